"""The cupy backend's own code on the CPU: ``--device cuda`` workers over a stand-in cupy.

Each "cuda" worker here is a real ``zmq-rpc-worker`` subprocess run through ``tests/fake_cupy.py``:
device arrays live in host memory, ``memcpyAsync`` is a ``memmove``, but everything above them is
the GPU worker's code: buffers and strided views built from device pointers, uploads and peer
chunks through the pinned staging slots, peer pushes prefetched into them, the kernel table with
cupy's overrides (their CUDA kernels are the one thing that cannot run here). Every result is
checked byte for byte against a numpy worker doing the same thing. On a GPU, the same scenarios
run on real cupy in ``test_cupy_backend.py`` (``tools/gpu_check.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import LOOPBACK, RelayLog
from zmq_rpc.client import Client, Graph, RemoteError, from_bfloat16
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(120)

FAKE = str(Path(__file__).with_name("fake_cupy.py"))
MiB = 1 << 20
RNG = np.random.default_rng(11)


class FakeCudaWorker:
    """``zmq-rpc-worker --device cuda`` over the stand-in cupy, in a subprocess."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, FAKE, "--bind", LOOPBACK, "--device", "cuda", "--mem", "512MiB",
             "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"fake cuda worker did not start: {line!r}")
        self.endpoint = line.rsplit(" ", 1)[1].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        assert self.proc.wait(20) == 0
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def fake_cuda() -> Iterator[Callable[[], Client]]:
    """``fake_cuda()``: a client of a new fake cuda worker (the client closed, then the worker
    stopped, exit 0, at the end: a session still open would hold its SIGTERM drain)."""
    workers: list[FakeCudaWorker] = []
    clients: list[Client] = []

    def start() -> Client:
        workers.append(FakeCudaWorker())
        clients.append(Client(workers[-1].endpoint, timeout=20.0))
        return clients[-1]

    yield start
    for client in clients:
        client.close()
    for worker in workers:
        worker.stop()


@pytest.fixture
def cpu(make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client]) -> Client:
    return make_client(make_worker(memory_limit=256 * MiB).endpoint)


def test_hello_describes_a_cuda_worker(fake_cuda: Callable[[], Client]) -> None:
    info = fake_cuda().info
    assert info.devices[0].kind == "cuda" and info.devices[0].name == "Fake GPU"
    assert info.device_details[0].compute_capability == "9.0"
    assert info.device_details[0].memory == 4 << 30
    assert "graph-v1" in info.capabilities and "peer-copy" in info.capabilities
    assert "packed-kernels" not in info.capabilities and "zero-copy" not in info.capabilities
    assert info.alignment == 256


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64", "int8", "uint16", "bool"])
def test_set_and_get_are_exact_contiguous_strided_and_through_many_slots(
        fake_cuda: Callable[[], Client], dtype: str) -> None:
    gpu = fake_cuda()
    storage = np.dtype("uint16" if dtype == "bfloat16" else dtype)
    values = RNG.integers(0, 256, 6 * 40 * storage.itemsize, dtype=np.uint8).view(storage)
    values = (values.astype(bool) if dtype == "bool" else values).reshape(6, 40)
    t = gpu.alloc_buffer(values.nbytes + 256).tensor((6, 40), dtype, offset=256)
    gpu.set_tensor(t, values)
    fetch = {"out": np.empty((6, 40), storage)} if dtype == "bfloat16" else {}
    assert gpu.get_tensor(t, **fetch).tobytes() == values.tobytes()
    part = t[1::2, 3::5]
    fresh = np.ascontiguousarray(values[::-1][1::2, 3::5])
    gpu.set_tensor(part, fresh if dtype != "bfloat16" else fresh)
    expected = values.copy()
    expected[1::2, 3::5] = fresh
    out = {"out": np.empty((6, 40), storage)} if dtype == "bfloat16" else {}
    assert gpu.get_tensor(t, **out).tobytes() == expected.tobytes()
    big = RNG.integers(0, 256, 37 * MiB + 5, dtype=np.uint8)     # 10 pinned slots of 4 MiB
    whole = gpu.alloc_buffer(big.size).tensor(big.size, "uint8")
    gpu.set_tensor(whole, big)
    assert np.array_equal(gpu.get_tensor(whole), big)


