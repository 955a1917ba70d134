"""``zmq-rpc-worker`` as a user runs it: the installed command, real ports, real signals.

A worker that cannot start says why and exits at once; bad flags are refused before anything
starts; SIGINT/SIGTERM (even one after the other) end a worker with exit 0 within the stated bound.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.protocol import Cmd
from zmq_rpc.client import Client
from zmq_rpc.worker.cli import BLAS_THREAD_VARS, SHUTDOWN_BOUND_S

pytestmark = pytest.mark.timeout(90)

WORKER = str(Path(sys.executable).with_name("zmq-rpc-worker"))
"""The console script the install put beside this interpreter."""


def run_worker(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run the worker command to its end (a worker that hangs fails the test at ``timeout``)."""
    return subprocess.run([WORKER, "--log-level", "WARNING", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_a_taken_port_ends_the_worker_at_once_with_a_clear_message(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    first = spawn_worker()
    start = time.monotonic()
    out = run_worker("--bind", first.endpoint)
    assert out.returncode == 1, out.stderr
    assert f"cannot bind {first.endpoint}: Address already in use" in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start < 20
    with Client(first.endpoint) as client:     # the first worker is unharmed
        client.ping()


@pytest.mark.parametrize(("bind", "message"), [
    ("127.0.0.1:50073", " has no scheme: write tcp://127.0.0.1:50073"),
    ("http://127.0.0.1:50073", ": scheme http:// is not one of tcp://, ipc://"),
    ("tcp://127.0.0.1", " needs tcp://HOST:PORT (port 0-65535 or *)"),
    ("tcp://127.0.0.1:70000", ": port '70000' is not 0-65535 or *"),
    ("tcp://127.0.0.1:0", ": port 0: write * for a free port"),
    ("tcp://127.0.0.1:1;0.0.0.0:50073", ": a source address (before ';') means nothing"),
    ("tcp://0x7f000001:50073", ": write the IPv4 address '0x7f000001' as four decimal"),
    ("tcp://::1:50073", ": write an IPv6 address in brackets, tcp://[::1]:50073"),
])
def test_a_bad_endpoint_is_refused_before_anything_starts(bind: str, message: str) -> None:
    out = run_worker("--bind", bind)
    assert out.returncode == 2, out.stderr
    assert f"argument --bind: {bind!r}{message}" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("mem", "code", "message"), [
    ("0", 2, "argument --mem: '0': must be more than 0 bytes (leave --mem out for 80% of "
             "the device)"),
    ("100TiB", 1, "cannot start: memory limit 102400.0 GiB is more than device cpu has"),
])
def test_mem_must_be_positive_and_within_the_machine(mem: str, code: int, message: str) -> None:
    out = run_worker("--bind", "tcp://127.0.0.1:*", "--mem", mem)
    assert out.returncode == code, out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("trial", range(2))
def test_sigint_then_sigterm_with_an_open_session_exits_zero(
        spawn_worker: Callable[..., WorkerProcess], trial: int) -> None:
    proc = spawn_worker()
    with Client(proc.endpoint) as client:
        client.alloc_buffer(1 << 20)
        proc.proc.send_signal(signal.SIGINT)
        time.sleep(0.1)             # the scenario: a second signal while it shuts down
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(SHUTDOWN_BOUND_S + 5) == 0


def said_draining(proc: WorkerProcess) -> None:
    """Wait for the worker's log line that it drains (its replies say so from then on)."""
    assert proc.proc.stderr is not None
    while "draining:" not in (line := proc.proc.stderr.readline()):
        assert line, "the worker exited without draining"


def test_a_second_sigterm_stops_a_draining_worker_at_once(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker()
    with Client(proc.endpoint) as client:
        client.alloc_buffer(1 << 20)
        proc.proc.send_signal(signal.SIGTERM)
        said_draining(proc)
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)        # the session is still open
        assert proc.proc.wait(SHUTDOWN_BOUND_S + 5) == 0
        assert time.monotonic() - started < SHUTDOWN_BOUND_S


def test_a_drain_ends_at_its_timeout_with_a_session_still_open(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker("--drain-timeout", "1")
    with Client(proc.endpoint) as client:
        client.alloc_buffer(1 << 20)
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        said_draining(proc)
        assert proc.proc.wait(1 + SHUTDOWN_BOUND_S + 5) == 0
        assert time.monotonic() - started >= 1.0
        assert "1 s passed with sessions still open" in proc.proc.stderr.read()


def test_a_client_of_13_is_served_by_a_draining_worker_without_the_flag(
        spawn_worker: Callable[..., WorkerProcess],
        raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """An older client (its HELLO says 1.13) gets the replies it always got: no field it
    cannot decode; its GOODBYE ends the drain."""
    proc = spawn_worker()
    sock = raw_socket(zmq.DEALER)
    sock.connect(proc.endpoint)
    sock.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=1, minor=13, client="old")))
    assert p.unpack_header(sock.recv_multipart()[0])[0] == p.STATUS_OK
    proc.proc.send_signal(signal.SIGTERM)
    said_draining(proc)
    sock.send(p.encode_request(Cmd.PING, 2, p.Empty()))
    assert p.unpack_header(sock.recv_multipart()[0]) == [p.STATUS_OK, 2]
    sock.send(p.encode_request(Cmd.GOODBYE, 3, p.Empty()))
    assert proc.proc.wait(SHUTDOWN_BOUND_S + 5) == 0


def test_shutdown_past_its_bound_exits_one_without_waiting() -> None:
    script = ("import time\n"
              "from zmq_rpc.worker.cli import stop_within\n"
              "class Stuck:\n"
              "    def stop(self): time.sleep(60)\n"         # a stop that never ends
              "raise SystemExit(stop_within(Stuck(), 0.5, 0))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 1
    assert "shutdown took more than 0.5 s; exiting without waiting" in out.stderr


def test_help_is_plain_text_and_shows_defaults() -> None:
    out = subprocess.run([WORKER, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "``" not in text and ":class:" not in text
    assert "seconds of silence after which a client's session and its buffers are freed " \
           "(default 30.0)" in text
    assert f"more than {SHUTDOWN_BOUND_S:g} s" in text


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cuda0", "cpu:0"])
def test_a_bad_device_is_refused_before_anything_starts(device: str) -> None:
    out = run_worker("--bind", "tcp://127.0.0.1:*", "--device", device)
    assert out.returncode == 2, out.stderr
    assert f"argument --device: unknown device {device!r}: expected cpu, cuda (GPU 0) or cuda:N" \
        in out.stderr
    assert "Traceback" not in out.stderr


def test_cuda_without_cupy_or_a_gpu_names_what_to_install() -> None:
    from devices import cuda_missing
    if cuda_missing() is None:
        pytest.skip("this machine has cupy and a GPU: --device cuda starts here")
    out = run_worker("--bind", "tcp://127.0.0.1:*", "--device", "cuda:0")
    assert out.returncode == 1, out.stderr
    assert "zmq-rpc-worker: cannot start: " in out.stderr
    assert "pip install 'zmq-rpc[cuda]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.gpu
def test_a_gpu_index_past_the_last_is_refused_clearly() -> None:
    from devices import cuda_missing
    if cuda_missing() is not None:
        pytest.skip(cuda_missing() or "")
    out = run_worker("--bind", "tcp://127.0.0.1:*", "--device", "cuda:999")
    assert out.returncode == 1, out.stderr
    assert "cannot start: no CUDA device 999: this machine has" in out.stderr


def test_parsing_every_flag_leaves_numpy_unloaded_so_threads_pins_blas(tmp_path: Path) -> None:
    """OpenBLAS reads its thread count once, when numpy loads, and the worker pins it from
    ``--threads`` through environment variables: parsing the flags must not load numpy. (When
    ``--device``'s check imported the server, each worker ran a 2-thread BLAS pool; two workers
    on 2 cores made a 128-token prefill 2-4x slower.) The environment is the user's: no BLAS
    variable inherited from this test process."""
    code = ("import sys; from zmq_rpc.worker.cli import build_parser; "
            "build_parser().parse_args(sys.argv[1:]); print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('numpy', 'numba', 'cupy')))")
    flags = ["--bind", "tcp://127.0.0.1:*", "--device", "cuda:1", "--mem", "64MiB",
             "--session-mem", "32MiB", "--max-sessions", "4", "--max-buffer", "16MiB",
             "--max-message", "16MiB", "--peer-bind", "tcp://127.0.0.1:*",
             "--peer-advertise", "tcp://127.0.0.1:5555", "--model-dir", str(tmp_path),
             "--cache-dir", str(tmp_path), "--cache-size", "1MiB", "--session-timeout", "5",
             "--max-graph-work", "1000000", "--threads", "2", "--log-level", "DEBUG",
             "--log-format", "json", "--metrics-port", "0", "--metrics-host", "127.0.0.1",
             "--insecure", "--preload-kernels"]
    env = {k: v for k, v in os.environ.items() if k not in BLAS_THREAD_VARS}
    out = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True,
                         timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_worker_whose_stdout_reader_went_away_serves_and_stops_on_sigterm() -> None:
    """The launcher closes its end of the worker's stdout before the worker prints its address
    (it crashed, or read nothing): the worker says so in its log, serves all the same, and
    SIGTERM ends it with exit 0 (it used to raise BrokenPipeError in main() and leave its
    server threads running, deaf to signals)."""
    proc = subprocess.Popen([WORKER, "--bind", "tcp://127.0.0.1:*"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        endpoint = ""
        deadline = time.monotonic() + 30
        while not endpoint and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if " listening on " in line:
                endpoint = line.rsplit(" listening on ", 1)[1].split()[0]
        assert endpoint, "the worker never logged its address"
        with Client(endpoint) as client:
            client.ping()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(SHUTDOWN_BOUND_S + 5) == 0
        assert "cannot write the worker's address to stdout" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_worker_listens_before_it_loads_numpy_and_answers_who_came_early() -> None:
    """Start-up order (a worker listening within 100 ms of exec: ``zmq-rpc-bench --cases
    startup`` measures it): the worker binds and says so before numpy and the executor load, and
    a client that connects in between is answered once they have. ``-X importtime`` writes each
    import to stderr as it ends, in order with the worker's log lines."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m",
                             "zmq_rpc.tools.worker_command", "--bind", "tcp://127.0.0.1:*"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().rsplit(" ", 1)[-1].strip()
        with Client(endpoint) as client:
            client.ping()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=SHUTDOWN_BOUND_S + 20)
    lines = err.splitlines()
    listening = next(i for i, line in enumerate(lines) if "listening on" in line)
    numpy, executor = (next(i for i, line in enumerate(lines)
                            if re.fullmatch(rf"import time:.*\|\s+{re.escape(name)}", line))
                       for name in ("numpy", "zmq_rpc.worker.dispatch.executor"))
    assert listening < numpy < executor, "\n".join(lines[listening - 3:listening + 3])
    assert proc.returncode == 0


def _maps(pid: int, library: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_preload_kernels_loads_them_beside_the_backend_and_a_plain_worker_waits_for_a_model(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """``--preload-kernels`` (what generate and zmq-rpc-serve give their local workers): the
    kernels built ahead of time (their module mapped, and numba's LLVM not), or where none are
    built numba (its LLVM library mapped), load with no client asking, while the worker answers;
    a worker without it loads neither for a client that runs no model (numba's runtime is ~110 MiB)."""
    pytest.importorskip("numba")
    from zmq_rpc.worker.kernels import aot
    library = aot.MODULE if aot.load() is not None else "libllvmlite"
    preloading, plain = spawn_worker("--preload-kernels"), spawn_worker()
    for worker in (preloading, plain):
        with Client(worker.endpoint) as client:
            client.ping()
    wait_until(lambda: _maps(preloading.proc.pid, library), 60.0, f"{library} loaded by --preload-kernels")
    assert not _maps(plain.proc.pid, library)
    if library == aot.MODULE:
        assert not _maps(preloading.proc.pid, "libllvmlite")
    assert preloading.terminate() == 0 and plain.terminate() == 0


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"     # exited, not reaped yet
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/stat")
def test_a_tools_worker_stops_once_the_tool_is_killed_with_sigkill() -> None:
    """worker_argv's workers (generate's, zmq-rpc-serve's, the bench's) run in sessions of their
    own, out of reach of the tool's process group: a tool killed with SIGKILL could not stop
    them, and one a bench stopped that way was left running after a CI run.
    ``--exit-with-parent`` stops them within a second of their parent's end."""
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         "from zmq_rpc.worker.launch import worker_argv\n"
         "p = subprocess.Popen(worker_argv(), stdout=subprocess.PIPE, text=True,"
         " start_new_session=True)\n"
         "print(p.pid, p.stdout.readline().split()[-1], flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    pid_text, endpoint = launcher.stdout.readline().split()
    worker = int(pid_text)
    try:
        with Client(endpoint) as client:
            client.ping()
        launcher.kill()
        launcher.wait(10)
        wait_until(lambda: _gone(worker), 5.0, "the worker stopped after its parent's SIGKILL")
    finally:
        launcher.kill()
        launcher.wait(10)
        launcher.stdout.close()
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
