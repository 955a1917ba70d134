"""``zmq-rpc-bench``: our client against raw pyzmq and raw TCP doing the same work, side by side.

What runs where:

- **This process, main thread**: every timed loop (our :class:`~zmq_rpc.client.Client` calls and the
  baselines' client halves, :mod:`zmq_rpc.tools.baselines`), repetitions interleaved A B A B ... so
  that drift on a noisy machine hits both alike; the progress bars (tqdm, stderr) and the report
  (table on stdout, ``--json FILE`` with every sample).
- **This process, client I/O threads**: one per :class:`Client` (one per worker).
- **Subprocesses**: two ``zmq-rpc-worker --threads 1`` on random loopback ports (unless ``--workers``
  names running ones), and the baseline servers (``echo``, ``bulk-zmq``, ``bulk-tcp``), each
  started the first time a case asks for it. All are stopped with SIGTERM and waited for at the end.

Cases live in a registry (:func:`register_case`): a case is a function taking a :class:`BenchContext`
and returning :class:`CaseResult` rows (samples for ours and for each baseline, the unit, and the
target ratio with its direction). Other modules add cases by decorating their functions and being
listed in :data:`CASE_MODULES`; commands (``zmq-rpc-bench generate ...``) are added with
:func:`register_command`; without a command name, ``zmq-rpc-bench [options]`` runs the benchmark.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import numpy as np
import zmq
from tqdm import tqdm

from ..client import Client
from ..worker.cli import parse_size
from ..worker.launch import ServerProcess, endpoint_list, local_workers, worker_argv
from . import baselines as bl
from .builtin_commands import BUILTIN_COMMANDS
from .units import fmt, format_size

# ------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Target:
    """What "good enough" means for a row: ``ours / baseline`` compared with ``ratio``."""

    ratio: float
    higher_is_better: bool

    def met(self, ratio: float) -> bool:
        return ratio >= self.ratio if self.higher_is_better else ratio <= self.ratio

    def __str__(self) -> str:
        return f"{'>=' if self.higher_is_better else '<='}{self.ratio:g}x"


@dataclass
class CaseResult:
    """One row of the report: our samples, each baseline's samples, and the target.

    ``stat`` says how samples are summarized into the headline figure ("median", "p99" or "max"); the row
    is compared with the baseline whose headline is best (by the target's direction), among
    ``compared_with`` when it names some (the others are still reported).
    """

    case: str
    label: str
    unit: str
    ours: list[float]
    baselines: dict[str, list[float]]
    target: Target | None
    higher_is_better: bool
    stat: str = "median"
    note: str = ""
    compared_with: tuple[str, ...] = ()

    def headline(self, samples: Sequence[float]) -> float:
        """The summary figure of ``samples`` (median or p99)."""
        if self.stat == "p99":
            return float(np.percentile(samples, 99))
        if self.stat == "max":
            return float(max(samples))
        return float(statistics.median(samples))

    def best_baseline(self) -> str:
        """Name of the baseline with the best headline figure."""
        pick = max if self.higher_is_better else min
        names = [name for name in self.baselines if name in self.compared_with] or self.baselines
        return pick(names, key=lambda name: self.headline(self.baselines[name]))

    def ratio(self) -> float:
        """Our headline over the best baseline's."""
        base = self.headline(self.baselines[self.best_baseline()])
        return self.headline(self.ours) / base if base else float("nan")

    def passed(self) -> bool | None:
        """Whether the target is met (None when the row has none)."""
        return None if self.target is None else self.target.met(self.ratio())


CaseFn = Callable[["BenchContext"], list[CaseResult]]


@dataclass(frozen=True)
class Case:
    """A registered benchmark case."""

    name: str
    fn: CaseFn
    help: str
    default: bool


CASES: dict[str, Case] = {}
"""Every registered case, in registration order (the default run order)."""

CASE_MODULES: tuple[str, ...] = ("zmq_rpc.tools.bench_graph", "zmq_rpc.tools.bench_peer",
                                 "zmq_rpc.tools.bench_llm", "zmq_rpc.tools.bench_kernels",
                                 "zmq_rpc.tools.bench_links", "zmq_rpc.tools.bench_security",
                                 "zmq_rpc.tools.bench_faults", "zmq_rpc.tools.bench_weights",
                                 "zmq_rpc.tools.bench_observe", "zmq_rpc.tools.bench_gpu",
                                 "zmq_rpc.tools.bench_families", "zmq_rpc.tools.bench_serve",
                                 "zmq_rpc.tools.bench_startup", "zmq_rpc.tools.bench_memory")
"""Modules imported before the command line is read, so that their ``@register_case``\\s run."""

F = TypeVar("F", bound=CaseFn)


def register_case(name: str, help: str = "", default: bool = True) -> Callable[[F], F]:
    """Decorator: ``@register_case("graph", "4096-float add graph")`` adds a case to the registry."""
    def add(fn: F) -> F:
        if name in CASES:
            raise ValueError(f"benchmark case {name!r} is already registered")
        CASES[name] = Case(name, fn, help or (fn.__doc__ or "").strip().split("\n")[0], default)
        return fn
    return add


# ------------------------------------------------------------------------------- context


class Baselines:
    """Baseline servers, each started on first use and stopped by :meth:`stop_all`."""

    def __init__(self) -> None:
        self.servers: dict[str, ServerProcess] = {}

    def endpoint(self, kind: str) -> str:
        """The endpoint of the ``kind`` server (echo, bulk-zmq, bulk-tcp), starting it if needed."""
        if kind not in self.servers:
            server = ServerProcess(bl.baseline_argv(kind))
            self.servers[kind] = server
            server.wait_ready()
        return self.servers[kind].endpoint

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


@dataclass
class BenchContext:
    """What a case gets: clients (one per worker), endpoints, repetition policy, baseline servers."""

    endpoints: list[str]
    clients: list[Client]
    quick: bool
    sizes: list[int]
    baselines: Baselines
    zmq_ctx: zmq.Context[zmq.Socket[bytes]]
    show_progress: bool = True
    link: str = ""
    synthetic: int = 0
    """``--synthetic-model SIZE``: the ``links`` case also loads a synthetic GGUF this big."""
    """``--link RATE``: the rate of the shaped links of the ``links`` case (default 1gbit)."""
    llama_bin: str = ""
    """``--llama-bin DIR``: llama.cpp's binaries, the ``llm-families`` and ``serve`` cases'
    baseline."""
    llama_python: str = ""
    """``--llama-python PY``: a Python with ``llama_cpp``, the local baseline without llama-bench."""
    families: list[str] = field(default_factory=list)
    """``--families``: the ``llm-families`` case's families (default: all)."""
    model: str = ""
    """``--model PATH``: the ``serve`` case's GGUF (default SmolLM2)."""
    streams: list[int] = field(default_factory=list)
    """``--streams``: the ``serve`` case's concurrent clients (default 1,4,16)."""
    serve_workers: list[int] = field(default_factory=list)
    """``--serve-workers``: the ``serve`` case's worker counts (default 1,2)."""
    max_tokens: int = 0
    """``--max-tokens``: tokens per ``serve`` request (default 64)."""
    resources: ExitStack = field(default_factory=ExitStack)

    @property
    def client(self) -> Client:
        """The client of the first worker."""
        return self.clients[0]

    def reps(self, full: int, quick: int) -> int:
        """``quick`` repetitions under ``--quick``, else ``full``."""
        return quick if self.quick else full

    def progress(self, total: int, desc: str) -> tqdm[Any]:
        """A progress bar on stderr (close it, or use it as a context manager)."""
        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, unit="rep",
                    disable=not self.show_progress, dynamic_ncols=True)

    def workers(self, count: int) -> list[Client]:
        """The first ``count`` workers' clients, starting more local workers (stopped when the
        run ends) if the run has fewer."""
        while len(self.clients) < count:
            server = ServerProcess(worker_argv())
            self.resources.callback(server.stop)
            client = Client(server.wait_ready())
            self.resources.callback(client.close)
            self.clients.append(client)
            self.endpoints.append(client.endpoint)
        return self.clients[:count]

    def baseline_socket(self, kind: str) -> zmq.Socket[bytes]:
        """A DEALER connected to baseline server ``kind``, closed when the run ends."""
        sock = bl.dealer(self.zmq_ctx, self.baselines.endpoint(kind))
        self.resources.callback(sock.close, 0)
        return sock


