"""A fast, checked reader of GGUF container files (v2 and v3, little-endian): header, metadata
and tensor directory, over a read-only memory map.

The ``gguf`` package's ``GGUFReader`` builds a numpy memmap view for every field part: SmolLM2's
49,152 vocabulary strings and 48,900 merges cost it ~5 s. Here each string is one
``struct.unpack_from`` and one ``bytes.decode``, and numeric arrays are one ``np.frombuffer``.

Layout (all integers little-endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x     (string key, u32 type, value)       string = u64 length + UTF-8 bytes
    n_tensors x (string name, u32 n_dims, n_dims x u64 dims, u32 ggml type, u64 offset)
    padding to the alignment (general.alignment, default 32), then the tensor data

Every length and count is checked against the bytes left before it is used (a corrupt or
truncated file is a :class:`GGUFFormatError`, never a huge allocation or a read past the end).
No threads; the result is immutable.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

__all__ = ["GGUFFile", "GGUFFormatError", "TensorInfo", "read_gguf"]

MAGIC: Final = b"GGUF"
VERSIONS: Final = (2, 3)
MAX_DIMS: Final = 8

# value type -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS: Final[dict[int, tuple[str, str]]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (magic, version, bounds)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor directory entry: GGUF dims (innermost first), ggml type, absolute offset."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A parsed GGUF file: its version, metadata (plain Python values; arrays as lists),
    tensor directory, where the data starts, and the whole file as a read-only uint8 array."""

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    alignment: int
    data: np.ndarray


class _Cursor:
    """Reads values from ``buf`` at ``pos``, bounds-checked."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> int:
        """Advance by ``n`` bytes; the position they start at."""
        if n < 0 or n > len(self.buf) - self.pos:
            raise GGUFFormatError(f"{n} bytes at offset {self.pos} run past the end of the file "
                                  f"({len(self.buf)} bytes)")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at offset {start} is not UTF-8: {exc}") from None

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            value = self.unpack(_SCALARS[kind][0])
            return bool(value) if kind == _BOOL else value
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise GGUFFormatError(f"unknown value type {kind} at offset {self.pos - 4}")

    def array(self) -> list[Any]:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind in _SCALARS:
            fmt, dtype = _SCALARS[kind]
            size = struct.calcsize(fmt)
            if count > (len(self.buf) - self.pos) // size:
                raise GGUFFormatError(f"an array of {count} items at offset {self.pos} runs "
                                      "past the end of the file")
            start = self.take(count * size)
            items = np.frombuffer(self.buf, dtype, count, start)
            values: list[Any] = (items != 0).tolist() if kind == _BOOL else items.tolist()
            return values
        if count > len(self.buf) - self.pos:     # every item takes at least one byte
            raise GGUFFormatError(f"an array of {count} items at offset {self.pos} runs past "
                                  "the end of the file")
        if kind == _STRING:
            return self._strings(count)
        return [self.value(kind) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """``count`` strings: the hot loop of a vocabulary (one unpack and decode each)."""
        buf, end, pos, out = self.buf, len(self.buf), self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                if 8 > end - pos:
                    raise GGUFFormatError(f"a string length at offset {pos} runs past the end")
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise GGUFFormatError(f"a string of {n} bytes at offset {pos} runs past the "
                                          "end of the file")
                out.append(str(buf[pos:pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"a string at offset {pos} is not UTF-8: {exc}") from None
        self.pos = pos
        return out


def read_gguf(path: str | Path, default_alignment: int = 32) -> GGUFFile:
    """Memory-map ``path`` read-only and parse its header, metadata and tensor directory."""
    try:
        data = np.memmap(path, np.uint8, mode="r")
    except ValueError as exc:                # an empty file cannot be mapped
        raise GGUFFormatError(f"cannot map the file: {exc}") from None
    cursor = _Cursor(memoryview(data.data))  # parsed through the buffer, not numpy indexing
    version, n_tensors, n_kv = _header(cursor)
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = [_tensor_info(cursor) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", default_alignment)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = [TensorInfo(t.name, t.dims, t.ggml_type, data_offset + t.offset) for t in infos]
    return GGUFFile(version, metadata, tensors, data_offset, alignment, data)


def _header(cursor: _Cursor) -> tuple[int, int, int]:
    start = cursor.take(4)
    magic = bytes(cursor.buf[start:start + 4])
    if magic != MAGIC:
        raise GGUFFormatError(f"magic {magic!r} is not {MAGIC!r}")
    version = cursor.unpack("<I")
    if version not in VERSIONS:
        kind = "byte order differs from this host" if version & 0xFFFF == 0 else "unsupported"
        raise GGUFFormatError(f"GGUF version {version} ({kind}); this reader reads "
                              f"{' and '.join(map(str, VERSIONS))}")
    n_tensors, n_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
    left = len(cursor.buf) - cursor.pos
    if n_tensors > left or n_kv > left:
        raise GGUFFormatError(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in "
                              f"{left} bytes")
    return version, n_tensors, n_kv


def _tensor_info(cursor: _Cursor) -> TensorInfo:
    name = cursor.string()
    n_dims = cursor.unpack("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFormatError(f"tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS} allowed)")
    dims = tuple(cursor.unpack("<Q") for _ in range(n_dims))
    return TensorInfo(name, dims, cursor.unpack("<I"), cursor.unpack("<Q"))
