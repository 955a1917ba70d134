"""Running a loaded llama: the KV cache and sequence position, and the step scheduler.

One step of the pipeline, one client round trip (with worker-to-worker copies)::

    client ── run(stage 0: x, pos) ──> worker A ── x (T, 576) ──> worker B
           <── logits or argmax (4 bytes) ─── run(stage 1: pos) <──────┘

Each stage's run carries the step's small inputs (embeddings, positions; the additive attention
masks only for a worker before protocol 1.13, the others build them from the positions) in its
own message, and the stages are chained by :func:`~zmq_rpc.client.pipeline.run_chain`
(the same linked runs a :class:`~zmq_rpc.client.pipeline.Pipeline` issues); the last stage's reply
carries the fetched result. Row ``n_ctx`` of every cache is a scratch row that the padding tokens
of a partial prefill chunk write to. The input embedding runs here, on the mapped GGUF (as
llama.cpp keeps the input layer on the host).

Threads: the caller's thread builds and launches steps and blocks only on a step's final result;
the continuation of a step (settling its future, a relayed hand-off) runs in done-callbacks on the
clients' I/O threads and only issues requests. One thread at a time drives a runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ...broker.errors import RecoveryFailed, RpcError, TransferError, TransportError
from ...broker.ops import QUANT_BLOCKS
from ...worker.formats import quant
from ..client import RemoteTensor, RunResult
from ..futures import failed, settled_by
from ..gguf_model import LlamaGGUF, dequantize_rows
from ..peer import HandOff
from ..pipeline import LinkedRun, run_chain
from .graph import Mode, Registrations, StageGraphs
from .load import Layout
from .plan import Stage, need

__all__ = ["LOSSES", "KVCache", "Recover", "Step", "StepRunner", "StepStat", "embed_tokens",
           "free_stages", "guarded", "recover_from"]

log = logging.getLogger("zmq_rpc.client.llama")

T = TypeVar("T")
Recover = Callable[[RpcError], None]
"""``recover(error)``: after a step failed on a lost connection, make the model whole again
(re-placed stages, the sequence replayed: :mod:`.recovery`) or raise."""

LOSSES = (TransportError, TransferError)
"""The errors a lost worker fails a step with: its own connection's (``ConnectionLost``), or a
survivor's ``TransferError`` (its hand-off from the lost worker never came, or was called off):
whichever reaches the step first."""

DECODE_TAIL_SHARE = 8
"""A prefill's last chunk of at most ``T // DECODE_TAIL_SHARE`` tokens (4 of the default 32) runs
as that many decode steps, not as one run of the prefill graph padded to ``T`` rows: a decode
step reads each weight once for one row, a padded chunk computes ``T`` rows for the few real
ones (SmolLM2 on one worker here: a 1-token prompt's first token 0.12 s by prefill, 0.02 s by
decode). The decode steps pipeline over the stages like chunks. Not the padded chunk's bits: a
step attends in the fused kernel, a chunk in the matmul / soft_max composition (logits within
the decode kernels' rounding of each other, tests/test_llama.py); the cache records them as
decoded, so a replay as fed repeats them so."""


def guarded(call: Callable[[], T], recover: Recover | None) -> T:
    """``call()``; when it fails on a lost connection, :func:`recover_from` it and call again
    (each recovery takes at least one worker out, so this ends). ``recover`` None: the error
    as is."""
    while True:
        try:
            return call()
        except LOSSES as exc:
            recover_from(exc, recover)


def recover_from(error: RpcError, recover: Recover | None) -> None:
    """``recover(error)``; a recovery that meets another loss (a worker lost while the stages
    load or the sequence is replayed) recovers from that one too. Raises ``error`` when there
    is nothing to recover with (``recover`` None, or ``error`` a failed recovery), and whatever
    a recovery raises that is not a new loss."""
    if recover is None or isinstance(error, RecoveryFailed):
        raise error
    while True:
        try:
            recover(error)
            return
        except LOSSES as again:
            if again is error or isinstance(again, RecoveryFailed):
                raise
            error = again


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


class KVCache:
    """Per stage and layer K and V caches of (n_ctx + 1, n_kv_heads, head_dim) on the workers
    (the last row is scratch), how many positions of the sequence they hold, and the tokens
    that put them there (``fed``: what a recovery replays, :mod:`.recovery`)."""

    def __init__(self, gguf: LlamaGGUF, n_ctx: int, dtype: str) -> None:
        self.config = gguf.config
        self.n_ctx = n_ctx
        self.dtype = dtype
        self.n_past = 0
        self.fed: list[tuple[Mode, list[int]]] = []
        """The sequence as it was fed, in order: each step mode and its tokens (consecutive
        decode steps merged). Replaying it in the same modes and chunks rebuilds the caches bit
        for bit (a prefill chunk and a decode step need not round alike)."""

    def record(self, mode: Mode, ids: Sequence[int]) -> None:
        """``ids`` went into the caches by ``mode`` steps (after :attr:`n_past` counted them)."""
        if mode == "decode" and self.fed and self.fed[-1][0] == "decode":
            self.fed[-1][1].extend(ids)
        else:
            self.fed.append((mode, list(ids)))

    def allocate(self, stage: Stage) -> None:
        """Place ``stage``'s caches in one new buffer on its worker (``stage.kv``)."""
        cfg = self.config
        shape = (self.n_ctx + 1, cfg.n_kv_heads, cfg.head_dim)
        layout = Layout()
        for i in stage.layers:
            layout.add(f"k{i}", shape, self.dtype)
            layout.add(f"v{i}", shape, self.dtype)
        stage.kv_buffer = stage.client.alloc_buffer_nowait(layout.size)
        placed = layout.bind(stage.kv_buffer)
        stage.kv = [(placed[f"k{i}"], placed[f"v{i}"]) for i in stage.layers]

    def clear(self, stages: Sequence[Stage]) -> list[Future[None]]:
        """Forget the sequence: position 0, caches zeroed (queued on the workers)."""
        self.n_past = 0
        self.fed = []
        return [s.kv_buffer.clear_async() for s in stages if s.kv_buffer is not None]

    def check(self, ids: Sequence[int]) -> None:
        """Refuse ``ids`` (a ValueError) unless they are in the vocabulary and fit the context."""
        if not ids:
            raise ValueError("need at least one token")
        if self.n_past + len(ids) > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens at position {self.n_past} overflow the context "
                             f"of {self.n_ctx} (reset() or load with a larger n_ctx)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary of "
                             f"{self.config.vocab_size}")


