"""PPO's critic two ways (ppo.py): a value head on the policy's trunk (shared) or a network of
its own (separate), its own learning rate, its own gradient clip; against hand arithmetic and
plain checks of which weights a value loss reaches."""
import json
import math
import shutil

import pytest
import torch

from running import checkpoint
from running import config
import update
import logprobs
import ppo
import train
from conftest import quick, synthetic_batch, tiny_model


def value_loss_grads(critic_kind: str):
    """Backward of the values alone through a Scorer: which parameters got a gradient."""
    model = tiny_model()
    critic = ppo.Critic(model) if critic_kind == "separate" else ppo.ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(critic.head.linear.weight if critic_kind == "separate" else critic.linear.weight)
    batch = synthetic_batch(model)
    _, _, values = logprobs.Scorer(model, critic)(batch.tokens(), 1.0, False)
    (values * batch.completion_mask).sum().backward()
    policy_moved = any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    critic_moved = any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.parameters())
    return policy_moved, critic_moved


def test_a_value_loss_moves_the_policy_only_through_a_shared_trunk():
    assert value_loss_grads("shared") == (True, True)
    assert value_loss_grads("separate") == (False, True)


def test_the_separate_critic_starts_as_a_copy_of_the_policy_trunk_with_values_zero():
    model = tiny_model()
    critic = ppo.Critic(model)
    for (name, a), (_, b) in zip(model.base_model.named_parameters(), critic.trunk.named_parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    batch = synthetic_batch(model)
    assert (critic.values(batch.tokens()) == 0).all(), "a zero value head"
    # its hidden states are the policy's own, at the positions that predict each token
    _, _, h = logprobs.completion_logprobs(model, batch.tokens(), return_hidden=True)
    torch.nn.init.normal_(critic.head.linear.weight)
    assert torch.allclose(critic.values(batch.tokens()), critic.head(h), atol=1e-5)


def test_each_parameter_group_is_clipped_on_its_own_by_hand():
    policy, critic = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [policy]}, {"params": [critic], "lr": 10.0}], lr=1.0)
    policy.grad, critic.grad = torch.tensor([0.3, 0.4]), torch.tensor([60.0, 80.0])     # norms 0.5, 100
    norm, nonfinite = update.optimizer_step(opt, 1.0, loss=1.0)
    assert norm == pytest.approx(0.5) and nonfinite == []
    assert policy.tolist() == pytest.approx([-0.3, -0.4]), "the critic's norm does not shrink the policy's step"
    assert critic.tolist() == pytest.approx([-6.0, -8.0]), "clipped to norm 1, then lr 10"
    critic.grad, policy.grad = torch.tensor([math.inf, 0.0]), torch.tensor([0.3, 0.4])
    before = policy.detach().clone()
    _, nonfinite = update.optimizer_step(opt, 1.0, loss=1.0)
    assert nonfinite == ["critic_grad_norm"] and torch.equal(policy.detach(), before)


def test_param_groups_put_the_critic_at_its_own_lr():
    model = tiny_model()
    parse = lambda *a: config.Config(algo="ppo", lr=1e-3, **dict(a))
    shared = ppo.ValueHead(model.config.hidden_size)
    groups = train.param_groups(parse(), model, shared)
    assert len(groups) == 1 and len(groups[0]["params"]) == len(list(model.parameters())) + 2
    groups = train.param_groups(parse(("critic_lr", 1e-2)), model, shared)
    assert [g.get("lr_scale") for g in groups] == [None, pytest.approx(10.0)] and groups[1]["lr"] == pytest.approx(1e-2)
    critic = ppo.Critic(model)
    groups = train.param_groups(parse(("critic", "separate")), model, critic)
    assert len(groups) == 2 and groups[1]["lr_scale"] == 1.0
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in critic.parameters()}


def test_a_separate_critic_run_trains_resumes_and_keeps_the_lr_ratio(tmp_path):
    flags = ["--algo", "ppo", "--critic", "separate", "--critic-lr", "1e-2", "--lr", "1e-3",
             "--lr-schedule", "linear", "--save-every", "3", "--steps", "6"]
    train.train(config.parse_config(quick(tmp_path, "c", *flags)))
    state = torch.load(tmp_path / "c" / "checkpoints" / "step-000003" / checkpoint.STATE_FILE, weights_only=False)
    policy_group, critic_group = state["optimizer"]["param_groups"]
    assert policy_group["lr"] == pytest.approx(1e-3 * (1 - 3 / 6))
    assert critic_group["lr"] == pytest.approx(10 * policy_group["lr"]), "the schedule moves both, 10x apart"
    assert set(state["controllers"]["value_head"]) >= {"trunk.embed_tokens.weight", "head.linear.weight"}
    # the run goes on from its newest checkpoint: the critic's trunk and head come back too
    shutil.rmtree(tmp_path / "c" / "checkpoints" / "step-000006")
    summary = train.train(config.parse_config(["--resume", str(tmp_path / "c"), "--quiet"]))
    rows = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert summary["steps"] == 6 and [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all("explained_variance" in r for r in rows)


@pytest.mark.parametrize("argv, flag", [
    (["--critic", "separate"], "--critic"),
    (["--critic-lr", "1e-2"], "--critic-lr"),
    (["--algo", "ppo", "--critic-lr", "-1"], "--critic-lr"),
    (["--algo", "ppo", "--critic", "both"], "--critic"),
])
def test_bad_critic_flags_exit_2_naming_the_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_the_critic_scores_the_rollouts_micro_batch_by_micro_batch(critic, tmp_path):
    """--micro-batch bounds every forward, the critic's too (a separate critic ran its
    trunk over all N sequences at once); the values equal one forward over the whole batch."""
    import rollout
    import tasks
    model = tiny_model()
    head = ppo.Critic(model) if critic == "separate" else ppo.ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(head.head.linear.weight if critic == "separate" else head.linear.weight, std=0.1)
    rows = []
    trunk = head.trunk if critic == "separate" else model.base_model
    trunk.register_forward_hook(lambda m, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    batch = synthetic_batch(model)
    models = rollout.Models(model, None, None, head)
    with torch.no_grad():
        whole = rollout.score_logprobs(batch, models, tasks.Sampling()).old_values.clone()
        rows.clear()
        chunked = rollout.score_logprobs(batch, models, tasks.Sampling(forward_batch=2)).old_values
    assert rows and max(rows) == 2, f"forwards of {rows} rows"
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
