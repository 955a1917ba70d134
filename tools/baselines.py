"""Raw baselines for ``zmq-rpc-bench``: the same work done with bare pyzmq and bare TCP sockets.

Two halves, used from two processes so that client and server never share a GIL (as with our
workers):

- **Servers** (``python -m zmq_rpc.tools.baselines echo|bulk-zmq|bulk-tcp --bind tcp://127.0.0.1:*``):
  one single-threaded loop each, in its own subprocess; the first stdout line is
  ``baseline KIND listening on ENDPOINT``; SIGTERM/SIGINT stop it cleanly (sockets closed, exit 0).
- **Client helpers** (:func:`echo_once`, :func:`echo_pipelined`, :class:`ZmqBulk`, :class:`TcpBulk`,
  and :class:`ProtocolDealer`, a bare DEALER speaking our protocol to a worker),
  called from the benchmark's main thread; :class:`~zmq_rpc.worker.launch.ServerProcess` spawns
  and stops any such server (workers included).

Bulk wire formats (all integers little-endian):

- ``bulk-zmq`` (DEALER -> ROUTER): every message is ``[head, payload?]`` with
  ``head = (op: 1 byte, total: u64, offset: u64, chunk: u64)``. ``S`` carries bytes
  ``[offset, offset+len)`` of an upload, landed in one preallocated array; the chunk that ends at
  ``total`` is acknowledged with ``b"k"``. ``G`` asks for ``total`` bytes sent back as ``G`` messages
  of at most ``chunk`` bytes (zero-copy from a preallocated array).
- ``bulk-tcp`` (one thread per connection): a request is ``(op: 1 byte, total: u64)``; ``S`` is followed by ``total`` bytes
  (``recv_into`` the preallocated array) and answered with ``b"k"``; ``G`` is answered with
  ``total`` bytes (``sendall`` of a memoryview).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import zmq

if TYPE_CHECKING:
    from ..broker.protocol import Cmd, Message

from ..broker.keys import KeyPair, load_keypair
from ..worker.launch import LISTENING

ZmqSocket = zmq.Socket[bytes]
ZmqContext = zmq.Context[zmq.Socket[bytes]]

HEAD = struct.Struct("<cQQQ")
"""bulk-zmq message head: op, total bytes, offset, chunk size."""
TCP_HEAD = struct.Struct("<cQ")
"""bulk-tcp request head: op, total bytes."""
ACK = b"k"


# ----------------------------------------------------------------------------------- servers


class ArrayStore:
    """One preallocated, already-touched byte array, grown when a larger transfer asks for it."""

    def __init__(self) -> None:
        self.array = np.ones(0, dtype=np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the store (allocated and touched once per new maximum)."""
        if nbytes > self.array.size:
            self.array = np.ones(nbytes, dtype=np.uint8)  # ones: every page faulted in now
        return self.array[:nbytes]


def serve_echo(sock: ZmqSocket) -> None:
    """ROUTER echo: send every message straight back to its sender."""
    while True:
        sock.send_multipart(sock.recv_multipart())


def serve_bulk_zmq(sock: ZmqSocket) -> None:
    """ROUTER bulk server: land ``S`` chunks in place, answer ``G`` with zero-copy chunks."""
    store = ArrayStore()
    while True:
        ident, head, *payload = sock.recv_multipart(copy=False)
        op, total, offset, chunk = HEAD.unpack(head.bytes)
        if op == b"S":
            data = payload[0].buffer
            store.take(total)[offset:offset + len(data)] = np.frombuffer(data, np.uint8)
            if offset + len(data) == total:
                sock.send_multipart([ident, ACK])
        elif op == b"G":
            _send_chunks(sock, ident, store.take(total).data, chunk)


def _send_chunks(sock: ZmqSocket, ident: zmq.Frame, source: memoryview, chunk: int) -> None:
    total = source.nbytes
    for offset in range(0, max(total, 1), chunk):
        piece = source[offset:offset + chunk]
        sock.send_multipart([ident, HEAD.pack(b"G", total, offset, chunk), piece], copy=False)


def serve_bulk_tcp(server: socket.socket) -> None:
    """Accept connections, each served by its own thread with its own preallocated array."""
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve_tcp_connection, args=(conn,), daemon=True).start()


