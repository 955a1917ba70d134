"""The client engine: one worker connection, its DEALER socket, and the futures of its requests.

Threads: callers (any thread) hand requests over with :meth:`Engine.submit`, which returns a
``concurrent.futures.Future`` at once. The connection's state (:class:`_IoLoop`: the DEALER, its
monitor, the calls in flight and their deadlines) has one owner at a time, whoever holds
``Engine._socket_lock`` (the lock's acquire and release are the full memory barrier zmq asks for
when a socket changes threads):

- the **I/O thread** (``zmq-rpc-client-io``), which sends requests in submission order while
  keeping at most ``window`` requests and ``window_bytes`` payload bytes in flight (so no
  high-water mark anywhere drops a reply), matches replies to futures, lands reply payloads
  where the caller asked, and fails futures on timeout, connection loss and close. When nothing
  is in flight it lets go of the lock and sleeps on its wake-up socket;
- a **caller in a synchronous call** (:meth:`Engine.inline`) that finds the engine idle: it takes
  the lock, sends its requests and reads their replies itself, with no hop through the I/O
  thread (half the latency of a tiny call), then gives the lock back.

Failure detection (the README's contract): a worker that dies, freezes or becomes unreachable
fails every request in flight and every new one with ``ConnectionLost`` once libzmq's heartbeat
(``zmq_heartbeat_ms``/``zmq_heartbeat_timeout_ms``, 0.5 s/5 s) or the kernel (a closed socket)
says so; while the connection is down new requests fail at once. A worker that answers but no
longer knows our session (restarted at the same address, or the session expired) fails them with
``SessionLost``, for good. No future is left hanging.
"""

from __future__ import annotations

import heapq
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
from urllib.parse import urlsplit

import zmq
from zmq import zmq_poll
from zmq.utils.monitor import recv_monitor_message

from ..broker import protocol as p
from ..broker.errors import (
    AuthenticationFailed,
    BadEndpoint,
    BadRequest,
    ClientClosed,
    ConnectionLost,
    RpcError,
    SessionLost,
    Timeout,
)
from ..broker.protocol import Cmd, ErrorCode
from .futures import RunningFuture
from .security import CurveClient

log = logging.getLogger("zmq_rpc.client")

OnReply = Callable[[p.Message, list[zmq.Frame]], Any]
"""Turns a decoded reply and its payload frames into the future's result (runs on the thread that
owns the connection at that moment)."""


DEFAULT_WINDOW_BYTES = 64 << 20
"""Payload bytes in flight per client (sixteen 4 MiB chunks). 16 and 32 MiB moved 16 and 256 MiB
on loopback as fast within this machine's noise; each byte in flight is a message the worker holds
until its backend thread copies it out, so a client that shares a worker with many others can pass
a smaller ``window_bytes``."""

SCHEMES = ("tcp", "ipc", "inproc")

FINISHING_WAIT = 0.002
"""How long a synchronous call waits for an idle holder to let go of the connection."""

BLOCKED_POLL_MS = 50
"""While the window is full, how often the I/O thread looks at new requests (arming their
timeouts) when no reply comes sooner."""

REFILL_EVERY = 16
"""While reading a batch of replies, send from the backlog after this many (keeps the window,
and so the worker, busy)."""


_SENT: tuple[Any, ...] = ()
_NEVER = float("inf")


