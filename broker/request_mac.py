"""Per-request authentication of a session (protocol 1.10, ``request-mac``).

Pure functions and small per-session objects; a :class:`Signer` belongs to whoever drives the
client's connection (the holder of its socket lock, ``client/connection.py``), a
:class:`Verifier` to the worker's backend thread.

Why: the worker keys a session by the client's 16-byte routing id, and its backend thread cannot
see which connection a message came on (libzmq's metadata does not cross the broker's proxy hop,
``ZMQ_ROUTER_NOTIFY`` is draft-only, ZAP never sees the routing id). A client that left without
GOODBYE thus left its session to whoever presented its routing id next, which travels in the
clear on a plain link. So a session opened by our client signs every request:

- **key exchange at HELLO**: HELLO carries an ephemeral X25519 public key (``exchange``); the
  worker answers with its own in the HELLO reply. Both derive the session's MAC key from the
  shared secret, the routing id and both public keys (:func:`derive`). An eavesdropper on a plain
  link sees both public keys, not the secret; under CURVE it sees nothing at all;
- **every later request** of that session ends its header frame with a trailer, a msgpack
  ``bin 8`` of 24 bytes right after the header's array::

      [cmd, req_id, fields...] | c4 18 | seq: u64 big-endian | tag: 16 bytes

  where ``tag`` is keyed BLAKE2b-128 over everything before it (the header's bytes, which hold
  the command, the request id and every field, then ``c4 18`` and ``seq``). ``seq`` counts the
  session's signed requests as they are sent (request ids do not follow the send order: a
  reservation's requests and other threads' take ids earlier) and must strictly grow, so no
  request can be replayed. Payload frames are not covered: their sizes are in the header, and a
  request is accepted at most once, so a stranger can write no bytes of its choice under a
  signed header unless it holds a signed header the worker never received (an active attack on
  a plain link, out of scope, see docs/SECURITY.md).

The worker refuses (``NOT_AUTHENTIC``) a request of a signed session whose trailer is missing,
wrong or old, before it touches the session. Sessions opened without the exchange (older
clients, raw protocol clients) are not signed, and are as unprotected as before.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["EXCHANGE_BYTES", "TRAILER_BYTES", "Signer", "Verifier", "derive", "new_exchange",
           "strip_trailer"]

EXCHANGE_BYTES = 32
"""An X25519 public key."""
_HEAD = b"\xc4\x18"
"""msgpack's ``bin 8`` of 24 bytes: the trailer is one msgpack value after the header's array."""
_TAG = 16
TRAILER_BYTES = len(_HEAD) + 8 + _TAG
_PERSON = b"zmq-rpc mac 1.10"


def new_exchange() -> tuple[bytes, bytes]:
    """An ephemeral X25519 key pair: (public, secret)."""
    from nacl.bindings import crypto_box_keypair

    public, secret = crypto_box_keypair()
    return public, secret


def derive(secret: bytes, their_public: bytes, routing_id: bytes, client_public: bytes,
           worker_public: bytes) -> bytes | None:
    """The session's MAC key (32 bytes), or None when ``their_public`` is no usable key (a
    low-order point gives a shared secret of zeros, which an attacker could know)."""
    from nacl.bindings import crypto_scalarmult

    if len(their_public) != EXCHANGE_BYTES:
        return None
    try:
        shared = crypto_scalarmult(secret, their_public)
    except Exception:  # noqa: BLE001 - libsodium refuses low-order points (RuntimeError et al.)
        return None
    if not any(shared):
        return None
    return hashlib.blake2b(client_public + worker_public + routing_id, key=shared,
                           digest_size=32, person=_PERSON).digest()


class Signer:
    """The client's side: appends the trailer to each request header it sends."""

    __slots__ = ("_base", "_seq")

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=key, digest_size=_TAG)
        """Keyed once: a copy per request is cheaper than keying again."""
        self._seq = 0

    def sign(self, header: bytes) -> bytes:
        """``header`` with the trailer of the next request of the session."""
        self._seq += 1
        body = header + _HEAD + self._seq.to_bytes(8, "big")
        state = self._base.copy()
        state.update(body)
        return body + state.digest()


class Verifier:
    """The worker's side: checks and strips each request's trailer."""

    __slots__ = ("_base", "seq")

    def __init__(self, key: bytes) -> None:
        self._base = hashlib.blake2b(key=key, digest_size=_TAG)
        self.seq = 0
        """The last sequence number accepted."""

    def open(self, frame: memoryview | bytes) -> bytes | str:
        """The header without its trailer, if the trailer is right; else why not (the caller
        refuses the request, and nothing else changes here)."""
        data = bytes(frame)     # slicing and comparing bytes costs a third of a memoryview's
        end = len(data) - TRAILER_BYTES
        if end < 0 or data[end:end + 2] != _HEAD:
            return "this session signs its requests (protocol 1.10, request-mac): no signature"
        state = self._base.copy()
        state.update(data[:-_TAG])
        if not hmac.compare_digest(state.digest(), data[-_TAG:]):
            return "wrong request signature (this session was opened by another client)"
        seq = int.from_bytes(data[end + 2:end + 10], "big")
        if seq <= self.seq:
            return f"request sequence {seq} replayed (last was {self.seq})"
        self.seq = seq
        return data[:end]


def strip_trailer(frame: memoryview | bytes) -> memoryview | bytes | None:
    """``frame`` without what looks like a trailer (unchecked), or None if it has none: how a
    worker reads the request id of a signed request it cannot check (its session is gone)."""
    end = len(frame) - TRAILER_BYTES
    if end < 0 or frame[end:end + 2] != _HEAD:
        return None
    return frame[:end]
