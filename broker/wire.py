r"""The leaf of the wire protocol: field checkers, dtypes, tensor references and the message base.

Pure functions and immutable data; any thread may use them. This module imports no other zmq_rpc
module but :mod:`~zmq_rpc.broker.errors`, so :mod:`.ops`, :mod:`.graph`, :mod:`.peer` and
:mod:`.protocol` all build on it without import cycles::

    errors <- wire <- ops <- graph <- protocol
                  \_____ peer ______/

Decoding is validation: a :class:`Message` is built from a header's fields by
:meth:`Message.from_fields`, which runs each field's checker and raises
:class:`~zmq_rpc.broker.errors.BadRequest` on the first violation.

Every value decoded from the network may reach an error message, and ``repr`` of such a value is
an attack surface (a 990-deep list makes it raise RecursionError; an 8 MiB list makes it slow and
the message huge): checkers name values with :func:`describe`, which never recurses.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, cast

from .errors import BadRequest

STATUS_OK = 0
MAX_HEADER_BYTES = 2 << 20
"""A header frame's size. Decoding is the first thing a worker spends on a request, before any
quota applies: these three bound it (docs/SECURITY.md, "What one request may cost"). The largest real header, a llama stage graph of 240 layers (8,192 nodes),
is ~0.6 MiB and ~40,000 containers."""
MAX_HEADER_ARRAY = 16384
"""Items in any one msgpack array of a header: twice the longest list a request may have (graph
nodes), so that a list a little too long still gets its field's own error."""
MAX_HEADER_CONTAINERS = 1 << 16
"""Arrays and maps in one header, all levels together: a MiB of empty lists is a million
Python objects (a second or more to build with the garbage collector running), refused early
here."""
MAX_RANK = 8
MAX_DIM = 1 << 48
MAX_HANDLE = (1 << 63) - 1
MAX_STRING = 4096


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
    FILE_REFUSED = 14
    PEER_UNREACHABLE = 15
    """1.9: a transfer failed because the worker answering lost its link to the other worker
    (both workers may be alive: a partition between them). Sent to sessions of 1.9 or later;
    older ones get TRANSFER_FAILED with the same message."""
    NOT_AUTHENTIC = 16
    """1.10: a request of a signed session without its right signature (``request-mac``)."""