Runner = Callable[[], float]


def interleave(runners: dict[str, Runner], reps: int, bar: tqdm[Any],
               warmup: int = 1, shuffle: bool = False) -> dict[str, list[float]]:
    """Run every runner once per repetition, in turn (A B A B ...); ``warmup`` rounds uncounted.

    ``shuffle``: each repetition in a new order (seeded), so that no runner always follows
    the same one. For calls of a few dozen µs the one before matters: in a fixed order ours,
    first after the echo server's round trip, woke an idle worker each time, and the raw
    DEALER after it found the worker awake (8% of the round trip, both ways round)."""
    for _ in range(warmup):
        for run in runners.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners.items())
    rng = random.Random(0)
    for _ in range(reps):
        if shuffle:
            rng.shuffle(order)
        for name, run in order:
            samples[name].append(run())
        bar.update(1)
    return samples


@contextmanager
def every(interval: float, tick: Callable[[], bool], name: str, join_s: float = 15.0) -> Iterator[None]:
    """Call ``tick()`` every ``interval`` seconds on a daemon thread while the block runs (until
    it returns False); the thread is joined (up to ``join_s``) when the block ends."""
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval) and tick():
            pass

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(join_s)


def elapsed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --------------------------------------------------------------------------------- cases

TINY = b"\x92\x02\xcd\x30\x39"
"""A baseline message as long as our PING request (msgpack ``[cmd, req_id]``, 5 bytes)."""
WINDOW = 512
"""Requests kept in flight by the pipelined baseline (the client's default window)."""


