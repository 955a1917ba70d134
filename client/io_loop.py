"""The state of one worker connection while requests are pending: what waits to be sent (the
backlog, in submission order, paced by the window), what is in flight, their deadlines, and the
rounds that send, read replies, time out and fail them.

Threads: created by the engine's I/O thread; touched only by whoever holds
``Engine._socket_lock`` (the I/O thread, running :meth:`IoLoop.step`, or a synchronous caller
driving the connection inline, see ``inline.py``). Futures settled here run their callbacks on
that thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import zmq
from zmq import zmq_poll

from ..broker import protocol as p
from ..broker.errors import BadRequest, RpcError, Timeout
from ..broker.protocol import Cmd, ErrorCode
from .calls import (
    SENT,
    Call,
    Reservation,
    all_done,
    drain_inbox,
    fail_call,
    fail_item,
    settle,
    timing,
)
from .deadlines import NEVER, Deadlines
from .futures import RunningFuture
from .link import Link

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("zmq_rpc.client")

BLOCKED_POLL_MS = 50
"""While the window is full, how often the I/O thread looks at new requests (arming their
timeouts) when no reply comes sooner."""

REFILL_EVERY = 16
"""While reading a batch of replies, send from the backlog after this many (keeps the window,
and so the worker, busy)."""


class _IoThread(threading.local):
    active = False
    """This thread drives a connection now (an I/O thread, or an inline caller)."""


io_thread = _IoThread()


def on_io_thread() -> bool:
    """Whether the caller is a client I/O thread (a future callback): it must never block."""
    return io_thread.active


class IoLoop:
    """The connection's pending requests: the backlog, the calls in flight, their deadlines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        opts = engine.options
        self.link = Link(engine.ctx, engine.endpoint, opts, self.fail_pending)
        self.dealer = self.link.dealer
        self.monitor = self.link.monitor
        self.backlog: deque[Call | Reservation] = deque()
        self.in_flight: dict[int, Call] = {}
        self.in_flight_bytes = 0
        self.deadlines: Deadlines[Call] = Deadlines()
        self.closing = False
        """close() was asked for (whoever drove the connection then saw it)."""
        self.wake_fd = engine._wake_r.fileno()
        """The wake-up socket, as poll reports it (a plain socket is reported by its fd)."""
        self.poll_items: list[tuple[Any, int]] = [
            (self.dealer, zmq.POLLIN), (self.monitor, zmq.POLLIN), (self.wake_fd, zmq.POLLIN)]
        self.blocked_readers: list[RunningFuture[Any]] = []
        """Futures settled in this batch of replies whose readers wait to be woken."""
        self.beat_ms = int(opts.heartbeat * 1000)
        self.trace = opts.trace
        self.wake_poller = zmq.Poller()
        self.wake_poller.register(engine._wake_r, zmq.POLLIN)

    def busy(self) -> bool:
        return bool(self.in_flight or self.backlog)

    # ------------------------------------------------------------------------ one round

    def step(self) -> bool:
        """One round of the I/O thread; False once close() was asked for.

        While the backlog waits for room in the window, new requests would only queue behind
        it: submitters do not wake the thread then (a pipelining caller would keep it spinning),
        and it looks at its inbox at the next reply, or within ``BLOCKED_POLL_MS``."""
        if self.closing:        # a synchronous caller saw close() and gave the connection back
            return False
        engine = self.engine
        blocked = bool(self.backlog)
        if not blocked:
            engine._io_sleeping = True      # then look again: a submit may have raced us
        if not self.in_flight and not blocked:
            timeout = 0                     # idle: look, then park
        elif not blocked and not engine._inbox.empty():
            timeout = 0
        else:
            timeout = self.poll_timeout_ms()
            if blocked and timeout > BLOCKED_POLL_MS:
                timeout = BLOCKED_POLL_MS
        events = dict(zmq_poll(self.poll_items, timeout))
        engine._io_sleeping = False
        return self.handle(events)

    def handle(self, events: dict[Any, int], calls: list[Call] | None = None) -> bool:
        """Handle what ``poll`` reported: replies before a disconnect (they made it), then
        connection events, then new requests; False once close() was asked for. ``calls``:
        an inline caller's, whose replies end its reading."""
        engine = self.engine
        if self.wake_fd in events:
            engine._drain_wake()       # undrained, it would keep every poll returning at once
        if self.dealer in events or self.monitor in events:
            self.receive(calls)
        if self.monitor in events:
            self.link.read_monitor()
        if not engine._inbox.empty() and not self._take_inbox():
            return False
        if self.closing:
            return False
        self.send_backlog()
        if self.deadlines.bloated(len(self.in_flight) + len(self.backlog)):
            self.deadlines.compact({*self.in_flight, *(c.req_id for c in self.backlog)})
        now = time.monotonic()
        if self.deadlines.next() <= now:
            self._expire(now)
        self.link.heartbeat(now)
        return True

    def poll_timeout_ms(self, deadline: float = NEVER) -> int:
        """Until the next deadline (or ``deadline``), at most a heartbeat interval."""
        return self.deadlines.timeout_ms(time.monotonic(), self.beat_ms, deadline)

    # ------------------------------------------------------------------------- sending

    def _take_inbox(self) -> bool:
        """Move submitted calls to the backlog; False when close() was asked for."""
        if self.closing:
            return False
        inbox = self.engine._inbox
        while not inbox.empty():            # one consumer: what empty() says holds
            item = inbox.get_nowait()
            if item is None:
                self.link.goodbye()
                self.closing = True
                return False
            self.admit(item)
        return True

    def admit(self, item: Call | Reservation) -> None:
        """Queue a call (or reservation) to be sent, or fail it at once if the connection is
        known to be down."""
        if self.link.down:
            fail_item(item, self.link.refusal())
            return
        self.backlog.append(item)
        if type(item) is Call:
            self.deadlines.watch(item)
        else:
            self.deadlines.watch_id(item.deadline, item.req_id)

    def send_now(self, call: Call) -> None:
        """Send ``call`` at once (an inline caller's, nothing ahead of it) or queue it."""
        opts = self.engine.options
        if self.backlog or self.link.down or (
                self.in_flight and (len(self.in_flight) >= opts.window or
                                    self.in_flight_bytes + call.nbytes > opts.window_bytes)):
            self.admit(call)
            self.send_backlog()
            return
        self.deadlines.watch(call)
        self.send(call, opts.trace)
        self.link.last_sent = time.monotonic()

    def send_backlog(self) -> None:
        """Send from the head of the backlog while the window allows."""
        backlog = self.backlog
        if not backlog:
            return
        opts, in_flight, trace = self.engine.options, self.in_flight, self.engine.options.trace
        while backlog:
            call = backlog[0]
            if isinstance(call, Reservation):
                if not self._open_reservation(call):
                    break
                continue
            if in_flight and (len(in_flight) >= opts.window or
                              self.in_flight_bytes + call.nbytes > opts.window_bytes):
                break
            backlog.popleft()
            if not call.settled:
                self.send(call, trace)
        self.link.last_sent = time.monotonic()

    def send(self, call: Call, trace: bool) -> None:
        """Put ``call`` on the wire and in flight."""
        if trace:
            call.sent_ns = time.perf_counter_ns()
        frames = call.frames
        signer = self.link.signer
        if isinstance(frames, bytes):
            self.dealer.send(frames if signer is None else signer.sign(frames))
        else:
            if signer is not None:
                frames = [signer.sign(frames[0]), *frames[1:]]
            self.dealer.send_multipart(frames, copy=call.nbytes < zmq.COPY_THRESHOLD)
        call.frames = SENT
        call.sent = True
        self.in_flight[call.req_id] = call
        self.in_flight_bytes += call.nbytes

    def _open_reservation(self, slot: Reservation) -> bool:
        """Replace a filled reservation at the head by its calls; False while it is open."""
        with self.engine._submit_lock:
            calls = slot.calls
        if calls is None:
            return False
        self.backlog.popleft()
        for call in reversed(calls):
            self.backlog.appendleft(call)
            self.deadlines.watch(call)
        return True

    # ------------------------------------------------------------------------ receiving

    def receive(self, calls: list[Call] | None = None) -> None:
        """Take the replies that are in (up to 1024 at a time); with ``calls`` (an inline
        caller's), stop once they are done. Every ``REFILL_EVERY`` replies the window is topped
        up from the backlog (read to the end first, and the worker would run dry meanwhile) and
        the threads blocked on the futures settled so far are woken."""
        try:
            self._read(calls)
        finally:
            if self.blocked_readers:
                self.wake_readers()

    def _read(self, calls: list[Call] | None) -> None:
        dealer, more = self.dealer, zmq.NOBLOCK
        for count in range(1, 1025):
            try:
                frame = dealer.recv(more, copy=False)
            except zmq.Again:
                return
            frames = [frame]
            while frame.more:           # the rest of a message is there with its first part
                frame = dealer.recv(more, copy=False)
                frames.append(frame)
            self._on_reply(frames)
            if calls is not None and all_done(calls):
                return
            if not count % REFILL_EVERY:
                if self.blocked_readers:
                    self.wake_readers()
                if self.backlog:
                    self.send_backlog()

    def wake_readers(self) -> None:
        readers, self.blocked_readers = self.blocked_readers, []
        for future in readers:
            future._wake_readers()

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        try:
            header = p.unpack_header(frames[0])
        except RpcError as exc:
            log.warning("dropping an unreadable reply: %s", exc)
            return
        if header[0] == ErrorCode.NO_SESSION:
            self.link.session_lost(header[2] if len(header) > 2 else "")
        call = self.in_flight.pop(header[1], None)
        if call is None:
            return  # a reply to a request that already timed out, or a heartbeat
        self.in_flight_bytes -= call.nbytes
        received = time.perf_counter_ns() if self.trace else 0
        call.settled = True
        try:
            result = p.decode_reply(call.cmd, header)
            if isinstance(result, RpcError):
                settle(call, None, result)
            else:
                check_reply_payload(call.cmd, result, frames)
                value = call.on_reply(result, frames[1:]) if call.on_reply else result
                future = call.future
                if type(future) is RunningFuture:
                    if future._set_result_quietly(value):
                        self.blocked_readers.append(future)
                else:
                    settle(call, value, None)
                if received and getattr(result, "timing", None):
                    self.engine.timings.append(timing(call, result, received))
        except BaseException as exc:
            fail_call(call, exc)

    # ------------------------------------------------------------------------ timing out

    def _expire(self, now: float) -> None:
        for due in self.deadlines.due(now):
            if not isinstance(due, int):
                self.expire_call(due)
                continue
            call = self.in_flight.get(due)
            if call is not None:
                self.expire_call(call)
                continue
            item = next((c for c in self.backlog if c.req_id == due), None)
            if isinstance(item, Call):
                self.time_out(item)
            elif isinstance(item, Reservation):
                self._expire_reservation(item)

    def expire_call(self, call: Call) -> None:
        """Fail ``call`` with Timeout; its late reply, if any, is dropped."""
        if self.in_flight.pop(call.req_id, None) is not None:
            self.in_flight_bytes -= call.nbytes
        self.time_out(call)

    def time_out(self, call: Call) -> None:
        where = "waiting to be sent" if not call.sent else "sent, no reply"
        fail_call(call, Timeout(f"{call.cmd.name} to {self.engine.endpoint}: no reply "
                                  f"within the timeout ({where})"))

    def _expire_reservation(self, slot: Reservation) -> None:
        with self.engine._submit_lock:
            if slot.calls is None:
                slot.error = Timeout(f"a request to {self.engine.endpoint} was not decided "
                                     "within the timeout")
                slot.calls = []
        self.backlog.remove(slot)

    # ------------------------------------------------------------------------- failing

    def fail_in_flight(self, exc: RpcError) -> None:
        calls, self.in_flight = list(self.in_flight.values()), {}
        self.in_flight_bytes = 0
        for call in calls:
            fail_call(call, exc)

    def fail_pending(self, exc: RpcError) -> None:
        """Fail what is in flight and what waits to be sent (callbacks run outside any lock:
        they may submit again)."""
        self.fail_in_flight(exc)
        items, self.backlog = list(self.backlog), deque()
        calls = [c for c in items if isinstance(c, Call)]
        with self.engine._submit_lock:
            for slot in items:
                if isinstance(slot, Reservation):
                    slot.error = slot.error or exc
                    calls.extend(slot.calls or ())
        for call in calls:
            fail_call(call, exc)

    def fail_all(self, exc: RpcError) -> None:
        self.fail_pending(exc)
        drain_inbox(self.engine._inbox, exc)

    def close(self) -> None:
        self.link.close()


def check_reply_payload(cmd: Cmd, reply: p.Message, frames: list[zmq.Frame]) -> None:
    expected = reply.payload_count()
    if len(frames) - 1 != expected:
        raise BadRequest(f"{cmd.name} reply has {len(frames) - 1} payload frame(s), "
                           f"expected {expected}")
