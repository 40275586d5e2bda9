"""Setting a run up and closing it: the policy loaded, the reference and the optimizer built
(train.py's reference_and_optimizer, called here), the controllers built, a resume restored,
the logs opened, the folder locked, signals caught, and the summary written.

    with session.open(cfg, build) as run:   # train.py: everything a run needs, in run
        ...                                 # the loop
    run.summary                             # summary.json's contents, after the block

Under torchrun every rank opens the same run (rank 0 alone writes its files); a collective
that fails because another rank died ends the run with one line (RankLost).
"""
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import transformers

import dynamic_sampling
import entropy_control
import grpo
import kl
import logprobs
import monitor
import mismatch
import ppo
import rollout
import shared_prefix
import tasks
from models import policy, pretrained
from running import checkpoint, config, distributed, report
from running import checks
from running.bookkeeping import RunState, held_out, keep_best, reserve_bytes, save_best
from running.config import Config, default_out


# ---- what a run carries ----

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
    dynamic: dynamic_sampling.Budget | None = None   # --dynamic-sampling's budget per step; None = off
    rollout_policy: mismatch.RolloutPolicy | None = None   # a sampler that is not the policy; None = off


@dataclass
class Run:
    """Everything the loop carries."""
    cfg: Config
    out: Path
    learner: Learner
    hp: grpo.HyperParams             # this run's; each step replaces beta, entropy_coef, seed
    kl_control: kl.KLController
    entropy_control: entropy_control.AdaptiveEntropy | None    # --entropy-target; None: the schedule
    stability: monitor.StabilityMonitor
    collapse: monitor.CollapseCount  # report 001's count and its null
    controllers: dict                # name -> each of the above a checkpoint keeps (state_dict)
    state: RunState
    rng: random.Random               # the prompts' draws
    prompts: dict                    # "train" and "eval"
    metrics: checkpoint.JsonlLog
    samples: checkpoint.JsonlLog
    log: Callable
    started: float                   # time.time() at the start of this session
    warn: Callable = print           # a failure's line: printed on rank 0 even with --quiet
    interrupts: checkpoint.Interrupts | None = None   # the signals caught (open)
    step_started: float = 0.0        # time.time() at the start of the current step (train.py)
    summary: dict | None = None      # summary.json's contents, once the run is closed
    said: set = dataclasses.field(default_factory=set)   # what the log said once already


# ---- open and close ----

@contextlib.contextmanager
def threads_kept():
    """torch's thread count as it was, after the block (start sets --threads)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def open(cfg: Config, build: Callable):
    """The run of cfg, set up (or resumed) in its locked folder, signals caught; on leaving
    the block its logs are closed and rank 0 writes the summary (run.summary). build(cfg,
    policy, critic) -> (reference, optimizer): train.py's reference_and_optimizer."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out = Path(cfg.out or default_out(cfg))
    main = distributed.is_main()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    # one run per folder, for as long as this one runs (under torchrun, rank 0 holds the lock);
    # torch's thread count (start: --threads) is given back after, for whoever called train()
    with checkpoint.run_lock(out) if main else contextlib.nullcontext(), threads_kept():
        run = start(cfg, out, build)
        # the handlers stay through the writing after the loop: a signal in the run's last second
        # is noted and the summary and curves.png are finished (it once killed the process between them)
        with checkpoint.Interrupts(run.log) as run.interrupts:
            if run.learner.dynamic:           # a signal ends dynamic sampling's rounds within one round
                run.learner.dynamic.stop = lambda: run.interrupts.signal is not None
            try:
                yield run
            except RuntimeError as e:                # torchrun: another rank died or hung
                if not distributed.lost_contact(e):
                    raise
                run.metrics.close()
                run.samples.close()
                raise RankLost(lost_rank_message(run, e)) from e
            close_run(run, out, main)


