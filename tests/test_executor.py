"""The executor's ordering rules, with a fake backend and no sockets.

Requests are encoded and decoded as on the wire and handed to ``Executor.handle_frames``; replies
are caught by a fake ``send`` that hands out trackers the test finishes by hand. Peer links have no
endpoint (relayed chunks, PEER_FILL, feed the receives), or a fake link that records pushes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest
import zmq
from zmq_rpc.broker import graph as wire_graph
from zmq_rpc.broker import peer as wire_peer
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.graph import GraphSpec, Node
from zmq_rpc.broker.protocol import Cmd, DType, ErrorCode, TensorRef
from zmq_rpc.worker.backends.base import Backend
from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
from zmq_rpc.worker.dispatch.executor import Executor
from zmq_rpc.worker.graphs import execute as graph_exec
from zmq_rpc.worker.graphs import linked
from zmq_rpc.worker.graphs.linked import LinkedRun, Stage
from zmq_rpc.worker.peer.endpoints import PeerSecurity
from zmq_rpc.worker.peer.links import PeerLinks
from zmq_rpc.worker.peer.push import PushLinks
from zmq_rpc.worker.sessions.session import WorkerLimits

pytestmark = pytest.mark.timeout(10)

A, B = b"client-a-0123456789", b"client-b-0123456789"
BIG = 64 * 1024                     # floats: 256 KiB, over the zero-copy tracking threshold


class FakeBackend(NumpyBackend):
    """Host memory with a log of every data movement, and allocations that can be made to fail."""

    name = "fake"

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events
        self.fail_alloc = False

    def alloc(self, size: int) -> np.ndarray:
        if self.fail_alloc:
            raise MemoryError("fake device full")
        return super().alloc(size)

    def write(self, view: np.ndarray, payload: Any) -> None:
        self.events.append(("write", view.size))
        super().write(view, payload)

    def fill(self, view: np.ndarray, byte: int) -> None:
        self.events.append(("fill", byte))
        super().fill(view, byte)


@dataclass
class FakeTracker:
    """A zero-copy send the test finishes by hand."""

    done: bool = False


@dataclass
class FakeLink:
    """A peer PUSH socket that records what it was given."""

    events: list[tuple[Any, ...]]
    closed: bool = False
    sent: list[list[Any]] = field(default_factory=list)

    def send_multipart(self, frames: list[Any], copy: bool = True,
                       track: bool = False) -> FakeTracker | None:
        self.events.append(("push", bytes(memoryview(frames[1]))) if len(frames) > 1
                           else ("ack",))
        self.sent.append(frames)
        return FakeTracker(done=True) if track else None


class FakePushLinks(PushLinks):
    """PUSH links with no socket: every link is one :class:`FakeLink`, every endpoint trusted."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], link: FakeLink) -> None:
        super().__init__(ctx, PeerSecurity())
        self.link = link

    def check_verified(self, endpoint: str) -> None:
        """Every fake endpoint counts as one that answered a probe."""

    def get(self, endpoint: str) -> zmq.Socket[bytes]:
        return cast(zmq.Socket[bytes], self.link)


