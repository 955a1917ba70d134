"""Tests of ``zmq-rpc-bench`` (:mod:`zmq_rpc.tools.bench`) and its raw baselines.

Figures on a shared 2-core machine are noise: these tests check that every case runs and reports
samples, that servers stop cleanly, and how results are summarized, never how fast anything is.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from zmq_rpc.tools import baselines as bl
from zmq_rpc.tools import bench, units
from zmq_rpc.worker.kernels import aot
from zmq_rpc.worker.launch import ServerProcess, local_workers

BENCH = str(Path(sys.executable).with_name("zmq-rpc-bench"))
"""The console script the install put beside this interpreter."""
ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The README and the pages it links: every ``zmq-rpc-bench CMD`` they show must exist."""


@pytest.mark.timeout(30)
def test_raw_protocol_dealer_pings_in_a_session(worker: Any) -> None:
    """The rtt and pipelined baselines' raw client opens a real session: its routing id set
    before connecting, its HELLO and every PING answered OK (it once set the id too late, so
    every PING it timed was a NO_SESSION error, a different path through the worker)."""
    with zmq.Context() as ctx:
        raw = bl.ProtocolDealer(ctx, worker.endpoint)
        try:
            raw.ping()
            raw.pipelined(300, 64)
            assert raw.sock.getsockopt(zmq.ROUTING_ID)[:1] == b"z"
        finally:
            raw.close()


