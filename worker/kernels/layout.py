"""The packed weight layout the quantized kernels read, and the repack from GGUF blocks into it.

Owns the byte layout of *packed* weights. Pure numpy functions, no state: the worker's backend thread
packs a weight once when it is loaded (the ``pack`` graph op), tests pack to compare against ``gguf``.

Why a second layout. GGUF stores a weight row by row, each row a run of blocks (``worker/formats/quant.py``
draws the blocks). A matrix-vector kernel that walks a row's 16-byte block cannot be vectorized by LLVM
(the work per block is too short); one that, for each block and each byte position, sweeps over *all
rows at once* is: the inner loop reads consecutive bytes of consecutive rows and keeps one float32
accumulator per row. So the packed form is the GGUF data transposed to ``[block][byte][row]``, with the
float16 scales converted to float32 once (numba has no float16 scalar; except q4_0, q4_1, q8_0, whose
integer kernels convert 16 at once) and the nibbles regrouped so that every 4-bit type shares one inner
loop.

A packed weight of ``R`` rows and ``K`` inputs is a uint8 tensor ``(R, P)`` (``P`` = packed bytes per
row, :func:`packed_row_bytes`), but its bytes are *not* row-major: it is a sequence of sections, each a
C-contiguous array whose last axis is the row, float32 sections first, then uint32, then bytes (so every
section is aligned for its dtype when the tensor is 4-byte aligned). With ``nb`` blocks per row (``K/32``
or ``K/256``) and ``ns = K/32`` sub-blocks of 32 weights::

    f16, bf16  w    u16 [K, R]                      the weights, transposed (f16/bf16 bits unchanged)
    q8_0       d    f16 [nb, R]   0 [2nb*R]   q   i8 [nb*8, R, 4]                 w = d*q
    q4_0       d    f16 [nb, R]   0 [2nb*R]   p   u8 [ns*4, R, 4]                 w = d*(q - 8)
    q4_1       d, m f16 [nb, R]   0 [4nb*R]   p   u8 [ns*4, R, 4]                 w = d*q + m
    q5_0       d    f32 [nb, R]   h  u32 [ns, R]     p  u8 [ns*4, R, 4]           w = d*(q - 16)
    q5_1       d, m f32 [nb, R]   h  u32 [ns, R]     p  u8 [ns*4, R, 4]           w = d*q + m
    q4_k       d, dmin f32 [nb, R]  sc, mn u8 [ns, R]  p u8 [ns*4, R, 4]        w = d*sc*q - dmin*mn
    q5_k       d, dmin f32 [nb, R]  h u32 [ns, R]  sc, mn u8 [ns, R]  p u8 [ns*4, R, 4]   (same)
    q6_k       d    f32 [nb, R]   h  u8 [ns*2, R, 4]  sc i8 [ns*2, R]  p u8 [ns*4, R, 4]  w = d*sc*(q - 32)

``p`` (pairs): byte ``j`` of sub-block ``s`` holds the low 4 bits of weight ``32s + j`` in its low nibble
and those of weight ``32s + j + 16`` in its high nibble (Q4_0's own pairing; K-quants pair differently in
GGUF and are regrouped). Every block type stores these bytes *by fours*: byte
``4g + b`` (b < 4) of a sub-block's row sits at ``[4s + g, r, b]`` (q8_0: code ``32s + 4g + b`` at
``[8s + g, r, b]``; q6_k's ``p`` and ``h`` alike, column ``c`` of row ``r`` at ``[c // 4, r, c % 4]``), so
the 4 bytes one int32 lane of the integer kernels (:mod:`.intdot`, :mod:`.intgemm`, :mod:`.unpackdot`,
:mod:`.unpacked`) takes are adjacent, and 16 rows of them fill one 64-byte vector that one load brings
(stored column by column, the K-quants' decode spent a third of its instructions transposing 4 columns
of 16 rows into that vector: docs/DESIGN.md). q8_0, q4_0 and q4_1 (:data:`INTERLEAVED`) keep their
scales float16, as in GGUF (a decode
token reads 17% fewer bytes of q4_1: the kernels are bound by memory bandwidth); the bytes after them
(``0``: zeros, never read) keep the section offsets and the packed sizes of ``PACKED_BLOCKS`` (the
sizes clients allocate by) as they were with float32 scales. ``h``: the 5th bit of weight ``32s + j`` is bit
``8 (j % 4) + j // 4`` of ``h[s]`` (byte ``b`` of the word holds in its bit ``g`` the bit of weight ``4g + b``: the
lane of inputs ``4g..4g+3`` gets its 16s by one shift and one mask, :func:`.unpacked.sub_codes`). q6_k works
in its 16-weight scale groups ``g`` instead: byte ``8g + j`` (j < 8) of ``p`` pairs weights ``16g + j``
and ``16g + 8 + j`` (one accumulator per scale), and byte ``4g + j`` (j < 4) of ``h`` holds the 5th-6th
bits of weights ``16g + j``, ``16g + 8 + j``, ``16g + 4 + j``, ``16g + 12 + j`` in its bit pairs 0-1,
2-3, 4-5, 6-7, so one ``h`` byte serves two ``p`` bytes with constant shifts. K-quant ``sc``/``mn`` are the 6-bit sub-block scales and mins, ``d``/``dmin``
the super-block factors: one extra multiply per 32 weights instead of 8 bytes of float32 per sub-block,
which keeps every type within 1.1x its GGUF size except q4_1 (1.2x) and q5_1 (1.17x).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from ...broker.ops import PACKED_BLOCKS

__all__ = ["INTERLEAVED", "PACKED", "QTYPES", "gguf_row_bytes", "pack_numpy", "packed_output", "packed_row_bytes", "read_row_bytes",
           "unpack_codes"]

#: qtype -> (weights per GGUF block, GGUF bytes per block, packed bytes per block and row).
PACKED: Final[dict[str, tuple[int, int, int]]] = dict(PACKED_BLOCKS)
QTYPES: Final = tuple(PACKED)
INTERLEAVED: Final = frozenset({"q8_0", "q4_0", "q4_1"})
"""Types whose scales stay float16 and whose codes need no unpacking (the integer kernels of
:mod:`.intdot` and :mod:`.intgemm`; every block type's code bytes are stored by fours)."""

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]


