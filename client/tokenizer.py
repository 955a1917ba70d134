"""Text <-> token ids for GGUF models, following llama.cpp's rules, and their chat prompts.

This module owns tokenization for the two vocabulary kinds of the families we run, read from the
GGUF's metadata and reproducing llama.cpp (``src/llama-vocab.cpp``), which is what the models'
GGUFs are made for:

- **byte-level BPE** (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen 2.5/3): the
  ``tokenizers`` package's BPE over ``tokenizer.ggml.tokens``/``merges``, after llama.cpp's
  pre-tokenizer regexes for the GGUF's ``tokenizer.ggml.pre`` (:data:`BPE_PRE_TOKENIZERS`), each
  applied as an isolating split, as llama.cpp's ``unicode_regex_split`` does; ``llama-bpe`` also
  takes a whole word that is a token as it is (llama.cpp's ``ignore_merges``);
- **SentencePiece-style** (``"llama"``: Gemma 3, Phi-3): :mod:`.sentencepiece`, with spaces as
  ``▁``, a prefix space when ``tokenizer.ggml.add_space_prefix`` says so, and ``<0xNN>`` byte
  fallback.

Special tokens (control, user-defined and unknown types) are cut out of the text first, longest
first, and each becomes its one id (llama.cpp's ``tokenizer_st_partition`` with
``parse_special``); the text between them is tokenized piece by piece. BOS is prepended when
``tokenizer.ggml.add_bos_token`` (or llama.cpp's default for the vocabulary) says so;
:attr:`Tokenizer.eog_ids` are the ids that end a generation (EOS, EOT and the end-of-turn tokens
llama.cpp recognises by their text). The ids were checked against llama.cpp itself
(``tools/tokenizer_oracle.py``, ``tests/test_tokenizer_oracle.py``).

Tokens can carry part of a UTF-8 character, so streamed output goes through
:class:`StreamDecoder`, which only emits complete characters. Chat prompts come from the GGUF's
jinja template (:mod:`.chat_template`).

Nothing here starts threads. A :class:`Tokenizer` may be shared between threads (the
``tokenizers`` backend is thread-safe, the rest immutable); a :class:`StreamDecoder` belongs to
one stream.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast, overload

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .chat_template import ChatTemplate, fallback_template
from .gguf_file import GGUFFormatError, read_gguf
from .gguf_model import GGUFMetadata, GGUFModelError, LlamaGGUF
from .sentencepiece import SPACE_MARK, SentencePieceVocab

__all__ = [
    "BPE_PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
    "StreamDecoder",
    "Tokenizer",
    "load_tokenizer",
    "read_tokenizer",
]

TOKEN_TYPE_NORMAL: Final = 1
TOKEN_TYPE_UNKNOWN: Final = 2
TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_USER_DEFINED: Final = 4
TOKEN_TYPE_BYTE: Final = 6

SUPPORTED_TOKENIZER_MODELS: Final = ("gpt2", "llama")
"""``tokenizer.ggml.model`` values we read: byte-level BPE and SentencePiece-style."""

# llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe in src/llama-vocab.cpp), applied in order.
_GPT2: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_LIKE: Final = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"{digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT: Final = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2: Final = (r"\p{N}", _GPT2)
_LLAMA3: Final = (_LLAMA3_LIKE.replace("{digits}", r"\p{N}{1,3}"),)
_QWEN2: Final = (_LLAMA3_LIKE.replace("{digits}", r"\p{N}"),)

BPE_PRE_TOKENIZERS: Final[Mapping[str, tuple[str, ...]]] = {
    "default": _DEFAULT,
    "gpt-2": (_GPT2,),
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}
"""``tokenizer.ggml.pre`` -> llama.cpp's regexes for it (a missing key means ``default``)."""

_LLAMA3_NAMES: Final = frozenset({"llama-bpe", "llama3", "llama-v3"})

