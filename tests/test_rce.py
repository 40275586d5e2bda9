"""Report 003's system against references: RCE's weights and loss by hand, its limits, the
composite reward by hand, early stopping, --init-from, the held-out answer NLL by a plain
loop, and every checkpoint against the baseline."""
import itertools
import json
import math

import pytest
import torch

from lab import compare
from tools import checkpoints
from running import config
from running import session
import logprobs
from models import policy
import rce
import rewards
import rollout
import tool_env
from tasks import tool_task
import train
import update
import warm_start
from tasks import workflow_task
from conftest import quick, synthetic_batch, tiny_model


# ---- the weights and the loss ----

@pytest.mark.lesson
def test_weights_are_a_softmax_of_rewards_within_each_group_by_hand():
    r = torch.tensor([1.0, 0.2, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])          # two prompts, K = 4
    w = rce.weights(r, 4, tau=0.5)
    e = [math.exp(x / 0.5) for x in (1.0, 0.2, 0.0, 0.0)]
    assert w[:4].tolist() == pytest.approx([x / sum(e) for x in e])
    assert w[4:].tolist() == pytest.approx([0.25] * 4), "equal rewards: every candidate imitated equally"
    assert w.view(2, 4).sum(1).tolist() == pytest.approx([1.0, 1.0])


@pytest.mark.lesson
def test_small_tau_puts_the_weight_on_the_best_and_large_tau_imitates_all_k():
    r = torch.tensor([0.2, 1.0, 0.0, 1.0])
    assert rce.weights(r, 4, tau=1e-4).tolist() == pytest.approx([0, 0.5, 0, 0.5]), "ties share the weight"
    assert rce.weights(r, 4, tau=1e6).tolist() == pytest.approx([0.25] * 4, abs=1e-6)


def rows_of(logp, mask, w):
    return rollout.Rows(tokens=None, mask=mask, old_logp=None, ref_logp=None, advantages=w, old_values=None,
                        returns=None)


def rce_loss(logp, rows, prompts: int, k: int = 2):
    """rce.loss for a mini-batch of `prompts` prompts of K samples (its sequences: prompts * K)."""
    return rce.loss(logp, torch.zeros_like(logp), None, rows, update.MiniBatch([], prompts * k, 0), rce.RCEParams(1, 1, k=k))


@pytest.mark.lesson
def test_loss_and_its_gradient_against_hand_arithmetic():
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.3, 0.0], [-1.5, 0.0, 0.0], [-0.2, -0.2, -0.2]],
                        requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    w = torch.tensor([0.7, 0.3, 0.1, 0.9])                               # two prompts of K = 2
    value, sums = rce_loss(logp, rows_of(logp, mask, w), prompts=2)
    by_hand = -(0.7 * -3.5 + 0.3 * -0.4 + 0.1 * -1.5 + 0.9 * -0.6) / 2
    assert value.item() == pytest.approx(by_hand)
    assert sums["nll"] == pytest.approx(3.5 + 0.4 + 1.5 + 0.6)
    value.backward()
    # dL / dlogp_it = -w_i / G on a policy token, 0 on padding
    assert torch.allclose(logp.grad, -(w / 2).unsqueeze(1) * mask)


@pytest.mark.lesson
def test_at_small_tau_rce_is_the_cross_entropy_of_the_best_candidate():
    model = tiny_model()
    batch = synthetic_batch(model, n=8)
    r = torch.tensor([0.0, 1.0, 0.2, 0.0, 0.0, 0.2, 0.0, 1.0])           # K = 4: bests are rows 1 and 7
    w = rce.weights(r, 4, tau=1e-4)
    logp, _ = logprobs.completion_logprobs(model, batch.tokens())
    value, _ = rce_loss(logp, rows_of(logp, batch.completion_mask, w), prompts=2, k=4)
    m = batch.completion_mask
    ce_best = -((logp[1] * m[1]).sum() + (logp[7] * m[7]).sum()) / 2
    assert value.item() == pytest.approx(ce_best.item(), rel=1e-5)