def _geometry(qtype: str, k: int) -> tuple[int, int, int]:
    if qtype not in PACKED:
        raise ValueError(f"unknown packed qtype {qtype!r} (expected one of {list(PACKED)})")
    per_block, gguf_bytes, packed_bytes = PACKED[qtype]
    if k <= 0 or k % per_block:
        raise ValueError(f"{qtype} rows need a length that is a positive multiple of {per_block}, got {k}")
    return k // per_block, gguf_bytes, packed_bytes


def packed_row_bytes(qtype: str, k: int) -> int:
    """Bytes per row of a packed weight with ``k`` inputs."""
    nb, _, packed_bytes = _geometry(qtype, k)
    return nb * packed_bytes


def read_row_bytes(qtype: str, k: int) -> int:
    """Bytes per row that a matrix-vector product reads: the packed row but for the unused room
    after the INTERLEAVED types' float16 scales (those read as many bytes as GGUF stores)."""
    return gguf_row_bytes(qtype, k) if qtype in INTERLEAVED else packed_row_bytes(qtype, k)


def gguf_row_bytes(qtype: str, k: int) -> int:
    """Bytes per row of the GGUF form of a weight with ``k`` inputs."""
    nb, gguf_bytes, _ = _geometry(qtype, k)
    return nb * gguf_bytes


# ------------------------------------------------------------------------ GGUF blocks -> codes


