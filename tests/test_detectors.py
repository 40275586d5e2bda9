"""The detector bench (lab/detectors.py) on runs made by hand: the onset it reads, the threshold it
fixes against a brute-force search, and a verdict that can go either way."""
import gzip
import json
import math
import random

import pytest

from lab import detectors, stats
from lab.common import Lab


def evaluation(step, one=0.1, valid=0.6, best=0.3):
    return {"step": step, "eval_one_answer": one, "eval_valid_rate": valid, "eval_best_rate": best}


def run_rows(collapse_at=None, spike_at=None, steps=60, seed=None):
    """A toy run evaluated every 10 steps; from collapse_at on its evaluations are one answer;
    its grad norm is ~1 (with noise when seeded), times 10 from spike_at on."""
    rng, rows = random.Random(seed), [evaluation(0)]
    for step in range(1, steps + 1):
        grad = (10 if spike_at is not None and step >= spike_at else 1) * (1 + 0.1 * (rng.random() if seed is not None else step % 3))
        row = {"step": step, "grad_norm": grad, "reward_mean": 0.5, "entropy": 0.3, "frac_reward_zero_std": 0.0}
        if step % 10 == 0:
            row.update(evaluation(step, one=0.95 if collapse_at is not None and step >= collapse_at else 0.1))
        rows.append(row)
    return rows


def test_outcome_reads_the_last_stretch_of_collapse():
    rows = [evaluation(0), evaluation(10, one=0.95), evaluation(20), evaluation(30, one=0.95), evaluation(40, one=0.95)]
    assert detectors.outcome(rows, real=False) == {"kind": "collapsed", "onset": 30, "last_healthy": 20}
    assert detectors.outcome(rows[:3], real=False)["kind"] == "recovered"
    assert detectors.outcome([evaluation(0), evaluation(10)], real=False)["kind"] == "healthy"
    # the toy's second clause: the format written, the wrong workflow; SmolLM2's rule is one answer alone
    wrong = [evaluation(0), evaluation(10, valid=0.95, best=0.25)]
    assert detectors.outcome(wrong, real=False)["kind"] == "collapsed"
    assert detectors.outcome(wrong, real=True)["kind"] == "healthy"
    assert detectors.outcome([evaluation(0)], real=False) == {"kind": None}


def as_runs(specs, noisy=False):
    """specs: (collapse_at, spike_at, half) -> the bench's run dicts, as read_runs makes them."""
    runs = []
    for i, (collapse_at, spike_at, half) in enumerate(specs):
        rows = run_rows(collapse_at, spike_at, seed=i if noisy else None)
        out = detectors.outcome(rows, real=False)
        updates = [x for x in rows if x["step"] > 0]
        runs.append(dict(path=str(i), half=half, **out,
                         series={n: fn(updates) for n, (fn, _) in detectors.SIGNALS.items()}))
    return runs


def test_threshold_is_the_smallest_with_few_false_alarms_against_brute_force():
    rng = random.Random(3)
    specs = [(rng.choice([None, 40, 50]), rng.choice([None, 15, 25, 45]), 0) for _ in range(30)]
    runs = [r for r in as_runs(specs, noisy=True) if r["kind"] in ("collapsed", "healthy")]
    name = "grad-norm spike"
    got = detectors.fix_threshold(runs, name)
    healthy = [r for r in runs if r["kind"] == "healthy"]

    def false_alarms(t):        # the naive loop: a healthy run alarms if any step reaches t
        return sum(any(v >= t for _, v in r["series"][name]) for r in healthy)
    # the naive search: every value any run reached and the float just above it
    values = sorted({x for r in runs for _, v in r["series"][name] for x in (v, math.nextafter(v, math.inf))})
    naive = min(t for t in values if false_alarms(t) <= 0.1 * len(healthy))
    assert got == naive and 0 < false_alarms(math.nextafter(got, -math.inf)) - false_alarms(got)


