"""Kept runs (protocol 1.15, ``kept-runs``): a linked run the client sends again and again goes
as its id on the worker, its transfer tokens and its inputs' sizes.

A decode step sends every stage the same linked run but for its hand-off tokens and the bytes
of its inputs (the position). :class:`KeptRuns` remembers the shapes of the runs a session sent
(everything but the tokens); the second time a shape is sent it goes in full with
``keep`` = a fresh id, and from the third on as a GRAPH_RUN_KEPT of that id: ~45 bytes of
header instead of ~150, which is what a token costs the client's link per stage.

Ordering: the worker keeps a run when its request arrives, and the connection sends in the
order requests are issued (a reserved place filled later included: what fills it was decided
when it was filled). A shape becomes usable only once the request that keeps it has been
issued, and an id is never given to another shape in a session: a GRAPH_RUN_KEPT can never
reach the worker before its run is kept, nor find another one under its id. When the ids run
out, new shapes simply go in full. A run filled into a place reserved earlier (its route was
being probed: ``peer._later``) goes in full and keeps nothing: places are filled when their
probe answers, on the thread that answers it, while a run issued at that moment on another
thread may fill its own place first, so the order in which shapes are looked up there is not
the send order (a GRAPH_RUN_KEPT then reached a worker ahead of the run that kept it, once, in
a fresh-clone run under load).

Threads: any; the table is under a lock, never held while a request is issued.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from ..broker.graph import MAX_KEPT, MAX_KEPT_TENSORS, GraphRunKept, GraphRunLinked
from ..broker.protocol import Cmd

__all__ = ["KeptRuns"]

SEEN = 512
"""Shapes remembered as seen once (least recently seen forgotten first): a shape is kept on
its second sighting, so one-off runs (a prompt's last chunk) take no id."""


def _shape(msg: GraphRunLinked) -> Hashable:
    """Everything of ``msg`` that a kept run repeats (all but its tokens)."""
    return (msg.handle, tuple(msg.inputs), tuple(msg.fetch), tuple(r.dst for r in msg.receive),
            tuple((s.src, s.endpoint) for s in msg.send), msg.timeout_ms, msg.hold_reply_us,
            msg.receive_from)


class KeptRuns:
    """Which linked runs of one session its worker keeps, and under which ids."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        """The worker has the capability (1.15); else every run goes in full."""
        self._lock = threading.Lock()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._ids: dict[Hashable, int] = {}
        """Shapes kept on the worker (their keeping request issued) -> id."""
        self._keeping: set[Hashable] = set()
        """Shapes whose keeping request is being issued now."""
        self._next = 0

    def shorten(self, msg: GraphRunLinked) -> tuple[Cmd, Any, Hashable | None]:
        """What to send for ``msg``: (command, message, shape being kept or None). A caller
        that gets a shape must call :meth:`issued` once the request is issued."""
        if not self.enabled or msg.keep >= 0 or msg.named() > MAX_KEPT_TENSORS:
            return Cmd.GRAPH_RUN_LINKED, msg, None
        shape = _shape(msg)
        with self._lock:
            kept = self._ids.get(shape)
            if kept is not None:
                return Cmd.GRAPH_RUN_KEPT, GraphRunKept(
                    kept=kept, tokens=msg.tokens(), sizes=msg.payload_sizes()), None
            if shape in self._keeping or self._next >= MAX_KEPT or not self._seen_before(shape):
                return Cmd.GRAPH_RUN_LINKED, msg, None
            self._keeping.add(shape)
            keep = self._next
            self._next += 1
        return Cmd.GRAPH_RUN_LINKED, replace(msg, keep=keep), shape

    def issued(self, shape: Hashable, keep: int, run: Future[Any]) -> None:
        """The request keeping ``shape`` under ``keep`` is issued: later runs of the shape go
        short. Should it fail (the worker may not have kept it), the shape goes in full again
        (under a new id if it comes back)."""
        with self._lock:
            self._keeping.discard(shape)
            self._ids[shape] = keep
        run.add_done_callback(lambda f: self._forget(shape, keep) if f.exception() else None)

    def abandoned(self, shape: Hashable) -> None:
        """The request that was to keep ``shape`` could not be issued."""
        with self._lock:
            self._keeping.discard(shape)

    def forget(self, msg: GraphRunKept) -> None:
        """A GRAPH_RUN_KEPT of ``msg.kept`` was refused: send that shape in full again."""
        with self._lock:
            for shape, kept in list(self._ids.items()):
                if kept == msg.kept:
                    del self._ids[shape]

    def _forget(self, shape: Hashable, keep: int) -> None:
        with self._lock:
            if self._ids.get(shape) == keep:
                del self._ids[shape]

    def _seen_before(self, shape: Hashable) -> bool:
        """Whether ``shape`` was sent before (and remember that it was, now)."""
        if shape in self._seen:
            del self._seen[shape]
            return True
        self._seen[shape] = None
        if len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        return False
