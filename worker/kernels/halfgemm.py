"""Prefill products of f16 and bf16 weights with FMA: float32 activation rows times 16-bit floats.

Owns the FMA prefill kernel of f16 and bf16 (:func:`gemm_u16`): the one that runs where AMX does not
(:mod:`.amxgemm`; a CPU without AMX-BF16, or a kernel that refuses the tile state). Only the
worker's backend thread calls it, or the helper threads it hands disjoint row ranges to
(``kernels.set_threads``): the kernel releases the GIL. Compiled code is cached on disk as
:mod:`.jit`'s is.

The packed layout (``u16 [K, R]``, :mod:`.layout`) already is a GEMM's packed B panel: for input
``k`` the 32 weights of rows ``r..r+32`` are 64 contiguous bytes. One pass (:func:`_loop`, LLVM IR)
takes :data:`TB` activation rows against 32 weight rows over :data:`KC` inputs: per input two
16-lane conversions (``vcvtph2ps``; bf16: widen and shift), then one FMA per activation row and
half, ``x[t, k]`` broadcast, into 24 float32 accumulators that stay in registers; weights are read
at 16 bits and no float32 copy of them is written. Passes are balanced (32 rows as 11 + 11 + 10, not
12 + 12 + 8); weight rows past the last multiple of 16 go through a zero-padded 16-row panel. Every
product is one FMA per weight and input in input order: the rounding of a float32 dot product.

The fallback for CPUs without AMX (:mod:`.amxgemm`): about level with float32 BLAS, so there "no
slower than f32 mode" does not hold yet at 128 rows (the figures: docs/DESIGN.md, "Quantized
kernels").
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .intdot import _at, _declare, _splat

__all__ = ["TB", "gemm_u16"]

TB: Final = 12
"""Activation rows per pass over a block of 32 weight rows: 24 float32 accumulators, 2 weight vectors
and a broadcast in the 32 vector registers."""
KC: Final = 256
"""Inputs per pass: the 16 KiB of weights of a 32-row block and the 12 KiB of 12 activation rows
stay in L1 across the passes over that block."""
PREFETCH: Final = 64
"""Bytes ahead of each weight load asked for, into L2: the next 32-row block, same inputs."""

_I32, _I64, _F = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F, _V16U16, _V16H = ir.VectorType(_F, 16), ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.HalfType(), 16)
_V16I = ir.VectorType(_I32, 16)

_PASS_SIG = types.void(*([types.intp] * 10))


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    fn = _declare(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _prefetch(builder: ir.IRBuilder, address: ir.Value, locality: int) -> None:
    i8p = ir.PointerType(ir.IntType(8))
    fn = _declare(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.inttoptr(address, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                      ir.Constant(_I32, 1)])


def _convert(builder: ir.IRBuilder, bits: ir.Value, bf16: bool) -> ir.Value:
    if bf16:
        wide = builder.shl(builder.zext(bits, _V16I), ir.Constant(_V16I, [16] * 16))
        return builder.bitcast(wide, _V16F)
    return builder.fpext(builder.bitcast(bits, _V16H), _V16F)


def _loop(builder: ir.IRBuilder, bf16: bool, nv: int, tb: int, args: Any) -> None:
    """The pass of ``tb`` activation rows over ``16 nv`` weight rows, at the builder's position."""
    y, ystride, w, wstride, x, xstride, k, pf, first = args
    fresh = builder.icmp_signed("!=", first, ir.Constant(_I64, 0))
    zero = ir.Constant(_V16F, [0.0] * 16)
    starts = []
    for t in range(tb):
        for j in range(nv):
            yo = builder.add(builder.mul(ystride, ir.Constant(_I64, t)), ir.Constant(_I64, 64 * j))
            starts.append(builder.select(fresh, zero, builder.load(_at(builder, y, yo, _V16F), align=4)))
    pre = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("done")
    builder.branch(loop)
    builder.position_at_end(loop)
    kk = builder.phi(_I64)
    kk.add_incoming(ir.Constant(_I64, 0), pre)
    accs = []
    for start in starts:
        phi = builder.phi(_V16F)
        phi.add_incoming(start, pre)
        accs.append(phi)
    wo = builder.mul(kk, wstride)
    _prefetch(builder, builder.add(builder.add(w, wo), pf), 2)
    wv = [_convert(builder, builder.load(_at(builder, w, builder.add(wo, ir.Constant(_I64, 32 * j)), _V16U16),
                                         align=2), bf16) for j in range(nv)]
    x4 = builder.mul(kk, ir.Constant(_I64, 4))
    new = []
    for t in range(tb):
        xo = builder.add(builder.mul(xstride, ir.Constant(_I64, t)), x4)
        xv = _splat(builder, builder.load(_at(builder, x, xo, _F), align=4), _V16F)
        for j in range(nv):
            new.append(_fma(builder, wv[j], xv, accs[t * nv + j]))
    nxt = builder.add(kk, ir.Constant(_I64, 1))
    kk.add_incoming(nxt, loop)
    for phi, v in zip(accs, new):
        phi.add_incoming(v, loop)
    builder.cbranch(builder.icmp_signed("<", nxt, k), loop, done)
    builder.position_at_end(done)
    for t in range(tb):
        for j in range(nv):
            yo = builder.add(builder.mul(ystride, ir.Constant(_I64, t)), ir.Constant(_I64, 64 * j))
            builder.store(new[t * nv + j], _at(builder, y, yo, _V16F), align=4)


