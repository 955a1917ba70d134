"""A client's graph calls: compute once, register and rerun, free; runs linked by hand-offs.

Part of :class:`~zmq_rpc.client.Client` (the job that runs compute graphs on the worker). Each
call has a blocking form and an ``_async`` twin returning a ``concurrent.futures.Future``; a run
with ``receive``/``send`` hand-offs is a linked run (:mod:`zmq_rpc.client.peer`). Used from any
thread: socket work belongs to the engine (:mod:`zmq_rpc.client.engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from ..broker import graph as wire_graph
from ..broker import protocol as p
from ..broker.errors import BadRequest
from ..broker.protocol import Cmd, TensorRef
from .arrays import RunResult
from .arrays import fetched as _fetched
from .connection import Connection
from .futures import then
from .graph import Graph
from .peer import HandOff, run_linked
from .peer import receive as receive_hand_off
from .remote import Inputs, RegisteredGraph, RemoteTensor, payload_array


class GraphCalls(Connection):
    """Compute graphs on the worker: one-off, registered, linked."""

    def compute(self, graph: Graph, inputs: Inputs = None,
                fetch: Sequence[RemoteTensor] = (), *, timeout: float | None = None) -> RunResult:
        """Validate and run ``graph`` once on the worker (one message); see :meth:`run`.
        ``timeout``: seconds this request may take (default: the client's ``timeout``)."""
        return self._sync(self.compute_async, graph, inputs, fetch, timeout=timeout)

    def compute_async(self, graph: Graph, inputs: Inputs = None,
                      fetch: Sequence[RemoteTensor] = (), *,
                      timeout: float | None = None) -> Future[RunResult]:
        self._own_graph(graph)
        refs, frames = self._graph_inputs(inputs)
        msg = wire_graph.GraphCompute(graph=graph.spec(), inputs=refs,
                                      fetch=[self._ref(t) for t in fetch])
        return self._call(Cmd.GRAPH_COMPUTE, msg, frames, on_reply=_fetched(fetch),
                          timeout=timeout)

    def register(self, graph: Graph) -> RegisteredGraph:
        """Validate ``graph`` on the worker and keep it (and its scratch arena) for :meth:`run`."""
        return self._sync(self.register_async, graph)

    def register_async(self, graph: Graph) -> Future[RegisteredGraph]:
        self._own_graph(graph)
        handle = RegisteredGraph(self._as_client(), self._new_handle(), graph)
        future = self._call(Cmd.GRAPH_REGISTER,
                            wire_graph.GraphRegister(handle=handle.handle, graph=graph.spec()))
        return then(future, lambda _: handle)

    def run(self, graph: RegisteredGraph, inputs: Inputs = None,
            fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
            send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> RunResult:
        """Rerun a registered graph with one small message.

        ``inputs`` (pairs of RemoteTensor and array, or a dict) are written first, in the same
        message; the arrays of the ``fetch`` tensors come back in the reply, after the run.
        ``receive`` and ``send`` are hand-offs (:func:`zmq_rpc.client.hand_off`) from and to
        other workers' runs: the run waits for the first and pushes the second, in the same one
        message (issue the sending run before the receiving one).

        ``hold_reply`` (seconds, at most 1) lets the worker keep a run's reply back that long
        after pushing its sends, when what it fetches is small (<= 64 KiB; it goes out sooner
        if another reply does): a client that pipelines runs and is not waiting on this one
        keeps the reply's wake-ups (broker, network, this process) off the CPUs the hand-off
        needs next. Workers without the ``held-replies`` capability reply at once.
        """
        return self._sync(self.run_async, graph, inputs, fetch, receive=receive, send=send,
                              hold_reply=hold_reply)

    def run_async(self, graph: RegisteredGraph, inputs: Inputs = None,
                  fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
                  send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> Future[RunResult]:
        if graph.client is not self:
            raise BadRequest("that graph is registered on another worker")
        refs, frames = self._graph_inputs(inputs)
        fetch_refs = [self._ref(t) for t in fetch]
        if receive or send:
            return run_linked(self._as_client(), graph, refs, frames, fetch, receive, send, hold_reply)
        msg = wire_graph.GraphRun(handle=graph.handle, inputs=refs, fetch=fetch_refs)
        return self._call(Cmd.GRAPH_RUN, msg, frames, on_reply=_fetched(fetch))

    def free_graph(self, graph: RegisteredGraph) -> None:
        """Release a registered graph and its scratch arena on the worker."""
        self._sync(self.free_graph_async, graph)

    def free_graph_async(self, graph: RegisteredGraph) -> Future[None]:
        if graph.client is not self:
            raise BadRequest("that graph is registered on another worker")
        return self._call(Cmd.GRAPH_FREE, p.BufferOp(handle=graph.handle))

    def receive(self, hand_off: HandOff) -> None:
        """Land a hand-off that no run of this worker receives (see :meth:`run`)."""
        self._sync(self.receive_async, hand_off)

    def receive_async(self, hand_off: HandOff) -> Future[None]:
        return receive_hand_off(self._as_client(), hand_off)

    def _own_graph(self, graph: Graph) -> None:
        if graph.client is not None and graph.client is not self:
            raise BadRequest(f"that graph uses tensors of {graph.client.endpoint}, "
                             f"not of {self.endpoint}")

    def _graph_inputs(self, inputs: Inputs) -> tuple[list[TensorRef], list[np.ndarray]]:
        pairs = list(inputs.items()) if isinstance(inputs, dict) else list(inputs or ())
        refs = [self._ref(t) for t, _ in pairs]
        frames = [payload_array(t, v).reshape(-1).view(np.uint8) for t, v in pairs]
        total = sum(f.nbytes for f in frames)
        if total > self.chunk_bytes:
            raise BadRequest(f"{total} bytes of graph inputs in one message; upload inputs over "
                             f"{self.chunk_bytes} bytes with set_tensor_async first")
        return refs, frames