@dataclass(frozen=True)
class RequestTiming:
    """Where one request's time went, in seconds: the client's clock for its own parts, the
    worker's report (protocol 1.5, ``EngineOptions.trace``) for its share. ``wire`` is the round
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


MAX_TIMINGS = 100_000
"""Timings kept until read (:meth:`Engine.drain_timings`); older ones are dropped."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if zmq-rpc can connect to it, else :class:`BadEndpoint` saying why."""
    if not isinstance(endpoint, str):
        raise BadEndpoint(f"an endpoint is a string like 'tcp://host:port', not {endpoint!r}")
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        raise BadEndpoint(f"endpoint {endpoint!r} has no scheme: write 'tcp://{endpoint}'")
    if scheme not in SCHEMES:
        raise BadEndpoint(f"endpoint {endpoint!r}: scheme {scheme!r} is not one of "
                          f"{', '.join(s + '://' for s in SCHEMES)}")
    if not rest:
        raise BadEndpoint(f"endpoint {endpoint!r} names no address")
    if scheme == "tcp":
        try:
            port = urlsplit(endpoint).port
        except ValueError:
            port = None
        if port is None or not urlsplit(endpoint).hostname:
            raise BadEndpoint(f"endpoint {endpoint!r} needs a host and a port "
                              "('tcp://host:port')")
    return endpoint


@dataclass(eq=False, slots=True)
class Call:
    """One request on its way: its frames, its future and its deadline."""

    cmd: Cmd
    req_id: int
    frames: bytes | list[Any] | tuple[Any, ...]
    """The header alone, or header and payload; an empty tuple once sent (the payload may be
    freed)."""
    future: Future[Any] | None
    """None for a synchronous call driven by its caller (:meth:`Engine.request`): its outcome
    lands in ``value``/``error`` instead."""
    deadline: float
    on_reply: OnReply | None
    nbytes: int = 0
    sent: bool = False
    settled: bool = False
    """Its future has (or is about to have) its outcome; set by whoever settles it, so the
    engine never asks the future (a lock round trip) whether it is done."""
    submitted_ns: int = 0
    sent_ns: int = 0
    """Submitted and sent, by ``perf_counter_ns`` (taken only when the engine traces)."""
    value: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        """A future-less call's result, or its error raised."""
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(eq=False)
class Reservation:
    """A place in the send order for requests decided later (:meth:`Engine.reserve`): requests
    submitted after it wait until it is filled, then go out behind what filled it."""

    req_id: int
    deadline: float
    calls: list[Call] | None = None
    """What filled it, once :meth:`Engine.filling` is done; None while open."""
    error: RpcError | None = None
    """Why it can no longer be filled (the connection failed, it expired)."""


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


