"""The client engine: one I/O thread that alone owns a worker connection's DEALER socket.

Callers (any thread) encode their request and hand it over with :meth:`Engine.submit`, which returns
a ``concurrent.futures.Future`` at once. The I/O thread sends requests in submission order while
keeping at most ``window`` requests and ``window_bytes`` payload bytes in flight (so no high-water
mark anywhere ever drops a reply), matches replies to futures by request id, lands reply payloads
where the caller asked (the one copy on receive), and fails futures on timeout, on connection loss,
and on close. No future is left hanging.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..broker import protocol as p
from ..broker.errors import (
    AuthenticationFailed,
    BadRequest,
    ClientClosed,
    ConnectionLost,
    RpcError,
    Timeout,
)
from ..broker.protocol import Cmd
from .security import CurveClient

log = logging.getLogger("zmq_rpc.client")

OnReply = Callable[[p.Message, list[zmq.Frame]], Any]
"""Turns a decoded reply and its payload frames into the future's result (runs on the I/O thread)."""


DEFAULT_WINDOW_BYTES = 64 << 20
"""Payload bytes in flight per client (sixteen 4 MiB chunks). 16 and 32 MiB moved 16 and 256 MiB
on loopback as fast within this machine's noise; each byte in flight is a message the worker holds
until its backend thread copies it out, so a client that shares a worker with many others can pass
a smaller ``window_bytes``."""


@dataclass
class Call:
    """One request on its way: its frames, its future and its deadline."""

    cmd: Cmd
    req_id: int
    frames: list[Any]
    future: Future[Any]
    deadline: float
    on_reply: OnReply | None
    nbytes: int = 0
    sent: bool = False


@dataclass
class EngineOptions:
    """How the engine paces and guards its requests."""

    timeout: float = 60.0
    window: int = 512
    window_bytes: int = DEFAULT_WINDOW_BYTES
    heartbeat: float = 2.0
    zmq_heartbeat_ms: int = 1000
    zmq_heartbeat_timeout_ms: int = 5000
    identity: bytes = field(default_factory=lambda: b"z" + os.urandom(15))
    """The routing id workers key this client's session by: random, never starting with 0x00."""
    curve: CurveClient | None = None
    """Speak CURVE with this key pair to a worker with this public key (None: plain ZMTP)."""


