"""``zmq-rpc-bench --report DIR``: the bench's figures as JSON, PNG plots and a Markdown summary.

Runs on the bench's main thread once the cases are done (or from a saved ``--json`` file with
``zmq-rpc-bench report FILE DIR``). Reads only the rows' samples, so any subset of cases makes a
report: a plot whose cases did not run is left out and the summary says which. matplotlib
(the ``report`` extra) is imported here only, with the non-interactive Agg backend.

Plots (each ``DIR/<name>.png``): ``throughput`` (set/get GB/s by tensor size against raw pyzmq
and raw TCP, log-log), ``latency`` (distributions of the tiny round trip and the graph run
against the raw echo, and metrics on/off), ``peer_vs_relay`` (worker-to-worker copy against
relaying through the client, by size), ``pipeline`` (rows/s by worker count), ``tokens`` (SmolLM2
tokens/s by worker count for prefill and generation), ``time_split`` (where a decoded token's
time went, when the run measured it).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..worker.cli import parse_size
from .units import fmt, format_size

Row = dict[str, Any]
"""One result row as :func:`zmq_rpc.tools.bench.result_json` writes it."""

PLOTS: dict[str, tuple[str, Callable[[Any, list[Row]], bool]]] = {}
"""name -> (title for the summary, draw(axes-maker, rows) -> whether there was data)."""


def plot(name: str, title: str) -> Callable[[Callable[[Any, list[Row]], bool]],
                                            Callable[[Any, list[Row]], bool]]:
    def add(fn: Callable[[Any, list[Row]], bool]) -> Callable[[Any, list[Row]], bool]:
        PLOTS[name] = (title, fn)
        return fn
    return add


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def spread(values: Sequence[float]) -> tuple[float, float]:
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def size_of(label: str) -> int | None:
    """The size a row's label ends with ("set 16MiB" -> 16777216), if any."""
    try:
        return parse_size(label.rsplit(" ", 1)[-1])
    except Exception:  # noqa: BLE001 - argparse's error type; not a sized row
        return None


def _series_by_size(rows: list[Row], case: str) -> dict[str, list[tuple[int, list[float]]]]:
    """case rows by size: {"ours": [(size, samples)], "ours (out=)": ..., "<baseline>": [...]}
    in size order (a variant of ours is what its label adds to the case's name; baselines
    shared by several variants of a size are taken once)."""
    series: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        size = size_of(row["label"])
        if row["case"] != case or size is None:
            continue
        variant = row["label"].rsplit(" ", 1)[0].removeprefix(case).strip()
        series.setdefault(f"ours {variant}".strip(), {})[size] = row["ours"]
        for name, samples in row["baselines"].items():
            series.setdefault(name, {}).setdefault(size, samples)
    return {k: sorted(v.items()) for k, v in series.items()}


def _line(ax: Any, points: Sequence[tuple[float, list[float]]], label: str, **style: Any) -> None:
    """Median line with a min-max band."""
    xs = [x for x, _ in points]
    meds = [median(s) for _, s in points]
    lo = [spread(s)[0] for _, s in points]
    hi = [spread(s)[1] for _, s in points]
    line, = ax.plot(xs, meds, marker="o", label=label, **style)
    ax.fill_between(xs, lo, hi, alpha=0.15, color=line.get_color())


