"""surrogates.py against re-implementations of verl's and TRL's formulas (values and gradients
on random inputs), the lesson each objective teaches, and --policy-loss through train.py."""
import json

import pytest
import torch

import grpo
import surrogates
from rollout import Rows
from conftest import assert_refused_in_one_line, configure, WARM_STARTS, quick

def inputs(seed=0, n=6, c=5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, c, generator=gen) * 3
    logp = (old + 0.6 * torch.randn(n, c, generator=gen)).requires_grad_(True)
    adv = torch.randn(n, generator=gen)
    mask = torch.ones(n, c)
    mask[0, 3:], mask[4, 1:] = 0, 0
    return logp, old, adv, mask


def token_mean(loss, mask):
    return (loss * mask).sum() / mask.sum()


# ---- the references, written as verl's core_algos.py writes them (A per token: (n, C)) ----

def verl_vanilla_dual_clip(old_log_prob, log_prob, advantages, mask, low, high, clip_ratio_c):
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    return token_mean(torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), mask)


def trl_cispo(old_log_prob, log_prob, advantages, mask, epsilon_high):
    coef_1 = torch.exp(log_prob - old_log_prob)
    coef = torch.clamp(coef_1, max=epsilon_high).detach()
    return token_mean(-coef * advantages * log_prob, mask)


def seq_mean_token_mean(loss, mask):
    """verl's agg_loss for "seq-mean-token-mean": each sequence's token mean, then their mean."""
    return ((loss * mask).sum(-1) / mask.sum(-1)).mean()


def verl_sapo(old_log_prob, log_prob, advantages, mask, tau_pos, tau_neg):
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20, 20))
    taus = torch.where(advantages > 0, torch.tensor(tau_pos), torch.tensor(tau_neg))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return seq_mean_token_mean(-gates * advantages, mask)         # verl forces this aggregation for SAPO


def verl_geo_mean(old_log_prob, log_prob, advantages, mask, low, high):
    negative_approx_kl = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -low, high)
    kl_min = sgn * torch.min(sgn * negative_approx_kl, sgn * clamped)
    ratio = torch.exp((kl_min * mask).sum(-1) / (mask.sum(-1) + 1e-8))
    advantage = (advantages * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return torch.mean(-advantage * ratio)


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, low, high, clip_cov_ratio, lb, ub):
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    masked_mean = lambda x: (x * response_mask).sum() / response_mask.sum()
    cov_all = (advantages - masked_mean(advantages)) * (log_prob - masked_mean(log_prob.detach()))
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (response_mask > 0))
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
        corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return token_mean(torch.maximum(pg_losses1, pg_losses2) * corr, response_mask)


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * negative_approx_kl.abs()
    pg_losses = pg_losses1.clone()
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    adv_v = advantages[all_valid].detach().reshape(-1)
    logp_v = log_prob[all_valid].detach().reshape(-1)
    cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
    k = max(1, int(len(cov) * kl_cov_ratio))
    idx = all_valid_idx[torch.topk(cov, k, largest=True).indices]
    c = advantages.shape[1]
    pg_losses[idx // c, idx % c] = pg_losses_kl[idx // c, idx % c]
    return token_mean(pg_losses, response_mask)


def ours(name, logp, old, adv, mask, **knobs):
    hp = grpo.HyperParams(mini_batch=6, micro_batch=6, policy_loss=name, **knobs)
    loss, low, high = surrogates.policy_gradient_loss(logp, old, adv, mask, hp)
    agg = surrogates.OWN_AGGREGATION.get(name, "token-mean")
    return grpo.aggregate(loss, mask, agg, len(mask), mask.sum(), 24), low, high


@pytest.mark.lesson
@pytest.mark.parametrize("name, reference, knobs, ref_args", [
    ("dual-clip", verl_vanilla_dual_clip, dict(clip_eps=0.2, clip_eps_high=0.28, dual_clip_c=3.0), (0.2, 0.28, 3.0)),
    ("cispo", trl_cispo, dict(cispo_max=1.3), (1.3,)),
    ("sapo", verl_sapo, dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05), (1.0, 1.05)),
    ("gmpo", verl_geo_mean, dict(gmpo_delta=0.4), (0.4, 0.4)),
    ("clip-cov", verl_clip_cov, dict(clip_eps=0.2, clip_eps_high=0.2, cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0),
     (0.2, 0.2, 0.2, 0.0, 5.0)),
    ("kl-cov", verl_kl_cov, dict(cov_ratio=0.2, kl_cov_coef=1.0), (0.2, 1.0)),
])
def test_each_objective_equals_its_reference_in_value_and_gradient(name, reference, knobs, ref_args):
    for seed in range(3):
        logp, old, adv, mask = inputs(seed)
        torch.manual_seed(seed)                        # clip-cov draws its tokens at random
        mine, _, _ = ours(name, logp, old, adv, mask, **knobs)
        (g_mine,) = torch.autograd.grad(mine, logp)
        torch.manual_seed(seed)
        theirs = reference(old, logp, adv.unsqueeze(1).expand_as(logp), mask, *ref_args)
        (g_theirs,) = torch.autograd.grad(theirs, logp)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_mine * mask, g_theirs * mask, rtol=1e-5, atol=1e-6)