def _raw_protocol(ctx: BenchContext, signed: bool = True) -> bl.ProtocolDealer:
    """A bare DEALER speaking our protocol to the first worker, closed when the run ends.
    ``signed`` (the targets' baseline): its requests carry the session's signature, as our
    client's do, so the worker does the same work for both; unsigned, it skips that check
    (shown beside, without a target)."""
    raw = bl.ProtocolDealer(ctx.zmq_ctx, ctx.client.endpoint, signed=signed)
    ctx.resources.callback(raw.close)
    return raw


@register_case("rtt", "tiny request round trip (ping) vs a raw DEALER speaking our protocol to "
               "the same worker (signed as ours, and unsigned), and vs a raw DEALER->ROUTER "
               "echo")
def case_rtt(ctx: BenchContext) -> list[CaseResult]:
    """Per-call latency in µs, ours, the raw protocol's and the echo's calls alternating."""
    client = ctx.client
    sock = ctx.baseline_socket("echo")
    raw, unsigned = _raw_protocol(ctx), _raw_protocol(ctx, signed=False)
    runners = {"ours": lambda: elapsed(client.ping) * 1e6,
               "raw-protocol": lambda: elapsed(raw.ping) * 1e6,
               "raw-unsigned": lambda: elapsed(unsigned.ping) * 1e6,
               "zmq-echo": lambda: elapsed(lambda: bl.echo_once(sock, TINY)) * 1e6}
    reps = ctx.reps(2000, 300)
    with ctx.progress(reps, "rtt") as bar:
        samples = interleave(runners, reps, bar, warmup=200, shuffle=True)
    rows = [("rtt", "median", "zmq-echo", Target(1.5, higher_is_better=False)),
            ("rtt p99", "p99", "zmq-echo", None),
            ("rtt vs raw protocol", "median", "raw-protocol", Target(1.2, higher_is_better=False)),
            ("rtt p99 vs raw protocol", "p99", "raw-protocol", None),
            ("rtt vs raw unsigned", "median", "raw-unsigned", None)]
    return [CaseResult("rtt", label, "µs", samples["ours"], {base: samples[base]},
                       target, higher_is_better=False, stat=stat)
            for label, stat, base, target in rows]


def _ours_pipelined(client: Client, count: int) -> None:
    futures = [client.ping_async() for _ in range(count)]
    for future in futures:
        future.result()


def _ours_sync(client: Client, count: int) -> None:
    for _ in range(count):
        client.ping()


@register_case("pipelined", "10,000 pipelined pings vs a raw DEALER speaking our protocol to the "
               "same worker and vs a raw DEALER echo, both with a 512 window")
