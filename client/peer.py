"""Cross-worker copies: worker A pushes straight to worker B; the client relays only as a fallback.

``copy_between(src, dst)`` issues, without waiting, PEER_RECV on B (which holds B's queue for this
session until the bytes have landed, so later requests to B see them) and PEER_SEND on A (which
runs after A's earlier requests, so it reads what they wrote). The client never touches the bytes.

The first copy between two workers asks A to probe B's peer endpoint; the copy's half on A takes a
place reserved in A's send order (``Connection.reserve``) and is decided when the probe answers, so
nothing waits and later requests to A still run after it. When the probe fails, or a worker has no
peer endpoint, copies are relayed: PEER_RECV on B as above, a GET on A, and, when its reply
arrives, PEER_FILL requests that hand the bytes to B's waiting receive. Nothing in here blocks, so
copies may be issued from future callbacks too; the ordering guarantees are the same either way.
Any thread may call in; route state (``routes.py``) is under a lock. Requests go through each
side's public :class:`~.connection.Connection` (``tensor.client.session.connection``).

Completion: a copy is done when B says the bytes have landed (its PEER_RECV reply). B writes
every byte into ``dst`` before it answers, and the receive held B's queue, so every request this
client sends B later (a graph run reading ``dst``) sees them. A's reply is not waited for: a 1.4
worker (``unacked-sends``) asks B for no acknowledgement and answers once its chunks are with
the link; an older one answers when B's acknowledgement has come back through it, a hop later.

Faults, with the client's default settings: A refusing (a freed handle) or dying fails the copy
as soon as its reply or the loss of its connection says so (at once for a process that died on
this host, else within the heartbeat bound, about 6 s), and aborts B's receive, whether it has
started or still waits in B's queue (it then fails as it starts); the requests queued behind it
on B fail with :class:`TransferError` (they would have read a half copy), B's other sessions
never wait. B dying fails the copy within the same bound. Bytes that never land (a dropped
link; B's stash for chunks that come before their receive starts overflowing, which fails the
receive as it starts) fail it with :class:`TransferError` at the transfer deadline, 0.8x the
timeout (48 s of the default 60 s), before the request's own timeout. A's chunks still queued
for a dead B by then are dropped with the link, so its source buffer is writable again.

A partition between A and B (both alive, both reached by the client, the link between them
down) fails a direct copy, and a linked run waiting for a hand-off, with
:class:`~zmq_rpc.broker.errors.PeerUnreachable` ("worker A (endpoint) cannot reach worker B
(endpoint): peer link lost after X s") within 6 s of the link going down: the peer links'
heartbeat (a ping every 1 s, 3 s for an answer) + a grace (1 s on A, 0.5 s on B), on A's push link and on B's own
link to A, which B opens and watches because the request names A (``source`` /
``receive_from``, 1.9 workers: ``peer-link-watch``). It comes in a worker's reply, so that
worker is alive: "A cannot reach B", where "A is gone" is A's :class:`ConnectionLost`.

A pipeline does better with hand-offs (:func:`hand_off`) folded into its graph runs
(``client.run_async(graph, ..., receive=[h], send=[h])``, one GRAPH_RUN_LINKED each): the stage
that produces ``src`` pushes it straight after its run, the stage that consumes ``dst`` waits for
it before its run, and the step costs one request per stage instead of three (no PEER_SEND, no
PEER_RECV, no acknowledgement). Routes are the same: on one worker the hand-off is a copy queued
after the sending run; when the peers cannot reach each other it is relayed after that run.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from ..broker import graph as wire_graph
from ..broker import peer as wire
from ..broker.errors import BadRequest, ConnectionLost, InvalidHandle, SessionLost
from ..broker.protocol import Cmd, DType, TensorRef, split_tensor
from .arrays import RunResult, fetched, to_bfloat16
from .calls import EMPTY, no_result
from .futures import all_of, first_error, forward, new_future, resolved, settled_by
from .remote import Owner, RegisteredGraph, RemoteTensor
from .routes import PROBE_TIMEOUT_S

log = logging.getLogger("zmq_rpc.client.peer")

_ISSUE_LOCK = threading.Lock()
"""Held while the two halves of one copy are queued. Without it, copies issued from two threads
in opposite directions can interleave so that each worker holds its queue for a receive whose
send waits behind the other worker's receive: a deadlock until the transfer timeout. In one global
order, the earliest unfinished copy can always proceed."""


def _call(client: Owner, cmd: Cmd, msg: Any, payload: Sequence[Any] = (),
          timeout: float | None = None, on_reply: Any = no_result) -> Future[Any]:
    """A request to ``client``'s worker, through its session's connection."""
    return client.session.connection.call(cmd, msg, payload, on_reply, timeout)


def _check_pair(src: RemoteTensor, dst: RemoteTensor) -> None:
    if src.shape != dst.shape or src.ref.dtype is not dst.ref.dtype:
        raise BadRequest(f"copy needs equal shapes and dtypes: {src!r} -> {dst!r}")


TRANSFER_SHARE = 0.8
"""The workers' deadline for a transfer, as a share of the client's timeout: their verdict
comes first."""


def _transfer_ms(wait: float) -> int:
    return max(1, int(wait * TRANSFER_SHARE * 1000))


def _direct(a: Owner, b: Owner) -> bool | Future[bool]:
    """Whether worker ``a`` pushes straight to worker ``b`` (probed once per pair), or the
    future answer while the probe is out."""
    target = b.session.info.peer_endpoint
    if not (target and a.session.info.peer_endpoint and a.session.peer_copy):
        return False
    return a.session.routes.route(target)


def route(a: Owner, b: Owner) -> Future[bool]:
    """Whether worker ``a`` pushes straight to worker ``b``: starts the probe if none has run,
    never waits (for hand-offs planned after it has answered to go worker to worker)."""
    decision = _direct(a, b)
    return resolved(decision) if isinstance(decision, bool) else decision


def _on_route(a: Owner, decision: bool | Future[bool],
              issue: Callable[[bool], Future[Any]]) -> Future[Any]:
    """``issue(direct)`` on ``a`` now if the route is known; else in a place reserved in
    ``a``'s send order now and filled when the probe answers (so requests issued to ``a``
    later still run after it). Never waits."""
    if isinstance(decision, bool):
        return issue(decision)
    return _later(a, decision, lambda: issue(decision.result()))


def _later(a: Owner, ready: Future[Any], issue: Callable[[], Future[Any]]) -> Future[Any]:
    """``issue()`` once ``ready`` is done, its requests to ``a`` in a place reserved in ``a``'s
    send order now (requests issued to ``a`` meanwhile wait behind it). Never waits."""
    connection = a.session.connection
    slot = connection.reserve(PROBE_TIMEOUT_S + 10)
    out: Future[Any] = new_future()

    def go(_: Future[Any]) -> None:
        with connection.filling(slot):
            try:
                issued = issue()
            except BaseException as exc:  # noqa: BLE001 - the caller's future reports it
                out.set_exception(exc)
                return
        forward(issued, out)

    ready.add_done_callback(go)
    return out


def copy_between(src: RemoteTensor, dst: RemoteTensor, timeout: float | None = None) -> Future[Any]:
    """dst[...] = src across workers; see the module docstring for ordering, completion, faults
    and fallback."""
    _check_pair(src, dst)
    a, b = src.client, dst.client
    wait = min(a.session.timeout, b.session.timeout) if timeout is None else timeout
    transfer_ms = _transfer_ms(wait)
    target = b.session.info.peer_endpoint
    token = os.urandom(wire.TOKEN_BYTES)

    def send_half(direct: bool) -> Future[Any]:
        if not direct:
            return _relay(src, dst, token)
        acked = "unacked-sends" not in a.session.info.capabilities
        return _call(a, Cmd.PEER_SEND, wire.PeerSend(token=token, src=src.ref, endpoint=target,
                                                     timeout_ms=transfer_ms, acked=acked),
                     timeout=wait)

    with _ISSUE_LOCK:   # every worker queues the halves of all copies in one global order
        route = _direct(a, b)
        source = _source(a, b) if route is True else ""
        landed = _call(b, Cmd.PEER_RECV, wire.PeerRecv(token=token, dst=dst.ref,
                                                       timeout_ms=transfer_ms, source=source),
                       timeout=wait)
        sent = _on_route(a, route, send_half)
    sent.add_done_callback(lambda f: _abort_if_failed(f, landed, b, token))
    return settled_by(landed, [landed, sent])


def _run_kept(client: Owner, msg: wire_graph.GraphRunLinked, frames: list[np.ndarray],
              on_reply: Any) -> Future[RunResult]:
    """``msg`` as its worker's kept run when the session keeps it (:mod:`.kept`), else whole."""
    kept = client.session.kept
    cmd, short, shape = kept.shorten(msg)
    try:
        run: Future[RunResult] = _call(client, cmd, short, frames, on_reply=on_reply)
    except BaseException:
        if shape is not None:
            kept.abandoned(shape)
        raise
    if shape is not None:
        kept.issued(shape, short.keep, run)
    elif isinstance(short, wire_graph.GraphRunKept):
        run.add_done_callback(
            lambda f: kept.forget(short) if isinstance(f.exception(), InvalidHandle) else None)
    return run


