"""The learning-rate schedule and the linear schedule of the entropy bonus at chosen steps (update.py)."""
import math

import pytest

import update


def test_constant_with_warmup():
    lr = [update.lr_at(s, 100, 1e-3, "constant", warmup=4) for s in (1, 2, 4, 5, 100)]
    assert lr == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3])


def test_linear_decays_to_min_lr_at_the_last_step():
    f = lambda s: update.lr_at(s, 101, 1.0, "linear", min_lr=0.1)
    assert f(1) == pytest.approx(1.0 - 0.9 / 101)
    assert f(51) == pytest.approx(0.1 + 0.9 * (1 - 51 / 101))
    assert f(101) == pytest.approx(0.1)


def test_cosine_is_half_way_at_the_middle_and_min_at_the_end():
    f = lambda s: update.lr_at(s, 110, 1.0, "cosine", min_lr=0.0, warmup=10)
    assert f(10) == pytest.approx(1.0)                       # end of warm-up
    assert f(60) == pytest.approx(0.5)                       # p = 0.5: (1 + cos(pi/2)) / 2
    assert f(110) == pytest.approx(0.0, abs=1e-12)
    assert f(35) == pytest.approx((1 + math.cos(math.pi * 0.25)) / 2)


def test_unknown_schedule_raises():
    with pytest.raises(ValueError, match="unknown lr schedule"):
        update.lr_at(1, 10, 1.0, "step")


def test_entropy_coef_decays_linearly_from_start_to_end():
    vals = [update.linear(s, 5, 0.01, 0.001) for s in (1, 3, 5)]
    assert vals == pytest.approx([0.01, 0.0055, 0.001])
