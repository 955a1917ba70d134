"""Test helper: the tiny deterministic GGUF of each architecture we load, in the test cache.

The files are :mod:`zmq_rpc.tools.synthetic_gguf`'s toy models (:data:`FAMILIES`: each family's
real structure at toy size, d_model 256, 4 heads of 64, FFN 512, 2-6 layers, Q4_K_M-like type
mixes inside a layer too, SmolLM2's GPT-2 vocabulary, random weights); the llama.cpp fixtures of
``tests/test_arch_oracle.py`` were recorded on exactly these bytes. Deterministic: the same family
gives the same bytes (seeded generator, gguf's writer).
"""

from __future__ import annotations

from pathlib import Path

from requantize import cache_dir
from zmq_rpc.tools.synthetic_gguf import FAMILIES, Family, write_family

__all__ = ["FAMILIES", "Family", "synthetic_path", "write_synthetic"]

VERSION = 3
"""Bumped whenever what a family writes changes (the cached file's name carries it)."""


def synthetic_path(name: str) -> Path:
    """The family's file in the test cache, written on first use."""
    path = cache_dir() / f"synthetic-{name}-v{VERSION}.gguf"
    if not path.exists():
        write_synthetic(name, path)
    return path


def write_synthetic(name: str, dst: Path) -> Path:
    """Write family ``name``'s toy GGUF to ``dst`` (atomically)."""
    return write_family(FAMILIES[name], dst, seed=sorted(FAMILIES).index(name) + 26)
