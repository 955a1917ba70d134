"""The worker's memory accounting (worker/sessions/memory.py): what it holds for anyone stays in --mem.

Real worker processes: their peak resident set (``VmHWM``) is read from /proc.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

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


def status_bytes(pid: int, field: str) -> int:
    """One ``kB`` field of /proc/PID/status (``VmRSS``, ``RssFile``, ...), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


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


NUMBA_RUNTIME = 64 * MiB
"""What numba keeps resident once it has linked the kernels (measured: 47 MiB of anonymous
memory, its modules and the JIT's state; docs/DESIGN.md "Memory: pages and the heap")."""
WORKING_SET = 32 * MiB
"""Graph arenas, step buffers, message buffers of a serving worker beside its tensors."""


def _pageout_supported() -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return os.uname().sysname == "Linux" and tuple(map(int, release[:2])) >= (5, 4)


@pytest.mark.skipif(not _pageout_supported(), reason="MADV_PAGEOUT needs Linux 5.4+")
def test_a_serving_worker_holds_its_tensors_and_a_bounded_rest(
        spawn_worker: Callable[..., WorkerProcess], llama_gguf: Any) -> None:
    """Issue 29 point 3: numba links even a cached kernel through LLVM, whose code and data
    came in resident (66 MiB) and stayed there: a worker serving SmolLM2 held 297 MiB, 170 MiB
    after its client left. Once the worker is idle it pages them out (the linked kernels never
    touch them); what stays is its tensors, the idle worker, numba's runtime and a working set."""
    from zmq_rpc.client.llama import LlamaModel
    proc = spawn_worker()                                  # default settings
    pid = proc.proc.pid
    with Client(proc.endpoint) as c:
        c.ping()                                           # its backend loaded: idle
    idle_rss, idle_file = status_bytes(pid, "VmRSS"), status_bytes(pid, "RssFile")
    with Client(proc.endpoint) as c, LlamaModel.load(llama_gguf, [c]) as model:
        model.generate(tuple(range(300, 316)), 4, stop_ids=())
        wait_until(lambda: status_bytes(pid, "RssFile") <= idle_file + 16 * MiB, 10,
                   lambda: f"the compiler's pages out: {status_bytes(pid, 'RssFile') / MiB:.0f} "
                           f"MiB file-backed, idle {idle_file / MiB:.0f}")
        model.generate(tuple(range(300, 316)), 4, stop_ids=())     # without them
        assert model.load_stats is not None
        tensors = model.load_stats.resident_bytes
        wait_until(lambda: status_bytes(pid, "VmRSS")
                   <= tensors + idle_rss + NUMBA_RUNTIME + WORKING_SET, 10,
                   lambda: f"{status_bytes(pid, 'VmRSS') / MiB:.0f} MiB serving "
                           f"{tensors / MiB:.0f} MiB of tensors, idle {idle_rss / MiB:.0f}")
    wait_until(lambda: status_bytes(pid, "VmRSS") <= idle_rss + NUMBA_RUNTIME + 16 * MiB, 10,
               lambda: f"back near idle after the client left: "
                       f"{status_bytes(pid, 'VmRSS') / MiB:.0f} MiB, idle {idle_rss / MiB:.0f}")
