#!/usr/bin/env bash
# Issue 4's benchmark: one disjoint layout, pipelined vs sequential schedule, in one run:
# step time and the idle fraction of the vision and the text ranks.
#   4 processes: vision sp=2 on ranks 0-1, text tp=2 on ranks 2-3 (the issue's layout);
#   2 processes: vision on rank 0, text on rank 1 (one core each on a 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/pipeline
mkdir -p "$out"
four='parallel.strategy=dhp;parallel.vision.ranks=[0,1];parallel.text.ranks=[2,3];training.micro_batches=4'
./build/dhp bench --strategies '' --point "pipelined:$four" --point "sequential:$four;parallel.pipeline=false" \
  --image-sides 224 --nproc 4 --steps 12 --warmup 3 --out runs/bench_pipeline4 "$@" | tee "$out/table_4proc.md"
cp runs/bench_pipeline4/results.json "$out/results_4proc.json"
two='parallel.strategy=custom;parallel.vision.strategy=none;parallel.vision.ranks=[0];parallel.text.strategy=none;parallel.text.ranks=[1];training.micro_batches=4'
./build/dhp bench --strategies '' --point "pipelined:$two" --point "sequential:$two;parallel.pipeline=false" \
  --image-sides 224 --nproc 2 --steps 12 --warmup 3 --out runs/bench_pipeline2 "$@" | tee "$out/table_2proc.md"
cp runs/bench_pipeline2/results.json "$out/results_2proc.json"
