"""ppo.py against hand arithmetic and references; PPO runs end to end and resume exactly."""
import json
import shutil

import pytest
import torch

from running import config
import logprobs
import ppo
import train
from conftest import configure, ppo_update, WARM_STARTS, quick, synthetic_batch, tiny_model
from ppo import PPOParams


@pytest.mark.lesson
def test_clipped_value_loss_against_hand_arithmetic():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    ret = torch.tensor([[1.0, 1.0, -1.0]])
    v = torch.tensor([[0.5, 0.1, 0.5]])
    # token 0: V moved 0.5 > eps 0.2, so V_clip = 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64
    # token 1: inside the range: both terms (0.1-1)^2 = 0.81
    # token 2: V_clip = 0.2: max((0.5+1)^2, (0.2+1)^2) = 2.25 (the unclipped is worse here)
    expected = 0.5 * torch.tensor([[0.64, 0.81, 2.25]])
    torch.testing.assert_close(ppo.value_loss(v, old, ret, value_clip=0.2), expected)
    torch.testing.assert_close(ppo.value_loss(v, old, ret, value_clip=0.0),
                               0.5 * torch.tensor([[0.25, 0.81, 2.25]]))


@pytest.mark.lesson
def test_token_rewards_put_the_outcome_on_the_last_policy_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    kl_t = torch.full((3, 4), 0.1)
    r = ppo.token_rewards(torch.tensor([1.0, 0.2, 0.0]), mask, beta=0.5, kl_t=kl_t)
    torch.testing.assert_close(r, torch.tensor([[-0.05, -0.05, 0.95, 0.0],
                                                [-0.05, -0.05, -0.05, 0.15],
                                                [-0.05, 0.0, 0.0, 0.0]]))


def naive_token_rewards(rewards, mask):
    """The reference: walk each row and put its reward on the last token whose mask is 1."""
    r = torch.zeros(mask.shape)
    for i in range(len(mask)):
        ones = [t for t in range(mask.shape[1]) if mask[i, t] == 1]
        if ones:
            r[i, ones[-1]] = rewards[i]
    return r


@pytest.mark.lesson
def test_token_rewards_on_multi_turn_masks_land_on_the_last_policy_token():
    # Tool episodes: policy turn, environment reply (mask 0), policy turn, padding.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0],      # two turns: mask.sum - 1 = 3 is a reply token
                         [1, 0, 0, 0, 1, 0, 0, 0],      # two one-token turns
                         [1, 1, 1, 0, 0, 0, 0, 0],      # one turn
                         [0, 0, 0, 0, 0, 0, 0, 0]])     # nothing of the policy's
    rewards = torch.tensor([1.0, -1.0, 0.5, 2.0])
    expected = naive_token_rewards(rewards, mask)
    torch.testing.assert_close(ppo.token_rewards(rewards, mask), expected)
    assert ppo.token_rewards(rewards, mask)[0, 5] == 1.0 and ppo.token_rewards(rewards, mask)[1, 4] == -1.0
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):                                  # random interleavings of turns and replies
        mask = (torch.rand(6, 15, generator=gen) < 0.6).long()
        rewards = torch.randn(6, generator=gen)
        torch.testing.assert_close(ppo.token_rewards(rewards, mask), naive_token_rewards(rewards, mask))
        # no reward lost: a row with any policy token keeps its whole reward
        kept = ppo.token_rewards(rewards, mask).sum(1)
        torch.testing.assert_close(kept, rewards * (mask.sum(1) > 0))


@pytest.mark.lesson
def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_a_constant_one():
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert ppo.explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((1, 4), 2.5), ret, mask) == pytest.approx(0.0)


@pytest.mark.lesson
def test_prepare_with_gamma_lambda_one_targets_the_outcome_reward():
    model = tiny_model()
    batch = synthetic_batch(model)
    batch.ref_logp = None
    batch.rewards = torch.tensor([1.0, 0.2, 0.0, 1.0, 0.0, 0.2, 1.0, 0.0])
    batch.old_values = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    ppo.prepare(batch, PPOParams(mini_batch=8, micro_batch=8, kl_in_reward=True, gamma=1.0, lam=1.0))
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.returns[m], batch.rewards[:, None].expand(8, 6)[m])
    a = batch.advantages[m]
    assert abs(a.mean().item()) < 1e-6 and a.std(correction=0).item() == pytest.approx(1.0, abs=1e-4)


def run_update(micro, epochs=1, target_kl=0.0):
    model = tiny_model()
    head = ppo.ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(head.linear.weight, std=0.1)
    batch = synthetic_batch(model)
    batch.rewards = torch.tensor([1.0, 0.2, 0.0, 1.0, 0.0, 0.2, 1.0, 0.0])
    batch.old_values = torch.zeros(8, 6)
    hp = PPOParams(mini_batch=8, micro_batch=micro, kl_in_reward=True, beta=0.1,
                   entropy_coef=0.01, max_len=6, epochs=epochs, target_kl=target_kl)
    ppo.prepare(batch, hp)
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=0.0)
    stats = ppo_update(logprobs.Scorer(model, head), opt, batch, hp)
    grads = torch.cat([p.grad.flatten() for p in list(model.parameters()) + list(head.parameters())])
    return stats, grads


