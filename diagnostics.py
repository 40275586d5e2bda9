"""What a step shows: the numbers to watch, each computed on the whole batch, and the two silent
no-ops said in plain words.

    row = diagnostics.rollout_metrics(batch, outcomes, task, hp, join)    # train.py, after the update
    rates, records = diagnostics.evaluate(models, task, prompts, sampling, samples, gamma)   # held out

A run that goes wrong says so in these numbers before its held-out reward does (their formulas:
docs/metrics.md). The ones this course leans on:

    frac_reward_zero_std   groups whose K rewards are all equal: their advantages are 0, they
                           teach nothing (Lesson 1: at K=2 a third of the groups)
    frac_adv_pm1           advantages of exactly +-1: K=2 with group normalisation gives only these
    adv_abs_mean           0 when the step teaches nothing at all
    kl                     k3 from the reference, on the sampled tokens (kl.py)
    completions/*          TRL's lengths: clipped_ratio 1 means every completion hit the limit
    sampling/*             how far the sampler's log-probs are from the trainer's (mismatch.py)
    explained_variance     PPO: how much of the returns' variance the critic explains (ppo.py)

Under torchrun each rank's pieces are joined first (`join`: train.py passes
running/distributed.concat), so every rank holds the numbers one process would compute on the
same rollouts, and every decision taken from them (beta, the monitor, a stop) is the same on
every rank.
"""
import dataclasses
from collections import Counter

import torch

import advantages
import kl
import mismatch
import ppo


def rollout_metrics(batch, outcomes: list, task, hp, join=lambda parts: parts) -> dict:
    """The metrics of a step's rollouts: rewards, the task's rates, the advantages and the KL to
    the reference, over the whole batch: each rank's pieces (one entry per rollout or per policy
    token) joined first by join (the identity in one process). hp: grpo.HyperParams (k, beta,
    algo)."""
    mask = batch.completion_mask.bool()                                              # (N, C)
    kl_t = kl.estimate(batch.old_logp, batch.ref_logp, "k3") \
        if batch.ref_logp is not None and batch.old_logp is not None else None   # (N, C)
    ppo_critic = hp.algo == "ppo" and batch.returns is not None
    p = join(dict(
        rewards=batch.rewards, outcomes=list(outcomes), seq_adv=batch.sequence_advantages(),   # (N,)
        lengths=mask.sum(1), truncated=batch.truncated,                                        # (N,)
        adv=batch.advantages[mask] if batch.advantages.dim() == 2 else batch.advantages,       # the loss's
        kl=kl_t[mask] if kl_t is not None else None,                                 # (policy tokens,)
        values=batch.old_values[mask] if ppo_critic else None,
        returns=batch.returns[mask] if ppo_critic else None))
    finite = torch.isfinite(p["rewards"])                                            # (N,)
    r = p["rewards"][finite]
    row = dict(reward_mean=r.mean().item() if len(r) else None,
               reward_std=r.std(correction=0).item() if len(r) else None, **task.rates(p["outcomes"]),
               nonfinite_rewards=int((~finite).sum()),
               frac_reward_zero_std=advantages.frac_zero_std(p["rewards"], hp.k),
               adv_abs_mean=p["adv"].abs().mean().item(), frac_adv_pm1=advantages.frac_pm1(p["adv"]),
               frac_adv_negative=(p["seq_adv"] < 0).float().mean().item(),
               kl=p["kl"].mean().item() if p["kl"] is not None else None, kl_coef=hp.beta)
    row.update(completion_lengths(p["lengths"], p["truncated"]))
    if batch.rollout_logp is not None and batch.old_logp is not None:      # the rollout/training mismatch
        row.update(mismatch_metrics(batch, join))
    if ppo_critic and finite.all():
        row["explained_variance"] = ppo.explained_variance(p["values"], p["returns"],
                                                           torch.ones_like(p["values"]))
    return row


def mismatch_metrics(batch, join) -> dict:
    """mismatch.diagnostics over the whole batch's policy tokens (joined over ranks): how far the
    sampler's log-probs are from the policy's recomputed ones, and the correction's weight."""
    mask = batch.completion_mask.bool()                                              # (N, C)
    log_w = mismatch.log_weights(batch.old_logp, batch.rollout_logp, mask, "token")  # (N, C)
    seq = log_w.sum(1) / mask.sum(1).clamp_min(1)                                    # (N,) mean log w
    p = join(dict(tokens=log_w[mask], seqs=seq[mask.any(1)],
                  weights=batch.is_weight[mask] if batch.is_weight is not None else None))
    return mismatch.diagnostics(p["tokens"], p["seqs"], p["weights"])


