"""The tool-calling task of report 000 for train.py: `python train.py --task tools --reward shaped`.

An episode is a ToolEnv episode (tool_env.py): the prompt names a benchmark; the policy
looks up the setting and value with `query_knowledge_base`, may check them with
`analyze_config_impact`, and answers `<answer> setting = value </answer>`, within
max_turns turns. rewards.py scores the whole episode (--reward sparse | shaped | format).
With --difficulty d the prompt names d benchmarks and the answer must hold all d pairs
(report 000's long ground truth); --curriculum moves d from 1 up over the run
(tool_env.difficulty_at).

The warm-start mix (what the tiny model imitates before RL) is our choice; report 000 gives
only its starting point, a mean reward of about -0.5 under +-1 (a quarter of the episodes
right). In WARMSTART_MIX below a quarter of the demonstrations look the answer up and copy
it (a few guesses are right by chance): the format is learned, and tools are called some of
the time, imperfectly.

The same interface as workflow_task.py: tasks.Task.
"""
import json
import random

import torch

import rewards
import rollout
# MAX_DIFFICULTY (tasks.Task): --difficulty's largest, the benchmarks an episode may ask about
from tool_env import FAILURES, KNOWLEDGE_BASE, MAX_DIFFICULTY, ToolEnv

NAME = "tools"
SYSTEM_PROMPT = (
    "You tune Linux kernels. Think in <think>...</think>, then either call one tool as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or give the final answer as '
    "<answer> setting = value </answer>. Tools: query_knowledge_base(topic: str) returns the "
    "setting a benchmark depends on and its recommended value; analyze_config_impact(param: "
    "str, value: str) says whether a value is recommended.")
MAX_POSITIONS = 384          # prompt + up to 5 turns and 4 tool responses (difficulty 3)
HEADLINE = ("accuracy", "tool_success_rate")
FORMAT_KEY = "wellformed_rate"
GROUP_KEY = "benchmark"      # results broken down by the prompt's benchmark (lab.compare.by_group)
RATES = ("accuracy", "answer_rate", "tool_calls", "tool_success_rate", "wellformed_rate", "turns",
         *(f"failure/{kind}" for kind in FAILURES))                     # the keys of rates()
ENDS_WITH_EOS = False        # an episode ends at </answer> (a stop string), not at EOS
TRAIN_SEEDS, EVAL_SEEDS = range(512), range(1_000_000, 1_000_032)
ALL_VALUES = sorted({v for _, values in KNOWLEDGE_BASE.values() for v in values}, key=int)

# What a warm-start demonstration does (shares sum to 1). Only "lookup" and "lookup_check"
# end right; "guess" is right when the guessed value happens to be the recommended one.
WARMSTART_MIX = {
    "lookup": 0.20,          # query the right benchmark, copy setting and value into the answer
    "lookup_check": 0.05,    # the same, with analyze_config_impact between query and answer
    "wrong_topic": 0.15,     # query another benchmark and copy its (wrong) answer
    "malformed": 0.15,       # a call with one closing brace missing, then a guess
    "unknown_tool": 0.10,    # a call to a tool that does not exist, then a guess
    "guess": 0.35,           # answer at once: the right setting, a value from ALL_VALUES
}


# ---- texts (every word below is in the tiny tokenizer's vocabulary) ----

def call_text(name: str, args: dict, broken: bool = False) -> str:
    """A policy turn calling a tool. JSON tokens are separated by spaces as json.dumps
    writes them; broken drops the last closing brace (malformed JSON)."""
    body = json.dumps({"name": name, "arguments": args})
    return f"<think> use a tool </think> <tool_call> {body[:-1] if broken else body} </tool_call>"


def answer_text(pairs: list) -> str:
    """The final turn: every (setting, value) pair, in order, in one answer."""
    body = " ".join(f"{param} = {value}" for param, value in pairs)
    return f"<think> answer now </think> <answer> {body} </answer>"


def draw(rng: random.Random, shares: dict):
    return rng.choices(list(shares), weights=list(shares.values()))[0]


