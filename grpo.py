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

summed over tokens and divided by one of three normalisers (`aggregate`). GRPO departs
from PPO in two places: the advantage is a group statistic of sequence rewards instead of a
learned value (no critic), and the KL to the reference is a loss term instead of a reward
penalty. eps_high > eps_low is DAPO's decoupled ("clip-higher") bound.

One update, as `update` below writes it out:

    prepare(batch, hp)                                  A_i from the rewards (advantages.py)
    for each epoch, for each shuffled mini-batch:       one optimizer step
        for each micro-batch:                           one forward and backward
            logp   = scorer(rows.tokens, ...)           the policy now, (n, C) (logprobs.Scorer)
            loss   = aggregate(policy_loss(...))        the equation above
            loss.backward()                             gradients add up over micro-batches
        optimizer_step(...)                             clip the norm, skip a NaN/inf step

ppo.py runs the same loop with a value loss added; --algo rce runs it with rce.py's
reward-weighted cross-entropy in place of the surrogate. Under torchrun (distributed.py) the same
loop runs on every rank over its share of the batch: the scorer is in DDP, the loss's
denominators and the batch statistics are the whole batch's, the loss is scaled by the
number of ranks; in one process those lines do nothing. Every knob is a field of HyperParams,
built once from train.py's flags (config.hyper_params); `python train.py --k 8 --norm global`
runs it.
"""
import math
from dataclasses import dataclass

import torch

import advantages
from running import distributed
import kl
import rce


@dataclass(frozen=True)
class HyperParams:
    """Everything one step's advantages and update read, each command-line "0 means the
    default" already resolved (config.hyper_params builds it; train.py replaces beta,
    entropy_coef and seed each step). The defaults are the command line's."""
    mini_batch: int                  # sequences per optimizer step (N: one step per epoch)
    micro_batch: int                 # sequences per forward/backward (gradient accumulation)
    algo: str = "grpo"               # grpo | ppo | rce (rce.py: the same loop, another loss)
    # advantages (prepare)
    k: int = 8                       # samples per prompt: rows i*K ... i*K+K-1 share a prompt
    norm: str = "global"             # advantages.compute's estimator
    unbiased: bool = False           # Bessel-corrected std in the advantage
    adv_clip: float | None = None    # clamp advantages to [-c, c]; None = off
    kl_in_reward: bool = False       # beta * KL leaves the reward (PPO's habit), not the loss
    gamma: float = 1.0               # PPO: discount per token
    lam: float = 0.95                # PPO: GAE lambda
    # the loss
    clip_low: float = 0.2            # ratio kept in [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    ratio_level: str = "token"       # token (PPO) or sequence (GSPO): importance_ratio
    beta: float = 0.0                # KL coefficient (this step's, kl.py)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0        # entropy bonus (this step's, schedules.py)
    loss_agg: str = "token-mean"     # aggregate's mode
    max_len: int = 24                # the longest completion ("constant" aggregation)
    temperature: float = 1.0         # the sampling temperature: log-probs of softmax(z / T)
    vf_coef: float = 0.5             # PPO: weight of the value loss
    value_clip: float = 0.2          # PPO: value-loss clip around the old values; 0 = off
    rce_temp: float = 1.0            # RCE: this step's softmax temperature tau (rce.py)
    # the optimisation
    epochs: int = 1                  # passes over the batch
    max_grad_norm: float = math.inf  # clip the global gradient norm (inf: measure only)
    target_kl: float = 0.0           # stop the epochs once approx_kl passes it; 0 = off
    fast: bool = False               # length-sorted micro-batches, cut to their longest row
    reuse_old_logp: bool = False     # old log-probs = this forward's, detached (config.py)
    skip_all_fallback: bool = False  # report 001's guard: no update on all-fallback batches
    seed: int = 0                    # the mini-batch shuffle's seed (this step's)


# ---- the advantage: a group statistic of sequence rewards, no critic ----

def prepare(batch, hp: HyperParams) -> None:
    """Fill batch.advantages (N,), one per sequence, from batch.rewards (N,) (advantages.py).
    With the KL in the reward (--kl-in reward), each reward first pays for its sequence's KL:

        R_i <- R_i - beta * sum_t kl_it
    """
    mask = batch.completion_mask                                                   # (N, C)
    r = batch.rewards                                                              # (N,)
    if hp.kl_in_reward and batch.ref_logp is not None:
        kl_t = kl.estimate(batch.old_logp, batch.ref_logp, hp.kl_estimator)       # (N, C)
        r = r - hp.beta * (kl_t * mask).sum(1).cpu()
    # batch statistics (global, batch, reinforce++-baseline) are summed over every rank
    batch.advantages = advantages.compute(r, hp.k, hp.norm, unbiased=hp.unbiased, clip=hp.adv_clip,
                                          lengths=mask.sum(1).cpu(),
                                          allsum=distributed.all_sum).to(mask.device)  # (N,)




