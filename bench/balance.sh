#!/usr/bin/env bash
# Replicas balanced by cost against contiguous runs of samples (parallel.balance), on a
# mixed-resolution batch (images of 112-896 px, heights and widths drawn apart), vision and
# text dp or zero3, on 2 and 4 ranks, 3 rounds each: step time, and the stalled fraction of
# each group (time not computing: waiting for a slower replica, or communicating).
#   bash bench/balance.sh [OUT_ROOT]   (default bench/results; ~12 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
for n in 2 4; do
  batch=$((n * 4))
  ./build/dhp bench --strategies '' \
    --point 'dp_cost:parallel.strategy=dp' \
    --point 'dp_contiguous:parallel.strategy=dp;parallel.balance=contiguous' \
    --point 'zero3_cost:parallel.strategy=zero3' \
    --point 'zero3_contiguous:parallel.strategy=zero3;parallel.balance=contiguous' \
    --mixed-sides 112-896 --nproc "$n" --batch-sizes "$batch" --steps 8 --warmup 2 --repeats 3 \
    --out "$out/balance_${n}rank"
done
