"""The multi-turn rollout of the tool task: environment tokens are attended to, never trained on."""
import json
import random

import pytest
import torch
from transformers import Qwen2ForCausalLM

from running import config
import grpo
import surrogates
import logprobs
from models import policy
import ppo
import rollout
import tasks
from tasks import tool_task
import train
from logprobs import Tokens
import tool_env
from tool_env import STOP_STRINGS, ToolEnv
from conftest import WARM_STARTS


@pytest.fixture(scope="module")
def tiny():
    tok = policy.build_tokenizer(tool_task.vocabulary())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(policy.tiny_config(tok, 16, 1, tool_task.MAX_POSITIONS)).eval()
    return model, tok


def scripted_generate(tok, turns):
    """A stand-in for model.generate that writes the given turns, one per call, for every
    row, then pads as `generate` pads a finished row (the real forward passes still run)."""
    calls = iter(turns)

    def generate(input_ids, attention_mask, **kw):
        new = tok(next(calls), add_special_tokens=False)["input_ids"]
        new = new + [tok.pad_token_id] * 3                       # what follows a stop is dropped
        return torch.cat([input_ids, torch.tensor([new] * len(input_ids))], dim=1)
    return generate


def test_environment_tokens_get_mask_zero_and_attention_one(tiny, monkeypatch):
    model, tok = tiny
    env = ToolEnv()
    env.reset(seed=5)
    param, value = env.solution
    call = tool_task.call_text("query_knowledge_base", {"topic": env.benchmark})
    answer = tool_task.answer_text([(param, value)])
    monkeypatch.setattr(model, "generate", scripted_generate(tok, [call, answer]))
    envs = [ToolEnv() for _ in range(2)]
    for e in envs:
        e.reset(seed=5)
    batch, infos, turns = rollout.sample_episodes(rollout.Models(model, tok), [env.reset(seed=5)], envs, 2,
                                                  tasks.Sampling())
    assert turns[0] == [call, answer] and infos[0][-1]["correct"]
    words = batch.texts[0].split()
    start, end = words.index("<tool_response>"), words.index("</tool_response>")
    ids = batch.completion_ids[0]
    expected = torch.ones(len(words), dtype=torch.long)
    expected[start:end + 1] = 0                                   # the environment's reply
    assert torch.equal(batch.completion_mask[0, :len(words)], expected)
    assert batch.attention()[0, :len(words)].eq(1).all()          # ...which is still attended to
    assert tok.decode(ids[:len(words)]) == batch.texts[0]
    # The log-probs of the policy's tokens are those of one plain forward over the whole
    # unpadded episode: the reply is in their context.
    full = torch.cat([batch.prompt_ids[0], ids[:len(words)]]).unsqueeze(0)
    with torch.no_grad():
        logits = model(full).logits[0, -len(words) - 1:-1].float()
    naive = torch.log_softmax(logits, -1).gather(-1, ids[:len(words), None]).squeeze(-1)
    m = expected.bool()
    assert torch.allclose(batch.old_logp[0, :len(words)][m], naive[m], atol=1e-5)


