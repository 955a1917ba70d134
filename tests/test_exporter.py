"""A real scrape: the Prometheus server (Debian's ``prometheus`` package) scrapes two worker
subprocesses while a client works them, and its HTTP query API returns the workers' counters.

Skipped, saying so, where the ``prometheus`` binary is absent (``apt-get install prometheus``;
.ci/run installs it when it runs as root). Everything listens on loopback only.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.client import Client, Graph

pytestmark = pytest.mark.timeout(120)

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = Path(__file__).resolve().parent.parent / "tools" / "grafana_dashboard.json"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metrics_address(proc: WorkerProcess) -> str:
    assert proc.proc.stdout is not None
    line = proc.proc.stdout.readline()
    assert "metrics on" in line, line
    return line.split(" on ", 1)[1].strip().removeprefix("http://").removesuffix("/metrics")


class PrometheusServer:
    """A Prometheus process scraping ``targets`` every 0.5 s, storing into ``tmp``."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
            "scrape_configs:\n  - job_name: zmq-rpc\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.log = (tmp / "prometheus.log").open("w")
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector ([] while Prometheus is not up yet)."""
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.load(response)
        except OSError:
            return []
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait_for(self, expr: str, check: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 60) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = []

        def holds() -> bool:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            result[:] = self.query(expr)
            return check(result)
        wait_until(holds, timeout, lambda: f"{expr} as expected: still {result}", interval=0.5)
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], PrometheusServer]]:
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus); "
                    "the real-scrape test needs it")
    servers: list[PrometheusServer] = []

    def start(targets: list[str]) -> PrometheusServer:
        server = PrometheusServer(tmp_path, targets)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def by_instance(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["instance"]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_two_workers(spawn_worker: Callable[..., WorkerProcess],
                                        prometheus: Callable[[list[str]], PrometheusServer]
                                        ) -> None:
    workers = [spawn_worker("--metrics-port", "0", "--mem", "64MiB") for _ in range(2)]
    targets = [metrics_address(w) for w in workers]
    prom = prometheus(targets)
    prom.wait_for("up", lambda r: sorted(by_instance(r)) == sorted(targets)
                  and all(v == 1 for v in by_instance(r).values()))
    a, b = (Client(w.endpoint) for w in workers)
    try:
        x = a.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
        y = b.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
        for _ in range(5):
            a.set_tensor(x, np.ones(1 << 18, np.float32))
        g = Graph()
        g.silu(y, out=y)
        handle = b.register(g)
        a.copy_tensor(x, y)
        for _ in range(3):
            b.run(handle)
        sets = prom.wait_for('zmq_rpc_requests_total{command="SET_TENSOR",outcome="ok"}',
                             lambda r: sum(by_instance(r).values()) == 5)
        assert list(by_instance(sets)) == [targets[0]]
        prom.wait_for("zmq_rpc_graph_runs_total", lambda r: by_instance(r).get(targets[1]) == 3)
        prom.wait_for('zmq_rpc_peer_transfers_total{direction="in",outcome="ok"}',
                      lambda r: by_instance(r) == {targets[0]: 0, targets[1]: 1})
        received = prom.wait_for('zmq_rpc_bytes_received_total{link="client"}',
                                 lambda r: by_instance(r).get(targets[0], 0) >= 5 << 20)
        assert by_instance(received)[targets[1]] > 0
        prom.wait_for("sum(zmq_rpc_sessions)", lambda r: bool(r) and r[0]["value"][1] == "2")
        prom.wait_for("zmq_rpc_graphs_registered", lambda r: by_instance(r).get(targets[1]) == 1)
        quantile = prom.wait_for(
            'histogram_quantile(0.5, sum by (le) (zmq_rpc_request_execution_seconds_bucket'
            '{command="SET_TENSOR"}))', lambda r: bool(r) and float(r[0]["value"][1]) > 0)
        assert float(quantile[0]["value"][1]) < 10
    finally:
        a.close()
        b.close()
    prom.wait_for("sum(zmq_rpc_sessions)", lambda r: bool(r) and r[0]["value"][1] == "0")


def test_grafana_dashboard_queries_metrics_the_workers_export() -> None:
    """Each panel's query names only metrics a worker serves (no dangling panels)."""
    from zmq_rpc.worker.observe import exporter
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    documented = exporter.__doc__ or ""
    for expr in exprs:
        names = {word for word in _words(expr) if word.startswith("zmq_rpc_")}
        assert names, expr
        for name in names:
            base = name.removeprefix("zmq_rpc_")
            for suffix in ("_bucket", "_total"):
                base = base.removesuffix(suffix)
            assert base in documented or base.startswith("process_"), (name, expr)


def _words(expr: str) -> list[str]:
    out, word = [], ""
    for ch in expr + " ":
        if ch.isalnum() or ch == "_":
            word += ch
        else:
            if word:
                out.append(word)
            word = ""
    return out
