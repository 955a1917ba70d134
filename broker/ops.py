"""The op registry: shape, dtype and parameter rules for every graph op.

Owns the op set both ends agree on. The client calls :func:`infer` while it builds a graph, so a mistake
fails before anything is sent; the worker calls it again on every node it receives, before running it.
Pure Python over :class:`TensorMeta` (no numpy, no state), so any thread may call it.

Limits, so that a hostile graph gets an :class:`OpError` instead of a crash or a huge allocation:
rank <= 8, every dim in [0, 2**40), element count < 2**40, list params at most 8 long, at most 64 inputs.
Shapes use numpy order (last axis innermost). Compute ops return float32 unless their rule says otherwise;
float16, bfloat16 and integer inputs are upcast.

Params arrive from msgpack, so validators accept only ints, floats, bools, strings and lists of ints
(``bool`` is not an int; an int is accepted where a float is expected; NaN and infinities are refused).
:func:`infer` returns normalized params (defaults filled, axes made non-negative, ``-1`` resolved, lists
turned into tuples); feeding them back to :func:`infer` gives the same result, and kernels expect them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from .limits import DEFAULT_MAX_WORK, NODE_WORK
from .wire import describe

__all__ = [
    "DEFAULT_MAX_WORK",
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_RANK",
    "NODE_WORK",
    "OPS",
    "PACKED_BLOCKS",
    "QUANT_BLOCKS",
    "REQUIRED",
    "OpError",
    "OpKind",
    "OpSpec",
    "TensorMeta",
    "c_strides",
    "infer",
    "node_work",
    "view_span",
]

MAX_RANK: Final = 8
MAX_DIM: Final = 2**40
MAX_ELEMENTS: Final = 2**40
MAX_INPUTS: Final = 64
MAX_STRIDE: Final = 2**48  # bytes, either sign
MAX_OFFSET: Final = 2**52  # bytes

DTYPE_SIZES: Final[Mapping[str, int]] = MappingProxyType({
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "bool": 1,
})
FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16", "float64"})
INDEX_DTYPES: Final = frozenset({"int32", "int64"})
#: qtype -> (elements per block, bytes per block); ``broker.quant.BLOCK`` is a copy.
QUANT_BLOCKS: Final[Mapping[str, tuple[int, int]]] = MappingProxyType({"q8_0": (32, 34), "q4_1": (32, 20)})
#: qtype -> (weights per GGUF block, GGUF bytes per block, packed bytes per block and row) of the types
#: the ``pack`` op lays out for ``mul_mat_packed`` (``worker/kernels/layout.py`` draws the packed form).
PACKED_BLOCKS: Final[Mapping[str, tuple[int, int, int]]] = MappingProxyType({
    "f16": (1, 2, 2), "bf16": (1, 2, 2),
    "q8_0": (32, 34, 36), "q4_0": (32, 18, 20), "q4_1": (32, 20, 24),
    "q5_0": (32, 22, 24), "q5_1": (32, 24, 28),
    "q4_k": (256, 144, 152), "q5_k": (256, 176, 184), "q6_k": (256, 210, 212),
})


class OpError(ValueError):
    """A graph node breaks its op's shape, dtype or parameter rules."""


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What op rules know of a tensor: its shape, dtype name and whether it is C-contiguous."""

    shape: tuple[int, ...]
    dtype: str
    contiguous: bool = True

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes (storage dtype; bfloat16 is 2 bytes)."""
        return self.numel * DTYPE_SIZES[self.dtype]


class OpKind(enum.Enum):
    """How an op produces its result."""

    COMPUTE = "compute"  # into a fresh C-contiguous ``out`` the executor supplies
    VIEW = "view"  # a view of input 0; no data moves
    INPLACE = "inplace"  # writes into input ``dst_input``; the result is that input


class _Required:
    __slots__ = ()

    def __repr__(self) -> str:
        return "REQUIRED"


#: Default marking a param the caller must give.
REQUIRED: Final = _Required()

