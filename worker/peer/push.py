"""Outgoing peer connections, on the backend thread: one PUSH socket per peer, their life and sends.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer.links.PeerLinks`), which creates,
uses and closes every socket here. A link opens on first use, is reused (most recently used kept
longest, at most :data:`MAX_LINKS`), never blocks a send (SNDTIMEO 0: a send no connection can
take fails its transfer and drops the link, the next use reconnects) and carries a monitor socket
so that a peer whose connection dropped is noticed while a transfer waits on it.

Whom a link may reach is decided before it opens: :class:`~zmq_rpc.worker.peer.endpoints.PeerSecurity`
(tcp with an IP address, or ipc; with CURVE, known worker keys only), and tensors go only to
endpoints that answered this worker's probe (:meth:`PushLinks.check_verified`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from ...broker.endpoints import needs_ipv6
from ...broker.monitor import parse_event
from ...broker.protocol import ErrorCode, WireError
from ...broker.wire import printable
from .endpoints import PeerSecurity

MAX_LINKS = 64
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 1, 1, 3
"""TCP keepalive on every link, the kernel's liveness check: a link whose peer host vanished
without closing its connections (power, cable, a partition between the two workers) is probed
after 1 s without traffic and dropped after 3 unanswered probes 1 s apart, :data:`LINK_LOSS_S`
after the last packet from the peer. Probes go only while the link has nothing unacknowledged
in flight: a link stuck behind a busy receiver (its window closed, its probes answered) is not
lost, and a copy into a worker that computes for a while completes. During a partition the
*receiver's* link back to the sender, which carries only acknowledgements and is idle by then,
is the one that tells (worker/peer/links.py watches it), well within the failure contract's 6 s
(docs/FAILURES.md). No TCP_USER_TIMEOUT: Linux applies it to a closed window too, and dropped a
64 MiB copy into a worker busy for 9 s after 5.5 s.

