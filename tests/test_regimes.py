"""lab/regimes.py: an experiment as a registered record, run by one runner."""
import dataclasses
import itertools
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from lab import real, regimes
from lab import main as lab


class FakeLab(real.RealLab):
    """A lab whose runs are made up (each arm's values given), with no train.py run."""

    def __init__(self, root, values):
        super().__init__(root, model="")
        self.values, self.asked = values, []
        self.ran_on = lambda label, seed: "cpu (1 thread)"

    def run(self, name, label, seed, log=print):
        self.asked.append((label, seed))
        valid, crash = self.values[label][seed - 100]
        (self.root / label / str(seed)).mkdir(parents=True, exist_ok=True)
        (self.root / label / str(seed) / "config.json").write_text(json.dumps({"ran_on": self.ran_on(label, seed)}))
        return dict(eval_valid_rate_end=valid, eval_fallback_rate_end=1 - valid, crash_rate=crash, crash_floor=0.1,
                    out=str(self.root / label / str(seed)), seconds=1.0)


def record(**changes):
    return dataclasses.replace(regimes.RECORDS["real_001_regime_pilot"], name="fake", arms={"a": "--k 2", "b": "--k 8"}, **changes)


def test_a_record_tests_each_claim_by_a_permutation_over_its_own_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "write_table", lambda *a: None)
    monkeypatch.setattr(real, "at_warm_start", lambda runs: "warm start")
    values = {"a": [(0.1, 0.5), (0.2, 0.6), (0.3, 0.4)], "b": [(0.7, 0.1), (0.8, 0.2), (0.9, 0.1)]}
    fake = FakeLab(tmp_path, values)
    rec = record(tests=(("eval_valid_rate_end", "a", "below", "b"), ("crash_above_floor", "a", "above", "b")),
                 seeds=range(100, 103))
    entry = regimes.measure(rec, fake, log=lambda *a: None)
    assert sorted(fake.asked) == sorted(itertools.product("ab", range(100, 103)))
    # a naive permutation test: every split of the 6 runs into 3 + 3, the share at least as extreme
    a, b = [v for v, _ in values["a"]], [v for v, _ in values["b"]]
    splits = list(itertools.combinations(a + b, 3))
    naive = sum(statistics.fmean(s) <= statistics.fmean(a) + 1e-12 for s in splits) / len(splits)
    assert naive == 0.05 and "a below b, one-sided permutation p = 0.050" in entry["measured"]
    assert entry["verdict"] == ("eval_valid_rate_end: a below b: inconclusive; "    # 0.05 is not below 0.05
                                "crash_above_floor: a above b: inconclusive")
    assert "crash_above_floor: a 0.40 ± 0.08" in entry["measured"]                  # 0.5 0.6 0.4 minus the floor


def test_a_record_is_registered_before_its_first_run_and_a_changed_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "write_table", lambda *a: None)
    monkeypatch.setattr(real, "at_warm_start", lambda runs: "")
    fake = FakeLab(tmp_path, {"a": [(0.5, 0.1)] * 2, "b": [(0.5, 0.1)] * 2})
    seen = []
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"ran_on": "cpu (1 thread)"}))
    monkeypatch.setattr(fake, "run", lambda *a, **k: seen.append((tmp_path / "fake" / "registration.json").exists())
                        or dict(eval_valid_rate_end=0.5, crash_rate=0.1, crash_floor=0.1, out=str(tmp_path / "run")))
    assert regimes.measure(record(), fake)["verdict"] == "a pilot (no verdict)"
    assert seen and all(seen)                                  # the registration was there before the first run
    regimes.measure(record(), fake)                            # the same record runs again
    with pytest.raises(SystemExit, match="changed since its registration"):
        regimes.measure(record(alpha=0.1), fake)


