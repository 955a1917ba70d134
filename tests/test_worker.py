"""Worker lifecycle: sessions freed on goodbye, death and silence; signals; CLI; packaging layout."""

from __future__ import annotations

import ast
import configparser
import json
import logging
import math
import pathlib
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import pytest
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.client import Client, ConnectionLost, Graph, RegisteredGraph, RemoteTensor, RpcError
from zmq_rpc.client.files import query_file
from zmq_rpc.worker.cli import parse_size
from zmq_rpc.worker.server import WorkerConfig, WorkerServer

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_goodbye_frees_the_session(worker: WorkerServer,
                                   make_client: Callable[..., Client]) -> None:
    observer = make_client(worker.endpoint)
    total = observer.device_memory().total
    leaving = make_client(worker.endpoint)
    leaving.alloc_buffer(64 << 20)
    assert observer.device_memory().free == total - (64 << 20)
    leaving.close()
    wait_until(lambda: observer.device_memory().free == total, 10.0,
               "the closed client's buffer was freed")


def test_killed_client_session_expires(make_worker: Callable[..., WorkerServer],
                                       make_client: Callable[..., Client],
                                       caplog: pytest.LogCaptureFixture) -> None:
    worker = make_worker(memory_limit=256 << 20, session_timeout=1.0)
    observer = make_client(worker.endpoint, heartbeat=0.2)
    script = ("import sys, os; from zmq_rpc.client import Client\n"
              "c = Client(sys.argv[1]); c.alloc_buffer(100 << 20)\n"
              "print('allocated', flush=True); os._exit(0)\n")   # dies without goodbye
    with caplog.at_level(logging.INFO, logger="zmq_rpc.worker"):
        out = subprocess.run([sys.executable, "-c", script, worker.endpoint], capture_output=True,
                             text=True, timeout=30)
        assert "allocated" in out.stdout, out.stderr
        assert observer.device_memory().free == (256 - 100) << 20
        wait_until(lambda: observer.device_memory().free == 256 << 20, 10,
                   "the dead client's session expired and its buffer was freed")
    assert any("no message for" in r.getMessage() for r in caplog.records)
    again = make_client(worker.endpoint)
    again.alloc_buffer(180 << 20)   # the memory is reusable (3/4 of --mem: one session's share)


def test_heartbeat_keeps_an_idle_session_alive(make_worker: Callable[..., WorkerServer],
                                               make_client: Callable[..., Client]) -> None:
    worker = make_worker(session_timeout=0.6)
    client = make_client(worker.endpoint, heartbeat=0.1)
    buf = client.alloc_buffer(1024)
    t = buf.tensor(4, "int32")
    client.set_tensor(t, np.arange(4, dtype=np.int32))
    time.sleep(2.0)                      # idle, longer than the session timeout
    np.testing.assert_array_equal(client.get_tensor(t), np.arange(4))


def test_silent_client_loses_its_session(make_worker: Callable[..., WorkerServer],
                                         make_client: Callable[..., Client]) -> None:
    worker = make_worker(session_timeout=0.5)
    client = make_client(worker.endpoint, heartbeat=30.0)   # heartbeats too rare on purpose
    buf = client.alloc_buffer(1024)
    time.sleep(1.6)                      # silent, longer than the session timeout
    with pytest.raises(ConnectionLost, match="no session"):
        client.get_tensor(buf.tensor(4, "int32"))


