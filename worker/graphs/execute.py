"""Graph compile and run on the backend thread: validation, a reusable scratch arena, execution.

Owned by the backend thread (it only runs inside :class:`~zmq_rpc.worker.dispatch.executor.Executor`
handlers). :func:`compile_graph` validates a decoded graph against the session (handles, bounds,
op rules) and plans its scratch arena once: every intermediate gets an offset, reused as soon as
its last reader has run (liveness over views too), so a registered graph allocates nothing per run.
The arena is the backend's memory (:meth:`~zmq_rpc.worker.backends.base.Backend.scratch`: host
memory for numpy, device memory for cupy), allocated once by :meth:`CompiledGraph.ensure_arena`,
which also takes the backend's kernel table (``Backend.kernels``). :meth:`CompiledGraph.run` then
executes the nodes in order through that table.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...broker.graph import GraphSpec, infer_graph, tensor_meta
from ...broker.ops import (
    DEFAULT_MAX_WORK,
    DTYPE_SIZES,
    NODE_WORK,
    OPS,
    OpKind,
    node_work,
)
from ...broker.protocol import ErrorCode, WireError
from ..backends import numpy_ops as K
from ..backends.base import Backend, Memory
from .bind import BoundRun, bind
from .steps import Step

ARENA_ALIGN = 64


@dataclass
class CompiledGraph:
    """A validated graph with its arena plan (and, once allocated, its arena)."""

    spec: GraphSpec
    steps: list[Step]
    arena_size: int
    written_buffers: frozenset[int]
    temp_size: int = 0
    """Worst-case bytes of numpy temporaries for strided inputs (see :func:`_temp_size`)."""
    arena: Memory | None = None
    views_valid_at: int = -1
    runs: int = 0
    arena_allocations: int = 0
    index_checks: list[tuple[int, int, int]] = field(default_factory=list)
    kernels: K.KernelTable = K.NUMPY_KERNELS
    """The backend's kernel table (set with the arena)."""
    _views: list[Any] | None = None
    _bound: BoundRun | None = None

    @property
    def views(self) -> list[Any] | None:
        """The external tensors' views, cached by the executor (see ``views_valid_at``);
        setting them drops the run bound to the old ones (no array of a freed buffer is kept)."""
        return self._views

    @views.setter
    def views(self, views: list[Any] | None) -> None:
        self._views, self._bound = views, None

    @property
    def memory_charge(self) -> int:
        """What the graph holds against the worker's memory limit: arena + temporaries."""
        return self.arena_size + self.temp_size

    def ensure_arena(self, backend: Backend) -> None:
        """Allocate the arena from ``backend`` on first use (and take its kernel table); later
        runs reuse it."""
        if self.arena is None:
            self.arena = backend.scratch(self.arena_size)
            self.kernels = backend.kernels
            self.arena_allocations += 1

    def run(self, externals: Sequence[np.ndarray]) -> None:
        """Execute every node (the arena allocated first: :meth:`ensure_arena`); raises
        WireError(GRAPH_FAILED) naming the node on failure."""
        if self.arena is None:
            raise RuntimeError("CompiledGraph.run before ensure_arena")
        self._precheck_indices(externals)
        bound = self._bind(externals)
        if bound is None:
            self._run_nodes(externals)
        else:
            self._run_bound(bound)
        self.runs += 1

    def bind_ahead(self, externals: Sequence[np.ndarray]) -> None:
        """Bind the run to ``externals`` (the cached :attr:`views`) now, at registration, so that
        the first run costs what the next ones do."""
        self._bind(externals)

    def _bind(self, externals: Sequence[np.ndarray]) -> BoundRun | None:
        """The run bound to ``externals`` (bound on first use, kept while they are the views)."""
        bound = self._bound
        if bound is None or bound.externals is not externals:
            bound = bind(self, externals)
            self._bound = bound if externals is self._views else None
        return bound

    def _run_bound(self, bound: BoundRun) -> None:
        at = -1
        try:
            with np.errstate(all="ignore") if self.kernels.host_errors else nullcontext():
                for at, call in bound.calls:  # noqa: B007 - ``at`` names the failed node
                    call()
        except (K.OpRuntimeError, ValueError, ArithmeticError, IndexError) as exc:
            raise _failed(at, self.steps[at], exc, self._writers_before(at)) from None

    def _writers_before(self, index: int) -> list[int]:
        return [i for i, s in enumerate(self.steps[:index])
                if s.dst >= 0 or s.kind is OpKind.INPLACE]

    def _run_nodes(self, externals: Sequence[np.ndarray]) -> None:
        """Node by node, views resolved as they come (a graph whose views cannot be bound)."""
        values: list[Any] = [None] * len(self.steps)
        written: list[int] = []
        for index, step in enumerate(self.steps):
            inputs = [values[s] if s >= 0 else externals[-1 - s] for s in step.srcs]
            try:
                values[index] = self._run_step(step, inputs, externals)
            except (K.OpRuntimeError, ValueError, ArithmeticError, IndexError) as exc:
                raise _failed(index, step, exc, written) from None
            if step.dst >= 0 or step.kind is OpKind.INPLACE:
                written.append(index)

    def _run_step(self, step: Step, inputs: list[Any], externals: Sequence[np.ndarray]) -> Any:
        kernels = self.kernels
        if step.kind is OpKind.VIEW:
            return kernels.run_view(step.op, inputs[0], step.in_metas[0], step.params)
        if step.kind is OpKind.INPLACE:
            kernels.run_inplace(step.op, inputs, step.in_metas, step.params)
            return inputs[OPS[step.op].dst_input or 0]
        out = externals[step.dst] if step.direct else self.scratch(step)
        kernels.run_compute(step.op, inputs, step.in_metas, step.params, out)
        if step.dst >= 0 and not step.direct:
            dst_meta = tensor_meta(self.spec.tensors[step.dst])
            K.convert(externals[step.dst], dst_meta.dtype, out, step.meta.dtype)
        return out

    def scratch(self, step: Step) -> np.ndarray:
        """The arena slot of ``step``'s result, as an array of its shape and dtype."""
        dtype = K.numpy_dtype(step.meta.dtype)
        arena: Memory = self.arena
        view: np.ndarray = arena[step.slot:step.slot + step.meta.nbytes].view(dtype).reshape(
            step.meta.shape)
        return view

    def _precheck_indices(self, externals: Sequence[np.ndarray]) -> None:
        """Index values held in external tensors (directly or through views) are checked before
        any node writes anything."""
        for node, src, rows in self.index_checks:
            idx = self._through_views(src, externals)
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= rows):
                bad = int(idx.min()) if int(idx.min()) < 0 else int(idx.max())
                raise WireError(ErrorCode.GRAPH_FAILED,
                                f"node {node} ({self.steps[node].op}): index {bad} is out of "
                                f"range [0, {rows}); nothing was written")


    def _through_views(self, src: int, externals: Sequence[np.ndarray]) -> np.ndarray:
        """The array ``src`` names when it is an external tensor or a view chain over one
        (walked iteratively: a chain of any length never recurses)."""
        chain: list[Step] = []
        while src >= 0:
            chain.append(self.steps[src])
            src = self.steps[src].srcs[0]
        array = externals[-1 - src]
        for step in reversed(chain):
            array = self.kernels.run_view(step.op, array, step.in_metas[0], step.params)
        return array


