"""Cross-worker copies: worker A pushes straight to worker B; the client relays only as a fallback.

``copy_between(src, dst)`` issues, without waiting, PEER_RECV on B (which holds B's queue for this
session until the bytes have landed, so later requests to B see them) and PEER_SEND on A (which
runs after A's earlier requests, so it reads what they wrote). The client never touches the bytes.

The first copy between two workers asks A to probe B's peer endpoint. Until the probe has answered
(and for good when it fails, or when a worker has no peer endpoint) copies are relayed: PEER_RECV on
B as above, a GET on A, and, when its reply arrives, PEER_FILL requests that hand the bytes to B's
waiting receive. Nothing in here blocks, so copies may be issued from future callbacks too; the
ordering guarantees are the same either way. Any thread may call in; route state is under a lock.

A pipeline does better with hand-offs (:func:`hand_off`) folded into its graph runs
(``client.run_async(graph, ..., receive=[h], send=[h])``, one GRAPH_RUN_LINKED each): the stage
that produces ``src`` pushes it straight after its run, the stage that consumes ``dst`` waits for
it before its run, and the step costs one request per stage instead of three (no PEER_SEND, no
PEER_RECV, no acknowledgement). Routes are the same: on one worker the hand-off is a copy queued
after the sending run; when the peers cannot reach each other it is relayed after that run.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..broker import graph as wire_graph
from ..broker import peer as wire
from ..broker.errors import BadRequest
from ..broker.protocol import Cmd, DType, TensorRef, split_tensor

if TYPE_CHECKING:
    from .client import Client, RegisteredGraph, RemoteTensor, RunResult

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
        self._probing: dict[str, Future[Any]] = {}

    def reachable(self, source: Client, endpoint: str, wait: bool) -> bool:
        """True once a probe from ``source`` reached ``endpoint``; while it is pending, waits for
        it if ``wait`` (else answers False: relay this copy)."""
        started = False
        with self._lock:
            known = self._reachable.get(endpoint)
            probe = self._probing.get(endpoint)
            if known is None and probe is None:
                probe = self._probing[endpoint] = self._send_probe(source, endpoint)
                started = True
        if started:
            # Outside the lock: a probe that has already finished runs the callback right here.
            assert probe is not None
            probe.add_done_callback(lambda f: self._record(source, endpoint, f))
        if known is not None:
            return known
        assert probe is not None
        if not wait:
            return False
        return _reached(probe, timeout=None)

    @staticmethod
    def _send_probe(source: Client, endpoint: str) -> Future[Any]:
        msg = wire.PeerProbe(endpoint=endpoint, timeout_ms=int(PROBE_TIMEOUT_S * 1000))
        return source._call(Cmd.PEER_PROBE, msg, timeout=PROBE_TIMEOUT_S + 5)

    def _record(self, source: Client, endpoint: str, probe: Future[Any]) -> None:
        ok = _reached(probe, timeout=0)
        if not ok:
            log.warning("%s cannot reach peer %s (%s): copies to it are relayed through this "
                        "client", source.endpoint, endpoint, probe.exception())
        with self._lock:
            self._reachable[endpoint] = ok
            self._probing.pop(endpoint, None)


def _reached(probe: Future[Any], timeout: float | None) -> bool:
    """The outcome of a finished (or, with ``timeout=None``, awaited) probe."""
    try:
        probe.result(timeout)
    except Exception:
        return False
    return True


def _check_pair(src: RemoteTensor, dst: RemoteTensor) -> None:
    if src.shape != dst.shape or src.ref.dtype is not dst.ref.dtype:
        raise BadRequest(f"copy needs equal shapes and dtypes: {src!r} -> {dst!r}")


TRANSFER_SHARE = 0.8
"""The workers' deadline for a transfer, as a share of the client's timeout: their verdict
comes first."""


def _transfer_ms(wait: float) -> int:
    return max(1, int(wait * TRANSFER_SHARE * 1000))


def _direct(a: Client, b: Client) -> bool:
    """Whether worker ``a`` pushes straight to worker ``b`` (probed once per pair)."""
    from .engine import on_io_thread

    target = b.info.peer_endpoint
    return bool(target and a.info.peer_endpoint and a.peer_copy and
                a._routes.reachable(a, target, wait=not on_io_thread()))


def copy_between(src: RemoteTensor, dst: RemoteTensor, timeout: float | None = None) -> Future[Any]:
    """dst[...] = src across workers; see the module docstring for ordering and fallback."""
    _check_pair(src, dst)
    a, b = src.client, dst.client
    wait = min(a.timeout, b.timeout) if timeout is None else timeout
    transfer_ms = _transfer_ms(wait)
    target = b.info.peer_endpoint
    direct = _direct(a, b)
    token = os.urandom(wire.TOKEN_BYTES)
    with _ISSUE_LOCK:   # every worker queues the halves of all copies in one global order
        landed = b._call(Cmd.PEER_RECV, wire.PeerRecv(token=token, dst=dst.ref,
                                                      timeout_ms=transfer_ms), timeout=wait)
        if direct:
            acked = "unacked-sends" not in a.info.capabilities
            sent = a._call(Cmd.PEER_SEND, wire.PeerSend(token=token, src=src.ref, endpoint=target,
                                                        timeout_ms=transfer_ms, acked=acked),
                           timeout=wait)
        else:
            sent = _relay(src, dst, token)
    if direct:
        return _done_when_landed(landed, sent, b, token)
    from .client import _gather
    return _gather([landed, sent], lambda: None)


def _done_when_landed(landed: Future[Any], sent: Future[Any], b: Client,
                      token: bytes) -> Future[None]:
    """A direct copy is done when B says the bytes have landed: A's own reply (sent after B's
    acknowledgement travels back to A) would add a hop to every copy (~0.2 ms at 64 KiB). A's
    failure still fails the copy at once, and aborts B's receive instead of leaving B's queue
    held until the transfer deadline."""
    out: Future[None] = Future()
    out.set_running_or_notify_cancel()
    lock = threading.Lock()

    def settle(error: BaseException | None) -> bool:
        with lock:
            if out.done():
                return False
            if error is None:
                out.set_result(None)
            else:
                out.set_exception(error)
            return True

    def on_landed(f: Future[Any]) -> None:
        settle(f.exception())

    def on_sent(f: Future[Any]) -> None:
        error = f.exception()
        if error is None:
            return
        if settle(error):
            b._call(Cmd.PEER_FILL, wire.PeerFill(token=token, seq=0, nchunks=1, start=0, total=0,
                                                 error=f"the sending worker failed: {error}"[:512]),
                    [b""])
        else:
            log.warning("a copy's bytes landed, but its sender then reported: %s", error)

    landed.add_done_callback(on_landed)
    sent.add_done_callback(on_sent)
    return out


def _relay(src: RemoteTensor, dst: RemoteTensor, token: bytes) -> Future[Any]:
    """GET on A; when it arrives, PEER_FILL chunks into B's waiting receive (or abort it)."""
    log.info("relaying %d bytes %s -> %s through the client", src.nbytes, src.client.endpoint,
             dst.client.endpoint)
    from .client import to_bfloat16

    fetched = src.client.get_tensor_async(src)
    b = dst.client

    def forward(f: Future[Any]) -> None:
        error = f.exception()
        if error is not None:
            b._call(Cmd.PEER_FILL, wire.PeerFill(token=token, seq=0, nchunks=1, start=0, total=0,
                                                 error=str(error)[:512]), [b""])
            return
        values = f.result()
        if dst.ref.dtype is DType.BFLOAT16:   # get_tensor widened it to float32: send raw bits
            values = to_bfloat16(values)
        flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        pieces = split_tensor(_flat_ref(dst), b.chunk_bytes)
        for seq, (start, sub) in enumerate(pieces):
            b._call(Cmd.PEER_FILL, wire.PeerFill(token=token, seq=seq, nchunks=len(pieces),
                                                 start=start, total=dst.nbytes, error=""),
                    [flat[start:start + sub.nbytes]])

    fetched.add_done_callback(forward)
    return fetched


