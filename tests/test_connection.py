"""A worker connection's lifecycle (``client/connection.py``): close against submit, failed
construction, bad endpoints, blocking calls on the caller's thread, reservations, and the two
faces of the client kept in step."""

from __future__ import annotations

import gc
import inspect
import itertools
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import zmq
from waiting import wait_until
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd, ErrorCode
from zmq_rpc.client import (
    AsyncClient,
    BadEndpoint,
    Client,
    ClientClosed,
    ConnectionLost,
    RpcError,
    SessionLost,
    Timeout,
)
from zmq_rpc.client.connection import Connection as Engine
from zmq_rpc.client.options import ConnectionOptions, check_endpoint
from zmq_rpc.worker.server import WorkerServer


def request(engine: Engine, cmd: Cmd, msg: p.Message, **kwargs: Any) -> Any:
    """A blocking call of one request (on this thread when the connection is idle)."""
    return engine.result_of(engine.call, cmd, msg, **kwargs)


def _client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zmq-rpc-client-io"]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:50052", "http://127.0.0.1:50052",
                                      "tcp://127.0.0.1", "tcp://:50052", "tcp://", "",
                                      "tcp://127.0.0.1:notaport"])
def test_bad_endpoints_raise_inside_the_error_tree(endpoint: str) -> None:
    before = len(_client_threads())
    with pytest.raises(BadEndpoint) as info:
        Client(endpoint)
    assert isinstance(info.value, RpcError) and isinstance(info.value, ValueError)
    assert not isinstance(info.value, zmq.ZMQError)
    assert len(_client_threads()) == before


def test_endpoint_check_accepts_what_zmq_rpc_speaks() -> None:
    for ok in ("tcp://127.0.0.1:1", "tcp://localhost:50052", "tcp://[::1]:5", "ipc:///tmp/x",
               "inproc://w"):
        assert check_endpoint(ok) == ok


