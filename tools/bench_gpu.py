"""``zmq-rpc-bench --cases gpu``: a ``--device cuda`` worker against cupy in process.

Rows, each beside a baseline measured in the same run:

- ``gpu set SIZE`` / ``gpu get SIZE`` (GB/s): set_tensor/get_tensor of SIZE bytes through a local
  cuda worker (loopback, pinned staging on the worker) vs cupy's own host<->device copies of the
  same bytes in this process (``ndarray.set`` / ``cupy.asnumpy`` from pageable memory).
- ``gpu graph_matmul`` (ms): 8 x (N x N @ N x N) with silu and add, run(h) on the cuda worker minus
  a 1-node run(h), vs the same cupy calls in this process (synchronized).
- ``gpu encoder`` (batches/s): a MiniLM-style encoder (6 layers, hidden 384, 12 heads, 128 tokens,
  batch 32: matmuls, masked softmax, GELU, layer norms) as one registered graph, on the cuda worker
  vs the same graph on a CPU worker of this run.
- ``gpu llm ...`` (tokens/s): SmolLM2-135M (f32 weights: dequantized once at load on the GPU)
  prefill of 128 tokens and greedy decode, on one cuda worker and split over a cuda worker and a
  CPU worker, vs one CPU worker in f32 and in the default quantized mode.

Without cupy or a GPU the case prints ``gpu: skipped (why)`` and returns no rows. Not a default
case: ``tools/gpu_check.sh`` runs it. Runs in the bench's main thread; the workers it starts are
stopped when the run ends.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..client import Client, Graph, RemoteTensor
from ..worker.launch import ServerProcess, worker_argv
from ..worker.process.devices import cuda_unavailable
from .bench import BenchContext, CaseResult, elapsed, interleave, register_case

MATMUL_SIDE = 2048
MATMUL_LAYERS = 8
ENCODER = {"layers": 6, "hidden": 384, "heads": 12, "ffn": 1536, "tokens": 128, "batch": 32}
GB = 1e9


def _worker(ctx: BenchContext, device: str) -> Client:
    server = ServerProcess([*worker_argv(), "--device", device])
    ctx.resources.callback(server.stop)
    client = Client(server.wait_ready())
    ctx.resources.callback(client.close)
    return client


@register_case("gpu", "cuda worker: set/get vs cupy copies, matmul graph vs cupy, encoder and "
                      "SmolLM2 vs CPU workers (skipped without a GPU)", default=False)
def case_gpu(ctx: BenchContext) -> list[CaseResult]:
    reason = cuda_unavailable()
    if reason is not None:
        print(f"gpu: skipped ({reason})")
        return []
    import cupy
    gpu = _worker(ctx, "cuda:0")
    cpu = ctx.workers(1)[0]
    rows = transfer_rows(ctx, gpu, cupy) + matmul_rows(ctx, gpu, cupy) + encoder_rows(ctx, gpu, cpu)
    return rows + llm_rows(ctx, gpu, cpu)


# ------------------------------------------------------------------------------ transfers


def transfer_rows(ctx: BenchContext, gpu: Client, cp: Any) -> list[CaseResult]:
    return [row for size in ctx.sizes for row in _transfer(ctx, gpu, cp, size)]


def _transfer(ctx: BenchContext, gpu: Client, cp: Any, size: int) -> list[CaseResult]:
    """set and get of ``size`` bytes through the worker and with cupy, interleaved."""
    reps = ctx.reps(9 if size <= 16 << 20 else 5, 3)
    host = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    tensor = gpu.alloc_buffer(size).tensor(size, "uint8")
    device = cp.empty(size, cp.uint8)
    back = np.empty(size, np.uint8)
    with ctx.progress(reps, f"gpu set/get {size}") as bar:
        s = interleave({"ours set": lambda: elapsed(lambda: gpu.set_tensor(tensor, host)),
                        "cupy set": lambda: _synced(cp, lambda: device.set(host)),
                        "ours get": lambda: elapsed(lambda: gpu.get_tensor(tensor, out=back)),
                        "cupy get": lambda: _synced(cp, lambda: cp.asnumpy(device))},
                       reps, bar)
    if not np.array_equal(back, host):
        raise RuntimeError(f"gpu get of {size} bytes came back different")
    tensor.buffer.free()
    return [CaseResult("gpu", f"gpu {way} {_size(size)}", "GB/s",
                       [size / t / GB for t in s[f"ours {way}"]],
                       {f"cupy {way} in process": [size / t / GB for t in s[f"cupy {way}"]]},
                       None, higher_is_better=True,
                       note="through a local cuda worker (loopback) vs cupy's own copy of "
                            "pageable host memory")
            for way in ("set", "get")]


def _synced(cp: Any, fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    cp.cuda.get_current_stream().synchronize()
    return time.perf_counter() - start


def _size(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 else f"{n >> 10}KiB"


# ------------------------------------------------------------------------------- matmul


def matmul_rows(ctx: BenchContext, gpu: Client, cp: Any) -> list[CaseResult]:
    side, reps = MATMUL_SIDE, ctx.reps(9, 3)
    rng = np.random.default_rng(2)
    x_host = rng.normal(size=(side, side)).astype(np.float32) / np.sqrt(side)
    w_host = [rng.normal(size=(side, side)).astype(np.float32) / np.sqrt(side)
              for _ in range(MATMUL_LAYERS)]
    x, out = (_put(gpu, x_host), _put(gpu, x_host))
    ws = [_put(gpu, w) for w in w_host]
    g = Graph()
    h: Any = x
    for w in ws:
        h = g.add(g.silu(g.matmul(h, w)), h)
    g.cont(h, out=out)
    a, b, c = (_put(gpu, np.ones(16, np.float32)) for _ in range(3))
    tiny = Graph()
    tiny.add(a, b, out=c)
    handle, tiny_handle = gpu.register(g), gpu.register(tiny)
    xd, wd = cp.asarray(x_host), [cp.asarray(w) for w in w_host]

    def in_process() -> float:
        def calls() -> None:
            v = xd
            for w in wd:
                m = cp.matmul(v, w)
                v = m / (1 + cp.exp(-m)) + v
        return _synced(cp, calls)

    with ctx.progress(reps, "gpu graph_matmul") as bar:
        s = interleave({"run": lambda: elapsed(lambda: gpu.run(handle)),
                        "tiny": lambda: elapsed(lambda: gpu.run(tiny_handle)),
                        "cupy": in_process}, reps, bar)
    np.testing.assert_allclose(gpu.get_tensor(out), cp.asnumpy(_reference(cp, xd, wd)),
                               rtol=1e-3, atol=1e-3)
    tiny_ms = statistics.median(s["tiny"]) * 1e3
    return [CaseResult("gpu", f"gpu graph_matmul {MATMUL_LAYERS}x{side}", "ms",
                       [t * 1e3 - tiny_ms for t in s["run"]],
                       {"cupy in process": [t * 1e3 for t in s["cupy"]]}, None,
                       higher_is_better=False,
                       note=f"run(h) minus a 1-node run(h) ({tiny_ms:.3f} ms)")]


def _reference(cp: Any, x: Any, ws: Sequence[Any]) -> Any:
    v = x
    for w in ws:
        m = cp.matmul(v, w)
        v = m / (1 + cp.exp(-m)) + v
    return v


def _put(client: Client, values: np.ndarray) -> RemoteTensor:
    tensor = client.alloc_buffer(values.nbytes).tensor(values.shape, str(values.dtype))
    client.set_tensor(tensor, values)
    return tensor


# ------------------------------------------------------------------------------ encoder


def encoder_graph(client: Client, rng: np.random.Generator) -> tuple[Graph, RemoteTensor]:
    """A MiniLM-style encoder on ``client``'s worker: random weights, a padding mask."""
    e = ENCODER
    hidden, heads, tokens, batch = e["hidden"], e["heads"], e["tokens"], e["batch"]
    head = hidden // heads

    def weight(*shape: int) -> RemoteTensor:
        return _put(client, (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32))

    x_in = weight(batch * tokens, hidden)
    mask_host = np.zeros((batch, 1, 1, tokens), np.float32)
    mask_host[:, :, :, tokens * 3 // 4:] = -np.inf          # the last quarter is padding
    mask = _put(client, mask_host)
    ones, zeros = _put(client, np.ones(hidden, np.float32)), _put(client, np.zeros(hidden, np.float32))
    g = Graph()
    x: Any = x_in
    for _ in range(e["layers"]):
        def split(t: Any) -> Any:
            return g.permute(g.reshape(t, (batch, tokens, heads, head)), (0, 2, 1, 3))
        q, k, v = (split(g.matmul(x, weight(hidden, hidden), transpose_b=True)) for _ in range(3))
        p = g.soft_max(g.matmul(q, k, transpose_b=True), mask=mask, scale=1 / np.sqrt(head))
        ctx = g.reshape(g.cont(g.permute(g.matmul(p, v), (0, 2, 1, 3))), (batch * tokens, hidden))
        x = g.layer_norm(g.add(x, g.matmul(ctx, weight(hidden, hidden), transpose_b=True)),
                         ones, zeros, eps=1e-12)
        ff = g.gelu(g.matmul(x, weight(e["ffn"], hidden), transpose_b=True))
        x = g.layer_norm(g.add(x, g.matmul(ff, weight(hidden, e["ffn"]), transpose_b=True)),
                         ones, zeros, eps=1e-12)
    out = client.alloc_buffer(batch * tokens * hidden * 4).tensor((batch * tokens, hidden))
    g.cont(x, out=out)
    return g, out


def _runner(client: Client, handle: Any) -> Callable[[], float]:
    return lambda: elapsed(lambda: client.run(handle))


def encoder_rows(ctx: BenchContext, gpu: Client, cpu: Client) -> list[CaseResult]:
    reps = ctx.reps(9, 3)
    runners: dict[str, Callable[[], float]] = {}
    outputs = []
    for name, client in (("gpu", gpu), ("cpu", cpu)):
        g, out = encoder_graph(client, np.random.default_rng(3))
        runners[name] = _runner(client, client.register(g))
        outputs.append(out)
    with ctx.progress(reps, "gpu encoder") as bar:
        s = interleave(runners, reps, bar)
    np.testing.assert_allclose(gpu.get_tensor(outputs[0]), cpu.get_tensor(outputs[1]),
                               rtol=1e-2, atol=1e-2)
    e = ENCODER
    return [CaseResult("gpu", "gpu encoder batches", "batches/s", [1 / t for t in s["gpu"]],
                       {"cpu worker (1 thread)": [1 / t for t in s["cpu"]]}, None,
                       higher_is_better=True,
                       note=f"{e['layers']} layers, hidden {e['hidden']}, {e['heads']} heads, "
                            f"{e['tokens']} tokens x batch {e['batch']}, one run(h) per batch")]


# ---------------------------------------------------------------------------------- llm


def llm_rows(ctx: BenchContext, gpu: Client, cpu: Client) -> list[CaseResult]:
    try:
        from ..client.gguf_model import default_model_path
        default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        print(f"gpu llm: skipped ({exc})")
        return []
    from .bench_llm import measure
    one = measure("1 cuda worker", [gpu], ctx, weights="f32")
    split = measure("cuda + cpu workers", [gpu, cpu], ctx, weights="f32")
    cpu_f32 = measure("1 cpu worker f32", [cpu], ctx, weights="f32")
    cpu_q = measure("1 cpu worker quantized", [cpu], ctx)
    base = {"cpu worker f32": cpu_f32, "cpu worker quantized": cpu_q}
    rows = []
    for placement in (one, split):
        for label, attr in (("prefill 128", "prefill128"), ("decode", "generate")):
            rows.append(CaseResult(
                "gpu", f"gpu llm {label} {placement.name}", "tokens/s",
                getattr(placement, attr), {k: getattr(v, attr) for k, v in base.items()}, None,
                higher_is_better=True, note="SmolLM2-135M, f32 weights dequantized at load"))
    return rows


if __name__ == "__main__":
    print(cuda_unavailable() or "cuda is usable", file=sys.stderr)
