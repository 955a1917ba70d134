"""Proof, in HELLO, of the CURVE key that opens a session (protocol 1.8, ``key-proof``).

Pure functions; any thread may call them. Why a proof at all: the worker's backend thread sees a
request as ``[routing id, header, *payload]`` only. The CURVE key libzmq authenticated (ZAP's
User-Id) is message metadata, and metadata does not survive the broker's ``zmq.proxy_steerable``
hop to the backend (a Python forwarding loop that could read it costs far more per message:
docs/DESIGN.md), so the backend cannot tell which key sent a message. The client therefore proves its key
in-band: HELLO carries the key and a crypto box (Curve25519 + XSalsa20-Poly1305, libsodium via
PyNaCl) from that key's secret to the worker's public key over a context string and the
session's routing id. Only the holder of the key's secret (or the worker itself) can make one;
under CURVE nobody else ever sees it (the link is encrypted), and binding the routing id stops
a proof from opening any other session.
"""

from __future__ import annotations

import os

from zmq.utils import z85

CONTEXT = b"zmq-rpc 1.8 session key proof\0"


def prove(client_secret: bytes, worker_public: bytes, routing_id: bytes) -> tuple[bytes, bytes]:
    """(raw public key, proof) for a HELLO; keys are Z85 text as in key files."""
    from nacl.public import Box, PrivateKey, PublicKey

    secret = PrivateKey(z85.decode(client_secret))
    box = Box(secret, PublicKey(z85.decode(worker_public)))
    proof = bytes(box.encrypt(CONTEXT + routing_id, os.urandom(24)))
    return bytes(secret.public_key), proof


def verify(worker_secret: bytes, key: bytes, proof: bytes, routing_id: bytes) -> bool:
    """Whether ``proof`` was made with the secret of ``key`` (raw, 32 bytes) for
    ``routing_id``; ``worker_secret`` is Z85 text."""
    from nacl.exceptions import CryptoError
    from nacl.public import Box, PrivateKey, PublicKey

    if len(key) != 32:
        return False
    box = Box(PrivateKey(z85.decode(worker_secret)), PublicKey(key))
    try:
        return box.decrypt(proof) == CONTEXT + routing_id
    except (CryptoError, ValueError, TypeError):
        return False

