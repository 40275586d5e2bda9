"""shared_prefix.py against the plain forward: the same log-probs, entropies, loss and gradient
of every parameter (to 1e-5 relative), with left-padded prompts of different lengths,
multi-turn tool episodes, micro-batches, PPO's critic; the same 20-step run; and a model whose
cache cannot be shared runs the plain forward and says so.

On SmolLM2 itself: tests/test_real_model.py (test_the_shared_prefix_forward_is_exact_on_smollm2).
"""
import dataclasses
import json

import pytest
import torch

import grpo
import logprobs
import shared_prefix
import update
from conftest import quick, synthetic_batch, tiny_model


def grouped_batch(model, b=3, k=4, seed=0):
    """b prompts of different lengths (left-padded) x k samples each, ends at different tokens."""
    one = synthetic_batch(model, n=b, p_len=6, c_len=7, seed=seed)
    one.prompt_mask[0, :3] = 0                          # three prompt lengths: 3, 4, 6 tokens
    one.prompt_ids = one.prompt_ids.masked_fill(one.prompt_mask == 0, 0)
    batch = synthetic_batch(model, n=b * k, p_len=6, c_len=7, seed=seed + 1)
    batch.prompt_ids = one.prompt_ids.repeat_interleave(k, 0)              # (b*k, P), grouped
    batch.prompt_mask = one.prompt_mask.repeat_interleave(k, 0)
    with torch.no_grad():
        batch.old_logp, _ = logprobs.completion_logprobs(model, batch.tokens())
    batch.ref_logp = batch.old_logp - 0.1
    return batch


