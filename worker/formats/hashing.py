"""Content hashes: BLAKE3-256 of tensor bytes (cache keys) and of whole files (file identity).

Pure functions; any thread. BLAKE3 rather than xxhash's XXH3-128: both hash far faster than a
1-2.5 GbE link delivers (``zmq-rpc-bench --cases hashes``; figures in docs/DESIGN.md), and only
BLAKE3 is collision resistant. A worker's tensor cache is shared by every client
of that worker, so a key must be a name that nobody can forge content for: with a
non-cryptographic hash one client could upload crafted bytes under the key of another's tensor
(poisoning it). The ``blake3`` package is an extra (``pip install zmq-rpc[files]``, also in
``llm`` and ``test``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

DIGEST_BYTES = 32
FILE_BLOCK = 8 << 20


def _blake3() -> Any:
    try:
        from blake3 import blake3
    except ImportError:
        raise RuntimeError("content hashes need the blake3 package: "
                           "pip install 'zmq-rpc[files]'") from None
    return blake3


def available() -> bool:
    """Whether the hash package is installed."""
    try:
        _blake3()
    except RuntimeError:
        return False
    return True


def digest(data: Any) -> bytes:
    """BLAKE3-256 of a bytes-like object (a zmq frame's buffer, a numpy array's memory)."""
    return bytes(_blake3()(memoryview(data).cast("B")).digest())


class HashCancelled(Exception):
    """:func:`file_digest` was told to stop before the end of the file."""


def file_digest(fd: int, size: int, stop: Callable[[], bool] | None = None) -> bytes:
    """BLAKE3-256 of the first ``size`` bytes of an open file (read in blocks, not mapped);
    ``stop`` is asked between blocks (a worker shutting down does not finish a 4 GiB hash)."""
    hasher = _blake3()()
    block = bytearray(min(FILE_BLOCK, max(size, 1)))
    view = memoryview(block)
    done = 0
    while done < size:
        if stop is not None and stop():
            raise HashCancelled(f"stopped at byte {done} of {size}")
        n = os.preadv(fd, [view[:min(len(block), size - done)]], done)
        if n <= 0:
            raise OSError(f"file ended at byte {done} of {size}")
        hasher.update(view[:n])
        done += n
    return bytes(hasher.digest())
