#!/usr/bin/env bash
# S1 and S2 CIFAR-10 at the paper's protocol (E = 5, T = 100) with the model the paper's text
# names, LEAF's CNN (8.5 million parameters on 3x32x32), instead of the authors' code's small
# CIFAR CNN: by default FedAvg, Local and FLT Enc1 with its defaults, all six runs at once on one
# CUDA GPU (SCENARIOS and METHODS pick others: any label of the scenario files' methods; JOBS,
# e.g. "s1:fedsem s2:flt_enc1", names the runs one by one instead).
# Each run has its own time limit; a run stopped there keeps its rounds so far (metrics.jsonl),
# and the log says where it stopped. RESUME=1 continues the runs already in $RUNS from their
# last checkpoints (`flt run --resume`), for a machine that kept them between two calls.
# The runs are packed into $OUT every SNAP seconds, so a call cut off at its own limit still
# returns them. Run from the repository root on a machine with a GPU:
#   DATA=/path/to/cifar10-jpg OUT=/tmp/gpu bash benchmarks/gpu_leaf_cifar.sh
set -uo pipefail
OUT=${OUT:-gpu-results}
DATA=${DATA:?set DATA to the folder holding cifar10-jpg.tar.gz or its train/ and test/}
LIMIT=${LIMIT:-470}          # seconds each run may take
RUNS=${RUNS:-/tmp/flt-leaf}  # run folders (packed into $OUT at the end)
ACCEL=${ACCEL:-cuda}          # cpu for a smoke test of this script
EXTRA=${EXTRA:-}             # more --set arguments, e.g. a smaller federation for that test
RESUME=${RESUME:-0}           # 1: resume the runs in $RUNS instead of starting them
SNAP=${SNAP:-30}             # seconds between two packings of the runs into $OUT
py=${PYTHON:-python3}
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 FLT_CACHE=${FLT_CACHE:-/tmp/flt-cache}
one() {  # one SCENARIO METHOD: a method's run under the limit, its terminal output in a log
  local scen=$1 method=$2 name="${1}_${2}"
  if [ "$RESUME" = 1 ]; then
    timeout "$LIMIT" $py -m flt.emulator.cli run --resume "$RUNS/$name" >> "$RUNS/$name.log" 2>&1
  else
    timeout "$LIMIT" $py -m flt.emulator.cli compare "scenarios/${scen}_cifar10.yaml" --methods "$method" \
      --set model=leaf_cnn --set train.eval_every=5 --set "data.root=$DATA" \
      --set devices.processes=1 --set "devices.accelerator=$ACCEL" $EXTRA --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1
  fi
  echo "=== $name: exit $? at $(date -u +%T); last line: $(grep -a '\] round' "$RUNS/$name.log" | tail -1)"
}
pack() {  # the runs without their models (checkpoints, arrays), written whole or not at all
  tar czf "$OUT/.runs.tgz" -C "$RUNS" --exclude='*.npz' --exclude='checkpoint*' --exclude='.lock' . 2>/dev/null \
    && mv "$OUT/.runs.tgz" "$OUT/leaf_cifar_runs.tgz"
}
snapshots() {  # pack every SNAP s; told to stop, it ends its pack under way first (no two tars at once)
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "$SNAP" &
    nap=$!
    wait "$nap"
    pack
  done
}
{
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "start $(date -u +%T), limit ${LIMIT} s a run"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 30 &
  smi=$!
  snapshots &
  snap=$!
  jobs=${JOBS:-}
  if [ -z "$jobs" ]; then
    for scen in ${SCENARIOS:-s1 s2}; do
      for method in ${METHODS:-fedavg local flt_enc1}; do jobs="$jobs $scen:$method"; done
    done
  fi
  pids=()
  for job in $jobs; do one "${job%%:*}" "${job#*:}" & pids+=($!); done
  wait "${pids[@]}"
  kill "$smi" "$snap" 2>/dev/null
  wait "$snap" 2>/dev/null
  pack
  echo "end $(date -u +%T)"
} 2>&1 | tee "$OUT/log.txt"
