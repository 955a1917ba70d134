"""Quantized matmul kernels for the CPU worker: packed weights (:mod:`.layout`) times float32 activations.

Owned by the worker's backend thread (module state: the thread count, the set of warmed qtypes);
:func:`preload` may run on a thread of its own beside it (``--preload-kernels``), and touches only
what :func:`fused_kernels` warms under its lock.
:func:`matmul` picks the path by the number of activation rows:

- up to :data:`MATVEC_ROWS` rows (decode): one numba matrix-vector pass per row over the packed bytes
  (:mod:`.jit`; the block types' integer passes: :mod:`.intdot`, :mod:`.unpackdot`), reading each
  weight byte once;
- more rows (prefill), the block types (q4_0 ... q6_k, :data:`INTEGER_GEMM`): the rows of ``x`` rounded
  to int8 once (split over the threads by rows, as the products), then an integer GEMM that unpacks
  each block of codes once for many rows (:mod:`.intgemm`; q5_x and the K-quants through a
  per-block scratch, :mod:`.unpacked`);
- more rows, f16/bf16 (:data:`HALF_GEMM`): AMX tiles (:mod:`.amxgemm`: activations split into three
  exact bf16 levels, float32-accurate), or where this process cannot use AMX an FMA kernel
  (:mod:`.halfgemm`); both read the weights at 16 bits and split over threads by rows like the
  integer GEMM;
- otherwise (no type today): the packed rows are dequantized tile by tile into a float32 scratch of
  about :data:`TILE_BYTES` (stays in L2), transposed so the dequantizer writes with unit stride, and
  each tile goes through BLAS (``x @ tile``).

With :func:`set_threads` ``n > 1`` each matrix-vector product, integer GEMM and f16/bf16 GEMM over at least
:data:`MIN_SPLIT_ROWS` rows per thread is split into ``n`` row ranges (:mod:`.split`: numba's OpenMP pool; inner bounds on
multiples of 16 rows): the backend thread runs the first range, ``n - 1`` pool threads the others,
at once (the kernels release the GIL). The pool threads touch nothing but their rows of the output
and no module state; the backend thread stays the only owner of everything else. Where the pool
cannot start (no libgomp), products run on one thread and a warning says why, once. The tile
path (:func:`dequantize`, row gathers, and prefill of a type without a GEMM) dequantizes on the
backend thread alone, and BLAS (pinned to ``n`` threads by the worker) multiplies: splitting the
dequantization too would hand the CPUs from numba's pool to BLAS's and back twice per tile, each
pool's idle spin delaying the other's start; that hand-off is also why the f16/bf16 GEMMs split by
rows like the integer ones rather than go through tiles + BLAS (docs/DESIGN.md, "Threads per
product").

Batch invariance (continuous batching: a sequence's logits must not depend on what shares its
batch, issue 27): each kernel computes an output from its activation row alone (rows are rounded
to int8 one by one; threads split the *weight* rows, on multiples of 16, so the per-output order
is fixed), so the question is only whether the one-row path (``B <= MATVEC_ROWS``) rounds like the
many-row one. :func:`batch_invariant` says where it does, and ``tests/test_kernels_batch.py``
checks every type at B = 1, 2, 3, 7, 16, 33 and every place of the row:

- q4_0, q4_1, q8_0: yes. :mod:`.intdot` rounds the activation block and its float sum as
  :func:`.intgemm.quantize_rows_into` does, and applies the scales per sub-block in the GEMM's
  order (``y = fma(float(isum), d * dx, y)``, then ``fma(m, sum x, y)``; the scalar tails as the
  GEMM's), so a decode row and the same row in a prefill are the same bits.
- q5_0, q5_1, q4_k, q5_k, q6_k: yes. :mod:`.unpackdot` rounds the row with the GEMM's own
  :func:`.intgemm.quantize_rows_into`, unpacks the codes with :mod:`.unpacked`'s IR (in registers,
  not through its scratch) and applies the scales and offsets with the GEMM pass's float
  operations in its order; rows past the last multiple of 16 run the GEMM itself.
- f16, bf16 without AMX: yes; both kernels are one FMA per weight and input, in input order.
  With AMX (:mod:`.amxgemm`, three bf16 levels), no.
- float32 weights (the ``matmul`` op, BLAS): no guarantee; BLAS picks kernels and blockings by
  shape (and threads), so a row's sums may be ordered differently at another B.

The batched engine (``client/llama/batch.py``, ``min_rows``) relies on the block types' promise
(:data:`INVARIANT_INTEGER`): a model whose products are all of these types steps one decoding
sequence as one row, any other never runs fewer than 3.

numba is an optional dependency (the ``llm`` extra): :func:`available` says whether it imports;
packing is plain numpy and works without it, the products raise :class:`KernelUnavailable`.

Where ``python -m zmq_rpc.worker.kernels --aot`` (``run.py``'s setup) built them, the same
kernels, machine code and bits, run from one extension module loaded without numba
(:mod:`.aot`, :func:`ahead`): about 15 ms and a few MiB, where numba's import and cached load
take 0.7-0.8 s and ~110 MiB stay resident. Only the row splits of ``set_threads(n > 1)`` are
numba's own (numba code calling numba's kernels), so with ``n > 1`` products run numba's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import numpy as np

from . import aot
from .aot import Compiled
from .layout import (
    PACKED,
    QTYPES,
    empty_rows,
    gguf_row_bytes,
    pack_numpy,
    packed_output,
    packed_row_bytes,
)

__all__ = [
    "HALF_GEMM",
    "INTEGER_GEMM",
    "MATVEC_ROWS",
    "PACKED",
    "QTYPES",
    "TILE_BYTES",
    "KernelUnavailable",
    "ahead",
    "available",
    "batch_invariant",
    "dequantize",
    "fused_kernels",
    "gguf_row_bytes",
    "matmul",
    "pack",
    "packed_row_bytes",
    "preload",
    "set_threads",
    "take_rows",
    "threads",
    "warm",
    "warm_fused",
    "warm_products",
]

MATVEC_ROWS: Final = 2
"""Activation rows up to which :func:`matmul` runs matrix-vector passes instead of tiles + BLAS."""
TILE_BYTES: Final = 1 << 20
"""float32 bytes of dequantized weights per prefill tile."""

INTEGER_GEMM: Final = frozenset({"q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"})
"""Types whose prefill products run the integer GEMM of :mod:`.intgemm` / :mod:`.unpacked` (the
others: tiles + BLAS)."""
INVARIANT_INTEGER: Final = INTEGER_GEMM
"""Block types whose decode kernels (:mod:`.intdot`, :mod:`.unpackdot`) round like their GEMM
(:mod:`.intgemm`, :mod:`.unpacked`): all of them."""
HALF_GEMM: Final = frozenset({"f16", "bf16"})
"""Types whose prefill products run :mod:`.amxgemm` (AMX tiles) or, on a CPU without AMX,
:mod:`.halfgemm` (FMA)."""

_state: dict[str, int] = {"threads": 1}
_warm: dict[str, float] = {}
_fused_lock = threading.Lock()
"""Held while the fused kernels warm: a second backend thread in the process (tests, benches)
that warmed them at the same time would meet compiling disabled by the first, mid-compile
(``RuntimeError: compilation disabled``, its graph failing)."""
_fused: list[Any] = []
_split: list[ModuleType | None] = []
_compiled: dict[str, Compiled | None] = {}
_ahead_lock = threading.Lock()
MIN_SPLIT_ROWS: Final = 64
"""A product is split over ``n`` threads only from ``n * MIN_SPLIT_ROWS`` rows on (below, a split
costs more than it saves)."""
_log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """The packed kernels need numba, which does not import here."""


def available() -> bool:
    """Whether numba can be imported (checked once, without importing it)."""
    if "numba" not in _state:
        _state["numba"] = int(importlib.util.find_spec("numba") is not None)
    return bool(_state["numba"])


def _require() -> None:
    if not available():
        raise KernelUnavailable("quantized matmul kernels need numba: pip install 'zmq-rpc[llm]'")


def _ahead() -> Compiled | None:
    """The kernels built ahead of time (:mod:`.aot`), loaded once: None where there are none
    (``python -m zmq_rpc.worker.kernels --aot`` builds them)."""
    if "ahead" in _compiled:
        return _compiled["ahead"]
    with _ahead_lock:       # the preload thread and the backend thread: one loads, once
        return _load_ahead() if "ahead" not in _compiled else _compiled["ahead"]


def _load_ahead() -> Compiled | None:
    """:func:`_ahead`'s load, under its lock; says in the log which kernels run."""
    _require()
    built = aot.load()
    if built is not None and built.gemm_amx is not None and not aot.request_amx():
        built = dataclasses.replace(built, gemm_amx=None, split_rows=None)
    _compiled["ahead"] = built
    if built is not None:
        _log.info("kernels: built ahead of time (%s)", aot.folder().name)
    else:       # the worker still runs: numba loads (or compiles) them, slower and larger
        _log.info("kernels: numba's (%s; python -m zmq_rpc.worker.kernels --aot builds them "
                  "ahead of time, once per install)", aot.disabled() or "none built for these sources")
    return built


