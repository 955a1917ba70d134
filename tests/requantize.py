"""Test helper: write a llama GGUF re-quantized to other ggml types.

The quantizers (``gguf.quants`` and the simple K-quant ones) are :mod:`zmq_rpc.tools.synthetic_gguf`'s,
shared with the benchmark's synthetic models: not llama.cpp's search for the best scales (any
valid blocks will do: the tests' oracle is gguf's dequantization of what is written), but close
enough to the weights that the model still talks sense, so greedy tokens do not hang on near-ties.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT
from zmq_rpc.tools.synthetic_gguf import finish, quantize, use_more_bits


def layer_types(i: int) -> dict[str, GT]:
    """The mix the requantized SmolLM2 uses: every packed type appears (K-quants where K % 256 == 0,
    i.e. ffn_down's 1536 inputs). Q/K/V share one type in even layers; in odd ones attn_k takes
    another (F16 and BF16 among them), so q | k | v are three products, q and v of one type. Gate/up
    differ in every third layer."""
    qkv = (GT.Q5_0, GT.Q5_1, GT.Q4_0, GT.Q8_0, GT.Q4_1)[i % 5]
    k = (GT.F16, GT.Q5_1, GT.BF16, GT.Q4_0, GT.Q8_0, GT.Q4_1, GT.Q5_0)[i % 7] if i % 2 else qkv
    ffn = (GT.Q5_0, GT.Q4_0, GT.Q5_1, GT.Q8_0)[i % 4]
    up = (GT.Q5_0, GT.Q4_0, GT.Q5_1, GT.Q8_0)[(i + 1) % 4] if i % 3 == 0 else ffn
    return {"attn_q": qkv, "attn_k": k, "attn_v": qkv,
            "attn_output": (GT.F16, GT.BF16, GT.Q5_0, GT.Q4_1, GT.Q8_0)[i % 5],
            "ffn_gate": ffn, "ffn_up": up, "ffn_down": (GT.Q4_K, GT.Q6_K, GT.Q5_K)[i % 3]}


def q4_k_m_types(i: int, n_layers: int) -> dict[str, GT]:
    """A llama.cpp Q4_K_M-like mix on a 576-wide model, where only ffn_down's rows (1536) hold
    256-weight blocks: Q4_K falls back to Q5_0 and Q6_K to Q8_0 tensor by tensor, so attn_q/attn_k
    are Q5_0 beside a Q8_0 attn_v, and ffn_down is Q4_K or (more bits) Q6_K. Unlike llama.cpp,
    ffn_gate and ffn_up also differ (Q5_0 and Q8_0, swapped in odd layers) so that every layer mixes
    types inside both Q/K/V and gate/up, in either order."""
    gate, up = (GT.Q5_0, GT.Q8_0) if i % 2 == 0 else (GT.Q8_0, GT.Q5_0)
    return {"attn_q": GT.Q5_0, "attn_k": GT.Q5_0, "attn_v": GT.Q8_0, "attn_output": GT.Q5_0,
            "ffn_gate": gate, "ffn_up": up,
            "ffn_down": GT.Q6_K if use_more_bits(i, n_layers) else GT.Q4_K}


MIXES: dict[str, Callable[[int, int], dict[str, GT]]] = {
    "every-type": lambda i, n: layer_types(i), "q4_k_m": q4_k_m_types,
    "f16": lambda i, n: dict.fromkeys(layer_types(i), GT.F16)}
"""The layer mixes :func:`write_requantized` writes, by name."""


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub)


def write_requantized(src: Path, dst: Path, mix: str = "every-type", embd: GT = GT.Q8_0) -> Path:
    """Write ``src`` (a llama GGUF) re-quantized per the layer mix ``mix`` (:data:`MIXES`) to
    ``dst`` (atomically). ``token_embd`` becomes ``embd`` and norms stay float32;
    ``general.file_type`` is copied unchanged (so it lies, as it does after llama.cpp requantizes:
    readers must trust each tensor's own type). Deterministic: the same ``src`` and ``mix`` give
    the same bytes."""
    reader = gguf.GGUFReader(src)
    n_layers = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    types = MIXES[mix]
    tmp = dst.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, "llama")
    _copy_metadata(reader, writer)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        parts = t.name.split(".")
        if len(shape) == 1:
            qtype = GT.F32
        elif t.name.startswith("blk."):
            qtype = types(int(parts[1]), n_layers)[parts[2]]
        else:
            qtype = embd
        data = quantize(values, qtype)
        if qtype in (GT.F32, GT.F16):
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, data, raw_dtype=qtype)
    return finish(writer, tmp, dst)


def cache_dir() -> Path:
    """Where generated test models live: ``$ZMQ_RPC_TEST_CACHE`` or ``~/.cache/zmq-rpc-tests``
    (outside the repository: no model files in the tree)."""
    base = os.environ.get("ZMQ_RPC_TEST_CACHE") or Path.home() / ".cache" / "zmq-rpc-tests"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path
