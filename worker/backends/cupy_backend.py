"""The NVIDIA GPU backend: buffers are cupy byte arrays in device memory, tensors strided views.

Owned by the worker's backend thread, like the numpy backend, with the same interface. cupy is
imported only when this backend is created (``--device cuda[:N]``; ``pip install zmq-rpc[cuda]``).
Payloads cross the host boundary here: ``write`` uploads a received frame, ``read`` downloads into
host memory (never zero-copy: the frame must outlive the device array's next write).

Graph compute runs the numpy kernels, so it is not offered on this backend yet: the worker does not
advertise the ``graph-v1`` capability and refuses graph commands with a clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...broker.protocol import TensorRef
from .numpy_backend import STORAGE_DTYPES

ALIGNMENT = 256


class CupyBackend:
    """Device-memory buffers on one GPU."""

    name = "cupy"
    kind = "cuda"
    alignment = ALIGNMENT
    supports_graphs = False

    def __init__(self, device_index: int = 0) -> None:
        import cupy  # lazily: the extra is optional

        self.cp = cupy
        self.device = cupy.cuda.Device(device_index)
        self.device.use()

    def device_name(self) -> str:
        props = self.cp.cuda.runtime.getDeviceProperties(self.device.id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def total_memory(self) -> int:
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(total)

    def alloc(self, size: int) -> Any:
        """A zero-filled device byte array (zeroed: no data leaks between sessions)."""
        return self.cp.zeros(size, dtype=self.cp.uint8)

    def view(self, buffer: Any, ref: TensorRef) -> Any:
        dtype = STORAGE_DTYPES[ref.dtype]
        if ref.numel == 0:
            return self.cp.empty(ref.shape, dtype)
        memptr = buffer.data + ref.offset
        return self.cp.ndarray(ref.shape, dtype, memptr=memptr, strides=ref.strides)

    def write(self, view: Any, payload: Any) -> None:
        host = np.frombuffer(payload, dtype=view.dtype)
        if view.flags.c_contiguous:
            view.reshape(-1).set(host)
        else:
            view[...] = self.cp.asarray(host.reshape(view.shape))

    def write_bytes(self, view: Any, start: int, payload: Any) -> None:
        data = np.frombuffer(payload, np.uint8)
        view.reshape(-1).view(self.cp.uint8)[start:start + data.size].set(data)

    def read(self, view: Any) -> tuple[Any, bool]:
        host = self.cp.asnumpy(self.cp.ascontiguousarray(view)).reshape(-1).view(np.uint8)
        return host, False

    def fill(self, view: Any, byte: int) -> None:
        if view.flags.c_contiguous:
            view.reshape(-1).view(self.cp.uint8).fill(byte)
        elif view.dtype.itemsize == 1:
            view.view(self.cp.uint8)[...] = byte
        else:
            pattern = np.frombuffer(bytes([byte]) * view.dtype.itemsize, view.dtype)[0]
            view[...] = pattern

    def copy(self, dst: Any, src: Any) -> None:
        if self.cp.shares_memory(dst, src):
            src = src.copy()
        dst[...] = src
