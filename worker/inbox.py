"""Requests read ahead from the broker's PAIR and handed to the executor in turns, one per client.

Owned by the backend thread (:class:`~zmq_rpc.worker.server.BackendThread`); no socket here. The
PAIR is one FIFO for every client; libzmq's proxy (broker.py) fills it with blocking sends and
forwards no reply while it waits for room. Served straight from the PAIR, a well-behaved client's
request waited behind the whole PAIR (64 requests, in any mix of other clients), and its reply
waited in the PAIR until the proxy had pushed every request queued at the ROUTER (the fuzzer's
four hostile sessions: up to 256 of them, some taking ~1 s each under load; CI saw a probe
answered after more than 5 s).

So after each request it handles, the backend thread reads the PAIR empty (at most once per
:data:`READ_AHEAD_EVERY_NS`; up to :data:`READ_AHEAD_MESSAGES` messages and
:data:`READ_AHEAD_BYTES` bytes held here, then it stops reading and libzmq's backpressure works
as before) and takes the next request from each client in turn; with nothing held here it takes
the PAIR's next message, the oldest of all. A request then waits for the one being handled, at
most a millisecond's worth more, and at most one of each other client with requests here; the
proxy, finding room in the PAIR, keeps forwarding replies. Each client's own requests keep
their order.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Any

__all__ = ["READ_AHEAD_BYTES", "READ_AHEAD_EVERY_NS", "READ_AHEAD_MESSAGES", "Inbox"]

READ_AHEAD_MESSAGES = 1024
"""Most messages held here: our client keeps at most 512 in flight, the fuzzer 4 x 64."""
READ_AHEAD_BYTES = 16 << 20
"""Most bytes held here (a message bigger than this is still taken when the inbox is empty)."""
READ_AHEAD_EVERY_NS = 1_000_000
"""How often the backend reads the PAIR while it works through the inbox: a newly arrived client
waits this long at most before it has its turn. Reading it before every request (the first
version) cost a pipelining client ~20 % of its calls/s and every ping ~40 us (quiet A/B)."""

Frames = list[Any]
"""``[client_id, header, *payload]`` as ``zmq.Frame``s (anything with ``.bytes`` and a length)."""


class Inbox:
    """Messages per client, taken round-robin: each client with messages here gets one per turn."""

    def __init__(self, max_messages: int = READ_AHEAD_MESSAGES,
                 max_bytes: int = READ_AHEAD_BYTES) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._clients: OrderedDict[bytes, deque[tuple[Frames, int, int]]] = OrderedDict()
        self.messages = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self.messages

    def full(self) -> bool:
        """Whether to stop reading the PAIR (libzmq then holds what comes next)."""
        return self.messages >= self.max_messages or self.nbytes >= self.max_bytes

    def put(self, frames: Frames) -> None:
        """Queue one message behind the earlier ones of its client (``frames[0]``, its id)."""
        client = frames[0].bytes if frames else b""
        size = sum(len(f) for f in frames)
        queue = self._clients.get(client)
        if queue is None:
            queue = self._clients[client] = deque()
        queue.append((frames, size, time.perf_counter_ns()))
        self.messages += 1
        self.nbytes += size

    def take(self) -> tuple[Frames, int] | None:
        """The oldest message of the client whose turn it is, and when it was put here
        (``perf_counter_ns``; the request's arrival for queue-wait figures), or None when empty.
        That client goes to the back of the turn."""
        if not self._clients:
            return None
        client, queue = next(iter(self._clients.items()))
        frames, size, arrived = queue.popleft()
        if queue:
            self._clients.move_to_end(client)
        else:
            del self._clients[client]
        self.messages -= 1
        self.nbytes -= size
        return frames, arrived
