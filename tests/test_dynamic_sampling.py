"""DAPO's dynamic sampling (dynamic_sampling.py): which groups are kept, in what order, what
happens at the cap, that merging rounds leaves every log-prob as it was, and a run's logs."""
import json
import math

import pytest
import torch

from running import config
import dynamic_sampling
import logprobs
import train
from conftest import configure, quick, synthetic_batch, tiny_model


@pytest.mark.lesson
def test_informative_groups_by_hand():
    r = torch.tensor([1.0, 1.0, 1.0, 0.2, 0.0, 0.0, math.nan, 0.0])     # K = 2
    assert dynamic_sampling.informative(r, 2).tolist() == [False, True, False, True]


def scripted(rounds: list, k: int):
    """sample_round for the test: round j's rewards are rounds[j]; prompts are ids, outcomes
    name their prompt and sample."""
    calls = []
    model = tiny_model()

    def sample_round(prompts):
        r = torch.tensor(rounds[len(calls)], dtype=torch.float)
        calls.append(list(prompts))
        batch = synthetic_batch(model, n=len(r), seed=len(calls))
        batch.rewards = r
        return batch, [f"{p}/{j}" for p in prompts for j in range(k)]
    return sample_round, calls


@pytest.mark.lesson
def test_rounds_go_on_until_b_groups_differ_and_keep_them_in_order():
    # B = 3, K = 2: round 1 has one informative group (prompt 1), round 2 two (prompts 3, 5)
    sample_round, calls = scripted([[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0.2, 1], [1, 0, 1, 0, 1, 0]], 2)
    fresh = iter([[3, 4, 5], [6, 7, 8]])
    batch, outcomes, prompts, stats = dynamic_sampling.sample(sample_round, lambda: next(fresh), [0, 1, 2], 2, dynamic_sampling.Budget(8))
    assert calls == [[0, 1, 2], [3, 4, 5]], "stops as soon as B groups are kept"
    assert prompts == [1, 3, 5] and outcomes == ["1/0", "1/1", "3/0", "3/1", "5/0", "5/1"]
    assert batch.rewards.tolist() == pytest.approx([0, 1, 1, 0, 0.2, 1])
    assert stats == dict(sampling_rounds=2, samples_generated=12, groups_kept=3)
    assert len(batch.texts) == 6 and batch.completion_mask.shape[0] == 6


@pytest.mark.lesson
def test_at_the_cap_the_step_keeps_fewer_groups_or_none():
    sample_round, calls = scripted([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 0]], 2)
    fresh = iter([[2, 3], [4, 5]])
    batch, _, prompts, stats = dynamic_sampling.sample(sample_round, lambda: next(fresh), [0, 1], 2, dynamic_sampling.Budget(2))
    assert prompts == [1] and stats == dict(sampling_rounds=2, samples_generated=8, groups_kept=1)
    sample_round, _ = scripted([[1, 1, 0, 0], [0, 0, 1, 1]], 2)
    fresh = iter([[2, 3]])
    batch, outcomes, prompts, stats = dynamic_sampling.sample(sample_round, lambda: next(fresh), [0, 1], 2, dynamic_sampling.Budget(2))
    assert stats["groups_kept"] == 0 and prompts == [2, 3] and batch.rewards.tolist() == [0, 0, 1, 1], \
        "none kept: the last round as sampled"


@pytest.mark.lesson
def test_merging_rounds_pads_without_changing_any_log_prob():
    model = tiny_model()
    a = synthetic_batch(model, n=4, p_len=3, c_len=5, seed=1)
    b = synthetic_batch(model, n=2, p_len=6, c_len=4, seed=2)
    for x in (a, b):
        x.rewards = torch.zeros(len(x.texts))
    merged = dynamic_sampling.merge([a, b])
    assert merged.prompt_ids.shape == (6, 6) and merged.completion_ids.shape == (6, 5)
    assert (merged.prompt_mask[:4, :3] == 0).all() and (merged.completion_mask[4:, 4:] == 0).all()
    with torch.no_grad():
        whole, _ = logprobs.completion_logprobs(model, merged.tokens())
        parts = [logprobs.completion_logprobs(model, x.tokens())[0] for x in (a, b)]
    for rows, part in ((slice(0, 4), parts[0]), (slice(4, 6), parts[1])):
        m = merged.completion_mask[rows][:, :part.shape[1]].bool()
        assert torch.allclose(whole[rows][:, :part.shape[1]][m], part[m], atol=1e-5)
    assert torch.equal(merged.old_logp[:4], a.old_logp) and (merged.old_logp[4:, 4:] == 0).all()


