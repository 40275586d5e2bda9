"""Train a policy with GRPO, PPO or RCE on report 001's workflow-DSL task or report 000's tool task.

    python train.py --k 8 --norm global            # GRPO learns: held-out best rate ~0.14 -> ~0.99
    python train.py --k 2 --batch 3 --norm group   # report 001's setting, for contrast
    python train.py --algo ppo                     # PPO: a value head, GAE, the same task
    python train.py --task tools --reward sparse   # report 000: a multi-turn tool agent
    python train.py --algo rce --reward composite --save-every 20 --out runs/rce   # report 003's RCE
    python train.py --model smollm2-135m --k 4 --batch 4 --lr 2e-5 --steps 20   # a real LLM (docs/lessons/5-real-llm.md)
    torchrun --standalone --nproc_per_node 2 train.py --k 8 --norm global      # the same run on 2 processes

The default run is not DeepSeekMath's GRPO. It departs in four places, each a flag away:

    one epoch, one mini-batch: every ratio is 1, so the clip never acts     --epochs 2 (or --mini-batch N/2)
    beta 0: no KL term and no reference model                               --beta 0.04
    global normalisation, (r - mean) / std over the whole batch             --norm group
    token-mean: every token of the batch weighs the same                    --loss-agg seq-mean-token-mean

so it is the plain policy gradient with a baseline (grpo.py says what each one changes).

`build` makes the policy, the critic, the reference, the optimizer and the controllers. One step
(`rl_step`): the task (tasks/) samples K completions or tool episodes per prompt (rollout.py,
logprobs.py) and scores them (rewards.py); the algorithm's `prepare` makes advantages (grpo.py,
advantages.py; ppo.py: a critic and GAE; rce.py: reward weights); update.py differentiates its
`loss`. The loop sets each step's lr, entropy bonus and beta (step_hyper_params) and moves the
controllers (`steer`); running/session.py opens the run and, after each step, evaluates, logs,
rolls back (--rollback) and checkpoints (`end_step`); docs/metrics.md describes the run's folder.
"""
import copy
import dataclasses
import sys
import time
from typing import Callable

from running import loading
loading.quiet_ctrl_c("train.py: stopped (SIGINT) while loading; nothing was written")   # not a traceback
import torch

import diagnostics
import dynamic_sampling
import entropy_control
import grpo
import kl
import lora
import mismatch
import monitor
import ppo
import rce
import rewards
import rollout
import tool_env
import update
from running import checkpoint, distributed
from running.config import Config, fail, parse_config
from running.session import Learner, Run, RankLost, end_step, open as open_run, stopped_at_once
from models import policy, pretrained
loading.loaded()


# ---- built once, before the first step (running/session.py calls it) ----

def build(cfg: Config, task, device: str, log, init: dict | None) -> dict:
    """What RL starts from: the policy, PPO's critic (ppo.py), the reference, the optimizer and the
    controllers: beta's (kl.py), adaptive entropy's (entropy_control.py; None: the schedule), the
    monitor's, report 001's count and --rollback's (monitor.py). init: --init-from's, pinned."""
    model, tok = policy.load(cfg, task, device, log, init)       # the warm-started policy
    critic = None if cfg.algo != "ppo" else ppo.Critic(model) if cfg.critic == "separate" else \
        ppo.ValueHead(model.config.hidden_size).to(device)
    ref, optimizer = reference_and_optimizer(cfg, model, critic)
    rule = kl.KLRule(cfg.kl_control, cfg.kl_target, cfg.kl_target_min, cfg.kl_target_max, cfg.kl_horizon, cfg.n)
    adaptive = entropy_control.AdaptiveEntropy(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta)
    return dict(model=model, tok=tok, critic=critic, ref=ref, optimizer=optimizer,
                kl_control=kl.KLController(cfg.beta, rule),
                entropy_control=adaptive if cfg.entropy_target > 0 else None,
                stability=monitor.StabilityMonitor(cfg.alert_entropy), collapse=monitor.CollapseCount(cfg.n),
                rollbacks=monitor.Rollbacks(cfg.rollback, cfg.rollback_at, cfg.rollback_lr_cut, task.FORMAT_KEY)
                if cfg.rollback else None)


