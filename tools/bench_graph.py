"""Graph benchmark cases for ``zmq-rpc-bench``: ``graph_run``, ``graph_500``, ``graph_scratch``,
``graph_matmul``.

Registered into :mod:`zmq_rpc.tools.bench`'s case registry on import (list this module in
``bench.CASE_MODULES``). What runs where:

- **This process, main thread**: the timed loops against the benchmark's workers (subprocesses
  started with ``--threads 1``) and the in-process numpy baselines, interleaved A B A B ...
- **This process, no threads**: :class:`LocalExecutor`, a worker's
  :class:`~zmq_rpc.worker.dispatch.executor.Executor` driven through ``handle_frames`` without sockets, to
  read the arena counters of a compiled graph (``graph_scratch``).
- **A child process** (``graph_matmul``): the same executor and the plain-numpy loop, both with
  ``OPENBLAS_NUM_THREADS=1`` set before numpy loads, as the workers have it; it prints its samples
  as one JSON line.

Every graph here is built once with the client's builder; the local executor and the child run the
very same :class:`~zmq_rpc.broker.graph.GraphSpec`, with buffers of the same handles and sizes.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from ..broker import graph as wire_graph
from ..broker import protocol as p
from ..broker.protocol import Cmd, TensorRef
from ..client import Client, Graph, RemoteTensor
from .bench import (
    BenchContext,
    CaseResult,
    Runner,
    Target,
    elapsed,
    interleave,
    register_case,
)

__all__ = ["LocalExecutor", "case_graph_500", "case_graph_matmul", "case_graph_run",
           "case_graph_scratch", "matmul_child"]

BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")


# ------------------------------------------------------------------------ an executor in-process


@dataclass
class _Sent:
    """What the executor's ``send`` returns when it asks for a tracker: a finished one."""

    done: bool = True


class LocalExecutor:
    """A worker's Executor in this process: requests are encoded and decoded as on the wire and
    run inline by ``handle_frames``; replies land in :attr:`replies`. One session."""

    CLIENT_ID = b"bench-local-0000!"

    def __init__(self, memory_limit: int = 4 << 30) -> None:
        from ..worker.backends.numpy_backend import NumpyBackend
        from ..worker.dispatch.executor import Executor, WorkerLimits
        from ..worker.peer.links import PeerLinks

        limits = WorkerLimits(memory_limit=memory_limit, max_buffer_size=memory_limit,
                              max_message_size=64 << 20, session_timeout=3600.0)
        self.replies: list[list[Any]] = []
        backend = NumpyBackend()
        peers = PeerLinks(zmq.Context.instance(), backend)     # no peer endpoint: no socket
        self.executor = Executor(backend, limits, self._send, "bench-local", peers)
        self._ids = itertools.count(1)
        major, minor = p.PROTOCOL_VERSION
        self.call(Cmd.HELLO, p.Hello(major=major, minor=minor, client="bench-local"))

    def _send(self, frames: list[Any], **_: Any) -> _Sent:
        self.replies.append(frames)
        return _Sent()

    def call(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = ()) -> None:
        """Run one request to completion; raises RuntimeError on an error reply."""
        req_id = next(self._ids)
        frames = [zmq.Frame(self.CLIENT_ID), zmq.Frame(p.encode_request(cmd, req_id, msg)),
                  *(zmq.Frame(bytes(memoryview(f))) for f in payload)]
        self.replies.clear()
        self.executor.handle_frames(frames)
        if len(self.replies) != 1:
            raise RuntimeError(f"{cmd.name}: {len(self.replies)} replies (queued behind a send?)")
        header = p.unpack_header(self.replies[0][1])
        if header[0] != p.STATUS_OK:
            raise RuntimeError(f"{cmd.name} failed: {header}")

    def mirror(self, refs: Sequence[TensorRef], sizes: dict[int, int],
               fill: Callable[[TensorRef], np.ndarray]) -> None:
        """Allocate buffers of the same handles and sizes as a remote graph's, then fill every
        tensor in ``refs`` with ``fill(ref)``."""
        for handle, size in sizes.items():
            self.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=handle, size=size))
        for ref in refs:
            self.call(Cmd.SET_TENSOR, p.SetTensor(tensor=ref), [fill(ref).tobytes()])

    def register(self, handle: int, spec: wire_graph.GraphSpec) -> Any:
        """Register ``spec``; returns the worker's CompiledGraph (safe: this thread owns it)."""
        self.call(Cmd.GRAPH_REGISTER, wire_graph.GraphRegister(handle=handle, graph=spec))
        return self.executor.sessions[self.CLIENT_ID].graphs[handle]

    def run(self, handle: int) -> None:
        self.call(Cmd.GRAPH_RUN, wire_graph.GraphRun(handle=handle, inputs=[], fetch=[]))

    def compute(self, spec: wire_graph.GraphSpec) -> None:
        self.call(Cmd.GRAPH_COMPUTE, wire_graph.GraphCompute(graph=spec, inputs=[], fetch=[]))


