"""The kernels built ahead of time (``worker/kernels/aot.py``, ``aotbuild.py``): the same bits as
numba's for every entry point and type, guards that never let a wrong array into an export, the
GIL released while one runs, and a model on worker processes that never needs numba.

``run.py``'s setup builds the module (``python -m zmq_rpc.worker.kernels --aot``); here, where a C
compiler is, its absence is a failure, not a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numba")

from test_kernels import random_weight  # noqa: E402
from zmq_rpc.worker import kernels  # noqa: E402
from zmq_rpc.worker.kernels import aot, fused, halfgemm, intgemm, jit, layout  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def built() -> aot.Compiled:
    found = aot.load()
    if found is None:
        if shutil.which("cc") is None and shutil.which("gcc") is None:
            pytest.skip("no C compiler: the kernels cannot be built ahead of time here")
        pytest.fail(f"no kernels built ahead of time in {aot.folder()} ({aot.disabled() or 'not built'}): "
                    "python -m zmq_rpc.worker.kernels --aot (run.py's setup runs it)")
    return found


def width(qtype: str) -> int:
    return 768 if kernels.PACKED[qtype][0] == 256 else 576


@pytest.mark.parametrize("qtype", kernels.QTYPES)
def test_every_product_and_repack_gives_numbas_bits(built: aot.Compiled, qtype: str) -> None:
    """Repack (from read-only GGUF rows, as a model file gives them), decode, 2-row decode, the
    activation rounding, prefill GEMM (f16/bf16: FMA, and AMX where it runs) and the dequantizer,
    for 100 rows (six blocks of 16 and a tail)."""
    rng = np.random.default_rng(5)
    rows, k = 100, width(qtype)
    src = random_weight(rng, qtype, rows, k)
    src.setflags(write=False)
    kernel, flags, u16 = built.pack[qtype]
    ours, theirs = layout.packed_output(src, qtype, None), layout.packed_output(src, qtype, None)
    kernel(src.view(np.uint16) if u16 else src, ours, *flags)
    jit.pack(src, qtype, theirs)
    assert np.array_equal(ours, theirs)
    w = ours
    x = (rng.standard_normal((9, k)) * rng.choice([1e-3, 1.0, 40.0], (9, 1))).astype(np.float32)
    mv, dq, mflags = built.kernels[qtype]
    nmv, ndq, _ = jit.KERNELS[qtype]
    for t in (0, 4):
        a, b = np.full(rows, np.nan, np.float32), np.full(rows, np.nan, np.float32)
        mv(w, x[t], a, 0, rows, *mflags)
        nmv(w, x[t], b, 0, rows, *mflags)
        assert np.array_equal(a, b), f"decode row {t}"
    a, b = np.full((k, rows), np.nan, np.float32), np.full((k, rows), np.nan, np.float32)
    dq(w, k, 0, rows, a, 0, *mflags)
    ndq(w, k, 0, rows, b, 0, *mflags)
    assert np.array_equal(a, b), "dequantizer"
    if qtype in kernels.INTEGER_GEMM:
        xa, xb = layout.empty_rows(9, k), layout.empty_rows(9, k)
        built.quantize_rows_into(x, *xa, 0, 9)
        intgemm.quantize_rows_into(x, *xb, 0, 9)
        assert all(np.array_equal(p, q) for p, q in zip(xa, xb)), "rounded rows"
        gemm, gflags = built.gemm[qtype]
        ya, yb = np.full((9, rows), np.nan, np.float32), np.full((9, rows), np.nan, np.float32)
        gemm(w, *xa, ya, 0, rows, *gflags)
        intgemm.GEMM[qtype][0](w, *xb, yb, 0, rows, *gflags)
        assert np.array_equal(ya, yb), "integer GEMM"
    if qtype in kernels.HALF_GEMM:
        bf16 = qtype == "bf16"
        ya, yb = np.full((9, rows), np.nan, np.float32), np.full((9, rows), np.nan, np.float32)
        built.gemm_u16(w, x, ya, 0, rows, bf16)
        halfgemm.gemm_u16(w, x, yb, 0, rows, bf16)
        assert np.array_equal(ya, yb), "f16/bf16 FMA GEMM"
        if built.gemm_amx is not None and built.split_rows is not None:
            from zmq_rpc.worker.kernels import amxgemm
            if amxgemm.available():
                ya[:], yb[:] = np.nan, np.nan
                built.gemm_amx(w, built.split_rows(x), ya, 0, rows, bf16, built.amx_config)
                amxgemm.gemm_amx(w, amxgemm.split_rows(x), yb, 0, rows, bf16, amxgemm.CONFIG)
                assert np.array_equal(ya, yb), "AMX GEMM"


def fused_cases(rng: np.random.Generator) -> list[tuple[str, tuple[Any, ...], int]]:
    """(op, arguments, index of the output) for each fused op and cache type a llama graph uses."""
    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)
    q, out = f32(1, 6, 8), np.zeros((1, 6, 8), np.float32)
    cases: list[tuple[str, tuple[Any, ...], int]] = []
    for cache in (f32(12, 2, 8), f32(12, 2, 8).astype(np.float16).view(np.uint16)):
        mask = np.where(rng.random((1, 12)) < 0.3, -np.inf, 0).astype(np.float32)
        cases.append(("attention", (q, cache, cache.copy(), mask, np.float32(0.35), out.copy()), 5))
        pos, base = np.array([7], np.int32), np.array([2], np.int32)
        cases.append(("attend_rows", (q, cache, cache.copy(), pos, base, np.float32(0.35), 0, out.copy()), 7))
    for dtype in (np.int32, np.int64):
        inv = 1.0 / 10000 ** (np.arange(4) / 4)
        cases.append(("rope", (q, np.array([3], dtype), inv, False, 8, out.copy()), 5))
    cases.append(("swiglu", (f32(2, 16), np.zeros((2, 8), np.float32)), 1))
    cases.append(("rms_norm", (f32(2, 64), np.float32(1e-5), np.zeros((2, 64), np.float32)), 2))
    ints, floats = np.array([4, 0], np.int32), np.array([0.8, 0.0], np.float32)
    cases.append(("sample_rows", (f32(2, 50), floats, ints, np.array([0.9, 1.0], np.float32),
                                  np.array([7, 9], np.uint32), ints.copy(), np.zeros(2, np.int32)), 6))
    return cases


def test_every_fused_op_gives_numbas_bits_and_refuses_other_types(built: aot.Compiled) -> None:
    """The fused ops as a llama graph calls them, float32 and float16 caches; a float64 array (no
    export, and numba's would not compile it either) is a TypeError, as numba's refusal is."""
    kernels.fused_kernels()
    for name, args, o in fused_cases(np.random.default_rng(2)):
        ours, theirs = list(args), [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        getattr(built.fused, name)(*ours)
        getattr(fused, name)(*theirs)
        assert np.array_equal(ours[o], theirs[o]), name
        with pytest.raises(TypeError):
            getattr(built.fused, name)(*[a.astype(np.float64) if isinstance(a, np.ndarray) else a for a in args])


def test_a_read_only_or_wrong_array_never_reaches_an_export(built: aot.Compiled) -> None:
    """A read-only array as the output, a strided activation row: each goes to numba's kernel
    (which refuses the one and compiles the other), never into the export."""
    rng = np.random.default_rng(3)
    w = kernels.pack(random_weight(rng, "q8_0", 32, 64), "q8_0")
    mv, _, flags = built.kernels["q8_0"]
    x = rng.standard_normal((2, 64)).astype(np.float32)
    frozen = np.zeros(32, np.float32)
    frozen.setflags(write=False)
    with pytest.raises(Exception, match="read.?only|readonly"):
        mv(w, x[0], frozen, 0, 32, *flags)
    assert not frozen.any()
    expected = np.empty(32, np.float32)
    jit.KERNELS["q8_0"][0](w, x[0], expected, 0, 32)
    wide = np.zeros((2, 128), np.float32)
    wide[:, ::2] = x
    strided = np.full(32, np.nan, np.float32)
    mv(w, wide[0, ::2], strided, 0, 32)       # numba's, compiled for a strided row
    assert np.array_equal(strided, expected)


def test_a_running_kernel_lets_other_threads_run(built: aot.Compiled) -> None:
    """The exports release the GIL (numba's kernels are ``nogil``): a Python thread keeps
    stamping the time while one long GEMM runs in this one."""
    rng = np.random.default_rng(4)
    rows, k, t = 4096, 2048, 192     # ~0.1 s here: long enough on a faster CPU too
    w = kernels.pack(random_weight(rng, "q8_0", rows, k), "q8_0")
    x = rng.standard_normal((t, k)).astype(np.float32)
    xq, y = layout.empty_rows(t, k), np.empty((t, rows), np.float32)
    built.quantize_rows_into(x, *xq, 0, t)
    gemm, flags = built.gemm["q8_0"]
    stamps: list[float] = []
    running, done = threading.Event(), threading.Event()

    def stamp() -> None:
        running.set()
        while not done.is_set():
            stamps.append(time.perf_counter())

    spinner = threading.Thread(target=stamp)
    spinner.start()
    running.wait(10)
    begin = time.perf_counter()
    gemm(w, *xq, y, 0, rows, *flags)
    end = time.perf_counter()
    done.set()
    spinner.join()
    inside = [s for s in stamps if begin < s < end]
    assert end - begin > 0.02, "the GEMM was too short to tell"
    assert inside, f"no stamp during the {1e3 * (end - begin):.0f} ms GEMM: it held the GIL"


def test_a_module_built_for_other_sources_or_switched_off_is_not_loaded(
        built: aot.Compiled, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "aot"
    shutil.copytree(aot.folder(), copy)
    assert aot.load(copy) is not None
    manifest = json.loads((copy / aot.MANIFEST).read_text())
    (copy / aot.MANIFEST).write_text(json.dumps({**manifest, "key": "0" * 20}))
    assert aot.load(copy) is None
    entries = dict(manifest["entries"])
    entries["fused.attention(): pass\n#"] = entries.pop("fused.attention")   # never into generated code
    (copy / aot.MANIFEST).write_text(json.dumps({**manifest, "entries": entries}))
    assert aot.load(copy) is None
    monkeypatch.setenv(aot.DISABLE_ENV, "0")
    assert aot.load() is None and aot.disabled() == f"{aot.DISABLE_ENV}=0"
    monkeypatch.delenv(aot.DISABLE_ENV)
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    assert aot.load() is None
    assert os.environ.get(aot.DISABLE_ENV) is None


def test_a_failed_build_leaves_numbas_kernels_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--aot`` where pycc cannot build (no C compiler, say): numba's cache is compiled, the
    command succeeds and says why there is no module (run.py's setup shows that line)."""
    from zmq_rpc.worker.kernels import __main__ as command
    from zmq_rpc.worker.kernels import aotbuild

    def fail(base: Path | None = None) -> Path:
        raise RuntimeError("pycc could not build the kernels: no compiler")
    monkeypatch.setattr(aotbuild, "build", fail)
    assert command.main(["q8_0", "--aot"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "aot: not built (pycc could not build the kernels: no compiler); workers will load numba's kernels" in lines
    assert lines[-1].startswith("all: ")


def test_the_worker_log_says_which_kernels_run_and_how_to_build_them(
        built: aot.Compiled, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kernels, "_compiled", {})
    with caplog.at_level("INFO", logger="zmq_rpc.worker.kernels"):
        assert kernels.ahead()
    assert f"kernels: built ahead of time ({aot.folder().name})" in caplog.messages
    caplog.clear()
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setenv(aot.DISABLE_ENV, "0")
    with caplog.at_level("INFO", logger="zmq_rpc.worker.kernels"):
        assert not kernels.ahead()
    assert any(m.startswith(f"kernels: numba's ({aot.DISABLE_ENV}=0; python -m zmq_rpc.worker.kernels --aot")
               for m in caplog.messages), caplog.messages


def test_a_build_that_cannot_write_its_folder_says_so_before_warming(tmp_path: Path) -> None:
    from zmq_rpc.worker.kernels import aotbuild
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.raises(RuntimeError, match="cannot write"):
        aotbuild.build(blocked / "cache")
    assert blocked.read_text() == "not a folder"
