"""PPO with a critic for language models: value head, token-level rewards, GAE, clipped losses.

Shapes as in grpo.py: n sequences, C completion tokens, H hidden size; mask (n, C) is 1 on
the policy's own tokens (its sampled EOS included).

The critic, two ways (--critic):
- shared (ValueHead): a linear value head on the policy's last hidden state, as TRL's
  AutoModelForCausalLMWithValueHead. One forward gives log-probs and values and no second
  model is kept; the price is that value-loss gradients (weighted by --vf-coef) move the
  policy's own weights, and one gradient clip covers both.
- separate (Critic): a network of its own, as report 000's system, verl and OpenRLHF train:
  a copy of the policy's trunk as RL starts (the warm start, or --init-from's weights) with
  a fresh zero value head. Value-loss gradients never reach the policy. It costs a second
  trunk in memory and a second forward per update, and it starts knowing what the policy
  knows (a random trunk would have to learn the language first; a critic is commonly loaded
  from a fine-tuned checkpoint, not from scratch).
Either way the critic's parameters are a second group of the one AdamW optimizer, at
--critic-lr (report 000: 1e-5 against the actor's 1e-6, ten times), scheduled with the
policy's lr and gradient-clipped on its own (update.optimizer_step).

One PPO step, per token t of sequence i:

    r_it     = R_i * [t is the last policy token] - beta * kl_it     (KL in the reward, --kl-in)
    A, G     = advantages.gae(r, V_old, mask, gamma, lam)            (G: the value targets)
    A        = whiten(A)                                             (over the batch's tokens)
    L_policy = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)    (surrogates.ppo_clip)
    L_value  = 1/2 max((V - G)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - G)^2)
    loss     = L_policy + vf_coef * L_value - entropy_coef * H     (+ beta * kl_t with --kl-in loss)

averaged by grpo.aggregate, in update.py's loop (epochs over shuffled mini-batches, CleanRL's
early stop at target_kl), the loop GRPO and RCE share: `loss` below is what PPO adds.
Without --value-clip the value loss is 1/2 (V - G)^2.

    python train.py --algo ppo
"""
import copy
from dataclasses import dataclass, field

import torch
from torch import nn

import advantages
import grpo
import kl
import logprobs


@dataclass
class Knobs:
    """PPO's critic: where it lives, how fast it learns, its loss, and GAE's discounts."""
    critic: str = field(default="shared", metadata={"help": "a value head on the policy's trunk (shared), or a "
                        "network of its own initialised from the policy (separate, as report 000, verl, OpenRLHF)",
                        "choices": ("shared", "separate"), "algos": ("ppo",)})
    critic_lr: float = field(default=0.0, metadata={"help": "the critic's learning rate (value head, and with "
                             "--critic separate its trunk); 0 = --lr; report 000 used 10x the actor's", "min": 0,
                             "algos": ("ppo",)})
    vf_coef: float = field(default=0.5, metadata={"help": "weight of the value loss", "min": 0, "max": 100.0,
                                                  "algos": ("ppo",)})
    value_clip: float = field(default=0.2, metadata={"help": "value-loss clip range around the old values; 0 = "
                              "unclipped", "min": 0, "max": 1e6, "algos": ("ppo",)})
    gamma: float = field(default=1.0, metadata={"help": "discount per token", "min": 0, "max": 1, "algos": ("ppo",),
                                                "flag": False})                 # TRL's; no run turns them
    lam: float = field(default=0.95, metadata={"help": "GAE lambda", "min": 0, "max": 1, "algos": ("ppo",),
                                               "flag": False})


@dataclass
class PPOParams(grpo.HyperParams, Knobs):
    """GRPO's knobs and the critic's."""
    algo: str = "ppo"
    kl_in_reward: bool = True        # PPO's habit: the KL is a reward penalty (--kl-in auto; kl.estimator: k1)


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the last hidden state; zero-initialised, so V starts at 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=h.device.type, enabled=False):     # float32 under bf16 autocast
            return self.linear(h.to(self.linear.weight.dtype)).squeeze(-1) # (n, C, H) -> (n, C)

    def values(self, tokens, h: torch.Tensor) -> torch.Tensor:
        """(n, C) values of the policy's hidden states h (n, C, H) predicting each token."""
        return self(h)


