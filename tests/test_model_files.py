"""Model files on the worker's disk (worker/files/model_files.py): confinement, identity, metadata.

Unit tests, no sockets: paths out of the model directories refused, files identified by hash,
GGUF and safetensors headers parsed (checked against the gguf package on the packaged model).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from zmq_rpc.worker.files.model_files import (
    HASH_TRIES,
    FileIdentity,
    FileMismatch,
    FileRefused,
    ModelFiles,
    OpenFile,
    check_digest,
    identify_open,
    parse_gguf,
    parse_safetensors,
    read_into,
)
from zmq_rpc.worker.formats import hashing
from zmq_rpc.worker.formats.hashing import digest

pytest.importorskip("blake3")


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, at = {}, [], 0
    names = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int8"): "I8"}
    for name, arr in tensors.items():
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [at, at + arr.nbytes]}
        blobs.append(arr.tobytes())
        at += arr.nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.fixture
def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    (root / "sub").mkdir(parents=True)
    write_safetensors(root / "a.safetensors", {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                                               "b": np.ones(5, np.int8)})
    (tmp_path / "outside.safetensors").write_bytes(b"secret")
    return root


def test_paths_are_confined_to_the_model_dirs(models: Path, tmp_path: Path) -> None:
    files = ModelFiles([str(models)])
    assert files.resolve("a.safetensors") == str(models / "a.safetensors")
    os.symlink(tmp_path / "outside.safetensors", models / "out.safetensors")
    os.symlink(models / "a.safetensors", models / "sub" / "in.safetensors")
    os.mkfifo(models / "pipe.safetensors")
    refused = {"../outside.safetensors": "'..' are refused",
               str(tmp_path / "outside.safetensors"): "absolute paths",
               "sub/../../outside.safetensors": "'..' are refused",
               "out.safetensors": "leads out of the model directory",
               "pipe.safetensors": "not a regular file",
               "sub": "not a regular file",
               "missing.gguf": "not in this worker's model directories",
               "": "non-empty relative path", "a\0b": "non-empty relative path"}
    for name, why in refused.items():
        with pytest.raises(FileRefused, match=why):
            files.resolve(name)
    assert files.resolve("sub/in.safetensors") == str(models / "a.safetensors")  # stays inside
    with pytest.raises(FileRefused, match="start it with --model-dir"):
        ModelFiles([]).resolve("a.safetensors")


def _hashed(files: ModelFiles, name: str) -> FileIdentity:
    """``identify``, doing the hashing thread's part inline when the cache misses."""
    found = files.identify(name)
    if isinstance(found, FileIdentity):
        return found
    try:
        ident = identify_open(found)
    finally:
        os.close(found.fd)
    files.remember(ident)
    return ident


def test_identity_is_the_files_hash_and_a_different_file_is_detected(models: Path) -> None:
    files = ModelFiles([str(models)])
    path = models / "a.safetensors"
    assert isinstance(files.identify("a.safetensors"), OpenFile)     # not hashed yet
    ident = _hashed(files, "a.safetensors")
    assert ident.digest == digest(path.read_bytes())
    assert files.identify("a.safetensors") is ident    # cached per path, inode, size, mtime
    assert check_digest(ident, ident.digest) is ident
    write_safetensors(path, {"w": np.zeros((3, 4), np.float32)})      # same name, new bytes
    assert isinstance(files.identify("a.safetensors"), OpenFile)     # hashed again
    with pytest.raises(FileMismatch, match="a different file"):
        check_digest(_hashed(files, "a.safetensors"), ident.digest)


def test_a_file_that_changes_while_hashed_is_hashed_again_or_refused(
        models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest taken while the file was written matches no version of it: hash again, and
    refuse a file that keeps changing rather than name a digest nobody has."""
    files = ModelFiles([str(models)])
    path = models / "a.safetensors"
    real_digest = hashing.file_digest
    writes = {"left": 1}

    def digest_while_written(fd: int, size: int, stop: object = None) -> bytes:
        result = real_digest(fd, size)
        if writes["left"]:
            writes["left"] -= 1
            with open(path, "r+b") as fh:            # same size, new bytes, during the hash
                fh.seek(size - 1)
                fh.write(b"\x7f")
            os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
        return result

    monkeypatch.setattr(hashing, "file_digest", digest_while_written)
    ident = _hashed(files, "a.safetensors")
    assert ident.digest == digest(path.read_bytes())          # the version that stayed
    assert ident.mtime_ns == path.stat().st_mtime_ns
    writes["left"] = HASH_TRIES
    path.write_bytes(path.read_bytes())
    with pytest.raises(FileRefused, match="kept changing while it was hashed"):
        _hashed(files, "a.safetensors")


def test_safetensors_table_has_absolute_offsets_and_sizes(models: Path) -> None:
    path = models / "a.safetensors"
    with open(path, "rb") as fh:
        table = parse_safetensors(fh, path.stat().st_size)
    w = table["w"]
    assert (w.kind, w.shape, w.nbytes) == ("F32", (3, 4), 48)
    raw = path.read_bytes()
    assert np.array_equal(np.frombuffer(raw[w.offset:w.offset + 48], np.float32),
                          np.arange(12, dtype=np.float32))
    out = np.empty(5, np.int8)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_into(fd, table["b"].offset, memoryview(out).cast("B"))
    finally:
        os.close(fd)
    assert out.tolist() == [1] * 5


@pytest.mark.parametrize("raw, why", [
    (b"GGUF" + struct.pack("<I", 7), "version 7"),
    (b"GGUX", "bad magic"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0), "over the limit"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1 << 40), "a header string"),
    (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", 1) + b"t" + struct.pack("<I", 1)
     + struct.pack("<Q", 64) + struct.pack("<IQ", 0, 1 << 50), "past the end"),
])
def test_broken_gguf_headers_are_refused(tmp_path: Path, raw: bytes, why: str) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(raw + bytes(64))
    with open(path, "rb") as fh, pytest.raises(FileRefused, match=why):
        parse_gguf(fh, path.stat().st_size)


def test_broken_safetensors_headers_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    for header in (b"[1]", b"{not json", json.dumps({"w": {"dtype": "F32", "shape": [2],
                                                           "data_offsets": [0, 7]}}).encode(),
                   json.dumps({"w": {"dtype": "F32", "shape": [2],
                                     "data_offsets": [0, 8]}}).encode()):
        path.write_bytes(struct.pack("<Q", len(header)) + header)
        with open(path, "rb") as fh, pytest.raises(FileRefused):
            parse_safetensors(fh, path.stat().st_size)


def test_gguf_table_matches_the_gguf_package_on_the_packaged_model() -> None:
    gguf_model = pytest.importorskip("zmq_rpc.client.gguf_model")
    try:
        path = gguf_model.default_model_path()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no packaged model: {exc}")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    with open(path, "rb") as fh:
        table = parse_gguf(fh, os.path.getsize(path))
    assert len(table) == len(reader.tensors)
    for t in reader.tensors:
        ours = table[t.name]
        assert ours.offset == t.data_offset
        assert ours.nbytes == t.n_bytes
        assert ours.kind == t.tensor_type.name
        assert ours.shape == tuple(int(d) for d in t.shape)
