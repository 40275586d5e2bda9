"""GRPO: the clipped policy-gradient update without a critic, in plain PyTorch.

Shapes: N sequences in the batch (B prompts x K samples), n in a micro-batch, P prompt
tokens, C completion tokens, V vocabulary. mask (n, C) is 1 on a token the policy chose
and is trained on, its sampled end-of-sequence token included, and 0 on padding and on
tokens an environment inserted (attended to, through the batch's attention(), but never
trained on: rollout.py).

Per token t of sequence i, with the sequence's advantage A_i (advantages.py):

    ratio_it  = exp(logp_it - logp_old_it)
    surrogate = min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)     (PPO)
    kl_it     = a per-token estimate of KL(policy || reference)                    (kl.py; k3 default)
    loss_it   = -surrogate + beta * kl_it - entropy_coef * H_it

summed over tokens and divided by one of three normalisers (`aggregate`). GRPO departs
from PPO in two places: the advantage is a group statistic of sequence rewards instead of a
learned value (no critic), and the KL to the reference is a loss term instead of a reward
penalty. eps_high > eps_low is DAPO's decoupled ("clip-higher") bound.

Every knob is a flag of train.py; `python train.py --k 8 --norm global` runs it.
"""
import math

import torch

import kl


# ---- log-probabilities ----

# Rows of logits handled at once: with a large vocabulary (Qwen's 151,936) the (n, C, V)
# float32 logits of a whole batch are gigabytes, so the head and the log-softmax run on a
# few rows at a time. A small vocabulary fits in one chunk, and then nothing changes.
# (`python bench.py logprobs` measures the memory this saves.)
LOGITS_CHUNK_ELEMENTS = 2 ** 27


def rows_per_chunk(c_len: int, vocab: int) -> int:
    return max(1, LOGITS_CHUNK_ELEMENTS // max(1, c_len * vocab))


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] in float32 without materialising the (n, C, V) log-softmax.

    logits: (n, C, V), any float dtype; ids: (n, C) -> (n, C) float32.
    log p(x) = logit_x - logsumexp(logits): one gather and one reduction, over a few rows
    at a time, so the extra memory is one chunk of rows, not another (n, C, V) tensor.
    """
    step = rows_per_chunk(logits.shape[1], logits.shape[2])
    out = []
    for i in range(0, len(logits), step):
        chunk = logits[i:i + step].float()                                  # (rows, C, V)
        picked = chunk.gather(-1, ids[i:i + step].unsqueeze(-1)).squeeze(-1)  # (rows, C)
        out.append(picked - torch.logsumexp(chunk, dim=-1))                 # (rows, C)
    return torch.cat(out)                                                   # (n, C)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, per position. (n, C, V) -> (n, C)."""
    p = torch.softmax(logits, dim=-1)                              # (n, C, V)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)  # (n, C)


def head_logits(model, h: torch.Tensor) -> torch.Tensor:
    """The model's logits from last hidden states h (rows, C, H), in float32: the LM head with
    autocast switched off (a bf16 head rounds every logit, and the log-probs with them; the
    weights are float32, train.load's choice), then what the model's own forward does to its
    logits after the head:

        Gemma 2/3   final_logit_softcapping c:  logits = c * tanh(logits / c)
        Cohere      logit_scale s:              logits = s * logits
        Granite     logits_scaling d:           logits = logits / d

    A model that does something else is refused at load (`check_logprobs`)."""
    head = model.get_output_embeddings()
    with torch.autocast(device_type=h.device.type, enabled=False):     # the module itself, so its
        logits = head(h.to(head.weight.dtype)).float()                  # hooks run; (rows, C, V)
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    if getattr(cfg, "logit_scale", None) is not None:
        logits = logits * cfg.logit_scale
    if getattr(cfg, "logits_scaling", None) is not None:
        logits = logits / cfg.logits_scaling
    return logits


