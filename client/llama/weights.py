"""How a llama's matmul weights live on the workers: the one seam a new weights mode plugs into.

A :class:`WeightFormat` answers every question that depends on the weights mode: how many bytes a
weight holds on its worker (stage planning balances on it), the shape and dtype it is laid out in,
the worker-side op that lays the uploaded GGUF blocks out that way (loading), and the op a stage
graph multiplies by it (graph building). The rest of the model never looks at the mode:

- ``"quantized"`` (:class:`PackedWeights`, the default): the blocks stay quantized, repacked once
  on the worker (``pack``) into the layout of its numba kernels (``worker/kernels/layout.py``,
  1.05-1.2x the file's bytes); every matmul runs them (``mul_mat_packed``). Any type the kernels
  know: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. Needs the workers'
  ``packed-kernels`` capability (numba).
- ``"f32"`` (:class:`F32Weights`): the blocks are dequantized once on the worker (``unpack`` of
  the packed form, or ``dequantize`` for Q8_0/Q4_1); every matmul reads f32 (~5x the memory).

Weights the graphs use as one product (a layer's Q/K/V, its gate/up) are stacked by rows into one
resident matrix wherever the format can hold them as one (:meth:`WeightFormat.groups`: f32 always,
packed blocks only where the parts share a type and row size); a stack of several such groups is a
:class:`StackedLinear`, whose product concatenates the groups' products, so the graphs see one
(T, rows) result either way. llama.cpp's Q4_K_M files mix types inside a layer (``attn_v`` and
``ffn_down`` one step up, Q5_0/Q8_0 where rows are not a multiple of 256): they load as two or
three products per stack; files whose stacks agree keep one matmul each.

A new mode is one subclass here and one entry in :data:`WEIGHT_FORMATS`. Plain data, no sockets:
any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ...broker.ops import PACKED_BLOCKS, QUANT_BLOCKS
from ..client import RemoteTensor
from ..gguf_model import GGUFTensor
from ..graph import Graph, GraphTensor

__all__ = ["MATMUL_QTYPES", "WEIGHT_FORMATS", "F32Weights", "LayerWeights", "Linear",
           "PackedWeights", "Product", "StackedLinear", "WeightFormat", "WeightsMode", "weight_format"]

WeightsMode = Literal["f32", "quantized"]

MATMUL_QTYPES = frozenset(PACKED_BLOCKS)
"""GGUF types a matmul weight may have (F32 matmul weights are not supported)."""


@dataclass(frozen=True, slots=True)
class Linear:
    """A weight (out, in) used as ``x @ W.T``: f32 (``qtype="none"``), or packed blocks."""

    tensor: RemoteTensor
    qtype: str = "none"

    def apply(self, g: Graph, x: GraphTensor, out: RemoteTensor | None = None) -> GraphTensor:
        """``x @ W.T`` in graph ``g`` (into ``out`` if given)."""
        if self.qtype == "none":
            return g.matmul(x, self.tensor, transpose_b=True, out=out)
        return g.mul_mat_packed(x, self.tensor, qtype=self.qtype, out=out)

    def rows(self, g: Graph, idx: GraphTensor, out: RemoteTensor | None = None) -> GraphTensor:
        """Rows ``idx`` of the weight as float32 (an embedding table's lookup)."""
        if self.qtype == "none":
            return g.get_rows(self.tensor, idx, out=out)
        return g.get_rows_packed(self.tensor, idx, qtype=self.qtype, out=out)


@dataclass(frozen=True, slots=True)
class StackedLinear:
    """Weights stacked by rows that no one resident matrix holds (packed blocks of different
    types or row sizes): each part is multiplied on its own and the products are concatenated
    along the output axis, as one stacked matrix's product would lay them out."""

    parts: tuple[Linear, ...]

    def apply(self, g: Graph, x: GraphTensor, out: RemoteTensor | None = None) -> GraphTensor:
        """``x @ [W_0; W_1; ...].T`` in graph ``g``: (T, sum of the parts' rows)."""
        products = [part.apply(g, x) for part in self.parts]
        return g.concat(*products, axis=1, out=out)


Product = Linear | StackedLinear
"""What a stage graph multiplies by: one resident matrix, or several stacked by their outputs."""


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer layer's weights on its worker: two norms, the fused linears (``qkv``,
    ``wo``, ``gate_up``, ``down``) and the vectors only some architectures have (``extra``:
    ``post_attention_norm``, ``post_ffw_norm``, ``attn_q_norm``, ``attn_k_norm``,
    ``qkv_bias``)."""

    attn_norm: RemoteTensor
    ffn_norm: RemoteTensor
    linear: dict[str, Product]
    extra: dict[str, RemoteTensor] = field(default_factory=dict)


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

    capability = ""
    """What each worker must advertise (HELLO capabilities) for this format; "" for nothing."""

    def groups(self, tensors: Sequence[GGUFTensor]) -> list[list[GGUFTensor]]:
        """``tensors`` (weights stacked by rows, in order) cut into consecutive runs that each
        fill one resident matrix: runs of one :meth:`stack_key`."""
        runs: list[list[GGUFTensor]] = []
        for t in tensors:
            if runs and self.stack_key(runs[-1][-1]) == self.stack_key(t):
                runs[-1].append(t)
            else:
                runs.append([t])
        return runs

    def stack_key(self, tensor: GGUFTensor) -> tuple[object, ...]:
        """Weights stack into one resident matrix when their keys agree: by default, when they
        share a type and row size."""
        return tensor.qtype, tensor.shape[-1]

    def fill(self, g: Graph, sources: list[RemoteTensor], qtypes: Sequence[str],
             dst: RemoteTensor) -> None:
        """Add to ``g`` the ops laying uploaded GGUF weights ``sources`` (of ``qtypes``, one per
        source, stacked by rows in this order: one of :meth:`groups`' runs) out in ``dst``."""
        raise NotImplementedError

    def linear(self, tensor: RemoteTensor, qtype: str) -> Linear:
        """The matmul weight laid out in ``tensor`` from GGUF blocks of ``qtype``."""
        raise NotImplementedError

    def kernel_qtypes(self, qtypes: Iterable[str]) -> set[str]:
        """Which of ``qtypes`` :meth:`fill` hands to the worker's numba kernels (``pack``): their
        first use on a machine compiles them (see :class:`~.load.WeightLoader`)."""
        return set()

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

    def stack_key(self, tensor: GGUFTensor) -> tuple[object, ...]:
        """Dequantized rows of any types stack into one f32 matrix (of one row size)."""
        return (tensor.shape[-1],)

    def fill(self, g: Graph, sources: list[RemoteTensor], qtypes: Sequence[str],
             dst: RemoteTensor) -> None:
        row = 0
        for src, qtype in zip(sources, qtypes, strict=True):
            part = dst[row:row + src.shape[0]] if len(sources) > 1 else dst
            if qtype in QUANT_BLOCKS:
                g.dequantize(src, qtype=qtype, out=part)
            elif qtype == "f16":
                g.cpy(src, part)
            else:      # the kernels' dequantizer knows every other type (numba on the worker)
                g.unpack(g.pack(src, qtype=qtype), qtype=qtype, out=part)
            row += src.shape[0]

    def linear(self, tensor: RemoteTensor, qtype: str) -> Linear:
        return Linear(tensor)

    def kernel_qtypes(self, qtypes: Iterable[str]) -> set[str]:
        return {q for q in qtypes if q in PACKED_BLOCKS and q not in QUANT_BLOCKS and q != "f16"}


class PackedWeights(WeightFormat):
    """Repacked once on the worker into the numba kernels' layout; each matmul runs them."""

    mode: WeightsMode = "quantized"
    dtype = "uint8"
    capability = "packed-kernels"

    def resident_bytes(self, tensor: GGUFTensor) -> int:
        return self.resident_shape(tensor, tensor.data.shape[0])[0] * self._row_bytes(tensor)

    def resident_shape(self, tensor: GGUFTensor, rows: int) -> tuple[int, int]:
        return rows, self._row_bytes(tensor)

    @staticmethod
    def _row_bytes(tensor: GGUFTensor) -> int:
        per_block, _, packed_bytes = PACKED_BLOCKS[tensor.qtype]
        return tensor.shape[-1] // per_block * packed_bytes

    def fill(self, g: Graph, sources: list[RemoteTensor], qtypes: Sequence[str],
             dst: RemoteTensor) -> None:
        """Stacked weights (one type: :meth:`groups`) are concatenated (in the graph's scratch)
        and packed as one: the packed layout interleaves rows, so it cannot be filled a slice at
        a time."""
        qtype = qtypes[0]
        stacked = g.concat(*sources, axis=0) if len(sources) > 1 else sources[0]
        g.pack(stacked, qtype=qtype, out=dst)

    def linear(self, tensor: RemoteTensor, qtype: str) -> Linear:
        return Linear(tensor, qtype)

    def kernel_qtypes(self, qtypes: Iterable[str]) -> set[str]:
        return {q for q in qtypes if q in PACKED_BLOCKS}


WEIGHT_FORMATS: dict[str, type[WeightFormat]] = {"quantized": PackedWeights, "f32": F32Weights}


def weight_format(mode: str) -> WeightFormat:
    """The format of weights mode ``mode``; a ValueError naming the modes for anything else."""
    try:
        return WEIGHT_FORMATS[mode]()
    except (KeyError, TypeError):
        raise ValueError(f"weights must be one of {sorted(WEIGHT_FORMATS)}, got {mode!r}") from None
