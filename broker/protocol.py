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

Decoding is validation: :func:`decode_request` checks the frame count, the header's size and schema,
the command, every field's type and range (handles, dtypes, ranks, dims, strides, offsets) and the
payload sizes, and raises :class:`~zmq_rpc.broker.errors.BadRequest` on the first violation. Checks
that need state (does the handle exist, does the view fit its buffer) belong to the worker.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from .errors import (
    BadRequest,
    ConnectionLost,
    GraphError,
    InvalidHandle,
    OutOfBounds,
    OutOfMemory,
    RemoteError,
    RpcError,
    SessionLost,
    TransferError,
    VersionMismatch,
)
from .wire import describe

PROTOCOL_VERSION = (1, 2)
"""(major, minor). A major mismatch is refused at HELLO; minors add optional capabilities."""

STATUS_OK = 0
MAX_HEADER_BYTES = 8 << 20
MAX_RANK = 8
MAX_DIM = 1 << 48
MAX_HANDLE = (1 << 63) - 1
MAX_STRING = 4096


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


class ErrorCode(enum.IntEnum):
    """Why a request failed. Each maps to one exception class (:func:`error_for_code`)."""

    BAD_REQUEST = 1
    UNKNOWN_COMMAND = 2
    VERSION_MISMATCH = 3
    NO_SESSION = 4
    INVALID_HANDLE = 5
    OUT_OF_BOUNDS = 6
    OUT_OF_MEMORY = 7
    SIZE_MISMATCH = 8
    GRAPH_INVALID = 9
    GRAPH_FAILED = 10
    TRANSFER_FAILED = 11
    SHUTTING_DOWN = 12
    INTERNAL = 13


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
    ErrorCode.SHUTTING_DOWN: ConnectionLost,
    ErrorCode.INTERNAL: RemoteError,
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


class WireError(Exception):
    """Raised by the worker's handlers: becomes an error reply with this code and message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# --------------------------------------------------------------------------------------- dtypes


class DType(enum.IntEnum):
    """Element types on the wire. bfloat16 is carried as raw 16-bit words."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT64 = 3
    INT8 = 4
    UINT8 = 5
    INT16 = 6
    UINT16 = 7
    INT32 = 8
    UINT32 = 9
    INT64 = 10
    UINT64 = 11
    BOOL = 12

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @property
    def dtype_name(self) -> str:
        """The lower-case name used by the client API and the op registry ("float32", ...)."""
        return self.name.lower()

    @property
    def storage(self) -> str:
        """The numpy dtype name that stores it (bfloat16 is stored as raw uint16 words)."""
        return "uint16" if self is DType.BFLOAT16 else self.dtype_name

    @classmethod
    def from_name(cls, name: str) -> DType:
        """Parse an exact lower-case name ("float32", "bfloat16", ...)."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; expected one of {DTYPE_NAMES}") from None


_ITEMSIZE = {
    DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT64: 8,
    DType.INT8: 1, DType.UINT8: 1, DType.INT16: 2, DType.UINT16: 2,
    DType.INT32: 4, DType.UINT32: 4, DType.INT64: 8, DType.UINT64: 8, DType.BOOL: 1,
}
DTYPE_NAMES = tuple(d.dtype_name for d in DType)


# ------------------------------------------------------------------------------- field checks


def _bad(field: str, why: str) -> BadRequest:
    return BadRequest(f"field {field!r}: {why}", code=ErrorCode.BAD_REQUEST)


def _int_in(lo: int, hi: int) -> Callable[[Any, str], int]:
    def check(value: Any, field: str) -> int:
        if type(value) is not int:
            raise _bad(field, f"expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise _bad(field, f"{value} is outside [{lo}, {hi}]")
        return value

    return check


check_handle = _int_in(0, MAX_HANDLE)
check_u63 = _int_in(0, MAX_HANDLE)
check_byte = _int_in(0, 255)
check_u32 = _int_in(0, (1 << 32) - 1)


def check_str(value: Any, field: str) -> str:
    if type(value) is not str or len(value) > MAX_STRING:
        raise _bad(field, f"expected a string of at most {MAX_STRING} characters")
    return value


def check_bytes(value: Any, field: str) -> bytes:
    if type(value) is not bytes or len(value) > MAX_STRING:
        raise _bad(field, f"expected at most {MAX_STRING} bytes")
    return value


def check_bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise _bad(field, "expected a boolean")
    return value


def check_any(value: Any, field: str) -> Any:
    return value


def list_of(item: Callable[[Any, str], Any], max_len: int) -> Callable[[Any, str], list[Any]]:
    def check(value: Any, field: str) -> list[Any]:
        if type(value) is not list or len(value) > max_len:
            raise _bad(field, f"expected a list of at most {max_len} items")
        return [item(v, f"{field}[{i}]") for i, v in enumerate(value)]

    return check


def _f(check: Callable[[Any, str], Any], *, since: tuple[int, int] | None = None,
       **kw: Any) -> Any:
    """A wire field checked by ``check``. A field added by a later minor (``since``) comes last,
    has a default, and is left off the wire while it holds that default: older peers decode the
    message unchanged, and a message from them decodes with the default."""
    if since is not None and "default" not in kw:
        raise TypeError("a field added by a later minor needs a default")
    return dataclasses.field(metadata={"check": check, "since": since}, **kw)


# ---------------------------------------------------------------------------------- tensors


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """A typed, strided view into a remote buffer: everything the worker needs to address it."""

    buffer: int
    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements laid out contiguously (what SET/GET payloads carry)."""
        return self.numel * self.dtype.itemsize

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def byte_extent(self) -> tuple[int, int]:
        """(lo, hi): the half-open byte range every element lies in; (offset, offset) if empty."""
        if self.numel == 0:
            return self.offset, self.offset
        lo = hi = self.offset
        for dim, stride in zip(self.shape, self.strides):
            reach = stride * (dim - 1)
            if reach < 0:
                lo += reach
            else:
                hi += reach
        return lo, hi + self.dtype.itemsize

    def is_contiguous(self) -> bool:
        """C-contiguous: strides are those of a dense row-major array."""
        return self.strides == contiguous_strides(self.shape, self.dtype.itemsize)

    def to_wire(self) -> list[Any]:
        return [self.buffer, int(self.dtype), list(self.shape), list(self.strides), self.offset]


