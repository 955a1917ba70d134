"""A stage's staging buffer while a model loads: the record :mod:`.load` fills and :mod:`.source`
reads (which file ranges, cache entries or uploads fill it).

Plain data, on the caller's thread. A leaf of those two, so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..client import RemoteBuffer, RemoteTensor
from .plan import Stage


@dataclass(eq=False)
class Staged:
    """A stage's staging buffer during load: the GGUF tensors in it, the uploads filling it."""

    stage: Stage
    buffer: RemoteBuffer
    tensors: dict[str, RemoteTensor] = field(default_factory=dict)
    uploads: list[tuple[RemoteTensor, np.ndarray]] = field(default_factory=list)