def _source(a: Owner, b: Owner) -> str:
    """A's peer endpoint, for B to watch its own link to A while it waits for A's bytes (1.9,
    ``peer-link-watch``): a partition between the two then fails the receive with
    :class:`PeerUnreachable` within the heartbeat bound. "" for workers that do not watch.
    Only for a route known to be direct: a relayed transfer does not need the link (the
    first copy between two workers, decided by its probe, is not watched)."""
    return (a.session.info.peer_endpoint if "peer-link-watch" in b.session.info.capabilities
            else "")


def _abort_if_failed(sent: Future[Any], landed: Future[Any], b: Owner, token: bytes) -> None:
    """The sending half failed (its worker died, or refused): release the receiving worker's
    queue now rather than at its transfer deadline."""
    error = sent.exception()
    if error is not None and not landed.done() and not b.session.closed:
        _abort(b, token, str(error))


def _abort_receives_if_failed(run: Future[Any], sends: Sequence[HandOff]) -> None:
    """A linked run failed (a lost link, its worker gone): call off the receives of its
    worker-to-worker hand-offs now, which would otherwise hold their workers' queues (a model's
    frees, every later request) until the transfer deadline. In a partition the receiving
    worker's own link to this one often still has unacknowledged data in flight, which keeps
    its keepalive silent: only the deadline (48 s) would end the wait. A hand-off that did
    land first is untouched (the abort of a finished receive is ignored)."""
    error = run.exception()
    if error is None:
        return
    for h in sends:
        if not h.dst.client.session.closed:
            _abort(h.dst.client, h.token, f"the run that sends it failed: {error}")