def case_pipelined(ctx: BenchContext) -> list[CaseResult]:
    """Calls/s: ours pipelined, the raw protocol and the echo pipelined, and ours synchronous
    (for the 5x check)."""
    client = ctx.client
    sock = ctx.baseline_socket("echo")
    raw, unsigned = _raw_protocol(ctx), _raw_protocol(ctx, signed=False)
    count = ctx.reps(10_000, 2_000)
    sync_count = ctx.reps(1_000, 200)
    runners = {
        "ours": lambda: count / elapsed(lambda: _ours_pipelined(client, count)) / 1e3,
        "raw-protocol": lambda: count / elapsed(lambda: raw.pipelined(count, WINDOW)) / 1e3,
        "raw-unsigned": lambda: count / elapsed(
            lambda: unsigned.pipelined(count, WINDOW)) / 1e3,
        "zmq-echo": lambda: count / elapsed(
            lambda: bl.echo_pipelined(sock, count, WINDOW, TINY)) / 1e3,
        "ours-sync": lambda: sync_count / elapsed(lambda: _ours_sync(client, sync_count)) / 1e3,
    }
    reps = ctx.reps(5, 2)
    with ctx.progress(reps, "pipelined") as bar:
        samples = interleave(runners, reps, bar)
    return [
        CaseResult("pipelined", "pipelined", "kcalls/s", samples["ours"],
                   {"zmq-echo": samples["zmq-echo"]}, Target(0.8, higher_is_better=True),
                   higher_is_better=True),
        CaseResult("pipelined", "pipelined vs raw protocol", "kcalls/s", samples["ours"],
                   {"raw-protocol": samples["raw-protocol"]}, Target(0.6, higher_is_better=True),
                   higher_is_better=True),
        CaseResult("pipelined", "pipelined vs raw unsigned", "kcalls/s", samples["ours"],
                   {"raw-unsigned": samples["raw-unsigned"]}, None, higher_is_better=True),
        CaseResult("pipelined", "pipelined vs own sync", "kcalls/s", samples["ours"],
                   {"ours-sync": samples["ours-sync"]}, Target(5.0, higher_is_better=True),
                   higher_is_better=True),
    ]


BULK_CHUNK = 4 << 20
"""Chunk size of the chunked raw-zmq baseline (the client's default chunk)."""
BYTES_PER_SAMPLE = 2 << 20
"""Small transfers are repeated within one sample until about this many bytes have moved."""


def _gbps(nbytes: int, inner: int, fn: Callable[[], Any]) -> Runner:
    """A runner: ``fn`` called ``inner`` times in a row, reported as GB/s."""
    def run() -> float:
        return nbytes * inner / elapsed(lambda: [fn() for _ in range(inner)]) / 1e9
    return run


def _transfer_reps(ctx: BenchContext, size: int) -> int:
    return ctx.reps(5, 2) if size > 16 << 20 else ctx.reps(7, 3)


def _bulk_clients(ctx: BenchContext) -> tuple[bl.ZmqBulk, bl.TcpBulk]:
    zmq_bulk = bl.ZmqBulk(ctx.zmq_ctx, ctx.baselines.endpoint("bulk-zmq"))
    ctx.resources.callback(zmq_bulk.close)
    tcp_bulk = bl.TcpBulk(ctx.baselines.endpoint("bulk-tcp"))
    ctx.resources.callback(tcp_bulk.close)
    return zmq_bulk, tcp_bulk


MakeRunners = Callable[[int, int, ExitStack], dict[str, Runner]]
PYZMQ_BULK = ("zmq-chunked", "zmq-whole")
"""What a transfer row's target compares with: the same bytes over raw pyzmq, the transport we
build on. Raw TCP (one copy, no framing) is reported beside it as the floor of what any
messaging layer costs."""


