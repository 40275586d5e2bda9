"""A run that survives: non-finite guard, crash-safe logs, exact resume, loadable checkpoints."""
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from running import checkpoint
from running import config
from models import policy
import monitor
import train
from tasks import workflow_task
from conftest import WARM_STARTS, quick

ROOT = Path(__file__).resolve().parent.parent


def flags(tmp_path, name, *extra):
    return ["--steps", "4", "--batch", "2", "--k", "4", "--eval-every", "2", "--eval-samples", "1",
            "--sft-steps", "30", "--hidden", "16", "--layers", "1", "--beta", "0.01", "--quiet",
            "--entropy-coef", "0.01",  # a gradient on every update, even when all rewards tie
            "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / name), *extra]


def read(path):
    return [json.loads(line) for line in open(path)]


def without_seconds(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def weights(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).state_dict()


def poison_training_forward(monkeypatch, on_calls):
    """Make the logits NaN on the given training-mode forward passes (1-based count)."""
    real_load = policy.load
    calls = {"n": 0}

    def load(*args, **kwargs):
        model, tok = real_load(*args, **kwargs)

        def hook(module, inputs, output):
            if module.training:
                calls["n"] += 1
                if calls["n"] in on_calls:
                    return output * float("nan")
            return output
        model.get_output_embeddings().register_forward_hook(hook)     # the LM head
        return model, tok
    monkeypatch.setattr(policy, "load", load)


# ---- the non-finite guard ----

def test_nan_loss_skips_the_step_with_weights_and_optimizer_bitwise_unchanged(tmp_path, monkeypatch):
    poison_training_forward(monkeypatch, on_calls={2})          # the update of step 2
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "1")))
    rows = read(tmp_path / "run" / "metrics.jsonl")[1:]
    assert rows[1]["skipped_nonfinite"] == 1 and rows[1]["updated"] is False
    assert set(rows[1]["nonfinite"]) == {"loss", "grad_norm"}
    assert rows[2]["updated"] is True and rows[3]["updated"] is True      # the run went on
    assert summary["skipped_nonfinite"] == 1 and summary["stopped"] is None
    ckpts = tmp_path / "run" / "checkpoints"
    w1, w2, w3 = (weights(ckpts / f"step-00000{i}") for i in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)              # step 2 changed nothing
    assert not all(torch.equal(w2[k], w3[k]) for k in w2)          # step 3 did update
    o1, o2 = (torch.load(ckpts / f"step-00000{i}" / checkpoint.STATE_FILE, weights_only=True)["optimizer"]
              for i in (1, 2))
    for s1, s2 in zip(o1["state"].values(), o2["state"].values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_too_many_skips_stop_the_run_with_a_checkpoint_of_the_last_good_weights(tmp_path, monkeypatch):
    poison_training_forward(monkeypatch, on_calls=set(range(2, 100)))   # every update after step 1
    summary = train.train(config.parse_config(flags(tmp_path, "run", "--steps", "10", "--max-skips", "1")))
    assert summary["stopped"] and "--max-skips 1" in summary["stopped"]
    assert summary["steps"] == 3 and summary["skipped_nonfinite"] == 2
    last = checkpoint.find(tmp_path / "run")
    assert last.name == "step-000003"
    state = torch.load(last / checkpoint.STATE_FILE, weights_only=True)
    assert state["loop"]["updates"] == 1


def test_non_finite_rewards_skip_the_update_and_are_never_averaged_in(tmp_path, monkeypatch):
    real_sample = workflow_task.sample

    def sample(*args, **kw):
        batch, classes = real_sample(*args, **kw)
        batch.rewards[0] = float("nan")
        return batch, classes
    monkeypatch.setattr(workflow_task, "sample", sample)
    train.train(config.parse_config(flags(tmp_path, "run")))
    rows = read(tmp_path / "run" / "metrics.jsonl")[1:]
    for r in rows:
        assert r["nonfinite_rewards"] == 1 and r["nonfinite"] == ["reward"] and not r["updated"]
        assert r["reward_mean"] is not None and r["reward_mean"] == r["reward_mean"]   # not NaN


# ---- crash-safe logs and exact resume ----

@pytest.mark.slow                  # a multi-process fault test, 20-35 s: the slow tier (README)
def test_kill_9_mid_run_leaves_logs_that_parse_line_by_line_and_resume_matches(tmp_path):
    extra = ["--steps", "60", "--save-every", "5", "--eval-every", "7"]     # killed at step ~10
    argv = flags(tmp_path, "killed", *extra)
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT)
    ckpt = tmp_path / "killed" / "checkpoints" / "step-000010"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.kill()                                                   # SIGKILL: no cleanup at all
    proc.wait()
    rows = read(tmp_path / "killed" / "metrics.jsonl")            # every line parses
    read(tmp_path / "killed" / "samples.jsonl")
    assert 10 <= rows[-1]["step"] < 60, "the run was not interrupted mid-way"
    assert [r["step"] for r in rows] == list(range(rows[-1]["step"] + 1))

    # Resume the killed run, and run the same configuration without interruption.
    train.train(config.parse_config(["--resume", str(tmp_path / "killed"), "--quiet"]))
    train.train(config.parse_config(flags(tmp_path, "straight", *extra)))
    for log in ("metrics.jsonl", "samples.jsonl"):
        resumed, straight = read(tmp_path / "killed" / log), read(tmp_path / "straight" / log)
        assert without_seconds(resumed) == without_seconds(straight), log


