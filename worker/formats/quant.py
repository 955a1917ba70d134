"""ggml block quantization (Q8_0, Q4_1) in numpy.

Owns the byte layout of quantized weights. Pure functions, no state: the backend thread dequantizes,
tests and tools quantize. Blocks are little-endian, 32 weights each, rows are runs of blocks along the
innermost axis, so a quantized tensor is a uint8 array (..., nblocks * bytes_per_block) whose
dequantized shape is (..., nblocks * 32)::

    q8_0  34 bytes: | d: f16 | q[0..31]: int8 |                          w[j] = d * q[j]
    q4_1  20 bytes: | d: f16 | m: f16 | qs[0..15]: u8 |                  w[j] = d * (qs[j] & 0xF) + m
                                                                         w[j + 16] = d * (qs[j] >> 4) + m

Dequantizing reads the blocks through a structured dtype (no per-block Python loop) and works in chunks
of :data:`CHUNK_BLOCKS` blocks so the small integer temporaries stay in cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from ...broker.ops import QUANT_BLOCKS

__all__ = ["BLOCK", "CHUNK_BLOCKS", "dequantize", "dequantized_shape", "quantize"]

#: qtype -> (elements per block, bytes per block).
BLOCK: Final[dict[str, tuple[int, int]]] = dict(QUANT_BLOCKS)
#: Blocks dequantized per step (2 MiB of float32 output).
CHUNK_BLOCKS: Final = 16384

_LAYOUT: Final = {
    "q8_0": np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    "q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
}

_SCALES: Final = {"q8_0": ("d",), "q4_1": ("d", "m")}

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def _block(qtype: str) -> tuple[int, int]:
    if qtype not in BLOCK:
        raise ValueError(f"unknown qtype {qtype!r} (expected one of {sorted(BLOCK)})")
    return BLOCK[qtype]


def dequantized_shape(shape: tuple[int, ...], qtype: str) -> tuple[int, ...]:
    """Shape of the float32 result of dequantizing a uint8 array of ``shape``."""
    per_block, block_bytes = _block(qtype)
    if not shape or shape[-1] % block_bytes:
        raise ValueError(f"{qtype} data needs a last dim that is a multiple of {block_bytes}, got shape {shape}")
    return shape[:-1] + (shape[-1] // block_bytes * per_block,)


def _check_out(out: np.ndarray | None, shape: tuple[int, ...]) -> F32:
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}, got {out.dtype} {out.shape}")
    return out


def dequantize(data: np.ndarray, qtype: str, out: np.ndarray | None = None) -> F32:
    """Dequantize uint8 blocks (..., nb * bytes_per_block) into float32 (..., nb * 32).

    ``out``, when given, must be C-contiguous float32 of the result shape and is returned.
    Raises ValueError for an unknown qtype, a non-uint8 array or a ragged last dim.
    """
    if data.dtype != np.uint8:
        raise ValueError(f"quantized data must be uint8, got {data.dtype}")
    result = _check_out(out, dequantized_shape(data.shape, qtype))
    blocks = np.ascontiguousarray(data).reshape(-1).view(_LAYOUT[qtype])
    dst = result.reshape(-1, BLOCK[qtype][0])
    kernel = _DEQUANT[qtype]
    for start in range(0, len(blocks), CHUNK_BLOCKS):
        kernel(blocks[start:start + CHUNK_BLOCKS], dst[start:start + CHUNK_BLOCKS])
    return result


def _dequant_q8_0(blocks: np.ndarray, dst: F32) -> None:
    np.copyto(dst, blocks["qs"], casting="unsafe")
    dst *= blocks["d"].astype(np.float32)[:, None]


def _dequant_q4_1(blocks: np.ndarray, dst: F32) -> None:
    qs = np.ascontiguousarray(blocks["qs"])  # unpacking contiguous bytes is faster than via the records
    q = np.empty(dst.shape, np.uint8)
    np.bitwise_and(qs, 0x0F, out=q[:, :16])
    np.right_shift(qs, 4, out=q[:, 16:])
    np.copyto(dst, q, casting="unsafe")
    dst *= blocks["d"].astype(np.float32)[:, None]
    dst += blocks["m"].astype(np.float32)[:, None]


_DEQUANT: Final[dict[str, Callable[[np.ndarray, F32], None]]] = {"q8_0": _dequant_q8_0, "q4_1": _dequant_q4_1}


def quantize(x: np.ndarray, qtype: str) -> U8:
    """Quantize float values (..., n * 32) into uint8 blocks (..., n * bytes_per_block).

    Follows ggml's reference quantizers (``quantize_row_q8_0_ref``, ``quantize_row_q4_1_ref``): scales
    are computed in float32 and stored as float16, q8_0 rounds half away from zero. One deviation: a
    block whose float16 scale rounds to 0 gets all-zero quants (ggml writes quants the zero scale
    discards anyway), so requantizing a dequantized tensor is stable. Raises ValueError for a ragged
    last dim, non-finite input, or values whose scale (or q4_1 minimum) does not fit in float16.
    """
    per_block, block_bytes = _block(qtype)
    values = np.asarray(x, dtype=np.float32)
    if values.ndim == 0 or values.shape[-1] % per_block:
        raise ValueError(f"last dim must be a multiple of {per_block}, got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("cannot quantize NaN or infinite values")
    blocks = np.empty(values.size // per_block, _LAYOUT[qtype])
    with np.errstate(all="ignore"):  # 1/d of a tiny d overflows; those blocks get zero quants
        _QUANT[qtype](values.reshape(-1, per_block), blocks)
    if not all(np.isfinite(blocks[name]).all() for name in _SCALES[qtype]):
        raise ValueError(f"values too large for {qtype}: a block scale overflows float16")
    return blocks.view(np.uint8).reshape(values.shape[:-1] + (values.shape[-1] // per_block * block_bytes,))


def _inverse(d: F32) -> F32:
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    return inv


def _quant_q8_0(x: F32, blocks: np.ndarray) -> None:
    d = np.abs(x).max(axis=1) / np.float32(127)
    blocks["d"] = d
    scaled = x * _inverse(d)[:, None]
    q = np.copysign(np.floor(np.abs(scaled) + np.float32(0.5)), scaled)  # roundf: half away from zero
    q[blocks["d"] == 0] = 0
    blocks["qs"] = q


def _quant_q4_1(x: F32, blocks: np.ndarray) -> None:
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / np.float32(15)
    blocks["d"], blocks["m"] = d, lo
    q = np.floor((x - lo[:, None]) * _inverse(d)[:, None] + np.float32(0.5))
    q[blocks["d"] == 0] = 0
    q = np.minimum(q, 15).astype(np.uint8)
    blocks["qs"] = q[:, :16] | (q[:, 16:] << 4)


_QUANT: Final[dict[str, Callable[[F32, np.ndarray], None]]] = {"q8_0": _quant_q8_0, "q4_1": _quant_q4_1}
