"""Peer-copy commands: PEER_RECV, PEER_SEND, PEER_PROBE and the client-relayed PEER_FILL.

Owned by the backend thread (the executor calls these handlers). They check the session's side
of a transfer (views, buffers) and hand :class:`~zmq_rpc.worker.peer.links.PeerLinks` only what
it needs: a view or a :class:`~zmq_rpc.worker.peer.send.Source`, the session as the transfer's
owner, and a ``done`` callable that tells the executor how the transfer ended.
"""

from __future__ import annotations

from collections.abc import Callable

from ...broker import peer as wire
from ...broker.protocol import Cmd, TensorRef
from ..backends.base import View
from ..sessions.quotas import Charged
from ..sessions.session import NO_REPLY, Admission, Later, Outcome, Reply, Request, Route, Session
from ..sessions.views import Views
from .acks import Done
from .links import PeerLinks
from .send import ZERO_COPY_BYTES, Push, Source

TransferDone = Callable[[Session, Request, "str | None"], None]
"""The executor's side of a transfer's end: (session, request, None or why it failed)."""


class PeerCommands:
    """The handlers of the peer-copy commands, and the receives and pushes of linked runs."""

    def __init__(self, peers: PeerLinks, views: Views, transfer_done: TransferDone) -> None:
        self.peers = peers
        self.views = views
        self.memory = views.memory
        self.transfer_done = transfer_done

    def routes(self) -> dict[Cmd, Route]:
        """This module's part of the executor's dispatch table."""
        return {
            Cmd.PEER_RECV: Route(self.recv, writes=lambda s, m: [m.dst.buffer],
                                 queued=lambda s, m: self.announce(s, [m.token])),
            Cmd.PEER_SEND: Route(self.send, eager=True),
            Cmd.PEER_PROBE: Route(self.probe),
            Cmd.PEER_FILL: Route(self.fill, admission=Admission.AT_ONCE),
        }

    def recv(self, session: Session, msg: wire.PeerRecv, req: Request) -> Outcome:
        """Holds the session's queue until the bytes have landed in ``msg.dst``."""
        self.receive(session, req, msg.token, msg.dst, msg.timeout_ms, msg.source)
        return Later.HOLD

    def send(self, session: Session, msg: wire.PeerSend, req: Request) -> Outcome:
        """Answered when the peer acknowledges, the queue going on meanwhile. A small send that
        asks for no acknowledgement (``acked`` false, 1.4; under ZERO_COPY_BYTES, every chunk
        copied into zmq) is answered as soon as it is pushed; a bigger one is still
        acknowledged: its reply then says its zero-copy chunks have left this worker, so that
        the client learns of this worker's death while they depend on it."""
        send = wire.Send(msg.token, msg.src, msg.endpoint)
        source = self.source(session, msg.src)
        if not msg.acked and msg.src.nbytes < ZERO_COPY_BYTES:
            self.peers.send_unacked(send, source)
            return NO_REPLY
        self.peers.start_send(send, source, msg.timeout_ms, session, self._done(session, req))
        return Later.ANSWERED_LATER

    def probe(self, session: Session, msg: wire.PeerProbe, req: Request) -> Outcome:
        self.peers.start_probe(msg.endpoint, msg.timeout_ms, session, self._done(session, req))
        return Later.ANSWERED_LATER

    def fill(self, session: Session, msg: wire.PeerFill, req: Request) -> Reply:
        self.peers.fill(session, f"client {session.label}", msg, req.payload[0])
        return NO_REPLY

    def announce(self, session: Session, tokens: list[bytes]) -> None:
        """Receives queued in ``session``: their early chunks are kept, whoever floods."""
        self.peers.announce(session, tokens)

    def receive(self, session: Session, req: Request, token: bytes, dst: TensorRef,
                timeout_ms: int, source: str = "") -> None:
        """Start receiving ``token`` into ``dst`` for ``req``, which is in flight until its
        transfer ends (chunks stashed earlier may end it before this returns); ``source``: the
        sender's peer endpoint, whose link is then watched."""
        view = self.views.view(session, dst)
        req.in_flight = True
        try:
            self.peers.start_recv(token, dst, view, timeout_ms, session, self._done(session, req),
                                  source)
        except BaseException:
            req.in_flight = False
            raise

    def prepare_push(self, session: Session, send: wire.Send) -> Push:
        """A linked run's send, checked and encoded (pushed with :meth:`push`, unacknowledged)."""
        return self.peers.prepare_push(send, self.source(session, send.src), acknowledge=False)

    def push(self, push: Push) -> None:
        self.peers.push(push)

    def source(self, session: Session, ref: TensorRef) -> Source:
        """What a send of ``ref`` reads: its checked view, and its buffer's memory and trackers."""
        view = self.views.view(session, ref)
        buf = self.views.buffer(session, ref.buffer)

        def copy(piece: View, endpoint: str) -> Charged:
            nbytes = piece.nbytes
            data = self.memory.allocate(session, nbytes, "peer send",
                                        lambda: self.views.backend.read(piece)[0])
            return Charged(data, nbytes, session.usage, endpoint)

        return Source(view, buf.memory, buf.sending.append, copy, self.memory.inflight.add)

    def _done(self, session: Session, req: Request) -> Done:
        return lambda error: self.transfer_done(session, req, error)