def _numba() -> Compiled:
    """numba's kernels (imports numba: compiles, or loads them from its cache, at first use)."""
    if (found := _compiled.get("numba")) is None:
        _require()
        from . import amxgemm, halfgemm, intgemm, jit
        amx = amxgemm.available()
        found = _compiled["numba"] = Compiled(
            kernels=jit.KERNELS, gemm=intgemm.GEMM, pack=jit.PACK, quantize_rows_into=intgemm.quantize_rows_into,
            gemm_u16=halfgemm.gemm_u16, gemm_amx=amxgemm.gemm_amx if amx else None,
            split_rows=amxgemm.split_rows if amx else None, amx_config=amxgemm.CONFIG, fused=None)
    return found


def _kernels() -> Compiled:
    """The entry points products run: the built ones where they load and products run on one
    thread (the row splits, :mod:`.split`, are numba code that calls numba's kernels), else
    numba's. Raises KernelUnavailable without numba."""
    if _state["threads"] == 1 and (built := _ahead()) is not None:
        return built
    return _numba()


def ahead() -> bool:
    """Whether this process runs the kernels built ahead of time (:mod:`.aot`)."""
    return available() and _ahead() is not None


def pack(data: np.ndarray, qtype: str, out: np.ndarray | None = None, *, jit: bool = True) -> np.ndarray:
    """Repack one GGUF weight into the kernels' layout (:mod:`.layout`): ``(R, P)`` uint8, returned
    (``out`` if given). With numba (and ``jit``) a compiled loop does it (an order of magnitude faster);
    else numpy (:func:`.layout.pack_numpy`), the same bytes. Raises ValueError on a bad shape.

    Chosen here, not in :mod:`.layout`: the compiled loop (:mod:`.jit`) reads the layout's
    tables, so the layout must not import it back."""
    result = packed_output(data, qtype, out)
    if jit and available():
        kernel, flags, u16 = _kernels().pack[qtype]
        src = np.ascontiguousarray(data)
        kernel(src.view(np.uint16) if u16 else src, result, *flags)
        return result
    return pack_numpy(data, qtype, result)


