"""Device names (``--device cpu|cuda|cuda:N``): pure parsing, no heavy imports.

Runs on the main thread while ``zmq-rpc-worker`` parses its flags, which happens before numpy
is imported: the worker pins BLAS threads with environment variables (``--threads``) that
OpenBLAS reads once, when numpy loads. A module the flag parsing imports must therefore not
import numpy (a test checks that parsing every flag leaves numpy unloaded).
"""

from __future__ import annotations


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
