"""Lesson 15: what popular RL code gets wrong (mistakes.py). Each test computes the course's
quantity and the mistaken one on the same inputs - exact enumeration over a small vocabulary,
hand arithmetic or a plain loop - says how far apart they are, and fails if the mistake is put in
place of ours."""
import math

import pytest
import torch

import grpo
import kl
import logprobs
import mistakes
import surrogates
import truncation
from conftest import grpo_update, synthetic_batch, tiny_model
from grpo import HyperParams


def token_gradient(loss_fn, r: float, a: float) -> float:
    """d loss / d log r for one token at ratio r with advantage a."""
    log_r = torch.tensor([[math.log(r)]], requires_grad=True)
    loss, _, _ = loss_fn(log_r.exp(), torch.tensor([a]), 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss.sum(), log_r)
    return grad.item()


@pytest.mark.lesson
def test_the_inverted_clip_turns_the_trust_region_inside_out_for_negative_advantages():
    """PPO, A = -1: a bad token whose ratio rose to 1.5 is pulled back (gradient r = 1.5 on
    log r); one already pushed to 0.5 is left alone (0). The inverted clip does the opposite:
    nothing pulls the first back, the second keeps falling. For A > 0 the two agree, and at
    reasoning-from-scratch's eps = 10 no ratio reaches the bound, so there too."""
    ppo, inverted = surrogates.ppo_clip, mistakes.clip_inverted
    assert token_gradient(ppo, 1.5, -1.0) == pytest.approx(1.5) and token_gradient(ppo, 0.5, -1.0) == 0.0
    assert token_gradient(inverted, 1.5, -1.0) == 0.0 and token_gradient(inverted, 0.5, -1.0) == pytest.approx(0.5)
    for r in (0.5, 0.9, 1.1, 1.5):
        assert token_gradient(inverted, r, 1.0) == token_gradient(ppo, r, 1.0)
    ratio, adv = torch.tensor([[0.05, 0.5, 1.5, 5.0]]), torch.tensor([-1.0])
    torch.testing.assert_close(inverted(ratio, adv, 10.0, 10.0)[0], ppo(ratio, adv, 10.0, 10.0)[0])
    # --policy-loss clip-inverted dispatches to it, with --clip-eps
    hp = HyperParams(policy_loss="clip-inverted", clip_eps=0.2)
    loss, low, high = surrogates.policy_gradient_loss(torch.log(ratio), torch.zeros(1, 4), adv, torch.ones(1, 4), hp)
    torch.testing.assert_close(loss, -torch.tensor([[-0.05, -0.5, -1.2, -1.2]]))
    assert low.tolist() == [[False, False, False, False]] and high.tolist() == [[False, False, True, True]]


def gradients(agg: str, micro: int) -> torch.Tensor:
    model = tiny_model()
    batch = synthetic_batch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grpo_update(logprobs.Scorer(model), opt, batch, HyperParams(mini_batch=8, micro_batch=micro, loss_agg=agg,
                                                                max_len=6))
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.lesson
def test_a_token_mean_over_the_micro_batch_makes_the_gradient_depend_on_the_cut():
    """nanochat's normalisation: one micro-batch of 8 gives the token mean; four of 2 sequences
    of unequal lengths give another gradient. Ours (token-mean) is the same either way. By a
    plain loop, the mistaken loss is the sum over micro-batches of (their token sum / their
    tokens) / the number of micro-batches."""
    ours = [gradients("token-mean", m) for m in (8, 2)]
    theirs = [gradients("micro-token-mean", m) for m in (8, 2)]
    torch.testing.assert_close(ours[0], ours[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(theirs[0], ours[0], rtol=1e-5, atol=1e-7)          # one micro-batch: the same
    gap = (theirs[1] - ours[1]).norm() / ours[1].norm()
    assert gap > 0.05, gap                              # 0.088 on this machine
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]])
    mask = (loss != 0).float()
    loop = sum((loss[i:i + 2] * mask[i:i + 2]).sum() / mask[i:i + 2].sum() for i in (0, 2)) / 2
    said = sum(mistakes.micro_token_mean(loss[i:i + 2], mask[i:i + 2], 4) for i in (0, 2))
    assert said.item() == pytest.approx(loop.item()) == pytest.approx((7 / 5 + 9 / 3) / 2)
    assert (loss * mask).sum().item() / mask.sum().item() == pytest.approx(16 / 8)       # the batch's token mean


