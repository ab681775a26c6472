#!/usr/bin/env bash
# The reference's study on this machine: throughput of dhp, tp, zero3 and the planner's
# choice (auto: every layout, degree, placement and micro-batch count) by vision length,
# the largest batch of 4, 2, 1 that fits a per-rank memory limit (700 MiB on 2 ranks, 400 MiB
# on 4; DHP_SWEEP_LIMIT_2 / _4 override), on 2 and then 4 ranks. ~3 and ~15 minutes here.
#   bash bench/sweep.sh [2|4|all] [extra dhp bench flags, e.g. --repeats 3 on a noisy machine]
# Writes bench/results/sweep_<N>rank/{table.md,results.json,throughput.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:-all}"
shift || true
sweep() {
  local n=$1 tokens=$2 limit=$3
  shift 3
  local out=bench/results/sweep_${n}rank
  mkdir -p "$out"
  ./build/dhp bench --config configs/bench.yaml --strategies dhp,tp,zero3,auto --vision-tokens "$tokens" \
    --batch-sizes 1,2,4 --memory-limit "$limit" --nproc "$n" --steps 5 --warmup 2 \
    --out "runs/sweep_${n}rank" "$@"
  cp "runs/sweep_${n}rank/table.md" "runs/sweep_${n}rank/results.json" "$out/"
  [ -f "runs/sweep_${n}rank/throughput.png" ] && cp "runs/sweep_${n}rank/throughput.png" "$out/"
  echo "== $out"
}
case "$which" in
  2) sweep 2 256,1024,4096 "${DHP_SWEEP_LIMIT_2:-700MiB}" "$@" ;;
  4) sweep 4 256,1024,4096,9216,16384 "${DHP_SWEEP_LIMIT_4:-400MiB}" "$@" ;;
  all) sweep 2 256,1024,4096 "${DHP_SWEEP_LIMIT_2:-700MiB}" "$@"
       sweep 4 256,1024,4096,9216,16384 "${DHP_SWEEP_LIMIT_4:-400MiB}" "$@" ;;
  *) echo "usage: $0 [2|4|all] [dhp bench flags]" >&2; exit 2 ;;
esac
