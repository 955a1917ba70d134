"""Signed sessions (protocol 1.10, ``request-mac``; broker/request_mac.py, issue 24 #7).

The attacker's path with real processes and default client settings: a client that vanished
without GOODBYE (SIGKILL) leaves a session that a raw DEALER presenting its routing id (read in
the clear on a plain link) can neither read, free nor re-open; a client whose connection drops
and comes back keeps its session, while a stranger who took its routing id meanwhile got
nothing. Then the pieces: the trailer's bytes, replays, raw clients that skip the exchange.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import WorkerProcess
from test_identity import Keys, _curve_dealer
from waiting import wait_until
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.errors import ConnectionLost, NotAuthentic
from zmq_rpc.broker.protocol import Cmd, ErrorCode
from zmq_rpc.broker.request_mac import Signer, Verifier, derive, new_exchange
from zmq_rpc.client import Client

pytestmark = pytest.mark.timeout(120)

SECRET = np.arange(1024, dtype=np.float32) * 3.5

VICTIM = """
import sys
import numpy as np
from zmq_rpc.client import Client
keys = {"curve_key": sys.argv[2], "server_key": sys.argv[3]} if len(sys.argv) > 2 else {}
client = Client(sys.argv[1], **keys)               # default settings
buf = client.alloc_buffer(4096)
client.set_tensor(buf.tensor(1024), np.arange(1024, dtype=np.float32) * 3.5)
print(client.connection.options.identity.hex(), buf.handle, flush=True)
sys.stdin.readline()                               # until it is killed
"""


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
            routing_id: bytes) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


def _take_over(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, routing_id: bytes,
               frames: list[bytes], within: float = 20.0) -> tuple[zmq.Socket[bytes], list[Any]]:
    """Connect with ``routing_id`` until the worker lets us have it (its ROUTER refuses the id
    while the old connection is still known), sending ``frames``; the socket and the reply."""
    deadline = time.monotonic() + within
    while True:
        sock = _dealer(ctx, endpoint, routing_id)
        sock.send_multipart(frames)
        if sock.poll(300):
            return sock, p.unpack_header(sock.recv_multipart()[0])
        sock.close(linger=0)
        assert time.monotonic() < deadline, "the worker never took the routing id"


def _ask(sock: zmq.Socket[bytes], frames: list[bytes]) -> list[Any]:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "no reply"
    return p.unpack_header(sock.recv_multipart()[0])


def _attacks(handle: int) -> list[tuple[str, list[bytes]]]:
    """What a stranger holding a session's routing id tries: read, free, re-open, close."""
    major, minor = p.PROTOCOL_VERSION
    tensor = p.TensorRef(buffer=handle, dtype=p.DType.FLOAT32, shape=(1024,), strides=(4,),
                         offset=0)
    return [
        ("read", [p.encode_request(Cmd.GET_TENSOR, 7, p.GetTensor(tensor=tensor))]),
        ("free", [p.encode_request(Cmd.FREE_BUFFER, 8, p.BufferOp(handle=handle))]),
        ("hello, a new exchange", [p.encode_request(Cmd.HELLO, 9, p.Hello(
            major=major, minor=minor, client="x", exchange=new_exchange()[0]))]),
        ("hello, none", [p.encode_request(Cmd.HELLO, 10, p.Hello(major=major, minor=minor,
                                                                 client="x"))]),
        ("goodbye", [p.encode_request(Cmd.GOODBYE, 11, p.Empty())]),
    ]


def _session(status: p.StatusReply, routing_id: bytes) -> p.SessionInfo:
    found = [s for s in status.session_list if s.client_id == routing_id[:4].hex()]
    assert len(found) == 1, f"the session is gone: {status.session_list}"
    return found[0]


def _vanish(*args: str) -> tuple[bytes, int]:
    """Run a victim client (``args``: endpoint, then its key files) until it has filled a
    buffer, then SIGKILL it: gone without GOODBYE. Its routing id and buffer handle."""
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None
        rid_hex, handle = victim.stdout.readline().split()
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
        for stream in (victim.stdin, victim.stdout):
            if stream is not None:
                stream.close()
    return bytes.fromhex(rid_hex), int(handle)


