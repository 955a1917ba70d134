"""``zmq-rpc-bench generate``: load a llama GGUF across workers, stream an answer, print its costs.

What runs where:

- **This process, main thread**: parsing, loading the model (a tqdm bar on stderr shows the upload
  in bytes, bytes/s and ETA), tokenizing with the GGUF's chat template, the generation loop (one
  round trip per token), streaming text to stdout as it completes (:class:`StreamDecoder`), and
  the summary.
- **This process, client I/O threads**: one per worker (:class:`~zmq_rpc.client.Client`).
- **Subprocesses**: without ``--workers``, ``--local-workers`` (2) ``zmq-rpc-worker --threads 1``
  on random loopback ports, stopped with SIGTERM and waited for at the end.

``main(argv)`` is self-contained: ``python -m zmq_rpc.tools.generate --prompt "..."`` runs it too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from tqdm import tqdm

from ..client import Client, RpcError
from ..client.gguf_model import default_model_path, load_gguf
from ..client.llama import LlamaModel, StepStat
from ..client.tokenizer import load_tokenizer
from .bench import local_workers, sigterm_exits

MEMORY_BANDWIDTH = 14e9
"""Bytes/s a CPU streams from memory: the floor is weight bytes read per token over this."""


def build_parser(prog: str = "zmq-rpc-bench generate") -> argparse.ArgumentParser:
    """The command line of ``generate``."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", required=True, help="the user message (the chat template is applied)")
    ap.add_argument("--workers", type=_csv, default=None,
                    help="comma-separated worker endpoints, one pipeline stage each "
                         "(default: start --local-workers local workers)")
    ap.add_argument("--local-workers", type=int, default=2,
                    help="workers to start when --workers is not given (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--weights", choices=["f32", "quantized"], default="f32",
                    help="f32: dequantize once on the workers (default, faster); quantized: "
                         "keep Q4_1/Q8_0 blocks and dequantize inside every matmul")
    ap.add_argument("--sources", choices=["auto", "upload", "cache", "file"], default="auto",
                    help="where workers get the weights: their own copy of the file "
                         "(--model-dir), their tensor cache (--cache-dir) or an upload; auto "
                         "(default) takes the first each worker has")
    ap.add_argument("--worker-path", default=None,
                    help="the model file's path under the workers' --model-dir (default: its "
                         "file name)")
    ap.add_argument("--kv-dtype", choices=["float32", "float16"], default="float32")
    ap.add_argument("--n-ctx", type=int, default=512, help="context length (default %(default)s)")
    ap.add_argument("--prefill-chunk", type=int, default=32,
                    help="tokens per prefill graph run (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    return ap


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@contextmanager
def _endpoints(args: argparse.Namespace) -> Iterator[list[str]]:
    if args.workers:
        yield args.workers
        return
    with local_workers(args.local_workers) as endpoints:
        yield endpoints


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zmq-rpc-bench generate``; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.max_new_tokens < 1 or (args.workers is None and args.local_workers < 1):
        print("generate: --max-new-tokens and --local-workers must be >= 1", file=sys.stderr)
        return 2
    try:
        _run(args)
    except (RpcError, OSError, ValueError) as exc:
        print(f"generate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> None:
    with sigterm_exits(), ExitStack() as stack:
        endpoints = stack.enter_context(_endpoints(args))
        clients = [stack.enter_context(Client(e, timeout=args.timeout)) for e in endpoints]
        model = _load(args, clients)
        stack.callback(model.close)
        print(f"model: {model}", file=sys.stderr)
        _generate(args, model)
        print(_summary(model, args), file=sys.stderr)


def _load(args: argparse.Namespace, clients: list[Client]) -> LlamaModel:
    gguf = load_gguf(args.model or default_model_path())
    with tqdm(desc="upload weights", unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, leave=True) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            if done == total:
                bar.close()    # the rate shown is the upload's, not the dequantization's

        return LlamaModel.load(gguf, clients, n_ctx=args.n_ctx, weights=args.weights,
                               kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk,
                               progress=progress, sources=args.sources,
                               worker_path=args.worker_path)


def _generate(args: argparse.Namespace, model: LlamaModel) -> list[int]:
    tok = load_tokenizer(model.gguf)
    prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    decoder = tok.stream_decoder(skip_special_tokens=True)

    def stream(token_id: int) -> None:
        sys.stdout.write(decoder.push(token_id))
        sys.stdout.flush()

    ids = model.generate(tok.encode(prompt), args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=stream)
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    return ids


def _summary(model: LlamaModel, args: argparse.Namespace) -> str:
    """The closing report: load, bytes, prefill and generation rates, overhead, floor."""
    load = model.load_stats
    assert load is not None
    prefill = [s for s in model.stats if s.mode == "prefill"]
    decode = [s for s in model.stats if s.mode == "decode"]
    lines = [
        f"load: {load.total_seconds:.2f} s; weights in place in {load.upload_seconds:.2f} s, "
        f"{load.upload_bytes / 1e6:.1f} MB of them sent = {load.upload_gbps:.2f} GB/s effective"
        + f"; {'dequantize to f32' if args.weights == 'f32' else 'lay out'} on the workers "
          f"{load.build_seconds:.2f} s",
        *(f"weights from {s.describe()}" for s in load.sources),
        (f"weights: {load.weight_bytes / 2**20:.1f} MiB compact; "
         f"{load.resident_bytes / 2**20:.1f} MiB on {len(model.stages)} worker(s); "
         f"KV cache {load.kv_bytes / 2**20:.1f} MiB"),
        f"bytes sent {_size(model.bytes_sent)} (weights and step inputs), "
        f"received {_size(model.bytes_received)}",
        _rate("prefill", prefill),
        _rate("generation", decode),
    ]
    if decode:
        per_token = statistics.median(s.seconds for s in decode)
        compute = statistics.median(s.compute for s in decode)
        overhead = statistics.median(s.seconds - s.compute for s in decode)
        lines.append(
            f"per token: {per_token * 1e3:.1f} ms median = {compute * 1e3:.1f} ms compute on the "
            f"workers (as they report it) + {overhead * 1e3:.2f} ms overhead "
            f"({overhead / per_token:.1%}); {statistics.median(s.messages for s in decode):g} "
            f"messages per token, no client round trip between tokens when greedy")
    lines.append(_floor(model))
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _rate(what: str, steps: list[StepStat]) -> str:
    tokens, seconds = sum(s.tokens for s in steps), sum(s.seconds for s in steps)
    if not steps or seconds <= 0:
        return f"{what}: -"
    return f"{what}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tokens/s"


def _floor(model: LlamaModel) -> str:
    compact = model.weight_bytes
    read = _bytes_read_per_token(model)
    return (f"floor at {MEMORY_BANDWIDTH / 1e9:g} GB/s: {compact / MEMORY_BANDWIDTH * 1e3:.1f} "
            f"ms/token for {compact / 1e6:.1f} MB of compact weights; this mode reads "
            f"{read / 1e6:.1f} MB per token = {read / MEMORY_BANDWIDTH * 1e3:.1f} ms")


def _bytes_read_per_token(model: LlamaModel) -> int:
    """Weight bytes one decode step streams: the f32 copies, or the compact blocks."""
    gguf = model.gguf
    matmul = [t for t in gguf.tensors.values() if t.qtype in ("q4_1", "q8_0")]
    if model.weights == "f32":
        return sum(4 * t.n_elements for t in matmul)
    return sum(t.nbytes for t in matmul)


if __name__ == "__main__":
    sys.exit(main())