class Engine:
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
        self._local = _Local()
        self._io: _IoLoop | None = None
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

    def request(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
                on_reply: OnReply | None = None, timeout: float | None = None,
                reply_bytes: int = 0) -> Any:
        """``submit(...).result()``, with no thread hop and no future when the engine is idle:
        the request goes out and its reply is read on this thread (a synchronous call of one
        request). Otherwise (busy, closed, a callback) it is submitted and waited for."""
        io = self._take_idle()
        if io is None:
            return self.submit(cmd, msg, payload, on_reply, timeout, reply_bytes).result()
        try:
            call = self._new_call(cmd, msg, payload, on_reply, timeout, reply_bytes, None)
            io.exchange(call)
        finally:
            self._release(io)
        return call.outcome()

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
                    _fail_call(call, error)
            self._wake()

    @contextmanager
    def inline(self) -> Iterator[None]:
        """Run the requests submitted from this thread inside the block on this thread, when the
        engine is idle: sent at once, their replies read here when the block ends (no thread
        hop). Otherwise (the I/O thread is busy, or this is a future callback) a no-op."""
        io = self._take_idle()
        if io is None:
            yield
            return
        calls: list[Call] = []
        self._local.io, self._local.calls = io, calls
        try:
            yield
            io.pump(calls)
        finally:
            self._give_back(io)

    def call(self, issue: Callable[..., Future[Any]], *args: Any, **kwargs: Any) -> Any:
        """``issue(*args, **kwargs).result()``, inline when the engine is idle (what
        :meth:`inline` does, without a generator in the way of every blocking call)."""
        io = self._take_idle()
        if io is None:
            return issue(*args, **kwargs).result()
        calls: list[Call] = []
        local = self._local
        local.io, local.calls = io, calls
        try:
            future = issue(*args, **kwargs)
            io.pump(calls)
        finally:
            self._give_back(io)
        return future.result()

    def _give_back(self, io: _IoLoop) -> None:
        """End of an inline call: the connection back to the I/O thread, woken if it has work."""
        self._local.io = None
        self._release(io)

    def _release(self, io: _IoLoop) -> None:
        self._socket_lock.release()
        if io.in_flight or io.backlog or io.closing or not self._inbox.empty():
            self._wake()

    def _take_idle(self) -> _IoLoop | None:
        """The connection, locked, if nothing else is using or waiting for it. Whoever holds it
        with nothing in flight or queued is finishing its last round: wait for it (at most
        ``FINISHING_WAIT`` s) rather than hand the call over."""
        io = self._io
        if io is None or self._local.io is not None or _io_thread.active:
            return None
        lock = self._socket_lock
        if not lock.acquire(blocking=False) and (
                io.in_flight or io.backlog or not lock.acquire(timeout=FINISHING_WAIT)):
            return None
        if self._closed or io.closing or io.in_flight or io.backlog or not self._inbox.empty():
            self._socket_lock.release()
            return None
        return io

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
        _fail_item(item, ClientClosed("the client is closed"))

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass      # full: a wake-up is already pending; closed: nobody to wake

    # ------------------------------------------------------------------ I/O thread only

    def _run(self) -> None:
        _io_thread.active = True
        try:
            io = _IoLoop(self)
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

    def _serve(self, io: _IoLoop) -> None:
        while True:
            with self._socket_lock:
                while True:
                    if not io.step():
                        return
                    if not io.busy() and self._inbox.empty():
                        break
            self._park(io)

    def _park(self, io: _IoLoop) -> None:
        """Nothing in flight: sleep on the wake-up socket only (an inline caller may drive the
        connection meanwhile); the heartbeat interval wakes us for the keep-alive ping."""
        self._io_sleeping = True
        if self._inbox.empty():
            io.wake_poller.poll(int(self.options.heartbeat * 1000))
        self._io_sleeping = False
        self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _finish(self, io: _IoLoop | None) -> None:
        """Every path out of the I/O thread: fail what is left, close sockets and context."""
        with self._submit_lock:
            self._closed = True
        with self._socket_lock:
            if io is not None:
                io.fail_all(ClientClosed("the client was closed"))
                io.close()
            else:
                _drain_inbox(self._inbox, ClientClosed("the client failed to start"))
        self._wake_r.close()
        self._wake_w.close()
        if self._own_ctx:
            self.ctx.term()


def call_together(engines: Sequence[Engine], issue: Callable[[], Future[Any]]) -> Any:
    """``issue().result()`` with every connection of ``engines`` driven on this thread when all
    are idle: the requests go out at once and the replies are read here, one poll over all the
    sockets (a cross-worker copy waits on two workers, and a hop through an I/O thread costs a
    wake-up and the GIL). Otherwise (one is busy) :meth:`Engine.call` on the first."""
    taken: list[tuple[Engine, _IoLoop]] = []
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
        _pump_together([io for _, io in taken], future, calls)
    finally:
        for engine, io in taken:
            engine._give_back(io)
    return future.result()


TOGETHER_GRACE_S = 0.5
"""How long :func:`call_together` still reads the replies of its other requests once its
future has succeeded (a copy's source worker answers a moment after the bytes landed): the
connections are then idle for the caller's next request. Past it (or at once when the future
failed) the I/O threads read them."""


