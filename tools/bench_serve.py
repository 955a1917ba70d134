"""``zmq-rpc-bench`` case ``serve``: ``zmq-rpc-serve`` under S concurrent streaming clients, on 1
and 2 local workers, beside llama.cpp's ``llama-server`` in the same run.

For each placement (1, then 2 workers; ``--serve-workers``) and each stream count S (1, 4, 16;
``--streams``) two servers run side by side, each on its own processes: ours
(``zmq-rpc-serve --workers ... --slots S``) and, where llama.cpp's binaries are at hand
(``--llama-bin DIR`` or ``$ZMQ_RPC_LLAMA_BIN`` holding ``llama-server`` and ``rpc-server``),
``llama-server --rpc`` to as many ``rpc-server -t 1`` processes as we have workers (``-ngl 99``,
``-np S``, ``-t 1``, the same GGUF). At S = 1 our ``--serial`` server (one sequence at a time,
sampled here: what ``generate`` does) runs too, as the "generate today" reference. Rounds
alternate the servers (ours, llama-server, serial, ours, ...), so that the load of a shared
machine hits all alike.

A round: S asyncio clients (httpx, one connection each) each send ``REQUESTS_PER_STREAM``
streaming ``/v1/completions`` requests one after the other (greedy, ``max_tokens`` 64 by default,
``--max-tokens``), stream i starting at prompt i of :data:`PROMPTS` (fixed texts of 5 to ~110
tokens). From each request: the time to its first text chunk (TTFT) and the gaps between its
text chunks (inter-token latency, ITL: a chunk is one token but for text held back, a stop
string's prefix or a split UTF-8 character, which both servers send with the next token); its
tokens from the final ``usage`` chunk. Per round: aggregate generated tokens over the round's
wall time, TTFT and ITL p50 and p99. Rows give the median and range of the per-round figures.

The workers are ``zmq-rpc-worker --threads 1 --metrics-port 0`` subprocesses, one set for the
whole case (the 2-worker placement reuses the first); their ``zmq_rpc_graph_compute_seconds_total``
before and after each round gives each worker's share of the round spent computing (reported for
the largest S), and ``/proc/PID/stat`` their CPU share (and the ``rpc-server``\\s' for llama.cpp).

Targets (issue 27): at 16 streams on 2 workers aggregate tokens/s >= 2x llama-server's and
>= 1.7x our own 1-worker figure; at 1 stream no slower than ``--serial``.

Runs in the bench's main thread (each round in a fresh asyncio loop); every process it starts is
stopped when the placement ends. Not in the default set: a full run takes ~15-25 minutes on a
2-core machine (``--quick``: one round, one request per stream).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..worker.launch import ServerProcess, worker_argv
from .bench import BenchContext, CaseResult, Target, register_case
from .bench_families import LLAMA_BIN_ENV, _free_port, _stop, _wait_port, rpc_server

__all__ = ["PROMPTS", "RoundResult", "case_serve", "drive"]

SERVE = str(Path(sys.executable).with_name("zmq-rpc-serve"))
"""The console script the install put beside this interpreter."""

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Here is a short history of the printing press. In the fifteenth century, Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books quickly and cheaply. Before that,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which green plants and some other organisms use "
    "sunlight to synthesize foods from carbon dioxide and water. Photosynthesis in plants "
    "generally involves the green pigment chlorophyll and generates oxygen as a byproduct. "
    "The process takes place mainly in the leaves, where cells contain chloroplasts. The "
    "light-dependent reactions happen in the thylakoid membranes, and the Calvin cycle",
    "1, 2, 3, 4, 5,",
    "A recipe for a simple tomato soup: first, chop two onions and",
    "The three laws of thermodynamics can be summarized as follows. The first law says",
)
"""Fixed prompts of varied lengths (5 to ~110 SmolLM2 tokens), cycled over the streams."""

MAX_TOKENS = 64
STREAMS = (1, 4, 16)
WORKER_COUNTS = (1, 2)
REQUESTS_PER_STREAM = 2
CTX_PER_SLOT = 256
"""Tokens of context per sequence (the longest prompt and MAX_TOKENS fit), ours and llama's."""
HTTP_TIMEOUT_S = 600.0
"""Seconds a request may take (16 streams on a loaded 2-core machine are slow, never hung)."""
METRICS_TIMEOUT_S = 120.0
"""Seconds a worker's metrics scrape may take (its HTTP thread waits its turn for the GIL and,
on a loaded machine, for a core: 30 s was once not enough at a load average of 25 on 2 cores)."""
START_S = 180.0
"""Seconds a server may take to load the model and listen."""
LOG_TAIL = 3000
"""Bytes of the end of each llama.cpp process's log a failed round shows."""
TARGET_VS_LLAMA = 2.0
TARGET_SCALING = 1.7
NO_LLAMA = "no llama-server"
LLAMA = "llama-server"
SERIAL = "ours --serial"
SETTLE_S = 0.5
"""Apart this far, two equal reads of a worker's compute seconds are current: the worker publishes
its metrics between polls of up to 0.25 s, at most every 0.1 s, so a read right after a round
could miss the round's last requests (a short round then showed a compute share of 0)."""


