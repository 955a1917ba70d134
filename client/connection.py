"""A client's connection to one worker: HELLO, the session's life, and how requests are issued.

:class:`Connection` is the part of :class:`~zmq_rpc.client.Client` that the calls build on: it
opens the engine (:mod:`zmq_rpc.client.engine`, whose I/O thread owns the DEALER), says HELLO,
closes the session, and issues requests (``_call`` for a future, ``_sync`` and ``_request`` for
a blocking call, which on an idle connection runs on the caller's thread). The calls themselves
live in :mod:`~zmq_rpc.client.tensor_calls` and :mod:`~zmq_rpc.client.graph_calls`. Used from any
thread: socket work belongs to the engine.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

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
from ..broker.protocol import Cmd, TensorRef
from ..broker.request_mac import derive, new_exchange
from .engine import DEFAULT_WINDOW_BYTES, Engine, EngineOptions, RequestTiming
from .peer import Routes
from .remote import RemoteBuffer, RemoteTensor
from .security import resolve_curve

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger("zmq_rpc.client")

T = TypeVar("T")
P = ParamSpec("P")
Self = TypeVar("Self", bound="Connection")

DEFAULT_CHUNK = 4 << 20
"""Large tensors travel as requests of at most this many bytes (received straight into place)."""

OnReply = Callable[[p.Message, list[zmq.Frame]], Any]
"""Turns a reply (its fields and payload frames) into the request's result."""


class Connection:
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
        self._routes = Routes()
        self.name = name
        self.timeout = timeout
        self._engine = Engine(address, EngineOptions(
            timeout=timeout, window=window, window_bytes=window_bytes, heartbeat=heartbeat,
            curve=curve, trace=trace), ctx)
        self._handles = itertools.count(1)
        self._handle_lock = threading.Lock()
        self._exchange = (b"", b"")
        """Our ephemeral key pair (public, secret) while HELLO is under way."""
        try:
            self.info: p.HelloReply = self._hello(connect_timeout)
        except BaseException:
            self._engine.close()
            raise
        self.chunk_bytes = max(4096, min(chunk_bytes, self.info.max_message_size - (64 << 10)))

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
        if self._engine.options.trace:
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
        curve = self._engine.options.curve
        if curve is None:
            return b"", b""
        return prove(curve.keys.secret, curve.server_key, self._engine.options.identity)

    def _say_hello(self, hello: p.Hello, timeout: float) -> p.HelloReply | BadRequest:
        """HELLO's reply, or the BadRequest of a worker that does not know a field of it."""
        try:
            with self._engine.inline():
                future = self._engine.submit(Cmd.HELLO, hello, on_reply=self._keyed,
                                             timeout=timeout)
            info: p.HelloReply = future.result()
        except BadRequest as exc:
            return exc
        return info

    def _keyed(self, reply: p.Message, frames: list[zmq.Frame]) -> p.Message:
        """HELLO's reply, on the thread that drives the connection: when the worker answered
        our key exchange, every request from now on is signed (broker/request_mac.py)."""
        exchange = getattr(reply, "exchange", b"")
        if exchange:
            public, secret = self._exchange
            key = derive(secret, exchange, self._engine.options.identity, public, exchange)
            if key is None:
                raise ProtocolError(f"the worker at {self.endpoint} answered the key exchange "
                                    "with an unusable key")
            self._engine.sign_from_now(key)
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
        self._engine.submit(Cmd.HELLO, hello, timeout=timeout).result()

    def timings(self) -> list[RequestTiming]:
        """Where each traced request's time went since the last call (``trace=True``)."""
        return self._engine.drain_timings()

    # ------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free this session on the worker, fail pending requests, stop the I/O thread."""
        self._engine.close()

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.endpoint!r}, server={self.info.server!r})"

    # --------------------------------------------------------------------------- plumbing

    def _call(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
              on_reply: OnReply | None = None,
              timeout: float | None = None, reply_bytes: int = 0) -> Future[Any]:
        return self._engine.submit(cmd, msg, payload, on_reply or no_result, timeout, reply_bytes)

    def _sync(self, issue: Callable[P, Future[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """A blocking call: ``issue(...)`` and wait. On an idle connection the request goes out
        and its reply comes back on this thread, with no hop through the I/O thread."""
        return cast(T, self._engine.call(issue, *args, **kwargs))

    def _request(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
                 on_reply: OnReply | None = None,
                 timeout: float | None = None, reply_bytes: int = 0) -> Any:
        """``_call(...).result()`` for a blocking call of one request: on an idle connection
        it goes out and its reply comes back on this thread, with no future at all."""
        return self._engine.request(cmd, msg, payload, on_reply or no_result, timeout,
                                    reply_bytes)

    def _new_handle(self) -> int:
        with self._handle_lock:
            return next(self._handles)

    def _own_buffer(self, buffer: RemoteBuffer) -> None:
        if buffer.client is not self:
            raise BadRequest(f"{buffer!r} lives on {buffer.client.endpoint}, not on {self.endpoint}")

    def _own(self, tensor: RemoteTensor) -> None:
        if tensor.buffer.client is not self:
            raise BadRequest(f"{tensor!r} lives on {tensor.client.endpoint}, not on {self.endpoint}")

    def _as_client(self) -> Client:
        """This connection as the :class:`~zmq_rpc.client.Client` it is part of (what the
        objects handed out name as theirs)."""
        return cast("Client", self)

    def _ref(self, tensor: RemoteTensor) -> TensorRef:
        self._own(tensor)
        return tensor.ref


EMPTY = p.Empty()
"""The fields of a request that has none (messages are frozen: one instance serves all)."""


def no_result(reply: p.Message, frames: list[zmq.Frame]) -> None:
    """The result of a request that returns nothing."""
    return None
