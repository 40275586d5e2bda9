"""One run, from its folder to its summary: `with session.open(cfg, build) as run:` (the lock,
train.py's build, a resume, the logs, the signals), then train.py's loop calling end_step after
each step (the monitor, the held-out evaluation, early stopping, the logs, the checkpoints);
after the block run.summary is summary.json's. Under torchrun every rank opens the same run,
rank 0 writes its files, and a collective that fails because another rank died ends the run
with one line (RankLost).
"""
import contextlib
import dataclasses
import errno
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError

import diagnostics
import dynamic_sampling
import entropy_control
import grpo
import kl
import logprobs
import lora
import monitor
import mismatch
import rollout
import tasks
import warm_start
from models import policy
from running import checkpoint, config, distributed, report
from running.config import Config

LOG_SAMPLES = 4               # completions per step written to samples.jsonl


# ---- what a run carries ----

@dataclass
class Learner:
    """What one RL step works on."""
    task: tasks.Task
    models: rollout.Models           # the policy, its tokenizer, the reference, the value head
    optimizer: torch.optim.Optimizer
    sampling: tasks.Sampling
    autocast: Callable               # bf16 autocast on a GPU; nothing on a CPU
    scorer: torch.nn.Module          # what the update differentiates (logprobs.Scorer; DDP under torchrun)
    dynamic: dynamic_sampling.Budget | None = None   # --dynamic-sampling's budget per step; None = off
    rollout_policy: mismatch.RolloutPolicy | None = None   # a sampler that is not the policy; None = off


@dataclass
class RunState:
    """What the loop remembers from step to step; a checkpoint keeps it ("loop")."""
    step: int = 0                    # the last step done
    updates: int = 0                 # steps that took an optimizer step
    skipped: int = 0                 # non-finite optimizer steps skipped
    first_eval: dict | None = None   # eval_* at step 0
    last_eval: dict | None = None    # eval_* at the newest evaluation
    failed_saves: int = 0            # checkpoints a full disk refused
    lost_log_lines: int = 0          # log lines a full disk refused
    seconds: float = 0.0             # wall time before this session (a resume's earlier ones)
    stopped: str | None = None       # why the run stopped early
    interrupted: str | None = None   # the signal that stopped it
    early_stopped: str | None = None  # why --early-stop-patience ended it (a normal end)
    difficulty: int = 1              # the task's difficulty at the last step (a curriculum never steps back)
    best_step: int = 0               # the evaluation with the highest held-out reward so far ...
    best_reward: float | None = None
    best_eval: dict | None = None    # ... its eval_*
    best_checkpoint: str | None = None   # its checkpoint, relative to the run (--early-stop-patience)
    evals_since_best: int = 0
    pending_row: dict | None = None  # a stop's metrics line, in the checkpoint before its evaluation


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
def open(cfg: Config, build: Callable):
    """The run of cfg (build: train.py's), set up or resumed in its locked folder, signals caught;
    after the block, the summary (run.summary) and torch's thread count as it was."""
    out, main, threads = Path(cfg.out or config.default_out(cfg)), distributed.is_main(), torch.get_num_threads()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    try:                                    # under torchrun, rank 0 holds the folder's lock
        with checkpoint.run_lock(out) if main else contextlib.nullcontext():
            # the handlers stay through the writing after the loop: a signal in the run's last
            # second is noted and the summary and curves.png are finished
            with checkpoint.Interrupts(at_once=True) as run_signals:
                run = start(cfg, out, build)
                run.interrupts, run_signals.at_once, run_signals.log = run_signals, False, run.log
                if run.learner.dynamic:     # a signal ends dynamic sampling's rounds within one round
                    run.learner.dynamic.stop = lambda: run.interrupts.signal is not None
                try:
                    yield run
                except RuntimeError as e:   # torchrun: another rank died or hung
                    if not distributed.lost_contact(e):
                        raise
                    run.metrics.close()
                    run.samples.close()
                    raise RankLost(lost_rank_message(run, e)) from e
                close_run(run, out, main)
    finally:
        torch.set_num_threads(threads)


