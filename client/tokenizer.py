"""Byte-level BPE tokenizer and ChatML prompts, built from a GGUF file's metadata.

This module owns turning text into token ids and back for GGUF models whose tokenizer is
GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``). The vocabulary
(``tokenizer.ggml.tokens``), merges (``tokenizer.ggml.merges``) and token types
(``tokenizer.ggml.token_type``; 3 = control, registered as special tokens so that
``<|im_start|>`` is one id) are fed to the ``tokenizers`` package. Pre-tokenization follows
llama.cpp for the GGUF's ``tokenizer.ggml.pre``: the GPT-2 regex without an added prefix
space, preceded for ``smollm``/``starcoder``-style vocabularies by splitting every digit alone.

Byte-level BPE can split one UTF-8 character over several tokens, so streamed output goes
through :class:`StreamDecoder`, which only emits complete characters.

Chat prompts use ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), implemented directly (no
jinja); :class:`ChatMLTemplate` checks the GGUF's ``tokenizer.chat_template`` is ChatML and
takes the default system prompt from it.

Nothing here starts threads. A :class:`Tokenizer` may be shared between threads (the
``tokenizers`` backend is thread-safe); a :class:`StreamDecoder` belongs to one stream.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .gguf_model import GGUFMetadata, GGUFModelError, LlamaGGUF

__all__ = ["ChatMLTemplate", "StreamDecoder", "Tokenizer", "load_tokenizer"]

TOKEN_TYPE_NORMAL: Final = 1
TOKEN_TYPE_CONTROL: Final = 3
TOKEN_TYPE_USER_DEFINED: Final = 4

# llama.cpp pre-tokenizer names -> whether each digit is split off alone before the GPT-2 regex.
_PRE_SPLITS_DIGITS: Final[Mapping[str, bool]] = {
    "default": False,
    "gpt2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
    "codeshell": True,
}

_IM_START: Final = "<|im_start|>"
_IM_END: Final = "<|im_end|>"
_CHATML_MARKERS: Final = (
    _IM_START,
    _IM_END,
    "message['role']",
    "message['content']",
    "add_generation_prompt",
)
_DEFAULT_SYSTEM_RE: Final = re.compile(
    r"!=\s*'system'\s*%\}\s*\{\{\s*'<\|im_start\|>system(?:\\n|\n)(?P<text>.*?)<\|im_end\|>",
    re.DOTALL,
)


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


def _token_bytes(token: str, token_type: int) -> bytes:
    """The bytes a token stands for: byte-level decoded for normal tokens, UTF-8 otherwise."""
    if token_type != TOKEN_TYPE_NORMAL:
        return token.encode("utf-8")
    try:
        return token.translate(_TO_LATIN1).encode("latin-1")     # every character mapped
    except UnicodeEncodeError:
        return b"".join(
            bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode() for c in token
        )


@dataclass(frozen=True, slots=True)
class ChatMLTemplate:
    """ChatML prompt rendering, checked against a GGUF ``tokenizer.chat_template``.

    Attributes:
        default_system: system prompt the template inserts when the first message is not a
            system message (``None`` when the template has none).
    """

    default_system: str | None = None

    @classmethod
    def from_template(cls, template: str) -> ChatMLTemplate:
        """Check ``template`` is ChatML and read its default system prompt.

        Raises:
            ValueError: ``template`` is not a ChatML template.
        """
        missing = [m for m in _CHATML_MARKERS if m not in template]
        if missing:
            raise ValueError(
                f"chat template is not ChatML (lacks {missing}); only ChatML is implemented"
            )
        match = _DEFAULT_SYSTEM_RE.search(template)
        return cls(default_system=match.group("text").replace("\\n", "\n") if match else None)

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` (dicts with ``role`` and ``content``) as a ChatML prompt."""
        turns = [_chatml_turn(m.get("role"), m.get("content")) for m in messages]
        if turns and self.default_system is not None and messages[0].get("role") != "system":
            turns.insert(0, _chatml_turn("system", self.default_system))
        if add_generation_prompt:
            turns.append(f"{_IM_START}assistant\n")
        return "".join(turns)


def _chatml_turn(role: object, content: object) -> str:
    if not isinstance(role, str) or not isinstance(content, str):
        raise TypeError("each chat message needs a str 'role' and a str 'content'")
    return f"{_IM_START}{role}\n{content}{_IM_END}\n"


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