def test_masked_environment_tokens_do_not_move_the_loss(tiny):
    """Changing the reward-free environment tokens' log-probs (via old_logp at mask-0
    positions) changes nothing: the loss only sums over the policy's tokens."""
    model, tok = tiny
    ids = torch.tensor([tok(tool_task.call_text("query_knowledge_base", {"topic": "cpu"})
                            + " <tool_response> error : empty_result </tool_response>",
                            add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    prompt = torch.tensor([tok("Use the tools", add_special_tokens=False)["input_ids"]])
    logp, _ = logprobs.completion_logprobs(model, Tokens(prompt, torch.ones_like(prompt), ids, torch.ones_like(ids)))
    surrogate = lambda old: grpo.aggregate(surrogates.ppo_clip(torch.exp(logp - old), torch.tensor([1.0]), 0.2, 0.2)[0],
                                           mask, "token-mean", 1, int(mask.sum()), 24)
    old = logp.detach().clone()
    other = old.clone()
    other[0, -5:] += 3.0
    assert surrogate(old).item() == surrogate(other).item()


def test_a_turn_ends_at_its_stop_token_and_drops_what_generate_padded(tiny):
    _, tok = tiny
    stops = tool_env.stop_ids(tok, STOP_STRINGS)
    assert stops is not None and len(stops) == 2
    turn = tok("<think> x </think> <answer> a = 1 </answer>", add_special_tokens=False)["input_ids"]
    assert tool_env.turn_tokens(turn + [tok.pad_token_id] * 4, tok, stops, STOP_STRINGS) == turn
    assert tool_env.turn_tokens(turn[:3], tok, stops, STOP_STRINGS) == turn[:3]     # cut by length


def test_the_vocabulary_reads_every_prompt_demonstration_and_response():
    tok = policy.build_tokenizer(tool_task.vocabulary())
    rng = random.Random(0)
    texts = [t for segs in tool_task.warmstart_batch(rng, 500) for t, _ in segs]
    for seed in range(50):                                  # every tool's responses
        env = ToolEnv(max_turns=5)
        env.reset(seed=seed)
        param, value = env.solution
        for text in [tool_task.call_text("query_knowledge_base", {"topic": env.benchmark}),
                     tool_task.call_text("analyze_config_impact", {"param": param, "value": "10"}),
                     tool_task.call_text("query_knowledge_base", {"topic": "gpu"})]:
            texts.append(env.step(text)[0])
    for text in texts:
        assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"], text


def test_warmstart_mix_calls_tools_some_of_the_time_imperfectly():
    rng = random.Random(1)
    episodes = [tool_task.demonstration(rng.randrange(512), rng) for _ in range(4000)]
    called = sum(any("<tool_call>" in t for t, trained in e if trained) for e in episodes) / 4000
    right = sum(any("recommended value" in t for t, trained in e if not trained) for e in episodes) / 4000
    mix = tool_task.WARMSTART_MIX
    assert called == pytest.approx(1 - mix["guess"], abs=0.03)
    assert right == pytest.approx(mix["lookup"] + mix["lookup_check"] + mix["wrong_topic"], abs=0.03)


def test_rates_count_calls_failures_and_answers():
    env = ToolEnv()
    env.reset(seed=0)
    param, value = env.solution
    good = [env.step(tool_task.call_text("query_knowledge_base", {"topic": env.benchmark}))[2],
            env.step(tool_task.answer_text([(param, value)]))[2]]
    env.reset(seed=0)
    bad = [env.step('<tool_call> {"name": </tool_call>')[2], env.step("nothing")[2],
           env.step("<answer> x = 1 </answer>")[2]]
    r = tool_task.rates([(good, []), (bad, [])])
    assert r["accuracy"] == 0.5 and r["answer_rate"] == 1.0 and r["tool_calls"] == 1.0
    assert r["tool_success_rate"] == 0.5 and r["wellformed_rate"] == 0.5
    assert r["failure/malformed_json"] == 0.5 and r["failure/no_action"] == 0.5
    c = config.Config(task="tools", reward="sparse")
    assert tool_task.episode_reward(good, [], c) == 1.0 and tool_task.episode_reward(bad, [], c) == -1.0


def test_train_runs_the_tool_task_and_logs_tool_metrics(tmp_path):
    argv = ["--task", "tools", "--reward", "sparse", "--steps", "2", "--batch", "2", "--k", "4",
            "--eval-every", "2", "--eval-samples", "1", "--sft-steps", "20", "--hidden", "16",
            "--layers", "1", "--quiet", "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / "run")]
    summary = train.train(config.parse_config(argv))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for key in ["accuracy", "tool_calls", "tool_success_rate", "failure/malformed_json",
                "frac_adv_negative", "wellformed_rate"]:
        assert key in rows[1], key
    assert "eval_accuracy" in rows[0] and 0 <= summary["eval_accuracy_end"] <= 1
    assert set(r["reward_mean"] for r in rows[1:]) <= set([x / 8 for x in range(-8, 9)])  # +-1 means


def test_ppo_runs_the_tool_task_with_the_reward_on_each_episode_s_last_policy_token(tmp_path):
    argv = ["--algo", "ppo", "--task", "tools", "--reward", "shaped", "--steps", "2", "--batch", "2",
            "--k", "4", "--eval-every", "2", "--eval-samples", "1", "--sft-steps", "20", "--hidden", "16",
            "--layers", "1", "--quiet", "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / "run")]
    c = config.parse_config(argv)
    summary = train.train(c)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(rows[s]["updated"] for s in (1, 2)) and summary["eval_value_rmse_end"] >= 0
    # The same warm start's own multi-turn rollouts: the reward sits on each row's last policy token.
    model, tok = policy.load(c, tool_task, "cpu", lambda s: None)
    torch.manual_seed(0)
    batch, _ = tool_task.sample(rollout.Models(model, tok), tool_task.prompts("train")[:2], 4, tasks.Sampling.of(c))
    m = batch.completion_mask
    turns = ((m[:, 1:] == 1) & (m[:, :-1] == 0)).sum(1) + m[:, 0]            # runs of 1s per row
    assert (turns > 1).any()                                                  # multi-turn rows exist
    r = ppo.token_rewards(batch.rewards, m)
    for i in range(len(m)):
        last = m[i].nonzero().max().item()
        assert r[i, last] == batch.rewards[i] and r[i].sum() == batch.rewards[i]
