"""The synchronous/futures face of the client: :class:`Client`, and the handles it hands out.

Every command has a blocking method and an ``_async`` twin that returns a
``concurrent.futures.Future`` at once; requests pipeline and run on the worker in the order they
were issued. Any thread may call in; socket work belongs to the worker's
:class:`~zmq_rpc.client.connection.Connection` (its I/O thread, or the caller's own thread for a
blocking call on an idle connection).

:class:`Client` composes one object per job, each built on the same
:class:`~zmq_rpc.client.session.Session` (the connection, HELLO, what the worker said):
:class:`~zmq_rpc.client.tensor_calls.TensorCalls` (buffers and tensor bytes) and
:class:`~zmq_rpc.client.graph_calls.GraphCalls` (graphs and linked runs); what the worker says
about itself (memory, status, ping) is here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import zmq

from ..broker import protocol as p
from ..broker.errors import BadRequest
from ..broker.keys import KeyPair
from ..broker.protocol import Cmd
from .arrays import RunResult as RunResult
from .arrays import from_bfloat16 as from_bfloat16
from .arrays import to_bfloat16 as to_bfloat16
from .calls import EMPTY, RequestTiming, no_result
from .connection import Connection
from .futures import failed
from .graph import Graph
from .graph_calls import GraphCalls
from .options import DEFAULT_WINDOW_BYTES
from .peer import HandOff
from .remote import DTypeLike as DTypeLike
from .remote import Inputs as Inputs
from .remote import MemoryInfo as MemoryInfo
from .remote import RegisteredGraph as RegisteredGraph
from .remote import RemoteBuffer as RemoteBuffer
from .remote import RemoteTensor as RemoteTensor
from .remote import as_dtype as as_dtype
from .session import DEFAULT_CHUNK as DEFAULT_CHUNK
from .session import Session
from .tensor_calls import TensorCalls


class Client:
    """A connection to one worker and a session on it.

    ``with Client("tcp://127.0.0.1:50052") as c: ...`` — ``close()`` frees the session's buffers on
    the worker and fails anything still pending with ``ClientClosed``.

    ``endpoint`` is ``tcp://host:port``, ``ipc://path`` or ``inproc://name`` (else
    :class:`BadEndpoint`). ``connect_timeout``: seconds to reach the worker and say HELLO (else
    ``ConnectionLost``). ``timeout``: seconds each request may take. A worker that dies, freezes
    or becomes unreachable fails every pending and new request with ``ConnectionLost`` within
    about 6 s (the heartbeat timeout + 1 s; at once when its process dies on this host); a worker
    that lost this session (restarted at the same address) fails them with ``SessionLost``. A
    failed constructor leaves no socket, thread or context behind.

    A worker run with ``--curve-secret-key`` needs ``curve_key`` (this client's ``.key_secret``
    file, or ``$ZMQ_RPC_CURVE_SECRET_KEY``) and the worker's public key: in the endpoint
    (``tcp://h:p#curve=KEY``), as ``server_key`` (text or ``.key`` file) or
    ``$ZMQ_RPC_SERVER_KEY``. A refused key fails at once with ``AuthenticationFailed``.

    ``trace=True`` records where each request's time went (:meth:`timings`): queued on the
    client, on the wire, queued on the worker, running there, and back; the worker reports its
    part in each reply (protocol 1.5; an older worker's requests are not traced).
    """

    def __init__(self, endpoint: str, *, timeout: float = 60.0, connect_timeout: float = 10.0,
                 window: int = 512, window_bytes: int = DEFAULT_WINDOW_BYTES,
                 heartbeat: float = 2.0, name: str = "zmq-rpc-client",
                 chunk_bytes: int = DEFAULT_CHUNK, peer_copy: bool = True,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 curve_key: str | os.PathLike[str] | KeyPair | None = None,
                 server_key: str | bytes | None = None, trace: bool = False) -> None:
        self.session = Session(
            endpoint, timeout=timeout, connect_timeout=connect_timeout, window=window,
            window_bytes=window_bytes, heartbeat=heartbeat, name=name, chunk_bytes=chunk_bytes,
            peer_copy=peer_copy, ctx=ctx, curve_key=curve_key, server_key=server_key,
            trace=trace)
        """The worker, the session on it and its connection (what the call modules share)."""
        self._tensors = TensorCalls(self.session, self)
        self._graphs = GraphCalls(self.session, self)

    # ---------------------------------------------------------------- the session

    @property
    def connection(self) -> Connection:
        """The worker connection every request of this client goes through."""
        return self.session.connection

    @property
    def endpoint(self) -> str:
        return self.session.endpoint

    @property
    def info(self) -> p.HelloReply:
        """The worker's HELLO reply: its protocol version, capabilities, limits."""
        return self.session.info

    @info.setter
    def info(self, info: p.HelloReply) -> None:
        self.session.info = info

    @property
    def draining(self) -> bool:
        """The worker said it is leaving (it got SIGTERM; protocol 1.14, capability
        ``draining``): it answers every request until its sessions close or its
        ``--drain-timeout`` passes, and refuses new sessions. Learned from any reply (a graph
        run's, a ping's, the idle heartbeat's); a model moves its layers off it at its next
        step (:mod:`zmq_rpc.client.llama.membership`)."""
        return self.connection.draining.is_set()

    @property
    def name(self) -> str:
        return self.session.name

    @property
    def timeout(self) -> float:
        """Seconds each request may take (as passed to the constructor)."""
        return self.session.timeout

    @timeout.setter
    def timeout(self, timeout: float) -> None:
        self.session.timeout = timeout

    @property
    def chunk_bytes(self) -> int:
        """Large tensors travel as requests of at most this many bytes."""
        return self.session.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, chunk_bytes: int) -> None:
        self.session.chunk_bytes = chunk_bytes

    @property
    def peer_copy(self) -> bool:
        """Whether copies between workers may go worker to worker."""
        return self.session.peer_copy

    @peer_copy.setter
    def peer_copy(self, peer_copy: bool) -> None:
        self.session.peer_copy = peer_copy

    @property
    def reconnect_refused(self) -> bool:
        """The connection is down and the worker's address refused a reconnection since: no
        process listens there (killed, or not restarted yet), as opposed to a worker that is
        slow or frozen (its host still accepts the connection)."""
        return self.session.connection.reconnect_refused()

    def timings(self) -> list[RequestTiming]:
        """Where each traced request's time went since the last call (``trace=True``)."""
        return self.session.connection.drain_timings()

    def close(self) -> None:
        """Free this session on the worker, fail pending requests, stop the I/O thread."""
        self.session.close()

    @property
    def closed(self) -> bool:
        return self.session.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.endpoint!r}, server={self.info.server!r})"

    # ------------------------------------------------------- buffers and tensors

    def alloc_buffer(self, size: int) -> RemoteBuffer:
        """Allocate ``size`` bytes on the worker (raises OutOfMemory beyond its limits)."""
        return self._tensors.alloc_buffer(size)

    def alloc_buffer_async(self, size: int) -> Future[RemoteBuffer]:
        """Allocate without waiting; the future resolves to the buffer."""
        return self._tensors.alloc_buffer_async(size)

    def alloc_buffer_nowait(self, size: int) -> RemoteBuffer:
        """The buffer object at once, for pipelining: later requests may use it immediately;
        ``buffer.allocation`` is the allocation's future (its error, if any, also fails them)."""
        return self._tensors.alloc_buffer_nowait(size)

    def free_buffer(self, buffer: RemoteBuffer) -> None:
        """Free a buffer now (the session frees the rest when the client closes)."""
        return self._tensors.free_buffer(buffer)

    def free_buffer_async(self, buffer: RemoteBuffer) -> Future[None]:
        return self._tensors.free_buffer_async(buffer)

    def clear_buffer(self, buffer: RemoteBuffer, value: int = 0) -> None:
        """Set every byte of the buffer to ``value`` (0..255)."""
        return self._tensors.clear_buffer(buffer, value)

    def clear_buffer_async(self, buffer: RemoteBuffer, value: int = 0) -> Future[None]:
        return self._tensors.clear_buffer_async(buffer, value)

    def set_tensor(self, tensor: RemoteTensor, values: Any) -> None:
        """Upload ``values`` (same shape; same dtype, or float32 into bfloat16) into the view."""
        return self._tensors.set_tensor(tensor, values)

    def set_tensor_async(self, tensor: RemoteTensor, values: Any) -> Future[None]:
        """Pipelined upload. Do not modify ``values`` until the future is done (zero-copy send)."""
        return self._tensors.set_tensor_async(tensor, values)

    def get_tensor(self, tensor: RemoteTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Download the view into a new C-ordered numpy array, or into ``out``.

        bfloat16 arrives as float32. ``out`` (C-contiguous, the tensor's shape, its numpy dtype;
        float32 or uint16 bits for bfloat16) receives the bytes straight from the reply frames,
        which saves the allocation and first touch of a fresh array on every large download.
        """
        return self._tensors.get_tensor(tensor, out)

    def get_tensor_async(self, tensor: RemoteTensor,
                         out: np.ndarray | None = None) -> Future[np.ndarray]:
        return self._tensors.get_tensor_async(tensor, out)

    def memset_tensor(self, tensor: RemoteTensor, value: int, offset: int = 0,
                      size: int | None = None) -> None:
        """Set bytes [offset, offset+size) of the tensor's data to ``value`` (0..255)."""
        return self._tensors.memset_tensor(tensor, value, offset, size)

    def memset_tensor_async(self, tensor: RemoteTensor, value: int, offset: int = 0,
                            size: int | None = None) -> Future[None]:
        return self._tensors.memset_tensor_async(tensor, value, offset, size)

    def copy_tensor(self, src: RemoteTensor, dst: RemoteTensor) -> None:
        """dst[...] = src (same shape and dtype), on one worker or across two.

        Across workers, src's worker pushes the bytes straight to dst's worker (the client never
        touches them) and dst's worker runs nothing else of this client's until they have landed.
        """
        return self._tensors.copy_tensor(src, dst)

    def copy_tensor_async(self, src: RemoteTensor, dst: RemoteTensor) -> Future[None]:
        return self._tensors.copy_tensor_async(src, dst)

    # -------------------------------------------------------------------- graphs

    def compute(self, graph: Graph, inputs: Inputs = None,
                fetch: Sequence[RemoteTensor] = (), *, timeout: float | None = None) -> RunResult:
        """Validate and run ``graph`` once on the worker (one message); see :meth:`run`.
        ``timeout``: seconds this request may take (default: the client's ``timeout``)."""
        return self._graphs.compute(graph, inputs, fetch, timeout=timeout)

    def compute_async(self, graph: Graph, inputs: Inputs = None,
                      fetch: Sequence[RemoteTensor] = (), *,
                      timeout: float | None = None) -> Future[RunResult]:
        return self._graphs.compute_async(graph, inputs, fetch, timeout=timeout)

    def register(self, graph: Graph) -> RegisteredGraph:
        """Validate ``graph`` on the worker and keep it (and its scratch arena) for :meth:`run`."""
        return self._graphs.register(graph)

    def register_async(self, graph: Graph) -> Future[RegisteredGraph]:
        return self._graphs.register_async(graph)

    def run(self, graph: RegisteredGraph, inputs: Inputs = None,
            fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
            send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> RunResult:
        """Rerun a registered graph with one small message.

        ``inputs`` (pairs of RemoteTensor and array, or a dict) are written first, in the same
        message; the arrays of the ``fetch`` tensors come back in the reply, after the run.
        ``receive`` and ``send`` are hand-offs (:func:`zmq_rpc.client.hand_off`) from and to
        other workers' runs: the run waits for the first and pushes the second, in the same one
        message (issue the sending run before the receiving one).

        ``hold_reply`` (seconds, at most 1) lets the worker keep a run's reply back that long
        after pushing its sends, when what it fetches is small (<= 64 KiB; it goes out sooner
        if another reply does): a client that pipelines runs and is not waiting on this one
        keeps the reply's wake-ups (broker, network, this process) off the CPUs the hand-off
        needs next. Workers without the ``held-replies`` capability reply at once.
        """
        return self._graphs.run(graph, inputs, fetch,
                                receive=receive, send=send, hold_reply=hold_reply)

    def run_async(self, graph: RegisteredGraph, inputs: Inputs = None,
                  fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
                  send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> Future[RunResult]:
        return self._graphs.run_async(graph, inputs, fetch,
                                      receive=receive, send=send, hold_reply=hold_reply)

    def free_graph(self, graph: RegisteredGraph) -> None:
        """Release a registered graph and its scratch arena on the worker."""
        return self._graphs.free_graph(graph)

    def free_graph_async(self, graph: RegisteredGraph) -> Future[None]:
        return self._graphs.free_graph_async(graph)

    def receive(self, hand_off: HandOff) -> None:
        """Land a hand-off that no run of this worker receives (see :meth:`run`)."""
        return self._graphs.receive(hand_off)

    def receive_async(self, hand_off: HandOff) -> Future[None]:
        return self._graphs.receive_async(hand_off)

    # -------------------------------------------------------------- the worker itself

    def device_memory(self) -> MemoryInfo:
        """Free and total bytes this worker may hand out (all sessions together)."""
        info: MemoryInfo = self.session.connection.request(Cmd.DEVICE_MEMORY, EMPTY, (),
                                                           _memory_info)
        return info

    def device_memory_async(self) -> Future[MemoryInfo]:
        return self.connection.call(Cmd.DEVICE_MEMORY, EMPTY, on_reply=_memory_info)

    def status(self) -> p.StatusReply:
        """What the worker is doing: sessions (other than this one), memory, queue depth,
        uptime, version, capabilities (protocol 1.5; an older worker raises BadRequest)."""
        return self.status_async().result()

    def status_async(self) -> Future[p.StatusReply]:
        if "status" not in self.info.capabilities:
            return failed(BadRequest(
                f"{self.endpoint} speaks protocol {self.info.major}.{self.info.minor}: STATUS "
                "needs 1.5 (capability 'status')"))
        return self.connection.call(Cmd.STATUS, EMPTY)

    def synchronize(self) -> None:
        """Return once every request issued before it to this worker has run."""
        self.session.connection.request(Cmd.SYNCHRONIZE, EMPTY, (), no_result)

    def synchronize_async(self) -> Future[None]:
        return self.connection.call(Cmd.SYNCHRONIZE, EMPTY, on_reply=no_result)

    def ping(self) -> None:
        """One tiny round trip (what the latency benchmark measures)."""
        self.session.connection.request(Cmd.PING, EMPTY, (), no_result)

    def ping_async(self) -> Future[None]:
        return self.connection.call(Cmd.PING, EMPTY, on_reply=no_result)


def _memory_info(reply: Any, frames: Sequence[Any]) -> MemoryInfo:
    return MemoryInfo(reply.free, reply.total)

