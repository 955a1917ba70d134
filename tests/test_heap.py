"""Giving memory back when the worker goes idle (worker/process/heap.py): the heap's free pages
(``malloc_trim``) and the JIT compiler's code pages (``MADV_PAGEOUT``). Fakes for the system calls;
tests/test_memory.py measures a real worker."""

from __future__ import annotations

from collections.abc import Iterator

from zmq_rpc.worker.process.heap import (
    MADV_PAGEOUT,
    PAGEOUT_GROWTH,
    CompilerPages,
    IdleTrim,
    file_resident_bytes,
    mapped_ranges,
)

RANGES = [(0x1000, 0x5000), (0x9000, 0xA000)]


class FakeSystem:
    """A process whose file-backed resident bytes the test sets, and a madvise that records."""

    def __init__(self, refuse: bool = False) -> None:
        self.resident = 100 << 20
        self.advised: list[tuple[int, int, int]] = []
        self.refuse = refuse

    def madvise(self, addr: int, size: int, advice: int) -> int:
        self.advised.append((addr, size, advice))
        if self.refuse:
            return -1
        self.resident -= size
        return 0

    def ranges(self) -> Iterator[tuple[int, int]]:
        return iter(RANGES)

    def pages(self) -> CompilerPages:
        return CompilerPages(self.madvise, lambda: self.resident, self.ranges)


def test_the_compiler_goes_out_only_once_it_came_in() -> None:
    system = FakeSystem()
    pages = system.pages()
    system.resident += PAGEOUT_GROWTH - 1            # less than a kernel's link brings in
    assert not pages.release() and system.advised == []
    system.resident += 1
    assert pages.release()
    assert system.advised == [(0x1000, 0x4000, MADV_PAGEOUT), (0x9000, 0x1000, MADV_PAGEOUT)]
    assert not pages.release() and len(system.advised) == 2       # nothing new came in
    system.resident += PAGEOUT_GROWTH                               # a second link
    assert pages.release() and pages.released == 2


def test_a_kernel_that_refuses_pageout_is_not_asked_again() -> None:
    system = FakeSystem(refuse=True)
    pages = system.pages()
    system.resident += PAGEOUT_GROWTH
    assert not pages.release() and len(system.advised) == 1
    system.resident += PAGEOUT_GROWTH
    assert not pages.release() and len(system.advised) == 1


def test_idle_trim_gives_both_back_on_the_first_idle_poll_after_traffic() -> None:
    system = FakeSystem()
    trims: list[int] = []
    idle = IdleTrim(lambda: trims.append(1), system.pages())
    idle.poll_result(False, now=10.0)                # idle with no traffic before: nothing
    system.resident += PAGEOUT_GROWTH
    idle.poll_result(True, now=10.5)
    assert trims == [] and system.advised == []      # busy: not now
    idle.poll_result(False, now=11.0)
    assert trims == [1] and len(system.advised) == 2
    idle.poll_result(True, now=11.2)
    idle.poll_result(False, now=11.5)                # within the interval: not again yet
    assert trims == [1]


def test_the_process_files_are_read_from_proc() -> None:
    """The real readers, on this process: the interpreter is a mapped file, and it is resident."""
    resident = file_resident_bytes()
    assert resident is None or resident > 0
    ranges = list(mapped_ranges(("python", "libpython")))
    assert all(lo < hi for lo, hi in ranges)
    assert list(mapped_ranges(("no-such-library-here",))) == []
