"""The kernels compiled ahead of time: numba's kernels as one extension module, loaded without numba.

Owns the built module's folder (:func:`folder`: beside numba's cache, one per kernel sources,
numba, numpy, Python and CPU) and the guarded entry points made from its manifest. Loaded once
by :mod:`.` (under its lock: the backend thread, or ``--preload-kernels``' thread); built by
:mod:`.aotbuild` in a process of its own (``python -m zmq_rpc.worker.kernels --aot``).

Why: loading numba's cached kernels imports numba and LLVM (0.7-0.8 s of a fresh worker's start,
~47 MiB of heap and ~66 MiB of LLVM's pages resident for as long as the worker lives); the same
machine code as a plain extension module imports in about a millisecond and holds a few MiB.

Each kernel entry point (the functions Python calls: decode and prefill products, repacks, the
fused ops) is exported once per argument types it was warmed with (:mod:`.aotbuild`). numba's
exports do not check the types of what they are given (an int16 array where int8 was built reads
the wrong bytes), so every call here goes through a guard generated from the manifest: the first
export whose types the arguments have exactly (dtype, dimensions, C order, a writable array where
the kernel writes; Python scalars by the type numba would give them) runs; otherwise the call
goes where it would have gone without this module: to numba's kernel, which compiles the new
types (products, repacks; logged once per entry point), or ``TypeError`` (the fused ops, whose
numba kernels refuse new types too: the caller runs its numpy composition).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Final

import numpy as np

__all__ = ["FUSED", "SCALARS", "Compiled", "disabled", "folder", "key", "load", "request_amx"]

FUSED: Final = ("attention", "attend_rows", "rope", "rms_norm", "sample_rows", "swiglu")
"""The fused ops' entry points (:mod:`.fused`): new argument types raise TypeError."""
MODULE: Final = "zmq_rpc_kernels"
"""The extension module's name (its file: ``MODULE`` + this Python's extension suffix)."""
MANIFEST: Final = "manifest.json"
DISABLE_ENV: Final = "ZMQ_RPC_AOT_KERNELS"
"""``0`` in the environment: never load the ahead-of-time kernels (numba's only)."""
NUMBA_TARGET_ENV: Final = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_CACHE_DIR", "NUMBA_DISABLE_JIT",
                           "NUMBA_OPT", "NUMBA_BOUNDSCHECK")
"""numba settings under which its kernels differ from the built ones (another CPU's path, ...):
with any of them set, only numba's kernels run."""
_log = logging.getLogger(__name__)

SCALARS: Final[dict[str, tuple[type, ...]]] = {
    "int64": (int, np.int64), "float64": (float, np.float64), "float32": (np.float32,),
    "bool": (bool, np.bool_), "int32": (np.int32,), "uint32": (np.uint32,), "uint64": (np.uint64,),
}
"""numba scalar type -> the Python types numba gives that type (``typeof``): a call whose scalar has
another type would have compiled another specialization."""

_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def request_amx() -> bool:
    """Ask Linux for the AMX tile state for this process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
    whether it was granted. The CPU's support is the caller's question."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0)
    except (OSError, AttributeError):
        return False


def disabled() -> str | None:
    """Why this process must not load the built kernels (None: it may)."""
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    for var in NUMBA_TARGET_ENV:
        if os.environ.get(var):
            return f"{var} is set"
    return None


def _cpu() -> bytes:
    """This CPU's model and feature flags (Linux's ``/proc/cpuinfo``; elsewhere the platform)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [line for line in f.read().splitlines() if line.startswith((b"model name", b"flags"))]
        return b"\n".join(sorted(set(lines)))
    except OSError:
        import platform
        return f"{platform.machine()} {platform.processor()}".encode()


