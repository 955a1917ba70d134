"""The worker's recorder (no sockets) and its Prometheus endpoint on real workers: counters by
command and outcome, latency histograms, bytes per link, gauges, peer transfers, JSON logs."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
import zmq
from conftest import Samples, WorkerProcess, sample, scrape
from waiting import wait_until
from zmq_rpc.broker.protocol import Cmd
from zmq_rpc.client import Client, Graph, InvalidHandle, OutOfMemory
from zmq_rpc.worker.observe.exporter import WorkerCollector, default_names, default_outcomes
from zmq_rpc.worker.observe.metrics import (
    LATENCY_BUCKETS_S,
    NullRecorder,
    Recorder,
    WorkerSnapshot,
    cumulative_buckets,
)
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(60)







def settled(address: str, check: Callable[[Samples], bool]) -> Samples:
    """Scrape until ``check`` holds (counters and gauges are republished every 0.1 s), at most
    5 s; the samples that passed it."""
    last: list[Samples] = []

    def holds() -> bool:
        last[:] = [scrape(address)]
        return check(last[0])
    wait_until(holds, 5, f"the /metrics page at {address} showed the expected samples",
               interval=0.05)
    return last[0]


# ------------------------------------------------------------------------------ unit tests


def test_histogram_buckets_are_prometheus_le_buckets() -> None:
    rec = Recorder()
    rec.request(8, 0, wait_ns=10_000, exec_ns=30_000)     # exactly 10 us goes in le=1e-05
    rec.request(8, 0, wait_ns=10_001, exec_ns=20 * 10**9)  # over the last bound: +Inf
    rec.fold()
    counts = rec.counters().queue_wait[8]
    buckets = cumulative_buckets(counts[:-1])
    assert buckets[0] == (repr(LATENCY_BUCKETS_S[0]), 1)
    assert buckets[1] == (repr(LATENCY_BUCKETS_S[1]), 2)
    assert buckets[-1] == ("+Inf", 2) and counts[-1] == 20_001
    exec_buckets = dict(cumulative_buckets(rec.counters().execution[8][:-1]))
    assert exec_buckets["5e-05"] == 1 and exec_buckets["10.0"] == 1 and exec_buckets["+Inf"] == 2


def test_counters_are_copies() -> None:
    rec = Recorder()
    rec.request(2, 0, 1, 1)
    rec.client_in([zmq.Frame(b"routing-id"), zmq.Frame(b"abc"), zmq.Frame(b"12345")])
    rec.client_out(b"head", [np.zeros(4, np.float32)])
    rec.transfer("in", False)
    assert rec.counters().requests == {}                   # not published yet
    rec.fold()
    copy = rec.counters()
    rec.request(2, 0, 1, 1)
    rec.fold()
    assert copy.requests == {(2, 0): 1} and rec.counters().requests == {(2, 0): 2}
    assert copy.bytes["client_in"] == 8 and copy.bytes["client_out"] == 4 + 16
    assert copy.transfers == {("in", False): 1}


def snapshot_of(sessions: int) -> WorkerSnapshot:
    return WorkerSnapshot(taken=time.monotonic(), sessions=sessions, queue_depth=0, memory_used=0,
                          memory_limit=1 << 20, device="cpu", device_kind="cpu", graphs=0,
                          buffers=sessions, transfers_in_progress=0, held_replies=0)


def test_a_scrape_sees_counters_and_gauges_from_one_publish() -> None:
    """A scrape that runs across a publish (the exporter's thread is preempted while it builds
    the families) pairs the gauges with the counters they were published with: CI once saw
    ``sessions`` 0 with the GOODBYE that closed the session not yet counted."""
    rec = Recorder()
    rec.request(Cmd.HELLO, 0, 1, 1)
    rec.publish(snapshot_of(sessions=1))
    families = WorkerCollector(rec, {}, default_names, default_outcomes).collect()
    seen = [next(families)]                                  # the scrape has begun ...
    rec.request(Cmd.GOODBYE, 0, 1, 1)                        # ... GOODBYE closes the session
    rec.publish(snapshot_of(sessions=0))
    seen += list(families)
    names = {(s.name, s.labels.get("command")): s.value for m in seen for s in m.samples}
    assert names[("zmq_rpc_sessions", None)] == 1 and names[("zmq_rpc_requests_total", "HELLO")] == 1
    assert ("zmq_rpc_requests_total", "GOODBYE") not in names
    fresh = {(s.name, s.labels.get("command")): s.value
             for m in WorkerCollector(rec, {}, default_names, default_outcomes).collect()
             for s in m.samples}
    assert fresh[("zmq_rpc_sessions", None)] == 0
    assert fresh[("zmq_rpc_requests_total", "GOODBYE")] == 1


def test_fold_alone_keeps_the_last_snapshot() -> None:
    rec = Recorder()
    assert rec.counters().snapshot is None
    snap = snapshot_of(sessions=2)
    rec.publish(snap)
    rec.request(2, 0, 1, 1)
    rec.fold()
    assert rec.counters().snapshot is snap and rec.counters().requests == {(2, 0): 1}


def test_folding_in_batches_counts_as_one_by_one() -> None:
    rng = np.random.default_rng(7)
    rec = Recorder()
    bounds = [round(b * 1e9) for b in LATENCY_BUCKETS_S]
    expected_wait: dict[int, list[int]] = {}
    expected_requests: dict[tuple[int, int], int] = {}
    for _batch in range(3):
        for _ in range(500):
            cmd, code = int(rng.integers(1, 5)), int(rng.choice([0, 0, 3]))
            wait = int(rng.choice([*bounds, *(rng.integers(0, 20 * 10**9, 4))]))
            rec.request(cmd, code, wait, 7)
            hist = expected_wait.setdefault(cmd, [0] * (len(bounds) + 2))
            hist[sum(b < wait for b in bounds)] += 1       # le: a value on a bound is in it
            hist[-1] += wait
            expected_requests[(cmd, code)] = expected_requests.get((cmd, code), 0) + 1
        rec.fold()
    counters = rec.counters()
    assert counters.requests == expected_requests and counters.queue_wait == expected_wait
    assert sum(h[0] for h in counters.execution.values()) == 1500   # 7 ns: first bucket


def test_null_recorder_records_nothing() -> None:
    rec = NullRecorder()
    rec.request(2, 0, 1, 1)
    rec.client_in([zmq.Frame(b"id"), zmq.Frame(b"abc")])
    rec.graph_run(5)
    rec.transfer("out", True)
    rec.fold()
    counters = rec.counters()
    assert not counters.requests and counters.bytes["client_in"] == 0
    assert counters.graph_runs == 0 and not counters.transfers


# --------------------------------------------------------------------------- real workers


def test_metrics_are_off_by_default(worker: WorkerServer) -> None:
    assert worker.metrics_address == "" and worker.metrics is None


def test_requests_bytes_and_gauges(make_worker: Callable[..., WorkerServer],
                                   make_client: Callable[..., Client]) -> None:
    w = make_worker(memory_limit=64 << 20, metrics_port=0)
    assert w.metrics_address.startswith("http://127.0.0.1:")
    c = make_client(w.endpoint)
    buf = c.alloc_buffer(1 << 20)
    x = buf.tensor((256,), "float32")
    y = buf.tensor((256,), "float32", offset=4096)
    for _ in range(3):
        c.set_tensor(x, np.arange(256, dtype=np.float32))
    assert c.get_tensor(x)[5] == 5
    g = Graph()
    g.silu(x, out=y)
    handle = c.register(g)
    for _ in range(4):
        c.run(handle, fetch=[y])
    gone = c.alloc_buffer(64)
    gone.free()
    with pytest.raises(InvalidHandle):
        c.get_tensor(gone.tensor((16,), "float32"))
    samples = settled(w.metrics_address,
                      lambda s: sample(s, "zmq_rpc_graphs_registered") == 1)

    def requests(command: str, outcome: str = "ok") -> float:
        return sample(samples, "zmq_rpc_requests_total", command=command, outcome=outcome)

    assert requests("HELLO") == 1 and requests("SET_TENSOR") == 3
    assert requests("GET_TENSOR") == 1 and requests("GRAPH_RUN") == 4
    assert requests("GRAPH_REGISTER") == 1 and requests("ALLOC_BUFFER") == 2
    assert requests("FREE_BUFFER") == 1
    assert requests("GET_TENSOR", "invalid_handle") == 1
    assert sample(samples, "zmq_rpc_graph_runs_total") == 4
    assert sample(samples, "zmq_rpc_request_execution_seconds_count", command="GRAPH_RUN") == 4
    assert sample(samples, "zmq_rpc_request_queue_seconds_count", command="SET_TENSOR") == 3
    assert sample(samples, "zmq_rpc_request_queue_seconds_bucket", command="SET_TENSOR",
                  le="+Inf") == 3
    assert sample(samples, "zmq_rpc_bytes_received_total", link="client") > 3 * 1024
    assert sample(samples, "zmq_rpc_bytes_sent_total", link="client") > 5 * 1024
    assert sample(samples, "zmq_rpc_sessions") == 1
    assert sample(samples, "zmq_rpc_buffers") == 1
    used = [v for (name, _), v in samples.items() if name == "zmq_rpc_memory_used_bytes"]
    limit = [v for (name, _), v in samples.items() if name == "zmq_rpc_memory_limit_bytes"]
    assert limit == [64 << 20] and used and used[0] >= 1 << 20
    c.close()
    samples = settled(w.metrics_address, lambda s: sample(s, "zmq_rpc_sessions") == 0)
    assert sample(samples, "zmq_rpc_sessions") == 0 and sample(samples, "zmq_rpc_buffers") == 0
    assert sample(samples, "zmq_rpc_requests_total", command="GOODBYE", outcome="ok") == 1


def test_bad_requests_are_counted(make_worker: Callable[..., WorkerServer],
                                  make_client: Callable[..., Client]) -> None:
    w = make_worker(memory_limit=64 << 20, metrics_port=0)
    c = make_client(w.endpoint)
    with pytest.raises(OutOfMemory):
        c.alloc_buffer(1 << 30)
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as raw:
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(w.endpoint)
        raw.send(b"\xc1 not msgpack")
        assert raw.poll(10_000) and raw.recv()
    expected = {"ALLOC_BUFFER/out_of_memory": 1, "INVALID/bad_request": 1}

    def failed(samples: Samples) -> dict[str, float]:
        return {dict(labels)["command"] + "/" + dict(labels)["outcome"]: v
                for (name, labels), v in samples.items()
                if name == "zmq_rpc_requests_total" and dict(labels)["outcome"] != "ok"}
    assert failed(settled(w.metrics_address, lambda s: failed(s) == expected)) == expected


def test_peer_transfers_and_peer_bytes(make_worker: Callable[..., WorkerServer],
                                       make_client: Callable[..., Client]) -> None:
    a = make_worker(memory_limit=64 << 20, metrics_port=0)
    b = make_worker(memory_limit=64 << 20, metrics_port=0)
    ca, cb = make_client(a.endpoint), make_client(b.endpoint)
    src = ca.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
    dst = cb.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
    ca.set_tensor(src, np.ones(1 << 18, np.float32))
    for _ in range(2):
        ca.copy_tensor(src, dst)
    assert cb.get_tensor(dst).sum() == 1 << 18
    sa = settled(a.metrics_address, lambda s: sample(
        s, "zmq_rpc_requests_total", command="PEER_SEND", outcome="ok") == 2)
    sb = settled(b.metrics_address, lambda s: sample(
        s, "zmq_rpc_requests_total", command="PEER_RECV", outcome="ok") == 2)
    assert sample(sa, "zmq_rpc_peer_transfers_total", direction="out", outcome="ok") == 2
    assert sample(sb, "zmq_rpc_peer_transfers_total", direction="in", outcome="ok") == 2
    assert sample(sa, "zmq_rpc_bytes_sent_total", link="peer") >= 2 << 20
    assert sample(sb, "zmq_rpc_bytes_received_total", link="peer") >= 2 << 20
    assert sample(sb, "zmq_rpc_bytes_sent_total", link="peer") > 0      # the acknowledgements
    assert sample(sa, "zmq_rpc_requests_total", command="PEER_SEND", outcome="ok") == 2
    assert sample(sb, "zmq_rpc_requests_total", command="PEER_RECV", outcome="ok") == 2


def test_cli_serves_metrics_and_logs_session_events_as_json(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker("--metrics-port", "0", "--log-level", "INFO", "--log-format", "json")
    assert proc.proc.stdout is not None and proc.proc.stderr is not None
    line = proc.proc.stdout.readline()
    assert "metrics on http://127.0.0.1:" in line, line
    address = line.split(" on ", 1)[1].strip().removesuffix("/metrics")
    with Client(proc.endpoint, name="metrics-test") as c:
        c.alloc_buffer(4096)
        c.synchronize()
        samples = settled(address, lambda s: sample(
            s, "zmq_rpc_requests_total", command="ALLOC_BUFFER", outcome="ok") == 1)
        assert sample(samples, "zmq_rpc_sessions") == 1
        assert sample(samples, "zmq_rpc_requests_total", command="ALLOC_BUFFER",
                      outcome="ok") == 1
        assert any(name == "zmq_rpc_process_resident_memory_bytes" for name, _ in samples)
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(15) == 0
    records = [json.loads(row) for row in proc.proc.stderr.read().splitlines() if row.strip()]
    events = [r for r in records if "event" in r]
    assert [r["event"] for r in events] == ["session_opened", "session_closed"], records
    opened, closed = events
    assert opened["client"] == closed["client"] == "metrics-test"
    assert opened["session"] == closed["session"] == "s1"
    assert len(opened["client_id"]) == 8 and closed["reason"] == "said goodbye"
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    with pytest.raises(urllib.error.URLError):
        scrape(address)                 # the endpoint went with the worker
