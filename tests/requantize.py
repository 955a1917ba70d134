"""Test helper: write a llama GGUF re-quantized to other ggml types, with simple K-quant quantizers.

``gguf.quants`` quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16 but not the K-quants, so Q4_K, Q5_K and Q6_K
are quantized here: per-sub-block min/max scales, rounded to the 6-bit (8-bit for Q6_K) sub-block
codes under float16 super-block factors. Not llama.cpp's search for the best scales (any valid blocks
will do: the tests' oracle is gguf's dequantization of what is written), but close enough to the
weights that the model still talks sense, so greedy tokens do not hang on near-ties.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

F16 = np.float16


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(F16).view(np.uint8).reshape(*values.shape, 2)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins (n, 8) -> ggml's 12-byte packing (inverse of ``get_scale_min_k4``)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _codes_min_max(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: x (n, 256) -> d, dmin (n,) float16, sc, mn (n, 8) and codes (n, 256) in [0, nmax]."""
    sub = x.reshape(-1, 8, 32)
    mins = -np.minimum(sub.min(axis=-1), 0)
    scales = (sub.max(axis=-1) + mins) / nmax
    d = (scales.max(axis=-1) / 63).astype(F16)
    dmin = (mins.max(axis=-1) / 63).astype(F16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scales / d.astype(np.float32)[:, None]), 0).clip(0, 63)
        mn = np.where(dmin[:, None] > 0, np.rint(mins / dmin.astype(np.float32)[:, None]), 0).clip(0, 63)
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
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), _k4_qs(q)], axis=-1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """(n, 256) float -> (n, 176) Q5_K blocks."""
    d, dmin, sc, mn, q = _codes_min_max(x, 31)
    high = ((q >> 4) & 1).reshape(-1, 8, 32)
    qh = (high << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), qh, _k4_qs(q)], axis=-1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(n, 256) float -> (n, 210) Q6_K blocks."""
    g = x.reshape(-1, 16, 16)
    scales = np.abs(g).max(axis=-1) / 31
    d = (scales.max(axis=-1) / 127).astype(F16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scales / d.astype(np.float32)[:, None]), 0).clip(-128, 127)
        step = (d.astype(np.float32)[:, None] * sc)[..., None]
        q = (np.where(step > 0, np.rint(g / step), 0) + 32).clip(0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=-1)


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
    return gguf.quants.quantize(values, qtype)


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


def use_more_bits(i: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers a Q4_K_M keeps one step up (``use_more_bits`` in
    ``llama-quant.cpp``): the first and last eighth, and every third layer between."""
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


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


def finish(writer: gguf.GGUFWriter, tmp: Path, dst: Path) -> Path:
    """Write out ``writer``'s file at ``tmp`` and move it to ``dst`` (whole or not at all)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def cache_dir() -> Path:
    """Where generated test models live: ``$ZMQ_RPC_TEST_CACHE`` or ``~/.cache/zmq-rpc-tests``
    (outside the repository: no model files in the tree)."""
    base = os.environ.get("ZMQ_RPC_TEST_CACHE") or Path.home() / ".cache" / "zmq-rpc-tests"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path
