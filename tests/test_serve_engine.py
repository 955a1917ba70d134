"""The serving engine's scheduler with a step function of two slots (the shape the batching engine
will have): requests join free slots between steps and share them, a cancelled stream leaves at
the next step boundary, a full queue refuses, a lost worker ends every stream with an error.

The step function here is the seam's test double: it counts tokens instead of running a model
(test_serve.py runs the real one). Runs an asyncio loop in the test thread and the engine's
thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import pytest

pytest.importorskip("starlette")
from zmq_rpc.client import ConnectionLost  # noqa: E402
from zmq_rpc.client.serve.engine import Engine, Event, Running, Stream  # noqa: E402
from zmq_rpc.client.serve.jobs import APIError, Job, Sampling  # noqa: E402
from zmq_rpc.client.serve.metrics import ServeMetrics  # noqa: E402

EOS = 1
LOSE = 2
"""A prompt starting with this id makes the step fail as a lost worker does."""
ENDS = 3
"""A prompt starting with this id gets EOS after three letters."""
TIMEOUT = 10.0


class Letters:
    """Token id t is the letter chr(t); EOS is special (no text)."""

    eos_id = EOS

    def stream_decoder(self, skip_special_tokens: bool = False) -> Letters:
        return self

    def push(self, token_id: int) -> str:
        return "" if token_id == EOS else chr(token_id)

    def flush(self) -> str:
        return ""


class TwoSlots:
    """Two slots; a prompt is prefilled 4 tokens a step, then each step yields the next letter.
    Each step waits for ``go``; ``busy_log`` records which slots each step ran."""

    slots = 2
    n_ctx = 64

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Semaphore(0)
        self.busy_log: list[tuple[int, ...]] = []

    def start(self, slot: int) -> None:
        pass

    def step(self, busy: Mapping[int, Running]) -> dict[int, int]:
        self.entered.release()
        assert self.go.wait(TIMEOUT)
        self.busy_log.append(tuple(sorted(busy)))
        if any(seq.job.prompt_ids[0] == LOSE for seq in busy.values()):
            raise ConnectionLost("worker tcp://127.0.0.1:1 is gone")
        out = {}
        for slot, seq in busy.items():
            del seq.pending[:4]
            if not seq.pending:
                ends = seq.job.prompt_ids[0] == ENDS and len(seq.tokens) == 3
                out[slot] = EOS if ends else ord("A") + len(seq.tokens)
        return out


def job(max_tokens: int, prompt: tuple[int, ...] = (7, 7, 7, 7, 7), stop: str = "") -> Job:
    return Job(kind="completion", model="m", prompt_ids=prompt,
               sampling=Sampling(max_tokens=max_tokens, temperature=0.0,
                                 stop=(stop,) if stop else ()))


async def read(stream: Stream) -> tuple[str, Event]:
    text = []
    while True:
        event = await asyncio.wait_for(stream.get(), TIMEOUT)
        text.append(event.text)
        if event.finish or event.error:
            return "".join(text), event


def run(test: object, max_queue: int = 4) -> None:
    steps, metrics = TwoSlots(), ServeMetrics()
    engine = Engine(steps, Letters(), max_queue=max_queue, metrics=metrics)  # type: ignore[arg-type]
    engine.start()
    try:
        asyncio.run(test(engine, steps))  # type: ignore[operator]
    finally:
        steps.go.set()
        engine.close()


def test_requests_share_the_slots_and_each_gets_its_own_answer() -> None:
    async def body(engine: Engine, steps: TwoSlots) -> None:
        loop = asyncio.get_running_loop()
        a = engine.submit(job(5), loop)
        assert steps.entered.acquire(timeout=TIMEOUT)         # a is in a slot, mid-step
        b = engine.submit(job(3, stop="C"), loop)
        c = engine.submit(job(2, prompt=(9,)), loop)
        steps.go.set()
        (ta, ea), (tb, eb), (tc, ec) = [await read(s) for s in (a, b, c)]
        assert (ta, ea.finish, ea.completion_tokens) == ("ABCDE", "length", 5)
        assert (tb, eb.finish) == ("AB", "stop")             # the stop string, cut
        assert (tc, ec.finish) == ("AB", "length")
        assert steps.busy_log[0] == (0,) and (0, 1) in steps.busy_log
        assert engine.metrics.finishes.labels("length")._value.get() == 2
    run(body)


def test_text_held_back_for_a_stop_string_comes_out_at_the_end_of_turn() -> None:
    async def body(engine: Engine, steps: TwoSlots) -> None:
        steps.go.set()
        stream = engine.submit(job(10, prompt=(ENDS,), stop="CD"), asyncio.get_running_loop())
        text, end = await read(stream)
        assert (text, end.finish, end.completion_tokens) == ("ABC", "stop", 4)
    run(body)


def test_a_cancelled_stream_leaves_its_slot_at_the_next_step() -> None:
    async def body(engine: Engine, steps: TwoSlots) -> None:
        loop = asyncio.get_running_loop()
        a = engine.submit(job(50), loop)
        assert steps.entered.acquire(timeout=TIMEOUT)
        a.cancel()
        steps.go.set()
        b = engine.submit(job(2), loop)
        assert (await read(b))[0] == "AB"
        assert steps.busy_log[0] == (0,) and (0,) == steps.busy_log[-1]
        assert engine.metrics.finishes.labels("cancelled")._value.get() == 1
        assert engine.slots_in_use() == 0
    run(body)


def test_a_full_queue_refuses_with_429() -> None:
    """``max_queue`` counts the requests beyond the free slots: those that arrive while a slot
    is free but before the engine thread takes them (between steps, or late on a loaded
    machine) are not refused."""
    async def body(engine: Engine, steps: TwoSlots) -> None:
        loop = asyncio.get_running_loop()
        held = [engine.submit(job(1), loop)]
        assert steps.entered.acquire(timeout=TIMEOUT)          # held in its step
        # Slot 1 is free: the first of these takes it at the next step, two wait.
        held += [engine.submit(job(1), loop) for _ in range(3)]
        with pytest.raises(APIError) as full:
            engine.submit(job(1), loop)
        assert full.value.status == 429 and full.value.headers == {"Retry-After": "1"}
        assert engine.scheduler.waiting() == 2
        steps.go.set()
        assert [(await read(s))[0] for s in held] == ["A"] * 4
    run(body, max_queue=2)


def test_a_lost_worker_ends_every_stream_and_refuses_new_ones() -> None:
    async def body(engine: Engine, steps: TwoSlots) -> None:
        loop = asyncio.get_running_loop()
        a = engine.submit(job(50), loop)
        assert steps.entered.acquire(timeout=TIMEOUT)
        lost = engine.submit(job(50, prompt=(LOSE,)), loop)
        waiting = engine.submit(job(50), loop)
        steps.go.set()
        for stream in (a, lost, waiting):
            _, event = await read(stream)
            assert event.error is not None and event.error.status == 503
            assert "worker" in event.error.message
        assert not engine.healthy and "ConnectionLost" in (engine.problem or "")
        with pytest.raises(APIError) as refused:
            engine.submit(job(1), loop)
        assert refused.value.status == 503
    run(body)
