"""Sends and probes waiting for a peer's acknowledgement, on the backend thread: outcomes and faults.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer.links.PeerLinks`). No sockets:
what it needs of the links comes as callables (whether a link dropped its connection, drop a link,
trust an endpoint that answered a probe). Each wait ends exactly once, through its ``done``: the
peer's acknowledgement (ok or refused), its deadline, or a deadline cut to
:data:`PEER_GONE_GRACE_S` once the peer's connection dropped; a closing session's waits end
silently (:meth:`AwaitedAcks.forget`: the executor answers their requests itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...broker import peer as wire
from ..observe.metrics import NullRecorder, Recorder

PEER_GONE_GRACE_S = 1.0
"""After a peer's connection drops, how long its acknowledgements may still arrive (they come
back on the peer's own link, so a dropped connection alone does not prove the copy failed)."""
WATCH_INTERVAL_S = 0.05
"""How often the links with transfers waiting for an acknowledgement are checked for drops."""

Done = Callable[[str | None], None]
"""Told once how a transfer ended: None when it succeeded, else what went wrong (a
:class:`LinkLost` when the peer link it needed was lost)."""


class LinkLost(str):
    """Why a transfer failed, when it is the loss of the peer link it needed: the executor
    answers it with PEER_UNREACHABLE (the client's ``PeerUnreachable``), not TRANSFER_FAILED."""


def link_lost(me: str, peer: str, after: float, what: str) -> LinkLost:
    """The failure of a transfer whose link from worker ``me`` to worker ``peer`` was lost,
    ``after`` seconds into it: names both ends of the link (docs/FAILURES.md)."""
    return LinkLost(f"worker {me or '(no peer endpoint)'} cannot reach worker {peer}: peer "
                    f"link lost after {after:.1f} s ({what}; the link went down: unanswered "
                    "keepalive or unacknowledged data, or no connection: the network between the two workers failed, or "
                    "that worker stopped)")


@dataclass
class Outgoing:
    """A PEER_SEND or PEER_PROBE waiting for the peer's acknowledgement."""

    owner: object
    done: Done
    endpoint: str
    deadline: float
    what: str
    probe: bool = False
    gone: bool = False
    """The peer's connection dropped while this waited: the deadline was cut to the grace."""
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class LinkHooks:
    """What the waits need of the PUSH links, as callables (the links stay socket owners)."""

    disconnected: Callable[[str], bool]
    """Whether the link to an endpoint dropped its connection since the last look."""
    drop: Callable[[str], None]
    """Close the link to an endpoint (its peer failed us)."""
    verify: Callable[[str], None]
    """An endpoint answered a probe: it may be pushed to."""
    lost_for: Callable[[str, float], float | None] = lambda endpoint, since: None
    """How long the link to an endpoint has been lost (counted from a moment), None if not:
    catches a link that never connected, which drops nothing."""


class AwaitedAcks:
    """The backend thread's sends and probes in flight, by transfer token."""

    def __init__(self, links: LinkHooks, me: str = "") -> None:
        self.links = links
        self.me = me
        """This worker's peer endpoint (named in link-loss errors)."""
        self.pending: dict[bytes, Outgoing] = {}
        self.metrics: Recorder = NullRecorder()
        self._next_watch = 0.0

    def __len__(self) -> int:
        return len(self.pending)

    def wait(self, token: bytes, out: Outgoing) -> None:
        """Wait for ``token``'s acknowledgement (drops of its link before now are forgotten)."""
        self.links.disconnected(out.endpoint)
        self.pending[token] = out

    def cancel(self, token: bytes) -> None:
        """Stop waiting without an outcome (its send failed: the caller reports that)."""
        self.pending.pop(token, None)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a wait, None when nothing waits."""
        return min((out.deadline for out in self.pending.values()), default=None)

    def on_ack(self, ack: wire.Ack) -> None:
        """A peer answered: end the wait on its token (unknown tokens are ignored: late)."""
        out = self.pending.pop(ack.token, None)
        if out is None:
            return
        if ack.ok and out.probe:
            self.links.verify(out.endpoint)
        if not out.probe:
            self.metrics.transfer("out", ack.ok)
        out.done(None if ack.ok else f"{out.what} refused by the peer: {ack.message}")

    def expire(self, now: float) -> None:
        """Fail the waits past their deadline (watching links for drops every so often)."""
        if self.pending and now >= self._next_watch:
            self._watch(now)
        for token, out in list(self.pending.items()):
            if now >= out.deadline:
                del self.pending[token]
                self._fail(out, now)

    def forget(self, owner: object) -> None:
        """Drop a closing session's waits without calling their ``done``."""
        for token in [t for t, out in self.pending.items() if out.owner is owner]:
            del self.pending[token]

    def _watch(self, now: float) -> None:
        """Cut the wait of transfers whose peer's connection dropped (its worker died or
        stopped: its acknowledgement will not come) to :data:`PEER_GONE_GRACE_S`."""
        self._next_watch = now + WATCH_INTERVAL_S
        gone = {ep for ep in {out.endpoint for out in self.pending.values()}
                if self.links.disconnected(ep)}
        for out in self.pending.values():
            if out.gone:
                continue
            if out.endpoint in gone:
                out.gone = True
                out.deadline = min(out.deadline, now + PEER_GONE_GRACE_S)
            elif not out.probe and self.links.lost_for(out.endpoint, out.started) is not None:
                out.gone = True          # never connected: nothing more to wait for
                out.deadline = now

    def _fail(self, out: Outgoing, now: float) -> None:
        if not out.probe:
            self.metrics.transfer("out", False)
        self.links.drop(out.endpoint)
        if out.gone:
            out.done(link_lost(self.me, out.endpoint, now - out.started,
                               f"{out.what}: no acknowledgement came"))
            return
        out.done(f"{out.what}: no acknowledgement within the timeout (peer unreachable, "
                 "dead or too slow)")
