"""Waiting on events in tests: poll a condition until it holds, or fail naming what did not happen.

Tests wait on the event itself, not on a sleep long enough on a quiet machine: a sleep is too
short under load (the test fails) and too long on a quiet machine (the suite is slow). The one
sleep here is the polling interval. Runs on the calling (test) thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zmq_rpc.client import Client

POLL_S = 0.005
"""How often a condition is checked: short against every bound the tests state (>= 0.1 s)."""


def wait_until(predicate: Callable[[], object], timeout: float, what: str | Callable[[], str],
               interval: float = POLL_S) -> float:
    """Poll ``predicate`` until it is true; return the seconds it took. Fail with
    ``AssertionError`` naming ``what`` (the event that should have happened; a callable is asked
    at the deadline, to show the state then) after ``timeout`` s."""
    start = time.monotonic()
    deadline = start + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            event = what if isinstance(what, str) else what()
            raise AssertionError(f"not within {timeout:g} s: {event}")
        time.sleep(interval)
    return time.monotonic() - start


def receiving(watch: Client) -> bool:
    """Whether ``watch``'s worker has a peer receive under way: STATUS, asked from a session of
    its own (a session's STATUS waits behind its queue, which the receive holds)."""
    return watch.status().transfers_in_progress > 0
