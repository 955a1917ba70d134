"""Building a model's forward graphs: per stage one registered graph per mode.

``decode`` runs 1 token, ``prefill`` and ``full`` a fixed chunk of T tokens. Each stage's graph
reads its step inputs (embeddings or the previous stage's activations, positions) from a small
per-mode buffer (:class:`~.plan.ModeIO`), so the graphs keep fixed shapes across steps: attention
always reads the whole cache (``n_ctx`` rows) and an additive mask, built in the graph from the
positions (:class:`StepMasks`), hides the rows past each query's position. The last stage ends with the final norm and the LM head; in
``decode`` and ``prefill`` also the argmax and its embedding (``x_next``) for chained decoding.

Graph building is plain data; :meth:`StageGraphs.register_async` issues the registrations from
the caller's thread and :meth:`StageGraphs.collect` waits for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from ..client import RegisteredGraph, RemoteTensor
from ..gguf_model import LlamaConfig
from ..graph import Graph, GraphTensor
from .load import Layout
from .plan import ModeIO, Stage, need
from .weights import LayerWeights

__all__ = ["Layer", "Mode", "Registrations", "StageGraphs", "StepMasks"]

Mode = Literal["decode", "prefill", "full"]
Registrations = dict[tuple[Stage, str], Future[RegisteredGraph]]
"""Each stage's and mode's registration in flight."""


class StageGraphs:
    """The forward graphs of a model's stages, for a context of ``n_ctx`` tokens."""

    def __init__(self, config: LlamaConfig, n_ctx: int, prefill_chunk: int) -> None:
        self.config = config
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk

    def chunk(self, mode: str) -> int:
        """Tokens one step of ``mode`` runs (chunks are padded to it)."""
        return 1 if mode == "decode" else self.prefill_chunk

    def register(self, stages: Sequence[Stage], modes: Sequence[Mode]) -> None:
        """Build and register every stage's graph for each of ``modes`` (pipelined)."""
        self.collect(self.register_async(stages, modes))

    def register_async(self, stages: Sequence[Stage], modes: Sequence[Mode]) -> Registrations:
        """Build every stage's graph for each of ``modes`` and issue its registration; nothing
        waits (:meth:`collect` does)."""
        futures: Registrations = {}
        for stage in stages:
            for mode in modes:
                io = stage.io[mode] = self._make_io(stage, mode)
                futures[stage, mode] = stage.client.register_async(self.build(stage, mode, io))
        return futures

    @staticmethod
    def collect(futures: Registrations, *, strict: bool = True) -> None:
        """Wait for every registration and keep each one that succeeded in its stage's
        ``graphs`` (so that closing the model frees it); then, if ``strict``, raise the first
        failure."""
        errors = []
        for (stage, mode), future in futures.items():
            try:
                stage.graphs[mode] = future.result()
            except Exception as exc:  # noqa: BLE001 - the first one is raised once all are in
                errors.append(exc)
        if errors and strict:
            raise errors[0]

    def _make_io(self, stage: Stage, mode: str) -> ModeIO:
        """One small buffer holding this stage's step tensors for ``mode``."""
        T, d, vocab = self.chunk(mode), self.config.d_model, self.config.vocab_size
        wanted: dict[str, tuple[tuple[int, ...], str]] = {
            "pos": ((T,), "int32"), "x_in": ((T, d), "float32")}
        if "causal-mask" not in stage.client.info.capabilities:    # a worker before 1.13
            wanted["mask"] = ((T, self.n_ctx), "float32")
            if any(self.config.is_swa(i) for i in stage.layers):
                wanted["mask_swa"] = ((T, self.n_ctx), "float32")
        if not stage.last:
            wanted["x_out"] = ((T, d), "float32")
        else:
            wanted["logits"] = ((T if mode == "full" else 1, vocab), "float32")
            if mode != "full":
                wanted["token"] = ((1,), "int32")
                wanted["x_next"] = ((1, d), "float32")
            if mode == "prefill":
                wanted["last_idx"] = ((1,), "int32")
        return ModeIO(**step_buffer(stage, wanted))

    def build(self, stage: Stage, mode: str, io: ModeIO) -> Graph:
        """The graph of ``stage`` for ``mode``, reading and writing ``io``'s tensors."""
        return self.build_layers(stage, io, self.chunk(mode),
                                 lambda g, x: self._head(g, x, stage, mode, io))

    def build_layers(self, stage: Stage, io: ModeIO, T: int,
                     head: Callable[[Graph, GraphTensor], None]) -> Graph:
        """``stage``'s layers over T rows of ``io``; on the last stage, ``head(g, x)`` after."""
        g = Graph()
        x: GraphTensor = g.input(need(io.x_in))
        if stage.first and self.config.spec.embed_scale:     # Gemma: in float32, as llama.cpp
            x = g.scale(x, s=math.sqrt(self.config.d_model))
        n = len(stage.weights)
        fused = "fused-ops" in stage.client.info.capabilities
        masks = StepMasks(g, io, self.n_ctx, self.config.swa_window)
        for k, (layer, kv) in enumerate(zip(stage.weights, stage.kv)):
            at = Layer(stage.layers[k], layer, kv, stage.rope_freqs)
            x = self._block(g, x, at, io, T, masks, out=io.x_out if k == n - 1 else None,
                            fused=fused)
        if stage.last:
            head(g, x)
        return g

    def head_graph(self, stage: Stage) -> Graph:
        """The last stage's decode head alone (final norm, LM head, argmax and its embedding),
        reading the decode ``x_in`` and writing the decode outputs, as the decode graph's end
        does: for timing the head apart from the layers (``zmq-rpc-bench --cases
        llm-families``). Run it only between steps: it overwrites the decode outputs."""
        io = stage.io["decode"]
        g = Graph()
        self._head(g, g.input(need(io.x_in)), stage, "decode", io)
        return g

    def _block(self, g: Graph, x: GraphTensor, at: Layer, io: ModeIO, T: int, masks: StepMasks,
               out: RemoteTensor | None, fused: bool) -> GraphTensor:
        """One transformer layer: x + attention(norm(x)), then + ffn(norm(.)), each sub-layer's
        output normed again where the architecture says so (Gemma). ``fused``: the worker has
        the ``attention`` and ``swiglu`` ops (``fused-ops``)."""
        eps, w = self.config.norm_eps, at.weights
        h = g.mul(g.rms_norm(x, eps=eps), w.attn_norm)
        x = g.add(x, self._post_norm(g, self._attention(g, h, at, io, T, masks, fused), w,
                                     "post_attention_norm"))
        h = g.mul(g.rms_norm(x, eps=eps), w.ffn_norm)
        return g.add(x, self._post_norm(g, self._ffn(g, h, w, fused), w, "post_ffw_norm"),
                     out=out)

    def _post_norm(self, g: Graph, y: GraphTensor, w: LayerWeights, name: str) -> GraphTensor:
        weight = w.extra.get(name)
        return y if weight is None else g.mul(g.rms_norm(y, eps=self.config.norm_eps), weight)

    def _attention(self, g: Graph, h: GraphTensor, at: Layer, io: ModeIO, T: int,
                   masks: StepMasks, fused: bool) -> GraphTensor:
        """A decode step (T = 1) ropes q and k in one node (neighbours in the QKV product, and
        a one-row q stays contiguous) where nothing sits between the product and the rope. On a
        worker with ``fused-ops`` a step attends in one ``attention`` node (a chunk there runs
        the matmul / soft_max / matmul composition over the keys its mask leaves live, not the
        whole cache); elsewhere the graph spells that composition out. Sliding-window layers
        read the step's window mask."""
        cfg, n_ctx, w = self.config, self.n_ctx, at.weights
        n_h, n_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = self._qkv(g, h, at, io, T)
        k_cache, v_cache = at.kv
        g.set_rows(k_cache, k, io.pos)
        g.set_rows(v_cache, v, io.pos)
        mask = masks.get(cfg.is_swa(at.index))
        if fused:
            att = g.attention(q, k_cache[:n_ctx], v_cache[:n_ctx], mask, scale=cfg.kq_scale)
            return w.linear["wo"].apply(g, g.reshape(att, (T, n_h * hd)))
        scores = g.matmul(self._by_kv_head(g, q, T), _heads_first(k_cache[:n_ctx]),
                          transpose_b=True)                     # (n_kv, G T, n_ctx)
        probs = g.soft_max(g.reshape(scores, (n_kv, cfg.gqa_group, T, n_ctx)), mask,
                           scale=cfg.kq_scale)
        att = g.matmul(g.reshape(probs, (n_kv, cfg.gqa_group * T, n_ctx)),
                       _heads_first(v_cache[:n_ctx]))          # (n_kv, G T, hd)
        return w.linear["wo"].apply(g, self._by_token(g, att, T))

    def _qkv(self, g: Graph, h: GraphTensor, at: Layer, io: ModeIO,
             T: int) -> tuple[GraphTensor, GraphTensor, GraphTensor]:
        """q (T, n_h, hd) and k (T, n_kv, hd) roped at ``io.pos``, and v (T, n_kv, hd), of the
        layer's QKV product (with its biases)."""
        cfg, w = self.config, at.weights
        n_h, n_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = w.linear["qkv"].apply(g, h)                       # (T, (n_h + 2 n_kv) hd)
        if "qkv_bias" in w.extra:
            qkv = g.add(qkv, w.extra["qkv_bias"])
        row = qkv.shape[1] * 4
        q, k = self._rope_qk(g, qkv, at, io, T)
        return q, k, g.view(qkv, (T, n_kv, hd), (row, hd * 4, 4), (n_h + n_kv) * hd * 4)

    def _rope_qk(self, g: Graph, qkv: GraphTensor, at: Layer, io: ModeIO,
                 T: int) -> tuple[GraphTensor, GraphTensor]:
        """q (T, n_h, hd) and k (T, n_kv, hd) of the QKV product, each RMS-normed per head
        first where the architecture has those norms (Qwen3, Gemma), then roped with the
        layer's base and scale (and the file's frequency factors)."""
        cfg, w = self.config, at.weights
        n_h, n_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        row = qkv.shape[1] * 4
        base, scale = cfg.layer_rope(at.index)

        def rope(x: GraphTensor) -> GraphTensor:
            return g.rope(x, io.pos, at.rope_freqs, n_dims=cfg.rope_dims, mode=cfg.rope_mode,
                          freq_base=base, freq_scale=scale)

        if T == 1 and "attn_q_norm" not in w.extra:
            qk = rope(g.view(qkv, (T, n_h + n_kv, hd), (row, hd * 4, 4)))
            qk_row = (n_h + n_kv) * hd * 4
            return (g.view(qk, (T, n_h, hd), (qk_row, hd * 4, 4)),
                    g.view(qk, (T, n_kv, hd), (qk_row, hd * 4, 4), n_h * hd * 4))
        q = g.view(qkv, (T, n_h, hd), (row, hd * 4, 4))
        k = g.view(qkv, (T, n_kv, hd), (row, hd * 4, 4), n_h * hd * 4)
        if "attn_q_norm" in w.extra:
            eps = cfg.norm_eps
            q = g.mul(g.rms_norm(q, eps=eps), w.extra["attn_q_norm"])
            k = g.mul(g.rms_norm(k, eps=eps), w.extra["attn_k_norm"])
        return rope(q), rope(k)

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

    def _ffn(self, g: Graph, h: GraphTensor, w: LayerWeights, fused: bool) -> GraphTensor:
        """down(act(gate) * up): SwiGLU (one ``swiglu`` node on a ``fused-ops`` worker), or
        GeGLU with tanh GELU (Gemma)."""
        d_ff, gelu = self.config.d_ff, self.config.spec.ffn_activation == "gelu"
        gate_up = w.linear["gate_up"].apply(g, h)               # (T, 2 d_ff)
        if fused and not gelu:
            return w.linear["down"].apply(g, g.swiglu(gate_up))
        T, row = gate_up.shape[0], gate_up.shape[1] * 4
        gate = g.view(gate_up, (T, d_ff), (row, 4))
        up = g.view(gate_up, (T, d_ff), (row, 4), d_ff * 4)
        act = g.gelu(gate, approximate="tanh") if gelu else g.silu(gate)
        return w.linear["down"].apply(g, g.mul(act, up))

    def _head(self, g: Graph, x: GraphTensor, stage: Stage, mode: str, io: ModeIO) -> None:
        """Final norm, LM head into ``io.logits``; then, but for "full", the argmax into
        ``io.token`` and its embedding into ``io.x_next``.

        Prefill keeps only the last real token's row (``io.last_idx``: chunks are padded)."""
        if stage.lm_head is None or stage.embd is None:
            raise RuntimeError("the last stage has no LM head")
        if mode == "prefill":
            x = g.get_rows(x, io.last_idx)
        logits = self.logits(g, x, stage, io)
        if mode != "full":
            token = g.argmax(logits, out=io.token)
            stage.embd.rows(g, token, out=io.x_next)

    def logits(self, g: Graph, x: GraphTensor, stage: Stage, io: ModeIO) -> GraphTensor:
        """Final norm and LM head of rows ``x`` into ``io.logits`` (soft-capped where the
        architecture says so)."""
        if stage.lm_head is None:
            raise RuntimeError("the last stage has no LM head")
        h = g.mul(g.rms_norm(x, eps=self.config.norm_eps), need(stage.out_norm))
        cap = self.config.logit_softcap
        logits = stage.lm_head.apply(g, h, out=None if cap else io.logits)
        if cap:                                     # cap * tanh(logits / cap), as llama.cpp
            logits = g.scale(g.tanh(g.scale(logits, s=1.0 / cap)), s=cap, out=io.logits)
        return logits


