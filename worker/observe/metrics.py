"""What a worker counts about itself: the recorder the backend thread bumps, and its snapshots.

Owned by the backend thread. :class:`Recorder` holds plain ints, dicts and lists; the backend
thread is the only writer and never takes a lock, and its per-request work is one list append
(folded into the histograms in batches, see :class:`Recorder`). Other threads (the metrics HTTP
server's, see :mod:`.exporter`) read only what the backend thread publishes a few times a second:
an immutable :class:`Counters` copy holding a :class:`WorkerSnapshot` of the state that needs a
walk over the sessions (queue depth, memory, graphs) (:meth:`Recorder.publish`).

A worker started without ``--metrics-port`` gets a :class:`NullRecorder`, whose methods do nothing:
the backend thread then pays one no-op call per event.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

LATENCY_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
                     25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of the latency histograms' buckets, in seconds (+Inf is implied)."""

_BOUNDS_NS = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S)
_BOUNDS = np.array(_BOUNDS_NS, dtype=np.int64)

INVALID_COMMAND = 0
"""The command label of requests that did not decode (their command is unknown or untrusted)."""

PUBLISH_INTERVAL = 0.1
"""Seconds between the backend thread's snapshots of its gauges."""


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """The worker's state at one moment, taken by the backend thread (any thread may read it)."""

    taken: float
    """``time.monotonic()`` when taken."""
    sessions: int
    queue_depth: int
    """Requests waiting in session queues (not yet run)."""
    memory_used: int
    memory_limit: int
    device: str
    device_kind: str
    graphs: int
    """Graphs registered, all sessions together."""
    buffers: int
    transfers_in_progress: int
    held_replies: int


@dataclass(frozen=True, slots=True)
class Counters:
    """A copy of a recorder's counters and the gauges' snapshot from one :meth:`Recorder.publish`
    (any thread may read it: one reference store publishes both, so a scrape never pairs new
    gauges with old counters)."""

    requests: dict[tuple[int, int], int]
    """(command, outcome code; 0 is ok) -> requests answered."""
    queue_wait: dict[int, list[int]]
    """command -> bucket counts (one per bound, then +Inf), then the sum in ns."""
    execution: dict[int, list[int]]
    bytes: dict[str, int]
    """``client_in``, ``client_out``, ``peer_in``, ``peer_out`` -> bytes."""
    transfers: dict[tuple[str, bool], int]
    """(``in``/``out``, succeeded) -> peer transfers finished."""
    graph_runs: int
    compute_ns: int
    snapshot: WorkerSnapshot | None
    """The gauges, or None before the first publish."""


def _nbytes(frame: Any) -> int:
    kind = type(frame)
    if kind is bytes or kind is zmq.Frame:     # a Frame's len is its size, and cheap
        return len(frame)
    nbytes = getattr(frame, "nbytes", None)    # arrays and memoryviews
    return nbytes if nbytes is not None else len(frame)


def _total(frames: Sequence[Any]) -> int:
    total = 0
    for frame in frames:          # a loop, not sum(genexpr): this runs once per message
        kind = type(frame)
        total += len(frame) if kind is bytes or kind is zmq.Frame else _nbytes(frame)
    return total


