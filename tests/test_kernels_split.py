"""The row split of the quantized kernels (``worker/kernels/split.py``) and ``kernels.set_threads``.

No sockets. Every qtype's decode and prefill products at 2 and 3 threads against 1 thread on odd row
counts (the rows of one product are independent: splitting them changes nothing but the last
float bits where a ragged tail runs the scalar loop); the ranges (:func:`split.cuts`); which
products are split (small ones are not); set/reset of the thread count; the fallback to one thread
when the OpenMP pool cannot start; two backend threads splitting at once (OpenMP is thread-safe).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

pytest.importorskip("numba")
pytest.importorskip("gguf")

from test_kernels import random_weight, row_lengths  # noqa: E402
from zmq_rpc.worker import kernels  # noqa: E402
from zmq_rpc.worker.kernels import intgemm, jit, split  # noqa: E402

pytestmark = pytest.mark.timeout(180)   # first use compiles each type's wrappers (~2 s each)


@pytest.fixture(autouse=True)
def one_thread() -> object:
    kernels.set_threads(1)
    yield
    kernels.set_threads(1)


@pytest.fixture
def split_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Records ``(lo, hi, n)`` of every split, then runs it."""
    calls: list[tuple[int, int, int]] = []
    real = split.run

    def spy(kernel: object, head: tuple, lo: int, hi: int, tail: tuple, n: int) -> None:
        calls.append((lo, hi, n))
        real(kernel, head, lo, hi, tail, n)
    monkeypatch.setattr(split, "run", spy)
    return calls


def products(qtype: str, packed: np.ndarray, x: np.ndarray, threads: int) -> np.ndarray:
    kernels.set_threads(threads)
    out = np.full((x.shape[0], packed.shape[0]), np.nan, np.float32)
    kernels.matmul(x, packed, qtype, out)
    return out


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_split_products_match_one_thread(qtype: str, monkeypatch: pytest.MonkeyPatch,
                                         split_calls: list[tuple[int, int, int]]) -> None:
    """Decode (1 and 2 rows) and prefill (7 rows: the integer GEMM split, or ragged tiles + BLAS) on
    3 * 64 + 7 rows (odd, not a multiple of 16) at 2 and 3 threads give the rows of 1 thread."""
    assert split.available(), split.problem()
    rng = np.random.default_rng(17)
    k = row_lengths(qtype)[-1]
    rows = 3 * kernels.MIN_SPLIT_ROWS + 7
    monkeypatch.setattr(kernels, "TILE_BYTES", 4 * k * 160)    # prefill tiles of 160 rows + 39
    packed = kernels.pack(random_weight(rng, qtype, rows, k), qtype)
    for t in (1, 2, 7):
        x = rng.standard_normal((t, k)).astype(np.float32)
        one = products(qtype, packed, x, 1)
        assert not split_calls
        for n in (2, 3):
            got = products(qtype, packed, x, n)
            np.testing.assert_allclose(got, one, rtol=1e-6, atol=1e-6 * np.abs(one).max(),
                                       err_msg=f"{qtype} threads={n} rows of x={t}")
        if t <= kernels.MATVEC_ROWS or qtype in kernels.INTEGER_GEMM | kernels.HALF_GEMM:
            assert split_calls and all(n in (2, 3) for _, _, n in split_calls)
        else:           # tiles + BLAS: one thread dequantizes, BLAS runs on the others
            assert not split_calls
        split_calls.clear()


@pytest.mark.parametrize(("lo", "hi", "n"), [(0, 1000, 2), (0, 1000, 3), (16, 49152, 2), (5, 70, 4),
                                             (0, 10, 2), (0, 17, 2), (3, 3 + 259, 2), (0, 576, 1)])
def test_cuts_cover_the_rows_once_on_16_row_boundaries(lo: int, hi: int, n: int) -> None:
    bounds = split.cuts(lo, hi, n).tolist()
    assert bounds[0] == lo and bounds[-1] == hi and 2 <= len(bounds) <= n + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert all((b - lo) % split.ALIGN == 0 for b in bounds[1:-1])
    if hi - lo >= split.ALIGN * n * 2:      # long enough: about equal parts
        sizes = np.diff(bounds)
        assert len(sizes) == n and sizes.max() - sizes.min() <= split.ALIGN * 2


