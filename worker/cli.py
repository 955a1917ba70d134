"""``zmq-rpc-worker``: run one worker process until SIGINT/SIGTERM.

The main thread parses and checks flags (endpoints, sizes), pins BLAS threads (before numpy is
imported), makes a :class:`~zmq_rpc.worker.server.WorkerServer` listen and prints the endpoint,
then loads the backend (numpy, the executor, the kernels' settings: clients that connect
meanwhile wait in its queue), freezes what start-up made (:mod:`.process.gc_pacing`), and waits
for a signal (or for one of the worker's threads to end on its own); then it stops the server
(in-flight requests answered or failed) within :data:`SHUTDOWN_BOUND_S` and exits 0.
SIGTERM with ``--drain-timeout`` (default :data:`DRAIN_TIMEOUT_S`) drains first: the worker keeps
answering, tells its clients it is leaving (protocol 1.14) so that their models move off it at
their next step, refuses new sessions, and stops once its last session has closed or the timeout
has passed; a second SIGTERM, or SIGINT, stops it at once.
The entry points (:mod:`.entry`) have the client port listening before this module is imported
(:mod:`.process.early_listen`; the ROUTER adopts that socket);
until the ROUTER exists it imports only what parsing and binding need
(:mod:`zmq_rpc.broker.limits` for the defaults ``--help`` shows).
A worker that cannot start (address in use, bad ``--mem``) says why and exits 1 at once.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from ..broker.endpoints import EndpointError, bind_endpoint, parse_endpoint
from ..broker.limits import DEFAULT_MAX_SESSIONS, DEFAULT_MAX_WORK, MAX_NODES, NODE_WORK
from .observe.logs import configure_logging
from .process.devices import parse_device
from .process.early_listen import DEFAULT_BIND
from .process.gc_pacing import freeze_start_up

if TYPE_CHECKING:
    from .server import WorkerServer

log = logging.getLogger("zmq_rpc.worker")

SHUTDOWN_BOUND_S = 10.0
"""Seconds a worker may take to answer or fail what it holds after SIGINT/SIGTERM."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

DRAIN_TIMEOUT_S = 30.0
"""Default ``--drain-timeout``: long enough for a model to move a stage off (a load from the
worker's own file or cache and a re-prefill take seconds, docs/FAILURES.md), short enough for a
service manager's stop (systemd waits 90 s before SIGKILL)."""

BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
BLAS_THREAD_TIMEOUT = "16"
"""``OPENBLAS_THREAD_TIMEOUT`` of a worker with ``--threads`` > 1 (unless the environment sets it):
OpenBLAS's idle threads spin 2^16 cycles before they sleep, not its default 2^28, which kept a CPU
from the quantized kernels' own threads (:mod:`.kernels.split`): two pools spinning at once made
two threads slower than one (docs/DESIGN.md, "Threads per product")."""


def blas_env(threads: int) -> dict[str, str]:
    """The environment variables that pin BLAS (and OpenMP) to ``threads`` threads, with a short
    idle spin (:data:`BLAS_THREAD_TIMEOUT`) when there are several; the worker sets them before
    numpy is imported, benches give them to their children."""
    env = {var: str(threads) for var in BLAS_THREAD_VARS}
    if threads > 1:
        env["OPENBLAS_THREAD_TIMEOUT"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    return env

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Parse sizes written like ``512MiB``, ``4GiB``, ``1.5GB`` or ``1048576`` into bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 512MiB, 4GiB, 100MB)")
    return int(float(match.group(1)) * _UNITS[unit])


SCHEMES = ("tcp", "ipc")
"""What a worker listens on (inproc:// reaches only its own process: use WorkerServer for that)."""