def close_run(run: Run, out: Path, main: bool) -> None:
    """After the loop: close the logs; rank 0 writes summary.json and curves.png (a signal
    arriving now is obeyed by finishing them)."""
    state = run.state
    state.interrupted = state.stopped and run.interrupts.signal or None
    run.metrics.close()
    run.samples.close()
    if not main:
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
    """The checkpoint --init-from starts from, pinned in config.json: {"path", "sha256"}. A
    resumed run refuses (ResumeError) if it changed or is gone: the parent's newer checkpoint
    would otherwise silently become the reference model of the rest of the run."""
    if not cfg.init_from:
        return None
    try:
        pinned = json.loads((out / "config.json").read_text()).get("init_from_checkpoint") if cfg.resume else None
    except (OSError, ValueError):
        pinned = None
    if pinned is None:
        ckpt = checkpoint.starting_point(Path(cfg.init_from))
        return {"path": str(ckpt), "sha256": checkpoint.weights_sha256(ckpt)}
    path = Path(pinned["path"])
    if not path.is_dir() or checkpoint.weights_sha256(path) != pinned["sha256"]:
        raise checkpoint.ResumeError(f"--resume: this run started --init-from {str(path)!r}, which "
                                     f"{'has changed since' if path.is_dir() else 'is gone'}; its reference "
                                     f"model cannot be restored (restore that checkpoint, or start a new run)")
    return pinned


def start(cfg: Config, out: Path, build: Callable) -> Run:
    """Load the policy, build the rest, resume if asked, open the logs, evaluate at step 0."""
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
        checkpoint.clear_run(out, config.RUN_FILES)
        log(f"--overwrite: removed the earlier run's files from {out}")
    task = tasks.TASKS[cfg.task]
    with distributed.main_first():                   # rank 0 fills the model and warm-start caches
        init = init_from_checkpoint(cfg, out)
        built = build(cfg, task, device, log, init)  # train.py: policy, critic, reference, optimizer, controllers
    model, tok, value_head, optimizer = built["model"], built["tok"], built["critic"], built["optimizer"]
    scorer = distributed.replicate(logprobs.Scorer(model, value_head))   # DDP: rank 0's weights now
    bf16 = policy.autocast_choice(cfg.bf16, device, real_model=bool(cfg.model))
    log(f"bf16 autocast: {'on' if bf16 else 'off'} ({device}, --bf16 {cfg.bf16})")
    if cfg.ratio_level == "sequence":
        log(f"GSPO (--ratio-level sequence): --clip-eps {cfg.clip_eps:g} --clip-eps-high "
            f"{cfg.clip_eps_high or cfg.clip_eps:g} --loss-agg {cfg.loss_agg}")
    if cfg.kl_in_reward and cfg.beta > 0 and cfg.kl_estimator in ("k2", "k3") and main:   # said even with --quiet
        print(f"train.py: warning: --kl-estimator {cfg.kl_estimator} in the reward pulls toward the reference far "
              f"less than k1 near it (kl.py); --kl-estimator auto (or k1) puts k1 there", file=sys.stderr)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    learner = Learner(task, rollout.Models(model, tok, built["ref"], value_head), optimizer, sampling(cfg, model, log),
                      autocast, scorer, dynamic=dynamic_sampling.Budget(cfg.max_sampling_rounds)
                      if cfg.dynamic_sampling else None,
                      rollout_policy=mismatch.RolloutPolicy(cfg.rollout_dtype, cfg.rollout_stale, cfg.rollout_temperature)
                      if cfg.rollout_logprobs else None)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    state = RunState()
    # what a checkpoint keeps besides the weights, the optimizer and the loop's state
    controllers = {name: c for name, c in (("monitor", built["stability"]), ("collapse", built["collapse"]),
                                           ("kl_control", built["kl_control"]),
                                           ("entropy_control", built["entropy_control"]), ("value_head", value_head),
                                           ("rollbacks", built["rollbacks"]),
                                           ("rollout_policy", learner.rollout_policy)) if c is not None}
    if cfg.resume:
        state = resume(cfg, out, model, optimizer, rng, controllers, log)
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
    run = Run(cfg, out, learner, config.hyper_params(cfg), built["kl_control"], built["entropy_control"],
              built["stability"], built["collapse"], controllers, state, rng, tasks.prompts_of(task, cfg), *logs, log, started,
              warn=(lambda s: print(f"train.py: {s}", file=sys.stderr)) if main else (lambda s: None))
    if state.first_eval is None and main:            # held-out evaluation: rank 0's alone
        held_out(run, row := {"step": 0})            # before any update: evaluation only
        state.first_eval = state.last_eval
        run.metrics.write(row)
        if keep_best(run, row) and (cfg.early_stop_patience or cfg.rollback):
            save_best(run)                           # the warm start is the first best
        log("step 0: held-out " + ", ".join(f"{key} {state.first_eval['eval_' + key]:.2f}"
                                            for key in task.HEADLINE))
    return run