def loss_and_grads(model, batch, share: bool, micro: int = 0, k: int = 4):
    """GRPO's update loss, its log-probs and entropies, and every parameter's gradient, with
    the forward shared or plain (one optimizer step's worth, not taken)."""
    batch.share_prefix = share
    model.zero_grad()
    hp = grpo.HyperParams(k=k, beta=0.05, entropy_coef=0.01, mini_batch=len(batch.texts),
                          micro_batch=micro or len(batch.texts), max_len=7)
    scorer = logprobs.Scorer(model)
    mb = next(update.minibatches(batch, hp, torch.Generator().manual_seed(0)))
    total, logps, entropies = 0.0, [], []
    for idx in mb.micro_batches:
        rows = batch.rows(idx)
        logp, entropy, values = scorer(rows.tokens, 1.0, True)
        loss, _ = grpo.loss(logp, entropy, values, rows, mb, hp)
        loss.backward()
        total += loss.item()
        logps.append(logp.detach())
        entropies.append(entropy.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, torch.cat(logps), torch.cat(entropies), grads


def assert_same(plain, shared, mask, tol=1e-5):
    loss, logp, entropy, grads = plain
    loss2, logp2, entropy2, grads2 = shared
    m = mask.bool()
    assert loss2 == pytest.approx(loss, rel=tol)
    torch.testing.assert_close(logp2[m], logp[m], rtol=tol, atol=tol)
    torch.testing.assert_close(entropy2[m], entropy[m], rtol=tol, atol=tol)
    assert grads.keys() == grads2.keys()
    for name in grads:
        rel = ((grads2[name] - grads[name]).norm() / grads[name].norm().clamp_min(1e-12)).item()
        assert rel < tol, f"{name}: gradient off by {rel:.2g} relative"


@pytest.mark.lesson
def test_each_prompt_encoded_once_gives_the_plain_forwards_logprobs_loss_and_gradients():
    """The lesson: K sequences that share a prompt need its keys and values once; copying them
    to the K rows (and adding the K rows' gradients back) changes no number."""
    model = tiny_model(3)
    batch = grouped_batch(model)
    rows, inverse = shared_prefix.distinct_prompts(batch.prompt_ids, batch.prompt_mask)
    assert len(rows) == 3 and all(len(set(inverse[g * 4:g * 4 + 4].tolist())) == 1 for g in range(3))
    assert shared_prefix.worth_it(batch.tokens()._replace(share=True))
    assert not shared_prefix.worth_it(batch.tokens())                    # share off: plain
    assert_same(loss_and_grads(model, batch, False), loss_and_grads(model, batch, True), batch.completion_mask)


def system_prompt_batch(model, b=3, k=4, start=shared_prefix.MIN_COMMON_START, seed=0):
    """b prompts that all begin with the same `start` tokens (a system prompt), then rests of
    2, 4 and 7 tokens (left-padded), x k samples each."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randint(2, 20, (start,), generator=gen)
    rests = [torch.randint(2, 20, (n,), generator=gen) for n in (2, 4, 7)[:b]]
    p_len = start + max(len(r) for r in rests)
    prompt_ids = torch.zeros(b, p_len, dtype=torch.long)
    prompt_mask = torch.zeros(b, p_len, dtype=torch.long)
    for i, rest in enumerate(rests):
        row = torch.cat([common, rest])
        prompt_ids[i, p_len - len(row):], prompt_mask[i, p_len - len(row):] = row, 1
    batch = synthetic_batch(model, n=b * k, p_len=p_len, c_len=7, seed=seed + 1)
    batch.prompt_ids, batch.prompt_mask = prompt_ids.repeat_interleave(k, 0), prompt_mask.repeat_interleave(k, 0)
    with torch.no_grad():
        batch.old_logp, _ = logprobs.completion_logprobs(model, batch.tokens())
    batch.ref_logp = batch.old_logp - 0.1
    return batch


@pytest.mark.lesson
def test_a_system_prompt_every_prompt_shares_is_encoded_once_per_batch():
    """One level more: the start every prompt of the batch shares (the system prompt and chat
    template: 77 of SmolLM2's ~90 DSL prompt tokens) runs once, each prompt's rest once, each
    completion once; the cache's columns become [start | padding | rest], the numbers stay the
    plain forward's. Two layers, so the second reads the first's outputs through the copies."""
    from transformers import Qwen2ForCausalLM
    from models import policy
    torch.manual_seed(5)
    tok = policy.build_tokenizer([f"w{i}" for i in range(17)])
    model = Qwen2ForCausalLM(policy.tiny_config(tok, 16, 2, 32, num_attention_heads=2, num_key_value_heads=1))
    batch = system_prompt_batch(model)
    rows, _ = shared_prefix.distinct_prompts(batch.prompt_ids, batch.prompt_mask)
    ids, mask = batch.prompt_ids[rows], batch.prompt_mask[rows]
    assert shared_prefix.common_start(ids, mask) == shared_prefix.MIN_COMMON_START
    calls = []
    model.model.register_forward_hook(lambda m, args, kw, out: calls.append(kw["input_ids"].shape), with_kwargs=True)
    shared = loss_and_grads(model, batch, True)
    assert calls[0] == (1, shared_prefix.MIN_COMMON_START), "the common start once"
    assert calls[1] == (3, ids.shape[1] - shared_prefix.MIN_COMMON_START) and calls[2] == (12, 7)
    assert_same(loss_and_grads(model, batch, False), shared, batch.completion_mask)
    # a start one token short of MIN_COMMON_START: two levels, the same numbers
    short = system_prompt_batch(model, start=shared_prefix.MIN_COMMON_START - 1)
    calls.clear()
    shared = loss_and_grads(model, short, True)
    assert calls[0][0] == 3, "each prompt whole, once"
    assert_same(loss_and_grads(model, short, False), shared, short.completion_mask)


def test_common_start_by_hand():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 9], [0, 5, 6, 7, 8, 2]])
    mask = (ids != 0).long()
    assert shared_prefix.common_start(ids, mask) == 3                    # 5 6 7
    assert shared_prefix.common_start(ids[:1], mask[:1]) == 3           # one row: all but its last token
    assert shared_prefix.common_start(ids[[0, 0]], mask[[0, 0]]) == 3
    other = torch.tensor([[0, 0, 4, 6, 7, 8], [5, 6, 7, 9, 9, 9]])
    assert shared_prefix.common_start(other, (other != 0).long()) == 0


@pytest.mark.lesson
def test_micro_batches_of_mixed_prompts_share_what_they_can():
    """The update shuffles rows into micro-batches: a micro-batch holds some rows of some
    groups (one row of a prompt shares nothing, two share); the sums come out the same."""
    model = tiny_model(4)
    batch = grouped_batch(model, seed=5)
    assert_same(loss_and_grads(model, batch, False, micro=5), loss_and_grads(model, batch, True, micro=5),
                batch.completion_mask)


def test_tool_episodes_with_environment_tokens_inside_the_completion():
    """A multi-turn episode's completion holds the environment's replies (attention 1, mask 0):
    shared, the policy's tokens get the plain forward's log-probs and gradients."""
    model = tiny_model(5)
    batch = grouped_batch(model, seed=7)
    batch.completion_attn = torch.ones_like(batch.completion_mask)
    batch.completion_mask = batch.completion_mask.clone()
    batch.completion_mask[:, 2:4] = 0                                  # the environment's reply
    with torch.no_grad():
        batch.old_logp, _ = logprobs.completion_logprobs(model, batch.tokens())
    batch.ref_logp = batch.old_logp - 0.1
    assert_same(loss_and_grads(model, batch, False), loss_and_grads(model, batch, True), batch.completion_mask)


def test_ppo_critic_of_its_own_reads_the_same_values_shared():
    import ppo
    model = tiny_model(6)
    batch = grouped_batch(model, seed=9)
    critic = ppo.Critic(model)
    plain = critic.values(batch.tokens())
    batch.share_prefix = True
    torch.testing.assert_close(critic.values(batch.tokens()), plain, rtol=1e-5, atol=1e-6)


def ignore_the_cache(trunk) -> None:
    """A trunk that ignores past_key_values: its completions never see their prompt, so a
    shared forward through it would be wrong."""
    forward = trunk.forward
    trunk.forward = lambda past_key_values=None, **kw: forward(**kw)


def test_a_model_whose_cache_cannot_be_shared_is_found_and_runs_plain(tmp_path, monkeypatch, capsys):
    model = tiny_model(7)
    assert logprobs.check_shared_prefix(model) < 1e-4
    broken = tiny_model(7)
    ignore_the_cache(broken.model)
    assert logprobs.check_shared_prefix(broken) > 1e-3, "a prefix the completions cannot see is a mismatch"
    # train.py: the check fails -> one line, and the run is the plain forward's
    from running import config
    import train
    monkeypatch.setattr(logprobs, "check_shared_prefix", lambda model: float("inf"))
    argv = quick(tmp_path, "broken", "--seed", "2")
    argv.remove("--quiet")
    train.train(config.parse_config(argv))
    err = capsys.readouterr().err
    assert err.count("shared prefix: off") == 1 and "cannot be shared over rows" in err
    train.train(plain_forward(config.parse_config(quick(tmp_path, "plain", "--seed", "2"))))
    assert metrics(tmp_path / "broken") == metrics(tmp_path / "plain"), "the plain forward, number for number"


def plain_forward(cfg):
    """cfg with the plain forward: every sequence encodes its own prompt (no_shared_prefix, a
    field Python sets, not a flag)."""
    return dataclasses.replace(cfg, no_shared_prefix=True)


def metrics(path):
    rows = [json.loads(line) for line in open(path / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


def test_twenty_grpo_steps_shared_give_the_plain_runs_metrics(tmp_path):
    """The whole loop: 20 steps with the shared forward write the metrics of 20 steps without
    it, every number to 1e-4 relative (the same tokens sampled, the same updates)."""
    from running import config
    import train
    flags = ["--steps", "20", "--eval-every", "10", "--device", "cpu"]          # float32 (on a GPU: bf16)
    train.train(config.parse_config(quick(tmp_path, "shared", *flags)))
    train.train(plain_forward(config.parse_config(quick(tmp_path, "plain", *flags))))
    shared, plain = metrics(tmp_path / "shared"), metrics(tmp_path / "plain")
    assert len(shared) == len(plain) == 21
    for a, b in zip(shared, plain):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), f"step {a['step']}: {key}"
            else:
                assert a[key] == b[key], f"step {a['step']}: {key}"


@pytest.mark.lesson
def test_generate_with_each_prompt_prefilled_once_samples_the_same_tokens():
    """generate's prompt work, once per distinct prompt (shared_prefix.prefill): with the same
    seed, the same completions as K separate prefills, left padding included."""
    import rollout
    import tasks
    from models import policy
    model = tiny_model(8)
    tok = policy.build_tokenizer([f"w{i}" for i in range(17)])
    prompts = [{"text": "w1 w2 w3"}, {"text": "w4 w5 w6 w7 w8"}, {"text": "w9"}]
    out = {}
    for share in (False, True):
        torch.manual_seed(0)
        batch = rollout.sample(rollout.Models(model, tok), [p["text"] for p in prompts], 4,
                               tasks.Sampling(max_new_tokens=8, shared_prefix=share))
        out[share] = batch
    assert torch.equal(out[True].completion_ids, out[False].completion_ids)
    torch.testing.assert_close(out[True].old_logp, out[False].old_logp, rtol=1e-5, atol=1e-6)
    cache = shared_prefix.prefill(model, out[True].prompt_ids, out[True].prompt_mask)
    assert cache.get_seq_length() == out[True].prompt_ids.shape[1] - 1 and cache.layers[0].keys.shape[0] == 12
    assert shared_prefix.prefill(model, out[True].prompt_ids[::4], out[True].prompt_mask[::4]) is None


def test_the_fast_paths_length_sort_keeps_a_groups_rows_together_when_they_share():
    """--fast sorts a mini-batch by length before cutting micro-batches; with the shared
    prefix on, a group's rows stay side by side (sorted by the group's longest), so each
    micro-batch still encodes a prompt once."""
    mb = torch.tensor([5, 0, 3, 7, 2, 6, 1, 4])
    lengths = torch.tensor([3, 9, 2, 4, 5, 5, 1, 8])                       # groups of 4: rows 0-3, 4-7
    order = mb[torch.argsort(update.length_key(mb, lengths, 4), descending=True, stable=True)]
    assert order.tolist() == [0, 3, 2, 1, 5, 7, 6, 4], "group 0 (longest 9) first, then group 1"
    plain = mb[torch.argsort(update.length_key(mb, lengths, 0), descending=True, stable=True)]
    assert plain.tolist() == [1, 7, 5, 4, 3, 0, 2, 6], "without sharing: by length alone"
