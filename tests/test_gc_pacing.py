"""The worker's garbage collector (worker/process/gc_pacing.py, issue 24.8): start-up objects frozen, full
collections run by the backend between requests, never inside one, and still run under traffic
that never lets the backend idle, so memory stays bounded.

Each test takes a real ``zmq-rpc-worker`` process and reads its ``/metrics``: prometheus_client's
``python_gc_collections_total{generation="2"}`` counts every full collection the process ran, the
worker's ``zmq_rpc_gc_full_collections_total{backend}`` those the backend ran between requests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgpack
import pytest
import zmq
from conftest import Samples, WorkerProcess, sample, scrape
from zmq_rpc.broker import protocol as p
from zmq_rpc.tools.fuzz import rss_of

pytestmark = pytest.mark.timeout(120)


FLOOD_ROUNDS = 150
"""Rounds of :data:`WINDOW` requests the flood sends (~4,800 requests: 1-2 s quiet)."""
WINDOW = 32
NODES = 1000
"""Lists in each flooding request's header: each decode makes ~1,000 objects (then refused)."""






def full_collections(samples: Samples) -> float:
    """Every full collection the worker process ran (CPython's own or the backend's)."""
    return sample(samples, "python_gc_collections_total", generation="2")


def paced_collections(samples: Samples, backend: str) -> float:
    return sample(samples, "zmq_rpc_gc_full_collections_total", backend=backend)


def start(spawn_worker: Callable[..., WorkerProcess]) -> tuple[WorkerProcess, str]:
    worker = spawn_worker("--metrics-port", "0", "--metrics-host", "127.0.0.1", "--mem", "64MiB")
    assert worker.proc.stdout is not None
    line = worker.proc.stdout.readline()
    assert "metrics on" in line, line
    return worker, line.split(" on ", 1)[1].strip().removesuffix("/metrics")


@dataclass
class Flood:
    before: Samples
    after: Samples
    rss_before: int
    rss_peak: int
    replies: int


def flood(endpoint: str, pid: int) -> Flood:
    """A raw session pipelines requests that each decode ~1,000 objects before they are refused,
    WINDOW at a time with no pause: the backend never idles for a poll interval."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.ROUTING_ID, b"g" + os.urandom(15))     # a session needs 16 bytes
    try:
        sock.connect(endpoint)
        major, minor = p.PROTOCOL_VERSION
        sock.send(p.encode_request(p.Cmd.HELLO, 0, p.Hello(major=major, minor=minor, client="f")))
        assert p.unpack_header(sock.recv_multipart()[0])[0] == p.STATUS_OK
        heavy = msgpack.packb([int(p.Cmd.GRAPH_COMPUTE), 1, [[1, 2, 3]] * NODES])
        rss_before = rss_peak = rss_of(pid)
        replies = 0
        for _ in range(FLOOD_ROUNDS):
            for _ in range(WINDOW):
                sock.send(heavy)
            for _ in range(WINDOW):
                status = p.unpack_header(sock.recv_multipart()[0])[0]
                assert status == p.ErrorCode.BAD_REQUEST, status
                replies += 1
            rss_peak = max(rss_peak, rss_of(pid))
        # GOODBYE, as a well-behaved client leaves: a session left open would hold the worker's
        # SIGTERM drain (--drain-timeout) until it expires
        sock.send(p.encode_request(p.Cmd.GOODBYE, 2, p.Empty()))
        assert p.unpack_header(sock.recv_multipart()[0])[0] == p.STATUS_OK
        return Flood({}, {}, rss_before, rss_peak, replies)
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture(scope="module")
def flooded(spawn_worker_module: Callable[..., WorkerProcess]) -> Iterator[Flood]:
    worker, metrics = start(spawn_worker_module)
    before = scrape(metrics)
    result = flood(worker.endpoint, worker.proc.pid)
    result.before, result.after = before, scrape(metrics)
    yield result


@pytest.fixture(scope="module")
def spawn_worker_module() -> Iterator[Callable[..., WorkerProcess]]:
    procs: list[WorkerProcess] = []

    def spawn(*args: str) -> WorkerProcess:
        procs.append(WorkerProcess(*args))
        return procs[-1]

    yield spawn
    for proc in procs:
        proc.terminate()


def test_no_full_collection_runs_inside_a_request_under_a_flood(flooded: Flood) -> None:
    """Every full collection during the flood was one the backend ran between two requests, and
    the flood (never idle) still got them: the promotions' bound, not idleness, started them."""
    ran = full_collections(flooded.after) - full_collections(flooded.before)
    between = sum(paced_collections(flooded.after, b) - paced_collections(flooded.before, b)
                  for b in ("idle", "busy"))
    busy = (paced_collections(flooded.after, "busy")
            - paced_collections(flooded.before, "busy"))
    assert ran == between, f"{ran - between:.0f} of {ran:.0f} full collections ran inside requests"
    assert busy >= 1, f"no full collection in {flooded.replies} requests without a pause"


def test_memory_stays_bounded_under_a_flood_that_never_idles(flooded: Flood) -> None:
    """~4,800 allocation-heavy requests (refused after decoding) with no pause: the worker's RSS
    grows by less than 32 MiB (measured: < 3 MiB)."""
    assert flooded.replies == FLOOD_ROUNDS * WINDOW
    grew = (flooded.rss_peak - flooded.rss_before) >> 20
    assert grew < 32, f"RSS grew {grew} MiB under the flood"


def test_start_up_objects_are_frozen_and_not_walked_again(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """What the worker made at start-up (imports, numba, the backend: ~31,000 objects) is frozen;
    a full collection after some traffic walks an old generation of what was made since, a few
    thousand objects, not the start-up's."""
    worker, metrics = start(spawn_worker)
    samples = scrape(metrics)
    frozen = sample(samples, "zmq_rpc_gc_frozen_objects")
    assert frozen >= 10_000, f"{frozen:.0f} objects frozen after start-up"
    flood(worker.endpoint, worker.proc.pid)
    samples = scrape(metrics)
    assert paced_collections(samples, "idle") + paced_collections(samples, "busy") >= 1
    old = sample(samples, "zmq_rpc_gc_old_objects")
    assert 0 < old < frozen / 3, f"{old:.0f} objects in the old generation, {frozen:.0f} frozen"
