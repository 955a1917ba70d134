"""Build the ahead-of-time kernels that :mod:`.aot` loads: numba's kernels through ``numba.pycc``.

Runs in a process of its own (``python -m zmq_rpc.worker.kernels --aot``; ``run.py``'s setup runs it
once after compiling numba's cache), main thread; owns nothing past the build.

What is exported: every entry point of :data:`.jit.KERNELS`, :data:`.intgemm.GEMM`,
:data:`.jit.PACK`, the activation rounding, the f16/bf16 GEMMs and the fused ops, once per
argument types it has after :func:`.warm` of every type (one thread) and the fused warm-up: the
types the worker calls them with. A product's or repack's inputs (parameters in :data:`INPUTS`)
are exported read-only, which takes writable arrays too (a model's GGUF weights are read-only
maps: numba compiles them a specialization of their own). The fused ops keep their warmed types
exactly (numba refuses the others, and so does :mod:`.aot`).

Each export is a trampoline compiled by pycc that calls the numba kernel, so the kernel itself is
compiled by numba with its own options (``fastmath``, ``error_model``: pycc would compile an
exported function with defaults) and the machine code is numba's; and pycc is told to release the
GIL in its wrappers as ``nogil=True`` kernels do (pycc has no option for it: its ``Flags`` are
replaced for the build), so the broker thread runs while a kernel computes.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Final

import numpy as np
from numba import types

from . import QTYPES, aot, fused_kernels, set_threads, warm

__all__ = ["INPUTS", "build"]

with warnings.catch_warnings():     # pycc is pending deprecation since numba 0.57 (docs/DESIGN.md)
    warnings.simplefilter("ignore", PendingDeprecationWarning)
    _pycc: Any = importlib.import_module("numba.pycc")
    _pycc_compiler: Any = importlib.import_module("numba.pycc.compiler")

INPUTS: Final = frozenset({"w", "x", "src", "xq1", "xq2", "dx", "sq", "sx", "xl", "cfg"})
"""Parameters that products and repacks only read (their arrays are exported read-only)..."""
INPUTS_OF: Final = {"intgemm.quantize_rows_into": frozenset({"x"})}
"""... except where an entry point writes some of them."""


def _entry_points() -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(entry name -> numba kernel, the tables by entry names, whether AMX runs here)."""
    from . import amxgemm, halfgemm, intgemm, jit
    entries: dict[str, Any] = {}

    def name(kernel: Any) -> str:
        label = f"{kernel.py_func.__module__.rsplit('.', 1)[1]}.{kernel.py_func.__name__}"
        entries[label] = kernel
        return label

    tables = {
        "KERNELS": {q: [name(mv), name(dq), list(flags)] for q, (mv, dq, flags) in jit.KERNELS.items()},
        "GEMM": {q: [name(fn), list(flags)] for q, (fn, flags) in intgemm.GEMM.items()},
        "PACK": {q: [name(fn), list(flags), u16] for q, (fn, flags, u16) in jit.PACK.items()},
    }
    for kernel in (intgemm.quantize_rows_into, halfgemm.gemm_u16):
        name(kernel)
    amx = amxgemm.available()
    if amx:
        name(amxgemm.gemm_amx)
        name(amxgemm.split_rows)
    module = fused_kernels()
    assert module is not None
    for op in aot.FUSED:
        name(getattr(module, op))
    return entries, tables, amx


def _warm_all() -> None:
    """Every entry point called with the types the worker gives it."""
    from . import halfgemm
    set_threads(1)
    for qtype in QTYPES:
        warm(qtype)
    w, x, y = np.zeros((16, 64), np.uint8), np.zeros((3, 16), np.float32), np.empty((3, 16), np.float32)
    halfgemm.gemm_u16(w, x, y, 0, 16, False)    # where AMX runs, warm() took the AMX kernel instead


def _describe(t: Any, writes: bool) -> list[Any] | None:
    """The manifest's form of numba type ``t`` (None: not one :mod:`.aot` can guard)."""
    if isinstance(t, types.Array):
        if t.layout not in ("C", "A"):
            return None
        return ["array", str(np.dtype(str(t.dtype))), t.ndim, t.layout, writes]
    label = "bool" if t == types.boolean else str(t)
    return ["scalar", label] if label in aot.SCALARS else None


