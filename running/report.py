"""What a run reports besides each step's metrics (diagnostics.py): samples.jsonl, the progress
line, summary.json and its curves, and TensorBoard when asked.

Every key of metrics.jsonl and summary.json, with its formula: docs/metrics.md.
"""
import json
import math
import resource
import statistics
import sys
from pathlib import Path

import torch

from running import checkpoint, plots


# ---- samples.jsonl ----

def train_samples(batch, outcomes: list, prompts: list, task, n: int) -> list:
    """The first n rollouts of a step for samples.jsonl: prompt, text, outcome, reward and
    advantage side by side, never one in place of the other."""
    k = len(batch.texts) // len(prompts)
    adv = batch.sequence_advantages()                                                # (N,)
    return [dict(prompt=prompts[i // k]["text"], **task.describe(batch.texts[i], outcomes[i]),
                 reward=batch.rewards[i].item(), advantage=adv[i].item())
            for i in range(min(n, len(batch.texts)))]


# ---- the terminal ----

def say(line: str) -> None:
    """A message, on stderr. On a terminal the progress line (below) may be sitting there
    unfinished: go back to its start and erase it first (carriage return, then ESC [K), or a
    shorter message would leave that line's tail on screen after it."""
    print(("\r\033[K" if sys.stderr.isatty() else "") + line, file=sys.stderr)


def progress(cfg, task, row: dict, last_eval: dict) -> None:
    """On a terminal, one line rewritten in place; in a log, one line per evaluation."""
    if cfg.quiet:
        return
    end = "\n" if (row["step"] % cfg.eval_every == 0 or row["step"] == cfg.steps) else "\r"
    if end == "\n" or sys.stderr.isatty():
        f = lambda x: "nan" if x is None else f"{x:.2f}"
        key, second = task.HEADLINE
        print(f"step {row['step']:4d}/{cfg.steps}  reward {f(row['reward_mean'])}  {second} {f(row[second])}  "
              f"{key} {f(row[key])}  held-out {key} {f(last_eval['eval_' + key])}", end=end, file=sys.stderr)


# ---- summary.json ----

SUMMARY_KEYS = ("steps", "updates", "collapses", "crash_rate", "crash_floor", "skipped_nonfinite",
                "alert_episodes", "stopped", "interrupted", "failed_saves", "lost_log_lines",
                "ended_off_format", "frac_adv_negative_mean", "early_stopped", "best_step", "best_checkpoint",
                "eval_value_rmse_end", "explained_variance_end", "eval_reward_mean_end", "seconds",
                "peak_memory_mb", "out")


def summary_keys(task) -> set:
    """Every key summary.json can hold for a task (lab/compare.py checks --columns against it)."""
    evals = [*task.RATES, "reward_mean", "answer_nll"]
    return set(SUMMARY_KEYS) | {f"eval_{key}_{when}" for key in evals for when in ("end", "best")} | \
        {f"eval_{key}_start" for key in task.HEADLINE} | {"train_answer_nll_end", "train_answer_nll_best"}


def finish(task, out: Path, state, monitors: tuple, log) -> dict:
    """Write summary.json and curves.png; log the one-line summary; return the summary.
    state: bookkeeping.RunState at the end (its seconds: the run's whole wall time, over every
    resume; its stopped / interrupted: why it ended early, or None); monitors: the run's
    monitor.StabilityMonitor and monitor.CollapseCount."""
    first, last = state.first_eval, state.last_eval
    updates, (stability, collapse) = state.updates, monitors
    summary = dict(steps=state.step, updates=updates, collapses=collapse.collapses,
                   crash_rate=collapse.collapses / updates if updates else 0.0,
                   crash_floor=collapse.floor / updates if updates else 0.0,
                   skipped_nonfinite=state.skipped, alert_episodes=stability.episodes,
                   stopped=state.stopped, interrupted=state.interrupted, failed_saves=state.failed_saves,
                   lost_log_lines=state.lost_log_lines, early_stopped=state.early_stopped,
                   best_step=state.best_step, best_checkpoint=state.best_checkpoint)
    for key in task.HEADLINE:
        summary[f"eval_{key}_start"] = first[f"eval_{key}"]
    for key, v in last.items():                     # eval_<rate>_end for every held-out rate
        summary[f"{key}_end"] = v
    for key, v in (state.best_eval or {}).items():  # ... and at the best evaluation (best_step)
        summary[f"{key}_best"] = v
    rows = plots.read_metrics(out)
    negative = [r["frac_adv_negative"] for r in rows if "frac_adv_negative" in r]
    # PPO: one step's explained variance swings wildly once the returns are nearly all equal
    # (Var(G) -> 0), so the end's is the median over the last 10 steps that have one
    ev = [r["explained_variance"] for r in rows
          if r.get("explained_variance") is not None and math.isfinite(r["explained_variance"])][-10:]
    summary.update(ended_off_format=last[f"eval_{task.FORMAT_KEY}"] < 0.5,
                   frac_adv_negative_mean=sum(negative) / len(negative) if negative else None,
                   eval_value_rmse_end=last.get("eval_value_rmse"),
                   explained_variance_end=statistics.median(ev) if ev else None,
                   seconds=round(state.seconds, 1), peak_memory_mb=round(peak_memory_mb()), out=str(out))
    if updates == 0 and state.skipped:            # every update non-finite: a run that learned nothing
        summary["nothing_learned"] = True
    summary, _ = checkpoint.finite_json(summary)
    writing = "summary.json"
    try:
        checkpoint.write_whole(out / writing, json.dumps(summary, indent=2, allow_nan=False))
        writing = "curves.png"
        plots.plot_run(out)
    except OSError as e:                            # a full disk: said in one line; metrics.jsonl has the run
        print(f"train.py: {writing} not written ({e}); metrics.jsonl and the checkpoint hold the run",
              file=sys.stderr)
    headline = ", ".join(f"{key} {summary[f'eval_{key}_start']:.2f} -> {summary[f'eval_{key}_end']:.2f}"
                         for key in task.HEADLINE)
    log(f"{'stopped' if state.stopped else 'done'} in {summary['seconds']}s: held-out {headline}, crash "
        f"rate {collapse.collapses}/{updates} (frozen-policy floor {summary['crash_floor']:.2f}), peak memory "
        f"{summary['peak_memory_mb']} MB; files in {out}/ (curves.png)")
    if summary.get("nothing_learned"):            # --quiet hides progress, never this
        print(f"train.py: error: every update of this run was non-finite ({state.skipped} skipped, none "
              f"taken): nothing was learned; the step lines and metrics.jsonl's nonfinite say what overflowed",
              file=sys.stderr)
    return summary


def peak_memory_mb() -> float:
    """This process's peak: GPU memory allocated by torch on a GPU, else the resident set size
    (RSS, the CPU's; it includes Python and every library)."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024          # KiB on Linux


# ---- TensorBoard, when asked (--tensorboard; an optional dependency) ----

class TensorBoardMirror:
    """metrics.jsonl, and each row's numbers also as TensorBoard scalars at its step, under
    OUT/tensorboard/ (`tensorboard --logdir OUT/tensorboard`). The JSON lines stay the record;
    a key with a slash (completions/mean_length) groups in TensorBoard as TRL's do."""

    def __init__(self, log, folder: Path, purge_step: int | None = None):
        """purge_step: a resumed run's first step; TensorBoard drops the abandoned history's
        values from there on (without it, every step redone showed two values)."""
        from torch.utils.tensorboard import SummaryWriter      # needs `pip install tensorboard`
        self.log = log
        self.writer = SummaryWriter(str(folder), **({"purge_step": purge_step} if purge_step else {}))
        self.lost, self.full = log.lost, log.full

    def write(self, row: dict) -> None:
        self.log.write(row)
        self.lost, self.full = self.log.lost, self.log.full
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step" \
                    and math.isfinite(value):
                self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.log.close()

