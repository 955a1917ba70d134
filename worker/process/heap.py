"""Giving freed heap memory back to the system when the worker goes idle (glibc only).

Owned by the backend thread (:class:`IdleTrim`, called from its loop). libzmq mallocs every
message it receives; the worker raises glibc's mmap and trim thresholds (``cli.tune_malloc``) so
that chunk-sized message buffers are reused while data streams, but then what a burst of
messages leaves freed in the heap stays resident (tens of MiB: docs/DESIGN.md). When the backend has been idle for a poll interval after some
traffic, ``malloc_trim(0)`` hands those pages back, at most once per :data:`TRIM_INTERVAL_S`.

At the same moment :class:`CompilerPages` pages out the JIT compiler's code (Linux 5.4+). numba
links even a cached kernel through LLVM, whose library's code and read-only data (tens of MiB)
become resident while it does; the linked kernels then run from the JIT's own memory and never
touch them again until something else is compiled or linked. Clean file pages: dropping them
loses nothing, and a later compile faults back only what it uses.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable, Iterator

TRIM_INTERVAL_S = 1.0
"""Least time between two trims."""

COMPILER_LIBRARIES = ("libllvmlite",)
"""Mapped files whose pages are only needed while kernels compile or link (numba's LLVM)."""
PAGEOUT_GROWTH = 8 << 20
"""File-backed resident bytes the process gains before the compiler's pages go out again."""
MADV_PAGEOUT = 21
"""Linux's "reclaim these pages now" (5.4+; older kernels refuse it with EINVAL)."""

Madvise = Callable[[int, int, int], int]


def _libc_trim() -> Callable[[], object] | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


def _libc_madvise() -> Madvise | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return lambda addr, size, advice: int(madvise(addr, size, advice))


def file_resident_bytes(statm: str = "/proc/self/statm") -> int | None:
    """This process's resident file-backed (and shared) bytes, or None where /proc is not."""
    try:
        with open(statm, "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return None


def mapped_ranges(names: tuple[str, ...], maps: str = "/proc/self/maps") -> Iterator[tuple[int, int]]:
    """The address ranges of the mappings of files whose path contains one of ``names``."""
    try:
        with open(maps) as f:
            lines = f.readlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and any(name in fields[5] for name in names):
            lo, hi = fields[0].split("-")
            yield int(lo, 16), int(hi, 16)


class CompilerPages:
    """Pages out the compiler's mapped code and data (:data:`COMPILER_LIBRARIES`) when the
    process's file-backed resident bytes grew by :data:`PAGEOUT_GROWTH` since the last time
    (a kernel was linked meanwhile); a kernel that refuses ``MADV_PAGEOUT`` stops it for good."""

    def __init__(self, madvise: Madvise | None = None,
                 resident: Callable[[], int | None] = file_resident_bytes,
                 ranges: Callable[[], Iterator[tuple[int, int]]] | None = None) -> None:
        self._madvise = madvise if madvise is not None else _libc_madvise()
        self._resident = resident
        self._ranges = ranges if ranges is not None else (
            lambda: mapped_ranges(COMPILER_LIBRARIES))
        self._after: int | None = resident()
        self.released = 0
        """Times the pages went out."""

    def release(self) -> bool:
        """Page the compiler out if it came in since the last time; whether it did."""
        now = self._resident()
        if self._madvise is None or now is None or (
                self._after is not None and now - self._after < PAGEOUT_GROWTH):
            return False
        advised = False
        for lo, hi in self._ranges():
            if self._madvise(lo, hi - lo, MADV_PAGEOUT) != 0:
                self._madvise = None        # not this kernel: keep the pages, stop asking
                return False
            advised = True
        self._after = self._resident() if advised else now
        self.released += advised
        return advised


class IdleTrim:
    """Calls ``malloc_trim(0)`` on the first idle poll after traffic (rate-limited), and lets
    :class:`CompilerPages` page the compiler out."""

    def __init__(self, trim: Callable[[], object] | None = None,
                 pages: CompilerPages | None = None) -> None:
        self._trim = trim if trim is not None else _libc_trim()
        self._pages = pages if pages is not None else CompilerPages()
        self._busy = False
        self._last = 0.0
        self.trims = 0

    def poll_result(self, had_events: bool, now: float | None = None) -> None:
        """Tell it whether the backend's last poll had events; trims when it had none."""
        if had_events:
            self._busy = True
            return
        now = time.monotonic() if now is None else now
        if self._busy and now - self._last >= TRIM_INTERVAL_S:
            if self._trim is not None:
                self._trim()
            self._pages.release()
            self._busy = False
            self._last = now
            self.trims += 1
