#!/bin/bash
# The GPU session's second command: the tests that failed in run.sh's suite again, with their
# tracebacks (update.py's --fast sort fixed in between), and the benchmarks that had failed on it.
#     bash results/gpu/rerun.sh [seconds]      (reads results/gpu/failed.txt)
set -u
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_RETRIES=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
G=/tmp/g; mkdir -p $G; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
START=$SECONDS; BUDGET=${1:-270}
left() { echo $(( BUDGET - (SECONDS - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
MACHINE="gpu: $(nvidia-smi --query-gpu=name --format=csv,noheader); $(python3 -c 'import torch, transformers, trl; print(f"torch {torch.__version__}; transformers {transformers.__version__}; trl {trl.__version__}")')"
job() {   # job NAME command...: the command's output in $G/NAME.log, headed by it and the machine
  local name=$1; shift
  { echo "# command: $*"; echo "# $MACHINE"; echo "# started at +$((SECONDS - START)) s of the GPU script"; } > $G/$name.log
  local t0=$SECONDS l=$(left)
  if [ $l -lt 10 ]; then echo "# not run: the script's time was spent" >> $G/$name.log; return; fi
  timeout -s INT -k 10 $l "$@" >> $G/$name.log 2>&1; local rc=$?
  echo "# exit $rc after $((SECONDS - t0)) s" >> $G/$name.log
}
( job tests_again python3 -m pytest -q -n 12 --timeout 200 -p no:cacheprovider -rfE --tb=short $(cat results/gpu/failed.txt) ) &
( job bench_tiny python3 -m tools.bench --vs-trl --steps 6 --warmup 2 --pairs 2 --json $G/bench_tiny.json
  job bench_tiny_no_shared_prefix python3 -m tools.bench --vs-trl --no-shared-prefix --steps 6 --warmup 2 --pairs 2 --json $G/bench_tiny_no_shared_prefix.json
  job bench_135m_bf16 python3 -m tools.bench --vs-trl --bf16 --config 135m --steps 4 --warmup 1 --pairs 1 --json $G/bench_135m_bf16.json ) &
( job bench_qwen05b_bf16 python3 -m tools.bench --vs-trl --bf16 --config qwen0.5b --steps 3 --warmup 1 --pairs 1 --json $G/bench_qwen05b_bf16.json ) &
( job generate_qwen05b python3 -m tools.bench generate --config qwen0.5b --bf16 --steps 3 --json $G/generate_qwen05b.json
  job generate_135m python3 -m tools.bench generate --config 135m --bf16 --steps 3 --json $G/generate_135m.json ) &
wait
tar czf $OUT/gpu2.tgz -C /tmp g
for f in $G/*.log; do echo "=== $(basename $f)"; grep -v "^# command\|^# gpu" $f | grep -v "^\[gw\|^tests/" | tail -n 5; done | cut -c1-400
