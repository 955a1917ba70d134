"""Synchronous calls driven on the caller's own thread: the caller that found the connection idle
sends its requests and reads their replies itself (no hop through the I/O thread), still
watching the monitor, the deadlines and the wake-up socket (close, and other threads' requests,
which it sends too).

Threads: the calling thread, while it holds ``Engine._socket_lock`` (taken by
``Engine._take_idle``); it marks itself with ``io_thread.active`` meanwhile, so that a future
callback it runs knows not to block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import zmq
from zmq import zmq_poll

from ..broker.errors import ClientClosed
from .calls import Call, all_done, fail_call
from .io_loop import IoLoop, io_thread

TOGETHER_GRACE_S = 0.5
"""How long :func:`pump_together` still reads the replies of its other requests once its
future has succeeded (a copy's source worker answers a moment after the bytes landed): the
connections are then idle for the caller's next request. Past it (or at once when the future
failed) the I/O threads read them."""


def exchange(io: IoLoop, call: Call) -> None:
    """Send a synchronous caller's ``call`` (nothing ahead of it) and drive the connection
    on this thread until it is settled. The call's deadline stays out of the shared heap
    (this loop watches it) unless the caller leaves early (an exception)."""
    if io.link.down:
        fail_call(call, io.link.refusal())
        return
    io.send(call, io.engine.options.trace)
    io.link.last_sent = time.monotonic()
    try:
        _await(io, call)
    finally:
        if not call.settled:        # the I/O thread times it out from now on
            io.deadlines.watch(call)


def _await(io: IoLoop, call: Call) -> None:
    engine, items, dealer, calls = io.engine, io.poll_items, io.dealer, [call]
    io_thread.active = True
    try:
        while True:
            engine._pump_sleeping = True
            timeout = io.poll_timeout_ms(call.deadline) if engine._inbox.empty() else 0
            events = zmq_poll(items, timeout)
            engine._pump_sleeping = False
            if len(events) == 1 and events[0][0] is dealer:   # the usual: its reply
                _take_one(io, dealer)
                if call.settled and not io.blocked_readers:
                    return
                io.receive(calls)
                if all_done(calls):
                    return
                events = []         # then the round's chores (timeouts, new requests)
            if not io.handle(dict(events), calls):
                fail_call(call, ClientClosed("the client was closed"))
                return
            if all_done(calls):
                return
            if call.deadline <= time.monotonic():
                io.expire_call(call)
                return
    finally:
        io_thread.active = False


def _take_one(io: IoLoop, dealer: zmq.Socket[bytes]) -> None:
    """Read the message that poll said is in."""
    frame = dealer.recv(zmq.NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:
        frame = dealer.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame)
    io._on_reply(frames)


def pump(io: IoLoop, calls: list[Call]) -> None:
    """An inline caller drives the connection until its ``calls`` are done; it also sends
    what other threads submit meanwhile (its calls may wait on theirs)."""
    engine, items = io.engine, io.poll_items
    io_thread.active = True
    try:
        while not all_done(calls):
            engine._pump_sleeping = True
            timeout = 0 if not engine._inbox.empty() else io.poll_timeout_ms()
            events = dict(zmq_poll(items, timeout))
            engine._pump_sleeping = False
            if not io.handle(events, calls):
                for call in calls:
                    fail_call(call, ClientClosed("the client was closed"))
                return
    finally:
        io_thread.active = False


def pump_together(loops: Sequence[IoLoop], future: Future[Any], calls: list[Call]) -> None:
    """:func:`pump` over several connections until every call sent here is done, or
    ``future`` failed, or it succeeded TOGETHER_GRACE_S ago (what is still due is then the I/O
    threads', woken as the connections are given back)."""
    poller = zmq.Poller()
    owner: dict[Any, IoLoop] = {}
    for io in loops:
        for sock in (io.dealer, io.monitor, io.wake_fd):
            poller.register(sock, zmq.POLLIN)
            owner[sock] = io
    io_thread.active = True
    try:
        settled = 0.0
        while not all(c.settled for c in calls):
            if future.done():
                if future.exception() is not None:
                    return
                settled = settled or time.monotonic()
                if time.monotonic() - settled > TOGETHER_GRACE_S:
                    return
            for io in loops:
                io.engine._pump_sleeping = True
            waiting = any(not io.engine._inbox.empty() for io in loops)
            timeout = 0 if waiting else min(io.poll_timeout_ms() for io in loops)
            if settled:
                timeout = min(timeout, int(TOGETHER_GRACE_S * 1000) + 1)
            events = dict(poller.poll(timeout))
            for io in loops:
                io.engine._pump_sleeping = False
            for io in loops:
                if not io.handle({s: e for s, e in events.items() if owner[s] is io}):
                    for call in calls:
                        fail_call(call, ClientClosed("the client was closed"))
                    return
    finally:
        io_thread.active = False