@dataclass(eq=False)
class Step:
    """One chunk's trip through the stages: its runs and transfers. ``future`` gives the last
    stage's fetch once it is in and nothing earlier has failed (the first error otherwise)."""

    future: Future[RunResult]
    runs: list[Future[RunResult]] = field(default_factory=list)
    messages: int = 0

    def compute(self) -> float:
        """Seconds of graph compute the workers reported for this step's runs."""
        return sum(r.result().compute_seconds for r in self.runs
                   if r.done() and r.exception() is None)


class StepRunner:
    """Launches chunks of tokens through the stages and waits for their results; counts the
    bytes and records a :class:`StepStat` per call."""

    def __init__(self, gguf: LlamaGGUF, stages: Sequence[Stage], graphs: StageGraphs,
                 cache: KVCache) -> None:
        self.gguf = gguf
        self.stages = list(stages)
        self.graphs = graphs
        self.cache = cache
        self.stats: list[StepStat] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pending: list[Future[Any]] = []

    def reset(self) -> None:
        """Position 0, caches zeroed on the workers (queued; the next wait covers it)."""
        self._pending += self.cache.clear(self.stages)

    # What a recovery needs (:class:`~.recovery.Recoverable`).

    def steps_done(self) -> int:
        return len(self.stats)

    def allocate_kv(self, stage: Stage) -> None:
        self.cache.allocate(stage)

    def register_stage(self, stage: Stage, like: Stage) -> Registrations:
        """The modes ``like`` had (decode and prefill when it had none yet)."""
        modes = [m for m in _MODES if m in like.graphs] or ["decode", "prefill"]
        return self.graphs.register_async([stage], modes)

    def run_chunks(self, mode: Mode, token_ids: Sequence[int], *, fetch_each: bool,
                   fetch: str = "logits") -> list[RunResult]:
        """Launch every chunk at once (they pipeline over the stages); wait for all. A prefill's
        short last chunk runs as decode steps (:data:`DECODE_TAIL_SHARE`)."""
        ids = [int(t) for t in token_ids]
        self.cache.check(ids)
        start, first = time.perf_counter(), self.cache.n_past
        parts = self._parts(mode, ids)
        last = sum(len(chunks) for _, chunks in parts) - 1
        steps: list[Step] = []
        try:
            for part_mode, chunks in parts:
                for chunk in chunks:
                    wants = fetch if fetch_each or len(steps) == last else "none"
                    steps.append(self.launch(part_mode, chunk, self.cache.n_past, wants))
                    self.cache.n_past += len(chunk)
            results = self.wait(steps)
        except BaseException:
            self.cache.n_past = first   # rows written past it are rewritten before they are read
            raise
        for part_mode, chunks in parts:
            if chunks:
                self.cache.record(part_mode, [t for chunk in chunks for t in chunk])
        self.stats.append(StepStat(mode, len(ids), time.perf_counter() - start,
                                   sum(s.messages for s in steps),
                                   sum(s.compute() for s in steps)))
        return results

    def _parts(self, mode: Mode, ids: list[int]) -> list[tuple[Mode, list[list[int]]]]:
        """``ids`` cut into the chunks of ``mode``'s graph, by mode: a prefill's last chunk of
        at most ``T // DECODE_TAIL_SHARE`` tokens as decode steps."""
        T = self.graphs.chunk(mode)
        chunks = [ids[i:i + T] for i in range(0, len(ids), T)]
        if mode == "prefill" and chunks and len(chunks[-1]) <= T // DECODE_TAIL_SHARE:
            return [("prefill", chunks[:-1]), ("decode", [[t] for t in chunks[-1]])]
        return [(mode, chunks)]

    def replay(self, *, as_fed: bool) -> int:
        """Clear the caches and feed the sequence again, its chunks issued at once: ``as_fed``,
        in the modes and chunks it was fed (:attr:`KVCache.fed`: the same bits whatever the
        kernels); else all of it as prefill chunks (a fraction of the time of one decode step
        per token; the products' bits where every product is batch-invariant, but a chunk's
        attention is not a step's: the caches within rounding of the fed ones). Tokens
        replayed; no :class:`StepStat` is kept for it."""
        fed, kept = self.cache.fed, len(self.stats)
        self.reset()
        merged: list[tuple[Mode, list[int]]] = [("prefill", [t for _, ids in fed for t in ids])]
        parts = fed if as_fed else merged
        for mode, ids in parts:
            if ids:
                self.run_chunks(mode, ids, fetch_each=False,
                                fetch="logits" if mode == "full" else "token")
        del self.stats[kept:]
        self.cache.fed = fed
        return sum(len(ids) for _, ids in fed)

    def wait(self, steps: Sequence[Step]) -> list[RunResult]:
        """The steps' results, after whatever was queued before them (a cache reset)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        results = [step.future.result() for step in steps]
        self.bytes_received += sum(a.nbytes for r in results for a in r)
        return results

    def launch(self, mode: Mode, chunk: list[int] | None, start: int, fetch: str, *,
               receive: HandOff | None = None, send: HandOff | None = None,
               hold_reply: float = 0.0, before: Sequence[tuple[Future[Any], int]] = ()) -> Step:
        """Issue one chunk at position ``start`` through every stage; nothing waits here.

        ``chunk`` None: one token whose embedding reaches the first stage by ``receive`` (or
        by a transfer in ``before``: futures already issued, with the requests each took)."""
        runs = self.stage_runs(mode, chunk, start, fetch)
        self.bytes_sent += sum(a.nbytes for r in runs for _, a in r.inputs)
        transfers = [f for f, _ in before]
        try:
            chain = run_chain(runs, receive=receive, send=send, hold_reply=hold_reply)
        except Exception as exc:  # noqa: BLE001 - the step's future carries every failure
            return Step(failed(exc))
        return Step(settled_by(chain.runs[-1], [*transfers, *chain.runs]), chain.runs,
                    chain.messages + sum(n for _, n in before))

    def stage_runs(self, mode: Mode, chunk: list[int] | None, start: int,
                   fetch: str) -> list[LinkedRun]:
        """Each stage's inputs for one chunk (padded to the mode's T) and the last one's fetch."""
        T, n, n_ctx = self.graphs.chunk(mode), 1 if chunk is None else len(chunk), self.cache.n_ctx
        pos = np.full(T, n_ctx, np.int32)               # padding writes the scratch cache row
        pos[:n] = np.arange(start, start + n, dtype=np.int32)
        masks = self._masks(mode, pos, n)
        x = None
        if chunk is not None:
            tokens = np.zeros(T, np.int32)
            tokens[:n] = chunk
            x = self.embed(tokens)
        return [self._stage_run(s, mode, pos, masks, x, n, fetch) for s in self.stages]

    def _masks(self, mode: Mode, pos: np.ndarray, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The step's additive masks (full, sliding-window) for the stages whose workers predate
        protocol 1.13 (the others build them from ``pos``: ``causal_mask``); None when no stage
        reads them. Row t of n real rows sees the keys up to ``pos[t]``; padding rows none."""
        if all(s.io[mode].mask is None for s in self.stages):
            return None, None
        n_ctx = self.cache.n_ctx
        mask = np.full((len(pos), n_ctx), -np.inf, np.float32)
        mask[:n][np.arange(n_ctx)[None, :] <= pos[:n, None]] = 0.0
        window = self.cache.config.swa_window
        mask_swa = mask.copy() if window else None
        if mask_swa is not None:    # llama.cpp hides key p0 from query p1 when p1 - p0 >= window
            mask_swa[:n][pos[:n, None] - np.arange(n_ctx)[None, :] >= window] = -np.inf
        return mask, mask_swa

    def embed(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The input embeddings (T, d_model) float32 of ``token_ids`` (:func:`embed_tokens`)."""
        return embed_tokens(self.gguf, token_ids)

    def _stage_run(self, stage: Stage, mode: Mode, pos: np.ndarray,
                   masks: tuple[np.ndarray | None, np.ndarray | None], x: np.ndarray | None, n: int,
                   fetch: str) -> LinkedRun:
        io = stage.io[mode]
        inputs: list[tuple[RemoteTensor | None, np.ndarray]] = [(io.pos, pos)]
        for tensor, mask in zip((io.mask, io.mask_swa), masks):
            if tensor is not None and mask is not None:
                inputs.append((tensor, mask))
        if stage.first and x is not None:
            inputs.append((io.x_in, x))
        if io.last_idx is not None:
            inputs.append((io.last_idx, np.array([n - 1], np.int32)))
        wanted = {"logits": io.logits, "token": io.token}.get(fetch) if stage.last else None
        return LinkedRun(stage.graphs[mode], [(need(t), a) for t, a in inputs if t is not None],
                         [wanted] if wanted is not None else [], x=io.x_in, y=io.x_out)


_MODES: tuple[Mode, ...] = ("decode", "prefill", "full")


def embed_tokens(gguf: LlamaGGUF, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The input embeddings (T, d_model) float32 of ``token_ids``, read here from the mapped
    GGUF: only the rows asked for are dequantized."""
    table = gguf.tensors["token_embd.weight"]
    rows = np.take(table.data, np.asarray(token_ids, np.intp), axis=0)
    if table.qtype in QUANT_BLOCKS:
        return quant.dequantize(rows, table.qtype)
    if table.qtype == "bf16":
        return (rows.astype(np.uint32) << 16).view(np.float32)
    if table.qtype in ("f32", "f16"):
        return rows.astype(np.float32)
    return dequantize_rows(rows, table.qtype)


def free_stages(stages: Sequence[Stage]) -> None:
    """Free the stages' graphs and buffers on their workers (those still connected), waiting
    for each; failures are logged (a buffer whose allocation failed, a worker gone)."""
    frees: list[Future[None]] = []
    for stage in stages:
        if stage.client.closed:
            continue
        frees += [graph.free_async() for graph in stage.graphs.values()]
        frees += [b.free_async() for b in [*stage.buffers, stage.kv_buffer] if b is not None]
    for future in frees:
        try:
            future.result()
        except RpcError as exc:
            log.debug("freeing model state: %s", exc)