def _buffer_sizes(tensors: Sequence[RemoteTensor]) -> dict[int, int]:
    return {t.buffer.handle: t.buffer.size for t in tensors}


def _normal_fill(scale: float) -> Callable[[TensorRef], np.ndarray]:
    rng = np.random.default_rng(0)
    return lambda ref: (rng.standard_normal(ref.shape) * scale).astype(ref.dtype.storage)


# ------------------------------------------------------------------------------ shared helpers


def _tensor(ctx: BenchContext, client: Client, shape: Sequence[int],
            values: np.ndarray | None = None) -> RemoteTensor:
    """A float32 tensor in a new buffer, freed when the run ends."""
    shape = tuple(shape)
    buffer = client.alloc_buffer(max(int(np.prod(shape)) * 4, 4))
    ctx.resources.callback(buffer.free)
    tensor = buffer.tensor(shape)
    client.set_tensor(tensor, np.ones(shape, np.float32) * 0.5 if values is None else values)
    return tensor


def _register(ctx: BenchContext, client: Client, g: Graph) -> Any:
    handle = client.register(g)
    ctx.resources.callback(handle.free)
    return handle


def _spread(samples: Sequence[float]) -> str:
    return f"median {statistics.median(samples):.3g} [{min(samples):.3g}-{max(samples):.3g}]"


# ------------------------------------------------------------------------------------ graph_run


@register_case("graph_run", "run(h) of a registered 1-node graph vs a ping round trip")
def case_graph_run(ctx: BenchContext) -> list[CaseResult]:
    """µs per call: run(h) of add(a, b) on 16 floats, run with inputs= and fetch=, and ping,
    alternating call by call."""
    client = ctx.client
    a, b, out = (_tensor(ctx, client, (16,)) for _ in range(3))
    g = Graph()
    g.add(a, b, out=out)
    handle = _register(ctx, client, g)
    values = np.arange(16, dtype=np.float32)
    runners: dict[str, Runner] = {
        "ours": lambda: elapsed(lambda: client.run(handle)) * 1e6,
        "ours-io": lambda: elapsed(lambda: client.run(handle, inputs={a: values},
                                                      fetch=[out])) * 1e6,
        "ping": lambda: elapsed(client.ping) * 1e6,
    }
    reps = ctx.reps(2000, 300)
    with ctx.progress(reps, "graph_run") as bar:
        samples = interleave(runners, reps, bar, warmup=200)
    ping = {"ping": samples["ping"]}
    return [
        CaseResult("graph_run", "graph_run", "µs", samples["ours"], ping,
                   Target(1.5, higher_is_better=False), higher_is_better=False),
        CaseResult("graph_run", "graph_run p99", "µs", samples["ours"], ping, None,
                   higher_is_better=False, stat="p99"),
        CaseResult("graph_run", "graph_run inputs+fetch", "µs", samples["ours-io"], ping, None,
                   higher_is_better=False, note="one 64-byte input written, out fetched"),
    ]


# ------------------------------------------------------------------------------------ graph_500


def _mix_recipe(n_ops: int) -> list[str]:
    """The op sequence of the 500-op graph: matmul, scale, add, tanh, mul, repeated."""
    cycle = ["matmul", "scale", "add", "tanh", "mul"]
    return [cycle[i % len(cycle)] for i in range(n_ops)]


