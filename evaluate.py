"""Held-out evaluation: the task's rates on prompts the policy never trains on.

One sample at the training temperature for each of --eval-samples x the task's held-out
prompts, drawn with a fixed seed, so every evaluation of a run (and every run) sees the same
sampling noise and a difference between two evaluations is the policy's. The training RNG
is left untouched. With PPO's value head it also measures the critic on those rollouts.

    python train.py --eval-every 10 --eval-samples 4     # the defaults: at step 0, every 10 steps
"""
import torch

import advantages
import ppo

EVAL_SEED = 1234


def evaluate(models, task, prompts: list, sampling, samples: int, gamma: float) -> tuple[dict, list]:
    """({eval_<rate>: value, eval_reward_mean, [eval_value_rmse]}, one samples.jsonl record per
    rollout). models: rollout.Models; task: tasks.Task; sampling: tasks.Sampling.

    eval_value_rmse (with a value head): the RMSE, over held-out policy tokens, of V(s_t)
    against the return the critic is meant to predict (the outcome reward discounted by
    gamma, without the KL penalty)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(EVAL_SEED)
        batch, outcomes = task.sample(models, prompts, samples, sampling, record_old_logp=False)
    out = {f"eval_{key}": v for key, v in task.rates(outcomes).items()}
    out["eval_reward_mean"] = batch.rewards.mean().item()
    if models.value_head is not None:
        m = batch.completion_mask                                                   # (N, C)
        # lam = 1: A_t + V_t is the Monte-Carlo return, whatever V is.
        _, returns = advantages.gae(ppo.token_rewards(batch.rewards.to(m.device), m),
                                    batch.old_values, m, gamma, 1.0)                # (N, C)
        out["eval_value_rmse"] = ((batch.old_values - returns)[m.bool()] ** 2).mean().sqrt().item()
    return out, [task.describe(t, o) for t, o in zip(batch.texts, outcomes)]
