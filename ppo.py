"""PPO with a critic for language models: value head, token-level rewards, GAE, clipped losses.

Shapes as in grpo.py: n sequences, C completion tokens, H hidden size; mask (n, C) is 1 on
the policy's own tokens (its sampled EOS included).

The critic. A linear value head on the policy's last hidden state (a shared trunk, as TRL's
AutoModelForCausalLMWithValueHead): one forward pass gives both log-probs and values, and
--vf-coef weighs the two losses. The price is that value-loss gradients reach the policy's
weights; verl and OpenRLHF train a separate critic network instead, which costs a second
model. For a 130k-parameter toy the shared trunk is the simpler lesson.

One PPO step, per token t of sequence i:

    r_it     = R_i * [t is the last policy token] - beta * kl_it     (KL in the reward, --kl-in)
    A, G     = advantages.gae(r, V_old, mask, gamma, lam)            (G: the value targets)
    A        = whiten(A)                                             (over the batch's tokens)
    L_policy = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)    (grpo.clipped_surrogate)
    L_value  = 1/2 max((V - G)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - G)^2)
    loss     = L_policy + vf_coef * L_value - entropy_coef * H

averaged by grpo.aggregate and optimised by grpo.optimize (epochs over shuffled mini-batches,
CleanRL's early stop at --target-kl). Without --value-clip the value loss is 1/2 (V - G)^2.

    python train.py --algo ppo
"""
import torch
from torch import nn

import advantages
import grpo
import kl


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the last hidden state; zero-initialised, so V starts at 0."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=h.device.type, enabled=False):     # float32 under bf16 autocast
            return self.linear(h.float()).squeeze(-1)                      # (n, C, H) -> (n, C)


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
    r = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)   # (n, C)
    r[torch.arange(len(last)), last] = rewards.float()
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


def prepare(batch, *, beta: float, kl_estimator: str, kl_in_reward: bool, gamma: float,
            lam: float) -> None:
    """Fill batch.advantages (n, C, whitened) and batch.returns (n, C) from its rewards."""
    kl_t = kl.estimate(batch.old_logp, batch.ref_logp, kl_estimator) \
        if (kl_in_reward and batch.ref_logp is not None) else None
    r = token_rewards(batch.rewards.to(batch.old_logp.device), batch.completion_mask, beta, kl_t)
    adv, batch.returns = advantages.gae(r, batch.old_values, batch.completion_mask, gamma, lam)
    batch.advantages = advantages.whiten(adv, batch.completion_mask)


# ---- one PPO update ----

def update(model, value_head, optimizer, batch, *, epochs: int, mini_batch: int,
           micro_batch: int, clip_eps: float, clip_eps_high: float, value_clip: float,
           vf_coef: float, beta: float, kl_estimator: str, kl_in_loss: bool,
           entropy_coef: float, agg: str, max_len: int, max_grad_norm: float,
           temperature: float, seed: int, target_kl: float = 0.0, fast: bool = False) -> dict:
    """PPO's losses on one batch (after `prepare`), optimised by grpo.optimize (fast:
    length-sorted, trimmed micro-batches).

    Returns the metrics of grpo.update plus value_loss (token mean of the unweighted value
    loss) and epochs_run (fewer than --epochs when --target-kl stopped it)."""
    def loss_fn(idx, mb_seqs, mb_tokens):
        p_ids, p_mask, c_ids, attn, mask, cols = grpo.micro_batch_rows(batch, idx, trim=fast)  # (n, C)
        logp, ent, h = grpo.completion_logprobs(model, p_ids, p_mask, c_ids, attn, temperature,
                                                with_entropy=True, entropy_grad=entropy_coef > 0,
                                                return_hidden=True)
        old = batch.old_logp[idx][:, cols]
        surrogate, clipped = grpo.clipped_surrogate(logp, old, batch.advantages[idx][:, cols],
                                                    clip_eps, clip_eps_high)
        v_loss = value_loss(value_head(h), batch.old_values[idx][:, cols], batch.returns[idx][:, cols],
                            value_clip)
        per_token = -surrogate + vf_coef * v_loss                               # (n, C)
        if kl_in_loss and batch.ref_logp is not None:
            per_token = per_token + beta * kl.estimate(logp, batch.ref_logp[idx][:, cols], kl_estimator)
        if entropy_coef > 0:
            per_token = per_token - entropy_coef * ent
        loss = grpo.aggregate(per_token, mask, agg, mb_seqs, mb_tokens, max_len)
        log_ratio = (logp - old).detach()
        return loss, dict(entropy=(ent.detach() * mask).sum().item(),
                          clipped=(clipped.float() * mask).sum().item(),
                          value_loss=(v_loss.detach() * mask).sum().item(),
                          approx_kl=(((log_ratio.exp() - 1) - log_ratio) * mask).sum().item())

    model.train()
    params = list(model.parameters()) + list(value_head.parameters())
    out = grpo.optimize(params, optimizer, batch.completion_mask, loss_fn,
                        epochs=epochs, mini_batch=mini_batch, micro_batch=micro_batch,
                        max_grad_norm=max_grad_norm, seed=seed, target_kl=target_kl,
                        lengths=batch.attention().sum(1) if fast else None)
    out["clip_frac"] = out.pop("clipped")
    return out
