"""``python -m zmq_rpc.worker.kernels [--threads N] [QTYPE ...]``: compile the quantized kernels ahead.

Compiles (or loads from numba's on-disk cache) the kernels of the given packed types (default: all
ten) for ``--threads`` (1: the single-thread bodies; more: the row-splitting versions too), and
prints the seconds each took. ``run.py`` runs it once after installing, so that no model load on
this machine pays the first compile (tens of seconds of CPU for all types: docs/MODELS.md); a worker that finds the cache
cold still compiles a model's types at its load (:data:`~zmq_rpc.client.llama.load.KERNEL_TIMEOUT`).
Runs in its own process, main thread.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import QTYPES, available, set_threads, warm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zmq_rpc.worker.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("qtypes", nargs="*", metavar="QTYPE", help=f"packed types (default: all of {', '.join(QTYPES)})")
    ap.add_argument("--threads", type=int, default=1, help="thread count to compile for (default 1)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.qtypes) - set(QTYPES))
    if unknown:
        ap.error(f"unknown qtype(s) {', '.join(unknown)} (expected some of {', '.join(QTYPES)})")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if not available():
        print("kernels: numba is not installed (pip install 'zmq-rpc[llm]'): nothing to compile", file=sys.stderr)
        return 1
    set_threads(args.threads)
    start = time.perf_counter()
    for qtype in args.qtypes or QTYPES:
        print(f"{qtype}: {warm(qtype):.2f} s", flush=True)
    print(f"all: {time.perf_counter() - start:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
