"""The client port listening before the worker's imports (worker/process/early_listen.py): which
``--bind`` values are taken early, and a client that connected before the ROUTER existed is
served by the ROUTER that adopts the socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_until
from zmq_rpc.client import Client
from zmq_rpc.worker.process.early_listen import (
    DEFAULT_BIND,
    bind_argument,
    early_listen,
    tcp_address,
)
from zmq_rpc.worker.server import WorkerConfig, WorkerServer


@pytest.mark.parametrize(("argv", "expected"), [
    ([], DEFAULT_BIND),
    (["--threads", "2"], DEFAULT_BIND),
    (["--bind", "tcp://127.0.0.1:*"], "tcp://127.0.0.1:*"),
    (["--bind=tcp://0.0.0.0:6000", "--insecure"], "tcp://0.0.0.0:6000"),
    (["--bind", "tcp://127.0.0.1:1", "--bind", "tcp://127.0.0.1:2"], "tcp://127.0.0.1:2"),
    (["--bin", "tcp://127.0.0.1:1"], None),             # argparse's abbreviation: not guessed
    (["--b=tcp://127.0.0.1:1"], None),
    (["--bind"], None),
    (["--bind", "--insecure"], None),
    (["--", "--bind", "tcp://127.0.0.1:1"], None),
])
def test_the_bind_argument_is_read_as_argparse_reads_it_or_not_at_all(
        argv: list[str], expected: str | None) -> None:
    assert bind_argument(argv) == expected


@pytest.mark.parametrize(("endpoint", "expected"), [
    ("tcp://127.0.0.1:50052", ("127.0.0.1", 50052)),
    ("tcp://127.0.0.1:*", ("127.0.0.1", 0)),
    ("tcp://*:7000", ("0.0.0.0", 7000)),
    ("tcp://10.1.2.3:65535", ("10.1.2.3", 65535)),
    ("tcp://127.0.0.1:0", None),               # the CLI refuses port 0: its error, not ours
    ("tcp://127.0.0.1:65536", None),
    ("tcp://127.0.0.1:080", None),
    ("tcp://127.1:5000", None),                # libzmq's reading of short forms is not ours
    ("tcp://127.0.0.01:5000", None),
    ("tcp://256.0.0.1:5000", None),
    ("tcp://localhost:5000", None),            # names: resolved by libzmq
    ("tcp://[::1]:5000", None),
    ("tcp://eth0:5000", None),
    ("tcp://10.0.0.1;127.0.0.1:5000", None),
    ("ipc:///tmp/worker", None),
    ("tcp://127.0.0.1", None),
    ("127.0.0.1:5000", None),
])
def test_only_plain_tcp_addresses_are_taken_early(
        endpoint: str, expected: tuple[str, int] | None) -> None:
    assert tcp_address(endpoint) == expected


def test_an_address_in_use_is_left_to_the_normal_path() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert early_listen(["--bind", f"tcp://127.0.0.1:{port}"]) is None


def test_a_client_that_connected_before_the_router_existed_is_answered() -> None:
    listening = early_listen(["--bind", "tcp://127.0.0.1:*"])
    assert listening is not None
    port = listening.getsockname()[1]
    answered = threading.Event()
    failed: list[BaseException] = []

    def ping() -> None:
        try:
            with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:
                client.ping()
                answered.set()
        except BaseException as exc:
            failed.append(exc)
    pinger = threading.Thread(target=ping)
    pinger.start()                               # its HELLO waits in the kernel's queue
    server = None
    try:
        assert not answered.wait(0.3), "answered with no ROUTER on the port"
        server = WorkerServer(WorkerConfig(bind="tcp://127.0.0.1:*",
                                           listening_fd=listening.detach()))
        assert server.start() == f"tcp://127.0.0.1:{port}"
        assert answered.wait(30), f"the queued client was not answered: {failed}"
    finally:
        pinger.join(30)
        if server is not None:
            server.stop()


def test_the_port_accepts_while_the_worker_is_still_starting(tmp_path: Path) -> None:
    """The worker blocks reading its key file (a FIFO nobody writes yet), long before zmq is
    imported: the port already completes TCP handshakes. A key file that turns out bad then
    stops the worker (exit 1, as before), and the port with it."""
    secret = tmp_path / "w.key_secret"
    os.mkfifo(secret, 0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "zmq_rpc.worker", "--bind",
                             f"tcp://127.0.0.1:{port}", "--curve-secret-key", str(secret)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _accepts(port), 30.0,
                   "the port accepted a connection while the worker waits for its key file")
        with open(secret, "w") as fifo:      # unblocks the worker's read: not a key file
            fifo.write("not a key\n")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "cannot start" in err, err
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("entry", [["-m", "zmq_rpc.worker"], ["-m", "zmq_rpc.tools.worker_command"]])
def test_each_entry_point_listens_on_one_socket_and_answers(entry: list[str]) -> None:
    with subprocess.Popen([sys.executable, *entry, "--bind", "tcp://127.0.0.1:*",
                           "--exit-with-parent"], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "listening on tcp://127.0.0.1:" in line, line
            endpoint = line.rsplit(" ", 1)[1].strip()
            with Client(endpoint, timeout=20) as client:
                client.ping()
            assert _listeners(proc.pid, int(endpoint.rsplit(":", 1)[1])) == 1
        finally:
            proc.terminate()
            proc.wait(30)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def _listeners(pid: int, port: int) -> int:
    """How many of ``pid``'s sockets listen on ``port`` (from /proc/net/tcp: state 0A)."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    count = 0
    with open("/proc/net/tcp") as table:
        for row in list(table)[1:]:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port \
                    and f"socket:[{fields[9]}]" in inodes:
                count += 1
    return count