class Recorder:
    """Counters and histograms, bumped by the backend thread only (no locks).

    The per-request path only appends: :meth:`request` extends a flat pending list and the
    byte counters are plain int attributes. :meth:`publish` (the backend thread, every
    :data:`PUBLISH_INTERVAL`) folds the pending requests into the histograms with numpy
    (a fraction of bucketing each request as it comes: docs/DESIGN.md) and stores a
    :class:`Counters` copy that other threads read: what a scrape sees is at most one
    interval old, and a counter never goes back."""

    enabled = True

    def __init__(self) -> None:
        self.started = time.time()
        self.requests: dict[tuple[int, int], int] = {}
        self.queue_wait: dict[int, list[int]] = {}
        self.execution: dict[int, list[int]] = {}
        self._pending: list[int] = []
        """(command, outcome code, wait ns, execution ns) of each request since the last fold,
        flat: one ``+=`` of a tuple per request is the cheapest record Python has."""
        self._client_in = self._client_out = self._peer_in = self._peer_out = 0
        self.transfers: dict[tuple[str, bool], int] = {}
        self.graph_runs = 0
        self.compute_ns = 0
        self._published = self._copy(None)

    # ---------------------------------------------------------------- backend thread only

    def request(self, cmd: int, code: int, wait_ns: int, exec_ns: int) -> None:
        """A request was answered (``code`` 0: ok) after waiting and running this long."""
        self._pending += (cmd, code, wait_ns, exec_ns)

    def graph_run(self, compute_ns: int) -> None:
        """A graph ran (any of the three run commands); ``compute_ns`` inside the graph."""
        self.graph_runs += 1
        self.compute_ns += compute_ns

    def client_in(self, frames: Sequence[zmq.Frame]) -> None:
        """A request's frames arrived from a client (the first, its routing id, not counted)."""
        nbytes = -len(frames[0])
        for frame in frames:
            nbytes += len(frame)
        self._client_in += nbytes

    def client_out(self, header: bytes, payload: Sequence[Any]) -> None:
        """A reply's header and payload frames went to a client."""
        self._client_out += len(header) + _total(payload) if payload else len(header)

    def peer_in(self, frames: Sequence[Any]) -> None:
        """A message's frames arrived on the peer PULL socket."""
        self._peer_in += _total(frames)

    def peer_out(self, frames: Sequence[Any]) -> None:
        """A message's frames went to a peer (chunks, acknowledgements, probes)."""
        self._peer_out += _total(frames)

    def transfer(self, direction: str, ok: bool) -> None:
        """A peer transfer finished (``in``: landed here, ``out``: pushed from here)."""
        key = (direction, ok)
        self.transfers[key] = self.transfers.get(key, 0) + 1

    def publish(self, snapshot: WorkerSnapshot) -> None:
        """Fold the pending requests, then publish their copy together with the gauges'
        snapshot (one reference store: readers see the old pair or the new, never a mix)."""
        self.fold(snapshot)

    def fold(self, snapshot: WorkerSnapshot | None = None) -> None:
        """Add the pending requests to the counters and histograms; publish their copy (with
        ``snapshot``, else the last one published)."""
        pending, self._pending = self._pending, []
        if pending:
            _fold(pending, self.requests, self.queue_wait, self.execution)
        self._published = self._copy(self._published.snapshot if snapshot is None else snapshot)

    def _copy(self, snapshot: WorkerSnapshot | None) -> Counters:
        return Counters(
            requests=dict(self.requests),
            queue_wait={k: list(v) for k, v in self.queue_wait.items()},
            execution={k: list(v) for k, v in self.execution.items()},
            bytes={"client_in": self._client_in, "client_out": self._client_out,
                   "peer_in": self._peer_in, "peer_out": self._peer_out},
            transfers=dict(self.transfers), graph_runs=self.graph_runs,
            compute_ns=self.compute_ns, snapshot=snapshot)

    # ------------------------------------------------------------------------ any thread

    def counters(self) -> Counters:
        """The counters as of the last :meth:`publish` (a copy: safe on any thread)."""
        return self._published


def _fold(pending: list[int], requests: dict[tuple[int, int], int],
          queue_wait: dict[int, list[int]], execution: dict[int, list[int]]) -> None:
    """Count ``pending`` (flat: command, code, wait ns, execution ns, ...) into the tables."""
    table = np.array(pending, dtype=np.int64).reshape(-1, 4)
    keys, counts = np.unique((table[:, 0] << 32) | table[:, 1], return_counts=True)
    for key, count in zip(keys.tolist(), counts.tolist()):
        pair = (key >> 32, key & 0xFFFFFFFF)
        requests[pair] = requests.get(pair, 0) + count
    commands = table[:, 0]
    first = int(commands[0])
    groups = ([(first, table)] if (commands == first).all() else
              [(cmd, table[commands == cmd]) for cmd in np.unique(commands).tolist()])
    width = len(_BOUNDS_NS) + 1
    for cmd, rows in groups:
        times = rows[:, 2:4]
        slots = np.searchsorted(_BOUNDS, times, side="left")   # bisect_left: le buckets
        slots[:, 1] += width
        buckets = np.bincount(slots.ravel(), minlength=2 * width).tolist()
        sums = times.sum(axis=0).tolist()
        for hists, part, total in ((queue_wait, buckets[:width], sums[0]),
                                   (execution, buckets[width:], sums[1])):
            hist = hists.setdefault(cmd, [0] * (width + 1))
            for i, count in enumerate(part):
                hist[i] += count
            hist[-1] += total


class NullRecorder(Recorder):
    """A recorder that records nothing (metrics off): every method returns at once."""

    enabled = False

    def request(self, cmd: int, code: int, wait_ns: int, exec_ns: int) -> None:
        pass

    def graph_run(self, compute_ns: int) -> None:
        pass

    def client_in(self, frames: Sequence[zmq.Frame]) -> None:
        pass

    def client_out(self, header: bytes, payload: Sequence[Any]) -> None:
        pass

    def peer_in(self, frames: Sequence[Any]) -> None:
        pass

    def peer_out(self, frames: Sequence[Any]) -> None:
        pass

    def transfer(self, direction: str, ok: bool) -> None:
        pass

    def publish(self, snapshot: WorkerSnapshot) -> None:
        pass

    def fold(self, snapshot: WorkerSnapshot | None = None) -> None:
        pass


def cumulative_buckets(counts: Sequence[int]) -> list[tuple[str, int]]:
    """Prometheus histogram buckets (``le`` label, cumulative count) from per-bucket counts."""
    out: list[tuple[str, int]] = []
    total = 0
    for bound, count in zip((*(repr(b) for b in LATENCY_BUCKETS_S), "+Inf"), counts):
        total += count
        out.append((bound, total))
    return out
