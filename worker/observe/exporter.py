"""The worker's Prometheus endpoint: an HTTP server thread that turns recorder copies into metrics.

Runs in prometheus_client's HTTP server thread (started and stopped by
:class:`~zmq_rpc.worker.server.WorkerServer`). It never touches backend state: each scrape reads a
copy of the :class:`~zmq_rpc.worker.observe.metrics.Recorder`'s counters and the latest
:class:`~zmq_rpc.worker.observe.metrics.WorkerSnapshot` the backend thread published. Every worker has
its own registry (several workers may share a process, as in the tests), holding this collector
the process collector (CPU seconds, resident memory, open fds) and the GC collector.

Metric names (all prefixed ``zmq_rpc_``): ``requests_total{command,outcome}``,
``request_queue_seconds{command}`` and ``request_execution_seconds{command}`` (histograms),
``bytes_received_total{link}`` / ``bytes_sent_total{link}`` (``link`` is ``client`` or ``peer``),
``queue_depth``, ``sessions``, ``memory_used_bytes{device}``, ``memory_limit_bytes{device}``,
``graphs_registered``, ``graph_runs_total``, ``graph_compute_seconds_total``,
``peer_transfers_total{direction,outcome}``, ``buffers``, ``transfers_in_progress``,
``held_replies``, ``uptime_seconds``, ``worker_info{name,version,protocol,device,kind}``,
``gc_full_collections_total{backend}`` (``idle`` or ``busy``), ``gc_frozen_objects`` and
``gc_old_objects`` (:mod:`..process.gc_pacing`); and prometheus_client's ``python_gc_*`` (collections by
generation).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..process.gc_pacing import FullCollections
from .metrics import INVALID_COMMAND, Recorder, WorkerSnapshot, cumulative_buckets

Names = Callable[[int], str]


class WorkerCollector(Collector):
    """Builds the metric families from one recorder at scrape time."""

    def __init__(self, recorder: Recorder, info: dict[str, str], command_name: Names,
                 outcome_name: Names) -> None:
        self.recorder = recorder
        self.info = info
        self.command_name = command_name
        self.outcome_name = outcome_name

    def collect(self) -> Iterator[Metric]:
        rec = self.recorder
        counters = rec.counters()
        yield from self._requests(counters.requests)
        yield self._histogram("request_queue_seconds", "Time a request waited on the worker "
                              "before it ran (behind its session's earlier requests, a transfer "
                              "or a busy buffer)", counters.queue_wait)
        yield self._histogram("request_execution_seconds", "Time from a request starting to "
                              "run until its reply left (deferred ones: until they finished)",
                              counters.execution)
        yield from self._bytes(counters.bytes)
        yield from self._transfers(counters.transfers)
        runs = CounterMetricFamily("zmq_rpc_graph_runs", "Graphs run (GRAPH_RUN, "
                                   "GRAPH_RUN_LINKED, GRAPH_RUN_KEPT and GRAPH_COMPUTE)")
        runs.add_metric([], counters.graph_runs)
        yield runs
        compute = CounterMetricFamily("zmq_rpc_graph_compute_seconds", "Time spent inside graphs")
        compute.add_metric([], counters.compute_ns / 1e9)
        yield compute
        yield from self._gauges(counters.snapshot)
        yield from self._gc()
        uptime = GaugeMetricFamily("zmq_rpc_uptime_seconds", "Seconds since the worker started")
        uptime.add_metric([], time.time() - rec.started)
        yield uptime
        info = GaugeMetricFamily("zmq_rpc_worker_info", "The worker's identity (value 1)",
                                 labels=sorted(self.info))
        info.add_metric([self.info[k] for k in sorted(self.info)], 1)
        yield info

    def _requests(self, requests: dict[tuple[int, int], int]) -> Iterator[Metric]:
        family = CounterMetricFamily("zmq_rpc_requests", "Requests answered, by command and "
                                     "outcome (ok or the error code)",
                                     labels=["command", "outcome"])
        for (cmd, code), count in sorted(requests.items()):
            family.add_metric([self.command_name(cmd), self.outcome_name(code)], count)
        yield family

    def _histogram(self, name: str, doc: str, table: dict[int, list[int]]) -> Metric:
        family = HistogramMetricFamily(f"zmq_rpc_{name}", doc, labels=["command"])
        for cmd, counts in sorted(table.items()):
            family.add_metric([self.command_name(cmd)], cumulative_buckets(counts[:-1]),
                              counts[-1] / 1e9)
        return family

    @staticmethod
    def _bytes(table: dict[str, int]) -> Iterator[Metric]:
        received = CounterMetricFamily("zmq_rpc_bytes_received", "Bytes received, by link "
                                       "(client requests, peer transfers)", labels=["link"])
        sent = CounterMetricFamily("zmq_rpc_bytes_sent", "Bytes sent, by link (client "
                                   "replies, peer transfers)", labels=["link"])
        for link in ("client", "peer"):
            received.add_metric([link], table[f"{link}_in"])
            sent.add_metric([link], table[f"{link}_out"])
        yield received
        yield sent

    @staticmethod
    def _transfers(table: dict[tuple[str, bool], int]) -> Iterator[Metric]:
        family = CounterMetricFamily("zmq_rpc_peer_transfers", "Worker-to-worker transfers "
                                     "finished, by direction and outcome",
                                     labels=["direction", "outcome"])
        for direction in ("in", "out"):
            for ok in (True, False):
                family.add_metric([direction, "ok" if ok else "failed"],
                                  table.get((direction, ok), 0))
        yield family

    @staticmethod
    def _gauges(snap: WorkerSnapshot | None) -> Iterator[Metric]:
        if snap is None:
            return
        plain = {"queue_depth": ("Requests waiting in session queues", snap.queue_depth),
                 "sessions": ("Client sessions open", snap.sessions),
                 "graphs_registered": ("Graphs registered, all sessions", snap.graphs),
                 "buffers": ("Buffers allocated, all sessions", snap.buffers),
                 "transfers_in_progress": ("Peer transfers being received",
                                           snap.transfers_in_progress),
                 "held_replies": ("Replies held back (hold_reply)", snap.held_replies)}
        for name, (doc, value) in plain.items():
            family = GaugeMetricFamily(f"zmq_rpc_{name}", doc)
            family.add_metric([], value)
            yield family
        for name, doc, value in (("used", "Bytes handed out (buffers and graph arenas)",
                                  snap.memory_used),
                                 ("limit", "Bytes the worker may hand out", snap.memory_limit)):
            family = GaugeMetricFamily(f"zmq_rpc_memory_{name}_bytes", doc,
                                       labels=["device", "kind"])
            family.add_metric([snap.device, snap.device_kind], value)
            yield family

    @staticmethod
    def _gc() -> Iterator[Metric]:
        """The process's garbage collector as worker/process/gc_pacing.py runs it."""
        stats = FullCollections.published
        full = CounterMetricFamily("zmq_rpc_gc_full_collections", "Full collections the backend "
                                   "ran between requests, by whether it was idle or busy",
                                   labels=["backend"])
        full.add_metric(["idle"], stats.idle)
        full.add_metric(["busy"], stats.busy)
        yield full
        for name, doc, value in (
                ("frozen", "Objects frozen after start-up, never walked again",
                 gc.get_freeze_count()),
                ("old", "Objects in the old generation after the last full collection",
                 stats.old_objects)):
            family = GaugeMetricFamily(f"zmq_rpc_gc_{name}_objects", doc)
            family.add_metric([], value)
            yield family


