"""The rollout/training mismatch: the policy that sampled is not quite the policy that trains.

PPO's ratio exp(logp - logp_old) assumes the samples came from pi_old, the weights that
recorded logp_old. In a fast trainer they did not: vLLM or SGLang samples in bf16 with its own
kernels, or from weights a few updates old (asynchronous rollouts), while the trainer
recomputes logp_old in fp32. Per token, with mu the sampler's probabilities,

    log w_it = log pi_old(y_it) - log mu(y_it)         w = pi_old / mu, the importance weight

and the expected gradient is right only with w in it: E_mu[w * grad] = E_pi_old[grad]. Left
out, every update is a little off-policy in a direction no clip sees (the clip bounds
pi / pi_old, never pi_old / mu); "When Speed Kills Stability" (Liu, Li et al., 2025) traces
collapses of long runs to it. The corrections multiply the policy-gradient term of each
token's loss by a weight made from w (never differentiated), at one of two levels:

    token      w_it                                  (TRL token_*, verl token)
    sequence   exp(mean_t log w_it), every token     (the geometric mean: verl's "geometric";
                                                      TRL's sequence_* take the product, which
                                                      underflows past a few hundred tokens)

    tis        min(w, C_max)                         truncated IS (TRL *_truncate, verl rollout_is)
    mis        w if C_min <= w <= C_max, else 0      masked IS, ICEPOP (TRL *_mask, verl rollout_rs)

or drop a whole sequence (weight 0 on its tokens, 1 on a kept one's):

    geo-mask        exp(mean_t log w_t) outside [1 - eps, 1 + eps], eps 0.01      SkyRL's default
    seq-error-mask  mean_t exp(|log w_t|) above a bound, 2.0                       NeMo-RL's recipes

or no weight at all, the sampler's log-probs taken as pi_old (`bypass`: prime-rl, which never
recomputes them; verl's bypass mode): the update's ratio is then pi / mu, so PPO's clip or
DPPO's mask is the trust region against the sampler itself (the DPPO paper's setting).

To see it on a CPU, without vLLM, this module makes the sampler differ on purpose
(`RolloutPolicy`): a bf16 copy of the policy (`--rollout-dtype bf16`), the weights of n
updates ago (`--rollout-stale n`) or another temperature (`--rollout-temperature`). The
sampler's own log-probs come from `generate`'s processed scores (`sampler_logprobs`: the
distribution each token was drawn from), and the run logs how far apart the two are
(`diagnostics`, TRL's names) whether or not it corrects (`--log-mismatch` alone: the null,
the same weights on both sides, where only float rounding differs).
"""
import copy
import dataclasses
import math
from dataclasses import dataclass, field
from collections import deque

import torch
from torch import nn

import logprobs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}          # --rollout-dtype; "same": the policy
CORRECTIONS = ("none", "tis", "mis", "geo-mask", "seq-error-mask", "bypass")
SEQUENCE_MASKS = ("geo-mask", "seq-error-mask")
LEVELS = ("token", "sequence")


