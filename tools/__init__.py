"""Command-line tools around the worker: ``zmq-rpc-bench`` (cases, reports, the main job),
``zmq-rpc-fuzz``, the load test, ``zmq-rpc-keygen``, ``status`` and the network lab. Each runs on
its process's main thread; a module's docstring says what else runs where."""
