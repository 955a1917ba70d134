"""The ZAP handler thread: decides which CURVE keys may connect to a worker's sockets.

Runs in its own thread (:class:`ZapThread`) and alone owns the ZAP ROUTER (``inproc://zeromq.zap.01``
of the worker's zmq context). libzmq asks it once per CURVE handshake, after the client proved it
holds the secret key of the public key it presents, before any message of that connection reaches
the broker or the peer port. Two domains:

- ``zmq-rpc-client`` (the ROUTER clients talk to): the public keys in ``--authorized-keys DIR``;
- ``zmq-rpc-peer`` (the PULL port other workers push to): this worker's own key and the keys in
  ``--worker-keys DIR``.

A directory is read again whenever any of its ``*.key`` files changes (added, removed, renamed,
rewritten in place: the name, size, mtime, ctime and inode of every file are compared with the
last read's, at a handshake, at most every :data:`RESCAN_S` = 0.1 s), so keys are granted and
revoked for every handshake that starts 0.1 s after the change, without a restart; a revocation stops new connections, not the ones already open (restart the worker, or
wait for the client to reconnect). A malformed file is refused, logged by name, while the other
files still apply; a directory that cannot be listed grants nothing until it can.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from .keys import KeyDir, KeyFileError, key_dir_signature, read_key_dir
from .wire import printable

log = logging.getLogger("zmq_rpc.zap")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
CLIENT_DOMAIN = "zmq-rpc-client"
PEER_DOMAIN = "zmq-rpc-peer"
REFUSAL_LOG_EVERY = 10.0
"""Seconds between refusal log lines for one address (a flood of handshakes is one line each)."""


RESCAN_S = 0.1
"""How often, at most, a key directory's signature is taken (at a handshake, not on a timer): a
change applies to every handshake that starts this long after it. Taking it costs one scandir
and one stat per ``*.key`` file, GIL held in between (up to tens of ms for 1,000 keys:
docs/DESIGN.md): per handshake, a flood of handshakes with made-up keys would take that from
every thread of the worker."""


@dataclass
class KeySet:
    """Fixed keys plus the keys of a directory, reread when any of its ``*.key`` files changes:
    its signature (name, size, mtime, ctime, inode of every file) is compared with the last
    read's at most every :data:`RESCAN_S`."""

    fixed: frozenset[bytes] = frozenset()
    directory: str | None = None
    loaded: frozenset[bytes] = frozenset()
    scan: KeyDir | None = None
    """The last read of the directory (None: never read, or unreadable at the last look)."""
    next_look: float = 0.0

    def keys(self) -> frozenset[bytes]:
        if self.directory is not None:
            self._refresh(self.directory)
        return self.fixed | self.loaded

    def check(self) -> None:
        """KeyFileError unless the directory reads cleanly (at start: a bad file or directory
        stops the worker from starting, rather than locking someone out later)."""
        if self.directory is not None:
            scan = read_key_dir(self.directory)
            if scan.errors:
                raise KeyFileError("; ".join(scan.errors))

    def _refresh(self, directory: str) -> None:
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + RESCAN_S
        try:
            signature = key_dir_signature(directory)
            if self.scan is not None and not self.scan.stale(signature):
                return
            scan = read_key_dir(directory)
        except KeyFileError as exc:      # gone or unreadable: accept none of its keys
            if self.scan is not None or self.loaded:
                log.error("%s: accepting none of its keys until it can be read", exc)
            self.loaded, self.scan = frozenset(), None
            return
        if self.scan is None or scan.signature != self.scan.signature:
            for error in scan.errors:        # once per change, not per handshake
                log.error("refusing key file %s (the other keys of %s apply)", error,
                          directory)
            log.info("%d key(s) authorized from %s", len(scan.keys), directory)
        self.loaded, self.scan = scan.keys, scan


@dataclass
class ZapPolicy:
    """Which keys each domain accepts."""

    domains: dict[str, KeySet] = field(default_factory=dict)

    def decide(self, domain: str, mechanism: bytes, key: bytes) -> tuple[bool, str]:
        """(allowed, reason) for one handshake."""
        keyset = self.domains.get(domain)
        if keyset is None:
            return False, "unknown domain"
        if mechanism != b"CURVE":
            return False, "CURVE required"
        if len(key) != 32:
            return False, "malformed key"
        if z85.encode(key) not in keyset.keys():
            return False, "key not authorized"
        return True, "OK"


class ZapThread(threading.Thread):
    """Answers ZAP requests for one zmq context until :meth:`stop`."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], policy: ZapPolicy) -> None:
        super().__init__(name="zmq-rpc-zap", daemon=False)
        self.ctx = ctx
        self.policy = policy
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.refused = 0
        self._control_ep = f"inproc://zmq-rpc-zap-ctl-{id(self)}"
        self._control = ctx.socket(zmq.PAIR)
        self._control.bind(self._control_ep)
        self._last_logged: dict[str, float] = {}

    def run(self) -> None:
        router = self.ctx.socket(zmq.ROUTER)
        control = self.ctx.socket(zmq.PAIR)
        try:
            router.bind(ZAP_ENDPOINT)
            control.connect(self._control_ep)
            self.ready.set()
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            poller.register(control, zmq.POLLIN)
            while control not in dict(poller.poll()):
                self._answer(router)
        except BaseException as exc:
            self.error = exc
            log.exception("ZAP handler failed: every CURVE handshake will now fail")
        finally:
            self.ready.set()
            router.close(linger=0)
            control.close(linger=0)

    def stop(self) -> None:
        """Ask the thread to end and join it (call from the thread that started it)."""
        if self.is_alive():
            self._control.send(b"STOP")
            self.join()
        self._control.close(linger=0)

    def _answer(self, router: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 9 or frames[1] != b"":
                continue          # libzmq never sends these: nothing to answer
            _, _, version, request_id, domain, address, _, mechanism, *creds = frames
            ok, reason = self.policy.decide(domain.decode("latin-1"), mechanism,
                                            creds[0] if creds else b"")
            if not ok:
                self._log_refusal(domain, address, creds[0] if creds else b"", reason)
            user = z85.encode(creds[0]) if ok else b""   # peers: a stash per key
            router.send_multipart([frames[0], b"", b"1.0", request_id,
                                   b"200" if ok else b"400", reason.encode(), user, b""])

    def _log_refusal(self, domain: bytes, address: bytes, key: bytes, reason: str) -> None:
        self.refused += 1
        where = printable(address.decode("latin-1"), 64)
        now = time.monotonic()
        if now - self._last_logged.get(where, -1e9) < REFUSAL_LOG_EVERY:
            return
        if len(self._last_logged) > 4096:
            self._last_logged.clear()
        self._last_logged[where] = now
        shown = z85.encode(key).decode() if len(key) == 32 else "-"
        log.warning("refused a %s connection from %s: %s (key %s; %d refused so far)",
                    printable(domain.decode("latin-1"), 32), where, reason, shown, self.refused)
