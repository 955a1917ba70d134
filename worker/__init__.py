"""The worker: a broker thread (``zmq_rpc.broker.broker``) and one backend thread that owns every byte.

Module map (thread that runs it):

- ``server``: :class:`WorkerServer` (the creating thread: start, stop, join) and
  :class:`BackendThread` (the backend thread's poll loop: PAIR, peer PULL, control, timers).
- ``inbox``: requests read ahead from the PAIR, handed to the executor one client at a time in
  turn (backend; no socket).
- ``executor``: the scheduler: requests in, each session's queue and its ordering rules, the
  ``Cmd -> Route`` dispatch table, transfer completions (backend thread).
- ``session_table``: the open sessions: HELLO (version, routing id, ``--max-sessions``), and
  closing one (GOODBYE, expiry, memory pressure): what it frees and fails (backend).
- ``requests``: the dispatch vocabulary: ``Request``, ``Route``, admissions and outcomes (backend).
- ``session``: ``Session``, ``Buffer``, checked ``Views`` of buffers, ``WorkerLimits`` (backend).
- ``buffers``: buffer and tensor commands: alloc, free, clear, set, get, memset, copy (backend).
- ``graphs``: graph commands: register, run, compute, free, and the run shared with linked runs
  (backend).
- ``transfers``: peer-copy commands: PEER_RECV / SEND / PROBE / FILL (backend).
- ``linked``: linked runs (one queue entry, RECEIVING -> READY -> RAN -> PUSHED) and held replies
  (backend).
- ``self_report``: what the worker says about itself: HELLO's reply, STATUS, capabilities, the
  gauges the metrics publish (backend; reads, never changes, the sessions and memory).
- ``outbox``: replies to the broker, zero-copy tracking, held replies first (backend).
- ``memory``: ``MemoryBudget`` (bytes handed out against ``--mem``) and ``SessionMemory`` (every
  byte a session holds, charged to its quota and the budget at once) (backend).
- ``quotas``: per-session quotas and materialized frames in flight until sent (backend).
- ``peer_links``: worker-to-worker transfers: the peer PULL socket (read, decoded, dispatched) and
  the executor's entry points, routed to the four pieces below (backend).
- ``peer_push``: the PUSH sockets to other workers: opened lazily, reused, monitored for drops,
  never blocking a send (backend).
- ``peer_send``: a send cut into chunks with headers encoded ahead, then pushed (zero-copy,
  copied or materialized and charged) (backend).
- ``peer_receive``: receives in progress: chunks checked and landed in their destinations, early
  chunks stashed (backend; no socket).
- ``peer_acks``: sends and probes waiting for an acknowledgement: acks, deadlines, dropped peers
  (backend; no socket).
- ``peer_endpoints``: which peer endpoints may be connected to, and as whom (backend; no socket).
- ``stash``: chunks that arrive before their receive starts: a byte share per sender, announced
  transfers first, counted in ``--mem`` (backend).
- ``peer_queue``: the peer PULL's receive queues: bounded per connection, counted in ``--mem``
  while each connection is open (backend).
- ``graph_exec``: graph compile (validation, arena plan) and execution (backend).
- ``graph_bind``: a compiled graph bound to its arrays once, run as a tight loop of prepared
  kernel calls (backend).
- ``backends.base``: the ``Backend`` protocol; ``backends.numpy_backend``, ``backends.cupy_backend``
  implement it, ``backends.numpy_ops`` holds the kernels (backend).
- ``kernels``: packed quantized matmul kernels, and ``kernels.fused`` the fused decode kernels
  (attention, swiglu, rope, rms_norm) (numba when installed) (backend); ``kernels.intgemm`` the
  int8 prefill GEMM of q4_0/q4_1/q8_0, ``kernels.unpacked`` the same for q5_0/q5_1/q4_k/q5_k/q6_k
  (each 16-row block unpacked once into an L1 scratch), ``kernels.amxgemm`` (AMX tiles) and ``kernels.halfgemm``
  (FMA, without AMX) the prefill GEMMs of f16/bf16, ``kernels.split`` products split over numba's OpenMP pool
  for ``--threads`` (the backend thread and the pool's threads, each writing only its rows).
- ``devices``: ``--device`` names, parsed without importing numpy (the main thread, with the flags).
- ``cli``: ``zmq-rpc-worker`` (the main thread: flags, signals, then ``WorkerServer``).
"""