def _flat_ref(tensor: RemoteTensor) -> TensorRef:
    """A contiguous 1-D stand-in with the tensor's byte count (for cutting the relayed bytes)."""
    size = tensor.ref.dtype.itemsize
    return TensorRef(buffer=0, dtype=tensor.ref.dtype, shape=(tensor.ref.numel,), strides=(size,),
                     offset=0)


# ------------------------------------------------------------------------------ hand-offs

Route = Literal["local", "direct", "relay"]


@dataclass(frozen=True)
class HandOff:
    """``dst[...] = src`` between two graph runs: name it in ``send`` of the run on ``src``'s
    worker and in ``receive`` of the run on ``dst``'s worker, issuing the sending run first.
    Each hand-off object is used for one transfer (its token): make a new one per step."""

    src: RemoteTensor
    dst: RemoteTensor
    token: bytes
    route: Route
    timeout_ms: int


def hand_off(src: RemoteTensor, dst: RemoteTensor) -> HandOff:
    """Plan a hand-off of ``src`` into ``dst`` (equal shapes and dtypes) and pick its route."""
    _check_pair(src, dst)
    a, b = src.client, dst.client
    route: Route = "local" if a is b else "direct" if _direct(a, b) else "relay"
    return HandOff(src, dst, os.urandom(wire.TOKEN_BYTES), route,
                   _transfer_ms(min(a.timeout, b.timeout)))


