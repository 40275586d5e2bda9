"""Train a policy with GRPO or PPO on report 001's workflow-DSL task or report 000's tool task.

    python train.py --k 8 --norm global            # GRPO learns: held-out best rate ~0.14 -> ~0.99
    python train.py --k 2 --batch 3 --norm group   # report 001's setting, for contrast
    python train.py --algo ppo                     # PPO: a value head, GAE, the same task
    python train.py --task tools --reward sparse   # report 000: a multi-turn tool agent
    python train.py --task tools --reward sparse --difficulty 3 --curriculum   # report 000: short -> long tasks
    python train.py --algo rce --reward composite --save-every 20 --out runs/rce   # report 003's RCE ...
    python train.py --init-from runs/rce --reward composite                        # ... then GRPO from it
    python train.py --model smollm2-135m --k 4 --batch 4 --lr 2e-5 --steps 20   # a real LLM (README, Lesson 5)
    python train.py --help                         # every flag, with its meaning

One step (`rl_step`), file by file: the task (workflow_task.py / tool_task.py, the interface
in tasks.py) samples K completions or K tool-calling episodes per prompt (rollout.py, which
records their log-probs with logprobs.py) and scores them (rewards.py); grpo.prepare turns
the rewards into one advantage per sequence (advantages.py), or ppo.prepare into one per
token (a critic and GAE); grpo.update / ppo.update write the clipped-surrogate loss out in
their loop; report.py turns the step into one line of metrics.jsonl. Around the steps, the
loop (`train`) moves the learning rate and entropy bonus (schedules.py) and beta (kl.py),
evaluates on held-out prompts (evaluate.py), watches for trouble (monitor.py) and saves
checkpoints (checkpoint.py).

The run's folder (--out) holds config.json, metrics.jsonl (every metric: report.py),
samples.jsonl, summary.json, curves.png and, with --save-every, checkpoints/ (`--resume RUN`
continues from the newest).

    torchrun --standalone --nproc_per_node 2 train.py --k 8 --norm global   # the same run on 2 processes

Under torchrun each rank runs this file on its share of every step's prompts; the lines that
differ call distributed.py, whose helpers do nothing in one process (its docstring has the maths).
"""
import contextlib
import copy
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import transformers
from safetensors import SafetensorError

import update

from running import checkpoint
from running import config
from running import distributed
import dynamic_sampling
from running import evaluate
import grpo
import kl
import logprobs
from running import monitor
from models import policy
import ppo
from models import pretrained
import rce
from running import report
import rollout
from running import schedules
import tasks
from running.config import Config, default_out, fail, parse_config

TASKS = tasks.TASKS


# ---- the policy ----

def load(cfg: Config, task, device: str, log):
    """The policy and its tokenizer on device, dropout off: a real model (--model: a named
    model, a folder, a hub id; pretrained.py) or the tiny model built in code, each
    warm-started on the task's mix (policy.py) unless --sft-steps 0; then, with --init-from,
    another run's weights (checkpoint.starting_point)."""
    default = policy.WARM_START["real" if cfg.model else "tiny"]
    warm = policy.WarmStart(default.steps if cfg.sft_steps == -1 else cfg.sft_steps, cfg.sft_lr or default.lr,
                            default.batch, cfg.sft_seed, cfg.sft_difficulty)
    if cfg.model:
        folder = pretrained.resolve(cfg.model, Path(cfg.model_cache or pretrained.default_cache()), log)
        # fp32 weights even on a GPU (bf16 is autocast): AdamW steps of lr 1e-6 on bf16
        # weights would mostly round away.
        model, tok = policy.real_policy(task, folder, warm, Path(cfg.cache_dir), device, log)
    else:
        model, tok = policy.tiny_policy(task, cfg.hidden, cfg.layers, warm, Path(cfg.cache_dir), log)
    if cfg.init_from:              # a second stage: another run's weights replace the warm start
        ckpt = checkpoint.starting_point(Path(cfg.init_from))
        checkpoint.load_weights(ckpt, model)
        log(f"--init-from: the policy starts from {ckpt}")
    off = policy.disable_dropout(model)            # RL's ratios and KLs need a deterministic forward
    if off:
        log(f"dropout: switched off in {off} places for RL")
    return model.to(device), tok


