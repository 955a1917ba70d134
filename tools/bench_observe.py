"""Bench case ``metrics``: what the Prometheus metrics cost a worker on its hot path.

Runs on the bench's main thread (the timed loops) plus one scraper thread. Two local workers are
started for the case, alike but for ``--metrics-port``; the one with metrics is scraped once a
second for the whole case (faster than any real Prometheus scrapes), and the tiny round trip and
the pipelined rate are measured against both, rounds alternating (A B A B ...). The rows compare
"metrics on" against "metrics off" from the same run: the budget is a cost of at most 5 %.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from ..client import Client
from ..worker.launch import ServerProcess, worker_argv
from .bench import (
    BenchContext,
    CaseResult,
    Target,
    _ours_pipelined,
    elapsed,
    every,
    interleave,
    register_case,
)

SCRAPE_INTERVAL = 1.0


@contextmanager
def _worker(ctx: BenchContext, metrics: bool) -> Iterator[tuple[Client, str]]:
    """A local worker (with metrics on a free loopback port if asked) and a client of it."""
    argv = worker_argv() + (["--metrics-port", "0"] if metrics else [])
    server = ServerProcess(argv)
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
    count = [0]

    def scrape() -> bool:
        with urllib.request.urlopen(address, timeout=10) as response:
            response.read()
        count[0] += 1
        return True

    with every(SCRAPE_INTERVAL, scrape, "bench-scraper"):
        yield count


def backend_cpu(rounds: int, count: int) -> dict[str, list[float]]:
    """CPU µs the backend thread spends per tiny request (a PING through
    :meth:`Executor.handle_frames`, the reply sent nowhere), with and without a recorder, in
    alternating rounds: the hot-path cost itself, without the machine's scheduling noise. The
    recorder folds its pending requests every 1,000 (the worker does every 0.1 s), inside the
    measured time."""
    import os
    import time

    import zmq

    from ..broker import protocol as p
    from ..worker.backends.numpy_backend import NumpyBackend
    from ..worker.dispatch.executor import Executor
    from ..worker.observe.metrics import NullRecorder, Recorder
    from ..worker.peer.links import PeerLinks
    from ..worker.sessions.session import WorkerLimits

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    def executor(recorder: Recorder) -> tuple[Executor, bytes]:
        backend = NumpyBackend()
        ex = Executor(backend, WorkerLimits(1 << 26, 1 << 26, 64 << 20, 60.0),
                      lambda *a, **k: None, "bench", PeerLinks(ctx, backend), metrics=recorder)
        client_id = b"z" + os.urandom(15)
        hello = p.Hello(major=p.PROTOCOL_VERSION[0], minor=p.PROTOCOL_VERSION[1], client="b")
        ex.handle_frames([zmq.Frame(client_id),
                          zmq.Frame(p.encode_request(p.Cmd.HELLO, 1, hello))])
        return ex, client_id

    ping = p.encode_request(p.Cmd.PING, 2, p.Empty())

    def run(ex: Executor, client_id: bytes) -> float:
        start = time.thread_time()
        for i in range(count):
            ex.handle_frames([zmq.Frame(client_id), zmq.Frame(ping)])
            if i % 1000 == 999:         # the loop publishes (folds) every 0.1 s: ~1k requests
                ex.metrics.fold()
        return (time.thread_time() - start) / count * 1e6

    both = {"on": executor(Recorder()), "off": executor(NullRecorder())}
    samples: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for name, (ex, client_id) in both.items():
            samples[name].append(run(ex, client_id))
    ctx.term()
    return samples


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
    cpu = backend_cpu(ctx.reps(9, 3), ctx.reps(20_000, 2_000))
    return [
        CaseResult("metrics", "backend CPU/ping, metrics on vs off", "µs", cpu["on"],
                   {"off": cpu["off"]}, None, higher_is_better=False,
                   note="thread CPU time of Executor.handle_frames(PING) in this process"),
        CaseResult("metrics", "rtt, metrics on vs off", "µs", rtt["on"], {"off": rtt["off"]},
                   Target(1.05, higher_is_better=False), higher_is_better=False, note=note),
        CaseResult("metrics", "rtt p99, metrics on vs off", "µs", rtt["on"], {"off": rtt["off"]},
                   None, higher_is_better=False, stat="p99"),
        CaseResult("metrics", "pipelined, metrics on vs off", "kcalls/s", rate["on"],
                   {"off": rate["off"]}, Target(0.95, higher_is_better=True),
                   higher_is_better=True, note=note),
    ]


SPLIT_PARTS = ("compute", "worker work", "hand-offs")


@register_case("token_split", "where a decoded SmolLM2 token's time goes on 2 traced workers "
                              "(compute, worker work, hand-offs; client messaging)",
               default=False)
def case_token_split(ctx: BenchContext) -> list[CaseResult]:
    """Rows in ms per token (mean of each generation's steps; one sample per generation), each
    against the token's whole time: the parts' shares of it."""
    from ..client.gguf_model import default_model_path, load_gguf
    from ..client.llama import LlamaModel
    from .bench_llm import PROMPT_TOKENS
    from .timing import token_split

    parts: dict[str, list[float]] = {name: [] for name in (*SPLIT_PARTS, "token", "wire")}
    with ExitStack() as stack:
        clients = [stack.enter_context(Client(c.endpoint, trace=True))
                   for c in ctx.workers(2)]
        with LlamaModel.load(load_gguf(default_model_path()), clients) as model:
            for _ in range(ctx.reps(5, 2)):
                model.stats.clear()
                for client in clients:
                    client.timings()
                model.generate(PROMPT_TOKENS[:32], ctx.reps(33, 9), stop_ids=())
                decode = [s.seconds for s in model.stats if s.mode == "decode"]
                split = token_split([c.timings() for c in clients], decode)
                if split is None:
                    raise RuntimeError("the traces do not cover every decode step")
                for name, value in zip((*SPLIT_PARTS, "token", "wire"),
                                       (split.compute, split.worker_work, split.hand_offs,
                                        split.token, split.wire)):
                    parts[name].append(value * 1e3)
    rows = [CaseResult("llm", f"llm token split {name}", "ms", parts[name],
                       {"token": parts["token"]}, None, higher_is_better=False,
                       note="mean per token over one generation's steps; ratio = share")
            for name in SPLIT_PARTS]
    rows.append(CaseResult("llm", "llm token split client wire/request", "ms", parts["wire"],
                           {"token": parts["token"]}, None, higher_is_better=False,
                           note="median per request, both ways; overlaps the chain"))
    return rows
