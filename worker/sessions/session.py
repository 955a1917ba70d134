"""A client's session on a worker: its buffers, graphs and request queue, and the requests in it.

Owned by the backend thread, like everything a session holds: no other thread reads or writes
any of it. A session and its requests refer to each other (a session queues requests, a request's
handler runs on a session), so both live here; checked views of the buffers are :mod:`.views`.

The executor's dispatch vocabulary: the executor keeps one table, ``Cmd -> Route``: the route
names the handler, the buffers the request writes (it waits while a zero-copy send still reads
them), how it is admitted (opens a session, runs at once, or waits its turn in the session's
queue), and what a queue entry of that command is (:class:`Request`, or a linked run with its
own states). A handler is called with the session, the decoded message and the request, and
returns the reply to send now, or a :class:`Later` saying who answers instead.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ...broker import graph as g
from ...broker import protocol as p
from ...broker.ops import DEFAULT_MAX_WORK
from ...broker.protocol import Cmd, TensorRef
from ...broker.request_mac import Verifier
from ..backends.base import Memory, View
from .quotas import Usage

if TYPE_CHECKING:
    from ..graphs.execute import CompiledGraph



@dataclass(frozen=True)
class WorkerLimits:
    """What the worker may hand out, and how long a silent session lives."""

    memory_limit: int
    max_buffer_size: int
    max_message_size: int
    session_timeout: float
    max_graph_work: int = DEFAULT_MAX_WORK
    """Element-ops one graph run may ask for (see :func:`~zmq_rpc.broker.ops.node_work`)."""
    session_memory: int = 0
    """Bytes one session may hold (0: the memory limit); see :mod:`~zmq_rpc.worker.sessions.quotas`."""
    max_sessions: int = 64
    """Sessions open at once; the HELLO of one more is refused (see :mod:`~zmq_rpc.worker.sessions.quotas`)."""
    identity_memory: int = 0
    """Bytes all sessions of one client identity may hold (0: 3/4 of the memory limit)."""
    identity_sessions: int = 0
    """Sessions one client identity may hold (0: 3/4 of ``max_sessions``); see
    :mod:`~zmq_rpc.worker.sessions.identities`."""


@dataclass
class Buffer:
    """One allocation: its memory and the zero-copy sends that still read from it."""

    handle: int
    size: int
    memory: Memory
    sending: list[zmq.MessageTracker] = field(default_factory=list)

    def busy(self) -> bool:
        """Whether a zero-copy reply or push still reads this memory (writes must wait)."""
        if not self.sending:
            return False
        self.sending = [t for t in self.sending if not t.done]
        return bool(self.sending)


@dataclass
class Session:
    """A client's resources; freed when it says goodbye or goes silent past the session timeout."""

    client_id: bytes
    name: str
    buffers: dict[int, Buffer] = field(default_factory=dict)
    graphs: dict[int, CompiledGraph] = field(default_factory=dict)
    queue: deque[Request] = field(default_factory=deque)
    """Requests in arrival order; the head runs first, and one whose transfer is under way
    (``in_flight``) holds the rest back."""
    pumping: bool = False
    """The executor is running this queue now (a transfer finishing meanwhile only marks it)."""
    frees: int = 0
    """Bumped whenever a buffer is freed: views resolved before then may be stale."""
    views: dict[TensorRef, View] = field(default_factory=dict)
    """Checked views by reference (a pipeline names the same few every step); emptied when a
    buffer is freed."""
    last_seen: float = field(default_factory=time.monotonic)
    usage: Usage = field(default_factory=Usage)
    answered_later: set[Request] = field(default_factory=set)
    """Requests out of the queue that the end of their transfer answers (a send, a probe)."""
    sid: int = 0
    """A number for the logs and the status (``s<sid>``): the routing id keys the session and
    stays secret, only its first 4 bytes are ever shown."""
    timing: bool = False
    """The client asked for the worker's share of each request's time in its replies (1.4)."""
    minor: int = 0
    """The protocol minor the client said in HELLO: replies carry fields up to it."""
    identity: str = ""
    """Whose session this is (:mod:`~zmq_rpc.worker.sessions.identities`): quotas over all of an
    identity's sessions, and a later HELLO must come from it."""
    verifier: Verifier | None = None
    """Set when the opening HELLO exchanged keys (1.10, :mod:`~zmq_rpc.broker.request_mac`):
    every later request must carry the session's signature, else it is refused untouched."""
    refused: int = 0
    """Requests refused for a missing or wrong signature (the first is logged)."""
    kept: dict[int, g.GraphRunLinked] = field(default_factory=dict)
    """Linked runs kept for GRAPH_RUN_KEPT (1.15), by the id the client gave (at most
    ``MAX_KEPT``: the ids are bounded)."""

    @property
    def label(self) -> str:
        return f"s{self.sid}"

    def log_fields(self) -> dict[str, Any]:
        """The session's identity for a log record (``extra=``): JSON logs keep them apart."""
        return {"session": self.label, "client": self.name, "client_id": self.client_id.hex()[:8]}

    def idle(self, handles: Iterable[int]) -> bool:
        """Whether no zero-copy send still reads any of the buffers ``handles`` names."""
        for handle in handles:
            buf = self.buffers.get(handle)
            if buf is not None and buf.busy():
                return False
        return True