def demonstration(seed: int, rng: random.Random, kind: str = "", difficulty: int = 1) -> list[tuple[str, bool]]:
    """One warm-start episode about `difficulty` benchmarks as (text, trained) segments,
    played against a real ToolEnv so the tool responses are exactly those the environment
    gives. Each benchmark gets its own kind from WARMSTART_MIX (or `kind` for all) and its
    calls in turn; one answer with every pair ends it. The turn limit leaves one spare turn,
    so at most one benchmark is looked up *and* checked (a second lookup_check is a lookup)."""
    env = ToolEnv()
    segments = [(env.reset(seed=seed, difficulty=difficulty), False)]
    kinds = [kind or draw(rng, WARMSTART_MIX) for _ in env.asked]
    checked = kinds.index("lookup_check") if "lookup_check" in kinds else None
    kinds = ["lookup" if k == "lookup_check" and i != checked else k for i, k in enumerate(kinds)]
    others = [b for b in KNOWLEDGE_BASE if b not in env.asked]
    turns, pairs = [], []
    for bench, kind in zip(env.asked, kinds):
        # Every draw is made whatever the kind, so one-benchmark demonstrations are exactly
        # those made before difficulty existed (and the cached warm start with them).
        other, wrong_value, tool, unknown_value, guess_value = (
            rng.choice(others), rng.choice(ALL_VALUES), rng.choice(["search", "lookup"]),
            rng.choice(ALL_VALUES), rng.choice(ALL_VALUES))
        param, value = env.kb[bench]
        query = call_text("query_knowledge_base", {"topic": bench})
        calls, pair = {
            "lookup": ([query], (param, value)),
            "lookup_check": ([query, call_text("analyze_config_impact", {"param": param, "value": value})],
                             (param, value)),
            "wrong_topic": ([call_text("query_knowledge_base", {"topic": other})], env.kb[other]),
            "malformed": ([call_text("query_knowledge_base", {"topic": bench}, broken=True)],
                          (param, wrong_value)),
            "unknown_tool": ([call_text(tool, {"topic": bench})], (param, unknown_value)),
            "guess": ([], (param, guess_value)),
        }[kind]
        turns += calls
        pairs.append(pair)
    for text in turns + [answer_text(pairs)]:
        observation, done, _ = env.step(text)
        segments.append((text, True))
        if not done:
            segments.append((" " + observation + " ", False))    # as rollout.py inserts it
    return segments


def warmstart_difficulties(top: int) -> dict:
    """How many benchmarks a warm-start demonstration asks about, up to `top` (--sft-difficulty):
    half of them one, the other half spread evenly over 2 .. top (our choice, like the mix)."""
    return {1: 1.0} if top == 1 else {1: 0.5, **{d: 0.5 / (top - 1) for d in range(2, top + 1)}}


def warmstart_batch(rng: random.Random, n: int, difficulty: int = 1) -> list[list[tuple[str, bool]]]:
    """n demonstrations of 1 .. `difficulty` benchmarks (warmstart_difficulties)."""
    shares, out = warmstart_difficulties(difficulty), []
    for _ in range(n):
        seed = rng.choice(TRAIN_SEEDS)
        out.append(demonstration(seed, rng, difficulty=draw(rng, shares) if difficulty > 1 else 1))
    return out


def answer(prompt: dict) -> list[tuple[str, bool]]:
    """A right episode for a prompt, as (text, trained) segments: look each benchmark up, then
    answer with what the tool said (the held-out answer NLL's text: warm_start.answer_nll)."""
    return demonstration(prompt["seed"], random.Random(0), kind="lookup", difficulty=prompt["difficulty"])


def vocabulary() -> list[str]:
    """Every word of the prompts, the demonstrations and the environment's responses."""
    env, texts = ToolEnv(), []
    for seed in range(200):                       # every benchmark, with several knowledge bases
        texts += [env.reset(seed=seed, difficulty=d) for d in range(1, MAX_DIFFICULTY + 1)]
    for bench, (param, _) in KNOWLEDGE_BASE.items():
        for value in ALL_VALUES:
            texts += [call_text("query_knowledge_base", {"topic": bench}),
                      call_text("query_knowledge_base", {"topic": bench}, broken=True),
                      call_text("analyze_config_impact", {"param": param, "value": value}),
                      answer_text([(param, value)]),
                      f"the {bench} benchmark depends on {param} , recommended value {value}",
                      f"{param} = {value} is not recommended , recommended value {value}"]
            texts += [call_text(t, {"topic": bench}) for t in ("search", "lookup")]
    texts += [f"<tool_response> error : {kind} </tool_response>" for kind in FAILURES]
    return sorted({w for t in texts for w in t.split()})


