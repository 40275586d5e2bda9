"""The lab's experiments on entropy collapse and its 2025-26 fixes (no report claims
these, so each "claim" is the README's or the method's own): how often train.py's defaults
collapse, which fix keeps a run off one answer, and what a rollout/training mismatch does.

A run *collapsed* (the rule, written before the first run): at its end the held-out samples
are one answer (eval_one_answer >= 0.9: one text for nearly every prompt), or it writes the
format (held-out valid >= 0.9) but picks the best workflow for at most 0.6 of the prompts.
Under the null, a frozen policy at the warm start, neither holds: its held-out valid rate is
about 0.6 and its commonest answer about 0.15 of the samples (step 0 of every run), so any
collapse counted is the training's doing.

Seeds 100-119: seeds no test and no other experiment uses (those use 0-5), 20 per setting,
so a rate of one run in twenty is seen at all.
"""
import json
import math
from pathlib import Path

from lab import compare, stats
from lab.common import Lab, mean, metric_rows
from running import report

SEEDS = range(100, 120)
ONE_ANSWER, VALID, BEST = 0.9, 0.9, 0.6       # the collapse rule's thresholds (above)
METRICS = ("eval_best_rate", "eval_one_answer", "entropy")


def collapsed(run: dict) -> bool:
    """The rule above, on a run's summary."""
    return (run.get("eval_one_answer_end") or 0) >= ONE_ANSWER or \
        (run["eval_valid_rate_end"] >= VALID and run["eval_best_rate_end"] <= BEST)


def rate(runs: list) -> str:
    """'3/20 (15%, 95% interval 5-36%)': the count, and the Wilson score interval of its rate."""
    n, k = len(runs), sum(map(collapsed, runs))
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return f"{k}/{n} ({100 * p:.0f}%, 95% interval {100 * max(0, centre - half):.0f}-{100 * min(1, centre + half):.0f}%)"


def which(runs: list) -> str:
    """The seeds that collapsed, by their folder name (s101 ...), or 'none'."""
    return ", ".join(r["out"].rsplit("/", 1)[-1] for r in runs if collapsed(r)) or "none"


def write_table(lab: Lab, name: str, runs: dict) -> None:
    lines = ["| setting | collapsed | which seeds | held-out best (end) | one answer (end) | entropy (end) |",
             "|---|---|---|---|---|---|"]
    for setting, rs in runs.items():
        lines.append(f"| `{setting}` | {rate(rs)} | {which(rs)} | "
                     f"{compare.spread([r['eval_best_rate_end'] for r in rs])} | "
                     f"{compare.spread([r.get('eval_one_answer_end') for r in rs])} | "
                     f"{compare.spread([end_entropy(r) for r in rs])} |")
    (lab.dir(name) / "table.md").write_text("\n".join(lines) + "\n")


def end_entropy(run: dict) -> float | None:
    """The mean token entropy of the run's last 10 updates."""
    hs = [x["entropy"] for x in metric_rows(run)[-10:] if x.get("entropy") is not None]
    return mean(hs) if hs else None


def below(runs: list, best: float = 0.9) -> int:
    """How many runs end below `best` held-out best, collapsed or not (a softer failure)."""
    return sum(r["eval_best_rate_end"] < best for r in runs)


# ---- 1. How often train.py's defaults collapse ----

GRPO_DEFAULT, PPO_DEFAULT = "--k 8 --norm global", "--algo ppo"


