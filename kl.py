"""KL to a reference policy: the estimators, and the controllers that set its weight beta.

Per token, with x = logp_ref - logp for a token the policy sampled (Schulman, "Approximating
KL divergence", 2020), each an estimator of KL(policy || reference):

    k1 = -x = logp - logp_ref            unbiased; negative on some tokens; high variance
    k2 = x^2 / 2                         biased (exact only to second order); >= 0; low variance
    k3 = exp(x) - x - 1                  unbiased; >= 0; low variance (GRPO's choice)

Where the KL goes (`--kl-in`): PPO's habit is a per-token penalty in the *reward*
(r_t -= beta * kl_t, so GAE carries it); GRPO's is a term in the *loss* (+ beta * kl_t).

How beta moves (`--kl-control`), once per step, from the measured KL of the step's rollouts
(the token mean of k3):

    fixed   beta never changes.
    ratio   report 002: target T (--kl-target, 0.01); beta x1.5 when KL > 2T, x0.8 when
            KL < T/2; clamped to [0.01, 1.0].
    range   report 003: beta x1.5 when KL > --kl-target-max, x0.8 when KL < --kl-target-min,
            unchanged in between; clamped to [0.001, 10] (the report's beta went 10 -> 0.001).
            Report 003 does not spell out its update factors; 1.5 and 0.8 are 002's.

A run starts at the reference, so KL starts at 0 and both adaptive rules first *lower* beta:
with the range rule, beta keeps falling until KL climbs past kl_target_min, and stays at its
floor if it never does.
"""
import torch

ESTIMATORS = ("k1", "k2", "k3")
CONTROLS = ("fixed", "ratio", "range")


def estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate; logp, ref_logp (n, C) -> (n, C)."""
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x ** 2
    if estimator == "k3":
        return torch.exp(x) - x - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")


class KLController:
    """beta for the next step, from the KL measured on this one."""

    UP, DOWN = 1.5, 0.8
    CLAMP = {"fixed": (0.0, float("inf")), "ratio": (0.01, 1.0), "range": (0.001, 10.0)}

    def __init__(self, beta: float, control: str = "fixed", target: float = 0.01,
                 target_min: float = 0.01, target_max: float = 0.1):
        if control not in CONTROLS:
            raise ValueError(f"unknown KL control {control!r}; expected one of {CONTROLS}")
        self.beta, self.control = beta, control
        self.target, self.target_min, self.target_max = target, target_min, target_max

    def update(self, kl: float) -> float:
        if self.control == "ratio":
            high, low = 2 * self.target, 0.5 * self.target
        elif self.control == "range":
            high, low = self.target_max, self.target_min
        else:
            return self.beta
        if kl > high:
            self.beta *= self.UP
        elif kl < low:
            self.beta *= self.DOWN
        lo, hi = self.CLAMP[self.control]
        self.beta = min(max(self.beta, lo), hi)
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]
