"""Model files on the worker's own disk: confined paths, file identity, tensor metadata, reads.

Owned by the backend thread (like every piece of worker state; no locks). A worker started with
``--model-dir DIR`` (repeatable) may read GGUF and safetensors files below those directories into
its buffers when a client asks (READ_FILE), so that weights never cross the network:

- **Confinement** (:meth:`ModelFiles.resolve`): a client names a path *relative* to a model
  directory; ``..`` components, absolute paths, NUL bytes, symlinks leading out of the directory
  and anything but a regular file are refused. The file is opened with ``O_NOFOLLOW`` and checked
  again on the open descriptor (same inode as resolved, regular file).
- **Identity**: the BLAKE3 hash of the whole file, computed once per (path, device, inode, size,
  mtime_ns) and kept in memory (one entry per path: a changed file replaces its old entry); a
  client names the hash it expects and a different file with the same name is refused
  (:class:`FileMismatch`). Hashing reads the whole file (seconds for GiBs), so it does not run
  here: :meth:`ModelFiles.identify` answers from the cache or hands back the open file, which
  :mod:`~.hasher`'s thread hashes with :func:`identify_open`.
- **Metadata**: the tensor table of the file's own header (GGUF v2/v3 or safetensors), parsed
  with bounds on every count and length, so a read of a named tensor is checked against the
  file's type, shape and byte size, and a byte range against the file's end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

log = logging.getLogger("zmq_rpc.worker.files")

HASH_BYTES = 32
READ_BLOCK = 8 << 20
MAX_NAME = 4096
MAX_TENSORS = 1 << 20
MAX_HEADER = 256 << 20

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
SAFETENSORS_TYPES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
    "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
PLAIN_DTYPES: dict[str, str] = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I8": "int8",
    "I16": "int16", "I32": "int32", "I64": "int64", "U8": "uint8", "U16": "uint16",
    "U32": "uint32", "U64": "uint64", "BOOL": "bool",
}
"""File element types a destination must match exactly (others are raw blocks: uint8/int8)."""


QUOTED_PATH_CHARS = 256
"""A path quoted in a refusal is cut to this many characters (a 4,096-character path made a
4,140-character reason, over the protocol's MAX_STRING)."""


def quoted(path: object) -> str:
    """``path`` quoted for a message, cut to QUOTED_PATH_CHARS (its repr, with an ellipsis)."""
    text = str(path)
    if len(text) <= QUOTED_PATH_CHARS:
        return repr(text)
    return f"{text[:QUOTED_PATH_CHARS]!r}... ({len(text)} characters)"


class FileRefused(Exception):
    """A path, file or read the worker will not serve; the message says why."""


class FileMismatch(FileRefused):
    """The named file exists but is not the one the client has (its hash differs)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a model file: its type name, shape as the file lists it, byte range."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class FileKey:
    """Which version of a file a digest is of: a change of any field means hash again."""

    real: str
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, real: str, st: os.stat_result) -> FileKey:
        return cls(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What :func:`identify_open` learned about one version of a file."""

    path: str
    key: FileKey
    digest: bytes
    format: str
    tensors: dict[str, TensorInfo]

    @property
    def size(self) -> int:
        return self.key.size

    @property
    def mtime_ns(self) -> int:
        return self.key.mtime_ns


@dataclass(frozen=True, slots=True)
class OpenFile:
    """A confined model file, opened, whose identity is not known yet: whoever takes it hashes
    it (:func:`identify_open`) and closes ``fd``."""

    name: str
    key: FileKey
    fd: int


# ------------------------------------------------------------------------------ parsing


class _Reader:
    """Bounded little-endian reads from the start of a file."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.size, self.pos = fh, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise FileRefused(f"header runs past the end of the file (at byte {self.pos})")
        data = self.fh.read(n)
        self.pos += n
        return data

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        if n > MAX_HEADER:
            raise FileRefused(f"a header string of {n} bytes")
        return self.take(n).decode("utf-8", errors="replace")


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_gguf_value(r: _Reader, kind: int) -> Any:
    """Read (small scalars) or skip one metadata value of GGUF type ``kind``."""
    if kind in _GGUF_SCALARS:
        raw = r.take(_GGUF_SCALARS[kind])
        return int.from_bytes(raw, "little") if kind in (4, 5, 10, 11) else None
    if kind == 8:
        r.string()
        return None
    if kind != 9:
        raise FileRefused(f"unknown GGUF metadata type {kind}")
    inner, count = r.u32(), r.u64()
    if count > r.size:
        raise FileRefused(f"a GGUF array of {count} items")
    if inner in _GGUF_SCALARS:
        r.take(_GGUF_SCALARS[inner] * count)
    else:
        for _ in range(count):
            _skip_gguf_value(r, inner)
    return None


def parse_gguf(fh: BinaryIO, size: int) -> dict[str, TensorInfo]:
    """The tensor table of a GGUF v2/v3 file (absolute byte offsets, checked to lie inside)."""
    r = _Reader(fh, size)
    if r.take(4) != b"GGUF":
        raise FileRefused("not a GGUF file (bad magic)")
    version = r.u32()
    if version not in (2, 3):
        raise FileRefused(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors > MAX_TENSORS or n_kv > MAX_TENSORS:
        raise FileRefused(f"{n_tensors} tensors / {n_kv} metadata entries is over the limit")
    alignment = 32
    for _ in range(n_kv):
        key, kind = r.string(), r.u32()
        value = _skip_gguf_value(r, kind)
        if key == "general.alignment" and isinstance(value, int):
            alignment = value
    if not 1 <= alignment <= 1 << 20:
        raise FileRefused(f"GGUF alignment {alignment}")
    raw = [_gguf_tensor(r) for _ in range(n_tensors)]
    data_start = -(-r.pos // alignment) * alignment
    return {t.name: _placed(t, data_start, size) for t in raw}


def _gguf_tensor(r: _Reader) -> TensorInfo:
    name = r.string()
    n_dims = r.u32()
    if n_dims > 8:
        raise FileRefused(f"tensor {name[:80]!r}: {n_dims} dims")
    dims = tuple(r.u64() for _ in range(n_dims))
    type_id, offset = r.u32(), r.u64()
    if type_id not in GGML_TYPES:
        return TensorInfo(name, f"ggml type {type_id}", dims, offset, -1)
    kind, block, block_bytes = GGML_TYPES[type_id]
    if dims and dims[0] % block:
        raise FileRefused(f"tensor {name[:80]!r}: {dims[0]} elements per row is not a "
                          f"multiple of {kind}'s block of {block}")
    numel = math.prod(dims)
    return TensorInfo(name, kind, dims, offset, numel // block * block_bytes)


def _placed(t: TensorInfo, data_start: int, size: int) -> TensorInfo:
    offset = data_start + t.offset
    if t.nbytes >= 0 and not (offset <= size and t.nbytes <= size - offset):
        raise FileRefused(f"tensor {t.name[:80]!r} lies past the end of the file")
    return TensorInfo(t.name, t.kind, t.shape, offset, t.nbytes)


def parse_safetensors(fh: BinaryIO, size: int) -> dict[str, TensorInfo]:
    """The tensor table of a safetensors file (absolute byte offsets, checked to lie inside)."""
    r = _Reader(fh, size)
    n = r.u64()
    if n > min(MAX_HEADER, size - 8):
        raise FileRefused(f"safetensors header of {n} bytes")
    try:
        header = json.loads(r.take(n))
    except ValueError as exc:
        raise FileRefused(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FileRefused("safetensors header is not an object")
    tensors = {}
    for name, spec in header.items():
        if name != "__metadata__":
            tensors[name] = _safetensor(name, spec, 8 + n, size)
    return tensors


def _safetensor(name: str, spec: Any, data_start: int, size: int) -> TensorInfo:
    try:
        kind, shape, (lo, hi) = spec["dtype"], tuple(spec["shape"]), spec["data_offsets"]
        ok = (kind in SAFETENSORS_TYPES and all(type(d) is int and d >= 0 for d in shape)
              and type(lo) is int and type(hi) is int and 0 <= lo <= hi)
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise FileRefused(f"safetensors entry {name[:80]!r} is malformed")
    nbytes = math.prod(shape) * SAFETENSORS_TYPES[kind]
    if hi - lo != nbytes:
        raise FileRefused(f"safetensors entry {name[:80]!r}: {hi - lo} bytes for "
                          f"{list(shape)} {kind}")
    return _placed(TensorInfo(name, kind, shape, lo, nbytes), data_start, size)


def file_format(path: str) -> str:
    """"gguf" or "safetensors" by the file's name."""
    lower = path.lower()
    if lower.endswith(".gguf"):
        return "gguf"
    if lower.endswith(".safetensors"):
        return "safetensors"
    raise FileRefused(f"{quoted(path)} is neither .gguf nor .safetensors")


# ------------------------------------------------------------------------------ the files


class ModelFiles:
    """The ``--model-dir`` directories of one worker and what it knows about files there."""

    def __init__(self, dirs: Sequence[str]) -> None:
        self.roots = [os.path.realpath(d) for d in dirs]
        for root in self.roots:
            if not os.path.isdir(root):
                raise ValueError(f"--model-dir {root!r} is not a directory")
        self._known: dict[str, FileIdentity] = {}
        """Real path -> the identity of the version of it last hashed."""

    def resolve(self, name: str) -> str:
        """The real path of ``name`` (relative to a model directory, first match wins)."""
        if not self.roots:
            raise FileRefused("this worker serves no model files (start it with --model-dir)")
        if not name or "\0" in name or len(name) > MAX_NAME:
            raise FileRefused("a model file name must be a non-empty relative path")
        if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
            raise FileRefused(f"{quoted(name)}: absolute paths and '..' are refused; name a file "
                              "relative to a --model-dir")
        for root in self.roots:
            real = os.path.realpath(os.path.join(root, name))
            if not real.startswith(root + os.sep):
                raise FileRefused(f"{quoted(name)} leads out of the model directory (a symlink?)")
            if os.path.lexists(real):
                mode = os.lstat(real).st_mode
                if not stat.S_ISREG(mode):
                    raise FileRefused(f"{quoted(name)} is not a regular file")
                return real
        raise FileRefused(f"{quoted(name)} is not in this worker's model directories")

    def open(self, name: str) -> tuple[int, os.stat_result]:
        """An open descriptor of the resolved file, checked to be that regular file."""
        return self._open(self.resolve(name), name)

    @staticmethod
    def _open(real: str, name: str) -> tuple[int, os.stat_result]:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or os.stat(real).st_ino != st.st_ino:
            os.close(fd)
            raise FileRefused(f"{quoted(name)} changed while it was opened")
        return fd, st

    def identify(self, name: str) -> FileIdentity | OpenFile:
        """``name``'s identity when this version of the file was hashed already (the cache),
        else the open file for the hashing thread (:mod:`~.hasher`) to identify."""
        real = self.resolve(name)
        fd, st = self._open(real, name)
        key = FileKey.of(real, st)
        known = self._known.get(real)
        if known is not None and known.key == key:
            os.close(fd)
            return known
        return OpenFile(name, key, fd)

    def remember(self, ident: FileIdentity) -> None:
        """Keep ``ident`` (from the hashing thread) as what its path currently is."""
        self._known[ident.key.real] = ident


HASH_TRIES = 3
"""A file whose size, mtime or ctime moved while it was hashed is hashed again, up to this many
times in all; then the query is refused (the file is being written: ask when it is done)."""


def identify_open(file: OpenFile, stop: Callable[[], bool] | None = None) -> FileIdentity:
    """Tensor table and BLAKE3 of an open model file (a whole read: run it off the backend
    thread). Does not close ``file.fd``. Raises FileRefused (a bad header, a file that kept
    changing), OSError, or :class:`~zmq_rpc.worker.formats.hashing.HashCancelled` when ``stop`` says so."""
    for _ in range(HASH_TRIES):
        before = os.fstat(file.fd)
        ident = _identify_once(file, before, stop)
        after = os.fstat(file.fd)
        if _version(after) == _version(before):
            return ident
        log.info("model file %s changed while it was hashed; hashing it again", file.name)
    raise FileRefused(f"{quoted(file.name)} kept changing while it was hashed ({HASH_TRIES} tries): "
                      "ask again once it is written")


def _version(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _identify_once(file: OpenFile, st: os.stat_result,
                   stop: Callable[[], bool] | None) -> FileIdentity:
    from ..formats.hashing import file_digest

    fmt = file_format(file.name)
    with os.fdopen(os.dup(file.fd), "rb") as fh:   # shares the offset: an earlier try moved it
        fh.seek(0)
        tensors = (parse_gguf if fmt == "gguf" else parse_safetensors)(fh, st.st_size)
    digest = file_digest(file.fd, st.st_size, stop)
    log.info("model file %s: %d tensors, %d bytes, blake3 %s", file.name, len(tensors),
             st.st_size, digest.hex()[:16])
    return FileIdentity(file.name, FileKey.of(file.key.real, st), digest, fmt, tensors)


def check_digest(ident: FileIdentity, digest: bytes) -> FileIdentity:
    """``ident``, refused unless its hash is ``digest``."""
    if ident.digest != digest:
        raise FileMismatch(f"{quoted(ident.path)} on this worker is a different file (blake3 "
                           f"{ident.digest.hex()[:16]}..., the client has "
                           f"{digest.hex()[:16]}...)")
    return ident


def read_into(fd: int, offset: int, target: memoryview) -> None:
    """Fill ``target`` with the file's bytes from ``offset`` (short reads retried)."""
    done, total = 0, target.nbytes
    while done < total:
        n = os.preadv(fd, [target[done:done + READ_BLOCK]], offset + done)
        if n <= 0:
            raise FileRefused(f"the file ended at byte {offset + done} (truncated meanwhile?)")
        done += n