Validator = Callable[[object], object]
"""Checks one param value and returns it normalized; raises OpError (message without the param name)."""
Rule = Callable[[Sequence[TensorMeta], dict[str, object]], TensorMeta]
"""Checks the inputs against the normalized params (may refine them in place); returns the output meta."""


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op: its kind, arity, params (name -> (validator, default or REQUIRED)) and shape rule."""

    name: str
    kind: OpKind
    min_inputs: int
    max_inputs: int
    rule: Rule = field(repr=False, compare=False, hash=False)
    params: Mapping[str, tuple[Validator, object]] = field(default_factory=dict, hash=False)
    dst_input: int | None = None


# ---------------------------------------------------------------------------------------------- helpers


def _show(value: object) -> str:
    return describe(value)


def _check_shape(shape: object, what: str) -> None:
    if not isinstance(shape, tuple) or len(shape) > MAX_RANK:
        raise OpError(f"{what} shape must be a tuple of at most {MAX_RANK} dims, got {_show(shape)}")
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < MAX_DIM:
            raise OpError(f"{what} shape {_show(shape)}: dims must be ints in [0, 2**40)")
    if math.prod(shape) >= MAX_ELEMENTS:
        raise OpError(f"{what} shape {_show(shape)} has 2**40 or more elements")


def _check_meta(meta: object, what: str) -> None:
    if not isinstance(meta, TensorMeta):
        raise OpError(f"{what} must be a TensorMeta, got {type(meta).__name__}")
    _check_shape(meta.shape, what)
    if not isinstance(meta.dtype, str) or meta.dtype not in DTYPE_SIZES:
        raise OpError(f"{what} has unknown dtype {_show(meta.dtype)}")
    if not isinstance(meta.contiguous, bool):
        raise OpError(f"{what} contiguous flag must be a bool")


def _need_dtype(meta: TensorMeta, allowed: frozenset[str], what: str) -> None:
    if meta.dtype not in allowed:
        raise OpError(f"{what} dtype {meta.dtype} is not allowed (expected one of {sorted(allowed)})")


def _need_rank(meta: TensorMeta, lo: int, hi: int, what: str) -> None:
    if not lo <= len(meta.shape) <= hi:
        want = f"rank {lo}" if lo == hi else f"rank in [{lo}, {hi}]"
        raise OpError(f"{what} must have {want}, got shape {meta.shape}")


def _need_contiguous(meta: TensorMeta, what: str) -> None:
    if not meta.contiguous:
        raise OpError(f"{what} must be contiguous (insert a cont op first)")


def _norm_axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise OpError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank


def _broadcast(a: tuple[int, ...], b: tuple[int, ...], what: str) -> tuple[int, ...]:
    n = max(len(a), len(b))
    pa, pb = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(pa, pb, strict=True):
        if x != y and x != 1 and y != 1:
            raise OpError(f"{what}: shapes {a} and {b} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)


def _quant_width(row_bytes: int, qtype: str, what: str) -> int:
    per_block, block_bytes = QUANT_BLOCKS[qtype]
    if row_bytes % block_bytes:
        raise OpError(f"{what} last dim {row_bytes} is not a multiple of the {qtype} block size ({block_bytes} bytes)")
    return row_bytes // block_bytes * per_block


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _is_c_contiguous(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    if 0 in shape:
        return True
    want = c_strides(shape, itemsize)
    return all(n == 1 or s == w for n, s, w in zip(shape, strides, want, strict=True))


def view_span(shape: Sequence[int], strides: Sequence[int], offset: int, itemsize: int) -> tuple[int, int] | None:
    """Byte range ``[lo, hi)`` a strided view can touch, or None when it has no elements.

    Python ints do not overflow, so the caller's ``0 <= lo and hi <= nbytes`` is exact.
    """
    if 0 in shape:
        return None
    lo = hi = offset
    for n, s in zip(shape, strides, strict=True):
        reach = s * (n - 1)
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + itemsize


# ------------------------------------------------------------------------------------------- validators


def _check_int(value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpError(f"must be an int, got {_show(value)}")
    if not lo <= value <= hi:
        raise OpError(f"must be in [{lo}, {hi}], got {value}")
    return int(value)


def _check_int_list(value: object, lo: int, hi: int, max_len: int = MAX_RANK) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) > max_len:
        raise OpError(f"must be a list of at most {max_len} ints, got {_show(value)}")
    return tuple(_check_int(v, lo, hi) for v in value)


def _int(lo: int, hi: int) -> Validator:
    return lambda value: _check_int(value, lo, hi)


def _int_list(lo: int, hi: int) -> Validator:
    return lambda value: _check_int_list(value, lo, hi)


def _float(lo: float = -math.inf, hi: float = math.inf, *, positive: bool = False) -> Validator:
    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise OpError(f"must be a float, got {_show(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise OpError(f"must be a finite float, got {_show(value)}") from None
        if not math.isfinite(number):
            raise OpError(f"must be a finite float, got {number}")
        if not lo <= number <= hi or (positive and number <= 0):
            raise OpError(f"must be {'> 0 and ' if positive else ''}in [{lo}, {hi}], got {number}")
        return number

    return check


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise OpError(f"must be a bool, got {_show(value)}")
    return value


def _choice(*options: str) -> Validator:
    def check(value: object) -> str:
        if not isinstance(value, str) or value not in options:
            raise OpError(f"must be one of {list(options)}, got {_show(value)}")
        return value

    return check


def _axes(value: object) -> tuple[int, ...]:
    """An int or a list of ints, each in [-8, 8); the rule checks them against the rank."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    return _check_int_list(value, -MAX_RANK, MAX_RANK - 1)


def _pint(p: Mapping[str, object], name: str) -> int:
    value = p[name]
    if not isinstance(value, int):
        raise OpError(f"param {name!r} must be an int")  # unreachable after validation
    return value


