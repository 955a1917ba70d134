"""The zmq-rpc client library: remote buffers, tensors and graphs on zmq-rpc workers.

Public API: :class:`Client` (blocking methods and ``_async`` twins returning
``concurrent.futures.Future``), :class:`AsyncClient` (asyncio), :class:`RemoteBuffer`,
:class:`RemoteTensor`, and the exception tree re-exported from :mod:`zmq_rpc.broker.errors`.

Module map (thread that runs it):

- ``client``: :class:`Client`, the futures face (any thread): ``connection`` (HELLO, the
  session's life, issuing requests), ``tensor_calls`` (buffers and tensor bytes), ``graph_calls``
  (graphs and linked runs); ``remote`` the handles they hand out (plain data, any thread).
- ``aio``: :class:`AsyncClient`, the asyncio face over the same engine (the event loop's thread).
- ``engine``: one worker connection: submit, the I/O thread, close (any thread submits; the
  I/O thread runs it). Whoever holds its socket lock drives the connection: ``io_loop``
  (backlog, in flight, send and receive rounds), ``link`` (the DEALER, monitor, handshake,
  keep-alive), ``deadlines`` (timers, socket-free), ``calls`` (what passes between threads),
  ``handover`` (a blocking call takes the idle connection, and gives it back; an Ack's round
  trip), ``inline`` (a synchronous call driven on the caller's own thread).
- ``futures``: future combinators and the lean ``RunningFuture`` (callbacks run on the thread
  that settles them, usually the I/O thread).
- ``peer``: worker-to-worker copies and hand-offs (any thread; route state under a lock).
- ``graph``: graph building (plain data, any thread). ``pipeline``: stages over workers (the
  caller's thread). ``llama``: a llama GGUF across workers (the caller's thread; see its map).
- ``files``, ``gguf_file``, ``gguf_model``, ``tokenizer``: model files and the worker-side
  file reads and cache (the caller's thread). ``security``, ``arrays``: pure helpers.
"""

from ..broker.errors import (
    AuthenticationFailed,
    BadEndpoint,
    BadRequest,
    ClientClosed,
    ConnectionLost,
    GraphError,
    InvalidHandle,
    ModelFileError,
    NotAuthentic,
    OutOfBounds,
    OutOfMemory,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    RpcError,
    SessionLost,
    Timeout,
    TransferError,
    TransportError,
    VersionMismatch,
)
from ..broker.ops import OpError
from .aio import AsyncClient
from .calls import RequestTiming
from .client import (
    Client,
    MemoryInfo,
    RegisteredGraph,
    RemoteBuffer,
    RemoteTensor,
    RunResult,
    from_bfloat16,
    to_bfloat16,
)
from .graph import Graph, GraphTensor
from .peer import HandOff, hand_off

__all__ = [
    "AsyncClient", "Client", "Graph", "GraphTensor", "HandOff", "MemoryInfo", "OpError",
    "RegisteredGraph", "RequestTiming", "RunResult", "RemoteBuffer", "RemoteTensor", "from_bfloat16", "hand_off",
    "to_bfloat16", "AuthenticationFailed", "BadEndpoint", "BadRequest", "ClientClosed",
    "ConnectionLost", "GraphError", "InvalidHandle", "ModelFileError", "NotAuthentic", "OutOfBounds", "OutOfMemory", "PeerUnreachable",
    "ProtocolError",
    "RemoteError", "RpcError", "SessionLost", "Timeout", "TransferError", "TransportError",
    "VersionMismatch",
]