# ---- one step ----

# Each algorithm: how rewards become advantages, and the loss update.py's loop differentiates.
ALGOS = {"grpo": (grpo.prepare, grpo.loss), "ppo": (ppo.prepare, ppo.loss), "rce": (rce.prepare, rce.loss)}

@dataclass
class Learner:
    """What one RL step works on."""
    task: tasks.Task
    models: rollout.Models           # the policy, its tokenizer, the reference, the value head
    optimizer: torch.optim.Optimizer
    sampling: tasks.Sampling
    autocast: Callable               # bf16 autocast on a GPU; nothing on a CPU
    scorer: torch.nn.Module          # what the update differentiates: logprobs.Scorer(policy, value
                                     # head), in DDP under torchrun (distributed.replicate)
    dynamic_rounds: int = 0          # --dynamic-sampling: sampling rounds at most per step; 0 = off


def sample_rollouts(learner: Learner, prompts: list, hp: grpo.HyperParams, draw: Callable):
    """The step's rollouts, rewarded: B prompts x K samples, or with --dynamic-sampling rounds
    of B fresh prompts (draw()) until B groups' rewards differ (dynamic_sampling.py).
    Returns (batch, outcomes, their prompts, the sampling's metrics); batch None when the
    policy's logits were non-finite."""
    def one_round(prompts):
        with learner.autocast():
            return learner.task.sample(learner.models, prompts, hp.k, learner.sampling,
                                       record_old_logp=not hp.reuse_old_logp)           # rewards (N,)
    try:
        if learner.dynamic_rounds:    # DAPO: keep only groups whose rewards differ
            return dynamic_sampling.sample(one_round, draw, prompts, hp.k, learner.dynamic_rounds)
        return (*one_round(prompts), prompts, {})
    except rollout.NonFiniteLogits:
        return None, None, prompts, {}


def rl_step(learner: Learner, prompts: list, hp: grpo.HyperParams, draw: Callable):
    """One step on B prompts: rollout -> reward -> advantage -> update (GRPO or PPO).

    draw() gives B fresh prompts (--dynamic-sampling's further rounds). Returns the batch
    (rollout.Rollout), the rollouts' outcomes (the task's: classes or episodes), their
    prompts, the step's rollout metrics (report.rollout_metrics) and the update's statistics
    (report.no_update's when no update was taken)."""
    batch, outcomes, prompts, extra = sample_rollouts(learner, prompts, hp, draw)
    # Under torchrun every decision that skips work is taken by all ranks together
    # (distributed.any_rank), or one rank would wait forever in a collective the others skip.
    if distributed.any_rank(batch is None):
        raise rollout.NonFiniteLogits("non-finite logits while sampling (on this rank or another)")
    finite = not distributed.any_rank(not torch.isfinite(batch.rewards).all())
    prepare, loss = ALGOS[hp.algo]
    if finite:
        prepare(batch, hp)                    # advantages: (N,) GRPO, (N, C) PPO; RCE's weights
    else:
        # A reward function returned NaN/inf: no update this step, and the bad values are
        # never averaged into any metric.
        batch.advantages = torch.zeros(len(batch.rewards), device=batch.completion_mask.device)
    row = dict(report.rollout_metrics(batch, outcomes, learner.task, hp), **extra)
    stats = report.no_update() if finite else report.no_update("reward")

    # GRPO without KL or entropy terms has nothing to learn from all-zero advantages (and
    # AdamW's momentum would still move the weights); PPO always has its value loss.
    no_signal = hp.algo == "grpo" and not distributed.any_rank((batch.advantages != 0).any()) \
        and hp.beta == 0 and hp.entropy_coef == 0
    all_fallback = hp.skip_all_fallback and row.get("fallback_rate") == 1.0     # the whole batch's
    if finite and not no_signal and not all_fallback:
        with learner.autocast():
            stats = update.update(learner.scorer, learner.optimizer, batch, hp, loss)
    if batch.ref_logp is not None and batch.old_logp is None:
        # --fast: the update's forward was the sampling policy's; its KL is the same number.
        row["kl"] = stats.get("ref_kl")
    return batch, outcomes, prompts, row, stats


