"""Tests for client/architectures.py and the per-architecture hyper-parameters in
client/gguf_model.py: each read as llama.cpp reads it (``src/models/*.cpp``,
``llama-model.cpp``, ``llama-hparams.cpp``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from synthetic_models import synthetic_path
from zmq_rpc.client.architectures import ARCHITECTURES
from zmq_rpc.client.gguf_model import GGUFMetadata, GGUFModelError, LlamaConfig, load_gguf


def config(arch: str, tensors: tuple[str, ...] = (), **keys: Any) -> LlamaConfig:
    """A config from minimal metadata of ``arch`` plus ``keys`` (dots written as ``__``)."""
    values: dict[str, Any] = {
        "general.architecture": arch, f"{arch}.block_count": 18,
        f"{arch}.embedding_length": 640, f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 1, f"{arch}.attention.key_length": 256,
        f"{arch}.feed_forward_length": 2048, f"{arch}.context_length": 32768,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": 1e6,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.tokens": ["t"] * 300}
    values.update({f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()})
    return LlamaConfig.from_metadata(GGUFMetadata(values), frozenset(tensors))


def test_another_architecture_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(GGUFModelError, match=r"unsupported architecture 'mamba': supported are "
                                             r"gemma3, llama, phi3, qwen2, qwen3"):
        config("mamba")
    assert sorted(ARCHITECTURES) == ["gemma3", "llama", "phi3", "qwen2", "qwen3"]


def test_rope_modes_as_llama_cpp_sets_them() -> None:
    """llama is "normal" (the converter permutes Q/K), the others NEOX (llama_model_rope_type)."""
    modes = {arch: config(arch).rope_mode for arch in ARCHITECTURES}
    assert modes == {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox",
                     "phi3": "neox"}


def test_gemma3_sliding_window_layers_and_rope_bases() -> None:
    """set_swa_pattern(6): layer il slides when il % 6 < 5; SWA layers rope with
    rope.freq_base_swa (10000 unless given) and no scaling, the global ones with the file's."""
    cfg = config("gemma3", attention__sliding_window=512, rope__scaling__type="linear",
                 rope__scaling__factor=8.0)
    assert cfg.swa_window == 512
    assert [i for i in range(18) if not cfg.is_swa(i)] == [5, 11, 17]
    assert cfg.layer_rope(0) == (10000.0, 1.0) and cfg.layer_rope(5) == (1e6, 0.125)
    two = config("gemma3", attention__sliding_window=8, attention__sliding_window_pattern=2,
                 rope__freq_base_swa=5000.0)
    assert [two.is_swa(i) for i in range(4)] == [True, False, True, False]
    assert two.layer_rope(0) == (5000.0, 1.0)
    flags = [i % 3 == 0 for i in range(18)]
    listed = config("gemma3", attention__sliding_window=8, attention__sliding_window_pattern=flags)
    assert [listed.is_swa(i) for i in range(18)] == flags
    assert not any(config("gemma3").is_swa(i) for i in range(18)), "no window: all global"


def test_gemma3_attention_scale_and_softcap() -> None:
    assert config("gemma3").kq_scale == pytest.approx(1 / 16)            # 1/sqrt(head size)
    assert config("gemma3", block_count=62).kq_scale == pytest.approx(1 / (640 / 4) ** 0.5)
    assert config("gemma3", final_logit_softcapping=30.0).logit_softcap == 30.0


def test_only_linear_rope_scaling_is_read() -> None:
    assert config("llama", rope__scaling__type="none", rope__scaling__factor=4.0).rope_scale == 1
    assert config("qwen2", rope__scale_linear=2.0).rope_scale == 0.5
    with pytest.raises(GGUFModelError, match="rope scaling 'yarn' is not supported"):
        config("qwen2", rope__scaling__type="yarn", rope__scaling__factor=4.0)


def test_optional_tensors_biases_and_rope_factors() -> None:
    """Q/K/V biases wherever the file has them (llama.cpp's create_tensor_qkv); rope_freqs
    only where the architecture reads them (llama)."""
    cfg = config("qwen2", ("blk.0.attn_q.bias", "rope_freqs.weight"), rope__dimension_count=256)
    assert cfg.qkv_bias and not cfg.rope_freqs
    shapes = cfg.expected_shapes()
    assert shapes["blk.3.attn_k.bias"] == (256,) and shapes["blk.3.attn_q.bias"] == (1024,)
    llama = config("llama", ("rope_freqs.weight",))
    assert llama.rope_freqs and llama.expected_shapes()["rope_freqs.weight"] == (128,)


def test_phi3_fused_tensors_and_partial_rotary() -> None:
    cfg = config("phi3", ("output.weight",), rope__dimension_count=96)
    shapes = cfg.expected_shapes()
    assert shapes["blk.0.attn_qkv.weight"] == (4 * 256 + 2 * 256, 640)
    assert shapes["blk.0.ffn_up.weight"] == (2 * 2048, 640)
    assert "blk.0.attn_q.weight" not in shapes and "blk.0.ffn_gate.weight" not in shapes
    assert cfg.rope_dims == 96 and not cfg.tied_output


def test_gemma3_and_qwen3_norm_tensors() -> None:
    gemma = config("gemma3").expected_shapes()
    for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
        assert gemma[f"blk.0.{name}.weight"] == (640,)
    assert gemma["blk.0.attn_q_norm.weight"] == gemma["blk.0.attn_k_norm.weight"] == (256,)
    qwen3 = config("qwen3").expected_shapes()
    assert qwen3["blk.0.attn_k_norm.weight"] == (256,) and "blk.0.post_ffw_norm.weight" not in qwen3


def test_a_tensor_the_loader_would_not_read_is_refused(tmp_path: Path) -> None:
    """An output bias (or LongRoPE factors ...) ignored would compute another model: refused,
    naming it, as llama.cpp refuses unused tensors."""
    src = gguf.GGUFReader(synthetic_path("qwen3"))
    path = tmp_path / "qwen3-output-bias.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in src.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.add_tensor("output.bias", np.zeros(49152, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFModelError, match="1 tensor.s. this loader does not read: output.bias"):
        load_gguf(path)


def test_llama3_rope_factors_are_the_same_bytes_on_every_cpu() -> None:
    """The synthetic llama3 file's rope factors, pinned: numpy's float32 power gave one factor
    a last bit off on an AVX-512 CPU, so that the file was not the one llama.cpp's fixture was
    recorded on (its SHA-256 differed) on such machines only."""
    from zmq_rpc.tools.synthetic_gguf import llama3_rope_factors
    assert llama3_rope_factors().tobytes().hex()[:80] == (
        "0000803f0000803f0000803f0000803f00a1a53fdbfced3f9bf83040b86d8b40385bf54000000041")
    assert llama3_rope_factors().tobytes().hex()[80:] == "00000041" * 22
