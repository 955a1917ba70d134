"""One greedy or hostile session cannot starve the others, nor grow the worker without bound.

A flooder (its own process, so it never shares our GIL) pipelines 64 KiB SET_TENSORs as fast as it
can and never reads a reply; meanwhile a well-behaved client with default settings pings. Issue 13
measured a median ping of 0.12 ms rising to 156 ms and the worker's RSS to 641 MiB (3.2 GiB when
the backend was busy); before bounded queues the same flood here timed a ping out after 60 s.
Stated bound: the median ping under the flood stays within 10x of the idle median measured just
before (plus 1 ms for scheduler noise on 2 shared cores), and the worker's RSS under 120 MiB.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from conftest import WorkerProcess
from zmq_rpc.client import Client

pytestmark = pytest.mark.timeout(120)

FLOODER = r"""
import os, sys, time, zmq
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd, DType
ep, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.setsockopt(zmq.ROUTING_ID, b"F" + os.urandom(15))
d.setsockopt(zmq.SNDHWM, 0)
d.connect(ep)
major, minor = p.PROTOCOL_VERSION
d.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor, client="flood")))
d.recv_multipart()
d.send(p.encode_request(Cmd.ALLOC_BUFFER, 2, p.AllocBuffer(handle=1, size=65536)))
d.recv_multipart()
ref = p.TensorRef(buffer=1, dtype=DType.UINT8, shape=(65536,), strides=(1,), offset=0)
header = p.encode_request(Cmd.SET_TENSOR, 3, p.SetTensor(tensor=ref))
print("flooding", flush=True)
end, n = time.monotonic() + seconds, 0
while time.monotonic() < end and n < 200_000:
    d.send_multipart([header, bytes(65536)])
    n += 1
print("sent", n, flush=True)
d.close(linger=0)
ctx.term()
"""


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def ping_ms(client: Client, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        client.ping()
        out.append((time.perf_counter() - start) * 1e3)
        time.sleep(0.002)
    return out


def test_flooding_session_does_not_starve_another(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client]) -> None:
    worker = spawn_worker("--mem", "256MiB")
    client = make_client(worker.endpoint, timeout=60.0)        # the default timeout
    ping_ms(client, 50)
    idle = statistics.median(ping_ms(client, 300))
    flood = subprocess.Popen([sys.executable, "-c", FLOODER, worker.endpoint, "15"],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert flood.stdout is not None and flood.stdout.readline().startswith("flooding")
        time.sleep(1.0)                                # the queues are full by now
        busy_samples = ping_ms(client, 300)
        rss = rss_mib(worker.proc.pid)
    finally:
        flood.kill()
        flood.communicate(timeout=30)
    busy = statistics.median(busy_samples)
    print(f"ping median idle {idle:.3f} ms, under flood {busy:.3f} ms ({busy / idle:.1f}x), "
          f"p99 {sorted(busy_samples)[296]:.1f} ms; worker RSS {rss} MiB")
    assert busy <= 10 * idle + 1.0
    assert rss < 120              # 169 MiB here with unbounded queues (641 MiB in the issue)
    client.alloc_buffer(1 << 20)                      # and the worker still serves
