""":class:`LlamaModel`: a GGUF model (any of :data:`~zmq_rpc.client.architectures.ARCHITECTURES`)
placed on a list of workers as a pipeline, one stage each.

The model composes the parts, each in its own module: planning the stages (:mod:`.plan`), the
weights mode (:mod:`.weights`), loading (:mod:`.load`), the forward graphs (:mod:`.graph`), the KV
cache and step scheduler (:mod:`.runtime`), generation (:mod:`.decode`) and recovery from a lost
worker (:mod:`.recovery`). It owns their lifecycle: load, use, recover, close.

Threads: the caller's thread; continuations run in done-callbacks on the clients' I/O threads and
only issue requests. A model is used by one thread at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from ...broker.errors import RpcError
from ..client import Client, RunResult
from ..gguf_model import LlamaConfig, LlamaGGUF, default_model_path, load_gguf
from .decode import Generator
from .graph import Mode, StageGraphs
from .load import LoadStats, Progress, WeightLoader
from .membership import Membership
from .plan import Stage, make_stages
from .recovery import OnRecovery, Recoverer, Recovery
from .runtime import KVCache, StepRunner, StepStat, free_stages, guarded
from .source import SourceChoice, WeightSource
from .weights import WeightsMode, weight_format

__all__ = ["KVDType", "LlamaModel", "Status", "free_stages"]

log = logging.getLogger("zmq_rpc.client.llama")

KVDType = Literal["float32", "float16"]
Status = Callable[[str], None]
"""``status(line)``: what loading is doing now, for a screen (one line each phase)."""


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
        if kv_dtype not in ("float32", "float16"):
            raise ValueError(f"kv_dtype must be 'float32' or 'float16', got {kv_dtype!r}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.gguf = gguf
        self.config: LlamaConfig = cfg
        self.format = weight_format(weights)
        self.weights: WeightsMode = self.format.mode
        self.kv_dtype: KVDType = kv_dtype
        self.load_stats: LoadStats | None = None
        self.cache = KVCache(gguf, n_ctx, kv_dtype)
        self.graphs = StageGraphs(cfg, n_ctx, prefill_chunk)
        self.runner = StepRunner(gguf, make_stages(gguf, self.format, list(clients)), self.graphs,
                                 self.cache)
        self.generator = Generator(self.runner, cfg.eos_id)
        self.recoverer: Recoverer | None = None
        """Re-places a lost worker's layers (set by :meth:`load` unless ``recover=False``)."""
        self.membership: Membership | None = None
        """Workers leaving (draining) and joining, at step boundaries (with the recoverer)."""
        self._upload_bytes = 0
        self._closed = False

    # ------------------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str | Path | LlamaGGUF | None, clients: Sequence[Client], *,
             n_ctx: int = 512, weights: WeightsMode = "quantized", kv_dtype: KVDType = "float16",
             prefill_chunk: int = 32, progress: Progress | None = None,
             status: Status | None = None, sources: SourceChoice = "auto",
             worker_path: str | None = None, recover: bool = True,
             spares: Sequence[Client] = (),
             on_recovery: OnRecovery | None = None) -> LlamaModel:
        """Load the GGUF at ``path`` (None: :func:`default_model_path`; or an already opened
        :class:`LlamaGGUF`) onto ``clients``.

        One pipeline stage per client, in order. ``weights="quantized"`` (the default) keeps the
        uploaded blocks quantized, repacked once on each worker for its numba kernels (workers
        need numba: the ``packed-kernels`` capability); ``"f32"`` dequantizes them once on each
        worker (~5x the memory, slower decoding). ``kv_dtype``: the KV cache's element type,
        float16 by default (half the bytes, llama.cpp's default too; the workers' attention reads
        it as it is, within 3 % of float32's speed: docs/DESIGN.md), float32 where logits must
        follow a float32 reference closely. ``progress(done, total)`` reports upload
        bytes as they are acknowledged; ``status(line)`` each later phase as it starts.

        ``sources``: where each worker gets its weights (:mod:`.source`): ``"auto"`` takes the
        worker's own copy of the file when it has it (``--model-dir``; ``worker_path`` names it
        there, default the file's name), else its tensor cache (``--cache-dir``), else uploads;
        ``load_stats.sources`` says what each worker did.

        ``recover`` (the default): when a worker is lost during a step (prefill, decode,
        generate), its layers are re-placed onto ``spares`` (first one with the memory), else
        onto the surviving worker with the most free memory, loaded there from the same
        ``sources``, the sequence replayed into the caches, and the step goes on: greedy output
        is the fault-free run's (:mod:`.recovery`). ``on_recovery(recovery)`` is told each
        time (:class:`~.recovery.Recovery`: what moved where, detection, load and re-prefill
        seconds). When the layers fit nowhere, :class:`~zmq_rpc.client.RecoveryFailed` (a
        ``ConnectionLost``) says what would fit. ``recover=False``: a lost worker fails the
        step with ``ConnectionLost`` as in docs/FAILURES.md.

        With ``recover``, workers may also leave and join on purpose (:mod:`.membership`): a
        worker that says it is draining (SIGTERM with ``--drain-timeout``) has its layers moved
        off it at the next step boundary, as a recovery would, and its client closed; a worker
        passed to :meth:`add_worker` takes over layers at the next step boundary. Both are
        reported to ``on_recovery`` (kind ``"drained"``, ``"joined"``); no step fails.
        """
        if not clients:
            raise ValueError("need at least one client")
        gguf = path if isinstance(path, LlamaGGUF) else load_gguf(
            path if path is not None else default_model_path())
        model = cls(gguf, clients, n_ctx=n_ctx, weights=weights, kv_dtype=kv_dtype,
                    prefill_chunk=prefill_chunk)
        source = WeightSource(gguf, sources, worker_path)
        try:
            model._load(progress, status or (lambda line: None), source)
        except BaseException:
            model.close()
            raise
        if recover:
            model.recoverer = Recoverer(gguf, model.format, source, model.runner, spares,
                                        on_recovery)
            model.generator.recover = model.recoverer.recover
            model.membership = Membership(model.recoverer)
            model.generator.boundary = model.membership
        return model

    def _load(self, progress: Progress | None, status: Status, source: WeightSource) -> None:
        """Everything is issued as early as it can be (each worker runs its requests in order)
        and waited for once: the weights' fills and builds, then the KV cache; while the
        workers lay the weights out, the client builds the stage graphs and registers them
        (not during the upload: the caller's thread would hold the GIL that the I/O thread
        sends with). No warm-up run: the kernels are compiled before the upload, the graphs'
        numba kernels prepared and their runs bound when they are registered, the buffers
        populated when allocated, so the first prefill and decode cost what the next ones
        do."""
        start = time.perf_counter()
        pending = WeightLoader(self.gguf, self.format, source).start(self.stages, status)
        for stage in self.stages:
            self.cache.allocate(stage)
        pending.wait_fills(progress, status)
        registrations = self.graphs.register_async(self.stages, ("decode", "prefill"))
        try:
            loaded = pending.wait_builds()
        except Exception:
            self.graphs.collect(registrations, strict=False)   # close() frees what registered
            raise
        status(f"allocating the KV cache and registering graphs on {len(self.stages)} worker(s)")
        self.graphs.collect(registrations)
        self._upload_bytes = loaded.upload_bytes
        self.load_stats = LoadStats(
            weight_bytes=self.gguf.tensor_data_bytes, upload_bytes=loaded.upload_bytes,
            resident_bytes=sum(b.size for s in self.stages for b in s.buffers),
            kv_bytes=sum(s.kv_buffer.size for s in self.stages if s.kv_buffer is not None),
            upload_seconds=loaded.upload_seconds, build_seconds=loaded.build_seconds,
            total_seconds=time.perf_counter() - start, sources=loaded.sources,
            kernel_seconds=loaded.kernel_seconds)

    # ------------------------------------------------------------------------- running steps

    def reset(self) -> None:
        """Forget the sequence: position 0, caches zeroed on the workers (queued, not waited)."""
        self._check_open()
        self.runner.reset()

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids`` at the current position; logits (vocab,) of the last one."""
        return self._run("prefill", token_ids, fetch_each=False)[-1][0].reshape(-1)

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; its logits (vocab,)."""
        return self._run("decode", [token_id], fetch_each=False)[-1][0].reshape(-1)

    def forward_full(self, token_ids: Sequence[int]) -> np.ndarray:
        """Recompute ``token_ids`` from position 0 (reset first); logits of every position.

        Runs the ``full`` graphs (registered on first use), chunk by chunk; the cache ends up
        holding the sequence, as after :meth:`prefill`.
        """
        self.reset()
        if "full" not in self.stages[0].graphs:
            self.graphs.register(self.stages, ("full",))
        results = self._run("full", token_ids, fetch_each=True)
        return np.concatenate([r[0] for r in results])[:len(token_ids)]

    def _run(self, mode: Mode, token_ids: Sequence[int], *, fetch_each: bool) -> list[RunResult]:
        self._check_open()

        def step() -> list[RunResult]:
            self.step_boundary()
            return self.runner.run_chunks(mode, token_ids, fetch_each=fetch_each)
        return guarded(step, self._recover)

    def add_worker(self, client: Client) -> None:
        """Have the worker of ``client`` take over layers at the next step boundary: the stage
        with the most layers is split with it (:mod:`.membership`: why that policy), the
        sequence replayed, and the generation goes on with the output it would have had.
        Any thread may call it; the client then belongs to the model's pipeline (the caller
        still closes it). ValueError for a worker already in the model or lacking what the
        weights need; RuntimeError for a model loaded with ``recover=False``."""
        self._check_open()
        if self.membership is None:
            raise RuntimeError("add_worker needs a model loaded with recover=True")
        self.membership.add(client)

    def step_boundary(self) -> None:
        """Let draining workers go and added ones join now, if any (every step does this
        first; a caller idle between steps may call it to do it sooner)."""
        self._check_open()
        if self.membership is not None and self.membership.due():
            guarded(self.membership.run, self._recover)

    def _recover(self, error: RpcError) -> None:
        if self.recoverer is None:
            raise error
        self.recoverer.recover(error)

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
        self._check_open()
        return self.generator.generate(prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                       seed, stream, stop_ids)

    def embed(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The input embeddings (T, d_model) float32 of ``token_ids``, read here from the mapped
        GGUF (like llama.cpp, which keeps the input layer on the host): only the rows asked for
        are dequantized, and the first worker needs no embedding table."""
        return self.runner.embed(token_ids)

    # ----------------------------------------------------------------------------- reading

    @property
    def stages(self) -> list[Stage]:
        """The pipeline's stages, in order (a recovery replaces a lost worker's)."""
        return self.runner.stages

    @property
    def recoveries(self) -> list[Recovery]:
        """Every recovery so far, in order."""
        return [] if self.recoverer is None else self.recoverer.recoveries

    @property
    def n_ctx(self) -> int:
        return self.cache.n_ctx

    @property
    def n_past(self) -> int:
        """Tokens of the sequence in the cache."""
        return self.cache.n_past

    @property
    def prefill_chunk(self) -> int:
        return self.graphs.prefill_chunk

    @property
    def stats(self) -> list[StepStat]:
        """One record per prefill/decode/full call and per chained decoded token."""
        return self.runner.stats

    @property
    def chain_greedy(self) -> bool:
        """Greedy decoding feeds each token back worker to worker (False: one client round trip
        per token)."""
        return self.generator.chain_greedy

    @chain_greedy.setter
    def chain_greedy(self, value: bool) -> None:
        self.generator.chain_greedy = value

    @property
    def bytes_sent(self) -> int:
        """Bytes sent to the workers: the weights' upload and every step's inputs."""
        return self._upload_bytes + self.runner.bytes_sent

    @property
    def bytes_received(self) -> int:
        """Bytes of step results fetched back."""
        return self.runner.bytes_received

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
        free_stages(self.stages)

    def __enter__(self) -> LlamaModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layers = ", ".join(f"{s.client.endpoint}: layers {s.layers.start}-{s.layers.stop - 1}"
                           for s in self.stages)
        return f"LlamaModel({self.weights}, n_ctx={self.n_ctx}, [{layers}])"
