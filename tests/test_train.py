"""train.py end to end on the CPU, in seconds: files, metrics, determinism, bad input."""
import json

import pytest

from running import config, report
import torch
import tasks
import grpo
from models import policy
import train
import warm_start
from tasks import workflow_task
from conftest import configure, WARM_STARTS, quick

REQUIRED = ["step", "reward_mean", "reward_std", "valid_rate", "best_rate", "fallback_rate",
            "frac_reward_zero_std", "adv_abs_mean", "frac_adv_pm1", "loss", "kl", "entropy",
            "grad_norm", "clip_frac", "lr", "updated", "collapsed_after_update", "seconds"]


def read(path):
    return [json.loads(line) for line in open(path)]


def test_smoke_run_writes_every_file_and_metric(tmp_path):
    summary = train.train(config.parse_config(quick(tmp_path, "run", "--beta", "0.05")))
    out = tmp_path / "run"
    for f in ["config.json", "metrics.jsonl", "samples.jsonl", "summary.json", "curves.png"]:
        assert (out / f).is_file(), f
    first, *rows = read(out / "metrics.jsonl")
    assert first["step"] == 0 and "eval_best_rate" in first      # evaluation before training
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in REQUIRED:
        assert key in rows[0], key
    assert "eval_best_rate" in rows[1] and "eval_valid_rate" in rows[2]
    assert 0 <= summary["eval_best_rate_end"] <= 1 and summary["steps"] == 3
    assert any(r["updated"] for r in rows) and rows[0]["kl"] is not None


def test_same_seed_gives_identical_metrics(tmp_path):
    runs = []
    for name in ["a", "b"]:
        train.train(config.parse_config(quick(tmp_path, name)))
        rows = read(tmp_path / name / "metrics.jsonl")
        for r in rows:
            r.pop("seconds", None)
        runs.append(rows)
    assert runs[0] == runs[1]


def test_a_local_model_folder_loads_with_model_flag(tmp_path):
    # Any local causal LM folder works; here, the tiny model saved the way users save theirs.
    model, tok = policy.tiny_policy(workflow_task, 16, 1, warm_start.WarmStart(10, 3e-3, 16, 0), tmp_path / "cache",
                                    log=lambda s: None)
    model.save_pretrained(tmp_path / "local")
    tok.save_pretrained(tmp_path / "local")
    summary = train.train(config.parse_config(quick(tmp_path, "local_run", "--model", str(tmp_path / "local"))))
    assert summary["steps"] == 3