def default_names(cmd: int) -> str:
    """A command's label (``INVALID`` for requests that did not decode)."""
    from ...broker.protocol import Cmd
    if cmd == INVALID_COMMAND:
        return "INVALID"
    try:
        return Cmd(cmd).name
    except ValueError:
        return str(cmd)


def default_outcomes(code: int) -> str:
    """An outcome's label: ``ok`` or the error code's name in lower case."""
    from ...broker.protocol import ErrorCode
    if code == 0:
        return "ok"
    try:
        return ErrorCode(code).name.lower()
    except ValueError:
        return f"error_{code}"


class MetricsServer:
    """The HTTP endpoint serving one worker's metrics (``/metrics``); stopped with :meth:`stop`."""

    def __init__(self, recorder: Recorder, info: dict[str, str]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(WorkerCollector(recorder, info, default_names, default_outcomes))
        ProcessCollector(namespace="zmq_rpc", registry=self.registry)
        GCCollector(registry=self.registry)     # python_gc_collections_total{generation}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address = ""

    def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (port 0 picks a free one); returns ``http://host:port``."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound_host, bound_port = self._server.server_address[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.address = f"http://{shown}:{bound_port}"
        return self.address

    def stop(self) -> None:
        """Stop serving and join the server thread. Idempotent."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = None
