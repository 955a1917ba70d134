"""The worker never trusts a client: every malformed or hostile request gets an error reply with
the right code, and the worker goes on serving everybody else.

Most tests speak the raw wire protocol through a DEALER (:class:`Wire`); after each abuse a
separate, well-behaved :class:`~zmq_rpc.client.Client` checks that the same worker still serves
a round trip (:func:`assert_serves`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message
from zmq_rpc.broker import peer as peer_wire
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.errors import VersionMismatch
from zmq_rpc.broker.graph import MAX_NODES
from zmq_rpc.broker.protocol import Cmd, DType, ErrorCode, TensorRef
from zmq_rpc.client import Client
from zmq_rpc.worker.process.devices import physical_memory
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(30)

OK = p.STATUS_OK
F32 = DType.FLOAT32
U8 = DType.UINT8

Reply = tuple[list[Any], list[bytes]]


class Wire:
    """A raw DEALER speaking (or abusing) the wire protocol; one reply read per request."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.ids = itertools.count(1000)

    def send(self, cmd: Cmd | int, msg: p.Message | None = None, payload: list[bytes] | None = None,
             *, fields: list[Any] | None = None) -> int:
        """Send a request (a message, or raw header fields); returns its req_id."""
        req_id = next(self.ids)
        if fields is not None:
            header = msgpack.packb([int(cmd), req_id, *fields], use_bin_type=True)
        else:
            header = p.encode_request(Cmd(cmd), req_id, msg or p.Empty())
        self.sock.send_multipart([header, *(payload or [])])
        return req_id

    def recv(self, timeout: float = 10.0) -> Reply:
        assert self.sock.poll(int(timeout * 1000)), "no reply from the worker"
        frames = self.sock.recv_multipart()
        return msgpack.unpackb(frames[0], raw=False), frames[1:]

    def call(self, cmd: Cmd | int, msg: p.Message | None = None,
             payload: list[bytes] | None = None, **kw: Any) -> Reply:
        req_id = self.send(cmd, msg, payload, **kw)
        header, frames = self.recv()
        assert header[1] == req_id, f"reply to {header[1]}, expected {req_id}"
        return header, frames

    def ok(self, cmd: Cmd, msg: p.Message | None = None, payload: list[bytes] | None = None
           ) -> Reply:
        header, frames = self.call(cmd, msg, payload)
        assert header[0] == OK, f"{cmd.name} failed: {header}"
        return header, frames

    def hello(self, major: int = p.PROTOCOL_VERSION[0]) -> Reply:
        return self.call(Cmd.HELLO, p.Hello(major=major, minor=0, client="raw-test"))

    def alloc(self, handle: int, size: int) -> None:
        self.ok(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=handle, size=size))

    def set(self, tensor: TensorRef, data: bytes) -> None:
        self.ok(Cmd.SET_TENSOR, p.SetTensor(tensor=tensor), [data])

    def get(self, tensor: TensorRef) -> bytes:
        return self.ok(Cmd.GET_TENSOR, p.GetTensor(tensor=tensor))[1][0]

    def no_reply(self, wait: float = 0.3) -> bool:
        return not self.sock.poll(int(wait * 1000))


def assert_error(reply: Reply, code: ErrorCode, *fragments: str, req_id: int | None = None) -> str:
    """The reply is ``[code, req_id, message]``, without payload, and the message says why."""
    header, frames = reply
    assert header[0] == code, f"expected {code.name}, got {header}"
    assert len(header) == 3 and type(header[2]) is str and header[2], header
    assert frames == []
    if req_id is not None:
        assert header[1] == req_id
    for fragment in fragments:
        assert fragment in header[2], f"{fragment!r} not in {header[2]!r}"
    return header[2]


def tensor(shape: tuple[int, ...], strides: tuple[int, ...] | None = None, *, buffer: int = 1,
           dtype: DType = F32, offset: int = 0) -> TensorRef:
    if strides is None:
        strides = p.contiguous_strides(shape, dtype.itemsize)
    return TensorRef(buffer=buffer, dtype=dtype, shape=shape, strides=strides, offset=offset)


@pytest.fixture
def connect(raw_socket: Callable[[int], zmq.Socket[bytes]]) -> Callable[..., Wire]:
    """``connect(endpoint, hello=True)``: a raw DEALER, with a session unless ``hello=False``."""

    def open_wire(endpoint: str, hello: bool = True) -> Wire:
        sock = raw_socket(zmq.DEALER)
        sock.connect(endpoint)
        wire = Wire(sock)
        if hello:
            header, _ = wire.hello()
            assert header[0] == OK, header
        return wire

    return open_wire


@pytest.fixture
def wire(worker: WorkerServer, connect: Callable[..., Wire]) -> Wire:
    """A raw session on ``worker`` with a 64-byte buffer under handle 1."""
    w = connect(worker.endpoint)
    w.alloc(1, 64)
    return w


@pytest.fixture
def assert_serves(make_client: Callable[..., Client]) -> Callable[[str], None]:
    """``assert_serves(endpoint)``: another client still gets a correct set/get round trip."""

    def check(endpoint: str) -> None:
        client = make_client(endpoint, timeout=10.0)
        try:
            buf = client.alloc_buffer(256)
            values = np.arange(48, dtype=np.float32).reshape(6, 8) * 1.5 - 7
            t = buf.tensor((6, 8), "float32")
            client.set_tensor(t, values)
            np.testing.assert_array_equal(client.get_tensor(t), values)
            np.testing.assert_array_equal(client.get_tensor(t.T[::2]), values.T[::2])
        finally:
            client.close()

    return check


# ------------------------------------------------------------------------- malformed requests


def test_unknown_command(worker: WorkerServer, wire: Wire, assert_serves: Any) -> None:
    for cmd in (0, 99, 2**64 - 1):
        req_id = wire.send(cmd, fields=[1, 2])
        assert_error(wire.recv(), ErrorCode.UNKNOWN_COMMAND, f"unknown command {cmd}",
                     req_id=req_id)
    assert_serves(worker.endpoint)


