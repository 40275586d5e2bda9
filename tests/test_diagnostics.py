"""The diagnostics users look for, named as TRL names them (diagnostics.py), and the two
silent no-ops said once, in plain words, at the step they happen."""
import json

import pytest
import torch

import grpo
import logprobs
import update
from conftest import quick, synthetic_batch, tiny_model
import diagnostics
from running import report
from lab import compare


def test_completion_lengths_against_a_hand_count():
    lengths = torch.tensor([3, 6, 6, 1])
    truncated = torch.tensor([False, True, True, False])
    out = diagnostics.completion_lengths(lengths, truncated)
    assert out == {"completions/mean_length": 4.0, "completions/min_length": 1.0, "completions/max_length": 6.0,
                   "completions/mean_terminated_length": 2.0, "completions/clipped_ratio": 0.5}
    every_cut = diagnostics.completion_lengths(lengths, torch.ones(4, dtype=torch.bool))
    assert every_cut["completions/mean_terminated_length"] == 0.0, "TRL logs 0 when no completion ended"


@pytest.mark.lesson
def test_loss_is_zero_when_every_ratio_is_one_and_advantages_are_centred():
    """TRL #3452, "loss is 0": in the first epoch every ratio is 1, so GRPO's loss is
    -sum_i A_i * (tokens of i) / tokens, and with centred advantages and equal lengths that is 0;
    the gradient, A_i * grad log p, is not."""
    model = tiny_model(1)
    batch = synthetic_batch(model, n=4)
    batch.completion_mask = torch.ones_like(batch.completion_mask)       # equal lengths
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])               # centred
    batch.old_logp, batch.ref_logp = None, None                           # --fast: old = this forward's
    hp = grpo.HyperParams(mini_batch=4, micro_batch=4, k=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = update.update(logprobs.Scorer(model), opt, batch, hp, grpo.loss)
    assert stats["loss"] == pytest.approx(0.0, abs=1e-7)
    assert stats["grad_norm"] > 1e-3, "zero loss, but a real gradient"


def test_a_run_whose_completions_are_all_cut_says_so_once(tmp_path, capsys):
    """--max-new-tokens 1: nothing can end (TRL #5697); said once, at step 1, and every
    step's completions/clipped_ratio is 1."""
    from running import config
    import train
    argv = quick(tmp_path, "cut", "--max-new-tokens", "1", "--device", "cpu")
    argv.remove("--quiet")
    train.train(config.parse_config(argv))
    err = capsys.readouterr().err
    assert err.count("every completion was cut at --max-new-tokens 1") == 1 and "step 1:" in err
    rows = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")][1:]
    assert all(r["completions/clipped_ratio"] == 1.0 and r["completions/max_length"] == 1 for r in rows)


def test_a_step_whose_every_group_has_one_reward_says_so_once(tmp_path, capsys):
    from running import config
    import train
    argv = quick(tmp_path, "flat", "--steps", "4")
    argv.remove("--quiet")
    train.train(config.parse_config(argv))
    rows = [json.loads(line) for line in open(tmp_path / "flat" / "metrics.jsonl")][1:]
    err = capsys.readouterr().err
    flat = [r["step"] for r in rows if r["frac_reward_zero_std"] == 1.0]
    assert len(flat) >= 2, "this tiny, barely warmed-up model writes one thing per prompt (the premise)"
    assert err.count("got the same reward, so every advantage is 0") == 1
    assert f"step {flat[0]}: every group's" in err


@pytest.mark.parametrize("adv_abs_mean, said", [(0.0, True), (0.66, False)])
def test_one_reward_a_group_is_called_zero_advantages_only_when_they_are(adv_abs_mean, said):
    """K=1 under global norm (every group trivially one reward, advantages r - batch mean: mean
    |A| 0.66 in a run) and RCE's weights: the "every advantage is 0" line was false there."""
    lines = diagnostics.silent_no_ops({"step": 3, "frac_reward_zero_std": 1.0, "adv_abs_mean": adv_abs_mean},
                                      k=1, new_tokens=24)
    assert any("every advantage is 0" in line for line in lines.values()) == said, lines


def test_the_ratio_extremes_are_the_whole_batchs_over_its_micro_batches():
    """ratio_min / ratio_max of an update (one epoch, lr 0) are the min and max of
    exp(logp - logp_old) over every policy token of the batch, by a plain forward, though the
    update saw them three sequences at a time."""
    model = tiny_model()
    batch = synthetic_batch(model)
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, batch.tokens())
    ratio = torch.exp(logp - batch.old_logp)[batch.completion_mask.bool()]
    stats = update.update(logprobs.Scorer(model), torch.optim.SGD(model.parameters(), lr=0.0), batch,
                          grpo.HyperParams(mini_batch=8, micro_batch=3), grpo.loss)
    assert stats["ratio_min"] == pytest.approx(ratio.min().item(), rel=1e-5)
    assert stats["ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-5)
    assert stats["ratio_min"] < 1 < stats["ratio_max"]


# ---- clip fractions, counted as the anchors count them ----

def clip_fracs(logp, old, adv, mask, **knobs):
    """(clip_frac_low, clip_frac_high, clip_frac) of grpo.policy_loss, through update.UpdateStats."""
    from rollout import Rows
    hp = grpo.HyperParams(mini_batch=len(mask), micro_batch=len(mask), **knobs)
    rows = Rows(tokens=None, mask=mask, old_logp=old, ref_logp=None, advantages=adv, old_values=None, returns=None)
    _, sums = grpo.policy_loss(logp, old, torch.zeros_like(logp), rows, hp)
    stats = update.UpdateStats()
    stats.new_epoch()
    stats.add(0.0, sums, mask)
    stats.stepped(0.0, [])
    stats.end_epoch()
    out = stats.result()
    return out["clip_frac_low"], out["clip_frac_high"], out["clip_frac"]


def clip_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(8, 6, generator=gen) * 2
    logp = old + 1.5 * torch.randn(8, 6, generator=gen)              # ratios far from 1: many clipped
    adv = torch.randn(8, generator=gen)
    mask = torch.ones(8, 6)
    mask[1, 2:], mask[5, 4:], mask[6, 1:] = 0, 0, 0                    # sequences of unequal length
    return logp, old, adv, mask


def test_cispo_counts_a_capped_token_high_only_with_a_positive_advantage_as_trl():
    logp, old, adv, mask = clip_inputs(1)
    r, a = torch.exp(logp - old), adv.unsqueeze(1).expand_as(logp)
    trl = (((r > 1.5) & (a > 0)).float() * mask).sum() / mask.sum()    # TRL: is_cispo_clipped, token mean
    low, high, _ = clip_fracs(logp, old, adv, mask, policy_loss="cispo", cispo_max=1.5)
    assert high == pytest.approx(trl.item()) and low == 0.0
    assert (((r > 1.5) & (a < 0)).float() * mask).sum() > 0, "the inputs hold A < 0 tokens past the cap"


def test_dual_clips_cap_is_counted_in_the_lower_fraction_as_verls():
    logp, old, adv, mask = clip_inputs(2)
    r, a = torch.exp(logp - old), adv.unsqueeze(1).expand_as(logp)
    ppo_low = (r < 0.8) & (a < 0)
    clip1 = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    capped = (clip1 > -a * 3.0) & (a < 0)                                # verl: pg_clipfrac_lower's tokens
    low, high, _ = clip_fracs(logp, old, adv, mask, policy_loss="dual-clip", dual_clip_c=3.0)
    assert capped[mask.bool()].any(), "the inputs hold capped tokens"
    assert low == pytest.approx((((ppo_low | capped)).float() * mask).sum().item() / mask.sum().item())
    assert high == pytest.approx((((r > 1.2) & (a > 0)).float() * mask).sum().item() / mask.sum().item())


def test_under_gspo_the_clip_fractions_are_shares_of_sequences_as_trls():
    logp, old, adv, mask = clip_inputs(3)
    logp = old + 0.002 * torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))                    # (8,) GSPO's s_i
    low_t, high_t = (s < 1 - 3e-4) & (adv < 0), (s > 1 + 4e-4) & (adv > 0)      # TRL: coef_1 (B, 1), x.mean()
    low, high, frac = clip_fracs(logp, old, adv, mask, ratio_level="sequence", clip_eps=3e-4, clip_eps_high=4e-4)
    assert (low_t | high_t).any() and not (low_t | high_t).all()
    assert (low, high, frac) == pytest.approx((low_t.float().mean().item(), high_t.float().mean().item(),
                                               (low_t | high_t).float().mean().item()))


