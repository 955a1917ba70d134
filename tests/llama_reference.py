"""Plain-numpy float32 reference forward pass of a llama GGUF model, for cross-checks.

Written independently of any graph builder, with its own Q8_0/Q4_1 dequantization (from the
ggml block layouts, REFERENCE.md §4), so that it can check both the loader and, later, the
distributed graph. All weights are dequantized to float32 once, in ``ReferenceLlama()``
(about 0.5 GB for SmolLM2-135M). Single-threaded use only; it holds its own KV cache.

Also holds :func:`require_model_path`, which the model tests use to find the GGUF.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from zmq_rpc.client.gguf_model import (
    GGUFTensor,
    LlamaConfig,
    LlamaGGUF,
    default_model_path,
    dequantize_rows,
)

QK = 32  # weights per Q8_0 / Q4_1 block
Q8_0_BLOCK_BYTES = 34  # f16 d, 32 x int8 q
Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles


def require_model_path() -> Path:
    """Path of the test model; skip when it is missing, but fail under CI (``$CI`` set)."""
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install the test model: {exc}")
        pytest.skip(f"test model not installed: {exc}")


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """View a (rows, row_bytes) uint8 array as (rows, blocks, block_bytes)."""
    rows, row_bytes = raw.shape
    if row_bytes % block_bytes:
        raise ValueError(f"row of {row_bytes} bytes is not whole {block_bytes}-byte blocks")
    return raw.reshape(rows, row_bytes // block_bytes, block_bytes)


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian f16 at byte ``start`` of every block, as float32 (rows, blocks, 1)."""
    pair = np.ascontiguousarray(blocks[..., start : start + 2])
    return pair.view("<f2").astype(np.float32)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 rows (uint8, (rows, row_bytes)) -> float32 (rows, row_bytes / 34 * 32): w = d*q."""
    blocks = _blocks(raw, Q8_0_BLOCK_BYTES)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)
    return (_f16_field(blocks, 0) * q).reshape(raw.shape[0], -1)


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 rows -> float32: element j = qs[j] & 0xF, element j+16 = qs[j] >> 4; w = d*q + m."""
    blocks = _blocks(raw, Q4_1_BLOCK_BYTES)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (_f16_field(blocks, 0) * q + _f16_field(blocks, 2)).reshape(raw.shape[0], -1)


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """Any supported GGUF tensor -> float32 array of its logical shape."""
    if tensor.qtype in ("f32", "f16"):
        return np.asarray(tensor.data, dtype=np.float32).reshape(tensor.shape)
    if tensor.qtype == "q8_0":
        return dequantize_q8_0(tensor.data).reshape(tensor.shape)
    if tensor.qtype == "q4_1":
        return dequantize_q4_1(tensor.data).reshape(tensor.shape)
    if tensor.qtype == "bf16":
        return (tensor.data.astype(np.uint32) << 16).view(np.float32).reshape(tensor.shape)
    # every other block type: gguf's own numpy dequantizer, the oracle of the packed kernels' tests
    return dequantize_rows(tensor.data, tensor.qtype).reshape(tensor.shape)


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


def _load_layer(model: LlamaGGUF, i: int) -> _Layer:
    def w(name: str) -> np.ndarray:
        return dequantize(model.tensors[f"blk.{i}.{name}.weight"])

    return _Layer(
        attn_norm=w("attn_norm"),
        wq=w("attn_q"),
        wk=w("attn_k"),
        wv=w("attn_v"),
        wo=w("attn_output"),
        ffn_norm=w("ffn_norm"),
        w_gate=w("ffn_gate"),
        w_up=w("ffn_up"),
        w_down=w("ffn_down"),
    )


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    mean_sq = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x / np.sqrt(mean_sq + eps)).astype(np.float32) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written with tanh so large |x| cannot overflow."""
    return x * (0.5 * (1.0 + np.tanh(0.5 * x)))


def _rope_angles(positions: np.ndarray, base: float, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of pos * base^(-2i/dims), shaped (tokens, 1, dims/2) to broadcast over heads."""
    inv_freq = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[
        :, None, :
    ]


def rope(
    x: np.ndarray, positions: np.ndarray, base: float, dims: int, mode: str = "normal"
) -> np.ndarray:
    """Rotary embedding of ``x`` (tokens, heads, head_dim); only the first ``dims`` features turn.

    ``"normal"`` (ggml mode 0, right for llama GGUFs) rotates interleaved pairs (x[2i], x[2i+1]);
    ``"neox"`` (HF rotate_half) rotates (x[i], x[i + dims/2]). Pair i turns by
    pos * base^(-2i/dims).
    """
    cos, sin = _rope_angles(positions, base, dims)
    if mode == "normal":
        first = np.arange(0, dims, 2)
        second = first + 1
    elif mode == "neox":
        first = np.arange(dims // 2)
        second = first + dims // 2
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int) -> np.ndarray:
    """Causal GQA attention.

    ``q`` is (T, n_heads, hd) at positions start_pos..; ``k``/``v`` are (S, n_kv, hd) for
    positions 0..S-1. Query head h reads KV head h // (n_heads / n_kv). Returns (T, n_heads*hd).
    """
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    k_full, v_full = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k_full) / np.float32(np.sqrt(head_dim))
    q_pos = start_pos + np.arange(n_tokens)[:, None]
    visible = np.arange(k.shape[0])[None, :] <= q_pos
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v_full).reshape(n_tokens, n_heads * head_dim)


