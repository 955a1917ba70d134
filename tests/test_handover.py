"""A blocking call on an idle engine (``client/handover.py``): the Ack's short course (two
headers' bytes, a send, a receive, a byte comparison), every way off it, and the connection
given back before ``on_reply`` runs. The other ways off the caller's path are test_inline's."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd, ErrorCode
from zmq_rpc.client import handover
from zmq_rpc.client.engine import Engine


@pytest.fixture
def engine(silent_router: zmq.Socket[bytes]) -> Iterator[Engine]:
    engine = Engine(silent_router.getsockopt_string(zmq.LAST_ENDPOINT))
    yield engine
    engine.close()


class OffCourse:
    """The request ids that left the short course (``inline.after_send``): ``refused`` with a
    reply the course read and did not take, ``timed_out`` with none yet (the reply took longer
    than the 2 ms slice, which a loaded machine allows: the wait goes on the ordinary way)."""

    def __init__(self) -> None:
        self.refused: list[int] = []
        self.timed_out: list[int] = []

    def all(self) -> list[int]:
        return sorted(self.refused + self.timed_out)


@pytest.fixture
def off_course(monkeypatch: pytest.MonkeyPatch) -> OffCourse:
    """Watches ``inline.after_send``, where a request leaves the short course."""
    seen = OffCourse()
    after_send = handover.after_send

    def spy(io: Any, cmd: Cmd, req_id: int, frame: Any, *rest: Any) -> Any:
        (seen.timed_out if frame is None else seen.refused).append(req_id)
        return after_send(io, cmd, req_id, frame, *rest)
    monkeypatch.setattr(handover, "after_send", spy)
    return seen


def _answer(router: zmq.Socket[bytes], count: int,
            replies: Callable[[bytes, int], list[list[bytes]]]) -> threading.Thread:
    """Answer the next ``count`` requests with ``replies(header, req_id)``."""
    def run() -> None:
        for _ in range(count):
            who, header, *_ = router.recv_multipart()
            for message in replies(header, p.unpack_header(header)[1]):
                router.send_multipart([who, *message])
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _ack(header: bytes, req_id: int) -> list[list[bytes]]:
    return [[p.encode_reply(req_id, p.Ack())]]


@pytest.mark.parametrize("first_id", [1, 2**16 - 2, 2**32 - 2, 2**63 - 2])
def test_acks_take_the_short_course_at_every_id_width(
        silent_router: zmq.Socket[bytes], engine: Engine, off_course: OffCourse,
        first_id: int) -> None:
    """The request goes out as encode_request would write it, and its Ack is recognized by
    its bytes, whatever the width of its id; nothing is left in flight."""
    engine._ids = itertools.count(first_id)
    headers: list[bytes] = []

    def replies(header: bytes, req_id: int) -> list[list[bytes]]:
        headers.append(header)
        return _ack(header, req_id)
    served = _answer(silent_router, 3, replies)
    assert engine.request(Cmd.PING, p.Empty()) is p.decode_reply(Cmd.PING, [p.STATUS_OK, 0])
    assert engine.request(Cmd.SYNCHRONIZE, p.Empty(), on_reply=lambda r, f: ("done", f)) == \
        ("done", [])
    assert engine.request(Cmd.PING, p.Empty(), timeout=30.0) is not None
    served.join(5)
    assert headers == [p.encode_request(cmd, first_id + i, p.Empty())
                       for i, cmd in enumerate([Cmd.PING, Cmd.SYNCHRONIZE, Cmd.PING])]
    assert off_course.refused == []   # every Ack that came within the slice was recognized
    io = engine._io
    assert io is not None and not io.in_flight and not io.backlog and not io.deadlines.next() < 1e9


@pytest.mark.parametrize("reply", ["error", "timing", "junk frame", "stray first"])
def test_any_other_reply_leaves_the_course_and_is_read_as_before(
        silent_router: zmq.Socket[bytes], engine: Engine, off_course: OffCourse,
        reply: str) -> None:
    """An error, an Ack with fields, an Ack with a frame too many, another message first:
    each is read the ordinary way (raised, decoded, refused, skipped)."""
    def replies(header: bytes, req_id: int) -> list[list[bytes]]:
        if reply == "error":
            return [[p.encode_error(req_id, ErrorCode.INTERNAL, "no")]]
        if reply == "timing":
            return [[p.encode_reply(req_id, p.Ack(timing=(1, 2)))]]
        if reply == "junk frame":
            return [[p.encode_reply(req_id, p.Ack()), b"junk"]]
        return [[p.encode_reply(0, p.Ack())], [p.encode_reply(req_id, p.Ack())]]
    served = _answer(silent_router, 1, replies)
    try:
        result = engine.request(Cmd.PING, p.Empty())
    except Exception as exc:  # noqa: BLE001
        result = exc
    served.join(5)
    assert off_course.all() == [1]
    if reply == "error":
        assert isinstance(result, Exception) and "no" in str(result)
    elif reply == "timing":
        assert result == p.Ack(timing=(1, 2))
    elif reply == "junk frame":
        assert isinstance(result, Exception) and "payload frame" in str(result)
    else:
        assert isinstance(result, p.Ack)
    io = engine._io
    assert io is not None and not io.in_flight and not io.backlog


def test_requests_with_fields_or_payload_do_not_take_the_course(
        silent_router: zmq.Socket[bytes], engine: Engine, off_course: OffCourse) -> None:
    served = _answer(silent_router, 2, _ack)
    assert isinstance(engine.request(Cmd.FREE_BUFFER, p.BufferOp(handle=3)), p.Ack)
    assert isinstance(engine.request(Cmd.PING, p.Empty(), payload=[b"x"]), p.Ack)
    served.join(5)
    assert off_course.all() == []       # the general path (inline.request), not this course


def test_on_reply_runs_with_the_connection_given_back(
        silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    """``on_reply`` may itself make a blocking call on the same engine (it used to run while
    the caller held the connection: such a call waited for it, forever)."""
    served = _answer(silent_router, 2, _ack)
    nested = engine.request(Cmd.PING, p.Empty(),
                            on_reply=lambda r, f: engine.request(Cmd.SYNCHRONIZE, p.Empty()))
    served.join(5)
    assert isinstance(nested, p.Ack)


@pytest.mark.timeout(30)
def test_on_reply_runs_with_the_connection_given_back_off_the_course(
        silent_router: zmq.Socket[bytes], engine: Engine, off_course: OffCourse) -> None:
    """The same when the Ack comes after the course gave up waiting for it (a slow worker, a
    loaded machine): the nested call used to wait forever for the connection its caller
    held, since the call in flight ran ``on_reply`` as it read the reply."""
    def run() -> None:
        who, header = silent_router.recv_multipart()
        time.sleep(0.05)                                    # past the 2 ms slice
        silent_router.send_multipart([who, *_ack(header, p.unpack_header(header)[1])[0]])
        who, header = silent_router.recv_multipart()        # the nested call
        silent_router.send_multipart([who, *_ack(header, p.unpack_header(header)[1])[0]])
    served = threading.Thread(target=run)
    served.start()
    nested = engine.request(Cmd.PING, p.Empty(),
                            on_reply=lambda r, f: engine.request(Cmd.SYNCHRONIZE, p.Empty()))
    served.join(5)
    assert isinstance(nested, p.Ack)
    assert off_course.timed_out[:1] == [1]