def _serve_tcp_connection(conn: socket.socket) -> None:
    """``S`` lands in a preallocated array, ``G`` streams one back, until the client hangs up."""
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        store = ArrayStore()
        while _serve_tcp_request(conn, store):
            pass


def _serve_tcp_request(conn: socket.socket, store: ArrayStore) -> bool:
    """One request; False at the end of the stream."""
    head = recv_exact(conn, TCP_HEAD.size)
    if head is None:
        return False
    op, total = TCP_HEAD.unpack(head)
    target = store.take(total)
    if op == b"S":
        recv_into_exact(conn, target.data)
        conn.sendall(ACK)
    elif op == b"G":
        conn.sendall(target.data)
    return True


def recv_exact(conn: socket.socket, nbytes: int) -> bytes | None:
    """Exactly ``nbytes`` from the stream, or None at a clean end of stream before the first."""
    buf = bytearray(nbytes)
    got = recv_into_exact(conn, memoryview(buf), eof_ok=True)
    return bytes(buf) if got else None


def recv_into_exact(conn: socket.socket, view: memoryview, eof_ok: bool = False) -> bool:
    """Fill ``view`` from the stream; False on end of stream before any byte (if ``eof_ok``)."""
    filled = 0
    while filled < view.nbytes:
        got = conn.recv_into(view[filled:])
        if got == 0:
            if eof_ok and filled == 0:
                return False
            raise ConnectionError(f"stream ended after {filled} of {view.nbytes} bytes")
        filled += got
    return True


