#!/usr/bin/env bash
# Issue 3's benchmark: dhp, tp and zero3 on 2 ranks, demo model, two image sizes, in one run:
# step time, peak memory per rank, communication time per step per rank.
#   bash bench/strategies.sh [extra dhp bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/strategies_2rank
mkdir -p "$out"
./build/dhp bench --strategies dhp,tp,zero3 --image-sides 112,224 --nproc 2 --steps 12 --warmup 3 \
  --out runs/bench_strategies "$@" | tee "$out/table.md"
cp runs/bench_strategies/results.json "$out/results.json"
