"""numba kernels over packed weights (layout in :mod:`.layout`): matrix-vector products and dequantization.

Owns the compiled loops. Only the worker's backend thread calls them, or the helper threads it hands
disjoint row ranges to (``kernels.set_threads``): every kernel releases the GIL. Importing this module
needs numba; nothing is compiled until a kernel is first called, and compiled code is cached on disk
(``cache=True``, in ``__pycache__`` beside this file or under ``NUMBA_CACHE_DIR``), so only the first
worker start on a machine pays the compile (a few seconds per family of types).

:data:`KERNELS` maps each qtype to its two kernels and the flags that select it within its family
(one compiled function per family: q4_0/q4_1, q5_0/q5_1, q4_k/q5_k, f16/bf16; q8_0 and q6_k alone; a
flag is tested once per sub-block, outside the vectorized loops). The matrix-vector products of the
block types are integer kernels that round ``x`` to int8 first as the prefill GEMM does (:mod:`.intdot`
for q4_0, q4_1, q8_0; :mod:`.unpackdot` for q5_0, q5_1, q4_k, q5_k, q6_k); those of f16/bf16, here,
multiply float32 by float32; the dequantizers of every type are here:

- ``mv(w, x, y, r0, r1, *flags)``: rows ``r0..r1`` of ``y = W @ x`` for one float32 vector ``x`` (K,);
- ``dq(w, k, r0, r1, out, c0, *flags)``: ``out[:, r - c0] = W[r, :]`` for rows ``r0..r1``: a transposed
  float32 tile (K, n), written with unit stride, that a BLAS ``x @ out`` consumes directly (prefill of
  the types without an integer GEMM, :mod:`.intgemm`; row gathers).

How the loops are built (the layout decides the speed: docs/DESIGN.md): for each sub-block of 32 weights
the innermost loop runs over a tile of :data:`TILE` rows, reading ``p[16s + j, r]`` with unit stride,
one sweep per byte position ``j`` (q4_0/q4_1/q8_0, whose codes are stored by fours, are dequantized
from int32 words of 4 bytes). LLVM vectorizes the row loop (8 or 16 rows per instruction). numba computes every integer expression in 64 bits; LLVM narrows it back only when
each operand is visibly an 8/16/32-bit value, so codes are read as ``np.int32(byte)``, every result is
cast to ``np.int32`` before it becomes a float, and bit masks come from the uint32 table :data:`_BIT`
(a computed ``1 << j`` or a shift by ``j`` keeps the whole loop in 64-bit lanes: half the elements per
vector). f16/bf16 convert with LLVM's own ``fpext half`` / a bit move
(:func:`_half`, :func:`_bfloat`), exact, one instruction per vector.
fastmath (matrix-vector only) allows reassociation and contraction but not "no NaN/no inf": infinities
and NaNs in weights or inputs propagate as they do in numpy. The dequantizers use strict float
semantics and gguf's order of operations, so they match ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .intdot import _half, mv_q4, mv_q8_0
from .layout import INTERLEAVED
from .unpackdot import mv_kquant, mv_q5, mv_q6_k

__all__ = ["KERNELS", "PACK", "TILE", "pack"]

FASTMATH = {"nsz", "arcp", "contract", "reassoc"}
TILE = 4096
"""Rows per accumulator tile (16 KiB of float32, in L1): one tile for every layer matrix of a small llama,
several for a vocabulary head (smaller tiles run slower on layer matrices)."""

_U15 = np.uint8(15)
_U4 = np.uint8(4)
_F32 = np.float32


def _jit(fn: Any) -> Any:
    return njit(fastmath=FASTMATH, cache=True, nogil=True)(fn)


def _jit_exact(fn: Any) -> Any:
    return njit(cache=True, nogil=True)(fn)


# ------------------------------------------------------------------------------------ sections


@njit(inline="always")
def _sec(flat: Any, off: int, n0: int, r: int, dtype: Any, size: int) -> Any:
    """Section ``(n0, r)`` of ``dtype`` (``size`` bytes each) at byte ``off`` of the flat packed bytes."""
    return flat[off:off + n0 * r * size].view(dtype).reshape((n0, r))


@njit(inline="always")
def _sec4(flat: Any, off: int, n0: int, r: int) -> Any:
    """Byte section of ``n0`` columns stored by fours (:mod:`.layout`) at byte ``off``: ``(n0 / 4, r, 4)``."""
    return flat[off:off + n0 * r].reshape((n0 // 4, r, 4))


@njit(inline="always")
def _col(p4: Any, c: int, r0: int, r1: int) -> Any:
    """Column ``c`` (rows r0..r1) of a section stored by fours (:func:`_sec4`)."""
    return p4[c // 4, r0:r1, c % 4]


@njit(inline="always")
def _fours_at(c: int, r: int, row: int) -> int:
    """Byte offset of column ``c``, row ``row`` in a section of ``r`` rows stored by fours."""
    return (c - c % 4) * r + 4 * row + c % 4


_I8, _I16, _I24 = np.int32(8), np.int32(16), np.int32(24)
_W4, _W8, _W12, _W15, _W16, _W20, _W24, _W28 = (np.uint32(v) for v in (4, 8, 12, 15, 16, 20, 24, 28))
_BIT = np.array([1 << i for i in range(32)], np.uint32)
_H5 = np.array([8 * (j % 4) + j // 4 for j in range(32)], np.uint32)
"""The bit of a q5 type's 5th-bit word that holds weight ``j``'s (:mod:`.layout`)."""
"""``1 << i`` as uint32: a bit mask read from an array keeps the bit tests in 32-bit vector lanes (numba
computes integer expressions in 64 bits; LLVM narrows them back only when every operand is a 32-bit value)."""


# ------------------------------------------------------------------------ matrix-vector, f16/bf16


def _bfloat_typing(typingctx: Any, bits: Any) -> Any:
    """bfloat16 bits (uint16) -> float32, exact (the bits moved to the top half of a float32)."""
    if bits != types.uint16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.uint16), codegen


_bfloat: Any = intrinsic(_bfloat_typing)


@_jit
def _mv_u16(w: Any, x: Any, y: Any, r0: int, r1: int, bf16: bool) -> None:
    """f16 / bf16: ``y[r] = sum_k W[r, k] x[k]``, four inputs per pass over the row tile."""
    R, K = w.shape[0], x.shape[0]
    t = _sec(w.reshape(-1), 0, K, R, np.uint16, 2)
    for t0 in range(r0, r1, TILE):
        t1 = min(t0 + TILE, r1)
        n = t1 - t0
        yt = y[t0:t1]
        yt[:] = 0
        k4 = K // 4 * 4
        for k in range(0, k4, 4):
            a, b, c, e = t[k][t0:t1], t[k + 1][t0:t1], t[k + 2][t0:t1], t[k + 3][t0:t1]
            xa, xb, xc, xe = x[k], x[k + 1], x[k + 2], x[k + 3]
            if bf16:
                for i in range(n):
                    yt[i] += _bfloat(a[i]) * xa + _bfloat(b[i]) * xb + _bfloat(c[i]) * xc + _bfloat(e[i]) * xe
            else:
                for i in range(n):
                    yt[i] += _half(a[i]) * xa + _half(b[i]) * xb + _half(c[i]) * xc + _half(e[i]) * xe
        for k in range(k4, K):
            row, xk = t[k][t0:t1], x[k]
            for i in range(n):
                yt[i] += (_bfloat(row[i]) if bf16 else _half(row[i])) * xk


# --------------------------------------------------------------------- dequantization, per type
# out[k, r - c0] for rows r0..r1: the (K, n) float32 tile a BLAS product reads as W[c0:].T. No fastmath:
# the operations run in gguf's order, so the values are bit-identical to gguf.quants.dequantize.
# Loops run from 0 over views, as above.


@njit(inline="always")
def _dq4(p: Any, s: int, j: int, r0: int, r1: int, out: Any, c0: int) -> None:
    row = _col(p, 16 * s + j, r0, r1)
    a, b = out[32 * s + j][r0 - c0:r1 - c0], out[32 * s + j + 16][r0 - c0:r1 - c0]
    for i in range(r1 - r0):
        v = np.int32(row[i])
        a[i] = _F32(np.int32(v & 15))
        b[i] = _F32(np.int32(v >> 4))


@njit(inline="always")
def _dq4_fours(p: Any, s: int, g: int, r0: int, r1: int, out: Any, c0: int) -> None:
    """Codes ``32s + 4g + b`` and ``32s + 16 + 4g + b`` (b < 4) from the words of q4_0/q4_1's codes
    stored by fours (word ``[4s + g, r]`` = bytes ``16s + 4g..+3`` of row ``r``)."""
    row = p[4 * s + g][r0:r1]
    o0, o1 = r0 - c0, r1 - c0
    a0, a1, a2, a3 = (out[32 * s + 4 * g][o0:o1], out[32 * s + 4 * g + 1][o0:o1],
                      out[32 * s + 4 * g + 2][o0:o1], out[32 * s + 4 * g + 3][o0:o1])
    b0, b1, b2, b3 = (out[32 * s + 16 + 4 * g][o0:o1], out[32 * s + 17 + 4 * g][o0:o1],
                      out[32 * s + 18 + 4 * g][o0:o1], out[32 * s + 19 + 4 * g][o0:o1])
    for i in range(r1 - r0):
        v = row[i]
        a0[i], b0[i] = _F32(np.int32(v & _W15)), _F32(np.int32((v >> _W4) & _W15))
        a1[i], b1[i] = _F32(np.int32((v >> _W8) & _W15)), _F32(np.int32((v >> _W12) & _W15))
        a2[i], b2[i] = _F32(np.int32((v >> _W16) & _W15)), _F32(np.int32((v >> _W20) & _W15))
        a3[i], b3[i] = _F32(np.int32((v >> _W24) & _W15)), _F32(np.int32(v >> _W28))


@njit(inline="always")
def _dq5(p: Any, h: Any, s: int, j: int, r0: int, r1: int, out: Any, c0: int) -> None:
    row, hs = _col(p, 16 * s + j, r0, r1), h[s][r0:r1]
    a, b = out[32 * s + j][r0 - c0:r1 - c0], out[32 * s + j + 16][r0 - c0:r1 - c0]
    mlo, mhi = _BIT[_H5[j]], _BIT[_H5[j + 16]]
    for i in range(r1 - r0):
        v = np.int32(row[i])
        hb = hs[i]
        a[i] = _F32(np.int32(np.int32(v & 15) | (np.int32(16) if hb & mlo else np.int32(0))))
        b[i] = _F32(np.int32(np.int32(v >> 4) | (np.int32(16) if hb & mhi else np.int32(0))))


@njit(inline="always")
def _dq_offset(out: Any, s: int, r0: int, r1: int, c0: int, ds: Any, off: float) -> None:
    """The 32 rows of sub-block ``s``: ``d * (q - off)``, gguf's order."""
    for j in range(32):
        o = out[32 * s + j][r0 - c0:r1 - c0]
        for i in range(r1 - r0):
            o[i] = ds[i] * (o[i] - off)


