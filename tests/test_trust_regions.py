"""trust_regions.py against re-implementations of prime-rl's, verl's and Tinker's code (values
and gradients), the lesson (PPO's region in probability is p_old-sized, DPPO's is not), and
--policy-loss dppo-tv / dppo-kl / sq-logratio through train.py."""
import math

import pytest
import torch

import grpo
import surrogates
import trust_regions
from conftest import configure, quick
from test_surrogates import BASE, clip_run, metrics, token_mean  # noqa: F401 (clip_run: a fixture)


def inputs(seed=0, n=6, c=5):
    """Probabilities in (0.01, 0.99) before and after a move, some tokens far moved; A of both signs."""
    gen = torch.Generator().manual_seed(seed)
    p_old = 0.01 + 0.98 * torch.rand(n, c, generator=gen)
    p = (p_old + 0.4 * torch.randn(n, c, generator=gen)).clamp(0.005, 0.995)
    adv = torch.randn(n, generator=gen)
    mask = torch.ones(n, c)
    mask[0, 3:], mask[4, 1:] = 0, 0
    return torch.log(p).requires_grad_(True), torch.log(p_old), adv, mask


# ---- the references, as their code writes them (A per token: (n, C)) ----

def prime_rl_default(trainer_logprobs, inference_logprobs, advantages, loss_mask, dppo_mask=0.2, kl_tau=0.0):
    """prime-rl's default_loss_fn (src/prime_rl/trainer/rl/loss.py), adv_tau 1, its per-token loss."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    invalid = torch.where(advantages > 0, probs_diff > dppo_mask, probs_diff < -dppo_mask)
    keep_mask = loss_mask.bool() & ~invalid
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio ** 2
    return -pg_loss + kl_tau * kl_loss, invalid


def verl_dppo(old_log_prob, log_prob, advantages, response_mask, kind, delta, clip_ratio_c=1e4):
    """verl's compute_policy_loss_dppo_tv / _kl (core_algos.py), token-mean."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if kind == "dppo-tv":
        valid_positive = (prob - old_prob) <= delta
        valid_negative = (prob - old_prob) >= -delta
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive = (binary_kl <= delta) | (prob <= old_prob)
        valid_negative = (binary_kl <= delta) | (prob >= old_prob)
    valid = torch.where(advantages > 0, valid_positive, valid_negative).detach().float()
    return token_mean(-advantages * truncated_ratio * log_prob * valid, response_mask), valid


def tinker_dro(target_logprobs, sampling_logprobs, advantages, beta):
    """Tinker's "dro" loss, per token (its docs' implementation, before the sum)."""
    quadratic_term = (target_logprobs - sampling_logprobs) ** 2
    return -(target_logprobs * advantages - 0.5 * beta * quadratic_term)


