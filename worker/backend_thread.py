"""The backend thread: the one owner of a worker's tensor state, and the loop that feeds it.

:class:`BackendThread` polls the PAIR from the broker thread, the control PAIR from
:class:`~zmq_rpc.worker.server.WorkerServer`, the peer port and the hasher, and runs the
:class:`~zmq_rpc.worker.dispatch.executor.Executor` on what comes. It imports numpy and the
executor, so :mod:`.server` imports this module only once the worker already listens (a client
that connects meanwhile has its requests queued in the PAIR until this thread serves them).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from functools import partial

import zmq

from ..broker.broker import BACKEND_HWM
from ..broker.keys import KeyPair
from ..broker.protocol import ErrorCode
from ..broker.zap import KeySet
from .backends.base import Backend
from .dispatch.executor import DRAIN_BATCH, Executor
from .dispatch.frames import recv_message, send_message
from .dispatch.inbox import READ_AHEAD_EVERY_NS, Inbox
from .files.model_files import ModelFiles
from .files.tensor_cache import TensorCache
from .observe.metrics import PUBLISH_INTERVAL, NullRecorder, Recorder
from .peer.endpoints import PeerSecurity
from .peer.links import PeerLinks
from .process.devices import parse_device
from .process.gc_pacing import FullCollections
from .process.heap import IdleTrim
from .sessions.identities import KeyCheck
from .sessions.session import WorkerLimits

log = logging.getLogger("zmq_rpc.worker")

DRAIN = b"DRAIN"
"""The control command that starts draining (:meth:`~.dispatch.executor.Executor.drain`); any
other command stops the thread."""

SHUTDOWN_DRAIN_S = 2.0
"""At shutdown, requests already sent keep being answered until none arrives for 20 ms, at most
this long; later ones get SHUTTING_DOWN or find the worker gone."""


def make_backend(device: str) -> Backend:
    """The compute backend for ``--device`` (cupy is imported only when asked for: without it,
    or without that GPU, a ``DeviceUnavailable`` error names the extra to install)."""
    kind, index = parse_device(device)
    if kind == "cpu":
        from .backends.numpy_backend import NumpyBackend
        return NumpyBackend()
    from .backends.cupy_backend import CupyBackend
    return CupyBackend(index)


class BackendThread(threading.Thread):
    """Polls the PAIR from the broker and the control PAIR from the server; runs the executor."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], backend: Backend, limits: WorkerLimits,
                 endpoints: tuple[str, str], name: str, peer: tuple[str, str],
                 curve: KeyPair | None = None, worker_keys: str | None = None,
                 metrics: Recorder | None = None, authorized_keys: str | None = None) -> None:
        super().__init__(name="zmq-rpc-backend", daemon=False)
        self.client_keys = None if curve is None else KeyCheck(
            curve.secret, KeySet(directory=authorized_keys).keys)
        """Whose HELLO key proofs this worker checks (its own KeySet: the ZAP thread's is the
        ZAP thread's), see worker/sessions/identities.py."""
        self.metrics = metrics or NullRecorder()
        self.peer_security = PeerSecurity(curve, KeySet(
            fixed=frozenset([curve.public]) if curve else frozenset(), directory=worker_keys))
        self.ctx = ctx
        self.backend = backend
        self.limits = limits
        self.pair_endpoint, self.control_endpoint = endpoints
        self.server_name = name
        self.peer_bind, self.peer_advertise = peer
        self.peers: PeerLinks | None = None
        self.peer_bound = ""
        """What the peer port listens on (``LAST_ENDPOINT``), once ready."""
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.pair: zmq.Socket[bytes] | None = None
        self.executor: Executor | None = None
        self.disk: tuple[ModelFiles | None, TensorCache | None] = (None, None)
        """The model files and tensor cache the executor serves (handed over before start)."""
        self.inbox = Inbox()
        self.drained = threading.Event()
        """Set once draining (the control command ``DRAIN``) and no session is left: the
        server may stop (the CLI waits on it, up to ``--drain-timeout``)."""

    def run(self) -> None:
        pair = self.ctx.socket(zmq.PAIR)
        control = self.ctx.socket(zmq.PAIR)
        try:
            self.backend.attach()                   # a GPU is current per thread: this one
            pair.setsockopt(zmq.SNDHWM, 0)                # replies: never block the backend
            pair.setsockopt(zmq.RCVHWM, BACKEND_HWM)      # requests: see broker.py
            pair.bind(self.pair_endpoint)
            control.bind(self.control_endpoint)
            self.peers = PeerLinks(self.ctx, self.backend, bind=self.peer_bind,
                                   advertise=self.peer_advertise,
                                   stash_limit=max(self.limits.memory_limit // 4, 64 << 20),
                                   security=self.peer_security)
            self.executor = Executor(self.backend, self.limits, partial(send_message, pair),
                                     self.server_name, self.peers, metrics=self.metrics,
                                     keys=self.client_keys)
            self.executor.serve_files(*self.disk)
            self.peers.metrics = self.metrics
            self.peer_bound = self.peers.bound
            self.pair = pair
            self.ready.set()
            self._loop(pair, control)
        except BaseException as exc:
            self.error = exc
            if self.ready.is_set():     # a failure to start is the starter's to report
                log.exception("backend thread failed")
        finally:
            self.ready.set()
            if self.peers is not None:
                self.peers.close()
            if self.executor is not None:
                self.executor.loading.close()
            pair.close(linger=1000)
            control.close(linger=0)

    def _loop(self, pair: zmq.Socket[bytes], control: zmq.Socket[bytes]) -> None:
        assert self.executor is not None
        poller = zmq.Poller()
        poller.register(pair, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        peers = self.peers
        assert peers is not None
        if peers.pull is not None:
            poller.register(peers.pull, zmq.POLLIN)
        hasher = self.executor.loading.hasher
        if hasher is not None:
            poller.register(hasher.wake_fd, zmq.POLLIN)
        waiting = False
        next_expiry = time.monotonic() + 1.0
        next_publish = 0.0
        idle_trim, full_gc = IdleTrim(), FullCollections()
        while True:
            events = dict(poller.poll(self._timeout_ms(waiting)))
            busy = bool(events) or bool(self.inbox)
            full_gc.poll_result(busy or waiting)        # between requests (worker/process/gc_pacing.py)
            idle_trim.poll_result(busy or waiting)      # after it: what the collection freed too
            if pair in events or self.inbox:
                self._drain(pair)
            if peers.pull is not None and peers.pull in events:
                peers.drain()
            if hasher is not None and hasher.wake_fd in events:
                hasher.collect()         # a file's hash is in: its request runs (and replies)
            if control in events:
                command = control.recv()
                if command != DRAIN:
                    self._shutdown(pair, command)
                    return
                self.executor.drain()
            waiting = self.executor.pump_all() if (waiting or busy) else False
            self.executor.reap()
            if self.executor.draining and not self.executor.sessions:
                self.drained.set()
            now = time.monotonic()
            self.executor.release_held(now)
            peers.expire(now)
            if now >= next_expiry:
                # What came while a request ran is not read yet when that request ran from
                # pump_all or a hash's end (no read follows it there): read it, or its sender
                # looks silent for as long as that request ran.
                self._read_ahead(pair)
                self.executor.expire_sessions(now, self.inbox.holds)
                next_expiry = now + min(1.0, self.limits.session_timeout / 4)
            if now >= next_publish and self.metrics.enabled:
                self.metrics.publish(self.executor.report.snapshot())
                next_publish = now + PUBLISH_INTERVAL

    def _timeout_ms(self, waiting: bool) -> int:
        if self.inbox:
            return 0      # requests read ahead wait: look at the other sockets, then go on
        if waiting or (self.peers is not None and self.peers.incoming):
            return 1      # a transfer is due: short naps keep this core quick to wake
        deadlines = [self.peers.next_deadline() if self.peers is not None else None,
                     self.executor.next_release() if self.executor is not None else None]
        deadline = min((d for d in deadlines if d is not None), default=None)
        if deadline is None:
            return 250
        return max(0, min(250, math.ceil((deadline - time.monotonic()) * 1000)))

    def _drain(self, pair: zmq.Socket[bytes]) -> None:
        """Handle up to DRAIN_BATCH requests, the client with the least backend time used
        first (worker/dispatch/inbox.py: why); each request's time is charged to its client.

        After a request is handled, the PAIR is read empty into the inbox (once per
        READ_AHEAD_EVERY_NS); an empty inbox takes the PAIR's next message alone, the oldest of
        all. The PAIR is read after a request, not before it: reading it to its end
        (``zmq.Again``) first would put that read in every ping's round trip (docs/DESIGN.md)."""
        assert self.executor is not None
        inbox = self.inbox
        next_read = 0
        for _ in range(DRAIN_BATCH):
            taken = inbox.take()
            if taken is None:       # nothing read ahead: the PAIR's next message, handled as is
                try:
                    taken = recv_message(pair), 0
                except zmq.Again:
                    return
            started = time.perf_counter_ns()
            try:
                self.executor.handle_frames(*taken)
            except Exception:   # whatever a message does, this thread keeps serving the others
                log.exception("unexpected error handling a message; the worker goes on")
            now = time.perf_counter_ns()
            frames = taken[0]
            inbox.charge(frames[0].bytes if frames else b"", now - started)
            if now >= next_read:
                self._read_ahead(pair)
                next_read = now + READ_AHEAD_EVERY_NS

    def _read_ahead(self, pair: zmq.Socket[bytes]) -> None:
        """Move what the PAIR holds into the inbox, until it is empty or the inbox full."""
        inbox = self.inbox
        while not inbox.full():
            try:
                inbox.put(recv_message(pair))
            except zmq.Again:
                return

    def _shutdown(self, pair: zmq.Socket[bytes], command: bytes) -> None:
        """Answer what is already queued, fail what still waits (the server then joins us)."""
        assert self.executor is not None
        executor = self.executor
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        while time.monotonic() < deadline and (self.inbox or pair.poll(20)):   # the PAIR is
            self._drain(pair)     # bounded: what clients sent before the signal is still coming
        executor.pump_all()
        executor.release_held()
        executor.fail_queued(ErrorCode.SHUTTING_DOWN, "the worker is shutting down")
        log.info("backend drained; %d session(s) were open", len(executor.sessions))