def fingerprint(difficulty: int = 1) -> dict:
    """What shapes a warm start of demonstrations up to `difficulty` benchmarks (the
    difficulties' shares only above 1, so the one-benchmark key is the one it always was)."""
    more = {"difficulties": warmstart_difficulties(difficulty)} if difficulty > 1 else {}
    return {"task": NAME, "vocab": vocabulary(), "mix": WARMSTART_MIX, **more,
            "kb": {b: [p, list(v)] for b, (p, v) in KNOWLEDGE_BASE.items()}}


def prompts(split: str, difficulty: int = 1) -> list[dict]:
    """Training or held-out episodes of a difficulty (benchmarks asked about): dicts with the
    env seed, the prompt text, its (first) benchmark and the difficulty."""
    seeds = TRAIN_SEEDS if split == "train" else EVAL_SEEDS
    out = []
    for s in seeds:
        env = ToolEnv()
        out.append({"seed": s, "text": env.reset(seed=s, difficulty=difficulty), "benchmark": env.benchmark,
                    "difficulty": difficulty})
    return out


# ---- rollouts and their scores (train.py) ----

def episode_reward(episode: list, turns: list, sampling) -> float:
    """The episode's reward under --reward (sampling: tasks.Sampling)."""
    if sampling.reward == "sparse":
        return rewards.sparse_reward(episode)
    if sampling.reward == "format":
        return rewards.format_reward(episode, turns)
    return rewards.shaped_reward(episode, process=sampling.process_reward, clip=sampling.reward_clip)


def sample(models, prompts: list, k: int, sampling, record_old_logp: bool = True):
    """K episodes per prompt (each of the K against its own ToolEnv with the prompt's seed),
    scored by --reward: (Rollout with rewards (N,), outcomes: (infos, turns) per episode).
    models: rollout.Models; sampling: tasks.Sampling."""
    envs = []
    for p in prompts:
        for _ in range(k):
            envs.append(ToolEnv(max_turns=sampling.max_turns))
            envs[-1].reset(seed=p["seed"], difficulty=p["difficulty"])
    texts = [rollout.format_prompt(models.tok, p["text"], SYSTEM_PROMPT) for p in prompts]
    batch, infos, turns = rollout.sample_episodes(models, texts, envs, k, sampling, record_old_logp)
    batch.rewards = torch.tensor([episode_reward(e, t, sampling) for e, t in zip(infos, turns)])  # (N,)
    return batch, list(zip(infos, turns))


def rates(outcomes: list) -> dict:
    """accuracy: episodes answered right; answer_rate: episodes with any answer;
    tool_calls: calls per episode; tool_success_rate: calls that returned a result / calls
    (0 without calls); wellformed_rate: episodes where no turn failed; failure/<kind>:
    turns that failed so, per episode."""
    episodes = [info for info, _ in outcomes]
    n = len(episodes)
    calls = sum(t["tool"] is not None or t["failure"] == "malformed_json" for e in episodes for t in e)
    successes = sum(t["tool_success"] for e in episodes for t in e)
    out = dict(accuracy=sum(rewards.answered_correctly(e) for e in episodes) / n,
               answer_rate=sum(any(t["answered"] for t in e) for e in episodes) / n,
               tool_calls=calls / n, tool_success_rate=successes / calls if calls else 0.0,
               wellformed_rate=sum(not any(t["failure"] for t in e) for e in episodes) / n,
               turns=sum(len(e) for e in episodes) / n)
    for kind in FAILURES:
        out[f"failure/{kind}"] = sum(t["failure"] == kind for e in episodes for t in e) / n
    return out


def describe(text: str, outcome) -> dict:
    """One episode for samples.jsonl: the whole transcript and each turn's failure."""
    episode, _ = outcome
    return dict(text=text, failures=[t["failure"] for t in episode],
                correct=rewards.answered_correctly(episode))
