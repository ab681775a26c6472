#!/usr/bin/env bash
# Communication beside compute (parallel.overlap) against the old schedule (every gradient
# reduction after the backward, every ZeRO-3 gather and reduce-scatter waited for at once),
# in one run per rank count: dp, zero3 and dhp (vision sp + ZeRO-1, text tp) on the bench
# preset, 2 and 4 ranks, 3 rounds each. 4 MiB buckets, so that each module has several (the
# bench preset's towers have 5.6M and 40.4M parameters: 11 and 81 MB of bf16 gradients). The
# table gives step time, comm % (time in collectives, counting a started one's wait) and the
# profiled step's breakdown.
#   bash bench/overlap.sh [OUT_ROOT]   (default bench/results; ~25 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results}
for n in 2 4; do
  ./build/dhp bench --config configs/bench.yaml --strategies '' \
    --point 'dp_overlap:parallel.strategy=dp;parallel.bucket_mb=4' \
    --point 'dp_end:parallel.strategy=dp;parallel.bucket_mb=4;parallel.overlap=false' \
    --point 'zero3_overlap:parallel.strategy=zero3' \
    --point 'zero3_end:parallel.strategy=zero3;parallel.overlap=false' \
    --point 'dhp_overlap:parallel.strategy=dhp;parallel.bucket_mb=4' \
    --point 'dhp_end:parallel.strategy=dhp;parallel.bucket_mb=4;parallel.overlap=false' \
    --nproc "$n" --vision-tokens 1024 --batch-sizes "$((n * 2))" --steps 8 --warmup 2 --repeats 3 \
    --out "$out/overlap_${n}rank"
done
