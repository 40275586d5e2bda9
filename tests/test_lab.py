"""The lab end to end in --quick mode (2 seeds, a few steps): every experiment runs, draws its
figure and gets a verdict computed from its numbers; tools/bench.py measures a step, and
tools/decode_floor.py's bare decoding computes what a full forward computes."""
import copy
import gzip
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

import shared_prefix
from tools import bench
from tools import decode_floor
from lab import compare
from lab import main as lab
from lab import stats


@pytest.mark.slow
def test_quick_lab_runs_every_experiment_and_writes_the_summary(tmp_path, capsys):
    lab.main(["--quick", "--out", str(tmp_path)])
    said = [line for line in capsys.readouterr().out.splitlines() if line.split(":")[0] in lab.EXPERIMENTS]
    assert len(said) == len(lab.EXPERIMENTS) and all("QUICK, a smoke test and not a verdict" in x for x in said), said
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == list(lab.EXPERIMENTS)
    text = (tmp_path / "SUMMARY.md").read_text()
    for name, r in summary.items():
        assert f"## {name}" in text and r["verdict"] and r["measured"]
        if r["figure"]:
            assert (tmp_path / r["figure"]).is_file(), r["figure"]
    assert summary["k2_pm1"]["verdict"] == "reproduced"          # arithmetic, not noise
    # each entry is stamped with the seeds it ran (collapse_rate's own range, cut to 2 by --quick), or none
    assert summary["collapse_rate"]["seeds"] == 2 and summary["k2_pm1"]["seeds"] is None
    runs = list((tmp_path / "group_norm" / "runs").glob("*/s1/metrics.jsonl"))
    assert len(runs) == 8          # the moderate-lr settings, one seed-1 run each


def kept_rows(run: dict) -> list:
    """A committed toy run's per-step rows, read by hand from its metrics.jsonl.gz (not through
    running.report, whose reading is what some of these tests check)."""
    text = gzip.decompress((Path(__file__).parent.parent / run["out"] / "metrics.jsonl.gz").read_bytes()).decode()
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.slow          # 10-30 s on a 2-core CPU: the slow tier, so CI fits in 12 minutes
def test_bench_measures_a_step_of_ours(tmp_path):
    bench.main(["--steps", "2", "--warmup", "1", "--json", str(tmp_path / "b.json")])
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["ours_s_per_step"] > 0 and r["ours_peak_mb"] > 0 and r["ours_tokens_per_s"] > 0
    assert set(r["ours_split"]) >= {"generate", "reference", "policy_fwd_bwd", "optimizer", "reward"}
    assert r["config"]["name"] == "tiny" and r["config"]["fast"]


def test_bench_on_a_real_model_asks_the_dsl_tasks_own_prompts():
    """`--model smollm2-135m` broke with a NameError when the prompt's format moved to rollout.py
    (SmolLM2 is not on CI's machine; its prompts are, and the tiny tokenizer formats them)."""
    import rollout
    from tasks import workflow_task
    _, tok = bench.build(bench.CONFIGS["tiny"])
    chosen = bench.prompts(bench.REAL, 3, seed=0, tok=tok)
    texts = {rollout.format_prompt(tok, p["text"], workflow_task.SYSTEM_PROMPT) for p in workflow_task.prompts("train")}
    assert len(chosen) == 3 and set(chosen) <= texts


def test_the_decode_floor_samples_from_the_logits_a_full_forward_gives():
    """The floor's prefill (the shared start once, each prompt's rest once) and bare decode loop
    must be the work sampling does: each step's logits equal those of one plain forward over
    prompt + the tokens sampled so far, with left-padded prompts of two lengths."""
    model, tok = bench.build(bench.CONFIGS["tiny"])
    model.eval()
    start = " ".join(f"w{i}" for i in range(20))                    # shared by both prompts (>= 16 tokens)
    texts = [start + " w30 w31 w32", start + " w40 w41 w42 w43 w44 w45"]
    texts = [t for t in texts for _ in range(2)]                     # 2 prompts x 2 rows
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = enc["input_ids"], enc["attention_mask"]              # (4, P), rows 0-1 left-padded
    assert (mask[:2] == 0).any() and shared_prefix.common_start(ids, mask) >= 16
    tokens, logits = decode_floor.decode(model, decode_floor.prefill(model, ids, mask), mask, 5)   # (4, 5), (4, 5, V)
    full = torch.cat([ids, tokens], 1)                               # (4, P+5)
    attn = torch.cat([mask, torch.ones_like(tokens)], 1)
    with torch.no_grad():
        expected = model(input_ids=full, attention_mask=attn,
                         position_ids=(attn.cumsum(-1) - 1).clamp_min(0)).logits[:, ids.shape[1] - 1:-1]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_decode_floor_prints_generate_beside_its_floor(tmp_path, capsys):
    decode_floor.main(["--repeats", "1", "--json", str(tmp_path / "f.json")])
    r = json.loads((tmp_path / "f.json").read_text())
    assert r["steps"] >= 1 and r["rows"] == 64
    assert r["floor"] == r["seconds"]["prefill"] + r["seconds"]["decode"]
    assert "generate / floor" in capsys.readouterr().out


@pytest.mark.slow          # worker processes, 11 s: the slow tier, so CI fits in 12 minutes
def test_compare_jobs_runs_seeds_as_processes_and_collects_their_summaries(tmp_path):
    from lab import compare
    common = "--steps 2 --batch 2 --k 4 --eval-samples 1 --sft-steps 30 --hidden 16 --layers 1"
    compare.main(["--k 4", "--seeds", "2", "--jobs", "2", "--common", common, "--out", str(tmp_path)])
    summaries = json.loads((tmp_path / "summaries.json").read_text())["--k 4"]
    assert [s["steps"] for s in summaries] == [2, 2]
    assert [s["out"] for s in summaries] == [str(tmp_path / "runs" / "k_4" / f"s{i}") for i in (0, 1)]
    assert (tmp_path / "table.md").is_file() and (tmp_path / "compare.png").is_file()


def test_a_failing_job_names_its_command_and_last_line(tmp_path):
    from lab import compare
    import pytest
    with pytest.raises(RuntimeError, match=r"exited 2: .*--layers"):
        compare.run_one(["--layers", "0", "--out", str(tmp_path / "r")], compare.Launch(jobs=2))


