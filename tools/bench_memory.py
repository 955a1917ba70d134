"""``zmq-rpc-bench`` case ``memory``: what a worker holds while it serves SmolLM2, and after.

Each round starts a fresh ``zmq-rpc-worker`` (default settings) and reads its resident set
(``/proc/PID/status``, Linux): **idle**, once a first client has pinged it and left (the backend
up, no model); **serving**, the peak of samples every 10 ms while this process generates 32
tokens of SmolLM2 Q4_1 on it (after the load); **after**, 3 s after that client closed (the
backend trims its heap when idle, at most once a second). Against, in the same rounds:

- issue 29's bound while serving: the model's weights and KV cache on the worker
  (``LoadStats.resident_bytes`` + ``kv_bytes``) + 80 MiB; after: the idle size;
- the same worker on numba's kernels (``ZMQ_RPC_AOT_KERNELS=0``), where the kernels built ahead
  of time (``worker/kernels/aot.py``) load;
- with ``--llama-bin``, llama.cpp's ``rpc-server -t 1`` serving the same GGUF to
  ``llama-completion --rpc`` (32 tokens; its peak sampled the same way).

Runs on the bench's main thread and one sampling thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..client import Client
from .bench import BenchContext, CaseResult, Target, every, register_case
from .bench_families import _free_port, _stop, _wait_port, rpc_server
from .bench_serve import llama_folder

MIB = 1 << 20
OVER_TENSORS = 80 * MIB
"""Issue 29's bound: resident at most the weights + KV cache + 80 MiB while serving."""
TOKENS = 32
SAMPLE_S = 0.01
SETTLE_S = 3.0
PROMPT_IDS = [1, 504, 3458, 282, 4649, 314, 2114, 30]


def resident(pid: int) -> int:
    """``pid``'s resident set in bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@contextmanager
def peak_of(pid: int) -> Iterator[list[int]]:
    """Samples ``pid``'s resident set every SAMPLE_S while the block runs; the list's one item,
    once it ends, is the peak."""
    found = [resident(pid)]

    def sample() -> bool:
        try:
            found[0] = max(found[0], resident(pid))
        except (OSError, RuntimeError):     # the process is gone
            return False
        return True

    with every(SAMPLE_S, sample, "rss-sampler"):
        yield found
    found[0] = max(found[0], resident(pid))


def _ours(model: Path, env: dict[str, str]) -> dict[str, float]:
    from ..client.gguf_model import load_gguf
    from ..client.llama import LlamaModel
    port = _free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("zmq-rpc-worker")), "--bind",
                             f"tcp://127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_port(proc, port)
        endpoint = f"tcp://127.0.0.1:{port}"
        with Client(endpoint) as client:
            client.ping()
        idle = resident(proc.pid)
        with Client(endpoint) as client, LlamaModel.load(load_gguf(model), [client]) as m:
            with peak_of(proc.pid) as peak:
                m.generate(PROMPT_IDS, TOKENS, stop_ids=())
            stats = m.load_stats
            tensors = stats.resident_bytes + stats.kv_bytes if stats is not None else 0
        time.sleep(SETTLE_S)
        return {"idle": idle, "serving": peak[0], "after": resident(proc.pid), "tensors": tensors}
    finally:
        _stop(proc)


def _llama(folder: Path, model: Path) -> float:
    """rpc-server's peak while ``llama-completion --rpc`` generates TOKENS through it."""
    port = _free_port()
    server = subprocess.Popen([str(rpc_server(folder)), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(server, port)
        argv = [str(folder / "llama-completion"), "-m", str(model), "--rpc", f"127.0.0.1:{port}",
                "-ngl", "99", "-t", "1", "-tb", "1", "-c", "512", "-no-cnv", "--no-display-prompt",
                "-p", "Hello", "-n", str(TOKENS), "--temp", "0", "--ignore-eos"]
        with peak_of(server.pid) as peak:
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                           timeout=120)
        return float(peak[0])
    finally:
        _stop(server)


@register_case("memory", "a fresh worker's resident set serving SmolLM2 and after its client leaves "
               "(vs weights + KV cache + 80 MiB, numba's kernels, llama.cpp's rpc-server)", default=False)
def case_memory(ctx: BenchContext) -> list[CaseResult]:
    if not sys.platform.startswith("linux"):
        print("memory: reads /proc/PID/status: Linux only", flush=True)
        return []
    from ..client.gguf_model import default_model_path
    from ..worker.kernels import aot
    model = default_model_path()
    llama, why = llama_folder(ctx)
    have_llama = llama is not None and (llama / "llama-completion").is_file() and rpc_server(llama)
    if not have_llama:
        print(f"memory: no llama.cpp baseline ({why or 'no llama-completion or rpc-server'})", flush=True)
    ahead = aot.load() is not None
    runs: list[tuple[str, Any]] = [("ours", lambda: _ours(model, dict(os.environ)))]
    if ahead:
        runs.append(("numba", lambda: _ours(model, {**os.environ, aot.DISABLE_ENV: "0"})))
    if have_llama and llama is not None:
        runs.append(("llama", lambda: _llama(llama, model)))
    samples: dict[str, list[Any]] = {name: [] for name, _ in runs}
    for _ in range(ctx.reps(3, 1)):
        for name, run in runs:
            samples[name].append(run())
    return _rows(samples, ahead)


def _rows(samples: dict[str, list[Any]], ahead: bool) -> list[CaseResult]:
    ours = samples["ours"]
    serving = [r["serving"] / MIB for r in ours]
    baselines: dict[str, list[float]] = {"weights + KV + 80 MiB": [(r["tensors"] + OVER_TENSORS) / MIB for r in ours]}
    if "numba" in samples:
        baselines["numba's kernels"] = [r["serving"] / MIB for r in samples["numba"]]
    if "llama" in samples:
        baselines["rpc-server"] = [x / MIB for x in samples["llama"]]
    kernels = "kernels built ahead of time" if ahead else "numba's kernels (none built ahead of time)"
    after_baselines: dict[str, list[float]] = {"idle": [r["idle"] / MIB for r in ours]}
    if "numba" in samples:
        after_baselines["numba's kernels"] = [r["after"] / MIB for r in samples["numba"]]
    return [
        CaseResult("memory", "worker resident serving", "MiB", serving, baselines, Target(1.0, False), False,
                   compared_with=("weights + KV + 80 MiB",),
                   note=f"peak while generating {TOKENS} tokens of SmolLM2 Q4_1, 1 worker; {kernels}; "
                        f"weights + KV cache {ours[0]['tensors'] / MIB:.0f} MiB"),
        CaseResult("memory", "worker resident after the client leaves", "MiB", [r["after"] / MIB for r in ours],
                   after_baselines, Target(1.0, False), False, compared_with=("idle",),
                   note=f"{SETTLE_S:g} s after the client closed, against the same worker idle "
                        "(pinged once, no model)"),
    ]