def close_run(run: Run, out: Path, main: bool) -> None:
    """After the loop: close the logs; rank 0 writes the summary (run.summary) and curves.png.
    state.interrupted is the signal that stopped the loop, or None: one arriving now finds
    every step done, and is obeyed by finishing these files."""
    state = run.state
    state.interrupted = run.state.stopped and run.interrupts.signal or None
    run.metrics.close()
    run.samples.close()
    if not main:                                     # rank 0 writes the summary
        run.summary = dict(stopped=state.stopped, interrupted=state.interrupted)
        return
    checkpoint.release(out)                          # the room held for the end: the summary's now
    state.lost_log_lines = run.metrics.lost + run.samples.lost     # lines a full disk refused
    state.seconds += time.time() - run.started       # the whole run's, over every resume
    run.summary = report.finish(run.learner.task, out, state, (run.stability, run.collapse), run.log)
    if state.failed_saves and checkpoint.find(out) is None:       # --quiet hides progress, never this
        run.summary["unsaved"] = True
        run.warn(f"error: none of this run's {state.failed_saves} checkpoint(s) could be written "
                 f"(see the lines above); it cannot be resumed")


# ---- setting up ----

def init_from_checkpoint(cfg: Config, out: Path) -> dict | None:
    """The checkpoint --init-from starts from, pinned: {"path", "sha256"} of its weights. A new
    run takes the parent's best or newest (checkpoint.starting_point) and records it in its
    config.json; a resumed run keeps to the one recorded, and refuses in one line
    (ResumeError) if it changed or is gone: the parent's newer checkpoint would otherwise
    silently become the reference model of the rest of the run."""
    if not cfg.init_from:
        return None
    try:
        pinned = json.loads((out / "config.json").read_text()).get("init_from_checkpoint") if cfg.resume else None
    except (OSError, ValueError):
        pinned = None
    if pinned is None:                     # a new run (or one recorded before pins existed)
        ckpt = checkpoint.starting_point(Path(cfg.init_from))
        return {"path": str(ckpt), "sha256": checkpoint.weights_sha256(ckpt)}
    path = Path(pinned["path"])
    if not path.is_dir() or checkpoint.weights_sha256(path) != pinned["sha256"]:
        raise checkpoint.ResumeError(f"--resume: this run started --init-from {str(path)!r}, which "
                                     f"{'has changed since' if path.is_dir() else 'is gone'}; its reference "
                                     f"model cannot be restored (restore that checkpoint, or start a new run)")
    return pinned


def load(cfg: Config, task, device: str, log, init: dict | None = None):
    """The policy and its tokenizer on device, dropout off: a real model (--model: a named
    model, a folder, a hub id; models/pretrained.py) or the tiny model built in code, each
    warm-started on the task's mix (models/policy.py) unless --sft-steps 0; then, with --init-from,
    another run's weights (init: the pinned checkpoint, init_from_checkpoint)."""
    default = policy.WARM_START["real" if cfg.model else "tiny"]
    warm = policy.WarmStart(default.steps if cfg.sft_steps == -1 else cfg.sft_steps, default.lr,
                            default.batch, 0, cfg.sft_difficulty, default.micro_batch)
    if cfg.model:
        folder = pretrained.resolve(cfg.model, pretrained.default_cache(), log)
        # fp32 weights even on a GPU (bf16 is autocast): AdamW steps of lr 1e-6 on bf16
        # weights would mostly round away.
        model, tok = policy.real_policy(task, folder, warm, Path(cfg.cache_dir), device, log)
    else:
        model, tok = policy.tiny_policy(task, cfg.hidden, cfg.layers, warm, Path(cfg.cache_dir), log)
    if init:                       # a second stage: another run's weights replace the warm start
        ckpt = Path(init["path"])
        checkpoint.load_weights(ckpt, model)
        log(f"--init-from: the policy starts from {ckpt}")
    off = policy.disable_dropout(model)            # RL's ratios and KLs need a deterministic forward
    if off:
        log(f"dropout: switched off in {off} places for RL")
    return model.to(device), tok


