"""What a worker counts about itself: the recorder the backend thread bumps, and its snapshots.

Owned by the backend thread. :class:`Recorder` holds plain ints in dicts and lists; the backend
thread is the only writer and never takes a lock. Other threads (the metrics HTTP server's, see
:mod:`.exporter`) only read *copies*: ``dict(d)`` and ``list(l)`` of builtin containers are single
C calls under the GIL, so a copy is never torn mid-insert (a histogram's sum may lag its buckets
by the one observation being recorded; Prometheus tolerates that). State that needs a walk over
the sessions (queue depth, memory, graphs) is not read across threads at all: the backend thread
publishes an immutable :class:`WorkerSnapshot` a few times a second (:meth:`Recorder.publish`).

A worker started without ``--metrics-port`` gets a :class:`NullRecorder`, whose methods do nothing:
the backend thread then pays one no-op call per event.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

LATENCY_BUCKETS_S = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
                     25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds of the latency histograms' buckets, in seconds (+Inf is implied)."""

_BOUNDS_NS = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S)

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
    """A consistent-enough copy of a recorder's counters (taken on any thread)."""

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
    """Counters and histograms, bumped by the backend thread only (no locks)."""

    enabled = True

    def __init__(self) -> None:
        self.started = time.time()
        self.requests: dict[tuple[int, int], int] = {}
        self.queue_wait: dict[int, list[int]] = {}
        self.execution: dict[int, list[int]] = {}
        self.bytes = {"client_in": 0, "client_out": 0, "peer_in": 0, "peer_out": 0}
        self.transfers: dict[tuple[str, bool], int] = {}
        self.graph_runs = 0
        self.compute_ns = 0
        self.snapshot: WorkerSnapshot | None = None

    # ---------------------------------------------------------------- backend thread only

    def request(self, cmd: int, code: int, wait_ns: int, exec_ns: int) -> None:
        """A request was answered (``code`` 0: ok) after waiting and running this long."""
        key = (cmd, code)
        requests = self.requests
        requests[key] = requests.get(key, 0) + 1
        waits = self.queue_wait.get(cmd)
        if waits is None:
            waits = self.queue_wait[cmd] = [0] * (len(_BOUNDS_NS) + 2)
            self.execution[cmd] = [0] * (len(_BOUNDS_NS) + 2)
        runs = self.execution[cmd]
        waits[bisect_left(_BOUNDS_NS, wait_ns)] += 1
        waits[-1] += wait_ns
        runs[bisect_left(_BOUNDS_NS, exec_ns)] += 1
        runs[-1] += exec_ns

    def graph_run(self, compute_ns: int) -> None:
        """A graph ran (any of the three run commands); ``compute_ns`` inside the graph."""
        self.graph_runs += 1
        self.compute_ns += compute_ns

    def client_in(self, frames: Sequence[Any]) -> None:
        """A request's frames arrived from a client."""
        self.bytes["client_in"] += _total(frames)

    def client_out(self, frames: Sequence[Any]) -> None:
        """A reply's frames went to a client."""
        self.bytes["client_out"] += _total(frames)

    def peer_in(self, frames: Sequence[Any]) -> None:
        """A message's frames arrived on the peer PULL socket."""
        self.bytes["peer_in"] += _total(frames)

    def peer_out(self, frames: Sequence[Any]) -> None:
        """A message's frames went to a peer (chunks, acknowledgements, probes)."""
        self.bytes["peer_out"] += _total(frames)

    def transfer(self, direction: str, ok: bool) -> None:
        """A peer transfer finished (``in``: landed here, ``out``: pushed from here)."""
        key = (direction, ok)
        self.transfers[key] = self.transfers.get(key, 0) + 1

    def publish(self, snapshot: WorkerSnapshot) -> None:
        """Replace the gauges' snapshot (one reference store: readers see old or new)."""
        self.snapshot = snapshot

    # ------------------------------------------------------------------------ any thread

    def counters(self) -> Counters:
        """Copies of the counters, safe to read while the backend thread goes on."""
        return Counters(
            requests=dict(self.requests),
            queue_wait={k: list(v) for k, v in dict(self.queue_wait).items()},
            execution={k: list(v) for k, v in dict(self.execution).items()},
            bytes=dict(self.bytes), transfers=dict(self.transfers),
            graph_runs=self.graph_runs, compute_ns=self.compute_ns)


class NullRecorder(Recorder):
    """A recorder that records nothing (metrics off): every method returns at once."""

    enabled = False

    def request(self, cmd: int, code: int, wait_ns: int, exec_ns: int) -> None:
        pass

    def graph_run(self, compute_ns: int) -> None:
        pass

    def client_in(self, frames: Sequence[Any]) -> None:
        pass

    def client_out(self, frames: Sequence[Any]) -> None:
        pass

    def peer_in(self, frames: Sequence[Any]) -> None:
        pass

    def peer_out(self, frames: Sequence[Any]) -> None:
        pass

    def transfer(self, direction: str, ok: bool) -> None:
        pass

    def publish(self, snapshot: WorkerSnapshot) -> None:
        pass


def cumulative_buckets(counts: Sequence[int]) -> list[tuple[str, int]]:
    """Prometheus histogram buckets (``le`` label, cumulative count) from per-bucket counts."""
    out: list[tuple[str, int]] = []
    total = 0
    for bound, count in zip((*(repr(b) for b in LATENCY_BUCKETS_S), "+Inf"), counts):
        total += count
        out.append((bound, total))
    return out
