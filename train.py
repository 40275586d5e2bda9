"""Train a policy with GRPO or PPO on report 001's workflow-DSL task or report 000's tool task.

    python train.py --k 8 --norm global            # GRPO learns: held-out best rate ~0.14 -> ~0.99
    python train.py --k 2 --batch 3 --norm group   # report 001's setting, for contrast
    python train.py --algo ppo                     # PPO: a value head, GAE, the same task
    python train.py --task tools --reward sparse   # report 000: a multi-turn tool agent
    python train.py --help                         # every flag, with its meaning

Each step: sample B prompts -> generate K completions (or K tool-calling episodes) each
(rollout.py, via workflow_task.py / tool_task.py) -> score them (rewards.py) -> advantages
(advantages.py for GRPO; a critic and GAE in ppo.py for PPO) -> a clipped-surrogate update
(grpo.py / ppo.py) -> one line of metrics.jsonl. The run's folder (--out) holds config.json, metrics.jsonl, samples.jsonl, summary.json, curves.png and, with
--save-every, checkpoints/ (checkpoint.py; `--resume RUN` continues from the newest).

Metrics, one JSON object per step (N = B*K rollouts of that step):
    reward_mean, reward_std   mean and population std of the N rewards
    best_rate, valid_rate     DSL task: share of rollouts that are the best workflow / any
                              valid DSL (valid_rate counts best ones too)
    fallback_rate, junk_rate  DSL task: share of `### Step` text / of anything else off-format
    accuracy, answer_rate, tool_calls, tool_success_rate, wellformed_rate, turns,
    failure/<kind>            tools task: see tool_task.rates
    frac_adv_negative         share of rollouts with a negative advantage (report 000's
                              explanation of the sparse reward's failure); a PPO rollout's
                              advantage is the mean over its policy tokens
    frac_zero_std_groups      share of prompts whose K rewards are all equal (no signal)
    adv_abs_mean, frac_adv_pm1  mean |A|; share of advantages with |A| = 1 (K=2's mark),
                              over the advantages the loss uses: one per rollout (GRPO), one
                              per policy token (PPO)
    loss, entropy, clip_frac, approx_kl, grad_norm   from the update (null when none was
                              taken): token means over the last epoch; approx_kl =
                              E[(ratio - 1) - log ratio]; loss and grad_norm are means over
                              the last epoch's mini-batches, grad_norm before clipping
    steps_taken               optimizer steps applied this step (epochs x mini-batches,
                              minus skipped ones)
    epochs_run                epochs actually run (fewer when --target-kl stopped them)
    value_loss, explained_variance   PPO: the critic's loss and 1 - Var(G - V) / Var(G)
                              on the rollouts (undefined, and wild, when every return is equal)
    kl, kl_coef               token-mean k3 estimate of KL(policy || reference) on the step's
                              rollouts, before the update (null without a reference); the
                              beta used this step (kl.py moves it from kl)
    ref_kl                    the same KL measured in the update's forward (its last epoch);
                              with --fast and one update per batch it is the `kl` above
    lr, entropy_coef          the step's learning rate and entropy bonus (schedules.py)
    updated                   steps_taken > 0: false when every advantage is 0
                              (nothing to learn, and AdamW's momentum would still move the
                              weights), when --skip-all-fallback fires, or when the step was
                              non-finite
    skipped_nonfinite, nonfinite   optimizer steps not taken because a quantity was NaN/inf,
                              and which ("loss", "grad_norm", "reward", or "logits": nothing
                              could be sampled)
    nonfinite_logged          the keys of this line whose NaN/inf value was written as null
    nonfinite_rewards         rewards that were NaN/inf (left out of reward_mean/std)
    alerts                    the stability monitor's active alerts (monitor.py)
    collapsed_after_update    the previous step updated, its on-format rate (valid_rate;
                              wellformed_rate for tools) was > 0, and this step's is at most
                              half of it (report 001: "50% -> 0% right after the update").
                              crash_rate = collapses / updates. A frozen policy raises it
                              too, by binomial noise: summary.json's crash_floor is the rate
                              it would show at the run's own on-format rates (monitor.py).
    eval_<rate>, eval_reward_mean   each rate above, on held-out prompts, at step 0 (a line
                              of its own) and every --eval-every steps: one sample at the
                              training temperature for each of --eval-samples x 32 held-out
                              prompts, drawn with a fixed seed so every evaluation sees the
                              same noise
    eval_value_rmse           PPO: RMSE of V(s_t) against the held-out returns
    seconds                   wall time of the step
"""
import contextlib
import copy
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError

