"""The server's Prometheus metrics, in a registry of its own (served at ``/metrics``).

Counters and histograms are updated from the engine thread (tokens, requests ending) and the
event loop (requests refused); gauges are read when scraped, from the functions the engine
binds. prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from ..llama.recovery import Recovery

__all__ = ["ServeMetrics"]

PREFIX = "zmq_rpc_serve_"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
RECOVERY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 7.0, 10.0, 20.0, 40.0, 80.0)
RECOVERY_PARTS = ("detection", "load", "prefill", "total")


class ServeMetrics:
    """Requests by status, time to first token, inter-token latency, generated tokens, queue
    depth, slots in use, and the recoveries from lost workers with their seconds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by route and status "
                                "(a stream counts with the status its response started with)",
                                ["route", "status"], registry=r)
        self.finishes = Counter(PREFIX + "sequences_finished", "Generations ended, by reason: "
                                "stop, length, cancelled (the client went away) or error",
                                ["reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From a request's arrival "
                              "to its first generated token (queueing included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between two tokens of one "
                             "sequence", buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter(PREFIX + "generated_tokens", "Tokens generated (rate: tokens/s)",
                              registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Requests waiting for a slot",
                                 registry=r)
        self.slots_in_use = Gauge(PREFIX + "slots_in_use", "KV slots running a sequence",
                                  registry=r)
        self.healthy = Gauge(PREFIX + "healthy", "1 while the model can run (a lost worker's "
                             "layers re-placed), 0 once a worker is lost for good", registry=r)
        self.recoveries = Counter(PREFIX + "recoveries", "Times the model was made whole after "
                                  "a worker dropped: moved (its layers re-placed onto a spare or "
                                  "a survivor) or returned (it came back with its session); "
                                  "and the workers that left on purpose (drained: their layers "
                                  "moved off at a step boundary) or joined (took over layers)",
                                  ["outcome"], registry=r)
        self.recovery_seconds = Histogram(PREFIX + "recovery_seconds", "A recovery's parts: "
                                          "detection, load (the moved layers), prefill (the "
                                          "sequences replayed) and total", ["part"],
                                          buckets=RECOVERY_BUCKETS, registry=r)
        self.planned_seconds = Histogram(PREFIX + "planned_move_seconds", "A drain's or a "
                                         "join's parts: load (the moved layers), prefill (the "
                                         "sequences replayed) and total", ["part"],
                                         buckets=RECOVERY_BUCKETS, registry=r)
        for outcome in ("moved", "returned", "drained", "joined"):
            self.recoveries.labels(outcome)

    def bind(self, *, queue_depth: Callable[[], int], slots_in_use: Callable[[], int],
             healthy: Callable[[], bool]) -> None:
        """The engine's read-only views, read at each scrape."""
        self.queue_depth.set_function(lambda: float(queue_depth()))
        self.slots_in_use.set_function(lambda: float(slots_in_use()))
        self.healthy.set_function(lambda: float(healthy()))

    def token(self, seconds: float, first: bool) -> None:
        """A token generated ``seconds`` after the request arrived (``first``) or after the
        sequence's previous token."""
        (self.ttft if first else self.itl).observe(seconds)
        self.tokens.inc()

    def recovered(self, recovery: Recovery) -> None:
        """A recovery, drain or join is done (the model's thread, before the streams go on)."""
        if recovery.kind != "lost":
            self.recoveries.labels(recovery.kind).inc()
            moved = (recovery.load_seconds, recovery.prefill_seconds, recovery.total_seconds)
            for part, seconds in zip(RECOVERY_PARTS[1:], moved):
                self.planned_seconds.labels(part).observe(seconds)
            return
        self.recoveries.labels("moved" if recovery.moves else "returned").inc()
        parts = (recovery.detect_seconds, recovery.load_seconds, recovery.prefill_seconds,
                 recovery.total_seconds)
        for part, seconds in zip(RECOVERY_PARTS, parts):
            self.recovery_seconds.labels(part).observe(seconds)

    def finished(self, reason: str) -> None:
        self.finishes.labels(reason).inc()

    def answered(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def exposition(self) -> bytes:
        """The text format a Prometheus server scrapes."""
        return generate_latest(self.registry)
