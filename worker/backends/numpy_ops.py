"""The kernel table of every op in :mod:`zmq_rpc.broker.ops`, written once over an array namespace.

Owns the arithmetic. Only the backend thread calls it. Callers validate each node with
:func:`zmq_rpc.broker.ops.infer` first and pass the *normalized* params it returns; inputs are arrays
of one backend (numpy on the CPU, cupy on a GPU) in storage dtype (bfloat16 as raw uint16 bits),
possibly strided views. Each kernel takes its namespace ``xp`` from its output array
(:func:`namespace`: numpy for a numpy array, without importing cupy) and calls ``xp.<ufunc>(...,
out=)``, ``xp.matmul``, ``xp.take``..., which both libraries have with the same meaning. What differs
per backend lives behind :class:`KernelTable` overrides (``cupy_ops.OVERRIDES``: CUDA kernels for
rope and the Q8_0/Q4_1 dequantizer, cupy's own reshape-without-copy and last-write-wins
``set_rows``); the numpy backend uses this table as it is, with no indirection.

- :func:`run_compute` writes into ``out`` (C-contiguous, the output's storage dtype), through ufunc
  ``out=`` and in-place updates, so a warm rerun allocates little beyond small per-row temporaries
  (exceptions are noted at each kernel: rope, argmax and dtype conversions of bfloat16 inputs).
- :func:`run_view` returns a view that shares memory with its input.
- :func:`run_inplace` writes into the destination input.

Floating-point exceptions are silent, as in ggml: overflow gives inf, 0/0 gives NaN. Data-dependent
checks (index values, a view escaping its runtime buffer) raise :class:`OpRuntimeError` before any memory
is touched.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ...broker.ops import OPS, OpError, OpKind, TensorMeta, view_span
from .. import kernels
from ..formats import quant

__all__ = [
    "NUMPY_KERNELS",
    "KernelTable",
    "OpRuntimeError",
    "as_float32",
    "convert",
    "erf",
    "from_float32",
    "namespace",
    "numpy_dtype",
    "run_compute",
    "run_inplace",
    "run_view",
]

F32 = npt.NDArray[np.float32]
Params = Mapping[str, Any]
Kernel = Callable[[Sequence[np.ndarray], Sequence[TensorMeta], Params, np.ndarray], None]


class OpRuntimeError(Exception):
    """Raised at run time by data-dependent checks (index values out of range)."""


_STORAGE: Final[Mapping[str, np.dtype[Any]]] = {
    name: np.dtype("uint16" if name == "bfloat16" else name)
    for name in ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "uint16",
                 "int32", "uint32", "int64", "uint64", "bool")
}


# ------------------------------------------------------------------------------------ namespaces


def namespace(arr: Any) -> ModuleType:
    """The array namespace of ``arr``: numpy for a numpy array, else the module that defines its
    type (cupy for a cupy array; already imported, since the array exists)."""
    if type(arr) is np.ndarray:
        return np
    xp = sys.modules.get(type(arr).__module__.partition(".")[0])
    if xp is None or not hasattr(xp, "ndarray"):
        raise TypeError(f"no array namespace for {type(arr).__name__}")
    return xp


# ------------------------------------------------------------------------------------ dtype helpers


def numpy_dtype(name: str) -> np.dtype[Any]:
    """Storage dtype of a dtype name (bfloat16 is stored as uint16 bits). Raises ValueError if unknown."""
    try:
        return _STORAGE[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def as_float32(arr: np.ndarray, dtype_name: str, out: np.ndarray | None = None) -> F32:
    """Values of ``arr`` (storage dtype of ``dtype_name``) as float32.

    Without ``out`` this returns ``arr`` itself when it is already float32 (do not write to the result).
    With ``out`` (float32, ``arr`` broadcastable to it) the values are written there and ``out`` is returned.
    """
    if dtype_name != "bfloat16":
        if out is None:                       # the common case: no namespace needed
            return arr if arr.dtype == np.float32 else arr.astype(np.float32)
        namespace(arr).copyto(out, arr, casting="unsafe")
        return out
    xp = namespace(arr)
    if out is None:
        out = xp.empty(arr.shape, np.float32)
    xp.left_shift(arr, 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def from_float32(arr32: np.ndarray, dtype_name: str, out: np.ndarray) -> None:
    """Write float32 values into ``out`` (storage dtype of ``dtype_name``).

    bfloat16 rounds to nearest even and keeps NaNs quiet NaNs; integer targets truncate like a C cast
    (NaN and out-of-range values give unspecified integers).
    """
    xp = namespace(out)
    if dtype_name != "bfloat16":
        xp.copyto(out, arr32, casting="unsafe")
        return
    bits = xp.ascontiguousarray(arr32, dtype=np.float32).view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    nan = xp.isnan(arr32)
    xp.copyto(rounded, (bits >> 16) | 0x40, where=nan)
    xp.copyto(out, rounded, casting="unsafe")


def convert(dst: np.ndarray, dst_dtype: str, src: np.ndarray, src_dtype: str) -> None:
    """Copy ``src`` into ``dst`` (broadcasting), converting between dtype names."""
    xp = namespace(dst)
    if src_dtype == dst_dtype:
        xp.copyto(dst, src)
    elif dst_dtype == "bfloat16":
        from_float32(xp.broadcast_to(as_float32(src, src_dtype), dst.shape), dst_dtype, dst)
    elif src_dtype == "bfloat16" and dst.dtype == np.float32:
        as_float32(src, src_dtype, out=dst)
    else:
        xp.copyto(dst, as_float32(src, src_dtype) if src_dtype == "bfloat16" else src, casting="unsafe")


def _load(out: np.ndarray, x: np.ndarray, meta: TensorMeta) -> F32:
    """Write ``x`` as float32 into ``out`` (the usual first step of an in-place kernel)."""
    convert(out, "float32", x, meta.dtype)
    return out


def _ufunc_src(x: np.ndarray, meta: TensorMeta) -> np.ndarray:
    """``x`` in a form a ufunc with ``dtype=float32`` reads correctly (only bfloat16 needs converting)."""
    return as_float32(x, meta.dtype) if meta.dtype == "bfloat16" else x


# -------------------------------------------------------------------------------------------- erf

_ERF_CHUNK: Final = 16384
# Numerical Recipes' Chebyshev fit of erfc (|erf error| < 1.2e-7; 8.3e-8 measured on [-6, 6]).
_ERFC_COEFFS: Final = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
                       0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erf64(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """erf of a float64 chunk, with three chunk-sized temporaries."""
    a = np.abs(z)
    t = a * 0.5
    t += 1.0
    np.reciprocal(t, out=t)
    poly = np.full_like(t, _ERFC_COEFFS[-1])
    for coeff in _ERFC_COEFFS[-2::-1]:
        poly *= t
        poly += coeff
    a *= a
    poly -= a
    np.exp(poly, out=poly)
    poly *= t  # erfc(|z|)
    np.subtract(1.0, poly, out=poly)
    return np.copysign(poly, z, out=poly)


def erf(x: np.ndarray, out: np.ndarray | None = None) -> F32:
    """Vectorized error function, float32 result, absolute error < 1.2e-7.

    Works in float64 chunks of 16K elements, so temporaries stay small (~0.5 MiB); ``out``
    (C-contiguous float32) may be ``x`` itself. On a GPU: cupyx's erf ufunc, in float32.
    """
    if type(x) is not np.ndarray and namespace(x).__name__ == "cupy":
        from cupyx.scipy import special  # a cupy array exists, so cupy (and cupyx) imports
        result_xp: F32 = special.erf(x, out=out) if out is not None else special.erf(x)
        return result_xp
    result = np.empty(x.shape, np.float32) if out is None else out
    src, dst = x.reshape(-1), result.reshape(-1)
    for start in range(0, src.size, _ERF_CHUNK):
        dst[start:start + _ERF_CHUNK] = _erf64(src[start:start + _ERF_CHUNK].astype(np.float64))
    return result


# ------------------------------------------------------------------------------ elementwise kernels

_F32: Final = np.float32
_SQRT_2_OVER_PI: Final = math.sqrt(2.0 / math.pi)


def _simple(name: str) -> Kernel:
    """``xp.<name>(x)`` (numpy's ufunc looked up once, another namespace's per call)."""
    numpy_fn = getattr(np, name)

    def kernel(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
        fn = numpy_fn if type(out) is np.ndarray else getattr(namespace(out), name)
        fn(_ufunc_src(xs[0], ms[0]), out=out, dtype=_F32)

    return kernel


def _binary(name: str) -> Kernel:
    numpy_fn = getattr(np, name)

    def kernel(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
        fn = numpy_fn if type(out) is np.ndarray else getattr(namespace(out), name)
        fn(_ufunc_src(xs[0], ms[0]), _ufunc_src(xs[1], ms[1]), out=out, dtype=_F32)

    return kernel


def _scale(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """x * s + b (``b`` since protocol 1.3, capability ``scale-bias``; like ggml_scale_bias)."""
    namespace(out).multiply(_ufunc_src(xs[0], ms[0]), _F32(p["s"]), out=out, dtype=_F32)
    if p.get("b", 0.0) != 0.0:
        out += _F32(p["b"])


def _relu(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    namespace(out).maximum(_ufunc_src(xs[0], ms[0]), _F32(0), out=out, dtype=_F32)


def _sigmoid_into(x: np.ndarray, out: np.ndarray) -> None:
    """out = 1 / (1 + exp(-x)); saturates to 0 and 1 without NaN."""
    xp = namespace(out)
    xp.negative(x, out=out, dtype=_F32)
    xp.exp(out, out=out)
    out += 1
    xp.reciprocal(out, out=out)


def _sigmoid(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    _sigmoid_into(_ufunc_src(xs[0], ms[0]), out)


def _silu(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    x = _ufunc_src(xs[0], ms[0])
    _sigmoid_into(x, out)
    namespace(out).multiply(out, x, out=out, dtype=_F32)


def _gelu(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (ggml's); erf: 0.5 x (1 + erf(x / sqrt 2))."""
    x, xp = _ufunc_src(xs[0], ms[0]), namespace(out)
    if p["approximate"] == "erf":
        xp.multiply(x, _F32(1 / math.sqrt(2.0)), out=out, dtype=_F32)
        erf(out, out=out)
    else:
        xp.square(x, out=out, dtype=_F32)
        out *= _F32(0.044715)
        out += 1
        xp.multiply(out, x, out=out, dtype=_F32)
        out *= _F32(_SQRT_2_OVER_PI)
        xp.tanh(out, out=out)
    out += 1
    xp.multiply(out, x, out=out, dtype=_F32)
    out *= _F32(0.5)


