"""The backend thread: the single owner of sessions, buffers and every tensor byte on a worker.

Runs in its own thread (:class:`BackendThread`). It receives requests from the broker thread over the
inproc PAIR as ``[client_id, header, *payload]``, validates them (protocol decoding first, then
state: handles, bounds, limits), runs them in order per session, and answers every one of them on
the same PAIR, an error reply included. No other thread touches anything here; other threads talk
to it only through its sockets.

A GRAPH_RUN_LINKED is queued as one silent PEER_RECV per hand-off it receives, then the run itself:
the receives hold the queue like any PEER_RECV, and only the run replies (for all of them).

Ordering: each session has a FIFO. A request runs only after every earlier request of its session
has run; a request whose precondition does not hold yet (a buffer still being sent zero-copy, a peer
transfer not yet arrived) waits at the head of its session's queue while other sessions go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import zmq

from ..broker import graph as g
from ..broker import peer as wire_peer
from ..broker import protocol as p
from ..broker.errors import BadRequest
from ..broker.ops import DEFAULT_MAX_WORK
from ..broker.protocol import Cmd, ErrorCode, TensorRef, WireError
from ..broker.wire import printable
from .backends.base import Backend
from .graph_exec import CompiledGraph, compile_graph
from .memory import MemoryBudget

log = logging.getLogger("zmq_rpc.worker")

DRAIN_BATCH = 512
"""Most requests taken from the PAIR per poll wake-up before replies are flushed."""

MAX_CACHED_VIEWS = 1024
"""Most checked views a session keeps (see :attr:`Session.views`)."""

TRACK_THRESHOLD = 64 * 1024
"""Replies at least this big are sent zero-copy from buffer memory, with a tracker."""

MAX_HELD_BYTES = 64 * 1024
"""A linked run's reply is held back only when what it fetched is at most this big..."""
MAX_HELD_TOTAL = 16 << 20
"""...and while every held reply together stays under this (a flood of held runs from a client
that never waits must not pile up memory)."""


MIN_CLIENT_ID = 16
WEAK_ID = (f"HELLO refused: this connection has no client-chosen routing id of at least "
           f"{MIN_CLIENT_ID} bytes. Sessions are keyed by it, so it must be unguessable: set "
           f"ZMQ_ROUTING_ID to {MIN_CLIENT_ID} random bytes (not starting with 0x00) before "
           "connecting (zmq_rpc.client does).")


def strong_client_id(client_id: bytes) -> bool:
    """Whether a routing id can key a session: client-chosen, random-length enough to be
    unguessable. libzmq names a peer that chose none ``0x00`` + a counter that any other
    connection can name after it leaves; such a peer gets no session."""
    return len(client_id) >= MIN_CLIENT_ID and client_id[0] != 0


@dataclass(frozen=True)
class WorkerLimits:
    """What the worker may hand out, and how long a silent session lives."""

    memory_limit: int
    max_buffer_size: int
    max_message_size: int
    session_timeout: float
    max_graph_work: int = DEFAULT_MAX_WORK
    """Element-ops one graph run may ask for (see :func:`~zmq_rpc.broker.ops.node_work`)."""


@dataclass
class Buffer:
    """One allocation: its memory and the zero-copy sends that still read from it."""

    handle: int
    size: int
    memory: Any
    sending: list[zmq.MessageTracker] = field(default_factory=list)

    def busy(self) -> bool:
        """Whether a zero-copy reply still reads this memory (writes must wait)."""
        self.sending = [t for t in self.sending if not t.done]
        return bool(self.sending)


@dataclass
class Request:
    """A decoded request waiting in its session's queue."""

    cmd: Cmd
    req_id: int
    msg: p.Message
    payload: Sequence[Any]
    silent: bool = False
    """A receive a GRAPH_RUN_LINKED queued ahead of itself (same ``req_id``): it never replies;
    the run behind it answers for both."""
    prepared: Prepared | None = None
    """What a linked run did while its receives waited."""


@dataclass(frozen=True)
class Prepared:
    """A linked run's work done while its last receive waited: its sends checked and encoded,
    and maybe its inputs written; stamped with the session's ``frees`` then (a freed buffer
    makes the pushes stale)."""

    frees: int
    pushes: list[Any]
    inputs_written: bool


