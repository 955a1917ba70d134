"""Where weights come from, measured: upload vs the workers' tensor cache (cold, warm) vs their own
copy of the file; and the content hashes the cache and file identity use.

- :func:`llama_load_rows`: SmolLM2 loaded by :class:`~zmq_rpc.client.llama.LlamaModel` onto two
  workers with each source in turn (``upload``, ``cache`` cold then warm, ``file``), rounds
  alternated; seconds until the weights are in place, and the weight bytes that crossed the
  network (used by the ``links`` case, where the workers sit behind shaped links).
- :func:`synthetic_load_rows`: the same four sources for a synthetic GGUF of random Q8_0/Q4_1
  blocks (``--synthetic-model 2GiB``), written to a temporary directory and deleted after; the
  tensors are split over two workers and filled with the client calls of
  :mod:`zmq_rpc.client.files`.
- case ``hashes``: GB/s of BLAKE3-256 and XXH3-128 (and SHA-256 for scale) over 256 MiB, one
  thread, alternated: the figures behind the choice of BLAKE3 (:mod:`zmq_rpc.worker.formats.hashing`).

Runs in the bench's main thread. Workers are started through a callable given by the caller (in
the lab hosts for ``links``) and stopped after each round.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..client import Client
from .bench import BenchContext, CaseResult, Runner, interleave, register_case
from .units import format_size

SOURCES = ("upload", "cache cold", "cache warm", "file first", "file")
"""Measured in this order on fresh workers each round: "file first" includes the worker hashing
its copy of the file (once per worker start), "file" is the next load."""
StartWorkers = Callable[[Sequence[str]], AbstractContextManager[list[Client]]]
"""``start(extra_worker_args)`` -> a context giving clients of two fresh workers."""


# ------------------------------------------------------------------------------- hashes


@register_case("hashes", "BLAKE3-256 vs XXH3-128 (vs SHA-256) GB/s over 256 MiB, one thread",
               default=False)
def case_hashes(ctx: BenchContext) -> list[CaseResult]:
    try:
        import blake3
        import xxhash
    except ImportError as exc:
        print(f"hashes: skipped ({exc}; pip install blake3 xxhash)")
        return []
    size = 64 << 20 if ctx.quick else 256 << 20
    data = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).data)

    def rate(fn: Callable[[], Any]) -> Runner:
        def run() -> float:
            start = time.perf_counter()
            fn()
            return size / (time.perf_counter() - start) / 1e9
        return run
    runners = {"blake3": rate(lambda: blake3.blake3(data).digest()),
               "xxh3-128": rate(lambda: xxhash.xxh3_128(data).digest()),
               "sha256": rate(lambda: hashlib.sha256(data).digest())}
    reps = ctx.reps(7, 2)
    with ctx.progress(reps, "hashes") as bar:
        samples = interleave(runners, reps, bar)
    return [CaseResult("hashes", f"hash blake3 {format_size(size)}", "GB/s", samples["blake3"],
                       {"xxh3-128": samples["xxh3-128"], "sha256": samples["sha256"]}, None,
                       True, note="BLAKE3 is the cache's key: collision resistant (a client "
                                  "cannot forge another's entry); XXH3 is not")]


# -------------------------------------------------------------------------- load sources


def _rows(label: str, seconds: dict[str, list[float]], wire: dict[str, int],
          note: str) -> list[CaseResult]:
    rows = []
    for source in SOURCES[1:]:
        rows.append(CaseResult(
            "links", f"{label} {source}", "s", seconds[source], {"upload": seconds["upload"]},
            None, False, note=f"{wire[source] / 1e6:.1f} MB on the wire vs "
                              f"{wire['upload'] / 1e6:.1f} MB uploaded; {note}"))
    return rows


def llama_load_rows(ctx: BenchContext, start: StartWorkers, label: str) -> list[CaseResult]:
    """SmolLM2 on two workers from each source (rounds alternated; a fresh cache per round)."""
    from ..client.gguf_model import default_model_path
    from ..client.llama import LlamaModel

    model = Path(default_model_path())
    seconds: dict[str, list[float]] = {s: [] for s in SOURCES}
    wire: dict[str, int] = {}
    with _model_dir(model) as (models, scratch):
        for round_ in range(ctx.reps(3, 1)):
            cache = scratch / f"cache{round_}"
            with start(["--model-dir", str(models), "--cache-dir", str(cache)]) as clients:
                for source in SOURCES:
                    choice = source.split()[0]
                    with LlamaModel.load(model, clients, sources=choice) as m:  # type: ignore[arg-type]
                        stats = m.load_stats
                        assert stats is not None
                        _check_sources(stats.sources, choice)
                        seconds[source].append(stats.upload_seconds)
                        wire[source] = stats.upload_bytes
            shutil.rmtree(cache, ignore_errors=True)
    return _rows(label, seconds, wire, "seconds until the weights are in place")


def _check_sources(sources: Sequence[Any], choice: str) -> None:
    got = {s.source for s in sources}
    if got != {choice}:
        raise RuntimeError(f"asked for {choice}, the workers used {got}")


@contextmanager
def _model_dir(model: Path) -> Iterator[tuple[Path, Path]]:
    """A scratch directory with ``models/`` holding the model (a hard link when the file system
    allows, else a copy); deleted on exit."""
    scratch = Path(tempfile.mkdtemp(prefix="zmq-rpc-bench-"))
    try:
        models = scratch / "models"
        models.mkdir()
        try:
            os.link(model, models / model.name)
        except OSError:
            shutil.copy(model, models / model.name)
        yield models, scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ----------------------------------------------------------------------- synthetic model


def write_synthetic_gguf(path: Path, nbytes: int, seed: int = 0) -> list[tuple[str, str, int]]:
    """A GGUF of random Q8_0 and Q4_1 matrices (4096 wide) adding up to about ``nbytes``;
    returns (name, type, rows) of each tensor."""
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "synthetic")
    width, rows = 4096, 2048
    kinds = [("Q8_0", GGMLQuantizationType.Q8_0, 34), ("Q4_1", GGMLQuantizationType.Q4_1, 20)]
    specs, total, i = [], 0, 0
    while total < nbytes:
        kind, qtype, block = kinds[i % 2]
        row_bytes = width // 32 * block
        data = rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
        writer.add_tensor(f"blk.{i}.weight", data, raw_dtype=qtype)
        specs.append((f"blk.{i}.weight", kind, rows))
        total += data.nbytes
        i += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return specs


class SyntheticLoad:
    """The synthetic model's tensors split over two workers, filled from one source."""

    def __init__(self, path: Path) -> None:
        from ..worker.files.model_files import parse_gguf

        with open(path, "rb") as fh:
            self.table = parse_gguf(fh, path.stat().st_size)
        self.path = path
        self.data = np.memmap(path, np.uint8, mode="r")
        from ..client import files

        start = time.perf_counter()
        self.digests = files.FILE_HASHES.hashes(path, [(t.offset, t.nbytes)
                                                       for t in self.table.values()], self.data)
        self.hash_seconds = time.perf_counter() - start

    def load(self, clients: Sequence[Client], source: str) -> tuple[float, int]:
        """(seconds until every tensor is in place, bytes sent)."""
        from ..client import files

        names = sorted(self.table)
        digests = self.digests
        start = time.perf_counter()
        waits: list[Future[Any]] = []
        sent = 0
        buffers = []
        for k, client in enumerate(clients):
            mine = [self.table[n] for n in names[k::len(clients)]]
            buffer = client.alloc_buffer(sum(t.nbytes for t in mine))
            buffers.append(buffer)
            at = 0
            reads = []
            for t in mine:
                dst = buffer.tensor(t.nbytes, "uint8", at)
                at += t.nbytes
                if source.startswith("file"):
                    reads.append(files.named_read(dst, t.name, t.kind, t.shape))
                elif source == "upload":
                    waits.append(client.set_tensor_async(dst, self.data[t.offset:t.offset
                                                                        + t.nbytes]))
                    sent += t.nbytes
                else:
                    for lo, n in files.pieces_of(t.offset, t.nbytes):
                        piece = dst[lo - t.offset:lo - t.offset + n]
                        hit = files.fill_from_cache(piece, digests.pieces[(lo, n)])
                        waits.append(_upload_if_missed(hit, piece, self.data[lo:lo + n],
                                                       digests.pieces[(lo, n)]))
                        sent += n   # corrected below for hits
            if reads:
                waits.append(files.read_file(client, self.path.name, digests.digest, reads))
        missed = [f.result() for f in waits]
        seconds = time.perf_counter() - start
        if source.startswith("cache"):
            sent = sum(n for n in missed if isinstance(n, int))
        for buffer in buffers:
            buffer.free()
        return seconds, sent


