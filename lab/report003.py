"""The lab's experiments on report 003 (RCE then GRPO with an adaptive KL): the KL range rule and
over-training, and RCE -> GRPO with early stopping (docs/reports.md)."""
import dataclasses
import json
import statistics
from pathlib import Path

import diagnostics
import rollout
import tasks
import warm_start
from models import policy
from running import checkpoint

from lab import compare, figures, stats
from running import report
from lab.common import Lab, mean, end, metric_rows

# ---- 8. Adaptive KL and over-training (report 003) ----

def kl_range(lab: Lab) -> dict:
    """Report 003's adaptive KL range 0.01/0.1 vs 0.05/0.2 vs a fixed beta; early stopping."""
    settings = ["--kl-control range --kl-target-min 0.01 --kl-target-max 0.1 --kl-coef 1",
                "--kl-control range --kl-target-min 0.05 --kl-target-max 0.2 --kl-coef 1",
                "--kl-control fixed --kl-coef 0.1"]
    # 60 steps: the lab's time budget (docs/lab-notebook.md, the trims, has what 100 steps gave)
    r = lab.sweep("kl_range", settings, "--epochs 5 --steps 60 --lr 1e-3",
                  ("kl_coef", "kl", "eval_reward_mean"), ("eval_reward_mean_end",))
    rows = {s: [metric_rows(x) for x in runs] for s, runs in r.items()}
    evals = {s: [[(x["step"], x["eval_reward_mean"]) for x in rs if "eval_reward_mean" in x] for rs in runs]
             for s, runs in rows.items()}
    past_peak = {s: mean(max(e, key=lambda p: p[1])[1] - e[-1][1] for e in runs) for s, runs in evals.items()}
    min_beta = {s: min(x["kl_coef"] for rs in runs for x in rs[1:]) for s, runs in rows.items()}
    low, wide, fixed = (end(runs, "eval_reward_mean_end") for runs in r.values())
    spread = [statistics.pstdev([x["eval_reward_mean_end"] for x in runs]) for runs in r.values()]
    s_low = list(r)[0]
    floor = min_beta[s_low] <= 0.002
    # "worse" as curriculum's and entropy's rules read a difference: by more than the larger of
    # the two spreads over seeds (at first any lower mean counted: a first rerun, whose KL
    # reading was later found defective, gave 0.91 against 0.92, spreads 0.09 and 0.13, and that
    # rule read it as "reproduced")
    worse = wide - low > max(spread[0], spread[1])
    return dict(report="003", figure="kl_range/compare.png",
                claim="the range rule with kl_target_min 0.01 lowered beta to 0.001 and the run got worse; "
                      "targets 0.05/0.2 and early stopping fix it",
                measured=f"held-out reward at the end (mean ± spread over seeds): range 0.01/0.1 {low:.2f} ± "
                         f"{spread[0]:.2f}, range 0.05/0.2 {wide:.2f} ± {spread[1]:.2f}, fixed beta 0.1 {fixed:.2f} ± "
                         f"{spread[2]:.2f}; lowest beta reached with 0.01/0.1: {min_beta[s_low]:.3g}; held-out "
                         f"reward lost between its best evaluation and the end (early stopping's gain): "
                         + ", ".join(f"{v:.2f}" for v in past_peak.values()),
                # rule: beta reaches the floor (<= 0.002) under 0.01/0.1, and that run ends below the wider
                # band by more than the spread over seeds
                verdict="reproduced" if floor and worse else
                "partly: beta falls to its floor, but the run ends no worse than with 0.05/0.2 beyond the spread "
                "over seeds" if floor else "not reproduced")


# ---- 8b. The same, in report 003's regime: a strong baseline, a reward partly misaligned ----

MISJUDGED = "--k 8 --norm global --reward misjudged --epochs 5 --steps 60 --lr 1e-3 --eval-every 10"   # stage 2


BASELINE_EVALS = 8       # evaluations of the baseline's checkpoint, eval seeds 1234 on: one can sit at the ceiling by luck


