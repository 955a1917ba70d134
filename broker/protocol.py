"""The zmq-rpc wire protocol: version, commands, error codes, one frozen dataclass per message.

Pure functions and immutable data; any thread may use it.

Frame layout (client DEALER -> worker ROUTER, which prepends the client's routing id)::

    +--------------------------------------------------+----------------------------+
    | frame 0: header, msgpack array                    | frames 1..n: payload       |
    |   [cmd, req_id, field_1, field_2, ...]            |   raw tensor bytes, C order|
    +--------------------------------------------------+----------------------------+

Replies (worker -> client)::

    frame 0: [STATUS_OK, req_id, field_1, ...]     frames 1..n: payload (GET_TENSOR: 1)
    frame 0: [error_code, req_id, message]         no payload

Fields travel positionally, in the dataclass's field order; a :class:`TensorRef` travels as
``[buffer, dtype, shape, strides, offset]`` (strides and offset in bytes). Tensor bytes never go
through msgpack and nothing is ever pickled.

Where things live (no import cycles): field checkers, dtypes, :class:`TensorRef` and the
:class:`Message` base in the leaf :mod:`.wire`; graph encodings and their messages in :mod:`.graph`;
hand-offs, the peer commands' messages and the peer link's own messages in :mod:`.peer`; here, the
commands, the error table, the core messages and :data:`REQUESTS` / :data:`REPLIES`, the one place
that says which command takes which message. A message's payload frames are its own business
(:meth:`Message.payload_sizes`, :meth:`Message.payload_count`).

Decoding is validation: :func:`decode_request` checks the frame count, the header's size and schema,
the command, every field's type and range (handles, dtypes, ranks, dims, strides, offsets) and the
payload sizes, and raises :class:`~zmq_rpc.broker.errors.BadRequest` on the first violation. Checks
that need state (does the handle exist, does the view fit its buffer) belong to the worker.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack

from .errors import (
    BadRequest,
    ConnectionLost,
    GraphError,
    InvalidHandle,
    ModelFileError,
    NotAuthentic,
    OutOfBounds,
    OutOfMemory,
    PeerUnreachable,
    RemoteError,
    RpcError,
    SessionLost,
    TransferError,
    VersionMismatch,
)
from .files import CacheReply, FileQuery, FileQueryReply, ReadFile, SetFromCache, check_cache_key
from .graph import (
    GraphCompute,
    GraphRegister,
    GraphReply,
    GraphRun,
    GraphRunKept,
    GraphRunLinked,
)
from .peer import PeerFill, PeerProbe, PeerRecv, PeerSend
from .wire import (
    DTYPE_NAMES,
    MAX_DIM,
    MAX_HANDLE,
    MAX_HEADER_ARRAY,
    MAX_HEADER_BYTES,
    MAX_HEADER_CONTAINERS,
    MAX_RANK,
    MAX_STRING,
    STATUS_OK,
    DType,
    Empty,
    ErrorCode,
    Message,
    TensorRef,
    WireError,
    _bad,
    _f,
    _int_in,
    check_any,
    check_bool,
    check_byte,
    check_handle,
    check_str,
    check_tensor,
    check_u32,
    check_u63,
    contiguous_strides,
    describe,
    draining_field,
    list_of,
    split_tensor,
    timing_field,
    wire_message,
)

if TYPE_CHECKING:
    import zmq

__all__ = [  # the protocol's vocabulary; wire's names are re-exported so callers need one import
    "DTYPE_NAMES", "MAX_DIM", "MAX_HANDLE", "MAX_HEADER_BYTES", "MAX_RANK", "MAX_STRING",
    "PROTOCOL_VERSION", "REPLIES", "REQUESTS", "STATUS_OK",
    "Ack", "AllocBuffer", "BufferOp", "ClearBuffer", "Cmd", "CopyTensor", "DType", "Device",
    "DeviceDetail", "DeviceMemoryReply", "Empty", "ErrorCode", "GetTensor", "GetTensorReply", "Hello", "HelloReply",
    "MemsetTensor", "Message", "SessionInfo", "SetTensor", "StatusReply", "TensorRef",
    "WireError",
    "check_tensor", "contiguous_strides", "decode_reply", "decode_request", "encode_error",
    "encode_reply", "encode_request", "error_for_code", "split_tensor", "unpack_header",
]

PROTOCOL_VERSION = (1, 15)
"""(major, minor). A major mismatch is refused at HELLO; minors add optional capabilities.

