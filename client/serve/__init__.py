"""``zmq-rpc-serve``: an OpenAI-compatible HTTP server around a model split over workers.

Modules, one job each, and the thread that runs each:

- :mod:`.jobs`: an OpenAI request body checked into a :class:`~.jobs.Job` (event loop);
- :mod:`.text`: a sequence's tokens turned into text, stop strings cut (engine thread);
- :mod:`.engine`: the :class:`~.engine.Engine`: one thread that alone owns the model, its slot
  :class:`~.engine.Scheduler` and the step function (:class:`~.engine.SerialSteps` today); the
  event loop talks to it through thread-safe queues only;
- :mod:`.metrics`: the Prometheus metrics (updated from both threads: prometheus_client is
  thread-safe);
- :mod:`.app`: the Starlette routes and their server-sent events (event loop);
- :mod:`.cli`: the command line: workers, model, engine, uvicorn (main thread).

The package needs the ``serve`` extra (starlette, uvicorn, prometheus_client); nothing else in
zmq_rpc imports it.
"""
