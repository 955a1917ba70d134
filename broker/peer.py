"""Worker-to-worker transfers: the client's requests and the messages peers push to each other.

Pure data and encoding; any thread may use it.

Client requests (ordinary DEALER→ROUTER requests, see :mod:`zmq_rpc.broker.protocol`):

- PEER_RECV on the destination worker B: expect transfer ``token`` into ``dst``. It runs in order in
  the client's session on B and *holds that session's queue* until the bytes have landed, so later
  requests of the session (a graph reading ``dst``) never see half a copy; other sessions go on.
- PEER_SEND on the source worker A: read ``src`` (in order in the client's session on A) and push it
  to B's peer endpoint; the reply comes when B has acknowledged the whole transfer, or (1.4,
  ``acked`` false) once the chunks have left A (handed to the kernel; at once for chunks copied
  into zmq), B sending no ack: the client learns of the landing from B's PEER_RECV reply alone,
  and A's reply only tells it that A no longer needs to live for the copy to complete.
- PEER_PROBE on A: can A reach the peer endpoint? (B answers a probe with an ack.)
- PEER_FILL on B: a chunk of transfer ``token`` relayed by the client itself (when A cannot reach
  B): it bypasses the session's queue, which the PEER_RECV holds. A non-empty ``error`` aborts the
  transfer instead (the client could not fetch the source).
- GRAPH_RUN_LINKED (protocol 1.1): a GRAPH_RUN fused with the hand-offs around it, so that a
  pipeline stage costs one request per step instead of three. On its worker it first waits, holding
  the session's queue like a PEER_RECV, until every ``receive`` transfer has landed; then it writes
  its inputs and runs the graph like GRAPH_RUN; then it pushes every ``send`` tensor to its peer
  (unacknowledged: ``reply_to`` is empty, and the receiving worker's own request reports a transfer
  that fails or never comes) and replies with the run's GraphReply. Issue the run that sends a
  hand-off before the run that receives it, or a receive may hold its queue ahead of a send that
  worker itself must make first (its timeout then fails it). Since 1.2, ``hold_reply_us`` (left
  off the wire when 0) lets the worker hold a successful reply that long after the pushes (sooner
  when another reply leaves; never when it fetched more than 64 KiB): a pipelining client keeps
  the reply's wake-ups off the CPUs the hand-off needs next.

Peer messages (A's PUSH → B's PULL, and acks B's PUSH → A's PULL): a msgpack header, then payload.
They are :class:`~zmq_rpc.broker.wire.Message` classes like the client's requests, decoded by the
same checkers, behind a version and a :class:`PeerKind`::

    [PEER_VERSION, CHUNK, token, seq, nchunks, start, total, reply_to]  + 1 frame: bytes at `start`
    [PEER_VERSION, ACK,   token, ok, message]        (only when the chunks named a reply_to)
    [PEER_VERSION, PROBE, token, reply_to]

A message of another peer version is refused (and logged by the receiving worker): workers of one
cluster run one release.

Chunks carry sequence numbers; the receiver acknowledges a transfer once every chunk has landed, or
reports why it failed. PUSH/PULL alone loses messages silently when a peer restarts: a transfer that
is not acknowledged before its deadline fails, with a clear error, on both sides.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from .errors import BadRequest
from .wire import (
    ErrorCode,
    Message,
    TensorRef,
    _f,
    _int_in,
    check_bool,
    check_str,
    check_tensor,
    describe,
    wire_message,
)

PEER_VERSION = 1
"""Version of the peer link's messages (the first element of every peer header)."""
TOKEN_BYTES = 16
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_HAND_OFFS = 256


def check_token(value: Any, field: str) -> bytes:
    if type(value) is not bytes or len(value) != TOKEN_BYTES:
        raise BadRequest(f"field {field!r}: a transfer token is {TOKEN_BYTES} bytes",
                         code=ErrorCode.BAD_REQUEST)
    return value


