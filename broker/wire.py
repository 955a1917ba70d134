"""Leaf helpers for decoding untrusted wire values: safe descriptions for error messages.

Pure functions; any thread may call them. Nothing here imports another zmq_rpc module.

Every value decoded from the network may reach an error message. ``repr`` of such a value is an
attack surface: a 990-deep nested list makes it raise RecursionError, an 8 MiB list makes it slow
and the message huge. :func:`describe` never recurses and never returns more than ``limit``
characters, so a decoder can always name what it refused.
"""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]

_SCALARS = (bool, int, float, type(None))


def describe(value: Any, limit: int = 60) -> str:
    """A short, safe description of an untrusted value: scalars and strings shown (truncated),
    containers by type and length only. Never recurses, never raises, at most ``limit`` chars."""
    kind = type(value)
    if kind is int and not -(10**30) < value < 10**30:
        text = f"an int of {value.bit_length()} bits"
    elif kind in _SCALARS:
        text = repr(value)
    elif kind is str or kind is bytes:
        text = repr(value[:limit])
    elif kind in (list, tuple, dict):
        text = f"a {kind.__name__} of {len(value)} items"
    else:
        text = f"a {kind.__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."
