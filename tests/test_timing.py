"""Where the time went: ``Client(trace=True)`` records each request's client queue, wire, worker
queue, worker run and way back (the worker's share from its reply, protocol 1.5), and
tools/timing.py splits a decoded token's time from such traces."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import pytest
from zmq_rpc.broker import protocol as p
from zmq_rpc.client import Client, Graph, RequestTiming, hand_off
from zmq_rpc.tools.timing import token_split
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(60)


def test_traced_requests_split_their_time(worker: WorkerServer,
                                          make_client: Callable[..., Client]) -> None:
    c = make_client(worker.endpoint, trace=True)
    x = c.alloc_buffer(1 << 20).tensor((4096,), "float32")
    c.set_tensor(x, np.ones(4096, np.float32))
    g = Graph()
    g.silu(x, out=x)
    handle = c.register(g)
    c.run(handle, fetch=[x])
    c.ping()
    timings = c.timings()
    cmds = [t.cmd for t in timings]
    assert cmds == ["HELLO", "ALLOC_BUFFER", "SET_TENSOR", "GRAPH_REGISTER", "GRAPH_RUN", "PING"]
    for t in timings:
        assert min(t.client_queue, t.wire, t.worker_queue, t.worker_run, t.back) >= 0
        assert 0 < t.total < 30
    run = timings[4]
    assert 0 < run.compute <= run.worker_run
    assert c.timings() == []                       # drained
    untraced = make_client(worker.endpoint)
    untraced.ping()
    assert untraced.timings() == []


def test_a_worker_queue_wait_shows_up(make_worker: Callable[..., WorkerServer],
                                      make_client: Callable[..., Client]) -> None:
    """A run that waits for a hand-off reports that wait as its queue time on the worker."""
    a, b = make_worker(memory_limit=64 << 20), make_worker(memory_limit=64 << 20)
    ca, cb = make_client(a.endpoint, trace=True), make_client(b.endpoint, trace=True)
    src = ca.alloc_buffer(4096).tensor((1024,), "float32")
    dst = cb.alloc_buffer(4096).tensor((1024,), "float32")
    g = Graph()
    g.silu(dst, out=dst)
    handle = cb.register(g)
    link = hand_off(src, dst)
    waiting = cb.run_async(handle, receive=[link])        # issued first: it must wait
    time.sleep(0.3)                 # the queue wait the test measures (>= 0.25 s)
    ca.set_tensor(src, np.zeros(1024, np.float32))
    g_a = Graph()
    g_a.silu(src, out=src)
    ca.run(ca.register(g_a), send=[link])
    waiting.result()
    linked = [t for t in cb.timings() if t.cmd == "GRAPH_RUN_LINKED"]
    assert len(linked) == 1 and linked[0].worker_queue >= 0.25


def test_an_older_worker_is_not_traced(worker: WorkerServer, make_client: Callable[..., Client],
                                       caplog: pytest.LogCaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from zmq_rpc.worker.dispatch.self_report import SelfReport
    original = SelfReport.hello_reply

    def old_hello(self: SelfReport) -> p.HelloReply:
        reply = original(self)
        return p.HelloReply(**{**{f: getattr(reply, f) for f in reply.__slots__}, "minor": 4,
                               "capabilities": tuple(c for c in reply.capabilities
                                                     if c != "timing")})
    monkeypatch.setattr(SelfReport, "hello_reply", old_hello)
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.client"):
        c = make_client(worker.endpoint, trace=True)
    c.ping()
    assert c.timings() == []
    assert any("carry no timing" in r.getMessage() for r in caplog.records)


def timing(run: float, compute: float, queue: float = 0.0,
           cmd: str = "GRAPH_RUN_LINKED") -> RequestTiming:
    return RequestTiming(cmd, 1e-5, 2e-4, queue, run, 3e-5, compute)


def test_token_split_of_a_two_stage_chain() -> None:
    """Steps sent whole (GRAPH_RUN_LINKED) and, once their worker keeps them, short
    (GRAPH_RUN_KEPT, protocol 1.15) are the same steps."""
    prefill = [timing(0.02, 0.019)]
    stage_a = prefill + [timing(0.004, 0.003, cmd="GRAPH_RUN_KEPT" if i > 1 else
                                "GRAPH_RUN_LINKED") for i in range(5)]
    stage_b = prefill + [RequestTiming("PING", 0, 0, 0, 0, 0)] + \
        [timing(0.005, 0.0045, cmd="GRAPH_RUN_KEPT") for _ in range(5)]
    split = token_split([stage_a, stage_b], [0.0100] * 5)
    assert split is not None and split.steps == 5
    assert split.compute == pytest.approx(0.0075)
    assert split.worker_work == pytest.approx(0.0015)
    assert split.hand_offs == pytest.approx(0.001)
    assert split.token == pytest.approx(split.compute + split.worker_work + split.hand_offs)
    assert split.wire == pytest.approx(2e-4) and "hand-offs" in split.line()
    assert token_split([stage_a, stage_b[:3]], [0.01] * 5) is None    # a stage missing steps
    assert token_split([stage_a], []) is None
    assert split.stage_compute == pytest.approx((0.003, 0.0045))


def test_token_split_of_one_stage() -> None:
    """On one worker a decode step is a plain GRAPH_RUN, the token's embedding copied into the
    next step's input between runs: that copy counts with the time between runs."""
    stage = [timing(0.02, 0.019, cmd="GRAPH_RUN")]
    for _ in range(4):
        stage += [timing(0.009, 0.0085, cmd="GRAPH_RUN"), RequestTiming("COPY_TENSOR", 0, 0, 0,
                                                                        1e-4, 0)]
    split = token_split([stage], [0.0100] * 4)
    assert split is not None and split.steps == 4
    assert split.compute == pytest.approx(0.0085) and split.stage_compute == (
        pytest.approx(0.0085),)
    assert split.worker_work == pytest.approx(0.0005)
    assert split.hand_offs == pytest.approx(0.001)
