#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA GPU (run from the repository root):
#   1. the CUDA tests (device cohorts on the GPU against the CPU, a whole run on the GPU);
#   2. benchmarks/bench_cohort.py: vectorized cohort against the per-client loop, per model;
#   3. benchmarks/bench_scale.py: the S4 scale scenario, M = 2,400, T = 100, on the GPU;
#   4. S1 CIFAR-10 (FedAvg, FLT, FedSEM) while time remains.
# Every stage has its own time limit, so one that fails or overruns leaves the others'
# figures. Results go to $OUT (default ./gpu-results): log.txt and the benchmark JSON/PNGs.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLT_CACHE=${FLT_CACHE:-/tmp/flt-cache}
py=${PYTHON:-python3}
stage() {  # stage SECONDS NAME COMMAND...: run with a limit, log, never stop the script
  local limit=$1 name=$2; shift 2
  echo "=== $name (limit ${limit} s) $(date -u +%T)"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}
{
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  stage 120 "CUDA tests" $py -m pytest -q -x -p no:cacheprovider tests/test_accelerator.py tests/test_fcr.py
  stage 80 "cohort benchmark" $py benchmarks/bench_cohort.py --device cuda --clients 480 120 120 \
    --samples 250 140 500 --loop-clients 40 --out "$OUT"
  stage 240 "scale benchmark, M = 2400, T = 100" $py benchmarks/bench_scale.py --clients 2400 --rounds 100 \
    --accelerator cuda --processes 4 --methods fedavg flt fedsem --out "$OUT" --work /tmp/flt-scale
  stage "${CIFAR_LIMIT:-110}" "S1 CIFAR-10" $py -m flt.emulator.cli compare scenarios/s1_cifar10.yaml \
    --methods fedavg,flt_enc1,fedsem --set devices.processes=4 --set devices.accelerator=cuda \
    --out /tmp/flt-s1-cifar10
  tar czf "$OUT/s1_cifar10.tgz" -C /tmp --exclude='*.npz' --exclude='checkpoint*' flt-s1-cifar10 2>/dev/null
  tar czf "$OUT/scale_runs.tgz" -C /tmp --exclude='*.npz' --exclude='checkpoint*' flt-scale 2>/dev/null
} 2>&1 | tee "$OUT/log.txt"