def _pints(p: Mapping[str, object], name: str) -> tuple[int, ...]:
    value = p[name]
    if not isinstance(value, tuple):
        raise OpError(f"param {name!r} must be a tuple of ints")  # unreachable after validation
    return value


def _normalize_params(spec: OpSpec, params: object) -> dict[str, object]:
    if not isinstance(params, Mapping):
        raise OpError(f"params must be a mapping, got {type(params).__name__}")
    for name in params:
        if name not in spec.params:
            raise OpError(f"unknown param {_show(name)} (takes {sorted(spec.params) or 'no params'})")
    out: dict[str, object] = {}
    for name, (check, default) in spec.params.items():
        if name in params:
            try:
                out[name] = check(params[name])
            except OpError as exc:
                raise OpError(f"param {name!r} {exc}") from None
        elif default is REQUIRED:
            raise OpError(f"missing required param {name!r}")
        else:
            out[name] = default
    return out


# ------------------------------------------------------------------------------------------------ rules


def _unary(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    return TensorMeta(ins[0].shape, "float32")


def _float_unary(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    _need_dtype(ins[0], FLOAT_DTYPES, "input 0")
    _need_rank(ins[0], 1, MAX_RANK, "input 0")
    return TensorMeta(ins[0].shape, "float32")


def _binary(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    return TensorMeta(_broadcast(ins[0].shape, ins[1].shape, "inputs"), "float32")


def _matmul(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    a, b = ins[0].shape, ins[1].shape
    if not a or not b:
        raise OpError(f"inputs must have rank >= 1, got {a} and {b}")
    if p["transpose_b"]:
        if len(b) < 2:
            raise OpError(f"transpose_b needs input 1 of rank >= 2, got {b}")
        b = b[:-2] + (b[-1], b[-2])
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise OpError(f"inner dims differ: {ins[0].shape} @ {b} (after transpose_b)")
    shape = _broadcast(a2[:-2], b2[:-2], "batch dims")
    shape += (a2[-2],) if len(a) > 1 else ()
    shape += (b2[-1],) if len(b) > 1 else ()
    return TensorMeta(shape, "float32")


def _get_rows(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    table, idx = ins
    _need_rank(table, 2, 2, "table")
    _need_rank(idx, 0, MAX_RANK - 1, "idx")
    _need_dtype(idx, INDEX_DTYPES, "idx")
    qtype = str(p["qtype"])
    if qtype == "none":
        _need_dtype(table, FLOAT_DTYPES, "table")
        width = table.shape[1]
    else:
        _need_dtype(table, frozenset({"uint8"}), f"{qtype} table")
        width = _quant_width(table.shape[1], qtype, "table")
    return TensorMeta(idx.shape + (width,), "float32")


def _layer_norm(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """Inputs: x, then optionally weight (d,), then optionally bias (d,); a bias needs a weight."""
    out = _float_unary(ins, p)
    for i, name in enumerate(("weight", "bias"), start=1):
        if len(ins) > i:
            _need_dtype(ins[i], FLOAT_DTYPES, name)
            if ins[i].shape != out.shape[-1:]:
                raise OpError(f"{name} shape {ins[i].shape} must be {out.shape[-1:]}")
    return out


def _soft_max(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    out = _float_unary(ins, p)
    if len(ins) > 1:
        _need_dtype(ins[1], FLOAT_DTYPES, "mask")
        if _broadcast(out.shape, ins[1].shape, "mask") != out.shape:
            raise OpError(f"mask shape {ins[1].shape} does not broadcast to x shape {out.shape}")
    return out


def _rope(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """x (..., T, H, D), pos (T,) and, from protocol 1.11 (capability ``rope-factors``), an
    optional freq_factors (n_dims / 2,) dividing each frequency (ggml_rope_ext's ``c``: Llama 3.x
    rope scaling)."""
    x, pos = ins[:2]
    _need_dtype(x, FLOAT_DTYPES, "x")
    _need_rank(x, 3, MAX_RANK, "x (..., T, H, D)")
    _need_dtype(pos, INDEX_DTYPES, "pos")
    if pos.shape != x.shape[-3:-2]:
        raise OpError(f"pos shape {pos.shape} must be (T,) = {x.shape[-3:-2]} for x {x.shape}")
    n_dims = p["n_dims"]
    if not isinstance(n_dims, int) or n_dims % 2 or n_dims > x.shape[-1]:
        raise OpError(f"n_dims {n_dims} must be even and <= head size {x.shape[-1]}")
    if len(ins) > 2:
        _need_dtype(ins[2], FLOAT_DTYPES, "freq_factors")
        if ins[2].shape != (n_dims // 2,):
            raise OpError(f"freq_factors shape {ins[2].shape} must be (n_dims / 2,) = "
                          f"({n_dims // 2},)")
    return TensorMeta(x.shape, "float32")


def _attention(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """q (T, H, D), k and v (S, H_kv, D) with H a multiple of H_kv, optional mask broadcasting
    to (T, S) -> float32 (T, H, D) (protocol 1.7, capability ``fused-ops``)."""
    q, k, v = ins[:3]
    for meta, name in ((q, "q"), (k, "k"), (v, "v")):
        _need_dtype(meta, FLOAT_DTYPES, name)
        _need_rank(meta, 3, 3, f"{name} (rows, heads, head size)")
    if k.shape != v.shape:
        raise OpError(f"k shape {k.shape} != v shape {v.shape}")
    if k.shape[2] != q.shape[2]:
        raise OpError(f"head size of q {q.shape} != that of k {k.shape}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise OpError(f"q heads {q.shape[1]} must be a multiple of k heads {k.shape[1]} (>= 1)")
    if len(ins) > 3:
        _need_dtype(ins[3], FLOAT_DTYPES, "mask")
        _need_rank(ins[3], 1, 2, "mask")
        rows = (q.shape[0], k.shape[0])
        if _broadcast(rows, ins[3].shape, "mask") != rows:
            raise OpError(f"mask shape {ins[3].shape} does not broadcast to (T, S) = {rows}")
    return TensorMeta(q.shape, "float32")


def _attend_rows(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """q (B, H, D) float32, k_cache and v_cache (R, H_kv, D) float32 or float16 with H a multiple
    of H_kv, pos (B,) and base (B,) int32 -> float32 (B, H, D) (protocol 1.12, capability
    ``row-attention``). Row b attends to the cache rows ``base[b] + j`` for ``j`` in
    ``[max(0, pos[b] - window + 1) if window else 0, pos[b]]``; ``pos[b] < 0`` is a padding row
    (zeros). The worker checks ``0 <= base[b]`` and ``base[b] + pos[b] < R`` when it runs."""
    q, k, v, pos, base = ins
    _need_dtype(q, frozenset({"float32"}), "q")
    _need_rank(q, 3, 3, "q (rows, heads, head size)")
    for meta, name in ((k, "k_cache"), (v, "v_cache")):
        _need_dtype(meta, frozenset({"float32", "float16"}), name)
        _need_rank(meta, 3, 3, f"{name} (cache rows, kv heads, head size)")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise OpError(f"k_cache {k.shape} {k.dtype} != v_cache {v.shape} {v.dtype}")
    if k.shape[2] != q.shape[2]:
        raise OpError(f"head size of q {q.shape} != that of k_cache {k.shape}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise OpError(f"q heads {q.shape[1]} must be a multiple of k_cache heads {k.shape[1]} (>= 1)")
    for meta, name in ((pos, "pos"), (base, "base")):
        _need_dtype(meta, frozenset({"int32"}), name)
        if meta.shape != q.shape[:1]:
            raise OpError(f"{name} shape {meta.shape} must be (B,) = {q.shape[:1]} for q {q.shape}")
    return TensorMeta(q.shape, "float32")


def _sample_rows(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """logits (B, V) float32, temperature (B,) float32, top_k (B,) int32, top_p (B,) float32,
    seed (B,) uint32, counter (B,) int32 -> int32 (B,) token ids (protocol 1.12, capability
    ``row-attention``; the draw is specified in ``worker/backends/numpy_ops.py``'s
    ``_sample_rows``)."""
    logits = ins[0]
    _need_dtype(logits, frozenset({"float32"}), "logits")
    _need_rank(logits, 2, 2, "logits (rows, vocabulary)")
    if not 0 < logits.shape[1] < 2**31:
        raise OpError(f"vocabulary size must be in [1, 2**31), got {logits.shape[1]}")
    for meta, (name, dtype) in zip(ins[1:], _SAMPLE_INPUTS, strict=True):
        _need_dtype(meta, frozenset({dtype}), name)
        if meta.shape != logits.shape[:1]:
            raise OpError(f"{name} shape {meta.shape} must be (B,) = {logits.shape[:1]}")
    return TensorMeta(logits.shape[:1], "int32")


_SAMPLE_INPUTS: Final = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"),
                         ("seed", "uint32"), ("counter", "int32"))


def _causal_mask(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """pos (T,) int32 -> float32 (T, n_ctx), the additive attention mask of T query rows at those
    positions over n_ctx cache rows (protocol 1.13, capability ``causal-mask``): row t is 0 for
    the keys ``j <= pos[t]`` (and ``pos[t] - j < window`` where window > 0: llama.cpp hides key
    p0 from query p1 when p1 - p0 >= window) and -inf elsewhere; a row whose position is outside
    ``[0, n_ctx)`` (a padding row) is -inf throughout. Built on the worker, so no mask row
    crosses the wire."""
    pos = ins[0]
    _need_dtype(pos, frozenset({"int32"}), "pos")
    _need_rank(pos, 1, 1, "pos (T,)")
    n_ctx = p["n_ctx"]
    if not isinstance(n_ctx, int):        # the param's validator made it one
        raise OpError(f"n_ctx {n_ctx!r} must be an int")
    return TensorMeta((pos.shape[0], n_ctx), "float32")


def _swiglu(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """x (..., 2n) -> float32 (..., n): silu of the first half times the second (protocol 1.7)."""
    x = ins[0]
    _need_dtype(x, FLOAT_DTYPES, "input 0")
    _need_rank(x, 1, MAX_RANK, "input 0")
    _need_contiguous(x, "input 0")
    if x.shape[-1] % 2:
        raise OpError(f"last dim {x.shape[-1]} must be even (gate and up halves)")
    return TensorMeta(x.shape[:-1] + (x.shape[-1] // 2,), "float32")


def _same_dtype_or_f32(ins: Sequence[TensorMeta]) -> str:
    dtypes = {m.dtype for m in ins}
    return dtypes.pop() if len(dtypes) == 1 else "float32"


def _concat(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    rank = len(ins[0].shape)
    if rank == 0:
        raise OpError("inputs must have rank >= 1")
    axis = _norm_axis(_pint(p, "axis"), rank, "axis")
    p["axis"] = axis
    total = 0
    for i, m in enumerate(ins):
        if len(m.shape) != rank or m.shape[:axis] + m.shape[axis + 1:] != ins[0].shape[:axis] + ins[0].shape[axis + 1:]:
            raise OpError(f"input {i} shape {m.shape} does not match {ins[0].shape} outside axis {axis}")
        total += m.shape[axis]
    shape = ins[0].shape[:axis] + (total,) + ins[0].shape[axis + 1:]
    return TensorMeta(shape, _same_dtype_or_f32(ins))


def _reduce(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    shape = ins[0].shape
    given = _pints(p, "axis")
    axes = tuple(sorted({_norm_axis(a, len(shape), "axis") for a in given}))
    if len(axes) != len(given):
        raise OpError(f"axis {p['axis']} repeats an axis")
    p["axis"] = axes
    if p["keepdims"]:
        return TensorMeta(tuple(1 if i in axes else n for i, n in enumerate(shape)), "float32")
    return TensorMeta(tuple(n for i, n in enumerate(shape) if i not in axes), "float32")


def _argmax(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    x = ins[0]
    _need_rank(x, 1, MAX_RANK, "input 0")
    if not 0 < x.shape[-1] < 2**31:
        raise OpError(f"last dim must be in [1, 2**31), got {x.shape[-1]}")
    return TensorMeta(x.shape[:-1], "int32")


def _diag_mask_inf(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    _need_dtype(ins[0], FLOAT_DTYPES, "input 0")
    _need_rank(ins[0], 2, MAX_RANK, "input 0 (..., T, S)")
    return TensorMeta(ins[0].shape, "float32")


def _dequantize(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    q = ins[0]
    _need_dtype(q, frozenset({"uint8"}), "input 0")
    _need_rank(q, 1, MAX_RANK, "input 0")
    width = _quant_width(q.shape[-1], str(p["qtype"]), "input 0")
    return TensorMeta(q.shape[:-1] + (width,), "float32")


def _mul_mat_q(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    x, wq = ins
    _need_dtype(x, FLOAT_DTYPES, "x")
    _need_rank(x, 1, MAX_RANK, "x")
    _need_dtype(wq, frozenset({"uint8"}), "wq")
    _need_rank(wq, 2, 2, "wq (out, in_bytes)")
    width = _quant_width(wq.shape[1], str(p["qtype"]), "wq")
    if width != x.shape[-1]:
        raise OpError(f"x last dim {x.shape[-1]} != wq input width {width} (wq shape {wq.shape})")
    return TensorMeta(x.shape[:-1] + wq.shape[:1], "float32")


def _pack(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """GGUF weight (R, row bytes) uint8, or (R, K) float16/bfloat16 -> packed uint8 (R, packed row bytes)."""
    w, qtype = ins[0], str(p["qtype"])
    _need_rank(w, 2, 2, "weight (rows, row)")
    _, gguf_bytes, packed_bytes = PACKED_BLOCKS[qtype]
    want = {"f16": {"float16", "uint16"}, "bf16": {"bfloat16", "uint16"}}.get(qtype, {"uint8"})
    _need_dtype(w, frozenset(want), f"{qtype} weight")
    row = w.shape[1] * DTYPE_SIZES[w.dtype]
    if row == 0 or row % gguf_bytes:
        raise OpError(f"weight rows of {row} bytes are not whole {qtype} blocks of {gguf_bytes} bytes")
    return TensorMeta((w.shape[0], row // gguf_bytes * packed_bytes), "uint8")


def _packed_width(wp: TensorMeta, qtype: str, what: str) -> int:
    """Inputs per row of a packed weight (uint8, 2-D, contiguous: its bytes are not row-major)."""
    _need_dtype(wp, frozenset({"uint8"}), what)
    _need_rank(wp, 2, 2, f"{what} (rows, packed row bytes)")
    _need_contiguous(wp, what)
    per_block, _, packed_bytes = PACKED_BLOCKS[qtype]
    if wp.shape[1] == 0 or wp.shape[1] % packed_bytes:
        raise OpError(f"{what} rows of {wp.shape[1]} bytes are not whole packed {qtype} blocks "
                      f"of {packed_bytes} bytes")
    return wp.shape[1] // packed_bytes * per_block


def _unpack(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    """Packed weight -> float32 (rows, K)."""
    return TensorMeta((ins[0].shape[0], _packed_width(ins[0], str(p["qtype"]), "input 0")), "float32")


def _get_rows_packed(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    table, idx = ins
    _need_rank(idx, 0, MAX_RANK - 1, "idx")
    _need_dtype(idx, INDEX_DTYPES, "idx")
    return TensorMeta(idx.shape + (_packed_width(table, str(p["qtype"]), "table"),), "float32")


def _mul_mat_packed(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    x, wp = ins
    _need_dtype(x, FLOAT_DTYPES, "x")
    _need_rank(x, 1, MAX_RANK, "x")
    width = _packed_width(wp, str(p["qtype"]), "wp")
    if width != x.shape[-1]:
        raise OpError(f"x last dim {x.shape[-1]} != wp input width {width} (wp shape {wp.shape})")
    return TensorMeta(x.shape[:-1] + wp.shape[:1], "float32")


def _cont(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    return TensorMeta(ins[0].shape, ins[0].dtype)


# ----------------------------------------------------------------------------------------- view rules


def _reshape(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    x = ins[0]
    _need_contiguous(x, "input 0")
    shape = _pints(p, "shape")
    if shape.count(-1) > 1:
        raise OpError(f"shape {shape} has more than one -1")
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape:
        if known == 0 or x.numel % known:
            raise OpError(f"cannot infer the -1 in {shape} for {x.numel} elements")
        shape = tuple(x.numel // known if n == -1 else n for n in shape)
    if math.prod(shape) != x.numel:
        raise OpError(f"shape {shape} does not hold the {x.numel} elements of {x.shape}")
    p["shape"] = shape
    return TensorMeta(shape, x.dtype)


def _view(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    x = ins[0]
    _need_contiguous(x, "input 0")
    shape = _pints(p, "shape")
    strides = _pints(p, "strides")
    offset = _pint(p, "offset")
    size = DTYPE_SIZES[x.dtype]
    if len(strides) != len(shape):
        raise OpError(f"strides {strides} and shape {shape} differ in length")
    if offset % size or any(s % size for s in strides):
        raise OpError(f"offset {offset} and strides {strides} must be multiples of the item size {size}")
    span = view_span(shape, strides, offset, size)
    lo, hi = span if span is not None else (offset, offset)
    if lo < 0 or hi > x.nbytes:
        raise OpError(f"view reaches bytes [{lo}, {hi}) outside the {x.nbytes}-byte input")
    return TensorMeta(shape, x.dtype, _is_c_contiguous(shape, strides, size))


def _permuted(x: TensorMeta, axes: Sequence[int]) -> TensorMeta:
    shape = tuple(x.shape[a] for a in axes)
    if not x.contiguous:  # conservative: may be contiguous again, but we cannot tell
        return TensorMeta(shape, x.dtype, False)
    strides = c_strides(x.shape, 1)
    return TensorMeta(shape, x.dtype, _is_c_contiguous(shape, [strides[a] for a in axes], 1))


def _permute(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    x = ins[0]
    axes = _pints(p, "axes")
    rank = len(x.shape)
    normal = tuple(_norm_axis(a, rank, "axis") for a in axes)
    if sorted(normal) != list(range(rank)):
        raise OpError(f"axes {axes} is not a permutation of {rank} axes")
    p["axes"] = normal
    return _permuted(x, normal)


def _transpose(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    _need_rank(ins[0], 2, MAX_RANK, "input 0")
    rank = len(ins[0].shape)
    return _permuted(ins[0], (*range(rank - 2), rank - 1, rank - 2))


# -------------------------------------------------------------------------------------- in-place rules


def _cpy(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    src, dst = ins
    same_count = src.contiguous and dst.contiguous and src.numel == dst.numel
    if src.shape != dst.shape and not same_count:
        raise OpError(
            f"src shape {src.shape} != dst shape {dst.shape} "
            "(different shapes need both contiguous and the same element count)"
        )
    return dst


def _set_rows(ins: Sequence[TensorMeta], p: dict[str, object]) -> TensorMeta:
    dst, src, idx = ins
    _need_rank(dst, 1, MAX_RANK, "dst")
    _need_dtype(idx, INDEX_DTYPES, "idx")
    if len(src.shape) != len(dst.shape) or src.shape[1:] != dst.shape[1:]:
        raise OpError(f"src shape {src.shape} must be (k,) + dst row shape {dst.shape[1:]}")
    if idx.shape != src.shape[:1]:
        raise OpError(f"idx shape {idx.shape} must be {src.shape[:1]} (one index per src row)")
    return dst


# ------------------------------------------------------------------------------------------ the table

_NO_PARAMS: Mapping[str, tuple[Validator, object]] = {}
_QTYPE = _choice(*QUANT_BLOCKS)
_PACKED_QTYPE = _choice(*PACKED_BLOCKS)
_EPS = (_float(0.0), REQUIRED)
_UNARY = ("neg", "abs", "sqr", "sqrt", "exp", "log", "tanh", "relu", "silu", "sigmoid")
_BINARY = ("add", "sub", "mul", "div")
_COMPUTE, _VIEW, _INPLACE = OpKind.COMPUTE, OpKind.VIEW, OpKind.INPLACE


def _spec(name: str, kind: OpKind, arity: tuple[int, int], rule: Rule,
          params: Mapping[str, tuple[Validator, object]] = _NO_PARAMS, dst: int | None = None) -> OpSpec:
    return OpSpec(name, kind, arity[0], arity[1], rule, MappingProxyType(dict(params)), dst)


_SPECS = [
    *(_spec(name, _COMPUTE, (1, 1), _unary) for name in _UNARY),
    *(_spec(name, _COMPUTE, (2, 2), _binary) for name in _BINARY),
    _spec("scale", _COMPUTE, (1, 1), _unary, {"s": (_float(), REQUIRED), "b": (_float(), 0.0)}),
    _spec("gelu", _COMPUTE, (1, 1), _unary, {"approximate": (_choice("tanh", "erf"), "tanh")}),
    _spec("get_rows", _COMPUTE, (2, 2), _get_rows, {"qtype": (_choice("none", *QUANT_BLOCKS), "none")}),
    _spec("matmul", _COMPUTE, (2, 2), _matmul, {"transpose_b": (_bool, False)}),
    _spec("rms_norm", _COMPUTE, (1, 1), _float_unary, {"eps": _EPS}),
    _spec("layer_norm", _COMPUTE, (1, 3), _layer_norm, {"eps": _EPS}),
    _spec("soft_max", _COMPUTE, (1, 2), _soft_max, {"scale": (_float(), 1.0)}),
    _spec("rope", _COMPUTE, (2, 3), _rope, {
        "n_dims": (_int(2, MAX_DIM), REQUIRED),
        "mode": (_choice("normal", "neox"), "normal"),
        "freq_base": (_float(positive=True), 10000.0),
        "freq_scale": (_float(), 1.0),
    }),
    _spec("attention", _COMPUTE, (3, 4), _attention, {"scale": (_float(), 1.0)}),
    _spec("swiglu", _COMPUTE, (1, 1), _swiglu),
    _spec("attend_rows", _COMPUTE, (5, 5), _attend_rows, {
        "scale": (_float(), 1.0),
        "window": (_int(0, MAX_DIM), 0),
    }),
    _spec("sample_rows", _COMPUTE, (6, 6), _sample_rows),
    _spec("causal_mask", _COMPUTE, (1, 1), _causal_mask, {
        "n_ctx": (_int(1, MAX_DIM), REQUIRED),
        "window": (_int(0, MAX_DIM), 0),
    }),
    _spec("cont", _COMPUTE, (1, 1), _cont),
    _spec("concat", _COMPUTE, (1, MAX_INPUTS), _concat, {"axis": (_int(-MAX_RANK, MAX_RANK - 1), REQUIRED)}),
    _spec("sum", _COMPUTE, (1, 1), _reduce, {"axis": (_axes, REQUIRED), "keepdims": (_bool, False)}),
    _spec("mean", _COMPUTE, (1, 1), _reduce, {"axis": (_axes, REQUIRED), "keepdims": (_bool, False)}),
    _spec("argmax", _COMPUTE, (1, 1), _argmax),
    _spec("diag_mask_inf", _COMPUTE, (1, 1), _diag_mask_inf, {"n_past": (_int(0, MAX_DIM), REQUIRED)}),
    _spec("dequantize", _COMPUTE, (1, 1), _dequantize, {"qtype": (_QTYPE, REQUIRED)}),
    _spec("mul_mat_q", _COMPUTE, (2, 2), _mul_mat_q, {"qtype": (_QTYPE, REQUIRED)}),
    _spec("pack", _COMPUTE, (1, 1), _pack, {"qtype": (_PACKED_QTYPE, REQUIRED)}),
    _spec("mul_mat_packed", _COMPUTE, (2, 2), _mul_mat_packed, {"qtype": (_PACKED_QTYPE, REQUIRED)}),
    _spec("unpack", _COMPUTE, (1, 1), _unpack, {"qtype": (_PACKED_QTYPE, REQUIRED)}),
    _spec("get_rows_packed", _COMPUTE, (2, 2), _get_rows_packed, {"qtype": (_PACKED_QTYPE, REQUIRED)}),
    _spec("reshape", _VIEW, (1, 1), _reshape, {"shape": (_int_list(-1, MAX_DIM - 1), REQUIRED)}),
    _spec("view", _VIEW, (1, 1), _view, {
        "shape": (_int_list(0, MAX_DIM - 1), REQUIRED),
        "strides": (_int_list(-MAX_STRIDE, MAX_STRIDE), REQUIRED),
        "offset": (_int(0, MAX_OFFSET), 0),
    }),
    _spec("permute", _VIEW, (1, 1), _permute, {"axes": (_int_list(-MAX_RANK, MAX_RANK - 1), REQUIRED)}),
    _spec("transpose", _VIEW, (1, 1), _transpose),
    _spec("cpy", _INPLACE, (2, 2), _cpy, dst=1),
    _spec("set_rows", _INPLACE, (3, 3), _set_rows, dst=0),
]

#: Every op, by name.
OPS: Final[Mapping[str, OpSpec]] = MappingProxyType({spec.name: spec for spec in _SPECS})


def infer(op: str, inputs: Sequence[TensorMeta], params: Mapping[str, object]) -> tuple[TensorMeta, dict[str, object]]:
    """Validate one node and return its output meta and normalized params.

    Checks the op name, the number of inputs, every input meta against the global limits, each param
    (unknown names, types, ranges; defaults filled in) and the op's shape and dtype rules.
    Raises OpError with a message naming the op and what is wrong.
    """
    spec = OPS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise OpError(f"unknown op {_show(op)}")
    try:
        return _infer(spec, inputs, params)
    except OpError as exc:
        raise OpError(f"{op}: {exc}") from None


def _infer(spec: OpSpec, inputs: Sequence[TensorMeta], params: object) -> tuple[TensorMeta, dict[str, object]]:
    if not isinstance(inputs, Sequence) or not spec.min_inputs <= len(inputs) <= spec.max_inputs:
        count = len(inputs) if isinstance(inputs, Sequence) else "?"
        raise OpError(f"takes {spec.min_inputs}..{spec.max_inputs} inputs, got {count}")
    for i, meta in enumerate(inputs):
        _check_meta(meta, f"input {i}")
    normalized = _normalize_params(spec, params)
    out = spec.rule(inputs, normalized)
    _check_shape(out.shape, "output")
    return out, normalized


# -------------------------------------------------------------------------------------------- work

MAC_WEIGHT: Final = 32
"""Multiply-adds of a product that cost as much as one element-op of an elementwise kernel (BLAS
runs ~25-50 of them in the time numpy's loops read and write one element, on this kind of CPU)."""


def node_work(op: str, inputs: Sequence[TensorMeta], out: TensorMeta) -> int:
    """Element-ops one node asks for: :data:`NODE_WORK` for being a node, every element it reads
    or writes (a view's logical elements, however few bytes back them), plus its multiply-adds /
    :data:`MAC_WEIGHT`. Views move no data (they count only as nodes).

    A worker bounds the sum over a graph before running it, so a tiny request (a zero-stride view
    naming 2**39 elements, a 65,536-node chain of big adds) cannot hold its backend thread for
    minutes."""
    return NODE_WORK + _data_work(op, inputs, out)


def _data_work(op: str, inputs: Sequence[TensorMeta], out: TensorMeta) -> int:
    """The elements a node reads and writes, and its multiply-adds / MAC_WEIGHT."""
    spec = OPS[op]
    if spec.kind is OpKind.VIEW:
        return 0
    if op in ("get_rows", "get_rows_packed"):
        return out.numel + inputs[1].numel
    if op == "set_rows":
        return 2 * inputs[1].numel + inputs[2].numel
    if op in ("attend_rows", "sample_rows"):
        return _row_work(op, inputs, out)
    work = out.numel + sum(m.numel for m in inputs)
    if op in ("matmul", "mul_mat_q", "mul_mat_packed"):
        work += out.numel * inputs[0].shape[-1] // MAC_WEIGHT
    if op == "attention":   # two products over every key: q k^T and p v
        scores = out.shape[0] * out.shape[1] * inputs[1].shape[0]
        work += 2 * scores * out.shape[2] // MAC_WEIGHT + scores
    return work


def _row_work(op: str, inputs: Sequence[TensorMeta], out: TensorMeta) -> int:
    """attend_rows: the cache rows each query row can reach (at most all R of them: the params'
    window and the positions are not known here), read for each KV head, and two products per
    head and row over them; not the whole cache per row. sample_rows: the logits, and a sort's
    ``V log V`` per row (the nucleus of a flat distribution)."""
    if op == "sample_rows":
        rows, vocab = inputs[0].shape
        return out.numel + sum(m.numel for m in inputs) + rows * vocab * max(1, vocab.bit_length())
    rows, heads, dim = out.shape
    reach = rows * inputs[1].shape[0]                     # (query row, cache row) pairs
    scores = reach * heads
    return (2 * out.numel + 2 * rows + 2 * reach * inputs[1].shape[1] * dim
            + 2 * scores * dim // MAC_WEIGHT + scores)