Why not ZMTP heartbeats: libzmq 4.3.5 (and its master) aborts the process that *receives* a
PING when it decodes the PING from input it kept while that connection's input was stopped by an
HWM and the peer reset the connection (``zmtp_engine_t::process_heartbeat_message`` calls
``out_event``, which asserts ``!_io_error``). A peer port's PULL stops its input after
``PEER_RCVHWM`` messages, so a sending worker's pings, a reset link (a session closed
mid-transfer) and a busy receiver aborted the receiving worker (docs/SECURITY.md)."""
RECONNECT_IVL_MS = 100
"""How long a link waits before it reconnects (libzmq's default, made explicit): a link to a
port that accepts and drops connections makes two monitor events per reconnect."""
LINK_LOSS_S = float(KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S)
"""The longest an idle link to a vanished peer goes unnoticed: the keepalive idle time, then its
probes. A link that has not connected within this long after it opened is lost too."""


@dataclass
class LinkState:
    """What a link's monitor said: whether its connection is up, since when it is down."""

    opened: float
    up: bool = False
    was_up: bool = False
    """It connected at least once (a drop then is a loss, not a connection that never came)."""
    down_since: float = 0.0
    dropped: bool = False
    """A drop not yet seen by :meth:`PushLinks.disconnected`."""


class PushLinks:
    """The PUSH sockets to other workers' peer ports, by endpoint."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], security: PeerSecurity, *,
                 reconnect_ivl_ms: int = RECONNECT_IVL_MS) -> None:
        self.ctx = ctx
        self.security = security
        self.reconnect_ivl_ms = reconnect_ivl_ms
        """Each link's reconnect interval (a test makes it small to fill a monitor fast)."""
        self.sockets: dict[str, zmq.Socket[bytes]] = {}
        self.monitors: dict[str, zmq.Socket[bytes]] = {}
        """Each link's socket monitor (connections, drops), read while a transfer needs it."""
        self.states: dict[str, LinkState] = {}
        self.verified: set[str] = set()
        """Peer endpoints that answered our probe: the only ones pushed to without CURVE."""

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self.sockets

    def __len__(self) -> int:
        return len(self.sockets)

    def close(self) -> None:
        """Close every link (what is still queued on them is dropped)."""
        for endpoint in list(self.sockets):
            self.drop(endpoint)

    def check_verified(self, endpoint: str) -> None:
        """Push tensors only to an endpoint that answered this worker's probe: the peer
        handshake. Its answer carries a random token only that endpoint received, so a client
        cannot make a worker send tensors to a port that is not a zmq-rpc worker; under CURVE
        the answer also proves the CURVE handshake with the endpoint's key (among
        ``--worker-keys``, :class:`PeerSecurity`) completed on this link, since the probe
        cannot leave before it. The handshake alone would not do: an ``inproc://`` endpoint
        has none (docs/SECURITY.md, "Peer links")."""
        self.security.address(endpoint)     # a refused endpoint says why first
        if endpoint not in self.verified:
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"{printable(endpoint, 100)} has not answered a peer probe from this "
                            "worker (PEER_PROBE it first; is it a zmq-rpc worker?): this "
                            "worker does not push there")

    def verify(self, endpoint: str) -> None:
        """``endpoint`` answered a probe of this worker: it may be pushed to."""
        self.verified.add(endpoint)

    def get(self, endpoint: str) -> zmq.Socket[bytes]:
        """The PUSH socket to ``endpoint``: reused, most recently used last; at most MAX_LINKS
        stay open (a peer can name any reply address: never let that exhaust our sockets)."""
        sock = self.sockets.pop(endpoint, None)
        if sock is not None:
            self.sockets[endpoint] = sock
            return sock
        address, server_key = self.security.address(endpoint)
        while len(self.sockets) >= MAX_LINKS:
            self.drop(next(iter(self.sockets)))
        sock = self._open(address, server_key)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:              # monitored before it connects: the connection is never missed
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"cannot connect to peer {printable(address, 100)}: {exc}") from None
        self.sockets[endpoint] = sock
        self.monitors[endpoint] = monitor
        now = time.monotonic()
        self.states[endpoint] = LinkState(opened=now, down_since=now)
        return sock

    def _open(self, address: str, server_key: bytes | None) -> zmq.Socket[bytes]:
        """A PUSH socket with the link's options, not connected yet."""
        try:
            sock = self.ctx.socket(zmq.PUSH)
        except zmq.ZMQError as exc:
            raise WireError(ErrorCode.TRANSFER_FAILED, f"cannot open a peer link: {exc}") from None
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 0)     # never block the backend thread (see send)
        sock.setsockopt(zmq.RECONNECT_IVL, self.reconnect_ivl_ms)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
        sock.setsockopt(zmq.IPV6, needs_ipv6(address))
        keys = self.security.keys
        if keys is not None and server_key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        return sock

    def drop(self, endpoint: str) -> None:
        """Close a link whose peer failed us (or whose session closed): what is queued on it is
        dropped, the next use reconnects."""
        self._read(endpoint)        # an unread monitor pipe that is full blocks disable_monitor
        sock = self.sockets.pop(endpoint, None)
        monitor = self.monitors.pop(endpoint, None)
        self.states.pop(endpoint, None)
        if sock is not None and monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)

    def disconnected(self, endpoint: str) -> bool:
        """Whether the link to ``endpoint`` dropped its connection since the last look."""
        state = self._read(endpoint)
        if state is None or not state.dropped:
            return False
        state.dropped = False
        return True

    def lost_for(self, endpoint: str, since: float) -> float | None:
        """How long the link to ``endpoint`` has been lost, counted from ``since`` at the
        earliest (when a transfer began to need it); None while it is not (up, or within
        :data:`LINK_LOSS_S` of opening without having connected yet, or not open here)."""
        state = self._read(endpoint)
        if state is None or state.up:
            return None
        now = time.monotonic()
        if not state.was_up and now - state.opened < LINK_LOSS_S:
            return None                  # still connecting
        return max(0.0, now - max(state.down_since, since))

    def read_all(self) -> None:
        """Take every link's monitor news now (never blocks). Run it often enough that no
        monitor's pipe fills: libzmq's I/O thread sends monitor events with a blocking send, so
        a full pipe (1,000 events: a link to a port that accepts and drops reconnects ten times
        a second) stops that thread, and with it every client connection of the worker and its
        exit (docs/SECURITY.md, the long fuzz)."""
        for endpoint in list(self.monitors):
            self._read(endpoint)

    def _read(self, endpoint: str) -> LinkState | None:
        """The link's state, after the monitor's news (never blocks)."""
        monitor, state = self.monitors.get(endpoint), self.states.get(endpoint)
        while monitor is not None and state is not None and monitor.poll(0):
            event = parse_event(monitor.recv_multipart()).event
            if event == zmq.EVENT_CONNECTED:
                state.up = state.was_up = True
            elif event == zmq.EVENT_DISCONNECTED:
                if state.up:
                    state.down_since = time.monotonic()
                state.up = False
                state.dropped = True
        return state

    def send(self, link: zmq.Socket[bytes], endpoint: str, frames: list[Any],
             track: bool = False, copy: bool = False) -> zmq.MessageTracker | None:
        """Hand frames to a link without ever blocking (links have SNDTIMEO 0): a PUSH whose
        connection cannot take a message (none up, its pipe gone) would otherwise block the
        backend thread, and with it every client, for good. Such a
        send fails its transfer with TRANSFER_FAILED and the link is dropped (the next use
        reconnects)."""
        try:
            return link.send_multipart(frames, copy=copy, track=track)
        except zmq.ZMQError as exc:
            self.drop(endpoint)
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"the link to peer {printable(endpoint, 100)} cannot take a "
                            f"message now ({zmq.strerror(exc.errno or 0)}): no connection "
                            "to it is up") from None

    def send_to(self, endpoint: str, frames: list[Any]) -> None:
        """Copy ``frames`` onto the link to ``endpoint`` (opened if needed), never blocking."""
        self.send(self.get(endpoint), endpoint, frames)
