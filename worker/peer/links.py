"""Worker-to-worker transfers, on the backend thread: the PULL socket and the pieces of a transfer.

Owned by the backend thread, like every other piece of tensor state: :class:`PeerLinks` binds the
peer PULL socket, reads and decodes what peers push to it, and routes the executor's requests to
the pieces that each do one job, all on this thread:

- :mod:`~zmq_rpc.worker.peer.push`: the PUSH sockets to other workers (opened on first use,
  reused, monitored, never blocking a send);
- :mod:`~zmq_rpc.worker.peer.send`: a send cut into chunks, headers encoded ahead, then pushed;
- :mod:`~zmq_rpc.worker.peer.receive`: receives in progress, chunks checked and landed straight
  into their destination views (no socket);
- :mod:`~zmq_rpc.worker.peer.acks`: sends and probes waiting for an acknowledgement, their
  deadlines and dropped peers (no socket);
- :mod:`~zmq_rpc.worker.peer.endpoints`: which endpoints may be connected to, as whom.

Nothing here blocks: the backend loop polls the PULL socket (:meth:`PeerLinks.drain`) and calls
:meth:`PeerLinks.expire`. Built before the executor and handed nothing of it: each transfer comes
with what it needs (the destination view, or a :class:`~zmq_rpc.worker.peer.send.Source`), an
``owner`` (its session, compared by identity only) and a ``done`` callable told the outcome once
(None on success, else why it failed).

Security (SECURITY.md): with a CURVE key pair the PULL port is a CURVE server in the ZAP domain
``zmq-rpc-peer`` (only this worker's own key and ``--worker-keys`` connect), and this worker pushes
only to endpoints that carry a key (``tcp://h:p#curve=KEY``) found among those same worker keys:
the CURVE handshake with that key is the peer handshake, so neither data nor acknowledgements go
to a port that is not a known worker. Chunks for transfers nobody here waits for yet are kept by
:class:`~zmq_rpc.worker.peer.stash.Stash`, per sender.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from ...broker import peer as wire
from ...broker.broker import make_curve_server
from ...broker.endpoints import needs_ipv6
from ...broker.errors import BadRequest
from ...broker.keys import join_endpoint, split_endpoint
from ...broker.protocol import ErrorCode, TensorRef, WireError
from ...broker.wire import printable
from ...broker.zap import PEER_DOMAIN
from ..backends.base import Backend, View
from ..observe.logs import Throttled
from ..observe.metrics import NullRecorder, Recorder
from ..sessions.memory import MemoryBudget
from .acks import WATCH_INTERVAL_S, AwaitedAcks, Done, LinkHooks, Outgoing, link_lost
from .endpoints import PeerSecurity, resolve_endpoint
from .push import PushLinks
from .queue import PeerQueue
from .receive import Incoming, Receives
from .send import ZERO_COPY_BYTES, Push, Pusher, Source
from .stash import Stash

log = logging.getLogger("zmq_rpc.worker.peer")

RECEIVE_GRACE_S = 0.5
"""Once the link to a receive's sender is lost, how long its chunks may still land (what was on
the wire before the link was seen lost, or before the sender's process ended, is in by then)."""
LINK_READ_S = 0.1
"""How often every push link's monitor is read (PushLinks.read_all): a link reconnecting at
libzmq's 100 ms interval makes at most ~2 events in that time, its pipe holds 1,000."""
DRAIN_BATCH = 256
"""Peer messages handled per :meth:`PeerLinks.drain` (then the backend loop polls again)."""


