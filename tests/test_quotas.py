"""One greedy or hostile session cannot starve the others, nor grow the worker without bound.

A flooder (its own process, so it never shares our GIL) pipelines 64 KiB SET_TENSORs as fast as it
can and never reads a reply; meanwhile a well-behaved client with default settings pings. Issue 13
measured a median ping of 0.12 ms rising to 156 ms and the worker's RSS to 641 MiB (3.2 GiB when
the backend was busy); before bounded queues the same flood here timed a ping out after 60 s.
Stated bound: the median ping under the flood stays within 10x of the idle median measured just
before plus 10 ms, and the worker's RSS grows by no more than its queues can hold (:func:`queued_mib`:
a client connection's pipe, the PAIR both ways and the backend's read-ahead, full of the flood's
64 KiB requests, plus 8 MiB for what the requests' handling allocates). Starvation, what this test is about, gave
medians of 156 ms and timeouts after 60 s. The 10 ms: on 2 cores the flooder, the worker's two
threads and this client share the CPUs, and the median under the flood lands near 0.5 ms or at
2-7 ms by how they are scheduled (quiet A/B, 3 runs each: 1.1x-15.1x of idle before and after the
client engine's rewrite; the old bound, 10x + 1 ms, failed 1 run in 3 on both). Not bounded
here: the tail. p99 is 140-165 ms in those runs, most likely libzmq's proxy (broker.py) forwarding
the flooder's requests in bursts with blocking sends into the full PAIR, when it forwards no reply.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.broker import BACKEND_HWM, CLIENT_RCVHWM
from zmq_rpc.broker.protocol import Cmd, DType
from zmq_rpc.client import Client, Graph, OutOfMemory
from zmq_rpc.worker.dispatch.inbox import READ_AHEAD_BYTES
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(120)

FLOODER = r"""
import os, sys, time, zmq
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd, DType
ep, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.ROUTING_ID, b"F" + os.urandom(15))
d.setsockopt(zmq.SNDHWM, 1000)      # 64 MiB queued here at most; then it blocks: backpressure
d.connect(ep)
major, minor = p.PROTOCOL_VERSION
d.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor, client="flood")))
d.recv_multipart()
d.send(p.encode_request(Cmd.ALLOC_BUFFER, 2, p.AllocBuffer(handle=1, size=65536)))
d.recv_multipart()
ref = p.TensorRef(buffer=1, dtype=DType.UINT8, shape=(65536,), strides=(1,), offset=0)
header = p.encode_request(Cmd.SET_TENSOR, 3, p.SetTensor(tensor=ref))
print("flooding", flush=True)
end, n, full = time.monotonic() + seconds, 0, False
while time.monotonic() < end and n < 200_000:
    try:
        d.send_multipart([header, bytes(65536)], flags=zmq.NOBLOCK)
    except zmq.Again:               # the worker's queues and this socket's are full
        if not full:
            print("full", flush=True)
            full = True
        d.send_multipart([header, bytes(65536)])
    n += 1