def test_sigterm_answers_or_fails_in_flight(spawn_worker: Callable[..., WorkerProcess],
                                            make_client: Callable[..., Client]) -> None:
    """``--drain-timeout 0``: SIGTERM stops at once (the default drains first:
    test_recovery.py's drain tests)."""
    proc = spawn_worker("--drain-timeout", "0")
    client = make_client(proc.endpoint, timeout=15)
    buf = client.alloc_buffer(64 << 20)
    t = buf.tensor(16 << 20, "float32")
    values = np.ones(16 << 20, np.float32)
    futures: list[Future[object]] = []
    for _ in range(20):
        futures.append(client.set_tensor_async(t, values))
        futures.append(client.get_tensor_async(t[:1024]))
    futures[0].result(timeout=15)     # the worker is busy with the rest (on a loaded machine
    assert proc.terminate(signal.SIGTERM) == 0          # a fixed sleep could end before any)
    outcomes = {"ok": 0, "failed": 0}
    for future in futures:
        try:
            future.result(timeout=20)
            outcomes["ok"] += 1
        except RpcError:
            outcomes["failed"] += 1
    assert sum(outcomes.values()) == len(futures)   # every future resolved, none hangs
    assert outcomes["ok"] >= 1


def test_sigint_exits_zero(spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker()
    assert proc.terminate(signal.SIGINT) == 0


def test_cli_version_and_sizes() -> None:
    out = subprocess.run([sys.executable, "-m", "zmq_rpc.worker.cli", "--version"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("zmq-rpc ")
    from importlib.metadata import version  # the installed metadata: setup.cfg reads VERSION
    assert out.stdout.split()[1] == version("zmq-rpc")
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_cli_mem_limit(spawn_worker: Callable[..., WorkerProcess],
                       make_client: Callable[..., Client]) -> None:
    proc = spawn_worker("--mem", "8MiB")
    client = make_client(proc.endpoint)
    assert client.device_memory().total == 8 << 20
    with pytest.raises(RpcError, match="over the maximum buffer size 8388608"):
        client.alloc_buffer(9 << 20)
    client.alloc_buffer(6 << 20)
    with pytest.raises(RpcError, match="does not fit: 2097152 of 8388608 bytes free"):
        client.alloc_buffer(3 << 20)


def test_warning_when_binding_beyond_loopback_insecurely(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.worker"):
        server = WorkerServer(WorkerConfig(bind="tcp://0.0.0.0:*", insecure=True))
        server.start()
        server.stop()
    assert any("INSECURE: listening on tcp://0.0.0.0" in r.getMessage()
               for r in caplog.records)


def test_setup_cfg_lists_every_package_folder() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    mapping = dict(line.split(" = ") for line in
                   cfg["options"]["package_dir"].strip().splitlines())
    folders = {p.parent for p in ROOT.glob("*/**/__init__.py")
               if not any(part in {"tests", "build"} or part.startswith(".")
                          for part in p.relative_to(ROOT).parts)}
    for folder in folders:
        rel = folder.relative_to(ROOT).as_posix()
        top = rel.split("/")[0]
        package = "zmq_rpc." + ".".join([top, *rel.split("/")[1:]])
        assert package in listed, f"{rel} is not listed in setup.cfg packages"
        assert mapping.get(f"zmq_rpc.{top}") == top


# ------------------------------------------------------------------ faults a worker meets from clients


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB (Linux /proc)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


needs_proc = pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(),
                                reason="reads worker memory from /proc")

SLOW_CLIENT = """
import collections, sys
import numpy as np
from zmq_rpc.client import Client, ConnectionLost, RpcError
client = Client(sys.argv[1])
tensor = client.alloc_buffer(16 << 20).tensor(4 << 20, "float32")
client.set_tensor(tensor, np.arange(4 << 20, dtype=np.float32))
futures = [client.get_tensor_async(tensor) for _ in range(64)]     # 1 GiB of replies
print("issued", flush=True)
outcomes = collections.Counter()
for future in futures:
    try:
        outcomes["ok" if future.result()[-1] == (4 << 20) - 1 else "wrong"] += 1
    except ConnectionLost:
        outcomes["ConnectionLost"] += 1
import time
from zmq_rpc.client import SessionLost
deadline = time.monotonic() + 15      # its own heartbeat may have dropped the connection while
while True:                           # it was frozen: new calls fail until it is back up
    try:
        client.ping()
        outcomes["ping ok"] += 1
        break
    except SessionLost as exc:
        outcomes["ping " + type(exc).__name__] += 1
        break
    except RpcError as exc:
        if time.monotonic() > deadline:
            outcomes["ping " + type(exc).__name__] += 1
            break
        time.sleep(0.1)               # (in the child: polls until the worker is back)
print(repr(dict(outcomes)), flush=True)
client.close()
"""


@needs_proc
@pytest.mark.timeout(120)
def test_a_client_that_stops_reading_holds_up_no_one(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """A client frozen with 1 GiB of replies due (SIGSTOP: it reads nothing, answers no
    heartbeat) for longer than the heartbeat timeout: two other clients go on with every reply
    right and none waiting on it; the worker queues the frozen one's replies without copying
    them. Thawed, the frozen client gets each reply right or, for those its own heartbeat check
    gave up on first (it heard nothing while frozen), ConnectionLost: never a wrong or a lost
    reply, never a hang; and it goes on working."""
    proc = spawn_worker()
    slow = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, proc.endpoint],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert slow.stdout is not None and slow.stdout.readline().strip() == "issued"
        slow.send_signal(signal.SIGSTOP)
        frozen_at, rss_before = time.monotonic(), rss_mib(proc.proc.pid)
        data = np.random.default_rng(0).random(1 << 18).astype(np.float32)
        with Client(proc.endpoint) as a, Client(proc.endpoint) as b:
            views = [(c, c.alloc_buffer(1 << 20).tensor(1 << 18, "float32")) for c in (a, b)]
            slowest = 0.0
            while time.monotonic() - frozen_at < 6.0:        # past the 5 s heartbeat timeout
                for client, view in views:
                    start = time.monotonic()
                    client.set_tensor(view, data)
                    np.testing.assert_array_equal(client.get_tensor(view), data)
                    slowest = max(slowest, time.monotonic() - start)
        assert slowest < 5.0, f"a round trip waited {slowest:.1f} s beside the frozen client"
        assert rss_mib(proc.proc.pid) - rss_before < 256, "the frozen client's replies were copied"
        slow.send_signal(signal.SIGCONT)
        got = ast.literal_eval(slow.stdout.readline().strip())
        print(f"the frozen client got {got}; the others' slowest round trip {slowest:.3f} s")
        assert got.get("ok", 0) + got.get("ConnectionLost", 0) == 64, got
        assert got.get("ping ok") == 1, got
        assert slow.wait(60) == 0
    finally:
        slow.send_signal(signal.SIGCONT)
        slow.kill()
        slow.wait()
        if slow.stdout is not None:
            slow.stdout.close()


@needs_proc
@pytest.mark.timeout(300)
def test_ten_thousand_sessions_leave_the_worker_as_it_was(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """10,000 clients (32 at a time, default worker settings) each open a signed session (the
    key exchange our client makes), allocate, write and leave: the worker's resident memory
    stays within 8 MiB of where 200 warm-up sessions left it (a leak of 1 KiB per session would
    show 10 MiB) and every byte is free again. The clients are bare protocol DEALERs speaking
    exactly our client's requests: the worker sees the same messages, and the test spends its
    time on the worker rather than on 10,000 client threads starting and stopping."""
    import threading

    import zmq
    from zmq_rpc.broker import protocol as p
    from zmq_rpc.broker.wire import DType, TensorRef
    from zmq_rpc.tools.baselines import ProtocolDealer

    proc = spawn_worker()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    errors: list[BaseException] = []
    ones = np.ones(16, np.float32).tobytes()
    view = TensorRef(buffer=1, dtype=DType.FLOAT32, shape=(16,), strides=(4,), offset=0)

    def sessions(count: int) -> None:
        try:
            for _ in range(count):
                client = ProtocolDealer(ctx, proc.endpoint, signed=True)
                try:
                    client.call(p.Cmd.ALLOC_BUFFER, p.AllocBuffer(handle=1, size=1 << 20))
                    client.call(p.Cmd.SET_TENSOR, p.SetTensor(tensor=view), ones)
                    client.call(p.Cmd.GOODBYE, p.Empty())
                finally:
                    client.close()
        except BaseException as exc:          # reported by the test thread
            errors.append(exc)

    def run(total: int) -> None:
        threads = [threading.Thread(target=sessions, args=(total // 32 + (i < total % 32),))
                   for i in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [], errors[:3]

    try:
        run(200)
        before = rss_mib(proc.proc.pid)
        run(10_000)
        time.sleep(1.0)         # RSS settles (the allocator gives pages back): no event to wait on
        after = rss_mib(proc.proc.pid)
        with Client(proc.endpoint, ctx=ctx) as observer:
            memory = observer.device_memory()
            assert memory.free == memory.total
    finally:
        ctx.destroy(linger=0)       # a failed session may have left its socket open
    print(f"worker RSS {before:.1f} MiB before, {after:.1f} MiB after 10,000 sessions")
    assert after - before < 8, f"worker RSS grew {after - before:.1f} MiB over 10,000 sessions"


VANISHING_CLIENT = """
import sys
from zmq_rpc.client import Client, ConnectionLost
client = Client(sys.argv[1])
buffer = client.alloc_buffer(int(sys.argv[2]))
print("allocated", flush=True)
sys.stdin.readline()                                  # frozen or killed while waiting here
try:
    client.alloc_buffer(1024)
    print("served", flush=True)
except ConnectionLost as exc:                         # or a subclass that says more
    print(f"ConnectionLost: {exc}", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL])
def test_a_frozen_or_vanished_client_has_its_session_freed_within_the_session_timeout(
        spawn_worker: Callable[..., WorkerProcess], fault: signal.Signals) -> None:
    """Its buffers are back within the session timeout (+1 s: the worker checks every second);
    a frozen client that wakes up later is told its session is gone, never served silently."""
    timeout, size = 3.0, 100 << 20
    proc = spawn_worker("--session-timeout", str(timeout))
    with Client(proc.endpoint) as observer:
        total = observer.device_memory().total
        client = subprocess.Popen([sys.executable, "-c", VANISHING_CLIENT, proc.endpoint,
                                   str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert client.stdin is not None and client.stdout is not None
        try:
            assert client.stdout.readline().strip() == "allocated"
            assert observer.device_memory().free == total - size
            client.send_signal(fault)
            start = time.monotonic()
            wait_until(lambda: observer.device_memory().free == total, timeout + 10,
                       "the vanished client's memory was freed")
            freed_after = time.monotonic() - start
            print(f"{fault.name}: session freed after {freed_after:.2f} s")
            assert freed_after <= timeout + 1.5
            if fault == signal.SIGSTOP:
                client.send_signal(signal.SIGCONT)
                client.stdin.write("go\n")
                client.stdin.flush()
                assert client.stdout.readline().startswith("ConnectionLost:")
                assert client.wait(30) == 0
        finally:
            client.kill()
            client.wait()
            client.stdin.close()
            client.stdout.close()


def sparse_safetensors(path: pathlib.Path, size: int) -> None:
    """A model file of one ``size``-byte tensor, its data a hole: instant to write, and its
    hash still reads every byte (32 MiB: 0.02-0.2 s here, under load)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}})
    raw = header.encode().ljust(-(-len(header) // 8) * 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + size)


N = 1024
"""Side of the identity matrices the long graphs multiply (a matmul: 24-54 ms here under load)."""


def long_graph(client: Client, seconds: float) -> tuple[RegisteredGraph, RemoteTensor]:
    """A graph that keeps this worker busy at least ``seconds`` (a chain of matmuls of an
    identity matrix, summed into the tensor returned: N), sized from the fastest of five runs of
    a chain of 8 (the worker's compute time): a load that comes and goes only makes the long
    chain slower."""
    a = client.alloc_buffer(N * N * 4).tensor((N, N), "float32")
    client.set_tensor(a, np.eye(N, dtype=np.float32))
    out = client.alloc_buffer(4).tensor((1,), "float32")
    chain = chain_of(client, 8, a, out)
    fastest = min(client.run(chain).compute_seconds for _ in range(5))
    return chain_of(client, math.ceil(seconds / (fastest / 8)), a, out), out


def chain_of(client: Client, matmuls: int, a: RemoteTensor, out: RemoteTensor) -> RegisteredGraph:
    """``a`` multiplied by itself ``matmuls`` times, summed into the one-element ``out``."""
    g, x = Graph(), a
    for _ in range(matmuls):
        x = g.matmul(x, a)
    g.sum(g.reshape(x, (N * N,)), axis=0, keepdims=True, out=out)
    return client.register(g)


def run_behind_a_hash(client: Client, long: RegisteredGraph, out: RemoteTensor) -> float:
    """Run ``long`` from the pump that the end of a file's hash starts; its compute seconds.
    Queued behind a FILE_QUERY of ``big.safetensors`` (in ``--model-dir``), held while the
    hashing thread reads the file, it runs when the worker's loop collects the hash, and the loop
    goes on to its session expiry without reading the PAIR in between: what the clients sent
    meanwhile is not read yet there (a transfer's end pumps the same way)."""
    asked = time.monotonic()
    query = query_file(client, "big.safetensors")
    run = client.run_async(long, fetch=[out])              # queued behind it at once
    assert query.result().found
    hashed = time.monotonic() - asked
    result = run.result()
    assert result[0][0] == N                               # identity matrices: the sum is N
    print(f"hashed in {hashed:.2f} s, then the graph ran {result.compute_seconds:.2f} s")
    return result.compute_seconds


@pytest.mark.timeout(60)
def test_a_request_longer_than_the_session_timeout_does_not_expire_its_own_session(
        spawn_worker: Callable[..., WorkerProcess], tmp_path: pathlib.Path) -> None:
    """A request may run past ``--session-timeout`` (a first-use kernel compile during a model
    load did): its client waits for it, it is not silent. Here the graph is shorter than the
    client's heartbeat (2 s), so the client sends nothing meanwhile: the old worker expired the
    session as soon as it had answered (its last message was the request), and the client's next
    request got SessionLost."""
    timeout = 0.5       # a graph of twice this mostly stays below the heartbeat (2 s)
    sparse_safetensors(tmp_path / "big.safetensors", 32 << 20)      # hashed well within 0.5 s
    proc = spawn_worker("--session-timeout", str(timeout), "--model-dir", str(tmp_path))
    with Client(proc.endpoint) as client:
        long, out = long_graph(client, 2 * timeout)
        ran = run_behind_a_hash(client, long, out)
        assert ran > timeout, "the case: a request longer than the session timeout"
        assert client.get_tensor(out)[0] == N


@pytest.mark.timeout(120)
def test_a_request_longer_than_the_session_timeout_expires_neither_its_session_nor_others(
        spawn_worker: Callable[..., WorkerProcess], tmp_path: pathlib.Path) -> None:
    """As above, with requests long enough for the clients' heartbeats: the pings that came
    while the graph ran, of its client and of another, must count; the old worker expired both
    sessions before it read them (each next request: SessionLost)."""
    timeout = 3.0       # above the client's heartbeat (2 s): idle default clients keep theirs
    sparse_safetensors(tmp_path / "big.safetensors", 32 << 20)
    proc = spawn_worker("--session-timeout", str(timeout), "--model-dir", str(tmp_path))
    with Client(proc.endpoint) as waiting, Client(proc.endpoint) as other:
        mark = other.alloc_buffer(4).tensor((1,), "float32")
        other.set_tensor(mark, np.array([7.0], np.float32))
        long, out = long_graph(waiting, 2 * timeout)
        ran = run_behind_a_hash(waiting, long, out)
        assert ran > timeout, "the case: a request longer than the session timeout"
        mine, theirs = waiting.get_tensor_async(out), other.get_tensor_async(mark)
        lost = {name: type(f.exception()).__name__
                for name, f in (("waiting", mine), ("other", theirs)) if f.exception()}
        assert lost == {}
        assert mine.result()[0] == N and theirs.result()[0] == 7.0