def batch_invariant(qtype: str) -> bool:
    """Whether :func:`matmul` gives row ``i`` of ``X @ W.T`` bit for bit the same whatever the
    other rows of ``X`` and however many (module docstring, "Batch invariance")."""
    if qtype in INVARIANT_INTEGER:
        return True
    return qtype in HALF_GEMM and _kernels().gemm_amx is None


def _half_gemm(x: np.ndarray, w: np.ndarray, qtype: str,
               out: np.ndarray) -> tuple[Callable[..., None], tuple[Any, ...], tuple[Any, ...]]:
    """(kernel, head, tail) of an f16/bf16 prefill product: AMX where this process may use it (asked
    once), else the FMA kernel."""
    bf16, compiled = qtype == "bf16", _kernels()
    if compiled.gemm_amx is not None and compiled.split_rows is not None:
        return compiled.gemm_amx, (w, compiled.split_rows(x), out), (bf16, compiled.amx_config)
    return compiled.gemm_u16, (w, x, out), (bf16,)


def fused_kernels() -> Any:
    """The kernels of the small per-token ops (:mod:`.fused`; those built ahead of time where
    they load) as attributes, or None without numba (the callers then run their numpy
    composition)."""
    if not _fused:
        if not available():
            return None
        with _fused_lock:       # workers in one process: one warms, the others wait for it
            if not _fused and (built := _ahead()) is not None:
                _warm["fused"] = 0.0
                _fused.append(built.fused)
            if not _fused:
                from . import fused as module
                start = time.perf_counter()
                _warm_fused(module)
                _warm["fused"] = time.perf_counter() - start
                _fused.append(module)
    return _fused[0]


