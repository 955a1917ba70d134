"""Picking the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Pure numpy on the caller's thread; no sockets, no model state.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sample_token"]


def sample_token(logits: np.ndarray, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 rng: np.random.Generator | None = None) -> int:
    """Pick a token from ``logits`` (vocab,): argmax when ``temperature <= 0``, else sample
    from the softmax of ``logits / temperature`` restricted to the ``top_k`` best (0: all) and to
    the smallest set whose probability reaches ``top_p``."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = np.asarray(logits, np.float64) / temperature
    if 0 < top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return int((rng or np.random.default_rng()).choice(probs.size, p=probs))


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs)
    keep = order[before < top_p]
    kept[keep] = probs[keep]
    kept /= kept.sum()
    return kept
