"""Workers joining and leaving a running model on purpose, at its step boundaries.

**Leaving (draining).** A worker sent SIGTERM with ``--drain-timeout`` keeps serving and says
so in its replies (protocol 1.14: ``Client.draining``, learned from any reply, the idle heartbeat's
too). At its next step boundary the model moves every stage of that worker off it exactly as a
recovery re-places a lost worker's (:meth:`.recovery.Recoverer.replace`: onto the first spare with
the memory, else the survivor with the most free memory; weights from the target's own file, its
cache, else an upload; KV cache and graphs made anew), replays its sequences into the caches as a
recovery does (the same bits: greedy output unchanged), then closes its client: its session ends,
and the worker, which waits for its last session, exits at once. No step fails: the old stages
answer every step issued before the boundary. A drain whose layers fit nowhere is logged and left
alone (the worker leaves at its timeout and the model's recovery then says what would fit).

**Joining.** :meth:`Membership.add` queues a worker; at the next step boundary the stage with the
most layers is split in two, balanced by bytes (:func:`.plan.split_stage`): its first layers stay
on its worker, reloaded as a stage of their own, the rest (and the head, for the last stage) go to
the newcomer, then the old stage is freed and the sequences replayed. Why split rather than move a
whole stage: moving one worker's stage to the newcomer only swaps who holds it, while a split
spreads the largest share over one more worker (less memory per worker, a deeper pipeline for
lanes to fill). The split worker holds its old stage and its new half at once while the half
loads (about 1.5x its share): a join that fails (out of memory) frees what it placed, is logged,
and the model goes on as it was.

Each is reported as a :class:`~.recovery.Recovery` of kind ``"drained"`` or ``"joined"`` (to
``on_recovery`` and the log). Runs on the model's thread, between steps (nothing in flight);
:meth:`Membership.add` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ...broker.errors import RecoveryFailed, RemoteError, RpcError
from ..client import Client
from .plan import Stage, split_stage
from .recovery import Move, Recoverer, Recovery
from .runtime import free_stages

__all__ = ["Membership"]

log = logging.getLogger("zmq_rpc.client.llama")


class Membership:
    """The workers joining and leaving one model (its :class:`~.recovery.Recoverer` places
    their stages)."""

    def __init__(self, recoverer: Recoverer) -> None:
        self.recoverer = recoverer
        self.joining: deque[Client] = deque()
        """Workers added and not yet placed (any thread appends, the model's thread takes;
        both under :attr:`_lock`)."""
        self._lock = threading.Lock()
        self.stuck: set[int] = set()
        """Draining workers whose stages fit nowhere else (by id): left to leave."""

    @property
    def stages(self) -> list[Stage]:
        return self.recoverer.target.stages

    def add(self, client: Client) -> None:
        """Queue ``client`` to take over layers at the next step boundary."""
        if client.closed:
            raise ValueError(f"the client of {client.endpoint} is closed")
        capability = self.recoverer.fmt.capability
        if capability and capability not in client.info.capabilities:
            raise ValueError(f"worker {client.endpoint} lacks {capability!r}, which this "
                             f"model's weights need")
        with self._lock:
            if any(s.client is client for s in self.stages) or client in self.joining:
                raise ValueError(f"worker {client.endpoint} already runs a stage of this model")
            self.joining.append(client)

    def leaving(self) -> list[Client]:
        """The model's workers that said they are leaving (not those stuck)."""
        clients = {id(s.client): s.client for s in self.stages}
        return [c for key, c in clients.items() if c.draining and key not in self.stuck]

    def due(self) -> bool:
        """Something to do at this step boundary (cheap: flags only, no request)."""
        return bool(self.joining) or bool(self.leaving())

    def run(self) -> None:
        """Move off every draining worker, then place every worker that joined."""
        for client in self.leaving():
            self.leave(client)
        while (newcomer := self._next_joining()) is not None:
            self.join(newcomer)

    def _next_joining(self) -> Client | None:
        with self._lock:
            return self.joining.popleft() if self.joining else None

    # ---------------------------------------------------------------------------- leaving

    def leave(self, client: Client) -> Recovery | None:
        """Move ``client``'s stages off it, replay, close it; None when they fit nowhere."""
        start = time.monotonic()
        cause = f"worker {client.endpoint} is draining"
        stages = [s for s in self.stages if s.client is client]
        recoverer = self.recoverer
        recoverer.lost.append(client)
        try:
            moves = recoverer.replace(stages, cause)
        except RecoveryFailed as exc:
            recoverer.lost.remove(client)
            self.stuck.add(id(client))
            log.error("cannot move off draining worker %s (it leaves at its --drain-timeout, "
                      "then a recovery is tried): %s", client.endpoint, exc)
            return None
        loaded = time.monotonic()
        tokens = recoverer.target.replay(as_fed=not recoverer.invariant)
        done = time.monotonic()
        _close_after_replies(client)
        recovery = Recovery(cause, tuple(moves), start, 0.0, loaded - start, done - loaded,
                            tokens, not recoverer.invariant, kind="drained")
        recoverer.report(recovery)
        return recovery

    # ---------------------------------------------------------------------------- joining

    def join(self, client: Client) -> Recovery | None:
        """Split the stage with the most layers with ``client``; None when it could not be
        placed (logged; the model is as it was)."""
        if client.closed or client.draining:
            log.warning("worker %s left before it could join", client.endpoint)
            return None
        start = time.monotonic()
        old = max(self.stages, key=lambda s: len(s.layers))
        recoverer = self.recoverer
        try:
            lower, upper = split_stage(recoverer.gguf, recoverer.fmt, old, client)
        except ValueError as exc:
            log.error("worker %s could not join: %s", client.endpoint, exc)
            return None
        try:
            sources = recoverer.load([lower, upper], [old, old])
        except RemoteError as exc:
            free_stages([lower, upper])
            log.error("worker %s could not join (the model goes on as it was): %s",
                      client.endpoint, exc)
            return None
        at = self.stages.index(old)
        self.stages[at:at + 1] = [lower, upper]
        for index, stage in enumerate(self.stages):
            stage.index = index
        free_stages([old])
        loaded = time.monotonic()
        tokens = recoverer.target.replay(as_fed=not recoverer.invariant)
        done = time.monotonic()
        moves = tuple(Move(old.client.endpoint, s.layers, s.client.endpoint, False, src)
                      for s, src in zip((lower, upper), sources))
        recovery = Recovery(f"worker {client.endpoint} added", moves, start, 0.0,
                            loaded - start, done - loaded, tokens, not recoverer.invariant,
                            kind="joined")
        recoverer.report(recovery)
        return recovery


def _close_after_replies(client: Client) -> None:
    """Close ``client`` once every request sent on it has been answered (a cache clear queued
    before the move must not fail with ``ClientClosed``): its session ends, and the draining
    worker exits."""
    try:
        client.synchronize()
    except RpcError as exc:     # leaving anyway: nothing of the model's is there any more
        log.debug("draining worker %s: %s", client.endpoint, exc)
    client.close()
