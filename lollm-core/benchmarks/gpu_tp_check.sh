#!/usr/bin/env bash
# The GPU check of tensor parallelism (docs/tensor-parallel.md, "On GPUs"): the same
# equality tests CI runs with gloo on the CPU, run with NCCL on the GPUs of this machine.
#
#   bash lollm-core/benchmarks/gpu_tp_check.sh [OUT_DIR]
#
# It uses the python3 on PATH (or $PYTHON) with a CUDA build of torch and transformers
# already installed; it needs no network. Steps:
#   1. the environment: GPUs, torch, NCCL;
#   2. lollm from this checkout, installed without dependencies into a scratch folder;
#   3. every family's tensor-parallel tests with LOLLM_TP_DEVICE=cuda: N processes under
#      torchrun (each on GPU LOCAL_RANK % device_count; on one GPU the 2 processes share it)
#      against one process on the GPU: logits within 1e-5 in float32, same greedy ids,
#      1/N of the split bytes per rank. Backend: NCCL.
#   4. on a machine with ONE GPU, NCCL may refuse two ranks on one device ("Duplicate GPU
#      detected"): the step then records that failure and runs the same tests again with
#      LOLLM_TP_BACKEND=gloo (gloo's collectives on CUDA tensors), so the split itself is
#      still checked on the GPU. The log says which backend each result is from.
# Exit status: 0 when every NCCL test passed (or, on one GPU, every gloo-on-CUDA test).
# OUT_DIR (default ./gpu-tp-check) gets the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:-gpu-tp-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
unset LOLLM_TP_BACKEND
status=0

echo "== 1. environment"
nvidia-smi -L || echo "(nvidia-smi not found)"
GPUS=$($PY - <<'PYEOF'
import sys, torch, torch.distributed as dist
if not torch.cuda.is_available():
    sys.exit("this torch sees no CUDA device (a CPU build, or no driver)")
print(torch.cuda.device_count())
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| NCCL", torch.cuda.nccl.version(),
      "| nccl backend", dist.is_backend_available("nccl"), file=sys.stderr)
PYEOF
) || { echo "stopping: no usable CUDA device for $PY"; exit 2; }
echo "GPUs: $GPUS"

echo "== 2. lollm from this checkout"
SITE=$(mktemp -d /tmp/lollm-site-XXXX)
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" \
        ./lollm-core ./lollm-qwen ./lollm-gemma ./lollm-qwen3_5 >"$OUT/install.log" 2>&1; then
    cat "$OUT/install.log"; echo "stopping: could not install lollm from this checkout"; exit 2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

run_tests() {  # $1: label; each distribution's tests in their own pytest process
    local label=$1 rc=0
    for dist in lollm-qwen lollm-gemma lollm-qwen3_5; do
        for t in "$dist"/tests/test_tensor_parallel_*.py; do
            echo "-- $label: $t"
            LOLLM_TP_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider "$t" 2>&1 | tee -a "$OUT/$label.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        done
    done
    return $rc
}

echo "== 3. NCCL"
run_tests nccl; nccl=$?
echo "NCCL result: $nccl (0: passed)"
if [ "$nccl" -ne 0 ] && [ "$GPUS" -eq 1 ]; then
    echo "== 4. one GPU: the same tests with gloo on CUDA tensors"
    export LOLLM_TP_BACKEND=gloo; run_tests gloo-cuda; status=$?
    echo "gloo-on-CUDA result: $status (0: passed); NCCL's failure is in $OUT/nccl.log"
else
    status=$nccl
fi
echo "== done: status $status"
exit $status
