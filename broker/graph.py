"""Computation graphs on the wire: encoding, structural validation and shape inference.

Pure functions and immutable data, shared by the client (which infers shapes so that mistakes fail
before anything is sent) and the worker (which validates again before anything runs).

Wire form (a msgpack value inside a request header; ``GRAPH_VERSION`` is its first element)::

    [GRAPH_VERSION,
     [tensor, ...],                       external tensors: [buffer, dtype, shape, strides, offset]
     [[op, [src, ...], {param: value}, dst], ...]]     nodes, in topological order

A ``src`` >= 0 names an earlier node's result (so a graph cannot have a cycle); a ``src`` < 0 names
external tensor ``-1 - src``. ``dst`` is -1 (the result stays in the worker's scratch arena) or the
index of an external tensor the result is written into (same shape; dtype converted).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import peer
from .errors import BadRequest
from .limits import MAX_NODES
from .ops import OPS, OpError, OpKind, TensorMeta, infer
from .wire import (
    ErrorCode,
    Message,
    TensorRef,
    _f,
    _int_in,
    check_handle,
    check_tensor,
    describe,
    draining_field,
    list_of,
    timing_field,
    wire_message,
)

GRAPH_VERSION = 1
MAX_TENSORS = 4096
"""External tensors of one graph (a llama layer reads ~11: weights and its KV cache)."""
MAX_PARAMS = 32


@dataclass(frozen=True, slots=True)
class Node:
    """One op applied to earlier results (``src >= 0``) or external tensors (``src < 0``)."""

    op: str
    srcs: tuple[int, ...]
    params: dict[str, Any]
    dst: int = -1

    def to_wire(self) -> list[Any]:
        return [self.op, list(self.srcs), self.params, self.dst]


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """A whole graph: the external tensors it touches and its nodes in topological order."""

    tensors: tuple[TensorRef, ...]
    nodes: tuple[Node, ...]

    def to_wire(self) -> list[Any]:
        return [GRAPH_VERSION, [t.to_wire() for t in self.tensors],
                [n.to_wire() for n in self.nodes]]


def _bad(why: str) -> BadRequest:
    return BadRequest(f"graph: {why}", code=ErrorCode.GRAPH_INVALID)


def check_graph(value: Any, field: str = "graph") -> GraphSpec:
    """Decode and structurally validate a wire graph (no shapes yet: see :func:`infer_graph`)."""
    if type(value) is not list or len(value) != 3:
        raise _bad("expected [version, tensors, nodes]")
    version, tensors, nodes = value
    if version != GRAPH_VERSION:
        raise _bad(f"encoding version {describe(version)}, this side speaks {GRAPH_VERSION}")
    if type(tensors) is not list or len(tensors) > MAX_TENSORS:
        raise _bad(f"at most {MAX_TENSORS} external tensors")
    if type(nodes) is not list or not 0 < len(nodes) <= MAX_NODES:
        raise _bad(f"a graph has 1 to {MAX_NODES} nodes, got "
                   f"{len(nodes) if type(nodes) is list else '?'}")
    refs = tuple(check_tensor(t, f"{field}.tensors[{i}]") for i, t in enumerate(tensors))
    return GraphSpec(refs, tuple(_check_node(n, i, len(refs)) for i, n in enumerate(nodes)))


def _check_node(value: Any, index: int, n_tensors: int) -> Node:
    if type(value) is not list or len(value) != 4:
        raise _bad(f"node {index}: expected [op, srcs, params, dst]")
    op, srcs, params, dst = value
    if type(op) is not str or op not in OPS:
        raise _bad(f"node {index}: unknown op {describe(op, 40)}")
    if type(srcs) is not list or len(srcs) > 64 or any(type(s) is not int for s in srcs):
        raise _bad(f"node {index}: srcs must be a list of integers")
    for src in srcs:
        if not (-n_tensors <= src < index):
            raise _bad(f"node {index}: src {src} is neither an earlier node nor an external "
                       "tensor (nodes may only use earlier results: no cycles)")
    if type(params) is not dict or len(params) > MAX_PARAMS or \
            any(type(k) is not str for k in params):
        raise _bad(f"node {index}: params must be a map of names to values")
    if type(dst) is not int or not -1 <= dst < n_tensors:
        raise _bad(f"node {index}: dst {describe(dst)} is not -1 or an external tensor index")
    return Node(op, tuple(srcs), params, dst)


def tensor_meta(ref: TensorRef) -> TensorMeta:
    """What the op rules need to know of an external tensor."""
    return TensorMeta(ref.shape, ref.dtype.dtype_name, ref.is_contiguous())


def infer_graph(spec: GraphSpec) -> tuple[list[TensorMeta], list[dict[str, Any]]]:
    """Every node's output meta and normalized params, checking each op's rules and each dst.

    Raises BadRequest (code GRAPH_INVALID) naming the node.
    """
    external = [tensor_meta(t) for t in spec.tensors]
    metas: list[TensorMeta] = []
    params: list[dict[str, Any]] = []
    for index, node in enumerate(spec.nodes):
        inputs = [metas[s] if s >= 0 else external[-1 - s] for s in node.srcs]
        try:
            meta, normalized = infer(node.op, inputs, node.params)
        except OpError as exc:
            raise _bad(f"node {index}: {exc}") from None
        _check_dst(spec, index, node, meta)
        metas.append(meta)
        params.append(normalized)
    return metas, params


def _check_dst(spec: GraphSpec, index: int, node: Node, meta: TensorMeta) -> None:
    if node.dst < 0:
        return
    kind = OPS[node.op].kind
    if kind is OpKind.INPLACE:
        raise _bad(f"node {index}: {node.op} writes into its destination input; it takes no dst")
    if kind is OpKind.VIEW:
        raise _bad(f"node {index}: {node.op} makes a view and writes nothing; to land it in a "
                   "tensor, add cont(..., out=) or cpy")
    target = spec.tensors[node.dst]
    if target.shape != meta.shape:
        raise _bad(f"node {index}: result shape {meta.shape} does not match its output tensor "
                   f"{target.shape}")


def external_srcs(spec: GraphSpec) -> Sequence[int]:
    """Indices of the external tensors the graph reads or writes."""
    return sorted({-1 - s for n in spec.nodes for s in n.srcs if s < 0} |
                  {n.dst for n in spec.nodes if n.dst >= 0})


# ------------------------------------------------------------------------------ messages

MAX_IO = 256
_check_refs = list_of(check_tensor, MAX_IO)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRegister(Message):
    """Validate ``graph`` and keep it under the client-chosen ``handle`` for cheap reruns."""

    handle: int = _f(check_handle)
    graph: GraphSpec = _f(check_graph)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRun(Message):
    """Run registered graph ``handle``: first write ``inputs`` (one payload frame each, C order),
    then run, then return the bytes of each ``fetch`` tensor as reply frames."""

    handle: int = _f(check_handle)
    inputs: list[TensorRef] = _f(_check_refs)
    fetch: list[TensorRef] = _f(_check_refs)

    def payload_sizes(self) -> list[int]:
        return [t.nbytes for t in self.inputs]


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GraphCompute(Message):
    """Validate and run ``graph`` once (GRAPH_RUN semantics for inputs and fetch)."""

    graph: GraphSpec = _f(check_graph)
    inputs: list[TensorRef] = _f(_check_refs)
    fetch: list[TensorRef] = _f(_check_refs)

    def payload_sizes(self) -> list[int]:
        return [t.nbytes for t in self.inputs]


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GraphReply(Message):
    """A graph ran: one payload frame per fetched tensor, of these sizes."""

    sizes: list[int] = _f(list_of(check_handle, MAX_IO))
    compute_ns: int = _f(check_handle)
    """How long the worker spent running the graph's nodes."""
    timing: tuple[int, ...] = timing_field()
    draining: bool = draining_field()
    """1.14: the worker is leaving (see :func:`~.wire.draining_field`): a model moves its
    layers off it at its next step boundary."""

    def payload_sizes(self) -> list[int]:
        return list(self.sizes)


