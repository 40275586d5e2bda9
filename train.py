"""Train a policy with GRPO on the workflow-DSL task of report 001.

    python train.py --k 8 --norm global            # learns: held-out best rate ~0.2 -> >0.9
    python train.py --k 2 --batch 3 --norm group   # report 001's setting, for contrast
    python train.py --help                         # every flag, with its meaning

Each step: sample B prompts -> generate K completions each (rollout.py) -> score them
(rewards.py) -> advantages (advantages.py) -> one clipped-surrogate update (grpo.py) ->
one line of metrics.jsonl. The run's folder (--out) holds config.json, metrics.jsonl,
samples.jsonl, summary.json and curves.png.

Metrics, one JSON object per step (N = B*K rollouts of that step):
    reward_mean, reward_std   mean and population std of the N rewards
    best_rate, valid_rate     share of rollouts that are the best workflow / any valid DSL
                              (valid_rate counts best ones too)
    fallback_rate, junk_rate  share of `### Step` text / of anything else off-format
    frac_zero_std_groups      share of prompts whose K rewards are all equal (no signal)
    adv_abs_mean, frac_adv_pm1  mean |A|; share of advantages with |A| = 1 (K=2's mark)
    loss, kl, entropy, clip_frac, grad_norm   from grpo.update (null when no update; kl
                              null without a reference model, i.e. --beta 0);
                              kl and entropy are token means, grad_norm is before clipping
    lr                        the learning rate of the step
    updated                   an optimizer step was taken: false when every advantage is 0
                              (nothing to learn, and AdamW's momentum would still move the
                              weights), when --skip-all-fallback fires, or when the step was
                              non-finite (skipped_nonfinite counts those)
    collapsed_after_update    the previous step updated, its valid rate was > 0, and this
                              step's valid rate is at most half of it (report 001: "50% ->
                              0% right after the update"). crash_rate = collapses / updates.
    eval_best_rate, eval_valid_rate   at step 0 (a line of its own) and every --eval-every steps: one sample at the training
                              temperature for each of --eval-samples x 32 held-out prompts,
                              drawn with a fixed seed so every evaluation sees the same noise
    seconds                   wall time of the step
"""
import argparse
import contextlib
import copy
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

import advantages
import grpo
import plots
import policy
import rewards
import rollout
import workflow_task as task


# ---- configuration: one dataclass, the single source of truth ----

def opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    # the GRPO batch
    k: int = opt(8, "samples per prompt (K); group norms need K >= 2")
    batch: int = opt(8, "prompts per step (B); N = B*K sequences per step")
    norm: str = opt("global", "advantage estimator", choices=advantages.NORMS)
    unbiased: bool = opt(False, "Bessel-corrected std in the advantage (TRL/verl habit; K=2 -> ±0.71)")
    adv_clip: float = opt(0.0, "clamp advantages to [-c, c]; 0 = off")
    # the update
    steps: int = opt(100, "training steps (one batch of rollouts each)")
    lr: float = opt(2e-3, "AdamW learning rate (the tiny model needs a large one)")
    clip_eps: float = opt(0.2, "PPO clip range: ratio kept in [1-eps, 1+eps_high]")
    clip_eps_high: float = opt(0.0, "upper clip range (DAPO's clip-higher); 0 = same as --clip-eps")
    beta: float = opt(0.0, "weight of the k3 KL to the frozen reference; 0 = no reference model")
    entropy_coef: float = opt(0.0, "entropy bonus weight")
    loss_agg: str = opt("token-mean", "how per-token losses are averaged", choices=grpo.AGGREGATIONS)
    epochs: int = opt(1, "optimizer steps on each batch")
    micro_batch: int = opt(0, "sequences per forward/backward (gradient accumulation); 0 = all N")
    max_grad_norm: float = opt(1.0, "clip the global gradient norm; 0 = off")
    skip_all_fallback: bool = opt(False, "report 001's guard: no update when every sample is fallback text")
    # sampling
    temperature: float = opt(1.0, "sampling temperature for rollouts and evaluation")
    max_new_tokens: int = opt(24, "longest completion")
    # evaluation and output
    eval_every: int = opt(10, "evaluate on held-out prompts every this many steps")
    eval_samples: int = opt(4, "samples per held-out prompt at each evaluation")
    seed: int = opt(0, "seed of the RL phase (prompts and sampling)")
    out: str = opt("", "folder for the run's files; default runs/k{K}_b{B}_{norm}_lr{lr}_s{seed}")
    log_samples: int = opt(4, "completions per step written to samples.jsonl")
    quiet: bool = opt(False, "no progress line")
    # the policy
    device: str = opt("auto", "where to run", choices=("auto", "cpu", "cuda"))
    model: str = opt("", "a local Hugging Face causal LM folder; default: the tiny model built in code")
    hidden: int = opt(64, "tiny model: hidden size")
    layers: int = opt(2, "tiny model: transformer layers")
    sft_steps: int = opt(-1, "supervised warm-up steps; -1 = 300 for the tiny model, 0 for --model")
    sft_lr: float = opt(3e-3, "warm-up learning rate")
    sft_seed: int = opt(0, "warm-up seed (one warm start shared by all RL seeds)")
    cache_dir: str = opt(".cache/warmstart", "where warm-started weights are cached")

    # derived sizes, computed in one place
    @property
    def n(self) -> int:
        return self.batch * self.k


