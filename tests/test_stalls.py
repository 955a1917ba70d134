"""One request must not stall every client (issue 24, point 5): the attacker's path against a real
worker process, with a well-behaved client pinging beside it (default client settings).

The bounds are the product's, stated in docs/SECURITY.md ("What one request may cost"): a file's
hash runs off the backend thread, so a ping waits for no hash; an oversize request is refused
from its length prefixes, before its items are built or checked; a graph's nodes count toward
``--max-graph-work`` before any of them is checked.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.errors import BadRequest
from zmq_rpc.broker.files import MAX_READS
from zmq_rpc.broker.graph import GRAPH_VERSION, MAX_NODES
from zmq_rpc.broker.ops import NODE_WORK
from zmq_rpc.broker.protocol import Cmd, ErrorCode
from zmq_rpc.client import Client
from zmq_rpc.client.files import query_file
from zmq_rpc.worker.formats.hashing import file_digest

pytestmark = pytest.mark.timeout(120)

PING_BOUND_S = 0.25
"""What another client's request may add to a ping's worst latency. A ping is a few hundred
microseconds of service; this 2-vCPU VM is shared (load 6-11), and its own worst over 12 s
quiet windows is ~0.2 s. So the bound is over the ping's normal service: for the hash, the worst
ping of a second worker with nothing to hash, pinged over the same seconds (the machine's load
then, whatever it is: compared with a quiet window after the hash, a load spike during a 10.8 s
hash gave 0.74 s against 0.02 s, CI loop run 1 of db52418 beside other jobs); for the others,
the worst of BASELINE_S before a request. A ping sent before the request counts only what it
waited after it was sent."""
REFUSAL_CPU_S = 0.1
"""CPU time (the worker process's, all threads) an oversize request may cost: it is refused from
its length prefixes and counts, not decoded. CPU, not wall time: this VM's 2 vCPUs are shared
with other jobs (load 10 is common), which stretches wall time but not the work done."""
LIMIT_GRAPH_CPU_S = 0.25
"""CPU time decoding and refusing a graph of MAX_NODES nodes may cost (~8 us a node, ~0.07 s
measured when quiet): what a graph within the decode limits costs before the work bound
applies."""
HASH_FILE = 1 << 30
"""Half the issue's file (whose hash took 4.6 s of every client's time on the backend thread):
2-7 s before the fix, 5-20 s on its own thread on the loaded VM."""
BASELINE_S = 2.0
"""The window before an attack whose worst ping is the normal service it is compared with."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pinger:
    """A good client pinging in a loop on its own thread; each ping's (start, latency)."""

    def __init__(self, endpoint: str) -> None:
        self.client = Client(endpoint)
        self.pings: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pinger")

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.client.ping()
            self.pings.append((started, time.monotonic() - started))

    def worst_between(self, start: float, end: float) -> tuple[float, int]:
        """The longest a ping waited within [start, ...) for pings out while [start, end] was
        (a ping sent before ``start`` counts from ``start``: what it waited before is the
        machine's, not the request's at ``start``), and how many pings were out."""
        waits = [at + lat - max(at, start) for at, lat in self.pings
                 if at <= end and at + lat >= start]
        return max(waits, default=0.0), len(waits)

    def normal(self, seconds: float) -> float:
        """The worst wait of the last ``seconds`` of pings: this machine's normal service."""
        now = time.monotonic()
        self.wait_pings(len(self.pings) + 3)
        time.sleep(seconds)                   # a measurement window, not a synchronization
        return self.worst_between(now, time.monotonic())[0]

    def wait_pings(self, n: int, timeout: float = 10) -> None:
        wait_until(lambda: len(self.pings) >= n, timeout, f"the good client's ping #{n} answered")

    @contextmanager
    def running(self) -> Iterator[Pinger]:
        self._thread.start()
        try:
            self.wait_pings(5)
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self.client.close()


