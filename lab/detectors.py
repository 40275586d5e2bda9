"""The detector bench: which signal a run already logs warns of a collapse before the lab's own
held-out evaluation sees it, and how often it fires on runs that never collapse.

    python -m lab detectors        # reads every run the lab has kept; trains nothing

Its runs are the other experiments' (each setting's metrics.jsonl(.gz) under results/NAME/runs/,
and under results/smollm2-135m/NAME/runs/ for SmolLM2), on the DSL task (the tool task has no
held-out evaluation of answers). Each model is read on its own: its signals live on other scales.

The collapse is the lab's: on the toy, lab/collapse.py's rule on an evaluation (one answer for
>= 0.9 of the held-out samples, or the format written (valid >= 0.9) with the best workflow for
at most 0.6); on SmolLM2, lab/real.py's (one answer, >= 0.9). A run *collapsed* when its last
evaluation meets the rule; its *onset* is the first evaluation of the stretch that meets it to
the end, and its *last healthy evaluation* the one before. A run is *healthy* when no evaluation
after step 0 meets it; one that met it and recovered is neither, and is left out.

A signal *warns* a collapsed run when it fires at a step at or before the last healthy evaluation:
while the lab's own measurement still said the run was fine (an alarm between that evaluation and
the onset may come after the collapse, which the evaluations cannot place closer). A run whose
first evaluation after step 0 already meets the rule cannot be warned (no update came before
step 0) and is counted apart. A false alarm is a healthy run on which the signal fires at all.
"""
import json
import math
import statistics
from pathlib import Path

import monitor
from lab import collapse, compare, figures, stats
from lab.collapse import BEST, ONE_ANSWER, VALID
from lab.common import COLLAPSED, Lab, mean
from running import report

WINDOW, SMOOTH = 10, 5        # the running windows: the history a spike or fall is measured against, a smoothed value
MOST_FALSE = 0.10             # the false-alarm rate a threshold may have on the half it is fixed on


def smooth(rows: list, key: str) -> list:
    """(step, the mean of key over this and the SMOOTH - 1 updates before)."""
    out, seen = [], []
    for x in rows:
        if x.get(key) is not None:
            seen.append(x[key])
            out.append((x["step"], statistics.mean(seen[-SMOOTH:])))
    return out


def against_history(rows: list, key: str, measure) -> list:
    """(step, measure(value, the WINDOW values before it)) from the step with a full window on."""
    out, seen = [], []
    for x in rows:
        if x.get(key) is not None:
            if len(seen) >= WINDOW:
                out.append((x["step"], measure(x[key], seen[-WINDOW:])))
            seen.append(x[key])
    return out


def entropy_fall(rows: list) -> list:
    """1 - the smoothed entropy over the entropy of the run's first update (0.5: halved)."""
    s = smooth(rows, "entropy")
    return [(step, 1 - h / s[0][1]) for step, h in s] if s and s[0][1] > 0 else []


def reward_fall(rows: list) -> list:
    """The mean reward of the WINDOW updates before, minus the smoothed reward now."""
    s = smooth(rows, "reward_mean")
    return [(s[i][0], statistics.mean(h for _, h in s[i - WINDOW:i]) - s[i][1]) for i in range(WINDOW, len(s))]


