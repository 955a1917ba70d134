"""``zmq-rpc-bench``'s entry point: the package's own commands (:mod:`.builtin_commands`:
``generate``, ``load``, ``report``, ``status``) import only their module; anything else is the
benchmark (:mod:`.bench`, which loads numpy, the client and every case module first: ~0.3 s that
``generate`` would spend before it even started its workers).

Runs on the main thread of its own process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .builtin_commands import BUILTIN_COMMANDS


def main(argv: Sequence[str] | None = None) -> int:
    """``zmq-rpc-bench COMMAND ...`` for the package's own commands, else the benchmark's
    :func:`.bench.main`; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in BUILTIN_COMMANDS:
        return BUILTIN_COMMANDS[args[0]](args[1:])
    from .bench import main as bench_main
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
