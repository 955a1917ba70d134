"""Requests read ahead from the broker's PAIR and handed to the executor by backend time used.

Owns the read-ahead queues and every client's virtual time; run by the backend thread
(:class:`~zmq_rpc.worker.backend_thread.BackendThread`); no socket here. The PAIR is one FIFO for every
client, and libzmq's proxy (broker.py) fills it with blocking sends and forwards no reply while it
waits for room: served straight from the PAIR, a well-behaved client's request would wait behind
every request queued there, and its reply behind every request queued at the ROUTER.

So after each request it handles, the backend thread reads the PAIR empty (at most once per
:data:`READ_AHEAD_EVERY_NS`; up to :data:`READ_AHEAD_MESSAGES` messages and
:data:`READ_AHEAD_BYTES` bytes held here, then it stops reading and libzmq's backpressure works
as before). The proxy, finding room in the PAIR, keeps forwarding replies. Each client's own
requests keep their order.

Which client goes next is fair queuing by backend time, not by turns: each client has a virtual
time, the backend nanoseconds its requests took (:meth:`Inbox.charge`), and the client with the
least goes next (ties: the one waiting longest, so equal costs make plain turns). A client that
had nothing here starts from the virtual time of the request taken last, so idling banks no
credit. Plain turns would make a ping wait for one request of *every* other client, however long
those are; by backend time, a client whose requests are cheap goes before those whose last
requests were long: it waits for the request being handled (at most a millisecond's worth more,
the read-ahead) and for no other; a client that keeps sending long requests gets its share of the
backend's time, no more, while the others have requests here. The figures that led here:
docs/DESIGN.md, "The backend's inbox".
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from typing import Any

__all__ = ["FORGET_ABOVE", "READ_AHEAD_BYTES", "READ_AHEAD_EVERY_NS", "READ_AHEAD_MESSAGES", "Inbox"]

READ_AHEAD_MESSAGES = 1024
"""Most messages held here: our client keeps at most 512 in flight, the fuzzer 4 x 64."""
READ_AHEAD_BYTES = 16 << 20
"""Most bytes held here (a message bigger than this is still taken when the inbox is empty)."""
READ_AHEAD_EVERY_NS = 1_000_000
"""How often the backend reads the PAIR while it works through the inbox: a newly arrived client
waits this long at most before it has its turn. Not before every request: that costs every
request a read of an empty PAIR (docs/DESIGN.md)."""
FORGET_ABOVE = 4096
"""Clients remembered before those with nothing here and no time ahead are forgotten (a client
that sent a long request keeps its virtual time until the others have caught up)."""

Frames = list[Any]
"""``[client_id, header, *payload]`` as ``zmq.Frame``s (anything with ``.bytes`` and a length)."""


class _Client:
    """One client's messages here and its virtual time (backend ns, see the module docstring)."""

    __slots__ = ("queue", "vtime", "entry")

    def __init__(self, vtime: int) -> None:
        self.queue: deque[tuple[Frames, int, int]] = deque()
        self.vtime = vtime
        self.entry = -1
        """The sequence number of this client's live entry in the turn heap (-1: none)."""


class Inbox:
    """Messages per client; the client with the least backend time used goes next."""

    def __init__(self, max_messages: int = READ_AHEAD_MESSAGES,
                 max_bytes: int = READ_AHEAD_BYTES) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._clients: dict[bytes, _Client] = {}
        self._turns: list[tuple[int, int, bytes]] = []
        """``(vtime, seq, client)`` of each client with messages here; stale entries (an older
        ``seq`` than the client's ``entry``) are skipped."""
        self._seq = itertools.count()
        self.vtime = 0
        """The virtual time of the request taken last (never goes back)."""
        self.messages = 0
        self.nbytes = 0
        self._forget_at = FORGET_ABOVE

    def __len__(self) -> int:
        return self.messages

    def holds(self, client_id: bytes) -> bool:
        """Whether a message of ``client_id`` waits here (read from the PAIR, not yet handled)."""
        client = self._clients.get(client_id)
        return client is not None and bool(client.queue)

    def full(self) -> bool:
        """Whether to stop reading the PAIR (libzmq then holds what comes next)."""
        return self.messages >= self.max_messages or self.nbytes >= self.max_bytes

    def put(self, frames: Frames) -> None:
        """Queue one message behind the earlier ones of its client (``frames[0]``, its id)."""
        client_id = frames[0].bytes if frames else b""
        size = sum(len(f) for f in frames)
        client = self._client(client_id)
        if not client.queue:
            client.vtime = max(client.vtime, self.vtime)      # idling banks no credit
            self._enter(client_id, client)
        client.queue.append((frames, size, time.perf_counter_ns()))
        self.messages += 1
        self.nbytes += size

    def take(self) -> tuple[Frames, int] | None:
        """The oldest message of the client with the least virtual time, and when it was put
        here (``perf_counter_ns``; the request's arrival for queue-wait figures), or None when
        empty."""
        while self._turns:
            vtime, seq, client_id = heapq.heappop(self._turns)
            client = self._clients.get(client_id)
            if client is None or client.entry != seq or not client.queue:
                continue                                    # superseded by a later entry
            self.vtime = max(self.vtime, vtime)
            frames, size, arrived = client.queue.popleft()
            client.entry = -1
            if client.queue:
                self._enter(client_id, client)
            self.messages -= 1
            self.nbytes -= size
            return frames, arrived
        return None

    def charge(self, client_id: bytes, ns: int) -> None:
        """Add ``ns`` of backend time to ``client_id``'s virtual time (after one of its
        requests ran, whether it came through here or straight from the PAIR)."""
        client = self._client(client_id)
        client.vtime = max(client.vtime, self.vtime) + max(ns, 0)
        if client.queue:
            self._enter(client_id, client)                  # its old entry goes stale
        if len(self._clients) > self._forget_at:
            self._forget()

    def _client(self, client_id: bytes) -> _Client:
        client = self._clients.get(client_id)
        if client is None:
            client = self._clients[client_id] = _Client(self.vtime)
        return client

    def _enter(self, client_id: bytes, client: _Client) -> None:
        client.entry = next(self._seq)
        heapq.heappush(self._turns, (client.vtime, client.entry, client_id))

    def _forget(self) -> None:
        """Drop the clients with nothing here whose virtual time the others have reached: they
        would start from :attr:`vtime` anyway."""
        for client_id in [c for c, client in self._clients.items()
                          if not client.queue and client.vtime <= self.vtime]:
            del self._clients[client_id]
        self._forget_at = max(FORGET_ABOVE, 2 * len(self._clients))   # amortized: never a
        # sweep per request while thousands of clients are ahead