class FakePeers(PeerLinks):
    """Peer links with an endpoint but no socket: every link is a :class:`FakeLink`."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: Backend,
                 events: list[tuple[Any, ...]]) -> None:
        self.link = FakeLink(events)
        super().__init__(ctx, backend, links=FakePushLinks(ctx, self.link))
        self.endpoint = "inproc://fake-peer"


@dataclass(frozen=True)
class Answer:
    client: bytes
    req_id: int
    status: int
    fields: list[Any]
    payload: list[bytes]

    @property
    def ok(self) -> bool:
        return self.status == p.STATUS_OK


class Harness:
    """One executor, its fake backend and everything it sent."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], memory_limit: int = 64 << 20,
                 peers_with_endpoint: bool = False) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.backend = FakeBackend(self.events)
        self.trackers: list[FakeTracker] = []
        self.peers = (FakePeers(ctx, self.backend, self.events) if peers_with_endpoint
                      else PeerLinks(ctx, self.backend))
        limits = WorkerLimits(memory_limit=memory_limit, max_buffer_size=memory_limit,
                              max_message_size=64 << 20, session_timeout=30.0)
        self.executor = Executor(self.backend, limits, self._send, "unit", self.peers)
        self._ids = itertools.count(1)
        self._sent: list[Answer] = []

    def _send(self, frames: list[Any], copy: bool = True, track: bool = False) -> Any:
        header = p.unpack_header(bytes(frames[1]))
        payload = [bytes(memoryview(f)) for f in frames[2:]]
        self._sent.append(Answer(frames[0], header[1], header[0], header[2:], payload))
        self.events.append(("reply", header[1]))
        if track:
            tracker = FakeTracker()
            self.trackers.append(tracker)
            return tracker
        return None

    def call(self, client: bytes, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = ()) -> int:
        """Hand one request to the executor; returns its request id."""
        req_id = next(self._ids)
        frames = [zmq.Frame(client), zmq.Frame(p.encode_request(cmd, req_id, msg)),
                  *(zmq.Frame(bytes(memoryview(f))) for f in payload)]
        self.executor.handle_frames(frames)
        return req_id

    def answers(self) -> list[Answer]:
        """Everything answered since the last call of this."""
        sent, self._sent = self._sent, []
        return sent

    def answered(self) -> list[int]:
        return [a.req_id for a in self.answers()]

    def hello(self, client: bytes) -> None:
        major, minor = p.PROTOCOL_VERSION
        self.call(client, Cmd.HELLO, p.Hello(major=major, minor=minor, client=client.decode()))
        assert self.answers()[0].ok

    def alloc(self, client: bytes, handle: int, size: int) -> None:
        self.call(client, Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=handle, size=size))
        assert self.answers()[0].ok

    def set(self, client: bytes, ref: TensorRef, values: np.ndarray) -> int:
        return self.call(client, Cmd.SET_TENSOR, p.SetTensor(tensor=ref), [values.tobytes()])

    def get(self, client: bytes, ref: TensorRef) -> int:
        return self.call(client, Cmd.GET_TENSOR, p.GetTensor(tensor=ref))

    def ping(self, client: bytes) -> int:
        return self.call(client, Cmd.PING, p.Empty())

    def fill(self, client: bytes, token: bytes, values: np.ndarray, error: str = "") -> int:
        data = values.tobytes()
        return self.call(client, Cmd.PEER_FILL, wire_peer.PeerFill(
            token=token, seq=0, nchunks=1, start=0, total=len(data), error=error), [data])

    def recv(self, client: bytes, token: bytes, dst: TensorRef) -> int:
        return self.call(client, Cmd.PEER_RECV,
                         wire_peer.PeerRecv(token=token, dst=dst, timeout_ms=5000))

    def register_neg(self, client: bytes, handle: int, x: TensorRef, y: TensorRef) -> None:
        spec = GraphSpec((x, y), (Node("neg", (-1,), {}, dst=1),))
        self.call(client, Cmd.GRAPH_REGISTER, wire_graph.GraphRegister(handle=handle, graph=spec))
        assert self.answers()[0].ok

    def linked(self, client: bytes, handle: int, *, receive: Sequence[tuple[bytes, TensorRef]] = (),
               send: Sequence[tuple[bytes, TensorRef]] = (), fetch: Sequence[TensorRef] = (),
               inputs: Sequence[tuple[TensorRef, np.ndarray]] = (), hold_us: int = 0) -> int:
        msg = wire_graph.GraphRunLinked(
            handle=handle, inputs=[ref for ref, _ in inputs], fetch=list(fetch),
            receive=tuple(wire_peer.Receive(t, ref) for t, ref in receive),
            send=tuple(wire_peer.Send(t, ref, "inproc://elsewhere") for t, ref in send),
            timeout_ms=5000, hold_reply_us=hold_us)
        return self.call(client, Cmd.GRAPH_RUN_LINKED, msg, [v.tobytes() for _, v in inputs])

    def head(self, client: bytes) -> Any:
        queue = self.executor.sessions[client].queue
        return queue[0] if queue else None

    def finish_sends(self) -> None:
        for tracker in self.trackers:
            tracker.done = True


