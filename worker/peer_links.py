"""Worker-to-worker transfers, on the backend thread: the PULL socket, lazy PUSH links, bookkeeping.

Owned by the backend thread, like every other piece of tensor state: it binds the peer PULL socket,
opens one PUSH socket per destination peer on first use (and reuses it), writes arriving chunks
straight into their destination views, sends acknowledgements, and fails transfers at their
deadline. Nothing here blocks: the backend loop polls the PULL socket and calls :meth:`expire`.

Security (SECURITY.md): with a CURVE key pair the PULL port is a CURVE server in the ZAP domain
``zmq-rpc-peer`` (only this worker's own key and ``--worker-keys`` connect), and this worker pushes
only to endpoints that carry a key (``tcp://h:p#curve=KEY``) found among those same worker keys:
the CURVE handshake with that key is the peer handshake, so neither data nor acknowledgements go
to a port that is not a known worker. Chunks for transfers nobody here waits for yet are stashed
per sender (the connection's key, or its IP address without CURVE): one sender filling its share
drops only its own chunks, never another's.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from ..broker import peer as wire
from ..broker.broker import make_curve_server
from ..broker.errors import BadRequest
from ..broker.keys import KeyFileError, KeyPair, join_endpoint, split_endpoint
from ..broker.protocol import ErrorCode, TensorRef, WireError, split_tensor
from ..broker.wire import printable
from ..broker.zap import PEER_DOMAIN, KeySet

if TYPE_CHECKING:
    from .executor import Executor, Pending, Session

log = logging.getLogger("zmq_rpc.worker.peer")

CHUNK_BYTES = 4 << 20
ZERO_COPY_BYTES = 64 * 1024
"""Smaller chunks are copied into zmq messages: cheaper than tracking a zero-copy one."""
STASH_TTL = 30.0
MAX_LINKS = 64
MAX_STASHED_TRANSFERS = 4096
MAX_STASHED_PER_SENDER = 1024
"""Early transfers one sender may have stashed before any session announced them (a client with
512 copies in flight can have that many chunks arrive ahead of their receives when the
destination's request queue is backed up; 1,100 made-up ones from one address once denied every
legitimate copy: now they only push out that sender's oldest)."""


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


@dataclass
class Incoming:
    """A PEER_RECV at the head of its session's queue, collecting chunks into ``dst``."""

    pending: Pending
    ref: TensorRef
    view: Any
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

    pending: Pending
    endpoint: str
    deadline: float
    what: str


@dataclass
class Watched:
    """An unacknowledged send whose zero-copy chunks must have left by ``deadline``: else the
    peer is gone or stuck, and the link is dropped (which releases the source buffer)."""

    endpoint: str
    deadline: float
    trackers: list[zmq.MessageTracker]


@dataclass(frozen=True)
class Piece:
    """One chunk of a send, its header encoded ahead: ``data`` aliases the source buffer when
    the backend can hand its bytes out in place (read after the run, for nothing), else the
    piece's view is read when it is pushed."""

    header: bytes
    view: Any
    data: Any | None
    zero_copy: bool


@dataclass(frozen=True)
class Push:
    """A checked send, ready to go: its pieces, the source buffer, the link to the peer."""

    pieces: tuple[Piece, ...]
    buffer: Any
    endpoint: str
    link: zmq.Socket[bytes]


@dataclass
class Stashed:
    """Chunks that arrived before their PEER_RECV reached the head of its queue."""

    messages: list[tuple[wire.Chunk, zmq.Frame]] = field(default_factory=list)
    nbytes: int = 0
    expires: float = 0.0
    sender: str = ""
    announced: bool = False
    """A session queued a receive for it: never evicted for other senders' chunks."""


class PeerLinks:
    """The backend thread's peer sockets and the transfers in progress."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], bind: str, advertise: str,
                 max_message_size: int, executor: Executor,
                 security: PeerSecurity | None = None) -> None:
        self.ctx = ctx
        self.executor = executor
        self.security = security or PeerSecurity()
        keys = self.security.keys
        self.pull: zmq.Socket[bytes] | None = None
        self.endpoint = ""
        if bind:      # without one, transfers still arrive relayed by clients (PEER_FILL)
            self.pull = ctx.socket(zmq.PULL)
            self.pull.setsockopt(zmq.RCVHWM, 0)
            self.pull.setsockopt(zmq.MAXMSGSIZE, max_message_size)
            if keys is not None:
                make_curve_server(self.pull, keys, PEER_DOMAIN)
            self.pull.bind(bind)
            self.endpoint = advertise or self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
            if keys is not None and split_endpoint(self.endpoint)[1] is None:
                self.endpoint = join_endpoint(self.endpoint, keys.public)
        self.links: dict[str, zmq.Socket[bytes]] = {}
        self.incoming: dict[bytes, Incoming] = {}
        self.outgoing: dict[bytes, Outgoing] = {}
        self.watched: dict[bytes, Watched] = {}
        self.stash: dict[bytes, Stashed] = {}
        self.stash_bytes = 0
        self.stashed_by: dict[str, dict[bytes, None]] = {}
        """Each sender's unannounced stashed tokens, oldest first."""
        self.announced: dict[bytes, Session] = {}
        """Tokens of receives queued in a session and not started yet."""
        self._dropped = 0
        self.stash_limit = max(executor.limits.memory_limit // 4, 64 << 20)

    def close(self) -> None:
        if self.pull is not None:
            self.pull.close(linger=0)
        for sock in self.links.values():
            sock.close(linger=0)

    def next_deadline(self) -> float | None:
        """The earliest moment something here may time out."""
        times = [t.deadline for t in self.incoming.values()]
        times += [t.deadline for t in self.outgoing.values()]
        times += [t.deadline for t in self.watched.values()]
        if self.stash:
            times.append(next(iter(self.stash.values())).expires)
        return min(times) if times else None

    # ------------------------------------------------------------- requests (from executor)

    def announce(self, session: Session, msg: Any) -> None:
        """A session queued a PEER_RECV (or a linked run's receives): chunks for these tokens
        that arrive before the receive starts are kept apart from unannounced ones."""
        tokens = [msg.token] if isinstance(msg, wire.PeerRecv) else [r.token for r in msg.receive]
        for token in tokens:
            if token in self.incoming or token in self.announced:
                continue
            self.announced[token] = session
            entry = self.stash.get(token)
            if entry is not None and not entry.announced:
                self._forget(entry.sender, token)
                entry.announced = True

    def start_recv(self, pending: Pending, msg: wire.PeerRecv) -> None:
        """Begin receiving into ``msg.dst`` (chunks stashed earlier may finish it at once)."""
        if msg.token in self.incoming:
            raise WireError(ErrorCode.TRANSFER_FAILED, "that transfer token is already in use")
        if self.announced.get(msg.token) is pending.session:
            del self.announced[msg.token]
        view = self.executor.view(pending.session, msg.dst)
        contiguous = msg.dst.is_contiguous()
        staging = None if contiguous else np.empty(msg.dst.nbytes, np.uint8)
        in_place = self.executor.backend.alias(view) if contiguous else None
        self.incoming[msg.token] = Incoming(
            pending, msg.dst, view, time.monotonic() + msg.timeout_ms / 1000, staging,
            None if in_place is None else memoryview(in_place))
        stashed = self._unstash(msg.token)
        if stashed is not None:
            for chunk, frame in stashed.messages:
                if msg.token in self.incoming:
                    self._on_chunk(chunk, frame, stashed.sender)

    def start_send(self, pending: Pending, msg: wire.PeerSend) -> bool:
        """Push ``msg.src`` to ``msg.endpoint`` in chunks; True when the reply waits for the
        peer's ack (``msg.acked``), False when it may go now (the chunks are with zmq)."""
        push = self.prepare_push(pending.session, wire.Send(msg.token, msg.src, msg.endpoint),
                                 acknowledge=msg.acked)
        deadline = time.monotonic() + msg.timeout_ms / 1000
        if msg.acked:
            self.outgoing[msg.token] = Outgoing(pending, msg.endpoint, deadline,
                                                f"transfer to {msg.endpoint}")
        trackers = self.push(push)
        if not msg.acked and trackers:
            self.watched[msg.token] = Watched(msg.endpoint, deadline, trackers)
        return msg.acked

    def prepare_push(self, session: Session, send: wire.Send, acknowledge: bool) -> Push:
        """Check a send (source view, peer endpoint, link) and encode its chunk headers before
        anything it follows runs: after the run, pushing is only handing frames to zmq. With
        ``acknowledge`` the receiver answers once it has everything, else it sends nothing."""
        if not self.endpoint:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker has no peer endpoint")
        view = self.executor.view(session, send.src)
        buffer = session.buffers[send.src.buffer]
        backend = self.executor.backend
        sub_refs = split_tensor(send.src, CHUNK_BYTES)
        reply_to = self.endpoint if acknowledge else ""
        pieces = []
        for seq, (start, sub) in enumerate(sub_refs):
            piece_view = view if len(sub_refs) == 1 else backend.view(buffer.memory, sub)
            data = backend.alias(piece_view)
            header = wire.encode_peer(wire.Chunk(send.token, seq, len(sub_refs), start,
                                                  send.src.nbytes, reply_to))
            pieces.append(Piece(header, piece_view, data,
                                data is not None and sub.nbytes >= ZERO_COPY_BYTES))
        return Push(tuple(pieces), buffer, send.endpoint, self._link(send.endpoint))

    def push(self, push: Push) -> list[zmq.MessageTracker]:
        """Send the prepared chunks (zero-copy from the buffer when big and aliased); returns
        the trackers of the zero-copy ones."""
        link = push.link if not push.link.closed else self._link(push.endpoint)
        trackers = []
        for piece in push.pieces:
            data = piece.data
            if data is None:
                data = self.executor.backend.read(piece.view)[0]
            if piece.zero_copy:
                tracker = link.send_multipart([piece.header, data], copy=False, track=True)
                if tracker is not None:
                    push.buffer.sending.append(tracker)
                    trackers.append(tracker)
            else:
                link.send_multipart([piece.header, data], copy=False)
        return trackers

    def start_probe(self, pending: Pending, msg: wire.PeerProbe) -> None:
        token = os.urandom(wire.TOKEN_BYTES)
        link = self._link(msg.endpoint)
        self.outgoing[token] = Outgoing(pending, msg.endpoint,
                                        time.monotonic() + msg.timeout_ms / 1000,
                                        f"probe of {msg.endpoint}")
        link.send(wire.encode_peer(wire.Probe(token, self.endpoint)))

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
        return sock

    def _drop_link(self, endpoint: str) -> None:
        """Close a link whose peer failed us: what is queued on it is dropped, next use reconnects."""
        sock = self.links.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    # ----------------------------------------------------------- peer messages (PULL side)

    def fill(self, session: Session, msg: wire.PeerFill, frame: zmq.Frame) -> None:
        """A chunk relayed by the client (no ack: the client's reply is the acknowledgement)."""
        transfer = self.incoming.get(msg.token)
        if transfer is not None and transfer.pending.session is not session:
            raise WireError(ErrorCode.INVALID_HANDLE, "that transfer belongs to another session")
        if msg.error:
            if transfer is not None:
                self._finish_incoming(msg.token, f"the relaying client failed: {msg.error}")
            return
        self._on_chunk(wire.Chunk(msg.token, msg.seq, msg.nchunks, msg.start, msg.total, ""),
                       frame, f"client {session.label}")

    def drain(self) -> None:
        """Handle what peers pushed to us."""
        assert self.pull is not None
        for _ in range(256):
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
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
            self._stash(chunk, frame, sender)
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
            self.executor.backend.write_bytes(transfer.view, chunk.start, frame.buffer)

    def _stash(self, chunk: wire.Chunk, frame: zmq.Frame, sender: str) -> None:
        """Keep a chunk whose PEER_RECV has not started yet. Chunks of announced transfers (a
        session queued their receive) are bounded only by the stash's bytes. Others are kept
        at most MAX_STASHED_PER_SENDER transfers per sender, a sender's oldest making room for
        its newest, and MAX_STASHED_TRANSFERS in all, the heaviest sender's oldest making room:
        made-up chunks never evict announced ones, nor another sender's while that sender
        stashes less. The dict stays in expiry order, so expiring pops from the front."""
        entry = self.stash.pop(chunk.token, None)
        if entry is not None and entry.sender != sender:
            self.stash[chunk.token] = entry
            self._drop(sender, "a token another sender stashed")
            return
        if self.stash_bytes + len(frame) > self.stash_limit:
            if entry is not None:
                self.stash[chunk.token] = entry
            self._drop(sender, "stash bytes full")
            return
        if entry is None:
            announced = chunk.token in self.announced
            if not announced and not self._make_room(sender):
                self._drop(sender, "stash full")
                return
            entry = Stashed(sender=sender, announced=announced)
            if not announced:
                self.stashed_by.setdefault(sender, {})[chunk.token] = None
        entry.messages.append((chunk, frame))
        entry.nbytes += len(frame)
        entry.expires = time.monotonic() + STASH_TTL
        self.stash[chunk.token] = entry
        self.stash_bytes += len(frame)

    def _make_room(self, sender: str) -> bool:
        """Room for one more unannounced transfer from ``sender``: evicts its own oldest when
        it has its share, else the heaviest sender's oldest when the stash is full."""
        mine = self.stashed_by.get(sender, {})
        victim = sender if len(mine) >= MAX_STASHED_PER_SENDER else None
        if victim is None and len(self.stash) >= MAX_STASHED_TRANSFERS:
            victim = max(self.stashed_by, key=lambda s: len(self.stashed_by[s]), default=None)
        if victim is None:
            return len(self.stash) < MAX_STASHED_TRANSFERS
        self._unstash(next(iter(self.stashed_by[victim])))
        self._drop(victim, "its oldest early transfer evicted")
        return True

    def _forget(self, sender: str, token: bytes) -> None:
        tokens = self.stashed_by.get(sender)
        if tokens is not None:
            tokens.pop(token, None)
            if not tokens:
                del self.stashed_by[sender]

    def _unstash(self, token: bytes) -> Stashed | None:
        entry = self.stash.pop(token, None)
        if entry is not None:
            self.stash_bytes -= entry.nbytes
            if not entry.announced:
                self._forget(entry.sender, token)
        return entry

    def _drop(self, sender: str, why: str) -> None:
        self._dropped += 1
        if self._dropped in (1, 10, 100, 1000) or self._dropped % 10000 == 0:
            log.warning("dropped %d chunk(s) for unknown transfers (last from %s: %s)",
                        self._dropped, printable(sender, 64), why)

    def _finish_incoming(self, token: bytes, error: str | None) -> None:
        transfer = self.incoming.pop(token)
        if error is None and transfer.staging is not None:
            self.executor.backend.write(transfer.view, transfer.staging)
        self.executor.finish(transfer.pending, error)   # may run the session's next requests
        if transfer.reply_to:
            self._send_ack(transfer.reply_to, wire.Ack(token, error is None, error or "ok"))

    def _on_ack(self, ack: wire.Ack) -> None:
        out = self.outgoing.pop(ack.token, None)
        if out is None:
            return
        self.executor.finish(out.pending, None if ack.ok else
                             f"{out.what} refused by the peer: {ack.message}")

    def _send_ack(self, endpoint: str, ack: wire.Ack) -> None:
        try:
            self._link(endpoint).send(wire.encode_peer(ack), zmq.NOBLOCK)
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
        for token, out in list(self.outgoing.items()):
            if now >= out.deadline:
                del self.outgoing[token]
                self._drop_link(out.endpoint)
                self.executor.finish(out.pending, f"{out.what}: no acknowledgement within the "
                                                  "timeout (peer unreachable, dead or too slow)")
        for token, watch in list(self.watched.items()):
            if all(t.done for t in watch.trackers):
                del self.watched[token]
            elif now >= watch.deadline:
                del self.watched[token]
                log.warning("a transfer to %s had not left by its deadline: dropping the link "
                            "(peer dead or stuck)", watch.endpoint)
                self._drop_link(watch.endpoint)
        while self.stash:
            token, entry = next(iter(self.stash.items()))
            if now < entry.expires:
                break
            self._unstash(token)

    def fail_session(self, session: Session) -> list[Pending]:
        """Forget the transfers of a closing session; returns their requests (the executor
        answers them: a client that said GOODBYE still gets a reply to each)."""
        dropped: list[Pending] = []
        for tok in [t for t, owner in self.announced.items() if owner is session]:
            del self.announced[tok]
            self._unstash(tok)
        for token, incoming in list(self.incoming.items()):
            if incoming.pending.session is session:
                dropped.append(self.incoming.pop(token).pending)
        for token, outgoing in list(self.outgoing.items()):
            if outgoing.pending.session is session:
                dropped.append(self.outgoing.pop(token).pending)
        return dropped



def _sender(frame: Any, curve: bool) -> str:
    """Who pushed a peer message: its CURVE key (the ZAP handler's User-Id), else its address."""
    try:
        return str(frame.get("User-Id" if curve else "Peer-Address")) or "local"
    except (zmq.ZMQError, AttributeError, TypeError):
        return "local"
