#!/usr/bin/env bash
# Every GPU check in one command, for a machine with one CUDA device and torch installed (installs nothing):
#   bash benchmarks/gpu/run.sh OUT_DIR
# kernel constants (kernel_constants.py), exec memory and offload overlap (gpu_checks.py), the CUDA tests, and the
# reference trainer on one GPU (recipe glm_moe_small, NCCL) under two policies. OUT_DIR gets checks.log, the two
# checks' JSON and the trainer's metrics (train_<policy>.jsonl). Every step runs; the exit status is 1 if any failed.
set -u -o pipefail
out=${1:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
{
    rc=0
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python3 benchmarks/gpu/kernel_constants.py --out "$out" || rc=1
    python3 benchmarks/gpu/gpu_checks.py --out "$out" || rc=1
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu || rc=1
    for policy in flexible ideal; do
        started=$(date +%s)
        timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m reference_trainer.train \
            --recipe glm_moe_small --steps 30 --policy "$policy" --json --metrics-file "$out/train_$policy.jsonl" \
            >/tmp/train.log 2>&1
        status=$?
        [ "$status" -eq 0 ] || rc=1
        echo "train $policy: rc $status, $(($(date +%s) - started)) s"
        tail -n 25 /tmp/train.log
    done
    exit "$rc"
} 2>&1 | tee "$out/checks.log"