def start(cfg: Config, out: Path, build: Callable) -> Run:
    """Load the policy, build the reference and the optimizer (build: train.py's
    reference_and_optimizer) and the controllers, resume if asked, open the logs and evaluate
    at step 0."""
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    if cfg.threads or not cfg.model:                 # the tiny model: 1 thread (--threads, docs/performance.md)
        torch.set_num_threads(cfg.threads or 1)
    main = distributed.is_main()                     # rank 0 (always, in one process) writes and prints
    log = (lambda *a: None) if cfg.quiet or not main else report.say
    started = time.time()
    if distributed.launched():
        distributed.init(device, cfg.collective_timeout)   # torchrun: join the other ranks
        out = Path(distributed.gather(str(out))[0])  # rank 0's folder (messages name it)
        log(f"torchrun: {distributed.size()} ranks ({torch.distributed.get_backend()} on {device}), "
            f"{cfg.batch // distributed.size()} of the {cfg.batch} prompts of a step each")
    if cfg.overwrite and not cfg.resume and main:
        checkpoint.clear_run(out, checks.RUN_FILES)
        log(f"--overwrite: removed the earlier run's files from {out}")
    task = tasks.TASKS[cfg.task]
    with distributed.main_first():                   # rank 0 fills the model and warm-start caches
        init = init_from_checkpoint(cfg, out)
        model, tok = load(cfg, task, device, log, init)
    value_head = None if cfg.algo != "ppo" else ppo.Critic(model) if cfg.critic == "separate" else \
        ppo.ValueHead(model.config.hidden_size).to(device)                # PPO's critic (ppo.py)
    ref, optimizer = build(cfg, model, value_head)   # load() returns the policy RL starts from, also on resume
    scorer = distributed.replicate(logprobs.Scorer(model, value_head))   # DDP: rank 0's weights now
    # bf16 autocast where it is faster (policy.autocast_choice); the lesson code is the same.
    bf16 = policy.autocast_choice(cfg.bf16, device, real_model=bool(cfg.model))
    log(f"bf16 autocast: {'on' if bf16 else 'off'} ({device}, --bf16 {cfg.bf16})")
    if cfg.ratio_level == "sequence":
        log(f"GSPO (--ratio-level sequence): --clip-eps {cfg.clip_eps:g} --clip-eps-high "
            f"{cfg.clip_eps_high or cfg.clip_eps:g} --loss-agg {cfg.loss_agg}")
    if cfg.kl_in_reward and cfg.beta > 0 and cfg.kl_estimator in ("k2", "k3") and main:   # said even with --quiet
        print(f"train.py: warning: --kl-estimator {cfg.kl_estimator} in the reward pulls toward the reference far "
              f"less than k1 near it (kl.py); --kl-estimator auto (or k1) puts k1 there", file=sys.stderr)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    learner = Learner(task, rollout.Models(model, tok, ref, value_head), optimizer, sampling(cfg, model, log),
                      autocast, scorer, dynamic=dynamic_sampling.Budget(cfg.max_sampling_rounds)
                      if cfg.dynamic_sampling else None,
                      rollout_policy=mismatch.RolloutPolicy(cfg.rollout_dtype, cfg.rollout_stale, cfg.rollout_temperature)
                      if cfg.rollout_logprobs else None)
    kl_control = kl.KLController(cfg.beta, kl.KLRule(cfg.kl_control, cfg.kl_target, cfg.kl_target_min,
                                                     cfg.kl_target_max, cfg.kl_horizon, cfg.n))
    adaptive = entropy_control.AdaptiveEntropy(cfg.entropy_coef, cfg.entropy_target, cfg.entropy_coef_delta) \
        if cfg.entropy_target > 0 else None
    stability, collapse = monitor.StabilityMonitor(cfg.alert_entropy), monitor.CollapseCount(cfg.n)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    state = RunState()
    # what a checkpoint keeps besides the weights, the optimizer and the loop's state
    controllers = {name: c for name, c in (("monitor", stability), ("collapse", collapse),
                                           ("kl_control", kl_control), ("entropy_control", adaptive),
                                           ("value_head", value_head), ("rollout_policy", learner.rollout_policy))
                   if c is not None}
    if cfg.resume:                                   # every rank loads rank 0's checkpoint
        saved, used = checkpoint.restore_newest(Path(cfg.resume), model, optimizer, rng, log)
        state = RunState.from_checkpoint(dict(saved["loop"], step=saved["step"]))
        for name, c in controllers.items():
            c.load_state_dict(saved["controllers"][name])
        for name in ("metrics.jsonl", "samples.jsonl"):
            torn = checkpoint.truncate_log(out / name, state.step) if main else 0
            if torn:
                log(f"resume: dropped {torn} torn line(s) of {name} (a write cut short)")
        aside = checkpoint.set_aside_later(out, state.step) if main else None
        if aside:                                    # whole later checkpoints, or only a save cut short
            whole = [p for p in aside.iterdir() if p.suffix != ".tmp" and (p / checkpoint.STATE_FILE).is_file()]
            log(f"resume: the checkpoints after step {state.step} belong to the abandoned history; moved to {aside.name}"
                if whole else f"resume: a checkpoint whose save was cut short moved to {aside.name}")
        log(f"resumed from {used} at step {state.step}")
    ran_on = f"cuda ({torch.cuda.get_device_name()})" if device == "cuda" else f"cpu ({torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)})"
    if distributed.launched():
        ran_on += f" x {distributed.size()} ranks (torchrun)"
    if main:
        checkpoint.write_whole(out / "config.json", json.dumps(dict(dataclasses.asdict(cfg), ran_on=ran_on,
                                                         processes=distributed.size(),
                                                         **({"init_from_checkpoint": init} if init else {})), indent=2))
    logs = [checkpoint.JsonlLog(out / name if main else os.devnull, append=bool(cfg.resume))   # rank 0 writes
            for name in ("metrics.jsonl", "samples.jsonl")]
    if cfg.resume and main and state.pending_row and checkpoint.last_step(out / "metrics.jsonl") < state.step:
        logs[0].write(state.pending_row)             # killed during the stop's evaluation: its step's line
        log(f"resume: wrote step {state.step}'s metrics line, saved with its checkpoint (the run was killed "
            f"during the evaluation that follows a stop; that evaluation is lost)")
    state.pending_row = None
    if main and cfg.save_every == 0 and not checkpoint.reserve(out, reserve_bytes(model, value_head)):
        log("the disk has not the room for this run's checkpoint; a full disk mid-run would lose the run "
            "(--save-every N keeps earlier ones)")
    if cfg.tensorboard and main:                     # the metrics mirrored for TensorBoard
        try:
            logs[0] = report.TensorBoardMirror(logs[0], out / "tensorboard", state.step + 1 if cfg.resume else None)
        except Exception as e:                       # a read-only folder, a full disk, a too-old package
            print(f"train.py: --tensorboard: cannot write to {out / 'tensorboard'} ({type(e).__name__}: "
                  f"{str(e)[:160]}); the run goes on, metrics.jsonl has every number", file=sys.stderr)
    run = Run(cfg, out, learner, config.hyper_params(cfg), kl_control, adaptive, stability, collapse, controllers,
              state, rng, prompts_of(task, cfg), *logs, log, started,
              warn=(lambda s: print(f"train.py: {s}", file=sys.stderr)) if main else (lambda s: None))
    if state.first_eval is None and main:            # held-out evaluation: rank 0's alone
        held_out(run, row := {"step": 0})                    # before any update: evaluation only
        state.first_eval = state.last_eval
        run.metrics.write(row)
        if keep_best(run, row) and cfg.early_stop_patience:
            save_best(run)                           # the warm start is the first best
        log("step 0: held-out " + ", ".join(f"{key} {state.first_eval['eval_' + key]:.2f}"
                                            for key in task.HEADLINE))
    return run