def _upload_if_missed(hit: Future[Any], piece: Any, data: Any, key: bytes) -> Future[int]:
    """Resolves with the bytes uploaded (0 on a cache hit)."""
    from ..client import files

    out: Future[int] = Future()
    out.set_running_or_notify_cancel()

    def after(f: Future[Any]) -> None:
        try:
            if f.result().hit:
                out.set_result(0)
                return
            up = files.upload_cached(piece, data, key)
            up.add_done_callback(lambda u: out.set_exception(u.exception()) if u.exception()
                                 else out.set_result(int(data.nbytes)))
        except BaseException as exc:
            out.set_exception(exc)
    hit.add_done_callback(after)
    return out


def synthetic_load_rows(ctx: BenchContext, start: StartWorkers, size: int,
                        label: str) -> list[CaseResult]:
    """The four sources for a synthetic GGUF of ``size`` bytes (deleted afterwards)."""
    seconds: dict[str, list[float]] = {s: [] for s in SOURCES}
    wire: dict[str, int] = {}
    scratch = Path(tempfile.mkdtemp(prefix="zmq-rpc-synthetic-"))
    try:
        models = scratch / "models"
        models.mkdir()
        path = models / "synthetic.gguf"
        write_synthetic_gguf(path, size)
        load = SyntheticLoad(path)
        for round_ in range(ctx.reps(2, 1)):
            cache = scratch / f"cache{round_}"
            with start(["--model-dir", str(models), "--cache-dir", str(cache),
                        "--mem", str(2 * size)]) as clients:
                for source in SOURCES:
                    took, sent = load.load(clients, source)
                    seconds[source].append(took)
                    wire[source] = sent
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _rows(f"{label} {format_size(size)}", seconds, wire,
                 f"random Q8_0/Q4_1 blocks over 2 workers; the client hashed the file once in "
                 f"{load.hash_seconds:.1f} s (not counted); file deleted after")