# Each signal: the updates' rows -> (step, value), a larger value more alarming, and how its
# threshold reads. Report 002's monitor's three alerts first (entropy_low, kl_high, reward_swing),
# then the field's candidates; each value is one the runs already log.
SIGNALS = {
    "entropy low (report 002)": (lambda rows: [(x["step"], -x["entropy"]) for x in rows if x.get("entropy") is not None],
                                 lambda t: f"entropy < {-t:.3g}"),
    "KL to the reference high (report 002)": (lambda rows: [(x["step"], x["kl"]) for x in rows if x.get("kl") is not None],
                                              lambda t: f"KL > {t:.3g}"),
    "reward swing (report 002)": (lambda rows: against_history(rows, "reward_mean", lambda v, h: max(h + [v]) - min(h + [v])),
                                  lambda t: f"range over {WINDOW + 1} steps > {t:.3g}"),
    "groups with one reward": (lambda rows: smooth(rows, "frac_reward_zero_std"),
                               lambda t: f"share of groups, {SMOOTH}-step mean >= {t:.3g}"),
    "entropy fallen from its start": (entropy_fall, lambda t: f"fallen by >= {t:.0%}"),
    "grad-norm spike": (lambda rows: against_history(rows, "grad_norm", lambda v, h: v / max(statistics.median(h), 1e-12)),
                        lambda t: f"grad norm >= {t:.3g} x the median of the last {WINDOW}"),
    "reward fallen below its running mean": (reward_fall, lambda t: f"fallen by >= {t:.3g}"),
    "sampler/trainer log-prob gap": (lambda rows: smooth(rows, "sampling/sampling_logp_difference/mean"),
                                     lambda t: f"mean |log mu - log pi| >= {t:.3g}"),
    "held-out one-answer share": (lambda rows: [(x["step"], x["eval_one_answer"]) for x in rows
                                                if x["step"] > 0 and x.get("eval_one_answer") is not None],
                                  lambda t: f">= {t:.3g}"),
}


def meets_rule(row: dict, real: bool) -> bool:
    """The lab's collapse on one evaluation (the module's docstring)."""
    one = (row.get("eval_one_answer") or 0) >= (COLLAPSED if real else ONE_ANSWER)
    return one if real else one or (row["eval_valid_rate"] >= VALID and row["eval_best_rate"] <= BEST)


def outcome(rows: list, real: bool) -> dict:
    """{"kind": "collapsed" | "healthy" | "recovered" | None, "onset", "last_healthy"}: None for a
    run with fewer than two evaluations."""
    evals = [x for x in rows if x.get("eval_best_rate") is not None and x.get("eval_valid_rate") is not None]
    if len(evals) < 2:
        return {"kind": None}
    met = [meets_rule(x, real) for x in evals]
    if not met[-1]:
        return {"kind": "recovered" if any(met[1:]) else "healthy"}
    first = max([i for i, m in enumerate(met) if not m], default=-1) + 1
    return {"kind": "collapsed", "onset": evals[first]["step"],
            "last_healthy": evals[first - 1]["step"] if first > 0 else None}


def kept_runs(root: Path) -> list:
    """Every kept DSL run under root's */runs/ made without --rollback (the rule says why), as (folder, seed, path)."""
    found = []
    for cfg in sorted(root.glob("**/runs/*/s*/config.json")):
        run, made = cfg.parent, json.loads(cfg.read_text())
        logged = (run / "metrics.jsonl").exists() or (run / "metrics.jsonl.gz").exists()
        if not logged or made.get("task") == "tools" or made.get("rollback"):
            continue
        found.append((run.parent, int(run.name[1:]) if run.name[1:].isdigit() else 0, run))
    return found


def read_runs(root: Path, real: bool, skip: Path | None = None) -> list:
    """Each kept run: its half (every other seed of each setting, in seed order: 0 fixes the
    thresholds, 1 reads them), its outcome and its signals' (step, value) series."""
    runs, by_setting = [], {}
    for setting, seed, path in kept_runs(root):
        if skip and skip in path.parents:
            continue
        by_setting.setdefault(setting, []).append((seed, path))
    for setting, seeds in by_setting.items():
        for i, (_, path) in enumerate(sorted(seeds)):
            rows = report.read_metrics(path)
            updates = [x for x in rows if x["step"] > 0]
            runs.append(dict(path=path, half=i % 2, **outcome(rows, real), alarms=first_alarms(updates),
                             series={name: fn(updates) for name, (fn, _) in SIGNALS.items()}))
    return [r for r in runs if r["kind"] in ("collapsed", "healthy")]


# The monitor's own alarms at fixed thresholds (report 002's, and StabilityMonitor's defaults, which
# were read off this bench's first reading): monitor.replay over the logged curves, so each is the
# alarm exactly as a run would raise it (its 10-step swing window included). Counted over every run
# of both halves: no threshold is fixed here, so there is nothing to hold out; a description, not a test.
FIXED = {"report 002's": monitor.REPORT_002, "the monitor's defaults": {}}
MEASURES = {"entropy_low": "entropy", "kl_high": "kl", "reward_swing": "reward_mean"}