@pytest.mark.lesson
def test_an_rce_update_is_one_sgd_step_on_the_loss():
    model = tiny_model()
    batch = synthetic_batch(model, n=8)
    batch.rewards = torch.tensor([0.0, 1.0, 0.2, 0.0, 0.0, 0.2, 0.0, 1.0])
    hp = rce.RCEParams(mini_batch=8, micro_batch=4, k=4, rce_temp=0.5, max_grad_norm=0)   # 0: no clip
    rce.prepare(batch, hp)
    ref = tiny_model()
    ref.load_state_dict(model.state_dict())
    logp, _ = logprobs.completion_logprobs(ref, batch.tokens())
    value, _ = rce_loss(logp, rows_of(logp, batch.completion_mask, batch.advantages), prompts=2, k=4)
    value.backward()
    expected = {n: p - 0.1 * p.grad for n, p in ref.named_parameters() if p.grad is not None}
    stats = update.update(logprobs.Scorer(model), torch.optim.SGD(model.parameters(), lr=0.1), batch, hp, rce.loss)
    assert stats["loss"] == pytest.approx(value.item(), rel=1e-5)
    got = dict(model.named_parameters())
    assert all(torch.allclose(got[n], p, atol=1e-6) for n, p in expected.items())


# ---- report 003's composite reward ----

BEST = "Custom -> Programmer -> Review ? Revise : done"


@pytest.mark.parametrize("text, hard, gt_prob, rel, reward", [
    (BEST, 1, 1, 1, 3.0),
    ("Custom -> Programmer", 0, 2 / 3, 1, 2 / 3 + 0.1),                  # 2 of the 3 steps, in order
    ("Programmer -> Test", 0, 1 / 3, 1 / 2, 1 / 3 + 0.05),              # Test is not in the best
    ("Test -> Format", 0, 0, 0, 0.0),
    ("### Step 1 : Analyze the problem", 0, 0, 0, 0.0),
])
@pytest.mark.lesson
def test_composite_reward_against_hand_arithmetic(text, hard, gt_prob, rel, reward):
    parts = rewards.composite_parts(text, BEST)
    assert (parts["hard"], parts["gt_prob"], parts["rel"]) == pytest.approx((hard, gt_prob, rel))
    assert rewards.composite_reward(text, BEST) == pytest.approx(reward)


def test_the_misjudged_reward_pays_the_next_types_best_on_a_quarter_of_the_training_prompts(monkeypatch):
    """--reward misjudged: on every 4th training prompt of a type (6 of its 24) the composite reward
    is computed against the next type's best workflow, so that workflow earns 3 there and the
    type's own best earns what composite gives a wrong answer; every other prompt, and every
    held-out one, is paid as --reward composite pays it; the classes (the rates) stay right."""
    import types
    train, held_out = workflow_task.prompts("train"), workflow_task.prompts("eval")
    for ptype in workflow_task.TYPES:
        mine = [p for p in train if p["type"] == ptype]
        wrong = [p for p in mine if "judged" in p]
        assert len(mine) == 24 and wrong == mine[::4]
        following = workflow_task.TYPES[(workflow_task.TYPES.index(ptype) + 1) % 4]
        assert {p["judged"] for p in wrong} == {workflow_task.BEST_WORKFLOW[following]}
    assert not any("judged" in p for p in held_out)
    prompts = [next(p for p in train if "judged" in p), next(p for p in train if "judged" not in p), held_out[0]]
    texts = [t for p in prompts for t in (p["best"], p.get("judged", "Test -> Format"))]
    monkeypatch.setattr(workflow_task.rollout, "format_prompt", lambda tok, text, system: text)
    monkeypatch.setattr(workflow_task.rollout, "sample", lambda models, t, k, sampling, record: types.SimpleNamespace(texts=texts))
    for reward in ("composite", "misjudged"):
        batch, classes = workflow_task.sample(types.SimpleNamespace(tok=None), prompts, 2, types.SimpleNamespace(reward=reward))
        paid = [rewards.composite_reward(t, p.get("judged", p["best"]) if reward == "misjudged" else p["best"])
                for p in prompts for t in (p["best"], p.get("judged", "Test -> Format"))]
        assert batch.rewards.tolist() == pytest.approx(paid)
        assert classes[0::2] == ["best"] * 3
    assert batch.rewards[1] == 3.0 and batch.rewards[0] < 1.2 and batch.rewards[2] == 3.0   # the misjudged prompt


