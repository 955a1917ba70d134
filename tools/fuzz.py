"""``zmq-rpc-fuzz``: mutation fuzzing of a live worker (every command) and of its peer port.

Runs in the main thread of its own process; the worker under test is a subprocess
(``zmq-rpc-worker``), so a crash is an exit, a hang is a probe that gets no answer, and memory is
the worker's RSS.

1. **Seed corpus**: a real :class:`~zmq_rpc.client.Client` runs every command once (buffers, views,
   set/get/memset/copy, graphs computed, registered, run, linked, freed, peer send/recv/probe/fill,
   goodbye) while the fuzzer records each request's header fields and payload frames.
2. **Mutation**: each message sent is a seed changed one to three times: frames truncated, added,
   dropped or swapped; bytes flipped, inserted or cut; a header field replaced (huge, negative and
   boundary ints, wrong types, long strings, deep or long containers); handles swapped for stale or
   unknown ones; msgpack bombs (an array or bin that claims 4 G entries, 100,000-deep nesting);
   hostile graphs (zero strides, huge shapes, long chains of views).
3. **Traffic**: several DEALER sessions pipeline mutated requests (each keeps a window in flight,
   re-HELLOs when its session is gone, reconnects when its answers stop); a PUSH sends mutated
   chunks, probes and acknowledgements to the peer PULL port; a well-behaved client probes the
   worker every second (ping, alloc, set, get, free) with default settings.
4. **Checks**: the worker stays alive, every reply parses and carries a known status, no INTERNAL
   error, every probe succeeds with each of its requests answered within ``probe_limit`` seconds
   of being sent, RSS stays within bounds. The findings
   (and the seed of every INTERNAL reply) go into the report.

``zmq-rpc-fuzz --seconds 600 --json fuzz.json``; tests/test_fuzz.py runs it for ``--fuzz-seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import IO, Any

import msgpack
import numpy as np
import zmq

from ..broker import files
from ..broker import peer as wire
from ..broker import protocol as p
from ..broker.errors import RpcError
from ..broker.protocol import Cmd, ErrorCode

Frames = list[bytes]


@dataclass(frozen=True)
class Seed:
    """One recorded request: its command, header fields and payload frames."""

    cmd: int
    fields: tuple[Any, ...]
    payload: tuple[bytes, ...]

    def header(self) -> list[Any]:
        """A fresh, deep copy of ``[cmd, 0, *fields]`` to mutate."""
        return list(msgpack.unpackb(msgpack.packb([self.cmd, 0, *self.fields],
                                                  use_bin_type=True), raw=False))

    def frames(self, req_id: int) -> Frames:
        return [msgpack.packb([self.cmd, req_id, *self.fields], use_bin_type=True),
                *self.payload]


# ------------------------------------------------------------------------------- corpus


def record_corpus(endpoint: str) -> list[Seed]:
    """Run every command once through a real client and keep what it sent."""
    from ..client import Client, Graph, hand_off
    seeds: list[Seed] = []
    with Client(endpoint, timeout=20) as a, Client(endpoint, timeout=20) as b:
        for client in (a, b):
            _record(client, seeds)
        _exercise(a, b, Graph, hand_off)
        a.connection.call(Cmd.PEER_PROBE, wire.PeerProbe(
            endpoint=a.info.peer_endpoint or "tcp://127.0.0.1:9",
            timeout_ms=500)).exception(timeout=5)
    major, minor = p.PROTOCOL_VERSION
    tensor = p.TensorRef(buffer=1, dtype=p.DType.UINT8, shape=(64,), strides=(1,), offset=0)
    for cmd, msg, payload in (
            (Cmd.HELLO, p.Hello(major=major, minor=minor, client="fuzz"), ()),
            (Cmd.HELLO, p.Hello(major=major, minor=minor, client="fuzz", timing=True), ()),
            (Cmd.STATUS, p.Empty(), ()),
            (Cmd.GOODBYE, p.Empty(), ()),
            (Cmd.PEER_RECV, wire.PeerRecv(token=b"t" * 16, dst=tensor, timeout_ms=300), ()),
            (Cmd.PEER_FILL, wire.PeerFill(token=b"t" * 16, seq=0, nchunks=1, start=0, total=64,
                                          error=""), (bytes(64),)),
            (Cmd.FILE_QUERY, files.FileQuery(path="model.gguf"), ()),
            (Cmd.READ_FILE, files.ReadFile(path="model.gguf", digest=bytes(32), reads=(
                files.FileRead("blk.0.attn_q.weight", "Q8_0", (32, 2), 0, 64, tensor),
                files.FileRead("", "", (), 0, 64, tensor))), ()),
            (Cmd.SET_FROM_CACHE, files.SetFromCache(tensor=tensor, key=bytes(32)), ()),
            (Cmd.SET_TENSOR, p.SetTensor(tensor=tensor, cache_key=bytes(32)), (bytes(64),))):
        seeds.append(Seed(int(cmd), tuple(msg.to_fields()), payload))
    return seeds


def _record(client: Any, seeds: list[Seed]) -> None:
    """Keep what ``client`` sends: every request goes through its connection's ``call`` (a
    future) or ``request`` (a blocking call of one request)."""
    connection = client.connection
    for name in ("call", "request"):
        setattr(connection, name, _recording(getattr(connection, name), seeds))


def _recording(send: Callable[..., Any], seeds: list[Seed]) -> Callable[..., Any]:
    def recording(cmd: Cmd, msg: p.Message, payload: Any = (), *args: Any, **kw: Any) -> Any:
        seeds.append(Seed(int(cmd), tuple(msg.to_fields()),
                          tuple(bytes(memoryview(f)) for f in payload)))
        return send(cmd, msg, payload, *args, **kw)
    return recording


def _exercise(a: Any, b: Any, graph_cls: Any, hand_off: Callable[..., Any]) -> None:
    buf = a.alloc_buffer(1 << 16)
    x = buf.tensor((16, 16), "float32")
    y = buf.tensor((16, 16), "float32", offset=4096)
    z = buf.tensor((16, 16), "float32", offset=8192)
    idx = buf.tensor((4,), "int32", offset=12288)
    a.set_tensor(x, np.ones((16, 16), np.float32))
    a.set_tensor(idx, np.arange(4, dtype=np.int32))
    a.get_tensor(x[::2, :8].T)
    a.memset_tensor(y, 0)
    a.copy_tensor(x, y)
    buf.clear(0)
    a.device_memory()
    a.synchronize()
    a.ping()
    g = graph_cls()
    g.silu(g.add(g.matmul(x, y, transpose_b=True), g.transpose(z)), out=z)
    a.compute(g, fetch=[z]) if _takes(a.compute, "fetch") else a.compute(g)
    g2 = graph_cls()
    g2.sum(g2.get_rows(x, idx), axis=0, out=y[0])
    h = a.register(g2)
    a.run(h, inputs={x: np.zeros((16, 16), np.float32)}, fetch=[y]) \
        if _takes(a.run, "fetch") else a.run(h)
    dst_buf = b.alloc_buffer(1 << 12)
    dst = dst_buf.tensor((16, 16), "float32")
    a.copy_tensor(x, dst)                       # PEER_RECV + PEER_SEND (or the relay: PEER_FILL)
    hb = b.register(_noop_graph(graph_cls, dst))
    for _ in range(3):                      # linked, linked and kept, then kept runs (1.15)
        link = hand_off(y, dst)
        fut = a.run_async(h, send=[link])
        b.run_async(hb, receive=[link]).result(timeout=20)
        fut.result(timeout=20)
    h.free()
    buf.free()


def _noop_graph(graph_cls: Any, t: Any) -> Any:
    g = graph_cls()
    g.scale(t, 1.0, out=t)
    return g


def _takes(fn: Callable[..., Any], name: str) -> bool:
    import inspect
    return name in inspect.signature(fn).parameters


# ------------------------------------------------------------------------------ mutation

INTS = [0, 1, -1, 2, 7, 255, 256, 4095, 65536, 2**31 - 1, 2**31, -(2**31), 2**32, 2**32 - 1,
        2**40, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]
BOMBS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xffxx",
         b"\xdb\xff\xff\xff\xffab", b"\x91" * 100_000 + b"\x00", b"\xdc\xff\xff" + b"\xc0" * 10,
         b"\xc9\xff\xff\xff\xff\x01", b"\x93\x08\x01" + b"\x91" * 5000 + b"\x00"]


class Mutator:
    """Turns seeds into hostile messages (deterministic for a given ``random.Random``)."""

    def __init__(self, rng: random.Random, seeds: list[Seed]) -> None:
        self.rng = rng
        self.seeds = seeds

    def message(self, req_id: int) -> Frames:
        seed = self.rng.choice(self.seeds)
        frames = seed.frames(req_id)
        for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
            frames = self.rng.choice(self.STRATEGIES)(self, seed, frames)
        return frames or [b""]

    # each strategy: (seed, frames) -> frames
    def field(self, seed: Seed, frames: Frames) -> Frames:
        header = seed.header()
        slots = list(_slots(header))
        if not slots:
            return frames
        container, key = self.rng.choice(slots[1:] or slots)
        container[key] = self.value(container[key])
        try:
            frames[0] = msgpack.packb(header, use_bin_type=True)
        except (ValueError, TypeError, OverflowError):
            pass
        return frames

    def value(self, old: Any) -> Any:
        r = self.rng.random()
        if isinstance(old, int) and not isinstance(old, bool) and r < 0.5:
            return self.rng.choice([*INTS, old + 1, old - 1, old * 4096, -old,
                                    self.rng.randrange(1, 9)])     # stale/unknown handles
        choices: list[Callable[[], Any]] = [
            lambda: None, lambda: True, lambda: 1.5, lambda: float("nan"), lambda: float("inf"),
            lambda: "", lambda: "x" * self.rng.choice((1, 300, 300, 300, 70_000)), lambda: b"",
            lambda: self.rng.randbytes(self.rng.choice((1, 16, 17, 4096))), lambda: [], lambda: {},
            lambda: [old] * self.rng.choice((2, 1000)), lambda: {"k": old}, lambda: [old],
            lambda: list(range(self.rng.choice((5, 5, 5, 100_000)))),
            lambda: "\x00\n\x1b[31m" * 10]
        return self.rng.choice(choices)()

    def hostile_graph(self, seed: Seed, frames: Frames) -> Frames:
        """Zero strides and huge shapes in every tensor, or a long chain of a node."""
        header = seed.header()
        slots = list(_slots(header))
        lists = [(c, k) for c, k in slots if isinstance(c[k], list) and c[k]
                 and isinstance(c[k][0], list)]
        for container, key in slots:
            value = container[key]
            if _looks_like_tensor(value) and self.rng.random() < 0.5:
                shape = [self.rng.choice((1 << 20, 1 << 31, 0, 7)) for _ in value[2]]
                container[key] = [value[0], value[1], shape, [0] * len(value[2]), value[4]]
        if lists and self.rng.random() < 0.3:            # a long chain: one list repeated
            container, key = self.rng.choice(lists)
            container[key] = container[key] * self.rng.choice((50, 2000))
        try:
            frames[0] = msgpack.packb(header, use_bin_type=True)
        except (ValueError, TypeError, OverflowError):
            pass
        return frames

    def bytes_(self, seed: Seed, frames: Frames) -> Frames:
        i = self.rng.randrange(len(frames))
        data = bytearray(frames[i])
        op = self.rng.randrange(4)
        if op == 0 and data:
            for _ in range(self.rng.randint(1, 4)):
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        elif op == 1:
            data[self.rng.randrange(len(data) + 1):] = b""
        elif op == 2:
            at = self.rng.randrange(len(data) + 1)
            data[at:at] = self.rng.randbytes(self.rng.randint(1, 16))
        else:
            data += self.rng.randbytes(self.rng.choice((1, 100, 100, 70_000)))
        frames[i] = bytes(data)
        return frames

    def frames_(self, seed: Seed, frames: Frames) -> Frames:
        op = self.rng.randrange(5)
        if op == 0:
            return frames[:self.rng.randrange(1, len(frames) + 1)]
        if op == 1:
            size = self.rng.choice((0, 4, 4096, 4096, 1 << 20))
            count = self.rng.choice((1, 2, 40)) if size < (1 << 20) else 1
            return frames + [self.rng.randbytes(size)] * count
        if op == 2:
            other = self.rng.choice(self.seeds)
            return frames[:1] + list(other.payload)
        if op == 3 and len(frames) > 2:
            frames[1], frames[-1] = frames[-1], frames[1]
            return frames
        return [frames[0], *frames]

    def bomb(self, seed: Seed, frames: Frames) -> Frames:
        bomb = self.rng.choice(BOMBS)
        if self.rng.random() < 0.5:
            frames[0] = bomb
        else:   # inside a valid array: [cmd, req_id, <bomb>]
            frames[0] = b"\x93" + msgpack.packb(seed.cmd) + b"\x00" + bomb
        return frames

    STRATEGIES: list[Callable[[Mutator, Seed, Frames], Frames]] = [
        field, field, field, hostile_graph, bytes_, bytes_, frames_, bomb]


def _slots(root: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) in a nested list/dict tree, iteratively."""
    stack = [root]
    while stack:
        node = stack.pop()
        items = enumerate(node) if isinstance(node, list) else (
            ((k, node[k]) for k in list(node)) if isinstance(node, dict) else ())
        for key, value in items:
            yield node, key
            if isinstance(value, (list, dict)):
                stack.append(value)


