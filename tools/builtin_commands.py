"""The package's own ``zmq-rpc-bench`` commands (``generate``, ``load``, ``report``, ``status``):
each imports its module when run. Read by the entry point (:mod:`.bench_command`), which runs
them without the benchmark's modules, and by :mod:`.bench` (its usage lists them). Imports
nothing on import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

BUILTIN_COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "load": lambda argv: importlib.import_module("zmq_rpc.tools.loadtest").main(list(argv)),
    # imported on use: it needs the model extras (gguf, tokenizers)
    "generate": lambda argv: importlib.import_module("zmq_rpc.tools.generate").main(list(argv)),
    "report": lambda argv: importlib.import_module("zmq_rpc.tools.report").report_command(
        list(argv)),
    "status": lambda argv: importlib.import_module("zmq_rpc.tools.status").main(
        list(argv), prog="zmq-rpc-bench status"),
}
"""Command name -> its ``main(argv)``."""
