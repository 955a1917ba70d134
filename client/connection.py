"""One worker connection: its DEALER and everything about it, behind one public call.

:class:`Connection` owns, for one worker, the :class:`~.loop.Loop` (the DEALER and its monitor
in :class:`~.link.Link`, the backlog, the calls in flight, their deadlines), the
:class:`~.mailbox.Mailbox` (inbox, wake-up, submit lock) and the I/O thread. Its public face:
:meth:`Connection.call` queues a request and returns a ``concurrent.futures.Future``;
:meth:`Connection.request` is a blocking call of one request; :meth:`Connection.result_of`
waits for what a function issues; :meth:`Connection.reserve` /
:meth:`Connection.filling` hold a place in the send order; :meth:`Connection.close`.

Threads: any thread calls in. The loop has one owner at a time, whoever holds the socket lock
(its acquire and release are the full memory barrier zmq asks for when a socket changes
threads):

- the **I/O thread** (``zmq-rpc-client-io``), which sends requests in submission order while
  keeping at most ``window`` requests and ``window_bytes`` payload bytes in flight (so no
  high-water mark anywhere drops a reply), matches replies to futures, lands reply payloads
  where the caller asked, and fails futures on timeout, connection loss and close. When nothing
  is in flight it lets go of the lock and sleeps on its wake-up socket;
- a **blocking caller** (:meth:`Connection.request`, :meth:`Connection.result_of`) that finds
  the connection idle: it takes the lock, and the requests it issues meanwhile go out and are
  answered on its own thread, with no hop through the I/O thread, through the same rounds of
  the same loop (close and other threads' requests are seen too); then it gives the lock back.

Every request takes one path: a :class:`~.calls.Call`, queued (posted to the mailbox, or
straight to the loop when this thread drives it), sent by the loop's ``send_backlog``/
``send_now``, settled by its reply (``Loop._on_reply``), its deadline or a failure. Its outcome
goes to its future, or, for :meth:`Connection.request` on the caller's thread, onto the call.

Failure detection (docs/FAILURES.md): a worker that dies, freezes or becomes unreachable
fails every request in flight and every new one with ``ConnectionLost`` once libzmq's heartbeat
(``zmq_heartbeat_ms``/``zmq_heartbeat_timeout_ms``, 0.5 s/5 s) or the kernel (a closed socket)
says so; while the connection is down new requests fail at once. A worker that answers but no
longer knows our session (restarted at the same address, or the session expired) fails them with
``SessionLost``, for good. No future is left hanging.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import zmq

from ..broker import protocol as p
from ..broker.errors import BadEndpoint, ClientClosed, ConnectionLost
from ..broker.protocol import Cmd
from ..broker.request_mac import Signer
from .calls import Call, OnReply, RequestTiming, Reservation, fail_call
from .loop import Loop, io_thread, on_io_thread
from .mailbox import Mailbox
from .options import MAX_TIMINGS, ConnectionOptions, check_endpoint

log = logging.getLogger("zmq_rpc.client")

T = TypeVar("T")
P = ParamSpec("P")

_EMPTY_HEADS = {cmd: p.request_head(cmd) for cmd in Cmd}
"""Per command, the head of a request header without fields (``protocol.request_head``)."""

FINISHING_WAIT = 0.002
"""How long a blocking caller waits for an idle holder to let go of the connection."""


class Connection:
    """One connection to one worker: an I/O thread, and a blocking caller's thread when idle."""

    def __init__(self, endpoint: str, options: ConnectionOptions | None = None,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.endpoint = check_endpoint(endpoint)
        self.options = options or ConnectionOptions()
        self._own_ctx = ctx is None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = ctx or zmq.Context()
        self._ids = itertools.count(1)
        self._mailbox = Mailbox()
        self._socket_lock = threading.Lock()
        """Held by whoever drives the loop (see the module docstring)."""
        self._local = _Local()
        self._loop: Loop | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._timings: deque[RequestTiming] = deque(maxlen=MAX_TIMINGS)
        self.draining = threading.Event()
        """Set (by the I/O thread) once a reply said the worker is leaving (protocol 1.14)."""
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

    def call(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
             on_reply: OnReply | None = None, timeout: float | None = None,
             reply_bytes: int = 0) -> Future[Any]:
        """Queue a request; the future resolves with ``on_reply(reply, frames)``, or the reply.

        ``timeout``: seconds until it fails with ``Timeout`` (default ``options.timeout``).
        ``reply_bytes`` (what the reply will carry) counts against the in-flight byte window
        like the payload does, so large downloads are paced too.
        """
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()       # new_future(), one call less per request
        call = self._new_call(cmd, msg, payload, on_reply, timeout, reply_bytes, future)
        local = self._local
        if local.filling is None and local.loop is None:
            self._mailbox.post(call)                # _enqueue's usual case, inline
        else:
            self._enqueue(call)
        return future

    def request(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
                on_reply: OnReply | None = None, timeout: float | None = None,
                reply_bytes: int = 0) -> Any:
        """``call(...).result()`` for a blocking call of one request. On an idle connection it
        is sent and answered on this thread, as in :meth:`result_of`, with its outcome kept on
        the call itself instead of a future (a blocking caller pays for every object on its
        way); otherwise it is :meth:`call` and a wait. ``on_reply`` runs once the connection is
        given back (so it may make a blocking call on this connection itself)."""
        loop = self._take_idle()
        if loop is None:
            return self.call(cmd, msg, payload, on_reply, timeout, reply_bytes).result()
        call = self._new_call(cmd, msg, payload, _kept, timeout, reply_bytes, None)
        try:
            loop.send_now(call)
            loop.drive([call])
        finally:
            self._release(loop)
        reply, frames = call.outcome()
        return on_reply(reply, frames) if on_reply is not None else reply

    def result_of(self, issue: Callable[P, Future[T]], *args: P.args,
                  **kwargs: P.kwargs) -> T:
        """``issue(*args, **kwargs).result()``: on an idle connection the requests ``issue``
        sends here go out and are answered on this thread (no hop through the I/O thread);
        otherwise (busy, closed, or a future callback) they take the I/O thread's turn."""
        loop = self._take_idle()
        if loop is None:
            return issue(*args, **kwargs).result()
        calls: list[Call] = []
        local = self._local
        local.loop, local.calls = loop, calls
        try:
            future = issue(*args, **kwargs)
            loop.drive(calls)
        finally:
            local.loop = None
            self._release(loop)
        return future.result()

    def reserve(self, timeout: float | None = None) -> Reservation:
        """Hold a place in the send order; fill it with :meth:`filling` (from any thread).

        Until it is filled nothing posted after it is sent. Unfilled after ``timeout`` (the
        request timeout by default), what fills it fails with ``Timeout``.
        """
        wait = self.options.timeout if timeout is None else timeout
        slot = Reservation(next(self._ids), time.monotonic() + wait)
        self._enqueue(slot)
        return slot

    @contextmanager
    def filling(self, slot: Reservation) -> Iterator[None]:
        """Requests this thread issues to this connection inside the block fill ``slot``."""
        calls: list[Call] = []
        outer = self._local.filling
        self._local.filling = calls
        try:
            yield
        finally:
            self._local.filling = outer
            with self._mailbox.lock:
                error = slot.error
                if error is None:
                    slot.calls = calls
            if error is not None:
                for call in calls:
                    fail_call(call, error)
            self._mailbox.wake()

    def close(self, timeout: float | None = None) -> None:
        """Fail what is pending with ClientClosed, say goodbye, close the socket and the context,
        join the I/O thread. Idempotent; from a future callback it returns without joining."""
        if self._mailbox.close() and not on_io_thread():
            self._thread.join(timeout)

    def sign_from_now(self, key: bytes) -> None:
        """Sign every request sent from now on with ``key`` (protocol 1.10,
        ``broker/request_mac.py``). Only for the thread that drives the connection, i.e. from a
        reply's ``on_reply`` (HELLO's): nothing can be sent between that reply and this."""
        if self._loop is not None:             # always, once a reply came in
            self._loop.link.signer = Signer(key)

    def reconnect_refused(self) -> bool:
        """Since the connection went down, the worker's address refused a reconnection (no
        process listens there: killed, or not restarted yet); False while up, or before the
        first retry (zmq retries every 0.1 s). Any thread."""
        loop = self._loop
        return loop is not None and loop.link.reconnect_refused.is_set()

    def drain_timings(self) -> list[RequestTiming]:
        """The timings recorded since the last call, oldest first (``options.trace``)."""
        out = []
        while self._timings:
            out.append(self._timings.popleft())
        return out

    @property
    def closed(self) -> bool:
        return self._mailbox.closed

    @property
    def thread(self) -> threading.Thread:
        """The I/O thread (joined by :meth:`close`)."""
        return self._thread

    # ---------------------------------------------------------------- submission

    def _new_call(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any],
                  on_reply: OnReply | None, timeout: float | None, reply_bytes: int,
                  future: Future[Any] | None) -> Call:
        req_id = next(self._ids)
        if type(msg) is p.Empty:          # the same bytes, without building a list
            header = _EMPTY_HEADS[cmd] + p.pack_id(req_id)
        else:
            header = p.encode_request(cmd, req_id, msg)
        options = self.options
        deadline = time.monotonic() + (options.timeout if timeout is None else timeout)
        if payload:
            nbytes = sum(memoryview(f).nbytes for f in payload) + reply_bytes
            return Call(cmd, req_id, [header, *payload], future, deadline, on_reply, nbytes,
                        submitted_ns=time.perf_counter_ns() if options.trace else 0)
        if options.trace:
            return Call(cmd, req_id, header, future, deadline, on_reply, reply_bytes,
                        submitted_ns=time.perf_counter_ns())
        return Call(cmd, req_id, header, future, deadline, on_reply, reply_bytes)

    def _enqueue(self, item: Call | Reservation) -> None:
        local = self._local
        filling = local.filling
        if filling is not None and isinstance(item, Call):
            filling.append(item)
            return
        loop = local.loop
        if loop is not None:          # in result_of: this thread drives the loop
            if isinstance(item, Call):
                local.calls.append(item)
                loop.send_now(item)
            else:
                loop.admit(item)
            return
        self._mailbox.post(item)

    # ------------------------------------------------------------ the socket lock

    def _take_idle(self) -> Loop | None:
        """The loop, locked, if nothing else is using or waiting for it. Whoever holds it with
        nothing in flight or queued is finishing its last round: wait for it (at most
        ``FINISHING_WAIT`` s) rather than hand the call over."""
        loop = self._loop
        if loop is None or io_thread.active or self._local.loop is not None:
            return None
        lock = self._socket_lock
        if not lock.acquire(False) and (
                loop.busy() or not lock.acquire(timeout=FINISHING_WAIT)):
            return None
        if self._mailbox.closed or not loop.idle():
            lock.release()
            return None
        return loop

    def _release(self, loop: Loop) -> None:
        """The loop back to the I/O thread, woken if it has work."""
        self._socket_lock.release()
        if loop.in_flight or loop.backlog or loop.closing or not self._mailbox.empty():
            self._mailbox.wake()

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        loop = self._open()
        if loop is None:
            return
        try:
            self._serve(loop)
        except BaseException as exc:  # never leave futures hanging, even on a bug
            log.exception("client I/O thread failed")
            with self._socket_lock:
                loop.fail_all(ConnectionLost(f"client I/O thread failed: {exc}"))
        finally:
            self._finish(loop)

    def _open(self) -> Loop | None:
        """The loop, its DEALER connecting; None (and ``_start_error``) when it cannot be."""
        io_thread.active = True
        try:
            self._loop = Loop(self.ctx, self.endpoint, self.options, self._mailbox,
                              self._timings, self.draining)
        except BaseException as exc:
            self._start_error = _as_rpc_error(self.endpoint, exc)
            self._finish(None)
            return None
        finally:
            self._started.set()
        return self._loop

    def _serve(self, loop: Loop) -> None:
        while True:
            with self._socket_lock:
                while True:
                    if not loop.step():
                        return
                    if not loop.busy() and self._mailbox.empty():
                        break
            loop.park()

    def _finish(self, loop: Loop | None) -> None:
        """Every path out of the I/O thread: fail what is left, close sockets and context."""
        self._mailbox.shut()
        with self._socket_lock:
            if loop is not None:
                loop.fail_all(ClientClosed("the client was closed"))
                loop.close()
            else:
                self._mailbox.fail_posted(ClientClosed("the client failed to start"))
        self._mailbox.close_sockets()
        if self._own_ctx:
            self.ctx.term()


def _kept(reply: p.Message, frames: list[zmq.Frame]) -> tuple[p.Message, list[zmq.Frame]]:
    """A blocking request's reply and payload, for its ``on_reply`` once the loop is let go."""
    return reply, frames


class _Local(threading.local):
    """Per thread, per connection: where this thread's requests go (see ``_enqueue``)."""

    loop: Loop | None = None
    """The loop, while this thread drives it (:meth:`Connection.result_of`)."""
    calls: list[Call] = []
    """The calls this thread issued while driving (reset per blocking call)."""
    filling: list[Call] | None = None
    """The calls filling a reservation (see :meth:`Connection.filling`)."""


def _as_rpc_error(endpoint: str, exc: BaseException) -> BaseException:
    if isinstance(exc, zmq.ZMQError):
        return BadEndpoint(f"cannot connect to {endpoint!r}: {exc}")
    return exc