@dataclass
class Session:
    """A client's resources; freed when it says goodbye or goes silent past the session timeout."""

    client_id: bytes
    name: str
    buffers: dict[int, Buffer] = field(default_factory=dict)
    graphs: dict[int, CompiledGraph] = field(default_factory=dict)
    queue: deque[Request] = field(default_factory=deque)
    held_by: Pending | None = None
    frees: int = 0
    """Bumped whenever a buffer is freed: views resolved before then may be stale."""
    views: dict[TensorRef, Any] = field(default_factory=dict)
    """Checked views by reference (a pipeline names the same few every step); emptied when a
    buffer is freed."""
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return f"{self.name}/{self.client_id.hex()[:8]}"


@dataclass(eq=False)
class Pending:
    """A request whose reply comes later (a peer transfer). If ``holds_queue``, the session's
    later requests wait until it finishes, and fail with it if it fails."""

    session: Session
    req_id: int
    cmd: Cmd
    holds_queue: bool
    silent: bool = False


Reply = tuple[p.Message, list[Any]]
Handler = Callable[[Session, Any, Sequence[Any]], Reply]


@dataclass(frozen=True)
class HeldReply:
    """A successful reply waiting until ``due`` (its payload copied out of the buffers)."""

    due: float
    client_id: bytes
    req_id: int
    reply: Reply
    nbytes: int


NO_REPLY: Reply = (p.Empty(), [])


