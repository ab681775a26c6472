#!/usr/bin/env bash
# Issue 24's planner check: bench/sweep.sh's 2-rank sweep (dhp, tp, zero3 at 256, 1024 and
# 4096 patches, bench preset trimmed as configs/bench.yaml) with the vision encoder frozen,
# and the same sweep unfrozen in the same session for the usual error, each then predicted by
# dhp plan --against with the committed 2-rank calibration (bench/results/plan/local-x2.json)
# and with one made in the same session (bench/results/plan/finetune_2rank/local-x2.json).
#   bash bench/sweep_frozen.sh [extra dhp bench flags]
# Writes bench/results/sweep_2rank_frozen/ and bench/results/sweep_2rank_unfrozen/ (table.md,
# results.json, validation.md, validation_recalibrated.md).
set -euo pipefail
cd "$(dirname "$0")/.."
frozen=(--set model.vision.freeze=true --set model.merger.freeze=true)
run() {
  local name=$1
  shift
  local out=bench/results/sweep_2rank_$name
  mkdir -p "$out"
  ./build/dhp bench --config configs/bench.yaml "$@" --strategies dhp,tp,zero3 --vision-tokens 256,1024,4096 \
    --batch-sizes 1,2,4 --memory-limit "${DHP_SWEEP_LIMIT_2:-700MiB}" --nproc 2 --steps 5 --warmup 2 --no-plot \
    --out "runs/sweep_2rank_$name" | tee "$out/table.md"
  cp "runs/sweep_2rank_$name/results.json" "$out/"
}
run frozen "${frozen[@]}" "$@"
run unfrozen "$@"
# The committed calibration (older, from another day's machine load), then a fresh one of
# this session, each against both sweeps.
cal=bench/results/plan/finetune_2rank
mkdir -p "$cal"
./build/dhp plan --calibrate --ranks 2 --out "$cal/local-x2.json"
for name in frozen unfrozen; do
  sets=()
  [ "$name" = frozen ] && sets=("${frozen[@]}")
  DHP_CALIBRATION_DIR=bench/results/plan ./build/dhp plan --config configs/bench.yaml "${sets[@]}" --cluster localx2 \
    --against "bench/results/sweep_2rank_$name/results.json" | tee "bench/results/sweep_2rank_$name/validation.md"
  DHP_CALIBRATION_DIR="$cal" ./build/dhp plan --config configs/bench.yaml "${sets[@]}" --cluster localx2 \
    --against "bench/results/sweep_2rank_$name/results.json" | tee "bench/results/sweep_2rank_$name/validation_recalibrated.md"
done
