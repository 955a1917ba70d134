"""Tests for broker/ops.py (rules) and worker/backends/numpy_ops.py (kernels) against plain numpy.

Every test runs on each kernel device of ``devices.KERNEL_DEVICES``: the ops that go through
:func:`run` use that device's kernel table (numpy; numpy posing as a device, which takes every
device branch of the shared kernels; cupy with its CUDA overrides, skipped without a GPU), with the
same references and tolerances. Tests that call the numpy functions directly run as they are.
"""

from __future__ import annotations

import math
import tracemalloc
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import fake_device
import numpy as np
import pytest
from devices import KERNEL_DEVICES, cupy_module
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from zmq_rpc.broker.ops import MAC_WEIGHT, OPS, OpError, OpKind, TensorMeta, infer, node_work
from zmq_rpc.worker.backends import numpy_ops
from zmq_rpc.worker.backends.numpy_ops import (
    OpRuntimeError,
    as_float32,
    erf,
    from_float32,
    numpy_dtype,
    run_compute,
    run_inplace,
    run_view,
)
from zmq_rpc.worker.formats import quant

FAST = settings(max_examples=25, deadline=None, database=None)
_DEVICE: dict[str, Any] = {}


@pytest.fixture(scope="module", params=KERNEL_DEVICES, autouse=True)
def kernel_device(request: pytest.FixtureRequest) -> Any:
    """The device :func:`run` runs kernels on, for every test of this module."""
    if request.param == "cuda":
        from zmq_rpc.worker.backends.cupy_ops import cupy_table
        cp = cupy_module()
        _DEVICE.update(name="cuda", table=cupy_table(cp), to=cp.asarray, back=cp.asnumpy)
    elif request.param == "fake":
        table = numpy_ops.NUMPY_KERNELS.overridden("fake", host_errors=True)
        _DEVICE.update(name="fake", table=table, to=fake_device.to_device, back=np.asarray)
    else:
        _DEVICE.update(name="cpu", table=numpy_ops.NUMPY_KERNELS, to=None, back=None)
    yield request.param
    _DEVICE.clear()
FLOATS = ("float32", "float16", "bfloat16", "float64")
NUMERIC = (*FLOATS, "int8", "uint8", "int32", "int64", "bool")

# ------------------------------------------------------------------------------------------- helpers


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """float values -> an array in the storage dtype of ``dtype`` (ints rounded and clipped)."""
    x = np.asarray(x, np.float32)
    if dtype == "bfloat16":
        out = np.empty(x.shape, np.uint16)
        from_float32(x, "bfloat16", out)
        return out
    if dtype == "bool":
        return x > 0
    np_dtype = numpy_dtype(dtype)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return np.clip(np.round(x), info.min, info.max).astype(np_dtype)
    return x.astype(np_dtype)


def values(arr: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values an array of ``dtype`` holds (the reference's input)."""
    return as_float32(arr, dtype).astype(np.float64) if dtype == "bfloat16" else arr.astype(np.float64)


def meta_of(arr: np.ndarray, dtype: str | None = None) -> TensorMeta:
    return TensorMeta(arr.shape, dtype or arr.dtype.name, bool(arr.flags.c_contiguous))


def run(op: str, arrays: Sequence[np.ndarray], params: Mapping[str, Any] | None = None,
        dtypes: Sequence[str | None] | None = None) -> np.ndarray:
    """infer, then run the kernel the way an executor would; returns the result array."""
    metas = [meta_of(a, d) for a, d in zip(arrays, dtypes or [None] * len(arrays), strict=True)]
    out_meta, norm = infer(op, metas, params or {})
    spec = OPS[op]
    if _DEVICE.get("to") is not None:
        return _run_on_device(op, arrays, metas, norm, out_meta)
    if spec.kind is OpKind.VIEW:
        result = run_view(op, arrays[0], metas[0], norm)
    elif spec.kind is OpKind.INPLACE:
        run_inplace(op, arrays, metas, norm)
        result = arrays[spec.dst_input or 0]
    else:
        result = np.empty(out_meta.shape, numpy_dtype(out_meta.dtype))
        run_compute(op, arrays, metas, norm, result)
    assert result.shape == out_meta.shape
    assert result.dtype == numpy_dtype(out_meta.dtype)
    return result


def _run_on_device(op: str, arrays: Sequence[np.ndarray], metas: list[TensorMeta], norm: Mapping[str, Any],
                   out_meta: TensorMeta) -> np.ndarray:
    """:func:`run` on the current non-numpy device: inputs copied there, results copied back
    (an in-place op's destination into the caller's array, as on the CPU)."""
    table, to, back = _DEVICE["table"], _DEVICE["to"], _DEVICE["back"]
    spec = OPS[op]
    inputs = [to(a) for a in arrays]
    if spec.kind is OpKind.VIEW:
        result = back(table.run_view(op, inputs[0], metas[0], norm))
    elif spec.kind is OpKind.INPLACE:
        table.run_inplace(op, inputs, metas, norm)
        dst = spec.dst_input or 0
        arrays[dst][...] = back(inputs[dst])
        result = arrays[dst]
    else:
        out = to(np.empty(out_meta.shape, numpy_dtype(out_meta.dtype)))
        table.run_compute(op, inputs, metas, norm, out)
        result = back(out)
    assert result.shape == out_meta.shape
    assert result.dtype == numpy_dtype(out_meta.dtype)
    return np.asarray(result)


def close(actual: np.ndarray, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(actual, np.asarray(expected, np.float64), rtol=rtol, atol=atol, equal_nan=True)


# Values on a 1/8 grid in [-10, 10]: exact in every float dtype, no near-zero divisors.
grid_values = st.integers(-80, 80).map(lambda i: i / 8)
small_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def tensors(draw: st.DrawFn, shape: tuple[int, ...] | None = None,
            dtypes: Sequence[str] = NUMERIC) -> tuple[np.ndarray, str]:
    shape = draw(small_shapes) if shape is None else shape
    dtype = draw(st.sampled_from(dtypes))
    x = draw(hnp.arrays(np.float32, shape, elements=grid_values))
    return stored(x, dtype), dtype


# -------------------------------------------------------------------------------------- the registry


def test_every_op_has_a_kernel_of_its_kind() -> None:
    tables = {OpKind.COMPUTE: numpy_ops._COMPUTE_KERNELS, OpKind.VIEW: numpy_ops._VIEW_KERNELS,
              OpKind.INPLACE: numpy_ops._INPLACE_KERNELS}
    for name, spec in OPS.items():
        assert name in tables[spec.kind], name
        assert (spec.dst_input is not None) == (spec.kind is OpKind.INPLACE)
    assert sum(len(t) for t in tables.values()) == len(OPS)


def test_run_functions_refuse_the_wrong_kind() -> None:
    x = np.zeros(3, np.float32)
    with pytest.raises(OpError, match="'add' is not an op of kind view"):
        run_view("add", x, meta_of(x), {})
    with pytest.raises(OpError, match="is not an op of kind compute"):
        run_compute("reshape", [x], [meta_of(x)], {"shape": (3,)}, x)
    with pytest.raises(OpError, match="'nope' is not an op of kind inplace"):
        run_inplace("nope", [x], [meta_of(x)], {})


def test_quant_block_table_is_shared() -> None:
    assert quant.BLOCK == {"q8_0": (32, 34), "q4_1": (32, 20)}


# ---------------------------------------------------------------------------------- elementwise ops

UNARY_REF: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "neg": np.negative, "abs": np.abs, "sqr": np.square, "sqrt": np.sqrt, "exp": np.exp, "log": np.log,
    "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0), "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "silu": lambda x: x / (1 + np.exp(-x)),
}


@pytest.mark.parametrize("op", sorted(UNARY_REF))
@FAST
@given(data=tensors())
def test_unary_matches_numpy(op: str, data: tuple[np.ndarray, str]) -> None:
    x, dtype = data
    with np.errstate(all="ignore"):
        expected = UNARY_REF[op](values(x, dtype))
    close(run(op, [x], {}, [dtype]), expected)


@FAST
@given(data=tensors(), s=st.floats(-4, 4))
def test_scale(data: tuple[np.ndarray, str], s: float) -> None:
    x, dtype = data
    close(run("scale", [x], {"s": s}, [dtype]), values(x, dtype) * np.float32(s))


def gelu_erf_ref(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2)))


@FAST
@given(data=tensors(dtypes=FLOATS))
def test_gelu_both_approximations(data: tuple[np.ndarray, str]) -> None:
    x, dtype = data
    v = values(x, dtype)
    tanh_ref = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    close(run("gelu", [x], {}, [dtype]), tanh_ref, atol=1e-5)
    close(run("gelu", [x], {"approximate": "erf"}, [dtype]), gelu_erf_ref(v), atol=1e-5)


def test_erf_accuracy() -> None:
    z = np.linspace(-6, 6, 200_001).astype(np.float32)
    expected = np.vectorize(math.erf, otypes=[np.float64])(z.astype(np.float64))
    assert np.abs(erf(z) - expected).max() < 1.5e-7
    assert erf(np.array([np.inf, -np.inf], np.float32)).tolist() == [1.0, -1.0]


def test_silu_and_sigmoid_saturate_without_nan() -> None:
    x = np.array([-1e4, -100, 0, 100, 1e4, -np.inf, np.inf], np.float32)
    assert run("sigmoid", [x]).tolist() == [0, 0, 0.5, 1, 1, 0, 1]
    np.testing.assert_array_equal(run("silu", [x[:5]]), [0, 0, 0, 100, 1e4])


