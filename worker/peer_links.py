"""Worker-to-worker transfers, on the backend thread: the PULL socket, lazy PUSH links, bookkeeping.

Owned by the backend thread, like every other piece of tensor state: it binds the peer PULL socket,
opens one PUSH socket per destination peer on first use (and reuses it), writes arriving chunks
straight into their destination views, sends acknowledgements, and fails transfers at their
deadline. Nothing here blocks: the backend loop polls the PULL socket and calls :meth:`expire`.

Built before the executor and handed nothing of it: each transfer comes with what it needs (the
destination view, or a :class:`Source`), an ``owner`` (its session, compared by identity only) and
a ``done`` callable told the outcome once (None on success, else why it failed).

Security (SECURITY.md): with a CURVE key pair the PULL port is a CURVE server in the ZAP domain
``zmq-rpc-peer`` (only this worker's own key and ``--worker-keys`` connect), and this worker pushes
only to endpoints that carry a key (``tcp://h:p#curve=KEY``) found among those same worker keys:
the CURVE handshake with that key is the peer handshake, so neither data nor acknowledgements go
to a port that is not a known worker. Chunks for transfers nobody here waits for yet are kept by
:class:`~zmq_rpc.worker.stash.Stash`, per sender.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ..broker import peer as wire
from ..broker.broker import make_curve_server
from ..broker.errors import BadRequest
from ..broker.keys import KeyFileError, KeyPair, join_endpoint, split_endpoint
from ..broker.protocol import ErrorCode, TensorRef, WireError, split_tensor
from ..broker.wire import printable
from ..broker.zap import PEER_DOMAIN, KeySet
from .backends.base import Backend, Memory, View
from .metrics import NullRecorder, Recorder
from .quotas import Charged
from .stash import Stash

log = logging.getLogger("zmq_rpc.worker.peer")

CHUNK_BYTES = 4 << 20
ZERO_COPY_BYTES = 64 * 1024
"""Smaller chunks are copied into zmq messages: cheaper than tracking a zero-copy one."""
MAX_LINKS = 64
PEER_RCVHWM = 256
"""Peer messages queued per sending connection before libzmq stops reading it (it was
unbounded: a flood of the peer port while the backend was busy grew the worker without limit).
A sender's chunks are 4 MiB: 1 GiB in flight per sender is far more than a transfer needs."""
PEER_GONE_GRACE_S = 1.0
"""After a peer's connection drops, how long its acknowledgements may still arrive (they come
back on the peer's own link, so a dropped connection alone does not prove the copy failed)."""
WATCH_INTERVAL_S = 0.05
"""How often the links with transfers waiting for an acknowledgement are checked for drops."""
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 2000, 6000
"""ZMTP heartbeats on every link: a peer host that vanishes without closing its connections
(power, cable) is seen as disconnected after at most ~8 s."""

NAMES_REFUSED = ("names an IP address (tcp://IP:PORT, tcp://[IPv6]:PORT) or ipc://PATH: libzmq "
                 "resolves a host name on the worker's I/O thread, synchronously, so a name that "
                 "does not resolve would stall every connection of this worker for seconds")


def check_numeric(address: str) -> None:
    """TRANSFER_FAILED unless ``address`` needs no name resolution to connect to.

    Peer endpoints come from the network (a client's PEER_SEND, a probe's reply address). libzmq
    calls getaddrinfo for a ``tcp://NAME:PORT`` on its I/O thread and again at every reconnect;
    an unresolvable name blocks that thread ~1.5 s each time, and with it every client's
    requests, replies and heartbeats (the long fuzz's lost probes). So links take IP addresses
    only; a worker's own advertised endpoint is resolved once at start (:func:`resolve_endpoint`).
    """
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc") and rest:
        return
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ok = scheme == "tcp" and bool(colon) and port.isdigit() and bool(ipaddress.ip_address(host))
    except ValueError:
        ok = False
    if not ok:
        raise WireError(ErrorCode.TRANSFER_FAILED, f"peer endpoint "
                        f"{printable(address, 100)} refused: a peer endpoint {NAMES_REFUSED}")


def resolve_endpoint(endpoint: str) -> str:
    """``tcp://NAME:PORT[#curve=KEY]`` with NAME resolved to an IP address, once (a worker's
    ``--peer-advertise``, given by whoever starts it); other endpoints as they are."""
    address, key = split_endpoint(endpoint)
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host.startswith("["):
        return endpoint
    try:
        ipaddress.ip_address(host)
        return endpoint
    except ValueError:
        pass
    family, *_, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    ip = str(sockaddr[0])
    resolved = f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"
    return join_endpoint(resolved, key)


