"""The worker's memory accounting: what every session's buffers and graph arenas hold together.

Owned by the backend thread (one :class:`MemoryBudget` per executor). Every byte handed out is
counted here and nowhere else: a reservation either turns into memory the caller keeps (released
when it frees it) or is given back when the allocation behind it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from ..broker.protocol import ErrorCode, WireError

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