def _transfer_rows(ctx: BenchContext, case: str, make: MakeRunners) -> list[CaseResult]:
    """One row per size (and per variant of ours): ``make(size, inner, cleanup)`` gives the
    runners and registers in ``cleanup`` what to free once that size is done."""
    rows = []
    with ctx.progress(sum(_transfer_reps(ctx, s) for s in ctx.sizes), case) as bar:
        for size in ctx.sizes:
            inner = max(1, BYTES_PER_SAMPLE // size)
            with ExitStack() as cleanup:
                samples = interleave(make(size, inner, cleanup), _transfer_reps(ctx, size), bar)
            ours = {k: v for k, v in samples.items() if k.startswith("ours")}
            base = {k: v for k, v in samples.items() if not k.startswith("ours")}
            target = Target(0.9, higher_is_better=True) if size >= 16 << 20 else None
            for variant, values in ours.items():
                label = f"{case}{variant[4:]} {format_size(size)}"
                rows.append(CaseResult(case, label, "GB/s", values, base, target,
                                       higher_is_better=True, note=f"{inner} call(s)/sample",
                                       compared_with=PYZMQ_BULK))
    return rows


@register_case("set", "set_tensor at each size vs raw pyzmq and raw TCP uploads")
def case_set(ctx: BenchContext) -> list[CaseResult]:
    """GB/s of uploads landing in one preallocated array on the receiving side."""
    zmq_bulk, tcp_bulk = _bulk_clients(ctx)
    client = ctx.client

    def make(size: int, inner: int, cleanup: ExitStack) -> dict[str, Runner]:
        buffer = client.alloc_buffer(size)
        cleanup.callback(buffer.free)
        tensor = buffer.tensor(size, "uint8")
        source = np.ones(size, dtype=np.uint8)
        return {"ours": _gbps(size, inner, lambda: client.set_tensor(tensor, source)),
                "zmq-chunked": _gbps(size, inner, lambda: zmq_bulk.set(source, BULK_CHUNK)),
                "zmq-whole": _gbps(size, inner, lambda: zmq_bulk.set(source, size)),
                "tcp": _gbps(size, inner, lambda: tcp_bulk.set(source))}
    return _transfer_rows(ctx, "set", make)


@register_case("get", "get_tensor at each size vs raw pyzmq and raw TCP downloads")
def case_get(ctx: BenchContext) -> list[CaseResult]:
    """GB/s of downloads ending as one numpy array on the client."""
    zmq_bulk, tcp_bulk = _bulk_clients(ctx)
    client = ctx.client
    has_out = "out" in inspect.signature(Client.get_tensor).parameters

    def make(size: int, inner: int, cleanup: ExitStack) -> dict[str, Runner]:
        buffer = client.alloc_buffer(size)
        cleanup.callback(buffer.free)
        tensor = buffer.tensor(size, "uint8")
        client.set_tensor(tensor, np.ones(size, dtype=np.uint8))
        runners = {"ours": _gbps(size, inner, lambda: client.get_tensor(tensor))}
        if has_out:
            out = np.empty(size, dtype=np.uint8)
            runners["ours (out=)"] = _gbps(size, inner, lambda: client.get_tensor(
                tensor, out=out))
        runners.update({
            "zmq-chunked": _gbps(size, inner, lambda: zmq_bulk.get(size, BULK_CHUNK)),
            "zmq-whole": _gbps(size, inner, lambda: zmq_bulk.get(size, size)),
            "tcp": _gbps(size, inner, lambda: tcp_bulk.get(size))})
        return runners
    return _transfer_rows(ctx, "get", make)


# -------------------------------------------------------------------------------- report


def _figure(row: CaseResult, samples: Sequence[float]) -> str:
    return f"{fmt(row.headline(samples))} [{fmt(min(samples))}-{fmt(max(samples))}]"


def table_rows(results: Sequence[CaseResult]) -> list[list[str]]:
    """The report as cells: header first."""
    rows = [["case", "unit", "stat", "ours [min-max]", "baseline", "baseline [min-max]",
             "ratio", "target", "ok", "other baselines"]]
    for r in results:
        best = r.best_baseline()
        passed = r.passed()
        others = ", ".join(f"{name} {fmt(r.headline(v))}" for name, v in r.baselines.items()
                           if name != best)
        rows.append([r.label, r.unit, r.stat, _figure(r, r.ours), best,
                     _figure(r, r.baselines[best]), f"{r.ratio():.2f}x", str(r.target or "-"),
                     {True: "PASS", False: "FAIL", None: "-"}[passed], others])
    return rows


def format_table(results: Sequence[CaseResult]) -> str:
    """A plain-text table, columns padded to fit."""
    rows = table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def result_json(r: CaseResult) -> dict[str, Any]:
    """One row with all its samples and its summary."""
    out = asdict(r)
    out["target"] = None if r.target is None else asdict(r.target)
    out["summary"] = {"ours": r.headline(r.ours), "best_baseline": r.best_baseline(),
                      "baselines": {k: r.headline(v) for k, v in r.baselines.items()},
                      "ratio": r.ratio(), "passed": r.passed()}
    return out


def write_json(path: str, results: Sequence[CaseResult], meta: dict[str, Any]) -> None:
    """Every sample of every row, plus what the run was (versions, endpoints, timing)."""
    doc = {"meta": meta, "results": [result_json(r) for r in results]}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)


