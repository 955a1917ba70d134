"""CurveZMQ on client and peer links, key files, refusing to expose an unauthenticated worker,
the peer port's stash under a flood of made-up transfers, and log lines that escape what an
attacker sends. Issue 13."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import WorkerProcess
from waiting import wait_until
from zmq_rpc.broker import peer as wire
from zmq_rpc.broker import protocol as p
from zmq_rpc.broker.keys import (
    KeyFileError,
    KeyPair,
    generate_keypair,
    load_key_dir,
    load_keypair,
    load_public_key,
    parse_key,
    split_endpoint,
)
from zmq_rpc.broker.protocol import Cmd, ErrorCode, WireError
from zmq_rpc.broker.wire import printable
from zmq_rpc.broker.zap import RESCAN_S
from zmq_rpc.client import AuthenticationFailed, Client, TransferError
from zmq_rpc.client.security import resolve_curve
from zmq_rpc.client.session import Session
from zmq_rpc.worker.peer.endpoints import check_numeric, resolve_endpoint
from zmq_rpc.worker.server import InsecureBind, WorkerConfig, WorkerServer

pytestmark = pytest.mark.timeout(60)


class Keys:
    """A key directory per role: workers, clients, and a stranger nobody authorized."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pairs: dict[str, KeyPair] = {}
        for role, names in (("workers", ["w1", "w2"]), ("clients", ["alice"]),
                            ("strangers", ["mallory"])):
            for name in names:
                _, secret = generate_keypair(root / role, name)
                self.pairs[name] = load_keypair(secret)

    def secret(self, name: str) -> str:
        role = "workers" if name.startswith("w") else (
            "clients" if name == "alice" else "strangers")
        return str(self.root / role / f"{name}.key_secret")

    def dir(self, role: str) -> str:
        return str(self.root / role)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


@pytest.fixture
def curve_worker(make_worker: Callable[..., WorkerServer], keys: Keys
                 ) -> Callable[..., tuple[WorkerServer, str]]:
    """A CURVE worker and the endpoint (with its key) clients connect to."""
    def start(name: str = "w1", **overrides: object) -> tuple[WorkerServer, str]:
        options: dict[str, object] = dict(curve=keys.pairs[name],
                                          authorized_keys=keys.dir("clients"),
                                          worker_keys=keys.dir("workers"),
                                          memory_limit=64 << 20)
        options.update(overrides)
        server = make_worker(**options)
        return server, f"{server.endpoint}#curve={keys.pairs[name].public.decode()}"
    return start


# ------------------------------------------------------------------------------- key files


