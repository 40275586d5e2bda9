"""Two guards every trainer learned the hard way (SkyRL, prime-rl, OpenRLHF, verl, TRL in 2026):
the token mean is the whole optimizer batch's, not each micro-batch's, so cutting a batch into
micro-batches leaves its gradient alone; and a NaN or inf in a masked-out position (padding,
a token the environment wrote) never reaches the loss, since 0 * NaN is NaN."""
import dataclasses

import pytest
import torch

import grpo
import logprobs
import ppo
import surrogates
from conftest import grpo_update, ppo_update, synthetic_batch, tiny_model

# Clip-Cov and KL-Cov choose their tokens among one micro-batch's, by its own covariance (verl
# calls its policy loss per micro-batch too): their gradient depends on --micro-batch, by design.
PER_MICRO_BATCH = ("clip-cov", "kl-cov")
INVARIANT = [name for name in surrogates.POLICY_LOSSES if name not in PER_MICRO_BATCH]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors this small gain nothing from a second thread; beside another job a second one made
    this file 40x slower (spinning threads). train.py takes 1 thread for the tiny model too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MODEL = tiny_model()
HEAD = ppo.ValueHead(MODEL.config.hidden_size)
torch.nn.init.normal_(HEAD.linear.weight, std=0.1, generator=torch.Generator().manual_seed(5))


def gradient(batch, hp, update=grpo_update) -> torch.Tensor:
    """The gradient one update leaves, every parameter, flat. SGD at lr 0 leaves the weights as
    they were, so every call starts from the same model (built once: most of a call's time)."""
    scorer = logprobs.Scorer(MODEL, HEAD if hp.algo == "ppo" else None)
    update(scorer, torch.optim.SGD(scorer.parameters(), lr=0.0), batch, hp)
    return torch.cat([p.grad.flatten() for p in scorer.parameters() if p.grad is not None])


def hyper(name: str, agg: str, micro: int) -> grpo.HyperParams:
    return grpo.HyperParams(mini_batch=8, micro_batch=micro, policy_loss=name, loss_agg=agg, beta=0.1,
                            entropy_coef=0.01, max_len=6, dual_clip_c=1.05, cispo_max=1.02)


@pytest.mark.lesson
@pytest.mark.parametrize("name", INVARIANT)
def test_one_batch_in_1_2_or_4_micro_batches_gives_one_gradient(name):
    """Every objective and aggregation: the 8 rows at once, in 2 micro-batches of 4 and in 4 of 2
    (old log-probs off the policy's, so the ratios leave 1 and the clips bite)."""
    batch = synthetic_batch(MODEL)
    for agg in grpo.AGGREGATIONS:
        whole = gradient(batch, hyper(name, agg, 8))
        assert whole.abs().sum() > 0
        for micro in (4, 2):
            torch.testing.assert_close(gradient(batch, hyper(name, agg, micro)), whole, rtol=1e-5, atol=1e-7)


def test_the_covariance_objectives_choose_their_tokens_per_micro_batch():
    """What PER_MICRO_BATCH says: KL-Cov's top tokens are a micro-batch's, so 2 micro-batches
    penalise other tokens than 1 (verl's behaviour; a reader comparing runs should know it)."""
    batch = synthetic_batch(MODEL)
    hp = dataclasses.replace(hyper("kl-cov", "token-mean", 8), cov_ratio=0.1)
    assert not torch.allclose(gradient(batch, hp), gradient(batch, dataclasses.replace(hp, micro_batch=4)))


def poisoned(batch):
    """The batch with NaN and inf wherever the mask is 0 (old and reference log-probs; PPO's
    values, returns and advantages per token)."""
    out = dataclasses.replace(batch)
    off = batch.completion_mask == 0
    for name, bad in (("old_logp", float("nan")), ("ref_logp", float("inf")), ("old_values", float("nan")),
                      ("returns", float("-inf"))):
        if getattr(batch, name, None) is not None:
            setattr(out, name, getattr(batch, name).masked_fill(off, bad))
    if batch.advantages is not None and batch.advantages.dim() == 2:
        out.advantages = batch.advantages.masked_fill(off, float("nan"))
    return out


@pytest.mark.lesson
@pytest.mark.parametrize("name", surrogates.POLICY_LOSSES)
def test_nan_and_inf_in_masked_out_positions_change_nothing(name):
    """Each objective, each aggregation: the poisoned batch gives the clean batch's gradient,
    finite, where `x * mask` would give NaN (0 * NaN = NaN killed 8 of 14 runs of one public
    report of 7B LoRA GRPO)."""
    batch = synthetic_batch(MODEL)
    assert (batch.completion_mask == 0).any()
    for agg in grpo.AGGREGATIONS:
        torch.manual_seed(0)                       # clip-cov draws its tokens at random
        clean = gradient(batch, hyper(name, agg, 4))
        torch.manual_seed(0)
        dirty = gradient(poisoned(batch), hyper(name, agg, 4))
        assert torch.isfinite(dirty).all(), f"{name} {agg}"
        torch.testing.assert_close(dirty, clean, rtol=1e-5, atol=1e-7)


def test_ppos_token_advantages_values_and_returns_poisoned_where_masked_change_nothing():
    batch = synthetic_batch(MODEL)
    hp = ppo.PPOParams(mini_batch=8, micro_batch=4, algo="ppo", beta=0.1, max_len=6, kl_in_reward=True)
    gen = torch.Generator().manual_seed(1)
    batch.rewards, batch.old_values = torch.randn(8, generator=gen), 0.1 * torch.randn(8, 6, generator=gen)
    ppo.prepare(batch, hp)                                  # returns and token advantages (GAE, whitened)
    clean = gradient(batch, hp, ppo_update)
    dirty = gradient(poisoned(batch), hp, ppo_update)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=1e-5, atol=1e-7)
