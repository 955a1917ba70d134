"""``zmq-rpc-bench generate``: load a GGUF across workers, stream an answer, print its costs.

What the screen shows, in order (status on stderr, the answer alone on stdout): a line per start-up
phase as it begins (starting local workers, opening the model, connecting),
a tqdm bar for the weight upload (bytes, bytes/s, ETA), a line per later phase (laying the weights
out on the workers, KV cache and graphs), the answer as it streams, and a summary whose parts add
up: start-up by phase, sizes in MiB, rates in tokens/s, the mean time per token split into the
workers' compute and the rest. Ctrl-C ends the answer with a newline, prints ``interrupted``, stops
the local workers cleanly and exits 130; SIGTERM and SIGHUP do the same with 143 and 129.

What runs where:

- **This process, main thread**: all of the above (the generation loop issues the steps and waits
  for each token).
- **This process, client I/O threads**: one per worker (:class:`~zmq_rpc.client.Client`).
- **This process, a tokenizer thread**: builds the tokenizer from the GGUF while the workers lay
  the weights out, then ends.
- **Subprocesses**: without ``--workers``, ``--local-workers`` (2) ``zmq-rpc-worker --threads 1``
  on random loopback ports, each in its own session (a terminal's Ctrl-C reaches this process
  only; it stops them with one SIGTERM each and waits for them).

``main(argv)`` is self-contained: ``python -m zmq_rpc.tools.generate --prompt "..."`` runs it too.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from ..broker.errors import RpcError
from ..worker.launch import add_worker_options, local_workers

if TYPE_CHECKING:   # imported when used: the workers start before the client side loads
    from concurrent.futures import Future

    from ..client import Client
    from ..client.gguf_model import LlamaGGUF
    from ..client.llama import LlamaModel, StepStat
    from ..client.tokenizer import Tokenizer

WIDTH = 100
"""Columns the summary fits in."""
MIB = 1 << 20


def build_parser(prog: str = "zmq-rpc-bench generate") -> argparse.ArgumentParser:
    """The command line of ``generate``."""
    ap = argparse.ArgumentParser(prog=prog, description=(
        "Load a GGUF across workers, stream an answer to the prompt, print its costs."))
    ap.add_argument("--prompt", required=True,
                    help="the user message to answer (with --no-chat: the text to continue)")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="--chat: wrap --prompt as one user message in the model's chat template "
                         "(the GGUF's tokenizer.chat_template; when it has none, the format its vocabulary's turn tokens name (Gemma, Llama 3, Phi-3), else ChatML); "
                         "--no-chat: plain text; default: --chat when the GGUF has a template, "
                         "as llama.cpp's llama-cli does")
    add_worker_options(ap)
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="tokens to generate at most (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut (default)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling mass (default %(default)s: no cut)")
    ap.add_argument("--seed", type=int, default=None,
                    help="sampling seed (default: a fresh one each run)")
    ap.add_argument("--model", default=None, help="GGUF path: a llama, qwen2, qwen3, gemma3 or phi3 model "
                                                       "(default: SmolLM2-135M-Instruct)")
    ap.add_argument("--weights", choices=["quantized", "f32"], default="quantized",
                    help="quantized (default): keep the blocks, repacked once on the workers for "
                         "their numba kernels; f32: dequantize once on the workers (~5x memory)")
    ap.add_argument("--sources", choices=["auto", "upload", "cache", "file"], default="auto",
                    help="where workers get the weights: their own copy of the file "
                         "(--model-dir), their tensor cache (--cache-dir) or an upload; auto "
                         "(default) takes the first each worker has")
    ap.add_argument("--worker-path", default=None,
                    help="the model file's path under the workers' --model-dir (default: its "
                         "file name)")
    ap.add_argument("--kv-dtype", choices=["float32", "float16"], default="float16",
                    help="KV cache element type (default %(default)s)")
    ap.add_argument("--n-ctx", type=int, default=512, help="context length (default %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=32,
                    help="tokens per prefill graph run (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for each request, and for each worker to answer the "
                         "first connection (default %(default)s)")
    ap.add_argument("--trace", action="store_true",
                    help="trace every request and split a token's time into compute, worker "
                         "work, hand-offs and client messaging")
    return ap


class _Clock:
    """Start-up phases, timed back to back from the command's start (so they add up)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []

    def lap(self, name: str) -> float:
        now = time.perf_counter()
        self.parts.append((name, now - self.last))
        self.last = now
        return self.parts[-1][1]


