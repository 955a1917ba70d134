"""worker/observe/logs.Throttled: a warning outside input can cause once per message is logged
once per interval, with a count of what was left out."""

from __future__ import annotations

import logging

import pytest
from zmq_rpc.worker.observe.logs import Throttled


def test_a_flood_logs_one_line_per_interval_with_the_count_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    throttled = Throttled(logging.getLogger("zmq_rpc.test"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.test"):
        logged = [throttled.warning("bad message %d from %s", i, "x") for i in range(1000)]
        now[0] += 9.9
        logged.append(throttled.warning("bad message %d from %s", 1000, "x"))
        now[0] += 0.2
        logged.append(throttled.warning("bad message %d from %s", 1001, "x"))
        now[0] += 10.0
        logged.append(throttled.warning("bad message %d from %s", 1002, "x"))
    assert logged == [True] + [False] * 1000 + [True, True]
    assert [r.getMessage() for r in caplog.records] == [
        "bad message 0 from x",
        "bad message 1001 from x (and 1000 more since the last such line)",
        "bad message 1002 from x"]
    assert throttled.count == 1003
