"""The client's future combinators (no sockets, no threads of their own)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest
from zmq_rpc.client.futures import (
    Steps,
    all_of,
    failed,
    first_error,
    forward,
    new_future,
    resolved,
    settled_by,
    then,
)


def test_then_maps_results_and_passes_errors() -> None:
    assert then(resolved(2), lambda x: x * 3).result(0) == 6
    with pytest.raises(KeyError):
        then(failed(KeyError("k")), lambda x: x).result(0)
    with pytest.raises(ZeroDivisionError):
        then(resolved(0), lambda x: 1 / x).result(0)


def test_all_of_waits_for_every_part_and_reports_the_first_error_in_issue_order() -> None:
    parts = [new_future() for _ in range(3)]
    out = all_of(parts, lambda: "done")
    parts[2].set_exception(ValueError("third"))
    parts[1].set_exception(KeyError("second"))
    assert not out.done()                        # the first part is still out
    parts[0].set_result(None)
    with pytest.raises(KeyError):
        out.result(0)
    assert all_of([], lambda: 1).result(0) == 1


def test_first_error_fails_at_once_else_waits_for_all() -> None:
    parts = [new_future() for _ in range(3)]
    out = first_error(parts, lambda: "done")
    parts[1].set_exception(ValueError("boom"))
    with pytest.raises(ValueError):
        out.result(0)
    parts = [new_future() for _ in range(2)]
    out = first_error(parts, lambda: "done")
    parts[0].set_result(1)
    assert not out.done()
    parts[1].set_result(2)
    assert out.result(0) == "done"


def test_steps_settle_with_the_final_part_or_the_first_error() -> None:
    steps = Steps()
    early, final = new_future(), new_future()
    steps.add(early)
    steps.add(final, final=True)
    final.set_result("out")
    assert steps.future.result(0) == "out"        # the early part's ack is not waited for
    early.set_exception(RuntimeError("late"))     # too late to matter
    assert steps.future.result(0) == "out"
    steps = Steps()
    steps.add(failed(RuntimeError("first")))
    steps.add(resolved("x"), final=True)
    with pytest.raises(RuntimeError, match="first"):
        steps.future.result(0)
    parts = [new_future(), new_future()]
    out = settled_by(parts[1], parts)
    parts[1].set_result(7)
    assert out.result(0) == 7


def test_forward_and_combinators_settle_once_under_threads() -> None:
    for _ in range(50):
        parts: list[Future[Any]] = [new_future() for _ in range(8)]
        out = first_error(parts, lambda: "ok")
        target: Future[Any] = new_future()
        forward(out, target)
        threads = [threading.Thread(target=p.set_result, args=(i,)) for i, p in enumerate(parts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert target.result(1) == "ok"


def test_new_futures_run_and_cannot_be_cancelled() -> None:
    future = new_future()
    assert isinstance(future, Future) and future.running() and not future.done()
    assert not future.cancel() and not future.cancelled()
    threading.Timer(0.05, future.set_result, (7,)).start()
    assert future.result(timeout=5) == 7 and future.done() and not future.running()