check_timeout = _int_in(1, MAX_TIMEOUT_MS)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRecv(Message):
    """On B: receive transfer ``token`` into ``dst`` (holds the session's queue until done)."""

    token: bytes = _f(check_token)
    dst: TensorRef = _f(check_tensor)
    timeout_ms: int = _f(check_timeout)
    source: str = _f(check_str, since=(1, 9), default="")
    """1.9 (``peer-link-watch``): the sending worker's peer endpoint, when it pushes straight
    here: this worker watches its own link to it and fails the receive with PEER_UNREACHABLE
    once that link is lost. Empty: not watched (relayed copies, older clients)."""


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSend(Message):
    """On A: push ``src`` to the worker whose peer endpoint is ``endpoint``, as ``token``."""

    token: bytes = _f(check_token)
    src: TensorRef = _f(check_tensor)
    endpoint: str = _f(check_str)
    timeout_ms: int = _f(check_timeout)
    acked: bool = _f(check_bool, since=(1, 4), default=True)
    """False (1.4, capability ``unacked-sends``): reply once the chunks have left this worker
    and ask the peer for no acknowledgement; B's PEER_RECV reply reports the landing (a copy
    then costs no ack and no wait for it). Off the wire when True."""


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerProbe(Message):
    """On A: check that the peer endpoint answers within ``timeout_ms``."""

    endpoint: str = _f(check_str)
    timeout_ms: int = _f(check_timeout)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class PeerFill(Message):
    """On B: one relayed chunk of transfer ``token`` (C-order bytes at ``start``), or an abort."""

    payload_frames: ClassVar[int] = 1
    token: bytes = _f(check_token)
    seq: int = _f(_int_in(0, (1 << 32) - 1))
    nchunks: int = _f(_int_in(1, (1 << 32) - 1))
    start: int = _f(_int_in(0, (1 << 63) - 1))
    total: int = _f(_int_in(0, (1 << 63) - 1))
    error: str = _f(check_str)


@dataclass(frozen=True, slots=True)
class Receive:
    """A hand-off a linked run waits for: transfer ``token`` lands in ``dst`` before the run."""

    token: bytes
    dst: TensorRef

    def to_wire(self) -> list[Any]:
        return [self.token, self.dst.to_wire()]


@dataclass(frozen=True, slots=True)
class Send:
    """A hand-off a linked run makes: ``src`` goes to the peer at ``endpoint`` after the run."""

    token: bytes
    src: TensorRef
    endpoint: str

    def to_wire(self) -> list[Any]:
        return [self.token, self.src.to_wire(), self.endpoint]


def _check_item(value: Any, field: str, arity: int) -> list[Any]:
    if type(value) is not list or len(value) != arity:
        raise BadRequest(f"field {field!r}: each entry is an array of {arity}",
                         code=ErrorCode.BAD_REQUEST)
    return value


def _check_hand_offs(build: Any, arity: int) -> Any:
    """A list of at most MAX_HAND_OFFS hand-offs with distinct tokens."""
    def check(value: Any, field: str) -> tuple[Any, ...]:
        if type(value) is not list or len(value) > MAX_HAND_OFFS:
            raise BadRequest(f"field {field!r}: an array of at most {MAX_HAND_OFFS} entries",
                             code=ErrorCode.BAD_REQUEST)
        items = tuple(build(_check_item(v, field, arity), field) for v in value)
        if len({item.token for item in items}) != len(items):
            raise BadRequest(f"field {field!r}: a transfer token appears twice",
                             code=ErrorCode.BAD_REQUEST)
        return items
    return check


check_receives = _check_hand_offs(
    lambda v, f: Receive(check_token(v[0], f), check_tensor(v[1], f)), 2)
check_sends = _check_hand_offs(
    lambda v, f: Send(check_token(v[0], f), check_tensor(v[1], f), check_str(v[2], f)), 3)


def check_sources(value: Any, field: str) -> tuple[str, ...]:
    """GRAPH_RUN_LINKED's ``receive_from``: at most MAX_HAND_OFFS peer endpoints (or "")."""
    if type(value) is not list or len(value) > MAX_HAND_OFFS:
        raise BadRequest(f"field {field!r}: an array of at most {MAX_HAND_OFFS} entries",
                         code=ErrorCode.BAD_REQUEST)
    return tuple(check_str(v, f"{field}[{i}]") for i, v in enumerate(value))