@dataclass(frozen=True, slots=True)
class Layer:
    """What one layer's part of a graph reads: its index in the model, weights, KV cache and
    the stage's rope factors (None for most files)."""

    index: int
    weights: LayerWeights
    kv: tuple[RemoteTensor, RemoteTensor]
    rope_freqs: RemoteTensor | None


class StepMasks:
    """One graph's additive attention masks (T, n_ctx), each made once, where a layer first
    asks: built on the worker from the step's positions (``causal_mask``, protocol 1.13), or,
    on an older worker, the ones the client writes into the step buffer every step (``io.mask``,
    ``io.mask_swa``)."""

    def __init__(self, g: Graph, io: ModeIO, n_ctx: int, window: int) -> None:
        self.g, self.io, self.n_ctx, self.window = g, io, n_ctx, window
        self._made: dict[bool, GraphTensor] = {}

    def get(self, swa: bool) -> GraphTensor | RemoteTensor:
        """The mask of a sliding-window layer (``swa``) or of a full-attention one."""
        sent = self.io.mask_swa if swa else self.io.mask
        if sent is not None:
            return sent
        if swa not in self._made:
            self._made[swa] = self.g.causal_mask(need(self.io.pos), n_ctx=self.n_ctx,
                                                 window=self.window if swa else 0)
        return self._made[swa]


def step_buffer(stage: Stage, wanted: dict[str, tuple[tuple[int, ...], str]]
                ) -> dict[str, RemoteTensor]:
    """One buffer on ``stage``'s worker holding the named step tensors ``wanted`` (name: shape,
    dtype), kept in the stage's buffers (freed with the model); the tensors by name."""
    layout = Layout()
    for name, (shape, dtype) in wanted.items():
        layout.add(name, shape, dtype)
    buffer = stage.client.alloc_buffer_nowait(layout.size)
    stage.buffers.append(buffer)
    return layout.bind(buffer)


def _heads_first(cache: RemoteTensor) -> RemoteTensor:
    """(n_ctx, n_kv_heads, hd) cache rows -> a (n_kv_heads, n_ctx, hd) strided view."""
    return cache.permute(1, 0, 2)