class ConfigError(ValueError):
    pass


def validate(c: Config) -> Config:
    """Check every flag before any work starts; raise ConfigError naming the flag."""
    def need(ok, flag, what):
        if not ok:
            raise ConfigError(f"--{flag}: {what}")
    need(c.k >= 1, "k", f"must be >= 1, got {c.k}")
    need(c.norm not in advantages.GROUP_NORMS or c.k >= 2, "k",
         f"norm {c.norm!r} compares samples within a group and needs --k >= 2, got {c.k}")
    need(c.batch >= 1, "batch", f"must be >= 1, got {c.batch}")
    need(c.steps >= 1, "steps", f"must be >= 1, got {c.steps}")
    need(c.lr > 0, "lr", f"must be > 0, got {c.lr}")
    need(0 <= c.clip_eps < 1, "clip-eps", f"must be in [0, 1), got {c.clip_eps}")
    need(c.clip_eps_high >= 0, "clip-eps-high", f"must be >= 0, got {c.clip_eps_high}")
    need(c.adv_clip >= 0, "adv-clip", f"must be >= 0 (0 = off), got {c.adv_clip}")
    need(c.beta >= 0, "beta", f"must be >= 0, got {c.beta}")
    need(c.entropy_coef >= 0, "entropy-coef", f"must be >= 0, got {c.entropy_coef}")
    need(c.epochs >= 1, "epochs", f"must be >= 1, got {c.epochs}")
    need(c.micro_batch >= 0 and (c.micro_batch == 0 or c.n % c.micro_batch == 0), "micro-batch",
         f"must divide N = batch*k = {c.n} (or be 0), got {c.micro_batch}")
    need(c.max_grad_norm >= 0, "max-grad-norm", f"must be >= 0 (0 = off), got {c.max_grad_norm}")
    need(c.temperature > 0, "temperature", f"must be > 0, got {c.temperature}")
    need(c.max_new_tokens >= 1, "max-new-tokens", f"must be >= 1, got {c.max_new_tokens}")
    need(c.eval_every >= 1, "eval-every", f"must be >= 1, got {c.eval_every}")
    need(c.eval_samples >= 1, "eval-samples", f"must be >= 1, got {c.eval_samples}")
    need(c.hidden >= 4 and c.hidden % 4 == 0, "hidden", f"must be a positive multiple of 4, got {c.hidden}")
    need(c.layers >= 1, "layers", f"must be >= 1, got {c.layers}")
    need(c.sft_steps >= -1, "sft-steps", f"must be >= 0 (or -1 = auto), got {c.sft_steps}")
    need(c.device != "cuda" or torch.cuda.is_available(), "device", "cuda asked for but no GPU is visible")
    if c.model:
        path = Path(c.model)
        need(path.is_dir() and (path / "config.json").is_file(), "model",
             f"{c.model!r} is not a readable model folder (no config.json)")
    out = Path(c.out or default_out(c))
    try:                               # the one side effect of validation: the run's folder
        out.mkdir(parents=True, exist_ok=True)
        ok = os.access(out, os.W_OK)
    except OSError:
        ok = False
    need(ok, "out", f"cannot create or write to the folder {str(out)!r}")
    return c


def default_out(c: Config) -> str:
    return f"runs/k{c.k}_b{c.batch}_{c.norm}_lr{c.lr:g}_s{c.seed}"


def fail(message: str):
    """Bad input: one line on stderr, exit code 2, before any work."""
    print(f"train.py: error: {message}", file=sys.stderr)
    sys.exit(2)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):        # one line instead of usage + error
        fail(message)


def parse_config(argv=None) -> Config:
    """The CLI, built from Config's fields: --field-name with the field's help."""
    parser = _OneLineParser(description=__doc__.split("\n\n")[0] + " Flags:",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool or f.type == "bool":
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default,
                                choices=f.metadata.get("choices"), help=f.metadata["help"])
    args = parser.parse_args(argv)
    try:
        return validate(Config(**vars(args)))
    except ConfigError as e:
        fail(str(e))


