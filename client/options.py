"""How one worker connection paces and guards its requests (:class:`ConnectionOptions`), and
which endpoints zmq-rpc connects to (:func:`check_endpoint`).

Plain data, no sockets and no threads: read by whoever builds or drives a connection.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..broker.endpoints import EndpointError, parse_endpoint
from ..broker.errors import BadEndpoint
from .security import CurveClient

DEFAULT_WINDOW_BYTES = 64 << 20
"""Payload bytes in flight per client (sixteen 4 MiB chunks; docs/CLIENT_DESIGN.md). Each byte
in flight is a message the worker holds until its backend thread copies it out, so a client that
shares a worker with many others can pass a smaller ``window_bytes``."""

MAX_TIMINGS = 100_000
"""Timings kept until read (``Connection.drain_timings``); older ones are dropped."""


@dataclass
class ConnectionOptions:
    """How a connection paces and guards its requests."""

    timeout: float = 60.0
    window: int = 512
    window_bytes: int = DEFAULT_WINDOW_BYTES
    heartbeat: float = 2.0
    """Seconds of silence after which the client pings the worker (keeps the session alive)."""
    zmq_heartbeat_ms: int = 500
    zmq_heartbeat_timeout_ms: int = 5000
    """libzmq's ZMTP heartbeat: a worker silent this long after a heartbeat is declared lost."""
    identity: bytes = field(default_factory=lambda: b"z" + os.urandom(15))
    """The routing id workers key this client's session by: random, never starting with 0x00."""
    trace: bool = False
    """Record a ``RequestTiming`` per request whose reply carries the worker's timing."""
    curve: CurveClient | None = None
    """Speak CURVE with this key pair to a worker with this public key (None: plain ZMTP)."""


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if zmq-rpc can connect to it, else :class:`BadEndpoint` saying why (read
    the way libzmq reads it: :mod:`zmq_rpc.broker.endpoints`)."""
    try:
        parse_endpoint(endpoint, wildcard_port=False)
    except EndpointError as exc:
        raise BadEndpoint(str(exc)) from None
    return endpoint