print("sent", n, flush=True)
d.close(linger=0)
ctx.term()
"""


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def queued_mib(message: int = 65536 + 256) -> int:
    """The most a flood of ``message``-byte requests from one connection can queue in a worker:
    its ROUTER pipe, the PAIR (both ways) and the backend's read-ahead, plus 8 MiB of slack for
    what handling them allocates; unbounded queues grew 130 MiB and more here (the RSS went
    from ~39 to 169 MiB in this test's flood, 641 MiB in issue 13's)."""
    pipes = (CLIENT_RCVHWM + 2 * BACKEND_HWM) * message
    return (pipes + max(READ_AHEAD_BYTES, message)) // (1 << 20) + 8


def ping_ms(client: Client, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        client.ping()
        out.append((time.perf_counter() - start) * 1e3)
        time.sleep(0.002)           # a user's pace, not back to back: a measurement, not a wait
    return out


def test_flooding_session_does_not_starve_another(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    worker = spawn_worker("--mem", "256MiB")
    client = make_client(worker.endpoint, timeout=60.0)        # the default timeout
    ping_ms(client, 50)
    idle = statistics.median(ping_ms(client, 300))
    rss_before = rss_mib(worker.proc.pid)
    flood = subprocess.Popen([sys.executable, "-c", FLOODER, worker.endpoint, "15"],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert flood.stdout is not None and flood.stdout.readline().startswith("flooding")
        assert flood.stdout.readline().startswith("full"), "the flooder never filled its queues"
        busy_samples = ping_ms(client, 300)
        rss = rss_mib(worker.proc.pid)
    finally:
        flood.kill()
        flood.communicate(timeout=30)
    busy = statistics.median(busy_samples)
    print(f"ping median idle {idle:.3f} ms, under flood {busy:.3f} ms ({busy / idle:.1f}x), "
          f"p99 {sorted(busy_samples)[296]:.1f} ms; worker RSS {rss_before} -> {rss} MiB")
    assert busy <= 10 * idle + 10.0
    # The queues' bound, re-derived when a connection's pipe went from 256 to 1,024 requests:
    # a fixed 120 MiB had been written for 256, and failed at 123 MiB.
    assert rss - rss_before <= queued_mib(), (rss_before, rss, queued_mib())
    client.alloc_buffer(1 << 20)                      # and the worker still serves


RESETTER = r"""
import os, sys, time, zmq
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd, DType
ep, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.ROUTING_ID, b"R" + os.urandom(15))
d.setsockopt(zmq.RCVHWM, 1)         # replies pile up unread in the kernel: closing sends a reset
d.connect(ep)
major, minor = p.PROTOCOL_VERSION
d.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor, client="reset")))
d.recv_multipart()
d.send(p.encode_request(Cmd.ALLOC_BUFFER, 2, p.AllocBuffer(handle=1, size=4096)))
d.recv_multipart()
ref = p.TensorRef(buffer=1, dtype=DType.UINT8, shape=(4096,), strides=(1,), offset=0)
header = p.encode_request(Cmd.SET_TENSOR, 3, p.SetTensor(tensor=ref))
print("flooding", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:       # never blocks: it closes on time, whatever the worker does
    try:
        d.send_multipart([header, bytes(4096)], flags=zmq.NOBLOCK)
    except zmq.Again:               # full: wait until it takes more, or at most 1 ms
        d.poll(1, zmq.POLLOUT)
d.close(linger=0)
ctx.term()
"""


def test_a_flooder_resetting_its_connection_does_not_kill_the_worker(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    """A client floods, stops reading its replies and closes (a TCP reset) while its pipe is full
    and the backend busy. With a ZMTP heartbeat on the ROUTER, libzmq 4.3.5 aborted the worker
    (``Assertion failed: !_io_error``, broker.py) within the heartbeat interval, 1 s, every time
    here. Now the worker serves on, and the long graph that kept it busy finishes right."""
    worker = spawn_worker()
    client = make_client(worker.endpoint, timeout=60.0)        # the default timeout
    n = 1024
    a = client.alloc_buffer(n * n * 4).tensor((n, n), "float32")
    out = client.alloc_buffer(4).tensor((1,), "float32")
    client.set_tensor(a, np.eye(n, dtype=np.float32))
    steps = _steps_for(client, a, out, seconds=3.0)
    g = Graph()
    x = a
    for _ in range(steps):
        x = g.matmul(x, a)
    g.sum(g.reshape(x, (n * n,)), axis=0, keepdims=True, out=out)
    busy = client.register(g)
    for _ in range(2):
        resetter = subprocess.Popen([sys.executable, "-c", RESETTER, worker.endpoint, "1.0"],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert resetter.stdout is not None and resetter.stdout.readline().startswith("flooding")
            time.sleep(0.5)           # the scenario: the run starts mid-flood, so the reset
                                      # comes while the backend is busy
            run = client.run_async(busy, fetch=[out])     # the backend is busy for ~3 s
            assert resetter.wait(30) == 0                 # closed with its pipe full: a reset
            time.sleep(1.5)           # a real duration: past the old heartbeat interval (1 s)
            assert worker.proc.poll() is None, worker.proc.stderr.read() if worker.proc.stderr else ""
            assert run.result()[0][0] == n                # identity matrices: the sum is n
        finally:
            resetter.kill()
            resetter.communicate(timeout=30)
    client.ping()


def _steps_for(client: Client, a: Any, out: Any, seconds: float) -> int:
    """Matmuls of ``a`` by itself that keep the backend busy about ``seconds`` here."""
    g = Graph()
    g.sum(g.reshape(g.matmul(a, a), (a.shape[0] * a.shape[1],)), axis=0, keepdims=True, out=out)
    one = client.register(g)
    start = time.perf_counter()
    client.run(one)
    return max(2, min(200, round(seconds / max(time.perf_counter() - start, 1e-3))))


# ------------------------------------------------------------------- memory and quotas


MiB = 1 << 20


class Raw:
    """A raw session (a DEALER with an unguessable id) that reads replies only when asked."""

    def __init__(self, raw_socket: Callable[[int], zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = raw_socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.ids = iter(range(1, 1 << 30))
        major, minor = p.PROTOCOL_VERSION
        assert self.call(Cmd.HELLO, p.Hello(major=major, minor=minor, client="raw"))[0] == 0

    def send(self, cmd: Cmd, msg: p.Message, *payload: bytes) -> int:
        req_id = next(self.ids)
        self.sock.send_multipart([p.encode_request(cmd, req_id, msg), *payload])
        return req_id

    def call(self, cmd: Cmd, msg: p.Message, *payload: bytes) -> list[object]:
        return self.reply(self.send(cmd, msg, *payload))

    def reply(self, req_id: int) -> list[object]:
        """The reply header to request ``req_id`` (others are skipped)."""
        while True:
            header = p.unpack_header(self.sock.recv_multipart()[0])
            if header[1] == req_id:
                return header


def zero_stride(handle: int, nbytes: int) -> p.TensorRef:
    """A view naming ``nbytes`` bytes that all read the same 4 bytes of a buffer."""
    return p.TensorRef(buffer=handle, dtype=DType.FLOAT32, shape=(nbytes // 4,), strides=(0,),
                       offset=0)


def test_materialized_replies_count_in_memory(make_worker: Callable[..., WorkerServer],
                                              make_client: Callable[..., Client],
                                              raw_socket: Callable[[int], zmq.Socket[bytes]]
                                              ) -> None:
    """Issue 13: GET of a zero-stride view of 64 bytes materialized 1 GiB outside --mem, and a
    client that did not read its replies left them all with the worker. Now a materialized
    reply counts until libzmq has handed it to the client's socket."""
    worker = make_worker(memory_limit=64 * MiB, max_buffer_size=64 * MiB)
    raw = Raw(raw_socket, worker.endpoint)
    assert raw.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=64))[0] == 0
    raw.sock.setsockopt(zmq.RCVHWM, 1)      # it reads nothing: its socket stops taking replies
    for _ in range(4):
        raw.send(Cmd.GET_TENSOR, p.GetTensor(tensor=zero_stride(1, 40 * MiB)))
    other = make_client(worker.endpoint)
    wait_until(lambda: other.device_memory().free <= 24 * MiB, 2.0,
               "one 40 MiB reply waits for the client, counted in --mem")
    with pytest.raises(OutOfMemory):
        other.alloc_buffer(32 * MiB)
    raw.sock.close(linger=0)                                  # gone: its replies with it
    wait_until(lambda: other.device_memory().free >= 64 * MiB - 64, 10,
               "the gone client's replies were given back")
    assert other.device_memory().free == 64 * MiB - 64        # all given back (but its buffer)


