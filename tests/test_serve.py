"""``zmq-rpc-serve`` as its users run it: a real server process on real workers, spoken to by
clients nobody here wrote (the ``openai`` package, ``curl -N``, httpx).

One server on two workers serves most tests; the reference answers come from a
:class:`~zmq_rpc.client.llama.LlamaModel` loaded on the same two workers (its own sessions), with
``generate`` as ``zmq-rpc-bench generate`` runs it. The worker-loss test has a server and a worker
of its own. Every wait is on an event (a metric, a status, a line), with a bound.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("tokenizers")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from zmq_rpc.client import Client  # noqa: E402
from zmq_rpc.worker.launch import ServerProcess, local_workers, worker_argv  # noqa: E402

SERVE = str(Path(sys.executable).with_name("zmq-rpc-serve"))
CTX = 128
CHUNK = 8
MAX_QUEUE = 3
SLOTS = 2
"""The shared server's KV slots (sequences at once)."""
TIMEOUT = 60.0
"""Seconds any one HTTP request may take (a loaded CI machine decodes ~20 tokens/s)."""
DRAIN_EXIT_S = 20.0
"""From SIGTERM to a draining worker's exit: the next step boundary (a step), moving its layers
(a load and a re-prefill, ~2 s here) and closing its session; under the 30 s default
--drain-timeout, so an exit in time is the model's doing."""
LOST_BOUND = 6.0 + 1.0
"""A killed worker's ConnectionLost bound (docs/FAILURES.md) + the step it interrupts."""
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):"]

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.xdist_group("serve"),     # one server and one set of workers
              pytest.mark.skipif(not Path(SERVE).exists(), reason=f"{SERVE} is not installed")]


class Server:
    """A ``zmq-rpc-serve`` subprocess on a free port."""

    def __init__(self, *args: str) -> None:
        self.proc = ServerProcess([SERVE, "--port", "0", "--ctx", str(CTX),
                                   "--prefill-chunk", str(CHUNK), *args])
        self.url = self.proc.wait_ready()
        self.http = httpx.Client(base_url=self.url, timeout=TIMEOUT)

    def openai(self) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=TIMEOUT)

    def metric(self, name: str, **labels: str) -> float:
        """The value of sample ``name`` with ``labels`` in /metrics (0 when absent)."""
        text = self.http.get("/metrics").text
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == name and s.labels == labels)

    def idle(self) -> None:
        """Wait until no request runs or waits (earlier tests' cancelled ones included)."""
        wait_until(lambda: self.metric("zmq_rpc_serve_slots_in_use") == 0
                   and self.metric("zmq_rpc_serve_queue_depth") == 0, TIMEOUT, "server idle")

    def stop(self) -> int:
        self.http.close()
        return self.proc.stop()


