"""The tool task's difficulty knob and report 000's short-to-long curriculum.

A task of difficulty d asks about d benchmarks and is right only when its answer reports every
one's setting and value (tool_env.py); --curriculum trains from 1 up to d in equal phases
(tool_env.difficulty_at); the warm start can show the longer tasks (--sft-difficulty).
"""
import json
import random

import pytest

from running import config
import tasks
from models import policy
import rewards
from tasks import tool_task
import train
from conftest import quick
from tool_env import KNOWLEDGE_BASE, ToolEnv, answer_pairs, difficulty_at


def call(bench: str) -> str:
    return tool_task.call_text("query_knowledge_base", {"topic": bench})


def episode(d: int, seed: int = 0, max_turns: int = 3) -> ToolEnv:
    env = ToolEnv(max_turns=max_turns)
    env.reset(seed=seed, difficulty=d)
    return env


@pytest.mark.parametrize("text, pairs", [
    ("vm.swappiness = 10", [("vm.swappiness", "10")]),
    (" vm.swappiness=10 vm.dirty_ratio = 40 ", [("vm.swappiness", "10"), ("vm.dirty_ratio", "40")]),
    ("vm.swappiness=10vm.dirty_ratio=40", [("vm.swappiness", "10"), ("vm.dirty_ratio", "40")]),
    ("vm.swappiness = ten", None), ("vm.swappiness", None), ("", None), ("= 10", None),
    ("vm.swappiness = 10 and more", None), ("VM.SWAPPINESS = 10", None),
])
def test_an_answer_reads_as_its_setting_value_pairs_or_none(text, pairs):
    assert answer_pairs(text) == pairs


def test_difficulty_one_asks_what_the_task_always_asked():
    for seed in range(300):                    # the benchmark rng.choice drew before difficulty
        env = episode(1, seed)
        assert env.asked == (random.Random(seed).choice(tuple(KNOWLEDGE_BASE)),)
        assert env.reset(seed=seed) == (f"Which kernel setting does the {env.benchmark} benchmark depend on, and "
                                        f"what value is recommended ? Use the tools , then answer as "
                                        f"<answer> setting = value </answer>")


@pytest.mark.parametrize("d", [1, 2, 3])
def test_a_task_of_difficulty_d_is_right_only_with_all_d_pairs_in_any_order(d):
    for seed in range(20):
        env = episode(d, seed)
        assert len(set(env.asked)) == d and all(f"the {b} benchmark" in env.reset(seed, d) for b in env.asked)
        pairs = env.solutions
        for bench in env.asked:                             # one lookup per benchmark
            obs, done, info = env.step(call(bench))
            assert not done and info["correct_call"] and f"recommended value {env.kb[bench][1]}" in obs
        _, done, info = env.step(tool_task.answer_text(pairs[::-1]))
        assert done and info["correct"]
        if d > 1:
            for answer in (pairs[:-1], pairs + pairs[:1]):   # one pair short; one pair twice
                env = episode(d, seed)
                assert not env.step(tool_task.answer_text(answer))[2]["correct"]


@pytest.mark.parametrize("d, max_turns", [(1, 3), (2, 3), (3, 3), (3, 1)])
def test_the_turn_limit_grows_by_one_per_benchmark_beyond_the_first(d, max_turns):
    env = episode(d, max_turns=max_turns)
    done, turns = False, 0
    while not done:
        _, done, info = env.step(call("gpu"))              # an empty result: never an answer
        turns += 1
    assert turns == max_turns + d - 1 and info["failure"] in ("turn_limit", "empty_result")


def test_an_unsupported_difficulty_is_refused_by_the_environment():
    with pytest.raises(ValueError):
        ToolEnv().reset(seed=0, difficulty=4)
    with pytest.raises(ValueError):
        ToolEnv(benchmarks=("cpu",)).reset(seed=0, difficulty=2)