# ---- the loss ----

RATIO_LEVELS = ("token", "sequence")


def importance_ratio(logp, old_logp, mask, level: str):
    """How much more likely the policy now makes what was sampled than the policy that sampled.

    token (PPO, GRPO)        ratio_it = exp(logp_it - logp_old_it)                      (n, C)
    sequence (GSPO, report 001's fix E; TRL importance_sampling_level="sequence", verl "gspo")
                             s_i = exp( (1/|y_i|) * sum_t (logp_it - logp_old_it) )      (n, 1)

    s_i is the geometric mean of sequence i's token ratios: one weight per sequence, the unit
    a sequence reward (GRPO's advantage) is given in; the length normalisation keeps it near 1
    whatever the length, so GSPO clips it far more tightly (its paper: eps 3e-4 / 4e-4)."""
    if level == "token":
        return torch.exp(logp - old_logp)                                       # (n, C)
    m = mask.to(logp.dtype)
    mean_log_ratio = ((logp - old_logp) * m).sum(1) / m.sum(1).clamp_min(1)    # (n,)
    return torch.exp(mean_log_ratio).unsqueeze(1)                               # (n, 1)


def clipped_surrogate(logp, old_logp, adv, eps_low: float, eps_high: float, mask=None, level: str = "token"):
    """PPO's clipped objective per token, to be maximised, and where clipping bites.

    logp, old_logp: (n, C); adv: (n,) one per sequence (GRPO) or (n, C) one per token (PPO);
    mask (n, C): the policy's tokens (needed by level "sequence", whose ratio averages them).
    With the sequence ratio (GSPO), every token of sequence i carries the same
    L_i = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i): aggregated with
    seq-mean-token-mean the loss is GSPO's mean over sequences of L_i, and unclipped
    dL_i/dlogp_it = -A_i * s_i / |y_i| (clipped: 0). A one-token sequence's s_i is its token
    ratio: the two levels then give the same loss. PPO's advantages are per token, so the
    sequence level is GRPO's and RCE has no ratio (config.py refuses both).
    Returns (surrogate (n, C), clipped (n, C) bool).
    """
    ratio = importance_ratio(logp, old_logp, mask, level)                   # (n, C) or (n, 1)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv                         # (n, 1) or (n, C)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * a
    # min(): the objective never rewards moving the ratio past the clip range.
    surrogate = torch.min(unclipped, clipped)                               # (n, C) or (n, 1)
    return surrogate.expand_as(logp), (clipped < unclipped).expand_as(logp)


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "constant")


