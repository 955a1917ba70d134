"""The backend thread's scheduler: sessions, their queues, and one dispatch table for every command.

Owned by the backend thread (:class:`~zmq_rpc.worker.backend_thread.BackendThread`), the single owner of
sessions, buffers and every tensor byte on a worker; no other thread touches anything here. It
receives requests from the broker thread over the inproc PAIR as ``[client_id, header, *payload]``,
decodes them, and answers every one of them on the same PAIR, an error reply included.

Dispatch: ``self.routes`` maps each command to its :class:`~zmq_rpc.worker.sessions.session.Route` (the
handler, the buffers it writes, how it is admitted). The handlers live by job in
:mod:`~zmq_rpc.worker.sessions.buffers`, :mod:`~zmq_rpc.worker.graphs.commands`, :mod:`~zmq_rpc.worker.peer.transfers`
and :mod:`~zmq_rpc.worker.graphs.linked`; replies leave through :class:`~zmq_rpc.worker.dispatch.outbox.Outbox`;
opening (HELLO) and closing sessions is :class:`~zmq_rpc.worker.sessions.table.SessionTable`'s.

Ordering: each session has a FIFO. A request runs only after every earlier request of its session
has run; a request whose precondition does not hold yet (a buffer it writes still being sent
zero-copy) waits at the head of its session's queue, and so does one whose transfer is under way
(a PEER_RECV, a linked run receiving its hand-offs), while other sessions go on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import zmq

from ...broker import protocol as p
from ...broker.errors import BadRequest
from ...broker.graph import GraphReply, GraphRunKept, GraphRunLinked
from ...broker.protocol import Cmd, ErrorCode, WireError
from ...broker.request_mac import strip_trailer
from ..backends.base import Backend
from ..files.loading import Loading
from ..files.model_files import ModelFiles
from ..files.tensor_cache import TensorCache
from ..graphs.commands import GraphCommands
from ..graphs.linked import LinkedRuns, unfold
from ..observe.metrics import INVALID_COMMAND, NullRecorder, Recorder
from ..peer.acks import LinkLost
from ..peer.links import PeerLinks
from ..peer.transfers import PeerCommands
from ..sessions.buffers import BufferCommands
from ..sessions.identities import Identities, IdentityQuotas, KeyCheck, default_share
from ..sessions.memory import MemoryBudget, SessionMemory
from ..sessions.quotas import Quotas, check
from ..sessions.session import (
    NO_REPLY,
    Admission,
    Later,
    Outcome,
    Request,
    Route,
    Session,
    WorkerLimits,
)
from ..sessions.table import PeerCleanup, SessionTable
from ..sessions.views import Views
from .outbox import Outbox, Send
from .self_report import SelfReport

__all__ = ["DRAIN_BATCH", "Executor", "WorkerLimits"]

log = logging.getLogger("zmq_rpc.worker")

NO_SESSION = "no session: send HELLO first (or the session expired)"

_KEEPING = frozenset({Cmd.GRAPH_RUN_LINKED, Cmd.GRAPH_RUN_KEPT})
"""Commands that keep a linked run, or repeat one (:func:`~..graphs.linked.unfold`)."""

DRAIN_BATCH = 512
"""Most requests handled per poll wake-up before the peer port, waiting sessions and timers get
their turn (server.py)."""

class Executor:
    """Runs validated requests against a backend, in order per session."""

    def __init__(self, backend: Backend, limits: WorkerLimits, send: Send, server_name: str,
                 peers: PeerLinks, metrics: Recorder | None = None,
                 keys: KeyCheck | None = None) -> None:
        self.metrics = metrics or NullRecorder()
        self.backend = backend
        self.limits = limits
        self.server_name = server_name
        self.peers = peers
        self.sessions: dict[bytes, Session] = {}
        self.budget = MemoryBudget(limits.memory_limit)
        self.identities = Identities(IdentityQuotas(
            memory=limits.identity_memory or default_share(limits.memory_limit),
            sessions=limits.identity_sessions or default_share(limits.max_sessions)), keys)
        self.accounts = SessionMemory(
            self.budget, Quotas(memory=limits.session_memory or limits.memory_limit),
            self._reclaim, self.identities.check_memory)
        peers.use_budget(self.budget)
        self.outbox = Outbox(send, self.accounts.inflight,
                             self.metrics.client_out if self.metrics.enabled else None)
        self.report = SelfReport(backend, limits, self.budget, peers, self.sessions,
                                 self.outbox, server_name)
        self.table = SessionTable(self.sessions, limits, self.accounts, self.outbox,
                                  self.metrics, PeerCleanup(peers.drop_link, peers.forget),
                                  self.report, self.identities)
        self.routes = self._routes(Views(backend, limits.max_buffer_size, self.accounts))
        self.draining = False
        """The worker is leaving (SIGTERM with ``--drain-timeout``; :meth:`drain`)."""

    def drain(self) -> None:
        """Leave on purpose: answer every request as before, mark the replies of sessions that
        understand it (1.14, ``draining``) so that their models move off this worker, refuse
        new sessions (:meth:`SessionTable.hello`); the loop stops once no session is left."""
        self.draining = True
        self.table.draining = True
        log.warning("draining: %d session(s) open; new sessions are refused",
                    len(self.sessions))

    @property
    def quotas(self) -> Quotas:
        """What one session may hold."""
        return self.accounts.quotas

    def _routes(self, views: Views) -> dict[Cmd, Route]:
        """The dispatch table: every command, each with its handler and the buffers it writes."""
        graphs = GraphCommands(self.backend, views, self.accounts, self.limits.max_graph_work)
        transfers = PeerCommands(self.peers, views, self._transfer_done)
        routes = {
            Cmd.HELLO: Route(self.table.hello, admission=Admission.OPENS),
            Cmd.PING: Route(_nothing),
            Cmd.SYNCHRONIZE: Route(_nothing),
            Cmd.GOODBYE: Route(self._goodbye),
            Cmd.STATUS: Route(lambda asker, msg, req: (self.report.status(asker), [])),
            **BufferCommands(self.backend, views, self.accounts, self.limits.max_buffer_size).routes(),
            **graphs.routes(),
            **transfers.routes(),
            **LinkedRuns(self.backend, views, graphs, transfers).routes(),
        }
        self.loading = Loading(self.backend, views, self.resume)
        routes.update(self.loading.routes(routes[Cmd.SET_TENSOR]))
        missing = set(Cmd) - set(routes)
        if missing:
            raise RuntimeError(f"no route for {sorted(c.name for c in missing)}")
        return routes

    def serve_files(self, files: ModelFiles | None, cache: TensorCache | None) -> None:
        """Serve ``--model-dir`` files and a ``--cache-dir`` cache (and say so at HELLO)."""
        self.loading.serve(files, cache)
        self.report.capabilities += self.loading.capabilities()

    def resume(self, session: Session) -> None:
        """Run ``session``'s queue again: what its head waited for (a file's hash) is in."""
        if self.sessions.get(session.client_id) is session and not session.pumping:
            self.pump(session)

    # ------------------------------------------------------------------ entry from the loop

    def handle_frames(self, frames: list[zmq.Frame], arrived: int = 0) -> None:
        """One message from the broker: ``[client_id, header, *payload]``, taken from the PAIR at
        ``arrived`` (``perf_counter_ns``; 0: now)."""
        if len(frames) < 2:
            log.warning("dropping a message of %d frame(s) from the broker", len(frames))
            return
        arrived = arrived or time.perf_counter_ns()
        client_id = frames[0].bytes
        self.metrics.client_in(frames)
        buffers: list[memoryview | bytes] = [f.buffer for f in frames[1:]]
        session = self.sessions.get(client_id)
        if session is not None and session.verifier is not None:
            opened = session.verifier.open(buffers[0])
            if isinstance(opened, str):
                self._refuse_unsigned(session, buffers[0], opened)
                return
            buffers[0] = opened
        try:
            cmd, req_id, msg = p.decode_request(buffers)
        except BadRequest as exc:
            self._refuse_bad(client_id, session, buffers[0], exc)
            return
        except Exception as exc:  # a decoder bug: still a bad request, never a dead thread
            log.exception("decoding a request from %s failed", client_id.hex()[:8])
            self._refuse(client_id, 0, ErrorCode.BAD_REQUEST,
                         f"malformed request ({type(exc).__name__})")
            return
        if cmd in _KEEPING:
            if session is None:     # nothing is kept outside a session: a kept run has no run
                self._refuse(client_id, req_id, ErrorCode.NO_SESSION, NO_SESSION, cmd)
                return
            try:
                msg = unfold(session, cast(GraphRunLinked | GraphRunKept, msg))
            except BadRequest as exc:
                self._refuse(client_id, req_id, ErrorCode(exc.code or 1), exc.message, cmd)
                return
        try:
            req = self.routes[cmd].request(cmd, req_id, msg, frames[2:])
        except Exception as exc:    # a bug of ours: this request still gets an answer
            log.exception("building the request of %s failed", cmd.name)
            self._refuse(client_id, req_id, ErrorCode.INTERNAL,
                         f"internal error ({type(exc).__name__}); the worker goes on", cmd)
            return
        req.arrived = arrived
        self._accept(client_id, session, req)

    def _refuse_unsigned(self, session: Session, header: Any, why: str) -> None:
        """Refuse a request of a signed session that does not carry its signature: someone
        else presents the session's routing id. The session is left as it was (not even its
        last-seen time moves); the refusal goes to whoever holds the routing id now."""
        session.refused += 1
        if session.refused == 1:
            log.warning("%s: refused a request without the session's signature (%s); "
                        "another connection uses its routing id", session.label, why,
                        extra=session.log_fields())
        self._refuse(session.client_id, _request_id(header), ErrorCode.NOT_AUTHENTIC,
                     f"request refused: {why}")

    def _refuse_bad(self, client_id: bytes, session: Session | None, header: Any,
                    exc: BadRequest) -> None:
        """Answer a request that did not decode. A signed request whose session is gone
        (it expired, the worker restarted) does not decode with its signature on: it gets
        NO_SESSION under its own request id, so that its client learns the session is lost."""
        if session is None and strip_trailer(header) is not None:
            self._refuse(client_id, _request_id(header), ErrorCode.NO_SESSION, NO_SESSION)
            return
        req_id, code, message = getattr(exc, "req_id", 0), ErrorCode(exc.code or 1), exc.message
        self._refuse(client_id, req_id, code, message)

    def _refuse(self, client_id: bytes, req_id: int, code: ErrorCode, message: str,
                cmd: int = INVALID_COMMAND) -> None:
        """Answer a request that never reached a session with an error."""
        self.metrics.request(cmd, code, 0, 0)
        self.outbox.error(client_id, req_id, code, message)

    def _accept(self, client_id: bytes, session: Session | None, req: Request) -> None:
        admission = req.route.admission
        if session is None:
            if admission is not Admission.OPENS:
                self._refuse(client_id, req.req_id, ErrorCode.NO_SESSION, NO_SESSION, req.cmd)
                return
            session = Session(client_id, "")         # opened by HELLO, if it is accepted
        session.last_seen = time.monotonic()
        if admission is not Admission.QUEUED:
            self._step(session, req)
            return
        idle = not session.queue
        if not idle and not self._may_queue(session, req):
            return
        session.queue.append(req)
        session.usage.queued_bytes += req.nbytes
        if req.route.queued is not None:
            req.route.queued(session, req.msg)
        if idle:
            self.pump(session)

    def _may_queue(self, session: Session, req: Request) -> bool:
        """Whether ``req`` fits the session's queue quotas (else it is answered at once)."""
        req.nbytes = sum(len(f) for f in req.payload)
        quotas = self.accounts.quotas
        try:
            check("queued requests", len(session.queue), 1, quotas.queued)
            check("queued payload bytes", session.usage.queued_bytes, req.nbytes,
                  quotas.queued_bytes)
        except WireError as exc:
            self.outbox.error(session.client_id, req.req_id, exc.code, exc.message)
            return False
        return True

    def pump(self, session: Session) -> bool:
        """Run the session's queue until it is empty or its head must wait; True when the head
        waits for a buffer (retry soon), False when it is empty or waits for a transfer (whose
        end pumps it again)."""
        session.pumping = True
        try:
            while session.queue:
                head = session.queue[0]
                if head.in_flight:
                    return False
                if not session.idle(head.writes(session)):
                    return True
                self._step(session, head)
            return False
        finally:
            session.pumping = False

    def pump_all(self) -> bool:
        """Retry every waiting session; True if some still wait for a buffer."""
        waiting = False
        for session in list(self.sessions.values()):
            if session.queue:
                waiting = self.pump(session) or waiting
        return waiting

    def _step(self, session: Session, req: Request) -> None:
        """Run one step of ``req`` and answer it when it is done."""
        started = time.perf_counter_ns()
        outcome = self._call(session, req)
        # Its client waits for this answer: not silent, however long the request ran (a
        # first-use kernel compile, a long graph; its pings from meanwhile are not read yet).
        session.last_seen = time.monotonic()
        if outcome is None or outcome is Later.HOLD:
            return
        queued = self._drop(session, req)
        if outcome is Later.ANSWERED_LATER:
            session.answered_later.add(req)
            return
        if queued:
            self._start_eager(session)
        reply, payload = outcome
        compute = getattr(reply, "compute_ns", None)
        if compute is not None:
            self.metrics.graph_run(compute)
        if session.timing:
            reply = timed(reply, req.arrived, started)
        if self.draining and session.minor >= DRAINING_MINOR:
            reply = marked_draining(reply)
        self.outbox.reply(session.client_id, req.req_id, (reply, payload), req.hold_us)
        self.metrics.request(req.cmd, 0, started - req.arrived, time.perf_counter_ns() - started)

    def _call(self, session: Session, req: Request) -> Outcome | None:
        """The handler's outcome; None when it failed (then answered with an error here)."""
        try:
            return req.route.handler(session, req.msg, req)
        except WireError as exc:
            code, message = exc.code, exc.message
        except MemoryError:
            code = ErrorCode.OUT_OF_MEMORY
            message = f"{req.cmd.name}: the worker ran out of {self.backend.kind} memory"
        except Exception as exc:  # a bug must not take the worker down: report it
            log.exception("internal error in %s for %s", req.cmd.name, session.label)
            code = ErrorCode.INTERNAL
            message = f"{req.cmd.name} failed: {type(exc).__name__}: {exc}"
        self._drop(session, req)
        self.metrics.request(req.cmd, code, 0, 0)
        self.outbox.error(session.client_id, req.req_id, code, message)
        return None

    @staticmethod
    def _drop(session: Session, req: Request) -> bool:
        """Take ``req`` out of the head of its queue; False when it was not there."""
        if session.queue and session.queue[0] is req:
            session.queue.popleft()
            session.usage.queued_bytes -= req.nbytes
            return True
        return False

    def _start_eager(self, session: Session) -> None:
        """Start the peer sends queued right behind a finished request before replying to it:
        another worker waits on those bytes (a pipeline's next stage), the client does not wait
        on the reply."""
        while session.queue:
            head = session.queue[0]
            if (not head.route.eager or head.in_flight
                    or not session.idle(head.writes(session))):
                return
            self._step(session, head)

    # ----------------------------------------------------------------------- transfers

    def _transfer_done(self, session: Session, req: Request, error: str | None) -> None:
        """A transfer ended: answer a send or probe; move on (or fail) what waited for a receive."""
        if self.sessions.get(session.client_id) is not session:
            return  # the session closed meanwhile
        code = _transfer_code(session, error)
        if not req.in_flight:              # a send or a probe: its queue went on without it
            session.answered_later.discard(req)
            self.metrics.request(req.cmd, 0 if error is None else code, 0,
                                 time.perf_counter_ns() - req.arrived)
            if error is None:
                done = timed(p.Empty(), req.arrived, req.arrived) if session.timing else None
                self.outbox.reply(session.client_id, req.req_id,
                                  NO_REPLY if done is None else (done, []))
            else:
                self.outbox.error(session.client_id, req.req_id, code, error)
            return
        req.in_flight = False
        if error is not None:
            self.table.fail_queue(session, ErrorCode.TRANSFER_FAILED, "an earlier transfer this "
                             f"request was queued behind failed: {error}",
                             req, req.transfer_failed(error), code)
            return
        finished = req.landed()
        if finished:
            self._drop(session, req)
        if not session.pumping:
            self.pump(session)   # what waited for these bytes runs first: the reply can wait
        if finished:
            self.metrics.request(req.cmd, 0, 0, time.perf_counter_ns() - req.arrived)
            done = timed(p.Empty(), req.arrived, req.arrived) if session.timing else None
            self.outbox.reply(session.client_id, req.req_id,
                              NO_REPLY if done is None else (done, []))

    # -------------------------------------------------------------------------- sessions

    def _goodbye(self, session: Session, msg: p.Empty, req: Request) -> Outcome:
        self._drop(session, req)          # answered below, not failed with the rest
        self.table.close(session, "said goodbye")
        return NO_REPLY

    def close_session(self, session: Session, why: str) -> None:
        """Free everything the session owns and fail what it still waits for."""
        self.table.close(session, why)

    def fail_queued(self, code: ErrorCode, message: str) -> None:
        """Answer every request still waiting in any session's queue with an error."""
        self.table.fail_queued(code, message)

    def _reclaim(self, keep: Session) -> None:
        """Memory is short for ``keep``: early chunks nobody announced go first, then the
        sessions silent long enough to be gone."""
        self.peers.stash.shed()
        self.table.close_silent(keep)

    def reap(self) -> None:
        """Give back the bytes of materialized replies and pushes that libzmq has sent."""
        self.accounts.reap()

    def expire_sessions(self, now: float, heard: Callable[[bytes], bool]) -> None:
        """Close sessions silent for longer than the session timeout (``heard``: see
        :meth:`SessionTable.expire`)."""
        self.table.expire(now, heard)

    # ----------------------------------------------------------------------- for the loop

    def release_held(self, now: float | None = None) -> None:
        """Send the held replies that are due (all of them when ``now`` is None)."""
        self.outbox.release_held(now)

    def next_release(self) -> float | None:
        """When the oldest held reply is due (None if nothing is held)."""
        return self.outbox.next_release()


