"""The lab's experiments on report 002 (a collapse post-mortem): batch size and gradient variance,
gradient clipping, fixed against scheduled hyper-parameters, and entropy (docs/reports.md; report
002's stability monitor is the detector bench's question now: lab/detectors.py)."""
import json
import statistics

import torch

import advantages
import grpo
import logprobs
import update
from models import policy
import rewards
import rollout
import tasks
import warm_start
from tasks import workflow_task
from lab import figures, stats
from lab.common import Lab, mean, end, metric_rows

# ---- 5. Batch size and gradient variance (report 002) ----

def gradient_variance(n_samples: int, repeats: int, micro: int) -> tuple[float, float]:
    """Per-parameter variance over `repeats` independent batches of the GRPO policy gradient at
    the warm start, averaged over parameters; and the largest relative gap between the
    gradient accumulated over micro-batches of `micro` and the one-pass gradient."""
    model, tok = policy.tiny_policy(workflow_task, 64, 2, warm_start.WarmStart(), policy.CACHE,
                                    log=lambda s: None)
    prompts = workflow_task.prompts("train")
    k = 8
    grads, gap = [], 0.0
    for rep in range(repeats):
        torch.manual_seed(rep)
        chosen = [prompts[i % len(prompts)] for i in torch.randperm(len(prompts) * 8)[: n_samples // k].tolist()]
        texts = [p["text"] for p in chosen]
        batch = rollout.sample(rollout.Models(model, tok), texts, k, tasks.Sampling())
        bests = [p["best"] for p in chosen for _ in range(k)]
        batch.rewards = torch.tensor([rewards.dsl_reward(t, b) for t, b in zip(batch.texts, bests)])
        batch.advantages = advantages.compute(batch.rewards, k, "global")
        flat = {}
        for mb in (len(texts) * k, micro):
            opt = torch.optim.SGD(model.parameters(), lr=0.0)         # lr 0: the weights stay put
            update.update(logprobs.Scorer(model), opt, batch,
                          grpo.HyperParams(mini_batch=len(texts) * k, micro_batch=mb, seed=rep), grpo.loss)
            flat[mb] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        gap = max(gap, ((flat[micro] - flat[len(texts) * k]).abs().max() / flat[len(texts) * k].abs().max()).item())
        grads.append(flat[len(texts) * k])
    g = torch.stack(grads)                                            # (repeats, parameters)
    return g.var(0).mean().item(), gap


def batch_size(lab: Lab) -> dict:
    """Gradient variance and reward swing at a small vs a big batch; exact accumulation (002)."""
    repeats = 3 if lab.quick else 8
    var_small, gap = gradient_variance(64, repeats, 16)
    var_big, gap_big = gradient_variance(512, repeats, 64)
    r = lab.sweep("batch_size", ["--batch 2", "--batch 16"], "--k 8 --steps 100 --lr 1e-3 --eval-every 20",
                  ("reward_mean", "eval_best_rate"))
    swing = {s: mean(mean(abs(b["reward_mean"] - a["reward_mean"]) for a, b in zip(rows[1:], rows[2:]))
                     for rows in map(metric_rows, runs)) for s, runs in r.items()}
    small, big = (swing[lab.shrink(s)] for s in ("--batch 2", "--batch 16"))
    figures.plot_bars(lab.dir("batch_size") / "gradient_variance.png",
                    {"64 samples": var_small, "512 samples": var_big},
                    "per-parameter gradient variance", f"GRPO policy gradient at the warm start, {repeats} batches each")
    ratio = var_small / var_big
    (lab.dir("batch_size") / "gradient_variance.json").write_text(json.dumps(
        dict(var_64=var_small, var_512=var_big, ratio=ratio, accumulation_gap=max(gap, gap_big))))
    return dict(report="002", figure="batch_size/compare.png",
                claim="gradient variance 0.082 at batch 64 vs 0.014 at 512 (~6x); a big batch gives a smooth "
                      "reward curve; accumulation reproduces the big-batch gradient exactly",
                measured=f"gradient variance {var_small:.3g} at 64 samples vs {var_big:.3g} at 512 ({ratio:.1f}x; "
                         f"1/N predicts 8x); accumulated vs one-pass gradient: largest relative gap {max(gap, gap_big):.1e}; "
                         f"mean step-to-step change of the rollout reward: {small:.3f} at 16 samples per step vs "
                         f"{big:.3f} at 128",
                # rule: a variance ratio between 4x and 12x, a smoother curve at the big batch, and a gap < 1e-4
                verdict="reproduced" if 4 <= ratio <= 12 and big < small and max(gap, gap_big) < 1e-4
                else "not reproduced")


# ---- 6. Gradient clipping (report 002) ----

def grad_clip(lab: Lab) -> dict:
    """Gradient clipping none / 2 / 1 / 0.5 at a harmful lr: collapse rate (report 002)."""
    settings = ["--max-grad-norm 0", "--max-grad-norm 2", "--max-grad-norm 1", "--max-grad-norm 0.5"]
    r = lab.sweep("grad_clip", settings, "--k 2 --batch 3 --norm group --lr 7e-3 --steps 60 --eval-every 20",
                  ("eval_valid_rate", "grad_norm"))
    collapsed = {s.split()[-1]: sum(x["ended_off_format"] for x in runs) / len(runs) for s, runs in r.items()}
    rates = list(collapsed.values())
    return dict(report="002", figure="grad_clip/compare.png",
                claim="share of runs that collapse: no clipping 35%, max_norm 2.0 12%, 1.0 3%, 0.5 0%",
                measured="runs ending off-format (K=2, B=3, lr 7e-3): " +
                         ", ".join(f"max_norm {k if k != '0' else 'none'} {v:.0%}" for k, v in collapsed.items()),
                # rule: the collapse share never rises as the clip tightens, and the tightest clip at
                # least halves it (the report: 35% -> 0%; one run of six either way is noise)
                verdict="reproduced" if all(a >= b for a, b in zip(rates, rates[1:])) and rates[-1] <= rates[0] / 2
                else "not reproduced")


CLIPS = ("0", "2", "1", "0.5")                    # report 002's table: none, max_norm 2.0, 1.0, 0.5
CALIBRATION = {"sgd": (0.03, 0.05, 0.1, 0.2, 0.3), "adamw": (2e-3, 3e-3, 5e-3, 7e-3, 1e-2)}


def collapsed(run: dict) -> bool:
    """A run ended collapsed: held-out valid rate below 0.5 at its end, or stopped early
    (non-finite steps past --max-skips)."""
    return bool(run["ended_off_format"] or run["stopped"])


def grad_clip_regime(lab: Lab) -> dict:
    """Clipping where it can matter: SGD (a step is lr * g) and AdamW, each at an lr where unclipped
    runs collapse, over 20 seeds an arm (002).

    Stage 1 (calibration, seeds 100-103, no clip): for each optimizer the lr grid CALIBRATION;
    the lr of stage 2 is the smallest at which at least 2 of the 4 runs end collapsed (the
    largest if none does). Stage 2 (seeds 0-19, the test's seeds, unseen by stage 1): at that
    lr, SGD with every clip of the report's table, AdamW with none and 0.5."""
    common = "--k 8 --batch 8 --norm global --steps 60 --eval-every 20"
    chosen = {}
    for opt, lrs in CALIBRATION.items():
        r = lab.sweep(f"grad_clip_regime/calibration_{opt}", [f"--optimizer {opt} --lr {lr:g}" for lr in lrs],
                      common + " --max-grad-norm 0", ("eval_valid_rate", "grad_norm"), seeds=range(100, 104))
        share = {lr: sum(map(collapsed, runs)) / len(runs) for lr, runs in zip(lrs, r.values())}
        chosen[opt] = (next((lr for lr in lrs if share[lr] >= 0.5), lrs[-1]), share)
    arms = {("sgd", c): f"--optimizer sgd --lr {chosen['sgd'][0]:g} --max-grad-norm {c}" for c in CLIPS}
    arms.update({("adamw", c): f"--optimizer adamw --lr {chosen['adamw'][0]:g} --max-grad-norm {c}" for c in ("0", "0.5")})
    r = lab.sweep("grad_clip_regime", list(arms.values()), common, ("eval_valid_rate", "grad_norm"),
                  seeds=range(20))
    runs = {arm: r[lab.shrink(flags)] for arm, flags in arms.items()}
    count = {arm: (sum(map(collapsed, rs)), len(rs)) for arm, rs in runs.items()}
    # rule (written before the first run): the report's claim, that clipping at max_norm 0.5 lowers
    # the share of runs that collapse (its 35% unclipped -> 0%), tested for each optimizer apart by
    # the one-sided Fisher exact test of the unclipped arm's collapsed count above the 0.5 arm's,
    # 20 seeds an arm, alpha 0.05 (power 0.88 at the report's 35% -> 0%; 10 seeds would give
    # 0.49). The claim holds under an optimizer when p < 0.05. Verdict: "reproduced" if it holds
    # under both; "partly: under X" if under one; if under neither, "not reproduced" when the
    # unclipped arms collapsed in at least 7 of 20 runs (the report's 35%, the design's power),
    # else "inconclusive" (the regime was not reached). The 2 and 1 arms (SGD) are the table's
    # shape, read beside it, not tested.
    p = {opt: stats.fisher(*count[(opt, "0")], *count[(opt, "0.5")]) for opt in CALIBRATION}
    holds = [opt for opt in CALIBRATION if p[opt] < stats.ALPHA]
    reached = all(count[(opt, "0")][0] >= 7 for opt in CALIBRATION)
    shares = lambda opt: ", ".join(f"max_norm {c if c != '0' else 'none'} {count[(o, c)][0]}/{count[(o, c)][1]}"
                                   for o, c in arms if o == opt)
    calibration = "; ".join(f"{opt}: " + ", ".join(f"lr {lr:g} {s:.0%}" for lr, s in share.items())
                            for opt, (_, share) in chosen.items())
    return dict(report="002", figure="grad_clip_regime/compare.png",
                claim="share of runs that collapse: no clipping 35%, max_norm 2.0 12%, 1.0 3%, 0.5 0%",
                measured=f"runs ended collapsed (K=8, B=8, global, 60 steps), SGD at lr {chosen['sgd'][0]:g}: "
                         f"{shares('sgd')} (none above 0.5: Fisher p = {p['sgd']:.4f}); AdamW at lr "
                         f"{chosen['adamw'][0]:g}: {shares('adamw')} (p = {p['adamw']:.4f}); the lr chosen by "
                         f"calibration runs (seeds {lab.block(range(100, 104)).start}-{lab.block(range(100, 104)).stop - 1}, unclipped, share collapsed): {calibration}",
                verdict="reproduced" if len(holds) == 2 else f"partly: under {holds[0]}" if holds
                else "not reproduced" if reached else "inconclusive")


# ---- 7. Fixed vs dynamic hyper-parameters (report 002) ----

def fixed_vs_dynamic(lab: Lab) -> dict:
    """Fixed lr and KL with a big batch vs dynamic lr or KL with a small one (002)."""
    settings = ["--batch 16 --beta 0.05", "--batch 4 --beta 0.05 --lr-schedule cosine --warmup-steps 10",
                "--batch 4 --beta 0.05 --kl-control ratio"]
    r = lab.sweep("fixed_vs_dynamic", settings, "--k 8 --steps 100 --lr 1e-3 --eval-every 20",
                  ("eval_best_rate", "kl_coef", "lr"))
    best = {s: end(runs, "eval_best_rate_end") for s, runs in r.items()}
    fixed, dyn_lr, dyn_kl = best.values()
    return dict(report="002", figure="fixed_vs_dynamic/compare.png",
                claim="fixed lr and KL with batch 512: 58.6%; dynamic lr, batch 128: 52.3%; dynamic KL, batch "
                      "128: 54.1%",
                measured=f"held-out best at the end: fixed, 128 samples/step {fixed:.2f}; cosine lr, 32 samples "
                         f"{dyn_lr:.2f}; ratio-rule KL, 32 samples {dyn_kl:.2f}",
                # rule: the fixed, big-batch setting ends highest
                verdict="reproduced" if fixed > max(dyn_lr, dyn_kl) else "not reproduced")



# ---- 12. Entropy (reports 000, 002) ----

def entropy(lab: Lab) -> dict:
    """With and without an entropy bonus; a too-high lr without clipping and the NaN guard (000, 002)."""
    # 100 steps: the lab's time budget (docs/lab-notebook.md, the trims)
    r = lab.sweep("entropy", ["--entropy-coef 0", "--entropy-coef 0.01 --entropy-coef-end 0.001"],
                  "--k 8 --steps 100 --lr 1e-3 --eval-every 20", ("entropy", "eval_best_rate"))
    h = {s: [mean(x["entropy"] for x in metric_rows(run)[-10:] if x.get("entropy") is not None)
             for run in runs] for s, runs in r.items()}
    # lr 10 with a KL term (so every step updates): the weights blow up within a step or two.
    blow = lab.sweep("entropy_nonfinite", ["--max-grad-norm 0", "--max-grad-norm 1"],
                     "--k 8 --steps 40 --lr 10 --beta 0.1 --max-skips 5 --eval-every 20", ("grad_norm", "entropy"))
    (no_clip, clip) = blow.values()
    skipped = [x["skipped_nonfinite"] for x in no_clip]
    skipped_clip = [x["skipped_nonfinite"] for x in clip]
    stopped = sum(x["stopped"] is not None for x in no_clip + clip)
    no_bonus, bonus = h.values()
    # "higher" as in curriculum's rule: by more than the larger of the two spreads over seeds
    # (a higher mean alone let one seed of six decide it)
    higher = mean(bonus) - mean(no_bonus) > max(statistics.pstdev(no_bonus), statistics.pstdev(bonus))
    return dict(report="000, 002", figure="entropy/compare.png",
                claim="without an entropy bonus the policy turns deterministic early; healthy entropy is 1.5-2.0 "
                      "early, 0.8-1.2 late; lr too high without clipping gives NaN",
                measured=f"token entropy over the last 10 steps: {mean(no_bonus):.3f} ± {statistics.pstdev(no_bonus):.3f} "
                         f"without a bonus, {mean(bonus):.3f} ± {statistics.pstdev(bonus):.3f} with 0.01 -> 0.001 "
                         f"(the 103-word tiny model starts at 0.29, far below the report's ranges); "
                         f"lr 10 (beta 0.1): non-finite steps skipped per run {skipped} without clipping, "
                         f"{skipped_clip} with max_norm 1; {stopped}/{len(no_clip + clip)} runs stopped by "
                         f"--max-skips with a checkpoint",
                # rule: the bonus keeps entropy higher, and the guard caught a non-finite step in every run
                verdict="reproduced" if higher and all(s > 0 for s in skipped) else
                "partly" if higher else "not reproduced")