@pytest.mark.parametrize("payloads", [0, 2])
def test_wrong_frame_count(worker: WorkerServer, wire: Wire, assert_serves: Any,
                           payloads: int) -> None:
    reply = wire.call(Cmd.SET_TENSOR, p.SetTensor(tensor=tensor((4,))), [bytes(16)] * payloads)
    assert_error(reply, ErrorCode.BAD_REQUEST, "SET_TENSOR takes 1 payload frame(s)",
                 f"got {payloads}")
    reply = wire.call(Cmd.PING, p.Empty(), [b"surplus"])
    assert_error(reply, ErrorCode.BAD_REQUEST, "PING takes 0 payload frame(s), got 1")
    assert wire.get(tensor((4,))) == bytes(16)  # nothing was written
    assert_serves(worker.endpoint)


def _leading_id(frame: bytes) -> int:
    """The request id in a header's first 32 bytes: [anything, id, ...] with id a u64; else 0."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(frame[:32])
    try:
        if unpacker.read_array_header() >= 2:
            unpacker.skip()
            req_id = unpacker.unpack()
            if type(req_id) is int and 0 <= req_id < 1 << 64:
                return req_id
    except Exception:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        pass
    return 0


@pytest.mark.parametrize(("header", "req_id"), [
    (b"\xc1garbage", 0), (b"\x95\x08\x01", 1), (msgpack.packb({"cmd": 2, "req_id": 7}), 0),
    (b"", 0), (msgpack.packb([2, 7])[:1], 0), (msgpack.packb("PING"), 0),
], ids=["garbage", "truncated", "map", "empty", "truncated-id", "string"])
def test_malformed_header(worker: WorkerServer, wire: Wire, assert_serves: Any,
                          header: bytes, req_id: int) -> None:
    """Answered to the request id when the header's first two items give one (its future then
    fails at once instead of timing out), else to 0."""
    wire.sock.send(header)
    message = assert_error(wire.recv(), ErrorCode.BAD_REQUEST, "header", req_id=req_id)
    assert "msgpack" in message or "[cmd, req_id" in message
    assert_serves(worker.endpoint)


def test_oversized_header(worker: WorkerServer, wire: Wire, assert_serves: Any) -> None:
    header = msgpack.packb([int(Cmd.PING), 5, "x" * p.MAX_HEADER_BYTES])
    wire.sock.send(header)
    assert_error(wire.recv(), ErrorCode.BAD_REQUEST, f"header of {len(header)} bytes",
                 str(p.MAX_HEADER_BYTES), req_id=5)
    wire.ok(Cmd.PING)
    assert_serves(worker.endpoint)


@pytest.mark.parametrize("dtype", [13, 200, -1, "float32"])
def test_unknown_dtype(worker: WorkerServer, wire: Wire, assert_serves: Any, dtype: Any) -> None:
    reply = wire.call(Cmd.GET_TENSOR, fields=[[1, dtype, [4], [4], 0]])
    assert_error(reply, ErrorCode.BAD_REQUEST, "unknown dtype code", repr(dtype))
    assert_serves(worker.endpoint)


@pytest.mark.parametrize("shape,strides,offset,code,why", [
    ([4], [4], -1, ErrorCode.BAD_REQUEST, "offset"),
    ([4], [4], 2**63, ErrorCode.BAD_REQUEST, "offset"),
    ([4], [4], 2**63 - 1, ErrorCode.OUT_OF_BOUNDS, "64-byte buffer"),
    ([4], [4], 2**64 - 1, ErrorCode.BAD_REQUEST, "offset"),
    ([-4], [4], 0, ErrorCode.BAD_REQUEST, "shape"),
    ([2**64 - 1], [4], 0, ErrorCode.BAD_REQUEST, "shape"),
    ([2**40, 2**40], [4, 4], 0, ErrorCode.BAD_REQUEST, "over the limit"),
    ([2**16] * 4, [0] * 4, 0, ErrorCode.BAD_REQUEST, "over the limit"),  # 2**64 elements
    ([4], [2**63], 0, ErrorCode.BAD_REQUEST, "strides"),
    ([4], [-(2**63)], 0, ErrorCode.BAD_REQUEST, "strides"),
    ([2**24, 2**24], [p.MAX_DIM, p.MAX_DIM], 0, ErrorCode.OUT_OF_BOUNDS, "64-byte buffer"),
    ([2**24, 2**24], [-p.MAX_DIM, p.MAX_DIM], 2**63 - 1, ErrorCode.OUT_OF_BOUNDS, "reaches"),
    ([2, 2**24], [0, p.MAX_DIM], 0, ErrorCode.OUT_OF_BOUNDS, "reaches"),
], ids=lambda v: str(v)[:20])
def test_negative_or_overflowing_geometry(worker: WorkerServer, wire: Wire, assert_serves: Any,
                                          shape: list[int], strides: list[int], offset: int,
                                          code: ErrorCode, why: str) -> None:
    for cmd in (Cmd.GET_TENSOR, Cmd.MEMSET_TENSOR):
        extra = [0, 0, -1] if cmd is Cmd.MEMSET_TENSOR else []
        reply = wire.call(cmd, fields=[[1, int(F32), shape, strides, offset], *extra])
        assert_error(reply, code, why)
    assert wire.get(tensor((16,))) == bytes(64)
    assert_serves(worker.endpoint)


# ---------------------------------------------------------------------- views outside buffers


@pytest.mark.parametrize("view,extent", [
    (tensor((16,), offset=1), "[1, 65)"),  # last element one byte past the end
    (tensor((4, 4), (16, 4), offset=4), "[4, 68)"),
    (tensor((4, 4), (20, 4)), "[0, 76)"),  # rows too far apart
    (tensor((4,), (-4,), offset=8), "[-4, 12)"),  # negative stride below byte 0
    (tensor((2, 2), (32, -8)), "[-8, 36)"),
    (tensor((0, 3), offset=65), "[65, 65)"),  # an empty view past the end
    (tensor((), (), dtype=DType.FLOAT64, offset=57), "[57, 65)"),
    (tensor((4, 4), (4, 20)), "[0, 76)"),  # a transposed float32[4, 5] does not fit
], ids=["one-byte-past", "offset-rows", "spread-rows", "negative-stride", "negative-inner",
        "empty-past-end", "scalar", "transposed-outside"])
def test_view_outside_its_buffer(worker: WorkerServer, wire: Wire, assert_serves: Any,
                                 view: TensorRef, extent: str) -> None:
    assert_error(wire.call(Cmd.GET_TENSOR, p.GetTensor(tensor=view)), ErrorCode.OUT_OF_BOUNDS,
                 f"reaches bytes {extent} of a 64-byte buffer")
    payload = [bytes(view.nbytes)]
    assert_error(wire.call(Cmd.SET_TENSOR, p.SetTensor(tensor=view), payload),
                 ErrorCode.OUT_OF_BOUNDS, extent)
    assert_error(wire.call(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=view, value=1, offset=0,
                                                             size=-1)),
                 ErrorCode.OUT_OF_BOUNDS, extent)
    assert wire.get(tensor((16,))) == bytes(64)  # nothing was written
    assert_serves(worker.endpoint)


def test_views_just_inside_their_buffer(worker: WorkerServer, wire: Wire,
                                        assert_serves: Any) -> None:
    data = np.arange(16, dtype=np.float32)
    wire.set(tensor((16,)), data.tobytes())
    assert wire.get(tensor((15,), offset=4)) == data[1:].tobytes()  # ends exactly at byte 64
    assert wire.get(tensor((4,), (-4,), offset=12)) == data[3::-1].tobytes()
    assert wire.get(tensor((0, 3), offset=64)) == b""  # empty view at the very end
    assert wire.get(tensor((3,), (0,), offset=60)) == data[[15] * 3].tobytes()
    transposed = tensor((4, 4), (4, 16))  # float32[4, 4].T
    assert wire.get(transposed) == data.reshape(4, 4).T.tobytes()
    assert wire.get(tensor((4, 3), (4, 20), offset=8)) == np.lib.stride_tricks.as_strided(
        data[2:], (4, 3), (4, 20)).tobytes()  # a transposed float32[3, 5] ending at byte 64
    assert_error(wire.call(Cmd.GET_TENSOR, p.GetTensor(tensor=tensor((4, 3), (4, 20), offset=9))),
                 ErrorCode.OUT_OF_BOUNDS, "[9, 65)")
    assert_serves(worker.endpoint)


def test_payload_size_mismatch(worker: WorkerServer, wire: Wire, assert_serves: Any) -> None:
    for size in (0, 15, 17, 64):
        reply = wire.call(Cmd.SET_TENSOR, p.SetTensor(tensor=tensor((2, 2))), [bytes(size)])
        assert_error(reply, ErrorCode.SIZE_MISMATCH, f"payload of {size} bytes, tensor needs 16")
    assert_serves(worker.endpoint)


def test_get_tensor_past_the_end_of_a_valid_buffer(worker: WorkerServer, wire: Wire,
                                                   assert_serves: Any) -> None:
    # llama.cpp's rpc-server read past its buffer for such a request
    wire.set(tensor((16,)), np.arange(16, dtype=np.float32).tobytes())
    for view in (tensor((32,)), tensor((1,), offset=64), tensor((16,), offset=64 - 60),
                 tensor((1 << 20,)), tensor((2,), dtype=DType.FLOAT64, offset=56)):
        assert_error(wire.call(Cmd.GET_TENSOR, p.GetTensor(tensor=view)),
                     ErrorCode.OUT_OF_BOUNDS, "64-byte buffer")
    assert_serves(worker.endpoint)


def test_set_tensor_declaring_2_64_bytes(worker: WorkerServer, wire: Wire,
                                         assert_serves: Any) -> None:
    for shape in ([2**64 - 1], [2**61, 8], [2**32, 2**32]):
        reply = wire.call(Cmd.SET_TENSOR, [bytes(16)],
                          fields=[[1, int(U8), shape, [1] * len(shape), 0]])
        assert_error(reply, ErrorCode.BAD_REQUEST, "tensor")
    assert_serves(worker.endpoint)


# -------------------------------------------------------------------------------- handles


def test_unknown_and_freed_handles(worker: WorkerServer, wire: Wire, assert_serves: Any) -> None:
    requests: list[tuple[Cmd, p.Message, list[bytes]]] = [
        (Cmd.GET_TENSOR, p.GetTensor(tensor=tensor((4,), buffer=2)), []),
        (Cmd.SET_TENSOR, p.SetTensor(tensor=tensor((4,), buffer=2)), [bytes(16)]),
        (Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=tensor((4,), buffer=2), value=1, offset=0,
                                           size=-1), []),
        (Cmd.COPY_TENSOR, p.CopyTensor(src=tensor((4,)), dst=tensor((4,), buffer=2)), []),
        (Cmd.COPY_TENSOR, p.CopyTensor(src=tensor((4,), buffer=2), dst=tensor((4,))), []),
        (Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=2, value=0), []),
        (Cmd.FREE_BUFFER, p.BufferOp(handle=2), []),
    ]
    for cmd, msg, payload in requests:
        assert_error(wire.call(cmd, msg, payload), ErrorCode.INVALID_HANDLE,
                     "buffer 2 does not exist")
    wire.alloc(2, 16)
    wire.ok(Cmd.FREE_BUFFER, p.BufferOp(handle=2))
    for cmd, msg, payload in requests:
        assert_error(wire.call(cmd, msg, payload), ErrorCode.INVALID_HANDLE, "buffer 2")
    assert_error(wire.call(Cmd.GET_TENSOR, p.GetTensor(tensor=tensor((1,), buffer=p.MAX_HANDLE))),
                 ErrorCode.INVALID_HANDLE, str(p.MAX_HANDLE))
    assert_serves(worker.endpoint)


def test_another_sessions_handle(worker: WorkerServer, connect: Callable[..., Wire],
                                 assert_serves: Any) -> None:
    owner = connect(worker.endpoint)
    owner.alloc(5, 64)
    secret = np.arange(16, dtype=np.float32).tobytes()
    owner.set(tensor((16,), buffer=5), secret)

    thief = connect(worker.endpoint)
    view = tensor((16,), buffer=5)
    for cmd, msg, payload in [
        (Cmd.GET_TENSOR, p.GetTensor(tensor=view), []),
        (Cmd.SET_TENSOR, p.SetTensor(tensor=view), [bytes(64)]),
        (Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=view, value=0, offset=0, size=-1), []),
        (Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=5, value=0), []),
        (Cmd.FREE_BUFFER, p.BufferOp(handle=5), []),
    ]:
        assert_error(thief.call(cmd, msg, payload), ErrorCode.INVALID_HANDLE,
                     "buffer 5 does not exist in this session")
    thief.alloc(5, 64)  # the thief's own handle 5 is a different buffer
    assert thief.get(view) == bytes(64)
    thief.set(view, bytes(range(64)))
    assert owner.get(view) == secret
    assert_serves(worker.endpoint)


def test_duplicate_handle(worker: WorkerServer, wire: Wire, assert_serves: Any) -> None:
    wire.set(tensor((16,)), bytes(range(64)))
    assert_error(wire.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=32)),
                 ErrorCode.INVALID_HANDLE, "buffer handle 1 is in use")
    assert wire.get(tensor((16,))) == bytes(range(64))  # the first buffer is untouched
    assert_serves(worker.endpoint)


# --------------------------------------------------------------------------------- limits


def test_allocation_over_the_memory_limit(make_worker: Callable[..., WorkerServer],
                                          connect: Callable[..., Wire],
                                          assert_serves: Any) -> None:
    server = make_worker(memory_limit=1 << 20)
    first = connect(server.endpoint)
    first.alloc(1, 600_000)
    second = connect(server.endpoint)
    free = (1 << 20) - 600_000
    assert_error(second.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=free + 1)),
                 ErrorCode.OUT_OF_MEMORY, f"buffer of {free + 1} bytes does not fit",
                 f"{free} of {1 << 20} bytes free")
    assert_error(second.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=2, size=p.MAX_HANDLE)),
                 ErrorCode.OUT_OF_MEMORY, str(p.MAX_HANDLE))
    second.alloc(1, free)  # exactly what is left fits
    header, _ = second.ok(Cmd.DEVICE_MEMORY)
    assert header[2:] == [0, 1 << 20]
    second.ok(Cmd.FREE_BUFFER, p.BufferOp(handle=1))
    assert_serves(server.endpoint)


def test_allocation_over_the_max_buffer_size(make_worker: Callable[..., WorkerServer],
                                             connect: Callable[..., Wire],
                                             assert_serves: Any) -> None:
    server = make_worker(memory_limit=4 << 20, max_buffer_size=1 << 20)
    wire = connect(server.endpoint)
    assert wire.hello()[0][2 + 5] == 1 << 20  # HelloReply.max_buffer_size
    assert_error(wire.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=(1 << 20) + 1)),
                 ErrorCode.OUT_OF_MEMORY, f"buffer of {(1 << 20) + 1} bytes",
                 f"maximum buffer size {1 << 20}")
    wire.alloc(1, 1 << 20)
    assert_serves(server.endpoint)


# ------------------------------------------------------------------------ sessions, versions


def test_requests_before_hello(worker: WorkerServer, connect: Callable[..., Wire],
                               assert_serves: Any) -> None:
    wire = connect(worker.endpoint, hello=False)
    for cmd, msg in [(Cmd.PING, p.Empty()), (Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=8)),
                     (Cmd.GET_TENSOR, p.GetTensor(tensor=tensor((1,)))), (Cmd.GOODBYE, p.Empty())]:
        assert_error(wire.call(cmd, msg), ErrorCode.NO_SESSION, "HELLO first")
    assert wire.hello()[0][0] == OK
    wire.alloc(1, 8)
    assert_serves(worker.endpoint)


def test_hello_with_another_major(worker: WorkerServer, connect: Callable[..., Wire],
                                  assert_serves: Any) -> None:
    wire = connect(worker.endpoint, hello=False)
    for major in (0, p.PROTOCOL_VERSION[0] + 1, 2**32 - 1):
        assert_error(wire.hello(major), ErrorCode.VERSION_MISMATCH,
                     f"client speaks protocol {major}.0", "worker speaks {}.{}".format(*p.PROTOCOL_VERSION))
    assert_error(wire.call(Cmd.PING), ErrorCode.NO_SESSION)  # no session was opened
    assert wire.hello()[0][0] == OK
    wire.ok(Cmd.PING)
    assert_serves(worker.endpoint)


@contextmanager
def fake_worker(ctx: zmq.Context[zmq.Socket[bytes]], answer: Callable[[int], bytes]
                ) -> Iterator[str]:
    """A ROUTER thread that answers HELLO with ``answer(req_id)`` and every other request OK."""
    ready = threading.Event()
    stop = threading.Event()
    endpoint: list[str] = []

    def serve() -> None:
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.bind("tcp://127.0.0.1:*")
            endpoint.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            ready.set()
            while not stop.is_set():
                if not sock.poll(20):
                    continue
                ident, header, *_ = sock.recv_multipart()
                cmd, req_id = msgpack.unpackb(header)[:2]
                reply = answer(req_id) if cmd == Cmd.HELLO else p.encode_reply(req_id, p.Empty())
                sock.send_multipart([ident, reply])
        finally:
            ready.set()
            sock.close(linger=0)

    thread = threading.Thread(target=serve, name="fake-worker")
    thread.start()
    try:
        ready.wait(5)
        yield endpoint[0]
    finally:
        stop.set()
        thread.join(5)


def hello_reply(major: int) -> p.HelloReply:
    return p.HelloReply(major=major, minor=7, server="fake", devices=(), alignment=64,
                        max_buffer_size=1 << 20, max_message_size=1 << 20,
                        session_timeout_ms=30_000, capabilities=(), peer_endpoint="")


def test_client_refuses_a_worker_with_another_major(zmq_ctx: Any) -> None:
    def answer(req_id: int) -> bytes:
        return p.encode_reply(req_id, hello_reply(99))

    with fake_worker(zmq_ctx, answer) as endpoint, \
            pytest.raises(VersionMismatch, match=r"worker speaks protocol 99\.7"):
        Client(endpoint, connect_timeout=5, timeout=5)


def test_client_raises_version_mismatch_when_the_worker_refuses(zmq_ctx: Any) -> None:
    def answer(req_id: int) -> bytes:
        return p.encode_error(req_id, ErrorCode.VERSION_MISMATCH, "worker speaks 99.0")

    with fake_worker(zmq_ctx, answer) as endpoint, \
            pytest.raises(VersionMismatch, match="worker speaks 99.0") as info:
        Client(endpoint, connect_timeout=5, timeout=5)
    assert info.value.code == ErrorCode.VERSION_MISMATCH


# ---------------------------------------------------------------- transport-level abuse


@contextmanager
def monitored(sock: zmq.Socket[bytes]) -> Iterator[zmq.Socket[bytes]]:
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        yield monitor
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def test_message_over_max_message_size(make_worker: Callable[..., WorkerServer],
                                       connect: Callable[..., Wire],
                                       make_client: Callable[..., Client],
                                       assert_serves: Any) -> None:
    server = make_worker(max_message_size=1 << 20, memory_limit=64 << 20)
    wire = connect(server.endpoint)
    wire.alloc(1, 2 << 20)
    with monitored(wire.sock) as monitor:
        wire.send(Cmd.SET_TENSOR, p.SetTensor(tensor=tensor((2 << 20,), dtype=U8)),
                  [bytes(2 << 20)])
        assert monitor.poll(5000), "the worker did not drop the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    assert wire.no_reply(0.3)
    assert_serves(server.endpoint)

    client = make_client(server.endpoint)
    assert client.chunk_bytes < 1 << 20  # the client chunks below the worker's limit
    values = np.random.default_rng(1).standard_normal((1024, 2048)).astype(np.float32)  # 8 MiB
    t = client.alloc_buffer(values.nbytes).tensor(values.shape, "float32")
    client.set_tensor(t, values)
    np.testing.assert_array_equal(client.get_tensor(t), values)
    np.testing.assert_array_equal(client.get_tensor(t[::3, 1::2]), values[::3, 1::2])


@pytest.mark.timeout(60)
def test_client_vanishing_while_its_reply_is_sent(make_worker: Callable[..., WorkerServer],
                                                  connect: Callable[..., Wire],
                                                  assert_serves: Any) -> None:
    size = 64 << 20
    server = make_worker(memory_limit=512 << 20)
    for delay in (0.001, 0.005, 0.01, 0.02, 0.03):  # a 64 MiB reply takes ~50 ms on loopback
        wire = connect(server.endpoint)
        wire.alloc(1, size)
        wire.send(Cmd.GET_TENSOR, p.GetTensor(tensor=tensor((size,), dtype=U8)))
        time.sleep(delay)           # the subject: a close at each point of the reply's sending
        wire.sock.close(linger=0)
    assert_serves(server.endpoint)
    wire = connect(server.endpoint)  # the same big reply still reaches a client that stays
    wire.alloc(1, size)
    wire.ok(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=tensor((size,), dtype=U8), value=3,
                                              offset=size - 1, size=1))
    data = np.frombuffer(wire.get(tensor((size,), dtype=U8)), np.uint8)
    assert data.size == size and data[-1] == 3 and not data[:-1].any()


def test_client_that_never_reads_its_replies(worker: WorkerServer, wire: Wire,
                                            assert_serves: Any) -> None:
    view = p.GetTensor(tensor=tensor((16,)))
    for _ in range(1000):
        wire.send(Cmd.GET_TENSOR, view)
        wire.send(Cmd.PING)
    assert wire.sock.poll(10_000), "the worker never began answering"   # replies on their way
    wire.sock.close(linger=0)
    assert_serves(worker.endpoint)


def test_fuzzed_frames_never_kill_the_worker(make_worker: Callable[..., WorkerServer],
                                             connect: Callable[..., Wire],
                                             assert_serves: Any) -> None:
    server = make_worker(memory_limit=16 << 20)
    wire = connect(server.endpoint)
    wire.alloc(1, 64)
    templates = [
        [p.encode_request(Cmd.SET_TENSOR, 11, p.SetTensor(tensor=tensor((4, 2)))), bytes(32)],
        [p.encode_request(Cmd.GET_TENSOR, 12, p.GetTensor(tensor=tensor((2, 4), (4, 8))))],
        [p.encode_request(Cmd.MEMSET_TENSOR, 13, p.MemsetTensor(
            tensor=tensor((16,)), value=9, offset=4, size=8))],
        [p.encode_request(Cmd.COPY_TENSOR, 14, p.CopyTensor(
            src=tensor((8,)), dst=tensor((8,), offset=16)))],
        [p.encode_request(Cmd.ALLOC_BUFFER, 15, p.AllocBuffer(handle=2, size=100))],
        [p.encode_request(Cmd.CLEAR_BUFFER, 16, p.ClearBuffer(handle=1, value=3))],
        [p.encode_request(Cmd.FREE_BUFFER, 17, p.BufferOp(handle=2))],
        [p.encode_request(Cmd.HELLO, 18, p.Hello(major=1, minor=0, client="fuzz"))],
        [p.encode_request(Cmd.DEVICE_MEMORY, 19, p.Empty())],
    ]

    @st.composite
    def mutated(draw: st.DrawFn) -> list[bytes]:
        frames = [bytearray(f) for f in draw(st.sampled_from(templates))]
        for _ in range(draw(st.integers(0, 3))):
            frame = frames[draw(st.integers(0, len(frames) - 1))]
            if frame:
                frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
        if draw(st.booleans()):
            frames.append(bytearray(draw(st.binary(max_size=40))))
        if len(frames) > 1 and draw(st.booleans()):
            frames.pop()
        return [bytes(f) for f in frames]

    random_frames = st.lists(st.binary(max_size=64), min_size=1, max_size=4)
    schema_shaped = st.builds(
        lambda cmd, req_id, fields, payload: [msgpack.packb([cmd, req_id, *fields]), *payload],
        st.integers(0, 24), st.integers(0, 2**64 - 1),
        st.lists(st.integers(-3, 70) | st.lists(st.integers(-3, 70), max_size=5), max_size=5),
        st.lists(st.binary(max_size=32), max_size=2))

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(mutated() | random_frames | schema_shaped)
    def fuzz(frames: list[bytes]) -> None:
        try:
            header = msgpack.unpackb(frames[0])
        except Exception:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
            header = None
        oversize = len(frames[0]) > p.MAX_HEADER_BYTES
        parsable = (type(header) is list and len(header) >= 2 and type(header[0]) is int
                    and type(header[1]) is int and not oversize)
        wire.sock.send_multipart(frames)
        reply, _ = wire.recv(5.0)
        assert type(reply[0]) is int and type(reply[1]) is int, reply
        # a header refused whole (not msgpack, too big) is answered to the id its first two
        # items give, if they give one
        expected = (header[1] if parsable  # type: ignore[index]
                    else _leading_id(frames[0]) if header is None or oversize else 0)
        assert reply[1] == expected, (frames, reply)
        if reply[0] != OK:
            assert type(reply[2]) is str and reply[2]
        said_goodbye = parsable and reply[0] == OK and header[0] == Cmd.GOODBYE  # type: ignore
        if reply[0] == ErrorCode.NO_SESSION or said_goodbye:
            assert wire.hello()[0][0] == OK
            wire.alloc(1, 64)

    fuzz()
    assert wire.no_reply(0.3), "a request got more than one reply"
    wire.ok(Cmd.PING)
    assert_serves(server.endpoint)


# ------------------------------------------------------------------ memset / copy / clear


def test_memset_byte_range_outside_the_tensor(worker: WorkerServer, wire: Wire,
                                              assert_serves: Any) -> None:
    view = tensor((4,), offset=16)  # 16 bytes of the 64
    for offset, size, why in [(10, 8, "bytes [10, +8) are outside the tensor's 16 bytes"),
                              (17, 0, "offset 17 is past the tensor's 16 bytes"),
                              (17, -1, "offset 17"),
                              (0, 17, "outside"),
                              (1, p.MAX_HANDLE, "outside"),
                              (p.MAX_HANDLE, 1, "past the tensor")]:
        reply = wire.call(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=view, value=7, offset=offset,
                                                            size=size))
        assert_error(reply, ErrorCode.OUT_OF_BOUNDS, why)
    assert wire.get(tensor((64,), dtype=U8)) == bytes(64)
    wire.ok(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=view, value=7, offset=12, size=-1))
    wire.ok(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=view, value=5, offset=16, size=0))
    assert wire.get(tensor((64,), dtype=U8)) == bytes(28) + b"\x07" * 4 + bytes(32)
    assert_serves(worker.endpoint)


def test_memset_byte_range_on_a_non_contiguous_view(worker: WorkerServer, wire: Wire,
                                                    assert_serves: Any) -> None:
    strided = tensor((4, 2), (16, 4))
    reply = wire.call(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=strided, value=1, offset=4, size=8))
    assert_error(reply, ErrorCode.BAD_REQUEST, "contiguous")
    assert wire.get(tensor((64,), dtype=U8)) == bytes(64)
    wire.ok(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=strided, value=0xAB, offset=0, size=-1))
    expected = np.zeros((4, 16), np.uint8)
    expected[:, :8] = 0xAB
    assert wire.get(tensor((64,), dtype=U8)) == expected.tobytes()
    assert_serves(worker.endpoint)


def test_full_memset_of_a_strided_bool_view_sets_the_byte(wire: Wire) -> None:
    view = tensor((32,), (2,), dtype=DType.BOOL)
    wire.ok(Cmd.MEMSET_TENSOR, p.MemsetTensor(tensor=view, value=5, offset=0, size=-1))
    assert wire.get(tensor((64,), dtype=U8)) == b"\x05\x00" * 32


def test_copy_with_mismatched_shapes_or_dtypes(worker: WorkerServer, wire: Wire,
                                               assert_serves: Any) -> None:
    for src, dst, why in [
        (tensor((4,)), tensor((2, 2)), "(4,) float32 -> (2, 2) float32"),
        (tensor((4,)), tensor((5,)), "(4,) float32 -> (5,) float32"),
        (tensor((4,)), tensor((4,), dtype=DType.INT32), "(4,) float32 -> (4,) int32"),
        (tensor((8,), dtype=DType.FLOAT16), tensor((4,)), "float16 -> (4,) float32"),
    ]:
        assert_error(wire.call(Cmd.COPY_TENSOR, p.CopyTensor(src=src, dst=dst)),
                     ErrorCode.BAD_REQUEST, "copy needs equal shapes and dtypes", why)
    assert_error(wire.call(Cmd.COPY_TENSOR, p.CopyTensor(src=tensor((8,)),
                                                         dst=tensor((8,), offset=40))),
                 ErrorCode.OUT_OF_BOUNDS, "[40, 72)")
    assert wire.get(tensor((64,), dtype=U8)) == bytes(64)
    assert_serves(worker.endpoint)


@pytest.mark.parametrize("src,dst", [
    (np.s_[0:12], np.s_[1:13]), (np.s_[1:13], np.s_[0:12]), (np.s_[::-1], np.s_[:]),
    (np.s_[0:8], np.s_[8:0:-1]), (np.s_[::2], np.s_[1::2]), (np.s_[0:6], np.s_[2:14:2]),
], ids=["shift-up", "shift-down", "reverse", "reverse-shifted", "interleaved", "strided"])
def test_copy_between_overlapping_views(client: Client, src: Any, dst: Any) -> None:
    values = np.arange(16, dtype=np.float32) * 3 + 1
    t = client.alloc_buffer(64).tensor(16, "float32")
    client.set_tensor(t, values)
    client.copy_tensor(t[src], t[dst])
    expected = values.copy()
    expected[dst] = expected[src]  # numpy: as if through a temporary
    np.testing.assert_array_equal(client.get_tensor(t), expected)


def test_copy_between_overlapping_2d_views(client: Client) -> None:
    values = np.arange(36, dtype=np.float32).reshape(6, 6)
    t = client.alloc_buffer(values.nbytes).tensor((6, 6), "float32")
    client.set_tensor(t, values)
    client.copy_tensor(t[:4, :4].T, t[1:5, 2:6])
    expected = values.copy()
    expected[1:5, 2:6] = expected[:4, :4].T
    np.testing.assert_array_equal(client.get_tensor(t), expected)


def test_clear_buffer_validation(worker: WorkerServer, wire: Wire, assert_serves: Any) -> None:
    assert_error(wire.call(Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=9, value=1)),
                 ErrorCode.INVALID_HANDLE, "buffer 9")
    for value in (256, -1, True):
        assert_error(wire.call(Cmd.CLEAR_BUFFER, fields=[1, value]), ErrorCode.BAD_REQUEST,
                     "field 'value'")
    assert wire.get(tensor((64,), dtype=U8)) == bytes(64)
    wire.ok(Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=1, value=0xFE))
    assert wire.get(tensor((64,), dtype=U8)) == b"\xfe" * 64
    assert_serves(worker.endpoint)


def test_broadcast_view_cannot_blow_up_the_worker(make_worker: Callable[..., WorkerServer],
                                                  connect: Callable[..., Wire]) -> None:
    server = make_worker(memory_limit=1 << 20)
    wire = connect(server.endpoint)
    wire.alloc(1, 64)
    huge = tensor((64 << 20,), (0,), dtype=U8)  # 64 MiB of one byte, from a 1 MiB worker
    header, frames = wire.call(Cmd.GET_TENSOR, p.GetTensor(tensor=huge))
    assert header[0] != OK, f"the worker sent {len(frames[0])} bytes for a 64-byte buffer"


# ------------------------------------------------------------ fuzz findings (issue 13), regressions


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def raw_graph(tensors: list[TensorRef], nodes: list[list[Any]]) -> list[Any]:
    return [1, [t.to_wire() for t in tensors], nodes]


def compute_fields(graph: Any, fetch: list[TensorRef] = ()) -> list[Any]:  # type: ignore[assignment]
    return [graph, [], [t.to_wire() for t in fetch]]


def test_deeply_nested_values_get_bad_request_without_hello(
        worker: WorkerServer, connect: Callable[..., Wire], assert_serves: Any) -> None:
    """A 990-deep list where a dtype goes used to make ``repr`` raise RecursionError in the
    decoder and end the backend thread: nobody was answered again."""
    wire = connect(worker.endpoint, hello=False)
    bomb = nested(990)
    header, _ = wire.call(Cmd.GET_TENSOR, fields=[[1, bomb, [4], [4], 0]])
    assert header[0] == ErrorCode.BAD_REQUEST and "a list of 1 items" in header[2], header
    for cmd in (Cmd.HELLO, Cmd.ALLOC_BUFFER, Cmd.GRAPH_COMPUTE, Cmd.PEER_SEND, 99):
        for at in range(3):
            fields: list[Any] = [1, 2, 3]
            fields[at] = bomb
            header, _ = wire.call(cmd, fields=fields)
            assert header[0] != OK and len(header[2]) < 400, header
    assert_serves(worker.endpoint)


@pytest.mark.parametrize("where", ["version", "op", "dst", "params", "srcs"])
def test_deeply_nested_graph_values_are_graph_invalid(wire: Wire, worker: WorkerServer,
                                                      assert_serves: Any, where: str) -> None:
    bomb = nested(990)
    node: list[Any] = ["neg", [-1], {}, -1]
    graph = raw_graph([tensor((4,))], [node])
    if where == "version":
        graph[0] = bomb
    else:
        node[["op", "srcs", "params", "dst"].index(where)] = (
            {"x": bomb} if where == "params" else bomb)
    header, _ = wire.call(Cmd.GRAPH_COMPUTE, fields=compute_fields(graph))
    assert header[0] in (ErrorCode.GRAPH_INVALID, ErrorCode.BAD_REQUEST), header
    assert_serves(worker.endpoint)


def test_zero_stride_view_naming_2_39_elements_is_refused_before_running(
        wire: Wire, worker: WorkerServer, assert_serves: Any) -> None:
    """A view of a 4-byte input with strides 0 passes every bounds check yet names 2**39
    elements; summing it held the backend thread for minutes."""
    nodes = [["view", [-1], {"shape": [1 << 20, 1 << 19], "strides": [0, 0]}, -1],
             ["sum", [0], {"axis": [0, 1]}, -1]]
    started = time.monotonic()
    header, _ = wire.call(Cmd.GRAPH_COMPUTE, fields=compute_fields(
        raw_graph([tensor((1,))], nodes)))
    assert_error((header, []), ErrorCode.GRAPH_INVALID, "element-ops", "--max-graph-work")
    assert time.monotonic() - started < 5
    assert_serves(worker.endpoint)


def test_argmax_over_a_repeated_view_is_charged_to_memory(
        make_worker: Callable[..., WorkerServer], connect: Callable[..., Wire],
        assert_serves: Any) -> None:
    """numpy copies a strided input before argmax: 2**30 repeated floats would be 4 GiB outside
    ``--mem``. The worst-case temporary is charged with the arena, so it does not fit."""
    server = make_worker(memory_limit=64 << 20)
    wire = connect(server.endpoint)
    wire.alloc(1, 64)
    nodes = [["view", [-1], {"shape": [1 << 15, 1 << 15], "strides": [0, 4]}, -1],
             ["argmax", [0], {}, -1]]
    graph = raw_graph([tensor((1 << 15,), (0,))], nodes)
    header, _ = wire.call(Cmd.GRAPH_COMPUTE, fields=compute_fields(graph))
    assert header[0] in (ErrorCode.OUT_OF_MEMORY, ErrorCode.GRAPH_INVALID), header
    assert_serves(server.endpoint)


def test_a_long_chain_of_views_plans_in_linear_time(wire: Wire, worker: WorkerServer,
                                                    assert_serves: Any) -> None:
    """Each node used to walk its view chain back to the root: 60,000 transposes took minutes
    (O(N**2)). A graph now has at most MAX_NODES; the test's timeout is the bound."""
    n = MAX_NODES - 1
    nodes: list[list[Any]] = [["transpose", [-1 if i == 0 else i - 1], {}, -1] for i in range(n)]
    nodes.append(["neg", [n - 1], {}, 1])
    graph = raw_graph([tensor((2, 8)), tensor((8, 2), offset=0, buffer=1)], nodes)
    header, _ = wire.call(Cmd.GRAPH_COMPUTE, fields=compute_fields(graph), )
    assert header[0] in (OK, ErrorCode.GRAPH_INVALID), header
    assert_serves(worker.endpoint)


