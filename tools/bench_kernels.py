"""``zmq-rpc-bench`` case ``kernels``: the packed quantized kernels against memory bandwidth and BLAS.

For every packed qtype, on weights shaped like SmolLM2-135M's 30 layers (Q/K/V and gate/up fused:
(960, K), (576, K), (3072, K), (576, 1536), K = 576, or 768 for the K-quants whose rows must be
multiples of 256), in one child process per thread count (``--threads``, BLAS pinned to the same
count), repetitions interleaved:

- decode: one matrix-vector product per matrix; GB/s of the packed weight bytes it reads
  (``layout.read_row_bytes``: q4_0/q4_1/q8_0 leave the room after their float16 scales unread), against a plain
  numpy copy of as many bytes (the memory bandwidth; target >= 0.5x) and against numpy float32
  ``dot`` on the dequantized matrices (the f32 mode's work);
- prefill: 32 and 128 activation rows through 4 layers (the block types: the integer GEMM, q5_x and
  the K-quants unpacked per 16 rows; f16/bf16: AMX tiles, or an FMA GEMM without AMX) against float32
  ``matmul`` on the dequantized matrices (target >= 1x: "no slower than f32 mode");
- the first compile of a type's kernels (a fresh numba cache) and the load of the same from cache.

Runs in the bench's main thread; its children are waited for.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..worker.cli import blas_env
from .bench import BenchContext, CaseResult, Target, register_case

LAYERS = 30
PREFILL_LAYERS = 4
COMPILE_TYPES = ("q4_1", "q4_k")


def shapes(qtype: str, layers: int) -> list[tuple[int, int]]:
    """SmolLM2's matmul weights (rows, inputs), K padded to 768 where rows must hold 256-blocks."""
    from ..worker import kernels
    k = 768 if kernels.PACKED[qtype][0] == 256 else 576
    return [(960, k), (576, k), (3072, k), (576, 1536)] * layers


