"""Integer matrix-vector products for decode: int8 activations times packed 4-bit and 8-bit codes.

Owns the integer decode kernels of q4_0, q4_1 and q8_0 (the types of a "Q4_0"/"Q4_1"/"Q8_0" llama
file). Only the worker's backend thread calls them, or the helper threads it hands disjoint row
ranges to (``kernels.set_threads``): every kernel releases the GIL. Compiled code is cached on disk
as :mod:`.jit`'s is.

llama.cpp's method, with a second int8 level. The float kernels of :mod:`.jit` convert every code to
float32 and multiply it by its input: about 4 codes per instruction, far below the memory's
bandwidth. Here the input vector ``x`` is rounded once per product to int8 blocks of 32,
in two levels: ``x ~ dx * (HI * xq1 + xq2)`` (``e = max|x| / 127`` per block, ``xq1 = rint(x / e)``,
``xq2`` the rest in steps ``dx = e / HI``, ``HI = 254``), and the codes meet both levels in integer
products summed into int32 (``isum = HI * (q . xq1) + q . xq2``, exact), so that one ``vpdpbusd``
(AVX512-VNNI: 64 unsigned bytes times 64 signed bytes, summed by fours into 16 int32 lanes) does 64
multiply-adds; the scales are applied once per 32-weight block and row::

    q4_0   y += d * dx * (isum - 8 * sum xq)          (w = d * (q - 8))
    q4_1   y += d * dx * isum + m * sum x             (w = d * q + m; ``sum x`` in float32)
    q8_0   y += d * dx * (isum' - 128 * sum xq)       (isum' over q + 128: the unsigned operand)

(``sum xq = HI * sum xq1 + sum xq2``), each term added as :mod:`.intgemm` adds it:
``y = fma(float(isum'), d * dx, y)``, then ``y = fma(m, sum x, y)``, with ``sum x`` in the same four
partial sums (:func:`_block_sum`), so that a row gives the same bits here as in the GEMM, whatever
else is in the batch (``kernels``, "Batch invariance"). The error this adds is the rounding of the inputs: at most
``dx / 2 = max|x| / 64516`` per input, so at most ``sum dx / 2 * |d q|`` per output (the tests hold
the kernels to that bound). llama.cpp stops at one level (``max|x| / 254`` per input): on SmolLM2 that
changed the 11th greedy token against the float32 reference; two levels keep the tokens, at little cost
(a sweep waits on memory more than on its integer work). Hot in cache it reads weights several
times faster than the float kernel; cold, it is memory bound (the scales stay float16 as in GGUF,
and the sweeps prefetch :data:`PREFETCH` bytes ahead in each stream): docs/DESIGN.md.

The packed layout (:mod:`.layout`): the codes of q4_0/q4_1/q8_0 are *interleaved by fours*: the 4
bytes of a row that one int32 lane takes are adjacent, and consecutive rows follow, so one 64-byte
load brings 4 bytes of 16 rows. The sweep over the rows of one sub-block (:func:`_sweep_q4`,
:func:`_sweep_q8`) is written in LLVM IR (numba cannot express a 512-bit vector): on a CPU with
AVX512-VNNI it calls ``llvm.x86.avx512.vpdpbusd.512``; elsewhere (or when numba is told to
compile for another CPU, ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``) the same sums in plain vector
IR (widen, multiply, add the four products of each lane), which any LLVM target compiles; the
choice depends only on the CPU features numba compiles for, which are part of numba's cache key, so
a cached kernel always matches the CPU. Rows past the last multiple of 16 go through a scalar loop.

AVX2 without VNNI (:data:`AVX2`; most consumer and many server CPUs) has llama.cpp's instructions
instead: ``vpmaddubsw`` (32 unsigned bytes times 32 signed bytes, adjacent products summed into 16
int16, *saturating*) and ``vpmaddwd`` by ones (adjacent int16 summed into 8 int32: the four bytes
of a lane, as ``vpdpbusd`` groups them). :func:`_dots` does a row group's whole sums, for every
input level and activation row at once: each 64-byte vector as two 32-byte halves, code by code
(the code vector in a register meets every input, the int16 sums stay in registers: 16 ymm,
against VNNI's 32 zmm), the ``vpmaddubsw`` results of several code vectors added in int16 before one
``vpmaddwd``. Exact, because no int16 can reach 2^15: an input code is at
most :data:`XMAX` = 127 in magnitude (both levels), so a product pair of codes ``0..top`` is at
most ``2 top 127`` and ``32767 // (2 top 127)`` of them are summed (q4 codes 8, q5 codes 4, q6_k's
6-bit codes 2). q8_0's codes are signed: made unsigned by +128 a pair could reach ``2 255 127``, so
instead ``vpsignb`` takes ``|q|`` and moves ``q``'s sign onto the input (a pair at most ``2 128 127
= 32512``, one product per ``vpmaddwd``), and the +128 offset (:data:`Q8_OFFSET`) disappears. The
int32 sums are the same integers on every path, and the float work after them the same IR, so the
products are bit-identical (tests/test_kernels.py compiles the other paths and compares bitwise).
On SmolLM2 Q4_1 (Zen 3, one thread, hot) the AVX2 sums made a token's products ~10x faster than the
portable IR, prefill 12-17x (docs/DESIGN.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

__all__ = ["AVX2", "HI", "PATH", "PATH_QTYPES", "PATH_TARGETS", "Q8_OFFSET", "TILE", "TWO_ROW_PASSES", "VNNI", "XMAX", "mv_q4", "mv_q8_0",
           "path_cache", "path_env", "path_problem", "quantize_x"]

TILE = 4096
"""Rows per output tile (16 KiB of float32 accumulators, in L1 while the sub-blocks sweep them)."""
_F32 = np.float32
HI = 254
"""Steps of the second int8 level per step of the first: ``x ~ dx * (HI * xq1 + xq2)``."""
_FMAX = np.float32(np.finfo(np.float32).max)


def _numba_cpu_features() -> set[str]:
    """The CPU features numba compiles for (its own rule: ``NUMBA_CPU_FEATURES`` or the host's)."""
    numba_config: Any = config
    host: Any = get_host_cpu_features
    features = numba_config.CPU_FEATURES if numba_config.CPU_FEATURES is not None else host()
    return set(str(features).split(","))


VNNI = {"+avx512f", "+avx512bw", "+avx512vnni"} <= _numba_cpu_features()
"""Whether the sweeps use ``vpdpbusd``."""
AVX2 = not VNNI and "+avx2" in _numba_cpu_features()
"""Whether the sweeps use AVX2's ``vpmaddubsw`` + ``vpmaddwd`` (else, without VNNI, the portable
vector IR: same sums, slower)."""
PATH = "vnni" if VNNI else "avx2" if AVX2 else "portable"
"""The integer path this process's kernels take."""
TWO_ROW_PASSES = PATH != "portable"
"""Whether the GEMMs have 2-row passes for the rows past their last full pass (:func:`_pass_rows`).
Not on the portable path: its wide vectors split into many narrow ones, and one more pass body per
kernel made its first compile 1.5x longer, for CPUs without AVX2."""
PATH_TARGETS = {     # numba told to compile for a CPU: (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES)
    "avx2": ("haswell", "+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1,"
                        "+sse4.2,+ssse3"),
    "portable": ("ivybridge", "+avx,+cx16,+f16c,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3"),
}
"""The other paths a process can be told to compile (tests/test_kernels.py compares their products
with this process's bit for bit; ``python -m zmq_rpc.worker.kernels --path NAME`` compiles them ahead)."""
PATH_QTYPES = ("q4_0", "q5_0", "q6_k", "q8_0")
"""The block types compiled for another path: one per bound of AVX2's 16-bit partial sums (8 products
of 4-bit codes, 4 of 5-bit, 2 of 6-bit) and q8_0's sign trick, decode (:mod:`.intdot`,
:mod:`.unpackdot`) and prefill; q4_1, q5_1, q4_k and q5_k reach the same bounds through the same
:func:`_dots`."""


def path_problem(path: str) -> str | None:
    """Why this process cannot compile and run ``path``'s kernels beside its own (None: it can)."""
    cpu, features = PATH_TARGETS[path]
    if path == PATH:
        return f"this process's kernels are the {path} ones"
    if not set(features.split(",")) <= _numba_cpu_features():
        return f"this CPU cannot run {cpu} code"
    return None


def path_cache(path: str) -> str:
    """numba's cache folder for ``path``'s kernels, beside the kernels' own: only the first process
    that runs them compiles them (``--path`` in ``run.py``'s setup, or the first test run)."""
    return os.path.join(os.path.dirname(__file__), "__pycache__", f"cpu-{path}")


def path_env(path: str) -> dict[str, str]:
    """The environment variables that make a new process compile ``path``'s kernels into
    :func:`path_cache`."""
    cpu, features = PATH_TARGETS[path]
    return {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features, "NUMBA_CACHE_DIR": path_cache(path)}


XMAX = 127
"""The largest ``|code|`` of either input level (:func:`quantize_x`: ``|x / e| <= 127`` rounds to at
most 127, ``xq2`` is clamped to it; a NaN block's codes are 0): what bounds AVX2's 16-bit sums."""
Q8_OFFSET = 0 if AVX2 else -128
"""Times the input's code sum that q8_0's integer sums take back: -128 where the codes go in
unsigned (+128, for ``vpdpbusd``), 0 where AVX2 multiplies them signed (``vpsignb``)."""

_I32, _I64, _F = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I, _V16F = ir.VectorType(_I32, 16), ir.VectorType(_F, 16)
_V16H, _V16U16 = ir.VectorType(ir.HalfType(), 16), ir.VectorType(ir.IntType(16), 16)


def _half_typing(typingctx: Any, bits: Any) -> Any:
    """float16 bits (uint16) -> float32, exact (LLVM ``fpext half``: one ``vcvtph2ps`` per vector with F16C)."""
    if bits != types.uint16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


_half: Any = intrinsic(_half_typing)


PREFETCH = 1024
"""Bytes ahead in each stream of codes that the sweeps ask the cache for (software prefetch: the
hardware's streams stop at every 4 KiB page; the fastest distance on SmolLM2's matrices:
docs/DESIGN.md)."""


def _prefetch(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> None:
    """Ask for the cache line at byte ``base + offset`` (read, keep in all levels)."""
    i8p = ir.PointerType(ir.IntType(8))
    fn = _declare(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.inttoptr(builder.add(base, offset), i8p), ir.Constant(_I32, 0),
                      ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _load_halves(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value) -> ir.Value:
    """16 float16 values at byte ``base + offset``, as float32."""
    bits = builder.load(_at(builder, base, offset, _V16U16), align=2)
    return builder.fpext(builder.bitcast(bits, _V16H), _V16F)


def _splat(builder: ir.IRBuilder, value: ir.Value, vtype: ir.VectorType) -> ir.Value:
    undef = ir.Constant(vtype, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vtype.count), [0] * vtype.count))


_declare: Any = cgutils.get_or_insert_function


def _dot4(builder: ir.IRBuilder, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
    """``acc[i] += sum_j a.u8[4i + j] * b.i8[4i + j]`` over 16 int32 lanes (``vpdpbusd``; the
    portable IR elsewhere: no AVX2 path here, :func:`_dots` has it)."""
    if VNNI:
        fnty = ir.FunctionType(_V16I, [_V16I, _V16I, _V16I])
        dp = _declare(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(dp, [acc, a, b])
    v64i8, v64i32 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(_I32, 64)
    prod = builder.mul(builder.zext(builder.bitcast(a, v64i8), v64i32),
                       builder.sext(builder.bitcast(b, v64i8), v64i32))
    undef = ir.Constant(v64i32, ir.Undefined)
    for j in range(4):
        lanes = ir.Constant(ir.VectorType(_I32, 16), [4 * i + j for i in range(16)])
        acc = builder.add(acc, builder.shuffle_vector(prod, undef, lanes))
    return acc


_V32B, _V16S, _V8I = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8)
_V64B = ir.VectorType(ir.IntType(8), 64)


def _halves(builder: ir.IRBuilder, v: ir.Value) -> list[ir.Value]:
    """The two 32-byte halves of a 64-byte vector (two ymm registers: no instruction)."""
    b = builder.bitcast(v, _V64B)
    undef = ir.Constant(_V64B, ir.Undefined)
    return [builder.shuffle_vector(b, undef, ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32))))
            for h in range(2)]


