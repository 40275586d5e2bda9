"""truncation.py against transformers' own top-k and top-p warpers, and its lesson by exact
enumeration over a small vocabulary: without the mask replay every sampled token's ratio is the
kept mass S, with it exactly 1."""
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import surrogates
import truncation


def hf_kept(logits, top_p, top_k):
    """What transformers' generate keeps: TopK, then TopP (its order in _get_logits_processor)."""
    scores = logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.isfinite(scores)


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (0.5, 0), (0.95, 0), (1.0, 3), (0.9, 5), (0.3, 2), (0.999, 0)])
def test_the_kept_set_is_transformers_own(top_p, top_k):
    gen = torch.Generator().manual_seed(int(top_p * 100) + top_k)
    logits = 2.0 * torch.randn(300, 12, generator=gen)
    assert torch.equal(truncation.kept(logits, top_p, top_k), hf_kept(logits, top_p, top_k))


def enumerate_tokens(top_p=0.8, seed=0, v=8):
    """Logits over a small vocabulary, the kept set, and every token the sampler can draw."""
    logits = 1.5 * torch.randn(v, generator=torch.Generator().manual_seed(seed))
    keep = truncation.kept(logits, top_p)
    return logits, keep, torch.nonzero(keep).flatten()


@pytest.mark.lesson
def test_without_the_replay_every_ratio_is_the_kept_mass_and_with_it_exactly_one():
    """Same weights for the sampler and the trainer (on-policy): each token top-p 0.8 can draw
    has ratio S = its kept mass (the same for all; log r = log S) without the replay, 1 with it;
    the sampler's own probabilities, enumerated, sum to 1 over K."""
    for seed in range(5):
        logits, keep, tokens = enumerate_tokens(seed=seed)
        s = truncation.kept_mass(logits, keep)
        assert 0.8 <= s < 1 and len(tokens) < len(logits)
        assert torch.exp(truncation.logprobs_over(logits, keep))[tokens].sum() == pytest.approx(1.0, abs=1e-6)
        for y in tokens:
            plain = truncation.token_ratio(logits, logits, keep, y, replay=False)
            replayed = truncation.token_ratio(logits, logits, keep, y, replay=True)
            assert plain.item() == pytest.approx(s.item(), rel=1e-5) and replayed.item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.lesson
def test_below_a_kept_mass_of_0_8_ppos_clip_drops_every_negative_advantage_on_policy():
    """top-p 0.75: S < 0.8 = 1 - eps, so the very first update's ratios are all under PPO's
    lower bound, and every token with A < 0 gets no gradient: "on-policy" PPO then learns only
    from its positive advantages. With the replay the ratio is 1 and they learn."""
    logits, keep, tokens = enumerate_tokens(top_p=0.75, seed=3)
    s = truncation.kept_mass(logits, keep).item()
    assert s < 0.8
    for replay in (False, True):
        trainer = logits.clone().requires_grad_(True)
        ratio = truncation.token_ratio(trainer, logits, keep, tokens[0], replay)
        loss, low, _ = surrogates.ppo_clip(ratio.reshape(1, 1), torch.tensor([-1.0]), 0.2, 0.2)
        (grad,) = torch.autograd.grad(loss.sum(), trainer)
        assert low.item() == (not replay) and (grad.abs().sum() == 0) == (not replay)
