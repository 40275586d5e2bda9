"""lab/real.py's bookkeeping, on the tiny model: every finished (experiment, setting, seed)
run is kept and skipped when the lab runs again; one cut short (kill -9: no summary; Ctrl-C:
an interrupted one) runs again from its beginning; a run whose flags changed runs again; the
estimate counts only the runs left. (The experiments themselves run on SmolLM2: results/smollm2-135m.)"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import compare
from lab import real
from lab import stats

ROOT = Path(__file__).resolve().parent.parent

TINY = "--eval-every 2 --eval-samples 1 --sft-steps 30 --hidden 16 --layers 1"


@pytest.fixture
def lab(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "COMMON", TINY)
    monkeypatch.setattr(real, "ALONE", False)        # this process (the real lab: one per run, below)
    monkeypatch.setattr(real, "SETTINGS", {"real_group_size": {
        "K=2, B=3": "--k 2 --batch 3 --steps 3", "K=8, B=3": "--k 8 --batch 3 --steps 3",
        "K=8, B=3, entropy bonus 0.01": "--k 8 --batch 3 --steps 3 --entropy-coef 0.01"}})
    calls = []
    run_one = compare.run_one
    monkeypatch.setattr(compare, "run_one", lambda argv, launch: calls.append(argv) or run_one(argv, launch))
    lab = real.RealLab(tmp_path, model="", seeds=2)
    lab.calls = calls
    return lab


@pytest.mark.slow          # 10-30 s on a 2-core CPU: the slow tier, so CI fits in 12 minutes
def test_finished_runs_are_kept_and_a_run_cut_short_starts_again(lab):
    """Cut short: killed before its summary, stopped by Ctrl-C, or stopped by a full disk (a
    run stopped by its training, --max-skips, is a result and is kept)."""
    every = [real.flags(lab.argv("real_group_size", label, seed)) for label in real.SETTINGS["real_group_size"]
             for seed in (0, 1)]
    assert real.estimate(lab, ["real_group_size"]) == (6, pytest.approx(
        sum(map(real.modelled, every)) + real.WARM_START_SECONDS["dsl"])), "no run finished: COST's model of each"
    first = real.real_group_size(lab, log=lambda s: None)
    assert len(lab.calls) == 6 and first["verdict"]
    assert (lab.root / "real_group_size" / "table.md").is_file()
    assert real.estimate(lab, ["real_group_size"])[0] == 0

    lab.calls.clear()
    real.real_group_size(lab, log=lambda s: None)
    assert lab.calls == [], "a second lab reruns nothing"

    killed = lab.out("real_group_size", "K=8, B=3", 1)
    (killed / "summary.json").unlink()                       # kill -9: the summary never written
    stopped = lab.out("real_group_size", "K=2, B=3", 0)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps(dict(summary, interrupted="SIGINT")))   # Ctrl-C
    full = lab.out("real_group_size", "K=8, B=3, entropy bonus 0.01", 1)      # the disk filled: stopped at a save
    summary = json.loads((full / "summary.json").read_text())
    (full / "summary.json").write_text(json.dumps(dict(summary, stopped="the disk is full: ...", failed_saves=2)))
    assert real.estimate(lab, ["real_group_size"])[0] == 3
    seconds = [json.loads((lab.out("real_group_size", label, seed) / "summary.json").read_text())["seconds"]
               for label, seed in (("K=8, B=3", 0), ("K=2, B=3", 1), ("K=8, B=3, entropy bonus 0.01", 0))]
    assert real.estimate(lab, ["real_group_size"])[1] == pytest.approx(sum(seconds) + real.WARM_START_SECONDS["dsl"]), \
        "each run left takes its setting's finished run's seconds, and a warm start"
    again = real.real_group_size(lab, log=lambda s: None)
    assert sorted(a[a.index("--out") + 1] for a in lab.calls) == sorted([str(killed), str(stopped), str(full)])
    assert all("--overwrite" in a for a in lab.calls)
    assert not list(full.parent.glob("*.other-flags-*")), "run again in place, not kept aside as another setting's"
    assert again["measured"] == first["measured"], "the same runs, the same numbers"


def test_a_run_made_before_a_flag_existed_is_kept_when_that_flag_is_at_its_default(lab):
    """A flag added to train.py after a run finished is missing from its config.json: the run
    used that flag's default, so it is kept (the real-model lab outlives the code's changes)."""
    lab.run("real_group_size", "K=2, B=3", 0, log=lambda s: None)
    path = lab.out("real_group_size", "K=2, B=3", 0) / "config.json"
    saved = json.loads(path.read_text())
    del saved["policy_loss"], saved["top_entropy_quantile"]
    path.write_text(json.dumps(saved))
    assert real.finished(lab.argv("real_group_size", "K=2, B=3", 0)) is not None


def test_a_run_whose_config_names_its_folder_by_another_path_is_kept(lab):
    """A lab run from another checkout, or with an absolute --out, saves its folder under another
    name; the folder is the one the lab reads it from, so the run is the same and is kept."""
    lab.run("real_group_size", "K=2, B=3", 0, log=lambda s: None)
    path = lab.out("real_group_size", "K=2, B=3", 0) / "config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(dict(saved, out="/elsewhere/" + saved["out"])))
    assert real.finished(lab.argv("real_group_size", "K=2, B=3", 0)) is not None
    path.write_text(json.dumps(dict(saved, k=8)))
    assert real.finished(lab.argv("real_group_size", "K=2, B=3", 0)) is None, "another flag still makes it another run"


def test_a_setting_whose_flags_changed_runs_again(lab, monkeypatch):
    lab.run("real_group_size", "K=2, B=3", 0, log=lambda s: None)
    lab.calls.clear()
    lab.run("real_group_size", "K=2, B=3", 0, log=lambda s: None)
    assert lab.calls == []
    monkeypatch.setitem(real.SETTINGS["real_group_size"], "K=2, B=3", "--k 2 --batch 3 --steps 4")
    assert real.finished(lab.argv("real_group_size", "K=2, B=3", 0)) is None
    lab.run("real_group_size", "K=2, B=3", 0, log=lambda s: None)
    assert len(lab.calls) == 1
    aside = list(lab.out("real_group_size", "K=2, B=3", 0).parent.glob("s0.other-flags-*"))
    assert len(aside) == 1 and (aside[0] / "summary.json").is_file(), "the older run kept aside, not overwritten"


def processes_naming(text: str) -> list:
    """Pids of the live processes whose command line contains text (Linux's /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow                  # a multi-process fault test, 20-35 s: the slow tier (README)
@pytest.mark.skipif(sys.platform != "linux", reason="the child is told to die with its parent by Linux's prctl")
def test_a_run_in_a_process_of_its_own_matches_this_process_and_dies_with_the_lab(tmp_path):
    """The real-model lab starts each run as a new process (compare.Launch(alone=True)): its
    memory is freed when it ends and its peak is its own. It trains as a run in this process
    does, and a lab killed with kill -9 takes its run with it (nothing left writing into a
    folder the next lab will start again)."""
    argv = f"{TINY} --k 2 --batch 2 --steps 2".split()
    here = compare.run_one(argv + ["--out", str(tmp_path / "here")], compare.Launch())
    alone = compare.run_one(argv + ["--out", str(tmp_path / "alone")], compare.Launch(alone=True))
    lines = lambda run: [{k: v for k, v in json.loads(x).items() if k != "seconds"}
                         for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert alone["steps"] == here["steps"] == 2 and lines("alone") == lines("here")

    out = tmp_path / "long"
    lab = subprocess.Popen([sys.executable, "-c", "import sys; from lab import compare; compare.run_one("
                            f"{(argv + ['--steps', '100000', '--quiet', '--out', str(out)])!r}, compare.Launch(alone=True))"],
                           cwd=Path(compare.__file__).parent.parent)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.5)
    child = [pid for pid in processes_naming(str(out)) if pid != lab.pid]
    assert child, "the run started in a process of its own"
    os.kill(lab.pid, 9)
    lab.wait()
    deadline = time.time() + 30
    while processes_naming(str(out)) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_naming(str(out)) == [], "the run died with the lab"


def test_every_committed_smollm2_run_is_kept_by_todays_lab(monkeypatch):
    """A flag that changes where a run works, not what it computes (the warm-start cache's
    folder, threads: config.NOT_IN_RESULTS), once made the lab take every committed run for one
    of other flags, move it aside and start 1.8 hours of runs again."""
    monkeypatch.chdir(ROOT)                     # as `python -m lab --model smollm2-135m` runs
    committed = real.RealLab(Path("results/smollm2-135m"), "smollm2-135m")
    done = json.loads(Path("results/smollm2-135m/summary.json").read_text())     # experiments with a verdict
    assert real.estimate(committed, [name for name in real.SETTINGS if name in done]) == (0, 0.0)


def rollback_verdict(ended: int, n: int, back: int, m: int) -> str:
    """real_rollback's registered rule by hand: Fisher's p of back of m against ended of n; when even 0
    of m could not reach 0.05, inconclusive, its letter beside."""
    p, best = stats.fisher(ended, n, back, m), stats.fisher(ended, n, 0, m)
    letter = "not reproduced: as many ended on one answer" if back / m >= ended / n else "inconclusive"
    return (f"reproduced (its registered test: Fisher one-sided, p = {stats.p_value(p)})" if p < 0.05 else letter
            if best < 0.05 else f"inconclusive: with {ended}/{n} without, even 0/{m} with would give p = "
            f"{stats.p_value(best)}, so the test could decide nothing (the registered rule's letter: {letter.split(':')[0]})")


@pytest.mark.slow          # 10-30 s on a 2-core CPU: the slow tier, so CI fits in 12 minutes
def test_the_powered_experiments_read_their_registered_tests_from_their_runs(lab, monkeypatch):
    """real_k_fair's verdict is the one-sided permutation test of its runs' held-out best at the
    end (K=8 above K=2), real_entropy_held's Fisher's test of runs ending on one answer against
    real_k_fair's K=8 runs (the same runs, not run twice), each recomputed here from the runs'
    summary.json; their seeds are their own (POWERED), not the lab's."""
    monkeypatch.setattr(real, "SETTINGS", {"real_k_fair": {"K=2, B=12": "--k 2 --batch 12 --steps 3",
                                                           "K=8, B=3": "--k 8 --batch 3 --steps 3"},
                                           "real_entropy_held": {"adaptive entropy": "--k 8 --batch 3 --steps 3 "
                                                                                     "--entropy-target 0.2"},
                                           "real_lora": {"LoRA r=1": "--k 8 --batch 3 --steps 3 --lora-rank 1 "
                                                                     "--lr 2e-2"},
                                           "real_rollback": {"K=8, B=3, --rollback 3": "--k 8 --batch 3 --steps 3 "
                                                             "--eval-every 1 --rollback 3 --lr 2e-2"},
                                           "real_lora_k2": {"K=2, B=3": "--k 2 --batch 3 --steps 3",
                                                            "LoRA r=1": "--k 2 --batch 3 --steps 3 --lora-rank 1 "
                                                                        "--lr 2e-2"},
                                           "real_rollback_epochs": {
                                               "K=8, B=3, two epochs": "--k 8 --batch 3 --steps 3 --epochs 2",
                                               "K=8, B=3, two epochs, --rollback 3": "--k 8 --batch 3 --steps 3 --epochs 2 "
                                               "--eval-every 1 --rollback 3 --lr 2e-2 --keep-checkpoints 1"}})
    monkeypatch.setattr(real, "POWERED", {"real_k_fair": 3, "real_entropy_held": 3, "real_lora": 3, "real_rollback": 3,
                                          "real_lora_k2": 3, "real_rollback_epochs": 2})
    names = ["real_k_fair", "real_entropy_held", "real_lora", "real_rollback"]
    assert lab.seeds == 2 and real.estimate(lab, names)[0] == 15
    fair = real.real_k_fair(lab, log=lambda s: None)
    held = real.real_entropy_held(lab, log=lambda s: None)
    lora = real.real_lora(lab, log=lambda s: None)
    back = real.real_rollback(lab, log=lambda s: None)
    assert len(lab.calls) == 15                                   # the K=8 runs served all four
    end = {label: [json.loads((lab.out(name, label, s) / "summary.json").read_text()) for s in range(3)]
           for name, label in (("real_k_fair", "K=2, B=12"), ("real_k_fair", "K=8, B=3"),
                               ("real_entropy_held", "adaptive entropy"))}
    best = {label: [r["eval_best_rate_end"] for r in rs] for label, rs in end.items()}
    p = stats.permutation(best["K=8, B=3"], best["K=2, B=12"])
    assert f"one-sided permutation p = {p:.3f} over 3 seeds an arm" in fair["measured"]
    assert fair["verdict"] == ("reproduced" if p < 0.05 else "inconclusive")
    one = {label: sum(r["eval_one_answer_end"] >= real.COLLAPSED for r in rs) for label, rs in end.items()}
    q = stats.fisher(one["K=8, B=3"], 3, one["adaptive entropy"], 3)
    assert f"one-sided Fisher p = {q:.3f}" in held["measured"]
    assert held["verdict"] == ("reproduced" if q < 0.05 else "inconclusive")
    adapters = [json.loads((lab.out("real_lora", "LoRA r=1", s) / "summary.json").read_text())["eval_one_answer_end"]
                for s in range(3)]
    two = stats.two_sided(adapters, [r["eval_one_answer_end"] for r in end["K=8, B=3"]])
    assert f"two-sided permutation p = {two:.3f})" in lora["measured"]
    assert lora["verdict"] == f"LoRA r=1: {'reproduced' if two < 0.025 else 'inconclusive'}"
    rolled = [json.loads((lab.out("real_rollback", "K=8, B=3, --rollback 3", s) / "summary.json").read_text())
              for s in range(3)]
    ones = sum(r["eval_one_answer_end"] >= real.COLLAPSED for r in rolled)
    f = stats.fisher(one["K=8, B=3"], 3, ones, 3)
    assert f"with --rollback 3 {ones}/3, one-sided Fisher p = {f:.3f}" in back["measured"]
    assert back["verdict"] == rollback_verdict(one["K=8, B=3"], 3, ones, 3)
    k2 = real.real_lora_k2(lab, log=lambda s: None)                 # its own full-fine-tuning arm
    assert len(lab.calls) == 21
    ends = {label: [json.loads((lab.out("real_lora_k2", label, s) / "summary.json").read_text())["eval_one_answer_end"]
                    for s in range(3)] for label in ("K=2, B=3", "LoRA r=1")}
    two = stats.two_sided(ends["LoRA r=1"], ends["K=2, B=3"])
    assert f"two-sided permutation p = {two:.3f})" in k2["measured"] and "K=2/B=3, against full" in k2["claim"]
    assert k2["verdict"] == f"LoRA r=1: {'reproduced' if two < 0.025 else 'inconclusive'}"
    epochs = real.real_rollback_epochs(lab, log=lambda s: None)    # its own arm without rollback
    assert len(lab.calls) == 25
    ended = {label: sum(json.loads((lab.out("real_rollback_epochs", label, s) / "summary.json").read_text())
                        ["eval_one_answer_end"] >= real.COLLAPSED for s in range(2))
             for label in real.SETTINGS["real_rollback_epochs"]}
    none, back = ended.values()
    e = stats.fisher(none, 2, back, 2)
    assert f"runs ending on one answer: K=8, B=3, two epochs {none}/2, with --rollback 3 {back}/2, one-sided " \
           f"Fisher p = {e:.3f}" in epochs["measured"] and "(K=8, B=3, two epochs)" in epochs["claim"]
    assert epochs["verdict"] == rollback_verdict(none, 2, back, 2)
    assert epochs["figure"] == "real_rollback_epochs/compare.png" and (lab.root / epochs["figure"]).exists()


def test_a_baseline_too_low_to_beat_leaves_the_rollback_verdict_inconclusive():
    """With 3 of 10 baseline runs on one answer, even 0 of 10 with --rollback gives Fisher's
    one-sided p = C(10,3) / C(20,3) = 120/1140 = 0.105: no outcome could reproduce the claim, so
    4/10 against 3/10 is not a "not reproduced" but undecided; with 7/10, 1/10 decides."""
    from lab import real
    assert 120 / 1140 == pytest.approx(0.10526, abs=1e-5)
    said = real.undecidable(3, 10, 10, "not reproduced: as many ended on one answer")
    assert said.startswith("inconclusive") and "p = 0.105" in said and "letter: not reproduced" in said
    assert real.undecidable(7, 10, 10, "inconclusive") == "inconclusive"          # 0/10 against 7/10: p = 0.0015
