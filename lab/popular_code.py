"""The lab's runs of Lesson 15 (mistakes.py): a mistake copied from popular RL code against the
course's formula, the same flags and seeds otherwise, in a setting of train.py's defaults where the
mistake is live (it changes a number the update reads). One rule for the three, written before
their first run (below)."""
from lab import collapse, compare, stats
from lab.common import Lab, mean, metric_rows

SEEDS = range(200, 210)      # 10 an arm, seeds no other experiment uses (0-19, 100-119)
COMMON = "--k 8 --norm global --steps 150"
# Power, from collapse_rate's 20 GRPO default runs (held-out best at the end, sd 0.0082): 10 runs an
# arm see a fall of 0.009 with power 0.8 (one-sided permutation, alpha 0.05; lab.stats.detectable_mean);
# where a mistake spreads the runs as PPO's defaults do (sd 0.15), a fall of 0.17.


def against(lab: Lab, name: str, live: str, mistake: str, fix: str) -> dict:
    """The mistake and the fix over SEEDS, with `live` (what makes the mistake bite) in both arms."""
    r = lab.sweep(name, [f"{live} {mistake}", f"{live} {fix}"], COMMON, ("eval_best_rate", "entropy"),
                  ("eval_best_rate_end", "ended_off_format"), seeds=SEEDS)
    wrong, right = r.values()
    best = [[x["eval_best_rate_end"] for x in rs] for rs in (wrong, right)]
    p = stats.permutation(best[1], best[0])
    # the registered test, as each experiment's rule states it; beside it, not tested: the runs
    # that ended collapsed (lab.collapse's rule) and the share of tokens clipped
    verdict = "reproduced" if p < stats.ALPHA else "not reproduced" if mean(best[0]) >= mean(best[1]) \
        else "inconclusive"
    fell = [sum(map(collapse.collapsed, rs)) for rs in (wrong, right)]
    clipped = [mean(mean(row.get("clip_frac") for row in metric_rows(x)) for x in rs) for rs in (wrong, right)]
    return dict(report="Lesson 15", figure=f"{name}/compare.png", verdict=verdict,
                measured=f"{COMMON} {live}, seeds {lab.block(SEEDS).start}-{lab.block(SEEDS).start + len(wrong) - 1}: "
                         f"held-out "
                         f"best at the end, the mistake ({mistake}) {compare.spread(best[0])}, the fix ({fix}) "
                         f"{compare.spread(best[1])} (the fix above: permutation p = {stats.p_value(p)}); ended "
                         f"collapsed {fell[0]}/{len(wrong)} against {fell[1]}/{len(right)}; tokens clipped "
                         f"(mean over steps) {clipped[0]:.4f} against {clipped[1]:.4f}")


def clip_inverted(lab: Lab) -> dict:
    """PPO's clip inverted for A < 0 (reasoning-from-scratch) against PPO's, at 4 epochs a batch."""
    # rule (written before the first run): `against`: 10 seeds an arm (200-209), the one-sided permutation
    # test of the held-out best at the end, the fix above the mistake, alpha 0.05: "reproduced" (the
    # mistake costs the run) if p < 0.05, "not reproduced" if the mistake's mean is at or above the fix's,
    # else "inconclusive".
    return dict(against(lab, "clip_inverted", "--epochs 4", "--policy-loss clip-inverted", "--policy-loss clip"),
                claim="the clip inverted for negative advantages (where(A >= 0, min, max)) costs a run where the "
                      "clip bites (4 epochs a batch, eps 0.2)")


def micro_token_mean(lab: Lab) -> dict:
    """A token mean over each micro-batch (nanochat) against the batch's, micro-batches of 8 sequences."""
    # rule (written before the first run): `against`: 10 seeds an arm (200-209), the one-sided permutation
    # test of the held-out best at the end, the fix above the mistake, alpha 0.05: "reproduced" (the
    # mistake costs the run) if p < 0.05, "not reproduced" if the mistake's mean is at or above the fix's,
    # else "inconclusive".
    return dict(against(lab, "micro_token_mean", "--micro-batch 8", "--loss-agg micro-token-mean",
                        "--loss-agg token-mean"),
                claim="a token mean over each micro-batch, not the batch, costs a run cut into micro-batches of "
                      "8 sequences (of 64)")


def sampled_not_scored(lab: Lab) -> dict:
    """Sampling at T 0.8, top-p 0.9 and scoring at T 1 over every token (reasoning-from-scratch) against
    scoring what was sampled (--temperature 0.8 --mask-replay)."""
    # rule (written before the first run): `against`: 10 seeds an arm (200-209), the one-sided permutation
    # test of the held-out best at the end, the fix above the mistake, alpha 0.05: "reproduced" (the
    # mistake costs the run) if p < 0.05, "not reproduced" if the mistake's mean is at or above the fix's,
    # else "inconclusive".
    return dict(against(lab, "sampled_not_scored", "--top-p 0.9", "--rollout-temperature 0.8",
                        "--temperature 0.8 --mask-replay"),
                claim="sampling at temperature 0.8 and top-p 0.9 while scoring at temperature 1 over the whole "
                      "vocabulary costs a run (both arms sample, and are evaluated, at 0.8 and 0.9)")