def _f16(raw: U8) -> F32:
    """float32 values of little-endian float16 pairs of bytes (last axis 2 -> dropped)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: U8) -> U8:
    """(..., 16) bytes -> (..., 32) codes: low nibbles first, then high (Q4_0's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: U8, n: int) -> U8:
    """(..., n/8) bytes -> (..., n) bits, little-endian bit order."""
    return np.unpackbits(qh, axis=-1, count=n, bitorder="little")


def _k_scales(scales: U8) -> tuple[U8, U8]:
    """The 8 6-bit scales and mins packed in a K-quant's 12 bytes (ggml ``get_scale_min_k4``)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


Codes = tuple[np.ndarray, dict[str, np.ndarray]]
"""Integer codes (R, K) in natural order and the per-block factors (each (R, n))."""


def _codes_q8_0(b: U8) -> Codes:
    codes: np.ndarray = b[..., 2:].view(np.int8).reshape(b.shape[0], -1)
    return codes, {"d": _f16(b[..., :2])}


def _codes_q4_0(b: U8) -> Codes:
    return _nibbles(b[..., 2:]).reshape(b.shape[0], -1), {"d": _f16(b[..., :2])}


def _codes_q4_1(b: U8) -> Codes:
    return _nibbles(b[..., 4:]).reshape(b.shape[0], -1), {"d": _f16(b[..., :2]), "m": _f16(b[..., 2:4])}


def _codes_q5_0(b: U8) -> Codes:
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6], 32) << 4)
    return q.reshape(b.shape[0], -1), {"d": _f16(b[..., :2])}


def _codes_q5_1(b: U8) -> Codes:
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8], 32) << 4)
    return q.reshape(b.shape[0], -1), {"d": _f16(b[..., :2]), "m": _f16(b[..., 2:4])}


def _k4_low(qs: U8) -> U8:
    """Q4_K/Q5_K 128 bytes -> 256 low-nibble codes: 4 chunks of 32 bytes, low nibbles then high."""
    c = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([c & 0x0F, c >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _codes_q4_k(b: U8) -> Codes:
    sc, mn = _k_scales(b[..., 4:16])
    factors: dict[str, np.ndarray] = {"d": _f16(b[..., :2]), "dmin": _f16(b[..., 2:4]), "sc": sc, "mn": mn}
    return _k4_low(b[..., 16:]).reshape(b.shape[0], -1), factors


def _codes_q5_k(b: U8) -> Codes:
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    q = _k4_low(b[..., 48:]) | ((qh & 1) << 4).reshape(*b.shape[:-1], 256)
    factors: dict[str, np.ndarray] = {"d": _f16(b[..., :2]), "dmin": _f16(b[..., 2:4]), "sc": sc, "mn": mn}
    return q.reshape(b.shape[0], -1), factors


def _codes_q6_k(b: U8) -> Codes:
    lead = b.shape[:-1]
    shifted = b[..., :128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (shifted & 0x0F).reshape(*lead, 2, 4, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (ql | ((qh & 3) << 4)).reshape(*lead, 256)
    factors: dict[str, np.ndarray] = {"d": _f16(b[..., 208:210]), "sc": b[..., 192:208].view(np.int8)}
    return q.reshape(b.shape[0], -1), factors


_CODES: Final[dict[str, Callable[[U8], Codes]]] = {
    "q8_0": _codes_q8_0, "q4_0": _codes_q4_0, "q4_1": _codes_q4_1, "q5_0": _codes_q5_0,
    "q5_1": _codes_q5_1, "q4_k": _codes_q4_k, "q5_k": _codes_q5_k, "q6_k": _codes_q6_k,
}


def unpack_codes(data: U8, qtype: str) -> Codes:
    """GGUF blocks (R, row bytes) -> integer codes (R, K) and per-row block factors (R, n)."""
    _, gguf_bytes, _ = PACKED[qtype]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, gguf_bytes)
    codes, factors = _CODES[qtype](blocks)
    return codes, {k: v.reshape(rows, -1) for k, v in factors.items()}


# ------------------------------------------------------------------------- codes -> packed sections


def _pairs(codes: np.ndarray) -> np.ndarray:
    """(R, K) codes -> (K/2, R): byte j of sub-block s = low 4 bits of 32s+j | of 32s+j+16 << 4."""
    rows = codes.shape[0]
    c = (codes.astype(np.uint8) & 0x0F).reshape(rows, -1, 2, 16)
    p: np.ndarray = c[:, :, 0, :] | (c[:, :, 1, :] << 4)
    pairs: np.ndarray = p.reshape(rows, -1).T
    return pairs


def _high1(codes: np.ndarray) -> npt.NDArray[np.uint32]:
    """(R, K) 5-bit codes -> u32 (K/32, R): bit ``8 (j % 4) + j // 4`` = 5th bit of weight 32s+j."""
    rows = codes.shape[0]
    bits = ((codes.astype(np.uint8) >> 4) & 1).reshape(rows, -1, 8, 4).transpose(0, 1, 3, 2).reshape(rows, -1, 32)
    words: npt.NDArray[np.uint32] = np.packbits(bits, axis=-1, bitorder="little").view("<u4")[..., 0].T
    return words


def _high2(codes: np.ndarray) -> U8:
    """q6_k (R, K) 6-bit codes -> u8 (K/4, R): byte ``4g + j`` (j < 4) holds bits 5-6 of weights
    ``16g + j``, ``16g + 8 + j``, ``16g + 4 + j``, ``16g + 12 + j`` in bits 0-1, 2-3, 4-5, 6-7."""
    rows = codes.shape[0]
    hi = (codes.astype(np.uint8) >> 4).reshape(rows, -1, 2, 2, 4)   # [g, 8s, 4s, j]
    h = hi[:, :, 0, 0] | (hi[:, :, 1, 0] << 2) | (hi[:, :, 0, 1] << 4) | (hi[:, :, 1, 1] << 6)
    out: U8 = h.reshape(rows, -1).T
    return out


def _pairs16(codes: np.ndarray) -> U8:
    """q6_k (R, K) codes -> (K/2, R): byte ``8g + j`` (j < 8) = low 4 bits of ``16g + j`` | of ``16g + 8 + j`` << 4
    (both in one 16-weight scale group, so one accumulator per group)."""
    rows = codes.shape[0]
    c = (codes.astype(np.uint8) & 0x0F).reshape(rows, -1, 2, 8)
    pairs: U8 = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(rows, -1).T
    return pairs


def _by_fours(section: np.ndarray) -> np.ndarray:
    """(J, R) -> (J/4, R, 4): the 4 bytes ``4g..4g+3`` of each row side by side (every block type's codes)."""
    rows = section.shape[1]
    out: np.ndarray = section.reshape(-1, 4, rows).transpose(0, 2, 1)
    return out


def _half_scales(*scales: np.ndarray) -> list[np.ndarray]:
    """INTERLEAVED types' float16 scale sections (values that came from float16: exact), then the
    unused half of the float32 room the sizes give them."""
    bits = [v.astype(np.float16).view(np.uint16) for v in scales]
    return [*bits, *(np.zeros_like(b) for b in bits)]


def _sections(qtype: str, codes: np.ndarray, f: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The packed sections of one weight, in storage order (each with the row as last axis)."""
    t = {k: v.T for k, v in f.items()}
    if qtype == "q8_0":
        return [*_half_scales(t["d"]), _by_fours(codes.astype(np.int8).T)]
    if qtype == "q6_k":
        return [t["d"], _by_fours(_high2(codes)), t["sc"], _by_fours(_pairs16(codes))]
    scales = [t["d"], t["m"]] if "m" in t else [t["d"], t["dmin"]] if "dmin" in t else [t["d"]]
    high = [_high1(codes)] if qtype in ("q5_0", "q5_1", "q5_k") else []
    sub = [t["sc"], t["mn"]] if "sc" in t else []
    if qtype in INTERLEAVED:
        return [*_half_scales(*scales), _by_fours(_pairs(codes))]
    return scales + high + sub + [_by_fours(_pairs(codes))]


def packed_output(data: np.ndarray, qtype: str, out: np.ndarray | None = None) -> U8:
    """Check a GGUF weight's shape for :func:`pack_numpy` (and the compiled repack of
    :func:`zmq_rpc.worker.kernels.pack`) and return where its packed bytes go: ``out`` or a new
    ``(R, P)`` uint8 array. Raises ValueError on a bad shape."""
    if data.ndim != 2:
        raise ValueError(f"pack needs a 2-D weight, got shape {data.shape}")
    rows, per_block = data.shape[0], PACKED[qtype][0]
    k = data.shape[1] if per_block == 1 else data.shape[1] // PACKED[qtype][1] * per_block
    if per_block > 1 and gguf_row_bytes(qtype, k) != data.shape[1]:
        raise ValueError(f"{qtype} rows of {data.shape[1]} bytes are not whole blocks")
    return np.empty((rows, packed_row_bytes(qtype, k)), np.uint8) if out is None else out


def pack_numpy(data: np.ndarray, qtype: str, out: np.ndarray | None = None) -> U8:
    """Repack one weight into the layout above with numpy: ``(R, P)`` uint8, returned
    (``out`` if given). :func:`zmq_rpc.worker.kernels.pack` runs numba's compiled loop instead
    where it can (an order of magnitude faster, the same bytes).

    ``data`` is the GGUF form: uint8 blocks ``(R, nb * block_bytes)`` for block types, or the
    ``(R, K)`` weights for f16 (float16) and bf16 (uint16 bits). Raises ValueError on a bad shape.
    """
    result = packed_output(data, qtype, out)
    if qtype in ("f16", "bf16"):
        parts = [np.ascontiguousarray(data).view(np.uint16).T]
    else:
        parts = _sections(qtype, *unpack_codes(data.view(np.uint8), qtype))
    flat, offset = result.reshape(-1), 0
    for part in parts:
        n = part.size * part.itemsize
        flat[offset:offset + n].view(part.dtype).reshape(part.shape)[...] = part
        offset += n
    if offset != flat.size:
        raise AssertionError(f"{qtype}: packed {offset} bytes into {flat.size}")  # a layout bug, not input
    return result


def empty_rows(n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Room for ``n`` rows of ``k`` inputs rounded by :func:`.intgemm.quantize_rows_into`."""
    ns = k // 32
    return (np.empty((n, k), np.int8), np.empty((n, k), np.int8), np.empty((n, ns), np.float32),
            np.empty((n, ns), np.int32), np.empty((n, ns), np.float32))
