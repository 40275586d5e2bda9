"""What popular RL code gets wrong: six mistakes of a few characters each, found in the field's
teaching code and trainers, each written here as its source writes it, beside the formula this
course uses. A learner who copies one carries it into every run (Lesson 15).

tests/test_mistakes.py computes ours and the mistaken one on the same inputs (exact enumeration
over a small vocabulary, or a plain loop) and says how far apart they are; each test fails if the
mistake is put in place of ours. The sources, as public snapshots (repository at a commit, file,
lines):

1. PPO's clip inverted for A < 0 (`clip_inverted`). rasbt/reasoning-from-scratch at f79c9cd,
   ch07/03_rlvr_grpo_scripts_advanced/7_4_plus_clip_ratio.py lines 208-212 (so 7_5_plus_kl.py
   220-224 and 7_7_improvements/olmo3_style.py 227-231):
       obj = where(A >= 0, min(r A, clip(r) A), max(r A, clip(r) A))
   PPO takes min(r A, clip(r) A) for either sign of A. With A < 0 the max keeps the gradient of a
   token already pushed below 1 - eps (it keeps falling) and removes it from a bad token whose
   ratio rose past 1 + eps (nothing pulls it back): the trust region turned inside out. Dormant at
   those scripts' eps = 10 (no ratio leaves [-9, 11]); live at olmo3_style's eps_low = 0.2.
   `--policy-loss clip-inverted` trains with it.

2. A token mean over the micro-batch (`micro_token_mean`). karpathy/nanochat at 92d63d4,
   scripts/chat_rl.py lines 266-269: each micro-batch's sum of logp * A is divided by that
   micro-batch's valid tokens (times the passes), while line 9 promises DAPO's token-level
   normalisation, which divides by the tokens of the whole batch. A token of a micro-batch of
   short completions then weighs more than one of long completions, and the gradient depends on
   how the batch is cut. `--loss-agg micro-token-mean` trains with it (the same as token-mean when
   one micro-batch holds the whole mini-batch).

3. Sampling from one distribution, scoring with another (`sampled_ratio`). reasoning-from-scratch's
   scripts sample at temperature 0.8 and top-p 0.9 (7_4_plus_clip_ratio.py lines 43-44, 57-62) and
   score with log_softmax at temperature 1 over the whole vocabulary (line 83); nanochat samples with
   top-k 50 (chat_rl.py lines 49, 111) and differentiates the full softmax's log-prob (line 264). The
   policy gradient of p is then averaged over samples of q: the weight p(x) / q(x) that would correct
   it is never 1 and never applied (its log averages -KL(q || p)). `--rollout-temperature 0.8
   --top-p 0.9` trains with it; truncation.py has top-p's exact bias on a ratio.

4. A "KL" that is not one (`positions_kl`). huggingface/course at 8ab66da,
   chapters/en/chapter12/3a.mdx, "3. Updating the Policy":
       kl_div(log_softmax(new_per_token_logps, -1), softmax(per_token_logps, -1))
   The softmax runs over the positions of one sequence's sampled-token log-probs: it compares two
   distributions over positions, not the policies over the vocabulary, and at length 1 it is 0
   whatever the two policies are.

5. k3 as exp(x) - x - 1 in float32 (`k3_cancelling`). At |x| = 1e-6 exp(x) is 1 within one
   rounding step (6e-8), and the answer, x^2 / 2 = 5e-13, is lost below it: the estimate comes out
   -6e-8, a negative KL (at 1e-4, 0 for 5e-9). expm1(x) - x is off by at most a rounding of x:
   positive, and within 1% from |x| = 1e-5. kl.py wrote the cancelling form until this lesson (so
   does TRL's grpo_trainer.py at f2cd577, line 3072); it now writes expm1.

6. The KL term times the importance ratio (`kl_ratio_corrected`). TRL at f2cd577,
   trl/trainer/grpo_trainer.py lines 3075-3076: with use_bias_correction_kl, per_token_kl *
   coef_1, coef_1 = exp(log pi - log pi_old) with its gradient (DeepSeek-V3.2's estimator; off by
   default in that snapshot). Not a mistake in itself, and worth knowing why: without
   the ratio, the expected gradient of k3 = ref/pi - log(ref/pi) - 1 over x ~ pi is
   -E_ref[grad log pi], the gradient of the *forward* KL(ref || pi); with it, the score term
   k3 grad log pi is added and the gradient is that of the reverse KL(pi || ref) that the loss
   names. Both at once on-policy: the ratio's value is 1, its gradient is not 0. The mistake is at
   importance_sampling_level="sequence": coef_1 is then the sequence's ratio broadcast onto every
   token's KL (TRL's lines 3057-3059 and 3066), and token t's KL pulls on the log-probs of every other
   token of its sequence. kl.Knobs.kl_ratio_correction trains with the token-level correction.

7. Two the course already teaches: sequence-level k1 in the loss has zero expected gradient
   (kl.py), and a stop token left out of the loss mask is never learned (rollout.py).
"""
import torch

