#!/bin/bash
# SmolLM2 step: full fine-tuning vs LoRA r=1 / r=16, fp32 (this CPU has no fast bf16: --bf16 auto picks fp32), the lab paused
cd /work/main
. /work/venv/bin/activate
PG=$(cat /tmp/labpg)
kill -STOP -$PG
O=results/smollm2-135m/bench
for rep in 1 2; do
  for r in 0 1 16; do
    python -m tools.bench --model smollm2-135m --steps 4 --warmup 1 --lora-rank $r --json $O/lora_r${r}_fp32_$rep.json
  done
done
for r in 0 1; do
  python -m tools.bench --model smollm2-135m --task tools --steps 3 --warmup 1 --lora-rank $r --json $O/lora_r${r}_fp32_tools.json
done
kill -CONT -$PG
echo BENCH-DONE
