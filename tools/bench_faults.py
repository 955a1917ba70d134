"""``zmq-rpc-bench`` fault cases: how long a client with DEFAULT settings takes to report a worker
that died, froze or was restarted, each row against the bound docs/FAILURES.md states.

What runs where: this process's main thread times each trial; worker subprocesses (started per
trial, so that each can be killed) run on random loopback ports; every trial's clients are closed
and its workers stopped or killed before the next begins.

Cases:
- ``faults`` (default): SIGKILL to ConnectionLost of a request in flight; SIGKILL of a copy's
  destination, and of its source, to the copy's failure; a worker restarted at the same address
  to SessionLost on the old client.
- ``freeze`` (not default: about 6 s a trial): SIGSTOP to ConnectionLost of a request in flight.
- ``recovery`` (not default: a SmolLM2 load a trial): kill -9 of one of 3 workers at a random
  token of a 64-token greedy generation; the model's recovery (client/llama/recovery.py) split
  into detection (from the kill), load of the moved layers and re-prefill, with the model in
  the workers' ``--model-dir`` and uploaded; every output checked against the fault-free one.
- ``chaos`` (not default: ~21 SmolLM2 loads): the recovery trial 21 times, each with one fault
  of :data:`FAULTS` (kill -9, SIGSTOP, kill -9 and a restart at the same address) of a random
  worker at a random token, then the same fault in a ``zmq-rpc-serve`` run of 4 greedy streams
  at a random streamed chunk; every output checked, detection and total recovery against the
  bounds (a frozen worker's: + the grace it has to come back), and for the server the longest
  any stream waited for its next chunk and the server's own recovery time.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TypeVar

import numpy as np

from ..client import Client, ConnectionLost, SessionLost
from ..client.llama.recovery import RETURN_GRACE_S
from ..worker.launch import ServerProcess, worker_argv
from .bench import BenchContext, CaseResult, Target, register_case

DETECT_BOUND_S = 6.0
"""The heartbeat timeout (5 s) + 1 s: docs/FAILURES.md's bound for a dead, frozen or unreachable
worker."""
COPY_BOUND_S = 3.0
"""A copy whose other side dies fails within this."""
RESTART_BOUND_S = 1.0
"""A restarted worker's NO_SESSION reaches the old client within this once it listens (zmq
reconnects every 0.1 s)."""
MiB = 1 << 20
T = TypeVar("T")


def _worker(stack: ExitStack, bind: str = "tcp://127.0.0.1:*") -> ServerProcess:
    server = ServerProcess(worker_argv(bind=bind))
    stack.callback(_reap, server)
    server.wait_ready()
    return server


def _reap(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
    server.stop(timeout=5)


def _client(stack: ExitStack, endpoint: str) -> Client:
    client = Client(endpoint)
    stack.callback(client.close)
    return client


def _failed_after(future: object, since: float, limit: float = 60.0) -> float:
    """Seconds from ``since`` until ``future`` failed (it must fail, and within ``limit``)."""
    error = future.exception(timeout=limit)  # type: ignore[attr-defined]
    if error is None:
        raise RuntimeError("the request succeeded although its worker was gone")
    return time.monotonic() - since


def trial_kill() -> float:
    """A 64 MiB upload in flight; SIGKILL; seconds until it fails with ConnectionLost."""
    with ExitStack() as stack:
        server = _worker(stack)
        client = _client(stack, server.endpoint)
        t = client.alloc_buffer(64 * MiB).tensor(16 * MiB)
        upload = client.set_tensor_async(t, np.ones(16 * MiB, np.float32))
        time.sleep(0.01)
        killed = time.monotonic()
        server.proc.kill()
        seconds = _failed_after(upload, killed)
        if not isinstance(upload.exception(), ConnectionLost):
            raise RuntimeError(f"expected ConnectionLost, got {upload.exception()!r}")
        return seconds


def trial_copy(kill: str) -> float:
    """A 256 MiB worker-to-worker copy; SIGKILL its ``kill`` side ("src" or "dst"); seconds
    until the copy fails."""
    with ExitStack() as stack:
        servers = {"src": _worker(stack), "dst": _worker(stack)}
        a, b = (_client(stack, servers[k].endpoint) for k in ("src", "dst"))
        src, dst = a.alloc_buffer(256 * MiB).tensor(64 * MiB), b.alloc_buffer(256 * MiB).tensor(
            64 * MiB)
        a.copy_tensor(src[:16], dst[:16])
        copy = a.copy_tensor_async(src, dst)
        time.sleep(0.02)
        killed = time.monotonic()
        servers[kill].proc.kill()
        return _failed_after(copy, killed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trial_restart() -> float:
    """SIGKILL, restart at the same address; seconds from the new worker's readiness until the
    old client's request fails with SessionLost (never answered with fresh memory)."""
    bind = f"tcp://127.0.0.1:{_free_port()}"
    with ExitStack() as stack:
        first = _worker(stack, bind)
        client = _client(stack, first.endpoint)
        t = client.alloc_buffer(1024).tensor(256)
        first.proc.kill()
        first.proc.wait()
        _worker(stack, bind)
        ready = time.monotonic()
        while True:
            try:
                client.get_tensor(t)
            except SessionLost:
                return time.monotonic() - ready
            except ConnectionLost:
                if time.monotonic() - ready > 30:
                    raise
                time.sleep(0.005)
            else:
                raise RuntimeError("the restarted worker answered the old session")