def test_keygen_writes_private_secret_and_refuses_overwrite(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "zmq_rpc.tools.keygen", str(tmp_path / "k"), "w"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    public, secret = tmp_path / "k" / "w.key", tmp_path / "k" / "w.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o700
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pair = load_keypair(secret)
    assert load_public_key(public) == pair.public and pair.public.decode() in out.stdout
    assert pair.secret.decode() not in out.stdout and "secret=<hidden>" in repr(pair)
    import zmq.auth  # interoperable with ZeroMQ's format
    assert zmq.auth.load_certificate(str(secret)) == (pair.public, pair.secret)
    again = subprocess.run([sys.executable, "-m", "zmq_rpc.tools.keygen", str(tmp_path / "k"),
                            "w"], capture_output=True, text=True, timeout=30)
    assert again.returncode == 1 and "exists" in again.stderr
    assert load_keypair(secret) == pair


def test_secret_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    _, secret = generate_keypair(tmp_path, "w")
    secret.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keypair(secret)
    with pytest.raises(KeyFileError, match="no secret-key"):
        load_keypair(_private_copy(tmp_path / "w.key"))


def _private_copy(path: Path) -> Path:
    copy = path.with_name("copy.key")
    copy.write_bytes(path.read_bytes())
    copy.chmod(0o600)
    return copy


def test_key_texts_and_endpoints() -> None:
    public, _ = zmq.curve_keypair()
    assert parse_key(public.decode()) == public
    assert parse_key(zmq.utils.z85.decode(public).hex()) == public
    assert split_endpoint(f"tcp://h:1#curve={public.decode()}") == ("tcp://h:1", public)
    assert split_endpoint("tcp://h:1") == ("tcp://h:1", None)
    for bad in ("abc", "x" * 64, "\0" * 40):
        with pytest.raises(KeyFileError):
            parse_key(bad)


def test_malformed_key_in_a_directory_is_an_error(tmp_path: Path) -> None:
    generate_keypair(tmp_path, "ok")
    (tmp_path / "typo.key").write_text('curve\n    public-key = "short"\n')
    with pytest.raises(KeyFileError, match="typo.key"):
        load_key_dir(tmp_path)


def test_client_keys_from_arguments_and_environment(keys: Keys) -> None:
    server = keys.pairs["w1"].public
    env = {"ZMQ_RPC_SERVER_KEY": str(keys.root / "workers" / "w1.key"),
           "ZMQ_RPC_CURVE_SECRET_KEY": keys.secret("alice")}
    address, curve = resolve_curve("tcp://h:1", environ=env)
    assert address == "tcp://h:1" and curve is not None
    assert curve.server_key == server and curve.keys == keys.pairs["alice"]
    other = keys.pairs["w2"].public
    _, curve = resolve_curve(f"tcp://h:1#curve={other.decode()}", environ=env)
    assert curve is not None and curve.server_key == other          # the endpoint's key wins
    assert resolve_curve("tcp://h:1", environ={}) == ("tcp://h:1", None)
    with pytest.raises(KeyFileError, match="ZMQ_RPC_CURVE_SECRET_KEY"):
        resolve_curve("tcp://h:1", server_key=server.decode(), environ={})


# ----------------------------------------------------------------------- the client link


def test_curve_client_round_trip(curve_worker: Callable[..., tuple[WorkerServer, str]],
                                 keys: Keys, make_client: Callable[..., Client]) -> None:
    _, endpoint = curve_worker()
    c = make_client(endpoint, curve_key=keys.secret("alice"))
    t = c.alloc_buffer(4096).tensor((1024,), "float32")
    data = np.arange(1024, dtype=np.float32)
    c.set_tensor(t, data)
    np.testing.assert_array_equal(c.get_tensor(t), data)
    assert c.info.peer_endpoint.endswith("#curve=" + keys.pairs["w1"].public.decode())


@pytest.mark.parametrize("case", ["unknown key", "no curve", "wrong server key"])
def test_refused_client_fails_fast_with_a_clear_error(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys, case: str,
        caplog: pytest.LogCaptureFixture) -> None:
    server, endpoint = curve_worker()
    options: dict[str, object] = {
        "unknown key": dict(curve_key=keys.secret("mallory")),
        "no curve": {},
        "wrong server key": dict(curve_key=keys.secret("alice"),
                                 server_key=keys.pairs["w2"].public),
    }[case]
    target = server.endpoint if case != "unknown key" else endpoint
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.zap"), \
            pytest.raises(AuthenticationFailed) as info:
        Client(target, **options)        # type: ignore[arg-type]   # default timeouts
    assert time.monotonic() - start < 2.0
    if case == "unknown key":
        assert "--authorized-keys" in str(info.value)
        assert any("key not authorized" in r.getMessage() for r in caplog.records)
    else:
        assert "handshake" in str(info.value)


@pytest.mark.timeout(30)
def test_a_hello_sent_after_the_handshake_broke_fails_instead_of_hanging(
        curve_worker: Callable[..., tuple[WorkerServer, str]], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A client without CURVE whose HELLO goes out only after the worker's CURVE handshake
    has already broken: libzmq dropped the connection and does not reconnect, so the DEALER
    has nowhere to queue the HELLO, and a blocking send waited forever with the socket's
    lock held (CI run 1 of db52418, loaded: ``Client()`` stuck in zmq's send for the test's
    60 s). The half second before the HELLO stands for the loaded machine; the handshake on
    loopback takes milliseconds. Now the send finds no connection and the client fails with
    the handshake's error, at once."""
    server, _ = curve_worker()
    say_hello = Session._say_hello
    sent: list[float] = []

    def late(self: Session, hello: p.Hello, timeout: float) -> object:
        time.sleep(0.5)
        sent.append(time.monotonic())
        return say_hello(self, hello, timeout)

    monkeypatch.setattr(Session, "_say_hello", late)
    with pytest.raises(AuthenticationFailed, match="handshake") as info:
        Client(server.endpoint)                              # default timeouts
    failed = time.monotonic() - sent[0]
    assert failed < 1.0, f"the HELLO failed {failed:.2f} s after it was sent: {info.value}"


def test_authorized_keys_reread_when_the_directory_changes(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        make_client: Callable[..., Client]) -> None:
    _, endpoint = curve_worker()
    with pytest.raises(AuthenticationFailed):
        Client(endpoint, curve_key=keys.secret("mallory"))
    (Path(keys.dir("clients")) / "mallory.key").write_bytes(
        (Path(keys.dir("strangers")) / "mallory.key").read_bytes())
    time.sleep(RESCAN_S)            # the stated bound: handshakes from then on see the change
    make_client(endpoint, curve_key=keys.secret("mallory")).alloc_buffer(16)


def _accepted(endpoint: str, secret: str) -> bool:
    """Whether a real CURVE client with this key pair gets through (default settings)."""
    try:
        with Client(endpoint, curve_key=secret) as client:
            client.ping()
        return True
    except AuthenticationFailed:
        return False


def test_a_key_file_rewritten_in_place_takes_effect_at_the_next_handshake(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys) -> None:
    """``cp carol.key clients/bob.key`` onto the existing file (same name, size and inode; the
    directory's mtime does not change) left bob accepted and carol refused (issue 24, 3)."""
    clients = Path(keys.dir("clients"))
    _, bob = generate_keypair(clients, "bob")
    carol_public, carol = generate_keypair(keys.root / "others", "carol")
    _, endpoint = curve_worker()
    assert _accepted(endpoint, str(bob)) and not _accepted(endpoint, str(carol))
    with open(clients / "bob.key", "r+b") as f:       # what cp onto an existing file does
        f.write(carol_public.read_bytes())
        f.truncate()
    time.sleep(RESCAN_S)            # the stated bound: handshakes from then on see the change
    assert not _accepted(endpoint, str(bob)), "a rewritten key file still grants the old key"
    assert _accepted(endpoint, str(carol))
    assert _accepted(endpoint, keys.secret("alice"))


def test_a_malformed_key_file_is_refused_by_name_and_removals_still_apply(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        caplog: pytest.LogCaptureFixture) -> None:
    """A malformed ``*.key`` kept the last good key set, so a key removed meanwhile stayed
    accepted (issue 24, 3)."""
    clients = Path(keys.dir("clients"))
    _, bob = generate_keypair(clients, "bob")
    _, endpoint = curve_worker()
    assert _accepted(endpoint, str(bob))
    with caplog.at_level(logging.ERROR, logger="zmq_rpc.zap"):
        (clients / "typo.key").write_text("public-key = not a key\n")
        (clients / "bob.key").unlink()
        time.sleep(RESCAN_S)        # the stated bound: handshakes from then on see the change
        assert not _accepted(endpoint, str(bob)), "a removed key stayed accepted"
        assert _accepted(endpoint, keys.secret("alice"))
    assert any("typo.key" in r.getMessage() and "refusing key file" in r.getMessage()
               for r in caplog.records)
    (clients / "typo.key").unlink()
    time.sleep(RESCAN_S)            # the stated bound: handshakes from then on see the change
    assert _accepted(endpoint, keys.secret("alice"))


def test_a_malformed_key_file_stops_the_start(keys: Keys) -> None:
    (Path(keys.dir("clients")) / "typo.key").write_text("public-key = nope\n")
    with pytest.raises(KeyFileError, match="typo.key"):
        WorkerServer(WorkerConfig(bind="tcp://127.0.0.1:*", curve=keys.pairs["w1"],
                                  authorized_keys=keys.dir("clients"))).start()


def test_curve_bytes_on_the_wire_are_encrypted(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        make_client: Callable[..., Client]) -> None:
    """A CURVE client through a recording TCP relay: the payload never appears in clear."""
    import socket
    import threading
    _, endpoint = curve_worker()
    address, key = split_endpoint(endpoint)
    port = int(address.rsplit(":", 1)[1])
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()
    opened: list[socket.socket] = [listener]
    ended: list[socket.socket] = []

    def relay() -> None:
        conn, _ = listener.accept()
        upstream = socket.create_connection(("127.0.0.1", port))
        opened.extend([conn, upstream])
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                seen.extend(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        ended.append(src)

    threading.Thread(target=relay, daemon=True).start()
    marker = b"SECRET-TENSOR-BYTES!" * 50
    c = make_client(f"tcp://127.0.0.1:{listener.getsockname()[1]}", curve_key=keys.secret("alice"),
                    server_key=key)
    t = c.alloc_buffer(len(marker)).tensor((len(marker),), "uint8")
    c.set_tensor(t, np.frombuffer(marker, np.uint8))
    assert c.get_tensor(t).tobytes() == marker
    c.close()
    wait_until(lambda: opened[1] in ended, 10, "the client's connection through the relay ended")
    for sock in opened:
        sock.close()
    assert len(seen) > 2 * len(marker) and b"SECRET-TENSOR" not in seen


# --------------------------------------------------------------------- exposure checks


def test_worker_refuses_to_listen_beyond_loopback_without_keys() -> None:
    with pytest.raises(InsecureBind, match="--insecure"):
        WorkerServer(WorkerConfig(bind="tcp://0.0.0.0:*")).start()
    with pytest.raises(InsecureBind, match="--insecure"):
        WorkerServer(WorkerConfig(peer_bind="tcp://0.0.0.0:*", bind="tcp://127.0.0.1:*")).start()
    with pytest.raises(InsecureBind, match="--authorized-keys"):
        WorkerServer(WorkerConfig(curve=KeyPair(*zmq.curve_keypair()))).start()


def test_cli_refuses_exposure_and_insecure_logs_loudly() -> None:
    cmd = [sys.executable, "-m", "zmq_rpc.worker.cli", "--bind", "tcp://0.0.0.0:*",
           "--log-level", "WARNING"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "refusing to listen on tcp://0.0.0.0" in out.stderr
    proc = subprocess.Popen([*cmd, "--insecure"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "listening on" in proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert err.count("INSECURE: listening on tcp://0.0.0.0") == 2     # client port, peer port


def test_cli_with_keys(spawn_worker: Callable[..., WorkerProcess], keys: Keys,
                       make_client: Callable[..., Client]) -> None:
    proc = spawn_worker("--curve-secret-key", keys.secret("w1"), "--authorized-keys",
                        keys.dir("clients"))
    c = make_client(proc.endpoint, curve_key=keys.secret("alice"),
                    server_key=str(keys.root / "workers" / "w1.key"))
    assert c.alloc_buffer(64).size == 64
    with pytest.raises(AuthenticationFailed):
        Client(proc.endpoint, curve_key=keys.secret("mallory"),
               server_key=keys.pairs["w1"].public)


# --------------------------------------------------------------------------- peer links


def test_peer_copy_between_curve_workers(curve_worker: Callable[..., tuple[WorkerServer, str]],
                                         keys: Keys, make_client: Callable[..., Client],
                                         relay_log: object) -> None:
    _, ep1 = curve_worker("w1")
    _, ep2 = curve_worker("w2")
    a = make_client(ep1, curve_key=keys.secret("alice"))
    b = make_client(ep2, curve_key=keys.secret("alice"))
    src = a.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
    dst = b.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
    data = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)
    a.set_tensor(src, data)
    a.copy_tensor(src, dst)
    np.testing.assert_array_equal(b.get_tensor(dst), data)
    assert relay_log.relayed() == 0                       # type: ignore[attr-defined]


def test_curve_worker_pushes_only_to_known_worker_keys(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        make_client: Callable[..., Client], raw_socket: Callable[[int], zmq.Socket[bytes]]
        ) -> None:
    """A client-named endpoint with a stranger's key, or none, is refused before anything is
    sent; a PULL port that is not a worker never gets the bytes."""
    _, ep1 = curve_worker("w1")
    a = make_client(ep1, curve_key=keys.secret("alice"))
    src = a.alloc_buffer(64).tensor((64,), "uint8")
    trap = raw_socket(zmq.PULL)
    trap.bind("tcp://127.0.0.1:*")
    trap_ep = trap.getsockopt_string(zmq.LAST_ENDPOINT)
    stranger = keys.pairs["mallory"].public.decode()
    for endpoint, why in ((trap_ep, "carries no key"),
                          (f"{trap_ep}#curve={stranger}", "not among this worker's")):
        fut = a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16), src=src.ref,
                                                   endpoint=endpoint, timeout_ms=2000))
        with pytest.raises(TransferError, match=why):
            fut.result(timeout=5)
    assert not trap.poll(200)


def test_a_curve_worker_never_pushes_to_inproc(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        make_client: Callable[..., Client]) -> None:
    """The attack of issue 24 (4): a PEER_SEND to ``inproc://zeromq.zap.01#curve=<the worker's
    own key>`` with ``acked`` false succeeded, and its chunks landed in the ZAP handler's socket
    (inproc has no handshake). Refused now, as is a probe there; the ZAP handler still serves."""
    _, ep1 = curve_worker("w1")
    a = make_client(ep1, curve_key=keys.secret("alice"))
    src = a.alloc_buffer(64).tensor((64,), "uint8")
    own = keys.pairs["w1"].public.decode()
    for target in ("inproc://zeromq.zap.01", "inproc://zmq-rpc-anything"):
        endpoint = f"{target}#curve={own}"
        send = a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16), src=src.ref,
                                                    endpoint=endpoint, timeout_ms=2000,
                                                    acked=False))
        with pytest.raises(TransferError, match="inproc:// would reach sockets inside"):
            send.result(timeout=5)
        probe = a.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=endpoint, timeout_ms=1000))
        with pytest.raises(TransferError, match="inproc:// would reach sockets inside"):
            probe.result(timeout=5)
    assert _accepted(ep1, keys.secret("alice"))
    assert not _accepted(ep1, keys.secret("mallory"))