def _avx2(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = _declare(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _dots(builder: ir.IRBuilder, codes: list[ir.Value], inputs: list[list[ir.Value]], top: int,
          signed: bool = False) -> list[ir.Value]:
    """Integer sums over 16 int32 lanes, one per list ``xs`` in ``inputs``: ``sum_c sum_j a_c.u8[4i + j]
    * xs[c].i8[4i + j]`` for the ``a_c`` in ``codes`` (codes ``0..top``, or with ``signed`` int8
    codes, ``|a| <= 128``; the inputs' codes ``|x| <= XMAX``). VNNI: ``vpdpbusd`` chains, code by
    code, the chains side by side; AVX2: per 32-byte half and code, ``vpmaddubsw`` (u8 x s8,
    adjacent pairs summed to int16, saturating) against each input, as many int16 results added as
    cannot reach 2^15 (``2 top XMAX`` each), then one ``vpmaddwd`` by ones (int16 pairs summed to
    int32: the four bytes of a lane), exact; ``signed`` codes first go through ``vpsignb`` (``|a|``
    times ``x`` with ``a``'s sign: a pair at most 2 128 127 = 32512). Elsewhere the portable IR of
    :func:`_dot4` (VNNI and portable make a signed ``a`` unsigned by +128: the caller takes back
    :data:`Q8_OFFSET` times the input's code sum)."""
    zero = ir.Constant(_V16I, [0] * 16)
    if not AVX2:
        sign = ir.Constant(_V16I, [-0x7F7F7F80] * 16)      # 0x80808080: flips each byte's sign bit
        accs = [zero] * len(inputs)
        for c, a in enumerate(codes):
            a = builder.xor(a, sign) if signed else a
            accs = [_dot4(builder, acc, a, xs[c]) for acc, xs in zip(accs, inputs)]
        return accs
    chunk = max(1, (2 ** 15 - 1) // (2 * (128 if signed else top) * XMAX))
    ones = ir.Constant(_V16S, [1] * 16)
    halves = []
    for h in range(2):
        totals: list[Any] = [None] * len(inputs)
        for c0 in range(0, len(codes), chunk):
            parts: list[Any] = [None] * len(inputs)
            for c in range(c0, min(c0 + chunk, len(codes))):
                a = _halves(builder, codes[c])[h]
                au = _avx2(builder, "llvm.x86.avx2.psign.b", _V32B, [a, a]) if signed else a
                for j, xs in enumerate(inputs):
                    x = _halves(builder, xs[c])[h]
                    if signed:
                        x = _avx2(builder, "llvm.x86.avx2.psign.b", _V32B, [x, a])
                    prod = _avx2(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16S, [au, x])
                    parts[j] = prod if parts[j] is None else builder.add(parts[j], prod)
            for j in range(len(inputs)):
                wide = _avx2(builder, "llvm.x86.avx2.pmadd.wd", _V8I, [parts[j], ones])
                totals[j] = wide if totals[j] is None else builder.add(totals[j], wide)
        halves.append(totals)
    join = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
    return [builder.shuffle_vector(lo, hi, join) for lo, hi in zip(*halves)]


def _at(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value, vtype: ir.Type) -> ir.Value:
    return builder.inttoptr(builder.add(base, offset), ir.PointerType(vtype))


def _by_rows(bodies: Mapping[int, Any]) -> Any:
    """One intrinsic's codegen whose first argument, ``rows``, picks the codegen ``bodies[rows]``
    to run on the other arguments: a switch in the IR (a GEMM's passes over a block's activation
    rows, one intrinsic for every count it has a pass of). A count without one does nothing."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        done = builder.append_basic_block("rows.done")
        switch = builder.switch(args[0], done)
        for rows, body in bodies.items():
            block = builder.append_basic_block(f"rows.{rows}")
            switch.add_case(ir.Constant(args[0].type, rows), block)
            builder.position_at_end(block)
            body(context, builder, sig, args[1:])
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return codegen


def _gemm_passes(tb: int) -> tuple[int, ...]:
    """The activation row counts a GEMM's passes are compiled for, the ones :func:`_pass_rows`
    picks from: ``tb``, then 2 (:data:`TWO_ROW_PASSES`) and 1."""
    return (tb, 2, 1) if TWO_ROW_PASSES else (tb, 1)


@njit(cache=True, nogil=True)
def _pass_rows(left: int, tb: int) -> int:
    """How many of the ``left`` activation rows a GEMM's next pass takes: ``tb``, then 2-row passes
    (:data:`TWO_ROW_PASSES`) and a one-row one (:data:`.intgemm.PASSES`)."""
    return tb if left >= tb else 2 if left >= 2 and TWO_ROW_PASSES else 1


_SWEEP_SIG = types.void(types.intp, types.intp, types.intp, types.intp, types.intp, types.intp, types.intp,
                        types.float32, types.float32, types.int32, types.intp, types.intp)


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` over 16 float32 lanes, rounded once (``llvm.fma``: one ``vfmadd``)."""
    fn = _declare(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _sweep_codegen(groups: int, nibbles: bool) -> Any:
    """IR of one sub-block's sweep over ``n`` rows (a multiple of 16): ``y[i] = fma(m[i], c1,
    fma(float(isum_i + ioff), d[i] * fx, y[i]))`` (``d``, ``m`` float16), where ``isum_i = HI * (q_i . xq1) + q_i . xq2`` over the codes ``q_i``
    of row ``i``, held in ``groups`` int32 words (word ``g`` at byte ``p + g * gstride + 4 i``), and the
    input codes at ``xw1``, ``xw2`` (int8, one int32 word per 4): with ``nibbles`` each word holds 8
    codes (low nibbles for inputs ``4g..4g+3``, high for ``16+4g..``; ``m`` is read), else 4 signed
    codes (:func:`_dots`: ``ioff`` takes back :data:`Q8_OFFSET` times the code sum; ``m`` unused). All pointers are
    addresses (int64), the arrays being kept alive by the caller."""
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        y, p, gstride, d, m, xw1, xw2, fx, c1, ioff, n, pf = args
        words = 2 * groups if nibbles else groups
        xs = [[_splat(builder, builder.load(_at(builder, xw, ir.Constant(_I64, 4 * k), _I32), align=4), _V16I)
               for k in range(words)] for xw in (xw1, xw2)]
        hi_scale = ir.Constant(_V16I, [HI] * 16)
        fxv, c1v, ioffv = _splat(builder, fx, _V16F), _splat(builder, c1, _V16F), _splat(builder, ioff, _V16I)
        low = ir.Constant(_V16I, [0x0F0F0F0F] * 16)
        four = ir.Constant(_V16I, [4] * 16)
        start, step = ir.Constant(_I64, 0), ir.Constant(_I64, 16)
        with cgutils.for_range_slice(builder, start, n, step, intp=_I64) as (i, _):
            off4 = builder.mul(i, ir.Constant(_I64, 4))
            off2 = builder.mul(i, ir.Constant(_I64, 2))
            codes, order = [], []
            for g in range(groups):
                at = builder.add(builder.mul(gstride, ir.Constant(_I64, g)), off4)
                _prefetch(builder, p, builder.add(at, pf))       # the same stream, ``pf`` bytes on
                v = builder.load(_at(builder, p, at, _V16I), align=1)
                group = [builder.and_(v, low), builder.and_(builder.lshr(v, four), low)] if nibbles else [v]
                codes += group
                order += [h * groups + g for h in range(len(group))]
            acc = _dots(builder, codes, [[x[k] for k in order] for x in xs], 15, signed=not nibbles)
            isum = builder.add(builder.add(builder.mul(acc[0], hi_scale), acc[1]), ioffv)
            yp = _at(builder, y, off4, _V16F)       # the GEMM's roundings (module docstring)
            scale = builder.fmul(_load_halves(builder, d, off2), fxv)
            t = _fma(builder, builder.sitofp(isum, _V16F), scale, builder.load(yp, align=4))
            if nibbles:
                t = _fma(builder, _load_halves(builder, m, off2), c1v, t)
            builder.store(t, yp, align=4)
        return context.get_dummy_value()
    return codegen


def _sweep_q4_typing(typingctx: Any, y: Any, p: Any, gstride: Any, d: Any, m: Any, xw1: Any, xw2: Any, fx: Any,
                     c1: Any, ioff: Any, n: Any, pf: Any) -> Any:
    return _SWEEP_SIG, _sweep_codegen(4, True)


def _sweep_q8_typing(typingctx: Any, y: Any, p: Any, gstride: Any, d: Any, m: Any, xw1: Any, xw2: Any, fx: Any,
                     c1: Any, ioff: Any, n: Any, pf: Any) -> Any:
    return _SWEEP_SIG, _sweep_codegen(8, False)


_sweep_q4: Any = intrinsic(_sweep_q4_typing)
_sweep_q8: Any = intrinsic(_sweep_q8_typing)


# ------------------------------------------------------------------------------------ the kernels


@njit(inline="always")
def _code(xq1: Any, xq2: Any, k: int) -> Any:
    """Input ``k`` in steps of the block's ``dx``: ``HI xq1 + xq2``."""
    return HI * np.int64(xq1[k]) + np.int64(xq2[k])


@njit(inline="always")
def _block_sum(x: Any, o: int) -> Any:
    """The float32 sum of ``x[o:o + 32]`` in four partial sums, as ``intgemm.quantize_rows`` adds
    a row's block (the same roundings: a row's q4_1 min term is the same in both kernels)."""
    s0, s1, s2, s3 = _F32(0), _F32(0), _F32(0), _F32(0)
    for j in range(0, 32, 4):
        s0 += x[o + j]
        s1 += x[o + j + 1]
        s2 += x[o + j + 2]
        s3 += x[o + j + 3]
    return (s0 + s1) + (s2 + s3)


@njit(cache=True, nogil=True)
def quantize_x(x: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``x`` (K,) float32 in int8 blocks of 32, two levels: ``(xq1, xq2, dx, sq, sx)``, ``x ~ dx * (HI xq1
    + xq2)``: the codes (K,) int8 (``xq1 = rint(x / e)``, ``e = max|x| / 127``; ``xq2`` the rest
    ``x - e xq1`` in steps of ``dx = e / HI``), ``dx`` per block, the code sums ``HI sum xq1 + sum xq2``
    (int32) and the float32 sums of ``x`` per block. A block with a NaN or an infinity gets codes 0
    and ``dx`` NaN (its products come out NaN)."""
    ns = x.shape[0] // 32
    xq1, xq2 = np.zeros(x.shape[0], np.int8), np.zeros(x.shape[0], np.int8)
    dx, sq, sx = np.empty(ns, np.float32), np.zeros(ns, np.int32), np.empty(ns, np.float32)
    for s in range(ns):
        amax, bad = _F32(0), False
        for j in range(32):
            v = x[32 * s + j]
            a = abs(v)
            bad |= not a <= _FMAX
            if a > amax:
                amax = a
        sx[s] = _block_sum(x, 32 * s)
        if bad:
            dx[s] = np.float32(np.nan)
            continue
        e = amax / _F32(127)
        dx[s] = e / _F32(HI)
        if amax == 0:
            continue
        inv = _F32(127) / amax
        inv2 = inv * _F32(HI)
        acc = 0
        for j in range(32):
            v = x[32 * s + j]
            q1 = np.rint(v * inv)
            q2 = min(max(np.rint((v - q1 * e) * inv2), _F32(-127)), _F32(127))
            xq1[32 * s + j], xq2[32 * s + j] = np.int8(q1), np.int8(q2)
            acc += HI * np.int64(q1) + np.int64(q2)
        sq[s] = acc
    return xq1, xq2, dx, sq, sx


@njit(cache=True, nogil=True)
def mv_q4(w: Any, x: Any, y: Any, r0: int, r1: int, has_min: bool) -> None:
    """q4_0 (``has_min`` False), q4_1: rows r0..r1 of ``y = W @ x`` (the int8 method above)."""
    R, ns = w.shape[0], x.shape[0] // 32
    flat = w.reshape(-1)
    d = flat[:2 * ns * R].view(np.uint16).reshape((ns, R))
    m = flat[2 * ns * R if has_min else 0:][:2 * ns * R].view(np.uint16).reshape((ns, R))  # d if no min (unused)
    off = 8 * ns * R if has_min else 4 * ns * R
    p = flat[off:off + 16 * ns * R].view(np.uint32).reshape((4 * ns, R))
    xq1, xq2, dx, sq, sx = quantize_x(x)
    xw1, xw2 = xq1.view(np.int32), xq2.view(np.int32)
    for t0 in range(r0, r1, TILE):
        t1 = min(t0 + TILE, r1)
        n = t1 - t0
        n16 = n // 16 * 16
        yt = y[t0:t1]
        yt[:] = 0
        for s in range(ns):
            c1 = sx[s] if has_min else _F32(0)
            ioff = np.int32(0) if has_min else np.int32(-8 * sq[s])
            ds, ms, fx = d[s][t0:t1], m[s][t0:t1], dx[s]
            _sweep_q4(yt.ctypes.data, p[4 * s][t0:t1].ctypes.data, 4 * R, ds.ctypes.data, ms.ctypes.data,
                      xw1[8 * s:8 * s + 8].ctypes.data, xw2[8 * s:8 * s + 8].ctypes.data, fx, c1, ioff, n16, PREFETCH)
            for i in range(n16, n):
                acc = 0
                for g in range(4):
                    word = np.int64(p[4 * s + g][t0 + i])
                    for b in range(4):
                        byte = (word >> (8 * b)) & 255
                        acc += (byte & 15) * _code(xq1, xq2, 32 * s + 4 * g + b)
                        acc += (byte >> 4) * _code(xq1, xq2, 32 * s + 16 + 4 * g + b)
                t = _F32(np.int32(acc + ioff)) * (_half(ds[i]) * fx)
                if has_min:
                    t += _half(ms[i]) * c1
                yt[i] += t


@njit(cache=True, nogil=True)
def mv_q8_0(w: Any, x: Any, y: Any, r0: int, r1: int) -> None:
    """q8_0: rows r0..r1 of ``y = W @ x`` (the int8 method above)."""
    R, ns = w.shape[0], x.shape[0] // 32
    flat = w.reshape(-1)
    d = flat[:2 * ns * R].view(np.uint16).reshape((ns, R))
    q = flat[4 * ns * R:36 * ns * R]
    words = q.view(np.uint32).reshape((8 * ns, R))
    codes = q.view(np.int8).reshape((8 * ns, 4 * R))
    xq1, xq2, dx, sq, _ = quantize_x(x)
    xw1, xw2 = xq1.view(np.int32), xq2.view(np.int32)
    for t0 in range(r0, r1, TILE):
        t1 = min(t0 + TILE, r1)
        n = t1 - t0
        n16 = n // 16 * 16
        yt = y[t0:t1]
        yt[:] = 0
        for s in range(ns):
            ds, fx = d[s][t0:t1], dx[s]
            _sweep_q8(yt.ctypes.data, words[8 * s][t0:t1].ctypes.data, 4 * R, ds.ctypes.data, ds.ctypes.data,
                      xw1[8 * s:8 * s + 8].ctypes.data, xw2[8 * s:8 * s + 8].ctypes.data, fx, _F32(0),
                      np.int32(Q8_OFFSET * sq[s]), n16, PREFETCH)
            for i in range(n16, n):
                acc = 0
                for g in range(8):
                    for b in range(4):
                        acc += np.int64(codes[8 * s + g][4 * (t0 + i) + b]) * _code(xq1, xq2, 32 * s + 4 * g + b)
                yt[i] += _F32(np.int32(acc)) * (_half(ds[i]) * fx)
