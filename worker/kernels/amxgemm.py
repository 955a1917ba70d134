"""Prefill products of f16 and bf16 weights on AMX tiles: float32 activation rows times 16-bit floats.

Owns the AMX prefill kernel of f16 and bf16 (:func:`gemm_amx`, the activation split
:func:`split_rows`, the tile configuration :data:`CONFIG`). Only the worker's backend thread calls
them, or the helper threads it hands disjoint row ranges to (``kernels.set_threads``): the kernel
releases the GIL, and each call loads the tile configuration in its own thread and releases the tiles
before it returns. :func:`available` asks Linux once per process for the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``); where the CPU numba compiles for lacks AMX-BF16 or
the kernel refuses, ``kernels`` runs the FMA kernel of :mod:`.halfgemm` instead. Compiled code is
cached on disk as :mod:`.jit`'s is (the tile instructions are inline assembly: numba's JIT does not
set up LLVM's assembly parser, this module does, at import).

Why AMX. ``tdpbf16ps`` multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 float32
accumulators: 8192 multiply-adds in one instruction, an order of magnitude more per cycle than
the FMA units. bf16 products are
exact in float32, and the tiles accumulate in float32, so the product stays float32-accurate if
the operands are *exact*: each activation is split into three bf16 levels, ``x = h + m + l``
(:func:`split_rows`: each level the top 16 bits of the float that the levels before left, so every
difference is exact and the three carry all 24 bits of the mantissa); bf16 weights are their own
bf16; an f16 weight (11 significant bits) splits exactly into ``hi + lo`` (the top 16 bits of its
float32, and the rest, at most 3 bits). So per 32 x 32 output block and 32 inputs the kernel runs
3 (bf16) or 5 (f16: ``h hi, h lo, m hi, m lo, l hi``; ``l lo`` is below float32's rounding)
tile products per quarter block. Rounding: float32 accumulation in the tiles (denormal inputs and
results flush to zero), the same order of error as a float32 BLAS.

Layouts. The weights stay packed as :mod:`.layout` has them (``u16 [K, R]``). For each block of 32
weight rows the kernel first repacks the block into B tiles (VNNI pairs: inputs ``2p``, ``2p+1`` of a
row side by side, one 64-byte tile row per pair and 16 rows; ``[chunk][level][half][16][32]``, 4 or
8 KiB per chunk of 32 inputs, in L1/L2; f16 split into its two levels there), then runs every block
of 32 activation rows against it; :func:`split_rows` lays the activation levels out as A tiles
``[row block][chunk][level][half][16][32]``. All tile memory is 64-byte aligned (a tile row that
straddles two cache lines makes each ``tileloadd`` several times slower). Activation rows past the last
multiple of 32, inputs past the last multiple of 32 and weight rows past the last whole block go
through zero padding (the output block then lands in a scratch and is copied).

How fast, against float32 BLAS on the dequantized weights: ``zmq-rpc-bench --cases kernels``;
the figures that chose this design: docs/DESIGN.md, "AMX tiles".
"""

from __future__ import annotations

from typing import Any, Final

import llvmlite.binding as llvm_binding
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .aot import request_amx
from .intdot import _at, _declare, _numba_cpu_features

__all__ = ["CONFIG", "TM", "available", "gemm_amx", "split_rows"]

TM: Final = 32
"""Activation rows per block (two 16-row tiles), weight rows per block likewise."""
GROUP: Final = 4
"""Blocks of 32 weight rows packed together: each input's row of the weights is then read as
``64 GROUP`` contiguous bytes (the layout puts ``2 R`` bytes between inputs: one cache line a row
was one TLB entry and one DRAM access a line; four blocks at a time make cold weights pack about
as fast as hot ones: docs/DESIGN.md)."""
PACK_AHEAD: Final = 16
"""Input pairs ahead that the packing of a weight block asks the cache for (its rows lie ``2 R``
bytes apart, too far for the hardware's prefetchers); it also asks for the next block's lines."""

_I16, _I32, _I64, _F = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V32I16, _V32I32, _V32F = ir.VectorType(_I16, 32), ir.VectorType(_I32, 32), ir.VectorType(_F, 32)
_V32H = ir.VectorType(ir.HalfType(), 32)

