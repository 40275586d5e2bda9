"""GRPO: the clipped policy-gradient update without a critic, in plain PyTorch.

Shapes: N sequences in the batch (B prompts x K samples), n in a micro-batch, P prompt
tokens, C completion tokens, V vocabulary. mask (n, C) is 1 on a token the policy chose
and is trained on, its sampled end-of-sequence token included, and 0 on padding and on
tokens an environment inserted (attended to, through the batch's attention(), but never
trained on: rollout.py).

Per token t of sequence i, with the sequence's advantage A_i (advantages.py):

    ratio_it  = exp(logp_it - logp_old_it)        (--ratio-level sequence: GSPO's s_i, importance_ratio)
    surrogate = min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)     (PPO)
    kl_it     = a per-token estimate of KL(policy || reference)                    (kl.py; k3 default)
    loss_it   = -surrogate + beta * kl_it - entropy_coef * H_it
                (--policy-loss: a 2025-26 objective in its place, surrogates.py; 2026's, trust_regions.py)

summed over tokens and divided by one of four normalisers (`aggregate`).

DeepSeekMath's GRPO: group normalisation, several updates per batch (so ratios move and the
clip acts), beta 0.04 with k3, each sequence's tokens averaged before the group. The default
run (`python train.py`) keeps none of the last three and normalises globally:

    epochs 1, one mini-batch   every ratio is 1 and the clip is inert: the update is the
                               plain policy gradient (tests/test_surrogates.py)      --epochs 2
    beta 0                     no KL term, no reference model in memory              --beta 0.04
    norm global                a batch's mean and std, not a group's: with K=2 a group's
                               gives exactly +-1 (report 001, advantages.py)         --norm group
    loss-agg token-mean        DAPO's: a long sequence is not down-weighted          --loss-agg seq-mean-token-mean

GRPO departs from PPO in two places: the advantage is a group statistic of sequence rewards
instead of a learned value (no critic), and the KL to the reference is a loss term instead of
a reward penalty. eps_high > eps_low is DAPO's decoupled ("clip-higher") bound.

One update (update.py's loop, the same for GRPO, PPO and RCE):

    prepare(batch, hp)                                  A_i from the rewards (advantages.py)
    for each epoch, for each shuffled mini-batch:       one optimizer step
        for each micro-batch:                           one forward and backward
            logp = scorer(rows.tokens, ...)             the policy now, (n, C) (logprobs.Scorer)
            loss = grpo.loss(...)                       aggregate(the equation above)
            loss.backward()                             gradients add up over micro-batches
        optimizer_step(...)                             clip the norm, skip a NaN/inf step

ppo.py's loss adds a value loss to the same terms; rce.py's replaces them with a
reward-weighted cross-entropy. Every knob is a field of HyperParams, defined (default, help,
range) by the lesson it belongs to (its Knobs, below: KNOBS) and copied from the flag of the
same name (running/config.py: hyper_params); `python train.py --k 8 --norm global` runs it.
"""
from dataclasses import dataclass, field, replace

import torch

import advantages
import entropy_control
import kl
import mistakes
import mismatch
import rewards
import rollout
import surrogates
import trust_regions
import update

RATIO_LEVELS = ("token", "sequence")                                  # importance_ratio
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")      # aggregate


@dataclass
class Knobs:
    """GRPO's own: the importance ratio's level, how per-token losses are averaged, report 001's guard."""
    ratio_level: str = field(default="token", metadata={
        "help": "the importance ratio: per token (PPO, GRPO) or per sequence (GSPO: the geometric mean of its "
                "token ratios; then, unless given, its paper's --clip-eps 3e-4 --clip-eps-high 4e-4 --loss-agg "
                "seq-mean-token-mean)", "choices": RATIO_LEVELS})
    loss_agg: str = field(default="token-mean", metadata={"help": "how per-token losses are averaged (aggregate)",
                                                          "choices": (*AGGREGATIONS, "micro-token-mean"), "algos": ("grpo", "ppo")})
    skip_all_fallback: bool = field(default=False, metadata={"help": "report 001's guard: no update when every "
                                                             "sample is fallback text", "flag": False})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.ratio_level == "sequence" and cfg.algo != "grpo":
        yield "ratio-level", f"sequence (GSPO) weighs a sequence advantage by a sequence ratio; --algo {cfg.algo} " + (
            "has per-token advantages (GAE)" if cfg.algo == "ppo" else "has no ratio (rce.py)")