def completion_lengths(lengths: torch.Tensor, truncated: torch.Tensor | None) -> dict:
    """TRL's completion-length metrics: policy tokens per rollout (mean, min, max), the mean
    length of the rollouts that ended (EOS or a stop string), and the share cut at the limit."""
    lengths = lengths.float()                                                        # (N,)
    out = {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
           "completions/max_length": lengths.max().item()}
    if truncated is not None:
        ended = lengths[~truncated.bool()]
        out["completions/mean_terminated_length"] = ended.mean().item() if len(ended) else 0.0   # TRL: 0
        out["completions/clipped_ratio"] = truncated.float().mean().item()
    return out


def no_rollout(task) -> dict:
    """The rollout metrics of a step whose sampling failed (non-finite logits)."""
    return dict(reward_mean=None, kl=None, **{key: None for key in (*task.HEADLINE, task.FORMAT_KEY)})


def no_update(*nonfinite) -> dict:
    """The update statistics of a step without an update (nonfinite: why it was skipped)."""
    return dict(loss=None, entropy=None, clip_frac=None, clip_frac_low=None, clip_frac_high=None,
                ratio_min=None, ratio_max=None, approx_kl=None, grad_norm=None, steps_taken=0,
                skipped_nonfinite=int(bool(nonfinite)), nonfinite=list(nonfinite))


def silent_no_ops(row: dict, k: int, new_tokens: int) -> dict:
    """The silent no-ops users keep reporting, in plain words, by name (the run says each once,
    at the first step it happens): every completion cut at the token limit (TRL #5697: too short
    a limit, and reward, loss and grad_norm sit at 0), and every advantage 0 because every group
    got one reward (TRL #3452: every ratio is 1 in the first epoch, so the loss is 0 and nothing
    is learned). The advantages, not the rewards, decide: under --norm global (K=1 too) or RCE's
    weights a batch of one-reward groups still has advantages that differ from 0. And dynamic
    sampling that found no group whose rewards differ (no update that step)."""
    said = {}
    if row.get("update_skipped") == "no_group_kept":
        said["no_group_kept"] = (f"dynamic sampling: in every one of its {row['sampling_rounds']} rounds, each "
                                 f"prompt's {k} samples got the same reward, so no group could teach anything; no "
                                 f"update this step (said once; update_skipped in metrics.jsonl marks each such step)")
    if row.get("completions/clipped_ratio") == 1.0:
        said["all_clipped"] = (f"every completion was cut at --max-new-tokens {new_tokens} before it ended (no "
                               f"EOS, no stop string): their rewards say little and the policy never learns to "
                               f"stop; raise --max-new-tokens (said once; completions/clipped_ratio in metrics.jsonl)")
    if row.get("frac_reward_zero_std") == 1.0 and row.get("adv_abs_mean") == 0:
        said["one_reward"] = (f"every group's {k} samples got the same reward, so every advantage is 0 and this "
                              f"step teaches nothing (a loss of 0 here is expected, not a bug) (said once; "
                              f"frac_reward_zero_std in metrics.jsonl)")
    return said


# ---- the held-out evaluation: prompts the policy never trains on, under a fixed seed (every
# evaluation sees the same sampling noise, so two evaluations differ by the policy alone) ----

EVAL_SEED = 1234


def evaluate(models, task, prompts: list, sampling, samples: int, gamma: float) -> tuple[dict, list]:
    """({eval_<rate>, eval_reward_mean, eval_one_answer, [eval_value_rmse]}, a samples.jsonl
    record per rollout). eval_one_answer: the commonest text's share (1.0: Lesson 5's collapse);
    eval_value_rmse: V(s_t) against the discounted outcome reward, over held-out policy tokens."""
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
    """task.sample of `samples` rollouts per prompt under a fixed seed; the training RNG untouched;
    no kept sets recorded (--mask-replay: nothing here is scored for training)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return task.sample(models, prompts, samples, sampling and dataclasses.replace(sampling, mask_replay=False),
                           record_old_logp=False)
