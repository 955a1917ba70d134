"""What a client's calls hand out: :class:`RemoteBuffer`, :class:`RemoteTensor`, :class:`RegisteredGraph`.

Plain descriptions of things on a worker (a handle, a view, the client they live on), usable from
any thread; their methods are shortcuts to the calls of the :class:`~zmq_rpc.client.Client` that
made them (:class:`Owner`: what this module and the call modules ask of it). No socket work here.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol, cast

import numpy as np

from ..broker.errors import BadRequest
from ..broker.protocol import DType, TensorRef, contiguous_strides
from .arrays import RunResult, to_bfloat16
from .graph import Graph
from .session import Session

DTypeLike = str | type | np.dtype[Any] | DType


def as_dtype(dtype: DTypeLike) -> DType:
    """Normalize "float32", np.float32, np.dtype("float32") or a DType."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        return DType.from_name(dtype)
    return DType.from_name(np.dtype(dtype).name)


def owned_ref(owner: object, tensor: RemoteTensor, endpoint: str) -> TensorRef:
    """``tensor``'s reference, if it lives on the worker of ``owner`` (at ``endpoint``); else
    BadRequest."""
    if tensor.buffer.client is not owner:
        raise BadRequest(f"{tensor!r} lives on {tensor.client.endpoint}, not on {endpoint}")
    return tensor.ref


class Owner(Protocol):
    """What a handle's ``client`` (a :class:`~zmq_rpc.client.Client`) offers to the handles and
    the call modules: its session, and the calls the handles' shortcuts and the cross-worker
    copies issue (declared here so that these modules need not import the client)."""

    @property
    def session(self) -> Session: ...

    @property
    def endpoint(self) -> str: ...

    def get_tensor(self, tensor: RemoteTensor, out: np.ndarray | None = None) -> np.ndarray: ...

    def get_tensor_async(self, tensor: RemoteTensor,
                         out: np.ndarray | None = None) -> Future[np.ndarray]: ...

    def set_tensor(self, tensor: RemoteTensor, values: Any) -> None: ...

    def set_tensor_async(self, tensor: RemoteTensor, values: Any) -> Future[None]: ...

    def copy_tensor(self, src: RemoteTensor, dst: RemoteTensor) -> None: ...

    def copy_tensor_async(self, src: RemoteTensor, dst: RemoteTensor) -> Future[None]: ...

    def free_buffer(self, buffer: RemoteBuffer) -> None: ...

    def free_buffer_async(self, buffer: RemoteBuffer) -> Future[None]: ...

    def clear_buffer(self, buffer: RemoteBuffer, value: int = 0) -> None: ...

    def clear_buffer_async(self, buffer: RemoteBuffer, value: int = 0) -> Future[None]: ...

    def free_graph(self, graph: RegisteredGraph) -> None: ...

    def free_graph_async(self, graph: RegisteredGraph) -> Future[None]: ...

    def run_async(self, graph: RegisteredGraph, inputs: Inputs = None,
                  fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[Any] = (),
                  send: Sequence[Any] = (), hold_reply: float = 0.0) -> Future[RunResult]: ...


class MemoryInfo(NamedTuple):
    """Bytes a worker may still hand out, and its limit."""

    free: int
    total: int


class RemoteTensor:
    """A typed, strided view into a :class:`RemoteBuffer`. Views of it are free and may alias."""

    __slots__ = ("buffer", "ref")

    def __init__(self, buffer: RemoteBuffer, ref: TensorRef) -> None:
        self.buffer = buffer
        self.ref = ref

    @property
    def client(self) -> Owner:
        return self.buffer.client

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape

    @property
    def dtype(self) -> str:
        return self.ref.dtype.dtype_name

    @property
    def strides(self) -> tuple[int, ...]:
        return self.ref.strides

    @property
    def offset(self) -> int:
        return self.ref.offset

    @property
    def ndim(self) -> int:
        return len(self.ref.shape)

    @property
    def nbytes(self) -> int:
        return self.ref.nbytes

    def is_contiguous(self) -> bool:
        return self.ref.is_contiguous()

    def __repr__(self) -> str:
        return (f"RemoteTensor({self.dtype}{list(self.shape)}, strides={list(self.strides)}, "
                f"offset={self.offset}, buffer={self.buffer.handle})")

    def _derive(self, probe: np.ndarray, base: np.ndarray) -> RemoteTensor:
        delta = probe.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        ref = TensorRef(buffer=self.ref.buffer, dtype=self.ref.dtype, shape=probe.shape,
                        strides=probe.strides, offset=self.ref.offset + delta)
        return RemoteTensor(self.buffer, ref)

    def _probe(self) -> tuple[np.ndarray, np.ndarray]:
        """A data-less numpy stand-in with our shape and strides, for numpy's view arithmetic."""
        base = np.zeros(1, dtype=self.ref.dtype.storage)
        stand_in = np.lib.stride_tricks.as_strided(base, self.ref.shape, self.ref.strides,
                                                   writeable=False)
        return stand_in, base

    def __getitem__(self, key: Any) -> RemoteTensor:
        """Basic numpy indexing (ints, slices with steps, ``...``, ``None``) gives a view."""
        keys = key if isinstance(key, tuple) else (key,)
        for k in keys:
            if not (k is None or k is Ellipsis or isinstance(k, (int, np.integer, slice))) \
                    or isinstance(k, bool):
                raise BadRequest(f"only basic indexing makes a remote view, not {k!r}")
        probe, base = self._probe()
        return self._derive(probe[key], base)

    def transpose(self, *axes: int) -> RemoteTensor:
        """A view with permuted axes (reversed when none are given), like ``ndarray.transpose``."""
        probe, base = self._probe()
        return self._derive(probe.transpose(*axes) if axes else probe.T, base)

    permute = transpose

    @property
    def T(self) -> RemoteTensor:
        return self.transpose()

    def reshape(self, *shape: int | Sequence[int]) -> RemoteTensor:
        """A reshaped view of a contiguous tensor (one -1 allowed)."""
        first = shape[0] if len(shape) == 1 else None
        dims = tuple(first) if isinstance(first, Sequence) else tuple(cast(tuple[int, ...], shape))
        if not self.is_contiguous():
            raise BadRequest("reshape needs a contiguous tensor; views of it cannot be reshaped")
        probe, base = self._probe()
        return self._derive(probe.reshape(dims), base)

    def view(self, shape: Sequence[int] | None = None, strides: Sequence[int] | None = None,
             offset: int = 0, dtype: DTypeLike | None = None) -> RemoteTensor:
        """A raw view: ``offset`` bytes past this tensor's start, any shape, strides (bytes), dtype.

        Like ``ggml_view``: the worker checks that every element it can reach lies in the buffer.
        """
        kind = as_dtype(dtype) if dtype is not None else self.ref.dtype
        dims = tuple(self.shape if shape is None else shape)
        steps = tuple(strides) if strides is not None else contiguous_strides(dims, kind.itemsize)
        return RemoteTensor(self.buffer, TensorRef(
            buffer=self.ref.buffer, dtype=kind, shape=dims, strides=steps,
            offset=self.ref.offset + offset))

    def get(self) -> np.ndarray:
        """``client.get_tensor(self)``."""
        return self.client.get_tensor(self)

    def set(self, values: Any) -> None:
        """``client.set_tensor(self, values)``."""
        self.client.set_tensor(self, values)


