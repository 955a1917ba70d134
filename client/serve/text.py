"""A generated sequence's text: tokens decoded as they come, stop strings cut off.

Runs on the engine thread (:mod:`.engine`), one :class:`TextStream` per sequence: no shared state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["StopText", "TextStream"]


class Decoder(Protocol):
    """What :meth:`zmq_rpc.client.tokenizer.Tokenizer.stream_decoder` returns."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class StopText:
    """Cuts text at the first of ``stops``; text that may be the start of a stop string is held
    back until the next piece shows whether it is one, so a partial stop string never goes
    out."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that can go out now (ends the sequence at a stop string: :attr:`stopped`)."""
        if self.stopped:
            return ""
        text = self.held + text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = self._partial(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def _partial(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def flush(self) -> str:
        """The end of the sequence: what was held back was no stop string after all."""
        held, self.held = self.held, ""
        return "" if self.stopped else held


class TextStream:
    """Token ids in, text deltas out: a :class:`Decoder` (whole UTF-8 characters only, special
    tokens skipped) feeding a :class:`StopText`."""

    def __init__(self, decoder: Decoder, stops: Sequence[str]) -> None:
        self.decoder = decoder
        self.stop = StopText(stops)

    def push(self, token_id: int) -> str:
        return self.stop.push(self.decoder.push(token_id))

    @property
    def stopped(self) -> bool:
        """A stop string was seen: the sequence ends here."""
        return self.stop.stopped

    def flush(self) -> str:
        return self.stop.push(self.decoder.flush()) + self.stop.flush()