def _plain(axis: Any) -> None:
    """Log-axis tick labels as plain numbers (60, 100, 200), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _size_axis(ax: Any, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([format_size(s) for s in sizes])
    ax.minorticks_off()


@plot("throughput", "Throughput by tensor size against raw pyzmq and raw TCP")
def _throughput(figure: Any, rows: list[Row]) -> bool:
    cases = [c for c in ("set", "get") if _series_by_size(rows, c)]
    if not cases:
        return False
    axes = figure(1, len(cases))
    for ax, case in zip(axes, cases):
        series = _series_by_size(rows, case)
        for name, points in series.items():
            ours = name.startswith("ours")
            _line(ax, points, name.replace("ours", "zmq-rpc") if ours else name,
                  linewidth=2.5 if ours else 1.2, linestyle="-" if name == "ours" or not ours
                  else "--")
        _size_axis(ax, sorted({s for pts in series.values() for s, _ in pts}))
        ax.set_yscale("log")
        _plain(ax.yaxis)
        verb = "upload (set_tensor)" if case == "set" else "download (get_tensor)"
        ax.set(title=verb, xlabel="tensor size", ylabel="throughput (GB/s, log)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return True


LATENCY_ROWS = (("rtt", "rtt"), ("graph_run", "graph_run"), ("metrics", "rtt, metrics on vs off"))


@plot("latency", "Latency distributions (tiny round trip, graph run, metrics on/off)")
def _latency(figure: Any, rows: list[Row]) -> bool:
    picked = [r for case, label in LATENCY_ROWS for r in rows
              if r["case"] == case and r["label"] == label]
    if not picked:
        return False
    axes = figure(1, len(picked))
    for ax, row in zip(axes, picked):
        series = {"ours" if row["case"] != "metrics" else "metrics on": row["ours"],
                  **row["baselines"]}
        for name, samples in series.items():
            values = sorted(samples)
            share = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot(values, share, label=f"{name} (median {median(values):.0f} µs)")
        ax.set_xscale("log")
        _plain(ax.xaxis)
        ax.set(title=row["label"], xlabel=f"latency ({row['unit']}, log)",
               ylabel="share of calls at or below")
        ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return True


@plot("peer_vs_relay", "Worker-to-worker copy against relaying through the client, by size")
def _peer(figure: Any, rows: list[Row]) -> bool:
    series = _series_by_size(rows, "peer_copy")
    if not series:
        return False
    ax = figure(1, 1)[0]
    for name, points in series.items():
        _line(ax, points, "worker to worker" if name.startswith("ours")
              else f"{name} via the client")
    _size_axis(ax, sorted({s for pts in series.values() for s, _ in pts}))
    ax.set_yscale("log")
    _plain(ax.yaxis)
    ax.set(title="peer copy vs relay", xlabel="tensor size", ylabel="throughput (GB/s, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return True


def _by_workers(rows: list[Row], case: str, prefix: str) -> list[tuple[int, list[float]]]:
    points = []
    for row in rows:
        label = row["label"]
        if row["case"] != case or not label.startswith(prefix):
            continue
        rest = label[len(prefix):].split()
        if len(rest) == 2 and rest[0].isdigit() and rest[1].startswith("worker"):
            points.append((int(rest[0]), row["ours"]))
    return sorted(points)


@plot("pipeline", "Pipeline throughput by worker count")
def _pipeline(figure: Any, rows: list[Row]) -> bool:
    points = _by_workers(rows, "pipeline", "pipeline ")
    if not points:
        return False
    ax = figure(1, 1)[0]
    _line(ax, [(float(n), s) for n, s in points], "zmq-rpc pipeline (median, min-max band)")
    ax.set_xticks([n for n, _ in points])
    ax.set_ylim(bottom=0)
    ax.set(title="pipeline scaling", xlabel="workers (stages)",
           ylabel="throughput (thousand rows/s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return True


TOKEN_MODES = ("prefill 32", "prefill 128", "generate")


@plot("tokens", "SmolLM2 tokens/s by worker count and mode")
def _tokens(figure: Any, rows: list[Row]) -> bool:
    modes = {m: _by_workers(rows, "llm", f"llm {m} ") for m in TOKEN_MODES}
    modes = {m: pts for m, pts in modes.items() if pts}
    if not modes:
        return False
    ax = figure(1, 1)[0]
    for mode, points in modes.items():
        base = next((r["baselines"].get("in-process") for r in rows
                     if r["case"] == "llm" and r["label"].startswith(f"llm {mode} ")), None)
        if base:
            points = [(0, base), *points]
        _line(ax, [(float(n), s) for n, s in points], mode)
    counts = sorted({n for pts in modes.values() for n, _ in pts} | {0})
    ax.set_xticks(counts)
    ax.set_xticklabels(["in-process" if n == 0 else str(n) for n in counts])
    ax.set_yscale("log")
    _plain(ax.yaxis)
    ax.set(title="SmolLM2-135M", xlabel="workers (0: in-process, no messaging)",
           ylabel="tokens/s (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return True


@plot("time_split", "Where a decoded token's time went")
def _time_split(figure: Any, rows: list[Row]) -> bool:
    parts = [r for r in rows if r["case"] == "llm" and r["label"].startswith("llm token split ")]
    if not parts:
        return False
    ax = figure(1, 1)[0]
    names = [r["label"].removeprefix("llm token split ") for r in parts]
    meds = [median(r["ours"]) for r in parts]
    errs = [[m - spread(r["ours"])[0] for m, r in zip(meds, parts)],
            [spread(r["ours"])[1] - m for m, r in zip(meds, parts)]]
    colors = ["tab:grey" if "request" in n else "tab:blue" for n in names]
    names = [n.replace("client wire/request", "client wire\n(per request,\noverlaps the chain)")
             for n in names]
    ax.bar(names, meds, yerr=errs, capsize=4, color=colors)
    ax.set(title="decode, 2 workers: mean ms per token by part (grey: per request)",
           ylabel="ms", xlabel="part (bars: median over generations; whiskers: min-max)")
    ax.grid(True, axis="y", alpha=0.3)
    return True


def _figure_maker(plt: Any) -> tuple[Callable[[int, int], list[Any]], list[Any]]:
    made: list[Any] = []

    def make(nrows: int, ncols: int) -> list[Any]:
        fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.6 * nrows), squeeze=False)
        made.append(fig)
        return list(axes.flat)
    return make, made


def write_report(directory: str, doc: dict[str, Any]) -> list[str]:
    """Write ``bench.json``, the PNGs and ``README.md`` into ``directory``; returns the PNGs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(doc, indent=1))
    drawn: list[tuple[str, str]] = []
    missing: list[str] = []
    for name, (title, draw) in PLOTS.items():
        make, figures = _figure_maker(plt)
        if draw(make, doc["results"]):
            figures[0].suptitle(title)
            figures[0].tight_layout()
            figures[0].savefig(out / f"{name}.png", dpi=110)
            drawn.append((name, title))
        else:
            missing.append(title)
        for fig in figures:
            plt.close(fig)
    (out / "README.md").write_text(summary(doc, drawn, missing))
    return [str(out / f"{name}.png") for name, _ in drawn]


