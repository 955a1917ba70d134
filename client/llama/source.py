"""Where a stage's weight bytes come from: the worker's own file, its tensor cache, or an upload.

For each stage (one worker), in this order of preference, whichever the worker has:

1. ``file``: the worker was started with ``--model-dir`` and holds a file of the model's name
   (or ``worker_path``) whose BLAKE3-256 is the client's file's: one READ_FILE names every tensor
   of the stage (type, dims and size checked against the worker's copy of the header). Nothing
   but the request crosses the network.
2. ``cache``: the worker has a ``--cache-dir``: SET_FROM_CACHE per cache piece (a tensor, or a
   16 MiB piece of a bigger one, named by its BLAKE3-256); the misses are uploaded with their key,
   so the next load finds them.
3. ``upload``: the file's byte ranges are uploaded (what a worker of protocol < 1.4 gets).

``sources="auto"`` picks per worker as above; ``"upload"``, ``"cache"`` or ``"file"`` insists
(``"file"`` fails when a worker cannot read the file, saying why). Runs on the loading thread; it
blocks on the requests' futures only. The client hashes the model file once
(:data:`~zmq_rpc.client.files.FILE_HASHES`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..files import (
    FILE_HASHES,
    FileDigests,
    fill_from_cache,
    named_read,
    pieces_of,
    query_file,
    read_file,
    upload_cached,
)

if TYPE_CHECKING:
    from ..client import RemoteTensor
    from ..gguf_model import GGUFTensor, LlamaGGUF
    from .staged import Staged

__all__ = ["SOURCES", "SourceChoice", "StageSource", "WeightSource"]

SourceChoice = Literal["auto", "upload", "cache", "file"]
SOURCES: tuple[str, ...] = ("auto", "upload", "cache", "file")


@dataclass(frozen=True, slots=True)
class StageSource:
    """How one stage's weights got to its worker."""

    endpoint: str
    source: str
    """"file", "cache" or "upload"."""
    wire_bytes: int
    """Weight bytes that crossed the network for this stage."""
    hits: int = 0
    misses: int = 0
    note: str = ""

    def describe(self, width: int = 100) -> str:
        """``tcp://a:1: cache (12/14 pieces hit), 3.1 MiB sent (why not a better source)``, cut to
        ``width`` characters."""
        hit = f" ({self.hits}/{self.hits + self.misses} pieces hit)" if self.source == "cache" \
            else ""
        text = f"{self.endpoint}: {self.source}{hit}, {self.wire_bytes / 2**20:.1f} MiB sent"
        if self.note:
            text += f" ({self.note})"
        return text if len(text) <= width else text[:width - 4] + "...)"


class WeightSource:
    """Fills staged tensors by the best source each worker offers."""

    def __init__(self, gguf: LlamaGGUF, choice: SourceChoice = "auto",
                 worker_path: str | None = None) -> None:
        if choice not in SOURCES:
            raise ValueError(f"sources must be one of {SOURCES}, got {choice!r}")
        self.gguf = gguf
        self.choice = choice
        self.worker_path = worker_path or os.path.basename(gguf.path)
        self._digests: FileDigests | None = None

    def digests(self, tensors: Sequence[GGUFTensor] = ()) -> FileDigests:
        """The client file's hashes (computed once per file; pieces of ``tensors`` added)."""
        ranges = [(t.offset, t.nbytes) for t in tensors]
        self._digests = FILE_HASHES.hashes(self.gguf.path, ranges, self.gguf.file_bytes)
        return self._digests

    def pick(self, staged: Staged) -> tuple[str, str]:
        """(source, why not better) for one stage's worker."""
        caps = staged.stage.client.info.capabilities
        notes = []
        if self.choice in ("auto", "file"):
            if "model-files" in caps:
                why = self._file_matches(staged)
                if not why:
                    return "file", ""
                notes.append(why)
            else:
                notes.append("no --model-dir")
            if self.choice == "file":
                raise FileNotFoundError(f"{staged.stage.client.endpoint} cannot read the model "
                                        f"file: {notes[-1]}")
        if self.choice in ("auto", "cache"):
            if "tensor-cache" in caps:
                return "cache", "; ".join(notes)
            notes.append("no --cache-dir")
            if self.choice == "cache":
                raise RuntimeError(f"{staged.stage.client.endpoint} has no tensor cache")
        return "upload", "; ".join(notes)

    def _file_matches(self, staged: Staged) -> str:
        """"" when the worker's file is ours, else why not."""
        reply = query_file(staged.stage.client, self.worker_path).result()
        if not reply.found:
            return reply.reason
        if reply.digest != self.digests().digest:
            return (f"its {self.worker_path!r} is a different file (blake3 "
                    f"{reply.digest.hex()[:12]}..., ours {self.digests().digest.hex()[:12]}...)")
        return ""

    # --------------------------------------------------------------------------- filling

    def from_file(self, staged: Staged) -> Future[None]:
        """One READ_FILE (in batches) naming every tensor of the stage."""
        reads = [named_read(staged.tensors[name], name, t.qtype.upper(),
                            tuple(reversed(t.shape)))
                 for name, t in ((n, self.gguf.tensors[n]) for n in staged.tensors)]
        return read_file(staged.stage.client, self.worker_path, self.digests().digest, reads)

    def cache_lookups(self, staged: Staged) -> list[tuple[RemoteTensor, Any, bytes,
                                                           Future[Any]]]:
        """SET_FROM_CACHE for every piece of the stage's tensors (all issued at once)."""
        tensors = [self.gguf.tensors[name] for name in staged.tensors]
        keys = self.digests(tensors).pieces
        lookups = []
        for t in tensors:
            flat = staged.buffer.tensor(t.nbytes, "uint8", staged.tensors[t.name].ref.offset)
            for lo, n in pieces_of(t.offset, t.nbytes):
                piece = flat[lo - t.offset:lo - t.offset + n]
                key = keys[(lo, n)]
                data = self.gguf.file_bytes[lo:lo + n]
                lookups.append((piece, data, key, fill_from_cache(piece, key)))
        return lookups

    @staticmethod
    def upload_misses(lookups: Sequence[tuple[RemoteTensor, Any, bytes, Future[Any]]]
                      ) -> tuple[list[Future[Any]], int, int]:
        """Upload (with their keys) the pieces the cache did not have: (futures, hits,
        bytes sent)."""
        futures, hits, sent = [], 0, 0
        for piece, data, key, lookup in lookups:
            if lookup.result().hit:
                hits += 1
                continue
            futures.append(upload_cached(piece, data, key))
            sent += int(data.nbytes)
        return futures, hits, sent
