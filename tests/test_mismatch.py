"""mismatch.py: the sampler's log-probs are the distribution it drew from; the corrections
against re-implementations of TRL's and verl's formulas; the lesson (truncated importance
sampling undoes a sampler's bias, by exact enumeration); the flags through train.py."""
import json

import pytest
import torch

import grpo
import logprobs
import mismatch
import rollout
import tasks
from conftest import assert_refused_in_one_line, configure, WARM_STARTS, quick, synthetic_batch, tiny_model
from models import policy


def model_and_tok(seed=0):
    tok = policy.build_tokenizer([f"w{i}" for i in range(17)])
    return tiny_model(seed), tok


def sampled(model, tok, sampling, sampler=None):
    torch.manual_seed(0)
    return rollout.sample(rollout.Models(model, tok, sampler=sampler), ["w3 w4", "w5 w6 w7"], 4, sampling)


# ---- the sampler's log-probs ----

@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_the_recorded_log_probs_are_the_samplers_distribution(temperature):
    """The same weights on both sides: generate's processed scores give, token for token, the
    log-probs a full forward at the sampling temperature gives (the null is float rounding)."""
    model, tok = model_and_tok()
    batch = sampled(model, tok, tasks.Sampling(temperature=1.0, rollout_temperature=temperature,
                                               rollout_logprobs=True, max_new_tokens=6))
    with torch.no_grad():
        at_t, _ = logprobs.completion_logprobs(model, batch.tokens(), temperature)
    m = batch.completion_mask.bool()
    assert (batch.rollout_logp[m] - at_t[m]).abs().max() < 1e-5
    if temperature != 1.0:       # the trainer's old log-probs are at T = 1: a mismatch by construction
        assert (batch.rollout_logp[m] - batch.old_logp[m]).abs().max() > 0.05


def test_a_bf16_sampler_is_what_differs_and_its_log_probs_are_its_own():
    model, tok = model_and_tok()
    copy = mismatch.RolloutPolicy("bf16").sampler(model)
    batch = sampled(model, tok, tasks.Sampling(rollout_logprobs=True, max_new_tokens=6), sampler=copy)
    m = batch.completion_mask.bool()
    with torch.no_grad():
        its_own, _ = logprobs.completion_logprobs(copy, batch.tokens())
    gap_own = (batch.rollout_logp[m] - its_own.float()[m]).abs().max()
    gap_fp32 = (batch.rollout_logp[m] - batch.old_logp[m]).abs()
    assert next(copy.parameters()).dtype == torch.bfloat16
    assert gap_own < 0.05 and gap_fp32.max() > 1e-3, (gap_own, gap_fp32.max())


def test_a_stale_sampler_holds_the_weights_of_n_updates_ago():
    model, _ = model_and_tok()
    stale = mismatch.RolloutPolicy(stale=2)
    weights = []
    for step in range(4):
        weights.append(model.lm_head.weight.detach().clone())
        copy = stale.sampler(model)
        expected = weights[max(0, step - 2)]
        assert torch.equal(copy.lm_head.weight, expected)
        with torch.no_grad():
            model.lm_head.weight.add_(0.1)                                # an "update"


# ---- the corrections against TRL's and verl's formulas ----

def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL GRPOTrainer's vllm_importance_sampling_ratio, token modes (grpo_trainer.py)."""
    ratio = torch.exp((old - sampling) * mask)
    if mode == "token_truncate":
        return torch.clamp(ratio, min=None, max=clip_max)
    invalid = (ratio < clip_min) | (ratio > clip_max)
    return ratio.masked_fill(invalid, 0.0)


def verl_geometric(old, rollout_logp, mask):
    """verl rollout_corr_helper, rollout_rs="geometric": exp(masked_mean(log ratio)) per sequence."""
    log_ratio = old - rollout_logp
    mean = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    return torch.exp(mean).expand_as(log_ratio)


def log_probs(seed=0, n=6, c=5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, c, generator=gen) * 3
    rollout_logp = old + 0.8 * torch.randn(n, c, generator=gen)
    mask = torch.ones(n, c)
    mask[0, 3:], mask[4, 1:] = 0, 0
    return old, rollout_logp, mask


