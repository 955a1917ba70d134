"""Local worker processes: start ``zmq-rpc-worker`` subprocesses, learn their endpoints, stop them.

The public launcher of ``generate``, the bench and the tests (and of the bench's baseline servers,
which announce themselves the same way). Runs on the caller's thread; it imports no worker code
(each worker is its own ``python -m zmq_rpc.worker`` process), so a client program pays only
for :mod:`subprocess`.

A server announces itself with one stdout line ending ``listening on ENDPOINT``
(:data:`LISTENING`); its stderr goes to a temporary file (shown if it fails to start), so a
chatty server can never block on a full pipe. :meth:`ServerProcess.stop` sends SIGTERM and
waits (SIGKILL after its timeout).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LISTENING", "ServerProcess", "add_worker_options", "endpoint_list", "local_workers",
           "worker_argv"]

LISTENING = "listening on"
"""What a server's first stdout line says before its endpoint."""

LOOPBACK = "tcp://127.0.0.1:*"
"""Where a local worker listens unless told otherwise: loopback, a port the system picks."""


class ServerProcess:
    """A server subprocess whose first stdout line ends with ``listening on ENDPOINT``.

    ``own_session``: start it in a session of its own, so that a terminal's Ctrl-C (SIGINT to the
    foreground process group) reaches only the parent, which then stops it with one SIGTERM.
    """

    def __init__(self, argv: Sequence[str], own_session: bool = False) -> None:
        self.argv = list(argv)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=own_session)
        self.endpoint = ""
        self._said = ""

    def wait_ready(self) -> str:
        """Read the announcement line; the endpoint, or RuntimeError with the server's stderr."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if LISTENING not in line:
            code = self.stop(timeout=5)
            raise RuntimeError(f"{' '.join(self.argv)} did not start (exit code {code}): "
                               f"{line!r}\n{self._said}")
        self.endpoint = line.rsplit(" ", 1)[1].strip()
        return self.endpoint

    def stderr(self) -> str:
        """What the server wrote to stderr so far."""
        if self._stderr.closed:
            return self._said
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> int:
        """``sig`` (SIGTERM), then wait; SIGKILL if it does not exit in time. Returns the exit
        code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if not self._stderr.closed:
            self._said = self.stderr()      # kept: a failed start reports it after the stop
            self._stderr.close()
        return code


def worker_argv(*extra: str, bind: str = LOOPBACK, threads: int | None = 1,
                log_level: str = "WARNING", drain_timeout: str | None = "0") -> list[str]:
    """The command line of one local worker (``threads``, ``drain_timeout`` None: the worker's
    default). A tool's workers are its own, stopped with it: nobody else's model is there to
    move off, so SIGTERM stops them at once (``--drain-timeout 0``) unless asked, and they stop
    on their own once the tool has exited however it ended (``--exit-with-parent``: a tool
    killed with SIGKILL cannot stop them)."""
    argv = [sys.executable, "-m", "zmq_rpc.worker", "--bind", bind, "--exit-with-parent"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    if drain_timeout is not None:
        argv += ["--drain-timeout", drain_timeout]
    return [*argv, "--log-level", log_level, *extra]


@contextmanager
def local_workers(count: int, *extra: str, own_session: bool = False,
                  meanwhile: Callable[[], object] | None = None) -> Iterator[list[str]]:
    """Start ``count`` workers (in parallel) and yield their endpoints; SIGTERM and wait for them
    on exit, saying on stderr if any exited with an error.

    ``own_session``: each in its own session, out of reach of a terminal's Ctrl-C (see
    :class:`ServerProcess`). ``meanwhile``: called once they are started, before waiting for
    them to listen (the caller's own start-up, overlapped with theirs)."""
    procs: list[ServerProcess] = []
    failed = False
    try:
        procs.extend(ServerProcess(worker_argv(*extra), own_session) for _ in range(count))
        if meanwhile is not None:
            meanwhile()
        yield [proc.wait_ready() for proc in procs]
    except Exception:               # not Ctrl-C or SIGTERM: the user stopped those
        failed = True
        raise
    finally:
        codes = [proc.stop() for proc in procs]
        if any(codes):
            print(f"{Path(sys.argv[0]).name}: worker exit codes {codes}", file=sys.stderr)
        if failed or any(codes):     # what the workers said can explain the failure
            for proc in procs:
                _show_stderr(proc)


def _show_stderr(proc: ServerProcess, lines: int = 20) -> None:
    said = proc.stderr().strip().splitlines()[-lines:]
    if said:
        print(f"{proc.endpoint or 'a local worker'} said:", *(f"  {line}" for line in said),
              sep="\n", file=sys.stderr)


def endpoint_list(text: str) -> list[str]:
    """``--workers``: comma-separated ``tcp://HOST:PORT`` / ``ipc://PATH``, each checked as a
    worker's CLI checks what it binds (no wildcard port)."""
    from .cli import endpoint  # here, not at the top: a client given no --workers skips it

    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("give at least one endpoint")
    return [endpoint(part, wildcard_port=False) for part in parts]


def add_worker_options(ap: argparse.ArgumentParser) -> None:
    """``--workers`` and ``--local-workers``, as every command that runs a model takes them."""
    ap.add_argument("--workers", type=endpoint_list, default=None,
                    help="comma-separated worker endpoints, one pipeline stage each "
                         "(default: start --local-workers local workers)")
    ap.add_argument("--local-workers", type=int, default=2,
                    help="workers to start when --workers is not given (default %(default)s)")
