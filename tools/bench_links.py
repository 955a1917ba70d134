"""``zmq-rpc-bench`` case ``links`` (or ``--link RATE``): workers and the client on separate hosts.

A :class:`~zmq_rpc.tools.netlab.NetLab` puts the client and two workers (``w0``, ``w1``) each in
its own network namespace, on links shaped to ``--link`` (default 1gbit) with ``tc tbf``; no
latency is added (netem is not available here). Rows:

- ``links set|get SIZE``: GB/s of uploads/downloads between the client and ``w0``, against the
  link's own rate (the ratio is the fraction of the link we fill) and raw TCP over the same link
  (the bench's bulk-tcp server, started on ``w0``).
- ``links peer_copy SIZE``: a copy ``w0 -> w1`` (worker to worker) vs the client's relay (get on
  ``w0``, set on ``w1``), first with every link at the rate, then with the workers on 10 Gbit/s
  links and the client behind its own shaped link (the case the direct copy exists for).
- ``links llm generate`` / ``links llm load``: SmolLM2-135M on two workers on separate hosts vs
  two workers on the client host's loopback (same machine, same cores), alternated.
- ``links load SmolLM2 ... cache cold|cache warm|file``: seconds until the weights are in place
  and bytes on the wire, against a plain upload in the same round (:mod:`.bench_weights`); with
  ``--synthetic-model 2GiB`` the same for a synthetic GGUF of random quantized blocks.

Runs in the bench's main thread, which moves into the client's namespace for each measurement
(:meth:`NetLab.inside`): the clients and zmq contexts made there, with their I/O threads, live in
that host. Skipped, with the reason, without root or iproute2.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from ..client import Client
from . import baselines as bl
from . import netlab
from .bench import BenchContext, CaseResult, Runner, Target, _gbps, interleave, register_case
from .bench_peer import _copy_row, floats, free_all
from .bench_weights import llama_load_rows, synthetic_load_rows
from .units import format_size

LINK_SIZES = (1 << 20, 16 << 20, 64 << 20)
COPY_SIZES = (64 << 10, 1 << 20, 16 << 20)
FAST_WORKER_LINK = "10gbit"
HOSTS = ("client", "w0", "w1")


@contextmanager
def lab_workers(lab: netlab.NetLab, hosts: Sequence[str],
                extra: Sequence[str] = ()) -> Iterator[list[Client]]:
    """Clients (made inside the client host) of workers started on ``hosts``; "lo" puts a worker
    on the client host's own loopback. Workers are stopped and clients closed on exit."""
    endpoints = []
    servers = []
    for host in hosts:
        on = "client" if host == "lo" else host
        argv = netlab.worker_argv(lab, on, *extra,
                                  bind="tcp://127.0.0.1:*" if host == "lo" else None)
        servers.append(lab.serve(on, argv))
        endpoints.append(servers[-1].endpoint)
    with ExitStack() as stack:
        for server in servers:
            stack.callback(server.stop)
        with lab.inside("client"):
            clients = [stack.enter_context(Client(ep)) for ep in endpoints]
        yield clients


def link_gbps(rate: str) -> float:
    return netlab.rate_bits(rate) / 8 / 1e9


def transfer_rows(ctx: BenchContext, lab: netlab.NetLab, client: Client,
                  rate: str) -> list[CaseResult]:
    """set/get at LINK_SIZES between the client and w0 vs the link rate and raw TCP."""
    tcp_server = lab.serve("w0", bl.baseline_argv("bulk-tcp", f"tcp://{lab.address('w0')}:*"))
    with lab.inside("client"):
        tcp = bl.TcpBulk(tcp_server.endpoint)
    rows = []
    try:
        with ctx.progress(2 * len(LINK_SIZES) * ctx.reps(5, 2), "links set/get") as bar:
            for size in LINK_SIZES:
                rows += _transfer_pair(ctx, client, tcp, size, rate, bar)
    finally:
        tcp.close()
        tcp_server.stop()
    return rows


def _transfer_pair(ctx: BenchContext, client: Client, tcp: bl.TcpBulk, size: int, rate: str,
                   bar: Any) -> list[CaseResult]:
    buffer = client.alloc_buffer(size)
    try:
        tensor = buffer.tensor(size, "uint8")
        source = np.ones(size, dtype=np.uint8)
        out = np.empty(size, dtype=np.uint8)
        runs: dict[str, dict[str, Runner]] = {
            "set": {"ours": _gbps(size, 1, lambda: client.set_tensor(tensor, source)),
                    "raw tcp": _gbps(size, 1, lambda: tcp.set(source))},
            "get": {"ours": _gbps(size, 1, lambda: client.get_tensor(tensor, out=out)),
                    "raw tcp": _gbps(size, 1, lambda: tcp.get(size))}}
        rows = []
        for op, runners in runs.items():
            samples = interleave(runners, ctx.reps(5, 2), bar)
            rows.append(CaseResult(
                "links", f"links {op} {format_size(size)}", "GB/s", samples["ours"],
                {f"link {rate}": [link_gbps(rate)], "raw tcp": samples["raw tcp"]},
                Target(0.9, True) if size >= 16 << 20 else None, True,
                note="ratio = fraction of the link rate"))
        return rows
    finally:
        buffer.free()


