"""The cupy backend's overrides of the shared kernel table (:mod:`.numpy_ops`).

Owned by the backend thread of a ``--device cuda`` worker; imported only by
:class:`~.cupy_backend.CupyBackend` (cupy is an optional extra). Every other op runs the shared
kernels, written once over the array namespace, on cupy arrays: ufuncs with ``out=``, reductions,
``cupy.matmul`` (cuBLAS), ``cupy.take``. What is replaced here, and why:

- ``rope``: one CUDA kernel rotating each feature pair in place (the shared kernel allocates two
  half-size temporaries and runs six ufuncs). Products and sums use ``__fmul_rn``/``__fsub_rn``/
  ``__fadd_rn`` so nvcc cannot contract them into FMAs: the same float32 roundings as numpy.
- ``dequantize`` and ``mul_mat_q``: one CUDA kernel per Q8_0/Q4_1 block row (cupy has no
  structured dtypes, and the byte-level shared version, :func:`.numpy_ops.dequantize_bytes`, is
  six kernels); the product is then ``cupy.matmul`` on float32 (cuBLAS). Quantized weights on a
  GPU are dequantized once at load (the client's ``weights="f32"`` mode): the per-call
  dequantization of ``mul_mat_q`` is for graphs that ask for it.
- ``pack`` and ``unpack``: the numba repacking runs on the host (a device-to-host copy, the CPU
  kernel, a copy back): load-time layout steps, once per weight.
- ``mul_mat_packed`` and ``get_rows_packed``: the packed products are CPU (numba) kernels; on a
  GPU worker they fail with a clear error (and the worker does not advertise ``packed-kernels``).

Views (``reshape`` without ``copy=False``) and ``set_rows`` (repeated indices: the last write
wins) are handled in the shared kernels by namespace checks, since both are a few lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from ...broker.ops import TensorMeta
from ..formats import quant
from . import numpy_ops as K

Params = K.Params

_ROPE_OP: Final = """
long long k = i % n_half;
long long row = i / n_half;
long long t = (row / heads) % tokens;
long long a = row * dim + (neox ? k : 2 * k);
long long b = a + (neox ? n_half : 1);
float c = cos_t[t * n_half + k], s = sin_t[t * n_half + k];
float x0 = y[a], x1 = y[b];
y[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
y[b] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
"""
"""``i`` runs over the rotated pairs of every row (..., t, head); ``n_half``, not ``half``: cupy's
kernels include cuda_fp16.h, where ``half`` is a type."""

_DEQUANT_OP: Final = {
    "q8_0": """
long long blk = i / 32, j = i % 32;
y = __fmul_rn((float)(signed char)q[blk * 34 + 2 + j], d[blk]);
""",
    "q4_1": """
long long blk = i / 32, j = i % 32;
unsigned char byte = q[blk * 20 + 4 + (j % 16)];
float nib = (float)(j < 16 ? (byte & 0x0F) : (byte >> 4));
y = __fadd_rn(__fmul_rn(nib, d[blk]), m[blk]);
""",
}


class CupyKernels:
    """The compiled CUDA kernels (cupy compiles each at its first call, cached on disk)."""

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy
        self.rope = cupy.ElementwiseKernel(
            "raw float32 cos_t, raw float32 sin_t, int64 tokens, int64 heads, int64 dim, "
            "int64 n_half, bool neox", "raw float32 y", _ROPE_OP, "zmq_rpc_rope")
        self.dequant = {
            "q8_0": cupy.ElementwiseKernel("raw uint8 q, raw float32 d", "float32 y",
                                           _DEQUANT_OP["q8_0"], "zmq_rpc_dequant_q8_0"),
            "q4_1": cupy.ElementwiseKernel("raw uint8 q, raw float32 d, raw float32 m",
                                           "float32 y", _DEQUANT_OP["q4_1"],
                                           "zmq_rpc_dequant_q4_1"),
        }

    # ------------------------------------------------------------------------- kernels

    def dequantize_into(self, data: Any, qtype: str, out: Any) -> Any:
        """Q8_0/Q4_1 rows into C-contiguous float32 ``out`` with one kernel (after the block
        scales are read as float16 and widened, two small cupy ops)."""
        cp = self.cp
        _, block_bytes = quant.BLOCK[qtype]
        blocks = cp.ascontiguousarray(data).reshape(-1, block_bytes)
        d = cp.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32).reshape(-1)
        flat = blocks.reshape(-1)              # raw arrays are indexed by a linear index
        if qtype == "q8_0":
            self.dequant[qtype](flat, d, out)
        else:
            m = cp.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
            self.dequant[qtype](flat, d, m.reshape(-1), out)
        return out

    def rope_kernel(self, xs: Sequence[Any], ms: Sequence[TensorMeta], p: Params, out: Any) -> None:
        """The shared rope's angles (float64, then float32 cos/sin tables of (T, n_dims/2)),
        then one kernel over every rotated pair of ``out``."""
        cp = self.cp
        K.convert(out, "float32", xs[0], ms[0].dtype)
        n_dims = int(p["n_dims"])
        half = n_dims // 2
        if half == 0:
            return
        inv_freq = p["freq_scale"] * p["freq_base"] ** (-2.0 * cp.arange(half) / n_dims)
        if len(xs) > 2:                     # freq factors (protocol 1.11)
            inv_freq = inv_freq / K.as_float32(xs[2], ms[2].dtype).astype(np.float64)
        theta = xs[1].astype(np.float64)[:, None] * inv_freq
        cos_t = cp.ascontiguousarray(cp.cos(theta).astype(np.float32)).reshape(-1)
        sin_t = cp.ascontiguousarray(cp.sin(theta).astype(np.float32)).reshape(-1)
        tokens, heads, dim = out.shape[-3], out.shape[-2], out.shape[-1]
        pairs = out.size // dim * half
        self.rope(cos_t, sin_t, tokens, heads, dim, half, p["mode"] == "neox", out, size=pairs)

    def dequantize_kernel(self, xs: Sequence[Any], ms: Sequence[TensorMeta], p: Params,
                          out: Any) -> None:
        self.dequantize_into(xs[0], p["qtype"], out)

    def mul_mat_q_kernel(self, xs: Sequence[Any], ms: Sequence[TensorMeta], p: Params,
                         out: Any) -> None:
        """x @ dequantize(W).T: W dequantized in blocks of 64 MiB of float32, cuBLAS products."""
        cp = self.cp
        x = K.as_float32(xs[0], ms[0].dtype).reshape(-1, ms[0].shape[-1])
        wq, qtype = xs[1], p["qtype"]
        n_out, n_in = wq.shape[0], x.shape[1]
        out2 = out.reshape(-1, n_out)
        rows = max(1, (64 << 20) // max(1, 4 * n_in))
        buf = cp.empty((min(rows, n_out), n_in), np.float32)
        for start in range(0, n_out, rows):
            w = self.dequantize_into(wq[start:start + rows], qtype,
                                     buf[:min(rows, n_out - start)])
            cp.matmul(x, w.T, out=out2[:, start:start + rows])

    def on_host(self, kernel: K.Kernel) -> K.Kernel:
        """``kernel`` run on host copies of the inputs, its output copied back (load-time
        layout ops only: the round trip is a copy of each weight once)."""
        cp = self.cp

        def run(xs: Sequence[Any], ms: Sequence[TensorMeta], p: Params, out: Any) -> None:
            host_out = np.empty(out.shape, out.dtype)
            kernel([cp.asnumpy(x) for x in xs], ms, p, host_out)
            out[...] = cp.asarray(host_out)

        return run


def _cpu_only(op: str) -> K.Kernel:
    def refuse(xs: Sequence[Any], ms: Sequence[TensorMeta], p: Params, out: Any) -> None:
        raise K.OpRuntimeError(
            f"{op} runs the packed CPU (numba) kernels and is not offered on a cuda worker: "
            "load quantized weights dequantized on a GPU worker (weights='f32')")

    return refuse


def cupy_table(cupy: Any) -> K.KernelTable:
    """The cupy backend's kernel table: the shared kernels with this module's overrides."""
    ck = CupyKernels(cupy)
    compute = K.NUMPY_KERNELS.compute
    return K.NUMPY_KERNELS.overridden("cupy", compute={
        "rope": ck.rope_kernel,
        "dequantize": ck.dequantize_kernel,
        "mul_mat_q": ck.mul_mat_q_kernel,
        "pack": ck.on_host(compute["pack"]),
        "unpack": ck.on_host(compute["unpack"]),
        "mul_mat_packed": _cpu_only("mul_mat_packed"),
        "get_rows_packed": _cpu_only("get_rows_packed"),
    })
