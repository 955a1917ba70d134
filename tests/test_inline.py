"""The synchronous caller's own path (``client/inline.py``): a request sent and answered on the
caller's thread, its fast course and every way off it (a stray message first, a bad reply, a
slow one, close from another thread, many threads at once)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from waiting import wait_until
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.errors import BadRequest
from zmq_rpc.broker.protocol import Cmd, ErrorCode
from zmq_rpc.client import Client, ClientClosed
from zmq_rpc.client.engine import Engine
from zmq_rpc.client.link import SYNC_SLICE_MS
from zmq_rpc.worker.server import WorkerServer


@pytest.fixture
def engine(silent_router: zmq.Socket[bytes]) -> Iterator[Engine]:
    engine = Engine(silent_router.getsockopt_string(zmq.LAST_ENDPOINT))
    yield engine
    engine.close()


def _serve(silent_router: zmq.Socket[bytes],
           replies: Callable[[int], list[list[bytes]]], delay: float = 0.0) -> threading.Thread:
    """Answer the next request with the messages ``replies(req_id)``, after ``delay`` s."""
    def run() -> None:
        who, header = silent_router.recv_multipart()
        time.sleep(delay)           # a slow worker: the delay is the test's subject
        for message in replies(p.unpack_header(header)[1]):
            silent_router.send_multipart([who, *message])
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _ack(req_id: int) -> list[bytes]:
    return [p.encode_reply(req_id, p.Ack())]


def _idle(engine: Engine) -> bool:
    io = engine._io
    return io is not None and not io.in_flight and not io.backlog


def test_stray_replies_first_are_dropped_and_ours_still_read(
        silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    """The keep-alive's reply (id 0) and late replies (to requests that timed out) come before
    ours; none is taken for ours."""
    served = _serve(silent_router, lambda req_id: [
        _ack(0), [p.encode_error(req_id + 1000, ErrorCode.BAD_REQUEST, "stray")], _ack(req_id)])
    assert isinstance(engine.request(Cmd.PING, p.Empty()), p.Ack)
    served.join(5)
    stale = p.DeviceMemoryReply(total=1, free=1)
    fresh = p.DeviceMemoryReply(total=1 << 30, free=1 << 20)
    served = _serve(silent_router, lambda req_id: [[p.encode_reply(req_id - 1, stale)],
                                            [p.encode_reply(req_id, fresh)]])
    assert engine.request(Cmd.DEVICE_MEMORY, p.Empty()) == fresh
    served.join(5)
    assert _idle(engine)


def test_a_reply_with_a_frame_too_many_raises_and_the_engine_goes_on(
        silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    served = _serve(silent_router, lambda req_id: [[*_ack(req_id), b"junk"]])
    with pytest.raises(BadRequest, match="payload frame"):
        engine.request(Cmd.PING, p.Empty())
    served.join(5)
    served = _serve(silent_router, lambda req_id: [_ack(req_id)])
    assert isinstance(engine.request(Cmd.PING, p.Empty()), p.Ack)
    served.join(5)
    assert _idle(engine)


def test_an_unreadable_reply_is_dropped_and_ours_still_read(
        silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    served = _serve(silent_router, lambda req_id: [[b"\xc1 not msgpack"], _ack(req_id)])
    assert isinstance(engine.request(Cmd.PING, p.Empty()), p.Ack)
    served.join(5)


def test_a_reply_with_fields_is_decoded(silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    """Not an Ack: decoded field by field, and handed to ``on_reply`` with its frames."""
    reply = p.DeviceMemoryReply(total=1 << 30, free=1 << 20)
    served = _serve(silent_router, lambda req_id: [[p.encode_reply(req_id, reply)]])
    got = engine.request(Cmd.DEVICE_MEMORY, p.Empty(),
                         on_reply=lambda r, frames: (r, list(frames)))
    served.join(5)
    assert got == (reply, [])


def test_a_reply_slower_than_the_slice_is_still_ours(
        silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    """Past ``SYNC_SLICE_MS`` the caller watches every socket; the reply still ends its call."""
    served = _serve(silent_router, lambda req_id: [_ack(req_id)], delay=20 * SYNC_SLICE_MS / 1000)
    started = time.monotonic()
    assert isinstance(engine.request(Cmd.PING, p.Empty()), p.Ack)
    assert time.monotonic() - started >= 20 * SYNC_SLICE_MS / 1000
    served.join(5)
    assert _idle(engine)


def test_requests_of_other_threads_go_out_while_a_sync_call_waits(
        silent_router: zmq.Socket[bytes], engine: Engine) -> None:
    """A synchronous caller whose reply is slow sends what other threads submit meanwhile
    (within ``SYNC_SLICE_MS``), so theirs are answered first."""
    first = threading.Event()
    order: list[str] = []

    def answer() -> None:
        who, header = silent_router.recv_multipart()           # the slow one
        slow_id = p.unpack_header(header)[1]
        first.set()
        who, header = silent_router.recv_multipart()           # another thread's, sent meanwhile
        silent_router.send_multipart([who, *_ack(p.unpack_header(header)[1])])
        time.sleep(0.1)             # the slow reply: slower than the other thread's round trip
        silent_router.send_multipart([who, *_ack(slow_id)])
    thread = threading.Thread(target=answer)
    thread.start()

    def other() -> None:
        first.wait(5)
        engine.submit(Cmd.PING, p.Empty()).result(timeout=5)
        order.append("other")
    helper = threading.Thread(target=other)
    helper.start()
    engine.request(Cmd.PING, p.Empty())
    order.append("sync")
    helper.join(5)
    thread.join(5)
    assert order == ["other", "sync"]


@pytest.mark.parametrize("delay", [0.2, "random"])
def test_close_wakes_a_sync_caller_within_the_slice(silent_router: zmq.Socket[bytes],
                                                    delay: float | str) -> None:
    """close() from another thread, whenever it comes, ends a synchronous call at once and
    joins the I/O thread at once. (The I/O thread, parked on the same wake-up socket, used to
    drain the caller's wake-up: a caller that polled just after slept through close() until
    its poll's timeout, 2 s; and once the caller had seen close() the I/O thread polled for
    the failed call's reply, 2 s, before it looked.)"""
    rounds = 1 if delay == 0.2 else 40
    rng = random.Random(7)
    endpoint = silent_router.getsockopt_string(zmq.LAST_ENDPOINT)
    woken, closing = 0.0, 0.0
    for _ in range(rounds):
        engine = Engine(endpoint)
        wait = 0.2 if delay == 0.2 else rng.uniform(0, 0.006)
        times: list[float] = []

        def close(engine: Engine = engine, wait: float = wait,
                  times: list[float] = times) -> None:
            time.sleep(wait)        # close() at a random moment of the call: the subject
            times.append(time.monotonic())
            engine.close()                                # joins the I/O thread
            times.append(time.monotonic())
        closer = threading.Thread(target=close)
        closer.start()
        with pytest.raises(ClientClosed):
            engine.request(Cmd.PING, p.Empty())           # default timeout: 60 s
        woken = max(woken, time.monotonic() - times[0])
        closer.join(5)
        closing = max(closing, times[1] - times[0])
    assert woken < 1.0, f"woken {woken:.3f} s after close()"
    assert closing < 1.0, f"close() took {closing:.3f} s"


def _ping_while_closing(client: Client, threads: int = 8, calls: int = 300) -> list[str]:
    """``threads`` threads call ``client.ping()`` ``calls`` times each while this one closes
    the client: what each call did ("ok", "closed", or the unexpected error)."""
    outcomes: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)

    def ping() -> None:
        start.wait(5)
        for _ in range(calls):
            try:
                client.ping()
                result = "ok"
            except ClientClosed:
                result = "closed"
            except BaseException as exc:  # noqa: BLE001
                result = repr(exc)
            with lock:
                outcomes.append(result)

    pingers = [threading.Thread(target=ping) for _ in range(threads)]
    for thread in pingers:
        thread.start()
    start.wait(5)
    wait_until(lambda: outcomes, 10, "a ping was answered: the pingers are under way")
    client.close()
    for thread in pingers:
        thread.join(20)
    assert not any(thread.is_alive() for thread in pingers), "a ping hangs"
    return outcomes


@pytest.mark.parametrize("round_", range(3))
def test_eight_threads_pinging_while_another_closes(
        worker: WorkerServer, make_client: Callable[..., Client], round_: int) -> None:
    """Every call returns or raises ClientClosed; none hangs."""
    outcomes = _ping_while_closing(make_client(worker.endpoint))
    assert len(outcomes) == 8 * 300
    assert set(outcomes) <= {"ok", "closed"}, set(outcomes) - {"ok", "closed"}