import advantages
import checkpoint
import grpo
import kl
import monitor
import plots
import policy
import ppo
import rollout
import schedules
import tool_task
import workflow_task
import config
from config import Config, default_out, fail, parse_config

TASKS = {"dsl": workflow_task, "tools": tool_task}


# ---- the policy ----

def load(c: Config, task, device: str, log):
    if c.model:
        sft = 0 if c.sft_steps == -1 else c.sft_steps
        # fp32 weights even on a GPU (bf16 is autocast): AdamW steps of lr 1e-6 on bf16
        # weights would mostly round away.
        model, tok = policy.local_policy(task, c.model, sft, c.sft_lr, 64, c.sft_seed, log)
    else:
        sft = 300 if c.sft_steps == -1 else c.sft_steps
        model, tok = policy.tiny_policy(task, c.hidden, c.layers, sft, c.sft_lr, 64, c.sft_seed,
                                        Path(c.cache_dir), log)
    off = policy.disable_dropout(model)            # RL's ratios and KLs need a deterministic forward
    if off:
        log(f"dropout: switched off in {off} places for RL")
    return model.to(device), tok


def evaluate(model, tok, task, eval_prompts: list, c: Config, value_head=None) -> tuple[dict, list]:
    """Held-out rates from a fixed-seed sample; the training RNG is left untouched.

    With a value head (PPO), also eval_value_rmse: the RMSE, over held-out policy tokens, of
    V(s_t) against the return the critic is meant to predict (the outcome reward,
    discounted by gamma, without the KL penalty)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(1234)
        batch, outcomes = task.sample(model, tok, eval_prompts, c.eval_samples, c,
                                      value_head=value_head, old_logp=False)
    out = {f"eval_{key}": v for key, v in task.rates(outcomes).items()}
    out["eval_reward_mean"] = batch.rewards.mean().item()
    if value_head is not None:
        m = batch.completion_mask
        # lam = 1: A_t + V_t is the Monte-Carlo return, whatever V is.
        adv, returns = advantages.gae(ppo.token_rewards(batch.rewards.to(m.device), m),
                                      batch.old_values, m, c.gamma, 1.0)
        out["eval_value_rmse"] = ((batch.old_values - returns)[m.bool()] ** 2).mean().sqrt().item()
    return out, [task.describe(t, o) for t, o in zip(batch.texts, outcomes)]


def rl_step(c: Config, task, model, value_head, tok, optimizer, ref_model, prompts: list, amp,
            step: int, beta: float, entropy_coef: float):
    """One step on B prompts: rollout -> reward -> advantage -> update (GRPO or PPO).

    Returns the batch record, the rollouts' outcomes (the task's: classes or episodes), the
    step's rollout metrics, and the update's statistics (all None when no update was taken)."""
    with amp():
        batch, outcomes = task.sample(model, tok, prompts, c.k, c, ref_model, value_head,
                                      old_logp=not c.reuse_old_logp)               # rewards (N,)
    stats = no_update()
    mask = batch.completion_mask
    has_ref = batch.ref_logp is not None
    finite = torch.isfinite(batch.rewards)                                             # (N,)
    if not finite.all():
        # A reward function returned NaN/inf: no update this step, and the bad values are
        # never averaged into any metric.
        stats.update(skipped_nonfinite=1, nonfinite=["reward"])
        batch.advantages = torch.zeros(len(batch.rewards), device=mask.device)
    elif c.algo == "grpo":
        r = batch.rewards                                                              # (N,)
        if c.kl_in_reward and has_ref:
            # R_i - beta * sum_t kl_it: the KL penalty folded into the sequence reward
            kl_t = kl.estimate(batch.old_logp, batch.ref_logp, c.kl_estimator)       # (N, C)
            r = r - beta * (kl_t * mask).sum(1).cpu()
        batch.advantages = advantages.compute(r, c.k, c.norm, unbiased=c.unbiased,
                                              clip=c.adv_clip or None,
                                              lengths=mask.sum(1).cpu()).to(mask.device)  # (N,)
    else:
        ppo.prepare(batch, beta=beta, kl_estimator=c.kl_estimator,
                    kl_in_reward=c.kl_in_reward, gamma=c.gamma, lam=c.lam)     # (N, C) each
    a = batch.advantages[mask.bool()] if batch.advantages.dim() == 2 else batch.advantages
    seq_adv = rollout_advantages(batch)                                                # (N,)
    r = batch.rewards[finite]
    row = dict(step=step, reward_mean=r.mean().item() if len(r) else None,
               reward_std=r.std(correction=0).item() if len(r) else None, **task.rates(outcomes),
               nonfinite_rewards=int((~finite).sum()),
               frac_zero_std_groups=advantages.frac_zero_std(batch.rewards, c.k),
               adv_abs_mean=a.abs().mean().item(), frac_adv_pm1=advantages.frac_pm1(a),
               frac_adv_negative=(seq_adv < 0).float().mean().item(),
               kl=(kl.estimate(batch.old_logp, batch.ref_logp, "k3") * mask).sum().item()
               / mask.sum().item() if has_ref and batch.old_logp is not None else None, kl_coef=beta)
    if c.algo == "ppo" and finite.all():
        row["explained_variance"] = ppo.explained_variance(batch.old_values, batch.returns, mask)

    # GRPO without KL or entropy terms has nothing to learn from all-zero advantages (and
    # AdamW's momentum would still move the weights); PPO always has its value loss.
    no_signal = c.algo == "grpo" and bool((batch.advantages == 0).all()) and beta == 0 \
        and entropy_coef == 0
    guard = c.skip_all_fallback and row.get("fallback_rate") == 1.0
    if not (no_signal or guard or stats["nonfinite"]):
        common = dict(epochs=c.epochs, mini_batch=c.mini_batch or c.n,
                      micro_batch=c.micro_batch or c.mini_batch or c.n, clip_eps=c.clip_eps,
                      clip_eps_high=c.clip_eps_high or c.clip_eps, beta=beta,
                      kl_estimator=c.kl_estimator, kl_in_loss=not c.kl_in_reward,
                      entropy_coef=entropy_coef, agg=c.loss_agg,
                      max_len=c.max_new_tokens * (c.max_turns if c.task == "tools" else 1),
                      max_grad_norm=c.max_grad_norm or float("inf"), temperature=c.temperature,
                      seed=c.seed * 100003 + step, target_kl=c.target_kl, fast=c.fast)
        with amp():
            if c.algo == "grpo":
                stats = grpo.update(model, optimizer, batch, **common)
            else:
                stats = ppo.update(model, value_head, optimizer, batch, value_clip=c.value_clip,
                                   vf_coef=c.vf_coef, **common)
    if has_ref and batch.old_logp is None:
        # --fast: the update's forward was the sampling policy's; its KL is the same number.
        row["kl"] = stats.get("ref_kl")
    return batch, outcomes, row, stats


def no_update(*nonfinite) -> dict:
    """The update statistics of a step without an update (nonfinite: why it was skipped)."""
    return dict(loss=None, entropy=None, clip_frac=None, approx_kl=None, grad_norm=None,
                steps_taken=0, skipped_nonfinite=int(bool(nonfinite)), nonfinite=list(nonfinite))


def rollout_advantages(batch):
    """(N,) one advantage per rollout: GRPO's A_i, or PPO's mean over the rollout's policy tokens."""
    adv = batch.advantages
    if adv.dim() == 1:
        return adv
    m = batch.completion_mask
    return (adv * m).sum(1) / m.sum(1).clamp_min(1)