def _abort(b: Owner, token: bytes, why: str) -> Future[Any]:
    sent = _call(b, Cmd.PEER_FILL, wire.PeerFill(token=token, seq=0, nchunks=1, start=0,
                                                 total=0, error=why[:512]), [b""])
    sent.add_done_callback(functools.partial(_hold_if_unsent, b, token, why))
    return sent


_unsent_call_offs: weakref.WeakKeyDictionary[Owner, list[tuple[bytes, str]]] = (
    weakref.WeakKeyDictionary())
"""Per receiving worker, the call-offs its dropped connection kept from it (token, why)."""
_unsent_lock = threading.Lock()


def _hold_if_unsent(b: Owner, token: bytes, why: str, sent: Future[Any]) -> None:
    """A call-off that met the receiver's connection down: a frozen worker that comes back
    would otherwise hold its queue behind that receive until the transfer deadline (48 s)."""
    error = sent.exception()
    if isinstance(error, ConnectionLost) and not isinstance(error, SessionLost):
        with _unsent_lock:
            _unsent_call_offs.setdefault(b, []).append((token, why))


def call_off_again(b: Owner) -> list[Future[Any]]:
    """Send ``b`` the call-offs of receives its dropped connection kept from it (those that
    fail again are kept again): for a worker whose connection came back, before anything that
    must not queue behind its stale receives (:mod:`.llama.recovery`)."""
    with _unsent_lock:
        held = _unsent_call_offs.pop(b, [])
    return [_abort(b, token, why) for token, why in held]


