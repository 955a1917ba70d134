"""Benchmark case ``curve``: what CurveZMQ costs, in ``zmq-rpc-bench``'s registry.

Runs in the benchmark's main thread like every case. It starts, for the run, a CURVE worker
(``zmq-rpc-worker --curve-secret-key ... --authorized-keys ...``) and raw pyzmq CURVE servers (the
``echo`` and ``bulk-zmq`` baselines with ``--curve-secret-key``), with throwaway keys in a
temporary directory, and times in alternation, in the same run:

- ours over CURVE, ours plain (the run's first worker), raw pyzmq over CURVE, raw pyzmq plain;
- for the tiny round trip (ping vs echo) and for uploads/downloads of 16 MiB and 256 MiB (ours in
  the client's chunks, raw CURVE in 4 MiB chunks, both landing in one preallocated array).

Rows: ``curve rtt`` / ``curve set|get SIZE`` against raw CURVE (target >= 0.9x raw CURVE for
throughput), the same against ours plain (what encryption costs us), and raw CURVE against raw
plain (what it costs libzmq itself: the ceiling).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from ..broker.keys import KeyPair, generate_keypair, load_keypair
from ..client import Client
from ..worker.launch import ServerProcess, worker_argv
from . import baselines as bl
from .bench import (
    BULK_CHUNK,
    BenchContext,
    CaseResult,
    Runner,
    Target,
    elapsed,
    interleave,
    register_case,
)
from .units import format_size

CURVE_SIZES = (16 << 20, 256 << 20)


class CurveSetup:
    """Keys, a CURVE worker and its client, raw CURVE servers and their sockets (all closed
    with the run)."""

    def __init__(self, ctx: BenchContext) -> None:
        folder = Path(tempfile.mkdtemp(prefix="zmq-rpc-bench-keys-"))
        ctx.resources.callback(_remove_tree, folder)
        secrets = {name: generate_keypair(folder / name, name)[1] for name in ("w", "c")}
        self.worker_key = load_keypair(secrets["w"])
        self.client_key: KeyPair = load_keypair(secrets["c"])
        worker = ServerProcess([*worker_argv(), "--curve-secret-key", str(secrets["w"]),
                                   "--authorized-keys", str(folder / "c")])
        ctx.resources.callback(worker.stop)
        endpoint = worker.wait_ready()
        self.client = Client(endpoint, curve_key=self.client_key,
                             server_key=self.worker_key.public)
        ctx.resources.callback(self.client.close)
        self.servers: dict[str, str] = {}
        for kind in ("echo", "bulk-zmq"):
            server = ServerProcess(bl.baseline_argv(kind, "tcp://127.0.0.1:*",
                                                       "--curve-secret-key", str(secrets["w"])))
            ctx.resources.callback(server.stop)
            self.servers[kind] = server.wait_ready()
        self.curve = (self.client_key, self.worker_key.public)

    def dealer(self, ctx: BenchContext, kind: str) -> Any:
        sock = bl.dealer(ctx.zmq_ctx, self.servers[kind], self.curve)
        ctx.resources.callback(sock.close, 0)
        return sock


def _remove_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    folder.rmdir()


@register_case("curve", "CurveZMQ vs plain, ours and raw pyzmq: tiny round trip, 16/256 MiB")
def case_curve(ctx: BenchContext) -> list[CaseResult]:
    """Round trip in µs and throughput in GB/s, ours and raw, over CURVE and plain."""
    setup = CurveSetup(ctx)
    return _rtt_rows(ctx, setup) + _bulk_rows(ctx, setup, "set") + _bulk_rows(ctx, setup, "get")


def _rtt_rows(ctx: BenchContext, setup: CurveSetup) -> list[CaseResult]:
    curve_echo, plain_echo = setup.dealer(ctx, "echo"), ctx.baseline_socket("echo")
    tiny = b"\x92\x02\xcd\x30\x39"
    runners = {
        "ours-curve": lambda: elapsed(setup.client.ping) * 1e6,
        "zmq-curve": lambda: elapsed(lambda: bl.echo_once(curve_echo, tiny)) * 1e6,
        "ours-plain": lambda: elapsed(ctx.client.ping) * 1e6,
        "zmq-plain": lambda: elapsed(lambda: bl.echo_once(plain_echo, tiny)) * 1e6}
    reps = ctx.reps(1000, 200)
    with ctx.progress(reps, "curve rtt") as bar:
        s = interleave(runners, reps, bar, warmup=100)
    return _rows("curve rtt", "µs", s, Target(1.5, higher_is_better=False), False)


def _rows(label: str, unit: str, s: dict[str, list[float]], target: Target | None,
          higher: bool, note: str = "") -> list[CaseResult]:
    return [
        CaseResult("curve", label, unit, s["ours-curve"], {"zmq-curve": s["zmq-curve"]}, target,
                   higher_is_better=higher, note=note),
        CaseResult("curve", f"{label} vs plain", unit, s["ours-curve"],
                   {"ours-plain": s["ours-plain"]}, None, higher_is_better=higher, note=note),
        CaseResult("curve", f"{label} raw zmq: curve vs plain", unit, s["zmq-curve"],
                   {"zmq-plain": s["zmq-plain"]}, None, higher_is_better=higher, note=note),
    ]


def _bulk_rows(ctx: BenchContext, setup: CurveSetup, op: str) -> list[CaseResult]:
    curve_bulk = bl.ZmqBulk(ctx.zmq_ctx, setup.servers["bulk-zmq"], setup.curve)
    ctx.resources.callback(curve_bulk.close)
    plain_bulk = bl.ZmqBulk(ctx.zmq_ctx, ctx.baselines.endpoint("bulk-zmq"))
    ctx.resources.callback(plain_bulk.close)
    rows: list[CaseResult] = []
    for size in CURVE_SIZES:
        reps = ctx.reps(5, 2) if size > 16 << 20 else ctx.reps(7, 3)
        with ExitStack() as cleanup, ctx.progress(reps, f"curve {op} {format_size(size)}") as bar:
            runners = {
                "ours-curve": _ours(setup.client, op, size, cleanup),
                "zmq-curve": _raw(curve_bulk, op, size),
                "ours-plain": _ours(ctx.client, op, size, cleanup),
                "zmq-plain": _raw(plain_bulk, op, size)}
            s = interleave(runners, reps, bar)
        rows += _rows(f"curve {op} {format_size(size)}", "GB/s", s,
                      Target(0.9, higher_is_better=True), True)
    return rows


def _ours(client: Client, op: str, size: int, cleanup: ExitStack) -> Runner:
    buffer = client.alloc_buffer(size)
    cleanup.callback(buffer.free)
    tensor = buffer.tensor(size, "uint8")
    source = np.ones(size, dtype=np.uint8)
    client.set_tensor(tensor, source)
    call: Callable[[], Any] = ((lambda: client.set_tensor(tensor, source)) if op == "set"
                               else (lambda: client.get_tensor(tensor)))
    return lambda: size / elapsed(call) / 1e9


def _raw(bulk: bl.ZmqBulk, op: str, size: int) -> Runner:
    source = np.ones(size, dtype=np.uint8)
    call: Callable[[], Any] = ((lambda: bulk.set(source, BULK_CHUNK)) if op == "set"
                               else (lambda: bulk.get(size, BULK_CHUNK)))
    return lambda: size / elapsed(call) / 1e9