def f32(buffer: int, n: int, offset: int = 0) -> TensorRef:
    return TensorRef(buffer=buffer, dtype=DType.FLOAT32, shape=(n,), strides=(4,), offset=offset)


def token(i: int) -> bytes:
    return bytes([i]) * wire_peer.TOKEN_BYTES


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def h(ctx: zmq.Context[zmq.Socket[bytes]]) -> Harness:
    harness = Harness(ctx)
    harness.hello(A)
    harness.hello(B)
    return harness


def busy_buffer(h: Harness, client: bytes, handle: int = 1) -> TensorRef:
    """A buffer whose bytes are being sent zero-copy (a big GET not yet done)."""
    ref = f32(handle, BIG)
    h.alloc(client, handle, ref.nbytes)
    h.get(client, ref)
    assert h.answers()[0].ok and len(h.trackers) == 1 and not h.trackers[0].done
    return ref


# ------------------------------------------------------------------------------ dispatch


def test_every_command_has_one_route(h: Harness) -> None:
    assert set(h.executor.routes) == set(Cmd)


def test_routes_say_which_buffers_they_write(h: Harness) -> None:
    session = h.executor.sessions[A]
    x, y = f32(3, 4), f32(4, 4, 16)
    routes = h.executor.routes
    assert list(routes[Cmd.SET_TENSOR].writes(session, p.SetTensor(tensor=x))) == [3]
    assert list(routes[Cmd.COPY_TENSOR].writes(session, p.CopyTensor(src=x, dst=y))) == [4]
    assert list(routes[Cmd.GET_TENSOR].writes(session, p.GetTensor(tensor=x))) == []
    assert list(routes[Cmd.PEER_RECV].writes(
        session, wire_peer.PeerRecv(token=token(1), dst=y, timeout_ms=1))) == [4]