def test_a_run_the_disk_stopped_is_not_a_result(tmp_path, monkeypatch):
    """A run that stops because a line of its log could not be written (the disk filled) ends
    cleanly, but at step 2 of 4: the lab raises rather than count it in a verdict."""
    import pytest
    from lab import compare
    from running import checkpoint
    write = checkpoint.JsonlLog.write

    def full_at_step_2(self, row):
        if self.path.name == "metrics.jsonl" and row.get("step") == 2:
            with monkeypatch.context() as m:
                m.setattr(checkpoint.os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(28, "No space")))
                return write(self, row)
        return write(self, row)
    monkeypatch.setattr(checkpoint.JsonlLog, "write", full_at_step_2)
    argv = "--steps 4 --batch 2 --k 4 --eval-every 2 --eval-samples 1 --sft-steps 30 --hidden 16 --layers 1".split()
    with pytest.raises(RuntimeError, match="stopped: the disk is full"):
        compare.run_one(argv + ["--out", str(tmp_path / "run")], compare.Launch())


def test_on_a_real_model_the_lab_scales_lr_and_steps_and_keeps_k_and_b(tmp_path):
    real = lab.Lab(tmp_path, quick=False, model="smollm2-135m")
    assert real.shrink("--k 2 --batch 3 --steps 150 --lr 7e-3") == "--k 2 --batch 3 --steps 50 --lr 7e-05"
    assert lab.Lab(tmp_path, quick=False).shrink("--steps 150 --lr 1e-3") == "--steps 150 --lr 1e-3"
    quick_real = lab.Lab(tmp_path, quick=True, model="smollm2-135m")
    assert quick_real.shrink("--steps 150 --lr 1e-3") == "--steps 4 --lr 1e-05"


