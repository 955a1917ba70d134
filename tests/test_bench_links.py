"""Tests of the ``links`` bench case (:mod:`zmq_rpc.tools.bench_links`): hosts on shaped links.

Figures are noise here: the tests check that the case builds its lab, reports every row with
samples against the right baselines, skips with a reason where it cannot run, and leaves no
namespace behind; never how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from zmq_rpc.tools import bench, bench_links, netlab

needs_lab = pytest.mark.skipif(netlab.unavailable_reason() is not None,
                               reason=f"multi-host lab: {netlab.unavailable_reason()}")


def _our_namespaces() -> list[str]:
    """Lab namespaces made by this process (other engineers' labs may exist meanwhile)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = f"{netlab.PREFIX}{os.getpid()}x"
    return [line.split()[0] for line in out.splitlines() if line.startswith(mine)]


@pytest.mark.timeout(60)
def test_link_option_alone_selects_the_links_case(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(netlab, "unavailable_reason", lambda: "network namespaces need root")
    assert bench.main(["--link", "100mbit", "--quick", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "links: skipped (network namespaces need root)" in out
    assert "0 row(s)" in out


@needs_lab
@pytest.mark.timeout(300)
def test_quick_links_run_reports_rows_against_link_rate_and_relay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_links, "LINK_SIZES", (1 << 20,))
    monkeypatch.setattr(bench_links, "COPY_SIZES", (64 << 10,))
    monkeypatch.setattr(bench_links, "_have_model", lambda: False)
    out = tmp_path / "links.json"
    assert bench.main(["--cases", "links", "--link", "200mbit", "--quick", "--no-progress",
                       "--json", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"links set 1MiB", "links get 1MiB", "links peer_copy 64KiB all 200mbit",
                         "links peer_copy 64KiB client 200mbit, workers 10gbit"}
    assert rows["links set 1MiB"]["baselines"]["link 200mbit"] == [0.025]
    assert rows["links get 1MiB"]["baselines"]["raw tcp"]
    assert all(r["ours"] for r in rows.values())
    assert "relay" in rows["links peer_copy 64KiB all 200mbit"]["baselines"]
    assert not _our_namespaces()
