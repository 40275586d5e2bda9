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


# ---- the sampler of train.py: --top-p / --top-k, and --mask-replay ----

def sampled(top_p=0.8, top_k=0, replay=True, seed=0):
    """A tiny random Qwen2 (conftest.tiny_model's) sampling 4 completions of 3 prompts with
    top-p / top-k, its own log-probs (mu) recorded, and the full-vocabulary logits at every
    sampled position, recomputed by one plain forward: (batch, logits (N, C, V))."""
    from conftest import tiny_model
    import logprobs
    import rollout
    import tasks
    from models import policy
    model, tok = tiny_model(seed), policy.build_tokenizer([f"w{i}" for i in range(17)])
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)                 # a peaked distribution, so the sets differ
    torch.manual_seed(seed)
    sampling = tasks.Sampling(max_new_tokens=6, top_p=top_p, top_k=top_k, mask_replay=replay, rollout_logprobs=True)
    batch = rollout.sample(rollout.Models(model, tok), ["w3 w4", "w5", "w6 w7 w8"], 4, sampling)
    with torch.no_grad():
        h = logprobs.completion_hidden(model.base_model, batch.tokens())[:, :-1]        # (N, C, H)
        logits = logprobs.head_logits(model, h)                                          # (N, C, V)
    return batch, logits


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (1.0, 4), (0.7, 6)])
def test_the_recorded_kept_set_is_the_samplers(top_p, top_k):
    """What generate kept at each sampled position (its processed scores) is truncation.kept of
    the policy's own logits there; past a row's end every token is kept (padding)."""
    batch, logits = sampled(top_p, top_k)
    on = batch.completion_mask.bool()                                                    # (N, C)
    assert torch.equal(batch.kept[on], truncation.kept(logits, top_p, top_k)[on])
    assert batch.kept[~on].all()
    assert (batch.kept[on].sum(-1) < logits.shape[-1]).any()        # truncation dropped tokens


@pytest.mark.parametrize("replay", [False, True])
def test_on_policy_the_ratio_is_the_kept_mass_without_the_replay_and_one_with_it(replay):
    """The recorded pi_old (the trainer's forward) against the sampler's own mu: exp(log pi_old -
    log mu) is S at every sampled token without the replay, exactly 1 with it."""
    batch, logits = sampled(0.8, replay=replay)
    on = batch.completion_mask.bool()
    ratio = torch.exp(batch.old_logp - batch.rollout_logp)[on]
    expected = truncation.kept_mass(logits, truncation.kept(logits, 0.8))[on] if not replay else torch.ones_like(ratio)
    assert torch.allclose(ratio, expected, atol=1e-5)
    assert replay or (ratio < 1 - 1e-3).any()                        # S < 1 somewhere: the bias is there


@pytest.mark.parametrize("argv, said", [
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p: must be in [0, 1]"),
    (["--top-k", "-1"], "--top-k: must be >= 0"),                   # a field, set as a flag would be
    (["--mask-replay"], "--mask-replay: without --top-p < 1 or --top-k > 0"),
    (["--task", "tools", "--top-p", "0.8"], "--top-p: the tool task's multi-turn sampling is untruncated"),
])
def test_bad_truncation_is_one_line_and_exit_2(tmp_path, capsys, argv, said):
    from conftest import configure, quick
    with pytest.raises(SystemExit) as e:
        configure(quick(tmp_path, "bad", *argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err


def test_a_top_p_run_takes_the_replay_ratio_to_one(tmp_path):
    """Three steps with top-p 0.8 and the sampler's log-probs as pi_old
    (--rollout-correction bypass): without the replay the on-policy ratio sits below 1 (the kept
    mass); with it, exactly 1. On a CPU: under a GPU's bf16 the sampler's and the trainer's
    log-probs differ by themselves (Lesson 9), so no ratio is exactly 1."""
    from conftest import quick
    import json
    import train
    from running import config
    ratios = {}
    for name, extra in (("plain", ()), ("replay", ("--mask-replay",))):
        train.train(config.parse_config(quick(tmp_path, name, "--batch", "4", "--k", "8", "--top-p", "0.8",
                                              "--rollout-correction", "bypass", "--device", "cpu", *extra)))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][1:]
        ratios[name] = [(r["ratio_min"], r["ratio_max"]) for r in rows if r["updated"]]
    assert ratios["plain"] and ratios["replay"]
    assert all(high < 1 for _, high in ratios["plain"])
    assert all(abs(low - 1) < 1e-5 and abs(high - 1) < 1e-5 for low, high in ratios["replay"])
