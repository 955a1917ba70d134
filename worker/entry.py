"""A worker process's way in (``zmq-rpc-worker``'s own branch, ``python -m zmq_rpc.worker``): the
client port listening first (:mod:`.process.early_listen`), then :func:`.cli.main`, which the
ROUTER's adoption of that socket completes.

Runs on the main thread, before the worker's modules are imported.
"""

from __future__ import annotations

from collections.abc import Sequence

from .process.early_listen import early_listen


def run_worker(argv: Sequence[str]) -> int:
    """Run one worker with ``argv`` (``zmq-rpc-worker``'s flags), its client port listening
    first; returns the exit code."""
    listening = early_listen(argv)
    from .cli import main
    return main(list(argv), listening_fd=None if listening is None else listening.detach())