def copy_rows(ctx: BenchContext, a: Client, b: Client, label: str) -> list[CaseResult]:
    """bench_peer's peer_copy rows (direct vs relay, alternated) at COPY_SIZES."""
    rows = []
    with ctx.progress(len(COPY_SIZES) * ctx.reps(5, 2), f"links copy {label}") as bar:
        for size in COPY_SIZES:
            src, dst = floats(a, size // 4, 1.0), floats(b, size // 4)
            try:
                row = _copy_row(ctx, size, src, dst, bar)
            finally:
                free_all([src, dst])
            row.case, row.label = "links", f"links peer_copy {format_size(size)} {label}"
            rows.append(row)
    return rows


def llm_rows(ctx: BenchContext, lab: netlab.NetLab, rate: str) -> list[CaseResult]:
    """SmolLM2 on w0+w1 vs on two loopback workers on the client host, alternated."""
    from .bench_llm import Placement, measure

    runs: dict[str, list[Placement]] = {"hosts": [], "loopback": []}
    for _ in range(ctx.reps(2, 1)):
        for name, hosts in (("hosts", ("w0", "w1")), ("loopback", ("lo", "lo"))):
            with lab_workers(lab, hosts) as clients, lab.inside("client"):
                runs[name].append(measure(name, clients, ctx))

    def merged(name: str, attr: str) -> list[float]:
        return [x for run in runs[name] for x in getattr(run, attr)]
    upload = runs["hosts"][0].upload_bytes
    return [
        CaseResult("links", f"links llm generate 2 hosts {rate}", "tok/s",
                   merged("hosts", "generate"), {"loopback": merged("loopback", "generate")},
                   None, True, note="2 workers on separate hosts vs both on loopback"),
        CaseResult("links", f"links llm load 2 hosts {rate}", "s",
                   merged("hosts", "load_seconds"), {"loopback": merged("loopback",
                                                                        "load_seconds")},
                   None, False,
                   note=f"{upload / 1e6:.0f} MB uploaded; link time alone "
                        f"{upload / 2 / (link_gbps(rate) * 1e9):.2f} s per worker link "
                        f"(both in parallel through the client's: "
                        f"{upload / (link_gbps(rate) * 1e9):.2f} s)"),
    ]


@register_case("links", "client and workers on separate hosts (network namespaces, tbf-shaped "
               "links, --link RATE): set/get vs link rate, peer copy vs relay, SmolLM2",
               default=False)
def case_links(ctx: BenchContext) -> list[CaseResult]:
    reason = netlab.unavailable_reason()
    if reason:
        print(f"links: skipped ({reason})")
        return []
    rate = ctx.link or "1gbit"
    rows: list[CaseResult] = []
    with netlab.NetLab(dict.fromkeys(HOSTS, rate)) as lab:
        with lab_workers(lab, ("w0", "w1")) as (a, b):
            rows += transfer_rows(ctx, lab, a, rate)
            rows += copy_rows(ctx, a, b, f"all {rate}")
            for host in ("w0", "w1"):
                lab.shape(host, FAST_WORKER_LINK)
            rows += copy_rows(ctx, a, b, f"client {rate}, workers {FAST_WORKER_LINK}")
            for host in ("w0", "w1"):
                lab.shape(host, rate)
        def start(extra: Sequence[str]) -> Any:
            return lab_workers(lab, ("w0", "w1"), extra)
        if _have_model():
            rows += llm_rows(ctx, lab, rate)
            rows += llama_load_rows(ctx, start, f"links load SmolLM2 2 hosts {rate}")
        if ctx.synthetic:
            rows += synthetic_load_rows(ctx, start, ctx.synthetic,
                                        f"links load synthetic 2 hosts {rate}")
    return rows


def _have_model() -> bool:
    try:
        from ..client.gguf_model import default_model_path
        default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        print(f"links llm: skipped ({exc})")
        return False
    return True


if __name__ == "__main__":
    from .bench import main

    sys.exit(main(["--cases", "links", *sys.argv[1:]]))