@pytest.mark.lesson
def test_cispo_keeps_a_gradient_on_a_clipped_token_where_ppos_clip_gives_none():
    """A rare token the update already made 3x likelier, with a positive advantage: PPO's clip
    (1.2) gives it gradient 0; CISPO gives it -min(r, 5) * A = -3A."""
    old = torch.tensor([[-4.0]])
    logp = (old + torch.log(torch.tensor(3.0))).requires_grad_(True)            # r = 3
    adv = torch.tensor([1.0])
    (g_clip,) = torch.autograd.grad(surrogates.ppo_clip(torch.exp(logp - old), adv, 0.2, 0.2)[0].sum(), logp)
    cispo_loss, _, capped = surrogates.cispo(torch.exp(logp - old), logp, adv, 5.0)
    (g_cispo,) = torch.autograd.grad(cispo_loss.sum(), logp)
    assert g_clip.item() == 0.0, "PPO's clip: no gradient past 1 + eps"
    assert g_cispo.item() == pytest.approx(-3.0, rel=1e-5) and not capped.any()


@pytest.mark.lesson
def test_dual_clip_bounds_the_loss_of_a_negative_advantage_token_whose_ratio_explodes():
    """A = -1, r = 100: PPO's clip charges 100 (its min keeps r*A) and keeps the token's gradient,
    d(-r A)/dlogp = -r A = 100 (past 1 + eps, the edge A < 0 does not push toward, nothing stops
    it); dual-clip caps the loss at c = 3, with gradient 0."""
    old = torch.tensor([[-6.0]])
    logp = (old + torch.log(torch.tensor(100.0))).requires_grad_(True)
    ratio, adv = torch.exp(logp - old), torch.tensor([-1.0])
    clip_loss, _, _ = surrogates.ppo_clip(ratio, adv, 0.2, 0.2)
    dual_loss, low, _ = surrogates.dual_clip(ratio, adv, 0.2, 0.2, 3.0)
    assert clip_loss.item() == pytest.approx(100.0, rel=1e-4) and dual_loss.item() == pytest.approx(3.0)
    assert torch.autograd.grad(clip_loss.sum(), logp, retain_graph=True)[0].item() == pytest.approx(100.0, rel=1e-4)
    assert torch.autograd.grad(dual_loss.sum(), logp)[0].item() == 0.0
    assert low.all(), "the cap is counted in the lower clip fraction (verl's pg_clipfrac_lower)"