def collapse_rate(lab: Lab) -> dict:
    """How often `python train.py --k 8 --norm global` and `--algo ppo` collapse, over 20 seeds."""
    r = lab.sweep("collapse_rate", [GRPO_DEFAULT, PPO_DEFAULT], "--steps 150", METRICS, seeds=SEEDS)
    write_table(lab, "collapse_rate", r)
    grpo_runs, ppo_runs = r.values()
    n_bad = sum(map(collapsed, grpo_runs)) + sum(map(collapsed, ppo_runs))
    return dict(report="README", figure="collapse_rate/compare.png",
                claim="train.py's defaults learn the task on every seed (GRPO --k 8 --norm global: held-out best "
                      "~0.99; PPO 'reliable at its defaults'; both from seeds 0-5)",
                measured=f"collapsed (one answer for >= 90% of held-out samples, or valid >= 0.9 with best <= 0.6) "
                         f"over {len(grpo_runs)} seeds from {lab.block(SEEDS).start}: GRPO {rate(grpo_runs)} ({which(grpo_runs)}), "
                         f"PPO {rate(ppo_runs)} ({which(ppo_runs)}); ending below 0.9 held-out best: GRPO "
                         f"{below(grpo_runs)}/{len(grpo_runs)}, PPO {below(ppo_runs)}/{len(ppo_runs)}; "
                         f"held-out best at the end: GRPO "
                         f"{compare.spread([x['eval_best_rate_end'] for x in grpo_runs])}, PPO "
                         f"{compare.spread([x['eval_best_rate_end'] for x in ppo_runs])}",
                # rule (written before the run): reproduced if no run of either collapses; partly if at
                # most one run in twenty of each does; else not reproduced
                verdict="reproduced" if n_bad == 0 else
                "partly: the defaults collapse now and then" if max(sum(map(collapsed, grpo_runs)),
                                                                    sum(map(collapsed, ppo_runs))) <= len(grpo_runs) // 20
                else "not reproduced: the defaults collapse on some seeds")


# ---- 2. Which fix keeps the entropy up (and, where the baseline collapses, the answers apart) ----

FIXES = {                                   # every knob chosen before the first run: each method's own default
    "entropy bonus": "--entropy-coef 0.01 --entropy-coef-end 0.001",      # report 000's range, decayed
    "clip-higher": "--clip-eps-high 0.28",                                 # DAPO's
    "CISPO": "--policy-loss cispo",                                        # eps_max 5
    "Clip-Cov": "--policy-loss clip-cov",                                  # 2e-4 of the tokens, bounds 1 and 5
    "KL-Cov": "--policy-loss kl-cov",                                      # 2e-4 of the tokens, coef 1
    "80/20": "--top-entropy-quantile 0.2",
    "adaptive entropy": "--entropy-target 0.2",                            # TRL's target, delta 0.005, from 0
}
HOLDS, COSTS = 2.0, 0.05      # a fix holds the entropy at >= 2x the baseline's end entropy; costs the task
                              # when its mean held-out best ends > 0.05 below the baseline's


def entropy_collapse(lab: Lab) -> dict:
    """collapse_rate's GRPO baseline against seven fixes of entropy collapse, the same 20 seeds.

    The baseline's runs are collapse_rate's (lab/main.py runs it first: NEEDS)."""
    base_runs = json.loads((lab.root / "collapse_rate" / "summaries.json").read_text())[GRPO_DEFAULT]
    r = lab.sweep("entropy_collapse", [f"{GRPO_DEFAULT} {f}" for f in FIXES.values()], "--steps 150", METRICS,
                  seeds=SEEDS)
    runs = {"baseline (defaults)": base_runs, **{name: rs for name, rs in zip(FIXES, r.values())}}
    # rule (written before the run): where the baseline collapses in >= 2 of 20 runs, a fix is
    # reproduced if it collapses in at least 3 fewer; where it does not, collapse cannot be
    # prevented here, and the verdict says which fixes hold the end entropy at >= 2x the
    # baseline's without losing > 0.05 held-out best, and which cost the task
    return fixes_entry(lab, "entropy_collapse", runs, "train.py's defaults", least=2, fewer=3)


EPOCHS = "--epochs 2"         # a second pass over each batch: the ratio leaves 1, the clip-based fixes can act
EPOCH_SEEDS = range(100, 106)


