"""``zmq-rpc-bench load``: N clients x M requests against one worker, every reply accounted for.

Runs in the main thread of the benchmark process, against a worker subprocess (or ``--workers``).
Each client is a raw DEALER with its own session (so that a reply is seen exactly as the worker
sent it: duplicates and strays are visible, which the client engine would silently drop) keeping
``window`` requests in flight: a mix of PING, SET_TENSOR (4 KiB), GET_TENSOR (reads back what the
same client wrote) and DEVICE_MEMORY. Every request must get exactly one OK reply, with the right
bytes for a GET, within ``timeout``; the report gives the count, the rate and the latency
percentiles, and lists anything lost, duplicated, late, failed or wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zmq

from ..broker import protocol as p
from ..broker.protocol import Cmd, DType

SLOT = 4096


@dataclass
class LoadReport:
    """What a load run saw."""

    clients: int = 0
    requests: int = 0
    replies: int = 0
    seconds: float = 0.0
    rate: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    lost: int = 0
    duplicated: int = 0
    late: int = 0
    failed: list[str] = field(default_factory=list)
    wrong: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.late or self.failed or self.wrong)


class LoadClient:
    """One raw session: its socket, the requests it has in flight and their send times."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, index: int) -> None:
        self.index = index
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"L" + os.urandom(15))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        major, minor = p.PROTOCOL_VERSION
        self._call(Cmd.HELLO, p.Hello(major=major, minor=minor, client=f"load{index}"))
        self._call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=SLOT * 16))
        self.sent: dict[int, tuple[float, Cmd, int]] = {}
        self.written: dict[int, int] = {}
        self.next_id = 10
        self.done = 0

    def _call(self, cmd: Cmd, msg: p.Message) -> None:
        self.sock.send(p.encode_request(cmd, 1, msg))
        if not self.sock.poll(10_000):
            raise RuntimeError(f"{cmd.name} got no reply")
        header = p.unpack_header(self.sock.recv_multipart()[0])
        if header[0] != p.STATUS_OK:
            raise RuntimeError(f"{cmd.name} failed: {header}")

    def send_one(self, rng: np.random.Generator) -> None:
        req_id = self.next_id
        self.next_id += 1
        kind = int(rng.integers(4))
        slot = req_id % 16
        ref = p.TensorRef(buffer=1, dtype=DType.UINT8, shape=(SLOT,), strides=(1,),
                          offset=slot * SLOT)
        if kind == 1 or (kind == 2 and slot not in self.written):
            value = req_id % 251
            self.sock.send_multipart([p.encode_request(Cmd.SET_TENSOR, req_id,
                                                       p.SetTensor(tensor=ref)),
                                      bytes([value]) * SLOT])
            self.written[slot] = value
            cmd = Cmd.SET_TENSOR
        elif kind == 2:
            self.sock.send(p.encode_request(Cmd.GET_TENSOR, req_id, p.GetTensor(tensor=ref)))
            cmd = Cmd.GET_TENSOR
        else:
            cmd = Cmd.PING if kind == 0 else Cmd.DEVICE_MEMORY
            self.sock.send(p.encode_request(cmd, req_id, p.Empty()))
        expect = self.written.get(slot, -1) if cmd is Cmd.GET_TENSOR else -1
        self.sent[req_id] = (time.perf_counter(), cmd, expect)


def run_load(endpoint: str, clients: int = 8, requests: int = 2000, window: int = 64,
             timeout: float = 60.0, seed: int = 0) -> LoadReport:
    """``clients`` sessions, ``requests`` each, ``window`` in flight per client."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    rng = np.random.default_rng(seed)
    pool = [LoadClient(ctx, endpoint, i) for i in range(clients)]
    report = LoadReport(clients=clients, requests=clients * requests)
    latencies: list[float] = []
    poller = zmq.Poller()
    for c in pool:
        poller.register(c.sock, zmq.POLLIN)
    by_sock = {c.sock: c for c in pool}
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < timeout:
            for c in pool:
                while len(c.sent) < window and c.next_id - 10 < requests:
                    c.send_one(rng)
            if all(c.done == requests for c in pool):
                break
            for sock, _ in poller.poll(100):
                _drain(by_sock[sock], report, latencies, timeout)
    finally:
        report.seconds = time.perf_counter() - start
        for c in pool:
            report.lost += requests - c.done
            c.sock.close(linger=0)
        ctx.term()
    report.rate = report.replies / report.seconds
    if latencies:
        report.p50_ms, report.p99_ms = (float(np.percentile(latencies, q)) for q in (50, 99))
        report.max_ms = max(latencies)
    return report


def _drain(c: LoadClient, report: LoadReport, latencies: list[float], timeout: float) -> None:
    while True:
        try:
            frames = c.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        header = p.unpack_header(frames[0])
        req_id = header[1]
        if req_id not in c.sent:           # answered already, or never asked
            report.duplicated += 1
            continue
        sent_at, cmd, expect = c.sent.pop(req_id)
        c.done += 1
        report.replies += 1
        latency = (time.perf_counter() - sent_at) * 1000
        latencies.append(latency)
        if latency > timeout * 1000:
            report.late += 1
        if header[0] != p.STATUS_OK:
            report.failed.append(f"{cmd.name}: {header[2:]}"[:200])
        elif cmd is Cmd.GET_TENSOR and (len(frames) != 2 or expect < 0 or
                                        frames[1] != bytes([expect]) * SLOT):
            report.wrong += 1


def main(argv: list[str] | None = None) -> int:
    """``zmq-rpc-bench load``: start a worker (unless --worker), run, print the report."""
    ap = argparse.ArgumentParser(prog="zmq-rpc-bench load", description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default="", help="endpoint of a running worker")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5000, help="per client")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    from ..worker.launch import ServerProcess, worker_argv
    server = None if args.worker else ServerProcess(worker_argv())
    try:
        endpoint = args.worker or server.wait_ready()      # type: ignore[union-attr]
        report = run_load(endpoint, args.clients, args.requests, args.window)
    finally:
        if server is not None:
            server.stop()
    data: dict[str, Any] = {**asdict(report), "ok": report.ok}
    print(json.dumps(data, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0 if report.ok else 1