def test_a_curve_worker_pushes_tensors_only_after_the_peer_handshake(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        make_client: Callable[..., Client]) -> None:
    """A PEER_SEND to a known worker key that this worker never probed is refused: the probe's
    answer is the peer handshake, under CURVE as without."""
    _, ep1 = curve_worker("w1")
    _, ep2 = curve_worker("w2")
    a = make_client(ep1, curve_key=keys.secret("alice"))
    b = make_client(ep2, curve_key=keys.secret("alice"))
    src = a.alloc_buffer(64).tensor((64,), "uint8")
    send = a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16), src=src.ref,
                                                endpoint=b.info.peer_endpoint, timeout_ms=2000,
                                                acked=False))
    with pytest.raises(TransferError, match="has not answered a peer probe"):
        send.result(timeout=5)
    a.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=b.info.peer_endpoint,
                                           timeout_ms=3000)).result(timeout=5)
    dst = b.alloc_buffer(64).tensor((64,), "uint8")
    a.copy_tensor(src, dst)


def test_peer_port_refuses_unauthenticated_pushers(
        curve_worker: Callable[..., tuple[WorkerServer, str]], keys: Keys,
        raw_socket: Callable[[int], zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
        ) -> None:
    server, ep = curve_worker("w1")
    peer_address, worker_key = split_endpoint(server._backend_thread.peers.endpoint)  # type: ignore
    acks = raw_socket(zmq.PULL)
    acks.bind("tcp://127.0.0.1:*")
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.zap"):
        for name in ("mallory", "alice"):                # a stranger, and a client (not a worker)
            push = raw_socket(zmq.PUSH)
            pair = keys.pairs[name]
            push.setsockopt(zmq.CURVE_SERVERKEY, worker_key)
            push.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
            push.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)
            push.connect(peer_address)
            push.send(wire.encode_peer(wire.Probe(os.urandom(16),
                                                   acks.getsockopt_string(zmq.LAST_ENDPOINT))),
                      zmq.NOBLOCK)
        zap = server._zap
        assert zap is not None
        wait_until(lambda: zap.refused >= 2, 0.5, "both handshakes were refused")
    assert sum("zmq-rpc-peer" in r.getMessage() for r in caplog.records) == 1  # rate-limited
    assert not acks.poll(100)


