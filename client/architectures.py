"""The model architectures we run, each described as data: its tensors and its graph's options.

One :class:`Architecture` per GGUF ``general.architecture`` value we support. The metadata keys
are the architecture's own (``{arch}.block_count`` ...), the tensor names llama.cpp's converter
writes, and the graph options the stage graphs (:mod:`~zmq_rpc.client.llama.graph`) switch on;
llama.cpp's per-architecture graph files (``src/models/{arch}.cpp``) are the authority on each:

- ``llama`` (Llama 2/3, SmolLM, Mistral): rope "normal" (the converter permutes Q/K rows into
  interleaved pairs); Llama 3.x's rope scaling as the ``rope_freqs`` factors the converter writes.
- ``qwen2`` (Qwen 2.5): rope "neox", biases on Q/K/V (any architecture's file may carry
  ``attn_q.bias``/``attn_k.bias``/``attn_v.bias``, as llama.cpp reads them for all).
- ``qwen3``: rope "neox", per-head RMS norms of Q and K (``attn_q_norm``/``attn_k_norm``) before
  the rope, no biases.
- ``gemma3``: rope "neox"; embeddings scaled by sqrt(d_model); RMS norms as stored (the converter
  already added Gemma's +1); norms after attention and after the FFN too; per-head Q/K norms;
  GeGLU with tanh GELU; sliding-window attention in the layers where ``il % pattern <
  pattern - 1`` (pattern 6 unless ``attention.sliding_window_pattern`` says otherwise), with the
  rope base ``rope.freq_base_swa`` (10000 by default) there; optional final logit softcapping.
- ``phi3``: rope "neox" (partial where ``rope.dimension_count`` < head size); one fused
  ``attn_qkv`` and one ``ffn_up`` holding gate then up; llama.cpp runs its sliding window as
  global attention, and so do we.

Plain data, no state: any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal

__all__ = ["ARCHITECTURES", "Architecture", "FfnActivation", "RopeMode", "architecture"]

RopeMode = Literal["normal", "neox"]
FfnActivation = Literal["silu", "gelu"]

_SPLIT_FUSED: Final = MappingProxyType({
    "qkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)})


@dataclass(frozen=True, slots=True, kw_only=True)
class Architecture:
    """What one architecture's GGUF holds and how its layers compute."""

    name: str
    rope_mode: RopeMode
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: _SPLIT_FUSED)
    """Per layer: the products the graph runs (``qkv``, ``wo``, ``gate_up``, ``down``) and the
    GGUF tensors stacked by rows into each (Q then K then V; gate then up)."""
    norms: tuple[str, ...] = ("attn_norm", "ffn_norm")
    """Per-layer RMS norm weights of d_model."""
    head_norms: tuple[str, ...] = ()
    """Per-head RMS norm weights of head size (``attn_q_norm``, ``attn_k_norm``), before rope."""
    post_norms: bool = False
    """``post_attention_norm`` / ``post_ffw_norm`` applied to each sub-layer's output (Gemma)."""
    ffn_activation: FfnActivation = "silu"
    """The gate's activation: SiLU (SwiGLU) or tanh GELU (GeGLU)."""
    embed_scale: bool = False
    """Input embeddings multiplied by sqrt(d_model) (Gemma)."""
    swa_pattern: int = 0
    """Sliding-window layers: ``il % n < n - 1`` for this n (0: none), when the file gives a
    window; ``attention.sliding_window_pattern`` overrides it."""
    rope_freqs: bool = False
    """A ``rope_freqs`` tensor (Llama 3.x's rope scaling factors) may be present."""

    def layer_norm_names(self) -> tuple[str, ...]:
        """Every per-layer norm weight of d_model."""
        return self.norms + (("post_attention_norm", "post_ffw_norm") if self.post_norms else ())


ARCHITECTURES: Final[Mapping[str, Architecture]] = MappingProxyType({
    "llama": Architecture(name="llama", rope_mode="normal", rope_freqs=True),
    "qwen2": Architecture(name="qwen2", rope_mode="neox"),
    "qwen3": Architecture(name="qwen3", rope_mode="neox",
                          head_norms=("attn_q_norm", "attn_k_norm")),
    "gemma3": Architecture(name="gemma3", rope_mode="neox", post_norms=True,
                           head_norms=("attn_q_norm", "attn_k_norm"), ffn_activation="gelu",
                           embed_scale=True, swa_pattern=6),
    "phi3": Architecture(name="phi3", rope_mode="neox", fused=MappingProxyType({
        "qkv": ("attn_qkv",), "wo": ("attn_output",), "gate_up": ("ffn_up",),
        "down": ("ffn_down",)})),
})
"""Every architecture we load, by its ``general.architecture``."""


def architecture(name: str) -> Architecture:
    """The description of ``name``; a ValueError naming the supported ones for anything else."""
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise ValueError(f"unsupported architecture {name!r}: supported are "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return spec
