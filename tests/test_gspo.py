"""GSPO (--ratio-level sequence, report 001's fix E) against hand arithmetic: the sequence
ratio, the loss and its gradient unclipped and clipped, a plain loop over sequences, and
equality with the token-level loss when every sequence has one token."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from running import config
import grpo
import surrogates
import logprobs
import train
from conftest import grpo_update, quick, synthetic_batch, tiny_model


@pytest.mark.lesson
def test_the_sequence_ratio_is_the_geometric_mean_of_its_token_ratios_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, -0.1, 5.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])                 # the 5.0 is padding: left out
    s = grpo.importance_ratio(logp, old, mask, "sequence")
    assert s.shape == (2, 1)
    assert s.squeeze(1).tolist() == pytest.approx([math.exp((0.2 - 0.1) / 2), math.exp(0.3)])
    assert torch.allclose(grpo.importance_ratio(logp, old, mask, "token"), torch.exp(logp))


def gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2):
    """The loss as the GSPO paper writes it, a plain loop: mean over sequences of L_i."""
    losses = []
    for i in range(len(logp)):
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in tokens) / len(tokens))
        losses.append(-torch.min(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return sum(losses) / len(losses)


def our_loss(logp, old, adv, mask, agg="seq-mean-token-mean", eps_low=0.2, eps_high=0.2, level="sequence"):
    loss, _, _ = surrogates.ppo_clip(grpo.importance_ratio(logp, old, mask, level), adv, eps_low, eps_high)
    return grpo.aggregate(loss.expand_as(logp), mask, agg, len(logp), int(mask.sum()), logp.shape[1])


@pytest.mark.lesson
def test_unclipped_gradient_is_minus_a_s_over_the_length_by_hand():
    # one sequence of 3 policy tokens and a padding token; A = 2, ratio inside the clip range
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    logp = (old + torch.tensor([[0.1, -0.05, 0.04, 9.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = our_loss(logp, old, torch.tensor([2.0]), mask)
    s = math.exp((0.1 - 0.05 + 0.04) / 3)
    assert loss.item() == pytest.approx(-2.0 * s, rel=1e-6)
    loss.backward()
    assert logp.grad[0, :3].tolist() == pytest.approx([-2.0 * s / 3] * 3, rel=1e-5)
    assert logp.grad[0, 3].item() == 0.0, "padding gets no gradient"


@pytest.mark.parametrize("shift, adv", [(0.3, 1.0), (-0.3, -1.0)])
@pytest.mark.lesson
def test_clipped_sequence_gets_no_gradient(shift, adv):
    # A > 0 with s above 1 + eps, or A < 0 with s below 1 - eps: the min keeps the clipped term
    old = torch.zeros(1, 2)
    logp = torch.full((1, 2), shift, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.long)
    loss = our_loss(logp, old, torch.tensor([adv]), mask, eps_low=3e-4, eps_high=4e-4)
    bound = 1 + 4e-4 if adv > 0 else 1 - 3e-4
    assert loss.item() == pytest.approx(-bound * adv, rel=1e-6)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    _, low, high = surrogates.ppo_clip(grpo.importance_ratio(logp, old, mask, "sequence"), torch.tensor([adv]),
                                       3e-4, 4e-4)
    clipped = low | high
    assert clipped.shape == (1, 1) and clipped.all(), "one ratio per sequence, clipped as a whole"


@pytest.mark.lesson
def test_loss_and_gradient_match_a_plain_loop_over_sequences():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 6, generator=gen) * 3
    logp = (old + 0.2 * torch.randn(5, 6, generator=gen)).requires_grad_()
    mask = torch.ones(5, 6, dtype=torch.long)
    for i, n in enumerate([6, 3, 1, 4, 2]):
        mask[i, n:] = 0
    adv = torch.randn(5, generator=gen)
    ours = our_loss(logp, old, adv, mask, eps_low=0.05, eps_high=0.05)
    g_ours, = torch.autograd.grad(ours, logp)
    ref = gspo_loss(logp, old, adv, mask, 0.05, 0.05)
    g_ref, = torch.autograd.grad(ref, logp)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(g_ours, g_ref, atol=1e-7)
    assert 0 < (g_ours.abs().sum(1) == 0).sum() < 5, "the draw clips some sequences and not others"


@pytest.mark.parametrize("agg", grpo.AGGREGATIONS)
@pytest.mark.lesson
def test_one_token_sequences_give_the_token_level_loss_and_gradient(agg):
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 1, generator=gen)
    logp = (old + 0.4 * torch.randn(8, 1, generator=gen)).requires_grad_()
    mask = torch.ones(8, 1, dtype=torch.long)
    adv = torch.randn(8, generator=gen)
    seq = our_loss(logp, old, adv, mask, agg, level="sequence")
    tok = our_loss(logp, old, adv, mask, agg, level="token")
    g_seq, = torch.autograd.grad(seq, logp)
    g_tok, = torch.autograd.grad(tok, logp)
    assert seq.item() == pytest.approx(tok.item(), rel=1e-6)
    assert torch.allclose(g_seq, g_tok, atol=1e-7)


def test_policy_loss_reads_the_ratio_level_from_the_hyper_params():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.2, 0.0]])
    rows = SimpleNamespace(mask=torch.tensor([[1, 1, 1], [1, 1, 0]]), advantages=torch.tensor([1.0, -1.0]),
                           ref_logp=None, is_weight=None)
    hp = grpo.HyperParams(mini_batch=2, micro_batch=2, ratio_level="sequence", clip_eps=0.5, clip_eps_high=0.5)
    per_token, _ = grpo.policy_loss(logp, old, torch.zeros(2, 3), rows, hp)
    assert per_token[0].tolist() == pytest.approx([-math.exp(0.2)] * 3)
    assert per_token[1, :2].tolist() == pytest.approx([math.exp(-0.1)] * 2)


def updated_weights(level: str, batch_old_logp: str):
    """The tiny model's weights after one GRPO update at this ratio level (seq-mean-token-mean)."""
    model = tiny_model()
    batch = synthetic_batch(model)
    if batch_old_logp == "on-policy":
        batch.old_logp = None                     # the policy that sampled is this one: ratio 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hp = grpo.HyperParams(mini_batch=8, micro_batch=8, ratio_level=level, loss_agg="seq-mean-token-mean",
                          clip_eps=3e-4, clip_eps_high=4e-4)
    stats = grpo_update(logprobs.Scorer(model), opt, batch, hp)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), stats


