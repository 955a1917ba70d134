"""A receiving worker watches its own link to the sender a request names (issue 24.9): real
zmq sockets on loopback, a bare PULL standing in for the sending worker's peer port."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq
from waiting import wait_until
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.protocol import DType, TensorRef
from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
from zmq_rpc.worker.peer_acks import LinkLost
from zmq_rpc.worker.peer_links import RECEIVE_GRACE_S, PeerLinks
from zmq_rpc.worker.peer_push import LINK_LOSS_S

pytestmark = pytest.mark.timeout(20)


def _receive(links: PeerLinks, source: str) -> list[str | None]:
    backend = NumpyBackend()
    dst = TensorRef(buffer=1, dtype=DType.FLOAT32, shape=(4,), strides=(4,), offset=0)
    outcomes: list[str | None] = []
    links.start_recv(os.urandom(wire.TOKEN_BYTES), dst, backend.view(np.zeros(16, np.uint8), dst),
                     60_000, object(), outcomes.append, source=source)
    return outcomes


def _expire_until(links: PeerLinks, outcomes: list[str | None], limit: float) -> float:
    """Run the backend thread's expiry chore until the receive is failed; the seconds it took."""
    def failed() -> bool:
        links.expire(time.monotonic())
        return bool(outcomes)
    return wait_until(failed, limit, "the receive was failed")


def _expire_until_up(links: PeerLinks, source: str, limit: float) -> None:
    """Run the expiry chore (which reads the link's monitor) until the watch link is up."""
    def up() -> bool:
        links.expire(time.monotonic())
        return links.links.states[source].up
    wait_until(up, limit, "the watch link connected")


def test_a_receive_fails_naming_the_link_once_the_senders_link_is_lost() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sender = ctx.socket(zmq.PULL)
    sender.bind("tcp://127.0.0.1:*")
    source = sender.getsockopt_string(zmq.LAST_ENDPOINT)
    links = PeerLinks(ctx, NumpyBackend(), bind="tcp://127.0.0.1:*")
    try:
        outcomes = _receive(links, source)
        assert source in links.links                       # opened to watch the sender
        _expire_until_up(links, source, 5)
        links.expire(time.monotonic() + 0.5)
        assert not outcomes                                 # the link is up: it waits
        sender.close(linger=0)                              # the sender is gone
        took = _expire_until(links, outcomes, 5)
        assert RECEIVE_GRACE_S * 0.9 <= took < RECEIVE_GRACE_S + 1
        [why] = outcomes
        assert isinstance(why, LinkLost)
        assert f"worker {links.endpoint} cannot reach worker {source}: peer link lost" in why
        assert not links.incoming
    finally:
        links.close()
        ctx.term()


def test_a_sender_that_cannot_be_reached_fails_the_receive_after_the_heartbeat_bound() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    links = PeerLinks(ctx, NumpyBackend(), bind="tcp://127.0.0.1:*")
    try:
        outcomes = _receive(links, "tcp://127.0.0.1:9")     # nothing listens there
        took = _expire_until(links, outcomes, LINK_LOSS_S + 2)
        assert LINK_LOSS_S * 0.9 <= took < LINK_LOSS_S + 1
        assert isinstance(outcomes[0], LinkLost)
    finally:
        links.close()
        ctx.term()


def test_a_receive_without_a_watchable_source_is_not_watched() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    links = PeerLinks(ctx, NumpyBackend(), bind="tcp://127.0.0.1:*")
    try:
        _receive(links, "tcp://localhost:9")              # refused by the endpoint checks
        _receive(links, links.endpoint)                   # itself
        _receive(links, "")                               # none named (relayed, older client)
        assert len(links.links) == 0
        assert all(not into.source for into in links.incoming.values())
    finally:
        links.close()
        ctx.term()