def test_get_rows_index_through_a_thousand_views(wire: Wire) -> None:
    """Index values are checked through their views before the run: this recursed once per
    view (RecursionError, INTERNAL) and now walks the chain."""
    wire.alloc(2, 256)
    table = tensor((4, 4), buffer=2)
    idx = tensor((2,), dtype=DType.INT32, buffer=1)
    wire.set(table, np.arange(16, dtype=np.float32).tobytes())
    wire.set(idx, np.array([3, 1], np.int32).tobytes())
    nodes: list[list[Any]] = [["reshape", [-2 if i == 0 else i - 1], {"shape": [2]}, -1]
                              for i in range(1000)]
    nodes.append(["get_rows", [-1, 999], {}, -1])
    out = tensor((2, 4), buffer=2, offset=128)
    graph = raw_graph([table, idx], nodes)
    header, frames = wire.call(Cmd.GRAPH_COMPUTE, fields=[graph, [], [out.to_wire()]])
    assert header[0] == OK, header
    nodes[-1] = ["get_rows", [-1, 999], {}, -1]
    wire.set(idx, np.array([3, 9], np.int32).tobytes())
    header, _ = wire.call(Cmd.GRAPH_COMPUTE, fields=compute_fields(graph))
    assert_error((header, []), ErrorCode.GRAPH_FAILED, "index 9 is out of range")