def _status(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ signals


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """The first Ctrl-C (or SIGTERM/SIGHUP) ends the run; any later one waits for the cleanup,
    which is bounded (request timeouts, then each worker's SIGTERM and SIGKILL)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


class _Stop(BaseException):
    """A signal ended the run (a BaseException, like KeyboardInterrupt: nothing catches it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_stop() -> Iterator[None]:
    """While inside (on the main thread), SIGINT, SIGTERM and SIGHUP raise :class:`_Stop`."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, _interrupted) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zmq-rpc-bench generate``; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.max_new_tokens < 1 or (args.workers is None and args.local_workers < 1):
        print("generate: --max-new-tokens and --local-workers must be >= 1", file=sys.stderr)
        return 2
    answer = _Answer(sys.stdout)
    try:
        with _signals_stop():
            _run(args, answer)
    except (_Stop, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, _Stop) else signal.SIGINT
        answer.end()
        print("interrupted" if signum == signal.SIGINT else
              f"stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
        return 128 + signum
    except (RpcError, OSError, ValueError, RuntimeError) as exc:
        answer.end()
        print(f"generate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


class _Answer:
    """The streamed answer on stdout: ended by exactly one newline, however the run ends."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = False
        self.at_line_start = True
        self.ended = False

    def write(self, text: str) -> None:
        if text:
            self.started = True
            self.at_line_start = text.endswith("\n")
            self.out.write(text)
            self.out.flush()

    def end(self, tail: str = "") -> None:
        """Write ``tail`` and end the answer's last line (an answer cut off right after a newline
        of its own gets no second one)."""
        if self.ended:
            return
        self.write(tail)
        if self.started and not self.at_line_start:
            self.out.write("\n")
            self.out.flush()
        self.ended = True


def _run(args: argparse.Namespace, answer: _Answer) -> None:
    clock = _Clock()
    with ExitStack() as stack:
        opened: list[LlamaGGUF] = []

        def meanwhile() -> None:
            """The client's own start-up, while the workers start (each worker answers its
            first client ~0.4 s after exec: imports, then its backend)."""
            _load_client_side()
            clock.lap("imports")
            opened.append(_open_model(args, clock))
        endpoints = stack.enter_context(_endpoints(args, clock, meanwhile))
        from ..client import Client  # loaded while the workers started (meanwhile)
        gguf = opened[0]
        tokenizer = _TokenizerLoad(gguf, stack)
        _status(f"connecting to {len(endpoints)} worker(s)")
        clients = [stack.enter_context(Client(e, timeout=args.timeout,
                                              connect_timeout=args.timeout,
                                              trace=args.trace)) for e in endpoints]
        clock.lap("connect")
        model = _load(args, gguf, clients, clock, sent=tokenizer.start)
        stack.callback(model.close)
        tok = tokenizer.result()
        clock.lap("tokenizer")
        for stage in model.stages:
            _status(f"stage {stage.index}: layers {stage.layers.start}-{stage.layers.stop - 1} "
                    f"on {stage.client.endpoint} ({args.weights} weights)")
        _generate(args, model, tok, answer)
        print(_summary(model, args, clock), file=sys.stderr)


class _TokenizerLoad:
    """The tokenizer, built from the GGUF on a thread of its own once the client has only the
    workers to wait for (the weights sent, the workers laying them out): earlier, its ~0.2 s
    of Python would hold the GIL that the connections and the upload need (a connection's
    HELLO took 0.29 s beside it, 0.015 s alone)."""

    def __init__(self, gguf: LlamaGGUF, stack: ExitStack) -> None:
        from concurrent.futures import ThreadPoolExecutor
        self._gguf = gguf
        self._pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))
        self._future: Future[Tokenizer] | None = None

    def start(self) -> None:
        """Start building it (once; the main thread calls it, from the upload's progress)."""
        if self._future is None:
            self._future = self._pool.submit(_build_tokenizer, self._gguf)

    def result(self) -> Tokenizer:
        self.start()
        assert self._future is not None
        return self._future.result()