Reply = tuple[p.Message, list[Any]]
"""A reply header message and its payload frames."""
NO_REPLY: Reply = (p.Empty(), [])


class Admission(enum.Enum):
    """How a request gets to run."""

    OPENS = "opens a session"
    """HELLO: runs with no session yet, and opens one."""
    AT_ONCE = "at once"
    """PEER_FILL: feeds the transfer that holds its session's queue, so it cannot wait in it."""
    QUEUED = "in session order"
    """Everything else: after every earlier request of its session."""


class Later(enum.Enum):
    """A handler's answer when the reply does not go out now."""

    HOLD = "stays at the head"
    """The request stays at the head of its queue (its transfer is under way, or it has more
    steps to take): the requests behind it wait."""
    ANSWERED_LATER = "answered later"
    """The request leaves the queue; the outcome of its transfer answers it."""


Outcome = Reply | Later
Handler = Callable[[Session, Any, "Request"], Outcome]
"""(session, the decoded message, the request) -> the reply, or who answers instead."""
Writes = Callable[[Session, Any], Iterable[int]]
"""(session, the decoded message) -> handles of the buffers the request writes."""


def writes_nothing(session: Session, msg: Any) -> Iterable[int]:
    """The buffers a request that writes none writes."""
    return ()


@dataclass(eq=False)
class Request:
    """A decoded request: run at once, or waiting in its session's queue."""

    cmd: Cmd
    req_id: int
    msg: p.Message
    payload: Sequence[Any]
    route: Route
    in_flight: bool = False
    """Its transfer is under way: the session's queue waits on it (see :meth:`landed`)."""
    nbytes: int = 0
    """Payload bytes, counted against the session's queued-bytes quota while it waits."""
    arrived: int = 0
    """``perf_counter_ns()`` when the backend thread took it from the PAIR (metrics, timing)."""

    def writes(self, session: Session) -> Iterable[int]:
        """The buffers its next step writes: zero-copy sends from them must be done first."""
        return self.route.writes(session, self.msg)

    def landed(self) -> bool:
        """Its transfer arrived; True when that finishes the request (it then replies)."""
        return True

    def transfer_failed(self, error: str) -> str:
        """Its error message when its transfer failed with ``error``."""
        return error

    @property
    def hold_us(self) -> int:
        """How long the worker may hold its successful reply back (0: send at once)."""
        return 0


@dataclass(frozen=True, slots=True)
class Route:
    """How the executor handles one command."""

    handler: Handler
    writes: Writes = writes_nothing
    admission: Admission = Admission.QUEUED
    eager: bool = False
    """Started right behind the request ahead of it, before that one's reply leaves (a peer
    send: another worker waits on its bytes, the client does not wait on the reply)."""
    queued: Callable[[Session, Any], None] | None = None
    """Called when a request joins its session's queue (a receive announces its tokens)."""
    entry: Callable[[Cmd, int, p.Message, Sequence[Any], Route], Request] = Request
    """What a request of this command is while it waits (a linked run has its own states)."""

    def request(self, cmd: Cmd, req_id: int, msg: p.Message, payload: Sequence[Any]) -> Request:
        """The queue entry for one decoded request."""
        return self.entry(cmd, req_id, msg, payload, self)
