"""Open sessions, on the backend thread: who may open one (HELLO), and what closing one does.

Owned by the backend thread (through :class:`~zmq_rpc.worker.dispatch.executor.Executor`, which routes
HELLO here and asks for closings). A session opens at an accepted HELLO (protocol major, a
client-chosen routing id, room under ``--max-sessions``) and closes at GOODBYE, after the session
timeout of silence (no message handled since its last request ran, and none read but waiting),
or when room is short (``--max-sessions``, memory) and it has been silent for
:data:`PRESSURE_SILENCE`. Closing frees its memory, drops its peer links' queued pushes and
its transfers, and answers everything it still waits for with an error. No sockets: replies
leave through the :class:`~zmq_rpc.worker.dispatch.outbox.Outbox`, peer links are reached through two
callables.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ...broker import protocol as p
from ...broker.protocol import ErrorCode, WireError
from ...broker.request_mac import Verifier, derive, new_exchange
from ...broker.wire import printable
from ..dispatch.outbox import Outbox
from ..observe.metrics import Recorder
from .identities import Identities, IdentityQuotas
from .memory import SessionMemory
from .session import Outcome, Request, Session, WorkerLimits

log = logging.getLogger("zmq_rpc.worker")

PRESSURE_SILENCE = 6.0
"""When memory is short, sessions silent this long (3 heartbeats of zmq-rpc's client) are closed
to make room, instead of holding their memory for the whole session timeout."""

DRAINING = ("HELLO refused: this worker is draining (it got SIGTERM and leaves once its "
            "sessions have closed, within its --drain-timeout); connect to another worker")

MIN_CLIENT_ID = 16
WEAK_ID = (f"HELLO refused: this connection has no client-chosen routing id of at least "
           f"{MIN_CLIENT_ID} bytes. Sessions are keyed by it, so it must be unguessable: set "
           f"ZMQ_ROUTING_ID to {MIN_CLIENT_ID} random bytes (not starting with 0x00) before "
           "connecting (zmq_rpc.client does).")


def strong_client_id(client_id: bytes) -> bool:
    """Whether a routing id can key a session: client-chosen, random-length enough to be
    unguessable. libzmq names a peer that chose none ``0x00`` + a counter that any other
    connection can name after it leaves; such a peer gets no session."""
    return len(client_id) >= MIN_CLIENT_ID and client_id[0] != 0


@dataclasses.dataclass(frozen=True)
class PeerCleanup:
    """What closing a session needs of the peer links."""

    drop_link: Callable[[str], None]
    """Close a link, dropping what is queued on it."""
    forget: Callable[[object], None]
    """Drop a session's transfers and stashed chunks (their ``done`` is not called)."""


class Greeter(Protocol):
    """Who says what this worker is (:class:`~zmq_rpc.worker.dispatch.self_report.SelfReport`)."""

    def hello_reply(self) -> p.HelloReply:
        """HELLO's reply."""
        ...


class SessionTable:
    """The open sessions by routing id, and their opening and closing."""

    def __init__(self, sessions: dict[bytes, Session], limits: WorkerLimits,
                 accounts: SessionMemory, outbox: Outbox, metrics: Recorder, peers: PeerCleanup,
                 greeter: Greeter, identities: Identities | None = None) -> None:
        self.sessions = sessions
        self.identities = identities or Identities(     # without CURVE: a session each
            IdentityQuotas(limits.memory_limit, limits.max_sessions), None)
        self.limits = limits
        self.accounts = accounts
        self.outbox = outbox
        self.metrics = metrics
        self.peers = peers
        self.greeter = greeter
        self._ids = 0
        self.draining = False
        """The worker is leaving: a HELLO that would open a session is refused."""

    def hello(self, session: Session, msg: p.Hello, req: Request) -> Outcome:
        """HELLO: open ``session`` (or refresh an open one) and say what this worker is."""
        if msg.major != p.PROTOCOL_VERSION[0]:
            raise WireError(ErrorCode.VERSION_MISMATCH,
                            f"client speaks protocol {msg.major}.{msg.minor}, worker speaks "
                            f"{p.PROTOCOL_VERSION[0]}.{p.PROTOCOL_VERSION[1]}")
        if not strong_client_id(session.client_id):
            raise WireError(ErrorCode.BAD_REQUEST, WEAK_ID)
        identity = self.identities.of_hello(session, msg)
        exchange: tuple[bytes, Verifier] | None = None
        if self.sessions.get(session.client_id) is not session:
            if self.draining:
                raise WireError(ErrorCode.SHUTTING_DOWN, DRAINING)
            exchange = self._exchange(session, msg.exchange)
            self._open(session, msg.client, identity)
        else:
            self.identities.check_bound(session, identity)
            if msg.exchange:
                raise WireError(ErrorCode.BAD_REQUEST, "HELLO refused: a session exchanges "
                                "keys at its first HELLO only")
        session.timing = session.timing or msg.timing
        session.minor = msg.minor
        reply = self.greeter.hello_reply()
        if msg.minor < 6:          # an older client decodes no field it does not know
            reply = dataclasses.replace(reply, device_details=())
        if exchange is not None:
            public, session.verifier = exchange
            reply = dataclasses.replace(reply, exchange=public)
        return reply, []

    @staticmethod
    def _exchange(session: Session, client_public: bytes) -> tuple[bytes, Verifier] | None:
        """For a HELLO that opens a session with an ``exchange`` (1.10): this worker's
        ephemeral public key for the reply, and the session's verifier (see
        :mod:`~zmq_rpc.broker.request_mac`); None without one (the session is not signed)."""
        if not client_public:
            return None
        public, secret = new_exchange()
        key = derive(secret, client_public, session.client_id, client_public, public)
        if key is None:
            raise WireError(ErrorCode.BAD_REQUEST, "HELLO refused: exchange is not a usable "
                            "X25519 public key")
        return public, Verifier(key)

    def _open(self, session: Session, client_name: str, identity: str) -> None:
        self._make_room()
        self._make_identity_room(identity)
        self.identities.admit(session, identity)
        session.name = printable(client_name, 64) or "client"
        self._ids += 1
        session.sid = self._ids
        self.sessions[session.client_id] = session
        log.info("session %s opened by client %r (id %s); %d open", session.label,
                 session.name, session.client_id.hex()[:8], len(self.sessions),
                 extra={"event": "session_opened", **session.log_fields(),
                        "open": len(self.sessions)})

    def _make_room(self) -> None:
        """OUT_OF_MEMORY unless one more session fits ``--max-sessions`` (sessions silent for
        PRESSURE_SILENCE are closed first: their clients are gone)."""
        limit = self.limits.max_sessions
        if len(self.sessions) < limit:
            return
        now = time.monotonic()
        for other in list(self.sessions.values()):
            if now - other.last_seen > PRESSURE_SILENCE:
                self.close(other, f"{limit} sessions were open (--max-sessions) and it "
                                  f"was silent for {now - other.last_seen:.0f} s")
        if len(self.sessions) >= limit:
            raise WireError(ErrorCode.OUT_OF_MEMORY, f"HELLO refused: this worker already "
                            f"serves {len(self.sessions)} sessions, its limit (--max-sessions "
                            f"{limit}); try again when one closes")

    def _make_identity_room(self, identity: str) -> None:
        """Close the identity's sessions silent for PRESSURE_SILENCE when it holds its most
        (their client is gone), so that a client that restarts is not locked out by itself."""
        if self.identities.room(identity) < self.identities.quotas.sessions:
            return
        now = time.monotonic()
        for other in list(self.sessions.values()):
            if other.identity == identity and now - other.last_seen > PRESSURE_SILENCE:
                self.close(other, f"its client identity held its most sessions "
                                  f"(--identity-sessions) and it was silent for "
                                  f"{now - other.last_seen:.0f} s")

    def close(self, session: Session, why: str) -> None:
        """Free everything the session owns; fail what it still has queued and what waits for
        a transfer (a client that said GOODBYE still gets a reply to each)."""
        freed = sum(b.size for b in session.buffers.values())
        freed += sum(graph.memory_charge for graph in session.graphs.values())
        self.accounts.uncharge(session, freed)       # materialized sends stay counted until sent
        for endpoint in self.accounts.inflight.links_of(session.usage):
            self.peers.drop_link(endpoint)        # what it queued there is dropped
        session.buffers.clear()
        session.views.clear()
        session.graphs.clear()
        self.sessions.pop(session.client_id, None)
        self.identities.leave(session)
        self.peers.forget(session)
        unfinished = f"session closed ({why}) before this transfer finished"
        for req in session.answered_later:
            self.outbox.error(session.client_id, req.req_id, ErrorCode.NO_SESSION, unfinished)
        session.answered_later.clear()
        head = session.queue[0] if session.queue and session.queue[0].in_flight else None
        self.fail_queue(session, ErrorCode.NO_SESSION, f"session closed ({why})", head,
                        unfinished)
        log.info("session %s of client %r (id %s) closed (%s): freed %d bytes; %d open",
                 session.label, session.name, session.client_id.hex()[:8], why, freed,
                 len(self.sessions), extra={"event": "session_closed", **session.log_fields(),
                                            "reason": why, "freed_bytes": freed,
                                            "open": len(self.sessions)})

    def fail_queued(self, code: ErrorCode, message: str) -> None:
        """Answer every request still waiting in any session's queue with an error."""
        for session in self.sessions.values():
            self.fail_queue(session, code, message)

    def fail_queue(self, session: Session, code: ErrorCode, message: str,
                   own: Request | None = None, own_message: str = "",
                   own_code: ErrorCode | None = None) -> None:
        """Answer every queued request with an error (``own_message``, and ``own_code`` when
        given, for ``own``, the request whose own transfer failed)."""
        queue = list(session.queue)
        session.queue.clear()
        session.usage.queued_bytes = 0
        for req in queue:
            mine = code if req is not own or own_code is None else own_code
            self.metrics.request(req.cmd, mine, 0, 0)
            text = own_message if req is own else message
            self.outbox.error(session.client_id, req.req_id, mine, text)

    def close_silent(self, keep: Session) -> None:
        """Memory is short: close sessions silent for PRESSURE_SILENCE (their client is gone:
        zmq-rpc's client pings every 2 s) to make room."""
        now = time.monotonic()
        for other in list(self.sessions.values()):
            if other is not keep and other.usage.memory and \
                    now - other.last_seen > PRESSURE_SILENCE:
                self.close(other, f"memory is short and it was silent for "
                                  f"{now - other.last_seen:.0f} s")

    def expire(self, now: float, heard: Callable[[bytes], bool]) -> None:
        """Close sessions silent for longer than the session timeout; ``heard(client_id)``: a
        message of that client was read but is not handled yet (it came while a long request
        ran: its client is not silent, its ``last_seen`` just not moved yet)."""
        for session in list(self.sessions.values()):
            if now - session.last_seen > self.limits.session_timeout and \
                    not heard(session.client_id):
                self.close(session, f"no message for {self.limits.session_timeout:g} s")
