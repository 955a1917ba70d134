"""The synchronous/futures face of the client: :class:`Client`, :class:`RemoteBuffer`, :class:`RemoteTensor`.

Every command has a blocking method and an ``_async`` twin that returns a
``concurrent.futures.Future`` at once; requests pipeline and run on the worker in the order they
were issued. Socket work belongs to the engine (:mod:`zmq_rpc.client.engine`): its I/O thread, or
the caller's own thread for a blocking call on an idle connection. The objects here are plain
descriptions and may be used from any thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, ParamSpec, TypeVar, cast

import numpy as np
import zmq

from ..broker import graph as wire_graph
from ..broker import protocol as p
from ..broker.errors import (
    AuthenticationFailed,
    BadRequest,
    ConnectionLost,
    OutOfMemory,
    ProtocolError,
    RpcError,
    VersionMismatch,
)
from ..broker.keys import KeyPair
from ..broker.protocol import Cmd, DType, TensorRef, contiguous_strides
from .arrays import RunResult as RunResult
from .arrays import fetched as _fetched
from .arrays import from_bfloat16 as from_bfloat16
from .arrays import to_bfloat16 as to_bfloat16
from .engine import DEFAULT_WINDOW_BYTES, Engine, EngineOptions, RequestTiming, call_together
from .futures import all_of, then
from .graph import Graph
from .peer import HandOff, Routes, copy_between, run_linked
from .peer import receive as receive_hand_off
from .security import resolve_curve

log = logging.getLogger("zmq_rpc.client")

T = TypeVar("T")
P = ParamSpec("P")

DEFAULT_CHUNK = 4 << 20
"""Large tensors travel as requests of at most this many bytes (received straight into place)."""

DTypeLike = str | type | np.dtype[Any] | DType


def as_dtype(dtype: DTypeLike) -> DType:
    """Normalize "float32", np.float32, np.dtype("float32") or a DType."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str):
        return DType.from_name(dtype)
    return DType.from_name(np.dtype(dtype).name)


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
    def client(self) -> Client:
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

    def __init__(self, client: Client, handle: int, size: int, allocation: Future[Any]) -> None:
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
                 window: int = 512, window_bytes: int = DEFAULT_WINDOW_BYTES, heartbeat: float = 2.0,
                 name: str = "zmq-rpc-client", chunk_bytes: int = DEFAULT_CHUNK,
                 peer_copy: bool = True,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 curve_key: str | os.PathLike[str] | KeyPair | None = None,
                 server_key: str | bytes | None = None, trace: bool = False) -> None:
        address, curve = resolve_curve(endpoint, curve_key, server_key)
        self.endpoint = address
        self.peer_copy = peer_copy
        self._routes = Routes()
        self.name = name
        self.timeout = timeout
        self._engine = Engine(address, EngineOptions(
            timeout=timeout, window=window, window_bytes=window_bytes, heartbeat=heartbeat,
            curve=curve, trace=trace), ctx)
        self._handles = itertools.count(1)
        self._handle_lock = threading.Lock()
        try:
            self.info: p.HelloReply = self._hello(connect_timeout)
        except BaseException:
            self._engine.close()
            raise
        self.chunk_bytes = max(4096, min(chunk_bytes, self.info.max_message_size - (64 << 10)))

    def _hello(self, timeout: float) -> p.HelloReply:
        major, minor = p.PROTOCOL_VERSION
        hello = p.Hello(major=major, minor=minor, client=self.name)
        try:
            with self._engine.inline():
                future = self._engine.submit(Cmd.HELLO, hello, timeout=timeout)
            info: p.HelloReply = future.result()
        except RpcError as exc:
            if isinstance(exc, (VersionMismatch, AuthenticationFailed, OutOfMemory)):
                raise          # the worker answered: it refused us (a full worker: OutOfMemory)
            raise ConnectionLost(f"cannot reach a zmq-rpc worker at {self.endpoint}: "
                                 f"{exc.message}") from exc
        if info.major != major:
            raise VersionMismatch(f"worker speaks protocol {info.major}.{info.minor}, "
                                  f"this client {major}.{minor}")
        if self._engine.options.trace:
            self._ask_for_timing(info, timeout)
        return info

    def _ask_for_timing(self, info: p.HelloReply, timeout: float) -> None:
        """A second HELLO asking for the worker's timing in replies (a worker older than 1.5
        would refuse the field, so it is sent only once the first HELLO showed the capability)."""
        if "timing" not in info.capabilities:
            log.warning("%s speaks protocol %d.%d: its replies carry no timing (trace needs "
                        "1.5)", self.endpoint, info.major, info.minor)
            return
        major, minor = p.PROTOCOL_VERSION
        hello = p.Hello(major=major, minor=minor, client=self.name, timing=True)
        self._engine.submit(Cmd.HELLO, hello, timeout=timeout).result()

    def timings(self) -> list[RequestTiming]:
        """Where each traced request's time went since the last call (``trace=True``)."""
        return self._engine.drain_timings()

    # ------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Free this session on the worker, fail pending requests, stop the I/O thread."""
        self._engine.close()

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.endpoint!r}, server={self.info.server!r})"

    # --------------------------------------------------------------------------- plumbing

    def _call(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
              on_reply: Callable[[p.Message, list[zmq.Frame]], Any] | None = None,
              timeout: float | None = None, reply_bytes: int = 0) -> Future[Any]:
        return self._engine.submit(cmd, msg, payload, on_reply or _no_result, timeout, reply_bytes)

    def _sync(self, issue: Callable[P, Future[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """A blocking call: ``issue(...)`` and wait. On an idle connection the request goes out
        and its reply comes back on this thread, with no hop through the I/O thread."""
        return cast(T, self._engine.call(issue, *args, **kwargs))

    def _request(self, cmd: Cmd, msg: p.Message, payload: Sequence[Any] = (),
                 on_reply: Callable[[p.Message, list[zmq.Frame]], Any] | None = None,
                 timeout: float | None = None, reply_bytes: int = 0) -> Any:
        """``_call(...).result()`` for a blocking call of one request: on an idle connection
        it goes out and its reply comes back on this thread, with no future at all."""
        return self._engine.request(cmd, msg, payload, on_reply or _no_result, timeout,
                                    reply_bytes)

    def _new_handle(self) -> int:
        with self._handle_lock:
            return next(self._handles)

    def _own_buffer(self, buffer: RemoteBuffer) -> None:
        if buffer.client is not self:
            raise BadRequest(f"{buffer!r} lives on {buffer.client.endpoint}, not on {self.endpoint}")

    def _own(self, tensor: RemoteTensor) -> None:
        if tensor.buffer.client is not self:
            raise BadRequest(f"{tensor!r} lives on {tensor.client.endpoint}, not on {self.endpoint}")

    # --------------------------------------------------------------------------- commands

    def alloc_buffer(self, size: int) -> RemoteBuffer:
        """Allocate ``size`` bytes on the worker (raises OutOfMemory beyond its limits)."""
        return self._sync(self.alloc_buffer_async, size)

    def alloc_buffer_async(self, size: int) -> Future[RemoteBuffer]:
        """Allocate without waiting; the future resolves to the buffer."""
        buffer = self.alloc_buffer_nowait(size)
        return then(buffer.allocation, lambda _: buffer)

    def alloc_buffer_nowait(self, size: int) -> RemoteBuffer:
        """The buffer object at once, for pipelining: later requests may use it immediately;
        ``buffer.allocation`` is the allocation's future (its error, if any, also fails them)."""
        if size < 0:
            raise BadRequest(f"buffer size must be >= 0, got {size}")
        handle = self._new_handle()
        future = self._call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=handle, size=size))
        return RemoteBuffer(self, handle, size, future)

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
        self._sync(self.set_tensor_async, tensor, values)

    def set_tensor_async(self, tensor: RemoteTensor, values: Any) -> Future[None]:
        """Pipelined upload. Do not modify ``values`` until the future is done (zero-copy send)."""
        self._own(tensor)
        data = _payload_array(tensor, values)
        flat = data.reshape(-1).view(np.uint8)
        parts = [self._call(Cmd.SET_TENSOR, p.SetTensor(tensor=sub),
                            [flat[start:start + sub.nbytes]])
                 for start, sub in p.split_tensor(tensor.ref, self.chunk_bytes)]
        return all_of(parts, lambda: None)

    def get_tensor(self, tensor: RemoteTensor, out: np.ndarray | None = None) -> np.ndarray:
        """Download the view into a new C-ordered numpy array, or into ``out``.

        bfloat16 arrives as float32. ``out`` (C-contiguous, the tensor's shape, its numpy dtype;
        float32 or uint16 bits for bfloat16) receives the bytes straight from the reply frames,
        which saves the allocation and first touch of a fresh array on every large download.
        """
        return self._sync(self.get_tensor_async, tensor, out)

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
                 for start, sub in p.split_tensor(tensor.ref, self.chunk_bytes)]

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
        if src.client is not dst.client:   # both workers' replies read on this thread
            call_together([src.client._engine, dst.client._engine],
                          lambda: copy_between(src, dst))
            return
        self._sync(self.copy_tensor_async, src, dst)

    def copy_tensor_async(self, src: RemoteTensor, dst: RemoteTensor) -> Future[None]:
        if src.client is not dst.client:
            return copy_between(src, dst)
        return src.client._call(Cmd.COPY_TENSOR, p.CopyTensor(src=src.ref, dst=dst.ref))

    def device_memory(self) -> MemoryInfo:
        """Free and total bytes this worker may hand out (all sessions together)."""
        return cast(MemoryInfo, self._request(
            Cmd.DEVICE_MEMORY, p.Empty(),
            on_reply=lambda r, f: MemoryInfo(r.free, r.total)))  # type: ignore[attr-defined]

    def device_memory_async(self) -> Future[MemoryInfo]:
        return self._call(Cmd.DEVICE_MEMORY, p.Empty(),
                          on_reply=lambda r, f: MemoryInfo(r.free, r.total))  # type: ignore[attr-defined]

    def status(self) -> p.StatusReply:
        """What the worker is doing: sessions (other than this one), memory, queue depth,
        uptime, version, capabilities (protocol 1.5; an older worker raises BadRequest)."""
        return self.status_async().result()

    def status_async(self) -> Future[p.StatusReply]:
        if "status" not in self.info.capabilities:
            future: Future[p.StatusReply] = Future()
            future.set_exception(BadRequest(
                f"{self.endpoint} speaks protocol {self.info.major}.{self.info.minor}: STATUS "
                "needs 1.5 (capability 'status')"))
            return future
        return self._call(Cmd.STATUS, p.Empty(), on_reply=lambda reply, frames: reply)

    def synchronize(self) -> None:
        """Return once every request issued before it to this worker has run."""
        self._request(Cmd.SYNCHRONIZE, p.Empty())

    def synchronize_async(self) -> Future[None]:
        return self._call(Cmd.SYNCHRONIZE, p.Empty())

    def ping(self) -> None:
        """One tiny round trip (what the latency benchmark measures)."""
        self._engine.request(Cmd.PING, _EMPTY, (), _no_result)

    def ping_async(self) -> Future[None]:
        return self._call(Cmd.PING, _EMPTY)

    # ----------------------------------------------------------------------------- graphs

    def compute(self, graph: Graph, inputs: Inputs = None,
                fetch: Sequence[RemoteTensor] = (), *, timeout: float | None = None) -> RunResult:
        """Validate and run ``graph`` once on the worker (one message); see :meth:`run`.
        ``timeout``: seconds this request may take (default: the client's ``timeout``)."""
        return self._sync(self.compute_async, graph, inputs, fetch, timeout=timeout)

    def compute_async(self, graph: Graph, inputs: Inputs = None,
                      fetch: Sequence[RemoteTensor] = (), *,
                      timeout: float | None = None) -> Future[RunResult]:
        self._own_graph(graph)
        refs, frames = self._graph_inputs(inputs)
        msg = wire_graph.GraphCompute(graph=graph.spec(), inputs=refs,
                                      fetch=[self._ref(t) for t in fetch])
        return self._call(Cmd.GRAPH_COMPUTE, msg, frames, on_reply=_fetched(fetch),
                          timeout=timeout)

    def register(self, graph: Graph) -> RegisteredGraph:
        """Validate ``graph`` on the worker and keep it (and its scratch arena) for :meth:`run`."""
        return self._sync(self.register_async, graph)

    def register_async(self, graph: Graph) -> Future[RegisteredGraph]:
        self._own_graph(graph)
        handle = RegisteredGraph(self, self._new_handle(), graph)
        future = self._call(Cmd.GRAPH_REGISTER,
                            wire_graph.GraphRegister(handle=handle.handle, graph=graph.spec()))
        return then(future, lambda _: handle)

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
        return self._sync(self.run_async, graph, inputs, fetch, receive=receive, send=send,
                              hold_reply=hold_reply)

    def run_async(self, graph: RegisteredGraph, inputs: Inputs = None,
                  fetch: Sequence[RemoteTensor] = (), *, receive: Sequence[HandOff] = (),
                  send: Sequence[HandOff] = (), hold_reply: float = 0.0) -> Future[RunResult]:
        if graph.client is not self:
            raise BadRequest("that graph is registered on another worker")
        refs, frames = self._graph_inputs(inputs)
        fetch_refs = [self._ref(t) for t in fetch]
        if receive or send:
            return run_linked(self, graph, refs, frames, fetch, receive, send, hold_reply)
        msg = wire_graph.GraphRun(handle=graph.handle, inputs=refs, fetch=fetch_refs)
        return self._call(Cmd.GRAPH_RUN, msg, frames, on_reply=_fetched(fetch))

    def free_graph(self, graph: RegisteredGraph) -> None:
        """Release a registered graph and its scratch arena on the worker."""
        self._sync(self.free_graph_async, graph)

    def free_graph_async(self, graph: RegisteredGraph) -> Future[None]:
        if graph.client is not self:
            raise BadRequest("that graph is registered on another worker")
        return self._call(Cmd.GRAPH_FREE, p.BufferOp(handle=graph.handle))

    def receive(self, hand_off: HandOff) -> None:
        """Land a hand-off that no run of this worker receives (see :meth:`run`)."""
        self._sync(self.receive_async, hand_off)

    def receive_async(self, hand_off: HandOff) -> Future[None]:
        return receive_hand_off(self, hand_off)

    def _own_graph(self, graph: Graph) -> None:
        if graph.client is not None and graph.client is not self:
            raise BadRequest(f"that graph uses tensors of {graph.client.endpoint}, "
                             f"not of {self.endpoint}")

    def _ref(self, tensor: RemoteTensor) -> TensorRef:
        self._own(tensor)
        return tensor.ref

    def _graph_inputs(self, inputs: Inputs) -> tuple[list[TensorRef], list[np.ndarray]]:
        pairs = list(inputs.items()) if isinstance(inputs, dict) else list(inputs or ())
        refs = [self._ref(t) for t, _ in pairs]
        frames = [_payload_array(t, v).reshape(-1).view(np.uint8) for t, v in pairs]
        total = sum(f.nbytes for f in frames)
        if total > self.chunk_bytes:
            raise BadRequest(f"{total} bytes of graph inputs in one message; upload inputs over "
                             f"{self.chunk_bytes} bytes with set_tensor_async first")
        return refs, frames


class RegisteredGraph:
    """A graph kept by the worker under a client-chosen handle; ``client.run(g)`` reruns it."""

    __slots__ = ("client", "handle", "graph")

    def __init__(self, client: Client, handle: int, graph: Graph) -> None:
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


_EMPTY = p.Empty()
"""The fields of a request that has none (messages are frozen: one instance serves all)."""


def _no_result(reply: p.Message, frames: list[zmq.Frame]) -> None:
    """The result of a request that returns nothing."""
    return None


def _payload_array(tensor: RemoteTensor, values: Any) -> np.ndarray:
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


def _check_out(tensor: RemoteTensor, out: np.ndarray, storage: np.dtype[Any]) -> None:
    allowed = {storage} | ({np.dtype(np.float32)} if tensor.ref.dtype is DType.BFLOAT16 else set())
    if out.shape != tensor.shape or out.dtype not in allowed:
        raise BadRequest(f"out= must have shape {tensor.shape} and dtype "
                         f"{' or '.join(sorted(d.name for d in allowed))}, got {out.shape} {out.dtype}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise BadRequest("out= must be a writeable C-contiguous array")
