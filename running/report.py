"""What a run reports besides each step's metrics (diagnostics.py): samples.jsonl, the progress
line, summary.json and its curves, and TensorBoard when asked. Every key: docs/metrics.md.

    python -m running.report OUT_DIR      # OUT_DIR/curves.png again, from its metrics.jsonl
"""
import contextlib
import ctypes.util
import gzip
import json
import math
import resource
import statistics
import sys
from pathlib import Path

import matplotlib
import torch

from running import checkpoint

matplotlib.use("Agg")  # no screen needed
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)


# ---- samples.jsonl ----

def train_samples(batch, outcomes: list, prompts: list, task, n: int) -> list:
    """The first n rollouts of a step for samples.jsonl: prompt, text, outcome, reward, advantage."""
    k = len(batch.texts) // len(prompts)
    adv = batch.sequence_advantages()                                                # (N,)
    return [dict(prompt=prompts[i // k]["text"], **task.describe(batch.texts[i], outcomes[i]),
                 reward=batch.rewards[i].item(), advantage=adv[i].item())
            for i in range(min(n, len(batch.texts)))]


# ---- the terminal ----

def say(line: str) -> None:
    """A message on stderr; on a terminal, the unfinished progress line erased first (CR, ESC [K)."""
    print(("\r\033[K" if sys.stderr.isatty() else "") + line, file=sys.stderr)


def progress(cfg, task, row: dict, last_eval: dict) -> None:
    """On a terminal, one line rewritten in place; in a log, one line per evaluation."""
    end = "\n" if (row["step"] % cfg.eval_every == 0 or row["step"] == cfg.steps) else "\r"
    if not cfg.quiet and (end == "\n" or sys.stderr.isatty()):
        f = lambda x: "nan" if x is None else f"{x:.2f}"
        key, second = task.HEADLINE
        print(f"step {row['step']:4d}/{cfg.steps}  reward {f(row['reward_mean'])}  {second} {f(row[second])}  "
              f"{key} {f(row[key])}  held-out {key} {f(last_eval['eval_' + key])}", end=end, file=sys.stderr)


# ---- summary.json ----

def finish(task, out: Path, state, monitors: tuple, log) -> dict:
    """Write summary.json and curves.png, log the one-line summary, return the summary. state:
    session.RunState at the end; monitors: the run's StabilityMonitor and CollapseCount."""
    first, last = state.first_eval, state.last_eval
    updates, (stability, collapse) = state.updates, monitors
    summary = dict(steps=state.step, updates=updates, collapses=collapse.collapses,
                   crash_rate=collapse.collapses / updates if updates else 0.0,
                   crash_floor=collapse.floor / updates if updates else 0.0,
                   skipped_nonfinite=state.skipped, alert_episodes=stability.episodes,
                   **{key: getattr(state, key) for key in ("stopped", "interrupted", "failed_saves", "lost_log_lines",
                                                           "early_stopped", "best_step", "best_checkpoint")})
    summary.update({f"eval_{key}_start": first[f"eval_{key}"] for key in task.HEADLINE})
    summary.update({f"{key}_end": v for key, v in last.items()})      # every held-out rate at the end ...
    summary.update({f"{key}_best": v for key, v in (state.best_eval or {}).items()})   # ... and at the best
    rows = read_metrics(out)
    taken = [r["rollback"] for r in rows if "rollback" in r]         # --rollback's (monitor.Rollbacks)
    negative = [r["frac_adv_negative"] for r in rows if "frac_adv_negative" in r]
    # PPO's explained variance swings wildly as Var(G) -> 0: the median of the last 10 steps
    ev = [r["explained_variance"] for r in rows
          if r.get("explained_variance") is not None and math.isfinite(r["explained_variance"])][-10:]
    summary.update(ended_off_format=last[f"eval_{task.FORMAT_KEY}"] < 0.5,
                   frac_adv_negative_mean=sum(negative) / len(negative) if negative else None,
                   eval_value_rmse_end=last.get("eval_value_rmse"),
                   explained_variance_end=statistics.median(ev) if ev else None,
                   seconds=round(state.seconds, 1), peak_memory_mb=round(peak_memory_mb()), out=str(out),
                   **({"rollbacks": taken} if taken else {}))
    if updates == 0 and state.skipped:            # every update non-finite: a run that learned nothing
        summary["nothing_learned"] = True
    summary, _ = checkpoint.finite_json(summary)
    writing = "summary.json"
    try:
        checkpoint.write_whole(out / writing, json.dumps(summary, indent=2, allow_nan=False))
        writing = "curves.png"
        plot_run(out)
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


# glibc keeps the pages a process frees while a later allocation pins the heap above them: an
# update's activations stayed resident between steps (Lesson 12's page measures it)
MALLOC_TRIM = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None) if sys.platform == "linux" else None


def give_back_freed_memory() -> None:
    """Return the memory freed since the last call to the OS (glibc's malloc_trim; elsewhere nothing)."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


def peak_memory_mb() -> float:
    """This process's peak: torch's GPU memory on a GPU, else the resident set size (all of it)."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024          # KiB on Linux


