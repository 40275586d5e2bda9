"""Rollouts: sample completions with Hugging Face `generate` and keep one record per batch.

One `generate` call per step over all N = B*K sequences, prompt i repeated in rows i*K ...
i*K+K-1 (advantages.py's layout), left-padded so every completion starts at one column.

The completion mask (N, C) is 1 on the tokens the policy chose, up to *and including* the
first EOS it sampled, and 0 after it: built from the first EOS's position, never from pad
ids (where the pad token is the EOS, masking pad ids would drop the sampled EOS from the
loss, and the policy would never learn when to stop).

Multi-turn episodes (`sample_episodes`, the tool task): a token the environment inserted (a
`<tool_response>`) is attended to (completion_attn) but never trained on (completion_mask 0).
"""
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

import lora
import mismatch
import shared_prefix
import tool_env
import truncation
from logprobs import Tokens, completion_logprobs, left_pad, pad


@dataclass
class Knobs:
    """Sampling: the temperature rollouts, scoring and evaluation share, and the longest completion."""
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature for rollouts and evaluation",
                                                      "min": 1e-3, "max": 1e3})    # logits / T overflow past it
    max_new_tokens: int = field(default=0, metadata={"help": "longest completion (tools: each turn); 0 = 24, or 64 "
                                "for a real model's tool turns (a tool call: ~40 of its tokens)", "min": 0})


@dataclass
class Models:
    """The policy, its tokenizer; the frozen reference, PPO's critic, a sampler not the policy, or None."""
    model: nn.Module
    tok: object
    ref: nn.Module | None = None              # with a KL term; under LoRA the policy itself (lora.py)
    value_head: nn.Module | None = None
    sampler: nn.Module | None = None


@dataclass
class Rows:
    """Some rows of a Rollout for one forward, every (n, C) tensor cut to the same columns."""
    tokens: Tokens
    mask: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    advantages: torch.Tensor | None
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    is_weight: torch.Tensor | None = None


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
    completion_attn: torch.Tensor | None = None  # (N, C) attention over the completion when it
                                                 # differs from the mask (environment tokens)
    share_prefix: bool = False      # forwards encode each distinct prompt once (shared_prefix.py)
    truncated: torch.Tensor | None = None    # (N,) bool: cut at the token limit, never ended (EOS / stop)
    rollout_logp: torch.Tensor | None = None  # (N, C) the sampler's own log-probs (mismatch.py)
    is_weight: torch.Tensor | None = None     # (N, C) the mismatch correction's weight (mismatch.weigh)
    kept: torch.Tensor | None = None          # (N, C, V) bool: the sampler's kept set (--mask-replay)

    def attention(self, idx=slice(None)) -> torch.Tensor:
        """(n, C) attention mask of the completion: every real token, policy's or not."""
        return (self.completion_mask if self.completion_attn is None else self.completion_attn)[idx]

    def sequence_advantages(self) -> torch.Tensor:
        """(N,) one advantage per rollout: GRPO's A_i, or PPO's mean over the rollout's policy tokens."""
        if self.advantages.dim() == 1:
            return self.advantages
        m = self.completion_mask
        return (self.advantages * m).sum(1) / m.sum(1).clamp_min(1)

    def tokens(self, idx=slice(None)) -> Tokens:
        """The rows idx as the four tensors of a forward (logprobs.completion_logprobs)."""
        return Tokens(self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx],
                      self.attention(idx), self.share_prefix, None if self.kept is None else self.kept[idx])

    def rows(self, idx, trim: bool = False) -> Rows:
        """The rows idx for one forward of the update. trim (--fast) drops the columns that are
        padding in every row: the leading prompt padding and everything after the longest
        completion. Causal attention leaves the kept tokens' log-probs unchanged."""
        p_ids, p_mask, attn = self.prompt_ids[idx], self.prompt_mask[idx], self.attention(idx)
        cols = slice(None)
        if trim:
            start = int((p_mask.sum(0) == 0).sum())        # left padding: the all-pad columns lead
            p_ids, p_mask = p_ids[:, start:], p_mask[:, start:]
            cols = slice(0, int(attn.sum(1).max()))

        def cut(t):                                                    # (N, C) -> (n, kept C)
            return None if t is None else t[idx][:, cols]
        adv = self.advantages[idx] if self.advantages.dim() == 1 else cut(self.advantages)
        return Rows(Tokens(p_ids, p_mask, self.completion_ids[idx][:, cols], attn[:, cols], self.share_prefix,
                           cut(self.kept)),
                    cut(self.completion_mask), cut(self.old_logp), cut(self.ref_logp), adv,
                    cut(self.old_values), cut(self.returns), cut(self.is_weight))


