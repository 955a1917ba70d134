"""Replies from the backend thread to the broker: encoded, tracked when zero-copy, kept in order.

Owned by the backend thread; ``send`` is its end of the inproc PAIR. Every reply leaves through
:class:`Outbox`: a reply that may be held (:class:`~zmq_rpc.worker.graphs.linked.HeldReplies`) waits
there, and any other reply first sends the held ones, so replies leave in the order they were made.

Every successful reply is checked here against the protocol, as a client decodes it (header
size, field count, types and ranges, payload frame count), before it leaves: one that would not
decode is logged and replaced by an INTERNAL error reply, never sent (a client would otherwise
raise BadRequest for the worker's mistake, e.g. a 4,140-character ``reason``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from ...broker import protocol as p
from ...broker.errors import BadRequest
from ...broker.protocol import ErrorCode
from ..graphs.linked import HeldReplies
from ..sessions.quotas import Charged, InFlight
from ..sessions.session import Reply
from ..sessions.views import TrackedPayload

log = logging.getLogger("zmq_rpc.worker")

Send = Callable[..., Any]
"""``zmq.Socket.send_multipart`` of the PAIR (its overloads have no nameable single type)."""


class Outbox:
    """Sends replies and error replies, holding back those that may wait."""

    def __init__(self, send: Send, inflight: InFlight,
                 count: Callable[[bytes, list[Any]], None] | None = None) -> None:
        self._send = send
        self._count = count or _uncounted
        """Told each reply's header and payload (the metrics' client bytes out)."""
        self.inflight = inflight
        self.held = HeldReplies()

    def reply(self, client_id: bytes, req_id: int, reply: Reply, hold_us: int = 0) -> None:
        """Send a successful reply, or hold it up to ``hold_us`` when it is small enough."""
        if hold_us and self.held.hold(client_id, req_id, reply, hold_us):
            return
        if self.held:
            self.release_held()
        self._send_reply(client_id, req_id, *reply)

    def error(self, client_id: bytes, req_id: int, code: ErrorCode, message: str) -> None:
        """Send an error reply (after any held ones)."""
        log.debug("error reply %s to %s: %s", code.name, client_id.hex()[:8], message)
        if self.held:
            self.release_held()
        header = p.encode_error(req_id, code, message)
        self._count(header, [])
        self._send([client_id, header])

    def release_held(self, now: float | None = None) -> None:
        """Send the held replies that are due (all of them when ``now`` is None)."""
        if not self.held:
            return
        for held in self.held.due(now):
            self._send_reply(held.client_id, held.req_id, *held.reply)

    def next_release(self) -> float | None:
        """When the oldest held reply is due (None if nothing is held)."""
        return self.held.next_release()

    def _send_reply(self, client_id: bytes, req_id: int, msg: p.Message,
                    payload: list[Any]) -> None:
        """Big payloads that alias buffer memory go zero-copy, and their buffers track them; so
        do big copies (their bytes stay counted in memory until sent)."""
        header = p.encode_reply(req_id, msg)
        broken = _breaks_protocol(header, msg, payload)
        if broken is not None:
            log.error("not sending a %s reply that breaks the protocol (%s)",
                      type(msg).__name__, broken)
            self.error(client_id, req_id, ErrorCode.INTERNAL,
                       f"the worker made a {type(msg).__name__} reply that breaks the protocol "
                       f"({broken}); it was not sent")
            return
        tracked = [b for b in payload if isinstance(b, (TrackedPayload, Charged))]
        if not tracked:
            self._count(header, payload)
            frames = [client_id, header, *payload]
            small = all(len(f) < zmq.COPY_THRESHOLD for f in payload)
            self._send(frames, copy=small)   # copying tiny frames beats making zero-copy ones
            return
        frames = [client_id, header,
                  *[b.data if isinstance(b, (TrackedPayload, Charged)) else b for b in payload]]
        self._count(header, frames[2:])
        tracker = self._send(frames, copy=False, track=True)
        for item in tracked:
            if isinstance(item, Charged):
                self.inflight.add(tracker, item)
            else:
                item.buffer.sending.append(tracker)


def _breaks_protocol(header: bytes, msg: p.Message, payload: list[Any]) -> str | None:
    """Why a client could not decode this reply (as ``client.loop`` does), or None."""
    if header[:1] == b"\x92" and not payload and msg.payload_count() == 0:
        return None       # [STATUS_OK, req_id], no fields: what from_fields([]) takes (hot path)
    try:
        type(msg).from_fields(p.unpack_header(header)[2:])
    except BadRequest as exc:
        return exc.message
    if len(payload) != msg.payload_count():
        return f"{len(payload)} payload frame(s), the reply says {msg.payload_count()}"
    return None


def _uncounted(header: bytes, payload: list[Any]) -> None:
    """No metrics: count nothing."""