def probe_ids(model, rows: int, tokens: int) -> torch.Tensor:
    """(rows, tokens) random token ids, the same every call, on the model's device."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    return ids.to(next(model.parameters()).device)


@torch.no_grad()
def check_logprobs(model, tokens: int = 12) -> float:
    """Largest |difference| between completion_logprobs and log-softmax of the model's own
    forward logits, on random tokens: ~1e-6 when head_logits reproduces the model. (Both
    forwards see the same mode; from_pretrained hands back a model in eval mode.)"""
    ids = probe_ids(model, 2, tokens)                                               # (2, T)
    attn, half = torch.ones_like(ids), tokens // 2
    ours, _ = completion_logprobs(model, ids[:, :half], attn[:, :half], ids[:, half:], attn[:, half:])
    logits = model(input_ids=ids, attention_mask=attn).logits[:, half - 1:-1].float()  # (2, T-half, V)
    ref = torch.log_softmax(logits, -1).gather(-1, ids[:, half:, None]).squeeze(-1)
    return (ours - ref).abs().max().item()


@torch.no_grad()
def forward_is_finite(model, tokens: int = 8) -> bool:
    """Whether the model's logits are finite on a few random tokens, in eval mode as sampling
    runs (train.py checks this before it writes a checkpoint)."""
    was_training = model.training
    model.eval()
    finite = bool(torch.isfinite(model(input_ids=probe_ids(model, 1, tokens)).logits).all())
    model.train(was_training)
    return finite


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, with_entropy: bool = False,
                        entropy_grad: bool = False, return_hidden: bool = False):
    """Per-token log-probs of the completion under the model: (n, C); entropy (n, C) or None;
    and, with return_hidden, the last hidden states that predict each token (n, C, H).

    prompt_ids (n, P) are left-padded, completion_ids (n, C) right-padded. Positions are
    counted from the first real token, as `generate` counts them, so left padding does not
    shift them. Only the C + 1 last positions go through the LM head (never all P + C).
    Logits are divided by the sampling temperature: the ratio compares the distribution
    the samples were actually drawn from. The entropy carries a gradient only when
    entropy_grad (an entropy bonus); as a metric it stays out of the graph. The head (in
    float32, with the model's own logit post-processing: `head_logits`) and the log-softmax
    run on LOGITS_CHUNK_ELEMENTS-sized groups of rows.
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                    # (n, P+C)
    attn = torch.cat([prompt_mask, completion_mask], dim=1)                 # (n, P+C)
    positions = (attn.cumsum(-1) - 1).clamp_min(0)                          # (n, P+C)
    c_len = completion_ids.shape[1]
    h = model.base_model(input_ids=ids, attention_mask=attn, position_ids=positions,
                         use_cache=False).last_hidden_state[:, -(c_len + 1):]  # (n, C+1, H)
    # hidden state j predicts token j+1: the last C+1 positions predict the C completion
    # tokens (and one token past the end, dropped).
    step = rows_per_chunk(c_len, model.get_output_embeddings().weight.shape[0])
    logps, entropies = [], []
    for i in range(0, len(ids), step):
        logits = head_logits(model, h[i:i + step, :-1]) / temperature       # (rows, C, V) float32
        logps.append(token_logprobs(logits, completion_ids[i:i + step]))    # (rows, C)
        if with_entropy:
            entropies.append(token_entropy(logits if entropy_grad else logits.detach()))
    logp = torch.cat(logps)                                                 # (n, C)
    entropy = torch.cat(entropies) if with_entropy else None                # (n, C)
    if return_hidden:
        return logp, entropy, h[:, :-1]                                     # (n, C, H)
    return logp, entropy


# ---- the loss ----

def clipped_surrogate(logp, old_logp, adv, eps_low: float, eps_high: float):
    """PPO's clipped objective per token, to be maximised, and where clipping bites.

    logp, old_logp: (n, C); adv: (n,) one per sequence (GRPO) or (n, C) one per token (PPO).
    Returns (surrogate (n, C), clipped (n, C) bool).
    """
    ratio = torch.exp(logp - old_logp)                                      # (n, C)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv                         # (n, 1) or (n, C)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * a
    # min(): the objective never rewards moving the ratio past the clip range.
    surrogate = torch.min(unclipped, clipped)                               # (n, C)
    return surrogate, clipped < unclipped


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


# ---- the update loop, shared with ppo.py ----

def micro_batch_rows(batch, idx, trim: bool = False):
    """The rows idx of a batch for one forward: (prompt_ids, prompt_mask, completion_ids,
    attention, mask, cols), cols the completion columns kept. trim (--fast) drops the
    columns that are padding in every row: the leading prompt padding and everything after
    the longest completion. Causal attention leaves the kept tokens' log-probs unchanged."""
    p_ids, p_mask = batch.prompt_ids[idx], batch.prompt_mask[idx]
    attn = batch.attention(idx)
    cols = slice(None)
    if trim:
        start = int((p_mask.sum(0) == 0).sum())        # left padding: the all-pad columns lead
        p_ids, p_mask = p_ids[:, start:], p_mask[:, start:]
        cols = slice(0, int(attn.sum(1).max()))
    return p_ids, p_mask, batch.completion_ids[idx][:, cols], attn[:, cols], \
        batch.completion_mask[idx][:, cols], cols


def optimize(params: list, optimizer, mask, loss_fn, *, epochs: int, mini_batch: int,
             micro_batch: int, max_grad_norm: float, seed: int, target_kl: float = 0.0,
             lengths=None) -> dict:
    """`epochs` passes over the batch's sequences in shuffled mini-batches: one optimizer step
    per mini-batch, its gradient accumulated over micro-batches. mask: the batch's (N, C)
    completion mask, which counts each mini-batch's policy tokens.

    loss_fn(idx, mb_seqs, mb_tokens) -> (loss, sums) for the sequences idx of a mini-batch of
    mb_seqs sequences and mb_tokens policy tokens: a scalar already normalised by those
    counts (so micro-batch losses add up to the mini-batch loss, and accumulation is exact),
    and per-token sums for the metrics ('approx_kl' among them).
    Guard: a NaN/inf loss or gradient norm skips that optimizer step (weights and optimizer
    state untouched); params are every parameter the optimizer updates, the norm is theirs.
    Early stop (CleanRL): after an epoch whose token-mean approx_kl exceeds target_kl (> 0),
    no further epochs. lengths (N,) (--fast): each mini-batch is sorted by length before it
    is cut into micro-batches, so sequences of similar length share a forward and little
    of it is padding (the gradient is the same sum). Returns the last epoch's token means, plus
    loss and grad_norm (means over the last epoch's mini-batches; grad_norm before clipping),
    steps_taken (optimizer steps applied, every epoch), skipped_nonfinite, nonfinite (which
    quantity), epochs_run.
    """
    n = mask.shape[0]
    gen = torch.Generator().manual_seed(seed)
    skipped, steps_taken, nonfinite, epochs_run = 0, 0, [], 0
    for _ in range(epochs):
        # Shuffle sequences across mini-batches every epoch (CleanRL), so the K samples of a
        # prompt do not always share an optimizer step; one mini-batch needs no order.
        order = torch.randperm(n, generator=gen) if mini_batch < n else torch.arange(n)
        sums, tokens, losses, norms = {}, 0, [], []
        for mb_start in range(0, n, mini_batch):
            mb = order[mb_start:mb_start + mini_batch]
            if lengths is not None:
                mb = mb[torch.argsort(lengths[mb], descending=True, stable=True)]
            mb_tokens = int(mask[mb].sum().clamp_min(1))
            optimizer.zero_grad(set_to_none=True)
            mb_loss = 0.0
            for start in range(0, len(mb), micro_batch):
                loss, part = loss_fn(mb[start:start + micro_batch], len(mb), mb_tokens)
                loss.backward()
                mb_loss += loss.item()
                for key, v in part.items():
                    sums[key] = sums.get(key, 0.0) + v
            tokens += mb_tokens
            losses.append(mb_loss)
            # max_grad_norm = inf measures the norm without clipping.
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
            norms.append(grad_norm)
            bad = [name for name, v in (("loss", mb_loss), ("grad_norm", grad_norm))
                   if not math.isfinite(v)]
            if not bad:
                optimizer.step()
                steps_taken += 1
            else:              # never apply a NaN/inf step: weights and optimizer state untouched
                skipped += 1
                nonfinite = bad
                optimizer.zero_grad(set_to_none=True)
        epochs_run += 1
        if target_kl > 0 and sums.get("approx_kl", 0.0) / max(tokens, 1) > target_kl:
            break
    stats = {key: v / max(tokens, 1) for key, v in sums.items()}
    return dict(stats, loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms),
                steps_taken=steps_taken, skipped_nonfinite=skipped, nonfinite=nonfinite,
                epochs_run=epochs_run)


