"""Which peer endpoints one worker can push to: probed once each, the answer kept.

Threads: any thread asks (:meth:`Routes.route`); the state is under a lock, and a probe's
answer is recorded by a future callback (on the connection's driving thread). Nothing waits: a
route still being probed is a future of the answer, which the probe's request timeout bounds.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

from ..broker import peer as wire
from ..broker.protocol import Cmd
from .connection import Connection
from .futures import new_future

log = logging.getLogger("zmq_rpc.client.peer")

PROBE_TIMEOUT_S = 3.0


class Routes:
    """Which destination peer endpoints one source worker can reach (probed once each)."""

    def __init__(self, source: Connection) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._reachable: dict[str, bool] = {}
        self._probing: dict[str, Future[bool]] = {}

    def route(self, endpoint: str) -> bool | Future[bool]:
        """Whether the source worker reaches ``endpoint``, or the future answer of the probe
        (started by the first caller)."""
        with self._lock:
            known = self._reachable.get(endpoint)
            if known is not None:
                return known
            decided = self._probing.get(endpoint)
            if decided is not None:
                return decided
            decided = self._probing[endpoint] = new_future()
        msg = wire.PeerProbe(endpoint=endpoint, timeout_ms=int(PROBE_TIMEOUT_S * 1000))
        probe = self._source.call(Cmd.PEER_PROBE, msg, timeout=PROBE_TIMEOUT_S + 5)
        # Outside the lock: a probe that has already finished runs the callback right here.
        probe.add_done_callback(lambda f: self._record(endpoint, f, decided))
        return decided

    def _record(self, endpoint: str, probe: Future[Any], decided: Future[bool]) -> None:
        error = probe.exception()
        if error is not None:
            log.warning("%s cannot reach peer %s (%s): copies to it are relayed through this "
                        "client", self._source.endpoint, endpoint, error)
        with self._lock:
            self._reachable[endpoint] = error is None
            self._probing.pop(endpoint, None)
        decided.set_result(error is None)
