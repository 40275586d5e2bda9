"""grpo.py against references: naive log-softmax, hand arithmetic, the full-batch gradient."""
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import grpo
from rollout import Rollout, completion_mask


def test_token_logprobs_equal_naive_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=gen) * 4
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    naive = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(grpo.token_logprobs(logits, ids), naive)


def test_chunked_logprobs_and_entropy_equal_one_pass(monkeypatch):
    """A large vocabulary is handled a few rows at a time; the result is the same."""
    model = tiny_model()
    batch = synthetic_batch(model)
    args = (model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    whole = grpo.completion_logprobs(*args, with_entropy=True)
    monkeypatch.setattr(grpo, "LOGITS_CHUNK_ELEMENTS", 3 * 6 * 20)          # 3 rows per chunk
    assert grpo.rows_per_chunk(6, 20) == 3
    chunked = grpo.completion_logprobs(*args, with_entropy=True)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b)
    logits = torch.randn(5, 6, 20, dtype=torch.bfloat16)
    ids = torch.randint(0, 20, (5, 6))
    naive = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(grpo.token_logprobs(logits, ids), naive)       # bf16 in, fp32 out


def test_token_entropy_equals_definition():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=gen)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(grpo.token_entropy(logits), -(p * p.log()).sum(-1))


@pytest.mark.parametrize("ratio, adv, expected, clipped", [
    (1.1, 2.0, 1.1 * 2.0, False),        # inside the range: plain ratio * A
    (1.5, 2.0, 1.2 * 2.0, True),         # A > 0, ratio above 1+eps: capped at 1.2 * A
    (0.5, 2.0, 0.5 * 2.0, False),        # A > 0, ratio below 1-eps: min keeps the smaller 0.5*A
    (0.5, -2.0, 0.8 * -2.0, True),       # A < 0, ratio below 1-eps: floored at 0.8 * A
    (1.5, -2.0, 1.5 * -2.0, False),      # A < 0, ratio above 1+eps: min keeps the worse 1.5*A
])
def test_clipped_surrogate_against_hand_arithmetic(ratio, adv, expected, clipped):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio))
    s, c = grpo.clipped_surrogate(logp, old, torch.tensor([adv]), 0.2, 0.2)
    assert s.item() == pytest.approx(expected, rel=1e-6)
    assert c.item() == clipped


def test_decoupled_upper_clip():
    logp = torch.full((1, 1), math.log(1.25))
    s, _ = grpo.clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.28)
    assert s.item() == pytest.approx(1.25)      # inside DAPO's wider upper bound


def test_aggregations_against_hand_arithmetic():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert grpo.aggregate(loss, mask, "token-mean", 2, 4, 3).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert grpo.aggregate(loss, mask, "seq-mean-token-mean", 2, 4, 3).item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(loss, mask, "constant", 2, 4, 3).item() == pytest.approx(10 / (2 * 3))
    with pytest.raises(ValueError, match="unknown aggregation"):
        grpo.aggregate(loss, mask, "bogus", 2, 4, 3)


# ---- a tiny model and a synthetic batch ----

def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return Qwen2ForCausalLM(cfg)


def synthetic_batch(model, n=8, p_len=4, c_len=6, eos=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, 20, (n, p_len), generator=gen)
    prompt_mask = torch.ones(n, p_len, dtype=torch.long)
    prompt_mask[: n // 2, :2] = 0                                 # left padding on half the rows
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(2, 20, (n, c_len), generator=gen)
    completion_ids[::3, 3] = eos                                  # some rows end early
    mask = completion_mask(completion_ids, eos)
    with torch.no_grad():
        old, _ = grpo.completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask)
    adv = torch.randn(n, generator=gen)
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, old + 0.05 * torch.randn(n, c_len, generator=gen),
                   old - 0.1, texts=[""] * n, advantages=adv)


@pytest.mark.parametrize("agg", grpo.AGGREGATIONS)
def test_micro_batched_gradient_equals_full_batch_gradient(agg):
    grads = []
    for micro in (8, 2):
        model = tiny_model()
        batch = synthetic_batch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)          # lr 0: keep the weights
        grpo.update(model, opt, batch, epochs=1, mini_batch=8, micro_batch=micro, clip_eps=0.2,
                    clip_eps_high=0.2, beta=0.1, kl_estimator="k3", kl_in_loss=True,
                    entropy_coef=0.01, agg=agg, max_len=6, max_grad_norm=float("inf"),
                    temperature=1.0, seed=0)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().sum() > 0