@pytest.mark.timeout(180)
def test_quick_run_reports_every_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = bench.main(["--quick", "--json", str(out), "--cases", "rtt,pipelined,set,get",
                       "--sizes", "4KiB,256KiB"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["errors"] == []
    assert len(doc["meta"]["endpoints"]) == 2
    by_case: dict[str, list[dict[str, object]]] = {}
    for row in doc["results"]:
        by_case.setdefault(row["case"], []).append(row)
        assert row["ours"] and row["baselines"]
        assert all(samples for samples in row["baselines"].values())
    assert set(by_case) == {"rtt", "pipelined", "set", "get"}
    for case in ("set", "get"):
        baselines = {name for row in by_case[case] for name in row["baselines"]}  # type: ignore[attr-defined]
        assert {"zmq-chunked", "zmq-whole", "tcp"} <= baselines
    printed = capsys.readouterr().out
    assert "ours [min-max]" in printed
    for label in ("rtt", "pipelined", "set 4KiB", "get 256KiB"):
        assert f"\n{label} " in printed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["echo", "bulk-zmq", "bulk-tcp"])
def test_baseline_server_round_trip_and_clean_stop(kind: str) -> None:
    server = ServerProcess(bl.baseline_argv(kind))
    try:
        endpoint = server.wait_ready()
        _exercise(kind, endpoint)
    finally:
        code = server.stop()
    assert code == 0


@pytest.mark.timeout(60)
def test_a_server_that_dies_before_listening_is_reported_with_its_stderr_and_code() -> None:
    """A failed start says why: the server's exit code and what it wrote to stderr (which the
    launcher used to drop by closing its stderr file before reading it)."""
    server = ServerProcess([sys.executable, "-c",
                            "import sys; sys.stderr.write('boom: no model'); sys.exit(3)"])
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*boom: no model"):
        server.wait_ready()
    assert "boom" in server.stderr()


@pytest.mark.timeout(60)
def test_a_run_that_fails_shows_what_its_local_workers_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A failure with local workers prints their stderr (a lost connection is explained there,
    and it went to a temporary file that nobody read); a run that ends well prints nothing."""
    with local_workers(1, "--log-level", "INFO"):
        pass
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="the load failed"), \
            local_workers(1, "--log-level", "INFO") as endpoints:
        raise ValueError("the load failed")
    err = capsys.readouterr().err
    assert f"{endpoints[0]} said:" in err and "INFO zmq_rpc.worker: worker " in err, err


def _exercise(kind: str, endpoint: str) -> None:
    data = np.arange(300_000, dtype=np.uint32).view(np.uint8)
    if kind == "bulk-tcp":
        tcp = bl.TcpBulk(endpoint)
        try:
            tcp.set(data)
            assert np.array_equal(tcp.get(data.size), data)
        finally:
            tcp.close()
        return
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        if kind == "echo":
            sock = bl.dealer(ctx, endpoint)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            bl.echo_once(sock, b"hello")
            bl.echo_pipelined(sock, 2_000, 64, b"hello")
            sock.close(linger=0)
        else:
            _exercise_bulk_zmq(bl.ZmqBulk(ctx, endpoint), data)
    finally:
        ctx.term()


def _exercise_bulk_zmq(client: bl.ZmqBulk, data: np.ndarray) -> None:
    client.sock.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        for chunk in (65_536, data.size):
            client.set(data, chunk)
            assert np.array_equal(client.get(data.size, chunk), data)
    finally:
        client.close()


def _row(ours: Sequence[float], base: Sequence[float], higher: bool,
         target: bench.Target | None) -> bench.CaseResult:
    return bench.CaseResult("demo", "demo 1KiB", "GB/s", list(ours),
                            {"slow": [x / 2 for x in base], "fast": list(base)}, target,
                            higher_is_better=higher)


class _NoBar:
    def update(self, n: int) -> None:
        pass


def _recording(calls: list[str]) -> dict[str, bench.Runner]:
    def runner(name: str) -> bench.Runner:
        def run() -> float:
            calls.append(name)
            return 1.0
        return run
    return {name: runner(name) for name in "abc"}


@pytest.mark.parametrize("shuffle", [False, True])
def test_interleave_gives_each_runner_every_repetition(shuffle: bool) -> None:
    """In turn, or (``shuffle``) in a new seeded order each repetition, so that in the end
    every runner has run first, and after each of the others."""
    calls: list[str] = []
    samples = bench.interleave(_recording(calls), 60, _NoBar(), warmup=2, shuffle=shuffle)  # type: ignore[arg-type]
    assert {name: len(got) for name, got in samples.items()} == {"a": 60, "b": 60, "c": 60}
    assert calls[:6] == list("abcabc")                          # the warm-up, in turn
    rounds = [calls[i:i + 3] for i in range(6, len(calls), 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    if not shuffle:
        assert all(r == ["a", "b", "c"] for r in rounds)
        return
    assert {r[0] for r in rounds} == {"a", "b", "c"}
    pairs = {(x, y) for r in rounds for x, y in zip(r, r[1:])}
    assert pairs == {(x, y) for x in "abc" for y in "abc" if x != y}
    again: list[str] = []
    bench.interleave(_recording(again), 60, _NoBar(), warmup=2, shuffle=True)  # type: ignore[arg-type]
    assert again == calls                                      # seeded: the same run twice


def test_results_compare_with_the_best_baseline() -> None:
    row = _row([1.0, 2.0, 3.0], [2.0, 2.0, 5.0], True, bench.Target(0.9, higher_is_better=True))
    assert row.best_baseline() == "fast"
    assert row.ratio() == pytest.approx(1.0)
    assert row.passed() is True
    latency = _row([3.0], [2.0], False, bench.Target(1.2, higher_is_better=False))
    assert latency.best_baseline() == "slow"
    assert latency.passed() is False
    assert _row([1.0], [1.0], True, None).passed() is None


def test_a_row_compared_with_named_baselines_ignores_the_others_for_its_ratio() -> None:
    """Transfer rows' targets compare with raw pyzmq (issue 25.7); raw TCP, faster, is reported
    beside it and does not set the ratio."""
    row = _row([0.95], [1.0], True, bench.Target(0.9, higher_is_better=True))
    row.baselines["tcp"] = [3.0]
    assert row.best_baseline() == "tcp" and row.passed() is False
    row.compared_with = ("slow", "fast")
    assert row.best_baseline() == "fast"
    assert row.ratio() == pytest.approx(0.95) and row.passed() is True
    assert bench.PYZMQ_BULK == ("zmq-chunked", "zmq-whole")


def test_table_shows_figures_ratio_and_mark() -> None:
    rows = [_row([1.0, 2.0, 3.0], [2.0, 2.0, 5.0], True, bench.Target(0.9, True)),
            _row([300.0], [100.0], False, bench.Target(1.5, False))]
    text = bench.format_table(rows)
    lines = text.splitlines()
    assert lines[0].startswith("case") and set(lines[1]) == {"-"}
    assert "2.00 [1.00-3.00]" in lines[2] and "PASS" in lines[2] and "slow 1.00" in lines[2]
    assert "FAIL" in lines[3] and "6.00x" in lines[3]


def test_llm_rows_hold_the_issue_budgets() -> None:
    """The LLM case states its absolute targets as rows: overhead <=1 ms, upload >=2 GB/s."""
    from zmq_rpc.tools import bench_llm

    def placement(name: str, overhead: list[float], upload: list[float]) -> Any:
        return bench_llm.Placement(name=name, prefill32=[100.0], prefill128=[100.0],
                                   generate=[20.0], token_seconds=[0.05], overhead=overhead,
                                   upload_gbps=upload, load_seconds=[0.5], upload_bytes=96_000_000,
                                   raw_upload_gbps=[2.5])

    base = placement("in-process", [], [])
    for overhead, upload, ok in (([0.8, 0.9, 1.3], [2.1, 2.2], True),
                                 ([1.1, 1.2, 0.4], [1.9, 1.8], False)):
        rows = {r.label: r for r in bench_llm.rows(base, [placement("2 workers", overhead, upload)])}
        assert rows["llm overhead/token vs budget"].ratio() == pytest.approx(sorted(overhead)[1])
        assert rows["llm overhead/token vs budget"].passed() is ok
        assert rows["llm upload vs budget"].passed() is ok


@pytest.mark.timeout(60)
def test_first_byte_times_a_program_and_stops_it_with_sigint(tmp_path: Path) -> None:
    """What the ``generate first output`` row measures: exec to the first byte, then Ctrl-C."""
    import sys

    from zmq_rpc.tools import bench_llm

    marker = tmp_path / "stopped"
    # the handler is installed explicitly, as generate does: a child inherits an ignored SIGINT
    script = ("import signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "try:\n    sys.stderr.write('x'); sys.stderr.flush()\n"
              f"    time.sleep(60)\nexcept KeyboardInterrupt:\n    open({str(marker)!r}, 'w')")
    # (the sleeps in these scripts are programs that run on until stopped: the subject)
    seconds = bench_llm.first_byte([sys.executable, "-c", script])
    assert 0 < seconds < 60 and marker.exists()
    with pytest.raises(RuntimeError, match="wrote nothing"):
        bench_llm.first_byte([sys.executable, "-c", "pass"])
    with pytest.raises(RuntimeError, match="wrote nothing"):      # its stderr is not counted
        bench_llm.first_byte([sys.executable, "-c", "import sys; sys.stderr.write('x')"],
                             stdout_only=True)
    assert bench_llm.first_byte([sys.executable, "-c", "print('x')"], stdout_only=True) > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ignored", ["SIGINT", "SIGINT, signal.SIGTERM"])
def test_first_byte_stops_a_program_that_ignores_sigint(monkeypatch: pytest.MonkeyPatch,
                                                        ignored: str) -> None:
    """SIGINT, SIGTERM after the grace, SIGKILL after another: the measurement is returned
    (a program that outlived SIGTERM's grace, or a loaded machine's late wake-up, raised
    ``TimeoutExpired`` from the second wait: CI run 1 of 37f52a6)."""
    import sys

    from zmq_rpc.tools import bench_llm

    monkeypatch.setattr(bench_llm, "STOP_GRACE_S", 1.0)
    script = ("import signal, sys, time\n"
              f"for s in (signal.{ignored}, ):\n    signal.signal(s, signal.SIG_IGN)\n"
              "sys.stderr.write('x'); sys.stderr.flush(); time.sleep(60)")
    started = time.monotonic()
    assert bench_llm.first_byte([sys.executable, "-c", script]) > 0
    assert time.monotonic() - started < 10          # SIGTERM/SIGKILL after the grace, not 60 s


def test_cases_and_commands_can_be_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every case module first: one imported for the first time under the copies below would
    # register into them, and its cases would be gone for the rest of the process.
    bench.load_case_modules()
    monkeypatch.setattr(bench, "CASES", dict(bench.CASES))
    monkeypatch.setattr(bench, "COMMANDS", dict(bench.COMMANDS))

    @bench.register_case("demo", default=False)
    def demo(ctx: bench.BenchContext) -> list[bench.CaseResult]:
        """A demo case."""
        return []

    assert bench.CASES["demo"].help == "A demo case."
    with pytest.raises(ValueError):
        bench.register_case("demo")(demo)
    calls: list[Sequence[str]] = []

    def generate(argv: Sequence[str]) -> int:
        calls.append(argv)
        return 7

    bench.register_command("demo-command", generate)
    assert bench.main(["demo-command", "--prompt", "hi"]) == 7
    assert calls == [["--prompt", "hi"]]
    assert "generate" in bench.COMMANDS           # the LLM command is registered on load


def test_unknown_case_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bench.main(["--cases", "rtt,nope"])
    assert stop.value.code == 2
    assert "unknown case" in capsys.readouterr().err


def test_format_size() -> None:
    assert [units.format_size(n) for n in (4096, 1 << 20, 256 << 20, 1000)] == \
        ["4KiB", "1MiB", "256MiB", "1000B"]


def run_cases(tmp_path: Path, capsys: pytest.CaptureFixture[str],
              *args: str) -> tuple[dict[str, Any], str]:
    """``zmq-rpc-bench --quick ... ARGS --llama-bin TMP`` (a folder without llama.cpp) end to end:
    its rows by label, and what it printed; it must exit 0 with no case error."""
    out = tmp_path / "bench.json"
    code = bench.main(["--quick", "--no-progress", "--json", str(out), *args, "--llama-bin", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads(out.read_text())
    assert doc["meta"]["errors"] == []
    return {r["label"]: r for r in doc["results"]}, printed


def _help(*args: str) -> str:
    out = subprocess.run([BENCH, *args, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.timeout(120)
def test_help_names_only_commands_that_exist_and_so_do_the_docs() -> None:
    text = _help()
    assert "``" not in text and ":class:" not in text
    bench.load_case_modules()
    in_help = set(re.findall(r"zmq-rpc-bench ([a-z][\w-]*)", text))
    in_docs = {name for page in DOCS
               for name in re.findall(r"^zmq-rpc-bench ([a-z][\w-]*)", page.read_text(), re.M)}
    assert in_help == set(bench.COMMANDS), in_help       # the usage shows every command
    assert in_docs <= set(bench.COMMANDS), in_docs       # no "run" that neither usage nor docs show
    for command in in_help:
        assert f"usage: zmq-rpc-bench {command}" in _help(command)


@pytest.mark.timeout(120)
def test_generate_help_shows_its_defaults() -> None:
    text = " ".join(_help("generate").split())
    assert "``" not in text
    assert "tokens to generate at most (default 64)" in text
    assert "(default 60.0)" in text.split("--timeout TIMEOUT")[-1]


@pytest.mark.timeout(120)
def test_generate_gives_up_connecting_after_its_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:    # accepts, never speaks zmq
        port = silent.getsockname()[1]
        proc = subprocess.Popen([BENCH, "generate", "--prompt", "hi", "--timeout", "1",
                                 "--workers", f"tcp://127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        lines = [proc.stderr.readline()]
        while "connecting to" not in lines[-1] and lines[-1]:
            lines.append(proc.stderr.readline())
        start = time.monotonic()           # from the status line on: the connection wait alone
        rest = proc.stderr.read()
        code = proc.wait(60)
        waited = time.monotonic() - start
        proc.stderr.close()
    assert code == 1
    assert f"cannot reach a zmq-rpc worker at tcp://127.0.0.1:{port}" in rest
    assert waited < 6, f"{waited:.1f} s: the connection wait ignored --timeout 1 (was 10 s)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [[], ["generate", "--prompt", "hi"]])
def test_workers_without_a_scheme_are_refused_with_the_fix(command: list[str]) -> None:
    out = subprocess.run([BENCH, *command, "--workers", "tcp://127.0.0.1:50052,127.0.0.1:50053"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'127.0.0.1:50053' has no scheme: write tcp://127.0.0.1:50053" in out.stderr
    assert "Traceback" not in out.stderr


LLAMA_BENCH_JSON = """[
  {"build_commit": "x", "model_type": "qwen3 ?B Q4_K - Medium", "n_threads": 1,
   "n_prompt": 32, "n_gen": 0, "avg_ts": 41.5, "stddev_ts": 0.0, "samples_ts": [41.5]},
  {"build_commit": "x", "model_type": "qwen3 ?B Q4_K - Medium", "n_threads": 1,
   "n_prompt": 0, "n_gen": 16, "avg_ts": 9.25, "stddev_ts": 0.0, "samples_ts": [9.25]}
]"""
"""``llama-bench -o json``'s output, trimmed to the fields read (a prefill test, then decode)."""


def test_llama_bench_json_gives_decode_and_prefill_rates() -> None:
    from zmq_rpc.tools.bench_families import parse_llama_bench
    assert parse_llama_bench(LLAMA_BENCH_JSON) == (9.25, 41.5)


@pytest.mark.timeout(300)
def test_llm_families_case_rows_without_llama_cpp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The llm-families case end to end (--quick) on the toy qwen3 in place of the benchmark's
    model: decode, prefill and resident rows on 1 and 2 workers, the head row on 1; a
    --llama-bin without llama.cpp's binaries is said so, and the rows carry no baseline."""
    from zmq_rpc.tools import synthetic_gguf as sg
    monkeypatch.setenv("ZMQ_RPC_BENCH_CACHE", str(tmp_path))
    for var in ("ZMQ_RPC_LLAMA_BIN", "ZMQ_RPC_LLAMA_PYTHON"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sg, "REALISTIC", {"qwen3": sg.FAMILIES["qwen3"]})
    rows, printed = run_cases(tmp_path, capsys, "--cases", "llm-families", "--families", "qwen3")
    assert list(rows) == [f"families {what} qwen3 {n}" for n in ("1 worker", "2 workers")
                          for what in ("decode", "prefill", "resident bytes")][:3] + [
        "families head qwen3"] + [f"families {what} qwen3 2 workers"
                                  for what in ("decode", "prefill", "resident bytes")]
    for label, row in rows.items():
        assert row["ours"] and all(v > 0 for v in row["ours"]), label
    assert set(rows["families decode qwen3 1 worker"]["baselines"]) == {"no llama.cpp"}
    file_mb = (tmp_path / "bench-qwen3-v1.gguf").stat().st_size / 1e6
    assert rows["families resident bytes qwen3 2 workers"]["baselines"]["file"] == [file_mb]
    assert "lacks ['llama-bench', 'rpc-server']" in printed


@pytest.mark.timeout(300)
def test_serve_case_rows_on_a_toy_model_without_llama_server(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The serve case end to end (--quick) on the toy qwen3: a real zmq-rpc-serve and its
    --serial twin on one local worker, one streaming client; a --llama-bin without llama.cpp's
    binaries is said so and the rows carry no llama-server baseline."""
    from synthetic_models import synthetic_path
    pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    rows, printed = run_cases(tmp_path, capsys, "--cases", "serve", "--model", str(synthetic_path("qwen3")),
                              "--streams", "1", "--serve-workers", "1", "--max-tokens", "4")
    where = "1 worker 1 stream"
    assert list(rows) == [f"serve tok/s {where}", f"serve tok/s {where} vs serial",
                          *(f"serve {what} p{q} {where}" for what in ("TTFT", "ITL")
                            for q in (50, 99)),
                          f"serve worker 0 compute share {where}"]
    for label, row in rows.items():
        assert row["ours"] and all(v > 0 for v in row["ours"]), label
    assert set(rows[f"serve tok/s {where}"]["baselines"]) == {"no llama-server", "ours --serial"}
    assert rows[f"serve tok/s {where} vs serial"]["baselines"]["ours --serial"][0] > 0
    assert rows[f"serve tok/s {where}"]["note"].startswith("no llama-server:")
    assert "lacks ['llama-server', 'rpc-server']" in printed
    assert printed.count("tokens/request 4.0") == 2       # ours and --serial: max_tokens each


def test_startup_case_times_real_worker_processes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The startup case end to end (--quick): fresh ``zmq-rpc-worker`` processes timed to a TCP
    connect and to a client's first ping; a bare listening interpreter as the floor; generate's
    first token on fresh workers; a --llama-bin without llama.cpp's binaries is said so (no
    rpc-server or llama-completion baseline)."""
    rows, printed = run_cases(tmp_path, capsys, "--cases", "startup")
    assert list(rows) == ["worker listens", "worker listens vs budget", "worker answers a client",
                          "kernels loaded, fresh process", "main job ready 1 worker", "main job ready 2 workers"]
    listens, answers = rows["worker listens"], rows["worker answers a client"]
    loaded = rows["kernels loaded, fresh process"]
    if aot.load() is not None:          # against numba's own cached load, in the same rounds
        assert set(loaded["baselines"]) == {"100 ms budget", "numba's cache"}
        assert "built ahead of time" in loaded["note"]
    else:
        assert set(loaded["baselines"]) == {"100 ms budget"}
    assert min(loaded["ours"]) > 0
    for n in ("1 worker", "2 workers"):        # generate's first token from fresh workers
        ready = rows[f"main job ready {n}"]
        assert set(ready["baselines"]) == {"a worker answers"}
        assert "no llama-completion" in ready["note"]
        assert min(ready["ours"]) > min(answers["ours"])
    assert set(listens["baselines"]) == {"python -c"}
    assert all(v > 0 for v in listens["ours"] + listens["baselines"]["python -c"])
    assert min(answers["ours"]) > 0
    assert "no rpc-server baseline" in printed
    assert re.search(r"bytecode cached: (yes|no)$", listens["note"]), listens["note"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")
@pytest.mark.timeout(300)
def test_memory_case_reads_a_real_workers_resident_set(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The memory case end to end (--quick): a fresh worker idle, serving SmolLM2 (its peak above
    the model's weights and KV cache) and after its client left (below the peak), against those + 80 MiB
    and the idle size; numba's kernels beside where the kernels built ahead of time load."""
    pytest.importorskip("numba")
    rows, printed = run_cases(tmp_path, capsys, "--cases", "memory")
    serving, after = rows["worker resident serving"], rows["worker resident after the client leaves"]
    bound = serving["baselines"]["weights + KV + 80 MiB"][0]
    assert bound - 80 < serving["ours"][0] and after["ours"][0] < serving["ours"][0]
    assert 0 < after["baselines"]["idle"][0] < serving["ours"][0]
    assert ("numba's kernels" in serving["baselines"]) == (aot.load() is not None)
    assert "no llama.cpp baseline" in printed


def test_bytecode_cached_means_caches_newer_than_their_sources(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import py_compile

    from zmq_rpc.tools.bench_startup import bytecode_cached
    source = tmp_path / "startup_probe_module.py"
    source.write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not bytecode_cached(("startup_probe_module",))          # never compiled
    py_compile.compile(str(source))
    assert bytecode_cached(("startup_probe_module",))
    later = os.path.getmtime(source) + 10
    os.utime(source, (later, later))                                  # edited since
    assert not bytecode_cached(("startup_probe_module",))
    assert not bytecode_cached(("no_such_module_anywhere",))
