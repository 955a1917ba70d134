"""Weights that don't cross the wire: worker-side file reads and the worker's tensor cache.

Pure data and encoding; any thread may use it. Commands (protocol 1.4; a worker lists
``model-files`` and/or ``tensor-cache`` in its capabilities when it was started with
``--model-dir`` / ``--cache-dir``):

- FILE_QUERY ``[path]``: does the worker have model file ``path`` (relative to one of its
  ``--model-dir`` directories)? The reply says ``found`` (else ``reason``), the file's ``size``,
  ``format`` and BLAKE3-256 ``digest``, so that the client can tell whether it is *its* file.
- READ_FILE ``[path, digest, reads]``: read from that file, which must still hash to ``digest``,
  into buffers of the session. Each read is ``[name, kind, shape, offset, nbytes, dst]``: a named
  tensor (``name`` non-empty: ``kind`` and ``shape`` must be what the file's own header says,
  ``nbytes`` its byte size) or a byte range (``name`` empty: ``[offset, offset + nbytes)`` of the
  file); ``dst`` is a contiguous view of exactly ``nbytes``. Runs in order in the session's queue
  like SET_TENSOR. Refusals are FILE_REFUSED errors naming why (path out of the directories, a
  symlink out, not a regular file, a different file, a type or size the header contradicts).
- SET_FROM_CACHE ``[tensor, key]``: fill ``tensor`` from the cache entry whose BLAKE3-256 is
  ``key``. The reply (``hit``, ``note``) says whether it did: a miss, or an entry that no longer
  matches its hash (then deleted, and said so), leaves the tensor as it was; upload it instead.
- SET_TENSOR's ``cache_key`` (since 1.4, off the wire when empty): the BLAKE3-256 of the payload;
  the worker stores the payload in its cache under that key when (and only when) it hashes to it.

Hashes are BLAKE3-256 (:mod:`.hashing`): keys name content nobody can forge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BadRequest
from .wire import (
    ErrorCode,
    Message,
    TensorRef,
    _f,
    _int_in,
    check_bool,
    check_str,
    check_tensor,
    check_u63,
    describe,
    timing_field,
    wire_message,
)

DIGEST_BYTES = 32
MAX_READS = 1024
"""Reads of one READ_FILE: each costs a decode, a header check and a ``preadv``, so their count
bounds the request's fixed cost (docs/SECURITY.md, "What one request may cost"); a client sends
them in batches of at most this many (a llama has ~9 tensors a layer)."""
MAX_READ_EXTRA = 256 << 20
"""Bytes one READ_FILE may read besides its largest read (a single tensor may be as big as a
buffer; ``reads`` naming the same 1 GiB view 1,024 times could not read in any bound)."""
MAX_KIND = 32


def check_digest(value: Any, field: str) -> bytes:
    """A BLAKE3-256 digest: 32 bytes."""
    if type(value) is not bytes or len(value) != DIGEST_BYTES:
        raise BadRequest(f"field {field!r}: a digest is {DIGEST_BYTES} bytes, not "
                         f"{describe(value)}", code=ErrorCode.BAD_REQUEST)
    return value


def check_cache_key(value: Any, field: str) -> bytes:
    """SET_TENSOR's optional cache key: empty, or a digest."""
    return value if value == b"" else check_digest(value, field)



@dataclass(frozen=True, slots=True)
class FileRead:
    """One read of READ_FILE: a named tensor (``kind``/``shape`` as the file lists them) or,
    with ``name`` empty, the byte range ``[offset, offset + nbytes)``; into ``dst``."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    dst: TensorRef

    def to_wire(self) -> list[Any]:
        return [self.name, self.kind, list(self.shape), self.offset, self.nbytes,
                self.dst.to_wire()]


_check_dim = _int_in(0, 1 << 48)


def _check_read(value: Any, field: str) -> FileRead:
    if type(value) is not list or len(value) != 6:
        raise BadRequest(f"field {field!r}: a read is [name, kind, shape, offset, nbytes, dst]",
                         code=ErrorCode.BAD_REQUEST)
    name, kind, shape, offset, nbytes, dst = value
    if type(shape) is not list or len(shape) > 8:
        raise BadRequest(f"field {field!r}.shape: a list of at most 8 dims",
                         code=ErrorCode.BAD_REQUEST)
    read = FileRead(check_str(name, f"{field}.name"), check_str(kind, f"{field}.kind"),
                    tuple(_check_dim(d, f"{field}.shape") for d in shape),
                    check_u63(offset, f"{field}.offset"), check_u63(nbytes, f"{field}.nbytes"),
                    check_tensor(dst, f"{field}.dst"))
    if len(read.kind) > MAX_KIND:
        raise BadRequest(f"field {field!r}.kind: at most {MAX_KIND} characters",
                         code=ErrorCode.BAD_REQUEST)
    if read.dst.nbytes != read.nbytes or not read.dst.is_contiguous():
        raise BadRequest(f"field {field!r}: dst must be a contiguous view of exactly "
                         f"{read.nbytes} bytes", code=ErrorCode.BAD_REQUEST)
    return read


def _check_reads(value: Any, field: str) -> tuple[FileRead, ...]:
    if type(value) is not list or not 1 <= len(value) <= MAX_READS:
        raise BadRequest(f"field {field!r}: 1 to {MAX_READS} reads", code=ErrorCode.BAD_REQUEST)
    reads = tuple(_check_read(v, f"{field}[{i}]") for i, v in enumerate(value))
    sizes = [r.nbytes for r in reads]
    if sum(sizes) - max(sizes) > MAX_READ_EXTRA:
        raise BadRequest(f"field {field!r}: {sum(sizes):,} bytes; one READ_FILE reads at most "
                         f"its largest read and {MAX_READ_EXTRA:,} bytes more",
                         code=ErrorCode.BAD_REQUEST)
    return reads


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class FileQuery(Message):
    """Does the worker have model file ``path`` (relative to a ``--model-dir``)?"""

    path: str = _f(check_str)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class FileQueryReply(Message):
    """The worker's file: found (with size, format and BLAKE3-256), or why not."""

    found: bool = _f(check_bool)
    reason: str = _f(check_str)
    size: int = _f(check_u63)
    format: str = _f(check_str)
    digest: bytes = _f(lambda v, f: v if v == b"" else check_digest(v, f))
    timing: tuple[int, ...] = timing_field()


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class ReadFile(Message):
    """Read named tensors or byte ranges of ``path`` (hashing to ``digest``) into buffers."""

    path: str = _f(check_str)
    digest: bytes = _f(check_digest)
    reads: tuple[FileRead, ...] = _f(_check_reads)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reads)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class SetFromCache(Message):
    """Fill ``tensor`` (contiguous) from the cache entry named by its BLAKE3-256 ``key``."""

    tensor: TensorRef = _f(check_tensor)
    key: bytes = _f(check_digest)


@wire_message
@dataclass(frozen=True, slots=True, kw_only=True)
class CacheReply(Message):
    """Whether SET_FROM_CACHE filled the tensor, and what happened (``hit``, ``not cached``,
    ``cached entry was corrupted (discarded)``, ...)."""

    hit: bool = _f(check_bool)
    note: str = _f(check_str)
    timing: tuple[int, ...] = timing_field()
