"""Benchmark cases for worker-to-worker copies and pipeline parallelism, in ``zmq-rpc-bench``'s registry.

- ``peer_copy``: ``copy_tensor`` A -> B (A pushes straight to B) vs a relay through the client
  (``get_tensor`` on A, then ``set_tensor`` on B), at 64 KiB, 1 MiB, 16 MiB and 256 MiB.
- ``peer_chain``: 200 rounds of (compute on A, 64 KiB hop to B, compute on B, hop back), all issued
  without waiting vs the same with a client round trip per step.
- ``pipeline``: a 12-layer matmul model (256x1024 @ 1024x1024 per layer and micro-batch) as a
  :class:`~zmq_rpc.client.pipeline.Pipeline` over 2 and 3 workers with 8 micro-batches, vs the whole
  model on 1 worker and vs the same workers without micro-batching (one 2048-row batch).

Importing this module registers the cases (``bench.CASE_MODULES`` lists it);
``python -m zmq_rpc.tools.bench_peer [options]`` runs ``zmq-rpc-bench`` with them registered. Runs in
the benchmark's main thread like every case; a case needing more workers than ``--workers`` gave
starts them (``zmq-rpc-worker --threads 1``) and stops them when the run ends.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

import numpy as np

from ..client import Client, Graph, RemoteTensor
from ..client.pipeline import Pipeline
from .bench import (
    BYTES_PER_SAMPLE,
    BenchContext,
    CaseResult,
    Runner,
    Target,
    interleave,
    register_case,
)
from .units import format_size

MiB = 1 << 20
PEER_SIZES = (64 << 10, 1 * MiB, 16 * MiB, 256 * MiB)
CHAIN_ROUNDS = 200
CHAIN_FLOATS = 16 * 1024                        # 64 KiB hops
LAYERS, WIDTH, ROWS, MICRO_BATCHES = 12, 1024, 256, 8


def floats(client: Client, count: int, fill: float = 0.0) -> RemoteTensor:
    """A new float32 vector on ``client``'s worker, set to ``fill``."""
    t = client.alloc_buffer(count * 4).tensor(count, "float32")
    client.set_tensor(t, np.full(count, fill, np.float32))
    return t


def free_all(tensors: Sequence[RemoteTensor]) -> None:
    for future in [t.buffer.free_async() for t in tensors]:
        future.exception()


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------- peer_copy


@register_case("peer_copy", "copy A->B worker to worker vs relayed through the client (get+set), "
               "64KiB..256MiB")
