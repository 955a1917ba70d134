"""``run.py``, the two-command entry point: when it reinstalls, and what counts as a failed test run.

Its real path (a fresh clone, ``python3 run.py test``) is what CI runs (``.ci/run``); these check
the decisions inside it without installing anything.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def load_run_script(root: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_script", ROOT / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ROOT = root
    return module


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what the setup stamp reads: the packaging files and the package folders."""
    for name in ("setup.cfg", "pyproject.toml", "run.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("broker", "worker", "client", "tools"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_setup_stamp_changes_only_with_what_the_install_depends_on(tree: Path) -> None:
    run = load_run_script(tree)
    key = run.setup_key()
    assert run.setup_key() == key                               # a second run: no reinstall
    (tree / "worker" / "dispatch" / "executor.py").write_text("# edited\n")
    assert run.setup_key() == key                               # an edit: the editable sees it
    (tree / "README.md").write_text("docs\n")
    assert run.setup_key() == key
    (tree / "worker" / "new_module.py").write_text("")
    with_new_file = run.setup_key()
    assert with_new_file != key                                 # the link tree needs the file
    with (tree / "setup.cfg").open("a") as cfg:
        cfg.write("\n# a changed dependency\n")
    assert run.setup_key() != with_new_file


@pytest.mark.parametrize(("pytest_code", "expected"), [(0, 0), (1, 1), (5, 1)])
def test_a_test_run_that_collects_nothing_fails(tree: Path, monkeypatch: pytest.MonkeyPatch,
                                                pytest_code: int, expected: int) -> None:
    run = load_run_script(tree)
    ran: list[str] = []

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[bytes]:
        ran.append(Path(argv[0]).name)
        return subprocess.CompletedProcess(argv, pytest_code if ran[-1] == "pytest" else 0)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    assert run.test(["-q"]) == expected
    assert ran == ["ruff", "mypy", "pytest"]


def test_ruff_or_mypy_findings_stop_the_run_before_pytest(tree: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    run = load_run_script(tree)
    ran: list[str] = []

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[bytes]:
        ran.append(Path(argv[0]).name)
        return subprocess.CompletedProcess(argv, 1 if ran[-1] == "mypy" else 0)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    assert run.test([]) == 1
    assert ran == ["ruff", "mypy"]


@pytest.mark.parametrize(("args", "parallel"), [
    ([], True), (["-q", "tests/test_cli.py"], True), (["-n", "0"], False), (["-n0"], False),
    (["--numprocesses=3"], False), (["-p", "no:xdist"], False)])
def test_pytest_runs_on_several_processes_unless_told_otherwise(
        tree: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], parallel: bool) -> None:
    run = load_run_script(tree)
    calls: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[bytes]:
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    monkeypatch.setattr(run, "optional_tools", lambda: None)
    assert run.test(args) == 0
    pytest_argv = calls[-1][1:]
    assert pytest_argv == ([*run.PYTEST_PROCESSES, *args] if parallel else args)
