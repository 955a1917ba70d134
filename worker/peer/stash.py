"""Chunks that reach a worker before their receive has started: kept a while, bounded, per sender.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer.links.PeerLinks`). A sender
may push before the destination's receive reaches the head of its queue; those chunks wait here
until the receive claims them, or for ``STASH_TTL``. Every stashed byte is counted against the
worker's ``--mem`` (the :class:`~zmq_rpc.worker.sessions.memory.MemoryBudget` handed to
:meth:`Stash.use_budget`) until it is claimed, expires or is evicted.

Two kinds of early chunks, kept apart:

- **announced** (a session queued their receive): bounded by ``--mem`` only. They are never
  evicted for anything else; when ``--mem`` has no room for one, unannounced chunks are evicted
  to make it (heaviest sender first). Only when that is not enough is the transfer failed, and
  then both ends hear it at once (its receive as it starts, its sender by acknowledgement);
- **unannounced** (nobody here waits for them yet: a real sender ahead of its receive, or made-up
  chunks), per sender (the connection's CURVE key, or its IP address without CURVE): at most
  ``limit`` bytes and MAX_STASHED_TRANSFERS transfers in all, MAX_STASHED_PER_SENDER transfers
  per sender. When full, the *heaviest* sender (by bytes, or by transfers) loses its oldest
  chunks first, so each of N senders keeps at least ``limit / N`` bytes: a flood only displaces
  its own sender's chunks while any other sender stashes less. Sessions needing memory shed
  them first (:meth:`Stash.shed`): garbage never keeps a session from its ``--mem``.

An unannounced transfer that loses a chunk here (dropped for want of room, evicted, expired) can
never complete: its token is remembered (the last MAX_LOST_EARLY), and a receive announced for it
later fails as it starts, saying why, instead of waiting for the transfer deadline (48 s: a
pipeline's hand-off that reached a worker whose ``--mem`` was full before its run was queued).
So is a session's call-off of a token it has not queued the receive of yet (the last
MAX_LOST_EARLY, for that session only): a client calls off the receives of a failed run's
hand-offs at once, and may then issue a run that receives one of them (a chained step launched
after the one that failed: kill -9 and a restart at the same address of a pipeline's middle
worker made its first stage wait 48 s for the carried token).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from ...broker import peer as wire
from ...broker.wire import printable

log = logging.getLogger("zmq_rpc.worker.peer")

STASH_TTL = 30.0
MAX_STASHED_TRANSFERS = 4096
MAX_STASHED_PER_SENDER = 1024
"""Early transfers one sender may have stashed before any session announced them (a client with
512 copies in flight can have that many chunks arrive ahead of their receives when the
destination's request queue is backed up; 1,100 made-up ones from one address once denied every
legitimate copy: now they only push out that sender's oldest)."""
MAX_LOST_EARLY = MAX_STASHED_TRANSFERS
"""Unannounced transfers whose early chunks were lost, remembered so that their receives fail
at once; past that the oldest is forgotten (its receive then waits for its deadline, as before)."""


class Budget(Protocol):
    """What the stash needs of :class:`~zmq_rpc.worker.sessions.memory.MemoryBudget`."""

    def free(self) -> int: ...

    def reserve(self, size: int, what: str) -> None: ...

    def release(self, size: int) -> None: ...


class Unbounded:
    """No ``--mem`` to count against (a stash on its own, in a unit test)."""

    def free(self) -> int:
        return 1 << 62

    def reserve(self, size: int, what: str) -> None:
        """Nothing to count."""

    def release(self, size: int) -> None:
        """Nothing to give back."""


@dataclass
class Stashed:
    """Chunks that arrived before their PEER_RECV reached the head of its queue."""

    messages: list[tuple[wire.Chunk, zmq.Frame]] = field(default_factory=list)
    nbytes: int = 0
    expires: float = 0.0
    sender: str = ""
    announced: bool = False
    """A session queued a receive for it: never evicted for other senders' chunks."""


@dataclass(frozen=True)
class Aborted:
    """Why an announced transfer failed before its receive started, and where its sender waits
    for the acknowledgement ("" when unknown)."""

    why: str
    reply_to: str = ""


class Stash:
    """Early chunks by transfer token, in expiry order (expiring pops from the front)."""

    def __init__(self, limit: int) -> None:
        self.entries: dict[bytes, Stashed] = {}
        self.nbytes = 0
        """Bytes kept in all (announced and not), each counted against ``--mem``."""
        self.limit = limit
        """Most bytes of unannounced chunks kept in all."""
        self.budget: Budget = Unbounded()
        self.by_sender: dict[str, dict[bytes, None]] = {}
        """Each sender's unannounced stashed tokens, oldest first."""
        self.sender_bytes: dict[str, int] = {}
        """Each sender's unannounced stashed bytes."""
        self.unannounced_bytes = 0
        self.announced: dict[bytes, object] = {}
        """Tokens of receives queued in a session (their owner) and not started yet."""
        self.aborted: dict[bytes, Aborted] = {}
        """Announced tokens whose transfer failed before its receive started, and why: the
        receive fails as soon as it starts instead of waiting for its deadline. A subset of
        ``announced`` (bounded by the sessions' queue quotas), forgotten with it."""
        self.lost_early: dict[bytes, Aborted] = {}
        """Unannounced tokens whose early chunks were lost, and why, oldest first (module
        docstring): :meth:`announce` turns one into an abort."""
        self.called_off: dict[bytes, tuple[object, Aborted]] = {}
        """Unannounced tokens a session called off, with that session and why, oldest first,
        the last MAX_LOST_EARLY (module docstring): that session's :meth:`announce` of one
        turns it into an abort."""
        self.dropped = 0

    def use_budget(self, budget: Budget) -> None:
        """Count what is stashed against ``budget`` (the worker's ``--mem``) from now on."""
        budget.reserve(self.nbytes, "the early-chunk stash")
        self.budget = budget

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
        early = self.called_off.pop(token, None)
        if early is not None and early[0] is owner:
            self.aborted[token] = early[1]
            return
        lost = self.lost_early.pop(token, None)
        if lost is not None:
            self.aborted[token] = Aborted(
                f"its chunks began to arrive before the receive was queued and one was lost "
                f"({lost.why})", lost.reply_to)
            return
        entry = self.entries.get(token)
        if entry is not None and not entry.announced:
            self._forget(entry.sender, token, entry.nbytes)
            entry.announced = True

    def claim(self, owner: object, token: bytes) -> tuple[Stashed | None, Aborted | None]:
        """``owner``'s receive of ``token`` starts: what came early is handed over, or why the
        transfer already failed (:meth:`abort`)."""
        if self.announced.get(token) is owner:
            del self.announced[token]
            why = self.aborted.pop(token, None)
            if why is not None:
                return self._unstash(token), why
        return self._unstash(token), None

    def abort(self, owner: object, token: bytes, why: str, reply_to: str = "") -> bool:
        """``owner``'s transfer ``token`` failed before its receive started (its sender or the
        relaying client failed): remember why until the receive starts, and drop its early
        chunks. False when ``owner`` announced no such receive: when nobody did, the call-off
        is remembered for ``owner`` (the client called off a hand-off whose sender failed
        before it queued the receive), else nothing is kept (another session's token)."""
        if self.announced.get(token) is not owner:
            if token not in self.announced:
                self._unstash(token)
                self.called_off.pop(token, None)
                self.called_off[token] = (owner, Aborted(why, reply_to))
                if len(self.called_off) > MAX_LOST_EARLY:
                    del self.called_off[next(iter(self.called_off))]
            return False
        self.aborted.setdefault(token, Aborted(why, reply_to))
        self._unstash(token)
        return True

    def keep(self, chunk: wire.Chunk, frame: zmq.Frame, sender: str) -> None:
        """Keep a chunk whose receive has not started yet (see the module docstring for what
        is kept and what makes room)."""
        if chunk.token in self.aborted or chunk.token in self.lost_early or \
                chunk.token in self.called_off:
            return                        # its receive fails when it starts: nothing to keep
        entry = self.entries.get(chunk.token)
        if entry is not None and entry.sender != sender:
            self._drop(sender, "a token another sender stashed")
            return
        size = len(frame)
        if chunk.token in self.announced:
            self._keep_announced(chunk, frame, sender, size)
        elif (why := self._room_unannounced(sender, size, entry is None)) is None:
            self._add(chunk, frame, sender, size)
        else:
            self._lose(chunk.token, why, chunk.reply_to)

    def _keep_announced(self, chunk: wire.Chunk, frame: zmq.Frame, sender: str,
                        size: int) -> None:
        while size > self.budget.free() and self._evict_heaviest(by_bytes=True):
            pass
        if size <= self.budget.free():
            self._add(chunk, frame, sender, size)
            return
        self._drop(sender, "no room in --mem for an announced transfer's early chunk")
        self.abort(self.announced[chunk.token], chunk.token,
                   f"a chunk arrived before the receive started and the worker's memory "
                   f"(--mem) had no room left to keep it ({self.budget.free()} bytes free, "
                   f"{self.nbytes} held by early chunks)", chunk.reply_to)

    def _room_unannounced(self, sender: str, size: int, new: bool) -> str | None:
        """Make room for ``size`` more unannounced bytes from ``sender`` (a new transfer when
        ``new``): its own oldest go first when it is the heaviest, else the heaviest's. None
        when there is room, else why not (the chunk is dropped)."""
        why = self._no_room_unannounced(sender, size, new)
        if why is not None:
            self._drop(sender, why)
        return why

    def _no_room_unannounced(self, sender: str, size: int, new: bool) -> str | None:
        if size > self.limit:
            return "a chunk larger than the stash"
        while self.unannounced_bytes + size > self.limit:
            if not self._evict_heaviest(by_bytes=True, joining=(sender, size)):
                return "its sender's share of the early-chunk stash is full"
        if new:
            mine = self.by_sender.get(sender, {})
            if len(mine) >= MAX_STASHED_PER_SENDER:
                self._evict(sender)
            elif len(self.entries) >= MAX_STASHED_TRANSFERS:
                if not self._evict_heaviest(by_bytes=False, joining=(sender, 1)):
                    return "the early-chunk stash is full"
        if size > self.budget.free():      # sessions hold --mem: early chunks wait their turn
            return f"the worker's --mem had no room to keep it: {self.budget.free()} bytes free"
        return None

    def _lose(self, token: bytes, why: str, reply_to: str) -> None:
        """An unannounced transfer lost a chunk: what came of it goes, and its receive, if one
        is ever announced, fails at once (module docstring)."""
        self._unstash(token)
        self.lost_early.pop(token, None)
        self.lost_early[token] = Aborted(why, reply_to)
        if len(self.lost_early) > MAX_LOST_EARLY:
            del self.lost_early[next(iter(self.lost_early))]

    def _add(self, chunk: wire.Chunk, frame: zmq.Frame, sender: str, size: int) -> None:
        entry = self.entries.pop(chunk.token, None)
        if entry is None:
            entry = Stashed(sender=sender, announced=chunk.token in self.announced)
            if not entry.announced:
                self.by_sender.setdefault(sender, {})[chunk.token] = None
        self.budget.reserve(size, "an early chunk")
        entry.messages.append((chunk, frame))
        entry.nbytes += size
        entry.expires = time.monotonic() + STASH_TTL
        self.entries[chunk.token] = entry
        self.nbytes += size
        if not entry.announced:
            self.sender_bytes[sender] = self.sender_bytes.get(sender, 0) + size
            self.unannounced_bytes += size

    def shed(self) -> bool:
        """Memory is short for a session: evict every unannounced chunk. True if any went."""
        if not self.by_sender:
            return False
        while self._evict_heaviest(by_bytes=True):
            pass
        return True

    def expire(self, now: float) -> None:
        """Forget entries past their time."""
        while self.entries:
            token, entry = next(iter(self.entries.items()))
            if now < entry.expires:
                break
            if entry.announced:
                self._unstash(token)
            else:
                self._lose(token, f"kept {STASH_TTL:g} s with no receive for it",
                           entry.messages[0][0].reply_to if entry.messages else "")

    def forget(self, owner: object) -> None:
        """A session closed: its announced tokens, what came for them, and its call-offs go."""
        for token in [t for t, by in self.announced.items() if by is owner]:
            del self.announced[token]
            self.aborted.pop(token, None)
            self._unstash(token)
        for token in [t for t, (by, _) in self.called_off.items() if by is owner]:
            del self.called_off[token]

    def _evict_heaviest(self, by_bytes: bool, joining: tuple[str, int] | None = None) -> bool:
        """Evict the oldest unannounced transfer of the sender stashing the most (bytes, or
        transfers), counting ``joining``'s (sender, amount) as already added: a sender is
        never evicted for a lighter one. False when nothing unannounced is stashed."""
        def weight(sender: str) -> int:
            have = self.sender_bytes.get(sender, 0) if by_bytes else \
                len(self.by_sender.get(sender, ()))
            return have + (joining[1] if joining and joining[0] == sender else 0)

        candidates = set(self.by_sender) | ({joining[0]} if joining else set())
        victim = max(candidates, key=weight, default=None)
        if victim is None or victim not in self.by_sender:
            return False
        self._evict(victim)
        return True

    def _evict(self, sender: str) -> None:
        token = next(iter(self.by_sender[sender]))
        entry = self._unstash(token)
        reply_to = entry.messages[0][0].reply_to if entry and entry.messages else ""
        self._lose(token, "evicted from the early-chunk stash: its sender held the most there",
                   reply_to)
        self._drop(sender, "its oldest early transfer evicted")

    def _forget(self, sender: str, token: bytes, nbytes: int) -> None:
        tokens = self.by_sender.get(sender)
        if tokens is not None and token in tokens:
            del tokens[token]
            self.unannounced_bytes -= nbytes
            self.sender_bytes[sender] -= nbytes
            if not tokens:
                del self.by_sender[sender]
                del self.sender_bytes[sender]

    def _unstash(self, token: bytes) -> Stashed | None:
        entry = self.entries.pop(token, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self.budget.release(entry.nbytes)
            if not entry.announced:
                self._forget(entry.sender, token, entry.nbytes)
        return entry

    def _drop(self, sender: str, why: str) -> None:
        self.dropped += 1
        if self.dropped in (1, 10, 100, 1000) or self.dropped % 10000 == 0:
            log.warning("dropped %d chunk(s) for unknown transfers (last from %s: %s)",
                        self.dropped, printable(sender, 64), why)
