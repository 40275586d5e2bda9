"""Rollouts: sample completions with Hugging Face `generate` and keep one record per batch.

One `generate` call per step over all N = B*K sequences: each prompt is repeated K times,
so prompt i owns rows i*K ... i*K+K-1 (the layout advantages.py expects). Prompts are
left-padded so every completion starts at the same column; sampling uses the KV cache.

The completion mask (N, C) is 1 on the tokens the policy chose, up to *and including* the
first end-of-sequence token it sampled, and 0 after it. It is built from the position of
the first EOS, never from pad ids: with tokenizers whose pad token is the EOS token, masking
every pad id would silently drop the sampled EOS from the loss, and the policy would never
learn when to stop.
"""
from dataclasses import dataclass

import torch

from grpo import completion_logprobs


@dataclass
class Rollout:
    """One batch of N sampled completions. Reward and advantage are separate fields."""
    prompt_ids: torch.Tensor        # (N, P) left-padded
    prompt_mask: torch.Tensor       # (N, P) 1 on real prompt tokens
    completion_ids: torch.Tensor    # (N, C) right-padded after the first EOS
    completion_mask: torch.Tensor   # (N, C) 1 on the policy's own tokens, its EOS included
    old_logp: torch.Tensor          # (N, C) log-probs under the policy that sampled
    ref_logp: torch.Tensor | None   # (N, C) log-probs under the frozen reference, or None
    texts: list                     # N decoded completions
    old_values: torch.Tensor | None = None   # (N, C) the critic's values when sampled (PPO)
    rewards: torch.Tensor | None = None      # (N,) filled by the task's reward
    advantages: torch.Tensor | None = None   # (N,) per sequence (GRPO) or (N, C) per token (PPO)
    returns: torch.Tensor | None = None      # (N, C) the critic's targets (PPO)


def completion_mask(completion_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(N, C) long: 1 up to and including the first EOS of each row, 0 after it.
    A row with no EOS (cut at max_new_tokens) is all ones."""
    is_eos = (completion_ids == eos_id).long()                      # (N, C)
    eos_before = is_eos.cumsum(1) - is_eos                          # EOS strictly before t
    return (eos_before == 0).long()                                 # (N, C)


@torch.no_grad()
def sample(model, tok, prompt_texts: list, k: int, max_new_tokens: int, temperature: float,
           ref_model=None, value_head=None) -> Rollout:
    """Generate k completions for each prompt and record them with their log-probs (and,
    given a value head, the values, from the same forward pass)."""
    texts = [t for t in prompt_texts for _ in range(k)]            # N = B*K, grouped
    device = next(model.parameters()).device
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    model.eval()
    # Pure sampling from softmax(logits / temperature): no top-k / top-p truncation, so the
    # log-probs below are those of the distribution the samples came from.
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # (N, P+C)
    p_len = enc["input_ids"].shape[1]
    completion_ids = out[:, p_len:]                                 # (N, C)
    mask = completion_mask(completion_ids, tok.eos_token_id)        # (N, C)
    completion_ids = completion_ids.masked_fill(mask == 0, tok.pad_token_id)
    args = (enc["input_ids"], enc["attention_mask"], completion_ids, mask)
    old_logp, _, h = completion_logprobs(model, *args, temperature=temperature,
                                         return_hidden=True)                      # (N, C)
    old_values = value_head(h) if value_head is not None else None                # (N, C)
    ref_logp = completion_logprobs(ref_model, *args, temperature=temperature)[0] \
        if ref_model is not None else None                                        # (N, C)
    decoded = tok.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(enc["input_ids"], enc["attention_mask"], completion_ids, mask,
                   old_logp, ref_logp, [d.strip() for d in decoded], old_values)