def endpoint(text: str, *, wildcard_port: bool = True) -> str:
    """``text`` if a worker can bind it (``tcp://HOST:PORT``, ``tcp://HOST:*``, ``ipc://PATH``),
    read the way libzmq reads it (:mod:`zmq_rpc.broker.endpoints`: a ``SRC;`` source address,
    IPv4 written otherwise than a.b.c.d and unbracketed IPv6 are refused).

    Raises :class:`argparse.ArgumentTypeError` saying what is wrong and what to write instead.
    """
    scheme, sep, _ = text.partition("://")
    if sep and scheme not in SCHEMES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: scheme {scheme}:// is not one of {', '.join(s + '://' for s in SCHEMES)}")
    try:
        parsed = bind_endpoint(text) if wildcard_port else parse_endpoint(text, wildcard_port=False)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("endpoint ")) from None
    if parsed.scheme == "tcp" and parsed.port == "0":
        raise argparse.ArgumentTypeError(f"{text!r}: port 0: write * for a free port")
    return text


def _peer_bind(text: str) -> str:
    return text if text == "none" else endpoint(text)


def _port(text: str) -> int:
    """A TCP port, 0 for a free one."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is 0-65535 (0: a free one)")
    return int(text)


def _device(text: str) -> str:
    try:
        parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_size(minimum: int, hint: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        size = parse_size(text)
        if size < minimum:
            least = "more than 0 bytes" if minimum <= 1 else f"at least {minimum >> 10}KiB"
            raise argparse.ArgumentTypeError(f"{text!r}: must be {least}"
                                             + (f" ({hint})" if hint else ""))
        return size
    return parse


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
        return value
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return value


DESCRIPTION = "Run one zmq-rpc worker until SIGINT or SIGTERM."
EPILOG = (f"SIGTERM drains first (--drain-timeout, default {DRAIN_TIMEOUT_S:g} s): the worker "
          f"keeps answering, tells its clients it is leaving so that their models move their "
          f"layers to other workers at their next step, refuses new sessions, and stops once its "
          f"last session has closed or the timeout has passed (a second SIGTERM: at once). "
          f"SIGINT (or SIGTERM with --drain-timeout 0): requests already received are answered "
          f"or failed, then the worker "
          f"exits 0 (a later signal does not change that); if that takes more than "
          f"{SHUTDOWN_BOUND_S:g} s (one long graph run), it exits 1 without waiting. Exit 1 also "
          f"when it cannot start (address in use, bad --mem, no such device), 2 for bad flags. "
          f"'zmq-rpc-worker status tcp://HOST:PORT[,...] [--json] [--sessions] [--watch [S]] "
          f"[--curve-key FILE]' "
          f"asks running workers what they are doing.")


class VersionAction(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked
    (importlib.metadata costs tens of milliseconds, and every start parses the flags)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        from .process.version import package_version
        print(f"zmq-rpc {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line."""
    ap = argparse.ArgumentParser(prog="zmq-rpc-worker", description=DESCRIPTION, epilog=EPILOG)
    ap.add_argument("--bind", type=endpoint, default=DEFAULT_BIND,
                    help="endpoint to listen on for clients: tcp://HOST:PORT (HOST a.b.c.d, "
                         "[IPv6], * or a name; port * picks a free one) or ipc://PATH "
                         "(default %(default)s)")
    ap.add_argument("--device", type=_device, default="cpu",
                    help="cpu (numpy), or cuda / cuda:N for GPU N (cupy: pip install "
                         "'zmq-rpc[cuda]'); several GPUs: one worker each, on its own port "
                         "(default %(default)s)")
    ap.add_argument("--mem", type=_positive_size(1, "leave --mem out for 80% of the device"),
                    default=0,
                    help="memory the worker may hand out, e.g. 512MiB or 4GiB; more than 0 and at "
                         "most the device's memory (default: 80%% of the device's memory)")
    ap.add_argument("--session-mem", type=_positive_size(1), default=0,
                    help="memory one client session may hold: buffers, graph arenas, replies "
                         "and peer sends being materialized (default: 3/4 of --mem, so that one "
                         "session always leaves a quarter to the others)")
    ap.add_argument("--max-sessions", type=_positive(int), default=DEFAULT_MAX_SESSIONS,
                    help="client sessions served at once; the HELLO of one more is refused "
                         "with OUT_OF_MEMORY (default %(default)s)")
    ap.add_argument("--identity-mem", type=_positive_size(1), default=0,
                    help="memory all sessions of one client identity may hold together (under "
                         "CURVE an identity is an authorized key, proven at HELLO; clients "
                         "older than protocol 1.8 share one; without CURVE each session is its "
                         "own): default 3/4 of --mem, so that one client, however many "
                         "sessions it opens, always leaves a quarter to the others")
    ap.add_argument("--identity-sessions", type=_positive(int), default=0,
                    help="sessions one client identity may hold at once; the HELLO of one "
                         "more is refused with OUT_OF_MEMORY (default: 3/4 of --max-sessions, "
                         "so one client cannot lock the others out)")
    ap.add_argument("--max-buffer", type=_positive_size(1), default=0,
                    help="largest single buffer (default: --mem)")
    ap.add_argument("--max-message", type=_positive_size(64 << 10), default=64 << 20,
                    help="largest message accepted, at least 64KiB; bigger tensors travel in "
                         "chunks (default 64MiB)")
    ap.add_argument("--peer-bind", type=_peer_bind, default=None,
                    help="endpoint where other workers push tensors to this one (default: the "
                         "--bind host, a free port; none disables worker-to-worker copy)")
    ap.add_argument("--peer-advertise", type=partial(endpoint, wildcard_port=False), default=None,
                    help="peer endpoint to tell clients, when it differs from what is bound "
                         "(NAT, multi-host)")
    ap.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                    help="a directory whose GGUF/safetensors files clients may have this worker "
                         "read into its buffers (repeatable; paths out of it are refused)")
    ap.add_argument("--cache-dir", default="", metavar="DIR",
                    help="keep uploaded tensors in a content-addressed cache here (BLAKE3 keys, "
                         "checked on every read) so that later loads skip the upload")
    ap.add_argument("--cache-size", type=parse_size, default=8 << 30,
                    help="bytes the tensor cache may hold (least recently used go first; "
                         "default 8GiB)")
    ap.add_argument("--drain-timeout", type=_non_negative, default=DRAIN_TIMEOUT_S,
                    metavar="SECONDS",
                    help="on SIGTERM, how long the worker goes on serving while the models "
                         "using it move their layers off it (it leaves as soon as its last "
                         "session closes); 0 stops at once (default %(default)s)")
    ap.add_argument("--session-timeout", type=_positive(float), default=30.0,
                    help="seconds of silence after which a client's session and its buffers are "
                         "freed (default %(default)s)")
    ap.add_argument("--max-graph-work", type=_positive(int), default=DEFAULT_MAX_WORK,
                    help="element-ops one graph run may ask for: every element read or written, "
                         f"repeated views counted in full, multiply-adds / 32, {NODE_WORK:,} "
                         "per node (its fixed cost; a graph has at most "
                         f"{MAX_NODES:,} nodes) (default {DEFAULT_MAX_WORK:,})")
    sec = ap.add_argument_group("security (docs/SECURITY.md)")
    sec.add_argument("--curve-secret-key", metavar="FILE", default=None,
                     help="this worker's CURVE key pair (a .key_secret file from zmq-rpc-keygen, "
                          "mode 0600): clients and peers must authenticate, every byte is "
                          "encrypted")
    sec.add_argument("--authorized-keys", metavar="DIR", default=None,
                     help="directory of client public keys (*.key) allowed to connect; reread "
                          "when any file in it changes (added, removed, rewritten in place): "
                          "handshakes that start 0.1 s after a change see it. A malformed "
                          "file is refused (logged by name) and the others apply")
    sec.add_argument("--worker-keys", metavar="DIR", default=None,
                     help="directory of worker public keys this worker accepts pushes from and "
                          "pushes to (its own key always counts)")
    sec.add_argument("--insecure", action="store_true",
                     help="allow listening beyond loopback without CURVE (anyone who reaches the "
                          "port can use the worker; logged loudly)")
    ap.add_argument("--exit-with-parent", action="store_true",
                    help="stop, as on SIGINT, once the process that started this worker has "
                         "exited (checked every 0.1 s): for the workers a tool starts for itself "
                         "(generate, zmq-rpc-serve, the bench), so that a tool killed with "
                         "SIGKILL leaves none behind (default: off)")
    ap.add_argument("--preload-kernels", action="store_true",
                    help="load numba and the fused kernels (from the on-disk cache) on a thread "
                         "of their own as the worker starts, not when a model's first lay-out "
                         "asks (~0.5-0.7 s sooner): for a worker that will run models; it holds "
                         "numba's runtime (~110 MiB) from the start (default: off)")
    ap.add_argument("--threads", type=_positive(int), default=1,
                    help="threads per product: BLAS, and the quantized kernels split rows "
                         "(default %(default)s)")
    ap.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                    help="(default %(default)s)")
    ap.add_argument("--log-format", default="text", choices=["text", "json"],
                    help="text lines, or one JSON object per line for log collectors "
                         "(default %(default)s; at INFO: start, stop, one line per session "
                         "event)")
    ap.add_argument("--metrics-port", type=_port, default=None,
                    help="serve Prometheus metrics over HTTP on this port (0: a free one, "
                         "printed on stdout; default: no metrics)")
    ap.add_argument("--metrics-host", default="127.0.0.1",
                    help="address the metrics endpoint listens on (default %(default)s)")
    ap.add_argument("--version", action=VersionAction, help="show the version and exit")
    return ap


