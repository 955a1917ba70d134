"""Loading a llama's weights onto its stages' workers: GGUF staging, upload, resident layout.

Loading sends the weights in their compact GGUF form (Q4_1 layers, Q8_0 ``token_embd``, f32 norms)
as the file lays them out: each stage's tensors form a few contiguous ranges of the mapped file
(:func:`file_runs`), sent zero-copy in chunk-sized messages into one staging buffer per worker. One
graph per stage then lays them out there as the stage graphs read them (Q/K/V and gate/up
stacked where the :class:`~.weights.WeightFormat` can hold them as one matrix, in the form it
says) and the staging buffer is freed.

Nothing waits between those steps: a worker runs a session's requests in the order they were
sent, so :meth:`WeightLoader.start` issues every stage's allocations, fills and build at once (the
workers' round trips and the client's next steps overlap) and :class:`PendingLoad` waits for them.
Only the kernels' preparation is waited for first (its compile may take minutes on a machine's
first load, longer than the other requests' timeout), and a cache's lookups (the misses are
uploaded next).

Runs on the caller's thread; it blocks on the requests' futures only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..client import RemoteBuffer, RemoteTensor
from ..gguf_model import GGUFTensor, LlamaGGUF
from ..graph import Graph
from .plan import (
    Stage,
    head_tensor,
    layer_small_tensors,
    layer_tensor,
    stage_sources,
    vocab_tables,
)
from .source import StageSource, WeightSource
from .staged import Staged
from .weights import LayerWeights, Product, StackedLinear, WeightFormat

__all__ = ["ALIGN", "KERNEL_TIMEOUT", "Layout", "LoadStats", "PendingLoad", "Progress",
           "WeightLoader", "file_runs", "staging_places"]

ALIGN = 64
"""Byte alignment of each tensor group placed in a worker buffer."""

KERNEL_TIMEOUT = 900.0
"""Seconds a worker may take to prepare the kernels of a model's weight types: their first compile
on a machine (numba, ~5-15 s per type on 2 loaded cores, 10 types ~40 s of CPU) must not meet
the client's request timeout (a dead or frozen worker is still noticed in seconds: heartbeats)."""

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)`` during the weight upload."""


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What loading cost: bytes and seconds of the upload and of the worker-side build."""

    weight_bytes: int
    """Unique weight bytes of the model in compact form (each tensor counted once)."""
    upload_bytes: int
    """Weight bytes sent over the network: the uploaded file ranges (each tensor once, with any
    alignment padding) and the cache misses; nothing for stages read from the worker's file."""
    resident_bytes: int
    """Weight bytes held on all workers (f32 matmul weights in ``weights="f32"`` mode)."""
    kv_bytes: int
    upload_seconds: float
    """From the first allocation to the last weight byte in place (uploaded, read from the
    worker's file or its cache)."""
    build_seconds: float
    """The workers laying the uploaded bytes out as resident weights (dequantizing in f32 mode)."""
    total_seconds: float
    """The whole load: kernels, upload, build, KV cache and graph registration (until the first
    step may run)."""
    sources: tuple[StageSource, ...] = ()
    """Where each worker's weights came from (its file, its cache, an upload), in stage order."""
    kernel_seconds: float = 0.0
    """Preparing the workers' numba kernels before the upload: their compile on a machine's first
    load (seconds per type), else loading them from numba's on-disk cache (milliseconds)."""

    def source_summary(self) -> str:
        """One line per worker: its source and the bytes that crossed the network for it."""
        return "\n".join(s.describe() for s in self.sources)

    @property
    def upload_gbps(self) -> float:
        """Effective upload rate in GB/s (10**9 bytes)."""
        return self.upload_bytes / max(self.upload_seconds, 1e-9) / 1e9


def file_runs(tensors: Iterable[GGUFTensor], alignment: int) -> list[tuple[int, int]]:
    """The fewest contiguous byte ranges ``[start, stop)`` of the file covering ``tensors``:
    neighbours merge when only alignment padding (under ``alignment`` bytes) lies between them."""
    runs: list[list[int]] = []
    for t in sorted({t.name: t for t in tensors}.values(), key=lambda t: t.offset):
        if runs and 0 <= t.offset - runs[-1][1] < alignment:
            runs[-1][1] = t.offset + t.nbytes
        else:
            runs.append([t.offset, t.offset + t.nbytes])
    return [(lo, hi) for lo, hi in runs]


