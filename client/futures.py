"""Combinators for ``concurrent.futures.Future``: the one place the client composes futures.

No thread of its own: every function here attaches done-callbacks, which run on whichever thread
resolves the parts (usually a client I/O thread, so they never block). Each returned future is
already running (``set_running_or_notify_cancel``) and is settled exactly once: never cancelled,
never left pending while a part is pending forever (the connection settles every part in bounded
time). They are stock futures (public API only): a request's future is made as in
``new_future()`` (``Connection.call`` does it inline).

- :func:`resolved` / :func:`failed`: a future that is already done.
- :func:`then`: ``fn(result)`` of one future (its error passes through).
- :func:`all_of`: waits for every part; the first error in issue order, else ``result()``. For the
  chunks of one transfer, whose buffers must not be reused while any chunk is still on its way.
- :func:`first_error`: fails as soon as any part fails, else ``result()`` once all have succeeded.
  For the halves of a copy or a linked run: a dead worker fails the whole at once.
  A part's lost connection outranks the consequences it has already caused elsewhere (a
  transfer called off because of it): the error reported names the worker lost.
- :class:`Steps` / :func:`settled_by`: parts (added over time); fails with the first error, or
  settles with the final part's result as soon as that part is done (the parts before it need not
  be waited for).
- :func:`forward`: settle one future like another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from ..broker.errors import TransportError

T = TypeVar("T")

__all__ = ["Steps", "all_of", "failed", "first_error", "forward", "new_future", "resolved",
           "settled_by", "then"]


def new_future() -> Future[Any]:
    """A pending future in the running state (so that nobody can cancel it)."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    return future


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
            _set(out, None, _root_cause(error, parts))
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
        with self._lock:
            final = self._final
            parts = list(self.parts) if error is not None else []
        if error is not None:
            _set(self.future, None, _root_cause(error, parts))
            return
        if final is not None and final.done() and final.exception() is None:
            _set(self.future, final.result(), None)


def _root_cause(error: BaseException, parts: Sequence[Future[Any]]) -> BaseException:
    """``error``, unless another part has already failed on its connection: then that part's
    error. A lost worker fails the other parts as a consequence (the receive of a hand-off its run
    never sent is called off, and that worker answers ``TransferError``), and the call-off is
    sent by a done-callback registered before ours on the failed run's future, so its answer can
    reach us first; the connection's error names the worker that was lost, and it is the error
    the failure contract promises."""
    if isinstance(error, TransportError):
        return error
    for part in parts:
        if part.done() and isinstance(part.exception(), TransportError):
            return part.exception() or error
    return error


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
