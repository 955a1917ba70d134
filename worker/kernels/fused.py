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
- :func:`attend_rows`: the same softmax-weighted sums for rows of different sequences in one
  call, each row over its own span of cache rows (``base + j`` for ``j`` up to its position, or
  the last ``window`` of them), the causal mask never materialized. Batch-invariant: a row's loops read only its own
  query, position and cache rows, in the same order whatever the other rows are.
- Both read a float16 cache as its uint16 bits, each element converted exactly where it is
  used (``intdot._half``: LLVM's ``fpext``, one ``vcvtph2ps`` per vector with F16C), so a step
  reads the cache's 2 bytes per element and makes no float32 copy of it.
- :func:`sample_rows`: one token per row of logits (greedy, or temperature / top-k / top-p with
  a counter-based draw, :func:`uniform`): the rule is ``numpy_ops._sample_rows``'s docstring.
  Strict float semantics (no fastmath) so its sums run in the stated order.
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
from numba import njit, types
from numba.extending import overload

from .intdot import _half

__all__ = ["attend_rows", "attention", "rms_norm", "rope", "sample_rows", "swiglu", "uniform"]

FASTMATH = {"nsz", "arcp", "contract", "reassoc"}
_F32 = np.float32
_NEG_INF = -np.inf


def _value(x: Any) -> Any:
    """A cache element as float32: itself, or a float16's exact value from its uint16 bits (one
    ``vcvtph2ps`` per vector with F16C); compiled by :func:`_value_overload`."""
    raise NotImplementedError("only called from compiled code")


@overload(_value)
def _value_overload(x: Any) -> Any:
    def from_bits(x: Any) -> Any:
        return _half(x)

    def itself(x: Any) -> Any:
        return x

    return from_bits if x == types.uint16 else itself


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
            acc += q[d] * _value(k[j, kh, d])
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
            out[d] += p * _value(v[j, kh, d])
    if total != 0.0:
        inv = _F32(1.0) / total
        for d in range(out.shape[0]):
            out[d] *= inv


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def attention(q: Any, k: Any, v: Any, mask: Any, scale: float, out: Any) -> None:
    """``out[t, h] = softmax(scale * q[t, h] . k[:, kh] + mask[t]) @ v[:, kh]`` for q (T, H, D),
    k and v (S, H_kv, D), mask (T, S) (a (1, S) mask serves every row), out (T, H, D); float32,
    any strides, but k and v may be float16 as their uint16 bits (as :func:`attend_rows` reads
    them)."""
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


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def _row_scores(q: Any, k: Any, lo: int, hi: int, kh: int, scale: float, s: Any) -> float:
    """``s[j - lo] = scale * q . k[j, kh]`` for cache rows ``j`` in ``[lo, hi)`` (float16 rows
    read as their uint16 bits, converted exactly); the peak."""
    peak = _NEG_INF
    for j in range(lo, hi):
        acc = _F32(0.0)
        for d in range(q.shape[0]):
            acc += q[d] * _value(k[j, kh, d])
        value = _F32(acc * scale)
        s[j - lo] = value
        if value > peak or math.isnan(value):
            peak = value
    return peak


@njit(fastmath=FASTMATH, cache=True, nogil=True, error_model="numpy")
def _row_weighted(s: Any, peak: float, v: Any, lo: int, hi: int, kh: int, out: Any) -> None:
    """``out = sum_j exp(s[j] - peak) v[j, kh] / sum_j exp(s[j] - peak)`` over rows [lo, hi)."""
    out[:] = 0.0
    total = _F32(0.0)
    for j in range(lo, hi):
        p = _F32(math.exp(s[j - lo] - peak))
        total += p
        for d in range(out.shape[0]):
            out[d] += p * _value(v[j, kh, d])
    if total != 0.0:
        inv = _F32(1.0) / total
        for d in range(out.shape[0]):
            out[d] *= inv


@njit(cache=True, nogil=True, error_model="numpy")
def attend_rows(q: Any, k: Any, v: Any, pos: Any, base: Any, scale: float, window: int,
                out: Any) -> None:
    """Row ``b`` of q (B, H, D) attends to the cache rows ``base[b] + j``, ``j`` in
    ``[max(0, pos[b] - window + 1) if window else 0, pos[b]]``, of k and v (R, H_kv, D) (float32,
    or float16 as their uint16 bits); a row with ``pos[b] < 0`` comes out as zeros. Bounds are the caller's (``numpy_ops``).

    Batch-invariant: row ``b``'s result is computed from q[b], pos[b], base[b] and its own
    cache rows alone, by the same loops in the same order whatever the other rows are (nothing
    is shared between rows but the scratch ``s``, rewritten before it is read)."""
    group = q.shape[1] // k.shape[1]
    s = np.empty(k.shape[0], np.float32)
    for b in range(q.shape[0]):
        if pos[b] < 0:
            out[b, :, :] = 0.0
            continue
        first = max(0, pos[b] - window + 1) if window > 0 else 0
        lo, hi = base[b] + first, base[b] + pos[b] + 1
        # The row's cache rows as their own views, read from 0: the same loops in the same
        # order (the same bits) as indexing the whole cache from lo, ~13% faster at 400 rows.
        kb, vb = k[lo:hi], v[lo:hi]
        for h in range(q.shape[1]):
            kh = h // group
            peak = _row_scores(q[b, h], kb, 0, hi - lo, kh, scale, s)
            if peak == _NEG_INF:
                out[b, h, :] = 0.0
                continue
            _row_weighted(s, peak, vb, 0, hi - lo, kh, out[b, h])


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_U64_MASK32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def uniform(seed: int, counter: int) -> float:
    """splitmix64 of ``seed << 32 | (counter mod 2**32)``, its top 53 bits as a float64 in [0, 1)."""
    z = (np.uint64(seed) << np.uint64(32)) | (np.uint64(np.int64(counter)) & _U64_MASK32)
    z += _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z ^= z >> np.uint64(31)
    return float(z >> np.uint64(11)) * 2.0**-53


@njit(cache=True, nogil=True)
def _first_max(x: Any) -> int:
    """numpy's argmax: the first NaN, else the first maximum."""
    best = 0
    for i in range(x.shape[0]):
        if math.isnan(x[i]):
            return i
        if x[i] > x[best]:
            best = i
    return best


@njit(cache=True, nogil=True)
def _top_order(s: Any, e: Any, count: int, top_p: float) -> Any:
    """The indices of the ``count`` highest ``s`` (ties: lower index first), in that order; when
    all are asked for and ``top_p < 1``, only those that can be in the nucleus (``e`` above
    ``(1 - top_p) * total / V / 2``: every nucleus token is above ``(1 - top_p) * total / V``)."""
    n = s.shape[0]
    if count == n and top_p < 1.0:
        total = 0.0
        for i in range(n):
            total += e[i]
        bound = (1.0 - top_p) * total / n * 0.5
        keep = np.empty(n, np.int64)
        m = 0
        for i in range(n):
            if e[i] > bound:
                keep[m] = i
                m += 1
        cand = keep[:m]
    else:
        cand = np.arange(n)
    order = cand[np.argsort(-s[cand], kind="mergesort")]
    return order[:count]


@njit(cache=True, nogil=True)
def _sample_row(logits: Any, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """One row of :func:`sample_rows` (the rule is ``numpy_ops._sample_rows``'s docstring)."""
    n = logits.shape[0]
    if not temperature > 0.0 or top_k == 1:
        return _first_max(logits)
    s = logits / np.float32(temperature)
    peak = s[_first_max(s)]
    if not math.isfinite(peak):
        return _first_max(logits)
    e = np.exp(s.astype(np.float64) - np.float64(peak))
    count = top_k if 0 < top_k < n else n
    kept = np.zeros(n, np.bool_)
    if count == n and not top_p < 1.0:
        kept[:] = True
    else:
        order = _top_order(s, e, count, top_p)
        total = _kept_total(e, order, count < n)
        keep, run = count, 0.0
        if top_p < 1.0:
            for r in range(order.shape[0]):
                run += e[order[r]]
                if run >= top_p * total:
                    keep = r + 1
                    break
        kept[order[:keep]] = True
    return _inverse_cdf(e, kept, u)


@njit(cache=True, nogil=True)
def _kept_total(e: Any, order: Any, only_order: bool) -> float:
    """The sum of ``e`` in index order over the tokens of ``order`` (or over all of them)."""
    mark = np.zeros(e.shape[0], np.bool_)
    if only_order:
        mark[order] = True
    else:
        mark[:] = True
    total = 0.0
    for i in range(e.shape[0]):
        if mark[i]:
            total += e[i]
    return total


@njit(cache=True, nogil=True)
def _inverse_cdf(e: Any, kept: Any, u: float) -> int:
    """The first kept index whose running sum of ``e`` (index order) passes ``u * total``."""
    total, last = 0.0, 0
    for i in range(e.shape[0]):
        if kept[i]:
            total += e[i]
            last = i
    target, run = u * total, 0.0
    for i in range(e.shape[0]):
        if kept[i]:
            run += e[i]
            if run > target:
                return i
    return last


@njit(cache=True, nogil=True)
def sample_rows(logits: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any, counter: Any,
                out: Any) -> None:
    """out[b] = the token row b draws (``numpy_ops._sample_rows`` states the rule); each row
    from its own inputs alone."""
    for b in range(logits.shape[0]):
        u = uniform(seed[b], counter[b])
        out[b] = _sample_row(logits[b], temperature[b], top_k[b], top_p[b], u)