def test_a_message_on_a_terminal_erases_the_progress_line_it_follows(monkeypatch):
    """A monitor alert printed over the progress line (written with \\r) kept that line's tail."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    for tty, want in ((True, "\r\033[Kstep 3: monitor alert\n"), (False, "step 3: monitor alert\n")):
        out = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", out)
        report.say("step 3: monitor alert")
        assert out.getvalue() == want


def test_every_key_a_run_writes_is_a_documented_metric(tmp_path):
    """docs/metrics.md lists every metric with its formula; lab.compare --metrics
    accepts those (lab.compare.is_metric). A key a run writes and the list lacks fails here."""
    from running import config
    import train
    for name, extra in (("grpo", ()), ("ppo", ("--algo", "ppo", "--beta", "0.05")),
                        ("tools", ("--task", "tools", "--difficulty", "2")),
                        ("m", ("--log-mismatch", "--rollout-correction", "tis", "--entropy-target", "0.2"))):
        train.train(config.parse_config(quick(tmp_path, name, "--steps", "2", *extra)))
        keys = {k for line in open(tmp_path / name / "metrics.jsonl") for k in json.loads(line)}
        undocumented = sorted(k for k in keys if not compare.is_metric(k))
        assert not undocumented, f"{name}: metrics.jsonl keys not in docs/metrics.md's list: {undocumented}"

