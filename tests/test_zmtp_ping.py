"""A ZMTP PING that reaches a connection whose input an HWM stopped, then a reset: libzmq 4.3.5
aborts the receiving process (``Assertion failed: !_io_error (stream_engine_base.cpp:310)``;
``zmtp_engine_t::process_heartbeat_message`` calls ``out_event`` on a connection already in
error). The worker's ROUTER and peer PULL both receive, both stop their input at an HWM, so
nothing of ours may send them a PING in a state that can meet this: peer links carry no ZMTP
heartbeat (TCP keepalive instead), and a client's ROUTER pipe holds more requests
than our client ever has in flight. A stranger speaking raw ZMTP still can: that is libzmq's bug
(docs/SECURITY.md, not protected), and the strict xfail below says when libzmq fixes it."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

import pytest
import zmq
from conftest import WorkerProcess
from zmq_rpc.broker.broker import CLIENT_RCVHWM
from zmq_rpc.client import Client, Graph, RegisteredGraph
from zmq_rpc.client.options import ConnectionOptions
from zmq_rpc.worker.peer.endpoints import PeerSecurity
from zmq_rpc.worker.peer.push import PushLinks

pytestmark = pytest.mark.timeout(60)

PING = bytes([0x04, 7]) + b"\x04PING\x00\x00"
"""A ZMTP 3.1 PING command: short command frame, name, TTL 0, no context."""


def greeting() -> bytes:
    """A ZMTP 3.0 greeting with the NULL mechanism, as a client."""
    return b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


def ready(socket_type: bytes) -> bytes:
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes([0x04, len(body)]) + body


def frame(body: bytes, more: bool = False) -> bytes:
    return bytes([0x01 if more else 0x00, len(body)]) + body


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed during the ZMTP handshake"
        data += chunk
    return data


def commands_heard(listener: socket.socket, seconds: float) -> list[bytes]:
    """Accept one ZMTP connection as a PULL, then return the names of the commands it sends
    within ``seconds`` (after its READY)."""
    conn, _ = listener.accept()
    with conn:
        conn.sendall(greeting())
        read_exactly(conn, 64)
        conn.sendall(ready(b"PULL"))
        names: list[bytes] = []
        conn.settimeout(0.1)
        stream = b""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                data = conn.recv(4096)
            except TimeoutError:
                continue
            if not data:
                break
            stream += data
            while len(stream) >= 2:
                flags, size = stream[0], stream[1]
                if flags & 0x02:                       # long frames: none expected here
                    raise AssertionError(f"unexpected long frame {stream[:16]!r}")
                if len(stream) < 2 + size:
                    break
                body, stream = stream[2:2 + size], stream[2 + size:]
                if flags & 0x04:
                    names.append(body[1:1 + body[0]])
        return names


def test_a_peer_link_sends_no_zmtp_heartbeat() -> None:
    """A worker's link to another worker's peer port, idle for 2.5 s, sends READY and nothing
    else (with ZMTP heartbeats it sent a PING every second)."""
    listener = socket.create_server(("127.0.0.1", 0))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    links = PushLinks(ctx, PeerSecurity())
    try:
        links.get(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        assert commands_heard(listener, 2.5) == [b"READY"]
    finally:
        links.close()
        ctx.term()
        listener.close()


def test_a_client_never_queues_enough_to_stop_the_routers_input() -> None:
    """Our client pings (ZMTP, every 0.5 s); the worker's ROUTER stops a connection's input only
    once its pipe holds CLIENT_RCVHWM requests, more than our client keeps in flight (its
    heartbeat calls included), so our pings never meet a stopped connection."""
    assert CLIENT_RCVHWM > ConnectionOptions().window + 8


def slow_graph(client: Client) -> RegisteredGraph:
    """A registered graph of 100 4 MiB adds (tens of ms a run), run once."""
    x = client.alloc_buffer(4 << 20).tensor((1 << 20,), "float32")
    g = Graph()
    y = x
    for _ in range(100):
        y = g.add(y, x)
    g.scale(y, 0.5, out=x)
    handle = client.register(g)
    client.run(handle)
    return handle


def reset_after(port: int, burst: bytes, socket_type: bytes) -> None:
    """Connect, handshake, send ``burst`` and close with a TCP reset."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(greeting())
        read_exactly(sock, 64)
        sock.sendall(ready(socket_type))
        sock.sendall(burst)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@pytest.mark.xfail(strict=True, reason="libzmq 4.3.5 aborts on a PING decoded after a reset "
                   "on a connection whose input an HWM stopped (zeromq/libzmq#4364)")
@pytest.mark.parametrize("port", ["client", "peer"])
def test_a_raw_zmtp_stranger_with_pings_cannot_abort_the_worker(
        spawn_worker: Callable[..., WorkerProcess], port: str) -> None:
    worker = spawn_worker()
    busy = Client(worker.endpoint)
    slow = slow_graph(busy)
    peer = busy.info.peer_endpoint
    endpoint = worker.endpoint if port == "client" else peer
    target = int(endpoint.rsplit(":", 1)[1])
    messages = (frame(b"h" * 20, more=True) + frame(b"x" * 20) if port == "client"
                else frame(b"x" * 20))
    count = 40 * CLIENT_RCVHWM if port == "client" else 5000      # past every queue before it
    burst = b"".join(messages + (PING if i % 3 == 2 else b"") for i in range(count))
    for _ in range(20):
        if worker.proc.poll() is not None:
            break
        runs = [busy.run_async(slow) for _ in range(3)]   # the backend reads nothing meanwhile
        try:
            reset_after(target, burst, b"DEALER" if port == "client" else b"PUSH")
        except OSError:
            break                                  # refused or reset: the worker is gone
        for run in runs:
            run.exception()
    busy.close()
    assert worker.proc.poll() is None, "the worker aborted"
    with Client(worker.endpoint) as client:
        client.ping()
