"""The packed quantized kernels (``worker/kernels``) against gguf's numpy dequantization.

No sockets: the layout, the repack, the numba matrix-vector and tile kernels, the thread split and the
op rules. The oracle is ``gguf.quants.dequantize`` of the original GGUF bytes: the packed dequantizer
must match it bit for bit; products must match float64 ``x @ W.T`` of those weights within
``MV_RTOL * (|x| @ |W|.T)`` (float32 accumulation over up to a few thousand terms, reassociated).
The decode products of the block types (``kernels.intdot``, ``kernels.unpackdot``) round the inputs to two int8 levels
per block of 32 first (``x ~ dx (HI xq1 + xq2)``, ``dx = max|x| / 127 / HI``): they must match float64
``xhat @ W.T`` for ``xhat`` those rounded inputs within the same ``MV_RTOL``, and so float64 ``x @ W.T``
within ``MV_RTOL * (|x| @ |W|.T)`` plus the rounding bound ``(0.51 dx) @ |d q|.T`` (half a step per
input, with room for float32 rounding in the step; ``d q`` the weights without q4_1's min term).
Random blocks: random quants, with scales drawn from zero, -0, float16 denormals, +-65504 and ordinary
values (every row length class: one block, several, an odd count, SmolLM2's widths).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from zmq_rpc.broker.ops import PACKED_BLOCKS, OpError, TensorMeta, infer

gguf = pytest.importorskip("gguf")
pytest.importorskip("numba")

from gguf import GGMLQuantizationType as GT  # noqa: E402
from zmq_rpc.worker import kernels  # noqa: E402
from zmq_rpc.worker.backends import numpy_ops  # noqa: E402
from zmq_rpc.worker.kernels import amxgemm, halfgemm, intdot, intgemm, jit, unpacked  # noqa: E402
from zmq_rpc.worker.kernels.layout import unpack_codes  # noqa: E402

pytestmark = pytest.mark.timeout(120)  # the first call of each qtype compiles its kernels (~10 s)

MV_RTOL = 1e-5
GGUF_TYPES = {"f16": GT.F16, "bf16": GT.BF16, "q8_0": GT.Q8_0, "q4_0": GT.Q4_0, "q4_1": GT.Q4_1,
              "q5_0": GT.Q5_0, "q5_1": GT.Q5_1, "q4_k": GT.Q4_K, "q5_k": GT.Q5_K, "q6_k": GT.Q6_K}
# byte offsets of the float16 factors inside each GGUF block
SCALE_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
                "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
SPECIAL_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8200, 0x7BFF, 0xFBFF, 0x0400], np.uint16)


def random_f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """float16 bit patterns: a third special (zero, -0, denormal, +-max), the rest ordinary."""
    ordinary = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 30.0], n)).astype(np.float16).view(np.uint16)
    return np.where(rng.random(n) < 0.35, rng.choice(SPECIAL_F16, n), ordinary).astype(np.uint16)


def random_weight(rng: np.random.Generator, qtype: str, rows: int, k: int) -> np.ndarray:
    """A GGUF weight of ``rows`` x ``k``: uint8 blocks, float16 or bfloat16 bits (finite values)."""
    if qtype == "f16":
        bits = rng.integers(0, 1 << 16, (rows, k), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf / NaN
        return bits.view(np.float16)
    if qtype == "bf16":
        sign = rng.integers(0, 2, (rows, k), dtype=np.uint16) << 15
        exponent = rng.choice(np.array([0, 1, 60, 120, 127, 130, 180], np.uint16), (rows, k)) << 7
        return sign | exponent | rng.integers(0, 128, (rows, k), dtype=np.uint16)
    per_block, block_bytes, _ = PACKED_BLOCKS[qtype]
    data = rng.integers(0, 256, (rows, k // per_block, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[qtype]:
        data[..., offset:offset + 2] = random_f16_scales(rng, rows * (k // per_block)).view(np.uint8).reshape(
            rows, -1, 2)
    return data.reshape(rows, -1)


def oracle(qtype: str, data: np.ndarray) -> np.ndarray:
    """gguf's float32 dequantization of a GGUF weight."""
    if qtype == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(gguf.quants.dequantize(data if qtype != "f16" else data.view(np.uint8), GGUF_TYPES[qtype]),
                      dtype=np.float32).reshape(data.shape[0], -1)


