"""Graph commands: register, run, compute once, free; and the run itself, shared with linked runs.

Owned by the backend thread (the executor calls these handlers from its queue). A graph's scratch
arena is counted by the worker's :class:`~zmq_rpc.worker.sessions.memory.MemoryBudget` and allocated by the
backend (:meth:`~zmq_rpc.worker.graphs.execute.CompiledGraph.ensure_arena`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...broker import graph as g
from ...broker import protocol as p
from ...broker.protocol import Cmd, ErrorCode, WireError
from ..backends import numpy_ops as K
from ..backends.base import Backend, View
from ..sessions.memory import SessionMemory
from ..sessions.quotas import check
from ..sessions.session import NO_REPLY, Reply, Request, Route, Session
from ..sessions.views import Views
from .execute import CompiledGraph, compile_graph


class GraphCommands:
    """The handlers of the graph commands (GRAPH_RUN_LINKED's run step comes here too)."""

    def __init__(self, backend: Backend, views: Views, memory: SessionMemory,
                 max_graph_work: int) -> None:
        self.backend = backend
        self.views = views
        self.memory = memory
        self.max_graph_work = max_graph_work

    def routes(self) -> dict[Cmd, Route]:
        """This module's part of the executor's dispatch table."""
        return {
            Cmd.GRAPH_REGISTER: Route(self.register),
            Cmd.GRAPH_RUN: Route(self.run, writes=self.run_writes),
            Cmd.GRAPH_COMPUTE: Route(self.compute, writes=lambda s, m: [
                t.buffer for t in [*m.graph.tensors, *m.inputs]]),
            Cmd.GRAPH_FREE: Route(self.free),
        }

    def register(self, session: Session, msg: g.GraphRegister, req: Request) -> Reply:
        if msg.handle in session.graphs:
            raise WireError(ErrorCode.INVALID_HANDLE, f"graph handle {msg.handle} is in use")
        quotas = self.memory.quotas
        check("registered graphs", len(session.graphs), 1, quotas.graphs)
        nodes = len(msg.graph.nodes)
        check("graph nodes", session.usage.graph_nodes, nodes, quotas.graph_nodes)
        graph = self._compile(session, msg.graph)
        self.memory.allocate(session, graph.memory_charge, "graph scratch arena",
                             lambda: graph.ensure_arena(self.backend))
        if self.backend.kernels is K.NUMPY_KERNELS:     # host arrays: numba kernels, if any
            K.prepare(step.op for step in graph.steps)
        graph.bind_ahead(self._externals(session, graph))
        session.graphs[msg.handle] = graph
        session.usage.graph_nodes += nodes
        return NO_REPLY

    def run(self, session: Session, msg: g.GraphRun, req: Request) -> Reply:
        return self.execute(session, self.graph(session, msg.handle), msg, req.payload)

    def compute(self, session: Session, msg: g.GraphCompute, req: Request) -> Reply:
        graph = self._compile(session, msg.graph)
        with self.memory.borrowed(session, graph.memory_charge, "graph scratch arena"):
            return self.execute(session, graph, msg, req.payload)

    def free(self, session: Session, msg: p.BufferOp, req: Request) -> Reply:
        graph = self.graph(session, msg.handle)
        del session.graphs[msg.handle]
        self.memory.uncharge(session, graph.memory_charge)
        session.usage.graph_nodes -= len(graph.spec.nodes)
        return NO_REPLY

    @staticmethod
    def run_writes(session: Session, msg: g.GraphRun | g.GraphRunLinked) -> Iterable[int]:
        """A registered graph's run writes its outputs' buffers and its inputs'."""
        graph = session.graphs.get(msg.handle)
        written = graph.written_buffers if graph is not None else frozenset()
        return [*written, *(t.buffer for t in msg.inputs)]

    @staticmethod
    def graph(session: Session, handle: int) -> CompiledGraph:
        """The session's registered graph ``handle``, or an INVALID_HANDLE error."""
        graph = session.graphs.get(handle)
        if graph is None:
            raise WireError(ErrorCode.INVALID_HANDLE,
                            f"graph {handle} is not registered in this session")
        return graph

    def execute(self, session: Session, graph: CompiledGraph,
                msg: g.GraphRun | g.GraphCompute | g.GraphRunLinked,
                payload: Sequence[Any], then: Callable[[], None] | None = None) -> Reply:
        """Write the inputs, run, call ``then`` (if any), read the fetched tensors."""
        inputs = [self.views.view(session, ref) for ref in msg.inputs]
        fetch = [self.views.view(session, ref) for ref in msg.fetch]
        externals = self._externals(session, graph)
        graph.ensure_arena(self.backend)
        for view, frame in zip(inputs, payload):
            self.backend.write(view, frame)
        started = time.perf_counter_ns()
        graph.run(externals)
        elapsed = time.perf_counter_ns() - started
        if then is not None:
            then()
        frames = self.views.fetch_all(session, msg.fetch, fetch)
        return g.GraphReply(sizes=[ref.nbytes for ref in msg.fetch], compute_ns=elapsed), frames

    def _compile(self, session: Session, spec: g.GraphSpec) -> CompiledGraph:
        if not self.backend.supports_graphs:
            raise WireError(ErrorCode.GRAPH_INVALID,
                            f"the {self.backend.name} backend does not run graphs yet")
        for ref in spec.tensors:
            self.views.view(session, ref)          # handles exist, views inside their buffers
        return compile_graph(spec, self.max_graph_work)

    def _externals(self, session: Session, graph: CompiledGraph) -> list[View]:
        """The graph's external views, validated once and reused until a buffer is freed."""
        if graph.views is None or graph.views_valid_at != session.frees:
            graph.views = [self.views.view(session, ref) for ref in graph.spec.tensors]
            graph.views_valid_at = session.frees
        return graph.views
