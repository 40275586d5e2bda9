"""entropy_control.py against a re-implementation of TRL's adaptive entropy control
(Skywork-OR1), its lesson, a resumed run that continues it, and its flags; and DAPO's
overlong filtering (--mask-truncated, rewards.mask_truncated)."""
import json
import math

import pytest
import torch

import grpo
import rewards
from conftest import assert_refused_in_one_line, configure, WARM_STARTS, quick, synthetic_batch, tiny_model
from entropy_control import AdaptiveEntropy


def trl_adaptive(entropies, coef, target, delta, coef_min, coef_max):
    """TRL GRPOTrainer's use_adaptive_entropy, one optimizer step per entropy: the coefficient
    each step applies, as grpo_trainer.py computes it (apply_coef, then the window's update)."""
    last, applied = float("inf"), []
    for h in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, coef_max) if h <= target else max(coef - delta, coef_min)
        last = h
    return applied


@pytest.mark.lesson
def test_the_controller_equals_trls_and_pushes_only_while_entropy_is_low():
    """Entropy above the target (0.5): no bonus at all, its weight sinking to 0; once the
    entropy falls below, the bonus applies and grows by delta a step until the entropy is back."""
    entropies = [0.9, 0.8, 0.6, 0.45, 0.3, 0.2, 0.25, 0.4, 0.55, 0.7]
    ctl, applied = AdaptiveEntropy(0.01, 0.5, 0.005, 0.02), []
    for h in entropies:
        applied.append(ctl.applied())
        ctl.update(h)
    ref = trl_adaptive(entropies, 0.01, 0.5, 0.005, 0.0, 0.02)
    assert applied == pytest.approx(ref)
    assert applied[:4] == [0.0] * 4                        # above the target: never applied
    assert applied[4:8] == pytest.approx([0.005, 0.01, 0.015, 0.02])   # below: growing to the cap (0.02)
    assert applied[9] == 0.0                               # back above: off again


def test_its_state_round_trips():
    ctl = AdaptiveEntropy(0.01, 0.5)
    ctl.update(0.1)
    other = AdaptiveEntropy(0.01, 0.5)
    other.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert (other.coef, other.last_entropy, other.applied()) == (ctl.coef, ctl.last_entropy, ctl.applied())
    assert AdaptiveEntropy(0.01, 0.5).last_entropy == math.inf


def metrics(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_a_run_applies_what_the_controller_says_and_a_resume_continues_it(tmp_path):
    """Each step's entropy_coef is the controller's applied weight, from the entropies the run
    measured; a run stopped at step 3 and resumed logs the same weights as one that was not."""
    from running import config
    import train
    flags = ["--entropy-target", "3", "--entropy-coef", "0.002", "--epochs", "2", "--hidden", "64", "--layers", "2",
             "--sft-steps", "60", "--batch", "4", "--k", "8"]          # a warm start that earns rewards
    train.train(configure(quick(tmp_path, "whole", "--steps", "6", *flags)))
    rows = metrics(tmp_path / "whole")[1:]
    ctl, expected = AdaptiveEntropy(0.002, 3.0), []
    for r in rows:
        expected.append(ctl.applied())
        if r["steps_taken"]:
            ctl.update(r["entropy"])
    assert [r["entropy_coef"] for r in rows] == pytest.approx(expected)
    assert any(c > 0 for c in expected)                                  # the bonus did apply
    train.train(configure(quick(tmp_path, "cut", "--steps", "3", "--save-every", "3", *flags,
                                          "--cache-dir", str(WARM_STARTS))))
    train.train(config.parse_config(["--resume", str(tmp_path / "cut"), "--steps", "6"]))
    assert [r["entropy_coef"] for r in metrics(tmp_path / "cut")[1:]] == pytest.approx(expected)


@pytest.mark.parametrize("argv, message", [
    (["--entropy-target", "-1"], "--entropy-target: must be >= 0"),
    (["--entropy-target", "0.3", "--entropy-coef-delta", "0"], "--entropy-coef-delta: must be > 0"),
    (["--entropy-coef-delta", "0.5"], "--entropy-coef-delta: only --entropy-target reads it"),
    (["--entropy-target", "0.3", "--entropy-coef", "2"], "--entropy-coef: adaptive control keeps the weight at most 1.0"),
    (["--entropy-target", "0.3", "--entropy-coef-end", "0.001"], "--entropy-coef-end: a decay schedule and"),
    (["--entropy-target", "0.3", "--algo", "rce"], "--entropy-target: only --algo grpo and ppo use it"),
])
def test_bad_entropy_control_settings_are_refused_in_one_line(argv, message, tmp_path, capsys):
    assert_refused_in_one_line(tmp_path, capsys, argv, message)


# ---- DAPO's overlong filtering ----

@pytest.mark.lesson
def test_a_truncated_completion_leaves_the_loss_as_if_it_were_not_in_the_batch():
    """--mask-truncated: GRPO's token-mean loss over a batch with two rows cut at the limit,
    and its gradient, equal those of the same batch without the two rows (their advantages
    kept as they were), by hand; the attention the forward uses is unchanged."""
    model = tiny_model()
    batch = synthetic_batch(model)
    batch.truncated = torch.zeros(8, dtype=torch.bool)
    batch.truncated[[1, 4]] = True
    attention = batch.attention().clone()
    hp = grpo.HyperParams(mini_batch=8, micro_batch=8)
    logp = (batch.old_logp + 0.1).requires_grad_(True)

    def loss_and_grad(rows_mask, keep):
        m = rows_mask[keep]
        ratio = torch.exp(logp[keep] - batch.old_logp[keep])
        a = batch.advantages[keep].unsqueeze(1)
        per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        loss = (per_token * m).sum() / m.sum()
        return loss, torch.autograd.grad(loss, logp)[0]
    keep = torch.tensor([i not in (1, 4) for i in range(8)])
    want, want_grad = loss_and_grad(batch.completion_mask.float(), keep)
    batch = rewards.mask_truncated(batch)
    rows = batch.rows(torch.arange(8))
    per_token, _ = grpo.policy_loss(logp, batch.old_logp, torch.zeros_like(logp), rows, hp)
    got = grpo.aggregate(per_token, rows.mask, "token-mean", 8, rows.mask.sum(), 24)
    got_grad = torch.autograd.grad(got, logp)[0]
    assert torch.allclose(got, want) and torch.allclose(got_grad, want_grad)
    assert torch.equal(batch.attention(), attention)


def test_every_completion_cut_means_no_update_said_by_its_reason(tmp_path):
    """A limit of 2 tokens cuts every completion: with --mask-truncated nothing is left to train
    on, and the step says so (update_skipped: all_truncated) instead of stepping AdamW on nothing."""
    from running import config
    import train
    train.train(configure(quick(tmp_path, "cut", "--max-new-tokens", "2", "--mask-truncated", "--device", "cpu",
                                          "--entropy-coef", "0.01")))
    rows = metrics(tmp_path / "cut")[1:]
    assert all(r["completions/clipped_ratio"] == 1.0 and r["update_skipped"] == "all_truncated"
               and not r["updated"] for r in rows)
