"""The worker: a broker thread (``zmq_rpc.broker.broker``) and one backend thread that owns every byte.

Module map, one subpackage per job (thread that runs it); each subpackage's docstring lists its
modules, and none imports anything on import:

- ``cli``: ``zmq-rpc-worker`` (the main thread: flags, signals, then ``WorkerServer``);
  ``entry``: the way in of ``zmq-rpc-worker`` and ``python -m zmq_rpc.worker`` (``__main__``,
  the launchers'): the client port listening first, then ``cli``.
- ``server``: :class:`WorkerServer` (the creating thread: listen, start, stop, join).
- ``backend_thread``: :class:`BackendThread` (the backend thread's poll loop: PAIR, peer PULL,
  control, timers), loaded once the worker listens.
- ``dispatch``: the request path: ``inbox`` (requests read ahead from the PAIR, handed on one
  client at a time in turn), ``executor`` (sessions' queues and the ``Cmd -> Route`` dispatch
  table), ``self_report`` (HELLO's reply, STATUS, capabilities, the metrics' gauges), ``outbox``
  (replies to the broker, zero-copy tracking, held replies first), ``frames`` (whole messages in
  and out of the PAIR) (backend).
- ``sessions``: ``session`` (``Session``, ``Buffer``, ``WorkerLimits``, and the dispatch vocabulary:
  ``Request``, ``Route``, admissions and outcomes), ``views`` (checked views of
  buffers), ``table`` (HELLO, ``--max-sessions``, closing a session: what it frees and fails),
  ``memory`` and ``quotas`` (``--mem`` and per-session quotas), ``identities`` (whose session it
  is: quotas per client key), ``buffers`` (buffer and tensor commands) (backend).
- ``graphs``: ``commands`` (register, run, compute, free), ``execute`` (compile: validation, arena
  plan; execution), ``bind`` (a compiled graph bound to its arrays once), ``linked`` (linked runs
  and held replies) (backend).
- ``peer``: the peer port, worker-to-worker transfers: ``links`` (the PULL socket, the executor's
  entry points), ``push``, ``send``, ``receive``, ``acks``, ``endpoints``, ``stash``, ``queue``, and
  ``transfers`` (PEER_RECV / SEND / PROBE / FILL) (backend).
- ``files``: weights from the worker's disk: ``model_files``, ``hasher`` (its hashing thread),
  ``tensor_cache``, ``loading`` (FILE_QUERY, READ_FILE, SET_FROM_CACHE) (backend).
- ``formats``: pure formats shared with the client: ``quant`` (ggml blocks), ``hashing`` (BLAKE3)
  (any thread).
- ``observe``: ``metrics`` (the recorder the backend thread bumps), ``exporter`` (Prometheus, its
  HTTP thread), ``logs`` (log lines; configured by the main thread).
- ``process``: ``early_listen`` (the client port bound before anything is imported; the ROUTER
  adopts it), ``devices`` (``--device`` names, parsed without importing numpy), ``version``,
  ``gc_pacing``, ``heap`` (the main thread sets them up; the backend thread paces and trims).
- ``backends``: ``base`` the ``Backend`` protocol; ``numpy_backend``, ``cupy_backend`` implement it,
  ``numpy_ops`` holds the kernels (backend).
- ``kernels``: packed quantized matmul kernels, and ``kernels.fused`` the fused decode kernels
  (attention, swiglu, rope, rms_norm) (numba when installed) (backend); ``kernels.intgemm`` the
  int8 prefill GEMM of q4_0/q4_1/q8_0, ``kernels.unpacked`` the same for q5_0/q5_1/q4_k/q5_k/q6_k
  (each 16-row block unpacked once into an L1 scratch), ``kernels.amxgemm`` (AMX tiles) and ``kernels.halfgemm``
  (FMA, without AMX) the prefill GEMMs of f16/bf16, ``kernels.split`` products split over numba's OpenMP pool
  for ``--threads`` (the backend thread and the pool's threads, each writing only its rows).
"""
