"""The lab end to end in --quick mode (2 seeds, a few steps): every experiment runs, draws its
figure and gets a verdict computed from its numbers; and bench.py measures a step."""
import json

import bench
import lab


def test_quick_lab_runs_every_experiment_and_writes_the_summary(tmp_path):
    lab.main(["--quick", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == list(lab.EXPERIMENTS)
    text = (tmp_path / "SUMMARY.md").read_text()
    for name, r in summary.items():
        assert f"## {name}" in text and r["verdict"] and r["measured"]
        if r["figure"]:
            assert (tmp_path / r["figure"]).is_file(), r["figure"]
    assert summary["k2_pm1"]["verdict"] == "reproduced"          # arithmetic, not noise
    runs = list((tmp_path / "group_norm" / "runs").glob("*/s1/metrics.jsonl"))
    assert len(runs) == 13


def test_bench_measures_a_step_of_ours(tmp_path):
    bench.main(["--steps", "3", "--warmup", "1", "--json", str(tmp_path / "b.json")])
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["ours_s_per_step"] > 0 and r["ours_peak_mb"] > 0 and r["ours_tokens_per_s"] > 0
    assert set(r["ours_split"]) >= {"generate", "reference", "policy_fwd_bwd", "optimizer", "reward"}
    assert r["config"]["name"] == "tiny" and r["config"]["fast"]