def tune_malloc(mmap_threshold: int = 64 << 20, trim_threshold: int = 64 << 20) -> bool:
    """Let glibc reuse freed message buffers instead of mapping fresh pages per message.

    libzmq mallocs every received message; above glibc's mmap threshold each one is a new
    mapping whose pages are faulted in on first touch, slower than reused ones. Raising the
    thresholds keeps chunk-sized buffers in the heap for reuse (docs/DESIGN.md). No-op where glibc's mallopt is unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, mmap_threshold)) and bool(libc.mallopt(-1, trim_threshold))
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None, listening_fd: int | None = None) -> int:
    """Run one worker; returns the exit code (see :data:`EPILOG`). ``zmq-rpc-worker status ...``
    is :mod:`zmq_rpc.tools.worker_command`'s other branch (a client: the worker never imports one).
    ``listening_fd``: a socket already listening on ``--bind``'s address
    (:mod:`.process.early_listen`), for the ROUTER to adopt."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    os.environ.update(blas_env(args.threads))
    tune_malloc()
    configure_logging(args.log_level, args.log_format)
    from .server import WorkerConfig, WorkerServer

    curve = None
    if args.curve_secret_key:       # key files: only then (a plain worker listens sooner)
        from ..broker.keys import KeyFileError, load_keypair
        try:
            curve = load_keypair(args.curve_secret_key)
        except KeyFileError as exc:
            print(f"zmq-rpc-worker: cannot start: {exc}", file=sys.stderr, flush=True)
            return 1

    config = WorkerConfig(bind=args.bind, listening_fd=listening_fd, device=args.device,
                          memory_limit=args.mem,
                          max_buffer_size=args.max_buffer, max_message_size=args.max_message,
                          session_timeout=args.session_timeout,
                          max_graph_work=args.max_graph_work,
                          session_memory=args.session_mem,
                          max_sessions=int(args.max_sessions),
                          identity_memory=args.identity_mem,
                          identity_sessions=int(args.identity_sessions),
                          peer_bind="" if args.peer_bind == "none" else args.peer_bind,
                          peer_advertise=args.peer_advertise or "", curve=curve,
                          authorized_keys=args.authorized_keys, worker_keys=args.worker_keys,
                          insecure=args.insecure, model_dirs=tuple(args.model_dir),
                          cache_dir=args.cache_dir, cache_size=args.cache_size,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host)
    parent = os.getppid() if args.exit_with_parent else None
    signals = Signals(drain=args.drain_timeout > 0)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signals.handle)
    server = WorkerServer(config)
    try:
        endpoint = server.listen()
    except Exception as exc:
        print(f"zmq-rpc-worker: cannot start: {exc}", file=sys.stderr, flush=True)
        return 1
    code = 1
    try:
        announce([f"zmq-rpc-worker listening on {endpoint}"])
        start_backend(server, args.threads, preload=args.preload_kernels and args.device == "cpu")
        freeze_start_up()   # full collections walk only what clients make (worker/process/gc_pacing.py)
        if server.metrics_address:
            announce([f"zmq-rpc-worker metrics on {server.metrics_address}/metrics"])
        code = serve_until(signals, server, args.drain_timeout, parent)
    except Exception as exc:
        print(f"zmq-rpc-worker: cannot start: {exc}", file=sys.stderr, flush=True)
    finally:     # whatever went wrong, the server's threads must not outlive main()
        code = stop_within(server, SHUTDOWN_BOUND_S, code)
    return code


