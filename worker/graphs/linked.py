"""Linked runs (GRAPH_RUN_LINKED, and GRAPH_RUN_KEPT repeating a kept one) and the replies they
may hold back.

Owned by the backend thread. A linked run is one entry in its session's queue with its own
states::

    RECEIVING --(every hand-off landed)--> READY --(graph ran)--> RAN --(sends pushed)--> PUSHED
        |  one receive in flight at a time, in the order the request lists them
        +--(a receive failed)--> the run and everything queued behind it fail

While it receives, it holds its queue like a PEER_RECV. While its last receive waits, it checks
and encodes its sends and, when nothing stands in the way, writes its inputs (:class:`Prepared`),
so that the run starts as soon as the bytes land. Its reply may then be held back a little
(``hold_reply_us``, :class:`HeldReplies`): replies still leave in the order they were made.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ...broker import graph as g
from ...broker.errors import BadRequest
from ...broker.protocol import Cmd, ErrorCode, WireError
from ..backends.base import Backend
from ..peer.send import Push
from ..peer.transfers import PeerCommands
from ..sessions.quotas import Charged
from ..sessions.session import Later, Outcome, Reply, Request, Route, Session
from ..sessions.views import TrackedPayload, Views, overlap
from .commands import GraphCommands

MAX_HELD_BYTES = 64 * 1024
"""A linked run's reply is held back only when what it fetched is at most this big..."""
MAX_HELD_TOTAL = 16 << 20
"""...and while every held reply together stays under this (a flood of held runs from a client
that never waits must not pile up memory)."""


class Stage(enum.Enum):
    """Where a linked run is."""

    RECEIVING = "waiting for receives"
    READY = "ready"
    RAN = "ran"
    PUSHED = "pushed"


@dataclass(frozen=True)
class Prepared:
    """A linked run's work done while its last receive waited: its sends checked and encoded,
    and maybe its inputs written; stamped with the session's ``frees`` then (a freed buffer
    makes the pushes stale)."""

    frees: int
    pushes: list[Push]
    inputs_written: bool


@dataclass(eq=False)
class LinkedRun(Request):
    """A GRAPH_RUN_LINKED in its session's queue."""

    stage: Stage = Stage.RECEIVING
    received: int = 0
    """How many of its hand-offs have landed."""
    prepared: Prepared | None = None

    def __post_init__(self) -> None:
        if not self.link.receive:
            self.stage = Stage.READY

    @property
    def link(self) -> g.GraphRunLinked:
        return cast(g.GraphRunLinked, self.msg)

    def writes(self, session: Session) -> Sequence[int]:
        """Receiving: the next hand-off's destination buffer; then what the run writes."""
        if self.stage is Stage.RECEIVING:
            return [self.link.receive[self.received].dst.buffer]
        return list(self.route.writes(session, self.msg))

    def landed(self) -> bool:
        """One more hand-off arrived; never the end of the run (it still has to run)."""
        self.received += 1
        if self.received == len(self.link.receive):
            self.stage = Stage.READY
        return False

    def transfer_failed(self, error: str) -> str:
        written = " (its inputs were written while it waited)" if (
            self.prepared is not None and self.prepared.inputs_written) else ""
        return f"receiving the run's input failed: {error}{written}"

    @property
    def hold_us(self) -> int:
        return self.link.hold_reply_us


def unfold(session: Session, msg: g.GraphRunLinked | g.GraphRunKept) -> g.GraphRunLinked:
    """A GRAPH_RUN_KEPT as the linked run it repeats (BadRequest when nothing is kept under
    its id, or it does not fit what is); a GRAPH_RUN_LINKED as it is, kept first if it asks.
    Done as a request arrives, so that the kept runs change in the order the client sent."""
    if isinstance(msg, g.GraphRunLinked):
        if msg.keep >= 0:
            session.kept[msg.keep] = msg
        return msg
    kept = session.kept.get(msg.kept)
    if kept is None:
        raise BadRequest(f"no run kept under {msg.kept} in this session (GRAPH_RUN_LINKED's "
                         f"keep sets one)", code=ErrorCode.INVALID_HANDLE)
    return msg.repeat(kept)


