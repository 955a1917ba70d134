"""The backend's read-ahead: each client's requests in order, clients served by backend time used
(in turns when they cost the same), bounded (worker/dispatch/inbox.py; the sockets' side is
tests/test_quotas.py)."""

from __future__ import annotations

import time

import pytest
from zmq_rpc.worker.dispatch.inbox import FORGET_ABOVE, Inbox

pytestmark = pytest.mark.timeout(10)


class Frame(bytes):
    """What the inbox reads of a ``zmq.Frame``: ``.bytes`` and a length."""

    @property
    def bytes(self) -> bytes:
        return bytes(self)


def msg(client: bytes, body: bytes) -> list[Frame]:
    return [Frame(client), Frame(body)]


def drain(inbox: Inbox) -> list[bytes]:
    out = []
    while (taken := inbox.take()) is not None:
        frames, _ = taken
        out.append(frames[0].bytes + b":" + frames[1].bytes)
    return out


def test_clients_take_turns_and_keep_their_own_order() -> None:
    inbox = Inbox()
    for body in (b"1", b"2", b"3", b"4"):
        inbox.put(msg(b"greedy", body))
    inbox.put(msg(b"polite", b"1"))
    inbox.put(msg(b"other", b"1"))
    inbox.put(msg(b"polite", b"2"))
    assert len(inbox) == 7
    assert drain(inbox) == [b"greedy:1", b"polite:1", b"other:1", b"greedy:2", b"polite:2",
                            b"greedy:3", b"greedy:4"]
    assert len(inbox) == 0 and inbox.nbytes == 0 and not inbox


def test_a_client_arriving_later_is_served_within_one_turn() -> None:
    inbox = Inbox()
    for i in range(100):
        inbox.put(msg(b"greedy", b"%d" % i))
    for i in range(3):
        inbox.put(msg(b"fuzz%d" % i, b"x"))
    assert drain(inbox)[:3] == [b"greedy:0", b"fuzz0:x", b"fuzz1:x"]
    inbox.put(msg(b"greedy", b"a"))
    inbox.take()
    inbox.put(msg(b"polite", b"ping"))
    taken = inbox.take()
    assert taken is not None and taken[0] == msg(b"polite", b"ping")


def test_a_cheap_client_goes_before_clients_whose_requests_took_long() -> None:
    """Four clients whose last requests took 300 ms each and a polite one with three 0.1 ms
    requests: the polite ones go first, not one per turn behind each of the four (the fuzz
    probe waited for four graph decodes that way)."""
    inbox = Inbox()
    hostile = [b"fuzz%d" % i for i in range(4)]
    for client in hostile:
        for i in range(3):
            inbox.put(msg(client, b"%d" % i))
    for _ in hostile:                       # each has run one long request
        taken = inbox.take()
        assert taken is not None
        inbox.charge(taken[0][0].bytes, 300_000_000)
    for body in (b"status", b"ping", b"status"):
        inbox.put(msg(b"polite", body))
    order = []
    while (taken := inbox.take()) is not None:
        client = taken[0][0].bytes
        order.append(client)
        inbox.charge(client, 100_000 if client == b"polite" else 300_000_000)
    assert order[:3] == [b"polite"] * 3
    assert sorted(order[3:]) == sorted(hostile * 2)


def test_idle_time_banks_no_credit() -> None:
    """A client back after a pause starts from the others' virtual time: it does not get the
    backend to itself for all the time it was away."""
    inbox = Inbox()
    for i in range(10):
        inbox.put(msg(b"busy", b"%d" % i))
        taken = inbox.take()
        assert taken is not None
        inbox.charge(b"busy", 10_000_000)
    for i in range(3):
        inbox.put(msg(b"busy", b"%d" % i))
        inbox.put(msg(b"back", b"%d" % i))
    order = []
    while (taken := inbox.take()) is not None:
        client = taken[0][0].bytes
        order.append(client)
        inbox.charge(client, 10_000_000)
    assert order == [b"busy", b"back"] * 3 or order == [b"back", b"busy"] * 3


def test_a_long_request_is_charged_even_when_taken_straight_from_the_pair() -> None:
    """The backend handles the PAIR's next message without the inbox when the inbox is empty;
    its time still counts for its client."""
    inbox = Inbox()
    inbox.charge(b"long", 500_000_000)           # ran straight from the PAIR
    inbox.put(msg(b"long", b"again"))
    inbox.put(msg(b"short", b"ping"))
    taken = inbox.take()
    assert taken is not None and taken[0][0].bytes == b"short"


def test_clients_with_nothing_here_are_forgotten_once_caught_up() -> None:
    inbox = Inbox()
    for i in range(FORGET_ABOVE + 10):
        inbox.charge(b"c%d" % i, 0)
    assert len(inbox._clients) <= FORGET_ABOVE + 1
    inbox.charge(b"ahead", 10**9)                # still ahead of the others: remembered
    for i in range(2 * FORGET_ABOVE):
        inbox.charge(b"d%d" % i, 0)
    inbox.put(msg(b"ahead", b"x"))
    inbox.put(msg(b"new", b"y"))
    taken = inbox.take()
    assert taken is not None and taken[0][0].bytes == b"new"


def test_full_by_messages_or_by_bytes() -> None:
    inbox = Inbox(max_messages=3, max_bytes=100)
    inbox.put(msg(b"a", b"x"))
    inbox.put(msg(b"b", b"x"))
    assert not inbox.full()
    inbox.put(msg(b"a", b"x"))
    assert inbox.full()
    inbox.take()
    assert not inbox.full()
    drain(inbox)
    inbox.put(msg(b"a", bytes(500)))      # bigger than the bound: read when the inbox is empty
    assert inbox.full() and inbox.nbytes == 501
    assert inbox.take() is not None and not inbox.full() and inbox.nbytes == 0


def test_arrival_is_when_the_message_was_read() -> None:
    inbox = Inbox()
    before = time.perf_counter_ns()
    inbox.put(msg(b"a", b"x"))
    after = time.perf_counter_ns()
    time.sleep(0.01)                # a real gap: taken later than it arrived
    taken = inbox.take()
    assert taken is not None and before <= taken[1] <= after


def test_holds_says_whose_messages_wait_here() -> None:
    inbox = Inbox()
    inbox.put(msg(b"a", b"1"))
    inbox.charge(b"b", 5)                   # known here (its time), nothing waiting
    assert inbox.holds(b"a") and not inbox.holds(b"b") and not inbox.holds(b"c")
    inbox.take()
    assert not inbox.holds(b"a")


def test_empty() -> None:
    inbox = Inbox()
    assert inbox.take() is None and not inbox.full()