# ---- one GRPO update on a batch of rollouts ----

def update(model, optimizer, batch, *, epochs: int, mini_batch: int, micro_batch: int,
           clip_eps: float, clip_eps_high: float, beta: float, kl_estimator: str,
           kl_in_loss: bool, entropy_coef: float, agg: str, max_len: int,
           max_grad_norm: float, temperature: float, seed: int, target_kl: float = 0.0,
           fast: bool = False) -> dict:
    """GRPO's loss on one batch of rollouts, optimised by `optimize`.

    batch: a rollout.Rollout (prompt/completion ids and masks, old_logp, ref_logp,
    advantages; ref_logp None means no reference; old_logp None means "the policy that
    sampled is this one": one update per batch, old = logp.detach()). fast: length-sorted,
    trimmed micro-batches. Returns loss, entropy, clip_frac, approx_kl, ref_kl (token-mean
    k3 to the reference, with one), grad_norm (before clipping, mean over the last epoch's
    mini-batches), steps_taken, epochs_run, and the guard's skipped_nonfinite / nonfinite.
    """
    def loss_fn(idx, mb_seqs, mb_tokens):
        p_ids, p_mask, c_ids, attn, mask, cols = micro_batch_rows(batch, idx, trim=fast)  # (n, C)
        logp, ent = completion_logprobs(model, p_ids, p_mask, c_ids, attn, temperature,
                                        with_entropy=True, entropy_grad=entropy_coef > 0)
        old = batch.old_logp[idx][:, cols] if batch.old_logp is not None else logp.detach()
        surrogate, clipped = clipped_surrogate(logp, old, batch.advantages[idx],
                                               clip_eps, clip_eps_high)
        per_token = -surrogate                                                  # (n, C)
        sums = {}
        if batch.ref_logp is not None:
            ref = batch.ref_logp[idx][:, cols]
            kl_t = kl.estimate(logp, ref, kl_estimator)
            if kl_in_loss:
                per_token = per_token + beta * kl_t
            k3 = kl_t.detach() if kl_estimator == "k3" else kl.estimate(logp.detach(), ref, "k3")
            sums["ref_kl"] = (k3 * mask).sum().item()
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * ent
        loss = aggregate(per_token, mask, agg, mb_seqs, mb_tokens, max_len)
        log_ratio = (logp - old).detach()
        # approx_kl = E[(ratio - 1) - log ratio], the k3 estimate of KL(old || new) (CleanRL)
        return loss, dict(sums, entropy=(ent.detach() * mask).sum().item(),
                          clipped=(clipped.float() * mask).sum().item(),
                          approx_kl=(((log_ratio.exp() - 1) - log_ratio) * mask).sum().item())

    model.train()
    lengths = batch.attention().sum(1) if fast else None
    out = optimize(list(model.parameters()), optimizer, batch.completion_mask, loss_fn,
                   epochs=epochs, mini_batch=mini_batch, micro_batch=micro_batch,
                   max_grad_norm=max_grad_norm, seed=seed, target_kl=target_kl, lengths=lengths)
    out["clip_frac"] = out.pop("clipped")
    return out