# Token texts llama.cpp takes as end of generation and forces to control type
# (llama_vocab::impl::load), and its fill-in-the-middle tokens, also end of generation there,
# found by text when the GGUF does not give their ids.
_EOG_NAMES: Final = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
_FIM_NAMES: Final[Mapping[str, frozenset[str]]] = {
    "pad": frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}),
    "rep": frozenset({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}),
    "sep": frozenset({"<|file_sep|>"}),
}
_C_SPACE: Final = " \t\n\v\f\r"    # C's isspace(), which llama.cpp's lstrip/rstrip use
_PHI3_NAMES: Final = ("phi-3", "phi3")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return mapping


_UNICODE_TO_BYTE: Final = {ch: b for b, ch in _bytes_to_unicode().items()}
# str.translate table: each byte-level character to the Latin-1 character of its byte; the
# unmapped characters 128-255 (UTF-8 encoded by the slow path) to one Latin-1 cannot encode.
_TO_LATIN1: Final = {
    **{ord(ch): chr(b) for ch, b in _UNICODE_TO_BYTE.items()},
    **{c: "\uffff" for c in range(128, 256) if chr(c) not in _UNICODE_TO_BYTE},
}


def _byte_level_bytes(token: str) -> bytes:
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")     # every character mapped
    except UnicodeEncodeError:
        return b"".join(
            bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode() for c in token
        )


def _byte_token_value(token: str) -> int | None:
    """The byte a ``<0xNN>`` token stands for, ``None`` for any other text."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def _piece_bytes(token: str, token_type: int, spm: bool) -> bytes:
    """What llama.cpp's ``token_to_piece`` prints for a token (special tokens as their text)."""
    if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):
        return token.encode("utf-8")
    if token_type == TOKEN_TYPE_NORMAL:
        return token.replace(SPACE_MARK, " ").encode("utf-8") if spm else _byte_level_bytes(token)
    value = _byte_token_value(token) if token_type == TOKEN_TYPE_BYTE else None
    return b"" if value is None else bytes([value])     # unused and undefined: nothing


class _PieceBytes(Sequence[bytes]):
    """Each token's :func:`_piece_bytes`, worked out the first time it is asked for: a stream
    decodes hundreds of a vocabulary's tens of thousands (all of them up front took ~40 ms of
    a model's start-up). Any thread (a lost race computes the same bytes twice)."""

    def __init__(self, tokens: Sequence[str], types: Sequence[int], spm: bool) -> None:
        self._tokens, self._types, self._spm = tokens, types, spm
        self._done: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        piece = self._done.get(index)
        if piece is None:
            piece = _piece_bytes(self._tokens[index], self._types[index], self._spm)
            self._done[index] = piece
        return piece


@dataclass(frozen=True, slots=True)
class _Special:
    """A token cut out of the text before tokenization, with llama.cpp's strip attributes."""

    text: str
    id: int
    lstrip: bool = False
    rstrip: bool = False


def _partition(text: str, specials: Sequence[_Special]) -> list[str | int]:
    """Split ``text`` at special-token texts, longest token first: text pieces and ids."""
    fragments: list[str | int] = [text]
    for special in specials:
        if not any(isinstance(f, str) and special.text in f for f in fragments):
            continue
        fragments = [
            piece
            for fragment in fragments
            for piece in (
                _split_at(fragment, special) if isinstance(fragment, str) else [fragment]
            )
        ]
    return fragments


def _split_at(text: str, special: _Special) -> list[str | int]:
    parts = text.split(special.text)
    out: list[str | int] = []
    for n, part in enumerate(parts):
        if n > 0:
            out.append(special.id)
            part = part.lstrip(_C_SPACE) if special.rstrip else part
        if n < len(parts) - 1 and special.lstrip:
            part = part.rstrip(_C_SPACE)
        if part:
            out.append(part)
    return out


