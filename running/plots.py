"""A run's figure, and the reading of its metrics.

    python -m running.plots run OUT_DIR   # OUT_DIR/curves.png from a run's metrics.jsonl

The lab's own figures (comparisons, the K=2 advantages, bars) are in lab/compare.py and
lab/figures.py.
"""
import argparse
import gzip
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen needed
import matplotlib.pyplot as plt

def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows; from metrics.jsonl.gz where only that is kept (the lab's
    committed toy runs: lab.common.keep)."""
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
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(*series("frac_adv_pm1"), label="share |A| = 1")
    ax.plot(*series("frac_reward_zero_std"), label="share zero-variance groups")
    ax.plot(*series("adv_abs_mean"), label="mean |A|")
    ax.plot(*series("frac_adv_negative"), label="share A < 0")
    ax.set(xlabel="step", title="advantages")
    ax.legend(fontsize=7)
    ax = axes[2]                    # the entropy on its own linear axis: the collapse this course is about
    ax.plot(*series("entropy"), "C4-", label="token entropy (the update's)")
    ax.set(xlabel="step", ylabel="nats a token", ylim=(0, None), title="entropy")
    ax.legend(fontsize=7)
    ax = axes[3]                    # the rest span decades (grad_norm ~1, kl ~1e-3): symlog
    for key, color in zip(["kl", "kl_coef", "clip_frac", "grad_norm", "value_loss"], ["C0", "C1", "C2", "C3", "C5"]):
        ax.plot(*series(key), color, label=key)
    ax.set(xlabel="step", yscale="symlog", title="update")
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="figure", required=True)
    p = sub.add_parser("run", help="curves of one training run")
    p.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    print(f"wrote {plot_run(args.run_dir)}")


if __name__ == "__main__":
    main()
