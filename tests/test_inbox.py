"""The backend's read-ahead: each client's requests in order, clients served in turn, bounded
(worker/inbox.py; the sockets' side is tests/test_quotas.py)."""

from __future__ import annotations

import time

import pytest
from zmq_rpc.worker.inbox import Inbox

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
    time.sleep(0.01)
    taken = inbox.take()
    assert taken is not None and before <= taken[1] <= after


def test_empty() -> None:
    inbox = Inbox()
    assert inbox.take() is None and not inbox.full()
