"""The lab's statistics: an exact test for each kind of number a verdict reads, and the smallest
effect a design can detect.

    counts     runs that ended collapsed, a out of n1 against b out of n2: Fisher's exact test
               (`fisher`), from the hypergeometric law of a given a + b
    means      a number per run (held-out best, or a claim's own) in two arms: a permutation test of the
               difference of means (`permutation`), exact over every split of the runs into the
               arms when there are at most RESAMPLES of them, else RESAMPLES random splits
    paired     two arms that share their seeds (the same warm start, the same prompts): the
               sign-flip test of the mean difference (`sign_flip`), exact up to 14 pairs
    intervals  a percentile bootstrap of the difference of means (`bootstrap`)

Every test here is one-sided: a report's claim names its direction ("K=8 learns more"), and a
difference the other way is no evidence for it. A verdict reads p < ALPHA as the claim's effect,
and p >= ALPHA as "inconclusive", not as its absence, unless the design could have seen it:
`detectable_mean` says what it could (tools/power.py plans seeds with it and `fisher_power`). With
3 runs an arm no test reaches p < 0.05 (the smallest one-sided p of three runs against three is
1 / C(6, 3) = 0.05), so a three-seed comparison is inconclusive whatever it shows.

`python -m tools.power` prints the committed comparisons' p and how many seeds an effect needs.
"""
import itertools
import json
import math
import random
import re
import statistics
from pathlib import Path

from lab import common

ALPHA = 0.05
NAMED_TEST = re.compile(r"Fisher|permutation|sign.flip|exact test")   # how a rule names its test (not "untested")
RESAMPLES = 20000


def fisher(a: int, n1: int, b: int, n2: int) -> float:
    """P(arm 1's count >= a) given a + b successes in n1 + n2 runs, under the null that both
    arms share one rate: the one-sided p of "arm 1's rate a/n1 is above arm 2's b/n2"."""
    s, n = a + b, n1 + n2
    total = math.comb(n, s)
    return sum(math.comb(n1, x) * math.comb(n2, s - x) for x in range(a, min(n1, s) + 1)) / total


def permutation(x: list, y: list, seed: int = 0) -> float:
    """The one-sided p of "mean(x) is above mean(y)": the share of the splits of the pooled
    runs into arms of len(x) and len(y) whose difference of means is at least the observed one
    (the observed split included, so p >= 1 / the number of splits)."""
    pooled, n = list(x) + list(y), len(x)
    observed = statistics.fmean(x) - statistics.fmean(y)
    total = sum(pooled)

    def diff(first_sum: float) -> float:          # mean of arm 1 minus mean of arm 2, from arm 1's sum
        return first_sum / n - (total - first_sum) / len(y)
    splits = math.comb(len(pooled), n)
    tol = 1e-12 * max(1.0, abs(observed))          # float sums of the same runs in another order
    if splits <= RESAMPLES:
        hits = sum(diff(sum(pooled[i] for i in idx)) >= observed - tol
                   for idx in itertools.combinations(range(len(pooled)), n))
        return hits / splits
    rng = random.Random(seed)
    hits = sum(diff(sum(rng.sample(pooled, n))) >= observed - tol for _ in range(RESAMPLES - 1))
    return (hits + 1) / RESAMPLES


def two_sided(x: list, y: list) -> float:
    """The two-sided p of "mean(x) differs from mean(y)": twice the smaller one-sided p, at most 1."""
    return min(1.0, 2 * min(permutation(x, y), permutation(y, x)))


def sign_flip(d: list, seed: int = 0) -> float:
    """The one-sided p of "the paired differences d are above 0 on average": the share of the
    2^n sign patterns whose mean is at least the observed one (exact up to n = 14; random
    patterns past it)."""
    observed, n = statistics.fmean(d), len(d)
    tol = 1e-12 * max(1.0, abs(observed))
    if n <= 14:
        patterns = itertools.product((1, -1), repeat=n)
        return statistics.fmean(statistics.fmean(s * v for s, v in zip(p, d)) >= observed - tol for p in patterns)
    rng = random.Random(seed)
    hits = sum(statistics.fmean(v * rng.choice((1, -1)) for v in d) >= observed - tol for _ in range(RESAMPLES - 1))
    return (hits + 1) / RESAMPLES


