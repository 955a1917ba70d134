"""The NVIDIA GPU backend: buffers are cupy byte arrays in device memory, tensors strided views.

Owned by the worker's backend thread, like the numpy backend, with the same interface. cupy is
imported only when this backend is created (``--device cuda[:N]``; ``pip install 'zmq-rpc[cuda]'``);
:meth:`CupyBackend.attach` makes the chosen GPU current on the backend thread (a CUDA device is
per thread). Payloads cross the host boundary here: contiguous writes (client uploads, peer chunks)
go through :class:`~.staging.PinnedStaging`: copied into a reusable pinned slot and uploaded
asynchronously on a copy stream that the compute stream waits for; ``read`` downloads into host
memory (never zero-copy: the frame must outlive the device array's next write), from pinned slots
filled ahead when a peer push asked for its pieces with :meth:`CupyBackend.prefetch`.

Every data movement is bit-exact, as on the CPU: copies, strided writes and fills run on unsigned
integer views of the same item size, so bool bytes other than 0/1 and NaN payloads move as they
are. Views must be element-aligned (offset and strides multiples of the item size): a misaligned
access on a GPU is a sticky error that would end the CUDA context for every session, so such views
are refused here with a clear error rather than run.

Graphs run the shared kernel table (:mod:`.numpy_ops`) on cupy arrays, with the overrides of
:mod:`.cupy_ops`; graph arenas are device memory (:meth:`CupyBackend.scratch`). The packed CPU
kernels (``mul_mat_packed``) are not offered: ``packed-kernels`` is not advertised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...broker.protocol import ErrorCode, TensorRef, WireError
from .base import Backend
from .numpy_backend import STORAGE_DTYPES
from .numpy_ops import KernelTable
from .staging import PinnedStaging

CUDA_EXTRA = "pip install 'zmq-rpc[cuda]'"
"""What to install for ``--device cuda`` (setup.cfg's ``cuda`` extra: cupy-cuda12x)."""


class DeviceUnavailable(RuntimeError):
    """cupy is missing, or no such CUDA device: ``--device cuda`` cannot start."""


def import_cupy() -> Any:
    """cupy, or DeviceUnavailable naming the extra to install."""
    try:
        import cupy
    except ImportError as exc:
        raise DeviceUnavailable(f"--device cuda needs cupy, which does not import here ({exc}): "
                                f"{CUDA_EXTRA}") from None
    return cupy

ALIGNMENT = 256
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""The unsigned integer type that moves an item of each size bit for bit."""


class CupyBackend(Backend):
    """Device-memory buffers on one GPU."""

    name = "cupy"
    kind = "cuda"
    alignment = ALIGNMENT
    supports_graphs = True
    packed_kernels = False
    zero_copy = False
    kernels: KernelTable

    def __init__(self, device_index: int = 0) -> None:
        cupy = import_cupy()
        self.cp = cupy
        count = _device_count(cupy)
        if not 0 <= device_index < count:
            raise DeviceUnavailable(
                f"no CUDA device {device_index}: this machine has {count} (cuda:0 .. "
                f"cuda:{count - 1})" if count else
                f"no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver?); {CUDA_EXTRA} "
                "installs cupy for CUDA 12")
        self.device = cupy.cuda.Device(device_index)
        self.index = device_index
        with self.device:
            self.cp.cuda.runtime.memGetInfo()       # fails here, clearly, if the GPU is unusable
        self._props = cupy.cuda.runtime.getDeviceProperties(device_index)
        from .cupy_ops import cupy_table
        self.kernels = cupy_table(cupy)
        self.staging: PinnedStaging | None = None

    def attach(self) -> None:
        """Make this backend's GPU current on the calling (backend) thread; the copy stream and
        pinned slots are made there too."""
        self.device.use()
        self.staging = PinnedStaging(CupyCopies(self.cp))

    def device_name(self) -> str:
        name = self._props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def compute_capability(self) -> str:
        """"major.minor" of the GPU (e.g. "9.0")."""
        return f"{self._props['major']}.{self._props['minor']}"

    def total_memory(self) -> int:
        with self.device:
            _, total = self.cp.cuda.runtime.memGetInfo()
        return int(total)

    def alloc(self, size: int) -> Any:
        """A zero-filled device byte array (zeroed: no data leaks between sessions)."""
        return self.cp.zeros(size, dtype=self.cp.uint8)

    def scratch(self, size: int) -> Any:
        """An uninitialised device byte array."""
        return self.cp.empty(size, dtype=self.cp.uint8)

    def view(self, buffer: Any, ref: TensorRef) -> Any:
        dtype = STORAGE_DTYPES[ref.dtype]
        if ref.numel == 0:
            return self.cp.empty(ref.shape, dtype)
        _check_aligned(ref, dtype.itemsize)
        memptr = buffer.data + ref.offset
        return self.cp.ndarray(ref.shape, dtype, memptr=memptr, strides=ref.strides)

    def write(self, view: Any, payload: Any) -> None:
        host = np.frombuffer(payload, dtype=_BITS[view.dtype.itemsize])
        if view.flags.c_contiguous and self.staging is not None:
            self.staging.upload(view.reshape(-1).view(self.cp.uint8), payload)
        elif view.flags.c_contiguous:
            view.reshape(-1).view(host.dtype).set(host)
        else:
            _bits(view)[...] = self.cp.asarray(host.reshape(view.shape))

    def write_bytes(self, view: Any, start: int, payload: Any) -> None:
        data = np.frombuffer(payload, np.uint8)
        target = view.reshape(-1).view(self.cp.uint8)[start:start + data.size]
        if self.staging is not None:
            self.staging.upload(target, payload)
        else:
            target.set(data)

    def prefetch(self, views: list[Any]) -> None:
        """Start downloading these views (a peer push's pieces, read in this order next)."""
        if self.staging is not None:
            self.staging.prefetch([(v, v.reshape(-1).view(self.cp.uint8)) for v in views
                                   if v.flags.c_contiguous and v.size])

    def alias(self, view: Any) -> Any | None:
        """Device memory is never handed to zmq in place: None (see :meth:`read`)."""
        return None

    def read(self, view: Any) -> tuple[Any, bool]:
        if self.staging is not None and view.flags.c_contiguous:
            staged = self.staging.take(view)
            if staged is not None:
                return staged, False
        bits = self.cp.ascontiguousarray(_bits(view))
        return self.cp.asnumpy(bits).reshape(-1).view(np.uint8), False

    def fill(self, view: Any, byte: int) -> None:
        if view.flags.c_contiguous:
            view.reshape(-1).view(self.cp.uint8).fill(byte)
        else:
            kind = _BITS[view.dtype.itemsize]
            _bits(view)[...] = np.frombuffer(bytes([byte]) * view.dtype.itemsize, kind)[0]

    def copy(self, dst: Any, src: Any) -> None:
        """dst[...] = src, bit for bit, through a temporary when the two may overlap."""
        source = _bits(src)
        if self.cp.may_share_memory(dst, src):
            source = source.copy()
        _bits(dst)[...] = source


def _bits(view: Any) -> Any:
    """The same memory viewed as unsigned integers of the same item size."""
    return view.view(_BITS[view.dtype.itemsize])


def _check_aligned(ref: TensorRef, itemsize: int) -> None:
    moved = [s for s, n in zip(ref.strides, ref.shape) if n > 1]
    if ref.offset % itemsize or any(s % itemsize for s in moved):
        raise WireError(ErrorCode.BAD_REQUEST,
                        f"the cuda backend needs element-aligned views: offset {ref.offset} and "
                        f"strides {list(ref.strides)} must be multiples of the {itemsize}-byte "
                        f"{ref.dtype.dtype_name} item size")


def _device_count(cupy: Any) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:       # cudaErrorNoDevice, cudaErrorInsufficientDriver: none usable
        return 0


class CupyCopies:
    """:class:`~.staging.CopyEngine` on one CUDA copy stream: ``cudaMemcpyAsync`` between pinned
    slots and device memory, ordered against the compute (current) stream with events."""

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy
        self.runtime = cupy.cuda.runtime
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def pinned(self, size: int) -> np.ndarray:
        memory = self.cp.cuda.alloc_pinned_memory(size)
        return np.frombuffer(memory, np.uint8, size)      # the array keeps the memory alive

    def _event(self, stream: Any) -> Any:
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def to_device_async(self, dst: Any, src: np.ndarray) -> Any:
        compute = self.cp.cuda.get_current_stream()
        self.stream.wait_event(self._event(compute))       # after earlier work on dst
        self.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, src.nbytes,
                                 self.runtime.memcpyHostToDevice, self.stream.ptr)
        done = self._event(self.stream)
        compute.wait_event(done)                           # later work sees the bytes
        return done

    def to_host_async(self, dst: np.ndarray, src: Any) -> Any:
        self.stream.wait_event(self._event(self.cp.cuda.get_current_stream()))
        self.runtime.memcpyAsync(dst.ctypes.data, src.data.ptr, dst.nbytes,
                                 self.runtime.memcpyDeviceToHost, self.stream.ptr)
        return self._event(self.stream)

    def wait(self, marker: Any) -> None:
        marker.synchronize()