def completion_mask(completion_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(N, C) long: 1 up to and including each row's first EOS, 0 after it (all ones with no EOS)."""
    is_eos = (completion_ids == eos_id).long()                      # (N, C)
    eos_before = is_eos.cumsum(1) - is_eos                          # EOS strictly before t
    return (eos_before == 0).long()                                 # (N, C)


# ---- the prompt the model sees ----

def natural(text: str) -> str:
    """A task's word-level text as a person writes it: 'Problem ( code ) .' -> 'Problem (code).'"""
    return re.sub(r"\( ", "(", re.sub(r" ([).,:;?!])", r"\1", text))


def format_prompt(tok, text: str, system: str) -> str:
    """With a chat template (a real instruct model): the task's system prompt, then the text in
    natural spelling as the user's message. The tiny model's word-level tokenizer: the text."""
    if not getattr(tok, "chat_template", None):
        return text
    messages = [{"role": "system", "content": system}, {"role": "user", "content": natural(text)}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- sampling from exactly the distribution we score ----

def plain_sampling(tok, temperature: float, max_new_tokens: int, top_p: float = 1.0, top_k: int = 0,
                   **extra) -> GenerationConfig:
    """Sampling from softmax(logits / temperature), truncated only by top_p / top_k (truncation.py;
    by default not at all): every other processor of `generate` neutral (no min-p, repetition
    penalty, banned words, forced tokens), so the log-probs we store are those of the distribution
    sampled. extra: the end tokens, stop strings, cache implementation."""
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=None,
                            typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
                            encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
                            bad_words_ids=None, suppress_tokens=None, begin_suppress_tokens=None,
                            forced_bos_token_id=None, forced_eos_token_id=None, sequence_bias=None,
                            guidance_scale=None, exponential_decay_length_penalty=None, min_length=0,
                            min_new_tokens=None, renormalize_logits=False, num_beams=1,
                            max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **extra)


class NonFiniteLogits(RuntimeError):
    """NaN/inf logits: nothing can be sampled; train.py counts a non-finite step, never a crash."""


class FiniteGuard(LogitsProcessor):
    """Notes NaN/+inf logits (on the device: no sync per token) and samples them as 0: on a GPU
    torch.multinomial's device-side assert on them kills the CUDA context. Finite logits pass."""

    def __init__(self):
        self.flags = []

    def __call__(self, input_ids, scores):
        self.flags.append(torch.isnan(scores).any() | torch.isposinf(scores).any())
        return scores.nan_to_num(nan=0.0, posinf=0.0, neginf=float("-inf"))


def generate(model, gen_config: GenerationConfig, share: bool = False, **inputs) -> torch.Tensor:
    """model.generate under gen_config alone. generate fills every option left unset from the
    model's own saved generation_config (Qwen2.5-Instruct's repetition_penalty 1.05, another
    model's min_p or no_repeat_ngram_size), so that config is swapped out for the call. share: a
    prompt repeated over rows is encoded once first (shared_prefix.prefill); the same tokens come
    out. NaN/inf logits raise NonFiniteLogits once generate is done (FiniteGuard)."""
    saved, guard = model.generation_config, FiniteGuard()
    model.generation_config = gen_config
    try:
        cache = shared_prefix.prefill(model, inputs["input_ids"], inputs["attention_mask"]) if share else None
        if cache is not None:
            inputs["past_key_values"] = cache
        out = model.generate(**inputs, generation_config=gen_config, logits_processor=LogitsProcessorList([guard]))
        if guard.flags and torch.stack(guard.flags).any():
            raise NonFiniteLogits("non-finite logits while sampling (NaN or inf in the policy's logits)")
        return out
    finally:
        model.generation_config = saved


@torch.no_grad()
def sample(models: Models, prompt_texts: list, k: int, sampling, record_old_logp: bool = True) -> Rollout:
    """Generate k completions a prompt, recorded with their log-probs (and a value head's values, from
    the same forward). record_old_logp=False skips that forward when nothing needs it (evaluation;
    --fast). sampling.static_cache: a static KV cache, compiled on a GPU, prompts padded to 64s."""
    model, tok = models.model, models.tok
    texts = [t for t in prompt_texts for _ in range(k)]            # N = B*K, grouped
    device = next(model.parameters()).device
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False,
              pad_to_multiple_of=64 if sampling.static_cache else None).to(device)
    model.eval()                    # generate stops once every sequence sampled EOS
    record = dict(output_scores=True, return_dict_in_generate=True) if sampling.rollout_logprobs or sampling.mask_replay else {}
    gen = plain_sampling(tok, sampling.rollout_temperature or sampling.temperature, sampling.max_new_tokens,
                         top_p=sampling.top_p, top_k=sampling.top_k, eos_token_id=tok.eos_token_id, **record,
                         cache_implementation="static" if sampling.static_cache else None)
    out = generate(models.sampler or model, gen, sampling.shared_prefix and not sampling.static_cache, **enc)
    out, scores = (out.sequences, out.scores) if record else (out, None)           # (N, P+C)
    p_len = enc["input_ids"].shape[1]
    completion_ids = out[:, p_len:]                                 # (N, C)
    mask = completion_mask(completion_ids, tok.eos_token_id)        # (N, C)
    completion_ids = completion_ids.masked_fill(mask == 0, tok.pad_token_id)
    decoded = tok.batch_decode(completion_ids, skip_special_tokens=True)
    batch = Rollout(enc["input_ids"], enc["attention_mask"], completion_ids, mask,
                    None, None, [d.strip() for d in decoded], share_prefix=sampling.shared_prefix,
                    truncated=~(out[:, p_len:] == tok.eos_token_id).any(1))    # no EOS: cut at the limit
    if sampling.rollout_logprobs:                                   # the sampler's log-probs (mismatch.py)
        batch.rollout_logp = mismatch.sampler_logprobs(scores, completion_ids) * mask
    batch.kept = truncation.recorded(scores, mask) if sampling.mask_replay else None   # its kept sets
    return score_logprobs(batch, models, sampling, record_old_logp)