def contiguous_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides = []
    step = itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


_check_dims = list_of(_int_in(0, MAX_DIM), MAX_RANK)
_check_strides = list_of(_int_in(-MAX_DIM, MAX_DIM), MAX_RANK)


def check_tensor(value: Any, field: str) -> TensorRef:
    """Validate a wire tensor ``[buffer, dtype, shape, strides, offset]``."""
    if type(value) is not list or len(value) != 5:
        raise _bad(field, "a tensor is [buffer, dtype, shape, strides, offset]")
    buffer, dtype, shape, strides, offset = value
    if type(dtype) is not int or dtype not in _DTYPE_VALUES:
        raise _bad(field, f"unknown dtype code {describe(dtype)}")
    dims = _check_dims(shape, f"{field}.shape")
    steps = _check_strides(strides, f"{field}.strides")
    if len(dims) != len(steps):
        raise _bad(field, f"rank of shape ({len(dims)}) != rank of strides ({len(steps)})")
    ref = TensorRef(buffer=check_handle(buffer, f"{field}.buffer"), dtype=DType(dtype),
                    shape=tuple(dims), strides=tuple(steps),
                    offset=_int_in(0, MAX_HANDLE)(offset, f"{field}.offset"))
    if ref.numel > MAX_DIM:
        raise _bad(field, f"{ref.numel} elements is over the limit of {MAX_DIM}")
    return ref


_DTYPE_VALUES = frozenset(int(d) for d in DType)


