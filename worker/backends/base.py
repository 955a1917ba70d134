"""The seam between the worker and a compute device: the :class:`Backend` protocol.

Owned by the backend thread, like every backend: the executor, the peer links and the graph
arenas reach device memory only through these methods, and only from that thread. A backend says
what it can do with explicit capability attributes (never probed with ``getattr``); the worker
turns them into the capabilities it advertises in HELLO.

Buffers and views are the device's own array type (numpy on the host, cupy on a GPU). They are
typed :data:`Memory` and :data:`View` (aliases of ``Any``): an optional dependency's array type
cannot be named here without importing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ...broker.protocol import TensorRef

if TYPE_CHECKING:
    from .numpy_ops import KernelTable

Memory = Any
"""A buffer's device memory: a flat byte array of the backend's array type."""
View = Any
"""A typed, possibly strided view of a buffer's memory (the backend's array type)."""


class Backend(Protocol):
    """What the worker needs from a device. Implementations: ``numpy_backend.NumpyBackend``
    (CPU) and ``cupy_backend.CupyBackend`` (NVIDIA GPU, imported only when asked for).

    Callers validate every view against its buffer before calling in (handles known, bytes
    inside); methods that move data may assume it.
    """

    name: str
    """Short backend name ("numpy", "cupy"), used in messages."""
    kind: str
    """The device kind clients see in HELLO ("cpu", "cuda")."""
    index: int
    """The device's ordinal on its machine (``cuda:N``; 0 for the CPU), in HELLO's details."""
    alignment: int
    """Bytes every buffer's start is aligned to."""
    zero_copy: bool
    """:meth:`read` and :meth:`alias` may hand out buffer memory in place, so replies and
    peer pushes go to zmq without a copy (host memory only)."""
    supports_graphs: bool
    """The graph kernels run on this device's arrays (advertised as ``graph-vN``)."""
    packed_kernels: bool
    """The packed quantized products (``mul_mat_packed``, ``get_rows_packed``: numba, host
    memory) run here; advertised as ``packed-kernels`` when numba imports."""
    kernels: KernelTable
    """The op kernels for this device's arrays: the shared table of :mod:`.numpy_ops` with the
    backend's overrides."""

    def attach(self) -> None:
        """Called first on the backend thread (a GPU backend makes its device current there)."""
        ...

    def device_name(self) -> str:
        """A human-readable device name for HELLO."""
        ...

    def total_memory(self) -> int:
        """Bytes of memory behind this device (0 if unknown)."""
        ...

    def compute_capability(self) -> str:
        """The device's compute capability ("9.0" for an H100), "" where there is none (a CPU)."""
        ...

    def alloc(self, size: int) -> Memory:
        """A zero-filled buffer of ``size`` bytes (no data leaks between sessions)."""
        ...

    def scratch(self, size: int) -> Memory:
        """An uninitialised byte array of ``size`` bytes for a graph's scratch arena (every
        byte is written by a node before any node reads it)."""
        ...

    def view(self, buffer: Memory, ref: TensorRef) -> View:
        """The strided view ``ref`` describes in ``buffer``."""
        ...

    def write(self, view: View, payload: Any) -> None:
        """Copy a C-ordered payload (any buffer object) into ``view``."""
        ...

    def write_bytes(self, view: View, start: int, payload: Any) -> None:
        """Copy ``payload`` to bytes ``[start, start + len)`` of a contiguous view."""
        ...

    def read(self, view: View) -> tuple[Any, bool]:
        """The view's bytes in C order as a host buffer, and whether they alias the buffer."""
        ...

    def prefetch(self, views: list[View]) -> None:
        """These views will be :meth:`read` next, in this order (a peer push's pieces): a device
        backend starts their downloads now, so that they overlap the sends. A host backend
        does nothing."""
        ...

    def alias(self, view: View) -> Any | None:
        """The view's bytes in place as a host buffer (reading them later sees later writes),
        or None when they are not one C-ordered run of host memory."""
        ...

    def fill(self, view: View, byte: int) -> None:
        """Set every byte of the view's elements to ``byte``."""
        ...

    def copy(self, dst: View, src: View) -> None:
        """``dst[...] = src`` bit for bit, correct when the two overlap."""
        ...