def test_a_send_awaiting_its_acknowledgement_is_answered_at_goodbye(
        worker: WorkerServer, wire: Wire, raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """A PEER_SEND whose receiver never acknowledges was left unanswered when its session said
    GOODBYE (only queued requests were failed)."""
    silent = raw_socket(zmq.PULL)        # a peer that answers the probe, never the transfer
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    probe_id = wire.send(Cmd.PEER_PROBE, fields=[f"tcp://127.0.0.1:{port}", 5000])
    assert silent.poll(5000), "the worker never probed"
    probe = peer_wire.decode_peer(silent.recv_multipart())
    answer = raw_socket(zmq.PUSH)
    answer.connect(probe.reply_to)
    answer.send(peer_wire.encode_peer(peer_wire.Ack(probe.token, True, "probe")))
    assert wire.recv()[0][1] == probe_id
    send_id = wire.send(Cmd.PEER_SEND, fields=[b"t" * 16, tensor((4,)).to_wire(),
                                                f"tcp://127.0.0.1:{port}", 60_000])
    assert silent.poll(5000), "the worker never pushed"
    bye_id = wire.send(Cmd.GOODBYE)
    replies = {}
    for _ in range(2):
        header, _ = wire.recv()
        replies[header[1]] = header
    assert replies[bye_id][0] == OK
    assert replies[send_id][0] == ErrorCode.NO_SESSION, replies[send_id]
    assert "before this transfer finished" in replies[send_id][2]


@pytest.mark.parametrize("routing_id", [None, b"\x00victim-id-0123456789", b"short-id"])
def test_sessions_need_an_unguessable_client_chosen_id(
        worker: WorkerServer, zmq_ctx: zmq.Context[zmq.Socket[bytes]],
        assert_serves: Any, routing_id: bytes | None) -> None:
    """Sessions are keyed by routing id. A client that set none got libzmq's 0x00 + a counter,
    the same sequence in every worker process: after it left, another connection naming that
    id read its buffers without HELLO. Such ids (and short ones) now get no session at all."""
    sock = zmq_ctx.socket(zmq.DEALER)
    try:
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.connect(worker.endpoint)
        wire = Wire(sock)
        assert_error(wire.hello(), ErrorCode.BAD_REQUEST, "ZMQ_ROUTING_ID", "16 random bytes")
        assert_error(wire.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=64)),
                     ErrorCode.NO_SESSION)
    finally:
        sock.close(linger=0)
    assert_serves(worker.endpoint)


@pytest.mark.parametrize("minor", [0, 5, 6, 99])
def test_device_details_only_for_clients_that_know_them(worker: WorkerServer,
                                                        connect: Callable[..., Wire],
                                                        minor: int) -> None:
    """HELLO's and STATUS's device_details (1.6) reach a client whose HELLO said 1.6 or later;
    an older one gets the replies it decodes, field for field."""
    wire = connect(worker.endpoint, hello=False)
    hello_header, _ = wire.call(Cmd.HELLO, p.Hello(major=1, minor=minor, client="raw-test"))
    status_header, _ = wire.call(Cmd.STATUS)
    hello = p.decode_reply(Cmd.HELLO, hello_header)
    status = p.decode_reply(Cmd.STATUS, status_header)
    assert isinstance(hello, p.HelloReply) and isinstance(status, p.StatusReply)
    if minor < 6:                                       # what a 1.5 client decodes
        assert len(hello_header) == 2 + [f.name for f in fields(p.HelloReply)].index("timing")
        assert hello.device_details == () and status.device_details == ()
        return
    detail = p.DeviceDetail(index=0, memory=physical_memory(), compute_capability="")
    assert hello.device_details == (detail,) and status.device_details == (detail,)
