"""No import circles in the package (issue 25.3): the import graph read from the source with ast.

Every import counts: at module level, inside functions (imported on use) and under
``if TYPE_CHECKING`` (type-only), absolute (``zmq_rpc.x.y``) and relative (``from ..x import y``,
``from . import y`` where ``y`` is a module). A circle fails the test, which prints each one as a
path of modules. The graph is the package's own files, so a new module is checked without a list.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("broker", "worker", "client", "tools")


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's ``__init__``)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for folder in PACKAGE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join(["zmq_rpc", *parts])] = (path, is_package)
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``import from`` names."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package modules ``module`` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return (found & known) - {module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    known = set(modules)
    return {name: imports_of(name, path, is_package, known)
            for name, (path, is_package) in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan's algorithm,
    iterative), as a path that starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [_path_in(component, graph) for component in components]


def _path_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest circle through the component's first module (breadth first, inside it)."""
    first = min(component)
    parents: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(parents[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle in {sorted(component)}")


def _describe(path: list[str], graph: dict[str, set[str]]) -> str:
    """The circle, then every module that reaches and is reached from it (its whole knot)."""
    knot = sorted(m for m in graph if _reaches(graph, path[0], m) and _reaches(graph, m, path[0]))
    return (" -> ".join(m.removeprefix("zmq_rpc.") for m in path)
            + f"\n    (a knot of {len(knot)}: {', '.join(m.removeprefix('zmq_rpc.') for m in knot)})")


def _reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, todo = {src}, [src]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == dst:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_the_finder_sees_every_import_form(tmp_path: Path) -> None:
    """A throwaway tree with one circle per import form: each must be found."""
    files = {
        "broker/__init__.py": "",
        "broker/a.py": "from .b import x\n",                                 # relative
        "broker/b.py": "from typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from zmq_rpc.broker.a import y\n",  # type-only, absolute
        "worker/__init__.py": "",
        "worker/sub/__init__.py": "",
        "worker/sub/c.py": "from . import d\n",                              # ``from . import`` a module
        "worker/sub/d.py": "def f() -> None:\n    from ..sub import c\n",    # on use, ``..``
        "client/__init__.py": "",
        "client/e.py": "import zmq_rpc.client.f\n",                          # plain import
        "client/f.py": "from zmq_rpc.client import e\n",
        "tools/__init__.py": "",
        "tools/g.py": "from ..broker import a\n",                            # no circle
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = sorted(circles(import_graph(tmp_path)))
    assert found == [["zmq_rpc.broker.a", "zmq_rpc.broker.b", "zmq_rpc.broker.a"],
                     ["zmq_rpc.client.e", "zmq_rpc.client.f", "zmq_rpc.client.e"],
                     ["zmq_rpc.worker.sub.c", "zmq_rpc.worker.sub.d", "zmq_rpc.worker.sub.c"]]


def test_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    report = "\n".join(_describe(path, graph) for path in found)
    assert not found, f"{len(found)} import circle(s):\n{report}"


def test_the_worker_and_the_wire_import_no_client_and_no_tools() -> None:
    """The layers: broker (the wire) <- worker, client <- tools. A worker process loads no client
    code, and nothing but tools imports tools (the ``status`` subcommand is chosen above both,
    in :mod:`zmq_rpc.tools.worker_command`)."""
    graph = import_graph()
    below = {"zmq_rpc.broker": ("zmq_rpc.worker", "zmq_rpc.client", "zmq_rpc.tools"),
             "zmq_rpc.worker": ("zmq_rpc.client", "zmq_rpc.tools"),
             "zmq_rpc.client": ("zmq_rpc.tools",)}
    wrong = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                   for layer, above in below.items()
                   if (m == layer or m.startswith(layer + ".")) and t.startswith(above))
    assert not wrong, "imports up the layers:\n" + "\n".join(wrong)