def _looks_like_tensor(value: Any) -> bool:
    return (isinstance(value, list) and len(value) == 5 and isinstance(value[2], list)
            and isinstance(value[3], list) and len(value[2]) == len(value[3]))


def peer_message(rng: random.Random, reply_to: str) -> Frames:
    """A mutated peer-port message: chunk, ack or probe."""
    token = rng.randbytes(16) if rng.random() < 0.9 else rng.randbytes(rng.choice((0, 15, 17)))
    kind = rng.randrange(3)
    head = [wire.PEER_VERSION if rng.random() < 0.95 else rng.choice(INTS[:8]), kind + 1]
    if kind == 0:
        size = rng.choice((0, 1, 16, 4096))
        fields = [token, rng.choice(INTS[:10]), rng.choice(INTS[:10]), rng.choice(INTS),
                  rng.choice((size, *INTS)), rng.choice((reply_to, "", "tcp://\x00x:1"))]
        frames = [msgpack.packb(head + fields, use_bin_type=True), rng.randbytes(size)]
    elif kind == 1:
        frames = [msgpack.packb(head + [token, rng.random() < 0.5,
                                        "x" * rng.choice((0, 10, 5000))], use_bin_type=True)]
    else:
        frames = [msgpack.packb(head + [token, rng.choice((reply_to, "tcp://127.0.0.1:9",
                                                           "nope"))], use_bin_type=True)]
    if rng.random() < 0.3:
        frames = Mutator(rng, [Seed(0, (), ())]).bytes_(Seed(0, (), ()), frames)
    if rng.random() < 0.05:
        frames[0] = rng.choice(BOMBS)
    return frames


