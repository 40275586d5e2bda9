"""Lessons of advantages.py, each as a test whose name states it.

Run: pytest tests/test_advantages.py -v
"""
import math

import pytest
import torch

import advantages as adv

pytestmark = pytest.mark.lesson          # every test here is a lesson: python -m pytest -m lesson


# ---- the K=2 lesson of report 001 ----

def test_k2_group_norm_gives_exactly_plus_minus_one_whatever_the_gap():
    gen = torch.Generator().manual_seed(0)
    for gap in [1e-3, 1e-2, 0.1, 0.5, 0.8, 1.0]:
        for _ in range(50):
            low = torch.rand((), generator=gen).item()
            pair = torch.tensor([low + gap, low]) if torch.rand((), generator=gen) < 0.5 \
                else torch.tensor([low, low + gap])
            a = adv.compute(pair, k=2, norm="group")
            # The better sample gets exactly +1, the worse exactly -1: the gap is forgotten.
            assert a[pair.argmax()] == 1.0 and a[pair.argmin()] == -1.0, (gap, pair, a)


def test_k2_with_bessel_correction_gives_plus_minus_one_over_root_two():
    # TRL / verl / OpenRLHF divide by the Bessel-corrected std: sqrt(2) * |r1-r2| / 2.
    gen = torch.Generator().manual_seed(1)
    for gap in [1e-3, 0.1, 1.0]:
        pair = torch.tensor([0.3 + gap, 0.3])
        a = adv.compute(pair, k=2, norm="group", unbiased=True)
        torch.testing.assert_close(a, torch.tensor([1.0, -1.0]) / math.sqrt(2))
        r = torch.rand(2, generator=gen)
        a = adv.compute(r, k=2, norm="group", unbiased=True)
        assert torch.allclose(a.abs(), torch.full((2,), 1 / math.sqrt(2)))


def test_the_field_std_plus_eps_convention_shrinks_small_gaps_ours_does_not(monkeypatch):
    # TRL: A = (r - mean) / (std + 1e-4). For a K=2 gap of 1e-3: 5e-4 / (5e-4 + 1e-4) = 0.83.
    pair = torch.tensor([0.201, 0.2], dtype=torch.float64)
    centred = pair - pair.mean()
    trl_style = centred / (pair.std(correction=0) + 1e-4)
    assert trl_style[0].item() == pytest.approx(0.0005 / 0.0006, rel=1e-6)
    # Ours divides by max(std, eps): the eps only guards zero-variance groups, even at TRL's 1e-4.
    monkeypatch.setattr(adv, "EPS", 1e-4)
    assert adv.compute(pair, k=2, norm="group")[0].item() == 1.0


def test_report_001_step4_worked_example_under_every_norm():
    # Step 4 of report 001: three prompts, K=2.
    r = torch.tensor([1.0, 1.0, 1.0, 0.2, 0.2, 0.2])
    # GRPO: zero-variance groups give 0; the mixed group gives +1 / -1.
    torch.testing.assert_close(adv.compute(r, 2, "group"),
                               torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0]))
    # Dr. GRPO: r - group mean; the mixed group's mean is 0.6.
    torch.testing.assert_close(adv.compute(r, 2, "drgrpo"),
                               torch.tensor([0.0, 0.0, 1.0 - 0.6, 0.2 - 0.6, 0.0, 0.0]))
    # Global: batch mean (3*1.0 + 3*0.2)/6 = 0.6, population std sqrt(mean((r-0.6)^2)) = 0.4.
    mean, std = 0.6, 0.4
    torch.testing.assert_close(adv.compute(r, 2, "global"), (r - mean) / std)
    # Batch: group-centred, divided by the batch std 0.4.
    torch.testing.assert_close(adv.compute(r, 2, "batch"),
                               torch.tensor([0.0, 0.0, 0.4 / 0.4, -0.4 / 0.4, 0.0, 0.0]))
    # RLOO: r_i minus the other sample's reward (K-1 = 1).
    torch.testing.assert_close(adv.compute(r, 2, "rloo"),
                               torch.tensor([0.0, 0.0, 1.0 - 0.2, 0.2 - 1.0, 0.0, 0.0]))
    # None: the raw reward, every sample pushed up.
    torch.testing.assert_close(adv.compute(r, 2, "none"), r)


