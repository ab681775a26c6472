#!/usr/bin/env bash
# The sweep on video: dhp, tp and zero3 on 4 ranks by clip length, every sample a clip of 8
# frames of the moving shapes task (4 temporal patches), frames of 224, 448, 672 and 896 px
# (1024, 4096, 9216 and 16384 patches a clip: the image sweep's lengths), the largest batch of
# 4, 2, 1 that fits the same per-rank memory limit as bench/sweep.sh's 4-rank run (400 MiB;
# DHP_SWEEP_LIMIT_4 overrides). The longest clip each strategy fits is where its OOM starts.
#   bash bench/sweep_video.sh [extra dhp bench flags, e.g. --repeats 3]
# Writes bench/results/sweep_4rank_video/{table.md,results.json,throughput.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/sweep_4rank_video
mkdir -p "$out"
./build/dhp bench --config configs/bench.yaml --strategies dhp,tp,zero3 --frames 8 --vision-tokens 256,1024,2304,4096 \
  --batch-sizes 1,2,4 --memory-limit "${DHP_SWEEP_LIMIT_4:-400MiB}" --nproc 4 --steps 5 --warmup 2 \
  --out runs/sweep_4rank_video "$@"
cp runs/sweep_4rank_video/table.md runs/sweep_4rank_video/results.json "$out/"
[ -f runs/sweep_4rank_video/throughput.png ] && cp runs/sweep_4rank_video/throughput.png "$out/"
echo "== $out"