def resume(cfg: Config, out: Path, model, optimizer, rng, controllers: dict, log) -> RunState:
    """Every rank loads the newest whole checkpoint; rank 0 cuts the logs back to its step and
    sets later checkpoints aside. The loop's state, less why it stopped."""
    saved, used = checkpoint.restore_newest(Path(cfg.resume), model, optimizer, rng, log)
    keep = {f.name for f in dataclasses.fields(RunState)} - {"stopped", "interrupted", "early_stopped"}
    state = RunState(**{k: v for k, v in dict(saved["loop"], step=saved["step"]).items() if k in keep})
    for name, c in controllers.items():
        c.load_state_dict(saved["controllers"][name])
    if distributed.is_main():
        for name in ("metrics.jsonl", "samples.jsonl"):
            torn = checkpoint.truncate_log(out / name, state.step)
            if torn:
                log(f"resume: dropped {torn} torn line(s) of {name} (a write cut short)")
        aside, cut = checkpoint.set_aside_later(out, state.step)
        if cut:
            log(f"resume: removed {', '.join(cut)}, a checkpoint whose save was cut short")
        if aside:
            log(f"resume: the checkpoints after step {state.step} belong to the abandoned history; moved to {aside.name}")
    log(f"resumed from {used} at step {state.step}")
    return state


def sampling(cfg: Config, model, log) -> tasks.Sampling:
    """tasks.Sampling.of(cfg); the shared-prefix forward only where this model's cache can be
    shared over rows (else said in one line)."""
    chosen = tasks.Sampling.of(cfg)
    why = chosen.shared_prefix and logprobs.shared_prefix_refused(model)
    if why:
        log(f"shared prefix: off: {why}")
        chosen = dataclasses.replace(chosen, shared_prefix=False)
    return chosen


# ---- after each step ----

