"""Pipeline parallelism over several workers, driven from the client: :class:`Pipeline`.

A model is cut into stages; stage ``i`` runs on ``clients[i]`` as a registered graph that reads an
input activation and writes an output activation. Micro-batch ``k`` goes::

    run stage 0 (the batch travels in the same message), pushing y0 -> x1 | run stage 1 once x1
    has landed, pushing y1 -> x2 | ... | run the last stage | fetch its output

One linked run per stage (:func:`zmq_rpc.client.hand_off`): the hand-offs travel inside the runs.
:func:`run_chain` issues such a chain of runs; :class:`Pipeline` and
:class:`~zmq_rpc.client.llama.LlamaModel` both step through their stages with it.

Everything is issued without waiting, so stage 0 computes micro-batch ``k+1`` while stage 1 computes
``k``. Each stage has ``depth`` input/output slots, used round robin by consecutive micro-batches:
stage 0 writes the next output while the previous one is still being pushed to stage 1. The workers'
per-session ordering makes any ``depth`` correct (a peer receive holds its session's queue until the
bytes have landed; a write waits until zero-copy sends of its buffer are done); ``depth`` only buys
overlap. At most ``max_in_flight`` micro-batches are outstanding, so request timeouts count from a
bounded queue.

Plain client-side orchestration, no thread of its own: any one thread may drive a pipeline. Stages
may share a client (then the hop is a copy on that worker); where workers cannot reach each other,
hand-offs fall back to a relay through this client (correct, slower).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..broker.errors import BadRequest
from .client import (
    Client,
    DTypeLike,
    RegisteredGraph,
    RemoteBuffer,
    RemoteTensor,
    RunResult,
    as_dtype,
)
from .futures import first_error
from .graph import Graph
from .peer import HandOff, hand_off

__all__ = ["Chain", "LinkedRun", "Pipeline", "StageBuilder", "run_chain"]

Shape = tuple[int, ...]

StageBuilder = Callable[[int, RemoteTensor, RemoteTensor], Graph]
"""``build(stage, x, y)``: a graph on ``x.client`` computing ``y`` from ``x``.

Called ``depth`` times per stage (once per slot, with different ``x``/``y``); create a stage's
weights once (e.g. cache them by stage) and reuse them in every slot's graph.
"""


@dataclass(frozen=True)
class _Slot:
    """One stage's buffers and graph for every ``depth``-th micro-batch."""

    x: RemoteTensor
    y: RemoteTensor
    graph: RegisteredGraph


