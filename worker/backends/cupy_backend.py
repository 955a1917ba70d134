"""The NVIDIA GPU backend: buffers are cupy byte arrays in device memory, tensors strided views.

Owned by the worker's backend thread, like the numpy backend, with the same interface. cupy is
imported only when this backend is created (``--device cuda[:N]``; ``pip install zmq-rpc[cuda]``);
:meth:`CupyBackend.attach` makes the chosen GPU current on the backend thread (a CUDA device is
per thread). Payloads cross the host boundary here: ``write`` uploads a received frame (a copy
from pageable memory, staged by CUDA before the call returns), ``read`` downloads into host memory
(never zero-copy: the frame must outlive the device array's next write).

Every data movement is bit-exact, as on the CPU: copies, strided writes and fills run on unsigned
integer views of the same item size, so bool bytes other than 0/1 and NaN payloads move as they
are. Views must be element-aligned (offset and strides multiples of the item size): a misaligned
access on a GPU is a sticky error that would end the CUDA context for every session, so such views
are refused here with a clear error rather than run.

Graph compute runs the numpy kernels, so it is not offered on this backend yet: the worker does not
advertise the ``graph-v1`` capability and refuses graph commands with a clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...broker.protocol import ErrorCode, TensorRef, WireError
from .base import Backend
from .numpy_backend import STORAGE_DTYPES

ALIGNMENT = 256
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""The unsigned integer type that moves an item of each size bit for bit."""


class CupyBackend(Backend):
    """Device-memory buffers on one GPU."""

    name = "cupy"
    kind = "cuda"
    alignment = ALIGNMENT
    supports_graphs = False
    zero_copy = False

    def __init__(self, device_index: int = 0) -> None:
        import cupy  # lazily: the extra is optional

        self.cp = cupy
        self.device = cupy.cuda.Device(device_index)
        with self.device:
            self.cp.cuda.runtime.memGetInfo()       # fails here, clearly, if the GPU is unusable

    def attach(self) -> None:
        """Make this backend's GPU current on the calling (backend) thread."""
        self.device.use()

    def device_name(self) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(self.device.id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

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
        if view.flags.c_contiguous:
            view.reshape(-1).view(host.dtype).set(host)
        else:
            _bits(view)[...] = self.cp.asarray(host.reshape(view.shape))

    def write_bytes(self, view: Any, start: int, payload: Any) -> None:
        data = np.frombuffer(payload, np.uint8)
        view.reshape(-1).view(self.cp.uint8)[start:start + data.size].set(data)

    def alias(self, view: Any) -> Any | None:
        """Device memory is never handed to zmq in place: None (see :meth:`read`)."""
        return None

    def read(self, view: Any) -> tuple[Any, bool]:
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