def case_peer_copy(ctx: BenchContext) -> list[CaseResult]:
    """GB/s of one copy between workers; targets: >=1.8x the relay from 16 MiB, not slower at
    64 KiB."""
    a, b = ctx.workers(2)
    rows = []
    with ctx.progress(len(PEER_SIZES) * ctx.reps(5, 2), "peer_copy") as bar:
        for size in PEER_SIZES:
            src, dst = floats(a, size // 4, 1.0), floats(b, size // 4)
            try:
                rows.append(_copy_row(ctx, size, src, dst, bar))
            finally:
                free_all([src, dst])
    return rows


def _copy_row(ctx: BenchContext, size: int, src: RemoteTensor, dst: RemoteTensor,
              bar: Any) -> CaseResult:
    a, b = src.client, dst.client
    inner = max(1, 4 * BYTES_PER_SAMPLE // size)

    def gbps(copy: Callable[[], Any]) -> Runner:
        return lambda: size * inner / timed(lambda: [copy() for _ in range(inner)]) / 1e9

    runners = {"ours": gbps(lambda: a.copy_tensor(src, dst)),
               "relay": gbps(lambda: b.set_tensor(dst, a.get_tensor(src)))}
    samples = interleave(runners, ctx.reps(5, 2), bar)
    target = Target(1.8, True) if size >= 16 * MiB else Target(1.0, True) if size <= 64 << 10 \
        else None
    return CaseResult("peer_copy", f"peer_copy {format_size(size)}", "GB/s", samples["ours"],
                      {"relay": samples["relay"]}, target, higher_is_better=True,
                      note=f"{inner} copies/sample")


# ------------------------------------------------------------------------------ peer_chain


class Chain:
    """x_A -> (+1 on A) -> y_A -> hop -> x_B -> (+1 on B) -> y_B -> hop -> x_A, repeated."""

    def __init__(self, a: Client, b: Client) -> None:
        n = CHAIN_FLOATS
        self.xa, self.ya, self.onea = floats(a, n), floats(a, n), floats(a, n, 1.0)
        self.xb, self.yb, self.oneb = floats(b, n), floats(b, n), floats(b, n, 1.0)
        self.ga = a.register(_add(self.xa, self.onea, self.ya))
        self.gb = b.register(_add(self.xb, self.oneb, self.yb))
        self.a, self.b = a, b

    def steps(self) -> list[Callable[[], Future[Any]]]:
        """One round, as four requests to issue in order."""
        a, b = self.a, self.b
        return [lambda: a.run_async(self.ga), lambda: a.copy_tensor_async(self.ya, self.xb),
                lambda: b.run_async(self.gb), lambda: b.copy_tensor_async(self.yb, self.xa)]

    def run(self, rounds: int, wait_each: bool) -> float:
        """Rounds per second; checks that every +1 happened, in order."""
        self.a.set_tensor(self.xa, np.zeros(CHAIN_FLOATS, np.float32))
        steps = self.steps()
        start = time.perf_counter()
        futures = []
        for _ in range(rounds):
            for step in steps:
                futures.append(step())
                if wait_each:
                    futures[-1].result()
        for future in futures:
            future.result()
        seconds = time.perf_counter() - start
        value = self.a.get_tensor(self.xa[:1])[0]
        if value != 2 * rounds:
            raise RuntimeError(f"chain computed {value}, expected {2 * rounds}")
        return rounds / seconds

    def free(self) -> None:
        free_all([self.xa, self.ya, self.onea, self.xb, self.yb, self.oneb])


def _add(x: RemoteTensor, one: RemoteTensor, out: RemoteTensor) -> Graph:
    g = Graph()
    g.add(x, one, out=out)
    return g


@register_case("peer_chain", f"{CHAIN_ROUNDS} rounds of compute A, 64KiB hop, compute B, hop back: "
               "issued async vs waiting for each step")
def case_peer_chain(ctx: BenchContext) -> list[CaseResult]:
    """Rounds/s of a dependent chain: no client round trip per step vs one per step."""
    a, b = ctx.workers(2)
    chain = Chain(a, b)
    try:
        rounds = ctx.reps(CHAIN_ROUNDS, 50)
        runners = {"ours": lambda: chain.run(rounds, wait_each=False),
                   "wait-each-step": lambda: chain.run(rounds, wait_each=True)}
        reps = ctx.reps(7, 2)
        with ctx.progress(reps, "peer_chain") as bar:
            samples = interleave(runners, reps, bar)
    finally:
        chain.free()
    return [CaseResult("peer_chain", f"peer_chain {rounds} rounds", "rounds/s", samples["ours"],
                       {"wait-each-step": samples["wait-each-step"]}, None,
                       higher_is_better=True, note="ratio = speed-up of issuing async")]


# -------------------------------------------------------------------------------- pipeline


class Model:
    """``LAYERS`` layers ``h = h @ W``; weights uploaded once per worker and layer."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.weights = [(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
                        for _ in range(LAYERS)]
        self.remote: dict[tuple[int, int], RemoteTensor] = {}

    def weight(self, client: Client, layer: int) -> RemoteTensor:
        key = (id(client), layer)
        if key not in self.remote:
            w = client.alloc_buffer(WIDTH * WIDTH * 4).tensor((WIDTH, WIDTH), "float32")
            client.set_tensor(w, self.weights[layer])
            self.remote[key] = w
        return self.remote[key]

    def builder(self, stages: int) -> Callable[[int, RemoteTensor, RemoteTensor], Graph]:
        """Stage ``i`` of ``stages`` runs layers ``[i * LAYERS / stages, (i + 1) * ...)``."""
        per = LAYERS // stages

        def build(stage: int, x: RemoteTensor, y: RemoteTensor) -> Graph:
            g = Graph()
            h: Any = x
            layers = range(stage * per, (stage + 1) * per)
            for layer in layers:
                w = self.weight(cast(Client, x.client), layer)
                h = g.matmul(h, w, out=y if layer == layers[-1] else None)
            return g
        return build

    def free(self) -> None:
        free_all(list(self.remote.values()))


def _pipeline_runner(pipe: Pipeline, batches: list[np.ndarray]) -> Runner:
    rows = sum(len(b) for b in batches)
    return lambda: rows / timed(lambda: pipe.run(batches)) / 1e3


@register_case("pipeline", f"{LAYERS}-layer matmul model: pipeline over 2 and 3 workers with "
               f"{MICRO_BATCHES} micro-batches vs 1 worker and vs no micro-batching")
def case_pipeline(ctx: BenchContext) -> list[CaseResult]:
    """k rows/s through the whole model (each worker: one BLAS thread)."""
    cs = ctx.workers(3)
    model = Model()
    rng = np.random.default_rng(1)
    micro = [rng.standard_normal((ROWS, WIDTH)).astype(np.float32) for _ in range(MICRO_BATCHES)]
    whole = [np.concatenate(micro)]
    pipes: dict[str, tuple[Pipeline, list[np.ndarray]]] = {}
    try:
        for name, stages, batches in [("ours-2", 2, micro), ("ours-3", 3, micro),
                                      ("1 worker", 1, micro), ("2 workers, 1 batch", 2, whole),
                                      ("3 workers, 1 batch", 3, whole)]:
            pipes[name] = (Pipeline(cs[:stages], model.builder(stages), batches[0].shape),
                           batches)
        _check_pipelines(model, pipes, micro)
        runners = {name: _pipeline_runner(*pipe) for name, pipe in pipes.items()}
        pipes["other worker"] = (Pipeline(cs[1:2], model.builder(1), (ROWS, WIDTH)), micro)
        runners["2 independent workers"] = _side_by_side(pipes["1 worker"][0],
                                                         pipes["other worker"][0], micro)
        reps = ctx.reps(7, 2)
        with ctx.progress(reps, "pipeline") as bar:
            samples = interleave(runners, reps, bar)
    finally:
        for pipe, _ in pipes.values():
            pipe.close()
        model.free()
    ceiling = CaseResult("pipeline", "pipeline 2 workers vs ceiling", "k rows/s",
                         samples["ours-2"], {"2 independent workers": samples["2 independent workers"]},
                         None, higher_is_better=True,
                         note="ceiling: the whole model on 2 workers at once, half the "
                              "micro-batches each (what the cores allow now); ratio = efficiency")
    return [_pipeline_row(samples, 2, Target(1.5, True)), ceiling, _pipeline_row(samples, 3, None)]


def _side_by_side(one: Pipeline, other: Pipeline, micro: list[np.ndarray]) -> Runner:
    """Both single-worker pipelines at once, half the micro-batches each: the machine's ceiling."""
    half = len(micro) // 2

    def run() -> float:
        start = time.perf_counter()
        thread = threading.Thread(target=other.run, args=(micro[half:],))
        thread.start()
        one.run(micro[:half])
        thread.join()
        return len(micro) * ROWS / (time.perf_counter() - start) / 1e3
    return run


def _check_pipelines(model: Model, pipes: dict[str, tuple[Pipeline, list[np.ndarray]]],
                     micro: list[np.ndarray]) -> None:
    """Every configuration computes the same model (float32 tolerance)."""
    expect = micro[-1]
    for w in model.weights:
        expect = expect @ w
    for name, (pipe, batches) in pipes.items():
        got = pipe.run(batches)[-1][-ROWS:]
        if not np.allclose(got, expect, rtol=1e-3, atol=1e-3):
            raise RuntimeError(f"pipeline {name!r} computed a different model")


def _pipeline_row(samples: dict[str, list[float]], workers: int,
                  target: Target | None) -> CaseResult:
    baselines = {"1 worker": samples["1 worker"],
                 f"{workers} workers, 1 batch": samples[f"{workers} workers, 1 batch"]}
    note = f"{MICRO_BATCHES} micro-batches of {ROWS} rows"
    if workers == 3:
        note += f"; 2 workers: {np.median(samples['ours-2']):.2f} (2 cores: 3 cannot beat 2)"
    return CaseResult("pipeline", f"pipeline {workers} workers", "k rows/s",
                      samples[f"ours-{workers}"], baselines, target, higher_is_better=True,
                      note=note)


def main(argv: Sequence[str] | None = None) -> int:
    """``zmq-rpc-bench`` with these cases registered (e.g. ``--cases peer_copy,pipeline``)."""
    from . import bench
    return bench.main(argv)


if __name__ == "__main__":
    sys.modules.setdefault("zmq_rpc.tools.bench_peer", sys.modules[__name__])  # register once
    sys.exit(main())
