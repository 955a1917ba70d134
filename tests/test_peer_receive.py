"""Receives in progress (worker/peer/receive.py): chunks checked and landed, with no socket.

Chunks are handed in as a peer's PULL would hand them (``wire.Chunk`` + a ``zmq.Frame``, which is
a message, not a socket); acknowledgements are caught by the ``ack`` callable.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import zmq
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.protocol import DType, TensorRef, WireError
from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
from zmq_rpc.worker.peer.receive import Receives
from zmq_rpc.worker.peer.stash import Stash

pytestmark = pytest.mark.timeout(10)


class DeviceLike(NumpyBackend):
    """A backend that never hands its bytes out in place (as a GPU): chunks go through
    ``write_bytes``."""

    def alias(self, view: np.ndarray) -> Any | None:
        return None


class Harness:
    def __init__(self, backend: NumpyBackend | None = None) -> None:
        self.backend = backend or NumpyBackend()
        self.acks: list[tuple[str, wire.Ack]] = []
        self.outcomes: list[str | None] = []
        self.stash = Stash(1 << 20)
        self.receives = Receives(self.backend, self.stash,
                                 lambda ep, ack: self.acks.append((ep, ack)))
        self.owner = object()

    def start(self, tok: bytes, dst: TensorRef, buf: np.ndarray, timeout_ms: int = 5000) -> None:
        view = self.backend.view(buf, dst)
        self.receives.start(tok, dst, view, timeout_ms, self.owner, self.outcomes.append)


def f32(n: int, offset: int = 0, stride: int = 4) -> TensorRef:
    return TensorRef(buffer=1, dtype=DType.FLOAT32, shape=(n,), strides=(stride,), offset=offset)


def pieces(tok: bytes, data: bytes, size: int, reply_to: str = "") -> list[tuple[wire.Chunk,
                                                                                  zmq.Frame]]:
    starts = list(range(0, len(data), size))
    return [(wire.Chunk(tok, seq, len(starts), start, len(data), reply_to),
             zmq.Frame(data[start:start + size])) for seq, start in enumerate(starts)]


def token() -> bytes:
    return os.urandom(wire.TOKEN_BYTES)


@pytest.mark.parametrize("backend", [NumpyBackend(), DeviceLike()], ids=["in-place", "write"])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_chunks_in_any_order_land_in_place_and_finish_once(backend: NumpyBackend,
                                                           order: str) -> None:
    h, tok = Harness(backend), token()
    buf = np.zeros(64, np.uint8)
    values = np.arange(8, dtype=np.float32)
    h.start(tok, f32(8, offset=16), buf)
    chunks = pieces(tok, values.tobytes(), 12, reply_to="tcp://10.0.0.1:5")
    for chunk, frame in (chunks if order == "forward" else chunks[::-1]):
        h.receives.on_chunk(chunk, frame, "peer")
    assert h.outcomes == [None]
    np.testing.assert_array_equal(buf[16:48].view(np.float32), values)
    assert buf[:16].sum() == 0 and buf[48:].sum() == 0        # nothing outside the view
    assert h.acks == [("tcp://10.0.0.1:5", wire.Ack(tok, True, "ok"))]
    assert len(h.receives) == 0


def test_a_strided_destination_is_staged_and_written_at_the_end() -> None:
    h, tok = Harness(), token()
    buf = np.zeros(32, np.float32)
    values = np.arange(4, dtype=np.float32) + 1
    h.start(tok, f32(4, stride=8), buf)
    (first, f1), (second, f2) = pieces(tok, values.tobytes(), 8)
    h.receives.on_chunk(first, f1, "peer")
    assert not buf.any()                      # staged: the view is written once, when complete
    h.receives.on_chunk(second, f2, "peer")
    assert h.outcomes == [None] and h.acks == []            # nobody asked for an ack
    np.testing.assert_array_equal(buf[0:8:2], values)
    assert not buf[1:8:2].any()


@pytest.mark.parametrize("bad, why", [
    (wire.Chunk(b"", 0, 1, 0, 99, ""), "does not fit"),                 # sender's total differs
    (wire.Chunk(b"", 0, 1, 30, 32, ""), "does not fit"),                # runs past the end
    (wire.Chunk(b"", 0, 1, 33, 32, ""), "does not fit"),                # starts past the end
    (wire.Chunk(b"", 0, 2, 0, 32, ""), "inconsistent or repeated"),     # chunk count changes
    (wire.Chunk(b"", 1, 4, 8, 32, ""), "inconsistent or repeated"),     # seq repeated
])
def test_a_chunk_that_does_not_belong_fails_the_receive_with_its_reason(
        bad: wire.Chunk, why: str) -> None:
    h, tok = Harness(), token()
    buf = np.zeros(8, np.float32)
    h.start(tok, f32(8), buf)
    h.receives.on_chunk(wire.Chunk(tok, 1, 4, 8, 32, "tcp://10.0.0.2:5"), zmq.Frame(bytes(8)),
                        "peer")
    h.receives.on_chunk(wire.Chunk(tok, bad.seq, bad.nchunks, bad.start, bad.total, ""),
                        zmq.Frame(b"\xff" * 8), "peer")
    assert len(h.outcomes) == 1 and h.outcomes[0] is not None and why in h.outcomes[0]
    assert h.acks[0][1].ok is False and why in h.acks[0][1].message
    assert not buf.any() and len(h.receives) == 0
    h.receives.on_chunk(wire.Chunk(tok, 2, 4, 16, 32, ""), zmq.Frame(bytes(8)), "peer")
    assert len(h.outcomes) == 1              # a later chunk is stashed, not landed: said once


def test_chunks_adding_up_short_fail_the_receive() -> None:
    h, tok = Harness(), token()
    h.start(tok, f32(4), np.zeros(4, np.float32))
    h.receives.on_chunk(wire.Chunk(tok, 0, 2, 0, 16, ""), zmq.Frame(bytes(4)), "p")
    h.receives.on_chunk(wire.Chunk(tok, 1, 2, 8, 16, ""), zmq.Frame(bytes(4)), "p")
    assert h.outcomes == ["all 2 chunks arrived but carried 8 of 16 bytes"]


def test_chunks_before_the_receive_are_stashed_and_land_when_it_starts() -> None:
    h, tok = Harness(), token()
    h.receives.announce(h.owner, [tok])
    values = np.arange(4, dtype=np.float32)
    for chunk, frame in pieces(tok, values.tobytes(), 8):
        h.receives.on_chunk(chunk, frame, "peer")
    assert len(h.stash) == 1 and h.outcomes == []
    buf = np.zeros(4, np.float32)
    h.start(tok, f32(4), buf)
    assert h.outcomes == [None] and len(h.stash) == 0
    np.testing.assert_array_equal(buf, values)


def test_a_fill_called_off_before_the_receive_fails_it_as_it_starts() -> None:
    h, tok = Harness(), token()
    h.receives.announce(h.owner, [tok])
    h.receives.fill(h.owner, "client x", wire.PeerFill(token=tok, seq=0, nchunks=1, start=0,
                                                       total=16, error="source gone"),
                    zmq.Frame(b""))
    h.start(tok, f32(4), np.zeros(4, np.float32))
    assert h.outcomes == ["the client called the transfer off: source gone"]


def test_a_fill_for_another_sessions_receive_is_refused() -> None:
    h, tok = Harness(), token()
    h.start(tok, f32(4), np.zeros(4, np.float32))
    with pytest.raises(WireError, match="another session"):
        h.receives.fill(object(), "client y", wire.PeerFill(token=tok, seq=0, nchunks=1,
                                                            start=0, total=16, error=""),
                        zmq.Frame(bytes(16)))
    assert h.outcomes == [] and len(h.receives) == 1


def test_a_token_in_use_is_refused() -> None:
    h, tok = Harness(), token()
    h.start(tok, f32(4), np.zeros(4, np.float32))
    with pytest.raises(WireError, match="already in use"):
        h.start(tok, f32(4), np.zeros(4, np.float32))


def test_expiry_fails_late_receives_with_what_arrived_and_forget_is_silent() -> None:
    h, late, closing = Harness(), token(), token()
    h.start(late, f32(4), np.zeros(4, np.float32), timeout_ms=1000)
    h.start(closing, f32(4), np.zeros(4, np.float32), timeout_ms=1000)
    h.receives.on_chunk(wire.Chunk(late, 0, 2, 0, 16, ""), zmq.Frame(bytes(8)), "p")
    due = h.receives.next_deadline()
    assert due is not None
    h.receives.forget(object())                      # another session: nothing of it here
    h.receives.expire(due - 0.5)
    assert h.outcomes == [] and len(h.receives) == 2
    h.receives.forget(h.owner)  # both are this owner's: gone, no outcome
    assert len(h.receives) == 0 and h.receives.next_deadline() is None
    h.start(late, f32(4), np.zeros(4, np.float32), timeout_ms=1000)
    h.receives.on_chunk(wire.Chunk(late, 1, 2, 8, 16, ""), zmq.Frame(bytes(8)), "p")
    h.receives.expire(due + 10)
    assert h.outcomes == ["transfer into [4] timed out (1 of 2 chunks arrived)"]