class Tokenizer:
    """Text <-> token ids for one GGUF model; build it with :func:`load_tokenizer`."""

    def __init__(
        self,
        *,
        backend: HFTokenizer,
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int],
        bos_id: int,
        eos_id: int,
        add_bos: bool,
        chat_template: ChatMLTemplate | None,
        chat_template_error: str = "",
    ) -> None:
        """Wrap a built backend; ``chat_template_error`` says why a template is missing."""
        self._backend = backend
        self._token_bytes = tuple(token_bytes)
        self._special_ids = special_ids
        self._bos_id, self._eos_id, self._add_bos = bos_id, eos_id, add_bos
        self._chat, self._chat_error = chat_template, chat_template_error

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence token id (``<|im_start|>`` for SmolLM2)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """End-of-sequence token id (``<|im_end|>`` for SmolLM2)."""
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self._token_bytes)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the control tokens (registered as special)."""
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text such as ``<|im_start|>`` maps to its id.

        A BOS id is prepended only when the GGUF says ``tokenizer.ggml.add_bos_token``.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return [self._bos_id, *ids] if self._add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut-off character) becomes U+FFFD."""
        id_list = list(ids)
        for token_id in id_list:
            _check_id(token_id, self.vocab_size)
        return str(self._backend.decode(id_list, skip_special_tokens=skip_special_tokens))

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
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat ``messages`` (``{"role": ..., "content": ...}``) as a ChatML prompt.

        Raises:
            ValueError: the GGUF has no ChatML template.
            TypeError: a message lacks a str ``role`` or ``content``.
        """
        if self._chat is None:
            raise ValueError(self._chat_error or "no chat template")
        return self._chat.render(messages, add_generation_prompt)


def load_tokenizer(model: LlamaGGUF) -> Tokenizer:
    """Build the tokenizer stored in ``model``'s GGUF metadata.

    Raises:
        GGUFModelError: the metadata holds no byte-level BPE tokenizer this module supports.
    """
    meta = model.metadata
    tokens, types = _vocab(meta, model.config.vocab_size)
    backend = _build_backend(tokens, _merges(meta), _splits_digits(meta))
    special_ids = _register_added_tokens(backend, tokens, types)
    chat_template, chat_error = _chat_template(meta)
    return Tokenizer(
        backend=backend,
        token_bytes=[_token_bytes(tok, kind) for tok, kind in zip(tokens, types)],
        special_ids=special_ids,
        bos_id=model.config.bos_id,
        eos_id=model.config.eos_id,
        add_bos=meta.get_bool("tokenizer.ggml.add_bos_token", False),
        chat_template=chat_template,
        chat_template_error=chat_error,
    )


def _vocab(meta: GGUFMetadata, vocab_size: int) -> tuple[list[str], list[int]]:
    kind = meta.get_str("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFModelError(
            f"tokenizer model {kind!r} is not supported; only 'gpt2' byte-level BPE is"
        )
    tokens = [str(t) for t in meta.get_list("tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get_list("tokenizer.ggml.token_type")]
    if not len(tokens) == len(types) == vocab_size:
        raise GGUFModelError(
            f"{len(tokens)} tokens, {len(types)} token types, vocab size {vocab_size}"
        )
    if len(set(tokens)) != len(tokens):
        raise GGUFModelError("the GGUF vocabulary holds duplicate tokens")
    return tokens, types


def _merges(meta: GGUFMetadata) -> list[tuple[str, str]]:
    pairs = [str(m).split(" ") for m in meta.get_list("tokenizer.ggml.merges")]
    bad = next((p for p in pairs if len(p) != 2), None)
    if bad is not None:
        raise GGUFModelError(f"malformed BPE merge {' '.join(bad)!r}")
    return [(a, b) for a, b in pairs]


def _splits_digits(meta: GGUFMetadata) -> bool:
    pre = meta.get_str("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS_DIGITS:
        raise GGUFModelError(
            f"pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_SPLITS_DIGITS)}"
        )
    return _PRE_SPLITS_DIGITS[pre]


def _build_backend(
    tokens: list[str], merges: list[tuple[str, str]], split_digits: bool
) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps = (
        [pre_tokenizers.Digits(individual_digits=True), byte_level]
        if split_digits
        else [byte_level]
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _register_added_tokens(
    backend: HFTokenizer, tokens: list[str], types: list[int]
) -> frozenset[int]:
    """Register control tokens as special and user-defined ones as plain added tokens."""
    special = [i for i, kind in enumerate(types) if kind == TOKEN_TYPE_CONTROL]
    user = [i for i, kind in enumerate(types) if kind == TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    for i in special + user:
        if backend.token_to_id(tokens[i]) != i:
            raise GGUFModelError(f"added token {tokens[i]!r} did not keep its id {i}")
    return frozenset(special)


def _chat_template(meta: GGUFMetadata) -> tuple[ChatMLTemplate | None, str]:
    """The model's ChatML template, or ``None`` and the reason there is none."""
    if "tokenizer.chat_template" not in meta:
        return None, "the GGUF has no tokenizer.chat_template"
    try:
        return ChatMLTemplate.from_template(meta.get_str("tokenizer.chat_template")), ""
    except ValueError as exc:
        return None, str(exc)