def test_global_norm_pushes_the_valid_dsl_up_when_the_batch_is_worse():
    # Under global norm a 0.2 (valid DSL) in a batch of mostly 0 (fallback) is above the
    # batch mean and gets a positive advantage; under K=2 group norm it got -1 next to a 1.0.
    r = torch.tensor([1.0, 0.2, 0.0, 0.0, 0.0, 0.0])
    assert adv.compute(r, 2, "group")[1] == -1.0
    assert adv.compute(r, 2, "global")[1] > 0


# ---- K=8 and the other estimators ----

def test_k8_group_norm_gives_graded_advantages():
    r = torch.tensor([1.0, 0.2, 0.2, 0.0, 0.0, 0.0, 0.2, 1.0])
    a = adv.compute(r, 8, "group")
    # Equal rewards -> equal advantages, ordered like the rewards, and not only +-1.
    assert a[0] == a[7] and a[1] == a[2] == a[6] and a[3] == a[4] == a[5]
    assert a[0] > a[1] > a[3]
    assert adv.frac_pm1(a) < 1.0
    torch.testing.assert_close(a, (r - r.mean()) / r.std(correction=0))
    # The group mean is (2*1.0 + 3*0.2)/8 = 0.325: the 0.2's sit below it, but are pushed
    # away far less than the 0's. The size of the push now depends on the reward gap.
    assert a[3] < a[1] < 0


def test_batch_is_trl_scale_rewards_batch_and_reinforce_pp_baseline_whitens_the_centred_rewards():
    r = torch.tensor([1.0, 0.0, 0.2, 0.2])                       # K=2: a mixed group, a tied one
    # batch (TRL scale_rewards="batch", Lite PPO): group-centred [0.5, -0.5, 0, 0] over the
    # population std of the raw rewards: mean 0.35, var (0.4225+0.1225+0.0225+0.0225)/4 = 0.1475.
    s = math.sqrt(0.1475)
    torch.testing.assert_close(adv.compute(r, 2, "batch"), torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))
    # reinforce++-baseline (verl, OpenRLHF): whiten the centred values: mean 0, Bessel var
    # (0.25 + 0.25) / 3 = 1/6, so 0.5 / sqrt(1/6) = 1.2247.
    w = 0.5 / math.sqrt(1 / 6)
    torch.testing.assert_close(adv.compute(r, 2, "reinforce++-baseline"), torch.tensor([w, -w, 0.0, 0.0]))
    # Token-weighted (lengths 1, 3, 2, 2): mean (0.5*1 - 0.5*3) / 8 = -0.125, so even the tied
    # group moves: c - mean = [0.625, -0.375, 0.125, 0.125];
    # var = (1*0.625^2 + 3*0.375^2 + 2*0.125^2 + 2*0.125^2) / 8 * 8/7 = 0.875 / 7 = 0.125.
    a = adv.compute(r, 2, "reinforce++-baseline", lengths=torch.tensor([1, 3, 2, 2]))
    torch.testing.assert_close(a, torch.tensor([0.625, -0.375, 0.125, 0.125]) / math.sqrt(0.125))


