"""broker/monitor.py: libzmq's monitor events read as pyzmq reads them, without its asyncio."""

from __future__ import annotations

import subprocess
import sys

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message
from zmq_rpc.broker.monitor import parse_event, recv_event


def test_events_of_a_real_connection_read_as_pyzmq_reads_them() -> None:
    ctx = zmq.Context()
    try:
        server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        monitor = client.get_monitor_socket()
        client.connect(f"tcp://127.0.0.1:{port}")
        seen = []
        while zmq.EVENT_HANDSHAKE_SUCCEEDED not in [e.event for e in seen]:
            assert monitor.poll(10_000), f"no handshake within 10 s: {seen}"
            frames = monitor.recv_multipart()
            ours, theirs = parse_event(frames), parse_monitor_message(frames)
            assert (ours.event, ours.value, ours.endpoint) == (
                theirs["event"], theirs["value"], theirs["endpoint"])
            seen.append(ours)
        assert seen[0].endpoint == f"tcp://127.0.0.1:{port}".encode()
        client.disable_monitor()
        for sock in (monitor, client, server):
            sock.close(linger=0)
    finally:
        ctx.term()


def test_a_message_that_is_not_an_event_is_refused() -> None:
    for frames in ([b"\0" * 6], [b"\0" * 5, b"x"], [b"\0" * 6, b"x", b"y"]):
        with pytest.raises(ValueError, match="not a monitor event"):
            parse_event(frames)


def test_recv_event_blocks_for_the_next_one() -> None:
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://events")
        b.connect("inproc://events")
        a.send_multipart([(zmq.EVENT_CONNECTED).to_bytes(2, sys.byteorder)
                          + (7).to_bytes(4, sys.byteorder), b"tcp://h:1"])
        assert recv_event(b) == parse_event([(1).to_bytes(2, sys.byteorder)
                                             + (7).to_bytes(4, sys.byteorder), b"tcp://h:1"])
        a.close(linger=0)
        b.close(linger=0)
    finally:
        ctx.term()


def test_neither_side_imports_asyncio_to_start() -> None:
    code = ("import sys, zmq_rpc.client, zmq_rpc.worker.backend_thread; "
            "print('asyncio' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