def test_graph_fetching_many_views_is_refused_whole(make_worker: Callable[..., WorkerServer],
                                                    make_client: Callable[..., Client]) -> None:
    worker = make_worker(memory_limit=64 * MiB, max_buffer_size=64 * MiB)
    c = make_client(worker.endpoint)
    buf = c.alloc_buffer(64)
    x = buf.tensor((4,), "float32")
    views = [x.view((6 * MiB,), (0,)) for _ in range(16)]       # 16 x 24 MiB
    g = Graph()
    g.scale(x, 1.0, out=x)
    with pytest.raises(OutOfMemory):
        c.compute(g, fetch=views)
    assert c.device_memory().free == 64 * MiB - 64           # nothing left charged
    (one,) = c.compute(g, fetch=views[:1])
    assert one.nbytes == 24 * MiB


def test_session_quotas(make_worker: Callable[..., WorkerServer],
                        make_client: Callable[..., Client]) -> None:
    worker = make_worker(memory_limit=64 * MiB, session_memory=16 * MiB)
    a, b = make_client(worker.endpoint), make_client(worker.endpoint)
    a.alloc_buffer(12 * MiB)
    with pytest.raises(OutOfMemory, match="session quota: memory"):
        a.alloc_buffer(8 * MiB)
    b.alloc_buffer(12 * MiB)                                 # another session has its own
    executor = worker._backend_thread.executor              # type: ignore[union-attr]
    assert executor.quotas.buffers == 16_384 and executor.quotas.graphs == 1_024