# ------------------------------------------------------------------------------- driving


@dataclass
class Report:
    """What a fuzz run saw."""

    seconds: float = 0.0
    messages: int = 0
    peer_messages: int = 0
    replies: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    malformed_replies: int = 0
    internal_errors: list[str] = field(default_factory=list)
    probes: int = 0
    probe_failures: list[str] = field(default_factory=list)
    probe_ms_max: float = 0.0
    probe_ms_median: float = 0.0
    probe_ms: list[float] = field(default_factory=list)
    """Every probe's duration (alloc, set, get, free), in order."""
    request_ms_max: float = 0.0
    """The longest any one probe request waited for its answer (the bound is per request)."""
    reconnects: int = 0
    rss_before: int = 0
    rss_peak: int = 0
    rss_after: int = 0
    worker_exit: int | None = None
    seeds: int = 0
    worker_errors: list[str] = field(default_factory=list)
    """What the worker logged at ERROR or above (each record's first line and, for a
    traceback, its last): a bug of ours, as an INTERNAL reply is; empty for ``--worker``."""

    @property
    def ok(self) -> bool:
        return (self.worker_exit is None and not self.malformed_replies
                and not self.internal_errors and not self.probe_failures
                and not self.worker_errors)


class Session:
    """One fuzzing DEALER: pipelines mutated requests, keeps its session alive."""

    WINDOW = 64

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.sock: zmq.Socket[bytes] | None = None
        self.in_flight = 0
        self.last_reply = time.monotonic()
        self.sent: dict[int, Frames] = {}
        self.connect()

    def connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"f" + os.urandom(15))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(self.endpoint)
        self.in_flight = 0
        self.sent.clear()
        self.last_reply = time.monotonic()
        self.hello()

    def hello(self) -> None:
        assert self.sock is not None
        major, minor = p.PROTOCOL_VERSION
        self.sock.send(p.encode_request(Cmd.HELLO, 0, p.Hello(major=major, minor=minor,
                                                              client="fuzz")))
        self.in_flight += 1