1.1 GRAPH_RUN_LINKED (``linked-runs``); 1.2 its ``hold_reply_us`` (``held-replies``); 1.3 the
``scale`` op's optional bias ``b`` (``scale-bias``: x * s + b, how graphs add scalars); 1.4
FILE_QUERY, READ_FILE, SET_FROM_CACHE and SET_TENSOR's ``cache_key`` (``model-files`` /
``tensor-cache`` when the worker has ``--model-dir`` / ``--cache-dir``), PEER_SEND's ``acked``
(``unacked-sends``).; 1.5 STATUS (``status``)
and the worker's share of each request's time in its reply, for sessions that ask (``timing``);
1.6 HELLO's and STATUS's ``device_details`` (device index, physical memory, compute capability),
sent to sessions whose HELLO said 1.6 or later; 1.7 the graph ops ``attention`` (fused GQA
attention over a KV cache) and ``swiglu`` (``fused-ops``); 1.8 HELLO's ``key`` and ``proof``
(``key-proof``: a CURVE client proves which authorized key opened the session, which the worker
counts quotas by and binds the session to; see :mod:`.identity`); 1.9 PEER_RECV's
``source`` and GRAPH_RUN_LINKED's ``receive_from`` (the sending worker's peer endpoint: the receiver watches its
own link to it) and the error code PEER_UNREACHABLE (``peer-link-watch``); 1.10 HELLO's and its reply's
``exchange`` and a signature after every later request's header (``request-mac``: the session
is the client's that opened it; see :mod:`.request_mac`); 1.11 the ``rope`` op's optional third
input ``freq_factors`` (``rope-factors``: Llama 3.x rope scaling; the encoding is unchanged); 1.12
the graph ops ``attend_rows`` (attention of rows of many sequences, each over its own cache rows,
the causal / sliding-window mask built on the worker from the positions) and ``sample_rows``
(greedy / temperature / top-k / top-p sampling on the worker, a counter-based draw per row)
(``row-attention``: both batch-invariant; the encoding is unchanged); 1.13 the graph op
``causal_mask`` (the attention mask of a chunk's rows built on the worker from their positions,
so a step sends no mask rows; ``causal-mask``; the encoding is unchanged); 1.14 the replies'
``draining`` (``Ack``'s and ``GraphReply``'s last field: the worker got SIGTERM and is leaving;
capability ``draining``) and HELLO refused with SHUTTING_DOWN by a draining worker; 1.15
GRAPH_RUN_LINKED's ``keep`` and GRAPH_RUN_KEPT (``kept-runs``: a session keeps a linked run's
shape, and repeats it from its id, new transfer tokens and input bytes: a decode step's header
per stage shrinks from ~150 bytes to ~45)."""


class Cmd(enum.IntEnum):
    """Request commands. Append only; changing a value changes the protocol major."""

    HELLO = 1
    PING = 2
    GOODBYE = 3
    ALLOC_BUFFER = 4
    FREE_BUFFER = 5
    CLEAR_BUFFER = 6
    DEVICE_MEMORY = 7
    SET_TENSOR = 8
    GET_TENSOR = 9
    MEMSET_TENSOR = 10
    COPY_TENSOR = 11
    SYNCHRONIZE = 12
    GRAPH_COMPUTE = 13
    GRAPH_REGISTER = 14
    GRAPH_RUN = 15
    GRAPH_FREE = 16
    PEER_SEND = 17
    PEER_RECV = 18
    PEER_PROBE = 19
    PEER_FILL = 20
    GRAPH_RUN_LINKED = 21
    FILE_QUERY = 22
    READ_FILE = 23
    SET_FROM_CACHE = 24
    STATUS = 25
    """1.5: what the worker is doing (sessions, memory, queue, uptime); capability ``status``."""
    GRAPH_RUN_KEPT = 26
    """1.15: a kept GRAPH_RUN_LINKED again, new tokens and inputs; capability ``kept-runs``."""




_ERROR_CLASSES: dict[int, type[RpcError]] = {
    ErrorCode.BAD_REQUEST: BadRequest,
    ErrorCode.UNKNOWN_COMMAND: BadRequest,
    ErrorCode.VERSION_MISMATCH: VersionMismatch,
    ErrorCode.NO_SESSION: SessionLost,
    ErrorCode.INVALID_HANDLE: InvalidHandle,
    ErrorCode.OUT_OF_BOUNDS: OutOfBounds,
    ErrorCode.OUT_OF_MEMORY: OutOfMemory,
    ErrorCode.SIZE_MISMATCH: BadRequest,
    ErrorCode.GRAPH_INVALID: GraphError,
    ErrorCode.GRAPH_FAILED: GraphError,
    ErrorCode.TRANSFER_FAILED: TransferError,
    ErrorCode.PEER_UNREACHABLE: PeerUnreachable,
    ErrorCode.SHUTTING_DOWN: ConnectionLost,
    ErrorCode.INTERNAL: RemoteError,
    ErrorCode.FILE_REFUSED: ModelFileError,
    ErrorCode.NOT_AUTHENTIC: NotAuthentic,
}


def error_for_code(code: int, message: str) -> RpcError:
    """The exception a client raises for a worker's error reply (a fixed table, never names)."""
    cls = _ERROR_CLASSES.get(code, RemoteError)
    return cls(f"[{_code_name(code)}] {message}", code=code)


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code}"


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Ack(Message):
    """The reply of a command that returns nothing (1.4: it may carry ``timing``; 1.14
    ``draining``: PING's reply, the heartbeat's included, says so)."""

    timing: tuple[int, ...] = timing_field()
    draining: bool = draining_field()