@pytest.mark.parametrize("op,fn", [("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                                   ("div", np.divide)])
@FAST
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=4),
       dtypes=st.tuples(st.sampled_from(NUMERIC), st.sampled_from(NUMERIC)), data=st.data())
def test_binary_broadcasts_like_numpy(op: str, fn: np.ufunc, shapes: Any, dtypes: tuple[str, str],
                                      data: st.DataObject) -> None:
    a, _ = data.draw(tensors(shapes.input_shapes[0], [dtypes[0]]))
    b, _ = data.draw(tensors(shapes.input_shapes[1], [dtypes[1]]))
    with np.errstate(all="ignore"):
        expected = fn(values(a, dtypes[0]), values(b, dtypes[1]))
    close(run(op, [a, b], {}, list(dtypes)), expected)


def test_binary_on_strided_views() -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    b = np.arange(12, dtype=np.float32).reshape(3, 4).T
    close(run("add", [a, b]), a + b)


def test_binary_rejects_non_broadcastable() -> None:
    with pytest.raises(OpError, match=r"add: inputs: shapes \(2, 3\) and \(4,\) do not broadcast"):
        infer("add", [TensorMeta((2, 3), "float32"), TensorMeta((4,), "float32")], {})


# -------------------------------------------------------------------------------------------- matmul


@FAST
@given(batch=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3),
       mkn=st.tuples(*[st.integers(0, 6)] * 3), transpose_b=st.booleans(),
       dtypes=st.tuples(st.sampled_from(FLOATS + ("int32",)), st.sampled_from(FLOATS)), data=st.data())
def test_matmul_matches_numpy(batch: Any, mkn: tuple[int, int, int], transpose_b: bool,
                              dtypes: tuple[str, str], data: st.DataObject) -> None:
    m, k, n = mkn
    b_shape = (n, k) if transpose_b else (k, n)
    a, _ = data.draw(tensors(batch.input_shapes[0] + (m, k), [dtypes[0]]))
    b, _ = data.draw(tensors(batch.input_shapes[1] + b_shape, [dtypes[1]]))
    bv = values(b, dtypes[1])
    expected = values(a, dtypes[0]) @ (np.swapaxes(bv, -1, -2) if transpose_b else bv)
    close(run("matmul", [a, b], {"transpose_b": transpose_b}, list(dtypes)), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("a_shape,b_shape", [((3,), (3,)), ((3,), (3, 2)), ((2, 3), (3,)),
                                             ((4, 2, 3), (3,)), ((3,), (5, 3, 2))])
def test_matmul_vector_cases(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    close(run("matmul", [a, b]), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_matmul_transpose_b_on_w_stored_out_in() -> None:
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    close(run("matmul", [x, w], {"transpose_b": True}), x.astype(np.float64) @ w.T, atol=1e-5)


@pytest.mark.parametrize("a,b,params,message", [
    ((2, 3), (4, 5), {}, r"inner dims differ"),
    ((2, 3), (5, 4), {"transpose_b": True}, r"inner dims differ"),
    ((), (3,), {}, r"rank >= 1"),
    ((3,), (3,), {"transpose_b": True}, r"transpose_b needs input 1 of rank >= 2"),
    ((2, 1, 5, 3), (3, 3, 4), {}, None),
    ((2, 2, 3), (3, 3, 4), {}, r"batch dims: shapes \(2,\) and \(3,\) do not broadcast"),
    ((2, 3), (3, 4), {"transpose_b": 1}, r"param 'transpose_b' must be a bool, got 1"),
])
def test_matmul_rules(a: tuple[int, ...], b: tuple[int, ...], params: dict[str, Any], message: str | None) -> None:
    metas = [TensorMeta(a, "float32"), TensorMeta(b, "float32")]
    if message is None:
        assert infer("matmul", metas, params)[0].shape == np.matmul(np.zeros(a), np.zeros(b)).shape
    else:
        with pytest.raises(OpError, match=message):
            infer("matmul", metas, params)


# ------------------------------------------------------------------------------------------ get_rows


@pytest.mark.parametrize("dtype", FLOATS)
@FAST
@given(idx_shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4), data=st.data())
def test_get_rows(dtype: str, idx_shape: tuple[int, ...], data: st.DataObject) -> None:
    table, _ = data.draw(tensors((7, 5), [dtype]))
    idx = data.draw(hnp.arrays(data.draw(st.sampled_from([np.int32, np.int64])), idx_shape,
                               elements=st.integers(0, 6)))
    close(run("get_rows", [table, idx], {}, [dtype, None]), values(table, dtype)[idx])


def test_get_rows_on_strided_table() -> None:
    table = np.arange(40, dtype=np.float32).reshape(8, 5)[::2]
    idx = np.array([3, 0], np.int32)
    close(run("get_rows", [table, idx]), table[idx])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_get_rows_quantized_dequantizes_only_selected_rows(qtype: str) -> None:
    rng = np.random.default_rng(3)
    table = quant.quantize(rng.standard_normal((6, 64)).astype(np.float32), qtype)
    idx = np.array([[5, 0], [2, 2]], np.int64)
    expected = quant.dequantize(table, qtype)[idx]
    close(run("get_rows", [table, idx], {"qtype": qtype}), expected, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [7, -1, 2**31 - 1, -(2**31)])
def test_get_rows_rejects_index_values_out_of_range(bad: int) -> None:
    table = np.zeros((7, 3), np.float32)
    idx = np.array([0, bad, 1], np.int32)
    with pytest.raises(OpRuntimeError, match=f"get_rows: index {bad} is out of range"):
        run("get_rows", [table, idx])


def test_get_rows_rules() -> None:
    f32, u8 = TensorMeta((4, 3), "float32"), TensorMeta((4, 68), "uint8")
    with pytest.raises(OpError, match="idx dtype float32 is not allowed"):
        infer("get_rows", [f32, TensorMeta((2,), "float32")], {})
    with pytest.raises(OpError, match="table must have rank 2"):
        infer("get_rows", [TensorMeta((4,), "float32"), TensorMeta((2,), "int32")], {})
    assert infer("get_rows", [u8, TensorMeta((2,), "int32")], {"qtype": "q8_0"})[0].shape == (2, 64)
    with pytest.raises(OpError, match=r"table last dim 68 is not a multiple of the q4_1 block size \(20"):
        infer("get_rows", [u8, TensorMeta((2,), "int32")], {"qtype": "q4_1"})
    with pytest.raises(OpError, match="q8_0 table dtype float32 is not allowed"):
        infer("get_rows", [f32, TensorMeta((2,), "int32")], {"qtype": "q8_0"})
    with pytest.raises(OpError, match=r"param 'qtype' must be one of \['none', 'q8_0', 'q4_1'\]"):
        infer("get_rows", [f32, TensorMeta((2,), "int32")], {"qtype": "q4_0"})


# ------------------------------------------------------------------------------------- normalization


@FAST
@given(data=tensors(dtypes=FLOATS), eps=st.sampled_from([0.0, 1e-6, 1e-2]))
def test_rms_norm(data: tuple[np.ndarray, str], eps: float) -> None:
    x, dtype = data
    if x.ndim == 0:
        x = x.reshape(1)
    v = values(x, dtype)
    with np.errstate(all="ignore"):
        expected = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) if v.size else v
    close(run("rms_norm", [x], {"eps": eps}, [dtype]), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_extra", [0, 1, 2])
@FAST
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6), data=st.data())
def test_layer_norm(n_extra: int, shape: tuple[int, ...], data: st.DataObject) -> None:
    x, dtype = data.draw(tensors(shape, FLOATS))
    extras = [data.draw(tensors(shape[-1:], FLOATS)) for _ in range(n_extra)]
    v = values(x, dtype)
    centered = v - v.mean(axis=-1, keepdims=True)
    expected = centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + 1e-5)
    if n_extra >= 1:
        expected = expected * values(*extras[0])
    if n_extra == 2:
        expected = expected + values(*extras[1])
    arrays = [x] + [e for e, _ in extras]
    dtypes = [dtype] + [d for _, d in extras]
    close(run("layer_norm", arrays, {"eps": 1e-5}, dtypes), expected, rtol=1e-4, atol=1e-4)


def test_layer_norm_rules() -> None:
    x = TensorMeta((2, 4), "float32")
    with pytest.raises(OpError, match=r"layer_norm: missing required param 'eps'"):
        infer("layer_norm", [x], {})
    with pytest.raises(OpError, match=r"bias shape \(3,\) must be \(4,\)"):
        infer("layer_norm", [x, TensorMeta((4,), "float32"), TensorMeta((3,), "float32")], {"eps": 1e-5})
    with pytest.raises(OpError, match=r"param 'eps' must be in \[0.0, inf\], got -1.0"):
        infer("rms_norm", [x], {"eps": -1.0})
    with pytest.raises(OpError, match=r"input 0 dtype int32 is not allowed"):
        infer("rms_norm", [TensorMeta((2, 4), "int32")], {"eps": 1e-5})


def softmax_ref(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@FAST
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6), scale=st.floats(0.1, 2),
       use_mask=st.booleans(), data=st.data())
def test_soft_max(shape: tuple[int, ...], scale: float, use_mask: bool, data: st.DataObject) -> None:
    x, dtype = data.draw(tensors(shape, FLOATS))
    v = values(x, dtype) * np.float32(scale)
    arrays, dtypes = [x], [dtype]
    if use_mask:
        suffix = shape[len(shape) - data.draw(st.integers(0, len(shape))):]
        mask_shape = tuple(data.draw(st.sampled_from([1, n])) for n in suffix)  # broadcasts *to* x
        mask, mdtype = data.draw(tensors(mask_shape, ("float32", "float16")))
        mask[mask < -5] = -np.inf  # some -inf, as causal masks have
        arrays, dtypes = [x, mask], [dtype, mdtype]
        v = v + values(mask, mdtype)
    expected = softmax_ref(np.where(np.isneginf(v).all(axis=-1, keepdims=True), 0.0, v))
    expected[np.isneginf(v).all(axis=-1)] = 0.0
    close(run("soft_max", arrays, {"scale": scale}, dtypes), expected, atol=1e-6)


