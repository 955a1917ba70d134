"""A content-addressed tensor cache on the worker's disk (``--cache-dir``, ``--cache-size``).

Owned by the backend thread (no locks). Entries are tensor payloads named by their BLAKE3-256
(:mod:`~zmq_rpc.worker.formats.hashing`): ``DIR/ab/abcdef....bin``. They are filled by uploads that carry
a cache key (SET_TENSOR with ``cache_key``): the worker hashes what it received and stores it only
when the hash is the key, so a client cannot file bytes under another tensor's name. They are read
by SET_FROM_CACHE: the entry is read into memory, hashed again and used only when it still matches
its name; a corrupted (or replaced) entry is reported in the reply and the log, deleted, and the
client uploads instead.

Bounded by bytes: past ``limit`` the least recently used entries are deleted (use order survives a
restart through the files' mtimes, which a hit refreshes). Writes go to a temporary file renamed
into place, so a crash never leaves a half-written entry under a valid name.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..formats.hashing import DIGEST_BYTES, digest

log = logging.getLogger("zmq_rpc.worker.cache")

SUFFIX = ".bin"


@dataclass(frozen=True, slots=True)
class CacheRead:
    """The outcome of one lookup: the bytes (None on a miss) and what happened."""

    data: np.ndarray | None
    note: str


class TensorCache:
    """Content-addressed entries under ``root``, at most ``limit`` bytes in all."""

    def __init__(self, root: str, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the cache size must be positive")
        self.root = os.path.realpath(root)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.limit = limit
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        """key -> size, least recently used first."""
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "stored": 0, "corrupt": 0, "evicted": 0}
        self._scan()

    def _scan(self) -> None:
        found = []
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                key = _key_of(entry.name)
                if key is None or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.entries[key] = size
            self.bytes += size
        self._evict(0)
        log.info("tensor cache %s: %d entries, %d bytes (limit %d)", self.root,
                 len(self.entries), self.bytes, self.limit)

    def path(self, key: bytes) -> str:
        text = key.hex()
        return os.path.join(self.root, text[:2], text + SUFFIX)

    def get(self, key: bytes, nbytes: int) -> CacheRead:
        """The entry ``key`` if present, ``nbytes`` long and still matching its hash."""
        size = self.entries.get(key)
        if size is None:
            self.stats["misses"] += 1
            return CacheRead(None, "not cached")
        if size != nbytes:
            self.stats["misses"] += 1
            return CacheRead(None, f"cached entry holds {size} bytes, not {nbytes}")
        data = self._read(key, size)
        if data is None or digest(data) != key:
            self._discard(key, "corrupted: its bytes no longer match its hash")
            return CacheRead(None, "cached entry was corrupted (discarded)")
        self.entries.move_to_end(key)
        _touch(self.path(key))
        self.stats["hits"] += 1
        return CacheRead(data, "hit")

    def _read(self, key: bytes, size: int) -> np.ndarray | None:
        data = np.empty(size, np.uint8)
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            view, done = memoryview(data.data), 0
            while done < size:
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    return None
                done += n
            return data if os.fstat(fd).st_size == size else None
        finally:
            os.close(fd)

    def put(self, key: bytes, payload: Any) -> str:
        """Store ``payload`` under ``key`` if it hashes to it; returns what happened."""
        view = memoryview(payload).cast("B")
        if len(key) != DIGEST_BYTES or digest(view) != key:
            return "not stored: the bytes do not match their cache key"
        if key in self.entries:
            self.entries.move_to_end(key)
            return "already cached"
        if view.nbytes > self.limit:
            return "not stored: larger than the whole cache"
        self._evict(view.nbytes)
        path = self.path(key)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(view)
            os.replace(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            log.warning("cannot store a cache entry in %s: %s", self.root, exc)
            return f"not stored: {exc.strerror}"
        self.entries[key] = view.nbytes
        self.bytes += view.nbytes
        self.stats["stored"] += 1
        return "stored"

    def _evict(self, incoming: int) -> None:
        while self.entries and self.bytes + incoming > self.limit:
            key, size = self.entries.popitem(last=False)
            self.bytes -= size
            self.stats["evicted"] += 1
            _unlink(self.path(key))

    def _discard(self, key: bytes, why: str) -> None:
        log.warning("tensor cache entry %s %s", key.hex()[:16], why)
        self.stats["corrupt"] += 1
        self.bytes -= self.entries.pop(key, 0)
        _unlink(self.path(key))


def _key_of(name: str) -> bytes | None:
    if not name.endswith(SUFFIX) or len(name) != 2 * DIGEST_BYTES + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None


def _touch(path: str) -> None:
    try:
        now = time.time_ns()
        os.utime(path, ns=(now, now), follow_symlinks=False)
    except OSError:
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