def _check_bytes(limit: int) -> Callable[[Any, str], bytes]:
    def check(value: Any, field: str) -> bytes:
        if type(value) is not bytes or len(value) > limit:
            raise _bad(field, f"expected at most {limit} bytes, got {describe(value)}")
        return value
    return check


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """First request of a session: the client's protocol version and a name for the logs."""

    major: int = _f(check_u32)
    minor: int = _f(check_u32)
    client: str = _f(check_str)
    timing: bool = _f(check_bool, since=(1, 5), default=False)
    """1.5: put the worker's share of each request's time in its reply (``timing``). A client
    asks in a second HELLO once the first has shown a worker of 1.5 or later."""
    key: bytes = _f(_check_bytes(32), since=(1, 8), default=b"")
    """1.8, CURVE only: the client's public key (32 raw bytes)."""
    proof: bytes = _f(_check_bytes(128), since=(1, 8), default=b"")
    """1.8, CURVE only: a crypto box from ``key`` to the worker's key over the routing id
    (:func:`~zmq_rpc.broker.identity.prove`): the session is that key's."""
    exchange: bytes = _f(_check_bytes(32), since=(1, 10), default=b"")
    """1.10: an ephemeral X25519 public key; the session then signs its requests
    (:mod:`~zmq_rpc.broker.request_mac`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One compute device of a worker."""

    name: str
    kind: str
    total_memory: int
    free_memory: int

    def to_wire(self) -> list[Any]:
        return [self.name, self.kind, self.total_memory, self.free_memory]


