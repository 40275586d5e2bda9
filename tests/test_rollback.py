"""--rollback (monitor.Rollbacks, running/session.roll_back): a run driven into one answer by a
destructive lr goes back to its best checkpoint, says why, and trains on at the lr cut; killed
mid-run it resumes whole; under torchrun every rank takes it at the same step."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import monitor
import train
from running import config
from conftest import WARM_STARTS

ROOT = Path(__file__).resolve().parent.parent
# AdamW at lr 0.01 (grad_clip_regime's lr that collapses AdamW): seed 1 writes junk at step 5 and,
# left alone, one answer from step 15: on a CPU (CUDA samples from its own random numbers, under
# bf16: another trajectory, which the first GPU run found did not collapse at step 5)
DESTRUCTIVE = ["--lr", "0.01", "--steps", "20", "--eval-every", "5", "--eval-samples", "1", "--seed", "1",
               "--quiet", "--cache-dir", str(WARM_STARTS), "--device", "cpu"]


def read(path):
    return [json.loads(line) for line in open(path)]


def weights(ckpt):
    return AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).state_dict()


def test_a_destructive_lr_rolls_back_to_the_best_checkpoint_and_trains_on_at_the_lr_cut(tmp_path):
    out = tmp_path / "run"
    summary = train.train(config.parse_config([*DESTRUCTIVE, "--rollback", "1", "--out", str(out)]))
    rows = {r["step"]: r for r in read(out / "metrics.jsonl")}
    # step 5's evaluation: the policy writes junk (report 001's crash, on the held-out prompts)
    assert rows[5]["eval_valid_rate"] <= rows[0]["eval_valid_rate"] / 2
    event = rows[5]["rollback"]
    assert event == {"step": 5, "why": f"the held-out valid_rate is {rows[5]['eval_valid_rate']:.2f}, at most half "
                                       f"the best evaluation's {rows[0]['eval_valid_rate']:.2f}",
                     "to": 0, "lr_scale": 0.5}                    # the warm start was the best evaluation
    assert [r.get("rollback") for s, r in rows.items() if s != 5] == [None] * 20
    assert rows[5]["lr"] == 0.01 and rows[6]["lr"] == rows[20]["lr"] == 0.005
    # the checkpoint written after the rollback holds the best's weights, bit for bit
    back, best = weights(out / "checkpoints" / "step-000005"), weights(out / "checkpoints" / "step-000000")
    assert all(torch.equal(back[k], best[k]) for k in best)
    assert summary["rollbacks"] == [event]
    assert rows[20]["eval_valid_rate"] > rows[0]["eval_valid_rate"] / 2    # it trained on, on the format (this seed)


def test_keeping_one_checkpoint_never_prunes_the_one_a_rollback_needs(tmp_path):
    """--keep-checkpoints 1 (a SmolLM2 checkpoint is 1.5 GB), a checkpoint every step: the best
    evaluation's checkpoint is spared, so the rollback at step 5 still goes back to the warm start, and the run is the one
    that kept every checkpoint; at the end the newest and the best are left (here one and the same)."""
    runs = {keep: tmp_path / f"keep{keep}" for keep in (0, 1)}
    for keep, out in runs.items():
        train.train(config.parse_config([*DESTRUCTIVE, "--rollback", "1", "--keep-checkpoints", str(keep),
                                         "--save-every", "1", "--out", str(out)]))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(read(runs[1] / "metrics.jsonl")) == strip(read(runs[0] / "metrics.jsonl"))
    assert read(runs[1] / "metrics.jsonl")[5]["rollback"]["to"] == 0
    summary = json.loads((runs[1] / "summary.json").read_text())
    every, left = (sorted(p.name for p in (out / "checkpoints").iterdir()) for out in (runs[0], runs[1]))
    assert len(every) > 2 and left == sorted({summary["best_checkpoint"].split("/")[1], every[-1]})


def test_without_rollback_the_same_run_stays_on_one_answer(tmp_path):
    """The control: the same command without --rollback ends where the collapse put it."""
    summary = train.train(config.parse_config([*DESTRUCTIVE, "--out", str(tmp_path / "run")]))
    assert summary["eval_one_answer_end"] >= 0.9 and "rollbacks" not in summary


def test_the_lr_cut_compounds_and_survives_a_restored_optimizer():
    """Hand arithmetic: the policy's group at 1, a critic's group at 10x; two rollbacks put them
    at 0.25 and 2.5; an optimizer restored from before both (as the best checkpoint may be) and a
    third rollback give 0.125 and 1.25, not the restored scale times the cut."""
    weight = torch.nn.Parameter(torch.zeros(1))
    critic = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [weight]}, {"params": [critic], "lr": 10.0, "lr_scale": 10.0}], lr=1.0)
    saved = opt.state_dict()
    rollbacks = monitor.Rollbacks(most=3, at=0.9, cut=0.5, fmt="valid_rate")
    rollbacks.take(5, "x", 0, opt)
    rollbacks.take(9, "y", 0, opt)
    assert [g.get("lr_scale", 1.0) for g in opt.param_groups] == [0.25, 2.5]
    opt.load_state_dict(saved)
    rollbacks.take(12, "z", 0, opt)
    assert [g["lr_scale"] for g in opt.param_groups] == [0.125, 1.25]
    again = monitor.Rollbacks(most=3, at=0.9, cut=0.5, fmt="valid_rate")
    again.load_state_dict(rollbacks.state_dict())
    assert again.taken == rollbacks.taken and [t["lr_scale"] for t in again.taken] == [0.5, 0.25, 0.125]


def test_what_rolls_back():
    rollbacks = monitor.Rollbacks(most=1, at=0.9, cut=0.5, fmt="valid_rate")
    best = {"eval_valid_rate": 0.6}
    assert rollbacks.why({"eval_one_answer": 0.95}, {}, best) == "the held-out one-answer share is 0.95 (>= 0.9)"
    assert rollbacks.why({"eval_one_answer": 0.85, "eval_valid_rate": 0.31}, {}, best) is None
    assert rollbacks.why({"eval_one_answer": 0.2, "eval_valid_rate": 0.3}, {}, best) == \
        "the held-out valid_rate is 0.30, at most half the best evaluation's 0.60"
    assert rollbacks.why({"eval_valid_rate": 0.0}, {}, None) is None          # no evaluation to compare with
    assert rollbacks.why({}, {"nonfinite": ["loss", "grad"]}, best) == "non-finite loss and grad"
    assert rollbacks.why({}, {"nonfinite": []}, best) is None


@pytest.mark.slow                  # a multi-process fault test: the slow tier (README)
def test_a_run_killed_after_its_rollback_resumes_whole(tmp_path):
    argv = [*DESTRUCTIVE, "--steps", "30", "--rollback", "2", "--save-every", "5"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv, "--out", str(killed)], cwd=ROOT)
    log, deadline = killed / "metrics.jsonl", time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (log.exists() and '"rollback"' in log.read_text()):
        time.sleep(0.01)
    proc.kill()                                                   # SIGKILL, right after the rollback's line
    proc.wait()
    assert any("rollback" in r for r in read(killed / "metrics.jsonl")), "killed before its rollback"
    train.train(config.parse_config(["--resume", str(killed), "--quiet"]))
    train.train(config.parse_config([*argv, "--out", str(tmp_path / "straight")]))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(read(killed / "metrics.jsonl")) == strip(read(tmp_path / "straight" / "metrics.jsonl"))
    assert json.loads((killed / "summary.json").read_text())["rollbacks"] == \
        json.loads((tmp_path / "straight" / "summary.json").read_text())["rollbacks"]


@pytest.mark.slow                  # two processes: the slow tier (README)
def test_under_torchrun_every_rank_rolls_back_at_the_same_step(tmp_path):
    """Rank 0 alone evaluates; the rollback is agreed and taken on both ranks: the job ends (no rank
    waits in a collective the other skipped) and the weights it saves after the rollback are the
    best's, as in one process."""
    out = tmp_path / "ranks"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(ROOT / "train.py"), *DESTRUCTIVE, "--seed", "2", "--steps", "30", "--rollback", "1",
                    "--out", str(out)],       # on two ranks seed 2 is on one answer at step 25
                   cwd=ROOT, check=True, timeout=300)
    taken = [r["rollback"] for r in read(out / "metrics.jsonl") if "rollback" in r]
    assert len(taken) == 1 and taken[0]["to"] == 0
    back = weights(out / "checkpoints" / f"step-{taken[0]['step']:06d}")
    best = weights(out / "checkpoints" / "step-000000")
    assert all(torch.equal(back[k], best[k]) for k in best)


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "1"], ["--algo", "ppo"], ["--beta", "0.04", "--kl-control", "proportional"]],
                         ids=["full", "lora", "ppo", "kl-control"])
