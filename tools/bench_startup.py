"""``zmq-rpc-bench`` case ``startup``: how soon a fresh worker process listens and answers.

Each trial starts a process and polls its port from this one (a TCP connect every millisecond):

- **listens**: from exec to the first connect that succeeds, for ``zmq-rpc-worker`` and, with
  ``--llama-bin``, llama.cpp's ``rpc-server -t 1`` (the worker it replaces), alternated trial by
  trial; against the 100 ms budget too;
- **answers**: from exec to a :class:`~zmq_rpc.client.Client` connected (its HELLO answered) and
  its first ping back: the worker's backend loaded (numpy, the executor), what a client waits for;
- **kernels loaded**: in a fresh process with numpy imported, ``kernels.preload()`` (what
  ``--preload-kernels`` runs): the kernels built ahead of time where they are, against numba's
  cached load (``ZMQ_RPC_AOT_KERNELS=0``) in the same rounds, and the 100 ms budget (issue 29);
- **main job ready**: from exec to the first generated token on stdout, on 1 and 2 fresh workers
  (warm page cache): ``zmq-rpc-bench generate --no-chat --max-new-tokens 1`` with its local workers
  against, with ``--llama-bin``, llama.cpp's ``llama-completion --rpc`` through as many fresh
  ``rpc-server -t 1`` (started at the same instant, waited for until they accept), same GGUF and
  prompt, against 1.5x its time (issue 29).

Runs on the bench's main thread; every process it starts is stopped before the trial ends.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..client import Client
from .bench import BenchContext, CaseResult, Target, register_case
from .bench_families import _free_port, _stop, rpc_server, rpc_servers
from .bench_llm import first_byte
from .bench_serve import llama_folder

LISTEN_BUDGET_S = 0.1
"""Issue 29's bound: a worker listening within 100 ms of its start."""
READY_VS_LLAMA = 1.5
"""Issue 29's bound: the main job ready within 1.5x llama.cpp's time."""
READY_PROMPT = "Hello"
POLL_S = 0.001
START_LIMIT_S = 30.0
"""A process that does not listen (or answer) this long after exec failed to start."""


def _worker(port: int) -> list[str]:
    return [str(Path(sys.executable).with_name("zmq-rpc-worker")),
            "--bind", f"tcp://127.0.0.1:{port}"]


def _listens(argv: list[str], port: int) -> float:
    """Seconds from exec until ``port`` accepts a TCP connection."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return time.perf_counter() - start
            except OSError:
                _check_alive(proc, start, argv)
                time.sleep(POLL_S)
    finally:
        _stop(proc)


def _answers(port: int) -> float:
    """Seconds from a worker's exec to a client's first ping answered."""
    start = time.perf_counter()
    argv = _worker(port)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                _check_alive(proc, start, argv)
                time.sleep(POLL_S)
        with Client(f"tcp://127.0.0.1:{port}") as client:
            client.ping()
        return time.perf_counter() - start
    finally:
        _stop(proc)


_KERNEL_LOAD = ("import time, numpy; start = time.perf_counter(); from zmq_rpc.worker import kernels; "
                "kernels.preload(); print(time.perf_counter() - start, kernels.ahead())")


def _kernels_load(env: dict[str, str]) -> tuple[float, bool]:
    """Seconds a fresh process takes to import the kernels and load them (numpy already in), and
    whether they were the ones built ahead of time."""
    out = subprocess.run([sys.executable, "-c", _KERNEL_LOAD], env=env, capture_output=True, text=True,
                         check=True, timeout=START_LIMIT_S)
    seconds, ahead = out.stdout.split()
    return float(seconds), ahead == "True"


def kernel_rows(ctx: BenchContext) -> list[CaseResult]:
    """Kernels loaded in a fresh process: built ahead of time vs numba's cache, and the budget."""
    from ..worker.kernels import aot
    ahead = _kernels_load(dict(os.environ))[1]
    runs: dict[str, Callable[[], float]] = {"ours": lambda: _kernels_load(dict(os.environ))[0]}
    if ahead:
        runs["numba's cache"] = lambda: _kernels_load({**os.environ, aot.DISABLE_ENV: "0"})[0]
    s = _alternate(ctx.reps(7, 2), runs)
    which = "the kernels built ahead of time" if ahead else "numba's cache (no kernels built ahead of time)"
    return [CaseResult("startup", "kernels loaded, fresh process", "s", s["ours"],
                       {"100 ms budget": [LISTEN_BUDGET_S], **{k: v for k, v in s.items() if k != "ours"}},
                       Target(1.0, False), False, compared_with=("100 ms budget",),
                       note=f"import + kernels.preload() after numpy: {which}; issue 29: <= 0.1 s")]


def _check_alive(proc: subprocess.Popen[Any], start: float, argv: list[str]) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"{argv[0]} exited with {proc.returncode} before it listened")
    if time.perf_counter() - start > START_LIMIT_S:
        raise RuntimeError(f"{argv[0]} did not listen within {START_LIMIT_S:g} s")