def _check_devices(value: Any, field: str) -> tuple[Device, ...]:
    rows = list_of(list_of(check_any, 4), 64)(value, field)
    devices = []
    for i, row in enumerate(rows):
        if len(row) != 4:
            raise _bad(f"{field}[{i}]", "a device is [name, kind, total, free]")
        devices.append(Device(name=check_str(row[0], field), kind=check_str(row[1], field),
                              total_memory=check_u63(row[2], field),
                              free_memory=check_u63(row[3], field)))
    return tuple(devices)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceDetail:
    """1.6: more about one device of ``devices`` (same position): what a scheduler places work
    by. A CPU is index 0, its RAM, capability ""."""

    index: int
    """The device's ordinal on its machine (``--device cuda:N``)."""
    memory: int
    """Physical bytes of the device (``devices`` reports the worker's limit and what is free)."""
    compute_capability: str
    """"major.minor" of an NVIDIA GPU (e.g. "9.0"); "" for a CPU."""

    def to_wire(self) -> list[Any]:
        return [self.index, self.memory, self.compute_capability]


def _check_device_details(value: Any, field: str) -> tuple[DeviceDetail, ...]:
    rows = list_of(list_of(check_any, 3), 64)(value, field)
    details = []
    for i, row in enumerate(rows):
        if len(row) != 3:
            raise _bad(f"{field}[{i}]", "a device detail is [index, memory, compute_capability]")
        details.append(DeviceDetail(index=check_u32(row[0], field), memory=check_u63(row[1], field),
                                    compute_capability=check_str(row[2], field)))
    return tuple(details)


def device_details_field() -> Any:
    """HELLO's and STATUS's ``device_details`` (1.6): off the wire while empty, which is what a
    worker sends a session whose HELLO said an older minor."""
    return _f(_check_device_details, since=(1, 6), default=())


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class HelloReply(Message):
    """What a worker tells a new session about itself."""

    major: int = _f(check_u32)
    minor: int = _f(check_u32)
    server: str = _f(check_str)
    devices: tuple[Device, ...] = _f(_check_devices)
    alignment: int = _f(check_u63)
    max_buffer_size: int = _f(check_u63)
    max_message_size: int = _f(check_u63)
    session_timeout_ms: int = _f(check_u63)
    capabilities: tuple[str, ...] = _f(lambda v, f: tuple(list_of(check_str, 256)(v, f)))
    peer_endpoint: str = _f(check_str)
    timing: tuple[int, ...] = timing_field()
    device_details: tuple[DeviceDetail, ...] = device_details_field()
    exchange: bytes = _f(_check_bytes(32), since=(1, 10), default=b"")
    """1.10: the worker's ephemeral public key, in reply to a HELLO's ``exchange`` only."""


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class AllocBuffer(Message):
    """Allocate ``size`` bytes under the client-chosen ``handle``."""

    handle: int = _f(check_handle)
    size: int = _f(check_u63)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class BufferOp(Message):
    """FREE_BUFFER: one buffer handle."""

    handle: int = _f(check_handle)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class ClearBuffer(Message):
    """Set every byte of a buffer to ``value``."""

    handle: int = _f(check_handle)
    value: int = _f(check_byte)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemoryReply(Message):
    """Free and total bytes the worker may hand out (all sessions together)."""

    free: int = _f(check_u63)
    total: int = _f(check_u63)
    timing: tuple[int, ...] = timing_field()


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class SetTensor(Message):
    """Write the payload frame (``tensor.nbytes`` bytes, C order) into the view."""

    tensor: TensorRef = _f(check_tensor)
    cache_key: bytes = _f(check_cache_key, since=(1, 4), default=b"")
    """BLAKE3-256 of the payload: the worker also keeps it in its tensor cache (see
    :mod:`.files`). Off the wire when empty."""

    def payload_sizes(self) -> list[int]:
        return [self.tensor.nbytes]


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GetTensor(Message):
    """Read the view; the reply carries its bytes (C order) as one payload frame."""

    tensor: TensorRef = _f(check_tensor)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class GetTensorReply(Message):
    """Reply to GET_TENSOR: one payload frame."""

    payload_frames: ClassVar[int] = 1
    timing: tuple[int, ...] = timing_field()


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class MemsetTensor(Message):
    """Set bytes [offset, offset+size) of a contiguous view (size -1: to its end) to ``value``."""

    tensor: TensorRef = _f(check_tensor)
    value: int = _f(check_byte)
    offset: int = _f(check_u63)
    size: int = _f(_int_in(-1, MAX_HANDLE))


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class CopyTensor(Message):
    """Copy ``src`` into ``dst`` on the same worker (same shape; overlap handled)."""

    src: TensorRef = _f(check_tensor)
    dst: TensorRef = _f(check_tensor)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    """One session as STATUS reports it (``client_id``: the first 4 bytes of its routing id, hex;
    the whole id keys the session and is never shown)."""

    sid: int
    client: str
    client_id: str
    memory: int
    buffers: int
    graphs: int
    queued: int
    idle_ms: int

    def to_wire(self) -> list[Any]:
        return [self.sid, self.client, self.client_id, self.memory, self.buffers, self.graphs,
                self.queued, self.idle_ms]