@pytest.mark.parametrize("jobs", [1, 2])
def test_jobs_registers_a_record_before_the_first_of_its_runs_starts(tmp_path, monkeypatch, jobs):
    """The lab runs the pending runs (arms seed by seed, so a session cut short leaves them alike) before the
    record's own measure, at any --jobs: the registration comes first anyway."""
    monkeypatch.setitem(regimes.RECORDS, "fake", record())
    seen = []

    def pending(real_lab, names, log=print):
        seen.append((tmp_path / "fake" / "registration.json").exists())
        raise KeyboardInterrupt
    monkeypatch.setattr(real, "run_pending", pending)
    monkeypatch.setattr(real, "estimate", lambda *a: (4, 60.0))
    args = type("Args", (), dict(model="", jobs=jobs, names=["fake"]))
    with pytest.raises(KeyboardInterrupt):
        lab.real_lab(args, tmp_path)
    assert seen == [True]
    assert json.loads((tmp_path / "fake" / "registration.json").read_text())["sha256"] == \
        regimes.registration(record())["sha256"]


def test_the_labs_rule_of_a_record_hashes_the_whole_record_and_its_deciding_code():
    a = lab.rule_of(regimes.experiment(record()))
    b = lab.rule_of(regimes.experiment(record(power="another pilot")))
    assert a["sha256"] != b["sha256"] and a["code_sha256"] == b["code_sha256"] and "power=" in a["text"]
    assert lab.REAL["real_001_regime_pilot"].record is regimes.RECORDS["real_001_regime_pilot"]


def test_a_records_entry_is_dated_by_its_registration_not_by_the_day_its_entry_is_written(tmp_path):
    """A record registered one day and measured on a later one: SUMMARY's "registered" is the first day,
    whether the entry is new or an older entry (dated the later day) stands before it."""
    regimes.register(record(), tmp_path / "fake")
    path = tmp_path / "fake" / "registration.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), registered="2026-01-01")))
    rule = lab.rule_of(regimes.experiment(record()), tmp_path / "fake")
    entry = dict(date="2026-03-01", rule=rule)
    assert lab.registered(entry, {})["rule"]["registered"] == "2026-01-01"
    old = dict(rule=dict(rule, registered="2026-02-01"))                    # written by the earlier code
    assert lab.registered(entry, old)["rule"]["registered"] == "2026-01-01"


def test_a_records_registration_is_the_same_in_another_process():
    """The hashes name the record and its code, not this process (no object address may enter them)."""
    here = lab.rule_of(lab.REAL["real_001_regime_pilot"])
    there = subprocess.run([sys.executable, "-c", "from lab import main; r = main.rule_of(main.REAL['real_001_regime_pilot']); "
                            "print(r['sha256'], r['code_sha256'])"], capture_output=True, text=True, check=True)
    assert there.stdout.split() == [here["sha256"], here["code_sha256"]]
    registered = Path(__file__).parent.parent / "results/smollm2-135m/real_001_regime_pilot/registration.json"
    assert here["sha256"] == json.loads(registered.read_text())["sha256"]      # the record as it was registered


def test_off_format_end_is_a_rate_whose_permutation_test_is_fishers_exact_test():
    """A 0/1 a run (held-out valid share below OFF_FORMAT at the end): the one-sided permutation p of
    the difference of means equals Fisher's one-sided p of the counts (lab.stats.fisher)."""
    from lab import stats
    a = [regimes.value({"eval_valid_rate_end": v}, "off_format_end") for v in (0.1, 0.2, 0.9, 0.05, 0.6, 0.24)]
    b = [regimes.value({"eval_valid_rate_end": v}, "off_format_end") for v in (0.9, 0.97, 0.3, 0.25, 1.0, 0.1)]
    assert a == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0] and sum(b) == 1.0                   # 0.25 itself is on the format
    assert regimes.one_sided("above", a, b) == pytest.approx(stats.fisher(4, 6, 1, 6), abs=1e-12)


