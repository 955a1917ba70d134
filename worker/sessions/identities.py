"""Who a session belongs to, and what one identity may hold: quotas per client, not per session.

Owned by the backend thread (one :class:`Identities` per executor, asked by the
:class:`~zmq_rpc.worker.sessions.table.SessionTable` at HELLO and close and by
:class:`~zmq_rpc.worker.sessions.memory.SessionMemory` at every charge). Per-session quotas
(:mod:`~zmq_rpc.worker.sessions.quotas`) still apply; this layer adds a cap over all the sessions of one
identity, so that opening more sessions does not buy more of the worker:

- **under CURVE** the identity is the client's authorized public key, proven in HELLO
  (:mod:`zmq_rpc.broker.identity`, protocol 1.8). A HELLO whose proof does not verify, or whose
  key is not in ``--authorized-keys``, is refused. Clients older than 1.8 prove nothing: they
  share one identity, ``unproven``, so leaving the proof out buys nothing either;
- **without CURVE** the backend cannot tell who sent a message (no key, and the peer address is
  metadata that does not survive the broker's proxy, see docs/SECURITY.md): each session is its
  own identity, as before.

An identity may hold at most ``memory`` bytes (``--identity-mem``, default 3/4 of ``--mem``) and
``sessions`` sessions (``--identity-sessions``, default 3/4 of ``--max-sessions``): whatever one
identity does, a quarter of each is left to the others. A session is bound to the identity that
opened it: a later HELLO under its routing id from another identity is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zmq.utils import z85

from ...broker import identity as proof
from ...broker import protocol as p
from ...broker.protocol import ErrorCode, WireError

if TYPE_CHECKING:
    from .session import Session

UNPROVEN = "unproven"
"""The identity every CURVE session without a key proof (a client older than 1.8) shares."""


def default_share(total: int) -> int:
    """What one identity may take of ``total`` unless told otherwise: 3/4, at least 1."""
    return max(total * 3 // 4, 1)


@dataclass(frozen=True)
class IdentityQuotas:
    """What one identity may hold over all its sessions."""

    memory: int
    sessions: int


@dataclass(frozen=True)
class KeyCheck:
    """Under CURVE: the worker's secret key, and which client keys are authorized now."""

    worker_secret: bytes
    authorized: Callable[[], frozenset[bytes]]
    """Z85 public keys (``--authorized-keys``, reread as the ZAP handler does)."""


@dataclass
class Identity:
    """One client identity's open sessions."""

    name: str
    sessions: dict[bytes, Session] = field(default_factory=dict)
    """By routing id."""

    def memory(self) -> int:
        return sum(s.usage.memory for s in self.sessions.values())


class Identities:
    """The open sessions of each identity, and the identity quotas."""

    def __init__(self, quotas: IdentityQuotas, keys: KeyCheck | None) -> None:
        self.quotas = quotas
        self.keys = keys
        self.by_name: dict[str, Identity] = {}

    def of_hello(self, session: Session, msg: p.Hello) -> str:
        """The identity a HELLO speaks for, or BAD_REQUEST when its key proof is false."""
        if self.keys is None:
            return f"session {session.client_id.hex()}"
        if not msg.key and not msg.proof:
            return UNPROVEN
        if not proof.verify(self.keys.worker_secret, msg.key, msg.proof, session.client_id):
            raise WireError(ErrorCode.BAD_REQUEST, "HELLO refused: its key proof does not "
                            "verify (made with another key, or for another routing id)")
        name = z85.encode(msg.key).decode()
        if name.encode() not in self.keys.authorized():
            raise WireError(ErrorCode.BAD_REQUEST, f"HELLO refused: key proof for {name}, "
                            "a key not authorized on this worker")
        return f"key {name}"

    def check_bound(self, session: Session, name: str) -> None:
        """A HELLO on an open session must come from the identity that opened it."""
        if session.identity != name:
            raise WireError(ErrorCode.BAD_REQUEST, "HELLO refused: this routing id's session "
                            "belongs to another client identity")

    def room(self, name: str) -> int:
        """Sessions ``name`` holds now."""
        owner = self.by_name.get(name)
        return len(owner.sessions) if owner else 0

    def admit(self, session: Session, name: str) -> None:
        """Count ``session`` as ``name``'s, or OUT_OF_MEMORY when that identity is full."""
        held = self.room(name)
        if held >= self.quotas.sessions:
            raise WireError(ErrorCode.OUT_OF_MEMORY, f"HELLO refused: this client identity "
                            f"already holds {held} sessions, the most one identity may hold "
                            f"(--identity-sessions {self.quotas.sessions})")
        session.identity = name
        self.by_name.setdefault(name, Identity(name)).sessions[session.client_id] = session

    def leave(self, session: Session) -> None:
        owner = self.by_name.get(session.identity)
        if owner is None:
            return
        owner.sessions.pop(session.client_id, None)
        if not owner.sessions:
            del self.by_name[session.identity]

    def check_memory(self, session: Session, size: int, what: str) -> None:
        """OUT_OF_MEMORY unless ``size`` more bytes fit the session's identity's share."""
        owner = self.by_name.get(session.identity)
        if owner is None:
            return
        held = owner.memory()
        if size > self.quotas.memory - held:
            raise WireError(ErrorCode.OUT_OF_MEMORY, f"identity quota: memory ({what}) would "
                            f"reach {held + size:,} over this client identity's sessions, "
                            f"over this worker's per-identity limit of "
                            f"{self.quotas.memory:,} (--identity-mem)")