@pytest.mark.parametrize("argv, flag", [
    (["--k", "0"], "--k"),
    (["--k", "1", "--norm", "group"], "--k"),
    (["--k", "1", "--norm", "rloo"], "--k"),
    (["--norm", "bogus"], "--norm"),
    (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--batch", "0"], "--batch"),
    (["--steps", "0"], "--steps"),
    (["--clip-eps", "1.5"], "--clip-eps"),
    (["--micro-batch", "7"], "--micro-batch"),
    (["--temperature", "0"], "--temperature"),
    (["--loss-agg", "mean"], "--loss-agg"),
    (["--device", "tpu"], "--device"),
    (["--model", "/nonexistent/model"], "--model"),
    (["--k", "two"], "--k"),
    (["--out", "/proc/not-writable"], "--out"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--task", "tools", "--max-turns", "0"], "--max-turns"),
    (["--task", "tools", "--reward", "bogus"], "--reward"),
    (["--task", "chess"], "--task"),
    # non-finite and out-of-range numbers
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--clip-eps", "nan"], "--clip-eps"),
    (["--max-grad-norm", "inf"], "--max-grad-norm"),
    (["--seed", str(2 ** 40)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints"),
    (["--eval-prompts", "-1"], "--eval-prompts"),
])
def test_bad_input_exits_2_with_one_line_naming_the_flag(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        configure(argv + (["--out", str(tmp_path / "x")] if "--out" not in argv else []))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_compare_runs_every_setting_over_seeds_and_writes_table_and_figure(tmp_path, capsys):
    from lab import compare
    common = " ".join(quick(tmp_path, "unused")[:-2])                  # all but --out
    compare.main(["--seeds", "2", "--common", common, "--out", str(tmp_path / "cmp"),
                  "--k 2 --norm group", "--k 4 --norm global"])
    table = (tmp_path / "cmp" / "table.md").read_text()
    assert "`--k 2 --norm group`" in table and "`--k 4 --norm global`" in table
    assert (tmp_path / "cmp" / "compare.png").is_file()
    assert (tmp_path / "cmp" / "runs" / "k_2_norm_group" / "s1" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_fast_path_takes_the_same_first_step(tmp_path, algo):
    """--fast (old log-probs from the update's forward for GRPO, length-sorted trimmed
    micro-batches) computes the same loss, gradient and KL as the plain path."""
    rows = {}
    for name, extra in [("plain", []), ("fast", ["--fast"])]:
        argv = quick(tmp_path, name, "--steps", "1", "--beta", "0.05", "--micro-batch", "2",
                     "--algo", algo, *extra)
        train.train(config.parse_config(argv))
        rows[name] = read(tmp_path / name / "metrics.jsonl")[1]
    plain, fast = rows["plain"], rows["fast"]
    assert plain["reward_mean"] == fast["reward_mean"] and fast["updated"]
    for key in ["loss", "grad_norm", "kl", "entropy"]:
        assert fast[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_one_non_finite_mini_batch_of_four_still_counts_as_an_update(tmp_path, monkeypatch):
    """N=8, --mini-batch 2, one mini-batch NaN: three optimizer steps moved the weights, so the
    step updated (and crash rate and collapsed_after_update count it)."""
    real = grpo.prepare

    def poisoned(batch, hp):                       # row 0's advantage NaN: its mini-batch's loss too
        real(batch, hp)
        batch.advantages[0] = float("nan")
    monkeypatch.setattr(grpo, "prepare", poisoned)
    argv = ["--steps", "1", "--batch", "2", "--k", "4", "--mini-batch", "2", "--kl-coef", "0.05",
            "--eval-samples", "1",
            "--sft-steps", "20", "--hidden", "16", "--layers", "1", "--quiet",
            "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / "run")]
    summary = train.train(config.parse_config(argv))
    row = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][1]
    assert row["steps_taken"] == 3 and row["skipped_nonfinite"] == 1 and row["updated"] is True
    assert summary["updates"] == 1


def test_proportional_kl_control_moves_beta_as_ziegler_s_rule_says(tmp_path):
    argv = quick(tmp_path, "run", "--kl-control", "proportional", "--kl-coef", "0.1", "--kl-target", "0.5",
                 "--kl-horizon", "40")             # a field, not a flag: configure sets it
    train.train(configure(argv))
    rows = read(tmp_path / "run" / "metrics.jsonl")[1:]
    for a, b in zip(rows, rows[1:]):                      # beta of step t+1 from the KL of step t, N = 8
        error = min(max(a["kl"] / 0.5 - 1, -0.2), 0.2)
        assert b["kl_coef"] == pytest.approx(a["kl_coef"] * (1 + error * 8 / 40))


def test_eval_prompts_evaluates_that_many_held_out_prompts_spread_over_the_list(tmp_path):
    held, trained = workflow_task.prompts("eval"), workflow_task.prompts("train")
    every = tasks.prompts_of(workflow_task, config.parse_config(quick(tmp_path, "all")))
    assert every["eval"] == held and every["nll"] == trained[::3][:32]            # the default: all 32
    cfg = config.parse_config(quick(tmp_path, "few", "--eval-prompts", "4"))
    few = tasks.prompts_of(workflow_task, cfg)
    assert few["eval"] == [held[0], held[8], held[16], held[24]] and few["nll"] == trained[::24][:4]
    assert len({p[workflow_task.GROUP_KEY] for p in few["eval"]}) > 1              # not the first type alone
    train.train(cfg)                                      # 1 sample per prompt: 4 held-out rollouts
    evals = [r for r in map(json.loads, open(tmp_path / "few" / "samples.jsonl")) if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(len(r["samples"]) == 4 for r in evals)


def test_a_checkpoint_given_as_model_keeps_its_tokenizer_every_sample_round_trips(tmp_path):
    """A run's checkpoint loaded again (--model FOLDER) must read and write text as the
    run did. AutoTokenizer alone gives a qwen2 folder the Qwen2 class, which splits the tiny
    model's words into byte-pair pieces ("### Step 1 : Analyze" -> "1:a"): the fallback text
    of report 001 would be classed as junk."""
    train.train(config.parse_config(quick(tmp_path, "run", "--save-every", "3", "--steps", "6")))
    ckpt = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    _, tok = policy.real_policy(workflow_task, ckpt, warm_start.WarmStart(steps=0), tmp_path / "cache", log=lambda s: None)
    built = policy.build_tokenizer(workflow_task.vocabulary())
    texts = [s["text"] for line in open(tmp_path / "run" / "samples.jsonl") for s in json.loads(line)["samples"]]
    assert len(texts) > 20 and any(t.startswith("### Step") for t in texts)
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == built(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("flags, threads", [([], 1), (["--threads", "2"], 2)])
def test_the_tiny_model_runs_on_one_thread_unless_told(flags, threads, tmp_path):
    """torch's default threads made a 20-step run on a busy 2-core machine 1.6x slower than one
    thread (docs/performance.md); the tiny model gets 1 unless --threads says otherwise."""
    import torch
    from running import config
    import train
    before = torch.get_num_threads()
    try:
        train.train(config.parse_config(quick(tmp_path, "t", "--steps", "1", "--device", "cpu", *flags)))
        ran_on = json.loads((tmp_path / "t" / "config.json").read_text())["ran_on"]
        assert ran_on.startswith(f"cpu ({threads} thread"), ran_on
    finally:
        torch.set_num_threads(before)


def test_a_negative_thread_count_is_refused_in_one_line(tmp_path, capsys):
    from conftest import assert_refused_in_one_line
    assert_refused_in_one_line(tmp_path, capsys, ["--threads", "-1"], "--threads: must be in [0, 1024]")


def test_every_example_in_help_is_a_command_that_parses(tmp_path):
    """--help ends with examples; each must be a valid command (a stale one would be refused)."""
    lines = [line.split("  ")[1].strip() for line in config.EXAMPLES.splitlines() if line.startswith("  python train.py")]
    assert len(lines) >= 5
    for i, line in enumerate(lines):
        argv = line.split()[2:]
        if "--resume" in argv:
            continue
        cfg = config.parse_config(argv + ["--out", str(tmp_path / f"e{i}")])
        assert cfg.out == str(tmp_path / f"e{i}")
    assert "--policy-loss cispo --epochs 2" in config.EXAMPLES, "Lesson 8's command acts only with two epochs"


FREED = """
import torch
from running import report
def resident_mb():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024
held = [torch.ones(16_000) for _ in range(2000)]     # 64 KB each, from the heap: 128 MB
pin = torch.ones(16)                                 # allocated after them: the heap's top stays in use
full = resident_mb()
del held
freed = resident_mb()
report.give_back_freed_memory()
print(full, freed, resident_mb())
"""


@pytest.mark.skipif(report.MALLOC_TRIM is None, reason="glibc's malloc_trim: Linux only")
def test_memory_a_step_freed_goes_back_to_the_os():
    """glibc keeps the pages a process frees while a later allocation pins the heap above them, so
    an update's activations stayed resident under the held-out generation after it; end_step
    gives them back (report.give_back_freed_memory). In a fresh process (a heap with a history
    behaves otherwise): 128 MB of 64 KB tensors, freed, stay resident until the call."""
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", FREED], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    full, freed, after = map(float, out.split())
    assert full - freed < 32 and freed - after > 96, (full, freed, after)