# ---- the loop ----

def train(c: Config) -> dict:
    """Run GRPO as configured (or resume it); write the run's files; return its summary."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = Path(c.out or default_out(c))
    out.mkdir(parents=True, exist_ok=True)
    lock = checkpoint.RunLock(out)           # one run per folder, for as long as this one runs
    try:
        return run(c, out)
    finally:
        lock.release()


def run(c: Config, out: Path) -> dict:
    """The run itself, in its locked folder."""
    device = "cuda" if c.device == "cuda" or (c.device == "auto" and torch.cuda.is_available()) else "cpu"
    say = (lambda *a: None) if c.quiet else (lambda s: print(s, file=sys.stderr))
    t_start = time.time()
    if c.overwrite and not c.resume:
        checkpoint.clear_run(out, config.RUN_FILES)
        say(f"--overwrite: removed the earlier run's files from {out}")

    task = TASKS[c.task]
    model, tok = load(c, task, device, say)
    # The reference is the warm start, also when resuming: load() always returns it.
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if c.beta > 0 else None
    value_head = ppo.ValueHead(model.config.hidden_size).to(device) if c.algo == "ppo" else None
    params = list(model.parameters()) + (list(value_head.parameters()) if value_head else [])
    optimizer = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
    kl_control = kl.KLController(c.beta, kl.KLRule(c.kl_control, c.kl_target, c.kl_target_min,
                                                   c.kl_target_max, c.kl_horizon, c.n))
    # bf16 autocast on a GPU; the lesson code is the same on both.
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" \
        else contextlib.nullcontext
    train_prompts, eval_prompts = task.prompts("train"), task.prompts("eval")
    rng = random.Random(c.seed)
    torch.manual_seed(c.seed)
    watch = monitor.StabilityMonitor(c.alert_entropy, c.alert_kl, c.alert_reward_range, c.alert_window)

    # Everything a checkpoint holds besides the weights, the optimizer and the RNGs.
    state = dict(step=0, updates=0, collapses=0, crash_floor=0.0, skipped=0,
                 prev=None,                                      # prev: (updated, on-format rate)
                 first_eval=None, last_eval=None, monitor=None, kl_control=None, value_head=None)
    if c.resume:
        state, used = checkpoint.restore_newest(Path(c.resume), model, optimizer, rng, say)
        watch.load_state_dict(state["monitor"])
        kl_control.load_state_dict(state["kl_control"])
        if value_head is not None:
            value_head.load_state_dict(state["value_head"])
        for name in ("metrics.jsonl", "samples.jsonl"):
            torn = checkpoint.truncate_log(out / name, state["step"])
            if torn:
                say(f"resume: dropped {torn} torn line(s) of {name} (a write cut short)")
        say(f"resumed from {used} at step {state['step']}")
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(c), indent=2))
    metrics = checkpoint.JsonlLog(out / "metrics.jsonl", append=bool(c.resume))
    samples = checkpoint.JsonlLog(out / "samples.jsonl", append=bool(c.resume))

    seconds_before = state.get("seconds", 0.0)               # the run's time before a resume

    def save():
        """A checkpoint now; None (said, counted in the summary) when it cannot be written:
        a full disk ends that save, not the run."""
        state.update(monitor=watch.state_dict(), kl_control=kl_control.state_dict(),
                     value_head=value_head.state_dict() if value_head is not None else None,
                     seconds=seconds_before + time.time() - t_start)
        if not grpo.forward_is_finite(model):
            # blown-up weights would become the newest checkpoint, the one --resume picks
            say(f"step {state['step']}: checkpoint not written: these weights give non-finite logits "
                f"(newest good checkpoint: {checkpoint.find(out) or 'none'})")
            return None
        try:
            return checkpoint.save(out, state["step"], model, tok, optimizer, state, rng)
        except (OSError, SafetensorError) as e:
            state["failed_saves"] = state.get("failed_saves", 0) + 1
            say(f"step {state['step']}: checkpoint not written ({type(e).__name__}: {e}); the run goes on")
            return None

    if state["first_eval"] is None:
        with amp():
            state["first_eval"], eval_rows = evaluate(model, tok, task, eval_prompts, c, value_head)
        state["last_eval"] = state["first_eval"]
        metrics.write({"step": 0, **state["first_eval"]})   # before any update: evaluation only
        samples.write({"step": 0, "split": "eval", "samples": eval_rows})
        say("step 0: held-out " + ", ".join(f"{key} {state['first_eval']['eval_' + key]:.2f}"
                                            for key in task.HEADLINE))

    stopped, interrupts = None, checkpoint.Interrupts(say)
    try:
        for step in range(state["step"] + 1, c.steps + 1):
            t0 = time.time()
            prompts = rng.sample(train_prompts, c.batch) if c.batch <= len(train_prompts) \
                else rng.choices(train_prompts, k=c.batch)
            lr = schedules.lr_at(step, c.steps, c.lr, c.lr_schedule, c.min_lr, c.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            entropy_coef = schedules.linear(step, c.steps, c.entropy_coef,
                                            c.entropy_coef if c.entropy_coef_end < 0 else c.entropy_coef_end)
            try:
                batch, outcomes, row, stats = rl_step(c, task, model, value_head, tok, optimizer, ref_model,
                                                      prompts, amp, step, kl_control.beta, entropy_coef)
            except rollout.NonFiniteLogits:       # nothing could be sampled: a non-finite step
                batch, stats = None, no_update("logits")
                row = dict(step=step, reward_mean=None, kl=None)
                row.update({key: None for key in (*task.HEADLINE, task.FORMAT_KEY)})
            row.update(lr=lr, entropy_coef=entropy_coef)
            if row["kl"] is not None:
                kl_control.update(row["kl"])                  # beta for the next step
            updated = stats["steps_taken"] > 0               # at least one optimizer step applied
            prev_rate = state["prev"][1] if state["prev"] and state["prev"][0] else None
            on_format = row[task.FORMAT_KEY]
            collapsed = bool(prev_rate and on_format is not None and on_format <= prev_rate / 2)
            # the null: how likely that flag was from sampling noise alone (monitor.py)
            floor = monitor.false_collapse_given(prev_rate, c.n) \
                if prev_rate is not None and on_format is not None else 0.0
            state.update(step=step, updates=state["updates"] + updated, prev=(updated, on_format),
                         collapses=state["collapses"] + collapsed,
                         crash_floor=state.get("crash_floor", 0.0) + floor,
                         skipped=state["skipped"] + stats["skipped_nonfinite"])
            row.update(stats, updated=updated, collapsed_after_update=collapsed)
            if stats["nonfinite"] == ["logits"]:
                say(f"step {step}: non-finite logits: nothing could be sampled, step skipped "
                    f"({state['skipped']} so far, --max-skips {c.max_skips})")
            elif stats["nonfinite"]:
                say(f"step {step}: non-finite {' and '.join(stats['nonfinite'])}: optimizer step "
                    f"skipped, weights untouched ({state['skipped']} so far, --max-skips {c.max_skips})")
            row["alerts"], started, messages = watch.update(row["reward_mean"], row.get("entropy"), row["kl"])
            for name, message in zip(started, messages):
                say(f"step {step}: monitor alert {name}: {message}")

            if state["skipped"] > c.max_skips:
                stopped = f"{state['skipped']} non-finite steps, more than --max-skips {c.max_skips}"
            elif c.stop_on_alert and started:
                stopped = f"monitor alert {', '.join(started)} (--stop-on-alert)"
            elif interrupts.signal:
                stopped = f"interrupted by {interrupts.signal}"
            # a stopped run is evaluated where it stops, so its eval_*_end are its own
            if (step % c.eval_every == 0 or step == c.steps or stopped) and batch is not None:
                try:
                    with amp():
                        state["last_eval"], eval_rows = evaluate(model, tok, task, eval_prompts, c, value_head)
                    row.update(state["last_eval"])
                    samples.write({"step": step, "split": "eval", "samples": eval_rows})
                except rollout.NonFiniteLogits:
                    say(f"step {step}: non-finite logits in the held-out evaluation; it is skipped")
            row["seconds"] = time.time() - t0
            metrics.write(row)
            if batch is not None:
                adv = rollout_advantages(batch)                    # (N,)
                samples.write({"step": step, "split": "train", "samples": [
                    dict(prompt=prompts[i // c.k]["text"], **task.describe(batch.texts[i], outcomes[i]),
                         reward=batch.rewards[i].item(), advantage=adv[i].item())
                    for i in range(min(c.log_samples, c.n))]})
            progress(c, task, row, state["last_eval"])

            if stopped or (c.save_every and step % c.save_every == 0):
                path = save()
                for old in checkpoint.prune(out, c.keep_checkpoints):
                    say(f"removed checkpoint {old.name} (--keep-checkpoints {c.keep_checkpoints})")
            if stopped:
                saved = f"weights saved in {path} (resume with --resume {out})" if path else \
                    "no checkpoint written"
                say(f"stopped at step {step}: {stopped}; {saved}")
                break
    finally:
        interrupts.restore()
    metrics.close()
    samples.close()
    state["lost_log_lines"] = metrics.lost + samples.lost      # lines a full disk refused
    return finish(c, task, out, state, watch, stopped, interrupts.signal,
                  seconds_before + time.time() - t_start, say)


SUMMARY_KEYS = ("steps", "updates", "collapses", "crash_rate", "crash_floor", "skipped_nonfinite",
                "alert_episodes", "stopped", "interrupted", "failed_saves", "lost_log_lines",
                "ended_off_format", "frac_adv_negative_mean",
                "eval_value_rmse_end", "eval_reward_mean_end", "seconds", "out")


def summary_keys(task) -> set:
    """Every key summary.json can hold for a task (compare.py checks --columns against it)."""
    return set(SUMMARY_KEYS) | {f"eval_{key}_end" for key in task.RATES} | \
        {f"eval_{key}_start" for key in task.HEADLINE}


def progress(c: Config, task, row: dict, last_eval: dict) -> None:
    """On a terminal, one line rewritten in place; in a log, one line per evaluation."""
    if c.quiet:
        return
    end = "\n" if (row["step"] % c.eval_every == 0 or row["step"] == c.steps) else "\r"
    if end == "\n" or sys.stderr.isatty():
        f = lambda x: "nan" if x is None else f"{x:.2f}"
        key, second = task.HEADLINE
        print(f"step {row['step']:4d}/{c.steps}  reward {f(row['reward_mean'])}  {second} {f(row[second])}  "
              f"{key} {f(row[key])}  held-out {key} {f(last_eval['eval_' + key])}", end=end, file=sys.stderr)


def finish(c: Config, task, out: Path, state: dict, watch, stopped, interrupted, seconds: float,
           say) -> dict:
    """Write summary.json and curves.png; print the one-line summary. seconds: the run's
    whole wall time, over every resume; interrupted: the signal that stopped it, or None."""
    first, last = state["first_eval"], state["last_eval"]
    summary = dict(steps=state["step"], updates=state["updates"], collapses=state["collapses"],
                   crash_rate=state["collapses"] / state["updates"] if state["updates"] else 0.0,
                   crash_floor=state.get("crash_floor", 0.0) / state["updates"] if state["updates"] else 0.0,
                   skipped_nonfinite=state["skipped"], alert_episodes=watch.episodes,
                   stopped=stopped, interrupted=interrupted, failed_saves=state.get("failed_saves", 0),
                   lost_log_lines=state.get("lost_log_lines", 0))
    for key in task.HEADLINE:
        summary[f"eval_{key}_start"] = first[f"eval_{key}"]
    for key, v in last.items():                     # eval_<rate>_end for every held-out rate
        summary[f"{key}_end"] = v
    negative = [r["frac_adv_negative"] for r in plots.read_metrics(out) if "frac_adv_negative" in r]
    summary.update(ended_off_format=last[f"eval_{task.FORMAT_KEY}"] < 0.5,
                   frac_adv_negative_mean=sum(negative) / len(negative) if negative else None,
                   eval_value_rmse_end=last.get("eval_value_rmse"),
                   seconds=round(seconds, 1), out=str(out))
    summary, _ = checkpoint.finite_json(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    plots.plot_run(out)
    headline = ", ".join(f"{key} {summary[f'eval_{key}_start']:.2f} -> {summary[f'eval_{key}_end']:.2f}"
                         for key in task.HEADLINE)
    say(f"{'stopped' if stopped else 'done'} in {summary['seconds']}s: held-out {headline}, crash "
        f"rate {state['collapses']}/{state['updates']} (frozen-policy floor {summary['crash_floor']:.2f}); "
        f"files in {out}/ (curves.png)")
    return summary


if __name__ == "__main__":
    config = parse_config()
    try:
        summary = train(config)
    except (policy.ModelError, checkpoint.ResumeError, checkpoint.RunBusy) as e:  # before training
        fail(str(e))
    # 128 + the signal's number (130 Ctrl-C, 143 SIGTERM), as a shell reports a killed job
    sys.exit(128 + checkpoint.SIGNALS[summary["interrupted"]] if summary["interrupted"]
             else 1 if summary["stopped"] else 0)
