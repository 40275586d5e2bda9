"""Held-out evaluation: the task's rates on prompts the policy never trains on.

One sample at the training temperature for each of --eval-samples x the task's held-out
prompts, drawn with a fixed seed, so every evaluation of a run (and every run) sees the same
sampling noise and a difference between two evaluations is the policy's. The training RNG
is left untouched. With PPO's value head it also measures the critic on those rollouts.

    python train.py --eval-every 10 --eval-samples 4     # the defaults: at step 0, every 10 steps

Beside the rates, the held-out *loss* report 003 watched: `answer_nll`, the per-token NLL
of a right answer (the task's `answer`: the best workflow, or a look-up-then-answer
episode), teacher-forced, on the held-out prompts and on 32 training prompts. `by_group`
breaks the rates down the way report 003 broke its accuracy down by shots (by problem type
for the DSL task), for `python -m lab.compare checkpoints RUN ...`.
"""
import statistics
from collections import Counter

import torch

import advantages
from models import policy
import ppo

EVAL_SEED = 1234
NLL_ROWS = 8          # answers per forward of answer_nll


def evaluate(models, task, prompts: list, sampling, samples: int, gamma: float) -> tuple[dict, list]:
    """({eval_<rate>: value, eval_reward_mean, eval_one_answer, [eval_value_rmse]}, one
    samples.jsonl record per rollout). models: rollout.Models; task: tasks.Task; sampling:
    tasks.Sampling. eval_one_answer: the share of the held-out samples that are the commonest
    one (1.0: one answer for every prompt, Lesson 5's collapse).

    eval_value_rmse (with a value head): the RMSE, over held-out policy tokens, of V(s_t)
    against the return the critic is meant to predict (the outcome reward discounted by
    gamma, without the KL penalty)."""
    batch, outcomes = sample_seeded(models, task, prompts, sampling, samples, EVAL_SEED)
    out = {f"eval_{key}": v for key, v in task.rates(outcomes).items()}
    out["eval_reward_mean"] = batch.rewards.mean().item()
    # one answer for every prompt: the share of held-out samples that are the commonest text
    out["eval_one_answer"] = max(Counter(batch.texts).values()) / len(batch.texts)
    if models.value_head is not None:
        m = batch.completion_mask                                                   # (N, C)
        # lam = 1: A_t + V_t is the Monte-Carlo return, whatever V is.
        _, returns = advantages.gae(ppo.token_rewards(batch.rewards.to(m.device), m),
                                    batch.old_values, m, gamma, 1.0)                # (N, C)
        out["eval_value_rmse"] = ((batch.old_values - returns)[m.bool()] ** 2).mean().sqrt().item()
    return out, [task.describe(t, o) for t, o in zip(batch.texts, outcomes)]


def sample_seeded(models, task, prompts: list, sampling, samples: int, seed: int):
    """task.sample of `samples` rollouts per prompt under a fixed seed; the training RNG untouched."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return task.sample(models, prompts, samples, sampling, record_old_logp=False)


@torch.no_grad()
def answer_nll(models, task, prompts: list) -> float:
    """Per-token NLL of the task's right answer to each prompt, teacher-forced at temperature
    1: - sum over answer tokens of log p(token) / their number (the prompt and any tool
    output are not counted: policy.sft_rows's labels)."""
    model, total, tokens = models.model, 0.0, 0
    for i in range(0, len(prompts), NLL_ROWS):          # a few rows at a time: a real model's memory
        rows = policy.sft_rows(task, models.tok, [task.answer(p) for p in prompts[i:i + NLL_ROWS]])
        ids, mask, labels = (t.to(model.device) for t in rows)
        total += policy.sft_loss_sum(model, ids, mask, labels).item()
        tokens += int((labels[:, 1:] != -100).sum())
    return total / max(tokens, 1)


def by_group(models, task, prompts: list, sampling, samples: int, seed: int) -> dict:
    """{group: {rate: value, "reward_mean": ...}} for each value of the prompts' task.GROUP_KEY
    (DSL: problem type), and "all": `samples` rollouts per prompt under `seed`."""
    batch, outcomes = sample_seeded(models, task, prompts, sampling, samples, seed)
    rewards = batch.rewards.tolist()
    groups = {}                                          # group -> rollout indices
    for i, p in enumerate(prompts):
        groups.setdefault(p[task.GROUP_KEY], []).extend(range(i * samples, (i + 1) * samples))
    groups["all"] = list(range(len(outcomes)))
    return {g: dict(task.rates([outcomes[i] for i in idx]), reward_mean=statistics.mean(rewards[i] for i in idx))
            for g, idx in groups.items()}