def test_soft_max_row_of_all_neg_inf_gives_zeros() -> None:
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    mask = np.array([[0.0, -np.inf, 0.0], [-np.inf, -np.inf, -np.inf]], np.float32)
    out = run("soft_max", [x, mask])
    close(out[0], softmax_ref(np.array([1.0, -np.inf, 3.0])))
    assert out[1].tolist() == [0.0, 0.0, 0.0]


def test_soft_max_mask_must_broadcast_to_x() -> None:
    with pytest.raises(OpError, match=r"mask shape \(2, 4\) does not broadcast to x shape \(4,\)"):
        infer("soft_max", [TensorMeta((4,), "float32"), TensorMeta((2, 4), "float32")], {})


# ------------------------------------------------------------------------------- attention, swiglu


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                  scale: float) -> np.ndarray:
    """float64, one query row and head at a time; every key masked gives a zero row."""
    T, H, _ = q.shape
    group = H // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(T):
        for h in range(H):
            s = scale * (k[:, h // group] @ q[t, h])
            if mask is not None:
                s = s + np.broadcast_to(mask, (T, k.shape[0]))[t]
            if not np.isneginf(s).all():
                e = np.exp(s - s.max())
                out[t, h] = e @ v[:, h // group] / e.sum()
    return out


def unfused_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
                      scale: float) -> np.ndarray:
    """What graphs without ``attention`` run: per KV head, matmul, soft_max, matmul."""
    T, H, D = q.shape
    group = H // k.shape[1]
    out = np.empty(q.shape, np.float32)
    for kh in range(k.shape[1]):
        qs = np.ascontiguousarray(q[:, kh * group:(kh + 1) * group].transpose(1, 0, 2))
        scores = run("matmul", [qs, np.ascontiguousarray(k[:, kh])], {"transpose_b": True})
        extra = [] if mask is None else [mask]
        probs = run("soft_max", [scores, *extra], {"scale": scale})
        out[:, kh * group:(kh + 1) * group] = run(
            "matmul", [probs, np.ascontiguousarray(v[:, kh])]).transpose(1, 0, 2)
    return out


@FAST
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(1, 7),
                       st.sampled_from([1, 4, 8])),
       dtype=st.sampled_from(["float32", "float16"]), mask_kind=st.sampled_from(["none", "row", "full"]),
       data=st.data())
def test_attention_matches_reference_and_the_unfused_ops(
        shape: tuple[int, int, int, int, int], dtype: str, mask_kind: str, data: st.DataObject) -> None:
    T, kv_heads, group, S, D = shape
    rng = np.random.default_rng(data.draw(st.integers(0, 1000)))
    q = rng.standard_normal((T, kv_heads * group, D)).astype(np.float32)
    k, v = (stored(rng.standard_normal((S, kv_heads, D)), dtype) for _ in range(2))
    mask = None
    if mask_kind != "none":
        mask = np.where(rng.random((T if mask_kind == "full" else 1, S)) < 0.3, -np.inf,
                        rng.standard_normal((1, S))).astype(np.float32)
    scale = data.draw(st.sampled_from([1.0, 0.125]))
    inputs = [q, k, v] + ([] if mask is None else [mask])
    got = run("attention", inputs, {"scale": scale}, [None, dtype, dtype] + [None] * (mask is not None))
    expected = attention_ref(q.astype(np.float64), values(k, dtype), values(v, dtype), mask, scale)
    close(got, expected, rtol=1e-5, atol=1e-5)
    if dtype == "float32":
        close(got, unfused_attention(q, k, v, mask, scale), rtol=1e-5, atol=1e-6)


def test_attention_reads_strided_queries_and_skips_masked_keys() -> None:
    """q as a view of a fused QKV row; keys behind a -inf mask are never read (NaN there does
    not reach the result on the CPU kernel); a row with every key masked is zeros."""
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((2, 5, 8)).astype(np.float32)
    q = qkv[:, :4]                                              # (2, 4, 8), strided
    k, v = rng.standard_normal((2, 6, 2, 8)).astype(np.float32)
    mask = np.zeros((2, 6), np.float32)
    mask[0, 3:] = -np.inf
    mask[1, :] = -np.inf
    expected = attention_ref(q.astype(np.float64), k, v, mask, 0.5)
    got = run("attention", [q, k, v, mask], {"scale": 0.5})
    close(got, expected, rtol=1e-5, atol=1e-6)
    assert not got[1].any()
    if _DEVICE["name"] == "cpu" and numpy_ops.kernels.fused_kernels() is not None:
        k[3:], v[3:] = np.nan, np.nan
        close(run("attention", [q[:1], k, v, mask[:1]], {"scale": 0.5}), expected[:1], rtol=1e-5, atol=1e-6)


def test_fused_attention_and_swiglu_match_their_numpy_composition() -> None:
    """The numba loops against the composition every other namespace runs, on the same input."""
    if numpy_ops.kernels.fused_kernels() is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(9)
    q = rng.standard_normal((3, 9, 64)).astype(np.float32)
    k, v = rng.standard_normal((2, 40, 3, 64)).astype(np.float32)
    mask = np.where(np.arange(40)[None, :] <= np.array([[10], [25], [39]]), 0, -np.inf).astype(np.float32)
    metas = [meta_of(a) for a in (q, k, v, mask)]
    composed, chunk = np.empty_like(q), np.empty_like(q)
    numpy_ops._attention_composed([q, k, v, mask], metas, {"scale": 0.125}, composed)
    for t in range(3):                        # one row: the fused loop
        fused = np.empty_like(q[t:t + 1])
        row = [meta_of(a) for a in (q[t:t + 1], k, v, mask[t:t + 1])]
        numpy_ops._attention([q[t:t + 1], k, v, mask[t:t + 1]], row, {"scale": 0.125}, fused)
        np.testing.assert_allclose(fused, composed[t:t + 1], rtol=1e-5, atol=1e-6)
    numpy_ops._attention([q, k, v, mask], metas, {"scale": 0.125}, chunk)   # live keys only
    np.testing.assert_allclose(chunk, composed, rtol=1e-5, atol=1e-6)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    with np.errstate(all="ignore"):
        silu = run("silu", [x[:, :48]])
        np.testing.assert_allclose(run("swiglu", [x]), run("mul", [silu, x[:, 48:]]), rtol=1e-6)


def test_a_chunk_attends_over_the_live_keys_only() -> None:
    """A prefill chunk early in a long cache reads the keys between the first and the last
    that some row's mask leaves live (NaN past and before them does not reach the result),
    and gives what attention over the whole cache gives."""
    rng = np.random.default_rng(11)
    q = rng.standard_normal((4, 4, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 64, 2, 16)).astype(np.float32)
    pos = np.arange(20, 24)
    keys = np.arange(64)[None, :]
    mask = np.where((keys <= pos[:, None]) & (keys > pos[:, None] - 8), 0, -np.inf)
    mask = mask.astype(np.float32)                              # a window of 8: keys 13..23
    expected = attention_ref(q.astype(np.float64), k, v, mask, 0.25)
    k[:13], v[:13], k[24:], v[24:] = np.nan, np.nan, np.nan, np.nan
    close(run("attention", [q, k, v, mask], {"scale": 0.25}), expected, rtol=1e-5, atol=1e-6)


def test_fused_kernels_never_compile_while_a_graph_runs() -> None:
    """Arrays their warmed signature does not take (read-only ones here) run the numpy
    composition: compiling a new specialization would hold the backend thread for seconds
    (numba's kernels compile none; where the kernels built ahead of time run, their guards
    refuse those arrays as numba's kernels would)."""
    if numpy_ops.kernels.fused_kernels() is None or _DEVICE["name"] != "cpu":
        pytest.skip("numba kernels run on host arrays only")
    from zmq_rpc.worker.kernels import fused
    names = ("attention", "rope", "swiglu", "rms_norm")
    compiled = {name: len(getattr(fused, name).signatures) for name in names}
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    for a in (q, k, v):
        a.setflags(write=False)
    close(run("attention", [q, k, v], {"scale": 0.5}), attention_ref(q, k, v, None, 0.5),
          rtol=1e-5, atol=1e-6)
    pos = np.arange(2, dtype=np.int32)
    pos.setflags(write=False)
    close(run("rope", [q, pos], {"n_dims": 8}), rope_ref(q, pos, 8, "normal", 10000.0, 1.0),
          rtol=1e-5, atol=1e-5)
    x = q.reshape(2, 32)
    close(run("rms_norm", [x], {"eps": 1e-5}),
          x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5), rtol=1e-5)
    with np.errstate(all="ignore"):
        close(run("swiglu", [x]), run("mul", [run("silu", [x[:, :16]]), x[:, 16:]]), rtol=1e-6)
    assert {name: len(getattr(fused, name).signatures) for name in names} == compiled