def first_alarms(updates: list) -> dict:
    """{thresholds: {alert: the first step it is active, or None if never}}; an alert whose quantity
    the run never logged (KL without a reference) is left out."""
    measured = {name for name, key in MEASURES.items() if any(x.get(key) is not None for x in updates)}
    out = {}
    for label, thresholds in FIXED.items():
        first = {name: None for name in measured}
        for row, active in zip(updates, monitor.replay(updates, thresholds)):
            for name in set(active) & measured:
                if first[name] is None:
                    first[name] = row["step"]
        out[label] = first
    return out


def alarm_counts(runs: list) -> dict:
    """{thresholds: {alert: (healthy runs it fired on, healthy runs that measured it, warnable collapsed
    runs it fired on at or before their last healthy evaluation, those that measured it)}}."""
    out = {}
    for label in FIXED:
        for name in MEASURES:
            has = [(r, r["alarms"][label][name]) for r in runs if name in r["alarms"][label]]
            healthy = [step for r, step in has if r["kind"] == "healthy"]
            sick = [(r, step) for r, step in has if r["kind"] == "collapsed" and r["last_healthy"] not in (None, 0)]
            out.setdefault(label, {})[name] = (sum(s is not None for s in healthy), len(healthy),
                                               sum(s is not None and s <= r["last_healthy"] for r, s in sick), len(sick))
    return out


def said(t: dict) -> str:
    return f"entropy < {t['min_entropy']:g}, KL > {t['max_kl']:g}, reward range over 10 steps > {t['max_reward_range']:g}"


def alarm_table(runs: list) -> list:
    lines = ["| thresholds | alarm | healthy runs it fires on | collapsed runs it warns in time |", "|---|---|---|---|"]
    for label, counts in alarm_counts(runs).items():
        for name, (false, n_healthy, warned, n_sick) in counts.items():
            lines.append(f"| {label} | {name} | {false}/{n_healthy} | {warned}/{n_sick} |")
    return lines


def first_alarm(series: list, threshold: float, until: float = math.inf) -> int | None:
    return next((step for step, v in series if v >= threshold and step <= until), None)


def peak(series: list, until: float = math.inf) -> float:
    return max((v for step, v in series if step <= until), default=-math.inf)


def scored(runs: list, name: str) -> tuple[list, list]:
    """(the warnable collapsed runs, the healthy runs) that measured the signal, each with its
    peaks: (at or before the last healthy evaluation, before the onset) and (over the run)."""
    has = [r for r in runs if r["series"][name]]
    sick = [(r, peak(r["series"][name], r["last_healthy"]), peak(r["series"][name], r["onset"] - 1))
            for r in has if r["kind"] == "collapsed" and r["last_healthy"] not in (None, 0)]
    return sick, [(r, peak(r["series"][name])) for r in has if r["kind"] == "healthy"]


def rates(scores: tuple, name: str, threshold: float, leads: bool = True) -> dict:
    """At one threshold: how many warnable collapsed runs it warned (strictly: at or before the last
    healthy evaluation; loosely: before the onset), their leads in steps, and its false alarms."""
    sick, healthy = scores
    warned = [r for r, strict, _ in sick if strict >= threshold]
    return dict(n_sick=len(sick), warned=len(warned), loose=sum(loose >= threshold for _, _, loose in sick),
                leads=[r["onset"] - first_alarm(r["series"][name], threshold) for r in warned] if leads else [],
                n_healthy=len(healthy), false=sum(top >= threshold for _, top in healthy))


def thresholds(scores: tuple) -> list:
    sick, healthy = scores
    return sorted(({x for _, strict, loose in sick for x in (strict, loose)} | {top for _, top in healthy}) - {-math.inf})


