"""Per-session quotas, and the bytes a reply or a push holds until libzmq has sent it.

Owned by the backend thread (the executor keeps one :class:`InFlight` and each session one
:class:`Usage`). Enforced by the worker, never taken from the client:

- **sessions** (``--max-sessions``, default :data:`~zmq_rpc.broker.limits.DEFAULT_MAX_SESSIONS`): the HELLO that would
  open one more is refused with OUT_OF_MEMORY saying so (after closing sessions silent for
  ``session_table.PRESSURE_SILENCE``: their clients are gone);
- **memory** (``--session-mem``, default :func:`default_session_share`: 3/4 of ``--mem``, so one
  greedy or hostile session always leaves a quarter of ``--mem`` to the others): a session's
  buffers, registered graphs' arenas and numpy temporaries, one-off graphs while they run, and
  the bytes of replies and peer pushes the worker had to materialize (strided or zero-stride
  views) until libzmq has sent them;
- **buffers**, **graphs**, **graph nodes** (summed over registered graphs) per session;
- **queued requests** and **queued payload bytes** per session (a session's queue grows only while
  its head waits: a peer receive, a buffer still being sent). A request over the quota gets
  OUT_OF_MEMORY at once, naming the quota.

Every byte counted against a session is also counted against ``--mem``. Materialized bytes in
flight stay counted after their session closes, until sent (or dropped with their link).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from ...broker.protocol import ErrorCode, WireError


def default_session_share(memory_limit: int) -> int:
    """What one session may hold unless ``--session-mem`` says otherwise: 3/4 of ``--mem``."""
    return memory_limit * 3 // 4


@dataclass(frozen=True)
class Quotas:
    """What one session may hold."""

    memory: int
    buffers: int = 16_384
    graphs: int = 1_024
    graph_nodes: int = 1 << 20
    queued: int = 4_096
    """Requests waiting in a session's queue (the client keeps at most 512 in flight)."""
    queued_bytes: int = 256 << 20
    """Payload bytes of those (the client keeps at most 64 MiB in flight)."""


@dataclass
class Usage:
    """What one session holds now."""

    memory: int = 0
    graph_nodes: int = 0
    queued_bytes: int = 0


def over(what: str, have: int, adding: int, limit: int) -> WireError:
    flag = " (--session-mem)" if what.startswith("memory") else ""
    return WireError(ErrorCode.OUT_OF_MEMORY, f"session quota: {what} would reach "
                     f"{have + adding:,}, over this worker's per-session limit of {limit:,}"
                     f"{flag}")


def check(what: str, have: int, adding: int, limit: int) -> None:
    """OUT_OF_MEMORY naming the quota unless ``have + adding <= limit``."""
    if adding > limit - have:
        raise over(what, have, adding, limit)


@dataclass(frozen=True)
class Charged:
    """A reply or push frame the worker materialized: counted until its tracker says sent."""

    data: Any
    nbytes: int
    usage: Usage
    endpoint: str = ""
    """For a push: the link it queues on (dropped when its session closes)."""


class InFlight:
    """Materialized frames being sent: (tracker, bytes, session usage, link endpoint)."""

    def __init__(self) -> None:
        self.items: deque[tuple[zmq.MessageTracker, Charged]] = deque()

    def add(self, tracker: zmq.MessageTracker | None, charged: Charged) -> None:
        if tracker is not None:
            self.items.append((tracker, charged))

    def reap(self) -> int:
        """Forget what was sent; returns the bytes it frees (the caller releases them)."""
        freed = 0
        for _ in range(len(self.items)):
            tracker, charged = self.items.popleft()
            if tracker.done:
                charged.usage.memory -= charged.nbytes
                freed += charged.nbytes
            else:
                self.items.append((tracker, charged))
        return freed

    def links_of(self, usage: Usage) -> set[str]:
        """Endpoints where a session's materialized pushes still wait."""
        return {c.endpoint for t, c in self.items if c.usage is usage and c.endpoint
                and not t.done}