@njit(inline="always")
def _dq_min(out: Any, s: int, r0: int, r1: int, c0: int, ds: Any, ms: Any) -> None:
    """The 32 rows of sub-block ``s``: ``d * q + m``, gguf's order."""
    for j in range(32):
        o = out[32 * s + j][r0 - c0:r1 - c0]
        for i in range(r1 - r0):
            o[i] = ds[i] * o[i] + ms[i]


@njit(inline="always")
def _dq_blocks(w: Any, k: int, r0: int, r1: int, out: Any, c0: int, has_min: bool, five: bool) -> None:
    """q4_0 (neither flag), q4_1 (``has_min``), q5_0 (``five``), q5_1 (both) rows r0..r1 into ``out``
    (K, r - c0)."""
    R, ns = w.shape[0], k // 32
    flat = w.reshape(-1)
    d = _sec(flat, 0, ns, R, np.float32, 4)
    off = 4 * ns * R
    m = _sec(flat, off if has_min else 0, ns, R, np.float32, 4)
    off += 4 * ns * R if has_min else 0
    h = _sec(flat, off if five else 0, ns, R, np.uint32, 4)
    off += 4 * ns * R if five else 0
    p = _sec4(flat, off, 16 * ns, R)
    words = _sec(flat, off, 4 * ns, R, np.uint32, 4)                 # q4_0, q4_1: by fours,
    d16 = _sec(flat, 0, ns, R, np.uint16, 2)                          # float16 scales
    m16 = _sec(flat, 2 * ns * R if has_min else 0, ns, R, np.uint16, 2)
    ds, ms = np.empty(r1 - r0, np.float32), np.empty(r1 - r0, np.float32)
    for s in range(ns):
        if five:
            for j in range(16):
                _dq5(p, h, s, j, r0, r1, out, c0)
            ds[:], ms[:] = d[s][r0:r1], m[s][r0:r1]
        else:
            for g in range(4):
                _dq4_fours(words, s, g, r0, r1, out, c0)
            dh, mh = d16[s][r0:r1], m16[s][r0:r1]
            for i in range(r1 - r0):
                ds[i], ms[i] = _half(dh[i]), _half(mh[i])
        if has_min:
            _dq_min(out, s, r0, r1, c0, ds, ms)
        else:
            _dq_offset(out, s, r0, r1, c0, ds, _F32(16) if five else _F32(8))


