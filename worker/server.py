"""A whole worker in one object: the broker thread, the backend thread, and their lifecycle.

:class:`WorkerServer` is created and stopped by one thread (the CLI's main thread, or a test). It owns
the zmq context and the control sockets that tell the other two threads to stop; the broker thread
owns the ROUTER (:mod:`zmq_rpc.broker.broker`), the backend thread owns every byte of tensor state
(:class:`~zmq_rpc.worker.backend_thread.BackendThread`, running
:class:`~zmq_rpc.worker.dispatch.executor.Executor`).

Start-up comes in two steps: :meth:`WorkerServer.listen` binds the client port and starts the
broker (this module imports only that: zmq, the endpoint and key rules), :meth:`WorkerServer.start`
then imports and starts the backend thread; requests that arrive in between wait in the
backend's PAIR.

Shutdown (``stop()``, SIGINT/SIGTERM in the CLI): the backend answers every request it already
holds, fails those still waiting with SHUTTING_DOWN, then the broker stops forwarding and closes the
ROUTER with a linger so the last replies reach their clients.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from ..broker.broker import BrokerConfig, BrokerThread
from ..broker.endpoints import EndpointError, bind_endpoint, is_loopback_endpoint
from ..broker.limits import DEFAULT_MAX_SESSIONS, DEFAULT_MAX_WORK
from .process.devices import parse_device, physical_memory
from .process.early_listen import DEFAULT_BIND

if TYPE_CHECKING:       # the rest loads after the worker listens (see WorkerServer.listen)
    from ..broker.keys import KeyPair
    from ..broker.zap import ZapThread
    from .backend_thread import BackendThread
    from .backends.base import Backend
    from .files.model_files import ModelFiles
    from .files.tensor_cache import TensorCache
    from .observe.exporter import MetricsServer
    from .observe.metrics import Recorder
    from .sessions.session import WorkerLimits

log = logging.getLogger("zmq_rpc.worker")

_ids = itertools.count()

@dataclass
class WorkerConfig:
    """Everything a worker is started with (the CLI's flags)."""

    bind: str = DEFAULT_BIND
    listening_fd: int | None = None
    """A socket already listening on ``bind`` (:mod:`.process.early_listen`), which the ROUTER
    adopts instead of binding its own; it owns the descriptor from then on."""
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
    max_sessions: int = DEFAULT_MAX_SESSIONS
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


@dataclass(frozen=True)
class _Endpoints:
    """The inproc endpoints between a worker's threads (unique per server in the process)."""

    uid: str

    @property
    def pair(self) -> str:
        return f"inproc://zmq-rpc-backend-{self.uid}"

    @property
    def backend_ctl(self) -> str:
        return f"inproc://zmq-rpc-backend-ctl-{self.uid}"

    @property
    def broker_ctl(self) -> str:
        return f"inproc://zmq-rpc-broker-ctl-{self.uid}"


class WorkerServer:
    """A running worker: ``with WorkerServer(WorkerConfig(bind="tcp://127.0.0.1:*")) as w: w.endpoint``."""

    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.endpoint = ""
        self._uid = f"{os.getpid()}-{next(_ids)}"
        self._endpoints = _Endpoints(self._uid)
        self._peer_endpoint = ""
        self._backend_thread: BackendThread | None = None
        self._broker_thread: BrokerThread | None = None
        self._backend_ctl: zmq.Socket[bytes] | None = None
        self._broker_ctl: zmq.Socket[bytes] | None = None
        self._zap: ZapThread | None = None
        self._stopped = False
        self.metrics: Recorder | None = None
        """What the backend thread records for the metrics endpoint (with a metrics port)."""
        self.metrics_server: MetricsServer | None = None
        self.metrics_address = ""
        """``http://host:port`` of the metrics endpoint once started ("" without one)."""

    def limits(self, backend: Backend) -> WorkerLimits:
        """The effective limits (defaults resolved against the device's memory)."""
        from .sessions.quotas import default_session_share  # after listening: see listen()
        from .sessions.session import WorkerLimits
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

    def listen(self) -> str:
        """Bind the client port and start forwarding; returns the bound endpoint (a ``*`` port
        resolved). Requests that arrive before :meth:`start` has the backend thread up wait in
        the backend's PAIR (inproc: connected before it is bound): the worker listens before
        numpy and the executor are imported. A bad configuration (security, ``--mem`` beyond a
        CPU's memory, the port) fails here, before anything listens."""
        cfg = self.config
        self._peer_endpoint = self._peer_bind()
        try:
            check_security(cfg, self._peer_endpoint)
            if parse_device(cfg.device)[0] == "cpu":     # a GPU's memory: once cupy is loaded
                check_memory_limit(cfg.memory_limit, physical_memory(), cfg.device)
            if cfg.curve is not None:
                self._start_zap(cfg.curve)
            self._broker_ctl = self.ctx.socket(zmq.PAIR)
            self._broker_ctl.bind(self._endpoints.broker_ctl)
            self._broker_thread = BrokerThread(self.ctx, BrokerConfig(
                bind=cfg.bind, listening_fd=cfg.listening_fd,
                backend_endpoint=self._endpoints.pair,
                control_endpoint=self._endpoints.broker_ctl,
                max_message_size=cfg.max_message_size, curve=cfg.curve))
            self._broker_thread.start()
            self._wait_ready(self._broker_thread)
            self.endpoint = self._broker_thread.endpoint
            check_bound(cfg, self.endpoint)
        except BaseException:
            self.stop()
            raise
        log.info("worker %s listening on %s (device %s)", cfg.name, self.endpoint, cfg.device)
        return self.endpoint

    def start(self) -> str:
        """:meth:`listen` (unless done), then start the backend thread and, with a metrics
        port, the metrics endpoint; returns the bound endpoint."""
        if self._broker_thread is None:
            self.listen()
        cfg = self.config
        try:
            from .backend_thread import BackendThread, make_backend  # numpy: see listen()
            backend = make_backend(cfg.device)
            limits = self.limits(backend)
            if cfg.metrics_port is not None:
                from .observe.metrics import Recorder
                self.metrics = Recorder()
            self._backend_thread = BackendThread(
                self.ctx, backend, limits, (self._endpoints.pair, self._endpoints.backend_ctl),
                cfg.name, (self._peer_endpoint, cfg.peer_advertise), cfg.curve,
                cfg.worker_keys, self.metrics, cfg.authorized_keys)
            self._backend_thread.disk = self._disk()
            self._backend_thread.start()
            self._wait_ready(self._backend_thread)
            self._backend_ctl = self._control(self._endpoints.backend_ctl)
            check_bound(cfg, self._backend_thread.peer_bound)
            if cfg.metrics_port is not None:
                self._start_metrics(backend)
        except BaseException:
            self.stop()
            raise
        log.info("worker %s serving on %s", cfg.name, self.endpoint)
        return self.endpoint

    def _start_metrics(self, backend: Backend) -> None:
        """Serve the recorder's metrics over HTTP (prometheus_client is imported only here)."""
        cfg = self.config
        assert self.metrics is not None
        from ..broker.protocol import PROTOCOL_VERSION
        from .process.version import package_version
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
        from .files.model_files import ModelFiles  # after listening: see listen()
        from .files.tensor_cache import TensorCache
        from .formats import hashing
        cfg = self.config
        if (cfg.model_dirs or cfg.cache_dir) and not hashing.available():
            raise RuntimeError("--model-dir and --cache-dir need the blake3 package: "
                               "pip install 'zmq-rpc[files]'")
        files = ModelFiles(cfg.model_dirs) if cfg.model_dirs else None
        cache = TensorCache(cfg.cache_dir, cfg.cache_size) if cfg.cache_dir else None
        return files, cache

    def _start_zap(self, keys: KeyPair) -> None:
        from ..broker.zap import CLIENT_DOMAIN, PEER_DOMAIN, KeySet, ZapPolicy, ZapThread
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

    def drain(self) -> None:
        """Leave on purpose: the backend goes on answering every request, marks its replies
        ``draining`` (protocol 1.14) so that models move their layers off, and refuses new
        sessions; :meth:`drained` says when no session is left. :meth:`stop` follows."""
        thread = self._backend_thread
        if self._stopped or thread is None or not thread.is_alive() or self._backend_ctl is None:
            return
        from .backend_thread import DRAIN
        self._backend_ctl.send(DRAIN)

    def drained(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a draining worker to have no session left; True
        at once when the backend is not running."""
        thread = self._backend_thread
        if thread is None or not thread.is_alive():
            return True
        return thread.drained.wait(timeout)

    def running(self) -> bool:
        """Whether both threads still run (False once either died or the server stopped)."""
        threads = (self._backend_thread, self._broker_thread)
        return not self._stopped and all(t is not None and t.is_alive() for t in threads)

    def __enter__(self) -> WorkerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
