"""Generating text with a loaded llama: prefill, then decode token by token or chained.

Greedy decoding is chained by default: each step's last stage sends the embedding of its argmax
(``x_next``) straight to the first stage's input as part of its run, and the next step's first run
receives it, so no client round trip sits between two tokens. With ``temperature > 0`` the logits
come back and are sampled here (:func:`~.sampling.sample_token`), one round trip per token.

Runs on the caller's thread (with the :class:`~.runtime.StepRunner` it drives).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from functools import partial
from typing import Protocol, TypeVar

import numpy as np

from ..client import RunResult
from ..peer import HandOff, hand_off
from .plan import need
from .runtime import LOSSES, Recover, Step, StepRunner, StepStat, guarded, recover_from
from .sampling import sample_token

__all__ = ["Boundary", "Generator"]

Stream = Callable[[int], None]
T = TypeVar("T")


class Boundary(Protocol):
    """What a model does between two steps (:class:`~.membership.Membership`: workers that
    leave or join)."""

    def due(self) -> bool:
        """Something to do now (flags only: it is asked before every step)."""
        ...

    def run(self) -> None:
        """Do it; nothing of the model's is in flight."""
        ...


class _AtBoundary(Exception):  # noqa: N818 - a signal between two methods, never raised out
    """The chained decoding stops at a step boundary that has work (:class:`Boundary`)."""


