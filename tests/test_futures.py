"""The client's future combinators (no sockets, no threads of their own)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    Future,
    InvalidStateError,
    as_completed,
    wait,
)
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import pytest
from zmq_rpc.broker.errors import ConnectionLost, TransferError
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


@pytest.mark.parametrize("combine", ["steps", "first_error"])
def test_a_lost_connection_is_reported_over_the_transfer_it_called_off(combine: str) -> None:
    # The order a lost worker produces: its run's future fails, and a done-callback registered
    # before the combinator's (the pipeline's call-off) fails the receive on another worker
    # before the combinator hears of the run; the combinator must still report the connection.
    run, receive = new_future(), new_future()
    run.add_done_callback(lambda _: receive.set_exception(TransferError("called off")))
    if combine == "steps":
        whole = settled_by(receive, [run, receive])
    else:
        whole = first_error([run, receive], lambda: None)
    run.set_exception(ConnectionLost("connection to tcp://w1 lost"))
    with pytest.raises(ConnectionLost):
        whole.result(timeout=0)


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


# ------------------------------------------------- the futures every request gets (new_future)

def _settle_later(future: Future[Any], value: Any, delay: float = 0.02) -> threading.Thread:
    setter = future.set_exception if isinstance(value, BaseException) else future.set_result
    thread = threading.Thread(target=lambda: (time.sleep(delay),  # settled while waited on
                                              setter(value)))
    thread.start()
    return thread


def test_new_future_waits_and_times_out_like_a_stock_future() -> None:
    future = new_future()
    with pytest.raises(FuturesTimeout):
        future.result(timeout=0.01)
    with pytest.raises(FuturesTimeout):
        future.exception(timeout=0.01)
    _settle_later(future, "late").join()
    assert future.result(0) == "late" and future.exception(0) is None
    with pytest.raises(InvalidStateError):
        future.set_result("again")
    with pytest.raises(InvalidStateError):
        future.set_exception(KeyError("again"))
    broken = new_future()
    _settle_later(broken, KeyError("k"))
    assert isinstance(broken.exception(timeout=5), KeyError)
    with pytest.raises(KeyError):
        broken.result(0)
    assert "finished raised KeyError" in repr(broken)


def test_new_future_callbacks_run_once_before_or_after_settling(
        caplog: pytest.LogCaptureFixture) -> None:
    future = new_future()
    seen: list[Any] = []
    future.add_done_callback(lambda f: seen.append(("before", f.result())))
    future.add_done_callback(lambda f: 1 / 0)      # logged, the others still run
    future.add_done_callback(lambda f: seen.append(("after-bad", f.result())))
    future.set_result(3)
    future.add_done_callback(lambda f: seen.append(("late", f.result())))
    assert seen == [("before", 3), ("after-bad", 3), ("late", 3)]
    assert "exception calling callback" in caplog.text


@pytest.mark.parametrize("when", [FIRST_COMPLETED, FIRST_EXCEPTION, ALL_COMPLETED])
def test_new_futures_work_with_concurrent_futures_wait(when: str) -> None:
    early = resolved("early")
    parts = [new_future() for _ in range(4)]
    threads = [_settle_later(p, i if i != 2 else ValueError("two"), 0.01 * (i + 1))
               for i, p in enumerate(parts)]
    done, not_done = wait([early, *parts], timeout=10, return_when=when)
    if when == ALL_COMPLETED:
        assert not not_done and len(done) == 5
    elif when == FIRST_EXCEPTION:
        assert parts[2] in done
    else:
        assert early in done
    for thread in threads:
        thread.join()
    assert [f.done() for f in parts] == [True] * 4


def test_new_futures_work_with_as_completed_and_asyncio() -> None:
    parts = [new_future() for _ in range(3)]
    threads = [_settle_later(p, i, 0.01 * (3 - i)) for i, p in enumerate(parts)]
    assert {f.result(0) for f in as_completed(parts, timeout=10)} == {0, 1, 2}

    async def main() -> list[Any]:
        a, b = new_future(), new_future()
        _settle_later(a, "a")
        _settle_later(b, RuntimeError("b"))
        return await asyncio.gather(asyncio.wrap_future(a), asyncio.wrap_future(b),
                                    return_exceptions=True)

    got = asyncio.run(main())
    assert got[0] == "a" and isinstance(got[1], RuntimeError)
    for thread in threads:
        thread.join()


def _append_result(future: Future[Any], out: list[Any]) -> None:
    out.append(future.result(10))


def test_new_future_wakes_every_waiter_when_settled_from_another_thread() -> None:
    for round_ in range(200):          # the Condition is built by the first waiter: race it
        future = new_future()
        got: list[Any] = []
        waiters = [threading.Thread(target=_append_result, args=(future, got))
                   for _ in range(3)]
        for thread in waiters:
            thread.start()
        if round_ % 2:
            time.sleep(0.0005)      # half the rounds settle a little later: the race is the subject
        future.set_result(round_)
        for thread in waiters:
            thread.join(10)
        assert got == [round_] * 3
