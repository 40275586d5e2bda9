"""The entropy-collapse experiments on a real model (SmolLM2-135M-Instruct), 3 seeds per setting, beside
lab/real.py's (the same RealLab: each finished run kept and skipped when the lab runs again).

    python -m lab --model smollm2-135m real_entropy_collapse real_mismatch

The baseline of both is real_group_size's K=8/B=3 (group norm, 30 steps, one update per batch);
Lesson 5's run of it ended on one answer for every prompt. The fixes that act through the ratio
(clip-higher, CISPO) run with --epochs 2 against two epochs alone. Each verdict's rule is written
next to it, before the first run.
"""
from lab import compare
from lab.collapse import end_entropy
from lab.common import COLLAPSED, mean
from lab.real import SETTINGS, RealLab, spread, write_table

BASELINE = ("real_group_size", "K=8, B=3")
BONUS = ("real_group_size", "K=8, B=3, entropy bonus 0.01")
COLUMNS = [("held-out best (end)", "eval_best_rate_end"), ("held-out best (best eval)", "eval_best_rate_best"),
           ("one answer (end)", "eval_one_answer_end")]


def ended_on_one(runs: list) -> int:
    return sum((r.get("eval_one_answer_end") or 0) >= COLLAPSED for r in runs)


def real_entropy_collapse(lab: RealLab, log=print) -> dict:
    """The K=8/B=3 collapse onto one answer against the entropy bonus and five 2025-26 fixes:
    Clip-Cov, 80/20 and adaptive entropy at one epoch (against the K=8/B=3 runs), clip-higher
    and CISPO at two (against two epochs alone: at one, every ratio is 1 and they change nothing)."""
    runs = {"baseline (K=8, B=3)": lab.runs(*BASELINE, log=log), "entropy bonus 0.01": lab.runs(*BONUS, log=log)}
    runs.update({label: lab.runs("real_entropy_collapse", label, log) for label in SETTINGS["real_entropy_collapse"]})
    write_table(lab, "real_entropy_collapse", runs, COLUMNS)
    one = {label: mean(r.get("eval_one_answer_end") for r in rs) for label, rs in runs.items()}

    def baseline_of(label):
        return "two epochs" if label.startswith("two epochs, ") else "baseline (K=8, B=3)"
    # rule (written before the first run), real_group_size's for the entropy bonus: a fix holds if
    # fewer of its runs end on one answer than its baseline's (two epochs for the two-epoch fixes)
    # AND its mean eval_one_answer at the end is lower by more than 0.1
    held = [label for label, rs in runs.items() if label not in ("baseline (K=8, B=3)", "two epochs")
            and ended_on_one(rs) < ended_on_one(runs[baseline_of(label)])
            and one[label] < one[baseline_of(label)] - 0.1]
    return dict(report="2025-26 methods", figure="real_entropy_collapse/compare.png",
                claim="each of the 2025-26 fixes keeps GRPO on SmolLM2 off its collapse onto one answer",
                measured="; ".join(f"{label}: {ended_on_one(rs)}/{len(rs)} end on one answer (mean "
                                   f"{one[label]:.2f}), entropy at the end "
                                   f"{compare.spread([end_entropy(r) for r in rs])}, held-out best "
                                   f"{spread(rs, 'eval_best_rate_end')}" for label, rs in runs.items()),
                verdict=f"held for {', '.join(held)}" if held else "not reproduced: no fix kept the runs off one answer")


def real_mismatch(lab: RealLab, log=print) -> dict:
    """bf16 rollouts of SmolLM2 with and without TIS / ICEPOP against the fp32-sampled baseline."""
    runs = {"baseline (sampler = policy)": lab.runs(*BASELINE, log=log)}
    runs.update({label: lab.runs("real_mismatch", label, log) for label in SETTINGS["real_mismatch"]})
    write_table(lab, "real_mismatch", runs, COLUMNS)
    best = {label: mean(r["eval_best_rate_end"] for r in rs) for label, rs in runs.items()}
    null, bf16 = best["baseline (sampler = policy)"], best["bf16 sampler"]
    fixed = max(best["bf16 + TIS"], best["bf16 + ICEPOP"])
    # rule (written before the first run), the toy lab's: reproduced if the bf16 sampler ends >= 0.05
    # below the baseline's mean held-out best and TIS or ICEPOP ends within 0.02 of the baseline;
    # not reproduced if the bf16 sampler ends within 0.05 of it; else partly
    return dict(report="Liu, Li et al. 2025", figure="real_mismatch/compare.png",
                claim="sampling from a bf16 copy of the policy hurts the run; TIS or ICEPOP undo it",
                measured="; ".join(f"{label}: held-out best {spread(rs, 'eval_best_rate_end')}, "
                                   f"{ended_on_one(rs)}/{len(rs)} end on one answer" for label, rs in runs.items()),
                verdict="reproduced" if bf16 <= null - 0.05 and fixed >= null - 0.02 else
                "not reproduced: the bf16 mismatch costs nothing here" if bf16 > null - 0.05 else
                "partly: the mismatch hurts, the corrections do not undo it")


EXPERIMENTS = {"real_entropy_collapse": real_entropy_collapse, "real_mismatch": real_mismatch}
