#!/usr/bin/env bash
# Issue 24's benchmark: full fine-tuning vs the vision encoder frozen vs LoRA (rank 16) on every
# linear of the text decoder (vision frozen too, PEFT's usual setting), bench preset, bf16, the
# dhp strategy, on 2 and 4 ranks, in one run each: step time, peak memory per rank, and the
# trainable parameters (dhp params).
#   bash bench/finetune.sh [extra dhp bench flags]
set -euo pipefail
cd "$(dirname "$0")/.."
frozen='model.vision.freeze=true;model.merger.freeze=true'
lora="lora.rank=16;lora.alpha=32;lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj];$frozen"
for n in ${DHP_FINETUNE_RANKS:-2 4}; do
  out=bench/results/finetune_${n}rank
  mkdir -p "$out"
  dhp="parallel.strategy=dhp"
  [ "$n" = 4 ] && dhp="$dhp;parallel.text.tp=2"  # the bench preset's 2 kv heads: text tp=2 x dp=2
  ./build/dhp bench --set model.preset=bench --set training.precision=bf16 --strategies '' \
    --point "full:$dhp" --point "frozen_vision:$dhp;$frozen" --point "lora16_text:$dhp;$lora" \
    --image-sides 224 --batch-sizes 8 --nproc "$n" --steps 8 --warmup 3 --no-plot \
    --out "runs/bench_finetune_${n}" "$@" | tee "$out/table.md"
  cp "runs/bench_finetune_${n}/results.json" "$out/results.json"
done
{
  echo "# trainable parameters (dhp params, bench preset)"
  echo '## full'; ./build/dhp params --set model.preset=bench
  echo '## frozen vision'; ./build/dhp params --set model.preset=bench --set model.vision.freeze=true --set model.merger.freeze=true
  echo '## LoRA 16 on the text decoder'; ./build/dhp params --set model.preset=bench --set model.vision.freeze=true \
    --set model.merger.freeze=true --set lora.rank=16 --set lora.alpha=32 \
    --set 'lora.targets=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]'
} | tee bench/results/finetune_params.txt
