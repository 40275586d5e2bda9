"""The policy-gradient objective: PPO's clip and what 2025-26 trainers put in its place.

PPO's clip (`ppo_clip`): a token past the edge its advantage pushes toward (r > 1 + eps_high
with A > 0, r < 1 - eps_low with A < 0) has a gradient of exactly 0. That is the safety, and the
problem the newer objectives answer: a rare token the policy starts to prefer quickly leaves
the range and stops learning, which feeds the entropy collapse this course is about; a token
past the other edge keeps its gradient (A < 0 at r = 100: weight 100), hence dual-clip.
--policy-loss picks one (r_it = exp(logp_it - logp_old_it); A the sequence's, or PPO's token's):

    clip       -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)                    PPO, GRPO, DAPO
    dual-clip  clip's loss, and for A < 0 at most -c A:                            verl clip_ratio_c,
               max(min(r A, clip(r) A), c A)  to maximise, c = 3                   OpenRLHF dual_clip
    cispo      -sg(min(r, eps_max)) A log pi_it: the ratio is a stopped weight,    MiniMax-M1; TRL
               capped at eps_max = 5; every token keeps its gradient A grad log pi  loss_type="cispo"
    sapo       -g(r) A, the gate g(r) = sigmoid(tau (r - 1)) * 4 / tau, tau_pos for A > 0,
               tau_neg > tau_pos for A < 0: a soft trust region, its gradient fading smoothly
               instead of stopping at an edge                                     TRL/verl "sapo"
    gmpo       -A exp(mean_t clip_sign(log r_it)): the geometric mean of the token ratios of a
               sequence, each log-ratio clipped to [-delta, delta] on the side the advantage
               pushes (delta = 0.4, i.e. r in (e^-0.4, e^0.4)): one outlier token cannot swing
               the sequence's weight as it swings an arithmetic mean             verl "geo_mean"
    clip-cov   PPO's clip, and a few random tokens of high covariance between advantage and
               log-prob taken out of the gradient                                verl "clip_cov"
    kl-cov     no clip; the top tokens by that covariance pay coef * |log r|      verl "kl_cov"
    dppo-tv    the move of a token's probability, not of its ratio, bounded;     prime-rl, verl
    dppo-kl    by |p - p_old| or a Bernoulli KL (trust_regions.py)               "dppo_tv", "dppo_kl"
    sq-logratio  -A log pi + (beta / 2) (log r)^2, no clip (trust_regions.py)    Tinker "dro"
    vespo      -phi(w) A log pi, a gamma weight of the sequence's ratio           TRL "vespo"
    luspo      GSPO's clipped sequence ratio, its loss summed over the tokens     TRL "luspo"

and, with any of them, --top-entropy-quantile 0.2 trains only the 20% of tokens of highest
entropy (TRL's top_entropy_quantile, the "80/20" of Wang et al. 2025).

Each returns the per-token loss (n, C) that grpo.aggregate averages, and where a bound bit (low, high:
TRL's clip_ratio/low_mean, high_mean); tests/test_surrogates.py checks each against verl's or TRL's
formula. clip-inverted is a mistake, kept to be seen (mistakes.py, 1).
"""
from dataclasses import dataclass, field

import torch

import mistakes
import trust_regions

