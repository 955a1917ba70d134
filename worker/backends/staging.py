"""Host <-> device copies staged through reusable pinned host buffers, overlapped in chunks.

Owned by the backend thread of a GPU worker (:class:`~.cupy_backend.CupyBackend` holds one
:class:`PinnedStaging`). A DMA engine copies only page-locked host memory asynchronously, so the
bytes of a received frame are copied (one host memcpy) into a free pinned slot and the upload is
queued on a copy stream: the call returns at once and the DMA runs while the backend thread goes
back to its sockets for the next chunk. Downloads for a peer push are queued ahead
(:meth:`PinnedStaging.prefetch`: up to ``slots`` pieces in flight), so the device-to-host copy of
piece ``i + 1`` runs while piece ``i`` is handed to zmq. A slot is reused only once its copy is
done (the engine's completion marker), so bytes are exact whatever the timing.

The device side is a :class:`CopyEngine`; the pipeline here is plain Python over numpy, tested on
the CPU with an engine that completes copies late (``tests/test_staging.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

SLOT_BYTES = 4 << 20
"""One pinned slot: a peer chunk (``peer_send.CHUNK_BYTES``)."""
SLOTS = 4
"""Slots per direction: 16 MiB of page-locked memory each way."""


class CopyEngine(Protocol):
    """What staging needs from a device: pinned memory, ordered async copies, their markers."""

    def pinned(self, size: int) -> np.ndarray:
        """``size`` bytes of page-locked host memory (uint8)."""
        ...

    def to_device_async(self, dst: Any, src: np.ndarray) -> Any:
        """Queue ``dst[...] = src`` (contiguous uint8 device view, pinned uint8 host array,
        equal sizes), ordered before later work on the device; return a completion marker."""
        ...

    def to_host_async(self, dst: np.ndarray, src: Any) -> Any:
        """Queue ``dst[...] = src`` after the device work queued so far; a completion marker."""
        ...

    def wait(self, marker: Any) -> None:
        """Block until the copy behind ``marker`` is done."""
        ...


@dataclass
class _Slot:
    host: np.ndarray
    marker: Any = None
    """The copy in flight from (upload) or into (download) this slot, None when idle."""
    size: int = 0


class PinnedStaging:
    """Reusable pinned slots, one ring for uploads and one for downloads."""

    def __init__(self, engine: CopyEngine, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> None:
        self.engine = engine
        self.slot_bytes = slot_bytes
        self._slots = slots
        self._up: deque[_Slot] = deque()
        self._down_free: list[_Slot] = []
        self._pending: deque[tuple[Any, Any]] = deque()
        """(key, device view) queued by :meth:`prefetch`, not yet given a slot."""
        self._ready: dict[int, tuple[Any, _Slot]] = {}
        """Downloads queued, by id of their key (the key is kept, so ids stay unique)."""
        self.uploads = 0
        self.downloads = 0

    # ------------------------------------------------------------------------- uploads

    def upload(self, dst: Any, payload: Any) -> None:
        """Queue ``dst[...] = payload`` (contiguous uint8 device view, a buffer of its size) in
        slot-sized chunks; returns once the bytes are in pinned memory (``payload`` may go)."""
        data = np.frombuffer(payload, np.uint8)
        for start in range(0, data.size, self.slot_bytes):
            piece = data[start:start + self.slot_bytes]
            slot = self._upload_slot()
            slot.host[:piece.size] = piece
            slot.marker = self.engine.to_device_async(dst[start:start + piece.size],
                                                      slot.host[:piece.size])
            self._up.append(slot)
            self.uploads += 1

    def _upload_slot(self) -> _Slot:
        """An idle slot: a new one while fewer than ``slots`` exist, else the oldest, once its
        copy is done."""
        if len(self._up) < self._slots:
            return _Slot(self.engine.pinned(self.slot_bytes))
        slot = self._up.popleft()
        self.engine.wait(slot.marker)
        slot.marker = None
        return slot

    # ----------------------------------------------------------------------- downloads

    def prefetch(self, items: Sequence[tuple[Any, Any]]) -> None:
        """Queue downloads: ``(key, view)`` pairs, ``view`` a contiguous uint8 device view (of
        at most a slot; bigger ones are left to the caller), read back in this order with
        :meth:`take` ``(key)``. Downloads queued by an earlier call and never taken are dropped
        first."""
        self._drop_ready()
        self._pending.extend(item for item in items if item[1].nbytes <= self.slot_bytes)
        self._issue()

    def take(self, key: Any) -> np.ndarray | None:
        """The bytes prefetched for ``key`` (a new host array), or None if there are none."""
        entry = self._ready.pop(id(key), None)
        if entry is None:
            return None
        _, slot = entry
        self.engine.wait(slot.marker)
        data: np.ndarray = slot.host[:slot.size].copy()
        self._release(slot)
        self._issue()
        return data

    def _issue(self) -> None:
        while self._pending and (self._down_free or self._down_count() < self._slots):
            key, view = self._pending.popleft()
            slot = self._down_free.pop() if self._down_free else _Slot(
                self.engine.pinned(self.slot_bytes))
            slot.size = view.nbytes
            slot.marker = self.engine.to_host_async(slot.host[:view.nbytes], view)
            self._ready[id(key)] = (key, slot)
            self.downloads += 1

    def _down_count(self) -> int:
        return len(self._ready) + len(self._down_free)

    def _release(self, slot: _Slot) -> None:
        slot.marker = None
        self._down_free.append(slot)

    def _drop_ready(self) -> None:
        self._pending.clear()
        for _, slot in self._ready.values():
            self.engine.wait(slot.marker)
            self._release(slot)
        self._ready.clear()
