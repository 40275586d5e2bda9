#!/bin/bash
# The GPU session's one command (device tool, one call): every check of the GPU list at once, as
# parallel processes, each log headed by its command and the machine; all of it ends up in
# $OUT/gpu.tgz, unpacked under results/gpu/ by hand.   bash results/gpu/run.sh [seconds]
set -u
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_RETRIES=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
G=/tmp/g; mkdir -p $G; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
START=$SECONDS; BUDGET=${1:-470}
left() { echo $(( BUDGET - (SECONDS - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
python3 - > $G/machine.txt 2>&1 <<'PY'
import os, platform, torch, transformers
try:
    import trl; t = trl.__version__
except Exception as e:
    t = f"not importable ({type(e).__name__}: {e})"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"gpu: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); transformers {transformers.__version__}; "
      f"trl {t}; python {platform.python_version()}; {os.cpu_count()} CPUs")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $G/machine.txt 2>&1
MACHINE=$(head -1 $G/machine.txt)
job() {   # job NAME command...: the command's output in $G/NAME.log, headed by it and the machine
  local name=$1; shift
  { echo "# command: $*"; echo "# $MACHINE"; echo "# started at +$((SECONDS - START)) s of the GPU script"; } > $G/$name.log
  local t0=$SECONDS l=$(left)
  if [ $l -lt 10 ]; then echo "# not run: the script's time was spent" >> $G/$name.log; return; fi
  timeout $l "$@" >> $G/$name.log 2>&1; local rc=$?
  echo "# exit $rc after $((SECONDS - t0)) s" >> $G/$name.log
}
# 1. the test suite with the GPU visible
( job tests python3 -m pytest -v -n 10 --dist worksteal --timeout 400 -p no:cacheprovider -rfE --durations=30 ) &
# 2. the default job on CUDA, then the same on this machine's CPU
( job main_cuda python3 train.py --k 8 --norm global --out /tmp/runs/main_cuda
  cp /tmp/runs/main_cuda/summary.json $G/main_cuda_summary.json 2>/dev/null
  job main_cpu python3 train.py --k 8 --norm global --device cpu --out /tmp/runs/main_cpu
  cp /tmp/runs/main_cpu/summary.json $G/main_cpu_summary.json 2>/dev/null ) &
# 3. against TRL's GRPOTrainer, interleaved pairs: the tiny model, SmolLM2-135M's shape, Qwen2.5-0.5B's shape
( job bench_tiny python3 -m tools.bench --vs-trl --json $G/bench_tiny.json
  job bench_135m_bf16 python3 -m tools.bench --vs-trl --bf16 --config 135m --steps 6 --warmup 2 --pairs 2 --json $G/bench_135m_bf16.json
  job bench_tiny_no_shared_prefix python3 -m tools.bench --vs-trl --no-shared-prefix --json $G/bench_tiny_no_shared_prefix.json ) &
( job bench_qwen05b_bf16 python3 -m tools.bench --vs-trl --bf16 --config qwen0.5b --steps 4 --warmup 1 --pairs 2 --json $G/bench_qwen05b_bf16.json
  job bench_qwen05b_bf16_no_shared_prefix python3 -m tools.bench --vs-trl --bf16 --no-shared-prefix --config qwen0.5b --steps 4 --warmup 1 --pairs 1 --json $G/bench_qwen05b_bf16_no_shared_prefix.json ) &
# 4. a static KV cache (compiled by transformers) against plain generate
( job generate_qwen05b python3 -m tools.bench generate --config qwen0.5b --bf16 --steps 4 --json $G/generate_qwen05b.json
  job generate_135m python3 -m tools.bench generate --config 135m --bf16 --steps 4 --json $G/generate_135m.json ) &
# 5. torchrun: nccl with two ranks on one GPU (a probe), then train.py with 2 processes against 1
( cat > /tmp/nccl_probe.py <<'PY'
import os, torch, torch.distributed as dist
torch.cuda.set_device(0)
dist.init_process_group("nccl")
x = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(x)
print(f"rank {dist.get_rank()}: nccl all_reduce with both ranks on cuda:0 gave {x.item()}")
dist.destroy_process_group()
PY
  job nccl_probe timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node 2 /tmp/nccl_probe.py
  job torchrun_1 python3 train.py --k 8 --norm global --steps 20 --seed 3 --out /tmp/runs/tr1
  job torchrun_2 python3 -m torch.distributed.run --standalone --nproc_per_node 2 train.py --k 8 --norm global --steps 20 --seed 3 --out /tmp/runs/tr2
  for r in tr1 tr2; do cp /tmp/runs/$r/summary.json $G/torchrun_${r#tr}_summary.json 2>/dev/null; done ) &
wait
tar czf $OUT/gpu.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' -C /tmp g runs 2>/dev/null
for f in $G/*.log; do echo "=== $(basename $f)"; grep -v "^# command\|^# gpu" $f | tail -n 6; done | cut -c1-300
