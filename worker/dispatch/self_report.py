"""What a worker says about itself: HELLO's reply, STATUS, the metrics' snapshot, its capabilities.

Owned by the backend thread, like the sessions, buffers and memory budget it reads (it never
changes any of them): :class:`~zmq_rpc.worker.dispatch.executor.Executor` asks it for the HELLO and STATUS
replies and the server loop for the gauges it publishes.
"""

from __future__ import annotations

import time

from ...broker import graph as g
from ...broker import protocol as p
from .. import kernels
from ..backends.base import Backend
from ..observe.metrics import WorkerSnapshot
from ..peer.links import PeerLinks
from ..process.version import package_version
from ..sessions.memory import MemoryBudget
from ..sessions.session import Session, WorkerLimits
from .outbox import Outbox


def capabilities(backend: Backend, peers: PeerLinks) -> list[str]:
    """What a worker on ``backend`` offers (files and cache are added when served)."""
    offered = ["views", "chunked-transfer", "status", "timing", "key-proof", "request-mac",
               "draining"]
    if backend.zero_copy:
        offered.append("zero-copy")
    if backend.supports_graphs:
        offered += [f"graph-v{g.GRAPH_VERSION}", "linked-runs", "held-replies", "scale-bias",
                    "fused-ops", "rope-factors", "row-attention", "causal-mask", "kept-runs"]
        if backend.packed_kernels and kernels.available():
            offered.append("packed-kernels")
    if peers.endpoint:
        offered += ["peer-copy", "unacked-sends", "peer-link-watch"]
    return offered


class SelfReport:
    """Reads the worker's state (never changes it) to describe the worker."""

    def __init__(self, backend: Backend, limits: WorkerLimits, budget: MemoryBudget,
                 peers: PeerLinks, sessions: dict[bytes, Session], outbox: Outbox,
                 server_name: str) -> None:
        self.backend, self.limits, self.budget = backend, limits, budget
        self.peers, self.sessions, self.outbox = peers, sessions, outbox
        self.server_name = server_name
        self.started = time.monotonic()
        self.version = package_version()
        self.capabilities = capabilities(backend, peers)

    def hello_reply(self) -> p.HelloReply:
        """What this worker tells new sessions."""
        return p.HelloReply(
            major=p.PROTOCOL_VERSION[0], minor=p.PROTOCOL_VERSION[1], server=self.server_name,
            devices=(self._device(),), alignment=self.backend.alignment,
            max_buffer_size=self.limits.max_buffer_size,
            max_message_size=self.limits.max_message_size,
            session_timeout_ms=int(self.limits.session_timeout * 1000),
            capabilities=tuple(self.capabilities), peer_endpoint=self.peers.endpoint,
            device_details=self.device_details())

    def device_details(self) -> tuple[p.DeviceDetail, ...]:
        """HELLO's and STATUS's ``device_details`` (1.6): index, physical memory, capability."""
        backend = self.backend
        return (p.DeviceDetail(index=backend.index, memory=backend.total_memory(),
                               compute_capability=backend.compute_capability()),)

    def _device(self) -> p.Device:
        free, total = self.budget.report()
        return p.Device(name=self.backend.device_name(), kind=self.backend.kind,
                        total_memory=total, free_memory=free)

    def snapshot(self) -> WorkerSnapshot:
        """The worker's gauges now (for the metrics and STATUS)."""
        free, total = self.budget.report()
        sessions = list(self.sessions.values())
        return WorkerSnapshot(
            taken=time.monotonic(), sessions=len(sessions),
            queue_depth=sum(len(s.queue) for s in sessions), memory_used=total - free,
            memory_limit=total, device=self.backend.device_name(), device_kind=self.backend.kind,
            graphs=sum(len(s.graphs) for s in sessions),
            buffers=sum(len(s.buffers) for s in sessions),
            transfers_in_progress=len(self.peers.incoming),
            held_replies=1 if self.outbox.held else 0)

    def status(self, asker: Session) -> p.StatusReply:
        """STATUS: the worker, and the other sessions (the asker's own is left out)."""
        others = [s for s in self.sessions.values() if s is not asker]
        snap = self.snapshot()
        now = time.monotonic()
        recent = sorted(others, key=lambda s: s.last_seen, reverse=True)[:p.MAX_STATUS_SESSIONS]
        return p.StatusReply(
            server=self.server_name, version=self.version,
            uptime_ms=int((now - self.started) * 1000), devices=(self._device(),),
            memory_used=snap.memory_used, memory_limit=snap.memory_limit, sessions=len(others),
            queue_depth=sum(len(s.queue) for s in others),
            buffers=sum(len(s.buffers) for s in others),
            graphs=sum(len(s.graphs) for s in others),
            transfers_in_progress=snap.transfers_in_progress,
            capabilities=tuple(self.capabilities), peer_endpoint=self.peers.endpoint,
            session_list=tuple(session_info(s, now) for s in recent),
            device_details=self.device_details() if asker.minor >= 6 else ())


def session_info(session: Session, now: float) -> p.SessionInfo:
    """One row of STATUS's session list."""
    memory = sum(b.size for b in session.buffers.values())
    memory += sum(graph.memory_charge for graph in session.graphs.values())
    return p.SessionInfo(sid=session.sid, client=session.name, client_id=session.client_id.hex()[:8],
                         memory=memory, buffers=len(session.buffers), graphs=len(session.graphs),
                         queued=len(session.queue),
                         idle_ms=int(max(now - session.last_seen, 0) * 1000))