class PeerLinks:
    """The backend thread's peer sockets and the transfers in progress."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: Backend, *, bind: str = "",
                 advertise: str = "",
                 stash_limit: int = 64 << 20, security: PeerSecurity | None = None,
                 links: PushLinks | None = None) -> None:
        self.security = security or PeerSecurity()
        self.pull: zmq.Socket[bytes] | None = None
        self.queue: PeerQueue | None = None
        """The PULL's receive queues, bounded and counted in --mem (None without a PULL)."""
        self.endpoint = ""
        self.bound = ""
        """What the PULL socket listens on (libzmq's ``LAST_ENDPOINT``; "" without one)."""
        if bind:      # without one, transfers still arrive relayed by clients (PEER_FILL)
            self.pull = self._bind(ctx, bind)
            try:
                self.endpoint = self._advertised(self.pull, advertise)
            except BaseException:
                self._close_pull()
                raise
        self.links = links if links is not None else PushLinks(ctx, self.security)
        """The PUSH sockets to peers (a test may hand in fakes)."""
        self.stash = Stash(stash_limit)
        self.receives = Receives(backend, self.stash, self._send_ack)
        self.acks = AwaitedAcks(LinkHooks(self.links.disconnected, self.links.drop,
                                          self.links.verify, self.links.lost_for),
                                self.endpoint)
        self._next_watch = 0.0
        self._next_link_read = 0.0
        self.pusher = Pusher(backend, self.links)
        self._metrics: Recorder = NullRecorder()
        self.bad_messages = Throttled(log)
        """Bad peer messages dropped (``count``), logged at most every few seconds."""
        self._unacknowledged = Throttled(log)

    def _bind(self, ctx: zmq.Context[zmq.Socket[bytes]], bind: str) -> zmq.Socket[bytes]:
        """The peer PULL socket, bound; a bind that fails closes it and raises OSError saying
        why (a socket left open would keep the context's term(), and the worker's exit, waiting
        for good: a taken --peer-bind port kept the worker from exiting for 8-19 s or more)."""
        pull = ctx.socket(zmq.PULL)
        self.queue = PeerQueue(pull)          # RCVHWM, MAXMSGSIZE, connections watched
        try:
            pull.setsockopt(zmq.IPV6, needs_ipv6(bind))
            if self.security.keys is not None:
                make_curve_server(pull, self.security.keys, PEER_DOMAIN)
            pull.bind(bind)
            self.bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.pull = pull
            self._close_pull()
            hint = (" (another process listens there: choose another port, or port * for a "
                    "free one)" if exc.errno == zmq.EADDRINUSE else "")
            raise OSError(f"cannot bind the peer port {printable(bind, 200)}: "
                          f"{zmq.strerror(exc.errno or 0)}{hint}") from None
        return pull

    def _close_pull(self) -> None:
        """Close the PULL and its queue's monitor (a bind or advertisement that failed)."""
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        if self.pull is not None:
            self.pull.close(linger=0)
            self.pull = None

    def _advertised(self, pull: zmq.Socket[bytes], advertise: str) -> str:
        """The endpoint peers reach this worker at (with this worker's key under CURVE)."""
        endpoint = resolve_endpoint(advertise) if advertise else self.bound
        keys = self.security.keys
        if keys is not None and split_endpoint(endpoint)[1] is None:
            endpoint = join_endpoint(endpoint, keys.public)
        return endpoint

    def use_budget(self, budget: MemoryBudget) -> None:
        """Count what this side holds for peers against ``budget`` (the worker's ``--mem``):
        the early-chunk stash and the PULL's receive queues."""
        self.stash.use_budget(budget)
        if self.queue is not None:
            self.queue.use_budget(budget)

    @property
    def metrics(self) -> Recorder:
        """Set by the worker when it serves metrics (bytes and transfers on the peer link)."""
        return self._metrics

    @metrics.setter
    def metrics(self, recorder: Recorder) -> None:
        self._metrics = self.receives.metrics = self.acks.metrics = recorder
        self.pusher.metrics = recorder

    @property
    def incoming(self) -> dict[bytes, Incoming]:
        """The receives in progress, by token."""
        return self.receives.pending

    @property
    def outgoing(self) -> dict[bytes, Outgoing]:
        """The sends and probes waiting for an acknowledgement, by token."""
        return self.acks.pending

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
        if self.pull is not None:
            self.pull.close(linger=0)
        self.links.close()

    def next_deadline(self) -> float | None:
        """The earliest moment something here may time out."""
        times = [self.receives.next_deadline(), self.acks.next_deadline(),
                 self.stash.next_expiry(), self._next_watch if self._watched() else None]
        return min((t for t in times if t is not None), default=None)

    # ------------------------------------------------------------- requests (from executor)

    def announce(self, owner: object, tokens: list[bytes]) -> None:
        """A session queued a PEER_RECV (or a linked run's receives): chunks for these tokens
        that arrive before the receive starts are kept apart from unannounced ones."""
        self.receives.announce(owner, tokens)

    def start_recv(self, token: bytes, dst: TensorRef, view: View, timeout_ms: int,
                   owner: object, done: Done, source: str = "") -> None:
        """Begin receiving transfer ``token`` into ``view`` (the checked view of ``dst``);
        chunks stashed earlier may finish it, and call ``done``, before this returns. With a
        ``source`` (the sender's peer endpoint) this worker opens its own link to the sender
        and fails the receive once that link is lost (:meth:`expire`)."""
        watched = self._watch_link(source)
        self.receives.start(token, dst, view, timeout_ms, owner, done, watched)

    def _watch_link(self, source: str) -> str:
        """Open (or reuse) the link to ``source`` so that its TCP keepalive tells whether the
        sender is still reachable; "" when it cannot be watched (not a peer endpoint this
        worker may connect to: the receive then ends at its deadline, as before 1.9)."""
        if not source or source == self.endpoint:
            return ""
        try:
            self.links.get(source)
        except WireError as exc:
            log.info("not watching the link to %s: %s", printable(source, 100),
                     printable(exc.message))
            return ""
        return source

    def start_send(self, send: wire.Send, source: Source, timeout_ms: int, owner: object,
                   done: Done) -> None:
        """Push ``source`` to ``send.endpoint`` in chunks; ``done`` hears the peer's ack."""
        push = self.prepare_push(send, source, acknowledge=True)
        self.acks.wait(send.token, Outgoing(owner, done, send.endpoint,
                                            time.monotonic() + timeout_ms / 1000,
                                            f"transfer to {send.endpoint}"))
        try:
            self.push(push)
        except WireError:
            self.acks.cancel(send.token)
            raise

    def send_unacked(self, send: wire.Send, source: Source) -> None:
        """Push a small ``source`` (under ZERO_COPY_BYTES: every chunk is copied into zmq
        here, so nothing of it depends on the source buffer, nor on this worker's life beyond
        its I/O thread's next write) and ask the peer for no acknowledgement: its own request
        reports the landing."""
        if send.src.nbytes >= ZERO_COPY_BYTES:
            raise WireError(ErrorCode.INTERNAL, "an unacknowledged send must be small")
        self.push(self.prepare_push(send, source, acknowledge=False))

    def prepare_push(self, send: wire.Send, source: Source, acknowledge: bool) -> Push:
        """Check a send (peer endpoint, link) and encode its chunk headers before anything it
        follows runs: after the run, pushing is only handing frames to zmq. With
        ``acknowledge`` the receiver answers once it has everything, else it sends nothing."""
        self._need_endpoint()
        return self.pusher.prepare(send, source, self.endpoint if acknowledge else "")

    def push(self, push: Push) -> None:
        """Send the prepared chunks (zero-copy from the buffer when big and aliased)."""
        self.pusher.push(push)

    def drop_link(self, endpoint: str) -> None:
        """Close a link and drop what is queued on it (its session closed)."""
        self.links.drop(endpoint)

    def start_probe(self, endpoint: str, timeout_ms: int, owner: object, done: Done) -> None:
        """Ask the peer at ``endpoint`` to answer; ``done`` hears whether it did in time."""
        self._need_endpoint()
        token = os.urandom(wire.TOKEN_BYTES)
        link = self.links.get(endpoint)
        self.acks.wait(token, Outgoing(owner, done, endpoint,
                                       time.monotonic() + timeout_ms / 1000,
                                       f"probe of {endpoint}", probe=True))
        probe = wire.encode_peer(wire.Probe(token, self.endpoint))
        self.metrics.peer_out((probe,))
        try:
            self.links.send(link, endpoint, [probe])
        except WireError:
            self.acks.cancel(token)
            raise

    def _need_endpoint(self) -> None:
        if not self.endpoint:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker has no peer endpoint")

    # ----------------------------------------------------------- peer messages (PULL side)

    def fill(self, owner: object, sender: str, msg: wire.PeerFill, frame: zmq.Frame) -> None:
        """A chunk relayed by the client ``sender`` on behalf of ``owner`` (no ack: the
        client's reply is the acknowledgement)."""
        self.receives.fill(owner, sender, msg, frame)

    def drain(self) -> None:
        """Handle what peers pushed to us."""
        assert self.pull is not None
        for _ in range(DRAIN_BATCH):
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.metrics.peer_in(frames)
            try:
                message = wire.decode_peer([f.buffer for f in frames[:1]] + frames[1:])
            except BadRequest as exc:
                self.bad_messages.warning("dropping a bad peer message from %s: %s",
                                          _sender(frames[0], self.security.keys is not None),
                                          printable(str(exc)))
                continue
            self._dispatch(message, frames)

    def _dispatch(self, message: wire.Chunk | wire.Ack | wire.Probe, frames: list[Any]) -> None:
        if isinstance(message, wire.Chunk):
            self.receives.on_chunk(message, frames[1],
                                   _sender(frames[0], self.security.keys is not None))
        elif isinstance(message, wire.Ack):
            self.acks.on_ack(message)
        else:
            self._send_ack(message.reply_to, wire.Ack(message.token, True, "probe"))

    def _send_ack(self, endpoint: str, ack: wire.Ack) -> None:
        try:
            frame = wire.encode_peer(ack)
            self.links.send_to(endpoint, [frame])
            self.metrics.peer_out((frame,))
        except (WireError, zmq.ZMQError) as exc:
            self._unacknowledged.warning("cannot acknowledge to %s: %s",
                                         printable(endpoint, 100), printable(str(exc)))

    # ----------------------------------------------------------------------- deadlines

    def expire(self, now: float) -> None:
        """Fail transfers past their deadline, and receives whose sender's link is lost;
        forget stale stashed chunks."""
        if self._watched() and now >= self._next_watch:
            self._watch_receives(now)
        if now >= self._next_link_read:           # no link monitor's pipe ever fills
            self.links.read_all()
            self._next_link_read = now + LINK_READ_S
        self.receives.expire(now)
        self.acks.expire(now)
        self.stash.expire(now)
        if self.queue is not None:
            self.queue.update()

    def _watched(self) -> bool:
        return any(into.source for into in self.receives.pending.values())

    def _watch_receives(self, now: float) -> None:
        """Fail each receive whose sender's link has been lost for RECEIVE_GRACE_S with
        PEER_UNREACHABLE: with the links' keepalive that is at most LINK_LOSS_S + 0.5 s after
        the link went down, whatever the sender did (an unacknowledged hand-off tells the
        sender nothing)."""
        self._next_watch = now + WATCH_INTERVAL_S
        for token, into in list(self.receives.pending.items()):
            if not into.source or token not in self.receives.pending:
                continue
            lost = self.links.lost_for(into.source, into.started)
            if lost is not None and lost >= RECEIVE_GRACE_S:
                self.receives.finish(token, link_lost(
                    self.endpoint, into.source, now - into.started,
                    f"receiving {into.progress()} into {list(into.ref.shape)}"))

    def forget(self, owner: object) -> None:
        """Drop everything of a closing session: its announced tokens' stashed chunks and its
        transfers (``done`` is not called: the executor answers their requests itself)."""
        self.stash.forget(owner)
        self.receives.forget(owner)
        self.acks.forget(owner)


def _sender(frame: Any, curve: bool) -> str:
    """Who pushed a peer message: its CURVE key (the ZAP handler's User-Id), else its address."""
    try:
        return str(frame.get("User-Id" if curve else "Peer-Address")) or "local"
    except (zmq.ZMQError, AttributeError, TypeError):
        return "local"
