"""Benchmark: seconds per GRPO step of this codebase, and of TRL's GRPOTrainer on the same work.

    python -m tools.bench                                     # tiny model: s/step, time split, tokens/s, peak memory
    python -m tools.bench --config 25m --vs-trl --json results/bench/25m.json
    python -m tools.bench --config qwen0.5b --vs-trl          # on a GPU: a Qwen2.5-0.5B-shaped model
    python -m tools.bench logprobs                            # peak extra memory of logprobs.token_logprobs
    python -m tools.bench --model smollm2-135m --steps 4 --warmup 1   # a real model on the DSL task's prompts
    python -m tools.bench --model smollm2-135m --steps 4 --warmup 1 --lora-rank 1   # LoRA (lora.py)
    python -m tools.bench --config 135m --bf16 --vs-trl --lora-rank 1   # against TRL's LoRA (pip install peft)
    python -m tools.bench bf16                                # is bf16 faster than float32 on this machine?
    python -m tools.bench generate --config qwen0.5b --bf16  # plain generate against a static KV cache (compiled on a GPU)
    python -m tools.bench warmstart --model smollm2-135m --task tools   # peak RSS of 2 warm-start steps
    python -m tools.decode_floor --model smollm2-135m           # generate against its floor (tools/decode_floor.py)

The work: B=8 prompts x K=8 samples of 32 new tokens (qwen0.5b: 32 x 8 = 256
sequences of 256 new tokens), a reference model with beta 0.04, one update per step. Models
are Qwen2ForCausalLM built from a config with random weights (seed 0), with a word-level
tokenizer built in code; prompts are 16 random words; the reward is the share of even token
ids (cheap, and the same for both). Each run is a subprocess of its own, so its peak memory is
its own (RSS on the CPU, torch.cuda.max_memory_allocated on a GPU); with --vs-trl ours and
TRL's runs alternate, --pairs times, and each reports the median step time after --warmup
steps. Ours runs with --fast (old log-probs from the update's forward, as TRL does) unless
--plain.

TRL is not a dependency of this project. Install it only to run --vs-trl, next to the pinned
torch (which then stays as it is):  pip install trl==1.16.0
"""
import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from running import loading

INTERRUPTED = "python -m tools.bench: interrupted; nothing was written"
loading.quiet_ctrl_c(INTERRUPTED)         # torch and matplotlib take seconds to load on a busy machine
import torch

import lora
from models import pretrained
from running import config, report
import warm_start

loading.loaded()                          # from here a KeyboardInterrupt stops a run's subprocess first

ROOT = Path(__file__).parent.parent          # the repository: workers run as `python -m tools.bench` there

CONFIGS = {   # model shape and the work per step
    "tiny": dict(vocab=3072, hidden=128, layers=2, heads=4, kv=2, inter=512, b=8, k=8, new=32, prompt=16),
    "25m": dict(vocab=8192, hidden=512, layers=6, heads=8, kv=4, inter=1792, b=8, k=8, new=32, prompt=16),
    "135m": dict(vocab=49152, hidden=576, layers=30, heads=9, kv=3, inter=1536, b=16, k=8, new=128,
                 prompt=64),                                        # SmolLM2-135M's shape, as a Qwen2
    "qwen0.5b": dict(vocab=151936, hidden=896, layers=24, heads=14, kv=2, inter=4864, b=32, k=8, new=256,
                     prompt=64, micro=32),      # the 256 sequences at once ran out of an H200's memory
}
BETA, LR = 0.04, 1e-6
# --model: a real model's work per step, sized for a CPU: B=4 DSL prompts (through the chat
# template, ~90 tokens) x K=4 samples of up to 24 new tokens, as `train.py --model` runs.
REAL = dict(b=4, k=4, new=24, tool_turn=64)      # tool_turn: --task tools, new tokens per turn


