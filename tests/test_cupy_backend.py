"""The cupy (NVIDIA GPU) backend through the real client/worker stack, byte for byte against numpy.

Every GPU worker here is a real in-process :class:`WorkerServer` with ``device="cuda"``; results are
compared byte for byte (NaN payloads, -0.0, subnormals and raw bool bytes included) with what the
numpy backend computes for the same requests: a :class:`Mirror` replays every request on a host
byte array through :class:`NumpyBackend`, the CPU worker's own code. Peer copies run between a
cuda worker and a numpy worker in both directions, and between two cuda workers on one GPU.

Skipped unless cupy imports and sees at least one CUDA device. The one test that may fault the
GPU (misaligned views) runs its worker in a subprocess, so a poisoned CUDA context cannot take the
other tests down with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from conftest import RelayLog, WorkerProcess
from zmq_rpc.broker.graph import GRAPH_VERSION
from zmq_rpc.broker.protocol import DType, split_tensor
from zmq_rpc.client import (
    BadRequest,
    Client,
    Graph,
    GraphError,
    InvalidHandle,
    OutOfBounds,
    OutOfMemory,
    RemoteBuffer,
    RemoteTensor,
    RpcError,
    from_bfloat16,
    to_bfloat16,
)
from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
from zmq_rpc.worker.process.devices import cuda_unavailable
from zmq_rpc.worker.server import WorkerServer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(60),
    # warnings from cupy or the driver are shown in the summary, never turned into failures
    # (setup.cfg makes warnings errors, and would do so in the worker threads too)
    pytest.mark.filterwarnings("default"),
]


@pytest.fixture(scope="module", autouse=True)
def cupy_mod() -> Any:
    """cupy, once it imports and sees a CUDA device; otherwise every test here is skipped.

    A fixture rather than a module-level skip: the tests are still collected, so running this
    file alone on a machine without a GPU reports them skipped and exits 0 (not 5, "no tests").
    """
    reason = cuda_unavailable()
    if reason is not None:
        pytest.skip(f"the cupy backend tests need cupy and a CUDA device: {reason}")
    import cupy
    return cupy


# ------------------------------------------------------------------------------------ helpers

MiB = 1 << 20
RNG = np.random.default_rng(2024)
NUMPY = NumpyBackend()
DTYPES = [d.dtype_name for d in DType]
STORAGE = {d.dtype_name: np.dtype(d.storage) for d in DType}

SPECIAL_BITS: dict[str, list[int]] = {
    # quiet NaN with payload, signalling NaN, negative NaN, -0.0, smallest subnormal, -inf
    "float16": [0x7E01, 0x7C01, 0xFE00, 0x8000, 0x0001, 0xFC00],
    "bfloat16": [0x7FC1, 0x7F81, 0xFFC0, 0x8000, 0x0001, 0xFF80],
    "float32": [0x7FC00001, 0x7F800001, 0xFFC00000, 0x80000000, 0x00000001, 0xFF800000],
    "float64": [0x7FF8000000000001, 0x7FF0000000000001, 0xFFF8000000000000,
                0x8000000000000000, 0x0000000000000001, 0xFFF0000000000000],
}
"""Bit patterns that a value-converting copy would change; the first elements of float arrays."""

_SPECIAL_WORDS = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32,
                  "float64": np.uint64}


def random_bits(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random elements of ``dtype``'s storage (uint16 bits for bfloat16): any bit pattern for
    numbers, special float patterns first, 0/1 for bool."""
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        return RNG.integers(0, 2, n, dtype=np.uint8).astype(bool).reshape(shape)
    storage = STORAGE[dtype]
    flat = RNG.integers(0, 256, n * storage.itemsize, dtype=np.uint8).view(storage)
    if dtype in SPECIAL_BITS:
        special = np.array(SPECIAL_BITS[dtype], _SPECIAL_WORDS[dtype]).view(storage)
        k = min(n, special.size)
        flat[:k] = special[:k]
    return flat.reshape(shape)


def as_bytes(array: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8)


