"""The synchronous/futures face of the client: :class:`Client`, :class:`RemoteBuffer`, :class:`RemoteTensor`.

Every command has a blocking method and an ``_async`` twin that returns a
``concurrent.futures.Future`` at once; requests pipeline and run on the worker in the order they
were issued. Socket work belongs to the engine (:mod:`zmq_rpc.client.engine`): its I/O thread, or
the caller's own thread for a blocking call on an idle connection. The objects here are plain
descriptions and may be used from any thread.

:class:`Client` is put together from one class per job: :class:`~zmq_rpc.client.connection.Connection`
(HELLO, the session's life, issuing requests), :class:`~zmq_rpc.client.tensor_calls.TensorCalls`
(buffers and tensor bytes), :class:`~zmq_rpc.client.graph_calls.GraphCalls` (graphs and linked
runs); what the worker says about itself (memory, status, ping) is here.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import cast

from ..broker import protocol as p
from ..broker.errors import BadRequest
from ..broker.protocol import Cmd
from .arrays import RunResult as RunResult
from .arrays import from_bfloat16 as from_bfloat16
from .arrays import to_bfloat16 as to_bfloat16
from .connection import DEFAULT_CHUNK as DEFAULT_CHUNK
from .connection import EMPTY, no_result
from .graph_calls import GraphCalls
from .remote import DTypeLike as DTypeLike
from .remote import Inputs as Inputs
from .remote import MemoryInfo as MemoryInfo
from .remote import RegisteredGraph as RegisteredGraph
from .remote import RemoteBuffer as RemoteBuffer
from .remote import RemoteTensor as RemoteTensor
from .remote import as_dtype as as_dtype
from .tensor_calls import TensorCalls


class Client(TensorCalls, GraphCalls):
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

    # -------------------------------------------------------------- the worker itself

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
        self._engine.request(Cmd.PING, EMPTY, (), no_result)

    def ping_async(self) -> Future[None]:
        return self._call(Cmd.PING, EMPTY)