# ---- the policy and the task's reward ----

def load(c: Config, device: str, log):
    if c.model:
        sft = 0 if c.sft_steps == -1 else c.sft_steps
        # fp32 weights even on a GPU (bf16 is autocast): AdamW steps of lr 1e-6 on bf16
        # weights would mostly round away.
        model, tok = policy.local_policy(c.model, sft, c.sft_lr, 64, c.sft_seed, log)
    else:
        sft = 300 if c.sft_steps == -1 else c.sft_steps
        model, tok = policy.tiny_policy(c.hidden, c.layers, sft, c.sft_lr, 64, c.sft_seed,
                                        Path(c.cache_dir), log)
    return model.to(device), tok


def score(texts: list, prompts: list, k: int):
    """Rewards (N,) and classes for N completions of B prompts (K each, grouped)."""
    bests = [p["best"] for p in prompts for _ in range(k)]
    classes = [rewards.classify(t, b) for t, b in zip(texts, bests)]
    return torch.tensor([rewards.DSL_REWARD[c] for c in classes]), classes


def rates(classes: list) -> dict:
    n = len(classes)
    share = {c: sum(x == c for x in classes) / n for c in ("best", "valid", "fallback", "junk")}
    return dict(best_rate=share["best"], valid_rate=share["best"] + share["valid"],
                fallback_rate=share["fallback"], junk_rate=share["junk"])


def evaluate(model, tok, eval_prompts: list, c: Config) -> tuple[dict, list]:
    """Held-out rates from a fixed-seed sample; the training RNG is left untouched."""
    texts = [policy.format_prompt(tok, p["text"]) for p in eval_prompts]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(1234)
        batch = rollout.sample(model, tok, texts, c.eval_samples, c.max_new_tokens, c.temperature)
    _, classes = score(batch.texts, eval_prompts, c.eval_samples)
    r = rates(classes)
    return {"eval_best_rate": r["best_rate"], "eval_valid_rate": r["valid_rate"],
            "eval_fallback_rate": r["fallback_rate"], "eval_junk_rate": r["junk_rate"]}, \
        list(zip(batch.texts, classes))


def grpo_step(c: Config, model, tok, optimizer, ref_model, prompts: list, amp, step: int):
    """One GRPO step on B prompts: rollout -> reward -> advantage -> update.

    Returns the batch record, the completions' classes, the step's rollout metrics, and the
    update's statistics (all None when no update was taken)."""
    texts = [policy.format_prompt(tok, p["text"]) for p in prompts]
    with amp():
        batch = rollout.sample(model, tok, texts, c.k, c.max_new_tokens, c.temperature, ref_model)
    batch.rewards, classes = score(batch.texts, prompts, c.k)                          # (N,)
    batch.advantages = advantages.compute(batch.rewards, c.k, c.norm, unbiased=c.unbiased,
                                          clip=c.adv_clip or None).to(batch.old_logp.device)  # (N,)
    row = dict(step=step, reward_mean=batch.rewards.mean().item(),
               reward_std=batch.rewards.std(correction=0).item(), **rates(classes),
               frac_zero_std_groups=advantages.frac_zero_std(batch.rewards, c.k),
               adv_abs_mean=batch.advantages.abs().mean().item(),
               frac_adv_pm1=advantages.frac_pm1(batch.advantages), lr=c.lr)

    no_signal = bool((batch.advantages == 0).all()) and c.beta == 0 and c.entropy_coef == 0
    guard = c.skip_all_fallback and row["fallback_rate"] == 1.0
    stats = dict(loss=None, kl=None, entropy=None, clip_frac=None, grad_norm=None,
                 skipped_nonfinite=0)
    if not (no_signal or guard):
        with amp():
            stats = grpo.update(model, optimizer, batch, epochs=c.epochs,
                                micro_batch=c.micro_batch or c.n, clip_eps=c.clip_eps,
                                clip_eps_high=c.clip_eps_high or c.clip_eps, beta=c.beta,
                                entropy_coef=c.entropy_coef, agg=c.loss_agg,
                                max_len=c.max_new_tokens,
                                max_grad_norm=c.max_grad_norm or float("inf"),
                                temperature=c.temperature, seed=c.seed * 100003 + step)
    return batch, classes, row, stats


# ---- the loop ----