def trial_freeze() -> float:
    """SIGSTOP a worker under a request; seconds until the request fails with ConnectionLost."""
    with ExitStack() as stack:
        server = _worker(stack)
        client = _client(stack, server.endpoint)
        client.ping()
        os.kill(server.proc.pid, signal.SIGSTOP)
        stack.callback(os.kill, server.proc.pid, signal.SIGCONT)
        frozen = time.monotonic()
        return _failed_after(client.ping_async(), frozen)


def _rows(case: str, label: str, samples: list[float], bound: float) -> list[CaseResult]:
    budget = {f"{bound:g} s bound": [bound]}
    return [CaseResult(case, f"{label} (median)", "s", samples, budget,
                       Target(1.0, higher_is_better=False), higher_is_better=False),
            CaseResult(case, f"{label} (max)", "s", samples, budget,
                       Target(1.0, higher_is_better=False), higher_is_better=False, stat="max")]


def _trials(ctx: BenchContext, name: str, trial: Callable[[], T], full: int = 10,
            quick: int = 3) -> list[T]:
    """``trial()``'s results, 10 times (3 with ``--quick``), with a progress bar."""
    reps = ctx.reps(full, quick)
    samples = []
    with ctx.progress(reps, name) as bar:
        for _ in range(reps):
            samples.append(trial())
            bar.update(1)
    return samples


@register_case("faults", "SIGKILL (in flight, copy source, copy destination) and restart at the "
               "same address to the client's error, default client settings, vs the bounds")
def case_faults(ctx: BenchContext) -> list[CaseResult]:
    rows = _rows("faults", "SIGKILL -> ConnectionLost", _trials(ctx, "kill", trial_kill),
                 DETECT_BOUND_S)
    rows += _rows("faults", "copy dst SIGKILL -> failed",
                  _trials(ctx, "copy dst", lambda: trial_copy("dst")), COPY_BOUND_S)
    rows += _rows("faults", "copy src SIGKILL -> failed",
                  _trials(ctx, "copy src", lambda: trial_copy("src")), COPY_BOUND_S)
    rows += _rows("faults", "restart -> SessionLost", _trials(ctx, "restart", trial_restart),
                  RESTART_BOUND_S)
    return rows


@register_case("freeze", "SIGSTOP to ConnectionLost of a request in flight, default client "
               "settings, vs the 6 s bound (about 6 s a trial)", default=False)
def case_freeze(ctx: BenchContext) -> list[CaseResult]:
    return _rows("freeze", "SIGSTOP -> ConnectionLost", _trials(ctx, "freeze", trial_freeze),
                 DETECT_BOUND_S)



RECOVERY_TOKENS = 64
RECOVERY_PROMPT = "The three laws of thermodynamics are"


