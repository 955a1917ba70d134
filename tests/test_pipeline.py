"""Pipeline parallelism (:mod:`zmq_rpc.client.pipeline`): results equal a numpy run, in order."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from zmq_rpc.client import BadRequest, Client, Graph, RemoteTensor
from zmq_rpc.client.pipeline import Pipeline
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(60)

SHAPES = [(4, 16), (4, 32), (4, 8), (4, 16)]
"""Activation shapes at the stage boundaries of a (up to) 3-stage model."""


class Model:
    """Stage ``i``: ``y = tanh(x @ W[i] + b[i])``, weights uploaded once per stage."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int = 3) -> None:
        rng = np.random.default_rng(seed)
        self.shapes = shapes
        self.weights = [((rng.standard_normal((a[-1], b[-1])) / np.sqrt(a[-1])).astype(np.float32),
                         rng.standard_normal(b[-1]).astype(np.float32))
                        for a, b in itertools.pairwise(shapes)]
        self.remote: dict[int, tuple[RemoteTensor, RemoteTensor]] = {}
        self.built: list[int] = []

    def build(self, stage: int, x: RemoteTensor, y: RemoteTensor) -> Graph:
        self.built.append(stage)
        if stage not in self.remote:
            self.remote[stage] = tuple(self.upload(x.client, w)   # type: ignore[assignment]
                                       for w in self.weights[stage])
        w, b = self.remote[stage]
        g = Graph()
        g.tanh(g.matmul(x, w) + b, out=y)
        return g

    @staticmethod
    def upload(client: Client, values: np.ndarray) -> RemoteTensor:
        tensor = client.alloc_buffer(values.nbytes).tensor(values.shape, "float32")
        client.set_tensor(tensor, values)
        return tensor

    def reference(self, x: np.ndarray, stages: int) -> np.ndarray:
        for w, b in self.weights[:stages]:
            x = np.tanh(x @ w + b)
        return x


def batches(count: int, shape: tuple[int, ...], seed: int = 11) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) + k for k in range(count)]


@pytest.fixture
def clients(make_worker: Callable[..., WorkerServer],
            make_client: Callable[..., Client]) -> list[Client]:
    return [make_client(make_worker(memory_limit=64 << 20).endpoint) for _ in range(3)]


def check(outputs: list[np.ndarray], inputs: list[np.ndarray], model: Model, stages: int) -> None:
    assert len(outputs) == len(inputs)
    for k, (out, x) in enumerate(zip(outputs, inputs)):
        np.testing.assert_allclose(out, model.reference(x, stages), rtol=1e-5, atol=1e-5,
                                   err_msg=f"micro-batch {k}")


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("count", [1, 2, 5, 17])
def test_pipeline_matches_numpy(clients: list[Client], stages: int, count: int) -> None:
    model = Model(SHAPES[:stages + 1])
    inputs = batches(count, SHAPES[0])
    with Pipeline(clients[:stages], model.build, model.shapes) as pipe:
        check(pipe.run(inputs), inputs, model, stages)
        check(pipe.run(inputs[::-1]), inputs[::-1], model, stages)   # reusable, order kept
    assert sorted(model.built) == sorted(list(range(stages)) * 2)    # depth 2: one graph a slot


@pytest.mark.parametrize("depth, in_flight", [(1, 1), (1, 8), (3, 2), (4, 20)])
def test_depth_and_window_do_not_change_results(clients: list[Client], depth: int,
                                                in_flight: int) -> None:
    model = Model(SHAPES)
    inputs = batches(12, SHAPES[0])
    with Pipeline(clients, model.build, model.shapes, depth=depth,
                  max_in_flight=in_flight) as pipe:
        check(pipe.run(inputs), inputs, model, 3)


def test_one_shape_everywhere_and_submit(clients: list[Client]) -> None:
    shape = (2, 3, 8)
    model = Model([shape] * 3)
    inputs = batches(6, shape)
    with Pipeline(clients[:2], model.build, shape) as pipe:
        futures = [pipe.submit(k, x) for k, x in enumerate(inputs)]
        check([f.result(timeout=20) for f in futures], inputs, model, 2)


def test_stages_sharing_a_worker(clients: list[Client]) -> None:
    model = Model(SHAPES)
    inputs = batches(7, SHAPES[0])
    with Pipeline([clients[0], clients[1], clients[0]], model.build, model.shapes) as pipe:
        check(pipe.run(inputs), inputs, model, 3)
    with Pipeline([clients[0]], Model(SHAPES[:2]).build, SHAPES[:2]) as single:
        assert len(single.run(inputs)) == 7


def test_batches_bigger_than_one_message(make_worker: Callable[..., WorkerServer],
                                         make_client: Callable[..., Client]) -> None:
    small = [make_client(make_worker().endpoint, chunk_bytes=4096) for _ in range(2)]
    shapes = [(64, 32), (64, 16), (64, 32)]      # 8 KiB inputs: uploaded, then run
    model = Model(shapes)
    inputs = batches(5, shapes[0])
    with Pipeline(small, model.build, shapes) as pipe:
        check(pipe.run(inputs), inputs, model, 2)


def test_relayed_hop_still_correct(make_worker: Callable[..., WorkerServer],
                                   make_client: Callable[..., Client]) -> None:
    lonely = make_client(make_worker(peer_bind="").endpoint)   # no peer endpoint: relayed
    other = make_client(make_worker().endpoint)
    model = Model(SHAPES[:3])
    inputs = batches(4, SHAPES[0])
    with Pipeline([other, lonely], model.build, model.shapes) as pipe:
        check(pipe.run(inputs), inputs, model, 2)


def open_peer_links(clients: list[Client]) -> None:
    """Open the links a pipeline's hand-offs take (each worker to the next): an open peer
    connection is counted in its receiver's --mem while it stays open (worker/peer/queue.py),
    whoever's transfers use it."""
    for a, b in zip(clients, clients[1:]):
        src, dst = a.alloc_buffer(64), b.alloc_buffer(64)
        a.copy_tensor(src.tensor((16,), "float32"), dst.tensor((16,), "float32"))
        src.free()
        dst.free()


def test_close_frees_worker_memory_and_rejects_work(clients: list[Client]) -> None:
    open_peer_links(clients)
    free = [c.device_memory().free for c in clients]
    model = Model(SHAPES)
    pipe = Pipeline(clients, model.build, model.shapes)
    pipe.run(batches(2, SHAPES[0]))
    pipe.close()
    pipe.close()
    weights = [sum(w.nbytes for w in model.weights[i]) for i in range(3)]
    assert [c.device_memory().free for c in clients] == [f - w for f, w in zip(free, weights)]
    with pytest.raises(BadRequest):
        pipe.submit(0, batches(1, SHAPES[0])[0])


def test_bad_arguments(clients: list[Client]) -> None:
    model = Model(SHAPES[:3])
    with pytest.raises(BadRequest, match="boundary shapes"):
        Pipeline(clients[:2], model.build, SHAPES)
    with pytest.raises(BadRequest):
        Pipeline([], model.build, SHAPES[0])
    with Pipeline(clients[:2], model.build, model.shapes) as pipe:
        with pytest.raises(BadRequest, match="shape"):
            pipe.run([np.zeros((5, 16), np.float32)])
        with pytest.raises(BadRequest, match="dtype"):
            pipe.run([np.zeros(SHAPES[0], np.float64)])
