"""The connection's deadline bookkeeping (a FIFO and a heap; no sockets, no clock)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zmq_rpc.client.deadlines import COMPACT_SLACK, NEVER, Deadlines


@dataclass(eq=False)
class Req:
    req_id: int
    deadline: float
    settled: bool = False


def _due(d: Deadlines[Req], now: float) -> list[int]:
    """What is due at ``now``, as request ids (a call by its id, a heap entry as its id)."""
    return [item if isinstance(item, int) else item.req_id for item in d.due(now)]


def test_empty_has_no_deadline_and_waits_the_cap() -> None:
    d: Deadlines[Req] = Deadlines()
    assert d.next() == NEVER and len(d) == 0
    assert d.timeout_ms(now=5.0, cap_ms=500) == 500
    assert _due(d, now=1e9) == []


def test_rising_deadlines_stay_in_the_fifo_and_expire_in_order() -> None:
    d: Deadlines[Req] = Deadlines()
    reqs = [Req(i, 10.0 + i) for i in range(5)]
    for r in reqs:
        d.watch(r)
    assert len(d.fifo) == 5 and not d.heap
    assert d.next() == 10.0
    assert _due(d, now=9.99) == []
    assert _due(d, now=12.0) == [0, 1, 2]
    assert d.next() == 13.0 and len(d) == 2


def test_equal_deadlines_stay_in_the_fifo() -> None:
    d: Deadlines[Req] = Deadlines()
    for i in range(3):
        d.watch(Req(i, 1.0))
    assert len(d.fifo) == 3 and not d.heap
    assert _due(d, now=1.0) == [0, 1, 2]             # due at exactly its deadline


def test_a_shorter_timeout_goes_to_the_heap_and_expires_first() -> None:
    d: Deadlines[Req] = Deadlines()
    d.watch(Req(1, 60.0))
    d.watch(Req(2, 5.0))                              # earlier than the FIFO's tail
    d.watch(Req(3, 61.0))
    assert [r.req_id for r in d.fifo] == [1, 3] and d.heap == [(5.0, 2)]
    assert d.next() == 5.0
    assert _due(d, now=5.0) == [2]
    assert d.next() == 60.0


def test_fifo_calls_come_before_heap_ids_due_at_the_same_time() -> None:
    d: Deadlines[Req] = Deadlines()
    d.watch(Req(1, 3.0))
    d.watch(Req(2, 1.0))                              # heap
    d.watch_id(2.0, 7)                                # a reservation
    assert _due(d, now=10.0) == [1, 2, 7]


def test_answered_calls_are_skipped_and_dropped_from_the_head() -> None:
    d: Deadlines[Req] = Deadlines()
    reqs = [Req(i, 1.0 + i) for i in range(4)]
    for r in reqs:
        d.watch(r)
    reqs[0].settled = reqs[1].settled = True
    assert d.next() == 3.0 and len(d.fifo) == 2      # the answered head is gone
    reqs[3].settled = True
    assert _due(d, now=100.0) == [2]                  # answered: not yielded
    assert len(d) == 0


def test_heap_ids_are_yielded_even_when_answered_the_caller_checks() -> None:
    d: Deadlines[Req] = Deadlines()
    d.watch(Req(1, 10.0))
    short = Req(2, 1.0)
    d.watch(short)
    short.settled = True                              # the heap knows ids only
    assert d.next() == 1.0
    assert _due(d, now=1.0) == [2]


def test_entries_added_while_iterating_are_seen_when_due() -> None:
    """A failed call's callback may submit again while ``due`` is being iterated."""
    d: Deadlines[Req] = Deadlines()
    d.watch(Req(1, 1.0))
    d.watch(Req(2, 2.0))
    seen = []
    for item in d.due(now=5.0):
        assert not isinstance(item, int)
        seen.append(item.req_id)
        if item.req_id == 1:
            d.watch(Req(3, 4.0))                      # due too: expires in this pass
            d.watch(Req(4, 50.0))                     # not due
    assert seen == [1, 2, 3]
    assert d.next() == 50.0