def test_resume_from_an_older_checkpoint_redoes_the_later_steps_exactly(tmp_path):
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "6", "--save-every", "3")))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "checkpoints" / "step-000006")   # as if killed at step 5
    train.train(config.parse_config(["--resume", str(tmp_path / "copy"), "--quiet"]))
    assert without_seconds(read(tmp_path / "copy" / "metrics.jsonl")) == \
        without_seconds(read(tmp_path / "run" / "metrics.jsonl"))
    assert json.loads((tmp_path / "copy" / "summary.json").read_text())["updates"] == \
        json.loads((tmp_path / "run" / "summary.json").read_text())["updates"]


def test_a_checkpoint_loads_in_plain_transformers_gives_back_every_task_text_and_the_same_logits(tmp_path):
    """The two lines a transformers user writes: AutoModelForCausalLM and AutoTokenizer on a checkpoint
    folder. Every text of the task (each prompt with its best workflow, each fallback text) comes back
    from encode and decode, as the same ids the run's own tokenizer gives, and the model's logits are
    the run's (read back by the project's own loader: policy.read_weights)."""
    import tasks
    from models import policy
    from tasks import workflow_task
    cfg = config.parse_config(flags(tmp_path, "run", "--save-every", "4"))
    train.train(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "step-000004"
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    ours = policy.build_tokenizer(workflow_task.vocabulary())
    texts = [f"{p['text']} {p['best']}" for split in ("train", "eval") for p in workflow_task.make_prompts(split)]
    texts += workflow_task.FALLBACK_TEXTS
    assert [tok.decode(tok(t)["input_ids"]) for t in texts] == texts
    assert [tok(t)["input_ids"] for t in texts] == [ours(t)["input_ids"] for t in texts]
    run_model, _ = policy.load(cfg, tasks.TASKS[cfg.task], "cpu", log=lambda s: None)
    run_model.load_state_dict(policy.read_weights(ckpt, run_model))
    ids = torch.tensor([ours(texts[0])["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, run_model.eval()(ids).logits)
    out = model.generate(**tok(texts[0], return_tensors="pt"), max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert out.shape[1] > len(ours(texts[0])["input_ids"])


def test_jsonl_log_appends_whole_lines_and_truncates_by_step(tmp_path):
    log = checkpoint.JsonlLog(tmp_path / "m.jsonl", append=False)
    for step in range(5):
        log.write({"step": step, "text": "x" * 20000})             # longer than any buffer
    log.close()
    checkpoint.truncate_log(tmp_path / "m.jsonl", 2)
    log = checkpoint.JsonlLog(tmp_path / "m.jsonl", append=True)
    log.write({"step": 3})
    log.close()
    assert [r["step"] for r in read(tmp_path / "m.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize("argv, flag", [
    (["--save-every", "-1"], "--save-every"),
    (["--max-skips", "-1"], "--max-skips"),
    (["--resume", "/nonexistent/run"], "--resume"),
])
def test_bad_survival_flags_exit_2_naming_the_flag(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv + ["--out", str(tmp_path / "x")])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_resume_refuses_to_change_the_saved_configuration(tmp_path, capsys):
    train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "4")))
    with pytest.raises(SystemExit) as e:
        config.parse_config(["--resume", str(tmp_path / "run"), "--lr", "0.1"])
    assert e.value.code == 2 and "--lr" in capsys.readouterr().err
    extended = config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "9"])
    assert extended.steps == 9 and extended.k == 4 and extended.out == str(tmp_path / "run")