# ----------------------------------------------------------------------------- matmul and friends


def _matmul(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """BLAS (cuBLAS on a GPU) handles a transposed (Fortran-ordered) 2-D operand itself, so
    transpose_b copies nothing."""
    a, b, xp = as_float32(xs[0], ms[0].dtype), as_float32(xs[1], ms[1].dtype), namespace(out)
    xp.matmul(a, xp.swapaxes(b, -1, -2) if p["transpose_b"] else b, out=out)


_MMQ_BLOCK_BYTES: Final = 1 << 20  # float32 bytes of W dequantized per step


def _mul_mat_q(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """out = x @ dequantize(wq).T, dequantizing W about 1 MiB of rows at a time into one reusable buffer.

    Blocking buys memory (1 MiB of scratch instead of the whole float32 W), not speed: it runs a
    little slower than dequantize-then-matmul (docs/DESIGN.md, "Quantized products on numpy").
    """
    x, xp = as_float32(xs[0], ms[0].dtype).reshape(-1, ms[0].shape[-1]), namespace(out)
    wq, qtype = xs[1], p["qtype"]
    n_out, n_in = wq.shape[0], x.shape[1]
    out2 = out.reshape(-1, n_out)
    block, dequant = ((_MMQ_BLOCK_BYTES, quant.dequantize) if xp is np
                      else (_MMQ_DEVICE_BLOCK_BYTES, dequantize_bytes))
    rows = max(1, block // max(1, 4 * n_in))
    buf = xp.empty((min(rows, n_out), n_in), np.float32)
    for start in range(0, n_out, rows):
        w = dequant(wq[start:start + rows], qtype, out=buf[:min(rows, n_out - start)])
        xp.matmul(x, w.T, out=out2[:, start:start + rows])


_MMQ_DEVICE_BLOCK_BYTES: Final = 64 << 20
"""float32 bytes of W dequantized per step on a GPU (big enough to keep cuBLAS busy)."""


def _dequantize(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    if type(out) is np.ndarray:
        quant.dequantize(xs[0], p["qtype"], out=out)
    else:
        dequantize_bytes(xs[0], p["qtype"], out=out)


def dequantize_bytes(data: Any, qtype: str, out: Any) -> Any:
    """Q8_0/Q4_1 blocks (uint8, rows of whole blocks) into C-contiguous float32 ``out``, on plain
    byte arrays: what a namespace without structured dtypes (cupy) runs. Bit for bit what
    :func:`quant.dequantize` gives (the same float32 products and sums, in the same order)."""
    xp = namespace(out)
    per_block, block_bytes = quant.BLOCK[qtype]
    blocks = xp.ascontiguousarray(data).reshape(-1, block_bytes)
    dst = out.reshape(-1, per_block)
    d = xp.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32)
    if qtype == "q8_0":
        xp.copyto(dst, blocks[:, 2:].view(np.int8), casting="unsafe")
        dst *= d
        return out
    m = xp.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    half = per_block // 2
    xp.copyto(dst[:, :half], qs & 0x0F, casting="unsafe")
    xp.copyto(dst[:, half:], qs >> 4, casting="unsafe")
    dst *= d
    dst += m
    return out


def _pack(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Repack a GGUF weight into the kernels' layout (compiled with numba when it imports, else numpy),
    then make sure the products' kernels for its type are compiled: a model's load pays the compile
    (once per machine: numba caches it on disk; seconds per type), never its first token."""
    kernels.pack(xs[0], p["qtype"], out=out)
    if kernels.available():
        kernels.warm(p["qtype"])


def _mul_mat_packed(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """out = x @ W.T for a packed W, with the numba kernels (``worker/kernels``)."""
    x = as_float32(xs[0], ms[0].dtype).reshape(-1, ms[0].shape[-1])
    try:
        kernels.matmul(x, xs[1], p["qtype"], out.reshape(x.shape[0], -1))
    except kernels.KernelUnavailable as exc:
        raise OpRuntimeError(str(exc)) from None


def _unpack(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """A packed weight dequantized into float32 rows (f32 mode's layout step for any packed type)."""
    with _kernels():
        kernels.dequantize(xs[0], p["qtype"], out.shape[1], out=out)


def _get_rows_packed(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Rows of a packed table (a model's embedding, for the token its last stage picked)."""
    table, idx = xs
    _check_index(idx, table.shape[0], "get_rows_packed")
    with _kernels():
        kernels.take_rows(table, p["qtype"], idx.reshape(-1), out.reshape(-1, out.shape[-1]))


@contextlib.contextmanager
def _kernels() -> Iterator[None]:
    """A missing numba becomes a run-time error naming the fix."""
    try:
        yield
    except kernels.KernelUnavailable as exc:
        raise OpRuntimeError(str(exc)) from None


def _check_index(idx: np.ndarray, n: int, what: str) -> None:
    """Reject index values outside [0, n) before they are used (no negative wraparound)."""
    if idx.size <= 1:               # a decode step's one position: no reductions
        if idx.size:
            lo = hi = int(idx.reshape(-1)[0])
        else:
            return
    else:
        lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        raise OpRuntimeError(f"{what}: index {lo if lo < 0 else hi} is out of range [0, {n})")


def _get_rows(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Only the selected rows are read (and dequantized, for a quantized table)."""
    table, idx = xs
    _check_index(idx, table.shape[0], "get_rows")
    if type(out) is not np.ndarray:
        _get_rows_device(table, idx, ms, p, out)
    elif p["qtype"] != "none":
        rows = np.take(table, idx.reshape(-1), axis=0, mode="clip")
        quant.dequantize(rows, p["qtype"], out=out.reshape(-1, out.shape[-1]))
    elif ms[0].dtype == "float32":
        np.take(table, idx, axis=0, out=out, mode="clip")
    else:
        _load(out, np.take(table, idx, axis=0, mode="clip"), ms[0])


def _get_rows_device(table: Any, idx: Any, ms: Sequence[TensorMeta], p: Params, out: Any) -> None:
    """get_rows on a device namespace (indices checked already: its take has no ``mode``)."""
    xp = namespace(out)
    if p["qtype"] != "none":
        rows = xp.take(table, idx.reshape(-1), axis=0)
        dequantize_bytes(rows, p["qtype"], out.reshape(-1, out.shape[-1]))
    elif ms[0].dtype == "float32":
        xp.take(table, idx, axis=0, out=out)
    else:
        _load(out, xp.take(table, idx, axis=0), ms[0])


# ----------------------------------------------------------------------------------- normalization


def _root_mean_square(x: F32, eps: float) -> F32:
    """sqrt(mean(x^2) + eps) over the last axis, shape (..., 1): one small array per call."""
    xp = namespace(x)
    rms: F32 = (np.vecdot(x, x) if xp is np else xp.einsum("...i,...i->...", x, x))[..., None]
    rms *= _F32(1.0 / x.shape[-1])
    rms += _F32(eps)
    xp.sqrt(rms, out=rms)
    return rms


def _rms_norm(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """x / sqrt(mean(x^2) + eps) over the last axis (ggml: no weight); numba on the host for
    contiguous float32 rows (``kernels.fused.rms_norm``)."""
    x, fused = xs[0], kernels.fused_kernels()
    if (fused is not None and type(out) is np.ndarray and ms[0].dtype == "float32"
            and ms[0].contiguous and out.ndim):
        width = out.shape[-1]
        if _compiled(fused.rms_norm, x.reshape(-1, width), _F32(p["eps"]), out.reshape(-1, width)):
            return
    _load(out, x, ms[0])
    out /= _root_mean_square(out, p["eps"])


def _layer_norm(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """(x - mean) / sqrt(var + eps) over the last axis, then * weight + bias when given."""
    _load(out, xs[0], ms[0])
    out -= out.mean(axis=-1, keepdims=True)
    out /= _root_mean_square(out, p["eps"])
    xp = namespace(out)
    for fn, x, meta in zip((xp.multiply, xp.add), xs[1:], ms[1:], strict=False):
        fn(out, _ufunc_src(x, meta), out=out, dtype=_F32)


def _soft_max(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """softmax(x * scale + mask) over the last axis. A row that is all -inf comes out as zeros, not NaN."""
    _load(out, xs[0], ms[0])
    if p["scale"] != 1.0:
        out *= _F32(p["scale"])
    xp = namespace(out)
    if len(xs) > 1:
        xp.add(out, _ufunc_src(xs[1], ms[1]), out=out, dtype=_F32)
    _soft_max_rows(out)


def _soft_max_rows(out: np.ndarray) -> None:
    """``out = softmax(out)`` over the last axis, in place; an all ``-inf`` row gives zeros."""
    peak = out.max(axis=-1, keepdims=True)
    peak[peak == -np.inf] = 0
    out -= peak
    namespace(out).exp(out, out=out)
    total = out.sum(axis=-1, keepdims=True)
    total[total == 0] = 1
    out /= total


def _rope(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Rotate feature pairs of each head by theta_i = pos * freq_scale * freq_base ** (-2i / n_dims).

    x is (..., T, H, D); "normal" pairs (2i, 2i+1), "neox" pairs (i, i + n_dims/2); features past n_dims
    pass through; a third input (n_dims/2,) divides the frequencies (ggml's freq factors). Angles are
    computed in float64 (ggml accumulates them in float32, so it differs by a few ulps of the angle).
    Allocates two temporaries of half the rotated part.
    """
    n_dims = int(p["n_dims"])
    if _fused_rope(xs, ms, p, out, n_dims):
        return
    _load(out, xs[0], ms[0])
    xp = namespace(out)
    half = n_dims // 2
    inv_freq = p["freq_scale"] * p["freq_base"] ** (-2.0 * xp.arange(half) / n_dims)
    if len(xs) > 2:
        inv_freq = inv_freq / as_float32(xs[2], ms[2].dtype).astype(np.float64)
    theta = xs[1].astype(np.float64)[:, None] * inv_freq  # (T, half)
    cos, sin = xp.cos(theta).astype(_F32)[:, None, :], xp.sin(theta).astype(_F32)[:, None, :]
    if p["mode"] == "neox":
        x0, x1 = out[..., :half], out[..., half:n_dims]
    else:
        x0, x1 = out[..., 0:n_dims:2], out[..., 1:n_dims:2]
    x0_sin, x1_sin = x0 * sin, x1 * sin
    x0 *= cos
    x0 -= x1_sin
    x1 *= cos
    x1 += x0_sin


_INV_FREQ: dict[tuple[int, float, float], np.ndarray] = {}
"""The rotation frequencies of the rope parameters seen (a few per model; 64 at most)."""


def _fused_rope(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray,
                n_dims: int) -> bool:
    """The numba rope (``kernels.fused``: same angles, same float32 operations) for float32 x
    (T, H, D) on the host; False where it does not apply (numba missing, another dtype, rank or
    namespace), and the numpy composition runs."""
    fused = kernels.fused_kernels()
    if fused is None or type(out) is not np.ndarray or ms[0].dtype != "float32" or out.ndim != 3:
        return False
    x, pos = np.ascontiguousarray(xs[0]), np.ascontiguousarray(xs[1])
    key = (n_dims, p["freq_base"], p["freq_scale"])
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:
        inv_freq = p["freq_scale"] * p["freq_base"] ** (-2.0 * np.arange(n_dims // 2) / n_dims)
        if len(_INV_FREQ) < 64:
            _INV_FREQ[key] = inv_freq
    if len(xs) > 2:    # the factors are a tensor, read at every run (not cached)
        inv_freq = inv_freq / as_float32(xs[2], ms[2].dtype).astype(np.float64)
    return _compiled(fused.rope, x, pos, inv_freq, p["mode"] == "neox", n_dims, out)


def _compiled(kernel: Callable[..., None], *args: Any) -> bool:
    """Run a numba kernel of ``kernels.fused`` on ``args``; False (nothing written) when its
    warmed signature does not take them (a read-only array, say): they never compile at run
    time, and the caller runs its numpy composition instead."""
    try:
        kernel(*args)
    except TypeError:
        return False
    return True


def _attention(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """``softmax(scale * q k^T + mask) v`` per query row and head, GQA-grouped (``ops._attention``):
    q (T, H, D), k and v (S, H_kv, D), optional mask broadcasting to (T, S), out (T, H, D).

    One query row (a decode step), on the host with numba, float32 queries and mask, and a
    float32 or float16 cache: one fused loop (``kernels.fused.attention``) that skips masked
    keys (a float16 cache read as its bits: no float32 copy of the whole cache per step).
    Otherwise (a prefill chunk: BLAS does its products faster than the loop) the composition
    the unfused graph runs (per KV head: a batched matmul, the masked softmax of
    :func:`_soft_max_rows`, a matmul), over any namespace, on the keys some row's mask leaves
    live: a chunk early in a long cache reads (and converts, for a float16 cache) its first
    rows only."""
    q, k, v = xs[:3]
    T, S = q.shape[0], k.shape[0]
    if T > 1:
        _attention_composed(_live_keys(xs), ms, p, out)
        return
    fused = kernels.fused_kernels()
    k16 = ms[1].dtype == "float16" and ms[2].dtype == "float16"
    if (fused is not None and type(out) is np.ndarray
            and all(m.dtype == "float32" for i, m in enumerate(ms) if not (k16 and i in (1, 2)))):
        mask = (np.zeros((1, S), np.float32) if len(xs) < 4
                else xs[3] if xs[3].ndim == 2 and xs[3].shape[1] == S
                else np.broadcast_to(xs[3], (T, S)))
        kk, vv = (k.view(np.uint16), v.view(np.uint16)) if k16 else (k, v)
        q, kk, vv, mask = (np.ascontiguousarray(a) for a in (q, kk, vv, mask))
        if _compiled(fused.attention, q, kk, vv, mask, _F32(p["scale"]), out):
            return
    _attention_composed(xs, ms, p, out)


def _live_keys(xs: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
    """``xs`` (q, k, v, mask) cut to the keys between the first and the last that some query
    row's mask does not hide (-inf); all of them without a mask. A key every row hides adds
    nothing to any row (exp(-inf) is 0), so the cut changes no result."""
    if len(xs) < 4:
        return xs
    q, k, v, mask = xs
    xp = namespace(mask)
    live = xp.flatnonzero(xp.isfinite(mask.reshape(-1, mask.shape[-1])).any(axis=0))
    if len(live) == 0 or mask.shape[-1] != k.shape[0]:
        return xs
    lo, hi = int(live[0]), int(live[-1]) + 1
    return q, k[lo:hi], v[lo:hi], mask[..., lo:hi]


def _attention_composed(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params,
                        out: np.ndarray) -> None:
    """Per KV head, per block of its query heads and rows (scores of at most
    :data:`_ATTENTION_BLOCK` floats, or one row of one head): matmul, masked softmax, matmul."""
    xp = namespace(out)
    q, k, v = (as_float32(x, m.dtype) for x, m in zip(xs[:3], ms[:3], strict=True))
    T, S = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = _ufunc_src(xs[3], ms[3]) if len(xs) > 3 else None
    if mask is not None:
        mask = xp.broadcast_to(mask, (T, S))
    heads = max(1, min(group, _ATTENTION_BLOCK // max(1, S)))
    rows = max(1, min(T, _ATTENTION_BLOCK // max(1, S * heads)))
    blocks = ((kh, h0, min(h0 + heads, (kh + 1) * group), t0)
              for kh in range(k.shape[1]) for h0 in range(kh * group, (kh + 1) * group, heads)
              for t0 in range(0, T, rows))
    for kh, h0, h1, t0 in blocks:
        qs = xp.swapaxes(q[t0:t0 + rows, h0:h1], 0, 1)               # (heads, rows, D)
        scores = xp.matmul(qs, xp.swapaxes(k[:, kh], 0, 1))            # (heads, rows, S)
        scores *= _F32(p["scale"])
        if mask is not None:
            scores += mask[t0:t0 + rows]
        _soft_max_rows(scores)
        out[t0:t0 + rows, h0:h1] = xp.swapaxes(xp.matmul(scores, v[:, kh]), 0, 1)


def _attend_rows(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Per query row, attention over that row's own cache rows (``ops._attend_rows``): q (B, H,
    D), k and v (R, H_kv, D) float32 or float16, pos and base (B,) int32; row b reads the cache
    rows ``base[b] + j`` for ``j`` from ``max(0, pos[b] - window + 1)`` (0 without a window) to
    ``pos[b]``, the causal (and sliding-window) mask built here from pos, so no mask crosses
    the wire; ``pos[b] < 0`` is a padding row: zeros, nothing read.

    Batch-invariant, bit for bit: every row is computed from its own inputs alone, by the same
    arithmetic whatever else is in the batch. On the host with numba: one loop
    (``kernels.fused.attend_rows``) that reads float16 caches as their bits. Otherwise
    (a GPU, or no numba), one call per row of :func:`_attention_composed` on that row's slice
    of the cache: the arithmetic of the ``attention`` op with a mask that admits exactly those
    rows."""
    q, k, v, pos, base = xs
    pos_h, base_h = _host_ints(pos), _host_ints(base)
    _check_rows(pos_h, base_h, k.shape[0])
    fused = kernels.fused_kernels()
    if fused is not None and type(out) is np.ndarray:
        k16 = ms[1].dtype == "float16"
        kk, vv = ((k.view(np.uint16), v.view(np.uint16)) if k16 else (k, v))
        q, kk, vv = (np.ascontiguousarray(a) for a in (q, kk, vv))
        if _compiled(fused.attend_rows, q, kk, vv, np.ascontiguousarray(pos_h), np.ascontiguousarray(base_h),
                     _F32(p["scale"]), int(p["window"]), out):
            return
    _attend_rows_composed(xs, ms, p, out, pos_h, base_h)


def _host_ints(arr: Any) -> npt.NDArray[Any]:
    """A small index vector on the host (a device array is downloaded: B int32s)."""
    if type(arr) is np.ndarray:
        return arr
    download = getattr(namespace(arr), "asnumpy", None)    # cupy's; a host stand-in has none
    return np.asarray(arr if download is None else download(arr))


def _check_rows(pos: np.ndarray, base: np.ndarray, rows: int) -> None:
    """Every row that reads (pos >= 0) stays inside the cache: 0 <= base and base + pos < rows.

    On Python ints: B is a step's rows (tens), and this runs once per layer per step, where
    numpy's masks and reductions over a few elements cost ~20 us (~0.5 ms of a 30-layer step)."""
    for b, (p, first) in enumerate(zip(pos.tolist(), base.tolist(), strict=True)):
        if p >= 0 and (first < 0 or first + p >= rows):
            raise OpRuntimeError(f"attend_rows: row {b} reads cache rows from base {first} to "
                                 f"base + pos = {first + p}, outside [0, {rows})")


def _attend_rows_composed(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray,
                          pos: np.ndarray, base: np.ndarray) -> None:
    """One :func:`_attention_composed` per row, on that row's query and cache rows alone."""
    q, k, v = xs[:3]
    window = int(p["window"])
    for b in range(q.shape[0]):
        if pos[b] < 0:
            out[b] = 0
            continue
        first = max(0, int(pos[b]) - window + 1) if window else 0
        lo, hi = int(base[b]) + first, int(base[b]) + int(pos[b]) + 1
        _attention_composed([q[b:b + 1], k[lo:hi], v[lo:hi]], ms[:3], p, out[b:b + 1])


def _sample_rows(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """One token per row of logits (B, V), drawn from that row's inputs alone (batch-invariant):

    1. ``temperature <= 0`` (or NaN) or ``top_k == 1``: the argmax of the logits (the first maximum; a NaN
       counts as the maximum, as ``argmax`` does). So is a row whose ``s`` below has a peak that is
       not finite.
    2. Else ``s = float32(logits / temperature)``, ``e = exp(float64(s) - max s)`` (float64).
       Order the tokens by descending ``s``, ties by ascending index. Keep the first
       ``K = top_k`` (if ``0 < top_k < V``, else all ``V``). If ``top_p < 1``: with ``T`` the sum of
       the kept ``e`` in index order, keep only the first ``n`` of that order, ``n`` the smallest
       count whose running sum (in that order) is ``>= top_p * T`` (``K`` if none is).
    3. ``u = (splitmix64(seed << 32 | (counter mod 2**32)) >> 11) * 2**-53``, in [0, 1), with
       splitmix64(x): ``z = x + 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
       z = (z ^ z >> 27) * 0x94D049BB133111EB; z ^ z >> 31`` (mod 2**64). seed is uint32, counter
       int32 (the sequence's step).
    4. The token is the first kept index, in index order, whose running sum of ``e`` (float64, in
       index order) exceeds ``u`` times the kept total (the last kept index if rounding leaves
       none).

    Every sum above is sequential, in the order stated, so the numba loop
    (``kernels.fused.sample_rows``) and this composition (any namespace) give the same token;
    a device whose ``exp`` rounds differently can differ only where ``u`` lands within float64
    rounding of a boundary."""
    fused = kernels.fused_kernels()
    if fused is not None and type(out) is np.ndarray:
        args = [np.ascontiguousarray(x) for x in xs]
        if _compiled(fused.sample_rows, *args, out):
            return
    _sample_rows_composed(xs, out)


def _splitmix_uniform(seed: Any, counter: Any) -> Any:
    """Step 3 of :func:`_sample_rows` over vectors (uint64 arithmetic wraps, as it should)."""
    xp = namespace(seed)
    z = (seed.astype(np.uint64) << np.uint64(32)) | counter.astype(np.uint32).astype(np.uint64)
    z += np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) * xp.float64(2.0**-53)


def _sample_rows_composed(xs: Sequence[Any], out: Any) -> None:
    """:func:`_sample_rows` with whole-array operations (a GPU, or no numba)."""
    logits, temperature, top_k, top_p, seed, counter = xs
    xp = namespace(out)
    n = logits.shape[1]
    greedy = xp.argmax(logits, axis=-1)
    s = logits / xp.where(temperature > 0, temperature, _F32(1))[:, None]
    peak = xp.max(s, axis=-1)
    e = xp.exp(s.astype(np.float64) - xp.where(xp.isfinite(peak), peak, 0).astype(np.float64)[:, None])
    order = xp.argsort(-s, axis=-1, kind="stable")
    rank = xp.empty_like(order)
    rank[xp.arange(order.shape[0])[:, None], order] = xp.arange(n)[None, :]
    count = xp.where((top_k > 0) & (top_k < n), top_k, n).astype(np.int64)[:, None]
    in_k = rank < count
    total = xp.cumsum(xp.where(in_k, e, 0.0), axis=-1)[:, -1:]
    running = xp.cumsum(xp.take_along_axis(e, order, axis=-1), axis=-1)
    short = xp.sum((running < top_p.astype(np.float64)[:, None] * total)
                   & (xp.arange(n)[None, :] < count), axis=-1)[:, None]
    keep = xp.where(top_p[:, None] < 1, xp.minimum(short + 1, count), count)
    kept = rank < keep
    cdf = xp.cumsum(xp.where(kept, e, 0.0), axis=-1)
    target = _splitmix_uniform(seed, counter)[:, None] * cdf[:, -1:]
    passed = kept & (cdf > target)
    last = n - 1 - xp.argmax(kept[:, ::-1], axis=-1)
    drawn = xp.where(passed.any(axis=-1), xp.argmax(passed, axis=-1), last)
    use_greedy = ~(temperature > 0) | (top_k == 1) | ~xp.isfinite(peak)
    xp.copyto(out, xp.where(use_greedy, greedy, drawn), casting="unsafe")


_ATTENTION_BLOCK: Final = 1 << 20
"""float32 scores the composed attention holds at once (4 MiB), unless one row of one head
needs more (that many keys are in memory, or charged as temporaries, already)."""


def _swiglu(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """``silu(x[..., :n]) * x[..., n:]`` for x (..., 2n) (ggml's swiglu: the fused gate-up
    product of a llama FFN, gate first). numba on the host for float32, else silu then mul."""
    n = out.shape[-1]
    x = xs[0]
    fused = kernels.fused_kernels()
    if (fused is not None and type(out) is np.ndarray and ms[0].dtype == "float32"
            and _compiled(fused.swiglu, x.reshape(-1, 2 * n), out.reshape(-1, n))):
        return
    x = _ufunc_src(x, ms[0])
    gate = x[..., :n]
    _sigmoid_into(gate, out)
    xp = namespace(out)
    xp.multiply(out, gate, out=out, dtype=_F32)
    xp.multiply(out, x[..., n:], out=out, dtype=_F32)


def _causal_mask(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """out (T, n_ctx): row t 0 for the keys ``j <= pos[t]`` (and ``pos[t] - j < window`` with a
    window), -inf elsewhere and throughout for a position outside ``[0, n_ctx)``
    (``ops._causal_mask``). On the device of ``out``: nothing is downloaded."""
    xp = namespace(out)
    n_ctx, window = out.shape[1], int(p["window"])
    pos = xs[0].astype(xp.int64)[:, None]
    keys = xp.arange(n_ctx, dtype=xp.int64)[None, :]
    seen = (keys <= pos) & (pos < n_ctx)
    if window:
        seen &= pos - keys < window
    out[...] = _F32(-np.inf)
    xp.copyto(out, _F32(0.0), where=seen)


def _diag_mask_inf(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """x[..., i, j] = -inf where j > n_past + i."""
    _load(out, xs[0], ms[0])
    xp = namespace(out)
    rows, cols = out.shape[-2:]
    mask = xp.arange(cols)[None, :] > xp.arange(rows)[:, None] + int(p["n_past"])
    xp.copyto(out, _F32(-np.inf), where=mask)


# ------------------------------------------------------------------------------ copies, reductions


def _cont(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    namespace(out).copyto(out, xs[0])


def _concat(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Keeps the dtype when all inputs share it, else float32."""
    axis = int(p["axis"])
    dtypes = {m.dtype for m in ms}
    out_dtype = ms[0].dtype if len(dtypes) == 1 else "float32"
    start = 0
    for x, meta in zip(xs, ms, strict=True):
        part = out[(slice(None),) * axis + (slice(start, start + x.shape[axis]),)]
        convert(part, out_dtype, x, meta.dtype)
        start += x.shape[axis]


def _sum(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    namespace(out).sum(_ufunc_src(xs[0], ms[0]), axis=tuple(p["axis"]), keepdims=p["keepdims"], dtype=_F32,
                       out=out)


def _mean(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """Sum / count; an empty reduction gives NaN, like numpy (without its warning)."""
    _sum(xs, ms, p, out)
    namespace(out).divide(out, _F32(math.prod(xs[0].shape[a] for a in p["axis"])), out=out)


def _argmax(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta], p: Params, out: np.ndarray) -> None:
    """First maximum (a NaN counts as the maximum, like numpy). Allocates an intp array of out's size."""
    x, xp = as_float32(xs[0], ms[0].dtype) if ms[0].dtype == "bfloat16" else xs[0], namespace(out)
    xp.copyto(out, xp.argmax(x, axis=-1), casting="unsafe")


# ------------------------------------------------------------------------------------ dispatch

_COMPUTE_KERNELS: Final[Mapping[str, Kernel]] = {
    **{name: _simple(fn) for name, fn in (
        ("neg", "negative"), ("abs", "absolute"), ("sqr", "square"), ("sqrt", "sqrt"),
        ("exp", "exp"), ("log", "log"), ("tanh", "tanh"))},
    **{name: _binary(fn) for name, fn in (
        ("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("div", "divide"))},
    "scale": _scale, "relu": _relu, "sigmoid": _sigmoid, "silu": _silu, "gelu": _gelu,
    "matmul": _matmul, "mul_mat_q": _mul_mat_q, "pack": _pack, "mul_mat_packed": _mul_mat_packed,
    "unpack": _unpack, "get_rows_packed": _get_rows_packed, "dequantize": _dequantize, "get_rows": _get_rows,
    "rms_norm": _rms_norm, "layer_norm": _layer_norm, "soft_max": _soft_max, "rope": _rope,
    "diag_mask_inf": _diag_mask_inf, "attention": _attention, "attend_rows": _attend_rows,
    "sample_rows": _sample_rows, "causal_mask": _causal_mask, "swiglu": _swiglu, "cont": _cont, "concat": _concat,
    "sum": _sum, "mean": _mean, "argmax": _argmax,
}


def _kind_check(op: str, kind: OpKind) -> None:
    spec = OPS.get(op)
    if spec is None or spec.kind is not kind:
        raise OpError(f"{op!r} is not an op of kind {kind.value}")


def run_compute(op: str, inputs: Sequence[np.ndarray], metas: Sequence[TensorMeta], params: Params,
                out: np.ndarray) -> None:
    """Run a COMPUTE op into ``out`` (C-contiguous, storage dtype of the output meta).

    ``metas`` and ``params`` are the input metas and the normalized params of :func:`ops.infer`.
    Raises OpError for a non-compute op and OpRuntimeError when index values are out of range.
    """
    _kind_check(op, OpKind.COMPUTE)
    if out.size == 0:
        return
    with np.errstate(all="ignore"):
        _COMPUTE_KERNELS[op](inputs, metas, params, out)


NUMBA_OPS: Final = frozenset({"attention", "attend_rows", "rms_norm", "rope", "sample_rows", "swiglu"})
"""Ops whose host kernels are numba loops (:mod:`~zmq_rpc.worker.kernels.fused`) where numba
imports."""


def prepare(ops: Iterable[str]) -> float:
    """Compile (or load from numba's disk cache) the numba kernels that ``ops`` run on host
    arrays, so that a registered graph's first run does not (a decode token would pay tens of
    milliseconds); seconds it took."""
    if NUMBA_OPS.isdisjoint(ops) or not kernels.available():
        return 0.0
    return kernels.warm_fused()


# --------------------------------------------------------------------------------------- views


def _strided_view(x: np.ndarray, p: Params) -> np.ndarray:
    """A byte-strided view of contiguous ``x``; the span is checked again against the real buffer."""
    shape, strides, offset = tuple(p["shape"]), tuple(p["strides"]), int(p["offset"])
    span = view_span(shape, strides, offset, x.itemsize)
    lo, hi = span if span is not None else (offset, offset)
    if not x.flags.c_contiguous or lo < 0 or hi > x.nbytes:
        raise OpRuntimeError(f"view bytes [{lo}, {hi}) escape the {x.nbytes}-byte input (or it is strided)")
    start = x.reshape(-1)[offset // x.itemsize:]
    view: np.ndarray = namespace(x).lib.stride_tricks.as_strided(start, shape, strides)
    return view


def _reshape(x: np.ndarray, p: Params) -> Any:
    if type(x) is not np.ndarray:
        return _reshape_device(x, tuple(p["shape"]))
    try:
        return np.reshape(x, tuple(p["shape"]), copy=False)
    except ValueError as exc:
        raise OpRuntimeError(f"reshape of a strided array would copy: {exc}") from None


def _reshape_device(x: Any, shape: tuple[int, ...]) -> Any:
    """reshape without a copy where the namespace's reshape has no ``copy=False`` (cupy): a
    result that does not share x's memory was a copy, and is refused like numpy refuses it."""
    result = x.reshape(shape)
    if x.size and not namespace(x).shares_memory(result, x):
        raise OpRuntimeError("reshape of a strided array would copy: the strides do not allow "
                             f"a view of shape {list(shape)}")
    return result


_VIEW_KERNELS: Final[Mapping[str, Callable[[np.ndarray, Params], np.ndarray]]] = {
    "reshape": _reshape,
    "view": _strided_view,
    "permute": lambda x, p: x.transpose(tuple(p["axes"])),
    "transpose": lambda x, p: x.swapaxes(-1, -2),
}


def run_view(op: str, x: np.ndarray, meta: TensorMeta, params: Params) -> np.ndarray:
    """Run a VIEW op on input ``x`` (described by ``meta``); the result shares x's memory."""
    _kind_check(op, OpKind.VIEW)
    return _VIEW_KERNELS[op](x, params)


# ------------------------------------------------------------------------------------- in place


def _cpy(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta]) -> None:
    """dst[...] = src with dtype conversion; equal shapes, or equal sizes (C order) when both contiguous."""
    src, dst = xs
    if src.shape != dst.shape:
        src = src.reshape(dst.shape)
    convert(dst, ms[1].dtype, src, ms[0].dtype)


def _set_rows(xs: Sequence[np.ndarray], ms: Sequence[TensorMeta]) -> None:
    """dst[idx[i]] = src[i] with dtype conversion; with repeated indices the last row wins."""
    dst, src, idx = xs
    _check_index(idx, dst.shape[0], "set_rows")
    if ms[0].dtype != ms[1].dtype:
        converted = namespace(dst).empty(src.shape, dst.dtype)
        convert(converted, ms[0].dtype, src, ms[1].dtype)
        src = converted
    if type(dst) is not np.ndarray:
        idx, src = last_writes(idx, src)
    dst[idx] = src


def last_writes(idx: Any, src: Any) -> tuple[Any, Any]:
    """The indices and rows of ``dst[idx] = src`` with only the last of each repeated index kept:
    numpy's fancy assignment lets the last write win, cupy's leaves repeats undefined."""
    xp = namespace(idx)
    flat = idx.reshape(-1)
    rows = src.reshape((flat.size, *src.shape[idx.ndim:]))
    _, first_in_reversed = xp.unique(flat[::-1], return_index=True)
    keep = flat.size - 1 - first_in_reversed
    return flat[keep], rows[keep]


_INPLACE_KERNELS: Final[Mapping[str, Callable[[Sequence[np.ndarray], Sequence[TensorMeta]], None]]] = {
    "cpy": _cpy,
    "set_rows": _set_rows,
}


def run_inplace(op: str, inputs: Sequence[np.ndarray], metas: Sequence[TensorMeta], params: Params) -> None:
    """Run an INPLACE op: writes into ``inputs[OPS[op].dst_input]``.

    Raises OpRuntimeError when index values are out of range (nothing is written then).
    """
    _kind_check(op, OpKind.INPLACE)
    with np.errstate(all="ignore"):
        _INPLACE_KERNELS[op](inputs, metas)


# ------------------------------------------------------------------------------------ the table

ViewKernel = Callable[[Any, Params], Any]
InplaceKernel = Callable[[Sequence[Any], Sequence[TensorMeta]], None]


@dataclass(frozen=True)
class KernelTable:
    """One backend's kernels: this module's, with the backend's overrides (a backend's
    ``kernels`` attribute; the graph executor calls only these three methods)."""

    name: str
    compute: Mapping[str, Kernel] = field(default_factory=lambda: _COMPUTE_KERNELS)
    views: Mapping[str, ViewKernel] = field(default_factory=lambda: _VIEW_KERNELS)
    inplace: Mapping[str, InplaceKernel] = field(default_factory=lambda: _INPLACE_KERNELS)
    host_errors: bool = True
    """numpy's floating-point warnings are silenced around every kernel (a GPU raises none)."""

    def __post_init__(self) -> None:
        """The numpy table runs the module's functions themselves (no method dispatch, no
        attribute lookup added per kernel call)."""
        if (self.compute is _COMPUTE_KERNELS and self.views is _VIEW_KERNELS
                and self.inplace is _INPLACE_KERNELS and self.host_errors):
            for method, function in (("run_compute", run_compute), ("run_view", run_view),
                                     ("run_inplace", run_inplace)):
                object.__setattr__(self, method, function)

    def overridden(self, name: str, *, compute: Mapping[str, Kernel] | None = None,
                   views: Mapping[str, ViewKernel] | None = None,
                   inplace: Mapping[str, InplaceKernel] | None = None,
                   host_errors: bool = False) -> KernelTable:
        """This table with some kernels replaced (every name must be an op of that kind), for a
        device whose arithmetic raises no floating-point warnings unless ``host_errors``."""
        for table, kind in ((compute, OpKind.COMPUTE), (views, OpKind.VIEW), (inplace, OpKind.INPLACE)):
            for op in table or ():
                _kind_check(op, kind)
        return KernelTable(name, {**self.compute, **(compute or {})}, {**self.views, **(views or {})},
                           {**self.inplace, **(inplace or {})}, host_errors=host_errors)

    def run_compute(self, op: str, inputs: Sequence[Any], metas: Sequence[TensorMeta],
                    params: Params, out: Any) -> None:
        """:func:`run_compute` with this table."""
        _kind_check(op, OpKind.COMPUTE)
        if out.size == 0:
            return
        with np.errstate(all="ignore") if self.host_errors else contextlib.nullcontext():
            self.compute[op](inputs, metas, params, out)

    def run_view(self, op: str, x: Any, meta: TensorMeta, params: Params) -> Any:
        """:func:`run_view` with this table."""
        _kind_check(op, OpKind.VIEW)
        return self.views[op](x, params)

    def run_inplace(self, op: str, inputs: Sequence[Any], metas: Sequence[TensorMeta],
                    params: Params) -> None:
        """:func:`run_inplace` with this table."""
        _kind_check(op, OpKind.INPLACE)
        with np.errstate(all="ignore") if self.host_errors else contextlib.nullcontext():
            self.inplace[op](inputs, metas)


NUMPY_KERNELS: Final = KernelTable("numpy")
"""The numpy backend's table: this module's kernels, unchanged."""
