"""Advantage estimators: how a reward becomes the push a sample gets.

Every policy-gradient update multiplies the log-probability of a sampled sequence by an
*advantage*: how much better that sample was than expected. This file holds every
estimator the reports talk about, as small pure functions on tensors.

Layout. Rewards arrive as a 1-D tensor of N = B*K sequence rewards: B prompts, K samples
per prompt, grouped contiguously (prompt i owns positions i*K ... i*K+K-1).

    compute(rewards, k, norm)        the one entry point the trainer, plots and tests call
        norm="group"   GRPO            A = (r - mean_g) / std_g
        norm="drgrpo"  Dr. GRPO        A = r - mean_g
        norm="global"  batch z-score   A = (r - mean_N) / std_N          each sequence weighs 1
        norm="reinforce++"  (verl, OpenRLHF)   A = (r - mean_T) / std_T     over the batch's tokens:
                                       a sequence weighs by its length
        norm="batch"   TRL scale_rewards="batch" (Lite PPO)
                                       A = (r - mean_g) / std_N          std of the raw rewards
        norm="reinforce++-baseline"    (verl, OpenRLHF)
                                       c = r - mean_g;  A = (c - mean_N(c)) / std_N(c)
                                       the group-centred rewards whitened over the batch
        norm="rloo"    leave-one-out   A = r_i - mean_{j != i in g} r_j
        norm="maxrl"   MaxRL           A = (r - mean_g) / mean_g (0 if mean_g <= 0): rate p weighs ~1/p
        norm="none"    plain REINFORCE A = r
    gae(rewards, values, mask, gamma, lam)   token-level advantages for PPO
    whiten(x, mask)                          masked z-scoring (PPO's advantage whitening)
    frac_zero_std(rewards, k)                share of groups that carry no signal
    frac_pm1(advantages)                     share of advantages that are exactly +-1

Under torchrun each process holds whole groups of K, so the group estimators need nothing
from the others; the batch estimators sum over processes (`all_sum`) for the batch's mean and
std (batch_mean_std), as whiten does for PPO; in one process those sums are the identity.

The lesson of report 001 (docs/reports.md). With K=2 and group normalisation,
a group [r1, r2] has mean (r1+r2)/2 and population std |r1-r2|/2, so

    A_1 = (r1 - r2) / |r1 - r2| = +-1        whatever the gap between r1 and r2.

A valid-but-second-best answer (0.2) next to the best one (1.0) is pushed away exactly as
hard as garbage would be. `python -m lab.figures` draws it; tests/test_advantages.py
pins it down.

Conventions (chosen, not laws; the tests show the alternatives):
- std is the population std by default (`unbiased=False`), so K=2 gives exactly +-1 as
  in the report. TRL, verl and OpenRLHF use Bessel's correction (torch.std's default),
  which gives +-1/sqrt(2) = +-0.707 for K=2; pass `unbiased=True` to match them.
- We divide by max(std, eps), not std + eps. eps only guards the zero-variance group
  (advantage 0, never NaN); it never shrinks a real one. With TRL's std + 1e-4, a K=2
  group whose gap is 1e-3 gets +-0.83 instead of +-1.
- Computation runs in float64 and is cast back, so "exactly +-1" is exact in float32.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

NORMS = ("group", "drgrpo", "global", "reinforce++", "batch", "reinforce++-baseline", "rloo", "maxrl", "none")
GROUP_NORMS = ("group", "drgrpo", "batch", "reinforce++-baseline", "rloo", "maxrl")  # these need K >= 2
EPS = 1e-6          # the floor of every std we divide by: a zero-variance group gets 0, not NaN


@dataclass
class Knobs:
    """The advantage: K samples a prompt and how their rewards are normalised (GRPO's; PPO's is GAE)."""
    k: int = field(default=8, metadata={"help": "samples per prompt (K); group norms need K >= 2", "max": 4096})
    norm: str = field(default="global", metadata={"help": "advantage estimator", "choices": NORMS,
                                                   "algos": ("grpo",)})
    unbiased: bool = field(default=False, metadata={"help": "Bessel-corrected std in the advantage (TRL/verl "
                                                    "habit; K=2 -> +-0.71)", "algos": ("grpo",), "flag": False})
    adv_clip: float = field(default=0.0, metadata={"help": "clamp advantages to [-c, c]; 0 = off", "min": 0,
                                                   "algos": ("grpo",)})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if group_size_problem(cfg.k, cfg.norm):
        yield "k", group_size_problem(cfg.k, cfg.norm)
    # what can make a reward negative: the tools task's, DAPO's overlong penalty, r - beta * KL
    below_0 = [why for why, on in (("the tools task's rewards", cfg.task == "tools"),
                                   ("--overlong-buffer's penalty", cfg.overlong_buffer),
                                   ("the KL penalty in the reward", cfg.kl_in_reward and cfg.beta > 0)) if on]
    if cfg.norm == "maxrl" and below_0:
        yield "norm", f"maxrl divides by the group's mean reward, written for rewards >= 0; {below_0[0]} can go below 0"


# ---- checks and small helpers ----

def group_size_problem(k: int, norm: str) -> str | None:
    """Why K samples per prompt cannot feed this estimator, or None (train.py's --k is checked
    with this rule too)."""
    if k < 1:
        return f"k must be >= 1, got {k}"
    if norm in GROUP_NORMS and k < 2:
        return f"norm {norm!r} compares samples within a group and needs k >= 2, got k={k}"
    return None


def _check(rewards: torch.Tensor, k: int, norm: str) -> None:
    """Raise ValueError, saying what is wrong, for input no estimator can use."""
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; expected one of {', '.join(NORMS)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N = B*K), got shape {tuple(rewards.shape)}")
    problem = group_size_problem(k, norm)
    if problem:
        raise ValueError(problem)
    if rewards.numel() == 0 or rewards.numel() % k != 0:
        raise ValueError(f"N={rewards.numel()} rewards cannot be split into groups of k={k}")
    if not torch.isfinite(rewards).all():
        where = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        raise ValueError(f"non-finite reward at positions {where[:10]}; refusing to average it in")


def _std(x: torch.Tensor, dim, unbiased: bool) -> torch.Tensor:    # divide by n, or n - 1 (Bessel)
    return x.std(dim=dim, correction=1 if unbiased else 0, keepdim=True)


def batch_mean_std(x: torch.Tensor, w: torch.Tensor, unbiased: bool):
    """The w-weighted mean and std of x (N,) over the whole batch, as two 0-d tensors. Each
    sum runs over this process's rows and, under torchrun, over every process's (all_sum):

        n = sum_i w_i,   mean = sum_i w_i x_i / n,   var = sum_i w_i (x_i - mean)^2 / (n - c)

    c = 1 with Bessel's correction (unbiased), else 0. The mean's sums travel first, the
    squared deviations from it second (two rounds, no cancellation of sum x^2 - n mean^2)."""
    n, wx = all_sum(torch.stack([w.sum(), (w * x).sum()]))
    mean = wx / n.clamp_min(1e-12)                       # an empty batch: mean 0, std 0
    var = all_sum((w * (x - mean) ** 2).sum()) / (n - (1 if unbiased else 0)).clamp_min(1e-12)
    return mean, var.sqrt()


def _safe_div(x: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    # x / max(std, eps): a zero-variance group has x == 0 exactly, so it gets 0, not NaN.
    return x / std.clamp_min(eps)


# ---- the estimators ----

def compute(rewards: torch.Tensor, k: int, norm: str, unbiased: bool = False,
            clip: float | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level advantages for N = B*K rewards grouped K per prompt.

    rewards: (N,) float, prompt i owns rewards[i*K:(i+1)*K].
    norm: one of NORMS (see the module docstring for each formula).
    unbiased: Bessel's correction for every std. False (default) gives K=2 -> +-1, as in
        report 001; True matches TRL / verl / OpenRLHF and gives K=2 -> +-1/sqrt(2).
    clip: if given, clamp advantages to [-clip, clip] (report 001's fix D uses 3; report 000's
        `max(adv,-5) + min(adv,5)` is not a clamp: adv=1 gives 2).
    lengths: (N,) policy tokens per sequence, for reinforce++ and reinforce++-baseline, which
        weigh a sequence by its length (verl, OpenRLHF); None: every sequence weighs 1.
    Under torchrun rewards is this process's whole groups; the batch statistics sum over
    every process (all_sum). Returns (N,) advantages in the rewards' float dtype.
    """
    _check(rewards, k, norm)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 (or None), got {clip}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(torch.float64)                          # (N,)
    g = r.view(-1, k)                                      # (B, K)

    if norm == "group":
        # A_i = (r_i - mean_g) / std_g            (GRPO, DeepSeekMath)
        a = _safe_div(g - g.mean(1, keepdim=True), _std(g, 1, unbiased), EPS)  # (B, K)
    elif norm == "drgrpo":
        # A_i = r_i - mean_g                      (Dr. GRPO: the std division biases toward
        #                                          easy/hard prompts; drop it)
        a = g - g.mean(1, keepdim=True)                                         # (B, K)
    elif norm == "global":
        # A_i = (r_i - mean_N) / std_N            (one baseline and one scale for the batch, over its
        #     N sequences. REINFORCE++'s idea, but verl and OpenRLHF whiten over tokens: reinforce++)
        mean, std = batch_mean_std(r, torch.ones_like(r), unbiased)
        a = _safe_div(r - mean, std, EPS)                                       # (N,)
    elif norm == "reinforce++":
        # A_i = (r_i - mean_T) / std_T, mean_T = sum_i L_i r_i / sum_i L_i   (verl's, OpenRLHF's: each of
        #     sequence i's L_i tokens carries r_i; Bessel-corrected as masked_whiten, whatever `unbiased` says)
        w = torch.ones_like(r) if lengths is None else lengths.to(torch.float64)  # (N,)
        mean, std = batch_mean_std(r, w, True)
        a = _safe_div(r - mean, std, EPS)                                       # (N,)
    elif norm == "batch":
        # A_i = (r_i - mean_g) / std_N            (group baseline, batch scale; std_N is the
        #                                          std of the raw rewards, as TRL computes it)
        _, std = batch_mean_std(r, torch.ones_like(r), unbiased)
        a = _safe_div(g - g.mean(1, keepdim=True), std, EPS)                    # (B, K)
    elif norm == "reinforce++-baseline":
        # c_i = r_i - mean_g;  A_i = (c_i - mean_N(c)) / std_N(c)    (REINFORCE++-baseline,
        #     verl and OpenRLHF: the group baseline, then whitening over the batch's tokens;
        #     Bessel-corrected as verl's masked_whiten, whatever `unbiased` says)
        c = (g - g.mean(1, keepdim=True)).reshape(-1)                           # (N,)
        w = torch.ones_like(c) if lengths is None else lengths.to(torch.float64)  # (N,)
        mean, std = batch_mean_std(c, w, True)
        a = _safe_div(c - mean, std, EPS)                                       # (N,)
    elif norm == "rloo":
        # A_i = r_i - (sum_g r - r_i) / (K - 1)   (each sample's baseline excludes itself,
        #     = K/(K-1) * (r_i - mean_g)           so the baseline is independent of r_i)
        a = g - (g.sum(1, keepdim=True) - g) / (k - 1)                          # (B, K)
    elif norm == "maxrl":
        # A_i = (r_i - mean_g) / mean_g, 0 where mean_g <= 0   (MaxRL, arXiv 2602.02710; prime-rl)
        mean = g.mean(1, keepdim=True)                                          # (B, 1)
        a = torch.where(mean > 0, (g - mean) / mean.clamp_min(EPS), torch.zeros_like(g))   # (B, K)
    else:  # "none"
        # A_i = r_i                               (no baseline: every positive reward pushes up)
        a = r.clone()                                                           # (N,)

    a = a.reshape(-1)                                      # (N,)
    if clip is not None:
        # A_i = clamp(A_i, -clip, clip)
        a = a.clamp(-clip, clip)
    return a.to(out_dtype)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float = 1.0, lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over tokens (Schulman et al. 2016), for PPO.

    rewards, values, mask: (N, T). mask is 1 on the policy's own tokens (including the
    end-of-sequence token it sampled) and 0 elsewhere: padding, and text an environment
    inserted. Positions with mask 0 are skipped: their reward and value are ignored, and
    the recursion jumps over them, so a tool response in the middle of a sequence links
    the policy token before it to the policy token after it.

        delta_t = r_t + gamma * V_{t'} - V_t      t' = the next policy token (V = 0 past the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                        (the value target)

    Returns (advantages, returns), both (N, T), zero where mask is 0.
    With gamma = lam = 1, A_t = sum of rewards from t on - V_t.
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(f"rewards, values, mask must share one (N, T) shape, got "
                         f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}")
    m = mask.to(rewards.dtype)                             # (N, T)
    n, t_len = rewards.shape
    adv = torch.zeros_like(rewards)                        # (N, T)
    next_value = rewards.new_zeros(n)                      # (N,) V of the next policy token
    next_adv = rewards.new_zeros(n)                        # (N,) A of the next policy token
    for t in reversed(range(t_len)):                       # a loop over time, vectorised over N
        delta = rewards[:, t] + gamma * next_value - values[:, t]          # (N,)
        a_t = delta + gamma * lam * next_adv                               # (N,)
        on = m[:, t]                                                       # (N,)
        adv[:, t] = a_t * on
        # Where mask is 0, carry the next policy token's value and advantage unchanged.
        next_value = on * values[:, t] + (1 - on) * next_value
        next_adv = on * a_t + (1 - on) * next_adv
    returns = (adv + values) * m                           # (N, T)
    return adv, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Masked z-score: (x - mean) / sqrt(var + eps) over the entries where mask is 1.

    x, mask: same shape. Population variance. shift_mean=False adds the mean back (PPO
    implementations whiten rewards that way, keeping their sign). Zero where mask is 0.
    Under torchrun the mean and variance are every process's tokens' (as in `compute`).
    """
    m = mask.to(x.dtype)
    # mean = sum(x * m) / sum(m);  var = sum((x - mean)^2 * m) / sum(m)
    mean, std = batch_mean_std(x.flatten(), m.flatten(), False)
    out = (x - mean) * torch.rsqrt(std ** 2 + eps) + (0 if shift_mean else mean)
    return out * m


# ---- diagnostics the trainer logs ----

def frac_zero_std(rewards: torch.Tensor, k: int) -> float:
    """Share of groups whose K rewards are all equal: they carry no learning signal under
    any group baseline (TRL logs it as frac_reward_zero_std)."""
    if k < 1 or rewards.numel() % k != 0:
        raise ValueError(f"N={rewards.numel()} rewards cannot be split into groups of k={k}")
    g = rewards.view(-1, k)                                # (B, K)
    return (g.max(1).values == g.min(1).values).float().mean().item()


def frac_pm1(advantages: torch.Tensor, tol: float = 1e-6) -> float:
    """Share of advantages whose magnitude is 1 (within tol): the K=2 signature."""
    return ((advantages.abs() - 1).abs() <= tol).float().mean().item()


# ---- under torchrun: a sum over processes (the identity in one process) ----

def world_size() -> int:
    """W, the processes training together (torchrun's process group), or 1."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_sum(x: torch.Tensor) -> torch.Tensor:      # x summed over every process; x itself in one
    return all_reduce(x, dist.ReduceOp.SUM)


def all_max(x: torch.Tensor) -> torch.Tensor:      # x's elementwise maximum over every process
    return all_reduce(x, dist.ReduceOp.MAX)


def all_reduce(x: torch.Tensor, op) -> torch.Tensor:
    """x reduced by op over every process. nccl (GPUs) reduces tensors on the GPU, gloo (CPUs)
    on the CPU."""
    if world_size() == 1:
        return x
    y = x.detach().clone().to("cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(y, op=op)
    return y.to(x.device)
