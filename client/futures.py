"""Combinators for ``concurrent.futures.Future``: the one place the client composes futures.

No thread of its own: every function here attaches done-callbacks, which run on whichever thread
resolves the parts (usually a client I/O thread, so they never block). Each returned future is
already running (``set_running_or_notify_cancel``) and is settled exactly once: never cancelled,
never left pending while a part is pending forever (the engine resolves every part in bounded time).

- :func:`resolved` / :func:`failed`: a future that is already done.
- :func:`then`: ``fn(result)`` of one future (its error passes through).
- :func:`all_of`: waits for every part; the first error in issue order, else ``result()``. For the
  chunks of one transfer, whose buffers must not be reused while any chunk is still on its way.
- :func:`first_error`: fails as soon as any part fails, else ``result()`` once all have succeeded.
  For the halves of a copy or a linked run: a dead worker fails the whole at once.
- :class:`Steps` / :func:`settled_by`: parts (added over time); fails with the first error, or
  settles with the final part's result as soon as that part is done (the parts before it need not
  be waited for).
- :func:`forward`: settle one future like another.
"""

from __future__ import annotations

import threading
from _thread import RLock as _RLock
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, RUNNING
from concurrent.futures._base import LOGGER as _LOGGER
from typing import Any, TypeVar, cast

T = TypeVar("T")

_CANCELLED = (CANCELLED, CANCELLED_AND_NOTIFIED)

__all__ = ["RunningFuture", "Steps", "all_of", "failed", "first_error", "forward", "new_future", "resolved",
           "settled_by", "then"]


class RunningFuture(Future[T]):
    """A ``concurrent.futures.Future`` born in the running state (so that nobody can cancel it),
    made for the engine's one-per-request traffic: its mutex is a bare ``RLock`` and its
    ``Condition`` is built only when somebody has to wait for it (an unsettled ``result()``,
    ``concurrent.futures.wait``/``as_completed``); settling it and reading a settled one take
    that lock once, or not at all.

    Everything that reads ``_condition`` (the standard library's ``wait``, ``as_completed``,
    ``cancel``, ``repr``) gets a Condition over the same lock, so it excludes the methods
    here exactly as it excludes the stock ones. The lists of waiters and callbacks are made on
    first use too: a pipelining caller holds thousands of these, and every object the garbage
    collector tracks makes its collections come sooner and last longer.
    """

    def __init__(self) -> None:     # not Future.__init__: it builds a Condition per future
        self._lock = _RLock()
        self._cond: threading.Condition | None = None
        self._state = RUNNING
        self._result: T | None = None
        self._exception: BaseException | None = None
        self._waiting: list[Any] | None = None
        self._callbacks: list[Callable[[Future[T]], object]] | None = None

    @property
    def _waiters(self) -> list[Any]:    # concurrent.futures.wait() appends under the lock
        if self._waiting is None:
            self._waiting = []
        return self._waiting

    @_waiters.setter
    def _waiters(self, waiters: list[Any]) -> None:
        self._waiting = waiters

    @property
    def _done_callbacks(self) -> list[Callable[[Future[T]], object]]:
        if self._callbacks is None:
            self._callbacks = []
        return self._callbacks

    @_done_callbacks.setter
    def _done_callbacks(self, callbacks: list[Callable[[Future[T]], object]]) -> None:
        self._callbacks = callbacks

    @property
    def _condition(self) -> threading.Condition:
        cond = self._cond
        if cond is None:
            with self._lock:
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition(self._lock)
        return cond

    @_condition.setter
    def _condition(self, cond: threading.Condition) -> None:
        raise AttributeError("a RunningFuture's condition is its own")

    def done(self) -> bool:
        return self._state == FINISHED or self._state in _CANCELLED

    def set_result(self, result: T) -> None:
        self._settle(result, None, failed=False)

    def set_exception(self, exception: BaseException | None) -> None:
        self._settle(None, exception, failed=True)

    def _settle(self, result: T | None, exception: BaseException | None, failed: bool) -> None:
        """Finish with ``result`` or ``exception``; wake waiters, then run callbacks."""
        with self._lock:
            if self._state == FINISHED or self._state in _CANCELLED:
                raise InvalidStateError(f"{self._state}: {self!r}")
            self._result, self._exception = result, exception
            self._state = FINISHED
            if self._waiting or self._cond is not None:
                self._wake(failed)
        if self._callbacks:
            self._run_callbacks()

    def _set_result_quietly(self, result: T) -> bool:
        """``set_result`` for the engine, which reads replies in batches: everything but waking
        a thread blocked in ``result()``; True when there is one, and the engine then calls
        :meth:`_wake_readers` at the end of its batch (a pipelining reader wakes once per
        batch, not once per reply)."""
        with self._lock:
            if self._state == FINISHED or self._state in _CANCELLED:
                raise InvalidStateError(f"{self._state}: {self!r}")
            self._result = result
            self._state = FINISHED
            for waiter in self._waiting or ():
                waiter.add_result(self)
            blocked = self._cond is not None
        if self._callbacks:
            self._run_callbacks()
        return blocked

    def _wake_readers(self) -> None:
        with self._lock:
            if self._cond is not None:
                self._cond.notify_all()

    def _wake(self, failed: bool) -> None:
        """Under the lock, just settled: tell whoever waits (usually nobody)."""
        for waiter in self._waiting or ():
            if failed:
                waiter.add_exception(self)
            else:
                waiter.add_result(self)
        if self._cond is not None:
            self._cond.notify_all()

    def _run_callbacks(self) -> None:
        for fn in self._callbacks or ():
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - as concurrent.futures does: logged, not raised
                _LOGGER.exception("exception calling callback for %r", self)

    def result(self, timeout: float | None = None) -> T:
        if self._state == FINISHED:             # written last, under the lock, by the setter
            error = self._exception
            if error is None:
                return cast(T, self._result)
            try:
                raise error
            finally:
                del error, self                 # no reference cycle through the traceback
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == FINISHED:
            return self._exception
        return super().exception(timeout)

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        with self._lock:
            if not (self._state == FINISHED or self._state in _CANCELLED):
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:   # noqa: BLE001 - as concurrent.futures does: logged, not raised
            _LOGGER.exception("exception calling callback for %r", self)