MAX_HOLD_REPLY_US = 1_000_000
MAX_KEPT = 256
"""Kept runs per session (GRAPH_RUN_LINKED's ``keep``): ids 0..255..."""
MAX_KEPT_TENSORS = 16
"""...each naming at most this many tensors (inputs, fetches and hand-offs together): what a
session can make its worker keep stays small."""
check_hold_reply = _int_in(0, MAX_HOLD_REPLY_US)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRunLinked(Message):
    """GRAPH_RUN of graph ``handle`` after the ``receive`` hand-offs have landed (within
    ``timeout_ms``), followed by the ``send`` hand-offs; see :mod:`zmq_rpc.broker.peer`."""

    handle: int = _f(check_handle)
    inputs: list[TensorRef] = _f(_check_refs)
    fetch: list[TensorRef] = _f(_check_refs)
    receive: tuple[peer.Receive, ...] = _f(peer.check_receives)
    send: tuple[peer.Send, ...] = _f(peer.check_sends)
    timeout_ms: int = _f(peer.check_timeout)
    hold_reply_us: int = _f(check_hold_reply, since=(1, 2), default=0)
    """The worker may hold the reply this long after pushing the sends (sooner when another
    reply goes out): a pipelining client that does not wait on it keeps the reply's wake-ups
    off the hand-off's path. 0: reply at once."""
    receive_from: tuple[str, ...] = _f(peer.check_sources, since=(1, 9), default=())
    """1.9 (``peer-link-watch``): per ``receive`` entry, the sending worker's peer endpoint
    ("" for none): the worker watches its own link to each and fails the run with
    PEER_UNREACHABLE once the link a pending receive needs is lost. Empty: none watched."""
    keep: int = _f(_int_in(-1, MAX_KEPT - 1), since=(1, 15), default=-1)
    """1.15 (``kept-runs``): the session also keeps this run, tokens aside, under id ``keep``
    (replacing what it kept there), for GRAPH_RUN_KEPT to repeat; at most
    ``MAX_KEPT_TENSORS`` tensors. -1: not kept."""

    def __post_init__(self) -> None:
        if self.keep >= 0 and self.named() > MAX_KEPT_TENSORS:
            raise BadRequest(f"a kept run names at most {MAX_KEPT_TENSORS} tensors, "
                             f"not {self.named()}", code=ErrorCode.BAD_REQUEST)

    def named(self) -> int:
        """How many tensors it names: inputs, fetches and hand-offs together."""
        return len(self.inputs) + len(self.fetch) + len(self.receive) + len(self.send)

    def payload_sizes(self) -> list[int]:
        return [t.nbytes for t in self.inputs]

    def tokens(self) -> tuple[bytes, ...]:
        """Its transfer tokens: the receives', then the sends'."""
        return tuple(r.token for r in self.receive) + tuple(s.token for s in self.send)