def _build_tokenizer(gguf: LlamaGGUF) -> Tokenizer:
    """On the tokenizer thread: its module too (tokenizers, jinja2: ~25 ms of imports)."""
    from ..client.tokenizer import load_tokenizer
    return load_tokenizer(gguf)


@contextmanager
def _endpoints(args: argparse.Namespace, clock: _Clock,
               meanwhile: Callable[[], None]) -> Iterator[list[str]]:
    """The workers' endpoints, ``meanwhile()`` called while local ones start."""
    if args.workers:
        meanwhile()
        yield args.workers
        return
    _status(f"starting {args.local_workers} local worker(s)")
    with local_workers(args.local_workers, "--preload-kernels", own_session=True,
                       meanwhile=meanwhile) as endpoints:
        clock.lap("workers")
        yield endpoints


def _load_client_side() -> None:
    """The client's modules (numpy, zmq, the protocol, the model's, tqdm: ~0.2 s), imported
    while the local workers start rather than before they do (the tokenizer's load on its
    thread)."""
    for module in ("..client", "..client.gguf_model", "..client.llama", "tqdm"):
        importlib.import_module(module, __package__)


def _open_model(args: argparse.Namespace, clock: _Clock) -> LlamaGGUF:
    from ..client.gguf_model import default_model_path, load_gguf

    path = Path(args.model or default_model_path())
    _status(f"opening {path.name}")
    gguf = load_gguf(path)
    seconds = clock.lap("open model")
    _status(f"opened in {seconds:.2f} s: {gguf.config.n_layers} layers, "
            f"{gguf.config.vocab_size:,} tokens, {gguf.tensor_data_bytes / MIB:.1f} MiB of weights")
    return gguf


def _load(args: argparse.Namespace, gguf: LlamaGGUF, clients: list[Client],
          clock: _Clock, sent: Callable[[], None]) -> LlamaModel:
    """The model loaded onto ``clients``; ``sent()`` once the upload is acknowledged (weights
    the workers read from their own disk: no upload, no call)."""
    from ..client.llama import LlamaModel

    bar: Any = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm
            bar = tqdm(desc="upload weights", total=total, unit="iB", unit_scale=True,
                       unit_divisor=1024, file=sys.stderr, leave=True)   # KiB, MiB, MiB/s
        bar.update(done - bar.n)
        if done == total:
            bar.close()    # the rate shown is the upload's, not the layout's
            sent()

    try:
        model = LlamaModel.load(gguf, clients, n_ctx=args.n_ctx, weights=args.weights,
                                kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk,
                                progress=progress, status=_status, sources=args.sources,
                                worker_path=args.worker_path,
                                on_recovery=lambda r: _status(f"\n{r.describe()}"))
    finally:
        if bar is not None:
            bar.close()
    seconds = clock.lap("load")
    stats = model.load_stats
    assert stats is not None
    clock.parts[-1:] = [("kernels", stats.kernel_seconds), ("upload", stats.upload_seconds),
                        ("lay out", stats.build_seconds),
                        ("graphs", seconds - stats.kernel_seconds - stats.upload_seconds
                         - stats.build_seconds)]
    return model


def prompt_ids(args: argparse.Namespace, tok: Tokenizer) -> list[int]:
    """The prompt's token ids: ``--prompt`` as one user message in the model's chat template
    (``--chat``, the default when the GGUF has one), or as plain text (``--no-chat``)."""
    if not (tok.has_chat_template if args.chat is None else args.chat):
        return tok.encode(args.prompt)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]))


def _generate(args: argparse.Namespace, model: LlamaModel, tok: Tokenizer,
              answer: _Answer) -> list[int]:
    decoder = tok.stream_decoder(skip_special_tokens=True)
    try:
        ids = model.generate(prompt_ids(args, tok), args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             seed=args.seed, stream=lambda t: answer.write(decoder.push(t)),
                             stop_ids=tok.eog_ids)
    finally:
        answer.end(decoder.flush())
    return ids