@dataclass
class Knobs:
    """The rollout/training mismatch: a sampler that is not the policy, and the correction."""
    rollout_dtype: str = field(default="same", metadata={"help": "sample from a copy of the policy in this dtype "
                               "(bf16: as vLLM does); same = the policy itself", "choices": ("same", *DTYPES)})
    rollout_stale: int = field(default=0, metadata={"help": "sample from the policy's weights of this many updates "
                                                    "ago (asynchronous rollouts)", "min": 0, "max": 64})
    rollout_temperature: float = field(default=0.0, metadata={"help": "sample at this temperature while training "
                                       "scores at --temperature; 0 = the same", "min": 0, "max": 1e3})
    rollout_correction: str = field(default="none", metadata={
        "help": "correct the mismatch: tis (truncated IS, min(w, C_max)), mis (masked IS / ICEPOP: w outside "
                "[C_min, C_max] drops its token), drop whole sequences: geo-mask (SkyRL), seq-error-mask "
                "(NeMo-RL); w = pi_old / pi_sampler; or bypass: the sampler's log-probs are pi_old (prime-rl)",
        "choices": CORRECTIONS,
        "algos": ("grpo", "ppo")})
    geo_mask_eps: float = field(default=0.01, metadata={"help": "--rollout-correction geo-mask: a sequence whose "
                                "geometric-mean w leaves [1 - eps, 1 + eps] is dropped", "needs": "rollout_correction",
                                "flag": False})
    seq_error_max: float = field(default=2.0, metadata={"help": "--rollout-correction seq-error-mask: a sequence "
                                 "whose mean exp(|log w|) passes this is dropped", "max": 1e4,
                                 "needs": "rollout_correction", "flag": False})
    rollout_correction_level: str = field(default="token", metadata={
        "help": "the correction's weight per token, or per sequence (the geometric mean of its tokens')",
        "choices": LEVELS, "needs": "rollout_correction", "flag": False})
    rollout_c_min: float = field(default=0.5, metadata={"help": "--rollout-correction mis: a weight below this "
                                                        "drops its token", "needs": "rollout_correction", "flag": False})
    rollout_c_max: float = field(default=3.0, metadata={"help": "--rollout-correction tis: the cap; mis: a weight "
                                 "above this drops its token (> 1)", "max": 1e4, "needs": "rollout_correction",
                                 "flag": False})
    log_mismatch: bool = field(default=False, metadata={"help": "record the sampler's log-probs and log the "
                               "mismatch (sampling/*) even with no mismatch made (the null: float rounding alone)"})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.rollout_stale >= cfg.steps:
        yield "rollout-stale", (f"{cfg.rollout_stale} updates old can never be reached in a run of --steps "
                                f"{cfg.steps} (and each step would keep a copy of the weights)")
    if 0 < cfg.rollout_temperature < 1e-3:
        yield "rollout-temperature", f"must be 0 (= --temperature) or in [0.001, 1000], got {cfg.rollout_temperature}"
    if cfg.rollout_c_max <= 1:
        yield "rollout-c-max", f"must be > 1 (a weight of 1 is on-policy), got {cfg.rollout_c_max}"
    if not 0 < cfg.rollout_c_min < 1:
        yield "rollout-c-min", f"must be in (0, 1), got {cfg.rollout_c_min}"
    if cfg.rollout_c_min != Knobs.rollout_c_min and cfg.rollout_correction != "mis":
        yield "rollout-c-min", (f"only --rollout-correction mis drops tokens below a floor; {cfg.rollout_correction} "
                                f"would ignore it")
    if cfg.rollout_correction not in ("none", "tis", "mis"):  # only tis and mis weigh tokens by w, capped
        for name in ("rollout_correction_level", "rollout_c_max"):
            if getattr(cfg, name) != getattr(Knobs, name):
                yield name, (f"only --rollout-correction tis and mis read it; {cfg.rollout_correction} would "
                             f"ignore it")
    if not 0 < cfg.geo_mask_eps < 1:
        yield "geo-mask-eps", f"must be in (0, 1): the band [1 - eps, 1 + eps] would be empty, got {cfg.geo_mask_eps}"
    for name, mode in (("geo_mask_eps", "geo-mask"), ("seq_error_max", "seq-error-mask")):
        if getattr(cfg, name) != getattr(Knobs, name) and cfg.rollout_correction != mode:
            yield name, f"only --rollout-correction {mode} reads it; {cfg.rollout_correction} would ignore it"
    if cfg.seq_error_max <= 1:
        yield "seq-error-max", f"must be > 1 (mean exp(|log w|) is at least 1: every sequence dropped), got {cfg.seq_error_max}"
    if cfg.task == "tools" and cfg.rollout_logprobs:
        yield "task", ("the tool task's multi-turn episodes do not record the sampler's log-probs that "
                       "--rollout-*/--log-mismatch need (mismatch.py is built for --task dsl)")


# ---- the sampler's log-probs ----

