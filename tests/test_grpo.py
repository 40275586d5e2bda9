"""grpo.py and update.py's loop against references: hand arithmetic, the full-batch gradient, CleanRL's shuffle."""
import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

import grpo
import surrogates
import logprobs
import update
from conftest import grpo_update, synthetic_batch, tiny_model
from grpo import HyperParams
from rollout import completion_mask


@pytest.mark.parametrize("ratio, adv, expected, clipped", [
    (1.1, 2.0, 1.1 * 2.0, False),        # inside the range: plain ratio * A
    (1.5, 2.0, 1.2 * 2.0, True),         # A > 0, ratio above 1+eps: capped at 1.2 * A
    (0.5, 2.0, 0.5 * 2.0, False),        # A > 0, ratio below 1-eps: min keeps the smaller 0.5*A
    (0.5, -2.0, 0.8 * -2.0, True),       # A < 0, ratio below 1-eps: floored at 0.8 * A
    (1.5, -2.0, 1.5 * -2.0, False),      # A < 0, ratio above 1+eps: min keeps the worse 1.5*A
])
@pytest.mark.lesson
def test_ppo_clip_against_hand_arithmetic(ratio, adv, expected, clipped):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio))
    loss, low, high = surrogates.ppo_clip(torch.exp(logp - old), torch.tensor([adv]), 0.2, 0.2)
    assert -loss.item() == pytest.approx(expected, rel=1e-6)
    assert (low | high).item() == clipped


@pytest.mark.lesson
def test_decoupled_upper_clip():
    logp = torch.full((1, 1), math.log(1.25))
    loss, _, _ = surrogates.ppo_clip(torch.exp(logp), torch.tensor([1.0]), 0.2, 0.28)
    assert -loss.item() == pytest.approx(1.25)      # inside DAPO's wider upper bound


@pytest.mark.lesson
def test_aggregations_against_hand_arithmetic():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert grpo.aggregate(loss, mask, "token-mean", 2, 4, 3).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert grpo.aggregate(loss, mask, "seq-mean-token-mean", 2, 4, 3).item() == pytest.approx((2 + 4) / 2)
    assert grpo.aggregate(loss, mask, "constant", 2, 4, 3).item() == pytest.approx(10 / (2 * 3))
    with pytest.raises(ValueError, match="unknown aggregation"):
        grpo.aggregate(loss, mask, "bogus", 2, 4, 3)


@pytest.mark.parametrize("agg", grpo.AGGREGATIONS)
@pytest.mark.lesson
def test_micro_batched_gradient_equals_full_batch_gradient(agg):
    grads = []
    for micro in (8, 2):
        model = tiny_model()
        batch = synthetic_batch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)          # lr 0: keep the weights
        grpo_update(logprobs.Scorer(model), opt, batch, HyperParams(mini_batch=8, micro_batch=micro, beta=0.1,
                                                   entropy_coef=0.01, loss_agg=agg, max_len=6))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().sum() > 0