def _exports(label: str, kernel: Any) -> list[tuple[types.Type, list[Any], Any]]:
    """(export signature, manifest types, kernel) for each warmed specialization of ``kernel``."""
    params = list(inspect.signature(kernel.py_func).parameters)
    relax = not label.startswith("fused.")
    found: dict[tuple[Any, ...], tuple[Any, list[Any], Any]] = {}
    for args in kernel.signatures:
        if any(isinstance(t, types.Literal) for t in args):
            continue        # a call from numba code (the row splits): Python never passes literals
        ret = kernel.overloads[args].signature.return_type
        out, described = [], []
        for param, t in zip(params, args):
            reads = relax and param in INPUTS_OF.get(label, INPUTS) and isinstance(t, types.Array)
            t = t.copy(readonly=True) if reads else t
            out.append(t)
            described.append(_describe(t, isinstance(t, types.Array) and t.mutable and not reads))
        if None in described or len(args) != len(params):
            print(f"aot: {label}{args}: not exported (types the guard cannot check)", flush=True)
            continue
        found.setdefault(tuple(out), (ret(*out), described, kernel))
    return list(found.values())


def _trampoline(kernel: Any, arity: int) -> Any:
    """A Python function that calls ``kernel``: what pycc compiles (module docstring)."""
    params = ", ".join(f"a{i}" for i in range(arity))
    scope = {"kernel": kernel}
    exec(f"def trampoline({params}):\n    return kernel({params})\n", scope)   # noqa: S102
    return scope["trampoline"]


def _releasing(flags_type: Any) -> Any:
    """pycc's compile flags with the GIL released around each call (module docstring)."""
    def flags(*args: Any, **kwargs: Any) -> Any:
        made = flags_type(*args, **kwargs)
        made.release_gil = True
        return made
    return flags


def build(base: Path | None = None) -> Path:
    """Build the module for this process's :func:`.aot.key` (warming numba's kernels first: from its
    cache when there); its folder. Raises RuntimeError where it cannot (no C compiler, a folder
    it cannot write, ...), before the warm-up where it can tell."""
    dest = aot.folder(base)
    if aot.load(dest) is not None:
        print(f"aot: kernels built ahead of time already: {dest}", flush=True)
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="aot-", dir=dest.parent))
    except OSError as exc:
        raise RuntimeError(f"cannot write {dest.parent}: {exc}") from exc
    try:
        _compile_into(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def _compile_into(work: Path, dest: Path) -> None:
    """Warm, export, compile into ``work``, then publish it as ``dest``."""
    start = time.perf_counter()
    _warm_all()
    entries, tables, amx = _entry_points()
    warmed = time.perf_counter()
    cc = _pycc.CC(aot.MODULE)
    cc.output_dir = str(work)
    cc.target_cpu = "host"
    manifest: dict[str, Any] = {"key": aot.key(), "tables": tables, "amx": amx,
                                "amx_config": _amx_config(), "entries": {}}
    for label, kernel in entries.items():
        exports = []
        for n, (signature, described, fn) in enumerate(_exports(label, kernel)):
            symbol = f"{label.replace('.', '__')}__{n}"
            cc.export(symbol, signature)(_trampoline(fn, len(described)))
            exports.append({"symbol": symbol, "args": described})
        if not exports:
            raise RuntimeError(f"no export of {label}")
        manifest["entries"][label] = exports
    original = _pycc_compiler.Flags
    _pycc_compiler.Flags = _releasing(original)
    try:
        cc.compile()
    except Exception as exc:
        raise RuntimeError(f"pycc could not build the kernels: {exc}") from exc
    finally:
        _pycc_compiler.Flags = original
    try:
        (work / aot.MANIFEST).write_text(json.dumps(manifest, indent=1))
        _publish(work, dest)
    except OSError as exc:
        raise RuntimeError(f"cannot write {dest}: {exc}") from exc
    print(f"aot: kernels built ahead of time in {time.perf_counter() - warmed:.0f} s "
          f"({sum(len(e) for e in manifest['entries'].values())} exports of {len(entries)} entry points, "
          f"after {warmed - start:.1f} s of warming numba's): {dest}", flush=True)


def _amx_config() -> list[int]:
    from . import amxgemm
    return [int(b) for b in amxgemm.CONFIG]


def _publish(work: Path, dest: Path) -> None:
    """Move the built folder into place in one rename (a folder another build put there first
    stays), and remove those built for earlier sources: no process loads them again."""
    try:
        os.rename(work, dest)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
        if not (dest / aot.MANIFEST).exists():
            raise
    for old in dest.parent.glob("aot-*"):
        if old != dest and (old / aot.MANIFEST).exists():
            shutil.rmtree(old, ignore_errors=True)