@pytest.mark.lesson
@pytest.mark.parametrize("ours, trl", [("tis", "token_truncate"), ("mis", "token_mask")])
def test_token_corrections_equal_trls(ours, trl):
    old, mu, mask = log_probs()
    w = mismatch.correction(mismatch.log_weights(old, mu, mask, "token"), ours, 0.5, 2.0)
    ref = trl_is_ratio(old, mu, mask, trl, 0.5, 2.0)
    assert torch.allclose(w * mask, ref * mask)
    assert ((w > 0) & (w < 2.0)).any() and (w == (2.0 if ours == "tis" else 0.0)).any()   # both branches met


def test_the_sequence_level_weight_is_verls_geometric_mean():
    old, mu, mask = log_probs(seed=1)
    log_w = mismatch.log_weights(old, mu, mask, "sequence")
    assert torch.allclose(torch.exp(log_w) * mask, verl_geometric(old, mu, mask) * mask)


def skyrl_geometric(old_log_probs, rollout_logprobs, loss_mask, geo_mask_low, geo_mask_high):
    """SkyRL's compute_sequence_mask, sequence_mask_metric="geometric" (off_policy_correction_utils.py)."""
    token_tis_log_ratio = old_log_probs - rollout_logprobs
    num_tokens = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_tis_log_ratio = (token_tis_log_ratio * loss_mask).sum(dim=-1, keepdim=True)
    geo_mean_ratio = torch.exp((seq_tis_log_ratio / num_tokens).clamp(-20.0, 20.0))
    return (~(geo_mean_ratio > geo_mask_high) & ~(geo_mean_ratio < geo_mask_low)).float()


def nemo_rl_seq_error(prev_logprobs, generation_logprobs, mask, threshold):
    """NeMo-RL's compute_and_apply_seq_logprob_error_masking (grpo.py), its kept sequences."""
    lp_error = torch.abs(generation_logprobs - prev_logprobs)
    num = (torch.exp(lp_error * mask) * mask).sum(dim=-1)
    seq_mult_prob_error = num / mask.sum(dim=-1).clamp(min=1)
    return (seq_mult_prob_error <= threshold).float()


@pytest.mark.parametrize("mode, bound", [("geo-mask", 0.01), ("geo-mask", 0.3), ("seq-error-mask", 2.0),
                                         ("seq-error-mask", 1.5)])
def test_the_sequence_masks_keep_the_sequences_skyrl_and_nemo_rl_keep(mode, bound):
    kept_any = dropped_any = False
    for seed in range(6):
        old, mu, mask = log_probs(seed)
        mu = old + (mu - old) * (0.02 if seed % 2 else 1.0)        # some batches nearly on-policy
        mine = mismatch.sequence_mask(old, mu, mask, mode, bound)
        ref = skyrl_geometric(old, mu, mask, 1 - bound, 1 + bound) if mode == "geo-mask" else \
            nemo_rl_seq_error(old, mu, mask, bound).unsqueeze(1)
        assert torch.equal(mine, ref.expand_as(mine))
        kept_any, dropped_any = kept_any or bool(mine.any()), dropped_any or not bool(mine.all())
    assert kept_any and dropped_any, "both outcomes met"


@pytest.mark.lesson
def test_gaps_that_cancel_pass_the_geometric_mask_and_fail_the_error_mask():
    """A sequence the sampler saw 0.5 nats too likely at one token and 0.5 too unlikely at the
    next: its geometric-mean w is exactly 1 (SkyRL keeps it), its mean exp(|log w|) is
    e^0.5 = 1.65 (NeMo-RL's bound 1.5 drops it). The first asks whether the sequence as a whole
    is on-policy, the second whether the sampler agreed anywhere it looked."""
    old = torch.full((1, 2), -1.0)
    mu = old + torch.tensor([[0.5, -0.5]])
    mask = torch.ones(1, 2)
    assert mismatch.sequence_mask(old, mu, mask, "geo-mask", 0.01).tolist() == [[1.0, 1.0]]
    assert mismatch.sequence_mask(old, mu, mask, "seq-error-mask", 1.5).tolist() == [[0.0, 0.0]]


