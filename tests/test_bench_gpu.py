"""The GPU bench case (tools/bench_gpu.py) where there is no GPU: it skips with the reason, and
the graphs it times are checked on a CPU worker (the same graphs run on the cuda worker)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from devices import cuda_missing
from zmq_rpc.client import Client
from zmq_rpc.tools import bench_gpu
from zmq_rpc.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(120)


def test_the_case_skips_with_the_reason_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_missing() is None:
        pytest.skip("this machine has a GPU: tools/gpu_check.sh runs the case")
    assert bench_gpu.case_gpu(None) == []         # type: ignore[arg-type]  # returns before use
    out = capsys.readouterr().out
    assert out.startswith("gpu: skipped (") and "zmq-rpc[cuda]" in out + str(bench_gpu.cuda_unavailable())


def test_the_encoder_graph_runs_and_normalizes_every_row(
        make_worker: Callable[..., WorkerServer], make_client: Callable[..., Client],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_gpu, "ENCODER", {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128,
                                               "tokens": 16, "batch": 2})
    client = make_client(make_worker(memory_limit=256 << 20).endpoint)
    g, out = bench_gpu.encoder_graph(client, np.random.default_rng(0))
    client.run(client.register(g))
    x = client.get_tensor(out)
    assert x.shape == (32, 64) and np.isfinite(x).all()
    np.testing.assert_allclose(x.mean(axis=1), 0, atol=1e-4)          # layer norm, unit weight
    np.testing.assert_allclose(x.std(axis=1), 1, atol=1e-3)