MAX_STATUS_SESSIONS = 256
"""Most sessions one STATUS reply lists (the counts cover them all)."""


def _check_sessions(value: Any, field: str) -> tuple[SessionInfo, ...]:
    rows = list_of(list_of(check_any, 8), MAX_STATUS_SESSIONS)(value, field)
    sessions = []
    for i, row in enumerate(rows):
        name = f"{field}[{i}]"
        if len(row) != 8:
            raise _bad(name, "a session is [sid, client, client_id, memory, buffers, graphs, "
                             "queued, idle_ms]")
        sessions.append(SessionInfo(
            sid=check_u63(row[0], name), client=check_str(row[1], name),
            client_id=check_str(row[2], name),
            **{key: check_u63(v, name) for key, v in zip(
                ("memory", "buffers", "graphs", "queued", "idle_ms"), row[3:])}))
    return tuple(sessions)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(Message):
    """STATUS (1.5): the worker's state now. Counts cover every session but the asker's."""

    server: str = _f(check_str)
    version: str = _f(check_str)
    """The worker's zmq-rpc package version."""
    uptime_ms: int = _f(check_u63)
    devices: tuple[Device, ...] = _f(_check_devices)
    memory_used: int = _f(check_u63)
    memory_limit: int = _f(check_u63)
    sessions: int = _f(check_u63)
    queue_depth: int = _f(check_u63)
    """Requests waiting in session queues."""
    buffers: int = _f(check_u63)
    graphs: int = _f(check_u63)
    transfers_in_progress: int = _f(check_u63)
    capabilities: tuple[str, ...] = _f(lambda v, f: tuple(list_of(check_str, 256)(v, f)))
    peer_endpoint: str = _f(check_str)
    session_list: tuple[SessionInfo, ...] = _f(_check_sessions)
    """At most :data:`MAX_STATUS_SESSIONS`, the most recently active first."""
    timing: tuple[int, ...] = timing_field()
    device_details: tuple[DeviceDetail, ...] = device_details_field()


REQUESTS: dict[Cmd, type[Message]] = {
    Cmd.HELLO: Hello,
    Cmd.PING: Empty,
    Cmd.GOODBYE: Empty,
    Cmd.ALLOC_BUFFER: AllocBuffer,
    Cmd.FREE_BUFFER: BufferOp,
    Cmd.CLEAR_BUFFER: ClearBuffer,
    Cmd.DEVICE_MEMORY: Empty,
    Cmd.SET_TENSOR: SetTensor,
    Cmd.GET_TENSOR: GetTensor,
    Cmd.MEMSET_TENSOR: MemsetTensor,
    Cmd.COPY_TENSOR: CopyTensor,
    Cmd.SYNCHRONIZE: Empty,
    Cmd.GRAPH_COMPUTE: GraphCompute,
    Cmd.GRAPH_REGISTER: GraphRegister,
    Cmd.GRAPH_RUN: GraphRun,
    Cmd.GRAPH_FREE: BufferOp,
    Cmd.PEER_SEND: PeerSend,
    Cmd.PEER_RECV: PeerRecv,
    Cmd.PEER_PROBE: PeerProbe,
    Cmd.PEER_FILL: PeerFill,
    Cmd.GRAPH_RUN_LINKED: GraphRunLinked,
    Cmd.FILE_QUERY: FileQuery,
    Cmd.READ_FILE: ReadFile,
    Cmd.SET_FROM_CACHE: SetFromCache,
    Cmd.STATUS: Empty,
    Cmd.GRAPH_RUN_KEPT: GraphRunKept,
}
"""The request class of every command (graph and peer messages live beside their encodings in
:mod:`.graph` and :mod:`.peer`; this table is the one place that says which command takes which)."""