def test_one_session_leaves_a_quarter_of_memory_to_the_others(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client]) -> None:
    """Issue 13: the per-session default was --mem, so one greedy session could take it all.
    By default a session holds at most 3/4 of --mem (default_session_share)."""
    worker = make_worker(memory_limit=64 * MiB)              # --session-mem left out
    greedy, good = make_client(worker.endpoint), make_client(worker.endpoint)
    greedy.alloc_buffer(40 * MiB)
    with pytest.raises(OutOfMemory, match=r"per-session limit of 50,331,648 \(--session-mem\)"):
        greedy.alloc_buffer(16 * MiB)
    greedy.alloc_buffer(8 * MiB)                             # 48 MiB: all of its share
    good.alloc_buffer(16 * MiB)                              # the quarter left is the others'


def test_sessions_beyond_max_sessions_are_refused_clearly(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client]) -> None:
    """Connections and sessions were unbounded. The HELLO beyond --max-sessions gets a clear
    OUT_OF_MEMORY (the client's constructor raises it at once); when one session closes, a new
    one fits again; sessions silent for PRESSURE_SILENCE make room for a new one."""
    worker = make_worker(memory_limit=64 * MiB, max_sessions=3)
    clients = [make_client(worker.endpoint) for _ in range(3)]
    start = time.monotonic()
    with pytest.raises(OutOfMemory, match=r"already serves 3 sessions, its limit "
                                          r"\(--max-sessions 3\)"):
        Client(worker.endpoint)
    assert time.monotonic() - start < 5                      # refused, not timed out
    clients.pop().close()
    make_client(worker.endpoint).ping()                      # room again
    executor = worker._backend_thread.executor              # type: ignore[union-attr]
    for session in executor.sessions.values():               # as if their clients had gone
        session.last_seen -= 60
    make_client(worker.endpoint).ping()                      # the silent ones made room
    assert len(executor.sessions) == 1


def test_freed_buffer_is_not_kept_by_a_registered_graph(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client]) -> None:
    worker = make_worker(memory_limit=64 * MiB)
    c = make_client(worker.endpoint)
    buf = c.alloc_buffer(1 * MiB)
    x = buf.tensor((256 * 1024,), "float32")
    g = Graph()
    g.scale(x, 2.0, out=x)
    h = c.register(g)
    c.run(h)
    executor = worker._backend_thread.executor              # type: ignore[union-attr]
    (graph,) = next(iter(executor.sessions.values())).graphs.values()
    assert graph.views is not None
    buf.free()
    c.synchronize()
    assert graph.views is None                               # no view keeps the freed mapping


def test_silent_sessions_make_room_when_memory_is_short(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """Issue 13: 2,000 identities that each allocate 1 MiB and vanish locked a well-behaved
    client out with OUT_OF_MEMORY for the whole 30 s session timeout."""
    worker = make_worker(memory_limit=64 * MiB, session_timeout=30.0)
    for _ in range(60):
        raw = Raw(raw_socket, worker.endpoint)
        raw.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=1 * MiB))
        raw.sock.close(linger=0)
    c = make_client(worker.endpoint)

    def allocated() -> bool:
        try:
            c.alloc_buffer(32 * MiB)
        except OutOfMemory:
            return False
        return True
    waited = wait_until(allocated, 10, "the closed sessions' memory was given back",
                        interval=0.05)
    print(f"locked out for {waited:.1f} s (the session timeout is 30 s)")
    assert waited < 8