def preload() -> float:
    """Load the kernels built ahead of time, or numba and the fused kernels from numba's on-disk
    cache (compiled there once per machine): what a model's first lay-out would otherwise wait
    for on the backend thread
    (``zmq-rpc-worker --preload-kernels`` runs this on a thread of its own as the worker
    starts). Safe beside the backend thread: :func:`fused_kernels` holds its lock while it
    warms, and nothing else here is touched (each type's products still load at its first
    lay-out, on the backend thread). Seconds it took; 0 without numba."""
    start = time.perf_counter()
    if fused_kernels() is None:
        return 0.0
    return time.perf_counter() - start


def set_threads(n: int) -> None:
    """Split the rows of every product over ``n`` threads (>= 1): this one and ``n - 1`` helpers."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _state["threads"] = n


def threads() -> int:
    """Threads a large product is split over (back to 1 once a split found no thread pool)."""
    return _state["threads"]


def _splitter() -> ModuleType | None:
    """:mod:`.split` once its thread pool started; None where it cannot (a warning says why,
    once, and the thread count drops to 1)."""
    if not _split:
        from . import split
        problem = split.problem()
        if problem is not None:
            _log.warning("kernels: %s: products run on one thread", problem)
        _split.append(split if problem is None else None)
    if _split[0] is None:
        _state["threads"] = 1
    return _split[0]


def _rows(kernel: Callable[..., None], head: tuple[Any, ...], lo: int, hi: int,
          tail: tuple[Any, ...]) -> None:
    """``kernel(*head, a, b, *tail)`` over the rows ``lo..hi``: in this thread, or split over
    :func:`threads` threads (:mod:`.split`)."""
    n = _state["threads"]
    if n == 1 or hi - lo < MIN_SPLIT_ROWS * n or (splitter := _splitter()) is None:
        kernel(*head, lo, hi, *tail)
        return
    splitter.run(kernel, head, lo, hi, tail, n)


def warm(qtype: str) -> float:
    """Compile (or load from the on-disk cache) the kernels of ``qtype`` and the repack; seconds it
    took, 0 if done before in this process."""
    if qtype in _warm:
        return 0.0
    start = time.perf_counter()
    w, k = _warm_products(qtype)
    dequantize(w, qtype, k)          # the tile dequantizer: prefill of the other types, row gathers, unpack
    if _state["threads"] > 1 and (splitter := _splitter()) is not None:
        _warm_split(splitter, w, qtype, k)
    warm_fused()
    _warm[qtype] = time.perf_counter() - start
    return _warm[qtype]


def warm_products(qtype: str) -> float:
    """Compile (or load) only the repack and the one-thread products of ``qtype`` (decode and
    prefill), not the dequantizer, row splits or fused kernels of :func:`warm`; seconds it took.
    What ``python -m zmq_rpc.worker.kernels --path`` compiles for another CPU's path."""
    start = time.perf_counter()
    _warm_products(qtype)
    return time.perf_counter() - start