def build(cfg: dict, model_name: str = ""):
    """(model, tokenizer): random weights from seed 0, words w0..wV as the vocabulary; or,
    with model_name, that real model (pretrained.resolve), not warm-started."""
    from transformers import Qwen2ForCausalLM
    from models import policy
    if model_name:
        from models import pretrained
        folder = pretrained.resolve(model_name, pretrained.default_cache(), log=lambda s: print(s, file=sys.stderr))
        return policy.real_policy(None, folder, warm_start.WarmStart(steps=0), policy.CACHE)
    tok = policy.build_tokenizer([f"w{i}" for i in range(cfg["vocab"] - len(policy.SPECIAL))])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(policy.tiny_config(tok, cfg["hidden"], cfg["layers"], 1024,
                                                intermediate_size=cfg["inter"], num_attention_heads=cfg["heads"],
                                                num_key_value_heads=cfg["kv"]))
    return model, tok


def prompts(cfg: dict, n: int, seed: int, tok=None) -> list:
    rng = random.Random(seed)
    if "vocab" not in cfg:                      # a real model: the DSL task's prompts, chat-formatted
        import rollout
        from tasks import workflow_task
        chosen = rng.sample(workflow_task.prompts("train"), n)
        return [rollout.format_prompt(tok, p["text"], workflow_task.SYSTEM_PROMPT) for p in chosen]
    return [" ".join(f"w{rng.randrange(cfg['vocab'] - 3)}" for _ in range(cfg["prompt"])) for _ in range(n)]


def even_share(ids_rows: list) -> list:
    """The benchmark's reward: the share of even token ids in each completion."""
    return [sum(i % 2 == 0 for i in ids) / max(1, len(ids)) for ids in ids_rows]


# ---- ours: the trainer's own functions, timed piece by piece ----