# ----------------------------------------------------------------- the peer port's stash


def _raw_session(raw_socket: Callable[[int], zmq.Socket[bytes]], endpoint: str
                 ) -> zmq.Socket[bytes]:
    dealer = raw_socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send(p.encode_request(Cmd.HELLO, 1, p.Hello(major=p.PROTOCOL_VERSION[0],
                                                      minor=p.PROTOCOL_VERSION[1], client="x")))
    dealer.recv_multipart()
    return dealer


def test_made_up_chunks_do_not_deny_peer_copies(make_worker: Callable[..., WorkerServer],
                                                make_client: Callable[..., Client],
                                                raw_socket: Callable[[int], zmq.Socket[bytes]],
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Issue 13: ~40 KB of well-formed chunks for 1,100 made-up transfers filled the stash
    (1,024 transfers, kept 30 s) and every real copy into that worker then timed out, even a
    first 16-byte copy into a fresh session. Now the flood only fills its sender's share."""
    a_srv, b_srv = make_worker(memory_limit=64 << 20), make_worker(memory_limit=64 << 20)
    b_peer = b_srv._backend_thread.peers.endpoint       # type: ignore[union-attr]
    attacker = raw_socket(zmq.PUSH)
    attacker.connect(b_peer)
    for _ in range(1100):
        attacker.send_multipart([wire.encode_peer(wire.Chunk(os.urandom(16), 0, 1, 0, 16,
                                                              "tcp://127.0.0.1:9")), bytes(16)])
    peers = b_srv._backend_thread.peers                   # type: ignore[union-attr]
    wait_until(lambda: len(peers.stash) >= 1024, 10,        # its share: MAX_STASHED_PER_SENDER
               "the flood filled its sender's share of B's stash")
    a, b = make_client(a_srv.endpoint), make_client(b_srv.endpoint)   # default client settings
    src = a.alloc_buffer(16).tensor((16,), "uint8")
    dst = b.alloc_buffer(16).tensor((16,), "uint8")
    a.set_tensor(src, np.arange(16, dtype=np.uint8))
    a.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=b_peer, timeout_ms=5000)).result(10)
    with caplog.at_level(logging.INFO, logger="zmq_rpc.client.peer"):
        for _ in range(3):     # with the PEER_SEND issued before the PEER_RECV: chunks stash
            token = os.urandom(16)
            send = a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=token, src=src.ref,
                                                        endpoint=b_peer, timeout_ms=5000))
            wait_until(lambda token=token: token in peers.stash.entries, 10,
                       "A's chunk was stashed on B before its receive")
            recv = b.connection.call(Cmd.PEER_RECV, wire.PeerRecv(token=token, dst=dst.ref,
                                                        timeout_ms=5000))
            send.result(timeout=10)
            recv.result(timeout=10)
        a.copy_tensor(src, dst)
    np.testing.assert_array_equal(b.get_tensor(dst), np.arange(16, dtype=np.uint8))
    assert len(peers.stash) <= 1024 + 4


