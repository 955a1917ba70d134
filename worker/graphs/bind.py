"""A compiled graph bound to its arrays: every per-run constant resolved once, a tight run loop.

Owned by the backend thread (only :class:`~zmq_rpc.worker.graphs.execute.CompiledGraph` calls it,
and passes itself as the :class:`Plan` it binds).
Between two runs of a registered graph nothing but the data changes: the arena is allocated
once, the external tensors' views are cached until a buffer of the session is freed, views of
either are fixed, and so is every node's output array (its arena slot, or its dst tensor when it
computes there directly). :func:`bind` therefore resolves, once per set of external views, every
view node into its array and every compute or in-place node into one call of its kernel with its
input arrays, metas, params and output bound (``functools.partial``); the run is then a loop over
those calls (a decode token of SmolLM2 runs ~840 nodes, so a per-node microsecond is a per-token
millisecond). A node whose view cannot be bound (it escapes its runtime buffer) makes :func:`bind`
return None: the caller runs the graph node by node and reports that node's error as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ...broker.graph import GraphSpec, tensor_meta
from ...broker.ops import OPS, OpKind
from ..backends import numpy_ops as K
from .steps import Step

__all__ = ["BoundRun", "Plan", "bind"]

Call = Callable[[], None]


class Plan(Protocol):
    """What :func:`bind` reads of a compiled graph (:class:`~.execute.CompiledGraph` is one)."""

    @property
    def spec(self) -> GraphSpec: ...

    @property
    def steps(self) -> list[Step]: ...

    @property
    def kernels(self) -> K.KernelTable: ...

    def scratch(self, step: Step) -> Any:
        """The arena slot of ``step``'s result, as an array of its shape and dtype."""


@dataclass(frozen=True, slots=True)
class BoundRun:
    """A graph's run, resolved: ``calls`` are (node index, call) in node order; ``values`` every
    node's result array (index sources read their views from here)."""

    externals: Sequence[Any]
    calls: tuple[tuple[int, Call], ...]
    values: tuple[Any, ...]


def bind(graph: Plan, externals: Sequence[Any]) -> BoundRun | None:
    """Resolve ``graph`` (its arena allocated) over ``externals``; None if a view cannot be
    bound (the node-by-node run then reports it)."""
    values: list[Any] = []
    calls: list[tuple[int, Call]] = []
    for index, step in enumerate(graph.steps):
        inputs = [values[s] if s >= 0 else externals[-1 - s] for s in step.srcs]
        try:
            value = _bind_step(graph, step, inputs, externals, index, calls)
        except (K.OpRuntimeError, ValueError, ArithmeticError, IndexError):
            return None
        values.append(value)
    return BoundRun(externals, tuple(calls), tuple(values))


def _bind_step(graph: Plan, step: Step, inputs: list[Any], externals: Sequence[Any],
               index: int, calls: list[tuple[int, Call]]) -> Any:
    """The node's result array; its calls (none for a view) appended to ``calls``."""
    kernels = graph.kernels
    if step.kind is OpKind.VIEW:
        return kernels.run_view(step.op, inputs[0], step.in_metas[0], step.params)
    if step.kind is OpKind.INPLACE:
        calls.append((index, functools.partial(kernels.inplace[step.op], inputs, step.in_metas)))
        return inputs[OPS[step.op].dst_input or 0]
    out = externals[step.dst] if step.direct else graph.scratch(step)
    if out.size:
        calls.append((index, functools.partial(kernels.compute[step.op], inputs, step.in_metas,
                                               step.params, out)))
    if step.dst >= 0 and not step.direct:
        dst_dtype = tensor_meta(graph.spec.tensors[step.dst]).dtype
        calls.append((index, functools.partial(K.convert, externals[step.dst], dst_dtype, out,
                                               step.meta.dtype)))
    return out