def rss_of(pid: int) -> int:
    """Resident bytes of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Fuzzer:
    """Drives sessions, the peer port and the probe against one worker process."""

    def __init__(self, endpoint: str, pid: int, seeds: list[Seed], rng: random.Random,
                 sessions: int = 4, probe_limit: float = 5.0, peer_share: float = 0.1) -> None:
        self.endpoint = endpoint
        self.pid = pid
        self.rng = rng
        self.mutator = Mutator(rng, seeds)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sessions = [Session(self.ctx, endpoint) for _ in range(sessions)]
        self.probe_limit = probe_limit
        self.peer_share = peer_share
        self.report = Report(seeds=len(seeds))
        self.req_ids = iter(range(1, 1 << 62))
        self.started = time.monotonic()

    def run(self, seconds: float, max_messages: int = 0) -> Report:
        from ..client import Client
        report = self.report
        report.rss_before = rss_of(self.pid)
        peer, acks, probe_client = None, None, Client(self.endpoint)
        try:
            peer_ep = probe_client.info.peer_endpoint
            if peer_ep:
                acks = self.ctx.socket(zmq.PULL)
                acks.bind("tcp://127.0.0.1:*")
                peer = self.ctx.socket(zmq.PUSH)
                peer.setsockopt(zmq.LINGER, 0)
                peer.setsockopt(zmq.SNDHWM, 1000)
                peer.connect(peer_ep)
            self._loop(seconds, max_messages, peer, acks, probe_client)
        finally:
            probe_client.close()
            for sock in [s.sock for s in self.sessions] + [peer, acks]:
                if sock is not None:
                    sock.close(linger=0)
            self.ctx.term()
        return report

    def _loop(self, seconds: float, max_messages: int, peer: Any, acks: Any,
              probe_client: Any) -> None:
        report = self.report
        start = time.monotonic()
        next_probe = start + 1.0
        reply_to = acks.getsockopt_string(zmq.LAST_ENDPOINT) if acks is not None else ""
        poller = zmq.Poller()
        for s in self.sessions:
            poller.register(s.sock, zmq.POLLIN)
        while time.monotonic() - start < seconds and not (
                max_messages and report.messages >= max_messages):
            for s in self.sessions:
                self._feed(s, poller)
            if peer is not None:
                for _ in range(int(self.peer_share * 8 * len(self.sessions))):
                    self._peer(peer, acks, reply_to)
            for sock, _ in poller.poll(5):
                self._drain(next(s for s in self.sessions if s.sock is sock))
            now = time.monotonic()
            if now >= next_probe:
                if int(now - start) // 60 != int(next_probe - 1.0 - start) // 60:
                    print(f"fuzz: {report.messages:,} messages, {report.replies:,} replies, "
                          f"{report.peer_messages:,} peer, RSS {rss_of(self.pid) >> 20} MiB, "
                          f"{dict(report.statuses).get('INTERNAL', 0)} INTERNAL, "
                          f"{len(report.probe_failures)} probe failures", file=sys.stderr,
                          flush=True)
                self._probe(probe_client)
                next_probe = time.monotonic() + 1.0
                report.rss_peak = max(report.rss_peak, rss_of(self.pid))
                if rss_of(self.pid) == 0:
                    break
        report.seconds = time.monotonic() - start

    def _feed(self, s: Session, poller: zmq.Poller) -> None:
        assert s.sock is not None
        if s.in_flight >= Session.WINDOW:
            if time.monotonic() - s.last_reply > 3.0:       # a long PEER_RECV holds its queue
                poller.unregister(s.sock)
                s.connect()
                poller.register(s.sock, zmq.POLLIN)
                self.report.reconnects += 1
            return
        for _ in range(8):
            req_id = next(self.req_ids)
            frames = self.mutator.message(req_id)
            try:
                s.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            s.in_flight += 1
            self.report.messages += 1
            if len(s.sent) > 4096:
                s.sent.clear()
            s.sent[req_id] = frames

    def _drain(self, s: Session) -> None:
        assert s.sock is not None
        while True:
            try:
                frames = s.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            s.in_flight = max(0, s.in_flight - 1)
            s.last_reply = time.monotonic()
            self.report.replies += 1
            self._check(s, frames)

    def _check(self, s: Session, frames: list[bytes]) -> None:
        report = self.report
        try:
            header = p.unpack_header(frames[0])
            status = header[0]
            name = "OK" if status == p.STATUS_OK else ErrorCode(status).name
        except (RpcError, ValueError):
            report.malformed_replies += 1
            return
        report.statuses[name] += 1
        if name == "INTERNAL" and len(report.internal_errors) < 50:
            sent = s.sent.get(header[1])
            report.internal_errors.append(
                f"{header[2] if len(header) > 2 else ''} <- "
                f"{[f[:200].hex() for f in sent] if sent else 'unknown request'}")
        if name == "NO_SESSION":
            s.hello()

    def _peer(self, peer: Any, acks: Any, reply_to: str) -> None:
        try:
            peer.send_multipart(peer_message(self.rng, reply_to), zmq.NOBLOCK)
            self.report.peer_messages += 1
        except zmq.ZMQError:
            pass
        while acks.poll(0):
            acks.recv_multipart()

    def _probe(self, client: Any) -> None:
        """Four requests of a well-behaved client (alloc; set and get pipelined; free). The
        contract checked is the failure contract's (docs/FAILURES.md): each request answered within ``probe_limit`` seconds
        of being sent (a probe, four of them in turn, may take longer)."""
        started = time.monotonic()
        self.report.probes += 1
        step = "alloc"
        try:
            buf = self._answered(client.alloc_buffer_async(4096), started)
            t = buf.tensor((1024,), "float32")
            data = np.full(1024, self.report.probes, np.float32)
            sent = time.monotonic()
            done, pending = client.set_tensor_async(t, data), client.get_tensor_async(t)
            step = "set"
            self._answered(done, sent)
            step = "get"
            got = self._answered(pending, sent)
            step = "free"
            self._answered(buf.free_async(), time.monotonic())
            if not np.array_equal(got, data):
                raise AssertionError("probe read back different bytes")
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            self.report.probe_failures.append(
                f"probe {self.report.probes} at {started - self.started:.0f} s, {step} after "
                f"{time.monotonic() - started:.1f} s: {type(exc).__name__}: {exc}"[:300])
        elapsed = (time.monotonic() - started) * 1000
        self.report.probe_ms.append(round(elapsed, 2))
        self.report.probe_ms_max = max(self.report.probe_ms_max, elapsed)
        self.report.probe_ms_median = float(np.median(self.report.probe_ms))

    def _answered(self, future: Any, sent: float) -> Any:
        """The future's result, at most ``probe_limit`` seconds after its request was sent."""
        result = future.result(timeout=max(0.0, sent + self.probe_limit - time.monotonic()))
        waited = (time.monotonic() - sent) * 1000
        self.report.request_ms_max = max(self.report.request_ms_max, waited)
        return result