def _alternate(trials: int, runs: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """``trials`` rounds, each running every measurement once, in turn."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(trials):
        for name, run in runs.items():
            samples[name].append(run())
    return samples


def bytecode_cached(modules: tuple[str, ...] = ("zmq_rpc.worker.cli", "zmq_rpc.worker.server",
                                                 "zmq_rpc.broker.protocol",
                                                 "zmq_rpc.worker.dispatch.executor")) -> bool:
    """Whether those modules have bytecode caches newer than their source. A pip install writes
    them; without (``PYTHONDONTWRITEBYTECODE=1``, or sources edited since) every process compiles
    them as it starts, which on a 2-core VM added ~20 ms to a worker's listening and ~0.1 s to its
    first answer: the start-up rows say which they measured."""
    for name in modules:
        spec = importlib.util.find_spec(name)
        source = spec.origin if spec is not None else None
        if source is None:
            return False
        cached = importlib.util.cache_from_source(source)
        if not os.path.exists(cached) or os.path.getmtime(cached) < os.path.getmtime(source):
            return False
    return True


@register_case("startup", "a fresh worker process: exec to listening (vs llama.cpp's rpc-server, "
               "--llama-bin) and to its first ping answered", default=False)
def case_startup(ctx: BenchContext) -> list[CaseResult]:
    llama, why = llama_folder(ctx)
    rpc = rpc_server(llama) if llama is not None else None
    runs: dict[str, Callable[[], float]] = {
        "ours": lambda: _listens(_worker(port := _free_port()), port),
        "python -c": lambda: _listens([sys.executable, "-c", _BARE_LISTENER.format(
            port := _free_port())], port),
        "answers": lambda: _answers(_free_port()),
    }
    if rpc is not None:
        runs["rpc-server"] = lambda: _listens(
            [str(rpc), "-H", "127.0.0.1", "-p", str(port := _free_port()), "-t", "1"], port)
    else:
        print(f"startup: no rpc-server baseline ({why})", flush=True)
    s = _alternate(ctx.reps(9, 2), runs)
    listen_baselines: dict[str, list[float]] = {k: s[k] for k in ("rpc-server", "python -c")
                                                if k in s}
    note = ("exec to a TCP connect accepted (polled every ms from the bench); our modules' "
            f"bytecode cached: {'yes' if bytecode_cached() else 'no'}")
    return [
        CaseResult("startup", "worker listens", "s", s["ours"], listen_baselines, None, False,
                   note=note, compared_with=("rpc-server",) if rpc is not None else ()),
        CaseResult("startup", "worker listens vs budget", "s", s["ours"],
                   {"100 ms budget": [LISTEN_BUDGET_S]}, Target(1.0, False), False,
                   note="issue 29: listening within 100 ms of exec"),
        CaseResult("startup", "worker answers a client", "s", s["answers"], listen_baselines, None,
                   False, note="exec to a Client's HELLO and first ping answered (backend loaded)",
                   compared_with=("rpc-server",) if rpc is not None else ()),
        *kernel_rows(ctx),
        *ready_rows(ctx, llama, s["answers"]),
    ]


def _ours_ready(model: Path, workers: int) -> float:
    cli = str(Path(sys.executable).with_name("zmq-rpc-bench"))
    return first_byte([cli, "generate", "--model", str(model), "--no-chat", "--prompt",
                       READY_PROMPT, "--max-new-tokens", "1", "--local-workers", str(workers)],
                      stdout_only=True)


def _llama_ready(folder: Path, model: Path, workers: int) -> float:
    """rpc-servers started, waited for, then ``llama-completion`` through them: from the first
    exec to its first generated byte."""
    start = time.perf_counter()
    with rpc_servers(folder, workers) as addresses:
        argv = [str(folder / "llama-completion"), "-m", str(model), "--rpc", ",".join(addresses),
                "-ngl", "99", "-t", "1", "-tb", "1", "-c", "512", "-no-cnv", "--no-display-prompt",
                "--no-warmup", "-p", READY_PROMPT, "-n", "1", "--temp", "0"]
        return time.perf_counter() - start + first_byte(argv, stdout_only=True)


def ready_rows(ctx: BenchContext, llama: Path | None, answers: list[float]) -> list[CaseResult]:
    """The main job ready on 1 and 2 fresh workers, against llama.cpp's in the same rounds (and
    beside a fresh worker's first answer: what the model's load and first token add to it)."""
    from ..client.gguf_model import default_model_path
    model = default_model_path()
    have = llama is not None and (llama / "llama-completion").is_file() and rpc_server(llama)
    out = []
    for n in (1, 2):
        runs: dict[str, Callable[[], float]] = {"ours": partial(_ours_ready, model, n)}
        if have and llama is not None:
            runs["llama.cpp"] = partial(_llama_ready, llama, model, n)
        s = _alternate(ctx.reps(5, 1), runs)
        label = f"main job ready {n} worker{'s' if n > 1 else ''}"
        if "llama.cpp" in s:
            out.append(CaseResult("startup", label, "s", s["ours"],
                                  {"llama.cpp 1.5x": [x * READY_VS_LLAMA for x in s["llama.cpp"]],
                                   "llama.cpp": s["llama.cpp"], "a worker answers": answers},
                                  Target(1.0, False), False, compared_with=("llama.cpp 1.5x",),
                                  note="exec to the first generated token, fresh workers; "
                                       "target <=1.5x llama.cpp's"))
        else:
            out.append(CaseResult("startup", label, "s", s["ours"], {"a worker answers": answers},
                                  None, False,
                                  note="exec to the first generated token, fresh workers "
                                       "(no llama-completion in --llama-bin: no baseline)"))
    return out


_BARE_LISTENER = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', {})); s.listen(); "
                  "import time; time.sleep(30)")
"""A bare interpreter that listens: the floor for any Python worker."""
