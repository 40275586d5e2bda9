"""RCE: reward-weighted cross-entropy, the first stage of report 003's system.

    python train.py --algo rce --steps 60 --save-every 20 --out runs/rce     # RCE, tau 1.7 -> 0.5
    python train.py --init-from runs/rce --beta 0.05 --kl-control range       # then GRPO from it

Per prompt, the K sampled candidates y_1..y_K with rewards r_1..r_K become a target
distribution over the candidates, a softmax of the rewards at temperature tau:

    w_i = exp(r_i / tau) / sum_j exp(r_j / tau)                 (over the prompt's K; sum_i w_i = 1)

and the policy is fitted to it by cross-entropy:

    L = -(1/G) sum_prompts sum_i w_i log p(y_i | x),   log p(y_i | x) = sum_t logp_it

with G the prompts in the mini-batch. The normalisation is per sequence (a candidate's
log-likelihood is the sum over its tokens, as in the formula) and a mean over prompts (each
prompt is one cross-entropy against its own w): our choice, so that the loss is the
cross-entropy it claims to be; a per-token mean instead would change which candidate a
weight favours by its length. tau moves linearly from --rce-temp-start 1.7 to
--rce-temp-end 0.5 over the run (report 003's schedule; train.py, update.linear).

The limits, which tests/test_rce.py checks: tau -> 0 puts all the weight on the best
candidate (ties shared), so L is the cross-entropy of the best answer; tau -> inf gives
w_i = 1/K, plain imitation of all K samples, good and bad.

Why it can do damage, in one line: its gradient, -(1/G) sum_i w_i grad log p(y_i | x), is a
policy gradient whose "advantages" K*w_i are never negative. There is no baseline: a prompt
whose K candidates are all wrong (equal rewards) gets w_i = 1/K and its wrong answers are
imitated as firmly as a right answer is elsewhere. GRPO's advantages sum to zero within a
group, so such a prompt contributes nothing there. Its loop is update.py's, GRPO's and PPO's
(no ratio, no clipping, no KL term: the loss below replaces the clipped surrogate);
`python -m lab rce_grpo` measures RCE-only, RCE -> GRPO and GRPO-only against the warm start.
"""
from dataclasses import dataclass, field

import torch

import grpo


@dataclass
class Knobs:
    """RCE's temperature tau of the reward weights, moved linearly over the run (report 003: 1.7 -> 0.5)."""
    rce_temp_start: float = field(default=1.7, metadata={"help": "softmax temperature tau of the reward weights at "
                                  "the first step", "min": 1e-3, "max": 1e3, "algos": ("rce",)})
    rce_temp_end: float = field(default=0.5, metadata={"help": "tau at the last step, linear in between",
                                                       "min": 1e-3, "max": 1e3, "algos": ("rce",)})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.algo == "rce" and cfg.k < 2:
        yield "k", f"--algo rce weighs the K samples of a prompt against each other and needs --k >= 2, got {cfg.k}"
    if cfg.algo == "rce" and (cfg.beta != 0 or cfg.kl_control != "fixed"):
        yield "beta", "--algo rce has no KL term (rce.py); leave --beta at 0 and --kl-control fixed"


@dataclass
class RCEParams(grpo.HyperParams, Knobs):
    """GRPO's knobs (those RCE reads: k, the batch sizes, epochs, clipping of the gradient)
    and this step's temperature tau (train.py moves it from --rce-temp-start to --rce-temp-end)."""
    algo: str = "rce"
    rce_temp: float = 1.0


def weights(rewards: torch.Tensor, k: int, tau: float) -> torch.Tensor:
    """w (N,): the softmax of rewards / tau within each group of K consecutive rows."""
    r = rewards.float().view(-1, k)                                  # (B, K)
    # w_i = exp(r_i / tau) / sum_j exp(r_j / tau); softmax subtracts the max, so a small tau
    # does not overflow
    return torch.softmax(r / tau, dim=1).reshape(-1)                 # (N,)


def prepare(batch, hp: RCEParams) -> None:
    """batch.advantages (N,) <- the weights w_i of this step's tau (hp.rce_temp). They are
    stored where GRPO's advantages go because the update reads them there; they are not
    advantages (never negative, a sum of 1 per prompt)."""
    mask = batch.completion_mask                                     # (N, C)
    batch.advantages = weights(batch.rewards, hp.k, hp.rce_temp).to(mask.device)   # (N,)


def loss(logp, entropy, values, rows, mb, hp: RCEParams) -> tuple[torch.Tensor, dict]:
    """The mini-batch's share of L from one micro-batch, and its per-token sums for the metrics.

    logp, entropy: (n, C); values: None; rows: rollout.Rows (mask, advantages = w); mb:
    update.MiniBatch, whose sequences / K are G, the prompts of the whole mini-batch (so the
    micro-batch losses add up)."""
    m = rows.mask.to(logp.dtype)                                     # (n, C)
    seq_logp = (logp * m).sum(1)                                     # log p(y_i | x), (n,)
    # L = -(1/G) sum_i w_i log p(y_i | x)
    value = -(rows.advantages * seq_logp).sum() / (mb.seqs / hp.k)
    # nll: the per-token NLL of the sampled candidates, unweighted (a metric)
    return value, dict(entropy=(entropy.detach() * m).sum().item(), nll=-(logp.detach() * m).sum().item())