# ---- the run's memory ----

@dataclass
class RunState:
    """What the loop remembers from step to step, and a checkpoint keeps besides the weights,
    the optimizer and the RNGs."""
    step: int = 0                    # the last step done
    updates: int = 0                 # steps that took an optimizer step
    collapses: int = 0               # collapsed_after_update steps
    crash_floor: float = 0.0         # sum over updates of P(collapse flag | frozen policy)
    skipped: int = 0                 # non-finite optimizer steps skipped
    prev_updated: bool = False       # the previous step updated ...
    prev_on_format: float | None = None   # ... from this on-format rate
    first_eval: dict | None = None   # eval_* at step 0
    last_eval: dict | None = None    # eval_* at the newest evaluation
    failed_saves: int = 0            # checkpoints a full disk refused
    lost_log_lines: int = 0          # log lines a full disk refused
    seconds: float = 0.0             # wall time before this session (a resume's earlier ones)
    stopped: str | None = None       # why the run stopped early
    interrupted: str | None = None   # the signal that stopped it
    early_stopped: str | None = None  # why --early-stop-patience ended it (a normal end)
    best_step: int = 0               # the evaluation with the highest held-out reward so far ...
    best_reward: float | None = None
    best_eval: dict | None = None    # ... its eval_*
    best_checkpoint: str | None = None   # its checkpoint, relative to the run (--early-stop-patience)
    evals_since_best: int = 0
    monitor: dict | None = None      # the state dicts of the monitor, the KL controller and
    kl_control: dict | None = None   # the value head, at the last save
    value_head: dict | None = None

    @classmethod
    def from_checkpoint(cls, saved: dict) -> "RunState":
        saved = dict(saved)
        if saved.get("prev"):        # checkpoints written before RunState: prev = (updated, rate)
            saved["prev_updated"], saved["prev_on_format"] = saved["prev"]
        names = {f.name for f in dataclasses.fields(cls)} - {"stopped", "interrupted", "early_stopped"}
        return cls(**{k: v for k, v in saved.items() if k in names})

    def count(self, step: int, stats: dict, on_format: float | None, n: int) -> bool:
        """Count one step; return collapsed_after_update: the previous step updated, its
        on-format rate was > 0, and this step's is at most half of it (report 001)."""
        updated = stats["steps_taken"] > 0
        prev_rate = self.prev_on_format if self.prev_updated else None
        collapsed = bool(prev_rate and on_format is not None and on_format <= prev_rate / 2)
        if prev_rate is not None and on_format is not None:
            # the null: how likely that flag was from sampling noise alone (monitor.py)
            self.crash_floor += monitor.false_collapse_given(prev_rate, n)
        self.step, self.prev_updated, self.prev_on_format = step, updated, on_format
        self.updates += updated
        self.collapses += collapsed
        self.skipped += stats["skipped_nonfinite"]
        return collapsed


# ---- the run: set up, one step's bookkeeping, save ----

@dataclass
class Run:
    """Everything the loop carries."""
    cfg: Config
    out: Path
    learner: Learner
    hp: grpo.HyperParams             # this run's; each step replaces beta, entropy_coef, seed
    kl_control: kl.KLController
    stability: monitor.StabilityMonitor
    state: RunState
    rng: random.Random               # the prompts' draws
    prompts: dict                    # "train" and "eval"
    metrics: checkpoint.JsonlLog
    samples: checkpoint.JsonlLog
    log: Callable
    started: float                   # time.time() at the start of this session