# ------------------------------------------------------------------------------ log lines


def test_printable_escapes_what_forges_log_lines() -> None:
    assert printable("a\x00b\nc\x1b[31m\u2028") == "a\\x00b\\nc\\x1b[31m\\u2028"
    assert printable("x" * 300, 10) == "x" * 10 + "..."


def test_attacker_strings_in_worker_logs_are_escaped(
        make_worker: Callable[..., WorkerServer], raw_socket: Callable[[int], zmq.Socket[bytes]],
        caplog: pytest.LogCaptureFixture) -> None:
    server = make_worker()
    peer_ep = server._backend_thread.peers.endpoint      # type: ignore[union-attr]
    with caplog.at_level(logging.DEBUG, logger="zmq_rpc"):
        dealer = raw_socket(zmq.DEALER)
        dealer.connect(server.endpoint)
        dealer.send(p.encode_request(Cmd.HELLO, 1, p.Hello(
            major=p.PROTOCOL_VERSION[0], minor=p.PROTOCOL_VERSION[1],
            client="evil\nINFO zmq_rpc.worker: forged\x00")))
        dealer.recv_multipart()
        push = raw_socket(zmq.PUSH)
        push.connect(peer_ep)
        push.send(wire.encode_peer(wire.Probe(os.urandom(16), "tcp://\x00bad\nline:1")))
        push.send(b"\x00garbage\n")
        wait_until(lambda: any("dropping a bad peer message" in r.getMessage()
                               for r in caplog.records), 0.5,
                   "the garbage (sent last) was logged as a bad peer message")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text, "nothing was logged"
    assert "\x00" not in text and "\nINFO zmq_rpc.worker: forged" not in text
    assert "\nline" not in text