@pytest.mark.lesson
def test_sampling_at_t_0_8_and_top_p_0_9_and_scoring_at_t_1_makes_on_policy_ratios_differ_from_1():
    """Exactly, over a vocabulary of 6: the sampler q (T = 0.8, top-p 0.9) and the scorer p (T = 1,
    all tokens). Every ratio p / q that can be drawn is off 1; E_q[log r] = -KL(q || p) < 0,
    and E_q[r] is the scorer's mass on the nucleus, below 1. Scoring with the sampler's own
    distribution (the fix: --temperature for both, --mask-replay) gives 1 everywhere."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0], dtype=torch.float64)
    q, r = mistakes.sampled_ratio(logits, 0.8, 0.9)
    drawn = q > 0
    temp = torch.softmax(logits / 0.8, -1)
    order = temp.argsort(descending=True)                  # by hand: the nucleus of the tempered softmax
    n = next(i for i in range(1, 7) if temp[order[:i]].sum() >= 0.9)
    assert drawn.sum().item() == n and 1 < n < 6
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(r[drawn], p[drawn] / (temp[drawn] / temp[drawn].sum()))
    assert (r[drawn] - 1).abs().min() > 0.03 and (r[drawn] - 1).abs().max() > 0.15      # 0.84, 0.95, 1.07
    torch.testing.assert_close((q[drawn] * r[drawn].log()).sum(), -(q[drawn] * (q[drawn] / p[drawn]).log()).sum())
    torch.testing.assert_close((q[drawn] * r[drawn]).sum(), p[drawn].sum())
    assert p[drawn].sum() < 0.99
    q1, r1 = mistakes.sampled_ratio(logits, 1.0, 1.0)
    torch.testing.assert_close(r1, torch.ones(6, dtype=torch.float64))
    tokens = drawn.nonzero()[:, 0]                       # the course's scorer: logits / T, the kept set replayed
    scaled, keep = (logits / 0.8).expand(len(tokens), 6), drawn.expand(len(tokens), 6)
    torch.testing.assert_close(truncation.token_ratio(scaled, scaled, keep, tokens, replay=True),
                               torch.ones(len(tokens), dtype=torch.float64))


@pytest.mark.lesson
def test_the_courses_kl_over_positions_is_not_the_kl_between_the_policies():
    """Two policies over a vocabulary of 4 whose KL is 0.45 (exact): one sampled token each
    gives the course's "KL" 0; two tokens whose log-probs move by the same amount under both
    also give 0 (a softmax over positions ignores a shift)."""
    pi = torch.tensor([0.7, 0.1, 0.1, 0.1])
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25])
    exact = (pi * (pi / ref).log()).sum()
    assert exact.item() == pytest.approx(0.7 * math.log(2.8) + 0.3 * math.log(0.4))
    assert exact > 0.3
    assert mistakes.positions_kl(pi[:1].log(), ref[:1].log()).item() == 0.0
    new, old = pi[[0, 1]].log(), pi[[0, 1]].log() + 1.0
    assert mistakes.positions_kl(new, old).item() == pytest.approx(0.0, abs=1e-7)
    assert kl.estimate(pi[:1].log(), ref[:1].log(), "k3").item() > 0.2                # per token, k3 sees it


@pytest.mark.lesson
def test_k3_keeps_its_sign_and_size_where_exp_x_minus_1_cancels():
    """In float32, x = 1e-6: exp(x) - x - 1 comes out -6e-8, a negative KL, and at x = 1e-4 it
    reads 0 for 5e-9. Against float64 over |x| from 1e-7 to 1e-2, kl.estimate's k3 (expm1(x) - x)
    is positive, off by at most a rounding of x (1.2e-7 |x|), and within 1% from |x| = 1e-5;
    the cancelling form is 0 or negative for some, off by up to a rounding of 1 (6e-8)."""
    zero = torch.zeros(1)
    assert mistakes.k3_cancelling(zero, torch.tensor([1e-6])).item() < 0
    assert mistakes.k3_cancelling(zero, torch.tensor([1e-4])).item() == 0.0
    lost = 0
    for x in torch.logspace(-7, -2, 26).tolist() + (-torch.logspace(-7, -2, 26)).tolist():
        x32 = torch.tensor([x])
        exact = x32.double().item()
        truth = math.expm1(exact) - exact
        ours = kl.estimate(zero, x32, "k3").item()
        assert ours > 0 and abs(ours - truth) <= 1.2e-7 * abs(exact), x
        assert abs(x) < 1e-5 or abs(ours - truth) < 1e-2 * truth, x
        lost += mistakes.k3_cancelling(zero, x32).item() <= 0
    assert lost >= 10, lost


def expected_kl_gradient(level_or_none, logits, ref):
    """E_{x ~ pi}[the per-token KL term] and its gradient, exactly over a vocabulary (one token a
    sequence, on-policy: pi_old = pi, held fixed as the sampler's weights)."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    term = kl.estimate(logp, ref.log(), "k3") if level_or_none is None else \
        mistakes.kl_ratio_corrected(logp[:, None], logp.detach()[:, None], ref.log()[:, None],
                                    torch.ones(len(ref), 1), level_or_none)[:, 0]
    (grad,) = torch.autograd.grad((logp.exp().detach() * term).sum(), logits)
    return grad


