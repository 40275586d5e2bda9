"""KL estimators against closed forms, and both adaptive controllers on scripted KL sequences."""
import pytest
import torch

import kl

pytestmark = pytest.mark.lesson          # every test here is a lesson: python -m pytest -m lesson

P = torch.tensor([0.6, 0.25, 0.1, 0.05])      # the policy
Q = torch.tensor([0.4, 0.3, 0.2, 0.1])        # the reference
EXACT = (P * (P / Q).log()).sum()             # KL(P || Q)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_exact_kl(estimator):
    # E_{x ~ P}[k(x)] in closed form: weight each outcome by its probability under P.
    per_token = kl.estimate(P.log(), Q.log(), estimator)
    torch.testing.assert_close((P * per_token).sum(), EXACT)


def test_k2_is_biased_but_close_for_nearby_distributions():
    per_token = kl.estimate(P.log(), Q.log(), "k2")
    expectation = (P * per_token).sum()
    assert expectation != pytest.approx(EXACT.item(), rel=1e-3)   # biased
    assert expectation == pytest.approx(EXACT.item(), rel=0.2)    # ... by a second-order amount


def test_k1_goes_negative_on_some_tokens_k2_and_k3_never_do():
    k1, k2, k3 = (kl.estimate(P.log(), Q.log(), e) for e in ("k1", "k2", "k3"))
    assert (k1 < 0).any()
    assert (k2 >= 0).all() and (k3 >= 0).all()
    assert torch.equal(kl.estimate(P.log(), P.log(), "k3"), torch.zeros(4))


def test_sampled_k3_has_less_variance_than_k1():
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(P, 20000, replacement=True, generator=gen)
    k1 = kl.estimate(P.log()[x], Q.log()[x], "k1")
    k3 = kl.estimate(P.log()[x], Q.log()[x], "k3")
    assert k3.var() < k1.var()
    assert k1.mean().item() == pytest.approx(EXACT.item(), abs=0.01)
    assert k3.mean().item() == pytest.approx(EXACT.item(), abs=0.01)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl.estimate(P.log(), Q.log(), "k4")


def test_report_002_ratio_rule_on_a_scripted_kl_sequence():
    c = kl.KLController(0.1, kl.KLRule("ratio", target=0.01))
    # KL > 2*target raises beta x1.5; < target/2 lowers it x0.8; in between leaves it.
    assert c.update(0.05) == pytest.approx(0.15)
    assert c.update(0.015) == pytest.approx(0.15)
    assert c.update(0.001) == pytest.approx(0.12)
    for _ in range(50):
        c.update(1.0)
    assert c.beta == 1.0                                         # clamped at the top
    for _ in range(100):
        c.update(0.0)
    assert c.beta == 0.01                                        # and at the bottom


def adaptive_kl_beta(beta, kl, kl_target_min=0.01, kl_target_max=0.1, factor=1.5):
    """A re-implementation of the public code that matches report 003's parameters."""
    if kl > kl_target_max:
        beta = beta * factor
    elif kl < kl_target_min:
        beta = beta / factor
    return min(max(beta, 0.001), 10.0)


def test_report_003_range_rule_is_its_codes_rule_and_reaches_the_floor_in_23_steps():
    c = kl.KLController(10.0, kl.KLRule("range", target_min=0.01, target_max=0.1))
    ref, gen = 10.0, torch.Generator().manual_seed(0)
    for value in torch.rand(200, generator=gen).mul(0.2).tolist():       # KLs below, inside, above
        ref = adaptive_kl_beta(ref, value)
        assert c.update(value) == pytest.approx(ref)
    c = kl.KLController(10.0, kl.KLRule("range", target_min=0.01, target_max=0.1))
    betas = [c.update(0.005) for _ in range(30)]                          # KL below the range
    assert betas.index(0.001) + 1 == 23                                   # /1.5 a step, to the floor
    assert c.update(0.03) == 0.001                                       # in range: beta stays on the floor
    assert c.update(0.5) == pytest.approx(0.0015)                        # above the range: x1.5
    assert kl.READS["range"] == "policy_shift", "report 003's code reads the update's KL, old to new policy"


def trl_adaptive_kl(value, target, horizon):
    """A re-implementation of TRL's AdaptiveKLController (Ziegler et al. 2019)."""
    def update(current, n_steps):
        nonlocal value
        proportional_error = min(max(current / target - 1, -0.2), 0.2)
        value *= 1 + proportional_error * n_steps / horizon
        return value
    return update


def test_proportional_rule_equals_trl_adaptive_kl_controller():
    import random
    rng = random.Random(0)
    ours = kl.KLController(0.2, kl.KLRule("proportional", target=0.05, horizon=500, samples_per_step=64))
    trl = trl_adaptive_kl(0.2, 0.05, 500)
    for _ in range(100):
        x = rng.choice([0.0, 0.01, 0.049, 0.051, 0.3, 5.0]) * rng.random()
        assert ours.update(x) == pytest.approx(trl(x, 64), rel=1e-12)
    c = kl.KLController(1.0, kl.KLRule("proportional", target=0.1, horizon=100, samples_per_step=10))
    assert c.update(10.0) == pytest.approx(1.0 * (1 + 0.2 * 10 / 100))   # the error is clipped at +0.2
    assert c.update(0.0) == pytest.approx(1.02 * (1 - 0.2 * 0.1))         # and at -0.2


