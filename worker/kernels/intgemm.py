"""Integer matrix-matrix products for prefill: int8 activation rows times packed 4-bit and 8-bit codes.

Owns the integer prefill kernels of q4_0, q4_1 and q8_0, and :data:`GEMM`, the table of every block
type's (q5_0, q5_1, q4_k, q5_k, q6_k: :mod:`.unpacked`, which unpacks their codes per block of 16
rows into this module's form, then makes the same passes). Only the worker's backend thread calls them,
or the helper threads it hands disjoint row ranges to (``kernels.set_threads``): every kernel releases
the GIL. Compiled code is cached on disk as :mod:`.jit`'s is.

The decode kernels' method (:mod:`.intdot`: read its docstring first) applied to many activation rows
at once, as llama.cpp's CPU prefill does. Each of the ``T`` rows of ``X`` is rounded once per product
to the same two int8 levels per block of 32 (:func:`quantize_rows`: ``x ~ dx (HI xq1 + xq2)``); then
for each block of 16 weight rows and each sub-block of 32 inputs the packed codes are loaded and
unpacked *once* (4 or 8 vectors of 64 bytes) and meet :data:`TB` activation rows in a row, 16
``vpdpbusd`` per activation row, the scales applied per sub-block into float32 accumulators that stay
in registers until the whole row length is summed (:func:`_gemm_codegen`)::

    q4_0   y[t] += d * dx[t] * (isum - 8 * sum xq[t])
    q4_1   y[t] += d * dx[t] * isum + m * sum x[t]
    q8_0   y[t] += d * dx[t] * (isum' - 128 * sum xq[t])

The loops: row blocks of 16 outside (their codes, 0.3-0.6 KiB per sub-block, stay in L1 while every
activation row passes over them), blocks of :data:`TB` activation rows inside, the sub-blocks
innermost. Activation rows past the last multiple of ``TB`` take 2-row passes and a one-row pass
(:data:`PASSES`); weight rows past the last multiple of 16 a scalar loop.

Why not BLAS: f32 BLAS does 16 multiply-adds per instruction, after a dequantization pass, on weights
read at 32 bits; ``vpdpbusd`` does 64 (32 with the two levels) on weights read at 4.5-8.5 bits; 96
of the ~260 instructions of a 6-row pass's sub-block are ``vpdpbusd``; it beats float32 BLAS on
SmolLM2's shapes (``zmq-rpc-bench --cases kernels``; figures in docs/DESIGN.md). llama.cpp's one
level would halve the ``vpdpbusd`` but changed greedy tokens (:mod:`.intdot`).

Without VNNI the sums are AVX2's ``vpmaddubsw`` + ``vpmaddwd`` (:func:`.intdot._dots`, exact, bit-identical
products; q8_0's codes multiplied signed, so its ``-128 sum xq`` term is gone there).

Batch invariance: an output depends on its activation row alone (rows are rounded one by one, and
every pass, whatever its row count, applies the scales with the same FMAs in the same sub-block order),
and the decode kernels of q4_0/q4_1/q8_0 round as these do (:mod:`.intdot`), so a row's result is
the same bits at any batch size.

Precision: the decode kernels' (the error is the rounding of the inputs, at most ``dx / 2 = max|x| /
64516`` per input; the tests hold these kernels to that bound for every row).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .intdot import (
    HI,
    Q8_OFFSET,
    _at,
    _by_rows,
    _code,
    _declare,
    _dots,
    _gemm_passes,
    _half,
    _load_halves,
    _pass_rows,
    _prefetch,
    _splat,
)
from .layout import empty_rows
from .unpacked import KINDS, gemm_unpacked

__all__ = ["GEMM", "PASSES", "TB", "empty_rows", "gemm_q4", "gemm_q8_0", "quantize_rows", "quantize_rows_into"]

TB = 6
"""Activation rows per pass over a block of 16 weight rows: 6 float32 accumulators, 8 unpacked code
vectors and 12 int32 sums in the 32 vector registers, the 12 chains of ``vpdpbusd`` interleaved
(faster than 4 or 8 on SmolLM2's shapes: docs/DESIGN.md)."""
PASSES = _gemm_passes(TB)
"""The activation row counts a pass is compiled for: TB, then 2-row passes and a last one-row pass
for the rows left. A one-row pass costs ~2.5x a row of a TB-row one, a 2-row pass little more than
two rows of it (SmolLM2's 1536x576 Q4_1, 4 rows: 56 us in a 4-row pass, 65 in two 2-row passes,
134 in four one-row passes); each further count adds its unrolled body to every kernel's compile
(all six counts tripled the portable path's, 150 -> 500 s in CI)."""
PREFETCH = 128
"""Bytes ahead in each stream of codes asked for (the next two row blocks: a row block's codes lie in
4-8 streams per sub-block, and its float16 scales and mins in 1-2 more, too many for the hardware's
prefetchers), half as far in the scales'. Only a row block's first pass asks: on the passes after it
the lines are in L1 and each hint would cost a load slot."""

_F32 = np.float32
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(ir.FloatType(), 16)

_ROWS_SIG = types.void(*([types.intp] * 17))


_alloca: Any = cgutils.alloca_once_value


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` over 16 float32 lanes, rounded once (``llvm.fma``: one ``vfmadd``)."""
    fn = _declare(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _gemm_codegen(kind: int, tb: int) -> Any:
    """IR of one pass: ``tb`` activation rows against 16 weight rows over all ``ns`` sub-blocks.

    Arguments (addresses as int64, the arrays kept alive by the caller): ``y`` (float32 output of the
    first activation row, first weight row) and its row stride in bytes; ``p`` the codes of sub-block 0
    of the first weight row, ``gstride`` the bytes between code groups (``4 R``); ``d``, ``m`` the
    float16 scales of sub-block 0, ``dstride`` the bytes between sub-blocks (``2 R``); ``xw1``, ``xw2``
    the int8 codes of the first activation row, ``xstride`` the bytes between rows (``K``); ``dx``,
    ``sq``, ``sx`` the per-sub-block step, code sum and float sum of the first activation row, and
    their row stride in bytes; ``ns``; ``pf`` the prefetch distance in bytes."""
    groups = 8 if kind == 2 else 4

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        y, ystride, p, gstride, d, m, dstride, xw1, xw2, xstride, dx, sq, sx, sstride, ns, pf = args
        facc = [_alloca(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(tb)]
        low, four = ir.Constant(_V16I, [0x0F0F0F0F] * 16), ir.Constant(_V16I, [4] * 16)
        hi_scale = ir.Constant(_V16I, [HI] * 16)
        sub = builder.mul(gstride, ir.Constant(_I64, groups))
        with cgutils.for_range(builder, ns, intp=_I64) as loop:
            s = loop.index
            base = builder.mul(s, sub)
            soff = builder.mul(s, dstride)
            with builder.if_then(builder.icmp_signed("!=", pf, ir.Constant(_I64, 0)), likely=True):
                for g in range(groups):
                    at = builder.add(base, builder.mul(gstride, ir.Constant(_I64, g)))
                    _prefetch(builder, p, builder.add(at, pf))
                half_pf = builder.lshr(pf, ir.Constant(_I64, 1))     # scales: 32 bytes a row block
                for scales in (d, m) if kind == 1 else (d,):
                    _prefetch(builder, scales, builder.add(soff, half_pf))
            words = []
            for g in range(groups):
                at = builder.add(base, builder.mul(gstride, ir.Constant(_I64, g)))
                words.append(builder.load(_at(builder, p, at, _V16I), align=1))
            codes = (words if kind == 2 else
                     [builder.and_(v, low) for v in words] + [builder.and_(builder.lshr(v, four), low) for v in words])
            dv = _load_halves(builder, d, soff)
            mv = _load_halves(builder, m, soff) if kind == 1 else None
            s4 = builder.mul(s, ir.Constant(_I64, 4))
            s32 = builder.mul(s, ir.Constant(_I64, 32))
            xos = [builder.add(builder.mul(xstride, ir.Constant(_I64, t)), s32) for t in range(tb)]
            inputs = []                           # per activation row, per level: its input words
            for t in range(tb):
                for xw in (xw1, xw2):
                    inputs.append([_splat(builder, builder.load(_at(builder, xw, builder.add(
                        xos[t], ir.Constant(_I64, 4 * c)), _I32), align=4), _V16I) for c in range(len(codes))])
            sums = _dots(builder, codes, inputs, 15, signed=kind == 2)
            accs = [sums[2 * t:2 * t + 2] for t in range(tb)]
            for t in range(tb):
                acc = accs[t]
                isum = builder.add(builder.mul(acc[0], hi_scale), acc[1])
                so = builder.add(builder.mul(sstride, ir.Constant(_I64, t)), s4)
                if kind == 0 or (kind == 2 and Q8_OFFSET):
                    sqt = builder.load(_at(builder, sq, so, _I32), align=4)
                    ioff = builder.mul(sqt, ir.Constant(_I32, -8 if kind == 0 else Q8_OFFSET))
                    isum = builder.add(isum, _splat(builder, ioff, _V16I))
                fx = builder.load(_at(builder, dx, so, ir.FloatType()), align=4)
                scale = builder.fmul(dv, _splat(builder, fx, _V16F))
                acc_f = _fma(builder, builder.sitofp(isum, _V16F), scale, builder.load(facc[t]))
                if mv is not None:
                    sxt = builder.load(_at(builder, sx, so, ir.FloatType()), align=4)
                    acc_f = _fma(builder, mv, _splat(builder, sxt, _V16F), acc_f)
                builder.store(acc_f, facc[t])
        for t in range(tb):
            yp = _at(builder, y, builder.mul(ystride, ir.Constant(_I64, t)), _V16F)
            builder.store(builder.load(facc[t]), yp, align=4)
        return context.get_dummy_value()
    return codegen


def _rows_typing(kind: int) -> Any:
    def typing(typingctx: Any, rows: Any, y: Any, ystride: Any, p: Any, gstride: Any, d: Any, m: Any,
               dstride: Any, xw1: Any, xw2: Any, xstride: Any, dx: Any, sq: Any, sx: Any, sstride: Any,
               ns: Any, pf: Any) -> Any:
        return _ROWS_SIG, _by_rows({rows: _gemm_codegen(kind, rows) for rows in PASSES})
    return typing


# ``_q4_1_pass(rows, *args)``: one pass of ``rows`` (one of PASSES) activation rows. A batch of 8 is a
# 6-row and a 2-row pass, not a 6-row pass and two one-row ones; the per-row work is the same in
# every pass, so the rows' bits do not depend on the split.
_q4_0_pass: Any = intrinsic(_rows_typing(0))
_q4_1_pass: Any = intrinsic(_rows_typing(1))
_q8_0_pass: Any = intrinsic(_rows_typing(2))


# ------------------------------------------------------------------------------------ the kernels


@njit(cache=True, nogil=True)
def quantize_rows(x: Any) -> tuple[Any, Any, Any, Any, Any]:
    """Each row of ``x`` (T, K) float32, C-contiguous, rounded as :func:`.intdot.quantize_x` rounds a
    vector: ``(xq1, xq2, dx, sq, sx)``, codes (T, K) int8, per-sub-block step, code sum and float sum
    (T, K/32)."""
    n, k = x.shape
    ns = k // 32
    xq1, xq2 = np.empty((n, k), np.int8), np.empty((n, k), np.int8)
    dx, sq, sx = np.empty((n, ns), np.float32), np.empty((n, ns), np.int32), np.empty((n, ns), np.float32)
    quantize_rows_into(x, xq1, xq2, dx, sq, sx, 0, n)
    return xq1, xq2, dx, sq, sx


@njit(cache=True, nogil=True)
def quantize_rows_into(x: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, t0: int, t1: int) -> None:
    """Rows ``t0..t1`` of :func:`quantize_rows` into the given arrays (:func:`empty_rows`; a long
    prefill's rows are split over the threads). Written to vectorize (the block's max from the
    float bits, the float sum in four partial sums): ~1-2 ns per input."""
    k = x.shape[1]
    ns = k // 32
    bits = x.view(np.int32)
    cell = np.empty(1, np.int32)
    cell_f = cell.view(np.float32)
    for t in range(t0, t1):
        for s in range(ns):
            o = 32 * s
            top = np.int32(0)
            for j in range(32):
                top = max(top, bits[t, o + j] & np.int32(0x7FFFFFFF))
            s0, s1, s2, s3 = _F32(0), _F32(0), _F32(0), _F32(0)
            for j in range(0, 32, 4):
                s0 += x[t, o + j]
                s1 += x[t, o + j + 1]
                s2 += x[t, o + j + 2]
                s3 += x[t, o + j + 3]
            sx[t, s] = (s0 + s1) + (s2 + s3)
            sq[t, s] = 0
            if top > np.int32(0x7F7FFFFF) or top == 0:      # an infinity or a NaN (step NaN), or zeros
                for j in range(32):
                    xq1[t, o + j], xq2[t, o + j] = 0, 0
                dx[t, s] = np.float32(np.nan) if top != 0 else _F32(0)
                continue
            cell[0] = top
            amax = cell_f[0]
            e = amax / _F32(127)
            dx[t, s] = e / _F32(HI)
            inv = _F32(127) / amax
            inv2 = inv * _F32(HI)
            acc = np.int32(0)
            for j in range(32):
                v = x[t, o + j]
                a = np.rint(v * inv)
                b = min(max(np.rint((v - a * e) * inv2), _F32(-127)), _F32(127))
                xq1[t, o + j], xq2[t, o + j] = np.int8(a), np.int8(b)
                acc += np.int32(HI) * np.int32(a) + np.int32(b)
            sq[t, s] = acc


@njit(cache=True, nogil=True)
def gemm_q4(w: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, y: Any, r0: int, r1: int,
            has_min: bool) -> None:
    """q4_0 (``has_min`` False), q4_1: columns r0..r1 of ``y = X @ W.T`` for ``X`` rounded by
    :func:`quantize_rows` (``y`` (T, R) float32, rows C-contiguous)."""
    R, n, k = w.shape[0], xq1.shape[0], xq1.shape[1]
    ns = k // 32
    flat = w.reshape(-1)
    d = flat[:2 * ns * R].view(np.uint16).reshape((ns, R))
    m = flat[2 * ns * R if has_min else 0:][:2 * ns * R].view(np.uint16).reshape((ns, R))  # d if no min (unused)
    off = 8 * ns * R if has_min else 4 * ns * R
    p = flat[off:off + 16 * ns * R].view(np.uint32).reshape((4 * ns, R))
    ys, ss = y.strides[0], 4 * ns
    pa, da, ma, ya = p.ctypes.data, d.ctypes.data, m.ctypes.data, y.ctypes.data
    xa1, xa2, dxa, sqa, sxa = xq1.ctypes.data, xq2.ctypes.data, dx.ctypes.data, sq.ctypes.data, sx.ctypes.data
    r16 = r0 + (r1 - r0) // 16 * 16
    for r in range(r0, r16, 16):
        t = 0
        while t < n:
            rows = _pass_rows(n - t, TB)
            args = (ya + t * ys + 4 * r, ys, pa + 4 * r, 4 * R, da + 2 * r, ma + 2 * r, 2 * R, xa1 + t * k,
                    xa2 + t * k, k, dxa + t * ss, sqa + t * ss, sxa + t * ss, ss, ns,
                    PREFETCH if t == 0 else 0)
            if has_min:
                _q4_1_pass(rows, *args)
            else:
                _q4_0_pass(rows, *args)
            t += rows
    for t in range(n):
        for i in range(r16, r1):
            total = _F32(0)
            for s in range(ns):
                acc = 0
                for g in range(4):
                    word = np.int64(p[4 * s + g, i])
                    for b in range(4):
                        byte = (word >> (8 * b)) & 255
                        acc += (byte & 15) * _code(xq1[t], xq2[t], 32 * s + 4 * g + b)
                        acc += (byte >> 4) * _code(xq1[t], xq2[t], 32 * s + 16 + 4 * g + b)
                ioff = 0 if has_min else -8 * np.int64(sq[t, s])
                v = _F32(np.int32(acc + ioff)) * (_half(d[s, i]) * dx[t, s])
                if has_min:
                    v += _half(m[s, i]) * sx[t, s]
                total += v
            y[t, i] = total


@njit(cache=True, nogil=True)
def gemm_q8_0(w: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, y: Any, r0: int, r1: int) -> None:
    """q8_0: columns r0..r1 of ``y = X @ W.T`` for ``X`` rounded by :func:`quantize_rows`."""
    R, n, k = w.shape[0], xq1.shape[0], xq1.shape[1]
    ns = k // 32
    flat = w.reshape(-1)
    d = flat[:2 * ns * R].view(np.uint16).reshape((ns, R))
    q = flat[4 * ns * R:36 * ns * R]
    codes = q.view(np.int8).reshape((8 * ns, 4 * R))
    ys, ss = y.strides[0], 4 * ns
    pa, da, ya = q.ctypes.data, d.ctypes.data, y.ctypes.data
    xa1, xa2, dxa, sqa, sxa = xq1.ctypes.data, xq2.ctypes.data, dx.ctypes.data, sq.ctypes.data, sx.ctypes.data
    r16 = r0 + (r1 - r0) // 16 * 16
    for r in range(r0, r16, 16):
        t = 0
        while t < n:
            rows = _pass_rows(n - t, TB)
            args = (ya + t * ys + 4 * r, ys, pa + 4 * r, 4 * R, da + 2 * r, da + 2 * r, 2 * R, xa1 + t * k,
                    xa2 + t * k, k, dxa + t * ss, sqa + t * ss, sxa + t * ss, ss, ns,
                    PREFETCH if t == 0 else 0)
            _q8_0_pass(rows, *args)
            t += rows
    for t in range(n):
        for i in range(r16, r1):
            total = _F32(0)
            for s in range(ns):
                acc = 0
                for g in range(8):
                    for b in range(4):
                        acc += np.int64(codes[8 * s + g, 4 * i + b]) * _code(xq1[t], xq2[t], 32 * s + 4 * g + b)
                total += _F32(np.int32(acc)) * (_half(d[s, i]) * dx[t, s])
            y[t, i] = total


GEMM: Final[dict[str, tuple[Any, tuple[Any, ...]]]] = {"q4_0": (gemm_q4, (False,)), "q4_1": (gemm_q4, (True,)), "q8_0": (gemm_q8_0, ()),
               **{qtype: (gemm_unpacked, (kind,)) for qtype, kind in KINDS.items()}}
"""qtype -> (kernel, flags): ``kernel(w, xq1, xq2, dx, sq, sx, y, r0, r1, *flags)``."""
