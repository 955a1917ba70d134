"""Build computation graphs on the client; run them on a worker in one message.

A :class:`Graph` records ops over :class:`~zmq_rpc.client.RemoteTensor` inputs. Every op infers its
result's shape and dtype at once with the same rules the worker applies (:mod:`zmq_rpc.broker.ops`),
so a mistake raises :class:`~zmq_rpc.broker.ops.OpError` here, before anything is sent. A result
either lands in a RemoteTensor you name (``out=``) or stays in the worker's scratch arena.

    g = Graph()
    h = g.rms_norm(x, eps=1e-5) * w            # GraphTensor values; operators build ops
    g.matmul(h, W, transpose_b=True, out=y)    # y = h @ W.T written into RemoteTensor y
    client.compute(g)                          # or: handle = client.register(g); client.run(handle)

Plain data, no sockets: any thread may build graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..broker.graph import GraphSpec, Node, tensor_meta
from ..broker.ops import OPS, OpError, OpKind, TensorMeta, infer
from ..broker.protocol import TensorRef

Operand = "GraphTensor | Any"


class GraphTensor:
    """A value inside a :class:`Graph`: an external RemoteTensor or a node's result."""

    __slots__ = ("graph", "index", "meta")

    def __init__(self, graph: Graph, index: int, meta: TensorMeta) -> None:
        self.graph = graph
        self.index = index
        self.meta = meta

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> str:
        return self.meta.dtype

    def __repr__(self) -> str:
        where = f"node {self.index}" if self.index >= 0 else f"input {-1 - self.index}"
        return f"GraphTensor({self.dtype}{list(self.shape)}, {where})"

    # Operators: another GraphTensor, a RemoteTensor of the same worker, or a real number (int,
    # float, numpy scalar) on either side. numpy defers to these (``__array_ufunc__ = None``), so
    # ``np.float32(0.5) * x`` builds a node and ``array + x`` is refused with a TypeError.
    __array_ufunc__ = None

    def __add__(self, other: Any) -> GraphTensor:
        return self.graph.add(self, other)

    def __radd__(self, other: Any) -> GraphTensor:
        return self.graph.add(other, self)

    def __sub__(self, other: Any) -> GraphTensor:
        return self.graph.sub(self, other)

    def __rsub__(self, other: Any) -> GraphTensor:
        return self.graph.sub(other, self)

    def __mul__(self, other: Any) -> GraphTensor:
        return self.graph.mul(self, other)

    def __rmul__(self, other: Any) -> GraphTensor:
        return self.graph.mul(other, self)

    def __truediv__(self, other: Any) -> GraphTensor:
        return self.graph.div(self, other)

    def __rtruediv__(self, other: Any) -> GraphTensor:
        return self.graph.div(other, self)

    def __matmul__(self, other: Any) -> GraphTensor:
        return self.graph.matmul(self, other)

    def __rmatmul__(self, other: Any) -> GraphTensor:
        return self.graph.matmul(other, self)

    def __neg__(self) -> GraphTensor:
        return self.graph.neg(self)

    @property
    def T(self) -> GraphTensor:
        return self.graph.transpose(self)

    def reshape(self, *shape: int) -> GraphTensor:
        return self.graph.reshape(self, shape)


