"""A client's session on a worker: its buffers, graphs and request queue, and its checked views.

Owned by the backend thread, like everything a session holds: no other thread reads or writes
any of it. :class:`Views` turns a wire :class:`~zmq_rpc.broker.protocol.TensorRef` into a backend
view after checking its handle and bounds (remembered per session until a buffer is freed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq

from ...broker import protocol as p
from ...broker.ops import DEFAULT_MAX_WORK
from ...broker.protocol import ErrorCode, TensorRef, WireError
from ...broker.request_mac import Verifier
from ..backends.base import Backend, Memory, View
from .quotas import Charged, Usage

if TYPE_CHECKING:
    from .memory import SessionMemory

if TYPE_CHECKING:
    from ..graphs.execute import CompiledGraph
    from .requests import Request

MAX_CACHED_VIEWS = 1024
"""Most checked views a session keeps (see :attr:`Session.views`)."""

TRACK_THRESHOLD = 64 * 1024
"""Replies at least this big are sent zero-copy from buffer memory, with a tracker."""


@dataclass(frozen=True)
class WorkerLimits:
    """What the worker may hand out, and how long a silent session lives."""

    memory_limit: int
    max_buffer_size: int
    max_message_size: int
    session_timeout: float
    max_graph_work: int = DEFAULT_MAX_WORK
    """Element-ops one graph run may ask for (see :func:`~zmq_rpc.broker.ops.node_work`)."""
    session_memory: int = 0
    """Bytes one session may hold (0: the memory limit); see :mod:`~zmq_rpc.worker.sessions.quotas`."""
    max_sessions: int = 64
    """Sessions open at once; the HELLO of one more is refused (see :mod:`~zmq_rpc.worker.sessions.quotas`)."""
    identity_memory: int = 0
    """Bytes all sessions of one client identity may hold (0: 3/4 of the memory limit)."""
    identity_sessions: int = 0
    """Sessions one client identity may hold (0: 3/4 of ``max_sessions``); see
    :mod:`~zmq_rpc.worker.sessions.identities`."""


@dataclass
class Buffer:
    """One allocation: its memory and the zero-copy sends that still read from it."""

    handle: int
    size: int
    memory: Memory
    sending: list[zmq.MessageTracker] = field(default_factory=list)

    def busy(self) -> bool:
        """Whether a zero-copy reply or push still reads this memory (writes must wait)."""
        if not self.sending:
            return False
        self.sending = [t for t in self.sending if not t.done]
        return bool(self.sending)


@dataclass
class Session:
    """A client's resources; freed when it says goodbye or goes silent past the session timeout."""

    client_id: bytes
    name: str
    buffers: dict[int, Buffer] = field(default_factory=dict)
    graphs: dict[int, CompiledGraph] = field(default_factory=dict)
    queue: deque[Request] = field(default_factory=deque)
    """Requests in arrival order; the head runs first, and one whose transfer is under way
    (``in_flight``) holds the rest back."""
    pumping: bool = False
    """The executor is running this queue now (a transfer finishing meanwhile only marks it)."""
    frees: int = 0
    """Bumped whenever a buffer is freed: views resolved before then may be stale."""
    views: dict[TensorRef, View] = field(default_factory=dict)
    """Checked views by reference (a pipeline names the same few every step); emptied when a
    buffer is freed."""
    last_seen: float = field(default_factory=time.monotonic)
    usage: Usage = field(default_factory=Usage)
    answered_later: set[Request] = field(default_factory=set)
    """Requests out of the queue that the end of their transfer answers (a send, a probe)."""
    sid: int = 0
    """A number for the logs and the status (``s<sid>``): the routing id keys the session and
    stays secret, only its first 4 bytes are ever shown."""
    timing: bool = False
    """The client asked for the worker's share of each request's time in its replies (1.4)."""
    minor: int = 0
    """The protocol minor the client said in HELLO: replies carry fields up to it."""
    identity: str = ""
    """Whose session this is (:mod:`~zmq_rpc.worker.sessions.identities`): quotas over all of an
    identity's sessions, and a later HELLO must come from it."""
    verifier: Verifier | None = None
    """Set when the opening HELLO exchanged keys (1.10, :mod:`~zmq_rpc.broker.request_mac`):
    every later request must carry the session's signature, else it is refused untouched."""
    refused: int = 0
    """Requests refused for a missing or wrong signature (the first is logged)."""

    @property
    def label(self) -> str:
        return f"s{self.sid}"

    def log_fields(self) -> dict[str, Any]:
        """The session's identity for a log record (``extra=``): JSON logs keep them apart."""
        return {"session": self.label, "client": self.name, "client_id": self.client_id.hex()[:8]}

    def idle(self, handles: Iterable[int]) -> bool:
        """Whether no zero-copy send still reads any of the buffers ``handles`` names."""
        for handle in handles:
            buf = self.buffers.get(handle)
            if buf is not None and buf.busy():
                return False
        return True