@pytest.mark.parametrize("shapes,message", [
    (((1, 9, 64), (8, 3, 32), (8, 3, 32)), r"head size of q"),
    (((1, 8, 4), (8, 3, 4), (8, 3, 4)), r"q heads 8 must be a multiple of k heads 3"),
    (((1, 3, 4), (8, 0, 4), (8, 0, 4)), r"must be a multiple of k heads 0"),
    (((1, 3, 4), (8, 3, 4), (7, 3, 4)), r"k shape \(8, 3, 4\) != v shape"),
    (((3, 4), (8, 3, 4), (8, 3, 4)), r"q \(rows, heads, head size\) must have rank 3"),
    (((2, 3, 4), (8, 3, 4), (8, 3, 4), (3, 8)), r"mask: shapes \(2, 8\) and \(3, 8\) do not broadcast"),
    (((2, 3, 4), (8, 3, 4), (8, 3, 4), (1, 2, 8)), r"mask must have rank in \[1, 2\]"),
])
def test_attention_rules(shapes: tuple[tuple[int, ...], ...], message: str) -> None:
    with pytest.raises(OpError, match=message):
        infer("attention", [TensorMeta(s, "float32") for s in shapes], {})


def test_swiglu_rules_and_work() -> None:
    assert infer("swiglu", [TensorMeta((2, 8), "float16")], {})[0] == TensorMeta((2, 4), "float32")
    with pytest.raises(OpError, match="last dim 7 must be even"):
        infer("swiglu", [TensorMeta((2, 7), "float32")], {})
    with pytest.raises(OpError, match="must be contiguous"):
        infer("swiglu", [TensorMeta((2, 8), "float32", False)], {})
    q, kv = TensorMeta((1, 9, 64), "float32"), TensorMeta((512, 3, 64), "float32")
    out, _ = infer("attention", [q, kv, kv], {})
    assert node_work("attention", [q, kv, kv], out) > 2 * 9 * 512 * 64 // MAC_WEIGHT


# ------------------------------------------------------------------------- rows of many sequences


def rows_case(rng: np.random.Generator, dtype: str, window: int) -> dict[str, Any]:
    """Three sequences in one cache of 40 rows (bases 0, 13, 27), and 9 query rows among them: a
    prefill chunk of the first (consecutive positions), decode rows of the others, one padding
    row (pos -1, base out of range: it must read nothing)."""
    H, H_kv, D = 6, 2, 8
    k, v = (stored(rng.standard_normal((40, H_kv, D)), dtype) for _ in range(2))
    pos = np.array([0, 1, 2, 3, 12, -1, 5, 9, 11], np.int32)
    base = np.array([0, 0, 0, 0, 13, 999, 27, 27, 27], np.int32)
    q = rng.standard_normal((pos.size, H, D)).astype(np.float32)
    return {"q": q, "k": k, "v": v, "pos": pos, "base": base, "dtype": dtype,
            "params": {"scale": 0.35, "window": window}}


def attend(case: Mapping[str, Any], rows: Any = slice(None)) -> np.ndarray:
    c = case
    return run("attend_rows", [c["q"][rows], c["k"], c["v"], c["pos"][rows], c["base"][rows]],
               c["params"], [None, c["dtype"], c["dtype"], None, None])