# --policy-loss NAME -> (loss, low, high) from (logp, old_logp, adv, mask, keep, hp). A new objective is one function
# below, one line here, its knobs in Knobs (metadata "objective" names it): choices, checks, dispatch follow.
OBJECTIVES = {
    "dual-clip": lambda logp, old, adv, mask, keep, hp: dual_clip(token_ratio(logp, old), adv, *clip_range(hp),
                                                                  hp.dual_clip_c),
    "cispo": lambda logp, old, adv, mask, keep, hp: cispo(token_ratio(logp, old), logp, adv, hp.cispo_max),
    "sapo": lambda logp, old, adv, mask, keep, hp: sapo(token_ratio(logp, old), adv, hp.sapo_tau_pos, hp.sapo_tau_neg),
    "gmpo": lambda logp, old, adv, mask, keep, hp: gmpo(logp, old, adv, mask if keep is None else keep, hp.gmpo_delta),
    "clip-cov": lambda logp, old, adv, mask, keep, hp: clip_cov(token_ratio(logp, old), logp, adv, mask, hp),
    "kl-cov": lambda logp, old, adv, mask, keep, hp: kl_cov(token_ratio(logp, old), logp, old, adv, mask, hp),
    "dppo-tv": lambda logp, old, adv, mask, keep, hp: trust_regions.dppo(logp, old, adv, "dppo-tv", hp.dppo_delta),
    "dppo-kl": lambda logp, old, adv, mask, keep, hp: trust_regions.dppo(logp, old, adv, "dppo-kl", hp.dppo_kl_delta),
    "sq-logratio": lambda logp, old, adv, mask, keep, hp: trust_regions.sq_logratio(logp, old, adv, hp.sq_beta),
    "vespo": lambda logp, old, adv, mask, keep, hp: trust_regions.vespo(logp, old, adv, mask),
    "clip-inverted": lambda logp, old, adv, mask, keep, hp: mistakes.clip_inverted(token_ratio(logp, old), adv,
                                                                                  *clip_range(hp))}   # a mistake
POLICY_LOSSES = ("clip", "luspo", *OBJECTIVES)    # PPO's clip (and GSPO's, LUSPO's), in grpo.policy_loss