class ReferenceLlama:
    """Float32 numpy llama with a KV cache: ``forward`` -> logits, ``generate_greedy`` -> ids."""

    def __init__(self, model: LlamaGGUF) -> None:
        """Dequantize every weight of ``model`` to float32 (once)."""
        self.config: LlamaConfig = model.config
        self.token_embd = dequantize(model.tensors["token_embd.weight"])
        self.output_norm = dequantize(model.tensors["output_norm.weight"])
        head = "token_embd.weight" if self.config.tied_output else "output.weight"
        self.lm_head = (
            self.token_embd if self.config.tied_output else dequantize(model.tensors[head])
        )
        self.layers = [_load_layer(model, i) for i in range(self.config.n_layers)]
        self._k_cache: list[np.ndarray] = []
        self._v_cache: list[np.ndarray] = []
        self.reset()

    @property
    def n_past(self) -> int:
        """Number of positions held in the KV cache."""
        return int(self._k_cache[0].shape[0])

    def reset(self) -> None:
        """Empty the KV cache."""
        shape = (0, self.config.n_kv_heads, self.config.head_dim)
        self._k_cache = [np.zeros(shape, np.float32) for _ in self.layers]
        self._v_cache = [np.zeros(shape, np.float32) for _ in self.layers]

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Run ``tokens`` at positions start_pos.. and return logits (len(tokens), vocab).

        The cache must hold at least ``start_pos`` positions; anything past ``start_pos`` is
        dropped first (so ``forward(ids, 0)`` recomputes from scratch).
        """
        if not tokens or not 0 <= start_pos <= self.n_past:
            raise ValueError(
                f"need tokens and 0 <= start_pos <= {self.n_past}, got start_pos={start_pos}"
            )
        self._truncate(start_pos)
        x = self.token_embd[np.asarray(tokens)]
        positions = np.arange(start_pos, start_pos + len(tokens))
        for i, layer in enumerate(self.layers):
            x = x + self._attention(
                i, layer, rms_norm(x, layer.attn_norm, self.config.norm_eps), positions
            )
            x = x + self._ffn(layer, rms_norm(x, layer.ffn_norm, self.config.norm_eps))
        return rms_norm(x, self.output_norm, self.config.norm_eps) @ self.lm_head.T

    def _truncate(self, n: int) -> None:
        self._k_cache = [k[:n] for k in self._k_cache]
        self._v_cache = [v[:n] for v in self._v_cache]

    def _attention(self, i: int, layer: _Layer, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg, n_tokens = self.config, h.shape[0]
        q = (h @ layer.wq.T).reshape(n_tokens, cfg.n_heads, cfg.head_dim)
        k = (h @ layer.wk.T).reshape(n_tokens, cfg.n_kv_heads, cfg.head_dim)
        v = (h @ layer.wv.T).reshape(n_tokens, cfg.n_kv_heads, cfg.head_dim)
        q = rope(q, positions, cfg.rope_base, cfg.rope_dims, cfg.rope_mode)
        k = rope(k, positions, cfg.rope_base, cfg.rope_dims, cfg.rope_mode)
        self._k_cache[i] = np.concatenate([self._k_cache[i], k])
        self._v_cache[i] = np.concatenate([self._v_cache[i], v])
        out = causal_attention(q, self._k_cache[i], self._v_cache[i], int(positions[0]))
        return out @ layer.wo.T

    @staticmethod
    def _ffn(layer: _Layer, h: np.ndarray) -> np.ndarray:
        return (silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T

    def generate_greedy(
        self, prompt_ids: Sequence[int], n: int, stop_ids: Collection[int] = ()
    ) -> list[int]:
        """Reset, prefill ``prompt_ids``, then decode up to ``n`` argmax tokens with the cache.

        Stops early after emitting a token in ``stop_ids`` (that token is included).
        """
        self.reset()
        logits = self.forward(prompt_ids, 0)
        out: list[int] = []
        while len(out) < n:
            out.append(int(np.argmax(logits[-1])))
            if out[-1] in stop_ids or len(out) == n:
                break
            logits = self.forward([out[-1]], self.n_past)
        return out