def equivalent_mask(pos: int, base: int, window: int, rows: int) -> np.ndarray:
    """The (1, R) mask that makes ``attention`` attend exactly where ``attend_rows`` row does."""
    first = max(0, pos - window + 1) if window else 0
    mask = np.full((1, rows), -np.inf, np.float32)
    mask[0, base + first:base + pos + 1] = 0
    return mask


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("window", [0, 3])
def test_attend_rows_matches_attention_with_the_equivalent_mask(dtype: str, window: int) -> None:
    case = rows_case(np.random.default_rng(11), dtype, window)
    got = attend(case)
    for b, (p, base) in enumerate(zip(case["pos"].tolist(), case["base"].tolist(), strict=True)):
        if p < 0:
            assert not got[b].any(), "a padding row must come out as zeros"
            continue
        mask = equivalent_mask(p, base, window, case["k"].shape[0])
        want = run("attention", [case["q"][b:b + 1], case["k"], case["v"], mask], {"scale": 0.35},
                   [None, dtype, dtype, None])
        close(got[b:b + 1], want, rtol=1e-5, atol=1e-6)
        close(got[b:b + 1], attention_ref(case["q"][b:b + 1].astype(np.float64), values(case["k"], dtype),
                                          values(case["v"], dtype), mask, 0.35), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attend_rows_is_batch_invariant_bit_for_bit(dtype: str) -> None:
    """One query row gives the same bits alone, in any batch of 2 to 33 rows and at any place
    in it, whatever the other rows hold (other sequences, other positions, padding)."""
    rng = np.random.default_rng(12)
    case = rows_case(rng, dtype, 4)
    alone = attend({**case, "q": case["q"][6:7], "pos": case["pos"][6:7], "base": case["base"][6:7]})
    for batch in (2, 3, 7, 16, 33):
        pick = rng.integers(0, case["pos"].size, batch)
        at = int(rng.integers(0, batch))
        pick[at] = 6
        mixed = {**case, "q": rng.standard_normal((batch, 6, 8)).astype(np.float32),
                 "pos": case["pos"][pick], "base": case["base"][pick]}
        mixed["q"][at] = case["q"][6]
        got = attend(mixed)
        assert np.array_equal(got[at], alone[0]), f"row at {at} of {batch} differs from the row alone"


def test_attend_rows_refuses_rows_outside_the_cache_and_reads_nothing_for_padding() -> None:
    case = rows_case(np.random.default_rng(13), "float32", 0)
    for pos, base in ((12, 28), (0, 40), (0, -1)):
        bad = {**case, "pos": np.array([3, pos], np.int32), "base": np.array([0, base], np.int32),
               "q": case["q"][:2]}
        with pytest.raises(OpRuntimeError, match=r"attend_rows: row 1 reads cache rows .* outside \[0, 40\)"):
            attend(bad)
    padding = {**case, "pos": np.array([-1, -7], np.int32), "base": np.array([2**31 - 1, -5], np.int32),
               "q": case["q"][:2]}
    assert not attend(padding).any()


@pytest.mark.parametrize("change,message", [
    ({"q": TensorMeta((2, 6, 8), "float16")}, r"q dtype float16"),
    ({"k": TensorMeta((40, 2, 8), "bfloat16")}, r"k_cache dtype bfloat16"),
    ({"v": TensorMeta((40, 2, 8), "float16")}, r"k_cache \(40, 2, 8\) float32 != v_cache"),
    ({"k": TensorMeta((40, 4, 8), "float32"), "v": TensorMeta((40, 4, 8), "float32")},
     r"q heads 6 must be a multiple of k_cache heads 4"),
    ({"k": TensorMeta((40, 2, 4), "float32"), "v": TensorMeta((40, 2, 4), "float32")}, r"head size"),
    ({"pos": TensorMeta((2,), "int64")}, r"pos dtype int64"),
    ({"base": TensorMeta((3,), "int32")}, r"base shape \(3,\) must be \(B,\) = \(2,\)"),
])
def test_attend_rows_rules(change: dict[str, TensorMeta], message: str) -> None:
    metas = {"q": TensorMeta((2, 6, 8), "float32"), "k": TensorMeta((40, 2, 8), "float32"),
             "v": TensorMeta((40, 2, 8), "float32"), "pos": TensorMeta((2,), "int32"),
             "base": TensorMeta((2,), "int32")}
    out, params = infer("attend_rows", list(metas.values()), {"scale": 0.5})
    assert out == TensorMeta((2, 6, 8), "float32") and params == {"scale": 0.5, "window": 0}
    with pytest.raises(OpError, match=message):
        infer("attend_rows", list({**metas, **change}.values()), {"scale": 0.5})
    with pytest.raises(OpError, match=r"window.*must be in \[0"):
        infer("attend_rows", list(metas.values()), {"window": -1})


@pytest.mark.parametrize("window", [0, 1, 3])
def test_causal_mask_is_the_mask_the_client_used_to_send(window: int) -> None:
    """Row t sees the keys j <= pos[t] (within the window), padding rows (pos -1 or the
    scratch row n_ctx) see none: the mask client/llama/runtime.py builds for a worker before
    protocol 1.13, bit for bit (0.0 and -inf), for a strided view of the positions too."""
    n_ctx = 7
    pos = np.array([0, 3, 6, -1, 7, 2**31 - 1, -(2**31)], np.int32)
    want = np.full((pos.size, n_ctx), -np.inf, np.float32)
    for t, p in enumerate(pos.tolist()):
        if 0 <= p < n_ctx:
            first = max(0, p - window + 1) if window else 0
            want[t, first:p + 1] = 0.0
    got = run("causal_mask", [pos], {"n_ctx": n_ctx, "window": window})
    assert np.array_equal(got, want) and not np.signbit(got[got == 0]).any()
    strided = np.repeat(pos, 2)[::2]
    assert np.array_equal(run("causal_mask", [strided], {"n_ctx": n_ctx, "window": window}), want)


@pytest.mark.parametrize("metas,params,message", [
    ([TensorMeta((3,), "int64")], {"n_ctx": 4}, r"pos dtype int64"),
    ([TensorMeta((3, 1), "int32")], {"n_ctx": 4}, r"pos \(T,\)"),
    ([TensorMeta((3,), "int32")], {}, r"n_ctx"),
    ([TensorMeta((3,), "int32")], {"n_ctx": 0}, r"n_ctx.*must be in \[1"),
    ([TensorMeta((3,), "int32")], {"n_ctx": 4, "window": -1}, r"window.*must be in \[0"),
])
def test_causal_mask_rules(metas: list[TensorMeta], params: dict[str, Any], message: str) -> None:
    out, norm = infer("causal_mask", [TensorMeta((3,), "int32")], {"n_ctx": 5})
    assert out == TensorMeta((3, 5), "float32") and norm == {"n_ctx": 5, "window": 0}
    with pytest.raises(OpError, match=message):
        infer("causal_mask", metas, params)


def test_attend_rows_work_counts_the_rows_reached_not_the_cache_per_head() -> None:
    """Each query row may reach all R cache rows: its work is ~ B R H_kv D reads, bounded from
    the shapes (the max-graph-work guard), and grows linearly in B and in R."""
    def work(b: int, r: int) -> int:
        metas = [TensorMeta((b, 32, 64), "float32"), TensorMeta((r, 8, 64), "float16"),
                 TensorMeta((r, 8, 64), "float16"), TensorMeta((b,), "int32"), TensorMeta((b,), "int32")]
        return node_work("attend_rows", metas, infer("attend_rows", metas, {})[0])
    reads = 2 * 16 * 4096 * 8 * 64
    assert reads <= work(16, 4096) <= 2 * reads
    assert work(32, 4096) - work(16, 4096) > reads // 2 and work(16, 8192) - work(16, 4096) > reads // 2


# ------------------------------------------------------------------------------------- sampling


def splitmix_uniform(seed: int, counter: int) -> float:
    """The specified draw, in Python integers (the reference for both kernels)."""
    mask = (1 << 64) - 1
    z = ((seed << 32) | (counter & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15 & mask
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def sample(logits: np.ndarray, temperature: Any, top_k: Any, top_p: Any, seed: Any, counter: Any) -> np.ndarray:
    b = logits.shape[0]
    vec = [np.broadcast_to(np.asarray(x, dtype), (b,)).copy() for x, dtype in (
        (temperature, np.float32), (top_k, np.int32), (top_p, np.float32), (seed, np.uint32),
        (counter, np.int32))]
    return run("sample_rows", [np.ascontiguousarray(logits, np.float32), *vec])


def restricted_softmax(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference of the distribution a row draws from."""
    s = logits.astype(np.float32) / np.float32(temperature)
    order = np.argsort(-s, kind="stable")
    e = np.exp(s.astype(np.float64) - s.max())
    keep = order[:top_k] if 0 < top_k < s.size else order
    if top_p < 1:
        running = np.cumsum(e[keep])
        keep = keep[:int(np.searchsorted(running, top_p * e[keep].sum())) + 1]
    probs = np.zeros(s.size)
    probs[keep] = e[keep] / e[keep].sum()
    return probs


def test_sample_rows_uniform_is_the_specified_splitmix64() -> None:
    fused = None
    if numpy_ops.kernels.available():      # numba's kernel (the built ones export sample_rows only)
        from zmq_rpc.worker.kernels import fused
    seeds = np.array([0, 1, 2**32 - 1, 123456789, 42], np.uint32)
    counters = np.array([0, -1, 2**31 - 1, 7, -(2**31)], np.int32)
    want = [splitmix_uniform(int(s), int(c)) for s, c in zip(seeds, counters, strict=True)]
    assert numpy_ops._splitmix_uniform(seeds, counters).tolist() == want
    if fused is not None:
        assert [fused.uniform(s, c) for s, c in zip(seeds, counters, strict=True)] == want


def test_sample_rows_greedy_rows_take_the_argmax() -> None:
    """temperature <= 0 (or NaN), and top_k == 1 at any temperature, give argmax: the lowest
    index among equal maxima."""
    rng = np.random.default_rng(21)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    logits[0, [3, 30]] = 9.0                       # a tie: 3 wins
    got = sample(logits, [0.0, -1.0, np.nan, 0.8, 1.5, 0.0], [0, 0, 0, 1, 1, 5], 0.9, 7, 3)
    assert got.tolist() == np.argmax(logits, axis=-1).tolist() and got[0] == 3


def test_sample_rows_fixed_seed_and_counter_give_one_token_in_any_batch() -> None:
    """A row's token depends only on its logits, seed and counter: the same alone, across calls,
    and at any place in batches of 2 to 33 rows of other settings."""
    rng = np.random.default_rng(22)
    row = rng.standard_normal(300).astype(np.float32) * 3
    settings_ = (1.0, 40, 0.95, 1234, 17)
    alone = sample(row[None], *settings_)
    assert sample(row[None], *settings_).tolist() == alone.tolist()
    for batch in (2, 3, 7, 16, 33):
        logits = rng.standard_normal((batch, 300)).astype(np.float32)
        at = int(rng.integers(0, batch))
        logits[at] = row
        cols = [rng.uniform(0.1, 2, batch), rng.integers(0, 60, batch), rng.uniform(0.5, 1, batch),
                rng.integers(0, 2**32, batch), rng.integers(0, 1000, batch)]
        for col, value in zip(cols, settings_, strict=True):
            col[at] = value
        assert sample(logits, *cols)[at] == alone[0], f"row at {at} of {batch} drew another token"


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 0.9), (1.3, 0, 1.0), (1.0, 0, 0.6), (2.0, 3, 1.0)])
def test_sample_rows_draws_follow_the_restricted_softmax(temperature: float, top_k: int, top_p: float) -> None:
    """4000 draws (counters 0..3999) of one row: no token outside the kept set, and a chi-square
    statistic below the 0.1 % critical value of its degrees of freedom."""
    logits = np.array([2.0, 1.5, 1.5, 0.3, -0.5, 1.0, -2.0, 0.9], np.float32)
    draws = 4000
    tokens = sample(np.tile(logits, (draws, 1)), temperature, top_k, top_p, 99, np.arange(draws))
    probs = restricted_softmax(logits, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=logits.size)
    assert not counts[probs == 0].any(), f"drew outside the kept set: {counts} for {probs}"
    kept = probs > 0
    chi2 = (((counts[kept] - draws * probs[kept]) ** 2) / (draws * probs[kept])).sum()
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[int(kept.sum()) - 1]
    assert chi2 < critical, f"chi-square {chi2:.1f} >= {critical} (counts {counts}, probs {probs.round(3)})"


def test_sample_rows_numba_and_composition_draw_the_same_tokens() -> None:
    """The numba loop and the whole-array composition (a GPU's) on a large vocabulary, every
    kind of row: greedy, top-k, nucleus (with its pruning), both."""
    fused = numpy_ops.kernels.fused_kernels()
    if fused is None or _DEVICE["name"] != "cpu":
        pytest.skip("compares the host's numba loop with the composition")
    rng = np.random.default_rng(23)
    b, vocab = 24, 5000
    logits = (rng.standard_normal((b, vocab)) * rng.choice([0.5, 3.0, 8.0], (b, 1))).astype(np.float32)
    cols = [np.where(rng.random(b) < 0.2, 0, rng.uniform(0.3, 1.5, b)).astype(np.float32),
            rng.choice([0, 1, 5, 50, 4999], b).astype(np.int32), rng.choice([1.0, 0.9, 0.5, 0.99], b).astype(np.float32),
            rng.integers(0, 2**32, b).astype(np.uint32), rng.integers(-5, 10**6, b).astype(np.int32)]
    numba_out, composed = np.empty(b, np.int32), np.empty(b, np.int32)
    fused.sample_rows(logits, *cols, numba_out)
    numpy_ops._sample_rows_composed([logits, *cols], composed)
    assert numba_out.tolist() == composed.tolist()


def test_sample_rows_rules() -> None:
    metas = [TensorMeta((3, 10), "float32"), TensorMeta((3,), "float32"), TensorMeta((3,), "int32"),
             TensorMeta((3,), "float32"), TensorMeta((3,), "uint32"), TensorMeta((3,), "int32")]
    assert infer("sample_rows", metas, {})[0] == TensorMeta((3,), "int32")
    with pytest.raises(OpError, match=r"seed dtype int64"):
        infer("sample_rows", [*metas[:4], TensorMeta((3,), "int64"), metas[5]], {})
    with pytest.raises(OpError, match=r"top_k shape \(2,\) must be \(B,\)"):
        infer("sample_rows", [metas[0], metas[1], TensorMeta((2,), "int32"), *metas[3:]], {})
    with pytest.raises(OpError, match=r"logits \(rows, vocabulary\) must have rank 2"):
        infer("sample_rows", [TensorMeta((10,), "float32"), *metas[1:]], {})


# ---------------------------------------------------------------------------------------------- rope


def rope_ref(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: str, base: float, scale: float,
             factors: np.ndarray | None = None) -> np.ndarray:
    """ggml's definition, one feature pair at a time (``factors``: ggml_rope_ext's freq factors,
    dividing each frequency)."""
    out = x.astype(np.float64).copy()
    for i in range(n_dims // 2):
        theta = pos.astype(np.float64) * scale * base ** (-2.0 * i / n_dims)  # (T,)
        if factors is not None:
            theta = theta / float(factors[i])
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]  # broadcast over heads
        j0, j1 = (i, i + n_dims // 2) if mode == "neox" else (2 * i, 2 * i + 1)
        x0, x1 = x[..., j0].astype(np.float64), x[..., j1].astype(np.float64)
        out[..., j0], out[..., j1] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


@pytest.mark.parametrize("mode", ["normal", "neox"])
@FAST
@given(lead=hnp.array_shapes(min_dims=0, max_dims=1, max_side=2), th=st.tuples(st.integers(1, 5), st.integers(1, 3)),
       head=st.sampled_from([2, 4, 8, 10]), data=st.data())
def test_rope(mode: str, lead: tuple[int, ...], th: tuple[int, int], head: int, data: st.DataObject) -> None:
    n_dims = data.draw(st.sampled_from([d for d in (2, 4, 8) if d <= head]))
    x, dtype = data.draw(tensors(lead + th + (head,), ("float32", "float16", "bfloat16")))
    pos = data.draw(hnp.arrays(np.int32, (th[0],), elements=st.integers(0, 4096)))
    base, scale = data.draw(st.sampled_from([10000.0, 500.0])), data.draw(st.sampled_from([1.0, 0.25]))
    params = {"n_dims": n_dims, "mode": mode, "freq_base": base, "freq_scale": scale}
    expected = rope_ref(values(x, dtype), pos, n_dims, mode, base, scale)
    close(run("rope", [x, pos], params, [dtype, None]), expected, rtol=1e-5, atol=1e-5)


def test_rope_modes_differ_and_pass_through_the_rest() -> None:
    x = np.arange(16, dtype=np.float32).reshape(1, 2, 8)
    pos = np.array([3], np.int32)
    normal = run("rope", [x, pos], {"n_dims": 4})
    neox = run("rope", [x, pos], {"n_dims": 4, "mode": "neox"})
    assert not np.allclose(normal, neox)
    np.testing.assert_array_equal(normal[..., 4:], x[..., 4:])
    close(normal[0, 0, :2], [0 * math.cos(3) - 1 * math.sin(3), 0 * math.sin(3) + 1 * math.cos(3)])


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("shape", [(5, 2, 8), (2, 5, 3, 8)])
def test_rope_freq_factors_divide_the_frequencies(mode: str, shape: tuple[int, ...]) -> None:
    """Protocol 1.11 (``rope-factors``): a third input (n_dims / 2,) divides each frequency, as
    ggml_rope_ext's freq factors (Llama 3.x's ``rope_freqs``); partial rotary keeps the rest.
    Rank 3 float32 runs the numba kernel on the host, rank 4 the numpy composition."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape).astype(np.float32)
    pos = np.array([0, 3, 17, 40, 511][:shape[-3]], np.int32)
    factors = np.array([1.0, 2.5, 8.0], np.float32)
    params = {"n_dims": 6, "mode": mode, "freq_base": 500.0, "freq_scale": 0.5}
    got = run("rope", [x, pos, factors], params)
    close(got, rope_ref(x, pos, 6, mode, 500.0, 0.5, factors), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, run("rope", [x, pos], params), atol=1e-3)
    close(run("rope", [x, pos, np.ones(3, np.float32)], params), run("rope", [x, pos], params),
          rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factors,message", [
    (TensorMeta((4,), "float32"), r"freq_factors shape \(4,\) must be \(n_dims / 2,\) = \(3,\)"),
    (TensorMeta((3,), "int32"), r"freq_factors dtype int32 is not allowed"),
])
def test_rope_freq_factors_rules(factors: TensorMeta, message: str) -> None:
    x, pos = TensorMeta((3, 2, 8), "float32"), TensorMeta((3,), "int32")
    assert infer("rope", [x, pos, TensorMeta((3,), "float16")], {"n_dims": 6})[0].shape == (3, 2, 8)
    with pytest.raises(OpError, match=message):
        infer("rope", [x, pos, factors], {"n_dims": 6})


@pytest.mark.parametrize("x_shape,pos,params,message", [
    ((3, 2, 8), (3,), {"n_dims": 5}, r"rope: n_dims 5 must be even and <= head size 8"),
    ((3, 2, 8), (3,), {"n_dims": 10}, r"n_dims 10 must be even and <= head size 8"),
    ((3, 2, 8), (4,), {"n_dims": 8}, r"pos shape \(4,\) must be \(T,\) = \(3,\)"),
    ((2, 8), (2,), {"n_dims": 8}, r"x \(\.\.\., T, H, D\) must have rank in \[3, 8\]"),
    ((3, 2, 8), (3,), {}, r"missing required param 'n_dims'"),
    ((3, 2, 8), (3,), {"n_dims": 8, "freq_base": 0.0}, r"param 'freq_base' must be > 0"),
    ((3, 2, 8), (3,), {"n_dims": 8, "freq_base": math.nan}, r"param 'freq_base' must be a finite float, got nan"),
    ((3, 2, 8), (3,), {"n_dims": 8, "mode": 2}, r"param 'mode' must be one of \['normal', 'neox'\], got 2"),
])
def test_rope_rules(x_shape: tuple[int, ...], pos: tuple[int, ...], params: dict[str, Any], message: str) -> None:
    with pytest.raises(OpError, match=message):
        infer("rope", [TensorMeta(x_shape, "float32"), TensorMeta(pos, "int32")], params)


# ------------------------------------------------------------------------------ masks and reductions


@FAST
@given(shape=hnp.array_shapes(min_dims=2, max_dims=4, min_side=1, max_side=6), n_past=st.integers(0, 7),
       data=st.data())
def test_diag_mask_inf(shape: tuple[int, ...], n_past: int, data: st.DataObject) -> None:
    x, dtype = data.draw(tensors(shape, FLOATS))
    t, s = shape[-2:]
    masked = np.triu(np.ones((t, s), bool), k=n_past + 1)
    expected = np.where(masked, -np.inf, values(x, dtype))
    np.testing.assert_array_equal(run("diag_mask_inf", [x], {"n_past": n_past}, [dtype]), expected)


@pytest.mark.parametrize("op,fn", [("sum", np.sum), ("mean", np.mean)])
@FAST
@given(data=tensors(), keepdims=st.booleans(), pick=st.data())
def test_reductions(op: str, fn: Callable[..., np.ndarray], data: tuple[np.ndarray, str], keepdims: bool,
                    pick: st.DataObject) -> None:
    x, dtype = data
    axes = pick.draw(st.lists(st.integers(-x.ndim, x.ndim - 1), unique_by=lambda a: a % x.ndim, max_size=x.ndim)
                     if x.ndim else st.just([]))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "mean of empty slice"
        expected = fn(values(x, dtype), axis=tuple(axes), keepdims=keepdims)
    close(run(op, [x], {"axis": axes, "keepdims": keepdims}, [dtype]), expected, atol=1e-5)


def test_reduction_rules() -> None:
    x = TensorMeta((2, 3), "float32")
    assert infer("sum", [x], {"axis": -1}) == (TensorMeta((2,), "float32"), {"axis": (1,), "keepdims": False})
    with pytest.raises(OpError, match=r"sum: axis \(0, -2\) repeats an axis"):
        infer("sum", [x], {"axis": [0, -2]})
    with pytest.raises(OpError, match="mean: axis 2 is out of range for rank 2"):
        infer("mean", [x], {"axis": 2})
    with pytest.raises(OpError, match="param 'axis' must be a list of at most 8 ints, got 1.0"):
        infer("mean", [x], {"axis": 1.0})


@FAST
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6), data=st.data())
def test_argmax(shape: tuple[int, ...], data: st.DataObject) -> None:
    x, dtype = data.draw(tensors(shape))
    out = run("argmax", [x], {}, [dtype])
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.argmax(values(x, dtype), axis=-1))


