"""The DEALER to one worker and what is known of its health: the socket's options, libzmq's
monitor (handshakes, disconnects), the session the worker may have forgotten, the keep-alive
ping and the goodbye.

Threads: created by the connection's I/O thread, then owned by whoever drives the connection
(the holder of its socket lock: the I/O thread or a blocking caller); closed by the I/O thread. A failure it learns of is reported to the connection's driver through ``on_failure``,
on the same thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from ..broker import protocol as p
from ..broker.endpoints import needs_ipv6
from ..broker.errors import AuthenticationFailed, ConnectionLost, RpcError, SessionLost
from ..broker.monitor import recv_event
from ..broker.protocol import Cmd, ErrorCode
from ..broker.request_mac import Signer
from .options import ConnectionOptions

log = logging.getLogger("zmq_rpc.client")

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

WAIT_SLICE_MS = 2
"""The DEALER's receive timeout (``RCVTIMEO``; every other read of it is non-blocking): how
long a blocking caller waits on the DEALER alone for its reply (``Loop.drive``) before it polls
the monitor, the deadlines and the wake-up socket too: a blocking receive costs the caller less
than a poll over the three sockets and a receive (docs/CLIENT_DESIGN.md)."""

PING_HEADER = p.encode_request(Cmd.PING, 0, p.Empty())
"""The keep-alive ping (request id 0: its reply matches nothing and is dropped)."""


class Link:
    """One worker's DEALER, its monitor, and whether the worker can be reached (``up``), ever
    could (``ever_up``) or has forgotten our session for good (``lost``)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                 options: ConnectionOptions, on_failure: Callable[[RpcError], None]) -> None:
        self.endpoint = endpoint
        self.options = options
        self.on_failure = on_failure
        """Fails what is pending (the connection's driver's ``fail_pending``)."""
        self.dealer = ctx.socket(zmq.DEALER)
        self.monitor: zmq.Socket[bytes] | None = None
        self.up = False
        self.ever_up = False
        self.lost: RpcError | None = None
        """Set for good when the worker no longer knows our session, or libzmq gave up on the
        connection (:meth:`unsendable`)."""
        self.refused: RpcError | None = None
        """The last handshake failure (the worker's ZAP said no, or the handshake broke)."""
        self.reconnect_refused = threading.Event()
        """Set (by the I/O thread) when, since the connection went down, a reconnection was
        refused: no process listens at the worker's address (it was killed, or is not back
        yet). A frozen worker's host still accepts the TCP connection: not set for it."""
        self.last_sent = time.monotonic()
        self.signer: Signer | None = None
        """Signs every request header from the HELLO reply on, when the worker exchanged keys
        (protocol 1.10, ``request-mac``): every path that sends one asks it."""
        try:
            self._configure(options)
            self.monitor = self.dealer.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED
                | zmq.EVENT_CLOSED)
            self.dealer.connect(endpoint)
        except BaseException:
            self.close()
            raise

    def _configure(self, opts: ConnectionOptions) -> None:
        dealer = self.dealer
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, opts.identity)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.RCVTIMEO, WAIT_SLICE_MS)
        dealer.setsockopt(zmq.IPV6, needs_ipv6(self.endpoint))   # tcp://[::1]:P: ENODEV without
        dealer.setsockopt(zmq.HEARTBEAT_IVL, opts.zmq_heartbeat_ms)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, opts.zmq_heartbeat_timeout_ms)
        dealer.setsockopt(zmq.HEARTBEAT_TTL, opts.zmq_heartbeat_timeout_ms)
        if opts.curve is not None:
            dealer.setsockopt(zmq.CURVE_SERVERKEY, opts.curve.server_key)
            dealer.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve.keys.public)
            dealer.setsockopt(zmq.CURVE_SECRETKEY, opts.curve.keys.secret)

    @property
    def down(self) -> bool:
        """Requests cannot go out now: the session is lost, or the connection was up and is not
        (zmq keeps reconnecting meanwhile)."""
        return self.lost is not None or (self.ever_up and not self.up)

    def refusal(self) -> RpcError:
        """Why a request cannot go out now (the connection is known to be down)."""
        if self.lost is not None:
            return self.lost
        return ConnectionLost(f"the connection to {self.endpoint} is down "
                              "(zmq keeps reconnecting); the request was not sent")

    # ----------------------------------------------------------------------- what we hear

    def read_monitor(self) -> None:
        """Take in what the monitor reports (handshakes, disconnects)."""
        assert self.monitor is not None
        while self.monitor.poll(0):
            message = recv_event(self.monitor)
            event = message.event
            if event & HANDSHAKE_FAILED:
                self._handshake_failed(event, message.value)
            elif event == zmq.EVENT_CLOSED and self.ever_up and not self.up:
                # a reconnection's socket closed unconnected (refused); a frozen worker's host
                # accepts it (EVENT_CONNECTED) and then stays silent
                self.reconnect_refused.set()
            elif event == zmq.EVENT_DISCONNECTED and self.up:
                self.up = False
                self.reconnect_refused.clear()
                self.on_failure(ConnectionLost(
                    f"connection to {self.endpoint} lost; requests in flight may or may "
                    "not have run, queued ones were not sent"))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.reconnect_refused.clear()
                again = self.ever_up and not self.up
                self.up = self.ever_up = True
                if again and self.lost is None:
                    self.ping()        # a restarted worker answers NO_SESSION: we learn it now

    def _handshake_failed(self, event: int, value: int) -> None:
        """The worker refused us (ZAP said no), or the handshake broke (a wrong server key, one
        side without CURVE): fail what waits now rather than at its timeout. libzmq retries."""
        self.up = False
        where = self.endpoint.partition("#")[0]
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"the worker at {where} refused this client's CURVE key (ZAP status {value}): "
                   "its public key must be in the worker's --authorized-keys directory")
        elif self.options.curve is not None:
            why = (f"the CURVE handshake with {where} failed ({handshake_error(value)}): is the "
                   "worker's public key right, and does the worker run with "
                   "--curve-secret-key?")
        else:
            why = (f"the handshake with {where} failed ({handshake_error(value)}): the worker "
                   "may require CURVE (pass curve_key= and the worker's key)")
        self.refused = AuthenticationFailed(why)
        self.on_failure(self.refused)

    def unsendable(self) -> RpcError:
        """A send found no connection to queue on (``EAGAIN``: the DEALER's queue is unbounded,
        so that is the only cause): libzmq dropped the connection on a handshake that broke
        (a worker that requires CURVE, a wrong key) and does not reconnect. Every request
        fails from now on, with the handshake's failure where the monitor has told it; a
        blocking send would have waited forever (with the socket's lock held: nothing else
        could fail either)."""
        self.read_monitor()
        if self.lost is None:
            self.lost = self.refused or ConnectionLost(
                f"cannot send to {self.endpoint.partition('#')[0]}: libzmq has no connection "
                "to it and does not reconnect (the handshake broke: does the worker require "
                "CURVE, or another key?)")
        self.up = False
        return self.lost

    def session_lost(self, said: object) -> None:
        """The worker answered NO_SESSION: every request from now on fails, for good."""
        if self.lost is not None:
            return
        self.lost = SessionLost(
            f"the worker at {self.endpoint} no longer knows this client's session "
            "(it was restarted, or the session expired): its buffers and graphs are gone; "
            f"open a new Client (the worker said: {str(said)[:200]})", code=ErrorCode.NO_SESSION)
        log.warning("%s", self.lost.message)
        self.on_failure(self.lost)

    # ------------------------------------------------------------------------ what we say

    def heartbeat(self, now: float) -> None:
        """Ping the worker when nothing was sent for ``options.heartbeat`` seconds (keeps the
        session alive)."""
        if self.up and now - self.last_sent >= self.options.heartbeat:
            self.ping()

    def ping(self) -> None:
        try:
            self.dealer.send(self.signed(PING_HEADER), zmq.NOBLOCK)
        except zmq.Again:
            self.on_failure(self.unsendable())
            return
        self.last_sent = time.monotonic()

    def goodbye(self) -> None:
        """Tell the worker to free our session now (best effort, not waited for)."""
        if self.up and self.lost is None:
            try:
                self.dealer.send(self.signed(p.encode_request(Cmd.GOODBYE, 0, p.Empty())),
                                 zmq.NOBLOCK)
            except zmq.Again:
                pass        # no connection left to say it on: the worker expires the session

    def signed(self, header: bytes) -> bytes:
        """``header`` as it goes on the wire: with the session's signature when it has one."""
        signer = self.signer
        return header if signer is None else signer.sign(header)

    def close(self) -> None:
        if self.monitor is not None:
            self.dealer.disable_monitor()
            self.monitor.close(linger=0)
        self.dealer.close(linger=200 if self.up else 0)


def handshake_error(value: int) -> str:
    """libzmq's handshake failure value: a ZMQ_PROTOCOL_ERROR_* code, else an errno."""
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == value:
            return name[len("PROTOCOL_ERROR_"):].lower().replace("_", " ")
    return zmq.strerror(value) if 0 < value < 0x10000000 else f"code 0x{value:x}"