def test_queue_quota_answers_a_flood_behind_a_waiting_receive(
        make_worker: Callable[..., WorkerServer], raw_socket: Callable[[int], zmq.Socket[bytes]]
        ) -> None:
    worker = make_worker(memory_limit=64 * MiB)
    raw = Raw(raw_socket, worker.endpoint)
    raw.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=64))
    dst = p.TensorRef(buffer=1, dtype=DType.UINT8, shape=(64,), strides=(1,), offset=0)
    raw.send(Cmd.PEER_RECV, wire.PeerRecv(token=os.urandom(16), dst=dst, timeout_ms=20_000))
    for _ in range(5000):                                   # all wait behind the receive
        raw.send(Cmd.PING, p.Empty())
    refused = 0
    deadline = time.monotonic() + 20
    while refused < 5000 - 4096 and time.monotonic() < deadline:
        if raw.sock.poll(1000):
            header = p.unpack_header(raw.sock.recv_multipart()[0])
            refused += header[0] == p.ErrorCode.OUT_OF_MEMORY and "queued requests" in header[2]
    assert refused == 5000 - 4096


def test_peer_send_to_a_dead_port_fails_at_once_and_holds_nothing(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """Issue 13: PEER_SEND of a zero-stride view to a port nobody listens on queued 1 GiB on
    the PUSH link, and GOODBYE never dropped it. Since issue 24 (point 9) a send on a link seen
    closed fails at once, as PEER_UNREACHABLE, and gives back what it materialized; the session
    and the worker's memory are as before the send."""
    worker = make_worker(memory_limit=64 * MiB, max_buffer_size=64 * MiB)
    peer = make_worker(memory_limit=64 * MiB)
    dead = peer._backend_thread.peers.endpoint                # type: ignore[union-attr]
    raw = Raw(raw_socket, worker.endpoint)
    raw.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=64))
    assert raw.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=dead, timeout_ms=5000))[0] == 0
    other = make_client(worker.endpoint)
    peer.stop()                                               # verified, then dead
    reply = raw.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16),
                                                  src=zero_stride(1, 32 * MiB),
                                                  endpoint=dead, timeout_ms=60_000))
    assert reply[0] == p.ErrorCode.PEER_UNREACHABLE, reply
    assert f"cannot reach worker {dead}" in str(reply[2])
    wait_until(lambda: other.device_memory().free >= 64 * MiB - 64, 5,   # (counted in --mem
               "the peer's ack connection into this worker closed")  # while open: peer/queue.py)
    assert other.device_memory().free == 64 * MiB - 64       # only the session's buffer
    raw.send(Cmd.GOODBYE, p.Empty())
    wait_until(lambda: other.device_memory().free >= 64 * MiB, 5, "GOODBYE gave all back")
    assert other.device_memory().free == 64 * MiB


class StalledPeer:
    """A peer port that answers one probe (the peer handshake) like a worker, then never reads
    again and keeps its connection open: libzmq stops reading a connection once its queue
    (RCVHWM 1) is full, so what the sender pushes next waits on the sender's side."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.ctx = ctx
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 1)
        self.pull.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)

    def answer_probe(self) -> zmq.Socket[bytes]:
        """Answer the probe that comes; returns the socket the answer went on (the caller
        closes it once the prober heard it)."""
        assert self.pull.poll(10_000), "no probe came"
        probe = wire.decode_peer(self.pull.recv_multipart())
        assert isinstance(probe, wire.Probe)
        ack = self.ctx.socket(zmq.PUSH)
        ack.setsockopt(zmq.LINGER, 0)
        ack.connect(probe.reply_to)
        ack.send(wire.encode_peer(wire.Ack(probe.token, True, "probe")))
        return ack

    def close(self) -> None:
        self.pull.close(linger=0)


def free_becomes(client: Client, check: Callable[[int], bool], limit: float = 5.0) -> int:
    """The worker's free memory, once ``check`` holds for it (or ``limit`` s have passed)."""
    deadline = time.monotonic() + limit
    free = client.device_memory().free
    while not check(free) and time.monotonic() < deadline:
        time.sleep(0.02)
        free = client.device_memory().free
    return free