def _failed(index: int, step: Step, exc: Exception, written: list[int]) -> WireError:
    note = (f"; outputs of nodes {written} were already written" if written
            else "; no output was written")
    return WireError(ErrorCode.GRAPH_FAILED,
                     f"node {index} ({step.op}) failed: {exc}{note}")


def compile_graph(spec: GraphSpec, max_work: int = DEFAULT_MAX_WORK) -> CompiledGraph:
    """Infer shapes (GRAPH_INVALID on any rule broken), bound the work, plan the scratch arena."""
    _check_node_count(len(spec.nodes), max_work)
    try:
        metas, params = infer_graph(spec)
    except Exception as exc:
        raise WireError(ErrorCode.GRAPH_INVALID, getattr(exc, "message", str(exc))) from None
    external = [tensor_meta(t) for t in spec.tensors]
    steps = [Step(n.op, OPS[n.op].kind, n.srcs, params[i], metas[i],
                  [metas[s] if s >= 0 else external[-1 - s] for s in n.srcs], n.dst)
             for i, n in enumerate(spec.nodes)]
    _check_work(steps, max_work)
    _mark_direct(spec, steps)
    roots = _roots(steps)
    graph = CompiledGraph(spec, steps, _plan_arena(steps, roots),
                          _written_buffers(spec, steps, roots), temp_size=_temp_size(steps))
    graph.index_checks = _index_checks(steps)
    return graph


