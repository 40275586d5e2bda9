"""KL to a reference policy: the estimators, and the controllers that set its weight beta.

Per token, with x = logp_ref - logp for a token the policy sampled (Schulman, "Approximating
KL divergence", 2020), each an estimator of KL(policy || reference):

    k1 = -x = logp - logp_ref            unbiased; negative on some tokens; high variance
    k2 = x^2 / 2                         biased (exact only to second order); >= 0; low variance
    k3 = exp(x) - x - 1                  unbiased; >= 0; low variance (GRPO's choice); not
                                         clamped (verl and OpenRLHF clamp it to [-10, 10])

Their values and their gradients are different lessons. As *values* (the logged `kl`), k1
and k3 are unbiased for KL(policy || reference) and k2 is not. As a *loss* (+ beta * k, the
samples x ~ policy held fixed, as every trainer does), the expected gradient is

    E[grad k1] = E[grad log pi(x)]                            = 0
    E[grad k2] = E[log(pi(x)/ref(x)) grad log pi(x)]          = grad KL(policy || reference)
    E[grad k3] = E[(1 - ref(x)/pi(x)) grad log pi(x)]         = grad KL(reference || policy)

so k1 in the loss regularises nothing (its gradient is zero-mean noise), k2 pulls on the KL
its name promises, and k3 (GRPO's choice, and TRL's and verl's default "low_var_kl") pulls
on the *forward* KL, reference to policy: mass-covering, it punishes the policy for
dropping tokens the reference likes more than for adding new ones. tests/test_kl.py proves
all six claims on an exact categorical distribution.

Where the KL goes (`--kl-in`): PPO's habit is a per-token penalty in the *reward*
(r_t -= beta * kl_t, so GAE carries it); GRPO's is a term in the *loss* (+ beta * kl_t).
In the reward an estimator is a number per sample, not differentiated: it acts through the
score function, E[k grad log pi], and the lesson turns around:

    reward k1: E[log(pi/ref) grad log pi]                     = grad KL(policy || reference)
    reward k3: E[(ref/pi - 1 + log(pi/ref)) grad log pi]      = grad KL(policy || reference)
                                                                - grad KL(reference || policy)

The two terms of k3's cancel to first order near the reference, where a run starts: by exact
enumeration over 7 words, k3 in the reward keeps a few percent of the pull (tests/test_kl.py).
So the reward side takes k1 (as TRL, verl and OpenRLHF do) and the loss side k3: the
command line's `--kl-estimator auto` resolves to one or the other by `--kl-in`, and
train.py warns when k2 or k3 is asked for in the reward.

How beta moves (`--kl-control`), once per step, from a measured KL (READS says which):

    fixed   beta never changes.
    ratio   report 002: target T (--kl-target, 0.01); beta x1.5 when KL > 2T, x0.8 when
            KL < T/2; clamped to [0.01, 1.0]. KL: the rollouts' token-mean k3 to the reference.
    range   report 003, as the public code that matches its parameters has it
            (adaptive_kl_beta): beta x1.5 when KL > --kl-target-max, /1.5 when KL <
            --kl-target-min, unchanged in between; clamped to [0.001, 10]. KL: the update's own,
            the batch's token mean of k3 between the policy that sampled and the policy after
            the update (update.policy_shift). From 10 to the floor in 23 steps below the range.
    proportional   Ziegler et al. (2019), as TRL's AdaptiveKLController and verl's and
            OpenRLHF's adaptive controllers: e = clip(KL / T - 1, -0.2, 0.2),
            beta *= 1 + e * n / horizon, n the samples of the step (N = B*K), horizon
            kl_horizon (10000, TRL's default). Smooth and slow: at most 0.2 * N / horizon
            per step (0.13% at N = 64), where the reports' rules jump by x1.5 or x0.8. No clamp;
            a horizon at or below 0.2 N would make the factor <= 0 (problems, below, refuses it).
            KL: the rollouts' to the reference.

The starting beta must lie in the rule's range (problems refuses it otherwise; the controller
raises): a start outside would be clamped at the first update, a jump no rule asked for.

A run starts at the reference, so the KL to it starts at 0 and the adaptive rules first *lower*
beta: with a range rule, beta keeps falling until the KL climbs past kl_target_min, and stays
at its floor if it never does. Report 003's KL (old to new policy) is small whenever the
updates are: there the floor is reached by any run whose steps move the policy little.
"""
from dataclasses import dataclass, field

import torch

ESTIMATORS = ("k1", "k2", "k3")
REWARD_ESTIMATOR, LOSS_ESTIMATOR = "k1", "k3"      # --kl-estimator auto, by where the KL goes
CONTROLS = ("fixed", "ratio", "range", "proportional")
# which measured KL each rule reads: the step's rollouts' KL to the reference ("kl"), or the
# update's KL between the policy before and after it ("policy_shift": report 003's code)
READS = {"fixed": "kl", "ratio": "kl", "range": "policy_shift", "proportional": "kl"}


