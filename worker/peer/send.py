"""Sends to a peer, on the backend thread: a tensor cut into chunks, headers encoded ahead, pushed.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer.links.PeerLinks`). A send is
prepared before what it follows runs (:meth:`Pusher.prepare`: the endpoint checked, the link
opened, every chunk's header encoded; :func:`cut` is that cutting, with no socket), then pushed
(:meth:`Pusher.push`: only handing frames to zmq). Big chunks that alias their buffer go
zero-copy (the buffer is not written until their trackers are done); strided pieces are
materialized and counted in their session's memory until sent; small chunks are copied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from ...broker import peer as wire
from ...broker.protocol import ErrorCode, WireError, split_tensor
from ..backends.base import Backend, Memory, View
from ..observe.metrics import NullRecorder, Recorder
from ..sessions.quotas import Charged
from .push import PushLinks

CHUNK_BYTES = 4 << 20
ZERO_COPY_BYTES = 256 * 1024
"""Smaller chunks are copied into zmq messages: a memcpy of up to 256 KiB (tens of
microseconds) costs less than tracking a zero-copy message (a tracker, a wake-up of pyzmq's
garbage-collector thread for each), and a send made only of copied chunks no longer depends on
its buffer once pushed, so it may go unacknowledged (PEER_SEND ``acked`` false)."""


@dataclass(frozen=True)
class Source:
    """Where a send reads from: the checked view, its buffer's memory, and where the trackers
    of zero-copy chunks go (the buffer is not written until they are done)."""

    view: View
    memory: Memory
    track: Callable[[zmq.MessageTracker], None]
    copy: Callable[[View, str], Charged] | None = None
    """Materializes a piece that cannot go in place (strided), counted in its session's memory
    until sent; None: read it uncounted."""
    sent: Callable[[zmq.MessageTracker | None, Charged], None] | None = None
    """Told the tracker of a materialized piece (its bytes are given back when done)."""


@dataclass(frozen=True)
class Piece:
    """One chunk of a send, its header encoded ahead: ``data`` aliases the source buffer when
    the backend can hand its bytes out in place (read after the run, for nothing), else the
    piece's view is read when it is pushed."""

    header: bytes
    view: View
    data: Any | None
    zero_copy: bool


@dataclass(frozen=True)
class Push:
    """A checked send, ready to go: its pieces, where trackers go, the link to the peer."""

    pieces: tuple[Piece, ...]
    source: Source
    endpoint: str
    link: zmq.Socket[bytes]
    acknowledged: bool = False
    """The receiver answers (PEER_SEND); a linked run's pushes are counted once sent."""


def cut(backend: Backend, send: wire.Send, source: Source, reply_to: str) -> tuple[Piece, ...]:
    """``send``'s chunks of at most :data:`CHUNK_BYTES`, their headers encoded (asking for an
    acknowledgement at ``reply_to`` when it is not empty)."""
    sub_refs = split_tensor(send.src, CHUNK_BYTES)
    pieces = []
    for seq, (start, sub) in enumerate(sub_refs):
        piece_view = (source.view if len(sub_refs) == 1
                      else backend.view(source.memory, sub))
        data = backend.alias(piece_view)
        header = wire.encode_peer(wire.Chunk(send.token, seq, len(sub_refs), start,
                                              send.src.nbytes, reply_to))
        pieces.append(Piece(header, piece_view, data,
                            data is not None and sub.nbytes >= ZERO_COPY_BYTES))
    return tuple(pieces)


class Pusher:
    """Prepares sends and hands their chunks to the PUSH links."""

    def __init__(self, backend: Backend, links: PushLinks) -> None:
        self.backend = backend
        self.links = links
        self.metrics: Recorder = NullRecorder()

    def prepare(self, send: wire.Send, source: Source, reply_to: str) -> Push:
        """Check a send (peer endpoint, link) and encode its chunk headers before anything it
        follows runs: after the run, pushing is only handing frames to zmq. With a
        ``reply_to`` the receiver answers there once it has everything, else it sends
        nothing."""
        pieces = cut(self.backend, send, source, reply_to)
        self.links.check_verified(send.endpoint)
        return Push(pieces, source, send.endpoint, self.links.get(send.endpoint),
                    bool(reply_to))

    def push(self, push: Push) -> None:
        """Send the prepared chunks (zero-copy from the buffer when big and aliased)."""
        link = push.link if not push.link.closed else self.links.get(push.endpoint)
        self.metrics.peer_out([p.header for p in push.pieces])
        self.metrics.peer_out([p.view for p in push.pieces])
        if not push.acknowledged:
            self.metrics.transfer("out", True)
        self.backend.prefetch([p.view for p in push.pieces if p.data is None])  # GPU: overlap
        for piece in push.pieces:
            data = piece.data
            if data is None and push.source.copy is not None and \
                    piece.view.nbytes >= ZERO_COPY_BYTES:
                self._push_charged(push, piece, link)
                continue
            if data is None:
                data = self.backend.read(piece.view)[0]
            if piece.zero_copy:
                tracker = self.links.send(link, push.endpoint, [piece.header, data], track=True)
                if tracker is not None:
                    push.source.track(tracker)
            else:     # bytes in the buffer are copied (it may change once this returns)
                self.links.send(link, push.endpoint, [piece.header, data],
                                copy=piece.data is not None)

    def _push_charged(self, push: Push, piece: Piece, link: zmq.Socket[bytes]) -> None:
        """A piece that must be materialized (strided, zero-stride) is counted in its
        session's memory until libzmq has sent it (a dead peer cannot pile up copies)."""
        copy, sent = push.source.copy, push.source.sent
        if copy is None or sent is None:
            raise WireError(ErrorCode.INTERNAL, "a materialized piece needs copy and sent")
        charged = copy(piece.view, push.endpoint)
        try:
            tracker = self.links.send(link, push.endpoint, [piece.header, charged.data],
                                      track=True)
        except WireError:
            sent(zmq.MessageTracker(), charged)      # never queued: done, reaped at once
            raise
        sent(tracker, charged)
