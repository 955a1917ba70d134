"""Buffer and tensor commands: allocate, free, clear, set, get, memset, copy, device memory.

Owned by the backend thread (the executor calls these handlers from its queue). Every byte
allocated here is counted by the worker's :class:`~zmq_rpc.worker.sessions.memory.MemoryBudget`; every
tensor is reached through :class:`~zmq_rpc.worker.sessions.views.Views` (handle and bounds checked).
"""

from __future__ import annotations

from ...broker import protocol as p
from ...broker.protocol import Cmd, ErrorCode, WireError
from ..backends.base import Backend
from .memory import SessionMemory
from .quotas import check
from .session import NO_REPLY, Buffer, Reply, Request, Route, Session
from .views import Views


class BufferCommands:
    """The handlers of the buffer and tensor commands."""

    def __init__(self, backend: Backend, views: Views, memory: SessionMemory,
                 max_buffer_size: int) -> None:
        self.backend = backend
        self.views = views
        self.memory = memory
        self.max_buffer_size = max_buffer_size

    def routes(self) -> dict[Cmd, Route]:
        """This module's part of the executor's dispatch table."""
        return {
            Cmd.ALLOC_BUFFER: Route(self.alloc),
            Cmd.FREE_BUFFER: Route(self.free),
            Cmd.CLEAR_BUFFER: Route(self.clear, writes=lambda s, m: [m.handle]),
            Cmd.DEVICE_MEMORY: Route(self.device_memory),
            Cmd.SET_TENSOR: Route(self.set_tensor, writes=lambda s, m: [m.tensor.buffer]),
            Cmd.GET_TENSOR: Route(self.get_tensor),
            Cmd.MEMSET_TENSOR: Route(self.memset, writes=lambda s, m: [m.tensor.buffer]),
            Cmd.COPY_TENSOR: Route(self.copy, writes=lambda s, m: [m.dst.buffer]),
        }

    def alloc(self, session: Session, msg: p.AllocBuffer, req: Request) -> Reply:
        if msg.handle in session.buffers:
            raise WireError(ErrorCode.INVALID_HANDLE, f"buffer handle {msg.handle} is in use")
        if msg.size > self.max_buffer_size:
            raise WireError(ErrorCode.OUT_OF_MEMORY, f"buffer of {msg.size} bytes is over the "
                            f"maximum buffer size {self.max_buffer_size}")
        check("buffers", len(session.buffers), 1, self.memory.quotas.buffers)
        memory = self.memory.allocate(session, msg.size, "buffer",
                                      lambda: self.backend.alloc(msg.size))
        session.buffers[msg.handle] = Buffer(msg.handle, msg.size, memory)
        return NO_REPLY

    def free(self, session: Session, msg: p.BufferOp, req: Request) -> Reply:
        buf = self.views.buffer(session, msg.handle)
        del session.buffers[msg.handle]
        session.frees += 1
        session.views.clear()
        for graph in session.graphs.values():   # their views of it must not keep it mapped
            graph.views = None
        self.memory.uncharge(session, buf.size)
        return NO_REPLY

    def clear(self, session: Session, msg: p.ClearBuffer, req: Request) -> Reply:
        buf = self.views.buffer(session, msg.handle)
        self.backend.fill(buf.memory, msg.value)
        return NO_REPLY

    def device_memory(self, session: Session, msg: p.Empty, req: Request) -> Reply:
        free, total = self.memory.budget.report()
        return p.DeviceMemoryReply(free=free, total=total), []

    def set_tensor(self, session: Session, msg: p.SetTensor, req: Request) -> Reply:
        self.backend.write(self.views.view(session, msg.tensor), req.payload[0])
        return NO_REPLY

    def get_tensor(self, session: Session, msg: p.GetTensor, req: Request) -> Reply:
        view = self.views.view(session, msg.tensor)
        return p.GetTensorReply(), [self.views.fetched(session, msg.tensor, view)]

    def memset(self, session: Session, msg: p.MemsetTensor, req: Request) -> Reply:
        ref = msg.tensor
        view = self.views.view(session, ref)
        if msg.offset > ref.nbytes:
            raise WireError(ErrorCode.OUT_OF_BOUNDS,
                            f"offset {msg.offset} is past the tensor's {ref.nbytes} bytes")
        size = ref.nbytes - msg.offset if msg.size == -1 else msg.size
        if size > ref.nbytes - msg.offset:
            raise WireError(ErrorCode.OUT_OF_BOUNDS, f"bytes [{msg.offset}, +{size}) are outside "
                            f"the tensor's {ref.nbytes} bytes")
        if msg.offset == 0 and size == ref.nbytes:
            self.backend.fill(view, msg.value)
        elif not ref.is_contiguous():
            raise WireError(ErrorCode.BAD_REQUEST, "a byte range memset needs a contiguous tensor")
        else:
            self.backend.fill(view.reshape(-1).view("uint8")[msg.offset:msg.offset + size],
                              msg.value)
        return NO_REPLY

    def copy(self, session: Session, msg: p.CopyTensor, req: Request) -> Reply:
        if msg.src.shape != msg.dst.shape or msg.src.dtype != msg.dst.dtype:
            raise WireError(ErrorCode.BAD_REQUEST,
                            f"copy needs equal shapes and dtypes: {msg.src.shape} "
                            f"{msg.src.dtype.dtype_name} -> {msg.dst.shape} "
                            f"{msg.dst.dtype.dtype_name}")
        src = self.views.view(session, msg.src)
        dst = self.views.view(session, msg.dst)
        self.backend.copy(dst, src)
        return NO_REPLY
