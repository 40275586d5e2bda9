"""The lab's experiments on report 001 (GRPO with K=2 on a workflow DSL): K=2 gives +-1, group
size and normalisation, and DAPO's dynamic sampling (docs/reports.md)."""
import json
from pathlib import Path

import monitor
from lab import compare, figures
from running import report
from lab.common import Lab, mean, end, metric_rows

# ---- 1. K=2 gives +-1 (report 001) ----

def k2_pm1(lab: Lab) -> dict:
    """Advantage distributions for K = 2, 4, 8, 16 under each norm (report 001)."""
    figures.plot_advantages(lab.dir("k2_pm1") / "advantages.png")
    exact = {k: figures.exact_shares("group", k) for k in (2, 4, 8, 16)}     # by enumeration, not sampled
    pm1, zero = {k: share for k, (share, _) in exact.items()}, exact[2][1]
    nonzero_pm1 = pm1[2] / (1 - zero) if zero < 1 else float("nan")
    return dict(report="001", figure="k2_pm1/advantages.png",
                claim="with K=2, (r - mean) / std gives every advantage exactly +1 or -1, whatever the reward gap",
                measured=f"exactly, over report 001's reward mix: group norm, K=2: {pm1[2]:.1%} of advantages "
                         f"are exactly ±1 and the rest are 0 "
                         f"(zero-variance groups, {zero:.1%} of groups); K=4: {pm1[4]:.1%}, K=8: {pm1[8]:.1%}, "
                         f"K=16: {pm1[16]:.1%}",
                # rule: every advantage of a non-zero-variance K=2 group is +-1
                verdict="reproduced" if abs(nonzero_pm1 - 1) < 1e-6 else "not reproduced")


# ---- 2. Group size and normalisation (report 001) ----

# GSPO (report 001's fix E; grpo.importance_ratio) at the report's K=2/B=3, with its paper's
# clip and mean over sequences. One update per step is on-policy: every s_i is 1 and its
# gradient is token-level GRPO's with seq-mean-token-mean (tests/test_gspo.py).
GSPO = "--k 2 --batch 3 --norm group --ratio-level sequence --clip-eps 3e-4 --clip-eps-high 4e-4 " \
       "--loss-agg seq-mean-token-mean"

def group_norm(lab: Lab) -> dict:
    """K=2 vs K=8 under each norm, clipping, GSPO, a fair budget, an aggressive lr (report 001)."""
    # The report's settings and its fixes at K=2, and the fair budget it skipped, 100 steps.
    # Trimmed for the lab's 40 minutes (README, "How long the whole lab takes"): 150 steps,
    # K=8/B=3 with Dr. GRPO, global, batch, RLOO and REINFORCE++-baseline norms, and K=2/B=3
    # run 4x longer are in the tables of git history (the ordering at step 100 was that at 150).
    moderate = ["--k 8 --batch 8 --norm global", "--k 8 --batch 2 --norm group", "--k 2 --batch 3 --norm group",
                "--k 8 --batch 3 --norm group", "--k 2 --batch 3 --norm drgrpo --adv-clip 2",
                "--k 2 --batch 3 --norm global --adv-clip 3",
                "--k 2 --batch 12 --norm group", GSPO]
    m = lab.sweep("group_norm", moderate, "--steps 100 --lr 1e-3 --eval-every 20",
                  ("eval_best_rate", "eval_valid_rate"))
    a = lab.sweep("group_norm_aggressive_lr", ["--k 2 --batch 3 --norm group", "--k 8 --batch 3 --norm group",
                                               "--k 8 --batch 2 --norm group", "--k 8 --batch 8 --norm global"],
                  "--steps 60 --lr 7e-3", ("eval_best_rate", "eval_valid_rate"))
    k2, k8b2, k8b3 = (m[lab.shrink(s)] for s in ("--k 2 --batch 3 --norm group", "--k 8 --batch 2 --norm group",
                                                   "--k 8 --batch 3 --norm group"))
    k2_agg, k8_agg = a[lab.shrink("--k 2 --batch 3 --norm group")], a[lab.shrink("--k 8 --batch 3 --norm group")]
    fair, gspo = m[lab.shrink("--k 2 --batch 12 --norm group")], m[lab.shrink(GSPO)]
    crash = mean(r["crash_rate"] for r in k2_agg)
    floor = mean(r["crash_floor"] for r in k2_agg)      # a frozen policy at the same rates (monitor.py)
    off = sum(r["ended_off_format"] for r in k2_agg)
    best = lambda runs: end(runs, "eval_best_rate_end")
    return dict(report="001", figure="group_norm/compare.png",
                claim="K=2, B=3 with group norm collapses right after 97% of updates; K=8 (B=2), Dr. GRPO, "
                      "global norm or clipping fix it",
                measured=f"held-out best at the end, lr 1e-3, 100 steps: K=2/B=3 group {best(k2):.2f}, K=8/B=2 {best(k8b2):.2f}, "
                         f"K=8/B=3 {best(k8b3):.2f}; fair budget K=2/B=12 {best(fair):.2f}; GSPO K=2/B=3 "
                         f"{best(gspo):.2f}. At lr 7e-3, K=2/B=3: crash rate {crash:.2f}, of which {floor:.2f} is the "
                         f"floor a frozen policy scores at the same on-format rates ({crash - floor:.2f} above "
                         f"it; at the warm start's p=0.57 and N=6 the floor is "
                         f"{monitor.false_collapse_rate(0.57, 6):.3f}), {off}/{len(k2_agg)} "
                         f"runs off-format (K=8/B=3: {sum(r['ended_off_format'] for r in k8_agg)}/{len(k8_agg)})",
                # rule: reproduced if K=8 beats K=2 at lr 1e-3 AND the K=2 crash rate at 7e-3, above
                # its frozen-policy floor, is >= 0.9
                verdict=("reproduced" if best(k8b2) > best(k2) and crash - floor >= 0.9 else
                         "partly: K=8 learns more than K=2, but the crash rate is far below 97%"
                         if best(k8b2) > best(k2) else "not reproduced"))