def row_lengths(qtype: str) -> list[int]:
    """One block, two, an odd count, and SmolLM2's widths where they are whole blocks."""
    per_block = PACKED_BLOCKS[qtype][0]
    if per_block == 1:
        return [1, 7, 64, 576]
    base = [per_block, 2 * per_block, 5 * per_block]
    return base + [k for k in (576, 1536) if k % per_block == 0 and k not in base]


def close_product(got: np.ndarray, x: np.ndarray, w: np.ndarray, slack: np.ndarray | float = 0.0) -> None:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    bad = np.abs(got - ref) > MV_RTOL * bound + slack + 1e-30
    assert not bad.any(), f"{bad.sum()} of {bad.size} outside tolerance; worst {np.abs(got - ref)[bad].max()}"


def int8_inputs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two-level int8 rounding of ``intdot.quantize_x``, in numpy: ``(xhat, dx)`` with ``xhat = dx *
    (HI xq1 + xq2)`` (float64, shaped as ``x``) and ``dx`` per input (its block's step)."""
    f32, hi = np.float32, intdot.HI
    blocks = x.astype(f32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    e = amax / f32(127)
    dx = e / f32(hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, f32(127) / amax, f32(0)).astype(f32)
    q1 = np.rint(blocks * inv)
    q2 = np.clip(np.rint((blocks - q1 * e) * (inv * f32(hi))), -127, 127)
    steps = hi * q1.astype(np.float64) + q2
    return ((dx.astype(np.float64) * steps).reshape(x.shape),
            np.broadcast_to(dx, blocks.shape).reshape(x.shape).astype(np.float64))


def min_terms(qtype: str, data: np.ndarray) -> np.ndarray:
    """The float min term ``m`` of each weight (R, K) float64 (``w = s c + m``): q4_1/q5_1's ``m``,
    q4_k/q5_k's ``-dmin mn``; zero for the types whose offset is an integer (the integer kernels
    multiply a min by the float sum of the unrounded inputs, the rest by the rounded ones)."""
    codes, f = unpack_codes(data, qtype)
    if qtype in ("q4_1", "q5_1"):
        return np.repeat(f["m"].astype(np.float64), 32, axis=1)
    if qtype in ("q4_k", "q5_k"):
        return -np.repeat(np.repeat(f["dmin"].astype(np.float64), 8, axis=1) * f["mn"], 32, axis=1)
    return np.zeros(codes.shape)


def close_int8_product(got: np.ndarray, x: np.ndarray, qtype: str, data: np.ndarray) -> None:
    """An integer product (decode or prefill): tight against the rounded inputs, and within the
    stated rounding bound of the float product."""
    w = oracle(qtype, data).astype(np.float64)
    m = min_terms(qtype, data)
    xhat, dx = int8_inputs(x)
    x64 = x.astype(np.float64)
    ref = xhat @ (w - m).T + x64 @ m.T
    bound = np.abs(xhat) @ np.abs(w - m).T + np.abs(x64) @ np.abs(m).T
    bad = np.abs(got - ref) > MV_RTOL * bound + 1e-30
    assert not bad.any(), f"{bad.sum()} of {bad.size} off the int8 product; worst {np.abs(got - ref)[bad].max()}"
    close_product(got, x, w.astype(np.float32), slack=(0.51 * dx) @ np.abs(w - m).T)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    kernels.set_threads(1)


# ------------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_packed_sizes_stay_within_1_2x_of_gguf(qtype: str) -> None:
    per_block, gguf_bytes, packed_bytes = PACKED_BLOCKS[qtype]
    k = per_block * 18 if per_block > 1 else 576
    assert kernels.packed_row_bytes(qtype, k) / kernels.gguf_row_bytes(qtype, k) <= 1.2
    with pytest.raises(ValueError, match="multiple"):
        kernels.packed_row_bytes(qtype, per_block + 1 if per_block > 1 else 0)


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_pack_then_dequantize_is_bit_identical_to_gguf(qtype: str) -> None:
    rng = np.random.default_rng(abs(hash(qtype)) % 2**32)
    for k in row_lengths(qtype):
        for rows in (1, 3, 17):
            data = random_weight(rng, qtype, rows, k)
            packed = kernels.pack(data, qtype)
            assert packed.shape == (rows, kernels.packed_row_bytes(qtype, k)) and packed.dtype == np.uint8
            got = kernels.dequantize(packed, qtype, k)
            np.testing.assert_array_equal(got.view(np.uint32), oracle(qtype, data).view(np.uint32),
                                          err_msg=f"{qtype} rows={rows} k={k}")


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_compiled_repack_writes_the_numpy_layout_byte_for_byte(qtype: str) -> None:
    rng = np.random.default_rng(13)
    for k in row_lengths(qtype):
        for rows in (1, 3, 70):   # 70: past one 64-row repack tile
            data = random_weight(rng, qtype, rows, k)
            np.testing.assert_array_equal(kernels.pack(data, qtype), kernels.pack(data, qtype, jit=False),
                                          err_msg=f"{qtype} rows={rows} k={k}")


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_matvec_matches_float_product_of_gguf_weights(qtype: str) -> None:
    rng = np.random.default_rng(7)
    sizes = [(rows, k) for k in row_lengths(qtype) for rows in (1, 17)]
    sizes.append((jit.TILE + 19, row_lengths(qtype)[0]))   # past one accumulator tile, ragged
    for rows, k in sizes:
        data = random_weight(rng, qtype, rows, k)
        w = oracle(qtype, data)
        x = rng.standard_normal((1, k)).astype(np.float32)
        out = np.full((1, rows), np.nan, np.float32)
        kernels.matmul(x, kernels.pack(data, qtype), qtype, out)
        if qtype in kernels.INTEGER_GEMM:
            close_int8_product(out, x, qtype, data)
        else:
            close_product(out, x, w)


PATHS_SCRIPT = """
import sys
import numpy as np
from zmq_rpc.worker import kernels
from zmq_rpc.worker.kernels import intdot
assert intdot.PATH == sys.argv[3], f"compiled for {intdot.PATH}, expected {sys.argv[3]}"
data = np.load(sys.argv[1])
out = {}
for qtype in sorted(name for name in data.files if name != "x"):
    for n in (1, data["x"].shape[0]):
        y = np.full((n, data[qtype].shape[0]), np.nan, np.float32)
        kernels.matmul(data["x"][:n], kernels.pack(data[qtype], qtype), qtype, y)
        out[f"{qtype}_{n}"] = y
np.savez(sys.argv[2], **out)
"""


def test_kernels_command_offers_every_other_path() -> None:
    """``python -m zmq_rpc.worker.kernels --path`` (run.py's setup) names the paths the test
    above compiles (its own list: the flags are parsed before numba is imported)."""
    from zmq_rpc.worker.kernels import __main__ as command
    assert command.PATHS == tuple(sorted(intdot.PATH_TARGETS))


def extreme_inputs(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Activation rows whose int8 codes reach +-127 on both levels (the bound of AVX2's 16-bit
    sums): whole blocks at +-amax (first level), blocks of half steps (second level), random rows."""
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[0] = np.where(np.arange(k) % 64 < 32, 1.0, -1.0)
    half_steps = (np.arange(31) + 0.5) / 127
    x[1] = np.tile(np.concatenate([[1.0], half_steps]), k // 32)
    x[2] = -x[1]
    return x


def extreme_weight(rng: np.random.Generator, qtype: str, rows: int, k: int) -> np.ndarray:
    """:func:`random_weight` with the first rows' codes at their largest (every code bit set) and the
    next rows' at 0x80 bytes (q8_0: -128, whose magnitude AVX2's sign trick must keep)."""
    data = random_weight(rng, qtype, rows, k)
    per_block, block_bytes, _ = PACKED_BLOCKS[qtype]
    blocks = data.reshape(rows, -1, block_bytes)
    keep = np.zeros(block_bytes, bool)
    for offset in SCALE_FIELDS[qtype]:
        keep[offset:offset + 2] = True
    blocks[:4, :, ~keep] = 0xFF
    blocks[4:8, :, ~keep] = 0x80
    return data


@pytest.mark.timeout(600)     # without run.py's setup, the first run compiles the other CPU's kernels (minutes)
@pytest.mark.parametrize("path", sorted(intdot.PATH_TARGETS))
def test_integer_paths_give_bit_identical_products(path: str, tmp_path: Path) -> None:
    """Compiled for another CPU (numba told to; its cache kept beside the kernels' own, filled by
    ``run.py``'s setup: ``python -m zmq_rpc.worker.kernels --path``), the integer kernels take that
    CPU's path (AVX2's ``vpmaddubsw`` sums, or the portable vector IR) and give bit-identical
    products to this process's path (VNNI, AVX2 or portable), decode and prefill of a block type per
    bound of the 16-bit sums (:data:`~zmq_rpc.worker.kernels.intdot.PATH_QTYPES`), on codes and
    inputs at those bounds. Skipped where both are the same path or this CPU cannot run the
    target's code."""
    problem = intdot.path_problem(path)
    if problem is not None:
        pytest.skip(problem)
    rng = np.random.default_rng(23)
    weights = {q: extreme_weight(rng, q, 35, 512) for q in intdot.PATH_QTYPES}
    x = extreme_inputs(rng, intgemm.TB + 3, 512)
    np.savez(tmp_path / "in.npz", x=x, **weights)
    env = {**os.environ, **intdot.path_env(path)}
    subprocess.run([sys.executable, "-c", PATHS_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"), path],
                   env=env, check=True, timeout=590)
    there = np.load(tmp_path / "out.npz")
    for qtype, data in weights.items():
        for n in (1, x.shape[0]):
            here = np.full((n, 35), np.nan, np.float32)
            kernels.matmul(x[:n], kernels.pack(data, qtype), qtype, here)
            np.testing.assert_array_equal(there[f"{qtype}_{n}"], here, err_msg=f"{qtype} {n} rows")


@pytest.mark.parametrize("qtype", ["f16", "bf16", "q6_k"])
def test_prefill_tiles_match_float_product(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile path (dequantized tiles + BLAS: what prefill of a type without a GEMM runs; every
    type has one today, so the GEMMs are hidden here)."""
    rng = np.random.default_rng(11)
    k = row_lengths(qtype)[1]
    rows = 83
    monkeypatch.setattr(kernels, "INTEGER_GEMM", frozenset())
    monkeypatch.setattr(kernels, "HALF_GEMM", frozenset())
    monkeypatch.setattr(kernels, "TILE_BYTES", 4 * k * 32)   # 32-row tiles: 3 of them and a ragged one
    data = random_weight(rng, qtype, rows, k)
    x = rng.standard_normal((9, k)).astype(np.float32)
    out = np.full((9, rows), np.nan, np.float32)
    kernels.matmul(x, kernels.pack(data, qtype), qtype, out)
    close_product(out, x, oracle(qtype, data))


@pytest.mark.parametrize("qtype", sorted(kernels.INTEGER_GEMM))
def test_integer_gemm_matches_the_int8_product(qtype: str) -> None:
    """Prefill of every block type (``kernels.intgemm``; q5_x and the K-quants unpacked per 16 rows,
    ``kernels.unpacked``): every row length class, odd weight row counts (16-row blocks and a
    scalar tail), activation row counts from 3 (one-row passes only) to 200 (many ``TB``-row passes
    and a ragged rest); held to the decode products' tolerance, row by row."""
    rng = np.random.default_rng(17)
    for k in row_lengths(qtype):
        for rows, n in ((35, 3), (17, intgemm.TB + 1), (83, 2 * intgemm.TB + 5), (51, 200)):
            data = random_weight(rng, qtype, rows, k)
            x = (rng.standard_normal((n, k)) * rng.choice([1e-3, 1.0, 50.0], (n, 1))).astype(np.float32)
            x[0, :min(k, 32)] = 0                 # an all-zero block
            out = np.full((n, rows), np.nan, np.float32)
            kernels.matmul(x, kernels.pack(data, qtype), qtype, out)
            close_int8_product(out, x, qtype, data)


@pytest.mark.parametrize("qtype", sorted(kernels.INTEGER_GEMM))
def test_integer_gemm_writes_only_its_row_range(qtype: str) -> None:
    """A thread's range ``r0..r1`` (any bounds, not only multiples of 16) gets exactly its columns."""
    rng = np.random.default_rng(19)
    k = row_lengths(qtype)[1]
    data = random_weight(rng, qtype, 70, k)
    w, x = kernels.pack(data, qtype), rng.standard_normal((9, k)).astype(np.float32)
    full = np.empty((9, 70), np.float32)
    kernels.matmul(x, w, qtype, full)
    gemm, flags = intgemm.GEMM[qtype]
    part = np.full((9, 70), np.nan, np.float32)
    gemm(w, *intgemm.quantize_rows(x), part, 5, 58, *flags)
    assert np.isnan(part[:, :5]).all() and np.isnan(part[:, 58:]).all()
    np.testing.assert_allclose(part[:, 5:58], full[:, 5:58], rtol=1e-6, atol=1e-6 * np.abs(full).max())


@pytest.mark.parametrize("qtype", sorted(unpacked.KINDS))
def test_unpacked_blocks_match_the_scalar_unpack(qtype: str) -> None:
    """``kernels.unpacked`` unpacks whole 16-row blocks with vector IR and ragged rows with a scalar
    loop into the same scratch, then runs the same passes: 16-row blocks and the same rows taken
    15 at a time (all scalar) give bit-identical products, on blocks with special scales."""
    rng = np.random.default_rng(29)
    k = row_lengths(qtype)[-1]
    data = random_weight(rng, qtype, 48, k)
    w, x = kernels.pack(data, qtype), rng.standard_normal((unpacked.TB + 1, k)).astype(np.float32)
    xq = intgemm.quantize_rows(x)
    blocks, ragged = np.full((x.shape[0], 48), np.nan, np.float32), np.full((x.shape[0], 48), np.nan, np.float32)
    unpacked.gemm_unpacked(w, *xq, blocks, 0, 48, unpacked.KINDS[qtype])
    for r in range(0, 48, 15):
        unpacked.gemm_unpacked(w, *xq, ragged, r, min(r + 15, 48), unpacked.KINDS[qtype])
    np.testing.assert_array_equal(blocks, ragged)
    close_int8_product(blocks, x, qtype, data)


@pytest.fixture(params=["amx", "fma"])
def half_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The f16/bf16 prefill kernel: AMX tiles (skipped where this CPU or kernel has none), or the FMA
    kernel that runs where AMX does not (forced here by hiding AMX)."""
    if request.param == "amx" and not amxgemm.available():
        pytest.skip("no AMX-BF16 here (CPU or kernel)")
    if request.param == "fma":
        compiled = kernels._kernels
        monkeypatch.setattr(kernels, "_kernels",
                            lambda: dataclasses.replace(compiled(), gemm_amx=None, split_rows=None))
    return str(request.param)


@pytest.mark.parametrize("qtype", sorted(kernels.HALF_GEMM))
def test_half_gemm_matches_float_product(qtype: str, half_path: str) -> None:
    """Prefill of f16/bf16 (``kernels.amxgemm`` or ``kernels.halfgemm``) against float64 ``x @ W.T`` of
    gguf's weights within ``MV_RTOL * (|x| @ |W|.T)``: every row length class (1 and 7 inputs: not a
    multiple of the 32-input chunks), weight row counts odd and past whole 32-row blocks (300: two
    groups of four blocks packed together, then one block and a ragged one), activation
    row counts from 3 to 200 (not multiples of the 32-row blocks nor of the FMA kernel's 12-row
    passes), activation rows of very different scales and an all-zero block."""
    rng = np.random.default_rng(29)
    for k in row_lengths(qtype) + [1536]:
        for rows, n in ((35, 3), (17, halfgemm.TB + 1), (83, 2 * halfgemm.TB + 5), (64, 32), (51, 200), (300, 40)):
            data = random_weight(rng, qtype, rows, k)
            x = (rng.standard_normal((n, k)) * rng.choice([1e-3, 1.0, 50.0], (n, 1))).astype(np.float32)
            x[0, :min(k, 32)] = 0
            out = np.full((n, rows), np.nan, np.float32)
            kernels.matmul(x, kernels.pack(data, qtype), qtype, out)
            close_product(out, x, oracle(qtype, data))


@pytest.mark.parametrize("qtype", sorted(kernels.HALF_GEMM))
def test_half_gemm_writes_only_its_row_range(qtype: str, half_path: str) -> None:
    """A thread's range ``r0..r1`` (any bounds) gets exactly its columns, as the whole product's."""
    rng = np.random.default_rng(31)
    data = random_weight(rng, qtype, 70, 64)
    w, x = kernels.pack(data, qtype), rng.standard_normal((9, 64)).astype(np.float32)
    full = np.empty((9, 70), np.float32)
    kernels.matmul(x, w, qtype, full)
    kernel, head, tail = kernels._half_gemm(x, w, qtype, np.full((9, 70), np.nan, np.float32))
    kernel(*head, 5, 58, *tail)
    part = head[-1]
    assert np.isnan(part[:, :5]).all() and np.isnan(part[:, 58:]).all()
    np.testing.assert_allclose(part[:, 5:58], full[:, 5:58], rtol=1e-6, atol=1e-6 * np.abs(full).max())


def test_amx_levels_sum_to_the_activations_exactly() -> None:
    """``amxgemm.split_rows``: three bf16 levels per input whose float sum is the float32 input, bit
    for bit (what keeps the AMX product float32-accurate), zeros past T and K."""
    rng = np.random.default_rng(37)
    x = (rng.standard_normal((35, 40)) * rng.choice([1e-30, 1e-3, 1.0, 1e20], (35, 40))).astype(np.float32)
    tiles = amxgemm.split_rows(x)
    levels = tiles.transpose(2, 0, 3, 4, 1, 5).reshape(3, 64, 64)    # (level, T padded, K padded)
    as_float = (levels.astype(np.uint32) << 16).view(np.float32)
    total = as_float[0].astype(np.float64) + as_float[1] + as_float[2]
    np.testing.assert_array_equal(total[:35, :40], x.astype(np.float64))
    assert not levels[:, 35:].any() and not levels[:, :, 40:].any()


def test_activation_rows_round_as_the_decode_vector() -> None:
    """``intgemm.quantize_rows`` rounds each row as ``intdot.quantize_x`` rounds a vector: the same
    first-level codes and steps, NaN and infinite blocks included; second-level codes within one
    step (``(x - xq1 e) / dx`` may land on a tie, and LLVM may fuse the product and the difference in
    one kernel and not in the other), the code sums those of its own codes, the float sums to float32
    rounding; the rounded inputs within half a step (and float32 rounding) of ``x``."""
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((5, 160)) * 30).astype(np.float32)
    x[1, 40], x[2, 100], x[3, :32] = np.nan, np.inf, 0
    xq1, xq2, dx, sq, sx = intgemm.quantize_rows(x)
    for t in range(5):
        one = intdot.quantize_x(x[t])
        np.testing.assert_array_equal(xq1[t], one[0])
        np.testing.assert_array_equal(dx[t], one[2])
        assert np.abs(xq2[t].astype(int) - one[1]).max() <= 1
        np.testing.assert_allclose(sx[t], one[4], rtol=1e-5, atol=1e-4)
    codes = intdot.HI * xq1.astype(np.int64) + xq2
    np.testing.assert_array_equal(sq, codes.reshape(5, -1, 32).sum(axis=-1))
    good = np.isfinite(np.repeat(dx, 32, axis=1))
    steps = np.repeat(dx, 32, axis=1).astype(np.float64)
    err = np.abs(steps * codes - x)[good]
    assert (err <= 0.5 * steps[good] * (1 + 1e-3) + 1e-6 * np.abs(x[good])).all()


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0", "q6_k", "f16"])
@pytest.mark.parametrize("n_rows", [1, 5])
def test_two_threads_give_the_same_rows(qtype: str, n_rows: int) -> None:
    rng = np.random.default_rng(3)
    k = row_lengths(qtype)[-1]
    data = random_weight(rng, qtype, 1000, k)
    packed, x = kernels.pack(data, qtype), rng.standard_normal((n_rows, k)).astype(np.float32)
    outs = []
    for n in (1, 2):
        kernels.set_threads(n)
        out = np.full((n_rows, 1000), np.nan, np.float32)
        kernels.matmul(x, packed, qtype, out)
        outs.append(out)
    if qtype in kernels.INTEGER_GEMM:
        close_int8_product(outs[1], x, qtype, data)
    else:
        close_product(outs[1], x, oracle(qtype, data))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6 * np.abs(outs[0]).max())


@pytest.mark.parametrize("n_rows", [1, 5])
def test_nan_activations_propagate(n_rows: int) -> None:
    """fastmath here never assumes "no NaN": a NaN input makes every output of its row NaN.
    (An infinite input may give NaN where numpy gives +-inf: the scales are factored out of the sums.)"""
    rng = np.random.default_rng(5)
    data = random_weight(rng, "q4_1", 4, 64)
    x = rng.standard_normal((n_rows, 64)).astype(np.float32)
    x[0, 3] = np.nan
    out = np.empty((n_rows, 4), np.float32)
    kernels.matmul(x, kernels.pack(data, "q4_1"), "q4_1", out)
    assert np.isnan(out[0]).all() and not np.isnan(out[1:]).any()


def test_pack_refuses_ragged_rows() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.pack(np.zeros((2, 35), np.uint8), "q8_0")
    with pytest.raises(ValueError, match="2-D"):
        kernels.pack(np.zeros(34, np.uint8), "q8_0")


def test_set_threads_refuses_zero() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        kernels.set_threads(0)


def test_every_qtype_has_kernels_and_families_share_them() -> None:
    assert set(jit.KERNELS) == set(kernels.QTYPES)
    assert jit.KERNELS["q4_0"][0] is jit.KERNELS["q4_1"][0] and jit.KERNELS["q4_0"][2] != jit.KERNELS["q4_1"][2]
    assert jit.KERNELS["q5_0"][1] is jit.KERNELS["q5_1"][1] and jit.KERNELS["q5_0"][2] != jit.KERNELS["q5_1"][2]


# ----------------------------------------------------------------------------------- ops, kernels


def run_op(op: str, inputs: list[np.ndarray], metas: list[TensorMeta], params: dict[str, object]) -> np.ndarray:
    meta, normalized = infer(op, metas, params)
    out = np.full(meta.shape, np.nan, np.float32) if meta.dtype == "float32" else np.zeros(meta.shape, np.uint8)
    numpy_ops.run_compute(op, inputs, metas, normalized, out)
    return out


@pytest.mark.parametrize("qtype", ["q6_k", "bf16", "q5_1"])
def test_pack_unpack_get_rows_ops_match_gguf(qtype: str) -> None:
    rng = np.random.default_rng(17)
    k = row_lengths(qtype)[1]
    data = random_weight(rng, qtype, 21, k)
    dtype = {"f16": "float16", "bf16": "bfloat16"}.get(qtype, "uint8")
    packed = run_op("pack", [data], [TensorMeta(data.shape, dtype)], {"qtype": qtype})
    wmeta = TensorMeta(packed.shape, "uint8")
    ref = oracle(qtype, data)
    np.testing.assert_array_equal(run_op("unpack", [packed], [wmeta], {"qtype": qtype}), ref)
    idx = np.array([[20, 0], [3, 3]], np.int32)
    rows = run_op("get_rows_packed", [packed, idx], [wmeta, TensorMeta(idx.shape, "int32")], {"qtype": qtype})
    np.testing.assert_array_equal(rows, ref[idx])
    with pytest.raises(numpy_ops.OpRuntimeError, match=r"index 21 is out of range \[0, 21\)"):
        run_op("get_rows_packed", [packed, idx + 1], [wmeta, TensorMeta(idx.shape, "int32")], {"qtype": qtype})


# -------------------------------------------------------------------------------------- op rules


def test_pack_rule_sizes_the_packed_weight() -> None:
    out, _ = infer("pack", [TensorMeta((7, 2 * 144), "uint8")], {"qtype": "q4_k"})
    assert out == TensorMeta((7, 2 * 152), "uint8")
    out, _ = infer("pack", [TensorMeta((3, 10), "bfloat16")], {"qtype": "bf16"})
    assert out == TensorMeta((3, 20), "uint8")
    with pytest.raises(OpError, match="not whole q4_k blocks"):
        infer("pack", [TensorMeta((7, 145), "uint8")], {"qtype": "q4_k"})
    with pytest.raises(OpError, match="dtype uint8 is not allowed"):
        infer("pack", [TensorMeta((7, 10), "uint8")], {"qtype": "f16"})
    with pytest.raises(OpError, match="qtype"):
        infer("pack", [TensorMeta((7, 36), "uint8")], {"qtype": "q2_k"})


def test_mul_mat_packed_rule_checks_widths() -> None:
    wp = TensorMeta((5, 3 * 24), "uint8")                    # q4_1, 96 inputs
    out, _ = infer("mul_mat_packed", [TensorMeta((2, 3, 96), "float32"), wp], {"qtype": "q4_1"})
    assert out == TensorMeta((2, 3, 5), "float32")
    with pytest.raises(OpError, match="x last dim 64 != wp input width 96"):
        infer("mul_mat_packed", [TensorMeta((64,), "float32"), wp], {"qtype": "q4_1"})
    with pytest.raises(OpError, match="not whole packed q4_1 blocks"):
        infer("mul_mat_packed", [TensorMeta((96,), "float32"), TensorMeta((5, 70), "uint8")], {"qtype": "q4_1"})
    with pytest.raises(OpError, match="contiguous"):
        infer("mul_mat_packed", [TensorMeta((96,), "float32"), TensorMeta((5, 72), "uint8", False)],
              {"qtype": "q4_1"})