def baseline_rate(run: Path) -> float:
    """The held-out best rate of a run's checkpoint (checkpoint.starting_point): the mean of
    BASELINE_EVALS evaluations, each of the run's own size, under eval seeds EVAL_SEED, EVAL_SEED + 1, ..."""
    cfg = dataclasses.replace(compare.run_config(run), init_from="", device="cpu")
    task = tasks.TASKS[cfg.task]
    model, tok = policy.load(cfg, task, "cpu", log=lambda s: None)
    model.load_state_dict(policy.read_weights(checkpoint.starting_point(run), model))
    models, sampling, held = rollout.Models(model, tok), tasks.Sampling.of(cfg), tasks.prompts_of(task, cfg)["eval"]
    return mean(compare.by_group(models, task, held, sampling, cfg.eval_samples, diagnostics.EVAL_SEED + i)["all"]
                ["best_rate"] for i in range(BASELINE_EVALS))


def strong_baseline(lab: Lab, name: str) -> Path:
    """Stage 1: one GRPO run of the main job's settings (150 steps, seed 0) that learns the task;
    its checkpoint, which stage 2 starts from (--init-from) and keeps as the KL's reference."""
    base = lab.sweep(f"{name}/baseline", ["--k 8 --norm global --steps 150 --save-every 150"], "--lr 1e-3",
                     ("eval_best_rate",), seeds=range(1))
    return Path(next(iter(base.values()))[0]["out"])


def kl_regime(lab: Lab) -> dict:
    """Report 003's range rule where its run started: from a strong baseline, on a reward partly
    misaligned with the held-out metric, 20 seeds an arm (003).

    Stage 1: the baseline, one GRPO run of the main job's settings (150 steps, seed 0) that
    learns the task, its checkpoint kept. Stage 2, from it (--init-from: it is also the KL's
    reference): GRPO on --reward misjudged (report 003's composite reward from a judge wrong on
    a quarter of the training prompts), 5 epochs a batch as kl_range, beta from 10 (the report's
    start) under the range rule with the report's targets 0.01/0.1 and its fix 0.05/0.2."""
    start = strong_baseline(lab, "kl_regime")
    arms = {"0.01/0.1": "--kl-target-min 0.01 --kl-target-max 0.1",
            "0.05/0.2": "--kl-target-min 0.05 --kl-target-max 0.2"}
    r = lab.sweep("kl_regime", list(arms.values()), f"{MISJUDGED} --kl-control range --kl-coef 10 --init-from {start}",
                  ("eval_best_rate", "kl_coef", "reward_mean", "eval_answer_nll"), seeds=range(20))
    runs = {arm: r[lab.shrink(flags)] for arm, flags in arms.items()}
    end_best = {arm: [x["eval_best_rate_end"] for x in rs] for arm, rs in runs.items()}
    first = mean(x["eval_best_rate_start"] for rs in runs.values() for x in rs)   # one checkpoint, one seeded evaluation
    baseline = baseline_rate(start)
    rows = {arm: [metric_rows(x) for x in rs] for arm, rs in runs.items()}
    floor = sum(min(x["kl_coef"] for x in rs[1:] if x.get("kl_coef") is not None) <= 0.002 for rs in rows["0.01/0.1"])
    climbed = {arm: mean(rs[-1]["reward_mean"] - rs[1]["reward_mean"] for rs in arm_rows)
               for arm, arm_rows in rows.items()}
    kept = {arm: mean(x["eval_best_rate_best"] - x["eval_best_rate_end"] for x in rs) for arm, rs in runs.items()}
    # rule (written before the first run): report 003's regime on the toy: a strong baseline (a
    # GRPO run of the main job's settings, 150 steps, seed 0), then GRPO from it on a reward
    # partly misaligned with the held-out metric (--reward misjudged), 5 epochs a batch, 60
    # steps, beta from 10 under the range rule, 20 seeds an arm (0-19). Two claims, each by a
    # one-sided exact test at alpha 0.05 on the held-out best at the end: 1. under 0.01/0.1 the
    # run ends below the baseline (the sign-flip test of baseline - end over its 20 runs; it
    # detects a mean fall of 0.56 sd with power 0.8); 2. the targets 0.05/0.2 fix it: 0.05/0.2
    # ends above 0.01/0.1 (the permutation test, 20 runs against 20). Beside them, measured, not
    # tested: the mechanism the report names (runs under 0.01/0.1 whose beta reached the floor,
    # <= 0.002), the misjudged reward's rise, and what early stopping would keep (best - end).
    # The baseline is the mean of 8 evaluations of its checkpoint (baseline_rate; changed before the
    # second block's first run: it was one evaluation, the runs' step 0, which sat at the 1.000 ceiling).
    # Verdict: "reproduced" if both claims hold; "partly: (the one that holds)" if one; if
    # neither, "not reproduced" when 0.01/0.1's mean end is at or above the baseline (no fall to
    # fix), else "inconclusive".
    p_fall = stats.sign_flip([baseline - v for v in end_best["0.01/0.1"]])
    p_fix = stats.permutation(end_best["0.05/0.2"], end_best["0.01/0.1"])
    holds = [claim for claim, p in (("0.01/0.1 ends below the baseline", p_fall),
                                    ("0.05/0.2 ends above 0.01/0.1", p_fix)) if p < stats.ALPHA]
    n = len(end_best["0.01/0.1"])
    return dict(report="003", figure="kl_regime/compare.png",
                claim="from a good baseline, GRPO under the range rule with kl_target_min 0.01 lowered beta to "
                      "0.001 and ended below the baseline; targets 0.05/0.2 fix it",
                measured=f"held-out best rate: the baseline {baseline:.3f} (the mean of {BASELINE_EVALS} evaluations; "
                         f"one, the runs' step 0: {first:.3f}); at the end, range 0.01/0.1 "
                         f"{mean(end_best['0.01/0.1']):.3f} (below the baseline in "
                         f"{sum(v < baseline for v in end_best['0.01/0.1'])}/{n} runs; sign-flip p = "
                         f"{stats.p_value(p_fall)}), range 0.05/0.2 {mean(end_best['0.05/0.2']):.3f} (above "
                         f"0.01/0.1: permutation p = {stats.p_value(p_fix)}); runs under 0.01/0.1 whose beta reached "
                         f"the floor (<= 0.002): {floor}/{n}; the misjudged reward's rise over the run (rollout mean, "
                         f"step 1 to the end): " + ", ".join(f"{a} {v:+.2f}" for a, v in climbed.items()) +
                         "; held-out best lost between the best evaluation and the end (what early stopping "
                         "keeps): " + ", ".join(f"{a} {v:.3f}" for a, v in kept.items()),
                verdict="reproduced" if len(holds) == 2 else f"partly: {holds[0]}" if holds
                else "not reproduced" if mean(end_best["0.01/0.1"]) >= baseline else "inconclusive")


