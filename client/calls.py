"""What passes between the threads of one connection: a request on its way (:class:`Call`), a
place held in the send order (:class:`Reservation`), the timing of one request, and the functions
that give a call its outcome.

Threads: a call is built by the submitting thread, then belongs to whoever drives the connection
(the holder of the connection's socket lock: its I/O thread or a blocking caller), which settles
it; a reservation's ``calls`` and ``error`` are written under the mailbox's lock. No sockets here.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from ..broker import protocol as p
from ..broker.errors import RpcError
from ..broker.protocol import Cmd

OnReply = Callable[[p.Message, list[zmq.Frame]], Any]
"""Turns a decoded reply and its payload frames into the future's result (runs on the thread that
owns the connection at that moment)."""

SENT: tuple[Any, ...] = ()
"""A sent call's ``frames`` (its payload may be freed)."""


@dataclass(frozen=True)
class RequestTiming:
    """Where one request's time went, in seconds: the client's clock for its own parts, the
    worker's report (protocol 1.5, ``ConnectionOptions.trace``) for its share. ``wire`` is the round
    trip minus the worker's share: both directions, the broker hop and the reply's decoding."""

    cmd: str
    client_queue: float
    """Submitted until the I/O thread sent it (the window, other requests ahead of it)."""
    wire: float
    worker_queue: float
    """Waiting on the worker behind its session's earlier requests or an incoming transfer."""
    worker_run: float
    """Running on the worker until its reply left."""
    back: float
    """Reply received until the future had its result (landing the payload, callbacks)."""
    compute: float = 0.0
    """Seconds inside graphs, as the worker reported (runs only)."""

    @property
    def total(self) -> float:
        return self.client_queue + self.wire + self.worker_queue + self.worker_run + self.back


@dataclass(eq=False, slots=True)
class Call:
    """One request on its way: its frames, its future and its deadline."""

    cmd: Cmd
    req_id: int
    frames: bytes | list[Any] | tuple[Any, ...]
    """The header alone, or header and payload; an empty tuple once sent (the payload may be
    freed)."""
    future: Future[Any] | None
    """None for a blocking call of one request (``Connection.request``): its outcome lands
    in ``value``/``error``, read by the caller once the loop it drives has settled it."""
    deadline: float
    on_reply: OnReply | None
    nbytes: int = 0
    sent: bool = False
    settled: bool = False
    """Its future has (or is about to have) its outcome; set by whoever settles it, so the
    loop never asks the future (a lock round trip) whether it is done."""
    submitted_ns: int = 0
    sent_ns: int = 0
    """Submitted and sent, by ``perf_counter_ns`` (taken only when the connection traces)."""
    value: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        """A future-less call's result, or its error raised."""
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(eq=False)
class Reservation:
    """A place in the send order for requests decided later (``Connection.reserve``): requests
    submitted after it wait until it is filled, then go out behind what filled it."""

    req_id: int
    deadline: float
    calls: list[Call] | None = None
    """What filled it, once ``Connection.filling`` is done; None while open."""
    error: RpcError | None = None
    """Why it can no longer be filled (the connection failed, it expired)."""


Inbox = queue.SimpleQueue[Call | Reservation | None]
"""Submitted calls and reservations on their way to the connection's driver (None: close)."""


def all_done(calls: list[Call]) -> bool:
    for call in calls:
        if not call.settled:
            return False
    return True


def fail_call(call: Call, error: BaseException) -> None:
    call.settled = True
    if call.future is not None:
        fail_future(call.future, error)
    elif call.error is None:
        call.value, call.error = None, error


def settle(call: Call, value: Any, error: BaseException | None) -> None:
    """Give ``call`` its outcome: to its future, or (a future-less call's) to its fields."""
    future = call.future
    if future is None:
        call.value, call.error = value, error
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def fail_future(future: Future[Any], error: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except Exception:  # noqa: BLE001 - settled meanwhile by another thread
            pass


def fail_item(item: Call | Reservation | None, error: RpcError) -> None:
    if isinstance(item, Call):
        fail_call(item, error)
    elif isinstance(item, Reservation):
        item.error = item.error or error


def drain_inbox(inbox: Inbox, error: RpcError) -> None:
    while True:
        try:
            fail_item(inbox.get_nowait(), error)
        except queue.Empty:
            return


def timing(call: Call, reply: p.Message, received_ns: int) -> RequestTiming:
    """Where ``call``'s time went, from the client's clock (``received_ns``: its reply came in,
    by ``perf_counter_ns``) and the worker's report in ``reply`` (which has ``timing``)."""
    queued_ns, run_ns = reply.timing  # type: ignore[attr-defined]
    round_trip = received_ns - call.sent_ns
    return RequestTiming(
        call.cmd.name, (call.sent_ns - call.submitted_ns) / 1e9,
        max(round_trip - queued_ns - run_ns, 0) / 1e9, queued_ns / 1e9, run_ns / 1e9,
        (time.perf_counter_ns() - received_ns) / 1e9,
        getattr(reply, "compute_ns", 0) / 1e9)


EMPTY = p.Empty()
"""The fields of a request that has none (messages are frozen: one instance serves all)."""


def no_result(reply: p.Message, frames: list[zmq.Frame]) -> None:
    """The result of a request that returns nothing."""
    return None
