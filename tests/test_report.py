"""``zmq-rpc-bench --report`` / ``zmq-rpc-bench report FILE DIR``: JSON, PNG plots and a Markdown
summary from result rows (synthetic rows here: the bench's own rows are tested in test_bench)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from zmq_rpc.tools.bench import CaseResult, Target, main, result_json
from zmq_rpc.tools.report import PLOTS, size_of
from zmq_rpc.tools.units import format_size

pytestmark = pytest.mark.timeout(120)


def rows() -> list[CaseResult]:
    out = []
    for case in ("set", "get"):
        for size in (4 << 10, 1 << 20, 16 << 20):
            out.append(CaseResult(case, f"{case} {format_size(size)}", "GB/s", [1.0, 1.2, 0.9],
                                  {"tcp": [2.0, 2.1], "zmq-chunked": [1.5, 1.6]},
                                  Target(0.9, True), True))
    out.append(CaseResult("get", "get (out=) 1MiB", "GB/s", [1.1], {"tcp": [2.0]}, None, True))
    out.append(CaseResult("rtt", "rtt", "µs", [100.0, 120, 300], {"zmq-echo": [80.0, 90]},
                          Target(1.5, False), False))
    for n in (2, 3):
        out.append(CaseResult("pipeline", f"pipeline {n} workers", "k rows/s", [5.0, 6.0],
                              {"1 worker": [3.0]}, None, True))
    out.append(CaseResult("llm", "llm generate 2 workers", "tok/s", [10.0, 11.0],
                          {"in-process": [12.0]}, None, True))
    return out


def test_report_from_a_saved_json(tmp_path: Path) -> None:
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"meta": {"time": "t", "cases": ["set"], "seconds": 1.0},
                                 "results": [result_json(r) for r in rows()]}))
    out = tmp_path / "report"
    assert main(["report", str(saved), str(out)]) == 0
    drawn = {p.stem for p in out.glob("*.png")}
    assert drawn == {"throughput", "latency", "pipeline", "tokens"}
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    summary = (out / "README.md").read_text()
    for name in drawn:
        assert f"]({name}.png)" in summary
    assert "| set 16MiB | GB/s | 1.00 [0.90-1.20] | tcp | 2.05 [2.00-2.10] | 0.49x | >=0.9x ✗ |" \
        in summary
    titles = {name: title for name, (title, _) in PLOTS.items()}
    assert titles["peer_vs_relay"] in summary.split("Not in this run")[1]
    assert json.loads((out / "bench.json").read_text())["meta"]["time"] == "t"


def test_sizes_are_read_from_labels() -> None:
    assert size_of("set 16MiB") == 16 << 20 and size_of("get (out=) 4KiB") == 4096
    assert size_of("rtt") is None and size_of("pipeline 2 workers") is None
