#!/usr/bin/env bash
# Every GPU check of zmq-rpc in one go, on a machine with an NVIDIA GPU (target: under 5 minutes).
#
#   tools/gpu_check.sh [OUT_DIR]        (from the repository root, its virtualenv active)
#
# 1. the tests marked gpu: the op kernels on cupy (test_ops), graphs on a cuda worker
#    (test_graph), peer copies between cuda and CPU workers (test_peer, test_cupy_backend), the
#    cuda backend byte for byte against numpy, SmolLM2 on a cuda worker and split cuda + CPU
#    (test_llama), --device cuda:N errors (test_cli);
# 2. the bench case gpu (zmq-rpc-bench --cases gpu): set/get vs cupy's copies, a matmul graph vs
#    cupy in process, a MiniLM-style encoder and SmolLM2 tokens/s vs CPU workers.
# Writes OUT_DIR/gpu_tests.txt, OUT_DIR/gpu_bench.txt and OUT_DIR/gpu_bench.json (default
# ./gpu_check_out). Exits non-zero if cupy is missing, a test fails or the bench fails.
set -u -o pipefail
out="${1:-gpu_check_out}"
mkdir -p "$out"
python - <<'PY' || { echo "gpu_check: install the cuda extra first: pip install 'zmq-rpc[cuda]'" >&2; exit 2; }
import cupy
n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
print(f"gpu_check: cupy {cupy.__version__}, {n} GPU(s); cuda:0 is {props['name'].decode()} "
      f"(compute capability {props['major']}.{props['minor']}, "
      f"{props['totalGlobalMem'] / 2**30:.0f} GiB)")
PY
start=$SECONDS
workers=$(python -c "import os; print(max(1, min(4, (os.cpu_count() or 2) // 2)))")
# the kernels compile on first use (cupy caches them in ~/.cupy): warm them once, serially
timeout 120 pytest -q -m gpu -p no:cacheprovider -n 0 "tests/test_ops.py::test_rope" \
    "tests/test_ops.py::test_dequantize_op_and_mul_mat_q" > /dev/null 2>&1
timeout 200 pytest -q -m gpu -n "$workers" -rs tests 2>&1 | tee "$out/gpu_tests.txt"
tests=$?
echo "gpu_check: tests took $((SECONDS - start)) s (exit $tests)"
bench_start=$SECONDS
timeout 150 zmq-rpc-bench --cases gpu --quick --sizes 1MiB,16MiB,256MiB --no-progress \
    --json "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.txt"
bench=$?
echo "gpu_check: bench took $((SECONDS - bench_start)) s (exit $bench); total $((SECONDS - start)) s"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
