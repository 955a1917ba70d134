"""The worker's content-addressed tensor cache (worker/files/tensor_cache.py): unit tests, no sockets."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("blake3")

from zmq_rpc.worker.files.tensor_cache import TensorCache  # noqa: E402
from zmq_rpc.worker.formats.hashing import digest  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def blob(seed: int, size: int = 4096) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_stored_entries_come_back_and_survive_a_restart(tmp_path: Path) -> None:
    cache = TensorCache(str(tmp_path), 1 << 20)
    data = blob(1)
    key = digest(data)
    assert cache.get(key, data.nbytes).note == "not cached"
    assert cache.put(key, data) == "stored"
    assert cache.put(key, data) == "already cached"
    got = cache.get(key, data.nbytes)
    assert got.note == "hit" and got.data is not None and np.array_equal(got.data, data)
    assert cache.get(key, data.nbytes + 1).data is None          # sizes must agree
    again = TensorCache(str(tmp_path), 1 << 20)                   # a restarted worker
    assert again.bytes == data.nbytes
    assert again.get(key, data.nbytes).note == "hit"


def test_a_payload_that_does_not_hash_to_its_key_is_never_stored(tmp_path: Path) -> None:
    cache = TensorCache(str(tmp_path), 1 << 20)
    honest, poison = blob(1), blob(2)
    key = digest(honest)
    assert cache.put(key, poison).startswith("not stored")
    assert cache.get(key, honest.nbytes).data is None
    assert cache.put(b"\0" * 31, poison).startswith("not stored")  # not even a key


@pytest.mark.parametrize("damage", ["flip", "truncate", "replace"])
def test_a_corrupted_entry_is_detected_reported_deleted_and_not_used(tmp_path: Path,
                                                                     damage: str) -> None:
    cache = TensorCache(str(tmp_path), 1 << 20)
    data = blob(3)
    key = digest(data)
    cache.put(key, data)
    path = cache.path(key)
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    if damage == "flip":
        raw[100] ^= 1
    elif damage == "truncate":
        raw = raw[:-1]
    else:
        raw = bytearray(blob(4).tobytes())                        # poisoned on disk
    with open(path, "wb") as fh:
        fh.write(raw)
    got = cache.get(key, data.nbytes)
    assert got.data is None and "corrupted" in got.note
    assert not os.path.exists(path) and cache.bytes == 0
    assert cache.stats["corrupt"] == 1
    assert cache.put(key, data) == "stored"                       # the next upload refills it


def test_least_recently_used_entries_go_first(tmp_path: Path) -> None:
    cache = TensorCache(str(tmp_path), 3 * 4096)
    keys = [digest(blob(i)) for i in range(4)]
    for i in range(3):
        cache.put(keys[i], blob(i))
    assert cache.get(keys[0], 4096).note == "hit"                 # 0 is now the most recent
    cache.put(keys[3], blob(3))                                   # evicts 1, the oldest use
    assert cache.get(keys[1], 4096).data is None
    assert all(cache.get(keys[i], 4096).note == "hit" for i in (0, 2, 3))
    assert cache.bytes <= cache.limit and cache.stats["evicted"] == 1
    assert cache.put(digest(blob(9, 5 * 4096)), blob(9, 5 * 4096)).startswith("not stored")


def test_stray_files_in_the_cache_dir_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("hello")
    (tmp_path / "ab" / ("zz" * 32 + ".bin")).write_bytes(b"x")
    cache = TensorCache(str(tmp_path), 1 << 20)
    assert cache.entries == {} and cache.bytes == 0