@pytest.mark.lesson
def test_the_ratio_on_k3_turns_the_forward_kls_gradient_into_the_reverse_kls():
    """Exactly over a vocabulary of 4: k3 alone pulls with grad KL(ref || pi) (test_kl's lesson);
    times the ratio pi / pi_old (value 1 on-policy, gradient not 0) with grad KL(pi || ref), what
    the loss says it penalises. grpo's loss with kl_ratio_correction adds exactly that term."""
    logits, ref = torch.tensor([1.0, 0.2, -0.5, -1.0]), torch.tensor([0.1, 0.2, 0.3, 0.4])

    def exact(which):
        x = logits.clone().requires_grad_(True)
        pi = torch.softmax(x, -1)
        d = (pi * (pi / ref).log()).sum() if which == "reverse" else (ref * (ref / pi).log()).sum()
        return torch.autograd.grad(d, x)[0]
    torch.testing.assert_close(expected_kl_gradient(None, logits, ref), exact("forward"))
    torch.testing.assert_close(expected_kl_gradient("token", logits, ref), exact("reverse"))
    assert (exact("forward") - exact("reverse")).abs().max() > 0.05
    # in grpo.policy_loss: advantages 0, beta 1: the per-token loss is the corrected k3, value and gradient
    logp = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), -1)[..., 0]
    old, ref_logp, mask = logp - 0.1, logp + 0.2, torch.ones(2, 3)
    from rollout import Rows
    rows = Rows(tokens=None, mask=mask, advantages=torch.zeros(2), old_logp=old, ref_logp=ref_logp, is_weight=None,
                old_values=None, returns=None)
    for on in (False, True):
        x = logp.clone().requires_grad_(True)
        per_token, _ = grpo.policy_loss(x, old, torch.zeros(2, 3), rows, HyperParams(beta=1.0, kl_ratio_correction=on))
        y = logp.clone().requires_grad_(True)
        want = mistakes.kl_ratio_corrected(y, old, ref_logp, mask) if on else kl.estimate(y, ref_logp, "k3")
        torch.testing.assert_close(per_token, want)
        torch.testing.assert_close(torch.autograd.grad(per_token.sum(), x)[0], torch.autograd.grad(want.sum(), y)[0])


@pytest.mark.lesson
def test_the_sequence_ratio_on_each_tokens_kl_pulls_on_the_other_tokens():
    """TRL's importance_sampling_level="sequence" with the correction: on-policy, token 1's KL
    term has a gradient on token 2's log-prob (k3_1 / 2 for a sequence of 2); at the token level, 0."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref, mask = torch.tensor([[-0.5, -2.5]]), torch.ones(1, 2)
    for level, want in (("token", 0.0), ("sequence", (math.expm1(0.5) - 0.5) / 2)):
        term = mistakes.kl_ratio_corrected(logp, logp.detach(), ref, mask, level)
        (grad,) = torch.autograd.grad(term[0, 0], logp)
        assert grad[0, 1].item() == pytest.approx(want, abs=1e-7), level
