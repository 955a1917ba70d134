"""The engine: one thread owns the model and runs it step by step for the requests in its slots.

::

    event loop (HTTP)                     engine thread (owns the model)
    Engine.submit(job) ── inbox ────────> Scheduler.admit: waiting requests into free slots
    (queue.Queue, bounded: full = 429)    step function: one prefill chunk or one decode per slot
    Stream.get() <── loop.call_soon_threadsafe ── each token's text, the end, or an error

Each turn of the engine thread is one step: cancelled streams (their HTTP client went away) leave
their slots, waiting requests are admitted into free slots (FIFO), and the step function advances
every busy slot by one prefill chunk or one decode step and returns the tokens they produced; each
token is sampled with its request's own RNG (:func:`~zmq_rpc.client.llama.sample_token`), turned
into text (:mod:`.text`) and handed to its stream. The step function is the seam: today's
:class:`SerialSteps` drives :class:`~zmq_rpc.client.llama.LlamaModel`, which holds one sequence
(one slot); a batching step function holding many KV slots replaces it without touching the rest.

A worker lost is recovered from inside the step, on this thread (the model's
:mod:`~zmq_rpc.client.llama.recovery`: its layers re-placed onto a spare or a survivor, every
live slot replayed, the lane steps in flight issued again): the streams wait for it and go on
with the next token, none lost or repeated; it is logged and counted in the metrics
(``on_recovery``, set where the model is loaded). A step that still fails (an
:class:`~zmq_rpc.client.RpcError`: a :class:`~zmq_rpc.client.RecoveryFailed`, nothing left to
take the layers; or a failure that leaves the model's state unknown) ends the busy streams with
an error event and marks the engine unhealthy: later requests are refused (503), the thread
keeps answering. The model and
the scheduler are touched by the engine thread only; the event loop calls :meth:`Engine.submit`,
:meth:`Stream.get`, :meth:`Stream.cancel` and the read-only properties.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ...broker.errors import ClientClosed, RpcError, TransportError
from ..llama.batch import LaneStep, Rows, RowSampling
from ..llama.sampling import sample_token
from .jobs import APIError, Job
from .metrics import ServeMetrics
from .text import TextStream

if TYPE_CHECKING:
    from ..client import Client
    from ..llama import LlamaModel
    from ..llama.batch import BatchedModel
    from ..tokenizer import Tokenizer

__all__ = ["BatchedSteps", "Engine", "Event", "Running", "Scheduler", "SerialSteps", "StepFunction",
           "Stream"]

log = logging.getLogger("zmq_rpc.client.serve")

RETRY_AFTER_S = 1
"""What a 429 tells the client to wait before trying again."""
IDLE_CHECK_S = 0.5
"""How often an idle engine looks for workers that drain or join (their flags: no request)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """What a stream receives: a piece of text, the end (``finish``), or an error."""

    text: str = ""
    finish: str | None = None
    """``"stop"`` (end of turn or a stop string) or ``"length"`` (max_tokens or the context)."""
    error: APIError | None = None
    completion_tokens: int = 0
    """Tokens generated so far (set on the last event)."""


class Stream:
    """One request's end of the engine: made and read on the event loop, fed by the engine
    thread through ``loop.call_soon_threadsafe``; :meth:`cancel` may be called from anywhere."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.arrived = time.perf_counter()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()

    def put(self, event: Event) -> None:
        """Engine thread: hand ``event`` to the reader."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:   # the loop is closed: nobody reads this stream any more
            pass

    async def get(self) -> Event:
        """Event loop: the next event."""
        return await self._events.get()

    def cancel(self) -> None:
        """The reader is gone: the engine frees the slot at its next step boundary."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(eq=False)
class Running:
    """A request in a slot (engine thread): what is left of its prompt, what it generated."""

    stream: Stream
    text: TextStream
    pending: list[int]
    """Prompt tokens not prefilled yet."""
    rng: np.random.Generator
    tokens: list[int] = field(default_factory=list)
    """Generated tokens; the last one is the next decode step's input."""
    last_time: float = 0.0

    @property
    def job(self) -> Job:
        return self.stream.job


