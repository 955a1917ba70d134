"""numba kernels of the small per-token graph ops: attention, rope, swiglu (float32, CPU).

Owns the compiled loops (numpy's error model: a division by zero gives inf or NaN, as in numpy);
only the worker's backend thread calls them (through
:mod:`~zmq_rpc.worker.backends.numpy_ops`, which falls back to its numpy composition where numba
is missing or the arrays are not the float32 ones these loops take). Importing this module needs
numba; compiled code is cached on disk (``cache=True``), like :mod:`.jit`'s.

Why they exist: a decode token of a small llama runs a few hundred of these ops on vectors of a
few hundred floats, where numpy's ~10 calls per op (temporaries, broadcasting, a BLAS call on
a strided cache) cost far more than the arithmetic (docs/DESIGN.md, "Quantized kernels").

- :func:`attention`: ``softmax(scale * q k^T + mask) v`` per query row and head, heads grouped
  over the KV heads (GQA: query head ``h`` reads KV head ``h // (H / H_kv)``). Keys whose mask
  entry is ``-inf`` are not read at all, so a decode step costs the filled part of the cache, not
  its whole length; a row with every key masked comes out as zeros (as ``soft_max`` gives).
  fastmath (reassociation, contraction) in the dot products and sums, like the matvec kernels.
- :func:`rope`: the rotation of :func:`~zmq_rpc.worker.backends.numpy_ops` ``_rope`` with the same
  float64 angles and the same float32 operations in the same order (strict float semantics).
- :func:`swiglu`: ``silu(x[:, :n]) * x[:, n:]`` per row (strict float semantics, numpy's order).
- :func:`rms_norm`: ``x / sqrt(mean(x^2) + eps)`` per row: the sum of squares reassociated (as
  numpy's pairwise sum is, in another order), the rest in numpy's operations.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

__all__ = ["attention", "rms_norm", "rope", "swiglu"]

FASTMATH = {"nsz", "arcp", "contract", "reassoc"}
_F32 = np.float32
_NEG_INF = -np.inf


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def _scores(q: Any, k: Any, kh: int, mask: Any, scale: float, s: Any) -> float:
    """``s[j] = scale * q . k[j, kh] + mask[j]`` (``-inf`` unread where masked); the peak."""
    peak = _NEG_INF
    for j in range(k.shape[0]):
        mj = mask[j]
        if mj == _NEG_INF:
            s[j] = _NEG_INF
            continue
        acc = _F32(0.0)
        for d in range(q.shape[0]):
            acc += q[d] * k[j, kh, d]
        value = _F32(acc * scale + mj)
        s[j] = value
        if value > peak or math.isnan(value):     # a NaN score makes the row NaN, as in numpy
            peak = value
    return peak


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def _weighted(s: Any, peak: float, v: Any, kh: int, out: Any) -> None:
    """``out = sum_j exp(s[j] - peak) v[j, kh] / sum_j exp(s[j] - peak)`` over unmasked j."""
    out[:] = 0.0
    total = _F32(0.0)
    for j in range(v.shape[0]):
        if s[j] == _NEG_INF:
            continue
        p = _F32(math.exp(s[j] - peak))
        total += p
        for d in range(out.shape[0]):
            out[d] += p * v[j, kh, d]
    if total != 0.0:
        inv = _F32(1.0) / total
        for d in range(out.shape[0]):
            out[d] *= inv


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def attention(q: Any, k: Any, v: Any, mask: Any, scale: float, out: Any) -> None:
    """``out[t, h] = softmax(scale * q[t, h] . k[:, kh] + mask[t]) @ v[:, kh]`` for q (T, H, D),
    k and v (S, H_kv, D), mask (T, S) (a (1, S) mask serves every row), out (T, H, D); all
    float32, any strides."""
    group = q.shape[1] // k.shape[1]
    s = np.empty(k.shape[0], np.float32)
    for t in range(q.shape[0]):
        row = mask[t if mask.shape[0] > 1 else 0]
        for h in range(q.shape[1]):
            kh = h // group
            peak = _scores(q[t, h], k, kh, row, scale, s)
            if peak == _NEG_INF:
                out[t, h, :] = 0.0
                continue
            _weighted(s, peak, v, kh, out[t, h])


@njit(cache=True, nogil=True, error_model="numpy")
def rope(x: Any, pos: Any, inv_freq: Any, neox: bool, n_dims: int, out: Any) -> None:
    """x (T, H, D) float32 rotated at positions pos (T,) into out (T, H, D): the features
    ``(2i, 2i+1)`` (or ``(i, i + n_dims/2)`` for neox) by ``pos * inv_freq[i]``; the rest copied."""
    half = n_dims // 2
    for t in range(x.shape[0]):
        p = np.float64(pos[t])
        for i in range(half):
            theta = p * inv_freq[i]
            c, sn = _F32(math.cos(theta)), _F32(math.sin(theta))
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(x.shape[1]):
                x0, x1 = x[t, h, a], x[t, h, b]
                out[t, h, a] = x0 * c - x1 * sn
                out[t, h, b] = x1 * c + x0 * sn
        for h in range(x.shape[1]):
            for d in range(n_dims, x.shape[2]):
                out[t, h, d] = x[t, h, d]


@njit(cache=True, nogil=True, error_model="numpy")
def swiglu(x: Any, out: Any) -> None:
    """out (T, n) = silu(x[:, :n]) * x[:, n:] for x (T, 2n), float32 (silu(g) = g / (1 + e^-g))."""
    n = out.shape[1]
    for t in range(x.shape[0]):
        for i in range(n):
            g = x[t, i]
            sig = _F32(1.0) / (_F32(1.0) + _F32(math.exp(-g)))
            out[t, i] = sig * g * x[t, n + i]


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def _sum_of_squares(x: Any) -> Any:
    acc = _F32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * x[i]
    return acc


@njit(cache=True, nogil=True, error_model="numpy")
def rms_norm(x: Any, eps: float, out: Any) -> None:
    """out (T, n) = x / sqrt(sum(x^2) / n + eps) per row of x (T, n), float32."""
    inv_n = _F32(1.0) / _F32(x.shape[1])
    for t in range(x.shape[0]):
        rms = _F32(math.sqrt(_F32(_F32(_sum_of_squares(x[t]) * inv_n) + eps)))
        for i in range(x.shape[1]):
            out[t, i] = x[t, i] / rms
