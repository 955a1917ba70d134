"""Sends and probes waiting for an acknowledgement (worker/peer/acks.py), with no socket.

The links are fakes behind the three callables the waits are given: whether a link dropped its
connection, drop a link, trust an endpoint.
"""

from __future__ import annotations

import os

import pytest
from zmq_rpc.broker import peer as wire
from zmq_rpc.worker.observe.metrics import NullRecorder
from zmq_rpc.worker.peer.acks import (
    PEER_GONE_GRACE_S,
    WATCH_INTERVAL_S,
    AwaitedAcks,
    LinkHooks,
    LinkLost,
    Outgoing,
)

pytestmark = pytest.mark.timeout(10)

EP, OTHER = "tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000"


class Counted(NullRecorder):
    def __init__(self) -> None:
        self.transfers: list[tuple[str, bool]] = []

    def transfer(self, direction: str, ok: bool) -> None:
        self.transfers.append((direction, ok))


class Harness:
    def __init__(self) -> None:
        self.dropped_links: set[str] = set()        # connections that dropped, not looked at
        self.closed: list[str] = []
        self.verified: list[str] = []
        self.outcomes: dict[str, list[str | None]] = {}
        self.acks = AwaitedAcks(LinkHooks(self._disconnected, self.closed.append,
                                          self.verified.append))
        self.metrics = self.acks.metrics = Counted()
        self.owner = object()

    def _disconnected(self, endpoint: str) -> bool:
        if endpoint in self.dropped_links:
            self.dropped_links.discard(endpoint)
            return True
        return False

    def wait(self, name: str, endpoint: str = EP, deadline: float = 100.0, probe: bool = False,
             owner: object | None = None) -> bytes:
        tok = os.urandom(wire.TOKEN_BYTES)
        outcomes = self.outcomes.setdefault(name, [])
        self.acks.wait(tok, Outgoing(self.owner if owner is None else owner, outcomes.append,
                                     endpoint, deadline, name, probe=probe))
        return tok


def test_an_ack_ends_its_wait_once_ok_or_refused_and_late_ones_are_ignored() -> None:
    h = Harness()
    good, bad = h.wait("good"), h.wait("bad")
    h.acks.on_ack(wire.Ack(good, True, "ok"))
    h.acks.on_ack(wire.Ack(bad, False, "no room"))
    h.acks.on_ack(wire.Ack(good, True, "ok"))                  # repeated: ignored
    h.acks.on_ack(wire.Ack(os.urandom(wire.TOKEN_BYTES), True, "ok"))   # unknown: ignored
    assert h.outcomes == {"good": [None], "bad": ["bad refused by the peer: no room"]}
    assert h.metrics.transfers == [("out", True), ("out", False)]
    assert len(h.acks) == 0 and h.verified == [] and h.closed == []


def test_an_answered_probe_trusts_its_endpoint_and_is_not_counted_as_a_transfer() -> None:
    h = Harness()
    refused, answered = h.wait("p1", OTHER, probe=True), h.wait("p2", probe=True)
    h.acks.on_ack(wire.Ack(refused, False, "no"))
    h.acks.on_ack(wire.Ack(answered, True, "probe"))
    assert h.verified == [EP] and h.metrics.transfers == []
    assert h.outcomes == {"p1": ["p1 refused by the peer: no"], "p2": [None]}


def test_the_deadline_fails_a_wait_and_drops_its_link() -> None:
    h = Harness()
    h.wait("late", deadline=10.0)
    h.wait("later", OTHER, deadline=20.0)
    assert h.acks.next_deadline() == 10.0
    h.acks.expire(9.99)
    assert h.outcomes == {"late": [], "later": []}
    h.acks.expire(10.0)
    assert h.outcomes["late"] == ["late: no acknowledgement within the timeout (peer "
                                  "unreachable, dead or too slow)"]
    assert h.closed == [EP] and h.metrics.transfers == [("out", False)]
    assert h.acks.next_deadline() == 20.0 and h.outcomes["later"] == []


def test_a_dropped_connection_cuts_the_wait_to_the_grace() -> None:
    h = Harness()
    h.wait("a", deadline=100.0)
    h.wait("b", deadline=100.0)
    h.wait("c", OTHER, deadline=100.0)
    h.dropped_links.add(EP)
    h.acks.expire(50.0)
    assert h.acks.next_deadline() == 50.0 + PEER_GONE_GRACE_S
    h.acks.expire(50.0 + PEER_GONE_GRACE_S / 2)                # an ack may still come
    assert h.outcomes == {"a": [], "b": [], "c": []}
    h.acks.on_ack(wire.Ack(next(iter(h.acks.pending)), True, "ok"))
    h.acks.expire(50.0 + PEER_GONE_GRACE_S)
    assert h.outcomes["a"] == [None]
    [why] = h.outcomes["b"]
    assert isinstance(why, LinkLost)               # answered PEER_UNREACHABLE, not a timeout
    assert f"cannot reach worker {EP}: peer link lost after" in why
    assert "b: no acknowledgement came" in why
    assert h.outcomes["c"] == [] and h.acks.next_deadline() == 100.0


def test_links_are_looked_at_only_every_watch_interval() -> None:
    h = Harness()
    h.wait("a")
    h.acks.expire(1.0)
    h.dropped_links.add(EP)
    h.acks.expire(1.0 + WATCH_INTERVAL_S / 2)                  # too soon: not looked at
    assert h.acks.next_deadline() == 100.0 and EP in h.dropped_links
    h.acks.expire(1.0 + WATCH_INTERVAL_S)
    assert h.acks.next_deadline() == 1.0 + WATCH_INTERVAL_S + PEER_GONE_GRACE_S


def test_a_drop_from_before_the_wait_does_not_count() -> None:
    h = Harness()
    h.dropped_links.add(EP)                 # an earlier transfer's peer went away
    h.wait("new")
    h.acks.expire(1.0)
    assert h.acks.next_deadline() == 100.0


def test_forget_and_cancel_end_waits_silently() -> None:
    h = Harness()
    other = object()
    h.wait("mine")
    kept = h.wait("theirs", owner=other)
    cancelled = h.wait("cancelled", owner=other)
    h.acks.cancel(cancelled)
    h.acks.cancel(cancelled)                # twice: nothing more to do
    h.acks.forget(h.owner)
    assert list(h.acks.pending) == [kept]
    h.acks.expire(1000.0)
    assert h.outcomes["mine"] == [] and h.outcomes["cancelled"] == []
    assert len(h.outcomes["theirs"]) == 1