class StepFunction(Protocol):
    """Advances the sequences in the model's KV slots (engine thread only)."""

    slots: int
    """How many sequences the model holds at once."""
    n_ctx: int
    """Positions each slot holds."""

    def start(self, slot: int) -> None:
        """A new sequence takes ``slot``: forget what it held."""

    def step(self, busy: Mapping[int, Running]) -> dict[int, int]:
        """One step: each busy slot's sequence gets one prefill chunk (its next ``pending``
        tokens, taken off the list) or one decode step (its last token); returns the token each
        slot produced (a sequence produces one on its prompt's last chunk and each decode)."""

    def add_worker(self, client: Client) -> None:
        """Have ``client``'s worker take over layers at the next step boundary (any thread)."""

    def step_boundary(self) -> None:
        """Workers that drain leave, added ones join, now (engine thread, idle)."""


class SerialSteps:
    """The step function on :class:`~zmq_rpc.client.llama.LlamaModel`: one slot (the model holds
    one sequence), one blocking prefill chunk or decode per step, sampled here."""

    slots = 1

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.n_ctx = model.n_ctx

    def start(self, slot: int) -> None:
        self.model.reset()

    def add_worker(self, client: Client) -> None:
        self.model.add_worker(client)

    def step_boundary(self) -> None:
        self.model.step_boundary()

    def step(self, busy: Mapping[int, Running]) -> dict[int, int]:
        return {slot: token for slot, seq in busy.items()
                if (token := self._advance(seq)) is not None}

    def _advance(self, seq: Running) -> int | None:
        if seq.pending:
            chunk = seq.pending[:self.model.prefill_chunk]
            del seq.pending[:len(chunk)]
            logits = self.model.prefill(chunk)
            if seq.pending:
                return None
        else:
            logits = self.model.decode(seq.tokens[-1])
        s = seq.job.sampling
        return sample_token(logits, s.temperature, s.top_k, s.top_p, seq.rng)


class BatchedSteps:
    """The step function on :class:`~zmq_rpc.client.llama.batch.BatchedModel`: one slot per
    KV slot, its lanes (micro-batches) kept in flight, tokens sampled on the last worker.

    Each call issues a step for every lane that has none in flight and work to do (every decoding
    sequence of the lane gets one row, then the prompts waiting are fed in chunks into the rows
    left), then waits for the oldest lane step in flight and returns its tokens. So with S lanes
    over S stages, every worker has a lane to compute while the engine hands out the tokens of
    another. A token of a sequence that left its slot meanwhile (cancelled) is dropped: each
    slot's sequence has a generation number, bumped by :meth:`start`."""

    def __init__(self, model: BatchedModel, *, prefill_chunk: int = 32,
                 keep_logits: bool = False) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.slots = model.slots
        self.n_ctx = model.n_ctx
        self.prefill_chunk = prefill_chunk
        self._n_past = [0] * model.slots
        self._generation = [0] * model.slots
        self._seeds: dict[int, int] = {}
        self._in_flight: deque[tuple[int, LaneStep, dict[int, int]]] = deque()
        self.keep_logits = keep_logits
        self.last_logits: dict[int, np.ndarray] = {}
        """With ``keep_logits``: the logits of each token the last step returned (tests)."""

    def add_worker(self, client: Client) -> None:
        self.model.add_worker(client)

    def step_boundary(self) -> None:
        self.model.step_boundary()

    def start(self, slot: int) -> None:
        self._generation[slot] += 1
        self._n_past[slot] = 0
        self._seeds.pop(slot, None)

    def step(self, busy: Mapping[int, Running]) -> dict[int, int]:
        for slot in range(self.slots):
            if slot not in busy:            # its sequence is over: a recovery skips it
                self.model.release(slot)
        flying = {lane for lane, _, _ in self._in_flight}
        for lane in range(self.model.lanes):
            if lane not in flying:
                self._launch(lane, busy)
        if not self._in_flight:
            return {}
        _, step, owners = self._in_flight.popleft()
        tokens, self.last_logits = step.result()
        return {slot: token for slot, token in tokens.items()
                if slot in busy and owners[slot] == self._generation[slot]}

    def _launch(self, lane: int, busy: Mapping[int, Running]) -> None:
        parts = self._plan(lane, busy)
        if not parts:
            return
        step = self.model.launch(lane, parts, logits=self.keep_logits)
        owners = {p.slot: self._generation[p.slot] for p in parts}
        self._in_flight.append((lane, step, owners))

    def _plan(self, lane: int, busy: Mapping[int, Running]) -> list[Rows]:
        """Decode rows first (one per running sequence), then prompt chunks in the rows left."""
        mine = [(slot, busy[slot]) for slot in self.model.lane_slots[lane] if slot in busy]
        parts = [self._rows(slot, seq, [seq.tokens[-1]], True)
                 for slot, seq in mine if not seq.pending and seq.tokens]
        room = self.model.rows - len(parts)
        for slot, seq in mine:
            if not seq.pending or room <= 0:
                continue
            chunk = seq.pending[:min(room, self.prefill_chunk)]
            del seq.pending[:len(chunk)]
            parts.append(self._rows(slot, seq, chunk, not seq.pending))
            room -= len(chunk)
        return parts

    def _rows(self, slot: int, seq: Running, tokens: list[int], sample: bool) -> Rows:
        start = self._n_past[slot]
        self._n_past[slot] += len(tokens)
        if not sample:
            return Rows(slot, tokens, start)
        s = seq.job.sampling
        seed = self._seeds.setdefault(slot, secrets.randbits(32) if s.seed is None else s.seed)
        return Rows(slot, tokens, start, RowSampling(s.temperature, s.top_k, s.top_p, seed,
                                                      len(seq.tokens)))

