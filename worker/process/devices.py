"""Device names (``--device cpu|cuda|cuda:N``): pure parsing, no heavy imports.

Runs on the main thread while ``zmq-rpc-worker`` parses its flags, which happens before numpy
is imported: the worker pins BLAS threads with environment variables (``--threads``) that
OpenBLAS reads once, when numpy loads. A module the flag parsing imports must therefore not
import numpy (a test checks that parsing every flag leaves numpy unloaded).
"""

from __future__ import annotations

import os


def parse_device(device: str) -> tuple[str, int]:
    """``("cpu", 0)`` for "cpu", ``("cuda", N)`` for "cuda" (GPU 0) or "cuda:N"; ValueError
    naming the accepted forms for anything else."""
    kind, sep, index = device.partition(":")
    if device == "cpu":
        return "cpu", 0
    if kind == "cuda" and (not sep or (index.isdigit() and index.isascii())):
        return "cuda", int(index or 0)
    raise ValueError(f"unknown device {device!r}: expected cpu, cuda (GPU 0) or cuda:N "
                     "(N = 0, 1, ...; one worker per GPU)")


def physical_memory() -> int:
    """Bytes of RAM on this machine (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


CUDA_EXTRA = "pip install 'zmq-rpc[cuda]'"
"""How to get the cuda backend's dependency (an extra: cupy needs an NVIDIA GPU and driver)."""


def cuda_unavailable() -> str | None:
    """Why a cuda worker cannot run here (cupy missing, CUDA unusable, no device), or None.

    Imports cupy (and with it numpy) only when called: never from flag parsing.
    """
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        return f"cupy is not installed ({CUDA_EXTRA} on a machine with an NVIDIA GPU)"
    try:
        import cupy
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, a driver too old for this cupy, a broken install
        return f"cupy is installed but CUDA is not usable: {exc!r}"
    return None if count else "cupy is installed but sees no CUDA device"