def reference_and_optimizer(cfg: Config, model, critic) -> tuple:
    """The reference: the policy RL starts from, frozen (as TRL and verl take it), kept only when
    beta > 0; under --lora-rank (lora.py) the policy itself with its adapters off, no copy.
    The optimizer: AdamW without weight decay (or plain SGD, --optimizer sgd), over param_groups."""
    if cfg.lora_rank:
        if not lora.add_adapters(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed):
            raise pretrained.ModelError("--lora-rank: the model has no nn.Linear layer to adapt besides its "
                                        "head (GPT-2's are Conv1D); train every weight (--lora-rank 0)")
        ref = model if cfg.beta > 0 else None                  # rollout.score_logprobs turns its adapters off
    else:
        ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 else None
    groups = param_groups(cfg, model, critic)
    if cfg.optimizer == "sgd":
        return ref, torch.optim.SGD(groups, lr=cfg.lr)
    return ref, torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)


def param_groups(cfg: Config, model, critic) -> list:
    """The policy's trained parameters (under LoRA its adapters alone); PPO's critic (a value head
    or a network) in a group of its own at --critic-lr, clipped on its own (update.optimizer_step),
    unless a shared head at --lr."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if critic is None or (cfg.critic == "shared" and cfg.critic_lr in (0, cfg.lr)):
        return [{"params": trained + (list(critic.parameters()) if critic else [])}]
    scale = (cfg.critic_lr or cfg.lr) / cfg.lr
    return [{"params": trained},
            {"params": list(critic.parameters()), "lr": cfg.lr * scale, "lr_scale": scale}]


# ---- one step ----

# Each algorithm is a module with two functions: prepare (rewards -> advantages) and loss
# (what update.py's loop differentiates).
ALGOS = {"grpo": grpo, "ppo": ppo, "rce": rce}


def sample_rollouts(learner: Learner, prompts: list, hp: grpo.HyperParams, draw: Callable):
    """The step's rollouts, rewarded: B prompts x K samples, or with --dynamic-sampling rounds
    of B fresh prompts (draw()) until B groups' rewards differ (dynamic_sampling.py).
    Returns (batch, outcomes, their prompts, the sampling's metrics); batch None when the
    policy's logits were non-finite."""
    models, sampling = learner.models, learner.sampling
    if learner.rollout_policy:        # a sampler that is not quite the policy, its log-probs kept (mismatch.py)
        models, sampling = learner.rollout_policy.rollout(models, sampling)

    def one_round(prompts):
        with learner.autocast():
            return learner.task.sample(models, prompts, hp.k, sampling,
                                       record_old_logp=not hp.reuse_old_logp)           # rewards (N,)
    try:
        if learner.dynamic:           # DAPO: keep only groups whose rewards differ
            return dynamic_sampling.sample(one_round, draw, prompts, hp.k, learner.dynamic)
        return (*one_round(prompts), prompts, {})
    except rollout.NonFiniteLogits:
        return None, None, prompts, {}


def rl_step(learner: Learner, prompts: list, hp: grpo.HyperParams, draw: Callable):
    """One step on B prompts: rollout -> reward -> advantage -> update (GRPO, PPO or RCE).

    draw() gives B fresh prompts (--dynamic-sampling's further rounds). Returns the batch the
    update trained on (rollout.Rollout), the rollouts' outcomes (the task's: classes or
    episodes), their prompts, the step's metrics (diagnostics.rollout_metrics) and the update's
    statistics (diagnostics.no_update's when no update was taken)."""
    batch, outcomes, prompts, extra = sample_rollouts(learner, prompts, hp, draw)
    # Under torchrun every decision that skips work is taken by all ranks together
    # (distributed.any_rank), or one rank would wait forever in a collective the others skip.
    if distributed.any_rank(batch is None):
        raise rollout.NonFiniteLogits("non-finite logits while sampling (on this rank or another)")
    finite = not distributed.any_rank(not torch.isfinite(batch.rewards).all())
    algo = ALGOS[hp.algo]
    if finite:
        algo.prepare(batch, hp)                    # advantages: (N,) GRPO, (N, C) PPO; RCE's weights
        if hp.rollout_correction != "none":       # each token's weight pi_old / pi_sampler (mismatch.py)
            mismatch.weigh(batch, hp)
    else:                                          # the bad rewards never reach a metric
        batch.advantages = torch.zeros(len(batch.rewards), device=batch.completion_mask.device)
    # DAPO: completions cut at the limit leave the loss (a copy; the metrics read the whole batch)
    trained = rewards.mask_truncated(batch) if hp.mask_truncated else batch
    if hp.rollout_correction == "bypass":       # pi_old is the sampler (mismatch.py); the metrics keep both
        trained = dataclasses.replace(trained, old_logp=trained.rollout_logp)
    skipped = why_no_update(trained, outcomes, extra, hp, finite)
    if skipped is None:
        with learner.autocast():
            stats = update.update(learner.scorer, learner.optimizer, trained, hp, algo.loss)
    else:
        stats = diagnostics.no_update() if finite else diagnostics.no_update("reward")
    row = dict(diagnostics.rollout_metrics(batch, outcomes, learner.task, hp, join=distributed.concat),
               **extra, update_skipped=skipped)
    if batch.ref_logp is not None and batch.old_logp is None:
        # --fast: the update's forward was the sampling policy's; its KL is the same number.
        row["kl"] = stats.get("ref_kl")
    return trained, outcomes, prompts, row, stats


def why_no_update(batch, outcomes: list, extra: dict, hp: grpo.HyperParams, finite: bool) -> str | None:
    """Why this step takes no update, or None; the same answer on every rank (any_rank), or one
    rank would wait forever in a collective the others skip.

    non_finite_reward  a reward function returned NaN/inf (counted as a non-finite step)
    no_group_kept      --dynamic-sampling found no group whose rewards differ in its rounds
                       (verl raises; under --norm global the rejected groups would train)
    all_truncated      --mask-truncated, and every completion was cut at the token limit: no
                       token is left to train on
    no_signal          GRPO without KL or entropy terms and every advantage 0 (AdamW's
                       momentum would still move the weights); PPO always has its value loss
    all_fallback       report 001's guard (skip_all_fallback): every sample is fallback text"""
    if not finite:
        return "non_finite_reward"
    if extra.get("groups_kept") == 0:
        return "no_group_kept"
    if hp.mask_truncated and not distributed.any_rank(bool(batch.completion_mask.any())):
        return "all_truncated"
    if hp.algo == "grpo" and hp.beta == 0 and hp.entropy_coef == 0 \
            and not distributed.any_rank((batch.advantages != 0).any()):
        return "no_signal"
    if hp.skip_all_fallback and not distributed.any_rank(not all(c == "fallback" for c in outcomes)):
        return "all_fallback"                                                # the whole batch's
    return None


def draw_prompts(run: Run, difficulty: int) -> list:
    """A step's B training prompts of a difficulty (this rank's share of them under torchrun)."""
    train, b = run.prompts["train"][difficulty], run.cfg.batch
    prompts = run.rng.sample(train, b) if b <= len(train) else run.rng.choices(train, k=b)
    return distributed.shard(prompts)                # torchrun: this rank's B/W of them, groups whole


def step_hyper_params(run: Run, step: int) -> grpo.HyperParams:
    """This step's learning rate (set in the optimizer), and its hyper-parameters: beta from
    the KL controller, the scheduled entropy bonus and RCE temperature, the mini-batch
    shuffle's seed."""
    cfg = run.cfg
    lr = update.lr_at(step, cfg.steps, cfg.lr, cfg.lr_schedule, cfg.min_lr, cfg.warmup_steps)
    for group in run.learner.optimizer.param_groups:        # the critic's at --critic-lr / --lr of it
        group["lr"] = lr * group.get("lr_scale", 1.0)
    end = cfg.entropy_coef if cfg.entropy_coef_end < 0 else cfg.entropy_coef_end
    tau = {"rce_temp": update.linear(step, cfg.steps, cfg.rce_temp_start, cfg.rce_temp_end)} if cfg.algo == "rce" else {}
    entropy_coef = run.entropy_control.applied() if run.entropy_control else \
        update.linear(step, cfg.steps, cfg.entropy_coef, end)             # --entropy-target: entropy_control.py
    return dataclasses.replace(run.hp, beta=run.kl_control.beta, seed=cfg.seed * 100003 + step,
                               entropy_coef=entropy_coef, **tau)


def steer(run: Run, row: dict, stats: dict, batch) -> None:
    """After the update: beta from the KL its rule reads (kl.py; report 003's range rule reads the
    update's own, policy_shift), adaptive entropy's weight (entropy_control.py), and report 001's
    collapsed_after_update: this step's on-format rate at most half the updated step's before
    (monitor.CollapseCount, which sums the flag's null beside it)."""
    cfg = run.cfg
    if kl.READS[cfg.kl_control] == "policy_shift" and batch is not None and stats["steps_taken"]:
        with run.learner.autocast():
            stats["policy_shift"] = update.policy_shift(run.learner.scorer, batch, run.hp)
    measured = {**row, **stats}.get(kl.READS[cfg.kl_control])
    if row["kl"] is not None and measured is not None:
        run.kl_control.update(measured)
    if run.entropy_control is not None and stats["steps_taken"]:
        row["entropy_coef_adaptive"] = run.entropy_control.update(stats["entropy"])
    collapsed = run.collapse.update(stats["steps_taken"] > 0, row[run.learner.task.FORMAT_KEY])
    row.update(stats, updated=stats["steps_taken"] > 0, collapsed_after_update=collapsed)


def exit_code(summary: dict) -> int:
    """128 + the signal's number when one stopped the run (130 Ctrl-C, 143 SIGTERM, as a shell
    reports a killed job); 1 when it stopped on a failure, could write none of its checkpoints,
    or took no update at all because every one was non-finite; else 0."""
    if summary["interrupted"]:
        return 128 + checkpoint.SIGNALS[summary["interrupted"]]
    return 1 if summary["stopped"] or summary.get("unsaved") or summary.get("nothing_learned") else 0


# ---- the loop ----

def train(cfg: Config) -> dict:
    """Run GRPO, PPO or RCE as configured (or resume it) in its locked folder; write the run's
    files; return its summary (summary.json)."""
    with open_run(cfg, build) as run:   # load, resume, logs, lock, signals; the summary after
        task = run.learner.task
        for step in range(run.state.step + 1, cfg.steps + 1):
            run.step_started = time.time()
            if distributed.launched():                     # torchrun: this rank's own sampling seed
                torch.manual_seed(distributed.sampling_seed(cfg.seed, step))
            hp = step_hyper_params(run, step)
            # --difficulty, or the curriculum's phase: never below the last step's (a curriculum
            # resumed with more --steps stretches its phases, and would otherwise step back)
            level = tool_env.difficulty_at(step, cfg.steps, cfg.difficulty) if cfg.curriculum else cfg.difficulty
            level = run.state.difficulty = max(level, run.state.difficulty)
            prompts = draw_prompts(run, level)             # this rank's share, under torchrun
            try:
                batch, outcomes, prompts, row, stats = rl_step(run.learner, prompts, hp,
                                                               lambda: draw_prompts(run, level))
            except rollout.NonFiniteLogits:                # nothing could be sampled: a non-finite step
                batch, outcomes, row, stats = None, None, diagnostics.no_rollout(task), diagnostics.no_update("logits")
            row = {"step": step, **row, "lr": run.learner.optimizer.param_groups[0]["lr"],
                   "entropy_coef": hp.entropy_coef, **({"rce_temp": hp.rce_temp} if hp.algo == "rce" else {}),
                   **({"difficulty": level} if task.MAX_DIFFICULTY > 1 else {})}
            steer(run, row, stats, batch)                  # beta, adaptive entropy, report 001's count
            # alerts, held-out evaluation, early stop, logs, checkpoints
            if end_step(run, row, stats, (batch, outcomes, prompts)):
                break
    return run.summary


if __name__ == "__main__":
    cfg = parse_config()
    try:
        summary = train(cfg)
    except (pretrained.ModelError, checkpoint.ResumeError, checkpoint.RunBusy) as e:  # before training
        fail(str(e))
    except RankLost as e:
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:       # Ctrl-C before the run caught signals (loading, the warm start),
        sys.exit(stopped_at_once(cfg, str(e) or "SIGINT"))   # or a second signal: one line, not a traceback
    except OSError as e:                 # no room on the disk before the run could say so itself
        if e.errno not in checkpoint.NO_ROOM:
            raise
        print(f"train.py: the disk has no room ({e}); free some, then run the command again", file=sys.stderr)
        sys.exit(1)
    finally:
        distributed.close()
    sys.exit(exit_code(summary))
