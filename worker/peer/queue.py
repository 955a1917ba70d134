"""The peer port's receive queue, on the backend thread: bounded per connection, counted in ``--mem``.

Owned by the backend thread (through :class:`~zmq_rpc.worker.peer.links.PeerLinks`, which binds
the PULL socket and hands it here before binding). libzmq reads each connection to the peer port
ahead of the backend, into a queue of at most :data:`PEER_RCVHWM` messages (the socket's
RCVHWM) plus the one it is decoding, and refuses any frame over :data:`PEER_FRAME_BYTES`
(MAXMSGSIZE: the connection is dropped). So one connection holds at most
:data:`QUEUE_BYTES_PER_CONNECTION` bytes that the backend has not read yet; a sender with more
to push keeps it on its own side (a PUSH with SNDHWM 0: there it is its buffer, or counted
in its own ``--mem`` while materialized).

:class:`PeerQueue` watches the socket's connections (a monitor: accepted, disconnected) and
counts that bound against the worker's ``--mem`` for every open one, from the moment it is
accepted until it closes: what sessions may allocate shrinks by it, so buffers, replies, the
early-chunk stash and the queue together stay within ``--mem``. A connection accepted while
``--mem`` is fully in use is counted over the limit (nothing more is allocated until it
closes): the worker can then hold at most that connection's bound beyond ``--mem``.
"""

from __future__ import annotations

import zmq

from ...broker.monitor import recv_event
from ..sessions.memory import MemoryBudget
from .send import CHUNK_BYTES

PEER_RCVHWM = 2
"""Peer messages libzmq queues per sending connection before it stops reading it (was 256:
1 GiB of 4 MiB chunks per connection, outside --mem). Two keep a connection's reads ahead of
the backend while it lands the previous chunk (with 1, libzmq 4.3.5 never delivered a probe
over a CURVE connection: tests/test_security.py::test_peer_copy_between_curve_workers)."""
PEER_FRAME_BYTES = CHUNK_BYTES + 64 * 1024
"""The largest frame the peer port takes: a sender's chunk (a chunk header is far smaller)."""
QUEUE_BYTES_PER_CONNECTION = (PEER_RCVHWM + 1) * 2 * PEER_FRAME_BYTES
"""What one connection to the peer port can hold unread: its queue and the message being
decoded, each at most two frames of at most PEER_FRAME_BYTES."""


class PeerQueue:
    """The PULL socket's per-connection receive queues, bounded and counted against ``--mem``."""

    def __init__(self, pull: zmq.Socket[bytes]) -> None:
        pull.setsockopt(zmq.RCVHWM, PEER_RCVHWM)
        pull.setsockopt(zmq.MAXMSGSIZE, PEER_FRAME_BYTES)
        self.monitor = pull.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.pull = pull
        self.connections = 0
        self.budget: MemoryBudget | None = None

    @property
    def nbytes(self) -> int:
        """What the open connections may hold, as counted against ``--mem``."""
        return self.connections * QUEUE_BYTES_PER_CONNECTION

    def use_budget(self, budget: MemoryBudget) -> None:
        """Count the open connections' queues against ``budget`` from now on."""
        budget.hold(self.nbytes)
        self.budget = budget

    def update(self) -> None:
        """Count the connections opened and closed since the last look."""
        while self.monitor.poll(0):
            event = recv_event(self.monitor).event
            if event == zmq.EVENT_ACCEPTED:
                self.connections += 1
                if self.budget is not None:
                    self.budget.hold(QUEUE_BYTES_PER_CONNECTION)
            elif event == zmq.EVENT_DISCONNECTED and self.connections:
                self.connections -= 1
                if self.budget is not None:
                    self.budget.release(QUEUE_BYTES_PER_CONNECTION)

    def close(self) -> None:
        self.pull.disable_monitor()
        self.monitor.close(linger=0)