def test_a_vanished_clients_session_cannot_be_read_freed_or_reopened(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client],
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    proc = spawn_worker("--session-timeout", "60")
    rid, handle = _vanish(proc.endpoint)
    attacks = _attacks(handle)
    sock, header = _take_over(ctx, proc.endpoint, rid, attacks[0][1])
    assert header[0] == ErrorCode.NOT_AUTHENTIC, f"read: {header}"
    assert header[1] == 7 and "signature" in header[2]
    for what, frames in attacks[1:]:
        header = _ask(sock, frames)
        assert header[0] == ErrorCode.NOT_AUTHENTIC, f"{what}: {header}"
    sock.close(linger=0)
    session = _session(make_client(proc.endpoint).status(), rid)
    assert (session.buffers, session.memory) == (1, 4096)       # untouched


def test_under_curve_another_authorized_key_cannot_use_a_vanished_clients_session(
        spawn_worker: Callable[..., WorkerProcess], tmp_path: Path,
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    keys = Keys(tmp_path)
    proc = spawn_worker(*keys.worker_args(), "--session-timeout", "60")
    rid, handle = _vanish(proc.endpoint, keys.secret("good"), keys.worker.public.decode())
    attacks = _attacks(handle)
    frames = attacks[0][1]
    deadline = time.monotonic() + 20
    while True:                  # the other key, the routing id it learnt, until it is let in
        sock = _curve_dealer(ctx, keys, "greedy", rid, proc.endpoint)
        sock.send_multipart(frames)
        if sock.poll(300):
            break
        sock.close(linger=0)
        assert time.monotonic() < deadline, "the worker never took the routing id"
    header = p.unpack_header(sock.recv_multipart()[0])
    assert header[0] == ErrorCode.NOT_AUTHENTIC, f"read: {header}"
    for what, frames in attacks[1:]:
        assert _ask(sock, frames)[0] == ErrorCode.NOT_AUTHENTIC, what
    sock.close(linger=0)


class Proxy:
    """A TCP relay to a worker that the test cuts (every connection closed, new ones refused)
    and restores: a network blip between one client and the worker."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = threading.Event()
        self.open.set()
        self.links: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                conn.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.links += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_relay, args=(a, b), daemon=True).start()

    def cut(self) -> None:
        self.open.clear()
        with self.lock:
            links, self.links = self.links, []
        for link in links:
            _close(link)

    def restore(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def _relay(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _pings(client: Client) -> bool:
    try:
        client.ping()
    except ConnectionLost:
        return False
    return True


def test_a_client_keeps_its_session_across_a_reconnect_and_a_stranger_gets_nothing(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client],
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    proc = spawn_worker("--session-timeout", "60")
    proxy = Proxy(proc.endpoint)
    try:
        client = make_client(proxy.endpoint)                   # default settings
        buf = client.alloc_buffer(4096)
        client.set_tensor(buf.tensor(1024), SECRET)
        rid = client.connection.options.identity
        proxy.cut()
        wait_until(lambda: not _pings(client), 15, "the client saw its connection drop")
        attacks = _attacks(buf.handle)
        sock, header = _take_over(ctx, proc.endpoint, rid, attacks[0][1])
        assert header[0] == ErrorCode.NOT_AUTHENTIC, f"read: {header}"
        for what, frames in attacks[1:]:
            assert _ask(sock, frames)[0] == ErrorCode.NOT_AUTHENTIC, what
        sock.close(linger=0)                                   # the stranger leaves
        proxy.restore()
        wait_until(lambda: _pings(client), 20, "the client reconnected")
        np.testing.assert_array_equal(client.get_tensor(buf.tensor(1024)), SECRET)
        client.free_buffer(buf)                                # its own requests still count
    finally:
        proxy.close()


# ------------------------------------------------------------------------------ the pieces


def test_the_trailer_is_a_msgpack_bin_after_the_header() -> None:
    signer = Signer(bytes(32))
    header = p.encode_request(Cmd.PING, 5, p.Empty())
    signed = signer.sign(header)
    assert signed[:len(header)] == header
    assert signed[len(header):len(header) + 10].hex() == "c418" + "0000000000000001"
    assert len(signed) == len(header) + 26
    assert signer.sign(header)[len(header) + 2:len(header) + 10] == (2).to_bytes(8, "big")


def test_a_verifier_refuses_a_replay_a_forgery_and_a_missing_signature() -> None:
    key = os.urandom(32)
    signer, verifier = Signer(key), Verifier(key)
    header = p.encode_request(Cmd.FREE_BUFFER, 3, p.BufferOp(handle=1))
    first, second = signer.sign(header), signer.sign(header)
    assert bytes(verifier.open(memoryview(second))) == header          # a gap is fine
    assert "replayed" in verifier.open(memoryview(first))               # an older one is not
    assert "replayed" in verifier.open(memoryview(second))
    assert "wrong" in verifier.open(memoryview(Signer(os.urandom(32)).sign(header)))
    forged = bytearray(signer.sign(header))
    forged[len(header) - 1] ^= 1                                       # another handle
    assert "wrong" in verifier.open(memoryview(bytes(forged)))
    assert "no signature" in verifier.open(memoryview(header))
    assert bytes(verifier.open(memoryview(signer.sign(header)))) == header


def test_both_sides_derive_the_same_key_and_a_low_order_point_is_refused() -> None:
    (cpub, csec), (wpub, wsec) = new_exchange(), new_exchange()
    rid = b"r" * 16
    assert derive(csec, wpub, rid, cpub, wpub) == derive(wsec, cpub, rid, cpub, wpub)
    assert derive(csec, wpub, b"s" * 16, cpub, wpub) != derive(wsec, cpub, rid, cpub, wpub)
    assert derive(wsec, bytes(32), rid, bytes(32), wpub) is None
    assert derive(wsec, b"short", rid, b"short", wpub) is None


def test_a_signed_request_after_the_session_expired_gets_no_session_under_its_id(
        make_worker: Callable[..., Any], make_client: Callable[..., Client],
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    worker = make_worker(memory_limit=64 << 20)
    client = make_client(worker.endpoint)
    rid = client.connection.options.identity
    client.close()               # GOODBYE (best effort: sent, not waited for)
    observer = make_client(worker.endpoint)
    # Until the worker has freed it, the session still exists (a stranger's PING would be
    # NOT_AUTHENTIC), and GOODBYE's own reply could reach a new socket under the same id.
    wait_until(lambda: observer.status().sessions == 0, 10, "the closed client's session freed")
    sock = _dealer(ctx, worker.endpoint, rid)
    header = _ask(sock, [Signer(bytes(32)).sign(p.encode_request(Cmd.PING, 42, p.Empty()))])
    assert header[:2] == [ErrorCode.NO_SESSION, 42]
    sock.close(linger=0)


def test_a_raw_client_without_the_exchange_is_served_unsigned_as_before(
        make_worker: Callable[..., Any], ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    worker = make_worker(memory_limit=64 << 20)
    sock = _dealer(ctx, worker.endpoint, b"r" + os.urandom(15))
    major, minor = p.PROTOCOL_VERSION
    hello = _ask(sock, [p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor,
                                                               client="raw"))])
    assert hello[0] == p.STATUS_OK
    assert p.decode_reply(Cmd.HELLO, hello).exchange == b""            # type: ignore[union-attr]
    assert _ask(sock, [p.encode_request(Cmd.PING, 2, p.Empty())])[:2] == [p.STATUS_OK, 2]
    sock.close(linger=0)


def test_our_client_signs_every_path_and_a_wrong_signature_raises_not_authentic(
        make_worker: Callable[..., Any], make_client: Callable[..., Client]) -> None:
    worker = make_worker(memory_limit=64 << 20)
    client = make_client(worker.endpoint, trace=True)    # a second HELLO, signed
    assert "request-mac" in client.info.capabilities and len(client.info.exchange) == 32
    buf = client.alloc_buffer(4096)                        # the synchronous course
    futures = [client.ping_async() for _ in range(600)]    # the I/O thread, past the window
    client.set_tensor(buf.tensor(1024), SECRET)
    assert all(f.result() is None for f in futures)
    client.ping()                                          # the short course
    np.testing.assert_array_equal(client.get_tensor(buf.tensor(1024)), SECRET)
    client.connection.sign_from_now(bytes(32))                # as if another client signed
    with pytest.raises(NotAuthentic, match="wrong request signature"):
        client.ping()