def test_small_products_stay_on_one_thread(split_calls: list[tuple[int, int, int]]) -> None:
    """Below MIN_SPLIT_ROWS rows per thread a product runs in the calling thread; from there on
    it is split over every thread."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    for n in (2, 3):
        small, large = kernels.MIN_SPLIT_ROWS * n - 1, kernels.MIN_SPLIT_ROWS * n
        for rows in (small, large):
            products("q4_1", kernels.pack(random_weight(rng, "q4_1", rows, 64), "q4_1"), x, n)
        assert split_calls == [(0, large, n)], split_calls
        split_calls.clear()


def test_set_threads_then_back_to_one(split_calls: list[tuple[int, int, int]]) -> None:
    rng = np.random.default_rng(4)
    packed = kernels.pack(random_weight(rng, "q8_0", 512, 64), "q8_0")
    x = rng.standard_normal((1, 64)).astype(np.float32)
    products("q8_0", packed, x, 2)
    assert kernels.threads() == 2 and split_calls == [(0, 512, 2)]
    products("q8_0", packed, x, 1)
    assert kernels.threads() == 1 and len(split_calls) == 1
    with pytest.raises(ValueError, match=">= 1"):
        kernels.set_threads(0)
    assert kernels.threads() == 1


def test_every_kernel_has_a_parallel_wrapper() -> None:
    for mv, dq, _ in jit.KERNELS.values():
        assert mv in split.PARALLEL and dq in split.PARALLEL
    for gemm, _ in intgemm.GEMM.values():
        assert gemm in split.PARALLEL


def test_without_the_pool_products_run_on_one_thread(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Where the OpenMP pool cannot start, a warning says why (once) and the products run on one
    thread, right."""
    monkeypatch.setattr(kernels, "_split", [])
    monkeypatch.setattr(split, "_state", {"problem": "numba's omp threading layer does not load (test)"})
    rng = np.random.default_rng(6)
    data = random_weight(rng, "q5_0", 300, 64)
    packed, x = kernels.pack(data, "q5_0"), rng.standard_normal((1, 64)).astype(np.float32)
    one = products("q5_0", packed, x, 1)
    with caplog.at_level(logging.WARNING, logger="zmq_rpc.worker.kernels"):
        got = products("q5_0", packed, x, 2)
        products("q5_0", packed, x, 2)   # set_threads(2) again: still one thread, no second try
    np.testing.assert_array_equal(got, one)
    assert kernels.threads() == 1
    warnings = [r.getMessage() for r in caplog.records if "one thread" in r.getMessage()]
    assert warnings and "does not load (test)" in warnings[0]


def test_two_backend_threads_split_at_once() -> None:
    """Two workers' backend threads in one process split their products at the same time
    (OpenMP is thread-safe; numba's workqueue layer would abort the process)."""
    rng = np.random.default_rng(8)
    packed = {q: kernels.pack(random_weight(rng, q, 1000, 256), q) for q in ("q4_1", "q6_k")}
    x = rng.standard_normal((1, 256)).astype(np.float32)
    ref = {q: products(q, w, x, 1) for q, w in packed.items()}
    kernels.set_threads(2)
    errors: list[str] = []

    def loop(qtype: str) -> None:
        out = np.empty((1, 1000), np.float32)
        for _ in range(200):
            kernels.matmul(x, packed[qtype], qtype, out)
            if not np.allclose(out, ref[qtype], rtol=1e-6, atol=1e-6 * np.abs(ref[qtype]).max()):
                errors.append(qtype)
                return
    threads = [threading.Thread(target=loop, args=(q,)) for q in packed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_a_long_prefill_rounds_its_rows_split_and_as_one_thread(split_calls: list[tuple[int, int, int]]) -> None:
    """From ``MIN_SPLIT_ROWS`` activation rows per thread the int8 rounding of ``x`` is split by rows
    too: the same codes, steps and sums as one thread (NaN, infinite and zero blocks included), and
    a q4_k prefill of such rows gives the rows of one thread."""
    rng = np.random.default_rng(31)
    t = 2 * kernels.MIN_SPLIT_ROWS + 9
    x = (rng.standard_normal((t, 256)) * rng.choice([1e-3, 1.0, 50.0], (t, 1))).astype(np.float32)
    x[3, 40], x[100, 7], x[120, 64:96] = np.nan, np.inf, 0
    one = intgemm.quantize_rows(x)
    for n in (2, 3):
        parts = intgemm.empty_rows(*x.shape)
        split.run(intgemm.quantize_rows_into, (x, *parts), 0, t, (), n)
        for a, b in zip(one, parts):
            np.testing.assert_array_equal(a, b)
    packed = kernels.pack(random_weight(rng, "q4_k", 70, 256), "q4_k")
    single = products("q4_k", packed, x, 1)
    split_calls.clear()
    np.testing.assert_allclose(products("q4_k", packed, x, 2), single, rtol=1e-6,
                               atol=1e-6 * np.nanmax(np.abs(single)))
    assert (0, t, 2) in split_calls         # the rounding (the 70-row product is too small to split)