def entropy_collapse_epochs(lab: Lab) -> dict:
    """The same seven fixes with two epochs per batch (off-policy in the second), 6 seeds.

    With one epoch (the defaults) every token's ratio is 1 when the loss is taken, so a fix that
    acts on the ratio (clip-higher, CISPO, KL-Cov) cannot change anything there."""
    r = lab.sweep("entropy_collapse_epochs", [f"{GRPO_DEFAULT} {EPOCHS}"] +
                  [f"{GRPO_DEFAULT} {EPOCHS} {f}" for f in FIXES.values()], "--steps 150", METRICS, seeds=EPOCH_SEEDS)
    runs = dict(zip(["baseline (defaults)", *FIXES], r.values()))
    # rule (written before the run): entropy_collapse's, for 6 seeds: where the baseline collapses in
    # >= 2 of 6 runs, a fix is reproduced if it collapses in at least 2 fewer; else as there
    return fixes_entry(lab, "entropy_collapse_epochs", runs, f"the defaults with {EPOCHS}", least=2, fewer=2)


WAVE_2026 = {                               # Lesson 13's objectives and MaxRL, each at its reference's defaults
    "DPPO-TV": "--policy-loss dppo-tv", "DPPO-KL": "--policy-loss dppo-kl",
    "squared log-ratio": "--policy-loss sq-logratio", "VESPO": "--policy-loss vespo",
    "LUSPO": "--policy-loss luspo --ratio-level sequence", "MaxRL": "--norm maxrl",
}


def entropy_collapse_2026(lab: Lab) -> dict:
    """The 2026 wave (Lesson 13) in entropy_collapse_epochs's comparison: two epochs, 6 seeds."""
    r = lab.sweep("entropy_collapse_2026", [f"{GRPO_DEFAULT} {EPOCHS}"] +
                  [f"{GRPO_DEFAULT} {EPOCHS} {f}" for f in WAVE_2026.values()], "--steps 150", METRICS,
                  seeds=EPOCH_SEEDS)
    runs = dict(zip(["baseline (defaults)", *WAVE_2026], r.values()))
    # rule (written before the first run): entropy_collapse_epochs's, for the 2026 methods: where the
    # two-epoch baseline collapses in >= 2 of 6 runs, a method is reproduced if it collapses in at
    # least 2 fewer; where it does not, "untestable", with the methods that hold the end entropy at
    # >= 2x the baseline's without losing > 0.05 held-out best and those that cost the task
    # (differences of means, untested)
    entry = fixes_entry(lab, "entropy_collapse_2026", runs, f"the defaults with {EPOCHS}", least=2, fewer=2)
    return dict(entry, report="the 2026 wave", claim="each of the 2026 objectives and MaxRL keeps a two-epoch GRPO "
                                                     "run off entropy collapse without costing the task")


def fixes_entry(lab: Lab, name: str, runs: dict, base: str, least: int, fewer: int) -> dict:
    """The table, figure, numbers and verdict of a baseline against FIXES: reproduced for the fixes
    with at least `fewer` fewer collapses where the baseline has at least `least`; otherwise which
    fixes hold the end entropy (>= HOLDS x the baseline's, held-out best kept within COSTS) and
    which cost the task."""
    write_table(lab, name, runs)
    base_runs = runs["baseline (defaults)"]
    first = json.loads((Path(base_runs[0]["out"]) / "config.json").read_text())
    compare.figure(runs, lab.dir(name) / "compare.png",
                   f"{name}: {len(base_runs)} seeds from {lab.block(SEEDS).start}, {base} + one fix each; {report.made_by(first)}",
                   ("entropy", "eval_best_rate", "eval_one_answer"))
    h = {n: mean(end_entropy(x) for x in rs) for n, rs in runs.items()}
    best = {n: mean(x["eval_best_rate_end"] for x in rs) for n, rs in runs.items()}
    n_base = sum(map(collapsed, base_runs))
    fixes = [n for n in runs if n != "baseline (defaults)"]
    holds = [n for n in fixes if h[n] >= HOLDS * h["baseline (defaults)"] and best[n] >= best["baseline (defaults)"] - COSTS]
    costs = [n for n in fixes if best[n] < best["baseline (defaults)"] - COSTS]
    helped = [n for n in fixes if sum(map(collapsed, runs[n])) <= n_base - fewer]
    return dict(report="2025-26 methods", figure=f"{name}/compare.png",
                claim="each of the 2025-26 fixes keeps a GRPO run off entropy collapse without costing the task",
                measured="; ".join(f"{n}: collapsed {sum(map(collapsed, rs))}/{len(rs)}, entropy at the end "
                                   f"{h[n]:.3f}, held-out best {best[n]:.2f}" for n, rs in runs.items()),
                verdict=(f"reproduced for {', '.join(helped) or 'none'}" if n_base >= least else
                         f"untestable on the toy: {base} do not collapse ({n_base}/{len(base_runs)}); "
                         f"entropy held (>= {HOLDS:g}x the baseline's, best kept): {', '.join(holds) or 'none'}; "
                         f"costs the task (best > {COSTS} below): {', '.join(costs) or 'none'}"))