def _check_node_count(nodes: int, max_work: int) -> None:
    """Refuse, before checking any node, a graph whose nodes alone are over ``max_work``:
    checking them is most of what they cost."""
    if nodes * NODE_WORK > max_work:
        raise WireError(ErrorCode.GRAPH_INVALID,
                        f"graph: {nodes:,} nodes count {nodes * NODE_WORK:,} element-ops "
                        f"({NODE_WORK:,} each) before any data, over this worker's limit of "
                        f"{max_work:,} per run (zmq-rpc-worker --max-graph-work)")


def _check_work(steps: list[Step], max_work: int) -> None:
    """Refuse a graph whose nodes together ask for more than ``max_work`` element-ops."""
    total = 0
    for index, step in enumerate(steps):
        total += node_work(step.op, step.in_metas, step.meta)
        if total > max_work:
            raise WireError(ErrorCode.GRAPH_INVALID,
                            f"graph: nodes 0..{index} already ask for {total:,} element-ops, over "
                            f"this worker's limit of {max_work:,} per run (zmq-rpc-worker "
                            "--max-graph-work; repeated views count every element they name)")


def _temp_size(steps: list[Step]) -> int:
    """Bytes numpy may allocate behind one node's back: kernels copy strided inputs (a
    zero-stride view of 4 bytes can name 4 GiB) into contiguous temporaries. The largest such
    node is charged to the session's memory with the arena."""
    peak = 0
    for step in steps:
        if step.kind is not OpKind.COMPUTE:
            continue
        temp = sum(meta.numel * max(DTYPE_SIZES[meta.dtype], 4)
                   for meta in step.in_metas if not meta.contiguous)
        peak = max(peak, temp)
    return peak


def _mark_direct(spec: GraphSpec, steps: list[Step]) -> None:
    """COMPUTE results go straight into their dst when it is contiguous, of the same dtype, read
    by no node, written by no other node, and overlapping no other tensor the graph reads or
    writes: then no kernel ever writes memory that one of its inputs (directly, through a view,
    or as an earlier result) lives in. Otherwise the result is computed in scratch and copied."""
    read = {-1 - s for n in spec.nodes for s in n.srcs if s < 0}
    writers: dict[int, int] = {}
    for node in spec.nodes:
        if node.dst >= 0:
            writers[node.dst] = writers.get(node.dst, 0) + 1
    crowded = _overlapping(spec, read | set(writers))
    for step in steps:
        if step.kind is not OpKind.COMPUTE or step.dst < 0:
            continue
        target = spec.tensors[step.dst]
        step.direct = (target.is_contiguous() and target.dtype.dtype_name == step.meta.dtype
                       and step.dst not in read and writers[step.dst] == 1
                       and step.dst not in crowded)


def _overlapping(spec: GraphSpec, indices: set[int]) -> set[int]:
    """The tensors among ``indices`` whose bytes overlap another one's (a sweep per buffer)."""
    spans = sorted((spec.tensors[i].buffer, *spec.tensors[i].byte_extent(), i) for i in indices)
    crowded: set[int] = set()
    reach, reach_owner, buffer = -1, -1, None
    for buf, lo, hi, index in spans:
        if buf != buffer:
            reach, reach_owner, buffer = -1, -1, buf
        if lo < hi and lo < reach:
            crowded.update((index, reach_owner))
        if hi > reach and lo < hi:
            reach, reach_owner = hi, index
    return crowded


def _roots(steps: list[Step]) -> list[int]:
    """Where each node's value is stored, in one forward pass: a COMPUTE node's own index, or an
    external src (< 0). Views lead to their input, in-place ops to their destination (linear in
    the node count: a chain of N views costs N steps, not N**2)."""
    roots: list[int] = []
    for index, step in enumerate(steps):
        if step.kind is OpKind.COMPUTE:
            roots.append(index)
            continue
        src = step.srcs[0] if step.kind is OpKind.VIEW else step.srcs[OPS[step.op].dst_input or 0]
        roots.append(src if src < 0 else roots[src])
    return roots


