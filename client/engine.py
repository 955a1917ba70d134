"""The client engine: one worker connection, its DEALER socket, and the futures of its requests.

Threads: callers (any thread) hand requests over with :meth:`Engine.submit`, which returns a
``concurrent.futures.Future`` at once. The connection's state (:class:`~.io_loop.IoLoop`: the
DEALER and its monitor in :class:`~.link.Link`, the calls in flight, their
:class:`~.deadlines.Deadlines`) has one owner at a time, whoever holds ``Engine._socket_lock``
(the lock's acquire and release are the full memory barrier zmq asks for when a socket changes
threads):

- the **I/O thread** (``zmq-rpc-client-io``), which sends requests in submission order while
  keeping at most ``window`` requests and ``window_bytes`` payload bytes in flight (so no
  high-water mark anywhere drops a reply), matches replies to futures, lands reply payloads
  where the caller asked, and fails futures on timeout, connection loss and close. When nothing
  is in flight it lets go of the lock and sleeps on its wake-up socket;
- a **caller in a synchronous call** (:meth:`Engine.request` for one request, with no future at
  all; :meth:`Engine.call` / :meth:`Engine.inline` for several) that finds the engine idle: it
  takes the lock (``handover.py``), sends its requests and reads their replies itself
  (``inline.py``), with no hop through the I/O thread, still watching the monitor, the deadlines
  and the wake-up socket (close, other threads' requests, which it sends too), then gives the
  lock back.

This module owns submission (any thread), the lock, the wake-up socket, and the I/O thread's
life (start, park, finish); :class:`~.handover.Handover`, its base, the blocking calls.

The futures are :class:`~.futures.RunningFuture` (a lock each, a Condition only for a thread
that waits); readers blocked on futures settled in one batch of replies are woken together.

Failure detection (the README's contract): a worker that dies, freezes or becomes unreachable
fails every request in flight and every new one with ``ConnectionLost`` once libzmq's heartbeat
(``zmq_heartbeat_ms``/``zmq_heartbeat_timeout_ms``, 0.5 s/5 s) or the kernel (a closed socket)
says so; while the connection is down new requests fail at once. A worker that answers but no
longer knows our session (restarted at the same address, or the session expired) fails them with
``SessionLost``, for good. No future is left hanging.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import zmq

from ..broker import protocol as p
from ..broker.endpoints import EndpointError, parse_endpoint
from ..broker.errors import BadEndpoint, ClientClosed, ConnectionLost
from ..broker.protocol import Cmd
from ..broker.request_mac import Signer
from .calls import Call, OnReply, Reservation, drain_inbox, fail_call, fail_item
from .calls import RequestTiming as RequestTiming
from .futures import RunningFuture
from .handover import Handover, Local
from .inline import pump_together
from .io_loop import IoLoop, io_thread
from .io_loop import on_io_thread as on_io_thread
from .security import CurveClient

log = logging.getLogger("zmq_rpc.client")

DEFAULT_WINDOW_BYTES = 64 << 20
"""Payload bytes in flight per client (sixteen 4 MiB chunks). 16 and 32 MiB moved 16 and 256 MiB
on loopback as fast within this machine's noise; each byte in flight is a message the worker holds
until its backend thread copies it out, so a client that shares a worker with many others can pass
a smaller ``window_bytes``."""


MAX_TIMINGS = 100_000
"""Timings kept until read (:meth:`Engine.drain_timings`); older ones are dropped."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if zmq-rpc can connect to it, else :class:`BadEndpoint` saying why (read
    the way libzmq reads it: :mod:`zmq_rpc.broker.endpoints`)."""
    try:
        parse_endpoint(endpoint, wildcard_port=False)
    except EndpointError as exc:
        raise BadEndpoint(str(exc)) from None
    return endpoint


@dataclass
class EngineOptions:
    """How the engine paces and guards its requests."""

    timeout: float = 60.0
    window: int = 512
    window_bytes: int = DEFAULT_WINDOW_BYTES
    heartbeat: float = 2.0
    """Seconds of silence after which the client pings the worker (keeps the session alive)."""
    zmq_heartbeat_ms: int = 500
    zmq_heartbeat_timeout_ms: int = 5000
    """libzmq's ZMTP heartbeat: a worker silent this long after a heartbeat is declared lost."""
    identity: bytes = field(default_factory=lambda: b"z" + os.urandom(15))
    """The routing id workers key this client's session by: random, never starting with 0x00."""
    trace: bool = False
    """Record a :class:`RequestTiming` per request whose reply carries the worker's timing."""
    curve: CurveClient | None = None
    """Speak CURVE with this key pair to a worker with this public key (None: plain ZMTP)."""