def queue_behind_a_stalled_peer(other: Client, session: Raw, peer: StalledPeer) -> int:
    """``session`` (of a worker with --mem 64 MiB, ``other`` a client of it) probes ``peer``,
    then sends it a 44 MiB zero-stride view, materialized chunk by chunk (4 MiB each); returns
    the send's request id once the chunks that wait on the link are counted. At least 24 MiB
    must be: past the link are at most the 2 chunks the stalled peer's libzmq took (its queue
    of 1, the one it decodes) and the two kernel buffers' worth (here at most 4 MiB sent and
    what the receiver's autotuning grew to without reads; measured: 2-4 of the 11 chunks
    left, 28-36 MiB stayed counted)."""
    session.call(Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=64))
    probe = session.send(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=peer.endpoint, timeout_ms=10_000))
    ack = peer.answer_probe()
    assert session.reply(probe)[0] == 0                       # handshake done: it may push there
    ack.close(linger=0)               # its connection into the worker is counted while open
    assert free_becomes(other, lambda free: free == 64 * MiB - 64) == 64 * MiB - 64
    send = session.send(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16),
                                                     src=zero_stride(1, 44 * MiB),
                                                     endpoint=peer.endpoint, timeout_ms=60_000))
    free = free_becomes(other, lambda free: free <= 40 * MiB)
    assert free <= 40 * MiB, f"the queued push is not counted: {free / MiB:.1f} MiB free"
    with pytest.raises(OutOfMemory):
        other.alloc_buffer(44 * MiB)          # fits an idle worker (a session may take 48 MiB)
    assert other.device_memory().free <= 40 * MiB                 # still counted
    assert not session.sock.poll(0), "the send ended: nothing waits on the link any more"
    return send


@pytest.mark.parametrize("end", ["goodbye", "peer closes"])
def test_a_peer_push_queued_behind_a_stalled_peer_is_counted_until_it_ends(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client],
        raw_socket: Callable[[int], zmq.Socket[bytes]],
        zmq_ctx: zmq.Context[zmq.Socket[bytes]], end: str) -> None:
    """Issue 24 (point 10): what a worker materialized for a peer push counts in --mem while
    it waits on the link. The peer answered the handshake, then stalled with its connection
    open (the link stays up: its heartbeat ping waits behind the half-written chunk; measured
    up for 10 s and more, 3 runs of 3): the chunks it does not take stay counted, and another
    client's alloc that would fit an idle worker gets OutOfMemory. They are given back when
    the session says GOODBYE (the link it queued on is dropped), or when the peer closes its
    connection (the send fails as PEER_UNREACHABLE and drops the link; the session keeps only
    its buffer). Lost since 28c3880, whose send to a stopped peer now fails at once."""
    worker = spawn_worker("--mem", "64MiB", "--max-buffer", "64MiB")
    other = make_client(worker.endpoint)
    session = Raw(raw_socket, worker.endpoint)
    peer = StalledPeer(zmq_ctx)
    try:
        send = queue_behind_a_stalled_peer(other, session, peer)
        if end == "goodbye":
            session.send(Cmd.GOODBYE, p.Empty())
            assert session.reply(send)[0] == p.ErrorCode.NO_SESSION   # still queued until then
            expected = 64 * MiB
        else:
            peer.close()
            reply = session.reply(send)
            assert reply[0] == p.ErrorCode.PEER_UNREACHABLE, reply
            assert f"cannot reach worker {peer.endpoint}" in str(reply[2])
            expected = 64 * MiB - 64
        assert free_becomes(other, lambda free: free == expected) == expected
    finally:
        peer.close()


def few_ms_graph(client: Client, adds: int) -> Any:
    """A registered graph of ``adds`` 4 MiB adds over a buffer of its own (a few ms a run), run
    once so that its arena and kernels are ready."""
    x = client.alloc_buffer(4 << 20).tensor((1 << 20,), "float32")
    g = Graph()
    y = x
    for _ in range(adds):
        y = g.add(y, x)
    g.scale(y, 0.5, out=x)
    handle = client.register(g)
    client.run(handle)
    return handle