def param_groups(cfg: Config, model, critic) -> list:
    """The optimizer's parameter groups: the policy's; PPO's critic (a value head, or with
    --critic separate a network) in a group of its own at --critic-lr, clipped on its own
    (grpo.optimizer_step). A shared value head at --lr stays in the policy's group, one clip
    over both, as before --critic-lr existed."""
    if critic is None or (cfg.critic == "shared" and cfg.critic_lr in (0, cfg.lr)):
        return [{"params": list(model.parameters()) + (list(critic.parameters()) if critic else [])}]
    scale = (cfg.critic_lr or cfg.lr) / cfg.lr
    return [{"params": list(model.parameters())},
            {"params": list(critic.parameters()), "lr": cfg.lr * scale, "lr_scale": scale}]


def start(cfg: Config, out: Path) -> Run:
    """Load the policy, build the optimizer and controllers, resume if asked, open the logs
    and evaluate at step 0."""
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    main = distributed.is_main()                     # rank 0 (always, in one process) writes and prints
    log = (lambda *a: None) if cfg.quiet or not main else (lambda s: print(s, file=sys.stderr))
    started = time.time()
    if distributed.launched():
        distributed.init(device)                     # torchrun: join the other ranks
        out = Path(distributed.gather(str(out))[0])  # rank 0's folder (messages name it)
        log(f"torchrun: {distributed.size()} ranks ({'nccl' if device == 'cuda' else 'gloo'}), "
            f"{cfg.batch // distributed.size()} of the {cfg.batch} prompts of a step each")
    if cfg.overwrite and not cfg.resume and main:
        checkpoint.clear_run(out, config.RUN_FILES)
        log(f"--overwrite: removed the earlier run's files from {out}")
    task = TASKS[cfg.task]
    with distributed.main_first():                   # rank 0 fills the model and warm-start caches
        model, tok = load(cfg, task, device, log)
    value_head = None if cfg.algo != "ppo" else ppo.Critic(model) if cfg.critic == "separate" else \
        ppo.ValueHead(model.config.hidden_size).to(device)                # PPO's critic (ppo.py)
    scorer = distributed.replicate(logprobs.Scorer(model, value_head))   # DDP: rank 0's weights now
    # The reference is the policy RL starts from, also when resuming: load() always returns it
    # (the warm start; with --init-from, the first stage's weights: the KL then anchors GRPO
    # to the policy it was handed, as TRL and verl take the initial policy as the reference).
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.beta > 0 else None
    optimizer = torch.optim.AdamW(param_groups(cfg, model, value_head), lr=cfg.lr, weight_decay=0.0)
    # bf16 autocast where it is faster (policy.autocast_choice); the lesson code is the same.
    bf16 = policy.autocast_choice(cfg.bf16, device, real_model=bool(cfg.model))
    log(f"bf16 autocast: {'on' if bf16 else 'off'} ({device}, --bf16 {cfg.bf16})")
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    learner = Learner(task, rollout.Models(model, tok, ref, value_head), optimizer, config.sampling(cfg),
                      autocast, scorer, dynamic_rounds=cfg.max_sampling_rounds if cfg.dynamic_sampling else 0)
    kl_control = kl.KLController(cfg.beta, kl.KLRule(cfg.kl_control, cfg.kl_target, cfg.kl_target_min,
                                                     cfg.kl_target_max, cfg.kl_horizon, cfg.n))
    stability = monitor.StabilityMonitor(cfg.alert_entropy, cfg.alert_kl, cfg.alert_reward_range,
                                         cfg.alert_window)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    state = RunState()
    if cfg.resume:                                   # every rank loads rank 0's checkpoint
        saved, used = checkpoint.restore_newest(Path(cfg.resume), model, optimizer, rng, log)
        state = RunState.from_checkpoint(saved)
        stability.load_state_dict(state.monitor)
        kl_control.load_state_dict(state.kl_control)
        if value_head is not None:
            value_head.load_state_dict(state.value_head)
        for name in ("metrics.jsonl", "samples.jsonl"):
            torn = checkpoint.truncate_log(out / name, state.step) if main else 0
            if torn:
                log(f"resume: dropped {torn} torn line(s) of {name} (a write cut short)")
        log(f"resumed from {used} at step {state.step}")
    ran_on = f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else f"cpu ({torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)})"
    if distributed.launched():
        ran_on += f" x {distributed.size()} ranks (torchrun)"
    if main:
        (out / "config.json").write_text(json.dumps(dict(dataclasses.asdict(cfg), ran_on=ran_on), indent=2))
    logs = [checkpoint.JsonlLog(out / name, append=bool(cfg.resume)) if main else checkpoint.NoLog()
            for name in ("metrics.jsonl", "samples.jsonl")]
    run = Run(cfg, out, learner, config.hyper_params(cfg), kl_control, stability, state, rng,
              prompts_of(task, cfg), *logs, log, started)
    if state.first_eval is None and main:            # held-out evaluation: rank 0's alone
        held_out(run, row := {"step": 0})                    # before any update: evaluation only
        state.first_eval = state.last_eval
        run.metrics.write(row)
        if keep_best(run, row) and cfg.early_stop_patience:
            save_best(run)                           # the warm start is the first best
        log("step 0: held-out " + ", ".join(f"{key} {state.first_eval['eval_' + key]:.2f}"
                                            for key in task.HEADLINE))
    return run