def test_argmax_needs_a_non_empty_last_axis() -> None:
    with pytest.raises(OpError, match=r"argmax: last dim must be in \[1, 2\*\*31\), got 0"):
        infer("argmax", [TensorMeta((3, 0), "float32")], {})


# --------------------------------------------------------------------------- copies and conversion


@FAST
@given(data=tensors(dtypes=NUMERIC + ("uint64", "int16")))
def test_cont_copies_strided_input_and_keeps_dtype(data: tuple[np.ndarray, str]) -> None:
    x, dtype = data
    view = x.T
    out = run("cont", [view], {}, [dtype])
    assert out.flags.c_contiguous and out.dtype == x.dtype
    np.testing.assert_array_equal(out, view)


@FAST
@given(shapes=st.lists(st.integers(0, 3), min_size=1, max_size=4), axis=st.integers(0, 2), data=st.data())
def test_concat(shapes: list[int], axis: int, data: st.DataObject) -> None:
    parts = []
    for n in shapes:
        shape = [2, 3, 2]
        shape[axis] = n
        parts.append(data.draw(tensors(tuple(shape), ("float32", "float16", "bfloat16", "int32"))))
    arrays, dtypes = [p for p, _ in parts], [d for _, d in parts]
    out = run("concat", arrays, {"axis": axis - 3}, dtypes)
    expected = np.concatenate([values(a, d) for a, d in parts], axis=axis)
    if len(set(dtypes)) == 1:
        assert out.dtype == arrays[0].dtype
        np.testing.assert_array_equal(out, np.concatenate(arrays, axis=axis))
    else:
        close(out, expected)


def test_concat_rules() -> None:
    a, b = TensorMeta((2, 3), "float32"), TensorMeta((2, 4), "float16")
    assert infer("concat", [a, b], {"axis": 1})[0] == TensorMeta((2, 7), "float32")
    with pytest.raises(OpError, match=r"input 1 shape \(2, 4\) does not match \(2, 3\) outside axis 0"):
        infer("concat", [a, b], {"axis": 0})
    with pytest.raises(OpError, match=r"concat: missing required param 'axis'"):
        infer("concat", [a, b], {})


@pytest.mark.parametrize("src_dtype", NUMERIC)
@pytest.mark.parametrize("dst_dtype", FLOATS + ("int32", "uint8"))
def test_cpy_converts(src_dtype: str, dst_dtype: str) -> None:
    rng = np.random.default_rng(4)
    src = stored(rng.integers(0, 64, (3, 4)) / 4, src_dtype)
    dst = stored(np.full((3, 4), 7.0), dst_dtype)
    run("cpy", [src, dst], {}, [src_dtype, dst_dtype])
    v = values(src, src_dtype)
    expected = stored(v, dst_dtype) if dst_dtype in FLOATS else np.trunc(v)  # float -> int truncates
    np.testing.assert_array_equal(values(dst, dst_dtype), values(expected, dst_dtype) if dst_dtype in FLOATS else expected)