def _pass_codegen(bf16: bool, nv: int) -> Any:
    """IR of one pass: ``tb`` (1..TB, a switch) activation rows against ``16 nv`` weight rows over all
    ``k`` inputs. Arguments (addresses as int64): ``tb``; ``y`` (float32 output of the first
    activation row, first weight row) and its row stride in bytes; ``w`` the 16-bit weights of input 0,
    first weight row, ``wstride`` the bytes between inputs (``2 R``); ``x`` the float32 first activation
    row, ``xstride`` its row stride in bytes; ``k`` (>= 1); ``pf`` bytes ahead of each weight load
    prefetched."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        tb, rest = args[0], args[1:]
        exit_block = builder.append_basic_block("exit")
        switch = builder.switch(tb, exit_block)
        for n in range(1, TB + 1):
            case = builder.append_basic_block(f"tb{n}")
            switch.add_case(ir.Constant(_I64, n), case)
            builder.position_at_end(case)
            _loop(builder, bf16, nv, n, rest)
            builder.branch(exit_block)
        builder.position_at_end(exit_block)
        return context.get_dummy_value()
    return codegen


def _typing_for(bf16: bool, nv: int) -> Any:
    def typing(typingctx: Any, tb: Any, y: Any, ystride: Any, w: Any, wstride: Any, x: Any, xstride: Any,
               k: Any, pf: Any, first: Any) -> Any:
        return _PASS_SIG, _pass_codegen(bf16, nv)
    return typing


_f16_32: Any = intrinsic(_typing_for(False, 2))
_f16_16: Any = intrinsic(_typing_for(False, 1))
_bf16_32: Any = intrinsic(_typing_for(True, 2))
_bf16_16: Any = intrinsic(_typing_for(True, 1))


@njit(cache=True, nogil=True)
def gemm_u16(w: Any, x: Any, y: Any, r0: int, r1: int, bf16: bool) -> None:
    """f16 (``bf16`` False), bf16: columns r0..r1 of ``y = X @ W.T`` (``x`` (T, K), ``y`` (T, R) float32,
    rows C-contiguous)."""
    R = w.shape[0]
    n, k = x.shape
    t = w.reshape(-1)[:2 * k * R].view(np.uint16).reshape((k, R))
    wa, xa, ya = t.ctypes.data, x.ctypes.data, y.ctypes.data
    ys, xs = y.strides[0], x.strides[0]
    passes = (n + TB - 1) // TB       # balanced: 32 rows as 11 + 11 + 10, not 12 + 12 + 8
    size, extra = n // passes, n % passes
    r = r0
    while r1 - r >= 16:
        wide = r1 - r >= 32
        for k0 in range(0, k, KC):
            kc = min(KC, k - k0)
            t0 = 0
            for p in range(passes):
                m = size + (p < extra)
                args = (m, ya + t0 * ys + 4 * r, ys, wa + 2 * r + 2 * R * k0, 2 * R, xa + t0 * xs + 4 * k0, xs, kc,
                        PREFETCH, k0 == 0)
                if bf16 and wide:
                    _bf16_32(*args)
                elif bf16:
                    _bf16_16(*args)
                elif wide:
                    _f16_32(*args)
                else:
                    _f16_16(*args)
                t0 += m
        r += 32 if wide else 16
    if r < r1:
        _tail(t, x, y, r, r1, bf16)


@njit(cache=True, nogil=True)
def _tail(t: Any, x: Any, y: Any, r: int, r1: int, bf16: bool) -> None:
    """Rows r..r1 (fewer than 16): copied into a 16-row scratch panel, one masked-free pass each way."""
    n, k = x.shape
    panel = np.zeros((k, 16), np.uint16)
    panel[:, :r1 - r] = t[:, r:r1]
    out = np.empty((n, 16), np.float32)
    pa, xa, oa = panel.ctypes.data, x.ctypes.data, out.ctypes.data
    xs = x.strides[0]
    for t0 in range(0, n, TB):
        m = min(TB, n - t0)
        args = (m, oa + t0 * 64, 64, pa, 32, xa + t0 * xs, xs, k, 0, 1)
        if bf16:
            _bf16_16(*args)
        else:
            _f16_16(*args)
    y[:, r:r1] = out[:, :r1 - r]
