"""Each report's central claim on the real model, in the report's own regime: experiments as records.

    python -m lab --model smollm2-135m --out results/smollm2-135m real_001_regime_pilot   # by name only: hours each

A record (lab/records/NAME.json) is the whole experiment: the claim, its arms (train.py flags after
lab/real.py's COMMON), the claims tested (metric, arm, below/above, arm), alpha, the seeds, the power
computation and pilot that chose them, and why (its regime, in words). `measure` runs it, tests it and
writes the entry; before its first run, OUT/NAME/registration.json: the sha256 of the record and of the
code that decides, the commit, the date. A record changed since then is refused: a new experiment, a new name.
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


def one_sided(relation: str, x: list, y: list) -> float:
    """The one-sided permutation p of mean(x) below (or above) mean(y)."""
    return stats.permutation(y, x) if relation == "below" else stats.permutation(x, y)


OFF_FORMAT = 0.25     # a run fell off the format (report 002's collapse) when its held-out valid share ends below this


def value(run: dict, metric: str):
    """A run's metric: a key of its summary.json, crash_above_floor (its crash rate above its null), or
    off_format_end (1.0 if it fell off the format, else 0.0: a mean of these is a rate, and its
    one-sided permutation test is Fisher's exact test)."""
    if metric == "crash_above_floor":
        return run["crash_rate"] - run["crash_floor"]
    return float(run["eval_valid_rate_end"] < OFF_FORMAT) if metric == "off_format_end" else run.get(metric)


# what every record's entry and table show, by task, beside the metrics its claims test
SHOWN = {"dsl": ("eval_valid_rate_end", "eval_fallback_rate_end", "crash_above_floor", "off_format_end"),
         "tools": ("eval_tool_calls_end", "eval_answer_rate_end", "eval_accuracy_end", "frac_adv_negative_mean")}
COLUMNS = {"dsl": [("held-out valid (start)", "eval_valid_rate_start"), ("held-out valid (end)", "eval_valid_rate_end"),
                   ("held-out fallback (end)", "eval_fallback_rate_end"), ("held-out best (end)", "eval_best_rate_end"),
                   ("crash rate", "crash_rate"), ("crash floor", "crash_floor")],
           "tools": [("held-out accuracy (start)", "eval_accuracy_start"), ("held-out tool calls (end)", "eval_tool_calls_end"),
                     ("held-out answer rate (end)", "eval_answer_rate_end"), ("held-out accuracy (end)", "eval_accuracy_end"),
                     ("share A < 0", "frac_adv_negative_mean"), ("non-finite steps skipped", "skipped_nonfinite")]}


def registration(record: Record) -> dict:
    """What registers a record: the sha256 of its text and of its deciding code, the commit, the date."""
    text = repr(record)
    code = "".join(inspect.getsource(f) for f in (measure, value, one_sided, device)) + f"OFF_FORMAT = {OFF_FORMAT}"
    sha = lambda s: hashlib.sha256(s.encode()).hexdigest()[:16]
    return {"text": text, "sha256": sha(text), "code_sha256": sha(code), "commit": commit(),
            "registered": time.strftime("%Y-%m-%d")}


def register(record: Record, folder: Path) -> None:
    """Write the record's registration into folder before its first run; leave the one there if the
    record is the same; SystemExit (one line) if the record changed since it was registered."""
    path, now = folder / "registration.json", registration(record)
    if path.exists():
        old = json.loads(path.read_text())
        if old["sha256"] != now["sha256"]:
            raise SystemExit(f"python -m lab: {record.name}'s record changed since its registration on "
                             f"{old['registered']} ({path}); a changed experiment is a new one: give it a new name")
        return
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now, indent=1) + "\n")


def measure(record: Record, lab: real.RealLab, log=print) -> dict:
    """Run the record's arms over its seeds (each run kept), test each claim, and say what was measured."""
    register(record, lab.root / record.name)
    runs = {label: [lab.run(record.name, label, seed, log) for seed in record.seeds] for label in record.arms}
    task = "tools" if "--task tools" in next(iter(record.arms.values())) else "dsl"
    real.write_table(lab, record.name, runs, COLUMNS[task])
    values = lambda metric, label: [value(r, metric) for r in runs[label]]
    shown = "; ".join(f"{metric}: " + ", ".join(f"{label} {compare.spread(values(metric, label))}" for label in runs)
                      for metric in dict.fromkeys([*SHOWN[task], *(t[0] for t in record.tests)]))
    verdicts, tested = [], []
    devices = sorted({device(r) for rs in runs.values() for r in rs})
    for metric, arm, relation, other in record.tests * (len(devices) == 1):
        p = one_sided(relation, values(metric, arm), values(metric, other))
        claim = f"{metric}: {arm} {relation} {other}"
        tested.append(f"{claim}, one-sided permutation p = {stats.p_value(p)}")
        verdicts.append(f"{claim}: {stats.decide(p, record.alpha)}")
    return dict(report=record.report, figure=f"{record.name}/compare.png", claim=record.claim,
                measured=f"seeds {record.seeds.start}-{record.seeds.stop - 1}, {len(record.seeds)} an arm, on "
                         f"{' and '.join(devices)}: {shown}; "
                         + "".join(f"{t}; " for t in tested) + real.at_warm_start(runs),
                verdict="; ".join(verdicts) or ("a pilot (no verdict)" if len(devices) == 1 else
                                                 f"no verdict: its runs ran on {' and '.join(devices)}, not one device"))


def device(run: dict) -> str:      # cpu or cuda: a record's runs on both get no verdict (numerics differ)
    return json.loads((Path(run["out"]) / "config.json").read_text()).get("ran_on", "?").split()[0]


RECORDS_DIR = Path(__file__).parent / "records"


def load(path: Path) -> Record:
    """A record from its file (its `why` is read by people, not hashed: what decides is the Record)."""
    d = json.loads(path.read_text())
    return Record(name=path.stem, report=d["report"], claim=d["claim"], arms=d["arms"],
                  tests=tuple(map(tuple, d["tests"])), alpha=d["alpha"], seeds=range(*d["seeds"]), power=d["power"])


RECORDS = {r.name: r for r in map(load, sorted(RECORDS_DIR.glob("*.json")))}
for _r in RECORDS.values():                      # lab/real.py runs them as it runs its own settings
    real.SETTINGS[_r.name], real.SEED_RANGES[_r.name] = _r.arms, _r.seeds


def experiment(record: Record):
    """The record as the lab calls an experiment, carrying its record (lab.main.rule_of reads it)."""
    run = lambda lab, log=print: measure(record, lab, log)
    run.record, run.__doc__ = record, record.claim
    return run


EXPERIMENTS = {name: experiment(r) for name, r in RECORDS.items()}