class Executor:
    """Runs validated requests against a backend. Owned by the backend thread."""

    def __init__(self, backend: Backend, limits: WorkerLimits, send: Callable[..., Any],
                 server_name: str, peer_endpoint: str = "") -> None:
        self.backend = backend
        self.limits = limits
        self._send = send
        self.server_name = server_name
        self.peer_endpoint = peer_endpoint
        self.sessions: dict[bytes, Session] = {}
        self.budget = MemoryBudget(limits.memory_limit)
        self.capabilities: list[str] = ["views", "chunked-transfer"]
        if backend.zero_copy:
            self.capabilities.append("zero-copy")
        if backend.supports_graphs:
            self.capabilities += [f"graph-v{g.GRAPH_VERSION}", "linked-runs", "held-replies",
                                  "scale-bias"]
        self.capabilities.append("unacked-sends")
        self.held: deque[HeldReply] = deque()
        """Replies of linked runs that asked to wait (``hold_reply_us``), oldest first."""
        self.held_bytes = 0
        self.handlers: dict[Cmd, Handler] = {
            Cmd.PING: lambda s, m, f: NO_REPLY,
            Cmd.GOODBYE: self._goodbye,
            Cmd.ALLOC_BUFFER: self._alloc,
            Cmd.FREE_BUFFER: self._free,
            Cmd.CLEAR_BUFFER: self._clear,
            Cmd.DEVICE_MEMORY: self._device_memory,
            Cmd.SET_TENSOR: self._set_tensor,
            Cmd.GET_TENSOR: self._get_tensor,
            Cmd.MEMSET_TENSOR: self._memset,
            Cmd.COPY_TENSOR: self._copy,
            Cmd.SYNCHRONIZE: lambda s, m, f: NO_REPLY,
            Cmd.GRAPH_REGISTER: self._graph_register,
            Cmd.GRAPH_RUN: self._graph_run,
            Cmd.GRAPH_COMPUTE: self._graph_compute,
            Cmd.GRAPH_FREE: self._graph_free,
        }
        self.writes: dict[Cmd, Callable[[Session, Any], Iterable[int]]] = {
            Cmd.CLEAR_BUFFER: lambda s, m: [m.handle],
            Cmd.SET_TENSOR: lambda s, m: [m.tensor.buffer],
            Cmd.MEMSET_TENSOR: lambda s, m: [m.tensor.buffer],
            Cmd.COPY_TENSOR: lambda s, m: [m.dst.buffer],
            Cmd.GRAPH_COMPUTE: lambda s, m: [t.buffer for t in [*m.graph.tensors, *m.inputs]],
            Cmd.GRAPH_RUN: self._graph_run_writes,
            Cmd.GRAPH_RUN_LINKED: self._graph_run_writes,
            Cmd.PEER_RECV: lambda s, m: [m.dst.buffer],
        }
        """Which buffers a command writes: it waits until their zero-copy sends are done."""
        self.preconditions: list[Callable[[Session, Request], bool]] = [self._buffers_idle]
        self.peers: Any = None
        self.deferred_handlers: dict[Cmd, Callable[[Pending, Any], bool]] = {
            Cmd.PEER_RECV: self._peer_recv,
            Cmd.PEER_SEND: self._peer_send,
            Cmd.PEER_PROBE: self._peer_probe,
        }
        """Handlers that may answer later: they return True when the reply is deferred."""

    # ------------------------------------------------------------------ entry from the loop

    def handle_frames(self, frames: list[zmq.Frame]) -> None:
        """One message from the broker: ``[client_id, header, *payload]``."""
        if len(frames) < 2:
            log.warning("dropping a message of %d frame(s) from the broker", len(frames))
            return
        client_id = frames[0].bytes
        try:
            cmd, req_id, msg = p.decode_request([f.buffer for f in frames[1:]])
        except BadRequest as exc:
            self._reply_error(client_id, getattr(exc, "req_id", 0), ErrorCode(exc.code or 1),
                              exc.message)
            return
        except Exception as exc:  # a decoder bug: still a bad request, never a dead thread
            log.exception("decoding a request from %s failed", client_id.hex()[:8])
            self._reply_error(client_id, 0, ErrorCode.BAD_REQUEST,
                              f"malformed request ({type(exc).__name__})")
            return
        self._accept(client_id, Request(cmd, req_id, msg, frames[2:]))

    def _accept(self, client_id: bytes, req: Request) -> None:
        if req.cmd is Cmd.HELLO:
            self._hello(client_id, req)
            return
        session = self.sessions.get(client_id)
        if session is None:
            self._reply_error(client_id, req.req_id, ErrorCode.NO_SESSION,
                              "no session: send HELLO first (or the session expired)")
            return
        session.last_seen = time.monotonic()
        if req.cmd is Cmd.PEER_FILL:      # feeds the PEER_RECV that holds the queue: not queued
            self._fill(session, req)
            return
        idle = not session.queue
        if req.cmd is Cmd.GRAPH_RUN_LINKED:
            session.queue.extend(self._receives(req))
        session.queue.append(req)
        if self.peers is not None and req.cmd in (Cmd.PEER_RECV, Cmd.GRAPH_RUN_LINKED):
            self.peers.announce(session, req.msg)   # its early chunks are kept, whoever floods
        if idle:
            self.pump(session)

    @staticmethod
    def _receives(run: Request) -> list[Request]:
        """A linked run's receives, as silent PEER_RECVs queued right ahead of it."""
        msg = cast(g.GraphRunLinked, run.msg)
        return [Request(Cmd.PEER_RECV, run.req_id,
                        wire_peer.PeerRecv(token=r.token, dst=r.dst, timeout_ms=msg.timeout_ms),
                        (), silent=True) for r in msg.receive]

    def pump(self, session: Session) -> bool:
        """Run the session's queue until empty or its head must wait; True if it must wait."""
        while session.queue and session.held_by is None:
            req = session.queue[0]
            if not all(ready(session, req) for ready in self.preconditions):
                return True
            session.queue.popleft()
            self._run(session, req)
            if session.client_id not in self.sessions:
                return False
        return False

    def pump_all(self) -> bool:
        """Retry every waiting session; True if some still wait."""
        waiting = False
        for session in list(self.sessions.values()):
            if session.queue:
                waiting = self.pump(session) or waiting
        return waiting

    def _run(self, session: Session, req: Request) -> None:
        try:
            deferred = self.deferred_handlers.get(req.cmd)
            if deferred is not None:
                pending = Pending(session, req.req_id, req.cmd, req.cmd is Cmd.PEER_RECV,
                                  req.silent)
                if deferred(pending, req.msg):
                    return
                reply, payload = NO_REPLY
            elif req.cmd is Cmd.GRAPH_RUN_LINKED:  # with what it prepared while it waited
                reply, payload = self._graph_run_linked(session, cast(g.GraphRunLinked, req.msg),
                                                        req.payload, req.prepared)
            else:
                reply, payload = self.handlers[req.cmd](session, req.msg, req.payload)
        except WireError as exc:
            self._fail(session, req, exc.code, exc.message)
            return
        except MemoryError:
            self._fail(session, req, ErrorCode.OUT_OF_MEMORY,
                       f"{req.cmd.name}: the worker ran out of {self.backend.kind} memory")
            return
        except Exception as exc:  # a bug must not take the worker down: report it
            log.exception("internal error in %s for %s", req.cmd.name, session.label)
            self._fail(session, req, ErrorCode.INTERNAL,
                       f"{req.cmd.name} failed: {type(exc).__name__}: {exc}")
            return
        self._start_sends(session)
        if req.cmd is Cmd.GRAPH_RUN_LINKED and self._hold(session, req, (reply, payload)):
            return
        self.reply(session.client_id, req.req_id, reply, payload)

    def _hold(self, session: Session, req: Request, reply: Reply) -> bool:
        """Keep a linked run's reply back as it asked, when what it fetched is small (copied
        now: later requests may write those buffers before the reply leaves)."""
        hold_us = cast(g.GraphRunLinked, req.msg).hold_reply_us
        frames: list[Any] = [f.data if isinstance(f, TrackedPayload) else f for f in reply[1]]
        size = sum(len(f) for f in frames)
        if not hold_us or size > MAX_HELD_BYTES or self.held_bytes + size > MAX_HELD_TOTAL:
            return False
        copied: list[Any] = [bytes(f) for f in frames]
        self.held.append(HeldReply(time.monotonic() + hold_us / 1e6, session.client_id,
                                   req.req_id, (reply[0], copied), size))
        self.held_bytes += size
        return True

    def release_held(self, now: float | None = None) -> None:
        """Send the held replies that are due (all of them when ``now`` is None), in order: a
        later one waits behind an earlier one."""
        while self.held and (now is None or self.held[0].due <= now):
            held = self.held.popleft()
            self.held_bytes -= held.nbytes
            self._send_reply(held.client_id, held.req_id, *held.reply)

    def next_release(self) -> float | None:
        """When the oldest held reply is due (None if nothing is held)."""
        return self.held[0].due if self.held else None

    def _fail(self, session: Session, req: Request, code: ErrorCode, message: str) -> None:
        """Answer ``req`` with an error. A linked run's receive that fails to start takes the
        rest of that run out of the queue: this is the run's one reply."""
        if req.silent:
            while session.queue and session.queue[0].req_id == req.req_id:
                session.queue.popleft()
            message = f"receiving the run's input failed: {message}"
        self._reply_error(session.client_id, req.req_id, code, message)

    def _start_sends(self, session: Session) -> None:
        """Start the peer sends queued right behind a finished request before replying to it:
        another worker waits on those bytes (a pipeline's next stage), the client does not wait
        on the reply."""
        while (session.queue and session.held_by is None
               and session.queue[0].cmd is Cmd.PEER_SEND
               and all(ready(session, session.queue[0]) for ready in self.preconditions)):
            self._run(session, session.queue.popleft())

    # --------------------------------------------------------------------------- replies

    def reply(self, client_id: bytes, req_id: int, msg: p.Message, payload: list[Any]) -> None:
        """Send a successful reply (after any held ones: replies leave in order)."""
        if self.held:
            self.release_held()
        self._send_reply(client_id, req_id, msg, payload)

    def _send_reply(self, client_id: bytes, req_id: int, msg: p.Message,
                    payload: list[Any]) -> None:
        """Big payloads that alias buffer memory are tracked."""
        header = p.encode_reply(req_id, msg)
        tracked = [b for b in payload if isinstance(b, TrackedPayload)]
        frames = [client_id, header, *[getattr(b, "data", b) for b in payload]]
        if not tracked:
            small = all(len(f) < zmq.COPY_THRESHOLD for f in frames[2:])
            self._send(frames, copy=small)   # copying tiny frames beats making zero-copy ones
            return
        tracker = self._send(frames, copy=False, track=True)
        for item in tracked:
            item.buffer.sending.append(tracker)

    def _reply_error(self, client_id: bytes, req_id: int, code: ErrorCode, message: str) -> None:
        log.debug("error reply %s to %s: %s", code.name, client_id.hex()[:8], message)
        if self.held:
            self.release_held()
        self._send([client_id, p.encode_error(req_id, code, message)])

    # --------------------------------------------------------------------------- sessions

    def _hello(self, client_id: bytes, req: Request) -> None:
        msg = cast(p.Hello, req.msg)
        if msg.major != p.PROTOCOL_VERSION[0]:
            self._reply_error(client_id, req.req_id, ErrorCode.VERSION_MISMATCH,
                              f"client speaks protocol {msg.major}.{msg.minor}, worker speaks "
                              f"{p.PROTOCOL_VERSION[0]}.{p.PROTOCOL_VERSION[1]}")
            return
        if not strong_client_id(client_id):
            self._reply_error(client_id, req.req_id, ErrorCode.BAD_REQUEST, WEAK_ID)
            return
        session = self.sessions.get(client_id)
        if session is None:
            session = self.sessions[client_id] = Session(client_id,
                                                         printable(msg.client, 64) or "client")
            log.info("session %s opened (%d open)", session.label, len(self.sessions))
        session.last_seen = time.monotonic()
        self.reply(client_id, req.req_id, self.hello_reply(), [])

    def hello_reply(self) -> p.HelloReply:
        """What this worker tells new sessions."""
        free, total = self.memory()
        device = p.Device(name=self.backend.device_name(), kind=self.backend.kind,
                          total_memory=total, free_memory=free)
        return p.HelloReply(
            major=p.PROTOCOL_VERSION[0], minor=p.PROTOCOL_VERSION[1], server=self.server_name,
            devices=(device,), alignment=self.backend.alignment,
            max_buffer_size=self.limits.max_buffer_size,
            max_message_size=self.limits.max_message_size,
            session_timeout_ms=int(self.limits.session_timeout * 1000),
            capabilities=tuple(self.capabilities), peer_endpoint=self.peer_endpoint)

    def _goodbye(self, session: Session, msg: p.Empty, payload: Sequence[Any]) -> Reply:
        self.close_session(session, "said goodbye")
        return NO_REPLY

    def close_session(self, session: Session, why: str) -> None:
        """Free everything the session owns."""
        freed = sum(b.size for b in session.buffers.values())
        freed += sum(graph.memory_charge for graph in session.graphs.values())
        self.budget.release(freed)
        session.buffers.clear()
        session.views.clear()
        session.graphs.clear()
        self.sessions.pop(session.client_id, None)
        if self.peers is not None:
            for pending in self.peers.fail_session(session):
                if not pending.silent:     # a linked run's receive: the run answers, below
                    self._reply_error(session.client_id, pending.req_id, ErrorCode.NO_SESSION,
                                      f"session closed ({why}) before this transfer finished")
        self._fail_queue(session, ErrorCode.NO_SESSION, f"session closed ({why})")
        log.info("session %s closed (%s): freed %d bytes; %d session(s) open",
                 session.label, why, freed, len(self.sessions))

    def fail_queued(self, code: ErrorCode, message: str) -> None:
        """Answer every request still waiting in any session's queue with an error."""
        for session in self.sessions.values():
            self._fail_queue(session, code, message)

    def _fail_queue(self, session: Session, code: ErrorCode, message: str,
                    own_req_id: int = -1, own_message: str = "") -> None:
        """Answer every queued request with an error (``own_message`` for the run whose own
        receive failed); silent receives have nobody to answer."""
        for req in session.queue:
            if not req.silent:
                mine = req.req_id == own_req_id
                self._reply_error(session.client_id, req.req_id, code,
                                  own_message if mine else message)
        session.queue.clear()

    def expire_sessions(self, now: float) -> None:
        """Close sessions silent for longer than the session timeout."""
        for session in list(self.sessions.values()):
            if now - session.last_seen > self.limits.session_timeout:
                self.close_session(session, f"no message for {self.limits.session_timeout:g} s")

    # ---------------------------------------------------------------------------- buffers

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes the worker may still hand out."""
        return self.budget.report()

    def _alloc(self, session: Session, msg: p.AllocBuffer, payload: Sequence[Any]) -> Reply:
        if msg.handle in session.buffers:
            raise WireError(ErrorCode.INVALID_HANDLE, f"buffer handle {msg.handle} is in use")
        if msg.size > self.limits.max_buffer_size:
            raise WireError(ErrorCode.OUT_OF_MEMORY, f"buffer of {msg.size} bytes is over the "
                            f"maximum buffer size {self.limits.max_buffer_size}")
        memory = self.budget.allocate(msg.size, "buffer", lambda: self.backend.alloc(msg.size))
        session.buffers[msg.handle] = Buffer(msg.handle, msg.size, memory)
        return NO_REPLY

    def buffer(self, session: Session, handle: int) -> Buffer:
        """The session's buffer ``handle``, or an INVALID_HANDLE error."""
        buf = session.buffers.get(handle)
        if buf is None:
            raise WireError(ErrorCode.INVALID_HANDLE,
                            f"buffer {handle} does not exist in this session")
        return buf

    def _free(self, session: Session, msg: p.BufferOp, payload: Sequence[Any]) -> Reply:
        buf = self.buffer(session, msg.handle)
        del session.buffers[msg.handle]
        session.frees += 1
        session.views.clear()
        self.budget.release(buf.size)
        return NO_REPLY

    def _clear(self, session: Session, msg: p.ClearBuffer, payload: Sequence[Any]) -> Reply:
        buf = self.buffer(session, msg.handle)
        self.backend.fill(buf.memory, msg.value)
        return NO_REPLY

    def _device_memory(self, session: Session, msg: p.Empty, payload: Sequence[Any]) -> Reply:
        free, total = self.memory()
        return p.DeviceMemoryReply(free=free, total=total), []

    def _buffers_idle(self, session: Session, req: Request) -> bool:
        written = self.writes.get(req.cmd)
        if written is None:
            return True
        for handle in written(session, req.msg):
            buf = session.buffers.get(handle)
            if buf is not None and buf.sending and buf.busy():
                return False
        return True

    # ---------------------------------------------------------------------------- tensors

    def view(self, session: Session, ref: TensorRef) -> Any:
        """The backend view of ``ref`` after checking its handle and that it lies in its buffer
        (remembered until the session frees a buffer)."""
        view = session.views.get(ref)
        if view is None:
            view = self._check_view(session, ref)
            if len(session.views) >= MAX_CACHED_VIEWS:
                session.views.clear()
            session.views[ref] = view
        return view

    def _check_view(self, session: Session, ref: TensorRef) -> Any:
        buf = self.buffer(session, ref.buffer)
        check_inside(ref, buf.size)
        if ref.nbytes > self.limits.max_buffer_size:
            raise WireError(ErrorCode.OUT_OF_BOUNDS, f"view of {ref.nbytes} bytes (repeating "
                            f"elements through zero strides) is over the maximum buffer size "
                            f"{self.limits.max_buffer_size}")
        return self.backend.view(buf.memory, ref)

    def _set_tensor(self, session: Session, msg: p.SetTensor, payload: Sequence[Any]) -> Reply:
        self.backend.write(self.view(session, msg.tensor), payload[0])
        return NO_REPLY

    def _get_tensor(self, session: Session, msg: p.GetTensor, payload: Sequence[Any]) -> Reply:
        return p.GetTensorReply(), [self._fetched(session, msg.tensor,
                                                  self.view(session, msg.tensor))]

    def _memset(self, session: Session, msg: p.MemsetTensor, payload: Sequence[Any]) -> Reply:
        ref = msg.tensor
        view = self.view(session, ref)
        if msg.offset > ref.nbytes:
            raise WireError(ErrorCode.OUT_OF_BOUNDS,
                            f"offset {msg.offset} is past the tensor's {ref.nbytes} bytes")
        size = ref.nbytes - msg.offset if msg.size == -1 else msg.size
        if size > ref.nbytes - msg.offset:
            raise WireError(ErrorCode.OUT_OF_BOUNDS, f"bytes [{msg.offset}, +{size}) are outside "
                            f"the tensor's {ref.nbytes} bytes")
        if msg.offset == 0 and size == ref.nbytes:
            self.backend.fill(view, msg.value)
        elif not ref.is_contiguous():
            raise WireError(ErrorCode.BAD_REQUEST, "a byte range memset needs a contiguous tensor")
        else:
            self.backend.fill(view.reshape(-1).view("uint8")[msg.offset:msg.offset + size],
                              msg.value)
        return NO_REPLY

    def _copy(self, session: Session, msg: p.CopyTensor, payload: Sequence[Any]) -> Reply:
        if msg.src.shape != msg.dst.shape or msg.src.dtype != msg.dst.dtype:
            raise WireError(ErrorCode.BAD_REQUEST,
                            f"copy needs equal shapes and dtypes: {msg.src.shape} "
                            f"{msg.src.dtype.dtype_name} -> {msg.dst.shape} "
                            f"{msg.dst.dtype.dtype_name}")
        src = self.view(session, msg.src)
        dst = self.view(session, msg.dst)
        self.backend.copy(dst, src)
        return NO_REPLY


    # ------------------------------------------------------------------------ peer copy

    def _fill(self, session: Session, req: Request) -> None:
        try:
            self.peers.fill(session, req.msg, req.payload[0])
        except WireError as exc:
            self._reply_error(session.client_id, req.req_id, exc.code, exc.message)
            return
        self.reply(session.client_id, req.req_id, p.Empty(), [])

    def _peer_recv(self, pending: Pending, msg: Any) -> bool:
        session = pending.session
        session.held_by = pending              # before: chunks stashed earlier may finish it now
        try:
            self.peers.start_recv(pending, msg)
        except BaseException:
            session.held_by = None
            raise
        if pending.silent and session.held_by is pending and session.queue:
            self._prepare_linked(session, session.queue[0], pending.req_id)
        return True

    def _prepare_linked(self, session: Session, run: Request, req_id: int) -> None:
        """While a linked run waits for its input, check and encode its sends, so that the run
        starts as soon as the bytes land (a failure here is reported by the run itself)."""
        if run.cmd is not Cmd.GRAPH_RUN_LINKED or run.req_id != req_id:
            return
        msg = cast(g.GraphRunLinked, run.msg)
        try:
            self._graph(session, msg.handle)
            pushes = self._pushes(session, msg)
            written = self._write_inputs_early(session, msg, run.payload)
        except Exception:  # noqa: BLE001 - the run itself meets and reports it (the receive runs)
            return
        run.prepared = Prepared(session.frees, pushes, written)

    def _write_inputs_early(self, session: Session, msg: g.GraphRunLinked,
                            payload: Sequence[Any]) -> bool:
        """Write a waiting linked run's inputs now, unless a receive lands on one of them (it
        must come first) or a zero-copy send still reads their buffers."""
        for ref in msg.inputs:
            if any(_overlap(ref, r.dst) for r in msg.receive):
                return False
            buf = session.buffers.get(ref.buffer)
            if buf is None or (buf.sending and buf.busy()):
                return False
        views = [self.view(session, ref) for ref in msg.inputs]
        for view, frame in zip(views, payload):
            self.backend.write(view, frame)
        return True

    def _pushes(self, session: Session, msg: g.GraphRunLinked) -> list[Any]:
        return [self.peers.prepare_push(session, send, acknowledge=False) for send in msg.send]

    def _peer_send(self, pending: Pending, msg: Any) -> bool:
        return bool(self.peers.start_send(pending, msg))

    def _peer_probe(self, pending: Pending, msg: Any) -> bool:
        if not self.peers.endpoint:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker has no peer endpoint")
        self.peers.start_probe(pending, msg)
        return True

    def finish(self, pending: Pending, error: str | None) -> None:
        """A deferred request is done: reply, release its session's queue, or fail what waited."""
        session = pending.session
        if self.sessions.get(session.client_id) is not session:
            return  # the session closed meanwhile
        if error is None and session.held_by is pending:
            session.held_by = None
            self.pump(session)   # what waited for these bytes runs first: the reply can wait
            if not pending.silent:
                self.reply(session.client_id, pending.req_id, p.Empty(), [])
            return
        if pending.silent:
            pass                # the linked run behind it answers (failed below, or runs)
        elif error is None:
            self.reply(session.client_id, pending.req_id, p.Empty(), [])
        else:
            self._reply_error(session.client_id, pending.req_id, ErrorCode.TRANSFER_FAILED, error)
        if session.held_by is not pending:
            return
        session.held_by = None
        if error is not None:
            run = session.queue[0].prepared if session.queue else None
            written = " (its inputs were written while it waited)" if (
                run is not None and run.inputs_written) else ""
            self._fail_queue(session, ErrorCode.TRANSFER_FAILED, "an earlier transfer this "
                             f"request was queued behind failed: {error}", pending.req_id,
                             f"receiving the run's input failed: {error}{written}")
        self.pump(session)

    # ----------------------------------------------------------------------------- graphs

    def _graph_register(self, session: Session, msg: g.GraphRegister,
                        payload: Sequence[Any]) -> Reply:
        if msg.handle in session.graphs:
            raise WireError(ErrorCode.INVALID_HANDLE, f"graph handle {msg.handle} is in use")
        graph = self._compile(session, msg.graph)
        self.budget.allocate(graph.memory_charge, "graph scratch arena",
                             lambda: graph.ensure_arena(self.backend))
        session.graphs[msg.handle] = graph
        return NO_REPLY

    def _compile(self, session: Session, spec: g.GraphSpec) -> CompiledGraph:
        if not self.backend.supports_graphs:
            raise WireError(ErrorCode.GRAPH_INVALID,
                            f"the {self.backend.name} backend does not run graphs yet")
        for ref in spec.tensors:
            self.view(session, ref)          # handles exist, views inside their buffers
        return compile_graph(spec, self.limits.max_graph_work)

    def _graph(self, session: Session, handle: int) -> CompiledGraph:
        graph = session.graphs.get(handle)
        if graph is None:
            raise WireError(ErrorCode.INVALID_HANDLE,
                            f"graph {handle} is not registered in this session")
        return graph

    def _graph_run_writes(self, session: Session, msg: g.GraphRun) -> Iterable[int]:
        graph = session.graphs.get(msg.handle)
        written = graph.written_buffers if graph is not None else frozenset()
        return [*written, *(t.buffer for t in msg.inputs)]

    def _graph_run(self, session: Session, msg: g.GraphRun, payload: Sequence[Any]) -> Reply:
        return self._execute(session, self._graph(session, msg.handle), msg, payload)

    def _graph_run_linked(self, session: Session, msg: g.GraphRunLinked,
                          payload: Sequence[Any], prepared: Prepared | None) -> Reply:
        """Its receives have landed (they ran ahead of it): check the sends, run, push them."""
        graph = self._graph(session, msg.handle)
        fresh = prepared is not None and prepared.frees == session.frees
        pushes = prepared.pushes if prepared is not None and fresh else self._pushes(session, msg)

        def push_all() -> None:          # before reading the fetch: a peer waits on these
            for push in pushes:
                self.peers.push(push)

        written = prepared is not None and prepared.inputs_written
        return self._execute(session, graph, msg, () if written else payload, then=push_all)

    def _graph_compute(self, session: Session, msg: g.GraphCompute,
                       payload: Sequence[Any]) -> Reply:
        graph = self._compile(session, msg.graph)
        with self.budget.borrowed(graph.memory_charge, "graph scratch arena"):
            return self._execute(session, graph, msg, payload)

    def _execute(self, session: Session, graph: CompiledGraph,
                 msg: g.GraphRun | g.GraphCompute | g.GraphRunLinked,
                 payload: Sequence[Any], then: Callable[[], None] | None = None) -> Reply:
        """Write the inputs, run, call ``then`` (if any), read the fetched tensors."""
        inputs = [self.view(session, ref) for ref in msg.inputs]
        fetch = [self.view(session, ref) for ref in msg.fetch]
        externals = self._externals(session, graph)
        graph.ensure_arena(self.backend)
        for view, frame in zip(inputs, payload):
            self.backend.write(view, frame)
        started = time.perf_counter_ns()
        graph.run(externals)
        elapsed = time.perf_counter_ns() - started
        if then is not None:
            then()
        frames = [self._fetched(session, ref, view) for ref, view in zip(msg.fetch, fetch)]
        return g.GraphReply(sizes=[ref.nbytes for ref in msg.fetch], compute_ns=elapsed), frames

    def _externals(self, session: Session, graph: CompiledGraph) -> list[Any]:
        """The graph's external views, validated once and reused until a buffer is freed."""
        if graph.views is None or graph.views_valid_at != session.frees:
            graph.views = [self.view(session, ref) for ref in graph.spec.tensors]
            graph.views_valid_at = session.frees
        return graph.views

    def _fetched(self, session: Session, ref: TensorRef, view: Any) -> Any:
        data, aliased = self.backend.read(view)
        if aliased and ref.nbytes >= TRACK_THRESHOLD:
            return TrackedPayload(data, session.buffers[ref.buffer])
        return data

    def _graph_free(self, session: Session, msg: p.BufferOp, payload: Sequence[Any]) -> Reply:
        graph = self._graph(session, msg.handle)
        del session.graphs[msg.handle]
        self.budget.release(graph.memory_charge)
        return NO_REPLY


@dataclass(frozen=True)
class TrackedPayload:
    """A reply frame that aliases ``buffer``'s memory: the buffer records the send's tracker."""

    data: Any
    buffer: Buffer


def _overlap(a: TensorRef, b: TensorRef) -> bool:
    """Whether two views of the same buffer may share a byte."""
    if a.buffer != b.buffer:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = a.byte_extent(), b.byte_extent()
    return a_lo < b_hi and b_lo < a_hi


def check_inside(ref: TensorRef, size: int) -> None:
    """OUT_OF_BOUNDS unless every element ``ref`` can reach lies in ``[0, size)``."""
    lo, hi = ref.byte_extent()
    if lo < 0 or hi > size or (ref.numel == 0 and ref.offset > size):
        raise WireError(ErrorCode.OUT_OF_BOUNDS,
                        f"view {ref.dtype.dtype_name}{list(ref.shape)} strides {list(ref.strides)} "
                        f"at offset {ref.offset} reaches bytes [{lo}, {hi}) of a {size}-byte buffer")
