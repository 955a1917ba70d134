"""A client's buffer and tensor calls: allocate, free and clear buffers; set, get, memset, copy views.

:class:`TensorCalls` issues them over one session's :class:`~.connection.Connection` (its public
``call`` and ``result_of`` only); :class:`~zmq_rpc.client.Client` composes it. Each call has a
blocking form and an ``_async`` twin returning a ``concurrent.futures.Future``; large tensors go
as requests of at most ``chunk_bytes`` (received straight into place). Any thread may call in;
``on_reply`` functions here run on the thread that drives the connection.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from ..broker import protocol as p
from ..broker.errors import BadRequest, ProtocolError
from ..broker.protocol import Cmd, DType
from .arrays import from_bfloat16
from .calls import OnReply, no_result
from .futures import all_of, then
from .peer import copy_between
from .remote import Owner, RemoteBuffer, RemoteTensor, owned_ref, payload_array
from .session import Session


class TensorCalls:
    """Buffers and the bytes of their views, on ``session``'s worker, handed out as ``owner``'s."""

    def __init__(self, session: Session, owner: Owner) -> None:
        self.session = session
        self.owner = owner
        self.connection = session.connection

    def _call(self, cmd: Cmd, msg: p.Message, payload: Any = (),
              on_reply: OnReply | None = None, reply_bytes: int = 0) -> Future[Any]:
        return self.connection.call(cmd, msg, payload, on_reply or no_result,
                                    reply_bytes=reply_bytes)

    def _request(self, cmd: Cmd, msg: p.Message) -> None:
        self.connection.request(cmd, msg, (), no_result)

    def _own_buffer(self, buffer: RemoteBuffer) -> None:
        if buffer.client is not self.owner:
            raise BadRequest(f"{buffer!r} lives on {buffer.client.endpoint}, "
                             f"not on {self.session.endpoint}")

    def _own(self, tensor: RemoteTensor) -> None:
        owned_ref(self.owner, tensor, self.session.endpoint)

    def alloc_buffer(self, size: int) -> RemoteBuffer:
        """Allocate ``size`` bytes on the worker (raises OutOfMemory beyond its limits)."""
        return self.connection.result_of(self.alloc_buffer_async, size)

    def alloc_buffer_async(self, size: int) -> Future[RemoteBuffer]:
        """Allocate without waiting; the future resolves to the buffer."""
        buffer = self.alloc_buffer_nowait(size)
        return then(buffer.allocation, lambda _: buffer)

    def alloc_buffer_nowait(self, size: int) -> RemoteBuffer:
        """The buffer object at once, for pipelining: later requests may use it immediately;
        ``buffer.allocation`` is the allocation's future (its error, if any, also fails them)."""
        if size < 0:
            raise BadRequest(f"buffer size must be >= 0, got {size}")
        handle = self.session.new_handle()
        future = self._call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=handle, size=size))
        return RemoteBuffer(self.owner, handle, size, future)

    def free_buffer(self, buffer: RemoteBuffer) -> None:
        """Free a buffer now (the session frees the rest when the client closes)."""
        self._own_buffer(buffer)
        self._request(Cmd.FREE_BUFFER, p.BufferOp(handle=buffer.handle))

    def free_buffer_async(self, buffer: RemoteBuffer) -> Future[None]:
        self._own_buffer(buffer)
        return self._call(Cmd.FREE_BUFFER, p.BufferOp(handle=buffer.handle))

    def clear_buffer(self, buffer: RemoteBuffer, value: int = 0) -> None:
        """Set every byte of the buffer to ``value`` (0..255)."""
        self._own_buffer(buffer)
        self._request(Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=buffer.handle, value=value))

    def clear_buffer_async(self, buffer: RemoteBuffer, value: int = 0) -> Future[None]:
        self._own_buffer(buffer)
        return self._call(Cmd.CLEAR_BUFFER, p.ClearBuffer(handle=buffer.handle, value=value))

    def set_tensor(self, tensor: RemoteTensor, values: Any) -> None:
        """Upload ``values`` (same shape; same dtype, or float32 into bfloat16) into the view."""
        self.connection.result_of(self.set_tensor_async, tensor, values)

    def set_tensor_async(self, tensor: RemoteTensor, values: Any) -> Future[None]:
        """Pipelined upload. Do not modify ``values`` until the future is done (zero-copy send)."""
        self._own(tensor)
        data = payload_array(tensor, values)
        flat = data.reshape(-1).view(np.uint8)
        parts = [self._call(Cmd.SET_TENSOR, p.SetTensor(tensor=sub),
                            [flat[start:start + sub.nbytes]])
                 for start, sub in p.split_tensor(tensor.ref, self.session.chunk_bytes)]
        return all_of(parts, lambda: None)

    def get_tensor(self, tensor: RemoteTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Download the view into a new C-ordered numpy array, or into ``out``.

        bfloat16 arrives as float32. ``out`` (C-contiguous, the tensor's shape, its numpy dtype;
        float32 or uint16 bits for bfloat16) receives the bytes straight from the reply frames,
        which saves the allocation and first touch of a fresh array on every large download.
        """
        return self.connection.result_of(self.get_tensor_async, tensor, out)

    def get_tensor_async(self, tensor: RemoteTensor,
                         out: np.ndarray | None = None) -> Future[np.ndarray]:
        self._own(tensor)
        storage = np.dtype(tensor.ref.dtype.storage)
        convert = tensor.ref.dtype is DType.BFLOAT16 and (out is None or out.dtype != storage)
        if out is not None:
            _check_out(tensor, out, storage)
        target = out if out is not None and not convert else np.empty(tensor.shape, storage)
        flat = target.reshape(-1).view(np.uint8)

        def landing(start: int, size: int) -> Callable[[p.Message, list[zmq.Frame]], None]:
            def land(reply: p.Message, frames: list[zmq.Frame]) -> None:
                if len(frames[0]) != size:
                    raise ProtocolError(f"GET_TENSOR reply of {len(frames[0])} bytes, "
                                          f"expected {size}")
                flat[start:start + size] = np.frombuffer(frames[0].buffer, np.uint8)
            return land

        parts = [self._call(Cmd.GET_TENSOR, p.GetTensor(tensor=sub),
                            on_reply=landing(start, sub.nbytes), reply_bytes=sub.nbytes)
                 for start, sub in p.split_tensor(tensor.ref, self.session.chunk_bytes)]

        def result() -> np.ndarray:
            if not convert:
                return target
            if out is None:
                return from_bfloat16(target)
            out[...] = from_bfloat16(target)
            return out

        return all_of(parts, result)

    def memset_tensor(self, tensor: RemoteTensor, value: int, offset: int = 0,
                      size: int | None = None) -> None:
        """Set bytes [offset, offset+size) of the tensor's data to ``value`` (0..255)."""
        self._own(tensor)
        self._request(Cmd.MEMSET_TENSOR, p.MemsetTensor(
            tensor=tensor.ref, value=value, offset=offset, size=-1 if size is None else size))

    def memset_tensor_async(self, tensor: RemoteTensor, value: int, offset: int = 0,
                            size: int | None = None) -> Future[None]:
        self._own(tensor)
        return self._call(Cmd.MEMSET_TENSOR, p.MemsetTensor(
            tensor=tensor.ref, value=value, offset=offset, size=-1 if size is None else size))

    def copy_tensor(self, src: RemoteTensor, dst: RemoteTensor) -> None:
        """dst[...] = src (same shape and dtype), on one worker or across two.

        Across workers, src's worker pushes the bytes straight to dst's worker (the client never
        touches them) and dst's worker runs nothing else of this client's until they have landed.
        """
        if src.client is not dst.client:   # the receiving worker's reply completes it
            dst.client.session.connection.result_of(copy_between, src, dst)
            return
        self.connection.result_of(self.copy_tensor_async, src, dst)

    def copy_tensor_async(self, src: RemoteTensor, dst: RemoteTensor) -> Future[None]:
        if src.client is not dst.client:
            return copy_between(src, dst)
        return src.client.session.connection.call(
            Cmd.COPY_TENSOR, p.CopyTensor(src=src.ref, dst=dst.ref), on_reply=no_result)


def _check_out(tensor: RemoteTensor, out: np.ndarray, storage: np.dtype[Any]) -> None:
    allowed = {storage} | ({np.dtype(np.float32)} if tensor.ref.dtype is DType.BFLOAT16 else set())
    if out.shape != tensor.shape or out.dtype not in allowed:
        raise BadRequest(f"out= must have shape {tensor.shape} and dtype "
                         f"{' or '.join(sorted(d.name for d in allowed))}, got {out.shape} {out.dtype}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise BadRequest("out= must be a writeable C-contiguous array")
