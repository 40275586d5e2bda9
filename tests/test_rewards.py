"""The DSL parser and report 001's reward: every string gets a class, none crashes."""
import random

import pytest
import torch

import rewards
from tasks import workflow_task as task

pytestmark = pytest.mark.lesson          # every test here is a lesson: python -m pytest -m lesson

CODE_BEST = task.BEST_WORKFLOW["code"]


@pytest.mark.parametrize("text, expected", [
    (CODE_BEST, "best"),
    ("Custom  ->  Programmer ->Review ?Revise: done", "best"),       # spacing does not matter
    ("Custom -> Programmer -> Review -> Revise", "valid"),
    ("Programmer", "valid"),
    ("Review ? Revise : Custom", "valid"),                           # else may be an operator
    ("### Step 1 : Analyze the problem", "fallback"),
    ("### Step 1: Analyze the problem and identify the key requirements.", "fallback"),
    ("", "junk"),
    ("   ", "junk"),
    ("Custom ->", "junk"),                                           # dangling arrow
    ("-> Custom", "junk"),
    ("Custom Programmer", "junk"),                                   # no arrow
    ("Review ? Revise", "junk"),                                     # half a conditional
    ("Review ? Revise : done : done", "junk"),
    ("Review ? done : Revise", "junk"),                              # 'done' only as else
    ("custom -> programmer", "junk"),                                # operators are case-sensitive
    ("Custom -> Hacker", "junk"),                                    # unknown operator
    ("and Custom ->", "junk"),
    ("Custom -> Programmer ### Step 1", "junk"),                     # DSL then text
])
def test_classify(text, expected):
    assert rewards.classify(text, CODE_BEST) == expected


def test_reward_values_match_report_001():
    assert rewards.dsl_reward(CODE_BEST, CODE_BEST) == 1.0
    assert rewards.dsl_reward("Programmer", CODE_BEST) == 0.2
    assert rewards.dsl_reward("### Step 1 : Analyze", CODE_BEST) == 0.0
    assert rewards.dsl_reward("garbage", CODE_BEST) == 0.0


def test_best_depends_on_the_problem_type():
    for ptype, best in task.BEST_WORKFLOW.items():
        for other, other_best in task.BEST_WORKFLOW.items():
            expected = "best" if other == ptype else "valid"
            assert rewards.classify(other_best, best) == expected


def test_workflow_longer_than_max_steps_is_rejected():
    ok = " -> ".join(["Custom"] * rewards.MAX_STEPS)
    assert rewards.classify(ok, CODE_BEST) == "valid"
    assert rewards.classify(ok + " -> Custom", CODE_BEST) == "junk"
    assert rewards.classify("Custom -> " * 100_000 + "Custom", CODE_BEST) == "junk"


def test_parser_never_raises_on_any_string():
    rng = random.Random(0)
    pieces = ["Custom", "Review", "->", "?", ":", "done", "###", "Step", " ", "\n", "é", "\x00",
              "{", "}", "<tool_call>", "!!!!", "-", ">", "Revise"]
    for i in range(3000):
        if i % 3 == 0:
            text = bytes(rng.randrange(256) for _ in range(rng.randrange(60))).decode("latin-1")
        else:
            text = "".join(rng.choice(pieces) for _ in range(rng.randrange(30)))
        cls = rewards.classify(text, CODE_BEST)
        assert cls in rewards.DSL_REWARD
        assert rewards.dsl_reward(text, CODE_BEST) in (0.0, 0.2, 1.0)
    assert rewards.classify(None, CODE_BEST) == "junk"


def test_warm_start_mix_is_shaped_like_report_001():
    rng = random.Random(0)
    classes = [rewards.classify(task.warmstart_completion("code", rng), CODE_BEST) for _ in range(20000)]
    share = {c: classes.count(c) / len(classes) for c in rewards.DSL_REWARD}
    assert share["junk"] == 0                                     # every target parses or is fallback
    assert share["fallback"] == pytest.approx(1 - task.VALID_SHARE, abs=0.015)
    assert share["best"] == pytest.approx(task.VALID_SHARE * task.BEST_SHARE_OF_VALID, abs=0.015)


def test_held_out_prompts_are_unseen_in_training():
    train = {p["text"] for p in task.make_prompts("train")}
    held_out = {p["text"] for p in task.make_prompts("eval")}
    assert len(held_out) == 32 and not train & held_out


@pytest.mark.lesson
def test_dapo_overlong_penalty_against_verls_formula_and_hand_values():
    """DAPO's soft punishment, as verl's reward manager writes it:
    expected = max_len - buffer; exceed = length - expected; min(-exceed / buffer * factor, 0)."""
    def verl(length, max_len, buffer, factor):
        expected_len = max_len - buffer
        exceed_len = length - expected_len
        return min(-exceed_len / buffer * factor, 0)
    for length in range(0, 25):
        for factor in (1.0, 0.5):
            assert rewards.overlong_penalty(length, 24, 8, factor) == pytest.approx(verl(length, 24, 8, factor))
    assert rewards.overlong_penalty(16, 24, 8) == 0.0 and rewards.overlong_penalty(20, 24, 8) == -0.5
    assert rewards.overlong_penalty(24, 24, 8) == -1.0


def test_the_overlong_penalty_reaches_the_advantages_not_the_logged_reward():
    import grpo
    from conftest import synthetic_batch, tiny_model
    batch = synthetic_batch(tiny_model(), n=4, c_len=6)                    # lengths: 4, 6, 6, 4
    batch.rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    lengths = batch.completion_mask.sum(1).tolist()
    hp = grpo.HyperParams(mini_batch=4, micro_batch=4, k=2, norm="none", max_len=6, overlong_buffer=4)
    grpo.prepare(batch, hp)
    expected = [r + rewards.overlong_penalty(n, 6, 4) for r, n in zip([1.0, 1.0, 0.0, 0.0], lengths)]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected))
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