def test_non_finite_loss_skips_the_step_and_leaves_weights_unchanged():
    model = tiny_model()
    batch = synthetic_batch(model)
    batch.advantages[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = grpo_update(logprobs.Scorer(model), opt, batch, HyperParams(mini_batch=8, micro_batch=8, max_len=6,
                                                       max_grad_norm=1.0))
    assert stats["skipped_nonfinite"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.lesson
def test_completion_mask_keeps_the_sampled_eos_and_drops_what_follows():
    eos = 1
    ids = torch.tensor([[5, 6, eos, 0, 0], [5, eos, eos, eos, eos], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(completion_mask(ids, eos), expected)
    # pad == eos (many real tokenizers): the second row is what generate returns then, and
    # the first EOS still counts as the policy's own token.


# ---- the update loop's parts: shuffling, steps taken, the grad-norm metric ----

@pytest.mark.lesson
def test_mini_batches_are_shuffled_every_epoch_even_with_one_epoch():
    batch = synthetic_batch(tiny_model())
    hp = HyperParams(mini_batch=2, micro_batch=1)
    gen = torch.Generator().manual_seed(7)
    seen = [[mb.micro_batches[0].item(), mb.micro_batches[1].item()]
            for _ in range(2) for mb in update.minibatches(batch, hp, gen)]
    # the reference (CleanRL): a fresh permutation of the N rows per epoch, cut into mini-batches
    ref = torch.Generator().manual_seed(7)
    expected = [perm[i:i + 2].tolist() for perm in (torch.randperm(8, generator=ref) for _ in range(2))
                for i in range(0, 8, 2)]
    assert seen == expected and seen[:4] != [[0, 1], [2, 3], [4, 5], [6, 7]]   # one epoch shuffles too
    one = list(update.minibatches(batch, HyperParams(mini_batch=8, micro_batch=8), gen))
    assert len(one) == 1 and one[0].micro_batches[0].tolist() == list(range(8))   # one: no order
    assert one[0].seqs == 8 and one[0].tokens == int(batch.completion_mask.sum())


def test_grad_norm_is_the_mean_over_mini_batches_and_steps_taken_counts_applied_steps():
    """update's bookkeeping on a loss whose gradient is sum(scales[idx]) * ones(4): a
    mini-batch's gradient norm is 2 * sum(scales[idx]); the one holding row 0 is NaN."""
    scales = torch.arange(1.0, 9.0)
    for nan_row, steps in ((0, 3), (None, 4)):
        w = torch.zeros(4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.0)
        stats, norms = update.UpdateStats(), []
        stats.new_epoch()
        for idx in torch.arange(8).view(4, 2):
            opt.zero_grad()
            loss = (scales[idx].sum() * w).sum() * (float("nan") if nan_row in idx.tolist() else 1.0)
            loss.backward()
            stats.add(loss.item(), {"approx_kl": 0.0}, torch.ones(3))
            stats.stepped(*update.optimizer_step(opt, math.inf, stats.whole_minibatch_loss()))
            norms.append(2 * scales[idx].sum().item())
        result = stats.result()
        assert result["steps_taken"] == steps and result["skipped_nonfinite"] == 4 - steps
        if nan_row is None:
            assert result["grad_norm"] == pytest.approx(sum(norms) / 4)
        else:
            assert result["nonfinite"] == ["loss", "grad_norm"]
            assert math.isnan(result["grad_norm"])     # a NaN mini-batch shows in the mean, not hidden


# ---- dropout is off for RL ----

def gpt2_model(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=20, n_positions=32, n_embd=16, n_layer=2, n_head=2)   # dropouts 0.1
    return GPT2LMHeadModel(cfg)


def first_epoch_ratio_stats(model):
    """One GRPO update whose old log-probs were recorded in eval mode, as sampling records them."""
    batch = synthetic_batch(model)
    model.eval()
    with torch.no_grad():
        batch.old_logp, _ = logprobs.completion_logprobs(model, batch.tokens())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return grpo_update(logprobs.Scorer(model), opt, batch, HyperParams(mini_batch=8, micro_batch=8, max_len=6))


@pytest.mark.lesson
def test_with_dropout_disabled_the_first_epoch_ratio_is_exactly_one():
    noisy = first_epoch_ratio_stats(gpt2_model())
    assert noisy["approx_kl"] > 1e-4                      # GPT-2's 0.1 dropouts: ratio != 1 at once
    model = gpt2_model()
    assert logprobs.disable_dropout(model) > 0
    exact = first_epoch_ratio_stats(model)
    assert exact["approx_kl"] == 0.0 and exact["clip_frac"] == 0.0
    assert logprobs.disable_dropout(model) == 0             # nothing left on
    # Qwen2 keeps its attention dropout in a float attribute, not an nn.Dropout
    cfg = tiny_model().config
    cfg.attention_dropout = 0.5
    qwen = Qwen2ForCausalLM(cfg)
    assert logprobs.disable_dropout(qwen) == 1 and qwen.config.attention_dropout == 0.0
    assert first_epoch_ratio_stats(qwen)["approx_kl"] == 0.0


@pytest.mark.lesson
def test_policy_shift_is_the_k3_the_update_made_where_one_epochs_approx_kl_is_zero():
    """approx_kl is measured before each mini-batch's step: with one epoch of one mini-batch it
    is exactly 0 on-policy. policy_shift, one forward after the update, is the KL(old || new)
    the step made (report 003's range rule reads it), checked against a plain loop."""
    model = tiny_model()
    batch = synthetic_batch(model)
    with torch.no_grad():
        batch.old_logp, _ = logprobs.completion_logprobs(model, batch.tokens())       # on-policy
    hp = HyperParams(mini_batch=8, micro_batch=4, max_len=6)
    stats = grpo_update(logprobs.Scorer(model), torch.optim.SGD(model.parameters(), lr=1.0), batch, hp)
    assert stats["approx_kl"] == 0.0
    with torch.no_grad():
        new, _ = logprobs.completion_logprobs(model, batch.tokens())
    terms = [math.exp(n - o) - (n - o) - 1 for row_n, row_o, row_m in zip(new.tolist(), batch.old_logp.tolist(),
             batch.completion_mask.tolist()) for n, o, m in zip(row_n, row_o, row_m) if m]
    shift = update.policy_shift(logprobs.Scorer(model), batch, hp)
    assert shift > 0 and shift == pytest.approx(sum(terms) / len(terms), rel=1e-4)


@pytest.mark.lesson
def test_adam_undoes_a_clip_that_scales_every_step_alike_and_feels_only_a_spike():
    """Why report 002's clipping table did not reproduce under AdamW (the lab's grad_clip):
    Adam divides the first moment by the root of the second, so gradients scaled by c on every
    step give the same steps (to eps); SGD's steps scale by c. Hand arithmetic of Adam's first
    step: m = (1 - b1) g, v = (1 - b2) g^2, bias-corrected g and g^2, so the step is
    lr * g / (|g| + eps), about lr * sign(g) whatever |g|. A clip acts on Adam only where one
    step's norm spikes above the others': update.optimizer_step's max_grad_norm then changes
    the trajectory."""
    torch.manual_seed(0)
    grads = [2 * g / g.norm() for g in torch.randn(6, 5)]          # six directions, each of norm 2

    def trajectory(opt_cls, scale, max_norm=math.inf, spike_at=None, **kw):
        w = torch.nn.Parameter(torch.zeros(5))
        opt = opt_cls([w], lr=0.1, **kw)
        for t, g in enumerate(grads):
            w.grad = g * scale * (100.0 if t == spike_at else 1.0)
            update.optimizer_step(opt, max_norm, 0.0)
        return w.detach().clone()

    adam = dict(weight_decay=0.0, eps=1e-8)
    one = torch.nn.Parameter(torch.zeros(5))
    first = torch.optim.AdamW([one], lr=0.1, **adam)
    one.grad = 1e-3 * grads[0]
    first.step()
    assert torch.allclose(one.detach(), -0.1 * grads[0] / (grads[0].abs() + 1e-8 / 1e-3), rtol=1e-5)   # lr * sign(g)
    assert torch.allclose(trajectory(torch.optim.AdamW, 1e-3, **adam), trajectory(torch.optim.AdamW, 1.0, **adam),
                          rtol=1e-4, atol=1e-6)                                       # scale undone
    assert torch.allclose(trajectory(torch.optim.SGD, 1e-3), 1e-3 * trajectory(torch.optim.SGD, 1.0), rtol=1e-5)
    # a clip at 1 on gradients of norm 2: every step halved alike, and Adam's steps do not move
    unclipped, clipped = trajectory(torch.optim.AdamW, 1.0, **adam), trajectory(torch.optim.AdamW, 1.0, 1.0, **adam)
    assert torch.allclose(clipped, unclipped, rtol=1e-5, atol=1e-6)
    # one step 100x the others: unclipped, it fills Adam's second moment and shrinks every later
    # step; clipped to norm 1 like the rest, it does not. Here the clip changes the weights by
    # about the size of a step (lr 0.1)
    spiked, spiked_clipped = (trajectory(torch.optim.AdamW, 1.0, m, spike_at=2, **adam) for m in (math.inf, 1.0))
    assert (spiked - spiked_clipped).abs().max() > 0.05


def test_optimizer_sgd_is_plain_steps_whose_size_the_clip_bounds(tmp_path):
    """--optimizer sgd (report 002's clipping regime): train.py builds torch's SGD at --lr with no
    momentum, and one step moves the weights by exactly lr * g * min(1, c / |g|), so the clip
    bounds every step's size; a run with it trains, and its checkpoint holds SGD's state."""
    from running import config
    import train
    cfg = config.parse_config(["--optimizer", "sgd", "--lr", "0.1", "--out", str(tmp_path / "unused")])
    w = torch.nn.Parameter(torch.zeros(5))
    _, opt = train.reference_and_optimizer(cfg, torch.nn.Linear(1, 1), None)
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.1 and opt.defaults["momentum"] == 0
    opt = torch.optim.SGD([w], **opt.defaults)
    g = torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0])                       # norm 5
    w.grad = g.clone()
    norm, bad = update.optimizer_step(opt, 1.0, 0.0)
    assert norm == pytest.approx(5.0) and not bad
    assert torch.allclose(w.detach(), -0.1 * g / 5, atol=1e-7)        # a step of norm lr * 1
    from conftest import quick
    train.train(config.parse_config(quick(tmp_path, "sgd", "--optimizer", "sgd", "--lr", "0.05", "--steps", "2",
                                          "--save-every", "2")))
    state = torch.load(tmp_path / "sgd" / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=True)
    group = state["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.05 and "momentum" in group and "betas" not in group
