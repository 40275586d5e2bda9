"""One update loop for GRPO, PPO and RCE: epochs, shuffled mini-batches, micro-batches, a step.

What changes between the three algorithms is the loss of one micro-batch, a few lines each
(train.py picks one by --algo and hands it to `update`):

    grpo.loss   -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * kl - c * H
    ppo.loss    grpo's terms + vf_coef * 1/2 max((V - G)^2, (V_clip - G)^2)      (A per token, GAE)
    rce.loss    -(1/G) sum_i w_i log p(y_i | x)                                  (no ratio, no clip)

The loop (CleanRL's shape):

    for each epoch, for each shuffled mini-batch:       one optimizer step
        for each micro-batch:                           one forward and backward
            logp, entropy, values = scorer(rows)        the policy now (logprobs.Scorer), (n, C)
            loss = loss_fn(...)                         the mini-batch's share, from this micro-batch
            loss.backward()                             gradients add up over micro-batches
        optimizer_step(...)                             clip the norm, skip a NaN/inf step

Gradient accumulation is exact: every loss divides by the whole mini-batch's count (its
tokens or sequences: `MiniBatch`), not the micro-batch's, so the micro-batch losses add up to
the mini-batch loss and their gradients to its gradient.

Under torchrun (W processes, DistributedDataParallel around the scorer) the same loop runs on
every rank over its share of the batch. Two things differ, both written below: the
mini-batch's counts are summed over ranks and divided by W (so each rank's loss is W times its
share, and DDP's mean of the W gradients is their sum: the one-process gradient), and DDP
all-reduces the gradients only in the last micro-batch's backward (one line, nanoGPT's). In
one process W = 1 and both do nothing.

The step size: train.py sets each step's lr from `lr_at`, a pure function of the step (a
resumed run needs no scheduler state), warm-up over w steps, then with p = (s - w) / (T - w):

    lr(s) = base * s / w  (s <= w);   constant: base;   linear: min_lr + (base - min_lr)(1 - p);
    cosine: min_lr + (base - min_lr)(1 + cos(pi p)) / 2       (report 000 recommends a decay)

`linear` moves the entropy bonus (report 000: decayed) and RCE's temperature over the run.
"""
import math
import os
from dataclasses import dataclass, field

import torch

import kl
from advantages import all_max, all_sum, world_size


LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class Knobs:
    """The update's loop: epochs over a batch, its mini- and micro-batches, its two brakes, the lr over the run."""
    epochs: int = field(default=1, metadata={"help": "passes over each batch", "min": 1})
    mini_batch: int = field(default=0, metadata={"help": "sequences per optimizer step (over all ranks under "
                            "torchrun; HyperParams holds this rank's share); 0 = all N (one step per epoch)", "min": 0})
    micro_batch: int = field(default=0, metadata={"help": "sequences per forward/backward (gradient "
                             "accumulation), per rank under torchrun; 0 = the whole mini-batch", "min": 0})
    target_kl: float = field(default=0.0, metadata={"help": "stop an update's epochs once approx_kl passes this "
                             "(CleanRL); 0 = off", "min": 0, "algos": ("grpo", "ppo"), "flag": False})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the global gradient norm; 0 = off", "min": 0})
    optimizer: str = field(default="adamw", metadata={"help": "adamw (no weight decay), or sgd: plain steps "
                           "lr * g, where a gradient's scale reaches the weights and a clip bounds the step "
                           "(under AdamW it bounds only a spike: optimizer_step)", "choices": ("adamw", "sgd")})
    fast: bool = field(default=False, metadata={"help": "the fast path: old log-probs from the update's own "
                       "forward (GRPO, one update per batch), micro-batches sorted by length and cut to their "
                       "longest sequence"})
    lr_schedule: str = field(default="constant", metadata={"help": "learning-rate schedule after the warm-up "
                             "(lr_at)", "choices": LR_SCHEDULES})
    min_lr: float = field(default=0.0, metadata={"help": "the lr linear/cosine decay to at the last step",
                                                  "flag": False})
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear learning-rate warm-up from 0"})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.mini_batch and cfg.n % cfg.mini_batch:
        yield "mini-batch", f"must divide N = batch*k = {cfg.n} (or be 0), got {cfg.mini_batch}"
    # torchrun's processes: train.py checks before its process group exists, so from its WORLD_SIZE
    ranks = max(world_size(), int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.mini_batch % ranks:
        yield "mini-batch", f"must split over {ranks} ranks, got {cfg.mini_batch}"
    mini = (cfg.mini_batch or cfg.n) // ranks
    if cfg.micro_batch and mini % cfg.micro_batch:
        yield "micro-batch", (f"must divide the mini-batch ({mini} sequences{' per rank' if ranks > 1 else ''}) "
                              f"(or be 0), got {cfg.micro_batch}")
    if not 0 <= cfg.min_lr <= cfg.lr:
        yield "min-lr", f"must be in [0, --lr], got {cfg.min_lr}"
    if not 0 <= cfg.warmup_steps < cfg.steps:
        yield "warmup-steps", f"must be in [0, --steps), got {cfg.warmup_steps}"


def lr_at(step: int, total: int, base: float, schedule: str = "constant",
          min_lr: float = 0.0, warmup: int = 0) -> float:
    """Learning rate of step `step` (1-based) of a run of `total` steps."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {LR_SCHEDULES}")
    if warmup > 0 and step <= warmup:
        return base * step / warmup
    if schedule == "constant":
        return base
    p = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    if schedule == "linear":
        return min_lr + (base - min_lr) * (1 - p)
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * p)) / 2


def linear(step: int, total: int, start: float, end: float) -> float:
    """start at step 1, end at step `total`, a straight line in between."""
    return start + (end - start) * ((step - 1) / max(total - 1, 1))


@dataclass
class MiniBatch:
    """The sequences of one optimizer step, cut into micro-batches (one forward each)."""
    micro_batches: list       # index tensors into the batch
    seqs: float               # the loss's denominators: the whole mini-batch's sequences and
    tokens: float             # policy tokens (summed over ranks), divided by the W ranks


def minibatches(batch, hp, gen: torch.Generator):
    """One epoch's mini-batches. Sequences are shuffled across mini-batches every epoch
    (CleanRL), so the K samples of a prompt do not always share a step; one mini-batch
    needs no order. hp.fast: each mini-batch is sorted by length before it is cut, so
    sequences of similar length share a forward and little of it is padding."""
    n = len(batch.completion_mask)
    size = hp.mini_batch or n                    # 0: the whole batch
    micro = hp.micro_batch or size               # 0: the whole mini-batch
    order = torch.randperm(n, generator=gen) if size < n else torch.arange(n)
    lengths = batch.attention().sum(1).cpu() if hp.fast else None                # (N,), beside order
    for start in range(0, n, size):
        mb = order[start:start + size]
        if lengths is not None:
            mb = mb[torch.argsort(length_key(mb, lengths, hp.k if batch.share_prefix else 0),
                                  descending=True, stable=True)]
        seqs, tokens = all_sum(torch.tensor([len(mb), int(batch.completion_mask[mb].sum())])).tolist()
        yield MiniBatch([mb[i:i + micro] for i in range(0, len(mb), micro)],
                        seqs / world_size(), max(tokens, 1) / world_size())


def length_key(mb: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """What hp.fast sorts a mini-batch's rows by: their length; with k (the rows share their
    group's prompt: shared_prefix.py), their group's longest, so a group's rows stay side by
    side in one micro-batch and its prompt is encoded once there."""
    if not k:
        return lengths[mb]
    groups = mb // k                                                             # (n,)
    longest = torch.zeros(int(groups.max()) + 1, dtype=lengths.dtype).scatter_reduce_(
        0, groups, lengths[mb], "amax", include_self=False)
    return longest[groups] * 2 * len(lengths) - groups          # longer groups first, then by group


def optimizer_step(optimizer, max_grad_norm: float, loss: float) -> tuple[float, list]:
    """Clip the gradient norm of each parameter group (the policy's; PPO's critic's, at its
    own lr, is clipped on its own) and step, unless the loss or a norm is NaN/inf: then the
    step is skipped, weights and optimizer state untouched. Returns (the first group's norm
    before clipping, the names of the non-finite quantities). Under AdamW the clip acts only on
    a step whose norm spikes above the others': Adam divides out a scale every step shares."""
    norms = [torch.nn.utils.clip_grad_norm_(g["params"], max_grad_norm).item() for g in optimizer.param_groups]
    nonfinite = [name for name, v in (("loss", loss), ("grad_norm", norms[0])) if not math.isfinite(v)]
    nonfinite += ["critic_grad_norm"] * any(not math.isfinite(v) for v in norms[1:])
    if nonfinite:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return norms[0], nonfinite


EXTREMES = {"ratio_min": min, "ratio_max": max}      # reduced by min / max over micro-batches and ranks


class UpdateStats:
    """What an update reports: token means of the last epoch's per-token sums, the mean loss
    and gradient norm over its mini-batches, and counts over every epoch. Under torchrun the
    sums are every rank's, so the metrics and target-KL's early stop agree on every rank."""

    def __init__(self):
        self.steps_taken, self.skipped, self.nonfinite, self.epochs_run = 0, 0, [], 0
        self.minibatch_loss = 0.0

    def new_epoch(self) -> None:
        self.sums, self.losses, self.norms = {"tokens": 0.0}, [], []
        self.epochs_run += 1

    def add(self, loss: float, sums: dict, mask: torch.Tensor) -> None:
        """One micro-batch: its loss, its per-token sums (ratio_min / ratio_max: extremes; a key
        "per_seq/x": a count over sequences, reported as x, a share of sequences), and its policy
        tokens (mask)."""
        self.minibatch_loss += loss
        counts = dict(tokens=mask.sum().item(), sequences=mask.reshape(len(mask), -1).any(1).sum().item())
        for key, v in dict(sums, **counts).items():
            if key in EXTREMES:
                self.sums[key] = EXTREMES[key](self.sums.get(key, v), v)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + v

    def stepped(self, grad_norm: float, nonfinite: list) -> None:
        """One mini-batch, after optimizer_step."""
        self.losses.append(self.minibatch_loss)
        self.norms.append(grad_norm)
        self.minibatch_loss = 0.0
        self.steps_taken += not nonfinite
        if nonfinite:
            self.skipped, self.nonfinite = self.skipped + 1, nonfinite

    def whole_minibatch_loss(self) -> float:
        """The mini-batch's loss: every rank's W x share summed, over W (torchrun); in one
        process, the sum of its micro-batches' losses."""
        self.minibatch_loss = all_sum(torch.tensor([self.minibatch_loss], dtype=torch.float64)).item() / world_size()
        return self.minibatch_loss

    def end_epoch(self) -> None:
        keys = sorted(k for k in self.sums if k not in EXTREMES)
        totals = all_sum(torch.tensor([self.sums[key] for key in keys], dtype=torch.float64))
        low, high = self.sums.get("ratio_min", math.inf), self.sums.get("ratio_max", -math.inf)
        low, high = all_max(torch.tensor([-low, high], dtype=torch.float64)).tolist()     # min = -max(-x)
        self.sums = dict(zip(keys, totals.tolist()), **({"ratio_min": -low, "ratio_max": high}
                                                        if math.isfinite(high) else {}))

    def mean(self, key: str) -> float:
        if key in EXTREMES:                       # not a mean: the epoch's extreme
            return self.sums[key]
        if key.startswith("per_seq/"):            # a share of sequences (GSPO's clip fractions, as TRL's)
            return self.sums[key] / max(self.sums["sequences"], 1)
        return self.sums.get(key, 0.0) / max(self.sums["tokens"], 1)

    def result(self) -> dict:
        return dict({key.removeprefix("per_seq/"): self.mean(key) for key in self.sums
                     if key not in ("tokens", "sequences")},
                    loss=sum(self.losses) / len(self.losses), grad_norm=sum(self.norms) / len(self.norms),
                    steps_taken=self.steps_taken, skipped_nonfinite=self.skipped, nonfinite=self.nonfinite,
                    epochs_run=self.epochs_run)


# ---- the loop ----

def update(scorer, optimizer, batch, hp, loss_fn) -> dict:
    """hp.epochs passes over shuffled mini-batches of the batch (its advantages filled by the
    algorithm's `prepare`), one optimizer step each, its gradient accumulated over micro-batches.

    scorer: logprobs.Scorer(policy, critic), in DDP under torchrun. loss_fn: grpo.loss,
    ppo.loss or rce.loss, (logp, entropy, values, rows, mb, hp) -> (loss, per-token sums for
    the metrics). Early stop (CleanRL): no further epoch once an epoch's approx_kl passes
    hp.target_kl (> 0). Returns the last epoch's token means (entropy, clip_frac, approx_kl,
    ref_kl with a reference, value_loss with a critic), loss and grad_norm (means over its
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
                rows = batch.rows(idx, trim=hp.fast)                                  # (n, C) each
                # DDP: all-reduce the gradients in the last micro-batch's backward only (nanoGPT)
                scorer.require_backward_grad_sync = i == len(mb.micro_batches) - 1
                logp, entropy, values = scorer(rows.tokens, hp.temperature, hp.entropy_coef > 0)   # (n, C)
                loss, sums = loss_fn(logp, entropy, values, rows, mb, hp)
                loss.backward()
                stats.add(loss.item(), sums, rows.mask)
            grad_norm, nonfinite = optimizer_step(optimizer, hp.max_grad_norm or math.inf, stats.whole_minibatch_loss())
            stats.stepped(grad_norm, nonfinite)
        stats.end_epoch()
        if hp.target_kl > 0 and stats.mean("approx_kl") > hp.target_kl:
            break
    return stats.result()


# ---- after the loop: how far it moved the policy ----

def policy_shift(scorer, batch, hp) -> float | None:
    """The token mean over the batch of k3 between the policy that sampled (old_logp) and the
    policy after the update, x = logp_new - logp_old:

        shift = sum_it mask_it * (exp(x_it) - x_it - 1) / sum_it mask_it       (KL(old || new))

    One forward without gradient, hp.micro_batch sequences at a time, summed over every
    process. Not approx_kl: that one is measured in the last epoch's forward, before its
    optimizer step, so with one epoch it is 0. Report 003's range rule reads this number
    (kl.READS). None when the batch has no old log-probs (--fast reused the update's own)."""
    if batch.old_logp is None:
        return None
    total = torch.zeros(2, dtype=torch.float64)                                   # (sum k3, tokens)
    with torch.no_grad():
        n = len(batch.completion_mask)
        step = hp.micro_batch or hp.mini_batch or n
        for start in range(0, n, step):
            rows = batch.rows(torch.arange(start, min(start + step, n)))
            logp, _, _ = scorer(rows.tokens, hp.temperature, False)                # (n, C)
            k3 = kl.estimate(rows.old_logp, logp, "k3") * rows.mask                # (n, C)
            total += torch.tensor([k3.sum().item(), rows.mask.sum().item()], dtype=torch.float64)
    total = all_sum(total)
    return (total[0] / total[1].clamp_min(1)).item()
