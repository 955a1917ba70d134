"""Sends to a peer (worker/peer/send.py): how a tensor is cut into chunks, and how each is pushed.

No socket: the links are :class:`~zmq_rpc.worker.peer.push.PushLinks` whose every link is a
recording fake, so what each chunk was handed to zmq as (zero-copy and tracked, copied, or
materialized and charged) can be read back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest
import zmq
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.protocol import DType, ErrorCode, TensorRef, WireError
from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
from zmq_rpc.worker.peer.endpoints import PeerSecurity
from zmq_rpc.worker.peer.push import PushLinks
from zmq_rpc.worker.peer.send import CHUNK_BYTES, ZERO_COPY_BYTES, Pusher, Source, cut
from zmq_rpc.worker.sessions.quotas import Charged, Usage

pytestmark = pytest.mark.timeout(10)

EP = "tcp://10.0.0.2:7"


@dataclass
class FakeLink:
    """A PUSH socket that records each message, or refuses them all (no connection up)."""

    refuse: bool = False
    closed: bool = False
    sent: list[tuple[list[Any], bool, bool]] = field(default_factory=list)

    def send_multipart(self, frames: list[Any], copy: bool = True,
                       track: bool = False) -> zmq.MessageTracker | None:
        if self.refuse:
            raise zmq.Again()
        self.sent.append((frames, copy, track))
        return zmq.MessageTracker() if track else None


class FakeLinks(PushLinks):
    def __init__(self, link: FakeLink) -> None:
        super().__init__(cast(zmq.Context[zmq.Socket[bytes]], None), PeerSecurity())
        self.link = link
        self.dropped: list[str] = []

    def get(self, endpoint: str) -> zmq.Socket[bytes]:
        return cast(zmq.Socket[bytes], self.link)

    def drop(self, endpoint: str) -> None:
        self.dropped.append(endpoint)


def ref(nbytes: int, stride: int = 1) -> TensorRef:
    return TensorRef(buffer=1, dtype=DType.UINT8, shape=(nbytes,), strides=(stride,), offset=0)


def source(backend: NumpyBackend, buf: np.ndarray, r: TensorRef, trackers: list[Any],
           charged: list[tuple[Any, Charged]] | None = None) -> Source:
    if charged is None:
        return Source(backend.view(buf, r), buf, trackers.append)

    def copy(view: Any, endpoint: str) -> Charged:
        data = np.ascontiguousarray(view)
        return Charged(data, data.nbytes, Usage(), endpoint)
    return Source(backend.view(buf, r), buf, trackers.append, copy,
                  lambda tracker, c: charged.append((tracker, c)))


def header(frame: bytes) -> wire.Chunk:
    msg = wire.decode_peer([frame, b""])
    assert isinstance(msg, wire.Chunk)
    return msg


def test_a_big_tensor_is_cut_into_chunks_that_say_where_they_go() -> None:
    backend, tok = NumpyBackend(), os.urandom(wire.TOKEN_BYTES)
    nbytes = 2 * CHUNK_BYTES + ZERO_COPY_BYTES // 2          # the last chunk is small
    buf = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    send = wire.Send(tok, ref(nbytes), EP)
    pieces = cut(backend, send, source(backend, buf, ref(nbytes), []), "tcp://10.0.0.1:7")
    chunks = [header(p.header) for p in pieces]
    assert [(c.seq, c.nchunks, c.start, c.total) for c in chunks] == [
        (0, 3, 0, nbytes), (1, 3, CHUNK_BYTES, nbytes), (2, 3, 2 * CHUNK_BYTES, nbytes)]
    assert {c.token for c in chunks} == {tok} and {c.reply_to for c in chunks} == {"tcp://10.0.0.1:7"}
    assert [p.zero_copy for p in pieces] == [True, True, False]
    joined = b"".join(bytes(p.data) for p in pieces)
    assert joined == buf.tobytes()                           # aliases of the buffer, in order
    buf[0] = 99
    assert pieces[0].data is not None and pieces[0].data[0] == 99   # in place, not copied


def test_a_strided_tensor_has_no_alias_and_is_read_when_pushed() -> None:
    backend = NumpyBackend()
    nbytes = 64
    buf = np.arange(2 * nbytes, dtype=np.uint64).astype(np.uint8)
    pieces = cut(backend, wire.Send(b"t" * 16, ref(nbytes, 2), EP),
                 source(backend, buf, ref(nbytes, 2), []), "")
    assert len(pieces) == 1 and pieces[0].data is None and not pieces[0].zero_copy
    assert header(pieces[0].header).reply_to == ""                  # no ack asked for


def test_push_tracks_big_chunks_and_copies_small_ones() -> None:
    backend, link, trackers = NumpyBackend(), FakeLink(), []
    pusher = Pusher(backend, FakeLinks(link))
    pusher.links.verify(EP)
    nbytes = CHUNK_BYTES + 1024
    buf = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    push = pusher.prepare(wire.Send(b"t" * 16, ref(nbytes), EP),
                          source(backend, buf, ref(nbytes), trackers), "tcp://10.0.0.1:7")
    assert push.acknowledged
    pusher.push(push)
    (big, big_copy, big_track), (small, small_copy, small_track) = link.sent
    assert (big_copy, big_track) == (False, True) and len(trackers) == 1
    assert (small_copy, small_track) == (True, False)      # aliased but small: copied now
    assert bytes(big[1]) + bytes(small[1]) == buf.tobytes()


def test_a_strided_piece_is_materialized_charged_and_told_when_sent() -> None:
    backend, link, trackers = NumpyBackend(), FakeLink(), []
    charged: list[tuple[Any, Charged]] = []
    pusher = Pusher(backend, FakeLinks(link))
    pusher.links.verify(EP)
    n = ZERO_COPY_BYTES
    buf = (np.arange(2 * n, dtype=np.uint64) % 251).astype(np.uint8)
    pusher.push(pusher.prepare(wire.Send(b"t" * 16, ref(n, 2), EP),
                               source(backend, buf, ref(n, 2), trackers, charged), ""))
    [(frames, copy, track)] = link.sent
    assert track and not copy and trackers == []
    [(tracker, piece)] = charged
    assert isinstance(tracker, zmq.MessageTracker) and piece.endpoint == EP
    assert bytes(frames[1]) == buf[::2].tobytes()


def test_a_send_no_connection_can_take_fails_drops_the_link_and_gives_bytes_back() -> None:
    backend, link = NumpyBackend(), FakeLink(refuse=True)
    charged: list[tuple[Any, Charged]] = []
    links = FakeLinks(link)
    pusher = Pusher(backend, links)
    links.verify(EP)
    n = ZERO_COPY_BYTES
    buf = np.zeros(2 * n, np.uint8)
    push = pusher.prepare(wire.Send(b"t" * 16, ref(n, 2), EP),
                          source(backend, buf, ref(n, 2), [], charged), "")
    with pytest.raises(WireError, match="cannot take a message now") as err:
        pusher.push(push)
    assert err.value.code == ErrorCode.TRANSFER_FAILED and links.dropped == [EP]
    assert len(charged) == 1                     # the materialized copy is given back at once


def test_an_endpoint_that_never_answered_a_probe_is_refused_without_curve() -> None:
    pusher, backend = Pusher(NumpyBackend(), FakeLinks(FakeLink())), NumpyBackend()
    buf = np.zeros(16, np.uint8)
    with pytest.raises(WireError, match="has not answered a peer probe"):
        pusher.prepare(wire.Send(b"t" * 16, ref(16), EP), source(backend, buf, ref(16), []), "")
