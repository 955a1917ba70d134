"""Where a decoded token's time went, from traced requests (``Client(trace=True)``).

Pure functions, called on the main thread of ``generate`` and of the bench once decoding is over.

A chained decode step is one linked run per stage (GRAPH_RUN_LINKED, or GRAPH_RUN_KEPT once the
worker keeps it), each worker's run started by the hand-off
of the stage before it (the last stage's token goes back to the first); on one worker it is one
GRAPH_RUN, the token's embedding copied into the next step's input by a COPY_TENSOR. The workers run one after
another, so a token's time T splits into: **compute** (inside the graphs, as the workers report
it), **worker work** (the rest of the runs: writing inputs, pushing the hand-off, fetching,
replying), and **hand-offs** (T minus the runs: bytes moving between workers and each worker
waking up for them). The client's own **messaging** per request (queued on the client, on the
wire both ways, back to the caller) is reported beside it: with steps issued ahead it overlaps
the chain rather than adding to it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..client.calls import RequestTiming

LINKED = ("GRAPH_RUN_LINKED", "GRAPH_RUN_KEPT")
"""A decode step's run, whole or kept (protocol 1.15)."""

STEP_RUNS = (*LINKED, "GRAPH_RUN")
"""A decode step's run on any number of stages (one stage: a plain run)."""


@dataclass(frozen=True)
class TokenSplit:
    """Means over the decode steps, in seconds per token, so that the parts add up to the
    token (messaging: medians per request)."""

    token: float
    compute: float
    worker_work: float
    hand_offs: float
    client_queue: float
    wire: float
    back: float
    steps: int
    stage_compute: tuple[float, ...] = ()
    """The compute's mean per stage, in pipeline order."""

    def line(self) -> str:
        """One line for a summary."""
        ms = 1e3
        return (f"where a token's time went (traced, mean of {self.steps} steps): "
                f"{self.token * ms:.2f} ms"
                f" = {self.compute * ms:.2f} compute + {self.worker_work * ms:.2f} worker work "
                f"(inputs, pushes, fetch, reply) + {self.hand_offs * ms:.2f} hand-offs between "
                f"workers; client messaging per request, overlapping the chain: "
                f"{self.client_queue * ms:.3f} ms queued on the client, {self.wire * ms:.3f} ms "
                f"on the wire (both ways), {self.back * ms:.3f} ms back to the caller")


def token_split(stages: Sequence[Sequence[RequestTiming]], token_seconds: Sequence[float]
                ) -> TokenSplit | None:
    """Split the decode steps' time; ``stages`` holds each stage's traced requests in order
    (the last ``len(token_seconds)`` runs of each are the decode steps). None when the
    traces do not cover every step (an untraced worker, too few runs)."""
    steps = len(token_seconds)
    runs = [[t for t in timings if t.cmd in STEP_RUNS][-steps:] for timings in stages]
    if steps == 0 or not runs or any(len(r) < steps for r in runs):
        return None
    per_step = list(zip(*runs))
    run = [sum(t.worker_run for t in step) for step in per_step]
    compute = [sum(t.compute for t in step) for step in per_step]
    med, mean = statistics.median, statistics.fmean
    every = [t for step in per_step for t in step]
    return TokenSplit(
        token=mean(token_seconds), compute=mean(compute),
        worker_work=mean(r - c for r, c in zip(run, compute)),
        hand_offs=mean(s - r for s, r in zip(token_seconds, run)),
        client_queue=med(t.client_queue for t in every), wire=med(t.wire for t in every),
        back=med(t.back for t in every), steps=steps,
        stage_compute=tuple(mean(t.compute for t in stage) for stage in runs))
