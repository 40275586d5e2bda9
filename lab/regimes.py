"""Each report's central claim on the real model, in the report's own regime, as registered records.

    python -m lab --model smollm2-135m --out results/smollm2-135m real_001_regime_pilot

A record is the whole experiment: the claim, its arms (train.py flags, after lab/real.py's COMMON),
the metric, the test, alpha, its seeds and the power computation (with the pilot it came from) that
chose them. `measure` runs it, tests it and writes the entry. Before its first run it writes
OUT/NAME/registration.json: the sha256 of the record and of the code that decides (`measure` and the
test), the commit and the date. A record that no longer matches its registration is refused: a changed
experiment is a new experiment, under a new name, and the old one's runs and verdict stay as they were.
"""
import dataclasses
import hashlib
import inspect
import json
import time
from pathlib import Path

from lab import compare, real, stats
from lab.common import commit


@dataclasses.dataclass(frozen=True)
class Record:
    name: str
    report: str
    claim: str
    arms: dict           # label -> train.py flags
    tests: tuple         # each (metric, arm, "below" or "above", other arm): one claim, its own verdict; () a pilot
    alpha: float         # each test's
    seeds: range
    power: str           # why this many seeds: the computation and the pilot it came from


def below(x: list, y: list) -> float:
    """One-sided permutation p of mean(x) < mean(y)."""
    return stats.permutation(y, x)


def above(x: list, y: list) -> float:
    """One-sided permutation p of mean(x) > mean(y)."""
    return stats.permutation(x, y)


TESTS = {"below": below, "above": above}
# a metric is a key of each run's summary.json, or one of these (the crash statistic above its null)
DERIVED = {"crash_above_floor": lambda run: run["crash_rate"] - run["crash_floor"]}
SHOWN = ("eval_valid_rate_end", "eval_fallback_rate_end", "crash_above_floor")   # measured in every record
COLUMNS = [("held-out valid (start)", "eval_valid_rate_start"), ("held-out valid (end)", "eval_valid_rate_end"),
           ("held-out fallback (end)", "eval_fallback_rate_end"), ("held-out best (end)", "eval_best_rate_end"),
           ("crash rate", "crash_rate"), ("crash floor", "crash_floor")]


def value(run: dict, metric: str):
    return DERIVED[metric](run) if metric in DERIVED else run.get(metric)


def registration(record: Record) -> dict:
    """What registers a record: the sha256 of its text and of its deciding code, the commit, the date."""
    text = repr(record)
    code = "".join(inspect.getsource(f) for f in (measure, value, below, above)) + repr(DERIVED) + \
        inspect.getsource(DERIVED["crash_above_floor"])
    sha = lambda s: hashlib.sha256(s.encode()).hexdigest()[:16]
    return {"text": text, "sha256": sha(text), "code_sha256": sha(code), "commit": commit(),
            "registered": time.strftime("%Y-%m-%d")}


def register(record: Record, folder: Path) -> dict:
    """The record's registration, written into folder before its first run; the one there if the
    record is the same; SystemExit (one line) if the record changed since it was registered."""
    path, now = folder / "registration.json", registration(record)
    if path.exists():
        old = json.loads(path.read_text())
        if old["sha256"] != now["sha256"]:
            raise SystemExit(f"python -m lab: {record.name}'s record changed since its registration on "
                             f"{old['registered']} ({path}); a changed experiment is a new one: give it a new name")
        return dict(old, code_now=now["code_sha256"])
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now, indent=1) + "\n")
    return dict(now, code_now=now["code_sha256"])