llvm_binding.initialize_native_asmparser()     # numba's JIT does not: inline assembly needs it


def _prefetch(builder: ir.IRBuilder, address: ir.Value) -> None:
    i8p = ir.PointerType(ir.IntType(8))
    fn = _declare(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.inttoptr(address, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 2),
                      ir.Constant(_I32, 1)])


def _asm(builder: ir.IRBuilder, text: str, constraint: str, args: list[ir.Value]) -> None:
    fty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.asm(fty, text, constraint, args, side_effect=True)


_state: dict[str, bool] = {}


def available() -> bool:
    """Whether this process may run AMX tiles (asked once: the CPU numba compiles for has AMX-BF16 and
    Linux grants the tile state, :func:`.aot.request_amx`)."""
    if "ok" not in _state:
        _state["ok"] = {"+amx-tile", "+amx-bf16"} <= _numba_cpu_features() and request_amx()
    return _state["ok"]


# ------------------------------------------------------------------------------------ intrinsics


def _cfg_typing(typingctx: Any, cfg: Any) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        _asm(builder, "ldtilecfg ($0)", "r,~{memory}", [args[0]])
        return context.get_dummy_value()
    return types.void(types.intp), codegen


def _release_typing(typingctx: Any) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        _asm(builder, "tilerelease", "~{memory}", [])
        return context.get_dummy_value()
    return types.void(), codegen


_tile_config: Any = intrinsic(_cfg_typing)
_tile_release: Any = intrinsic(_release_typing)

_F16_PAIRS = ((0, 0), (0, 1), (1, 1), (1, 0), (2, 0))     # (x level, w level): each load reused once
_BF16_PAIRS = ((0, 0), (1, 0), (2, 0))


def _block_codegen(bf16: bool) -> Any:
    """IR of one 32 x 32 output block over all ``nch`` chunks of 32 inputs: ``c`` (float32, row stride
    ``cstride`` bytes) = sum over the level pairs of A level (``a`` + level * ``alevel``, 32 rows of
    bf16 at ``astride`` bytes) times B level (``b`` + level * ``blevel``: per chunk two 1 KiB tiles)."""
    pairs = _BF16_PAIRS if bf16 else _F16_PAIRS

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        c, cstride, a, b, nch = args
        nlev = 1 if bf16 else 2
        for i in range(4):
            _asm(builder, f"tilezero %tmm{i}", "~{memory}", [])
        sixty4 = ir.Constant(_I64, 64)
        pre = builder.block
        loop = builder.append_basic_block("chunks")
        done = builder.append_basic_block("done")
        builder.branch(loop)
        builder.position_at_end(loop)
        ch = builder.phi(_I64)
        ch.add_incoming(ir.Constant(_I64, 0), pre)
        ao = builder.add(a, builder.mul(ch, ir.Constant(_I64, 3 * 2048)))
        bo = builder.add(b, builder.mul(ch, ir.Constant(_I64, nlev * 2048)))
        loaded: tuple[int, int] = (-1, -1)
        for la, lb in pairs:
            if la != loaded[0]:
                at = builder.add(ao, ir.Constant(_I64, 2048 * la))
                _asm(builder, "tileloadd ($0,$1,1), %tmm4", "r,r,~{memory}", [at, sixty4])
                _asm(builder, "tileloadd ($0,$1,1), %tmm5", "r,r,~{memory}",
                     [builder.add(at, ir.Constant(_I64, 1024)), sixty4])
            if lb != loaded[1]:
                bt = builder.add(bo, ir.Constant(_I64, 2048 * lb))
                _asm(builder, "tileloadd ($0,$1,1), %tmm6", "r,r,~{memory}", [bt, sixty4])
                _asm(builder, "tileloadd ($0,$1,1), %tmm7", "r,r,~{memory}",
                     [builder.add(bt, ir.Constant(_I64, 1024)), sixty4])
            loaded = (la, lb)
            for i, (ta, tb) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
                _asm(builder, f"tdpbf16ps %tmm{tb}, %tmm{ta}, %tmm{i}", "~{memory}", [])
        nxt = builder.add(ch, ir.Constant(_I64, 1))
        ch.add_incoming(nxt, loop)
        builder.cbranch(builder.icmp_signed("<", nxt, nch), loop, done)
        builder.position_at_end(done)
        c16 = builder.mul(cstride, ir.Constant(_I64, 16))
        for i, off in enumerate((ir.Constant(_I64, 0), ir.Constant(_I64, 64), c16,
                                 builder.add(c16, ir.Constant(_I64, 64)))):
            _asm(builder, f"tilestored %tmm{i}, ($0,$1,1)", "r,r,~{memory}", [builder.add(c, off), cstride])
        return context.get_dummy_value()
    return codegen


