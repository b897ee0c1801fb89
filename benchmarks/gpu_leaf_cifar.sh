#!/usr/bin/env bash
# S1 and S2 CIFAR-10 at the paper's protocol (E = 5, T = 100) with the model the paper's text
# names, LEAF's CNN (8.5 million parameters on 3x32x32), instead of the authors' code's small
# CIFAR CNN: FedAvg, Local and FLT Enc1 with its defaults, all six runs at once on one CUDA GPU.
# Each run has its own time limit; a run stopped there keeps its rounds so far (metrics.jsonl),
# and the log says where it stopped. Run from the repository root on a machine with a GPU:
#   DATA=/path/to/cifar10-jpg OUT=/tmp/gpu bash benchmarks/gpu_leaf_cifar.sh
set -uo pipefail
OUT=${OUT:-gpu-results}
DATA=${DATA:?set DATA to the folder holding cifar10-jpg.tar.gz or its train/ and test/}
LIMIT=${LIMIT:-470}          # seconds each run may take
RUNS=${RUNS:-/tmp/flt-leaf}  # run folders (packed into $OUT at the end)
ACCEL=${ACCEL:-cuda}          # cpu for a smoke test of this script
EXTRA=${EXTRA:-}             # more --set arguments, e.g. a smaller federation for that test
py=${PYTHON:-python3}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 FLT_CACHE=${FLT_CACHE:-/tmp/flt-cache}
one() {  # one SCENARIO METHOD: a method's run under the limit, its terminal output in a log
  local scen=$1 method=$2 name="${1}_${2}"
  timeout "$LIMIT" $py -m flt.emulator.cli compare "scenarios/${scen}_cifar10.yaml" --methods "$method" \
    --set model=leaf_cnn --set train.eval_every=5 --set "data.root=$DATA" \
    --set devices.processes=1 --set "devices.accelerator=$ACCEL" $EXTRA --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1
  echo "=== $name: exit $? at $(date -u +%T); last line: $(grep -a '\] round' "$RUNS/$name.log" | tail -1)"
}
{
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "start $(date -u +%T), limit ${LIMIT} s a run"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 30 &
  smi=$!
  pids=()
  for scen in ${SCENARIOS:-s1 s2}; do
    for method in ${METHODS:-fedavg local flt_enc1}; do one "$scen" "$method" & pids+=($!); done
  done
  wait "${pids[@]}"
  kill "$smi" 2>/dev/null
  tar czf "$OUT/leaf_cifar_runs.tgz" -C "$RUNS" --exclude='*.npz' --exclude='checkpoint*' . 2>/dev/null
  echo "end $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