def end_step(run: Run, row: dict, stats: dict, sampled: tuple) -> bool:
    """After the update and train.py's steer: count the step, account for it, evaluate when due,
    keep the best, stop early, write the logs, a checkpoint when due. sampled: (batch, outcomes,
    prompts), batch None when nothing could be sampled. True: the run stops here."""
    batch, outcomes, prompts = sampled
    cfg, state, task = run.cfg, run.state, run.learner.task
    report.give_back_freed_memory()       # the update's, before the held-out generation
    step = state.step = row["step"]
    state.updates += stats["steps_taken"] > 0
    state.skipped += stats["skipped_nonfinite"]
    # a signal reaches one rank at a time: every rank stops at the step any of them got one
    signal = distributed.first_reason(run.interrupts.signal)
    state.stopped = account(run, row, stats, signal)
    main = distributed.is_main()
    path = None
    if signal and main:
        # the weights (and this step's metrics line) first: torchrun kills the group 30 s after
        # its SIGTERM, and a real model's evaluation can take longer; --resume writes the line
        state.pending_row = dict(row, seconds=time.time() - run.step_started)
        path = save(run)
        state.pending_row = None
    # a stopped run is evaluated where it stops, so its eval_*_end are its own
    due = (step % cfg.eval_every == 0 or step == cfg.steps or state.stopped) and batch is not None
    best = False
    rollbacks = run.controllers.get("rollbacks")
    if due and main:
        held_out(run, row)               # under --rollback, a collapsed evaluation is never the best
        best = not (rollbacks and rollbacks.why(row, {}, state.best_eval)) and keep_best(run, row)
    rolled = rollbacks is not None and roll_back(run, row, stats)
    patience = cfg.early_stop_patience
    early = due and bool(patience) and main and state.evals_since_best >= patience
    if due and patience:                   # rank 0 evaluated: every rank stops with it
        early = distributed.any_rank(early)
    if early and not state.stopped:
        state.early_stopped = (f"the held-out reward has not risen for {cfg.early_stop_patience} evaluations "
                               f"(--early-stop-patience); best {state.best_reward:.3f} at step {state.best_step}, "
                               f"kept in {run.out / (state.best_checkpoint or '?')}")
        run.log(f"early stop at step {step}: {state.early_stopped}")
    row["seconds"] = time.time() - run.step_started
    run.metrics.write(row)
    if batch is not None:
        run.samples.write({"step": step, "split": "train", "samples": report.train_samples(
            batch, outcomes, prompts, task, LOG_SAMPLES)})
    full = [log.path.name for log in (run.metrics, run.samples) if log.full]
    if full and not state.stopped:          # stop now: the last good checkpoint stays, --resume redoes the step
        state.stopped = (f"the disk is full: a line of {full[0]} could not be written; --resume {run.out} once "
                         f"there is room")
        run.warn(f"step {step}: {state.stopped}")
    if main:
        report.progress(cfg, task, row, state.last_eval)
    if best and (patience or rollbacks):   # main only: early stopping and --rollback keep the best's weights
        save_best(run)
    # a log the disk cut short: no checkpoint of this step (its line is lost), the last good one stays;
    # with none (--save-every 0), this step's is written (the reserve's room): one line lost, not the run
    if (state.stopped or rolled or (cfg.save_every and step % cfg.save_every == 0)) and main and not signal and \
            not (full and checkpoint.find(run.out)):
        path = save(run)
    if state.stopped:
        saved = f"weights saved in {path} (resume with --resume {run.out})" if path else "no checkpoint written"
        run.log(f"stopped at step {step}: {state.stopped}; {saved}")
    return bool(state.stopped or state.early_stopped)


def account(run: Run, row: dict, stats: dict, signal: str | None) -> str | None:
    """Say what went wrong (once where it repeats), raise the monitor's alerts; why the run must stop, or None."""
    cfg, state, step = run.cfg, run.state, row["step"]
    for key, message in diagnostics.silent_no_ops(row, cfg.k, cfg.new_tokens).items():   # each said once
        if key not in run.said:
            run.said.add(key)
            run.log(f"step {step}: {message}")
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
    return f"interrupted by {signal}" if signal else None