# ---- 3. DAPO's dynamic sampling (report 001 cites DAPO) ----

def dynamic_sampling(lab: Lab) -> dict:
    """Only groups whose rewards differ, at K=2/B=3 and K=8/B=3, vs group_norm's runs (DAPO).

    The runs without it are group_norm's (the same flags, seeds and steps); with it,
    --dynamic-sampling samples rounds of B=3 fresh prompts, at most 8 a step, until 3 groups
    differ (dynamic_sampling.py). Samples per step: every sample generated, the dropped
    groups' included."""
    plain = ["--k 2 --batch 3 --norm group", "--k 8 --batch 3 --norm group"]
    with_it = [f"{s} --dynamic-sampling" for s in plain]
    r = lab.sweep("dynamic_sampling", with_it, "--steps 100 --lr 1e-3 --eval-every 20",
                  ("eval_best_rate", "samples_generated", "frac_reward_zero_std"))
    base = json.loads((lab.root / "group_norm" / "summaries.json").read_text())
    runs = {}                                  # K=2 without, with; K=8 without, with
    for s, ds in zip(plain, with_it):
        runs[lab.shrink(s)], runs[lab.shrink(ds)] = base[lab.shrink(s)], r[lab.shrink(ds)]
    cfg = {name: json.loads((Path(rs[0]["out"]) / "config.json").read_text()) for name, rs in runs.items()}
    # every sample generated, the dropped groups' included; without it B*K every step
    samples = {name: mean(mean(x["samples_generated"] for x in metric_rows(run)[1:]) for run in rs)
               if cfg[name].get("dynamic_sampling") else cfg[name]["k"] * cfg[name]["batch"]
               for name, rs in runs.items()}
    zero = {name: mean(mean(x["frac_reward_zero_std"] for x in metric_rows(run)[1:]) for run in rs)
            for name, rs in runs.items()}
    lines = ["| setting | held-out best (end) | samples per step | zero-variance groups trained on | s per run |",
             "|---|---|---|---|---|"]
    for name, rs in runs.items():
        lines.append(f"| `{name}` | {compare.spread([x['eval_best_rate_end'] for x in rs])} | "
                     f"{samples[name]:.1f} | {zero[name]:.2f} | {mean(x['seconds'] for x in rs):.0f} |")
    (lab.dir("dynamic_sampling") / "table.md").write_text("\n".join(lines) + "\n")
    compare.figure(runs, lab.dir("dynamic_sampling") / "compare.png",
                   f"dynamic sampling: {lab.seeds} seeds, lr 1e-3; "
                   f"{report.made_by(next(iter(cfg.values())))}")
    k2, k2ds, k8, k8ds = (end(rs, "eval_best_rate_end") for rs in runs.values())
    names = list(runs)
    return dict(report="001 (DAPO)", figure="dynamic_sampling/compare.png",
                claim="at K=2 most groups carry no signal; dropping them and sampling until B groups differ "
                      "(DAPO's dynamic sampling) trains better",
                measured=f"held-out best at the end: K=2/B=3 {k2:.2f}, with dynamic sampling {k2ds:.2f} "
                         f"({samples[names[1]]:.1f} samples a step against {samples[names[0]]:.0f}); K=8/B=3 "
                         f"{k8:.2f}, with it {k8ds:.2f} ({samples[names[3]]:.1f} against "
                         f"{samples[names[2]]:.0f}); zero-variance groups trained on without it: K=2 "
                         f"{zero[names[0]]:.2f}, K=8 {zero[names[2]]:.2f}; seconds per run "
                         + ", ".join(f"{mean(x['seconds'] for x in rs):.0f}" for rs in runs.values()),
                # rule (written before the run): reproduced if dynamic sampling raises K=2/B=3's
                # mean held-out best by more than 0.05; "partly" if it raises K=8's instead
                verdict="reproduced" if k2ds > k2 + 0.05 else "partly: it helps at K=8 only" if k8ds > k8 + 0.05
                else "not reproduced")
