"""The loop of one worker connection: what waits to be sent (the backlog, in submission order,
paced by the window), what is in flight, their deadlines, and the rounds that send, read replies,
time out and fail them.

Threads: created by the connection's I/O thread; run only by whoever holds the connection's
socket lock: the I/O thread (:meth:`Loop.step`, :meth:`Loop.park`) or a blocking caller that
found the connection idle (:meth:`Loop.drive`). The two run the same rounds (:meth:`Loop.handle`);
only how long they sleep differs. Futures settled here run their callbacks on that thread, which
is marked meanwhile (:func:`on_io_thread`) so that a callback knows not to block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import zmq
from zmq import zmq_poll
from zmq.backend import Socket as _CSocket

from ..broker import protocol as p
from ..broker.errors import BadRequest, ClientClosed, RpcError, Timeout
from ..broker.protocol import STATUS_OK, Cmd, ErrorCode
from .calls import (
    SENT,
    Call,
    RequestTiming,
    Reservation,
    all_done,
    fail_call,
    fail_item,
    settle,
    timing,
)
from .deadlines import NEVER, Deadlines
from .link import Link
from .mailbox import Mailbox
from .options import ConnectionOptions

log = logging.getLogger("zmq_rpc.client")

_send = _CSocket.send
"""pyzmq's send without its Python layer (routing ids and groups, for draft sockets only), for
a header alone: a blocking caller pays for every call on its way."""

BLOCKED_POLL_MS = 50
"""While the window is full, how often the I/O thread looks at new requests (arming their
timeouts) when no reply comes sooner."""

READ_BATCH = 1024
"""Replies read in one round at most."""

REFILL_EVERY = 16
"""While reading a batch of replies, send from the backlog after this many (keeps the window,
and so the worker, busy)."""


class _IoThread(threading.local):
    active = False
    """This thread drives a connection now (an I/O thread, or a blocking caller)."""


io_thread = _IoThread()


def on_io_thread() -> bool:
    """Whether the caller is a client I/O thread (a future callback): it must never block."""
    return io_thread.active


class Loop:
    """The connection's pending requests: the backlog, the calls in flight, their deadlines."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                 opts: ConnectionOptions, mailbox: Mailbox,
                 timings: deque[RequestTiming], draining: threading.Event | None = None) -> None:
        self.endpoint = endpoint
        self.options = opts
        self.mailbox = mailbox
        self.timings = timings
        """Appended when tracing; read by the connection's ``drain_timings`` (any thread)."""
        self.draining = draining or threading.Event()
        """Set when a reply says the worker is leaving (``draining``, protocol 1.14); read
        by ``Client.draining`` (any thread)."""
        self.link = Link(ctx, endpoint, opts, self.fail_pending)
        self.dealer = self.link.dealer
        self.monitor = self.link.monitor
        self.backlog: deque[Call | Reservation] = deque()
        self.in_flight: dict[int, Call] = {}
        self.in_flight_bytes = 0
        self.deadlines: Deadlines[Call] = Deadlines()
        self.closing = False
        """close() was asked for (whoever drove the connection then saw it)."""
        self.wake_fd = mailbox.wake_socket.fileno()
        """The wake-up socket, as poll reports it (a plain socket is reported by its fd)."""
        self.poll_items: list[tuple[Any, int]] = [
            (self.dealer, zmq.POLLIN), (self.monitor, zmq.POLLIN), (self.wake_fd, zmq.POLLIN)]
        self.beat_ms = int(opts.heartbeat * 1000)
        self.trace = opts.trace
        self.wake_poller = zmq.Poller()
        self.wake_poller.register(mailbox.wake_socket, zmq.POLLIN)

    def busy(self) -> bool:
        return bool(self.in_flight or self.backlog)

    def idle(self) -> bool:
        """Nothing in flight, queued or posted, and no close under way: a blocking caller may
        take the connection."""
        return not (self.closing or self.in_flight or self.backlog or not self.mailbox.empty())

    # ------------------------------------------------------------------------ the drivers

    def park(self) -> None:
        """The I/O thread with nothing in flight: sleep on the wake-up socket only (a blocking
        caller may drive the connection meanwhile); the heartbeat interval wakes us for the
        keep-alive ping.

        A blocking caller polls the same wake-up socket: when there is work in the inbox
        (close, other threads' requests) the byte we drained is written again, or a caller that
        polled just after we drained would sleep through it."""
        mailbox = self.mailbox
        mailbox.parked = True
        if mailbox.empty():
            self.wake_poller.poll(self.beat_ms)
        mailbox.parked = False
        mailbox.drain_wake()
        if not mailbox.empty():
            mailbox.wake()

    def drive(self, calls: list[Call]) -> None:
        """A blocking caller drives the connection until its ``calls`` are done; it also sends
        what other threads post meanwhile (its calls may wait on theirs)."""
        mailbox, items = self.mailbox, self.poll_items
        io_thread.active = True
        try:
            if self._first_reply(calls) and mailbox.empty():
                self.deadlines.next()       # drops the settled calls' timers (and results)
                return
            while not all_done(calls):
                mailbox.polling = True
                timeout = 0 if not mailbox.empty() else self.poll_timeout_ms()
                events = dict(zmq_poll(items, timeout))
                mailbox.polling = False
                if not self.handle(events, calls):
                    for call in calls:
                        fail_call(call, ClientClosed("the client was closed"))
                    return
        finally:
            io_thread.active = False

    def _first_reply(self, calls: list[Call]) -> bool:
        """A blocking caller's first wait, when its calls alone are in flight: on the DEALER
        only, for at most ``link.WAIT_SLICE_MS`` (its ``RCVTIMEO``), the message that comes
        read as any reply; True once that settled the calls. The poll rounds of :meth:`drive` (the
        monitor, the deadlines, the wake-up socket) take over after it."""
        if not calls or self.backlog or len(self.in_flight) != len(calls):
            return False
        dealer = self.dealer
        try:
            frame = dealer.recv(copy=False)
        except zmq.Again:
            return False
        if len(calls) == 1 and not frame.more and self._was_ack(calls[0], frame):
            return True
        frames = [frame]
        while frame.more:
            frame = dealer.recv(zmq.NOBLOCK, copy=False)
            frames.append(frame)
        self._on_reply(frames)
        return all_done(calls)

    def _was_ack(self, call: Call, frame: zmq.Frame) -> bool:
        """Settle ``call`` if ``frame`` is its success reply without fields (an Ack: the bytes
        ``protocol.BARE_REPLY_HEAD`` and its id), which decodes to one known instance: no header
        to parse, no reply to build. Anything else is :meth:`_on_reply`'s."""
        ack = _ACKS.get(call.cmd)
        if ack is None or frame.bytes != _ACK_HEAD + p.pack_id(call.req_id):
            return False
        if self.in_flight.pop(call.req_id, None) is None:
            return False
        self.in_flight_bytes -= call.nbytes
        call.settled = True
        try:
            settle(call, call.on_reply(ack, []) if call.on_reply else ack, None)
        except BaseException as exc:
            fail_call(call, exc)
        return True

    # ------------------------------------------------------------------------ one round

    def step(self) -> bool:
        """One round of the I/O thread; False once close() was asked for.

        While the backlog waits for room in the window, new requests would only queue behind
        it: submitters do not wake the thread then (a pipelining caller would keep it spinning),
        and it looks at its inbox at the next reply, or within ``BLOCKED_POLL_MS``."""
        if self.closing:        # a blocking caller saw close() and gave the connection back
            return False
        mailbox = self.mailbox
        blocked = bool(self.backlog)
        if not blocked:
            mailbox.parked = True           # then look again: a post may have raced us
        if not self.in_flight and not blocked:
            timeout = 0                     # idle: look, then park
        elif not blocked and not mailbox.empty():
            timeout = 0
        else:
            timeout = self.poll_timeout_ms()
            if blocked and timeout > BLOCKED_POLL_MS:
                timeout = BLOCKED_POLL_MS
        events = dict(zmq_poll(self.poll_items, timeout))
        mailbox.parked = False
        return self.handle(events)

    def handle(self, events: dict[Any, int], calls: list[Call] | None = None) -> bool:
        """Handle what ``poll`` reported: replies before a disconnect (they made it), then
        connection events, then new requests; False once close() was asked for. ``calls``:
        a blocking caller's, whose replies end its reading."""
        mailbox = self.mailbox
        if self.wake_fd in events:
            mailbox.drain_wake()       # undrained, it would keep every poll returning at once
        if self.dealer in events or self.monitor in events:
            self.receive(calls)
        if self.monitor in events:
            self.link.read_monitor()
        if not mailbox.empty() and not self._take_inbox():
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
        """Take what was submitted: a call goes out at once while nothing waits ahead of it and
        the window has room (no stop in the backlog on the way: each is a few Python calls per
        request of a pipelining caller), the rest to the backlog; False when close() was asked
        for."""
        if self.closing:
            return False
        inbox, link, in_flight, backlog = self.mailbox.inbox, self.link, self.in_flight, \
            self.backlog
        watch = self.deadlines.watch
        window, window_bytes, trace = self.options.window, self.options.window_bytes, self.trace
        up = not link.down      # nothing in this loop changes the link's state
        sent = False
        while not inbox.empty():            # one consumer: what empty() says holds
            item = inbox.get_nowait()
            if item is None:
                self.link.goodbye()
                self.closing = True
                return False
            if not up or type(item) is not Call:
                self.admit(item)
            elif not backlog and (not in_flight or (
                    len(in_flight) < window and
                    self.in_flight_bytes + item.nbytes <= window_bytes)):
                self.send(item, trace)
                watch(item)
                sent = True
            else:                           # admit(item), inline: the window is full
                backlog.append(item)
                watch(item)
        if sent:
            link.last_sent = time.monotonic()
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
        """Send ``call`` at once (a blocking caller's, nothing ahead of it) or queue it."""
        opts = self.options
        if self.backlog or self.link.down or (
                self.in_flight and (len(self.in_flight) >= opts.window or
                                    self.in_flight_bytes + call.nbytes > opts.window_bytes)):
            self.admit(call)
            self.send_backlog()
            return
        self.send(call, opts.trace)
        self.deadlines.watch(call)
        self.link.last_sent = time.monotonic()

    def send_backlog(self) -> None:
        """Send from the head of the backlog while the window allows."""
        backlog = self.backlog
        if not backlog:
            return
        opts, in_flight, trace = self.options, self.in_flight, self.options.trace
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
        try:    # never blocking: the queue is unbounded, EAGAIN says there is no connection
            if isinstance(frames, bytes):
                _send(self.dealer, frames if signer is None else signer.sign(frames), zmq.NOBLOCK)
            else:
                if signer is not None:
                    frames = [signer.sign(frames[0]), *frames[1:]]
                self.dealer.send_multipart(frames, zmq.NOBLOCK, copy=call.nbytes < zmq.COPY_THRESHOLD)
        except zmq.Again:
            fail_call(call, self.link.unsendable())
            return
        call.frames = SENT
        call.sent = True
        self.in_flight[call.req_id] = call
        self.in_flight_bytes += call.nbytes

    def _open_reservation(self, slot: Reservation) -> bool:
        """Replace a filled reservation at the head by its calls; False while it is open."""
        with self.mailbox.lock:
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
        """Take the replies that are in (up to ``READ_BATCH`` at a time); with ``calls`` (a
        blocking caller's), stop once they are done. Every ``REFILL_EVERY`` replies the window
        is topped up from the backlog (settle them all first, and the worker would run dry
        meanwhile).

        The I/O thread reads what is in before it settles any of it: a thread waiting on these
        futures then wakes once per batch, not once per reply (each receive lets go of the
        GIL, and a woken waiter would take it between every two replies)."""
        self._read(calls)

    def _read(self, calls: list[Call] | None) -> None:
        if calls is not None:
            self._read_for(calls)
            return
        dealer, more, replies = self.dealer, zmq.NOBLOCK, []
        for _ in range(READ_BATCH):
            try:
                frame = dealer.recv(more, copy=False)
            except zmq.Again:
                break
            frames = [frame]
            while frame.more:           # the rest of a message is there with its first part
                frame = dealer.recv(more, copy=False)
                frames.append(frame)
            replies.append(frames)
        settle_ack, on_reply = self._settle_ack, self._on_reply
        for count, frames in enumerate(replies, 1):
            if len(frames) != 1 or not settle_ack(frames[0].bytes):
                on_reply(frames)
            if not count % REFILL_EVERY and self.backlog:
                self.send_backlog()

    def _read_for(self, calls: list[Call]) -> None:
        """A blocking caller's reading: each reply settled as it comes, until ``calls`` are."""
        dealer, more = self.dealer, zmq.NOBLOCK
        for count in range(1, READ_BATCH + 1):
            try:
                frame = dealer.recv(more, copy=False)
            except zmq.Again:
                return
            frames = [frame]
            while frame.more:
                frame = dealer.recv(more, copy=False)
                frames.append(frame)
            if len(frames) != 1 or not self._settle_ack(frames[0].bytes):
                self._on_reply(frames)
            if all_done(calls):
                return
            if not count % REFILL_EVERY and self.backlog:
                self.send_backlog()

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        """Settle the call that ``frames`` answer (an Ack is :meth:`_settle_ack`'s first)."""
        try:
            header = p.unpack_header(frames[0])
        except RpcError as exc:
            log.warning("dropping an unreadable reply: %s", exc)
            return
        if header[0] == ErrorCode.NO_SESSION:
            self.link.session_lost(header[2] if len(header) > 2 else "")
        call = self.in_flight.pop(header[1], None)
        if call is None:    # a reply to a request that already timed out, or a heartbeat
            if header[1] == 0 and header[0] == STATUS_OK and len(header) > 2:
                try:
                    self._note(p.decode_reply(Cmd.PING, header))
                except RpcError as exc:
                    log.warning("dropping an unreadable heartbeat reply: %s", exc)
            return
        self.in_flight_bytes -= call.nbytes
        received = time.perf_counter_ns() if self.trace else 0
        call.settled = True
        try:
            if len(header) == 2 and len(frames) == 1 and header[0] == STATUS_OK:
                ack = _ACKS.get(call.cmd)     # what decode_reply would return, as is
                if ack is not None:
                    settle(call, call.on_reply(ack, []) if call.on_reply else ack, None)
                    return
            result = p.decode_reply(call.cmd, header)
            if isinstance(result, RpcError):
                settle(call, None, result)
            else:
                self._note(result)
                check_reply_payload(call.cmd, result, frames)
                settle(call, call.on_reply(result, frames[1:]) if call.on_reply else result,
                       None)
                if received and getattr(result, "timing", None):
                    self.timings.append(timing(call, result, received))
        except BaseException as exc:
            fail_call(call, exc)

    def _note(self, reply: p.Message | RpcError) -> None:
        """What a reply says about the worker itself: that it is leaving (1.14)."""
        if getattr(reply, "draining", False) and not self.draining.is_set():
            log.warning("worker %s is draining (leaving): move off it", self.endpoint)
            self.draining.set()

    def _settle_ack(self, data: bytes) -> bool:
        """Settle the call that ``data`` answers if it is that call's Ack (its bytes
        ``protocol.BARE_REPLY_HEAD`` and the id, for a command whose reply is an Ack): the id
        read from its bytes, no header to parse, no reply to build. False, and nothing done,
        for anything else (:meth:`_on_reply` reads it as any reply)."""
        if data[:2] != _ACK_HEAD or len(data) < 3:
            return False
        tag = data[2]         # the id: a positive fixint, or 0xcc-0xcf and its bytes
        req_id = int.from_bytes(data[3:], "big") if tag >= 0xcc else tag
        call = self.in_flight.get(req_id)
        if call is None:
            return False
        ack = _ACKS.get(call.cmd)
        if ack is None or data != _ACK_HEAD + p.pack_id(req_id):
            return False
        del self.in_flight[req_id]
        self.in_flight_bytes -= call.nbytes
        call.settled = True
        try:
            value = call.on_reply(ack, []) if call.on_reply else ack
            future = call.future
            if future is None:
                call.value = value
            else:
                future.set_result(value)
        except BaseException as exc:
            fail_call(call, exc)
        return True

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
        fail_call(call, Timeout(f"{call.cmd.name} to {self.endpoint}: no reply "
                                  f"within the timeout ({where})"))

    def _expire_reservation(self, slot: Reservation) -> None:
        with self.mailbox.lock:
            if slot.calls is None:
                slot.error = Timeout(f"a request to {self.endpoint} was not decided "
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
        with self.mailbox.lock:
            for slot in items:
                if isinstance(slot, Reservation):
                    slot.error = slot.error or exc
                    calls.extend(slot.calls or ())
        for call in calls:
            fail_call(call, exc)

    def fail_all(self, exc: RpcError) -> None:
        self.fail_pending(exc)
        self.mailbox.fail_posted(exc)

    def close(self) -> None:
        self.link.close()


def _acks() -> dict[Cmd, p.Message]:
    """Per command whose success reply has no fields and no payload (an Ack): the one instance
    such a reply decodes to (a success reply of its bytes decodes to this very object)."""
    acks = {}
    for cmd in p.REQUESTS:
        try:
            first, second = (p.decode_reply(cmd, [STATUS_OK, 0]) for _ in range(2))
        except RpcError:
            continue                    # a reply with required fields
        if first is second and isinstance(first, p.Message) and not first.payload_count():
            acks[cmd] = first
    return acks


_ACKS = _acks()
_ACK_HEAD = p.BARE_REPLY_HEAD


def check_reply_payload(cmd: Cmd, reply: p.Message, frames: list[zmq.Frame]) -> None:
    expected = reply.payload_count()
    if len(frames) - 1 != expected:
        raise BadRequest(f"{cmd.name} reply has {len(frames) - 1} payload frame(s), "
                           f"expected {expected}")