class Scheduler:
    """The slots and the waiting requests (engine thread; the inbox is the only thing the event
    loop touches, through :meth:`queue.Queue.put_nowait`)."""

    def __init__(self, slots: int, max_queue: int) -> None:
        # Unbounded: the limit is :meth:`has_room`'s, which leaves out the requests headed for
        # free slots (a bounded queue counted them, and refused requests that had a free slot
        # whenever several arrived before the engine thread woke).
        self.inbox: queue.Queue[Stream | None] = queue.Queue()
        self.busy: dict[int, Running] = {}
        self.slots = slots
        self.max_queue = max_queue

    def free_slots(self) -> list[int]:
        return [i for i in range(self.slots) if i not in self.busy]

    def waiting(self) -> int:
        """Requests queued beyond the free slots: those that wait for a slot (any thread)."""
        return max(0, self.inbox.qsize() - (self.slots - len(self.busy)))

    def has_room(self) -> bool:
        """One more request may queue: fewer than ``max_queue`` would wait for a slot."""
        return self.waiting() < self.max_queue

    def next_waiting(self, block: bool) -> Stream | None:
        """The oldest waiting stream that is not cancelled; None when none (blocking: none
        within :data:`IDLE_CHECK_S`), or at a wake-up's None (:meth:`Engine.close`,
        :meth:`Engine.add_worker`)."""
        while True:
            try:
                stream = self.inbox.get(block=block, timeout=IDLE_CHECK_S if block else None)
            except queue.Empty:
                return None
            if stream is None or not stream.cancelled:
                return stream


    def drain(self) -> list[Stream]:
        """Take every waiting stream off the queue (cancelled ones dropped)."""
        streams: list[Stream] = []
        while True:
            try:
                stream = self.inbox.get_nowait()
            except queue.Empty:
                return streams
            if stream is not None and not stream.cancelled:
                streams.append(stream)


