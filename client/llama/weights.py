"""How a llama's matmul weights live on the workers: the one seam a new weights mode plugs into.

A :class:`WeightFormat` answers every question that depends on the weights mode: how many bytes a
weight holds on its worker (stage planning balances on it), the shape and dtype it is laid out in,
the worker-side op that lays the uploaded GGUF blocks out that way (loading), and the op a stage
graph multiplies by it (graph building). The rest of the model never looks at the mode:

- ``"f32"`` (:class:`F32Weights`): the blocks are dequantized once on the worker; every matmul
  reads f32 (faster steps, ~5x the memory of the blocks);
- ``"quantized"`` (:class:`QuantizedWeights`): the blocks are kept as the file has them (uint8
  rows of ggml blocks) and dequantized inside every matmul (``mul_mat_q``).

A new mode (a repacked block layout with its own kernel, say) is one subclass here and one entry
in :data:`WEIGHT_FORMATS`. Plain data, no sockets: any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...broker.ops import QUANT_BLOCKS
from ..client import RemoteTensor
from ..gguf_model import GGUFTensor
from ..graph import Graph, GraphTensor

__all__ = ["WEIGHT_FORMATS", "F32Weights", "LayerWeights", "Linear", "QuantizedWeights",
           "WeightFormat", "WeightsMode", "weight_format"]

WeightsMode = Literal["f32", "quantized"]


@dataclass(frozen=True, slots=True)
class Linear:
    """A weight (out, in) used as ``x @ W.T``: f32 (``qtype="none"``), or ggml blocks."""

    tensor: RemoteTensor
    qtype: str = "none"

    def apply(self, g: Graph, x: GraphTensor, out: RemoteTensor | None = None) -> GraphTensor:
        """``x @ W.T`` in graph ``g`` (into ``out`` if given)."""
        if self.qtype == "none":
            return g.matmul(x, self.tensor, transpose_b=True, out=out)
        return g.mul_mat_q(x, self.tensor, qtype=self.qtype, out=out)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer layer's weights on its worker: two norms and the fused linears
    (``qkv``, ``wo``, ``gate_up``, ``down``)."""

    attn_norm: RemoteTensor
    ffn_norm: RemoteTensor
    linear: dict[str, Linear]


class WeightFormat:
    """The resident form of matmul weights; subclasses are the weights modes."""

    mode: WeightsMode
    dtype: str
    """The dtype a matmul weight is laid out in on its worker."""

    def resident_bytes(self, tensor: GGUFTensor) -> int:
        """Bytes ``tensor`` (a matmul weight) holds on its worker."""
        raise NotImplementedError

    def resident_shape(self, tensor: GGUFTensor, rows: int) -> tuple[int, int]:
        """The 2-d shape ``rows`` rows like ``tensor``'s are laid out in."""
        raise NotImplementedError

    def fill(self, g: Graph, src: RemoteTensor, qtype: str, dst: RemoteTensor) -> None:
        """Add to ``g`` the op laying uploaded GGUF bytes ``src`` (of ``qtype``) out in ``dst``."""
        g.cpy(src, dst)

    def linear(self, tensor: RemoteTensor, qtype: str) -> Linear:
        """The matmul weight laid out in ``tensor`` from GGUF blocks of ``qtype``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.mode


class F32Weights(WeightFormat):
    """Dequantized once on the worker at load time; plain f32 matmuls."""

    mode: WeightsMode = "f32"
    dtype = "float32"

    def resident_bytes(self, tensor: GGUFTensor) -> int:
        return 4 * tensor.n_elements

    def resident_shape(self, tensor: GGUFTensor, rows: int) -> tuple[int, int]:
        return rows, tensor.shape[-1]

    def fill(self, g: Graph, src: RemoteTensor, qtype: str, dst: RemoteTensor) -> None:
        if qtype in QUANT_BLOCKS:
            g.dequantize(src, qtype=qtype, out=dst)
        else:
            g.cpy(src, dst)

    def linear(self, tensor: RemoteTensor, qtype: str) -> Linear:
        return Linear(tensor)


class QuantizedWeights(WeightFormat):
    """The file's blocks as they are; each matmul dequantizes them (``mul_mat_q``)."""

    mode: WeightsMode = "quantized"
    dtype = "uint8"

    def resident_bytes(self, tensor: GGUFTensor) -> int:
        return tensor.nbytes

    def resident_shape(self, tensor: GGUFTensor, rows: int) -> tuple[int, int]:
        return rows, tensor.data.shape[1]

    def linear(self, tensor: RemoteTensor, qtype: str) -> Linear:
        return Linear(tensor, qtype)


WEIGHT_FORMATS: dict[str, type[WeightFormat]] = {"f32": F32Weights, "quantized": QuantizedWeights}


def weight_format(mode: str) -> WeightFormat:
    """The format of weights mode ``mode``; a ValueError naming the modes for anything else."""
    try:
        return WEIGHT_FORMATS[mode]()
    except (KeyError, TypeError):
        raise ValueError(f"weights must be one of {sorted(WEIGHT_FORMATS)}, got {mode!r}") from None