def prompts_of(task, cfg: Config) -> dict:
    """The task's prompts: "train", a list per difficulty the run trains at (--curriculum: 1
    up to --difficulty); "eval", held out, at --difficulty (--eval-prompts of them, spread over
    the list); "nll": as many training prompts (32 by default) at --difficulty spread over
    theirs, on which the answer NLL is measured beside the held-out one."""
    levels = range(1, cfg.difficulty + 1) if cfg.curriculum else [cfg.difficulty]
    train = {d: task.prompts("train", d) for d in levels}
    held_out, n = task.prompts("eval", cfg.difficulty), cfg.eval_prompts

    def spread(xs: list, k: int) -> list:              # every (len/k)-th: each part of the list
        return xs[::max(1, len(xs) // k)][:k]
    return {"train": train, "eval": spread(held_out, n or len(held_out)), "nll": spread(train[cfg.difficulty], n or 32)}


def step_hyper_params(run: Run, step: int) -> grpo.HyperParams:
    """This step's learning rate (set in the optimizer), and its hyper-parameters: beta from
    the KL controller, the scheduled entropy bonus and RCE temperature, the mini-batch
    shuffle's seed."""
    cfg = run.cfg
    lr = schedules.lr_at(step, cfg.steps, cfg.lr, cfg.lr_schedule, cfg.min_lr, cfg.warmup_steps)
    for group in run.learner.optimizer.param_groups:        # the critic's at --critic-lr / --lr of it
        group["lr"] = lr * group.get("lr_scale", 1.0)
    end = cfg.entropy_coef if cfg.entropy_coef_end < 0 else cfg.entropy_coef_end
    tau = {"rce_temp": schedules.linear(step, cfg.steps, cfg.rce_temp_start, cfg.rce_temp_end)} if cfg.algo == "rce" else {}
    return dataclasses.replace(run.hp, beta=run.kl_control.beta, seed=cfg.seed * 100003 + step,
                               entropy_coef=schedules.linear(step, cfg.steps, cfg.entropy_coef, end), **tau)


def held_out(run: Run, row: dict) -> None:
    """Evaluate on the held-out prompts into row and state.last_eval; its samples to samples.jsonl."""
    cfg, learner = run.cfg, run.learner
    try:
        with learner.autocast():
            run.state.last_eval, rows = evaluate.evaluate(learner.models, learner.task, run.prompts["eval"],
                                                          learner.sampling, cfg.eval_samples, cfg.gamma)
    except rollout.NonFiniteLogits:
        if row["step"] == 0:
            raise                      # the starting policy itself is broken: nothing to train
        run.log(f"step {row['step']}: non-finite logits in the held-out evaluation; it is skipped")
        return
    # the held-out loss beside the held-out reward (report 003: train loss falls, val loss rises)
    run.state.last_eval["eval_answer_nll"] = evaluate.answer_nll(learner.models, learner.task, run.prompts["eval"])
    run.state.last_eval["train_answer_nll"] = evaluate.answer_nll(learner.models, learner.task, run.prompts["nll"])
    row.update(run.state.last_eval)
    run.samples.write({"step": row["step"], "split": "eval", "samples": rows})


def keep_best(run: Run, row: dict) -> bool:
    """After a held-out evaluation (rank 0): remember the one with the highest held-out reward
    (strictly higher than every earlier one, the warm start's at step 0 included); True when
    this one is it. Else count one more evaluation without progress (--early-stop-patience)."""
    state = run.state
    reward = row.get("eval_reward_mean")
    if reward is None:                     # a skipped evaluation (non-finite) counts for nothing
        return False
    if state.best_reward is not None and reward <= state.best_reward:
        state.evals_since_best += 1
        return False
    state.best_step, state.best_reward, state.evals_since_best = row["step"], reward, 0
    state.best_eval = dict(state.last_eval)
    return True


def save_best(run: Run) -> None:
    """--early-stop-patience: a checkpoint of the new best evaluation, named in the summary
    (best_checkpoint) and spared by --keep-checkpoints."""
    before, run.state.best_checkpoint = run.state.best_checkpoint, f"checkpoints/step-{run.state.step:06d}"
    if save(run) is None:                  # not written (said by save): the older best stays
        run.state.best_checkpoint = before


def account(run: Run, row: dict, stats: dict, signal: str | None) -> str | None:
    """After a step: move beta, count the step (updates, collapses, skips) into the row and
    the run's state, raise the monitor's alerts; return why the run must stop, or None."""
    cfg, state, step = run.cfg, run.state, row["step"]
    if row["kl"] is not None:
        run.kl_control.update(row["kl"])                  # beta for the next step
    collapsed = state.count(step, stats, row[run.learner.task.FORMAT_KEY], cfg.n)
    row.update(stats, updated=stats["steps_taken"] > 0, collapsed_after_update=collapsed)
    if stats["nonfinite"] == ["logits"]:
        run.log(f"step {step}: non-finite logits: nothing could be sampled, step skipped "
                f"({state.skipped} so far, --max-skips {cfg.max_skips})")
    elif stats["nonfinite"]:
        run.log(f"step {step}: non-finite {' and '.join(stats['nonfinite'])}: optimizer step "
                f"skipped, weights untouched ({state.skipped} so far, --max-skips {cfg.max_skips})")
    row["alerts"], started, messages = run.stability.update(row["reward_mean"], row.get("entropy"), row["kl"])
    for name, message in zip(started, messages):
        run.log(f"step {step}: monitor alert {name}: {message}")
    if state.skipped > cfg.max_skips:
        return f"{state.skipped} non-finite steps, more than --max-skips {cfg.max_skips}"
    if cfg.stop_on_alert and started:
        return f"monitor alert {', '.join(started)} (--stop-on-alert)"
    if signal:
        return f"interrupted by {signal}"
    return None


def save(run: Run) -> Path | None:
    """A checkpoint now, and the oldest ones pruned (--keep-checkpoints); None (said, counted
    in the summary) when it cannot be written: a full disk ends that save, not the run."""
    state, models = run.state, run.learner.models
    snapshot = dataclasses.replace(state, monitor=run.stability.state_dict(), kl_control=run.kl_control.state_dict(),
                                   value_head=models.value_head.state_dict() if models.value_head is not None else None,
                                   seconds=state.seconds + time.time() - run.started)
    path = None
    if not logprobs.forward_is_finite(models.model):
        # blown-up weights would become the newest checkpoint, the one --resume picks
        run.log(f"step {state.step}: checkpoint not written: these weights give non-finite logits "
                f"(newest good checkpoint: {checkpoint.find(run.out) or 'none'})")
    else:
        try:
            path = checkpoint.save(run.out, state.step, models.model, models.tok, run.learner.optimizer,
                                   dataclasses.asdict(snapshot), run.rng)
        except (OSError, SafetensorError) as e:
            state.failed_saves += 1
            run.log(f"step {state.step}: checkpoint not written ({type(e).__name__}: {e}); the run goes on")
    spare = run.out / state.best_checkpoint if state.best_checkpoint else None    # early stopping's best
    for old in checkpoint.prune(run.out, run.cfg.keep_checkpoints, spare):
        run.log(f"removed checkpoint {old.name} (--keep-checkpoints {run.cfg.keep_checkpoints})")
    return path


# ---- the loop ----

def train(cfg: Config) -> dict:
    """Run GRPO or PPO as configured (or resume it) in its locked folder; write the run's
    files; return its summary (report.finish)."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = Path(cfg.out or default_out(cfg))
    main = distributed.is_main()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    # one run per folder, for as long as this one runs (under torchrun, rank 0 holds the lock)
    with checkpoint.RunLock(out) if main else contextlib.nullcontext():
        run = start(cfg, out)
        state, task = run.state, run.learner.task
        with checkpoint.Interrupts(run.log) as interrupts:
            for step in range(state.step + 1, cfg.steps + 1):
                try:
                    if one_step(run, step, interrupts):
                        break
                except RuntimeError as e:                # torchrun: another rank died or hung
                    if not distributed.lost_contact(e):
                        raise
                    run.metrics.close()
                    run.samples.close()
                    raise RankLost(lost_rank_message(run, e)) from e
        state.interrupted = interrupts.signal
        run.metrics.close()
        run.samples.close()
        if not main:                                     # rank 0 writes the summary
            return dict(stopped=state.stopped, interrupted=state.interrupted)
        state.lost_log_lines = run.metrics.lost + run.samples.lost     # lines a full disk refused
        state.seconds += time.time() - run.started       # the whole run's, over every resume
        return report.finish(task, out, state, run.stability.episodes, run.log)


def draw_prompts(run: Run, difficulty: int) -> list:
    """A step's B training prompts of a difficulty (this rank's share of them under torchrun)."""
    train, b = run.prompts["train"][difficulty], run.cfg.batch
    prompts = run.rng.sample(train, b) if b <= len(train) else run.rng.choices(train, k=b)
    return distributed.shard(prompts)                # torchrun: this rank's B/W of them, groups whole


def one_step(run: Run, step: int, interrupts: checkpoint.Interrupts) -> bool:
    """Step `step`: its prompts (this rank's share of them), rl_step, the bookkeeping, the
    held-out evaluation when due, the logs, a checkpoint when due. True: the run stops here."""
    cfg, state, task = run.cfg, run.state, run.learner.task
    t0 = time.time()
    hp = step_hyper_params(run, step)
    # the task's difficulty: --difficulty, or with --curriculum this step's phase of it
    level = schedules.difficulty_at(step, cfg.steps, cfg.difficulty, cfg.curriculum)
    prompts = draw_prompts(run, level)
    if distributed.launched():
        torch.manual_seed(distributed.sampling_seed(cfg.seed, step))   # its own draws, each step
    try:
        batch, outcomes, prompts, row, stats = rl_step(run.learner, prompts, hp, lambda: draw_prompts(run, level))
    except rollout.NonFiniteLogits:       # nothing could be sampled: a non-finite step
        batch, row, stats = None, report.no_rollout(task), report.no_update("logits")
    row = {"step": step, **row, "lr": run.learner.optimizer.param_groups[0]["lr"],
           "entropy_coef": hp.entropy_coef, **({"rce_temp": hp.rce_temp} if hp.algo == "rce" else {}),
           **({"difficulty": level} if task.MAX_DIFFICULTY > 1 else {})}
    # a signal reaches one rank at a time: every rank stops at the step any of them got one
    # (the step's last collective; account's other inputs are the same on every rank)
    state.stopped = account(run, row, stats, distributed.first_reason(interrupts.signal))
    main = distributed.is_main()
    # a stopped run is evaluated where it stops, so its eval_*_end are its own
    due = (step % cfg.eval_every == 0 or step == cfg.steps or state.stopped) and batch is not None
    best = False
    if due and main:
        held_out(run, row)
        best = keep_best(run, row)
    patience = cfg.early_stop_patience
    early = due and bool(patience) and main and state.evals_since_best >= patience
    if due and patience:                   # rank 0 evaluated: every rank stops with it
        early = distributed.any_rank(early)
    if early and not state.stopped:
        state.early_stopped = (f"the held-out reward has not risen for {cfg.early_stop_patience} evaluations "
                               f"(--early-stop-patience); best {state.best_reward:.3f} at step {state.best_step}, "
                               f"kept in {run.out / (state.best_checkpoint or '?')}")
        run.log(f"early stop at step {step}: {state.early_stopped}")
    row["seconds"] = time.time() - t0
    run.metrics.write(row)
    if batch is not None:
        run.samples.write({"step": step, "split": "train", "samples": report.train_samples(
            batch, outcomes, prompts, task, cfg.log_samples)})
    if main:
        report.progress(cfg, task, row, state.last_eval)
    path = None
    if best and patience:                  # main only: early stopping keeps the best's weights
        save_best(run)
    if (state.stopped or (cfg.save_every and step % cfg.save_every == 0)) and main:
        path = save(run)
    if state.stopped:
        saved = f"weights saved in {path} (resume with --resume {run.out})" if path else "no checkpoint written"
        run.log(f"stopped at step {step}: {state.stopped}; {saved}")
    return bool(state.stopped or state.early_stopped)


class RankLost(RuntimeError):
    """Under torchrun, a collective failed: another rank died (killed, crashed) or hung."""


def lost_rank_message(run: Run, error: RuntimeError) -> str:
    """One line: which rank saw what, where the log ends, and how to go on."""
    newest = checkpoint.find(run.out)
    how = (f"continue from {newest.name} with: torchrun --nproc_per_node {distributed.size()} train.py "
           f"--resume {run.out}" if newest else "no checkpoint was written (--save-every 0): it cannot be resumed")
    # gloo's "[.../pair.cc:537] Read error [host]:port: Connection reset by peer. This is ..."
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    first = first.split("] ", 1)[-1].split(". ")[0][:160]
    return (f"rank {distributed.rank()} of {distributed.size()} lost contact with another rank during step "
            f"{run.state.step + 1} ({first}); the job ends. metrics.jsonl holds every step up to "
            f"{run.state.step}; {how}")


if __name__ == "__main__":
    cfg = parse_config()
    try:
        summary = train(cfg)
    except (pretrained.ModelError, checkpoint.ResumeError, checkpoint.RunBusy) as e:  # before training
        fail(str(e))
    except RankLost as e:
        print(f"train.py: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        distributed.close()
    # 128 + the signal's number (130 Ctrl-C, 143 SIGTERM), as a shell reports a killed job
    sys.exit(128 + checkpoint.SIGNALS[summary["interrupted"]] if summary["interrupted"]
             else 1 if summary["stopped"] else 0)
