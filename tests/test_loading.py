"""Weights that don't cross the wire (worker/files/loading.py, client/files.py, client/llama/source.py).

Real workers and clients on loopback: FILE_QUERY / READ_FILE confined to ``--model-dir`` and
checked against the file's header and hash; SET_FROM_CACHE / cached uploads verified by hash;
LlamaModel choosing the worker's file, its cache or an upload, and computing the same logits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("blake3")

from test_model_files import write_safetensors  # noqa: E402
from zmq_rpc.broker.files import FileRead  # noqa: E402
from zmq_rpc.client import BadRequest, Client, ModelFileError  # noqa: E402
from zmq_rpc.client.files import (  # noqa: E402
    FileHashes,
    fill_from_cache,
    named_read,
    query_file,
    read_file,
    upload_cached,
)
from zmq_rpc.worker.formats.hashing import digest  # noqa: E402
from zmq_rpc.worker.server import WorkerServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)

W = np.arange(12, dtype=np.float32).reshape(3, 4)
B = np.arange(5, dtype=np.int8)


@pytest.fixture
def models(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    write_safetensors(root / "m.safetensors", {"w": W, "b": B})
    (tmp_path / "secret.safetensors").write_bytes(b"top secret")
    return root


@pytest.fixture
def files_client(models: Path, make_worker: Callable[..., WorkerServer],
                 make_client: Callable[..., Client]) -> Client:
    return make_client(make_worker(model_dirs=(str(models),)).endpoint)


def test_a_worker_reads_named_tensors_and_byte_ranges_of_its_own_file(
        files_client: Client, models: Path) -> None:
    c = files_client
    assert "model-files" in c.info.capabilities and "tensor-cache" not in c.info.capabilities
    reply = query_file(c, "m.safetensors").result()
    raw = (models / "m.safetensors").read_bytes()
    assert reply.found and reply.size == len(raw) and reply.format == "safetensors"
    assert reply.digest == digest(raw)
    w = c.alloc_buffer(48).tensor((3, 4), "float32")
    b = c.alloc_buffer(5).tensor(5, "int8")
    head = c.alloc_buffer(8).tensor(8, "uint8")
    read_file(c, "m.safetensors", reply.digest, [
        named_read(w, "w", "F32", (3, 4)), named_read(b, "b", "I8", (5,)),
        FileRead("", "", (), 0, 8, head.ref)]).result()
    np.testing.assert_array_equal(c.get_tensor(w), W)
    np.testing.assert_array_equal(c.get_tensor(b), B)
    assert c.get_tensor(head).tobytes() == raw[:8]


@pytest.mark.parametrize("path, why", [
    ("../secret.safetensors", "are refused"),
    ("/etc/passwd", "absolute paths"),
    ("nothere.safetensors", "not in this worker's model directories"),
    ("link.safetensors", "leads out of the model directory"),
    ("fifo.safetensors", "not a regular file"),
])
def test_paths_out_of_the_model_dirs_are_refused_and_the_worker_goes_on(
        files_client: Client, models: Path, path: str, why: str) -> None:
    os.symlink(models.parent / "secret.safetensors", models / "link.safetensors")
    os.mkfifo(models / "fifo.safetensors")
    c = files_client
    reply = query_file(c, path).result()
    assert not reply.found and why in reply.reason
    t = c.alloc_buffer(10).tensor(10, "uint8")
    with pytest.raises(ModelFileError, match=why):
        read_file(c, path, bytes(32), [FileRead("", "", (), 0, 10, t.ref)]).result()
    c.ping()


def test_a_different_file_with_the_same_name_is_detected(files_client: Client,
                                                         models: Path) -> None:
    c = files_client
    theirs = query_file(c, "m.safetensors").result().digest
    w = c.alloc_buffer(48).tensor((3, 4), "float32")
    write_safetensors(models / "m.safetensors", {"w": W + 1, "b": B})    # replaced meanwhile
    with pytest.raises(ModelFileError, match="a different file"):
        read_file(c, "m.safetensors", theirs, [named_read(w, "w", "F32", (3, 4))]).result()
    assert not c.get_tensor(w).any()                                    # nothing was written


@pytest.mark.parametrize("read, why", [
    (lambda t: named_read(t, "w", "F16", (3, 4)), "F32 \\[3, 4\\] \\(48 bytes\\) in the file"),
    (lambda t: named_read(t, "w", "F32", (4, 3)), "in the file, not"),
    (lambda t: named_read(t, "nope", "F32", (3, 4)), "no tensor named 'nope'"),
    (lambda t: named_read(t.view(dtype="int32"), "w", "F32", (3, 4)), "cannot land in a int32"),
    (lambda t: FileRead("", "", (), 1 << 40, 48, t.ref), "past the end"),
])
def test_reads_are_checked_against_the_files_own_header(files_client: Client, read: Callable,
                                                        why: str) -> None:
    c = files_client
    ours = query_file(c, "m.safetensors").result().digest
    t = c.alloc_buffer(48).tensor((3, 4), "float32")
    with pytest.raises(ModelFileError, match=why):
        read_file(c, "m.safetensors", ours, [read(t)]).result()
    with pytest.raises(BadRequest, match="contiguous view of exactly"):     # checked on decode
        read_file(c, "m.safetensors", ours, [FileRead("w", "F32", (3, 4), 0, 40, t.ref)])\
            .result()


def test_a_worker_without_model_dirs_or_cache_says_so(worker: WorkerServer,
                                                      make_client: Callable[..., Client]) -> None:
    c = make_client(worker.endpoint)
    assert not query_file(c, "m.safetensors").result().found
    t = c.alloc_buffer(8).tensor(8, "uint8")
    with pytest.raises(ModelFileError, match="--model-dir"):
        read_file(c, "m.safetensors", bytes(32), [FileRead("", "", (), 0, 8, t.ref)]).result()
    miss = fill_from_cache(t, bytes(32)).result()
    assert not miss.hit and "--cache-dir" in miss.note


def test_the_cache_fills_from_uploads_and_refuses_corrupted_or_poisoned_entries(
        tmp_path: Path, make_worker: Callable[..., WorkerServer],
        make_client: Callable[..., Client]) -> None:
    c = make_client(make_worker(cache_dir=str(tmp_path / "cache")).endpoint)
    assert "tensor-cache" in c.info.capabilities
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    key = digest(data)
    t = c.alloc_buffer(data.nbytes).tensor(data.nbytes, "uint8")
    assert fill_from_cache(t, key).result().note == "not cached"
    upload_cached(t, data, key).result()
    other = c.alloc_buffer(data.nbytes).tensor(data.nbytes, "uint8")
    assert fill_from_cache(other, key).result().hit
    np.testing.assert_array_equal(c.get_tensor(other), data)
    # poisoning: bytes uploaded under another tensor's key are written but never cached
    fake = digest(data[::-1].copy())
    upload_cached(t, data, fake).result()
    assert not fill_from_cache(other, fake).result().hit
    # corruption on disk: detected, reported, deleted, not used
    entry = next((tmp_path / "cache").rglob("*.bin"))
    entry.write_bytes(bytes(data.nbytes))
    c.set_tensor(other, np.full(data.nbytes, 7, np.uint8))
    bad = fill_from_cache(other, key).result()
    assert not bad.hit and "corrupted" in bad.note and not entry.exists()
    assert (c.get_tensor(other) == 7).all()


def test_client_hashes_each_file_once_and_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(40000))
    store = tmp_path / "store"
    first = FileHashes(store).hashes(path, [(0, 100), (100, 39900)])
    assert first.digest == digest(path.read_bytes())
    assert first.pieces[(100, 39900)] == digest(path.read_bytes()[100:])
    again = FileHashes(store)                                         # a new process
    assert again.hashes(path, [(0, 100)]).pieces == first.pieces      # read from the store
    os.utime(path, ns=(1, 1))                                         # touched: hashed again
    assert (0, 100) not in FileHashes(store).hashes(path).pieces


# ------------------------------------------------------------------------------ LlamaModel


def _packaged_model() -> Path:
    gguf_model = pytest.importorskip("zmq_rpc.client.gguf_model")
    try:
        return Path(gguf_model.default_model_path())
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"no packaged model: {exc}")


@pytest.mark.timeout(600)
def test_llama_takes_the_workers_file_then_its_cache_then_an_upload(
        tmp_path: Path, spawn_worker: Callable[..., object]) -> None:
    """Worker A holds the model file, worker B a cache, and every load computes the same
    logits as a plain upload; the summary says which source each worker used."""
    from zmq_rpc.client.llama import LlamaModel

    model = _packaged_model()
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(model, models / model.name)
    argv = [sys.executable, "-m", "zmq_rpc.worker.cli", "--bind", "tcp://127.0.0.1:*",
            "--log-level", "WARNING"]
    procs = [subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, text=True)
             for extra in (["--model-dir", str(models)],
                           ["--cache-dir", str(tmp_path / "cache")])]
    try:
        endpoints = [proc.stdout.readline().rsplit(" ", 1)[1].strip()  # type: ignore[union-attr]
                     for proc in procs]
        clients = [Client(ep) for ep in endpoints]
        prompt = list(range(300, 308))
        outcomes = []
        for sources in ("upload", "auto", "auto"):
            with LlamaModel.load(model, clients, sources=sources) as m:  # type: ignore[arg-type]
                logits = m.prefill(prompt)
                stats = m.load_stats
                assert stats is not None
                outcomes.append((logits, [(s.source, s.hits, s.misses) for s in stats.sources],
                                 stats.upload_bytes))
        (base, _, sent), (cold, cold_src, cold_sent), (warm, warm_src, warm_sent) = outcomes
        np.testing.assert_array_equal(cold, base)
        np.testing.assert_array_equal(warm, base)
        assert cold_src[0] == ("file", 0, 0) and cold_src[1][0] == "cache"
        assert cold_src[1][1] == 0 and cold_src[1][2] > 0              # all misses, uploaded
        assert warm_src[1] == ("cache", cold_src[1][2], 0)             # all hits
        assert warm_sent == 0 < cold_sent < sent
        changed = bytearray(model.read_bytes())                         # same name, other bytes
        changed[-1] ^= 0xFF
        (models / model.name).write_bytes(changed)
        with LlamaModel.load(model, clients[:1]) as m:
            assert m.load_stats is not None
            only = m.load_stats.sources[0]
            assert only.source == "upload" and "different file" in only.note
        with pytest.raises(FileNotFoundError, match="cannot read the model file"):
            LlamaModel.load(model, clients[:1], sources="file")
        for client in clients:
            client.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
            if proc.stdout is not None:
                proc.stdout.close()