class WireError(Exception):
    """Raised by the worker's handlers: becomes an error reply with this code and message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message



# ----------------------------------------------------------------------------- descriptions

_SCALARS = (bool, int, float, type(None))


def describe(value: Any, limit: int = 60) -> str:
    """A short, safe description of an untrusted value: scalars and strings shown (truncated),
    containers by type and length only. Never recurses, never raises, at most ``limit`` chars."""
    kind = type(value)
    if kind is int and not -(10**30) < value < 10**30:
        text = f"an int of {value.bit_length()} bits"
    elif kind in _SCALARS:
        text = repr(value)
    elif kind is str or kind is bytes:
        text = repr(value[:limit])
    elif kind in (list, tuple, dict):
        text = f"a {kind.__name__} of {len(value)} items"
    else:
        text = f"a {kind.__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def printable(text: str, limit: int = 200) -> str:
    """An untrusted string made safe for one log line: control characters, quotes, backslashes
    and non-ASCII escaped the way ``repr`` shows them (a NUL is ``\\x00``, a newline ``\\n``, so
    nobody forges a log line), cut to ``limit`` characters."""
    cut = text[:limit]
    shown = cut.encode("ascii", "backslashreplace").decode("ascii")
    shown = "".join(c if " " <= c <= "~" else repr(c)[1:-1] for c in shown)
    return shown + ("..." if len(text) > limit else "")


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


def check_bool(value: Any, field: str) -> bool:
    if type(value) is not bool:
        raise _bad(field, f"expected a boolean (true or false), got {describe(value)}")
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


def _check_timing(value: Any, field: str) -> tuple[int, ...]:
    timing = tuple(list_of(_int_in(0, MAX_HANDLE), 2)(value, field))
    if len(timing) not in (0, 2):     # [] is the default, on the wire when a later field follows
        raise _bad(field, "timing is [queued_ns, run_ns]")
    return timing


def timing_field() -> Any:
    """A reply's ``timing`` (1.5): ``(queued_ns, run_ns)``, the worker's share of the request
    (waiting in its session's queue, then running until the reply left). Sent only to sessions
    that asked in HELLO; ``()`` otherwise, and then never on the wire."""
    return _f(_check_timing, since=(1, 5), default=())


def draining_field() -> Any:
    """A reply's ``draining`` (1.14, capability ``draining``): the worker is leaving (it got
    SIGTERM with ``--drain-timeout``): it answers every request as before, takes no new
    session, and exits once its sessions have closed or the timeout passed. Sent (True) only
    to sessions whose HELLO said 1.14 or later; False otherwise, and then never on the wire.
    The client library surfaces it as ``Client.draining``."""
    return _f(check_bool, since=(1, 14), default=False)


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


def _to_wire(value: Any) -> Any:
    """A field's msgpack form: objects with ``to_wire`` (tensors, graphs, devices, hand-offs)
    converted, tuples and lists as arrays."""
    if hasattr(value, "to_wire"):
        return value.to_wire()
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    return value


# ---------------------------------------------------------------------------------- messages


M = TypeVar("M", bound="Message")


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every request and reply: positional wire fields, validated on decode."""

    payload_frames: ClassVar[int] = 0
    """How many payload frames follow the header when their sizes are not known from the fields
    (a reply's fetched bytes, a relayed chunk)."""

    def payload_sizes(self) -> list[int] | None:
        """The exact byte size of each payload frame, when the fields say; else None."""
        return None

    def payload_count(self) -> int:
        """How many payload frames must follow this message's header."""
        sizes = self.payload_sizes()
        return len(sizes) if sizes is not None else type(self).payload_frames

    @classmethod
    def from_fields(cls: type[M], fields: Sequence[Any]) -> M:
        """Build from the header's fields, checking count, types and ranges."""
        if not fields and cls in _BARE:     # an Ack, an Empty: one shared instance
            return cast(M, _BARE[cls])
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
        if _BARE.get(type(self)) is self:   # every field at its default: none on the wire
            return []
        spec, defaults = _SPECS[type(self)], _LATER_DEFAULTS[type(self)]
        if not spec:
            return []
        values = [getattr(self, name) for name, _ in spec]
        end = len(values)
        while end > _REQUIRED[type(self)] and values[end - 1] == defaults[end - 1]:
            end -= 1
        return [_to_wire(v) for v in values[:end]]


_SPECS: dict[type[Message], list[tuple[str, Callable[[Any, str], Any]]]] = {}
_REQUIRED: dict[type[Message], int] = {}
"""How many leading fields every version of a message carries."""
_LATER_DEFAULTS: dict[type[Message], list[Any]] = {}
_BARE: dict[type[Message], Message] = {}
"""The instance of each message whose fields all default to immutable values, decoded from a
header without fields (frozen, so one instance serves every such reply)."""


def wire_message(cls: type[M]) -> type[M]:
    """Class decorator: make a Message subclass decodable (its fields' checkers collected)."""
    fields = dataclasses.fields(cls)
    _SPECS[cls] = [(f.name, f.metadata["check"]) for f in fields]
    later = [f.metadata.get("since") is not None for f in fields]
    _REQUIRED[cls] = later.index(True) if True in later else len(fields)
    if not all(later[_REQUIRED[cls]:]):
        raise TypeError(f"{cls.__name__}: fields added by later minors must come last")
    _LATER_DEFAULTS[cls] = [f.default if is_later else None for f, is_later in zip(fields, later)]
    if _REQUIRED[cls] == 0 and all(_immutable(f.default) for f in fields):
        _BARE[cls] = cls()
    return cls


def _immutable(default: Any) -> bool:
    """Whether a field's default may be shared by every instance (not a factory, nothing that
    can change)."""
    return isinstance(default, (int, float, str, bytes, type(None))) \
        or (type(default) is tuple and not default)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class Empty(Message):
    """A request or reply with no fields."""
