"""The 2026 trust regions: DPPO's masks in probability, the squared log-ratio, VESPO's soft weight.

PPO's clip bounds each token's *ratio* r = p / p_old. Read in probability space, that is a
region whose width depends on the token: a rare token (p_old = 0.01) may rise only to 0.012
before its gradient stops, while a likely one (p_old = 0.9) can never leave [0.8, 1.2] upward
(r <= 1 / 0.9 = 1.11), so it is never bounded on that side however far its probability runs.
DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879) bounds the
move in probability itself:

    dppo-tv   keep a token unless its probability moved more than delta the way its advantage
              pushes:  A > 0 and p - p_old > delta,  or  A < 0 and p_old - p > delta
    dppo-kl   the same, with the Bernoulli KL between p_old and p as the distance:
              KL = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)) > delta
              on the side its advantage pushes (a move back toward p_old is always kept)

    loss_it = -keep_it * r_it * A_it          (a dropped token: no gradient at all)

prime-rl's default loss (delta 0.2 for TV), verl's `dppo_tv` / `dppo_kl` (whose gradient,
-A min(r, c) grad log p, is this one's for r < c; the authors' scripts use delta 0.15 TV and
0.05 KL with c = 1e4).

    sq-logratio   loss_it = -A_it log p_it + (beta / 2) (log p_it - log p_old_it)^2

no mask and no clip: a soft trust region whose pull back grows with the distance moved
(Tinker's "dro", beta 0.05 as its docs' example; prime-rl adds the same square at 1e-3 to DPPO;
Kimi's k1.5/K2 square the whole sequence's log-ratio instead, which pulls back alike only while
every ratio is 1). Its gradient is
(-A + beta log r) grad log p: the plain policy gradient at r = 1.

    vespo     loss_it = -phi(w_i) A_i log p_it,   phi(w) = e^lam w^k e^(-lam w)  (phi(1) = 1, no gradient)

w_i = prod_t r_it the *product* of sequence i's token ratios; k and lam are (2, 3) for A >= 0
and (3, 2) for A < 0 (TRL's `get_gamma_weights`, VESPO's defaults): a gamma-shaped weight that
fades smoothly as the sequence's ratio leaves 1 either way, instead of a hard edge.

    python train.py --policy-loss dppo-tv --epochs 2      # two epochs: the ratio leaves 1

The lesson as a test: `python -m pytest -q tests/test_trust_regions.py -m lesson`.
"""
import math
from dataclasses import dataclass, field

import torch

DPPO = ("dppo-tv", "dppo-kl")
VESPO = {"k_pos": 2.0, "lam_pos": 3.0, "k_neg": 3.0, "lam_neg": 2.0}     # TRL's vespo_k_pos ... defaults


@dataclass
class Knobs:
    """DPPO's trust region in probability and the squared log-ratio's weight (2026)."""
    dppo_delta: float = field(default=0.2, metadata={
        "help": "dppo-tv: the largest probability move |p - p_old| kept on the side the advantage pushes",
        "objective": ("dppo-tv",), "min": 0.0, "max": 1.0, "flag": False})
    dppo_kl_delta: float = field(default=0.05, metadata={
        "help": "dppo-kl: the largest Bernoulli KL(p_old, p) kept on the side the advantage pushes",
        "objective": ("dppo-kl",), "min": 0.0, "max": 100.0, "flag": False})
    sq_beta: float = field(default=0.05, metadata={
        "help": "sq-logratio: beta of (beta / 2) (log p - log p_old)^2", "objective": ("sq-logratio",),
        "min": 0.0, "max": 1e4, "flag": False})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    for name in ("dppo_delta", "dppo_kl_delta", "sq_beta"):
        if getattr(cfg, name) <= 0:
            yield name, f"must be > 0, got {getattr(cfg, name)}"
    if cfg.policy_loss == "vespo" and cfg.algo != "grpo":
        yield "policy-loss", f"vespo weighs a sequence by one advantage; --algo {cfg.algo} has none"
    if cfg.policy_loss == "vespo" and cfg.rollout_correction != "none":
        yield "policy-loss", ("vespo folds the sampler's weight into its own w (TRL); here the correction would "
                              "multiply it again: leave --rollout-correction none")


def per_token(adv, like):
    """(n,) one advantage per sequence, or (n, C) per token -> broadcast to like's (n, C)."""
    return (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand_as(like)


def bernoulli_kl(old_logp, logp):
    """KL(Bernoulli(p_old) || Bernoulli(p)): DPPO's binary approximation of the policy's move
    (the sampled token against all the others together); 1e-8 guards log 0, as in verl."""
    p_old, p = torch.exp(old_logp), torch.exp(logp)
    return p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


def dppo(logp, old_logp, adv, kind: str, delta: float):
    """DPPO's per-token loss (n, C) and where its mask dropped a token (low: A < 0, high: A > 0).
    kind: "dppo-tv" or "dppo-kl"; delta: that distance's bound."""
    a = per_token(adv, logp)
    p, p_old = torch.exp(logp.detach()), torch.exp(old_logp)
    if kind == "dppo-tv":
        up, down = p - p_old > delta, p_old - p > delta
    else:
        far = bernoulli_kl(old_logp, logp.detach()) > delta
        up, down = far & (p > p_old), far & (p < p_old)
    high, low = up & (a > 0), down & (a < 0)
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))       # as surrogates.token_ratio
    loss = torch.where(low | high, torch.zeros_like(ratio), -ratio * a)
    return loss, low, high


def sq_logratio(logp, old_logp, adv, beta: float):
    """The squared log-ratio's per-token loss (n, C); no bound bites: low and high report where
    the ratio left PPO's [0.8, 1.2], for comparison (as surrogates.sapo does)."""
    a = per_token(adv, logp)
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.detach())
    return -a * logp + 0.5 * beta * log_ratio ** 2, ratio < 0.8, ratio > 1.2


def vespo(logp, old_logp, adv, mask):
    """VESPO's per-token loss (n, C), on GRPO's sequence advantages; low and high report where
    phi(w) fell below 0.5, by the sign of A (its soft bound, as surrogates.sapo reports its own)."""
    lower = math.log(1e-8)                                    # TRL's clamp of log w, as the paper's code
    log_r = (logp - old_logp).detach().clamp(-20.0, 20.0)
    log_w = torch.where(mask.bool(), log_r, 0.0).sum(1).clamp(lower, 20.0)             # (n,)
    pos = adv >= 0
    k = torch.where(pos, VESPO["k_pos"], VESPO["k_neg"])
    lam = torch.where(pos, VESPO["lam_pos"], VESPO["lam_neg"])
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)  # (n,)
    loss = -(phi * adv).unsqueeze(1) * logp
    faded = (phi < 0.5).unsqueeze(1).expand_as(logp)
    return loss, faded & ~pos.unsqueeze(1), faded & pos.unsqueeze(1)

