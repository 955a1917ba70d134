"""Quantized matmul kernels for the CPU worker: packed weights (:mod:`.layout`) times float32 activations.

Owned by the worker's backend thread (module state: the thread count and the set of warmed qtypes).
:func:`matmul` picks the path by the number of activation rows:

- up to :data:`MATVEC_ROWS` rows (decode): one numba matrix-vector pass per row over the packed bytes
  (:mod:`.jit`), reading each weight byte once;
- more rows (prefill): the packed rows are dequantized tile by tile into a float32 scratch of about
  :data:`TILE_BYTES` (stays in L2), transposed so the dequantizer writes with unit stride, and each tile
  goes through BLAS (``x @ tile``).

numba is an optional dependency (the ``llm`` extra): :func:`available` says whether it imports;
packing is plain numpy and works without it, the products raise :class:`KernelUnavailable`.
"""

from __future__ import annotations

import importlib.util
import time
from types import ModuleType
from typing import Final

import numpy as np

from .layout import PACKED, QTYPES, gguf_row_bytes, pack, packed_row_bytes

__all__ = [
    "MATVEC_ROWS",
    "PACKED",
    "QTYPES",
    "TILE_BYTES",
    "KernelUnavailable",
    "available",
    "dequantize",
    "gguf_row_bytes",
    "matmul",
    "pack",
    "packed_row_bytes",
    "set_threads",
    "take_rows",
    "threads",
    "warm",
]

MATVEC_ROWS: Final = 2
"""Activation rows up to which :func:`matmul` runs matrix-vector passes instead of tiles + BLAS."""
TILE_BYTES: Final = 1 << 20
"""float32 bytes of dequantized weights per prefill tile."""

_state: dict[str, int] = {"threads": 1}
_warm: dict[str, float] = {}


class KernelUnavailable(RuntimeError):
    """The packed kernels need numba, which does not import here."""


def available() -> bool:
    """Whether numba can be imported (checked without importing it)."""
    return importlib.util.find_spec("numba") is not None


def _jit() -> ModuleType:
    if not available():
        raise KernelUnavailable("quantized matmul kernels need numba: pip install 'zmq-rpc[llm]'")
    from . import jit
    return jit


def set_threads(n: int) -> None:
    """Split the rows of every product over ``n`` threads (numba's pool; >= 1)."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _state["threads"] = n


def threads() -> int:
    """Threads each product uses."""
    return _state["threads"]


def warm(qtype: str) -> float:
    """Compile (or load from the on-disk cache) the kernels of ``qtype`` for the current thread
    count, and the repack; seconds it took, 0 if done before."""
    key = f"{qtype}/{threads() > 1}"
    if key in _warm:
        return 0.0
    start = time.perf_counter()
    per_block, gguf_bytes, _ = PACKED[qtype]
    k = 256 if per_block == 256 else 32
    src = np.zeros((16, k), np.uint16) if per_block == 1 else np.zeros((16, k // per_block * gguf_bytes), np.uint8)
    w = pack(src, qtype)
    matmul(np.zeros((1, k), np.float32), w, qtype, np.empty((1, 16), np.float32))
    matmul(np.zeros((MATVEC_ROWS + 1, k), np.float32), w, qtype, np.empty((MATVEC_ROWS + 1, 16), np.float32))
    _warm[key] = time.perf_counter() - start
    return _warm[key]


def matmul(x: np.ndarray, w: np.ndarray, qtype: str, out: np.ndarray) -> None:
    """``out = x @ W.T`` for float32 ``x`` (T, K), packed ``w`` (R, P) and float32 ``out`` (T, R).

    ``w`` and ``out`` must be C-contiguous; ``x`` is made so. Raises KernelUnavailable without numba.
    """
    jit = _jit()
    n = threads()
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = w.shape[0], x.shape[1]
    if x.shape[0] <= MATVEC_ROWS:
        for t in range(x.shape[0]):
            if n == 1:
                jit.MV_ROWS[qtype](w, x[t], out[t], 0, rows)
            else:
                jit.MV[qtype](w, x[t], out[t], n)
        return
    step = min(rows, max(16, TILE_BYTES // (4 * k) // 16 * 16))
    tile = np.empty((k, step), np.float32)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        _dequantize_tile(jit, w, qtype, k, r0, r1, tile, n)
        np.matmul(x, tile[:, :r1 - r0], out=out[:, r0:r1])


def _dequantize_tile(jit: ModuleType, w: np.ndarray, qtype: str, k: int, r0: int, r1: int,
                     tile: np.ndarray, n: int) -> None:
    if n == 1:
        jit.DQ_ROWS[qtype](w, k, r0, r1, tile, r0)
    else:
        jit.DQ[qtype](w, k, r0, r1, tile, n)


def dequantize(w: np.ndarray, qtype: str, k: int, out: np.ndarray | None = None) -> np.ndarray:
    """Packed ``w`` as float32 rows (R, K), into ``out`` if given (tile by tile)."""
    rows = w.shape[0]
    result = np.empty((rows, k), np.float32) if out is None else out
    step = min(rows, max(16, TILE_BYTES // (4 * k) // 16 * 16))
    tile = np.empty((k, step), np.float32)
    jit = _jit()
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        _dequantize_tile(jit, w, qtype, k, r0, r1, tile, threads())
        result[r0:r1] = tile[:, :r1 - r0].T
    return result


def take_rows(w: np.ndarray, qtype: str, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = W[idx[i]]`` for packed ``w`` (indices already checked), float32 (len(idx), K)."""
    dq = _jit().DQ_ROWS[qtype]
    column = np.empty((out.shape[1], 1), np.float32)
    for i, r in enumerate(idx.tolist()):
        dq(w, out.shape[1], r, r + 1, column, r)
        out[i] = column[:, 0]