def trial_recovery(from_file: bool, rng: random.Random, fault: str = "kill") -> list[float]:
    """SmolLM2 on 3 fresh local workers (with the model in their ``--model-dir`` when
    ``from_file``, else uploaded): a 64-token greedy generation, and again with one worker,
    picked at random, hit by ``fault`` (:data:`FAULTS`) at a random token. The outputs must
    match. Seconds of [detection (from the fault), load of the moved layers, re-prefill,
    total]."""
    from ..client.gguf_model import default_model_path, load_gguf
    from ..client.llama import LlamaModel
    from ..client.tokenizer import load_tokenizer

    path = default_model_path()
    gguf = load_gguf(path)
    args = ["--model-dir", str(path.parent)] if from_file else []
    with ExitStack() as stack:
        binds = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(3)]
        servers = [_worker_with(stack, args, bind) for bind in binds]
        model = LlamaModel.load(gguf, [_client(stack, s.endpoint) for s in servers])
        stack.callback(model.close)
        prompt = load_tokenizer(gguf).encode(RECOVERY_PROMPT)
        expected = model.generate(prompt, RECOVERY_TOKENS, stop_ids=())
        victim, at = rng.randrange(3), rng.randrange(1, RECOVERY_TOKENS - 1)
        seen, hit = [0], [0.0]

        def stream(_: int) -> None:
            seen[0] += 1
            if seen[0] == at:
                hit[0] = time.monotonic()
                _hit(stack, servers[victim], fault, args, binds[victim])
        out = model.generate(prompt, RECOVERY_TOKENS, stop_ids=(), stream=stream)
        if out != expected or len(model.recoveries) != 1:
            raise RuntimeError(f"worker {victim} hit by {fault} at token {at}: output differs or "
                               f"{len(model.recoveries)} recoveries")
        r = model.recoveries[0]
        detection = r.failed_at - hit[0] + r.detect_seconds
        return [detection, r.load_seconds, r.prefill_seconds,
                detection + r.load_seconds + r.prefill_seconds]


FAULTS = ("kill", "stop", "restart")
"""What a trial does to its victim: ``kill -9``; ``SIGSTOP`` (left stopped: frozen, as a host
that stopped scheduling it, until the trial ends); ``kill -9`` and a fresh worker started at
the same address at once (as a supervisor restarts it)."""


def _hit(stack: ExitStack, server: ServerProcess, fault: str, args: list[str], bind: str) -> None:
    if fault == "stop":
        server.proc.send_signal(signal.SIGSTOP)
        stack.callback(server.proc.send_signal, signal.SIGCONT)    # before _reap kills it
        return
    server.proc.kill()
    if fault == "restart":
        server.proc.wait()
        _worker_with(stack, args, bind)


def _worker_with(stack: ExitStack, args: list[str], bind: str = "tcp://127.0.0.1:*"
                 ) -> ServerProcess:
    server = ServerProcess(worker_argv(*args, bind=bind))
    stack.callback(_reap, server)
    server.wait_ready()
    return server


@register_case("recovery", "SmolLM2 on 3 workers, kill -9 of one at a random token of a 64-token "
               "greedy generation: detection, load of the moved layers, re-prefill (with and "
               "without the model in --model-dir); outputs checked identical", default=False)
def case_recovery(ctx: BenchContext) -> list[CaseResult]:
    rng = random.Random(28)     # the same victims and tokens in every run
    rows = []
    for label, from_file in (("--model-dir", True), ("upload", False)):
        trials = _trials(ctx, f"recovery {label}", functools.partial(trial_recovery,
                                                                        from_file, rng))
        for k, part in enumerate(("detection", "load", "re-prefill", "total")):
            rows += _rows("recovery", f"{label}: kill -9 -> {part}", [t[k] for t in trials],
                          DETECT_BOUND_S if part == "detection" else RECOVERY_BOUND_S)
    return rows


RECOVERY_BOUND_S = DETECT_BOUND_S + 4.0
"""Detection + 4 s for the load and the re-prefill of a SmolLM2-size stage on this host (the
rows show each part against it)."""
FROZEN_RECOVERY_BOUND_S = RECOVERY_BOUND_S + RETURN_GRACE_S
"""A frozen worker's connection drops at the heartbeat (within :data:`DETECT_BOUND_S`), then it
has ``RETURN_GRACE_S`` to come back before it is taken for lost (client/llama/recovery.py)."""
CHAOS_TRIALS = 21
SERVE_STREAMS = 4
SERVE_TOKENS = 48
"""Tokens each of the server trials' streams generates (greedy)."""


