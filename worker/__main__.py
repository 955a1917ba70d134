"""``python -m zmq_rpc.worker``: run one worker, its client port listening first
(:mod:`.entry`); the launchers' way to start one (:mod:`.launch`)."""

import sys

from .entry import run_worker

if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:]))