def test_pooled_runs_reuse_their_workers_and_match_a_run_in_this_process(tmp_path):
    """--jobs N runs seeds in N worker processes started once (compare.pool); a worker has
    fewer threads than this process, which must not change a run of the tiny model."""
    from lab import compare
    argv = "--steps 3 --batch 2 --k 4 --eval-every 2 --eval-samples 1 --sft-steps 30 --hidden 16 --layers 1".split()
    here = compare.run_one(argv + ["--out", str(tmp_path / "here")], compare.Launch())
    pooled = compare.run_one(argv + ["--out", str(tmp_path / "pooled")], compare.Launch(jobs=2))
    workers = set(compare.pool(2)._processes)
    compare.run_one(argv + ["--seed", "1", "--out", str(tmp_path / "again")], compare.Launch(jobs=2))
    assert set(compare.pool(2)._processes) == workers and len(workers) >= 1
    assert pooled["out"] == str(tmp_path / "pooled") and pooled["steps"] == here["steps"] == 3
    lines = lambda run: [{k: v for k, v in json.loads(x).items() if k != "seconds"}
                         for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert lines("pooled") == lines("here")


def test_the_lab_gives_each_run_the_users_omp_num_threads_else_its_share_of_the_cores(tmp_path, monkeypatch):
    """Two labs of --jobs 1 on a 2-core machine gave each run both cores whatever OMP_NUM_THREADS said:
    three runs had six threads on two cores (a step 5-10x slower), and one experiment's runs ran at 1 and
    at 2 threads. The user's OMP_NUM_THREADS is what each run gets; unset, cpu_count // jobs."""
    seen = []

    def fake_run(cmd, env, **kw):                   # train.py in a process of its own, as far as its threads
        seen.append(env["OMP_NUM_THREADS"])
        (out := Path(cmd[cmd.index("--out") + 1])).mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text("{}")
    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(compare, "_POOLS", {})
    monkeypatch.setattr(compare, "ProcessPoolExecutor", lambda jobs, mp_context, initializer, initargs: initargs)
    argv = ["--out", str(tmp_path / "r")]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    compare.run_in_new_process(argv, compare.Launch(jobs=1, alone=True))
    assert compare.pool(1) == (1,)
    monkeypatch.delenv("OMP_NUM_THREADS")
    compare.run_in_new_process(argv, compare.Launch(jobs=1, alone=True))
    compare.run_in_new_process(argv, compare.Launch(jobs=2, alone=True))
    assert seen == ["1", "2", "1"] and compare.pool(2) == (1,)


def test_how_often_a_run_is_evaluated_does_not_change_its_training(tmp_path):
    """The lab evaluates most experiments every 20 steps instead of 10: an evaluation draws
    with its own seed and leaves the training RNG alone (diagnostics.sample_seeded), so every
    training metric, and the last evaluation, are the same."""
    from running import config
    import train
    from conftest import quick
    runs = {}
    for every in ("1", "4"):
        summary = train.train(config.parse_config(quick(tmp_path, f"e{every}", "--steps", "4", "--eval-every", every,
                                                          "--entropy-coef", "0.01")))   # every step updates
        rows = [json.loads(x) for x in (tmp_path / f"e{every}" / "metrics.jsonl").read_text().splitlines()]
        training = [{k: v for k, v in r.items() if not k.startswith(("eval_", "train_answer")) and k != "seconds"}
                    for r in rows]
        runs[every] = (training, summary["eval_best_rate_end"], sum(r.get("eval_best_rate") is not None for r in rows))
    assert runs["1"][0] == runs["4"][0] and runs["1"][1] == runs["4"][1]
    assert all(r["updated"] for r in runs["1"][0][1:]), "the runs trained"
    assert (runs["1"][2], runs["4"][2]) == (5, 2), "evaluated at steps 0-4, and at steps 0 and 4"


def test_same_metrics_finds_a_changed_number_and_ignores_seconds(tmp_path, capsys):
    from tools import same_metrics
    row = {"step": 1, "loss": 0.5, "seconds": 1.0, "alerts": ["entropy_low"], "kl": None}
    (tmp_path / "a.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(dict(row, seconds=9.0)) + "\n")
    (tmp_path / "c.jsonl").write_text(json.dumps(dict(row, loss=0.5 * (1 + 1e-4))) + "\n")
    assert same_metrics.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 0
    assert same_metrics.main([str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")]) == 1
    assert "step 1.loss" in capsys.readouterr().out


def test_the_collapse_rule_and_its_interval_by_hand():
    """lab/collapse.py's rule on hand-made summaries, and the Wilson interval of 0/20 by hand:
    upper bound z^2 / (n + z^2) = 3.8416 / 23.8416 = 0.161."""
    from lab.collapse import collapsed, rate
    one_answer = dict(eval_one_answer_end=0.95, eval_valid_rate_end=1.0, eval_best_rate_end=0.25)
    wrong_but_valid = dict(eval_one_answer_end=0.3, eval_valid_rate_end=0.95, eval_best_rate_end=0.5)
    off_format = dict(eval_one_answer_end=0.3, eval_valid_rate_end=0.5, eval_best_rate_end=0.5)
    learned = dict(eval_one_answer_end=0.25, eval_valid_rate_end=0.99, eval_best_rate_end=0.98)
    assert [collapsed(r) for r in (one_answer, wrong_but_valid, off_format, learned)] == [True, True, False, False]
    assert rate([learned] * 20) == "0/20 (0%, 95% interval 0-16%)"
    assert rate([one_answer] * 10 + [learned] * 10).startswith("10/20 (50%, 95% interval 30-70%)")


def test_the_bench_without_trl_points_to_a_page_that_exists(capsys, monkeypatch):
    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "trl" else real_import(name, *a, **k))
    with pytest.raises(SystemExit) as e:
        bench.main(["--vs-trl"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    page = err.split("see ")[-1].rstrip(")")
    assert (Path(__file__).parent.parent / page).is_file(), f"the hint names {page!r}"


def test_a_comparison_figure_draws_each_setting_as_its_mean_and_spread_over_the_seeds_that_logged_a_step(tmp_path):
    """compare.figure overlays the settings on one panel a metric: each a mean line (the median
    for explained variance, where one seed's -900 would drag a mean off the axis) and a band from
    min to max, at every step over the seeds that logged the metric there."""
    from lab import compare
    logged = {0: [(0, 0.1), (1, 0.5), (2, None)], 1: [(0, 0.3), (1, 0.1), (2, 0.4)], 2: [(0, 0.2)]}   # seed 2 stopped
    runs = []
    for seed, rows in logged.items():
        out = tmp_path / f"s{seed}"
        out.mkdir()
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": t, "entropy": v}) + "\n" for t, v in rows))
        runs.append({"out": str(out)})
    steps, mean, low, high = compare.band(runs, "entropy")
    assert steps == [0, 1, 2]
    assert mean == pytest.approx([0.2, 0.3, 0.4]) and low == [0.1, 0.1, 0.4] and high == [0.3, 0.5, 0.4]
    assert compare.band(runs, "entropy", statistics.median)[1] == pytest.approx([0.2, 0.3, 0.4])
    compare.figure({"a": runs, "b": runs[:2]}, tmp_path / "compare.png", "t", ("entropy", "kl"))
    assert (tmp_path / "compare.png").stat().st_size > 0
    for seed, v in enumerate((0.2, 0.1, -900.0)):           # one seed's wild value: the median stays on the axis
        (tmp_path / f"s{seed}" / "metrics.jsonl").write_text(json.dumps({"step": 1, "explained_variance": v}) + "\n")
    assert compare.band(runs, "explained_variance", statistics.median)[1:] == ([0.1], [-900.0], [0.2])


def test_lesson_1s_shares_are_exact_by_enumeration():
    """K=2 group norm: a group is +-1 unless its two rewards are equal, so the share is
    1 - sum p^2 by hand; K=8's exact share (5.5%) is what 500 simulated batches put at 4.6%."""
    from lab import figures
    p = list(figures.REPORT_001_MIX.values())
    pm1, zero = figures.exact_shares("group", 2)
    assert zero == pytest.approx(sum(q * q for q in p)) and pm1 == pytest.approx(1 - sum(q * q for q in p))
    assert figures.exact_shares("none", 4)[0] == pytest.approx(figures.REPORT_001_MIX[1.0])   # A = r: |A| = 1 iff r = 1
    assert len(list(figures.compositions(16, 3))) == 153                                     # C(18, 2)
    assert figures.exact_shares("group", 8)[0] == pytest.approx(0.0549, abs=5e-4)
    assert figures.exact_shares("batch", 2) is None                   # depends on the groups' arrangement


def test_an_entry_keeps_its_place_in_summary_md_whichever_lab_wrote_last(tmp_path):
    """SmolLM2's folder holds the real experiments and the probes (the toy lab's): a probe rewritten by its
    lab moved both probes from after the real entries to the top of SUMMARY.md, and the next real entry
    moved them back. Every writer orders the entries one way: the real ones, then the toy's."""
    entry = lambda: dict(report="001", claim="c", measured="m", verdict="inconclusive", seconds=1.0, quick=False)
    real_name, toy_name = list(lab.REAL)[-1], next(n for n in lab.EXPERIMENTS if n not in lab.REAL)
    lab.record(tmp_path, toy_name, entry())
    for name in (real_name, toy_name):
        lab.record(tmp_path, name, entry())
        assert list(lab.read_summary(tmp_path)) == [real_name, toy_name], name
    assert (tmp_path / "SUMMARY.md").read_text().index(real_name) < (tmp_path / "SUMMARY.md").read_text().index(toy_name)


def test_a_claim_asked_as_a_question_ends_with_its_question_mark():
    """SUMMARY.md ends each claim with a full stop unless it already ends in one: a record's claim is often a
    question ("... against a frozen policy?"), which read "?." before."""
    entry = lambda claim: dict(report="000", claim=claim, measured="m", verdict="inconclusive", seconds=1.0)
    assert "- **Claimed:** does it?\n" in lab.summary_md({"group_norm": entry("does it?")})
    assert "- **Claimed:** it does.\n" in lab.summary_md({"group_norm": entry("it does")})


def test_a_rule_is_registered_with_its_first_runs_and_a_change_after_runs_keeps_the_old_verdict_beside():
    """The lab records each experiment's rule (its "# rule" comments, hashed) with the date of its
    first runs; the same rule keeps that date; a rule changed after runs existed is flagged in
    SUMMARY.md with the old rule and the verdict recorded under it; a --quick entry registers
    nothing."""
    def entry(text, verdict, date, quick=False):
        return dict(report="001", claim="c", measured="m", verdict=verdict, seconds=1.0, date=date, quick=quick,
                    rule={"text": text, "sha256": str(hash(text))})
    first = lab.registered(entry("rule: A", "reproduced", "2026-01-01"), {})
    assert first["rule"]["registered"] == "2026-01-01" and first["rule"]["changed"] is None
    again = lab.registered(entry("rule: A", "reproduced", "2026-02-01"), first)
    assert again["rule"]["registered"] == "2026-01-01"
    changed = lab.registered(entry("rule: B", "not reproduced", "2026-03-01"), again)
    assert changed["rule"]["registered"] == "2026-03-01"
    assert changed["rule"]["changed"] == dict(rule="rule: A", registered="2026-01-01", verdict="reproduced",
                                              measured="m")
    text = lab.summary_md({"group_norm": changed})
    assert "Rule changed after runs existed" in text and "the verdict was: reproduced" in text
    assert lab.registered(entry("rule: A", "reproduced", "2026-01-01", quick=True), {})["rule"].get("registered") is None
    assert "# rule" not in lab.rule_of(lab.EXPERIMENTS["kl_range"])["text"]          # comments read, marks off
    assert lab.rule_of(lab.EXPERIMENTS["kl_range"])["text"].startswith("rule: beta reaches the floor")


def test_probe_001_builds_the_reports_batch_and_measures_p_off_exactly():
    """probe_001's pieces against hand arithmetic and a plain loop: the report's step-4 batch
    gives 0, +-1, 0 (group) and 0, +-0.4, 0 (Dr. GRPO); K=8 with 3 best of 8 gives
    (1 - 0.5) / sqrt(0.15) and (0.2 - 0.5) / sqrt(0.15); P(off) is the mean over held-out prompts,
    each forwarded alone, of the fallback's first token's probability (and log p(best), teacher-forced
    alone); and the prompt-tied warm
    start answers each tied prompt with fallback text only."""
    import random
    from lab import probe001
    from models import policy
    from tasks import workflow_task as task
    tok = policy.build_tokenizer(task.vocabulary())
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1, task.MAX_POSITIONS)).eval()
    pool = task.make_prompts("train")
    adv = {c: probe001.probe_batch(model, tok, c, random.Random(3), pool)[0].advantages.tolist()
           for c in probe001.CONDITIONS}
    assert adv["null"] == [0.0] * 6
    assert adv["k2_group"] == pytest.approx([0, 0, 1, -1, 0, 0], abs=1e-6)
    assert adv["k2_drgrpo"] == pytest.approx([0, 0, 0.4, -0.4, 0, 0], abs=1e-6)
    assert adv["k8_group"] == pytest.approx(([0.5 / 0.15 ** 0.5] * 3 + [-0.3 / 0.15 ** 0.5] * 5) * 3, abs=1e-4)
    first = tok(task.FALLBACK_TEXTS[0], add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        alone = [torch.softmax(model(torch.tensor([tok(p["text"], add_special_tokens=False)["input_ids"]]))
                               .logits[0, -1], -1)[first].item() for p in task.make_prompts("eval")]
        best = [torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)[len(ids) - len(c) - 1:]   # teacher-forced
                .gather(-1, torch.tensor(ids[len(ids) - len(c):])[:, None]).sum().item()
                for p in task.make_prompts("eval")
                for c in [tok(p["best"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
                for ids in [tok(p["text"], add_special_tokens=False)["input_ids"] + c]]
    measured = probe001.measure(model, probe001.held_out(tok))
    assert measured["p_off"] == pytest.approx(statistics.fmean(alone), rel=1e-4)
    assert measured["lp_best"] == pytest.approx(statistics.fmean(best), rel=1e-4)
    tied = probe001.tied_task()
    for (prompt, _), (completion, _) in tied.warmstart_batch(random.Random(0), 200):
        is_fallback = completion in task.FALLBACK_TEXTS
        assert is_fallback != tied.answered_validly({"text": prompt})


def test_probe_001_continues_its_own_cells_and_takes_a_complete_set_from_any_machine(tmp_path):
    """A stopped probe keeps each finished cell under its warm start's P(off) before: run again,
    it takes those cells and computes the rest; a warm start that measures otherwise (built afresh
    on another machine) starts over beside them; a complete set is returned whatever the model."""
    import random
    from lab import probe001
    from models import policy
    from tasks import workflow_task as task
    from transformers import Qwen2ForCausalLM
    tok = policy.build_tokenizer(task.vocabulary())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1, task.MAX_POSITIONS)).eval()
    plan, cells = dict(batches=1, lrs=(2e-4,), warming_lr=1e-3), tmp_path / "cells.json"
    key = f"{probe001.measure(model, probe001.held_out(tok))['p_off']:.6f}"
    mine = {m: [123.0] for m in probe001.MEASURES}
    cells.write_text(json.dumps({key: {"warmed|0.0002|k8_group": mine}, "0.999999": {"fresh|0.0002|null": mine}}))
    out = probe001.probe(model, tok, plan, task.make_prompts("train"), cells)
    assert out[("warmed", 2e-4, "k8_group")] == mine                        # taken, not computed
    assert out[("fresh", 2e-4, "null")]["p_off"] == [0.0]                   # the other start's cell: computed
    kept = json.loads(cells.read_text())
    assert len(kept[key]) == 2 + 2 * len(probe001.CONDITIONS) and kept["0.999999"] == {"fresh|0.0002|null": mine}
    near = f"{float(key) + 4e-6:.6f}"          # the same warm start rebuilt on another CPU: its cells continue
    cells.write_text(json.dumps({near: {"warmed|0.0002|k2_group": mine}}))
    out = probe001.probe(model, tok, plan, task.make_prompts("train"), cells)
    assert out[("warmed", 2e-4, "k2_group")] == mine and list(json.loads(cells.read_text())) == [near]
    whole = {"0.5": {**{k: v for k, v in kept[key].items()}}}
    cells.write_text(json.dumps(whole))
    assert probe001.probe(None, None, plan, [], cells)[("warmed", 2e-4, "k8_group")] == mine   # no model needed


def test_every_probe_001_update_starts_from_the_same_optimizer_state(tmp_path, monkeypatch):
    """Each update of a cell starts from its own copy of the optimizer state: the null update (every
    advantage 0) is then one and the same step after every batch, so its deltas are identical,
    warmed as fresh; the state handed in is left as it was. (Loading one state into each update
    chained them: load_state_dict keeps the dict's tensors and AdamW moves them in place.)"""
    from lab import probe001
    from models import policy
    from tasks import workflow_task as task
    from transformers import Qwen2ForCausalLM
    import random
    tok = policy.build_tokenizer(task.vocabulary())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1, task.MAX_POSITIONS)).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(3):                  # a warmed AdamW: moments that a zero gradient still steps on
        opt.zero_grad()
        model(torch.tensor([[3, 4, 5]])).logits.logsumexp(-1).sum().backward()
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    monkeypatch.setattr(probe001, "warmed", lambda *a: (model, copy.deepcopy(state)))
    out = probe001.probe(model, tok, dict(batches=3, lrs=(2e-3,), warming_lr=1e-3), task.make_prompts("train"),
                         tmp_path / "cells.json")
    for start in ("fresh", "warmed"):
        null = out[(start, 2e-3, "null")]["p_off"]
        assert null == [null[0]] * 3, (start, null)
    assert out[("warmed", 2e-3, "null")]["p_off"][0] != 0.0        # a warmed AdamW moves even on a zero gradient
    kept = copy.deepcopy(state)
    batch, k = probe001.probe_batch(model, tok, "k2_group", random.Random(0), task.make_prompts("train"))
    probe001.updated(model, state, batch, k, 2e-3)
    assert all(torch.equal(a, b) for p in kept["state"] for a, b in
               zip(kept["state"][p].values(), state["state"][p].values())), "the update moved the state it was given"


def test_probe_001_held_warms_adams_moments_and_leaves_p_off_where_the_warm_start_has_it():
    """probe_001_held's optimizer: the moments of WARMING_STEPS real steps (a step count, second moments
    above zero), taken at HELD_LR, so P(off) before any probe update is the warm start's to 1e-6, where
    the same steps at probe_001's warming lr move it (on SmolLM2: 0.381 -> 0.004)."""
    from lab import probe001
    from models import policy
    from running import config
    from tasks import workflow_task as task
    model, tok = policy.load(config.Config(cache_dir=str(policy.CACHE), sft_difficulty=1), task, "cpu", lambda s: None)
    held = probe001.held_out(tok)                  # the course's warm start, as the probe loads it (a random
    start = probe001.measure(model, held)["p_off"]  # model's groups tie: zero advantages, no moments)
    weights, state = probe001.warmed(model, tok, probe001.HELD_LR)
    moments = list(state["state"].values())
    assert moments and all(m["step"] == probe001.WARMING_STEPS for m in moments)
    assert sum(float(m["exp_avg_sq"].sum()) for m in moments) > 0
    assert abs(probe001.measure(weights, held)["p_off"] - start) < 1e-6
    moved, _ = probe001.warmed(model, tok, probe001.WARMING_LR)
    assert abs(probe001.measure(moved, held)["p_off"] - start) > 1e-3


def test_a_finished_probe_001_rewrites_its_table_from_its_deltas_without_measuring_again(tmp_path, monkeypatch):
    """Run again after it finished (its cells folded into deltas.json), probe_001 takes every
    delta from deltas.json: no update is applied, the table shows those deltas, and deltas.json
    comes back the same."""
    import types
    from lab import probe001
    monkeypatch.setattr(probe001.policy, "load", lambda *a: (None, None))          # no model is needed
    monkeypatch.setattr(probe001, "updated", lambda *a: pytest.fail("an update was applied"))
    lrs, before = probe001.QUICK_LRS, {m: -1.0 for m in probe001.MEASURES}
    record = {"fresh|before": before, "warmed|before": before,
              **{f"{s}|{lr}|{c}": {m: [0.125, 0.375] if c == "k2_group" else [0.0, 0.0] for m in probe001.MEASURES}
                 for s in ("fresh", "warmed") for lr in lrs for c in probe001.CONDITIONS}}
    (tmp_path / "deltas.json").write_text(json.dumps({"per-sample fallback": record}))
    entry = probe001.probe_001(types.SimpleNamespace(quick=True, model=None, dir=lambda name: tmp_path))
    assert "+0.25000" in (tmp_path / "table.md").read_text()                      # the mean of 0.125 and 0.375
    assert json.loads((tmp_path / "deltas.json").read_text()) == {"per-sample fallback": record}
    assert not list(tmp_path.glob("cells-*.json"))
    assert entry["verdict"] == "not reproduced"          # two batches: the sign flip's p is at best 1/4


@pytest.mark.parametrize("folder", ["results", "results/smollm2-135m"])
def test_probe_001s_summary_is_recomputed_from_its_committed_deltas(folder):
    """Every number and the verdict of a SUMMARY.md's probe_001 entry (the toy's, SmolLM2's),
    recomputed from its probe_001/deltas.json (the probe's every delta) by the lab's own test."""
    from lab import probe001
    root = Path(__file__).parent.parent / folder
    lrs = probe001.REAL_LRS if "smollm2" in folder else probe001.LRS
    entry = json.loads((root / "summary.json").read_text()).get("probe_001")
    if entry is None and "smollm2" in folder:
        pytest.skip("SmolLM2's probe_001 has not finished (python -m lab --model smollm2-135m probe_001)")
    raw = json.loads((root / "probe_001" / "deltas.json").read_text())
    tests = {}
    for start, cells in raw.items():
        deltas = {tuple(float(x) if x[0].isdigit() else x for x in k.split("|")): v for k, v in cells.items()}
        for lr in lrs:
            for state in ("fresh", "warmed"):
                tests[(start, state, lr)] = probe001.rises(deltas, state, lr)
            d, p = tests[(start, "warmed", lr)]
            assert f"{d:+.1e} at lr {lr:g} (p {stats.p_value(p)})" in entry["measured"], (start, lr)
    jumped = any(probe001.jumps(tests, s, lr, lrs) for s in raw for lr in lrs)
    raised = any(tests[(s, "warmed", lr)][1] < 0.05 and tests[(s, "warmed", lr)][0] > 0 for s in raw for lr in lrs)
    assert entry["verdict"].split(":")[0] == ("reproduced" if jumped else "partly" if raised else "not reproduced")


def test_the_committed_summary_is_what_the_lab_writes_from_its_files():
    """results/SUMMARY.md is summary_md of results/summary.json with the runs beside it: each
    entry whose rule named no test carries the tests made after the runs, recomputed here from
    the runs' summaries.json (group_norm's K=8/B=3 above K=2/B=3 and the off-format counts)."""
    results = Path(__file__).parent.parent / "results"
    text = (results / "SUMMARY.md").read_text()
    assert text == lab.summary_md(lab.read_summary(results), results)
    group_norm = text.split("## group_norm")[1].split("\n## ")[0]
    k8 = stats.toy("group_norm", "--k 8 --batch 3 --norm group", "eval_best_rate_end")
    k2 = stats.toy("group_norm", "--k 2 --batch 3 --norm group", "eval_best_rate_end")
    assert (f"K=8/B=3 above K=2/B=3: {statistics.fmean(k8) - statistics.fmean(k2):+.3f}, one-sided permutation "
            f"p = {stats.p_value(stats.permutation(k8, k2))},") in group_norm
    assert "K=2/B=3 5/6, K=8/B=3 0/6, one-sided Fisher p = 0.0076" in group_norm       # 6 / C(12, 5) = 6/792
    # 6 runs against 6: 4/6 against 0/6 is the least Fisher's test can see (15/495 = 0.030; 3/6: 20/220 = 0.091)
    assert "the smallest it can see is 4/6 against 0/6" in group_norm
    assert "Tested after the runs" not in lab.summary_md(lab.read_summary(results))    # no folder, no runs to test


def test_the_smollm2_summary_tests_its_three_seed_verdicts_and_finds_them_inconclusive():
    """results/smollm2-135m/SUMMARY.md is what the lab writes, and its 3-seed entries carry their
    tests: "held for adaptive entropy" rests on 0 of 3 runs on one answer against 1 of 3, whose
    one-sided Fisher p is, by hand, P(the baseline's arm holds the one collapsed run of six) = 3/6; K=8 above K=2 on 3 runs each cannot reach p < 0.05
    (1 / C(6, 3) = 0.05 is the smallest)."""
    real = Path(__file__).parent.parent / "results" / "smollm2-135m"
    text = (real / "SUMMARY.md").read_text()
    assert text == lab.summary_md(lab.read_summary(real), real)
    entropy = text.split("## real_entropy_collapse")[1].split("\n## ")[0]
    assert "adaptive entropy off one answer more often than K=8/B=3: on one answer 1/3 against 0/3, " \
           "one-sided Fisher p = 0.500 (inconclusive), and no count of 3 runs against 3 reaches p < 0.05" in entropy
    group = text.split("## real_group_size")[1].split("\n## ")[0]
    assert "K=8/B=3 above K=2/B=3: +0.167, one-sided permutation p = 0.300 (inconclusive)" in group
    # the verdicts read what their tests support: neither says held or learns more, the rule's letter beside
    assert "**Verdict:** inconclusive: its test" in entropy and "its letter said: held for adaptive entropy" in entropy
    assert "**Verdict:** inconclusive: its test" in group
    assert stats.fisher(1, 3, 0, 3) == 0.5 and stats.permutation([1, 1, 1], [0, 0, 0]) == 1 / 20


def test_the_per_step_numbers_of_committed_toy_entries_are_recomputed_from_their_kept_runs():
    """critic's and kl_range's per-step figures in results/summary.json, recomputed from each
    run's committed metrics.jsonl.gz (lab.common.keep) with a plain loop: kl_range's lowest beta
    under 0.01/0.1 (every step after the first) and the held-out reward lost after each setting's
    best evaluation; critic's median explained variance over the first half of each run."""
    import math
    results = Path(__file__).parent.parent / "results"
    entry = json.loads((results / "summary.json").read_text())

    kl = json.loads((results / "kl_range" / "summaries.json").read_text())
    low = list(kl)[0]
    assert "--kl-target-min 0.01" in low
    lowest = min(row["kl_coef"] for run in kl[low] for row in kept_rows(run)[1:])
    assert f"lowest beta reached with 0.01/0.1: {lowest:.3g};" in entry["kl_range"]["measured"]
    lost = []
    for runs in kl.values():
        gaps = []
        for run in runs:
            evals = [row["eval_reward_mean"] for row in kept_rows(run) if "eval_reward_mean" in row]
            gaps.append(max(evals) - evals[-1])
        lost.append(f"{sum(gaps) / len(gaps):.2f}")
    assert "(early stopping's gain): " + ", ".join(lost) in entry["kl_range"]["measured"]
    critic = json.loads((results / "critic" / "summaries.json").read_text())
    for label, setting in (("shared", "--critic shared"), ("separate", "--critic separate")):
        medians = []
        for run in critic[setting]:
            steps = kept_rows(run)[1:]
            xs = sorted(row["explained_variance"] for row in steps[:len(steps) // 2]
                        if row.get("explained_variance") is not None and math.isfinite(row["explained_variance"]))
            mid = len(xs) // 2
            medians.append(xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2)
        assert f"{label} [" + ", ".join(f"{x:.2f}" for x in medians) + "]; " in \
            entry["critic"]["measured"].split("first half of the run: ")[1]


def test_an_entry_is_stamped_with_the_seeds_of_one_setting_not_with_its_calibration_seeds(tmp_path, monkeypatch):
    """SUMMARY.md says "N seeds" per setting: an experiment that calibrates on seeds 100-103 and
    then runs 20 seeds an arm (grad_clip_regime) is stamped 20, not 24 (as it was recorded)."""
    from lab import common, compare
    seen = []
    monkeypatch.setattr(compare, "run_settings", lambda settings, common_flags, seeds, *a, **k:
                        seen.append(list(seeds)) or {s: [] for s in settings})
    lab_ = common.Lab(tmp_path, quick=False)
    lab_.sweep("calibration", ["--lr 0.1"], "", seeds=range(100, 104))
    lab_.sweep("test", ["--lr 0.1", "--lr 0.2"], "", seeds=range(20))
    assert seen == [[100, 101, 102, 103], list(range(20))] and lab_.most_seeds == 20


def test_the_rerun_toy_entries_per_step_numbers_from_their_kept_runs():
    """dynamic_sampling's samples a step (its own runs) and zero-variance groups trained on
    (group_norm's runs, without it), recomputed from the committed metrics.jsonl.gz with a plain
    loop: every step after step 0, each run's mean, then the mean over runs."""
    results = Path(__file__).parent.parent / "results"
    measured = json.loads((results / "summary.json").read_text())["dynamic_sampling"]["measured"]

    def run_mean(run, key):
        values = [row.get(key) for row in kept_rows(run)][1:]
        values = [v for v in values if v is not None]
        return sum(values) / len(values)

    def over_runs(folder, setting, key):
        runs = json.loads((results / folder / "summaries.json").read_text())[setting]
        return sum(run_mean(run, key) for run in runs) / len(runs)
    k2, k8 = (over_runs("dynamic_sampling", f"--k {k} --batch 3 --norm group --dynamic-sampling", "samples_generated")
              for k in (2, 8))
    assert f"({k2:.1f} samples a step against 6)" in measured and f"({k8:.1f} against 24)" in measured
    zero = [over_runs("group_norm", f"--k {k} --batch 3 --norm group", "frac_reward_zero_std") for k in (2, 8)]
    assert f"zero-variance groups trained on without it: K=2 {zero[0]:.2f}, K=8 {zero[1]:.2f}" in measured


def test_entropy_curriculum_and_mismatch_per_step_numbers_from_their_kept_runs():
    """Three more rerun entries' per-step figures, recomputed from the committed metrics.jsonl.gz
    with plain loops: entropy's token entropy over each run's last 10 steps (mean and population
    spread over runs), curriculum's share of groups with one reward over steps 1-33, and
    mismatch's mean log-prob gap between sampler and trainer over every logged step."""
    results = Path(__file__).parent.parent / "results"
    entry = json.loads((results / "summary.json").read_text())


    def arms(folder):
        return json.loads((results / folder / "summaries.json").read_text()).values()

    def mean(xs):
        return sum(xs) / len(xs)

    def run_mean(key, rows):
        return mean([row[key] for row in rows if row.get(key) is not None])

    def pstdev(xs):
        return (sum((x - mean(xs)) ** 2 for x in xs) / len(xs)) ** 0.5
    entropies = []
    for arm in arms("entropy"):
        ends = [run_mean("entropy", kept_rows(run)[-10:]) for run in arm]
        entropies.append(f"{mean(ends):.3f} ± {pstdev(ends):.3f}")
    assert entry["entropy"]["measured"].startswith(
        f"token entropy over the last 10 steps: {entropies[0]} without a bonus, {entropies[1]} with 0.01 -> 0.001")
    shares = [mean([run_mean("frac_reward_zero_std", kept_rows(run)[1:34]) for run in arm]) for arm in arms("curriculum")]
    assert (f"mean over the first third of the steps: long from the start {shares[0]:.2f}; short -> long "
            f"{shares[1]:.2f}" in entry["curriculum"]["measured"])
    gaps = [mean([run_mean("sampling/sampling_logp_difference/mean", kept_rows(run)) for run in arm])
            for arm in arms("mismatch")]
    measured = entry["mismatch"]["measured"]
    for name, gap in zip(("null (fp32 sampler)", "bf16 sampler", "bf16 + TIS", "bf16 + ICEPOP", "4 updates stale",
                          "4 stale + TIS"), gaps):
        assert f"{name}: log-prob gap {gap:.2g}," in measured, name


def test_the_monitor_lead_times_and_entropy_collapse_end_entropy_from_their_kept_runs():
    """monitor's steps of warning, recomputed from group_norm_aggressive_lr's kept K=2 runs by hand:
    the collapse is the first step (after step 0) from which the rollout valid rate stays below 0.5,
    the first alarm the first step with entropy < 0.5, KL > 0.5 or, once 10 rewards are in, their
    range over the last 10 > 0.3 (report 002); and entropy_collapse's mean entropy of the last 10
    steps per arm."""
    results = Path(__file__).parent.parent / "results"
    entry = json.loads((results / "summary.json").read_text())

    sick = json.loads((results / "group_norm_aggressive_lr" / "summaries.json").read_text())["--k 2 --batch 3 --norm group"]
    leads = []
    for run in sick:
        steps = kept_rows(run)[1:]
        if steps[-1]["valid_rate"] >= 0.5:
            continue
        collapse = len(steps) - 1
        while collapse > 0 and steps[collapse - 1]["valid_rate"] < 0.5:
            collapse -= 1
        rewards, first = [], None
        for i, row in enumerate(steps):
            if row.get("reward_mean") is not None:
                rewards.append(row["reward_mean"])
            swing = len(rewards) >= 10 and max(rewards[-10:]) - min(rewards[-10:]) > 0.3
            if (row.get("entropy") is not None and row["entropy"] < 0.5) or swing or \
                    (row.get("kl") is not None and row["kl"] > 0.5):
                first = i
                break
        leads.append(collapse - first if first is not None and first <= collapse else None)
    assert f"{len(leads)} collapsing runs; steps of warning before the collapse: {leads};" in entry["monitor"]["measured"]
    arms = json.loads((results / "entropy_collapse" / "summaries.json").read_text())
    ends = []
    for runs in arms.values():
        per_run = []
        for run in runs:
            last = [row["entropy"] for row in kept_rows(run)[-10:] if row.get("entropy") is not None]
            per_run.append(sum(last) / len(last))
        ends.append(f"entropy at the end {sum(per_run) / len(per_run):.3f},")
    measured = entry["entropy_collapse"]["measured"].split("; ")
    assert [part.split(", ", 1)[1].split(" held-out")[0] for part in measured[1:]] == ends


def test_kl_regimes_beta_floor_and_reward_rise_from_its_kept_runs():
    """kl_regime's two per-step figures, by hand from the kept runs: how many 0.01/0.1 runs took
    beta to 0.002 or below at some step after step 0, and each arm's rollout reward from step 1
    to the last step, averaged over runs."""
    results = Path(__file__).parent.parent / "results"
    measured = json.loads((results / "summary.json").read_text())["kl_regime"]["measured"]
    arms = list(json.loads((results / "kl_regime" / "summaries.json").read_text()).values())
    rises, floor = [], 0
    for i, runs in enumerate(arms):
        total = 0.0
        for run in runs:
            steps = kept_rows(run)[1:]
            total += steps[-1]["reward_mean"] - steps[0]["reward_mean"]
            if i == 0 and any(row.get("kl_coef") is not None and row["kl_coef"] <= 0.002 for row in steps):
                floor += 1
        rises.append(total / len(runs))
    assert f"whose beta reached the floor (<= 0.002): {floor}/{len(arms[0])};" in measured
    assert f"(rollout mean, step 1 to the end): 0.01/0.1 {rises[0]:+.2f}, 0.05/0.2 {rises[1]:+.2f};" in measured


def test_rce_grpos_over_training_count_from_its_kept_runs():
    """rce_grpo's GRPO-only runs read for report 003's over-training by hand: the held-out answer
    NLL at the last evaluation at least 10% above its lowest, with the training prompts' NLL at
    the end no higher than at that lowest evaluation."""
    results = Path(__file__).parent.parent / "results"
    measured = json.loads((results / "summary.json").read_text())["rce_grpo"]["measured"]
    grpo_only = json.loads((results / "rce_grpo" / "summaries.json").read_text())[
        "--steps 120 --kl-control range --kl-target-min 0.01 --kl-target-max 0.1 --kl-coef 1 --save-every 40"]
    over = 0
    for run in grpo_only:
        evals = [row for row in kept_rows(run) if row.get("eval_answer_nll") is not None]
        low = evals[0]
        for row in evals:
            if row["eval_answer_nll"] < low["eval_answer_nll"]:
                low = row
        if evals[-1]["eval_answer_nll"] >= 1.1 * low["eval_answer_nll"] and \
                evals[-1]["train_answer_nll"] <= low["train_answer_nll"]:
            over += 1
    assert f"while the training prompts' NLL did not rise: {over}/{len(grpo_only)};" in measured


def test_the_lab_writes_into_runs_lab_unless_told_to_refresh_results(tmp_path, monkeypatch):
    """A user following the lessons runs `python -m lab NAME`: its runs, figures and SUMMARY.md go
    to runs/lab/, so the committed results/ stay as they are; `--out results` is the maintainers'
    refresh."""
    monkeypatch.chdir(tmp_path)
    lab.main(["k2_pm1"])
    assert (tmp_path / "runs" / "lab" / "k2_pm1" / "advantages.png").is_file()
    assert (tmp_path / "runs" / "lab" / "SUMMARY.md").is_file() and not (tmp_path / "results").exists()


@pytest.mark.parametrize("name", ["dynamic_sampling", "critic", "group_norm"])
def test_the_terminal_says_the_verdict_summary_md_records(name):
    """dynamic_sampling's rule letter says "reproduced" while its test after the runs gives
    p = 0.08: the line the lab prints is SUMMARY.md's verdict, not the bare letter."""
    results = Path(__file__).parent.parent / "results"
    entry = json.loads((results / "summary.json").read_text())[name]
    said = lab.said_verdict(results, name, entry)
    recorded = (results / "SUMMARY.md").read_text().split(f"## {name} ")[1].split("- **Verdict:** ")[1]
    assert recorded.startswith(said + ". ("), (said, recorded[:200])
    if name == "dynamic_sampling":
        assert said.startswith("inconclusive")


def test_the_labs_progress_line_says_the_time_left_at_the_pace_so_far():
    """After 3 of 8 settings in 270 s, 5 more at 90 s each: 7.5 minutes left."""
    assert compare.progress(3, 8, 270.0) == "3/8 settings, 4.5 min so far, about 7.5 min left"
    assert compare.progress(8, 8, 600.0).endswith("about 0.0 min left")


def test_a_second_block_runs_on_seeds_the_first_never_drew_and_summary_md_says_whether_it_replicates(tmp_path,
                                                                                                       monkeypatch):
    """--block 2 shifts every seed by 1000 (above every range the experiments use) into OUT/block2;
    SUMMARY.md sets the second block's verdict beside the first's, said "replicates" only when the
    two verdict words agree."""
    from lab import common
    assert common.Lab(tmp_path, quick=False, block=2).block(range(100, 120)) == range(1100, 1120)
    assert common.Lab(tmp_path, quick=False).block(range(6)) == range(6)
    used = [r for f in Path(lab.__file__).parent.glob("*.py") for r in re.findall(r"range\((\d+), (\d+)\)", f.read_text())]
    assert used and max(int(b) for _, b in used) <= common.BLOCK
    monkeypatch.chdir(tmp_path)
    lab.main(["--block", "2", "k2_pm1"])
    entry = json.loads((tmp_path / "runs" / "lab" / "block2" / "summary.json").read_text())["k2_pm1"]
    assert entry["block"] == 2 and entry["cpu"] and not (tmp_path / "runs" / "lab" / "summary.json").exists()

    def entry_(verdict):
        return dict(report="001", claim="c", measured="m", verdict=verdict, seconds=1.0, date="d", cpu="X")
    for second, said in (("reproduced (p = 0.01)", "Replicates: the same verdict."),
                         ("inconclusive: p = 0.2", "Does not replicate (reproduced against inconclusive): not decided.")):
        root = tmp_path / second.split()[0]
        (root / "block2").mkdir(parents=True)
        (root / "block2" / "summary.json").write_text(json.dumps({"k2_pm1": entry_(second)}))
        text = lab.summary_md({"k2_pm1": entry_("reproduced")}, root)
        line = next(x for x in text.splitlines() if x.startswith("- **Second block**"))
        assert line.startswith(f"- **Second block** (every seed + 1000; d, X): {second}") and line.endswith(said), line
    ruled = lambda sha: dict(entry_("reproduced"), rule={"text": "rule: x", "sha256": sha})
    (tmp_path / "ruled" / "block2").mkdir(parents=True)
    (tmp_path / "ruled" / "block2" / "summary.json").write_text(json.dumps({"k2_pm1": ruled("b")}))
    assert "Under another rule than the first block's (sha256 b): not a replication." in \
        lab.summary_md({"k2_pm1": ruled("a")}, tmp_path / "ruled")


def test_a_baseline_is_the_mean_of_evaluations_and_its_first_is_the_runs_own_step_0(tmp_path, monkeypatch):
    """kl_regime's baseline: its checkpoint evaluated BASELINE_EVALS times under eval seeds 1234, 1235, ...;
    the first of them is exactly the evaluation a run started from that checkpoint makes at step 0."""
    from lab import report003
    import train
    from running import config
    tiny = "--batch 2 --k 4 --eval-samples 2 --sft-steps 30 --hidden 16 --layers 1 --quiet".split()
    train.train(config.parse_config(tiny + ["--steps", "2", "--save-every", "2", "--out", str(tmp_path / "base")]))
    after = train.train(config.parse_config(tiny + ["--steps", "1", "--init-from", str(tmp_path / "base"),
                                                    "--out", str(tmp_path / "after")]))
    monkeypatch.setattr(report003, "BASELINE_EVALS", 1)
    assert report003.baseline_rate(tmp_path / "base") == after["eval_best_rate_start"]
    monkeypatch.setattr(report003, "BASELINE_EVALS", 3)
    rates = []
    monkeypatch.setattr(report003, "mean", lambda xs: rates.extend(xs) or statistics.fmean(rates))
    report003.baseline_rate(tmp_path / "base")
    assert len(rates) == 3 and rates[0] == after["eval_best_rate_start"]


def _decides_a(lab_):
    # rule: reproduced if p < 0.05
    return "reproduced" if lab_ < 0.05 else "inconclusive"


def _decides_b(lab_):
    # rule: reproduced if p < 0.05
    return "reproduced" if lab_ < 0.5 else "inconclusive"


def test_a_rules_registration_hashes_the_code_that_decides_and_names_its_commit():
    """Two experiments with one rule comment and different deciding code: the same rule sha256,
    another code sha256; an entry whose code changed after registration says so in SUMMARY.md."""
    a, b = lab.rule_of(_decides_a), lab.rule_of(_decides_b)
    assert a["sha256"] == b["sha256"] and a["code_sha256"] != b["code_sha256"] and a["commit"] != "?"
    stats_used = lab.deciding_code(lab.EXPERIMENTS["kl_regime"])
    assert "def sign_flip" in stats_used and "def baseline_rate" in stats_used     # through stats., and by name
    entry = dict(report="001", claim="c", measured="m", verdict="reproduced", seconds=1.0, date="d")
    first = lab.registered(dict(entry, rule=a), {})
    later = lab.registered(dict(entry, rule=dict(b)), first)
    assert later["rule"]["registered"] == "d" and later["rule"]["code_registered"] == a["code_sha256"]
    assert f"changed since its registration's {a['code_sha256']}" in lab.summary_md({"grad_clip": later})
    assert "changed since" not in lab.summary_md({"grad_clip": first})


def test_kl_regimes_first_block_against_the_mean_of_its_baselines_last_six_evaluations():
    """The first block's baseline was one evaluation at the 1.000 ceiling; against the mean of the
    baseline run's last six evaluations (0.988) the range rule's fall gives p = 0.079 (7/20 runs
    below), kl_regime_fixed's beta = 10 p = 0.0063: the figures docs/claims.md quotes."""
    results = Path(__file__).parent.parent / "results"
    rows = kept_rows({"out": "results/kl_regime/baseline/runs/k_8_norm_global_steps_150_save-every_150/s0"})
    baseline = statistics.fmean([r["eval_best_rate"] for r in rows if "eval_best_rate" in r][-6:])
    assert baseline == pytest.approx(0.98828125)
    for name, arm, p, below in (("kl_regime", "--kl-target-min 0.01", "0.079", 7), ("kl_regime_fixed", "--kl-coef 10", "0.0063", None)):
        runs = next(v for k, v in json.loads((results / name / "summaries.json").read_text()).items() if arm in k)
        end = [x["eval_best_rate_end"] for x in runs]
        assert stats.p_value(stats.sign_flip([baseline - v for v in end])) == p
        assert below is None or sum(v < baseline for v in end) == below
