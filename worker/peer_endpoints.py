"""Peer endpoints: which addresses a worker may connect its peer links to, and as whom.

Pure checks, no sockets: called on the backend thread by :mod:`~zmq_rpc.worker.peer_push` before a
PUSH link opens (:func:`check_numeric`, :class:`PeerSecurity`) and by
:class:`~zmq_rpc.worker.peer_links.PeerLinks` once at start for the worker's own advertised
endpoint (:func:`resolve_endpoint`, the only name resolution: the worker's owner chose the name).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

from ..broker.keys import KeyFileError, KeyPair, join_endpoint, split_endpoint
from ..broker.protocol import ErrorCode, WireError
from ..broker.wire import printable
from ..broker.zap import KeySet

NAMES_REFUSED = ("names an IP address (tcp://IP:PORT, tcp://[IPv6]:PORT) or ipc://PATH: libzmq "
                 "resolves a host name on the worker's I/O thread, synchronously, so a name that "
                 "does not resolve would stall every connection of this worker for seconds")


def check_numeric(address: str) -> None:
    """TRANSFER_FAILED unless ``address`` needs no name resolution to connect to.

    Peer endpoints come from the network (a client's PEER_SEND, a probe's reply address). libzmq
    calls getaddrinfo for a ``tcp://NAME:PORT`` on its I/O thread and again at every reconnect;
    an unresolvable name blocks that thread ~1.5 s each time, and with it every client's
    requests, replies and heartbeats (the long fuzz's lost probes). So links take IP addresses
    only; a worker's own advertised endpoint is resolved once at start (:func:`resolve_endpoint`).
    """
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc") and rest:
        return
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ok = scheme == "tcp" and bool(colon) and port.isdigit() and bool(ipaddress.ip_address(host))
    except ValueError:
        ok = False
    if not ok:
        raise WireError(ErrorCode.TRANSFER_FAILED, f"peer endpoint "
                        f"{printable(address, 100)} refused: a peer endpoint {NAMES_REFUSED}")


def resolve_endpoint(endpoint: str) -> str:
    """``tcp://NAME:PORT[#curve=KEY]`` with NAME resolved to an IP address, once (a worker's
    ``--peer-advertise``, given by whoever starts it); other endpoints as they are."""
    address, key = split_endpoint(endpoint)
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host.startswith("["):
        return endpoint
    try:
        ipaddress.ip_address(host)
        return endpoint
    except ValueError:
        pass
    family, *_, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    ip = str(sockaddr[0])
    resolved = f"tcp://[{ip}]:{port}" if family == socket.AF_INET6 else f"tcp://{ip}:{port}"
    return join_endpoint(resolved, key)


@dataclass
class PeerSecurity:
    """Who this worker's peer links authenticate as and whom they may push to."""

    keys: KeyPair | None = None
    accepted: KeySet = field(default_factory=KeySet)
    """Worker public keys a push may go to (this worker's own key included)."""

    def address(self, endpoint: str) -> tuple[str, bytes | None]:
        """The address to connect to and the server key to demand, or TRANSFER_FAILED when
        this worker must not push there."""
        try:
            address, key = split_endpoint(endpoint)
        except KeyFileError as exc:
            raise WireError(ErrorCode.TRANSFER_FAILED, f"bad peer endpoint: {exc}") from None
        check_numeric(address)
        if self.keys is None:
            if key is not None:
                raise WireError(ErrorCode.TRANSFER_FAILED, "that peer endpoint requires CURVE, "
                                "and this worker has no key pair (--curve-secret-key)")
            return address, None
        if key is None:
            raise WireError(ErrorCode.TRANSFER_FAILED, "this worker pushes only to CURVE "
                            "workers: the peer endpoint carries no key (#curve=...)")
        if key not in self.accepted.keys():
            raise WireError(ErrorCode.TRANSFER_FAILED, "that peer endpoint's key is not among "
                            "this worker's --worker-keys: it will not push there")
        return address, key