def test_the_weight_multiplies_each_tokens_policy_gradient_and_carries_none():
    """grpo.policy_loss with rows.is_weight: each token's loss, and its gradient, are the
    uncorrected ones times its weight; the weight itself is never differentiated."""
    model = tiny_model()
    batch = synthetic_batch(model)
    hp = grpo.HyperParams(mini_batch=8, micro_batch=8)
    gen = torch.Generator().manual_seed(3)
    weight = torch.rand(batch.completion_mask.shape, generator=gen)
    logp = (batch.old_logp + 0.1 * torch.randn(batch.old_logp.shape, generator=gen)).requires_grad_(True)
    entropy = torch.zeros_like(logp)
    rows = batch.rows(torch.arange(8))
    plain, _ = grpo.policy_loss(logp, batch.old_logp, entropy, rows, hp)
    g_plain, = torch.autograd.grad(plain.sum(), logp)
    rows.is_weight = weight
    weighted, _ = grpo.policy_loss(logp, batch.old_logp, entropy, rows, hp)
    g_weighted, = torch.autograd.grad(weighted.sum(), logp)
    assert torch.allclose(weighted, plain * weight) and torch.allclose(g_weighted, g_plain * weight)


# ---- the lesson: a sampler's bias, and what truncated IS does to it ----