def test_failed_client_leaves_nothing_that_blocks_later() -> None:
    """Nothing listens: HELLO times out; the socket, the thread and the context are gone, so a
    later garbage collection has nothing to terminate (it used to block in ``term()``)."""
    before = len(_client_threads())
    with pytest.raises(ConnectionLost, match="cannot reach"):
        Client("tcp://127.0.0.1:9", connect_timeout=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # an unclosed context would warn here
        done = threading.Event()

        def collect() -> None:
            gc.collect()
            done.set()
        threading.Thread(target=collect, daemon=True).start()
        assert done.wait(5), "gc.collect() blocked"
    assert len(_client_threads()) == before


def test_failed_engine_start_closes_its_context() -> None:
    ctx_seen: list[zmq.Context[Any]] = []
    real = zmq.Context.__init__

    def spy(self: zmq.Context[Any], *args: Any, **kw: Any) -> None:
        real(self, *args, **kw)
        ctx_seen.append(self)
    zmq.Context.__init__ = spy  # type: ignore[method-assign]
    try:
        with pytest.raises(BadEndpoint):
            Engine("ipc:///tmp/" + "x" * 200)       # zmq refuses it at connect()
    finally:
        zmq.Context.__init__ = real  # type: ignore[method-assign]
    assert ctx_seen and all(c.closed for c in ctx_seen)


def test_close_joins_the_io_thread_and_closes_the_context(worker: WorkerServer) -> None:
    client = Client(worker.endpoint)
    engine = client.connection
    client.close()
    assert not engine.thread.is_alive()
    assert engine.ctx.closed


def _submit_while_closing(endpoint: str) -> list[Future[Any]]:
    client = Client(endpoint)
    futures: list[Future[Any]] = []
    lock = threading.Lock()
    go = threading.Barrier(9)

    def submit() -> None:
        go.wait()
        for _ in range(200):
            future = client.ping_async()
            with lock:
                futures.append(future)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    go.wait()
    time.sleep(0.002)               # close() among the submissions: the race is the subject
    client.close()
    for thread in threads:
        thread.join(10)
    return futures


def test_close_races_eight_submitting_threads(worker: WorkerServer) -> None:
    """Every future resolves (a result, or ClientClosed), none hangs, whatever the timing."""
    for _ in range(5):
        futures = _submit_while_closing(worker.endpoint)
        for future in futures:
            error = future.exception(timeout=10)
            assert error is None or isinstance(error, ClientClosed), error
        assert len(futures) == 8 * 200


def _reply_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that handle each reply from now on (the reply handler of the
    pings and allocations below, ``no_result``, runs on the thread that read the reply, on the
    blocking caller's thread as on the I/O thread's)."""
    from zmq_rpc.client import client as client_module
    from zmq_rpc.client import tensor_calls as tensor_calls_module
    seen: list[str] = []
    real = tensor_calls_module.no_result

    def on_reply(reply: p.Message, frames: list[zmq.Frame]) -> None:
        seen.append(threading.current_thread().name)
        real(reply, frames)
    monkeypatch.setattr(tensor_calls_module, "no_result", on_reply)
    monkeypatch.setattr(client_module, "no_result", on_reply)
    return seen


def _wait_let_go(client: Client) -> None:
    """Wait for the I/O thread to finish its round and let go of the socket lock: a blocking
    caller waits for that only ``FINISHING_WAIT`` s, then hands its call to the I/O thread (on a
    loaded CPU the holder can be off the CPU longer than that; the call is still answered)."""
    lock = client.connection._socket_lock

    def free() -> bool:
        if not lock.acquire(False):
            return False
        lock.release()
        return True
    wait_until(free, 10.0, "the I/O thread let go of the connection", interval=0.001)


def test_sync_call_on_an_idle_engine_runs_on_the_callers_thread(
        worker: WorkerServer, make_client: Callable[..., Client],
        monkeypatch: pytest.MonkeyPatch) -> None:
    client = make_client(worker.endpoint)
    seen = _reply_threads(monkeypatch)
    _wait_let_go(client)
    client.ping()                                         # one request
    client.alloc_buffer(64)                               # result_of: issued on this thread
    assert seen == [threading.current_thread().name] * 2
    pending = [client.ping_async() for _ in range(50)]   # pipelined: the I/O thread's
    client.ping()                                         # waits its turn behind them
    for future in pending:
        future.result(timeout=10)
    assert "zmq-rpc-client-io" in seen and len(seen) == 53
    assert not client.connection._loop.in_flight               # type: ignore[union-attr]
    _wait_let_go(client)
    seen.clear()
    client.ping()                                         # idle again: back on this thread
    assert seen == [threading.current_thread().name]


def _endpoint(sock: zmq.Socket[bytes]) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _answer(router: zmq.Socket[bytes], reply: Callable[[int], bytes]) -> threading.Thread:
    """Answer the next request on ``router`` with ``reply(req_id)``, from a thread."""
    def run() -> None:
        who, header = router.recv_multipart()
        router.send_multipart([who, reply(p.unpack_header(header)[1])])
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sync_request_times_out_and_leaves_the_engine_idle(
        silent_router: zmq.Socket[bytes]) -> None:
    engine = Engine(_endpoint(silent_router))
    try:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(Timeout, match="PING"):
                request(engine, Cmd.PING, p.Empty(), timeout=0.3)
            assert 0.25 < time.monotonic() - started < 3.0
            assert engine._loop is not None and not engine._loop.in_flight
            silent_router.recv_multipart()                # it did go out
        answering = _answer(silent_router, lambda req_id: p.encode_reply(req_id, p.Empty()))
        assert isinstance(request(engine, Cmd.PING, p.Empty()), p.Ack)
        answering.join(5)
    finally:
        engine.close()


def test_sync_request_raises_what_the_reply_or_its_handler_says(
        silent_router: zmq.Socket[bytes]) -> None:
    engine = Engine(_endpoint(silent_router))
    try:
        _answer(silent_router, lambda req_id: p.encode_reply(req_id, p.Empty())).join(0)

        def broken(reply: p.Message, frames: list[zmq.Frame]) -> None:
            raise ValueError("the handler broke")
        with pytest.raises(ValueError, match="handler broke"):
            request(engine, Cmd.PING, p.Empty(), on_reply=broken)
        _answer(silent_router, lambda req_id: p.encode_error(req_id, ErrorCode.NO_SESSION, "gone"))
        with pytest.raises(SessionLost, match="gone"):
            request(engine, Cmd.PING, p.Empty())
        started = time.monotonic()
        for _ in range(2):                                # for good, and at once
            with pytest.raises(SessionLost):
                request(engine, Cmd.PING, p.Empty())
            with pytest.raises(SessionLost):
                engine.call(Cmd.PING, p.Empty()).result(timeout=5)
        assert time.monotonic() - started < 1.0
    finally:
        engine.close()


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="needs thread CPU clocks")
def test_io_thread_sleeps_while_it_waits_for_replies(silent_router: zmq.Socket[bytes]) -> None:
    """Requests in flight, none answered, wake-ups from new requests: the I/O thread drains
    its wake-up socket and sleeps in poll (it used to miss the socket in poll's answer, which
    names a plain socket by its fd, and spin until the engine went idle)."""
    engine = Engine(_endpoint(silent_router))
    try:
        pending = [engine.call(Cmd.PING, p.Empty()) for _ in range(3)]
        for _ in range(3):
            time.sleep(0.05)        # wake-ups spread while it waits: the subject
            pending.append(engine.call(Cmd.PING, p.Empty()))   # wakes the I/O thread
        clock = time.pthread_getcpuclockid(engine.thread.ident or 0)
        cpu, wall = time.clock_gettime(clock), time.monotonic()
        time.sleep(0.5)             # a measurement window of its CPU time
        used = time.clock_gettime(clock) - cpu
        assert used < 0.25 * (time.monotonic() - wall), f"I/O thread busy {used:.3f} s"
        assert not any(f.done() for f in pending)
    finally:
        engine.close()


def test_each_request_times_out_at_its_own_deadline(silent_router: zmq.Socket[bytes]) -> None:
    """Deadlines in submission order (the engine's timeout) and out of it (shorter ones)."""
    engine = Engine(_endpoint(silent_router), ConnectionOptions(timeout=0.6))
    try:
        started = time.monotonic()
        default = [engine.call(Cmd.PING, p.Empty()) for _ in range(3)]
        short = engine.call(Cmd.PING, p.Empty(), timeout=0.2)
        long = engine.call(Cmd.PING, p.Empty(), timeout=30)
        assert isinstance(short.exception(timeout=5), Timeout)
        assert time.monotonic() - started < 0.55 and not any(f.done() for f in default)
        for future in default:
            assert isinstance(future.exception(timeout=5), Timeout)
        assert 0.55 < time.monotonic() - started < 3.0 and not long.done()
    finally:
        engine.close()
    assert isinstance(long.exception(timeout=5), ClientClosed)


def test_close_from_another_thread_ends_a_waiting_sync_request(
        silent_router: zmq.Socket[bytes]) -> None:
    engine = Engine(_endpoint(silent_router))
    closer = threading.Timer(0.2, engine.close)
    closer.start()
    started = time.monotonic()
    with pytest.raises(ClientClosed):
        request(engine, Cmd.PING, p.Empty())               # default timeout: 60 s
    assert time.monotonic() - started < 5.0
    closer.join(5)
    assert not engine.thread.is_alive()


def test_sync_and_async_calls_from_many_threads_keep_order(
        worker: WorkerServer, make_client: Callable[..., Client]) -> None:
    """Inline calls and I/O-thread calls interleave without losing or mixing replies."""
    client = make_client(worker.endpoint)
    t = client.alloc_buffer(4096).tensor(1024, "int32")
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(60):
                if i % 3 == 0:
                    client.device_memory()            # result_of
                elif i % 3 == 1:
                    client.ping()                     # result_of too
                else:
                    client.ping_async().result(10)    # the I/O thread's
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    client.set_tensor(t, list(range(1024)))
    assert client.get_tensor(t)[-1] == 1023


def test_reservation_holds_later_requests_until_filled(
        worker: WorkerServer, make_client: Callable[..., Client]) -> None:
    client = make_client(worker.endpoint)
    engine = client.connection
    t = client.alloc_buffer(64).tensor(16, "float32")
    slot = engine.reserve()
    later = client.get_tensor_async(t)
    time.sleep(0.2)                 # nothing may happen meanwhile: a real duration
    assert not later.done()                       # held behind the open reservation
    with engine.filling(slot):
        write = client.set_tensor_async(t, [7.0] * 16)
    write.result(timeout=10)
    assert later.result(timeout=10)[0] == 7.0     # ran after what filled the slot


def test_reservation_that_is_never_filled_times_out(
        worker: WorkerServer, make_client: Callable[..., Client]) -> None:
    client = make_client(worker.endpoint)
    slot = client.connection.reserve(timeout=0.3)
    later = client.ping_async()
    later.result(timeout=5)                        # released at the reservation's deadline
    with client.connection.filling(slot):
        late = client.ping_async()
    with pytest.raises(RpcError):
        late.result(timeout=5)


def test_no_session_reply_is_session_lost_for_good(worker: WorkerServer,
                                                   make_client: Callable[..., Client]) -> None:
    from zmq_rpc.client import SessionLost
    client = make_client(worker.endpoint)
    client.connection.call(Cmd.GOODBYE, p.Empty())  # the worker forgets us

    def lost() -> bool:
        try:
            client.ping()
        except SessionLost:
            return True
        return False
    wait_until(lost, 1.0, "a ping answered 'no session' after GOODBYE", interval=0.01)
    with pytest.raises(SessionLost):
        client.alloc_buffer(16)


def test_a_wake_up_during_a_poll_is_drained_and_the_io_thread_sleeps(
        worker: WorkerServer, make_client: Callable[..., Client],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request submitted while the I/O thread polls writes the wake-up socket; that round must
    read it. zmq_poll names a plain socket by its fd, and left unread it made every later poll
    return at once: the thread spun through every graph run in flight (~80% of a core per
    connection while a model generated)."""
    from zmq_rpc.client import Graph
    from zmq_rpc.client import loop as io_loop_module
    client = make_client(worker.endpoint)
    wake_fd = client.connection._mailbox.wake_socket.fileno()
    wakes = [0]
    poll = io_loop_module.zmq_poll

    def counting_poll(items: Any, timeout: Any = None) -> Any:
        events = poll(items, timeout)
        if threading.current_thread() is client.connection.thread:
            wakes[0] += sum(1 for sock, _ in events if sock == wake_fd)
        return events

    monkeypatch.setattr(io_loop_module, "zmq_poll", counting_poll)
    x = client.alloc_buffer(512 * 512 * 4).tensor((512, 512), "float32")
    g = Graph()
    y = g.input(x)
    for _ in range(40):                           # a run long enough to spin through
        y = g.matmul(y, x)
    g.add(y, 0.0, out=x)
    for _ in range(3):
        slow = client.compute_async(g)
        time.sleep(0.05)                          # the I/O thread now polls for its reply
        pings = [client.ping_async() for _ in range(3)]   # submitted while it is in flight
        slow.result(timeout=60)
        for ping in pings:
            ping.result(timeout=60)
    assert wakes[0] <= 20, f"the wake-up socket was reported {wakes[0]} times"


# ------------------------------------------------------------------------- the two faces


def _public(cls: type) -> dict[str, Any]:
    return {name: member for name, member in inspect.getmembers(cls)
            if not name.startswith("_") and (callable(member) or isinstance(member, property))}


def test_async_face_matches_the_sync_face() -> None:
    """Every public method of Client has an AsyncClient twin with the same parameters (the
    ``_async`` twins are the sync face's futures), and the other way round."""
    sync, aio = _public(Client), _public(AsyncClient)
    twins = {n for n in sync if n.endswith("_async")}
    expected = ({n for n in sync if n not in twins}
                | {"connect", "sync"})              # how an AsyncClient is made, and its Client
    attributes = {"endpoint", "info",               # the worker, as the session knows it
                  "name", "timeout", "chunk_bytes", "peer_copy", "connection"}
    assert set(aio) - {"sync"} - attributes == expected - {"sync"} - attributes, \
        (set(aio) ^ expected)
    for name in sorted(expected - {"connect", "sync"} - (attributes - set(aio))):
        a, s = aio[name], sync[name]
        if isinstance(s, property):
            assert isinstance(a, property), name
            continue
        assert list(inspect.signature(a).parameters.items()) == \
            list(inspect.signature(s).parameters.items()), name
        if f"{name}_async" in twins:
            assert inspect.iscoroutinefunction(a), f"AsyncClient.{name} is not a coroutine"
            params = inspect.signature(sync[f"{name}_async"]).parameters
            assert list(params) == list(inspect.signature(s).parameters), f"{name}_async"
    for name in twins:
        assert name[:-len("_async")] in sync, f"{name} has no blocking twin"


@pytest.mark.parametrize("first_id", [1, 200, 70_000, 1 << 33])
def test_acks_read_by_their_bytes_settle_the_right_calls(
        silent_router: zmq.Socket[bytes], first_id: int) -> None:
    """A bare success reply settles its call by the id in its bytes (``Loop._settle_ack``) at
    every msgpack width of the id; what is not exactly an Ack's bytes (an id written wider than
    msgpack writes it, an Ack for a command whose reply has fields, an unknown id) is read as any
    reply."""
    engine = Engine(_endpoint(silent_router))
    try:
        engine._ids = itertools.count(first_id)       # ids of this width from the start
        pings = [engine.call(Cmd.PING, p.Empty()) for _ in range(3)]
        status = engine.call(Cmd.STATUS, p.Empty())
        requests = [silent_router.recv_multipart() for _ in range(4)]
        who = requests[0][0]
        ids = [p.unpack_header(r[1])[1] for r in requests]      # no HELLO: unsigned
        assert ids == list(range(first_id, first_id + 4))
        wide = p.BARE_REPLY_HEAD + b"\xcf" + ids[1].to_bytes(8, "big")
        for reply in (p.BARE_REPLY_HEAD + p.pack_id(ids[0] + 1000),     # nobody's: dropped
                      p.BARE_REPLY_HEAD + p.pack_id(ids[2]), wide,
                      p.BARE_REPLY_HEAD + p.pack_id(ids[3]),           # STATUS has fields
                      p.BARE_REPLY_HEAD + p.pack_id(ids[0])):
            silent_router.send_multipart([who, reply])
        assert [f.result(timeout=5) for f in pings] == [p.Ack()] * 3
        with pytest.raises(RpcError):
            status.result(timeout=5)
    finally:
        engine.close()