# The aggregation (grpo.aggregate) an objective was written with, where not token-mean (used
# unless --loss-agg is given): SAPO's paper, verl and TRL average per sequence (token-mean weighs a
# long sequence more: 0.32 apart on the same inputs); GMPO's loss is one number a sequence (verl's
# geo_mean); LUSPO's is that number times the sequence's length (TRL's luspo).
OWN_AGGREGATION = {"sapo": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean", "luspo": "seq-mean-token-sum"}
CLIPPED = ("clip", "luspo", "dual-clip", "clip-cov", "clip-inverted")   # those [1 - eps, 1 + eps_high] bounds


def knob(default, help, objective=CLIPPED, **more):
    """A knob of these objectives: its default (the paper's), its help, the objectives that read it.
    Beyond PPO's clip range they are fields, not flags: python -c or a test sets them."""
    return field(default=default, metadata={"help": help, "objective": objective,
                                            "flag": objective == CLIPPED, **more})


@dataclass
class Knobs:
    """The policy-gradient objective: PPO's clip or a 2025-26 one in its place, and the 80/20 mask."""
    policy_loss: str = field(default="clip", metadata={"help": "PPO's clip, or a 2025-26 objective in its place",
                                                       "choices": POLICY_LOSSES, "algos": ("grpo", "ppo")})
    clip_eps: float = knob(0.2, "PPO clip range: ratio kept in [1-eps, 1+eps_high]", algos=("grpo", "ppo"))
    clip_eps_high: float = knob(0.0, "upper clip range (DAPO's clip-higher); 0 = same as --clip-eps",
                                algos=("grpo", "ppo"))
    dual_clip_c: float = knob(3.0, "a negative-advantage token's loss at most -c*A (c > 1)", ("dual-clip",), max=1e4)
    cispo_max: float = knob(5.0, "the cap of the stopped importance weight (>= 1)", ("cispo",), min=1.0, max=1e4)
    sapo_tau_pos: float = knob(1.0, "the gate's temperature for A > 0", ("sapo",), min=1e-3, max=1e3)
    sapo_tau_neg: float = knob(1.05, "the gate's temperature for A < 0", ("sapo",), min=1e-3, max=1e3)
    gmpo_delta: float = knob(0.4, "each token's log-ratio clipped to [-delta, delta] (> 0)", ("gmpo",), max=20.0)
    cov_ratio: float = knob(2e-4, "the share of tokens, by covariance of advantage and log-prob, they detach / "
                            "penalise (> 0, <= 1)", ("clip-cov", "kl-cov"), max=1)
    clip_cov_lb: float = knob(1.0, "a candidate's covariance above this ...", ("clip-cov",))
    clip_cov_ub: float = knob(5.0, "... and below this", ("clip-cov",))
    kl_cov_coef: float = knob(1.0, "the weight of |log ratio| on the chosen tokens (> 0)", ("kl-cov",), max=100.0)
    top_entropy_quantile: float = field(default=1.0, metadata={
        "help": "the policy-gradient loss only on the tokens whose entropy is in this top share (0, 1] of a "
                "micro-batch's (0.2: the 80/20 rule; TRL's name)", "algos": ("grpo", "ppo")})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    for name in ("dual_clip_c", "cispo_max", "sapo_tau_pos", "sapo_tau_neg", "gmpo_delta", "cov_ratio", "kl_cov_coef"):
        floor = 1 if name == "dual_clip_c" else 0
        if getattr(cfg, name) <= floor:
            yield name, f"must be > {floor}, got {getattr(cfg, name)}"
    if not 0 <= cfg.clip_eps < 1:
        yield "clip-eps", f"must be in [0, 1), got {cfg.clip_eps}"
    if not 0 <= cfg.clip_eps_high <= 100:
        yield "clip-eps-high", f"must be in [0, 100] (0 = --clip-eps), got {cfg.clip_eps_high}"
    if cfg.clip_cov_lb >= cfg.clip_cov_ub:
        yield "clip-cov-lb", f"must be below clip_cov_ub ({cfg.clip_cov_ub}), got {cfg.clip_cov_lb}: no token could be chosen"
    if not 0 < cfg.top_entropy_quantile <= 1:
        yield "top-entropy-quantile", f"is a share of the tokens, in (0, 1] (1 = every token), got {cfg.top_entropy_quantile}"
    if cfg.policy_loss not in ("clip", "luspo") and cfg.ratio_level != "token":
        yield "policy-loss", (f"{cfg.policy_loss} weighs each token by its own ratio; --ratio-level sequence is "
                              f"GSPO's clip, not a ratio the others take")
    if cfg.policy_loss == "luspo" and cfg.ratio_level != "sequence":
        yield "policy-loss", "luspo is GSPO's clip on the sequence ratio: give --ratio-level sequence too"
    if cfg.policy_loss == "gmpo" and cfg.algo != "grpo":
        yield "policy-loss", f"gmpo weighs a sequence by one advantage; --algo {cfg.algo} gives " + (
            "one per token (GAE)" if cfg.algo == "ppo" else "no ratio at all")


def clip_range(hp) -> tuple[float, float]:
    """(eps_low, eps_high) of PPO's clip: --clip-eps-high 0 means the same as --clip-eps."""
    return hp.clip_eps, hp.clip_eps_high or hp.clip_eps


def token_ratio(logp, old_logp):
    """r_it = exp(log r_it), log r_it clamped to [-20, 20] first (verl's clamp): past log r = 88
    exp gives inf in float32, and a branch torch.where does not take then still sends 0 * inf =
    NaN into the gradient (dual-clip's capped tokens, SAPO's gate). e^20 is far past every clip and cap
    here; only a token past it changes (KL-Cov's -r A: e^20 A, not inf), and has no gradient, as in verl."""
    return torch.exp((logp - old_logp).clamp(-20.0, 20.0))                      # (n, C)


def advantage_per_token(adv: torch.Tensor) -> torch.Tensor:
    """(n,) one per sequence (GRPO) or (n, C) per token (PPO) -> broadcastable (n, 1) or (n, C)."""
    return adv.unsqueeze(1) if adv.dim() == 1 else adv


def ppo_clip(ratio, adv, eps_low: float, eps_high: float):
    """PPO's clipped surrogate as a loss, and where it clipped (low, high): (n, C) for token
    ratios, (n, 1) for GSPO's one ratio a sequence (grpo.importance_ratio).

        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

    The min takes the clipped term only where moving r further would raise the objective:
    A > 0 and r > 1 + eps_high (high), A < 0 and r < 1 - eps_low (low)."""
    a = advantage_per_token(adv)
    loss = -torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
    high = (ratio > 1 + eps_high) & (a > 0)
    low = (ratio < 1 - eps_low) & (a < 0)
    return loss, low, high


def dual_clip(ratio, adv, eps_low: float, eps_high: float, c: float):
    """PPO's clip, and for A < 0 the loss bounded at -c A (c > 1; Ye et al. 2020):

        A >= 0:  -min(r A, clip(r) A)
        A <  0:  min(-min(r A, clip(r) A), -c A)

    With A < 0 the clipped term is -clip(r) A, which grows without bound as r does: one token
    the update made 100x likelier than when it was sampled adds 100 |A| to the loss. The
    second clip caps it (counted low, with the other A < 0 tokens a bound held, as verl's
    pg_clipfrac_lower counts it)."""
    a = advantage_per_token(adv)
    loss, low, high = ppo_clip(ratio, adv, eps_low, eps_high)
    capped = (a < 0) & (loss > -c * a)
    return torch.where(capped, -c * a, loss), low | capped, high


def cispo(ratio, logp, adv, eps_max: float):
    """CISPO's loss: the importance weight clipped and stopped, the gradient through log pi.

        loss = -sg(min(r, eps_max)) A log pi

    d loss / d logp = -min(r, eps_max) A: never 0, so a token past the cap still learns, at
    the capped weight (high: capped tokens with A > 0, as TRL counts them: with A < 0 the cap
    only lowers a weight that pushes the token down). Its value is not PPO's (it is A log pi,
    not r A); only its gradient matters."""
    a = advantage_per_token(adv)
    weight = ratio.clamp(max=eps_max).detach()
    return -weight * a * logp, torch.zeros_like(ratio, dtype=torch.bool), (ratio > eps_max) & (a > 0)


def sapo(ratio, adv, tau_pos: float, tau_neg: float):
    """SAPO's soft gate instead of the clip:

        loss = -(4 / tau) sigmoid(tau (r - 1)) A,     tau = tau_pos if A > 0 else tau_neg

    At r = 1 its gradient is A (the plain policy gradient, as PPO's); it fades as r leaves 1,
    faster with a larger tau; negative advantages get the larger tau (they shrink many
    tokens' probabilities at once, the move that destabilises). No bound bites: low and high
    report where the ratio left PPO's [0.8, 1.2], for comparison."""
    a = advantage_per_token(adv)
    tau = torch.where(a > 0, torch.as_tensor(tau_pos, dtype=ratio.dtype), torch.as_tensor(tau_neg, dtype=ratio.dtype))
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * a
    return loss, ratio < 0.8, ratio > 1.2


def gmpo(logp, old_logp, adv, mask, delta: float):
    """GMPO's loss: one weight per sequence, the geometric mean of its clipped token ratios.

        x_it = sign(A_i) * min(sign(A_i) log r_it, sign(A_i) clip(log r_it, -delta, delta))
        loss_i = -A_i exp( sum_t mask_it x_it / |y_i| )          on every token of sequence i

    The min keeps the clipped log-ratio only on the side that would raise the objective
    (PPO's pessimism, per token, in log space). The per-sequence loss sits on each of its
    tokens; aggregated with seq-mean-token-mean (OWN_AGGREGATION) it is verl's mean over
    sequences. Sequence advantages only (GRPO). mask: the tokens inside the mean; under the
    80/20 mask only the kept ones (TRL), so a masked token has no gradient at all."""
    log_ratio = logp - old_logp                                                  # (n, C)
    sign = torch.sign(adv).unsqueeze(1)                                          # (n, 1)
    clamped = log_ratio.clamp(-delta, delta)
    x = sign * torch.min(sign * log_ratio, sign * clamped)                       # (n, C)
    m = mask.to(logp.dtype)
    weight = torch.exp((x * m).sum(1) / m.sum(1).clamp_min(1))                   # (n,)
    loss = (-adv * weight).unsqueeze(1).expand_as(logp)                          # (n, C)
    bit = log_ratio != clamped
    return loss, bit & (sign < 0), bit & (sign > 0)


# ---- the few tokens that drive the entropy down (Cui et al. 2025, "The Entropy Mechanism of RL") ----

def token_covariance(logp, adv, mask):
    """cov_it = (A_it - mean A) (log pi_it - mean log pi), means over the policy tokens: a
    token whose log-prob is high where its advantage is high pushes the entropy down when
    trained on; a few such tokens carry most of the collapse."""
    a = advantage_per_token(adv).expand_as(logp)
    m = mask.bool()
    return (a - a[m].mean()) * (logp.detach() - logp.detach()[m].mean())                # (n, C)


def clip_cov(ratio, logp, adv, mask, hp):
    """Clip-Cov: PPO's clip, and a few tokens of high covariance taken out of the gradient.

        candidates: policy tokens PPO did not clip with lb < cov_it < ub
        chosen:     max(1, int(ratio * tokens)) of them at random -> loss_it = 0 (no gradient)

    (verl's clip_cov, its defaults ratio 2e-4, lb 1, ub 5.) The chosen tokens count as high."""
    a = advantage_per_token(adv).expand_as(logp)
    eps_low, eps_high = clip_range(hp)
    loss, low, high = ppo_clip(ratio, adv, eps_low, eps_high)
    clipped_by_ppo = (-a * ratio.clamp(1 - eps_low, 1 + eps_high) > -a * ratio) & mask.bool()
    cov = token_covariance(logp, adv, mask)
    cov[mask == 0] = -torch.inf
    cov[clipped_by_ppo] = -torch.inf
    candidates = torch.nonzero((cov > hp.clip_cov_lb) & (cov < hp.clip_cov_ub) & mask.bool())  # (k, 2)
    keep = torch.ones_like(loss)
    n_clip = max(int(hp.cov_ratio * mask.sum().item()), 1)
    if len(candidates):
        chosen = candidates[torch.randperm(len(candidates))[:n_clip]]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    return loss * keep, low, high | (keep == 0)


def kl_cov(ratio, logp, old_logp, adv, mask, hp):
    """KL-Cov: no clip; the top max(1, int(ratio * tokens)) tokens by covariance pay a KL penalty
    to the sampling policy instead of being free to move:

        loss_it = -r A                              most tokens
        loss_it = -r A + coef |log r|               the highest-covariance ones (high)

    (verl's kl_cov, its defaults ratio 2e-4, coef 1.)"""
    a = advantage_per_token(adv).expand_as(logp)
    loss = -a * ratio
    penalised = torch.zeros_like(mask, dtype=torch.bool)
    valid = mask.bool()
    cov = token_covariance(logp, adv, mask)[valid]                                     # (tokens,)
    k = max(1, int(len(cov) * hp.cov_ratio))
    rows, cols = torch.nonzero(valid, as_tuple=True)
    top = torch.topk(cov, min(k, len(cov))).indices
    penalised[rows[top], cols[top]] = True
    loss = torch.where(penalised, loss + hp.kl_cov_coef * (logp - old_logp).abs(), loss)
    return loss, torch.zeros_like(penalised), penalised


# ---- 80/20: train only on the forking tokens ----

def high_entropy_mask(entropy, mask, quantile: float):
    """(n, C) 1 on the policy tokens whose entropy is in the top `quantile` of this
    micro-batch's (TRL's top_entropy_quantile; Wang et al. 2025: the 20% highest-entropy
    tokens, the forks where the model chooses, carry the learning). quantile 1 keeps every
    token. TRL takes the quantile over every process's tokens; here, over this rank's."""
    values = entropy.detach()[mask.bool()]
    if quantile >= 1 or len(values) == 0:
        return mask.to(entropy.dtype)
    threshold = torch.quantile(values.float(), 1 - quantile)
    return ((entropy.detach() >= threshold) & mask.bool()).to(entropy.dtype)


def policy_gradient_loss(logp, old_logp, adv, mask, hp, keep=None):
    """The per-token loss (n, C) of hp.policy_loss (OBJECTIVES; 'clip' is grpo.policy_loss's
    ppo_clip) and where its bounds bit (low, high). keep (n, C): the 80/20 mask or None; the
    caller multiplies by it, except GMPO's, whose geometric mean is over the kept tokens."""
    if hp.policy_loss not in OBJECTIVES:
        raise ValueError(f"unknown --policy-loss {hp.policy_loss!r}; expected one of {POLICY_LOSSES}")
    return OBJECTIVES[hp.policy_loss](logp, old_logp, adv, mask, keep, hp)