@_jit_exact
def _dq_q4(w: Any, k: int, r0: int, r1: int, out: Any, c0: int, has_min: bool) -> None:
    """q4_0, q4_1 (``has_min``): as :func:`_dq_blocks`."""
    _dq_blocks(w, k, r0, r1, out, c0, has_min, False)


@_jit_exact
def _dq_q5(w: Any, k: int, r0: int, r1: int, out: Any, c0: int, has_min: bool) -> None:
    """q5_0, q5_1 (``has_min``): as :func:`_dq_blocks`."""
    _dq_blocks(w, k, r0, r1, out, c0, has_min, True)


@_jit_exact
def _dq_q8_0(w: Any, k: int, r0: int, r1: int, out: Any, c0: int) -> None:
    R, ns = w.shape[0], k // 32
    flat = w.reshape(-1)
    d = _sec(flat, 0, ns, R, np.uint16, 2)                           # float16 scales
    q = _sec(flat, 4 * ns * R, 8 * ns, R, np.int32, 4)               # by fours: byte b = code 4g + b
    ds = np.empty(r1 - r0, np.float32)
    for s in range(ns):
        dh = d[s][r0:r1]
        for i in range(r1 - r0):
            ds[i] = _half(dh[i])
        for g in range(8):
            row, o0, o1 = q[8 * s + g][r0:r1], r0 - c0, r1 - c0
            a, b, c, e = (out[32 * s + 4 * g][o0:o1], out[32 * s + 4 * g + 1][o0:o1],
                          out[32 * s + 4 * g + 2][o0:o1], out[32 * s + 4 * g + 3][o0:o1])
            for i in range(r1 - r0):
                v = row[i]
                a[i] = _F32(np.int32(np.int32(v << _I24) >> _I24)) * ds[i]
                b[i] = _F32(np.int32(np.int32(v << _I16) >> _I24)) * ds[i]
                c[i] = _F32(np.int32(np.int32(v << _I8) >> _I24)) * ds[i]
                e[i] = _F32(np.int32(v >> _I24)) * ds[i]


