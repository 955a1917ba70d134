"""Client library against real workers: round trips, views, pipelining, many clients, lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from conftest import WorkerProcess
from zmq_rpc.broker.protocol import DType
from zmq_rpc.client import (
    AsyncClient,
    BadRequest,
    Client,
    ClientClosed,
    ConnectionLost,
    InvalidHandle,
    OutOfBounds,
    OutOfMemory,
    RemoteTensor,
    Timeout,
    from_bfloat16,
    to_bfloat16,
)
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(60)

RNG = np.random.default_rng(7)


def random_array(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool":
        return RNG.integers(0, 2, shape).astype(bool)
    if dtype == "bfloat16":
        return from_bfloat16(to_bfloat16(RNG.standard_normal(shape).astype(np.float32)))
    kind = np.dtype(dtype)
    if kind.kind == "f":
        return RNG.standard_normal(shape).astype(kind)
    info = np.iinfo(kind)
    return RNG.integers(info.min, info.max, shape, dtype=kind, endpoint=True)


@pytest.mark.parametrize("dtype", [d.dtype_name for d in DType])
def test_round_trip_every_dtype(client: Client, dtype: str) -> None:
    buf = client.alloc_buffer(1 << 16)
    for shape in [(), (7,), (3, 5), (2, 3, 4), (1, 2, 1, 2, 1, 2, 1, 2)]:
        t = buf.tensor(shape, dtype, offset=64)
        values = random_array(shape, dtype)
        client.set_tensor(t, values)
        out = client.get_tensor(t)
        assert out.shape == shape
        np.testing.assert_array_equal(out, values)


def test_strided_views_read_and_write(client: Client) -> None:
    buf = client.alloc_buffer(1 << 20)
    base = buf.tensor((16, 24), "float32")
    values = RNG.standard_normal((16, 24)).astype(np.float32)
    client.set_tensor(base, values)
    for key in [np.s_[::2], np.s_[3:11, ::-3], np.s_[..., 5], np.s_[-1], np.s_[None, 2:4, 1::5]]:
        np.testing.assert_array_equal(client.get_tensor(base[key]), values[key])
    np.testing.assert_array_equal(client.get_tensor(base.T), values.T)
    np.testing.assert_array_equal(client.get_tensor(base.reshape(4, 4, 24).transpose(2, 0, 1)),
                                  values.reshape(4, 4, 24).transpose(2, 0, 1))
    patch = np.arange(8 * 4, dtype=np.float32).reshape(4, 8)
    client.set_tensor(base.T[::3, 1:9:2].T, patch)   # write through a strided view
    values.T[::3, 1:9:2] = patch.T
    np.testing.assert_array_equal(client.get_tensor(base), values)


def test_raw_view_and_aliasing(client: Client) -> None:
    buf = client.alloc_buffer(4096)
    words = buf.tensor(16, "uint32")
    client.set_tensor(words, np.arange(16, dtype=np.uint32))
    as_bytes = words.view((64,), dtype="uint8")
    np.testing.assert_array_equal(client.get_tensor(as_bytes),
                                  np.arange(16, dtype=np.uint32).view(np.uint8))
    every_other = words.view((8,), strides=(8,), offset=4)
    np.testing.assert_array_equal(client.get_tensor(every_other), np.arange(1, 16, 2))
    with pytest.raises(OutOfBounds):
        client.get_tensor(words.view((2000,)))


def test_large_strided_tensor_is_chunked(worker: WorkerServer,
                                         make_client: Callable[..., Client]) -> None:
    client = make_client(worker.endpoint, chunk_bytes=64 << 10)
    buf = client.alloc_buffer(8 << 20)
    base = buf.tensor((512, 1024), "float32")
    values = RNG.standard_normal((512, 1024)).astype(np.float32)
    client.set_tensor(base.T, values.T.copy())  # strided, many chunks, rows split further
    np.testing.assert_array_equal(client.get_tensor(base), values)
    np.testing.assert_array_equal(client.get_tensor(base.T[::2]), values.T[::2])


def test_get_into_out(client: Client) -> None:
    buf = client.alloc_buffer(1 << 20)
    t = buf.tensor((256, 256), "float32")
    values = RNG.standard_normal((256, 256)).astype(np.float32)
    client.set_tensor(t, values)
    out = np.empty((128, 256), np.float32)
    assert client.get_tensor(t[::2], out=out) is out
    np.testing.assert_array_equal(out, values[::2])
    half = buf.tensor(8, "bfloat16", offset=512 << 10)
    client.set_tensor(half, np.arange(8, dtype=np.float32))
    wide, bits = np.empty(8, np.float32), np.empty(8, np.uint16)
    np.testing.assert_array_equal(client.get_tensor(half, out=wide), np.arange(8))
    np.testing.assert_array_equal(from_bfloat16(client.get_tensor(half, out=bits)), np.arange(8))
    for bad in (np.empty((256, 128), np.float32), np.empty((128, 256), np.float64),
                np.empty((256, 256), np.float32)[::2]):
        with pytest.raises(BadRequest, match="out="):
            client.get_tensor(t[::2], out=bad)


def test_memset_clear_copy(client: Client) -> None:
    buf = client.alloc_buffer(1024)
    t = buf.tensor(64, "uint8")
    buf.clear(7)
    assert (client.get_tensor(t) == 7).all()
    client.memset_tensor(t, 1, offset=10, size=5)
    expected = np.full(64, 7, np.uint8)
    expected[10:15] = 1
    np.testing.assert_array_equal(client.get_tensor(t), expected)
    f = buf.tensor(16, "float32", offset=256)
    client.set_tensor(f, np.arange(16, dtype=np.float32))
    client.copy_tensor(f[:12], f[4:])   # overlapping: numpy semantics (as if through a temporary)
    ref = np.arange(16, dtype=np.float32)
    ref[4:] = ref[:12].copy()
    np.testing.assert_array_equal(client.get_tensor(f), ref)
    with pytest.raises(OutOfBounds):
        client.memset_tensor(t, 0, offset=60, size=5)


def test_pipelined_requests_run_in_order(client: Client) -> None:
    buf = client.alloc_buffer_nowait(4096)       # no wait: later requests pipeline behind it
    t = buf.tensor(256, "int32")
    futures: list[Future[None]] = []
    for i in range(200):
        futures.append(client.set_tensor_async(t[i % 256:], np.full(256 - i % 256, i, np.int32)))
    reads = [client.get_tensor_async(t) for _ in range(3)]
    client.synchronize()
    assert all(f.done() for f in futures + reads)
    expected = np.zeros(256, np.int32)
    for i in range(200):
        expected[i % 256:] = i
    for read in reads:
        np.testing.assert_array_equal(read.result(), expected)


def test_errors_fail_only_their_future(client: Client) -> None:
    buf = client.alloc_buffer(64)
    good = client.set_tensor_async(buf.tensor(4, "float32"), np.ones(4, np.float32))
    bad = client.get_tensor_async(buf.tensor(4, "float32").view((32,)))
    with pytest.raises(OutOfBounds, match="reaches bytes"):
        bad.result()
    good.result()
    buf.free()
    with pytest.raises(InvalidHandle):
        client.get_tensor(buf.tensor(4, "float32"))


def test_local_argument_errors(client: Client) -> None:
    buf = client.alloc_buffer(64)
    t = buf.tensor(4, "float32")
    with pytest.raises(BadRequest, match="dtype"):
        client.set_tensor(t, np.ones(4, np.float64))
    with pytest.raises(BadRequest, match="shape"):
        client.set_tensor(t, np.ones(5, np.float32))
    with pytest.raises(BadRequest):
        buf.tensor(100, "float32")
    with pytest.raises(ValueError):
        t[[0, 1]]


def test_memory_limit_and_device_memory(worker: WorkerServer, client: Client) -> None:
    free, total = client.device_memory()
    assert total == 256 << 20 and free == total
    buf = client.alloc_buffer(100 << 20)
    assert client.device_memory().free == total - (100 << 20)
    with pytest.raises(OutOfMemory, match="does not fit"):
        client.alloc_buffer(200 << 20)
    buf.free()
    assert client.device_memory().free == total
    assert client.info.devices[0].kind == "cpu"
    assert client.info.max_buffer_size == 256 << 20


def test_eight_clients_thousand_mixed_requests(worker: WorkerServer,
                                               make_client: Callable[..., Client]) -> None:
    clients = [make_client(worker.endpoint, window=64) for _ in range(8)]
    errors: list[BaseException] = []

    def run(index: int, client: Client) -> None:
        try:
            rng = np.random.default_rng(index)
            buf = client.alloc_buffer(1 << 16)
            shadow = np.zeros(1 << 14, np.float32)
            t = buf.tensor(1 << 14, "float32")
            pending: list[tuple[Future[np.ndarray], np.ndarray]] = []
            for i in range(1000):
                lo = int(rng.integers(0, shadow.size - 64))
                kind = i % 4
                if kind == 0:
                    vals = rng.standard_normal(64).astype(np.float32)
                    client.set_tensor_async(t[lo:lo + 64], vals)
                    shadow[lo:lo + 64] = vals
                elif kind == 1:
                    pending.append((client.get_tensor_async(t[lo:lo + 64]),
                                    shadow[lo:lo + 64].copy()))
                elif kind == 2:
                    client.memset_tensor_async(t[lo:lo + 16], 0)
                    shadow[lo:lo + 16] = 0
                else:
                    client.copy_tensor_async(t[lo:lo + 32], t[lo + 32:lo + 64])
                    shadow[lo + 32:lo + 64] = shadow[lo:lo + 32]
            client.synchronize()
            for future, expected in pending:
                np.testing.assert_array_equal(future.result(), expected)
            np.testing.assert_array_equal(client.get_tensor(t), shadow)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(50)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_sessions_are_isolated(worker: WorkerServer, make_client: Callable[..., Client]) -> None:
    a, b = make_client(worker.endpoint), make_client(worker.endpoint)
    buf_a = a.alloc_buffer(64)
    a.set_tensor(buf_a.tensor(4, "int32"), np.arange(4, dtype=np.int32))
    buf_b = b.alloc_buffer(64)       # same handle number on another session: its own buffer
    assert buf_b.handle == buf_a.handle
    np.testing.assert_array_equal(b.get_tensor(buf_b.tensor(4, "int32")), np.zeros(4))
    np.testing.assert_array_equal(a.get_tensor(buf_a.tensor(4, "int32")), np.arange(4))
    with pytest.raises(BadRequest, match="lives on"):      # b's tensor named to a
        a.get_tensor(buf_b.tensor(4, "int32"))


def test_close_fails_pending_and_new_calls(worker: WorkerServer,
                                           make_client: Callable[..., Client]) -> None:
    client = make_client(worker.endpoint)
    buf = client.alloc_buffer(64 << 20)
    t = buf.tensor(16 << 20, "float32")
    pending = [client.get_tensor_async(t) for _ in range(4)]
    client.close()
    for future in pending:
        try:
            future.result(timeout=10)
        except ClientClosed:
            pass
    with pytest.raises(ClientClosed):
        client.ping()
    client.close()  # idempotent


def test_timeout_and_unreachable_worker() -> None:
    with pytest.raises(ConnectionLost, match="cannot reach"):
        Client("tcp://127.0.0.1:9", connect_timeout=0.3)


def test_request_timeout_on_frozen_worker(spawn_worker: Callable[..., WorkerProcess],
                                          make_client: Callable[..., Client]) -> None:
    proc = spawn_worker()
    client = make_client(proc.endpoint, timeout=0.5)
    client.ping()
    proc.freeze()                                   # a frozen worker
    try:
        with pytest.raises(Timeout, match="PING"):
            client.ping()
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    client.ping()


def test_async_client(worker: WorkerServer) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(worker.endpoint) as c:
            buf = await c.alloc_buffer(1 << 16)
            t = buf.tensor((32, 32), "float16")
            values = RNG.standard_normal((32, 32)).astype(np.float16)
            await c.set_tensor(t, values)
            results = await asyncio.gather(*(c.get_tensor(t[i]) for i in range(32)))
            np.testing.assert_array_equal(np.stack(results), values)
            await c.memset_tensor(t, 0)
            assert not (await c.get_tensor(t)).any()
            await c.synchronize()
            assert (await c.device_memory()).total == 256 << 20

    asyncio.run(main())


def test_async_client_graphs_and_linked_runs(make_worker: Callable[..., WorkerServer]) -> None:
    """The asyncio face runs graphs too: a two-worker ring of linked runs, issued in order
    without awaiting in between, then a one-shot compute."""
    from zmq_rpc.client import Graph, hand_off

    async def stage(c: AsyncClient, add: float) -> tuple[Any, RemoteTensor, RemoteTensor]:
        x, y, k = [(await c.alloc_buffer(64)).tensor((16,), "float32") for _ in range(3)]
        await c.set_tensor(k, np.full(16, add, np.float32))
        g = Graph()
        g.add(x, k, out=y)
        return await c.register(g), x, y

    async def main(endpoints: list[str]) -> None:
        a, b = [await AsyncClient.connect(e) for e in endpoints]
        try:
            (ga, xa, ya), (gb, xb, yb) = await stage(a, 1.0), await stage(b, 10.0)
            await a.set_tensor(xa, np.arange(16, dtype=np.float32))
            runs, previous = [], None
            for _ in range(20):
                there, back = hand_off(ya, xb), hand_off(yb, xa)
                runs.append(a.run(ga, receive=[previous] if previous else [], send=[there]))
                runs.append(b.run(gb, receive=[there], send=[back], fetch=[yb],
                                  hold_reply=0.001))
                previous = back
            results = await asyncio.wait_for(asyncio.gather(*runs), 20)
            await a.receive(previous)
            np.testing.assert_array_equal(results[-1][0], np.arange(16) + 11.0 * 20)
            np.testing.assert_array_equal(await a.get_tensor(xa), np.arange(16) + 11.0 * 20)
            g = Graph()
            g.mul(xa, xa, out=ya)
            (squared,) = await a.compute(g, fetch=[ya])
            np.testing.assert_array_equal(squared, (np.arange(16) + 220.0) ** 2)
            await a.free_graph(ga)
        finally:
            await a.close()
            await b.close()

    workers = [make_worker() for _ in range(2)]
    asyncio.run(main([w.endpoint for w in workers]))


def _peak_mib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM"))
    return int(line.split()[1]) >> 10


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_large_transfers_need_no_second_copy_in_memory(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    """256 MiB each way: the extra memory on either side stays near the in-flight window."""
    proc = spawn_worker()
    client = make_client(proc.endpoint)
    size = 256 << 20
    data = np.ones(size, np.uint8)
    out = np.zeros(size, np.uint8) + 2           # touched: only new memory shows in the peak
    t = client.alloc_buffer(size).tensor(size, "uint8")
    client_before, worker_before = _peak_mib(), _peak_mib(proc.proc.pid)
    client.set_tensor(t, data)
    client.get_tensor(t, out=out)
    client_grew, worker_grew = _peak_mib() - client_before, _peak_mib(proc.proc.pid) - worker_before
    window = client.connection.options.window_bytes >> 20
    assert client_grew <= window + 48
    assert worker_grew <= (size >> 20) + window + 48
    assert out.min() == 1 and out.max() == 1
