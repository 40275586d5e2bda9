"""Truncated sampling's exact bias: top-p and top-k, and the mask replay that removes it.

A sampler with top-p or top-k draws only from the tokens it keeps, K, renormalised:

    mu(y) = pi(y) / S    for y in K,    S = sum over K of pi(y)  (the kept mass),    0 elsewhere

The trainer scores the same token over the whole vocabulary, pi(y), so even with the very
weights that sampled, every sampled token's ratio trainer / sampler is

    r = pi(y) / mu(y) = S        (log r = log S < 0, the same for every token of a step)

not 1. A trainer that takes the sampler's log-probs as pi_old (prime-rl; TRL with vLLM's) gets
it as PPO's ratio: "on-policy" training with top-p 0.8 sees ratios near 0.8, at the edge of
[0.8, 1.2], and every term r A grad log pi scaled by S (TRL PR #7269 on Qwen2.5-1.5B, top-p 0.8:
mean ratio 0.896, 51.8% of tokens outside [0.9, 1.1]). One that recomputes pi_old, as train.py
does, gets it as the mismatch weight w = pi_old / mu of mismatch.py. The fix now in
vLLM, prime-rl, slime and SkyRL, the *mask replay*: record K when sampling and renormalise the
trainer's log-probs over it,

    log pi_K(y) = log pi(y) - log S        so r = pi_K(y) / mu(y) = 1 on-policy, exactly.

By default this project samples with top-p 1 and top-k 0 (K is the whole vocabulary, S = 1).
`--top-p` (and the field top_k) truncate its sampler (transformers' warpers); `--mask-replay`
records K at every sampled position (`recorded`) and scores every log-prob of the run over it
(logprobs.py).

    python train.py --top-p 0.8 --rollout-correction bypass                  # the ratio: S, not 1
    python train.py --top-p 0.8 --rollout-correction bypass --mask-replay    # the ratio: 1

`kept` follows transformers' own warpers (top-k first, then top-p over what top-k kept, the
token that crosses p included), which the test checks it against.

The lesson as a test: `python -m pytest -q tests/test_truncation.py -m lesson`.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Knobs:
    """Truncated sampling: top-p, top-k, and the mask replay that keeps the ratio exact."""
    top_p: float = field(default=1.0, metadata={"help": "sample from the likeliest tokens whose probability "
                                                "reaches p (1 = every token)", "min": 0.0, "max": 1.0})
    top_k: int = field(default=0, metadata={"help": "sample from the k likeliest tokens (0 = every token)", "min": 0,
                                            "flag": False})        # a field: the flags stop at 80
    mask_replay: bool = field(default=False, metadata={"help": "score every log-prob over the tokens the sampler "
                                                       "could draw (recorded), so the on-policy ratio is 1"})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.top_p <= 0:
        yield "top-p", f"must be in (0, 1], got {cfg.top_p}"
    if cfg.mask_replay and cfg.top_p == 1 and cfg.top_k == 0:
        yield "mask-replay", "without --top-p < 1 or --top-k > 0 the sampler keeps every token: nothing to replay"
    if cfg.task == "tools" and (cfg.top_p < 1 or cfg.top_k):
        yield "top-p" if cfg.top_p < 1 else "top-k", "the tool task's multi-turn sampling is untruncated"


def kept(logits, top_p: float = 1.0, top_k: int = 0):
    """(..., V) bool: the tokens a sampler with this top-p and top-k can draw. top-k keeps the k
    largest logits (0: all); top-p then keeps the fewest most likely of those whose probability,
    renormalised over them, sums to at least p (1.0: all)."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]                  # (..., 1)
        keep = logits >= kth
    if top_p < 1.0:
        probs = torch.softmax(logits.masked_fill(~keep, -torch.inf), dim=-1)
        order = torch.argsort(probs, dim=-1, descending=True)
        sorted_probs = torch.gather(probs, -1, order)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs                # mass strictly above
        in_sorted = before < top_p                                                # the crossing token too
        keep = keep & torch.zeros_like(keep).scatter(-1, order, in_sorted)
    return keep


def logprobs_over(logits, keep):
    """(..., V) log-probabilities renormalised over the kept tokens (-inf elsewhere): the
    sampler's own log-probs, and the trainer's under the mask replay (logits its own, keep the
    sampler's recorded set)."""
    return torch.log_softmax(logits.masked_fill(~keep, -torch.inf), dim=-1)


def kept_mass(logits, keep):
    """(...,) S, the whole-vocabulary probability of the kept tokens: every sampled token's
    ratio when the trainer does not replay the mask."""
    return torch.exp(torch.logsumexp(logits.masked_fill(~keep, -torch.inf), dim=-1)
                     - torch.logsumexp(logits, dim=-1))


def token_ratio(trainer_logits, sampler_logits, keep, token, replay: bool):
    """(...,) the importance ratio pi / mu of the sampled token: the trainer's log-prob over the
    whole vocabulary (replay False) or over the recorded kept set (replay True), against the
    sampler's over that set."""
    trainer = logprobs_over(trainer_logits, keep if replay else torch.ones_like(keep))
    sampler = logprobs_over(sampler_logits, keep)
    pick = lambda lp: torch.gather(lp, -1, token.unsqueeze(-1)).squeeze(-1)
    return torch.exp(pick(trainer) - pick(sampler))


def recorded(scores: tuple, mask: torch.Tensor) -> torch.Tensor:
    """(N, C, V) bool: the kept set at every sampled position, read from generate's processed
    scores (C tensors (N, V); a token the warpers dropped scores -inf); every token past a row's
    end (mask 0: padding, never trained on), so no position is left with an empty set."""
    keep = torch.stack([torch.isfinite(s) for s in scores[:mask.shape[1]]], dim=1)   # (N, C, V), 1 byte each
    return keep | ~mask.bool().unsqueeze(-1)
