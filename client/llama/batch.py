"""Continuous batching on a GGUF model: many sequences in KV slots, stepped together.

:class:`BatchedModel` loads a model (any architecture :class:`~.model.LlamaModel` loads, with the
same planning, loading and graph building blocks) for ``slots`` sequences at once::

    lane 0: rows of slots 0, 2, 4, ...  ──> stage 0 ──> stage 1 ──> token ids
    lane 1: rows of slots 1, 3, 5, ...  ──> stage 0 ──> stage 1 ──> token ids
            (lane 1 runs on stage 0 while lane 0 runs on stage 1)

**KV slots.** Each layer's cache holds ``slots * n_ctx`` rows (slot s at rows ``[s n_ctx,
(s + 1) n_ctx)``) and one scratch row that padding rows write.

**Rows.** A lane step runs B rows (the smallest of the lane's registered sizes that fits, padded
with position -1); each row carries its own input embedding, position, cache row and slot base.
``set_rows`` writes each row's K and V at base + pos, ``attend_rows`` attends each row to its own
slot's rows up to its position (the causal and sliding-window masks are built on the worker, none
is sent), and the last stage keeps the rows that produce a token (``out_idx``: each sequence's
last row), applies the head and ``sample_rows`` with each row's temperature, top-k, top-p, seed
and counter. Only the int32 token ids come back. A sequence's prompt is fed in chunks, in the
same step as other sequences' decode rows.

**Micro-batches.** With S stages the slots are split over S lanes, each with its own step
tensors and graphs on every stage (S x S x sizes registrations): the lanes' steps are issued
without waiting, and a worker runs its requests in order, so while one lane's rows are on stage 1
the next lane's are on stage 0. Stage hand-offs go worker to worker (:func:`~..pipeline.run_chain`).

**Batch invariance.** A sequence's logits do not depend on the other rows of its step: every op
computes a row from that row alone (products, norms, rope; ``attend_rows`` reads only the row's
own slot; ``sample_rows`` draws from a hash of the row's seed and counter), and a row's result is
the same at any position of the batch and in any of the registered sizes: every product rounds
each row to int8 on its own and sums each row's blocks in the same order whatever the other rows.
The workers' integer GEMM does so from 3 rows; below that their matrix-vector kernels run, which
round the same way for :data:`ROW_INVARIANT_QTYPES` (every block type: Q4_0 ... Q8_0 and the
K-quants), so a model whose products are all of those types runs steps of 1 and 2 rows (one
decoding sequence: the decode kernel, as :class:`~.model.LlamaModel` runs it), any other (an F16
or BF16 product, or float32 weights) never fewer than :data:`MIN_ROWS` (:func:`min_rows`;
checked by the tests).

**Recovery.** The model keeps each live slot's tokens (as its lane steps are launched) and the
lane steps in flight. A step whose result fails as a lost worker fails it is mended by the
:class:`~.recovery.Recoverer` :class:`~.model.LlamaModel` uses (this model is its
:class:`~.recovery.Recoverable`): the lost stages re-placed with every lane's graphs of every
size, each live slot replayed as prefill chunks up to where a step in flight feeds it (batch
invariance: the same bits), then every step in flight issued again, in order, so each sequence
gets its tokens once and the fault-free run's.

Threads: the caller's thread builds and launches steps and blocks only on a lane step's result
(and recovers there).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...broker.errors import RpcError
from ...worker.kernels import INVARIANT_INTEGER
from ..client import Client, RemoteTensor, RunResult
from ..futures import failed, settled_by
from ..gguf_model import LlamaConfig, LlamaGGUF, default_model_path, load_gguf
from ..graph import Graph, GraphTensor
from ..pipeline import LinkedRun, run_chain
from .graph import Layer, Registrations, StageGraphs, StepMasks, step_buffer
from .load import LoadStats, Progress, WeightLoader
from .membership import Membership
from .model import KVDType, Status, free_stages
from .plan import ModeIO, Stage, head_tensor, layer_tensor, make_stages, need
from .recovery import OnRecovery, Recoverer, Recovery
from .runtime import LOSSES, KVCache, Recover, embed_tokens, guarded, recover_from
from .source import SourceChoice, WeightSource
from .weights import WeightFormat, WeightsMode, weight_format

__all__ = ["MIN_ROWS", "ROW_INVARIANT_QTYPES", "BatchedModel", "LaneStep", "RowIO", "RowSampling",
           "Rows", "min_rows"]

MIN_ROWS = 3
"""Rows of the smallest step graph of a model with a product outside :data:`ROW_INVARIANT_QTYPES`.
The workers' packed products run a matrix-vector pass per row up to 2 rows
(``worker.kernels.MATVEC_ROWS``) and a GEMM from 3; for f16/bf16 the two may differ in the last
bits (AMX's GEMM splits the activations into bf16 levels), and float32 weights go through BLAS, so
every step runs 3 rows or more, and a row's products are the same whatever the step's size."""

ROW_INVARIANT_QTYPES = INVARIANT_INTEGER
"""Packed types whose matrix-vector kernels round a row as their GEMM does (``worker.kernels``,
"Batch invariance"; ``tests/test_kernels_batch.py``): a 1-row step computes its row bit for bit
as a row of a larger step."""


def min_rows(gguf: LlamaGGUF, fmt: WeightFormat) -> int:
    """Rows of the smallest step graph of ``gguf`` in format ``fmt``: 1 when every product the
    step graphs run (the layers' weights and the head) is packed in :data:`ROW_INVARIANT_QTYPES`,
    else :data:`MIN_ROWS`. A one-stream decode step then runs one row through the decode kernels
    instead of three through the GEMM (3x the rows, and a GEMM pass over one row costs more than
    the matrix-vector one)."""
    if fmt.mode != "quantized":          # f32 products: BLAS, no per-row promise at any size
        return MIN_ROWS
    cfg = gguf.config
    parts = [p for fused in cfg.spec.fused.values() for p in fused]
    qtypes = {layer_tensor(gguf, i, p).qtype for i in range(cfg.n_layers) for p in parts}
    qtypes.add(head_tensor(gguf).qtype)
    return 1 if qtypes <= ROW_INVARIANT_QTYPES else MIN_ROWS


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How a row picks its token: greedy when ``temperature <= 0``; else the ``counter``-th draw
    of the sequence seeded ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    counter: int = 0


@dataclass(frozen=True, slots=True)
class Rows:
    """One sequence's part of a lane step: ``tokens`` at positions ``start``, ``start + 1``, ...
    of ``slot``; ``sample`` None: no token wanted (a prompt chunk before its last)."""

    slot: int
    tokens: Sequence[int]
    start: int
    sample: RowSampling | None = None


@dataclass(eq=False)
class RowIO(ModeIO):
    """One stage's step tensors for one lane and row count (``pos`` is -1 on padding rows)."""

    kv_idx: RemoteTensor | None = None
    """The cache row each row writes (the scratch row for padding)."""
    base: RemoteTensor | None = None
    """Each row's slot's first cache row."""
    out_idx: RemoteTensor | None = None
    temperature: RemoteTensor | None = None
    top_k: RemoteTensor | None = None
    top_p: RemoteTensor | None = None
    seed: RemoteTensor | None = None
    counter: RemoteTensor | None = None


class LaneStep:
    """A lane step in flight: :meth:`result` waits for it and maps its rows back to slots.

    When it fails as a lost worker fails it, its model recovers (the lost stages re-placed, the
    slots replayed) and issues it again, with every other step still in flight, in their
    order (:meth:`BatchedModel.launch`); :meth:`result` then waits for the new one."""

    def __init__(self, lane: int, parts: Sequence[Rows], logits: bool, rows: int,
                 future: Future[RunResult], recover: Recover | None = None) -> None:
        self.lane = lane
        self.parts = tuple(parts)
        self.future = future
        """The step's last run as issued last (a recovery issues it again)."""
        self.producers = [p.slot for p in parts if p.sample is not None]
        self.logits = logits
        self.rows = rows
        """Rows the step runs (the registered size its rows were padded to)."""
        self.recover = recover
        self.taken = False
        """Its result was taken (it is no longer in flight)."""

    def result(self) -> tuple[dict[int, int], dict[int, np.ndarray]]:
        """The token each producing slot got, and (when asked) its logits row."""
        try:
            fetched = guarded(lambda: self.future.result(), self.recover)
        finally:
            self.taken = True
        tokens = fetched[0].reshape(-1)
        picked = {slot: int(tokens[k]) for k, slot in enumerate(self.producers)}
        rows = {slot: fetched[1][k] for k, slot in enumerate(self.producers)} if self.logits \
            else {}
        return picked, rows


class BatchGraphs(StageGraphs):
    """The row-batched step graphs: :class:`StageGraphs`' layers with per-row attention over the
    slots' cache and a sampling head."""

    def __init__(self, config: LlamaConfig, n_ctx: int, slots: int) -> None:
        super().__init__(config, n_ctx, prefill_chunk=1)
        self.slots = slots
        self.scratch = slots * n_ctx
        """The cache row padding rows write."""

    def make_row_io(self, stage: Stage, rows: int, outs: int) -> RowIO:
        """One small buffer of ``stage``'s step tensors for ``rows`` rows, ``outs`` sampled."""
        d, vocab = self.config.d_model, self.config.vocab_size
        wanted: dict[str, tuple[tuple[int, ...], str]] = {
            "pos": ((rows,), "int32"), "kv_idx": ((rows,), "int32"), "base": ((rows,), "int32"),
            "x_in": ((rows, d), "float32")}
        if not stage.last:
            wanted["x_out"] = ((rows, d), "float32")
        else:
            wanted |= {"out_idx": ((outs,), "int32"), "logits": ((outs, vocab), "float32"),
                       "token": ((outs,), "int32"), "temperature": ((outs,), "float32"),
                       "top_k": ((outs,), "int32"), "top_p": ((outs,), "float32"),
                       "seed": ((outs,), "uint32"), "counter": ((outs,), "int32")}
        return RowIO(**step_buffer(stage, wanted))

    def build_rows(self, stage: Stage, io: RowIO, rows: int) -> Graph:
        """``stage``'s graph over ``rows`` rows reading and writing ``io``."""
        return self.build_layers(stage, io, rows, lambda g, x: self._sample_head(g, x, stage, io))

    def _attention(self, g: Graph, h: GraphTensor, at: Layer, io: ModeIO, T: int,
                   masks: StepMasks, fused: bool) -> GraphTensor:
        """Each row's K and V into its slot's cache row, then ``attend_rows`` (which builds
        each row's mask itself: ``masks`` stays unused)."""
        if not isinstance(io, RowIO):
            raise TypeError("row graphs need a RowIO")
        cfg = self.config
        q, k, v = self._qkv(g, h, at, io, T)
        k_cache, v_cache = at.kv
        g.set_rows(k_cache, k, need(io.kv_idx))
        g.set_rows(v_cache, v, need(io.kv_idx))
        window = cfg.swa_window if cfg.is_swa(at.index) else 0
        att = g.attend_rows(q, k_cache, v_cache, need(io.pos), need(io.base),
                            scale=cfg.kq_scale, window=window)
        return at.weights.linear["wo"].apply(g, g.reshape(att, (T, cfg.n_heads * cfg.head_dim)))

    def _sample_head(self, g: Graph, x: GraphTensor, stage: Stage, io: RowIO) -> None:
        logits = self.logits(g, g.get_rows(x, need(io.out_idx)), stage, io)
        g.sample_rows(logits, need(io.temperature), need(io.top_k), need(io.top_p),
                      need(io.seed), need(io.counter), out=need(io.token))


class BatchedModel:
    """A GGUF model on a list of workers (one pipeline stage each) holding ``slots`` sequences.

    Build it with :meth:`load`; :meth:`launch` issues one lane step; :meth:`close` (or ``with``)
    frees its worker state. The clients stay open and belong to the caller.
    """

    def __init__(self, gguf: LlamaGGUF, clients: Sequence[Client], *, n_ctx: int, slots: int,
                 rows: int, weights: WeightsMode, kv_dtype: KVDType,
                 lanes: int | None = None) -> None:
        cfg = gguf.config
        if not 1 <= n_ctx <= cfg.context_length:
            raise ValueError(f"n_ctx {n_ctx} must be in [1, {cfg.context_length}]")
        if kv_dtype not in ("float32", "float16"):
            raise ValueError(f"kv_dtype must be 'float32' or 'float16', got {kv_dtype!r}")
        self.gguf = gguf
        self.config = cfg
        self.format = weight_format(weights)
        self.stages = make_stages(gguf, self.format, list(clients))
        n_lanes = lanes or len(self.stages)
        if not 1 <= n_lanes <= slots:
            raise ValueError(f"{slots} slot(s) over {n_lanes} lane(s): need 1 <= lanes <= slots")
        self.slots = slots
        self.n_ctx = n_ctx
        self.lane_slots = [list(range(lane, slots, n_lanes)) for lane in range(n_lanes)]
        self.outs = len(self.lane_slots[0])
        """Rows a lane step samples at most: one per slot of the lane."""
        if rows < self.outs:
            raise ValueError(f"rows {rows} must be >= the {self.outs} slot(s) of a lane")
        self.rows = rows
        """Rows one lane step runs at most (its decode rows and prompt chunks)."""
        self.min_rows = min_rows(gguf, self.format)
        """Rows of the smallest step graph (:func:`min_rows`)."""
        if rows < self.min_rows:
            raise ValueError(f"rows {rows} must be >= {self.min_rows}")
        self.sizes = sorted({max(self.min_rows, n) for n in
                             (*(1 << i for i in range(self.outs.bit_length())), self.outs, rows)})
        """The row counts each lane has graphs for (a step runs the smallest that fits)."""
        self.cache = KVCache(gguf, slots * n_ctx, kv_dtype)
        self.graphs = BatchGraphs(cfg, n_ctx, slots)
        self.load_stats: LoadStats | None = None
        self.bytes_sent = 0
        self.recoverer: Recoverer | None = None
        """Re-places a lost worker's layers (set by :meth:`load` unless ``recover=False``)."""
        self.membership: Membership | None = None
        """Workers leaving (draining) and joining, at step boundaries (with the recoverer)."""
        self._fed: dict[int, list[int]] = {}
        """Each live slot's tokens, by position, as its lane steps were launched: what a
        recovery replays (:meth:`release` forgets a slot)."""
        self._flying: list[LaneStep] = []
        """Lane steps launched whose result is not taken yet, in launch order."""
        self._done = 0
        self._closed = False

    @classmethod
    def load(cls, path: str | Path | LlamaGGUF | None, clients: Sequence[Client], *,
             n_ctx: int = 512, slots: int = 8, rows: int | None = None,
             weights: WeightsMode = "quantized", kv_dtype: KVDType = "float16",
             lanes: int | None = None, progress: Progress | None = None,
             status: Status | None = None, sources: SourceChoice = "auto",
             worker_path: str | None = None, recover: bool = True,
             spares: Sequence[Client] = (),
             on_recovery: OnRecovery | None = None) -> BatchedModel:
        """Load the GGUF at ``path`` onto ``clients`` as :meth:`LlamaModel.load
        <.model.LlamaModel.load>` does, for ``slots`` sequences of up to ``n_ctx`` tokens.

        ``rows``: rows one lane step runs at most (default: the lane's slots plus 32 prompt
        tokens); ``lanes``: micro-batches (default: one per stage).

        ``recover``, ``spares``, ``on_recovery``: as :meth:`LlamaModel.load
        <.model.LlamaModel.load>`'s. A lane step that fails as a lost worker fails it
        (:meth:`LaneStep.result`) re-places the lost stages (every lane's graphs of every size
        registered there), replays each live slot's tokens so far as prefill chunks (the step
        graphs are batch-invariant), then issues again every lane step in flight, in order:
        each sequence gets the tokens the fault-free run would have given it, once.

        With ``recover``, a worker that says it is draining has its stages moved off it, and
        one passed to :meth:`add_worker` takes over layers, at the next step boundary
        (:meth:`step_boundary`, which :meth:`launch` calls first): the same way, no step
        failed (:mod:`.membership`)."""
        if not clients:
            raise ValueError("need at least one client")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        gguf = path if isinstance(path, LlamaGGUF) else load_gguf(
            path if path is not None else default_model_path())
        n_lanes = lanes or len(clients)
        default_rows = math.ceil(slots / max(1, min(n_lanes, slots))) + 32
        model = cls(gguf, clients, n_ctx=n_ctx, slots=slots, rows=rows or default_rows,
                    weights=weights, kv_dtype=kv_dtype, lanes=lanes)
        source = WeightSource(gguf, sources, worker_path)
        try:
            model._load(progress, status or (lambda line: None), source)
        except BaseException:
            model.close()
            raise
        if recover:
            model.recoverer = Recoverer(gguf, model.format, source, model, spares, on_recovery,
                                        invariant=True)
            model.membership = Membership(model.recoverer)
        return model

    def _load(self, progress: Progress | None, status: Status, source: WeightSource) -> None:
        """As :meth:`LlamaModel._load <.model.LlamaModel._load>`: everything issued at once,
        waited for once; the lanes' graphs registered while the workers lay out the weights."""
        start = time.perf_counter()
        pending = WeightLoader(self.gguf, self.format, source).start(self.stages, status)
        for stage in self.stages:
            self.cache.allocate(stage)
        pending.wait_fills(progress, status)
        registrations = self._register(self.stages)
        try:
            loaded = pending.wait_builds()
        except Exception:
            self.graphs.collect(registrations, strict=False)
            raise
        status(f"registering {len(registrations)} step graphs on {len(self.stages)} worker(s)")
        self.graphs.collect(registrations)
        self.load_stats = LoadStats(
            weight_bytes=self.gguf.tensor_data_bytes, upload_bytes=loaded.upload_bytes,
            resident_bytes=sum(b.size for s in self.stages for b in s.buffers),
            kv_bytes=sum(s.kv_buffer.size for s in self.stages if s.kv_buffer is not None),
            upload_seconds=loaded.upload_seconds, build_seconds=loaded.build_seconds,
            total_seconds=time.perf_counter() - start, sources=loaded.sources,
            kernel_seconds=loaded.kernel_seconds)

    def _register(self, stages: Sequence[Stage]) -> Registrations:
        """Per stage, lane and size: its step tensors and graph (issued, not waited for)."""
        futures: Registrations = {}
        for stage in stages:
            for lane in range(len(self.lane_slots)):
                for rows in self.sizes:
                    key = _key(lane, rows)
                    io = self.graphs.make_row_io(stage, rows, min(rows, self.outs))
                    stage.io[key] = io
                    futures[stage, key] = stage.client.register_async(
                        self.graphs.build_rows(stage, io, rows))
        return futures

    # ------------------------------------------------------------------------------- steps

    @property
    def lanes(self) -> int:
        return len(self.lane_slots)

    def lane_of(self, slot: int) -> int:
        return slot % self.lanes

    def launch(self, lane: int, parts: Sequence[Rows], *, logits: bool = False) -> LaneStep:
        """Issue one step of ``lane`` running ``parts`` (their slots in the lane, at most
        :attr:`rows` tokens in all); nothing waits. ``logits``: also fetch each sampled row's
        logits (tests). A part at position 0 starts its slot's sequence anew."""
        if self._closed:
            raise RuntimeError("the model is closed")
        self.step_boundary()
        used = sum(len(p.tokens) for p in parts)
        samples = sum(p.sample is not None for p in parts)
        if not 1 <= used <= self.rows:
            raise ValueError(f"a lane step runs 1 to {self.rows} rows, not {used}")
        rows = next(n for n in self.sizes if n >= used and min(n, self.outs) >= samples)
        future = self._issue(lane, parts, rows, logits)
        for part in parts:
            self._record(part)
        step = LaneStep(lane, parts, logits, rows, future,
                        self._recover if self.recoverer is not None else None)
        self._prune()
        self._flying.append(step)
        return step

    def add_worker(self, client: Client) -> None:
        """Have the worker of ``client`` take over layers at the next step boundary (as
        :meth:`LlamaModel.add_worker <.model.LlamaModel.add_worker>`). Any thread may call it."""
        if self._closed:
            raise RuntimeError("the model is closed")
        if self.membership is None:
            raise RuntimeError("add_worker needs a model loaded with recover=True")
        self.membership.add(client)

    def step_boundary(self) -> None:
        """Let draining workers go and added ones join, if any: the lane steps in flight are
        let finish on the stages they were issued to (a draining worker still answers), the
        stages move (:mod:`.membership`), the slots are replayed up to those steps, and the
        steps are issued again in order, as after a recovery. A step in flight that failed
        leaves it to the next boundary (its :meth:`LaneStep.result` recovers first)."""
        membership = self.membership
        if membership is None or not membership.due():
            return
        self._prune()
        if any(step.future.exception() is not None for step in self._flying):
            return
        try:
            membership.run()
        except LOSSES as exc:
            recover_from(exc, self._recover)    # re-issues the steps in flight itself
            return
        for step in self._flying:
            step.future = self._issue(step.lane, step.parts, step.rows, step.logits)

    def release(self, slot: int) -> None:
        """``slot``'s sequence is over: a recovery no longer replays it."""
        self._fed.pop(slot, None)

    def _record(self, part: Rows) -> None:
        """Keep ``part``'s tokens as its slot's at their positions (a gap: the slot's earlier
        positions were never fed by this model, so a recovery cannot replay it)."""
        fed = self._fed.get(part.slot, [] if part.start == 0 else None)
        if fed is None or len(fed) < part.start:
            self._fed.pop(part.slot, None)
            return
        del fed[part.start:]
        fed.extend(part.tokens)
        self._fed[part.slot] = fed

    def _issue(self, lane: int, parts: Sequence[Rows], rows: int,
               logits: bool) -> Future[RunResult]:
        """Issue the runs of one lane step of ``rows`` rows on every stage; its last run."""
        inputs = self._inputs(lane, parts, rows)
        key = _key(lane, rows)
        runs = []
        for stage in self.stages:
            io = stage.io[key]
            assert isinstance(io, RowIO)
            sent = [(need(io.pos), inputs["pos"]), (need(io.kv_idx), inputs["kv_idx"]),
                    (need(io.base), inputs["base"])]
            if stage.first:
                sent.append((need(io.x_in), inputs["x_in"]))
            fetch = []
            if stage.last:
                sent += [(need(getattr(io, name)), inputs[name]) for name in _SAMPLING]
                fetch = [need(io.token)] + ([need(io.logits)] if logits else [])
            self.bytes_sent += sum(a.nbytes for _, a in sent)
            runs.append(LinkedRun(stage.graphs[key], sent, fetch, x=io.x_in, y=io.x_out))
        try:
            chain = run_chain(runs)
        except RpcError as exc:    # a connection already lost: the step's result says so
            return failed(exc)
        return settled_by(chain.runs[-1], chain.runs)

    def _prune(self) -> None:
        """Forget the steps whose result was taken."""
        self._done += sum(s.taken for s in self._flying)
        self._flying = [s for s in self._flying if not s.taken]

    # ----------------------------------------------------------------------------- recovery

    def _recover(self, error: RpcError) -> None:
        """Make the model whole after ``error`` (:meth:`.recovery.Recoverer.recover`: the
        lost stages re-placed and the slots replayed, or nothing when the worker came back),
        then issue every step in flight again, in order."""
        if self.recoverer is None:
            raise error
        self.recoverer.recover(error)
        self._prune()
        for step in self._flying:
            step.future = self._issue(step.lane, step.parts, step.rows, step.logits)

    def steps_done(self) -> int:
        self._prune()
        return self._done

    def allocate_kv(self, stage: Stage) -> None:
        self.cache.allocate(stage)

    def register_stage(self, stage: Stage, like: Stage) -> Registrations:
        """Every lane's graphs of every size (whatever ``like`` had)."""
        return self._register([stage])

    def replay(self, *, as_fed: bool = False) -> int:
        """Write each live slot's tokens again, up to the first position a step in flight
        feeds (those steps are issued again after), as prefill chunks filling each lane's
        steps, all issued at once and waited for. Batch invariance makes them the bits the
        slots held (``as_fed`` is not needed: every size's rows round alike). The tokens
        replayed."""
        self._prune()
        upto = {slot: len(fed) for slot, fed in self._fed.items()}
        for step in self._flying:
            for part in step.parts:
                if part.slot in upto:
                    upto[part.slot] = min(upto[part.slot], part.start)
        futures = [self._issue(lane, parts, self._size(parts), False)
                   for lane in range(self.lanes)
                   for parts in self._replay_steps(lane, upto)]
        for future in futures:
            future.result()
        return sum(upto.values())

    def _replay_steps(self, lane: int, upto: dict[int, int]) -> Iterator[list[Rows]]:
        """``lane``'s replay as steps of at most :attr:`rows` rows, each slot's tokens in
        order (a slot's chunks in consecutive steps)."""
        left = [(slot, 0) for slot in self.lane_slots[lane] if upto.get(slot, 0) > 0]
        while left:
            parts: list[Rows] = []
            room = self.rows
            for k, (slot, at) in enumerate(left):
                if room == 0:
                    break
                n = min(room, upto[slot] - at)
                parts.append(Rows(slot, self._fed[slot][at:at + n], at))
                left[k] = (slot, at + n)
                room -= n
            left = [(slot, at) for slot, at in left if at < upto[slot]]
            yield parts

    def _size(self, parts: Sequence[Rows]) -> int:
        used = sum(len(p.tokens) for p in parts)
        return next(n for n in self.sizes if n >= used)

    def _inputs(self, lane: int, parts: Sequence[Rows], rows: int) -> dict[str, np.ndarray]:
        """The step's row arrays: padding rows at position -1 writing the scratch row."""
        outs = min(rows, self.outs)
        tokens = np.zeros(rows, np.int32)
        pos = np.full(rows, -1, np.int32)
        base = np.zeros(rows, np.int32)
        arrays: dict[str, np.ndarray] = {
            "out_idx": np.zeros(outs, np.int32), "temperature": np.zeros(outs, np.float32),
            "top_k": np.zeros(outs, np.int32), "top_p": np.ones(outs, np.float32),
            "seed": np.zeros(outs, np.uint32), "counter": np.zeros(outs, np.int32)}
        row = out = 0
        for part in parts:
            self._check(lane, part)
            n = len(part.tokens)
            tokens[row:row + n] = part.tokens
            pos[row:row + n] = np.arange(part.start, part.start + n)
            base[row:row + n] = part.slot * self.n_ctx
            if part.sample is not None:
                s = part.sample
                arrays["out_idx"][out] = row + n - 1
                for name in _SAMPLING[1:]:
                    arrays[name][out] = getattr(s, name) if name != "seed" else s.seed % (1 << 32)
                out += 1
            row += n
        kv_idx = np.where(pos >= 0, base + pos, self.graphs.scratch).astype(np.int32)
        return {**arrays, "pos": pos, "base": base, "kv_idx": kv_idx,
                "x_in": embed_tokens(self.gguf, tokens)}

    def _check(self, lane: int, part: Rows) -> None:
        if part.slot not in self.lane_slots[lane]:
            raise ValueError(f"slot {part.slot} is not in lane {lane}")
        if not part.tokens or part.start < 0 or part.start + len(part.tokens) > self.n_ctx:
            raise ValueError(f"{len(part.tokens)} token(s) at position {part.start} do not fit "
                             f"a slot of {self.n_ctx}")
        bad = [t for t in part.tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary of "
                             f"{self.config.vocab_size}")

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def recoveries(self) -> list[Recovery]:
        """Every recovery so far, in order."""
        return [] if self.recoverer is None else self.recoverer.recoveries

    @property
    def registrations(self) -> int:
        """Step graphs registered on the workers (stages x lanes x sizes)."""
        return sum(len(s.graphs) for s in self.stages)

    def close(self) -> None:
        """Free this model's graphs and buffers on every worker (clients stay open). Idempotent."""
        if self._closed:
            return
        self._closed = True
        free_stages(self.stages)

    def __enter__(self) -> BatchedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SAMPLING = ("out_idx", "temperature", "top_k", "top_p", "seed", "counter")


def _key(lane: int, rows: int) -> str:
    return f"lane{lane}.rows{rows}"