def run_meta(args: argparse.Namespace, endpoints: list[str], seconds: float) -> dict[str, Any]:
    """Where and how the figures were taken."""
    return {"argv": sys.argv, "cases": args.cases, "quick": args.quick, "endpoints": endpoints,
            "spawned_workers": not args.workers, "sizes": args.sizes, "seconds": seconds,
            "python": platform.python_version(), "pyzmq": zmq.pyzmq_version(),
            "libzmq": zmq.zmq_version(), "numpy": np.__version__, "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


# ----------------------------------------------------------------------------- lifecycle


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit (so the workers we started are stopped too)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(*_: object) -> None:
        raise SystemExit(128 + signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_cases(ctx: BenchContext, names: Sequence[str]) -> tuple[list[CaseResult], list[str]]:
    """Run the cases in order; a case that raises is reported and skipped, not fatal."""
    results: list[CaseResult] = []
    errors: list[str] = []
    for name in names:
        try:
            results.extend(CASES[name].fn(ctx))
        except Exception as exc:  # noqa: BLE001 - one broken case must not cost the others
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"zmq-rpc-bench: case {name} failed: {exc!r}", file=sys.stderr)
    return results, errors


def bench(args: argparse.Namespace, endpoints: list[str]) -> tuple[list[CaseResult], list[str]]:
    """Open clients and a zmq context, run the selected cases, close everything."""
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    baselines = Baselines()
    try:
        with ExitStack() as stack:
            clients = [stack.enter_context(Client(ep)) for ep in endpoints]
            ctx = BenchContext(endpoints, clients, args.quick, args.sizes, baselines, zctx,
                               show_progress=not args.no_progress, link=args.link,
                               synthetic=args.synthetic_model, llama_bin=args.llama_bin,
                               llama_python=args.llama_python, families=args.families,
                               model=args.model, streams=args.streams,
                               serve_workers=args.serve_workers, max_tokens=args.max_tokens)
            with ctx.resources:
                return run_cases(ctx, args.cases)
    finally:
        zctx.term()
        baselines.stop_all()


# ----------------------------------------------------------------------------------- CLI


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _case_list(text: str) -> list[str]:
    names = _csv(text)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown case(s) {unknown}; known: {list(CASES)}")
    return names


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in _csv(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"give integers >= 1: {text!r}")
    return values


def _size_list(text: str) -> list[int]:
    return [parse_size(part) for part in _csv(text)]


DESCRIPTION = ("Benchmark zmq-rpc against raw pyzmq and raw TCP doing the same work, each case "
               "beside its baseline from the same run (median and range per row).")


def build_run_parser(prog: str = "zmq-rpc-bench") -> argparse.ArgumentParser:
    """Options of ``zmq-rpc-bench`` (the benchmark; other commands have their own)."""
    cases = ", ".join(f"{c.name} ({c.help})" for c in CASES.values())
    commands = ", ".join(f"'{prog} {name} --help'" for name in COMMANDS)
    usage = "\n".join([f"{prog} [options]", *(f"       {prog} {name} [options]"
                                                for name in COMMANDS)])
    ap = argparse.ArgumentParser(prog=prog, usage=usage, description=DESCRIPTION,
                                 epilog=f"cases: {cases}. Commands: see {commands}.")
    ap.add_argument("--workers", type=endpoint_list, default=[],
                    help="comma-separated endpoints of running workers (default: start two)")
    ap.add_argument("--cases", type=_case_list,
                    default=[c.name for c in CASES.values() if c.default],
                    help="comma-separated cases to run (default: all)")
    ap.add_argument("--sizes", type=_size_list, default=[4 << 10, 1 << 20, 16 << 20, 256 << 20],
                    help="transfer sizes for set/get (default 4KiB,1MiB,16MiB,256MiB)")
    ap.add_argument("--link", metavar="RATE", default="",
                    help="rate of the simulated links of the 'links' case (e.g. 100mbit, 1gbit, "
                         "2.5gbit; tc units); alone, runs that case only (needs root, iproute2)")
    ap.add_argument("--synthetic-model", type=parse_size, default=0, metavar="SIZE",
                    help="the links case also loads a synthetic GGUF of random quantized blocks "
                         "this big (e.g. 2GiB; written to a temporary directory, deleted after)")
    ap.add_argument("--llama-bin", metavar="DIR", default="",
                    help="llama.cpp's binaries (llama-bench, llama-server, rpc-server): the "
                         "llm-families and serve cases' baseline on the same files (default "
                         "$ZMQ_RPC_LLAMA_BIN; without: no baseline, said so)")
    ap.add_argument("--llama-python", metavar="PY", default="",
                    help="a Python with llama-cpp-python: llm-families' local llama.cpp baseline "
                         "where llama-bench is not built (default $ZMQ_RPC_LLAMA_PYTHON)")
    ap.add_argument("--families", type=_csv, default=[],
                    help="the llm-families case's families (llama, llama3, qwen2, qwen3, gemma3, "
                         "phi3; default: all)")
    ap.add_argument("--model", metavar="PATH", default="",
                    help="the serve case's GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--streams", type=_int_list, default=[],
                    help="the serve case's concurrent streaming clients (default 1,4,16)")
    ap.add_argument("--serve-workers", type=_int_list, default=[],
                    help="the serve case's worker counts (default 1,2)")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="tokens each serve request generates (default 64)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (for tests)")
    ap.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    ap.add_argument("--report", metavar="DIR",
                    help="write DIR/bench.json, PNG plots and DIR/README.md (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    return ap


def run_command(argv: Sequence[str]) -> int:
    """``zmq-rpc-bench [options]``: the benchmark itself."""
    args = build_run_parser().parse_args(argv)
    if args.link and not any(a.startswith("--cases") for a in argv):
        args.cases = ["links"]
    start = time.perf_counter()
    with ExitStack() as stack:
        stack.enter_context(sigterm_exits())
        endpoints = args.workers or stack.enter_context(local_workers(2))
        results, errors = bench(args, endpoints)
    seconds = time.perf_counter() - start
    print(format_table(results))
    print(f"\n{len(results)} row(s) in {seconds:.1f} s", *errors, sep="\n")
    meta = run_meta(args, endpoints, seconds) | {"errors": errors}
    if args.json:
        write_json(args.json, results, meta)
    if args.report:
        from .report import write_report
        doc = {"meta": meta, "results": [result_json(r) for r in results]}
        for path in write_report(args.report, doc):
            print(f"wrote {path}")
    missed = any(r.passed() is False for r in results)
    return 1 if errors or (args.check and missed) else 0


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {}
"""Commands by name; the benchmark (:func:`run_command`) runs when the first argument names none."""


def register_command(name: str, fn: Callable[[Sequence[str]], int]) -> None:
    """Add a subcommand (``fn`` gets the arguments after its name and returns the exit code)."""
    if name in COMMANDS:
        raise ValueError(f"command {name!r} is already registered")
    COMMANDS[name] = fn


def load_case_modules() -> None:
    """Import :data:`CASE_MODULES` so that their cases and commands register themselves."""
    for module in CASE_MODULES:
        importlib.import_module(module)
    for name, fn in BUILTIN_COMMANDS.items():
        if name not in COMMANDS:
            register_command(name, fn)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``zmq-rpc-bench [options]`` (the benchmark) or ``zmq-rpc-bench COMMAND ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in BUILTIN_COMMANDS:
        return BUILTIN_COMMANDS[args[0]](args[1:])
    load_case_modules()
    if args and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    return run_command(args)


if __name__ == "__main__":
    # python -m zmq_rpc.tools.bench: the case modules fill the registry of the package's module
    from .bench import main as package_main

    sys.exit(package_main())
