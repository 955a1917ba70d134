"""Synchronous calls driven on the caller's own thread: the caller that found the connection idle
sends its requests and reads their replies itself (no hop through the I/O thread), still
watching the monitor, the deadlines and the wake-up socket (close, and other threads' requests,
which it sends too).

Threads: the calling thread, while it holds ``Engine._socket_lock`` (taken by
``Engine._take_idle``); it marks itself with ``io_thread.active`` meanwhile, so that a future
callback it runs knows not to block.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import zmq
from zmq import zmq_poll

from ..broker import protocol as p
from ..broker.errors import ClientClosed, RpcError
from ..broker.protocol import STATUS_OK, Cmd
from .calls import SENT, Call, OnReply, all_done, fail_call
from .io_loop import IoLoop, check_reply_payload, io_thread
from .link import SYNC_SLICE_MS

SYNC_SLICE_S = SYNC_SLICE_MS / 1000

TOGETHER_GRACE_S = 0.5
"""How long :func:`pump_together` still reads the replies of its other requests once its
future has succeeded (a copy's source worker answers a moment after the bytes landed): the
connections are then idle for the caller's next request. Past it (or at once when the future
failed) the I/O threads read them."""


def request(io: IoLoop, cmd: Cmd, req_id: int, msg: p.Message, payload: Sequence[Any],
            on_reply: OnReply | None, wait: float, reply_bytes: int) -> Any:
    """One synchronous request (``wait``: its timeout in seconds), sent and answered on this
    thread: its result (``on_reply``'s, or the reply), or its error raised.

    Its usual course (the connection up, its own successful reply within ``SYNC_SLICE_MS``)
    is a send and a blocking receive on the DEALER alone, like a bare socket's, and leaves
    nothing behind: no :class:`Call`, no entry in flight, no deadline. Anything else (another
    message first, an error reply, no reply within the slice, a short timeout, tracing) makes
    it a call in flight driven by :func:`_await`, which watches the monitor, the deadlines and
    the wake-up socket as every inline caller does. So close(), other threads' requests and
    connection events wait at most ``SYNC_SLICE_MS`` for a synchronous caller's notice.

    (A request whose success is an Ack takes a shorter course still: ``Handover.request``.)"""
    link = io.link
    if io.trace or link.down:
        return _exchanged(io, cmd, req_id, msg, payload, on_reply, wait, reply_bytes)
    header = link.signed(p.encode_request(cmd, req_id, msg))
    now = time.monotonic()
    dealer = io.dealer
    link.last_sent = now
    io_thread.active = True
    try:
        nbytes = reply_bytes
        if payload:
            nbytes += sum(memoryview(f).nbytes for f in payload)
            dealer.send_multipart([header, *payload], copy=nbytes < zmq.COPY_THRESHOLD)
        else:
            dealer.send(header)
        frame = None
        if wait > SYNC_SLICE_S:
            try:
                frame = dealer.recv(copy=False)     # blocks at most SYNC_SLICE_MS (RCVTIMEO)
            except zmq.Again:
                pass
        return _sent(io, cmd, req_id, frame, on_reply, now + wait, nbytes)
    finally:
        io_thread.active = False


def after_send(io: IoLoop, cmd: Cmd, req_id: int, frame: zmq.Frame | None,
               on_reply: OnReply | None, deadline: float, nbytes: int) -> Any:
    """The rest of a synchronous request sent by ``Handover.request`` whose reply was not the
    Ack it hoped for: ``frame`` (the first part of what came instead, or None: nothing within
    ``SYNC_SLICE_MS``) read as any reply, or the request in flight and driven to its end."""
    io_thread.active = True
    try:
        return _sent(io, cmd, req_id, frame, on_reply, deadline, nbytes)
    finally:
        io_thread.active = False


def _sent(io: IoLoop, cmd: Cmd, req_id: int, frame: zmq.Frame | None,
          on_reply: OnReply | None, deadline: float, nbytes: int) -> Any:
    """A sent request's outcome: ``frame`` (a message's first part, if one came) its reply,
    or the request in flight until its end."""
    frames = None
    if frame is not None:
        frames = _rest(io.dealer, frame)
        value = _own_reply(cmd, req_id, frames, on_reply)
        if value is not _NOT_OURS:
            return value
    return _in_flight(io, Call(cmd, req_id, SENT, None, deadline, on_reply, nbytes,
                               sent=True), frames)


def _in_flight(io: IoLoop, call: Call, frames: list[zmq.Frame] | None) -> Any:
    """The rest of :func:`request` for ``call``, sent and now in flight (``frames``: a
    message already read for it, not its successful reply)."""
    io.in_flight[call.req_id] = call
    io.in_flight_bytes += call.nbytes
    if frames is not None:
        io._on_reply(frames)
    try:
        if not call.settled or io.blocked_readers:
            _await(io, call, [] if frames is not None else None)
    finally:
        if not call.settled:        # the I/O thread times it out from now on
            io.deadlines.watch(call)
    return call.outcome()


_NOT_OURS = object()

def bare_courses() -> dict[Cmd, tuple[type[p.Message], bytes, p.Message]]:
    """The requests that take ``Handover.request``'s short course, by command: a request type
    without fields, whose success is a reply without fields or payload (an Ack); for each,
    that type, its header's head (:func:`~zmq_rpc.broker.protocol.request_head`) and the
    reply, the one instance a success decodes to."""
    courses = {}
    for cmd, kind in p.REQUESTS.items():
        bare = _bare_reply(cmd)
        if bare is not None and not dataclasses.fields(kind):
            courses[cmd] = (kind, p.request_head(cmd), bare)
    return courses


def _bare_reply(cmd: Cmd) -> p.Message | None:
    """The reply to ``cmd`` that has no fields (an Ack), when there is one: a success reply
    byte-identical to its encoding decodes to this very instance, and carries no payload."""
    try:
        first, second = (p.decode_reply(cmd, [STATUS_OK, 0]) for _ in range(2))
    except RpcError:
        return None                     # a reply with required fields
    if first is second and isinstance(first, p.Message) and not first.payload_count():
        return first
    return None


def _own_reply(cmd: Cmd, req_id: int, frames: list[zmq.Frame], on_reply: OnReply | None) -> Any:
    """What the reply in ``frames`` settles our request with, if it is our request's successful
    reply (its error raised if it is not a valid one); else ``_NOT_OURS`` (for
    ``IoLoop._on_reply``: a late reply, a keep-alive's, an error, garbage)."""
    try:
        header = p.unpack_header(frames[0])
    except RpcError:
        return _NOT_OURS
    if header[1] != req_id or header[0] != STATUS_OK:
        return _NOT_OURS
    reply = p.decode_reply(cmd, header)
    if isinstance(reply, RpcError):
        return _NOT_OURS
    check_reply_payload(cmd, reply, frames)
    return on_reply(reply, frames[1:]) if on_reply else reply


def _exchanged(io: IoLoop, cmd: Cmd, req_id: int, msg: p.Message, payload: Sequence[Any],
               on_reply: OnReply | None, wait: float, reply_bytes: int) -> Any:
    """:func:`request` as a :class:`Call` from the start (tracing, or the connection down)."""
    header = p.encode_request(cmd, req_id, msg)
    frames: bytes | list[Any] = [header, *payload] if payload else header
    nbytes = sum(memoryview(f).nbytes for f in payload) + reply_bytes
    call = Call(cmd, req_id, frames, None, time.monotonic() + wait, on_reply, nbytes,
                submitted_ns=time.perf_counter_ns() if io.trace else 0)
    exchange(io, call)
    return call.outcome()


def exchange(io: IoLoop, call: Call) -> None:
    """Send a synchronous caller's ``call`` (nothing ahead of it) and drive the connection
    on this thread until it is settled. The call's deadline stays out of the shared heap
    (this loop watches it) unless the caller leaves early (an exception)."""
    if io.link.down:
        fail_call(call, io.link.refusal())
        return
    io.send(call, io.engine.options.trace)
    io.link.last_sent = time.monotonic()
    try:
        _await(io, call)
    finally:
        if not call.settled:        # the I/O thread times it out from now on
            io.deadlines.watch(call)


def _await(io: IoLoop, call: Call, events: list[tuple[Any, int]] | None = None) -> None:
    """Drive the connection until ``call`` is settled (or its deadline passed); ``events``:
    what a poll already reported, handled first."""
    engine, items, dealer, calls = io.engine, io.poll_items, io.dealer, [call]
    io_thread.active = True
    try:
        while True:
            if events is None:
                engine._pump_sleeping = True
                timeout = io.poll_timeout_ms(call.deadline) if engine._inbox.empty() else 0
                events = zmq_poll(items, timeout)
                engine._pump_sleeping = False
                if len(events) == 1 and events[0][0] is dealer:   # the usual: its reply
                    _take_one(io, dealer)
                    if call.settled and not io.blocked_readers:
                        return
                    io.receive(calls)
                    if all_done(calls):
                        return
                    events = []     # then the round's chores (timeouts, new requests)
            if not io.handle(dict(events), calls):
                fail_call(call, ClientClosed("the client was closed"))
                return
            events = None
            if all_done(calls):
                return
            if call.deadline <= time.monotonic():
                io.expire_call(call)
                return
    finally:
        io_thread.active = False


def _take_one(io: IoLoop, dealer: zmq.Socket[bytes]) -> None:
    """Read the message that poll said is in."""
    io._on_reply(_recv(dealer))


def _recv(dealer: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """The message that poll said is in, all its frames."""
    return _rest(dealer, dealer.recv(zmq.NOBLOCK, copy=False))


def _rest(dealer: zmq.Socket[bytes], frame: zmq.Frame) -> list[zmq.Frame]:
    """The message whose first frame is ``frame``: the rest is there with it."""
    frames = [frame]
    while frame.more:
        frame = dealer.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def pump(io: IoLoop, calls: list[Call]) -> None:
    """An inline caller drives the connection until its ``calls`` are done; it also sends
    what other threads submit meanwhile (its calls may wait on theirs)."""
    engine, items = io.engine, io.poll_items
    io_thread.active = True
    try:
        while not all_done(calls):
            engine._pump_sleeping = True
            timeout = 0 if not engine._inbox.empty() else io.poll_timeout_ms()
            events = dict(zmq_poll(items, timeout))
            engine._pump_sleeping = False
            if not io.handle(events, calls):
                for call in calls:
                    fail_call(call, ClientClosed("the client was closed"))
                return
    finally:
        io_thread.active = False


def pump_together(loops: Sequence[IoLoop], future: Future[Any], calls: list[Call]) -> None:
    """:func:`pump` over several connections until every call sent here is done, or
    ``future`` failed, or it succeeded TOGETHER_GRACE_S ago (what is still due is then the I/O
    threads', woken as the connections are given back)."""
    poller = zmq.Poller()
    owner: dict[Any, IoLoop] = {}
    for io in loops:
        for sock in (io.dealer, io.monitor, io.wake_fd):
            poller.register(sock, zmq.POLLIN)
            owner[sock] = io
    io_thread.active = True
    try:
        settled = 0.0
        while not all(c.settled for c in calls):
            if future.done():
                if future.exception() is not None:
                    return
                settled = settled or time.monotonic()
                if time.monotonic() - settled > TOGETHER_GRACE_S:
                    return
            for io in loops:
                io.engine._pump_sleeping = True
            waiting = any(not io.engine._inbox.empty() for io in loops)
            timeout = 0 if waiting else min(io.poll_timeout_ms() for io in loops)
            if settled:
                timeout = min(timeout, int(TOGETHER_GRACE_S * 1000) + 1)
            events = dict(poller.poll(timeout))
            for io in loops:
                io.engine._pump_sleeping = False
            for io in loops:
                if not io.handle({s: e for s, e in events.items() if owner[s] is io}):
                    for call in calls:
                        fail_call(call, ClientClosed("the client was closed"))
                    return
    finally:
        io_thread.active = False