@torch.no_grad()
def score_logprobs(batch: Rollout, models: Models, sampling, record_old_logp: bool = True) -> Rollout:
    """Fill a sampled batch's old_logp (unless record_old_logp=False and no value head), old_values
    and ref_logp (None without a reference), sampling.forward_batch sequences a forward; the batch."""
    n = len(batch.completion_ids)
    size = sampling.forward_batch or n

    def forward(m, critic=None):     # (N, C) log-probs [and the critic's (N, C) values], by chunks
        logps, values = [], []
        for i in range(0, n, size):
            tokens = batch.tokens(slice(i, i + size))
            logp, _, *h = completion_logprobs(m, tokens, sampling.temperature, return_hidden=critic is not None)
            logps.append(logp)                                                         # h: [(n, C, H)] or []
            if critic is not None:       # a value head reads h; a critic of its own runs its trunk here
                values.append(critic.values(tokens, h[0]))
        return torch.cat(logps), (torch.cat(values) if critic is not None else None)
    if record_old_logp or models.value_head is not None:
        batch.old_logp, batch.old_values = forward(models.model, models.value_head)       # (N, C) each
    if models.ref is not None:                 # LoRA: the reference is the policy, its adapters off
        with lora.adapters_off(models.ref):
            batch.ref_logp = forward(models.ref)[0]                                      # (N, C)
    return batch


@torch.no_grad()
def sample_episodes(models: Models, prompt_texts: list, envs: list, k: int, sampling,
                    record_old_logp: bool = True):
    """Play N = B*K multi-turn episodes, envs[i] (reset) playing row i (grouped as in `sample`):
    each turn every unfinished episode generates until a stop string, the environment answers,
    and the reply joins its context. Returns the Rollout (completion = every turn and reply after
    the prompt; mask 1 only on the policy's tokens), each episode's infos and policy turns' texts."""
    model, tok = models.model, models.tok
    stop_strings = envs[0].stop_strings
    device = next(model.parameters()).device
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in prompt_texts for _ in range(k)]
    n = len(prompts)
    ids, policy_mask = [[] for _ in range(n)], [[] for _ in range(n)]    # the completion so far
    infos, turns = [[] for _ in range(n)], [[] for _ in range(n)]
    stops = tool_env.stop_ids(tok, stop_strings)
    ends = dict(eos_token_id=[tok.eos_token_id, *stops]) if stops else \
        dict(eos_token_id=tok.eos_token_id, stop_strings=list(stop_strings))
    gen = plain_sampling(tok, sampling.temperature, sampling.max_new_tokens, **ends)
    active = list(range(n))
    cut, ends_at = [False] * n, set(stops or []) | {tok.eos_token_id}   # an episode with a turn cut at the limit
    model.eval()
    while active:
        ctx, attn = left_pad([prompts[i] + ids[i] for i in active], tok.pad_token_id, device)
        out = generate(model, gen, sampling.shared_prefix, input_ids=ctx, attention_mask=attn,
                       tokenizer=tok)[:, ctx.shape[1]:]                        # (n_active, T)
        still = []
        for row, i in enumerate(active):
            new = tool_env.turn_tokens(out[row].tolist(), tok, stops, stop_strings)
            cut[i] = cut[i] or len(new) == out.shape[1] == sampling.max_new_tokens and new[-1] not in ends_at
            text = tok.decode(new, skip_special_tokens=True).strip()
            observation, done, info = envs[i].step(text)
            ids[i] += new
            policy_mask[i] += [1] * len(new)                 # the policy chose these: trained on
            infos[i].append(info)
            turns[i].append(text)
            if not done:
                reply = tok(" " + observation + " ", add_special_tokens=False)["input_ids"]
                ids[i] += reply
                policy_mask[i] += [0] * len(reply)           # the environment's: never trained on
                still.append(i)
        active = still
    completion_ids = pad(ids, tok.pad_token_id, device=device)                 # (N, C)
    mask = pad(policy_mask, 0, device=device)                                  # (N, C)
    attn = pad([[1] * len(r) for r in ids], 0, device=device)                  # (N, C)
    p_ids, p_attn = left_pad(prompts, tok.pad_token_id, device)
    texts = [tok.decode(r, skip_special_tokens=True).strip() for r in ids]
    batch = Rollout(p_ids, p_attn, completion_ids, mask, None, None, texts, completion_attn=attn,
                    share_prefix=sampling.shared_prefix, truncated=torch.tensor(cut, device=device))
    return score_logprobs(batch, models, sampling, record_old_logp), infos, turns