def test_left_padded_logprobs_equal_each_sequence_alone():
    # Positions count from the first real token, so left padding changes nothing.
    model = tiny_model(1)
    batch = synthetic_batch(model)
    with torch.no_grad():
        together, _ = grpo.completion_logprobs(model, batch.prompt_ids, batch.prompt_mask,
                                               batch.completion_ids, batch.completion_mask)
        for i in range(4):                                        # the left-padded rows
            real = batch.prompt_mask[i].bool()
            alone, _ = grpo.completion_logprobs(model, batch.prompt_ids[i:i + 1, real],
                                                batch.prompt_mask[i:i + 1, real],
                                                batch.completion_ids[i:i + 1],
                                                batch.completion_mask[i:i + 1])
            m = batch.completion_mask[i].bool()
            torch.testing.assert_close(together[i, m], alone[0, m], rtol=1e-5, atol=1e-5)


def test_non_finite_loss_skips_the_step_and_leaves_weights_unchanged():
    model = tiny_model()
    batch = synthetic_batch(model)
    batch.advantages[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = grpo.update(model, opt, batch, epochs=1, mini_batch=8, micro_batch=8, clip_eps=0.2,
                        clip_eps_high=0.2, beta=0.0, kl_estimator="k3", kl_in_loss=True,
                        entropy_coef=0.0, agg="token-mean", max_len=6, max_grad_norm=1.0,
                        temperature=1.0, seed=0)
    assert stats["skipped_nonfinite"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_completion_mask_keeps_the_sampled_eos_and_drops_what_follows():
    eos = 1
    ids = torch.tensor([[5, 6, eos, 0, 0], [5, eos, eos, eos, eos], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, eos), expected)
    # pad == eos (many real tokenizers): the second row is what generate returns then, and
    # the first EOS still counts as the policy's own token.


# ---- optimize(): shuffling, steps taken, the grad-norm metric ----

def recording_loss(scales, seen, nan_rows=()):
    """loss_fn for optimize(): a loss on one parameter w whose gradient is sum(scales[idx]) * 1,
    NaN for a mini-batch holding a row of nan_rows; records the rows of each call."""
    w = torch.zeros(4, requires_grad=True)

    def loss_fn(idx, mb_seqs, mb_tokens):
        seen.append(idx.tolist())
        loss = (scales[idx].sum() * w).sum()
        if set(idx.tolist()) & set(nan_rows):
            loss = loss * float("nan")
        return loss, {"approx_kl": 0.0}
    return w, loss_fn


def test_mini_batches_are_shuffled_every_epoch_even_with_one_epoch():
    scales = torch.arange(1.0, 9.0)
    seen = []
    w, loss_fn = recording_loss(scales, seen)
    grpo.optimize([w], torch.optim.SGD([w], lr=0.0), torch.ones(8, 3), loss_fn, epochs=2, mini_batch=2,
                  micro_batch=2, max_grad_norm=float("inf"), seed=7)
    # the reference (CleanRL): a fresh permutation of the N rows per epoch, cut into mini-batches
    gen = torch.Generator().manual_seed(7)
    expected = [perm[i:i + 2].tolist() for perm in (torch.randperm(8, generator=gen) for _ in range(2))
                for i in range(0, 8, 2)]
    assert seen == expected
    seen.clear()
    w, loss_fn = recording_loss(scales, seen)
    grpo.optimize([w], torch.optim.SGD([w], lr=0.0), torch.ones(8, 3), loss_fn, epochs=1, mini_batch=2,
                  micro_batch=2, max_grad_norm=float("inf"), seed=7)
    assert seen == expected[:4] and seen != [[0, 1], [2, 3], [4, 5], [6, 7]]    # epochs=1 shuffles too


def test_grad_norm_is_the_mean_over_mini_batches_and_steps_taken_counts_applied_steps():
    scales = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    seen = []
    w, loss_fn = recording_loss(scales, seen, nan_rows=(0,))
    stats = grpo.optimize([w], torch.optim.SGD([w], lr=0.0), torch.ones(8, 3), loss_fn, epochs=1,
                          mini_batch=2, micro_batch=2, max_grad_norm=float("inf"), seed=0)
    # a mini-batch's gradient is sum(scales[idx]) * ones(4): its norm is 2 * sum(scales[idx])
    norms = [2 * scales[idx].sum().item() for idx in seen]
    finite = [v for idx, v in zip(seen, norms) if 0 not in idx]
    assert stats["steps_taken"] == 3 and stats["skipped_nonfinite"] == 1
    assert stats["nonfinite"] == ["loss", "grad_norm"]
    assert len(finite) == 3
    assert math.isnan(stats["grad_norm"])            # a NaN mini-batch shows in the mean, not hidden
    seen.clear()
    w, loss_fn = recording_loss(scales, seen)
    stats = grpo.optimize([w], torch.optim.SGD([w], lr=0.0), torch.ones(8, 3), loss_fn, epochs=1,
                          mini_batch=2, micro_batch=2, max_grad_norm=float("inf"), seed=0)
    expected = sum(2 * scales[idx].sum().item() for idx in seen) / 4
    assert stats["grad_norm"] == pytest.approx(expected) and stats["steps_taken"] == 4


# ---- dropout is off for RL ----

def gpt2_model(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=20, n_positions=32, n_embd=16, n_layer=2, n_head=2)   # dropouts 0.1
    return GPT2LMHeadModel(cfg)


def first_epoch_ratio_stats(model):
    """One GRPO update whose old log-probs were recorded in eval mode, as sampling records them."""
    batch = synthetic_batch(model)
    model.eval()
    with torch.no_grad():
        batch.old_logp, _ = grpo.completion_logprobs(model, batch.prompt_ids, batch.prompt_mask,
                                                     batch.completion_ids, batch.completion_mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return grpo.update(model, opt, batch, epochs=1, mini_batch=8, micro_batch=8, clip_eps=0.2,
                       clip_eps_high=0.2, beta=0.0, kl_estimator="k3", kl_in_loss=True, entropy_coef=0.0,
                       agg="token-mean", max_len=6, max_grad_norm=float("inf"), temperature=1.0, seed=0)


def test_with_dropout_disabled_the_first_epoch_ratio_is_exactly_one():
    import policy
    noisy = first_epoch_ratio_stats(gpt2_model())
    assert noisy["approx_kl"] > 1e-4                      # GPT-2's 0.1 dropouts: ratio != 1 at once
    model = gpt2_model()
    assert policy.disable_dropout(model) > 0
    exact = first_epoch_ratio_stats(model)
    assert exact["approx_kl"] == 0.0 and exact["clip_frac"] == 0.0
    assert policy.disable_dropout(model) == 0             # nothing left on
    # Qwen2 keeps its attention dropout in a float attribute, not an nn.Dropout
    cfg = tiny_model().config
    cfg.attention_dropout = 0.5
    qwen = Qwen2ForCausalLM(cfg)
    assert policy.disable_dropout(qwen) == 1 and qwen.config.attention_dropout == 0.0
    assert first_epoch_ratio_stats(qwen)["approx_kl"] == 0.0


# ---- the model's own logit post-processing, and the head in float32 ----

def post_processing_models():
    """Tiny models whose forward transforms the head's logits: Gemma 2 (soft-capping at 5),
    Cohere (scale 0.25), Granite (divide by 4)."""
    from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                              GraniteConfig, GraniteForCausalLM)
    shape = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return {"gemma2": Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8, final_logit_softcapping=5.0)),
            "cohere": CohereForCausalLM(CohereConfig(**shape, logit_scale=0.25)),
            "granite": GraniteForCausalLM(GraniteConfig(**shape, logits_scaling=4.0))}


