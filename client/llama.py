"""A llama GGUF model run across zmq-rpc workers: a pipeline of contiguous layer ranges.

Owns everything model-shaped on top of the graph API: splitting the layers into stages (one per
:class:`~zmq_rpc.client.Client`, balanced by resident weight bytes), loading the weights, the KV
cache that lives on the workers, the forward graphs (per stage one registered graph per mode:
``decode`` for 1 token, ``prefill`` and ``full`` for a fixed chunk of T tokens), the per-step
pipeline, and sampling.

Loading sends the weights in their compact GGUF form (Q4_1 layers, Q8_0 ``token_embd``, f32 norms)
as the file lays them out: each stage's tensors form a few contiguous ranges of the mapped file,
sent zero-copy in chunk-sized messages into one staging buffer per worker. One graph per stage then
lays them out there as the stage graphs read them (Q/K/V and gate/up stacked; dequantized to f32
in the default ``weights="f32"`` mode) and the staging buffer is freed. The input embedding runs
here, on the mapped file (as llama.cpp keeps the input layer on the host): the first stage is fed
(T, d_model) rows and holds no embedding table; ``token_embd`` lives on the last stage only, as
the tied LM head and to embed the token it picks for chained greedy decoding.

One step of the pipeline, one client round trip (with worker-to-worker copies)::

    client ── run(stage 0: x, pos, mask) ──> worker A ── x (T, 576) ──> worker B
           <── logits or argmax (4 bytes) ─── run(stage 1: pos, mask) <──────┘

Each stage's run carries the step's small inputs (embeddings, positions, the additive attention
mask) in its own message and the last stage's reply carries the fetched result, so the graphs
keep fixed shapes across steps: attention always reads the whole cache (``n_ctx`` rows) and the
mask hides the rows past each query's position. Row ``n_ctx`` of every cache is a scratch row
that the padding tokens of a partial prefill chunk write to. Chained greedy decoding copies the
last stage's picked-token embedding (``x_next``) straight to the first stage's input.

Threads: the caller's thread builds and launches steps and blocks only on a step's final result;
the continuation of a step (the hand-off to the next stage when it goes through this client)
runs in done-callbacks on the clients' I/O threads and only issues requests. A model is used by
one thread at a time.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..broker import quant
from ..broker.errors import RpcError
from ..broker.ops import QUANT_BLOCKS
from .client import Client, RegisteredGraph, RemoteBuffer, RemoteTensor
from .gguf_model import (
    GGUFTensor,
    LlamaConfig,
    LlamaGGUF,
    default_model_path,
    load_gguf,
)
from .graph import Graph, GraphTensor
from .peer import HandOff, hand_off

__all__ = ["LlamaModel", "LoadStats", "StepStat", "plan_stages", "sample_token"]

log = logging.getLogger("zmq_rpc.client.llama")

WeightsMode = Literal["f32", "quantized"]
KVDType = Literal["float32", "float16"]
Mode = Literal["decode", "prefill", "full"]
Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)`` during the weight upload."""

ALIGN = 64
"""Byte alignment of each tensor group placed in a worker buffer."""


# ------------------------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What loading cost: bytes and seconds of the upload and of the worker-side build."""

    weight_bytes: int
    """Unique weight bytes of the model in compact form (each tensor counted once)."""
    upload_bytes: int
    """Bytes sent: the stages' file ranges (each tensor once, with any alignment padding)."""
    resident_bytes: int
    """Weight bytes held on all workers (f32 matmul weights in ``weights="f32"`` mode)."""
    kv_bytes: int
    upload_seconds: float
    """From the first allocation to the last uploaded byte acknowledged."""
    build_seconds: float
    """The workers laying the uploaded bytes out as resident weights (dequantizing in f32 mode)."""
    total_seconds: float

    @property
    def upload_gbps(self) -> float:
        """Effective upload rate in GB/s (10**9 bytes)."""
        return self.upload_bytes / max(self.upload_seconds, 1e-9) / 1e9


@dataclass(frozen=True, slots=True)
class StepStat:
    """One step as the client saw it: wall time from launch to the final result."""

    mode: Mode
    tokens: int
    seconds: float
    messages: int
    """Requests issued for the step (runs and hand-offs)."""
    compute: float = 0.0
    """Seconds the workers spent running the step's graphs, as they reported it."""


# ------------------------------------------------------------------------------------ planning


def plan_stages(layer_bytes: Sequence[int], first_extra: int, last_extra: int,
                n_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, minimizing the largest stage's bytes.

    ``first_extra`` bytes sit on the first stage and ``last_extra`` on the last (both on one
    stage when there is only one). Every stage gets at least one layer.
    """
    n = len(layer_bytes)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages for {n} layers: need 1 <= stages <= layers")
    prefix = np.concatenate([[0], np.cumsum(layer_bytes)]).tolist()

    def cost(lo: int, hi: int, stage: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)
        return int(prefix[hi] - prefix[lo]) + extra

    best = _split_table(n, n_stages, cost)
    return _read_splits(best, n, n_stages)


def _split_table(n: int, n_stages: int, cost: Callable[[int, int, int], int]
                 ) -> list[list[tuple[float, int]]]:
    """DP: best[s][i] = (max stage cost, split) placing layers [0, i) on stages [0, s]."""
    best = [[(math.inf, 0)] * (n + 1) for _ in range(n_stages)]
    for i in range(1, n + 1):
        best[0][i] = (cost(0, i, 0), 0)
    for s in range(1, n_stages):
        for i in range(s + 1, n + 1):
            best[s][i] = min((max(best[s - 1][j][0], cost(j, i, s)), j) for j in range(s, i))
    return best


def _read_splits(best: list[list[tuple[float, int]]], n: int, n_stages: int) -> list[range]:
    bounds, hi = [], n
    for s in range(n_stages - 1, -1, -1):
        lo = best[s][hi][1] if s else 0
        bounds.append(range(lo, hi))
        hi = lo
    return bounds[::-1]


# ------------------------------------------------------------------------------------- sampling


def sample_token(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 rng: np.random.Generator | None = None) -> int:
    """Pick a token from ``logits`` (vocab,): argmax when ``temperature <= 0``, else sample
    from the softmax of ``logits / temperature`` restricted to the ``top_k`` best (0: all) and to
    the smallest set whose probability reaches ``top_p``."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = np.asarray(logits, np.float64) / temperature
    if 0 < top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return int((rng or np.random.default_rng()).choice(probs.size, p=probs))


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs)
    keep = order[before < top_p]
    kept[keep] = probs[keep]
    kept /= kept.sum()
    return kept