@pytest.mark.lesson
def test_a_signal_that_leads_warns_and_one_that_does_not_is_refused():
    # 12 collapsing runs whose grad norm spikes at step 15, onset at step 40 (last healthy 30);
    # 12 healthy runs without a spike; each half gets six of each
    specs = [(40, 15, i % 2) for i in range(12)] + [(None, None, i % 2) for i in range(12)]
    result = detectors.bench(as_runs(specs))
    spike = result["grad-norm spike"]
    assert (spike["warned"], spike["n_sick"], spike["false"], spike["n_healthy"]) == (6, 6, 0, 6)
    assert spike["leads"] == [25] * 6                      # onset 40 - the spike at 15
    assert spike["p"] == stats.fisher(6, 6, 0, 6) and spike["warns"]
    # the same spike after the onset is no warning; a spike 5 steps after the last healthy
    # evaluation is only a loose one
    late = detectors.bench(as_runs([(40, 45, i % 2) for i in range(12)] + [(None, None, i % 2) for i in range(12)]))
    assert late["grad-norm spike"]["warned"] == 0 and not late["grad-norm spike"]["warns"]
    loose = detectors.bench(as_runs([(40, 35, i % 2) for i in range(12)] + [(None, None, i % 2) for i in range(12)]))
    assert (loose["grad-norm spike"]["warned"], loose["grad-norm spike"]["loose"]) == (0, 6)
    # a spike on the healthy runs as often as on the collapsing: at <= 10% false alarms it warns nothing
    same = detectors.bench(as_runs([(40, 15, i % 2) for i in range(12)] + [(None, 15, i % 2) for i in range(12)]))
    assert not same["grad-norm spike"]["warns"]


def test_signal_series_against_hand_arithmetic():
    rows = [{"step": s, "entropy": h, "reward_mean": r} for s, h, r in
            [(1, 0.4, 1.0), (2, 0.2, 1.0), (3, 0.1, 0.0)]]
    fall = detectors.entropy_fall(rows)
    assert fall[0] == (1, 0.0) and math.isclose(fall[1][1], 1 - 0.3 / 0.4) and math.isclose(fall[2][1], 1 - (0.7 / 3) / 0.4)
    assert detectors.SIGNALS["entropy low (report 002)"][0](rows) == [(1, -0.4), (2, -0.2), (3, -0.1)]
    flat = [{"step": s, "reward_mean": 1.0} for s in range(1, 12)] + [{"step": 12, "reward_mean": 0.0}]
    swing = detectors.SIGNALS["reward swing (report 002)"][0](flat)
    assert swing == [(11, 0.0), (12, 1.0)]                   # from the step with 10 before it on
    fallen = detectors.reward_fall(flat)
    assert fallen[-1] == (12, 1.0 - 0.8)                    # 10 updates at 1.0, then the 5-step mean 0.8


def test_bench_reads_kept_runs_and_records_its_verdict(tmp_path):
    for i in range(16):
        collapse = i < 8
        run = tmp_path / "some_experiment" / "runs" / ("sick" if collapse else "well") / f"s{i}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"task": "dsl", **({"rollback": 0} if i % 2 else {})}))
        rows = run_rows(40 if collapse else None, 15 if collapse else None)
        (run / "metrics.jsonl.gz").write_bytes(gzip.compress("\n".join(map(json.dumps, rows)).encode()))
    for task, rollback in (("tools", 0), ("dsl", 3)):       # the tool task, and runs with --rollback, are left out
        left_out = tmp_path / f"{task}_{rollback}" / "runs" / "x" / "s0"
        left_out.mkdir(parents=True)
        (left_out / "config.json").write_text(json.dumps({"task": task, "rollback": rollback}))
        (left_out / "metrics.jsonl").write_text("\n".join(map(json.dumps, run_rows(40, 15))) + "\n")
    entry = detectors.detectors(Lab(tmp_path, quick=False))
    assert entry["verdict"].startswith("reproduced for toy: ") and "grad-norm spike" in entry["verdict"]
    table = (tmp_path / "detectors" / "table.md").read_text()
    assert "16 runs, 8 collapsed (0 at their first evaluation" in table and "| grad-norm spike |" in table
    assert (tmp_path / "detectors" / "detectors.png").stat().st_size > 0
    # four runs a half cannot decide anything at alpha 0.05: inconclusive, not "not reproduced"
    few = [r for r in detectors.read_runs(tmp_path, real=False) if r["path"].name in ("s0", "s1", "s8", "s9")]
    assert not detectors.could_decide(few)


