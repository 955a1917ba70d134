"""When each pending request of one connection times out: a FIFO for the usual case and a heap
for the rest, with no sockets and no clock of its own (the caller says what time it is).

Threads: owned by whoever drives the connection's loop (the holder of its socket lock: the I/O
thread, or a blocking caller); never touched by two threads at once.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Container, Iterator
from typing import Generic, Protocol, TypeVar

NEVER = float("inf")

COMPACT_SLACK = 4096
"""Stale entries (answered calls) tolerated beyond twice the live ones before compacting."""


class Timed(Protocol):
    """What a timer is set on: a request with its id, its deadline, and whether it is done."""

    @property
    def req_id(self) -> int: ...

    @property
    def deadline(self) -> float: ...

    @property
    def settled(self) -> bool: ...


T = TypeVar("T", bound=Timed)


class Deadlines(Generic[T]):
    """The deadlines of a connection's pending calls and reservations.

    Calls usually share one timeout, so their deadlines rise with submission: those go to
    ``fifo`` (appended and dropped in O(1), no tuple per call), answered ones dropped lazily from
    its head. A call whose deadline is earlier than the last one in ``fifo`` (a shorter timeout),
    and every reservation (known by its id only), go to ``heap`` as ``(deadline, req_id)``.
    Entries of answered requests stay until they are due or :meth:`compact` drops them; what
    :meth:`due` yields may therefore be answered already: the caller checks.
    """

    def __init__(self) -> None:
        self.fifo: deque[T] = deque()
        self.heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def watch(self, item: T) -> None:
        """Time ``item`` out at its deadline."""
        fifo = self.fifo
        if not fifo or fifo[-1].deadline <= item.deadline:
            fifo.append(item)
        else:
            heapq.heappush(self.heap, (item.deadline, item.req_id))

    def watch_id(self, deadline: float, req_id: int) -> None:
        """Time out whatever ``req_id`` names then (a reservation, looked up when due)."""
        heapq.heappush(self.heap, (deadline, req_id))

    def next(self) -> float:
        """The earliest deadline of an entry not known to be answered (``NEVER``: none); the
        answered ones at the head of ``fifo`` are dropped on the way."""
        fifo = self.fifo
        while fifo and fifo[0].settled:
            fifo.popleft()
        first = fifo[0].deadline if fifo else NEVER
        heap = self.heap
        return heap[0][0] if heap and heap[0][0] < first else first

    def due(self, now: float) -> Iterator[T | int]:
        """Remove and yield what is due at ``now``: the unanswered calls of ``fifo`` first (in
        deadline order), then the ids of ``heap`` (in deadline order). The caller may add
        entries while it iterates (a failed call's callback submits again)."""
        fifo = self.fifo
        while fifo and fifo[0].deadline <= now:
            item = fifo.popleft()
            if not item.settled:
                yield item
        heap = self.heap
        while heap and heap[0][0] <= now:
            yield heapq.heappop(heap)[1]

    def timeout_ms(self, now: float, cap_ms: int, deadline: float = NEVER) -> int:
        """Milliseconds from ``now`` until the next deadline (or ``deadline``, if earlier),
        rounded up, at most ``cap_ms``, 0 when one has passed."""
        deadline = min(deadline, self.next())
        if deadline == NEVER:
            return cap_ms
        wait = int((deadline - now) * 1000) + 1
        return cap_ms if wait > cap_ms else wait if wait > 0 else 0

    def bloated(self, live: int) -> bool:
        """Whether answered entries outnumber the ``live`` requests enough to :meth:`compact`
        (they otherwise stay until their deadline, or in ``fifo`` until those before them are
        answered)."""
        return len(self.fifo) + len(self.heap) > 2 * live + COMPACT_SLACK

    def compact(self, live: Container[int]) -> None:
        """Keep the unanswered calls of ``fifo`` and the heap entries whose id is in ``live``."""
        self.fifo = deque(item for item in self.fifo if not item.settled)
        self.heap = [entry for entry in self.heap if entry[1] in live]
        heapq.heapify(self.heap)