class Engine(Handover):
    """One connection to one worker: an I/O thread, and the caller's thread when it is idle."""

    def __init__(self, endpoint: str, options: EngineOptions | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.endpoint = check_endpoint(endpoint)
        self.options = options or EngineOptions()
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = ctx or zmq.Context()
        self._ids = itertools.count(1)
        self._inbox: queue.SimpleQueue[Call | Reservation | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._io_sleeping = False
        """Set by the I/O thread just before it blocks; submitters wake it only then."""
        self._pump_sleeping = False
        """The same for a caller driving the connection inline."""
        self._closed = False
        self._submit_lock = threading.Lock()
        """Orders submissions against close(): nothing is queued after the close marker."""
        self._socket_lock = threading.Lock()
        """Held by whoever drives the connection (see the module docstring)."""
        self._local = Local()
        self._io: IoLoop | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.timings: deque[RequestTiming] = deque(maxlen=MAX_TIMINGS)
        """Appended by the I/O thread (``trace``); read with :meth:`drain_timings`."""
        self._thread = threading.Thread(target=self._run, name="zmq-rpc-client-io", daemon=True)
        self._thread.start()
        self._started.wait()
        error = self._failed_start()
        if error is not None:
            self._thread.join()
            raise error

    def _failed_start(self) -> BaseException | None:
        """What stopped the I/O thread from opening the connection, if anything."""
        return self._start_error

    # ------------------------------------------------------------------ any thread

    def submit(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
               on_reply: OnReply | None = None, timeout: float | None = None,
               reply_bytes: int = 0) -> Future[Any]:
        """Queue a request; the future resolves with ``on_reply(reply, frames)`` or the reply.

        ``reply_bytes`` (what the reply will carry) counts against the in-flight byte window
        like the payload does, so large downloads are paced too.
        """
        future: Future[Any] = RunningFuture()
        self._enqueue(self._new_call(cmd, msg, payload, on_reply, timeout, reply_bytes, future))
        return future

    def _new_call(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any],
                  on_reply: OnReply | None, timeout: float | None, reply_bytes: int,
                  future: Future[Any] | None) -> Call:
        req_id = next(self._ids)
        header = p.encode_request(cmd, req_id, msg)
        wait = self.options.timeout if timeout is None else timeout
        frames: bytes | list[Any]
        if payload:
            frames = [header, *payload]
            nbytes = sum(memoryview(f).nbytes for f in payload) + reply_bytes
        else:
            frames, nbytes = header, reply_bytes
        return Call(cmd, req_id, frames, future, time.monotonic() + wait, on_reply, nbytes,
                    submitted_ns=time.perf_counter_ns() if self.options.trace else 0)

    def reserve(self, timeout: float | None = None) -> Reservation:
        """Hold a place in the send order; fill it with :meth:`filling` (from any thread).

        Until it is filled nothing submitted after it is sent. Unfilled after ``timeout`` (the
        request timeout by default), what fills it fails with ``Timeout``.
        """
        wait = self.options.timeout if timeout is None else timeout
        slot = Reservation(next(self._ids), time.monotonic() + wait)
        self._enqueue(slot)
        return slot

    @contextmanager
    def filling(self, slot: Reservation) -> Iterator[None]:
        """Requests this thread submits to this engine inside the block fill ``slot``."""
        calls: list[Call] = []
        outer = self._local.filling
        self._local.filling = calls
        try:
            yield
        finally:
            self._local.filling = outer
            with self._submit_lock:
                error = slot.error
                if error is None:
                    slot.calls = calls
            if error is not None:
                for call in calls:
                    fail_call(call, error)
            self._wake()

    def close(self, timeout: float | None = None) -> None:
        """Fail what is pending with ClientClosed, say goodbye, close the socket and the context,
        join the I/O thread. Idempotent; from a future callback it returns without joining."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(None)
        self._wake()
        if not on_io_thread():        # a callback on a thread that drives the connection
            self._thread.join(timeout)

    def sign_from_now(self, key: bytes) -> None:
        """Sign every request sent from now on with ``key`` (protocol 1.10,
        ``broker/request_mac.py``). Only for the thread that drives the connection, i.e. from a
        reply's ``on_reply`` (HELLO's): nothing can be sent between that reply and this."""
        if self._io is not None:             # always, once a reply came in
            self._io.link.signer = Signer(key)

    def drain_timings(self) -> list[RequestTiming]:
        """The timings recorded since the last call, oldest first (any thread)."""
        out = []
        while self.timings:
            out.append(self.timings.popleft())
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def _enqueue(self, item: Call | Reservation) -> None:
        local = self._local
        filling = local.filling
        if filling is not None and isinstance(item, Call):
            filling.append(item)
            return
        io = local.io
        if io is not None:          # in an inline block: this thread owns the connection
            if isinstance(item, Call):
                local.calls.append(item)
                io.send_now(item)
            else:
                io.admit(item)
            return
        with self._submit_lock:
            if not self._closed:
                self._inbox.put(item)
                if self._io_sleeping or self._pump_sleeping:  # one wake-up per sleep
                    self._io_sleeping = self._pump_sleeping = False
                    self._wake()
                return
        fail_item(item, ClientClosed("the client is closed"))

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass      # full: a wake-up is already pending; closed: nobody to wake

    # ------------------------------------------------------------------ I/O thread only

    def _run(self) -> None:
        io_thread.active = True
        try:
            io = IoLoop(self)
        except BaseException as exc:
            self._start_error = _as_rpc_error(self.endpoint, exc)
            self._finish(None)
            self._started.set()
            return
        self._io = io
        self._started.set()
        try:
            self._serve(io)
        except BaseException as exc:  # never leave futures hanging, even on a bug
            log.exception("client I/O thread failed")
            with self._socket_lock:
                io.fail_all(ConnectionLost(f"client I/O thread failed: {exc}"))
        finally:
            self._finish(io)

    def _serve(self, io: IoLoop) -> None:
        while True:
            with self._socket_lock:
                while True:
                    if not io.step():
                        return
                    if not io.busy() and self._inbox.empty():
                        break
            self._park(io)

    def _park(self, io: IoLoop) -> None:
        """Nothing in flight: sleep on the wake-up socket only (an inline caller may drive the
        connection meanwhile); the heartbeat interval wakes us for the keep-alive ping.

        A caller driving the connection polls the same wake-up socket: when there is work in
        the inbox (close, other threads' requests) the byte we drained is written again, or
        a caller that polled just after we drained would sleep through it (its poll's
        timeout: up to a heartbeat interval, or its deadline)."""
        self._io_sleeping = True
        if self._inbox.empty():
            io.wake_poller.poll(int(self.options.heartbeat * 1000))
        self._io_sleeping = False
        self._drain_wake()
        if not self._inbox.empty():
            self._wake()    # the wake-up may have been a synchronous caller's: keep it for its poll

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _finish(self, io: IoLoop | None) -> None:
        """Every path out of the I/O thread: fail what is left, close sockets and context."""
        with self._submit_lock:
            self._closed = True
        with self._socket_lock:
            if io is not None:
                io.fail_all(ClientClosed("the client was closed"))
                io.close()
            else:
                drain_inbox(self._inbox, ClientClosed("the client failed to start"))
        self._wake_r.close()
        self._wake_w.close()
        if self._own_ctx:
            self.ctx.term()


def call_together(engines: Sequence[Engine], issue: Callable[[], Future[Any]]) -> Any:
    """``issue().result()`` with every connection of ``engines`` driven on this thread when all
    are idle: the requests go out at once and the replies are read here, one poll over all the
    sockets (a cross-worker copy waits on two workers, and a hop through an I/O thread costs a
    wake-up and the GIL). Otherwise (one is busy) :meth:`Engine.call` on the first."""
    taken: list[tuple[Engine, IoLoop]] = []
    for engine in engines:
        io = engine._take_idle()
        if io is None:
            for held, held_io in taken:
                held._give_back(held_io)
            return engines[0].call(issue)
        taken.append((engine, io))
    calls: list[Call] = []
    for engine, io in taken:
        engine._local.io, engine._local.calls = io, calls
    try:
        future = issue()
        pump_together([io for _, io in taken], future, calls)
    finally:
        for engine, io in taken:
            engine._give_back(io)
    return future.result()


def _as_rpc_error(endpoint: str, exc: BaseException) -> BaseException:
    if isinstance(exc, zmq.ZMQError):
        return BadEndpoint(f"cannot connect to {endpoint!r}: {exc}")
    return exc
