"""The broker thread: owns a worker's ROUTER front-end and the broker end of the inproc PAIR.

Runs in its own thread (:class:`BrokerThread`). Forwarding is ``zmq.proxy_steerable`` — libzmq's C
loop, which passes frames by reference and never takes the GIL per message (a Python forwarding loop
would, at a large cost in pipelined throughput: docs/DESIGN.md). Everything else (sessions, validation,
replies) is the backend thread's; the broker only moves frames and obeys TERMINATE on its control
socket.

Socket options chosen here:
- ROUTER_MANDATORY stays off: zmq_proxy would stop on the EHOSTUNREACH it raises for a client that
  left while its reply was under way; such a reply is dropped, and the client has gone anyway.
- Requests are bounded, replies are not dropped for clients that read them. Each client's inbound
  pipe holds at most ``CLIENT_RCVHWM`` messages and the PAIR towards the backend ``BACKEND_HWM``
  (both sides together twice that): when the backend is behind, the proxy stops reading, libzmq
  stops reading the clients' TCP sockets, and each client feels its own backpressure, while
  libzmq's fair queuing across client pipes lets every other client's next request through
  after at most one of the flooder's per turn. So a client that floods waits for itself (its
  sends back up on its side), and the others' median latency stays within a few queued requests
  of idle (tests/test_quotas.py). libzmq's proxy forwards a burst of up to 1000 requests with
  blocking sends, and while the full PAIR holds it there it forwards no reply; so the backend
  reads the PAIR ahead and serves first the client that used the least backend time
  (worker/dispatch/inbox.py), and the PAIR fills only
  while one request runs long or a flood outruns the read-ahead (that test's 64 KiB flood does).
  Replies to a client are held up to ``CLIENT_SNDHWM`` messages; a
  client that never reads them loses those beyond it (zmq-rpc's client keeps at most 512
  requests in flight, under it). The PAIR's reply direction is unbounded, so the backend never
  blocks on a reply.
- MAXMSGSIZE refuses oversized messages at the socket: libzmq drops that peer's connection.
- No ZMTP heartbeat of its own (HEARTBEAT_IVL stays 0): libzmq 4.3.5 (and its master) aborts the
  process with ``Assertion failed: !_io_error (stream_engine_base.cpp:310)`` when the heartbeat
  timer fires on a connection whose input is stopped by the HWM above after the peer reset it
  (zeromq/libzmq#4364, #3937, #4767): a client that floods and then closes with replies unread
  killed the worker (tests/test_quotas.py reproduces it every time with the backend busy).
  Frozen or vanished clients are still dropped: zmq-rpc's client sends a ZMTP PING every 0.5 s
  with a TTL of 5 s, on which libzmq closes the connection once the client falls silent; TCP
  keepalive (``KEEPALIVE_*``) closes the connections of raw clients whose host vanished.
- With a key pair the ROUTER is a CURVE server in the ZAP domain ``zmq-rpc-client``: a connection
  whose key the ZAP handler (:mod:`zmq_rpc.broker.zap`) refuses never delivers a message.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from .endpoints import needs_ipv6

if TYPE_CHECKING:
    from .keys import KeyPair

log = logging.getLogger("zmq_rpc.broker")

CLIENT_RCVHWM = 1024
"""Requests libzmq holds per client connection before it stops reading that client's socket:
more than zmq-rpc's client keeps in flight (512), so our clients never stop a connection's input.
A stopped connection that receives a ZMTP PING (our clients send one every 0.5 s) and then a
reset aborts the process in libzmq 4.3.5 (worker/peer/push.py, docs/SECURITY.md)."""
CLIENT_SNDHWM = 1024
"""Replies held per client connection; more than that to a client that does not read are dropped.
zmq-rpc's client keeps at most 512 requests in flight; replies are copied into libzmq only below
64 KiB (bigger ones alias buffers or are counted in ``--mem``), so this holds at most 64 MiB of
reply copies per connection (docs/SECURITY.md, what the RSS is made of)."""
BACKEND_HWM = 32
"""Requests queued on the inproc PAIR per side (the backend's PAIR sets its RCVHWM to this)."""
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 5, 3
"""TCP keepalive on client connections: a silent peer is probed after 30 s and dropped after 3
unanswered probes 5 s apart (a client without ZMTP heartbeats whose host vanished: ~45 s)."""


@dataclass(frozen=True)
class BrokerConfig:
    """Where the front-end listens and how it guards itself."""

    bind: str
    backend_endpoint: str
    control_endpoint: str
    max_message_size: int
    listening_fd: int | None = None
    """A socket already listening on ``bind``: the ROUTER adopts it (``zmq.USE_FD``)."""
    curve: KeyPair | None = None
    """The worker's key pair: clients must speak CURVE and pass the ZAP handler."""


def make_curve_server(sock: zmq.Socket[bytes], keys: KeyPair, domain: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server whose clients the ZAP handler checks."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


class BrokerThread(threading.Thread):
    """Binds the ROUTER, connects the PAIR to the backend thread, and proxies until TERMINATE."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], config: BrokerConfig) -> None:
        super().__init__(name="zmq-rpc-broker", daemon=False)
        self.ctx = ctx
        self.config = config
        self.endpoint = ""
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        try:
            router, pair, control = self._open(sockets)
            self.ready.set()
            zmq.proxy_steerable(router, pair, None, control)
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # reported to whoever waits on ready
            self.error = exc
            if self.ready.is_set():   # a failure to open is the starter's to report
                log.exception("broker thread failed")
        finally:
            self.ready.set()
            for sock in sockets:
                sock.close(linger=1000 if sock.type == zmq.ROUTER else 0)

    def _open(self, sockets: list[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], ...]:
        cfg = self.config
        router = self.ctx.socket(zmq.ROUTER)
        sockets.append(router)
        router.setsockopt(zmq.SNDHWM, CLIENT_SNDHWM)
        router.setsockopt(zmq.RCVHWM, CLIENT_RCVHWM)
        router.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_size)
        router.setsockopt(zmq.TCP_KEEPALIVE, 1)
        router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
        router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
        if cfg.curve is not None:
            from .zap import CLIENT_DOMAIN  # with CURVE only: a plain worker listens sooner
            make_curve_server(router, cfg.curve, CLIENT_DOMAIN)
        router.setsockopt(zmq.IPV6, needs_ipv6(cfg.bind))
        if cfg.listening_fd is not None:
            router.setsockopt(zmq.USE_FD, cfg.listening_fd)
        try:
            router.bind(cfg.bind)
        except zmq.ZMQError as exc:
            hint = (" (another process listens there: choose another port, or port * for a "
                    "free one)" if exc.errno == zmq.EADDRINUSE else "")
            raise OSError(f"cannot bind {cfg.bind}: {zmq.strerror(exc.errno or 0)}{hint}") from None
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        pair = self.ctx.socket(zmq.PAIR)
        sockets.append(pair)
        pair.setsockopt(zmq.SNDHWM, BACKEND_HWM)
        pair.setsockopt(zmq.RCVHWM, 0)
        pair.connect(cfg.backend_endpoint)
        control = self.ctx.socket(zmq.PAIR)
        sockets.append(control)
        control.connect(cfg.control_endpoint)
        return router, pair, control