def test_a_greedy_clients_queue_does_not_hold_another_clients_reply(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    """A greedy client pipelines 150 graph runs of a few ms each, each followed by a small alloc;
    another client's STATUS, ping, STATUS are answered after a few of them, not after the worker
    has gone through a PAIR's worth or the lot.

    Counted, not timed: STATUS tells the greedy session's buffers, so the two STATUS replies
    say how many of its allocs ran while the ping went there and back. Before the backend read
    its PAIR ahead and served clients in turn (worker/dispatch/inbox.py), the ping waited behind the 64
    requests the PAIR held, and each reply waited in the PAIR until libzmq's proxy had pushed
    every request still queued at the ROUTER (the fuzzer's probe, behind four hostile sessions,
    once waited more than 5 s in CI)."""
    worker = spawn_worker("--mem", "256MiB")
    greedy = make_client(worker.endpoint, timeout=60.0)         # the default timeout
    polite = make_client(worker.endpoint, timeout=60.0)
    handle = few_ms_graph(greedy, 16)
    polite.ping()
    futures: list[Any] = []
    for _ in range(150):
        futures += [greedy.run_async(handle), greedy.alloc_buffer_async(4096)]
    wait_until(lambda: any(f.done() for f in futures), 10, "the worker is into greedy's requests")
    before = polite.status().buffers
    polite.ping()
    during = polite.status().buffers - before
    for f in futures:
        f.result()
    print(f"greedy allocs: {before - 1} done before the first STATUS, {during} between the two")
    assert before < 100, "the greedy runs were too quick to queue up: make them longer"
    assert during <= 16


POLITE = r"""
import json, os, sys, zmq
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.ROUTING_ID, b"P" + os.urandom(15))
d.setsockopt(zmq.RCVTIMEO, 30_000)
d.connect(sys.argv[1])
major, minor = p.PROTOCOL_VERSION
d.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor, client="polite")))
d.recv_multipart()
burst = [p.encode_request(Cmd.STATUS, 2, p.Empty()),
         *[p.encode_request(Cmd.PING, 3 + i, p.Empty()) for i in range(10)],
         p.encode_request(Cmd.STATUS, 13, p.Empty())]
print("ready", flush=True)
sys.stdin.readline()
for frame in burst:
    d.send(frame)
replies = {}
while len(replies) < len(burst):
    header = p.unpack_header(d.recv_multipart()[0])
    replies[header[1]] = header
first, second = (p.decode_reply(Cmd.STATUS, replies[i]) for i in (2, 13))
print(json.dumps([first.buffers, second.buffers]), flush=True)
d.close(linger=0)
ctx.term()
"""


def test_a_polite_client_waits_for_no_turn_of_the_greedy_ones(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    """Four greedy clients pipeline 30 graph runs of a few ms each, each followed by a small alloc;
    another session sends STATUS, ten pings, STATUS in one burst. Its requests go before the greedy ones
    (it used almost no backend time), not one per turn behind one request of each greedy client.

    Counted, not timed: STATUS tells the buffers, so the two STATUS replies say how many greedy
    allocs ran in between. Served in plain turns (the inbox's first version) that was ~20 (each
    of the twelve polite requests waited for one request of each of the four: the fuzzer's probe
    behind four hostile sessions' graph decodes); by backend time used, at most a few.

    The polite session is its own process (:data:`POLITE`) with one thread, which sends its
    twelve requests, encoded beforehand, within microseconds: the count then says in what order
    the worker served them, not how the sending process was scheduled. Sent from this process,
    each send gives up the GIL and the four greedy clients' I/O threads may keep it for a switch
    interval (5 ms) before the next: with two CPU hogs beside the suite, 6 greedy allocs ran in
    between (CI loop run 5 of afa36de), the burst reaching the worker a few requests at a time."""
    worker = spawn_worker("--mem", "256MiB")
    greedy = [make_client(worker.endpoint) for _ in range(4)]
    runs = [few_ms_graph(client, 8) for client in greedy]
    futures: list[Any] = []
    with subprocess.Popen([sys.executable, "-c", POLITE, worker.endpoint], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as polite:
        assert polite.stdout is not None and polite.stdin is not None
        try:
            assert polite.stdout.readline().strip() == "ready"
            for _ in range(30):
                for client, handle in zip(greedy, runs):
                    futures += [client.run_async(handle), client.alloc_buffer_async(4096)]
            wait_until(lambda: any(f.done() for f in futures), 10,
                       "the worker is into greedy's requests")
            polite.stdin.write("go\n")
            polite.stdin.flush()
            before, after = json.loads(polite.stdout.readline())
            assert polite.wait(30) == 0
        finally:
            polite.kill()
    for f in futures:
        f.result()
    print(f"greedy allocs: {before - 4} before the first STATUS, {after - before} between")
    assert before - 4 < 100, "the greedy runs were too quick to queue up: make them longer"
    assert after - before <= 4
