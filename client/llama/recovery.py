"""Recovering a split model from a lost worker: its layers re-placed, the sequence replayed.

When a step fails as a lost worker fails it (:data:`.runtime.LOSSES`: the worker's own
``ConnectionLost``, or a ``TransferError`` from a worker whose hand-off from it never came),
:meth:`Recoverer.recover` makes the model whole again and the caller retries the step:

1. **detection**: every worker of the model is pinged; those whose ping fails with a
   ``TransportError`` are lost (a dead process fails at once, a frozen one within the heartbeat
   bound of docs/FAILURES.md, 6 s). A worker whose connection is down is given
   :data:`RETURN_GRACE_S` to come back (zmq reconnects every 0.1 s), unless its address
   refuses the reconnection (``Client.reconnect_refused``: no process listens there, it was
   killed), which makes it lost at once: one that answers within the grace
   with its session is **slow, not lost** (its host starved it past the heartbeat; its
   stage's weights and KV cache are still there), and the failed step is simply issued again,
   nothing re-placed or replayed, at most :data:`MAX_RETURNS` times in a row (no step done in
   between); past that it is taken for lost. When none is lost and none came back (two live
   workers that cannot reach each other: ``PeerUnreachable``), the error is raised as it was:
   nothing here can mend a link.
2. **re-placement**: each stage of a lost worker moves whole (its layers, its place in the
   pipeline) to the first spare with the memory for it, else to the surviving worker with the
   most free memory, if that is enough (it then runs two stages; the hand-off between them is
   a copy on that worker). Its weights come as at load, in the same order of sources (the
   worker's own file from ``--model-dir``, its ``--cache-dir``, else an upload); its KV cache
   and graphs are made as at load. What it needs is the lost stage's own buffers (weights, KV,
   step tensors) plus the staging buffer its file ranges pass through; when no worker has that
   free, :class:`~zmq_rpc.client.RecoveryFailed` says what each would hold.
3. **re-prefill**: the sequences the model kept are replayed into the caches, and greedy
   decoding goes on with the token the fault-free run would have picked: as prefill chunks when
   every product of the model is batch-invariant (a row's products the same bits in a chunk as
   in a decode step: the integer kernels of every quantized block type; every model in
   :class:`~.batch.BatchedModel`, whose step sizes are chosen so), else exactly as it was fed
   (the prompt's prefill chunks, then one decode step per decoded token, all issued at once:
   several times slower), which gives back the fault-free run's bits. As chunks, a decoded
   token's attention is the chunk's matmul / soft_max composition, not a step's fused kernel:
   its cache rows come back within rounding of the fault-free run's, not bit for bit.

What is mended is a :class:`Recoverable`: :class:`~.runtime.StepRunner` (one sequence, its
tokens in :attr:`.runtime.KVCache.fed`; the failed step is then issued again by
:func:`~.runtime.guarded`) or :class:`~.batch.BatchedModel` (a sequence per KV slot, each
slot's tokens kept as its lane steps are launched; the lane steps in flight are then issued
again in their order, so no token is lost or repeated).

Each recovery is reported as a :class:`Recovery` (to ``on_recovery``, and logged): which worker
was lost, which layers went where, and its three costs, measured. Not recovered: a model on one
worker with no spare (nothing survives to re-place onto); a partition between live workers; a
worker lost while the model loads (the load fails as before). A worker that comes back is not
taken back (its session, if it still has one, expires on its own).

Runs on the caller's thread; it blocks on the requests' futures only.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from ...broker.errors import (
    ConnectionLost,
    RecoveryFailed,
    RemoteError,
    RpcError,
    SessionLost,
    TransportError,
)
from ...worker.kernels import INVARIANT_INTEGER
from ..client import Client, MemoryInfo
from ..gguf_model import LlamaGGUF
from ..peer import call_off_again
from .graph import Registrations, StageGraphs
from .load import WeightLoader, staging_places
from .plan import Stage, stage_sources
from .source import StageSource, WeightSource
from .weights import MATMUL_QTYPES, WeightFormat

__all__ = ["MAX_RETURNS", "RETURN_GRACE_S", "Move", "OnRecovery", "Recoverable", "Recoverer",
           "Recovery"]

log = logging.getLogger("zmq_rpc.client.llama")

MiB = 1 << 20

RETURN_GRACE_S = 1.0
"""How long a worker whose connection dropped is given to come back before it is taken for lost:
a worker its host starved past the heartbeat (5 s) reconnects within 0.1 s of running again
(zmq's reconnect interval) plus its handshake. It adds to the detection of a worker truly lost
(a killed one: at once + this; a frozen one: the heartbeat bound + this)."""
MAX_RETURNS = 3
"""Times in a row (no step completed in between) a step is issued again because workers came
back; the next drop takes them for lost and re-places them (a worker that keeps dropping costs
a heartbeat timeout per try)."""
RETURN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Move:
    """One stage of a lost worker, and where it went."""

    lost: str
    """The endpoint of the worker the layers left (lost, drained, or split for a newcomer)."""
    layers: range
    onto: str
    spare: bool
    """Whether ``onto`` was a spare (else a surviving worker, which now runs two stages)."""
    source: StageSource
    """How its weights got there (the worker's file, its cache, an upload)."""

    def describe(self) -> str:
        kind = "spare" if self.spare else "survivor" if self.onto != self.lost else "kept"
        return (f"layers {self.layers.start}-{self.layers.stop - 1} of {self.lost} onto "
                f"{self.onto} ({kind}, weights from its {self.source.source}"
                f"{'' if self.source.source == 'file' else ' and'}"
                f"{f' {self.source.wire_bytes / MiB:.1f} MiB sent' if self.source.wire_bytes else ''})")


@dataclass(frozen=True, slots=True)
class Recovery:
    """One recovery: what was lost, what moved where, and what each part took."""

    cause: str
    """The error that revealed the loss (``ConnectionLost: ...``)."""
    moves: tuple[Move, ...]
    failed_at: float
    """``time.monotonic()`` when the failed step's error reached the model."""
    detect_seconds: float
    """From the error to the lost workers told apart from the live ones (their pings)."""
    load_seconds: float
    """Placing the moved stages: kernels, weights, KV cache, graphs."""
    prefill_seconds: float
    """Replaying the sequence into the caches."""
    tokens: int
    """Tokens replayed."""
    as_fed: bool = False
    """Replayed as it was fed (a decode step per decoded token), not as prefill chunks."""
    returned: tuple[str, ...] = ()
    """Workers whose connection dropped and came back with their session (slow, not lost):
    nothing of theirs moved; with no ``moves`` the failed step was just issued again."""
    kind: str = "lost"
    """``"lost"`` (a worker failed a step), ``"drained"`` (a worker said it is leaving: its
    stages moved off it at a step boundary, nothing failed) or ``"joined"`` (a worker added
    to the model took over layers at a step boundary): :mod:`.membership`."""

    @property
    def total_seconds(self) -> float:
        return self.detect_seconds + self.load_seconds + self.prefill_seconds

    def describe(self) -> str:
        """``worker tcp://a lost (ConnectionLost: ...): re-placed layers 10-19 of ... in 1.2 s
        (detection 0.01 s, load 0.9 s, re-prefill of 70 tokens 0.3 s)``."""
        if self.kind != "lost":
            return self._describe_planned()
        if not self.moves:
            return (f"worker {', '.join(self.returned)} dropped its connection and came back "
                    f"with its session ({self.cause}): the step is issued again, nothing "
                    f"re-placed (detection {self.detect_seconds:.2f} s)")
        lost = ", ".join(sorted({m.lost for m in self.moves}))
        return (f"worker {lost} lost ({self.cause}): re-placed "
                f"{'; '.join(m.describe() for m in self.moves)} in {self.total_seconds:.2f} s "
                f"(detection {self.detect_seconds:.2f} s, load {self.load_seconds:.2f} s, "
                f"re-prefill of {self.tokens} tokens {'as fed' if self.as_fed else 'in chunks'} "
                f"{self.prefill_seconds:.2f} s)")


    def _describe_planned(self) -> str:
        """``worker tcp://a drained (...): moved layers 10-19 ... in 1.2 s (load 0.9 s,
        re-prefill of 70 tokens 0.3 s)``, or the same for a worker that joined."""
        who = (sorted({m.lost for m in self.moves}) if self.kind == "drained"
               else sorted({m.onto for m in self.moves} - {m.lost for m in self.moves}))
        verb = "drained (left on purpose)" if self.kind == "drained" else "joined"
        return (f"worker {', '.join(who)} {verb} ({self.cause}): moved "
                f"{'; '.join(m.describe() for m in self.moves)} at a step boundary in "
                f"{self.total_seconds:.2f} s (load {self.load_seconds:.2f} s, re-prefill of "
                f"{self.tokens} tokens {'as fed' if self.as_fed else 'in chunks'} "
                f"{self.prefill_seconds:.2f} s)")


OnRecovery = Callable[[Recovery], None]
"""``on_recovery(recovery)``: called after each recovery, before generation goes on."""


class Recoverable(Protocol):
    """What a recovery mends: a model's stages and the sequences in its caches. The
    one-sequence :class:`~.runtime.StepRunner` (of :class:`~.model.LlamaModel`) and the
    continuous-batching :class:`~.batch.BatchedModel` implement it."""

    stages: list[Stage]
    """The pipeline's stages in order; a recovery puts each moved stage in its lost one's place."""

    def steps_done(self) -> int:
        """Steps completed so far (a come-back counts as one in a row while this stays put)."""
        ...

    def allocate_kv(self, stage: Stage) -> None:
        """Place ``stage``'s KV cache on its worker, as at load (issued, not waited for)."""
        ...

    def register_stage(self, stage: Stage, like: Stage) -> Registrations:
        """Build and issue the registration of every graph ``stage`` needs, those the lost
        ``like`` had (its step tensors made anew); :meth:`StageGraphs.collect` waits."""
        ...

    def replay(self, *, as_fed: bool) -> int:
        """Refill the caches with every live sequence's tokens so far (``as_fed``: in the
        modes and chunks it was fed; else as prefill chunks); the tokens replayed."""
        ...


class Recoverer:
    """Re-places a model's lost stages (onto ``spares`` first) and replays its sequences."""

    def __init__(self, gguf: LlamaGGUF, fmt: WeightFormat, source: WeightSource,
                 target: Recoverable, spares: Sequence[Client] = (),
                 on_recovery: OnRecovery | None = None, *, invariant: bool | None = None) -> None:
        self.gguf = gguf
        self.fmt = fmt
        self.source = source
        self.target = target
        self.spares = list(spares)
        self.on_recovery = on_recovery
        self.invariant = invariant if invariant is not None else (
            fmt.mode == "quantized" and all(t.qtype in INVARIANT_INTEGER for t in
                                            gguf.tensors.values() if t.qtype in MATMUL_QTYPES))
        """Every product of the model gives a row the same bits in a prefill chunk as in a decode
        step (the integer kernels of Q4_0, Q4_1, Q8_0 on every CPU path; any model of the
        batched model's step graphs, whose sizes are chosen so): the sequences are replayed as
        prefill chunks; else as they were fed (one decode step per decoded token)."""
        self.lost: list[Client] = []
        """Workers given up on (never used again by this model)."""
        self.recoveries: list[Recovery] = []
        self.max_returns = MAX_RETURNS
        self.return_grace = RETURN_GRACE_S
        self._returns = (0, -1)
        """Come-backs in a row, and the model's completed steps at the last one."""

    # ----------------------------------------------------------------------------- recovery

    def recover(self, error: RpcError) -> None:
        """Make the model whole after ``error`` (see the module docstring), or raise: the error
        itself when no worker is lost or came back, :class:`RecoveryFailed` when the layers fit
        nowhere."""
        failed_at = time.monotonic()
        lost, back = self._find_lost(error)
        detected = time.monotonic()
        cause = f"{type(error).__name__}: {error}"
        if not lost and back and self._may_return():
            self._report(Recovery(cause, (), failed_at, detected - failed_at, 0.0, 0.0, 0,
                                  returned=tuple(c.endpoint for c in back)))
            return
        lost += back
        if not lost:
            raise error
        self.lost += lost
        try:
            moves = self._replace([s for s in self.target.stages if s.client in lost], cause)
        except RecoveryFailed as exc:
            if exc.__cause__ is None:
                raise exc from error
            raise
        loaded = time.monotonic()
        tokens = self.target.replay(as_fed=not self.invariant)
        done = time.monotonic()
        self._report(Recovery(cause, tuple(moves), failed_at, detected - failed_at,
                              loaded - detected, done - loaded, tokens, not self.invariant))

    def report(self, recovery: Recovery) -> None:
        """Keep, log and tell ``on_recovery`` of ``recovery`` (a drain's and a join's too)."""
        self._report(recovery)

    def replace(self, stages: list[Stage], cause: str) -> list[Move]:
        """Re-make ``stages`` on spares or survivors, as a recovery does (their workers must
        already be in :attr:`lost`): see :meth:`_replace`."""
        return self._replace(stages, cause)

    def load(self, stages: list[Stage], like: list[Stage]) -> list[StageSource]:
        """Place ``stages`` (weights, KV cache, graphs like ``like``'s), as a recovery does."""
        return self._load(stages, like)

    def _report(self, recovery: Recovery) -> None:
        self.recoveries.append(recovery)
        log.warning("%s", recovery.describe())
        if self.on_recovery is not None:
            self.on_recovery(recovery)

    def _may_return(self) -> bool:
        """Count a come-back; False past :attr:`max_returns` in a row (no step done since)."""
        done = self.target.steps_done()
        count = self._returns[0] + 1 if done == self._returns[1] else 1
        self._returns = (count, done)
        return count <= self.max_returns

    def _find_lost(self, error: RpcError) -> tuple[list[Client], list[Client]]:
        """The model's workers that are lost, and those that came back: all are pinged at
        once; one whose connection is down is pinged again until it answers (back) or
        :attr:`return_grace` passes (lost); one that forgot our session is lost. A ping queued
        behind the failed step's transfers may fail with them (a ``TransferError``: the worker
        answered): those are pinged once more, behind the failure now. When every ping
        answered at once but ``error`` was a dropped connection, it came back before the pings:
        the worker it names is back."""
        clients = list({id(s.client): s.client for s in self.target.stages}.values())
        for client in clients:      # a connection back before the pings: its stale receives
            call_off_again(client)
        errors = self._ping(clients)
        errors.update(self._ping([c for c in clients if _answered(errors[id(c)])]))
        down = [c for c in clients if isinstance(errors[id(c)], TransportError)]
        lost = [c for c in down if isinstance(errors[id(c)], SessionLost)]
        back = self._await_return([c for c in down if c not in lost])
        lost += [c for c in down if c not in lost and c not in back]
        if not down and type(error) is ConnectionLost:
            back = [c for c in clients if _names(error, c.endpoint)][:1]
        return lost, back

    @staticmethod
    def _ping(clients: Sequence[Client]) -> dict[int, BaseException | None]:
        pings = [(c, c.ping_async()) for c in clients]
        return {id(c): ping.exception() for c, ping in pings}

    def _await_return(self, down: list[Client]) -> list[Client]:
        """Those of ``down`` whose ping is answered within :attr:`return_grace` (their session
        kept: a worker restarted meanwhile answers ``SessionLost``, and is lost)."""
        back: list[Client] = []
        deadline = time.monotonic() + self.return_grace
        while down and time.monotonic() < deadline:
            down = [c for c in down if not c.reconnect_refused]   # nothing listens: lost now
            if not down:
                break
            time.sleep(RETURN_POLL_S)   # zmq reconnects on its own; nothing to wait on but time
            for client in down:         # the stale runs' receives, released before the ping
                call_off_again(client)
            errors = self._ping(down)
            back += [c for c in down if errors[id(c)] is None]
            down = [c for c in down if not isinstance(errors[id(c)], SessionLost)
                    and errors[id(c)] is not None]
        return back

    def _replace(self, stages: list[Stage], cause: str) -> list[Move]:
        """Each of ``stages`` re-made on a spare or a survivor, its weights, KV cache and graphs
        in place; they take their places in the model's stage list."""
        new: list[Stage] = []
        for stage in stages:
            target = self._target(stage, cause, new)
            new.append(Stage(stage.index, target, stage.layers, stage.first, stage.last))
        try:
            sources = self._load(new, stages)
        except RemoteError as exc:
            raise RecoveryFailed(f"lost a worker ({cause}); placing its layers again failed: "
                                 f"{exc}") from exc
        for old, stage in zip(stages, new):
            self.target.stages[self.target.stages.index(old)] = stage
        return [Move(old.client.endpoint, old.layers, s.client.endpoint, s.client in self.spares,
                     src) for old, s, src in zip(stages, new, sources)]

    def _load(self, stages: list[Stage], lost: list[Stage]) -> list[StageSource]:
        """As :meth:`LlamaModel.load` does it, for ``stages`` only (each in a ``lost`` one's
        place)."""
        pending = WeightLoader(self.gguf, self.fmt, self.source).start(stages)
        for stage in stages:
            self.target.allocate_kv(stage)
        pending.wait_fills()
        registrations: Registrations = {}
        for stage, like in zip(stages, lost):
            registrations.update(self.target.register_stage(stage, like))
        pending.wait_builds()
        StageGraphs.collect(registrations)
        return pending.sources

    # ---------------------------------------------------------------------------- placement

    def need_bytes(self, stage: Stage) -> int:
        """Bytes a worker needs free to take ``stage`` over: what the stage held (weights, KV
        cache, step tensors) plus the staging buffer its file ranges pass through."""
        held = sum(b.size for b in stage.buffers)
        held += stage.kv_buffer.size if stage.kv_buffer is not None else 0
        return held + staging_places(self.gguf, stage_sources(self.gguf, stage))[1]

    def _target(self, stage: Stage, cause: str, placed: list[Stage]) -> Client:
        """The first spare with the memory for ``stage``, else the survivor with the most free
        memory if it is enough; else :class:`RecoveryFailed` saying what would fit."""
        need = self.need_bytes(stage)
        survivors = list({id(s.client): s.client for s in self.target.stages
                          if s.client not in self.lost}.values())
        spares = [c for c in self.spares if c not in self.lost and c not in survivors]
        free = {key: MemoryInfo(m.free - sum(self.need_bytes(s) for s in placed
                                             if id(s.client) == key), m.total)
                for key, m in _free_memory([*spares, *survivors]).items()}
        room = {id(c): free[id(c)].free if id(c) in free else -1 for c in spares + survivors}
        for client in spares + sorted(survivors, key=lambda c: -room[id(c)]):
            if self._usable(client) and room[id(client)] >= need:
                return client
        raise RecoveryFailed(self._no_room(stage, cause, need, free, spares + survivors))

    def _usable(self, client: Client) -> bool:
        """Has what the weights format needs, and is not leaving."""
        return (not self.fmt.capability or self.fmt.capability in client.info.capabilities) \
            and not client.draining

    def _no_room(self, stage: Stage, cause: str, need: int, free: dict[int, MemoryInfo],
                 clients: list[Client]) -> str:
        """What the lost layers need and what each worker could hold of them."""
        layers = len(stage.layers)
        lines = []
        for c in clients:
            room = free.get(id(c), MemoryInfo(0, 0)).free
            fits = min(layers, int(layers * room / max(need, 1)))
            lines.append(f"{c.endpoint} has {room / MiB:.0f} MiB free (about {fits} of those "
                         f"layers)" + ("" if self._usable(c) else f", lacks {self.fmt.capability}"))
        where = "; ".join(lines) or "no worker is left"
        return (f"worker {stage.client.endpoint} lost ({cause}) and its layers "
                f"{stage.layers.start}-{stage.layers.stop - 1} fit on no other worker: they need "
                f"{need / MiB:.0f} MiB free on one ({where}). Pass a worker with --mem >= "
                f"{-(-need // MiB) + 1} MiB as a spare (spares=[...] of LlamaModel.load or "
                f"BatchedModel.load, zmq-rpc-serve --spares), or "
                f"load with a smaller n_ctx.")


def _answered(error: BaseException | None) -> bool:
    """A ping that failed with the failed step's transfers (the worker answered it)."""
    return error is not None and not isinstance(error, TransportError)


def _names(error: RpcError, endpoint: str) -> bool:
    """``error``'s message names ``endpoint`` (not just a longer port that starts alike)."""
    return re.search(re.escape(endpoint) + r"(?![\w.:])", str(error)) is not None


def _free_memory(clients: Sequence[Client]) -> dict[int, MemoryInfo]:
    """Each reachable client's memory (by id); a client that cannot answer is left out."""
    asked: list[tuple[Client, Future[MemoryInfo]]] = [(c, c.device_memory_async())
                                                      for c in clients]
    return {id(c): f.result() for c, f in asked if f.exception() is None}
