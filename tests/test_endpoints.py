"""Endpoints read the way libzmq reads them (broker/endpoints.py) and what follows from it, with
real ``zmq-rpc-worker`` processes: no listening beyond loopback through a ``SRC;`` bind, IPv6
endpoints, a taken peer port, ``--metrics-port 0``, ``status`` without a key. Issue 24 (1, 11)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import WorkerProcess
from zmq_rpc.broker.endpoints import EndpointError, bind_endpoint, parse_endpoint
from zmq_rpc.broker.keys import generate_keypair, load_keypair
from zmq_rpc.client import Client

pytestmark = pytest.mark.timeout(60)

WORKER = [sys.executable, "-m", "zmq_rpc.worker.cli", "--log-level", "WARNING"]


@pytest.mark.parametrize(("text", "host", "loopback"), [
    ("tcp://127.0.0.1:5", "127.0.0.1", True),
    ("tcp://127.0.0.1:*", "127.0.0.1", True),
    ("tcp://[::1]:5", "::1", True),
    ("tcp://localhost:5", "localhost", True),
    ("tcp://10.0.0.1:1;127.0.0.1:5", "127.0.0.1", True),
    ("tcp://127.0.0.1:1;0.0.0.0:5", "0.0.0.0", False),       # libzmq binds what follows ';'
    ("tcp://127.0.0.1:1;[::]:5", "::", False),
    ("tcp://*:*", "*", False),
    ("tcp://lo:5", "lo", False),                               # interface names: not loopback
    ("tcp://[fe80::1%eth0]:5", "fe80::1%eth0", False),
    ("ipc:///tmp/x", None, True),
    ("ipc://@abstract", None, True),
    ("inproc://x", None, True),
])
def test_the_host_is_what_libzmq_binds(text: str, host: str | None, loopback: bool) -> None:
    endpoint = parse_endpoint(text)
    assert (endpoint.host.text if endpoint.host else None) == host
    assert endpoint.is_loopback() is loopback


@pytest.mark.parametrize(("text", "why"), [
    ("127.0.0.1:5", "has no scheme"),
    ("pgm://eth0;239.1.1.1:5", "scheme 'pgm' is not one of"),
    ("tcp://127.0.0.1", "needs tcp://HOST:PORT"),
    ("tcp://127.0.0.1:65536", "is not 0-65535"),
    ("tcp://127.0.0.1: 5", "is not 0-65535"),
    ("tcp://::1:5", "in brackets"),
    ("tcp://[::1]5", r"\[ADDRESS\]:PORT"),
    ("tcp://[nope]:5", "is not an IPv6 address"),
    ("tcp://127.1:5", "as four decimal numbers"),               # inet_aton forms libzmq takes
    ("tcp://0x7f000001:5", "as four decimal numbers"),
    ("tcp://2130706433:5", "as four decimal numbers"),
    ("tcp://a b:5", "neither an IP address"),
    ("tcp://:5", "neither an IP address"),
    ("tcp://127.0.0.1;0.0.0.0:5", "needs tcp://HOST:PORT"),     # libzmq: EINVAL too
    ("ipc://", "names no ipc path"),
    ("inproc://a b", "names no inproc path"),
])
def test_what_is_not_understood_is_refused(text: str, why: str) -> None:
    with pytest.raises(EndpointError, match=why):
        parse_endpoint(text)


def test_a_bind_refuses_a_source_address() -> None:
    with pytest.raises(EndpointError, match="means nothing to a listening socket"):
        bind_endpoint("tcp://127.0.0.1:1;127.0.0.1:5")


def _outside_address() -> str | None:
    """A non-loopback IPv4 address of this host (a UDP connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    """Whether anything listens on ``port`` beyond loopback, as ``ss -ltn`` shows it."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         check=True).stdout
    return any(not re.search(r"\s(127\.\S+|\[::1\]|\[::ffff:127\.\S+\]):\d+\s", f" {line} ")
               for line in out.splitlines() if line.strip())


@pytest.mark.parametrize("flag", ["--bind", "--peer-bind"])
def test_a_source_address_bind_never_listens_beyond_loopback(flag: str) -> None:
    """``tcp://127.0.0.1:1;0.0.0.0:P`` passed the old loopback check (it read the host before
    the first ':') while libzmq listened on 0.0.0.0:P with no keys and no INSECURE line."""
    port = _free_port()
    args = ["--bind", "tcp://127.0.0.1:*", flag, f"tcp://127.0.0.1:1;0.0.0.0:{port}"]
    proc = subprocess.Popen([*WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        code = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        exposed = _listening(port)
        outside = _outside_address()
        reached = False
        if outside is not None:
            with socket.socket() as s:
                s.settimeout(2)
                reached = s.connect_ex((outside, port)) == 0
        proc.kill()
        proc.communicate()
        pytest.fail(f"the worker started; listening beyond loopback: {exposed}, reached on "
                    f"{outside}: {reached}")
    _, err = proc.communicate()
    assert code == 2 and "a source address (before ';') means nothing" in err, err
    assert not _listening(port)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no ::1 on this host")
def test_a_worker_and_a_client_over_ipv6(spawn_worker: Callable[..., WorkerProcess],
                                         make_client: Callable[..., Client]) -> None:
    """``--bind tcp://[::1]:*`` failed with "No such device" (zmq.IPV6 was never set); the
    peer port follows the client port's host, and a copy between two such workers works."""
    workers = [spawn_worker("--bind", "tcp://[::1]:*") for _ in range(2)]
    a, b = (make_client(w.endpoint) for w in workers)
    assert workers[0].endpoint.startswith("tcp://[::1]:")
    assert a.info.peer_endpoint.startswith("tcp://[::1]:")
    src = a.alloc_buffer(4096).tensor((1024,), "float32")
    dst = b.alloc_buffer(4096).tensor((1024,), "float32")
    import numpy as np
    data = np.arange(1024, dtype=np.float32)
    a.set_tensor(src, data)
    a.copy_tensor(src, dst)
    np.testing.assert_array_equal(b.get_tensor(dst), data)


