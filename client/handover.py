"""Blocking calls on an idle connection, run on the caller's own thread: :class:`Handover`, the
part of :class:`~.engine.Engine` that takes the connection from the I/O thread for a blocking
call (:meth:`~Handover.request` for one request, :meth:`~Handover.call` and
:meth:`~Handover.inline` for several), and gives it back.

Threads: any calling thread. The connection is the caller's while it holds
``Engine._socket_lock`` (taken by :meth:`Handover._take_idle`; the lock's acquire and release
are the full memory barrier zmq asks for when a socket changes threads); what it does with it
is ``inline.py``'s, except the one course :meth:`Handover.request` runs itself.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import zmq
from zmq.backend import Socket as _CSocket

from ..broker import protocol as p
from ..broker.protocol import Cmd
from .calls import Call, OnReply, Reservation
from .inline import SYNC_SLICE_S, after_send, bare_courses, pump, request
from .io_loop import IoLoop, io_thread

if TYPE_CHECKING:
    from .engine import EngineOptions

FINISHING_WAIT = 0.002
"""How long a synchronous call waits for an idle holder to let go of the connection."""

_send = _CSocket.send
"""pyzmq's send without its Python layer (routing ids and groups, for draft sockets only):
0.4 µs of the few a synchronous call spends."""

_BARE_HEAD = p.BARE_REPLY_HEAD
pack_id = p.pack_id
monotonic = time.monotonic
_COURSES = bare_courses()
"""Per command: the request type without fields that takes the short course, the head of its
header, and the Ack its success decodes to."""


class Handover:
    """The blocking calls of :class:`~.engine.Engine` (see the module docstring)."""

    options: EngineOptions
    _io: IoLoop | None
    _ids: Iterator[int]
    _inbox: queue.SimpleQueue[Call | Reservation | None]
    _closed: bool
    _socket_lock: threading.Lock
    _local: Local

    if TYPE_CHECKING:
        def submit(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
                   on_reply: OnReply | None = None, timeout: float | None = None,
                   reply_bytes: int = 0) -> Future[Any]: ...

        def _wake(self) -> None: ...

    def request(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
                on_reply: OnReply | None = None, timeout: float | None = None,
                reply_bytes: int = 0) -> Any:
        """``submit(...).result()``, with no thread hop and no future when the engine is idle:
        the request goes out and its reply is read on this thread (a synchronous call of one
        request). Otherwise (busy, closed, a callback) it is submitted and waited for.

        A request without fields or payload whose success is an Ack (PING, SYNCHRONIZE) runs
        its usual course here, in one function (a blocking caller runs it with cold caches:
        every call and object on the way costs): the two headers' bytes (the request's signed
        when the session signs, ``broker/request_mac.py``) made before the send
        (on a busy machine the code between a send and its receive delays the receive), a
        send and a blocking receive on the DEALER alone, like a bare socket's, the reply
        recognized by its bytes, ``on_reply`` called once the connection is given back.
        Anything else is :meth:`_request`'s (or, once sent, ``inline.after_send``'s)."""
        course = _COURSES.get(cmd)
        lock = self._socket_lock
        io = self._io
        if (course is None or type(msg) is not course[0] or payload or io is None
                or io_thread.active or not lock.acquire(False)):
            return self._request(cmd, msg, payload, on_reply, timeout, reply_bytes)
        # (a thread that drives this connection inline holds the lock: it was refused above)
        wait = self.options.timeout if timeout is None else timeout
        link = io.link
        if (self._closed or io.closing or io.in_flight or io.backlog or not self._inbox.empty()
                or io.trace or link.lost is not None or not link.up and link.ever_up
                or wait <= SYNC_SLICE_S):
            lock.release()
            return self._request(cmd, msg, payload, on_reply, timeout, reply_bytes)
        req_id = next(self._ids)
        packed = pack_id(req_id)
        header, expected = course[1] + packed, _BARE_HEAD + packed
        signer = link.signer
        if signer is not None:
            header = signer.sign(header)
        dealer = io.dealer
        try:
            sent = link.last_sent = monotonic()
            _send(dealer, header)
            try:
                frame: zmq.Frame | None = dealer.recv(copy=False)  # at most SYNC_SLICE_MS
            except zmq.Again:
                frame = None
            reply = course[2]
            if frame is None or frame.more or frame.bytes != expected:
                reply = after_send(io, cmd, req_id, frame, None, sent + wait, reply_bytes)
        finally:
            lock.release()
            if io.in_flight or io.backlog or io.closing or not self._inbox.empty():
                self._wake()
        return on_reply(reply, []) if on_reply is not None else reply

    def _request(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any],
                 on_reply: OnReply | None, timeout: float | None, reply_bytes: int) -> Any:
        """:meth:`request` the general way: on this thread if the connection is idle (or
        about to be, see :meth:`_take_idle`), else submitted and waited for."""
        io = self._take_idle()
        if io is None:
            return self.submit(cmd, msg, payload, on_reply, timeout, reply_bytes).result()
        try:
            return request(io, cmd, next(self._ids), msg, payload, on_reply,
                           self.options.timeout if timeout is None else timeout, reply_bytes)
        finally:
            self._release(io)

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
            pump(io, calls)
        finally:
            self._give_back(io)
        return future.result()

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
            pump(io, calls)
        finally:
            self._give_back(io)

    def _take_idle(self) -> IoLoop | None:
        """The connection, locked, if nothing else is using or waiting for it. Whoever holds it
        with nothing in flight or queued is finishing its last round: wait for it (at most
        ``FINISHING_WAIT`` s) rather than hand the call over."""
        io = self._io
        if io is None or self._local.io is not None or io_thread.active:
            return None
        lock = self._socket_lock
        if not lock.acquire(False) and (
                io.in_flight or io.backlog or not lock.acquire(timeout=FINISHING_WAIT)):
            return None
        if self._closed or io.closing or io.in_flight or io.backlog or not self._inbox.empty():
            lock.release()
            return None
        return io

    def _give_back(self, io: IoLoop) -> None:
        """End of an inline call: the connection back to the I/O thread, woken if it has work."""
        self._local.io = None
        self._release(io)

    def _release(self, io: IoLoop) -> None:
        self._socket_lock.release()
        if io.in_flight or io.backlog or io.closing or not self._inbox.empty():
            self._wake()


class Local(threading.local):
    """Per thread, per engine: where this thread's submissions go (see ``Engine._enqueue``)."""

    io: IoLoop | None = None
    """The connection, while this thread drives it inline."""
    calls: list[Call] = []
    """The calls this thread submitted inline (reset per inline call)."""
    filling: list[Call] | None = None
    """The calls filling a reservation (see :meth:`Engine.filling`)."""