def _relay(src: RemoteTensor, dst: RemoteTensor, token: bytes) -> Future[Any]:
    """GET on A; when it arrives, PEER_FILL chunks into B's waiting receive (or abort it)."""
    log.info("relaying %d bytes %s -> %s through the client", src.nbytes, src.client.endpoint,
             dst.client.endpoint)
    fetched = src.client.get_tensor_async(src)
    b = dst.client

    def pass_on(f: Future[Any]) -> None:
        error = f.exception()
        if error is not None:
            _abort(b, token, str(error))
            return
        values = f.result()
        if dst.ref.dtype is DType.BFLOAT16:   # get_tensor widened it to float32: send raw bits
            values = to_bfloat16(values)
        flat = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        pieces = split_tensor(_flat_ref(dst), b.session.chunk_bytes)
        for seq, (start, sub) in enumerate(pieces):
            _call(b, Cmd.PEER_FILL, wire.PeerFill(token=token, seq=seq, nchunks=len(pieces),
                                                 start=start, total=dst.nbytes, error=""),
                    [flat[start:start + sub.nbytes]])

    fetched.add_done_callback(pass_on)
    return fetched


def _flat_ref(tensor: RemoteTensor) -> TensorRef:
    """A contiguous 1-D stand-in with the tensor's byte count (for cutting the relayed bytes)."""
    size = tensor.ref.dtype.itemsize
    return TensorRef(buffer=0, dtype=tensor.ref.dtype, shape=(tensor.ref.numel,), strides=(size,),
                     offset=0)


# ------------------------------------------------------------------------------ hand-offs

Route = Literal["local", "direct", "relay", "probing"]
"""How a hand-off travels: a copy on one worker, worker to worker, through the client, or (the
first between two workers) decided when the sending run is issued and the route's probe has
answered."""


@dataclass(frozen=True)
class HandOff:
    """``dst[...] = src`` between two graph runs: name it in ``send`` of the run on ``src``'s
    worker and in ``receive`` of the run on ``dst``'s worker, issuing the sending run first.
    Each hand-off object is used for one transfer (its token): make a new one per step."""

    src: RemoteTensor
    dst: RemoteTensor
    token: bytes
    planned: Route
    """The route when planned ("probing" for the first hand-off between two workers)."""
    timeout_ms: int
    probe: Future[bool] | None = None
    """While ``planned`` is "probing": the answer (True: worker to worker)."""

    @property
    def route(self) -> Route:
        """How it travels: "local", "direct" or "relay". While the route's probe is still out
        (``planned`` is "probing") this says "direct", what a probe between working peers
        answers; it says "relay" once a probe found the peer unreachable."""
        if self.planned != "probing" or self.probe is None:
            return self.planned
        if not self.probe.done():
            return "direct"
        return "direct" if self.probe.exception() is None and self.probe.result() else "relay"

    def decided(self) -> HandOff:
        """This hand-off with its probed route (call once ``probe`` is done)."""
        if self.planned != "probing":
            return self
        return replace(self, planned=self.route, probe=None)


def hand_off(src: RemoteTensor, dst: RemoteTensor) -> HandOff:
    """Plan a hand-off of ``src`` into ``dst`` (equal shapes and dtypes) and pick its route.

    Never waits: the first hand-off between two workers starts the probe of their route; its
    sending run is then issued in a place reserved in its worker's send order and decided when
    the probe answers (worker to worker, or relayed through the client)."""
    _check_pair(src, dst)
    a, b = src.client, dst.client
    timeout_ms = _transfer_ms(min(a.session.timeout, b.session.timeout))
    token = os.urandom(wire.TOKEN_BYTES)
    if a is b:
        return HandOff(src, dst, token, "local", timeout_ms)
    decision = _direct(a, b)
    if isinstance(decision, bool):
        return HandOff(src, dst, token, "direct" if decision else "relay", timeout_ms)
    return HandOff(src, dst, token, "probing", timeout_ms, decision)


