"""The client port listening from a worker process's first milliseconds (socket activation).

A worker's imports (argparse, logging, zmq, numpy) take tens to hundreds of milliseconds; a client
or a supervisor that connects meanwhile would be refused and retry (libzmq's reconnect interval is
100 ms). So the entry points (:mod:`zmq_rpc.worker.entry`) first bind and listen on the
``--bind`` address with a plain socket, importing nothing but :mod:`socket`; the
kernel completes clients' TCP handshakes and keeps their bytes in the socket's backlog. The
ROUTER then adopts that socket (``zmq.USE_FD``, the way libzmq takes a socket from systemd)
instead of binding its own, and serves what queued: nothing a client sent is lost, and
nothing is served before the worker has checked its flags and security as it always does.

Only plain ``tcp://A.B.C.D:PORT`` and ``tcp://*:PORT`` (``PORT`` a number or ``*``) are taken
early; anything else (names, IPv6, ``ipc://``, abbreviated flags, a bind that fails) is left to
the normal path, which reads, binds and reports it as before.

Runs on the main thread, before the worker's modules are imported.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

DEFAULT_BIND = "tcp://127.0.0.1:50052"
"""Where a worker listens unless ``--bind`` says otherwise."""

BACKLOG = 100
"""Connections the kernel queues before the ROUTER accepts them: libzmq's own ``ZMQ_BACKLOG``."""


def early_listen(argv: Sequence[str]) -> socket.socket | None:
    """A socket listening where ``argv``'s ``--bind`` says, or None when that is not a plain
    TCP address or cannot be bound now (the normal path then binds it and reports why not)."""
    bind = bind_argument(argv)
    address = None if bind is None else tcp_address(bind)
    if address is None:
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # as libzmq's listener does: a restarted worker rebinds a port in TIME_WAIT at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        return None
    return sock


def bind_argument(argv: Sequence[str]) -> str | None:
    """The ``--bind`` value argparse will read from ``argv`` (the last one given, else the
    default), or None where argv is not plain enough to be sure (an abbreviated ``--bind``,
    ``--``, a ``--bind`` with no value)."""
    value = DEFAULT_BIND
    args = iter(argv)
    for arg in args:
        name, eq, rest = arg.partition("=")
        if name == "--bind":
            given = rest if eq else next(args, None)
            if given is None or given.startswith("-"):
                return None
            value = given
        elif arg == "--" or (len(name) > 2 and "--bind".startswith(name)):
            return None
    return value


def tcp_address(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` for ``tcp://A.B.C.D:PORT`` or ``tcp://*:PORT`` (``*`` port: 0, a free
    one), else None."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon:
        return None
    if port == "*":
        number = 0
    elif port.isascii() and port.isdigit() and port[0] != "0" and int(port) <= 65535:
        number = int(port)
    else:
        return None
    if host == "*":
        return "0.0.0.0", number
    return (host, number) if _dotted_quad(host) else None


def _dotted_quad(host: str) -> bool:
    parts = host.split(".")
    return len(parts) == 4 and all(
        part.isascii() and part.isdigit() and len(part) <= 3 and int(part) <= 255
        and (part == "0" or part[0] != "0") for part in parts)