# ---------------------------------------------------------------------------------- driver


@dataclass
class RequestResult:
    """One streamed request: seconds to its first text chunk, the gaps after, its tokens."""

    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class RoundResult:
    """One round of S streams: aggregate tokens/s and the latencies of every request."""

    tokens_per_s: float
    ttft: list[float]
    itl: list[float]
    tokens: int
    seconds: float

    def percentile(self, what: str, q: float) -> float:
        """The ``q``-th percentile of ``what`` (``ttft`` or ``itl``) in milliseconds."""
        values = getattr(self, what)
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """The request: greedy, streamed, with usage. ``cache_prompt`` off: llama-server would
    otherwise reuse a slot's KV of the same prompt from an earlier round and skip its prefill
    (ours keeps no prompt cache and ignores the field)."""
    return {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": False}


async def _request(http: Any, prompt: str, max_tokens: int) -> RequestResult:
    """Send one streaming completion and time its chunks."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = -1
    async with http.stream("POST", "/v1/completions", json=_body(prompt, max_tokens)) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"HTTP {answer.status_code}: {(await answer.aread())[:500]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if any(choice.get("text") for choice in chunk.get("choices", ())):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    if not stamps:
        raise RuntimeError(f"no text streamed for {prompt[:30]!r}")
    return RequestResult(stamps[0] - start, list(np.diff(stamps)),
                         tokens if tokens >= 0 else len(stamps))


async def _stream(http: Any, first: int, requests: int, max_tokens: int) -> list[RequestResult]:
    """One client: ``requests`` requests in turn, from prompt ``first`` on."""
    return [await _request(http, PROMPTS[(first + i) % len(PROMPTS)], max_tokens)
            for i in range(requests)]


async def _drive(url: str, streams: int, requests: int, max_tokens: int) -> RoundResult:
    import httpx

    # No kept-alive connections: llama-server (cpp-httplib) may close an idle kept-alive
    # connection just as the next request goes out on it, which httpx reports as
    # RemoteProtocolError "Server disconnected without sending a response" (a 16-stream round
    # failed so, after minutes); a fresh loopback connection per request costs ~0.1 ms, the same
    # for both servers.
    limits = httpx.Limits(max_keepalive_connections=0)
    clients = [httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S, limits=limits)
               for _ in range(streams)]
    try:
        start = time.perf_counter()
        done = await asyncio.gather(*(_stream(http, i, requests, max_tokens)
                                      for i, http in enumerate(clients)))
        seconds = time.perf_counter() - start
    finally:
        for http in clients:
            await http.aclose()
    results = [r for stream in done for r in stream]
    tokens = sum(r.tokens for r in results)
    return RoundResult(tokens / seconds, [r.ttft for r in results],
                       [gap for r in results for gap in r.gaps], tokens, seconds)


def drive(url: str, streams: int, requests: int = REQUESTS_PER_STREAM,
          max_tokens: int = MAX_TOKENS) -> RoundResult:
    """One round against the OpenAI server at ``url``: ``streams`` concurrent clients, each
    sending ``requests`` streaming completions in turn."""
    return asyncio.run(_drive(url, streams, requests, max_tokens))


# ------------------------------------------------------------------------------- processes


@dataclass
class Worker:
    """One of our workers, with its metrics address."""

    process: ServerProcess
    endpoint: str
    metrics: str

    def compute_seconds(self) -> float:
        """``zmq_rpc_graph_compute_seconds_total`` now."""
        import httpx

        for line in httpx.get(self.metrics, timeout=METRICS_TIMEOUT_S).text.splitlines():
            if line.startswith("zmq_rpc_graph_compute_seconds_total "):
                return float(line.split()[1])
        raise RuntimeError(f"{self.metrics} has no zmq_rpc_graph_compute_seconds_total")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def our_workers(count: int) -> Iterator[list[Worker]]:
    """``count`` local workers (one thread each) with metrics endpoints."""
    with ExitStack() as stack:
        procs = [ServerProcess(worker_argv("--metrics-port", "0")) for _ in range(count)]
        for proc in procs:
            stack.callback(proc.stop)
        workers = []
        for proc in procs:
            endpoint = proc.wait_ready()
            assert proc.proc.stdout is not None
            line = proc.proc.stdout.readline()
            if "metrics on " not in line:
                raise RuntimeError(f"worker did not announce its metrics: {line!r}")
            workers.append(Worker(proc, endpoint, line.rsplit(" ", 1)[1].strip()))
        yield workers


@contextmanager
def our_server(model: Path, workers: Sequence[Worker], slots: int,
               serial: bool = False) -> Iterator[str]:
    """A ``zmq-rpc-serve`` on ``workers`` with ``slots`` KV slots; its base URL."""
    argv = [SERVE, "--model", str(model), "--workers", ",".join(w.endpoint for w in workers),
            "--port", "0", "--slots", str(slots), "--ctx", str(CTX_PER_SLOT),
            "--max-queue", str(max(64, slots)), "--timeout", "120"]
    proc = ServerProcess(argv + (["--serial"] if serial else []))
    try:
        yield proc.wait_ready()
    finally:
        if proc.stop() != 0:
            print(f"serve: {' '.join(argv)} exited with an error:\n{proc.stderr()[-2000:]}",
                  file=sys.stderr)


@dataclass
class LlamaServer:
    """llama-server and its rpc-servers: the URL, the processes and where each logs."""

    url: str
    server: subprocess.Popen[Any]
    rpc: list[subprocess.Popen[Any]]
    logs: list[IO[bytes]]
    """llama-server's log, then each rpc-server's."""

    def measured(self, run: Measure) -> Measure:
        """``run``, failing with what llama-server and its rpc-servers said when it fails."""
        def checked() -> tuple[RoundResult, list[float], list[float]]:
            try:
                return run()
            except Exception as exc:
                raise RuntimeError(f"a round against llama-server failed ({exc!r}); "
                                   f"{self.report()}") from exc
        return checked

    def report(self) -> str:
        """Each process's state and the end of its log."""
        names = ["llama-server"] + [f"rpc-server {i + 1}" for i in range(len(self.rpc))]
        parts = []
        for name, proc, log in zip(names, [self.server, *self.rpc], self.logs):
            state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
            log.seek(0)
            tail = log.read()[-LOG_TAIL:].decode(errors="replace")
            parts.append(f"{name} {state}; its log ends:\n{tail}")
        return "\n".join(parts)


def llama_folder(ctx: BenchContext) -> tuple[Path | None, str]:
    """llama.cpp's binaries' folder if it has llama-server and rpc-server, else why not."""
    text = ctx.llama_bin or os.environ.get(LLAMA_BIN_ENV, "")
    if not text:
        return None, f"{NO_LLAMA}: give --llama-bin DIR or ${LLAMA_BIN_ENV}"
    folder = Path(text)
    missing = [name for name in ("llama-server", "rpc-server") if rpc_server(folder, name) is None]
    if missing:
        return None, f"{NO_LLAMA}: {folder} lacks {missing}"
    return folder, ""


@contextmanager
def llama_server(folder: Path, model: Path, count: int, slots: int) -> Iterator[LlamaServer]:
    """``llama-server --rpc`` to ``count`` fresh ``rpc-server -t 1``; every layer offloaded,
    ``-np slots``, ``CTX_PER_SLOT`` tokens per slot, one thread."""
    with ExitStack() as stack:
        rpc, addresses, logs = [], [], []
        for _ in range(count):
            port = _free_port()
            logs.append(stack.enter_context(tempfile.TemporaryFile()))
            proc = subprocess.Popen([str(rpc_server(folder)), "-H", "127.0.0.1", "-p", str(port),
                                     "-t", "1"], stdout=logs[-1], stderr=logs[-1])
            stack.callback(_stop, proc)
            _wait_port(proc, port)
            rpc.append(proc)
            addresses.append(f"127.0.0.1:{port}")
        port = _free_port()
        log = stack.enter_context(tempfile.TemporaryFile())
        server = subprocess.Popen(
            [str(folder / "llama-server"), "-m", str(model), "--rpc", ",".join(addresses),
             "-ngl", "99", "-t", "1", "-tb", "1", "-np", str(slots),
             "-c", str(CTX_PER_SLOT * slots), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=log)
        stack.callback(_stop, server)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(server, url, log)
        yield LlamaServer(url, server, rpc, [log, *logs])


def _wait_healthy(proc: subprocess.Popen[Any], url: str, log: Any) -> None:
    """Wait until llama-server's /health says 200 (it answers 503 while loading)."""
    import httpx

    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited with {proc.returncode}: "
                               f"{log.read()[-2000:].decode(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server not healthy within {START_S} s")


# ---------------------------------------------------------------------------------- rounds


@dataclass
class Cell:
    """What one server measured at one (workers, streams): a RoundResult per round, and for the
    shares, per round and worker, the compute and CPU seconds over the round's wall time."""

    rounds: list[RoundResult] = field(default_factory=list)
    compute_share: list[list[float]] = field(default_factory=list)
    cpu_share: list[list[float]] = field(default_factory=list)


Measure = Callable[[], tuple[RoundResult, list[float], list[float]]]


def _measured(url: str, streams: int, requests: int, max_tokens: int,
              compute: Sequence[Callable[[], float]], cpu: Sequence[int]) -> Measure:
    """A round against ``url`` that also reads each worker's compute seconds (``compute``) and
    CPU seconds (``cpu``: PIDs) before and after, as shares of the round's wall time."""
    def run() -> tuple[RoundResult, list[float], list[float]]:
        compute0, cpu0 = [settled(f) for f in compute], [cpu_seconds(p) for p in cpu]
        result = drive(url, streams, requests, max_tokens)
        shares = [(settled(f) - c) / result.seconds for f, c in zip(compute, compute0)]
        cpu_shares = [(cpu_seconds(p) - c) / result.seconds for p, c in zip(cpu, cpu0)]
        return result, shares, cpu_shares
    return run


def settled(read: Callable[[], float], limit_s: float = 10.0) -> float:
    """``read()`` once two reads :data:`SETTLE_S` apart agree (the worker is idle between rounds:
    its counter then stops moving once its last requests are published)."""
    last, deadline = read(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        now = read()
        if now == last:
            return now
        last = now
    return last


def alternate(runners: dict[str, Measure], rounds: int) -> dict[str, Cell]:
    """``rounds`` rounds, each running every server once, in turn."""
    cells = {name: Cell() for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            result, compute, cpu = run()
            cells[name].rounds.append(result)
            cells[name].compute_share.append(compute)
            cells[name].cpu_share.append(cpu)
    return cells


@dataclass
class Settings:
    """The case's knobs (from the command line, or ``--quick``)."""

    model: Path
    streams: tuple[int, ...]
    worker_counts: tuple[int, ...]
    max_tokens: int
    rounds: int
    requests: int


def placement(settings: Settings, workers: Sequence[Worker], llama: Path | None,
              streams: int) -> dict[str, Cell]:
    """Every server at ``streams`` streams on ``workers``, in alternated rounds."""
    n, s = len(workers), settings
    compute = [w.compute_seconds for w in workers]
    pids = [w.process.proc.pid for w in workers]
    with ExitStack() as stack:
        runners: dict[str, Measure] = {}
        url = stack.enter_context(our_server(s.model, workers, streams))
        runners["ours"] = _measured(url, streams, s.requests, s.max_tokens, compute, pids)
        if llama is not None:
            theirs = stack.enter_context(llama_server(llama, s.model, n, streams))
            runners[LLAMA] = theirs.measured(_measured(
                theirs.url, streams, s.requests, s.max_tokens, [], [p.pid for p in theirs.rpc]))
        if streams == 1:
            url = stack.enter_context(our_server(s.model, workers, 1, serial=True))
            runners[SERIAL] = _measured(url, 1, s.requests, s.max_tokens, compute, pids)
        _warm(runners)
        return alternate(runners, s.rounds)


def _warm(runners: dict[str, Measure]) -> None:
    """One uncounted round of each server (first runs of its graphs, its caches)."""
    for run in runners.values():
        run()


# ------------------------------------------------------------------------------------ rows


def _where(n: int, streams: int) -> str:
    return f"{n} worker{'s' if n > 1 else ''} {streams} stream{'s' if streams > 1 else ''}"


def _rates(cell: Cell) -> list[float]:
    return [r.tokens_per_s for r in cell.rounds]


def _summary(name: str, cell: Cell) -> str:
    def fig(values: Sequence[float]) -> str:
        return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"
    rounds = cell.rounds
    return (f"{name}: {fig(_rates(cell))} tok/s, TTFT p50 "
            f"{fig([r.percentile('ttft', 50) for r in rounds])} ms p99 "
            f"{fig([r.percentile('ttft', 99) for r in rounds])} ms, ITL p50 "
            f"{fig([r.percentile('itl', 50) for r in rounds])} ms p99 "
            f"{fig([r.percentile('itl', 99) for r in rounds])} ms; tokens/request "
            f"{rounds[0].tokens / len(rounds[0].ttft):.1f}")


def _percentile(what: str, q: float) -> Callable[[RoundResult], float]:
    return lambda r: r.percentile(what, q)


def cell_rows(n: int, streams: int, cells: dict[str, Cell], why_no_llama: str) -> list[CaseResult]:
    """Tokens/s, TTFT and ITL rows of one (workers, streams); baselines llama-server (or a NaN
    named why not) and, at 1 stream, ours --serial."""
    where = _where(n, streams)
    others = {name: cell for name, cell in cells.items() if name != "ours"}
    if LLAMA not in others:
        others = {NO_LLAMA: Cell(), **others}
    ours = cells["ours"]
    rows = []

    def samples(cell: Cell, fn: Callable[[RoundResult], float]) -> list[float]:
        return [fn(r) for r in cell.rounds] or [float("nan")]

    target = Target(TARGET_VS_LLAMA, True) if (n, streams) == (2, 16) else None
    rows.append(CaseResult("serve", f"serve tok/s {where}", "tok/s", _rates(ours),
                           {k: samples(c, lambda r: r.tokens_per_s) for k, c in others.items()},
                           target, True, compared_with=(LLAMA, NO_LLAMA),
                           note=why_no_llama or "aggregate generated tokens over the round"))
    if SERIAL in cells:
        rows.append(CaseResult("serve", f"serve tok/s {where} vs serial", "tok/s", _rates(ours),
                               {SERIAL: _rates(cells[SERIAL])}, Target(1.0, True), True,
                               note="target: no slower than the one-sequence engine"))
    for what, label in (("ttft", "TTFT"), ("itl", "ITL")):
        for q in (50, 99):
            rows.append(CaseResult(
                "serve", f"serve {label} p{q} {where}", "ms",
                samples(ours, _percentile(what, q)),
                {k: samples(c, _percentile(what, q)) for k, c in others.items()}, None, False,
                compared_with=(LLAMA, NO_LLAMA),
                note=f"per-round p{q}, median and range over rounds"))
    return rows


def share_rows(n: int, streams: int, cells: dict[str, Cell]) -> list[CaseResult]:
    """Each worker's compute share of the rounds at ``streams`` (ours), beside its CPU share and
    the rpc-servers' CPU share (llama-server's)."""
    out = []
    ours, theirs = cells["ours"], cells.get(LLAMA)
    for k in range(n):
        compute = [100 * round_[k] for round_ in ours.compute_share]
        base = {"its CPU share": [100 * round_[k] for round_ in ours.cpu_share]}
        if theirs is not None:
            base["llama rpc-server CPU share"] = [100 * round_[k] for round_ in theirs.cpu_share]
        out.append(CaseResult("serve", f"serve worker {k} compute share {_where(n, streams)}",
                              "%", compute, base, None, True,
                              note="graph compute seconds (the worker's metrics) over the "
                                   "round's wall time"))
    return out


def scaling_row(streams: int, by_workers: dict[int, dict[str, Cell]]) -> list[CaseResult]:
    """2 workers against 1 at ``streams`` streams (the stages overlap)."""
    if 1 not in by_workers or 2 not in by_workers:
        return []
    where = f"{streams} stream{'s' if streams > 1 else ''}"
    return [CaseResult("serve", f"serve tok/s 2 workers vs 1 worker {where}", "tok/s",
                       _rates(by_workers[2]["ours"]), {"ours 1 worker": _rates(by_workers[1]["ours"])},
                       Target(TARGET_SCALING, True) if streams == 16 else None, True,
                       note="target >=1.7x at 16 streams: every stage computes at once")]


def settings(ctx: BenchContext) -> Settings:
    from ..client.gguf_model import default_model_path

    model = Path(ctx.model) if ctx.model else default_model_path()
    return Settings(model, tuple(ctx.streams or STREAMS), tuple(ctx.serve_workers or WORKER_COUNTS),
                    ctx.max_tokens or MAX_TOKENS, ctx.reps(3, 1), ctx.reps(REQUESTS_PER_STREAM, 1))


@register_case("serve", "zmq-rpc-serve under 1/4/16 streaming clients on 1 and 2 workers vs "
               "llama-server --rpc (--llama-bin) and our --serial", default=False)
def case_serve(ctx: BenchContext) -> list[CaseResult]:
    try:
        import httpx  # noqa: F401 - the driver's client

        s = settings(ctx)
    except (ImportError, FileNotFoundError) as exc:
        print(f"serve: skipped ({exc})")
        return []
    llama, why = llama_folder(ctx)
    if why:
        print(f"serve: {why}", flush=True)
    rows: list[CaseResult] = []
    by_streams: dict[int, dict[int, dict[str, Cell]]] = {}
    with our_workers(max(s.worker_counts)) as workers:
        for n in s.worker_counts:
            for streams in s.streams:
                cells = placement(s, workers[:n], llama, streams)
                for name, cell in cells.items():
                    print(f"serve {_where(n, streams)}: {_summary(name, cell)}", flush=True)
                by_streams.setdefault(streams, {})[n] = cells
                rows += cell_rows(n, streams, cells, why)
                if streams == max(s.streams):
                    rows += share_rows(n, streams, cells)
    for streams, by_workers in by_streams.items():
        rows += scaling_row(streams, by_workers)
    return rows
