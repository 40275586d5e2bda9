"""The crash flag under the null: a frozen policy raises `collapsed_after_update` by binomial noise."""
import json
import math
import random

import pytest

from running import config
import monitor
import train
from conftest import WARM_STARTS


@pytest.mark.parametrize("p, n", [(0.57, 6), (0.57, 16), (0.2, 24), (0.9, 6)])
def test_false_collapse_rate_equals_a_monte_carlo_frozen_policy(p, n):
    rng = random.Random(0)
    trials, flags = 100_000, 0
    for _ in range(trials):
        x1 = sum(rng.random() < p for _ in range(n))
        x2 = sum(rng.random() < p for _ in range(n))
        flags += x1 > 0 and x2 / n <= (x1 / n) / 2            # train.py's rule, on shares
    assert monitor.false_collapse_rate(p, n) == pytest.approx(flags / trials, abs=0.004)


@pytest.mark.lesson
def test_report_001s_97_percent_is_what_a_policy_that_never_changes_gives():
    """Report 001 called a step a collapse when fallback text came after an update: 37 of its 38
    updates (97.4%). A policy that never changes, at the report's own 57.2% valid and 6 samples
    a step, puts fallback in the next step with probability 1 - 0.572^6 = 96.5%, and 37 or more of
    38 such steps happen with probability 0.61 (a frozen policy, simulated, says the same): the
    statistic cannot tell a collapse from no change at all."""
    p_next = 1 - 0.572 ** 6
    tail = 1 - monitor.binomial_cdf(36, 38, p_next)                 # P(>= 37 of 38)
    assert p_next == pytest.approx(0.9650, abs=1e-4) and tail == pytest.approx(0.61, abs=0.005)
    rng, trials, hits = random.Random(0), 20_000, 0
    for _ in range(trials):            # 38 next steps of a frozen policy: 6 samples, each valid at 0.572
        hits += sum(any(rng.random() >= 0.572 for _ in range(6)) for _ in range(38)) >= 37
    assert hits / trials == pytest.approx(tail, abs=0.01)


@pytest.mark.lesson
def test_the_floor_at_report_001s_warm_start():
    assert monitor.false_collapse_rate(0.57, 6) == pytest.approx(0.1442, abs=1e-4)   # K=2, B=3
    assert monitor.false_collapse_rate(0.57, 16) == pytest.approx(0.0265, abs=1e-4)
    assert monitor.false_collapse_rate(0.57, 64) < 1e-4
    # given the previous share 3/6 = 0.5: P(Bin(6, 0.5) <= 1) = 7/64
    assert monitor.false_collapse_given(0.5, 6) == pytest.approx(7 / 64)
    assert monitor.false_collapse_given(0.0, 6) == 0.0


def test_summary_crash_floor_is_the_mean_null_chance_over_updates_recomputed_from_the_log(tmp_path):
    """A K=2/B=3 run at lr 7e-3 from a short warm start (the junk state: updates from 1 valid
    sample of 6): the summary's collapses and crash floor, recomputed from metrics.jsonl by
    hand. At each updated step t with x > 0 valid samples, the chance that step t + 1 has at
    most x // 2: n = 6 draws without replacement from the samples of the (up to 10) steps
    before t, or at t's own rate for the run's first step."""
    argv = ["--k", "2", "--batch", "3", "--norm", "group", "--steps", "14", "--eval-every", "14", "--lr", "7e-3",
            "--eval-samples", "1", "--sft-steps", "100", "--hidden", "16", "--layers", "1", "--quiet",
            "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / "run"), "--device", "cpu"]
    summary = train.train(config.parse_config(argv))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][1:]
    counts = [round(6 * r["valid_rate"]) for r in rows]
    floor, flags = 0.0, 0
    for t in range(len(rows) - 1):
        if not rows[t]["updated"] or counts[t] == 0:
            continue
        flags += counts[t + 1] <= counts[t] // 2
        k, window = counts[t] // 2, counts[max(0, t - monitor.WINDOW):t]
        if not window:
            p = counts[t] / 6
            floor += sum(math.comb(6, i) * p ** i * (1 - p) ** (6 - i) for i in range(k + 1))
        else:
            m, s = 6 * len(window), sum(window)
            floor += sum(math.comb(s, i) * math.comb(m - s, 6 - i) for i in range(k + 1)) / math.comb(m, 6)
    updates = sum(r["updated"] for r in rows)
    assert updates >= 3 and flags >= 1, "the junk state, with updates that can flag (the premise)"
    assert summary["updates"] == updates and summary["collapses"] == flags
    assert summary["crash_floor"] == pytest.approx(floor / updates)
    assert [r["collapsed_after_update"] for r in rows[1:]] == [
        bool(rows[t]["updated"] and counts[t] and counts[t + 1] <= counts[t] // 2) for t in range(len(rows) - 1)]


@pytest.mark.parametrize("p", [0.03, 0.3, 0.57])
def test_the_floor_equals_what_a_frozen_policy_flags_where_the_observed_rate_would_not(p):
    """A simulated frozen policy (every step updated, K=2/B=3: n = 6): the flags it raises by
    sampling noise alone, against the floor CollapseCount sums. At p = 0.03 the plug-in
    P(Binomial(n, x/n) <= x/2) says 0.33 where the flag follows a step of x = 1 with chance
    0.83; the window's rate gets it."""
    rng, n, steps = random.Random(1), 6, 20000
    count, plug_in = monitor.CollapseCount(n), 0.0
    for _ in range(steps):
        x = sum(rng.random() < p for _ in range(n))
        if count.before is not None:
            plug_in += monitor.false_collapse_given(count.before, n)
        count.update(True, x / n)
    se = math.sqrt(max(count.collapses, 1))                         # Poisson-like error of the count
    assert abs(count.collapses - count.floor) < 4 * se + 0.02 * count.collapses, (count.collapses, count.floor)
    if p == 0.03:
        assert plug_in < 0.5 * count.collapses, (plug_in, count.collapses)  # the old floor: less than half