@dataclass
class PeerSecurity:
    """Who this worker's peer links authenticate as and whom they may push to."""

    keys: KeyPair | None = None
    accepted: KeySet = field(default_factory=KeySet)
    """Worker public keys a push may go to (this worker's own key included)."""

    def address(self, endpoint: str) -> tuple[str, bytes | None]:
        """The address to connect to and the server key to demand, or TRANSFER_FAILED when
        this worker must not push there."""
        try:
            address, key = split_endpoint(endpoint)
        except KeyFileError as exc:
            raise WireError(ErrorCode.TRANSFER_FAILED, f"bad peer endpoint: {exc}") from None
        check_numeric(address)
        if self.keys is None:
            if key is not None:
                raise WireError(ErrorCode.TRANSFER_FAILED, "that peer endpoint requires CURVE, "
                                "and this worker has no key pair (--curve-secret-key)")
            return address, None
        if key is None:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker pushes only to CURVE "
                            "workers: the peer endpoint carries no key (#curve=...)")
        if key not in self.accepted.keys():
            raise WireError(ErrorCode.TRANSFER_FAILED, "that peer endpoint's key is not among "
                            "this worker's --worker-keys: it will not push there")
        return address, key

Done = Callable[[str | None], None]
"""Told once how a transfer ended: None when it succeeded, else what went wrong."""


@dataclass(frozen=True)
class Source:
    """Where a send reads from: the checked view, its buffer's memory, and where the trackers
    of zero-copy chunks go (the buffer is not written until they are done)."""

    view: View
    memory: Memory
    track: Callable[[zmq.MessageTracker], None]
    copy: Callable[[View, str], Charged] | None = None
    """Materializes a piece that cannot go in place (strided), counted in its session's memory
    until sent; None: read it uncounted."""
    sent: Callable[[zmq.MessageTracker | None, Charged], None] | None = None
    """Told the tracker of a materialized piece (its bytes are given back when done)."""


@dataclass
class Incoming:
    """A receive at the head of its session's queue, collecting chunks into ``dst``."""

    owner: object
    done: Done
    ref: TensorRef
    view: View
    deadline: float
    staging: np.ndarray | None
    target: memoryview | None
    """The destination's bytes in place (a contiguous view on a host backend): chunks land
    with one memcpy each."""
    received: set[int] = field(default_factory=set)
    nchunks: int = -1
    nbytes: int = 0
    reply_to: str = ""


@dataclass
class Outgoing:
    """A PEER_SEND or PEER_PROBE waiting for the peer's acknowledgement."""

    owner: object
    done: Done
    endpoint: str
    deadline: float
    what: str
    probe: bool = False
    gone: bool = False
    """The peer's connection dropped while this waited: the deadline was cut to the grace."""


@dataclass(frozen=True)
class Piece:
    """One chunk of a send, its header encoded ahead: ``data`` aliases the source buffer when
    the backend can hand its bytes out in place (read after the run, for nothing), else the
    piece's view is read when it is pushed."""

    header: bytes
    view: View
    data: Any | None
    zero_copy: bool


@dataclass(frozen=True)
class Push:
    """A checked send, ready to go: its pieces, where trackers go, the link to the peer."""

    pieces: tuple[Piece, ...]
    source: Source
    endpoint: str
    link: zmq.Socket[bytes]
    acknowledged: bool = False
    """The receiver answers (PEER_SEND); a linked run's pushes are counted once sent."""