def phase_peak_reset(device: str) -> None:
    """Start a phase's memory peak afresh: the process's RSS high-water mark (a CPU) or torch's
    allocator peak (a GPU)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:                   # VmHWM back to VmRSS
            f.write("5")


def phase_peak_mb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else rss_mb("VmHWM")


def run_ours(cfg: dict, steps: int, bf16: bool, fast: bool, device: str, model_name: str = "",
             shared: bool = True, task_name: str = "dsl") -> dict:
    import grpo
    import logprobs
    import rollout
    import update
    import tasks
    model, tok = build(cfg, model_name)
    model.to(device)
    if cfg.get("lora_rank"):          # as train.py --lora-rank: the reference is the policy, its adapters off
        lora.add_adapters(model, cfg["lora_rank"], alpha=32.0)
        ref = model
    else:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    amp = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    spent, peaks, growth = {}, {}, {}

    def timed(name, fn, memory=True):     # seconds (and peak memory) of each call of fn, by name
        def wrapper(*a, **kw):
            if memory:
                phase_peak_reset(device)
                before = rss_mb("VmRSS") if device == "cpu" else torch.cuda.memory_allocated() / 2 ** 20
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            if memory:         # the high-water mark, and how far above the phase's start it rose
                peaks[name] = max(peaks.get(name, 0.0), phase_peak_mb(device))
                growth[name] = max(growth.get(name, 0.0), phase_peak_mb(device) - before)
            return out
        return wrapper
    rollout.generate = timed("generate", rollout.generate)         # generate's prefill included
    score = rollout.completion_logprobs

    def which_logprobs(m, *a, **kw):          # the reference's forward, or the policy's old log-probs
        adapted = any(layer.enabled for layer in lora.adapters(m))
        name = "reference" if m is ref and not adapted else "old_logprobs"
        return timed(name, score)(m, *a, **kw)
    rollout.completion_logprobs = which_logprobs
    opt.step = timed("optimizer", opt.step, memory=False)
    n, times, split, tokens = cfg["b"] * cfg["k"], [], [], []
    task = real_task(task_name) if model_name else None
    sampling = tasks.Sampling(max_new_tokens=cfg["new"] if task_name == "dsl" else cfg["tool_turn"],
                              shared_prefix=shared)
    hp = grpo.HyperParams(mini_batch=n, micro_batch=cfg.get("micro", n), norm="group", k=cfg["k"], beta=BETA,
                          max_len=cfg["new"], max_grad_norm=1.0, fast=fast)
    for step in range(steps):
        spent.clear()
        t0 = time.perf_counter()
        with amp():
            models = rollout.Models(model, tok, ref)
            if task is not None and task_name == "tools":     # episodes, the task's own reward
                batch, _ = task.sample(models, real_prompts(task, cfg["b"], step), cfg["k"], sampling,
                                       record_old_logp=not fast)
            else:
                batch = rollout.sample(models, prompts(cfg, cfg["b"], step, tok), cfg["k"], sampling,
                                       record_old_logp=not fast)
        t1 = time.perf_counter()
        if task_name == "dsl":
            ids = [row[m.bool()].tolist() for row, m in zip(batch.completion_ids, batch.completion_mask)]
            batch.rewards = torch.tensor(even_share(ids))
        grpo.prepare(batch, hp)                                              # advantages (N,)
        spent["reward"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        with amp():
            timed("update", update.update)(logprobs.Scorer(model), opt, batch, dataclasses.replace(hp, seed=step),
                                           grpo.loss)
        total = time.perf_counter() - t0
        spent["policy_fwd_bwd"] = time.perf_counter() - t2 - spent.get("optimizer", 0.0)
        del spent["update"]
        spent["other"] = total - sum(spent.values())
        times.append(total)
        split.append(dict(spent))
        tokens.append(int(batch.completion_mask.sum()))
    # the phases reset the high-water mark: the whole run's peak is the largest phase's
    return dict(times=times, split=split, tokens=tokens, peak_mb=max([report.peak_memory_mb(), *peaks.values()]),
                phase_peak_mb=peaks, phase_growth_mb=growth)


def real_task(name: str):
    from tasks import tool_task, workflow_task
    return {"dsl": workflow_task, "tools": tool_task}[name]


def real_prompts(task, n: int, seed: int) -> list:
    return random.Random(seed).sample(task.prompts("train"), n)


# ---- TRL's GRPOTrainer on the same model, prompts and sizes ----

def run_trl(cfg: dict, steps: int, bf16: bool, device: str, model_name: str = "") -> dict:
    """TRL's GRPOTrainer on the same model, prompts (a real model's: already in its chat
    template, so TRL tokenizes the same text), sizes and reward."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    model, tok = build(cfg, model_name)
    n = cfg["b"] * cfg["k"]
    peft = None
    if cfg.get("lora_rank"):     # TRL's LoRA is peft's; its reference, too, is the policy with adapters off
        from peft import LoraConfig
        peft = LoraConfig(r=cfg["lora_rank"], lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
    data = Dataset.from_dict({"prompt": [p for s in range(steps) for p in prompts(cfg, cfg["b"], s, tok)]})
    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    def reward(completion_ids=None, **kw):
        return even_share(completion_ids)
    with tempfile.TemporaryDirectory() as out:
        # TRL builds its reference model from the policy's folder: save the same weights there.
        model.save_pretrained(f"{out}/model")
        tok.save_pretrained(f"{out}/model")
        args = GRPOConfig(output_dir=out, model_init_kwargs={"dtype": "float32"}, per_device_train_batch_size=cfg.get("micro", n),
                          gradient_accumulation_steps=n // cfg.get("micro", n), num_generations=cfg["k"],
                          max_completion_length=cfg["new"], beta=BETA, num_iterations=1,
                          max_steps=steps, learning_rate=LR, temperature=1.0, top_k=0, top_p=1.0,
                          bf16=bf16, gradient_checkpointing=False, use_cpu=device == "cpu",
                          report_to="none", save_strategy="no", logging_steps=10 ** 6,
                          disable_tqdm=True, shuffle_dataset=False, seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=f"{out}/model", reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok, callbacks=[Clock()], peft_config=peft)
        trainer.train()
    return dict(times=times, peak_mb=report.peak_memory_mb())


# ---- the log-prob function's memory on Qwen-sized logits ----

def rss_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_logprobs(shape: tuple, dtype: str, how: str) -> dict:
    """Peak RSS above the logits tensor while computing log-probs from it (no grad)."""
    import logprobs
    logits = torch.randn(shape, dtype=getattr(torch, dtype))           # pages touched
    ids = torch.randint(0, shape[-1], shape[:-1])
    with open("/proc/self/clear_refs", "w") as f:                       # reset the peak (VmHWM)
        f.write("5")
    base = rss_mb("VmRSS")
    with torch.no_grad():
        if how == "ours":
            logprobs.token_logprobs(logits, ids)
        else:                                                           # the naive formula
            torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    size = logits.numel() * logits.element_size() / 2 ** 20
    return dict(extra_mb=rss_mb("VmHWM") - base, logits_mb=size)


def logprobs_report(args) -> None:
    full = (64, 256, 151936)
    print(f"peak extra memory of log-probs from logits of shape {full} (V = Qwen's vocabulary), no grad;\n"
          f"'x logits' = the extra memory in units of the logits tensor it was given:")
    for how, rows in (("ours", 64), ("naive", 8)):          # naive at 8 rows: 64 would need ~3x 10 GB
        for dtype in ("bfloat16", "float32"):
            cmd = [sys.executable, "-m", "tools.bench", "--worker", "logprobs", "--shape", f"{rows},256,151936",
                   "--dtype", dtype, "--how", how]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                sys.exit(f"python -m tools.bench: logprobs run failed:\n{out.stderr[-2000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  {how:5s} {dtype:8s} ({rows}, 256, 151936): logits {r['logits_mb']:7.0f} MB, extra "
                  f"{r['extra_mb']:7.0f} MB = {r['extra_mb'] / r['logits_mb']:.2f} x logits")


# ---- the driver: subprocesses, alternating, medians ----

def worker(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker == "logprobs":
        return run_logprobs(tuple(map(int, args.shape.split(","))), args.dtype, args.how)
    if args.worker == "warmstart":
        return run_warmstart(args.model, args.task, args.steps, args.warm_micro)
    cfg = dict(REAL if args.model else CONFIGS[args.config], lora_rank=args.lora_rank)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker == "trl":
        return run_trl(cfg, args.steps, args.bf16, device, args.model)
    if args.each_prompt_whole:                  # shared_prefix's third level off: no start shared by the batch
        import shared_prefix
        shared_prefix.MIN_COMMON_START = 10 ** 9
    return run_ours(cfg, args.steps, args.bf16, not args.plain, device, args.model, not args.no_shared_prefix,
                    args.task)


def run_warmstart(model_name: str, task_name: str, steps: int, micro: int) -> dict:
    """Peak RSS (VmHWM) after loading the real model, and after `steps` warm-start steps of the
    real default (8 examples, lr 1e-4) with `micro` examples per forward (0: the whole batch
    through model(labels=...)); and their seconds."""
    from models import policy
    model, tok = build({}, model_name)
    loaded = rss_mb("VmHWM")
    t0 = time.perf_counter()
    warm = dataclasses.replace(warm_start.DEFAULTS["real"], steps=steps, micro_batch=micro)
    losses = warm_start.fit(real_task(task_name), model, tok, warm)
    return dict(loaded_mb=loaded, peak_mb=rss_mb("VmHWM"), seconds=time.perf_counter() - t0, losses=losses)


def warmstart_report(args) -> None:
    cmd = [sys.executable, "-m", "tools.bench", "--worker", "warmstart", "--model", args.model, "--task", args.task,
           "--steps", str(args.steps), "--warm-micro", str(args.warm_micro)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"python -m tools.bench: the warm-start run failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    how = "the whole batch through model(labels=...)" if args.warm_micro == 0 else \
        f"{args.warm_micro} example(s) per forward, the LM head at the trained positions only"
    print(f"{args.model} {args.task}: {args.steps} warm-start steps of 8 examples, {how}: peak RSS "
          f"{r['peak_mb']:.0f} MB (after loading: {r['loaded_mb']:.0f} MB), {r['seconds']:.1f} s, losses "
          + ", ".join(f"{x:.4f}" for x in r["losses"]))


def generate_report(args) -> None:
    """rollout.sample with plain generate against a static KV cache (tasks.Sampling.static_cache,
    which transformers compiles the decoding step for on a GPU): generated tokens/s over the calls
    after the first, and the first call's seconds (where the compiling happens). --bf16 casts the
    weights to bf16 (a static cache is allocated in the weights' dtype: under autocast its
    float32 cache refuses the bf16 keys)."""
    import rollout
    import tasks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, rows = CONFIGS[args.config], {}
    for static in (False, True):
        model, tok = build(cfg)
        model.to(device, torch.bfloat16 if args.bf16 else torch.float32)
        sampling = tasks.Sampling(max_new_tokens=cfg["new"], static_cache=static)
        seconds, tokens = [], []
        for call in range(args.steps):
            torch.manual_seed(call)
            t0 = time.perf_counter()
            batch = rollout.sample(rollout.Models(model, tok), prompts(cfg, cfg["b"], call), cfg["k"], sampling,
                                   record_old_logp=False)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            tokens.append(int(batch.completion_mask.sum()))
        name = "static cache" if static else "plain"
        rows[name] = dict(first_call_s=seconds[0], seconds=seconds, tokens=tokens,
                          tokens_per_s=statistics.median(t / s for t, s in zip(tokens[1:], seconds[1:])))
        print(f"  {name:12s}: first call {seconds[0]:.1f} s, then {rows[name]['tokens_per_s']:.0f} generated "
              f"tokens/s (median of calls 2..{args.steps}; {cfg['b'] * cfg['k']} sequences of up to {cfg['new']} "
              f"new tokens, {'bf16' if args.bf16 else 'fp32'}, {device})")
    ratio = rows["static cache"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    print(f"  static cache / plain tokens/s: {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(config=dict(name=args.config, **cfg, bf16=args.bf16, device=device),
                                                   ratio=ratio, **rows), indent=1))


def bf16_report(args) -> None:
    """float32 against bf16 on this machine: one 1024 x 1024 matmul, 10 times each."""
    a = torch.randn(1024, 1024)
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x                                                   # first call: allocation, dispatch
        t0 = time.perf_counter()
        for _ in range(10):
            x @ x
        print(f"  10 matmuls 1024 x 1024 in {str(dtype)[6:]:8s}: {time.perf_counter() - t0:.3f} s "
              f"({torch.get_num_threads()} threads)")
    from models import policy
    print(f"policy.bf16_matmul_is_faster(): {policy.bf16_matmul_is_faster()} "
          f"(train.py --bf16 auto uses bf16 autocast for a real model on this CPU only if True)")


def launch(args, who: str) -> dict:
    cmd = [sys.executable, "-m", "tools.bench", "--worker", who, "--config", args.config, "--steps", str(args.steps),
           "--threads", str(args.threads), "--model", args.model, "--task", args.task] + ["--bf16"] * args.bf16 + \
        ["--plain"] * args.plain + ["--no-shared-prefix"] * args.no_shared_prefix + \
        ["--each-prompt-whole"] * args.each_prompt_whole + ["--lora-rank", str(args.lora_rank)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"python -m tools.bench: the {who} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(run: dict, warmup: int) -> dict:
    s = dict(s_per_step=statistics.median(run["times"][warmup:]), peak_mb=run["peak_mb"],
             phase_peak_mb=run.get("phase_peak_mb", {}), phase_growth_mb=run.get("phase_growth_mb", {}))
    if "split" in run:
        keys = run["split"][0].keys()
        s["split"] = {k: statistics.median(x.get(k, 0.0) for x in run["split"][warmup:]) for k in keys}
        gen = [x["generate"] for x in run["split"][warmup:]]
        s["tokens_per_s"] = statistics.median(t / g for t, g in zip(run["tokens"][warmup:], gen))
    return s


def main(argv=None):
    p = config.OneLineParser(prog="python -m tools.bench", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="step", choices=("step", "logprobs", "bf16", "warmstart", "generate"))
    p.add_argument("--model", default="", help="a real model (train.py --model) instead of --config")
    p.add_argument("--config", default="tiny", choices=tuple(CONFIGS))
    p.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians")
    p.add_argument("--pairs", type=int, default=3, help="--vs-trl: alternating (ours, TRL) runs")
    p.add_argument("--vs-trl", action="store_true", help="also run TRL's GRPOTrainer (pip install trl)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (ours) / bf16=True (TRL)")
    p.add_argument("--plain", action="store_true", help="ours without --fast")
    p.add_argument("--no-shared-prefix", action="store_true",
                   help="ours with every sequence encoding its own prompt (shared_prefix.py off)")
    p.add_argument("--each-prompt-whole", action="store_true",
                   help="ours with each prompt encoded once, whole: the start every prompt shares (the system "
                        "prompt) not encoded once for the batch (shared_prefix.encode_prompts)")
    p.add_argument("--task", default="dsl", choices=("dsl", "tools"),
                   help="--model: the DSL task's prompts (even-token reward, as TRL's run) or the tool task's "
                        "episodes (its own reward; not with --vs-trl)")
    p.add_argument("--lora-rank", type=int, default=0, help="ours with LoRA adapters of this rank (alpha 32) "
                   "on every linear layer, as train.py --lora-rank; 0 = every weight trained")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run; 0 = torch's default")
    p.add_argument("--json", default="", help="also write the figures to this file")
    p.add_argument("--warm-micro", type=int, default=1, help="warmstart: examples per forward; 0 = the whole "
                   "batch through model(labels=...), the older path")
    p.add_argument("--worker", choices=("ours", "trl", "logprobs", "warmstart"), help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--how", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if not 0 <= args.warmup < args.steps and args.what == "step":
        p.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    if not 0 <= args.threads <= 4 * (os.cpu_count() or 1):      # 100000 threads crash torch itself
        p.error(f"--threads must be in [0, {4 * (os.cpu_count() or 1)}] (0 = torch's default; 4x the "
                f"{os.cpu_count()} cores at most), got {args.threads}")
    if args.pairs < 1:
        p.error(f"--pairs must be >= 1, got {args.pairs}")
    if not 0 <= args.lora_rank <= 4096:
        p.error(f"--lora-rank must be in [0, 4096], got {args.lora_rank}")
    if args.lora_rank and args.vs_trl and importlib.util.find_spec("peft") is None:
        p.error("--lora-rank with --vs-trl needs peft for TRL's LoRA (pip install peft); or drop --vs-trl")
    if args.json and (Path(args.json).is_dir() or not (config.writable(Path(args.json).parent) and
                      (not Path(args.json).exists() or os.access(args.json, os.W_OK)))):
        p.error(f"--json: cannot write {args.json!r}")         # found now, not after the benchmark
    if args.what == "logprobs":
        return logprobs_report(args)
    if args.what == "bf16":
        return bf16_report(args)
    if args.what == "generate":
        if args.steps < 2:
            p.error(f"generate needs --steps >= 2 (the first call compiles), got {args.steps}")
        return generate_report(args)
    if args.what == "warmstart":
        if not args.model:
            p.error("warmstart needs --model (the tiny model's warm start is small)")
        if args.warm_micro < 0:
            p.error(f"--warm-micro must be >= 0, got {args.warm_micro}")
        problem = pretrained.problem(args.model)
        if problem:
            p.error(f"--model: {problem}")
        return warmstart_report(args)
    if args.task == "tools" and not args.model:
        p.error("--task tools needs --model (the --config shapes have no tool task)")
    if args.task == "tools" and args.vs_trl:
        p.error("--vs-trl compares on the DSL task's prompts (TRL has no tool environment here); drop --task tools")
    if args.model:
        problem = pretrained.problem(args.model)
        if problem:
            p.error(f"--model: {problem}")
    if args.vs_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            p.error("--vs-trl needs TRL: pip install trl==1.16.0 (see docs/performance.md)")
    cfg = dict(REAL if args.model else CONFIGS[args.config], lora_rank=args.lora_rank)
    ours, theirs = [], []
    for _ in range(args.pairs if args.vs_trl else 1):
        ours.append(summarise(launch(args, "ours"), args.warmup))
        if args.vs_trl:
            theirs.append(summarise(launch(args, "trl"), args.warmup))
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"{args.model or args.config}{' ' + args.task if args.model else ''}: B={cfg['b']} x K={cfg['k']}, "
          f"{cfg['new'] if args.task == 'dsl' else str(cfg['tool_turn']) + ' per turn'} new tokens, beta {BETA}, one update per "
          f"step, {'bf16' if args.bf16 else 'fp32'}, {f'LoRA rank {args.lora_rank}' if args.lora_rank else 'every weight trained'}, "
          f"{device}; medians of steps {args.warmup + 1}..{args.steps}")
    for i, o in enumerate(ours):
        split = "  ".join(f"{k} {v:.3f}" for k, v in o["split"].items())
        line = f"  ours{' (plain)' if args.plain else ''}{' (no shared prefix)' if args.no_shared_prefix else ''}{' (each prompt whole)' if args.each_prompt_whole else ''}: {o['s_per_step']:.3f} s/step  [{split}]  " \
               f"{o['tokens_per_s']:.0f} generated tokens/s  peak {o['peak_mb']:.0f} MB  [peak RSS by phase: " + \
               "  ".join(f"{k} {v:.0f} (+{o['phase_growth_mb'].get(k, 0):.0f})" for k, v in o["phase_peak_mb"].items()) + \
               " MB; (+: above the phase's start)]"
        if theirs:
            t = theirs[i]
            line += f"\n  TRL:  {t['s_per_step']:.3f} s/step  peak {t['peak_mb']:.0f} MB  " \
                    f"-> ratio ours/TRL {o['s_per_step'] / t['s_per_step']:.2f}"
        print(line)
    result = dict(config=dict(name=args.model or args.config, **cfg, beta=BETA, bf16=args.bf16, fast=not args.plain,
                              task=args.task if args.model else None, shared_prefix=not args.no_shared_prefix,
                              shared_start=not (args.no_shared_prefix or args.each_prompt_whole),
                              steps=args.steps, warmup=args.warmup, device=device),
                  ours_s_per_step=statistics.median(o["s_per_step"] for o in ours),
                  ours_phase_peak_mb=ours[0]["phase_peak_mb"], ours_phase_growth_mb=ours[0]["phase_growth_mb"],
                  ours_peak_mb=max(o["peak_mb"] for o in ours), ours_split=ours[0]["split"],
                  ours_tokens_per_s=statistics.median(o["tokens_per_s"] for o in ours))
    if theirs:
        ratios = [o["s_per_step"] / t["s_per_step"] for o, t in zip(ours, theirs)]
        result.update(trl_s_per_step=statistics.median(t["s_per_step"] for t in theirs),
                      trl_peak_mb=max(t["peak_mb"] for t in theirs), ratio=statistics.median(ratios),
                      ratios=ratios)
        print(f"  median ratio ours/TRL over {len(ratios)} pairs: {result['ratio']:.2f}; peak memory "
              f"ours {result['ours_peak_mb']:.0f} MB vs TRL {result['trl_peak_mb']:.0f} MB")
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))
            print(f"wrote {args.json}")
        except OSError as e:                     # a full disk after the benchmark: its numbers are above
            print(f"python -m tools.bench: --json {args.json} not written ({e}); the figures are printed above",
                  file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:             # Ctrl-C: one line, as a shell reports it, no traceback
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(130)
