#!/bin/bash
# The fourth GPU command: first the test files pinned to the CPU after run3.sh (and the golden
# runs, to show they fail on this machine's CPU too), then, with nothing else running, the
# benchmarks against TRL one after another (run3.sh's ran beside the test suite, under a load
# that changed between ours and TRL's run).      bash results/gpu/run4.sh [seconds]
set -u
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_RETRIES=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
G=/tmp/g; mkdir -p $G; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
START=$SECONDS; BUDGET=${1:-330}
left() { echo $(( BUDGET - (SECONDS - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
MACHINE="gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(python3 -c 'import os, torch, transformers, trl, peft; print(f"torch {torch.__version__}; transformers {transformers.__version__}; trl {trl.__version__}; peft {peft.__version__}; {os.cpu_count()} CPUs")' 2>&1 | tail -1)"
echo "$MACHINE" > $G/machine.txt
job() {   # job NAME command...: the command's output in $G/NAME.log, headed by it and the machine
  local name=$1; shift
  { echo "# command: $*"; echo "# $MACHINE"; echo "# started at +$((SECONDS - START)) s of the GPU script"; } > $G/$name.log
  local t0=$SECONDS l=$(left)
  if [ $l -lt 10 ]; then echo "# not run: the script's time was spent"; echo "# not run: the script's time was spent" >> $G/$name.log; return; fi
  timeout -s INT -k 10 $l "$@" >> $G/$name.log 2>&1; local rc=$?
  echo "# exit $rc after $((SECONDS - t0)) s" >> $G/$name.log
}
OMP_NUM_THREADS=1 job tests_pinned timeout 100 python3 -m pytest -q -n 14 -p no:cacheprovider -rfE --tb=line \
  tests/test_rollback.py tests/test_surrogates.py tests/test_trust_regions.py tests/test_truncation.py tests/test_same_learning.py
job bench_135m_full python3 -m tools.bench --vs-trl --bf16 --config 135m --steps 4 --warmup 1 --pairs 1 --json $G/bench_135m_full.json
job bench_135m_lora1 python3 -m tools.bench --vs-trl --bf16 --config 135m --lora-rank 1 --steps 4 --warmup 1 --pairs 1 --json $G/bench_135m_lora1.json
job bench_qwen05b_full python3 -m tools.bench --vs-trl --bf16 --config qwen0.5b --steps 3 --warmup 1 --pairs 1 --json $G/bench_qwen05b_full.json
tar czf $OUT/gpu4.tgz -C /tmp g
for f in $G/*.log; do echo "=== $(basename $f)"; grep -v "^# command\|^# gpu" $f | tail -n 4; done | cut -c1-600