def trl_vespo(per_token_logps, old_per_token_logps, advantages, mask):
    """TRL's GRPOTrainer with loss_type="vespo" (get_gamma_weights, default k and lambda), no
    vLLM correction, its per-token loss summed over the mask's tokens and divided by their count."""
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(per_token_logps - old_per_token_logps, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, 2.0, 3.0)
    lambda_seq = torch.where(is_nonneg_adv, 3.0, 2.0).clamp(min=1e-4)
    phi_seq = torch.exp(lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    per_token_loss = -phi_seq.detach() * advantages * per_token_logps
    return (per_token_loss * mask).sum() / mask.sum()


def ours(name, logp, old, adv, mask, **knobs):
    hp = grpo.HyperParams(mini_batch=6, micro_batch=6, policy_loss=name, **knobs)
    return surrogates.policy_gradient_loss(logp, old, adv, mask, hp)


def test_dppo_tv_is_prime_rls_default_loss_token_for_token():
    for seed in range(4):
        logp, old, adv, mask = inputs(seed)
        a = adv.unsqueeze(1).expand_as(logp)
        mine, low, high = ours("dppo-tv", logp, old, adv, mask, dppo_delta=0.2)
        theirs, invalid = prime_rl_default(logp, old, a, mask)
        torch.testing.assert_close(mine * mask, theirs * mask)
        (g_mine,) = torch.autograd.grad((mine * mask).sum(), logp)
        (g_theirs,) = torch.autograd.grad((theirs * mask).sum(), logp)
        torch.testing.assert_close(g_mine, g_theirs)
        assert torch.equal(low | high, invalid & (a != 0)) and (low | high).any() and not (low | high).all()


@pytest.mark.parametrize("kind, knobs", [("dppo-tv", dict(dppo_delta=0.15)), ("dppo-kl", dict(dppo_kl_delta=0.05))])
def test_dppo_drops_the_tokens_verl_drops_with_verls_gradient(kind, knobs):
    """verl writes the loss as -A sg(min(r, c)) log p: another value, the same gradient below c."""
    delta = next(iter(knobs.values()))
    for seed in range(4):
        logp, old, adv, mask = inputs(seed)
        a = adv.unsqueeze(1).expand_as(logp)
        per_token, low, high = ours(kind, logp, old, adv, mask, **knobs)
        (g_mine,) = torch.autograd.grad(grpo.aggregate(per_token, mask, "token-mean", 6, mask.sum(), 5), logp)
        theirs, valid = verl_dppo(old, logp, a, mask, kind, delta)
        (g_theirs,) = torch.autograd.grad(theirs, logp)
        torch.testing.assert_close(g_mine * mask, g_theirs * mask)
        assert torch.equal(low | high, (valid == 0) & (a != 0)), "the same tokens dropped"


def test_sq_logratio_is_tinkers_dro_in_value_and_gradient():
    for seed in range(4):
        logp, old, adv, mask = inputs(seed)
        mine, _, _ = ours("sq-logratio", logp, old, adv, mask, sq_beta=0.3)
        theirs = tinker_dro(logp, old, adv.unsqueeze(1).expand_as(logp), 0.3)
        torch.testing.assert_close(mine, theirs)
        (g_mine,) = torch.autograd.grad((mine * mask).sum(), logp)
        (g_theirs,) = torch.autograd.grad((theirs * mask).sum(), logp)
        torch.testing.assert_close(g_mine, g_theirs)


def test_sq_logratio_squares_each_tokens_log_ratio_not_the_sequences_as_kimi_does():
    """Kimi's loss (k1.5, K2) pulls back with (tau/2) (sum_t log r_t)^2, the whole sequence's
    log-ratio squared; ours squares each token's. The gradients on token t are beta log r_t and
    tau sum_s log r_s: equal where every ratio is 1 (the first epoch), apart after a move."""
    for seed in range(4):
        logp, old, adv, mask = inputs(seed)
        moved = (old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))).requires_grad_(True)
        for start, apart in ((old.clone().requires_grad_(True), False), (moved, True)):
            mine, _, _ = ours("sq-logratio", start, old, torch.zeros_like(adv), mask, sq_beta=0.3)
            (g_mine,) = torch.autograd.grad((mine * mask).sum(), start)
            kimi = 0.5 * 0.3 * (((start - old) * mask).sum(1) ** 2).sum()                       # the sequence's square
            (g_kimi,) = torch.autograd.grad(kimi, start)
            gap = ((g_mine - g_kimi) * mask).abs().max().item()
            assert (gap > 1e-3) == apart, (seed, apart, gap)


def test_vespo_is_trls_in_value_and_gradient():
    for seed in range(4):
        logp, old, adv, mask = inputs(seed, c=3)              # short sequences: products near 1 too
        logp = (old + 0.3 * (logp.detach() - old)).requires_grad_(True)
        per_token, _, _ = ours("vespo", logp, old, adv, mask)
        mine = grpo.aggregate(per_token, mask, "token-mean", 6, mask.sum(), 3)
        theirs = trl_vespo(logp, old, adv.unsqueeze(1), mask)
        torch.testing.assert_close(mine, theirs)
        (g_mine,) = torch.autograd.grad(mine, logp)
        (g_theirs,) = torch.autograd.grad(theirs, logp)
        torch.testing.assert_close(g_mine, g_theirs)


@pytest.mark.lesson
def test_vespos_weight_peaks_where_the_update_has_not_gone_yet():
    """phi(w) = e^lam w^k e^(-lam w): 1 at w = 1 (the plain policy gradient), largest at w = k/lam:
    2/3 for A > 0 (phi = 4e/9 = 1.21) and 1.5 for A < 0 (27/(8e) = 1.24). A sequence the updates
    already made likelier (w = 2, A > 0: phi = 4/e^3 = 0.20) or less likely (w = 0.5, A < 0:
    phi = e/8 = 0.34) is pushed further only faintly; one that moved the other way, harder."""
    def phi(w: float, a: float) -> float:
        logp = torch.tensor([[math.log(w) - 1.0]], requires_grad=True)
        loss, _, _ = trust_regions.vespo(logp, torch.tensor([[-1.0]]), torch.tensor([a]), torch.ones(1, 1))
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        return -grad.item() / a                                      # d loss / d log p = -phi A
    assert phi(1.0, 1.0) == pytest.approx(1.0) and phi(1.0, -1.0) == pytest.approx(1.0)
    assert phi(2 / 3, 1.0) == pytest.approx(4 * math.e / 9, rel=1e-5)
    assert phi(1.5, -1.0) == pytest.approx(27 / (8 * math.e), rel=1e-5)
    assert phi(2.0, 1.0) == pytest.approx(4 / math.e ** 3, rel=1e-5)
    assert phi(0.5, -1.0) == pytest.approx(math.e / 8, rel=1e-5)


