"""SentencePiece-style tokenization the way llama.cpp does it (``tokenizer.ggml.model == "llama"``).

This module owns the merge algorithm of llama.cpp's ``llm_tokenizer_spm_session``
(``src/llama-vocab.cpp``), for the Gemma and Phi-3 vocabularies: the text, its spaces already
replaced by ``▁``, is split into UTF-8 characters; every adjacent pair whose concatenation is a
token is queued by that token's score (highest first, leftmost on ties); pairs are merged until
none is left; each final piece is its token, or, for a character the vocabulary lacks, one
``<0xNN>`` byte token per UTF-8 byte.

The ``tokenizers`` package is not used here: its SentencePiece models (``Unigram``, or ``BPE`` with
merges derived from scores as ``transformers`` converts them) choose pieces by a different rule
than llama.cpp's score-ordered bigram merges, and the ids would differ on some texts.

Pure functions of immutable data: a :class:`SentencePieceVocab` may be shared between threads.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Final

__all__ = ["SPACE_MARK", "SentencePieceVocab", "byte_token_text"]

SPACE_MARK: Final = "\u2581"
"""``▁``: how SentencePiece vocabularies write a space."""


def byte_token_text(byte: int) -> str:
    """The text of the byte-fallback token for ``byte`` (``<0x0A>``), as llama.cpp spells it."""
    return f"<0x{byte:02X}>"


class SentencePieceVocab:
    """Token texts and scores; :meth:`encode` turns escaped text into ids."""

    def __init__(self, ids: Mapping[str, int], scores: Sequence[float]) -> None:
        """``ids``: token text -> id (the last id wins for a repeated text, as in llama.cpp);
        ``scores``: one per id."""
        self._ids = dict(ids)
        self._scores = tuple(scores)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (spaces already escaped to ``▁``, prefix space already added).

        Raises:
            ValueError: a character is not in the vocabulary and one of its bytes has no
                ``<0xNN>`` token.
        """
        pieces = self._merge(list(text))
        return [i for piece in pieces for i in self._piece_ids(piece)]

    def _merge(self, symbols: list[str]) -> list[str]:
        """Merge adjacent symbols, best-scored bigram first, as a doubly linked list."""
        nxt = [*range(1, len(symbols)), -1]
        prev = list(range(-1, len(symbols) - 1))
        queue: list[tuple[float, int, int, int]] = []
        for i in range(1, len(symbols)):
            self._push(queue, symbols, i - 1, i)
        while queue:
            _, left, size, right = heapq.heappop(queue)
            # stale when either side has been merged since: its length changed or it is empty
            if not symbols[left] or not symbols[right] or (
                len(symbols[left]) + len(symbols[right]) != size
            ):
                continue
            symbols[left] += symbols[right]
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            self._push(queue, symbols, prev[left], left)
            self._push(queue, symbols, left, nxt[left])
        return [s for s in symbols if s]

    def _push(self, queue: list[tuple[float, int, int, int]], symbols: list[str], left: int,
              right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = symbols[left] + symbols[right]
        token = self._ids.get(merged)
        if token is not None:   # highest score first, then the leftmost pair
            heapq.heappush(queue, (-self._scores[token], left, len(merged), right))

    def _piece_ids(self, piece: str) -> list[int]:
        token = self._ids.get(piece)
        if token is not None:
            return [token]
        return [self._byte_id(b) for b in piece.encode("utf-8")]

    def _byte_id(self, byte: int) -> int:
        token = self._ids.get(byte_token_text(byte))
        if token is None:
            token = self._ids.get(chr(byte)) if byte < 0x80 else None
        if token is None:
            raise ValueError(
                f"the vocabulary has no token for byte 0x{byte:02X} (no {byte_token_text(byte)})"
            )
        return token