def _package_version(name: str) -> bytes:
    """The bytes of package ``name``'s ``_version.py`` (numba, llvmlite: both have one), without
    importing it (``importlib.metadata`` takes ~40 ms)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return b"-"
    try:
        return Path(spec.origin).with_name("_version.py").read_bytes()
    except OSError:
        return spec.origin.encode()


def key() -> str:
    """What the built module depends on, hashed: the kernels' sources, numba's and llvmlite's
    versions, numpy's, this Python's, and this CPU."""
    h = hashlib.blake2b(digest_size=10)
    for source in sorted(Path(__file__).parent.glob("*.py")):
        h.update(source.name.encode() + b"\0" + source.read_bytes())
    for part in (_package_version("numba"), _package_version("llvmlite"), np.__version__.encode(),
                 sys.version.encode(), sys.implementation.cache_tag.encode(), _cpu()):
        h.update(b"\0" + part)
    return h.hexdigest()


def folder(base: Path | None = None) -> Path:
    """Where the module for :func:`key` lives: ``__pycache__/aot-KEY`` beside the kernels (numba's
    cache is there too), or under ``base``."""
    return (base or Path(__file__).parent / "__pycache__") / f"aot-{key()}"


@dataclass(frozen=True)
class Compiled:
    """The entry points of :mod:`.` in one place, as :mod:`.jit`, :mod:`.intgemm`,
    :mod:`.halfgemm`, :mod:`.amxgemm` and :mod:`.fused` give them (numba's) or as the built module
    does (guarded exports)."""

    kernels: dict[str, tuple[Callable[..., None], Callable[..., None], tuple[Any, ...]]]
    """qtype -> (matrix-vector, dequantizer, flags): :data:`.jit.KERNELS`."""
    gemm: dict[str, tuple[Callable[..., None], tuple[Any, ...]]]
    """qtype -> (integer GEMM, flags): :data:`.intgemm.GEMM`."""
    pack: dict[str, tuple[Callable[..., None], tuple[Any, ...], bool]]
    """qtype -> (repack, flags, as uint16): :data:`.jit.PACK`."""
    quantize_rows_into: Callable[..., None]
    gemm_u16: Callable[..., None]
    """:func:`.halfgemm.gemm_u16`."""
    gemm_amx: Callable[..., None] | None
    """:func:`.amxgemm.gemm_amx`, None where the CPU has no AMX."""
    split_rows: Callable[..., Any] | None
    amx_config: np.ndarray
    fused: Any
    """The fused ops (:data:`FUSED`) as attributes (numba's: None, :func:`.fused_kernels` has them)."""


def load(where: Path | None = None) -> Compiled | None:
    """The built kernels for this process, or None where there are none (not built, built for
    other sources or another CPU, or :func:`disabled`)."""
    if disabled() is not None:
        return None
    path = where or folder()
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key():    # a folder copied from elsewhere, or sources changed since
        return None
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    spec = importlib.util.spec_from_file_location(MODULE, path / (MODULE + suffix))
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        _log.warning("kernels: the built kernels in %s do not load (%s): numba's run", path, exc)
        return None
    try:
        return _compiled(module, manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        _log.warning("kernels: the built kernels' manifest in %s is not one this code reads (%r): "
                     "numba's run", path, exc)
        return None


def _compiled(module: ModuleType, manifest: dict[str, Any]) -> Compiled:
    entries = {name: _entry(name, module, exports) for name, exports in manifest["entries"].items()}
    tables = manifest["tables"]
    amx = manifest["amx"]
    return Compiled(
        kernels={q: (entries[mv], entries[dq], tuple(flags)) for q, (mv, dq, flags) in tables["KERNELS"].items()},
        gemm={q: (entries[fn], tuple(flags)) for q, (fn, flags) in tables["GEMM"].items()},
        pack={q: (entries[fn], tuple(flags), u16) for q, (fn, flags, u16) in tables["PACK"].items()},
        quantize_rows_into=entries["intgemm.quantize_rows_into"],
        gemm_u16=entries["halfgemm.gemm_u16"],
        gemm_amx=entries.get("amxgemm.gemm_amx") if amx else None,
        split_rows=entries.get("amxgemm.split_rows") if amx else None,
        amx_config=np.array(manifest["amx_config"], np.uint8),
        fused=SimpleNamespace(**{name: entries[f"fused.{name}"] for name in FUSED}))


def _entry(name: str, module: ModuleType, exports: list[dict[str, Any]]) -> Callable[..., Any]:
    """One entry point: its exports behind a guard each, then the fallback (module docstring).

    The guard reads attributes only (``ndim``, ``dtype``, ``flags``): an argument without them
    is no array, and goes to the fallback; pycc's own unboxing refuses what is not an ndarray.
    The exports are called outside the ``try``, so an error of theirs is never taken for that."""
    if not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"entry point name {name!r}")
    arity = len(exports[0]["args"])
    params = ", ".join(f"a{i}" for i in range(arity))
    scope: dict[str, Any] = {"fallback": _fallback(name)}
    tests = []
    for n, export in enumerate(exports):
        scope[f"e{n}"] = getattr(module, export["symbol"])
        tests.append(" and ".join(_check(i, arg, n, scope) for i, arg in enumerate(export["args"])))
    choose = " else ".join(f"{n} if {test}" for n, test in enumerate(tests)) + " else -1"
    lines = [f"def {name.replace('.', '__')}({params}):",
             "    try:",
             f"        n = {choose}",
             "    except AttributeError:",
             "        n = -1"]
    lines += [f"    if n == {n}:\n        return e{n}({params})" for n in range(len(exports))]
    lines.append(f"    return fallback({params})")
    exec("\n".join(lines), scope)       # noqa: S102 (source built here from the manifest's types)
    return scope[name.replace(".", "__")]  # type: ignore[no-any-return]


def _check(i: int, arg: list[Any], n: int, scope: dict[str, Any]) -> str:
    """The guard's test of argument ``i`` (``arg``: the manifest's type), its names put in ``scope``."""
    a = f"a{i}"
    if arg[0] == "scalar":
        scope[f"s{n}_{i}"] = SCALARS[arg[1]]
        return f"{a}.__class__ in s{n}_{i}"
    _, dtype, ndim, layout, writes = arg
    scope[f"d{n}_{i}"] = np.dtype(dtype)
    ndim = int(ndim)
    test = f"{a}.ndim == {ndim} and ({a}.dtype is d{n}_{i} or {a}.dtype == d{n}_{i})"
    if layout == "C" and writes:
        return test + f" and (f{i} := {a}.flags).c_contiguous and f{i}.writeable"
    if layout == "C":
        return test + f" and {a}.flags.c_contiguous"
    return test + (f" and {a}.flags.writeable" if writes else "")


def _fallback(name: str) -> Callable[..., Any]:
    """Where a call whose types no export takes goes (module docstring)."""
    module_name, attr = name.split(".")
    if module_name == "fused":
        def refuse(*args: Any) -> Any:
            raise TypeError(f"kernels: {name} has no compiled version for these argument types")
        return refuse
    warned: list[bool] = []

    def jit(*args: Any) -> Any:
        if not warned:
            warned.append(True)
            _log.warning("kernels: %s called with types it was not built for (%s): numba compiles them",
                         name, ", ".join(_describe(a) for a in args))
        kernel = getattr(importlib.import_module(f"{__package__}.{module_name}"), attr)
        return kernel(*args)
    return jit


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        order = "C" if value.flags.c_contiguous else "A"
        return f"{value.dtype}[{value.ndim}d {order}{'' if value.flags.writeable else ' read-only'}]"
    return type(value).__name__