UNTRUSTED_MAX_WORK = 10**8
"""``--max-graph-work`` of the worker the fuzz starts: ~0.1 s of numpy, what docs/SECURITY.md tells a
worker serving untrusted clients to set. Under the default (2^35: 10-40 s, for a large model's
prefill) the mutations' own graphs could hold the backend thread past the probes' bound: the
corpus's one-node graph on a zero-stride (2^20, 7) view, its node list repeated 2,000 times (both
``hostile_graph`` mutations), ran 48 s on a loaded 2-vCPU VM."""


def start_worker(mem: str = "256MiB", extra: tuple[str, ...] = (),
                 log: IO[bytes] | None = None) -> tuple[subprocess.Popen[str], str]:
    """A worker subprocess on a free loopback port, configured for untrusted clients
    (:data:`UNTRUSTED_MAX_WORK`; ``extra`` flags come after, so they may override it). Its log
    goes to ``log`` (a file: a pipe nobody reads while the fuzz runs would stop the worker at
    its first write past the pipe's 64 KiB), or nowhere."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zmq_rpc.worker.cli", "--bind", "tcp://127.0.0.1:*", "--mem", mem,
         "--session-timeout", "10", "--log-level", "ERROR", "--max-graph-work", str(UNTRUSTED_MAX_WORK),
         *extra],
        stdout=subprocess.PIPE, stderr=log if log is not None else subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"worker did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


_LOG_RECORD = re.compile(r"^\S+ \S+,\d+ ([A-Z]+) (.*)$")
"""A record's first line in the worker's log format (``%(asctime)s %(levelname)s ...``)."""


def logged_errors(text: str, most: int = 20) -> list[str]:
    """The ERROR and CRITICAL records of a worker's log, each as its first line and, after a
    traceback, the exception it ended with; at most ``most``, then how many more."""
    found: list[str] = []
    record: list[str] = []
    for line in [*text.splitlines(), "0000-00-00 00:00:00,000 END of log"]:
        start = _LOG_RECORD.match(line)
        if start is None:
            if record and line and not line[0].isspace() and not line.startswith("Traceback"):
                record[1:] = [line]                 # a traceback's last line: the exception
            continue
        if record:
            found.append(" <- ".join(reversed(record)))
        record = [start.group(2)] if start.group(1) in ("ERROR", "CRITICAL") else []
    return found[:most] + ([f"... and {len(found) - most} more"] if len(found) > most else [])


def fuzz(seconds: float, max_messages: int = 0, seed: int = 0, mem: str = "256MiB",
         settle: float = 12.0) -> Report:
    """Start a worker, record the corpus, fuzz it, check it afterwards, stop it."""
    with tempfile.TemporaryFile() as log:
        proc, endpoint = start_worker(mem, log=log)
        try:
            seeds = record_corpus(endpoint)
            fuzzer = Fuzzer(endpoint, proc.pid, seeds, random.Random(seed))
            report = fuzzer.run(seconds, max_messages)
            time.sleep(settle)              # sessions expire (10 s); what they held is freed
            report.rss_after = rss_of(proc.pid)
            if proc.poll() is None:
                _final_probe(endpoint, report)
            report.worker_exit = proc.poll()
        finally:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        log.seek(0)
        report.worker_errors = logged_errors(log.read().decode(errors="replace"))
    return report


def _final_probe(endpoint: str, report: Report) -> None:
    from ..client import Client
    try:
        with Client(endpoint) as c:
            t = c.alloc_buffer(1 << 20).tensor((1 << 18,), "float32")
            c.set_tensor(t, np.ones(1 << 18, np.float32))
            if float(c.get_tensor(t).sum()) != float(1 << 18):
                raise AssertionError("wrong bytes after the fuzz")
    except Exception as exc:  # noqa: BLE001
        report.probe_failures.append(f"after the run: {type(exc).__name__}: {exc}"[:300])


def report_json(report: Report) -> dict[str, Any]:
    """The report as JSON-ready data (``asdict`` would turn the Counter's items into keys)."""
    data = {f.name: getattr(report, f.name) for f in fields(report)}
    data["statuses"] = dict(report.statuses)
    data["ok"] = report.ok
    return data


def fuzz_running(endpoint: str, pid: int, seconds: float, max_messages: int = 0,
                 seed: int = 0) -> Report:
    """Fuzz a worker that is already running (``zmq-rpc-fuzz --worker``): one segment of a long
    run; the worker keeps running. ``pid`` (0: unknown) is only read for its RSS."""
    seeds = record_corpus(endpoint)
    report = Fuzzer(endpoint, pid, seeds, random.Random(seed)).run(seconds, max_messages)
    if pid:
        report.rss_after = rss_of(pid)
        report.worker_exit = None if report.rss_after else -1
    if report.worker_exit is None:
        _final_probe(endpoint, report)
    return report


SUMMED = ("seconds", "messages", "peer_messages", "replies", "malformed_replies", "probes",
          "reconnects")


def add_segment(totals: dict[str, Any], segment: dict[str, Any]) -> dict[str, Any]:
    """The totals of a long run after one more segment (``--continue FILE``): counts summed,
    lists concatenated, RSS before from the first segment, peak the highest, after the last."""
    if not totals:
        return {**segment, "segments": 1}
    out = dict(totals)
    for name in SUMMED:
        out[name] = totals.get(name, 0) + segment.get(name, 0)
    statuses = Counter(totals.get("statuses", {}))
    statuses.update(segment.get("statuses", {}))
    out["statuses"] = dict(statuses)
    for name in ("internal_errors", "probe_failures", "probe_ms", "worker_errors"):
        out[name] = list(totals.get(name, [])) + list(segment.get(name, []))
    for name in ("probe_ms_max", "request_ms_max"):
        out[name] = max(totals.get(name, 0.0), segment.get(name, 0.0))
    out["probe_ms_median"] = float(np.median(out["probe_ms"])) if out["probe_ms"] else 0.0
    out["rss_peak"] = max(totals.get("rss_peak", 0), segment.get("rss_peak", 0))
    out["rss_after"] = segment.get("rss_after", 0)
    out["worker_exit"] = segment.get("worker_exit")
    out["segments"] = totals.get("segments", 1) + 1
    out["ok"] = bool(totals.get("ok")) and bool(segment.get("ok"))
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zmq-rpc-fuzz``."""
    ap = argparse.ArgumentParser(prog="zmq-rpc-fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--messages", type=int, default=0, help="stop after this many (0: time only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem", default="256MiB")
    ap.add_argument("--worker", default="", metavar="ENDPOINT",
                    help="fuzz this running worker instead of starting one (it keeps running)")
    ap.add_argument("--pid", type=int, default=0,
                    help="with --worker: its process id, to watch its RSS and that it lives")
    ap.add_argument("--continue", dest="totals", default="", metavar="FILE",
                    help="add this run to the totals in FILE (created if missing) and write "
                         "them back: a long run in segments against one --worker")
    ap.add_argument("--json", default="", help="write the report here")
    args = ap.parse_args(argv)
    if args.worker:
        report = fuzz_running(args.worker, args.pid, args.seconds, args.messages, args.seed)
    else:
        report = fuzz(args.seconds, args.messages, args.seed, args.mem)
    data = report_json(report)
    if args.totals:
        totals: dict[str, Any] = {}
        if os.path.exists(args.totals):
            with open(args.totals) as f:
                totals = json.load(f)
        data = add_segment(totals, data)
        with open(args.totals, "w") as f:
            json.dump(data, f, indent=1, default=str)
    text = json.dumps({k: v for k, v in data.items() if k != "probe_ms"}, indent=1, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