# ------------------------------------------------------------------------------ summary


def _summary(model: LlamaModel, args: argparse.Namespace, clock: _Clock) -> str:
    """The closing report: every sum is printed with its parts, rounded so that they add up."""
    load = model.load_stats
    assert load is not None
    prefill = [s for s in model.stats if s.mode == "prefill"]
    decode = [s for s in model.stats if s.mode == "decode"]
    ready = sum(seconds for _, seconds in clock.parts)
    steps = model.bytes_sent - load.upload_bytes
    lines = [
        *_wrap(f"ready in {ready:.2f} s = " + _parts(clock.parts, ".2f") + " s"),
        f"upload: {load.upload_bytes / MIB:.1f} MiB in {load.upload_seconds:.2f} s = "
        f"{load.upload_bytes / MIB / max(load.upload_seconds, 1e-9):.0f} MiB/s",
        *(f"weights from {s.describe(width=87)}" for s in load.sources),
        f"weights: {load.weight_bytes / MIB:.1f} MiB in the file; on {len(model.stages)} "
        f"worker(s) {load.resident_bytes / MIB:.1f} MiB ({args.weights}) + KV cache "
        f"{load.kv_bytes / MIB:.1f} MiB",
        f"traffic: sent {model.bytes_sent / MIB:.1f} MiB = "
        + _parts([("weights", load.upload_bytes / MIB), ("step inputs", steps / MIB)], ".1f")
        + f" MiB; received {model.bytes_received / MIB:.2f} MiB",
        _rate("prefill", prefill),
        _rate("generation", decode),
    ]
    if decode:
        lines += _per_token(decode, chained=args.temperature <= 0 and model.chain_greedy)
        split = None
        if args.trace:
            from .timing import token_split
            split = token_split([s.client.timings() for s in model.stages],
                                [s.seconds for s in decode])
        if split is not None:
            lines.append(split.line())
    return "\n".join(lines)


def _parts(parts: Sequence[tuple[str, float]], fmt: str) -> str:
    """``name value + ...`` with each value rounded so that the printed values add up to the
    printed total (each is the rounded running sum minus the previous rounded running sum)."""
    out, running, shown = [], 0.0, 0.0
    for name, value in parts:
        running += value
        rounded = float(format(running, fmt))
        out.append(f"{name} {format(rounded - shown, fmt)}")
        shown = rounded
    return " + ".join(out)


def _wrap(line: str) -> list[str]:
    """``line`` cut at `` + `` to fit :data:`WIDTH`, continuation lines indented."""
    lines, current = [], ""
    for piece in line.split(" + "):
        candidate = f"{current} + {piece}" if current else piece
        if len(candidate) > WIDTH and current:
            lines.append(current)
            candidate = "    + " + piece
        current = candidate
    return [*lines, current]


def _rate(what: str, steps: list[StepStat]) -> str:
    tokens, seconds = sum(s.tokens for s in steps), sum(s.seconds for s in steps)
    if not steps or seconds <= 0:
        return f"{what}: -"
    return f"{what}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tokens/s"


def _per_token(decode: list[StepStat], chained: bool) -> list[str]:
    """Mean = compute + the rest (means add up; medians would not), then the spread."""
    n = len(decode)
    mean = sum(s.seconds for s in decode) / n * 1e3
    compute = sum(s.compute for s in decode) / n * 1e3
    split = _parts([("workers' compute", compute), ("overhead", mean - compute)], ".1f")
    times = [s.seconds * 1e3 for s in decode]
    requests = statistics.median(s.messages for s in decode)
    return [
        f"per token: {mean:.1f} ms mean = {split} ms ({(mean - compute) / mean:.1%} overhead)",
        f"    median {statistics.median(times):.1f} ms, range {min(times):.1f}-{max(times):.1f} "
        f"ms over {n} tokens",
        f"    {requests:g} requests per token"
        + ("; each token goes worker to worker, no client round trip" if chained else ""),
    ]


if __name__ == "__main__":
    sys.exit(main())
