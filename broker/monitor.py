"""libzmq socket monitor events, read without ``zmq.utils.monitor`` (which imports
``zmq.asyncio``, and asyncio with it: ~30 ms of every client's and worker's start-up).

A monitor PAIR socket receives two frames per event: 6 bytes (the event, uint16, and its
value, uint32, in the host's byte order, no padding), then the endpoint. Any thread: the
caller owns the monitor socket.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import zmq

_HEAD = struct.Struct("=HI")


@dataclass(frozen=True, slots=True)
class MonitorEvent:
    """One event: ``event`` a ``zmq.EVENT_*`` bit, ``value`` its number (an fd, an errno, a
    handshake error code), ``endpoint`` the address it concerns."""

    event: int
    value: int
    endpoint: bytes


def parse_event(frames: list[bytes]) -> MonitorEvent:
    """The event in a monitor message; ValueError when it is not one."""
    if len(frames) != 2 or len(frames[0]) != _HEAD.size:
        raise ValueError(f"not a monitor event: {len(frames)} frame(s) "
                         f"of {[len(f) for f in frames]} bytes")
    event, value = _HEAD.unpack(frames[0])
    return MonitorEvent(event, value, frames[1])


def recv_event(monitor: zmq.Socket[bytes]) -> MonitorEvent:
    """Receive (blocking) and parse the next event of ``monitor``."""
    return parse_event(monitor.recv_multipart())
