"""logprobs.py against references: naive log-softmax, the model's own forward, one sequence
at a time, generate's own sampling distribution."""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import logprobs
from conftest import synthetic_batch, tiny_model
from logprobs import Tokens
import warm_start


@pytest.mark.lesson
def test_token_logprobs_equal_naive_log_softmax_gather():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=gen) * 4
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    naive = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs.token_logprobs(logits, ids), naive)


@pytest.mark.lesson
def test_chunked_logprobs_and_entropy_equal_one_pass(monkeypatch):
    """A large vocabulary is handled a few rows at a time; the result is the same."""
    model = tiny_model()
    batch = synthetic_batch(model)
    args = (model, batch.tokens())
    whole = logprobs.completion_logprobs(*args, with_entropy=True)
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_ELEMENTS", 3 * 6 * 20)          # 3 rows per chunk
    assert logprobs.rows_per_chunk(6, 20) == 3
    chunked = logprobs.completion_logprobs(*args, with_entropy=True)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b)
    logits = torch.randn(5, 6, 20, dtype=torch.bfloat16)
    ids = torch.randint(0, 20, (5, 6))
    naive = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs.token_logprobs(logits, ids), naive)       # bf16 in, fp32 out


@pytest.mark.lesson
def test_token_entropy_equals_definition():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=gen)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(logprobs.token_entropy(logits), -(p * p.log()).sum(-1))


@pytest.mark.lesson
def test_left_padded_logprobs_equal_each_sequence_alone():
    # Positions count from the first real token, so left padding changes nothing.
    model = tiny_model(1)
    batch = synthetic_batch(model)
    with torch.no_grad():
        together, _ = logprobs.completion_logprobs(model, batch.tokens())
        for i in range(4):                                        # the left-padded rows
            real = batch.prompt_mask[i].bool()
            alone, _ = logprobs.completion_logprobs(model, Tokens(batch.prompt_ids[i:i + 1, real],
                                                                  batch.prompt_mask[i:i + 1, real],
                                                                  batch.completion_ids[i:i + 1],
                                                                  batch.completion_mask[i:i + 1]))
            m = batch.completion_mask[i].bool()
            torch.testing.assert_close(together[i, m], alone[0, m], rtol=1e-5, atol=1e-5)


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
        ours, _ = logprobs.completion_logprobs(model, Tokens(ids[:, :4], attn[:, :4], ids[:, 4:], attn[:, 4:]),
                                               temperature=0.7)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, 3:-1] / 0.7   # the reference
        ref = torch.log_softmax(logits, -1).gather(-1, ids[:, 4:, None]).squeeze(-1)
        plain = torch.log_softmax(model.get_output_embeddings()(
            model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, 3:-1]) / 0.7, -1)
        plain = plain.gather(-1, ids[:, 4:, None]).squeeze(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert (plain - ref).abs().max() > 0.1                    # skipping the post-processing is far off
    assert logprobs.check_logprobs(model) < 1e-5


def test_a_model_with_an_unknown_logit_transform_is_detected_and_refused(tmp_path, monkeypatch):
    from models import policy
    model = tiny_model()
    real_forward = model.forward

    def forward(*args, **kwargs):                          # a transform after the head, unknown to us
        out = real_forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out
    model.forward = forward
    assert logprobs.check_logprobs(model) > 1e-2
    folder = tmp_path / "gemma2"                               # a saved model we would get wrong
    gemma = post_processing_models()["gemma2"]
    with torch.no_grad():
        gemma.get_output_embeddings().weight.mul_(20)          # logits the soft-cap changes
    gemma.save_pretrained(folder)
    policy.build_tokenizer(["a", "b"]).save_pretrained(folder)
    policy.real_policy(None, folder, warm_start.WarmStart(steps=0), tmp_path / "cache")     # reproduced: loads
    monkeypatch.setattr(logprobs, "head_logits", lambda m, h: m.get_output_embeddings()(h).float())
    with pytest.raises(policy.ModelError, match="transforms its logits"):
        policy.real_policy(None, folder, warm_start.WarmStart(steps=0), tmp_path / "cache")


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
        args = (model, Tokens(ids[:, :8], attn[:, :8], ids[:, 8:], attn[:, 8:]))
        fp32, _ = logprobs.completion_logprobs(*args)
        head = ppo.ValueHead(64)
        torch.nn.init.normal_(head.linear.weight)
        h = torch.randn(4, 8, 64)
        v32 = head(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp, _ = logprobs.completion_logprobs(*args)
            v_amp = head(h)
            bf16_head = model.get_output_embeddings()(torch.randn(2, 3, 64)).dtype
    assert bf16_head == torch.bfloat16                     # autocast really is on for a plain head call
    assert (amp - fp32).abs().max() < 1e-5                 # a bf16 head was off by ~0.03 here
    assert v_amp.dtype == torch.float32 and torch.allclose(v_amp, v32, atol=1e-6)


# ---- sampling draws from the distribution we score ----

@pytest.mark.lesson
def test_rollouts_sample_from_the_distribution_their_logprobs_score(monkeypatch):
    """A model whose saved generation config sets a repetition penalty, min-p, typical-p, top-k,
    top-p, banned n-grams and suppressed tokens: generate's processed scores (the distribution it
    sampled from) still equal our log-probs of softmax(logits / T)."""
    from models import policy
    import rollout
    import tasks
    from transformers import GenerationConfig
    tok = policy.build_tokenizer([f"w{i}" for i in range(17)])           # tiny_model's vocabulary
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
    batch = rollout.sample(rollout.Models(model, tok), ["w1 w2 w3", "w4 w5"], 3,
                           tasks.Sampling(max_new_tokens=8, temperature=0.7))
    processed = torch.log_softmax(scores[0].float(), -1)
    c = batch.completion_ids.shape[1]
    theirs = processed[:, :c].gather(-1, batch.completion_ids[..., None]).squeeze(-1)   # (N, C)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.old_logp[m], theirs[m], rtol=1e-4, atol=1e-4)
    assert model.generation_config.repetition_penalty == 1.3          # the model's own config is back