def test_the_curriculum_runs_in_equal_phases_from_one_up():
    for total, top in [(100, 3), (7, 3), (10, 2), (3, 3), (150, 2)]:
        levels = [difficulty_at(s, total, top) for s in range(1, total + 1)]
        assert levels[0] == 1 and levels[-1] == top and levels == sorted(levels)
        counts = [levels.count(d) for d in range(1, top + 1)]
        assert max(counts) - min(counts) <= 1, counts          # equal phases, up to one step
    assert [difficulty_at(s, 100, 3) for s in (1, 34, 35, 67, 68, 100)] == [1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("d", [1, 2, 3])
def test_a_right_demonstration_of_each_difficulty_is_right_in_the_environment(d):
    for seed in range(10):
        prompt = tool_task.prompts("train", d)[seed]
        segments = tool_task.answer(prompt)
        env = episode(d, prompt["seed"])
        infos = [env.step(text)[2] for text, trained in segments if trained]
        assert segments[0][0] == prompt["text"] and rewards.sparse_reward(infos) == 1.0
        assert sum(i["tool"] is not None for i in infos) == d


def test_the_warm_start_shows_each_difficulty_at_its_share_and_stays_within_the_turn_limit():
    rng = random.Random(0)
    shares = tool_task.warmstart_difficulties(3)
    assert shares == {1: 0.5, 2: 0.25, 3: 0.25} and tool_task.warmstart_difficulties(1) == {1: 1.0}
    seen = {1: 0, 2: 0, 3: 0}
    for segments in tool_task.warmstart_batch(rng, 2000, difficulty=3):
        d = segments[0][0].count("Which kernel setting")
        seen[d] += 1
        trained = [t for t, on in segments if on]
        assert "<answer>" in trained[-1] and len(trained) <= 3 + d - 1    # the answer fits in the limit
        assert sum("analyze_config_impact" in t for t in trained) <= 1
    for d, share in shares.items():
        assert seen[d] / 2000 == pytest.approx(share, abs=0.04)


def test_longer_demonstrations_are_right_less_often():
    rng, right = random.Random(1), {}
    for d in (1, 2, 3):
        hits = 0
        for _ in range(1500):
            seed = rng.choice(tool_task.TRAIN_SEEDS)
            segments = tool_task.demonstration(seed, rng, difficulty=d)
            env = episode(d, seed)
            hits += rewards.answered_correctly([env.step(t)[2] for t, on in segments if on])
        right[d] = hits / 1500
    assert right[1] > 2 * right[2] > 4 * right[3] > 0, right


def test_the_vocabulary_reads_every_difficulty_and_the_one_benchmark_cache_key_is_unchanged():
    tok = policy.build_tokenizer(tool_task.vocabulary())
    for segments in tool_task.warmstart_batch(random.Random(2), 300, difficulty=3):
        for text, _ in segments:
            assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"], text
    settings = dict(hidden=64, layers=2)
    assert policy.cache_key(settings, tool_task) == policy.cache_key(settings, tool_task, 1)
    assert "difficulties" not in tool_task.fingerprint(1)
    assert policy.cache_key(settings, tool_task, 3) != policy.cache_key(settings, tool_task, 1)


def test_a_curriculum_run_trains_each_phase_at_its_difficulty_and_evaluates_the_long_task(tmp_path):
    argv = quick(tmp_path, "cur", "--task", "tools", "--reward", "sparse", "--difficulty", "3", "--curriculum",
                 "--steps", "6", "--eval-every", "3")
    cfg = config.parse_config(argv)
    assert cfg.sft_difficulty == 3
    train.train(cfg)
    rows = [json.loads(line) for line in open(tmp_path / "cur" / "metrics.jsonl")]
    assert [r["difficulty"] for r in rows[1:]] == [1, 1, 2, 2, 3, 3]
    train_records = [r for r in map(json.loads, open(tmp_path / "cur" / "samples.jsonl")) if r["split"] == "train"]
    assert len(train_records) == 6
    for record in train_records:
        asked = {s["prompt"].count("Which kernel setting") for s in record["samples"]}
        assert asked == {rows[record["step"]]["difficulty"]}, record["step"]
    prompts = tasks.prompts_of(tool_task, cfg)                 # held out: the long task only
    assert sorted(prompts["train"]) == [1, 2, 3]
    assert {p["difficulty"] for p in prompts["eval"] + prompts["nll"]} == {3}


@pytest.mark.parametrize("argv, flag", [
    (["--task", "tools", "--difficulty", "4"], "--difficulty"),
    (["--task", "tools", "--difficulty", "0"], "--difficulty"),
    (["--difficulty", "2"], "--difficulty"),                           # the dsl task has one
    (["--task", "tools", "--curriculum"], "--curriculum"),            # difficulty 1: nothing to move
    (["--task", "tools", "--difficulty", "3", "--curriculum", "--steps", "2"], "--curriculum"),
    (["--task", "tools", "--sft-difficulty", "4"], "--sft-difficulty"),
    (["--sft-difficulty", "2"], "--sft-difficulty"),
])
def test_bad_difficulty_flags_exit_2_naming_the_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_a_curriculum_resumed_with_more_steps_goes_on_and_never_steps_back(tmp_path):
    """Resumed with more --steps, the phases stretch: step 6 of 9 is difficulty 2 by
    the schedule, after the first run reached 3 at step 5. The schedule goes on from where the
    run is, it never hands the policy easier tasks again."""
    argv = quick(tmp_path, "cur", "--task", "tools", "--reward", "sparse", "--difficulty", "3", "--curriculum",
                 "--steps", "5", "--eval-every", "5", "--save-every", "5")
    train.train(config.parse_config(argv))
    train.train(config.parse_config(["--resume", str(tmp_path / "cur"), "--steps", "9", "--quiet"]))
    levels = [json.loads(line).get("difficulty") for line in open(tmp_path / "cur" / "metrics.jsonl")][1:]
    assert levels == [1, 1, 2, 2, 3, 3, 3, 3, 3], levels
