"""The hashing thread (worker/files/hasher.py): completions on the caller's thread, one hash per
file version however many ask, refusals delivered as reasons, and a prompt stop."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

import pytest
from test_stalls import write_big_safetensors
from zmq_rpc.worker.files.hasher import FileHasher, HashOutcome
from zmq_rpc.worker.files.model_files import FileIdentity, ModelFiles, OpenFile
from zmq_rpc.worker.formats.hashing import digest

pytest.importorskip("blake3")
pytestmark = pytest.mark.timeout(60)


def _collect(hasher: FileHasher, outcomes: list[HashOutcome], n: int) -> None:
    deadline = time.monotonic() + 30
    while len(outcomes) < n:
        assert time.monotonic() < deadline, "no completion"
        select.select([hasher.wake_fd], [], [], 1.0)
        hasher.collect()


def test_one_hash_per_file_version_and_every_waiter_is_told(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_big_safetensors(path, 1 << 20)
    files = ModelFiles([str(tmp_path)])
    hasher = FileHasher()
    outcomes: list[HashOutcome] = []
    try:
        first, second = files.identify(path.name), files.identify(path.name)
        assert isinstance(first, OpenFile) and isinstance(second, OpenFile)
        hasher.submit(first, outcomes.append)
        hasher.submit(second, outcomes.append)        # same version: waits on the same hash
        _collect(hasher, outcomes, 2)
    finally:
        hasher.close()
    assert outcomes[0] is outcomes[1]
    assert isinstance(outcomes[0], FileIdentity)
    assert outcomes[0].digest == digest(path.read_bytes())


def test_a_bad_file_comes_back_as_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    found = ModelFiles([str(tmp_path)]).identify(path.name)
    assert isinstance(found, OpenFile)
    hasher = FileHasher()
    outcomes: list[HashOutcome] = []
    try:
        hasher.submit(found, outcomes.append)
        _collect(hasher, outcomes, 1)
    finally:
        hasher.close()
    assert outcomes == ["not a GGUF file (bad magic)"]


def test_close_stops_a_long_hash_and_closes_every_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    write_big_safetensors(path, 8 << 30)              # sparse: tens of seconds to hash here
    files = ModelFiles([str(tmp_path)])
    before = len(os.listdir("/proc/self/fd"))
    hasher = FileHasher()
    for _ in range(2):           # the first under way (or not yet started), the second waiting
        found = files.identify(path.name)
        assert isinstance(found, OpenFile)
        hasher.submit(found, lambda outcome: None)
    started = time.monotonic()
    hasher.close()
    assert time.monotonic() - started < 2.0
    assert len(os.listdir("/proc/self/fd")) == before
