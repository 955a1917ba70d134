"""Whole messages in and out of the backend's PAIR socket, through pyzmq's C-level socket methods.

Runs on the backend thread, which alone uses the PAIR. pyzmq's ``recv_multipart`` asks the socket
for ``RCVMORE`` after each frame and ``send_multipart`` ORs ``SNDMORE`` into its flags per frame,
both through Python ``enum`` objects; on the backend's hot path (every request and every reply)
that was about a tenth of its time per ping. A received :class:`zmq.Frame` already says whether
more follow (``Frame.more``), and the flags are plain ints here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _CSocket

__all__ = ["recv_message", "send_message"]

_recv = _CSocket.recv
_send = _CSocket.send
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def recv_message(sock: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """The next whole message, without waiting (``zmq.Again`` when there is none): its parts
    arrive together, so only the first receive can find nothing."""
    frame: zmq.Frame = _recv(sock, _NOBLOCK, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, _NOBLOCK, False)
        frames.append(frame)
    return frames


def send_message(sock: zmq.Socket[bytes], frames: Sequence[Any], copy: bool = True,
                 track: bool = False) -> Any:
    """``sock.send_multipart(frames, copy=copy, track=track)``: the last part's tracker (when
    ``track``), as pyzmq's returns."""
    last = len(frames) - 1
    for frame in frames[:last]:
        _send(sock, frame, _SNDMORE, copy, track)
    return _send(sock, frames[last], 0, copy, track)
