"""GRPO: the clipped policy-gradient update without a critic, in plain PyTorch.

Shapes: N sequences in the batch (B prompts x K samples), n in a micro-batch, P prompt
tokens, C completion tokens, V vocabulary. mask (n, C) is 1 on a token the policy chose
and is trained on, its sampled end-of-sequence token included, and 0 on padding.

Per token t of sequence i, with the sequence's advantage A_i (advantages.py):

    ratio_it  = exp(logp_it - logp_old_it)
    surrogate = min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)     (PPO)
    kl_it     = exp(ref - logp) - (ref - logp) - 1                                 (k3)
    loss_it   = -surrogate + beta * kl_it - entropy_coef * H_it

summed over tokens and divided by one of three normalisers (`aggregate`). GRPO departs
from PPO in two places: the advantage is a group statistic of sequence rewards instead of a
learned value (no critic), and the KL to the reference is a loss term instead of a reward
penalty. eps_high > eps_low is DAPO's decoupled ("clip-higher") bound.

Every knob is a flag of train.py; `python train.py --k 8 --norm global` runs it.
"""
import math

import torch


# ---- log-probabilities ----

def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] without materialising the (n, C, V) log-softmax.

    logits: (n, C, V), ids: (n, C) -> (n, C).
    log p(x) = logit_x - logsumexp(logits): one gather and one reduction.
    """
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)      # (n, C)
    return picked - torch.logsumexp(logits, dim=-1)                # (n, C)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, per position. (n, C, V) -> (n, C)."""
    p = torch.softmax(logits, dim=-1)                              # (n, C, V)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)  # (n, C)


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, with_entropy: bool = False,
                        entropy_grad: bool = False):
    """Per-token log-probs of the completion under the model: (n, C), and entropy (n, C).

    prompt_ids (n, P) are left-padded, completion_ids (n, C) right-padded. Positions are
    counted from the first real token, as `generate` counts them, so left padding does not
    shift them. Only the C + 1 last positions go through the LM head (logits_to_keep).
    Logits are divided by the sampling temperature: the ratio compares the distribution
    the samples were actually drawn from. The entropy carries a gradient only when
    entropy_grad (an entropy bonus); as a metric it stays out of the graph.
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                    # (n, P+C)
    attn = torch.cat([prompt_mask, completion_mask], dim=1)                 # (n, P+C)
    positions = (attn.cumsum(-1) - 1).clamp_min(0)                          # (n, P+C)
    c_len = completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                logits_to_keep=c_len + 1, use_cache=False)
    # logits at position j predict token j+1: the last C+1 positions predict the C
    # completion tokens (and one token past the end, dropped).
    logits = out.logits[:, :-1].float() / temperature                       # (n, C, V)
    logp = token_logprobs(logits, completion_ids)                           # (n, C)
    entropy = None
    if with_entropy:
        entropy = token_entropy(logits if entropy_grad else logits.detach())  # (n, C)
    return logp, entropy


# ---- the loss ----

def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || reference) per token (Schulman's 'approximating KL'):
    x = ref - logp;  k3 = exp(x) - x - 1 >= 0, unbiased for samples from the policy."""
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def clipped_surrogate(logp, old_logp, adv, eps_low: float, eps_high: float):
    """PPO's clipped objective per token, to be maximised, and where clipping bites.

    logp, old_logp: (n, C); adv: (n,). Returns (surrogate (n, C), clipped (n, C) bool).
    """
    ratio = torch.exp(logp - old_logp)                                      # (n, C)
    a = adv.unsqueeze(1)                                                    # (n, 1)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * a
    # min(): the objective never rewards moving the ratio past the clip range.
    surrogate = torch.min(unclipped, clipped)                               # (n, C)
    return surrogate, clipped < unclipped


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "constant")


def aggregate(per_token, mask, mode: str, batch_seqs: int, batch_tokens: int, max_len: int):
    """Reduce a per-token loss (n, C) to a scalar.

    token-mean           sum_it loss_it / (tokens in the whole batch)         (DAPO, TRL)
    seq-mean-token-mean  sum_i (sum_t loss_it / len_i) / (sequences in batch)  (original GRPO)
    constant             sum_it loss_it / (sequences * max_len)                (Dr. GRPO)

    The denominators are those of the *whole* batch, so the losses of its micro-batches
    add up to the full-batch loss exactly: gradient accumulation then reproduces the
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


# ---- one update on a batch of rollouts ----

def update(model, optimizer, batch, *, epochs: int, micro_batch: int, clip_eps: float,
           clip_eps_high: float, beta: float, entropy_coef: float, agg: str, max_len: int,
           max_grad_norm: float, temperature: float, seed: int) -> dict:
    """`epochs` optimizer steps on one batch, each accumulated over micro-batches.

    batch: a rollout.Rollout (prompt/completion ids and masks, old_logp, ref_logp,
    advantages; ref_logp None means no KL term). Returns the metrics of the last epoch:
    loss, kl (None without a reference), entropy, clip_frac,
    grad_norm (before clipping), skipped_nonfinite: how many optimizer steps were not
    taken because the loss or the gradient norm was NaN or infinite (weights and optimizer
    state untouched), and nonfinite: which of the two it was.
    """
    n = batch.completion_ids.shape[0]
    m_all = batch.completion_mask
    batch_tokens = int(m_all.sum().clamp_min(1))
    gen = torch.Generator().manual_seed(seed)
    skipped, nonfinite = 0, []
    model.train()
    for _ in range(epochs):
        # Shuffle sequences across micro-batches; the full-batch gradient is the same.
        order = torch.randperm(n, generator=gen) if epochs > 1 else torch.arange(n)
        sums = dict(loss=0.0, kl=0.0, entropy=0.0, clipped=0.0)
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, n, micro_batch):
            idx = order[start:start + micro_batch]
            mask = m_all[idx]                                                   # (n, C)
            logp, ent = completion_logprobs(model, batch.prompt_ids[idx], batch.prompt_mask[idx],
                                            batch.completion_ids[idx], mask, temperature,
                                            with_entropy=True, entropy_grad=entropy_coef > 0)
            surrogate, clipped = clipped_surrogate(logp, batch.old_logp[idx],
                                                   batch.advantages[idx], clip_eps, clip_eps_high)
            per_token = -surrogate                                              # (n, C)
            if batch.ref_logp is not None:
                kl = kl_k3(logp, batch.ref_logp[idx])                           # (n, C)
                per_token = per_token + beta * kl
                sums["kl"] += (kl.detach() * mask).sum().item()
            if entropy_coef > 0:
                per_token = per_token - entropy_coef * ent
            loss = aggregate(per_token, mask, agg, n, batch_tokens, max_len)
            loss.backward()
            sums["loss"] += loss.item()
            sums["entropy"] += (ent.detach() * mask).sum().item()
            sums["clipped"] += (clipped.float() * mask).sum().item()
        # max_grad_norm = inf measures the norm without clipping.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        bad = [name for name, v in (("loss", sums["loss"]), ("grad_norm", grad_norm.item()))
               if not math.isfinite(v)]
        if not bad:
            optimizer.step()
        else:                  # never apply a NaN/inf step: weights and optimizer state untouched
            skipped += 1
            nonfinite = bad
            optimizer.zero_grad(set_to_none=True)
    kl = sums["kl"] / batch_tokens if batch.ref_logp is not None else None
    return dict(loss=sums["loss"], kl=kl,
                entropy=sums["entropy"] / batch_tokens,
                clip_frac=sums["clipped"] / batch_tokens, grad_norm=grad_norm.item(),
                skipped_nonfinite=skipped, nonfinite=nonfinite)
