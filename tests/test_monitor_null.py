"""The crash flag under the null: a frozen policy raises `collapsed_after_update` by binomial noise."""
import json
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
def test_the_floor_at_report_001s_warm_start():
    assert monitor.false_collapse_rate(0.57, 6) == pytest.approx(0.1442, abs=1e-4)   # K=2, B=3
    assert monitor.false_collapse_rate(0.57, 16) == pytest.approx(0.0265, abs=1e-4)
    assert monitor.false_collapse_rate(0.57, 64) < 1e-4
    # given the previous share 3/6 = 0.5: P(Bin(6, 0.5) <= 1) = 7/64
    assert monitor.false_collapse_given(0.5, 6) == pytest.approx(7 / 64)
    assert monitor.false_collapse_given(0.0, 6) == 0.0


def test_summary_crash_floor_is_the_mean_null_probability_over_updates(tmp_path):
    argv = ["--k", "2", "--batch", "3", "--norm", "group", "--steps", "6", "--eval-every", "6",
            "--eval-samples", "1", "--sft-steps", "30", "--hidden", "16", "--layers", "1", "--quiet",
            "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / "run")]
    summary = train.train(config.parse_config(argv))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][1:]
    expected = sum(monitor.false_collapse_given(a["valid_rate"], 6)
                   for a, b in zip(rows, rows[1:]) if a["updated"])
    updates = sum(r["updated"] for r in rows)
    assert summary["updates"] == updates
    assert summary["crash_floor"] == pytest.approx(expected / updates if updates else 0.0)
