"""Shared fixtures: in-process and subprocess workers on random loopback ports, clients, raw sockets.

Every socket a test opens through ``raw_socket`` is closed with linger 0 at teardown; every worker
is stopped; every client is closed, so a leak fails a test instead of hanging CI.
"""

from __future__ import annotations

import logging
import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")   # before numpy loads: 2 cores, workers in the same process
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    # CI's environment sets it: every worker, CLI and child interpreter the tests start compiled
    # the package's modules from source (0.1 s of CPU more per worker start, 0.4 s per CLI run,
    # hundreds of them). They share one bytecode cache instead, in the checkout's ignored
    # .pytest_cache (it goes with the clone).
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "pycache"))
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq
from gguf import GGMLQuantizationType as GT
from requantize import cache_dir
from waiting import wait_until
from zmq_rpc.client import Client
from zmq_rpc.tools.synthetic_gguf import FAMILIES, write_family
from zmq_rpc.worker.launch import LISTENING, local_workers, worker_argv
from zmq_rpc.worker.server import WorkerConfig, WorkerServer

LOOPBACK = "tcp://127.0.0.1:*"


@pytest.fixture
def make_worker() -> Iterator[Callable[..., WorkerServer]]:
    """Start in-process workers: ``make_worker(memory_limit=..., session_timeout=...)``."""
    servers: list[WorkerServer] = []

    def start(**overrides: Any) -> WorkerServer:
        config = WorkerConfig(bind=LOOPBACK, **overrides)
        server = WorkerServer(config)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def worker(make_worker: Callable[..., WorkerServer]) -> WorkerServer:
    """One in-process worker with a 256 MiB memory limit."""
    return make_worker(memory_limit=256 << 20)


@pytest.fixture
def make_client() -> Iterator[Callable[..., Client]]:
    """Open clients that are closed at teardown: ``make_client(endpoint, timeout=...)``."""
    clients: list[Client] = []

    def open_client(endpoint: str, **options: Any) -> Client:
        options.setdefault("timeout", 20.0)
        client = Client(endpoint, **options)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


@pytest.fixture
def client(worker: WorkerServer, make_client: Callable[..., Client]) -> Client:
    return make_client(worker.endpoint)


@pytest.fixture
def silent_router() -> Iterator[zmq.Socket[bytes]]:
    """A ROUTER that takes requests and answers only what the test sends (linger 0)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.bind("tcp://127.0.0.1:0")
    yield sock
    sock.close(linger=0)
    ctx.term()


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def raw_socket(zmq_ctx: zmq.Context[zmq.Socket[bytes]]
               ) -> Iterator[Callable[[int], zmq.Socket[bytes]]]:
    """Raw sockets for speaking (or abusing) the wire protocol; closed with linger 0."""
    sockets: list[zmq.Socket[bytes]] = []

    def make(kind: int) -> zmq.Socket[bytes]:
        sock = zmq_ctx.socket(kind)
        if kind == zmq.DEALER:    # workers key sessions by an unguessable client-chosen id
            sock.setsockopt(zmq.ROUTING_ID, os.urandom(16).replace(b"\0", b"\1"))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sockets.append(sock)
        return sock

    yield make
    for sock in sockets:
        sock.close(linger=0)


class WorkerProcess:
    """A ``zmq-rpc-worker`` subprocess (the package launcher's command line); ``endpoint`` is
    parsed from its first stdout line. Its stderr is a pipe: tests read the worker's logs."""

    def __init__(self, *args: str) -> None:
        cmd = worker_argv(*args, bind=LOOPBACK, threads=None, drain_timeout=None)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if LISTENING not in line:
            self.proc.kill()
            raise RuntimeError(f"worker did not start: {line!r} {self.proc.stderr.read()!r}")
        self.endpoint = line.rsplit(" ", 1)[1].strip()

    def freeze(self, timeout: float = 10) -> None:
        """SIGSTOP, then wait until every thread is stopped: ``kill`` returns once the signal
        is queued, and under load a worker thread can still answer a request for a few ms."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = f"/proc/{self.proc.pid}/task"
        wait_until(lambda: not os.path.isdir(tasks) or all(_stopped(f"{tasks}/{t}/stat")
                                                           for t in os.listdir(tasks)),
                   timeout, "the worker stopped (SIGSTOP) in every thread", interval=0.001)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return code


def _stopped(stat: str) -> bool:
    try:
        with open(stat) as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except OSError:
        return True                 # the thread is gone


@pytest.fixture
def spawn_worker() -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker subprocesses, killed at teardown if still running."""
    procs: list[WorkerProcess] = []

    def spawn(*args: str) -> WorkerProcess:
        proc = WorkerProcess(*args)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.proc.poll() is None:
            proc.terminate(signal.SIGKILL)
        else:
            proc.terminate()


@pytest.fixture(scope="session")
def llama_gguf() -> Any:
    """The SmolLM2 GGUF, opened once for the whole run (skipped outside CI when not installed)."""
    from llama_reference import require_model_path
    from zmq_rpc.client.gguf_model import load_gguf
    return load_gguf(require_model_path())


class RelayLog:
    """The client's peer-copy log records: how many copies it relayed itself."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    @property
    def records(self) -> list[logging.LogRecord]:
        return self.caplog.records              # read late: each test phase has its own list

    def relayed(self) -> int:
        return sum("relaying" in r.getMessage() for r in self.records)


@pytest.fixture
def relay_log(caplog: pytest.LogCaptureFixture) -> Iterator[RelayLog]:
    """Captures ``zmq_rpc.client.peer`` INFO records for the test."""
    with caplog.at_level(logging.INFO, logger="zmq_rpc.client.peer"):
        yield RelayLog(caplog)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-seconds", type=float, default=20.0,
                     help="how long tests/test_fuzz.py fuzzes a live worker (default 20 s; "
                          "raise it for a long run, e.g. --fuzz-seconds 1800 --timeout 0)")


@pytest.fixture
def fuzz_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--fuzz-seconds"))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""A /metrics page's samples, keyed by (name, sorted labels)."""


def scrape(address: str) -> Samples:
    """Every sample of a worker's /metrics page at ``address``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when the page does not have it)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def worker_processes() -> Iterator[list[Client]]:
    """Clients of two worker processes from the package's launcher, shared by a test module."""
    with local_workers(2) as endpoints:
        opened = [Client(e) for e in endpoints]
        try:
            yield opened
        finally:
            for c in opened:
                c.close()


def q4_1_mix(part: str, layer: int, n_layers: int, cols: int) -> GT:
    """SmolLM2's type: the integer kernels, batch-invariant on every CPU path."""
    return GT.Q4_1


@pytest.fixture(scope="module")
def six_layers_q4_1() -> Path:
    """The synthetic llama of tests/synthetic_models.py with 6 layers (2 per worker of 3), in
    Q4_1 only: a recovery replays it as prefill chunks (tests/test_recovery.py,
    tests/test_membership.py)."""
    path = cache_dir() / "synthetic-llama3-6layers-q4_1-v1.gguf"
    if not path.exists():
        write_family(replace(FAMILIES["llama3"], n_layers=6, mix=q4_1_mix), path, seed=62)
    return path


@pytest.fixture
def clients() -> Iterator[Callable[[str], Client]]:
    """``clients(endpoint)``: a Client with default settings, closed at teardown."""
    opened: list[Client] = []

    def open_client(endpoint: str) -> Client:
        opened.append(Client(endpoint))
        return opened[-1]

    yield open_client
    for c in opened:
        c.close()
