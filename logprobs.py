"""Log-probabilities of completions under a causal LM: what rollouts record and updates recompute.

Shapes: n sequences, P prompt tokens, C completion tokens, V vocabulary, H hidden size.
Prompts are left-padded, completions right-padded (rollout.py).

    log p(x_t) = logit_{x_t} - logsumexp(logits_t)          (token_logprobs)
    H_t        = logsumexp(z_t) - sum_v softmax(z_t)_v z_v   (token_entropy)

rollout.py calls completion_logprobs to record old and reference log-probs, grpo.py and
ppo.py call it again in the update (through a `Scorer`); one function, so the ratio compares
like with like. It runs the head in float32 with the model's own logit post-processing
(head_logits), checked against the model's forward when a model is loaded (check_logprobs; the
shared-prefix forward against the plain one: check_shared_prefix), and with every dropout off
for the whole RL phase (disable_dropout): the same weights must give the same log-probs, or the
first epoch's ratio is not 1 and the KL is noise.
"""
from typing import NamedTuple

import torch

import shared_prefix


class Tokens(NamedTuple):
    """The four tensors one forward over prompt + completion needs."""
    prompt_ids: torch.Tensor        # (n, P) left-padded
    prompt_mask: torch.Tensor       # (n, P) 1 on real prompt tokens
    completion_ids: torch.Tensor    # (n, C) right-padded
    attention: torch.Tensor         # (n, C) 1 on every real completion token (policy's or not)
    share: bool = False             # rows that repeat a prompt may share its forward (shared_prefix.py)
    kept: torch.Tensor | None = None  # (n, C, V) bool: the sampler's kept set (truncation.py), or None


# ---- log-probabilities ----

# Rows of logits handled at once: with a large vocabulary (Qwen's 151,936) the (n, C, V)
# float32 logits of a whole batch are gigabytes, so the head and the log-softmax run on a
# few rows at a time. A small vocabulary fits in one chunk, and then nothing changes.
# (`python -m tools.bench logprobs` measures the memory this saves.)
LOGITS_CHUNK_ELEMENTS = 2 ** 27


def rows_per_chunk(c_len: int, vocab: int) -> int:
    return max(1, LOGITS_CHUNK_ELEMENTS // max(1, c_len * vocab))


def float32_or_wider(x: torch.Tensor) -> torch.Tensor:
    """x in float32 (bf16 and fp16 widened), or as it is if wider: a float64 model keeps float64
    end to end, which is how tests/test_same_learning.py gets numbers no CPU's kernels move."""
    return x if x.dtype == torch.float64 else x.float()


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] in float32 without materialising the (n, C, V) log-softmax.

    logits: (n, C, V), any float dtype; ids: (n, C) -> (n, C) float32.
    log p(x) = logit_x - logsumexp(logits): one gather and one reduction, over a few rows
    at a time, so the extra memory is one chunk of rows, not another (n, C, V) tensor.
    """
    step = rows_per_chunk(logits.shape[1], logits.shape[2])
    out = []
    for i in range(0, len(logits), step):
        chunk = float32_or_wider(logits[i:i + step])                        # (rows, C, V)
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
        logits = float32_or_wider(head(h.to(head.weight.dtype)))        # hooks run; (rows, C, V)
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
    ours, _ = completion_logprobs(model, Tokens(ids[:, :half], attn[:, :half], ids[:, half:], attn[:, half:]))
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


def completion_logprobs(model, tokens: Tokens, temperature: float = 1.0, with_entropy: bool = False,
                        entropy_grad: bool = False, return_hidden: bool = False):
    """Per-token log-probs of the completion under the model: (n, C); entropy (n, C) or None;
    and, with return_hidden, the last hidden states that predict each token (n, C, H).

    tokens: prompt_ids (n, P) left-padded, completion_ids (n, C) right-padded. Positions are
    counted from the first real token, as `generate` counts them, so left padding does not
    shift them. Only the C + 1 last positions go through the LM head (never all P + C).
    Logits are divided by the sampling temperature: the ratio compares the distribution
    the samples were actually drawn from. The entropy carries a gradient only when
    entropy_grad (an entropy bonus); as a metric it stays out of the graph. The head (in
    float32, with the model's own logit post-processing: `head_logits`) and the log-softmax
    run on LOGITS_CHUNK_ELEMENTS-sized groups of rows. With tokens.kept (--mask-replay) the
    log-probs are renormalised over the sampler's kept set; the entropy stays the whole policy's.
    """
    completion_ids = tokens.completion_ids                                  # (n, C)
    c_len = completion_ids.shape[1]
    h = completion_hidden(model.base_model, tokens)                         # (n, C+1, H)
    # hidden state j predicts token j+1: the last C+1 positions predict the C completion
    # tokens (and one token past the end, dropped).
    step = rows_per_chunk(c_len, model.get_output_embeddings().weight.shape[0])
    logps, entropies = [], []
    for i in range(0, len(completion_ids), step):
        logits = head_logits(model, h[i:i + step, :-1]) / temperature       # (rows, C, V) float32 or wider
        # --mask-replay: log pi_K(y) = log pi(y) - log S, over the tokens the sampler kept
        kept = logits if tokens.kept is None else logits.masked_fill(~tokens.kept[i:i + step], -torch.inf)
        logps.append(token_logprobs(kept, completion_ids[i:i + step]))      # (rows, C)
        if with_entropy:
            entropies.append(token_entropy(logits if entropy_grad else logits.detach()))
    logp = torch.cat(logps)                                                 # (n, C)
    entropy = torch.cat(entropies) if with_entropy else None                # (n, C)
    if return_hidden:
        return logp, entropy, h[:, :-1]                                     # (n, C, H)
    return logp, entropy


def completion_hidden(trunk, tokens: Tokens):
    """The trunk's (a model's base_model: no LM head) last hidden states at the C + 1 last
    positions, (n, C+1, H); position j predicts completion token j + 1. Positions are counted
    from the first real token, as `generate` counts them, so left padding does not shift them.
    With tokens.share and rows that repeat a prompt, each distinct prompt is encoded once
    (shared_prefix.py: the same hidden states, less work)."""
    attn = torch.cat([tokens.prompt_mask, tokens.attention], dim=1)         # (n, P+C)
    positions = (attn.cumsum(-1) - 1).clamp_min(0)                          # (n, P+C)
    if shared_prefix.worth_it(tokens):
        return shared_prefix.hidden(trunk, tokens, positions, attn)         # (n, C+1, H)
    ids = torch.cat([tokens.prompt_ids, tokens.completion_ids], dim=1)      # (n, P+C)
    return trunk(input_ids=ids, attention_mask=attn, position_ids=positions,
                 use_cache=False).last_hidden_state[:, -(tokens.completion_ids.shape[1] + 1):]


class Scorer(torch.nn.Module):
    """What an update differentiates, as one module: forward(tokens) gives the policy's
    log-probs (n, C) and entropy (n, C) and, with PPO's critic (ppo.py: a value head on the
    policy's last hidden states, or a network of its own), its values (n, C); else None.

    One module because DistributedDataParallel (distributed.replicate) all-reduces the
    gradients only of a forward run through its own call, and completion_logprobs calls the
    model's parts (its trunk, its LM head), not model(...). In one process it is just the
    call below; its parameters are the model's, then the critic's."""

    def __init__(self, model, value_head=None):
        super().__init__()
        self.model, self.value_head = model, value_head

    def forward(self, tokens: Tokens, temperature: float, entropy_grad: bool):
        logp, entropy, h = completion_logprobs(self.model, tokens, temperature, with_entropy=True,
                                               entropy_grad=entropy_grad, return_hidden=True)
        values = self.value_head.values(tokens, h) if self.value_head is not None else None   # (n, C)
        return logp, entropy, values


# ---- batching token lists ----

def pad(rows: list, value, left: bool = False, device=None) -> torch.Tensor:
    """Lists of unequal length -> (n, L), filled with value on the right (or the left)."""
    width = max(map(len, rows))
    return torch.tensor([[value] * (width - len(r)) + r if left else r + [value] * (width - len(r))
                         for r in rows], device=device)


def left_pad(rows: list, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, attention) (n, L), padded on the left."""
    return pad(rows, pad_id, left=True, device=device), \
        pad([[1] * len(r) for r in rows], 0, left=True, device=device)


