"""Integer prefill of the types whose codes are packed below a byte: q5_0, q5_1, q4_k, q5_k, q6_k.

Owns their integer GEMM. Only the worker's backend thread calls it, or the helper threads it hands
disjoint row ranges to (``kernels.set_threads``): the kernel releases the GIL and each call keeps
its own scratch. Compiled code is cached on disk as :mod:`.jit`'s is.

:mod:`.intgemm`'s method (read its docstring first: activation rows rounded to two int8 levels per
block of 32, ``vpdpbusd``, :data:`~.intgemm.TB` activation rows per pass over 16 weight rows) for the
types whose packed layout (:mod:`.layout`) keeps the codes' low 4 bits in nibble pairs (by fours, as
q4_0's) and their 5th/6th bits apart. Every one of them is ``w = s * c + m`` with small unsigned integer codes ``c``
and a float scale ``s`` and offset ``m`` per sub-block of ``L`` weights::

    q5_0   c 0..31  L 32   s = d            m = -16 d          y[t] += s dx[t] (isum - 16 sq[t])
    q5_1   c 0..31  L 32   s = d            m = m              y[t] += s dx[t] isum + m sx[t]
    q4_k   c 0..15  L 32   s = d sc         m = -dmin mn       (as q5_1)
    q5_k   c 0..31  L 32   s = d sc         m = -dmin mn       (as q5_1)
    q6_k   c 0..63  L 16   s = d sc         m = -32 s          y[t] += s dx[t] (isum - 32 sq[t])

(``sq``, ``sx``: the code sum and float sum of the activation row's ``L`` inputs; q6_k's steps
``dx`` per 32 serve both of its 16-weight groups, its code sums per 16 are summed here, once per
call.) So the kernel first *unpacks* each block of 16 weight rows, losslessly, into a per-call
scratch that stays in L1/L2: the codes as whole bytes interleaved by fours as q8_0 stores them
(byte ``4g + b`` of a sub-block's row at ``[g, row, b]``: one 64-byte vector per 4 inputs of 16
rows; 16 bytes per weight row and input, 24 KiB for SmolLM2's longest rows), ``s`` and ``m`` as
float32 per sub-block and row. The unpack (:func:`_unpack_codegen`, LLVM IR: one 64-byte load per
4 byte columns of 16 rows, stored by fours, nibbles split, the 5th bits moved into place by one shift and a mask,
q6_k's bit pairs by shifts and masks) costs ~1/30 of a 128-row pass, and every activation row then
meets the codes as in q8_0's kernel, with no unpacking in the passes (:func:`_pass_codegen`). The
packed layouts and their decode kernels are unchanged (no memory grows). Rows past the last
multiple of 16 of a range are unpacked by a scalar loop (:func:`_unpack_rows`, zero-padded) and
pass into a 16-column scratch output.

q6_k's passes are bound by the port that runs ``vpdpbusd`` (8 per 16 inputs and row, against
16 per 32 for the others, with the same per-group tail): they apply ``HI`` to the first level's sum
in float32 (two conversions and an FMA) instead of an integer multiply (two more micro-ops on that
port), faster (the sum then rounds to float32 once, far inside the tolerance).

Precision: as :mod:`.intgemm`'s (the rounding of the inputs, at most ``dx / 2`` per input, times
``|s c|``; the offsets of q5_0 and q6_k are exact integer sums, the mins of the others meet the float
sums of the unrounded inputs).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .intdot import HI, _at, _by_rows, _declare, _dots, _gemm_passes, _pass_rows, _splat

__all__ = ["KINDS", "PASSES", "TB", "gemm_unpacked", "unpack_rows"]

TB = 6
"""Activation rows per pass (as :data:`.intgemm.TB`)."""
PASSES = _gemm_passes(TB)
"""The row counts a pass is compiled for (as :data:`.intgemm.PASSES`)."""
KINDS: Final = {"q5_0": 0, "q5_1": 1, "q4_k": 2, "q5_k": 3, "q6_k": 4}
"""qtype -> the kernel's ``kind`` flag."""

_F32 = np.float32
_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(ir.FloatType(), 16)