def fix_threshold(runs: list, name: str) -> float | None:
    """The smallest threshold whose false alarms on these healthy runs are <= MOST_FALSE (of those
    that qualify, it warns the most collapsed runs): just above the peak of the healthy run one past
    the false alarms allowed, counting down from the highest; None without healthy runs that measured it."""
    peaks = sorted((top for _, top in scored(runs, name)[1]), reverse=True)
    return math.nextafter(peaks[int(MOST_FALSE * len(peaks))], math.inf) if peaks else None


def bench(runs: list) -> dict:
    """Per signal: the threshold fixed on half 0 and what it does on half 1, with Fisher's one-sided
    p of "it warns more collapsed runs than it alarms healthy ones"."""
    fit, read = [r for r in runs if r["half"] == 0], [r for r in runs if r["half"] == 1]
    out = {}
    for name in SIGNALS:
        t = fix_threshold(fit, name)
        if t is None:
            out[name] = dict(threshold=t)
            continue
        r = rates(scored(read, name), name, t)
        p = stats.fisher(r["warned"], r["n_sick"], r["false"], r["n_healthy"]) if r["n_sick"] and r["n_healthy"] else 1.0
        out[name] = dict(r, threshold=t, p=p, warns=p < stats.ALPHA and r["false"] <= MOST_FALSE * r["n_healthy"])
    return out


def could_decide(runs: list) -> bool:
    """Whether the held-out half could show a warning at all: every warnable collapsed run warned
    and MOST_FALSE of the healthy alarmed gives p < ALPHA."""
    read = [r for r in runs if r["half"] == 1]
    n_sick = sum(r["kind"] == "collapsed" and r["last_healthy"] not in (None, 0) for r in read)
    n_healthy = sum(r["kind"] == "healthy" for r in read)
    return bool(n_sick and n_healthy) and \
        stats.fisher(n_sick, n_sick, int(MOST_FALSE * n_healthy), n_healthy) < stats.ALPHA


