"""A compiled graph's planned node (:class:`Step`): what to run, on what, and where its result lives.

Plain data, made by :mod:`.execute` when it compiles a graph and read by :mod:`.bind`; a leaf of
the two, so that neither imports the other. The backend thread owns every instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...broker.ops import OpKind, TensorMeta

__all__ = ["Step"]


@dataclass
class Step:
    """One planned node: what to run, on what, and where its result lives."""

    op: str
    kind: OpKind
    srcs: tuple[int, ...]
    params: dict[str, Any]
    meta: TensorMeta
    in_metas: list[TensorMeta]
    dst: int
    slot: int = -1          # arena offset of its result (COMPUTE into scratch), else -1
    direct: bool = False    # COMPUTE straight into its dst tensor