def split_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); ``*`` as the port means any free one (0)."""
    match = re.fullmatch(r"tcp://(.+):(\d+|\*)", endpoint)
    if match is None:
        raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
    port = match.group(2)
    return match.group(1), 0 if port == "*" else int(port)


def _raise_exit_on_signals() -> None:
    """SIGTERM/SIGINT raise SystemExit(0) in the main thread (blocking socket calls retry on EINTR
    and let it through, PEP 475), so ``with`` blocks close the sockets."""
    def stop(*_: object) -> None:
        raise SystemExit(0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


class ZmqServerThread(threading.Thread):
    """Owns the ROUTER: creates, binds, serves and closes it; ends when the context is terminated.

    The loop runs here rather than in the main thread because a signal cannot reliably interrupt a
    blocking pyzmq ``recv`` (pyzmq retries on EINTR and the handler's exception can be lost);
    ``ctx.term()`` from the main thread always can.
    """

    def __init__(self, ctx: ZmqContext, bind: str, loop: Callable[[ZmqSocket], None],
                 curve: KeyPair | None = None) -> None:
        super().__init__(name="baseline-server", daemon=False)
        self.ctx = ctx
        self.curve = curve
        self.bind = bind
        self.loop = loop
        self.endpoint = ""
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if self.curve is not None:       # raw CURVE: no ZAP handler, any client key
                sock.setsockopt(zmq.CURVE_SERVER, 1)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)
            sock.bind(self.bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self.ready.set()
            self.loop(sock)
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by run_zmq_server
            self.error = exc
        finally:
            self.ready.set()
            sock.close(linger=0)


def run_zmq_server(kind: str, bind: str, loop: Callable[[ZmqSocket], None],
                   curve: KeyPair | None = None) -> int:
    """Serve ``loop`` on a ROUTER in a thread, announce it, and stop it on SIGTERM/SIGINT."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ctx: ZmqContext = zmq.Context()
    server = ZmqServerThread(ctx, bind, loop, curve)
    server.start()
    server.ready.wait()
    if server.endpoint:
        print(f"baseline {kind} {LISTENING} {server.endpoint}", flush=True)
    while server.is_alive() and not stop.wait(0.5):
        pass
    ctx.term()  # wakes the server thread with ContextTerminated; returns once it closed its socket
    server.join()
    if server.error is not None:
        print(f"baseline {kind} failed: {server.error!r}", file=sys.stderr)
        return 1
    return 0


def run_tcp_server(bind: str) -> None:
    """Listen on ``bind``, announce it, serve bulk-tcp until a signal."""
    host, port = split_tcp_endpoint(bind)
    with socket.create_server((host, port)) as server:
        bound_host, bound_port = server.getsockname()[:2]
        print(f"baseline bulk-tcp {LISTENING} tcp://{bound_host}:{bound_port}", flush=True)
        serve_bulk_tcp(server)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zmq_rpc.tools.baselines echo|bulk-zmq|bulk-tcp --bind tcp://127.0.0.1:*``."""
    ap = argparse.ArgumentParser(prog="python -m zmq_rpc.tools.baselines",
                                 description="Raw pyzmq / TCP servers for zmq-rpc-bench.")
    ap.add_argument("kind", choices=["echo", "bulk-zmq", "bulk-tcp"])
    ap.add_argument("--bind", default="tcp://127.0.0.1:*")
    ap.add_argument("--curve-secret-key", default=None,
                    help="speak CURVE with this key pair (zmq servers only)")
    args = ap.parse_args(argv)
    if args.kind != "bulk-tcp":
        loop = serve_echo if args.kind == "echo" else serve_bulk_zmq
        curve = load_keypair(args.curve_secret_key) if args.curve_secret_key else None
        return run_zmq_server(args.kind, args.bind, loop, curve)
    _raise_exit_on_signals()
    try:
        run_tcp_server(args.bind)
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


# ------------------------------------------------------------------------------ client side


def echo_once(sock: ZmqSocket, message: bytes) -> None:
    """One synchronous round trip through the echo server."""
    sock.send(message)
    sock.recv()


def echo_pipelined(sock: ZmqSocket, count: int, window: int, message: bytes) -> None:
    """``count`` echoes with up to ``window`` in flight, all from this thread."""
    sent = received = 0
    while received < count:
        while sent < count and sent - received < window:
            sock.send(message)
            sent += 1
        sock.recv()
        received += 1
        while received < sent:
            try:
                sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            received += 1


def dealer(ctx: ZmqContext, endpoint: str,
           curve: tuple[KeyPair, bytes] | None = None,
           routing_id: bytes | None = None) -> ZmqSocket:
    """A connected DEALER with no high-water marks and linger 0 (close it yourself); with
    ``curve`` = (client key pair, server public key) it speaks CURVE; with ``routing_id`` it
    introduces itself by that id (set before connecting: libzmq ignores it afterwards)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve[1])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve[0].public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve[0].secret)
    sock.connect(endpoint)
    return sock


def _check_ok(reply: bytes) -> None:
    """Raise unless ``reply``'s header says OK (msgpack ``[status, req_id, ...]``, status 0)."""
    if reply[1] != 0:
        raise RuntimeError(f"the worker answered a raw protocol request with an error: {reply!r:.200}")


def _unsigned(header: bytes) -> bytes:
    return header


class ProtocolDealer:
    """A bare DEALER speaking zmq-rpc's protocol to a worker: HELLO once (its session is open,
    checked), then PINGs with their own request ids, each reply checked for an OK status and
    otherwise matched by nothing but its count (what our client does, minus everything that
    makes it a client). ``signed``: HELLO offers the key exchange and every PING carries the
    session's signature (protocol 1.10, ``broker/request_mac.py``), as our client's requests
    do; unsigned, the worker skips that check."""

    def __init__(self, ctx: ZmqContext, endpoint: str, signed: bool = False) -> None:
        from ..broker import protocol as p
        from ..broker.request_mac import Signer, derive, new_exchange

        routing_id = b"z" + os.urandom(15)
        self.sock = dealer(ctx, endpoint, routing_id=routing_id)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        major, minor = p.PROTOCOL_VERSION
        public, secret = new_exchange() if signed else (b"", b"")
        self.sock.send(p.encode_request(p.Cmd.HELLO, 1, p.Hello(
            major=major, minor=minor, client="raw-protocol", exchange=public)))
        reply = p.decode_reply(p.Cmd.HELLO, p.unpack_header(self.sock.recv()))
        if isinstance(reply, Exception):
            raise RuntimeError(f"the raw protocol client's HELLO was refused: {reply}")
        self._sign: Callable[[bytes], bytes] = _unsigned
        if signed:
            key = derive(secret, getattr(reply, "exchange", b""), routing_id, public,
                         getattr(reply, "exchange", b""))
            if key is None:
                raise RuntimeError("the worker did not answer the raw client's key exchange")
            self._sign = Signer(key).sign
        self._encode, self._ping, self._empty = p.encode_request, p.Cmd.PING, p.Empty()
        self._next = 2

    def call(self, cmd: Cmd, message: Message, *frames: bytes) -> bytes:
        """One synchronous request (``message``: the command's request dataclass, ``frames``
        its payload); the reply's header, checked for an OK status."""
        self.sock.send_multipart([self._sign(self._encode(cmd, self._next, message)), *frames])
        self._next += 1
        reply = self.sock.recv_multipart()
        _check_ok(reply[0])
        return reply[0]

    def ping(self) -> None:
        """One synchronous PING."""
        self.sock.send(self._sign(self._encode(self._ping, self._next, self._empty)))
        self._next += 1
        _check_ok(self.sock.recv())

    def pipelined(self, count: int, window: int) -> None:
        """``count`` PINGs with up to ``window`` in flight, all from this thread."""
        sent = received = 0
        sock, encode, ping, empty = self.sock, self._encode, self._ping, self._empty
        sign = self._sign
        while received < count:
            while sent < count and sent - received < window:
                sock.send(sign(encode(ping, self._next + sent, empty)))
                sent += 1
            _check_ok(sock.recv())
            received += 1
            while received < sent:
                try:
                    _check_ok(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                received += 1
        self._next += count

    def close(self) -> None:
        self.sock.close(linger=0)


class ZmqBulk:
    """Client of the bulk-zmq server: uploads and downloads, chunked or as one frame."""

    def __init__(self, ctx: ZmqContext, endpoint: str,
                 curve: tuple[KeyPair, bytes] | None = None) -> None:
        self.sock = dealer(ctx, endpoint, curve)

    def set(self, source: np.ndarray, chunk: int) -> None:
        """Send ``source`` (contiguous bytes) zero-copy in ``chunk``-byte messages; wait for the ack."""
        flat = source.reshape(-1).view(np.uint8).data
        total = flat.nbytes
        for offset in range(0, max(total, 1), chunk):
            head = HEAD.pack(b"S", total, offset, chunk)
            self.sock.send_multipart([head, flat[offset:offset + chunk]], copy=False)
        self.sock.recv()

    def get(self, total: int, chunk: int) -> np.ndarray:
        """``total`` bytes as one numpy array: the frame itself if whole, else copied into place."""
        self.sock.send(HEAD.pack(b"G", total, 0, chunk))
        if chunk >= total:
            frames = self.sock.recv_multipart(copy=False)
            return np.frombuffer(frames[1].buffer, np.uint8)
        out = np.empty(total, dtype=np.uint8)
        landed = 0
        while landed < total:
            head, data = self.sock.recv_multipart(copy=False)
            offset = HEAD.unpack(head.bytes)[2]
            out[offset:offset + len(data)] = np.frombuffer(data.buffer, np.uint8)
            landed += len(data)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


class TcpBulk:
    """Client of the bulk-tcp server over one kept-open connection."""

    def __init__(self, endpoint: str) -> None:
        self.conn = socket.create_connection(split_tcp_endpoint(endpoint))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set(self, source: np.ndarray) -> None:
        """``sendall`` the bytes of ``source``; wait for the ack."""
        view = source.reshape(-1).view(np.uint8).data
        self.conn.sendall(TCP_HEAD.pack(b"S", view.nbytes))
        self.conn.sendall(view)
        if recv_exact(self.conn, 1) != ACK:
            raise ConnectionError("bulk-tcp server did not acknowledge the upload")

    def get(self, total: int) -> np.ndarray:
        """``total`` bytes received straight into a new numpy array."""
        out = np.empty(total, dtype=np.uint8)
        self.conn.sendall(TCP_HEAD.pack(b"G", total))
        recv_into_exact(self.conn, out.data)
        return out

    def close(self) -> None:
        self.conn.close()


def baseline_argv(kind: str, bind: str = "tcp://127.0.0.1:*", *extra: str) -> list[str]:
    """The command line that starts one baseline server."""
    return [sys.executable, "-m", "zmq_rpc.tools.baselines", kind, "--bind", bind, *extra]


if __name__ == "__main__":
    sys.exit(main())