def bootstrap(x: list, y: list, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of mean(x) - mean(y), each arm resampled on its own."""
    rng = random.Random(seed)
    diffs = sorted(statistics.fmean(rng.choices(x, k=len(x))) - statistics.fmean(rng.choices(y, k=len(y)))
                   for _ in range(RESAMPLES))
    cut = (1 - level) / 2
    return diffs[int(cut * RESAMPLES)], diffs[min(RESAMPLES - 1, int((1 - cut) * RESAMPLES))]


# ---- what a design can see ----

def detectable_mean(sd: float, n1: int, n2: int, power: float = 0.8, alpha: float = ALPHA) -> float:
    """The smallest difference of means a one-sided test of two arms of n1 and n2 runs, each
    with standard deviation sd, detects with this power (normal approximation:
    (z_{1-alpha} + z_{power}) * sd * sqrt(1/n1 + 1/n2)); a permutation test needs at least it.
    inf when no split of the runs can reach p < alpha (1 / C(n1 + n2, n1) >= alpha: 3 against 3)."""
    if 1 / math.comb(n1 + n2, n1) >= alpha:
        return math.inf
    z = statistics.NormalDist().inv_cdf
    return (z(1 - alpha) + z(power)) * sd * math.sqrt(1 / n1 + 1 / n2)


def decide(p: float, alpha: float = ALPHA) -> str:
    """A claim's one-sided test read as a verdict word: its effect is seen, or the test cannot
    tell (never "refuted" from p alone: that needs the design's power, said beside it)."""
    return "reproduced" if p < alpha else "inconclusive"


REAL = Path(__file__).resolve().parent.parent / "results" / "smollm2-135m"


def committed(experiment: str, arm: str, key: str, root: Path = REAL) -> list:
    """key of every SmolLM2 run of one arm (its run folder) of an experiment under root (the
    committed runs by default), in seed order; OSError when it has none."""
    runs = sorted((root / experiment / "runs" / arm).glob("s*/summary.json"))
    if not runs:
        raise OSError(f"no runs in {root / experiment / 'runs' / arm}")
    return [json.loads(r.read_text())[key] for r in runs]


def toy(experiment: str, setting: str, key: str, root: Path = REAL.parent) -> list:
    """key of every tiny-model run of one setting (root/EXPERIMENT/summaries.json: the committed
    results by default), in seed order."""
    return [run[key] for run in json.loads((root / experiment / "summaries.json").read_text())[setting]]


# Comparisons of the committed tiny-model runs: (what is claimed above what, arm, arm), each arm
# (experiment, setting) with seeds 0-5, and the number compared if not the held-out best at the end.
# Their rules named no test: these p-values came after the runs.
AFTER_THE_FACT = (
    ("K=8/B=3 above K=2/B=3", ("group_norm", "--k 8 --batch 3 --norm group"),
     ("group_norm", "--k 2 --batch 3 --norm group")),
    ("K=8/B=2 (report 001's fix A) above K=2/B=3", ("group_norm", "--k 8 --batch 2 --norm group"),
     ("group_norm", "--k 2 --batch 3 --norm group")),
    ("K=8/B=3 above K=2/B=12 (the same 24 samples a step)", ("group_norm", "--k 8 --batch 3 --norm group"),
     ("group_norm", "--k 2 --batch 12 --norm group")),
    ("dynamic sampling above none, K=2/B=3", ("dynamic_sampling", "--k 2 --batch 3 --norm group --dynamic-sampling"),
     ("group_norm", "--k 2 --batch 3 --norm group")),
    ("dynamic sampling above none, K=8/B=3", ("dynamic_sampling", "--k 8 --batch 3 --norm group --dynamic-sampling"),
     ("group_norm", "--k 8 --batch 3 --norm group")),
    ("a separate critic above a shared one", ("critic", "--critic separate"), ("critic", "--critic shared")),
    ("a separate critic at 10x lr above a shared one", ("critic", "--critic separate --critic-lr 1e-2"),
     ("critic", "--critic shared")),
    ("a separate critic at 10x lr above one at 1x", ("critic", "--critic separate --critic-lr 1e-2"),
     ("critic", "--critic separate")),
    ("fixed, 128 samples a step, above a cosine lr, 32", ("fixed_vs_dynamic", "--batch 16 --beta 0.05"),
     ("fixed_vs_dynamic", "--batch 4 --beta 0.05 --lr-schedule cosine --warmup-steps 10")),
    ("shaped above sparse in held-out tool calls per episode", ("tools", "--reward shaped"),
     ("tools", "--reward sparse"), "eval_tool_calls_end"),
    ("sparse above shaped in held-out accuracy", ("tools", "--reward sparse"), ("tools", "--reward shaped"),
     "eval_accuracy_end"),
    ("range 0.05/0.2 above 0.01/0.1 in held-out reward", *(("kl_range", f"--kl-control range --kl-target-min "
     f"{band} --kl-coef 1") for band in ("0.05 --kl-target-max 0.2", "0.01 --kl-target-max 0.1")), "eval_reward_mean_end"),
    ("4 updates stale with TIS above without", *(("mismatch", "--k 8 --norm global --rollout-stale 4" + tis)
                                                 for tis in (" --rollout-correction tis", ""))),
)


# The SmolLM2 lab's comparisons tested after the runs (the 3-seed ones' rules named no test):
# (the SUMMARY entry, what is claimed, arm, arm, what is compared), each arm (experiment, run
# folder). "best": the held-out best at the end, the first arm's above the second's (permutation
# test); "one answer": runs ending on one answer, the first arm's count above the second's (Fisher);
# "paired": the one-answer share at the end, the first arm's above the second's seed by seed (sign
# flip), for arms whose runs of one seed are one run until a flag acts (a rollback: Lesson 14).
K8, TWO_EPOCHS = ("real_group_size", "K=8,_B=3"), ("real_entropy_collapse", "two_epochs")
BONUS = ("real_group_size", "K=8,_B=3,_entropy_bonus_0.01")
REAL_AFTER_THE_FACT = (
    ("real_group_size", "K=8/B=3 above K=2/B=3", K8, ("real_group_size", "K=2,_B=3"), "best"),
    ("real_group_size", "K=2/B=3 on one answer more often than K=8/B=3", ("real_group_size", "K=2,_B=3"), K8,
     "one answer"),
    ("real_entropy_collapse", "the entropy bonus off one answer more often than K=8/B=3", K8, BONUS, "one answer"),
    *(("real_entropy_collapse", f"{fix} off one answer more often than K=8/B=3", K8,
       ("real_entropy_collapse", folder), "one answer")
      for fix, folder in (("Clip-Cov", "Clip-Cov"), ("80/20", "80_20"), ("adaptive entropy", "adaptive_entropy"))),
    *(("real_entropy_collapse", f"{fix} off one answer more often than two epochs alone", TWO_EPOCHS,
       ("real_entropy_collapse", f"two_epochs,_{fix}"), "one answer") for fix in ("clip-higher", "CISPO")),
    ("real_rollback", "--rollback 3 ends less on one answer than the same seed without", ("real_k_fair", "K=8,_B=3"),
     ("real_rollback", "K=8,_B=3,_rollback_3"), "paired"),
    ("real_rollback_epochs", "--rollback 3 ends less on one answer than the same seed without",
     ("real_rollback_epochs", "K=8,_B=3,_two_epochs"), ("real_rollback_epochs", "K=8,_B=3,_two_epochs,_rollback_3"), "paired"),
)


def real_after_the_fact(root: Path, experiment: str) -> list[tuple[str, float, str]]:
    """REAL_AFTER_THE_FACT's comparisons of one SUMMARY entry, tested on the runs under root:
    (what is claimed, p, the phrase) each."""
    out = []
    for entry, name, first, second, kind in REAL_AFTER_THE_FACT:
        if entry != experiment:
            continue
        if kind == "best":
            out.append(means_test(name, *(committed(*arm, "eval_best_rate_end", root) for arm in (first, second))))
        elif kind == "paired":
            d = [x - y for x, y in zip(*(committed(*arm, "eval_one_answer_end", root) for arm in (first, second)))]
            p = sign_flip(d)
            out.append((name, p, f"{name}: lower in {sum(x > 0 for x in d)} of {len(d)} seeds, higher in "
                                 f"{sum(x < 0 for x in d)}, one-sided sign-flip p = {p_value(p)}{undecided(p)}"))
        else:
            a, b = ([(v or 0) >= common.COLLAPSED for v in committed(*arm, "eval_one_answer_end", root)] for arm in (first, second))
            out.append(counts_test(name, sum(a), len(a), sum(b), len(b), "on one answer ", " against "))
    return out


def means_test(name: str, x: list, y: list) -> tuple[str, float, str]:
    """mean(x) above mean(y), to the permutation test, with what the design could detect."""
    p = permutation(x, y)
    return name, p, (f"{name}: {statistics.fmean(x) - statistics.fmean(y):+.3f}, one-sided permutation "
                     f"p = {p_value(p)}{undecided(p)}, {can_detect_mean(x, y)}")


def counts_test(name: str, a: int, n1: int, b: int, n2: int, lead: str, join: str) -> tuple[str, float, str]:
    """a of n1 runs above b of n2, to Fisher's test, with what the design could detect; the
    counts written lead a/n1 join b/n2."""
    p = fisher(a, n1, b, n2)
    return name, p, (f"{name}: {lead}{a}/{n1}{join}{b}/{n2}, one-sided Fisher p = {p_value(p)}{undecided(p)}, "
                     f"{can_detect_count(n1, n2)}")


def can_detect_mean(x: list, y: list) -> str:
    """What a permutation test of these two arms could see: detectable_mean at their pooled sd."""
    sd = math.sqrt(((len(x) - 1) * statistics.variance(x) + (len(y) - 1) * statistics.variance(y))
                   / (len(x) + len(y) - 2))
    mde = detectable_mean(sd, len(x), len(y))
    if mde == math.inf:
        return f"and {len(x)} runs against {len(y)} can reach p < {ALPHA} by no split"
    return f"{len(x)} runs against {len(y)} detect {mde:+.3f} (power 0.8, sd {sd:.3f})"


def smallest_count(n1: int, n2: int) -> int | None:
    """The fewest of n1 runs that Fisher's test calls above none of n2: the smallest difference
    of counts the design can see at all; None when even n1 of n1 cannot."""
    return next((a for a in range(1, n1 + 1) if fisher(a, n1, 0, n2) < ALPHA), None)


def can_detect_count(n1: int, n2: int) -> str:
    a = smallest_count(n1, n2)
    if a is None:
        return f"and no count of {n1} runs against {n2} reaches p < {ALPHA}"
    return f"the smallest it can see is {a}/{n1} against 0/{n2}"


def after_the_fact(root: Path, experiment: str) -> list[tuple[str, float, str]]:
    """The AFTER_THE_FACT comparisons whose first arm is experiment's, tested on the runs in root
    (a lab's folder): (what is claimed, p, the phrase) each (SUMMARY.md's entry, `python -m
    lab.stats`); for group_norm also its lr-7e-3 runs' off-format counts, to Fisher's test. None
    where a run's file is missing (a --quick or partial lab)."""
    out = []
    try:
        if experiment.startswith("real_"):
            return real_after_the_fact(root, experiment)
        for name, (ex, first), (ey, second), *key in AFTER_THE_FACT:
            if ex == experiment:
                key = (key or ["eval_best_rate_end"])[0]
                out.append(means_test(name, toy(ex, first, key, root), toy(ey, second, key, root)))
        if experiment == "group_norm":
            off = [toy("group_norm_aggressive_lr", f"--k {k} --batch 3 --norm group", "ended_off_format", root)
                   for k in (2, 8)]
            out.append(counts_test("off-format at lr 7e-3", sum(off[0]), len(off[0]), sum(off[1]), len(off[1]),
                                   "K=2/B=3 ", ", K=8/B=3 "))
    except (OSError, KeyError, ValueError):
        return []
    return out


# The comparison that is each claim's own test, where its rule named none: the verdict's word
# stands only where this test gives p < ALPHA (SUMMARY.md then says which test it rests on);
# else the entry reads "inconclusive", the rule's letter beside it. Chosen by the claim's words,
# not by the p-values: dynamic sampling is claimed for K=2 ("at K=2 most groups carry no
# signal"); report 001's group-size claim is K=8 above K=2 at the same B; report 000's critic
# claim is its own setting, a separate critic at 10x lr, above a shared one; report 002's is the
# fixed, large batch above the dynamic lr; report 000's tools verdict, tool calls dying out; the
# SmolLM2 entropy verdict names adaptive entropy.
CLAIM_TEST = {"group_norm": "K=8/B=3 above K=2/B=3", "dynamic_sampling": "dynamic sampling above none, K=2/B=3",
              "tools": "shaped above sparse in held-out tool calls per episode",
              "critic": "a separate critic at 10x lr above a shared one",
              "fixed_vs_dynamic": "fixed, 128 samples a step, above a cosine lr, 32",
              "real_group_size": "K=8/B=3 above K=2/B=3",
              "real_entropy_collapse": "adaptive entropy off one answer more often than K=8/B=3"}


# The verdicts that claim an effect with no test to read: why, said beside the verdict.
UNTESTED = {
    "k2_pm1": "exact: every reward draw of the mix enumerated, nothing sampled",
    "batch_size": "no test: the variances are measured on 8 batches each from one warm start, the gap is an "
                  "equality to float precision, and the reward swing is a mean over the kept runs' steps",
    "collapse_rate": "its test is the 95% interval of each collapsed count, under Measured",
    "entropy_collapse": "no test of 'entropy held' or of 'costs the task': a ratio and a difference of means "
                        "the rule reads",
    "entropy_collapse_epochs": "no test of 'entropy held' or of 'costs the task': ratios and differences of "
                               "means the rule reads",
}


def tested_verdict(verdict: str, tests: list, experiment: str) -> str:
    """The verdict as SUMMARY.md reads it: the rule's word where the claim's own test
    (CLAIM_TEST) gives p < ALPHA, naming that test; "inconclusive" where it does not, the rule's
    letter kept beside; the verdict with why it has no test (UNTESTED), or as it is (a
    registered test's, or "not reproduced")."""
    own = next(((name, p) for name, p, _ in tests if name == CLAIM_TEST.get(experiment)), None)
    if own is None:
        return f"{verdict} ({UNTESTED[experiment]})" if experiment in UNTESTED else verdict
    name, p = own
    if p < ALPHA:
        return f"{verdict} (its test, after the runs: {name}, p = {p_value(p)})"
    return (f"inconclusive: its test, after the runs ({name}), gives p = {p_value(p)}; the rule named no test, "
            f"and its letter said: {verdict}")


def p_value(p: float) -> str:
    """p to three decimals, or two significant digits below 0.01 (Fisher's 6/792 = 0.0076). A
    p at the floor of RESAMPLES random patterns (none as extreme as the data) is a bound, not a
    value: "< 5e-05 (Monte Carlo)"."""
    if p == 1 / RESAMPLES:
        return f"< {p:.2g} (Monte Carlo)"
    return f"{p:.3f}" if p >= 0.01 else f"{p:.2g}"


def undecided(p: float) -> str:
    return "" if p < ALPHA else " (inconclusive)"
