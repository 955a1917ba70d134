"""Worker lifecycle: sessions freed on goodbye, death and silence; signals; CLI; packaging layout."""

from __future__ import annotations

import configparser
import logging
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest
from conftest import WorkerProcess
from zmq_rpc.client import Client, ConnectionLost, RpcError
from zmq_rpc.worker.cli import parse_size
from zmq_rpc.worker.server import WorkerConfig, WorkerServer

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_goodbye_frees_the_session(worker: WorkerServer,
                                   make_client: Callable[..., Client]) -> None:
    observer = make_client(worker.endpoint)
    total = observer.device_memory().total
    leaving = make_client(worker.endpoint)
    leaving.alloc_buffer(64 << 20)
    assert observer.device_memory().free == total - (64 << 20)
    leaving.close()
    assert wait_for(lambda: observer.device_memory().free == total)


def test_killed_client_session_expires(make_worker: Callable[..., WorkerServer],
                                       make_client: Callable[..., Client],
                                       caplog: pytest.LogCaptureFixture) -> None:
    worker = make_worker(memory_limit=256 << 20, session_timeout=1.0)
    observer = make_client(worker.endpoint, heartbeat=0.2)
    script = ("import sys, os; from zmq_rpc.client import Client\n"
              "c = Client(sys.argv[1]); c.alloc_buffer(100 << 20)\n"
              "print('allocated', flush=True); os._exit(0)\n")   # dies without goodbye
    with caplog.at_level(logging.INFO, logger="zmq_rpc.worker"):
        out = subprocess.run([sys.executable, "-c", script, worker.endpoint], capture_output=True,
                             text=True, timeout=30)
        assert "allocated" in out.stdout, out.stderr
        assert observer.device_memory().free == (256 - 100) << 20
        assert wait_for(lambda: observer.device_memory().free == 256 << 20, timeout=10)
    assert any("no message for" in r.getMessage() for r in caplog.records)
    again = make_client(worker.endpoint)
    again.alloc_buffer(200 << 20)   # the memory is reusable


def test_heartbeat_keeps_an_idle_session_alive(make_worker: Callable[..., WorkerServer],
                                               make_client: Callable[..., Client]) -> None:
    worker = make_worker(session_timeout=0.6)
    client = make_client(worker.endpoint, heartbeat=0.1)
    buf = client.alloc_buffer(1024)
    t = buf.tensor(4, "int32")
    client.set_tensor(t, np.arange(4, dtype=np.int32))
    time.sleep(2.0)                      # idle, longer than the session timeout
    np.testing.assert_array_equal(client.get_tensor(t), np.arange(4))


def test_silent_client_loses_its_session(make_worker: Callable[..., WorkerServer],
                                         make_client: Callable[..., Client]) -> None:
    worker = make_worker(session_timeout=0.5)
    client = make_client(worker.endpoint, heartbeat=30.0)   # heartbeats too rare on purpose
    buf = client.alloc_buffer(1024)
    time.sleep(1.6)
    with pytest.raises(ConnectionLost, match="no session"):
        client.get_tensor(buf.tensor(4, "int32"))


def test_sigterm_answers_or_fails_in_flight(spawn_worker: Callable[..., WorkerProcess],
                                            make_client: Callable[..., Client]) -> None:
    proc = spawn_worker()
    client = make_client(proc.endpoint, timeout=15)
    buf = client.alloc_buffer(64 << 20)
    t = buf.tensor(16 << 20, "float32")
    values = np.ones(16 << 20, np.float32)
    futures: list[Future[object]] = []
    for _ in range(20):
        futures.append(client.set_tensor_async(t, values))
        futures.append(client.get_tensor_async(t[:1024]))
    time.sleep(0.05)
    assert proc.terminate(signal.SIGTERM) == 0
    outcomes = {"ok": 0, "failed": 0}
    for future in futures:
        try:
            future.result(timeout=20)
            outcomes["ok"] += 1
        except RpcError:
            outcomes["failed"] += 1
    assert sum(outcomes.values()) == len(futures)   # every future resolved, none hangs
    assert outcomes["ok"] >= 1


def test_sigint_exits_zero(spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker()
    assert proc.terminate(signal.SIGINT) == 0


def test_cli_version_and_sizes() -> None:
    out = subprocess.run([sys.executable, "-m", "zmq_rpc.worker.cli", "--version"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("zmq-rpc ")
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_cli_mem_limit(spawn_worker: Callable[..., WorkerProcess],
                       make_client: Callable[..., Client]) -> None:
    proc = spawn_worker("--mem", "8MiB")
    client = make_client(proc.endpoint)
    assert client.device_memory().total == 8 << 20
    with pytest.raises(RpcError, match="over the maximum buffer size 8388608"):
        client.alloc_buffer(9 << 20)
    client.alloc_buffer(6 << 20)
    with pytest.raises(RpcError, match="does not fit: 2097152 of 8388608 bytes free"):
        client.alloc_buffer(3 << 20)


def test_warning_when_binding_beyond_loopback_insecurely(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.worker"):
        server = WorkerServer(WorkerConfig(bind="tcp://0.0.0.0:*", insecure=True))
        server.start()
        server.stop()
    assert any("INSECURE: listening on tcp://0.0.0.0" in r.getMessage()
               for r in caplog.records)


def test_setup_cfg_lists_every_package_folder() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in
                   cfg["options"]["package_dir"].strip().splitlines())
    folders = {p.parent for p in ROOT.glob("*/**/__init__.py")
               if not any(part in {"tests", "build"} or part.startswith(".")
                          for part in p.relative_to(ROOT).parts)}
    for folder in folders:
        rel = folder.relative_to(ROOT).as_posix()
        top = rel.split("/")[0]
        package = "zmq_rpc." + ".".join([top, *rel.split("/")[1:]])
        assert package in listed, f"{rel} is not listed in setup.cfg packages"
        assert mapping.get(f"zmq_rpc.{top}") == top
