"""Programs over the client and the worker, the top layer (nothing below imports it): the bench
(``bench`` and its ``bench_*`` cases, ``baselines``, ``report``, ``units``; ``bench_command``,
``zmq-rpc-bench``'s entry point, and ``builtin_commands``, its own commands), ``generate`` (the main
job), ``status``, ``keygen``, ``fuzz``, ``loadtest``, ``netlab`` (multi-host tests in network
namespaces), ``timing``, and ``worker_command`` (``zmq-rpc-worker``'s entry point). Each runs on
the main thread of its own process. Imports nothing on import.
"""