def test_jobs_runs_every_pending_run_once_longest_first_one_cost_seed_by_seed_a_warm_start_once_a_failure_survived(
        tmp_path, monkeypatch):
    settings = {"a": "--k 2 --batch 3 --steps 30", "b": "--k 8 --batch 3 --steps 90", "c": "--task tools --k 2 --batch 1 --steps 2",
                "second stage": "--steps 30 --init-from {stage1}", "a, another lr": "--k 2 --batch 3 --steps 30 --lr 1e-3"}
    monkeypatch.setitem(real.SETTINGS, "fake", settings)
    monkeypatch.setitem(real.SEED_RANGES, "fake", range(100, 102))
    warmed, ran, said = [], [], []
    monkeypatch.setattr(real, "warm_up", lambda argv, log: warmed.append(real.warm_key(argv)))

    class Lab(real.RealLab):
        def run(self, name, label, seed, log=print):
            ran.append((label, seed))
            if (label, seed) == ("a", 101):
                raise RuntimeError("train.py exited 1: out of memory")
    real.run_pending(Lab(tmp_path, model="", jobs=1), ["fake"], said.append)
    # the naive plan: every (label, seed), ordered by the modelled seconds, longest first, and among runs of one
    # cost by seed (the second stage among them: its run makes its start first, here RCE (stage 1), which
    # names no setting of fake)
    plan = sorted([(label, seed) for label in settings for seed in (100, 101)],
                  key=lambda r: (-real.modelled(real.flags(Lab(tmp_path, "").argv("fake", *r))), r[1]))
    assert ran == plan and ran[0][0] == "b"
    assert ran.index(("a, another lr", 100)) < ran.index(("a", 101)), "two arms of one cost: seed by seed"
    assert sorted(warmed) == [("", "dsl", -1, 1), ("", "tools", -1, 1)]
    assert any("a, seed 101 failed: train.py exited 1: out of memory" in line for line in said)


def test_a_record_whose_runs_ran_on_two_devices_gets_no_verdict(tmp_path, monkeypatch):
    """A GPU run samples with CUDA's random numbers under bf16: the 001 pilot's warm start measured
    valid 0.81 / fallback 0.16 there against 0.50 / 0.41 on the CPU. Arms split across devices are no comparison."""
    monkeypatch.setattr(real, "write_table", lambda *a: None)
    monkeypatch.setattr(real, "at_warm_start", lambda runs: "warm start")
    values = {"a": [(0.1, 0.5), (0.2, 0.6), (0.3, 0.4), (0.2, 0.5)], "b": [(0.7, 0.1), (0.8, 0.2), (0.9, 0.1), (0.8, 0.1)]}
    rec = record(tests=(("eval_valid_rate_end", "a", "below", "b"),), seeds=range(100, 104))
    one = regimes.measure(rec, FakeLab(tmp_path / "one", values), log=lambda s: None)
    assert one["verdict"] == "eval_valid_rate_end: a below b: reproduced" and "on cpu:" in one["measured"]
    mixed = FakeLab(tmp_path / "mixed", values)
    mixed.ran_on = lambda label, seed: "cuda (NVIDIA H200)" if label == "b" else "cpu (2 threads)"
    two = regimes.measure(rec, mixed, log=lambda s: None)
    assert two["verdict"] == "no verdict: its runs ran on cpu and cuda, not one device"
    assert "permutation" not in two["measured"]


def test_jobs_starts_no_run_after_one_was_stopped_by_ctrl_c(tmp_path, monkeypatch):
    monkeypatch.setitem(real.SETTINGS, "fake", {"a": "--steps 30", "b": "--steps 20", "c": "--steps 10"})
    monkeypatch.setitem(real.SEED_RANGES, "fake", range(100, 101))
    monkeypatch.setattr(real, "warm_up", lambda argv, log: None)
    ran = []

    class Lab(real.RealLab):
        def run(self, name, label, seed, log=print):
            ran.append(label)
            if label == "b":
                raise KeyboardInterrupt("SIGINT")
    with pytest.raises(KeyboardInterrupt):
        real.run_pending(Lab(tmp_path, model="", jobs=1), ["fake"], lambda s: None)
    assert ran == ["a", "b"], "c was queued behind the stopped run and never started"