def test_no_session_and_version_mismatch(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    h = Harness(ctx)
    h.ping(A)
    (answer,) = h.answers()
    assert answer.status == ErrorCode.NO_SESSION
    h.call(A, Cmd.HELLO, p.Hello(major=p.PROTOCOL_VERSION[0] + 1, minor=0, client="x"))
    (answer,) = h.answers()
    assert answer.status == ErrorCode.VERSION_MISMATCH
    assert A not in h.executor.sessions
    h.hello(A)
    assert h.executor.sessions[A].name == A.decode()


def test_a_kept_run_without_a_session_is_answered_no_session(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A GRAPH_RUN_KEPT from a client without a session (the live fuzz sent such): NO_SESSION,
    answered; it raised building its request and was never answered (the client's future
    hung) and the worker logged a traceback for each."""
    h = Harness(ctx)
    h.call(A, Cmd.GRAPH_RUN_KEPT, wire_graph.GraphRunKept(kept=0, tokens=(token(1),), sizes=[]))
    (answer,) = h.answers()
    assert answer.status == ErrorCode.NO_SESSION
    h.hello(A)
    assert h.executor.sessions[A].name == A.decode()


# ------------------------------------------------------------------- per-session order


def test_a_write_waits_for_the_zero_copy_send_of_its_buffer(h: Harness) -> None:
    ref = busy_buffer(h, A)
    first = h.set(A, ref, np.ones(BIG, np.float32))
    later = [h.ping(A), h.get(A, f32(1, 4)), h.call(A, Cmd.SYNCHRONIZE, p.Empty())]
    assert h.answered() == []                       # the SET waits, and everything behind it
    assert h.executor.pump_all() is True            # still waiting: the loop retries soon
    h.finish_sends()
    assert h.executor.pump_all() is False
    answers = h.answers()
    assert [a.req_id for a in answers] == [first, *later]
    assert answers[2].payload == [np.ones(4, np.float32).tobytes()]


def test_reads_do_not_wait_for_a_send(h: Harness) -> None:
    busy_buffer(h, A)
    ids = [h.get(A, f32(1, 4)), h.ping(A)]
    assert h.answered() == ids


def test_requests_run_in_arrival_order_within_a_session(h: Harness) -> None:
    ref = f32(1, 4)
    h.alloc(A, 1, 16)
    ids = []
    for value in range(5):
        ids.append(h.set(A, ref, np.full(4, value, np.float32)))
        ids.append(h.get(A, ref))
    answers = h.answers()
    assert [a.req_id for a in answers] == ids
    got = [np.frombuffer(a.payload[0], np.float32)[0] for a in answers[1::2]]
    assert got == [0, 1, 2, 3, 4]


def test_a_failed_request_does_not_stop_its_queue(h: Harness) -> None:
    bad = h.get(A, f32(99, 4))                    # no such buffer
    good = h.ping(A)
    answers = h.answers()
    assert [(a.req_id, a.status) for a in answers] == [(bad, ErrorCode.INVALID_HANDLE),
                                                        (good, p.STATUS_OK)]


def test_an_internal_error_is_answered_and_the_queue_goes_on(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    h.alloc(A, 1, 16)

    def broken(view: Any, byte: int) -> None:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(h.backend, "fill", broken)
    failed = h.call(A, Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=1, value=0))
    after = h.ping(A)
    answers = h.answers()
    assert answers[0].req_id == failed and answers[0].status == ErrorCode.INTERNAL
    assert "kernel exploded" in answers[0].fields[0]
    assert answers[1].req_id == after and answers[1].ok


# -------------------------------------------------------------- cross-session independence


def test_a_waiting_session_does_not_hold_another(h: Harness) -> None:
    ref = busy_buffer(h, A)
    waiting = h.set(A, ref, np.zeros(BIG, np.float32))
    h.alloc(B, 1, 16)
    others = [h.set(B, f32(1, 4), np.ones(4, np.float32)), h.ping(B)]
    assert h.answered() == others                 # B's buffer 1 is not A's buffer 1
    h.finish_sends()
    h.executor.pump_all()
    assert h.answered() == [waiting]


def test_a_receive_holds_only_its_own_session(h: Harness) -> None:
    h.alloc(A, 1, 16)
    recv = h.recv(A, token(1), f32(1, 4))
    behind = h.get(A, f32(1, 4))
    other = h.ping(B)
    assert h.answered() == [other]
    assert h.head(A).in_flight
    fill = h.fill(A, token(1), np.arange(4, dtype=np.float32))
    answers = h.answers()
    # what waited for the bytes runs first, then the receive answers, then the fill
    assert [a.req_id for a in answers] == [behind, recv, fill]
    assert np.frombuffer(answers[0].payload[0], np.float32).tolist() == [0, 1, 2, 3]


def test_a_failed_receive_fails_what_was_queued_behind_it(h: Harness) -> None:
    h.alloc(A, 1, 16)
    recv = h.recv(A, token(1), f32(1, 4))
    behind = h.ping(A)
    h.fill(A, token(1), np.zeros(4, np.float32), error="sender died")
    answers = {a.req_id: a for a in h.answers()}
    assert answers[recv].status == ErrorCode.TRANSFER_FAILED
    assert "sender died" in answers[recv].fields[0]
    assert answers[behind].status == ErrorCode.TRANSFER_FAILED
    assert "an earlier transfer" in answers[behind].fields[0]
    assert not h.executor.sessions[A].queue
    again = h.ping(A)
    assert h.answered() == [again]                # the session itself goes on


def test_chunks_that_came_first_finish_a_receive_at_once(h: Harness) -> None:
    h.alloc(A, 1, 16)
    fill = h.fill(A, token(1), np.full(4, 7, np.float32))       # stashed: no receive yet
    recv = h.recv(A, token(1), f32(1, 4))
    behind = h.get(A, f32(1, 4))
    answers = h.answers()
    assert [a.req_id for a in answers] == [fill, recv, behind]
    assert np.frombuffer(answers[2].payload[0], np.float32).tolist() == [7, 7, 7, 7]
    assert not h.executor.sessions[A].queue


def test_a_fill_for_another_sessions_transfer_is_refused(h: Harness) -> None:
    h.alloc(A, 1, 16)
    h.recv(A, token(1), f32(1, 4))
    fill = h.fill(B, token(1), np.zeros(4, np.float32))
    (answer,) = h.answers()
    assert answer.req_id == fill and answer.status == ErrorCode.INVALID_HANDLE
    assert h.head(A).in_flight


# --------------------------------------------------------------------------- linked runs


def _linked_setup(h: Harness) -> tuple[TensorRef, TensorRef]:
    x, y = f32(1, 4), f32(1, 4, 16)
    h.alloc(A, 1, 32)
    h.register_neg(A, 7, x, y)
    return x, y


def test_a_linked_run_waits_for_every_receive_then_runs(h: Harness) -> None:
    x, y = _linked_setup(h)
    x0, x1 = f32(1, 2), f32(1, 2, 8)
    run = h.linked(A, 7, receive=[(token(1), x0), (token(2), x1)], fetch=[y])
    behind = h.get(A, y)
    entry = h.head(A)
    assert isinstance(entry, LinkedRun) and entry.stage is Stage.RECEIVING and entry.in_flight
    assert h.answered() == []
    h.fill(A, token(1), np.array([1, 2], np.float32))
    assert (entry.stage, entry.received) == (Stage.RECEIVING, 1)
    assert [a.ok for a in h.answers()] == [True]     # only the fill
    assert h.head(A) is entry and entry.in_flight    # now receiving the second hand-off
    h.fill(A, token(2), np.array([3, 4], np.float32))
    answers = h.answers()
    assert [a.req_id for a in answers[:2]] == [run, behind]
    expected = np.array([-1, -2, -3, -4], np.float32).tobytes()
    assert answers[0].payload == [expected] and answers[1].payload == [expected]
    assert entry.stage is Stage.PUSHED
    assert not h.executor.sessions[A].queue


def test_a_linked_run_with_its_chunks_already_stashed_runs_at_once(h: Harness) -> None:
    x, y = _linked_setup(h)
    h.fill(A, token(1), np.array([5, 6, 7, 8], np.float32))
    h.answers()
    run = h.linked(A, 7, receive=[(token(1), x)], fetch=[y])
    (answer,) = h.answers()
    assert answer.req_id == run and answer.ok
    assert answer.payload == [np.array([-5, -6, -7, -8], np.float32).tobytes()]


def test_a_linked_run_whose_receive_fails_fails_with_its_queue(h: Harness) -> None:
    x, y = _linked_setup(h)
    run = h.linked(A, 7, receive=[(token(1), x)], fetch=[y])
    behind = h.ping(A)
    h.fill(A, token(1), np.zeros(4, np.float32), error="stage 1 died")
    answers = {a.req_id: a for a in h.answers()}
    assert answers[run].status == ErrorCode.TRANSFER_FAILED
    assert answers[run].fields[0].startswith("receiving the run's input failed: ")
    assert "stage 1 died" in answers[run].fields[0]
    assert "an earlier transfer" in answers[behind].fields[0]


def test_a_linked_run_whose_receive_cannot_start_fails_alone(h: Harness) -> None:
    _linked_setup(h)
    run = h.linked(A, 7, receive=[(token(1), f32(42, 4))], fetch=[])
    behind = h.ping(A)
    answers = h.answers()
    assert [a.req_id for a in answers] == [run, behind]
    assert answers[0].status == ErrorCode.INVALID_HANDLE
    assert answers[0].fields[0].startswith("receiving the run's input failed: ")
    assert answers[1].ok


def test_a_linked_run_writes_its_inputs_while_its_last_receive_waits(h: Harness) -> None:
    x, y = f32(1, 4), f32(1, 4, 16)
    h.alloc(A, 1, 32)
    h.alloc(A, 2, 16)
    z = f32(2, 4)
    h.register_neg(A, 7, x, y)
    h.events.clear()
    h.linked(A, 7, receive=[(token(1), x)], inputs=[(z, np.ones(4, np.float32))], fetch=[y])
    assert ("write", 4) in h.events                # written before the bytes came
    entry = h.head(A)
    assert entry.prepared is not None and entry.prepared.inputs_written
    h.fill(A, token(1), np.full(4, 2, np.float32))
    writes = [e for e in h.events if e[0] == "write"]
    assert len(writes) == 1                        # not written twice


def test_a_linked_run_pushes_after_it_ran_and_before_it_replies(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    h = Harness(ctx, peers_with_endpoint=True)
    h.hello(A)
    x, y = _linked_setup(h)
    h.set(A, x, np.array([1, 2, 3, 4], np.float32))
    h.answers()
    h.events.clear()
    run = h.linked(A, 7, send=[(token(3), y)], fetch=[y])
    pushed = np.array([-1, -2, -3, -4], np.float32).tobytes()
    assert h.events == [("push", pushed), ("reply", run)]


def test_a_send_behind_a_request_starts_before_that_ones_reply(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    h = Harness(ctx, peers_with_endpoint=True)
    h.hello(A)
    h.alloc(A, 1, 16)
    h.events.clear()
    h.peers.link.events.clear()
    first = h.set(A, f32(1, 4), np.full(4, 9, np.float32))
    assert h.events[-1] == ("reply", first) and h.answered() == [first]
    # a PEER_SEND queued behind a waiting request starts before the request's reply
    ref = busy_buffer(h, A, handle=2)
    waiting = h.set(A, ref, np.zeros(BIG, np.float32))
    send = h.call(A, Cmd.PEER_SEND, wire_peer.PeerSend(
        token=token(4), src=f32(1, 4), endpoint="inproc://b", timeout_ms=5000))
    h.events.clear()
    h.finish_sends()
    h.executor.pump_all()
    assert h.events == [("write", BIG), ("push", np.full(4, 9, np.float32).tobytes()),
                        ("reply", waiting)]
    assert h.answered() == [waiting]               # the send: when the peer acknowledges
    h.peers.acks.on_ack(wire_peer.Ack(token(4), True, "ok"))
    assert h.answered() == [send]


# -------------------------------------------------------------------------- held replies


def test_a_held_reply_leaves_before_any_later_reply(h: Harness) -> None:
    x, y = _linked_setup(h)
    held = h.linked(A, 7, fetch=[y], hold_us=500_000)
    assert h.answered() == []
    assert h.executor.next_release() is not None
    h.executor.release_held(now=0.0)               # not due yet
    assert h.answered() == []
    other = h.ping(B)                              # any reply takes the held ones first
    assert h.answered() == [held, other]
    assert h.executor.next_release() is None


def test_held_replies_leave_in_order_when_due(h: Harness) -> None:
    x, y = _linked_setup(h)
    ids = [h.linked(A, 7, fetch=[y], hold_us=100_000 * (i + 1)) for i in range(3)]
    assert h.answered() == []
    due = h.executor.next_release()
    assert due is not None
    h.executor.release_held(now=due)               # the first is due: only it leaves
    assert h.answered() == ids[:1]
    h.executor.release_held()                      # the rest, in order
    assert h.answered() == ids[1:]


def test_a_held_reply_due_sooner_waits_behind_an_earlier_one(h: Harness) -> None:
    _, y = _linked_setup(h)
    slow = h.linked(A, 7, fetch=[y], hold_us=500_000)
    fast = h.linked(A, 7, fetch=[y], hold_us=1000)
    h.executor.release_held(now=time.monotonic() + 0.05)   # the second is due, the first not
    assert h.answered() == []
    h.executor.release_held(now=time.monotonic() + 1.0)
    assert h.answered() == [slow, fast]


def test_an_error_reply_releases_the_held_ones_first(h: Harness) -> None:
    _, y = _linked_setup(h)
    held = h.linked(A, 7, fetch=[y], hold_us=500_000)
    bad = h.get(B, f32(5, 4))
    assert h.answered() == [held, bad]


def test_a_big_or_over_budget_reply_is_not_held(h: Harness,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = _linked_setup(h)
    monkeypatch.setattr(linked, "MAX_HELD_TOTAL", 20)
    first = h.linked(A, 7, fetch=[y], hold_us=500_000)     # 16 bytes: held
    second = h.linked(A, 7, fetch=[y], hold_us=500_000)    # 32 in all: goes, with the first
    assert h.answered() == [first, second]


# ---------------------------------------------------------------------- memory and sessions


def test_memory_is_counted_once_per_allocation(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    h = Harness(ctx, memory_limit=1 << 20)
    h.hello(A)
    budget = h.executor.budget
    h.alloc(A, 1, 600 << 10)
    assert budget.used == 600 << 10
    h.call(A, Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=2, size=600 << 10))
    (answer,) = h.answers()
    assert answer.status == ErrorCode.OUT_OF_MEMORY
    h.backend.fail_alloc = True
    h.call(A, Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=2, size=1 << 10))
    (answer,) = h.answers()
    assert answer.status == ErrorCode.OUT_OF_MEMORY and budget.used == 600 << 10
    h.backend.fail_alloc = False
    h.call(A, Cmd.FREE_BUFFER, p.BufferOp(handle=1))
    assert h.answers()[0].ok and budget.used == 0


def test_graph_arenas_are_counted_and_come_from_the_backend(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch: list[int] = []
    real = h.backend.scratch
    monkeypatch.setattr(h.backend, "scratch", lambda size: scratch.append(size) or real(size))
    x = f32(1, 64)
    h.alloc(A, 1, 512)
    spec = GraphSpec((x, f32(1, 64, 256)), (Node("neg", (-1,), {}), Node("neg", (0,), {}, dst=1)))
    used = h.executor.budget.used
    h.call(A, Cmd.GRAPH_REGISTER, wire_graph.GraphRegister(handle=3, graph=spec))
    assert h.answers()[0].ok
    graph = h.executor.sessions[A].graphs[3]
    arena = graph.memory_charge
    assert scratch == [graph.arena_size] and h.executor.budget.used == used + arena
    h.call(A, Cmd.GRAPH_COMPUTE, wire_graph.GraphCompute(graph=spec, inputs=[], fetch=[]))
    assert h.answers()[0].ok and h.executor.budget.used == used + arena   # borrowed, given back
    h.call(A, Cmd.GRAPH_FREE, p.BufferOp(handle=3))
    assert h.answers()[0].ok and h.executor.budget.used == used


def test_a_registered_graph_is_bound_at_registration_so_its_first_run_is_like_the_next(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    binds: list[int] = []
    real = graph_exec.bind
    monkeypatch.setattr(graph_exec, "bind", lambda g, ext: binds.append(1) or real(g, ext))
    x = f32(1, 64)
    h.alloc(A, 1, 512)
    spec = GraphSpec((x, f32(1, 64, 256)), (Node("neg", (-1,), {}), Node("neg", (0,), {}, dst=1)))
    h.call(A, Cmd.GRAPH_REGISTER, wire_graph.GraphRegister(handle=3, graph=spec))
    assert h.answers()[0].ok and binds == [1]
    for _ in range(2):
        h.call(A, Cmd.GRAPH_RUN, wire_graph.GraphRun(handle=3, inputs=[], fetch=[]))
        assert h.answers()[0].ok
    assert binds == [1]
    h.alloc(A, 2, 64)                      # a new buffer leaves the views as they were
    h.call(A, Cmd.FREE_BUFFER, p.BufferOp(handle=2))    # a freed one drops them: bound again
    h.call(A, Cmd.GRAPH_RUN, wire_graph.GraphRun(handle=3, inputs=[], fetch=[]))
    assert all(a.ok for a in h.answers()) and binds == [1, 1]


def test_goodbye_frees_everything_and_fails_what_waited(h: Harness) -> None:
    h.alloc(A, 1, 16)
    recv = h.recv(A, token(1), f32(1, 4))
    behind = h.ping(A)
    bye = h.call(A, Cmd.GOODBYE, p.Empty())
    assert h.answered() == []                      # GOODBYE waits its turn too
    h.executor.close_session(h.executor.sessions[A], "test")
    answers = {a.req_id: a.status for a in h.answers()}
    assert answers == {recv: ErrorCode.NO_SESSION, behind: ErrorCode.NO_SESSION,
                       bye: ErrorCode.NO_SESSION}
    assert h.executor.budget.used == 0 and not h.peers.incoming
    h.fill(A, token(1), np.zeros(4, np.float32))
    assert h.answers()[0].status == ErrorCode.NO_SESSION


def test_goodbye_is_answered_and_fails_only_what_came_after(h: Harness) -> None:
    h.alloc(A, 1, 16)
    recv = h.recv(A, token(1), f32(1, 4))
    bye = h.call(A, Cmd.GOODBYE, p.Empty())
    h.fill(A, token(1), np.zeros(4, np.float32))
    answers = {a.req_id: a.status for a in h.answers()}
    assert answers[recv] == p.STATUS_OK and answers[bye] == p.STATUS_OK
    assert A not in h.executor.sessions


def test_goodbye_answers_a_send_still_waiting_for_its_ack(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    h = Harness(ctx, peers_with_endpoint=True)
    h.hello(A)
    h.alloc(A, 1, 16)
    send = h.call(A, Cmd.PEER_SEND, wire_peer.PeerSend(
        token=token(4), src=f32(1, 4), endpoint="inproc://b", timeout_ms=5000))
    assert h.answered() == []
    bye = h.call(A, Cmd.GOODBYE, p.Empty())
    answers = {a.req_id: a for a in h.answers()}
    assert answers[bye].ok
    assert answers[send].status == ErrorCode.NO_SESSION
    assert "before this transfer finished" in answers[send].fields[0]
    assert not h.peers.outgoing


def test_a_weak_client_id_gets_no_session(h: Harness) -> None:
    major, minor = p.PROTOCOL_VERSION
    for weak in (b"short", b"\x00" + bytes(20)):
        h.call(weak, Cmd.HELLO, p.Hello(major=major, minor=minor, client="weak"))
        (answer,) = h.answers()
        assert answer.status == ErrorCode.BAD_REQUEST and weak not in h.executor.sessions


def test_a_request_that_ran_long_leaves_its_session_fresh(h: Harness) -> None:
    """Its client waited for the answer: its silence starts when the request is done, not when
    it came (the loop expires sessions right after a request run from its pump, before it reads
    what the client sent meanwhile)."""
    h.alloc(A, 1, 16)
    session = h.executor.sessions[A]
    route = h.executor.routes[Cmd.ALLOC_BUFFER]

    def ran_a_minute(session: Any, msg: Any, req: Any) -> Any:
        session.last_seen -= 60.0                      # as if the clock moved on meanwhile
        return route.handler(session, msg, req)

    h.executor.routes[Cmd.ALLOC_BUFFER] = dataclasses.replace(route, handler=ran_a_minute)
    h.alloc(A, 2, 16)
    h.executor.expire_sessions(time.monotonic() + 29.0, lambda client_id: False)
    assert h.executor.sessions.get(A) is session


def test_silent_sessions_expire(h: Harness) -> None:
    h.alloc(A, 1, 16)
    h.executor.sessions[A].last_seen -= 60
    h.executor.expire_sessions(h.executor.sessions[B].last_seen, lambda client_id: False)
    assert A not in h.executor.sessions and B in h.executor.sessions
    assert h.executor.budget.used == 0
