"""A run's bookkeeping between steps: what it remembers (RunState), and what happens after each
step's update and train.py's `steer` (beta, adaptive entropy, the count): the monitor watches,
the held-out evaluation runs when due, early stopping decides, the logs are written and
checkpoints saved (end_step).

train.py's loop calls end_step once per step; running/session.py sets a run up and closes it.
"""
from __future__ import annotations

import dataclasses
import errno
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

import diagnostics
import logprobs
import lora
import rollout
from running import checkpoint, distributed, evaluate, report

if TYPE_CHECKING:
    from running.session import Run

LOG_SAMPLES = 4               # completions per step written to samples.jsonl


# ---- the run's memory ----

@dataclass
class RunState:
    """What the loop remembers from step to step, and a checkpoint keeps besides the weights,
    the optimizer and the RNGs."""
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
    pending_row: dict | None = None  # a stop's metrics line, kept in the checkpoint that precedes its
                                     # evaluation: a kill during it (torchrun's SIGKILL) loses no step

    @classmethod
    def from_checkpoint(cls, saved: dict) -> "RunState":
        """The state a checkpoint kept (checkpoint.restore's "loop"), less why the run stopped."""
        names = {f.name for f in dataclasses.fields(cls)} - {"stopped", "interrupted", "early_stopped"}
        return cls(**{k: v for k, v in saved.items() if k in names})

    def count(self, step: int, stats: dict) -> None:
        """Count one step: done, and whether it updated or skipped a non-finite one."""
        self.step = step
        self.updates += stats["steps_taken"] > 0
        self.skipped += stats["skipped_nonfinite"]


# ---- after each step ----

def end_step(run: Run, row: dict, stats: dict, sampled: tuple) -> bool:
    """A step's bookkeeping after its update and train.py's controllers: the logs of skips,
    the monitor's alerts (account); evaluate on the held-out prompts when due and keep the best;
    early stopping; write the metrics and samples; the progress line; a checkpoint when due.
    sampled: the step's (batch, outcomes, prompts); batch None when nothing could be sampled.
    True: the run stops here."""
    batch, outcomes, prompts = sampled
    cfg, state, task = run.cfg, run.state, run.learner.task
    step = row["step"]
    state.count(step, stats)
    # a signal reaches one rank at a time: every rank stops at the step any of them got one
    # (the step's last collective; account's other inputs are the same on every rank)
    signal = distributed.first_reason(run.interrupts.signal)
    state.stopped = account(run, row, stats, signal)
    main = distributed.is_main()
    path = None
    if signal and main:
        # the weights first: torchrun kills the group 30 s after its SIGTERM, and a real model's
        # held-out evaluation can take longer; the evaluation follows, if time allows. The step's
        # metrics line goes into that checkpoint too, written by --resume if the kill came first.
        state.pending_row = dict(row, seconds=time.time() - run.step_started)
        path = save(run)
        state.pending_row = None
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
    if best and patience:                  # main only: early stopping keeps the best's weights
        save_best(run)
    # a log the disk cut short: no checkpoint of this step (its line is lost), the last good one stays;
    # with none (--save-every 0), this step's is written (the reserve's room): one line lost, not the run
    if (state.stopped or (cfg.save_every and step % cfg.save_every == 0)) and main and not signal and \
            not (full and checkpoint.find(run.out)):
        path = save(run)
    if state.stopped:
        saved = f"weights saved in {path} (resume with --resume {run.out})" if path else "no checkpoint written"
        run.log(f"stopped at step {step}: {state.stopped}; {saved}")
    return bool(state.stopped or state.early_stopped)


def say_once(run: Run, row: dict) -> None:
    """The silent no-ops (diagnostics.silent_no_ops), each said once, at the step it first
    happens; not with --quiet: metrics.jsonl's completions/clipped_ratio and frac_reward_zero_std
    keep them."""
    for key, message in diagnostics.silent_no_ops(row, run.cfg.k, run.cfg.new_tokens).items():
        if key not in run.said:
            run.said.add(key)
            run.log(f"step {row['step']}: {message}")


def account(run: Run, row: dict, stats: dict, signal: str | None) -> str | None:
    """After a step: say what went wrong once, raise the monitor's alerts; return why the run
    must stop, or None."""
    cfg, state, step = run.cfg, run.state, row["step"]
    if row.get("update_skipped") == "no_group_kept" and "no_group_kept" not in run.said:
        run.said.add("no_group_kept")            # once: metrics.jsonl's update_skipped marks every such step
        run.log(f"step {step}: dynamic sampling: in every one of {row['sampling_rounds']} rounds of {cfg.batch} "
                f"prompts, each prompt's {cfg.k} samples got the same reward, so no group could teach "
                f"anything; no update this step (said once; update_skipped in metrics.jsonl marks each such step)")
    say_once(run, row)
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


def reserve_bytes(model, value_head=None) -> int:
    """What session.start holds on the disk for the run's last checkpoint and summary: the fp32
    weights three times (AdamW's two moments), and 4 MB for the rest (summary, curves, config)."""
    params = list(model.parameters()) + (list(value_head.parameters()) if value_head is not None else [])
    return 3 * sum(p.numel() * 4 for p in params) + 4 * 2 ** 20


def checkpoint_bytes(run: Run) -> int:
    """About what a checkpoint takes on disk: the weights and the optimizer's state."""
    tensors = list(run.learner.models.model.parameters()) + [
        t for state in run.learner.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def save(run: Run) -> Path | None:
    """A checkpoint now, and the oldest ones pruned (--keep-checkpoints); None (said, counted
    in the summary) when it cannot be written: a full disk ends that save, not the run."""
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
                if not checkpoint.release(run.out):       # the room held for this (session.start): once
                    raise
                run.warn(f"step {state.step}: the disk is full; the room held for a checkpoint is used for it")
                path = checkpoint.save(run.out, state.step, policy, models.tok, whole, run.rng)
        except (OSError, RuntimeError, SafetensorError) as e:         # torch.save's failures are RuntimeErrors
            state.failed_saves += 1
            need, free = checkpoint_bytes(run), shutil.disk_usage(run.out).free
            # a file-size limit, whatever the free space (safetensors says it in words: "os error 27")
            if getattr(e, "errno", None) == errno.EFBIG or f"os error {errno.EFBIG})" in str(e):
                state.stopped = (f"a file of the checkpoint of step {state.step} is larger than this system "
                                 f"allows (ulimit -f, or FAT32's 4 GB); the last good one is "
                                 f"{checkpoint.find(run.out) or 'none'}; raise the limit, or --out on another disk")
                run.warn(f"step {state.step}: {state.stopped}")
            elif free < need:             # a full disk: stop now, the last good checkpoint untouched
                state.stopped = (f"the disk is full: the checkpoint of step {state.step} needs about "
                                 f"{need / 2**20:.0f} MB and {free / 2**20:.0f} MB are free; the last good one "
                                 f"is {checkpoint.find(run.out) or 'none'}; --resume {run.out} once there is room")
                run.warn(f"step {state.step}: {state.stopped}")
            else:
                run.warn(f"step {state.step}: checkpoint not written ({type(e).__name__}: {e}); the run goes on")
    spare = run.out / state.best_checkpoint if state.best_checkpoint else None    # early stopping's best
    for old in checkpoint.prune(run.out, run.cfg.keep_checkpoints, spare):
        run.log(f"removed checkpoint {old.name} (--keep-checkpoints {run.cfg.keep_checkpoints})")
    return path
