"""Opening and closing sessions (worker/sessions/table.py), with no socket.

Replies are caught from a real :class:`~zmq_rpc.worker.dispatch.outbox.Outbox` whose ``send`` records the
frames; the peer links are two recording callables; memory is a real budget and session memory.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import pytest
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd, ErrorCode, WireError
from zmq_rpc.worker.dispatch.outbox import Outbox
from zmq_rpc.worker.observe.metrics import NullRecorder
from zmq_rpc.worker.sessions.memory import MemoryBudget, SessionMemory
from zmq_rpc.worker.sessions.quotas import Quotas
from zmq_rpc.worker.sessions.session import Buffer, Request, Route, Session, WorkerLimits
from zmq_rpc.worker.sessions.table import PRESSURE_SILENCE, WEAK_ID, PeerCleanup, SessionTable

pytestmark = pytest.mark.timeout(10)

A, B, C = (bytes([n]) * 16 for n in (0xA1, 0xB2, 0xC3))


@dataclasses.dataclass(frozen=True)
class FakeHello:
    """Stands in for the worker's HelloReply: only ``device_details`` is looked at."""

    device_details: tuple[str, ...] = ("fake device",)


class Harness:
    def __init__(self, max_sessions: int = 64, session_timeout: float = 30.0) -> None:
        self.limits = WorkerLimits(memory_limit=1 << 20, max_buffer_size=1 << 20,
                                   max_message_size=1 << 20, session_timeout=session_timeout,
                                   max_sessions=max_sessions)
        self.budget = MemoryBudget(self.limits.memory_limit)
        self.accounts = SessionMemory(self.budget, Quotas(memory=self.limits.memory_limit),
                                      lambda keep: self.table.close_silent(keep))
        self.sent: list[tuple[bytes, list[Any]]] = []
        self.outbox = Outbox(self._send, self.accounts.inflight)
        self.forgotten: list[object] = []
        self.dropped: list[str] = []
        self.sessions: dict[bytes, Session] = {}
        self.table = SessionTable(self.sessions, self.limits, self.accounts, self.outbox,
                                  NullRecorder(), PeerCleanup(self.dropped.append,
                                                              self.forgotten.append),
                                  self)

    def hello_reply(self) -> p.HelloReply:
        return cast(p.HelloReply, FakeHello())

    def _send(self, frames: list[Any], copy: bool = True, track: bool = False) -> None:
        self.sent.append((bytes(frames[0]), p.unpack_header(bytes(frames[1]))))

    def hello(self, client_id: bytes, name: str = "unit", minor: int = p.PROTOCOL_VERSION[1],
              major: int = p.PROTOCOL_VERSION[0], timing: bool = False) -> Session:
        session = self.sessions.get(client_id) or Session(client_id, "")
        msg = p.Hello(major=major, minor=minor, client=name, timing=timing)
        self.table.hello(session, msg, request(1))
        return session

    def errors(self) -> list[tuple[int, ErrorCode, str]]:
        """(req_id, code, message) of every error reply so far."""
        return [(h[1], ErrorCode(h[0]), h[2]) for _, h in self.sent]


def request(req_id: int, in_flight: bool = False) -> Request:
    req = Request(Cmd.PING, req_id, p.Empty(), [], Route(lambda s, m, r: None))
    req.in_flight = in_flight
    return req


def test_hello_opens_a_session_once_and_numbers_it() -> None:
    h = Harness()
    first = h.hello(A, name="x\x00" * 50, timing=True)
    assert h.sessions == {A: first} and first.sid == 1 and first.timing
    assert first.name.startswith("x\\x00") and "\x00" not in first.name     # printable
    again = h.hello(A, timing=False)
    assert again is first and first.sid == 1 and first.timing        # refreshed, not reopened
    assert h.hello(B).sid == 2


def test_an_older_client_gets_no_field_it_does_not_know() -> None:
    h = Harness()
    new = h.table.hello(Session(A, ""), p.Hello(major=p.PROTOCOL_VERSION[0], minor=6,
                                                client="n"), request(1))
    old = h.table.hello(Session(B, ""), p.Hello(major=p.PROTOCOL_VERSION[0], minor=5,
                                                client="o"), request(1))
    assert cast(Any, new[0]).device_details == ("fake device",)
    assert cast(Any, old[0]).device_details == ()


