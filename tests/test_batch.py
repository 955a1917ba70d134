"""Continuous batching (client/llama/batch.py, serve's BatchedSteps) on real worker processes.

The tiny synthetic models of every family (tests/synthetic_models.py) on 1 and 2 workers: a
sequence's logits and tokens are bit for bit the same alone and with other sequences of other
lengths joining and leaving in the other slots, wherever its rows fall; the batched graphs
agree with :class:`~zmq_rpc.client.llama.LlamaModel`'s; a cancelled sequence's slot serves the
next one cleanly; a running stream gets a token every step while a long prompt prefills.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from synthetic_models import FAMILIES, synthetic_path
from zmq_rpc.client import Client
from zmq_rpc.client.gguf_model import LlamaGGUF, load_gguf
from zmq_rpc.client.llama import LlamaModel
from zmq_rpc.client.llama.batch import MIN_ROWS, BatchedModel, Rows, RowSampling
from zmq_rpc.client.serve.engine import BatchedSteps
from zmq_rpc.client.serve.jobs import Sampling
from zmq_rpc.tools.synthetic_gguf import write_family

N_CTX = 64
SLOTS = 8
CHUNK = 4
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(1, 2000, n).tolist() for n in (5, 11, 3, 17, 8, 2, 13, 6)]
GREEDY = Sampling(max_tokens=6, temperature=0.0)

pytestmark = pytest.mark.timeout(300)


@dataclass(eq=False)
class Seq:
    """What BatchedSteps reads of the engine's Running: the prompt left, the tokens, the job."""

    pending: list[int]
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    steps_done: list[int] = field(default_factory=list)

    @property
    def job(self) -> Any:
        return SimpleNamespace(sampling=self.sampling)


Plan = dict[int, list[tuple[int, list[int], Sampling]]]
"""From step call i: (slot, prompt, sampling) of the sequences joining (once the slot is free)."""


def drive(steps: BatchedSteps, plan: Plan, *, cancel: dict[int, list[int]] | None = None
          ) -> dict[tuple[int, int], Seq]:
    """Run ``plan`` as the engine would; every sequence by (slot, joining step)."""
    busy: dict[int, Seq] = {}
    done: dict[tuple[int, int], Seq] = {}
    waiting = [(at, *join) for at, joins in sorted(plan.items()) for join in joins]
    i = 0
    while busy or waiting:
        for slot in (cancel or {}).get(i, []):
            busy.pop(slot, None)
        for join in [w for w in waiting if w[0] <= i and w[1] not in busy]:  # a slot in use: later
            waiting.remove(join)
            at, slot, prompt, sampling = join
            steps.start(slot)
            busy[slot] = done[slot, at] = Seq(list(prompt), sampling)
        for slot, token in steps.step(busy).items():   # type: ignore[arg-type]
            seq = busy[slot]
            seq.tokens.append(token)
            seq.steps_done.append(i)
            seq.logits.append(steps.last_logits[slot])
            if len(seq.tokens) >= seq.sampling.max_tokens:
                del busy[slot]
        i += 1
        assert i < 1000, "the sequences never finished"
    return done


@pytest.fixture(scope="module")
def families(worker_processes: list[Client]) -> Iterator[dict[tuple[str, int], BatchedModel]]:
    loaded: dict[tuple[str, int], BatchedModel] = {}
    try:
        yield loaded
    finally:
        for model in loaded.values():
            model.close()


def batched(families: dict[tuple[str, int], BatchedModel], clients: list[Client], family: str,
            workers: int) -> BatchedModel:
    key = (family, workers)
    if key not in families:
        families[key] = BatchedModel.load(load_gguf(synthetic_path(family)), clients[:workers],
                                          n_ctx=N_CTX, slots=SLOTS, rows=SLOTS + CHUNK)
    return families[key]


def alone(model: BatchedModel, slot: int, prompt: list[int], sampling: Sampling = GREEDY) -> Seq:
    steps = BatchedSteps(model, prefill_chunk=CHUNK, keep_logits=True)
    return drive(steps, {0: [(slot, prompt, sampling)]})[slot, 0]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_sequence_is_bit_identical_alone_and_among_others(
        family: str, workers: int, worker_processes: list[Client],
        families: dict[tuple[str, int], BatchedModel]) -> None:
    model = batched(families, worker_processes, family, workers)
    assert model.sizes[0] == MIN_ROWS        # K-quants: no step below the GEMM's 3 rows
    assert_alone_as_among_others(model, workers)


def row_invariant_mix(part: str, layer: int, n_layers: int, cols: int) -> GT:
    """Only types whose decode kernels round as their GEMM (Q4_1 layers, a Q8_0 head)."""
    return GT.Q8_0 if part in ("output", "token_embd_tied") else GT.Q4_1


KQUANT_TYPES = (GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.Q5_0, GT.Q5_1)
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def kquant_mix(part: str, layer: int, n_layers: int, cols: int) -> GT:
    """A Q4_K_M-like file's other block types, every one in every layer (a different one per part
    and layer, so Q/K/V and gate/up split), the head Q6_K: the decode kernels of kernels.unpackdot."""
    if part in ("output", "token_embd_tied"):
        return GT.Q6_K
    if part == "token_embd":
        return GT.Q8_0
    return KQUANT_TYPES[(PARTS.index(part) + layer) % len(KQUANT_TYPES)]


MIXES = {"q4_1": row_invariant_mix, "kquant": kquant_mix}