@pytest.mark.lesson
def test_on_policy_gspo_is_token_level_grpo_with_the_sequence_mean():
    # One update on fresh samples: every s_i = 1, never clipped, and -A_i * s_i / |y_i| is the
    # token-level gradient of seq-mean-token-mean. GSPO changes nothing until the samples
    # are off-policy (a second epoch, a later mini-batch): it cannot touch K=2's +-1, which
    # lives in the advantage (lab.group_norm runs it at report 001's on-policy setting).
    seq, seq_stats = updated_weights("sequence", "on-policy")
    tok, _ = updated_weights("token", "on-policy")
    assert torch.allclose(seq, tok, atol=1e-6) and seq_stats["clip_frac"] == 0.0
    seq_off, off_stats = updated_weights("sequence", "off-policy")
    tok_off, _ = updated_weights("token", "off-policy")
    assert not torch.allclose(seq_off, tok_off, atol=1e-4) and off_stats["clip_frac"] > 0, \
        "off-policy (old log-probs 0.05 away) the two ratios differ"


def test_a_gspo_run_writes_its_ratio_level(tmp_path):
    summary = train.train(config.parse_config(quick(tmp_path, "gspo", "--ratio-level", "sequence",
                                                    "--clip-eps", "3e-4", "--clip-eps-high", "4e-4")))
    assert summary["steps"] == 3
    assert json.loads((tmp_path / "gspo" / "config.json").read_text())["ratio_level"] == "sequence"


@pytest.mark.parametrize("argv", [["--algo", "ppo", "--ratio-level", "sequence"],
                                  ["--algo", "rce", "--ratio-level", "sequence"],
                                  ["--ratio-level", "word"]])
