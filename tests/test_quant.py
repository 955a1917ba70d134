"""Tests for worker/formats/quant.py: ggml Q8_0 / Q4_1 layouts, round trips, argument checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from zmq_rpc.worker.formats import quant

FAST = settings(max_examples=25, deadline=None, database=None)
QTYPES = ("q8_0", "q4_1")


def reference_dequantize(raw: bytes, qtype: str) -> list[float]:
    """One block at a time with struct, straight from the layout description."""
    size = quant.BLOCK[qtype][1]
    out: list[float] = []
    for start in range(0, len(raw), size):
        block = raw[start:start + size]
        if qtype == "q8_0":
            (d,) = struct.unpack("<e", block[:2])
            out += [d * q for q in struct.unpack("<32b", block[2:])]
        else:
            d, m = struct.unpack("<ee", block[:4])
            qs = block[4:]
            out += [d * (b & 0x0F) + m for b in qs] + [d * (b >> 4) + m for b in qs]
    return out


# ------------------------------------------------------------------------------------------ layout


def test_q8_0_hand_built_block() -> None:
    q = list(range(-16, 16))
    raw = struct.pack("<e", 0.5) + struct.pack("<32b", *q)
    out = quant.dequantize(np.frombuffer(raw, np.uint8), "q8_0")
    assert out.dtype == np.float32 and out.shape == (32,)
    assert out.tolist() == [0.5 * v for v in q]


def test_q4_1_hand_built_block() -> None:
    qs = bytes(j | ((15 - j) << 4) for j in range(16))  # low nibbles 0..15, high nibbles 15..0
    raw = struct.pack("<ee", 0.25, -1.0) + qs
    out = quant.dequantize(np.frombuffer(raw, np.uint8), "q4_1")
    expected = [0.25 * j - 1.0 for j in range(16)] + [0.25 * (15 - j) - 1.0 for j in range(16)]
    assert out.tolist() == expected


def test_q8_0_quantize_bytes_and_round_half_away_from_zero() -> None:
    x = np.zeros(32, np.float32)
    x[:5] = [127.0, 2.5, -2.5, 0.49, -126.5]  # amax 127 -> d = 1, so x*id is exactly x
    raw = quant.quantize(x, "q8_0").tobytes()
    assert raw[:2] == struct.pack("<e", 1.0)
    assert struct.unpack("<5b", raw[2:7]) == (127, 3, -3, 0, -127)
    assert raw[7:] == bytes(27)


def test_q4_1_quantize_bytes() -> None:
    x = np.array(list(range(16)) + list(range(15, -1, -1)), np.float32) * 0.5 + 2.0  # min 2, max 9.5
    raw = quant.quantize(x, "q4_1").tobytes()
    assert raw[:4] == struct.pack("<ee", 0.5, 2.0)
    assert raw[4:] == bytes(j | ((15 - j) << 4) for j in range(16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_shapes_keep_leading_dims(qtype: str) -> None:
    x = np.zeros((2, 3, 64), np.float32)
    q = quant.quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (2, 3, 2 * quant.BLOCK[qtype][1])
    assert quant.dequantize(q, qtype).shape == (2, 3, 64)


@pytest.mark.parametrize("qtype", QTYPES)
@FAST
@given(data=st.data())
def test_dequantize_matches_block_by_block_reference_on_any_bytes(qtype: str, data: st.DataObject) -> None:
    n_blocks = data.draw(st.integers(0, 6))
    raw = data.draw(st.binary(min_size=n_blocks * quant.BLOCK[qtype][1], max_size=n_blocks * quant.BLOCK[qtype][1]))
    with np.errstate(all="ignore"):  # random scales may be inf/NaN
        out = quant.dequantize(np.frombuffer(raw, np.uint8), qtype)
        expected = np.array(reference_dequantize(raw, qtype), np.float64).astype(np.float32)
    np.testing.assert_array_equal(out, expected)


# -------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("qtype", QTYPES)
@FAST
@given(x=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda n: 32 * n)),
                    elements=st.floats(-1e3, 1e3, width=32)))
def test_round_trip_error_is_within_half_a_step(qtype: str, x: np.ndarray) -> None:
    back = quant.dequantize(quant.quantize(x, qtype), qtype)
    blocks, err = x.reshape(-1, 32).astype(np.float64), np.abs(back - x).reshape(-1, 32)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    if qtype == "q8_0":
        amax = np.maximum(np.abs(lo), np.abs(hi))
        bound = amax / 127 * 0.5 + amax * 2.0**-10 + 127 * 2.0**-25  # half a step + f16 rounding of d
    else:
        bound = (hi - lo) / 15 * 0.5 + (np.abs(lo) + (hi - lo)) * 2.0**-10 + 16 * 2.0**-25
    assert (err.max(axis=1) <= bound * 1.0001).all()  # the f16 terms also cover subnormal scales


@FAST
@given(x=hnp.arrays(np.float32, 64, elements=st.floats(-100, 100, width=32)))
def test_q8_0_requantizing_its_own_output_is_stable(x: np.ndarray) -> None:
    q = quant.quantize(x, "q8_0")
    assert quant.quantize(quant.dequantize(q, "q8_0"), "q8_0").tobytes() == q.tobytes()


def test_constant_block_round_trips_exactly() -> None:
    x = np.full(32, 3.0, np.float32)
    np.testing.assert_array_equal(quant.dequantize(quant.quantize(x, "q4_1"), "q4_1"), x)
    np.testing.assert_array_equal(quant.dequantize(quant.quantize(np.zeros(32, np.float32), "q8_0"), "q8_0"), 0)


# ------------------------------------------------------------------------------ out=, views, chunks


@pytest.mark.parametrize("qtype", QTYPES)
def test_out_strided_input_and_chunking(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    q = quant.quantize(rng.standard_normal((10, 96)).astype(np.float32), qtype)
    expected = quant.dequantize(q, qtype)
    monkeypatch.setattr(quant, "CHUNK_BLOCKS", 4)  # 30 blocks: several chunks and a ragged last one
    out = np.full((10, 96), np.nan, np.float32)
    assert quant.dequantize(q, qtype, out=out) is out
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(quant.dequantize(q[::3], qtype), expected[::3])


@pytest.mark.parametrize("data,qtype,out,message", [
    (np.zeros(34, np.int8), "q8_0", None, "quantized data must be uint8, got int8"),
    (np.zeros(35, np.uint8), "q8_0", None, r"last dim that is a multiple of 34, got shape \(35,\)"),
    (np.zeros((), np.uint8), "q8_0", None, "multiple of 34"),
    (np.zeros(34, np.uint8), "q4_0", None, "unknown qtype 'q4_0'"),
    (np.zeros(34, np.uint8), "q8_0", np.zeros(32, np.float64), r"out must be a C-contiguous float32 array of shape \(32,\)"),
    (np.zeros(34, np.uint8), "q8_0", np.zeros(33, np.float32), "out must be"),
    (np.zeros(68, np.uint8), "q8_0", np.zeros(128, np.float32)[::2], "out must be"),
])
def test_dequantize_argument_errors(data: np.ndarray, qtype: str, out: np.ndarray | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quant.dequantize(data, qtype, out=out)


def test_tiny_blocks_get_zero_quants() -> None:
    x = np.full(32, 2e-7, np.float32)  # d = amax / 127 rounds to 0 in float16
    q = quant.quantize(x, "q8_0")
    assert q.tobytes() == bytes(34)


def test_quantize_argument_errors() -> None:
    with pytest.raises(ValueError, match="a block scale overflows float16"):
        quant.quantize(np.full(32, 1e7, np.float32), "q8_0")
    with pytest.raises(ValueError, match="a block scale overflows float16"):
        quant.quantize(np.full(32, -1e5, np.float32), "q4_1")
    with pytest.raises(ValueError, match=r"last dim must be a multiple of 32, got shape \(33,\)"):
        quant.quantize(np.zeros(33, np.float32), "q8_0")
    with pytest.raises(ValueError, match="cannot quantize NaN or infinite values"):
        quant.quantize(np.full(32, np.inf, np.float32), "q4_1")
    with pytest.raises(ValueError, match="unknown qtype"):
        quant.quantize(np.zeros(32, np.float32), "q5_0")
