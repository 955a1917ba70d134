"""The zmq-rpc client library: remote buffers, tensors and (later) graphs on zmq-rpc workers.

Public API: :class:`Client` (blocking methods and ``_async`` twins returning
``concurrent.futures.Future``), :class:`AsyncClient` (asyncio), :class:`RemoteBuffer`,
:class:`RemoteTensor`, and the exception tree re-exported from :mod:`zmq_rpc.broker.errors`.
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
    OutOfBounds,
    OutOfMemory,
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
from .engine import RequestTiming
from .graph import Graph, GraphTensor
from .peer import HandOff, hand_off

__all__ = [
    "AsyncClient", "Client", "Graph", "GraphTensor", "HandOff", "MemoryInfo", "OpError",
    "RegisteredGraph", "RequestTiming", "RunResult", "RemoteBuffer", "RemoteTensor", "from_bfloat16", "hand_off",
    "to_bfloat16", "AuthenticationFailed", "BadEndpoint", "BadRequest", "ClientClosed",
    "ConnectionLost", "GraphError", "InvalidHandle", "ModelFileError", "OutOfBounds", "OutOfMemory", "ProtocolError",
    "RemoteError", "RpcError", "SessionLost", "Timeout", "TransferError", "TransportError",
    "VersionMismatch",
]
