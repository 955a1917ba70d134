"""The PUSH links to other workers (worker/peer/push.py), on sockets that connect to nothing (abstract ipc names), closed with linger 0."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from waiting import wait_until
from zmq_rpc.broker.keys import KeyPair
from zmq_rpc.broker.protocol import WireError
from zmq_rpc.broker.zap import KeySet
from zmq_rpc.worker.peer import push as peer_push
from zmq_rpc.worker.peer.endpoints import PeerSecurity
from zmq_rpc.worker.peer.push import MAX_LINKS, PushLinks

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def links() -> Iterator[PushLinks]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    links = PushLinks(ctx, PeerSecurity())
    try:
        yield links
    finally:
        links.close()
        ctx.term()                    # hangs (and the timeout fails the test) if one leaked


def test_a_link_is_reused_and_the_least_recently_used_closes_beyond_the_limit(
        links: PushLinks) -> None:
    first = links.get("ipc://@zmq-rpc-test-peer-0")
    opened = [links.get(f"ipc://@zmq-rpc-test-peer-{i}") for i in range(1, MAX_LINKS)]
    assert links.get("ipc://@zmq-rpc-test-peer-0") is first          # reused, and now the most recent
    links.get("ipc://@zmq-rpc-test-one-too-many")
    assert len(links) == MAX_LINKS and len(links.monitors) == MAX_LINKS
    assert "ipc://@zmq-rpc-test-peer-1" not in links and opened[0].closed
    assert "ipc://@zmq-rpc-test-peer-0" in links and not first.closed


def test_a_dropped_link_is_closed_and_the_next_use_reconnects(links: PushLinks) -> None:
    sock = links.get("ipc://@zmq-rpc-test-peer")
    links.drop("ipc://@zmq-rpc-test-peer")
    links.drop("ipc://@zmq-rpc-test-peer")                           # twice: nothing left to close
    assert sock.closed and "ipc://@zmq-rpc-test-peer" not in links and not links.monitors
    again = links.get("ipc://@zmq-rpc-test-peer")
    assert again is not sock and not again.closed


def test_a_disconnection_is_seen_once(links: PushLinks) -> None:
    pull = links.ctx.socket(zmq.PULL)
    try:
        pull.bind("tcp://127.0.0.1:*")
        endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        links.get(endpoint).send(b"x")
        assert pull.recv() == b"x"
        assert not links.disconnected(endpoint)
    finally:
        pull.close(linger=0)
    wait_until(lambda: links.disconnected(endpoint), 5, "the link reported its peer gone")
    assert not links.disconnected(endpoint)               # said once
    assert not links.disconnected("tcp://127.0.0.1:9")    # never opened: nothing to say


def test_only_probed_endpoints_may_be_pushed_to_with_or_without_curve() -> None:
    """Under CURVE too (issue 24): the probe's answer is the peer handshake."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    keys = KeyPair(*zmq.curve_keypair())
    links = PushLinks(ctx, PeerSecurity(keys, KeySet(fixed=frozenset([keys.public]))))
    endpoint = f"tcp://10.0.0.1:5#curve={keys.public.decode()}"
    try:
        with pytest.raises(WireError, match="has not answered a peer probe"):
            links.check_verified(endpoint)
        links.verify(endpoint)
        links.check_verified(endpoint)
    finally:
        ctx.term()


def test_inproc_and_source_addresses_are_refused_and_open_no_socket(links: PushLinks) -> None:
    for endpoint in ("inproc://zeromq.zap.01", "tcp://127.0.0.1:1;10.0.0.1:5", "tcp://127.1:5"):
        links.verify(endpoint)
        with pytest.raises(WireError, match="names an IP address"):
            links.check_verified(endpoint)
        with pytest.raises(WireError, match="names an IP address"):
            links.get(endpoint)
    assert len(links) == 0


def test_without_curve_only_probed_endpoints_may_be_pushed_to(links: PushLinks) -> None:
    with pytest.raises(WireError, match="has not answered a peer probe"):
        links.check_verified("tcp://10.0.0.1:5")
    links.verify("tcp://10.0.0.1:5")
    links.check_verified("tcp://10.0.0.1:5")


def test_an_endpoint_refused_by_security_opens_no_socket(links: PushLinks) -> None:
    with pytest.raises(WireError, match="names an IP address"):
        links.get("tcp://localhost:5")
    assert len(links) == 0


def test_a_link_is_lost_once_its_connection_drops_and_counted_from_the_later_moment(
        links: PushLinks) -> None:
    pull = links.ctx.socket(zmq.PULL)
    try:
        pull.bind("tcp://127.0.0.1:*")
        endpoint = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        links.get(endpoint)
        wait_until(lambda: links.lost_for(endpoint, 0.0) is None and links.states[endpoint].up,
                   5.0, "the link connected")                   # up: not lost
    finally:
        pull.close(linger=0)
    wait_until(lambda: links.lost_for(endpoint, 0.0) is not None, 5.0, "the drop was seen")
    lost = links.lost_for(endpoint, 0.0)
    assert lost is not None and 0 <= lost < 1                        # since the drop
    assert links.lost_for(endpoint, time.monotonic() + 10) == 0     # needed from later: 0
    assert links.disconnected(endpoint)                             # the acks' view: once
    assert links.lost_for("tcp://127.0.0.1:9", 0.0) is None         # never opened here


def test_a_link_that_never_connects_is_lost_after_the_heartbeat_bound(
        links: PushLinks, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_push, "LINK_LOSS_S", 0.3)
    dead_end = "tcp://127.0.0.1:9"                                   # nothing listens there
    links.get(dead_end)
    assert links.lost_for(dead_end, 0.0) is None                    # still connecting
    wait_until(lambda: links.lost_for(dead_end, 0.0) is not None, 5.0, "declared lost")
    assert not links.states[dead_end].was_up