def write_big_safetensors(path: Path, size: int) -> None:
    """A valid safetensors file of ``size`` bytes, sparse: one U8 tensor over all its data."""
    header = b""
    for _ in range(2):                 # the header's length is part of the data's size
        n = size - 8 - len(header)
        header = (b'{"w":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]}}' % (n, n))
    with open(path, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.write(b"\1" * 4096)            # some data that is not a hole
        fh.truncate(size)


def test_hashing_a_big_model_file_does_not_hold_other_clients(
        spawn_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    big = models / "big.safetensors"
    write_big_safetensors(big, HASH_FILE)
    worker = spawn_worker("--model-dir", str(models))
    control = spawn_worker()
    with Client(worker.endpoint) as asker, Pinger(worker.endpoint).running() as pinger, \
            Pinger(control.endpoint).running() as baseline:
        started = time.monotonic()
        reply = query_file(asker, big.name).result(90)
        hashed = time.monotonic()
        repeat = query_file(asker, big.name).result(60)
        repeated = time.monotonic() - hashed
    worst, overlapping = pinger.worst_between(started, hashed)
    normal, _ = baseline.worst_between(started, hashed)
    assert reply.found and reply.size == HASH_FILE, reply     # its digest: the next test
    assert overlapping >= 3, f"only {overlapping} pings while the {hashed - started:.2f} s hash ran"
    assert worst < normal + PING_BOUND_S, (
        f"a ping waited {worst:.3f} s while another client's file was hashed "
        f"({hashed - started:.2f} s); {normal:.3f} s at worst on a worker without it, meanwhile")
    assert repeat.digest == reply.digest and repeated < PING_BOUND_S, \
        f"asking again took {repeated:.3f} s: the digest is not cached"


def test_a_changed_model_file_is_hashed_again(
        spawn_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    path = models / "m.safetensors"
    write_big_safetensors(path, 1 << 20)
    worker = spawn_worker("--model-dir", str(models))
    with Client(worker.endpoint) as client:
        before = query_file(client, path.name).result(30)
        with open(path, "r+b") as fh:             # same size, one byte changed
            fh.seek((1 << 20) - 1)
            fh.write(b"\2")
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 10**9))
        after = query_file(client, path.name).result(30)
    assert before.found and after.found
    assert before.digest != after.digest
    assert after.digest == _digest_of(path)


def _digest_of(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_digest(fd, path.stat().st_size)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ oversize requests


class Attacker:
    """A raw DEALER with a session, sending headers no client of ours would."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16).replace(b"\0", b"\1"))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        major, minor = p.PROTOCOL_VERSION
        hello = p.Hello(major=major, minor=minor, client="attacker")
        assert self.call(p.encode_request(Cmd.HELLO, 1, hello))[0] == 0
        alloc = p.AllocBuffer(handle=1, size=16)        # what its graphs and reads name
        assert self.call(p.encode_request(Cmd.ALLOC_BUFFER, 2, alloc))[0] == 0

    def call(self, header: bytes) -> list[Any]:
        self.sock.send(header)
        assert self.sock.poll(30_000), "the worker did not answer"
        reply: list[Any] = msgpack.unpackb(self.sock.recv_multipart()[0], raw=False)
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _graph_header(n_nodes: int) -> bytes:
    tensor = [1, int(p.DType.FLOAT32), [4], [4], 0]
    nodes = [["neg", [i - 1 if i else -1], {}, -1] for i in range(n_nodes)]
    return msgpack.packb([int(Cmd.GRAPH_COMPUTE), 7, [GRAPH_VERSION, [tensor], nodes], [], []])


def _read_file_header(n_reads: int) -> bytes:
    read = ["", "", [], 0, 4, [1, int(p.DType.FLOAT32), [1], [4], 0]]
    return msgpack.packb([int(Cmd.READ_FILE), 7, "m.gguf", b"d" * 32, [read] * n_reads])


def _containers_header() -> bytes:
    """A header of MAX_HEADER_BYTES made of empty lists: a million Python objects to build."""
    rows = (p.MAX_HEADER_BYTES - 64) // (p.MAX_HEADER_ARRAY + 3)
    return msgpack.packb([int(Cmd.PING), 7, [[[]] * p.MAX_HEADER_ARRAY] * rows])


OVERSIZE = {
    "graph-65536-nodes": (lambda: _graph_header(1 << 16), "over 16384 items"),
    "read-file-65536-reads": (lambda: _read_file_header(1 << 16), "over 16384 items"),
    "a-million-empty-lists": (_containers_header, "arrays and maps"),
}


@pytest.mark.parametrize("name", OVERSIZE)
def test_an_oversize_request_is_refused_at_decode_without_holding_others(
        spawn_worker: Callable[..., WorkerProcess], name: str) -> None:
    make, why = OVERSIZE[name]
    header = make()
    assert len(header) <= p.MAX_HEADER_BYTES          # the broker lets it through to decoding
    worker = spawn_worker()
    attacker = Attacker(worker.endpoint)
    try:
        with Pinger(worker.endpoint).running() as pinger:
            reply, cpu, worst = _attack(worker, attacker, header, pinger)
    finally:
        attacker.close()
    assert cpu < REFUSAL_CPU_S, f"{name} took {cpu:.3f} s of the worker's CPU: {reply[:3]}"
    assert worst < PING_BOUND_S, f"a ping waited {worst:.3f} s more than normal behind {name}"
    assert reply[0] in (ErrorCode.BAD_REQUEST, ErrorCode.GRAPH_INVALID), reply
    assert reply[1] == 7, reply          # refused whole, still answered to its request id
    assert any(w in reply[2] for w in why.split("|")), reply


def _attack(worker: WorkerProcess, attacker: Attacker, header: bytes,
            pinger: Pinger) -> tuple[list[Any], float, float]:
    """Send ``header``; its reply, the worker's CPU seconds until then, and the worst ping
    that was out meanwhile over the worst of the BASELINE_S before (the pinger's own requests
    are in the CPU figure: ~0.2 ms each)."""
    normal = pinger.normal(BASELINE_S)
    cpu = cpu_seconds(worker.proc.pid)
    started = time.monotonic()
    reply = attacker.call(header)
    refused = time.monotonic()
    cpu = cpu_seconds(worker.proc.pid) - cpu
    pinger.wait_pings(len(pinger.pings) + 3)
    worst, _ = pinger.worst_between(started, refused)
    return reply, cpu, worst - normal


def test_graph_nodes_count_toward_the_work_limit_before_they_are_checked(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """Tiny nodes are not free: with ``--max-graph-work`` set for ~0.1 s of numpy, a chain of
    MAX_NODES tiny nodes (no elements to speak of) is refused before any node is checked."""
    limit = 100_000_000
    assert MAX_NODES * NODE_WORK > limit
    worker = spawn_worker("--max-graph-work", str(limit))
    attacker = Attacker(worker.endpoint)
    try:
        with Pinger(worker.endpoint).running() as pinger:
            reply, cpu, _ = _attack(worker, attacker, _graph_header(MAX_NODES), pinger)
    finally:
        attacker.close()
    assert reply[0] == ErrorCode.GRAPH_INVALID and "--max-graph-work" in reply[2], reply
    assert cpu < LIMIT_GRAPH_CPU_S, f"refusing it took {cpu:.3f} s of the worker's CPU"


LARGEST_GRAPH_CPU_S = 1.0
"""CPU time a graph at the node limit may cost in all (decode, check, plan, run), its nodes tiny:
the fixed cost stated in docs/SECURITY.md (0.27-0.44 s measured on the loaded VM)."""


def test_the_largest_graph_of_tiny_nodes_runs_within_its_stated_cost(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    worker = spawn_worker()
    attacker = Attacker(worker.endpoint)
    try:
        with Pinger(worker.endpoint).running() as pinger:
            reply, cpu, _ = _attack(worker, attacker, _graph_header(MAX_NODES), pinger)
    finally:
        attacker.close()
    assert reply[0] == 0, reply                   # within the limits: it runs
    assert cpu < LARGEST_GRAPH_CPU_S, f"a {MAX_NODES}-node graph took {cpu:.3f} s of CPU"


def test_the_largest_reads_list_still_decodes() -> None:
    """What the limits must not refuse: MAX_READS reads and a MAX_NODES graph decode."""
    header = _read_file_header(MAX_READS)
    assert p.decode_request([header])[0] is Cmd.READ_FILE
    assert p.decode_request([_graph_header(MAX_NODES)])[0] is Cmd.GRAPH_COMPUTE


@pytest.mark.parametrize("name", OVERSIZE)
def test_an_oversize_header_is_refused_with_its_request_id(name: str) -> None:
    make, why = OVERSIZE[name]
    with pytest.raises(BadRequest) as info:
        p.decode_request([make()])
    assert info.value.req_id == 7  # type: ignore[attr-defined]
    assert any(w in info.value.message for w in why.split("|"))
