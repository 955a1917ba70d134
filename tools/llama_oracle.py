"""Record llama.cpp's answers on a GGUF as a test fixture: tokenization, greedy tokens, logits.

llama.cpp is the oracle the llama tests compare against (numbers we compute ourselves can share our
own misunderstandings). It is never a dependency of the package: this script runs in a separate
environment where ``llama-cpp-python`` was built from its sdist (see docs/MODELS.md)::

    /work/llamaenv/bin/python tools/llama_oracle.py MODEL.gguf tests/fixtures/NAME.npz

For each prompt it records what llama.cpp does with ``Llama(model, n_threads=1, logits_all=True)``:

- ``tokenize(prompt, add_bos=True, special=True)`` (BOS only where the GGUF asks for it; special
  tokens such as ``<|im_start|>`` parsed);
- its greedy continuation: :data:`N_PREDICT` tokens, each the argmax of the previous step's logits
  (one ``eval`` per token, as generation runs);
- teacher-forced logits: the prompt and that continuation evaluated as one sequence, the logits at
  every position.

Stored compactly (a full float32 vocabulary row is 192 KiB for a 49k vocabulary; the ~100
positions of 3 prompts would be ~19 MiB): at every position the :data:`TOP_K` largest logits and their ids, and
the logits of a fixed sample of ids (every :data:`STRIDE`-th id, the tail of the distribution
where no top-k looks), both float32; plus the full vocabulary row, float16 (its rounding,
< 0.016 for logits under 32, is far below the comparison's tolerance), at the last prompt position
of the first prompt (``--no-full-row``: none; ``--stride``: another sample). The file also records the model's SHA-256, the prompts, the versions and the
command line, so that a test can refuse a different file. The arrays are all deterministic (one
thread: llama.cpp's CPU sums run in a fixed order).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["N_PREDICT", "PROMPTS", "STRIDE", "TOP_K", "main", "sha256_file"]

PROMPTS = (
    "What is the capital of France?",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "  Spaces, digits 12345, ünïcödé 🙂 and code: x = f(y) + 1\n",
)
"""Plain text, a chat turn with special tokens, and text that exercises byte-level BPE's edges."""
N_PREDICT = 16
TOP_K = 32
STRIDE = 97
N_CTX = 512


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB pieces)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


def _greedy(llm: Any, ids: list[int], n: int) -> list[int]:
    """llama.cpp's greedy continuation of ``ids``: one ``eval`` per token, argmax of its logits."""
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
        llm.eval([token])
    return out


def _teacher_forced(llm: Any, ids: list[int]) -> np.ndarray:
    """Logits (len(ids), vocab) of ``ids`` evaluated as one sequence from position 0."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def record(llm: Any, prompts: tuple[str, ...], vocab: int, stride: int = STRIDE,
           full_row: bool = True) -> dict[str, np.ndarray]:
    """The fixture's arrays for ``prompts`` (see the module docstring)."""
    arrays: dict[str, np.ndarray] = {"sample_ids": np.arange(0, vocab, stride, dtype=np.int32)}
    for i, prompt in enumerate(prompts):
        prompt_ids = [int(t) for t in llm.tokenize(prompt.encode(), add_bos=True, special=True)]
        greedy = _greedy(llm, prompt_ids, N_PREDICT)
        logits = _teacher_forced(llm, prompt_ids + greedy)
        top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K].astype(np.int32)
        arrays[f"p{i}_prompt_ids"] = np.array(prompt_ids, np.int32)
        arrays[f"p{i}_greedy"] = np.array(greedy, np.int32)
        arrays[f"p{i}_top_ids"] = top
        arrays[f"p{i}_top_logits"] = np.take_along_axis(logits, top, axis=1)
        arrays[f"p{i}_sample_logits"] = logits[:, arrays["sample_ids"]]
        if i == 0 and full_row:
            arrays["p0_full_pos"] = np.array([len(prompt_ids) - 1], np.int32)
            arrays["p0_full_logits"] = logits[len(prompt_ids) - 1:len(prompt_ids)].astype(np.float16)
    return arrays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, help="the GGUF to run llama.cpp on")
    parser.add_argument("out", type=Path, help="the .npz fixture to write")
    parser.add_argument("--name", default="", help="how tests name the model (recorded)")
    parser.add_argument("--stride", type=int, default=STRIDE,
                        help="record every STRIDE-th id's logit (random-weight models' logits "
                             "compress poorly: a larger stride keeps their fixtures small)")
    parser.add_argument("--no-full-row", action="store_true",
                        help="keep no full vocabulary row (a 262k vocabulary's is 512 KiB)")
    args = parser.parse_args(argv)
    import llama_cpp  # type: ignore[import-not-found]  # the oracle's own environment only

    llm = llama_cpp.Llama(str(args.model), n_threads=1, n_threads_batch=1, logits_all=True,
                          n_ctx=N_CTX, n_batch=N_CTX, seed=0, verbose=False)
    arrays = record(llm, PROMPTS, llm.n_vocab(), args.stride, not args.no_full_row)
    meta = {
        "model_name": args.name or args.model.name,
        "model_sha256": sha256_file(args.model),
        "model_bytes": args.model.stat().st_size,
        "prompts": list(PROMPTS),
        "n_predict": N_PREDICT, "top_k": TOP_K, "stride": args.stride,
        "full_row": not args.no_full_row, "n_ctx": N_CTX,
        "llama_cpp_python": llama_cpp.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "command": shlex.join(["python", "tools/llama_oracle.py", *(argv or sys.argv[1:])]),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "settings": "Llama(model, n_threads=1, n_threads_batch=1, logits_all=True, "
                    f"n_ctx={N_CTX}, n_batch={N_CTX}); tokenize(add_bos=True, special=True)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    contents: dict[str, Any] = {"meta": np.array(json.dumps(meta, ensure_ascii=False)), **arrays}
    np.savez_compressed(args.out, **contents)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes) for {meta['model_sha256'][:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