def measure(record: Record, lab: real.RealLab, log=print) -> dict:
    """Run the record's arms over its seeds (each run kept), test each claim, and say what was measured."""
    register(record, lab.root / record.name)
    runs = {label: [lab.run(record.name, label, seed, log) for seed in record.seeds] for label in record.arms}
    real.write_table(lab, record.name, runs, COLUMNS)
    values = lambda metric, label: [value(r, metric) for r in runs[label]]
    shown = "; ".join(f"{metric}: " + ", ".join(f"{label} {compare.spread(values(metric, label))}" for label in runs)
                      for metric in dict.fromkeys([*SHOWN, *(t[0] for t in record.tests)]))
    verdicts, tested = [], []
    for metric, arm, relation, other in record.tests:
        p = TESTS[relation](values(metric, arm), values(metric, other))
        claim = f"{metric}: {arm} {relation} {other}"
        tested.append(f"{claim}, one-sided permutation p = {stats.p_value(p)}")
        verdicts.append(f"{claim}: {stats.decide(p, record.alpha)}")
    return dict(report=record.report, figure=f"{record.name}/compare.png", claim=record.claim,
                measured=f"seeds {record.seeds.start}-{record.seeds.stop - 1}, {len(record.seeds)} an arm: {shown}; "
                         + "".join(f"{t}; " for t in tested) + real.at_warm_start(runs),
                verdict="; ".join(verdicts) or "a pilot (no verdict)")


# ---- report 001: K=2 in the report's regime ----
# LoRA r=32 (report 001 trained LoRA on Qwen2.5-7B; its rank is not given), KL 0.005 in the loss (k3, as
# verl's kl_loss), no entropy bonus, 96 steps, group norm. Warm start: warm_start.DEFAULTS["real"], the
# report's mix, which leaves the fallback at 0.41-0.44 of the held-out samples at the start (the report's
# 0.428; real_lora_k2's and real_group_size's step-0 evaluations). lr 2e-5 for LoRA: 10x below real_lora's
# 2e-4, at which the fallback was gone in 2-4 steps (real_lora_k2's training rates), as the report cut its
# own lr 10x. Calibration rule (written before the pilot): if in neither pilot seed the K=8 arm's held-out
# valid share moves by 0.1 from its start, the policy does not move in 96 steps and the pilot runs again
# at 6e-5 under a new name before anything is registered. The null arm: the same loop and optimizer at lr
# 1e-30, a step too small to change a float32 logit (a frozen policy).
# The experiment, registered after the pilot by this rule (written before it): two claims, each a one-sided
# permutation test at alpha 0.05 over seeds 0..n-1: (1) eval_valid_rate_end, K=2/B=3 below K=8/B=2 (the
# report's endpoint: K=2 ends off-format, K=8 does not); (2) crash_above_floor, K=2/B=3 above the frozen arm
# (its crash after updates against the null). n: the seeds for power 0.8 to see a difference of 0.25 in (1)
# at the pilot's pooled sd of the K=2 and K=8 arms (lab.stats.seeds_for_mean), at least 4; above 20 it is
# registered and sized, and run over later sessions.
REGIME_001 = ("--lora-rank 32 --lr 2e-5 --beta 0.005 --steps 96 --norm group "
              "--eval-every 24 --eval-prompts 32 --eval-samples 2")
ARMS_001 = {"K=2, B=3": f"{REGIME_001} --k 2 --batch 3",
            "K=8, B=2": f"{REGIME_001} --k 8 --batch 2 --micro-batch 8",
            "frozen, K=2, B=3": f"{REGIME_001} --k 2 --batch 3 --lr 1e-30"}
PILOT_001 = Record(
    name="real_001_regime_pilot", report="001",
    claim="(pilot) report 001's regime on SmolLM2: LoRA, KL 0.005, 96 steps, K=2/B=3 against K=8/B=2 and a "
          "frozen policy; measured to size the experiment (the sd of the held-out valid share at the end)",
    arms=ARMS_001, tests=(), alpha=0.05, seeds=range(100, 102),
    power="a pilot: 2 seeds an arm, seeds 100-101, which no registered run uses")

RECORDS = {r.name: r for r in (PILOT_001,)}
for _r in RECORDS.values():                      # lab/real.py runs them as it runs its own settings
    real.SETTINGS[_r.name], real.SEED_RANGES[_r.name] = _r.arms, _r.seeds


def experiment(record: Record):
    """The record as the lab calls an experiment, carrying its record (lab.main.rule_of reads it)."""
    run = lambda lab, log=print: measure(record, lab, log)
    run.record, run.__doc__ = record, record.claim
    return run


EXPERIMENTS = {name: experiment(r) for name, r in RECORDS.items()}