def receive(client: Client, h: HandOff) -> Future[None]:
    """Land a hand-off that no run receives, in ``client``'s queue (a PEER_RECV)."""
    if h.dst.client is not client:
        raise BadRequest(f"a hand-off lands in its own worker's tensors, not {h.dst!r}")
    if h.route == "local":
        return client.synchronize_async()
    msg = wire.PeerRecv(token=h.token, dst=h.dst.ref, timeout_ms=h.timeout_ms)
    return client._call(Cmd.PEER_RECV, msg, timeout=h.timeout_ms / 1000 / TRANSFER_SHARE)


def run_linked(client: Client, graph: RegisteredGraph, refs: list[TensorRef],
               frames: list[np.ndarray], fetch: Sequence[RemoteTensor],
               receive: Sequence[HandOff], send: Sequence[HandOff],
               hold_reply: float = 0.0) -> Future[RunResult]:
    """One GRAPH_RUN_LINKED (or a GRAPH_RUN when every hand-off is local), then the copies or
    relays of the sends that do not go worker to worker; the future carries the run's result
    or the first error of any part. ``hold_reply``: see :meth:`Client.run`."""
    from .client import _fetched, _gather

    if not 0 <= hold_reply <= wire_graph.MAX_HOLD_REPLY_US / 1e6:
        raise BadRequest(f"hold_reply must lie in [0, {wire_graph.MAX_HOLD_REPLY_US / 1e6}] "
                         f"seconds, not {hold_reply}")
    if hold_reply and hold_reply >= client.timeout / 2:
        raise BadRequest(f"hold_reply {hold_reply} s would eat half of the client's "
                         f"{client.timeout} s timeout")

    for h in receive:
        if h.dst.client is not client:
            raise BadRequest(f"a run receives into its own worker's tensors, not {h.dst!r}")
    for h in send:
        if h.src.client is not client:
            raise BadRequest(f"a run sends its own worker's tensors, not {h.src!r}")
    receives = tuple(wire.Receive(h.token, h.dst.ref) for h in receive if h.route != "local")
    sends = tuple(wire.Send(h.token, h.src.ref, h.dst.client.info.peer_endpoint)
                  for h in send if h.route == "direct")
    fetch_refs = [t.ref for t in fetch]
    if receives or sends:
        if "linked-runs" not in client.info.capabilities:
            raise BadRequest(f"the worker at {client.endpoint} does not run linked graphs "
                             f"(protocol {client.info.major}.{client.info.minor})")
        timeout_ms = max([h.timeout_ms for h in receive] or [_transfer_ms(client.timeout)])
        hold_us = round(hold_reply * 1e6) if "held-replies" in client.info.capabilities else 0
        msg: Any = wire_graph.GraphRunLinked(handle=graph.handle, inputs=refs, fetch=fetch_refs,
                                             receive=receives, send=sends, timeout_ms=timeout_ms,
                                             hold_reply_us=hold_us)
        run = client._call(Cmd.GRAPH_RUN_LINKED, msg, frames, on_reply=_fetched(fetch))
    else:
        msg = wire_graph.GraphRun(handle=graph.handle, inputs=refs, fetch=fetch_refs)
        run = client._call(Cmd.GRAPH_RUN, msg, frames, on_reply=_fetched(fetch))
    after = [client.copy_tensor_async(h.src, h.dst) if h.route == "local"
             else _relay(h.src, h.dst, h.token) for h in send if h.route != "direct"]
    return run if not after else _gather([run, *after], run.result)
