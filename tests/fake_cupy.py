"""A stand-in for cupy on a machine without a GPU: "device" arrays in host memory.

``python tests/fake_cupy.py ARGS`` runs ``zmq-rpc-worker ARGS`` with this module installed as
``cupy`` (and ``cupyx.scipy.special``), so a ``--device cuda`` worker starts on the CPU and runs
the cupy backend's own code: views built from device pointers and strides, uploads and downloads
through the pinned staging slots with ``memcpyAsync`` (here a ``memmove``), events and streams
(here already complete), the shared kernel table on cupy-typed arrays. Only the CUDA kernels of
``cupy_ops`` (rope, the Q8_0/Q4_1 dequantizer) cannot run: calling one raises.

Used only by ``tests/test_fake_cuda.py``, in worker subprocesses (never imported into the test
process, where it would shadow a real cupy).
"""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any

import numpy as np
from fake_device import posing_as


class _Array(np.ndarray):  # type: ignore[type-arg]
    """Host memory that the worker takes for cupy's ndarray (its type's module is ``cupy``)."""

    @property
    def data(self) -> MemoryPointer:  # type: ignore[override]
        return MemoryPointer(self.ctypes.data, self)

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        self[...] = np.asarray(host).reshape(self.shape)

    def get(self) -> np.ndarray:
        return np.array(self).view(np.ndarray)


_Array.__module__ = "cupy"


class MemoryPointer:
    def __init__(self, ptr: int, owner: Any) -> None:
        self.ptr, self.owner = ptr, owner

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.ptr + offset, self.owner)


def _new(shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None,
         strides: Any = None) -> _Array:
    """``cupy.ndarray(shape, dtype, memptr=, strides=)``: a view of the memory at memptr."""
    dtype = np.dtype(dtype)
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    if memptr is None:
        return np.empty(shape, dtype).view(_Array)
    strides = tuple(strides) if strides is not None else None
    steps = strides or tuple(np.empty(shape, dtype).strides)
    lo = sum((n - 1) * s for n, s in zip(shape, steps, strict=True) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(shape, steps, strict=True) if s > 0) + dtype.itemsize
    raw = (ctypes.c_char * (hi - lo)).from_address(memptr.ptr + lo)
    view = np.ndarray(shape, dtype, buffer=raw, offset=-lo, strides=strides).view(_Array)
    view.__dict__["_owner"] = memptr.owner          # keeps the memory alive
    return view


_wrapped = posing_as(_Array)


class _Done:
    """A stream or an event: every copy here is complete when its call returns."""

    ptr = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Device:
    def __init__(self, index: int = 0) -> None:
        self.id = index

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def use(self) -> None:
        pass


class ElementwiseKernel:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = args[3] if len(args) > 3 else kwargs.get("name", "kernel")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"fake cupy runs no CUDA kernel ({self.name})")


def _memcpy(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    ctypes.memmove(dst, src, size)


runtime = types.SimpleNamespace(
    memGetInfo=lambda: (3 << 30, 4 << 30), getDeviceCount=lambda: 1,
    getDeviceProperties=lambda i: {"name": b"Fake GPU", "major": 9, "minor": 0,
                                   "totalGlobalMem": 4 << 30},
    memcpyAsync=_memcpy, memcpyHostToDevice=1, memcpyDeviceToHost=2)
cuda = types.SimpleNamespace(
    Device=_Device, runtime=runtime, Stream=_Done, Event=_Done,
    get_current_stream=lambda: _Done(), alloc_pinned_memory=lambda size: bytearray(size))


def asnumpy(a: Any) -> np.ndarray:
    return np.array(a).view(np.ndarray)


def asarray(a: Any, dtype: Any = None) -> _Array:
    return np.array(a, dtype=dtype).view(_Array)


def __getattr__(name: str) -> Any:
    attr = getattr(np, name)
    if callable(attr) and not isinstance(attr, type):
        return _wrapped(attr)
    return attr


def _erf(x: Any, out: Any = None) -> Any:
    from zmq_rpc.worker.backends.numpy_ops import erf
    host = erf(np.asarray(x).view(np.ndarray))
    if out is None:
        return host.view(_Array)
    out[...] = host
    return out


def install() -> None:
    """Make ``import cupy`` (and ``cupyx.scipy.special``) find this module."""
    this = sys.modules[__name__]
    this.__dict__["ndarray"] = _new                  # the constructor cupy_backend calls
    sys.modules["cupy"] = this
    special = types.ModuleType("cupyx.scipy.special")
    special.erf = _erf  # type: ignore[attr-defined]
    scipy = types.ModuleType("cupyx.scipy")
    scipy.special = special  # type: ignore[attr-defined]
    cupyx = types.ModuleType("cupyx")
    cupyx.scipy = scipy  # type: ignore[attr-defined]
    sys.modules.update({"cupyx": cupyx, "cupyx.scipy": scipy, "cupyx.scipy.special": special})


if __name__ == "__main__":
    install()
    from zmq_rpc.worker.cli import main
    sys.exit(main())