_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_u32 = _int_in(0, (1 << 32) - 1)
_u63 = _int_in(0, (1 << 63) - 1)



class PeerKind(enum.IntEnum):
    """What a peer message is (the second element of its header)."""

    CHUNK = 1
    ACK = 2
    PROBE = 3


@wire_message
@dataclass(frozen=True, slots=True)
class Chunk(Message):
    """One piece of a transfer: its payload frame is bytes at ``start`` of the tensor's C-ordered
    data; ``reply_to`` (a peer endpoint, or empty) wants the acknowledgement."""

    payload_frames: ClassVar[int] = 1
    token: bytes = _f(check_token)
    seq: int = _f(_u32)
    nchunks: int = _f(_int_in(1, (1 << 32) - 1))
    start: int = _f(_u63)
    total: int = _f(_u63)
    reply_to: str = _f(check_str)


@wire_message
@dataclass(frozen=True, slots=True)
class Ack(Message):
    """The receiver's verdict on a whole transfer (or a probe)."""

    token: bytes = _f(check_token)
    ok: bool = _f(check_bool)
    message: str = _f(check_str)


@wire_message
@dataclass(frozen=True, slots=True)
class Probe(Message):
    """Does the worker at ``reply_to``'s peer reach us? Answered with an Ack."""

    token: bytes = _f(check_token)
    reply_to: str = _f(check_str)


PEER_MESSAGES: dict[PeerKind, type[Chunk | Ack | Probe]] = {
    PeerKind.CHUNK: Chunk, PeerKind.ACK: Ack, PeerKind.PROBE: Probe}
_KINDS = {cls: kind for kind, cls in PEER_MESSAGES.items()}


def encode_peer(msg: Chunk | Ack | Probe) -> bytes:
    """The header frame of a peer message."""
    if isinstance(msg, Ack) and len(msg.message) > 1024:
        msg = Ack(msg.token, msg.ok, msg.message[:1024])
    return _pack([PEER_VERSION, int(_KINDS[type(msg)]), *msg.to_fields()])


MAX_PEER_HEADER = 32 << 10
"""A peer header's bytes: at most 8 fields, one string of at most MAX_STRING characters (4 bytes
each in UTF-8) among them. Refused before decoding: the peer port takes frames of 4 MiB, and
4 MiB of nested empty arrays cost the backend thread seconds to decode."""
MAX_PEER_FIELDS = 16


def decode_peer(frames: Sequence[Any]) -> Chunk | Ack | Probe:
    """Validate a message from a peer (anyone can reach a PULL socket: trust nothing)."""
    if len(frames[0]) > MAX_PEER_HEADER:
        raise BadRequest(f"peer header of {len(frames[0])} bytes is over {MAX_PEER_HEADER}")
    try:
        head = msgpack.unpackb(frames[0], raw=False, use_list=True,
                               max_array_len=MAX_PEER_FIELDS, max_map_len=0)
    except Exception as exc:
        raise BadRequest(f"peer message is not msgpack: {exc}") from None
    if type(head) is not list or len(head) < 2 or type(head[0]) is not int \
            or type(head[1]) is not int:
        raise BadRequest("peer message must be an array [version, kind, ...]")
    if head[0] != PEER_VERSION:
        raise BadRequest(f"peer message of version {describe(head[0])}; this worker speaks "
                         f"{PEER_VERSION}")
    cls = PEER_MESSAGES.get(head[1])  # type: ignore[call-overload]
    if cls is None:
        raise BadRequest(f"unknown peer message kind {describe(head[1])}")
    msg: Chunk | Ack | Probe = cls.from_fields(head[2:])
    if len(frames) - 1 != msg.payload_count():
        raise BadRequest(f"peer {cls.__name__} takes {msg.payload_count()} payload frame(s), "
                         f"got {len(frames) - 1}")
    if isinstance(msg, Chunk) and not msg.seq < msg.nchunks:
        raise BadRequest(f"chunk {msg.seq} of {msg.nchunks}")
    return msg
