"""Recovery of a split model from a lost worker (client/llama/recovery.py), as users meet it:
real worker subprocesses, real signals (kill -9 and SIGSTOP by PID), default client and model
settings. A worker of three is lost at a random token of a greedy generation; the output must be
the fault-free run's, the loss detected within the failure contract's bound (docs/FAILURES.md:
the heartbeat timeout + 1 s), and the recovery reported.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import WorkerProcess
from requantize import cache_dir
from zmq_rpc.client import Client, ConnectionLost, RecoveryFailed
from zmq_rpc.client.llama import LlamaModel
from zmq_rpc.client.llama.batch import BatchedModel
from zmq_rpc.client.llama.recovery import MAX_RETURNS, RETURN_GRACE_S, Recovery
from zmq_rpc.client.llama.runtime import LOSSES
from zmq_rpc.client.serve.engine import BatchedSteps
from zmq_rpc.client.serve.jobs import Sampling
from zmq_rpc.tools.synthetic_gguf import FAMILIES, write_family

pytestmark = pytest.mark.timeout(240)

BOUND_S = 5.0 + 1.0
"""Detection: the heartbeat timeout + 1 s (a killed worker's loss is seen at once)."""

PROMPT = [1, 400, 2000, 31, 77, 12000, 5]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def six_layers() -> Path:
    """The synthetic llama of tests/synthetic_models.py with 6 layers (2 per worker of 3)."""
    path = cache_dir() / "synthetic-llama3-6layers-v1.gguf"
    if not path.exists():
        write_family(replace(FAMILIES["llama3"], n_layers=6), path, seed=61)
    return path


def split(path: Path, procs: list[WorkerProcess], open_client: Callable[[str], Client],
          **options: object) -> LlamaModel:
    return LlamaModel.load(str(path), [open_client(p.endpoint) for p in procs], n_ctx=64,
                           **options)  # type: ignore[arg-type]


def fault_at(token: int, fault: Callable[[], None]) -> Callable[[int], None]:
    """A stream callback that runs ``fault`` when the ``token``-th new token arrives."""
    seen = [0]

    def stream(_: int) -> None:
        seen[0] += 1
        if seen[0] == token:
            fault()
    return stream


@pytest.mark.parametrize("types", ["toy mix", "q4_1"])
def test_generation_survives_a_killed_worker(
        types: str, request: pytest.FixtureRequest, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """The toy mix (K-quants, f16) is replayed as it was fed, Q4_1 as prefill chunks: both
    give the fault-free output."""
    path = request.getfixturevalue("six_layers" if types == "toy mix" else "six_layers_q4_1")
    procs = [spawn_worker() for _ in range(3)]
    with split(path, procs, clients) as model:
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        at = random.Random().randint(2, NEW_TOKENS - 4)
        victim, layers = procs[1], model.stages[1].layers
        killed = [0.0]

        def kill() -> None:
            killed[0] = time.monotonic()
            victim.proc.send_signal(signal.SIGKILL)
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(at, kill))
        assert out == expected, f"killed at token {at}"
        reported = model.recoveries
        assert [r.moves[0].lost for r in reported] == [victim.endpoint]
        move = reported[0].moves[0]
        assert move.layers == layers and not move.spare
        assert move.onto in (procs[0].endpoint, procs[2].endpoint)
        assert reported[0].failed_at + reported[0].detect_seconds - killed[0] < BOUND_S
        # its address refuses zmq's reconnection (after 0.1 s): lost without the grace a
        # frozen worker gets to come back
        assert reported[0].detect_seconds < RETURN_GRACE_S
        assert reported[0].tokens >= len(PROMPT) + at - 1
        assert reported[0].as_fed == (types == "toy mix")
        assert model.stages[1].client.endpoint == move.onto
        assert model.generate(PROMPT, NEW_TOKENS, stop_ids=()) == expected   # and stays whole


def test_the_last_stage_moves_to_a_spare_first(
        six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    procs = [spawn_worker() for _ in range(4)]
    spare = clients(procs[3].endpoint)
    reported: list[Recovery] = []
    with split(six_layers, procs[:3], clients, spares=[spare],
               on_recovery=reported.append) as model:
        layers = model.stages[-1].layers
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(
            5, lambda: procs[2].proc.send_signal(signal.SIGKILL)))
        assert out == expected
        assert reported == model.recoveries and len(reported) == 1
        (move,) = reported[0].moves
        assert move.spare and move.onto == spare.endpoint and move.layers == layers
        assert model.stages[-1].client is spare and model.stages[-1].last


def test_a_frozen_worker_is_detected_within_the_bound_and_replaced(
        six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    procs = [spawn_worker() for _ in range(3)]
    with split(six_layers, procs, clients) as model:
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        frozen = [0.0]

        def freeze() -> None:
            procs[0].freeze()
            frozen[0] = time.monotonic()
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(4, freeze))
        assert out == expected
        (recovery,) = model.recoveries
        assert recovery.moves[0].lost == procs[0].endpoint
        detected = recovery.failed_at + recovery.detect_seconds - frozen[0]
        assert detected < BOUND_S + RETURN_GRACE_S, detected   # + its grace to come back


def test_layers_that_fit_nowhere_fail_saying_what_would_fit(
        six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """The last stage holds the 13 MiB vocabulary table (28 MiB with its step tensors and
    staging): survivors of 52 MiB cannot take it. Each peer connection a worker accepts counts
    24.4 MiB of receive queue against --mem (worker/peer/queue.py): a worker of the chain has
    two (its upstream's hand-offs, its downstream's watch of the link), so 52 MiB leaves ~1 MiB
    for a hand-off chunk that arrives before its run is queued; after the kill one goes, and
    ~26 MiB is free, under the 28 needed (64 MiB: the stage fits and is moved). Not 12 MiB, as
    before: the connections then left no byte of --mem free, the early chunk had nowhere to
    wait, and the prefill failed (after 48 s, until the stash remembered lost transfers; CI
    loop run 1 of 3aa0586), not the recovery. The step fails first with the lost worker's
    ConnectionLost or a survivor's TransferError (its hand-off from the lost worker called
    off), whichever the client hears first."""
    procs = [spawn_worker("--mem", "52MiB"), spawn_worker("--mem", "52MiB"),
             spawn_worker("--mem", "256MiB")]
    with split(six_layers, procs, clients) as model:
        with pytest.raises(RecoveryFailed, match=r"layers \d+-5 fit on no other worker: they need "
                                                  r"\d+ MiB free on one .*--mem >= \d+ MiB") as e:
            model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(
                3, lambda: procs[2].proc.send_signal(signal.SIGKILL)))
        assert isinstance(e.value, ConnectionLost) and isinstance(e.value.__cause__, LOSSES)
        assert "receive was queued" not in str(e.value.__cause__)      # the kill's, not that


def test_a_middle_worker_restarted_at_its_address_is_replaced_at_once(
        llama_gguf: Any, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """kill -9 of the middle worker of 3, and a fresh one at the same address at once (as a
    supervisor restarts it): the client calls off the failed step's hand-offs, then launches
    the next chained step before it sees the failure, whose first stage receives the token the
    called-off hand-off carried. That receive fails as it is queued (it waited for the
    transfer deadline, 48 s, every time), and the output is the fault-free one. SmolLM2: its
    steps are still in flight when the stream callback runs (a toy model's are done)."""
    procs = [spawn_worker() for _ in range(3)]
    with LlamaModel.load(llama_gguf, [clients(p.endpoint) for p in procs], n_ctx=64) as model:
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        victim = procs[1]

        def restart() -> None:
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait()
            spawn_worker("--bind", victim.endpoint)      # listening again before it returns
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(4, restart))
        assert out == expected
        (recovery,) = model.recoveries
        assert recovery.moves[0].lost == victim.endpoint
        assert recovery.detect_seconds < BOUND_S


def test_recover_false_keeps_the_failure_contract(
        six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    procs = [spawn_worker() for _ in range(3)]
    with split(six_layers, procs, clients, recover=False) as model:
        with pytest.raises(ConnectionLost):
            model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(
                3, lambda: procs[1].proc.send_signal(signal.SIGKILL)))
        assert model.recoveries == []


def thaw_when_dropped(proc: WorkerProcess, client: Client, done: threading.Event) -> None:
    """Freeze ``proc`` and, on another thread, SIGCONT it the moment ``client``'s connection to
    it drops (a ping in flight fails with ``ConnectionLost`` at the heartbeat timeout): a worker
    its host starved past the heartbeat, running again."""
    proc.freeze()

    def watch() -> None:
        try:
            with pytest.raises(ConnectionLost):
                client.ping_async().result(timeout=BOUND_S + 5)
        finally:
            proc.proc.send_signal(signal.SIGCONT)
            done.set()
    threading.Thread(target=watch, daemon=True).start()


@pytest.mark.parametrize("max_returns", [MAX_RETURNS, 0])
def test_a_worker_that_comes_back_keeps_its_layers(
        max_returns: int, six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """SIGSTOP past the heartbeat, SIGCONT once the connection dropped: the worker reconnects
    with its session, so the failed step is issued again on the same stages, nothing re-placed
    or replayed, and the output is the fault-free one. Past ``max_returns`` in a row (0 here)
    it is taken for lost and re-placed."""
    procs = [spawn_worker() for _ in range(3)]
    with split(six_layers, procs, clients) as model:
        assert model.recoverer is not None
        model.recoverer.max_returns = max_returns
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        slow, thawed = model.stages[1].client, threading.Event()
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(
            4, lambda: thaw_when_dropped(procs[1], slow, thawed)))
        assert thawed.wait(BOUND_S + 5)
        assert out == expected
        (recovery,) = model.recoveries
        if max_returns:
            assert recovery.moves == () and recovery.returned == (procs[1].endpoint,)
            assert recovery.tokens == 0 and model.stages[1].client is slow
            assert recovery.detect_seconds < RETURN_GRACE_S + 1.0
        else:
            assert recovery.moves[0].lost == procs[1].endpoint
            assert model.stages[1].client is not slow
        assert model.generate(PROMPT, NEW_TOKENS, stop_ids=()) == expected   # and stays whole


# ------------------------------------------------------------------ the batched model (server)


BATCH_PROMPTS = [PROMPT[:3], PROMPT * 2, PROMPT[2:], PROMPT + PROMPT[:4]]
BATCH_NEW = [12, 22, 16, 26]
BATCH_CHUNK = 4


@dataclass(eq=False)
class Seq:
    """What BatchedSteps reads of the engine's Running: the prompt left, the tokens, the job."""

    pending: list[int]
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)

    @property
    def job(self) -> Any:
        return SimpleNamespace(sampling=self.sampling)