def sampling(cfg: Config, model, log) -> tasks.Sampling:
    """config.sampling(cfg), with the shared-prefix forward only where this model's cache can be
    shared over rows (shared_prefix.mismatch): else the plain forward, said in one line."""
    chosen = config.sampling(cfg)
    if chosen.shared_prefix:
        error = shared_prefix.mismatch(model)
        if not error < 1e-3:
            log(f"shared prefix: off: {type(model).__name__}'s cache cannot be shared over rows (log-probs off "
                f"by {error:.3g}); every sequence encodes its own prompt")
            chosen = dataclasses.replace(chosen, shared_prefix=False)
    return chosen


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


# ---- a rank lost ----

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


def stopped_at_once(cfg: Config, signal_name: str) -> int:
    """Say in one line what a stop outside the loop's own handling left, and return the exit code
    (128 + the signal). Before training (the folder holds no run) the folder this command made is
    removed, so the same command starts afresh; the warm start is cached only once it is done."""
    out = Path(cfg.out)
    if checks.holds_run(out):
        where = f"--resume {out} continues from its newest checkpoint" if checkpoint.find(out) else \
            "it had no checkpoint yet: run the command again with --overwrite"
        print(f"train.py: stopped at once ({signal_name}); {where}", file=sys.stderr)
    else:
        for leftover in (".lock", checkpoint.RESERVE):
            (out / leftover).unlink(missing_ok=True)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        print(f"train.py: stopped ({signal_name}) before training began; nothing was written, run the "
              f"command again to start", file=sys.stderr)
    return 128 + checkpoint.SIGNALS.get(signal_name, 2)