def _check_tokens(value: Any, field: str) -> tuple[bytes, ...]:
    """At most 2 x MAX_HAND_OFFS distinct transfer tokens."""
    tokens = tuple(list_of(peer.check_token, 2 * peer.MAX_HAND_OFFS)(value, field))
    if len(set(tokens)) != len(tokens):
        raise BadRequest(f"field {field!r}: a transfer token appears twice",
                         code=ErrorCode.BAD_REQUEST)
    return tokens


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GraphRunKept(Message):
    """1.15 (``kept-runs``): the GRAPH_RUN_LINKED the session keeps under ``kept`` again, with
    new transfer ``tokens`` (the receives', then the sends', as :meth:`GraphRunLinked.tokens`)
    and new input bytes (payload frames of ``sizes``, which must be the kept inputs' sizes).
    A decode step repeats the same run shape every token: this is what crosses the client's
    link for it (tens of bytes, where the whole run's header is ~150)."""

    kept: int = _f(_int_in(0, MAX_KEPT - 1))
    tokens: tuple[bytes, ...] = _f(_check_tokens)
    sizes: list[int] = _f(list_of(check_handle, MAX_IO))

    def payload_sizes(self) -> list[int]:
        return list(self.sizes)

    def repeat(self, kept: GraphRunLinked) -> GraphRunLinked:
        """``kept`` with this message's tokens (checked against it: their count, the inputs'
        sizes), not kept again."""
        old = kept.tokens()
        if len(self.tokens) != len(old):
            raise BadRequest(f"kept run {self.kept} takes {len(old)} transfer token(s), "
                             f"got {len(self.tokens)}", code=ErrorCode.BAD_REQUEST)
        if self.sizes != kept.payload_sizes():
            raise BadRequest(f"kept run {self.kept} takes inputs of {kept.payload_sizes()} "
                             f"bytes, got {self.sizes}", code=ErrorCode.SIZE_MISMATCH)
        n = len(kept.receive)
        receive = tuple(peer.Receive(t, r.dst) for t, r in zip(self.tokens, kept.receive))
        send = tuple(peer.Send(t, s.src, s.endpoint)
                     for t, s in zip(self.tokens[n:], kept.send))
        return dataclasses.replace(kept, receive=receive, send=send, keep=-1)
