"""The lab's statistics on the committed results: each comparison's p, and how many seeds an effect needs.

    python -m tools.power     # the committed tiny-model and SmolLM2 comparisons, then the power tables

The tests are lab/stats.py's; the power computations the records name (fisher_power, seeds_for_counts,
seeds_for_mean) are here; this prints both over results/ (tests/test_stats.py).
"""
import itertools
import json
import math
import statistics
from pathlib import Path

from tasks import workflow_task
from lab.common import mean
from running import report
from lab.stats import (ALPHA, AFTER_THE_FACT, REAL, after_the_fact, committed, detectable_mean, fisher,
                       permutation, real_after_the_fact)


# the power computations the records name (their power: how many seeds an arm), planning only
def fisher_power(p1: float, p2: float, n1: int, n2: int, alpha: float = ALPHA) -> float:
    """P(fisher(a, n1, b, n2) < alpha) when arm 1's runs succeed with probability p1 and arm
    2's with p2: every (a, b) with its binomial probability, enumerated."""
    def pmf(k, n, p):
        return math.comb(n, k) * p ** k * (1 - p) ** (n - k)
    return sum(pmf(a, n1, p1) * pmf(b, n2, p2) for a in range(n1 + 1) for b in range(n2 + 1)
               if fisher(a, n1, b, n2) < alpha)


def seeds_for_counts(p1: float, p2: float, power: float = 0.8, most: int = 200) -> int | None:
    """The fewest runs an arm (both arms alike) for Fisher's test to see p1 above p2 with this
    power; None past `most`. Power is not monotone in n for an exact test: the first n that
    reaches it and keeps it for the next two is taken."""
    for n in range(2, most + 1):
        if all(fisher_power(p1, p2, m, m) >= power for m in (n, n + 1, n + 2)):
            return n
    return None


def seeds_for_mean(effect: float, sd: float, power: float = 0.8, alpha: float = ALPHA) -> int:
    """Runs an arm for detectable_mean to reach effect."""
    return next(n for n in itertools.count(2) if detectable_mean(sd, n, n, power, alpha) <= effect)


def pooled_sd(arms: list) -> float:
    """The sd of runs within an arm, pooled over arms of equal size: the root of their sample variances' mean."""
    return math.sqrt(statistics.fmean(statistics.variance(x) for x in arms))


def sized_by_pilot(pilot: str, key: str, effect: float, arms: int, root: Path = REAL) -> tuple | None:
    """A comparison's runs an arm by its pilot's rule (report 003's, written in its record before the pilot ran):
    the pooled sd of key over the pilot's arms (their sample variances averaged: equal arms), then
    seeds_for_mean(effect, sd), at least 4 and at most 30. (n, sd, the difference n runs an arm detect);
    None until each of the pilot's `arms` arms has 2 finished runs or more."""
    finished = lambda arm: [s[key] for s in (json.loads(p.read_text()) for p in sorted(arm.glob("s*/summary.json")))
                            if not s.get("interrupted")]             # a run stopped part way is no run of the pilot
    runs = [x for x in map(finished, (root / pilot / "runs").glob("*")) if len(x) >= 2]
    if len(runs) < arms:
        return None
    sd = pooled_sd(runs)
    n = min(30, max(4, seeds_for_mean(effect, sd)))
    return n, sd, detectable_mean(sd, n, n)


def toy_after_the_fact() -> None:
    """The committed tiny-model runs' central comparisons, each put to the one-sided permutation
    test; and group_norm's off-format count at lr 7e-3 to Fisher's."""
    print("The committed tiny-model runs, held-out best at the end unless named, 6 seeds an arm, after the fact:")
    for experiment in dict.fromkeys(x[1][0] for x in AFTER_THE_FACT):
        for _, _, line in after_the_fact(REAL.parent, experiment):
            print(f"  {line}")
    print()


