"""The zmq-rpc client library: remote buffers, tensors and graphs on zmq-rpc workers.

Public API: :class:`Client` (blocking methods and ``_async`` twins returning
``concurrent.futures.Future``), :class:`AsyncClient` (asyncio), :class:`RemoteBuffer`,
:class:`RemoteTensor`, and the exception tree re-exported from :mod:`zmq_rpc.broker.errors`.

Module map, in layers (each imports only from the layers below it; thread that runs it):

- ``client``: :class:`Client`, the futures face (any thread), composed of ``tensor_calls``
  (buffers and tensor bytes) and ``graph_calls`` (graphs and linked runs) over one ``session``;
  ``aio``: :class:`AsyncClient`, the asyncio face over the same client (the event loop's
  thread); ``pipeline``: stages over workers (the caller's thread); ``llama``: a llama GGUF
  across workers (the caller's thread; see its map).
- ``peer`` (worker-to-worker copies and hand-offs), ``files`` (worker-side file reads, the
  workers' tensor cache, file hashes): request helpers over a handle's client's session (any
  thread); ``remote``: the handles the calls hand out, and ``Owner``, what they ask of their
  client (plain data, any thread).
- ``session``: one worker session: the connection, HELLO, what the calls share (built on the
  caller's thread, then read from any); ``routes``: which peers a worker reaches (under a lock).
- ``connection``: :class:`~.connection.Connection`, one per worker: the public ``call`` (a
  future), ``request`` and ``result_of`` (blocking), ``reserve``/``filling``, ``close``; it owns
  the I/O thread, the ``mailbox`` (inbox, wake-up, submit lock; any thread posts) and the
  ``loop`` (backlog, in flight, the send/receive/timeout rounds), run by whoever holds its
  socket lock: the I/O thread, or a blocking caller on an idle connection. The loop owns the
  ``link`` (the DEALER, its monitor, handshake, keep-alive) and the ``deadlines`` (timers).
- Leaves: ``calls`` (what passes between threads), ``options`` (connection options, endpoint
  check), ``futures`` (combinators over ``concurrent.futures.Future``; callbacks run on the
  thread that settles them), ``graph`` (graph building), ``arrays``, ``security``,
  ``gguf_file``, ``gguf_model``, ``tokenizer`` (pure helpers and model files).
"""

from typing import TYPE_CHECKING

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
    RecoveryFailed,
    RemoteError,
    RpcError,
    SessionLost,
    Timeout,
    TransferError,
    TransportError,
    VersionMismatch,
)
from ..broker.ops import OpError
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

if TYPE_CHECKING:
    from .aio import AsyncClient


def __getattr__(name: str) -> object:
    """:class:`AsyncClient` is imported on first use: asyncio's ~45 ms of imports are paid by
    the programs that use it, not by every blocking client (``generate``'s start-up)."""
    if name == "AsyncClient":
        from .aio import AsyncClient
        return AsyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AsyncClient", "Client", "Graph", "GraphTensor", "HandOff", "MemoryInfo", "OpError",
    "RegisteredGraph", "RequestTiming", "RunResult", "RemoteBuffer", "RemoteTensor", "from_bfloat16", "hand_off",
    "to_bfloat16", "AuthenticationFailed", "BadEndpoint", "BadRequest", "ClientClosed",
    "ConnectionLost", "GraphError", "InvalidHandle", "ModelFileError", "NotAuthentic", "OutOfBounds", "OutOfMemory", "PeerUnreachable",
    "ProtocolError",
    "RecoveryFailed", "RemoteError", "RpcError", "SessionLost", "Timeout", "TransferError", "TransportError",
    "VersionMismatch",
]
