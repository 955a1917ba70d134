"""Peer endpoints: which addresses a worker may connect its peer links to, and as whom.

Pure checks, no sockets: called on the backend thread by :mod:`~zmq_rpc.worker.peer.push` before a
PUSH link opens (:func:`check_numeric`, :class:`PeerSecurity`) and by
:class:`~zmq_rpc.worker.peer.links.PeerLinks` once at start for the worker's own advertised
endpoint (:func:`resolve_endpoint`, the only name resolution: the worker's owner chose the name).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from ...broker.endpoints import EndpointError, parse_endpoint
from ...broker.keys import KeyFileError, KeyPair, join_endpoint, split_endpoint
from ...broker.protocol import ErrorCode, WireError
from ...broker.wire import printable
from ...broker.zap import KeySet

NAMES_REFUSED = ("names an IP address (tcp://IP:PORT, tcp://[IPv6]:PORT) or ipc://PATH: libzmq "
                 "resolves a host name on the worker's I/O thread, synchronously, so a name that "
                 "does not resolve would stall every connection of this worker for seconds, and "
                 "inproc:// would reach sockets inside the worker itself, with no handshake")


def check_numeric(address: str) -> None:
    """TRANSFER_FAILED unless ``address`` is ``tcp://IP:PORT`` (an address literal, no source
    address) or ``ipc://PATH``: what a worker may connect a peer link to.

    Peer endpoints come from the network (a client's PEER_SEND, a probe's reply address).
    libzmq calls getaddrinfo for a ``tcp://NAME:PORT`` on its I/O thread and again at every
    reconnect; an unresolvable name blocks that thread for seconds each time, and with it every
    client's requests, replies and heartbeats. So links take IP
    addresses only; a worker's own advertised endpoint is resolved once at start
    (:func:`resolve_endpoint`). ``inproc://`` is refused: it reaches sockets inside this
    worker's own process with no handshake at all (the ZAP handler's
    ``inproc://zeromq.zap.01`` would take tensor chunks), and a ``SRC;`` source
    address is refused: which local address a link leaves from is not a client's to choose.
    """
    try:
        endpoint = parse_endpoint(address, wildcard_port=False)
    except EndpointError as exc:
        raise WireError(ErrorCode.TRANSFER_FAILED, f"peer endpoint {printable(address, 100)} "
                        f"refused: {printable(str(exc), 200)}; a peer endpoint "
                        f"{NAMES_REFUSED}") from None
    if endpoint.scheme == "ipc" or (endpoint.ip is not None and endpoint.source is None):
        return
    raise WireError(ErrorCode.TRANSFER_FAILED, f"peer endpoint {printable(address, 100)} "
                    f"refused: a peer endpoint {NAMES_REFUSED}")


def resolve_endpoint(endpoint: str) -> str:
    """``tcp://NAME:PORT[#curve=KEY]`` with NAME resolved to an IP address, once (a worker's
    ``--peer-advertise``, given by whoever starts it); other endpoints as they are."""
    address, key = split_endpoint(endpoint)
    parsed = parse_endpoint(address, wildcard_port=False)
    if parsed.host is None or parsed.ip is not None:
        return endpoint
    port = int(parsed.port)
    family, *_, sockaddr = socket.getaddrinfo(parsed.host.text, port, type=socket.SOCK_STREAM)[0]
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