def test_a_rollback_restores_what_shapes_training(tmp_path, monkeypatch, extra):
    """Made to fire at step 6's evaluation: the weights (LoRA: its adapters), PPO's value head and
    beta's controller are the best checkpoint's again; the prompts' sampler draws what it drew then."""
    monkeypatch.setattr(monitor.Rollbacks, "why", lambda self, row, stats, best: "made to" if row.get("step") == 6 and
                        "eval_one_answer" in row else None)
    out = tmp_path / "run"
    train.train(config.parse_config(["--steps", "8", "--batch", "2", "--k", "4", "--eval-every", "3",
                                     "--eval-samples", "1", "--sft-steps", "30", "--hidden", "16", "--layers", "1",
                                     "--quiet", "--cache-dir", str(WARM_STARTS), "--rollback", "1",
                                     "--out", str(out), *extra]))
    rows = {r["step"]: r for r in read(out / "metrics.jsonl")}
    to = rows[6]["rollback"]["to"]
    back = torch.load(out / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=True)
    best = torch.load(out / "checkpoints" / f"step-{to:06d}" / "trainer_state.pt", weights_only=True)
    assert back["python_rng"] == best["python_rng"]                       # the data position
    for name in ("kl_control", "value_head"):
        if name in best["controllers"]:
            a, b = back["controllers"][name], best["controllers"][name]
            assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in b), name
    if "adapters" in best:
        assert all(torch.equal(back["adapters"][k], best["adapters"][k]) for k in best["adapters"])
    a, b = weights(out / "checkpoints" / "step-000006"), weights(out / "checkpoints" / f"step-{to:06d}")
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert back["controllers"]["rollbacks"]["taken"] == [rows[6]["rollback"]]


def test_a_rollback_it_cannot_take_is_said():
    rollbacks = monitor.Rollbacks(most=1, at=0.9, cut=0.5, fmt="valid_rate")
    assert rollbacks.cannot(None, "checkpoints/step-000000") is None
    assert rollbacks.cannot("junk", None) == "junk; no checkpoint to go back to yet"
    assert rollbacks.cannot("junk", "checkpoints/step-000000") is None
    rollbacks.taken.append({})
    assert rollbacks.cannot("junk", "checkpoints/step-000000") == "junk; no rollback left (--rollback 1)"