@pytest.mark.parametrize("layout", ["cuda->cpu", "cpu->cuda", "cuda->cuda"])
def test_peer_copies_are_exact_and_go_worker_to_worker(
        fake_cuda: Callable[[], Client], cpu: Client, layout: str, relay_log: RelayLog) -> None:
    """27 MiB: 7 chunks, more than the 4 pinned slots each way (prefetch, take, slot reuse)."""
    kinds = layout.split("->")
    a, b = (fake_cuda() if kind == "cuda" else cpu for kind in kinds)
    values = RNG.normal(size=(27 * MiB // 4,)).astype(np.float32)
    src = a.alloc_buffer(values.nbytes + 64).tensor(values.size, "float32", offset=64)
    dst = b.alloc_buffer(values.nbytes + 512).tensor(values.size, "float32", offset=512)
    a.set_tensor(src, values)
    for _ in range(2):                                  # the slots are reused by the second
        a.copy_tensor(src, dst)
        assert np.array_equal(b.get_tensor(dst), values)
        values = values[::-1].copy()
        a.set_tensor(src, values)
    strided = a.alloc_buffer(24 * 13 * 4).tensor((24, 13), "float32")
    a.set_tensor(strided, np.arange(24 * 13, dtype=np.float32).reshape(24, 13))
    target = b.alloc_buffer(13 * 12 * 4).tensor((13, 12), "float32")
    a.copy_tensor(strided.T[:, ::2], target)
    assert np.array_equal(b.get_tensor(target),
                          np.arange(24 * 13, dtype=np.float32).reshape(24, 13).T[:, ::2])
    assert relay_log.relayed() == 0


def _graph(client: Client) -> tuple[Graph, dict[str, object]]:
    """Shared kernels on the worker's arrays: norms, matmul, masked softmax, exact GELU (erf),
    get_rows, set_rows with a repeated index (the last write wins), a bfloat16 output, argmax."""
    rng = np.random.default_rng(5)
    buf = client.alloc_buffer(1 << 20)
    x = buf.tensor((8, 32), "float32")
    w = buf.tensor((16, 32), "float32", offset=64 << 10)
    mask = buf.tensor((8, 8), "float32", offset=128 << 10)
    idx = buf.tensor(4, "int32", offset=160 << 10)
    first = buf.tensor(4, "int32", offset=161 << 10)
    y_out = buf.tensor((8, 16), "float32", offset=384 << 10)
    table = buf.tensor((10, 16), "float32", offset=192 << 10)
    out = buf.tensor((8, 16), "bfloat16", offset=256 << 10)
    picked = buf.tensor(8, "int32", offset=320 << 10)
    client.set_tensor(x, rng.normal(size=(8, 32)).astype(np.float32))
    client.set_tensor(w, rng.normal(size=(16, 32)).astype(np.float32) / 4)
    client.set_tensor(mask, np.triu(np.full((8, 8), -np.inf, np.float32), 1))
    client.set_tensor(idx, np.array([3, 7, 3, 0], np.int32))
    client.set_tensor(first, np.arange(4, dtype=np.int32))
    client.set_tensor(table, np.zeros((10, 16), np.float32))
    g = Graph()
    h = g.matmul(g.layer_norm(g.rms_norm(x, eps=1e-6), eps=1e-5), w, transpose_b=True)
    p = g.soft_max(g.matmul(h, h, transpose_b=True), mask=mask, scale=0.25)
    y = g.gelu(g.matmul(p, h))
    g.set_rows(table, g.get_rows(y, first), idx)
    g.cpy(y, out)
    g.cpy(y, y_out)
    g.argmax(y, out=picked)
    return g, {"y": y_out, "out": out, "table": table, "picked": picked}


def test_graphs_match_a_numpy_worker_and_the_cuda_kernels_are_the_overrides(
        fake_cuda: Callable[[], Client], cpu: Client) -> None:
    gpu = fake_cuda()
    results = []
    for client in (gpu, cpu):
        g, tensors = _graph(client)
        handle = client.register(g)
        client.run(handle)
        client.run(handle)                                   # again, on the same arena
        results.append({name: client.get_tensor(t) for name, t in tensors.items()})
    for got in results:                                 # set_rows: the last write wins
        y, table = got["y"], got["table"]
        assert np.array_equal(table[[3, 7, 0]], y[[2, 1, 3]]) and not table[[1, 2, 4, 5, 6, 8, 9]].any()
        assert np.array_equal(got["picked"], y.argmax(axis=1))
    # the device path sums rms_norm with einsum, numpy with vecdot: the last bits may differ
    np.testing.assert_allclose(results[0]["y"], results[1]["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(from_bfloat16(np.asarray(results[0]["out"])),
                               from_bfloat16(np.asarray(results[1]["out"])), rtol=1e-2, atol=1e-2)
    x = gpu.alloc_buffer(4096).tensor((2, 1, 8), "float32")
    pos = gpu.alloc_buffer(64).tensor(2, "int32")
    g = Graph()
    g.rope(x, pos, n_dims=8, out=x)
    with pytest.raises(RemoteError, match="fake cupy runs no CUDA kernel .zmq_rpc_rope."):
        gpu.compute(g)                                      # cupy's table: the CUDA rope
    gpu.ping()


def _row_graph(client: Client) -> tuple[Graph, dict[str, object]]:
    """attend_rows over a float16 cache (three sequences, a padding row, a window) and
    sample_rows (greedy, top-k, nucleus rows) on the worker's arrays."""
    rng = np.random.default_rng(8)
    buf = client.alloc_buffer(1 << 20)
    t = {name: buf.tensor(shape, dtype, offset=i << 14) for i, (name, shape, dtype) in enumerate((
        ("q", (5, 4, 8), "float32"), ("k", (20, 2, 8), "float16"), ("v", (20, 2, 8), "float16"),
        ("pos", 5, "int32"), ("base", 5, "int32"), ("att", (5, 4, 8), "float32"),
        ("logits", (5, 300), "float32"), ("temperature", 5, "float32"), ("top_k", 5, "int32"),
        ("top_p", 5, "float32"), ("seed", 5, "uint32"), ("counter", 5, "int32"), ("tokens", 5, "int32")))}
    values = {"q": rng.normal(size=(5, 4, 8)), "k": rng.normal(size=(20, 2, 8)),
              "v": rng.normal(size=(20, 2, 8)), "pos": [0, 4, -1, 6, 2], "base": [0, 0, 99, 8, 15],
              "logits": rng.normal(size=(5, 300)) * 3, "temperature": [0, 0.8, 1.0, 1.2, 0.5],
              "top_k": [0, 0, 40, 1, 5], "top_p": [1, 0.9, 1, 0.5, 0.7], "seed": [1, 2, 3, 4, 5],
              "counter": [0, 10, 20, 30, 40]}
    for name, value in values.items():
        client.set_tensor(t[name], np.asarray(value, t[name].dtype))
    g = Graph()
    g.attend_rows(t["q"], t["k"], t["v"], t["pos"], t["base"], scale=0.3, window=3, out=t["att"])
    g.sample_rows(*(t[n] for n in ("logits", "temperature", "top_k", "top_p", "seed", "counter")),
                  out=t["tokens"])
    return g, {"att": t["att"], "tokens": t["tokens"]}


def test_row_ops_on_a_cuda_worker_match_a_numpy_worker(fake_cuda: Callable[[], Client],
                                                        cpu: Client) -> None:
    """The cupy backend runs attend_rows as one shared attention per row and sample_rows as the
    whole-array composition: the same rows (to float rounding) and the same tokens as the CPU's
    numba loops; the padding row is zeros on both."""
    gpu = fake_cuda()
    assert "row-attention" in gpu.info.capabilities
    results = []
    for client in (gpu, cpu):
        g, tensors = _row_graph(client)
        client.compute(g)
        results.append({name: client.get_tensor(tensor) for name, tensor in tensors.items()})
    np.testing.assert_allclose(results[0]["att"], results[1]["att"], rtol=1e-5, atol=1e-6)
    assert not results[0]["att"][2].any() and not results[1]["att"][2].any()
    assert results[0]["tokens"].tolist() == results[1]["tokens"].tolist()