# ---- 3. The rollout/training mismatch, made and corrected ----

MISMATCH = {                                # the null first: the sampler is the policy, its log-probs logged
    "null (fp32 sampler)": "--log-mismatch",
    "bf16 sampler": "--rollout-dtype bf16",
    "bf16 + TIS": "--rollout-dtype bf16 --rollout-correction tis",
    "bf16 + ICEPOP": "--rollout-dtype bf16 --rollout-correction mis",
    "4 updates stale": "--rollout-stale 4",
    "4 stale + TIS": "--rollout-stale 4 --rollout-correction tis",
}
MISMATCH_SEEDS = range(100, 106)
DIFF = "sampling/sampling_logp_difference/mean"


def mismatch(lab: Lab) -> dict:
    """bf16 and stale rollouts, with and without TIS / ICEPOP, against the null (6 seeds)."""
    r = lab.sweep("mismatch", [f"{GRPO_DEFAULT} {f}" for f in MISMATCH.values()], "--steps 150",
                  ("eval_best_rate", DIFF, "entropy"), seeds=MISMATCH_SEEDS)
    runs = dict(zip(MISMATCH, r.values()))
    best = {name: mean(x["eval_best_rate_end"] for x in rs) for name, rs in runs.items()}
    diff = {name: mean(mean(row[DIFF] for row in metric_rows(x) if row.get(DIFF) is not None) for x in rs)
            for name, rs in runs.items()}
    lines = ["| setting | mean abs log-prob gap | held-out best (end) | collapsed |", "|---|---|---|---|"]
    lines += [f"| {name} (`{MISMATCH[name]}`) | {diff[name]:.2g} | "
              f"{compare.spread([x['eval_best_rate_end'] for x in rs])} | {rate(rs)} |" for name, rs in runs.items()]
    (lab.dir("mismatch") / "table.md").write_text("\n".join(lines) + "\n")
    null, bf16 = best["null (fp32 sampler)"], best["bf16 sampler"]
    fixed = max(best["bf16 + TIS"], best["bf16 + ICEPOP"])
    return dict(report="Liu, Li et al. 2025", figure="mismatch/compare.png",
                claim="sampling from a bf16 copy of the policy while training in fp32 hurts the run; truncated "
                      "(TIS) or masked (ICEPOP) importance weights undo it",
                measured="; ".join(f"{name}: log-prob gap {diff[name]:.2g}, held-out best {best[name]:.2f}"
                                   for name in runs),
                # rule (written before the run): reproduced if the bf16 sampler ends >= 0.05 below the null's
                # mean held-out best and TIS or ICEPOP ends within 0.02 of the null; not reproduced if the
                # bf16 sampler ends within 0.05 of the null (the mismatch costs nothing here); else partly
                verdict="reproduced" if bf16 <= null - 0.05 and fixed >= null - 0.02 else
                "not reproduced: the bf16 mismatch costs nothing at this scale" if bf16 > null - 0.05 else
                "partly: the mismatch hurts, the corrections do not undo it")


# ---- 4. The 2026 trust regions, in the setting their paper names: a sampler that is not the policy ----

STALE = "--rollout-stale 4 --rollout-correction bypass"     # pi_old = a sampler 4 updates old (prime-rl's way)
TRUST = {"PPO's clip": "", "DPPO-TV": "--policy-loss dppo-tv", "DPPO-KL": "--policy-loss dppo-kl",
         "CISPO (no trust region)": "--policy-loss cispo"}