def _block_typing_for(bf16: bool) -> Any:
    def typing(typingctx: Any, c: Any, cstride: Any, a: Any, b: Any, nch: Any) -> Any:
        return types.void(*([types.intp] * 5)), _block_codegen(bf16)
    return typing


_block_f16: Any = intrinsic(_block_typing_for(False))
_block_bf16: Any = intrinsic(_block_typing_for(True))


_V16I16, _V16F, _V16H = ir.VectorType(_I16, 16), ir.VectorType(_F, 16), ir.VectorType(ir.HalfType(), 16)
_V32W = ir.VectorType(_I16, 32)
_HIGH_WORDS = ir.Constant(ir.VectorType(_I32, 32), [v for i in range(16) for v in (2 * i + 1, 32 + 2 * i + 1)])
_BOTH_WORDS = ir.Constant(ir.VectorType(_I32, 32), [v for i in range(16) for v in (i, 16 + i)])


def _pair_rows(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, bf16: bool) -> list[ir.Value]:
    """16 weights of input ``2p`` (``a``) and of input ``2p + 1`` (``b``), 16 x i16 each, as the 64-byte
    VNNI tile rows of each level (``a0 b0 a1 b1 ...``): bf16 as it is; f16 converted to float32 and
    split exactly into bf16 hi (the top 16 bits) and lo (the rest, as a float), the top 16-bit halves
    of the floats gathered by one word permutation each (``vpermt2w``)."""
    if bf16:
        return [builder.shuffle_vector(a, b, _BOTH_WORDS)]
    fa, fb = (builder.fpext(builder.bitcast(v, _V16H), _V16F) for v in (a, b))
    mask = ir.Constant(ir.VectorType(_I32, 16), [-65536] * 16)
    lows = [builder.fsub(f, builder.bitcast(builder.and_(builder.bitcast(f, ir.VectorType(_I32, 16)), mask), _V16F))
            for f in (fa, fb)]
    return [builder.shuffle_vector(builder.bitcast(u, _V32W), builder.bitcast(v, _V32W), _HIGH_WORDS)
            for u, v in ((fa, fb), (lows[0], lows[1]))]


def _pack_codegen(bf16: bool) -> Any:
    """IR of the B packing of ``nblk`` blocks of 32 weight rows (side by side in the source: each
    input's row read once, ``64 nblk`` contiguous bytes): for each pair ``p`` of inputs (``npairs``;
    source rows ``2p``, ``2p + 1`` at ``src + 2p * sstride``), each block ``i``, level and 16-row half
    ``j``, the 64-byte tile row at ``dst + i * dblk + (p // 16) * nlev * 2048 + level * 2048 + j * 1024
    + (p % 16) * 64``."""
    nlev = 1 if bf16 else 2

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        src, sstride, dst, npairs, nblk, dblk = args
        with cgutils.for_range(builder, npairs, intp=_I64) as pairs:
            p = pairs.index
            s0 = builder.add(src, builder.mul(p, builder.mul(sstride, ir.Constant(_I64, 2))))
            out = builder.add(builder.mul(builder.lshr(p, ir.Constant(_I64, 4)), ir.Constant(_I64, 2048 * nlev)),
                              builder.mul(builder.and_(p, ir.Constant(_I64, 15)), ir.Constant(_I64, 64)))
            ahead = builder.add(s0, builder.mul(sstride, ir.Constant(_I64, 2 * PACK_AHEAD)))
            with cgutils.for_range(builder, nblk, intp=_I64) as blocks:
                i = blocks.index
                at = builder.add(s0, builder.mul(i, ir.Constant(_I64, 64)))
                pf = builder.add(ahead, builder.mul(i, ir.Constant(_I64, 64)))
                _prefetch(builder, pf)
                _prefetch(builder, builder.add(pf, sstride))
                base = builder.add(builder.add(dst, out), builder.mul(i, dblk))
                for j in range(2):
                    a = builder.load(_at(builder, at, ir.Constant(_I64, 32 * j), _V16I16), align=2)
                    b = builder.load(_at(builder, builder.add(at, sstride), ir.Constant(_I64, 32 * j), _V16I16),
                                     align=2)
                    for lvl, row in enumerate(_pair_rows(builder, a, b, bf16)):
                        builder.store(row, _at(builder, base, ir.Constant(_I64, 2048 * lvl + 1024 * j), _V32W),
                                      align=2)
        return context.get_dummy_value()
    return codegen


