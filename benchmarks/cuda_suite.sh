#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("On a GPU"), one command (~5 min on one H200):
#
#   benchmarks/cuda_suite.sh OUTDIR          # PYTHON=... to choose the interpreter (default python3)
#
# 1. overhead.py on the GPU: the param-heavy model of the CPU table (fp32), then a 150M-parameter
#    one under bf16 autocast; step time, host syncs a step, device memory beyond bare; the large
#    one with a profile of 5 steps of each monitored variant (where the monitor's time goes).
# 2. faults.py on the GPU (deterministic algorithms): the loop models and the reference trainer
#    (fp16 autocast + GradScaler on CUDA), healthy runs bit for bit and one-off faults.
# 3. stability.py: the reference trap on the GPU (the trainer picks CUDA when there is one).
# Each step has its own time limit; a step that fails or runs out leaves its log and the next runs.
set -u
out=${1:?usage: benchmarks/cuda_suite.sh OUTDIR}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...: stdout to OUTDIR/NAME.md, stderr to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.md" 2>"$out/$name.log"
    echo "== $name: exit $? in $((SECONDS - t0)) s"
    cat "$out/$name.md"
}
nvidia-smi -L
"$py" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
step overhead_small 60 "$py" benchmarks/overhead.py --device cuda --variants defaults,undo-off,lean --steps 100
step overhead_large 120 "$py" benchmarks/overhead.py --device cuda --amp bf16 --d 1024 --layers 12 --batch 32 \
    --seq 256 --variants defaults,undo-off,lean --steps 40 --profile 5
step faults 200 "$py" benchmarks/faults.py --device cuda --models gpt,cnn,bert,reference \
    --scenarios fault_free,nan_batch,lr_spike,loss_spike,eval_combine,high_lr --no-probe --no-isolate \
    --json "$out/faults.json"
step trap 200 "$py" benchmarks/stability.py --config trap --seeds 8 --jobs 8 --json "$out/trap.json"
