"""The installed zmq-rpc version, for ``--version``, HELLO's reply, STATUS and the metrics' info.

A leaf: the standard library only, any thread. The CLI (main thread) and the backend thread's
self-report both read it, and neither may import the other.
"""

from __future__ import annotations

VERSION = "0.1.0"
"""zmq-rpc's version: setup.cfg's ``version = attr:`` reads it from here, so the installed
package's metadata and this constant are one number (``importlib.metadata`` alone costs a
worker ~25-50 ms of imports on its way to answering its first client)."""


def package_version() -> str:
    """The installed zmq-rpc version."""
    return VERSION