def table(model: str, runs: list, result: dict) -> list:
    counts = {k: sum(r["kind"] == k for r in runs) for k in ("collapsed", "healthy")}
    unwarnable = sum(r["kind"] == "collapsed" and r["last_healthy"] in (None, 0) for r in runs)
    lines = [f"### {model}: {len(runs)} runs, {counts['collapsed']} collapsed ({unwarnable} at their first "
             f"evaluation, which nothing can warn), {counts['healthy']} healthy; thresholds fixed on every other "
             f"seed, read on the rest", "",
             "| signal | threshold (fixed on half 0) | warned, half 1 | loosely (before the onset) | "
             "lead, steps (median, range) | false alarms, half 1 | p | warns early |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        if r["threshold"] is None:
            lines.append(f"| {name} | not measured by these runs | | | | | | |")
        else:
            lead = f"{statistics.median(r['leads']):g} ({min(r['leads'])}-{max(r['leads'])})" if r["leads"] else "-"
            lines.append(f"| {name} | {SIGNALS[name][1](r['threshold'])} | {r['warned']}/{r['n_sick']} | "
                         f"{r['loose']}/{r['n_sick']} | {lead} | {r['false']}/{r['n_healthy']} | "
                         f"{stats.p_value(r['p'])} | {'yes' if r['warns'] else 'no'} |")
    return lines


def curves(runs: list, name: str) -> list:
    """(false-alarm rate, share warned, median lead) on half 1 at every threshold half 1 offers."""
    scores = scored([r for r in runs if r["half"] == 1], name)
    if not scores[0] or not scores[1]:
        return []
    points = []
    for t in thresholds(scores):
        r = rates(scores, name, t)
        points.append((r["false"] / r["n_healthy"], r["warned"] / r["n_sick"],
                       statistics.median(r["leads"]) if r["leads"] else None))
    return points


def figure(models: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, (model, runs) in enumerate(models.items()):
        top, bottom = axes[0][col], axes[1][col]
        for name in SIGNALS:
            pts = curves(runs, name)
            if not pts:
                continue
            line, = top.plot([p[0] for p in pts], [p[1] for p in pts], label=name, drawstyle="steps-post")
            led = [p for p in pts if p[2] is not None]
            bottom.plot([p[0] for p in led], [p[2] for p in led], "o-", ms=3, color=line.get_color())
        for ax in (top, bottom):
            ax.axvline(MOST_FALSE, color="grey", ls=":")
            ax.set_xlabel("false alarms: share of healthy runs the signal fires on (half 1)")
        top.plot([0, 1], [0, 1], color="black", lw=0.5, ls="--")
        top.set_ylabel("share of collapsed runs warned in time")
        bottom.set_ylabel("median lead of the warned runs (steps)")
        top.set_title(f"{model} (CPU): each signal at every threshold")
        top.legend(fontsize=7)
    figures.save(fig, path, dpi=110)


def detectors(lab: Lab) -> dict:
    """The detector bench: lead time and false alarms of every signal over every kept run (toy and SmolLM2)."""
    real = lab.root / "smollm2-135m"
    models = {"toy": read_runs(lab.root, real=False, skip=real)}
    if real.is_dir():
        models["SmolLM2-135M-Instruct"] = read_runs(real, real=True)
    results = {model: bench(runs) for model, runs in models.items()}
    lines = ["Written by `python -m lab detectors` from the kept runs; the rule and definitions: lab/detectors.py.", ""]
    for model, runs in models.items():
        lines += table(model, runs, results[model]) + [""]
        lines += [f"The monitor's own alarms on {model}'s runs (both halves), replayed from the logged curves "
                  f"(monitor.replay) at report 002's thresholds ({said(monitor.REPORT_002)}) and at the monitor's "
                  f"defaults ({said(monitor.StabilityMonitor().__dict__)}):", ""] + alarm_table(runs) + [""]
    out = lab.dir("detectors")
    (out / "table.md").write_text("\n".join(lines))
    figure(models, out / "detectors.png")
    warns = {model: [name for name, r in res.items() if r.get("warns")] for model, res in results.items()}
    decidable = [model for model, runs in models.items() if could_decide(runs)]
    # rule (written before the first run; amended after the third reading): on each model's held-out half (every other
    # seed of each setting), a signal warns early when, at the threshold fixed on the other half (the smallest whose
    # false alarms on that half's healthy runs are <= 10%), it fires on <= 10% of the held-out healthy runs AND fires at
    # or before the last healthy evaluation on more of the collapsed runs than its share of false alarms, Fisher's
    # one-sided p < 0.05. Reproduced ("a signal the runs already log warns of a collapse before the evaluation sees it,
    # at <= 10% false alarms") when some signal warns early on a model; not reproduced when none does on a model where
    # the design could show it (every collapsed run warned with 10% false alarms would give p < 0.05); inconclusive
    # otherwise. Runs made with --rollback are left out (kept_runs): the held-out evaluation set off their rollbacks,
    # which undid the collapses it saw, so a signal fired on an undone collapse read as a warning of the last one.
    found = [f"{model}: {', '.join(names)}" for model, names in warns.items() if names]
    return dict(report="002 and the field", figure="detectors/detectors.png",
                claim="a signal the runs already log warns of a collapse before the held-out evaluation sees it, "
                      "at <= 10% false alarms on healthy runs",
                measured="; ".join(
                    f"{model}: " + ", ".join(f"{name} {r['warned']}/{r['n_sick']} warned, {r['false']}/{r['n_healthy']} "
                                             f"false (p {r['p']:.2g})" for name, r in results[model].items()
                                             if r.get("p") is not None) for model in models),
                verdict=f"reproduced for {'; '.join(found)}" if found else
                "not reproduced: no signal warned early at <= 10% false alarms" if decidable else
                "inconclusive: too few collapsed or healthy runs in the held-out half")


# ---- undoing it: --rollback against doing nothing ----

ROLLBACK = "--k 8 --batch 8 --norm global --steps 60 --eval-every 5 --lr 0.01"   # grad_clip_regime's AdamW lr


def failed(run: dict) -> bool:
    """The run ends collapsed (lab/collapse.py's rule) or off the format (held-out valid < 0.5)."""
    return collapse.collapsed(run) or run["ended_off_format"]


def against_none(lab: Lab, name: str, common: str, setting: str) -> tuple:
    """--rollback 3 against none on `common`, 20 seeds an arm: (what was measured, Fisher's one-sided
    p of fewer failures with the rollback, the failures without and with)."""
    r = lab.sweep(name, ["--rollback 0", "--rollback 3"], common, ("eval_best_rate", "eval_valid_rate"),
                  seeds=collapse.SEEDS)
    none, back = r.values()
    n_none, n_back = sum(map(failed, none)), sum(map(failed, back))
    p = stats.fisher(n_none, len(none), n_back, len(back))
    best = [x["eval_best_rate_end"] for x in back], [x["eval_best_rate_end"] for x in none]
    taken = [len(x.get("rollbacks", [])) for x in back]
    seen = stats.smallest_count(len(back), len(none))
    measured = (f"{setting}, seeds {lab.block(collapse.SEEDS).start}-{lab.block(collapse.SEEDS).stop - 1}: failed without "
                f"{n_none}/{len(none)}, with --rollback 3 {n_back}/{len(back)} (Fisher one-sided p = {p:.2g}; "
                f"against all failing, {len(back)} seeds see {seen}/{len(back)} kept off failure or more); "
                f"held-out best at the end {compare.spread(best[1])} without, {compare.spread(best[0])} with "
                f"(permutation p = {stats.permutation(*best):.2g}); rollbacks a run {compare.spread(taken)}; "
                f"seconds a run {mean(x['seconds'] for x in none):.0f} without, "
                f"{mean(x['seconds'] for x in back):.0f} with")
    return measured, p, n_none, n_back


def verdict(p: float, n_none: int, n_back: int) -> str:
    return f"reproduced (its registered test: Fisher one-sided, p = {stats.p_value(p)})" if p < stats.ALPHA else \
        "not reproduced: its runs failed as often" if n_back >= n_none else "inconclusive"


CLAIM = ("going back to the best checkpoint with the lr halved, when an evaluation finds one answer or junk, "
         "keeps a run from ending collapsed or off the format")


def rollback(lab: Lab) -> dict:
    """--rollback 3 against none where AdamW's lr ruins the toy (grad_clip_regime's lr 0.01), 20 seeds each."""
    measured, p, n_none, n_back = against_none(lab, "rollback", ROLLBACK, "lr 0.01, 60 steps")
    # rule (written before the first run): the rollback helps when fewer of its runs fail (end collapsed by
    # lab/collapse.py's rule, or off the format: held-out valid < 0.5) than of the runs without it, Fisher's
    # one-sided p < 0.05: reproduced. Not reproduced when its runs fail at least as often; inconclusive
    # otherwise. The held-out best at the end (one-sided permutation test) and the rollbacks taken are
    # reported beside it, not part of the rule.
    return dict(report="the field (a checkpoint to go back to, the lr cut)", figure="rollback/compare.png",
                claim=CLAIM, measured=measured, verdict=verdict(p, n_none, n_back))


STALE_SAMPLER = "--k 8 --norm global --steps 150 --rollout-stale 4"      # mismatch's "4 updates stale" arm


def rollback_stale(lab: Lab) -> dict:
    """--rollback 3 against none where a sampler 4 updates stale ruins the toy (mismatch's arm), 20 seeds each."""
    measured, p, n_none, n_back = against_none(lab, "rollback_stale", STALE_SAMPLER, "a sampler 4 updates stale, 150 steps")
    # rule (written before the first run): as rollback's, on a sampler 4 updates stale with pi_old recomputed
    # and no correction (mismatch's arm): the rollback helps when fewer of its runs fail (end collapsed by
    # lab/collapse.py's rule, or off the format: held-out valid < 0.5) than of the runs without it, Fisher's
    # one-sided p < 0.05: reproduced. Not reproduced when its runs fail at least as often; inconclusive
    # otherwise. The held-out best at the end and the rollbacks taken are reported beside it.
    return dict(report="the field (a checkpoint to go back to, the lr cut)", figure="rollback_stale/compare.png",
                claim=CLAIM + ", when the sampler is stale", measured=measured, verdict=verdict(p, n_none, n_back))