def test_push_to_a_port_that_is_not_a_worker_is_refused(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """Without CURVE a worker pushes only to endpoints that answered its probe: a client-named
    PULL port gets no tensor bytes (the probe it receives is all it ever sees)."""
    a = make_client(make_worker(memory_limit=64 << 20).endpoint)
    src = a.alloc_buffer(1 << 16).tensor((1 << 16,), "uint8")
    trap = raw_socket(zmq.PULL)
    trap_ep = f"tcp://127.0.0.1:{trap.bind_to_random_port('tcp://127.0.0.1')}"
    send = a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16), src=src.ref,
                                                endpoint=trap_ep, timeout_ms=2000))
    with pytest.raises(TransferError, match="has not answered a peer probe"):
        send.result(timeout=5)
    probe = a.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint=trap_ep, timeout_ms=1000))
    with pytest.raises(TransferError, match="no acknowledgement"):
        probe.result(timeout=5)                            # it got the probe, never answered
    again = a.connection.call(Cmd.PEER_SEND, wire.PeerSend(token=os.urandom(16), src=src.ref,
                                                 endpoint=trap_ep, timeout_ms=2000))
    with pytest.raises(TransferError, match="has not answered a peer probe"):
        again.result(timeout=5)
    seen = []
    while trap.poll(200):
        seen.append(wire.decode_peer(trap.recv_multipart()))
    assert [type(m).__name__ for m in seen] == ["Probe"]     # never a chunk


