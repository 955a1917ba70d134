"""One session on one worker: the :class:`~.connection.Connection`, HELLO, and what the calls
of a :class:`~zmq_rpc.client.Client` share about it (the worker's HELLO reply, the client's
timeout and chunk size, handles, peer routes).

Threads: built on the caller's thread (HELLO is a blocking call); then read from any thread,
handles drawn under a lock. Socket work belongs to the connection.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import zmq

from ..broker import protocol as p
from ..broker.errors import (
    AuthenticationFailed,
    BadRequest,
    ConnectionLost,
    OutOfMemory,
    ProtocolError,
    RpcError,
    VersionMismatch,
)
from ..broker.identity import prove
from ..broker.keys import KeyPair
from ..broker.protocol import Cmd
from ..broker.request_mac import derive, new_exchange
from .connection import Connection
from .kept import KeptRuns
from .options import DEFAULT_WINDOW_BYTES, ConnectionOptions
from .routes import Routes
from .security import resolve_curve

log = logging.getLogger("zmq_rpc.client")

DEFAULT_CHUNK = 4 << 20
"""Large tensors travel as requests of at most this many bytes (received straight into place)."""


class Session:
    """One worker and a session on it (see :class:`~zmq_rpc.client.Client` for the options)."""

    def __init__(self, endpoint: str, *, timeout: float = 60.0, connect_timeout: float = 10.0,
                 window: int = 512, window_bytes: int = DEFAULT_WINDOW_BYTES, heartbeat: float = 2.0,
                 name: str = "zmq-rpc-client", chunk_bytes: int = DEFAULT_CHUNK,
                 peer_copy: bool = True,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 curve_key: str | os.PathLike[str] | KeyPair | None = None,
                 server_key: str | bytes | None = None, trace: bool = False) -> None:
        address, curve = resolve_curve(endpoint, curve_key, server_key)
        self.endpoint = address
        self.peer_copy = peer_copy
        self.name = name
        self.timeout = timeout
        self.connection = Connection(address, ConnectionOptions(
            timeout=timeout, window=window, window_bytes=window_bytes, heartbeat=heartbeat,
            curve=curve, trace=trace), ctx)
        self.routes = Routes(self.connection)
        """Which peers this worker pushes to (for copies and hand-offs)."""
        self._handles = itertools.count(1)
        self._handle_lock = threading.Lock()
        self._exchange = (b"", b"")
        """Our ephemeral key pair (public, secret) while HELLO is under way."""
        try:
            self.info: p.HelloReply = self._hello(connect_timeout)
        except BaseException:
            self.connection.close()
            raise
        self.chunk_bytes = max(4096, min(chunk_bytes, self.info.max_message_size - (64 << 10)))
        self.kept = KeptRuns("kept-runs" in self.info.capabilities)
        """The linked runs this session's worker keeps (:mod:`.kept`)."""

    def _hello(self, timeout: float) -> p.HelloReply:
        major, minor = p.PROTOCOL_VERSION
        try:
            hellos = self._hellos()
            info = self._say_hello(hellos[0], timeout)
            for hello in hellos[1:]:     # a worker older than a field we sent: fewer fields
                if not isinstance(info, BadRequest) or "Hello takes" not in info.message:
                    break
                info = self._say_hello(hello, timeout)
            if isinstance(info, RpcError):
                raise info
        except RpcError as exc:
            if isinstance(exc, (VersionMismatch, AuthenticationFailed, OutOfMemory)):
                raise          # the worker answered: it refused us (a full worker: OutOfMemory)
            raise ConnectionLost(f"cannot reach a zmq-rpc worker at {self.endpoint}: "
                                 f"{exc.message}") from exc
        if info.major != major:
            raise VersionMismatch(f"worker speaks protocol {info.major}.{info.minor}, "
                                  f"this client {major}.{minor}")
        if self.connection.options.trace:
            self._ask_for_timing(info, timeout)
        return info

    def _hellos(self) -> list[p.Hello]:
        """The HELLOs to try, newest first (a worker refuses fields it does not know): with a
        key exchange, so that the session signs its requests (1.10, broker/request_mac.py),
        and under CURVE the proof of our key (1.8); then without the exchange; then bare."""
        major, minor = p.PROTOCOL_VERSION
        key, proof = self._key_proof()
        self._exchange = new_exchange()
        hellos = [p.Hello(major=major, minor=minor, client=self.name, key=key, proof=proof,
                          exchange=self._exchange[0])]
        if proof:
            hellos.append(p.Hello(major=major, minor=minor, client=self.name, key=key,
                                  proof=proof))
        hellos.append(p.Hello(major=major, minor=minor, client=self.name))
        return hellos

    def _key_proof(self) -> tuple[bytes, bytes]:
        """Under CURVE, HELLO's proof of this client's key (protocol 1.8): the worker counts
        quotas per key and binds the session to it (broker/identity.py)."""
        curve = self.connection.options.curve
        if curve is None:
            return b"", b""
        return prove(curve.keys.secret, curve.server_key, self.connection.options.identity)

    def _say_hello(self, hello: p.Hello, timeout: float) -> p.HelloReply | BadRequest:
        """HELLO's reply, or the BadRequest of a worker that does not know a field of it."""
        conn = self.connection
        try:
            info: p.HelloReply = conn.result_of(conn.call, Cmd.HELLO, hello,
                                                on_reply=self._keyed, timeout=timeout)
        except BadRequest as exc:
            return exc
        return info

    def _keyed(self, reply: p.Message, frames: list[zmq.Frame]) -> p.Message:
        """HELLO's reply, on the thread that drives the connection: when the worker answered
        our key exchange, every request from now on is signed (broker/request_mac.py)."""
        exchange = getattr(reply, "exchange", b"")
        if exchange:
            public, secret = self._exchange
            key = derive(secret, exchange, self.connection.options.identity, public, exchange)
            if key is None:
                raise ProtocolError(f"the worker at {self.endpoint} answered the key exchange "
                                    "with an unusable key")
            self.connection.sign_from_now(key)
            self._exchange = (b"", b"")     # the secret is not needed again
        return reply

    def _ask_for_timing(self, info: p.HelloReply, timeout: float) -> None:
        """A second HELLO asking for the worker's timing in replies (a worker older than 1.5
        would refuse the field, so it is sent only once the first HELLO showed the capability)."""
        if "timing" not in info.capabilities:
            log.warning("%s speaks protocol %d.%d: its replies carry no timing (trace needs "
                        "1.5)", self.endpoint, info.major, info.minor)
            return
        major, minor = p.PROTOCOL_VERSION
        key, proof = self._key_proof() if "key-proof" in info.capabilities else (b"", b"")
        hello = p.Hello(major=major, minor=minor, client=self.name, timing=True, key=key,
                        proof=proof)
        self.connection.call(Cmd.HELLO, hello, timeout=timeout).result()

    def new_handle(self) -> int:
        """A fresh client-chosen handle for a buffer or a graph (any thread)."""
        with self._handle_lock:
            return next(self._handles)

    def close(self) -> None:
        """Free this session on the worker, fail pending requests, stop the I/O thread."""
        self.connection.close()

    @property
    def closed(self) -> bool:
        return self.connection.closed