TRUST_ALPHA = 0.025           # each of the two primary tests (DPPO-TV, DPPO-KL against PPO's clip)


def trust_regions_stale(lab: Lab) -> dict:
    """DPPO against PPO's clip where the DPPO paper (arXiv 2602.04879, its Fig. 3) puts them: the
    sampler is not the policy (here 4 updates stale, asynchronous RL's mismatch) and the update's
    pi_old is the sampler's log-probs, so the trust region bounds the policy against the sampler.
    20 seeds an arm (100-119), the GRPO defaults otherwise.

    Power, computed before the first run (lab.stats, one-sided, alpha 0.025 a test, 20 against
    20): Fisher's test sees a collapse rate of 60% against 15% with power 0.80 (50% against 10%:
    0.74); it needs a difference of at least 5 runs to reach p < 0.025 at all. Smaller effects
    are not called real: the verdict says inconclusive. The held-out best at the end is tested
    beside (a permutation test sees 0.27 with power 0.80 at a spread of 0.3 between seeds)."""
    r = lab.sweep("trust_regions_stale", [f"{GRPO_DEFAULT} {STALE} {f}".strip() for f in TRUST.values()],
                  "--steps 150", ("eval_best_rate", DIFF, "entropy"), seeds=SEEDS)
    runs = dict(zip(TRUST, r.values()))
    write_table(lab, "trust_regions_stale", runs)
    count = {n: sum(map(collapsed, rs)) for n, rs in runs.items()}
    end = {n: [x["eval_best_rate_end"] for x in rs] for n, rs in runs.items()}
    n_runs, clip = len(runs["PPO's clip"]), "PPO's clip"
    fewer = {n: stats.fisher(count[clip], n_runs, count[n], n_runs) for n in ("DPPO-TV", "DPPO-KL")}
    more = {n: stats.fisher(count[n], n_runs, count[clip], n_runs) for n in ("DPPO-TV", "DPPO-KL")}
    higher = {n: stats.permutation(end[n], end[clip]) for n in ("DPPO-TV", "DPPO-KL")}
    cispo = stats.fisher(count["CISPO (no trust region)"], n_runs, count["DPPO-TV"], n_runs)
    better = [n for n, p in fewer.items() if p < TRUST_ALPHA]
    worse = [n for n, p in more.items() if p < TRUST_ALPHA]
    return dict(report="Qi et al. 2026 (DPPO)", figure="trust_regions_stale/compare.png",
                claim="with a sampler that is not the policy, DPPO's trust region in probability keeps training "
                      "stable where PPO's ratio clip does not, and a method without a trust region (CISPO) collapses",
                measured="; ".join(f"{n}: collapsed {rate(rs)}, held-out best at the end {compare.spread(end[n])}"
                                   for n, rs in runs.items())
                + "; " + "; ".join(f"{n} against PPO's clip: fewer collapses p = {fewer[n]:.3f}, more p = "
                                   f"{more[n]:.3f}, higher best at the end p = {higher[n]:.3f}" for n in fewer)
                + f"; CISPO collapses more than DPPO-TV: p = {cispo:.3f}",
                # rule: reproduced if DPPO-TV or DPPO-KL collapses in fewer runs than PPO's clip (Fisher's
                # exact test, one-sided, p < 0.025 each: the two tests' alpha 0.05) and neither collapses
                # in more (the same test the other way); not reproduced if one collapses in more and
                # neither in fewer; otherwise inconclusive. The held-out best at the end (permutation
                # tests) and CISPO against DPPO-TV are reported beside, not conditions.
                verdict="reproduced: " + ", ".join(better) + " collapse less than PPO's clip" if better and not worse
                else "not reproduced: " + ", ".join(worse) + " collapse more than PPO's clip" if worse and not better
                else f"inconclusive: collapses {', '.join(f'{n} {c}/{n_runs}' for n, c in count.items())}, no "
                     f"difference from PPO's clip the test can see" if not better and not worse
                else "inconclusive: one DPPO variant collapses less than PPO's clip and one more")
