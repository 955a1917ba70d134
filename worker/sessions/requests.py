"""The executor's dispatch vocabulary: a queued :class:`Request` and the :class:`Route` of each command.

Owned by the backend thread. The executor keeps one table, ``Cmd -> Route``: the route names the
handler, the buffers the request writes (it waits while a zero-copy send still reads them), how it
is admitted (opens a session, runs at once, or waits its turn in the session's queue), and what a
queue entry of that command is (:class:`Request`, or a linked run with its own states).

A handler is called with the session, the decoded message and the request, and returns the reply
to send now, or a :class:`Later` saying who answers instead.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ...broker import protocol as p
from ...broker.protocol import Cmd
from .session import Reply, Session


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