def test_cpy_into_strided_destination_and_between_shapes() -> None:
    big = np.zeros((4, 6), np.float32)
    src = np.arange(8, dtype=np.float32).reshape(4, 2)
    run("cpy", [src, big[:, ::3]])
    np.testing.assert_array_equal(big[:, ::3], src)
    assert big[:, 1].sum() == 0
    flat = np.zeros(8, np.float16)
    run("cpy", [src, flat])
    np.testing.assert_array_equal(flat, src.ravel())
    with pytest.raises(OpError, match=r"cpy: src shape \(4, 2\) != dst shape \(8,\) \(different shapes need both"):
        infer("cpy", [TensorMeta((4, 2), "float32"), TensorMeta((8,), "float32", contiguous=False)], {})


@pytest.mark.parametrize("dst_dtype", ["float32", "float16", "bfloat16"])
def test_set_rows(dst_dtype: str) -> None:
    dst = stored(np.zeros((5, 2, 3)), dst_dtype)
    src = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    idx = np.array([4, 1], np.int64)
    run("set_rows", [dst, src, idx], {}, [dst_dtype, None, None])
    expected = np.zeros((5, 2, 3))
    expected[idx] = src
    np.testing.assert_array_equal(values(dst, dst_dtype), expected)


@pytest.mark.parametrize("bad", [5, -1, -5])
def test_set_rows_rejects_index_values_before_writing(bad: int) -> None:
    dst = np.zeros((5, 3), np.float32)
    with pytest.raises(OpRuntimeError, match=f"set_rows: index {bad} is out of range"):
        run("set_rows", [dst, np.ones((2, 3), np.float32), np.array([0, bad], np.int32)])
    assert not dst.any()


def test_set_rows_rules() -> None:
    dst = TensorMeta((5, 3), "float32")
    with pytest.raises(OpError, match=r"src shape \(2, 4\) must be \(k,\) \+ dst row shape \(3,\)"):
        infer("set_rows", [dst, TensorMeta((2, 4), "float32"), TensorMeta((2,), "int32")], {})
    with pytest.raises(OpError, match=r"idx shape \(3,\) must be \(2,\)"):
        infer("set_rows", [dst, TensorMeta((2, 3), "float32"), TensorMeta((3,), "int32")], {})
    with pytest.raises(OpError, match=r"idx dtype uint32 is not allowed"):
        infer("set_rows", [dst, TensorMeta((2, 3), "float32"), TensorMeta((2,), "uint32")], {})


def bf16_ref(x: float) -> int:
    """Round-to-nearest-even float32 -> bfloat16 bits, one value at a time."""
    bits = int(np.array([x], np.float32).view(np.uint32)[0])
    if math.isnan(x):
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@FAST
@given(hnp.arrays(np.float32, st.integers(0, 50)))
def test_bfloat16_round_to_nearest_even(x: np.ndarray) -> None:
    out = np.empty(x.shape, np.uint16)
    from_float32(x, "bfloat16", out)
    assert out.tolist() == [bf16_ref(float(v)) for v in x]
    back = as_float32(out, "bfloat16")
    finite = np.isfinite(x) & (np.abs(x) < 3e38)
    close(back[finite], x[finite], rtol=2**-8, atol=2.0**-134)  # bf16 subnormals are coarser
    assert np.isnan(back[np.isnan(x)]).all()


def test_bfloat16_ties_and_specials() -> None:
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), np.inf, -np.inf, np.nan, 3.4e38], np.float32)
    out = np.empty(x.shape, np.uint16)
    from_float32(x, "bfloat16", out)
    back = as_float32(out, "bfloat16")
    assert back[:5].tolist() == [1.0, 1.015625, -1.0, np.inf, -np.inf]
    assert np.isnan(back[5]) and back[6] == np.inf


def test_numpy_dtype_names() -> None:
    assert numpy_dtype("bfloat16") == np.uint16 and numpy_dtype("bool") == np.bool_
    with pytest.raises(ValueError, match="unknown dtype name 'float8'"):
        numpy_dtype("float8")


# -------------------------------------------------------------------------------------- quantized


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_dequantize_op_and_mul_mat_q(qtype: str) -> None:
    rng = np.random.default_rng(5)
    wq = quant.quantize(rng.standard_normal((70, 96)).astype(np.float32), qtype)
    w = quant.dequantize(wq, qtype)
    np.testing.assert_array_equal(run("dequantize", [wq], {"qtype": qtype}), w)
    x = rng.standard_normal((2, 3, 96)).astype(np.float16)
    close(run("mul_mat_q", [x, wq], {"qtype": qtype}, ["float16", None]),
          x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)


def test_mul_mat_q_uses_several_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numpy_ops, "_MMQ_BLOCK_BYTES", 3 * 4 * 64)
    rng = np.random.default_rng(6)
    wq = quant.quantize(rng.standard_normal((10, 64)).astype(np.float32), "q8_0")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    close(run("mul_mat_q", [x, wq], {"qtype": "q8_0"}), x.astype(np.float64) @ quant.dequantize(wq, "q8_0").T,
          rtol=1e-5, atol=1e-5)


def test_mul_mat_q_rules() -> None:
    x = TensorMeta((2, 64), "float32")
    with pytest.raises(OpError, match=r"x last dim 64 != wq input width 32 \(wq shape \(5, 34\)\)"):
        infer("mul_mat_q", [x, TensorMeta((5, 34), "uint8")], {"qtype": "q8_0"})
    with pytest.raises(OpError, match=r"wq last dim 40 is not a multiple of the q8_0 block size"):
        infer("mul_mat_q", [x, TensorMeta((5, 40), "uint8")], {"qtype": "q8_0"})
    with pytest.raises(OpError, match=r"dequantize: input 0 dtype int8 is not allowed"):
        infer("dequantize", [TensorMeta((5, 34), "int8")], {"qtype": "q8_0"})


# -------------------------------------------------------------------------------------------- views


@FAST
@given(data=tensors((2, 3, 4)), order=st.permutations(range(3)))
def test_permute_and_transpose_share_memory(data: tuple[np.ndarray, str], order: list[int]) -> None:
    x, dtype = data
    out = run("permute", [x], {"axes": order}, [dtype])
    np.testing.assert_array_equal(out, np.transpose(x, order))
    assert _DEVICE["name"] == "cuda" or np.shares_memory(out, x)   # cuda: a copy came back
    t = run("transpose", [x], {}, [dtype])
    np.testing.assert_array_equal(t, np.swapaxes(x, -1, -2))


@pytest.mark.parametrize("shape,axes,contiguous", [
    ((2, 3, 4), [0, 1, 2], True), ((2, 3, 4), [0, 2, 1], False), ((1, 3, 4), [1, 0, 2], True),
    ((2, 1, 4), [0, 2, 1], True), ((2, 3, 0), [2, 1, 0], True),
])
def test_permute_contiguity(shape: tuple[int, ...], axes: list[int], contiguous: bool) -> None:
    out, params = infer("permute", [TensorMeta(shape, "float32")], {"axes": axes})
    assert out.contiguous is contiguous
    assert out.contiguous == np.transpose(np.empty(shape), axes).flags.c_contiguous
    assert params == {"axes": tuple(axes)}


@FAST
@given(shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4), data=st.data())
def test_reshape(shape: tuple[int, ...], data: st.DataObject) -> None:
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    new = [int(n) for n in np.random.default_rng(data.draw(st.integers(0, 99))).permutation(list(shape))]
    if new and x.size and data.draw(st.booleans()):
        new[data.draw(st.integers(0, len(new) - 1))] = -1
    out = run("reshape", [x], {"shape": new})
    np.testing.assert_array_equal(out, x.reshape(new))
    assert _DEVICE["name"] == "cuda" or np.shares_memory(out, x) or x.size == 0


def test_reshape_rules() -> None:
    x = TensorMeta((2, 6), "float32")
    assert infer("reshape", [x], {"shape": [3, -1]}) == (TensorMeta((3, 4), "float32"), {"shape": (3, 4)})
    for shape, message in [([-1, -1], "more than one -1"), ([5, -1], r"cannot infer the -1 in \(5, -1\)"),
                           ([5, 2], r"shape \(5, 2\) does not hold the 12 elements"),
                           ([0, -1], "cannot infer the -1"), ([True, 12], "must be an int, got True"),
                           ([-2, 6], r"must be in \[-1, ")]:
        with pytest.raises(OpError, match=message):
            infer("reshape", [x], {"shape": shape})
    with pytest.raises(OpError, match=r"reshape: input 0 must be contiguous \(insert a cont op first\)"):
        infer("reshape", [TensorMeta((2, 6), "float32", contiguous=False)], {"shape": [12]})


