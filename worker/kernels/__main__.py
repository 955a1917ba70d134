"""``python -m zmq_rpc.worker.kernels [--threads N] [--aot] [QTYPE ...]``: compile the quantized kernels ahead.

Compiles (or loads from numba's on-disk cache) the kernels of the given packed types (default: all
ten) for ``--threads`` (1: the single-thread bodies; more: the row-splitting versions too), and
prints the seconds each took. ``run.py`` runs it once after installing, so that no model load on
this machine pays the first compile (tens of seconds of CPU for all types: docs/MODELS.md); a worker that finds the cache
cold still compiles a model's types at its load (:data:`~zmq_rpc.client.llama.load.KERNEL_TIMEOUT`).
Runs in its own process, main thread.

``--aot`` then builds them, and the fused ops, into one extension module for this machine
(:mod:`.aotbuild`; about two minutes of CPU once), which workers load without numba (:mod:`.aot`).

``--path avx2|portable`` compiles instead the products (decode and prefill) of another CPU's integer
path (:data:`.intdot.PATH_TARGETS`; default types :data:`.intdot.PATH_QTYPES`) into that path's own
cache (:func:`.intdot.path_cache`), in a child process told to (numba reads the target at import):
what tests/test_kernels.py compares bit for bit with this CPU's path, about 95 s of CPU (portable,
on a fresh clone) that ``run.py``'s setup pays once instead of the test. Nothing to do, and exit 0,
where the path is this CPU's own or the CPU cannot run it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from . import QTYPES, available, set_threads, warm, warm_products

PATHS = ("avx2", "portable")
"""The values of ``--path`` (:data:`.intdot.PATH_TARGETS`: importing it would import numba)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zmq_rpc.worker.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("qtypes", nargs="*", metavar="QTYPE", help=f"packed types (default: all of {', '.join(QTYPES)})")
    ap.add_argument("--threads", type=int, default=1, help="thread count to compile for (default 1)")
    ap.add_argument("--path", choices=PATHS, default="",
                    help="compile another CPU's integer path instead, into its own cache (default types: "
                         "one per bound of its sums, as tests/test_kernels.py compares them)")
    ap.add_argument("--aot", action="store_true",
                    help="then build them ahead of time, into a module workers load without numba")
    ap.add_argument("--in-path", action="store_true", help=argparse.SUPPRESS)   # the child of --path
    args = ap.parse_args(argv)
    unknown = sorted(set(args.qtypes) - set(QTYPES))
    if unknown:
        ap.error(f"unknown qtype(s) {', '.join(unknown)} (expected some of {', '.join(QTYPES)})")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if not available():
        print("kernels: numba is not installed (pip install 'zmq-rpc[llm]'): nothing to compile", file=sys.stderr)
        return 1
    if args.path:
        return _other_path(args.path, args.qtypes, args.in_path)
    set_threads(args.threads)
    start = time.perf_counter()
    for qtype in args.qtypes or QTYPES:
        print(f"{qtype}: {warm(qtype):.2f} s", flush=True)
    if args.aot:
        from .aotbuild import build
        try:
            build()
        except RuntimeError as exc:      # numba's cache is compiled: workers load from it instead
            print(f"aot: not built ({exc}); workers will load numba's kernels", flush=True)
    print(f"all: {time.perf_counter() - start:.2f} s", flush=True)
    return 0


def _other_path(path: str, qtypes: list[str], child: bool) -> int:
    """``--path``: in this process when it is the child told to compile ``path``, else start that child."""
    from . import intdot
    if child:
        assert intdot.PATH == path, f"compiling for {intdot.PATH}, expected {path}"
        start = time.perf_counter()
        for qtype in qtypes or intdot.PATH_QTYPES:
            print(f"{path} {qtype}: {warm_products(qtype):.2f} s", flush=True)
        print(f"all: {time.perf_counter() - start:.2f} s", flush=True)
        return 0
    problem = intdot.path_problem(path)
    if problem is not None:
        print(f"{path}: nothing to compile: {problem}", flush=True)
        print("all: 0.00 s", flush=True)
        return 0
    return subprocess.run([sys.executable, "-m", "zmq_rpc.worker.kernels", "--path", path, "--in-path", *qtypes],
                          env={**os.environ, **intdot.path_env(path)}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