def trial_serve(fault: str, rng: random.Random) -> list[float]:
    """A ``zmq-rpc-serve`` on 3 fresh local workers, 4 concurrent greedy streams, then again with
    one worker, picked at random, hit by ``fault`` at a random streamed chunk (after every
    stream's first). Every stream's text must be the fault-free one's, with one recovery counted
    in the server's /metrics. Seconds of [the longest wait of any stream for its next chunk
    after the fault (what a user sees), the server's own total (detection + load + re-prefill)]."""
    from .bench_serve import PROMPTS, SERVE

    binds = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(3)]
    with ExitStack() as stack:
        servers = [_worker_with(stack, [], bind) for bind in binds]
        serve = ServerProcess([SERVE, "--workers", ",".join(s.endpoint for s in servers),
                               "--port", "0", "--slots", str(SERVE_STREAMS)])
        stack.callback(serve.stop)
        url = serve.wait_ready()
        prompts = PROMPTS[:SERVE_STREAMS]
        expected, _ = _streams(url, prompts, lambda: None, -1)
        victim, at = rng.randrange(3), rng.randrange(SERVE_STREAMS, SERVE_STREAMS * 12)
        got, waited = _streams(url, prompts, lambda: _hit(stack, servers[victim], fault, [],
                                                          binds[victim]), at)
        if got != expected:
            raise RuntimeError(f"worker {victim} hit by {fault} at chunk {at}: streams differ")
        recoveries = _metric(url, 'zmq_rpc_serve_recoveries_total{outcome="moved"}') + \
            _metric(url, 'zmq_rpc_serve_recoveries_total{outcome="returned"}')
        if recoveries != 1:
            raise RuntimeError(f"{fault} at chunk {at}: {recoveries:g} recoveries")
        return [waited, _metric(url, 'zmq_rpc_serve_recovery_seconds_sum{part="total"}')]


def _streams(url: str, prompts: Sequence[str], hit: Callable[[], None], at: int
             ) -> tuple[list[str], float]:
    """Each prompt's streamed greedy text (one thread each); ``hit()`` once ``at`` text chunks
    have arrived in all; the longest any stream then waited for its next chunk."""
    import httpx

    lock = threading.Lock()
    count, hit_at, waits = [0], [0.0], [0.0]

    def run(prompt: str) -> str:
        text, first_after = "", True
        body = {"model": "any", "prompt": prompt, "max_tokens": SERVE_TOKENS, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=url, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=body) as answer:
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                piece = "".join(c.get("text", "") for c in chunk.get("choices", ()))
                text += piece
                with lock:
                    if hit_at[0] and first_after and piece:
                        waits[0] = max(waits[0], time.monotonic() - hit_at[0])
                        first_after = False
                    count[0] += bool(piece)
                    if count[0] == at:
                        hit_at[0] = time.monotonic()
                        first_after = False     # this stream's chunk came before the fault
                        hit()
        return text
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(run, prompts)), waits[0]


def _metric(url: str, sample: str) -> float:
    """The value of ``sample`` (name and labels as /metrics prints them; 0 when absent)."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@register_case("chaos", "SmolLM2 on 3 workers: kill -9, SIGSTOP, or kill -9 and restart at the "
               "same address, of a random worker at a random token of a 64-token greedy "
               "generation and of a 4-stream server run, 21 trials each: every output "
               "identical, recovery times vs the bounds",
               default=False)
def case_chaos(ctx: BenchContext) -> list[CaseResult]:
    rng = random.Random(2828)   # the same faults, victims and tokens in every run
    faults = [FAULTS[i % len(FAULTS)] for i in range(ctx.reps(CHAOS_TRIALS, len(FAULTS)))]
    rng.shuffle(faults)
    order = iter(faults)

    def trial() -> tuple[str, list[float], list[float]]:
        fault = next(order)
        return fault, trial_recovery(False, rng, fault), trial_serve(fault, rng)
    results = _trials(ctx, "chaos", trial, len(faults), len(faults))
    rows = []
    for fault in FAULTS:
        samples = [(model, serve) for f, model, serve in results if f == fault]
        bound = FROZEN_RECOVERY_BOUND_S if fault == "stop" else RECOVERY_BOUND_S
        rows += _rows("chaos", f"{fault}: detection", [m[0] for m, _ in samples], bound - 4.0)
        rows += _rows("chaos", f"{fault}: total recovery", [m[3] for m, _ in samples], bound)
        rows += _rows("chaos", f"{fault}: 4-stream server, longest wait for a chunk",
                      [v[0] for _, v in samples], bound)
        rows += _rows("chaos", f"{fault}: 4-stream server, its recovery", [v[1] for _, v in samples],
                      bound)
    return rows


