#!/usr/bin/env bash
# A/B of two dhp binaries on the 2-rank sweep (bench/sweep.sh's points), in one run on one
# machine: A, B, A again (so a drift of the machine shows), then the ratios of step time
# per point, B over the mean of the two A runs (< 1: B faster).
#   bash bench/ab.sh OLD_DHP NEW_DHP [OUT_DIR]
# Needs python3 for the table.
set -euo pipefail
old=$1 new=$2 out=${3:-runs/ab}
mkdir -p "$out"
run() {  # binary, name
  "$1" bench --config configs/bench.yaml --strategies dhp,tp,zero3 --vision-tokens 256,1024,4096 \
    --batch-sizes 1,2,4 --memory-limit "${DHP_SWEEP_LIMIT_2:-700MiB}" --nproc 2 --steps 5 --warmup 2 \
    --out "$out/$2" > "$out/$2.log" 2>&1
  echo "== $2 done"
}
run "$old" a1
run "$new" b
run "$old" a2
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def points(name):
    d = json.load(open(f"{out}/{name}/results.json"))
    return {(p["strategy"], p["vision_tokens"]): p for p in d["points"]}
a1, b, a2 = points("a1"), points("b"), points("a2")
print("| strategy | patches | batch | A1 s/step | B s/step | A2 s/step | B / mean(A) |")
print("|---|---|---|---|---|---|---|")
ratios = []
for k in sorted(b):
    if k not in a1 or k not in a2 or b[k]["oom"] or a1[k]["oom"] or a2[k]["oom"]:
        print(f"| {k[0]} | {k[1]} | - | - | - | - | (oom or missing) |")
        continue
    if not (a1[k]["batch_size"] == b[k]["batch_size"] == a2[k]["batch_size"]):
        print(f"| {k[0]} | {k[1]} | {a1[k]['batch_size']}/{b[k]['batch_size']}/{a2[k]['batch_size']} | - | - | - | "
              "(kept batches differ: memory peaks changed) |")
        continue
    ma = (a1[k]["step_time_s"] + a2[k]["step_time_s"]) / 2
    r = b[k]["step_time_s"] / ma
    ratios.append(r)
    print(f"| {k[0]} | {k[1]} | {b[k]['batch_size']} | {a1[k]['step_time_s']:.3f} | {b[k]['step_time_s']:.3f} | "
          f"{a2[k]['step_time_s']:.3f} | {r:.3f} |")
if ratios:
    import math
    g = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"\ngeometric mean B / A: {g:.3f} over {len(ratios)} points")
PY
