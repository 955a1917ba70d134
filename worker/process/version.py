"""The installed zmq-rpc version, for ``--version``, HELLO's reply, STATUS and the metrics' info.

A leaf: the standard library only, any thread. The CLI (main thread) and the backend thread's
self-report both read it, and neither may import the other.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed zmq-rpc version."""
    try:
        return version("zmq-rpc")
    except PackageNotFoundError:
        return "unknown"
