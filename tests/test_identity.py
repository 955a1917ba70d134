"""Quotas per client identity, and sessions bound to it (worker/sessions/identities.py, issue 24 #6/#7).

Real worker processes and default clients: under CURVE a greedy key, however many sessions it
opens, leaves a quarter of ``--mem`` and of ``--max-sessions`` to another key.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from conftest import WorkerProcess
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.identity import prove
from zmq_rpc.broker.keys import generate_keypair, load_keypair
from zmq_rpc.broker.protocol import Cmd, ErrorCode
from zmq_rpc.client import Client, OutOfMemory

pytestmark = pytest.mark.timeout(90)

MIB = 1 << 20


class Keys:
    """A worker key, and two authorized client keys: a greedy one and a good one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for role, name in (("workers", "w1"), ("clients", "greedy"), ("clients", "good")):
            generate_keypair(root / role, name)
        self.worker = load_keypair(root / "workers" / "w1.key_secret")

    def secret(self, name: str) -> str:
        return str(self.root / "clients" / f"{name}.key_secret")

    def worker_args(self) -> tuple[str, ...]:
        return ("--curve-secret-key", str(self.root / "workers" / "w1.key_secret"),
                "--authorized-keys", str(self.root / "clients"))


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


def _fill(client: Client, step: int = MIB) -> int:
    """Allocate ``step`` buffers until the worker refuses; the bytes held."""
    held = 0
    while True:
        try:
            client.alloc_buffer(step)
        except OutOfMemory:
            return held
        held += step


def test_a_greedy_key_leaves_sessions_and_memory_to_another_key(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client],
        keys: Keys) -> None:
    proc = spawn_worker(*keys.worker_args(), "--mem", "64MiB", "--max-sessions", "4")
    server_key = keys.worker.public
    greedy: list[Client] = []
    for _ in range(5):           # as many sessions as the worker lets one key open
        try:
            greedy.append(make_client(proc.endpoint, curve_key=keys.secret("greedy"),
                                      server_key=server_key))
        except OutOfMemory:
            break
    assert len(greedy) == 3      # 3/4 of --max-sessions
    held = sum(_fill(c) for c in greedy)
    assert held == 48 * MIB      # 3/4 of --mem over all the greedy key's sessions
    good = make_client(proc.endpoint, curve_key=keys.secret("good"), server_key=server_key)
    assert _fill(good) == 16 * MIB   # what the greedy key had to leave


def test_sessions_of_one_key_beyond_its_share_are_refused_at_hello(
        spawn_worker: Callable[..., WorkerProcess], make_client: Callable[..., Client],
        keys: Keys) -> None:
    proc = spawn_worker(*keys.worker_args(), "--max-sessions", "8", "--identity-sessions", "2")
    opened = [make_client(proc.endpoint, curve_key=keys.secret("greedy"),
                          server_key=keys.worker.public) for _ in range(2)]
    with pytest.raises(OutOfMemory, match="--identity-sessions 2"):
        Client(proc.endpoint, curve_key=keys.secret("greedy"), server_key=keys.worker.public)
    opened[0].close()            # GOODBYE gives the slot back
    make_client(proc.endpoint, curve_key=keys.secret("greedy"), server_key=keys.worker.public)


def _curve_dealer(ctx: zmq.Context[zmq.Socket[bytes]], keys: Keys, name: str,
                  routing_id: bytes, endpoint: str) -> zmq.Socket[bytes]:
    pair = load_keypair(keys.secret(name))
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.worker.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
    sock.connect(endpoint)
    return sock


def _hello(sock: zmq.Socket[bytes], keys: Keys, name: str | None, routing_id: bytes) -> int:
    major, minor = p.PROTOCOL_VERSION
    proof: dict[str, bytes] = {}
    if name is not None:
        key, box = prove(load_keypair(keys.secret(name)).secret, keys.worker.public, routing_id)
        proof = {"key": key, "proof": box}
    sock.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor, client="x",
                                                     **proof)))
    status: int = p.unpack_header(sock.recv())[0]
    return status


def _let_in(ctx: zmq.Context[zmq.Socket[bytes]], keys: Keys, name: str, routing_id: bytes,
            endpoint: str) -> tuple[zmq.Socket[bytes], int]:
    """Connect as ``name`` with ``routing_id`` and say HELLO with its proof, until the worker
    takes the routing id (its ROUTER refuses it while a closed connection's is still known):
    the socket and the HELLO's status."""
    deadline = time.monotonic() + 20
    while True:
        sock = _curve_dealer(ctx, keys, name, routing_id, endpoint)
        sock.setsockopt(zmq.RCVTIMEO, 500)
        try:
            status = _hello(sock, keys, name, routing_id)
        except zmq.Again:
            sock.close(linger=0)
            assert time.monotonic() < deadline, "the worker never took the routing id"
            continue
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        return sock, status


def test_a_session_answers_hello_only_from_the_key_that_opened_it(
        spawn_worker: Callable[..., WorkerProcess], keys: Keys) -> None:
    proc = spawn_worker(*keys.worker_args())
    rid = b"r" + os.urandom(15)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        owner = _curve_dealer(ctx, keys, "good", rid, proc.endpoint)
        assert _hello(owner, keys, "good", rid) == p.STATUS_OK
        owner.close(linger=0)    # gone without GOODBYE: the session stays open
        other, status = _let_in(ctx, keys, "greedy", rid, proc.endpoint)
        assert status == ErrorCode.BAD_REQUEST              # another key's proof
        assert _hello(other, keys, None, rid) == ErrorCode.BAD_REQUEST   # none (pre-1.8)
        other.close(linger=0)
        back, status = _let_in(ctx, keys, "good", rid, proc.endpoint)
        assert status == p.STATUS_OK                        # its own key resumes it
        back.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_a_proof_made_for_another_routing_id_is_refused(
        spawn_worker: Callable[..., WorkerProcess], keys: Keys) -> None:
    proc = spawn_worker(*keys.worker_args())
    rid = b"r" + os.urandom(15)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = _curve_dealer(ctx, keys, "good", rid, proc.endpoint)
        major, minor = p.PROTOCOL_VERSION
        key, box = prove(load_keypair(keys.secret("good")).secret, keys.worker.public,
                         b"s" + os.urandom(15))
        sock.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=major, minor=minor, client="x",
                                                         key=key, proof=box)))
        header = p.unpack_header(sock.recv())
        assert header[0] == ErrorCode.BAD_REQUEST and "proof" in header[2]
        sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