def test_a_run_with_dynamic_sampling_logs_its_rounds_and_trains_on_differing_groups(tmp_path):
    summary = train.train(config.parse_config(quick(tmp_path, "ds", "--dynamic-sampling", "--max-sampling-rounds",
                                                    "3", "--sft-steps", "60")))
    rows = [json.loads(x) for x in (tmp_path / "ds" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert summary["steps"] == 3 and len(rows) == 3
    for r in rows:
        assert 1 <= r["sampling_rounds"] <= 3 and r["samples_generated"] == r["sampling_rounds"] * 2 * 4
        assert 0 <= r["groups_kept"] <= 2
        if r["groups_kept"] > 0:
            assert r["frac_reward_zero_std"] == 0.0, "a kept batch holds no zero-variance group"


@pytest.mark.lesson
def test_the_budget_in_seconds_and_a_stop_end_the_rounds_after_the_one_in_progress():
    """Near-greedy sampling made every group one reward, round after round; with a
    huge --max-sampling-rounds a step ran on for minutes and obeyed SIGTERM after ~180 s."""
    sample_round, calls = scripted([[0, 0, 0, 0]] * 50, 2)
    fresh = iter([[i, i + 1] for i in range(2, 100, 2)])
    _, _, _, stats = dynamic_sampling.sample(sample_round, lambda: next(fresh), [0, 1], 2,
                                             dynamic_sampling.Budget(10 ** 9, seconds=0.0))
    assert stats["sampling_rounds"] == 1, "the time budget ends the step after its first round"
    asked = iter([False, False, True])
    _, _, _, stats = dynamic_sampling.sample(sample_round, lambda: next(fresh), [0, 1], 2,
                                             dynamic_sampling.Budget(10 ** 9, stop=lambda: next(asked)))
    assert stats["sampling_rounds"] == 3, "a stop ends the rounds after the one in progress"


@pytest.mark.parametrize("norm", ["global", "group"])
def test_with_no_group_kept_the_step_takes_no_update_and_says_why(norm, tmp_path, monkeypatch, capsys):
    """Under --norm global the rejected groups' advantages are not 0 ([-1, -1, 1, 1]
    for two groups of equal rewards 0 and 1); training on them would be training on what the
    filter refused. verl raises; here the step is skipped, logged with its reason."""
    monkeypatch.setattr(dynamic_sampling, "informative", lambda rewards, k: torch.zeros(len(rewards) // k, dtype=torch.bool))
    argv = quick(tmp_path, "none", "--dynamic-sampling", "--max-sampling-rounds", "2", "--norm", norm)
    argv.remove("--quiet")
    train.train(config.parse_config(argv))
    rows = [json.loads(x) for x in (tmp_path / "none" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert all(r["groups_kept"] == 0 and r["sampling_rounds"] == 2 for r in rows)
    assert all(r["update_skipped"] == "no_group_kept" and r["steps_taken"] == 0 and r["skipped_nonfinite"] == 0
               for r in rows)
    err = capsys.readouterr().err
    assert err.count("each prompt's 4 samples got the same reward") == 1, err       # said once, in plain words


@pytest.mark.parametrize("argv, flag", [
    (["--dynamic-sampling", "--algo", "ppo"], "--dynamic-sampling"),
    (["--dynamic-sampling", "--algo", "rce"], "--dynamic-sampling"),
    (["--dynamic-sampling", "--k", "1", "--norm", "global"], "--dynamic-sampling"),
    (["--max-sampling-rounds", "0"], "--max-sampling-rounds"),
])
def test_bad_dynamic_sampling_flags_exit_2_naming_the_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_config(argv + ["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_every_rollout_field_is_either_carried_through_the_filter_or_named_as_not_per_row():
    """A per-row field left out of the filter is silently dropped: rollout_logp once was, and
    --rollout-correction then had nothing to correct with."""
    import dataclasses
    from rollout import Rollout
    listed = set(dynamic_sampling.PROMPT_FIELDS + dynamic_sampling.COMPLETION_FIELDS + dynamic_sampling.NOT_PADDED)
    assert {f.name for f in dataclasses.fields(Rollout)} == listed


def test_merge_and_select_keep_the_samplers_log_probs():
    model = tiny_model()
    a, b = synthetic_batch(model, n=4, c_len=5, seed=1), synthetic_batch(model, n=2, c_len=4, seed=2)
    for x in (a, b):
        x.rewards = torch.zeros(len(x.texts))
        x.rollout_logp = x.old_logp - 0.01 * torch.arange(x.old_logp.shape[1])       # any values that differ
    merged = dynamic_sampling.merge([a, b])
    assert torch.equal(merged.rollout_logp[:4], a.rollout_logp)
    assert torch.equal(merged.rollout_logp[4:, :4], b.rollout_logp) and (merged.rollout_logp[4:, 4:] == 0).all()
    picked = dynamic_sampling.select(a, torch.tensor([1]), 2)
    assert torch.equal(picked.rollout_logp, a.rollout_logp[2:4])


def test_merging_rounds_keeps_the_kept_sets_and_keeps_every_token_in_the_padding():
    """--mask-replay under --dynamic-sampling: each round's kept sets (N, C, V) survive the merge
    and the filter; a padded position keeps every token, so its log-prob stays finite."""
    model = tiny_model()
    a, b = synthetic_batch(model, n=4, c_len=5, seed=1), synthetic_batch(model, n=2, c_len=4, seed=2)
    gen = torch.Generator().manual_seed(3)
    for x in (a, b):
        x.rewards = torch.zeros(len(x.texts))
        x.kept = torch.rand(*x.completion_ids.shape, 20, generator=gen) < 0.7
        x.kept |= torch.nn.functional.one_hot(x.completion_ids, 20).bool()          # the sampled token kept
    merged = dynamic_sampling.merge([a, b])
    assert torch.equal(merged.kept[:4], a.kept) and torch.equal(merged.kept[4:, :4], b.kept)
    assert merged.kept[4:, 4:].all()
    with torch.no_grad():
        logp, _ = logprobs.completion_logprobs(model, merged.tokens())
    assert torch.isfinite(logp).all()
    assert torch.equal(dynamic_sampling.select(a, torch.tensor([1]), 2).kept, a.kept[2:4])


def test_a_correction_acts_under_dynamic_sampling(tmp_path):
    """--dynamic-sampling --rollout-stale 1 with and without TIS: the sampler's log-probs reach
    the update, so the two runs differ and the mismatch is logged (they were bit-identical)."""
    losses = {}
    for name, extra in (("plain", ()), ("tis", ("--rollout-correction", "tis", "--rollout-c-max", "1.01"))):
        train.train(configure(quick(tmp_path, name, "--dynamic-sampling", "--rollout-stale", "1",
                                    "--max-sampling-rounds", "4", "--steps", "6", "--lr", "0.01", "--device", "cpu",
                                    *extra)))
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()[1:]]
        assert all("sampling/raw_importance_ratio/mean" in r for r in rows), sorted(rows[0])
        losses[name] = [r["loss"] for r in rows]
    pairs = [(a, b) for a, b in zip(losses["plain"][1:], losses["tis"][1:]) if a is not None and b is not None]
    assert pairs, "no step after the first took an update in both runs"
    gap = max(abs(a - b) for a, b in pairs)
    assert gap > 1e-4, f"stale rollouts corrected should give another loss; largest difference {gap}"
