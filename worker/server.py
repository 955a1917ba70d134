"""A whole worker in one object: the broker thread, the backend thread, and their lifecycle.

:class:`WorkerServer` is created and stopped by one thread (the CLI's main thread, or a test). It owns
the zmq context and the control sockets that tell the other two threads to stop; the broker thread
owns the ROUTER (:mod:`zmq_rpc.broker.broker`), the backend thread owns every byte of tensor state
(:class:`BackendThread`, running :class:`~zmq_rpc.worker.dispatch.executor.Executor`).

Shutdown (``stop()``, SIGINT/SIGTERM in the CLI): the backend answers every request it already
holds, fails those still waiting with SHUTTING_DOWN, then the broker stops forwarding and closes the
ROUTER with a linger so the last replies reach their clients.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import zmq

from ..broker.broker import BACKEND_HWM, BrokerConfig, BrokerThread
from ..broker.endpoints import EndpointError, bind_endpoint, is_loopback_endpoint
from ..broker.keys import KeyPair
from ..broker.ops import DEFAULT_MAX_WORK
from ..broker.protocol import ErrorCode
from ..broker.zap import CLIENT_DOMAIN, PEER_DOMAIN, KeySet, ZapPolicy, ZapThread
from .backends.base import Backend
from .dispatch.executor import DRAIN_BATCH, Executor
from .dispatch.frames import recv_message, send_message
from .dispatch.inbox import READ_AHEAD_EVERY_NS, Inbox
from .files.model_files import ModelFiles
from .files.tensor_cache import TensorCache
from .formats import hashing
from .observe.metrics import PUBLISH_INTERVAL, NullRecorder, Recorder
from .peer.endpoints import PeerSecurity
from .peer.links import PeerLinks
from .process.devices import parse_device
from .process.gc_pacing import FullCollections
from .process.heap import IdleTrim
from .process.version import package_version
from .sessions.identities import KeyCheck
from .sessions.quotas import default_session_share
from .sessions.session import WorkerLimits

if TYPE_CHECKING:
    from .observe.exporter import MetricsServer

log = logging.getLogger("zmq_rpc.worker")

_ids = itertools.count()

DEFAULT_BIND = "tcp://127.0.0.1:50052"
SHUTDOWN_DRAIN_S = 2.0
"""At shutdown, requests already sent keep being answered until none arrives for 20 ms, at most
this long; later ones get SHUTTING_DOWN or find the worker gone."""


@dataclass
class WorkerConfig:
    """Everything a worker is started with (the CLI's flags)."""

    bind: str = DEFAULT_BIND
    device: str = "cpu"
    memory_limit: int = 0
    """Bytes the worker may hand out; 0 means 80 % of the device's memory."""
    max_buffer_size: int = 0
    """Largest single buffer; 0 means the memory limit."""
    max_message_size: int = 64 << 20
    session_timeout: float = 30.0
    max_graph_work: int = DEFAULT_MAX_WORK
    """Element-ops one graph run may ask for."""
    session_memory: int = 0
    """Bytes one session may hold; 0 means :func:`~zmq_rpc.worker.sessions.quotas.default_session_share`
    of the memory limit (see worker/sessions/quotas.py)."""
    max_sessions: int = 64
    """Sessions open at once (see worker/sessions/quotas.py)."""
    identity_memory: int = 0
    """Bytes all sessions of one client identity may hold; 0: 3/4 of the memory limit
    (worker/sessions/identities.py)."""
    identity_sessions: int = 0
    """Sessions one client identity may hold; 0: 3/4 of ``max_sessions``."""
    peer_bind: str | None = None
    """Where peers push tensors to us; None: the client bind's host, a free port; "" disables."""
    peer_advertise: str = ""
    """The peer endpoint told to clients (for multi-host setups); default: what was bound."""
    name: str = field(default_factory=lambda: f"zmq-rpc-worker@{socket.gethostname()}")
    model_dirs: tuple[str, ...] = ()
    """Directories whose GGUF/safetensors files clients may have read into buffers here."""
    cache_dir: str = ""
    """Where the content-addressed tensor cache lives ("" for none)."""
    cache_size: int = 8 << 30
    """Bytes the tensor cache may hold on disk (least recently used entries go first)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this HTTP port (0: a free one); None: no metrics."""
    metrics_host: str = "127.0.0.1"
    """Where the metrics endpoint listens (loopback unless told otherwise)."""
    curve: KeyPair | None = None
    """This worker's CURVE key pair: clients and peers must authenticate (see SECURITY.md)."""
    authorized_keys: str | None = None
    """Directory of the client public keys (``*.key``) allowed to connect."""
    worker_keys: str | None = None
    """Directory of the worker public keys this one exchanges peer transfers with (its own key
    is always accepted)."""
    insecure: bool = False
    """Allow binding beyond loopback without CURVE (anyone who reaches the ports can use it)."""


class InsecureBind(RuntimeError):
    """A worker without CURVE keys was asked to listen beyond loopback."""


def check_security(cfg: WorkerConfig, peer_bind: str) -> None:
    """Refuse a configuration that exposes an unauthenticated worker (or a half-secured one).

    The endpoints are read the way libzmq reads them (:mod:`zmq_rpc.broker.endpoints`): what
    it would bind is what is checked, and what is not understood is refused."""
    try:
        exposed = [ep for ep in (cfg.bind, peer_bind) if ep and not is_loopback_endpoint(ep)]
    except EndpointError as exc:
        raise InsecureBind(f"cannot listen there: {exc}") from None
    if cfg.curve is not None:
        if not cfg.authorized_keys:
            raise InsecureBind("--curve-secret-key needs --authorized-keys DIR (the client "
                               "public keys allowed to connect)")
        return
    if cfg.authorized_keys or cfg.worker_keys:
        raise InsecureBind("--authorized-keys/--worker-keys need --curve-secret-key FILE")
    if exposed and not cfg.insecure:
        raise InsecureBind(
            f"refusing to listen on {', '.join(exposed)} without authentication: anyone who "
            "reaches it could allocate memory, run graphs and make this worker push tensors. "
            "Pass --curve-secret-key FILE --authorized-keys DIR (see zmq-rpc-keygen), or "
            "--insecure on a network you trust")
    for ep in exposed:
        log.warning("INSECURE: listening on %s with no authentication and no encryption "
                    "(--insecure): anyone who can reach this port can read and write every "
                    "tensor, use all of --mem and make this worker send data to other "
                    "workers", ep)


def check_bound(cfg: WorkerConfig, bound: str) -> None:
    """After a bind, what libzmq reports it listens on (``LAST_ENDPOINT``) must pass the same
    rule: a name that resolved beyond loopback (``localhost`` in a strange hosts file) is
    caught here, the worker stops before serving anyone."""
    if cfg.curve is None and not cfg.insecure and bound and not is_loopback_endpoint(bound):
        raise InsecureBind(f"{bound} is beyond loopback, and this worker has no CURVE key "
                           "pair and no --insecure: refusing to serve")


def _loopback_host(host: str) -> bool:
    """Whether an HTTP listener on ``host`` (``--metrics-host``) is for this machine only."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return is_loopback_endpoint(f"tcp://[{bare}]:0" if ":" in bare else f"tcp://{bare}:0")
    except EndpointError:
        return False


def make_backend(device: str) -> Backend:
    """The compute backend for ``--device`` (cupy is imported only when asked for: without it,
    or without that GPU, a ``DeviceUnavailable`` error names the extra to install)."""
    kind, index = parse_device(device)
    if kind == "cpu":
        from .backends.numpy_backend import NumpyBackend
        return NumpyBackend()
    from .backends.cupy_backend import CupyBackend
    return CupyBackend(index)


def check_memory_limit(limit: int, total: int, device: str) -> None:
    """The rule for ``--mem``: 0 (the default: 80 % of the device) or 1 byte up to all of it.

    ``total`` is what the backend reports (physical RAM for cpu, the GPU's memory for cuda; 0 when
    unknown, and then any positive limit is taken).
    """
    if limit < 0:
        raise ValueError(f"memory limit {limit} is negative")
    if limit and total and limit > total:
        raise ValueError(f"memory limit {limit / 2**30:.1f} GiB is more than device {device} has "
                         f"({total / 2**30:.1f} GiB): give at most that, or leave the default "
                         f"(80 % of it)")


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
            idle_trim.poll_result(busy or waiting)
            full_gc.poll_result(busy or waiting)        # between requests (worker/process/gc_pacing.py)
            if pair in events or self.inbox:
                self._drain(pair)
            if peers.pull is not None and peers.pull in events:
                peers.drain()
            if hasher is not None and hasher.wake_fd in events:
                hasher.collect()         # a file's hash is in: its request runs (and replies)
            if control in events:
                self._shutdown(pair, control.recv())
                return
            waiting = self.executor.pump_all() if (waiting or busy) else False
            self.executor.reap()
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


class WorkerServer:
    """A running worker: ``with WorkerServer(WorkerConfig(bind="tcp://127.0.0.1:*")) as w: w.endpoint``."""

    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.endpoint = ""
        self._uid = f"{os.getpid()}-{next(_ids)}"
        self._backend_thread: BackendThread | None = None
        self._broker_thread: BrokerThread | None = None
        self._backend_ctl: zmq.Socket[bytes] | None = None
        self._broker_ctl: zmq.Socket[bytes] | None = None
        self._zap: ZapThread | None = None
        self._stopped = False
        self.metrics: Recorder = NullRecorder()
        self.metrics_server: MetricsServer | None = None
        self.metrics_address = ""
        """``http://host:port`` of the metrics endpoint once started ("" without one)."""

    def limits(self, backend: Backend) -> WorkerLimits:
        """The effective limits (defaults resolved against the device's memory)."""
        cfg = self.config
        check_memory_limit(cfg.memory_limit, backend.total_memory(), cfg.device)
        memory = cfg.memory_limit or int(backend.total_memory() * 0.8) or (8 << 30)
        return WorkerLimits(memory_limit=memory,
                            max_buffer_size=min(cfg.max_buffer_size or memory, memory),
                            max_message_size=cfg.max_message_size,
                            session_timeout=cfg.session_timeout,
                            max_graph_work=cfg.max_graph_work,
                            session_memory=min(cfg.session_memory or default_session_share(memory),
                                               memory),
                            max_sessions=cfg.max_sessions,
                            identity_memory=min(cfg.identity_memory, memory),
                            identity_sessions=cfg.identity_sessions)

    def start(self) -> str:
        """Start both threads; returns the bound endpoint (a ``*`` port resolved)."""
        cfg = self.config
        peer_bind = self._peer_bind()
        try:
            check_security(cfg, peer_bind)
            if cfg.curve is not None:
                self._start_zap(cfg.curve)
            backend = make_backend(cfg.device)
            limits = self.limits(backend)
        except BaseException:
            self.stop()
            raise
        if cfg.metrics_port is not None:
            self.metrics = Recorder()
        pair_ep = f"inproc://zmq-rpc-backend-{self._uid}"
        backend_ctl_ep = f"inproc://zmq-rpc-backend-ctl-{self._uid}"
        broker_ctl_ep = f"inproc://zmq-rpc-broker-ctl-{self._uid}"
        self._backend_thread = BackendThread(self.ctx, backend, limits,
                                             (pair_ep, backend_ctl_ep), cfg.name,
                                             (peer_bind, cfg.peer_advertise), cfg.curve,
                                             cfg.worker_keys, self.metrics,
                                             cfg.authorized_keys)
        self._backend_thread.disk = self._disk()
        self._backend_thread.start()
        self._wait_ready(self._backend_thread)
        self._backend_ctl = self._control(backend_ctl_ep)
        self._broker_ctl = self.ctx.socket(zmq.PAIR)
        self._broker_ctl.bind(broker_ctl_ep)
        self._broker_thread = BrokerThread(self.ctx, BrokerConfig(
            bind=cfg.bind, backend_endpoint=pair_ep, control_endpoint=broker_ctl_ep,
            max_message_size=cfg.max_message_size, curve=cfg.curve))
        self._broker_thread.start()
        self._wait_ready(self._broker_thread)
        self.endpoint = self._broker_thread.endpoint
        try:
            for bound in (self.endpoint, self._backend_thread.peer_bound):
                check_bound(cfg, bound)
        except InsecureBind:
            self.stop()
            raise
        if cfg.metrics_port is not None:
            try:
                self._start_metrics(backend)
            except BaseException:
                self.stop()
                raise
        log.info("worker %s listening on %s (device %s)", cfg.name, self.endpoint, cfg.device)
        return self.endpoint

    def _start_metrics(self, backend: Backend) -> None:
        """Serve the recorder's metrics over HTTP (prometheus_client is imported only here)."""
        cfg = self.config
        from ..broker.protocol import PROTOCOL_VERSION
        try:
            from .observe.exporter import MetricsServer
        except ImportError as exc:
            raise RuntimeError(f"metrics need prometheus_client ({exc}): "
                               "pip install 'zmq-rpc[metrics]'") from None
        info = {"name": cfg.name, "version": package_version(), "device": cfg.device,
                "kind": backend.kind, "endpoint": self.endpoint,
                "protocol": "{}.{}".format(*PROTOCOL_VERSION)}
        self.metrics_server = MetricsServer(self.metrics, info)
        try:
            self.metrics_address = self.metrics_server.start(cfg.metrics_host,
                                                             cfg.metrics_port or 0)
        except OSError as exc:
            raise RuntimeError(f"cannot serve metrics on {cfg.metrics_host}:"
                               f"{cfg.metrics_port}: {exc}") from None
        if not _loopback_host(cfg.metrics_host):     # named with the port it took (0: a free one)
            log.warning("serving metrics on %s, beyond loopback: anyone who can reach it can "
                        "read them", self.metrics_address)
        log.info("metrics on %s/metrics", self.metrics_address)

    def _disk(self) -> tuple[ModelFiles | None, TensorCache | None]:
        """The ``--model-dir`` files and the ``--cache-dir`` cache (both hash with BLAKE3)."""
        cfg = self.config
        if (cfg.model_dirs or cfg.cache_dir) and not hashing.available():
            raise RuntimeError("--model-dir and --cache-dir need the blake3 package: "
                               "pip install 'zmq-rpc[files]'")
        files = ModelFiles(cfg.model_dirs) if cfg.model_dirs else None
        cache = TensorCache(cfg.cache_dir, cfg.cache_size) if cfg.cache_dir else None
        return files, cache

    def _start_zap(self, keys: KeyPair) -> None:
        cfg = self.config
        policy = ZapPolicy({CLIENT_DOMAIN: KeySet(directory=cfg.authorized_keys),
                            PEER_DOMAIN: KeySet(fixed=frozenset([keys.public]),
                                                directory=cfg.worker_keys)})
        for keyset in policy.domains.values():
            keyset.check()                # a bad directory or file fails the start
        self._zap = ZapThread(self.ctx, policy)
        self._zap.start()
        self._wait_ready(self._zap)
        log.info("CURVE on: clients need a key in %s; peers a key in %s or this worker's",
                 cfg.authorized_keys, cfg.worker_keys or "(none)")

    def _peer_bind(self) -> str:
        cfg = self.config
        if cfg.peer_bind is not None:
            return cfg.peer_bind
        try:
            bind = bind_endpoint(cfg.bind)
        except EndpointError:
            return ""        # check_security says why
        if bind.host is not None:
            host = f"[{bind.host.text}]" if bind.ipv6 else bind.host.text
            return f"tcp://{host}:*"
        return f"inproc://zmq-rpc-peer-{self._uid}" if bind.scheme == "inproc" else ""

    def _control(self, endpoint: str) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.PAIR)
        sock.connect(endpoint)
        return sock

    def _wait_ready(self, thread: BackendThread | BrokerThread | ZapThread) -> None:
        thread.ready.wait(10)
        if thread.error is not None or not thread.is_alive():
            self.stop()
            error = thread.error
            if isinstance(error, OSError):     # says what failed (a bind, a device)
                raise error
            raise RuntimeError(f"{thread.name} failed to start: {error}") from error

    def stop(self) -> None:
        """Answer or fail in-flight requests, close every socket, join the threads. Idempotent.

        A thread that already died (a bind that failed) is not waited for: stop never blocks on a
        command nobody will read.
        """
        if self._stopped:
            return
        self._stopped = True
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self._command(self._backend_ctl, self._backend_thread, b"STOP")
        if self._broker_thread is not None and self._broker_thread.is_alive():
            time.sleep(0.05)  # let the proxy forward the backend's last replies
        self._command(self._broker_ctl, self._broker_thread, b"TERMINATE")
        for sock in (self._backend_ctl, self._broker_ctl):
            if sock is not None:
                sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self.ctx.term()
        log.info("worker %s stopped", self.config.name)

    @staticmethod
    def _command(sock: zmq.Socket[bytes] | None, thread: threading.Thread | None,
                 command: bytes) -> None:
        """Send a thread its stop command (if it still runs) and join it."""
        if thread is None:
            return
        if sock is not None and thread.is_alive():
            try:
                sock.send(command, zmq.NOBLOCK)
            except zmq.Again:          # its end closed: the thread is on its way out
                pass
        thread.join()

    def running(self) -> bool:
        """Whether both threads still run (False once either died or the server stopped)."""
        threads = (self._backend_thread, self._broker_thread)
        return not self._stopped and all(t is not None and t.is_alive() for t in threads)

    def __enter__(self) -> WorkerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