def _pack_typing_for(bf16: bool) -> Any:
    def typing(typingctx: Any, src: Any, sstride: Any, dst: Any, npairs: Any, nblk: Any, dblk: Any) -> Any:
        return types.void(*([types.intp] * 6)), _pack_codegen(bf16)
    return typing


_pack_f16: Any = intrinsic(_pack_typing_for(False))
_pack_bf16: Any = intrinsic(_pack_typing_for(True))


def _bits_typing(typingctx: Any, v: Any) -> Any:
    if v != types.float32:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], _I32)
    return types.uint32(types.float32), codegen


def _float_typing(typingctx: Any, v: Any) -> Any:
    if not isinstance(v, types.Integer):
        return None

    width: int = getattr(v, "bitwidth")  # noqa: B009 (numba's Integer is untyped)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        value = args[0] if width == 32 else builder.trunc(args[0], _I32)
        return builder.bitcast(value, _F)
    return types.float32(v), codegen


def _split32_typing(typingctx: Any, src: Any, dst: Any) -> Any:
    """32 float32 at address ``src`` as three bf16 levels: 64 bytes each at ``dst``, ``dst + 2048``,
    ``dst + 4096`` (the level tiles of :func:`split_rows`)."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        src, dst = args
        mask, sixteen = ir.Constant(_V32I32, [-65536] * 32), ir.Constant(_V32I32, [16] * 32)
        f = builder.load(_at(builder, src, ir.Constant(_I64, 0), _V32F), align=4)
        levels = []
        for _ in range(2):
            top = builder.and_(builder.bitcast(f, _V32I32), mask)
            levels.append(top)
            f = builder.fsub(f, builder.bitcast(top, _V32F))
        levels.append(builder.bitcast(f, _V32I32))
        for i, v in enumerate(levels):
            builder.store(builder.trunc(builder.lshr(v, sixteen), _V32I16),
                          _at(builder, dst, ir.Constant(_I64, 2048 * i), _V32I16), align=2)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp), codegen


_split32: Any = intrinsic(_split32_typing)
_bits: Any = intrinsic(_bits_typing)
_float: Any = intrinsic(_float_typing)

# ------------------------------------------------------------------------------------ the kernels

_HI = np.uint32(0xFFFF0000)
_SH = np.uint32(16)


@njit(cache=True, nogil=True)
def _aligned(n: int) -> Any:
    """``n`` uint16 on a 64-byte boundary (a tile row: loads that straddle cache lines run slower)."""
    raw = np.empty(n + 32, np.uint16)
    off = (-raw.ctypes.data) % 64 // 2
    return raw[off:off + n]


@njit(cache=True, nogil=True)
def split_rows(x: Any) -> Any:
    """``x`` (T, K) float32 as three bf16 levels, ``x = h + m + l`` exactly (each level the top 16 bits
    of what the levels before left: truncation, so every difference is exact), stored as the kernel's
    A tiles: uint16 ``(T / 32, K / 32, 3, 2, 16, 32)`` (T, K rounded up to multiples of 32, zeros
    there): for each block of 32 rows, chunk of 32 inputs and level, two 16 x 32 tiles."""
    n, k = x.shape
    nt, nch = (n + TM - 1) // TM, (k + 31) // 32
    out = _aligned(nt * nch * 3072)
    if n % TM or k % 32:
        out[:] = 0
    full, xa, oa, xs = k // 32, x.ctypes.data, out.ctypes.data, x.strides[0]
    for t in range(n):
        base = t // TM * nch * 3072 + t % TM // 16 * 512 + t % 16 * 32
        for c in range(full):
            _split32(xa + t * xs + 128 * c, oa + 2 * (base + 3072 * c))
        o = base + 3072 * full
        for i in range(k - 32 * full):       # a last chunk of fewer than 32 inputs
            v = x[t, 32 * full + i]
            bh = _bits(v) & _HI
            r = v - _float(bh)
            bm = _bits(r) & _HI
            out[o + i] = np.uint16(bh >> _SH)
            out[o + 1024 + i] = np.uint16(bm >> _SH)
            out[o + 2048 + i] = np.uint16(_bits(r - _float(bm)) >> _SH)
    return out.reshape((nt, nch, 3, 2, 16, 32))


@njit(cache=True, nogil=True)
def _pack(src: int, sstride: int, dst: int, npairs: int, nblk: int, dblk: int, bf16: bool) -> None:
    if bf16:
        _pack_bf16(src, sstride, dst, npairs, nblk, dblk)
    else:
        _pack_f16(src, sstride, dst, npairs, nblk, dblk)


@njit(cache=True, nogil=True)
def gemm_amx(w: Any, xl: Any, y: Any, r0: int, r1: int, bf16: bool, cfg: Any) -> None:
    """f16 (``bf16`` False), bf16: columns r0..r1 of ``y = X @ W.T`` for ``xl`` = :func:`split_rows`
    ``(X)`` (``y`` (T, R) float32, rows C-contiguous; ``cfg`` the 64-byte tile configuration)."""
    R, n = w.shape[0], y.shape[0]
    nt, nch = xl.shape[0], xl.shape[1]
    kp = 32 * nch
    k = w.shape[1] // 2
    if (k + 31) // 32 != nch:
        raise ValueError("activation rows and weight rows differ in length")
    t = w.reshape(-1)[:2 * k * R].view(np.uint16).reshape((k, R))
    nlev = 1 if bf16 else 2
    dblk = nlev * nch * 2048
    bpack = _aligned(GROUP * dblk // 2)
    cbuf = _aligned(2 * TM * TM).view(np.float32).reshape((TM, TM))
    panel = np.zeros((kp, TM), np.uint16)
    ys = y.strides[0]
    xa, ba, ya, ca = xl.ctypes.data, bpack.ctypes.data, y.ctypes.data, cbuf.ctypes.data
    _tile_config(cfg.ctypes.data)
    for g in range(r0, r1, GROUP * TM):
        g1 = min(g + GROUP * TM, r1)
        whole = (g1 - g) // TM if kp == k else 0       # blocks packed straight from the weights
        if whole:
            _pack(t.ctypes.data + 2 * g, 2 * R, ba, kp // 2, whole, dblk, bf16)
        for b in range(whole, (g1 - g + TM - 1) // TM):  # ragged: through a zero-padded panel
            r = g + b * TM
            panel[:, :] = 0
            panel[:k, :min(TM, g1 - r)] = t[:, r:min(r + TM, g1)]
            _pack(panel.ctypes.data, 2 * TM, ba + b * dblk, kp // 2, 1, dblk, bf16)
        for b in range((g1 - g + TM - 1) // TM):
            r = g + b * TM
            m = min(TM, g1 - r)
            for tb in range(nt):
                t0 = tb * TM
                full = m == TM and t0 + TM <= n
                c, cs = (ya + t0 * ys + 4 * r, ys) if full else (ca, 4 * TM)
                a = xa + tb * nch * 6144
                if bf16:
                    _block_bf16(c, cs, a, ba + b * dblk, nch)
                else:
                    _block_f16(c, cs, a, ba + b * dblk, nch)
                if not full:
                    u = min(TM, n - t0)
                    y[t0:t0 + u, r:r + m] = cbuf[:u, :m]
    _tile_release()


def _tile_config_bytes() -> np.ndarray:
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1                              # palette 1
    cfg[16:32].view(np.uint16)[:8] = 64     # tiles 0-7: 64 bytes a row
    cfg[48:56] = 16                         # 16 rows
    return cfg


CONFIG: Final = _tile_config_bytes()
"""The 64-byte tile configuration every kernel call loads: palette 1, tiles 0-7 of 16 rows x 64 bytes."""
