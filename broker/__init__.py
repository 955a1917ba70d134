"""The wire, shared by the client and the worker, and the worker's front-end threads.

- the protocol: ``protocol`` (version, commands, one frozen dataclass per message; decoding is
  validation), built on ``wire`` (field checkers, the message base) and ``errors`` (the exception
  tree), with the messages of ``ops`` and ``graph`` (graphs and their op rules), ``peer``
  (worker-to-worker transfers) and ``files`` (worker-side file reads, the tensor cache), and
  ``limits`` (what a graph may hold and cost, sessions: the numbers ``--help`` shows);
- how a session proves who it is: ``identity`` (the CURVE key proof in HELLO), ``request_mac``
  (per-request signatures), ``keys`` (CurveZMQ key files and keyed endpoints), ``endpoints``
  (endpoints read the way libzmq reads them), ``monitor`` (socket monitor events);
- the threads in front of a worker's backend: ``broker`` (the ROUTER front-end, ``zmq.proxy_steerable``)
  and ``zap`` (which CURVE keys may connect).

Pure formats without sockets (ggml quantization, content hashes) are :mod:`zmq_rpc.worker.formats`.
Imports nothing on import.
"""