class Generator:
    """Generation on a :class:`~.runtime.StepRunner`'s stages."""

    def __init__(self, runner: StepRunner, eos_id: int) -> None:
        self.runner = runner
        self.eos_id = eos_id
        self.chain_greedy = True
        """Greedy decoding feeds each token back worker to worker (no client round trip per
        token); False decodes one client round trip per token."""
        self.lookahead = 2
        """Chained greedy steps issued ahead of the one being waited for."""
        self.hold_reply = 0.001
        """Seconds each chained step's stage runs let their worker hold the reply (see
        :meth:`Client.run`): nothing waits on those replies right away, and sent at once
        they wake the broker and this process while the activation is in flight; 0 turns
        it off."""
        self.recover: Recover | None = None
        """Called with the error when a step fails on a lost connection: it re-places the lost
        stages and replays the sequence (:mod:`.recovery`), or raises; generation then goes on
        from the next token. None: the error is raised."""
        self.boundary: Boundary | None = None
        """Asked before each step (and after each chained token) whether workers leave or
        join; they do then, with nothing in flight (:mod:`.membership`)."""

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 stream: Stream | None = None,
                 stop_ids: Collection[int] | None = None) -> list[int]:
        """See :meth:`~zmq_rpc.client.llama.LlamaModel.generate`."""
        self.runner.reset()
        if max_new_tokens <= 0:
            return []
        stops = {self.eos_id} if stop_ids is None else set(stop_ids)
        greedy, rng = temperature <= 0, np.random.default_rng(seed)
        fetch = "token" if greedy else "logits"

        def pick(result: RunResult) -> int:
            row = result[0].reshape(-1)
            return int(row[0]) if greedy else sample_token(row, temperature, top_k, top_p, rng)

        run = self.runner.run_chunks
        out = [pick(self._step(partial(run, "prefill", prompt_ids, fetch_each=False,
                                       fetch=fetch))[-1])]
        if greedy and self.chain_greedy:
            self._generate_chained(out, max_new_tokens, stops, stream)
            return out
        for token in self._continue(out, max_new_tokens, stops, stream):
            out.append(pick(self._step(partial(run, "decode", [token], fetch_each=False,
                                               fetch=fetch))[-1]))
        return out

    def _step(self, call: Callable[[], T]) -> T:
        """``call()`` after the step boundary's work, recovering from a lost worker."""
        def at_boundary() -> T:
            self._boundary()
            return call()
        return guarded(at_boundary, self.recover)

    def _boundary(self) -> None:
        if self.boundary is not None and self.boundary.due():
            self.boundary.run()

    def _continue(self, out: list[int], limit: int, stops: set[int],
                  stream: Stream | None) -> Iterator[int]:
        """Stream each new token; yield it back for decoding while generation goes on."""
        while True:
            if stream is not None:
                stream(out[-1])
            if out[-1] in stops or len(out) >= limit or self._full():
                return
            yield out[-1]

    def _full(self) -> bool:
        return self.runner.cache.n_past >= self.runner.cache.n_ctx

    def _generate_chained(self, out: list[int], limit: int, stops: set[int],
                          stream: Stream | None) -> None:
        """Stream the prompt's token, then decode chained; after a recovery, or workers that
        left or joined at a step boundary, the chain starts again from the last token, which
        the client embeds (the prompt's hand-off is gone)."""
        if stream is not None:
            stream(out[-1])
        if out[-1] in stops or len(out) >= limit:
            return
        restart: int | None = None
        while True:
            try:
                self._decode_chained(out, limit, stops, stream, restart)
                return
            except LOSSES as exc:
                recover_from(exc, self.recover)
                restart = out[-1]
            except _AtBoundary:
                guarded(self._boundary, self.recover)
                restart = out[-1]

    def _decode_chained(self, out: list[int], limit: int, stops: set[int],
                        stream: Stream | None, restart: int | None) -> None:
        """Greedy decoding with the token fed back worker to worker, ``lookahead`` steps ahead.

        The workers' queues order it all, so a step is one request per stage. The client streams
        each token as its step reports it and stops issuing at a stop token; steps already issued
        past it only write cache rows beyond the end, which later steps overwrite before reading.
        ``restart``: the token the first step embeds here (None: the prompt's argmax, handed
        over by the last worker).
        """
        cache = self.runner.cache
        pending: deque[Step] = deque()
        newest: Step | None = None
        carried: HandOff | None = None
        last_arrival = time.perf_counter()
        try:
            while True:
                while (len(pending) < self.lookahead and len(out) + len(pending) < limit
                       and cache.n_past + len(pending) < cache.n_ctx):
                    newest, carried = self._launch_chained(cache.n_past + len(pending), carried,
                                                           restart)
                    pending.append(newest)
                if not pending:
                    return
                step = pending.popleft()
                token = int(self.runner.wait([step])[0][0].reshape(-1)[0])
                now = time.perf_counter()
                self.runner.stats.append(StepStat("decode", 1, now - last_arrival,
                                                  step.messages, step.compute()))
                last_arrival = now
                cache.n_past += 1
                cache.record("decode", [out[-1]])     # the token this step consumed
                out.append(token)
                if stream is not None:
                    stream(token)
                if token in stops or len(out) >= limit or self._full():
                    return
                if self.boundary is not None and self.boundary.due():
                    raise _AtBoundary
        finally:
            self._finish_chain(pending, newest, carried)

    def _launch_chained(self, start: int, carried: HandOff | None,
                        restart: int | None) -> tuple[Step, HandOff]:
        """Issue one chained step at position ``start``; returns it and the hand-off of its
        argmax embedding, which the next step receives."""
        first, last = self.runner.stages[0], self.runner.stages[-1]
        x_in = need(first.io["decode"].x_in)
        following = hand_off(need(last.io["decode"].x_next), x_in)
        if carried is None and restart is not None:
            step = self.runner.launch("decode", [restart], start, "token", send=following,
                                      hold_reply=self.hold_reply)
            return step, following
        before = []
        if carried is None:                 # the prompt's argmax: its run has been issued
            prompt = need(last.io["prefill"].x_next)
            before.append((prompt.client.copy_tensor_async(prompt, x_in),
                           1 if last.client is first.client else 2))
        step = self.runner.launch("decode", None, start, "token", receive=carried,
                                  send=following, hold_reply=self.hold_reply, before=before)
        return step, following

    def _finish_chain(self, pending: deque[Step], newest: Step | None,
                      carried: HandOff | None) -> None:
        """Let the steps already issued finish (results unused), then land the newest one's
        hand-off, which no step receives (when that step failed it may never come: the
        worker drops an unclaimed transfer after a while)."""
        for step in pending:
            step.future.exception()
        if newest is not None and carried is not None and newest.future.exception() is None:
            self.runner.stages[0].client.receive_async(carried).exception()