@pytest.mark.lesson
def test_sapo_is_the_plain_policy_gradient_at_ratio_one_and_fades_instead_of_stopping():
    """The weight SAPO puts on grad log pi (A = 1) at r = 1, 1.2, 4, 10: -1 (PPO's), then a
    soft fade, -0.72 at r = 4 where PPO's clip gives exactly 0, and near 0 by r = 10."""
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.0, 1.2, 4.0, 10.0]])).requires_grad_(True)
    loss, _, _ = surrogates.sapo(torch.exp(logp - old), torch.tensor([1.0]), 1.0, 1.05)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    (g_clip,) = torch.autograd.grad(surrogates.ppo_clip(torch.exp(logp - old), torch.tensor([1.0]), 0.2, 0.2)[0].sum(), logp)
    assert g[0, 0].item() == pytest.approx(-1.0, rel=1e-5), "at r = 1: -A, as PPO's"
    assert g_clip[0, 2].item() == 0.0 and g[0, 2].item() == pytest.approx(-0.7225, rel=1e-3)
    assert -0.01 < g[0, 3].item() < 0


@pytest.mark.lesson
def test_gmpo_one_outlier_token_barely_moves_the_sequence_weight():
    """Four tokens at r = 1 and one at r = 50, A > 0: the arithmetic mean of the ratios is
    10.8; GMPO's geometric mean of the clipped ratios is e^(0.4/5) = 1.08."""
    old = torch.zeros(1, 5)
    logp = torch.tensor([[0.0, 0.0, 0.0, 0.0, float(torch.log(torch.tensor(50.0)))]])
    loss, _, high = surrogates.gmpo(logp, old, torch.tensor([1.0]), torch.ones(1, 5), 0.4)
    assert torch.exp(logp - old).mean().item() == pytest.approx(10.8)
    assert -loss[0, 0].item() == pytest.approx(float(torch.exp(torch.tensor(0.08))), rel=1e-5)
    assert high.tolist() == [[False] * 4 + [True]]


@pytest.mark.lesson
@pytest.mark.parametrize("name", ["clip-cov", "kl-cov"])
def test_clip_cov_and_kl_cov_touch_only_the_highest_covariance_tokens(name):
    """Their gradient differs from the plain one (PPO's clip; for KL-Cov, -r A) on the chosen
    tokens alone, and those have the largest (A - mean A)(log pi - mean log pi)."""
    logp, old, adv, mask = inputs(5, n=8, c=6)
    hp = grpo.HyperParams(mini_batch=8, micro_batch=8, policy_loss=name, cov_ratio=0.1, clip_cov_lb=0.0)
    torch.manual_seed(0)
    loss, _, touched = surrogates.policy_gradient_loss(logp, old, adv, mask, hp)
    plain = surrogates.ppo_clip(torch.exp(logp - old), adv, 0.2, 0.2)[0] if name == "clip-cov" else \
        -adv.unsqueeze(1) * torch.exp(logp - old)
    (g,) = torch.autograd.grad((loss * mask).sum(), logp)
    (g_plain,) = torch.autograd.grad((plain * mask).sum(), logp)
    differs = (g - g_plain).abs() > 1e-7
    chosen = touched & mask.bool() & ~surrogates.ppo_clip(torch.exp(logp - old), adv, 0.2, 0.2)[2] \
        if name == "clip-cov" else touched
    assert differs.any() and not (differs & ~chosen).any(), "only the chosen tokens changed"
    cov = surrogates.token_covariance(logp, adv, mask)
    assert chosen.sum() == max(1, int(0.1 * mask.sum()))
    if name == "kl-cov":                       # the top ones by covariance
        assert cov[chosen].min() >= cov[mask.bool() & ~chosen].max()
    else:                                      # drawn among the positive-covariance candidates
        assert (cov[chosen] > 0).all()