def summary(doc: dict[str, Any], drawn: list[tuple[str, str]], missing: list[str]) -> str:
    """The Markdown summary: the run, the table, each plot embedded."""
    meta = doc.get("meta", {})
    lines = ["# zmq-rpc bench report", "",
             f"Run {meta.get('time', '?')} on {meta.get('machine', '?')}, Python "
             f"{meta.get('python', '?')}, pyzmq {meta.get('pyzmq', '?')} / libzmq "
             f"{meta.get('libzmq', '?')}; cases {', '.join(meta.get('cases', []))}; "
             f"{meta.get('seconds', 0):.0f} s. Every figure is a median with its min-max range; "
             "each row's baseline ran in the same run, rounds alternating. Samples: "
             "`bench.json`.", "",
             "| row | unit | ours [min-max] | baseline | baseline [min-max] | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        s = r["summary"]
        best = s["best_baseline"]
        lo, hi = spread(r["ours"])
        blo, bhi = spread(r["baselines"][best])
        target = r.get("target")
        mark = "" if s["passed"] is None else (" ✓" if s["passed"] else " ✗")
        goal = (f"{'>=' if target['higher_is_better'] else '<='}{target['ratio']:g}x{mark}"
                if target else "-")
        lines.append(f"| {r['label']} | {r['unit']} | {fmt(s['ours'])} [{fmt(lo)}-{fmt(hi)}] | "
                     f"{best} | {fmt(s['baselines'][best])} [{fmt(blo)}-{fmt(bhi)}] | "
                     f"{s['ratio']:.2f}x | {goal} |")
    for name, title in drawn:
        lines += ["", f"## {title}", "", f"![{title}]({name}.png)"]
    if missing:
        lines += ["", "Not in this run (their cases were not selected): " + "; ".join(missing)
                  + "."]
    errors = meta.get("errors") or []
    if errors:
        lines += ["", "Cases that failed:", *[f"- {e}" for e in errors]]
    return "\n".join(lines) + "\n"


def report_command(argv: Sequence[str]) -> int:
    """``zmq-rpc-bench report FILE DIR``: a report from a saved ``--json`` file."""
    import argparse
    ap = argparse.ArgumentParser(prog="zmq-rpc-bench report",
                                 description="Draw the bench report (PNG plots and a Markdown "
                                             "summary) from a saved --json file.")
    ap.add_argument("bench_json", help="a file written by zmq-rpc-bench --json")
    ap.add_argument("directory", help="where to write bench.json, the PNGs and README.md")
    args = ap.parse_args(list(argv))
    with open(args.bench_json, encoding="utf-8") as fh:
        doc = json.load(fh)
    for path in write_report(args.directory, doc):
        print(path)
    return 0