def sampler_logprobs(scores: tuple, completion_ids: torch.Tensor) -> torch.Tensor:
    """(N, C) log mu of each sampled token, from generate's processed scores: scores[t] (N, V)
    is the distribution step t sampled from (the logits after every processor, temperature
    included), so log_softmax(scores[t]) at the chosen token is the sampler's log-prob. Columns
    past the last step (a row padded after its EOS) are 0; mask them."""
    n, c = completion_ids.shape
    out = torch.zeros(n, c, device=completion_ids.device)
    rows = torch.arange(n, device=completion_ids.device)
    for t, s in enumerate(scores[:c]):
        out[:, t] = torch.log_softmax(logprobs.float32_or_wider(s), -1)[rows, completion_ids[:, t]]
    return out


# ---- a sampler that differs on purpose ----

class RolloutPolicy:
    """How a step's rollouts are sampled when not from the policy that trains, and with the
    sampler's log-probs recorded: from a copy in `dtype` ("same": the policy itself) holding the
    policy's weights of `stale` updates ago (0: this step's), at `temperature` (0: the
    training's). The copy is refreshed from the policy every step, as a trainer loads its
    weights into vLLM. The stale weights go into the run's checkpoints (state_dict), so a
    resumed run samples from the same old weights as one that never stopped."""

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.extend(state["history"])

    def __init__(self, dtype: str = "same", stale: int = 0, temperature: float = 0.0):
        self.dtype, self.copy, self.temperature = DTYPES.get(dtype), None, temperature   # None: the policy's
        self.own_copy = dtype != "same" or stale > 0
        self.history = deque(maxlen=stale + 1)

    def rollout(self, models, sampling):
        """Called once a step, before sampling: (models, sampling) for this step's rollouts:
        rollout.Models with the sampler set, tasks.Sampling recording the sampler's log-probs."""
        sampler = self.sampler(models.model) if self.own_copy else None
        return (dataclasses.replace(models, sampler=sampler),
                dataclasses.replace(sampling, rollout_logprobs=True, rollout_temperature=self.temperature))

    def sampler(self, model: nn.Module) -> nn.Module:
        """The copy, holding the weights to sample with this step."""
        if self.copy is None:
            self.copy = copy.deepcopy(model).to(self.dtype or next(model.parameters()).dtype).eval()
            self.copy.requires_grad_(False)
        if self.history.maxlen == 1:                           # not stale: this step's weights, no copy kept
            self.copy.load_state_dict(model.state_dict())
            return self.copy
        self.history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        self.copy.load_state_dict(self.history[0])             # the oldest kept: `stale` updates ago
        return self.copy


# ---- the correction ----

def log_weights(old_logp, rollout_logp, mask, level: str) -> torch.Tensor:
    """log w per token (N, C), or each sequence's mean log w on its every token (sequence
    level); 0 off the mask."""
    m = mask.to(old_logp.dtype)
    log_w = (old_logp - rollout_logp) * m                                          # (N, C)
    if level == "sequence":
        log_w = (log_w.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1)) * m
    return log_w


def correction(log_w, mode: str, c_min: float, c_max: float) -> torch.Tensor:
    """The weight each token's policy-gradient term is multiplied by (N, C), no gradient:

        tis   min(w, c_max)
        mis   w * [c_min <= w <= c_max]      (ICEPOP: a token far off-policy is dropped)

    log_w is clamped to +-20 before exp (as verl does), so no weight is inf."""
    w = torch.exp(log_w.detach().clamp(-20.0, 20.0))
    if mode == "tis":
        return w.clamp(max=c_max)
    if mode == "mis":
        return w * ((w >= c_min) & (w <= c_max)).to(w.dtype)
    raise ValueError(f"unknown correction {mode!r}; expected one of {CORRECTIONS[1:]}")


