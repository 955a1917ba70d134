"""STATUS (protocol 1.5) and ``zmq-rpc-worker status``: what running workers report about
themselves, over the protocol, as a table, as JSON, refreshing; unreachable workers say so."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import WorkerProcess
from zmq_rpc.broker import protocol as p
from zmq_rpc.client import Client, Graph
from zmq_rpc.tools import status as tool
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(60)


def status_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zmq_rpc.tools.worker_command", "status", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_status_reports_other_sessions_memory_and_queue(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client]) -> None:
    w = make_worker(memory_limit=64 << 20)
    busy = make_client(w.endpoint, name="busy-client")
    buf = busy.alloc_buffer(3 << 20)
    x = buf.tensor((16,), "float32")
    g = Graph()
    g.silu(x, out=x)
    busy.register(g)
    busy.set_tensor(x, np.ones(16, np.float32))
    watcher = make_client(w.endpoint, name="watcher")
    status = watcher.status()
    assert isinstance(status, p.StatusReply)
    assert status.sessions == 1 and status.buffers == 1 and status.graphs == 1
    assert status.memory_limit == 64 << 20 and status.memory_used >= 3 << 20
    assert status.devices[0].free_memory == status.memory_limit - status.memory_used
    assert status.queue_depth == 0 and status.version and 0 < status.uptime_ms < 600_000
    assert "status" in status.capabilities and status.server == w.config.name
    [info] = status.session_list
    assert info.client == "busy-client" and info.buffers == 1 and info.graphs == 1
    assert info.memory >= 3 << 20 and len(info.client_id) == 8 and info.sid >= 1
    busy.close()
    assert watcher.status().sessions == 0


def test_status_of_an_older_worker_is_a_clear_error(
        worker: WorkerServer, make_client: Callable[..., Client]) -> None:
    c = make_client(worker.endpoint)
    c.info = p.HelloReply(**{**{f: getattr(c.info, f) for f in c.info.__slots__},
                             "minor": 2, "capabilities": ("views",)})
    with pytest.raises(p.BadRequest, match="STATUS needs 1.5"):
        c.status()


def free_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_cli_table_and_json_for_two_workers_and_a_dead_one(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    a, b = spawn_worker("--mem", "64MiB"), spawn_worker("--mem", "32MiB")
    dead = free_endpoint()
    with Client(a.endpoint, name="job-1") as c:
        c.alloc_buffer(1 << 20)
        c.synchronize()
        done = status_cli(f"{a.endpoint},{b.endpoint},{dead}", "--sessions", "--timeout", "2")
        assert done.returncode == 1, done.stderr          # one worker did not answer
        lines = done.stdout.splitlines()
        assert lines[0].split()[:3] == ["WORKER", "NAME", "VERSION"]
        row_a = next(line for line in lines if line.startswith(a.endpoint + " "))
        assert "1.0 MiB / 64.0 MiB" in row_a and " {}.{} ".format(*p.PROTOCOL_VERSION) in row_a
        assert next(line for line in lines if line.startswith(dead)).split()[1] == "unreachable:"
        assert any("job-1" in line and line.startswith(a.endpoint) for line in lines)
        done = status_cli(f"{a.endpoint},{b.endpoint}", "--json")
        assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    by_endpoint = {w["endpoint"]: w for w in doc["workers"]}
    assert by_endpoint[a.endpoint]["status"]["sessions"] == 1
    assert by_endpoint[a.endpoint]["status"]["session_list"][0]["client"] == "job-1"
    assert by_endpoint[b.endpoint]["status"]["memory_limit"] == 32 << 20
    assert by_endpoint[b.endpoint]["protocol"] == "{}.{}".format(*p.PROTOCOL_VERSION) and by_endpoint[b.endpoint]["error"] is None


def test_cli_watch_refreshes_until_interrupted(spawn_worker: Callable[..., WorkerProcess]) -> None:
    w = spawn_worker()
    proc = subprocess.Popen([sys.executable, "-m", "zmq_rpc.tools.worker_command", "status", w.endpoint,
                             "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        seen = 0
        deadline = time.monotonic() + 30
        while seen < 3 and time.monotonic() < deadline:
            if proc.stdout.readline().startswith("WORKER"):
                seen += 1
        assert seen == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_table_formatting() -> None:
    assert tool.human_bytes(1536) == "1.5 KiB" and tool.human_bytes(12) == "12 B"
    assert tool.human_seconds(3725) == "1h02m" and tool.human_seconds(5.25) == "5.2s"
    assert tool.human_seconds(90061) == "1d01h"
    row = tool.Row("tcp://x:1", error="Timeout: no reply")
    cells = tool.worker_cells(row)
    assert cells[:2] == ["tcp://x:1", "unreachable: Timeout: no reply"]
    assert len(cells) == len(tool.WORKER_COLUMNS)