@pytest.mark.lesson
def test_importance_weights_undo_a_samplers_bias_by_exact_enumeration():
    """Six answers, a trainer's policy pi and a sampler mu that under-samples the rare last
    answer (as a bf16 sampler is not an fp32 trainer, exaggerated). The policy gradient the
    trainer wants is E_pi[r grad log pi]. Sampling from mu and leaving w = pi / mu out gives
    E_mu[r grad log pi]: here the rare *good* answer is pushed down instead of up. With w it is
    exact; truncated at C = 2 (its w is 7.3) it is closer but keeps part of the bias; masked
    (ICEPOP) the answer is dropped and pushed down harder: masking is for tokens whose w is
    numerical noise, not a real gap between the two policies."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -2.0], requires_grad=True)
    r = torch.tensor([1.0, 0.2, 0.2, 0.0, 0.0, 1.0])                    # the rare last answer is good
    pi = torch.softmax(logits, 0)
    mu = torch.softmax(torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -4.0]), 0)    # the sampler under-samples it
    log_w = (pi.log() - mu.log()).detach().unsqueeze(0)                   # (1, V): w per answer

    def expected_grad(weight):          # sum_y mu(y) * weight(y) * r(y) * grad log pi(y), exactly
        return torch.autograd.grad((mu * weight * r * torch.log_softmax(logits, 0)).sum(), logits)[0]
    want = torch.autograd.grad((pi.detach() * r * torch.log_softmax(logits, 0)).sum(), logits)[0]
    none = expected_grad(torch.ones(6))
    exact = expected_grad(torch.exp(log_w[0]))
    tis = expected_grad(mismatch.correction(log_w, "tis", 0.5, 2.0)[0])
    mis_weight = mismatch.correction(log_w, "mis", 0.5, 2.0)[0]
    mis = expected_grad(mis_weight)
    assert torch.allclose(exact, want, atol=1e-6)
    assert want[5] > 0 > none[5]                                          # uncorrected: the wrong way
    assert (tis - want).norm() < (none - want).norm() and tis[5] < 0      # truncated: closer, not there
    assert torch.exp(log_w[0, 5]) > 7 and mis_weight[5] == 0 and mis[5] < none[5]   # masked: dropped


def test_diagnostics_by_hand():
    log_w = torch.log(torch.tensor([1.0, 2.0, 0.5, 1.0]))
    d = mismatch.diagnostics(log_w, torch.tensor([0.0, 0.1]))
    assert d["sampling/sampling_logp_difference/max"] == pytest.approx(0.693147, abs=1e-6)
    assert d["sampling/raw_importance_ratio/mean"] == pytest.approx(4.5 / 4)
    assert d["sampling/effective_sample_size"] == pytest.approx(4.5 ** 2 / (4 * 6.25))
    assert d["sampling/raw_importance_ratio/seq_max"] == pytest.approx(1.105171, abs=1e-6)
    assert not any("importance_sampling_ratio" in k and "raw" not in k for k in d), "no correction: no corrected ratio"


def test_the_logged_importance_sampling_ratio_is_the_corrected_one_as_trls():
    """TRL logs sampling/importance_sampling_ratio after its truncation (token_truncate: the
    ratio clamped at C); the raw weight has a name of its own here."""
    log_w = torch.log(torch.tensor([1.0, 4.0, 0.5, 1.0]))
    trl_ratio = torch.exp(log_w).clamp(max=2.0)                           # TRL: vllm_importance_sampling_ratio
    d = mismatch.diagnostics(log_w, torch.tensor([0.0]), mismatch.correction(log_w, "tis", 0.5, 2.0))
    assert d["sampling/importance_sampling_ratio/max"] == pytest.approx(trl_ratio.max().item())
    assert d["sampling/importance_sampling_ratio/mean"] == pytest.approx(trl_ratio.mean().item())
    assert d["sampling/raw_importance_ratio/max"] == pytest.approx(4.0)


# ---- through train.py ----

def metrics(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


BASE = ["--steps", "4", "--eval-every", "4", "--epochs", "2"]


def test_the_null_run_logs_a_zero_mismatch_and_learns_as_before(tmp_path):
    """--log-mismatch alone: the sampler is the policy, the difference is float rounding, and
    the run's rollouts and losses are the plain run's. On a CPU in float32: on a GPU under bf16
    autocast the same null run's largest difference was 0.0086 (results/gpu/README.md): bf16's
    rounding, between sampling's cached forward and the update's whole one, is far larger."""
    from running import config
    import train
    train.train(configure(quick(tmp_path, "plain", *BASE, "--device", "cpu")))
    train.train(configure(quick(tmp_path, "null", *BASE, "--log-mismatch", "--device", "cpu")))
    plain, null = metrics(tmp_path / "plain"), metrics(tmp_path / "null")
    for a, b in zip(plain[1:], null[1:]):
        assert a["reward_mean"] == b["reward_mean"]
        assert a["loss"] == b["loss"] or a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert b["sampling/sampling_logp_difference/max"] < 1e-4


@pytest.mark.parametrize("flags", [["--rollout-dtype", "bf16", "--rollout-correction", "tis"],
                                   ["--rollout-stale", "1", "--rollout-correction", "mis",
                                    "--rollout-correction-level", "sequence"],
                                   ["--rollout-temperature", "1.5", "--rollout-correction", "tis"],
                                   ["--rollout-stale", "1", "--rollout-correction", "geo-mask", "--geo-mask-eps", "0.5"],
                                   ["--rollout-stale", "1", "--rollout-correction", "seq-error-mask",
                                    "--seq-error-max", "3"],
                                   ["--lora-rank", "2", "--lr", "1e-2", "--rollout-stale", "1",
                                    "--rollout-correction", "tis"]])      # the sampler holds old adapters
def test_a_made_mismatch_is_logged_and_corrected(flags, tmp_path):
    from running import config
    import train
    train.train(configure(quick(tmp_path, "m", *BASE, "--entropy-coef", "0.01", *flags)))  # every step updates
    rows = metrics(tmp_path / "m")[1:]
    assert all(r["updated"] for r in rows) and all(r["sampling/sampling_logp_difference/max"] > 1e-3 for r in rows[1:])
    assert all(0 < r["sampling/importance_sampling_ratio/mean"] for r in rows)
    assert all(0 < r["sampling/effective_sample_size"] <= 1 + 1e-9 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--rollout-stale", "-1"], "--rollout-stale: must be in [0, 64]"),
    (["--rollout-temperature", "-1"], "--rollout-temperature: must be in [0, 1000]"),
    (["--rollout-correction", "tis", "--rollout-c-max", "1"], "--rollout-c-max: must be > 1"),
    (["--rollout-correction", "mis", "--rollout-c-min", "1.5"], "--rollout-c-min: must be in (0, 1)"),
    (["--rollout-c-max", "5"], "--rollout-c-max: only --rollout-correction reads it"),
    (["--rollout-correction", "tis", "--rollout-c-min", "0.2"], "--rollout-c-min: only --rollout-correction mis"),
    (["--rollout-correction", "tis", "--task", "tools"], "--task: the tool task's multi-turn episodes do not record"),
    (["--rollout-correction", "geo-mask", "--geo-mask-eps", "0"], "--geo-mask-eps: must be in (0, 1)"),
    (["--rollout-correction", "seq-error-mask", "--seq-error-max", "1"], "--seq-error-max: must be > 1"),
    (["--rollout-correction", "tis", "--geo-mask-eps", "0.1"], "--geo-mask-eps: only --rollout-correction geo-mask"),
    (["--rollout-correction", "geo-mask", "--rollout-c-max", "5"], "--rollout-c-max: only --rollout-correction tis and mis"),
    (["--rollout-correction", "seq-error-mask", "--rollout-c-max", "5"], "--rollout-c-max: only --rollout-correction tis"),
    (["--rollout-correction", "bypass", "--rollout-correction-level", "sequence"],
     "--rollout-correction-level: only --rollout-correction tis and mis read it"),
    (["--rollout-correction", "tis", "--algo", "rce"], "--rollout-correction: only --algo grpo and ppo use it"),
])
def test_bad_mismatch_settings_are_refused_in_one_line(argv, message, tmp_path, capsys):
    assert_refused_in_one_line(tmp_path, capsys, argv, message)


def test_under_fast_the_old_log_probs_come_before_the_update_when_a_mismatch_is_weighed(tmp_path):
    """--fast takes pi_old from the update's own forward; the weight pi_old / mu must exist
    before the update, so a run that records the sampler's log-probs scores pi_old first."""
    from running import config
    assert config.parse_config(quick(tmp_path, "f", "--fast")).reuse_old_logp
    assert not config.parse_config(quick(tmp_path, "g", "--fast", "--log-mismatch")).reuse_old_logp
    assert not config.parse_config(quick(tmp_path, "h", "--fast", "--rollout-correction", "tis")).reuse_old_logp


