"""Tests for worker/backends/staging.py: the pinned-slot pipeline, on the CPU.

A :class:`LateEngine` stands in for the GPU: "device" arrays are numpy arrays, and each queued
copy lands only when its marker is waited for (or when the engine is told to run everything),
the worst timing a real stream allows. The pipeline must still move every byte exactly, never
reuse a slot whose copy is in flight, and keep its pinned memory bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from zmq_rpc.worker.backends.staging import PinnedStaging

pytestmark = pytest.mark.timeout(30)
RNG = np.random.default_rng(7)


class Marker:
    def __init__(self, copy: Callable[[], None]) -> None:
        self.copy: Callable[[], None] | None = copy

    def land(self) -> None:
        if self.copy is not None:
            self.copy()
            self.copy = None


class LateEngine:
    """Copies happen when their marker is waited for; sources are snapshotted never (a slot
    overwritten before its copy landed would show up as wrong bytes)."""

    def __init__(self) -> None:
        self.pinned_bytes = 0
        self.markers: list[Marker] = []

    def pinned(self, size: int) -> np.ndarray:
        self.pinned_bytes += size
        return np.full(size, 0xAA, np.uint8)

    def to_device_async(self, dst: np.ndarray, src: np.ndarray) -> Marker:
        assert dst.nbytes == src.nbytes
        marker = Marker(lambda: dst.__setitem__(Ellipsis, src))
        self.markers.append(marker)
        return marker

    def to_host_async(self, dst: np.ndarray, src: np.ndarray) -> Marker:
        assert dst.nbytes == src.nbytes
        marker = Marker(lambda: dst.__setitem__(Ellipsis, src))
        self.markers.append(marker)
        return marker

    def wait(self, marker: Any) -> None:
        marker.land()

    def finish(self) -> None:
        for marker in self.markers:
            marker.land()


@pytest.mark.parametrize("size", [0, 1, 1000, 4096, 4097, 5 * 4096 + 3])
def test_uploads_are_exact_in_slot_sized_pieces(size: int) -> None:
    engine = LateEngine()
    staging = PinnedStaging(engine, slot_bytes=4096, slots=2)
    device = np.zeros(size, np.uint8)
    data = RNG.integers(0, 256, size, dtype=np.uint8)
    staging.upload(device, data.tobytes())
    engine.finish()
    np.testing.assert_array_equal(device, data)
    assert staging.uploads == -(-size // 4096)
    assert engine.pinned_bytes <= 2 * 4096


def test_many_uploads_reuse_slots_only_after_their_copy_landed() -> None:
    engine = LateEngine()
    staging = PinnedStaging(engine, slot_bytes=256, slots=3)
    device = np.zeros(64 * 256, np.uint8)
    expected = np.zeros_like(device)
    for i in range(64):
        chunk = RNG.integers(0, 256, 256, dtype=np.uint8)
        staging.upload(device[i * 256:(i + 1) * 256], memoryview(chunk))
        expected[i * 256:(i + 1) * 256] = chunk
        chunk[:] = 0                      # the caller's frame may go as soon as upload returns
    engine.finish()
    np.testing.assert_array_equal(device, expected)
    assert engine.pinned_bytes == 3 * 256


def test_prefetched_downloads_come_back_in_order_and_exact() -> None:
    engine = LateEngine()
    staging = PinnedStaging(engine, slot_bytes=1024, slots=2)
    device = RNG.integers(0, 256, 10 * 1024, dtype=np.uint8)
    pieces = [device[i * 1024:(i + 1) * 1024] for i in range(10)]
    keys = [object() for _ in pieces]
    staging.prefetch(list(zip(keys, pieces, strict=True)))
    assert staging.downloads == 2                  # two slots: two copies in flight
    for key, piece in zip(keys, pieces, strict=True):
        data = staging.take(key)
        assert data is not None
        np.testing.assert_array_equal(data, piece)
    assert staging.downloads == 10
    assert engine.pinned_bytes == 2 * 1024


def test_take_of_an_unknown_key_and_oversized_pieces_fall_back() -> None:
    engine = LateEngine()
    staging = PinnedStaging(engine, slot_bytes=16, slots=2)
    big, small = np.arange(32, dtype=np.uint8), np.arange(8, dtype=np.uint8)
    key_big, key_small = object(), object()
    staging.prefetch([(key_big, big), (key_small, small)])
    assert staging.take(key_big) is None           # bigger than a slot: the caller reads it
    assert staging.take(object()) is None
    np.testing.assert_array_equal(staging.take(key_small), small)


def test_a_new_prefetch_drops_the_untaken_rest() -> None:
    engine = LateEngine()
    staging = PinnedStaging(engine, slot_bytes=16, slots=2)
    first = [(object(), np.full(16, i, np.uint8)) for i in range(5)]
    staging.prefetch(first)
    staging.take(first[0][0])                      # a push that failed after one piece
    second = [(object(), np.full(16, 100 + i, np.uint8)) for i in range(3)]
    staging.prefetch(second)
    assert staging.take(first[1][0]) is None
    for i, (key, _) in enumerate(second):
        np.testing.assert_array_equal(staging.take(key), np.full(16, 100 + i, np.uint8))
    assert engine.pinned_bytes == 2 * 16
