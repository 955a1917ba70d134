"""Load: N clients x M requests against a worker process, every reply accounted for (none lost,
none duplicated, none late, none failed, every GET returning what its client wrote). Issue 13."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import WorkerProcess
from zmq_rpc.tools.loadtest import run_load

pytestmark = pytest.mark.timeout(120)


def test_many_clients_every_reply_accounted_for(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    worker = spawn_worker("--mem", "64MiB")
    report = run_load(worker.endpoint, clients=8, requests=1500, window=64, timeout=60.0)
    print(f"{report.replies} replies from {report.clients} clients in {report.seconds:.1f} s: "
          f"{report.rate:,.0f}/s, p50 {report.p50_ms:.1f} ms, p99 {report.p99_ms:.1f} ms, "
          f"max {report.max_ms:.0f} ms")
    assert report.replies == report.requests == 12_000
    assert (report.lost, report.duplicated, report.late, report.wrong) == (0, 0, 0, 0)
    assert report.failed == []