@pytest.mark.parametrize("client_id", [b"short", b"\x00" + bytes(20)])
def test_a_weak_routing_id_opens_no_session(client_id: bytes) -> None:
    h = Harness()
    with pytest.raises(WireError) as err:
        h.hello(client_id)
    assert err.value.code == ErrorCode.BAD_REQUEST and err.value.message == WEAK_ID
    assert not h.sessions


def test_another_protocol_major_opens_no_session() -> None:
    h = Harness()
    with pytest.raises(WireError, match="client speaks protocol") as err:
        h.hello(A, major=p.PROTOCOL_VERSION[0] + 1)
    assert err.value.code == ErrorCode.VERSION_MISMATCH and not h.sessions


def test_max_sessions_refuses_one_more_unless_a_silent_one_makes_room() -> None:
    h = Harness(max_sessions=2)
    a, b = h.hello(A), h.hello(B)
    with pytest.raises(WireError, match="limit") as err:
        h.hello(C)
    assert err.value.code == ErrorCode.OUT_OF_MEMORY and set(h.sessions) == {A, B}
    a.queue.append(request(7))
    a.last_seen = time.monotonic() - PRESSURE_SILENCE - 1       # its client is gone
    h.hello(C)
    assert set(h.sessions) == {B, C} and h.forgotten == [a] and not b.queue
    [(req_id, code, message)] = h.errors()
    assert (req_id, code) == (7, ErrorCode.NO_SESSION) and "--max-sessions" in message


def test_closing_frees_memory_and_answers_everything_it_waited_for() -> None:
    h = Harness()
    session = h.hello(A)
    h.accounts.charge(session, 4096, "a buffer")
    session.buffers[1] = Buffer(1, 4096, memory=bytearray(4096))
    sending = request(3)
    session.answered_later.add(sending)                    # a send waiting for its ack
    session.queue.extend([request(4, in_flight=True), request(5)])
    session.usage.queued_bytes = 10
    h.table.close(session, "said goodbye")
    assert h.budget.used == 0 and session.usage.memory == 0 and not session.buffers
    assert not h.sessions and h.forgotten == [session] and not session.queue
    assert session.usage.queued_bytes == 0 and not session.answered_later
    unfinished = "session closed (said goodbye) before this transfer finished"
    assert h.errors() == [(3, ErrorCode.NO_SESSION, unfinished),
                          (4, ErrorCode.NO_SESSION, unfinished),      # its own transfer
                          (5, ErrorCode.NO_SESSION, "session closed (said goodbye)")]


def test_memory_pressure_closes_only_silent_sessions_holding_memory() -> None:
    h = Harness()
    keep, holder, empty = h.hello(A), h.hello(B), h.hello(C)
    for session in (keep, holder):
        h.accounts.charge(session, 300 << 10, "buffers")
        session.buffers[1] = Buffer(1, 300 << 10, memory=bytearray(0))
    for session in (keep, holder, empty):
        session.last_seen = time.monotonic() - PRESSURE_SILENCE - 1
    h.accounts.charge(keep, 600 << 10, "one more")          # does not fit: B is reclaimed
    assert set(h.sessions) == {A, C} and h.forgotten == [holder]
    assert h.budget.used == 900 << 10


def test_expiry_closes_sessions_silent_past_the_timeout() -> None:
    h = Harness(session_timeout=5.0)
    old, fresh = h.hello(A), h.hello(B)
    now = time.monotonic()
    old.last_seen, fresh.last_seen = now - 6.0, now - 4.0
    old.queue.append(request(9))
    h.table.expire(now, lambda client_id: False)
    assert set(h.sessions) == {B}
    assert h.errors() == [(9, ErrorCode.NO_SESSION, "session closed (no message for 5 s)")]


def test_a_session_with_a_message_waiting_unread_is_not_silent() -> None:
    h = Harness(session_timeout=5.0)
    waiting, gone = h.hello(A), h.hello(B)
    now = time.monotonic()
    waiting.last_seen = gone.last_seen = now - 6.0
    h.table.expire(now, lambda client_id: client_id == A)
    assert set(h.sessions) == {A}


def test_fail_queued_answers_every_session_s_queue() -> None:
    h = Harness()
    a, b = h.hello(A), h.hello(B)
    a.queue.append(request(1))
    b.queue.extend([request(2), request(3)])
    h.table.fail_queued(ErrorCode.SHUTTING_DOWN, "bye")
    assert sorted(h.errors()) == [(i, ErrorCode.SHUTTING_DOWN, "bye") for i in (1, 2, 3)]
    assert set(h.sessions) == {A, B} and not a.queue and not b.queue
