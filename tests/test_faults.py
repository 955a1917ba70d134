"""Faults as users meet them: real worker subprocesses, real signals, real ports, and clients with
their DEFAULT settings (a fault test that passes only with a short timeout hides a long wait).

The bound under test is the failure-detection contract (docs/FAILURES.md): a worker that dies, freezes or
becomes unreachable fails every in-flight and new request with ConnectionLost within the
heartbeat timeout (5 s) + 1 s; at once when its process dies on this host.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from conftest import WorkerProcess
from waiting import receiving, wait_until
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker.protocol import Cmd
from zmq_rpc.client import Client, ConnectionLost, SessionLost, TransferError

MiB = 1 << 20
BOUND_S = 5.0 + 1.0
"""The heartbeat timeout + 1 s."""

pytestmark = pytest.mark.timeout(90)


def failures(futures: list[Future[Any]], within: float) -> list[BaseException]:
    """Every future's exception; each must resolve within ``within`` seconds from now."""
    deadline = time.monotonic() + within
    out = []
    for future in futures:
        out.append(future.exception(timeout=max(0.0, deadline - time.monotonic())))
    return [e for e in out if e is not None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_killed_worker_fails_in_flight_and_new_requests_at_once(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker()
    with Client(proc.endpoint) as client:
        t = client.alloc_buffer(64 * MiB).tensor(16 * MiB, "float32")
        values = np.ones(16 * MiB, np.float32)
        pending = [client.set_tensor_async(t, values) for _ in range(4)]   # an upload under way
        pending += [client.get_tensor_async(t) for _ in range(4)]          # and downloads
        time.sleep(0.05)            # mid-upload: no event says bytes are on the wire
        killed = time.monotonic()
        proc.terminate(signal.SIGKILL)
        errors = failures(pending, BOUND_S)
        assert errors and all(isinstance(e, ConnectionLost) for e in errors), errors
        for _ in range(3):                      # new requests: failed at once, not queued
            started = time.monotonic()
            with pytest.raises(ConnectionLost):
                client.alloc_buffer(1024)
            assert time.monotonic() - started < 1.0
        assert time.monotonic() - killed < BOUND_S


def test_frozen_worker_fails_in_flight_then_serves_after_sigcont(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    proc = spawn_worker()
    with Client(proc.endpoint) as client:
        t = client.alloc_buffer(4 * MiB).tensor(MiB, "float32")
        client.ping()
        proc.freeze()                           # every thread stopped, not just signalled
        try:
            frozen = time.monotonic()
            pending = [client.get_tensor_async(t), client.ping_async()]
            errors = failures(pending, BOUND_S + 1.0)
            waited = time.monotonic() - frozen
            assert len(errors) == 2 and all(isinstance(e, ConnectionLost) for e in errors)
            assert waited < BOUND_S, waited
            with pytest.raises(ConnectionLost):
                client.ping()                   # new requests fail at once while it is down
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        with Client(proc.endpoint) as fresh:    # the worker serves new clients
            fresh.ping()
            assert fresh.alloc_buffer(1024).size == 1024
        def pings() -> bool:
            try:
                client.ping()
            except ConnectionLost:
                return False
            return True
        wait_until(pings, 10, "the old client reconnected; its session lived", interval=0.1)
        assert client.get_tensor(t).shape == (MiB,)


def test_frozen_worker_fails_a_waiting_sync_call_on_the_callers_thread(
        spawn_worker: Callable[..., WorkerProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking call on an idle client reads its reply on the caller's thread; while it waits
    there the connection's health is still watched: ConnectionLost within the bound."""
    proc = spawn_worker()
    with Client(proc.endpoint) as client:
        client.ping()
        monkeypatch.setattr(client.connection._mailbox, "post", None)  # no I/O thread hop
        proc.freeze()
        try:
            frozen = time.monotonic()
            with pytest.raises(ConnectionLost):
                client.ping()
            assert time.monotonic() - frozen < BOUND_S
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        monkeypatch.undo()


def test_restarted_worker_answers_the_old_session_with_session_lost(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    bind = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_worker("--bind", bind)
    with Client(proc.endpoint) as client:
        t = client.alloc_buffer(1024).tensor(256, "float32")
        client.set_tensor(t, np.arange(256, dtype=np.float32))
        proc.terminate(signal.SIGKILL)
        spawn_worker("--bind", bind)
        def session_lost() -> bool:             # down (ConnectionLost) until it reconnects
            try:
                client.get_tensor(t)
            except SessionLost as exc:
                assert "session" in str(exc)
                return True
            except ConnectionLost:
                return False
            pytest.fail("the restarted worker answered the old session with fresh memory")
        wait_until(session_lost, 10, "the client reconnected", interval=0.05)
        for call in (client.ping, lambda: client.alloc_buffer(16), lambda: client.get_tensor(t)):
            with pytest.raises(SessionLost):   # for good: its buffers are gone
                call()


def test_peer_copy_whose_destination_dies_fails_quickly(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    wa, wb, wc = spawn_worker(), spawn_worker(), spawn_worker()
    with Client(wa.endpoint) as a, Client(wb.endpoint) as b, Client(wc.endpoint) as c, \
            Client(wb.endpoint) as watch:
        src, dst = a.alloc_buffer(256 * MiB).tensor(64 * MiB), b.alloc_buffer(256 * MiB).tensor(
            64 * MiB)
        a.copy_tensor(src[:16], dst[:16])       # the route is known
        copy = a.copy_tensor_async(src, dst)
        wait_until(lambda: receiving(watch), 3, "B started receiving the copy")
        killed = time.monotonic()
        wb.terminate(signal.SIGKILL)
        with pytest.raises((ConnectionLost, TransferError)):
            copy.result(timeout=BOUND_S)
        assert time.monotonic() - killed < 3.0
        head = src[:1024]                        # A goes on: its buffer is writable and sent
        a.set_tensor(head, np.arange(1024, dtype=np.float32))
        # the write waited for A's send to end: A saw B's connection drop (not a 48 s timeout)
        assert time.monotonic() - killed < 3.0
        fresh = c.alloc_buffer(4096).tensor(1024)
        a.copy_tensor(head, fresh)
        np.testing.assert_array_equal(c.get_tensor(fresh), np.arange(1024))


def test_peer_copy_whose_source_dies_fails_quickly_and_frees_the_destination(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    wa, wb = spawn_worker(), spawn_worker()
    with Client(wa.endpoint) as a, Client(wb.endpoint) as b, Client(wb.endpoint) as watch:
        src, dst = a.alloc_buffer(256 * MiB).tensor(64 * MiB), b.alloc_buffer(256 * MiB).tensor(
            64 * MiB)
        small = b.alloc_buffer(16).tensor(4)
        b.set_tensor(small, np.arange(4, dtype=np.float32))
        a.copy_tensor(src[:16], dst[:16])
        copy = a.copy_tensor_async(src, dst)
        queued = b.get_tensor_async(small)       # behind the receive in B's queue
        wait_until(lambda: receiving(watch), 3, "B started receiving the copy")
        killed = time.monotonic()
        wa.terminate(signal.SIGKILL)
        with pytest.raises((ConnectionLost, TransferError)):
            copy.result(timeout=BOUND_S)
        assert time.monotonic() - killed < 3.0
        with pytest.raises(TransferError, match="earlier transfer"):
            queued.result(timeout=3.0)           # B's queue was released, not held 48 s
        assert time.monotonic() - killed < 3.0
        np.testing.assert_array_equal(b.get_tensor(small), np.arange(4))


def test_small_peer_copy_whose_destination_dies_fails_quickly(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """A small copy goes unacknowledged: its source answers at once, and B's death is what
    the copy reports (A's buffer was copied into zmq: writable at once)."""
    wa, wb, wc = spawn_worker(), spawn_worker(), spawn_worker()
    with Client(wa.endpoint) as a, Client(wb.endpoint) as b, Client(wc.endpoint) as c:
        src, dst = a.alloc_buffer(64 << 10).tensor(16 << 10), b.alloc_buffer(64 << 10).tensor(
            16 << 10)
        a.copy_tensor(src, dst)                 # the route is known
        wb.freeze()                             # B takes nothing in from here on
        copy = a.copy_tensor_async(src, dst)
        time.sleep(0.2)             # A's send goes out (B frozen: no event shows it)
        killed = time.monotonic()
        wb.terminate(signal.SIGKILL)
        with pytest.raises((ConnectionLost, TransferError)):
            copy.result(timeout=BOUND_S)
        assert time.monotonic() - killed < 3.0
        a.set_tensor(src, np.arange(16 << 10, dtype=np.float32))
        fresh = c.alloc_buffer(64 << 10).tensor(16 << 10)
        a.copy_tensor(src, fresh)
        np.testing.assert_array_equal(c.get_tensor(fresh), np.arange(16 << 10))


def test_peer_copy_whose_source_dies_before_its_receive_starts_frees_the_destination(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    """B still waits on an earlier transfer (one this client relays itself, later) when A dies:
    B remembers the abort and fails A's receive as it starts, so what B queued behind it is
    answered as soon as the earlier transfer is in, not at the deadline (0.8x the 60 s timeout)."""
    wa, wb = spawn_worker(), spawn_worker()
    with Client(wa.endpoint) as a, Client(wb.endpoint) as b:
        n = 16 << 10
        src = a.alloc_buffer(4 * n).tensor(n)
        first, second = (b.alloc_buffer(4 * n).tensor(n) for _ in range(2))
        small = b.alloc_buffer(16).tensor(4)
        b.set_tensor(small, np.arange(4, dtype=np.float32))
        a.copy_tensor(src, second)               # the route is known
        tok = os.urandom(wire.TOKEN_BYTES)
        one = b.connection.call(Cmd.PEER_RECV, wire.PeerRecv(token=tok, dst=first.ref, timeout_ms=48_000))
        # A dies before it sends: a small send is answered once its bytes are in zmq, and B
        # would hold them and finish this copy after `one` (a success: no fault to report).
        wa.freeze()
        two = a.copy_tensor_async(src, second)   # queued behind the first receive on B
        queued = b.get_tensor_async(small)
        wa.terminate(signal.SIGKILL)
        with pytest.raises((ConnectionLost, TransferError)):
            two.result(timeout=BOUND_S)
        time.sleep(0.3)                          # the abort reaches B, whose queue is held
        assert not queued.done()
        released = time.monotonic()
        values = np.arange(n, dtype=np.float32)
        b.connection.call(Cmd.PEER_FILL, wire.PeerFill(token=tok, seq=0, nchunks=1, start=0, total=4 * n,
                                             error=""), [values.view(np.uint8)])
        one.result(timeout=BOUND_S)
        with pytest.raises(TransferError, match="earlier transfer"):
            queued.result(timeout=BOUND_S)
        assert time.monotonic() - released < 3.0
        np.testing.assert_array_equal(b.get_tensor(first), values)
        np.testing.assert_array_equal(b.get_tensor(small), np.arange(4))