@pytest.mark.lesson
def test_at_one_update_per_batch_the_ratio_based_fixes_are_the_plain_policy_gradient():
    """One update per batch (the lab's real-model runs): old = this forward's log-probs, every
    ratio is 1, and clip-higher, dual-clip, CISPO, SAPO and KL-Cov all give the gradient of
    -A log pi, the plain policy gradient, to the last bit of float32: a fix that acts through
    the ratio needs a second epoch (or a stale sampler) to act at all. Clip-Cov does act: the
    tokens it draws lose their gradient."""
    logp, _, adv, mask = inputs(seed=1)
    old = logp.detach()                                                            # r = 1 everywhere
    plain = token_mean(-adv.unsqueeze(1) * logp, mask)
    (g_plain,) = torch.autograd.grad(plain, logp)
    (g_plain_seq,) = torch.autograd.grad(seq_mean_token_mean(-adv.unsqueeze(1) * logp, mask), logp)
    for name, knobs in [("dual-clip", dict(clip_eps_high=0.28)), ("cispo", {}), ("sapo", {}), ("kl-cov", {})]:
        (g,) = torch.autograd.grad(ours(name, logp, old, adv, mask, **knobs)[0], logp)
        want = g_plain_seq if name in surrogates.OWN_AGGREGATION else g_plain     # in the objective's own aggregation
        torch.testing.assert_close(g * mask, want * mask, rtol=1e-6, atol=1e-7, msg=name)
    hp = grpo.HyperParams(mini_batch=6, micro_batch=6, clip_eps_high=0.28)          # clip-higher: grpo's own clip
    loss, _, _ = surrogates.ppo_clip(torch.exp(logp - old), adv, *surrogates.clip_range(hp))
    (g,) = torch.autograd.grad(token_mean(loss.expand_as(logp), mask), logp)
    torch.testing.assert_close(g * mask, g_plain * mask, rtol=1e-6, atol=1e-7)
    torch.manual_seed(0)
    (g,) = torch.autograd.grad(ours("clip-cov", logp, old, adv, mask, cov_ratio=0.2, clip_cov_lb=0.0)[0], logp)
    dropped = (g == 0) & (g_plain != 0) & mask.bool()
    assert dropped.sum() == int(0.2 * mask.sum()), "Clip-Cov takes its tokens out even at r = 1"


@pytest.mark.lesson
def test_the_80_20_mask_trains_only_the_forking_tokens():
    """--top-entropy-quantile 0.2: of ten policy tokens the two of highest entropy keep their
    gradient; the eight near-certain ones get none."""
    entropy = torch.tensor([[0.01, 0.02, 1.5, 0.03, 0.01], [0.02, 2.0, 0.01, 0.05, 0.02]])
    mask = torch.ones(2, 5)
    keep = surrogates.high_entropy_mask(entropy, mask, 0.2)
    assert keep.tolist() == [[0, 0, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert surrogates.high_entropy_mask(entropy, mask, 1.0).tolist() == mask.tolist()


def trl_gmpo_top_entropy(old_log_prob, log_prob, advantages, mask, entropy_mask, delta):
    """GMPO under the 80/20 mask as TRL writes it: the geometric mean over the kept tokens only,
    then the mean over sequences (a sequence with none kept: weight 1, no gradient)."""
    kept = mask * entropy_mask
    log_ratio = log_prob - old_log_prob
    sgn = torch.sign(advantages).unsqueeze(1)
    x = sgn * torch.min(sgn * log_ratio, sgn * log_ratio.clamp(-delta, delta))
    weight = torch.exp((x * kept).sum(-1) / kept.sum(-1).clamp(min=1))
    return (-advantages * weight).mean()


@pytest.mark.lesson
def test_gmpo_under_the_80_20_mask_averages_only_the_kept_tokens():
    """Masking GMPO's per-sequence loss afterwards left the masked tokens inside the geometric
    mean, with a gradient; the kept tokens' mean is TRL's, and a masked token gets no gradient."""
    for seed in range(3):
        logp, old, adv, mask = inputs(seed)
        entropy = torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed + 10))
        keep = surrogates.high_entropy_mask(entropy, mask, 0.4)
        hp = grpo.HyperParams(mini_batch=6, micro_batch=6, policy_loss="gmpo", top_entropy_quantile=0.4,
                              loss_agg="seq-mean-token-mean")
        rows = Rows(tokens=None, mask=mask, old_logp=old, ref_logp=None, advantages=adv, old_values=None, returns=None)
        per_token, _ = grpo.policy_loss(logp, old, entropy, rows, hp)
        mine = grpo.aggregate(per_token, mask, hp.loss_agg, len(mask), mask.sum(), 24)
        theirs = trl_gmpo_top_entropy(old, logp, adv, mask, keep, 0.4)
        (g_mine,) = torch.autograd.grad(mine, logp)
        (g_theirs,) = torch.autograd.grad(theirs, logp)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g_mine * mask, g_theirs * mask, rtol=1e-5, atol=1e-6)
        assert (g_mine[(keep == 0) & (mask == 1)] == 0).all(), "a masked token keeps no gradient"