def start_backend(server: WorkerServer, threads: int, preload: bool = False) -> None:
    """The worker's backend, once it listens: numpy and the kernels load now, with the BLAS
    variables already set (clients that connected meanwhile wait in the backend's queue).
    ``preload``: then numba and the fused kernels on a daemon thread (:func:`.kernels.preload`),
    while the backend serves."""
    from . import kernels
    kernels.set_threads(threads)
    server.start()
    if preload:
        threading.Thread(target=kernels.preload, name="kernel-preload", daemon=True).start()


def announce(lines: list[str]) -> None:
    """Print what a launcher reads on stdout. A stdout that is closed or whose reader went away
    is logged, not fatal: the worker serves all the same (the address is in the log too), and
    SIGINT/SIGTERM still stop it."""
    try:
        for line in lines:
            print(line, flush=True)
    except (OSError, ValueError) as exc:      # BrokenPipeError, EBADF, a closed file
        log.warning("cannot write the worker's address to stdout (%s); serving anyway", exc)
        sys.stdout = open(os.devnull, "w")    # no second error when the interpreter flushes it


class Signals:
    """What the stop signals asked for (set by the handlers on the main thread): SIGINT stops;
    the first SIGTERM drains when ``drain``, any later one stops."""

    def __init__(self, *, drain: bool) -> None:
        self.stop = threading.Event()
        self.drain = threading.Event()
        self._may_drain = drain

    def handle(self, sig: int, frame: object) -> None:
        if sig == signal.SIGTERM and self._may_drain and not self.drain.is_set():
            self.drain.set()
        else:
            self.stop.set()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True once a signal asked for a stop or a drain."""
        return self.stop.wait(seconds) or self.drain.is_set()


def serve_until(signals: Signals, server: WorkerServer, drain_timeout: float = 0.0,
                parent: int | None = None) -> int:
    """Wait for a stop signal (exit code 0), a drain (:func:`drain_until`), the end of the
    process ``parent`` (``--exit-with-parent``: 0) or for a worker thread to end on its own
    (1)."""
    while not signals.wait(0.1):
        if not server.running():
            log.error("a worker thread ended on its own; stopping")
            return 1
        if parent is not None and os.getppid() != parent:
            log.warning("the process that started this worker (pid %d) has exited; stopping",
                        parent)
            return 0
    if signals.drain.is_set() and not signals.stop.is_set():
        return drain_until(signals, server, drain_timeout)
    return 0


def drain_until(signals: Signals, server: WorkerServer, timeout: float) -> int:
    """Drain ``server`` until its last session has closed, ``timeout`` seconds have passed or
    a second signal came (exit code 0 each), or a worker thread ended on its own (1)."""
    log.warning("SIGTERM: draining for up to %g s (clients are told to move off; new sessions "
                "are refused); a second SIGTERM or SIGINT stops at once", timeout)
    server.drain()
    deadline = time.monotonic() + timeout
    while not signals.stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("draining: %g s passed with sessions still open; stopping", timeout)
            return 0
        if server.drained(min(0.1, left)):
            log.info("drained: no session left; stopping")
            return 0
        if not server.running():
            log.error("a worker thread ended on its own while draining; stopping")
            return 1
    log.warning("draining cut short by a second signal; stopping")
    return 0


def stop_within(server: WorkerServer, bound: float, code: int) -> int:
    """Stop ``server``; past ``bound`` seconds, leave the process at once with exit code 1."""
    def give_up() -> None:
        log.error("shutdown took more than %g s; exiting without waiting", bound)
        logging.shutdown()
        os._exit(1)
    watchdog = threading.Timer(bound, give_up)
    watchdog.daemon = True
    watchdog.start()
    server.stop()
    watchdog.cancel()
    for sig in STOP_SIGNALS:      # a late second signal must not turn exit 0 into death by signal
        signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