def _warm_products(qtype: str) -> tuple[np.ndarray, int]:
    """Run the repack and a decode and a prefill product of ``qtype`` on zeros; the packed weight
    (16 rows) and its row length."""
    per_block, gguf_bytes, _ = PACKED[qtype]
    k = 256 if per_block == 256 else 32
    src = np.zeros((16, k), np.uint16) if per_block == 1 else np.zeros((16, k // per_block * gguf_bytes), np.uint8)
    w = pack(src, qtype)
    matmul(np.zeros((1, k), np.float32), w, qtype, np.empty((1, 16), np.float32))
    matmul(np.zeros((MATVEC_ROWS + 1, k), np.float32), w, qtype, np.empty((MATVEC_ROWS + 1, 16), np.float32))
    return w, k


def _warm_split(splitter: ModuleType, w: np.ndarray, qtype: str, k: int) -> None:
    """Compile (or load) the parallel wrappers of ``qtype``'s kernels (:mod:`.split`)."""
    mv, dq, flags = _numba().kernels[qtype]
    rows = w.shape[0]
    splitter.run(mv, (w, np.zeros(k, np.float32), np.empty(rows, np.float32)), 0, rows, flags, 2)
    splitter.run(dq, (w, k), 0, rows, (np.empty((k, rows), np.float32), 0, *flags), 2)
    if qtype in INTEGER_GEMM:
        compiled = _numba()
        gemm, gemm_flags = compiled.gemm[qtype]
        x = np.zeros((MATVEC_ROWS + 1, k), np.float32)
        xq = empty_rows(*x.shape)
        splitter.run(compiled.quantize_rows_into, (x, *xq), 0, x.shape[0], (), 2)
        splitter.run(gemm, (w, *xq, np.empty((MATVEC_ROWS + 1, rows), np.float32)), 0, rows, gemm_flags, 2)
    if qtype in HALF_GEMM:
        x, y = np.zeros((MATVEC_ROWS + 1, k), np.float32), np.empty((MATVEC_ROWS + 1, rows), np.float32)
        kernel, head, tail = _half_gemm(x, w, qtype, y)
        splitter.run(kernel, head, 0, rows, tail, 2)


def warm_fused() -> float:
    """Compile (or load from the on-disk cache) the fused small-op kernels (:mod:`.fused`) for the
    layouts a llama graph gives them; seconds it took, 0 if done before in this process or
    without numba."""
    if "fused" in _warm or fused_kernels() is None:
        return 0.0
    return _warm["fused"]


def matmul(x: np.ndarray, w: np.ndarray, qtype: str, out: np.ndarray) -> None:
    """``out = x @ W.T`` for float32 ``x`` (T, K), packed ``w`` (R, P) and float32 ``out`` (T, R).

    ``w`` and ``out`` must be C-contiguous; ``x`` is made so. Raises KernelUnavailable without numba.
    """
    compiled = _kernels()
    mv, dq, flags = compiled.kernels[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = w.shape[0], x.shape[1]
    if x.shape[0] == 1:    # a decode step
        if _state["threads"] == 1:
            mv(w, x[0], out[0], 0, rows, *flags)
        else:
            _rows(mv, (w, x[0], out[0]), 0, rows, flags)
        return
    if x.shape[0] <= MATVEC_ROWS:
        for t in range(x.shape[0]):
            _rows(mv, (w, x[t], out[t]), 0, rows, flags)
        return
    if qtype in INTEGER_GEMM:
        gemm, gemm_flags = compiled.gemm[qtype]
        xq = empty_rows(*x.shape)      # x rounded once; a long prefill's rows split too
        _rows(compiled.quantize_rows_into, (x, *xq), 0, x.shape[0], ())
        _rows(gemm, (w, *xq, out), 0, rows, gemm_flags)
        return
    if qtype in HALF_GEMM:
        kernel, head, tail = _half_gemm(x, w, qtype, out)
        _rows(kernel, head, 0, rows, tail)
        return
    step = _tile_rows(rows, k)
    tile = np.empty((k, step), np.float32)
    for r0 in range(0, rows, step):     # one thread dequantizes, BLAS has the others (module docstring)
        r1 = min(r0 + step, rows)
        dq(w, k, r0, r1, tile, r0, *flags)
        np.matmul(x, tile[:, :r1 - r0], out=out[:, r0:r1])


def _tile_rows(rows: int, k: int) -> int:
    """Rows per prefill tile: about TILE_BYTES of float32, a multiple of 16, at least 16."""
    return min(rows, max(16, TILE_BYTES // (4 * k) // 16 * 16))


def dequantize(w: np.ndarray, qtype: str, k: int, out: np.ndarray | None = None) -> np.ndarray:
    """Packed ``w`` as float32 rows (R, K), into ``out`` if given (tile by tile)."""
    _, dq, flags = _kernels().kernels[qtype]
    rows = w.shape[0]
    result = np.empty((rows, k), np.float32) if out is None else out
    step = _tile_rows(rows, k)
    tile = np.empty((k, step), np.float32)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        _rows(dq, (w, k), r0, r1, (tile, r0, *flags))
        result[r0:r1] = tile[:, :r1 - r0].T
    return result


def take_rows(w: np.ndarray, qtype: str, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = W[idx[i]]`` for packed ``w`` (indices already checked), float32 (len(idx), K)."""
    _, dq, flags = _kernels().kernels[qtype]
    column = np.empty((out.shape[1], 1), np.float32)
    for i, r in enumerate(idx.tolist()):
        dq(w, out.shape[1], r, r + 1, column, r, *flags)
        out[i] = column[:, 0]


def _warm_fused(module: ModuleType) -> None:
    """Compile (or load) the fused small-op kernels for the one signature each is called with
    (C-contiguous float32 arrays; rope's positions int32 or int64), then forbid compiling: a
    graph whose arrays would need another specialization gets a TypeError, and its op runs the
    numpy composition, instead of holding the backend thread for seconds of compilation."""
    q, kv, out = np.zeros((1, 4, 4), np.float32), np.zeros((3, 1, 4), np.float32), np.zeros((1, 4, 4), np.float32)
    for cache in (kv, np.zeros(kv.shape, np.uint16)):      # float32 caches, float16 ones as bits
        module.attention(q, cache, cache, np.zeros((1, 3), np.float32), np.float32(0.5), out)
    for dtype in (np.int32, np.int64):
        module.rope(q, np.zeros(1, dtype), np.ones(2), False, 4, out)
    module.swiglu(np.zeros((1, 8), np.float32), np.zeros((1, 4), np.float32))
    module.rms_norm(np.zeros((1, 4), np.float32), np.float32(1e-5), np.zeros((1, 4), np.float32))
    rows = np.zeros(1, np.int32)
    for cache in (kv, np.zeros(kv.shape, np.uint16)):      # float32 caches, float16 ones as bits
        module.attend_rows(q, cache, cache, rows, rows, np.float32(0.5), 0, out)
    ints, floats = np.zeros(1, np.int32), np.ones(1, np.float32)
    module.sample_rows(np.zeros((1, 4), np.float32), floats, ints, floats, np.zeros(1, np.uint32), ints, ints)
    for kernel in (module.attention, module.attend_rows, module.rope, module.sample_rows, module.swiglu,
                   module.rms_norm):
        kernel.disable_compile()