_alloca: Any = cgutils.alloca_once_value


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` over 16 float32 lanes, rounded once."""
    fn = _declare(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _words(value: int) -> ir.Constant:
    """A 16-lane int32 constant (each lane ``value``: a byte pattern repeated)."""
    return ir.Constant(_V16I, [value] * 16)


# ------------------------------------------------------------------------------- the unpack


def _fours(builder: ir.IRBuilder, base: ir.Value) -> ir.Value:
    """The 4 byte columns of 16 rows at ``base`` (stored by fours, :mod:`.layout`) as 16 int32 lanes:
    byte ``b`` of lane ``i`` is column ``b`` of row ``i``. One load."""
    return builder.load(_at(builder, base, ir.Constant(_I64, 0), _V16I), align=1)


def _store(builder: ir.IRBuilder, dst: ir.Value, offset: ir.Value, value: ir.Value) -> None:
    builder.store(value, _at(builder, dst, offset, _V16I), align=64)


def sub_codes(builder: ir.IRBuilder, kind: str, p: ir.Value, h: ir.Value, stride: ir.Value) -> list[ir.Value]:
    """The code vectors of one sub-block of 16 rows (q6_k: one group of 16 inputs), unpacked: vector ``g``
    holds inputs ``4g..4g+3`` interleaved by fours (byte ``b`` of lane ``i``: input ``4g + b`` of row
    ``i``). ``p`` (and ``h``) address the first row's bytes of the sub-block's first group of 4 byte
    columns (its 5th-bit word; q6_k: its bit-pair columns), ``stride`` the bytes between byte
    positions (``R``: a group of 4 is ``4 R`` bytes); ``kind`` as
    :func:`_unpack_codegen`'s. Shared by the GEMM's unpack and the decode sweeps (:mod:`.unpackdot`)."""
    low, top2 = _words(0x0F0F0F0F), _words(0x30303030)
    four, two = _words(4), _words(2)
    if kind == "q6":
        a = _fours(builder, p)
        b = _fours(builder, builder.add(p, builder.mul(stride, ir.Constant(_I64, 4))))
        hb = _fours(builder, h)
        parts = [(builder.and_(a, low), builder.shl(hb, four)),
                 (builder.and_(b, low), hb),
                 (builder.and_(builder.lshr(a, four), low), builder.shl(hb, two)),
                 (builder.and_(builder.lshr(b, four), low), builder.lshr(hb, two))]
        return [builder.or_(code, builder.and_(bits, top2)) for code, bits in parts]
    hv = builder.load(_at(builder, h, ir.Constant(_I64, 0), _V16I), align=4) if kind == "q5" else None
    codes: list[Any] = [None] * 8
    for jq in range(4):
        v = _fours(builder, builder.add(p, builder.mul(stride, ir.Constant(_I64, 4 * jq))))
        for g, code in ((jq, builder.and_(v, low)), (jq + 4, builder.and_(builder.lshr(v, four), low))):
            codes[g] = code if hv is None else builder.or_(code, _fifth_bits(builder, hv, g))
    return codes


def _unpack_codegen(kind: str) -> Any:
    """IR that unpacks the codes of 16 weight rows into the scratch ``dst`` (64-byte aligned): ``kind``
    ``"q4"`` (nibble pairs ``p``), ``"q5"`` (and the 5th bits ``h`` u32 per sub-block) or ``"q6"``
    (q6_k's pairs per 16-weight group and bit pairs). Arguments (addresses as int64): ``dst``, ``p``
    and ``h`` at the block's first row, ``stride`` the bytes between byte positions (``R``), ``n``
    the sub-blocks (q6_k: groups of 16)."""
    per_p, per_h, groups = (8, 4, 4) if kind == "q6" else (16, 4, 8)

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        dst, p, h, stride, n = args
        with cgutils.for_range(builder, n, intp=_I64) as loop:
            s = loop.index
            ps = builder.add(p, builder.mul(s, builder.mul(stride, ir.Constant(_I64, per_p))))
            hs = builder.add(h, builder.mul(s, builder.mul(stride, ir.Constant(_I64, per_h))))
            out = builder.mul(s, ir.Constant(_I64, groups * 64))
            for g, code in enumerate(sub_codes(builder, kind, ps, hs, stride)):
                _store(builder, dst, builder.add(out, ir.Constant(_I64, 64 * g)), code)
        return context.get_dummy_value()
    return codegen


def _fifth_bits(builder: ir.IRBuilder, hv: ir.Value, g: int) -> ir.Value:
    """16 in byte ``b`` of lane ``i`` where row ``i``'s 5th bit of input ``4g + b`` is set: bit ``g`` of
    byte ``b`` of its word (:mod:`.layout`), moved to bit 4 by one shift of the lane (no bit crosses a
    byte: the shift is at most 4) and masked."""
    moved = builder.shl(hv, _words(4 - g)) if g < 4 else builder.lshr(hv, _words(g - 4)) if g > 4 else hv
    return builder.and_(moved, _words(0x10101010))


_UNPACK_SIG = types.void(types.intp, types.intp, types.intp, types.intp, types.intp)


def _unpack_typing(kind: str) -> Any:
    def typing(typingctx: Any, dst: Any, p: Any, h: Any, stride: Any, n: Any) -> Any:
        return _UNPACK_SIG, _unpack_codegen(kind)
    return typing


_unpack_q4: Any = intrinsic(_unpack_typing("q4"))
_unpack_q5: Any = intrinsic(_unpack_typing("q5"))
_unpack_q6: Any = intrinsic(_unpack_typing("q6"))


# ------------------------------------------------------------------------------- the passes

_ROWS_SIG = types.void(*([types.intp] * 14))


def _pass_codegen(groups: int, offset: int, tb: int) -> Any:
    """IR of one pass: ``tb`` activation rows against the 16 unpacked weight rows over ``n``
    sub-blocks of ``4 groups`` inputs: ``y[t] += s dx[t] (isum + offset sq[t]) (+ m sx[t]`` where
    ``offset`` is 0). Arguments (addresses as int64): ``y`` (float32 output of the first activation
    row, first weight row) and its row stride in bytes; ``codes``, ``s``, ``m`` the scratch (codes
    ``[n, groups, 16, 4]`` u8, ``s``/``m`` ``[n, 16]`` float32); ``xw1``, ``xw2`` the int8 codes of
    the first activation row, ``xstride`` the bytes between rows; ``dx``, ``sq``, ``sx`` per sub-block
    of the first activation row, and their row stride in bytes; ``n``."""
    width = 4 * groups
    top = 63 if groups == 4 else 31           # q6_k's 6-bit codes; q5_x's and q4_k/q5_k's 5-bit

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        y, ystride, codes, sv, mv, xw1, xw2, xstride, dx, sq, sx, sstride, n = args
        facc = [_alloca(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(tb)]
        hi_scale, hi_float = _words(HI), ir.Constant(_V16F, [float(HI)] * 16)
        with cgutils.for_range(builder, n, intp=_I64) as loop:
            s = loop.index
            base = builder.mul(s, ir.Constant(_I64, 64 * groups))
            vecs = [builder.load(_at(builder, codes, builder.add(base, ir.Constant(_I64, 64 * g)), _V16I), align=64)
                    for g in range(groups)]
            s64 = builder.mul(s, ir.Constant(_I64, 64))
            scale_v = builder.load(_at(builder, sv, s64, _V16F), align=4)
            min_v = builder.load(_at(builder, mv, s64, _V16F), align=4) if offset == 0 else None
            s4 = builder.mul(s, ir.Constant(_I64, 4))
            sw = builder.mul(s, ir.Constant(_I64, width))
            xos = [builder.add(builder.mul(xstride, ir.Constant(_I64, t)), sw) for t in range(tb)]
            inputs = []                           # per activation row, per level: its input words
            for t in range(tb):
                for xw in (xw1, xw2):
                    inputs.append([_splat(builder, builder.load(_at(builder, xw, builder.add(
                        xos[t], ir.Constant(_I64, 4 * c)), _I32), align=4), _V16I) for c in range(groups)])
            sums = _dots(builder, vecs, inputs, top)
            accs = [sums[2 * t:2 * t + 2] for t in range(tb)]
            for t in range(tb):
                so = builder.add(builder.mul(sstride, ir.Constant(_I64, t)), s4)
                isum = accs[t][1]
                if offset:          # ``sq`` holds ``offset * sq`` (one broadcast add)
                    isum = builder.add(isum, _splat(builder, builder.load(_at(builder, sq, so, _I32), align=4), _V16I))
                if groups == 4:     # q6_k: HI applied in float (2 conversions, no vpmulld: see the docstring)
                    fsum = _fma(builder, builder.sitofp(accs[t][0], _V16F), hi_float, builder.sitofp(isum, _V16F))
                else:
                    fsum = builder.sitofp(builder.add(builder.mul(accs[t][0], hi_scale), isum), _V16F)
                fx = builder.load(_at(builder, dx, so, ir.FloatType()), align=4)
                scale = builder.fmul(scale_v, _splat(builder, fx, _V16F))
                acc_f = _fma(builder, fsum, scale, builder.load(facc[t]))
                if min_v is not None:
                    sxt = builder.load(_at(builder, sx, so, ir.FloatType()), align=4)
                    acc_f = _fma(builder, min_v, _splat(builder, sxt, _V16F), acc_f)
                builder.store(acc_f, facc[t])
        for t in range(tb):
            yp = _at(builder, y, builder.mul(ystride, ir.Constant(_I64, t)), _V16F)
            builder.store(builder.load(facc[t]), yp, align=4)
        return context.get_dummy_value()
    return codegen


def _rows_typing(groups: int, offset: int) -> Any:
    def typing(typingctx: Any, rows: Any, y: Any, ystride: Any, codes: Any, s: Any, m: Any, xw1: Any,
               xw2: Any, xstride: Any, dx: Any, sq: Any, sx: Any, sstride: Any, n: Any) -> Any:
        return _ROWS_SIG, _by_rows({rows: _pass_codegen(groups, offset, rows) for rows in PASSES})
    return typing


# ``_pass_min(rows, *args)``: one pass of ``rows`` (one of PASSES) activation rows (as in .intgemm).
_pass_off16: Any = intrinsic(_rows_typing(8, -16))
_pass_min: Any = intrinsic(_rows_typing(8, 0))
_pass_q6: Any = intrinsic(_rows_typing(4, -32))


# ------------------------------------------------------------------------------- the kernel


@njit(inline="always")
def _sections(w: Any, k: int, kind: int) -> tuple[Any, Any, Any, Any, Any, int, int]:
    """Byte offsets into ``w``'s flat bytes: ``(d, m, h, sc, mn, p)`` sections (-1: absent)."""
    R, ns = w.shape[0], k // 32
    nb = ns // 8
    if kind <= 1:                                    # q5_0, q5_1: d [, m], h, p
        h = 4 * ns * R * (2 if kind == 1 else 1)
        return 0, 4 * ns * R if kind == 1 else -1, h, -1, -1, h + 4 * ns * R, ns
    if kind <= 3:                                    # q4_k, q5_k: d, dmin, [h], sc, mn, p
        h = 8 * nb * R
        sc = h + (4 * ns * R if kind == 3 else 0)
        return 0, 4 * nb * R, h if kind == 3 else -1, sc, sc + ns * R, sc + 2 * ns * R, ns
    ng = k // 16                                     # q6_k: d, h, sc, p
    nb = ng // 16
    return 0, -1, 4 * nb * R, 4 * nb * R + 4 * ng * R, -1, 4 * nb * R + 5 * ng * R, ng


@njit(inline="always")
def _fours_at(c: int, r: int, row: int) -> int:
    """Byte offset of column ``c``, row ``row`` in a section of ``r`` rows stored by fours (:mod:`.layout`)."""
    return (c - c % 4) * r + 4 * row + c % 4


@njit(cache=True, nogil=True)
def unpack_rows(w: Any, k: int, kind: int, r: int, cnt: int, codes: Any, s: Any, m: Any) -> None:
    """Rows ``r..r + cnt`` (cnt <= 16) of packed ``w`` into the scratch, rows past ``cnt`` zero: the
    codes ``codes[sub, g, i, b]`` (u8, input ``L sub + 4 g + b`` of row ``r + i``), the scales
    ``s[sub, i]`` and offsets ``m[sub, i]`` (float32; q5_0, q6_k: ``m`` unused). A scalar loop (the
    ragged rows of a range; the tests' reference for the vector unpack)."""
    R = w.shape[0]
    flat = w.reshape(-1)
    od, om, oh, osc, omn, op, n = _sections(w, k, kind)
    codes[:] = 0
    s[:] = 0
    m[:] = 0
    for i in range(cnt):
        row = r + i
        for sub in range(n):
            if kind == 4:
                for c in range(16):
                    byte = np.int64(flat[op + _fours_at(8 * sub + c % 8, R, row)])
                    nib = (byte & 15) if c < 8 else (byte >> 4)
                    hb = np.int64(flat[oh + _fours_at(4 * sub + c % 4, R, row)])
                    shift = np.int64((0, 4, 2, 6)[c // 4])
                    codes[sub, c // 4, i, c % 4] = nib | (((hb >> shift) & 3) << 4)
                d = flat[od:od + 4 * (n // 16) * R].view(np.float32)[(sub // 16) * R + row]
                s[sub, i] = d * _F32(flat[osc + sub * R + row:osc + sub * R + row + 1].view(np.int8)[0])
                continue
            for c in range(32):
                byte = np.int64(flat[op + _fours_at(16 * sub + c % 16, R, row)])
                code = (byte & 15) if c < 16 else (byte >> 4)
                if oh >= 0:
                    word = np.int64(flat[oh:oh + 4 * n * R].view(np.uint32)[sub * R + row])
                    code |= ((word >> (8 * (c % 4) + c // 4)) & 1) << 4
                codes[sub, c // 4, i, c % 4] = code
            if kind <= 1:
                s[sub, i] = flat[od:od + 4 * n * R].view(np.float32)[sub * R + row]
                if kind == 1:
                    m[sub, i] = flat[om:om + 4 * n * R].view(np.float32)[sub * R + row]
            else:
                nb = n // 8
                d = flat[od:od + 4 * nb * R].view(np.float32)[(sub // 8) * R + row]
                dmin = flat[om:om + 4 * nb * R].view(np.float32)[(sub // 8) * R + row]
                s[sub, i] = d * _F32(flat[osc + sub * R + row])
                m[sub, i] = -(dmin * _F32(flat[omn + sub * R + row]))


@njit(inline="always")
def _unpack_block(w: Any, k: int, kind: int, r: int, codes: Any, ca: int, s: Any, m: Any) -> None:
    """Rows ``r..r + 16`` into the scratch (``ca`` the codes' address): the vector unpack."""
    R = w.shape[0]
    flat = w.reshape(-1)
    base = flat.ctypes.data
    od, om, oh, osc, omn, op, n = _sections(w, k, kind)
    if kind == 4:
        _unpack_q6(ca, base + op + 4 * r, base + oh + 4 * r, R, n)
        d = flat[od:od + 4 * (n // 16) * R].view(np.float32).reshape((n // 16, R))
        sc = flat[osc:osc + n * R].view(np.int8).reshape((n, R))
        for sub in range(n):
            for i in range(16):
                s[sub, i] = d[sub // 16, r + i] * _F32(sc[sub, r + i])
        return
    if oh >= 0:
        _unpack_q5(ca, base + op + 4 * r, base + oh + 4 * r, R, n)
    else:
        _unpack_q4(ca, base + op + 4 * r, base, R, n)
    if kind <= 1:
        d = flat[od:od + 4 * n * R].view(np.float32).reshape((n, R))
        mm = flat[om if kind == 1 else od:][:4 * n * R].view(np.float32).reshape((n, R))
        for sub in range(n):
            for i in range(16):
                s[sub, i] = d[sub, r + i]
                m[sub, i] = mm[sub, r + i]       # q5_0: d again (unused)
        return
    nb = n // 8
    d = flat[od:od + 4 * nb * R].view(np.float32).reshape((nb, R))
    dmin = flat[om:om + 4 * nb * R].view(np.float32).reshape((nb, R))
    sc, mn = flat[osc:osc + n * R].reshape((n, R)), flat[omn:omn + n * R].reshape((n, R))
    for sub in range(n):
        for i in range(16):
            s[sub, i] = d[sub // 8, r + i] * _F32(sc[sub, r + i])
            m[sub, i] = -(dmin[sub // 8, r + i] * _F32(mn[sub, r + i]))


@njit(inline="always")
def _offsets(xq1: Any, xq2: Any, dx: Any, sq: Any, width: int, offset: int) -> tuple[Any, Any]:
    """The steps per ``width`` inputs (``dx`` repeated) and ``offset`` times the code sums
    ``HI sum xq1 + sum xq2`` per ``width`` inputs (int32)."""
    n, k = xq1.shape
    nsub = k // width
    dxs, offs = np.empty((n, nsub), np.float32), np.empty((n, nsub), np.int32)
    for t in range(n):
        for g in range(nsub):
            dxs[t, g] = dx[t, g * width // 32]
            if width == 32:
                offs[t, g] = np.int32(offset) * sq[t, g]
                continue
            acc = np.int32(0)
            for j in range(width):
                acc += np.int32(HI) * np.int32(xq1[t, width * g + j]) + np.int32(xq2[t, width * g + j])
            offs[t, g] = np.int32(offset) * acc
    return dxs, offs


@njit(cache=True, nogil=True)
def gemm_unpacked(w: Any, xq1: Any, xq2: Any, dx: Any, sq: Any, sx: Any, y: Any, r0: int, r1: int,
                  kind: int) -> None:
    """q5_0, q5_1, q4_k, q5_k, q6_k (``kind``: :data:`KINDS`): columns r0..r1 of ``y = X @ W.T`` for
    ``X`` rounded by :func:`.intgemm.quantize_rows` (``y`` (T, R) float32, rows C-contiguous)."""
    if kind == 4:
        dx16, off16 = _offsets(xq1, xq2, dx, sq, 16, -32)
        _blocks(w, xq1, xq2, dx16, off16, sx, y, r0, r1, kind, 16)
    elif kind == 0:
        dx32, off32 = _offsets(xq1, xq2, dx, sq, 32, -16)
        _blocks(w, xq1, xq2, dx32, off32, sx, y, r0, r1, kind, 32)
    else:
        _blocks(w, xq1, xq2, dx, sq, sx, y, r0, r1, kind, 32)


@njit(nogil=True)
def _blocks(w: Any, xq1: Any, xq2: Any, dx: Any, offs: Any, sx: Any, y: Any, r0: int, r1: int, kind: int,
            width: int) -> None:
    """The row blocks of :func:`gemm_unpacked` (the arrays are arguments: alive while their addresses
    are used): ``dx``, ``offs`` (the offset times the code sums; unused with a min) per ``width``
    inputs."""
    n, k = xq1.shape
    nsub = k // width
    groups = width // 4
    raw = np.empty(16 * k + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    codes = raw[start:start + 16 * k].reshape((nsub, groups, 16, 4))
    s, m = np.zeros((nsub, 16), np.float32), np.zeros((nsub, 16), np.float32)
    spare = np.empty((n, 16), np.float32)
    ys, ss = y.strides[0], dx.strides[0]
    for r in range(r0, r1, 16):
        cnt = min(16, r1 - r)
        ca = codes.ctypes.data
        if cnt == 16:
            _unpack_block(w, k, kind, r, codes, ca, s, m)
            out, os_ = y.ctypes.data + 4 * r, ys
        else:
            unpack_rows(w, k, kind, r, cnt, codes, s, m)
            out, os_ = spare.ctypes.data, spare.strides[0]
        sa, ma = s.ctypes.data, m.ctypes.data
        xa1, xa2, dxa, sqa, sxa = xq1.ctypes.data, xq2.ctypes.data, dx.ctypes.data, offs.ctypes.data, sx.ctypes.data
        t = 0
        while t < n:
            rows = _pass_rows(n - t, TB)
            args = (out + t * os_, os_, ca, sa, ma, xa1 + t * k, xa2 + t * k, k, dxa + t * ss, sqa + t * ss,
                    sxa + t * ss, ss, nsub)
            if kind == 4:
                _pass_q6(rows, *args)
            elif kind == 0:
                _pass_off16(rows, *args)
            else:
                _pass_min(rows, *args)
            t += rows
        if cnt < 16:
            y[:, r:r + cnt] = spare[:, :cnt]
