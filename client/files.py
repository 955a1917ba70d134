"""Weights that don't cross the wire, client side: worker-side file reads, the workers' tensor
cache, and the file hashes both need.

- :func:`query_file`, :func:`read_file`: FILE_QUERY / READ_FILE (see :mod:`zmq_rpc.broker.files`):
  a worker started with ``--model-dir`` reads named tensors or byte ranges of a file on its own
  disk into buffers; the client names the file's BLAKE3-256 so a different file of the same name
  is refused.
- :func:`fill_from_cache`, :func:`upload_cached`: SET_FROM_CACHE / SET_TENSOR with a cache key:
  a worker started with ``--cache-dir`` keeps uploads under their content hash and fills later
  loads from disk.
- :class:`FileHashes`: each file is hashed once per (path, size, mtime): the whole file, and each
  tensor's pieces of at most :data:`CACHE_PIECE` bytes (the cache's unit). Results are kept in
  memory and on disk (``$XDG_CACHE_HOME/zmq-rpc/hashes``, else ``~/.cache/...``), so a restarted
  client does not hash a large model again.

Requests go through the worker's public :class:`~.connection.Connection`
(``client.session.connection``). Nothing here blocks but :meth:`FileHashes.hashes` (it reads the
file the first time); futures resolve on the thread that drives the connection. Any thread may
call in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..broker import files as wire
from ..broker.protocol import Cmd
from ..worker.formats.hashing import digest as content_digest
from .calls import no_result
from .futures import first_error
from .remote import Owner, RemoteTensor

log = logging.getLogger("zmq_rpc.client.files")

CACHE_PIECE = 16 << 20
"""Cache entries hold at most this many bytes of one tensor (bigger tensors are cut)."""
READ_BATCH = 64 << 20
"""A READ_FILE asks for about this many bytes at most (other sessions' requests go between)."""
HASHES_VERSION = 1


# ------------------------------------------------------------------------------ requests


def query_file(client: Owner, path: str) -> Future[wire.FileQueryReply]:
    """FILE_QUERY: whether ``client``'s worker has ``path`` under a ``--model-dir``, and its
    hash."""
    return client.session.connection.call(Cmd.FILE_QUERY, wire.FileQuery(path=path))


def read_file(client: Owner, path: str, file_digest: bytes,
              reads: Sequence[wire.FileRead]) -> Future[None]:
    """READ_FILE in batches of about :data:`READ_BATCH` bytes and at most
    :data:`~zmq_rpc.broker.files.MAX_READS` reads; one future for all of them."""
    batches: list[list[wire.FileRead]] = [[]]
    size = 0
    for read in reads:
        if batches[-1] and (size + read.nbytes > READ_BATCH or
                            len(batches[-1]) == wire.MAX_READS):
            batches.append([])
            size = 0
        batches[-1].append(read)
        size += read.nbytes
    connection = client.session.connection
    parts = [connection.call(Cmd.READ_FILE, wire.ReadFile(path=path, digest=file_digest,
                                                          reads=tuple(batch)), on_reply=no_result)
             for batch in batches if batch]
    return first_error(parts, lambda: None)


def named_read(tensor: RemoteTensor, name: str, kind: str, file_shape: Sequence[int]) -> \
        wire.FileRead:
    """A read of tensor ``name`` (of type ``kind`` and dims ``file_shape`` as the file lists
    them) into ``tensor``."""
    return wire.FileRead(name, kind, tuple(file_shape), 0, tensor.nbytes, tensor.ref)


def fill_from_cache(tensor: RemoteTensor, key: bytes) -> Future[wire.CacheReply]:
    """SET_FROM_CACHE: the reply says whether the worker's cache filled ``tensor``."""
    return tensor.client.session.connection.call(
        Cmd.SET_FROM_CACHE, wire.SetFromCache(tensor=tensor.ref, key=key))


def upload_cached(tensor: RemoteTensor, data: Any, key: bytes) -> Future[None]:
    """One SET_TENSOR of a contiguous ``tensor`` (at most a message) that the worker also files
    in its cache under ``key`` (the payload's BLAKE3-256)."""
    from ..broker import protocol as p

    flat = data.reshape(-1).view("uint8")
    return tensor.client.session.connection.call(
        Cmd.SET_TENSOR, p.SetTensor(tensor=tensor.ref, cache_key=key), [flat], no_result)


# -------------------------------------------------------------------------------- hashes


@dataclass
class FileDigests:
    """A file's BLAKE3-256, and the keys of its byte ranges' cache pieces."""

    size: int
    mtime_ns: int
    digest: bytes
    pieces: dict[tuple[int, int], bytes] = field(default_factory=dict)
    """(offset, nbytes) of a piece -> its BLAKE3-256."""


def pieces_of(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """The cache pieces of the byte range ``[offset, offset + nbytes)``."""
    return [(offset + at, min(CACHE_PIECE, nbytes - at)) for at in range(0, nbytes, CACHE_PIECE)]


class FileHashes:
    """File hashes computed once per (path, size, mtime), kept in memory and on disk."""

    def __init__(self, store: str | Path | None = None) -> None:
        self.store = Path(store) if store is not None else _default_store()
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int, int], FileDigests] = {}

    def hashes(self, path: str | Path, ranges: Iterable[tuple[int, int]] = (),
               file_bytes: Any = None) -> FileDigests:
        """The file's digest and the keys of the pieces of ``ranges`` (hashing what is missing;
        ``file_bytes``: the file already mapped, else it is read)."""
        real = os.path.realpath(path)
        st = os.stat(real)
        key = (real, st.st_size, st.st_mtime_ns)
        wanted = [piece for lo, n in ranges for piece in pieces_of(lo, n)]
        with self._lock:
            known = self._known.get(key) or self._load(key)
            missing = [pc for pc in wanted if known is None or pc not in known.pieces]
            if known is not None and not missing:
                return known
            known = self._compute(real, st, known, missing, file_bytes)
            self._known[key] = known
            self._save(key, known)
            return known

    @staticmethod
    def _compute(real: str, st: os.stat_result, known: FileDigests | None,
                 missing: list[tuple[int, int]], file_bytes: Any) -> FileDigests:
        import numpy as np

        from ..worker.formats.hashing import file_digest

        if known is None:
            fd = os.open(real, os.O_RDONLY)
            try:
                known = FileDigests(st.st_size, st.st_mtime_ns, file_digest(fd, st.st_size))
            finally:
                os.close(fd)
        data = file_bytes if file_bytes is not None else np.memmap(real, np.uint8, mode="r")
        for lo, n in missing:
            known.pieces[(lo, n)] = content_digest(data[lo:lo + n])
        log.info("hashed %s: %d piece(s)", real, len(missing))
        return known

    def _path(self, key: tuple[str, int, int]) -> Path:
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        return self.store / f"{name}.json"

    def _load(self, key: tuple[str, int, int]) -> FileDigests | None:
        try:
            doc = json.loads(self._path(key).read_text())
            if doc["version"] != HASHES_VERSION or doc["key"] != list(key):
                return None
            pieces = {(lo, n): bytes.fromhex(h) for lo, n, h in doc["pieces"]}
            return FileDigests(key[1], key[2], bytes.fromhex(doc["digest"]), pieces)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _save(self, key: tuple[str, int, int], known: FileDigests) -> None:
        doc = {"version": HASHES_VERSION, "key": list(key), "digest": known.digest.hex(),
               "pieces": [[lo, n, h.hex()] for (lo, n), h in sorted(known.pieces.items())]}
        try:
            self.store.mkdir(parents=True, exist_ok=True)
            tmp = self._path(key).with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(self._path(key))
        except OSError as exc:
            log.warning("cannot keep file hashes in %s: %s", self.store, exc)


def _default_store() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zmq-rpc" / "hashes"


FILE_HASHES = FileHashes()
"""The process's file hashes (what :class:`~zmq_rpc.client.llama.LlamaModel` uses)."""
