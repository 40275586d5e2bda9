"""KL estimators against closed forms, and both adaptive controllers on scripted KL sequences."""
import pytest
import torch

import kl

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
    c = kl.KLController(beta=0.1, control="ratio", target=0.01)
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


def test_report_003_range_rule_lets_beta_drift_to_its_floor_while_kl_stays_in_range():
    c = kl.KLController(beta=10.0, control="range", target_min=0.01, target_max=0.1)
    assert c.update(20.0) == pytest.approx(10.0)                 # already at the ceiling
    betas = [c.update(0.005) for _ in range(60)]                 # KL below the range
    assert betas[0] == pytest.approx(8.0) and betas[-1] == 0.001  # x0.8 per step, to the floor
    assert c.update(0.03) == 0.001                               # in range: beta stays on the floor
    assert c.update(0.5) == pytest.approx(0.0015)                # above the range: x1.5


def test_fixed_control_never_moves():
    c = kl.KLController(beta=0.05)
    assert [c.update(x) for x in (0.0, 1.0, 100.0)] == [0.05, 0.05, 0.05]