def test_rollbacks_verdict_is_its_fisher_test(tmp_path, monkeypatch):
    def run(fails, rollbacks=0):
        return dict(eval_one_answer_end=0.1, eval_valid_rate_end=0.2 if fails else 0.95,
                    eval_best_rate_end=0.0 if fails else 0.9, ended_off_format=fails, seconds=10.0,
                    **({"rollbacks": [{}] * rollbacks} if rollbacks else {}))
    lab = Lab(tmp_path, quick=False)
    none = [run(True) for _ in range(20)]
    registered = f"reproduced (its registered test: Fisher one-sided, p = {stats.p_value(stats.fisher(20, 20, 8, 20))})"
    for back, verdict in (([run(i < 8, 2) for i in range(20)], registered),                 # 8/20 against 20/20
                          ([run(i < 18, 3) for i in range(20)], "inconclusive"),            # 18/20: p = 0.24
                          ([run(True, 3) for _ in range(20)], "not reproduced: its runs failed as often")):
        monkeypatch.setattr(lab, "sweep", lambda *a, **k: {"--rollback 0": none, "--rollback 3": back})
        entry = detectors.rollback(lab)
        failing = sum(detectors.failed(r) for r in back)
        assert entry["verdict"] == verdict
        assert f"with --rollback 3 {failing}/20 (Fisher one-sided p = {stats.fisher(20, 20, failing, 20):.2g}" \
            in entry["measured"]
    assert stats.fisher(20, 20, 8, 20) < 0.05 < stats.fisher(20, 20, 18, 20)


def test_replaying_report_002s_thresholds_gives_the_alerts_the_runs_logged():
    """Every committed run logged its alerts under report 002's thresholds (the monitor's defaults
    then); monitor.replay recomputes them from the logged curves, so the lab reads report 002's
    alarms whatever the defaults are now."""
    from pathlib import Path
    import monitor
    from running import report
    results = Path(__file__).resolve().parent.parent / "results"
    runs = [results / "trust_regions_stale" / "runs" / "k_8_norm_global_rollout-stale_4_rollout-correction_bypass" / "s100",
            results / "kl_regime" / "baseline" / "runs" / "k_8_norm_global_steps_150_save-every_150" / "s0",
            results / "smollm2-135m" / "real_group_size" / "runs" / "K=8,_B=3" / "s0"]
    for run in runs:
        rows = report.read_metrics(run)[1:]
        assert monitor.replay(rows) == [r["alerts"] for r in rows], run
        assert any(r["alerts"] for r in rows)


def test_the_fixed_alarm_counts_against_a_naive_reading_of_each_runs_curves():
    """alarm_counts replays the monitor at report 002's thresholds and at its defaults; the reference
    here reads each alarm off the rows by its definition: entropy below the floor, KL above the
    ceiling, the range of the last 10 mean rewards above its ceiling, the first step it holds."""
    import monitor
    rng = random.Random(5)

    def made(collapse_at):
        rows = run_rows(collapse_at)
        for x in rows[1:]:
            x["entropy"] = rng.choice([0.3, 0.004, 0.6])
            x["reward_mean"] = rng.choice([0.0, 0.1, 1.0, 3.0]) if rng.random() < 0.3 else 0.5
            if collapse_at == 50:
                x["kl"] = rng.choice([0.1, 0.7, 5.0])
        return rows

    def first(updates, name, t):
        for i, x in enumerate(updates):
            window = [y["reward_mean"] for y in updates[max(0, i - 9):i + 1]]
            if {"entropy_low": x["entropy"] < t["min_entropy"],
                "kl_high": x.get("kl") is not None and x["kl"] > t["max_kl"],
                "reward_swing": len(window) == 10 and max(window) - min(window) > t["max_reward_range"]}[name]:
                return x["step"]
        return None

    runs, expected = [], {}
    defaults = {"min_entropy": 0.005, "max_kl": 4.0, "max_reward_range": 2.0}
    assert monitor.StabilityMonitor().__dict__.items() >= defaults.items()
    for i, collapse_at in enumerate([None, None, 40, 50, None, 30, 50, None]):
        rows = made(collapse_at)
        updates = [x for x in rows if x["step"] > 0]
        run = dict(**detectors.outcome(rows, real=False), alarms=detectors.first_alarms(updates))
        runs.append(run)
        for label, t in (("report 002's", monitor.REPORT_002), ("the monitor's defaults", defaults)):
            for name in ("entropy_low", "kl_high", "reward_swing"):
                if name == "kl_high" and collapse_at != 50:
                    assert name not in run["alarms"][label]          # no KL logged: not counted at all
                    continue
                step = first(updates, name, t)
                assert run["alarms"][label][name] == step
                c = expected.setdefault((label, name), [0, 0, 0, 0])
                if run["kind"] == "healthy":
                    c[0] += step is not None
                    c[1] += 1
                elif run["kind"] == "collapsed" and run["last_healthy"] not in (None, 0):
                    c[2] += step is not None and step <= run["last_healthy"]
                    c[3] += 1
    got = detectors.alarm_counts(runs)
    assert {(label, name): list(v) for label, d in got.items() for name, v in d.items()} == expected
    assert expected[("report 002's", "entropy_low")][0] == 4         # 0.3 < 0.5 somewhere on every healthy run