def timed(reply: p.Message, arrived: int, started: int) -> p.Message:
    """``reply`` carrying the worker's share of its request: (queued, running until now) ns."""
    timing = (max(started - arrived, 0), max(time.perf_counter_ns() - started, 0))
    if type(reply) is p.Empty:
        return p.Ack(timing=timing)
    return dataclasses.replace(reply, timing=timing)  # type: ignore[call-arg]


DRAINING_MINOR = 14
"""The protocol minor from which a session's replies carry ``draining``."""


def marked_draining(reply: p.Message) -> p.Message:
    """``reply`` saying that the worker is leaving (1.14): an Ack's or a graph run's reply;
    any other kind as it is (a model learns it from its next step or heartbeat)."""
    if type(reply) is p.Empty:
        return p.Ack(draining=True)
    if isinstance(reply, (p.Ack, GraphReply)):
        return dataclasses.replace(reply, draining=True)
    return reply


def _request_id(header: Any) -> int:
    """The request id of a header (a signed one's trailer is skipped), for an error reply
    to a request refused before decoding; 0 when it has none."""
    try:
        fields = p.unpack_header(strip_trailer(header) or header)
    except BadRequest:
        return 0
    return fields[1] if 0 <= fields[1] < 1 << 64 else 0


def _nothing(session: Session, msg: Any, req: Request) -> Outcome:
    """PING and SYNCHRONIZE: the reply is the point (SYNCHRONIZE's comes after every earlier
    request of the session has run)."""
    return NO_REPLY


PEER_UNREACHABLE_SINCE = 9
"""The protocol minor from which a session is answered PEER_UNREACHABLE."""


def _transfer_code(session: Session, error: str | None) -> ErrorCode:
    """A failed transfer's code: PEER_UNREACHABLE when its peer link was lost, for sessions
    that know it (1.9); TRANSFER_FAILED otherwise (the message says the same)."""
    if isinstance(error, LinkLost) and session.minor >= PEER_UNREACHABLE_SINCE:
        return ErrorCode.PEER_UNREACHABLE
    return ErrorCode.TRANSFER_FAILED
