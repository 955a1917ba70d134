"""Receives in progress, on the backend thread: chunks checked and landed in their destinations.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer.links.PeerLinks`). No sockets:
chunks arrive as (header, frame) pairs whose frame has ``.buffer`` and a length (a ``zmq.Frame``
from the PULL socket, or a client's PEER_FILL payload), and the acknowledgement a sender asked
for leaves through the ``ack`` callable it was built with. Each receive ends exactly once, through
its ``done``: every chunk landed, a chunk that does not fit (TRANSFER_FAILED, nothing more lands),
the client calling it off, or its deadline; a closing session's receives end silently
(:meth:`Receives.forget`). Chunks for a transfer nobody here waits for yet go to the
:class:`~zmq_rpc.worker.peer.stash.Stash`, per sender.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...broker import peer as wire
from ...broker.protocol import ErrorCode, TensorRef, WireError
from ..backends.base import Backend, View
from ..observe.metrics import NullRecorder, Recorder
from .acks import Done
from .stash import Stash

SendAck = Callable[[str, wire.Ack], None]
"""Sends an acknowledgement to a peer endpoint (never raises: a failure is logged)."""


@dataclass
class Incoming:
    """A receive at the head of its session's queue, collecting chunks into ``dst``."""

    owner: object
    done: Done
    ref: TensorRef
    view: View
    deadline: float
    staging: np.ndarray | None
    target: memoryview | None
    """The destination's bytes in place (a contiguous view on a host backend): chunks land
    with one memcpy each."""
    received: set[int] = field(default_factory=set)
    nchunks: int = -1
    nbytes: int = 0
    reply_to: str = ""
    source: str = ""
    """The sending worker's peer endpoint when the client named it (1.9): the link to it is
    watched (:meth:`~zmq_rpc.worker.peer.links.PeerLinks.expire`)."""
    started: float = field(default_factory=time.monotonic)

    def admit(self, chunk: wire.Chunk, size: int) -> None:
        """Count a chunk of ``size`` bytes in, or TRANSFER_FAILED when it does not belong:
        outside the destination, repeated, inconsistent with the others, or the last one
        leaving the byte count short."""
        total = self.ref.nbytes
        if chunk.total != total or chunk.start > total or size > total - chunk.start:
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"chunk of {size} bytes at {chunk.start} does not fit a {total}-byte "
                            f"destination (sender says {chunk.total})")
        if self.nchunks not in (-1, chunk.nchunks) or chunk.seq in self.received:
            raise WireError(ErrorCode.TRANSFER_FAILED, "inconsistent or repeated chunk")
        self.nchunks = chunk.nchunks
        self.received.add(chunk.seq)
        self.nbytes += size
        if self.complete and self.nbytes != total:
            raise WireError(ErrorCode.TRANSFER_FAILED, f"all {chunk.nchunks} chunks arrived but "
                            f"carried {self.nbytes} of {total} bytes")

    @property
    def complete(self) -> bool:
        """Every chunk has arrived."""
        return len(self.received) == self.nchunks

    def progress(self) -> str:
        """How much arrived, for a timeout's message."""
        return f"{len(self.received)} of {max(self.nchunks, 0) or '?'} chunks"