def test_sequence_ratio_outside_grpo_exits_2_naming_the_flag(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--ratio-level" in err, err


def test_the_sequence_ratio_alone_brings_gspos_clip_and_mean_and_says_so(tmp_path, capsys):
    """GSPO's paper and verl clip the sequence ratio at 3e-4 / 4e-4 and average over
    sequences; with PPO's 0.2 a length-normalised ratio is hardly ever clipped."""
    cfg = config.parse_config(quick(tmp_path, "a", "--ratio-level", "sequence"))
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    hp = config.hyper_params(cfg)
    assert surrogates.clip_range(hp) == (3e-4, 4e-4)
    given = config.parse_config(quick(tmp_path, "b", "--ratio-level", "sequence", "--clip-eps", "0.01"))
    assert (given.clip_eps, given.clip_eps_high, given.loss_agg) == (0.01, 4e-4, "seq-mean-token-mean")
    token = config.parse_config(quick(tmp_path, "c"))
    assert (token.clip_eps, token.clip_eps_high, token.loss_agg) == (0.2, 0.0, "token-mean")
    argv = quick(tmp_path, "run", "--ratio-level", "sequence", "--steps", "1")
    argv.remove("--quiet")
    train.train(config.parse_config(argv))
    assert "GSPO (--ratio-level sequence): --clip-eps 0.0003 --clip-eps-high 0.0004 --loss-agg seq-mean-token-mean" \
        in capsys.readouterr().err


# ---- LUSPO: GSPO's clip, a sequence's loss summed over its tokens ----

def trl_luspo(per_token_logps, old_per_token_logps, advantages, mask, epsilon_low, epsilon_high):
    """TRL's GRPOTrainer, loss_type="luspo" with importance_sampling_level="sequence"."""
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return (per_token_loss * mask.sum(1, keepdim=True)).mean()


def test_luspo_is_trls_in_value_and_gradient():
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(6, 5, generator=gen) * 2
    logp = (old + 0.1 * torch.randn(6, 5, generator=gen)).requires_grad_(True)
    adv = torch.randn(6, generator=gen)
    mask = torch.ones(6, 5)
    mask[0, 2:], mask[3, 4:] = 0, 0
    mine = our_loss(logp, old, adv.unsqueeze(1), mask, agg="seq-mean-token-sum", eps_low=3e-4, eps_high=4e-4)
    theirs = trl_luspo(logp, old, adv.unsqueeze(1), mask, 3e-4, 4e-4)
    torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(*(torch.autograd.grad(x, logp)[0] for x in (mine, theirs)))


@pytest.mark.lesson
def test_luspo_weighs_a_sequence_by_its_length_where_gspo_weighs_each_alike():
    """Two sequences at ratio 1 with one advantage, of 2 and 6 tokens: under GSPO's mean over
    sequences each token of the short one gets 3x the long one's gradient (A s / |y|), so the two
    sequences pull alike; under LUSPO every token gets A s: the long one pulls 3x as hard."""
    old = torch.zeros(2, 6)
    mask = torch.tensor([[1.0] * 2 + [0.0] * 4, [1.0] * 6])
    grads = {}
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        logp = old.clone().requires_grad_(True)
        (grads[agg],) = torch.autograd.grad(our_loss(logp, old, torch.ones(2, 1), mask, agg=agg), logp)
    gspo, luspo = grads["seq-mean-token-mean"] * mask, grads["seq-mean-token-sum"] * mask
    # GSPO: -A s / (|y| B) a token: -1/4 and -1/12; each sequence's tokens sum to -1/2
    assert gspo[0, 0].item() == pytest.approx(-1 / 4) and gspo[1, 0].item() == pytest.approx(-1 / 12)
    assert gspo.sum(1).tolist() == pytest.approx([-0.5, -0.5])
    # LUSPO: -A s / B = -1/2 a token, whatever the length; the sequences sum to -1 and -3
    assert luspo[mask.bool()].tolist() == pytest.approx([-0.5] * 8)
    assert luspo.sum(1).tolist() == pytest.approx([-1.0, -3.0])


def test_luspo_needs_the_sequence_ratio_and_brings_its_own_sum(tmp_path, capsys):
    from conftest import assert_refused_in_one_line, configure
    assert_refused_in_one_line(tmp_path, capsys, ["--policy-loss", "luspo"], "--policy-loss: luspo is GSPO's clip")
    cfg = configure(quick(tmp_path, "l", "--policy-loss", "luspo", "--ratio-level", "sequence"))
    assert (cfg.loss_agg, cfg.clip_eps, cfg.clip_eps_high) == ("seq-mean-token-sum", 3e-4, 4e-4)