REPLIES: dict[Cmd, type[Message]] = {
    **{cmd: Ack for cmd in Cmd},
    Cmd.HELLO: HelloReply,
    Cmd.DEVICE_MEMORY: DeviceMemoryReply,
    Cmd.GET_TENSOR: GetTensorReply,
    Cmd.GRAPH_RUN: GraphReply,
    Cmd.GRAPH_COMPUTE: GraphReply,
    Cmd.GRAPH_RUN_LINKED: GraphReply,
    Cmd.GRAPH_RUN_KEPT: GraphReply,
    Cmd.FILE_QUERY: FileQueryReply,
    Cmd.SET_FROM_CACHE: CacheReply,
    Cmd.STATUS: StatusReply,
}
"""The reply class of every command."""

if set(REQUESTS) != set(Cmd):  # a new command without a request class fails at import
    raise TypeError(f"commands without a request class: {set(Cmd) - set(REQUESTS)}")


# ------------------------------------------------------------------------------ encode/decode

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def encode_request(cmd: Cmd, req_id: int, msg: Message) -> bytes:
    """The header frame of a request."""
    return _packb([int(cmd), req_id, *msg.to_fields()])


def encode_reply(req_id: int, msg: Message) -> bytes:
    """The header frame of a successful reply."""
    return _packb([STATUS_OK, req_id, *msg.to_fields()])


pack_id: Callable[[int], bytes] = _packb
"""A request id as msgpack writes it inside a header (what the two heads below precede): the
packer itself, no function around it (a synchronous caller's fast path)."""


def request_head(cmd: Cmd) -> bytes:
    """The header of a ``cmd`` request whose message has no fields on the wire (``Empty``) is
    this, then :func:`pack_id` of its id: msgpack's ``[cmd, req_id]`` (the same bytes as
    :func:`encode_request`, without building a list: a synchronous caller's fast path)."""
    return b"\x92" + _packb(int(cmd))


BARE_REPLY_HEAD = b"\x92" + _packb(STATUS_OK)
"""The header of a successful reply without fields (an ``Ack``) is this, then :func:`pack_id`
of its request id: msgpack's ``[STATUS_OK, req_id]`` (the same bytes as :func:`encode_reply`)."""


def encode_error(req_id: int, code: ErrorCode, message: str) -> bytes:
    """The header frame of an error reply."""
    return _packb([int(code), req_id, message[:MAX_STRING]])


def unpack_header(frame: bytes | memoryview | zmq.Frame) -> list[Any]:
    """Parse a header frame into its msgpack array, with size and shape checks (a ``zmq.Frame``
    is read in place: cheaper than its ``.buffer``, a new memoryview each time)."""
    if len(frame) > MAX_HEADER_BYTES:
        raise _with_id(BadRequest(f"header of {len(frame)} bytes is over {MAX_HEADER_BYTES}",
                                  code=ErrorCode.BAD_REQUEST), _peek_req_id(frame))
    try:
        header = _unpack(frame)
    except _TooManyContainers:
        raise _with_id(BadRequest(f"header has over {MAX_HEADER_CONTAINERS} arrays and maps",
                                  code=ErrorCode.BAD_REQUEST), _peek_req_id(frame)) from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        message = (f"header: an array or map is over {MAX_HEADER_ARRAY} items ({exc})"
                   if "exceeds max_" in str(exc) else f"header is not valid msgpack: {exc}")
        raise _with_id(BadRequest(message, code=ErrorCode.BAD_REQUEST),
                       _peek_req_id(frame)) from None
    if type(header) is not list or len(header) < 2 or type(header[0]) is not int \
            or type(header[1]) is not int:
        raise BadRequest("header must be an array [cmd, req_id, ...]", code=ErrorCode.BAD_REQUEST)
    return header


