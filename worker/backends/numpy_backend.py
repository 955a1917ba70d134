"""The CPU backend: buffers are aligned numpy byte arrays, tensors are strided numpy views of them.

Owned by the worker's backend thread: nothing here is thread-safe, and nothing needs to be.
The executor validates every view against its buffer before calling in here.
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import Any

import numpy as np

from ...broker.protocol import DType, TensorRef
from ..process.devices import physical_memory
from .base import Backend
from .numpy_ops import NUMPY_KERNELS

ALIGNMENT = 64
POPULATE_MIN = 1 << 20
POPULATE_MAX = 256 << 20
HUGE_PAGE = 2 << 20

STORAGE_DTYPES: dict[DType, np.dtype[Any]] = {d: np.dtype(d.storage) for d in DType}
"""The numpy dtype that stores each wire dtype (bfloat16 as raw uint16 words)."""


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)
"""Linux 5.14+; Python names it from 3.13 on."""


def _advise(mapping: mmap.mmap, advice: int | None, start: int = 0, length: int = 0) -> bool:
    """``madvise`` the mapping (or ``length`` bytes from page-aligned ``start``); False when the
    platform lacks the advice or refuses it."""
    if advice is None:
        return False
    try:
        mapping.madvise(advice, start, length or len(mapping) - start)
    except OSError:            # an older kernel (POPULATE_WRITE is Linux 5.14), THP disabled
        return False
    return True


class NumpyBackend(Backend):
    """Host-memory buffers and numpy views; the executor's only way to touch tensor data."""

    name = "numpy"
    kind = "cpu"
    index = 0
    alignment = ALIGNMENT
    zero_copy = True
    supports_graphs = True
    packed_kernels = True
    kernels = NUMPY_KERNELS

    def attach(self) -> None:
        """Called first on the backend thread (a GPU backend makes its device current there)."""

    def device_name(self) -> str:
        """A human-readable device name for HELLO."""
        return f"cpu ({os.cpu_count()} cores)"

    def total_memory(self) -> int:
        """Physical memory behind this backend."""
        return physical_memory()

    def compute_capability(self) -> str:
        """A CPU has none: ""."""
        return ""

    def alloc(self, size: int) -> np.ndarray:
        """A zero-filled, ``ALIGNMENT``-aligned byte array (zeroed: no data leaks between sessions).

        Buffers of ``POPULATE_MIN`` bytes and more are private anonymous mappings on 2 MiB
        boundaries, advised to use transparent huge pages: faulting fresh 4 KiB pages in one at
        a time is the slowest way to fill them, huge pages the fastest (docs/DESIGN.md). Those up to ``POPULATE_MAX`` are populated at once, so that the first upload
        into them runs at copy speed; bigger ones fault in as they are written.
        """
        if size < POPULATE_MIN:
            raw = np.zeros(size + ALIGNMENT, dtype=np.uint8)
            start = (-raw.ctypes.data) % ALIGNMENT
            return raw[start:start + size]
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(mapping, np.uint8)
        start = (-raw.ctypes.data) % HUGE_PAGE
        whole = size // HUGE_PAGE * HUGE_PAGE        # huge pages only where the buffer fills them
        if whole:
            _advise(mapping, getattr(mmap, "MADV_HUGEPAGE", None), start, whole)
        memory = raw[start:start + size]
        populate = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE   # the buffer's pages, not the
        if size <= POPULATE_MAX and not _advise(mapping, MADV_POPULATE_WRITE, start, populate):
            memory[::mmap.PAGESIZE] = 0     # alignment slack (1,000 x 1 MiB cost 3 GiB of RSS)
        return memory

    def scratch(self, size: int) -> np.ndarray:
        """An uninitialised byte array (a graph arena: nodes write before they read)."""
        return np.empty(size, np.uint8)

    def view(self, buffer: np.ndarray, ref: TensorRef) -> np.ndarray:
        """The strided view ``ref`` describes (validated by the caller to lie inside ``buffer``)."""
        dtype = STORAGE_DTYPES[ref.dtype]
        if ref.numel == 0:
            return np.empty(ref.shape, dtype)
        view: np.ndarray = np.ndarray(ref.shape, dtype, buffer=buffer.data, offset=ref.offset,
                                      strides=ref.strides)
        return view

    def write(self, view: np.ndarray, payload: Any) -> None:
        """Copy a C-ordered payload (any buffer object) into ``view``: the one copy on receive."""
        src = np.frombuffer(payload, dtype=view.dtype)
        if view.flags.c_contiguous:
            view.reshape(-1)[...] = src
        else:
            view[...] = src.reshape(view.shape)

    def write_bytes(self, view: np.ndarray, start: int, payload: Any) -> None:
        """Copy ``payload`` to bytes [start, start+len) of a contiguous view's data."""
        data = np.frombuffer(payload, np.uint8)
        view.reshape(-1).view(np.uint8)[start:start + data.size] = data

    def read(self, view: np.ndarray) -> tuple[Any, bool]:
        """The view's bytes in C order, and whether they alias the buffer (zero-copy)."""
        aliased = self.alias(view)
        if aliased is not None:
            return aliased, True
        return np.ascontiguousarray(view).reshape(-1).view(np.uint8), False

    def prefetch(self, views: list[np.ndarray]) -> None:
        """Host memory is read in place or copied when asked: nothing to start."""

    def alias(self, view: np.ndarray) -> Any | None:
        """The view's bytes in place (reading them later sees later writes), or None when they
        are not one C-ordered run."""
        return view.reshape(-1).view(np.uint8) if view.flags.c_contiguous else None

    def fill(self, view: np.ndarray, byte: int) -> None:
        """Set every byte of the view's elements to ``byte``."""
        if view.flags.c_contiguous:
            view.reshape(-1).view(np.uint8)[...] = byte
        elif view.dtype.itemsize == 1:
            view.view(np.uint8)[...] = byte             # bool included: no value conversion
        else:                                           # same-dtype assignment copies the bits
            view[...] = np.frombuffer(bytes([byte]) * view.dtype.itemsize, view.dtype)[0]

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst[...] = src; numpy copies through a temporary when the two overlap."""
        dst[...] = src