# ---- TensorBoard, when asked (--tensorboard; an optional dependency) ----

class TensorBoardMirror:
    """metrics.jsonl, each row's numbers also TensorBoard scalars under OUT/tensorboard/ (a key
    with a slash groups as TRL's do). purge_step: a resumed run's first step; TensorBoard drops
    the abandoned history's values from there on (else every step redone showed two)."""

    def __init__(self, log, folder: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter      # needs `pip install tensorboard`
        self.log = log
        self.writer = SummaryWriter(str(folder), **({"purge_step": purge_step} if purge_step else {}))
        self.lost, self.full = log.lost, log.full

    def write(self, row: dict) -> None:
        self.log.write(row)
        self.lost, self.full = self.log.lost, self.log.full
        try:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step" \
                        and math.isfinite(value):
                    self.writer.add_scalar(key, value, row["step"])
            self.writer.flush()
        except Exception as e:               # a full disk, a folder gone: the mirror stops, the run does not
            print(f"train.py: --tensorboard: stopped at step {row['step']} ({type(e).__name__}: {e}); metrics.jsonl has every number", file=sys.stderr)
            self.write = self.log.write

    def close(self) -> None:
        self.log.close()
        with contextlib.suppress(Exception):     # its last events may not fit either
            self.writer.close()


# ---- curves.png ----

def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows; from metrics.jsonl.gz where only that is kept (lab.common.keep)."""
    path = Path(run_dir) / "metrics.jsonl"
    text = path.read_text() if path.exists() else gzip.decompress(path.with_suffix(".jsonl.gz").read_bytes()).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def made_by(cfg: dict) -> str:
    """Which model on which device made a run (its config.json), for a figure's title."""
    return f"{cfg.get('model') or 'tiny Qwen2'} on {cfg.get('ran_on', '?')}"


def plot_run(run_dir: Path) -> Path:
    """run_dir/curves.png: rates, advantage diagnostics and update statistics per step."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    steps = [r["step"] for r in rows]

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    ax = axes[0]
    tools = cfg.get("task") == "tools"
    rates = ["accuracy", "tool_success_rate", "wellformed_rate"] if tools else \
        ["best_rate", "valid_rate", "fallback_rate"]
    for key, color in zip(rates, ["C0", "C2", "C3"]):
        ax.plot(*series(key), color + "-", alpha=0.35, lw=1, label=f"rollout {key}")
    for key, color in zip(rates[:2], ["C0", "C2"]):
        ax.plot(*series("eval_" + key), color + "o-", lw=2, label=f"held-out {key}")
    crashes = [r["step"] for r in rows if r.get("collapsed_after_update")]
    ax.plot(crashes, [0.02] * len(crashes), "kx", label="collapsed after update")
    ax.set(xlabel="step", ylabel="share of samples", ylim=(-0.03, 1.03), title="what the policy writes")
    ax = axes[1]
    ax.plot(*series("frac_adv_pm1"), label="share |A| = 1")
    ax.plot(*series("frac_reward_zero_std"), label="share zero-variance groups")
    ax.plot(*series("adv_abs_mean"), label="mean |A|")
    ax.plot(*series("frac_adv_negative"), label="share A < 0")
    ax.set(xlabel="step", title="advantages")
    ax = axes[2]                    # the entropy on its own linear axis: the collapse this course is about
    ax.plot(*series("entropy"), "C4-", label="token entropy (the update's)")
    ax.set(xlabel="step", ylabel="nats a token", ylim=(0, None), title="entropy")
    ax = axes[3]                    # the rest span decades (grad_norm ~1, kl ~1e-3): symlog
    for key, color in zip(["kl", "kl_coef", "clip_frac", "grad_norm", "value_loss"], ["C0", "C1", "C2", "C3", "C5"]):
        ax.plot(*series(key), color, label=key)
    ax.set(xlabel="step", yscale="symlog", title="update")
    for ax in axes:
        ax.legend(fontsize=7)
    algo = cfg.get("algo", "grpo")
    norm = f"norm={cfg['norm']}  " if algo == "grpo" else ""
    task = f"tools ({cfg['reward']} reward)  " if tools else ""
    fig.suptitle(f"{task}{algo.upper()}  K={cfg['k']}  B={cfg['batch']}  {norm}lr={cfg['lr']:g}  "
                 f"seed={cfg['seed']}  ({len(steps)} steps)  {made_by(cfg)}")
    # fixed margins: tight_layout's search for them cost more than drawing the figure
    fig.subplots_adjust(left=0.035, right=0.99, bottom=0.12, top=0.87, wspace=0.18)
    path = run_dir / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys as _sys
    print(f"wrote {plot_run(Path(_sys.argv[1]))}" if len(_sys.argv) == 2 and Path(_sys.argv[1]).is_dir()
          else "usage: python -m running.report OUT_DIR (a run's folder)")