def aggregate(per_token, mask, mode: str, batch_seqs: int, batch_tokens: int, max_len: int):
    """Reduce a per-token loss (n, C) to a scalar.

    token-mean           sum_it loss_it / (tokens in the mini-batch)          (DAPO, TRL)
    seq-mean-token-mean  sum_i (sum_t loss_it / len_i) / (sequences in it)     (original GRPO)
    constant             sum_it loss_it / (sequences * max_len)                (Dr. GRPO)

    The denominators are those of the whole mini-batch (one optimizer step's worth; the
    whole batch by default), not of the micro-batch being computed, so the micro-batch
    losses add up to the mini-batch loss exactly: gradient accumulation then reproduces the
    big-batch gradient (for equal micro-batches this is 'divide each micro-batch mean by
    the number of micro-batches').
    """
    m = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * m).sum() / batch_tokens
    if mode == "seq-mean-token-mean":
        return ((per_token * m).sum(1) / m.sum(1).clamp_min(1)).sum() / batch_seqs
    if mode == "constant":
        return (per_token * m).sum() / (batch_seqs * max_len)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def policy_loss(logp, old_logp, entropy, rows, hp: HyperParams) -> tuple[torch.Tensor, dict]:
    """The per-token terms GRPO and PPO share, (n, C), and their per-token sums for the metrics:

        loss_it = -min(ratio * A, clip(ratio) * A) + beta * kl_it - entropy_coef * H_it

    rows: the micro-batch (rollout.Rows: mask, advantages, ref_logp). kl_it only with a
    reference and the KL in the loss; ref_kl (k3, whichever estimator the loss uses) is
    measured whenever there is a reference."""
    mask = rows.mask                                                            # (n, C)
    surrogate, clipped = clipped_surrogate(logp, old_logp, rows.advantages, hp.clip_low, hp.clip_high,
                                           mask, hp.ratio_level)
    per_token = -surrogate                                                      # (n, C)
    sums = {}
    if rows.ref_logp is not None:
        kl_t = kl.estimate(logp, rows.ref_logp, hp.kl_estimator)                # (n, C)
        if not hp.kl_in_reward:
            per_token = per_token + hp.beta * kl_t
        k3 = kl_t.detach() if hp.kl_estimator == "k3" else kl.estimate(logp.detach(), rows.ref_logp, "k3")
        sums["ref_kl"] = (k3 * mask).sum().item()
    if hp.entropy_coef > 0:
        per_token = per_token - hp.entropy_coef * entropy
    # approx_kl = E[(ratio - 1) - log ratio]: k3 of KL(old || new), how far this update moved (CleanRL)
    approx_kl = kl.estimate(old_logp, logp.detach(), "k3")                     # (n, C)
    sums.update(entropy=(entropy.detach() * mask).sum().item(),
                clip_frac=(clipped.float() * mask).sum().item(), approx_kl=(approx_kl * mask).sum().item())
    return per_token, sums


# ---- the update loop's parts, shared with ppo.py ----

@dataclass
class MiniBatch:
    """The sequences of one optimizer step, cut into micro-batches (one forward each)."""
    micro_batches: list       # index tensors into the batch
    seqs: int                 # sequences in the mini-batch  } the loss's denominators, so the
    tokens: int               # policy tokens in it          } micro-batch losses add up exactly
                              # (under torchrun: summed over every rank's share of it)


def minibatches(batch, hp: HyperParams, gen: torch.Generator):
    """One epoch's mini-batches. Sequences are shuffled across mini-batches every epoch
    (CleanRL), so the K samples of a prompt do not always share a step; one mini-batch
    needs no order. hp.fast: each mini-batch is sorted by length before it is cut, so
    sequences of similar length share a forward and little of it is padding."""
    n = len(batch.completion_mask)
    order = torch.randperm(n, generator=gen) if hp.mini_batch < n else torch.arange(n)
    lengths = batch.attention().sum(1) if hp.fast else None                      # (N,)
    for start in range(0, n, hp.mini_batch):
        mb = order[start:start + hp.mini_batch]
        if lengths is not None:
            mb = mb[torch.argsort(lengths[mb], descending=True, stable=True)]
        # the whole mini-batch's counts: this rank's, summed over every rank
        seqs, tokens = distributed.all_sum(torch.tensor([len(mb), int(batch.completion_mask[mb].sum())])).tolist()
        yield MiniBatch([mb[i:i + hp.micro_batch] for i in range(0, len(mb), hp.micro_batch)],
                        seqs, max(tokens, 1))


def optimizer_step(optimizer, max_grad_norm: float, loss: float) -> tuple[float, list]:
    """Clip the gradient norm of each parameter group (the policy's; PPO's critic's, at its
    own lr, is clipped on its own: ppo.py) and step, unless the loss or a norm is NaN/inf:
    then the step is skipped, weights and optimizer state untouched. Returns (the first
    group's norm before clipping, the names of the non-finite quantities)."""
    norms = [torch.nn.utils.clip_grad_norm_(g["params"], max_grad_norm).item() for g in optimizer.param_groups]
    nonfinite = [name for name, v in (("loss", loss), ("grad_norm", norms[0])) if not math.isfinite(v)]
    nonfinite += ["critic_grad_norm"] * any(not math.isfinite(v) for v in norms[1:])
    if nonfinite:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return norms[0], nonfinite


