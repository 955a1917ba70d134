"""The package's imports form no circle: every import counts, the ones under ``TYPE_CHECKING``
and inside functions too (read from the source with ``ast``, so nothing is imported here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "worker", "client", "tools")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES
            for path in (ROOT / package).rglob("*.py")}


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, wherever the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.level, node.module)
            for alias in node.names:
                target = f"{base}.{alias.name}" if base else alias.name
                found.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name.removeprefix("zmq_rpc."))
    return {module for module in found if module in known and module != name}


def _resolve(package: str, level: int, module: str | None) -> str:
    if level == 0:
        return (module or "").removeprefix("zmq_rpc.")
    parts = package.split(".") if package else []
    base = parts[:len(parts) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imported(name, path, known) for name, path in known.items()}


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _circles(graph: dict[str, set[str]], scope: str,
             exclude: tuple[str, ...] = ()) -> list[list[str]]:
    """The strongly connected components of more than one module among the modules of
    ``scope`` (a dotted prefix) but those of ``exclude``, by Tarjan's algorithm."""
    nodes = {n for n in graph
             if _inside(n, scope) and not any(_inside(n, e) for e in exclude)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node] & nodes:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def test_the_scanner_finds_a_circle() -> None:
    graph = {"client.a": {"client.b"}, "client.b": {"client.c"}, "client.c": {"client.a"},
             "client.d": {"client.a"}}
    assert _circles(graph, "client") == [["client.a", "client.b", "client.c"]]


def test_the_scanner_reads_type_only_and_relative_imports() -> None:
    graph = _graph()
    assert "client.calls" in graph["client.loop"]                  # from .calls import ...
    assert "broker.protocol" in graph["client.loop"]               # from ..broker import protocol
    assert "client.session" in graph["client.remote"]


@pytest.mark.parametrize(("scope", "exclude"), [("client", ("client.llama",))])
def test_no_import_circles(scope: str, exclude: tuple[str, ...]) -> None:
    """No circle among the modules of ``scope``: what two modules share lives in a leaf."""
    assert _circles(_graph(), scope, exclude) == []
