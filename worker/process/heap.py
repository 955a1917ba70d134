"""Giving freed heap memory back to the system when the worker goes idle (glibc only).

Owned by the backend thread (:class:`IdleTrim`, called from its loop). libzmq mallocs every
message it receives; the worker raises glibc's mmap and trim thresholds (``cli.tune_malloc``) so
that chunk-sized message buffers are reused while data streams, but then what a burst of
messages leaves freed in the heap stays resident (tens of MiB: docs/DESIGN.md). When the backend has been idle for a poll interval after some
traffic, ``malloc_trim(0)`` hands those pages back, at most once per :data:`TRIM_INTERVAL_S`.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 1.0
"""Least time between two trims."""


def _libc_trim() -> Callable[[], object] | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class IdleTrim:
    """Calls ``malloc_trim(0)`` on the first idle poll after traffic (rate-limited)."""

    def __init__(self, trim: Callable[[], object] | None = None) -> None:
        self._trim = trim if trim is not None else _libc_trim()
        self._busy = False
        self._last = 0.0
        self.trims = 0

    def poll_result(self, had_events: bool, now: float | None = None) -> None:
        """Tell it whether the backend's last poll had events; trims when it had none."""
        if had_events:
            self._busy = True
            return
        now = time.monotonic() if now is None else now
        if self._busy and self._trim is not None and now - self._last >= TRIM_INTERVAL_S:
            self._trim()
            self._busy = False
            self._last = now
            self.trims += 1