class Graph:
    """An ordered list of ops over one worker's tensors (a DAG by construction)."""

    def __init__(self) -> None:
        self.tensors: list[TensorRef] = []
        self.nodes: list[Node] = []
        self.metas: list[TensorMeta] = []
        self.client: Any = None
        self._external: dict[TensorRef, int] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def spec(self) -> GraphSpec:
        """The graph as the wire sees it."""
        if not self.nodes:
            raise OpError("an empty graph has nothing to run")
        return GraphSpec(tuple(self.tensors), tuple(self.nodes))

    # ------------------------------------------------------------------------ building

    def input(self, tensor: Any, op: str = "input") -> GraphTensor:
        """Use a RemoteTensor in this graph (ops do this implicitly). Anything else but a value
        of this graph is a TypeError naming ``op`` and the type."""
        if isinstance(tensor, GraphTensor):
            if tensor.graph is not self:
                raise OpError("a GraphTensor from another graph")
            return tensor
        ref = getattr(tensor, "ref", None)
        if not isinstance(ref, TensorRef):          # a RemoteTensor has one
            raise TypeError(_not_a_tensor(op, tensor))
        self._bind(tensor.client)
        index = self._external.get(ref)
        if index is None:
            index = self._external[ref] = len(self.tensors)
            self.tensors.append(ref)
        return GraphTensor(self, -1 - index, tensor_meta(ref))

    def _bind(self, client: Any) -> None:
        if self.client is None:
            self.client = client
        elif self.client is not client:
            raise OpError(f"one graph runs on one worker: {client.endpoint} is not "
                          f"{self.client.endpoint}")

    def op(self, name: str, *inputs: Any, out: Any = None, **params: Any) -> GraphTensor:
        """Append ``name(inputs, **params)``; its result goes into RemoteTensor ``out`` if given."""
        values = [self.input(x, name) for x in inputs]
        meta, _ = infer(name, [v.meta for v in values], params)
        dst = -1
        if out is not None:
            if isinstance(out, GraphTensor):
                raise OpError(f"{name}: out= takes a RemoteTensor, not a value of the graph")
            if OPS[name].kind is not OpKind.COMPUTE:
                raise OpError(f"{name}: only computing ops take out= (use cont(..., out=) to land "
                              "a view, cpy to write into an existing tensor)")
            if tuple(out.shape) != meta.shape:
                raise OpError(f"{name}: result shape {meta.shape} does not fit output tensor "
                              f"{tuple(out.shape)}")
            dst = -1 - self.input(out, name).index
        self.nodes.append(Node(name, tuple(v.index for v in values), _wire_params(params), dst))
        self.metas.append(meta)
        return GraphTensor(self, len(self.nodes) - 1, meta)

    # ---------------------------------------------------------------- the op set, typed

    def get_rows(self, table: Any, idx: Any, *, qtype: str = "none", out: Any = None) -> GraphTensor:
        return self.op("get_rows", table, idx, qtype=qtype, out=out)

    def add(self, a: Any, b: Any, *, out: Any = None) -> GraphTensor:
        """``a + b`` (broadcasting); either may be a real number (a ``scale`` node with a bias)."""
        if _scalar(b) is not None or _scalar(a) is not None:
            x, c = _tensor_and_scalar("add", a, b)
            return self.scale(x, 1.0, bias=c, out=out)
        return self.op("add", a, b, out=out)

    def sub(self, a: Any, b: Any, *, out: Any = None) -> GraphTensor:
        """``a - b`` (broadcasting); either may be a real number."""
        if _scalar(b) is not None:
            return self.scale(a, 1.0, bias=-_real("sub", b), out=out)
        if _scalar(a) is not None:
            return self.scale(b, -1.0, bias=_real("sub", a), out=out)
        return self.op("sub", a, b, out=out)

    def mul(self, a: Any, b: Any, *, out: Any = None) -> GraphTensor:
        """``a * b`` (broadcasting); either may be a real number (a ``scale`` node)."""
        if _scalar(b) is not None or _scalar(a) is not None:
            x, c = _tensor_and_scalar("mul", a, b)
            return self.scale(x, c, out=out)
        return self.op("mul", a, b, out=out)

    def div(self, a: Any, b: Any, *, out: Any = None) -> GraphTensor:
        """``a / b`` (broadcasting); ``b`` may be a real number (``a * (1 / b)`` in float32)."""
        if _scalar(a) is not None:
            raise TypeError(f"div: {type(a).__name__} / tensor has no op (there is no reciprocal);"
                            " upload the numerator as a tensor")
        if _scalar(b) is not None:
            if _real("div", b) == 0.0:
                raise TypeError("div: division by the number 0 (op parameters are finite)")
            return self.scale(a, 1.0 / _real("div", b), out=out)
        return self.op("div", a, b, out=out)

    def scale(self, x: Any, s: float, *, bias: float = 0.0, out: Any = None) -> GraphTensor:
        """``x * s + bias``; a nonzero ``bias`` needs a worker with ``scale-bias`` (protocol 1.3)."""
        if bias == 0.0:
            return self.op("scale", x, s=float(s), out=out)
        value = self.input(x, "scale")
        if self.client is not None and "scale-bias" not in self.client.info.capabilities:
            raise OpError(f"{self.client.endpoint} predates protocol 1.3: its scale op takes no "
                          "bias, so a graph cannot add a number there; upgrade the worker")
        return self.op("scale", value, s=float(s), b=float(bias), out=out)

    def neg(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("neg", x, out=out)

    def abs(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("abs", x, out=out)

    def sqr(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("sqr", x, out=out)

    def sqrt(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("sqrt", x, out=out)

    def exp(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("exp", x, out=out)

    def log(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("log", x, out=out)

    def tanh(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("tanh", x, out=out)

    def relu(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("relu", x, out=out)

    def silu(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("silu", x, out=out)

    def sigmoid(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("sigmoid", x, out=out)

    def gelu(self, x: Any, *, approximate: str = "none", out: Any = None) -> GraphTensor:
        """GELU, exact by default (``x * Phi(x)`` with erf, as PyTorch and BERT compute it);
        ``approximate="tanh"`` for the tanh approximation (GPT-2, ggml's default)."""
        if approximate not in ("none", "erf", "tanh"):
            raise OpError(f"gelu: approximate must be 'none' (exact, erf) or 'tanh', "
                          f"got {approximate!r}")
        return self.op("gelu", x, approximate="tanh" if approximate == "tanh" else "erf", out=out)

    def matmul(self, a: Any, b: Any, *, transpose_b: bool = False, out: Any = None) -> GraphTensor:
        """Batched ``a @ b`` (``a @ b.T`` with transpose_b, for weights stored (out, in))."""
        return self.op("matmul", a, b, transpose_b=transpose_b, out=out)

    def mul_mat_q(self, x: Any, wq: Any, *, qtype: str, out: Any = None) -> GraphTensor:
        """``x @ dequantize(wq).T`` for a ggml-quantized weight (uint8 blocks), fused."""
        return self.op("mul_mat_q", x, wq, qtype=qtype, out=out)

    def pack(self, w: Any, *, qtype: str, out: Any = None) -> GraphTensor:
        """Repack a GGUF weight (uint8 blocks, or float16/bfloat16 rows) into the layout of
        :meth:`mul_mat_packed`: uint8 (rows, packed row bytes), sized by ``ops.PACKED_BLOCKS``."""
        return self.op("pack", w, qtype=qtype, out=out)

    def mul_mat_packed(self, x: Any, wp: Any, *, qtype: str, out: Any = None) -> GraphTensor:
        """``x @ W.T`` for a weight packed by :meth:`pack` (the worker's numba kernels; needs the
        worker's ``packed-kernels`` capability)."""
        return self.op("mul_mat_packed", x, wp, qtype=qtype, out=out)

    def unpack(self, wp: Any, *, qtype: str, out: Any = None) -> GraphTensor:
        """A packed weight (:meth:`pack`) as float32 rows."""
        return self.op("unpack", wp, qtype=qtype, out=out)

    def get_rows_packed(self, table: Any, idx: Any, *, qtype: str, out: Any = None) -> GraphTensor:
        """Rows ``idx`` of a packed table (:meth:`pack`), dequantized to float32."""
        return self.op("get_rows_packed", table, idx, qtype=qtype, out=out)

    def dequantize(self, q: Any, *, qtype: str, out: Any = None) -> GraphTensor:
        return self.op("dequantize", q, qtype=qtype, out=out)

    def rms_norm(self, x: Any, *, eps: float, out: Any = None) -> GraphTensor:
        return self.op("rms_norm", x, eps=float(eps), out=out)

    def layer_norm(self, x: Any, weight: Any = None, bias: Any = None, *, eps: float,
                   out: Any = None) -> GraphTensor:
        extra = [t for t in (weight, bias) if t is not None]
        if bias is not None and weight is None:
            raise OpError("layer_norm: a bias needs a weight")
        return self.op("layer_norm", x, *extra, eps=float(eps), out=out)

    def soft_max(self, x: Any, mask: Any = None, *, scale: float = 1.0,
                 out: Any = None) -> GraphTensor:
        extra = [] if mask is None else [mask]
        return self.op("soft_max", x, *extra, scale=float(scale), out=out)

    def rope(self, x: Any, pos: Any, freq_factors: Any = None, *, n_dims: int,
             mode: str = "normal", freq_base: float = 10000.0, freq_scale: float = 1.0,
             out: Any = None) -> GraphTensor:
        """Rotary embedding of x (..., T, H, D) at positions pos (T,) int32; ``freq_factors``
        (n_dims / 2,) divide the frequencies (Llama 3.x; needs ``rope-factors``, protocol
        1.11)."""
        extra = []
        if freq_factors is not None:
            if self.client is not None and "rope-factors" not in self.client.info.capabilities:
                raise OpError(f"{self.client.endpoint} predates protocol 1.11: its rope op "
                              "takes no freq_factors; upgrade the worker")
            extra.append(freq_factors)
        return self.op("rope", x, pos, *extra, n_dims=n_dims, mode=mode,
                       freq_base=float(freq_base), freq_scale=float(freq_scale), out=out)

    def attention(self, q: Any, k: Any, v: Any, mask: Any = None, *, scale: float = 1.0,
                  out: Any = None) -> GraphTensor:
        """``softmax(scale * q k^T + mask) v`` per query row and head: q (T, H, D), k and v
        (S, H_kv, D) with query head h reading KV head ``h // (H / H_kv)`` (grouped-query
        attention), mask broadcasting to (T, S); float32 (T, H, D). Keys whose mask is -inf do
        not count (the CPU kernel does not read them). Needs ``fused-ops`` (protocol 1.7)."""
        self._need_fused("attention")
        extra = [] if mask is None else [mask]
        return self.op("attention", q, k, v, *extra, scale=float(scale), out=out)

    def swiglu(self, x: Any, *, out: Any = None) -> GraphTensor:
        """``silu(x[..., :n]) * x[..., n:]`` for x (..., 2n) (a llama FFN's fused gate-up
        product, gate first). Needs ``fused-ops`` (protocol 1.7)."""
        self._need_fused("swiglu")
        return self.op("swiglu", x, out=out)

    def attend_rows(self, q: Any, k_cache: Any, v_cache: Any, pos: Any, base: Any, *,
                    scale: float = 1.0, window: int = 0, out: Any = None) -> GraphTensor:
        """Attention for rows of many sequences at once: row b of q (B, H, D) float32 attends
        to the cache rows ``base[b] + j`` of k_cache and v_cache (R, H_kv, D) (float32 or
        float16) for ``j`` from ``max(0, pos[b] - window + 1)`` (0 when ``window`` is 0) to
        ``pos[b]``; pos and base (B,) int32; ``pos[b] < 0`` is a padding row (zeros). The
        worker builds the causal mask from pos (none crosses the wire) and checks that every
        row stays inside the cache. Batch-invariant: a row's result does not depend on the
        other rows. Needs ``row-attention`` (protocol 1.12)."""
        self._need_rows("attend_rows")
        return self.op("attend_rows", q, k_cache, v_cache, pos, base, scale=float(scale),
                       window=int(window), out=out)

    def sample_rows(self, logits: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any,
                    counter: Any, *, out: Any = None) -> GraphTensor:
        """One token id (int32) per row of logits (B, V) float32, drawn on the worker:
        temperature (B,) float32 (<= 0: argmax), top_k (B,) int32 (0: all; 1: argmax), top_p
        (B,) float32, seed (B,) uint32 and counter (B,) int32 (the sequence's step: a row's
        token depends only on its logits, seed and counter). The exact rule is the worker's
        ``numpy_ops._sample_rows``. Needs ``row-attention`` (protocol 1.12)."""
        self._need_rows("sample_rows")
        return self.op("sample_rows", logits, temperature, top_k, top_p, seed, counter, out=out)

    def causal_mask(self, pos: Any, *, n_ctx: int, window: int = 0,
                    out: Any = None) -> GraphTensor:
        """The additive attention mask (T, n_ctx) float32 of query rows at positions pos (T,)
        int32: row t is 0 for the keys ``j <= pos[t]`` (and ``pos[t] - j < window`` where
        ``window`` > 0, llama.cpp's sliding window) and -inf elsewhere; a position outside
        ``[0, n_ctx)`` (a padding row) hides every key. Built on the worker from the positions,
        so no mask crosses the wire. Needs ``causal-mask`` (protocol 1.13)."""
        if self.client is not None and "causal-mask" not in self.client.info.capabilities:
            raise OpError(f"{self.client.endpoint} predates protocol 1.13: it has no causal_mask "
                          "op; upgrade the worker (or send the mask as an input)")
        return self.op("causal_mask", pos, n_ctx=int(n_ctx), window=int(window), out=out)

    def _need_rows(self, op: str) -> None:
        if self.client is not None and "row-attention" not in self.client.info.capabilities:
            raise OpError(f"{self.client.endpoint} predates protocol 1.12: it has no {op} op; "
                          "upgrade the worker")

    def _need_fused(self, op: str) -> None:
        if self.client is not None and "fused-ops" not in self.client.info.capabilities:
            raise OpError(f"{self.client.endpoint} predates protocol 1.7: it has no {op} op; "
                          "upgrade the worker (or build the graph from unfused ops)")

    def reshape(self, x: Any, shape: Sequence[int]) -> GraphTensor:
        return self.op("reshape", x, shape=list(shape))

    def view(self, x: Any, shape: Sequence[int], strides: Sequence[int],
             offset: int = 0) -> GraphTensor:
        """A byte-strided view of a contiguous value (like ggml_view)."""
        return self.op("view", x, shape=list(shape), strides=list(strides), offset=offset)

    def permute(self, x: Any, axes: Sequence[int]) -> GraphTensor:
        return self.op("permute", x, axes=list(axes))

    def transpose(self, x: Any) -> GraphTensor:
        """Swap the last two axes (a view)."""
        return self.op("transpose", x)

    def cont(self, x: Any, *, out: Any = None) -> GraphTensor:
        return self.op("cont", x, out=out)

    def concat(self, *xs: Any, axis: int, out: Any = None) -> GraphTensor:
        return self.op("concat", *xs, axis=axis, out=out)

    def cpy(self, src: Any, dst: Any) -> GraphTensor:
        """Write src into existing tensor dst, converting dtype (how a KV cache is written)."""
        return self.op("cpy", src, dst)

    def set_rows(self, dst: Any, src: Any, idx: Any) -> GraphTensor:
        """dst[idx[i]] = src[i] into an existing tensor; index values are checked at run time."""
        return self.op("set_rows", dst, src, idx)

    def sum(self, x: Any, *, axis: int | Sequence[int], keepdims: bool = False,
            out: Any = None) -> GraphTensor:
        return self.op("sum", x, axis=_axis(axis), keepdims=keepdims, out=out)

    def mean(self, x: Any, *, axis: int | Sequence[int], keepdims: bool = False,
             out: Any = None) -> GraphTensor:
        return self.op("mean", x, axis=_axis(axis), keepdims=keepdims, out=out)

    def argmax(self, x: Any, *, out: Any = None) -> GraphTensor:
        """Index of the largest element along the last axis (int32)."""
        return self.op("argmax", x, out=out)

    def diag_mask_inf(self, x: Any, *, n_past: int, out: Any = None) -> GraphTensor:
        """Causal mask: x[..., i, j] = -inf where j > n_past + i."""
        return self.op("diag_mask_inf", x, n_past=n_past, out=out)


def _scalar(value: Any) -> float | None:
    """``value`` as a float when it is a real number (not a bool), else None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        return None
    if isinstance(value, np.complexfloating):
        return None
    return float(value)


def _real(op: str, value: Any) -> float:
    number = _scalar(value)
    if number is None:
        raise TypeError(_not_a_tensor(op, value))
    return number


def _tensor_and_scalar(op: str, a: Any, b: Any) -> tuple[Any, float]:
    """The tensor and the number of a commutative op with one real-number operand."""
    if _scalar(a) is not None and _scalar(b) is not None:
        raise TypeError(f"{op}: two numbers ({a!r}, {b!r}); a graph op needs a tensor")
    return (b, _real(op, a)) if _scalar(a) is not None else (a, _real(op, b))


def _not_a_tensor(op: str, value: Any) -> str:
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" \
        else kind.__qualname__
    if isinstance(value, np.ndarray):
        return (f"{op}: a {name} operand cannot join a graph (graphs run on the worker): upload "
                f"it into a RemoteTensor (client.set_tensor) and use that")
    return (f"{op}: operands are GraphTensors, RemoteTensors of the graph's worker or real "
            f"numbers, not {name}")


def _axis(axis: int | Sequence[int]) -> Any:
    return axis if isinstance(axis, int) else list(axis)


def _wire_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}