def staging_places(gguf: LlamaGGUF, sources: Sequence[GGUFTensor]
                   ) -> tuple[list[tuple[int, int, int]], int]:
    """Where ``sources``' file ranges go in a staging buffer: ``(lo, hi, offset)`` per range of
    the file (:func:`file_runs`), each ``ALIGN``-aligned, and the buffer's size."""
    placed, size = [], 0
    for lo, hi in file_runs(sources, gguf.alignment):
        size = -(-size // ALIGN) * ALIGN
        placed.append((lo, hi, size))
        size += hi - lo
    return placed, size


class Layout:
    """Places tensors one after another in one buffer, each ``ALIGN``-aligned."""

    def __init__(self) -> None:
        self.size = 0
        self.places: list[tuple[str, tuple[int, ...], str, int]] = []

    def add(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        """Reserve ``name`` at the next aligned offset."""
        self.size = -(-self.size // ALIGN) * ALIGN
        self.places.append((name, shape, dtype, self.size))
        self.size += math.prod(shape) * np.dtype(dtype).itemsize

    def bind(self, buffer: RemoteBuffer) -> dict[str, RemoteTensor]:
        """The placed tensors as RemoteTensors of ``buffer``."""
        return {name: buffer.tensor(shape, dtype, offset)
                for name, shape, dtype, offset in self.places}


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :meth:`WeightLoader.load` sent and how long the two phases took."""

    upload_bytes: int
    upload_seconds: float
    build_seconds: float
    sources: tuple[StageSource, ...] = ()
    kernel_seconds: float = 0.0


@dataclass(eq=False)
class PendingLoad:
    """A load whose requests are all issued; :meth:`finish` waits for them."""

    started: float
    kernel_seconds: float
    layout_line: str
    """The status line of the build phase."""
    uploads: dict[Future[Any], int] = field(default_factory=dict)
    """Each uploaded piece's acknowledgement and its bytes (the progress counts them)."""
    fills: list[Future[Any]] = field(default_factory=list)
    """The other fills: the workers' file reads, the cache misses' uploads."""
    builds: list[Future[Any]] = field(default_factory=list)
    sources: list[StageSource] = field(default_factory=list)
    upload_bytes: int = 0

    uploaded: float = 0.0

    def finish(self, progress: Progress | None = None,
               status: Callable[[str], None] | None = None) -> Loaded:
        """:meth:`wait_fills`, then :meth:`wait_builds`."""
        self.wait_fills(progress, status)
        return self.wait_builds()

    def wait_fills(self, progress: Progress | None = None,
                   status: Callable[[str], None] | None = None) -> None:
        """Wait for the fills (``progress`` as the upload's acknowledgements arrive); the first
        failure is raised. ``status``: the line of the build phase, once they are in."""
        total, done = sum(self.uploads.values()), 0
        if progress is not None:
            progress(0, total)
        for future in as_completed(self.uploads):
            future.result()
            done += self.uploads[future]
            if progress is not None:
                progress(done, total)
        for future in self.fills:
            future.result()
        self.uploaded = time.perf_counter()
        if status is not None:
            status(self.layout_line)

    def wait_builds(self) -> Loaded:
        """Wait for the builds (after :meth:`wait_fills`); the first failure is raised."""
        for future in self.builds:
            future.result()
        return Loaded(self.upload_bytes, self.uploaded - self.started,
                      time.perf_counter() - self.uploaded, tuple(self.sources),
                      self.kernel_seconds)


class WeightLoader:
    """Puts each stage's weights on its worker in format ``fmt`` (fills ``Stage.weights``,
    ``embd``, ``out_norm``, ``lm_head`` and ``buffers``)."""

    def __init__(self, gguf: LlamaGGUF, fmt: WeightFormat,
                 source: WeightSource | None = None) -> None:
        self.gguf = gguf
        self.fmt = fmt
        self.source = source or WeightSource(gguf, "upload")

    def load(self, stages: Sequence[Stage], progress: Progress | None = None,
             status: Callable[[str], None] | None = None) -> Loaded:
        """Stage each worker's file ranges, fill them from the best source the worker offers
        (its file, its cache, an upload), then build its resident weights there."""
        return self.start(stages, status).finish(progress, status)

    def start(self, stages: Sequence[Stage],
              status: Callable[[str], None] | None = None) -> PendingLoad:
        """Prepare the kernels (waited for), then issue every stage's staging buffer, fills and
        build without waiting: the stages' weights are bound (``Stage.weights`` ...), so graphs
        reading them may be registered before :meth:`PendingLoad.finish`."""
        kernel_seconds = self._prepare_kernels(stages, status)
        pending = PendingLoad(time.perf_counter(), kernel_seconds,
                              f"laying out weights ({self.fmt}) on {len(stages)} worker(s)")
        staged = [self._stage_file_ranges(stage) for stage in stages]
        self._fill(staged, pending)
        pending.builds = [f for s in staged for f in self._build_resident(s)]
        return pending

    def _prepare_kernels(self, stages: Sequence[Stage], status: Callable[[str], None] | None
                         ) -> float:
        """Make each worker compile (or load from numba's on-disk cache) the kernels its weights
        need, before anything else is sent to it: one ``pack`` of one row per type, in a request
        allowed :data:`KERNEL_TIMEOUT` seconds. A cold cache costs seconds per type, once per
        machine; a warm one about a millisecond. Seconds until every worker is ready."""
        start = time.perf_counter()
        futures: list[Future[Any]] = []
        buffers: list[RemoteBuffer] = []
        for stage in stages:
            samples: dict[str, GGUFTensor] = {}
            for t in stage_sources(self.gguf, stage):
                samples.setdefault(t.qtype, t)
            wanted = sorted(self.fmt.kernel_qtypes(samples))
            if not wanted:
                continue
            if status is not None:
                status(f"preparing the {', '.join(wanted)} kernels on {stage.client.endpoint} "
                       "(compiled on a machine's first load: seconds per type)")
            layout = Layout()
            for q in wanted:
                layout.add(q, (1, samples[q].data.shape[1]), str(samples[q].data.dtype))
            buffer = stage.client.alloc_buffer_nowait(layout.size)
            g = Graph()
            for q, tensor in layout.bind(buffer).items():
                g.pack(tensor, qtype=q)
            futures.append(stage.client.compute_async(g, timeout=KERNEL_TIMEOUT))
            buffers.append(buffer)
        errors = [future.exception() for future in futures]
        # Freed once the compiles are done: queued behind a compile, a free would meet its own
        # request timeout first, and the load would fail on a machine's first compile.
        frees = [buffer.free_async() for buffer in buffers]
        for error in errors:
            if error is not None:
                raise error
        for free in frees:
            free.result()
        return time.perf_counter() - start if futures else 0.0

    def _fill(self, staged: Sequence[Staged], pending: PendingLoad) -> None:
        """Issue the fill of every staging buffer (into ``pending``): how each stage is filled,
        the requests, the bytes sent."""
        picks = [self.source.pick(s) for s in staged]
        lookups = {}
        for s, (source, _) in zip(staged, picks):
            if source == "file":
                pending.fills.append(self.source.from_file(s))
            elif source == "cache":
                lookups[id(s)] = self.source.cache_lookups(s)
            elif source == "upload":
                pending.uploads.update(self._upload(s.uploads))
        pending.upload_bytes = sum(pending.uploads.values())
        for s, (source, note) in zip(staged, picks):
            endpoint = s.stage.client.endpoint
            if source == "cache":
                futures, hits, nbytes = self.source.upload_misses(lookups[id(s)])
                pending.fills += futures
                pending.upload_bytes += nbytes
                pending.sources.append(StageSource(endpoint, source, nbytes, hits,
                                                   len(lookups[id(s)]) - hits, note))
            else:
                nbytes = sum(int(d.nbytes) for t, d in s.uploads) if source == "upload" else 0
                pending.sources.append(StageSource(endpoint, source, nbytes, note=note))

    def _stage_file_ranges(self, stage: Stage) -> Staged:
        """Allocate a staging buffer holding the stage's tensors as the file lays them out, and
        the uploads that fill it: few contiguous ranges of the mapped file, zero-copy, cut into
        pieces of one message each."""
        sources = stage_sources(self.gguf, stage)
        placed, size = staging_places(self.gguf, sources)
        buffer = stage.client.alloc_buffer_nowait(size)
        staged = Staged(stage, buffer)
        for t in sources:
            lo, _, at = next(run for run in placed if run[0] <= t.offset < run[1])
            staged.tensors[t.name] = buffer.tensor(t.data.shape, t.data.dtype, at + t.offset - lo)
        piece = stage.client.chunk_bytes
        for lo, hi, at in placed:
            for start in range(lo, hi, piece):
                stop = min(start + piece, hi)
                staged.uploads.append((buffer.tensor(stop - start, "uint8", at + start - lo),
                                       self.gguf.file_bytes[start:stop]))
        return staged

    @staticmethod
    def _upload(uploads: list[tuple[RemoteTensor, np.ndarray]]) -> dict[Future[Any], int]:
        """Pipelined set_tensor_async of every piece: each acknowledgement and its bytes."""
        return {t.client.set_tensor_async(t, data): int(data.nbytes) for t, data in uploads}

    def _build_resident(self, staged: Staged) -> list[Future[Any]]:
        """One compute graph on the stage's worker lays the staged bytes out as the weights the
        stage graphs read; then the staging buffer is freed (queued behind the build on the same
        worker)."""
        stage = staged.stage
        layout, fills = self._resident_layout(stage)
        buffer = stage.client.alloc_buffer_nowait(layout.size)
        stage.buffers.append(buffer)
        placed = layout.bind(buffer)
        g = Graph()
        for name, sources in fills:
            qtypes = [self.gguf.tensors[s].qtype for s in sources]
            if qtypes[0] == "f32":                  # norms, biases (stacked), rope factors
                self._fill_vectors(g, [staged.tensors[s] for s in sources], placed[name])
            else:
                self.fmt.fill(g, [staged.tensors[s] for s in sources], qtypes, placed[name])
        built = stage.client.compute_async(g)
        self._bind_weights(stage, placed)
        return [built, staged.buffer.free_async()]

    @staticmethod
    def _fill_vectors(g: Graph, sources: list[RemoteTensor], dst: RemoteTensor) -> None:
        """float32 vectors copied one after another into ``dst``."""
        at = 0
        for src in sources:
            n = src.shape[0]
            g.cpy(src, dst[at:at + n] if len(sources) > 1 else dst)
            at += n

    def _groups(self, layer: int, parts: Sequence[str]) -> list[list[GGUFTensor]]:
        """The resident matrices of one fused linear: its GGUF tensors in runs the format
        stacks as one (all of them, unless their types or row sizes differ)."""
        return self.fmt.groups([layer_tensor(self.gguf, layer, p) for p in parts])

    def _resident_layout(self, stage: Stage) -> tuple[Layout, list[tuple[str, list[str]]]]:
        """Where each resident weight goes, and the GGUF tensors (stacked by rows) filling it:
        per layer its float32 vectors (norms; the Q/K/V biases stacked as one), then its
        products' matrices; on the last stage the vocabulary tables and the output norm."""
        cfg, fmt = self.gguf.config, self.fmt
        layout, fills = Layout(), []
        for i in stage.layers:
            vectors = layer_small_tensors(cfg)
            biases = [v for v in vectors if v.endswith(".bias")]
            for v in (v for v in vectors if v.endswith(".weight")):
                name = f"{i}.{v.removesuffix('.weight')}"
                layout.add(name, self.gguf.tensors[f"blk.{i}.{v}"].shape, "float32")
                fills.append((name, [f"blk.{i}.{v}"]))
            if biases:
                sources = [f"blk.{i}.{b}" for b in biases]
                rows = sum(self.gguf.tensors[b].shape[0] for b in sources)
                layout.add(f"{i}.qkv_bias", (rows,), "float32")
                fills.append((f"{i}.qkv_bias", sources))
            for name, parts in cfg.spec.fused.items():
                for j, tensors in enumerate(self._groups(i, parts)):
                    rows = sum(t.data.shape[0] for t in tensors)
                    layout.add(f"{i}.{name}.{j}", fmt.resident_shape(tensors[0], rows), fmt.dtype)
                    fills.append((f"{i}.{name}.{j}", [t.name for t in tensors]))
        if cfg.rope_freqs:
            layout.add("rope_freqs", (cfg.rope_dims // 2,), "float32")
            fills.append(("rope_freqs", ["rope_freqs.weight"]))
        if stage.last:
            for name in vocab_tables(self.gguf):
                t = self.gguf.tensors[name]
                layout.add(name, fmt.resident_shape(t, t.data.shape[0]), fmt.dtype)
                fills.append((name, [name]))
            layout.add("output_norm", (cfg.d_model,), "float32")
            fills.append(("output_norm", ["output_norm.weight"]))
        return layout, fills

    def _bind_weights(self, stage: Stage, placed: dict[str, RemoteTensor]) -> None:
        fmt, cfg = self.fmt, self.gguf.config
        vectors = [v.removesuffix(".weight") for v in layer_small_tensors(cfg)
                   if v.endswith(".weight")] + (["qkv_bias"] if cfg.qkv_bias else [])
        for i in stage.layers:
            linear = {name: self._product(placed, i, name, parts)
                      for name, parts in cfg.spec.fused.items()}
            extra = {v: placed[f"{i}.{v}"] for v in vectors}
            stage.weights.append(LayerWeights(extra.pop("attn_norm"), extra.pop("ffn_norm"),
                                              linear, extra))
        stage.rope_freqs = placed.get("rope_freqs")
        if stage.last:
            embd = self.gguf.tensors["token_embd.weight"]
            stage.embd = fmt.linear(placed["token_embd.weight"], embd.qtype)
            stage.out_norm = placed["output_norm"]
            head = head_tensor(self.gguf)
            stage.lm_head = fmt.linear(placed[head.name], head.qtype)

    def _product(self, placed: dict[str, RemoteTensor], layer: int, name: str,
                 parts: Sequence[str]) -> Product:
        """Fused linear ``name`` of ``layer``: one matmul when its parts stack as one resident
        matrix (the usual case: no cost), else one per run, their products concatenated."""
        linears = tuple(self.fmt.linear(placed[f"{layer}.{name}.{j}"], tensors[0].qtype)
                        for j, tensors in enumerate(self._groups(layer, parts)))
        return linears[0] if len(linears) == 1 else StackedLinear(linears)