class Engine:
    """One connection to one worker, driven by a background I/O thread."""

    def __init__(self, endpoint: str, options: EngineOptions | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.endpoint = endpoint
        self.options = options or EngineOptions()
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = ctx or zmq.Context()
        self._ids = itertools.count(1)
        self._inbox: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._io_sleeping = False
        """Set by the I/O thread just before it blocks; submitters wake it only then."""
        self._closed = False
        self._close_lock = threading.Lock()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zmq-rpc-client-io", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    # ------------------------------------------------------------------ any thread

    def submit(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
               on_reply: OnReply | None = None, timeout: float | None = None,
               reply_bytes: int = 0) -> Future[Any]:
        """Queue a request; the future resolves with ``on_reply(reply, frames)`` or the reply.

        ``reply_bytes`` (what the reply will carry) counts against the in-flight byte window
        like the payload does, so large downloads are paced too.
        """
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()
        if self._closed:
            future.set_exception(ClientClosed("the client is closed"))
            return future
        req_id = next(self._ids)
        frames = [p.encode_request(cmd, req_id, msg), *payload]
        wait = self.options.timeout if timeout is None else timeout
        nbytes = sum(memoryview(f).nbytes for f in payload) + reply_bytes
        self._inbox.put(Call(cmd, req_id, frames, future, time.monotonic() + wait, on_reply,
                             nbytes))
        if self._io_sleeping:
            os.eventfd_write(self._wake_fd, 1)
        return future

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is pending with ClientClosed, close the socket, join the thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put(None)
        os.eventfd_write(self._wake_fd, 1)
        self._thread.join(timeout)
        os.close(self._wake_fd)
        if self._own_ctx:
            self.ctx.term()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ I/O thread only

    def _run(self) -> None:
        _io_thread.active = True
        try:
            io = _IoLoop(self)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            io.loop()
        except BaseException as exc:  # never leave futures hanging, even on a bug
            log.exception("client I/O thread failed")
            io.fail_all(ConnectionLost(f"client I/O thread failed: {exc}"))
        finally:
            io.fail_all(ClientClosed("the client was closed"))
            io.close()


_io_thread = threading.local()


def on_io_thread() -> bool:
    """Whether the caller is a client I/O thread (a future callback): it must never block."""
    return getattr(_io_thread, "active", False)


class _IoLoop:
    """State of the I/O thread: the DEALER, the monitor, the calls in flight and their deadlines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        opts = engine.options
        self.dealer = engine.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.ROUTING_ID, opts.identity)
        self.dealer.setsockopt(zmq.SNDHWM, 0)
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        self.dealer.setsockopt(zmq.HEARTBEAT_IVL, opts.zmq_heartbeat_ms)
        self.dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.zmq_heartbeat_timeout_ms)
        self.dealer.setsockopt(zmq.HEARTBEAT_TTL, opts.zmq_heartbeat_timeout_ms)
        self.dealer.setsockopt(zmq.LINGER, 0)
        if opts.curve is not None:
            self.dealer.setsockopt(zmq.CURVE_SERVERKEY, opts.curve.server_key)
            self.dealer.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve.keys.public)
            self.dealer.setsockopt(zmq.CURVE_SECRETKEY, opts.curve.keys.secret)
        self.monitor = self.dealer.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | _HANDSHAKE_FAILED)
        self.dealer.connect(engine.endpoint)
        self.backlog: deque[Call] = deque()
        self.in_flight: dict[int, Call] = {}
        self.in_flight_bytes = 0
        self.deadlines: list[tuple[float, int]] = []
        self.last_sent = time.monotonic()
        self.connected = False
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.poller.register(engine._wake_fd, zmq.POLLIN)

    def loop(self) -> None:
        engine = self.engine
        while True:
            engine._io_sleeping = True      # then look again: a submit may have raced us
            timeout = 0 if not engine._inbox.empty() else self._poll_timeout_ms()
            events = dict(self.poller.poll(timeout))
            engine._io_sleeping = False
            if engine._wake_fd in events:
                os.eventfd_read(engine._wake_fd)
            if not self._take_inbox():
                return
            if self.dealer in events:
                self._receive()
            if self.monitor in events:
                self._on_monitor()
            self._send_backlog()
            self._expire(time.monotonic())
            self._heartbeat()

    def _poll_timeout_ms(self) -> int:
        if not self.deadlines:
            return int(self.engine.options.heartbeat * 1000)
        wait = self.deadlines[0][0] - time.monotonic()
        return max(0, min(int(wait * 1000) + 1, int(self.engine.options.heartbeat * 1000)))

    def _take_inbox(self) -> bool:
        """Move submitted calls to the backlog; False when close() was asked for."""
        while True:
            try:
                call = self.engine._inbox.get_nowait()
            except queue.Empty:
                return True
            if call is None:
                self._goodbye()
                return False
            self.backlog.append(call)
            heapq.heappush(self.deadlines, (call.deadline, call.req_id))
            if len(self.deadlines) > 2 * (len(self.in_flight) + len(self.backlog)) + 4096:
                self._compact_deadlines()

    def _send_backlog(self) -> None:
        opts = self.engine.options
        while self.backlog:
            call = self.backlog[0]
            if self.in_flight and (len(self.in_flight) >= opts.window or
                                   self.in_flight_bytes + call.nbytes > opts.window_bytes):
                return
            self.backlog.popleft()
            if call.future.done():
                continue
            self.dealer.send_multipart(call.frames, copy=call.nbytes < zmq.COPY_THRESHOLD)
            call.frames = []
            call.sent = True
            self.in_flight[call.req_id] = call
            self.in_flight_bytes += call.nbytes
            self.last_sent = time.monotonic()

    def _receive(self) -> None:
        for _ in range(1024):
            try:
                frames = self.dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_reply(frames)

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        try:
            header = p.unpack_header(frames[0].buffer)
        except RpcError as exc:
            log.warning("dropping an unreadable reply: %s", exc)
            return
        call = self.in_flight.pop(header[1], None)
        if call is None:
            return  # a reply to a request that already timed out, or a heartbeat
        self.in_flight_bytes -= call.nbytes
        if call.future.done():
            return
        try:
            result = p.decode_reply(call.cmd, header)
            if isinstance(result, RpcError):
                call.future.set_exception(result)
            else:
                _check_reply_payload(call.cmd, result, frames)
                value = call.on_reply(result, frames[1:]) if call.on_reply else result
                call.future.set_result(value)
        except BaseException as exc:
            call.future.set_exception(exc)

    def _compact_deadlines(self) -> None:
        """Drop heap entries of answered calls (they otherwise stay until their deadline)."""
        live = [*self.in_flight.values(), *self.backlog]
        self.deadlines = [(c.deadline, c.req_id) for c in live if not c.future.done()]
        heapq.heapify(self.deadlines)

    def _expire(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, req_id = heapq.heappop(self.deadlines)
            call = self.in_flight.pop(req_id, None)
            if call is not None:
                self.in_flight_bytes -= call.nbytes  # its late reply, if any, is dropped
            else:
                call = next((c for c in self.backlog if c.req_id == req_id), None)
            if call is not None and not call.future.done():
                where = "waiting to be sent" if not call.sent else "sent, no reply"
                call.future.set_exception(Timeout(
                    f"{call.cmd.name} to {self.engine.endpoint}: no reply within the timeout "
                    f"({where})"))

    def _heartbeat(self) -> None:
        if time.monotonic() - self.last_sent >= self.engine.options.heartbeat:
            self.dealer.send(p.encode_request(Cmd.PING, 0, p.Empty()))
            self.last_sent = time.monotonic()

    def _on_monitor(self) -> None:
        while self.monitor.poll(0):
            message = recv_monitor_message(self.monitor)
            event = message["event"]
            if event & _HANDSHAKE_FAILED:
                self._handshake_failed(event, message["value"])
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self.fail_pending(ConnectionLost(
                    f"connection to {self.engine.endpoint} lost; requests in flight may or may "
                    "not have run, queued ones were not sent"))
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                self.connected = True

    def _handshake_failed(self, event: int, value: int) -> None:
        """The worker refused us (ZAP said no), or the handshake broke (a wrong server key, one
        side without CURVE): fail what waits now rather than at its timeout. libzmq retries."""
        self.connected = False
        where = self.engine.endpoint.partition("#")[0]
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"the worker at {where} refused this client's CURVE key (ZAP status {value}): "
                   "its public key must be in the worker's --authorized-keys directory")
        elif self.engine.options.curve is not None:
            why = (f"the CURVE handshake with {where} failed ({_handshake_error(value)}): is the "
                   "worker's public key right, and does the worker run with "
                   "--curve-secret-key?")
        else:
            why = (f"the handshake with {where} failed ({_handshake_error(value)}): the worker "
                   "may require CURVE (pass curve_key= and the worker's key)")
        self.fail_pending(AuthenticationFailed(why))

    def fail_in_flight(self, exc: RpcError) -> None:
        for call in self.in_flight.values():
            if not call.future.done():
                call.future.set_exception(exc)
        self.in_flight.clear()
        self.in_flight_bytes = 0

    def fail_pending(self, exc: RpcError) -> None:
        """Fail what is in flight and what waits to be sent."""
        self.fail_in_flight(exc)
        for call in self.backlog:
            if not call.future.done():
                call.future.set_exception(exc)
        self.backlog.clear()

    def fail_all(self, exc: RpcError) -> None:
        self.fail_pending(exc)
        while True:
            try:
                call = self.engine._inbox.get_nowait()
            except queue.Empty:
                return
            if call is not None and not call.future.done():
                call.future.set_exception(exc)

    def _goodbye(self) -> None:
        """Tell the worker to free our session now (best effort, not waited for)."""
        if self.connected:
            self.dealer.send(p.encode_request(Cmd.GOODBYE, 0, p.Empty()))

    def close(self) -> None:
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=200 if self.connected else 0)


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _handshake_error(value: int) -> str:
    """libzmq's handshake failure value: a ZMQ_PROTOCOL_ERROR_* code, else an errno."""
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name[len("PROTOCOL_ERROR_"):].lower().replace("_", " ")
    return zmq.strerror(value) if 0 < value < 0x10000000 else f"code 0x{value:x}"


def _check_reply_payload(cmd: Cmd, reply: p.Message, frames: list[zmq.Frame]) -> None:
    expected = reply.payload_count()
    if len(frames) - 1 != expected:
        raise BadRequest(f"{cmd.name} reply has {len(frames) - 1} payload frame(s), "
                           f"expected {expected}")