class Reference:
    """The same model on the same workers, run as ``zmq-rpc-bench generate`` runs it."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tok = model, tokenizer

    def chat_ids(self, content: str) -> list[int]:
        ids: list[int] = self.tok.encode(self.tok.apply_chat_template(
            [{"role": "user", "content": content}]))
        return ids

    def greedy(self, ids: list[int], max_tokens: int) -> tuple[str, str]:
        """Text and finish reason of a greedy answer of at most ``max_tokens``."""
        out = self.model.generate(ids, max_tokens)
        text = "".join(self.tok.decode_stream(out, skip_special_tokens=True))
        return text, "stop" if out[-1] == self.tok.eos_id else "length"


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    with local_workers(2) as endpoints:
        yield endpoints


@pytest.fixture(scope="module")
def server(workers: list[str]) -> Iterator[Server]:
    serve = Server("--workers", ",".join(workers), "--max-queue", str(MAX_QUEUE),
                   "--slots", str(SLOTS))
    yield serve
    assert serve.stop() == 0, serve.proc.stderr()


@pytest.fixture(scope="module")
def reference(workers: list[str], llama_gguf: Any) -> Iterator[Reference]:
    from zmq_rpc.client.llama import LlamaModel
    from zmq_rpc.client.tokenizer import load_tokenizer
    with Client(workers[0]) as a, Client(workers[1]) as b:
        with LlamaModel.load(llama_gguf, [a, b], n_ctx=CTX, prefill_chunk=CHUNK) as model:
            yield Reference(model, load_tokenizer(llama_gguf))


@pytest.fixture
def idle(server: Server) -> Server:
    server.idle()
    return server


# ------------------------------------------------------------------------- the openai package


def test_models_and_health(idle: Server) -> None:
    models = idle.openai().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    health = idle.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_is_generate_greedy(idle: Server, reference: Reference) -> None:
    done = idle.openai().completions.create(model="any", prompt=PROMPTS[0], max_tokens=12,
                                            temperature=0)
    text, finish = reference.greedy(reference.tok.encode(PROMPTS[0]), 12)
    assert (done.choices[0].text, done.choices[0].finish_reason) == (text, finish)
    assert done.usage.prompt_tokens == len(reference.tok.encode(PROMPTS[0]))
    assert done.usage.completion_tokens == 12 or finish == "stop"


def test_one_slot_on_two_workers_serves(workers: list[str], reference: Reference) -> None:
    """``--slots 1`` over two stages: one lane, whose step the stages take in turn (the server
    once refused to start: two lanes, one per stage, for one slot)."""
    serve = Server("--workers", ",".join(workers), "--slots", "1")
    try:
        done = serve.openai().completions.create(model="any", prompt=PROMPTS[2], max_tokens=8,
                                                 temperature=0)
        text, finish = reference.greedy(reference.tok.encode(PROMPTS[2]), 8)
        assert (done.choices[0].text, done.choices[0].finish_reason) == (text, finish)
    finally:
        assert serve.stop() == 0, serve.proc.stderr()


def test_chat_streamed_and_whole_are_generate_greedy(idle: Server, reference: Reference) -> None:
    question = "What is the capital of France?"
    text, finish = reference.greedy(reference.chat_ids(question), 16)
    client = idle.openai()
    messages = [{"role": "user", "content": question}]
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=16,
                                           temperature=0)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (text, finish)
    chunks = list(client.chat.completions.create(
        model="any", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.prompt_tokens == len(reference.chat_ids(question))


def test_stop_string_cuts_the_answer(idle: Server, reference: Reference) -> None:
    text, _ = reference.greedy(reference.tok.encode(PROMPTS[1]), 16)
    words = text.split(" ")
    stop = " " + words[len(words) // 2]          # a word in the middle, with its space
    cut = text[:text.index(stop)]
    client = idle.openai()
    whole = client.completions.create(model="any", prompt=PROMPTS[1], max_tokens=16,
                                      temperature=0, stop=[stop, "never said"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    pieces = [c.choices[0].text for c in client.completions.create(
        model="any", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == cut


def test_seeded_sampling_repeats(idle: Server) -> None:
    client = idle.openai()

    def sample(seed: int) -> str:
        return str(client.completions.create(
            model="any", prompt=PROMPTS[2], max_tokens=10, temperature=1.0, top_p=0.95,
            seed=seed, extra_body={"top_k": 50}).choices[0].text)
    first = sample(7)
    assert sample(7) == first


def test_concurrent_requests_queue_and_each_is_as_alone(idle: Server,
                                                        reference: Reference) -> None:
    """More requests than slots: they queue (FIFO) and every answer is the one it gets alone."""
    client = idle.openai()
    asks: list[dict[str, Any]] = [
        {"prompt": p, "max_tokens": 4 + 3 * i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    asks[3].update(temperature=0.8, seed=11, top_p=0.9)

    def ask(kwargs: dict[str, Any]) -> tuple[str, str]:
        c = client.completions.create(model="any", **kwargs).choices[0]
        return c.text, c.finish_reason
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(ask, asks))
    for kwargs, answer in zip(asks[:3], together[:3]):
        assert answer == reference.greedy(reference.tok.encode(kwargs["prompt"]),
                                          kwargs["max_tokens"])
    assert together[3] == ask(asks[3])
    assert idle.metric("zmq_rpc_serve_requests_total", route="/v1/completions",
                       status="200") >= len(asks)


# ------------------------------------------------------------------ continuous batching, 32 streams


def test_32_concurrent_streams_each_greedy_one_as_alone(workers: list[str]) -> None:
    """A tiny model served with 16 slots: 32 streams of different lengths and sampling settings
    at once (16 run, 16 wait, joining as others leave); every greedy answer is the one the same
    prompt gets alone, every seeded one the one it gets alone with its seed."""
    from synthetic_models import synthetic_path
    serve = Server("--model", str(synthetic_path("llama3")), "--workers", ",".join(workers),
                   "--slots", "16", "--max-queue", "64")
    try:
        client = serve.openai()
        asks: list[dict[str, Any]] = []
        for i in range(32):
            ask: dict[str, Any] = {"prompt": f"{PROMPTS[i % 4]} {i} " * (1 + i % 5),
                                   "max_tokens": 3 + (7 * i) % 23, "temperature": 0,
                                   "stream": i % 2 == 0}
            if i % 4 == 3:
                ask.update(temperature=0.9, top_p=0.9, seed=100 + i, extra_body={"top_k": 40})
            asks.append(ask)

        def run(kwargs: dict[str, Any]) -> tuple[str, str | None]:
            if kwargs["stream"]:
                text, finish = "", None
                for chunk in client.completions.create(model="any", **kwargs):
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                return text, finish
            c = client.completions.create(model="any", **kwargs).choices[0]
            return c.text, c.finish_reason
        with ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(run, asks))
        assert serve.metric("zmq_rpc_serve_requests_total", route="/v1/completions",
                            status="200") == len(asks)
        for kwargs, answer in zip(asks, together):
            assert answer == run(kwargs), kwargs
    finally:
        assert serve.stop() == 0, serve.proc.stderr()

# ------------------------------------------------------------------------------ curl -N (SSE)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_reads_the_event_stream(idle: Server, reference: Reference) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out = subprocess.run(["curl", "-sS", "-N", "--max-time", str(TIMEOUT),
                          "-H", "Content-Type: application/json", "-d", json.dumps(body),
                          idle.url + "/v1/completions"],
                         capture_output=True, text=True, check=True, timeout=TIMEOUT).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == reference.greedy(reference.tok.encode(PROMPTS[0]), 6)[0]
    assert chunks[-1]["usage"]["completion_tokens"] == 6


# --------------------------------------------------------------------- refusals and departures


def test_bad_requests_get_openai_errors(idle: Server) -> None:
    client = idle.openai()
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="any", prompt="word " * CTX, max_tokens=4)
    assert too_long.value.status_code == 400
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model="any", prompt="a", n=2)
    assert many.value.param == "n"
    broken = idle.http.post("/v1/chat/completions", content=b"{not json")
    assert broken.status_code == 400
    assert set(broken.json()["error"]) == {"message", "type", "param", "code"}
    huge = idle.http.post("/v1/completions", content=b" " * (16 << 20) + b"{}")
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "too_large"
    assert idle.http.get("/health").status_code == 200


def test_a_disconnect_frees_the_slot(idle: Server) -> None:
    cancelled = idle.metric("zmq_rpc_serve_sequences_finished_total", reason="cancelled")
    body = {"prompt": PROMPTS[1], "max_tokens": CTX, "temperature": 0, "stream": True}
    with httpx.Client(base_url=idle.url, timeout=TIMEOUT) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line).startswith("data: ")
    wait_until(lambda: idle.metric("zmq_rpc_serve_sequences_finished_total",
                                   reason="cancelled") == cancelled + 1, TIMEOUT,
               "the server cancelled the stream")
    done = idle.openai().completions.create(model="any", prompt=PROMPTS[0], max_tokens=2,
                                            temperature=0)
    assert done.usage.completion_tokens == 2


def test_a_client_gone_before_its_json_answer_frees_the_slot(idle: Server) -> None:
    """Without a stream too: the server watches the connection while the answer is made."""
    asyncio.run(_leave_mid_answer(idle))


async def _leave_mid_answer(server: Server) -> None:
    cancelled = server.metric("zmq_rpc_serve_sequences_finished_total", reason="cancelled")
    body = {"prompt": PROMPTS[1], "max_tokens": CTX, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
        answer = asyncio.create_task(http.post("/v1/completions", json=body))
        while server.metric("zmq_rpc_serve_generated_tokens_total") == 0 or \
                server.metric("zmq_rpc_serve_slots_in_use") == 0:
            assert not answer.done(), "it answered"
            await asyncio.sleep(0.01)
        answer.cancel()                            # closes its connection
    await asyncio.to_thread(wait_until, lambda: server.metric(
        "zmq_rpc_serve_sequences_finished_total", reason="cancelled") == cancelled + 1,
        TIMEOUT, "the server cancelled the request")


def test_a_full_queue_answers_429(idle: Server) -> None:
    asyncio.run(_fill_the_queue(idle))
    idle.idle()                             # the queued requests were cancelled with the holder


async def _fill_the_queue(server: Server) -> None:
    long = {"prompt": PROMPTS[1], "max_tokens": CTX, "temperature": 0, "stream": True}
    short = {"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
        async with AsyncExitStack() as holders:       # every slot taken
            for _ in range(SLOTS):
                holder = await holders.enter_async_context(
                    http.stream("POST", "/v1/completions", json=long))
                assert holder.status_code == 200      # headers come with its first token
            waiting = [asyncio.create_task(http.post("/v1/completions", json=short))
                       for _ in range(MAX_QUEUE)]
            while server.metric("zmq_rpc_serve_queue_depth") < MAX_QUEUE:
                assert not any(t.done() for t in waiting), "a queued request was answered"
                await asyncio.sleep(0.01)
            refused = await http.post("/v1/completions", json=short)
            for task in waiting:
                task.cancel()
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"


# ----------------------------------------------------------------------------- a worker lost


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error() -> None:
    worker = ServerProcess(worker_argv())
    try:
        serve = Server("--workers", worker.wait_ready())
        try:
            _kill_mid_stream(serve, worker)
        finally:
            assert serve.stop() == 0, serve.proc.stderr()
    finally:
        worker.stop()


def _kill_mid_stream(serve: Server, worker: ServerProcess) -> None:
    client = serve.openai()
    stream = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=CTX, temperature=0, stream=True)
    got = []
    with pytest.raises(openai.APIError) as ended:
        for chunk in stream:
            got.append(chunk.choices[0].delta.content)
            if len(got) == 3:
                worker.proc.kill()
    assert "worker is gone" in str(ended.value.message)
    assert len(got) < CTX
    wait_until(lambda: serve.http.get("/health").status_code == 503, LOST_BOUND,
               "/health says 503")
    assert "worker is gone" in serve.http.get("/health").json()["error"]
    assert serve.proc.proc.poll() is None                      # it stays up, and says so
    assert serve.http.get("/v1/models").status_code == 200
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="any", prompt="hi", max_tokens=2)
    assert refused.value.status_code == 503
    assert serve.metric("zmq_rpc_serve_healthy") == 0


def test_streams_go_on_across_a_killed_worker() -> None:
    """4 concurrent streams on 3 workers; one worker (at random) killed with SIGKILL once every
    stream has text and none has ended: every stream ends as it did without the fault (the same
    text, finish and token count: no token lost or repeated), /health stays 200, and the
    recovery is counted in /metrics."""
    workers = [ServerProcess(worker_argv()) for _ in range(3)]
    try:
        serve = Server("--workers", ",".join(w.wait_ready() for w in workers), "--slots", "4")
        try:
            expected = _four_streams(serve, None)
            victim = random.choice(workers)
            assert _four_streams(serve, victim) == expected, f"killed {victim.endpoint}"
            assert victim.proc.poll() is not None                    # it was killed mid-stream
            assert serve.http.get("/health").status_code == 200
            assert serve.metric("zmq_rpc_serve_recoveries_total", outcome="moved") == 1
            assert serve.metric("zmq_rpc_serve_recovery_seconds_count", part="total") == 1
            assert serve.metric("zmq_rpc_serve_healthy") == 1
            assert serve.metric("zmq_rpc_serve_sequences_finished_total", reason="error") == 0
            assert f"worker {victim.endpoint} lost" in serve.proc.stderr()    # logged
        finally:
            assert serve.stop() == 0, serve.proc.stderr()
    finally:
        for worker in workers:
            worker.stop()


def test_streams_go_on_across_a_worker_that_drains() -> None:
    """4 concurrent streams on 3 workers (default settings); one worker (at random) sent
    SIGTERM once every stream has text and none has ended: it drains (--drain-timeout's
    default), the model moves its layers off at the next step, every stream ends as it did
    without it, /health stays 200, the drain is counted, and the worker exits 0 by itself
    once the server closed its session (long before its drain timeout)."""
    workers = [ServerProcess(worker_argv(drain_timeout=None)) for _ in range(3)]
    try:
        serve = Server("--workers", ",".join(w.wait_ready() for w in workers), "--slots", "4")
        try:
            expected = _four_streams(serve, None)
            victim = random.choice(workers)
            signalled = [0.0]

            def drain(worker: ServerProcess) -> None:
                signalled[0] = time.monotonic()
                worker.proc.send_signal(signal.SIGTERM)
            assert _four_streams(serve, victim, drain) == expected, f"drained {victim.endpoint}"
            assert victim.proc.wait(DRAIN_EXIT_S) == 0
            assert time.monotonic() - signalled[0] < DRAIN_EXIT_S
            assert serve.http.get("/health").status_code == 200
            assert serve.metric("zmq_rpc_serve_recoveries_total", outcome="drained") == 1
            assert serve.metric("zmq_rpc_serve_recoveries_total", outcome="moved") == 0
            assert serve.metric("zmq_rpc_serve_sequences_finished_total", reason="error") == 0
            assert f"worker {victim.endpoint} drained" in serve.proc.stderr()    # logged
        finally:
            assert serve.stop() == 0, serve.proc.stderr()
    finally:
        for worker in workers:
            worker.stop()


def test_a_worker_added_over_http_takes_over_layers() -> None:
    """``POST /admin/workers`` with a third worker's endpoint while 4 streams run: it joins at
    a step boundary (counted, logged), and every stream ends as it did on two workers."""
    workers = [ServerProcess(worker_argv(drain_timeout=None)) for _ in range(3)]
    try:
        endpoints = [w.wait_ready() for w in workers]
        serve = Server("--workers", ",".join(endpoints[:2]), "--slots", "4")
        try:
            expected = _four_streams(serve, None)

            def join(worker: ServerProcess) -> None:
                added = serve.http.post("/admin/workers", json={"endpoint": worker.endpoint})
                assert added.status_code == 202, added.text
            assert _four_streams(serve, workers[2], join) == expected
            wait_until(lambda: serve.metric("zmq_rpc_serve_recoveries_total",
                                            outcome="joined") == 1, TIMEOUT, "joined")
            assert f"worker {endpoints[2]} joined" in serve.proc.stderr()
            again = serve.http.post("/admin/workers", json={"endpoint": "tcp://nowhere"})
            assert again.status_code == 400, again.text
        finally:
            assert serve.stop() == 0, serve.proc.stderr()
    finally:
        for worker in workers:
            worker.stop()


def test_admin_workers_answers_loopback_clients_only() -> None:
    """The route that places weights on a machine of the caller's choosing: a request from any
    address but loopback gets 403 before anything is read or connected (the ASGI app as uvicorn
    runs it, the client's address as the server would see it; no traffic off this host)."""
    from starlette.testclient import TestClient
    from zmq_rpc.client.serve.app import build_app
    from zmq_rpc.client.serve.metrics import ServeMetrics
    connected: list[str] = []
    engine: Any = type("Engine", (), {"metrics": ServeMetrics()})()

    def connect(endpoint: str) -> Any:
        connected.append(endpoint)
        raise AssertionError("connected for a refused caller")
    app = build_app(engine, None, "m", connect)  # type: ignore[arg-type]
    for host in ("192.0.2.7", "10.1.2.3", "2001:db8::1", "testclient"):
        with TestClient(app, client=(host, 50000)) as http:
            refused = http.post("/admin/workers", json={"endpoint": "tcp://127.0.0.1:9"})
        assert refused.status_code == 403, (host, refused.text)
        assert refused.json()["error"]["code"] == "forbidden"
    with TestClient(app, client=("::1", 50000)) as http:
        bad = http.post("/admin/workers", json={"endpoint": 7})
    assert bad.status_code == 400 and connected == []


def _four_streams(serve: Server, victim: ServerProcess | None,
                  fault: Callable[[ServerProcess], None] = lambda w: w.proc.kill()
                  ) -> list[tuple[str, str, int]]:
    """Each stream's text, finish reason and completion tokens; ``fault(victim)`` (a kill) runs
    once every stream has had text and none has ended."""
    client = serve.openai()
    done = threading.Event()
    lock = threading.Lock()
    seen = [0] * len(PROMPTS)
    ended = [False] * len(PROMPTS)

    def run(i: int) -> tuple[str, str, int]:
        text, finish, used = "", "", -1
        for chunk in client.completions.create(
                model="any", prompt=PROMPTS[i], max_tokens=24 + 8 * i, temperature=0,
                stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            with lock:
                seen[i] += bool(chunk.choices[0].text)
                ended[i] = ended[i] or bool(finish)
                if victim is not None and not done.is_set() and min(seen) >= 2 \
                        and not any(ended):
                    done.set()
                    fault(victim)
        return text, finish, used
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(run, range(len(PROMPTS))))


# ------------------------------------------------------------------ its own workers, SIGTERM


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_stops_the_server_and_its_local_workers() -> None:
    serve = Server("--local-workers", "1")
    workers = _children(serve.proc.proc.pid)
    assert len(workers) == 1
    done = serve.openai().completions.create(model="any", prompt="Hi", max_tokens=1)
    assert done.usage.completion_tokens == 1
    assert serve.stop() == 0
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def _children(parent: int) -> list[int]:
    """The pids whose parent is ``parent``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids
