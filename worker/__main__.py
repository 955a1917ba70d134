"""``python -m zmq_rpc.worker``: run one worker, its client port listening first
(:mod:`.process.early_listen`); the launchers' way to start one (:mod:`.launch`)."""

import sys

from .process.early_listen import run_worker

sys.exit(run_worker(sys.argv[1:]))