class RemoteBuffer:
    """A block of worker memory owned by this client's session, named by a client-chosen handle."""

    __slots__ = ("client", "handle", "size", "allocation")

    def __init__(self, client: Owner, handle: int, size: int, allocation: Future[Any]) -> None:
        self.client = client
        self.handle = handle
        self.size = size
        self.allocation = allocation

    def __repr__(self) -> str:
        return f"RemoteBuffer(handle={self.handle}, size={self.size}, worker={self.client.endpoint})"

    def tensor(self, shape: int | Sequence[int], dtype: DTypeLike = "float32", offset: int = 0,
               strides: Sequence[int] | None = None) -> RemoteTensor:
        """A typed view at ``offset`` bytes (contiguous unless ``strides`` are given)."""
        kind = as_dtype(dtype)
        dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
        steps = tuple(strides) if strides is not None else contiguous_strides(dims, kind.itemsize)
        ref = TensorRef(buffer=self.handle, dtype=kind, shape=dims, strides=steps, offset=offset)
        lo, hi = ref.byte_extent()
        if lo < 0 or hi > self.size:
            raise BadRequest(f"tensor {kind.dtype_name}{list(dims)} at offset {offset} reaches "
                             f"bytes [{lo}, {hi}) of a {self.size}-byte buffer")
        return RemoteTensor(self, ref)

    def free(self) -> None:
        """``client.free_buffer(self)``."""
        self.client.free_buffer(self)

    def free_async(self) -> Future[None]:
        return self.client.free_buffer_async(self)

    def clear(self, value: int = 0) -> None:
        """``client.clear_buffer(self, value)``."""
        self.client.clear_buffer(self, value)

    def clear_async(self, value: int = 0) -> Future[None]:
        return self.client.clear_buffer_async(self, value)


class RegisteredGraph:
    """A graph kept by the worker under a client-chosen handle; ``client.run(g)`` reruns it."""

    __slots__ = ("client", "handle", "graph")

    def __init__(self, client: Owner, handle: int, graph: Graph) -> None:
        self.client = client
        self.handle = handle
        self.graph = graph

    def __repr__(self) -> str:
        return f"RegisteredGraph(handle={self.handle}, nodes={len(self.graph)})"

    def free(self) -> None:
        """``client.free_graph(self)``."""
        self.client.free_graph(self)

    def free_async(self) -> Future[None]:
        return self.client.free_graph_async(self)


Inputs = dict[RemoteTensor, Any] | Sequence[tuple[RemoteTensor, Any]] | None


def payload_array(tensor: RemoteTensor, values: Any) -> np.ndarray:
    """``values`` as the C-ordered array a SET_TENSOR (or a graph input) of ``tensor`` carries:
    its storage dtype (float32 converted for bfloat16) and its shape, else BadRequest."""
    storage = np.dtype(tensor.ref.dtype.storage)
    if tensor.ref.dtype is DType.BFLOAT16 and np.asarray(values).dtype != np.uint16:
        values = to_bfloat16(np.asarray(values, dtype=np.float32))
    array = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=storage)
    if array.dtype != storage:
        raise BadRequest(f"array of dtype {array.dtype} for a {tensor.dtype} tensor; "
                         f"convert it first (e.g. values.astype({storage.name!r}))")
    if array.shape != tensor.shape:
        raise BadRequest(f"array of shape {array.shape} for a tensor of shape {tensor.shape}")
    return np.ascontiguousarray(array)