# ---------------------------------------------------------------------------- buffer layout


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


class _Layout:
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
class _Linear:
    """A weight (out, in) used as ``x @ W.T``: f32, or ggml blocks with their qtype."""

    tensor: RemoteTensor
    qtype: str = "none"


def _linear(g: Graph, x: Any, w: _Linear, out: RemoteTensor | None = None) -> GraphTensor:
    if w.qtype == "none":
        return g.matmul(x, w.tensor, transpose_b=True, out=out)
    return g.mul_mat_q(x, w.tensor, qtype=w.qtype, out=out)


# Per layer: the fused linear weights and the GGUF tensors stacked (by rows) into each.
_FUSED = {"qkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",),
          "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}
_NORMS = ("attn_norm", "ffn_norm")


@dataclass
class _LayerWeights:
    attn_norm: RemoteTensor
    ffn_norm: RemoteTensor
    linear: dict[str, _Linear]


@dataclass
class _ModeIO:
    """One stage's step tensors for one mode (inputs, hand-off ends, outputs)."""

    pos: RemoteTensor | None = None
    mask: RemoteTensor | None = None
    last_idx: RemoteTensor | None = None
    x_in: RemoteTensor | None = None
    x_out: RemoteTensor | None = None
    logits: RemoteTensor | None = None
    token: RemoteTensor | None = None
    x_next: RemoteTensor | None = None
    """The picked token's embedding, the next chained step's first input."""


@dataclass(eq=False)
class _Stage:
    """One worker's share: its layers, weights, KV cache, and per-mode I/O and graphs."""

    index: int
    client: Client
    layers: range
    first: bool
    last: bool
    buffers: list[RemoteBuffer] = field(default_factory=list)
    weights: list[_LayerWeights] = field(default_factory=list)
    embd: _Linear | None = None
    out_norm: RemoteTensor | None = None
    lm_head: _Linear | None = None
    kv: list[tuple[RemoteTensor, RemoteTensor]] = field(default_factory=list)
    kv_buffer: RemoteBuffer | None = None
    io: dict[str, _ModeIO] = field(default_factory=dict)
    graphs: dict[str, RegisteredGraph] = field(default_factory=dict)


