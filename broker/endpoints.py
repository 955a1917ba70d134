"""ZeroMQ endpoints read the way libzmq reads them: one parser for every place that checks one.

Pure functions, any thread. libzmq's grammar (``tcp_address.cpp``, ``ip_resolver.cpp``) is wider than
``scheme://host:port``: a tcp endpoint may start with a *source* address, ``tcp://SRC;HOST:PORT``
(split at the last ``;``), and libzmq binds or connects ``HOST:PORT``, the part after it. Reading
the host before the first ``:`` would take ``tcp://127.0.0.1:1;0.0.0.0:5555`` for loopback while
libzmq listens on 0.0.0.0. libzmq also reads IPv4 in inet_aton's forms (``127.1``,
``0x7f000001``, ``2130706433``, octal ``010.0.0.1``) and resolves interface names and host names.

:func:`parse_endpoint` accepts a strict subset and refuses the rest with a message saying what to
write instead (:class:`EndpointError`, a ``ValueError``):

- ``tcp://[SRC;]HOST:PORT``: HOST a dotted-quad IPv4 address, a bracketed IPv6 address
  (``[::1]``, ``[fe80::1%eth0]``), ``*`` (every interface), or a host or interface name
  (letters, digits, ``.``, ``-``, ``_``; a name libc would read as an IPv4 number is refused).
  PORT 0-65535, or ``*`` (a free one). SRC: the same forms, with an optional ``:PORT``;
- ``ipc://PATH`` (``ipc://@NAME``: Linux's abstract namespace), ``inproc://NAME``.

Other schemes (pgm, ws, tipc, udp...) are refused: zmq-rpc neither needs nor checks them. What an
endpoint may name where (a worker's bind, a peer endpoint a client hands over) is for the caller
to ask of the parsed :class:`Endpoint` (:meth:`Endpoint.is_loopback`, :attr:`Endpoint.ip`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

__all__ = ["Endpoint", "EndpointError", "parse_endpoint", "bind_endpoint", "is_loopback_endpoint",
           "needs_ipv6", "LOOPBACK_NAMES"]

SCHEMES = ("tcp", "ipc", "inproc")
LOOPBACK_NAMES = ("localhost",)
"""Names that count as loopback without resolving them (the worker also checks what it bound)."""
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")
_PORT = re.compile(r"[0-9]{1,5}")
MAX_ENDPOINT = 1024


class EndpointError(ValueError):
    """An endpoint zmq-rpc does not understand, or that has no place where it was given."""


@dataclass(frozen=True)
class Host:
    """A tcp host: ``ip`` when it is an address literal (no brackets), else ``name``
    (``*`` for every interface)."""

    text: str
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    port: str = ""

    @property
    def wildcard(self) -> bool:
        return self.text == "*"


@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint: ``scheme`` and, for tcp, the ``host`` libzmq binds or connects to
    (after any ``source;``) and its ``port``; for ipc/inproc, ``path``."""

    text: str
    scheme: str
    host: Host | None = None
    source: Host | None = None
    path: str = ""

    @property
    def port(self) -> str:
        return self.host.port if self.host is not None else ""

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The host as an address literal (None for names, ``*``, ipc and inproc)."""
        return self.host.ip if self.host is not None else None

    @property
    def ipv6(self) -> bool:
        """A tcp endpoint with an IPv6 literal (its socket needs ``zmq.IPV6``)."""
        hosts = (self.host, self.source)
        return any(h is not None and isinstance(h.ip, ipaddress.IPv6Address) for h in hosts)

    def is_loopback(self) -> bool:
        """Whether only this machine can reach it: ipc and inproc, and tcp on a loopback
        address (or ``localhost``). ``*``, other addresses and interface names are not."""
        if self.host is None:
            return True
        if self.host.ip is not None:
            return self.host.ip.is_loopback
        return self.host.text in LOOPBACK_NAMES


def parse_endpoint(text: str, *, wildcard_port: bool = True) -> Endpoint:
    """``text`` parsed (see the module docstring), or :class:`EndpointError` saying why not."""
    if not isinstance(text, str):
        raise EndpointError(f"an endpoint is a string like 'tcp://host:port', not {text!r}")
    if len(text) > MAX_ENDPOINT:
        raise EndpointError(f"an endpoint of {len(text)} characters is too long")
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise EndpointError(f"endpoint {text!r} has no scheme: write tcp://{text}")
    if scheme not in SCHEMES:
        raise EndpointError(f"endpoint {text!r}: scheme {scheme!r} is not one of "
                            f"{', '.join(s + '://' for s in SCHEMES)}")
    if scheme != "tcp":
        if not rest or any(c.isspace() or not c.isprintable() for c in rest):
            raise EndpointError(f"endpoint {text!r} names no {scheme} path (write "
                                f"{scheme}://NAME, without spaces)")
        return Endpoint(text, scheme, path=rest)
    source_text, semi, address = rest.rpartition(";")
    source = _host(text, source_text, wildcard_port=False) if semi else None
    return Endpoint(text, scheme, _host(text, address, wildcard_port=wildcard_port),
                    source)


def _host(text: str, hostport: str, *, wildcard_port: bool) -> Host:
    """``HOST:PORT`` (a source address too: libzmq wants its port, 0 for any)."""
    ports = "0-65535" + (" or *" if wildcard_port else "")
    if hostport.startswith("["):
        close = hostport.find("]")
        host, port = hostport[1:close], hostport[close + 1:]
        if close < 0 or not port.startswith(":"):
            raise EndpointError(f"endpoint {text!r}: an IPv6 address is written [ADDRESS]:PORT")
        return Host(host, _ipv6(text, host), _port(text, port[1:], ports, wildcard_port))
    host, colon, port = hostport.rpartition(":")
    if not colon:
        raise EndpointError(f"endpoint {text!r} needs tcp://HOST:PORT (port {ports})")
    if ":" in host:
        raise EndpointError(f"endpoint {text!r}: write an IPv6 address in brackets, "
                            f"tcp://[{host}]:{port}")
    return Host(host, _ipv4_or_name(text, host), _port(text, port, ports, wildcard_port))


def _port(text: str, port: str, ports: str, wildcard: bool) -> str:
    if wildcard and port == "*":
        return port
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise EndpointError(f"endpoint {text!r}: port {port!r} is not {ports}")
    return port


def _ipv6(text: str, host: str) -> ipaddress.IPv6Address:
    try:
        return ipaddress.IPv6Address(host)
    except ValueError:
        raise EndpointError(f"endpoint {text!r}: [{host}] is not an IPv6 address") from None


def _ipv4_or_name(text: str, host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address, or None for ``*`` and names; refuses what libc would read as an
    IPv4 number written otherwise than as a dotted quad (``127.1``, ``0x7f000001``)."""
    if host == "*":
        return None
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        pass
    if not _NAME.fullmatch(host):
        raise EndpointError(f"endpoint {text!r}: {host!r} is neither an IP address, *, nor "
                            "a host or interface name")
    try:
        socket.inet_aton(host)
    except OSError:
        return None
    raise EndpointError(f"endpoint {text!r}: write the IPv4 address {host!r} as four decimal "
                        "numbers (a.b.c.d)")


def needs_ipv6(endpoint: str) -> bool:
    """Whether a socket binding or connecting to ``endpoint`` needs ``zmq.IPV6`` (an IPv6
    literal in it); False for what does not parse (libzmq then says why)."""
    try:
        return parse_endpoint(endpoint).ipv6
    except EndpointError:
        return False


def bind_endpoint(text: str) -> Endpoint:
    """An endpoint a worker can listen on: ``tcp://HOST:PORT`` (port ``*`` or 0 for a free
    one), ``ipc://PATH`` or ``inproc://NAME``; a source address (``SRC;``) is refused, since
    libzmq ignores it on a bind and listens on what follows it."""
    endpoint = parse_endpoint(text)
    if endpoint.source is not None:
        raise EndpointError(f"endpoint {text!r}: a source address (before ';') means nothing "
                            f"to a listening socket (libzmq would listen on "
                            f"{endpoint.host.text if endpoint.host else '?'}): write "
                            "tcp://HOST:PORT alone")
    return endpoint


def is_loopback_endpoint(text: str) -> bool:
    """Whether a worker bound to ``text`` listens for this machine only (see
    :meth:`Endpoint.is_loopback`); :class:`EndpointError` for what is not understood."""
    return bind_endpoint(text).is_loopback()