@dataclass
class Knobs:
    """KL to the reference: its weight beta, how beta moves, how the KL is estimated and where it goes."""
    beta: float = field(default=0.0, metadata={"help": "KL coefficient (at the start, if adaptive); 0 with fixed "
                                               "control = no reference model", "min": 0, "max": 100.0,
                                               "aliases": ("--kl-coef",)})
    kl_control: str = field(default="fixed", metadata={"help": "how beta moves: fixed, ratio (report 002), range "
                            "(report 003's code: x1.5 / /1.5 on the update's KL between old and new policy) or "
                            "proportional (Ziegler et al., as TRL/verl/OpenRLHF)", "choices": CONTROLS})
    kl_target: float = field(default=0.01, metadata={"help": "ratio and proportional control: the KL target"})
    kl_horizon: float = field(default=10000.0, metadata={"help": "proportional control: beta *= 1 + clip(KL/target "
                                                         "- 1, +-0.2) * N / horizon", "flag": False})
    kl_target_min: float = field(default=0.01, metadata={"help": "range control: lower beta below this KL"})
    kl_target_max: float = field(default=0.1, metadata={"help": "range control: raise beta above this KL"})
    kl_estimator: str = field(default="auto", metadata={"help": "per-token KL estimator; auto = k1 in the reward, "
                              "k3 in the loss (in the reward k3's pull nearly cancels)", "choices": ("auto", *ESTIMATORS)})
    kl_in: str = field(default="auto", metadata={"help": "where the KL goes: loss (GRPO's habit), reward (PPO's); "
                                                 "auto = by --algo", "choices": ("auto", "loss", "reward")})
    kl_ratio_correction: bool = field(default=False, metadata={"help": "the loss's KL term times each token's ratio "
                                      "pi / pi_old, with its gradient: the reverse KL's gradient, not the forward's "
                                      "(TRL's use_bias_correction_kl; mistakes.py, 6)", "flag": False})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    lo, hi = KLController.CLAMP[cfg.kl_control]
    if cfg.kl_control != "fixed" and not (cfg.beta > 0 and lo <= cfg.beta <= hi):
        yield "kl-coef", (f"--kl-control {cfg.kl_control} keeps beta in [{lo}, {hi}] and needs a starting value "
                          f"above 0 in it, got {cfg.beta}")
    for name in ("kl_target", "kl_horizon"):
        if getattr(cfg, name) <= 0:
            yield name, f"must be > 0, got {getattr(cfg, name)}"
    # Ziegler's beta *= 1 + e * N / horizon with e down to -0.2 turns beta negative unless horizon > 0.2 N
    if cfg.kl_control == "proportional" and cfg.kl_horizon <= 0.2 * cfg.n:
        yield "kl-horizon", (f"must be above 0.2 * N = {0.2 * cfg.n:g} (N = --batch x --k): the step beta *= 1 + "
                             f"e * N / horizon, e down to -0.2, would turn beta negative; got {cfg.kl_horizon:g}")
    if not 0 < cfg.kl_target_min < cfg.kl_target_max:
        yield "kl-target-min", (f"need 0 < --kl-target-min < --kl-target-max, got {cfg.kl_target_min} and "
                                f"{cfg.kl_target_max}")


def estimator(hp) -> str:
    """--kl-estimator, auto resolved by where the KL goes: k1 in the reward, k3 in the loss."""
    if hp.kl_estimator != "auto":
        return hp.kl_estimator
    return REWARD_ESTIMATOR if hp.kl_in_reward else LOSS_ESTIMATOR


def estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate; logp, ref_logp (n, C) -> (n, C)."""
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x ** 2
    if estimator == "k3":                # expm1: exp(x) - 1 cancels to 0 or below in float32 (mistakes.py, 5)
        return torch.expm1(x) - x
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {ESTIMATORS}")


@dataclass
class KLRule:
    """How beta moves: the control and the numbers it reads (train.py's --kl-* flags)."""
    control: str = "fixed"
    target: float = 0.01                  # ratio, proportional
    target_min: float = 0.01              # range
    target_max: float = 0.1               # range
    horizon: float = 10000.0              # proportional
    samples_per_step: int = 1             # proportional: Ziegler's n_steps (N = B*K here)


class KLController:
    """beta for the next step, from the KL measured on this one."""

    UP = 1.5
    DOWN = {"ratio": 0.8, "range": 1 / 1.5}     # report 003's code divides by 1.5
    CLAMP = {"fixed": (0.0, float("inf")), "ratio": (0.01, 1.0), "range": (0.001, 10.0),
             "proportional": (0.0, float("inf"))}

    def __init__(self, beta: float, rule: KLRule | None = None):
        rule = rule or KLRule()
        if rule.control not in CONTROLS:
            raise ValueError(f"unknown KL control {rule.control!r}; expected one of {CONTROLS}")
        lo, hi = self.CLAMP[rule.control]
        if not lo <= beta <= hi:
            raise ValueError(f"starting beta {beta} is outside the {rule.control} rule's range [{lo}, {hi}]")
        self.beta, self.rule = beta, rule

    def update(self, kl: float) -> float:
        rule = self.rule
        if rule.control == "proportional":
            # Ziegler et al.: a proportional controller on log(beta), its error clipped
            error = min(max(kl / rule.target - 1, -0.2), 0.2)
            self.beta *= 1 + error * rule.samples_per_step / rule.horizon
            return self.beta
        if rule.control == "ratio":
            high, low = 2 * rule.target, 0.5 * rule.target
        elif rule.control == "range":
            high, low = rule.target_max, rule.target_min
        else:
            return self.beta
        if kl > high:
            self.beta *= self.UP
        elif kl < low:
            self.beta *= self.DOWN[rule.control]
        lo, hi = self.CLAMP[rule.control]
        self.beta = min(max(self.beta, lo), hi)
        return self.beta

    def state_dict(self) -> dict:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]
