"""The worker's memory accounting: what every session's buffers and graph arenas hold together.

Owned by the backend thread (one :class:`MemoryBudget` and one :class:`SessionMemory` per
executor). Every byte handed out is counted here and nowhere else: a reservation either turns into memory the caller keeps (released
when it frees it) or is given back when the allocation behind it fails.

What counts against ``--mem`` (the :class:`MemoryBudget`), and what bounds each part:

- a session's buffers, graph arenas and temporaries, one-off graphs while they run, and the
  replies and peer pushes it had materialized until libzmq has sent them (:class:`SessionMemory`;
  each session at most its ``--session-mem``, worker/sessions/quotas.py). Replies and pushes that alias a
  buffer's memory add nothing: the buffer stays counted until they are sent (its trackers);
- the early-chunk stash (:class:`~zmq_rpc.worker.peer.stash.Stash`): unannounced chunks at most its
  limit, and shed first when a session is short; announced ones by ``--mem`` alone;
- the peer port's receive queues (:class:`~zmq_rpc.worker.peer.queue.PeerQueue`): a fixed bound
  per open connection, held (:meth:`MemoryBudget.hold`) even over the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from ...broker.protocol import ErrorCode, WireError
from .quotas import InFlight, Quotas, check

if TYPE_CHECKING:
    from .session import Session

T = TypeVar("T")


class MemoryBudget:
    """Bytes in use against the worker's memory limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def free(self) -> int:
        """Bytes still available."""
        return max(self.limit - self.used, 0)

    def report(self) -> tuple[int, int]:
        """(free, total) bytes, as DEVICE_MEMORY and HELLO report them."""
        return self.free(), self.limit

    def reserve(self, size: int, what: str) -> None:
        """Count ``size`` more bytes in use, or OUT_OF_MEMORY when they do not fit."""
        if size > self.free():
            raise WireError(ErrorCode.OUT_OF_MEMORY, f"{what} of {size} bytes does not fit: "
                            f"{self.free()} of {self.limit} bytes free on this worker")
        self.used += size

    def release(self, size: int) -> None:
        """Give back bytes reserved earlier (their memory was freed)."""
        self.used -= size

    def hold(self, size: int) -> None:
        """Count ``size`` bytes the worker holds without a choice (libzmq's receive queue of a
        peer connection that opened), even over the limit: nothing else is allocated until
        they are released."""
        self.used += size

    def allocate(self, size: int, what: str, alloc: Callable[[], T]) -> T:
        """Reserve ``size`` bytes, then ``alloc()``; the reservation is given back if it fails."""
        self.reserve(size, what)
        try:
            return alloc()
        except BaseException:
            self.release(size)
            raise

    @contextmanager
    def borrowed(self, size: int, what: str) -> Iterator[None]:
        """``size`` bytes reserved for the duration of the block (a one-off graph's arena)."""
        self.reserve(size, what)
        try:
            yield
        finally:
            self.release(size)


class SessionMemory:
    """Every byte a session holds, counted against its quota and the worker's budget at once:
    buffers, graph arenas, one-off graphs while they run, and materialized replies and pushes
    until libzmq has sent them (:class:`~zmq_rpc.worker.sessions.quotas.InFlight`)."""

    def __init__(self, budget: MemoryBudget, quotas: Quotas,
                 reclaim: Callable[[Session], None],
                 identity_check: Callable[[Session, int, str], None] | None = None) -> None:
        self.budget = budget
        self.quotas = quotas
        self.identity_check = identity_check
        """Over all sessions of the session's client identity (worker/sessions/identities.py)."""
        self.inflight = InFlight()
        self._reclaim = reclaim

    def charge(self, session: Session, size: int, what: str) -> None:
        """Count ``size`` bytes against the session's quota and ``--mem`` (closing silent
        sessions first when memory is short), or OUT_OF_MEMORY."""
        try:                    # the worker's --mem first: "does not fit, N free" says most
            self.budget.reserve(size, what)
        except WireError:
            if not self.reclaim(session):
                raise
            self.budget.reserve(size, what)
        if self.quotas.memory < self.budget.limit:
            try:
                check(f"memory ({what})", session.usage.memory, size, self.quotas.memory)
            except WireError:
                self.budget.release(size)
                raise
        if self.identity_check is not None:
            try:
                self.identity_check(session, size, what)
            except WireError:
                self.budget.release(size)
                raise
        session.usage.memory += size

    def uncharge(self, session: Session, size: int) -> None:
        """Give back bytes ``session`` held (their memory was freed)."""
        session.usage.memory -= size
        self.budget.release(size)

    def allocate(self, session: Session, size: int, what: str, alloc: Callable[[], T]) -> T:
        """``charge``, then ``alloc()``; the charge is given back if it fails."""
        self.charge(session, size, what)
        try:
            return alloc()
        except BaseException:
            self.uncharge(session, size)
            raise

    @contextmanager
    def borrowed(self, session: Session, size: int, what: str) -> Iterator[None]:
        """``size`` bytes charged for the duration of the block (a one-off graph's arena)."""
        self.charge(session, size, what)
        try:
            yield
        finally:
            self.uncharge(session, size)

    def reap(self) -> None:
        """Give back the bytes of materialized replies and pushes that libzmq has sent."""
        if self.inflight.items:
            self.budget.release(self.inflight.reap())

    def reclaim(self, keep: Session) -> bool:
        """Memory is short: forget what was sent, let the executor close silent sessions.
        True if anything was freed."""
        before = self.budget.used
        self.reap()
        self._reclaim(keep)
        return self.budget.used < before
