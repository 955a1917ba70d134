"""Tests for client/tokenizer.py on SmolLM2's GGUF vocabulary.

Expected ids come from two sources: a small independent byte-level BPE below that follows
llama.cpp's algorithm for ``tokenizer.ggml.pre == "smollm"`` (split every ``\\p{N}`` alone,
then the GPT-2 regex, then lowest-rank-first merges), and a few pinned golden ids.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from zmq_rpc.client.chat_template import CHATML_TEMPLATE, ChatTemplate
from zmq_rpc.client.gguf_model import LlamaGGUF
from zmq_rpc.client.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days; I'll say it's 3.14159, don't you think?",
    "  leading spaces\n\n\ttabs and trailing   ",
    "héllo wörld — naïve café, 你好，世界。 Привет, мир! ",
    "emoji 🎉👩‍👩‍👧 family 🇫🇷 flag",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def model(llama_gguf: LlamaGGUF) -> LlamaGGUF:
    return llama_gguf


@pytest.fixture(scope="module")
def tok(model: LlamaGGUF) -> Tokenizer:
    return load_tokenizer(model)


# ---- an independent llama.cpp-style BPE, for cross-checking ids -------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _byte_to_char() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in keep}
    table |= {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in table)}
    return table


def _bpe_word(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    parts = list(word)
    while len(parts) > 1:
        pairs = [
            (ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(itertools.pairwise(parts))
        ]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def independent_encode(text: str, model: LlamaGGUF) -> list[int]:
    regex: Any = pytest.importorskip("regex")
    tokens = model.metadata.get_list("tokenizer.ggml.tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {
        tuple(m.split(" ")): r
        for r, m in enumerate(model.metadata.get_list("tokenizer.ggml.merges"))
    }
    table = _byte_to_char()
    chunks = [c for c in regex.split(r"(\p{N})", text) if c]
    words = [w for chunk in chunks for w in regex.findall(GPT2_PATTERN, chunk)]
    pieces = [p for w in words for p in _bpe_word("".join(table[b] for b in w.encode()), ranks)]
    return [vocab[p] for p in pieces]


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert "".join(tok.decode_stream(ids)) == text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t])
def test_ids_match_independent_llama_cpp_style_bpe(
    tok: Tokenizer, model: LlamaGGUF, text: str
) -> None:
    assert tok.encode(text) == independent_encode(text, model)


@pytest.mark.timeout(60)
def test_golden_ids(tok: Tokenizer) -> None:
    assert tok.encode("Hello world!") == [19556, 905, 17]
    assert tok.encode("2024") == [34, 32, 34, 36], "smollm pre-tokenizer splits digits one by one"
    assert tok.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]


@pytest.mark.timeout(60)
def test_special_tokens_are_single_ids(tok: Tokenizer, model: LlamaGGUF) -> None:
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.encode("<|im_start|>") == [tok.bos_id]
    assert tok.encode("<|im_end|>") == [tok.eos_id]
    tokens, types = (
        model.metadata.get_list(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type")
    )
    control = [i for i, kind in enumerate(types) if kind == 3]
    assert len(control) == 17 and tok.special_ids == frozenset(control)
    for i in control:
        assert tok.encode(tokens[i]) == [i]
    assert tok.decode([1, 2]) == "<|im_start|><|im_end|>"
    assert tok.decode([1, 19556, 2], skip_special_tokens=True) == "Hello"


@pytest.mark.timeout(60)
def test_no_bos_added(tok: Tokenizer) -> None:
    assert tok.encode("Hello")[0] != tok.bos_id


@pytest.mark.timeout(60)
def test_decode_rejects_unknown_ids(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.stream_decoder().push(-1)


@pytest.mark.timeout(60)
def test_decode_stream_holds_back_partial_characters(tok: Tokenizer) -> None:
    text = "🎉👩‍👩‍👧 ok"
    ids = tok.encode(text)
    pieces = list(tok.decode_stream(ids))
    assert "".join(pieces) == text
    assert all(pieces) and not any("\ufffd" in p for p in pieces)
    assert len(pieces) < len(ids), "some emoji tokens carry only part of a character"
    assert any(b"\xf0" in tok.token_bytes(i) and len(tok.token_bytes(i)) < 4 for i in ids)


@pytest.mark.timeout(60)
def test_stream_decoder_push_and_flush(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    decoder = tok.stream_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "🎉" and decoder.flush() == ""
    cut = tok.stream_decoder()
    cut.push(ids[0])
    assert cut.flush() == "\ufffd"
    assert list(tok.decode_stream([1, 19556, 2], skip_special_tokens=True)) == ["Hello"]


@pytest.mark.timeout(60)
def test_chat_template_renders_chatml_with_default_system(tok: Tokenizer) -> None:
    user = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(user) == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *user]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    assert tok.apply_chat_template([], add_generation_prompt=False) == ""


@pytest.mark.timeout(60)
def test_chat_template_agrees_with_jinja_rendering(tok: Tokenizer, model: LlamaGGUF) -> None:
    jinja2: Any = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(model.metadata.get_str("tokenizer.chat_template"))
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
        ],
        [{"role": "user", "content": "multi\nline ✓"}, {"role": "assistant", "content": ""}],
    ]
    for messages in conversations:
        for add in (True, False):
            expected = template.render(messages=messages, add_generation_prompt=add)
            assert tok.apply_chat_template(messages, add_generation_prompt=add) == expected


@pytest.mark.timeout(60)
def test_chat_prompt_tokens(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 3 and ids.count(tok.eos_id) == 2
    tail = [tok.bos_id, *tok.encode("assistant\n")]
    assert ids[-len(tail) :] == tail and 30 <= len(ids) <= 40


@pytest.mark.timeout(60)
def test_chat_template_errors() -> None:
    gemma_like = ChatTemplate(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="refused the conversation: System role not supported"):
        gemma_like.render([{"role": "system", "content": "S"}])
    with pytest.raises(TypeError, match="'role'"):
        ChatTemplate(CHATML_TEMPLATE).render([{"content": "no role"}])
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.timeout(60)
def test_chat_template_is_sandboxed() -> None:
    """A downloaded GGUF's template cannot reach Python internals."""
    hostile = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="unsafe|failed"):
        hostile.render([{"role": "user", "content": "x"}])


@pytest.mark.timeout(60)
def test_chatml_fallback_without_a_template() -> None:
    rendered = ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