@njit(inline="always")
def _dq_k(out: Any, d: Any, dmin: Any, sc: Any, mn: Any, s: int, r0: int, r1: int, c0: int) -> None:
    db, mb, scs, mns = d[s // 8][r0:r1], dmin[s // 8][r0:r1], sc[s][r0:r1], mn[s][r0:r1]
    for j in range(32):
        o = out[32 * s + j][r0 - c0:r1 - c0]
        for i in range(r1 - r0):
            o[i] = db[i] * _F32(scs[i]) * o[i] - mb[i] * _F32(mns[i])


@_jit_exact
def _dq_kquant(w: Any, k: int, r0: int, r1: int, out: Any, c0: int, five: bool) -> None:
    """q4_k, q5_k (``five``) rows r0..r1 into ``out`` (K, r - c0)."""
    R, ns = w.shape[0], k // 32
    nb = ns // 8
    flat = w.reshape(-1)
    d = _sec(flat, 0, nb, R, np.float32, 4)
    dmin = _sec(flat, 4 * nb * R, nb, R, np.float32, 4)
    off = 8 * nb * R
    h = _sec(flat, off if five else 0, ns, R, np.uint32, 4)
    off += 4 * ns * R if five else 0
    sc = _sec(flat, off, ns, R, np.uint8, 1)
    mn = _sec(flat, off + ns * R, ns, R, np.uint8, 1)
    p = _sec4(flat, off + 2 * ns * R, 16 * ns, R)
    for s in range(ns):
        for j in range(16):
            if five:
                _dq5(p, h, s, j, r0, r1, out, c0)
            else:
                _dq4(p, s, j, r0, r1, out, c0)
        _dq_k(out, d, dmin, sc, mn, s, r0, r1, c0)


@_jit_exact
def _dq_q6_k(w: Any, k: int, r0: int, r1: int, out: Any, c0: int) -> None:
    R, ng = w.shape[0], k // 16
    nb = ng // 16
    flat = w.reshape(-1)
    d = _sec(flat, 0, nb, R, np.float32, 4)
    h = _sec4(flat, 4 * nb * R, 4 * ng, R)
    sc = _sec(flat, 4 * nb * R + 4 * ng * R, ng, R, np.int8, 1)
    p = _sec4(flat, 4 * nb * R + 5 * ng * R, 8 * ng, R)
    n, o0, o1 = r1 - r0, r0 - c0, r1 - c0
    for g in range(ng):
        db, sg = d[g // 16][r0:r1], sc[g][r0:r1]
        for j in range(4):
            ra, rb, hr = _col(p, 8 * g + j, r0, r1), _col(p, 8 * g + 4 + j, r0, r1), _col(h, 4 * g + j, r0, r1)
            oa, ob = out[16 * g + j][o0:o1], out[16 * g + 8 + j][o0:o1]
            oc, od = out[16 * g + 4 + j][o0:o1], out[16 * g + 12 + j][o0:o1]
            for i in range(n):
                va, vb, hb = np.int32(ra[i]), np.int32(rb[i]), np.int32(hr[i])
                qa = np.int32(np.int32(va & 15) | np.int32((hb << 4) & 48))
                qb = np.int32(np.int32(va >> 4) | np.int32((hb << 2) & 48))
                qc = np.int32(np.int32(vb & 15) | np.int32(hb & 48))
                qd = np.int32(np.int32(vb >> 4) | np.int32((hb >> 2) & 48))
                scale = _F32(sg[i])
                oa[i] = db[i] * scale * _F32(np.int32(qa - 32))
                ob[i] = db[i] * scale * _F32(np.int32(qb - 32))
                oc[i] = db[i] * scale * _F32(np.int32(qc - 32))
                od[i] = db[i] * scale * _F32(np.int32(qd - 32))


@_jit_exact
def _dq_u16(w: Any, k: int, r0: int, r1: int, out: Any, c0: int, bf16: bool) -> None:
    """f16, bf16 (``bf16``) rows r0..r1 into ``out`` (K, r - c0)."""
    R = w.shape[0]
    t = _sec(w.reshape(-1), 0, k, R, np.uint16, 2)
    for kk in range(k):
        row, o = t[kk][r0:r1], out[kk][r0 - c0:r1 - c0]
        if bf16:
            for i in range(r1 - r0):
                o[i] = _bfloat(row[i])
        else:
            for i in range(r1 - r0):
                o[i] = _half(row[i])


# ------------------------------------------------------------------------------------ entry points

KERNELS: dict[str, tuple[Any, Any, tuple[bool, ...]]] = {
    "f16": (_mv_u16, _dq_u16, (False,)), "bf16": (_mv_u16, _dq_u16, (True,)),
    "q8_0": (mv_q8_0, _dq_q8_0, ()),
    "q4_0": (mv_q4, _dq_q4, (False,)), "q4_1": (mv_q4, _dq_q4, (True,)),
    "q5_0": (mv_q5, _dq_q5, (False,)), "q5_1": (mv_q5, _dq_q5, (True,)),
    "q4_k": (mv_kquant, _dq_kquant, (False,)), "q5_k": (mv_kquant, _dq_kquant, (True,)),
    "q6_k": (mv_q6_k, _dq_q6_k, ()),
}
"""qtype -> (``mv(w, x, y, r0, r1, *flags)``: rows r0..r1 of ``y = W @ x``; ``dq(w, k, r0, r1, out, c0,
*flags)``: rows r0..r1 dequantized into ``out[:, r - c0]``; the flags that pick the type in a family).
Both run in the calling thread and release the GIL, so several threads may run disjoint rows."""


# ----------------------------------------------------------------------------------------- repack
# GGUF rows (R, row bytes) -> packed (R, P), byte for byte what layout.pack_numpy writes, much faster.
# Rows go in tiles of PACK_TILE so the transposed writes of one (block, byte) land in one cache line run.

PACK_TILE = 64


@njit(inline="always")
def _fifth_order(word: Any) -> Any:
    """GGUF's 5th bits (bit ``j`` = weight ``j``) in the layout's order (bit ``8 (j % 4) + j // 4``)."""
    out = np.uint32(0)
    for g in range(8):
        nib = (word >> np.uint32(4 * g)) & _W15
        spread = (nib & np.uint32(1)) | ((nib & np.uint32(2)) << np.uint32(7)) | ((nib & np.uint32(4)) << np.uint32(14)) \
            | ((nib & np.uint32(8)) << np.uint32(21))
        out |= spread << np.uint32(g)
    return out


@njit(inline="always")
def _f16_bytes(lo: Any, hi: Any) -> Any:
    """Little-endian float16 bytes -> float32 value (exact)."""
    return _half(np.uint16(np.uint16(lo) | (np.uint16(hi) << np.uint16(8))))


@_jit_exact
def _pack_simple(src: Any, out: Any, block: int, nf: int, hbytes: int, qbytes: int, fours: bool) -> None:
    """q8_0, q4_0, q4_1, q5_0, q5_1: ``nf`` float16 factors, ``hbytes`` of 5th bits, ``qbytes`` of
    quants per block, each copied to its section (transposed: block-major, row last; the quants by
    fours of bytes: byte ``4g + b`` of row ``r`` at ``[g, r, b]``); with ``fours`` (:data:`.layout.INTERLEAVED`)
    the scales stay float16."""
    R, nb = src.shape[0], src.shape[1] // block
    flat = out.reshape(-1)
    bits = flat[:4 * nf * nb * R].view(np.float32)
    halves = flat[:2 * nf * nb * R].view(np.uint16)                 # by fours: the scales stay float16
    if fours:
        flat[2 * nf * nb * R:4 * nf * nb * R] = 0
    hoff = 4 * nf * nb * R
    h = flat[hoff:hoff + hbytes * nb * R]
    qoff = hoff + hbytes * nb * R
    words = qbytes // 4
    q32 = flat[qoff:qoff + qbytes * nb * R].view(np.uint32)    # by fours: one word per row
    for t0 in range(0, R, PACK_TILE):
        t1 = min(t0 + PACK_TILE, R)
        for b in range(nb):
            base = b * block
            for f in range(nf):
                if fours:
                    dst16 = halves[(f * nb + b) * R:(f * nb + b + 1) * R]
                    for r in range(t0, t1):
                        dst16[r] = np.uint16(src[r, base + 2 * f]) | (np.uint16(src[r, base + 2 * f + 1]) << np.uint16(8))
                    continue
                dst = bits[(f * nb + b) * R:(f * nb + b + 1) * R]
                for r in range(t0, t1):
                    dst[r] = _f16_bytes(src[r, base + 2 * f], src[r, base + 2 * f + 1])
            if hbytes:
                h32 = h[b * R * 4:(b + 1) * R * 4].view(np.uint32)
                for r in range(t0, t1):
                    o = base + 2 * nf
                    word = (np.uint32(src[r, o]) | (np.uint32(src[r, o + 1]) << _W8) | (np.uint32(src[r, o + 2]) << _W16)
                            | (np.uint32(src[r, o + 3]) << _W24))
                    h32[r] = _fifth_order(word)
            for g in range(words):
                col = base + 2 * nf + hbytes + 4 * g
                dst32 = q32[(b * words + g) * R:(b * words + g + 1) * R]
                for r in range(t0, t1):
                    dst32[r] = (np.uint32(src[r, col]) | (np.uint32(src[r, col + 1]) << _W8)
                                | (np.uint32(src[r, col + 2]) << _W16) | (np.uint32(src[r, col + 3]) << _W24))


@njit(inline="always")
def _k_scale(sc12: Any, i: int) -> tuple[int, int]:
    """Scale and min of sub-block ``i`` from a K-quant's 12 scale bytes (ggml ``get_scale_min_k4``)."""
    if i < 4:
        return sc12[i] & 63, sc12[i + 4] & 63
    return (sc12[i + 4] & 0xF) | ((sc12[i - 4] >> 6) << 4), (sc12[i + 4] >> 4) | ((sc12[i] >> 6) << 4)


@_jit_exact
def _pack_k45(src: Any, out: Any, five: bool) -> None:
    """q4_k (``five`` False, 144-byte blocks) and q5_k (176): d, dmin, [h], sc, mn, pairs."""
    block = 176 if five else 144
    R, nb = src.shape[0], src.shape[1] // block
    ns = 8 * nb
    flat = out.reshape(-1)
    bits = flat[:8 * nb * R].view(np.float32)
    off = 8 * nb * R
    hbytes = 4 * ns * R if five else 0
    h = flat[off:off + hbytes].view(np.uint32)
    off += hbytes
    sc, mn, p = flat[off:off + ns * R], flat[off + ns * R:off + 2 * ns * R], flat[off + 2 * ns * R:]
    qoff = 48 if five else 16
    for t0 in range(0, R, PACK_TILE):
        t1 = min(t0 + PACK_TILE, R)
        for b in range(nb):
            base = b * block
            for r in range(t0, t1):
                row = src[r]
                bits[b * R + r] = _f16_bytes(row[base], row[base + 1])
                bits[(nb + b) * R + r] = _f16_bytes(row[base + 2], row[base + 3])
                for i in range(8):
                    s, m = _k_scale(row[base + 4:base + 16], i)
                    sc[(8 * b + i) * R + r] = s
                    mn[(8 * b + i) * R + r] = m
                for c in range(4):
                    for j in range(16):
                        g0, g1 = row[base + qoff + 32 * c + j], row[base + qoff + 32 * c + j + 16]
                        p[_fours_at(16 * (8 * b + 2 * c) + j, R, r)] = (g0 & _U15) | ((g1 & _U15) << _U4)
                        p[_fours_at(16 * (8 * b + 2 * c + 1) + j, R, r)] = (g0 >> _U4) | (g1 & np.uint8(0xF0))
                if five:
                    for i in range(8):
                        word = np.uint32(0)
                        for j in range(32):
                            word |= np.uint32((row[base + 16 + j] >> i) & 1) << _H5[j]
                        h[(8 * b + i) * R + r] = word


@_jit_exact
def _pack_q6_k(src: Any, out: Any) -> None:
    R, nb = src.shape[0], src.shape[1] // 210
    ns = 8 * nb
    flat = out.reshape(-1)
    bits = flat[:4 * nb * R].view(np.float32)
    h = flat[4 * nb * R:4 * nb * R + 8 * ns * R]
    off = 4 * nb * R + 8 * ns * R
    sc, p = flat[off:off + 2 * ns * R], flat[off + 2 * ns * R:]
    q = np.empty(256, np.uint8)
    for t0 in range(0, R, PACK_TILE):
        t1 = min(t0 + PACK_TILE, R)
        for b in range(nb):
            base = b * 210
            for r in range(t0, t1):
                row = src[r]
                bits[b * R + r] = _f16_bytes(row[base + 208], row[base + 209])
                for i in range(16):
                    sc[(16 * b + i) * R + r] = row[base + 192 + i]
                for half in range(2):
                    for col in range(32):
                        lo0, lo1 = row[base + 64 * half + col], row[base + 64 * half + 32 + col]
                        hh = row[base + 128 + 32 * half + col]
                        e = 128 * half + col
                        q[e] = (lo0 & _U15) | ((hh & np.uint8(3)) << _U4)
                        q[e + 32] = (lo1 & _U15) | (((hh >> np.uint8(2)) & np.uint8(3)) << _U4)
                        q[e + 64] = (lo0 >> _U4) | (((hh >> np.uint8(4)) & np.uint8(3)) << _U4)
                        q[e + 96] = (lo1 >> _U4) | (((hh >> np.uint8(6)) & np.uint8(3)) << _U4)
                for g in range(16):
                    for j in range(8):
                        a, c = q[16 * g + j], q[16 * g + 8 + j]
                        p[_fours_at(8 * (16 * b + g) + j, R, r)] = (a & _U15) | ((c & _U15) << _U4)
                    for j in range(4):
                        e = 16 * g + j
                        h[_fours_at(4 * (16 * b + g) + j, R, r)] = ((q[e] >> _U4) | ((q[e + 8] >> _U4) << np.uint8(2))
                                                             | ((q[e + 4] >> _U4) << _U4)
                                                             | ((q[e + 12] >> _U4) << np.uint8(6)))


@_jit_exact
def _pack_u16(src: Any, out: Any) -> None:
    """f16/bf16 (R, K) uint16 -> (K, R) uint16 in ``out``'s bytes."""
    R, K = src.shape
    t = out.reshape(-1).view(np.uint16)
    for t0 in range(0, R, PACK_TILE):
        t1 = min(t0 + PACK_TILE, R)
        for k in range(K):
            for r in range(t0, t1):
                t[k * R + r] = src[r, k]


_SIMPLE = {"q8_0": (1, 0, 32), "q4_0": (1, 0, 16), "q4_1": (2, 0, 16), "q5_0": (1, 4, 16), "q5_1": (2, 4, 16)}
"""qtype -> (float16 factors, bytes of 5th bits, bytes of quants) per 32-weight block."""

PACK: dict[str, tuple[Any, tuple[Any, ...], bool]] = {
    "f16": (_pack_u16, (), True), "bf16": (_pack_u16, (), True),
    "q6_k": (_pack_q6_k, (), False), "q4_k": (_pack_k45, (False,), False), "q5_k": (_pack_k45, (True,), False),
    **{qtype: (_pack_simple, (2 * nf + hbytes + qbytes, nf, hbytes, qbytes, qtype in INTERLEAVED), False)
       for qtype, (nf, hbytes, qbytes) in _SIMPLE.items()},
}
"""qtype -> (kernel, flags, as uint16): ``kernel(src, out, *flags)`` repacks GGUF rows ``src`` (viewed
as uint16 where the third item says so) into ``out``."""


def pack(src: Any, qtype: str, out: Any) -> None:
    """Repack GGUF ``src`` into ``out`` (the layout of :mod:`.layout`); ``src`` C-contiguous."""
    kernel, flags, u16 = PACK[qtype]
    kernel(src.view(np.uint16) if u16 else src, out, *flags)