def random_gguf(rng: np.random.Generator, qtype: str, rows: int, k: int) -> np.ndarray:
    """A GGUF weight with random quants and ordinary float16 scales."""
    from ..worker import kernels
    if qtype in ("f16", "bf16"):
        values = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
        return values.astype(np.float16) if qtype == "f16" else (values.view(np.uint32) >> 16).astype(np.uint16)
    per_block, block_bytes, _ = kernels.PACKED[qtype]
    data = rng.integers(0, 256, (rows, k // per_block, block_bytes), dtype=np.uint8)
    scale = (rng.random((rows, k // per_block)) * 0.01).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    offsets = (208,) if qtype == "q6_k" else (0, 2) if qtype in ("q4_1", "q5_1", "q4_k", "q5_k") else (0,)
    for offset in offsets:
        data[..., offset:offset + 2] = scale
    return data.reshape(rows, -1)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleave(runners: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    for run in runners.values():
        run()
    out: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, run in runners.items():
            out[name].append(run())
    return out


def measure_type(qtype: str, reps: int, rng: np.random.Generator) -> dict[str, list[float]]:
    """Samples (GB/s for decode, tokens/s for prefill) of one qtype, kernels and baselines."""
    from ..worker import kernels
    from ..worker.kernels.layout import read_row_bytes
    gguf = [random_gguf(rng, qtype, r, k) for r, k in shapes(qtype, LAYERS)]
    packed = [kernels.pack(w, qtype) for w in gguf]
    kernels.warm(qtype)
    dense = [kernels.dequantize(w, qtype, k) for w, (_, k) in zip(packed, shapes(qtype, LAYERS))]
    del gguf
    nbytes = sum(w.shape[0] * read_row_bytes(qtype, k) for w, (_, k) in zip(packed, shapes(qtype, LAYERS)))
    src = np.frombuffer(rng.bytes(nbytes), np.uint8)
    dst = np.empty_like(src)
    xs = [rng.standard_normal((1, w.shape[1]), dtype=np.float32) for w in dense]
    outs = [np.empty((1, w.shape[0]), np.float32) for w in dense]

    def kernel() -> None:
        for w, x, y in zip(packed, xs, outs):
            kernels.matmul(x, w, qtype, y)

    def dot() -> None:
        for w, x in zip(dense, xs):
            w.dot(x[0])

    times = _interleave({"kernel": lambda: _timed(kernel), "copy": lambda: _timed(lambda: np.copyto(dst, src)),
                         "f32 dot": lambda: _timed(dot)}, reps)
    result = {f"mv {name}": [nbytes / t / 1e9 for t in ts] for name, ts in times.items()}
    result["mv f32 dot"] = [4 * sum(w.size for w in dense) / t / 1e9 for t in times["f32 dot"]]
    result["mv seconds"] = times["kernel"]
    result["mv f32 dot seconds"] = times["f32 dot"]
    n = PREFILL_LAYERS * 4
    for tokens in (32, 128):
        xs_t = [rng.standard_normal((tokens, w.shape[1]), dtype=np.float32) for w in dense[:n]]
        outs_t = [np.empty((tokens, w.shape[0]), np.float32) for w in dense[:n]]

        def tiles(xs_t: list[np.ndarray] = xs_t, outs_t: list[np.ndarray] = outs_t) -> None:
            for w, x, y in zip(packed[:n], xs_t, outs_t):
                kernels.matmul(x, w, qtype, y)

        def f32(xs_t: list[np.ndarray] = xs_t, outs_t: list[np.ndarray] = outs_t) -> None:
            for w, x, y in zip(dense[:n], xs_t, outs_t):
                np.matmul(x, w.T, out=y)

        t = _interleave({"kernel": lambda: _timed(tiles), "f32": lambda: _timed(f32)}, reps)
        result[f"mm{tokens} kernel"] = [tokens / s for s in t["kernel"]]
        result[f"mm{tokens} f32"] = [tokens / s for s in t["f32"]]
    result["bytes"] = [float(nbytes)]
    return result


def _child(threads: int, reps: int) -> None:
    """``python -m zmq_rpc.tools.bench_kernels THREADS REPS``: every qtype's samples as JSON."""
    from ..worker import kernels
    kernels.set_threads(threads)
    rng = np.random.default_rng(0)
    print(json.dumps({qtype: measure_type(qtype, reps, rng) for qtype in kernels.QTYPES}))


def _compile_child() -> None:
    """``python -m zmq_rpc.tools.bench_kernels compile``: seconds to warm each of COMPILE_TYPES."""
    from ..worker import kernels
    print(json.dumps({qtype: kernels.warm(qtype) for qtype in COMPILE_TYPES}))


def _run(args: list[str], env: dict[str, str]) -> Any:
    child = subprocess.run([sys.executable, "-m", "zmq_rpc.tools.bench_kernels", *args], env=env,
                           capture_output=True, text=True, timeout=1800)
    if child.returncode != 0:
        raise RuntimeError(f"kernels bench child failed: {child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _prefill_method(qtype: str) -> str:
    """What a prefill product of ``qtype`` runs here (the row's note)."""
    from ..worker import kernels
    from ..worker.kernels.layout import INTERLEAVED
    if qtype in kernels.HALF_GEMM:
        from ..worker.kernels import amxgemm
        return "AMX bf16 tiles, 3-level x" if amxgemm.available() else "FMA GEMM on 16-bit weights"
    if qtype not in kernels.INTEGER_GEMM:
        return "tile dequantization + BLAS"
    return "int8 GEMM" if qtype in INTERLEAVED else "int8 GEMM, codes unpacked per 16 rows"


def type_rows(qtype: str, s: dict[str, list[float]], threads: int) -> list[CaseResult]:
    tag = f"{qtype} {threads}t"
    mb = s["bytes"][0] / 1e6
    return [
        CaseResult("kernels", f"kernels mv {tag}", "GB/s", s["mv kernel"], {"numpy copy": s["mv copy"]},
                   Target(0.5, True), True,
                   note=f"{mb:.0f} MB read, 120 mat-vecs; {statistics.median(s['mv seconds']) * 1e3:.1f} ms"),
        CaseResult("kernels", f"kernels mv {tag} vs f32 dot", "ms", [t * 1e3 for t in s["mv seconds"]],
                   {"numpy f32 dot": [t * 1e3 for t in s["mv f32 dot seconds"]]}, Target(1.0, False), False,
                   note="the same products on dequantized float32 weights (f32 mode's work)"),
        *(CaseResult("kernels", f"kernels prefill {n} {tag}", "tok/s", s[f"mm{n} kernel"],
                     {"f32 matmul": s[f"mm{n} f32"]}, Target(1.0, True), True,
                     note=f"{PREFILL_LAYERS} layers, {_prefill_method(qtype)}")
          for n in (32, 128)),
    ]


@register_case("kernels", "packed quantized kernels: GB/s vs copy and f32 dot, prefill vs f32 matmul")
def case_kernels(ctx: BenchContext) -> list[CaseResult]:
    from ..worker import kernels
    if not kernels.available():
        print("kernels: skipped (numba is not installed)")
        return []
    reps = ctx.reps(7, 3)
    out = []
    for threads in (1, 2):
        env = {**os.environ, **blas_env(threads)}
        samples = _run([str(threads), str(reps)], env)
        out += [row for qtype in kernels.QTYPES for row in type_rows(qtype, samples[qtype], threads)]
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        cold, cached = _run(["compile"], env), _run(["compile"], env)
    for qtype in COMPILE_TYPES:
        out.append(CaseResult("kernels", f"kernels compile {qtype}", "s", [cold[qtype]],
                              {"from cache": [cached[qtype]]}, None, False,
                              note="first worker start on a machine (empty numba cache) vs every later one"))
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["compile"]:
        _compile_child()
    else:
        _child(int(sys.argv[1]), int(sys.argv[2]))