def _owners(steps: list[Step], roots: list[int]) -> list[int]:
    """The node whose scratch storage each result lives in; -1 for external storage."""
    return [root if root >= 0 and not steps[root].direct else -1 for root in roots]


def _plan_arena(steps: list[Step], roots: list[int]) -> int:
    """Give each scratch result an arena offset, reusing space after its last reader."""
    owners = _owners(steps, roots)
    last_use = {i: i for i, o in enumerate(owners) if o == i}
    for i, step in enumerate(steps):
        for src in step.srcs:
            if src >= 0 and owners[src] >= 0:
                last_use[owners[src]] = max(last_use[owners[src]], i)
    frees_at: dict[int, list[int]] = {}
    for owner, last in last_use.items():
        frees_at.setdefault(last, []).append(owner)
    allocator = _FirstFit()
    for i, step in enumerate(steps):
        if owners[i] == i:
            step.slot = allocator.take(step.meta.nbytes)
        for owner in frees_at.get(i, ()):
            allocator.give(steps[owner].slot, steps[owner].meta.nbytes)
    return allocator.high_water


class _FirstFit:
    """Offsets in a growing arena: first-fit over a sorted free list, neighbours merged."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []
        self.high_water = 0

    def take(self, size: int) -> int:
        size = _aligned(size)
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                self.free[i] = (offset + size, length - size)
                if self.free[i][1] == 0:
                    del self.free[i]
                return offset
        if self.free and self.free[-1][0] + self.free[-1][1] == self.high_water:
            offset = self.free.pop()[0]
        else:
            offset = self.high_water
        self.high_water = offset + size
        return offset

    def give(self, offset: int, size: int) -> None:
        """Return a block, merging it with free neighbours (the list stays sorted)."""
        size = _aligned(size)
        at = bisect.bisect(self.free, (offset, size))
        if at < len(self.free) and offset + size == self.free[at][0]:
            size += self.free.pop(at)[1]
        if at and self.free[at - 1][0] + self.free[at - 1][1] == offset:
            offset, size = self.free[at - 1][0], self.free[at - 1][1] + size
            self.free[at - 1] = (offset, size)
        else:
            self.free.insert(at, (offset, size))


def _aligned(size: int) -> int:
    return max(ARENA_ALIGN, -(-size // ARENA_ALIGN) * ARENA_ALIGN)


def _written_buffers(spec: GraphSpec, steps: list[Step], roots: list[int]) -> frozenset[int]:
    """Buffer handles the graph writes: dst tensors and in-place targets (through views)."""
    handles = {spec.tensors[s.dst].buffer for s in steps if s.dst >= 0}
    for index, step in enumerate(steps):
        if step.kind is OpKind.INPLACE:
            root = roots[index]
            if root < 0:
                handles.add(spec.tensors[-1 - root].buffer)
    return frozenset(handles)


def _index_checks(steps: list[Step]) -> list[tuple[int, int, int]]:
    """(node, external src, rows) for get_rows/set_rows whose indices come from external tensors;
    one check per (src, rows), the first node's (a llama's decode graph writes every layer's KV
    rows at the same positions)."""
    view_of_external = _views_of_external(steps)
    checks: dict[tuple[int, int], int] = {}
    for i, step in enumerate(steps):
        position = {"get_rows": 1, "set_rows": 2}.get(step.op)
        src = step.srcs[position] if position is not None else 0
        if position is not None and (src < 0 or view_of_external[src]):
            checks.setdefault((src, step.in_metas[0].shape[0]), i)
    return [(node, src, rows) for (src, rows), node in checks.items()]


def _views_of_external(steps: list[Step]) -> list[bool]:
    """For each node, whether it is views all the way down to an external tensor (one pass)."""
    out: list[bool] = []
    for step in steps:
        src = step.srcs[0] if step.srcs else 0
        out.append(step.kind is OpKind.VIEW and (src < 0 or out[src]))
    return out