@pytest.mark.parametrize("name", sorted(surrogates.OWN_AGGREGATION))
def test_sapo_gmpo_and_luspo_aggregate_as_written_unless_loss_agg_is_given(name, tmp_path):
    from running import config
    level = ["--ratio-level", "sequence"] if name == "luspo" else []          # LUSPO's ratio is GSPO's
    own = config.parse_config(["--policy-loss", name, *level, "--out", str(tmp_path / "a")]).loss_agg
    assert own == surrogates.OWN_AGGREGATION[name] and own != "token-mean"
    given = config.parse_config(["--policy-loss", name, *level, "--loss-agg", "token-mean", "--out", str(tmp_path / "b")])
    assert given.loss_agg == "token-mean"


def metrics(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


# five steps of two epochs of the default-sized tiny model (after --quick's flags, which they override)
# one CPU trajectory (on a GPU, CUDA's sampling gave rollouts whose first update left no token
# outside DPPO's trust region: its loss was the clip's to the bit)
BASE = ["--steps", "5", "--eval-every", "5", "--epochs", "2", "--hidden", "64", "--layers", "2", "--sft-steps", "60",
        "--batch", "4", "--k", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    """The metrics of the BASE run with PPO's clip, once for every comparison below."""
    from running import config
    import train
    tmp = tmp_path_factory.mktemp("surrogates")
    train.train(configure(quick(tmp, "clip", *BASE)))
    BASE.extend(["--cache-dir", str(WARM_STARTS)])       # the other runs start from the same warm start
    return metrics(tmp / "clip")


@pytest.mark.parametrize("flags", [["--policy-loss", "dual-clip", "--dual-clip-c", "1.05"], ["--policy-loss", "cispo"],
                                   ["--policy-loss", "sapo"], ["--policy-loss", "gmpo"],
                                   ["--policy-loss", "clip-cov", "--cov-ratio", "0.05"],
                                   ["--policy-loss", "kl-cov", "--cov-ratio", "0.05"],
                                   ["--top-entropy-quantile", "0.2"], ["--overlong-buffer", "20"]])
def test_each_policy_loss_trains_and_changes_only_the_update(flags, clip_run, tmp_path):
    """Five steps of two epochs with another objective: up to the first update the run is the
    clip run (the same rollouts), that update's loss differs, and every later step updates.
    (dual-clip with c = 1.05, so that its cap bites within two epochs: see the next test.)"""
    from running import config
    import train
    train.train(configure(quick(tmp_path, "other", *BASE, *flags)))
    clip, other = clip_run, metrics(tmp_path / "other")
    first = next(i for i, row in enumerate(clip) if row.get("loss") is not None)
    assert clip[first]["reward_mean"] == other[first]["reward_mean"], "the same rollouts until the first update"
    assert clip[first]["loss"] != other[first]["loss"], "another objective"
    assert all(0 <= row["clip_frac_low"] <= 1 and 0 <= row["clip_frac_high"] <= 1 for row in other[1:]
               if row["clip_frac_low"] is not None)


def test_dual_clip_at_its_default_cap_changes_nothing_until_a_ratio_explodes(clip_run, tmp_path):
    """c = 3 only bites on a negative-advantage token whose ratio passed 3: a short healthy
    run never gets there, so it is the clip run, number for number."""
    from running import config
    import train
    train.train(configure(quick(tmp_path, "dual", *BASE, "--policy-loss", "dual-clip")))
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(clip_run) == strip(metrics(tmp_path / "dual"))


@pytest.mark.parametrize("argv, message", [
    (["--policy-loss", "dual-clip", "--dual-clip-c", "1"], "--dual-clip-c: must be > 1"),
    (["--policy-loss", "cispo", "--cispo-max", "-5"], "--cispo-max: must be in [1, 10000]"),
    (["--policy-loss", "sapo", "--sapo-tau-neg", "0"], "--sapo-tau-neg: must be in [0.001, 1000]"),
    (["--dual-clip-c", "4"], "--dual-clip-c: only --policy-loss dual-clip reads it"),
    (["--policy-loss", "cispo", "--clip-eps", "0.3"], "--clip-eps: only --policy-loss clip, luspo, dual-clip, clip-cov and clip-inverted read it; --policy-loss cispo would ignore it"),
    (["--policy-loss", "sapo", "--ratio-level", "sequence"], "--policy-loss: sapo weighs each token by its own ratio"),
    (["--policy-loss", "gmpo", "--algo", "ppo"], "--policy-loss: gmpo weighs a sequence by one advantage; --algo ppo"),
    (["--policy-loss", "cispo", "--algo", "rce"], "--policy-loss: only --algo grpo and ppo use it"),
    (["--top-entropy-quantile", "0"], "--top-entropy-quantile: is a share of the tokens, in (0, 1]"),
    (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile: is a share of the tokens, in (0, 1]"),
    (["--policy-loss", "kl-cov", "--cov-ratio", "-1"], "--cov-ratio: must be > 0"),
    (["--policy-loss", "clip-cov", "--clip-cov-lb", "6"], "--clip-cov-lb: must be below clip_cov_ub"),
    (["--cov-ratio", "0.1"], "--cov-ratio: only --policy-loss clip-cov and kl-cov read it"),
    (["--overlong-buffer", "24"], "--overlong-buffer: must be in [0, the completion limit 24)"),
    (["--overlong-buffer", "-1"], "--overlong-buffer: must be in [0, the completion limit 24)"),
])
def test_bad_policy_loss_settings_are_refused_in_one_line(argv, message, tmp_path, capsys):
    assert_refused_in_one_line(tmp_path, capsys, argv, message)


@pytest.mark.parametrize("name", ["dual-clip", "sapo", "clip", "cispo"])
def test_an_exploded_ratio_gives_a_finite_gradient_as_verls_clamp_does(name):
    """log r = 100 (exp overflows float32): verl clamps the log-ratio to [-20, 20] and gets a
    gradient of 0 there; without the clamp dual-clip's cap and SAPO's gate gave NaN."""
    old = torch.tensor([[-110.0, -2.0]])
    logp = torch.tensor([[-10.0, -2.1]], requires_grad=True)                     # log r = 100, -0.1
    adv = torch.tensor([-1.0])
    hp = grpo.HyperParams(mini_batch=1, micro_batch=1, policy_loss=name)
    rows = Rows(tokens=None, mask=torch.ones(1, 2), old_logp=old, ref_logp=None, advantages=adv,
                old_values=None, returns=None)
    per_token, _ = grpo.policy_loss(logp, old, torch.zeros(1, 2), rows, hp)
    (g,) = torch.autograd.grad(per_token.sum(), logp)
    assert torch.isfinite(per_token).all() and torch.isfinite(g).all(), (per_token, g)
    if name != "cispo":                             # CISPO's gradient is -min(r, cap) A: never 0
        assert g[0, 0] == 0, "the exploded token: no gradient, as verl's clamp gives"
    assert g[0, 1] != 0, "the other token still learns"