def kept_up_to(name, p_old: float, **knobs) -> float:
    """The largest probability p in a 1e-4 grid at which a token sampled at p_old with A = +1 still
    gets a gradient (the top of the trust region, in probability)."""
    p = torch.arange(1e-4, 1.0, 1e-4, dtype=torch.float64)
    logp = torch.log(p).unsqueeze(0).requires_grad_(True)
    old = torch.full_like(logp, p_old).log()
    hp = grpo.HyperParams(mini_batch=1, micro_batch=1, policy_loss=name, **knobs)
    if name == "clip":
        loss, _, _ = surrogates.ppo_clip(surrogates.token_ratio(logp, old), torch.ones(1, dtype=p.dtype), 0.2, 0.2)
    else:
        loss, _, _ = surrogates.policy_gradient_loss(logp, old, torch.ones(1, dtype=p.dtype), torch.ones_like(logp), hp)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    return p[grad[0] != 0].max().item()


@pytest.mark.lesson
def test_ppos_region_in_probability_shrinks_with_the_token_dppos_does_not():
    """A positive-advantage token sampled at p_old keeps its gradient up to p = 1.2 p_old under
    PPO's clip (a rare token at 0.01: up to 0.012, a move of 0.002; one at 0.9: never stopped,
    since r <= 1/0.9), and up to p_old + 0.2 under DPPO-TV, whatever p_old."""
    for p_old in (0.01, 0.05, 0.3, 0.5, 0.9):
        assert kept_up_to("clip", p_old) == pytest.approx(min(1.2 * p_old, 0.9999), abs=1.1e-4)
        assert kept_up_to("dppo-tv", p_old, dppo_delta=0.2) == pytest.approx(min(p_old + 0.2, 0.9999), abs=1.1e-4)


@pytest.mark.lesson
def test_a_move_back_toward_the_sampler_is_never_dropped():
    """DPPO drops a token only on the side its advantage pushes: A > 0 at p < p_old (and A < 0 at
    p > p_old) keep their gradient however far p went, as PPO's clip keeps them."""
    p_old, p = torch.tensor([[0.9, 0.1]]), torch.tensor([[0.1, 0.9]])
    for kind in trust_regions.DPPO:
        for adv, moved in ((torch.tensor([1.0]), 0), (torch.tensor([-1.0]), 1)):
            logp = torch.log(p).requires_grad_(True)
            loss, low, high = ours(kind, logp, torch.log(p_old), adv, torch.ones(1, 2))
            (grad,) = torch.autograd.grad(loss.sum(), logp)
            assert grad[0, moved] != 0 and grad[0, 1 - moved] == 0 and (low | high).sum() == 1


@pytest.mark.parametrize("field, value, message", [
    ("dppo_delta", 0.0, "--dppo-delta: must be > 0"),
    ("dppo_kl_delta", -1.0, "--dppo-kl-delta: must be in [0, 100], got -1"),
    ("sq_beta", 0.0, "--sq-beta: must be > 0"),
])
def test_a_trust_region_of_no_width_is_refused_in_one_line(field, value, message, tmp_path, capsys):
    policy_loss = {"dppo_delta": "dppo-tv", "dppo_kl_delta": "dppo-kl", "sq_beta": "sq-logratio"}[field]
    with pytest.raises(SystemExit) as e:
        configure(quick(tmp_path, "bad", "--policy-loss", policy_loss, "--" + field.replace("_", "-"), str(value)))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("flags", [["--policy-loss", "dppo-tv"], ["--policy-loss", "dppo-kl"],
                                   ["--policy-loss", "sq-logratio"], ["--policy-loss", "vespo"],
                                   ["--norm", "maxrl"]])
def test_each_2026_method_trains_and_changes_only_the_update(flags, clip_run, tmp_path):
    """Five steps of two epochs (the ratio leaves 1): the same rollouts as the clip run up to the
    first update, whose loss differs; every later step updates."""
    import train
    train.train(configure(quick(tmp_path, "other", *BASE, *flags)))
    other = metrics(tmp_path / "other")
    first = next(i for i, row in enumerate(clip_run) if row.get("loss") is not None)
    assert clip_run[first]["reward_mean"] == other[first]["reward_mean"], "the same rollouts until the first update"
    assert clip_run[first]["loss"] != other[first]["loss"], "another objective"
    assert all(row["updated"] for row in other[1:])


@pytest.mark.parametrize("argv, message", [
    (["--policy-loss", "vespo", "--algo", "ppo"], "--policy-loss: vespo weighs a sequence by one advantage"),
    (["--policy-loss", "vespo", "--rollout-stale", "1", "--rollout-correction", "tis"],
     "--policy-loss: vespo folds the sampler's weight into its own w"),
])
def test_vespo_where_it_cannot_mean_what_trl_means_is_refused(argv, message, tmp_path, capsys):
    from conftest import assert_refused_in_one_line
    assert_refused_in_one_line(tmp_path, capsys, argv, message)
