"""DAPO's dynamic sampling (report 001 cites DAPO): train only on groups that carry a signal.

A group whose K rewards are all equal gets advantage 0 for every sample under a group
baseline (group norm, Dr. GRPO, RLOO, REINFORCE++-baseline: advantages.py), so it adds
nothing to the gradient but its share of the denominators. With a binary reward and success
rate p, a share p^K + (1-p)^K of groups is like that: 70% of K=2 groups at p = 0.18. DAPO
drops those groups and samples more prompts until the batch holds B groups whose rewards
differ (verl: algorithm.filter_groups; TRL only logs frac_reward_zero_std):

    round 1:         B prompts x K samples; keep the groups with max(r) > min(r)
    rounds 2 .. R:   while fewer than B are kept, B fresh prompts x K, keep theirs
    the batch:       the first B kept groups, in the order they were sampled

R is the cap (--max-sampling-rounds; also 300 s of sampling, Budget.seconds, and a signal to stop ends
the step after the round in progress: `Budget`). At the cap the step trains on the groups it kept,
fewer than B (verl stops the run with an error there; here the run goes on and logs
`groups_kept`); with none kept it returns the last round as sampled, and train.py takes no
update that step (`update_skipped: no_group_kept`; under --norm global those rejected groups'
advantages would not be 0). Everything after the
filter (the advantages, their global or batch statistics, the loss's token counts) is
computed over the kept groups only. A group holding a non-finite reward is kept, so that
train.rl_step's guard sees it, counts it and skips the update.

Under global norm a homogeneous group's advantages are not 0 (the batch mean is subtracted),
so there the filter throws signal away; the flag allows it, and says so here. PPO (its critic
gives every token a baseline) and RCE (equal rewards: plain imitation) are refused, and so is
torchrun (ranks would sample different numbers of rounds): `problems` below.
"""
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import rollout


@dataclass
class Knobs:
    """DAPO's dynamic sampling: sample past the groups whose K rewards are all equal."""
    dynamic_sampling: bool = field(default=False, metadata={"help": "drop groups whose K rewards are all equal "
                                   "and sample more prompts until B groups differ"})
    max_sampling_rounds: int = field(default=8, metadata={"help": "--dynamic-sampling: rounds of B prompts at most "
                                     "per step; at the cap the step trains on the groups it kept", "min": 1})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.dynamic_sampling and cfg.algo != "grpo":
        yield "dynamic-sampling", (f"drops the groups a group baseline gives advantage 0; --algo {cfg.algo} " + (
            "gives every token a baseline from its critic" if cfg.algo == "ppo" else "imitates them instead"))
    if cfg.dynamic_sampling and cfg.k < 2:
        yield "dynamic-sampling", f"compares the K rewards of a group and needs --k >= 2, got {cfg.k}"
    if cfg.dynamic_sampling and "WORLD_SIZE" in os.environ:       # torchrun's
        yield "dynamic-sampling", "not under torchrun: ranks would sample different numbers of rounds"

# (N, ...) fields of a Rollout: the prompt's are left-padded, the completion's right-padded.
# Every per-row field a round can carry is here (rollout_logp: the sampler's own log-probs, which
# --rollout-correction needs). The other fields: per row but not padded (ROW_FIELDS), the batch's
# (share_prefix), or filled after the filter (advantages, is_weight): NOT_PADDED. A Rollout field
# in none of these lists fails tests/test_dynamic_sampling.py, so a new one cannot be dropped silently.
PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
COMPLETION_FIELDS = ("completion_ids", "completion_mask", "old_logp", "ref_logp", "old_values", "returns",
                     "completion_attn", "rollout_logp", "kept")
ROW_FIELDS = ("texts", "rewards", "truncated")
NOT_PADDED = ROW_FIELDS + ("share_prefix", "advantages", "is_weight")


def informative(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """(G,) bool: the groups of K rewards that are not all equal (a NaN counts as unequal)."""
    g = rewards.view(-1, k)                                                  # (G, K)
    return ~(g.max(1).values == g.min(1).values)


def pad(t: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    """(n, w) -> (n, width), zeros added on the left (prompts) or the right (completions); a kept
    set (bool, (n, w, V)) gets every token kept there (padding, never trained on)."""
    extra = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), t.dtype == torch.bool and t.dim() == 3)
    return torch.cat([extra, t] if left else [t, extra], 1)


def merge(parts: list) -> rollout.Rollout:
    """Rollouts of several rounds as one: the rows in order, every (N, width) field padded to
    the widest (a prompt on the left, a completion on the right, as one generate call would)."""
    fields = {}
    for name in PROMPT_FIELDS + COMPLETION_FIELDS:
        ts = [getattr(p, name) for p in parts]
        if any(t is None for t in ts):
            fields[name] = None
            continue
        width = max(t.shape[1] for t in ts)
        fields[name] = torch.cat([pad(t, width, name in PROMPT_FIELDS) for t in ts])
    return rollout.Rollout(**fields, texts=[t for p in parts for t in p.texts],
                           rewards=torch.cat([p.rewards for p in parts]), share_prefix=parts[0].share_prefix,
                           truncated=None if any(p.truncated is None for p in parts) else torch.cat([p.truncated for p in parts]))


def select(batch: rollout.Rollout, groups: torch.Tensor, k: int) -> rollout.Rollout:
    """The rows of the groups `groups` (indices of groups of K), in that order."""
    rows = (groups.unsqueeze(1) * k + torch.arange(k)).flatten()             # (len(groups) * K,)

    def take(t):
        return None if t is None else t[rows.to(t.device)]
    fields = {name: take(getattr(batch, name)) for name in PROMPT_FIELDS + COMPLETION_FIELDS}
    return rollout.Rollout(**fields, texts=[batch.texts[i] for i in rows.tolist()], rewards=take(batch.rewards),
                           share_prefix=batch.share_prefix, truncated=take(batch.truncated))


@dataclass
class Budget:
    """How long one step may go on sampling: rounds at most, seconds at most (near-greedy
    sampling can make every group one reward, round after round), and stop(), True once the
    run was asked to stop (a signal): the step then ends after the round in progress."""
    rounds: int = 8
    seconds: float = 300.0            # every group one reward, round after round, under near-greedy sampling
    stop: Callable[[], bool] = lambda: False


def sample(sample_round, draw, prompts: list, k: int, budget: Budget):
    """Sample rounds of B prompts until B informative groups, or the budget is spent.

    sample_round(prompts) -> (Rollout with rewards, outcomes), one per rollout: the task's
    sampling; draw() -> B fresh prompts. Returns (the batch of kept groups, their outcomes,
    their prompts, stats: sampling_rounds, samples_generated, groups_kept)."""
    b = len(prompts)
    parts, outcomes, kept_prompts, kept = [], [], [], 0
    rounds, started = 0, time.monotonic()
    while kept < b and rounds < budget.rounds and (rounds == 0 or (
            time.monotonic() - started < budget.seconds and not budget.stop())):
        if rounds:
            prompts = draw()
        batch, out = sample_round(prompts)
        rounds += 1
        good = informative(batch.rewards, k).nonzero().flatten()[: b - kept]  # (groups kept,)
        if len(good):
            parts.append(select(batch, good, k))
            outcomes += [out[i * k + j] for i in good.tolist() for j in range(k)]
            kept_prompts += [prompts[i] for i in good.tolist()]
            kept += len(good)
    stats = dict(sampling_rounds=rounds, samples_generated=rounds * b * k, groups_kept=kept)
    if not parts:                                   # nothing informative: the last round as it is
        return batch, out, prompts, stats
    return merge(parts), outcomes, kept_prompts, stats