@pytest.mark.parametrize("now, deadline, expected", [
    (0.0, 0.0105, 11),          # rounded up: never wake a hair early
    (0.0, 0.2, 201),
    (0.0, 10.0, 500),           # capped
    (1.0, 0.5, 0),              # passed
    (0.0, NEVER, 500),
])
def test_timeout_ms(now: float, deadline: float, expected: int) -> None:
    d: Deadlines[Req] = Deadlines()
    if deadline != NEVER:
        d.watch(Req(1, deadline))
    assert d.timeout_ms(now, cap_ms=500) == expected


def test_timeout_ms_takes_the_earlier_of_its_own_and_the_callers() -> None:
    d: Deadlines[Req] = Deadlines()
    d.watch(Req(1, 2.0))
    assert d.timeout_ms(0.0, 5000, deadline=1.0) == 1001
    assert d.timeout_ms(0.0, 5000, deadline=3.0) == 2001


def test_compact_keeps_live_entries_only() -> None:
    d: Deadlines[Req] = Deadlines()
    reqs = [Req(i, 100.0 + i) for i in range(10)]
    for r in reqs:
        d.watch(r)
    d.watch(Req(50, 1.0))
    d.watch_id(2.0, 51)
    d.watch_id(3.0, 52)
    for r in reqs[:8]:
        r.settled = True
    assert not d.bloated(live=len(d))
    d.compact(live={8, 9, 51})
    assert [r.req_id for r in d.fifo] == [8, 9] and d.heap == [(2.0, 51)]
    assert _due(d, now=1e9) == [8, 9, 51]


def test_bloated_after_many_stale_entries() -> None:
    d: Deadlines[Req] = Deadlines()
    for i in range(COMPACT_SLACK + 10):
        d.watch(Req(i, 0.0 + i))
    assert d.bloated(live=4)
    assert not d.bloated(live=COMPACT_SLACK)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["call", "reservation", "answer", "expire"]),
                          st.integers(0, 50)), max_size=80),
       st.randoms(use_true_random=False))
def test_matches_a_plain_list_of_deadlines(ops: list[tuple[str, int]],
                                           rnd: random.Random) -> None:
    """Whatever the mix of timeouts, answers and expiry passes: every unanswered call and every
    reservation is yielded exactly once, when due, in deadline order within the FIFO part and
    within the heap part, and ``next()`` is the earliest pending deadline."""
    d: Deadlines[Req] = Deadlines()
    pending: dict[int, Req] = {}
    reservations: dict[int, float] = {}
    now, next_id = 0.0, 0
    for op, n in ops:
        if op in ("call", "reservation"):
            next_id += 1
            deadline = now + n / 10
            if op == "call":
                pending[next_id] = Req(next_id, deadline)
                d.watch(pending[next_id])
            else:
                reservations[next_id] = deadline
                d.watch_id(deadline, next_id)
        elif op == "answer" and pending:
            pending.pop(rnd.choice(sorted(pending))).settled = True
        elif op == "expire":
            now += n / 20
            due = list(d.due(now))
            calls = [x for x in due if not isinstance(x, int)]
            ids = [x for x in due if isinstance(x, int)]
            expected_calls = {i for i, r in pending.items() if r.deadline <= now}
            expected_ids = {i for i, t in reservations.items() if t <= now}
            got_calls = {r.req_id for r in calls} | {i for i in ids if i in pending}
            assert got_calls == expected_calls
            assert {i for i in ids if i in reservations} == expected_ids
            assert all(r.deadline <= now for r in calls)
            assert [r.deadline for r in calls] == sorted(r.deadline for r in calls)
            for i in got_calls:
                pending.pop(i).settled = True
            for i in expected_ids:
                del reservations[i]
        if rnd.random() < 0.1:
            d.compact({*pending, *reservations})
        earliest = min([r.deadline for r in pending.values()] + list(reservations.values()),
                       default=NEVER)
        if not any(i not in pending and i not in reservations for _, i in d.heap):
            assert d.next() == earliest
        else:
            assert d.next() <= earliest