def kl_regime_fixed(lab: Lab) -> dict:
    """kl_regime's control: is its fall beta's? The same two stages, with beta held fixed at 10
    (the range rule's start) and at 0.001 (where the range rule took it) (003)."""
    start = strong_baseline(lab, "kl_regime_fixed")          # kl_regime's baseline command, run again
    arms = {"10": "--kl-coef 10", "0.001": "--kl-coef 0.001"}
    r = lab.sweep("kl_regime_fixed", list(arms.values()), f"{MISJUDGED} --kl-control fixed --init-from {start}",
                  ("eval_best_rate", "reward_mean"), seeds=range(20))
    end_best = {arm: [x["eval_best_rate_end"] for x in r[lab.shrink(flags)]] for arm, flags in arms.items()}
    first, baseline = mean(x["eval_best_rate_start"] for rs in r.values() for x in rs), baseline_rate(start)
    # rule (written before the first run): kl_regime's two stages (its baseline command; then GRPO on
    # --reward misjudged, 5 epochs a batch, 60 steps, lr 1e-3, 20 seeds 0-19) with beta fixed at 10 and
    # at 0.001. Two one-sided exact tests at alpha 0.05 on the held-out best at the end: 1. beta 10
    # ends above beta 0.001 (the permutation test, 20 runs against 20; it detects 0.79 sd with power
    # 0.8); 2. beta 10 ends below the baseline (the sign-flip test of baseline - end over its 20 runs;
    # 0.56 sd). Verdict: "reproduced" (the fall is beta's) if 1 holds and 2 does not; "partly" if both
    # hold; "not reproduced" if 2 holds and 1 does not; else "inconclusive". The baseline: kl_regime's
    # (the mean of 8 evaluations of its checkpoint since the second block; one evaluation before).
    p_held = stats.permutation(end_best["10"], end_best["0.001"])
    p_fall = stats.sign_flip([baseline - v for v in end_best["10"]])
    held, fell, n = p_held < stats.ALPHA, p_fall < stats.ALPHA, len(end_best["10"])
    return dict(report="003", figure="kl_regime_fixed/compare.png",
                claim="the range rule's fall of beta to 0.001 is what takes GRPO below its strong baseline (kl_regime); "
                      "a beta held at 10 keeps the run there",
                measured=f"held-out best rate: the baseline {baseline:.3f} (the mean of {BASELINE_EVALS} evaluations; "
                         f"one, the runs' step 0: {first:.3f}); at the end, fixed beta 10 "
                         f"{mean(end_best['10']):.3f} (below the baseline in {sum(v < baseline for v in end_best['10'])}"
                         f"/{n} runs; sign-flip p = {stats.p_value(p_fall)}), fixed beta 0.001 "
                         f"{mean(end_best['0.001']):.3f} (beta 10 above it: permutation p = {stats.p_value(p_held)})",
                verdict="reproduced" if held and not fell else "partly: beta 10 ends above 0.001, but below the "
                "baseline too" if held else "not reproduced: a fixed beta of 10 falls too" if fell else "inconclusive")


