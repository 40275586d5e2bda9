"""The lab's statistics (lab/stats.py) against hand arithmetic and naive loops over every
relabelling, and the design fact the lab's verdicts rest on: three runs an arm cannot reach
p < 0.05."""
import itertools
import json
import math
import random
import statistics

import pytest

from lab import stats
from tools import power


def naive_permutation_p(x, y):
    """Every ordering of the pooled runs, the first len(x) taken as arm 1 (each split counted
    len(x)! len(y)! times, which the share does not see)."""
    pooled, n = x + y, len(x)
    observed = statistics.fmean(x) - statistics.fmean(y)
    orders = list(itertools.permutations(pooled))
    hits = sum(statistics.fmean(o[:n]) - statistics.fmean(o[n:]) >= observed - 1e-12 for o in orders)
    return hits / len(orders)


def test_fisher_against_hand_arithmetic():
    # the lady tasting tea: 3 of 4 against 1 of 4; P(X >= 3) = (C(4,3) C(4,1) + C(4,4) C(4,0)) / C(8,4)
    assert stats.fisher(3, 4, 1, 4) == pytest.approx(17 / 70)
    # one run of three on one answer against none of three: C(3,1) C(3,0) / C(6,1)
    assert stats.fisher(1, 3, 0, 3) == pytest.approx(0.5)
    assert stats.fisher(0, 3, 1, 3) == 1.0                      # the other way: no evidence at all
    assert stats.fisher(3, 3, 0, 3) == pytest.approx(1 / 20)    # the most three against three can say


def test_three_runs_an_arm_can_never_reach_p_below_005():
    """Whatever three runs against three show, no one-sided exact test gives p < 0.05: Fisher's
    power is 0 even for 100% against 0%, and the permutation test's smallest p is 1/20."""
    assert power.fisher_power(1.0, 0.0, 3, 3) == 0.0
    assert power.fisher_power(1.0, 0.0, 4, 4) == 1.0            # four can: 1 / C(8, 4) = 1/70
    assert stats.permutation([0.9, 0.8, 0.7], [0.1, 0.2, 0.3]) == pytest.approx(1 / 20)
    assert stats.decide(stats.permutation([0.9, 0.8, 0.7], [0.1, 0.2, 0.3])) == "inconclusive"
    assert stats.detectable_mean(0.01, 3, 3) == math.inf and stats.detectable_mean(0.01, 4, 4) < math.inf


@pytest.mark.parametrize("x, y", [([0.33, 0.5, 0.17], [0.17, 0.0, 0.33]),
                                  ([0.52, 0.61, 0.43, 0.9], [0.77, 0.7, 0.8]),
                                  ([1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0])])
def test_the_permutation_test_equals_a_loop_over_every_ordering(x, y):
    assert stats.permutation(x, y) == pytest.approx(naive_permutation_p(x, y))


def test_two_sided_by_hand():
    """[1, 2, 3] against [4, 5, 6]: of the C(6, 3) = 20 splits only the observed one puts the
    three largest on one side, so each one-sided p is 1/20 or 1, and the two-sided 2/20."""
    assert stats.two_sided([1, 2, 3], [4, 5, 6]) == pytest.approx(0.1) == stats.two_sided([4, 5, 6], [1, 2, 3])
    assert stats.two_sided([0.5, 0.5], [0.5, 0.5]) == 1.0                   # no difference: capped at 1


def test_past_the_exact_limit_the_random_splits_land_within_their_error_of_the_exact_p():
    rng = random.Random(3)
    x = [rng.gauss(0.3, 0.2) for _ in range(10)]
    y = [rng.gauss(0.15, 0.2) for _ in range(10)]                # C(20, 10) = 184,756 splits > RESAMPLES
    pooled, observed = x + y, statistics.fmean(x) - statistics.fmean(y)
    total = sum(pooled)
    exact = statistics.fmean(sum(pooled[i] for i in idx) / 10 - (total - sum(pooled[i] for i in idx)) / 10
                             >= observed - 1e-12 for idx in itertools.combinations(range(20), 10))
    got = stats.permutation(x, y)
    assert abs(got - exact) <= 4 * math.sqrt(exact * (1 - exact) / stats.RESAMPLES) + 1 / stats.RESAMPLES