class _TooManyContainers(Exception):
    pass


_SMALL_HEADER = 4096
"""Below this many bytes a header cannot hold MAX_HEADER_CONTAINERS (each takes a byte): no
counting, no per-container call on the hot path."""


def _unpack(frame: bytes | memoryview | zmq.Frame) -> Any:
    """msgpack's unpack, with every array at most MAX_HEADER_ARRAY long (refused from its length
    prefix, before its items) and at most MAX_HEADER_CONTAINERS arrays and maps in all."""
    if len(frame) <= _SMALL_HEADER:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                               max_array_len=MAX_HEADER_ARRAY, max_map_len=MAX_HEADER_ARRAY)
    left = MAX_HEADER_CONTAINERS

    def count(container: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooManyContainers
        return container

    return msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                           max_array_len=MAX_HEADER_ARRAY, max_map_len=MAX_HEADER_ARRAY,
                           list_hook=count, object_hook=count)


_ID_PREFIX = 32
"""Bytes that hold a header's array prefix, command and request id (ints: 9 bytes at most)."""


def _peek_req_id(frame: bytes | memoryview | zmq.Frame) -> int:
    """The request id of a header refused whole (an array over the limit deep inside), read
    from its first two items alone, so that the error reaches the request's future; 0 when
    even those are not there."""
    unpacker = msgpack.Unpacker(max_array_len=MAX_HEADER_ARRAY, max_map_len=MAX_HEADER_ARRAY)
    data: Any = getattr(frame, "buffer", frame)        # a zmq.Frame's bytes, in place
    unpacker.feed(memoryview(data)[:_ID_PREFIX])
    try:
        if unpacker.read_array_header() >= 2:
            unpacker.skip()
            req_id = unpacker.unpack()
            if type(req_id) is int and 0 <= req_id < 1 << 64:
                return req_id
    except Exception:  # garbage: no id to answer to
        pass
    return 0


def decode_request(frames: Sequence[Any]) -> tuple[Cmd, int, Message]:
    """Validate a request's frames (header first, then payload); returns (cmd, req_id, message).

    Raises BadRequest; ``exc.req_id`` carries the request id when the header got that far.
    """
    if not frames:
        raise BadRequest("a request needs a header frame", code=ErrorCode.BAD_REQUEST)
    header = unpack_header(frames[0])
    req_id = header[1]
    cmd = _COMMANDS.get(header[0])
    if cmd is None:
        raise _with_id(BadRequest(f"unknown command {describe(header[0])}",
                                  code=ErrorCode.UNKNOWN_COMMAND), req_id)
    try:
        msg = REQUESTS[cmd].from_fields(header[2:])
        _check_payload(cmd, msg, frames)
    except BadRequest as exc:
        raise _with_id(exc, req_id) from None
    return cmd, req_id, msg


_COMMANDS: dict[int, Cmd] = {int(c): c for c in Cmd}


def _with_id(exc: BadRequest, req_id: int) -> BadRequest:
    exc.req_id = req_id  # type: ignore[attr-defined]
    return exc


def _check_payload(cmd: Cmd, msg: Message, frames: Sequence[Any]) -> None:
    expected = msg.payload_count()
    if len(frames) - 1 != expected:
        raise BadRequest(f"{cmd.name} takes {expected} payload frame(s), got {len(frames) - 1}",
                         code=ErrorCode.BAD_REQUEST)
    for size, frame in zip(msg.payload_sizes() or (), frames[1:]):
        if size != len(frame):
            raise BadRequest(f"{cmd.name}: payload of {len(frame)} bytes, tensor needs {size}",
                             code=ErrorCode.SIZE_MISMATCH)


def decode_reply(cmd: Cmd, header: list[Any]) -> Message | RpcError:
    """Decode a reply header for a request of ``cmd``: the reply message or the error to raise."""
    status = header[0]
    if status != STATUS_OK:
        message = header[2] if len(header) > 2 and type(header[2]) is str else "(no message)"
        return error_for_code(status, message)
    return REPLIES[cmd].from_fields(header[2:])