def train(c: Config) -> dict:
    """Run GRPO as configured; write the run's files; return its summary."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = "cuda" if c.device == "cuda" or (c.device == "auto" and torch.cuda.is_available()) else "cpu"
    out = Path(c.out or default_out(c))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(c), indent=2))
    say = (lambda *a: None) if c.quiet else (lambda s: print(s, file=sys.stderr))
    t_start = time.time()

    model, tok = load(c, device, say)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if c.beta > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=0.0)
    # bf16 autocast on a GPU; the lesson code is the same on both.
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" \
        else contextlib.nullcontext
    train_prompts, eval_prompts = task.make_prompts("train"), task.make_prompts("eval")
    rng = random.Random(c.seed)
    torch.manual_seed(c.seed)

    metrics_f = open(out / "metrics.jsonl", "w")
    samples_f = open(out / "samples.jsonl", "w")

    def write(f, row):
        f.write(json.dumps(row) + "\n")
        f.flush()                      # a killed run keeps every finished line

    with amp():
        first_eval, eval_rows = evaluate(model, tok, eval_prompts, c)
    write(metrics_f, {"step": 0, **first_eval})       # before any update: evaluation only
    write(samples_f, {"step": 0, "split": "eval", "samples": eval_rows})
    say(f"step 0: held-out best {first_eval['eval_best_rate']:.2f}, "
        f"valid {first_eval['eval_valid_rate']:.2f}, fallback {first_eval['eval_fallback_rate']:.2f}")

    updates = collapses = skipped_total = 0
    prev = None                        # (updated, valid_rate) of the previous step
    last_eval = first_eval
    for step in range(1, c.steps + 1):
        t0 = time.time()
        prompts = rng.sample(train_prompts, c.batch) if c.batch <= len(train_prompts) \
            else rng.choices(train_prompts, k=c.batch)
        batch, classes, row, stats = grpo_step(c, model, tok, optimizer, ref_model, prompts, amp, step)
        if stats["skipped_nonfinite"]:
            say(f"step {step}: skipped {stats['skipped_nonfinite']} non-finite optimizer step(s)")
        updated = stats["loss"] is not None and stats["skipped_nonfinite"] < c.epochs
        collapsed = bool(prev and prev[0] and prev[1] > 0 and row["valid_rate"] <= prev[1] / 2)
        updates += updated
        collapses += collapsed
        skipped_total += stats["skipped_nonfinite"]
        prev = (updated, row["valid_rate"])
        row.update(stats, updated=updated, collapsed_after_update=collapsed)

        if step % c.eval_every == 0 or step == c.steps:
            with amp():
                last_eval, eval_rows = evaluate(model, tok, eval_prompts, c)
            row.update(last_eval)
            write(samples_f, {"step": step, "split": "eval", "samples": eval_rows})
        row["seconds"] = time.time() - t0
        write(metrics_f, row)
        write(samples_f, {"step": step, "split": "train", "samples": [
            dict(prompt=prompts[i // c.k]["text"], text=batch.texts[i], cls=classes[i],
                 reward=batch.rewards[i].item(), advantage=batch.advantages[i].item())
            for i in range(min(c.log_samples, c.n))]})
        if not c.quiet:
            # On a terminal, one line rewritten in place; in a log, one line per evaluation.
            end = "\n" if (step % c.eval_every == 0 or step == c.steps) else "\r"
            if end == "\n" or sys.stderr.isatty():
                print(f"step {step:4d}/{c.steps}  reward {row['reward_mean']:.2f}  "
                      f"valid {row['valid_rate']:.2f}  best {row['best_rate']:.2f}  "
                      f"held-out best {last_eval['eval_best_rate']:.2f}", end=end, file=sys.stderr)
    metrics_f.close()
    samples_f.close()

    summary = dict(steps=c.steps, updates=updates, collapses=collapses,
                   crash_rate=collapses / updates if updates else 0.0,
                   skipped_nonfinite=skipped_total,
                   eval_best_rate_start=first_eval["eval_best_rate"],
                   eval_best_rate_end=last_eval["eval_best_rate"],
                   eval_valid_rate_start=first_eval["eval_valid_rate"],
                   eval_valid_rate_end=last_eval["eval_valid_rate"],
                   eval_fallback_rate_end=last_eval["eval_fallback_rate"],
                   eval_junk_rate_end=last_eval["eval_junk_rate"],
                   ended_off_format=last_eval["eval_valid_rate"] < 0.5,
                   seconds=round(time.time() - t_start, 1), out=str(out))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plots.plot_run(out)
    say(f"done in {summary['seconds']}s: held-out best {summary['eval_best_rate_start']:.2f} -> "
        f"{summary['eval_best_rate_end']:.2f}, valid {summary['eval_valid_rate_start']:.2f} -> "
        f"{summary['eval_valid_rate_end']:.2f}, crash rate {collapses}/{updates}; "
        f"files in {out}/ (curves.png)")
    return summary


if __name__ == "__main__":
    train(parse_config())
