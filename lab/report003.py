"""The lab's experiments on report 003 (RCE then GRPO with an adaptive KL): the KL range rule and
over-training, and RCE -> GRPO with early stopping (docs/reports.md)."""
import json
import statistics
from pathlib import Path

from lab import compare
from lab import figures
from running import plots
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
                            f"checkpoints, fresh seed; {plots.made_by(json.loads((folders[0] / 'config.json').read_text()))}")
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
    def diverged(run):
        rows = [x for x in metric_rows(run) if x.get("eval_answer_nll") is not None]
        low = min(rows, key=lambda x: x["eval_answer_nll"])
        return rows[-1]["eval_answer_nll"] >= 1.1 * low["eval_answer_nll"] and \
            rows[-1]["train_answer_nll"] <= low["train_answer_nll"]
    over = sum(diverged(x) for x in runs["GRPO-only"])
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
