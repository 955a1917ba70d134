"""A client's graph calls: compute once, register and rerun, free; runs linked by hand-offs.

:class:`GraphCalls` issues them over one session's :class:`~.connection.Connection` (its public
``call`` and ``result_of`` only); :class:`~zmq_rpc.client.Client` composes it. Each call has a
blocking form and an ``_async`` twin returning a ``concurrent.futures.Future``; a run with
``receive``/``send`` hand-offs is a linked run (:mod:`zmq_rpc.client.peer`). Any thread may call
in; ``on_reply`` functions run on the thread that drives the connection.
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
from .calls import no_result
from .futures import then
from .graph import Graph
from .peer import HandOff, run_linked
from .peer import receive as receive_hand_off
from .remote import Inputs, Owner, RegisteredGraph, RemoteTensor, owned_ref, payload_array
from .session import Session


class GraphCalls:
    """Compute graphs on ``session``'s worker: one-off, registered, linked; handed out as
    ``owner``'s."""

    def __init__(self, session: Session, owner: Owner) -> None:
        self.session = session
        self.owner = owner
        self.connection = session.connection

    def compute(self, graph: Graph, inputs: Inputs = None,
                fetch: Sequence[RemoteTensor] = (), *, timeout: float | None = None) -> RunResult:
        """Validate and run ``graph`` once on the worker (one message); see :meth:`run`.
        ``timeout``: seconds this request may take (default: the client's ``timeout``)."""
        return self.connection.result_of(self.compute_async, graph, inputs, fetch, timeout=timeout)

    def compute_async(self, graph: Graph, inputs: Inputs = None,
                      fetch: Sequence[RemoteTensor] = (), *,
                      timeout: float | None = None) -> Future[RunResult]:
        self._own_graph(graph)
        refs, frames = self._graph_inputs(inputs)
        msg = wire_graph.GraphCompute(graph=graph.spec(), inputs=refs,
                                      fetch=[self._ref(t) for t in fetch])
        return self.connection.call(Cmd.GRAPH_COMPUTE, msg, frames, on_reply=_fetched(msg.fetch),
                                    timeout=timeout)

    def register(self, graph: Graph) -> RegisteredGraph:
        """Validate ``graph`` on the worker and keep it (and its scratch arena) for :meth:`run`."""
        return self.connection.result_of(self.register_async, graph)

    def register_async(self, graph: Graph) -> Future[RegisteredGraph]:
        self._own_graph(graph)
        handle = RegisteredGraph(self.owner, self.session.new_handle(), graph)
        future = self.connection.call(
            Cmd.GRAPH_REGISTER, wire_graph.GraphRegister(handle=handle.handle, graph=graph.spec()))
        return then(future, lambda _: handle)

    def run(self, graph: RegisteredGraph, inputs: Inputs = None,
            fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
            send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> RunResult:
        """:meth:`zmq_rpc.client.Client.run`, which documents it."""
        return self.connection.result_of(self.run_async, graph, inputs, fetch, receive=receive,
                                         send=send, hold_reply=hold_reply)

    def run_async(self, graph: RegisteredGraph, inputs: Inputs = None,
                  fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
                  send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> Future[RunResult]:
        if graph.client is not self.owner:
            raise BadRequest("that graph is registered on another worker")
        refs, frames = self._graph_inputs(inputs)
        fetch_refs = [self._ref(t) for t in fetch]
        if receive or send:
            return run_linked(self.owner, graph, refs, frames, fetch, receive, send, hold_reply)
        msg = wire_graph.GraphRun(handle=graph.handle, inputs=refs, fetch=fetch_refs)
        return self.connection.call(Cmd.GRAPH_RUN, msg, frames, on_reply=_fetched(fetch_refs))

    def free_graph(self, graph: RegisteredGraph) -> None:
        """Release a registered graph and its scratch arena on the worker."""
        self.connection.result_of(self.free_graph_async, graph)

    def free_graph_async(self, graph: RegisteredGraph) -> Future[None]:
        if graph.client is not self.owner:
            raise BadRequest("that graph is registered on another worker")
        return self.connection.call(Cmd.GRAPH_FREE, p.BufferOp(handle=graph.handle),
                                    on_reply=no_result)

    def receive(self, hand_off: HandOff) -> None:
        """Land a hand-off that no run of this worker receives (see :meth:`run`)."""
        self.connection.result_of(self.receive_async, hand_off)

    def receive_async(self, hand_off: HandOff) -> Future[None]:
        return receive_hand_off(self.owner, hand_off)

    def _own_graph(self, graph: Graph) -> None:
        if graph.client is not None and graph.client is not self.owner:
            raise BadRequest(f"that graph uses tensors of {graph.client.endpoint}, "
                             f"not of {self.session.endpoint}")

    def _ref(self, tensor: RemoteTensor) -> TensorRef:
        return owned_ref(self.owner, tensor, self.session.endpoint)

    def _graph_inputs(self, inputs: Inputs) -> tuple[list[TensorRef], list[np.ndarray]]:
        pairs = list(inputs.items()) if isinstance(inputs, dict) else list(inputs or ())
        refs = [self._ref(t) for t, _ in pairs]
        frames = [payload_array(t, v).reshape(-1).view(np.uint8) for t, v in pairs]
        total = sum(f.nbytes for f in frames)
        if total > self.session.chunk_bytes:
            raise BadRequest(f"{total} bytes of graph inputs in one message; upload inputs over "
                             f"{self.session.chunk_bytes} bytes with set_tensor_async first")
        return refs, frames
