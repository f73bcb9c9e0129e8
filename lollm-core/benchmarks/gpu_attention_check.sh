#!/usr/bin/env bash
# The GPU check of --attn triton, in one run on a machine with a CUDA GPU
# (docs/flash-attention.md, "GPU figures", says what to do with its output).
#
#   bash lollm-core/benchmarks/gpu_attention_check.sh [OUT_DIR]
#
# It uses the python3 on PATH (or $PYTHON) with the torch (a CUDA build) and the triton
# already installed there; it needs no network. Steps:
#   1. the environment: GPU, driver, torch, triton;
#   2. lollm from this checkout, installed without dependencies into a scratch folder
#      (the machine's packages stay as they are; lollm needs numpy, safetensors, pluggy,
#      typer, jinja2, regex, tqdm, rich, huggingface_hub, and transformers for the gate);
#   3. the kernel tests compiled on the GPU (TRITON_INTERPRET=0): test_flash_kernels.py's
#      grid, bfloat16 included (the CPU interpreter cannot check bfloat16);
#   4. gpu_attention_check.py: the parity gate with --attn sdpa and --attn triton on every
#      family's tiny checkpoint and on Qwen2.5-0.5B and Gemma 3 270M (real weights from
#      lollm's cache, or random weights of their real shapes), fp32 and bf16; then speed
#      at prompt 512 and 4096, both backends, rounds alternating; tables at the end.
# Exit status: 0 when every gate passed. OUT_DIR (default ./gpu-attention-check) gets
# the logs, tables.txt and results.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:-gpu-attention-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET LOLLM_ATTN
status=0

echo "== 1. environment"
nvidia-smi -L || echo "(nvidia-smi not found)"
if ! $PY - <<'EOF'; then
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
EOF
    echo "stopping: no usable CUDA device or no triton for $PY"
    exit 2
fi

echo "== 2. lollm from this checkout"
SITE=$(mktemp -d /tmp/lollm-site-XXXX)
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" \
        ./lollm-core ./lollm-qwen ./lollm-gemma ./lollm-qwen3_5 >"$OUT/install.log" 2>&1; then
    cat "$OUT/install.log"
    echo "stopping: could not install lollm from this checkout"
    exit 2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
$PY -m lollm.cli families || status=1

echo "== 3. the kernels compiled on the GPU against sdpa (fp32, fp16, bf16)"
TRITON_INTERPRET=0 $PY -m pytest -q -p no:cacheprovider lollm-core/tests/test_flash_kernels.py 2>&1 | tee "$OUT/kernel-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 4. parity and speed, every family, sdpa and triton"
$PY lollm-core/benchmarks/gpu_attention_check.py --device "${DEVICE:-cuda}" --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/check.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== done: status $status (0: every gate passed); tables in $OUT/tables.txt"
exit $status