def drive(steps: BatchedSteps, fault: Callable[[dict[int, Seq]], bool] | None = None
          ) -> list[list[int]]:
    """The 4 sequences in slots 0-3 from the first step, run as the engine runs them;
    ``fault(busy)`` is asked after each step until it says it struck."""
    busy: dict[int, Seq] = {}
    for slot, (prompt, new) in enumerate(zip(BATCH_PROMPTS, BATCH_NEW)):
        steps.start(slot)
        busy[slot] = Seq(list(prompt), Sampling(max_tokens=new, temperature=0.0))
    seqs = dict(busy)
    for _ in range(1000):
        if not busy:
            return [seqs[slot].tokens for slot in sorted(seqs)]
        for slot, token in steps.step(busy).items():   # type: ignore[arg-type]
            busy[slot].tokens.append(token)
            if len(busy[slot].tokens) >= busy[slot].sampling.max_tokens:
                del busy[slot]
        if fault is not None and fault(busy):
            fault = None
    raise AssertionError("the sequences never finished")


@pytest.mark.parametrize("with_spare", [False, True])
def test_batched_sequences_survive_a_killed_worker(
        with_spare: bool, six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """4 sequences of different lengths in a BatchedModel on 3 workers (3 lanes in flight),
    a random worker killed at a random step once every sequence is decoding: each sequence's
    greedy tokens are the fault-free run's (none lost, none repeated), and the recovery is
    reported once."""
    procs = [spawn_worker() for _ in range(4 if with_spare else 3)]
    spare: dict[str, Any] = {"spares": [clients(procs[3].endpoint)]} if with_spare else {}
    with BatchedModel.load(str(six_layers), [clients(p.endpoint) for p in procs[:3]], n_ctx=64,
                           slots=4, rows=2 + BATCH_CHUNK, **spare) as model:
        expected = drive(BatchedSteps(model, prefill_chunk=BATCH_CHUNK))
        rng = random.Random()
        victim, extra = rng.randrange(3), rng.randint(0, 8)
        layers = model.stages[victim].layers
        struck: list[int] = []

        def kill(busy: dict[int, Seq]) -> bool:
            nonlocal extra
            if len(busy) < 4 or not all(seq.tokens for seq in busy.values()):
                return False
            extra -= 1
            if extra >= 0:
                return False
            struck.extend(len(seq.tokens) for seq in busy.values())
            procs[victim].proc.send_signal(signal.SIGKILL)
            return True
        out = drive(BatchedSteps(model, prefill_chunk=BATCH_CHUNK), kill)
        assert struck, "the kill never came"
        assert out == expected, f"worker {victim} killed at tokens {struck}"
        (recovery,) = model.recoveries
        (move,) = recovery.moves
        assert move.lost == procs[victim].endpoint and move.layers == layers
        assert move.spare == with_spare and model.stages[victim].client.endpoint == move.onto
        assert recovery.tokens >= sum(len(p) for p in BATCH_PROMPTS)
        assert drive(BatchedSteps(model, prefill_chunk=BATCH_CHUNK)) == expected   # stays whole


def test_batched_sequences_wait_for_a_worker_that_comes_back(
        six_layers: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """SIGSTOP past the heartbeat, SIGCONT once the connection dropped: the lane steps in flight
    are issued again on the same stages, nothing re-placed or replayed, and every sequence's
    tokens are the fault-free run's."""
    procs = [spawn_worker() for _ in range(3)]
    with BatchedModel.load(str(six_layers), [clients(p.endpoint) for p in procs], n_ctx=64,
                           slots=4, rows=2 + BATCH_CHUNK) as model:
        expected = drive(BatchedSteps(model, prefill_chunk=BATCH_CHUNK))
        slow, thawed = model.stages[1].client, threading.Event()

        def freeze(busy: dict[int, Seq]) -> bool:
            if len(busy) < 4 or not all(seq.tokens for seq in busy.values()):
                return False
            thaw_when_dropped(procs[1], slow, thawed)
            return True
        out = drive(BatchedSteps(model, prefill_chunk=BATCH_CHUNK), freeze)
        assert thawed.wait(BOUND_S + 5)
        assert out == expected
        (recovery,) = model.recoveries
        assert recovery.moves == () and recovery.returned == (procs[1].endpoint,)
        assert model.stages[1].client is slow
