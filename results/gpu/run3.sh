#!/bin/bash
# The third GPU command (device tool, one call): the CI test set with CUDA visible after the first
# session's fixes, the quick lab alone with its traceback, and against TRL the rows the first session
# could not measure: Qwen2.5-0.5B's shape in micro-batches of 32, and LoRA (ours: lora.py; TRL's:
# peft) beside full fine-tuning on the same warm machine. Every log is headed by its command and
# the machine; all of it ends up in $OUT/gpu3.tgz, unpacked under results/gpu/third/ by hand.
#     bash results/gpu/run3.sh [seconds]
set -u
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_RETRIES=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
G=/tmp/g; mkdir -p $G; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
START=$SECONDS; BUDGET=${1:-420}
left() { echo $(( BUDGET - (SECONDS - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
MACHINE="gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(python3 -c 'import os, torch, transformers, trl, peft; print(f"torch {torch.__version__}; transformers {transformers.__version__}; trl {trl.__version__}; peft {peft.__version__}; {os.cpu_count()} CPUs")' 2>&1 | tail -1)"
echo "$MACHINE" > $G/machine.txt
job() {   # job NAME command...: the command's output in $G/NAME.log, headed by it and the machine
  local name=$1; shift
  { echo "# command: $*"; echo "# $MACHINE"; echo "# started at +$((SECONDS - START)) s of the GPU script"; } > $G/$name.log
  local t0=$SECONDS l=$(left)
  if [ $l -lt 10 ]; then echo "# not run: the script's time was spent" >> $G/$name.log; return; fi
  timeout -s INT -k 10 $l "$@" >> $G/$name.log 2>&1; local rc=$?
  echo "# exit $rc after $((SECONDS - t0)) s" >> $G/$name.log
}
# 1. the README's test set (slow tier deselected, as CI), 2 threads a worker as on CI's 2 cores
( OMP_NUM_THREADS=2 job tests python3 -m pytest -q -n 10 --dist worksteal --timeout 300 -p no:cacheprovider -rfE --tb=short --durations=25 ) &
# 2. the quick lab end to end (slow tier), alone, with its traceback
( job quick_lab python3 -m pytest -q -m slow -k quick_lab -p no:cacheprovider -rfE --tb=long ) &
# 3. SmolLM2-135M's shape: full fine-tuning, then LoRA r=1 (TRL: peft, all-linear, alpha 32), each against TRL; r=16 ours alone
( job bench_135m_full python3 -m tools.bench --vs-trl --bf16 --config 135m --steps 4 --warmup 1 --pairs 1 --json $G/bench_135m_full.json
  job bench_135m_lora1 python3 -m tools.bench --vs-trl --bf16 --config 135m --lora-rank 1 --steps 4 --warmup 1 --pairs 1 --json $G/bench_135m_lora1.json
  job bench_135m_lora16 python3 -m tools.bench --bf16 --config 135m --lora-rank 16 --steps 4 --warmup 1 --json $G/bench_135m_lora16.json ) &
# 4. Qwen2.5-0.5B's shape (256 sequences of 256 new tokens, micro-batches of 32): full, then LoRA r=1, each against TRL
( job bench_qwen05b_full python3 -m tools.bench --vs-trl --bf16 --config qwen0.5b --steps 3 --warmup 1 --pairs 1 --json $G/bench_qwen05b_full.json
  job bench_qwen05b_lora1 python3 -m tools.bench --vs-trl --bf16 --config qwen0.5b --lora-rank 1 --steps 3 --warmup 1 --pairs 1 --json $G/bench_qwen05b_lora1.json ) &
wait
tar czf $OUT/gpu3.tgz -C /tmp g
for f in $G/*.log; do echo "=== $(basename $f)"; grep -v "^# command\|^# gpu" $f | grep -v "^\[gw\|^tests/" | tail -n 4; done | cut -c1-600