@pytest.mark.lesson
def test_ppo_micro_batched_gradient_equals_full_batch_gradient_value_head_included():
    (_, full), (_, micro) = run_update(8), run_update(2)
    torch.testing.assert_close(full, micro, rtol=1e-5, atol=1e-7)
    assert full[-17:].abs().sum() > 0                       # the value head got a gradient


def test_target_kl_stops_the_epochs_early():
    stats, _ = run_update(8, epochs=4, target_kl=1e-9)      # old_logp is off by noise: KL > 0
    assert stats["epochs_run"] == 1
    stats, _ = run_update(8, epochs=4, target_kl=0.0)
    assert stats["epochs_run"] == 4


def flags(tmp_path, name, *extra):
    return ["--algo", "ppo", "--steps", "4", "--batch", "2", "--k", "4", "--eval-every", "2",
            "--eval-samples", "1", "--sft-steps", "30", "--hidden", "16", "--layers", "1",
            "--quiet", "--cache-dir", str(WARM_STARTS), "--out", str(tmp_path / name), *extra]


def test_ppo_smoke_run_logs_the_critic_metrics(tmp_path):
    train.train(config.parse_config(flags(tmp_path, "run", "--kl-coef", "0.05", "--epochs", "2",
                                          "--mini-batch", "4", "--lr-schedule", "cosine")))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert "eval_value_rmse" in rows[0]
    for key in ["value_loss", "explained_variance", "approx_kl", "clip_frac", "entropy", "kl_coef", "kl"]:
        assert key in rows[1], key
    assert rows[1]["lr"] > rows[-1]["lr"]                   # cosine decayed


def test_ppo_with_adaptive_kl_resumes_exactly(tmp_path):
    extra = ["--steps", "6", "--save-every", "3", "--kl-coef", "0.5", "--kl-control", "ratio",
             "--entropy-coef", "0.01", "--entropy-coef-end", "0.001"]
    train.train(config.parse_config(flags(tmp_path, "run", *extra)))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "checkpoints" / "step-000006")
    train.train(config.parse_config(["--resume", str(tmp_path / "copy"), "--quiet"]))
    read = lambda p: [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in open(p)]
    resumed, straight = read(tmp_path / "copy" / "metrics.jsonl"), read(tmp_path / "run" / "metrics.jsonl")
    assert resumed == straight
    assert len({r["kl_coef"] for r in straight[1:]}) > 1    # beta really moved


@pytest.mark.parametrize("argv, flag", [
    (["--algo", "a2c"], "--algo"),
    (["--kl-control", "pid"], "--kl-control"),
    (["--kl-control", "ratio"], "--kl-coef"),                           # adaptive from beta 0
    (["--kl-target-min", "0.2", "--kl-target-max", "0.1"], "--kl-target-min"),
    (["--kl-control", "ratio", "--kl-coef", "5"], "--kl-coef"),          # outside [0.01, 1]
    (["--kl-control", "proportional", "--kl-coef", "0.1", "--kl-horizon", "0"], "--kl-horizon"),
    (["--kl-estimator", "k4"], "--kl-estimator"),
    (["--gamma", "1.5"], "--gamma"),
    (["--lam", "-0.1"], "--lam"),
    (["--value-clip", "-1"], "--value-clip"),
    (["--mini-batch", "7"], "--mini-batch"),
    (["--mini-batch", "16", "--micro-batch", "6"], "--micro-batch"),
    (["--warmup-steps", "200"], "--warmup-steps"),
    (["--min-lr", "1"], "--min-lr"),
    (["--lr-schedule", "step"], "--lr-schedule"),
    (["--target-kl", "-1"], "--target-kl"),
    (["--entropy-coef-end", "-0.5"], "--entropy-coef-end"),
])
def test_bad_ppo_and_kl_flags_exit_2_naming_the_flag(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        configure(argv + ["--out", str(tmp_path / "x")])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_the_kl_in_the_reward_defaults_to_k1_and_k3_there_is_warned_about(tmp_path, capsys):
    """K3 as a reward penalty hardly pulls toward the reference (tests/test_kl.py);
    --kl-estimator auto puts k1 in the reward and k3 in the loss, and k3 in the reward is said."""
    def estimator(*flags):
        return config.hyper_params(config.parse_config(quick(tmp_path, "x", "--beta", "0.05", *flags))).kl_estimator
    assert estimator("--algo", "ppo") == "k1"                       # PPO: the KL in the reward
    assert estimator() == "k3"                                      # GRPO: in the loss
    assert estimator("--algo", "ppo", "--kl-in", "loss") == "k3"
    assert estimator("--kl-in", "reward") == "k1"
    assert estimator("--algo", "ppo", "--kl-estimator", "k2") == "k2"  # asked for: kept, and warned about
    train.train(config.parse_config(quick(tmp_path, "run", "--algo", "ppo", "--beta", "0.05", "--kl-estimator", "k3",
                                          "--steps", "1")))
    assert "warning: --kl-estimator k3 in the reward" in capsys.readouterr().err