def split_tensor(ref: TensorRef, limit: int) -> list[tuple[int, TensorRef]]:
    """Cut a view into sub-views of at most ``limit`` bytes (when its rows allow).

    Returns ``(start, sub_view)`` pairs where ``start`` is the sub-view's first byte in the view's
    C-ordered data; the pieces tile that data in order. Contiguous views split into flat runs;
    strided ones along their first axis, recursively when one row is still too big.
    """
    if ref.nbytes <= limit or not ref.shape:
        return [(0, ref)]
    size = ref.dtype.itemsize
    if ref.is_contiguous():
        step = max(limit // size, 1)
        return [(start * size, TensorRef(buffer=ref.buffer, dtype=ref.dtype,
                                         shape=(min(step, ref.numel - start),), strides=(size,),
                                         offset=ref.offset + start * size))
                for start in range(0, ref.numel, step)]
    row_bytes = ref.nbytes // ref.shape[0]
    rows = max(limit // max(row_bytes, 1), 1)
    pieces: list[tuple[int, TensorRef]] = []
    for first in range(0, ref.shape[0], rows):
        sub = dataclasses.replace(ref, shape=(min(rows, ref.shape[0] - first), *ref.shape[1:]),
                                  offset=ref.offset + first * ref.strides[0])
        if rows == 1 and row_bytes > limit:
            row = dataclasses.replace(sub, shape=ref.shape[1:], strides=ref.strides[1:])
            pieces += [(first * row_bytes + s, r) for s, r in split_tensor(row, limit)]
        else:
            pieces.append((first * row_bytes, sub))
    return pieces


def _tensor_to_wire(value: Any) -> Any:
    if hasattr(value, "to_wire"):
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_tensor_to_wire(v) for v in value]
    return value


# ---------------------------------------------------------------------------------- messages


M = TypeVar("M", bound="Message")


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every request and reply: positional wire fields, validated on decode."""

    payload_frames: ClassVar[int] = 0

    @classmethod
    def from_fields(cls: type[M], fields: Sequence[Any]) -> M:
        """Build from the header's fields, checking count, types and ranges."""
        spec = _SPECS[cls]
        required = _REQUIRED[cls]
        if not required <= len(fields) <= len(spec):
            wanted = f"{required} to {len(spec)}" if required < len(spec) else f"{len(spec)}"
            raise BadRequest(f"{cls.__name__} takes {wanted} fields, got {len(fields)}",
                             code=ErrorCode.BAD_REQUEST)
        return cls(**{name: check(v, name) for (name, check), v in zip(spec, fields)})

    def to_fields(self) -> list[Any]:
        """The header's fields, in order, as msgpack-ready values (later-minor fields that
        hold their default left off the end)."""
        spec, defaults = _SPECS[type(self)], _LATER_DEFAULTS[type(self)]
        values = [getattr(self, name) for name, _ in spec]
        end = len(values)
        while end > _REQUIRED[type(self)] and values[end - 1] == defaults[end - 1]:
            end -= 1
        return [_tensor_to_wire(v) for v in values[:end]]


_SPECS: dict[type[Message], list[tuple[str, Callable[[Any, str], Any]]]] = {}
_REQUIRED: dict[type[Message], int] = {}
"""How many leading fields every version of a message carries."""
_LATER_DEFAULTS: dict[type[Message], list[Any]] = {}


def _register(cls: type[M]) -> type[M]:
    fields = dataclasses.fields(cls)
    _SPECS[cls] = [(f.name, f.metadata["check"]) for f in fields]
    later = [f.metadata.get("since") is not None for f in fields]
    _REQUIRED[cls] = later.index(True) if True in later else len(fields)
    if not all(later[_REQUIRED[cls]:]):
        raise TypeError(f"{cls.__name__}: fields added by later minors must come last")
    _LATER_DEFAULTS[cls] = [f.default if is_later else None for f, is_later in zip(fields, later)]
    return cls


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class Empty(Message):
    """A request or reply with no fields."""


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """First request of a session: the client's protocol version and a name for the logs."""

    major: int = _f(check_u32)
    minor: int = _f(check_u32)
    client: str = _f(check_str)


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One compute device of a worker."""

    name: str
    kind: str
    total_memory: int
    free_memory: int


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


@_register
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

    def to_fields(self) -> list[Any]:
        fields = Message.to_fields(self)
        fields[3] = [[d.name, d.kind, d.total_memory, d.free_memory] for d in self.devices]
        fields[8] = list(self.capabilities)
        return fields


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class AllocBuffer(Message):
    """Allocate ``size`` bytes under the client-chosen ``handle``."""

    handle: int = _f(check_handle)
    size: int = _f(check_u63)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class BufferOp(Message):
    """FREE_BUFFER: one buffer handle."""

    handle: int = _f(check_handle)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class ClearBuffer(Message):
    """Set every byte of a buffer to ``value``."""

    handle: int = _f(check_handle)
    value: int = _f(check_byte)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceMemoryReply(Message):
    """Free and total bytes the worker may hand out (all sessions together)."""

    free: int = _f(check_u63)
    total: int = _f(check_u63)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class SetTensor(Message):
    """Write the payload frame (``tensor.nbytes`` bytes, C order) into the view."""

    payload_frames: ClassVar[int] = 1
    tensor: TensorRef = _f(check_tensor)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class GetTensor(Message):
    """Read the view; the reply carries its bytes (C order) as one payload frame."""

    tensor: TensorRef = _f(check_tensor)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class GetTensorReply(Message):
    """Reply to GET_TENSOR: one payload frame."""

    payload_frames: ClassVar[int] = 1


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class MemsetTensor(Message):
    """Set bytes [offset, offset+size) of a contiguous view (size -1: to its end) to ``value``."""

    tensor: TensorRef = _f(check_tensor)
    value: int = _f(check_byte)
    offset: int = _f(check_u63)
    size: int = _f(_int_in(-1, MAX_HANDLE))


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class CopyTensor(Message):
    """Copy ``src`` into ``dst`` on the same worker (same shape; overlap handled)."""

    src: TensorRef = _f(check_tensor)
    dst: TensorRef = _f(check_tensor)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(Message):
    """A failed request: the code travels in the status slot."""

    message: str = _f(check_any)


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
}
"""The request class of every command."""

REPLIES: dict[Cmd, type[Message]] = {
    **{cmd: Empty for cmd in Cmd},
    Cmd.HELLO: HelloReply,
    Cmd.DEVICE_MEMORY: DeviceMemoryReply,
    Cmd.GET_TENSOR: GetTensorReply,
}
"""The reply class of every command."""


def register_command(cmd: Cmd, request: type[Message], reply: type[Message]) -> None:
    """Add a command's request and reply classes (used by the graph and peer modules)."""
    _register(request)
    _register(reply)
    REQUESTS[cmd] = request
    REPLIES[cmd] = reply


# ------------------------------------------------------------------------------ encode/decode

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def encode_request(cmd: Cmd, req_id: int, msg: Message) -> bytes:
    """The header frame of a request."""
    return _packb([int(cmd), req_id, *msg.to_fields()])


def encode_reply(req_id: int, msg: Message) -> bytes:
    """The header frame of a successful reply."""
    return _packb([STATUS_OK, req_id, *msg.to_fields()])


def encode_error(req_id: int, code: ErrorCode, message: str) -> bytes:
    """The header frame of an error reply."""
    return _packb([int(code), req_id, message[:MAX_STRING]])


def unpack_header(frame: bytes | memoryview) -> list[Any]:
    """Parse a header frame into its msgpack array, with size and shape checks."""
    if len(frame) > MAX_HEADER_BYTES:
        raise BadRequest(f"header of {len(frame)} bytes is over {MAX_HEADER_BYTES}",
                         code=ErrorCode.BAD_REQUEST)
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise BadRequest(f"header is not valid msgpack: {exc}", code=ErrorCode.BAD_REQUEST) from None
    if type(header) is not list or len(header) < 2 or type(header[0]) is not int \
            or type(header[1]) is not int:
        raise BadRequest("header must be an array [cmd, req_id, ...]", code=ErrorCode.BAD_REQUEST)
    return header


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
    expected = payload_count(msg)
    if len(frames) - 1 != expected:
        raise BadRequest(f"{cmd.name} takes {expected} payload frame(s), got {len(frames) - 1}",
                         code=ErrorCode.BAD_REQUEST)
    for size, frame in zip(payload_sizes(msg), frames[1:]):
        if size != len(frame):
            raise BadRequest(f"{cmd.name}: payload of {len(frame)} bytes, tensor needs {size}",
                             code=ErrorCode.SIZE_MISMATCH)


def payload_count(msg: Message) -> int:
    """How many payload frames must follow this message's header."""
    sizes = getattr(msg, "payload_sizes", None)
    return len(sizes()) if sizes is not None else type(msg).payload_frames


def payload_sizes(msg: Message) -> list[int]:
    """The exact byte size of each payload frame of a request."""
    sizes = getattr(msg, "payload_sizes", None)
    if sizes is not None:
        return list(sizes())
    if isinstance(msg, SetTensor):
        return [msg.tensor.nbytes]
    return []


def decode_reply(cmd: Cmd, header: list[Any]) -> Message | RpcError:
    """Decode a reply header for a request of ``cmd``: the reply message or the error to raise."""
    status = header[0]
    if status != STATUS_OK:
        message = header[2] if len(header) > 2 and type(header[2]) is str else "(no message)"
        return error_for_code(status, message)
    return REPLIES[cmd].from_fields(header[2:])


# The graph and peer commands' messages live beside their encodings; importing them registers them.
from . import graph as _graph  # noqa: E402,F401  (circular by design: they need this module)
from . import peer as _peer  # noqa: E402,F401
