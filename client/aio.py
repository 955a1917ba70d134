"""The asyncio face of the client: the same :class:`~zmq_rpc.client.Client`, awaited.

Every coroutine issues its request through the futures-based twin (``Client.<name>_async``) and
awaits it with ``asyncio.wrap_future``: one connection, one I/O thread, no event-loop integration of
its own, so it runs under any asyncio loop. A request is issued when its coroutine starts to run,
so tasks started in order issue in order (``asyncio.gather(a.run(g1, send=[h]), b.run(g2,
receive=[h]))`` issues the sender first, as linked runs need). Use from one event loop; the
underlying client may be shared with threads.

The two faces stay in step: ``tests/test_client.py`` fails when a public method or a parameter
exists on one and not on the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..broker import protocol as p
from .calls import RequestTiming
from .client import (
    Client,
    Inputs,
    MemoryInfo,
    RegisteredGraph,
    RemoteBuffer,
    RemoteTensor,
    RunResult,
)
from .graph import Graph
from .peer import HandOff


class AsyncClient:
    """``async with await AsyncClient.connect(endpoint) as c: await c.set_tensor(t, a)``.

    Each coroutine is the awaited twin of the :class:`Client` method of the same name (same
    parameters, same errors).
    """

    def __init__(self, client: Client) -> None:
        self.sync = client

    @classmethod
    async def connect(cls, endpoint: str, **options: Any) -> AsyncClient:
        """Connect and say HELLO without blocking the event loop (options as for
        :class:`Client`)."""
        return cls(await asyncio.to_thread(Client, endpoint, **options))

    @property
    def info(self) -> p.HelloReply:
        return self.sync.info

    @property
    def endpoint(self) -> str:
        return self.sync.endpoint

    @property
    def closed(self) -> bool:
        return self.sync.closed

    @property
    def draining(self) -> bool:
        """The worker said it is leaving (see :attr:`Client.draining`)."""
        return self.sync.draining

    async def close(self) -> None:
        """Free this session on the worker, fail pending requests, stop the I/O thread."""
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------------- buffers

    async def alloc_buffer(self, size: int) -> RemoteBuffer:
        """Allocate ``size`` bytes on the worker (raises OutOfMemory beyond its limits)."""
        return await asyncio.wrap_future(self.sync.alloc_buffer_async(size))

    def alloc_buffer_nowait(self, size: int) -> RemoteBuffer:
        """The buffer object at once, for pipelining (see :meth:`Client.alloc_buffer_nowait`)."""
        return self.sync.alloc_buffer_nowait(size)

    async def free_buffer(self, buffer: RemoteBuffer) -> None:
        """Free a buffer now."""
        await asyncio.wrap_future(self.sync.free_buffer_async(buffer))

    async def clear_buffer(self, buffer: RemoteBuffer, value: int = 0) -> None:
        """Set every byte of the buffer to ``value`` (0..255)."""
        await asyncio.wrap_future(self.sync.clear_buffer_async(buffer, value))

    # ---------------------------------------------------------------------- tensors

    async def set_tensor(self, tensor: RemoteTensor, values: Any) -> None:
        """Upload ``values`` into the view (do not modify them until this returns)."""
        await asyncio.wrap_future(self.sync.set_tensor_async(tensor, values))

    async def get_tensor(self, tensor: RemoteTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Download the view into a new array, or into ``out`` (see :meth:`Client.get_tensor`)."""
        return await asyncio.wrap_future(self.sync.get_tensor_async(tensor, out))

    async def memset_tensor(self, tensor: RemoteTensor, value: int, offset: int = 0,
                            size: int | None = None) -> None:
        """Set bytes [offset, offset+size) of the tensor's data to ``value``."""
        await asyncio.wrap_future(self.sync.memset_tensor_async(tensor, value, offset, size))

    async def copy_tensor(self, src: RemoteTensor, dst: RemoteTensor) -> None:
        """dst[...] = src, on one worker or across two (see :meth:`Client.copy_tensor`)."""
        await asyncio.wrap_future(self.sync.copy_tensor_async(src, dst))

    async def device_memory(self) -> MemoryInfo:
        """Free and total bytes this worker may hand out."""
        return await asyncio.wrap_future(self.sync.device_memory_async())

    async def synchronize(self) -> None:
        """Return once every request issued before it to this worker has run."""
        await asyncio.wrap_future(self.sync.synchronize_async())

    async def ping(self) -> None:
        """One tiny round trip."""
        await asyncio.wrap_future(self.sync.ping_async())

    async def status(self) -> p.StatusReply:
        """What the worker is doing (see :meth:`Client.status`)."""
        return await asyncio.wrap_future(self.sync.status_async())

    @property
    def reconnect_refused(self) -> bool:
        """The connection is down and the worker's address refused a reconnection since (see
        :attr:`Client.reconnect_refused`)."""
        return self.sync.reconnect_refused

    def timings(self) -> list[RequestTiming]:
        """Where each traced request's time went since the last call (never blocks)."""
        return self.sync.timings()

    # ----------------------------------------------------------------------- graphs

    async def compute(self, graph: Graph, inputs: Inputs = None,
                      fetch: Sequence[RemoteTensor] = (), *,
                      timeout: float | None = None) -> RunResult:
        """Validate and run ``graph`` once (see :meth:`Client.compute`)."""
        return await asyncio.wrap_future(self.sync.compute_async(graph, inputs, fetch,
                                                                 timeout=timeout))

    async def register(self, graph: Graph) -> RegisteredGraph:
        """Keep ``graph`` on the worker for :meth:`run` (see :meth:`Client.register`)."""
        return await asyncio.wrap_future(self.sync.register_async(graph))

    async def run(self, graph: RegisteredGraph, inputs: Inputs = None,
                  fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
                  send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> RunResult:
        """Rerun a registered graph, with its hand-offs (see :meth:`Client.run`). Issued when
        the coroutine starts: start the sending run's task before the receiving one's."""
        return await asyncio.wrap_future(self.sync.run_async(
            graph, inputs, fetch, receive=receive, send=send, hold_reply=hold_reply))

    async def free_graph(self, graph: RegisteredGraph) -> None:
        """Release a registered graph and its scratch arena on the worker."""
        await asyncio.wrap_future(self.sync.free_graph_async(graph))

    async def receive(self, hand_off: HandOff) -> None:
        """Land a hand-off that no run of this worker receives."""
        await asyncio.wrap_future(self.sync.receive_async(hand_off))