@pytest.fixture(scope="module", params=sorted(MIXES))
def invariant_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaGGUF:
    family = replace(FAMILIES["llama3"], mix=MIXES[request.param])
    name = request.param
    return load_gguf(write_family(family, tmp_path_factory.mktemp(name) / f"{name}.gguf", seed=5))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_stream_of_a_row_invariant_model_decodes_one_row_bit_identically(
        workers: int, worker_processes: list[Client], invariant_gguf: LlamaGGUF) -> None:
    """A model whose products are all block types (Q4_0/Q4_1/Q8_0, or Q4_K/Q5_K/Q6_K/Q5_0/Q5_1:
    a Q4_K_M file's) steps one decoding sequence as one row (the decode kernel, as LlamaModel
    does; it ran 3 through the GEMM, 0.5x the speed), and its logits stay bit for bit those it
    gets among others (steps of 2 to 12 rows)."""
    with BatchedModel.load(invariant_gguf, worker_processes[:workers], n_ctx=N_CTX,
                           slots=SLOTS, rows=SLOTS + CHUNK) as model:
        assert model.sizes[0] == 1
        step = model.launch(0, [Rows(0, [5], 0, RowSampling())])
        assert step.rows == 1
        step.result()
        assert_alone_as_among_others(model, workers)


def assert_alone_as_among_others(model: BatchedModel, workers: int) -> None:
    """A sequence's tokens and logits alone (its decode steps as small as ``model`` allows) and
    among others joining and leaving, in another slot and lane too."""
    target = PROMPTS[3]
    reference = alone(model, 5, target)
    others = [PROMPTS[k] for k in (0, 1, 2, 4, 5, 6, 7)]
    sampled = Sampling(max_tokens=9, temperature=0.8, top_k=40, top_p=0.9, seed=11)
    plan: Plan = {0: [(0, others[0], GREEDY), (1, others[1], sampled), (2, others[2], GREEDY)],
                  2: [(5, target, GREEDY), (3, others[3], Sampling(max_tokens=2))],
                  3: [(4, others[4], sampled), (6, others[5], GREEDY)],
                  5: [(7, others[6], Sampling(max_tokens=12, temperature=0.0))],
                  6: [(3, others[0], GREEDY)]}
    mixed = drive(BatchedSteps(model, prefill_chunk=CHUNK, keep_logits=True), plan)
    got = mixed[5, 2]
    assert got.tokens == reference.tokens
    for a, b in zip(got.logits, reference.logits, strict=True):
        assert np.array_equal(a, b)
    moved = alone(model, 2 if workers == 1 else 0, target)   # another slot, lane and rows
    assert moved.tokens == reference.tokens
    assert all(np.array_equal(a, b) for a, b in zip(moved.logits, reference.logits, strict=True))
    again = alone(model, 1, others[1], sampled)              # a seeded draw is its own too
    assert again.tokens == mixed[1, 0].tokens


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_batched_graphs_compute_what_the_model_computes(
        family: str, worker_processes: list[Client],
        families: dict[tuple[str, int], BatchedModel]) -> None:
    model = batched(families, worker_processes, family, 2)
    prompt = PROMPTS[6] + PROMPTS[3]
    got = alone(model, 3, prompt, Sampling(max_tokens=4, temperature=0.0))
    with LlamaModel.load(model.gguf, worker_processes[:1], n_ctx=N_CTX) as serial:
        full = serial.forward_full(prompt + got.tokens[:-1])
    want = full[len(prompt) - 1:]
    for row, logits in zip(want, got.logits, strict=True):
        np.testing.assert_allclose(logits, row, rtol=0, atol=2e-3 * np.abs(row).max())
    assert got.tokens == [int(np.argmax(r)) for r in want]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_cancelled_sequence_leaves_its_slot_clean(
        workers: int, worker_processes: list[Client],
        families: dict[tuple[str, int], BatchedModel]) -> None:
    model = batched(families, worker_processes, "llama3", workers)
    follower = PROMPTS[4]
    reference = alone(model, 2, follower)
    long = Sampling(max_tokens=40, temperature=0.0)
    # On 2 workers slot 1 is in the other lane, so that at step 14 slot 2's lane has a step in
    # flight with a token for the cancelled sequence: it must not reach the one joining.
    plan: Plan = {0: [(2, PROMPTS[3], long), (1, PROMPTS[0], long)], 14: [(2, follower, GREEDY)]}
    runs = drive(BatchedSteps(model, prefill_chunk=CHUNK, keep_logits=True), plan,
                 cancel={14: [2]})
    cancelled, joined = runs[2, 0], runs[2, 14]
    assert 0 < len(cancelled.tokens) < long.max_tokens
    assert joined.tokens == reference.tokens
    assert all(np.array_equal(a, b) for a, b in zip(joined.logits, reference.logits, strict=True))


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(
        worker_processes: list[Client], families: dict[tuple[str, int], BatchedModel]) -> None:
    model = batched(families, worker_processes, "llama3", 1)
    long_prompt = RNG.integers(1, 2000, 5 * CHUNK + 1).tolist()
    steady = Sampling(max_tokens=20, temperature=0.0)
    plan: Plan = {0: [(0, PROMPTS[0], steady)], 3: [(1, long_prompt, Sampling(max_tokens=2))]}
    runs = drive(BatchedSteps(model, prefill_chunk=CHUNK, keep_logits=True), plan)
    running, joining = runs[0, 0], runs[1, 3]
    first = joining.steps_done[0]
    assert first >= 3 + 5                      # its prompt took 6 steps of CHUNK rows
    during = range(3, first + 1)
    assert set(during) <= set(running.steps_done)   # one token in every one of those steps
    assert running.tokens == alone(model, 0, PROMPTS[0], steady).tokens