def test_a_starting_beta_outside_the_rule_s_range_is_refused():
    with pytest.raises(ValueError, match="outside the ratio rule's range"):
        kl.KLController(5.0, kl.KLRule("ratio"))
    with pytest.raises(ValueError, match="outside the range rule's range"):
        kl.KLController(0.0001, kl.KLRule("range"))


def test_fixed_control_never_moves():
    c = kl.KLController(0.05)
    assert [c.update(x) for x in (0.0, 1.0, 100.0)] == [0.05, 0.05, 0.05]


# ---- the estimator as a loss: its expected gradient (samples held fixed) ----

def expected_value_and_gradient(estimator):
    """E_{x ~ pi}[k(x)] and its gradient w.r.t. the policy's logits, computed exactly: the
    expectation weights each outcome by pi(x) held fixed (the samples do not move with the
    weights, as in every trainer), the estimator's own pi(x) carries the gradient."""
    logits = P.log().clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    value = (logp.exp().detach() * kl.estimate(logp, Q.log(), estimator)).sum()
    (grad,) = torch.autograd.grad(value, logits)
    return value.detach(), grad


def closed_form_gradient(which):
    logits = P.log().clone().requires_grad_(True)
    pi = torch.softmax(logits, -1)
    divergence = (pi * (pi / Q).log()).sum() if which == "policy||ref" else (Q * (Q / pi).log()).sum()
    (grad,) = torch.autograd.grad(divergence, logits)
    return grad


def test_k1_in_the_loss_has_zero_expected_gradient():
    value, grad = expected_value_and_gradient("k1")
    torch.testing.assert_close(value, EXACT)                          # an unbiased value ...
    torch.testing.assert_close(grad, torch.zeros(4), atol=1e-7, rtol=0)  # ... that regularises nothing


def test_k2_in_the_loss_gives_the_gradient_of_kl_policy_to_reference():
    value, grad = expected_value_and_gradient("k2")
    assert value != pytest.approx(EXACT.item(), rel=1e-3)             # a biased value ...
    torch.testing.assert_close(grad, closed_form_gradient("policy||ref"))  # ... the right gradient


def test_k3_in_the_loss_gives_the_gradient_of_the_forward_kl_reference_to_policy():
    value, grad = expected_value_and_gradient("k3")
    torch.testing.assert_close(value, EXACT)                          # an unbiased value of KL(pi||ref) ...
    torch.testing.assert_close(grad, closed_form_gradient("ref||policy"))  # ... pulls on KL(ref||pi)
    assert not torch.allclose(grad, closed_form_gradient("policy||ref"), atol=1e-3)


# ---- the estimator as a reward penalty: it acts through the score function ----

def reward_side_gradient(estimator, pi_logits, ref):
    """E_{x ~ pi}[k(x) grad log pi(x)], exactly over the vocabulary: the gradient a reward
    penalty r -= beta * k gives (PPO's --kl-in reward), k a number per sample, not differentiated."""
    logits = pi_logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    k = kl.estimate(logp.detach(), ref.log(), estimator)                         # (V,) per outcome
    (grad,) = torch.autograd.grad((logp.exp().detach() * k * logp).sum(), logits)
    return grad


def exact_gradients(pi_logits, ref):
    """grad KL(pi || ref) and grad KL(ref || pi), by autograd on the closed forms."""
    out = []
    for which in ("policy||ref", "ref||policy"):
        logits = pi_logits.clone().requires_grad_(True)
        pi = torch.softmax(logits, -1)
        divergence = (pi * (pi / ref).log()).sum() if which == "policy||ref" else (ref * (ref / pi).log()).sum()
        out.append(torch.autograd.grad(divergence, logits)[0])
    return out


def test_in_the_reward_k1_gives_the_kl_gradient_and_k3_nearly_cancels_near_the_reference():
    """The same estimators in the other place. As a reward penalty (PPO's habit) an
    estimator k acts through E_pi[k grad log pi]: k1 = log(pi/ref) gives exactly grad
    KL(pi||ref), as TRL, verl and OpenRLHF use it there; k3 gives grad KL(pi||ref) - grad
    KL(ref||pi), which cancels to first order near the reference, where PPO starts."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)     # a 7-word reference
    direction = torch.randn(7, generator=gen, dtype=torch.float64)
    shares = []
    for scale in (0.03, 0.1, 0.3, 1.0):                # the policy moved away from the reference
        pi_logits = ref.log() + scale * direction
        forward, backward = exact_gradients(pi_logits, ref)
        torch.testing.assert_close(reward_side_gradient("k1", pi_logits, ref), forward)
        k3 = reward_side_gradient("k3", pi_logits, ref)
        torch.testing.assert_close(k3, forward - backward)
        shares.append((k3.norm() / forward.norm()).item())
    assert shares[0] < 0.05, f"near the reference k3 in the reward keeps {shares[0]:.1%} of the pull"
    assert shares == sorted(shares), "and it recovers only as the policy moves away"