class Pipeline:
    """``with Pipeline(clients, build, shape) as pipe: outputs = pipe.run(batches)``.

    ``shape`` is the activation shape at every stage boundary, or a list of ``len(clients) + 1``
    shapes (the input of stage 0, then each stage's output). ``dtype`` is the activations' dtype.
    """

    def __init__(self, clients: Sequence[Client], build: StageBuilder,
                 shape: Sequence[int] | Sequence[Sequence[int]], *, dtype: DTypeLike = "float32",
                 depth: int = 2, max_in_flight: int | None = None) -> None:
        if not clients:
            raise BadRequest("a pipeline needs at least one stage")
        if depth < 1:
            raise BadRequest(f"depth must be >= 1, got {depth}")
        self.clients = list(clients)
        self.shapes = _boundary_shapes(shape, len(self.clients))
        self.dtype = as_dtype(dtype)
        self.depth = depth
        self.max_in_flight = max_in_flight or 2 * max(len(self.clients), depth)
        self._buffers: list[RemoteBuffer] = []
        self._graphs: list[RegisteredGraph] = []
        self._closed = False
        try:
            self.stages = [self._make_stage(i, build) for i in range(len(self.clients))]
            self._warm_up()
        except BaseException:
            self.close()
            raise

    # --------------------------------------------------------------------------- set-up

    def _tensor(self, client: Client, shape: Shape) -> RemoteTensor:
        nbytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        buffer = client.alloc_buffer_nowait(nbytes)
        self._buffers.append(buffer)
        return buffer.tensor(shape, self.dtype)

    def _make_stage(self, stage: int, build: StageBuilder) -> list[_Slot]:
        client = self.clients[stage]
        slots = []
        for _ in range(self.depth):
            x = self._tensor(client, self.shapes[stage])
            y = self._tensor(client, self.shapes[stage + 1])
            graph = client.register(build(stage, x, y))
            self._graphs.append(graph)
            slots.append(_Slot(x, y, graph))
        return slots

    def _warm_up(self) -> None:
        """One copy per hop now, so that route probes and peer links are not paid in ``run``."""
        hops = [self.stages[i][0].y.client.copy_tensor_async(self.stages[i][0].y,
                                                             self.stages[i + 1][0].x)
                for i in range(len(self.stages) - 1)]
        for future in hops:
            future.result()

    # ---------------------------------------------------------------------------- running

    def submit(self, index: int, batch: np.ndarray) -> Future[np.ndarray]:
        """Issue micro-batch ``index`` (slot ``index % depth``) through every stage, without waiting.

        The future gives the last stage's output, or the first error of any step.
        """
        if self._closed:
            raise BadRequest("the pipeline is closed")
        if tuple(batch.shape) != self.shapes[0]:
            raise BadRequest(f"micro-batch of shape {batch.shape}, the pipeline takes "
                             f"{self.shapes[0]}")
        slots = [stage[index % self.depth] for stage in self.stages]
        runs = [LinkedRun(s.graph, x=s.x, y=s.y) for s in slots]
        first = slots[0]
        client = self.clients[0]
        steps: list[Future[Any]] = []
        if batch.nbytes <= client.chunk_bytes:      # the batch travels in stage 0's run message
            runs[0] = LinkedRun(first.graph, [(first.x, batch)], x=first.x, y=first.y)
        else:
            steps.append(client.set_tensor_async(first.x, batch))
        steps += run_chain(runs).runs
        last = slots[-1]
        steps.append(last.y.client.get_tensor_async(last.y))
        return first_error(steps, lambda: steps[-1].result())

    def run(self, batches: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Push every micro-batch through the stages; the last stage's outputs, in order.

        Raises the first error of the first micro-batch that fails; at most ``max_in_flight``
        micro-batches are outstanding at any time.
        """
        pending: deque[Future[np.ndarray]] = deque()
        outputs: list[np.ndarray] = []
        for index, batch in enumerate(batches):
            if len(pending) >= self.max_in_flight:
                outputs.append(pending.popleft().result())
            pending.append(self.submit(index, batch))
        outputs.extend(future.result() for future in pending)
        return outputs

    # -------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free the graphs and buffers on the workers (best effort). Idempotent."""
        if self._closed:
            return
        self._closed = True
        futures = [g.free_async() for g in self._graphs]
        futures += [b.free_async() for b in self._buffers]
        for future in futures:
            future.exception()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



@dataclass(frozen=True, slots=True)
class LinkedRun:
    """One stage's part of a chained step: its graph, the inputs sent inside its run message, the
    tensors fetched back, and its hand-off ends (``x``: where the previous stage's output lands;
    ``y``: its own output, handed to the next stage)."""

    graph: RegisteredGraph
    inputs: Sequence[tuple[RemoteTensor, np.ndarray]] = ()
    fetch: Sequence[RemoteTensor] = ()
    x: RemoteTensor | None = None
    y: RemoteTensor | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    """What :func:`run_chain` issued: each stage's run, and the hand-offs the runs send."""

    runs: list[Future[RunResult]]
    sent: list[HandOff]

    @property
    def messages(self) -> int:
        """Requests issued: one per run, plus per hand-off none worker to worker, a copy on one
        worker, or a fetch and a relayed fill through the client."""
        return len(self.runs) + sum(_HAND_OFF_MESSAGES[h.route] for h in self.sent)


_HAND_OFF_MESSAGES = {"direct": 0, "local": 1, "relay": 2}


def run_chain(runs: Sequence[LinkedRun], *, receive: HandOff | None = None,
              send: HandOff | None = None, hold_reply: float = 0.0) -> Chain:
    """Issue one linked run per stage, in order, without waiting: stage ``i`` receives stage
    ``i - 1``'s ``y`` into its ``x`` and sends its own ``y`` on (``receive``: the first stage's
    input from elsewhere; ``send``: the last stage's output to elsewhere). The workers' queues
    order it all; ``hold_reply`` is passed to every run (see :meth:`Client.run`)."""
    futures: list[Future[RunResult]] = []
    sent: list[HandOff] = []
    for i, run in enumerate(runs):
        out = send if i == len(runs) - 1 else _hop(run, runs[i + 1])
        futures.append(run.graph.client.run_async(
            run.graph, list(run.inputs), list(run.fetch), receive=[receive] if receive else [],
            send=[out] if out else [], hold_reply=hold_reply))
        sent += [out] if out else []
        receive = out
    return Chain(futures, sent)


def _hop(run: LinkedRun, following: LinkedRun) -> HandOff:
    if run.y is None or following.x is None:
        raise BadRequest("a chained stage needs an output y and its successor an input x")
    return hand_off(run.y, following.x)

def _boundary_shapes(shape: Sequence[int] | Sequence[Sequence[int]], stages: int) -> list[Shape]:
    """One shape for every boundary, or the ``stages + 1`` shapes given."""
    if not shape or isinstance(shape[0], (int, np.integer)):
        return [tuple(int(d) for d in cast(Sequence[int], shape))] * (stages + 1)
    shapes = [tuple(int(d) for d in s) for s in cast(Sequence[Sequence[int]], shape)]
    if len(shapes) != stages + 1:
        raise BadRequest(f"{stages} stage(s) need {stages + 1} boundary shapes, got {len(shapes)}")
    return shapes