class Receives:
    """The backend thread's receives in progress, by transfer token, and the early chunks."""

    def __init__(self, backend: Backend, stash: Stash, ack: SendAck) -> None:
        self.backend = backend
        self.stash = stash
        self.ack = ack
        self.pending: dict[bytes, Incoming] = {}
        self.metrics: Recorder = NullRecorder()

    def __len__(self) -> int:
        return len(self.pending)

    def announce(self, owner: object, tokens: list[bytes]) -> None:
        """A session queued a PEER_RECV (or a linked run's receives): chunks for these tokens
        that arrive before the receive starts are kept apart from unannounced ones."""
        for token in tokens:
            if token not in self.pending:
                self.stash.announce(owner, token)

    def start(self, token: bytes, dst: TensorRef, view: View, timeout_ms: int,
              owner: object, done: Done, source: str = "") -> None:
        """Begin receiving transfer ``token`` into ``view`` (the checked view of ``dst``);
        chunks stashed earlier may finish it, and call ``done``, before this returns."""
        if token in self.pending:
            raise WireError(ErrorCode.TRANSFER_FAILED, "that transfer token is already in use")
        contiguous = dst.is_contiguous()
        staging = None if contiguous else np.empty(dst.nbytes, np.uint8)
        in_place = self.backend.alias(view) if contiguous else None
        self.pending[token] = Incoming(
            owner, done, dst, view, time.monotonic() + timeout_ms / 1000, staging,
            None if in_place is None else memoryview(in_place), source=source)
        stashed, aborted = self.stash.claim(owner, token)
        if aborted is not None:               # called off before it started: fail it now
            self.pending[token].reply_to = aborted.reply_to   # its sender hears it at once
            self.finish(token, aborted.why)
            return
        if stashed is not None:
            for chunk, frame in stashed.messages:
                if token in self.pending:
                    self.on_chunk(chunk, frame, stashed.sender)

    def fill(self, owner: object, sender: str, msg: wire.PeerFill, frame: Any) -> None:
        """A chunk relayed by the client ``sender`` on behalf of ``owner`` (no ack: the
        client's reply is the acknowledgement)."""
        transfer = self.pending.get(msg.token)
        if transfer is not None and transfer.owner is not owner:
            raise WireError(ErrorCode.INVALID_HANDLE, "that transfer belongs to another session")
        if msg.error:
            why = f"the client called the transfer off: {msg.error}"
            if transfer is not None:
                self.finish(msg.token, why)
            else:                     # its receive has not started: it fails when it does
                self.stash.abort(owner, msg.token, why)
            return
        self.on_chunk(wire.Chunk(msg.token, msg.seq, msg.nchunks, msg.start, msg.total, ""),
                      frame, sender)

    def on_chunk(self, chunk: wire.Chunk, frame: Any, sender: str) -> None:
        """Land a chunk in its receive (finishing it when it was the last, failing it when it
        does not fit), or stash it when its receive has not started."""
        transfer = self.pending.get(chunk.token)
        if transfer is None:
            self.stash.keep(chunk, frame, sender)
            return
        transfer.reply_to = chunk.reply_to or transfer.reply_to
        size = len(frame)
        try:
            transfer.admit(chunk, size)
        except WireError as exc:
            self.finish(chunk.token, exc.message)
            return
        self._land(transfer, chunk.start, size, frame.buffer)
        if transfer.complete:
            self.finish(chunk.token, None)

    def _land(self, transfer: Incoming, start: int, size: int, data: Any) -> None:
        if transfer.target is not None:
            transfer.target[start:start + size] = data
        elif transfer.staging is not None:
            transfer.staging[start:start + size] = np.frombuffer(data, np.uint8)
        else:
            self.backend.write_bytes(transfer.view, start, data)

    def finish(self, token: bytes, error: str | None) -> None:
        """End receive ``token``: write a staged destination, tell ``done``, acknowledge."""
        transfer = self.pending.pop(token)
        self.metrics.transfer("in", error is None)
        if error is None and transfer.staging is not None:
            self.backend.write(transfer.view, transfer.staging)
        transfer.done(error)                  # may run the session's next requests
        if transfer.reply_to:
            self.ack(transfer.reply_to, wire.Ack(token, error is None, error or "ok"))

    def next_deadline(self) -> float | None:
        """The earliest deadline of a receive, None when none runs."""
        return min((t.deadline for t in self.pending.values()), default=None)

    def expire(self, now: float) -> None:
        """Fail the receives past their deadline."""
        for token, transfer in list(self.pending.items()):
            if now >= transfer.deadline:
                self.finish(token, f"transfer into {list(transfer.ref.shape)} timed out "
                                   f"({transfer.progress()} arrived)")

    def forget(self, owner: object) -> None:
        """Drop a closing session's receives without calling their ``done``."""
        for token in [t for t, into in self.pending.items() if into.owner is owner]:
            del self.pending[token]