@pytest.mark.parametrize("name", ["gemma2", "cohere", "granite"])
def test_completion_logprobs_apply_the_model_s_own_logit_post_processing(name):
    model = post_processing_models()[name].eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)          # logits large enough to be capped
        ids = torch.randint(0, 40, (3, 10), generator=torch.Generator().manual_seed(1))
        attn = torch.ones_like(ids)
        ours, _ = grpo.completion_logprobs(model, ids[:, :4], attn[:, :4], ids[:, 4:], attn[:, 4:],
                                           temperature=0.7)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, 3:-1] / 0.7   # the reference
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 4:, None]).squeeze(-1)
        plain = torch.log_softmax(model.get_output_embeddings()(
            model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, 3:-1]) / 0.7, -1)
        plain = plain.gather(-1, ids[:, 4:, None]).squeeze(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert (plain - ref).abs().max() > 0.1                    # skipping the post-processing is far off
    assert grpo.check_logprobs(model) < 1e-5


def test_a_model_with_an_unknown_logit_transform_is_detected_and_refused(tmp_path, monkeypatch):
    import policy
    model = tiny_model()
    real_forward = model.forward

    def forward(*args, **kwargs):                          # a transform after the head, unknown to us
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out
    model.forward = forward
    assert grpo.check_logprobs(model) > 1e-2
    folder = tmp_path / "gemma2"                               # a saved model we would get wrong
    gemma = post_processing_models()["gemma2"]
    with torch.no_grad():
        gemma.get_output_embeddings().weight.mul_(20)          # logits the soft-cap changes
    gemma.save_pretrained(folder)
    policy.build_tokenizer(["a", "b"]).save_pretrained(folder)
    policy.local_policy(None, str(folder), 0, 1e-3, 4, 0)     # reproduced: loads
    monkeypatch.setattr(grpo, "head_logits", lambda m, h: m.get_output_embeddings()(h).float())
    with pytest.raises(policy.ModelError, match="transforms its logits"):
        policy.local_policy(None, str(folder), 0, 1e-3, 4, 0)


def test_under_bf16_autocast_the_heads_run_in_float32_on_a_large_vocabulary():
    import ppo
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=0,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()                   # no layers: the head is all that autocast touches
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
        ids = torch.randint(0, 32000, (4, 16), generator=torch.Generator().manual_seed(0))
        attn = torch.ones_like(ids)
        args = (model, ids[:, :8], attn[:, :8], ids[:, 8:], attn[:, 8:])
        fp32, _ = grpo.completion_logprobs(*args)
        head = ppo.ValueHead(64)
        torch.nn.init.normal_(head.linear.weight)
        h = torch.randn(4, 8, 64)
        v32 = head(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp, _ = grpo.completion_logprobs(*args)
            v_amp = head(h)
            bf16_head = model.get_output_embeddings()(torch.randn(2, 3, 64)).dtype
    assert bf16_head == torch.bfloat16                     # autocast really is on for a plain head call
    assert (amp - fp32).abs().max() < 1e-5                 # a bf16 head was off by ~0.03 here
    assert v_amp.dtype == torch.float32 and torch.allclose(v_amp, v32, atol=1e-6)


# ---- sampling draws from the distribution we score ----

def test_rollouts_sample_from_the_distribution_their_logprobs_score(monkeypatch):
    """A model whose saved generation config sets a repetition penalty, min-p, typical-p, top-k,
    top-p, banned n-grams and suppressed tokens: generate's processed scores (the distribution it
    sampled from) still equal our log-probs of softmax(logits / T)."""
    import rollout
    import policy
    from transformers import GenerationConfig
    tok = policy.build_tokenizer([f"w{i}" for i in range(17)])
    model = tiny_model(2).eval()
    model.generation_config = GenerationConfig(repetition_penalty=1.3, min_p=0.2, typical_p=0.5,
                                               top_k=5, top_p=0.6, no_repeat_ngram_size=2,
                                               suppress_tokens=[7, 8], min_new_tokens=4, eos_token_id=1)
    scores = []
    real = model.generate

    def recording(**kw):
        out = real(**kw, output_scores=True, return_dict_in_generate=True)
        scores.append(torch.stack(out.scores, 1))                             # (N, C, V) processed
        return out.sequences
    monkeypatch.setattr(model, "generate", recording)
    batch = rollout.sample(model, tok, ["w1 w2 w3", "w4 w5"], 3, max_new_tokens=8, temperature=0.7)
    processed = torch.log_softmax(scores[0].float(), -1)
    c = batch.completion_ids.shape[1]
    theirs = processed[:, :c].gather(-1, batch.completion_ids[..., None]).squeeze(-1)   # (N, C)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.old_logp[m], theirs[m], rtol=1e-4, atol=1e-4)
    assert model.generation_config.repetition_penalty == 1.3          # the model's own config is back