def assert_same(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """Same shape, dtype and bytes."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    got, want = as_bytes(actual), as_bytes(expected)
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        first = int(bad[0])
        item = expected.dtype.itemsize
        start = first - first % item
        pytest.fail(f"{what}: {bad.size} of {got.size} bytes differ; first at byte {first} "
                    f"(element {first // item}): got {got[start:start + item].tolist()}, "
                    f"numpy has {want[start:start + item].tolist()}")


def fetch(client: Client, tensor: RemoteTensor) -> np.ndarray:
    """The tensor's elements in their storage dtype (bfloat16 as its uint16 bits, via out=)."""
    if tensor.ref.dtype is DType.BFLOAT16:
        return client.get_tensor(tensor, out=np.empty(tensor.shape, np.uint16))
    return client.get_tensor(tensor)


def payload(tensor: RemoteTensor, values: np.ndarray) -> bytes:
    """The bytes set_tensor sends for ``values`` (float32 into bfloat16 rounds like the client)."""
    if tensor.ref.dtype is DType.BFLOAT16 and values.dtype != np.uint16:
        values = to_bfloat16(values)
    return np.ascontiguousarray(values).tobytes()


class Mirror:
    """A buffer on a worker and its model: the same requests replayed by the numpy backend."""

    def __init__(self, client: Client, size: int) -> None:
        self.client = client
        self.size = size
        self.buffer = client.alloc_buffer(size)
        self.memory = np.zeros(size, np.uint8)

    def local(self, tensor: RemoteTensor) -> np.ndarray:
        """The numpy view the CPU worker would make of ``tensor``."""
        return NUMPY.view(self.memory, tensor.ref)

    def set(self, tensor: RemoteTensor, values: np.ndarray) -> None:
        self.client.set_tensor(tensor, values)
        NUMPY.write(self.local(tensor), payload(tensor, values))

    def memset(self, tensor: RemoteTensor, value: int, offset: int = 0,
               size: int | None = None) -> None:
        self.client.memset_tensor(tensor, value, offset, size)
        view = self.local(tensor)
        count = tensor.nbytes - offset if size is None else size
        if offset == 0 and count == tensor.nbytes:
            NUMPY.fill(view, value)
        else:
            NUMPY.fill(view.reshape(-1).view(np.uint8)[offset:offset + count], value)

    def clear(self, value: int) -> None:
        self.buffer.clear(value)
        self.memory[...] = value

    def copy(self, src: RemoteTensor, dst: RemoteTensor) -> None:
        self.client.copy_tensor(src, dst)
        self.local(dst)[...] = self.local(src).copy()

    def get(self, tensor: RemoteTensor) -> None:
        """The worker's view equals numpy's, in storage bits and (bfloat16) widened to float32."""
        expected = self.local(tensor).copy()        # C order; 0-d stays 0-d
        assert_same(fetch(self.client, tensor), expected, f"get {tensor!r}")
        if tensor.ref.dtype is DType.BFLOAT16:
            assert_same(self.client.get_tensor(tensor), from_bfloat16(expected),
                        f"get {tensor!r} as float32")

    def check(self, what: str = "whole buffer") -> None:
        whole = self.client.get_tensor(self.buffer.tensor(self.size, "uint8"))
        assert_same(whole, self.memory, what)


def whole(buffer: RemoteBuffer) -> np.ndarray:
    return buffer.client.get_tensor(buffer.tensor(buffer.size, "uint8"))


def assert_serves(client: Client) -> None:
    """A fresh buffer round-trips exactly, contiguous and through a strided (kernel) view."""
    values = np.arange(48, dtype=np.float32).reshape(6, 8) * 1.5 - 7
    t = client.alloc_buffer(256).tensor((6, 8), "float32")
    client.set_tensor(t, values)
    assert_same(client.get_tensor(t), values, "round trip")
    assert_same(client.get_tensor(t.T[::2]), np.ascontiguousarray(values.T[::2]), "strided get")
    t.buffer.free()


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture
def gpu_worker(make_worker: Callable[..., WorkerServer]) -> WorkerServer:
    """An in-process cuda worker with a 512 MiB memory limit."""
    return make_worker(device="cuda", memory_limit=512 * MiB)


@pytest.fixture
def gpu(gpu_worker: WorkerServer, make_client: Callable[..., Client]) -> Client:
    return make_client(gpu_worker.endpoint, timeout=20)


ROUTES = ["cuda->cpu", "cpu->cuda", "cuda->cuda"]


@pytest.fixture
def route(request: pytest.FixtureRequest, make_worker: Callable[..., WorkerServer],
          make_client: Callable[..., Client]) -> tuple[Client, Client]:
    """Clients of a source and a destination worker: ``"cuda->cpu"`` and so on."""
    src, dst = (make_client(make_worker(device=kind, memory_limit=256 * MiB).endpoint, timeout=15)
                for kind in request.param.split("->"))
    return src, dst


# ------------------------------------------------------------------------ device and memory


@pytest.mark.timeout(60)
def test_hello_reports_the_cuda_device_and_its_graphs(cupy_mod: Any,
                                                     make_worker: Callable[..., WorkerServer],
                                                     make_client: Callable[..., Client]) -> None:
    client = make_client(make_worker(device="cuda").endpoint)
    info = client.info
    assert len(info.devices) == 1
    device = info.devices[0]
    name = cupy_mod.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    assert device.kind == "cuda"
    assert device.name == name and device.name.strip()
    _, gpu_total = cupy_mod.cuda.runtime.memGetInfo()
    assert device.total_memory == int(gpu_total * 0.8)    # default limit: 80 % of the GPU
    assert device.free_memory == device.total_memory
    assert info.max_buffer_size == device.total_memory
    assert info.alignment == 256
    assert f"graph-v{GRAPH_VERSION}" in info.capabilities
    assert "packed-kernels" not in info.capabilities and "zero-copy" not in info.capabilities
    assert {"views", "chunked-transfer", "peer-copy", "linked-runs"} <= set(info.capabilities)
    assert info.peer_endpoint.startswith("tcp://127.0.0.1:")

    cpu = make_client(make_worker(memory_limit=64 * MiB).endpoint).info
    assert cpu.devices[0].kind == "cpu"


@pytest.mark.timeout(60)
def test_device_memory_is_plausible_and_drops_after_a_big_alloc(
        cupy_mod: Any, make_worker: Callable[..., WorkerServer],
        make_client: Callable[..., Client]) -> None:
    client = make_client(make_worker(device="cuda").endpoint)
    free, total = client.device_memory()
    _, gpu_total = cupy_mod.cuda.runtime.memGetInfo()
    assert total == int(gpu_total * 0.8) and 0 < total < gpu_total
    assert free == total
    size = 2 << 30
    buf = client.alloc_buffer(size)
    assert client.device_memory() == (total - size, total)
    assert cupy_mod.cuda.runtime.memGetInfo()[0] <= gpu_total - size   # really taken from the GPU
    tail = buf.tensor(16, "uint8", offset=size - 16)             # both ends are addressable
    client.set_tensor(tail, np.arange(16, dtype=np.uint8) + 1)
    assert_same(client.get_tensor(tail), np.arange(16, dtype=np.uint8) + 1, "tail")
    assert_same(client.get_tensor(buf.tensor(4096, "uint8")), np.zeros(4096, np.uint8), "head")
    buf.free()
    assert client.device_memory() == (total, total)
    with pytest.raises(OutOfMemory, match="over the maximum buffer size"):
        client.alloc_buffer(total + 1)
    assert client.device_memory() == (total, total)
    assert_serves(client)


@pytest.mark.timeout(60)
def test_alloc_is_zero_filled_even_when_memory_is_reused(gpu_worker: WorkerServer, gpu: Client,
                                                         make_client: Callable[..., Client]
                                                         ) -> None:
    for size in (1, 100, 4096, MiB, 3 * MiB + 17):
        buf = gpu.alloc_buffer(size)
        assert_same(whole(buf), np.zeros(size, np.uint8), f"fresh {size}")
        buf.clear(0xCD)
        assert_same(whole(buf), np.full(size, 0xCD, np.uint8), f"cleared {size}")
        buf.free()
        again = gpu.alloc_buffer(size)        # cupy's pool hands the same block out again
        assert_same(whole(again), np.zeros(size, np.uint8), f"reused {size}")
        again.free()
    other = make_client(gpu_worker.endpoint)
    dirty = other.alloc_buffer(MiB)
    dirty.clear(0xEE)
    other.close()                             # another session's bytes never leak to us
    assert_same(whole(gpu.alloc_buffer(MiB)), np.zeros(MiB, np.uint8), "after another session")
    empty = gpu.alloc_buffer(0)
    empty.clear(7)
    got = gpu.get_tensor(empty.tensor(0, "float32"))
    assert got.shape == (0,) and got.dtype == np.float32


# --------------------------------------------------------------------------- set and get


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_set_get_every_dtype_contiguous_and_strided(gpu: Client, dtype: str) -> None:
    m = Mirror(gpu, 8192)
    for shape in [(), (7,), (3, 5), (2, 3, 4), (0, 3), (1, 2, 1, 2, 1, 2, 1, 2)]:
        t = m.buffer.tensor(shape, dtype, offset=64)
        m.set(t, random_bits(shape, dtype))
        m.get(t)
    m.check("contiguous")

    base = m.buffer.tensor((6, 10), dtype, offset=1024)
    m.set(base, random_bits((6, 10), dtype))
    views = [base[1::2, ::3], base.T, base[::-1, 2:9:2], base[..., 4], base[None, 3, ::-2],
             base.T[::2, 1::2], base[2:5, 7:1:-3], base.reshape(3, 4, 5).transpose(2, 0, 1)]
    assert all(not v.is_contiguous() for v in views)
    for view in views:
        m.get(view)
    for view in views:
        m.set(view, random_bits(view.shape, dtype))
        m.check(f"after set {view!r}")
        m.get(view)

    other = m.buffer.tensor((10, 6), dtype, offset=4096)
    m.copy(base.T, other)                        # strided -> contiguous
    m.check("copy base.T -> other")
    m.copy(other[::2].T, base[:, ::2])           # strided -> strided, another region
    m.check("copy other[::2].T -> base[:, ::2]")
    m.copy(base[::-1], base.view((6, 10), offset=6144 - 1024))   # reversed rows, contiguous dst
    m.check("copy base[::-1] -> contiguous")


@pytest.mark.timeout(60)
def test_bool_views_keep_raw_bytes(gpu: Client) -> None:
    """The numpy backend moves bool elements as bytes (2..255 stay): so must the GPU's kernels."""
    m = Mirror(gpu, 256)
    raw = m.buffer.tensor(64, "uint8")
    m.set(raw, RNG.integers(2, 256, 64, dtype=np.uint8))
    flags = raw.view((8, 8), dtype="bool")
    dst = m.buffer.tensor((8, 8), "bool", offset=128)
    m.get(flags)
    m.get(flags.T)                               # strided read: a copy kernel
    m.copy(flags.T, dst)                         # strided -> contiguous
    m.check("strided -> contiguous")
    m.memset(dst, 0)
    m.copy(flags[::2], dst[1::2])                # strided -> strided
    m.check("strided -> strided")
    m.copy(flags, dst)                           # contiguous -> contiguous
    m.check("contiguous -> contiguous")


@pytest.mark.timeout(60)
def test_get_tensor_into_out(gpu: Client) -> None:
    m = Mirror(gpu, 1 * MiB)
    t = m.buffer.tensor((256, 256), "float32")
    m.set(t, random_bits((256, 256), "float32"))
    out = np.empty((128, 256), np.float32)
    assert gpu.get_tensor(t[::2], out=out) is out
    assert_same(out, m.local(t)[::2], "out= rows")
    out_t = np.empty((256, 256), np.float32)
    assert gpu.get_tensor(t.T, out=out_t) is out_t
    assert_same(out_t, np.ascontiguousarray(m.local(t).T), "out= transposed")

    wide = m.buffer.tensor((8, 8), "int64", offset=512 * 1024)
    m.set(wide, random_bits((8, 8), "int64"))
    out64 = np.empty((8, 8), np.int64)
    assert gpu.get_tensor(wide.T, out=out64) is out64
    assert_same(out64, np.ascontiguousarray(m.local(wide).T), "out= int64")

    half = m.buffer.tensor((4, 8), "bfloat16", offset=600 * 1024)
    bits = random_bits((4, 8), "bfloat16")
    m.set(half, bits)
    as_f32, as_u16 = np.empty((4, 8), np.float32), np.empty((4, 8), np.uint16)
    assert gpu.get_tensor(half, out=as_f32) is as_f32
    assert_same(as_f32, from_bfloat16(bits), "bfloat16 into float32")
    assert gpu.get_tensor(half, out=as_u16) is as_u16
    assert_same(as_u16, bits, "bfloat16 into uint16 bits")
    values = RNG.standard_normal((4, 8)).astype(np.float32)
    m.set(half, values)                          # float32 in: rounded to nearest even
    assert_same(gpu.get_tensor(half), from_bfloat16(to_bfloat16(values)), "bfloat16 rounding")
    strided_out = np.empty((8, 4), np.uint16)
    assert gpu.get_tensor(half.T, out=strided_out) is strided_out
    assert_same(strided_out, np.ascontiguousarray(to_bfloat16(values).T), "bfloat16 strided")
    m.check()


@pytest.mark.timeout(120)
def test_large_transfer_is_chunked_and_exact(gpu: Client) -> None:
    size = 64 * MiB
    data = RNG.integers(0, 256, size, dtype=np.uint8)
    buf = gpu.alloc_buffer(size)
    flat = buf.tensor(size, "uint8")
    assert len(split_tensor(flat.ref, gpu.chunk_bytes)) >= 8      # several messages each way
    gpu.set_tensor(flat, data)
    assert_same(gpu.get_tensor(flat), data, "64 MiB round trip")

    matrix = buf.tensor((4096, 4096), "float32")
    expected = data.view(np.float32).reshape(4096, 4096)
    out = np.empty((4096, 4096), np.float32)
    assert gpu.get_tensor(matrix, out=out) is out
    assert_same(out, expected, "64 MiB into out=")
    columns = matrix[:, 1::2]                    # 32 MiB strided: split by rows
    assert len(split_tensor(columns.ref, gpu.chunk_bytes)) >= 4
    assert_same(gpu.get_tensor(columns), np.ascontiguousarray(expected[:, 1::2]), "columns")

    patch = RNG.integers(0, 256, (2048, 4096 * 4), dtype=np.uint8).view(np.float32)
    gpu.set_tensor(matrix[::2], patch)           # 32 MiB strided write, chunked
    expected = expected.copy()
    expected[::2] = patch
    assert_same(gpu.get_tensor(matrix), expected, "after strided write")


# ------------------------------------------------------------------------------------ copy


OVERLAPS = [
    (np.s_[0:12], np.s_[1:13]), (np.s_[1:13], np.s_[0:12]), (np.s_[::-1], np.s_[:]),
    (np.s_[0:8], np.s_[8:0:-1]), (np.s_[::2], np.s_[1::2]), (np.s_[0:6], np.s_[2:14:2]),
    (np.s_[:], np.s_[:]),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("src,dst", OVERLAPS, ids=["shift-up", "shift-down", "reverse",
                                                   "reverse-shifted", "interleaved", "strided",
                                                   "itself"])
def test_copy_between_overlapping_views(gpu: Client, src: Any, dst: Any) -> None:
    values = np.arange(16, dtype=np.float32) * 3 + 1
    m = Mirror(gpu, 64)
    t = m.buffer.tensor(16, "float32")
    m.set(t, values)
    m.copy(t[src], t[dst])
    expected = values.copy()
    expected[dst] = expected[src].copy()         # numpy: as if through a temporary
    assert_same(gpu.get_tensor(t), expected)
    m.check()


@pytest.mark.timeout(60)
def test_large_overlapping_copies_match_numpy(gpu: Client) -> None:
    """Many thread blocks: an overlapping copy without a temporary would race visibly here."""
    n = 1 << 20
    m = Mirror(gpu, 4 * n)
    t = m.buffer.tensor(n, "uint32")
    m.set(t, np.arange(n, dtype=np.uint32))
    m.copy(t[:-1], t[1:])                        # shift up by one element
    m.check("shift up")
    m.copy(t[7:], t[:-7])                        # shift down
    m.check("shift down")
    m.copy(t[::-1], t)                           # reverse in place
    m.check("reverse")
    m.copy(t[: n // 2], t[1::2])                 # strided destination over its own source
    m.check("interleave")
    square = t.reshape(1024, 1024)
    m.copy(square[:512, :512].T, square[100:612, 200:712])   # transposed, overlapping
    m.check("transposed block")
    m.copy(square[::-1, ::-1], square)           # a full 2-D reversal in place
    m.check("2-D reversal")


# --------------------------------------------------------------------- memset, clear, fill


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES)
def test_memset_and_clear_of_views_match_numpy(gpu: Client, dtype: str) -> None:
    m = Mirror(gpu, 4096)
    base = m.buffer.tensor((8, 12), dtype, offset=256)
    m.set(base, random_bits((8, 12), dtype))
    row = base[3]
    views = [base, base[1::2, ::3], base.T[2:7], row, base[::-1, 5], base[2:6, 1:-1]]
    for byte in (0x00, 0x01, 0x7F, 0x80, 0xAB, 0xFF):
        for view in views:
            m.memset(view, byte)             # the whole view: strided ones set whole elements
            m.check(f"memset {byte:#x} {view!r}")
        m.set(base, random_bits((8, 12), dtype))
        m.memset(row, byte, offset=1, size=row.nbytes - 2)      # byte ranges of contiguous views
        m.memset(base, byte ^ 0x5A, offset=5, size=7)
        m.memset(row, byte, offset=row.nbytes, size=0)
        m.memset(base, byte, offset=base.nbytes - 3)
        m.check(f"byte ranges {byte:#x}")
    with pytest.raises(BadRequest, match="contiguous"):
        gpu.memset_tensor(base[::2], 1, offset=1, size=2)
    with pytest.raises(OutOfBounds, match="outside the tensor"):
        gpu.memset_tensor(row, 1, offset=2, size=row.nbytes)
    m.check("after refused memsets")
    m.clear(0x3C)
    m.check("clear")
    m.get(base.T)


# ------------------------------------------------------------------------------ ordering


@pytest.mark.timeout(60)
def test_pipelined_mixed_requests_keep_their_order(gpu: Client) -> None:
    """Uploads, kernels and downloads issued without waiting run in order on the GPU too."""
    rng = np.random.default_rng(11)
    n = 1 << 14
    m = Mirror(gpu, 4 * n)
    t = m.buffer.tensor(n, "float32")
    local = m.local(t)
    pending: list[tuple[Future[np.ndarray], np.ndarray]] = []
    for i in range(600):
        lo = int(rng.integers(0, n - 512))
        kind = i % 6
        if kind == 0:
            values = rng.standard_normal(256).astype(np.float32)
            gpu.set_tensor_async(t[lo:lo + 256], values)
            local[lo:lo + 256] = values
        elif kind == 1:
            values = rng.standard_normal(256).astype(np.float32)
            gpu.set_tensor_async(t[lo:lo + 512:2], values)
            local[lo:lo + 512:2] = values
        elif kind == 2:
            gpu.memset_tensor_async(t[lo:lo + 64], i % 256)
            NUMPY.fill(local[lo:lo + 64], i % 256)
        elif kind == 3:
            gpu.memset_tensor_async(t[lo:lo + 128:2], (i * 7) % 256)
            NUMPY.fill(local[lo:lo + 128:2], (i * 7) % 256)
        elif kind == 4:
            gpu.copy_tensor_async(t[lo:lo + 256], t[lo + 128:lo + 384])
            local[lo + 128:lo + 384] = local[lo:lo + 256].copy()
        else:
            pending.append((gpu.get_tensor_async(t[lo:lo + 512:3]), local[lo:lo + 512:3].copy()))
    gpu.synchronize()
    for k, (future, expected) in enumerate(pending):
        assert_same(future.result(timeout=20), expected, f"read {k}")
    m.check()


# ---------------------------------------------------------------------------------- errors


@pytest.mark.timeout(60)
def test_freed_handle_is_refused_and_the_worker_keeps_serving(
        gpu_worker: WorkerServer, gpu: Client, make_client: Callable[..., Client]) -> None:
    keep = Mirror(gpu, 1024)
    kept = keep.buffer.tensor(64, "float32")
    keep.set(kept, np.arange(64, dtype=np.float32))
    total = gpu.device_memory().total
    buf = gpu.alloc_buffer(MiB)
    t = buf.tensor(16, "float32")
    gpu.set_tensor(t, np.ones(16, np.float32))
    assert gpu.device_memory().free == total - MiB - 1024
    buf.free()
    assert gpu.device_memory().free == total - 1024
    gone = f"buffer {buf.handle} does not exist in this session"
    refused: list[Callable[[], Any]] = [
        lambda: gpu.get_tensor(t),
        lambda: gpu.get_tensor(t[::2]),
        lambda: gpu.set_tensor(t, np.zeros(16, np.float32)),
        lambda: gpu.memset_tensor(t, 1),
        lambda: gpu.copy_tensor(t, kept[:16]),
        lambda: gpu.copy_tensor(kept[:16], t),
        lambda: buf.clear(3),
        buf.free,
    ]
    for call in refused:
        with pytest.raises(InvalidHandle, match=re.escape(gone)):
            call()
    keep.check("the live buffer is untouched")
    keep.get(kept[::3])
    assert gpu.device_memory().free == total - 1024
    fresh = gpu.alloc_buffer(MiB)               # the freed block comes back zeroed
    assert_same(whole(fresh), np.zeros(MiB, np.uint8), "realloc")
    assert_serves(gpu)
    assert_serves(make_client(gpu_worker.endpoint))


@pytest.mark.timeout(60)
def test_out_of_bounds_views_are_refused_and_the_worker_keeps_serving(
        gpu_worker: WorkerServer, gpu: Client, make_client: Callable[..., Client]) -> None:
    m = Mirror(gpu, 64)
    base = m.buffer.tensor(16, "float32")
    m.set(base, np.arange(16, dtype=np.float32))
    spare = gpu.alloc_buffer(1024)
    cases = [
        (base.view((16,), offset=4), "[4, 68)"),                # one element past the end
        (base.view((4, 4), strides=(20, 4)), "[0, 76)"),        # rows too far apart
        (base.view((4,), strides=(-4,), offset=8), "[-4, 12)"),  # negative stride below 0
        (base.view((2, 2), strides=(32, -8)), "[-8, 36)"),
        (base.view((), strides=(), offset=57, dtype="float64"), "[57, 65)"),
        (base.view((0, 3), offset=65), "[65, 65)"),             # an empty view past the end
        (base.view((4, 4), strides=(4, 20)), "[0, 76)"),        # a transposed [4, 5] too big
    ]
    for view, extent in cases:
        why = re.escape(f"reaches bytes {extent} of a 64-byte buffer")
        peer = spare.tensor(view.shape, view.dtype)
        zeros = np.zeros(view.shape, STORAGE[view.dtype])
        requests: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
            (gpu.get_tensor, (view,)), (gpu.set_tensor, (view, zeros)),
            (gpu.memset_tensor, (view, 0xFF)), (gpu.copy_tensor, (view, peer)),
            (gpu.copy_tensor, (peer, view))]
        for call, args in requests:
            with pytest.raises(OutOfBounds, match=why):
                call(*args)
    with pytest.raises(BadRequest, match="reaches bytes"):
        m.buffer.tensor(17, "float32")           # refused by the client before sending
    m.check("nothing was written")
    m.get(base.view((15,), offset=4))            # views ending exactly at the end are fine
    m.get(base.view((4,), strides=(-4,), offset=12))
    m.get(base.view((4, 3), strides=(4, 20), offset=8))
    assert_serves(gpu)
    assert_serves(make_client(gpu_worker.endpoint))


def _block_graph(client: Client) -> tuple[Graph, list[RemoteTensor], RemoteTensor]:
    """A small transformer-like block: rms_norm, matmul (transposed weight), rope, masked
    softmax, silu, a bfloat16 output; on whichever worker ``client`` talks to."""
    rng = np.random.default_rng(5)
    buf = client.alloc_buffer(1 << 20)
    x = buf.tensor((4, 2, 32), "float32")
    w = buf.tensor((64, 64), "float32", offset=64 << 10)
    pos = buf.tensor(4, "int32", offset=128 << 10)
    mask = buf.tensor((4, 4), "float32", offset=192 << 10)
    out = buf.tensor((4, 64), "bfloat16", offset=256 << 10)
    client.set_tensor(x, rng.normal(size=(4, 2, 32)).astype(np.float32))
    client.set_tensor(w, rng.normal(size=(64, 64)).astype(np.float32) / 8)
    client.set_tensor(pos, np.arange(4, dtype=np.int32) + 7)
    client.set_tensor(mask, np.triu(np.full((4, 4), -np.inf, np.float32), 1))
    g = Graph()
    r = g.rope(g.rms_norm(x, eps=1e-5), pos, n_dims=32, mode="neox")
    h = g.matmul(g.reshape(r, (4, 64)), w, transpose_b=True)
    scores = g.soft_max(g.matmul(h, h, transpose_b=True), mask=mask, scale=0.125)
    g.cpy(g.silu(g.matmul(scores, h)), out)
    return g, [x, w, pos, mask], out


@pytest.mark.timeout(120)
def test_graphs_run_on_the_gpu_like_on_the_cpu(
        gpu: Client, make_worker: Callable[..., WorkerServer],
        make_client: Callable[..., Client]) -> None:
    cpu = make_client(make_worker(memory_limit=64 * MiB).endpoint)
    results = []
    for client in (gpu, cpu):
        g, _, out = _block_graph(client)
        client.compute(g)
        results.append(from_bfloat16(fetch(client, out)))
    np.testing.assert_allclose(results[0], results[1], rtol=2e-2, atol=2e-2)
    assert_serves(gpu)


@pytest.mark.timeout(60)
def test_a_registered_graph_holds_its_arena_in_device_memory(gpu: Client) -> None:
    g, _, out = _block_graph(gpu)
    free = gpu.device_memory().free
    registered = gpu.register(g)
    assert gpu.device_memory().free < free            # the arena is charged while registered
    gpu.run(registered)
    first = fetch(gpu, out)
    gpu.run(registered)
    assert_same(fetch(gpu, out), first, "a rerun on the same arena")
    registered.free()
    assert gpu.device_memory().free == free


@pytest.mark.timeout(60)
def test_packed_cpu_kernels_are_refused_clearly_and_the_worker_keeps_serving(gpu: Client) -> None:
    assert "packed-kernels" not in gpu.info.capabilities
    buf = gpu.alloc_buffer(1 << 16)
    x = buf.tensor((1, 32), "float32")
    w = buf.tensor((4, 36), "uint8", offset=4096)
    out = buf.tensor((1, 4), "float32", offset=8192)
    g = Graph()
    g.mul_mat_packed(x, w, qtype="q8_0", out=out)
    with pytest.raises(GraphError, match="not offered on a cuda worker.*weights='f32'"):
        gpu.compute(g)
    assert_serves(gpu)


@pytest.mark.timeout(120)
def test_misaligned_views_are_served_or_refused_without_breaking_the_worker(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    """The protocol allows any byte offset and stride, and the numpy worker serves them. A CUDA
    kernel that loads a float32 from an odd address faults, and the fault is sticky: every later
    CUDA call of that process fails. Each request must be served like numpy, or refused with
    an error and nothing written; the worker must go on serving afterwards. Overlapping float32
    views 2 bytes apart share bytes but no element address, which cupy.shares_memory misses.
    (Subprocess worker: a fault here cannot break the GPU context of the other tests.)"""
    proc = spawn_worker("--device", "cuda", "--mem", "64MiB")
    client = make_client(proc.endpoint, timeout=30)
    m = Mirror(client, MiB)
    m.set(m.buffer.tensor(MiB, "uint8"), RNG.integers(0, 256, MiB, dtype=np.uint8))
    flat = m.buffer.tensor(16, "float32", offset=3)                     # contiguous, misaligned
    rows = m.buffer.tensor((8, 4), "float32", offset=1, strides=(36, 4))   # strided, misaligned
    aligned = m.buffer.tensor((4, 8), "float32", offset=2048)
    n = 1 << 17                                  # 512 KiB: overlapping, 2 bytes apart
    below, above = (m.buffer.tensor(n, "float32", offset=4096 + d) for d in (0, 2))
    refused: list[str] = []

    def step(name: str, action: Callable[[], None]) -> None:
        """Run one request (served or refused); then the whole buffer must equal numpy's."""
        try:
            action()
        except RpcError as exc:
            refused.append(f"{name}: {exc}")
        try:
            m.check(f"after {name} (served ones like numpy, refused ones write nothing; "
                    f"refused so far: {refused})")
        except RpcError as exc:
            pytest.fail(f"the cuda worker stopped serving after the misaligned {name} "
                        f"(refused so far: {refused}): {exc}")

    step("contiguous get", lambda: m.get(flat))
    step("contiguous set", lambda: m.set(flat, random_bits((16,), "float32")))
    step("overlapping copy", lambda: m.copy(below, above))   # bytes overlap, elements don't
    step("overlapping copy back", lambda: m.copy(above, below))
    step("strided get", lambda: m.get(rows))
    step("strided set", lambda: m.set(rows, random_bits((8, 4), "float32")))
    step("strided memset", lambda: m.memset(rows, 0xAB))
    step("copy into it", lambda: m.copy(aligned.T, rows))
    step("copy out of it", lambda: m.copy(rows.T, aligned))
    try:
        assert_serves(client)
        assert_serves(make_client(proc.endpoint, timeout=30))
    except RpcError as exc:
        pytest.fail(f"the cuda worker stopped serving after misaligned views ({refused}): {exc}")


# ------------------------------------------------------------------------------- peer copy


VIEW_CASES: dict[str, tuple[tuple[int, int], tuple[int, int], tuple[int, int],
                            Callable[[Any], Any]]] = {
    # name: (view shape, contiguous base, strided base, view of the strided base)
    "small": ((4, 6), (4, 6), (9, 13), lambda t: t[1::2, 2::2]),
    "small-transposed": ((4, 6), (4, 6), (6, 4), lambda t: t.T),
    "multi-chunk-columns": ((1024, 1536), (1024, 1536), (1024, 3072), lambda t: t[:, ::2]),
    "multi-chunk-rows": ((1024, 1536), (1024, 1536), (2048, 1536), lambda t: t[::2]),
}


def placed(client: Client, case: str, strided: bool, shift: float
           ) -> tuple[RemoteTensor, np.ndarray, RemoteTensor, np.ndarray]:
    """A float32 base set to known values and its mirror; the (remote, local) views of them."""
    shape, dense, strided_base, view = VIEW_CASES[case]
    base_shape = strided_base if strided else dense
    local = (RNG.standard_normal(base_shape) + shift).astype(np.float32)
    base = client.alloc_buffer(local.nbytes).tensor(base_shape, "float32")
    client.set_tensor(base, local)
    pick = view if strided else (lambda t: t)
    remote = pick(base)
    assert remote.shape == shape and remote.is_contiguous() is not strided
    return base, local, remote, pick(local)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(VIEW_CASES))
@pytest.mark.parametrize("route", ROUTES, indirect=True)
def test_peer_copy_views(route: tuple[Client, Client], case: str,
                         relay_log: RelayLog) -> None:
    a, b = route
    for which in ("neither", "src", "dst", "both"):
        src_base, src_all, src, src_local = placed(a, case, which in ("src", "both"), 0.0)
        dst_base, dst_all, dst, dst_local = placed(b, case, which in ("dst", "both"), 100.0)
        a.copy_tensor(src, dst)
        dst_local[...] = src_local               # the bytes outside the view stay as they were
        assert_same(b.get_tensor(dst_base), dst_all, f"{which} strided: destination")
        assert_same(a.get_tensor(src_base), src_all, f"{which} strided: source")
        src_base.buffer.free()
        dst_base.buffer.free()
    assert relay_log.relayed() == 0, "copies were relayed through the client, not worker to worker"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ROUTES, indirect=True)
def test_peer_copy_every_dtype(route: tuple[Client, Client],
                               relay_log: RelayLog) -> None:
    a, b = route
    for dtype in DTYPES:
        item = DType.from_name(dtype).itemsize
        for shape in [(), (7,), (3, 5, 4), (0, 3)]:
            nbytes = int(np.prod(shape, dtype=np.int64)) * item
            src = a.alloc_buffer(nbytes + 64).tensor(shape, dtype, offset=64)
            dst = b.alloc_buffer(nbytes + 8).tensor(shape, dtype, offset=8)
            values = random_bits(shape, dtype)
            a.set_tensor(src, values)
            a.copy_tensor(src, dst)
            assert_same(fetch(b, dst), values, f"{dtype}{list(shape)}")
        source = a.alloc_buffer(24 * item).tensor((6, 4), dtype)
        target = b.alloc_buffer(9 * 13 * item).tensor((9, 13), dtype)
        src_values, dst_values = random_bits((6, 4), dtype), random_bits((9, 13), dtype)
        a.set_tensor(source, src_values)
        b.set_tensor(target, dst_values)
        a.copy_tensor(source.T, target[1::2, 2::2])       # strided on both sides
        expected = dst_values.copy()
        expected[1::2, 2::2] = src_values.T
        assert_same(fetch(b, target), expected, f"{dtype} strided")
    assert relay_log.relayed() == 0, "copies were relayed through the client, not worker to worker"