# GSPO's paper (and verl's gspo) clip the sequence ratio at 3e-4 / 4e-4 and average over
# sequences; token-level PPO's 0.2 would leave a length-normalised ratio unclipped.
GSPO_DEFAULTS = dict(clip_eps=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean")


def own_defaults(cfg, given: dict):
    """cfg with the defaults an objective was written with, for the flags not given (given: the
    names on the command line): --ratio-level sequence, GSPO's clip range and aggregation;
    --policy-loss sapo or gmpo, its own aggregation (surrogates.OWN_AGGREGATION)."""
    if cfg.policy_loss in surrogates.OWN_AGGREGATION and "loss_agg" not in given:
        cfg = replace(cfg, loss_agg=surrogates.OWN_AGGREGATION[cfg.policy_loss])
    if cfg.ratio_level != "sequence":
        return cfg
    own = {"loss_agg"} if cfg.policy_loss in surrogates.OWN_AGGREGATION else set()      # LUSPO's, not GSPO's
    return replace(cfg, **{k: v for k, v in GSPO_DEFAULTS.items() if k not in given and k not in own})


# the lessons whose knobs one step's advantages and update read
KNOBS = (Knobs, advantages.Knobs, surrogates.Knobs, trust_regions.Knobs, update.Knobs, kl.Knobs,
         entropy_control.Knobs, rewards.Knobs, mismatch.Knobs, rollout.Knobs)


@dataclass
class HyperParams(*KNOBS):
    """Everything one step's advantages and update read: the knobs of the lessons they belong to,
    each defined (with its default and help) in that lesson, and five values train.py derives.
    running/config.py builds it from the flags, this rank's share of --mini-batch, and
    train.py replaces beta, entropy_coef and seed each step. PPO's (ppo.PPOParams) and RCE's
    (rce.RCEParams) extend it with their lesson's knobs."""
    algo: str = "grpo"               # grpo | ppo | rce: which prepare and loss train.py uses
    kl_in_reward: bool = False       # beta * KL leaves the reward (PPO's habit), not the loss
    max_len: int = 24                # the longest completion ("constant" aggregation, DAPO's overlong buffer)
    reuse_old_logp: bool = False     # old log-probs = this forward's, detached (--fast)
    seed: int = 0                    # the mini-batch shuffle's seed (this step's)


# ---- the advantage: a group statistic of sequence rewards, no critic ----

def prepare(batch, hp: HyperParams) -> None:
    """Fill batch.advantages (N,), one per sequence, from batch.rewards (N,) (advantages.py).
    With --overlong-buffer, each reward first pays DAPO's length penalty (rewards.py); with the
    KL in the reward (--kl-in reward), for its sequence's KL:

        R_i <- R_i - beta * sum_t kl_it

    batch.rewards itself stays the task's (reward_mean in metrics.jsonl is the task's reward)."""
    mask = batch.completion_mask                                                   # (N, C)
    r = batch.rewards                                                              # (N,)
    if hp.overlong_buffer:        # DAPO: R_i <- R_i + min(0, ((L_max - L_buf) - |y_i|) / L_buf)
        r = r + torch.tensor([rewards.overlong_penalty(int(n), hp.max_len, hp.overlong_buffer)
                              for n in mask.sum(1).tolist()], dtype=r.dtype)
    if hp.kl_in_reward and batch.ref_logp is not None:
        kl_t = kl.estimate(batch.old_logp, batch.ref_logp, kl.estimator(hp))       # (N, C)
        r = r - hp.beta * (kl_t * mask).sum(1).cpu()
    # batch statistics (global, reinforce++, batch, reinforce++-baseline) are summed over every process
    batch.advantages = advantages.compute(r, hp.k, hp.norm, unbiased=hp.unbiased, clip=hp.adv_clip or None,
                                          lengths=mask.sum(1).cpu()).to(mask.device)  # (N,)


# ---- the loss ----


def importance_ratio(logp, old_logp, mask, level: str):
    """How much more likely the policy now makes what was sampled than the policy that sampled.

    token (PPO, GRPO)        ratio_it = exp(logp_it - logp_old_it)                      (n, C)
    sequence (GSPO, report 001's fix E; TRL importance_sampling_level="sequence", verl "gspo")
                             s_i = exp( (1/|y_i|) * sum_t (logp_it - logp_old_it) )      (n, 1)

    s_i is the geometric mean of sequence i's token ratios: one weight per sequence, the unit
    a sequence reward (GRPO's advantage) is given in; the length normalisation keeps it near 1
    whatever the length, so GSPO clips it far more tightly (its paper: eps 3e-4 / 4e-4, and
    a mean over sequences; `--ratio-level sequence` brings both unless they are given). Under
    PPO's clip (surrogates.ppo_clip) every token of sequence i then carries the same
    L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i): aggregated with
    seq-mean-token-mean the loss is GSPO's mean over sequences of L_i, and unclipped
    dL_i/dlogp_it = -A_i s_i / |y_i| (clipped: 0). A one-token sequence's s_i is its token
    ratio: the two levels then give the same loss. PPO's advantages are per token, so the
    sequence level is GRPO's, and RCE has no ratio (problems refuses both)."""
    if level == "token":
        return surrogates.token_ratio(logp, old_logp)                           # (n, C), log r in [-20, 20]
    m = mask.to(logp.dtype)
    mean_log_ratio = ((logp - old_logp) * m).sum(1) / m.sum(1).clamp_min(1)    # (n,)
    return torch.exp(mean_log_ratio).unsqueeze(1)                               # (n, 1)


def aggregate(per_token, mask, mode: str, batch_seqs: int, batch_tokens: int, max_len: int):
    """Reduce a per-token loss (n, C) to a scalar.

    token-mean           sum_it loss_it / (tokens in the mini-batch)          (DAPO, TRL)
    seq-mean-token-mean  sum_i (sum_t loss_it / len_i) / (sequences in it)     (original GRPO)
    seq-mean-token-sum   sum_it loss_it / (sequences in it)                    (LUSPO; verl's name)
    constant             sum_it loss_it / (sequences * max_len)                (Dr. GRPO)
    micro-token-mean     this micro-batch's token mean / micro-batches         (a mistake: mistakes.py)

    The denominators are those of the whole mini-batch (one optimizer step's worth; the
    whole batch by default), not of the micro-batch being computed, so the micro-batch
    losses add up to the mini-batch loss exactly: gradient accumulation then reproduces the
    big-batch gradient (for equal micro-batches this is 'divide each micro-batch mean by
    the number of micro-batches').
    """
    m = mask.to(per_token.dtype)
    kept = torch.where(mask.bool(), per_token, 0.0)      # not per_token * m: 0 * NaN is NaN (harmless)
    if mode == "token-mean":
        return kept.sum() / batch_tokens
    if mode == "seq-mean-token-mean":
        return (kept.sum(1) / m.sum(1).clamp_min(1)).sum() / batch_seqs
    if mode == "seq-mean-token-sum":
        return kept.sum() / batch_seqs
    if mode == "constant":
        return kept.sum() / (batch_seqs * max_len)
    if mode == "micro-token-mean":                       # a mistake, as nanochat writes it (mistakes.py, 2)
        return mistakes.micro_token_mean(kept, m, batch_seqs)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def harmless(rows, logp, values=None):
    """rows with every (n, C) input made harmless where the mask is 0 (padding, a token the
    environment wrote): the policy's own log-prob there (ratio 1, KL 0), advantage 0, weight 1,
    the critic's own value. A NaN or inf left there would reach the gradient even through
    torch.where (0 times a NaN derivative is NaN): it killed 8 of 14 runs of one public
    report of 7B LoRA GRPO. Where the mask is 1 nothing changes."""
    on, own = rows.mask.bool(), logp.detach()

    def fill(x, value):                          # x as it is where nothing can be filled in
        return x if x is None or value is None or x.dim() < 2 else torch.where(on, x, value)
    critic = None if values is None else values.detach()
    return replace(rows, old_logp=fill(rows.old_logp, own), ref_logp=fill(rows.ref_logp, own),
                   advantages=fill(rows.advantages, 0.0), is_weight=fill(rows.is_weight, 1.0),
                   old_values=fill(rows.old_values, critic), returns=fill(rows.returns, critic))


def policy_loss(logp, old_logp, entropy, rows, hp: HyperParams) -> tuple[torch.Tensor, dict]:
    """The per-token terms GRPO and PPO share, (n, C), and their per-token sums for the metrics:

        loss_it = -min(ratio * A, clip(ratio) * A) + beta * kl_it - entropy_coef * H_it

    rows: the micro-batch (rollout.Rows: mask, advantages, ref_logp). kl_it only with a
    reference and the KL in the loss; ref_kl (k3, whichever estimator the loss uses) is
    measured whenever there is a reference."""
    mask = rows.mask                                                            # (n, C)
    keep = None                                 # 80/20: the policy gradient on the forking tokens only
    if hp.top_entropy_quantile < 1:
        keep = surrogates.high_entropy_mask(entropy, mask, hp.top_entropy_quantile)   # (n, C)
    if hp.policy_loss in ("clip", "luspo"):     # PPO's clip, on the token ratio or GSPO's sequence ratio
        ratio = importance_ratio(logp, old_logp, mask, hp.ratio_level)         # (n, C) or (n, 1)
        per_token, low, high = (t.expand_as(logp) for t in                      # (n, C): a sequence's
                                surrogates.ppo_clip(ratio, rows.advantages, *surrogates.clip_range(hp)))   # on its tokens
    else:                       # the 2025-26 objectives (surrogates.py), token ratios
        per_token, low, high = surrogates.policy_gradient_loss(logp, old_logp, rows.advantages, mask, hp, keep)
    clipped = low | high
    if rows.is_weight is not None:              # the rollout/training mismatch's correction (mismatch.py)
        per_token = per_token * rows.is_weight
    if keep is not None and hp.policy_loss != "gmpo":   # gmpo's mean already leaves the others out
        per_token = per_token * keep
    sums = {}
    if rows.ref_logp is not None:
        kl_t = kl.estimate(logp, rows.ref_logp, kl.estimator(hp))               # (n, C)
        if not hp.kl_in_reward:                 # kl_ratio_correction: mistakes.py, 6
            per_token = per_token + hp.beta * kl_t * (torch.exp(logp - old_logp) if hp.kl_ratio_correction else 1)
        k3 = kl_t.detach() if kl.estimator(hp) == "k3" else kl.estimate(logp.detach(), rows.ref_logp, "k3")
        sums["ref_kl"] = (k3 * mask).sum().item()
    if hp.entropy_coef > 0:
        per_token = per_token - hp.entropy_coef * entropy
    # approx_kl = E[(ratio - 1) - log ratio], CleanRL's: kl.py's k3 of KL(old || new), how far
    # this update moved, from the token log-ratio x = log pi - log pi_old
    x = logp.detach() - old_logp                                                # (n, C)
    approx_kl = kl.estimate(old_logp, logp.detach(), "k3")                     # (n, C): expm1(x) - x
    if mask.any():                              # the token ratio's extremes (update.EXTREMES)
        token_ratio = torch.exp(x)[mask.bool()]
        sums.update(ratio_min=token_ratio.min().item(), ratio_max=token_ratio.max().item())
    sums.update(entropy=(entropy.detach() * mask).sum().item(), approx_kl=(approx_kl * mask).sum().item())
    # clip fractions: the share of policy tokens; under GSPO's one ratio a sequence, the share of
    # sequences (TRL's), so a long clipped sequence does not count more than a short one
    seq_level = hp.policy_loss in ("clip", "luspo") and hp.ratio_level == "sequence"
    for name, bit in (("clip_frac", clipped), ("clip_frac_low", low), ("clip_frac_high", high)):
        if seq_level:
            sums["per_seq/" + name] = (bit[:, 0] & mask.bool().any(1)).sum().item()
        else:
            sums[name] = (bit.float() * mask).sum().item()
    return per_token, sums


# ---- GRPO's loss for one micro-batch (update.py's loop differentiates it) ----

def loss(logp, entropy, values, rows, mb, hp: HyperParams) -> tuple[torch.Tensor, dict]:
    """The mini-batch's share of GRPO's loss from one micro-batch, and its per-token sums.

        loss = aggregate(-min(ratio * A, clip(ratio) * A) + beta * kl - entropy_coef * H)

    logp, entropy: (n, C) the policy now; values: None (no critic); rows: rollout.Rows;
    mb: update.MiniBatch, whose counts are aggregate's denominators. rows.old_logp None means
    "the policy that sampled is this one" (--fast, one update per batch): old = logp.detach(),
    every ratio 1, and the gradient is the plain policy gradient A * grad logp."""
    rows = harmless(rows, logp)                  # a NaN where the mask is 0 never reaches the gradient
    old = rows.old_logp if rows.old_logp is not None else logp.detach()           # (n, C)
    per_token, sums = policy_loss(logp, old, entropy, rows, hp)                    # (n, C)
    return aggregate(per_token, rows.mask, hp.loss_agg, mb.seqs, mb.tokens, hp.max_len), sums