class PeerLinks:
    """The backend thread's peer sockets and the transfers in progress."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: Backend, *, bind: str = "",
                 advertise: str = "", max_message_size: int = 64 << 20,
                 stash_limit: int = 64 << 20, security: PeerSecurity | None = None) -> None:
        self.ctx = ctx
        self.backend = backend
        self.security = security or PeerSecurity()
        keys = self.security.keys
        self.pull: zmq.Socket[bytes] | None = None
        self.endpoint = ""
        if bind:      # without one, transfers still arrive relayed by clients (PEER_FILL)
            self.pull = ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.RCVHWM, PEER_RCVHWM)
            self.pull.setsockopt(zmq.MAXMSGSIZE, max_message_size)
            if keys is not None:
                make_curve_server(self.pull, keys, PEER_DOMAIN)
            self.pull.bind(bind)
            self.endpoint = (resolve_endpoint(advertise) if advertise
                             else self.pull.getsockopt_string(zmq.LAST_ENDPOINT))
            if keys is not None and split_endpoint(self.endpoint)[1] is None:
                self.endpoint = join_endpoint(self.endpoint, keys.public)
        self.links: dict[str, zmq.Socket[bytes]] = {}
        self.monitors: dict[str, zmq.Socket[bytes]] = {}
        """Each link's socket monitor (disconnections), read while a transfer waits on it."""
        self._next_watch = 0.0
        self.verified: set[str] = set()
        """Peer endpoints that answered our probe: the only ones pushed to without CURVE."""
        self.incoming: dict[bytes, Incoming] = {}
        self.outgoing: dict[bytes, Outgoing] = {}
        self.stash = Stash(stash_limit)
        self.metrics: Recorder = NullRecorder()
        """Set by the worker when it serves metrics (bytes and transfers on the peer link)."""

    def close(self) -> None:
        if self.pull is not None:
            self.pull.close(linger=0)
        for endpoint in list(self.links):
            self._drop_link(endpoint)

    def next_deadline(self) -> float | None:
        """The earliest moment something here may time out."""
        times = [t.deadline for t in self.incoming.values()]
        times += [t.deadline for t in self.outgoing.values()]
        expiry = self.stash.next_expiry()
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    # ------------------------------------------------------------- requests (from executor)

    def announce(self, owner: object, tokens: list[bytes]) -> None:
        """A session queued a PEER_RECV (or a linked run's receives): chunks for these tokens
        that arrive before the receive starts are kept apart from unannounced ones."""
        for token in tokens:
            if token not in self.incoming:
                self.stash.announce(owner, token)

    def start_recv(self, token: bytes, dst: TensorRef, view: View, timeout_ms: int,
                   owner: object, done: Done) -> None:
        """Begin receiving transfer ``token`` into ``view`` (the checked view of ``dst``);
        chunks stashed earlier may finish it, and call ``done``, before this returns."""
        if token in self.incoming:
            raise WireError(ErrorCode.TRANSFER_FAILED, "that transfer token is already in use")
        contiguous = dst.is_contiguous()
        staging = None if contiguous else np.empty(dst.nbytes, np.uint8)
        in_place = self.backend.alias(view) if contiguous else None
        self.incoming[token] = Incoming(
            owner, done, dst, view, time.monotonic() + timeout_ms / 1000, staging,
            None if in_place is None else memoryview(in_place))
        stashed = self.stash.claim(owner, token)
        if stashed is not None:
            for chunk, frame in stashed.messages:
                if token in self.incoming:
                    self._on_chunk(chunk, frame, stashed.sender)

    def start_send(self, send: wire.Send, source: Source, timeout_ms: int, owner: object,
                   done: Done) -> None:
        """Push ``source`` to ``send.endpoint`` in chunks; ``done`` hears the peer's ack."""
        push = self.prepare_push(send, source, acknowledge=True)
        self._disconnected(send.endpoint)     # forget drops from before this transfer
        self.outgoing[send.token] = Outgoing(owner, done, send.endpoint,
                                             time.monotonic() + timeout_ms / 1000,
                                             f"transfer to {send.endpoint}")
        try:
            self.push(push)
        except WireError:
            self.outgoing.pop(send.token, None)
            raise

    def prepare_push(self, send: wire.Send, source: Source, acknowledge: bool) -> Push:
        """Check a send (peer endpoint, link) and encode its chunk headers before anything it
        follows runs: after the run, pushing is only handing frames to zmq. With
        ``acknowledge`` the receiver answers once it has everything, else it sends nothing."""
        if not self.endpoint:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker has no peer endpoint")
        sub_refs = split_tensor(send.src, CHUNK_BYTES)
        reply_to = self.endpoint if acknowledge else ""
        pieces = []
        for seq, (start, sub) in enumerate(sub_refs):
            piece_view = (source.view if len(sub_refs) == 1
                          else self.backend.view(source.memory, sub))
            data = self.backend.alias(piece_view)
            header = wire.encode_peer(wire.Chunk(send.token, seq, len(sub_refs), start,
                                                  send.src.nbytes, reply_to))
            pieces.append(Piece(header, piece_view, data,
                                data is not None and sub.nbytes >= ZERO_COPY_BYTES))
        self._check_verified(send.endpoint)
        return Push(tuple(pieces), source, send.endpoint, self._link(send.endpoint), acknowledge)

    def push(self, push: Push) -> None:
        """Send the prepared chunks (zero-copy from the buffer when big and aliased)."""
        link = push.link if not push.link.closed else self._link(push.endpoint)
        self.metrics.peer_out([p.header for p in push.pieces])
        self.metrics.peer_out([p.view for p in push.pieces])
        if not push.acknowledged:
            self.metrics.transfer("out", True)
        self.backend.prefetch([p.view for p in push.pieces if p.data is None])  # GPU: overlap
        for piece in push.pieces:
            data = piece.data
            if data is None and push.source.copy is not None and \
                    piece.view.nbytes >= ZERO_COPY_BYTES:
                self._push_charged(push, piece, link)
                continue
            if data is None:
                data = self.backend.read(piece.view)[0]
            if piece.zero_copy:
                tracker = self._send(link, push.endpoint, [piece.header, data], track=True)
                if tracker is not None:
                    push.source.track(tracker)
            else:
                self._send(link, push.endpoint, [piece.header, data])

    def _check_verified(self, endpoint: str) -> None:
        """Without CURVE, push only to an endpoint that answered this worker's probe (the peer
        handshake: the answer carries a random token only that endpoint received), so a client
        cannot make a worker send tensors to a port that is not a zmq-rpc worker. With CURVE
        the handshake with a known worker key is the check (:class:`PeerSecurity`)."""
        if self.security.keys is None and endpoint not in self.verified:
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"{printable(endpoint, 100)} has not answered a peer probe from this "
                            "worker (PEER_PROBE it first; is it a zmq-rpc worker?): this "
                            "worker does not push there")

    def _push_charged(self, push: Push, piece: Piece, link: zmq.Socket[bytes]) -> None:
        """A piece that must be materialized (strided, zero-stride) is counted in its
        session's memory until libzmq has sent it (a dead peer cannot pile up copies)."""
        copy, sent = push.source.copy, push.source.sent
        assert copy is not None and sent is not None
        charged = copy(piece.view, push.endpoint)
        try:
            tracker = self._send(link, push.endpoint, [piece.header, charged.data], track=True)
        except WireError:
            sent(zmq.MessageTracker(), charged)      # never queued: done, reaped at once
            raise
        sent(tracker, charged)

    def _send(self, link: zmq.Socket[bytes], endpoint: str, frames: list[Any],
              track: bool = False) -> zmq.MessageTracker | None:
        """Hand frames to a link without ever blocking (links have SNDTIMEO 0): a PUSH whose
        connection cannot take a message (none up, its pipe gone) would otherwise block the
        backend thread, and with it every client, for good (seen in the long fuzz). Such a
        send fails its transfer with TRANSFER_FAILED and the link is dropped (the next use
        reconnects)."""
        try:
            return link.send_multipart(frames, copy=False, track=track)
        except zmq.ZMQError as exc:
            self._drop_link(endpoint)
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"the link to peer {printable(endpoint, 100)} cannot take a "
                            f"message now ({zmq.strerror(exc.errno or 0)}): no connection "
                            "to it is up") from None

    def drop_link(self, endpoint: str) -> None:
        """Close a link and drop what is queued on it (its session closed)."""
        self._drop_link(endpoint)

    def start_probe(self, endpoint: str, timeout_ms: int, owner: object, done: Done) -> None:
        """Ask the peer at ``endpoint`` to answer; ``done`` hears whether it did in time."""
        if not self.endpoint:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker has no peer endpoint")
        token = os.urandom(wire.TOKEN_BYTES)
        link = self._link(endpoint)
        self._disconnected(endpoint)
        self.outgoing[token] = Outgoing(owner, done, endpoint,
                                        time.monotonic() + timeout_ms / 1000,
                                        f"probe of {endpoint}", probe=True)
        probe = wire.encode_peer(wire.Probe(token, self.endpoint))
        self.metrics.peer_out((probe,))
        try:
            self._send(link, endpoint, [probe])
        except WireError:
            del self.outgoing[token]
            raise

    def _link(self, endpoint: str) -> zmq.Socket[bytes]:
        """The PUSH socket to ``endpoint``: reused, most recently used last; at most MAX_LINKS
        stay open (a peer can name any reply address: never let that exhaust our sockets)."""
        sock = self.links.pop(endpoint, None)
        if sock is not None:
            self.links[endpoint] = sock
            return sock
        address, server_key = self.security.address(endpoint)
        while len(self.links) >= MAX_LINKS:
            oldest = next(iter(self.links))
            self._drop_link(oldest)
        try:
            sock = self.ctx.socket(zmq.PUSH)
        except zmq.ZMQError as exc:
            raise WireError(ErrorCode.TRANSFER_FAILED, f"cannot open a peer link: {exc}") from None
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 0)     # never block the backend thread (see _send)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        keys = self.security.keys
        if keys is not None and server_key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"cannot connect to peer {printable(address, 100)}: {exc}") from None
        self.links[endpoint] = sock
        self.monitors[endpoint] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return sock

    def _drop_link(self, endpoint: str) -> None:
        """Close a link whose peer failed us: what is queued on it is dropped, next use reconnects."""
        sock = self.links.pop(endpoint, None)
        monitor = self.monitors.pop(endpoint, None)
        if sock is not None and monitor is not None:
            sock.disable_monitor()
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)

    def _disconnected(self, endpoint: str) -> bool:
        """Whether the link to ``endpoint`` dropped its connection since the last look."""
        monitor = self.monitors.get(endpoint)
        dropped = False
        while monitor is not None and monitor.poll(0):
            monitor.recv_multipart()
            dropped = True          # the monitor reports nothing but disconnections
        return dropped

    def _watch_links(self, now: float) -> None:
        """Cut the wait of transfers whose peer's connection dropped (its worker died or
        stopped: its acknowledgement will not come) to :data:`PEER_GONE_GRACE_S`."""
        self._next_watch = now + WATCH_INTERVAL_S
        gone = {ep for ep in {out.endpoint for out in self.outgoing.values()}
                if self._disconnected(ep)}
        for out in self.outgoing.values():
            if out.endpoint in gone and not out.gone:
                out.gone = True
                out.deadline = min(out.deadline, now + PEER_GONE_GRACE_S)

    # ----------------------------------------------------------- peer messages (PULL side)

    def fill(self, owner: object, sender: str, msg: wire.PeerFill, frame: zmq.Frame) -> None:
        """A chunk relayed by the client ``sender`` on behalf of ``owner`` (no ack: the
        client's reply is the acknowledgement)."""
        transfer = self.incoming.get(msg.token)
        if transfer is not None and transfer.owner is not owner:
            raise WireError(ErrorCode.INVALID_HANDLE, "that transfer belongs to another session")
        if msg.error:
            if transfer is not None:
                self._finish_incoming(msg.token, f"the relaying client failed: {msg.error}")
            return
        self._on_chunk(wire.Chunk(msg.token, msg.seq, msg.nchunks, msg.start, msg.total, ""),
                       frame, sender)

    def drain(self) -> None:
        """Handle what peers pushed to us."""
        assert self.pull is not None
        for _ in range(256):
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.metrics.peer_in(frames)
            try:
                message = wire.decode_peer([f.buffer for f in frames[:1]] + frames[1:])
            except BadRequest as exc:
                log.warning("dropping a bad peer message from %s: %s",
                            _sender(frames[0], self.security.keys is not None),
                            printable(str(exc)))
                continue
            self._dispatch(message, frames)

    def _dispatch(self, message: wire.Chunk | wire.Ack | wire.Probe, frames: list[Any]) -> None:
        if isinstance(message, wire.Chunk):
            self._on_chunk(message, frames[1],
                           _sender(frames[0], self.security.keys is not None))
        elif isinstance(message, wire.Ack):
            self._on_ack(message)
        else:
            self._send_ack(message.reply_to, wire.Ack(message.token, True, "probe"))

    def _on_chunk(self, chunk: wire.Chunk, frame: zmq.Frame, sender: str) -> None:
        transfer = self.incoming.get(chunk.token)
        if transfer is None:
            self.stash.keep(chunk, frame, sender)
            return
        transfer.reply_to = chunk.reply_to or transfer.reply_to
        try:
            self._land(transfer, chunk, frame)
        except WireError as exc:
            self._finish_incoming(chunk.token, exc.message)
            return
        if len(transfer.received) == transfer.nchunks:
            self._finish_incoming(chunk.token, None)

    def _land(self, transfer: Incoming, chunk: wire.Chunk, frame: zmq.Frame) -> None:
        size = len(frame)
        total = transfer.ref.nbytes
        if chunk.total != total or chunk.start > total or size > total - chunk.start:
            raise WireError(ErrorCode.TRANSFER_FAILED,
                            f"chunk of {size} bytes at {chunk.start} does not fit a {total}-byte "
                            f"destination (sender says {chunk.total})")
        if transfer.nchunks not in (-1, chunk.nchunks) or chunk.seq in transfer.received:
            raise WireError(ErrorCode.TRANSFER_FAILED, "inconsistent or repeated chunk")
        transfer.nchunks = chunk.nchunks
        transfer.received.add(chunk.seq)
        transfer.nbytes += size
        if len(transfer.received) == transfer.nchunks and transfer.nbytes != total:
            raise WireError(ErrorCode.TRANSFER_FAILED, f"all {chunk.nchunks} chunks arrived but "
                            f"carried {transfer.nbytes} of {total} bytes")
        if transfer.target is not None:
            transfer.target[chunk.start:chunk.start + size] = frame.buffer
        elif transfer.staging is not None:
            transfer.staging[chunk.start:chunk.start + size] = np.frombuffer(frame.buffer, np.uint8)
        else:
            self.backend.write_bytes(transfer.view, chunk.start, frame.buffer)

    def _finish_incoming(self, token: bytes, error: str | None) -> None:
        transfer = self.incoming.pop(token)
        self.metrics.transfer("in", error is None)
        if error is None and transfer.staging is not None:
            self.backend.write(transfer.view, transfer.staging)
        transfer.done(error)                  # may run the session's next requests
        if transfer.reply_to:
            self._send_ack(transfer.reply_to, wire.Ack(token, error is None, error or "ok"))

    def _on_ack(self, ack: wire.Ack) -> None:
        out = self.outgoing.pop(ack.token, None)
        if out is None:
            return
        if ack.ok and out.probe:
            self.verified.add(out.endpoint)
        if not out.probe:
            self.metrics.transfer("out", ack.ok)
        out.done(None if ack.ok else f"{out.what} refused by the peer: {ack.message}")

    def _send_ack(self, endpoint: str, ack: wire.Ack) -> None:
        try:
            frame = wire.encode_peer(ack)
            self._send(self._link(endpoint), endpoint, [frame])
            self.metrics.peer_out((frame,))
        except (WireError, zmq.ZMQError) as exc:
            log.warning("cannot acknowledge to %s: %s", printable(endpoint, 100),
                        printable(str(exc)))

    # ----------------------------------------------------------------------- deadlines

    def expire(self, now: float) -> None:
        """Fail transfers past their deadline; forget stale stashed chunks."""
        for token, transfer in list(self.incoming.items()):
            if now >= transfer.deadline:
                got = f"{len(transfer.received)} of {max(transfer.nchunks, 0) or '?'} chunks"
                self._finish_incoming(token, f"transfer into {list(transfer.ref.shape)} timed "
                                             f"out ({got} arrived)")
        if self.outgoing and now >= self._next_watch:
            self._watch_links(now)
        for token, out in list(self.outgoing.items()):
            if now >= out.deadline:
                del self.outgoing[token]
                if not out.probe:
                    self.metrics.transfer("out", False)
                self._drop_link(out.endpoint)
                out.done(f"{out.what}: the peer's connection dropped and no acknowledgement "
                         f"came within {PEER_GONE_GRACE_S:g} s (its worker stopped or died)"
                         if out.gone else
                         f"{out.what}: no acknowledgement within the timeout (peer unreachable, "
                         "dead or too slow)")
        self.stash.expire(now)

    def forget(self, owner: object) -> None:
        """Drop everything of a closing session: its announced tokens' stashed chunks and its
        transfers (``done`` is not called: the executor answers their requests itself)."""
        self.stash.forget(owner)
        for token in [t for t, into in self.incoming.items() if into.owner is owner]:
            del self.incoming[token]
        for token in [t for t, out in self.outgoing.items() if out.owner is owner]:
            del self.outgoing[token]



def _sender(frame: Any, curve: bool) -> str:
    """Who pushed a peer message: its CURVE key (the ZAP handler's User-Id), else its address."""
    try:
        return str(frame.get("User-Id" if curve else "Peer-Address")) or "local"
    except (zmq.ZMQError, AttributeError, TypeError):
        return "local"
