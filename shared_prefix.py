"""The shared-prefix forward: a group's K sequences share their whole prompt, so encode it once.

A GRPO step scores N = B*K sequences, prompt + completion, four or more times: the old
log-probs, the reference's, the update's forward and its backward. The K samples of a prompt
repeat that prompt K times, and with a real model the prompt is most of the sequence
(SmolLM2 on the DSL task: about 90 prompt tokens, at most 24 completion tokens), so most of
the work is the same prompt encoded K times (and `generate` encodes it K times more before it
samples: `prefill` below does that once too). Prefix Grouper (Liu et al. 2025, "Efficient GRPO
Training through Shared-Prefix Forward"; verl's `use_prefix_grouper`) removes it; this is the
same idea with a Hugging Face model's own KV cache:

    1. the distinct prompts of the rows, U of them:   (U, P)    (U = B when the rows are a batch)
    2. one forward over them, keeping their keys and values (past_key_values) with their graph
    3. those keys and values copied to the rows that share each prompt (index_select: (U,..) -> (n,..))
    4. one forward over the completions (n, C), attending to the copied prefix; positions
       continue after each row's prompt, as in one forward over prompt + completion

One level more (`encode_prompts`): the U prompts of a batch all start with the same system
prompt and chat template (73-77 of SmolLM2's ~90 DSL prompt tokens), so step 2 runs that start
once, copies its keys and values to the U rows, and runs each prompt's rest after it: S + U*R
tokens instead of U*P (B=4, K=4: the forward's ~740 tokens become ~520). It applies when a
forward holds several prompts (a micro-batch of several groups), from MIN_COMMON_START shared
tokens.

The log-probs are those of the plain forward: each completion token attends to the same keys
and values at the same positions; only the order of float additions differs (~1e-6 relative).
The gradient is the same too: index_select's backward adds the K rows' gradients into their
prompt's keys and values, which is what K copies of the prompt would each have received and
their shared weights summed. Cost: U*P + n*C tokens instead of n*(P + C) (B=4, K=4, 90 + 24
tokens: 744 instead of 1,824).

Why the KV cache and not a block attention mask (one row holding the prompt and the K
completions, each completion masked from the others, Prefix Grouper's own layout): the cache
needs nothing from the model but what `generate` already uses, keeps the (n, C) shapes every
other lesson reads, and works with left-padded prompts of different lengths. What it costs:
each completion still attends to all P prompt keys, and the prompt's keys are copied K times
(small: 2 x layers x P x kv heads x head size per row).

A model whose cache cannot be copied over rows this way (a recurrent state, a sliding window
that drops the prompt, a model that ignores past_key_values) would give wrong log-probs:
`logprobs.check_shared_prefix` measures it on random tokens when a model is loaded, and the run
falls back to the plain forward (running/session.py says so in one line). `python -m tools.bench --model
smollm2-135m` times both; `tests/test_shared_prefix.py` checks log-probs, entropies, the loss
and every gradient against the plain forward.
"""
import torch


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """The U distinct (ids, mask) prompt rows of n rows: (rows (U,), inverse (n,)) where
    rows[u] is one row holding prompt u and inverse[i] the prompt of row i."""
    key = torch.cat([prompt_ids, prompt_mask], dim=1)                       # (n, 2P)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)              # (n,) in 0..U-1
    rows = torch.empty(int(inverse.max()) + 1, dtype=torch.long, device=key.device)
    rows[inverse] = torch.arange(len(inverse), device=key.device)           # (U,) any row of each
    return rows, inverse