@pytest.mark.parametrize("shape,strides,offset", [
    ((2, 3), (12, 4), 0), ((3, 2), (4, 12), 0), ((2,), (4,), 40), ((6,), (-4,), 20),
    ((2, 2), (-24, 4), 24), ((4, 3), (0, 4), 12), ((0, 5), (4, 4), 48), ((), (), 44),
])
def test_view_inside_bounds(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> None:
    x = np.arange(12, dtype=np.float32)
    out = run("view", [x], {"shape": list(shape), "strides": list(strides), "offset": offset})
    expected = np.lib.stride_tricks.as_strided(x[offset // 4:], shape, strides) if out.size else out
    np.testing.assert_array_equal(out, expected)
    assert _DEVICE["name"] == "cuda" or out.size == 0 or np.shares_memory(out, x)


@pytest.mark.parametrize("shape,strides,offset,message", [
    ((2, 3), (12, 4), 4, r"view reaches bytes \[4, 28\) outside the 24-byte input"),
    ((3,), (-4,), 4, r"view reaches bytes \[-4, 8\)"),
    ((2,), (2**47, 4), 0, "differ in length"),
    ((2,), (2**47,), 0, r"view reaches bytes \[0, 140737488355332\)"),
    ((2,), (6,), 0, "must be multiples of the item size 4"),
    ((2,), (4,), 2, "must be multiples of the item size 4"),
    ((0,), (4,), 28, r"view reaches bytes \[28, 28\) outside"),
    ((2,), (2**49,), 0, r"param 'strides' must be in \[-281474976710656, 281474976710656\]"),
    ((2**39, 2**39), (0, 0), 0, r"output shape .* has 2\*\*40 or more elements"),
])
def test_view_rejects_escapes(shape: tuple[int, ...], strides: tuple[int, ...], offset: int, message: str) -> None:
    x = TensorMeta((6,), "float32")
    with pytest.raises(OpError, match=message):
        infer("view", [x], {"shape": list(shape), "strides": list(strides), "offset": offset})


def test_view_rechecks_the_real_buffer_at_run_time() -> None:
    x = np.arange(4, dtype=np.float32)
    params = {"shape": (4,), "strides": (4,), "offset": 4}  # as if infer had been fooled by a wrong meta
    with pytest.raises(OpRuntimeError, match="escape the 16-byte input"):
        run_view("view", x, meta_of(x), params)


def test_view_contiguity() -> None:
    x = TensorMeta((4, 6), "float32")
    out, _ = infer("view", [x], {"shape": [2, 6], "strides": [24, 4], "offset": 24})
    assert out.contiguous
    out, _ = infer("view", [x], {"shape": [4, 3], "strides": [24, 4]})
    assert not out.contiguous


# --------------------------------------------------------------------------------- generic rules


@pytest.mark.parametrize("op,metas,params,message", [
    ("nope", [], {}, "unknown op 'nope'"),
    ("add", [TensorMeta((2,), "float32")], {}, r"add: takes 2\.\.2 inputs, got 1"),
    ("neg", [TensorMeta((2,), "float32")], {"s": 1.0}, r"neg: unknown param 's' \(takes no params\)"),
    ("scale", [TensorMeta((2,), "float32")], {"t": 1.0}, r"unknown param 't' \(takes \['b', 's'\]\)"),
    ("scale", [TensorMeta((2,), "float32")], {"s": "2"}, "param 's' must be a float, got '2'"),
    ("scale", [TensorMeta((2,), "float32")], {"s": True}, "param 's' must be a float, got True"),
    ("scale", [TensorMeta((2,), "float32")], {"s": math.inf}, "param 's' must be a finite float, got inf"),
    ("scale", [TensorMeta((2,), "float32")], {"s": 10**400}, "param 's' must be a finite float"),
    ("diag_mask_inf", [TensorMeta((2, 2), "float32")], {"n_past": 2**41}, r"must be in \[0, 1099511627776\]"),
    ("diag_mask_inf", [TensorMeta((2, 2), "float32")], {"n_past": 1.0}, "param 'n_past' must be an int, got 1.0"),
    ("neg", [TensorMeta((1,) * 9, "float32")], {}, "input 0 shape must be a tuple of at most 8 dims"),
    ("neg", [TensorMeta((2**40,), "float32")], {}, r"dims must be ints in \[0, 2\*\*40\)"),
    ("neg", [TensorMeta((-1,), "float32")], {}, r"dims must be ints in \[0, 2\*\*40\)"),
    ("neg", [TensorMeta((2**20, 2**20), "float32")], {}, r"has 2\*\*40 or more elements"),
    ("neg", [TensorMeta([2], "float32")], {}, "shape must be a tuple"),  # type: ignore[arg-type]
    ("neg", [TensorMeta((2,), "complex64")], {}, "input 0 has unknown dtype 'complex64'"),
    ("neg", [(2,)], {}, "input 0 must be a TensorMeta, got tuple"),
    ("add", [TensorMeta((2**20, 1), "float32"), TensorMeta((2**20,), "float32")], {}, "output shape"),
    ("permute", [TensorMeta((2, 3), "float32")], {"axes": [0, 0]}, r"axes \(0, 0\) is not a permutation"),
    ("permute", [TensorMeta((2, 3), "float32")], {"axes": list(range(100))}, "at most 8 ints"),
    ("neg", [TensorMeta((2,), "float32")], [("s", 1)], "params must be a mapping, got list"),
])
def test_rule_violations_raise_op_error(op: str, metas: list[Any], params: Any, message: str) -> None:
    with pytest.raises(OpError, match=message):
        infer(op, metas, params)


PARAM_VALUES = st.one_of(
    st.integers(-3, 10), st.integers(), st.floats(), st.booleans(), st.none(),
    st.sampled_from(["none", "q8_0", "q4_1", "tanh", "erf", "normal", "neox", ""]),
    st.lists(st.integers(-3, 10), max_size=9), st.lists(st.integers(), max_size=3), st.text(max_size=3),
)
HOSTILE_DIMS = st.one_of(st.integers(0, 6), st.sampled_from([2**40 - 1, 2**40, 2**63, -1]))
ALL_PARAM_NAMES = sorted({name for spec in OPS.values() for name in spec.params} | {"bogus"})


@st.composite
def nodes(draw: st.DrawFn) -> tuple[str, list[TensorMeta], dict[str, Any]]:
    op = draw(st.sampled_from(sorted(OPS)))
    metas = draw(st.lists(st.builds(
        TensorMeta, st.lists(HOSTILE_DIMS, max_size=9).map(tuple),
        st.sampled_from([*NUMERIC, "uint16", "float8"]), st.booleans()), max_size=4))
    names = draw(st.lists(st.sampled_from(sorted(OPS[op].params) * 3 + ALL_PARAM_NAMES), max_size=5))
    return op, metas, {name: draw(PARAM_VALUES) for name in names}


@settings(max_examples=400, deadline=None, database=None)
@given(node=nodes())
def test_infer_fuzz_only_raises_op_error_and_normalizes_idempotently(
        node: tuple[str, list[TensorMeta], dict[str, Any]]) -> None:
    op, metas, params = node
    try:
        out, norm = infer(op, metas, params)
    except OpError:
        return
    assert out.numel < 2**40 and len(out.shape) <= 8
    assert infer(op, metas, norm) == (out, norm)


# ------------------------------------------------------------------------------ allocation budget

N_BIG = 1 << 20  # 4 MiB of float32


def _peak_extra(fn: Callable[[], None]) -> int:
    fn()  # warm
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("op,params", [
    ("add", {}), ("mul", {}), ("exp", {}), ("silu", {}), ("sigmoid", {}), ("gelu", {}),
    ("gelu", {"approximate": "erf"}), ("scale", {"s": 2.0}), ("rms_norm", {"eps": 1e-6}),
    ("layer_norm", {"eps": 1e-6}), ("soft_max", {}), ("diag_mask_inf", {"n_past": 0}), ("cont", {}),
    ("swiglu", {}),
])
def test_warm_compute_allocates_little_beyond_out(op: str, params: dict[str, Any]) -> None:
    x = np.random.default_rng(7).standard_normal((4, 256, N_BIG // 1024)).astype(np.float32)
    inputs = [x, x] if op in ("add", "mul") else [x]
    metas = [meta_of(a) for a in inputs]
    out_meta, norm = infer(op, metas, params)
    out = np.empty(out_meta.shape, np.float32)
    peak = _peak_extra(lambda: run_compute(op, inputs, metas, norm, out))
    assert peak < out.nbytes // 4, f"{op} allocated {peak} bytes"


# ------------------------------------------------------------------- the shared table's device helpers


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_byte_level_dequantizer_is_bit_exact_with_quant(qtype: str) -> None:
    """The dequantizer for namespaces without structured dtypes gives quant's bytes, NaN and inf
    scales included (random bytes make some)."""
    rng = np.random.default_rng(3)
    per_block, block_bytes = quant.BLOCK[qtype]
    data = rng.integers(0, 256, (17, 6 * block_bytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
        expected = quant.dequantize(data, qtype)
        got = numpy_ops.dequantize_bytes(data, qtype, np.empty((17, 6 * per_block), np.float32))
    assert got.tobytes() == expected.tobytes()


def test_last_writes_keeps_the_last_of_repeated_indices() -> None:
    rng = np.random.default_rng(4)
    for _ in range(20):
        idx = rng.integers(0, 6, rng.integers(1, 12))
        src = rng.normal(size=(idx.size, 3)).astype(np.float32)
        expected = np.zeros((6, 3), np.float32)
        expected[idx] = src                        # numpy: the last write wins
        kept_idx, kept_rows = numpy_ops.last_writes(idx, src)
        assert len(set(kept_idx.tolist())) == kept_idx.size
        got = np.zeros((6, 3), np.float32)
        got[kept_idx] = kept_rows
        np.testing.assert_array_equal(got, expected)


def test_namespace_of_arrays() -> None:
    assert numpy_ops.namespace(np.zeros(2)) is np
    assert numpy_ops.namespace(fake_device.to_device(np.zeros(2))) is fake_device
    with pytest.raises(TypeError, match="no array namespace for list"):
        numpy_ops.namespace([1.0])


def test_overrides_must_name_ops_of_their_kind() -> None:
    table = numpy_ops.NUMPY_KERNELS
    with pytest.raises(OpError, match="'reshape' is not an op of kind compute"):
        table.overridden("x", compute={"reshape": table.compute["add"]})
    changed = table.overridden("x", compute={"neg": table.compute["abs"]})
    assert changed.compute["neg"] is table.compute["abs"] and table.compute["neg"] is not changed.compute["neg"]
    assert not changed.host_errors and table.host_errors


def test_reshape_on_a_device_refuses_a_copy() -> None:
    x = fake_device.to_device(np.arange(12, dtype=np.float32).reshape(3, 4).T)
    with pytest.raises(OpRuntimeError, match="would copy"):
        numpy_ops.NUMPY_KERNELS.run_view("reshape", x, meta_of(np.asarray(x)), {"shape": (12,)})
