"""Chunks that reach a worker before their receive has started: kept a while, bounded, per sender.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer_links.PeerLinks`). A sender
may push before the destination's receive reaches the head of its queue; those chunks wait here
until the receive claims them, or for ``STASH_TTL``. Tokens a session has announced (it queued
their receive) are bounded only by bytes; the others are stashed per sender (the connection's
CURVE key, or its IP address without CURVE), so one sender filling its share drops only its own
chunks, never another's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from ..broker import peer as wire
from ..broker.wire import printable

log = logging.getLogger("zmq_rpc.worker.peer")

STASH_TTL = 30.0
MAX_STASHED_TRANSFERS = 4096
MAX_STASHED_PER_SENDER = 1024
"""Early transfers one sender may have stashed before any session announced them (a client with
512 copies in flight can have that many chunks arrive ahead of their receives when the
destination's request queue is backed up; 1,100 made-up ones from one address once denied every
legitimate copy: now they only push out that sender's oldest)."""


@dataclass
class Stashed:
    """Chunks that arrived before their PEER_RECV reached the head of its queue."""

    messages: list[tuple[wire.Chunk, zmq.Frame]] = field(default_factory=list)
    nbytes: int = 0
    expires: float = 0.0
    sender: str = ""
    announced: bool = False
    """A session queued a receive for it: never evicted for other senders' chunks."""


class Stash:
    """Early chunks by transfer token, in expiry order (expiring pops from the front)."""

    def __init__(self, limit: int) -> None:
        self.entries: dict[bytes, Stashed] = {}
        self.nbytes = 0
        self.limit = limit
        """Most bytes kept in all."""
        self.by_sender: dict[str, dict[bytes, None]] = {}
        """Each sender's unannounced stashed tokens, oldest first."""
        self.announced: dict[bytes, object] = {}
        """Tokens of receives queued in a session (their owner) and not started yet."""
        self.aborted: dict[bytes, str] = {}
        """Announced tokens whose transfer failed before its receive started, and why: the
        receive fails as soon as it starts instead of waiting for its deadline. A subset of
        ``announced`` (bounded by the sessions' queue quotas), forgotten with it."""
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.entries)

    def next_expiry(self) -> float | None:
        """When the oldest entry expires (None when empty)."""
        return next(iter(self.entries.values())).expires if self.entries else None

    def announce(self, owner: object, token: bytes) -> None:
        """``owner`` queued a receive of ``token``: its chunks are kept apart from unannounced
        ones (never evicted for another sender's)."""
        if token in self.announced:
            return
        self.announced[token] = owner
        entry = self.entries.get(token)
        if entry is not None and not entry.announced:
            self._forget(entry.sender, token)
            entry.announced = True

    def claim(self, owner: object, token: bytes) -> tuple[Stashed | None, str | None]:
        """``owner``'s receive of ``token`` starts: what came early is handed over, or why the
        transfer already failed (:meth:`abort`)."""
        if self.announced.get(token) is owner:
            del self.announced[token]
            why = self.aborted.pop(token, None)
            if why is not None:
                return self._unstash(token), why
        return self._unstash(token), None

    def abort(self, owner: object, token: bytes, why: str) -> bool:
        """``owner``'s transfer ``token`` failed before its receive started (its sender or the
        relaying client failed): remember why until the receive starts, and drop its early
        chunks. False when ``owner`` announced no such receive (nothing is kept)."""
        if self.announced.get(token) is not owner:
            return False
        self.aborted.setdefault(token, why)
        self._unstash(token)
        return True

    def keep(self, chunk: wire.Chunk, frame: zmq.Frame, sender: str) -> None:
        """Keep a chunk whose receive has not started yet. Chunks of announced transfers are
        bounded only by bytes. Others are kept at most MAX_STASHED_PER_SENDER transfers per
        sender, a sender's oldest making room for its newest, and MAX_STASHED_TRANSFERS in all,
        the heaviest sender's oldest making room: made-up chunks never evict announced ones,
        nor another sender's while that sender stashes less."""
        if chunk.token in self.aborted:
            return                        # its receive fails when it starts: nothing to keep
        entry = self.entries.pop(chunk.token, None)
        if entry is not None and entry.sender != sender:
            self.entries[chunk.token] = entry
            self._drop(sender, "a token another sender stashed")
            return
        if self.nbytes + len(frame) > self.limit:
            if entry is not None:
                self.entries[chunk.token] = entry
            self._drop(sender, "stash bytes full")
            owner = self.announced.get(chunk.token)
            if owner is not None:         # that transfer cannot complete: say so at its start
                self.abort(owner, chunk.token, f"a chunk arrived before the receive started "
                           f"and the early-chunk stash was full ({self.limit} bytes)")
            return
        if entry is None:
            entry = self._new_entry(chunk.token, sender)
            if entry is None:
                return
        entry.messages.append((chunk, frame))
        entry.nbytes += len(frame)
        entry.expires = time.monotonic() + STASH_TTL
        self.entries[chunk.token] = entry
        self.nbytes += len(frame)

    def expire(self, now: float) -> None:
        """Forget entries past their time."""
        while self.entries:
            token, entry = next(iter(self.entries.items()))
            if now < entry.expires:
                break
            self._unstash(token)

    def forget(self, owner: object) -> None:
        """A session closed: its announced tokens, and what came for them, go."""
        for token in [t for t, by in self.announced.items() if by is owner]:
            del self.announced[token]
            self.aborted.pop(token, None)
            self._unstash(token)

    def _new_entry(self, token: bytes, sender: str) -> Stashed | None:
        announced = token in self.announced
        if not announced and not self._make_room(sender):
            self._drop(sender, "stash full")
            return None
        if not announced:
            self.by_sender.setdefault(sender, {})[token] = None
        return Stashed(sender=sender, announced=announced)

    def _make_room(self, sender: str) -> bool:
        """Room for one more unannounced transfer from ``sender``: evicts its own oldest when
        it has its share, else the heaviest sender's oldest when the stash is full."""
        mine = self.by_sender.get(sender, {})
        victim = sender if len(mine) >= MAX_STASHED_PER_SENDER else None
        if victim is None and len(self.entries) >= MAX_STASHED_TRANSFERS:
            victim = max(self.by_sender, key=lambda s: len(self.by_sender[s]), default=None)
        if victim is None:
            return len(self.entries) < MAX_STASHED_TRANSFERS
        self._unstash(next(iter(self.by_sender[victim])))
        self._drop(victim, "its oldest early transfer evicted")
        return True

    def _forget(self, sender: str, token: bytes) -> None:
        tokens = self.by_sender.get(sender)
        if tokens is not None:
            tokens.pop(token, None)
            if not tokens:
                del self.by_sender[sender]

    def _unstash(self, token: bytes) -> Stashed | None:
        entry = self.entries.pop(token, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            if not entry.announced:
                self._forget(entry.sender, token)
        return entry

    def _drop(self, sender: str, why: str) -> None:
        self.dropped += 1
        if self.dropped in (1, 10, 100, 1000) or self.dropped % 10000 == 0:
            log.warning("dropped %d chunk(s) for unknown transfers (last from %s: %s)",
                        self.dropped, printable(sender, 64), why)
