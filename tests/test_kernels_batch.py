"""Batch invariance of the packed products (``worker/kernels``, "Batch invariance"): row i of
``X @ W.T`` against the same row computed alone, for B = 1, 2, 3, 5, 7, 8, 16, 33 rows, at the first,
middle and last place, with other rows of every scale around it, on one and on two threads.

The types :func:`kernels.batch_invariant` names must give the same bits; the others must not (so a
change that makes one invariant, or breaks one, shows up here and in that function together).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from test_kernels import random_weight  # noqa: E402
from zmq_rpc.worker import kernels  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # a first call compiles its type's kernels

BATCHES = (1, 2, 3, 5, 7, 8, 16, 33)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    kernels.set_threads(1)


def rows_differ(qtype: str, k: int, rows: int) -> list[tuple[int, int]]:
    """(B, place) of every batch where the watched row's output is not its bits alone."""
    rng = np.random.default_rng(31)
    w = kernels.pack(random_weight(rng, qtype, rows, k), qtype)
    row = rng.standard_normal(k).astype(np.float32)
    alone = np.empty((1, rows), np.float32)
    kernels.matmul(row[None], w, qtype, alone)
    bad = []
    for b in BATCHES:
        for place in sorted({0, b // 2, b - 1}):
            x = (rng.standard_normal((b, k)) * rng.choice([1e-3, 1.0, 50.0], (b, 1))).astype(np.float32)
            x[place] = row
            out = np.empty((b, rows), np.float32)
            kernels.matmul(x, w, qtype, out)
            if not np.array_equal(out[place], alone[0]):
                bad.append((b, place))
    return bad


def width(qtype: str) -> int:
    return 512 if kernels.PACKED[qtype][0] != 256 else 768


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_a_row_gives_the_same_bits_in_any_batch_where_promised(qtype: str) -> None:
    """100 weight rows: six blocks of 16 and a scalar tail of 4."""
    bad = rows_differ(qtype, width(qtype), 100)
    if kernels.batch_invariant(qtype):
        assert not bad, f"{qtype}: (B, place) where the row changed: {bad}"
    else:
        assert bad, f"{qtype} is batch-invariant now: add it to kernels.batch_invariant"


UNPACKED = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


@pytest.mark.parametrize("qtype", UNPACKED)
def test_decode_sweeps_over_two_tiles_give_the_gemm_rows(qtype: str) -> None:
    """4200 weight rows: the decode kernels' (``kernels.unpackdot``) two output tiles of 4096 and 96
    rows and a ragged tail of 8 (the GEMM's own pass) give a row the bits it gets among others."""
    assert kernels.batch_invariant(qtype)
    assert not rows_differ(qtype, 256, 4200)


@pytest.mark.parametrize("qtype", sorted(kernels.INVARIANT_INTEGER | kernels.HALF_GEMM))
def test_rows_split_over_threads_keep_their_bits(qtype: str) -> None:
    """Two threads split the 300 weight rows (on multiples of 16): the outputs do not move."""
    if not kernels.batch_invariant(qtype):
        pytest.skip(f"{qtype} is not batch-invariant on this CPU")
    kernels.set_threads(2)
    assert not rows_differ(qtype, width(qtype), 300)
