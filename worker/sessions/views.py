"""Checked views of a session's buffers, for every command that touches tensor bytes.

Owned by the backend thread. :class:`Views` turns a wire :class:`~zmq_rpc.broker.protocol.TensorRef`
into a backend view after checking its handle and bounds (remembered per session until a buffer
is freed), and a fetched view into a reply frame (zero-copy and tracked when big, else a copy
charged to the session's memory until sent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...broker.protocol import ErrorCode, TensorRef, WireError
from ..backends.base import Backend, View
from .memory import SessionMemory
from .quotas import Charged
from .session import Buffer, Session

MAX_CACHED_VIEWS = 1024
"""Most checked views a session keeps (see :attr:`~.session.Session.views`)."""

TRACK_THRESHOLD = 64 * 1024
"""Replies at least this big are sent zero-copy from buffer memory, with a tracker."""


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