def test_a_shared_start_is_made_once_before_the_runs_naming_it_and_runs_from_other_weights_are_set_aside(
        tmp_path, monkeypatch):
    """{real_NAME} in an arm's flags: experiment NAME's first arm at its first seed, made (tiny train.py
    runs) by the first run that needs it while the others wait; a kept run pinned to other weights
    (a start made again in another session, whose weights were not committed) is renamed, then run again."""
    monkeypatch.setitem(real.SETTINGS, "real_fake_start", {"base": "--k 2 --batch 2 --steps 2 --save-every 2"})
    monkeypatch.setitem(real.SEED_RANGES, "real_fake_start", range(7, 8))
    monkeypatch.setitem(real.SETTINGS, "real_fake", {a: f"--k 2 --batch 2 --steps 1 --init-from {{real_fake_start}} --lr {lr}"
                                                     for a, lr in (("a", 1e-3), ("b", 1e-2))})
    monkeypatch.setitem(real.SEED_RANGES, "real_fake", range(100, 102))
    monkeypatch.setattr(real, "warm_up", lambda argv, log: None)
    lab_ = real.RealLab(tmp_path, model="", jobs=2)
    old = tmp_path / "real_fake" / "runs" / "a" / "s100"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"init_from_checkpoint": {
        "path": str(lab_.out("real_fake_start", "base", 7) / "checkpoints" / "step-000002"), "sha256": "0ld"}}))
    made, run_one = [], real.compare.run_one
    monkeypatch.setattr(real.compare, "run_one", lambda argv, launch: made.append(argv[argv.index("--out") + 1]) or
                        run_one(argv, launch))
    real.run_pending(lab_, ["real_fake"], lambda s: None)
    start = str(lab_.out("real_fake_start", "base", 7))
    assert made.count(start) == 1 and made[0] == start and len(made) == 5
    sha = real.checkpoint.weights_sha256(Path(start) / "checkpoints" / "step-000002")
    for label in "ab":
        for seed in (100, 101):
            began = json.loads((lab_.out("real_fake", label, seed) / "config.json").read_text())["init_from_checkpoint"]
            assert began["sha256"] == sha and "real_fake_start" in began["path"]
            assert (lab_.out("real_fake", label, seed) / "cpu.txt").read_text() == f"{real.cpu()}\n", "the CPU named"
    assert (old.parent / "s100.other-start-0ld" / "config.json").exists()


def test_a_start_made_again_beside_its_kept_run_leaves_its_files_and_is_taken_only_with_its_numbers(
        tmp_path, monkeypatch):
    """A start's weights are not committed: a later session makes it again beside its kept run, whose
    files stay byte for byte, and takes its checkpoint when it ends with the kept run's numbers (this
    CPU, the same flags); when they differ (another CPU sums in another order) no checkpoint is taken
    and its experiment's runs wait: they never begin from another start than their kept runs."""
    monkeypatch.setitem(real.SETTINGS, "real_fake_start", {"base": "--k 2 --batch 2 --steps 2 --save-every 2"})
    monkeypatch.setitem(real.SEED_RANGES, "real_fake_start", range(7, 8))
    monkeypatch.setattr(real, "ALONE", False)             # in this process: the tiny model's runs take a second
    lab_, start = real.RealLab(tmp_path, model="", jobs=1), ("real_fake_start", "base", 7)
    out, files = lab_.out(*start), lambda: {p.name: p.read_bytes() for p in lab_.out(*start).iterdir() if p.is_file()}
    lab_.make_start(start)                                # its first run, into its own folder
    sha, kept = real.checkpoint.weights_sha256(real.checkpoint.starting_point(out)), files()
    shutil.rmtree(out / "checkpoints")                    # a new session: the weights are gone, the run's files kept
    lab_.make_start(start)
    assert files() == kept and real.checkpoint.weights_sha256(real.checkpoint.starting_point(out)) == sha
    assert not out.with_name("s7.made-again").exists()
    shutil.rmtree(out / "checkpoints")
    summary = json.loads(kept["summary.json"])
    number = next(k for k, v in summary.items() if isinstance(v, float) and k not in ("seconds", "peak_memory_mb"))
    (out / "summary.json").write_text(json.dumps(dict(summary, **{number: summary[number] + 1e-6})))
    with pytest.raises(RuntimeError, match="other numbers than its kept run"):
        lab_.make_start(start)                            # as if the kept run had been made on another CPU
    assert not (out / "checkpoints").exists() and (out.with_name("s7.made-again") / "summary.json").exists()
