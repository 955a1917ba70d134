"""The README and ``docs/``: the example runs against a real worker, the two commands are the ones
``run.py`` documents, and every link between the pages lands on a file and a heading that exist.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE_ENDPOINT = "tcp://127.0.0.1:50052"
"""The endpoint the README's example and worker command use; the test swaps in its own worker's."""


def code_blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M)


@pytest.mark.timeout(120)
def test_the_readme_example_runs_against_a_real_worker(
        spawn_worker: Callable[..., WorkerProcess]) -> None:
    example, = code_blocks(README, "python")
    assert EXAMPLE_ENDPOINT in example and len(example.strip().splitlines()) <= 25
    worker = spawn_worker("--mem", "256MiB")
    code = example.replace(EXAMPLE_ENDPOINT, worker.endpoint)
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["(8, 512)", "[1024. 1024. 1024. 1024.]"], out.stdout


def test_the_readme_shows_the_two_commands_run_py_documents() -> None:
    run_doc = (ROOT / "run.py").read_text()
    for command in ("python3 run.py generate --prompt", "python3 run.py test"):
        in_readme = [line.split("#")[0].strip() for block in code_blocks(README, "bash")
                     for line in block.splitlines() if line.startswith(command)]
        assert len(in_readme) == 1, (command, in_readme)
        assert in_readme[0] in run_doc, in_readme[0]


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_lands() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif fragment and dest.suffix == ".md" and fragment not in {
                    anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}:
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    linked = set(re.findall(r"\]\(docs/([\w.]+\.md)\)", README.read_text()))
    assert linked == {p.name for p in PAGES[1:]}, linked    # the README's table lists every page