def hidden(trunk, tokens, positions: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The trunk's last hidden states at the C + 1 last positions, (n, C+1, H), as one forward
    over prompt + completion gives them, with each distinct prompt encoded once.

    tokens: logprobs.Tokens (prompt (n, P) left-padded, completion (n, C)); positions and
    attention: (n, P+C), the plain forward's (logprobs.completion_hidden computes them)."""
    p_len = tokens.prompt_ids.shape[1]
    rows, inverse = distinct_prompts(tokens.prompt_ids, tokens.prompt_mask)  # (U,), (n,)
    # 1-2. each distinct prompt once, its keys and values kept (with their graph)
    cache, cache_mask, last = encode_prompts(trunk, tokens.prompt_ids[rows], tokens.prompt_mask[rows],
                                             positions[rows, :p_len])      # U rows; (U, P); (U, 1, H)
    # 3. copied to the rows that share each prompt: (U, heads, P, d) -> (n, heads, P, d)
    cache.reorder_cache(inverse)
    # 4. the completions, attending to their prompt's copy; positions continue after it
    suffix = trunk(input_ids=tokens.completion_ids, attention_mask=torch.cat([cache_mask[inverse], attention[:, p_len:]], 1),
                   position_ids=positions[:, p_len:], past_key_values=cache, use_cache=True)
    # the prompt's last hidden state predicts the first completion token
    return torch.cat([last[inverse], suffix.last_hidden_state], dim=1)     # (n, C+1, H)


MIN_COMMON_START = 16   # first tokens every distinct prompt shares, below which a third forward does not pay


def encode_prompts(trunk, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
    """U distinct prompts (U, P), left-padded, through the trunk: (their KV cache, (U, P) the
    mask of its columns, (U, 1, H) each prompt's last hidden state). When they all start with
    the same MIN_COMMON_START or more tokens (a system prompt and chat template every prompt of
    a batch shares), that start is encoded once and copied to the U rows, and each row's rest
    runs after it: the cache's columns are then [start | padding | rest] instead of
    [padding | start | rest], each token at its own position, the same keys and values."""
    s = common_start(ids, mask)
    if len(ids) < 2 or s < MIN_COMMON_START:
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        return out.past_key_values, mask, out.last_hidden_state[:, -1:]
    p_len, lengths = ids.shape[1], mask.sum(1, keepdim=True)                  # (U, 1)
    first = int(p_len - lengths[0])                                           # row 0's first real column
    start = trunk(input_ids=ids[:1, first:first + s], position_ids=positions[:1, first:first + s],
                  attention_mask=mask[:1, first:first + s], use_cache=True)
    cache = start.past_key_values
    cache.reorder_cache(torch.zeros(len(ids), dtype=torch.long, device=ids.device))   # 1 row -> U rows
    # each row without its start: its padding, then its rest (left-padded to P - s columns)
    j = torch.arange(p_len - s, device=ids.device).expand(len(ids), -1)       # (U, P-s)
    cols = j + s * (j >= p_len - lengths)                                      # skip the s start columns
    rest_mask = mask.gather(1, cols)
    cache_mask = torch.cat([mask.new_ones(len(ids), s), rest_mask], 1)        # (U, P)
    rest = trunk(input_ids=ids.gather(1, cols), attention_mask=cache_mask,
                 position_ids=positions.gather(1, cols), past_key_values=cache, use_cache=True)
    return rest.past_key_values, cache_mask, rest.last_hidden_state[:, -1:]


def common_start(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """How many first real tokens every row of a left-padded (U, P) batch has in common, at
    most the shortest row's length - 1 (each row keeps a token of its own to run)."""
    lengths = mask.sum(1)                                                     # (U,)
    most = int(lengths.min()) - 1
    if most <= 0:
        return 0
    first = ids.shape[1] - lengths                                            # (U,)
    starts = ids.gather(1, first.unsqueeze(1) + torch.arange(most, device=ids.device))  # (U, most)
    same = (starts == starts[:1]).all(0)                                      # (most,)
    return int(same.long().cumprod(0).sum())


@torch.no_grad()
def prefill(model, ids: torch.Tensor, attention: torch.Tensor):
    """`generate`'s prompt work done once per distinct prompt: a KV cache holding, for every
    row, its prompt but the last token (generate runs that one itself and samples from its
    logits), or None when no two rows share a prompt. ids, attention: (n, P) left-padded.
    Positions as generate counts them (it gives padding position 1; padding is masked)."""
    rows, inverse = distinct_prompts(ids, attention)                        # (U,), (n,)
    if len(rows) == len(ids):
        return None
    mask = attention[rows, :-1]                                             # (U, P-1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    cache = model(input_ids=ids[rows, :-1], attention_mask=mask, position_ids=positions,
                  use_cache=True).past_key_values
    cache.reorder_cache(inverse)                                            # U rows -> n rows
    return cache


def worth_it(tokens) -> bool:
    """Whether any two rows share a prompt (with none, the plain forward is the same work, once)."""
    if not tokens.share or len(tokens.prompt_ids) < 2:
        return False
    rows, inverse = distinct_prompts(tokens.prompt_ids, tokens.prompt_mask)
    return len(rows) < len(inverse)
