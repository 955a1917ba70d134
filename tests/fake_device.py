"""Host memory posing as a device array namespace, so the kernels' device branches run on the CPU.

:class:`DeviceArray` is a numpy subclass; the kernel table finds an array's namespace by its
type's module (``namespace(arr)`` in ``numpy_ops``), which is this module. Every numpy function
is reached through the module ``__getattr__`` and its array results come back as
:class:`DeviceArray`, so a kernel never falls back to the numpy fast path by accident.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class DeviceArray(np.ndarray):  # type: ignore[type-arg]
    """A numpy array that the kernel table treats as another backend's array."""


def posing_as(kind: type[np.ndarray]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:  # type: ignore[type-arg]
    """A wrapper for numpy functions whose array results come back as ``kind`` (a numpy
    subclass posing as another backend's arrays; also used by ``fake_cupy``)."""

    def as_kind(value: Any) -> Any:
        if isinstance(value, np.ndarray) and not isinstance(value, kind):
            return value.view(kind)
        if isinstance(value, tuple):
            return tuple(as_kind(v) for v in value)
        return value

    def wrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return as_kind(fn(*args, **kwargs))

        return call

    return wrapped


_wrapped = posing_as(DeviceArray)


def __getattr__(name: str) -> Any:
    attr = getattr(np, name)
    if callable(attr) and not isinstance(attr, type):
        return _wrapped(attr)
    return attr


def to_device(array: np.ndarray) -> DeviceArray:
    """The same memory, as a device array (strides kept)."""
    result: DeviceArray = array.view(DeviceArray)
    return result
