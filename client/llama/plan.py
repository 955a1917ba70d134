"""Planning a model across workers: which layers and GGUF tensors each pipeline stage holds.

One stage per :class:`~zmq_rpc.client.Client`, in order: contiguous layer ranges balanced by the
bytes each stage will hold in the weights mode (:func:`plan_stages`); the last stage also holds the
output norm and the vocabulary tables (the LM head, and ``token_embd`` to embed the token it picks
for chained decoding). :class:`Stage` is the record of one worker's share, filled in by loading
(weights, KV cache) and graph building (step tensors, registered graphs).

Plain data, no sockets: the caller's thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..client import Client, RegisteredGraph, RemoteBuffer, RemoteTensor
from ..gguf_model import GGUFTensor, LlamaConfig, LlamaGGUF
from .weights import MATMUL_QTYPES, LayerWeights, Linear, WeightFormat

__all__ = ["ModeIO", "Stage", "layer_small_tensors", "make_stages", "plan_stages",
           "resident_bytes", "split_stage", "stage_sources"]


def layer_small_tensors(config: LlamaConfig) -> list[str]:
    """A layer's float32 vectors, as ``{part}.{weight|bias}``: its norms (d_model, then the
    per-head ones) and its Q/K/V biases where the file has them."""
    spec = config.spec
    names = [f"{n}.weight" for n in (*spec.layer_norm_names(), *spec.head_norms)]
    return names + ([f"{p}.bias" for p in spec.fused["qkv"]] if config.qkv_bias else [])


@dataclass
class ModeIO:
    """One stage's step tensors for one mode (inputs, hand-off ends, outputs)."""

    pos: RemoteTensor | None = None
    mask: RemoteTensor | None = None
    mask_swa: RemoteTensor | None = None
    """The sliding-window layers' mask (stages holding one of them)."""
    last_idx: RemoteTensor | None = None
    x_in: RemoteTensor | None = None
    x_out: RemoteTensor | None = None
    logits: RemoteTensor | None = None
    token: RemoteTensor | None = None
    x_next: RemoteTensor | None = None
    """The picked token's embedding, the next chained step's first input."""


@dataclass(eq=False)
class Stage:
    """One worker's share: its layers, weights, KV cache, and per-mode I/O and graphs."""

    index: int
    client: Client
    layers: range
    first: bool
    last: bool
    buffers: list[RemoteBuffer] = field(default_factory=list)
    weights: list[LayerWeights] = field(default_factory=list)
    embd: Linear | None = None
    out_norm: RemoteTensor | None = None
    lm_head: Linear | None = None
    rope_freqs: RemoteTensor | None = None
    """The rope frequency factors (Llama 3.x), on every stage of a file that has them."""
    kv: list[tuple[RemoteTensor, RemoteTensor]] = field(default_factory=list)
    kv_buffer: RemoteBuffer | None = None
    io: dict[str, ModeIO] = field(default_factory=dict)
    graphs: dict[str, RegisteredGraph] = field(default_factory=dict)


def layer_tensor(gguf: LlamaGGUF, layer: int, name: str) -> GGUFTensor:
    """GGUF tensor ``blk.{layer}.{name}.weight``."""
    return gguf.tensors[f"blk.{layer}.{name}.weight"]


def vocab_tables(gguf: LlamaGGUF) -> list[str]:
    """Vocabulary tables on the last stage: ``token_embd`` (for get_rows), and the head when it
    is not tied to it."""
    return ["token_embd.weight"] + ([] if gguf.config.tied_output else ["output.weight"])


def head_tensor(gguf: LlamaGGUF) -> GGUFTensor:
    """The LM head: ``token_embd`` when tied (SmolLM2), else ``output``."""
    return gguf.tensors["token_embd.weight" if gguf.config.tied_output else "output.weight"]


def stage_sources(gguf: LlamaGGUF, stage: Stage) -> list[GGUFTensor]:
    """The GGUF tensors a stage holds: its layers', and the head's on the last stage (with
    ``token_embd``, which also embeds the token it picked, for chained decoding)."""
    cfg = gguf.config
    matrices = [f"{p}.weight" for parts in cfg.spec.fused.values() for p in parts]
    names = [f"blk.{i}.{part}" for i in stage.layers
             for part in (*layer_small_tensors(cfg), *matrices)]
    if cfg.rope_freqs:
        names.append("rope_freqs.weight")
    if stage.last:
        names += [*vocab_tables(gguf), "output_norm.weight"]
    return [gguf.tensors[name] for name in names]


def make_stages(gguf: LlamaGGUF, fmt: WeightFormat, clients: Sequence[Client]) -> list[Stage]:
    """One stage per client, layer ranges balanced by the bytes each holds in format ``fmt``.
    Raises ValueError for a matmul weight of a type no format handles, and for a worker that
    lacks what ``fmt`` needs (the packed kernels need numba on the worker)."""
    if fmt.capability:
        for c in clients:
            if fmt.capability not in c.info.capabilities:
                raise ValueError(f"worker {c.endpoint} lacks {fmt.capability!r} (weights={fmt.mode!r} "
                                 "needs numba there: pip install 'zmq-rpc[llm]'); or load with "
                                 "weights='f32'")
    layer_bytes, tables = resident_bytes(gguf, fmt)
    ranges = plan_stages(layer_bytes, 0, tables, len(clients))
    return [Stage(i, c, r, first=i == 0, last=i == len(clients) - 1)
            for i, (c, r) in enumerate(zip(clients, ranges))]


def resident_bytes(gguf: LlamaGGUF, fmt: WeightFormat) -> tuple[list[int], int]:
    """Each layer's matmul weights' bytes on a worker in format ``fmt``, and the vocabulary
    tables' (the last stage's); ValueError for a matmul weight of a type no format handles."""
    def resident(t: GGUFTensor) -> int:
        if t.qtype not in MATMUL_QTYPES:
            raise ValueError(f"{t.name}: matmul weights must be one of {sorted(MATMUL_QTYPES)}, "
                             f"not {t.qtype}")
        return fmt.resident_bytes(t)

    layer_bytes = [sum(resident(layer_tensor(gguf, i, n)) for names in
                       gguf.config.spec.fused.values() for n in names)
                   for i in range(gguf.config.n_layers)]
    return layer_bytes, sum(resident(gguf.tensors[n]) for n in vocab_tables(gguf))


def split_stage(gguf: LlamaGGUF, fmt: WeightFormat, stage: Stage,
                newcomer: Client) -> tuple[Stage, Stage]:
    """``stage`` cut in two, balanced by bytes as :func:`plan_stages` balances a model: its
    first layers stay on its worker, the rest (and the head, if it had it) go to ``newcomer``.
    Each new stage is bare (loaded by the caller); ValueError for a stage of one layer."""
    if len(stage.layers) < 2:
        raise ValueError(f"stage {stage.index} has one layer: nothing to split")
    layer_bytes, tables = resident_bytes(gguf, fmt)
    lower, upper = plan_stages(layer_bytes[stage.layers.start:stage.layers.stop], 0,
                               tables if stage.last else 0, 2)
    at = stage.layers.start
    return (Stage(stage.index, stage.client, range(at + lower.start, at + lower.stop),
                  first=stage.first, last=False),
            Stage(stage.index + 1, newcomer, range(at + upper.start, at + upper.stop),
                  first=False, last=stage.last))


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


def need(tensor: RemoteTensor | None) -> RemoteTensor:
    """A step tensor this stage's layout must have (a bug here, not a user error)."""
    if tensor is None:
        raise RuntimeError("a stage lacks a step tensor its graph needs")
    return tensor