PEER_BIND_EXIT_S = 2.0
"""A worker whose peer port is taken exits within this of one whose front port is taken, the
same start-up then a bind refused (it took 8-19 s more, or never: the PULL socket left open
kept the context's term() waiting). Measured against that baseline in the same run, since a
loaded machine stretches the start-up itself by seconds."""


def _exit_of(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    try:
        out = subprocess.run([*WORKER, *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within 30 s: {args}")
    return out, time.monotonic() - start


def test_a_taken_peer_port_exits_at_once_with_a_clear_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        front, baseline = _exit_of(["--bind", f"tcp://127.0.0.1:{port}"])
        out, took = _exit_of(["--bind", "tcp://127.0.0.1:*", "--peer-bind",
                              f"tcp://127.0.0.1:{port}"])
    assert front.returncode == 1, front.stderr
    assert out.returncode == 1, out.stderr
    assert (f"cannot start: cannot bind the peer port tcp://127.0.0.1:{port}: Address already "
            "in use (another process listens there") in out.stderr
    assert "Traceback" not in out.stderr
    assert took - baseline < PEER_BIND_EXIT_S, f"took {took:.1f} s, the front port's {baseline:.1f} s"


def test_metrics_port_0_takes_a_free_port_and_says_which() -> None:
    proc = subprocess.Popen([*WORKER, "--bind", "tcp://127.0.0.1:*", "--metrics-port", "0",
                             "--metrics-host", "0.0.0.0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        metrics = proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    port = re.fullmatch(r"zmq-rpc-worker metrics on http://0\.0\.0\.0:(\d+)/metrics\n", metrics)
    assert port is not None and int(port.group(1)) > 0, metrics
    assert f"serving metrics on http://0.0.0.0:{port.group(1)}, beyond loopback" in err
    assert "port 0" not in err


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZMQ_RPC_")}
    return subprocess.run([sys.executable, "-m", "zmq_rpc.tools.worker_command", "status", *args], capture_output=True, text=True,
                          timeout=30, env={**environ, **(env or {})})


def test_status_of_a_curve_worker_without_a_key_says_so(
        spawn_worker: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    """It printed a KeyFileError traceback; now a row says why, and --curve-key works."""
    _, worker_secret = generate_keypair(tmp_path / "workers", "w1")
    _, client_secret = generate_keypair(tmp_path / "clients", "alice")
    proc = spawn_worker("--curve-secret-key", str(worker_secret), "--authorized-keys",
                        str(tmp_path / "clients"))
    endpoint = f"{proc.endpoint}#curve={load_keypair(worker_secret).public.decode()}"
    out = _status(endpoint)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "unreachable: no key" in out.stdout and "--curve-key" in out.stdout
    out = _status(endpoint, "--curve-key", str(client_secret))
    assert out.returncode == 0 and "unreachable" not in out.stdout, out.stdout + out.stderr
    assert proc.endpoint in out.stdout