class UpdateStats:
    """What an update reports: token means of the last epoch's per-token sums, the mean loss
    and gradient norm over its mini-batches, and counts over every epoch."""

    def __init__(self):
        self.steps_taken, self.skipped, self.nonfinite, self.epochs_run = 0, 0, [], 0
        self.minibatch_loss = 0.0

    def new_epoch(self) -> None:
        self.sums, self.tokens, self.losses, self.norms = {}, 0, [], []
        self.epochs_run += 1

    def add(self, loss: float, sums: dict) -> None:
        """One micro-batch."""
        self.minibatch_loss += loss
        for key, v in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + v

    def whole_minibatch_loss(self) -> float:
        """The mini-batch's loss: this rank's part, summed over every rank (torchrun)."""
        loss, self.minibatch_loss = distributed.sum_float(self.minibatch_loss), 0.0
        return loss

    def stepped(self, loss: float, tokens: int, grad_norm: float, nonfinite: list) -> None:
        """One mini-batch, after optimizer_step (tokens: the whole mini-batch's)."""
        self.tokens += tokens
        self.losses.append(loss)
        self.norms.append(grad_norm)
        self.steps_taken += not nonfinite
        if nonfinite:
            self.skipped, self.nonfinite = self.skipped + 1, nonfinite

    def end_epoch(self) -> None:
        """The epoch's per-token sums over every rank's tokens (torchrun), so that target-KL's
        early stop and the metrics are the whole batch's, the same on every rank."""
        keys = sorted(self.sums)
        totals = distributed.all_sum(torch.tensor([self.sums[key] for key in keys], dtype=torch.float64))
        self.sums = dict(zip(keys, totals.tolist()))

    def mean(self, key: str) -> float:
        return self.sums.get(key, 0.0) / max(self.tokens, 1)

    def result(self) -> dict:
        return dict({key: self.mean(key) for key in self.sums}, loss=sum(self.losses) / len(self.losses),
                    grad_norm=sum(self.norms) / len(self.norms), steps_taken=self.steps_taken,
                    skipped_nonfinite=self.skipped, nonfinite=self.nonfinite, epochs_run=self.epochs_run)


# ---- one GRPO update on a batch of rollouts ----

def update(scorer, optimizer, batch, hp: HyperParams) -> dict:
    """GRPO's loss on one batch of rollouts (after `prepare`): hp.epochs passes over shuffled
    mini-batches, one optimizer step each, its gradient accumulated over micro-batches.

    scorer: logprobs.Scorer(policy), in DDP under torchrun (distributed.replicate).
    batch: a rollout.Rollout (ids, masks, old_logp, ref_logp, advantages); ref_logp None means
    no reference; old_logp None means "the policy that sampled is this one" (--fast, one
    update per batch): old = logp.detach(). Early stop (CleanRL): no further epoch once an
    epoch's approx_kl passes hp.target_kl (> 0). Returns the last epoch's token means (entropy,
    clip_frac, approx_kl, ref_kl with a reference), loss and grad_norm (means over its
    mini-batches; the norm before clipping), steps_taken, epochs_run, and the guard's
    skipped_nonfinite / nonfinite.
    """
    scorer.train()
    gen = torch.Generator().manual_seed(hp.seed)
    stats = UpdateStats()
    for _ in range(hp.epochs):
        stats.new_epoch()
        for mb in minibatches(batch, hp, gen):
            optimizer.zero_grad(set_to_none=True)
            for i, idx in enumerate(mb.micro_batches):
                rows = batch.rows(idx, trim=hp.fast)                              # (n, C) each
                # DDP: gradients all-reduced in the last micro-batch's backward only
                with distributed.accumulating(scorer, last=i == len(mb.micro_batches) - 1):
                    logp, entropy, _ = scorer(rows.tokens, hp.temperature, hp.entropy_coef > 0)
                    if hp.algo == "rce":      # RCE (rce.py): -(1/G) sum_i w_i log p(y_i | x), no ratio
                        loss, sums = rce.loss(logp, entropy, rows, mb.seqs / hp.k)
                    else:
                        old = rows.old_logp if rows.old_logp is not None else logp.detach()   # (n, C)
                        per_token, sums = policy_loss(logp, old, entropy, rows, hp)           # (n, C)
                        loss = aggregate(per_token, rows.mask, hp.loss_agg, mb.seqs, mb.tokens, hp.max_len)
                    # DDP averages gradients over W ranks; the denominators are the whole
                    # mini-batch's already, so W * loss makes the average the sum
                    (loss * distributed.size()).backward()
                stats.add(loss.item(), sums)
            loss = stats.whole_minibatch_loss()
            stats.stepped(loss, mb.tokens, *optimizer_step(optimizer, hp.max_grad_norm, loss))
        stats.end_epoch()
        if hp.target_kl > 0 and stats.mean("approx_kl") > hp.target_kl:
            break
    return stats.result()