def sequence_mask(old_logp, rollout_logp, mask, mode: str, bound: float) -> torch.Tensor:
    """(N, C) 1 on every token of a kept sequence, 0 on a dropped one's (no gradient):

        geo-mask        keep if 1 - bound <= exp(mean_t log w_t) <= 1 + bound       (SkyRL)
        seq-error-mask  keep if mean_t exp(|log w_t|) <= bound                       (NeMo-RL)

    The geometric mean forgives a long sequence's many small gaps that cancel; the error does
    not (|log w| never cancels), so it drops a sequence the sampler saw differently anywhere."""
    m = mask.to(old_logp.dtype)
    n = m.sum(1).clamp_min(1)                                                      # (N,)
    log_w = torch.where(mask.bool(), old_logp - rollout_logp, 0.0)                 # (N, C)
    if mode == "geo-mask":
        w = torch.exp((log_w.sum(1) / n).clamp(-20.0, 20.0))
        keep = (w >= 1 - bound) & (w <= 1 + bound)
    else:
        keep = (torch.exp(log_w.abs()) * m).sum(1) / n <= bound
    return keep.to(m.dtype).unsqueeze(1).expand_as(m)


def weigh(batch, hp) -> None:
    """Fill batch.is_weight (N, C) from the sampler's log-probs and the policy's recomputed
    old ones, by hp.rollout_correction at hp.rollout_correction_level; None without one."""
    if hp.rollout_correction in ("none", "bypass") or batch.rollout_logp is None:
        batch.is_weight = None                 # bypass: train.rl_step trains on the sampler's log-probs
        return
    if hp.rollout_correction in SEQUENCE_MASKS:
        bound = hp.geo_mask_eps if hp.rollout_correction == "geo-mask" else hp.seq_error_max
        batch.is_weight = sequence_mask(batch.old_logp, batch.rollout_logp, batch.completion_mask,
                                        hp.rollout_correction, bound)
        return
    log_w = log_weights(batch.old_logp, batch.rollout_logp, batch.completion_mask, hp.rollout_correction_level)
    batch.is_weight = correction(log_w, hp.rollout_correction, hp.rollout_c_min, hp.rollout_c_max)


# ---- what a run logs ----

def diagnostics(log_w_tokens: torch.Tensor, log_w_seqs: torch.Tensor, weight_tokens=None) -> dict:
    """How far the sampler and the trainer disagree on the tokens sampled:

        sampling/sampling_logp_difference/mean, max     |log pi_old - log mu| per token (TRL's)
        sampling/raw_importance_ratio/min, mean, max    w = pi_old / mu per token, before any correction
        sampling/raw_importance_ratio/seq_min, seq_max  the geometric mean per sequence
        sampling/effective_sample_size      (sum w)^2 / (n sum w^2) over the tokens, of the raw w:
                                            1 when every w is equal, 1/n when one token has all
        sampling/importance_sampling_ratio/min, mean, max   the weight the loss used (tis: min(w,
                                            C_max); mis: 0 for a dropped token), with a correction
                                            on: TRL's meaning of the name
    log_w_tokens: (tokens,) log w of every policy token; log_w_seqs: (N,) the mean per sequence;
    weight_tokens: (tokens,) the correction's weight, or None."""
    w = torch.exp(log_w_tokens.double().clamp(-20.0, 20.0))
    out = {"sampling/sampling_logp_difference/mean": log_w_tokens.abs().mean().item(),
           "sampling/sampling_logp_difference/max": log_w_tokens.abs().max().item(),
           "sampling/raw_importance_ratio/min": w.min().item(),
           "sampling/raw_importance_ratio/mean": w.mean().item(),
           "sampling/raw_importance_ratio/max": w.max().item(),
           "sampling/raw_importance_ratio/seq_min": math.exp(log_w_seqs.min().item()),
           "sampling/raw_importance_ratio/seq_max": math.exp(log_w_seqs.max().item()),
           "sampling/effective_sample_size": (w.sum() ** 2 / (len(w) * (w ** 2).sum())).item()}
    if weight_tokens is not None:
        out.update({f"sampling/importance_sampling_ratio/{k}": getattr(weight_tokens, k)().item()
                    for k in ("min", "mean", "max")})
    return out
