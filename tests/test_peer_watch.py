"""A receiving worker watches its own link to the sender a request names (issue 24.9): real
zmq sockets on loopback, a bare PULL standing in for the sending worker's peer port."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from waiting import wait_until
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.protocol import DType, TensorRef
from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
from zmq_rpc.worker.peer.acks import LinkLost
from zmq_rpc.worker.peer.endpoints import PeerSecurity
from zmq_rpc.worker.peer.links import RECEIVE_GRACE_S, PeerLinks
from zmq_rpc.worker.peer.push import LINK_LOSS_S, PushLinks

pytestmark = pytest.mark.timeout(20)


def _receive(links: PeerLinks, source: str, timeout_ms: int = 60_000) -> list[str | None]:
    backend = NumpyBackend()
    dst = TensorRef(buffer=1, dtype=DType.FLOAT32, shape=(4,), strides=(4,), offset=0)
    outcomes: list[str | None] = []
    links.start_recv(os.urandom(wire.TOKEN_BYTES), dst, backend.view(np.zeros(16, np.uint8), dst),
                     timeout_ms, object(), outcomes.append, source=source)
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


class DroppingPort:
    """A TCP port that accepts every connection and closes it at once (what the long fuzz's
    links met), on its own thread; ``accepted`` counts the connections it dropped."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.listener.settimeout(0.05)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.close()
            self.accepted += 1

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.listener.close()


@pytest.fixture
def dropping_port() -> Iterator[DroppingPort]:
    port = DroppingPort()
    try:
        yield port
    finally:
        port.close()


MONITOR_PIPE_EVENTS = 2000
"""What a link's monitor pipe holds before libzmq's I/O thread blocks on it: the monitor's
SNDHWM plus our end's RCVHWM (1,000 each, libzmq's inproc pipe); each connection the port
accepts and drops is two events (connected, disconnected)."""


@pytest.mark.timeout(60)
def test_a_link_to_a_port_that_accepts_and_drops_never_stalls_the_workers_sockets(
        dropping_port: DroppingPort) -> None:
    """The long fuzz (issue 24): a watch link to a port that accepts and drops connections
    reconnected every 100 ms, and its monitor, read only while a transfer needed it (here a
    receive that timed out), filled
    after ~3 min; libzmq's I/O thread blocked on it, and with it every client connection on
    the worker's context, and closing the link hung in disable_monitor. Here the link
    reconnects every 1 ms, so the port drops 1.5x the pipe's worth within seconds, while the
    test thread does the backend loop's chores (expire) and answers a client on a socket of
    the same context, as the worker's front end is."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = PushLinks(ctx, PeerSecurity(), reconnect_ivl_ms=1)
    links = PeerLinks(ctx, NumpyBackend(), bind="tcp://127.0.0.1:*", links=push)
    front, client = ctx.socket(zmq.REP), client_ctx.socket(zmq.REQ)
    try:
        front.bind("tcp://127.0.0.1:*")
        client.connect(front.getsockopt_string(zmq.LAST_ENDPOINT))
        outcomes = _receive(links, dropping_port.endpoint, timeout_ms=100)  # a watch link
        _expire_until(links, outcomes, 5)                  # ends; its link stays open
        assert dropping_port.endpoint in links.links
        _serve_while_dropped(links, front, client, dropping_port)
        closing = threading.Thread(target=links.close, daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(2.0)
        assert not closing.is_alive(), "closing the link hung (in disable_monitor?)"
        assert time.monotonic() - started < 2.0
    finally:
        front.close(linger=0)
        client.close(linger=0)
        client_ctx.term()
        if not links.links.monitors:    # a link that never closed keeps term() waiting
            ctx.term()


def _serve_while_dropped(links: PeerLinks, front: zmq.Socket[bytes],
                         client: zmq.Socket[bytes], port: DroppingPort) -> None:
    """Ping the front end until the port has dropped 1.5x a monitor pipe's worth of
    connections; each ping must be answered within 2 s (a healthy one takes well under a
    millisecond; the stall lasted for good)."""
    deadline = time.monotonic() + 40
    while port.accepted < MONITOR_PIPE_EVENTS * 3 // 4:
        assert time.monotonic() < deadline, f"the port dropped only {port.accepted} connections"
        client.send(b"ping")
        assert front.poll(2000), f"front end not served after {port.accepted} drops"
        front.send(front.recv())
        assert client.poll(2000), f"client not answered after {port.accepted} drops"
        client.recv()
        links.expire(time.monotonic())