def test_longest_common_subsequence_against_brute_force():
    for a, b in [("abcbdab", "bdcaba"), ("", "abc"), ("aaa", "aa"), ("xyz", "abc")]:
        brute = max(n for n in range(len(a) + 1)
                    if any("".join(c) in {"".join(d) for d in itertools.combinations(b, n)}
                           for c in itertools.combinations(a, n)))
        assert rewards._lcs(list(a), list(b)) == brute


# ---- the held-out loss: a right answer's NLL ----

def test_answer_nll_equals_a_plain_loop_over_the_answer_tokens(tmp_path):
    model, tok = policy.tiny_policy(workflow_task, 16, 1, warm_start.WarmStart(steps=5), tmp_path, log=lambda s: None)
    prompts = workflow_task.prompts("eval")[:3]
    total, count = 0.0, 0
    for p in prompts:
        prompt = tok(p["text"], add_special_tokens=False)["input_ids"]
        answer = tok(p["best"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        for j, token in enumerate(answer):              # position len(prompt)+j-1 predicts it
            total -= logp[len(prompt) + j - 1, token].item()
            count += 1
    got = warm_start.answer_nll(rollout.Models(model, tok), workflow_task, prompts)
    assert got == pytest.approx(total / count, rel=1e-4)


def test_the_tool_tasks_answer_is_a_right_episode():
    prompt = tool_task.prompts("eval")[3]
    segments = tool_task.answer(prompt)
    env = tool_env.ToolEnv()
    assert env.reset(seed=prompt["seed"]) == segments[0][0] and env.benchmark == prompt["benchmark"]
    infos = [env.step(text)[2] for text, trained in segments[1:] if trained]
    assert rewards.answered_correctly(infos) and rewards.sparse_reward(infos) == 1.0


def test_by_group_partitions_the_rollouts_and_all_is_their_whole():
    calls = []

    class FakeTask:
        GROUP_KEY = "type"

        @staticmethod
        def sample(models, prompts, k, sampling, record_old_logp=True):
            calls.append(k)
            outcomes = [p["type"] == "a" and i % 2 == 0 for p in prompts for i in range(k)]
            batch = rollout.Rollout(*[None] * 6, texts=[""] * len(outcomes))
            batch.rewards = torch.tensor([float(o) for o in outcomes])
            return batch, outcomes

        @staticmethod
        def rates(outcomes):
            return {"best_rate": sum(outcomes) / len(outcomes)}

    prompts = [{"type": "a"}, {"type": "b"}, {"type": "a"}]
    out = compare.by_group(None, FakeTask, prompts, None, samples=4, seed=0)
    assert out == {"a": {"best_rate": 0.5, "reward_mean": 0.5}, "b": {"best_rate": 0.0, "reward_mean": 0.0},
                   "all": {"best_rate": 4 / 12, "reward_mean": 4 / 12}}


# ---- two stages, early stopping, checkpoints against the baseline ----

def run(tmp_path, name, *extra):
    return train.train(config.parse_config(quick(tmp_path, name, *extra)))


def test_early_stopping_stops_after_patience_and_keeps_the_best(tmp_path):
    # lr 1e-12: the policy cannot move, so no evaluation is strictly better than step 0's
    s = run(tmp_path, "es", "--steps", "10", "--eval-every", "1", "--early-stop-patience", "2", "--lr", "1e-12")
    assert s["steps"] == 2 and s["stopped"] is None and "early-stop-patience" in s["early_stopped"]
    assert s["best_step"] == 0 and s["best_checkpoint"] == "checkpoints/step-000000"
    assert (tmp_path / "es" / s["best_checkpoint"] / "trainer_state.pt").is_file()
    rows = [json.loads(x) for x in open(tmp_path / "es" / "metrics.jsonl")]
    assert all("eval_answer_nll" in r and "train_answer_nll" in r for r in rows), "the held-out loss at each eval"


def test_init_from_starts_from_the_first_stages_best_weights_and_takes_them_as_reference(tmp_path):
    first = run(tmp_path, "rce", "--algo", "rce", "--steps", "4", "--eval-every", "1", "--early-stop-patience", "5")
    rows = [json.loads(x) for x in open(tmp_path / "rce" / "metrics.jsonl")]
    assert [r["rce_temp"] for r in rows[1:]] == pytest.approx([1.7, 1.3, 0.9, 0.5]), "tau 1.7 -> 0.5, linear"
    second = run(tmp_path, "grpo", "--init-from", str(tmp_path / "rce"), "--beta", "0.1")
    # the second stage's step-0 evaluation is the first stage's best one: the same weights
    assert second["eval_best_rate_start"] == first["eval_best_rate_best"]
    step1 = [json.loads(x) for x in open(tmp_path / "grpo" / "metrics.jsonl")][1]
    assert step1["kl"] == pytest.approx(0.0, abs=1e-6), "the reference is the loaded weights, not the warm start"


def test_init_from_refuses_a_folder_without_checkpoints_or_of_another_model(tmp_path, capsys):
    run(tmp_path, "a", "--save-every", "3")
    for argv, why in [(["--init-from", str(tmp_path / "nothing")], "no checkpoint"),
                      (["--init-from", str(tmp_path / "a"), "--hidden", "32"], "--hidden")]:
        with pytest.raises(SystemExit) as e:
            config.parse_config(quick(tmp_path, "b", *argv))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and why in err, err


@pytest.mark.parametrize("argv, flag", [
    (["--algo", "rce", "--k", "1"], "--k"),
    (["--algo", "rce", "--beta", "0.1"], "--beta"),
    (["--rce-temp-start", "0"], "--rce-temp-start"),
    (["--rce-temp-end", "-1"], "--rce-temp-end"),
    (["--task", "tools", "--reward", "composite"], "--reward"),
    (["--reward", "sparse"], "--reward"),
    (["--early-stop-patience", "-1"], "--early-stop-patience"),
])
def test_bad_rce_and_two_stage_flags_exit_2_naming_the_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_compare_checkpoints_evaluates_the_warm_start_and_every_checkpoint(tmp_path, capsys, monkeypatch):
    run(tmp_path, "r", "--save-every", "1", "--reward", "composite")
    out = tmp_path / "ck"
    monkeypatch.setattr("sys.argv", ["lab/compare.py"])
    checkpoints.main([str(tmp_path / "r"), "--samples", "2", "--out", str(out)])
    result = json.loads((out / "checkpoints.json").read_text())
    assert [s for s, _ in result["runs"][str(tmp_path / "r")]] == [1, 2, 3]
    assert set(result["baseline"]) == {*workflow_task.TYPES, "all"}
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 2 + 1 + 3 and table[2].startswith("| warm start")
    assert (out / "checkpoints.png").stat().st_size > 0
    with pytest.raises(SystemExit) as e:
        checkpoints.main([str(tmp_path / "nothing")])
    assert e.value.code == 2 and "not a run folder" in capsys.readouterr().err


def test_a_second_stages_setting_names_each_seeds_first_stage_run():
    assert compare.slug("--init-from runs/x/s{seed} --k 2") == "init-from_runs_x_sS_k_2"


def test_pruning_spares_the_best_checkpoint_and_a_later_stage_starts_from_it(tmp_path):
    from running import checkpoint
    run_dir = tmp_path / "run"
    for step in (0, 10, 20, 30):
        (run_dir / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step:06d}" / checkpoint.STATE_FILE).write_bytes(b"")
    best = run_dir / "checkpoints" / "step-000010"
    gone = checkpoint.prune(run_dir, keep=1, spare=best)
    assert sorted(p.name for p in gone) == ["step-000000", "step-000020"]
    assert checkpoint.starting_point(run_dir).name == "step-000030", "no summary: the newest"
    (run_dir / "summary.json").write_text(json.dumps({"best_checkpoint": "checkpoints/step-000010"}))
    assert checkpoint.starting_point(run_dir) == best, "the summary names the best: that one"