class Engine:
    """Runs requests on a :class:`StepFunction` in its own thread; see the module docstring."""

    def __init__(self, steps: StepFunction, tokenizer: Tokenizer, *, max_queue: int,
                 metrics: ServeMetrics) -> None:
        self.steps = steps
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.scheduler = Scheduler(steps.slots, max_queue)
        self.stop_ids = frozenset({tokenizer.eos_id})
        self.problem: str | None = None
        """Why the engine is unhealthy (a worker lost); None while healthy."""
        self._stopping = False
        self._added: list[Client] = []
        """Clients of the workers added at runtime (closed with the engine)."""
        self._thread = threading.Thread(target=self._run, name="zmq-rpc-serve-engine")
        metrics.bind(queue_depth=self.scheduler.waiting, slots_in_use=self.slots_in_use,
                     healthy=lambda: self.healthy)

    # ----------------------------------------------------------------- any thread

    @property
    def healthy(self) -> bool:
        return self.problem is None and self._thread.is_alive()

    def slots_in_use(self) -> int:
        return len(self.scheduler.busy)

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop) -> Stream:
        """Queue ``job``; its :class:`Stream`. APIError 503 when unhealthy, 429 when the queue
        is full."""
        if not self.healthy:
            raise unavailable(self.problem or "the engine is not running")
        if not self.scheduler.has_room():
            raise APIError(429, f"the queue is full ({self.scheduler.max_queue} requests "
                           "waiting); try again later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        stream = Stream(job, loop)
        self.scheduler.inbox.put_nowait(stream)
        return stream

    def start(self) -> None:
        self._thread.start()

    def add_worker(self, client: Client) -> None:
        """Have ``client``'s worker take over layers at the next step boundary (at once when
        idle); the engine closes it when it closes. ValueError as the model's add_worker."""
        self.steps.add_worker(client)
        self._added.append(client)
        self.scheduler.inbox.put_nowait(None)        # wakes an idle engine

    def close(self) -> None:
        """Stop after the current step; the streams still open end with an error. Idempotent."""
        self._stopping = True
        self.scheduler.inbox.put_nowait(None)        # wakes an idle engine
        if self._thread.is_alive():
            self._thread.join()
        for client in self._added:
            client.close()

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._reap()
                if not self._admit():
                    break
                if self.scheduler.busy:
                    self._step()
                elif self.problem is None:
                    self._idle()
        finally:
            self._end_all(unavailable("the server is shutting down"))

    def _admit(self) -> bool:
        """Waiting requests into free slots (waits for one when nothing runs); False at
        shutdown."""
        for slot in self.scheduler.free_slots():
            stream = self.scheduler.next_waiting(block=not self.scheduler.busy)
            if stream is None:
                return not self._stopping
            if self.problem is not None:
                self._end(stream, Event(error=unavailable(self.problem)))
                continue
            self._begin(slot, stream)
        return True

    def _begin(self, slot: int, stream: Stream) -> None:
        job = stream.job
        self.steps.start(slot)
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        self.scheduler.busy[slot] = Running(stream, TextStream(decoder, job.sampling.stop),
                                            list(job.prompt_ids),
                                            np.random.default_rng(job.sampling.seed))

    def _reap(self) -> None:
        """Slots whose reader is gone are free from this step on."""
        for slot, seq in list(self.scheduler.busy.items()):
            if seq.stream.cancelled:
                del self.scheduler.busy[slot]
                self.metrics.finished("cancelled")

    def _step(self) -> None:
        try:
            produced = self.steps.step(self.scheduler.busy)
        except RpcError as exc:
            self._lost(exc)
            return
        except Exception as exc:   # noqa: BLE001 - a bug must end the streams, not the thread
            log.exception("engine step failed")
            self._end_all(APIError(500, f"the step failed: {exc}", type="server_error"))
            return
        now = time.perf_counter()
        for slot, token in produced.items():
            self._deliver(slot, token, now)

    def _idle(self) -> None:
        """Nothing runs: workers that drain leave and added ones join now, not at the next
        request's first step."""
        try:
            self.steps.step_boundary()
        except RpcError as exc:
            self._lost(exc)
        except Exception:   # noqa: BLE001 - a bug must not end the thread
            log.exception("moving workers in or out failed")

    def _deliver(self, slot: int, token: int, now: float) -> None:
        seq = self.scheduler.busy[slot]
        self.metrics.token(now - (seq.last_time or seq.stream.arrived), first=not seq.tokens)
        seq.tokens.append(token)
        seq.last_time = now
        text = "" if token in self.stop_ids else seq.text.push(token)
        finish = self._finish(seq, token)
        if finish is not None:
            text += seq.text.flush()      # what was held back for a stop string that never came
            del self.scheduler.busy[slot]
            self._end(seq.stream, Event(text=text, finish=finish,
                                        completion_tokens=len(seq.tokens)))
        elif text:
            seq.stream.put(Event(text=text))

    def _finish(self, seq: Running, token: int) -> str | None:
        if token in self.stop_ids or seq.text.stopped:
            return "stop"
        if (len(seq.tokens) >= seq.job.sampling.max_tokens
                or len(seq.job.prompt_ids) + len(seq.tokens) > self.steps.n_ctx):
            return "length"
        return None

    def _end(self, stream: Stream, event: Event) -> None:
        # Counted first: a client that has seen its stream end finds it in /metrics.
        self.metrics.finished("error" if event.error is not None else event.finish or "?")
        stream.put(event)

    def _lost(self, exc: RpcError) -> None:
        what = "a worker is gone" if isinstance(exc, (TransportError, ClientClosed)) else \
            "a worker request failed (the model's state on the workers is unknown)"
        self.problem = f"{what}: {type(exc).__name__}: {exc}"
        log.error("%s; the server stops taking requests", self.problem)
        self._end_all(unavailable(self.problem))

    def _end_all(self, error: APIError) -> None:
        for seq in self.scheduler.busy.values():
            self._end(seq.stream, Event(error=error, completion_tokens=len(seq.tokens)))
        self.scheduler.busy.clear()
        for stream in self.scheduler.drain():
            self._end(stream, Event(error=error))


def unavailable(message: str) -> APIError:
    """503: the server cannot run requests (a worker is gone, or it is shutting down)."""
    return APIError(503, message, type="service_unavailable", code="unavailable")
