"""The exception tree of zmq-rpc, shared by the client and the worker.

Plain exception classes and the fixed table from error codes to them: no state, any thread.

::

    RpcError
    ├── ProtocolError                 the other side broke the protocol
    │   ├── VersionMismatch           HELLO refused: protocol majors differ
    │   ├── BadRequest                malformed request (frames, header, dtype, sizes, limits)
    │   └── NotAuthentic              a signed session's request without its right signature
    ├── RemoteError                   the worker understood the request and refused or failed it
    │   ├── InvalidHandle             unknown, freed, duplicate or another session's handle
    │   ├── OutOfBounds               a view reaches outside its buffer
    │   ├── OutOfMemory               allocation over the worker's memory or size limit
    │   ├── GraphError                invalid graph, or a graph that failed while running
    │   ├── TransferError             a worker-to-worker transfer failed or timed out
    │   │   └── PeerUnreachable       ...because one worker lost its link to the other
    │   └── ModelFileError            a worker-side file read refused (path, identity, header)
    ├── TransportError                the connection failed us
    │   ├── Timeout                   no reply within the request's timeout
    │   ├── ConnectionLost            the worker went away, froze, or cannot be reached
    │   │   ├── SessionLost           the worker answers but no longer knows our session
    │   │   │                         (restarted, or it expired): its buffers are gone
    │   │   └── RecoveryFailed        a model lost a worker and could not re-place its layers
    │   └── AuthenticationFailed      the worker refused our CURVE key, or we its key
    ├── BadEndpoint                   an address the client cannot use (also a ValueError)
    └── ClientClosed                  you closed the client; pending and new calls fail with this

Remote failures travel as an :class:`~zmq_rpc.broker.protocol.ErrorCode` and a message; the client
maps the code to a class with :func:`error_for_code`, a fixed table. Class names sent by the other side
are never used to build exceptions.
"""

from __future__ import annotations

__all__ = [
    "RpcError",
    "ProtocolError",
    "VersionMismatch",
    "BadRequest",
    "NotAuthentic",
    "RemoteError",
    "InvalidHandle",
    "OutOfBounds",
    "OutOfMemory",
    "GraphError",
    "TransferError",
    "PeerUnreachable",
    "ModelFileError",
    "TransportError",
    "Timeout",
    "ConnectionLost",
    "SessionLost",
    "RecoveryFailed",
    "AuthenticationFailed",
    "BadEndpoint",
    "ClientClosed",
]


class RpcError(Exception):
    """Base class of every error zmq-rpc raises.

    ``code`` is the wire error code (an ``ErrorCode`` value) when the error came from a worker,
    else ``None``.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ProtocolError(RpcError):
    """The other side sent something the protocol does not allow."""


class VersionMismatch(ProtocolError):
    """Client and worker speak incompatible protocol versions."""


class BadRequest(ProtocolError, ValueError):
    """A request was malformed: frame count, header schema, dtype, sizes or limits.

    Also a ``ValueError``: the client raises it before sending for arguments it can check itself.
    """


class NotAuthentic(ProtocolError):
    """The worker refused a request of a session that signs its requests (protocol 1.10,
    ``request-mac``) because its signature was missing, wrong or replayed: it did not come from
    the client that opened the session. The session was left as it was."""


class RemoteError(RpcError):
    """The worker refused or failed a well-formed request."""


class InvalidHandle(RemoteError):
    """A handle is unknown, already freed, a duplicate, or belongs to another session."""


class OutOfBounds(RemoteError):
    """A tensor view reaches outside its buffer."""


class OutOfMemory(RemoteError):
    """An allocation exceeds the worker's memory limit or its maximum buffer size."""


class GraphError(RemoteError):
    """A graph is invalid (shapes, dtypes, cycles, limits) or failed while running."""


class TransferError(RemoteError):
    """A worker-to-worker transfer failed, was refused, or timed out."""


class PeerUnreachable(TransferError):
    """A worker-to-worker transfer failed because the worker that answered lost its peer link
    to the other worker (no ZMTP heartbeat answer, or a connection that would not come up,
    while the transfer needed it): "A cannot reach B". The worker that raised it is alive (it
    answered); whether the other one is too, its own requests say (they fail with
    :class:`ConnectionLost` when it is gone). The message names both workers and the link."""


class ModelFileError(RemoteError):
    """A worker would not read a model file from its disk: the path is outside its
    ``--model-dir`` directories (or leads out, or is not a regular file), the file there is a
    different one (its hash differs), or a read contradicts the file's own header."""


class TransportError(RpcError):
    """The connection to the worker failed."""


class Timeout(TransportError):
    """A request got no reply within its timeout. It may still run on the worker."""


class ConnectionLost(TransportError):
    """The worker went away, froze, or cannot be reached; or it no longer knows our session.

    Requests in flight when the connection dropped may or may not have run.
    """


class SessionLost(ConnectionLost):
    """The worker answers but no longer knows this client's session (it was restarted, or the
    session expired): every buffer and graph of the session is gone. The client stays unusable;
    open a new one."""


class RecoveryFailed(ConnectionLost):
    """A split model lost a worker and could not re-place its layers on the others (no survivor
    or spare has the memory, or none is left): the message names the lost worker, what its
    layers need and what would fit. A ``ConnectionLost``, so code written for the failure
    contract still catches it; the loss itself is its ``__cause__``."""


class BadEndpoint(RpcError, ValueError):
    """An endpoint the client cannot use: no scheme, a scheme zmq-rpc does not speak, no port."""


class AuthenticationFailed(TransportError):
    """The CURVE handshake failed: the worker does not list our public key, its key is not the
    one we expect, or one side speaks CURVE and the other does not. Retrying will not help."""


class ClientClosed(RpcError):
    """The client was closed; pending requests fail with this, new ones are refused."""
