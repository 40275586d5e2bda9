"""Compare training settings over several seeds: one table, one figure.

    python compare.py --seeds 6 --common "--steps 100" \\
        "--k 8 --batch 8 --norm global" "--k 2 --batch 3 --norm group"

Each quoted setting is a train.py command line (added to --common). Every setting runs for
seeds 0 .. S-1 into OUT/runs/<setting>/s<seed>/, all from the same cached warm start. It prints
a Markdown table of the final held-out rates (mean ± std over seeds, [min-max]), how many
runs ended off-format (held-out valid rate < 0.5), and the crash-after-update rate, and
draws OUT/compare.png: held-out best rate per step, a thin line per seed and the mean.
RL is noisy: one seed proves nothing, so this is how the README's numbers are made.
"""
import argparse
import json
import shlex
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import config
import plots
import train


def run_setting(argv: list, seeds: int, out: Path) -> list[dict]:
    summaries = []
    for seed in range(seeds):
        c = config.parse_config(argv + ["--seed", str(seed), "--out", str(out / f"s{seed}"), "--quiet"])
        summaries.append(train.train(c))
    return summaries


def spread(xs: list) -> str:
    sd = statistics.pstdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.2f} ± {sd:.2f} [{min(xs):.2f}–{max(xs):.2f}]"


def table(results: dict) -> str:
    lines = ["| setting | held-out best (end) | held-out valid (end) | off-format runs | "
             "crash rate | fallback / junk (end) | s per run |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        lines.append(
            f"| `{name}` | {spread([r['eval_best_rate_end'] for r in runs])} "
            f"| {spread([r['eval_valid_rate_end'] for r in runs])} "
            f"| {sum(r['ended_off_format'] for r in runs)}/{len(runs)} "
            f"| {statistics.mean(r['crash_rate'] for r in runs):.2f} "
            f"| {statistics.mean(r['eval_fallback_rate_end'] for r in runs):.2f} / "
            f"{statistics.mean(r['eval_junk_rate_end'] for r in runs):.2f} "
            f"| {statistics.mean(r['seconds'] for r in runs):.0f} |")
    return "\n".join(lines)


def figure(results: dict, path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.4), sharey=True,
                             squeeze=False)
    for ax, (name, runs) in zip(axes[0], results.items()):
        curves = []
        for r in runs:
            rows = [x for x in plots.read_metrics(r["out"]) if "eval_best_rate" in x]
            steps = [x["step"] for x in rows]                 # step 0 is the warm start
            ys = [x["eval_best_rate"] for x in rows]
            ax.plot(steps, ys, color="C0", alpha=0.3, lw=1)
            curves.append(ys)
        mean = [statistics.mean(v) for v in zip(*curves)]
        ax.plot(steps, mean, color="C0", lw=2.5, label=f"mean of {len(runs)} seeds")
        ax.set(title=name, xlabel="step", ylim=(-0.03, 1.03))
        ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel("held-out best-workflow rate")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", help="train.py flags for one setting, quoted")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--common", default="", help="flags shared by every setting")
    p.add_argument("--out", type=Path, default=Path("runs/compare"))
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    common = shlex.split(args.common)
    for s in args.settings:                       # fail on a bad setting before any run
        config.parse_config(common + shlex.split(s) + ["--out", str(args.out)])
    results = {}
    for s in args.settings:
        name = " ".join(shlex.split(s))
        slug = name.replace("--", "").replace(" ", "_")
        results[name] = run_setting(common + shlex.split(s), args.seeds, args.out / "runs" / slug)
        print(f"finished {name}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    print(f"\n{args.seeds} seeds each; common flags: {args.common or '(defaults)'}\n\n{text}")
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "summaries.json").write_text(json.dumps(results, indent=1))
    figure(results, args.out / "compare.png", f"{args.seeds} seeds; common: {args.common or 'defaults'}")
    print(f"\nwrote {args.out}/table.md and {args.out}/compare.png")


if __name__ == "__main__":
    main()