def new_future() -> Future[Any]:
    """A pending future in the running state (so that nobody can cancel it)."""
    return RunningFuture()


def resolved(value: T) -> Future[T]:
    """A future already holding ``value``."""
    future: Future[T] = new_future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future[Any]:
    """A future already failed with ``error``."""
    future: Future[Any] = new_future()
    future.set_exception(error)
    return future


def _settle(out: Future[T], result: Callable[[], T]) -> None:
    """Set ``out`` to ``result()``, or to what it raised; nothing if ``out`` is already done."""
    try:
        value = result()
    except BaseException as err:  # noqa: BLE001 - it belongs to the future's reader
        _set(out, None, err)
        return
    _set(out, value, None)


def _set(out: Future[T], value: Any, error: BaseException | None) -> None:
    try:
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(value)
    except Exception:  # noqa: BLE001 - InvalidStateError: someone settled it first
        pass


def then(future: Future[Any], fn: Callable[[Any], T]) -> Future[T]:
    """``fn(future.result())`` once ``future`` succeeds; its error (or ``fn``'s) otherwise."""
    out: Future[T] = new_future()

    def done(f: Future[Any]) -> None:
        error = f.exception()
        if error is not None:
            _set(out, None, error)
        else:
            _settle(out, lambda: fn(f.result()))

    future.add_done_callback(done)
    return out


def all_of(parts: Sequence[Future[Any]], result: Callable[[], T]) -> Future[T]:
    """One future for several: once every part is done, the first error in issue order, else
    ``result()``."""
    if len(parts) == 1:
        return then(parts[0], lambda _: result())
    out: Future[T] = new_future()
    if not parts:
        _settle(out, result)
        return out
    left = _Countdown(len(parts))

    def done(_: Future[Any]) -> None:
        if not left.tick():
            return
        error = next((f.exception() for f in parts if f.exception() is not None), None)
        if error is not None:
            _set(out, None, error)
        else:
            _settle(out, result)

    for part in parts:
        part.add_done_callback(done)
    return out


def first_error(parts: Sequence[Future[Any]], result: Callable[[], T]) -> Future[T]:
    """Fails as soon as one part fails (with that part's error); once all have succeeded,
    ``result()``."""
    out: Future[T] = new_future()
    if not parts:
        _settle(out, result)
        return out
    left = _Countdown(len(parts))

    def done(part: Future[Any]) -> None:
        error = part.exception()
        last = left.tick()
        if error is not None:
            _set(out, None, error)
        elif last:
            _settle(out, result)

    for part in parts:
        part.add_done_callback(done)
    return out


class _Countdown:
    """A thread-safe counter that says which tick was the last."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._lock = threading.Lock()

    def tick(self) -> bool:
        with self._lock:
            self._count -= 1
            return self._count == 0


class Steps:
    """Parts added over time, one of them final: ``future`` fails with the first part that fails,
    or gets the final part's result as soon as the final part is done (the others' outcomes no
    longer matter then: whatever the final part ran on was produced by them)."""

    def __init__(self) -> None:
        self.future: Future[Any] = new_future()
        self.parts: list[Future[Any]] = []
        self._final: Future[Any] | None = None
        self._lock = threading.Lock()

    def add(self, part: Future[Any], final: bool = False) -> None:
        """Add a part (``final``: the one whose result becomes the future's)."""
        with self._lock:
            self.parts.append(part)
            if final:
                self._final = part
        part.add_done_callback(self._check)

    def fail(self, error: BaseException) -> None:
        """Fail the whole now (e.g. issuing a later part raised)."""
        _set(self.future, None, error)

    def _check(self, part: Future[Any]) -> None:
        error = part.exception()
        if error is not None:
            _set(self.future, None, error)
            return
        with self._lock:
            final = self._final
        if final is not None and final.done() and final.exception() is None:
            _set(self.future, final.result(), None)


def forward(source: Future[T], target: Future[T]) -> None:
    """Settle ``target`` like ``source`` once ``source`` is done."""
    def done(f: Future[T]) -> None:
        error = f.exception()
        _set(target, None if error is not None else f.result(), error)

    source.add_done_callback(done)


def settled_by(final: Future[T], parts: Sequence[Future[Any]]) -> Future[T]:
    """The first error of ``parts`` (which include ``final``), else ``final``'s result as soon
    as it is in: the others' outcomes need not be waited for (``final`` ran on what they
    produced). :class:`Steps` is the same with parts added over time."""
    steps = Steps()
    for part in parts:
        steps.add(part, final=part is final)
    return steps.future