class LinkedRuns:
    """The GRAPH_RUN_LINKED and GRAPH_RUN_KEPT handler: moves a run on by one state each time
    it is called (a kept run arrives unfolded: :func:`unfold`)."""

    def __init__(self, backend: Backend, views: Views, graphs: GraphCommands,
                 transfers: PeerCommands) -> None:
        self.backend = backend
        self.views = views
        self.graphs = graphs
        self.transfers = transfers

    def routes(self) -> dict[Cmd, Route]:
        """This module's part of the executor's dispatch table."""
        route = Route(
            self.step, writes=GraphCommands.run_writes, entry=LinkedRun,
            queued=lambda s, m: self.transfers.announce(s, [r.token for r in m.receive]))
        return {Cmd.GRAPH_RUN_LINKED: route, Cmd.GRAPH_RUN_KEPT: route}

    def step(self, session: Session, msg: g.GraphRunLinked, req: Request) -> Outcome:
        """Start the next receive (the run stays at the head of its queue), or run."""
        run = cast(LinkedRun, req)
        if run.stage is Stage.RECEIVING:
            self._receive(session, run)
            return Later.HOLD
        return self._run(session, run)

    def _receive(self, session: Session, run: LinkedRun) -> None:
        hand_off = run.link.receive[run.received]
        sources = run.link.receive_from
        source = sources[run.received] if run.received < len(sources) else ""
        try:
            self.transfers.receive(session, run, hand_off.token, hand_off.dst, run.link.timeout_ms,
                                   source)
        except WireError as exc:
            raise WireError(exc.code, f"receiving the run's input failed: {exc.message}") from None
        if run.in_flight and run.received == len(run.link.receive) - 1:
            self._prepare(session, run)

    def _run(self, session: Session, run: LinkedRun) -> Reply:
        """Every hand-off has landed: run, push the sends, read what the client fetches."""
        msg = run.link
        graph = self.graphs.graph(session, msg.handle)
        prepared = run.prepared
        fresh = prepared is not None and prepared.frees == session.frees
        pushes = prepared.pushes if prepared is not None and fresh else self._pushes(session, msg)
        written = prepared is not None and prepared.inputs_written

        def push_all() -> None:          # before reading the fetch: a peer waits on these
            run.stage = Stage.RAN
            for push in pushes:
                self.transfers.push(push)
            run.stage = Stage.PUSHED

        return self.graphs.execute(session, graph, msg, () if written else run.payload,
                                   then=push_all)

    def _prepare(self, session: Session, run: LinkedRun) -> None:
        """While the last receive waits, check and encode the sends, so that the run starts as
        soon as the bytes land (a failure here is reported by the run itself)."""
        msg = run.link
        try:
            self.graphs.graph(session, msg.handle)
            pushes = self._pushes(session, msg)
            written = self._write_inputs_early(session, msg, run.payload)
        except Exception:  # noqa: BLE001 - the run itself meets and reports it
            return
        run.prepared = Prepared(session.frees, pushes, written)

    def _write_inputs_early(self, session: Session, msg: g.GraphRunLinked,
                            payload: Sequence[Any]) -> bool:
        """Write a waiting run's inputs now, unless a receive lands on one of them (it must
        come first) or a zero-copy send still reads their buffers."""
        for ref in msg.inputs:
            if any(overlap(ref, r.dst) for r in msg.receive):
                return False
            buf = session.buffers.get(ref.buffer)
            if buf is None or buf.busy():
                return False
        views = [self.views.view(session, ref) for ref in msg.inputs]
        for view, frame in zip(views, payload):
            self.backend.write(view, frame)
        return True

    def _pushes(self, session: Session, msg: g.GraphRunLinked) -> list[Push]:
        return [self.transfers.prepare_push(session, send) for send in msg.send]


# ------------------------------------------------------------------------- held replies


@dataclass(frozen=True)
class HeldReply:
    """A successful reply waiting until ``due`` (its payload copied out of the buffers)."""

    due: float
    client_id: bytes
    req_id: int
    reply: Reply
    nbytes: int


class HeldReplies:
    """Replies that asked to wait (``hold_reply_us``), oldest first, bounded in bytes."""

    def __init__(self) -> None:
        self.queue: deque[HeldReply] = deque()
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.queue)

    def hold(self, client_id: bytes, req_id: int, reply: Reply, hold_us: int) -> bool:
        """Keep ``reply`` back for ``hold_us`` when what it carries is small (copied now: later
        requests may write those buffers before it leaves); False when it must go now."""
        if any(isinstance(f, Charged) for f in reply[1]):
            return False                  # materialized: sent now, counted until sent
        frames: list[Any] = [f.data if isinstance(f, TrackedPayload) else f for f in reply[1]]
        size = sum(len(f) for f in frames)
        if size > MAX_HELD_BYTES or self.nbytes + size > MAX_HELD_TOTAL:
            return False
        copied: list[Any] = [bytes(f) for f in frames]
        self.queue.append(HeldReply(time.monotonic() + hold_us / 1e6, client_id, req_id,
                                    (reply[0], copied), size))
        self.nbytes += size
        return True

    def due(self, now: float | None) -> Iterator[HeldReply]:
        """Take the replies that are due (all of them when ``now`` is None), in order: a later
        one waits behind an earlier one."""
        while self.queue and (now is None or self.queue[0].due <= now):
            held = self.queue.popleft()
            self.nbytes -= held.nbytes
            yield held

    def next_release(self) -> float | None:
        """When the oldest held reply is due (None if nothing is held)."""
        return self.queue[0].due if self.queue else None