class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get back only complete characters."""

    def __init__(
        self, token_bytes: Sequence[bytes], special_ids: frozenset[int], skip_special_tokens: bool
    ) -> None:
        self._token_bytes = token_bytes
        self._skip = special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often ``""`` mid-character)."""
        _check_id(token_id, len(self._token_bytes))
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        """End the stream; a dangling partial character comes back as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _check_id(token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} outside the vocabulary (size {vocab_size})")


FragmentEncoder = Callable[[str, bool], list[int]]
"""Ids of one piece of text between special tokens; the flag: it follows a special token (or
starts the text)."""


class Tokenizer:
    """Text <-> token ids for one GGUF model; build it with :func:`load_tokenizer`."""

    def __init__(
        self,
        *,
        encode_fragment: FragmentEncoder,
        specials: Sequence[_Special],
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int],
        bos_id: int,
        eos_id: int,
        eog_ids: frozenset[int],
        add_bos: bool,
        chat_template: ChatTemplate,
        has_chat_template: bool,
        kind: str,
    ) -> None:
        """Wrap built parts (:func:`load_tokenizer` makes them from a GGUF)."""
        self._encode_fragment = encode_fragment
        self._specials = tuple(specials)
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        self._bos_id, self._eos_id, self._add_bos = bos_id, eos_id, add_bos
        self._eog_ids = eog_ids
        self._chat = chat_template
        self.has_chat_template = has_chat_template
        """Whether the GGUF has its own ``tokenizer.chat_template`` (else the format its
        vocabulary's turn markers name, or ChatML: ``chat_template.fallback_template``)."""
        self.kind = kind
        """``model/pre``, e.g. ``gpt2/qwen2`` or ``llama/spm``."""

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence token id (``<|im_start|>`` for SmolLM2)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """End-of-sequence token id (``<|im_end|>`` for SmolLM2)."""
        return self._eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end a generation: EOS, EOT and the end-of-turn tokens llama.cpp knows."""
        return self._eog_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self._token_bytes)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the control and unknown tokens (left out by ``skip_special_tokens``)."""
        return self._special_ids

    @property
    def chat_template(self) -> ChatTemplate:
        """The GGUF's chat template (when it has none: the format its vocabulary names, else ChatML)."""
        return self._chat

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` maps to its id.

        A BOS id is prepended when the GGUF's ``tokenizer.ggml.add_bos_token`` (or llama.cpp's
        default for the vocabulary) says so.
        """
        ids = [self._bos_id] if self._add_bos else []
        after_special = True
        for fragment in _partition(text, self._specials) if text else []:
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids += self._encode_fragment(fragment, after_special)
            after_special = isinstance(fragment, int)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut-off character) becomes U+FFFD."""
        id_list = list(ids)
        for token_id in id_list:
            _check_id(token_id, self.vocab_size)
        skip = self._special_ids if skip_special_tokens else frozenset()
        raw = b"".join(self._token_bytes[i] for i in id_list if i not in skip)
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        _check_id(token_id, self.vocab_size)
        return self._token_bytes[token_id]

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for one generated sequence."""
        return StreamDecoder(self._token_bytes, self._special_ids, skip_special_tokens)

    def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = False) -> Iterator[str]:
        """Yield printable text as tokens arrive, holding back partial UTF-8 characters.

        Only non-empty strings are yielded; their concatenation equals :meth:`decode`.
        """
        decoder = self.stream_decoder(skip_special_tokens)
        for token_id in ids:
            text = decoder.push(token_id)
            if text:
                yield text
        tail = decoder.flush()
        if tail:
            yield tail

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat ``messages`` (``{"role": ..., "content": ...}``) with the model's template.

        When :meth:`encode` adds BOS itself, a BOS the template printed first is left out (as
        llama.cpp's ``common_chat_template_direct_apply`` does), so the prompt gets one BOS.

        Raises:
            ValueError: the template refused the conversation or failed.
            TypeError: a message lacks a str ``role`` or ``content``.
        """
        text = self._chat.render(messages, add_generation_prompt)
        bos = self._token_bytes[self._bos_id].decode("utf-8", errors="replace")
        return text[len(bos):] if self._add_bos and bos and text.startswith(bos) else text


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the GGUF at ``path``, reading its metadata only (no model checks).

    Raises:
        GGUFModelError: not a readable GGUF, or no tokenizer this module supports.
    """
    try:
        parsed = read_gguf(path)
    except GGUFFormatError as exc:
        raise GGUFModelError(f"{path}: not a readable GGUF file: {exc}") from exc
    return load_tokenizer(GGUFMetadata(parsed.metadata))


def load_tokenizer(model: LlamaGGUF | GGUFMetadata) -> Tokenizer:
    """Build the tokenizer stored in a GGUF's metadata (``model`` or its ``metadata``).

    Raises:
        GGUFModelError: the metadata holds no tokenizer this module supports (the message names
            the supported kinds) or a malformed one.
    """
    meta = model if isinstance(model, GGUFMetadata) else model.metadata
    vocab = _Vocab.from_metadata(meta)
    spm = vocab.model == "llama"
    encode_fragment, pre = _spm_encoder(meta, vocab) if spm else _bpe_encoder(meta, vocab)
    bos_id, eos_id = (meta.get_int(f"tokenizer.ggml.{k}_token_id", d)
                      for k, d in (("bos", 1 if spm else 11), ("eos", 2 if spm else 11)))
    _check_id(bos_id, len(vocab.tokens))
    _check_id(eos_id, len(vocab.tokens))
    return Tokenizer(
        encode_fragment=encode_fragment,
        specials=_specials(meta, vocab),
        token_bytes=_PieceBytes(vocab.tokens, vocab.types, spm),
        special_ids=frozenset(
            i for i, k in enumerate(vocab.types) if k in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        ),
        bos_id=bos_id,
        eos_id=eos_id,
        eog_ids=_eog_ids(meta, vocab, eos_id),
        add_bos=meta.get_bool("tokenizer.ggml.add_bos_token", spm or pre in _LLAMA3_NAMES),
        chat_template=_chat_template(meta, vocab, bos_id, eos_id),
        has_chat_template="tokenizer.chat_template" in meta,
        kind=f"{vocab.model}/{pre}",
    )


@dataclass(frozen=True, slots=True)
class _Vocab:
    model: str
    tokens: list[str]
    types: list[int]
    """Token types, with llama.cpp's override: end-of-turn texts are control tokens."""

    @classmethod
    def from_metadata(cls, meta: GGUFMetadata) -> _Vocab:
        model = meta.get_str("tokenizer.ggml.model")
        if model not in SUPPORTED_TOKENIZER_MODELS:
            raise GGUFModelError(
                f"tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level "
                "BPE: Llama 3, Qwen, SmolLM) and 'llama' (SentencePiece-style: Gemma, Phi-3)"
            )
        tokens = [str(t) for t in meta.get_list("tokenizer.ggml.tokens")]
        types = (
            [int(t) for t in meta.get_list("tokenizer.ggml.token_type")]
            if "tokenizer.ggml.token_type" in meta else [TOKEN_TYPE_NORMAL] * len(tokens)
        )
        if len(tokens) != len(types) or not tokens:
            raise GGUFModelError(f"{len(tokens)} tokens but {len(types)} token types")
        forced = _EOG_NAMES | {n for kind, names in _FIM_NAMES.items()
                               if f"tokenizer.ggml.fim_{kind}_token_id" not in meta for n in names}
        types = [TOKEN_TYPE_CONTROL if t in forced else k for t, k in zip(tokens, types)]
        return cls(model, tokens, types)


def _bpe_encoder(meta: GGUFMetadata, vocab: _Vocab) -> tuple[FragmentEncoder, str]:
    pre = meta.get_str("tokenizer.ggml.pre", "default")
    if pre not in BPE_PRE_TOKENIZERS:
        raise GGUFModelError(
            f"pre-tokenizer {pre!r} is not supported; supported: {sorted(BPE_PRE_TOKENIZERS)}"
        )
    if len(set(vocab.tokens)) != len(vocab.tokens):
        raise GGUFModelError("the GGUF vocabulary holds duplicate tokens")
    backend = HFTokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(vocab.tokens)},
        merges=_merges(meta),
        ignore_merges=pre in _LLAMA3_NAMES,
    ))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in BPE_PRE_TOKENIZERS[pre]),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()

    def encode(text: str, _after_special: bool) -> list[int]:
        return list(backend.encode(text, add_special_tokens=False).ids)

    return encode, pre


def _merges(meta: GGUFMetadata) -> list[tuple[str, str]]:
    pairs = [tuple(str(m).split(" ")) for m in meta.get_list("tokenizer.ggml.merges")]
    bad = next((p for p in pairs if len(p) != 2), None)
    if bad is not None:
        raise GGUFModelError(f"malformed BPE merge {' '.join(bad)!r}")
    return cast("list[tuple[str, str]]", pairs)


def _spm_encoder(meta: GGUFMetadata, vocab: _Vocab) -> tuple[FragmentEncoder, str]:
    if "tokenizer.ggml.scores" in meta:
        scores = [float(s) for s in meta.get_list("tokenizer.ggml.scores")]
    else:
        scores = [0.0] * len(vocab.tokens)
    if len(scores) < len(vocab.tokens):
        raise GGUFModelError(f"{len(scores)} token scores for {len(vocab.tokens)} tokens")
    spm = SentencePieceVocab({t: i for i, t in enumerate(vocab.tokens)}, scores)
    prefix = meta.get_bool("tokenizer.ggml.add_space_prefix", True)

    def encode(text: str, after_special: bool) -> list[int]:
        # llama.cpp: a prefix space before the first text and after each special token
        spaced = " " + text if prefix and after_special else text
        return spm.encode(spaced.replace(" ", SPACE_MARK))

    return encode, "spm"


def _specials(meta: GGUFMetadata, vocab: _Vocab) -> list[_Special]:
    """The tokens cut out of text, longest first, with llama.cpp's Phi-3 strip rule."""
    kinds = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)
    ids = [i for i, k in enumerate(vocab.types) if k in kinds and vocab.tokens[i]]
    # llama.cpp sets attributes by the model's name: Phi-3's special tokens eat the whitespace
    # after them, except these.
    name = meta.get_str("general.name", "").lower()
    phi3 = any(n in name for n in _PHI3_NAMES)
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    specials = [_Special(vocab.tokens[i], i, rstrip=phi3 and vocab.tokens[i] not in keep)
                for i in ids]
    return sorted(specials, key=lambda s: -len(s.text.encode("utf-8")))


def _eog_ids(meta: GGUFMetadata, vocab: _Vocab, eos_id: int) -> frozenset[int]:
    fim = [names for kind, names in _FIM_NAMES.items()
           if f"tokenizer.ggml.fim_{kind}_token_id" not in meta]
    wanted = _EOG_NAMES.union(*fim)
    named = [(i, t) for i, t in enumerate(vocab.tokens) if t in wanted]    # one pass
    eog = {i for i, t in named if t in _EOG_NAMES} | {eos_id}
    for key in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
        token_id = meta.get_int(f"tokenizer.ggml.{key}_token_id", -1)
        if 0 <= token_id < len(vocab.tokens):
            eog.add(token_id)
    for names in fim:
        # llama.cpp takes the first it meets in a hash map: a vocabulary with two of these
        # names (none we know) could differ
        eog |= {i for i, t in named if t in names}
    return frozenset(eog)


def _chat_template(meta: GGUFMetadata, vocab: _Vocab, bos_id: int, eos_id: int) -> ChatTemplate:
    source = meta.get_str("tokenizer.chat_template", "") or fallback_template(
        frozenset(vocab.tokens))[1]
    try:
        return ChatTemplate(source, vocab.tokens[bos_id], vocab.tokens[eos_id])
    except ValueError as exc:
        raise GGUFModelError(f"tokenizer.chat_template: {exc}") from exc