def _pump_together(loops: Sequence[_IoLoop], future: Future[Any], calls: list[Call]) -> None:
    """:meth:`_IoLoop.pump` over several connections until every call sent here is done, or
    ``future`` failed, or it succeeded TOGETHER_GRACE_S ago (what is still due is then the I/O
    threads', woken as the connections are given back)."""
    poller = zmq.Poller()
    owner: dict[Any, _IoLoop] = {}
    for io in loops:
        for sock in (io.dealer, io.monitor, io.wake_fd):
            poller.register(sock, zmq.POLLIN)
            owner[sock] = io
    _io_thread.active = True
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
            timeout = 0 if waiting else min(io._poll_timeout_ms() for io in loops)
            if settled:
                timeout = min(timeout, int(TOGETHER_GRACE_S * 1000) + 1)
            events = dict(poller.poll(timeout))
            for io in loops:
                io.engine._pump_sleeping = False
            for io in loops:
                if not io._round({s: e for s, e in events.items() if owner[s] is io}):
                    for call in calls:
                        _fail_call(call, ClientClosed("the client was closed"))
                    return
    finally:
        _io_thread.active = False


class _Local(threading.local):
    """Per thread, per engine: where this thread's submissions go (see ``_enqueue``)."""

    io: _IoLoop | None = None
    """The connection, while this thread drives it inline."""
    calls: list[Call] = []
    """The calls this thread submitted inline (reset per inline call)."""
    filling: list[Call] | None = None
    """The calls filling a reservation (see :meth:`Engine.filling`)."""


class _IoThread(threading.local):
    active = False
    """This thread drives a connection now (an I/O thread, or an inline caller)."""


_io_thread = _IoThread()


def on_io_thread() -> bool:
    """Whether the caller is a client I/O thread (a future callback): it must never block."""
    return _io_thread.active


def _all_done(calls: list[Call]) -> bool:
    for call in calls:
        if not call.settled:
            return False
    return True


def _fail_call(call: Call, error: BaseException) -> None:
    call.settled = True
    if call.future is not None:
        _fail(call.future, error)
    elif call.error is None:
        call.value, call.error = None, error