Reply = tuple[p.Message, list[Any]]
"""A reply header message and its payload frames."""
NO_REPLY: Reply = (p.Empty(), [])


@dataclass(frozen=True)
class TrackedPayload:
    """A reply frame that aliases ``buffer``'s memory: the buffer records the send's tracker."""

    data: Any
    buffer: Buffer


class Views:
    """Checked views of a session's buffers, for every command that touches tensor bytes."""

    def __init__(self, backend: Backend, max_view_bytes: int, memory: SessionMemory) -> None:
        self.backend = backend
        self.max_view_bytes = max_view_bytes
        self.memory = memory

    @staticmethod
    def buffer(session: Session, handle: int) -> Buffer:
        """The session's buffer ``handle``, or an INVALID_HANDLE error."""
        buf = session.buffers.get(handle)
        if buf is None:
            raise WireError(ErrorCode.INVALID_HANDLE,
                            f"buffer {handle} does not exist in this session")
        return buf

    def view(self, session: Session, ref: TensorRef) -> View:
        """The backend view of ``ref`` after checking its handle and that it lies in its buffer
        (remembered until the session frees a buffer)."""
        view = session.views.get(ref)
        if view is None:
            view = self._check(session, ref)
            if len(session.views) >= MAX_CACHED_VIEWS:
                session.views.clear()
            session.views[ref] = view
        return view

    def fetched(self, session: Session, ref: TensorRef, view: View) -> Any:
        """A reply frame: the buffer's bytes in place (tracked when big), else a copy; a big
        copy (a strided or zero-stride view) is counted in memory until it is sent."""
        data = self.backend.alias(view)
        if data is not None:
            if ref.nbytes >= TRACK_THRESHOLD:
                return TrackedPayload(data, session.buffers[ref.buffer])
            return data
        if ref.nbytes < TRACK_THRESHOLD:
            return self.backend.read(view)[0]
        data = self.memory.allocate(session, ref.nbytes, "reply",
                                    lambda: self.backend.read(view)[0])
        return Charged(data, ref.nbytes, session.usage)

    def fetch_all(self, session: Session, refs: Sequence[TensorRef],
                  views: Sequence[View]) -> list[Any]:
        """Every fetched frame, or none: a fetch that does not fit gives back the others."""
        frames: list[Any] = []
        try:
            for ref, view in zip(refs, views):
                frames.append(self.fetched(session, ref, view))
        except BaseException:
            for frame in frames:
                if isinstance(frame, Charged):
                    self.memory.uncharge(session, frame.nbytes)
            raise
        return frames

    def _check(self, session: Session, ref: TensorRef) -> View:
        buf = self.buffer(session, ref.buffer)
        check_inside(ref, buf.size)
        if ref.nbytes > self.max_view_bytes:
            raise WireError(ErrorCode.OUT_OF_BOUNDS, f"view of {ref.nbytes} bytes (repeating "
                            f"elements through zero strides) is over the maximum buffer size "
                            f"{self.max_view_bytes}")
        return self.backend.view(buf.memory, ref)


def check_inside(ref: TensorRef, size: int) -> None:
    """OUT_OF_BOUNDS unless every element ``ref`` can reach lies in ``[0, size)``."""
    lo, hi = ref.byte_extent()
    if lo < 0 or hi > size or (ref.numel == 0 and ref.offset > size):
        raise WireError(ErrorCode.OUT_OF_BOUNDS,
                        f"view {ref.dtype.dtype_name}{list(ref.shape)} strides {list(ref.strides)} "
                        f"at offset {ref.offset} reaches bytes [{lo}, {hi}) of a {size}-byte buffer")


def overlap(a: TensorRef, b: TensorRef) -> bool:
    """Whether two views of the same buffer may share a byte."""
    if a.buffer != b.buffer:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = a.byte_extent(), b.byte_extent()
    return a_lo < b_hi and b_lo < a_hi
