"""The row split: run a kernel over disjoint row ranges on N threads at once (numba's OpenMP pool).

Owned by the worker's backend thread, the only caller (through ``kernels._rows``). The other
threads of a split are numba's OpenMP team: each runs the kernel on its own row range and touches
nothing but those rows of the output; the backend thread runs the first range itself and returns
when every range is done. No backend state is read or written outside the backend thread.

Why OpenMP. A decode product of a small llama takes tens of microseconds, so a split must cost
far less per parallel region than that: a ``ThreadPoolExecutor`` (a future per range, a futex
wake-up and the GIL per call) and numba's ``workqueue`` layer (condition variables) both made two
threads slower than one; the ``omp`` layer (GNU libgomp) is cheap per region because its threads
spin a while before they sleep, and the products of one decode step follow each other closely
enough to find them awake (the figures: docs/DESIGN.md, "Threads per product"). OpenMP is also
thread-safe (two backend threads in one process may split at once;
``workqueue`` aborts the process then). It needs libgomp (shipped with GCC, on every common Linux);
where it does not load, :func:`problem` says why and the products run on one thread (the caller
warns).

Two spinning pools. BLAS (OpenBLAS, numpy's) keeps its own threads for the prefill products and
the f32 mode. A thread that spins holds its CPU until the scheduler preempts it (milliseconds), so
each pool's spinning starves the other with both libraries' default spins (libgomp ~300k pauses,
OpenBLAS ~2^28 cycles): two threads then ran far slower than one. So this module makes libgomp spin :data:`SPINCOUNT` pauses (``GOMP_SPINCOUNT``, set before
libgomp loads unless the environment sets it), long enough to bridge the gaps between the products
of a decode step and short enough to leave the CPU to BLAS soon after; the worker's CLI shortens
OpenBLAS's spin alike (``OPENBLAS_THREAD_TIMEOUT``, :data:`~zmq_rpc.worker.cli.BLAS_THREAD_TIMEOUT`).

Use: :func:`run` ``(kernel, head, lo, hi, tail, n)`` calls ``kernel(*head, a, b, *tail)`` for
``n`` ranges ``a..b`` of ``lo..hi`` (:func:`cuts`: inner bounds on multiples of :data:`ALIGN` rows
from ``lo``, so vector sweeps of 16 rows never straddle two threads), at once. ``kernel`` is a
numba dispatcher compiled with ``nogil=True`` whose rows ``a..b`` write only rows ``a..b`` of its
output, with a parallel wrapper in :data:`PARALLEL` (the matrix-vector and dequantization kernels
of :mod:`.jit`, :mod:`.intdot`, :mod:`.unpackdot` and :mod:`.intgemm` here; a new kernel adds its own with
:func:`register`). The wrappers are compiled on first use and cached on disk like the kernels
(``cache=True``: compiled once, loaded in milliseconds after). numba keys each cached
function on its own file's time stamp only: a wrapper here holds the kernel it calls, so after
editing a kernel in place (a developer's checkout; an install rewrites every file) clear the
``__pycache__`` beside these files, or the wrappers keep running the old kernel (a change of a
kernel's packed layout, such as the K-quants' codes going by fours, then reads the new bytes the
old way: wrong products, not an error; so a commit that changes a kernel also touches this file,
whose new time stamp recompiles every wrapper). A split changes
no output bit: each output's arithmetic is its kernel's, whichever thread runs it (the products'
batch invariance, ``kernels/__init__``).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

import numba as _numba
import numpy as np
from numba import njit, prange

from . import amxgemm, halfgemm, intdot, intgemm, jit, unpackdot, unpacked

numba: Any = _numba      # numba's config and thread functions are untyped

__all__ = ["ALIGN", "LAYER", "PARALLEL", "SPINCOUNT", "available", "cuts", "problem", "register", "run", "team"]

ALIGN: Final = 16
"""Inner range bounds are multiples of this many rows from the first row."""
LAYER: Final = os.environ.get("NUMBA_THREADING_LAYER") or "omp"
"""numba's threading layer for the split: ``omp`` unless ``NUMBA_THREADING_LAYER`` names another
(only the thread-safe ``omp`` and ``tbb`` are used; anything else counts as unavailable)."""

SPINCOUNT: Final = os.environ.get("GOMP_SPINCOUNT") or "10000"
"""Pauses a libgomp thread spins before it sleeps (``GOMP_SPINCOUNT``; libgomp's own default is
300000, milliseconds: see the module docstring)."""

if not os.environ.get("NUMBA_THREADING_LAYER"):
    numba.config.THREADING_LAYER = LAYER
os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)    # read by libgomp when it loads (first split)

_cuts: dict[tuple[int, int, int], np.ndarray] = {}
_state: dict[str, str | None] = {}
_local = threading.local()


def _parallel(fn: Any) -> Any:
    return njit(parallel=True, cache=True, nogil=True)(fn)


# ----------------------------------------------------------------------------- the wrappers
# One per kernel, written out: numba cannot cache a wrapper made by a factory (the closure's
# dispatcher pickles with a per-process id, so the cache key never matches twice). Each runs the
# ranges ``bounds[i]..bounds[i + 1]`` of one product, spread over the calling thread's team.


@_parallel
def _mv_q4(w: Any, x: Any, y: Any, b: Any, has_min: bool) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        intdot.mv_q4(w, x, y, b[i], b[i + 1], has_min)


@_parallel
def _mv_q8_0(w: Any, x: Any, y: Any, b: Any) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        intdot.mv_q8_0(w, x, y, b[i], b[i + 1])


@_parallel
def _mv_q5(w: Any, x: Any, y: Any, b: Any, has_min: bool) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        unpackdot.mv_q5(w, x, y, b[i], b[i + 1], has_min)


@_parallel
def _mv_kquant(w: Any, x: Any, y: Any, b: Any, five: bool) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        unpackdot.mv_kquant(w, x, y, b[i], b[i + 1], five)


@_parallel
def _mv_q6_k(w: Any, x: Any, y: Any, b: Any) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        unpackdot.mv_q6_k(w, x, y, b[i], b[i + 1])


@_parallel
def _mv_u16(w: Any, x: Any, y: Any, b: Any, bf16: bool) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        jit._mv_u16(w, x, y, b[i], b[i + 1], bf16)


@_parallel
def _dq_q4(w: Any, k: int, b: Any, out: Any, c0: int, has_min: bool) -> None:   # pragma: no cover
    for i in prange(b.shape[0] - 1):
        jit._dq_q4(w, k, b[i], b[i + 1], out, c0, has_min)


@_parallel
def _dq_q5(w: Any, k: int, b: Any, out: Any, c0: int, has_min: bool) -> None:   # pragma: no cover
    for i in prange(b.shape[0] - 1):
        jit._dq_q5(w, k, b[i], b[i + 1], out, c0, has_min)


@_parallel
def _dq_q8_0(w: Any, k: int, b: Any, out: Any, c0: int) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        jit._dq_q8_0(w, k, b[i], b[i + 1], out, c0)


@_parallel
def _dq_kquant(w: Any, k: int, b: Any, out: Any, c0: int, five: bool) -> None:   # pragma: no cover
    for i in prange(b.shape[0] - 1):
        jit._dq_kquant(w, k, b[i], b[i + 1], out, c0, five)


@_parallel
def _dq_q6_k(w: Any, k: int, b: Any, out: Any, c0: int) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        jit._dq_q6_k(w, k, b[i], b[i + 1], out, c0)


@_parallel
def _dq_u16(w: Any, k: int, b: Any, out: Any, c0: int, bf16: bool) -> None:   # pragma: no cover
    for i in prange(b.shape[0] - 1):
        jit._dq_u16(w, k, b[i], b[i + 1], out, c0, bf16)


@_parallel
def _gemm_q4(w: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, y: Any, b: Any,
             has_min: bool) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        intgemm.gemm_q4(w, xq1, xq2, dx, sq, sx, y, b[i], b[i + 1], has_min)


@_parallel
def _gemm_q8_0(w: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, y: Any,
               b: Any) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        intgemm.gemm_q8_0(w, xq1, xq2, dx, sq, sx, y, b[i], b[i + 1])


@_parallel
def _quantize_rows(x: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, b: Any) -> None:   # pragma: no cover
    for i in prange(b.shape[0] - 1):
        intgemm.quantize_rows_into(x, xq1, xq2, dx, sq, sx, b[i], b[i + 1])


@_parallel
def _gemm_unpacked(w: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, y: Any, b: Any,
                   kind: int) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        unpacked.gemm_unpacked(w, xq1, xq2, dx, sq, sx, y, b[i], b[i + 1], kind)


@_parallel
def _gemm_u16(w: Any, x: Any, y: Any, b: Any, bf16: bool) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        halfgemm.gemm_u16(w, x, y, b[i], b[i + 1], bf16)


@_parallel
def _gemm_amx(w: Any, xl: Any, y: Any, b: Any, bf16: bool, cfg: Any) -> None:   # pragma: no cover (compiled)
    for i in prange(b.shape[0] - 1):
        amxgemm.gemm_amx(w, xl, y, b[i], b[i + 1], bf16, cfg)


PARALLEL: dict[Any, Any] = {
    intdot.mv_q4: _mv_q4, intdot.mv_q8_0: _mv_q8_0, unpackdot.mv_q5: _mv_q5, unpackdot.mv_kquant: _mv_kquant,
    unpackdot.mv_q6_k: _mv_q6_k, jit._mv_u16: _mv_u16,
    jit._dq_q4: _dq_q4, jit._dq_q5: _dq_q5, jit._dq_q8_0: _dq_q8_0, jit._dq_kquant: _dq_kquant,
    jit._dq_q6_k: _dq_q6_k, jit._dq_u16: _dq_u16,
    intgemm.gemm_q4: _gemm_q4, intgemm.gemm_q8_0: _gemm_q8_0, unpacked.gemm_unpacked: _gemm_unpacked,
    intgemm.quantize_rows_into: _quantize_rows,
    halfgemm.gemm_u16: _gemm_u16, amxgemm.gemm_amx: _gemm_amx,
}
"""kernel -> its parallel wrapper: ``wrapper(*head, bounds, *tail)`` runs ``kernel(*head, a, b, *tail)``
over the ranges of ``bounds``. A new kernel (e.g. an integer GEMM) adds its own with :func:`register`."""


def register(kernel: Any, wrapper: Any) -> None:
    """Let :func:`run` split ``kernel``: ``wrapper(*head, bounds, *tail)`` must run
    ``kernel(*head, bounds[i], bounds[i + 1], *tail)`` for every ``i`` in a ``prange`` (compiled
    ``@njit(parallel=True, cache=True, nogil=True)``, written out as the ones above)."""
    PARALLEL[kernel] = wrapper


def cuts(lo: int, hi: int, n: int) -> np.ndarray:
    """``lo..hi`` in at most ``n`` non-empty ranges as bounds (int64, ``lo`` first, ``hi`` last): about
    equal, inner bounds on multiples of :data:`ALIGN` from ``lo``. Cached per ``(lo, hi, n)``."""
    key = (lo, hi, n)
    bounds = _cuts.get(key)
    if bounds is None:
        inner = [lo + (hi - lo) * t // n // ALIGN * ALIGN for t in range(1, n)]
        bounds = np.array(sorted({lo, hi, *(c for c in inner if lo < c < hi)}), np.int64)
        if len(_cuts) > 4096:
            _cuts.clear()
        _cuts[key] = bounds
    return bounds


def team(n: int) -> int:
    """Threads a split over ``n`` ranges runs on: ``n``, at most numba's pool (NUMBA_NUM_THREADS,
    by default the CPU count)."""
    return max(1, min(n, int(numba.config.NUMBA_NUM_THREADS)))


def run(kernel: Any, head: tuple[Any, ...], lo: int, hi: int, tail: tuple[Any, ...], n: int) -> None:
    """``kernel(*head, a, b, *tail)`` over ``n`` ranges ``a..b`` of ``lo..hi``, at once on
    :func:`team` ``(n)`` threads (this one and numba's pool); returns when all are done. Needs
    :func:`available` and ``kernel`` in :data:`PARALLEL`."""
    size = team(n)
    if getattr(_local, "team", 0) != size:     # numba's team size is per calling thread
        numba.set_num_threads(size)
        _local.team = size
    PARALLEL[kernel](*head, cuts(lo, hi, n), *tail)


@njit(parallel=True, cache=True, nogil=True)
def _probe(out: Any) -> None:   # pragma: no cover (compiled)
    for i in prange(out.shape[0]):
        out[i] = i


def available() -> bool:
    """Whether the split can run: the first call starts numba's thread pool on :data:`LAYER` (a
    thread-safe layer: ``omp`` or ``tbb``); False where it does not load (see :func:`problem`)."""
    return problem() is None


def problem() -> str | None:
    """Why the split cannot run (None when it can), decided once per process."""
    if "problem" not in _state:
        _state["problem"] = _start()
    return _state["problem"]


def _start() -> str | None:
    if LAYER not in ("omp", "tbb"):
        return f"NUMBA_THREADING_LAYER={LAYER} is not a thread-safe layer (omp or tbb)"
    try:
        _probe(np.zeros(2, np.int64))
    except (ValueError, ImportError, OSError) as exc:
        return f"numba's {LAYER} threading layer does not load ({exc})"
    layer = numba.threading_layer()
    if layer not in ("omp", "tbb"):
        return f"numba runs its {layer} threading layer, not a thread-safe one"
    return None

