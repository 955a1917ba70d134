"""Worker-to-worker transfers: the client's requests and the messages peers push to each other.

Pure data and encoding; any thread may use it.

Client requests (ordinary DEALER→ROUTER requests, see :mod:`zmq_rpc.broker.protocol`):

- PEER_RECV on the destination worker B: expect transfer ``token`` into ``dst``. It runs in order in
  the client's session on B and *holds that session's queue* until the bytes have landed, so later
  requests of the session (a graph reading ``dst``) never see half a copy; other sessions go on.
- PEER_SEND on the source worker A: read ``src`` (in order in the client's session on A) and push it
  to B's peer endpoint; the reply comes when B has acknowledged the whole transfer.
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

Peer messages (A's PUSH → B's PULL, and acks B's PUSH → A's PULL), header then payload::

    [PEER_CHUNK, token, seq, nchunks, start, total, reply_to]   + 1 frame: bytes at C-order `start`
    [PEER_ACK,   token, ok, message]                 (only when the chunks named a reply_to)
    [PEER_PROBE_MSG, token, reply_to]

Chunks carry sequence numbers; the receiver acknowledges a transfer once every chunk has landed, or
reports why it failed. PUSH/PULL alone loses messages silently when a peer restarts: a transfer that
is not acknowledged before its deadline fails, with a clear error, on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from .errors import BadRequest
from .protocol import (
    Cmd,
    Empty,
    ErrorCode,
    Message,
    TensorRef,
    _f,
    _int_in,
    check_str,
    check_tensor,
    register_command,
)

PEER_CHUNK = 1
PEER_ACK = 2
PEER_PROBE_MSG = 3
TOKEN_BYTES = 16
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_HAND_OFFS = 256


def check_token(value: Any, field: str) -> bytes:
    if type(value) is not bytes or len(value) != TOKEN_BYTES:
        raise BadRequest(f"field {field!r}: a transfer token is {TOKEN_BYTES} bytes",
                         code=ErrorCode.BAD_REQUEST)
    return value


check_timeout = _int_in(1, MAX_TIMEOUT_MS)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRecv(Message):
    """On B: receive transfer ``token`` into ``dst`` (holds the session's queue until done)."""

    token: bytes = _f(check_token)
    dst: TensorRef = _f(check_tensor)
    timeout_ms: int = _f(check_timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSend(Message):
    """On A: push ``src`` to the worker whose peer endpoint is ``endpoint``, as ``token``."""

    token: bytes = _f(check_token)
    src: TensorRef = _f(check_tensor)
    endpoint: str = _f(check_str)
    timeout_ms: int = _f(check_timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerProbe(Message):
    """On A: check that the peer endpoint answers within ``timeout_ms``."""

    endpoint: str = _f(check_str)
    timeout_ms: int = _f(check_timeout)


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


register_command(Cmd.PEER_FILL, PeerFill, Empty)
register_command(Cmd.PEER_RECV, PeerRecv, Empty)
register_command(Cmd.PEER_SEND, PeerSend, Empty)
register_command(Cmd.PEER_PROBE, PeerProbe, Empty)

_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a transfer: ``nbytes`` at byte ``start`` of the tensor's C-ordered data."""

    token: bytes
    seq: int
    nchunks: int
    start: int
    total: int
    reply_to: str


@dataclass(frozen=True, slots=True)
class Ack:
    """The receiver's verdict on a whole transfer (or a probe)."""

    token: bytes
    ok: bool
    message: str


@dataclass(frozen=True, slots=True)
class Probe:
    token: bytes
    reply_to: str


def encode_chunk(chunk: Chunk) -> bytes:
    return _pack([PEER_CHUNK, chunk.token, chunk.seq, chunk.nchunks, chunk.start, chunk.total,
                  chunk.reply_to])


def encode_ack(ack: Ack) -> bytes:
    return _pack([PEER_ACK, ack.token, ack.ok, ack.message[:1024]])


def encode_probe(probe: Probe) -> bytes:
    return _pack([PEER_PROBE_MSG, probe.token, probe.reply_to])


_u63 = _int_in(0, (1 << 63) - 1)


def decode_peer(frames: Sequence[Any]) -> Chunk | Ack | Probe:
    """Validate a message from a peer (anyone can reach a PULL socket: trust nothing)."""
    try:
        head = msgpack.unpackb(frames[0], raw=False, use_list=True)
    except Exception as exc:
        raise BadRequest(f"peer message is not msgpack: {exc}") from None
    if type(head) is not list or not head or type(head[0]) is not int:
        raise BadRequest("peer message must be an array [kind, ...]")
    kind, fields = head[0], head[1:]
    if kind == PEER_CHUNK and len(fields) == 6 and len(frames) == 2:
        token, seq, nchunks, start, total, reply_to = fields
        chunk = Chunk(check_token(token, "token"), _u63(seq, "seq"), _u63(nchunks, "nchunks"),
                      _u63(start, "start"), _u63(total, "total"), check_str(reply_to, "reply_to"))
        if not chunk.seq < chunk.nchunks:
            raise BadRequest(f"chunk {chunk.seq} of {chunk.nchunks}")
        return chunk
    if kind == PEER_ACK and len(fields) == 3 and len(frames) == 1:
        token, ok, message = fields
        if type(ok) is not bool:
            raise BadRequest("ack.ok must be a boolean")
        return Ack(check_token(token, "token"), ok, check_str(message, "message"))
    if kind == PEER_PROBE_MSG and len(fields) == 2 and len(frames) == 1:
        return Probe(check_token(fields[0], "token"), check_str(fields[1], "reply_to"))
    raise BadRequest(f"unknown peer message kind {kind} with {len(fields)} fields and "
                     f"{len(frames)} frame(s)")
