"""Bench case ``metrics``: what the Prometheus metrics cost a worker on its hot path.

Runs on the bench's main thread (the timed loops) plus one scraper thread. Two local workers are
started for the case, alike but for ``--metrics-port``; the one with metrics is scraped once a
second for the whole case (faster than any real Prometheus scrapes), and the tiny round trip and
the pipelined rate are measured against both, rounds alternating (A B A B ...). The rows compare
"metrics on" against "metrics off" from the same run: the issue's budget is a cost of at most 5 %.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from ..client import Client
from . import baselines as bl
from .bench import (
    BenchContext,
    CaseResult,
    Target,
    _ours_pipelined,
    elapsed,
    interleave,
    register_case,
    worker_argv,
)

SCRAPE_INTERVAL = 1.0


@contextmanager
def _worker(ctx: BenchContext, metrics: bool) -> Iterator[tuple[Client, str]]:
    """A local worker (with metrics on a free loopback port if asked) and a client of it."""
    argv = worker_argv() + (["--metrics-port", "0"] if metrics else [])
    server = bl.ServerProcess(argv)
    try:
        endpoint = server.wait_ready()
        address = ""
        if metrics:
            assert server.proc.stdout is not None
            line = server.proc.stdout.readline()
            address = line.split(" on ", 1)[1].strip() if " on " in line else ""
        with Client(endpoint) as client:
            yield client, address
    finally:
        server.stop()


@contextmanager
def _scraping(address: str) -> Iterator[list[int]]:
    """Scrape ``address`` every second on a thread until the block ends; yields [scrapes]."""
    done = threading.Event()
    count = [0]

    def loop() -> None:
        while not done.wait(SCRAPE_INTERVAL):
            with urllib.request.urlopen(address, timeout=10) as response:
                response.read()
            count[0] += 1

    thread = threading.Thread(target=loop, name="bench-scraper", daemon=True)
    thread.start()
    try:
        yield count
    finally:
        done.set()
        thread.join(15)


@register_case("metrics", "round trip and pipelined rate with --metrics-port (scraped every "
                          "second) vs without, alternating", default=False)
def case_metrics(ctx: BenchContext) -> list[CaseResult]:
    """Rows: tiny round trip (median µs) and pipelined pings (kcalls/s), metrics on vs off."""
    with _worker(ctx, True) as (on, address), _worker(ctx, False) as (off, _), \
            _scraping(address) as scrapes:
        rtt_reps = ctx.reps(3000, 300)
        with ctx.progress(rtt_reps, "metrics rtt") as bar:
            rtt = interleave({"on": lambda: elapsed(on.ping) * 1e6,
                              "off": lambda: elapsed(off.ping) * 1e6}, rtt_reps, bar, warmup=200)
        count = ctx.reps(10_000, 2_000)
        reps = ctx.reps(9, 3)
        with ctx.progress(reps, "metrics pipelined") as bar:
            rate = interleave({
                "on": lambda: count / elapsed(lambda: _ours_pipelined(on, count)) / 1e3,
                "off": lambda: count / elapsed(lambda: _ours_pipelined(off, count)) / 1e3},
                reps, bar)
        note = f"{scrapes[0]} scrapes during the case"
    return [
        CaseResult("metrics", "rtt, metrics on vs off", "µs", rtt["on"], {"off": rtt["off"]},
                   Target(1.05, higher_is_better=False), higher_is_better=False, note=note),
        CaseResult("metrics", "rtt p99, metrics on vs off", "µs", rtt["on"], {"off": rtt["off"]},
                   None, higher_is_better=False, stat="p99"),
        CaseResult("metrics", "pipelined, metrics on vs off", "kcalls/s", rate["on"],
                   {"off": rate["off"]}, Target(0.95, higher_is_better=True),
                   higher_is_better=True, note=note),
    ]
