"""Cross-worker copies: worker A pushes straight to worker B; the client relays only as a fallback.

``copy_between(src, dst)`` issues, without waiting, PEER_RECV on B (which holds B's queue for this
session until the bytes have landed, so later requests to B see them) and PEER_SEND on A (which
runs after A's earlier requests, so it reads what they wrote). The client never touches the bytes.
Only the first copy between a pair of workers waits: a probe checks that A can reach B; when it
cannot (or a worker has no peer endpoint), copies between them are relayed through the client,
with a log line saying so. Any thread may call in; route state is guarded by a lock.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..broker import peer as wire
from ..broker.errors import BadRequest, RpcError
from ..broker.protocol import Cmd

if TYPE_CHECKING:
    from .client import Client, RemoteTensor

log = logging.getLogger("zmq_rpc.client.peer")

PROBE_TIMEOUT_S = 3.0

_ISSUE_LOCK = threading.Lock()
"""Held while the two halves of one copy are queued. Without it, copies issued from two threads
in opposite directions can interleave so that each worker holds its queue for a receive whose
send waits behind the other worker's receive: a deadlock until the transfer timeout. In one global
order, the earliest unfinished copy can always proceed."""


class Routes:
    """Which destination peer endpoints one source worker can reach (probed once each)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reachable: dict[str, bool] = {}

    def reachable(self, source: Client, endpoint: str) -> bool:
        with self._lock:
            known = self._reachable.get(endpoint)
        if known is None:
            known = _probe(source, endpoint)
            with self._lock:
                self._reachable[endpoint] = known
        return known

    def forget(self, endpoint: str) -> None:
        with self._lock:
            self._reachable.pop(endpoint, None)


def _probe(source: Client, endpoint: str) -> bool:
    msg = wire.PeerProbe(endpoint=endpoint, timeout_ms=int(PROBE_TIMEOUT_S * 1000))
    try:
        source._call(Cmd.PEER_PROBE, msg, timeout=PROBE_TIMEOUT_S + 5).result()
        return True
    except RpcError as exc:
        log.warning("%s cannot reach peer %s (%s): copies to it are relayed through this client",
                    source.endpoint, endpoint, exc)
        return False


def copy_between(src: RemoteTensor, dst: RemoteTensor, timeout: float | None = None) -> Future[Any]:
    """dst[...] = src across workers; see the module docstring for ordering and fallback."""
    if src.shape != dst.shape or src.ref.dtype is not dst.ref.dtype:
        raise BadRequest(f"copy needs equal shapes and dtypes: {src!r} -> {dst!r}")
    a, b = src.client, dst.client
    wait = min(a.timeout, b.timeout) if timeout is None else timeout
    target = b.info.peer_endpoint
    if not target or not a.info.peer_endpoint or a.peer_copy is False \
            or not a._routes.reachable(a, target):
        return _relay(src, dst)
    token = os.urandom(wire.TOKEN_BYTES)
    transfer_ms = max(1, int(wait * 0.8 * 1000))   # the workers' verdict comes before our timeout
    with _ISSUE_LOCK:   # every worker queues the halves of all copies in one global order
        landed = b._call(Cmd.PEER_RECV, wire.PeerRecv(token=token, dst=dst.ref,
                                                      timeout_ms=transfer_ms), timeout=wait)
        sent = a._call(Cmd.PEER_SEND, wire.PeerSend(token=token, src=src.ref, endpoint=target,
                                                    timeout_ms=transfer_ms), timeout=wait)
    from .client import _gather
    return _gather([landed, sent], lambda: None)


def _relay(src: RemoteTensor, dst: RemoteTensor) -> Future[Any]:
    """Fetch then upload. The fetch is waited for here, so the upload is queued on B before any
    later request of ours: ordering holds, at the cost of one client round trip."""
    log.info("relaying %d bytes %s -> %s through the client", src.nbytes, src.client.endpoint,
             dst.client.endpoint)
    values = src.client.get_tensor(src)
    return dst.client.set_tensor_async(dst, values)