# ---- the monitor ----

def test_monitor_alerts_once_per_episode_on_a_scripted_run():
    m = monitor.StabilityMonitor(min_entropy=0.5, max_kl=0.5, max_reward_range=0.3, window=3)
    script = [  # (reward, entropy, kl) -> alerts starting now
        ((0.5, 1.0, 0.1), []),
        ((0.5, 0.4, 0.1), ["entropy_low"]),
        ((0.5, 0.3, None), []),                    # still low: same episode, no new alert
        ((0.5, None, None), []),                   # not measured: the episode goes on
        ((0.5, 0.2, None), []),                    # ... so this is not a new one
        ((0.9, 1.0, 0.7), ["kl_high", "reward_swing"]),
        ((0.9, 0.2, 0.1), ["entropy_low"]),        # a second episode of low entropy
        ((0.9, None, None), []),                   # nothing measured: nothing raised
    ]
    for (reward, ent, kl), expected in script:
        _, started, messages = m.update(reward, ent, kl)
        assert started == expected and len(messages) == len(expected)
    assert m.episodes == {"entropy_low": 2, "kl_high": 1, "reward_swing": 1}
    copy = monitor.StabilityMonitor(window=3)
    copy.load_state_dict(m.state_dict())
    assert copy.update(0.9, 1.0, 0.1) == m.update(0.9, 1.0, 0.1)


# ---- resume that does what the user means ----