def verl_reinforce_pp_baseline(rewards, k, mask):
    """A re-implementation of verl's REINFORCE++-baseline: subtract the group mean, tile the
    score over the response tokens, masked whitening with the unbiased (Bessel) variance."""
    scores = rewards.clone().double()
    for start in range(0, len(scores), k):
        scores[start:start + k] -= scores[start:start + k].mean()
    m = mask.double()
    tiled = scores[:, None] * m                                               # (N, T)
    mean = (tiled * m).sum() / m.sum()
    var = ((tiled - mean) ** 2 * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    return ((tiled - mean) * torch.rsqrt(var + 1e-8) * m).float()


def test_reinforce_pp_baseline_equals_a_reimplementation_of_verl_on_random_batches():
    gen = torch.Generator().manual_seed(5)
    for k in (2, 4, 8):
        rewards = torch.randn(4 * k, generator=gen)                               # B = 4 prompts
        lengths = torch.randint(1, 12, (4 * k,), generator=gen)
        mask = (torch.arange(12)[None, :] < lengths[:, None]).long()             # (N, T)
        ours = adv.compute(rewards, k, "reinforce++-baseline", lengths=lengths)  # (N,)
        ref = verl_reinforce_pp_baseline(rewards, k, mask)
        torch.testing.assert_close(ours[:, None] * mask, ref, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ours, adv.compute(rewards, k, "batch"))      # not the same estimator


def verl_reinforce_pp(rewards, mask, gamma=1.0):
    """A re-implementation of verl's REINFORCE++ (compute_reinforce_plus_plus_outcome_advantage):
    the outcome reward on each response's last token, returns summed backwards with gamma (reset
    past the response), then masked whitening over every response token, Bessel-corrected."""
    m = mask.double()
    last = m.sum(1).long() - 1                                                # (N,)
    token_rewards = torch.zeros_like(m)
    token_rewards[torch.arange(len(last)), last] = rewards.double()
    returns, running = torch.zeros_like(m), torch.zeros(len(m), dtype=torch.float64)
    for t in reversed(range(m.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * m[:, t]
    mean = (returns * m).sum() / m.sum()
    var = ((returns - mean) ** 2 * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    return ((returns - mean) * torch.rsqrt(var + 1e-8) * m).float()


def test_reinforce_pp_equals_verls_token_whitening_and_global_does_not():
    """REINFORCE++ as verl and OpenRLHF compute it whitens over the batch's tokens, so a long
    completion weighs by its length; `global` z-scores the N sequences, each weighing 1. On
    completions of unequal lengths the two differ, and may differ in sign; on equal lengths they
    agree up to Bessel's correction."""
    gen = torch.Generator().manual_seed(7)
    rewards = torch.tensor([1.0, 0.2, 0.0])[torch.randint(0, 3, (32,), generator=gen)]   # report 001's rewards
    lengths = torch.where(rewards == 0, 35, 6) + torch.randint(0, 4, (32,), generator=gen)  # junk runs long
    mask = (torch.arange(40)[None, :] < lengths[:, None]).long()                  # (N, T)
    ours = adv.compute(rewards, 8, "reinforce++", lengths=lengths)                # (N,)
    torch.testing.assert_close(ours[:, None] * mask, verl_reinforce_pp(rewards, mask), rtol=1e-5, atol=1e-6)
    seq = adv.compute(rewards, 8, "global")
    gap = (seq - ours).abs()
    assert gap.mean() > 0.02, "on unequal lengths token weighting moves the baseline and the scale"
    assert (torch.sign(seq) != torch.sign(ours)).any(), "a 0.2 between the token mean and the row mean changes sides"
    tokens = 32 * 10                       # equal lengths: std over 320 tokens (Bessel) against 32 rows (population)
    torch.testing.assert_close(adv.compute(rewards, 8, "reinforce++", lengths=torch.full((32,), 10))
                               * (tokens / (tokens - 1)) ** 0.5, seq, rtol=1e-5, atol=1e-6)


def test_global_keeps_the_sign_of_reward_minus_batch_mean():
    gen = torch.Generator().manual_seed(2)
    r = torch.rand(64, generator=gen)
    a = adv.compute(r, 8, "global")
    assert torch.equal(torch.sign(a), torch.sign(r - r.mean()))


def test_rloo_equals_scaled_drgrpo():
    # r_i - mean_{j!=i} r_j = K/(K-1) * (r_i - mean_g): the same direction, a larger step.
    gen = torch.Generator().manual_seed(3)
    r = torch.rand(32, generator=gen)
    torch.testing.assert_close(adv.compute(r, 4, "rloo"), adv.compute(r, 4, "drgrpo") * 4 / 3)


def prime_rl_max_rl(rewards: torch.Tensor) -> torch.Tensor:
    """prime-rl's MaxRLAlgorithm.score_group (src/prime_rl/orchestrator/algo/max_rl.py), one group."""
    mean = rewards.mean()
    return torch.zeros_like(rewards) if mean <= 0 else (rewards - mean) / mean


def test_maxrl_equals_a_reimplementation_of_prime_rl_group_by_group():
    gen = torch.Generator().manual_seed(5)
    r = (torch.rand(64, generator=gen) < 0.3).float() * torch.tensor([1.0, 0.2]).repeat(32)   # 0, 0.2, 1
    r[:8] = 0                                                   # one group never rewarded
    theirs = torch.cat([prime_rl_max_rl(g) for g in r.view(-1, 8)])
    torch.testing.assert_close(adv.compute(r, 8, "maxrl"), theirs)


@pytest.mark.lesson
def test_maxrl_is_dr_grpo_divided_by_the_success_rate_so_hard_prompts_weigh_more():
    """Binary rewards, K=8: a prompt solved once (p = 1/8) gives its correct sample 7 under
    MaxRL, (1 - p) / p, against Dr. GRPO's 0.875 and GRPO's sqrt(7) = 2.65; a prompt solved 7
    times gives 1/7. MaxRL's advantage is Dr. GRPO's divided by p: the gradient of log p, not of p."""
    r = torch.tensor([1.0] + [0.0] * 7 + [1.0] * 7 + [0.0])
    maxrl, drgrpo, group = (adv.compute(r, 8, norm) for norm in ("maxrl", "drgrpo", "group"))
    p = torch.tensor([1 / 8] * 8 + [7 / 8] * 8)
    torch.testing.assert_close(maxrl, drgrpo / p)
    assert maxrl[0].item() == pytest.approx(7.0) and maxrl[8].item() == pytest.approx(1 / 7)
    assert drgrpo[0].item() == pytest.approx(0.875) and group[0].item() == pytest.approx(math.sqrt(7))


def test_zero_variance_groups_give_zero_never_nan():
    r = torch.tensor([0.2, 0.2, 0.2, 0.2, 1.0, 1.0, 1.0, 1.0])
    for norm in ["group", "drgrpo", "batch", "reinforce++-baseline", "rloo", "maxrl"]:
        a = adv.compute(r, 4, norm)
        assert torch.equal(a, torch.zeros(8)), norm
    # All rewards equal: even the global std is 0.
    assert torch.equal(adv.compute(torch.zeros(8), 4, "global"), torch.zeros(8))
    assert adv.frac_zero_std(r, 4) == 1.0
    assert adv.frac_zero_std(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2) == 0.5


def test_clip_is_a_clamp_and_report_000s_formula_is_not():
    r = torch.tensor([10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    a = adv.compute(r, 8, "none", clip=5.0)
    assert a[0] == 5.0 and a[1] == 0.0
    a = adv.compute(r - 10, 8, "none", clip=3.0)
    assert a[1] == -3.0 and a[0] == 0.0
    # max(adv, -5) + min(adv, 5) doubles every advantage inside [-5, 5].
    x = torch.tensor(1.0)
    assert torch.max(x, torch.tensor(-5.0)) + torch.min(x, torch.tensor(5.0)) == 2.0


def test_integer_rewards_and_dtype():
    a = adv.compute(torch.tensor([1, 0, 0, 0]), 2, "group")
    assert a.dtype == torch.float32 and a.tolist() == [1.0, -1.0, 0.0, 0.0]
    a64 = adv.compute(torch.tensor([1.0, 0.0], dtype=torch.float64), 2, "group")
    assert a64.dtype == torch.float64


@pytest.mark.parametrize("kwargs, message", [
    (dict(rewards=torch.ones(4), k=1, norm="group"), "needs k >= 2"),
    (dict(rewards=torch.ones(4), k=1, norm="rloo"), "needs k >= 2"),
    (dict(rewards=torch.ones(4), k=0, norm="global"), "k must be >= 1"),
    (dict(rewards=torch.ones(5), k=2, norm="group"), "cannot be split"),
    (dict(rewards=torch.ones(5), k=2, norm="global"), "cannot be split"),
    (dict(rewards=torch.ones(0), k=2, norm="group"), "cannot be split"),
    (dict(rewards=torch.ones(4), k=2, norm="bogus"), "unknown norm"),
    (dict(rewards=torch.tensor([1.0, float("nan")]), k=2, norm="group"), "non-finite"),
    (dict(rewards=torch.tensor([1.0, float("inf")]), k=2, norm="none"), "non-finite"),
    (dict(rewards=torch.ones(2, 2), k=2, norm="group"), "must be 1-D"),
    (dict(rewards=torch.ones(4), k=2, norm="group", clip=0.0), "clip must be > 0"),
])
def test_bad_input_raises_value_error_saying_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        adv.compute(**kwargs)


def test_global_and_none_accept_k1():
    r = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(adv.compute(r, 1, "global"), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(adv.compute(r, 1, "none"), r)


# ---- GAE and whitening (PPO) ----

def _gae_reference(rewards, values, mask, gamma, lam):
    """The plain Python loop, one sequence and one token at a time, skipping mask-0 tokens."""
    n, t_len = len(rewards), len(rewards[0])
    advs = [[0.0] * t_len for _ in range(n)]
    for i in range(n):
        policy_positions = [t for t in range(t_len) if mask[i][t] == 1]
        last_adv, next_value = 0.0, 0.0
        for t in reversed(policy_positions):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            last_adv = delta + gamma * lam * last_adv
            advs[i][t] = last_adv
            next_value = values[i][t]
    return torch.tensor(advs, dtype=torch.float64)


def test_gae_matches_a_plain_python_loop_with_masks():
    gen = torch.Generator().manual_seed(4)
    n, t_len = 6, 12
    rewards = torch.randn(n, t_len, generator=gen, dtype=torch.float64)
    values = torch.randn(n, t_len, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, t_len, generator=gen) < 0.7).long()
    mask[:, -3:] = 0            # right padding
    mask[0] = 0                 # a sequence with no policy token at all
    for gamma, lam in [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0)]:
        a, ret = adv.gae(rewards, values, mask, gamma, lam)
        expected = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        torch.testing.assert_close(a, expected)
        torch.testing.assert_close(ret, (expected + values) * mask)


def test_gae_with_gamma_lam_one_is_returns_minus_values():
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 9)
    a, ret = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(1).cumsum(1).flip(1)          # sum_{t' >= t} r_t'
    torch.testing.assert_close(a, reward_to_go - values)
    torch.testing.assert_close(ret, reward_to_go)


def test_gae_skips_environment_tokens_in_the_middle():
    # Policy tokens at 0, 1 and 4; positions 2-3 are a tool response (mask 0) with a value
    # and reward that must be ignored.
    rewards = torch.tensor([[0.0, 0.0, 99.0, 99.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 50.0, 50.0, 0.4]])
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    a, _ = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(a, torch.tensor([[1.0 - 0.1, 1.0 - 0.2, 0.0, 0.0, 1.0 - 0.4]]))


def test_whiten_gives_zero_mean_unit_std_on_masked_entries():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 3 + 2
    mask = torch.ones(5, 7)
    mask[:, 5:] = 0
    w = adv.whiten(x, mask)
    on = w[mask.bool()]
    assert abs(on.mean().item()) < 1e-12
    assert abs(on.std(correction=0).item() - 1) < 1e-6
    assert torch.all(w[~mask.bool()] == 0)
    kept = adv.whiten(x, mask, shift_mean=False)[mask.bool()]
    assert kept.mean().item() == pytest.approx(x[mask.bool()].mean().item())


def test_maxrl_is_refused_on_the_tools_task_whose_rewards_go_below_zero(tmp_path, capsys):
    from conftest import assert_refused_in_one_line
    assert_refused_in_one_line(tmp_path, capsys, ["--task", "tools", "--reward", "sparse", "--norm", "maxrl"],
                               "--norm: maxrl divides by the group's mean reward")



@pytest.mark.parametrize("argv", [["--overlong-buffer", "4"], ["--kl-in", "reward", "--beta", "0.05"]],
                         ids=["overlong", "kl_in_reward"])
def test_maxrl_is_refused_wherever_a_reward_can_go_below_zero(tmp_path, capsys, argv):
    """DAPO's overlong penalty and a KL penalty in the reward push rewards below 0, where maxrl's
    division by the group's mean flips sign or explodes (the test below). Each is refused in one
    line, exit 2, before any model is built; the same flags with another estimator, or maxrl with
    --beta 0, are not."""
    from conftest import assert_refused_in_one_line, configure
    assert_refused_in_one_line(tmp_path, capsys, [*argv, "--norm", "maxrl"], "--norm: maxrl divides by the group's mean reward")
    configure([*argv, "--norm", "drgrpo", "--out", str(tmp_path / "a")])
    configure(["--kl-in", "reward", "--beta", "0", "--norm", "maxrl", "--out", str(tmp_path / "b")])


def test_maxrl_explodes_on_a_group_whose_rewards_straddle_zero():
    """Why it is refused, by hand: rewards [1, -0.99, 0, 0] have mean 0.0025 > 0, so maxrl divides
    by it: A = (r - 0.0025) / 0.0025."""
    a = adv.compute(torch.tensor([1.0, -0.99, 0.0, 0.0]), 4, "maxrl")
    torch.testing.assert_close(a, torch.tensor([399.0, -397.0, -1.0, -1.0]))