def _build_mix(g: Graph, x: Any, w: Any, out: Any, n_ops: int) -> None:
    value: Any = x
    recipe = _mix_recipe(n_ops)
    for i, op in enumerate(recipe):
        dst = out if i == len(recipe) - 1 else None
        if op == "matmul":
            value = g.matmul(value, w, out=dst)
        elif op == "scale":
            value = g.scale(value, 0.5, out=dst)
        elif op == "add":
            value = g.add(value, x, out=dst)
        elif op == "tanh":
            value = g.tanh(value, out=dst)
        else:
            value = g.mul(value, w, out=dst)


def _numpy_mix(x: np.ndarray, w: np.ndarray, n_ops: int) -> np.ndarray:
    """The same calls in a plain numpy loop (allocating, as a script would)."""
    value = x
    for op in _mix_recipe(n_ops):
        if op == "matmul":
            value = value @ w
        elif op == "scale":
            value = value * np.float32(0.5)
        elif op == "add":
            value = value + x
        elif op == "tanh":
            value = np.tanh(value)
        else:
            value = value * w
    return value


def _mix_graph(ctx: BenchContext, client: Client, side: int, n_ops: int
               ) -> tuple[Graph, list[RemoteTensor], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(side)
    x = rng.standard_normal((side, side)).astype(np.float32)
    w = (rng.standard_normal((side, side)) / np.sqrt(side)).astype(np.float32)
    rx, rw, out = _tensor(ctx, client, x.shape, x), _tensor(ctx, client, w.shape, w), \
        _tensor(ctx, client, x.shape)
    g = Graph()
    _build_mix(g, rx, rw, out, n_ops)
    (got,) = client.compute(g, fetch=[out])
    if not np.allclose(got, _numpy_mix(x, w, n_ops), rtol=1e-4, atol=1e-4):
        raise RuntimeError(f"graph_500 {side}x{side}: the worker's result differs from numpy's")
    return g, [rx, rw, out], x, w


@register_case("graph_500", "a 500-op elementwise/matmul graph in one message vs numpy in-process")
def case_graph_500(ctx: BenchContext) -> list[CaseResult]:
    """kops/s of one GRAPH_COMPUTE (validate, plan, run) and one run(h) of the same graph, against
    the same 500 numpy calls made here in a loop; and the per-op overhead in µs."""
    client, n_ops = ctx.client, 500
    rows: list[CaseResult] = []
    reps = ctx.reps(30, 5)
    with ctx.progress(2 * reps, "graph_500") as bar:
        for side in (8, 64):
            rows += _mix_rows(side, n_ops, _mix_seconds(ctx, client, side, n_ops, reps, bar))
    return rows


def _mix_seconds(ctx: BenchContext, client: Client, side: int, n_ops: int, reps: int,
                 bar: Any) -> dict[str, list[float]]:
    """Seconds per call of compute(g), run(h) and the numpy loop, interleaved."""
    g, _, x, w = _mix_graph(ctx, client, side, n_ops)
    handle = _register(ctx, client, g)
    return interleave({
        "compute": lambda: elapsed(lambda: client.compute(g)),
        "run": lambda: elapsed(lambda: client.run(handle)),
        "numpy": lambda: elapsed(lambda: _numpy_mix(x, w, n_ops)),
    }, reps, bar, warmup=2)


def _mix_rows(side: int, n_ops: int, seconds: dict[str, list[float]]) -> list[CaseResult]:
    size = f"{side}x{side} f32"
    kops = {name: [n_ops / s / 1e3 for s in values] for name, values in seconds.items()}
    numpy_us = [s / n_ops * 1e6 for s in seconds["numpy"]]
    overhead = [(run - base) / n_ops * 1e6 for run, base in zip(seconds["run"], seconds["numpy"])]
    compute_overhead = [(c - base) / n_ops * 1e6
                        for c, base in zip(seconds["compute"], seconds["numpy"])]
    return [
        CaseResult("graph_500", f"graph_500 run {size}", "kops/s", kops["run"],
                   {"numpy": kops["numpy"]}, None, higher_is_better=True),
        CaseResult("graph_500", f"graph_500 compute {size}", "kops/s", kops["compute"],
                   {"numpy": kops["numpy"]}, None, higher_is_better=True,
                   note="one message: validate + plan + run"),
        CaseResult("graph_500", f"graph_500 overhead/op run {size}", "µs", overhead,
                   {"numpy per op": numpy_us}, None, higher_is_better=False,
                   note="(run - numpy loop) / 500, paired by repetition"),
        CaseResult("graph_500", f"graph_500 overhead/op compute {size}", "µs", compute_overhead,
                   {"numpy per op": numpy_us}, None, higher_is_better=False),
    ]


# -------------------------------------------------------------------------------- graph_scratch


@register_case("graph_scratch", "arena reuse: allocations per warm run, arena vs intermediates")
def case_graph_scratch(ctx: BenchContext) -> list[CaseResult]:
    """The 500-op 64x64 graph: its arena next to the sum of its intermediates; arena
    allocations and traced peak bytes per warm run(h) against a GRAPH_COMPUTE of the same graph
    (which plans and allocates afresh); device memory reserved on the remote worker."""
    client, n_ops, runs = ctx.client, 500, ctx.reps(50, 10)
    g, tensors, _, _ = _mix_graph(ctx, client, 64, n_ops)
    free_before = client.device_memory().free
    handle = _register(ctx, client, g)
    reserved = free_before - client.device_memory().free
    for _ in range(runs):
        client.run(handle)
    drift = free_before - reserved - client.device_memory().free

    local = LocalExecutor()
    spec = g.spec()
    local.mirror([t.ref for t in tensors[:2]], _buffer_sizes(tensors), _normal_fill(0.1))
    graph = local.register(1, spec)
    local.run(1)
    before = graph.arena_allocations
    with ctx.progress(runs, "graph_scratch") as bar:
        run_peaks, compute_peaks = [], []
        for _ in range(runs):
            run_peaks.append(_traced_peak(lambda: local.run(1)) / 1024)
            compute_peaks.append(_traced_peak(lambda: local.compute(spec)) / 1024)
            bar.update(1)
    per_run = (graph.arena_allocations - before) / runs
    intermediates = sum(step.meta.nbytes for step in graph.steps if step.slot >= 0)
    note = (f"remote arena reserve {reserved} B (local plan {graph.arena_size} B); "
            f"device memory drift over {runs} runs {drift} B")
    return [
        CaseResult("graph_scratch", "graph_scratch arena 64x64 x500", "KiB",
                   [graph.arena_size / 1024], {"sum of intermediates": [intermediates / 1024]},
                   None, higher_is_better=False, note=note),
        CaseResult("graph_scratch", "graph_scratch arena allocs/warm run", "allocs",
                   [per_run], {"GRAPH_COMPUTE": [1.0]}, None, higher_is_better=False,
                   note="a compute plans and allocates its arena every time"),
        CaseResult("graph_scratch", "graph_scratch traced peak/warm run", "KiB", run_peaks,
                   {"GRAPH_COMPUTE": compute_peaks}, None, higher_is_better=False,
                   note="tracemalloc peak of one request in an in-process executor"),
    ]


def _traced_peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --------------------------------------------------------------------------------- graph_matmul

MATMUL_SIDE = 512
MATMUL_LAYERS = 8


def _build_matmul(g: Graph, x: Any, weights: Sequence[Any], out: Any) -> None:
    """x -> 8 x (silu(v @ W_i) + x) -> out."""
    value: Any = x
    for i, w in enumerate(weights):
        last = i == len(weights) - 1
        value = g.add(g.silu(g.matmul(value, w)), x, out=out if last else None)


def _numpy_matmul(x: np.ndarray, weights: Sequence[np.ndarray]) -> np.ndarray:
    """The same calls in a plain script: silu written the usual way."""
    value = x
    for w in weights:
        h = value @ w
        value = h / (1 + np.exp(-h)) + x
    return value


def matmul_child(request: dict[str, Any]) -> dict[str, list[float]]:
    """Run in a child with one BLAS thread: the graph on a LocalExecutor, the numpy loop, and a
    1-node graph, interleaved; seconds per call."""
    spec = wire_graph.check_graph(request["graph"])
    small = wire_graph.check_graph(request["small"])
    local = LocalExecutor()
    sizes = {int(h): int(s) for h, s in request["sizes"].items()}
    inputs = [p.check_tensor(t, "input") for t in request["inputs"]]
    fill = _normal_fill(1 / np.sqrt(MATMUL_SIDE))
    local.mirror(inputs, sizes, fill)
    local.register(1, spec)
    local.register(2, small)
    x = fill(inputs[0]).astype(np.float32)
    weights = [fill(ref).astype(np.float32) for ref in inputs[1:MATMUL_LAYERS + 1]]
    runners: dict[str, Callable[[], float]] = {"executor": lambda: elapsed(lambda: local.run(1)),
               "numpy": lambda: elapsed(lambda: _numpy_matmul(x, weights)),
               "one-node": lambda: elapsed(lambda: local.run(2))}
    for run in runners.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(int(request["reps"])):
        for name, run in runners.items():
            samples[name].append(run())
    return samples


def _child_samples(request: dict[str, Any]) -> dict[str, list[float]]:
    env = {**os.environ, **{var: "1" for var in BLAS_VARS}}
    code = ("import json, sys, msgpack\n"
            "from zmq_rpc.tools.bench_graph import matmul_child\n"
            "request = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)\n"
            "print(json.dumps(matmul_child(request)))\n")
    proc = subprocess.run([sys.executable, "-c", code], input=msgpack.packb(request),
                          capture_output=True, env=env, timeout=600, check=False)
    if proc.returncode:
        raise RuntimeError(f"graph_matmul child failed: {proc.stderr.decode()[-2000:]}")
    samples: dict[str, list[float]] = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return samples


@register_case("graph_matmul", "8 x (512x512 @ 512x512) with silu/add: worker compute vs numpy")
def case_graph_matmul(ctx: BenchContext) -> list[CaseResult]:
    """ms of the graph's compute, one BLAS thread everywhere: on an in-process executor and on
    the bench's worker (run(h) minus a 1-node run), against the same numpy calls in a script."""
    client, side, reps = ctx.client, MATMUL_SIDE, ctx.reps(9, 3)
    x = _tensor(ctx, client, (side, side))
    weights = [_tensor(ctx, client, (side, side)) for _ in range(MATMUL_LAYERS)]
    out = _tensor(ctx, client, (side, side))
    g = Graph()
    _build_matmul(g, x, weights, out)
    a, b, tiny_out = (_tensor(ctx, client, (16,)) for _ in range(3))
    small = Graph()
    small.add(a, b, out=tiny_out)
    request = {"graph": g.spec().to_wire(), "small": small.spec().to_wire(), "reps": reps,
               "inputs": [t.ref.to_wire() for t in (x, *weights, a, b)],
               "sizes": {str(h): s for h, s in _buffer_sizes([x, *weights, out, a, b,
                                                              tiny_out]).items()}}
    local = _child_samples(request)
    fill = _normal_fill(1 / np.sqrt(side))                 # same data remotely (and finite)
    for tensor in (x, *weights):
        client.set_tensor(tensor, fill(tensor.ref))
    remote = _remote_matmul(ctx, client, g, small, reps)
    ms = {name: [s * 1e3 for s in values] for name, values in {**local, **remote}.items()}
    numpy = {"numpy (1 thread)": ms["numpy"]}
    one_node = statistics.median(ms["one-node"])
    return [
        CaseResult("graph_matmul", "graph_matmul executor", "ms",
                   [e - one_node for e in ms["executor"]], numpy,
                   Target(1.1, higher_is_better=False), higher_is_better=False,
                   note=f"in-process executor, minus a 1-node run ({one_node:.3f} ms)"),
        CaseResult("graph_matmul", "graph_matmul worker", "ms", ms["worker"], numpy,
                   Target(1.1, higher_is_better=False), higher_is_better=False,
                   note="run(h) on the bench's --threads 1 worker minus a 1-node run(h); "
                        f"raw run(h) {_spread(ms['worker-raw'])} ms"),
    ]


def _remote_matmul(ctx: BenchContext, client: Client, g: Graph, small: Graph,
                   reps: int) -> dict[str, list[float]]:
    handle, tiny = _register(ctx, client, g), _register(ctx, client, small)
    with ctx.progress(reps, "graph_matmul") as bar:
        seconds = interleave({"raw": lambda: elapsed(lambda: client.run(handle)),
                              "tiny": lambda: elapsed(lambda: client.run(tiny))}, reps, bar)
    tiny_median = statistics.median(seconds["tiny"])
    return {"worker": [s - tiny_median for s in seconds["raw"]], "worker-raw": seconds["raw"]}
