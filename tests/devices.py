"""The backends tests run on, as pytest parameters: ``cpu`` (numpy), ``fake`` and ``cuda`` (cupy).

- ``cpu``: the numpy backend, the product on every machine.
- ``fake``: host memory posing as a device (:mod:`fake_device`): numpy arrays of a subclass whose
  namespace is not numpy, so the kernels take every device branch (no ``mode=`` in ``take``,
  reshape without ``copy=False``, last-write-wins ``set_rows``, the byte-level dequantizer, the
  device block sizes) while running on the CPU. Kernel tests only.
- ``cuda``: the cupy backend on GPU 0; skipped with the reason when cupy does not import or sees
  no GPU. Marked ``gpu``: ``tools/gpu_check.sh`` runs ``pytest -m gpu``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from zmq_rpc.worker.process.devices import cuda_unavailable


@functools.cache
def cuda_missing() -> str | None:
    """Why cuda tests cannot run here, or None when cupy imports and sees a GPU."""
    reason = cuda_unavailable()
    return None if reason is None else f"cuda backend: {reason}"


def cupy_module() -> Any:
    """cupy (call only from a cuda-parametrized test: the parameter's skip has run)."""
    import cupy
    return cupy


def on_gpu(value: Any, id: str | None = None) -> Any:
    """A pytest parameter that needs the cuda backend: marked ``gpu``, skipped without one."""
    return pytest.param(value, id=id, marks=[pytest.mark.gpu,
                                             pytest.mark.skipif(cuda_missing() is not None,
                                                                reason=cuda_missing() or "")])


CUDA = on_gpu("cuda")
WORKER_DEVICES = ["cpu", CUDA]
"""Devices a worker runs on (``WorkerConfig.device``)."""
KERNEL_DEVICES = ["cpu", "fake", CUDA]
"""Where the kernel table runs: numpy, numpy posing as a device, cupy."""
TRIO_DEVICES = [pytest.param(("cpu", "cpu", "cpu"), id="cpu-cpu-cpu"),
                on_gpu(("cuda", "cpu", "cuda"), id="cuda-cpu-cuda"),
                on_gpu(("cpu", "cuda", "cuda"), id="cpu-cuda-cuda")]
"""Three workers for peer tests: all CPU, and mixed layouts where every ordered pair of kinds
(cuda->cpu, cpu->cuda, cuda->cuda, cpu->cpu) appears among workers 0->1, 1->2, 0->2."""
