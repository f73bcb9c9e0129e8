#!/usr/bin/env bash
# The GPU check of the paged attention kernel (lollm.kernels.paged_attention; docs/flash-attention.md,
# "Paged attention"), in one run on a machine with a CUDA GPU:
#
#   bash lollm-core/benchmarks/gpu_paged_check.sh [OUT_DIR] [gpu_paged_bench.py options]
#
# It uses the python3 on PATH (or $PYTHON) with the torch (a CUDA build), triton and transformers
# already installed there; it needs no network. Steps:
#   1. the environment: GPU, driver, torch, triton;
#   2. lollm from this checkout, installed without dependencies into a scratch folder
#      (the machine's packages stay as they are);
#   3. the paged kernel's tests compiled on the GPU (TRITON_INTERPRET=0): test_paged_kernel.py
#      against the seam's sdpa, bfloat16 included (the CPU interpreter cannot check bfloat16),
#      and the seam's own engine-step test;
#   4. gpu_paged_bench.py: the batched engine on qwen2 with random weights (the tests' tiny shape
#      and Qwen2.5-0.5B's shape) with --attn sdpa and --attn triton in alternating rounds
#      (output tokens per second, same tokens or not), then one decode step's attention alone
#      (the paged launch against the gather loop). Figures only: nothing is asserted on speed.
# Exit status: 0 when the tests passed and the bench ran without an error. OUT_DIR (default
# ./gpu-paged-check) gets the logs, paged-tables.txt and paged-results.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:-gpu-paged-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET LOLLM_ATTN
status=0

echo "== 1. environment"
nvidia-smi -L || echo "(nvidia-smi not found)"
if ! $PY - <<'PYEOF'; then
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    sys.exit("triton is not installed for this python: pip install 'lollm-core[triton]' (or triton alone)")
if not torch.cuda.is_available():
    sys.exit("this torch sees no CUDA device (a CPU build, or no driver): install a CUDA build of torch")
print("device 0:", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
PYEOF
    echo "stopping: no usable CUDA device or no triton for $PY"
    exit 2
fi

echo "== 2. lollm from this checkout"
SITE=$(mktemp -d /tmp/lollm-site-XXXX)
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" \
        ./lollm-core ./lollm-qwen >"$OUT/install.log" 2>&1; then
    cat "$OUT/install.log"
    echo "stopping: could not install lollm from this checkout"
    exit 2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

echo "== 3. the paged kernel compiled on the GPU against sdpa (fp32, fp16, bf16)"
TRITON_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider lollm-core/tests/test_paged_kernel.py \
    "lollm-core/tests/test_attention.py::test_an_engine_step_takes_a_backends_paged_path_for_the_rows_it_covers" \
    2>&1 | tee "$OUT/paged-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 4. the engine and one decode step's attention, sdpa and triton (figures)"
$PY lollm-core/benchmarks/gpu_paged_bench.py --device "${DEVICE:-cuda}" --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== done: status $status (0: the tests passed and the bench ran); tables in $OUT/paged-tables.txt"
exit $status