def test_sign_flip_against_a_loop_and_by_hand():
    assert stats.sign_flip([0.1, 0.2, 0.05, 0.3, 0.15]) == pytest.approx(1 / 32)      # all five positive
    d = [0.2, -0.1, 0.3, 0.05]
    patterns = list(itertools.product((1, -1), repeat=4))
    want = sum(statistics.fmean(s * v for s, v in zip(p, d)) >= statistics.fmean(d) - 1e-12 for p in patterns) / 16
    assert stats.sign_flip(d) == pytest.approx(want)


def test_a_p_at_the_floor_of_the_random_patterns_is_said_as_a_bound():
    """30 positive differences: none of 20,000 random sign patterns reaches their mean, so the p is
    1/20,000 by construction, an upper bound and not a measured value; an exact p is said as it is."""
    p = stats.sign_flip([0.01 * (i + 1) for i in range(30)])
    assert p == 1 / stats.RESAMPLES and stats.p_value(p) == "< 5e-05 (Monte Carlo)"
    assert stats.p_value(stats.sign_flip([0.1, 0.2, 0.05, 0.3, 0.15])) == "0.031"      # 1/32, exact
    assert stats.p_value(6 / 792) == "0.0076" and stats.p_value(3.9e-7) == "3.9e-07"   # Fisher's, exact


def test_fisher_power_against_a_simulation():
    rng = random.Random(0)
    trials, hits = 4000, 0
    for _ in range(trials):
        a = sum(rng.random() < 0.6 for _ in range(10))
        b = sum(rng.random() < 0.1 for _ in range(10))
        hits += stats.fisher(a, 10, b, 10) < 0.05
    want = power.fisher_power(0.6, 0.1, 10, 10)
    assert abs(hits / trials - want) < 4 * math.sqrt(want * (1 - want) / trials)


def test_the_detectable_mean_and_the_seeds_it_needs_by_hand():
    # (z_0.95 + z_0.8) * sd * sqrt(2 / n) = (1.6449 + 0.8416) * 0.2 * sqrt(2 / 10)
    assert stats.detectable_mean(0.2, 10, 10) == pytest.approx(2.4865 * 0.2 * math.sqrt(0.2), rel=1e-4)
    n = power.seeds_for_mean(0.25, 0.2)
    assert stats.detectable_mean(0.2, n, n) <= 0.25 < stats.detectable_mean(0.2, n - 1, n - 1)
    assert power.binomial_se(0.25, 16) == pytest.approx(math.sqrt(0.25 * 0.75 / 16))       # 0.108: README's 0.11


def test_a_comparison_is_sized_by_its_pilots_pooled_sd_within_4_and_30_runs_an_arm(tmp_path):
    """report 003's rule: sd = sqrt(mean of the arms' sample variances); n = seeds_for_mean(0.1, sd) in 4..30."""
    def pilot(values):
        for arm, xs in values.items():
            for seed, x in enumerate(xs):
                (tmp_path / "p" / "runs" / arm / f"s{seed}").mkdir(parents=True, exist_ok=True)
                (tmp_path / "p" / "runs" / arm / f"s{seed}" / "summary.json").write_text(json.dumps({"best": x}))
        return power.sized_by_pilot("p", "best", 0.1, arms=4, root=tmp_path)
    assert pilot({"a": [0.5, 0.5], "b": [0.5, 0.6], "c": [0.4], "d": [0.5, 0.5]}) is None        # c has one run
    (tmp_path / "p" / "runs" / "c" / "s1").mkdir()                                     # one in flight, no summary
    (tmp_path / "p" / "runs" / "e" / "s0").mkdir(parents=True)                     # an arm with none finished
    assert power.sized_by_pilot("p", "best", 0.1, arms=4, root=tmp_path) is None
    n, sd, seen = pilot({"c": [0.4, 0.6]})               # variances 0, 0.005, 0.02, 0: sd = sqrt(0.025 / 4)
    assert sd == pytest.approx(math.sqrt(0.025 / 4)) and n == power.seeds_for_mean(0.1, sd) and seen <= 0.1
    assert pilot({"a": [0.5, 0.5], "b": [0.5, 0.5], "c": [0.5, 0.5]})[:2] == (4, 0.0)       # no spread: the floor
    n, sd, seen = pilot({"a": [0.0, 1.0], "b": [0.0, 1.0], "c": [0.0, 1.0], "d": [0.0, 1.0]})
    assert n == 30 and seen == pytest.approx(stats.detectable_mean(sd, 30, 30)) and seen > 0.1    # capped at 30