def test_resume_accepts_the_original_command_and_names_both_values_of_a_changed_flag(tmp_path, capsys):
    argv = flags(tmp_path, "run", "--save-every", "2")
    train.train(config.parse_config(argv))
    again = config.parse_config(argv + ["--resume", str(tmp_path / "run"), "--steps", "6"])
    assert again.steps == 6 and again.k == 4 and again.save_every == 2
    with pytest.raises(SystemExit) as e:
        config.parse_config(["--resume", str(tmp_path / "run"), "--k", "8"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--k was 4" in err and "is 8 now" in err and len(err.splitlines()) == 1
    for bad, flag in ((["--steps", "3"], "--steps"), ([], "--steps"), (["--steps", "4"], "--steps")):
        with pytest.raises(SystemExit) as e:               # at or below the checkpoint's step 4
            config.parse_config(["--resume", str(tmp_path / "run"), *bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        config.parse_config(["--resume", ""])
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err


def test_resume_drops_a_torn_last_log_line(tmp_path, capsys):
    train.train(config.parse_config(flags(tmp_path, "run", "--save-every", "2")))
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-000004")
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "best')                                   # a kill mid-write
    c = config.parse_config(["--resume", str(tmp_path / "run")])
    train.train(c)
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert "dropped 1 torn line(s) of metrics.jsonl" in capsys.readouterr().err


def test_resume_skips_a_damaged_newest_checkpoint_for_the_newest_good_one(tmp_path, capsys):
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "6", "--save-every", "2")))
    weights_file = tmp_path / "run" / "checkpoints" / "step-000006" / "model.safetensors"
    with open(weights_file, "r+b") as f:
        f.truncate(1000)
    train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "8"]))
    err = capsys.readouterr().err
    assert "skipped damaged checkpoint" in err and "step-000006" in err and "step-000004" in err
    assert [r["step"] for r in read(tmp_path / "run" / "metrics.jsonl")] == list(range(9))
    for ckpt in (tmp_path / "run" / "checkpoints").glob("step-*"):   # every one damaged
        (ckpt / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(checkpoint.ResumeError, match="no checkpoint in"):
        train.train(config.parse_config(["--resume", str(tmp_path / "run"), "--steps", "12", "--quiet"]))


def test_non_finite_numbers_are_logged_as_null_and_named(tmp_path):
    log = checkpoint.JsonlLog(tmp_path / "m.jsonl", append=False)
    log.write({"step": 1, "grad_norm": float("nan"), "loss": float("inf"), "nested": {"x": [1.0, float("-inf")]}})
    log.close()
    text = (tmp_path / "m.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["grad_norm"] is None and row["loss"] is None and row["nested"]["x"] == [1.0, None]
    assert row["nonfinite_logged"] == ["grad_norm", "loss", "nested.x"]


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_a_damaged_warm_start_cache_is_moved_aside_and_built_again(damage, tmp_path, capsys):
    """A warm-start cache entry without its config.json, or with its weights cut short,
    gave a traceback, then "Directory not empty" on the retry."""
    argv = quick(tmp_path, "a", "--steps", "1", own_cache=True)
    train.train(config.parse_config(argv))
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    if damage == "config":
        (entry / "config.json").unlink()
    else:
        weights = entry / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    summary = train.train(config.parse_config(quick(tmp_path, "b", "--steps", "1", own_cache=True)))
    assert summary["steps"] == 1
    assert "did not load" in capsys.readouterr().err
    assert (entry / "config.json").is_file() and list((tmp_path / "cache").glob("*.damaged-*"))


def test_resuming_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    """Resumed from step 2 to 3, checkpoints/ still held steps 4 and 5 of the old
    history, and a later plain --resume picked step 5 of it. One folder, one history."""
    train.train(config.parse_config(flags(tmp_path, "run", "--steps", "5", "--save-every", "1")))
    run = tmp_path / "run"
    train.train(config.parse_config(["--resume", str(run / "checkpoints" / "step-000002"), "--steps", "3", "--quiet"]))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002", "step-000003"]
    aside = run / "checkpoints.abandoned-after-step-2"
    assert sorted(p.name for p in aside.iterdir()) == ["step-000003", "step-000004", "step-000005"]
    assert checkpoint.find(run).name == "step-000003"
    assert [json.loads(x)["step"] for x in open(run / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_line_the_disk_cuts_short_is_removed_and_the_next_one_starts_whole(tmp_path, monkeypatch, capsys):
    """A full disk mid-line left half a line, the next line was appended to it, and
    report.finish died on a JSONDecodeError."""
    log = checkpoint.JsonlLog(tmp_path / "m.jsonl", append=False)
    log.write({"step": 1, "loss": 0.5})
    real, calls = checkpoint.os.write, {"n": 0}

    def full_midway(fd, data):                     # the second line: 10 bytes fit, then ENOSPC
        calls["n"] += 1
        if calls["n"] == 1:
            return real(fd, data[:10])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.os, "write", full_midway)
    log.write({"step": 2, "loss": 0.25, "text": "x" * 100})
    monkeypatch.setattr(checkpoint.os, "write", real)
    log.write({"step": 3, "loss": 0.125})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3] and log.lost == 1
    assert "a line was not written" in capsys.readouterr().err