@torch.no_grad()
def check_shared_prefix(model, tokens: int = 12) -> float:
    """Largest |difference| between log-probs from the shared-prefix forward and the plain
    one, on random tokens (two prompts of different padding, two completions each, one cut
    short): ~1e-6 where the model's cache can be shared over rows; inf where the shared
    forward fails outright (a cache without reorder_cache, a model that rejects it)."""
    ids = probe_ids(model, 2, 2 * tokens)                          # (2, 2T)
    prompt, completion = ids[:, :tokens].repeat_interleave(2, 0), ids[:, tokens:].repeat_interleave(2, 0)
    p_mask, c_mask = torch.ones_like(prompt), torch.ones_like(completion)  # (4, T) each
    p_mask[2:, :3] = 0                                # the second prompt left-padded
    c_mask[1, tokens // 2:] = 0                       # a completion that ended early
    plain = Tokens(prompt, p_mask, completion, c_mask)
    was_training = model.training
    model.eval()                                      # as sampling runs; the mode is given back
    try:
        shared, _ = completion_logprobs(model, plain._replace(share=True))
        expected, _ = completion_logprobs(model, plain)
    except (AttributeError, TypeError, ValueError, RuntimeError, IndexError):
        return float("inf")
    finally:
        model.train(was_training)
    return ((shared - expected) * c_mask).abs().max().item()


def shared_prefix_refused(model) -> str | None:
    """Why this model's forward cannot share a prompt over rows (check_shared_prefix above 1e-3), or None."""
    error = check_shared_prefix(model)
    return None if error < 1e-3 else (f"{type(model).__name__}'s cache cannot be shared over rows (log-probs "
                                      f"off by {error:.3g}); every sequence encodes its own prompt")


# ---- the same weights give the same log-probs: no dropout in RL ----

def disable_dropout(model) -> int:
    """Switch off every dropout of the model, for the whole RL phase; returns how many were on.

    RL compares log-probs of the same weights: the update's against those recorded when
    sampling (in eval mode), and the policy's against the reference's. With dropout on
    during the update (model.train()), the first epoch's ratio is no longer 1, clipping bites
    on noise, and the KL to the reference is noise too (TRL's disable_dropout=True, for the
    same reason). Dropout lives in nn.Dropout modules (GPT-2: attention, residuals,
    embeddings), in float attributes read at forward time (Qwen2's attention_dropout), and in
    the config some models read while running: all three are set to 0."""
    on = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p, on = 0.0, on + 1
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                on += 1
    for name, value in model.config.to_dict().items():
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0:
            setattr(model.config, name, 0.0)
    return on