def test_the_bootstrap_interval_holds_the_observed_difference_and_is_a_point_for_constant_arms():
    lo, hi = stats.bootstrap([0.5, 0.7, 0.6, 0.9], [0.1, 0.3, 0.2])
    assert lo <= statistics.fmean([0.5, 0.7, 0.6, 0.9]) - 0.2 <= hi
    assert stats.bootstrap([0.4, 0.4], [0.1, 0.1]) == pytest.approx((0.3, 0.3))



def naive_p(x: list, y: list) -> float:
    """The share of all C(12, 6) splits of two arms of six runs (a plain loop) at least as far
    apart as the observed one: the one-sided permutation p, counted by hand."""
    import itertools
    pooled, seen = x + y, statistics.fmean(x) - statistics.fmean(y)
    splits = list(itertools.combinations(range(12), 6))
    return sum(statistics.fmean([pooled[i] for i in a]) - statistics.fmean([pooled[i] for i in range(12) if i not in a])
               >= seen - 1e-12 for a in splits) / len(splits)


def test_lesson_2s_group_norm_comparison_tested_after_the_fact(capsys):
    """python -m tools.power's first line: K=8/B=3 against K=2/B=3 on the committed group_norm runs,
    its p the share of all C(12, 6) splits of the twelve runs (a plain loop) at least as far apart."""
    k8 = stats.toy("group_norm", "--k 8 --batch 3 --norm group", "eval_best_rate_end")
    k2 = stats.toy("group_norm", "--k 2 --batch 3 --norm group", "eval_best_rate_end")
    seen, naive = statistics.fmean(k8) - statistics.fmean(k2), naive_p(k8, k2)
    power.toy_after_the_fact()
    assert f"K=8/B=3 above K=2/B=3: {seen:+.3f}, one-sided permutation p = {naive:.3f}" in capsys.readouterr().out


def test_a_verdict_reads_inconclusive_where_its_claims_own_test_gives_p_above_alpha():
    """SUMMARY.md's verdict follows the claim's own test (stats.CLAIM_TEST): dynamic sampling's
    K=2 arm, p = 0.077 on the committed runs by the permutation test, turns "reproduced" into
    "inconclusive" with the rule's letter beside; a test below 0.05 keeps the word and names the
    test; an experiment with neither keeps its verdict."""
    tests = [("dynamic sampling above none, K=2/B=3", 0.077, ""), ("dynamic sampling above none, K=8/B=3", 0.009, "")]
    read = stats.tested_verdict("reproduced", tests, "dynamic_sampling")
    assert read.startswith("inconclusive:") and read.endswith("its letter said: reproduced")
    read = stats.tested_verdict("reproduced", [("a separate critic at 10x lr above a shared one", 0.017, "")], "critic")
    assert read == "reproduced (its test, after the runs: a separate critic at 10x lr above a shared one, p = 0.017)"
    assert stats.tested_verdict("not reproduced", [], "kl_range") == "not reproduced"
    dyn = stats.toy("dynamic_sampling", "--k 2 --batch 3 --norm group --dynamic-sampling", "eval_best_rate_end")
    none = stats.toy("group_norm", "--k 2 --batch 3 --norm group", "eval_best_rate_end")
    assert [p for name, p, _ in stats.after_the_fact(stats.REAL.parent, "dynamic_sampling")
            if name == stats.CLAIM_TEST["dynamic_sampling"]] == [stats.permutation(dyn, none)]