def test_a_resumed_stale_sampler_samples_what_an_uninterrupted_one_does(tmp_path):
    """--rollout-stale's old weights were kept in memory only: a resumed run's first steps
    sampled fresher weights, and its numbers left the uninterrupted run's."""
    from running import config
    import train
    argv = ["--rollout-stale", "2", "--rollout-correction", "tis", "--entropy-coef", "0.01", "--lr", "0.01"]
    train.train(configure(quick(tmp_path, "whole", "--steps", "6", *argv)))
    train.train(configure(quick(tmp_path, "cut", "--steps", "3", "--save-every", "3", *argv,
                                          "--cache-dir", str(WARM_STARTS))))
    train.train(config.parse_config(["--resume", str(tmp_path / "cut"), "--steps", "6"]))
    whole, cut = metrics(tmp_path / "whole")[1:], metrics(tmp_path / "cut")[1:]
    for key in ("reward_mean", "loss", "sampling/raw_importance_ratio/mean"):
        assert [r[key] for r in cut] == pytest.approx([r[key] for r in whole], rel=1e-5), key


def test_under_bypass_the_update_takes_the_samplers_log_probs_as_pi_old(tmp_path):
    """One epoch, one mini-batch: with pi_old recomputed every ratio the update sees is exactly 1;
    with --rollout-correction bypass it is pi / mu, here a sampler one update stale, so it leaves
    1; both runs log the same kind of mismatch (the metrics keep the recomputed pi_old)."""
    import train
    ratios = {}
    for name, flags in (("recomputed", ["--log-mismatch"]), ("bypass", ["--rollout-correction", "bypass"])):
        train.train(configure(quick(tmp_path, name, "--steps", "4", "--eval-every", "4", "--epochs", "1",
                                    "--entropy-coef", "0.01", "--rollout-stale", "1", *flags)))
        rows = metrics(tmp_path / name)[2:]                       # from the second update the sampler is stale
        ratios[name] = [(r["ratio_min"], r["ratio_max"]) for r in rows]
        assert all(r["sampling/sampling_logp_difference/max"] > 1e-3 for r in rows), name
    assert all(lo == pytest.approx(1.0, abs=1e-5) and hi == pytest.approx(1.0, abs=1e-5) for lo, hi in ratios["recomputed"])
    assert all(hi - lo > 1e-3 for lo, hi in ratios["bypass"])