def roll_back(run: Run, row: dict, stats: dict) -> bool:
    """--rollback (monitor.Rollbacks), on every rank at rank 0's word (it alone evaluated): the best
    checkpoint's weights, optimizer, controllers and prompt sampler back, the lr cut. True if taken."""
    rollbacks = run.controllers["rollbacks"]
    why, best = distributed.gather((rollbacks.why(row, stats, run.state.best_eval), run.state.best_checkpoint))[0]
    said = rollbacks.cannot(why, best)
    if said and said.split("; ")[-1] not in run.said:         # once for each reason it cannot
        run.said.add(said.split("; ")[-1])
        run.log(f"step {row['step']}: {said}")
    if said or not why:
        return False
    saved = checkpoint.restore(run.out / best, run.learner.models.model, run.learner.optimizer, run.rng)
    for name in set(rollbacks.RESTORED) & set(run.controllers):
        run.controllers[name].load_state_dict(saved["controllers"][name])
    row["rollback"] = rollbacks.take(row["step"], why, saved["step"], run.learner.optimizer)
    run.log(f"step {row['step']}: rollback {len(rollbacks.taken)} of {rollbacks.most}: {why}; back to step "
            f"{saved['step']}'s checkpoint, lr x{row['rollback']['lr_scale']:g}")
    return True


def held_out(run: Run, row: dict) -> None:
    """Evaluate on the held-out prompts into row and state.last_eval; its samples to samples.jsonl."""
    cfg, learner = run.cfg, run.learner
    try:
        with learner.autocast():
            run.state.last_eval, rows = diagnostics.evaluate(learner.models, learner.task, run.prompts["eval"],
                                                             learner.sampling, cfg.eval_samples, cfg.gamma)
    except rollout.NonFiniteLogits:
        if row["step"] == 0:
            raise                      # the starting policy itself is broken: nothing to train
        run.log(f"step {row['step']}: non-finite logits in the held-out evaluation; it is skipped")
        return
    report.give_back_freed_memory()       # the generation's, before answer_nll's logits
    # the held-out loss beside the held-out reward (report 003: train loss falls, val loss rises)
    run.state.last_eval["eval_answer_nll"] = warm_start.answer_nll(learner.models, learner.task, run.prompts["eval"])
    run.state.last_eval["train_answer_nll"] = warm_start.answer_nll(learner.models, learner.task, run.prompts["nll"])
    row.update(run.state.last_eval)
    run.samples.write({"step": row["step"], "split": "eval", "samples": rows})


def keep_best(run: Run, row: dict) -> bool:
    """True when this evaluation's reward beats every earlier one's (the warm start's included);
    else one more without progress. A skipped (non-finite) evaluation counts for nothing."""
    state, reward = run.state, row.get("eval_reward_mean")
    if reward is None:
        return False
    if state.best_reward is not None and reward <= state.best_reward:
        state.evals_since_best += 1
        return False
    state.best_step, state.best_reward, state.evals_since_best = row["step"], reward, 0
    state.best_eval = dict(state.last_eval)
    return True


# ---- checkpoints ----

def save_best(run: Run) -> None:
    """--early-stop-patience: a checkpoint of the new best, named in the summary and spared by
    --keep-checkpoints; if it cannot be written the older stays."""
    before, run.state.best_checkpoint = run.state.best_checkpoint, f"checkpoints/step-{run.state.step:06d}"
    if save(run) is None:
        run.state.best_checkpoint = before


def reserve_bytes(model, value_head=None) -> int:
    """The disk held for the last checkpoint: fp32 weights and AdamW's two moments, 4 MB more."""
    params = list(model.parameters()) + (list(value_head.parameters()) if value_head is not None else [])
    return 3 * sum(p.numel() * 4 for p in params) + 4 * 2 ** 20