# ---- 9. RCE, then GRPO; early stopping; every checkpoint against the baseline (report 003) ----

def rce_grpo(lab: Lab) -> dict:
    """Warm start vs RCE-only vs RCE -> GRPO vs GRPO-only, each with and without early stopping (003).

    Report 003's pipeline on the DSL task with its composite reward: RCE (rce.py, tau 1.7 ->
    0.5) for 60 steps, then GRPO for 120 (its 5 and 10 epochs, in the same 1:2 ratio) with
    the range rule 0.01/0.1 (kl.py); GRPO-only starts from the warm start. "With early
    stopping": --early-stop-patience 3 (30 steps without a higher held-out reward) in both
    stages, the second stage starting from the first's best checkpoint. Every pipeline's
    kept checkpoint (the newest; with early stopping the best) is then evaluated beside the
    warm start on the held-out prompts with a fresh seed and 16 samples per prompt
    (compare.evaluate_checkpoints), broken down by problem type as the report broke its
    accuracy down by shots."""
    grpo_flags = "--steps 120 --kl-control range --kl-target-min 0.01 --kl-target-max 0.1 --kl-coef 1"
    es = " --early-stop-patience 3"
    stage1 = {"RCE-only": "--algo rce --steps 60 --save-every 20", "RCE-only, early stop": "--algo rce --steps 60" + es}
    runs_dir = lab.dir("rce_grpo") / "runs"
    stage2 = {"GRPO-only": grpo_flags + " --save-every 40", "GRPO-only, early stop": grpo_flags + es,
              "RCE -> GRPO": f"{grpo_flags} --save-every 40 --init-from "
                             f"{runs_dir / compare.slug(lab.shrink(stage1['RCE-only']))}/s{{seed}}",
              "RCE -> GRPO, early stop": f"{grpo_flags}{es} --init-from "
                                         f"{runs_dir / compare.slug(lab.shrink(stage1['RCE-only, early stop']))}/s{{seed}}"}
    names = {**stage1, **stage2}
    r = lab.sweep("rce_grpo", list(names.values()), "--reward composite --lr 1e-3 --eval-every 10",
                  ("eval_best_rate", "eval_answer_nll", "train_answer_nll"), ("best_step", "eval_answer_nll_end"))
    runs = {label: r[lab.shrink(flags)] for label, flags in names.items()}
    # every pipeline's kept checkpoint against the warm start: a fresh seed, 16 samples per prompt
    folders = [Path(x["out"]) for label in runs for x in runs[label]]
    ev = compare.evaluate_checkpoints(folders, samples=4 if lab.quick else 16, kept_only=True, log=lambda s: None)
    kept = {label: [ev["runs"][str(Path(x["out"]))][0][1] for x in runs[label]] for label in runs}
    groups = list(ev["baseline"])
    best = {label: {g: [e[g]["best_rate"] for e in evals] for g in groups} for label, evals in kept.items()}
    best = {"warm start": {g: [ev["baseline"][g]["best_rate"]] for g in groups}, **best}
    figures.plot_grouped_bars(lab.dir("rce_grpo") / "by_type.png", best, "held-out best rate",
                            f"report 003's pipelines on the DSL task, composite reward, {lab.seeds} seeds; kept "
                            f"checkpoints, fresh seed; {report.made_by(json.loads((folders[0] / 'config.json').read_text()))}")
    lines = ["| pipeline | " + " | ".join(groups) + " | vs warm start (all) | steps run |",
             "|" + "---|" * (len(groups) + 3)]
    for label, by_group in best.items():
        steps = mean(x["steps"] for x in runs[label]) if label in runs else 0
        lines.append(f"| {label} | " + " | ".join(f"{mean(v):.3f}" for v in by_group.values())
                     + f" | {mean(by_group['all']) - best['warm start']['all'][0]:+.3f} | {steps:.0f} |")
    (lab.dir("rce_grpo") / "by_type.md").write_text("\n".join(lines) + "\n")

    base = best["warm start"]["all"][0]
    overall = {label: best[label]["all"] for label in runs}            # per seed
    n = lab.seeds
    # claim 1: RCE-only below the warm start, in all seeds but at most one
    below = sum(x < base for x in overall["RCE-only"])
    # claim 2: RCE -> GRPO above RCE-only in all seeds but one, and still below the warm start
    recovered = sum(a > b for a, b in zip(overall["RCE -> GRPO"], overall["RCE-only"]))
    # claim 3, over-training: GRPO-only's held-out answer NLL ends >= 10% above its lowest
    # evaluation while the training prompts' NLL at the end is no higher than at that evaluation
    over = sum(warm_start.overtrained(metric_rows(x)) for x in runs["GRPO-only"])
    # claim 4: early stopping's kept checkpoint at least as good as the run's end, both pipelines
    gain = {p: mean(overall[f"{p}, early stop"]) - mean(overall[p]) for p in ("GRPO-only", "RCE -> GRPO")}
    verdicts = [("RCE-only below the warm start", below >= n - 1),
                ("GRPO after RCE recovers part of it", recovered >= n - 1 and mean(overall["RCE -> GRPO"]) < base),
                ("over-training: held-out loss up while the training loss falls", over >= n / 2),
                ("early stopping keeps the best", all(g >= 0 for g in gain.values()))]
    held = [name for name, ok in verdicts if ok]
    fmt = lambda label: f"{mean(overall[label]):.2f}"
    return dict(report="003", figure="rce_grpo/by_type.png",
                claim="RCE-only fell below the baseline (-9.45 points); GRPO after RCE recovered part of it "
                      "(+4.83, still -4.57); GRPO's validation loss rose from epoch 2 while its training loss "
                      "fell; early stopping on validation keeps the best",
                measured=f"held-out best rate (fresh seed, {4 if lab.quick else 16} samples/prompt, mean of {n} "
                         f"seeds): warm start {base:.2f}, RCE-only {fmt('RCE-only')} (below it in {below}/{n} "
                         f"seeds), RCE -> GRPO {fmt('RCE -> GRPO')} (above RCE-only in {recovered}/{n}), GRPO-only "
                         f"{fmt('GRPO-only')}; with early stopping: RCE-only {fmt('RCE-only, early stop')}, RCE -> "
                         f"GRPO {fmt('RCE -> GRPO, early stop')}, GRPO-only {fmt('GRPO-only, early stop')}; "
                         f"GRPO-only runs whose held-out answer NLL ended >= 10% above its minimum while the "
                         f"training prompts' NLL did not rise: {over}/{n}; by type: rce_grpo/by_type.md",
                # rule: each of the four claims by the rule written above it; all four = reproduced
                verdict="reproduced" if len(held) == 4 else
                f"partly: {'; '.join(held)} (of the four claims)" if held else "not reproduced")