import kl
import truncation


def clip_inverted(ratio, adv, eps_low: float, eps_high: float):
    """Mistake 1 as a per-token loss with the (loss, low, high) of surrogates.ppo_clip: the objective
    takes the max of the two terms where A < 0. low / high: where the clipped term was taken."""
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    plain, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    objective = torch.where(a >= 0, torch.min(plain, clipped), torch.max(plain, clipped))
    taken = objective.ne(plain)
    return -objective, taken & (ratio < 1), taken & (ratio > 1)


def micro_token_mean(kept, mask, batch_seqs: int):
    """Mistake 2, aggregate's way: this micro-batch's token sum over its own tokens, divided by the
    number of micro-batches (batch_seqs / its sequences), as nanochat's chat_rl.py divides by
    num_valid * num_passes. kept: the per-token loss, 0 off the mask."""
    passes = batch_seqs / kept.shape[0]
    return kept.sum() / (mask.sum().clamp_min(1) * passes)


def sampled_ratio(logits, temperature: float = 0.8, top_p: float = 0.9):
    """Mistake 3 exactly, for one position: (q, r) with q the sampler's distribution (softmax of
    logits / temperature, cut to the top-p nucleus and renormalised) and r = p / q, the weight that
    would correct each token the sampler can draw, p the full softmax at temperature 1 that scores it."""
    keep = truncation.kept(logits / temperature, top_p)                     # the nucleus (transformers' rule)
    q = truncation.logprobs_over(logits / temperature, keep).exp()
    return q, torch.where(keep, torch.softmax(logits, -1) / q, torch.nan)


def positions_kl(new_logps, old_logps):
    """Mistake 4: the course's per-sequence "KL" over positions, new_logps, old_logps (C,) the
    sampled tokens' log-probs of one sequence; its sum (keepdim dropped)."""
    return torch.nn.functional.kl_div(torch.log_softmax(new_logps, -1), torch.softmax(old_logps, -1),
                                      reduction="none").sum(-1)


def k3_cancelling(logp, ref_logp):
    """Mistake 5: k3 with exp(x) - 1 cancelling in float32 (x = ref - logp). kl.estimate's k3 is
    expm1(x) - x, which keeps the x^2 / 2 that this loses."""
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def kl_ratio_corrected(logp, old_logp, ref_logp, mask, level: str = "token"):
    """Item 6: k3 times the importance ratio exp(log pi - log pi_old), with its gradient, per token
    ("token": each token's own ratio, kl.py's kl_ratio_correction) or, TRL's importance_sampling_level
    "sequence", the sequence's ratio exp(mean_t log r_t) broadcast onto each of its tokens. (n, C)."""
    k3 = kl.estimate(logp, ref_logp, "k3")
    log_r = logp - old_logp
    if level == "sequence":
        m = mask.to(log_r.dtype)
        log_r = ((log_r * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)).expand_as(logp)
    return k3 * torch.exp(log_r)
