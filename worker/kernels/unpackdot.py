"""Integer matrix-vector products for decode of q5_0, q5_1, q4_k, q5_k, q6_k, rounding as their GEMM.

Owns the integer decode kernels of the types whose codes are stored in byte columns (:mod:`.layout`)
and whose prefill runs :mod:`.unpacked`'s GEMM. Only the worker's backend thread calls them, or the
helper threads it hands disjoint row ranges to (``kernels.set_threads``): every kernel releases the
GIL. Compiled code is cached on disk as :mod:`.jit`'s is.

Why. The float32 kernels these replace (formerly in :mod:`.jit`) rounded differently from the GEMM,
so a sequence's row came out in other bits at 1-2 rows than at 3+ (``kernels``, "Batch
invariance"), and the batched engine padded every decode step of these models to 3 rows; and the
GEMM itself on one row unpacks each block of 16 weight rows into a scratch before one pass over
it, 1.3-3x the float kernel (docs/DESIGN.md has the figures: these sweeps take 0.4-1x it). Here the
GEMM's arithmetic runs as :mod:`.intdot`'s sweeps do: the input is rounded by the GEMM's own
:func:`.intgemm.quantize_rows_into` (one row), the offsets per sub-block by :mod:`.unpacked`'s
``_offsets``; then for each tile of :data:`TILE` weight rows and each sub-block (q6_k: group of 16
inputs) one sweep (:func:`_sweep_codegen`) goes down the rows 16 at a time, unpacks their codes in
registers with the GEMM's own IR (:func:`.unpacked.sub_codes`: nothing goes through memory), takes
the integer sums with :func:`.intdot._dots` (exact: the same integers), and applies the scales with
the GEMM pass's float operations in its order (the codes are stored by fours, :mod:`.layout`: one
64-byte load per 4 inputs of 16 rows, each stream prefetched :data:`.intdot.PREFETCH` bytes ahead)::

    s = d (q5_x) | d * float(sc) (K-quants) ;  m = m (q5_1) | -(dmin * float(mn)) (q4_k, q5_k)
    fsum = float(HI * a1 + a2 + off)               (q6_k: fma(float(a1), HI, float(a2 + off)))
    y = fma(fsum, s * dx, y) ;  y = fma(m, sum x, y)     (the min only for q5_1, q4_k, q5_k)

``y`` starting at 0 and the sub-blocks in order, as the GEMM's register accumulator does: a row's
product is the GEMM's bits at any batch size. Rows past the last multiple of 16 of a range run the
GEMM itself (:func:`.unpacked._blocks`, one activation row).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .intdot import HI, PREFETCH, _at, _declare, _dots, _prefetch, _splat
from .intgemm import quantize_rows_into
from .unpacked import _blocks, _offsets, _sections, sub_codes

__all__ = ["TILE", "mv_kquant", "mv_q5", "mv_q6_k"]

TILE = 4096
"""Rows per output tile (16 KiB of float32, in L1 while the sub-blocks sweep it), as :mod:`.intdot`'s."""

_F32 = np.float32
_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_F = ir.FloatType()
_V16I, _V16F, _V16B = ir.VectorType(_I32, 16), ir.VectorType(_F, 16), ir.VectorType(_I8, 16)

_SWEEP_SIG = types.void(*([types.intp] * 10), types.float32, types.float32, types.int32, types.intp, types.intp)

