"""``zmq-rpc-worker``'s entry point: ``zmq-rpc-worker status ...`` asks running workers
(:mod:`.status`), anything else runs one (:func:`zmq_rpc.worker.cli.main`).

Runs on the main thread of its own process. The choice lives here, above both, because
``status`` is a client (it opens a :class:`~zmq_rpc.client.Client` per worker) and the worker
package never imports the client side. Each branch imports only its own side: a worker started
here loads no client code, and its BLAS variables are still set before numpy is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``zmq-rpc-worker [status] ...``; returns the exit code of the command it ran."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["status"]:
        from .status import main as status_main
        return status_main(args[1:])
    from ..worker.entry import run_worker
    return run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