def _settle(call: Call, value: Any, error: BaseException | None) -> None:
    """Give ``call`` its outcome: to its future, or (a synchronous call's) to its fields."""
    future = call.future
    if future is None:
        call.value, call.error = value, error
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _fail(future: Future[Any], error: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except Exception:  # noqa: BLE001 - settled meanwhile by another thread
            pass


def _fail_item(item: Call | Reservation | None, error: RpcError) -> None:
    if isinstance(item, Call):
        _fail_call(item, error)
    elif isinstance(item, Reservation):
        item.error = item.error or error


def _drain_inbox(inbox: queue.SimpleQueue[Call | Reservation | None], error: RpcError) -> None:
    while True:
        try:
            _fail_item(inbox.get_nowait(), error)
        except queue.Empty:
            return


def _as_rpc_error(endpoint: str, exc: BaseException) -> BaseException:
    if isinstance(exc, zmq.ZMQError):
        return BadEndpoint(f"cannot connect to {endpoint!r}: {exc}")
    return exc


class _IoLoop:
    """The connection's state: the DEALER, the monitor, the calls in flight, their deadlines.

    Touched only by the holder of ``Engine._socket_lock``.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        opts = engine.options
        self.dealer = engine.ctx.socket(zmq.DEALER)
        self.monitor: zmq.Socket[bytes] | None = None
        try:
            self._configure(opts)
            self.monitor = self.dealer.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
            self.dealer.connect(engine.endpoint)
        except BaseException:
            self.close()
            raise
        self.backlog: deque[Call | Reservation] = deque()
        self.in_flight: dict[int, Call] = {}
        self.in_flight_bytes = 0
        self.deadlines: list[tuple[float, int]] = []
        """A heap of (deadline, req_id): reservations, and calls whose deadline is earlier than
        the last one in ``fifo`` (a shorter timeout)."""
        self.fifo: deque[Call] = deque()
        """Calls in deadline order, the usual case (one timeout, deadlines rising with
        submission): appended and dropped in O(1), no tuple per call."""
        self.last_sent = time.monotonic()
        self.up = False
        self.ever_up = False
        self.lost: RpcError | None = None
        """Set for good when the worker no longer knows our session."""
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

    def _configure(self, opts: EngineOptions) -> None:
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.ROUTING_ID, opts.identity)
        self.dealer.setsockopt(zmq.SNDHWM, 0)
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        self.dealer.setsockopt(zmq.HEARTBEAT_IVL, opts.zmq_heartbeat_ms)
        self.dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.zmq_heartbeat_timeout_ms)
        self.dealer.setsockopt(zmq.HEARTBEAT_TTL, opts.zmq_heartbeat_timeout_ms)
        if opts.curve is not None:
            self.dealer.setsockopt(zmq.CURVE_SERVERKEY, opts.curve.server_key)
            self.dealer.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve.keys.public)
            self.dealer.setsockopt(zmq.CURVE_SECRETKEY, opts.curve.keys.secret)

    def busy(self) -> bool:
        return bool(self.in_flight or self.backlog)

    # ------------------------------------------------------------------------ one round

    def step(self) -> bool:
        """One round of the I/O thread; False once close() was asked for.

        While the backlog waits for room in the window, new requests would only queue behind
        it: submitters do not wake the thread then (a pipelining caller would keep it spinning),
        and it looks at its inbox at the next reply, or within ``BLOCKED_POLL_MS``."""
        engine = self.engine
        blocked = bool(self.backlog)
        if not blocked:
            engine._io_sleeping = True      # then look again: a submit may have raced us
        if not self.in_flight and not blocked:
            timeout = 0                     # idle: look, then park
        elif not blocked and not engine._inbox.empty():
            timeout = 0
        else:
            timeout = self._poll_timeout_ms()
            if blocked and timeout > BLOCKED_POLL_MS:
                timeout = BLOCKED_POLL_MS
        events = dict(zmq_poll(self.poll_items, timeout))
        engine._io_sleeping = False
        return self._round(events)

    def _round(self, events: dict[Any, int], calls: list[Call] | None = None) -> bool:
        """Handle what ``poll`` reported: replies before a disconnect (they made it), then
        connection events, then new requests; False once close() was asked for. ``calls``:
        an inline caller's, whose replies end its reading."""
        engine = self.engine
        if self.wake_fd in events:
            engine._drain_wake()       # undrained, it would keep every poll returning at once
        if self.dealer in events or self.monitor in events:
            self._receive(calls)
        if self.monitor in events:
            self._on_monitor()
        if not engine._inbox.empty() and not self._take_inbox():
            return False
        if self.closing:
            return False
        self.send_backlog()
        if len(self.deadlines) + len(self.fifo) > \
                2 * (len(self.in_flight) + len(self.backlog)) + 4096:
            self._compact_deadlines()
        now = time.monotonic()
        if self._next_deadline() <= now:
            self._expire(now)
        if now - self.last_sent >= engine.options.heartbeat:
            self._heartbeat()
        return True

    def pump(self, calls: list[Call]) -> None:
        """An inline caller drives the connection until its ``calls`` are done; it also sends
        what other threads submit meanwhile (its calls may wait on theirs)."""
        engine, items = self.engine, self.poll_items
        _io_thread.active = True
        try:
            while not _all_done(calls):
                engine._pump_sleeping = True
                timeout = 0 if not engine._inbox.empty() else self._poll_timeout_ms()
                events = dict(zmq_poll(items, timeout))
                engine._pump_sleeping = False
                if not self._round(events, calls):
                    for call in calls:
                        _fail_call(call, ClientClosed("the client was closed"))
                    return
        finally:
            _io_thread.active = False

    def exchange(self, call: Call) -> None:
        """Send a synchronous caller's ``call`` (nothing ahead of it) and drive the connection
        on this thread until it is settled. The call's deadline stays out of the shared heap
        (this loop watches it) unless the caller leaves early (an exception)."""
        if self.lost is not None or (self.ever_up and not self.up):
            _fail_call(call, self._refusal())
            return
        self._send(call, self.engine.options.trace)
        self.last_sent = time.monotonic()
        try:
            self._await(call)
        finally:
            if not call.settled:        # the I/O thread times it out from now on
                self._watch(call)

    def _await(self, call: Call) -> None:
        engine, items, dealer, calls = self.engine, self.poll_items, self.dealer, [call]
        _io_thread.active = True
        try:
            while True:
                engine._pump_sleeping = True
                timeout = self._poll_timeout_ms(call.deadline) if engine._inbox.empty() else 0
                events = zmq_poll(items, timeout)
                engine._pump_sleeping = False
                if len(events) == 1 and events[0][0] is dealer:   # the usual: replies, only
                    self._receive(calls)
                    if _all_done(calls):
                        return
                    events = []         # then the round's chores (timeouts, new requests)
                if not self._round(dict(events), calls):
                    _fail_call(call, ClientClosed("the client was closed"))
                    return
                if _all_done(calls):
                    return
                if call.deadline <= time.monotonic():
                    self.in_flight.pop(call.req_id, None)
                    self.in_flight_bytes -= call.nbytes
                    self._time_out(call)
                    return
        finally:
            _io_thread.active = False

    def _poll_timeout_ms(self, deadline: float = _NEVER) -> int:
        """Until the next deadline (or ``deadline``), at most a heartbeat interval."""
        beat = self.beat_ms
        deadline = min(deadline, self._next_deadline())
        if deadline == _NEVER:
            return beat
        wait = int((deadline - time.monotonic()) * 1000) + 1
        return beat if wait > beat else wait if wait > 0 else 0

    def _next_deadline(self) -> float:
        """The earliest deadline of a pending call or reservation (answered calls at the head
        of ``fifo`` are dropped on the way)."""
        fifo = self.fifo
        while fifo and fifo[0].settled:
            fifo.popleft()
        first = fifo[0].deadline if fifo else _NEVER
        heap = self.deadlines
        return heap[0][0] if heap and heap[0][0] < first else first

    # ------------------------------------------------------------------------- sending

    def _take_inbox(self) -> bool:
        """Move submitted calls to the backlog; False when close() was asked for."""
        if self.closing:
            return False
        inbox = self.engine._inbox
        while not inbox.empty():            # one consumer: what empty() says holds
            item = inbox.get_nowait()
            if item is None:
                self._goodbye()
                self.closing = True
                return False
            self.admit(item)
        return True

    def admit(self, item: Call | Reservation) -> None:
        """Queue a call (or reservation) to be sent, or fail it at once if the connection is
        known to be down."""
        if self.lost is not None or (self.ever_up and not self.up):
            _fail_item(item, self._refusal())
            return
        self.backlog.append(item)
        if type(item) is Call:
            self._watch(item)
        else:
            heapq.heappush(self.deadlines, (item.deadline, item.req_id))

    def _watch(self, call: Call) -> None:
        """Time ``call`` out at its deadline (see ``fifo``)."""
        fifo = self.fifo
        if not fifo or fifo[-1].deadline <= call.deadline:
            fifo.append(call)
        else:
            heapq.heappush(self.deadlines, (call.deadline, call.req_id))

    def send_now(self, call: Call) -> None:
        """Send ``call`` at once (an inline caller's, nothing ahead of it) or queue it."""
        opts = self.engine.options
        if self.backlog or self.lost is not None or (self.ever_up and not self.up) or (
                self.in_flight and (len(self.in_flight) >= opts.window or
                                    self.in_flight_bytes + call.nbytes > opts.window_bytes)):
            self.admit(call)
            self.send_backlog()
            return
        self._watch(call)
        self._send(call, opts.trace)
        self.last_sent = time.monotonic()

    def _refusal(self) -> RpcError:
        """Why a request cannot go out now (the connection is known to be down)."""
        if self.lost is not None:
            return self.lost
        return ConnectionLost(f"the connection to {self.engine.endpoint} is down "
                              "(zmq keeps reconnecting); the request was not sent")

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
                self._send(call, trace)
        self.last_sent = time.monotonic()

    def _send(self, call: Call, trace: bool) -> None:
        if trace:
            call.sent_ns = time.perf_counter_ns()
        frames = call.frames
        if isinstance(frames, bytes):
            self.dealer.send(frames)
        else:
            self.dealer.send_multipart(frames, copy=call.nbytes < zmq.COPY_THRESHOLD)
        call.frames = _SENT
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
            self._watch(call)
        return True

    # ------------------------------------------------------------------------ receiving

    def _receive(self, calls: list[Call] | None = None) -> None:
        """Take the replies that are in (up to 1024 at a time); with ``calls`` (an inline
        caller's), stop once they are done. Every ``REFILL_EVERY`` replies the window is topped
        up from the backlog (read to the end first, and the worker would run dry meanwhile) and
        the threads blocked on the futures settled so far are woken."""
        try:
            self._read(calls)
        finally:
            if self.blocked_readers:
                self._wake_readers()

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
            if calls is not None and _all_done(calls):
                return
            if not count % REFILL_EVERY:
                if self.blocked_readers:
                    self._wake_readers()
                if self.backlog:
                    self.send_backlog()

    def _wake_readers(self) -> None:
        readers, self.blocked_readers = self.blocked_readers, []
        for future in readers:
            future._wake_readers()

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        try:
            header = p.unpack_header(frames[0].buffer)
        except RpcError as exc:
            log.warning("dropping an unreadable reply: %s", exc)
            return
        if header[0] == ErrorCode.NO_SESSION:
            self._session_lost(header[2] if len(header) > 2 else "")
        call = self.in_flight.pop(header[1], None)
        if call is None:
            return  # a reply to a request that already timed out, or a heartbeat
        self.in_flight_bytes -= call.nbytes
        received = time.perf_counter_ns() if self.trace else 0
        call.settled = True
        try:
            result = p.decode_reply(call.cmd, header)
            if isinstance(result, RpcError):
                _settle(call, None, result)
            else:
                _check_reply_payload(call.cmd, result, frames)
                value = call.on_reply(result, frames[1:]) if call.on_reply else result
                future = call.future
                if type(future) is RunningFuture:
                    if future._set_result_quietly(value):
                        self.blocked_readers.append(future)
                else:
                    _settle(call, value, None)
                if received:
                    self._record(call, result, received)
        except BaseException as exc:
            _fail_call(call, exc)

    def _session_lost(self, said: object) -> None:
        if self.lost is not None:
            return
        self.lost = SessionLost(
            f"the worker at {self.engine.endpoint} no longer knows this client's session "
            "(it was restarted, or the session expired): its buffers and graphs are gone; "
            f"open a new Client (the worker said: {str(said)[:200]})", code=ErrorCode.NO_SESSION)
        log.warning("%s", self.lost.message)
        self.fail_pending(self.lost)

    # ------------------------------------------------------------------- time and health

    def _record(self, call: Call, reply: p.Message, received: int) -> None:
        if not getattr(reply, "timing", ()):
            return
        queued_ns, run_ns = reply.timing  # type: ignore[attr-defined]
        round_trip = received - call.sent_ns
        self.engine.timings.append(RequestTiming(
            call.cmd.name, (call.sent_ns - call.submitted_ns) / 1e9,
            max(round_trip - queued_ns - run_ns, 0) / 1e9, queued_ns / 1e9, run_ns / 1e9,
            (time.perf_counter_ns() - received) / 1e9,
            getattr(reply, "compute_ns", 0) / 1e9))

    def _compact_deadlines(self) -> None:
        """Drop the entries of answered calls (they otherwise stay until their deadline, or in
        ``fifo`` until the calls before them are answered)."""
        self.fifo = deque(c for c in self.fifo if not c.settled)
        live = {*self.in_flight, *(c.req_id for c in self.backlog)}
        self.deadlines = [entry for entry in self.deadlines if entry[1] in live]
        heapq.heapify(self.deadlines)

    def _expire(self, now: float) -> None:
        fifo = self.fifo
        while fifo and fifo[0].deadline <= now:
            due = fifo.popleft()
            if not due.settled:
                self._expire_call(due)
        while self.deadlines and self.deadlines[0][0] <= now:
            _, req_id = heapq.heappop(self.deadlines)
            call = self.in_flight.get(req_id)
            if call is not None:
                self._expire_call(call)
                continue
            item = next((c for c in self.backlog if c.req_id == req_id), None)
            if isinstance(item, Call):
                self._time_out(item)
            elif isinstance(item, Reservation):
                self._expire_reservation(item)

    def _expire_call(self, call: Call) -> None:
        if self.in_flight.pop(call.req_id, None) is not None:
            self.in_flight_bytes -= call.nbytes     # its late reply, if any, is dropped
        self._time_out(call)

    def _time_out(self, call: Call) -> None:
        where = "waiting to be sent" if not call.sent else "sent, no reply"
        _fail_call(call, Timeout(f"{call.cmd.name} to {self.engine.endpoint}: no reply "
                                   f"within the timeout ({where})"))

    def _expire_reservation(self, slot: Reservation) -> None:
        with self.engine._submit_lock:
            if slot.calls is None:
                slot.error = Timeout(f"a request to {self.engine.endpoint} was not decided "
                                     "within the timeout")
                slot.calls = []
        self.backlog.remove(slot)

    def _heartbeat(self) -> None:
        if self.up and time.monotonic() - self.last_sent >= self.engine.options.heartbeat:
            self._ping()

    def _ping(self) -> None:
        self.dealer.send(p.encode_request(Cmd.PING, 0, p.Empty()))
        self.last_sent = time.monotonic()

    def _on_monitor(self) -> None:
        assert self.monitor is not None
        while self.monitor.poll(0):
            message = recv_monitor_message(self.monitor)
            event = message["event"]
            if event & _HANDSHAKE_FAILED:
                self._handshake_failed(event, message["value"])
            elif event == zmq.EVENT_DISCONNECTED and self.up:
                self.up = False
                self.fail_pending(ConnectionLost(
                    f"connection to {self.engine.endpoint} lost; requests in flight may or may "
                    "not have run, queued ones were not sent"))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                again = self.ever_up and not self.up
                self.up = self.ever_up = True
                if again and self.lost is None:
                    self._ping()        # a restarted worker answers NO_SESSION: we learn it now

    def _handshake_failed(self, event: int, value: int) -> None:
        """The worker refused us (ZAP said no), or the handshake broke (a wrong server key, one
        side without CURVE): fail what waits now rather than at its timeout. libzmq retries."""
        self.up = False
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

    # ------------------------------------------------------------------------- failing

    def fail_in_flight(self, exc: RpcError) -> None:
        calls, self.in_flight = list(self.in_flight.values()), {}
        self.in_flight_bytes = 0
        for call in calls:
            _fail_call(call, exc)

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
            _fail_call(call, exc)

    def fail_all(self, exc: RpcError) -> None:
        self.fail_pending(exc)
        _drain_inbox(self.engine._inbox, exc)

    def _goodbye(self) -> None:
        """Tell the worker to free our session now (best effort, not waited for)."""
        if self.up and self.lost is None:
            self.dealer.send(p.encode_request(Cmd.GOODBYE, 0, p.Empty()))

    def close(self) -> None:
        if self.monitor is not None:
            self.dealer.disable_monitor()
            self.monitor.close(linger=0)
        self.dealer.close(linger=200 if getattr(self, "up", False) else 0)


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