def receive(client: Owner, h: HandOff) -> Future[None]:
    """Land a hand-off that no run receives, in ``client``'s queue (a PEER_RECV)."""
    if h.dst.client is not client:
        raise BadRequest(f"a hand-off lands in its own worker's tensors, not {h.dst!r}")
    if h.route == "local":
        return _call(client, Cmd.SYNCHRONIZE, EMPTY)
    msg = wire.PeerRecv(token=h.token, dst=h.dst.ref, timeout_ms=h.timeout_ms)
    return _call(client, Cmd.PEER_RECV, msg, timeout=h.timeout_ms / 1000 / TRANSFER_SHARE)


def run_linked(client: Owner, graph: RegisteredGraph, refs: list[TensorRef],
               frames: list[np.ndarray], fetch: Sequence[RemoteTensor],
               receive: Sequence[HandOff], send: Sequence[HandOff],
               hold_reply: float = 0.0, *, keepable: bool = True) -> Future[RunResult]:
    """One GRAPH_RUN_LINKED (or a GRAPH_RUN when every hand-off is local), then the copies or
    relays of the sends that do not go worker to worker; the future carries the run's result
    or the first error of any part. ``hold_reply``: see :meth:`Client.run`. ``keepable``
    False: the run goes in full, never as or for a kept run (:func:`_run_kept`)."""
    if not 0 <= hold_reply <= wire_graph.MAX_HOLD_REPLY_US / 1e6:
        raise BadRequest(f"hold_reply must lie in [0, {wire_graph.MAX_HOLD_REPLY_US / 1e6}] "
                         f"seconds, not {hold_reply}")
    session = client.session
    if hold_reply and hold_reply >= session.timeout / 2:
        raise BadRequest(f"hold_reply {hold_reply} s would eat half of the client's "
                         f"{session.timeout} s timeout")

    for h in receive:
        if h.dst.client is not client:
            raise BadRequest(f"a run receives into its own worker's tensors, not {h.dst!r}")
    for h in send:
        if h.src.client is not client:
            raise BadRequest(f"a run sends its own worker's tensors, not {h.src!r}")
    probes = [h.probe for h in send if h.probe is not None and not h.probe.done()]
    if probes:      # issued in its place in the send order once the routes are known
        return _later(client, all_of(probes, lambda: None), lambda: run_linked(
            client, graph, refs, frames, fetch, receive, [h.decided() for h in send],
            hold_reply, keepable=False))
    receives = tuple(wire.Receive(h.token, h.dst.ref) for h in receive if h.route != "local")
    sources = tuple(_source(h.src.client, client) if h.planned == "direct" else ""
                    for h in receive if h.route != "local")
    if not any(sources):
        sources = ()
    sends = tuple(wire.Send(h.token, h.src.ref, h.dst.client.session.info.peer_endpoint)
                  for h in send if h.route == "direct")
    fetch_refs = [t.ref for t in fetch]
    if receives or sends:
        info = session.info
        if "linked-runs" not in info.capabilities:
            raise BadRequest(f"the worker at {client.endpoint} does not run linked graphs "
                             f"(protocol {info.major}.{info.minor})")
        timeout_ms = max([h.timeout_ms for h in receive] or [_transfer_ms(session.timeout)])
        hold_us = round(hold_reply * 1e6) if "held-replies" in info.capabilities else 0
        msg: Any = wire_graph.GraphRunLinked(handle=graph.handle, inputs=refs, fetch=fetch_refs,
                                             receive=receives, send=sends, timeout_ms=timeout_ms,
                                             hold_reply_us=hold_us, receive_from=sources)
        run = (_run_kept(client, msg, frames, fetched(fetch_refs)) if keepable
               else _call(client, Cmd.GRAPH_RUN_LINKED, msg, frames, on_reply=fetched(fetch_refs)))
        direct = [h for h in send if h.route == "direct"]
        if direct:
            run.add_done_callback(lambda f: _abort_receives_if_failed(f, direct))
    else:
        msg = wire_graph.GraphRun(handle=graph.handle, inputs=refs, fetch=fetch_refs)
        run = _call(client, Cmd.GRAPH_RUN, msg, frames, on_reply=fetched(fetch_refs))
    after = [client.copy_tensor_async(h.src, h.dst) if h.route == "local"
             else _relay(h.src, h.dst, h.token) for h in send if h.route != "direct"]
    return run if not after else first_error([run, *after], run.result)