def test_the_tools_verdict_rests_on_its_tool_calls_to_the_permutation_test():
    """Report 000's "tool calling dies out" is the tools entry's half that held: the shaped runs'
    held-out tool calls per episode above the sparse runs', tested on the committed runs. With
    every shaped run above every sparse one, only 1 of the C(12, 6) = 924 splits puts a mean
    difference as large in the shaped arm: p = 1/924, counted here over the splits by hand."""
    shaped = stats.toy("tools", "--reward shaped", "eval_tool_calls_end")
    sparse = stats.toy("tools", "--reward sparse", "eval_tool_calls_end")
    naive = naive_p(shaped, sparse)
    assert min(shaped) > max(sparse) and naive == 1 / 924
    tests = stats.after_the_fact(stats.REAL.parent, "tools")
    assert [p for name, p, _ in tests if name == stats.CLAIM_TEST["tools"]] == [naive]
    summary = (stats.REAL.parent / "SUMMARY.md").read_text().split("## tools ")[1].split("\n## ")[0]
    assert "(its test, after the runs: shaped above sparse in held-out tool calls per episode, p = 0.0011)" in summary

def test_the_smallest_count_fishers_test_can_see_by_hand():
    """6 runs against 6: 4/6 against 0/6 gives C(6,4)/C(12,4) = 15/495 = 0.030 < 0.05, 3/6 gives
    20/220 = 0.091; 3 against 3 sees nothing (3/3 against 0/3: 1/20 = 0.05, not below); 20 against
    20 sees 5/20 (C(20,5)/C(40,5) = 0.023; 4/20: 0.053)."""
    assert stats.fisher(4, 6, 0, 6) == pytest.approx(15 / 495) and stats.fisher(3, 6, 0, 6) == pytest.approx(20 / 220)
    assert stats.smallest_count(6, 6) == 4 and stats.smallest_count(3, 3) is None
    assert stats.fisher(5, 20, 0, 20) == pytest.approx(math.comb(20, 5) / math.comb(40, 5))
    assert stats.smallest_count(20, 20) == 5 and stats.fisher(4, 20, 0, 20) >= 0.05


@pytest.mark.parametrize("experiment, twin, rolled", [
    ("real_rollback", "real_k_fair/runs/K=8,_B=3", "real_rollback/runs/K=8,_B=3,_rollback_3"),
    ("real_rollback_epochs", "real_rollback_epochs/runs/K=8,_B=3,_two_epochs",
     "real_rollback_epochs/runs/K=8,_B=3,_two_epochs,_rollback_3")])
def test_rollback_is_tested_paired_by_seed_after_the_fact(experiment, twin, rolled):
    """A rollback run and its no-rollback twin share their seed, and the rollback run is its twin
    until its first rollback: SUMMARY.md prints, beside the registered unpaired test, the
    one-answer share at the end compared seed by seed. Its p is the share of the 2^10 sign patterns
    (a plain loop over bit masks) whose mean difference is at least the observed one."""
    import json
    read = lambda arm: [json.loads((stats.REAL / arm / f"s{s}" / "summary.json").read_text())["eval_one_answer_end"]
                        for s in range(10)]
    d = [x - y for x, y in zip(read(twin), read(rolled))]
    seen = sum(d) / len(d)
    naive = sum(sum(v if mask >> i & 1 else -v for i, v in enumerate(d)) / len(d) >= seen - 1e-12
                for mask in range(2 ** len(d))) / 2 ** len(d)
    (name, p, line), = stats.real_after_the_fact(stats.REAL, experiment)
    assert p == pytest.approx(naive) and naive > stats.ALPHA      # paired, still inconclusive
    assert f"lower in {sum(x > 0 for x in d)} of 10 seeds, higher in {sum(x < 0 for x in d)}" in line
    assert line.endswith(f"p = {stats.p_value(naive)} (inconclusive)")


def test_a_rule_names_its_test_by_the_test_not_by_the_word():
    """SUMMARY's "Tested after the runs" says "beside the registered test" only where the rule
    names one: grad_clip's rule ("the tightest clip") and entropy_collapse_2026's ("untested")
    hold the letters "test" and name none; real_rollback_epochs' names Fisher's."""
    import json
    toy = json.loads((stats.REAL.parent / "summary.json").read_text())
    real = json.loads((stats.REAL / "summary.json").read_text())
    for rule, named in ((toy["grad_clip"]["rule"]["text"], False), (toy["entropy_collapse_2026"]["rule"]["text"], False),
                        (real["real_rollback_epochs"]["rule"]["text"], True), (toy["kl_regime"]["rule"]["text"], True)):
        assert "test" in rule and bool(stats.NAMED_TEST.search(rule)) is named, rule