@dataclass(eq=False)
class _Staged:
    """A stage's staging buffer during load: the GGUF tensors in it, the uploads filling it."""

    stage: _Stage
    buffer: RemoteBuffer
    tensors: dict[str, RemoteTensor] = field(default_factory=dict)
    uploads: list[tuple[RemoteTensor, np.ndarray]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _StageRun:
    stage: _Stage
    inputs: list[tuple[RemoteTensor, np.ndarray]]
    fetch: list[RemoteTensor]


# -------------------------------------------------------------------------------- hand-off


def _messages(h: HandOff) -> int:
    """Requests a hand-off adds to the two linked runs: none worker to worker, a copy on one
    worker, a fetch and a relayed fill through the client."""
    return {"direct": 0, "local": 1, "relay": 2}[h.route]


def _new_future() -> Future[Any]:
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    return future


class _StepFuture:
    """One chunk's trip through the stages: its runs and transfers; its result is the last
    stage's fetch, set once every part has succeeded (the first error otherwise)."""

    def __init__(self) -> None:
        self.future: Future[list[np.ndarray]] = _new_future()
        self.runs: list[Future[Any]] = []
        self.transfers: list[Future[None]] = []
        self.transfer_messages = 0
        self._final: Future[list[np.ndarray]] | None = None
        self._lock = threading.Lock()

    def add_run(self, run: Future[Any], final: bool = False) -> None:
        with self._lock:
            self.runs.append(run)
            if final:
                self._final = run
        run.add_done_callback(self._settle)

    def add_transfer(self, transfer: Future[None], messages: int) -> None:
        with self._lock:
            self.transfers.append(transfer)
            self.transfer_messages += messages
        transfer.add_done_callback(self._settle)

    def add_messages(self, messages: int) -> None:
        """Requests a hand-off added beside the runs (see :func:`_messages`)."""
        with self._lock:
            self.transfer_messages += messages

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if not self.future.done():
                self.future.set_exception(error)

    def compute(self) -> float:
        """Seconds of graph compute the workers reported for this step's runs."""
        return sum(getattr(r.result(), "compute_seconds", 0.0) for r in self.runs
                   if r.done() and r.exception() is None)

    def messages(self) -> int:
        """Requests the step sent: runs, and per hand-off a copy on one worker, or a peer
        receive and send across two."""
        return len(self.runs) + self.transfer_messages

    def _settle(self, _: Future[Any]) -> None:
        with self._lock:
            if self.future.done():
                return
            parts = [*self.runs, *self.transfers]
            failed = next((p.exception() for p in parts
                           if p.done() and p.exception() is not None), None)
            if failed is not None:
                self.future.set_exception(failed)
            elif self._final is not None and self._final.done():
                # The last stage ran on data every earlier run and hand-off produced (its worker
                # fails what queued behind a failed transfer), so its result settles the step;
                # the senders' acknowledgements need not be waited for.
                self.future.set_result(self._final.result())


# ---------------------------------------------------------------------------------- the model


class LlamaModel:
    """A llama GGUF placed on a list of workers as a pipeline (one stage per client).

    Build it with :meth:`load`; then :meth:`prefill`, :meth:`decode`, :meth:`generate`,
    :meth:`forward_full`, :meth:`reset`; :meth:`close` (or ``with``) frees its worker state.
    The clients stay open and belong to the caller.
    """

    def __init__(self, gguf: LlamaGGUF, clients: Sequence[Client], *, n_ctx: int,
                 weights: WeightsMode, kv_dtype: KVDType, prefill_chunk: int) -> None:
        cfg = gguf.config
        if not 1 <= n_ctx <= cfg.context_length:
            raise ValueError(f"n_ctx {n_ctx} must be in [1, {cfg.context_length}]")
        if weights not in ("f32", "quantized") or kv_dtype not in ("float32", "float16"):
            raise ValueError(f"weights must be 'f32' or 'quantized' and kv_dtype 'float32' or "
                             f"'float16', got {weights!r} and {kv_dtype!r}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.gguf = gguf
        self.config: LlamaConfig = cfg
        self.n_ctx = n_ctx
        self.weights: WeightsMode = weights
        self.kv_dtype: KVDType = kv_dtype
        self.prefill_chunk = prefill_chunk
        self.n_past = 0
        self.chain_greedy = True
        """Greedy decoding feeds each token back worker to worker (no client round trip per
        token); False decodes one client round trip per token."""
        self.lookahead = 2
        """Chained greedy steps issued ahead of the one being waited for."""
        self.hold_reply = 0.001
        """Seconds each chained step's stage runs let their worker hold the reply (see
        :meth:`Client.run`): nothing waits on those replies right away, and sent at once
        they wake the broker and this process while the activation is in flight; 0 turns
        it off."""
        self.stats: list[StepStat] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.load_stats: LoadStats | None = None
        self.stages = self._make_stages(list(clients))
        self._pending: list[Future[Any]] = []
        self._closed = False

    # ------------------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path | LlamaGGUF | None, clients: Sequence[Client], *,
             n_ctx: int = 512, weights: WeightsMode = "f32", kv_dtype: KVDType = "float32",
             prefill_chunk: int = 32, progress: Progress | None = None) -> LlamaModel:
        """Load the GGUF at ``path`` (None: :func:`default_model_path`; or an already opened
        :class:`LlamaGGUF`) onto ``clients``.

        One pipeline stage per client, in order. ``weights="f32"`` dequantizes the uploaded
        blocks once on each worker (faster steps, ~5x the memory); ``"quantized"`` keeps them
        compact and dequantizes inside every matmul. ``progress(done, total)`` reports upload
        bytes as they are acknowledged.
        """
        if not clients:
            raise ValueError("need at least one client")
        gguf = path if isinstance(path, LlamaGGUF) else load_gguf(
            path if path is not None else default_model_path())
        model = cls(gguf, clients, n_ctx=n_ctx, weights=weights, kv_dtype=kv_dtype,
                    prefill_chunk=prefill_chunk)
        try:
            model._load(progress)
        except BaseException:
            model.close()
            raise
        return model

    def _make_stages(self, clients: list[Client]) -> list[_Stage]:
        """Layer ranges balanced by the bytes each stage will hold in this weights mode."""
        layer_bytes = [sum(self._resident(self._tensor(i, n)) for names in _FUSED.values()
                           for n in names) for i in range(self.config.n_layers)]
        tables = sum(self._resident(self.gguf.tensors[n]) for n in self._last_stage_tables())
        ranges = plan_stages(layer_bytes, 0, tables, len(clients))
        return [_Stage(i, c, r, first=i == 0, last=i == len(clients) - 1)
                for i, (c, r) in enumerate(zip(clients, ranges))]

    def _resident(self, tensor: GGUFTensor) -> int:
        """Bytes a matmul weight holds on its worker: f32 in f32 mode, else its blocks."""
        if tensor.qtype not in QUANT_BLOCKS:
            raise ValueError(f"{tensor.name}: matmul weights must be one of "
                             f"{sorted(QUANT_BLOCKS)}, not {tensor.qtype}")
        return 4 * tensor.n_elements if self.weights == "f32" else tensor.nbytes

    def _tensor(self, layer: int, name: str) -> GGUFTensor:
        return self.gguf.tensors[f"blk.{layer}.{name}.weight"]

    def _load(self, progress: Progress | None) -> None:
        """Stage each worker's file ranges, then build its resident weights from them there."""
        start = time.perf_counter()
        staged = [self._stage_file_ranges(stage) for stage in self.stages]
        upload_bytes = self._upload([u for s in staged for u in s.uploads], progress)
        uploaded = time.perf_counter()
        builds = [f for s in staged for f in self._build_resident(s)]
        for future in builds:
            future.result()
        built = time.perf_counter()
        for stage in self.stages:
            self._make_kv(stage)
        self._register_all(("decode", "prefill"))
        self._warm_up(("decode", "prefill"))
        self.load_stats = LoadStats(
            weight_bytes=self.gguf.tensor_data_bytes, upload_bytes=upload_bytes,
            resident_bytes=sum(b.size for s in self.stages for b in s.buffers),
            kv_bytes=sum(s.kv_buffer.size for s in self.stages if s.kv_buffer is not None),
            upload_seconds=uploaded - start, build_seconds=built - uploaded,
            total_seconds=time.perf_counter() - start)

    def _stage_sources(self, stage: _Stage) -> list[GGUFTensor]:
        """The GGUF tensors a stage holds: its layers', and the head's on the last stage (with
        ``token_embd``, which also embeds the token it picked, for chained decoding)."""
        names = [f"blk.{i}.{part}.weight" for i in stage.layers
                 for part in (*_NORMS, *(p for parts in _FUSED.values() for p in parts))]
        if stage.last:
            names += ["token_embd.weight", "output_norm.weight"]
            names += [] if self.config.tied_output else ["output.weight"]
        return [self.gguf.tensors[name] for name in names]

    def _stage_file_ranges(self, stage: _Stage) -> _Staged:
        """Allocate a staging buffer holding the stage's tensors as the file lays them out, and
        the uploads that fill it: few contiguous ranges of the mapped file, zero-copy, cut into
        pieces of one message each."""
        sources = self._stage_sources(stage)
        placed, size = [], 0
        for lo, hi in file_runs(sources, self.gguf.alignment):
            size = -(-size // ALIGN) * ALIGN
            placed.append((lo, hi, size))
            size += hi - lo
        buffer = stage.client.alloc_buffer_nowait(size)
        staged = _Staged(stage, buffer)
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

    def _upload(self, uploads: list[tuple[RemoteTensor, np.ndarray]],
                progress: Progress | None) -> int:
        """Pipelined set_tensor_async of every piece; progress as acknowledgements arrive."""
        parts = {t.client.set_tensor_async(t, data): int(data.nbytes) for t, data in uploads}
        total, done = sum(parts.values()), 0
        if progress is not None:
            progress(0, total)
        for future in as_completed(parts):
            future.result()
            done += parts[future]
            if progress is not None:
                progress(done, total)
        self.bytes_sent += total
        return total

    def _build_resident(self, staged: _Staged) -> list[Future[Any]]:
        """One compute graph on the stage's worker lays the staged bytes out as the weights the
        stage graphs read (Q/K/V and gate/up stacked; dequantized in f32 mode); then the staging
        buffer is freed (queued behind the build on the same worker)."""
        stage, src = staged.stage, staged.tensors
        layout = _Layout()
        fills: list[tuple[str, list[str]]] = []
        for i in stage.layers:
            for norm in _NORMS:
                layout.add(f"{i}.{norm}", (self.config.d_model,), "float32")
                fills.append((f"{i}.{norm}", [f"blk.{i}.{norm}.weight"]))
            for name, parts in _FUSED.items():
                tensors = [self._tensor(i, p) for p in parts]
                rows = sum(t.data.shape[0] for t in tensors)
                layout.add(f"{i}.{name}", self._resident_shape(tensors[0], rows),
                           self._resident_dtype)
                fills.append((f"{i}.{name}", [t.name for t in tensors]))
        if stage.last:
            for name in self._last_stage_tables():
                t = self.gguf.tensors[name]
                layout.add(name, self._resident_shape(t, t.data.shape[0]), self._resident_dtype)
                fills.append((name, [name]))
            layout.add("output_norm", (self.config.d_model,), "float32")
            fills.append(("output_norm", ["output_norm.weight"]))
        buffer = stage.client.alloc_buffer_nowait(layout.size)
        stage.buffers.append(buffer)
        placed = layout.bind(buffer)
        g = Graph()
        for name, sources in fills:
            row = 0
            for source in sources:
                t, rows = self.gguf.tensors[source], src[source].shape[0]
                dst = placed[name][row:row + rows] if len(sources) > 1 else placed[name]
                if self.weights == "f32" and t.qtype in QUANT_BLOCKS:
                    g.dequantize(src[source], qtype=t.qtype, out=dst)
                else:
                    g.cpy(src[source], dst)
                row += rows
        built = stage.client.compute_async(g)
        self._bind_weights(stage, placed)
        return [built, staged.buffer.free_async()]

    @property
    def _resident_dtype(self) -> str:
        return "float32" if self.weights == "f32" else "uint8"

    def _resident_shape(self, t: GGUFTensor, rows: int) -> tuple[int, int]:
        """A matmul weight as it lives on its worker: (rows, in) f32, or its blocks' bytes."""
        if self.weights == "f32":
            return rows, t.shape[-1]
        return rows, t.data.shape[1]

    def _last_stage_tables(self) -> list[str]:
        """Vocabulary tables on the last stage: the head, and ``token_embd`` for get_rows (the
        same table when tied)."""
        return ["token_embd.weight"] + ([] if self.config.tied_output else ["output.weight"])

    def _bind_weights(self, stage: _Stage, placed: dict[str, RemoteTensor]) -> None:
        for i in stage.layers:
            linear = {name: self._linear_weight(placed[f"{i}.{name}"], self._fused_qtype(i, parts))
                      for name, parts in _FUSED.items()}
            stage.weights.append(_LayerWeights(placed[f"{i}.attn_norm"],
                                               placed[f"{i}.ffn_norm"], linear))
        if stage.last:
            embd = self.gguf.tensors["token_embd.weight"]
            stage.embd = self._linear_weight(placed["token_embd.weight"], embd.qtype)
            stage.out_norm = placed["output_norm"]
            head = self._head_tensor()
            stage.lm_head = self._linear_weight(placed[head.name], head.qtype)

    def _linear_weight(self, tensor: RemoteTensor, qtype: str) -> _Linear:
        return _Linear(tensor, "none" if self.weights == "f32" else qtype)

    def _head_tensor(self) -> GGUFTensor:
        """The LM head: ``token_embd`` when tied (SmolLM2), else ``output``."""
        return self.gguf.tensors["token_embd.weight" if self.config.tied_output
                                 else "output.weight"]

    def _fused_qtype(self, layer: int, parts: Sequence[str]) -> str:
        """The one qtype of weights stacked into one matmul (Q/K/V, gate/up)."""
        kinds = {(self._tensor(layer, p).qtype, self._tensor(layer, p).data.shape[1])
                 for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"layer {layer}: {'/'.join(parts)} differ in qtype or row size "
                             f"({sorted(kinds)}); they are multiplied as one stacked weight")
        return kinds.pop()[0]

    def _make_kv(self, stage: _Stage) -> None:
        """Per layer K and V caches of (n_ctx + 1, n_kv_heads, head_dim); the last row is scratch."""
        cfg = self.config
        shape = (self.n_ctx + 1, cfg.n_kv_heads, cfg.head_dim)
        layout = _Layout()
        for i in stage.layers:
            layout.add(f"k{i}", shape, self.kv_dtype)
            layout.add(f"v{i}", shape, self.kv_dtype)
        stage.kv_buffer = stage.client.alloc_buffer_nowait(layout.size)
        placed = layout.bind(stage.kv_buffer)
        stage.kv = [(placed[f"k{i}"], placed[f"v{i}"]) for i in stage.layers]

    # ------------------------------------------------------------------------------ graphs

    def _chunk(self, mode: str) -> int:
        return 1 if mode == "decode" else self.prefill_chunk

    def _make_io(self, stage: _Stage, mode: str) -> _ModeIO:
        """One small buffer holding this stage's step tensors for ``mode``."""
        T, d, vocab = self._chunk(mode), self.config.d_model, self.config.vocab_size
        wanted: dict[str, tuple[tuple[int, ...], str]] = {
            "pos": ((T,), "int32"), "mask": ((T, self.n_ctx), "float32"),
            "x_in": ((T, d), "float32")}
        if not stage.last:
            wanted["x_out"] = ((T, d), "float32")
        else:
            wanted["logits"] = ((T if mode == "full" else 1, vocab), "float32")
            if mode != "full":
                wanted["token"] = ((1,), "int32")
                wanted["x_next"] = ((1, d), "float32")
            if mode == "prefill":
                wanted["last_idx"] = ((1,), "int32")
        layout = _Layout()
        for name, (shape, dtype) in wanted.items():
            layout.add(name, shape, dtype)
        buffer = stage.client.alloc_buffer_nowait(layout.size)
        stage.buffers.append(buffer)
        return _ModeIO(**layout.bind(buffer))

    def _register_all(self, modes: Sequence[Mode]) -> None:
        """Build and register every stage's graph for each of ``modes`` (pipelined)."""
        futures = {}
        for stage in self.stages:
            for mode in modes:
                io = stage.io[mode] = self._make_io(stage, mode)
                graph = self._stage_graph(stage, mode, io)
                futures[stage, mode] = stage.client.register_async(graph)
        for (stage, mode), future in futures.items():
            stage.graphs[mode] = future.result()

    def _stage_graph(self, stage: _Stage, mode: str, io: _ModeIO) -> Graph:
        g = Graph()
        x: Any = g.input(io.x_in)
        n = len(stage.weights)
        for k, (layer, kv) in enumerate(zip(stage.weights, stage.kv)):
            x = self._block(g, x, layer, kv, io, self._chunk(mode),
                            out=io.x_out if k == n - 1 else None)
        if stage.last:
            self._head(g, x, stage, mode, io)
        return g

    def _block(self, g: Graph, x: Any, w: _LayerWeights, kv: tuple[RemoteTensor, RemoteTensor],
               io: _ModeIO, T: int, out: RemoteTensor | None) -> GraphTensor:
        """One transformer layer: x + attention(norm(x)), then + ffn(norm(.))."""
        eps = self.config.norm_eps
        h = g.mul(g.rms_norm(x, eps=eps), w.attn_norm)
        x = g.add(x, self._attention(g, h, w, kv, io, T))
        h = g.mul(g.rms_norm(x, eps=eps), w.ffn_norm)
        return g.add(x, self._ffn(g, h, w), out=out)

    def _attention(self, g: Graph, h: GraphTensor, w: _LayerWeights,
                   kv: tuple[RemoteTensor, RemoteTensor], io: _ModeIO, T: int) -> GraphTensor:
        cfg = self.config
        n_h, n_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = _linear(g, h, w.linear["qkv"])                    # (T, (n_h + 2 n_kv) hd)
        row = qkv.shape[1] * 4
        q = g.view(qkv, (T, n_h, hd), (row, hd * 4, 4))
        k = g.view(qkv, (T, n_kv, hd), (row, hd * 4, 4), n_h * hd * 4)
        v = g.view(qkv, (T, n_kv, hd), (row, hd * 4, 4), (n_h + n_kv) * hd * 4)
        q = g.rope(q, io.pos, n_dims=cfg.rope_dims, mode=cfg.rope_mode, freq_base=cfg.rope_base)
        k = g.rope(k, io.pos, n_dims=cfg.rope_dims, mode=cfg.rope_mode, freq_base=cfg.rope_base)
        k_cache, v_cache = kv
        g.set_rows(k_cache, k, io.pos)
        g.set_rows(v_cache, v, io.pos)
        scores = g.matmul(self._by_kv_head(g, q, T), _heads_first(k_cache[:self.n_ctx]),
                          transpose_b=True)                     # (n_kv, G T, n_ctx)
        probs = g.soft_max(g.reshape(scores, (n_kv, cfg.gqa_group, T, self.n_ctx)), io.mask,
                           scale=1.0 / math.sqrt(hd))
        att = g.matmul(g.reshape(probs, (n_kv, cfg.gqa_group * T, self.n_ctx)),
                       _heads_first(v_cache[:self.n_ctx]))    # (n_kv, G T, hd)
        return _linear(g, self._by_token(g, att, T), w.linear["wo"])

    def _by_kv_head(self, g: Graph, q: GraphTensor, T: int) -> GraphTensor:
        """(T, n_heads, hd) -> (n_kv, G*T, hd): query head h reads KV head h // G."""
        n_kv, group, hd = self.config.n_kv_heads, self.config.gqa_group, self.config.head_dim
        if T == 1:
            return g.reshape(q, (n_kv, group, hd))
        grouped = g.permute(g.reshape(q, (T, n_kv, group, hd)), (1, 2, 0, 3))
        return g.reshape(g.cont(grouped), (n_kv, group * T, hd))

    def _by_token(self, g: Graph, att: GraphTensor, T: int) -> GraphTensor:
        """(n_kv, G*T, hd) -> (T, n_heads * hd)."""
        n_kv, group, hd = self.config.n_kv_heads, self.config.gqa_group, self.config.head_dim
        if T == 1:
            return g.reshape(att, (1, n_kv * group * hd))
        tokens_first = g.permute(g.reshape(att, (n_kv, group, T, hd)), (2, 0, 1, 3))
        return g.reshape(g.cont(tokens_first), (T, n_kv * group * hd))

    def _ffn(self, g: Graph, h: GraphTensor, w: _LayerWeights) -> GraphTensor:
        d_ff = self.config.d_ff
        gate_up = _linear(g, h, w.linear["gate_up"])            # (T, 2 d_ff)
        T, row = gate_up.shape[0], gate_up.shape[1] * 4
        gate = g.view(gate_up, (T, d_ff), (row, 4))
        up = g.view(gate_up, (T, d_ff), (row, 4), d_ff * 4)
        return _linear(g, g.mul(g.silu(gate), up), w.linear["down"])

    def _head(self, g: Graph, x: Any, stage: _Stage, mode: str, io: _ModeIO) -> None:
        """Final norm, LM head into ``io.logits``; but for "full", the argmax into ``io.token``
        and its embedding into ``io.x_next``.

        Prefill keeps only the last real token's row (``io.last_idx``: chunks are padded)."""
        if stage.lm_head is None or stage.embd is None:
            raise RuntimeError("the last stage has no LM head")
        if mode == "prefill":
            x = g.get_rows(x, io.last_idx)
        h = g.mul(g.rms_norm(x, eps=self.config.norm_eps), _need(stage.out_norm))
        logits = _linear(g, h, stage.lm_head, out=io.logits)
        if mode != "full":
            token = g.argmax(logits, out=io.token)
            g.get_rows(stage.embd.tensor, token, qtype=stage.embd.qtype, out=io.x_next)

    # ------------------------------------------------------------------------- running steps

    def reset(self) -> None:
        """Forget the sequence: position 0, caches zeroed on the workers (queued, not waited)."""
        self._check_open()
        self.n_past = 0
        self._pending += [s.kv_buffer.clear_async() for s in self.stages if s.kv_buffer]

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` at the current position; logits (vocab,) of the last one."""
        return self._prefill(token_ids, "logits")[0].reshape(-1)

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; its logits (vocab,)."""
        return self._decode(token_id, "logits")[0].reshape(-1)

    def forward_full(self, token_ids: Sequence[int]) -> np.ndarray:
        """Recompute ``token_ids`` from position 0 (reset first); logits of every position.

        Runs the ``full`` graphs (registered on first use), chunk by chunk; the cache ends up
        holding the sequence, as after :meth:`prefill`.
        """
        self.reset()
        if "full" not in self.stages[0].graphs:
            self._register_all(("full",))
        results = self._run_chunks("full", token_ids, fetch_each=True)
        n = len(token_ids)
        return np.concatenate([r[0] for r in results])[:n]

    def _prefill(self, token_ids: Sequence[int], fetch: str) -> list[np.ndarray]:
        return self._run_chunks("prefill", token_ids, fetch_each=False, fetch=fetch)[-1]

    def _decode(self, token_id: int, fetch: str) -> list[np.ndarray]:
        return self._run_chunks("decode", [token_id], fetch_each=False, fetch=fetch)[-1]

    def _run_chunks(self, mode: Mode, token_ids: Sequence[int], *, fetch_each: bool,
                    fetch: str = "logits") -> list[list[np.ndarray]]:
        """Launch every chunk at once (they pipeline over the stages); wait for all."""
        self._check_open()
        ids = [int(t) for t in token_ids]
        self._check_tokens(ids)
        start = time.perf_counter()
        T = self._chunk(mode)
        chunks = [ids[i:i + T] for i in range(0, len(ids), T)]
        steps, first = [], self.n_past
        try:
            for k, chunk in enumerate(chunks):
                wants = fetch if fetch_each or k == len(chunks) - 1 else "none"
                steps.append(self._launch(mode, chunk, self.n_past, wants))
                self.n_past += len(chunk)
            results = self._wait(steps)
        except BaseException:
            self.n_past = first     # rows written past it are rewritten before they are read
            raise
        self.stats.append(StepStat(mode, len(ids), time.perf_counter() - start,
                                   sum(s.messages() for s in steps),
                                   sum(s.compute() for s in steps)))
        return results

    def _check_tokens(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("need at least one token")
        if self.n_past + len(ids) > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens at position {self.n_past} overflow the context "
                             f"of {self.n_ctx} (reset() or load with a larger n_ctx)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary of "
                             f"{self.config.vocab_size}")

    def _wait(self, steps: list[_StepFuture]) -> list[list[np.ndarray]]:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        results = [step.future.result() for step in steps]
        self.bytes_received += sum(a.nbytes for r in results for a in r)
        return results

    def _launch(self, mode: Mode, chunk: list[int], start: int, fetch: str) -> _StepFuture:
        """Issue one chunk through every stage; only the returned step's future is waited on."""
        runs = self._stage_runs(mode, chunk, start, fetch)
        self.bytes_sent += sum(a.nbytes for r in runs for _, a in r.inputs)
        step = _StepFuture()
        self._issue(step, mode, runs)
        return step

    def _issue(self, step: _StepFuture, mode: Mode, runs: list[_StageRun],
                receive: HandOff | None = None, send: HandOff | None = None,
                hold_reply: float = 0.0) -> None:
        """Run every stage in turn, one linked run each: a stage receives the previous one's
        output and sends its own to the next (``receive``: the first stage's input from
        elsewhere; ``send``: the last stage's output to elsewhere). Nothing waits here."""
        try:
            for i, run in enumerate(runs):
                stage = run.stage
                out = send if stage.last else hand_off(
                    _need(stage.io[mode].x_out), _need(runs[i + 1].stage.io[mode].x_in))
                step.add_run(stage.client.run_async(
                    stage.graphs[mode], run.inputs, run.fetch,
                    receive=[receive] if receive else [], send=[out] if out else [],
                    hold_reply=hold_reply),
                    final=stage.last)
                if out is not None:
                    step.add_messages(_messages(out))
                receive = out
        except Exception as exc:  # noqa: BLE001 - the step's future carries every failure
            step.fail(exc)

    def _stage_runs(self, mode: Mode, chunk: list[int] | None, start: int,
                    fetch: str) -> list[_StageRun]:
        """Each stage's inputs for one chunk (padded to the mode's T) and the last one's fetch;
        ``chunk`` None: one token whose embedding reaches the first stage by a hand-off."""
        T, n = self._chunk(mode), 1 if chunk is None else len(chunk)
        pos = np.full(T, self.n_ctx, np.int32)          # padding writes the scratch cache row
        pos[:n] = np.arange(start, start + n, dtype=np.int32)
        mask = np.full((T, self.n_ctx), -np.inf, np.float32)
        mask[:n][np.arange(self.n_ctx)[None, :] <= pos[:n, None]] = 0.0
        x = None
        if chunk is not None:
            tokens = np.zeros(T, np.int32)
            tokens[:n] = chunk
            x = self.embed(tokens)
        return [self._stage_run(s, mode, pos, mask, x, n, fetch) for s in self.stages]

    def embed(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The input embeddings (T, d_model) float32 of ``token_ids``, read here from the mapped
        GGUF (like llama.cpp, which keeps the input layer on the host): only the rows asked for
        are dequantized, and the first worker needs no embedding table."""
        table = self.gguf.tensors["token_embd.weight"]
        rows = np.take(table.data, np.asarray(token_ids, np.intp), axis=0)
        if table.qtype in QUANT_BLOCKS:
            return quant.dequantize(rows, table.qtype)
        return rows.astype(np.float32)

    def _stage_run(self, stage: _Stage, mode: Mode, pos: np.ndarray, mask: np.ndarray,
                   x: np.ndarray | None, n: int, fetch: str) -> _StageRun:
        io = stage.io[mode]
        inputs = [(io.pos, pos), (io.mask, mask)]
        if stage.first and x is not None:
            inputs.append((io.x_in, x))
        if io.last_idx is not None:
            inputs.append((io.last_idx, np.array([n - 1], np.int32)))
        wanted = {"logits": io.logits, "token": io.token}.get(fetch) if stage.last else None
        return _StageRun(stage, [(t, a) for t, a in inputs if t is not None],
                         [wanted] if wanted is not None else [])

    # --------------------------------------------------------------------------- generation

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stream: Callable[[int], None] | None = None,
                 stop_ids: Collection[int] | None = None) -> list[int]:
        """Reset, prefill the prompt, then decode up to ``max_new_tokens`` tokens.

        Greedy by default: the argmax is taken on the last worker and only its 4 bytes come
        back. With ``temperature > 0`` the logits are fetched and sampled here (``top_k``,
        ``top_p``, ``seed``). ``stream(token_id)`` is called for each new token. Generation stops
        after a token in ``stop_ids`` (default: the EOS id; pass ``()`` to never stop early) or
        when the context is full.
        """
        self.reset()
        if max_new_tokens <= 0:
            return []
        stops = {self.config.eos_id} if stop_ids is None else set(stop_ids)
        greedy, rng = temperature <= 0, np.random.default_rng(seed)
        fetch = "token" if greedy else "logits"
        def pick(r: list[np.ndarray]) -> int:
            if greedy:
                return int(r[0].reshape(-1)[0])
            return sample_token(r[0].reshape(-1), temperature, top_k, top_p, rng)
        out = [pick(self._prefill(prompt_ids, fetch))]
        if greedy and self.chain_greedy:
            self._decode_chained(out, max_new_tokens, stops, stream)
            return out
        for token in self._continue(out, max_new_tokens, stops, stream):
            out.append(pick(self._decode(token, fetch)))
        return out

    def _decode_chained(self, out: list[int], limit: int, stops: set[int],
                        stream: Callable[[int], None] | None) -> None:
        """Greedy decoding with the token fed back worker to worker, ``lookahead`` steps ahead.

        Each step's last stage sends the embedding of its argmax (``x_next``) to the first
        stage's input as part of its run, and the next step's first run receives it (the first
        step's comes from the prompt's run by a copy); the workers' queues order it all, so no
        client round trip sits between two tokens, and a step is one request per stage. The
        client streams each token as its step reports it and stops issuing at a stop token;
        steps already issued past it only write cache rows beyond the end, which later steps
        overwrite before reading.
        """
        if stream is not None:
            stream(out[-1])
        if out[-1] in stops or len(out) >= limit:
            return
        pending: deque[_StepFuture] = deque()
        newest: _StepFuture | None = None
        carried: HandOff | None = None
        last_arrival = time.perf_counter()
        try:
            while True:
                while (len(pending) < self.lookahead and len(out) + len(pending) < limit
                       and self.n_past + len(pending) < self.n_ctx):
                    newest, carried = self._launch_chained(self.n_past + len(pending), carried)
                    pending.append(newest)
                if not pending:
                    return
                step = pending.popleft()
                token = int(self._wait([step])[0][0].reshape(-1)[0])
                now = time.perf_counter()
                self.stats.append(StepStat("decode", 1, now - last_arrival, step.messages(),
                                           step.compute()))
                last_arrival = now
                self.n_past += 1
                out.append(token)
                if stream is not None:
                    stream(token)
                if token in stops or len(out) >= limit or self.n_past >= self.n_ctx:
                    return
        finally:
            self._finish_chain(pending, newest, carried)

    def _launch_chained(self, start: int, carried: HandOff | None
                        ) -> tuple[_StepFuture, HandOff]:
        """Issue one chained step at position ``start``; returns it and the hand-off of its
        argmax embedding, which the next step receives."""
        first, last = self.stages[0], self.stages[-1]
        x_in = _need(first.io["decode"].x_in)
        runs = self._stage_runs("decode", None, start, "token")
        self.bytes_sent += sum(a.nbytes for r in runs for _, a in r.inputs)
        step = _StepFuture()
        if carried is None:                 # the prompt's argmax: its run has been issued
            prompt = _need(last.io["prefill"].x_next)
            step.add_transfer(prompt.client.copy_tensor_async(prompt, x_in),
                              1 if last.client is first.client else 2)
        following = hand_off(_need(last.io["decode"].x_next), x_in)
        self._issue(step, "decode", runs, receive=carried, send=following,
                    hold_reply=self.hold_reply)
        return step, following

    def _finish_chain(self, pending: deque[_StepFuture], newest: _StepFuture | None,
                      carried: HandOff | None) -> None:
        """Let the steps already issued finish (results unused), then land the newest one's
        hand-off, which no step receives (when that step failed it may never come: the
        worker drops an unclaimed transfer after a while)."""
        for step in pending:
            step.future.exception()
        if newest is not None and carried is not None and newest.future.exception() is None:
            self.stages[0].client.receive_async(carried).exception()

    def _continue(self, out: list[int], limit: int, stops: set[int],
                  stream: Callable[[int], None] | None) -> Iterator[int]:
        """Stream each new token; yield it back for decoding while generation goes on."""
        while True:
            if stream is not None:
                stream(out[-1])
            if out[-1] in stops or len(out) >= limit or self.n_past >= self.n_ctx:
                return
            yield out[-1]

    # ---------------------------------------------------------------------------- measuring

    def measure_compute(self, mode: Mode = "decode", repeats: int = 5) -> list[float]:
        """Seconds each stage's ``mode`` graph takes on its worker (median of the compute times
        the worker reports). Positions go to the scratch row: the cache and position are left
        as they were."""
        self._check_open()
        medians = []
        for stage in self.stages:
            run = self._scratch_run(stage, mode)
            times = [stage.client.run(stage.graphs[mode], run.inputs).compute_seconds
                     for _ in range(repeats)]
            medians.append(statistics.median(times))
        return medians

    def _scratch_run(self, stage: _Stage, mode: Mode) -> _StageRun:
        """Inputs that send every token to the scratch cache row, with nothing visible."""
        T = self._chunk(mode)
        pos = np.full(T, self.n_ctx, np.int32)
        mask = np.full((T, self.n_ctx), -np.inf, np.float32)
        x = np.zeros((T, self.config.d_model), np.float32)
        return self._stage_run(stage, mode, pos, mask, x, 1, "none")

    def _warm_up(self, modes: Sequence[Mode]) -> None:
        """Run each graph once on scratch rows, so the first real step does not pay for the
        first touch of its scratch arena and cache pages."""
        futures = []
        for mode in modes:
            for stage in self.stages:
                run = self._scratch_run(stage, mode)
                futures.append(stage.client.run_async(stage.graphs[mode], run.inputs))
        for future in futures:
            future.result()

    @property
    def weight_bytes(self) -> int:
        """Unique weight bytes of the model in its compact GGUF form."""
        return self.gguf.tensor_data_bytes

    # ------------------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the model is closed")

    def close(self) -> None:
        """Free this model's graphs and buffers on every worker (clients stay open). Idempotent."""
        if self._closed:
            return
        self._closed = True
        frees: list[Future[None]] = []
        for stage in self.stages:
            if stage.client.closed:
                continue
            frees += [graph.free_async() for graph in stage.graphs.values()]
            frees += [b.free_async() for b in [*stage.buffers, stage.kv_buffer] if b is not None]
        for future in frees:
            try:
                future.result()
            except RpcError as exc:   # a buffer whose allocation failed, or a worker gone
                log.debug("freeing model state: %s", exc)

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layers = ", ".join(f"{s.client.endpoint}: layers {s.layers.start}-{s.layers.stop - 1}"
                           for s in self.stages)
        return f"LlamaModel({self.weights}, n_ctx={self.n_ctx}, [{layers}])"


def _need(tensor: RemoteTensor | None) -> RemoteTensor:
    """A step tensor this stage's layout must have (a bug here, not a user error)."""
    if tensor is None:
        raise RuntimeError("a stage lacks a step tensor its graph needs")
    return tensor


def _heads_first(cache: RemoteTensor) -> RemoteTensor:
    """(n_ctx, n_kv, hd) cache rows -> a (n_kv, n_ctx, hd) strided view."""
    return cache.permute(1, 0, 2)
