"""The asyncio face of the client: the same engine as :class:`~zmq_rpc.client.Client`, awaited.

Every coroutine wraps the futures-based twin with ``asyncio.wrap_future``: one engine, one I/O
thread, no event-loop integration of its own, so it runs under any asyncio loop. Use from one event
loop; the underlying client may be shared with threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

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
    """``async with await AsyncClient.connect(endpoint) as c: await c.set_tensor(t, a)``."""

    def __init__(self, client: Client) -> None:
        self.sync = client

    @classmethod
    async def connect(cls, endpoint: str, **options: Any) -> AsyncClient:
        """Connect and say HELLO without blocking the event loop."""
        return cls(await asyncio.to_thread(Client, endpoint, **options))

    @property
    def info(self) -> Any:
        return self.sync.info

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def alloc_buffer(self, size: int) -> RemoteBuffer:
        return await asyncio.wrap_future(self.sync.alloc_buffer_async(size))

    async def free_buffer(self, buffer: RemoteBuffer) -> None:
        await asyncio.wrap_future(buffer.free_async())

    async def clear_buffer(self, buffer: RemoteBuffer, value: int = 0) -> None:
        await asyncio.wrap_future(buffer.clear_async(value))

    async def set_tensor(self, tensor: RemoteTensor, values: Any) -> None:
        await asyncio.wrap_future(self.sync.set_tensor_async(tensor, values))

    async def get_tensor(self, tensor: RemoteTensor) -> np.ndarray:
        return await asyncio.wrap_future(self.sync.get_tensor_async(tensor))

    async def memset_tensor(self, tensor: RemoteTensor, value: int, offset: int = 0,
                            size: int | None = None) -> None:
        await asyncio.wrap_future(self.sync.memset_tensor_async(tensor, value, offset, size))

    async def copy_tensor(self, src: RemoteTensor, dst: RemoteTensor) -> None:
        await asyncio.wrap_future(self.sync.copy_tensor_async(src, dst))

    async def device_memory(self) -> MemoryInfo:
        return await asyncio.wrap_future(self.sync.device_memory_async())

    async def synchronize(self) -> None:
        await asyncio.wrap_future(self.sync.synchronize_async())

    async def ping(self) -> None:
        await asyncio.wrap_future(self.sync.ping_async())

    async def compute(self, graph: Graph, inputs: Inputs = None,
                      fetch: Sequence[RemoteTensor] = ()) -> RunResult:
        """Validate and run ``graph`` once (see :meth:`Client.compute`)."""
        return await asyncio.wrap_future(self.sync.compute_async(graph, inputs, fetch))

    async def register(self, graph: Graph) -> RegisteredGraph:
        """Keep ``graph`` on the worker for :meth:`run` (see :meth:`Client.register`)."""
        return await asyncio.wrap_future(self.sync.register_async(graph))

    def run(self, graph: RegisteredGraph, inputs: Inputs = None,
            fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
            send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> asyncio.Future[RunResult]:
        """Rerun a registered graph, with its hand-offs (see :meth:`Client.run`); await the
        result. Unlike the coroutines here, the run is issued when this is called, so that
        ``a_run = a.run(g1, send=[h])`` then ``b_run = b.run(g2, receive=[h])`` issues the
        sender first, as linked runs need (call it from the event loop's thread)."""
        return asyncio.wrap_future(self.sync.run_async(graph, inputs, fetch, receive=receive,
                                                       send=send, hold_reply=hold_reply))

    async def receive(self, hand_off: HandOff) -> None:
        """Land a hand-off that no run of this worker receives."""
        await asyncio.wrap_future(self.sync.receive_async(hand_off))

    async def free_graph(self, graph: RegisteredGraph) -> None:
        await asyncio.wrap_future(graph.free_async())

    async def gather_set(self, pairs: Sequence[tuple[RemoteTensor, Any]]) -> None:
        """Upload several tensors, pipelined."""
        await asyncio.gather(*(self.set_tensor(t, v) for t, v in pairs))