class Critic(nn.Module):
    """A critic of its own: a copy of the policy's trunk (its base_model, no LM head) and a
    fresh zero value head. Its values read the tokens, not the policy's hidden states."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.trunk = copy.deepcopy(policy.base_model).train(policy.training)
        self.head = ValueHead(policy.config.hidden_size).to(next(policy.parameters()).device)

    def values(self, tokens, h=None) -> torch.Tensor:
        """(n, C): the value of the state before each completion token."""
        return self.head(logprobs.completion_hidden(self.trunk, tokens)[:, :-1])      # (n, C)


# ---- rewards, advantages and the value loss ----

def last_policy_token(mask):
    """(n,) the index of each row's last token whose mask is 1 (0 for an all-zero row).

    Not mask.sum(1) - 1: in a multi-turn episode the environment's tokens (mask 0) sit
    between the policy's turns, so the 1s are not one unbroken run from position 0."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)     # (C,) 1-based
    return ((mask > 0) * positions).max(1).values.clamp_min(1) - 1         # (n,)


def token_rewards(rewards, mask, beta: float = 0.0, kl_t=None):
    """Outcome reward on the last policy token, minus beta * kl on every policy token. (n, C).

    rewards (n,), mask (n, C): 1 on the policy's tokens, which may come in several turns
    with the environment's tokens (0) in between; the reward goes on the last 1 of a row.
    """
    last = last_policy_token(mask)                                          # (n,)
    r = torch.zeros(mask.shape, device=mask.device)                         # (n, C) float32 (the default dtype)
    r[torch.arange(len(last)), last] = rewards.to(r.dtype)
    if kl_t is not None and beta > 0:
        r = r - beta * kl_t * mask
    return r * mask


def value_loss(values, old_values, returns, value_clip: float):
    """Per-token 1/2 max((V - G)^2, (V_clipped - G)^2), V_clipped = V_old + clip(V - V_old).
    value_clip = 0 gives the plain 1/2 (V - G)^2. (n, C)."""
    plain = (values - returns) ** 2
    if value_clip <= 0:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return 0.5 * torch.max(plain, (clipped - returns) ** 2)


def explained_variance(values, returns, mask) -> float:
    """1 - Var(G - V) / Var(G) over policy tokens: 1 is a perfect critic, 0 a constant one."""
    m = mask.bool()
    g, v = returns[m], values[m]
    var = g.var(correction=0)
    return (1 - (g - v).var(correction=0) / var).item() if var > 0 else float("nan")


def prepare(batch, hp: PPOParams) -> None:
    """Fill batch.advantages (n, C, whitened) and batch.returns (n, C) from its rewards."""
    kl_t = kl.estimate(batch.old_logp, batch.ref_logp, kl.estimator(hp)) \
        if (hp.kl_in_reward and batch.ref_logp is not None) else None                  # (n, C)
    r = token_rewards(batch.rewards.to(batch.old_logp.device), batch.completion_mask, hp.beta, kl_t)
    adv, batch.returns = advantages.gae(r, batch.old_values, batch.completion_mask, hp.gamma, hp.lam)
    batch.advantages = advantages.whiten(adv, batch.completion_mask)    # (n, C), every process's tokens


# ---- PPO's loss for one micro-batch (update.py's loop differentiates it) ----

def loss(logp, entropy, values, rows, mb, hp: PPOParams) -> tuple[torch.Tensor, dict]:
    """The mini-batch's share of PPO's loss from one micro-batch, and its per-token sums:

        loss = aggregate(-min(ratio * A, clip(ratio) * A) + vf_coef * L_value - entropy_coef * H)
                                                          (+ beta * kl with --kl-in loss)

    GRPO's policy terms (grpo.policy_loss) with the critic's value loss added; values (n, C)
    are the critic's now, rows.old_values and rows.returns its values when sampled and GAE's
    targets. value_loss is the token mean of the unweighted value loss (a metric)."""
    rows = grpo.harmless(rows, logp, values)           # a NaN where the mask is 0 never reaches the gradient
    per_token, sums = grpo.policy_loss(logp, rows.old_logp, entropy, rows, hp)          # (n, C)
    v_loss = value_loss(values, rows.old_values, rows.returns, hp.value_clip)            # (n, C)
    per_token = per_token + hp.vf_coef * v_loss
    sums["value_loss"] = (v_loss.detach() * rows.mask).sum().item()
    return grpo.aggregate(per_token, rows.mask, hp.loss_agg, mb.seqs, mb.tokens, hp.max_len), sums
