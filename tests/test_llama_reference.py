"""Tests for tests/llama_reference.py: dequantization, KV cache, rope mode, and a real answer."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from llama_reference import (
    ReferenceLlama,
    dequantize,
    dequantize_q4_1,
    dequantize_q8_0,
    rope,
)
from zmq_rpc.client.gguf_model import LlamaGGUF
from zmq_rpc.client.tokenizer import Tokenizer, load_tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GGML_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module")
def model(llama_gguf: LlamaGGUF) -> LlamaGGUF:
    return llama_gguf


@pytest.fixture(scope="module")
def tok(model: LlamaGGUF) -> Tokenizer:
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def ref(model: LlamaGGUF) -> ReferenceLlama:
    return ReferenceLlama(model)


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(tok.apply_chat_template(QUESTION))


@pytest.mark.timeout(60)
def test_dequant_block_layouts_by_hand() -> None:
    q8 = np.zeros((1, 34), np.uint8)
    q8[0, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    q8[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(
        dequantize_q8_0(q8), 0.5 * np.arange(-16, 16, dtype=np.float32)[None]
    )
    q4 = np.zeros((1, 20), np.uint8)
    q4[0, :4] = np.frombuffer(np.array([0.25, -1.0], np.float16).tobytes(), np.uint8)
    low, high = np.arange(16, dtype=np.uint8), np.arange(15, -1, -1, dtype=np.uint8)
    q4[0, 4:] = low | (high << 4)
    expected = 0.25 * np.concatenate([low, high]).astype(np.float32) - 1.0
    np.testing.assert_array_equal(dequantize_q4_1(q4), expected[None])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.17.ffn_down.weight"]
)
def test_dequant_matches_gguf_package(model: LlamaGGUF, name: str) -> None:
    tensor = model.tensors[name]
    expected = gguf.quants.dequantize(tensor.data, GGML_TYPES[tensor.qtype])
    np.testing.assert_array_equal(dequantize(tensor), expected.reshape(tensor.shape))


@pytest.mark.timeout(60)
def test_rope_normal_rotates_interleaved_pairs() -> None:
    x = np.zeros((1, 1, 4), np.float32)
    x[0, 0, 0] = 1.0  # pair 0 is (x0, x1); at pos 1 with base 1 it turns by 1 radian
    out = rope(x, np.array([1]), base=1.0, dims=4, mode="normal")
    np.testing.assert_allclose(out[0, 0], [np.cos(1.0), np.sin(1.0), 0.0, 0.0], rtol=1e-6)
    neox = rope(x, np.array([1]), base=1.0, dims=4, mode="neox")
    np.testing.assert_allclose(neox[0, 0], [np.cos(1.0), 0.0, np.sin(1.0), 0.0], rtol=1e-6)


@pytest.mark.timeout(300)
def test_kv_cache_decode_equals_full_recompute(ref: ReferenceLlama, prompt_ids: list[int]) -> None:
    """16 greedy tokens decoded with the cache: the same tokens, and the same logits at every
    step, as one forward of the whole sequence without it. Row i of that forward is what an
    uncached greedy step i computes (the attention is causal), so its argmax is that step's
    token: one recompute instead of an uncached greedy run's 16 (11 of the test's 13 s)."""
    assert 30 <= len(prompt_ids) <= 40
    cached = ref.generate_greedy(prompt_ids, 16)
    ref.reset()
    step_logits = [ref.forward(prompt_ids, 0)[-1]]
    step_logits += [ref.forward([t], ref.n_past)[-1] for t in cached[:-1]]
    assert ref.n_past == len(prompt_ids) + 15
    full = ref.forward(prompt_ids + cached[:-1], 0)[len(prompt_ids) - 1 :]
    assert cached == [int(i) for i in np.argmax(full, axis=-1)]
    np.testing.assert_allclose(np.stack(step_logits), full, rtol=1e-4, atol=2e-3)


@pytest.mark.timeout(300)
def test_answers_paris(ref: ReferenceLlama, tok: Tokenizer, prompt_ids: list[int]) -> None:
    # The reference answers "The capital of France is Paris.<|im_end|>". Its first token wins
    # narrowly ("The" 25.33 vs "L" 25.24, which leads to French-sounding nonsense), so only
    # "Paris" and a clean EOS are asserted, not the exact wording.
    answer = ref.generate_greedy(prompt_ids, 32, stop_ids={tok.eos_id})
    text = tok.decode(answer)
    assert answer[-1] == tok.eos_id, text
    assert "Paris" in text, text


def _mean_nll(ref: ReferenceLlama, ids: list[int]) -> float:
    ref.reset()
    logits = ref.forward(ids, 0).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))


@pytest.mark.timeout(300)
def test_normal_rope_fits_text_better_than_neox(ref: ReferenceLlama, tok: Tokenizer) -> None:
    ids = tok.encode(
        "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city "
        "of France, with an estimated population of two million residents."
    )
    config = ref.config
    normal = _mean_nll(ref, ids)
    try:
        ref.config = dataclasses.replace(config, rope_mode="neox")
        neox = _mean_nll(ref, ids)
    finally:
        ref.config = config
    assert normal < 3.5 and neox > normal + 0.5, (normal, neox)


@pytest.mark.timeout(60)
def test_forward_checks_start_pos(ref: ReferenceLlama) -> None:
    ref.reset()
    with pytest.raises(ValueError, match="start_pos"):
        ref.forward([1, 2], 1)
    ref.forward([1, 2], 0)
    assert ref.n_past == 2
    ref.forward([3], 1)  # rewinds the cache to position 1
    assert ref.n_past == 2
