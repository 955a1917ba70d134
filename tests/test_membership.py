"""Workers leaving and joining a running model on purpose (client/llama/membership.py), as users
meet it: real worker subprocesses with their default settings, a real SIGTERM by PID, default
client and model settings. A worker sent SIGTERM mid-generation (its ``--drain-timeout``
default) has its layers moved off it at the next step boundary: the output is the fault-free
run's, nothing fails, and the worker exits 0 once the model closed its session. A worker added
mid-generation takes over layers, the output unchanged. A draining worker refuses new sessions.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import WorkerProcess
from test_recovery import fault_at
from waiting import wait_until
from zmq_rpc.client import Client, ConnectionLost
from zmq_rpc.client.llama import LlamaModel
from zmq_rpc.client.llama.batch import BatchedModel, Rows, RowSampling
from zmq_rpc.client.llama.recovery import Recovery

pytestmark = pytest.mark.timeout(120)

PROMPT = [1, 400, 2000, 31, 77, 12000, 5]
NEW_TOKENS = 32
HEARTBEAT_S = 2.0
"""The client's heartbeat interval (Client's default)."""
EXIT_BOUND_S = 10.0
"""From the model's drain (its client closed) to the worker's exit: its backend notices the
last session gone within a poll (0.25 s), then stops as SIGINT stops it (SHUTDOWN_BOUND_S)."""


def drain(proc: WorkerProcess) -> None:
    """SIGTERM, then wait for the worker to say that it drains (its log line): from then on
    its replies say so."""
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.stderr is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        line = proc.proc.stderr.readline()
        if "draining:" in line:
            return
        assert line, "the worker exited without draining"
    raise AssertionError("the worker never said it drains")


def test_sigterm_mid_generation_moves_the_layers_off_and_the_worker_exits_zero(
        six_layers_q4_1: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    procs = [spawn_worker() for _ in range(3)]
    reported: list[Recovery] = []
    with LlamaModel.load(str(six_layers_q4_1), [clients(p.endpoint) for p in procs], n_ctx=64,
                         on_recovery=reported.append) as model:
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        victim, layers = procs[1], model.stages[1].layers
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(4, lambda:
                                                                            drain(victim)))
        assert out == expected
        (recovery,) = reported
        assert recovery.kind == "drained" and "drained" in recovery.describe()
        (move,) = recovery.moves
        assert move.lost == victim.endpoint and move.layers == layers
        assert move.onto in (procs[0].endpoint, procs[2].endpoint)
        assert victim.endpoint not in [s.client.endpoint for s in model.stages]
        assert victim.proc.wait(EXIT_BOUND_S) == 0
        assert model.generate(PROMPT, NEW_TOKENS, stop_ids=()) == expected   # and stays whole


def test_an_idle_model_hears_the_drain_by_heartbeat_and_moves_at_its_next_step(
        six_layers_q4_1: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """Nothing runs when the worker drains: the client's heartbeat (2 s of silence) brings the
    flag, and the next generate moves off before its prompt (nothing to replay yet)."""
    procs = [spawn_worker() for _ in range(3)]
    with LlamaModel.load(str(six_layers_q4_1), [clients(p.endpoint) for p in procs], n_ctx=64) as model:
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        victim = model.stages[0].client
        drain(procs[0])
        wait_until(lambda: victim.draining, HEARTBEAT_S + 3, "the heartbeat said draining")
        assert model.generate(PROMPT, NEW_TOKENS, stop_ids=()) == expected
        (recovery,) = model.recoveries
        assert recovery.kind == "drained" and recovery.tokens == 0 and victim.closed
        assert procs[0].proc.wait(EXIT_BOUND_S) == 0


def test_a_worker_added_mid_generation_takes_over_layers(
        six_layers_q4_1: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    procs = [spawn_worker() for _ in range(3)]
    reported: list[Recovery] = []
    with LlamaModel.load(str(six_layers_q4_1), [clients(p.endpoint) for p in procs[:2]], n_ctx=64,
                         on_recovery=reported.append) as model:
        expected = model.generate(PROMPT, NEW_TOKENS, stop_ids=())
        widest = max(model.stages, key=lambda s: len(s.layers))
        newcomer = clients(procs[2].endpoint)
        out = model.generate(PROMPT, NEW_TOKENS, stop_ids=(), stream=fault_at(
            4, lambda: model.add_worker(newcomer)))
        assert out == expected
        (recovery,) = reported
        assert recovery.kind == "joined" and f"worker {newcomer.endpoint} joined" in \
            recovery.describe()
        assert len(model.stages) == 3 and newcomer in [s.client for s in model.stages]
        assert [s.index for s in model.stages] == [0, 1, 2]
        assert [layer for s in model.stages for layer in s.layers] == list(range(6))
        assert {m.lost for m in recovery.moves} == {widest.client.endpoint}
        assert sum(len(m.layers) for m in recovery.moves) == len(widest.layers)
        assert model.stages[0].first and model.stages[-1].last
        assert model.generate(PROMPT, NEW_TOKENS, stop_ids=()) == expected
        with pytest.raises(ValueError, match="already runs a stage"):
            model.add_worker(newcomer)


def test_a_draining_worker_refuses_new_sessions_and_serves_its_own(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker()
    with Client(proc.endpoint) as client:
        buf = client.alloc_buffer(1 << 10)
        assert not client.draining
        drain(proc)
        with pytest.raises(ConnectionLost, match=r"SHUTTING_DOWN\] HELLO refused: this worker "
                                                 r"is draining"):
            Client(proc.endpoint, connect_timeout=5)
        buf.clear(7)                            # still served
        client.ping()
        assert client.draining
        assert proc.proc.poll() is None         # it waits for this session
    assert proc.proc.wait(EXIT_BOUND_S) == 0    # closed: it leaves at once


def test_batched_sequences_move_off_a_draining_worker(
        six_layers_q4_1: Path, spawn_worker: Callable[..., WorkerProcess],
        clients: Callable[[str], Client]) -> None:
    """Two lanes of a 4-slot batched model, lane steps in flight when the worker drains: each
    slot's tokens are the fault-free run's."""
    procs = [spawn_worker() for _ in range(3)]
    with BatchedModel.load(str(six_layers_q4_1), [clients(p.endpoint) for p in procs], n_ctx=64,
                           slots=4, lanes=2) as model:
        expected = greedy_slots(model, None)
        victim = procs[2]
        assert greedy_slots(model, lambda: drain(victim)) == expected
        (recovery,) = model.recoveries
        assert recovery.kind == "drained" and recovery.moves[0].lost == victim.endpoint
        assert victim.proc.wait(EXIT_BOUND_S) == 0


def greedy_slots(model: BatchedModel, action: Callable[[], None] | None) -> list[list[int]]:
    """Each slot's prompt (one per slot, in one step), then 12 greedy tokens per slot, both
    lanes kept in flight; ``action`` runs after the 3rd step's tokens."""
    prompts = [PROMPT[: 3 + slot] for slot in range(model.slots)]
    out: list[list[int]] = [[] for _ in prompts]
    flying = []
    for lane in range(model.lanes):
        parts = [Rows(s, prompts[s], 0, RowSampling()) for s in model.lane_slots[lane]]
        flying.append(model.launch(lane, parts))
    steps = 0
    while flying:
        step = flying.pop(0)
        tokens, _ = step.result()
        steps += 1
        for slot, token in tokens.items():
            out[slot].append(token)
        if steps == 3 and action is not None:
            action()
        parts = [Rows(s, [out[s][-1]], len(prompts[s]) + len(out[s]) - 1, RowSampling())
                 for s in model.lane_slots[step.lane] if len(out[s]) < 12]
        if parts:
            flying.append(model.launch(step.lane, parts))
    for slot in range(model.slots):
        model.release(slot)
    return out
