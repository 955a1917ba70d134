"""The worker's memory accounting (worker/sessions/memory.py): what it holds for anyone stays in --mem.

Real worker processes: their peak resident set (``VmHWM``) is read from /proc.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import zmq
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.errors import RpcError
from zmq_rpc.broker.protocol import Cmd
from zmq_rpc.client import Client
from zmq_rpc.worker.peer.queue import QUEUE_BYTES_PER_CONNECTION
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
FIXED_OVERHEAD = 64 * MiB
"""What a worker process holds beside --mem: the interpreter, numpy and libzmq (an idle
worker: 38-40 MiB resident) and libzmq's buffers for its client connection."""


def peak_rss(pid: int) -> int:
    """The process's peak resident set, in bytes (``VmHWM`` in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_push_to_itself_and_a_get_of_the_same_view_stay_within_mem(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """Issue 24.10: a worker pushing a 512 MiB zero-stride view to its own peer endpoint while
    a pipelined 512 MiB GET of the same view was out peaked at 1,577 MiB resident under
    --mem 1GiB: the peer port's receive queue (256 messages of 4 MiB) and the early-chunk
    stash were outside --mem. Both now count (the queue per connection, the stash by bytes)."""
    proc = spawn_worker("--mem", "1GiB")
    with Client(proc.endpoint) as c:                   # default settings
        x = c.alloc_buffer(64).tensor((4,), "float32")
        view = x.view((128 * MiB,), (0,))              # 512 MiB, all the same 4 bytes
        own = c.info.peer_endpoint
        c.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=own, timeout_ms=5000)).result(10)
        send = c.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(wire.TOKEN_BYTES),
                                                    src=view.ref, endpoint=own,
                                                    timeout_ms=8000))
        get = c.get_tensor_async(view)
        outcomes = []
        for fut in (get, send):
            try:
                fut.result(timeout=60)
                outcomes.append("ok")
            except RpcError as exc:             # OutOfMemory, or the push's timeout: both fine
                outcomes.append(type(exc).__name__)
        c.ping()
        peak = peak_rss(proc.proc.pid)
    assert peak <= (1 << 30) + FIXED_OVERHEAD, \
        f"peak {peak / MiB:.0f} MiB under --mem 1GiB ({outcomes})"


def test_each_peer_connection_counts_its_receive_queue(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """What libzmq may queue for a connection to the peer port is counted in --mem while it
    is open, and given back when it closes."""
    server = make_worker(memory_limit=256 * MiB)
    c = make_client(server.endpoint)
    before = c.device_memory().free
    pushers = [raw_socket(zmq.PUSH) for _ in range(2)]
    for push in pushers:
        push.connect(c.info.peer_endpoint)
    wait_until(lambda: c.device_memory().free == before - 2 * QUEUE_BYTES_PER_CONNECTION, 10,
               "both peer connections' queues were counted in --mem")
    for push in pushers:
        push.close(linger=0)
    wait_until(lambda: c.device_memory().free == before, 10,
               "the closed connections' queues were given back")