def save(run: Run) -> Path | None:
    """A checkpoint now, the oldest pruned; None (said, counted) when it cannot be written."""
    state, models = run.state, run.learner.models
    # the checkpoint: one dict beside the weights (checkpoint.save adds the random generators)
    whole = {"optimizer": run.learner.optimizer.state_dict(),
             "loop": dataclasses.asdict(dataclasses.replace(state, seconds=state.seconds + time.time() - run.started)),
             "controllers": {name: c.state_dict() for name, c in run.controllers.items()}}
    path = None
    if not logprobs.forward_is_finite(models.model):
        # blown-up weights would become the newest checkpoint, the one --resume picks
        run.log(f"step {state.step}: checkpoint not written: these weights give non-finite logits "
                f"(newest good checkpoint: {checkpoint.find(run.out) or 'none'})")
    else:
        policy = models.model
        if lora.adapters(policy):        # LoRA: the adapters kept whole, the weights merged (plain transformers loads them)
            whole["adapters"], policy = lora.adapter_state(policy), lora.merged(policy)
        try:
            try:
                path = checkpoint.save(run.out, state.step, policy, models.tok, whole, run.rng)
            except (OSError, RuntimeError, SafetensorError):
                if not checkpoint.release(run.out):       # the room held for this (start): once
                    raise
                run.warn(f"step {state.step}: the disk is full; the room held for a checkpoint is used for it")
                path = checkpoint.save(run.out, state.step, policy, models.tok, whole, run.rng)
        except (OSError, RuntimeError, SafetensorError) as e:         # torch.save's failures are RuntimeErrors
            state.failed_saves += 1
            why = unsavable(run, e)          # it cannot work: stop now, the last good one untouched
            state.stopped = why or state.stopped
            run.warn(f"step {state.step}: " + (why or f"checkpoint not written ({type(e).__name__}: {e}); "
                                                      f"the run goes on"))
    spare = run.out / state.best_checkpoint if state.best_checkpoint else None    # early stopping's best
    for old in checkpoint.prune(run.out, run.cfg.keep_checkpoints, spare):
        run.log(f"removed checkpoint {old.name} (--keep-checkpoints {run.cfg.keep_checkpoints})")
    return path


def unsavable(run: Run, error: Exception) -> str | None:
    """Why no later checkpoint can be written either, or None: a file-size limit (safetensors
    says "os error 27"), or less room than the weights and the optimizer's state take."""
    step, last = run.state.step, checkpoint.find(run.out) or "none"
    if getattr(error, "errno", None) == errno.EFBIG or f"os error {errno.EFBIG})" in str(error):
        return (f"a file of the checkpoint of step {step} is larger than this system allows (ulimit -f, or "
                f"FAT32's 4 GB); the last good one is {last}; raise the limit, or --out on another disk")
    tensors = list(run.learner.models.model.parameters()) + [
        t for s in run.learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    need, free = sum(t.numel() * t.element_size() for t in tensors), shutil.disk_usage(run.out).free
    if free < need:
        return (f"the disk is full: the checkpoint of step {step} needs about {need / 2**20:.0f} MB and "
                f"{free / 2**20:.0f} MB are free; the last good one is {last}; --resume {run.out} once there is room")
    return None


# ---- a rank lost, a stop before the loop ----

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
    """Say in one line what a stop outside the loop left; return 128 + the signal. Before
    training, the folder this command made is removed, so the same command starts afresh."""
    out, log = Path(cfg.out), Path(cfg.out) / "metrics.jsonl"
    untrained = not cfg.resume and not checkpoint.find(out) and (not log.exists() or len(log.read_text().splitlines()) < 2)
    if config.holds_run(out) and not untrained:
        where = f"--resume {out} continues from its newest checkpoint" if checkpoint.find(out) else \
            "it had no checkpoint yet: run the command again with --overwrite"
        print(f"train.py: stopped at once ({signal_name}); {where}", file=sys.stderr)
        return 128 + checkpoint.SIGNALS.get(signal_name, 2)
    made = config.holds_run(out)                # files of this command's, nothing trained (step 0 at most)
    for path in (out / name for name in (*config.RUN_FILES, ".lock", checkpoint.RESERVE)):
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    said = "before its first step; nothing was trained and its files are removed" if made else \
        "before training began; nothing was written"
    print(f"train.py: stopped ({signal_name}) {said}, run the command again to start", file=sys.stderr)
    return 128 + checkpoint.SIGNALS.get(signal_name, 2)
