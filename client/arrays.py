"""Array helpers shared by the client's modules: bfloat16 bits, and landing fetched tensors.

Pure functions with no socket and no thread of their own (they run on whichever thread calls
them: the caller's, or the one that reads a reply).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import zmq

from ..broker import graph as wire_graph
from ..broker import protocol as p
from ..broker.protocol import DType, TensorRef


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even."""
    values = np.asarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class RunResult(list[np.ndarray]):
    """The arrays a graph run fetched, in ``fetch`` order, and how long the worker computed."""

    compute_seconds: float = 0.0


def fetched(fetch: Sequence[TensorRef]) -> Callable[[p.Message, list[zmq.Frame]], Any]:
    """The reply handler of a graph run that fetches the views ``fetch``: their arrays (a
    :class:`RunResult`)."""
    shapes = [(ref.shape, ref.dtype) for ref in fetch]

    def land(reply: p.Message, frames: list[zmq.Frame]) -> RunResult:
        arrays = RunResult()
        for (shape, dtype), frame in zip(shapes, frames):
            array = np.frombuffer(frame.buffer, dtype.storage).reshape(shape).copy()
            arrays.append(from_bfloat16(array) if dtype is DType.BFLOAT16 else array)
        arrays.compute_seconds = cast(wire_graph.GraphReply, reply).compute_ns / 1e9
        return arrays

    return land