# ------------------------------------------------------------------- names in peer endpoints


def test_peer_endpoints_must_name_ip_addresses() -> None:
    for ok in ("tcp://127.0.0.1:5", "tcp://[::1]:5", "ipc:///tmp/x", "tcp://10.0.0.1:1#curve=k"):
        check_numeric(ok.partition("#")[0])
    for bad in ("tcp://localhost:5", "tcp://no-such-host.invalid:1", "tcp://127.0.0.1:*",
                "tcp://127.0.0.1;10.0.0.1:5", "nope", "tcp://\x00x:1", "udp://1.2.3.4:5"):
        with pytest.raises(WireError, match="names an IP address"):
            check_numeric(bad)
    assert resolve_endpoint("tcp://localhost:7#curve=" + "a" * 40) == \
        "tcp://127.0.0.1:7#curve=" + "a" * 40
    assert resolve_endpoint("tcp://10.1.2.3:7") == "tcp://10.1.2.3:7"


def test_unresolvable_peer_names_do_not_stall_the_worker(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        raw_socket: Callable[[int], zmq.Socket[bytes]]) -> None:
    """The long fuzz (issue 13): 43 of 517 good-client probes failed, ConnectionLost after the
    5 s heartbeat or a 5 s timeout, while the worker's threads sat idle. Messages naming hosts
    that do not resolve (a mutated reply address, a client's PEER_SEND endpoint) made libzmq
    call getaddrinfo on the worker's single I/O thread, ~1.5 s per name and again at every
    reconnect, stalling every connection. Now such endpoints are refused at once."""
    server = make_worker(memory_limit=64 << 20)
    c = make_client(server.endpoint)                   # default client settings
    c.ping()
    push = raw_socket(zmq.PUSH)
    push.connect(server._backend_thread.peers.endpoint)   # type: ignore[union-attr]
    for i in range(20):
        push.send(wire.encode_peer(wire.Probe(os.urandom(16), f"tcp://nohost-{i}.invalid:1")))
    probe = c.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(endpoint="tcp://nohost.invalid:1",
                                                   timeout_ms=1000))
    with pytest.raises(TransferError, match="names an IP address"):
        probe.result(timeout=5)
    worst = 0.0
    for _ in range(20):
        start = time.monotonic()
        c.ping()
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)            # pings spread over a second: a stall would fall among them
    assert worst < 3.0, f"a ping took {worst:.1f} s: the I/O thread stalled"


def test_a_link_that_cannot_take_a_message_never_blocks_the_worker() -> None:
    """The long fuzz (issue 13) hung a worker for good: the backend thread sat in a PUSH link's
    blocking send (a probe). A PUSH with no pipe left (libzmq ends a connection that fails its
    handshake with a protocol error and removes the pipe without reconnecting) blocks a send
    forever, and with the backend thread every client. Link sends never block now (SNDTIMEO
    0): the probe or push fails with TRANSFER_FAILED, the link is dropped, nothing is left
    waiting for an acknowledgement."""
    from zmq_rpc.worker.backends.numpy_backend import NumpyBackend
    from zmq_rpc.worker.peer.links import PeerLinks
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    links = PeerLinks(ctx, NumpyBackend(), bind="tcp://127.0.0.1:*")
    try:
        dead_end = "tcp://127.0.0.1:9"
        links.links.get(dead_end).disconnect(dead_end)      # what a failed handshake leaves: no pipe
        outcome: list[str | None] = []
        start = time.monotonic()
        with pytest.raises(WireError, match="cannot take a message now") as err:
            links.start_probe(dead_end, 5000, object(), outcome.append)
        assert time.monotonic() - start < 1 and err.value.code == ErrorCode.TRANSFER_FAILED
        assert not links.outgoing and dead_end not in links.links and not outcome
    finally:
        links.close()
        ctx.term()