def binomial_se(p: float, samples: int) -> float:
    """The standard error of a held-out rate measured on `samples` samples: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1 - p) / samples)


def one_answer_census(root: Path) -> dict:
    """Lesson 10's counts over root's DSL runs that log 16 held-out samples an evaluation (the
    3-seed experiments; the powered ones log 64): how many end with one text for every logged
    held-out sample, whose best workflow that text is, at which evaluation it first happened,
    their last five steps' share of groups with one reward and token entropy, and how many end
    at held-out best 0.25 without being quite one text."""
    owner = {text: ptype for ptype, text in workflow_task.BEST_WORKFLOW.items()}
    out = {"runs": 0, "one_text": 0, "by_type": {}, "first_step": [], "quarter_not_one": 0, "zero_std": [],
           "entropy": []}
    for summary in sorted(root.glob("*/runs/*/s*/summary.json")):
        cfg = json.loads((summary.parent / "config.json").read_text())
        if cfg["task"] != "dsl" or cfg["eval_prompts"] * cfg["eval_samples"] != 16:
            continue
        rows = [json.loads(line) for line in (summary.parent / "samples.jsonl").read_text().splitlines()]
        evals = [(r["step"], {x["text"] for x in r["samples"]}) for r in rows if r["split"] == "eval"]
        out["runs"] += 1
        if len(evals[-1][1]) == 1:
            out["one_text"] += 1
            kind = owner.get(next(iter(evals[-1][1])), "none")
            out["by_type"][kind] = out["by_type"].get(kind, 0) + 1
            out["first_step"].append(next(step for step, texts in evals if len(texts) == 1))
            last = report.read_metrics(summary.parent)[-5:]          # its last five steps
            out["zero_std"].append(mean(r.get("frac_reward_zero_std") for r in last))
            out["entropy"].append(mean(r.get("entropy") for r in last))
        elif json.loads(summary.read_text())["eval_best_rate_end"] == 0.25:
            out["quarter_not_one"] += 1
    return out


def main() -> None:
    toy_after_the_fact()
    arms = {arm: committed("real_group_size", arm, "eval_best_rate_end")
            for arm in ("K=2,_B=3", "K=8,_B=3", "K=8,_B=3,_entropy_bonus_0.01")}
    sd = pooled_sd(list(arms.values()))
    k2, k8 = arms["K=2,_B=3"], arms["K=8,_B=3"]
    print("The committed SmolLM2 runs (results/smollm2-135m/real_group_size, held-out best at the end):")
    for arm, x in arms.items():
        print(f"  {arm:30s} {x}")
    mde, n = detectable_mean(sd, len(k8), len(k2)), len(k8)
    seen = f"nothing (no split of {n} runs against {n} reaches p < 0.05)" if mde == math.inf else f"{mde:.2f}"
    print(f"  K=8 above K=2: {statistics.fmean(k8) - statistics.fmean(k2):+.3f}, one-sided permutation p = "
          f"{permutation(k8, k2):.2f}; the pooled sd over seeds is {sd:.3f}; {n} runs an arm detect {seen}; "
          f"this difference needs {seeds_for_mean(statistics.fmean(k8) - statistics.fmean(k2), sd)} runs an arm")
    for entry in ("real_group_size", "real_entropy_collapse"):   # the tests SUMMARY.md prints beside them
        for _, _, line in real_after_the_fact(REAL, entry):
            print(f"  {line}")
    c = one_answer_census(REAL)
    print(f"  SmolLM2 DSL runs ending with one text for every logged held-out sample (Lesson 10): "
          f"{c['one_text']} of {c['runs']}, by whose best workflow it is {c['by_type']}; first so at steps "
          f"{sorted(c['first_step'])}; over their last five steps, groups with one reward (median) "
          f"{statistics.median(c['zero_std']):.2f} and token entropy (median) {statistics.median(c['entropy']):.4f}; "
          f"{c['quarter_not_one']} more end at held-out best 0.25 with two texts")
    best = sorted(json.loads(p.read_text())["eval_best_rate_best"] for p in REAL.glob("*/runs/*/s*/summary.json")
                  if json.loads((p.parent / "config.json").read_text())["task"] == "dsl")
    print(f"  SmolLM2 DSL runs' best held-out evaluation (report 003's regime needs a strong baseline): highest "
          f"{best[-1]:.2f}, median {statistics.median(best):.2f}, over {len(best)} runs")
    for pilot in ("real_003_kl_pilot_cpu", "real_003_kl_pilot_cpu_again"):     # one rule, two starts (Intel, AMD)
        sized = sized_by_pilot(pilot, "eval_best_rate_end", 0.1, arms=4)
        print(f"  report 003's comparison, sized by {pilot}'s rule (a difference of 0.1 in held-out best at the end, "
              + (f"power 0.8): the pooled sd of its four arms {sized[1]:.3f}, so {sized[0]} runs an arm, which "
                 f"detect {sized[2]:.3f}" if sized else "power 0.8): not yet, its pilot has an arm with fewer than 2 runs"))
    print("\nRuns an arm for a one-sided test at alpha 0.05 to detect an effect with power 0.8:")
    print("how often a setting ends collapsed (Fisher's exact test)")
    for p1, p2 in ((0.5, 0.0), (0.5, 0.1), (0.33, 0.0), (0.9, 0.3), (0.7, 0.1), (0.7, 0.4)):
        print(f"  {p1:.0%} against {p2:.0%}: {seeds_for_counts(p1, p2)} runs an arm")
    print(f"a difference of held-out means, at the sd above ({sd:.3f})")
    for effect in (0.1, 0.15, 0.25):
        print(f"  {effect:.2f}: {seeds_for_mean(effect, sd)} runs an arm")
    print("the binomial standard error of one held-out rate near 0.25")
    for n in (16, 64, 128, 256):
        print(f"  {n} samples: {binomial_se(0.25, n):.3f}")
    print(f"three runs against three: the smallest one-sided p is {permutation([1, 1, 1], [0, 0, 0]):.3f}")


if __name__ == "__main__":
    main()
