"""Every checkpoint against the baseline (report 003's last fix): the warm start and every checkpoint
of the runs, evaluated on the same held-out prompts with a fresh seed, by the task's group (problem
type, as report 003 broke accuracy down by shots).

    python -m tools.checkpoints runs/rce runs/grpo_after_rce --samples 16   # OUT/table.md, checkpoints.json, checkpoints.png

The evaluation is lab/compare.py's evaluate_checkpoints (the lab's rce_grpo uses it too).
"""
import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import tasks
from lab import figures
from lab.compare import CHECKPOINT_SEED, evaluate_checkpoints, run_config
from models import pretrained
from running import checkpoint, config, report


def problem_of(runs: list) -> str | None:
    """Why these runs' checkpoints cannot be compared, or None: each needs a config.json and a
    checkpoint, and all must share the task and model (one baseline for all)."""
    first = None
    for run in runs:
        if not (Path(run) / "config.json").is_file():
            return f"{str(run)!r} is not a run folder (no config.json)"
        if not checkpoint.candidates(run):
            return f"{str(run)!r} holds no checkpoint (train.py --save-every N or --early-stop-patience P)"
        if checkpoint.is_busy(run):
            return f"{str(run)!r} is still running (its folder is locked): compare it once it has ended"
        damaged = [(c, pretrained.cut_short(c)) for c in checkpoint.candidates(run) if pretrained.cut_short(c)]
        if damaged:
            return f"{str(damaged[0][0])!r} is damaged: {damaged[0][1]}"
        cfg = run_config(run)
        shape = {name: getattr(cfg, name) for name in config.SAME_MODEL}
        first = first or shape
        if shape != first:
            return f"{str(run)!r} has {shape}, another run {first}: one baseline needs one task and model"
    return None


def table(result: dict, key: str) -> str:
    """Markdown: a row per checkpoint, the rate `key` per group and overall, and the overall
    difference from the baseline (report 003's table: accuracy by shots, against the baseline)."""
    groups = list(result["baseline"])
    base = result["baseline"]["all"][key]
    head = ["model", *groups, "vs baseline (all)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             "| warm start (baseline) | " + " | ".join(f"{result['baseline'][g][key]:.3f}" for g in groups) + " | |"]
    for run, evals in result["runs"].items():
        for step, ev in evals:
            lines.append(f"| {run} step {step} | " + " | ".join(f"{ev[g][key]:.3f}" for g in groups)
                         + f" | {ev['all'][key] - base:+.3f} |")
    return "\n".join(lines)


def figure(result: dict, key: str, path: Path, title: str) -> None:
    """A panel per group (and all): `key` per checkpoint step, a line per run, the baseline dashed."""
    groups = list(result["baseline"])
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.2), squeeze=False)
    for ax, g in zip(axes[0], groups):
        ax.axhline(result["baseline"][g][key], color="k", ls="--", lw=1, label="warm start")
        for i, (run, evals) in enumerate(result["runs"].items()):
            name = "/".join(Path(run).parts[-2:])                     # setting/seed, as compare.py names them
            ax.plot([s for s, _ in evals], [ev[g][key] for _, ev in evals], "o-", color=f"C{i}", ms=3,
                    label=name if len(name) <= 40 else name[:18] + "..." + name[-19:])
        ax.set(title=g, xlabel="checkpoint step", ylabel=key)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("\n".join(textwrap.wrap(title, 40 * len(groups))), fontsize=9)
    figures.save(fig, path)


def main(argv: list) -> None:
    p = config.OneLineParser(prog="python -m tools.checkpoints",
                             description="Evaluate the warm start and every checkpoint of the runs on the "
                                         "same held-out prompts, broken down by the task's group.")
    p.add_argument("runs", nargs="+", type=Path, help="run folders (with checkpoints/)")
    p.add_argument("--samples", type=int, default=16, help="samples per held-out prompt")
    p.add_argument("--out", type=Path, default=Path("runs/checkpoints"))
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    problem = problem_of(args.runs)
    if problem:
        p.error(problem)
    if not config.writable(args.out):
        p.error(f"--out: cannot create or write to the folder {str(args.out)!r}")
    result = evaluate_checkpoints(args.runs, args.samples, log=lambda s: print(s, file=sys.stderr))
    task = tasks.TASKS[run_config(args.runs[0]).task]
    key = task.HEADLINE[0]
    text = table(result, key)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "checkpoints.json").write_text(json.dumps(result, indent=1))
    made = report.made_by(json.loads((args.runs[0] / "config.json").read_text()))
    figure(result, key, args.out / "checkpoints.png",
                       f"held-out {key} by {task.GROUP_KEY}, {args.samples} samples per prompt; {made}")
    print(f"held-out {key} by {task.GROUP_KEY} ({args.samples} samples per prompt, seed {CHECKPOINT_SEED})\n\n{text}")
    print(f"\nwrote {args.out}/table.md, checkpoints.json and checkpoints.png")


if __name__ == "__main__":
    main(sys.argv[1:])
