"""``zmq-rpc-serve``: load a model across workers and serve it over HTTP (the OpenAI API).

Start-up, on the main thread: the workers (``--workers``, or ``--local-workers`` started here as
``zmq-rpc-bench generate`` starts them), one :class:`~zmq_rpc.client.Client` each, the model and
its tokenizer, the :class:`~.engine.Engine` thread, then uvicorn's event loop on this thread with
the routes of :mod:`.app`. Once it accepts connections it prints ``listening on http://HOST:PORT``
on stdout (status lines go to stderr). SIGINT and SIGTERM stop it: uvicorn closes the connections
(streams end), the engine stops after its step, the model's state is freed and local workers
are stopped.

Threads: main (start-up, then the event loop), the engine's, and the clients' I/O threads.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from ...broker.errors import RpcError
from ...worker.launch import LISTENING, add_worker_options, endpoint_list, local_workers
from ..client import Client

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["build_parser", "main"]

log = logging.getLogger("zmq_rpc.client.serve")


def build_parser(prog: str = "zmq-rpc-serve") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=(
        "Serve a llama GGUF split over workers with the OpenAI API (/v1/completions, "
        "/v1/chat/completions, /v1/models), /health and /metrics."), epilog=(
        "Workers may join and leave while it serves. Joining: POST /admin/workers "
        "{\"endpoint\": \"tcp://HOST:PORT\"} (from this machine only: other addresses get "
        "403) connects to that worker (202), and at the next step boundary it takes over half "
        "of the stage with the most layers; a --spares worker can be added so too. Leaving: "
        "SIGTERM a worker (zmq-rpc-worker --drain-timeout, default 30 s): at the next step "
        "boundary its layers move to a spare or the worker with the most free memory, the "
        "sequences are replayed there, the streams go on, and the worker exits. Both are "
        "counted in /metrics (zmq_rpc_serve_recoveries_total{outcome=drained|joined})."))
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--model-id", default=None,
                    help="the name /v1/models gives the model (default: the file's stem); "
                         "requests may name any model, this one answers")
    add_worker_options(ap)
    ap.add_argument("--spares", type=endpoint_list, default=[],
                    help="comma-separated spare workers (tcp://HOST:PORT or ipc://PATH), as "
                         "--workers: none runs layers at first; when a worker is lost, its layers "
                         "move to the first spare with the memory for them (else to the surviving "
                         "worker with the most free memory), the sequences are replayed there and "
                         "the streams go on; only when nothing can take them do the streams end "
                         "with an error and /health answer 503 (default: none)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default %(default)s: this machine only)")
    ap.add_argument("--port", type=int, default=8000,
                    help="TCP port (default %(default)s; 0: any free port)")
    ap.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait for a slot; more get 429 (default %(default)s)")
    ap.add_argument("--ctx", type=int, default=2048,
                    help="context length in tokens, prompt and answer (default %(default)s)")
    ap.add_argument("--weights", choices=["quantized", "f32"], default="quantized",
                    help="weights on the workers (default %(default)s)")
    ap.add_argument("--slots", "--parallel", type=int, default=8,
                    help="sequences served at once (continuous batching: each has its own KV slot "
                         "of --ctx tokens on the workers and one row in every step; default "
                         "%(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=32,
                    help="prompt tokens per prefill step and sequence (default %(default)s)")
    ap.add_argument("--serial", action="store_true",
                    help="one sequence at a time, sampled here (the engine before batching; "
                         "for comparisons)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for each worker request (default %(default)s)")
    ap.add_argument("--log-level", default="warning",
                    choices=["debug", "info", "warning", "error"],
                    help="uvicorn's and the server's log level (default %(default)s)")
    return ap


def _status(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zmq-rpc-serve``; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if (args.max_queue < 1 or args.ctx < 2 or args.slots < 1 or args.prefill_chunk < 1
            or (args.workers is None and args.local_workers < 1)):
        print("zmq-rpc-serve: --max-queue, --slots, --prefill-chunk and --local-workers must be "
              ">= 1, --ctx >= 2", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        _serve(args)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except SystemExit as stop:
        return int(stop.code or 0)
    except (RpcError, OSError, ValueError, RuntimeError) as exc:
        print(f"zmq-rpc-serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (uvicorn re-raises it once it has shut down): unwind, stopping what we started,
    and exit 0: SIGTERM is how a server is meant to be stopped."""
    raise SystemExit(0)


def _serve(args: argparse.Namespace) -> None:
    from ..gguf_model import default_model_path, load_gguf
    from ..llama import LlamaModel
    from ..llama.batch import BatchedModel
    from ..tokenizer import load_tokenizer
    from .engine import BatchedSteps, Engine, SerialSteps, StepFunction
    from .metrics import ServeMetrics

    with ExitStack() as stack:
        endpoints = stack.enter_context(_workers(args))
        _status(f"connecting to {len(endpoints)} worker(s)"
                + (f" and {len(args.spares)} spare(s)" if args.spares else ""))
        clients, spares = ([stack.enter_context(Client(e, timeout=args.timeout,
                                                       connect_timeout=args.timeout))
                            for e in group] for group in (endpoints, args.spares))
        metrics = ServeMetrics()
        path = Path(args.model or default_model_path())
        _status(f"loading {path.name}")
        gguf = load_gguf(path)
        steps: StepFunction
        if args.serial:
            model = LlamaModel.load(gguf, clients, n_ctx=args.ctx, weights=args.weights,
                                    prefill_chunk=args.prefill_chunk, status=_status,
                                    spares=spares, on_recovery=metrics.recovered)
            stack.callback(model.close)
            steps = SerialSteps(model)
        else:
            lanes = min(args.slots, len(clients))     # a lane needs a slot: fewer slots, fewer lanes
            batched = BatchedModel.load(gguf, clients, n_ctx=args.ctx, slots=args.slots,
                                        weights=args.weights, status=_status, lanes=lanes,
                                        rows=_lane_rows(args.slots, lanes, args.prefill_chunk),
                                        spares=spares, on_recovery=metrics.recovered)
            stack.callback(batched.close)
            steps = BatchedSteps(batched, prefill_chunk=args.prefill_chunk)
        engine = Engine(steps, load_tokenizer(gguf), max_queue=args.max_queue,
                        metrics=metrics)
        engine.start()
        stack.callback(engine.close)
        _run_http(args, engine, args.model_id or path.stem)


def _lane_rows(slots: int, lanes: int, chunk: int) -> int:
    """Rows of a lane step: one per slot of the lane and a prompt chunk."""
    return -(-slots // lanes) + chunk


@contextmanager
def _workers(args: argparse.Namespace) -> Iterator[list[str]]:
    if args.workers:
        yield args.workers
        return
    _status(f"starting {args.local_workers} local worker(s)")
    with local_workers(args.local_workers, "--preload-kernels", own_session=True) as endpoints:
        yield endpoints


def _run_http(args: argparse.Namespace, engine: Engine, model_id: str) -> None:
    import uvicorn

    from .app import build_app

    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine, engine.tokenizer, model_id,
                  lambda e: Client(e, timeout=args.timeout, connect_timeout=args.timeout)),
        log_level=args.log_level,
        access_log=args.log_level in ("debug", "info"), timeout_graceful_shutdown=5,
        lifespan="off"))
    shown = f"[{host}]" if ":" in host else host
    print(f"zmq-rpc-serve: {model_id} {LISTENING} http://{shown}:{port}", flush=True)
    with sock:
        server.run(sockets=[sock])


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (bound here, so ``--port 0`` can be announced)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


if __name__ == "__main__":
    sys.exit(main())
