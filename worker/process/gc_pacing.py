"""Python's garbage collector in a worker process: start-up objects frozen, full collections paced.

Why: a full (generation 2) collection walks every object the collector tracks, holding the GIL.
CPython starts one from whatever code allocates when its thresholds are crossed: in a worker that
is the backend thread in the middle of some client's request, and every client waits for it,
usually for nothing: a request's garbage dies young (the figures, before and after what follows:
docs/SECURITY.md, "Garbage-collector pauses").

What the worker does about it (process-wide, as the collector is):

1. :func:`freeze_start_up` (the CLI, once the worker listens): collect, then ``gc.freeze()``: the
   objects of the imports, numba and the backend's set-up go to the permanent generation and are
   never walked again; pacing as below keeps the old generation small by collecting whenever the
   backend idles.
2. It also takes full collections out of CPython's automatic schedule (``threshold2`` =
   :data:`NEVER`). The young generations stay automatic: they walk only young objects (cheap), and garbage cycles that die young, as a request's usually do, go with them.
3. :class:`FullCollections` (the backend thread, once per loop turn, so between requests, never
   inside one) runs the full collections: when the backend has nothing to do (no client waits),
   or, under traffic that never lets it idle, as soon as the young generations have promoted as
   much as CPython itself would wait for: :data:`MIN_PROMOTIONS` gen-1 collections (CPython's
   default ``threshold2``) and a quarter of the old generation (CPython's own rule, see
   ``gcmodule.c``). So the garbage the old generation holds stays within CPython's own bound (at
   most ~7,000 objects per gen-1 collection promoted: max(~70,000, old/4) objects), whatever the
   traffic, and a client waits at most for one full collection per that much allocation, of only
   what was made after start-up.

What is not bounded here: the cost of one full collection grows with the objects clients keep alive
(sessions, registered graphs); a worker holding millions of them pays each collection for them.

A process that did not call :func:`freeze_start_up` (a :class:`~zmq_rpc.worker.server.WorkerServer`
inside a test process) keeps CPython's schedule, and :class:`FullCollections` leaves it alone.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import ClassVar

NEVER = 2**31 - 1
"""``threshold2`` that keeps CPython from starting full collections by itself."""

MIN_PROMOTIONS = 10
"""Gen-1 collections (each promotes at most ~7,000 objects to the old generation) before a busy
worker collects in full: CPython's default ``threshold2``."""

PROMOTED_PER_GEN1 = 700 * 10
"""At most about this many objects one gen-1 collection promotes (``threshold0 * threshold1``)."""


def freeze_start_up() -> int:
    """Collect, freeze what is left, and take full collections out of CPython's schedule (see the
    module docstring); returns the number of objects frozen. Called once the worker listens."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, NEVER)
    return gc.get_freeze_count()


def paced() -> bool:
    """Whether this process's full collections are left to :class:`FullCollections`."""
    return gc.get_threshold()[2] == NEVER


@dataclass(frozen=True, slots=True)
class CollectionStats:
    """What :class:`FullCollections` did (published for the metrics thread)."""

    idle: int = 0
    """Full collections run while the backend had nothing to do."""
    busy: int = 0
    """Full collections a busy backend ran between two requests (the promotions' bound)."""
    old_objects: int = 0
    """Objects in the old generation after the last full collection."""


class FullCollections:
    """Runs the process's full collections from the backend thread's loop (module docstring)."""

    def __init__(self) -> None:
        self.stats = CollectionStats()

    def poll_result(self, busy: bool) -> None:
        """Tell it whether the backend has work (events, requests read ahead, transfers due)."""
        promotions = gc.get_count()[2]      # gen-1 collections since the last full one
        if not promotions or not paced():
            return
        if busy and promotions < max(MIN_PROMOTIONS,
                                     self.stats.old_objects // (4 * PROMOTED_PER_GEN1)):
            return
        gc.collect()
        s = self.stats
        self.stats = CollectionStats(idle=s.idle + (not busy), busy=s.busy + busy,
                                     old_objects=len(gc.get_objects(2)))
        FullCollections.published = self.stats

    published: ClassVar[CollectionStats] = CollectionStats()
    """The stats last published in this process (the collector is process-wide; any thread may
    read them: each is an immutable object, swapped whole)."""