_SPEC = {0: ("q5", 8, 31), 1: ("q5", 8, 31), 2: ("q4", 8, 15), 3: ("q5", 8, 31), 4: ("q6", 4, 63)}
"""kind (:data:`.unpacked.KINDS`) -> (unpack kind, code vectors per sub-block, the largest code)."""


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    fn = _declare(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _scales(builder: ir.IRBuilder, kind: int, sv: ir.Value, mv: ir.Value, scp: ir.Value, mnp: ir.Value,
            at4: ir.Value, at1: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """(``s``, ``m``) of 16 rows as :func:`.unpacked._unpack_block` computes them (``m`` None
    where the kind has no min)."""
    d = builder.load(_at(builder, sv, at4, _V16F), align=4)
    if kind <= 1:
        return d, builder.load(_at(builder, mv, at4, _V16F), align=4) if kind == 1 else None
    sc = builder.load(_at(builder, scp, at1, _V16B), align=1)
    conv = builder.sitofp if kind == 4 else builder.uitofp          # q6_k's scales are int8
    s = builder.fmul(d, conv(sc, _V16F))
    if kind == 4:
        return s, None
    dmin = builder.load(_at(builder, mv, at4, _V16F), align=4)
    mn = builder.uitofp(builder.load(_at(builder, mnp, at1, _V16B), align=1), _V16F)
    return s, builder.fneg(builder.fmul(dmin, mn))


def _sweep_codegen(kind: int) -> Any:
    """IR of one sub-block's sweep over ``n`` rows (a multiple of 16). Arguments (addresses as
    int64, the arrays kept alive by the caller), all at the tile's first row: ``y`` (float32
    outputs); ``p``, ``h`` the sub-block's first code column and 5th-bit words (q6_k: bit-pair
    column); ``sv``, ``mv`` its ``d`` and ``m``/``dmin`` (float32); ``scp``, ``mnp`` its K-quant
    scale and min bytes; ``stride`` (``R``); ``xw1``, ``xw2`` the sub-block's input codes; ``fx``
    (the step ``dx``), ``sx`` (the float sum of its inputs), ``off`` (the offset times the code sum),
    ``n``."""
    unpack, groups, top = _SPEC[kind]

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        y, p, h, sv, mv, scp, mnp, stride, xw1, xw2, fx, sx, off, n, pf = args
        cols = [builder.add(p, builder.mul(stride, ir.Constant(_I64, 4 * g))) for g in range(groups // 2)]
        streams = cols + ([h] if unpack != "q4" else [])
        xs = [[_splat(builder, builder.load(_at(builder, xw, ir.Constant(_I64, 4 * c), _I32), align=4), _V16I)
               for c in range(groups)] for xw in (xw1, xw2)]
        hi_scale, hi_float = ir.Constant(_V16I, [HI] * 16), ir.Constant(_V16F, [float(HI)] * 16)
        fxv, sxv, offv = _splat(builder, fx, _V16F), _splat(builder, sx, _V16F), _splat(builder, off, _V16I)
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), n, ir.Constant(_I64, 16), intp=_I64) as (i, _):
            at4 = builder.mul(i, ir.Constant(_I64, 4))
            for at in streams:      # each stream of 64-byte vectors, PREFETCH bytes on
                _prefetch(builder, builder.add(at, at4), pf)
            codes = sub_codes(builder, unpack, builder.add(p, at4), builder.add(h, at4), stride)
            a1, a2 = _dots(builder, codes, xs, top)
            if kind in (0, 4):
                a2 = builder.add(a2, offv)
            if kind == 4:       # the q6_k pass's order (unpacked._pass_codegen)
                fsum = _fma(builder, builder.sitofp(a1, _V16F), hi_float, builder.sitofp(a2, _V16F))
            else:
                fsum = builder.sitofp(builder.add(builder.mul(a1, hi_scale), a2), _V16F)
            s, m = _scales(builder, kind, sv, mv, scp, mnp, at4, i)
            yp = _at(builder, y, at4, _V16F)
            acc = _fma(builder, fsum, builder.fmul(s, fxv), builder.load(yp, align=4))
            if m is not None:
                acc = _fma(builder, m, sxv, acc)
            builder.store(acc, yp, align=4)
        return context.get_dummy_value()
    return codegen


def _sweep_typing(kind: int) -> Any:
    def typing(typingctx: Any, y: Any, p: Any, h: Any, sv: Any, mv: Any, scp: Any, mnp: Any, stride: Any,
               xw1: Any, xw2: Any, fx: Any, sx: Any, off: Any, n: Any, pf: Any) -> Any:
        return _SWEEP_SIG, _sweep_codegen(kind)
    return typing


_sweep_q5_0: Any = intrinsic(_sweep_typing(0))
_sweep_q5_1: Any = intrinsic(_sweep_typing(1))
_sweep_q4_k: Any = intrinsic(_sweep_typing(2))
_sweep_q5_k: Any = intrinsic(_sweep_typing(3))
_sweep_q6_k: Any = intrinsic(_sweep_typing(4))


# ------------------------------------------------------------------------------------ the kernels


@njit(inline="always")
def _sweep(kind: int, args: Any) -> None:
    if kind == 0:
        _sweep_q5_0(*args)
    elif kind == 1:
        _sweep_q5_1(*args)
    elif kind == 2:
        _sweep_q4_k(*args)
    elif kind == 3:
        _sweep_q5_k(*args)
    else:
        _sweep_q6_k(*args)


@njit(inline="always")
def _mv(w: Any, x: Any, y: Any, r0: int, r1: int, kind: int) -> None:
    """Rows r0..r1 of ``y = W @ x`` for ``kind`` (:data:`.unpacked.KINDS`): the method above."""
    R, k = w.shape[0], x.shape[0]
    ns = k // 32
    xq1, xq2 = np.empty((1, k), np.int8), np.empty((1, k), np.int8)
    dx, sq, sx = np.empty((1, ns), np.float32), np.empty((1, ns), np.int32), np.empty((1, ns), np.float32)
    quantize_rows_into(np.ascontiguousarray(x).reshape((1, k)), xq1, xq2, dx, sq, sx, 0, 1)
    width = 16 if kind == 4 else 32
    dxw, offs = _offsets(xq1, xq2, dx, sq, width, -32 if kind == 4 else -16)   # unused but for q5_0, q6_k
    if kind != 4 and kind != 0:
        dxw = dx
    flat = w.reshape(-1)
    base = flat.ctypes.data
    od, om, oh, osc, omn, op, n = _sections(w, k, kind)
    per_p = 8 if kind == 4 else 16
    per_d = 16 if kind == 4 else 8 if kind >= 2 else 1     # sub-blocks per d
    xa1, xa2 = xq1.ctypes.data, xq2.ctypes.data
    r16 = r0 + (r1 - r0) // 16 * 16
    for t0 in range(r0, r16, TILE):
        t1 = min(t0 + TILE, r16)
        y[t0:t1] = 0
        ya = y[t0:t1].ctypes.data
        for s in range(n):
            args = (ya, base + op + per_p * s * R + 4 * t0, base + oh + 4 * (s * R + t0),
                    base + od + 4 * ((s // per_d) * R + t0), base + (om if om >= 0 else od) + 4 * ((s // per_d) * R + t0),
                    base + osc + s * R + t0, base + omn + s * R + t0, R, xa1 + width * s, xa2 + width * s,
                    dxw[0, s], sx[0, s * width // 32], offs[0, s], t1 - t0, PREFETCH)
            _sweep(kind, args)
    if r16 < r1:
        _blocks(w, xq1, xq2, dxw, offs, sx, y.reshape((1, R)), r16, r1, kind, width)


@njit(cache=True, nogil=True)
def mv_q5(w: Any, x: Any, y: Any, r0: int, r1: int, has_min: bool) -> None:
    """q5_0, q5_1 (``has_min``): rows r0..r1 of ``y = W @ x``, the GEMM's bits."""
    _mv(w, x, y, r0, r1, 1 if has_min else 0)


@njit(cache=True, nogil=True)
def mv_kquant(w: Any, x: Any, y: Any, r0: int, r1: int, five: bool) -> None:
    """q4_k, q5_k (``five``): rows r0..r1 of ``y = W @ x``, the GEMM's bits."""
    _mv(w, x, y, r0, r1, 3 if five else 2)


@njit(cache=True, nogil=True)
def mv_q6_k(w: Any, x: Any, y: Any, r0: int, r1: int) -> None:
    """q6_k: rows r0..r1 of ``y = W @ x``, the GEMM's bits."""
    _mv(w, x, y, r0, r1, 4)
