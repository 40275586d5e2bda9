"""The lab: every comparison of the four reports, rerun over seeds, with its figure and verdict.

    python -m lab                        # all of them, 6 seeds a setting (20 for the collapse ones), then
                                         # the detector bench over their kept runs
    python -m lab group_norm tools       # some of them
    python -m lab --quick                # all of them, 2 seeds, a few steps, into runs/lab-quick (CI)
    python -m lab --list                 # the experiments and the report each comes from
    python -m lab --model smollm2-135m   # the central claims on a real model (lab/real.py), into
                                         # runs/lab/smollm2-135m; stop it and run it again to continue
    python -m lab --out results NAME     # a maintainer's refresh of the committed results/
    python -m lab --block 2 NAME         # NAME again on seeds + 1000, into OUT/block2: does its verdict replicate?

Each experiment writes OUT/NAME/ (its runs under runs/, table.md, figures) and returns the claim,
what we measured, and a verdict by a rule stated in its code (never tuned to agree); OUT/SUMMARY.md
collects them. OUT is runs/lab (runs/lab/MODEL with --model) unless --out says otherwise: the
committed results/ change only when asked.
"""
import argparse
import fcntl
import hashlib
import inspect
import json
import os
import re
import time
from pathlib import Path

import transformers

from running import config
from models import pretrained
from lab.common import BLOCK, Lab, commit, cpu
from lab.report000 import critic, curriculum, tools, tools_ppo
from lab.report001 import dynamic_sampling, group_norm, k2_pm1
from lab.probe001 import probe_001, probe_001_held
from lab.popular_code import clip_inverted, micro_token_mean, sampled_not_scored
from lab.report002 import batch_size, entropy, fixed_vs_dynamic, grad_clip, grad_clip_regime
from lab.report003 import kl_range, kl_regime, kl_regime_fixed, rce_grpo
from lab import real, real_collapse, regimes, stats
from lab.detectors import detectors, rollback, rollback_stale
from lab.collapse import (collapse_rate, entropy_collapse, entropy_collapse_epochs, entropy_collapse_2026, mismatch,
                          trust_regions_stale)

EXPERIMENTS = {f.__name__: f for f in (k2_pm1, group_norm, dynamic_sampling, probe_001, probe_001_held, critic,
                                       batch_size, grad_clip, grad_clip_regime, fixed_vs_dynamic, kl_range, kl_regime,
                                       kl_regime_fixed, rce_grpo, tools, curriculum, tools_ppo, entropy, collapse_rate,
                                       entropy_collapse, entropy_collapse_epochs, entropy_collapse_2026, mismatch,
                                       trust_regions_stale, detectors, rollback, rollback_stale, clip_inverted,
                                       micro_token_mean, sampled_not_scored)}
REAL = {**real.EXPERIMENTS, **real_collapse.EXPERIMENTS, **regimes.EXPERIMENTS}   # --model: lab/real*.py, lab/regimes.py
NEEDS = {"dynamic_sampling": ["group_norm"], "entropy_collapse": ["collapse_rate"]}          # experiments whose runs another one reads


def said_verdict(out: Path, name: str, entry: dict) -> str:
    """The verdict as SUMMARY.md records it: the terminal says what the file says (tested_verdict)."""
    tested = stats.after_the_fact(out, name) if not entry.get("quick") else []
    return stats.tested_verdict(entry["verdict"], tested, name)


def summary_md(results: dict, root: Path | None = None) -> str:
    """SUMMARY.md of the entries in results; root: the lab's folder, whose runs give the tests
    made after them (stats.after_the_fact) for the entries whose rule named none."""
    head = ("# What the reports claimed, and what the lab measured\n\n"
            "Written by `python -m lab`; each entry says when it was measured and with how many seeds "
            "per setting. Each verdict is computed from the numbers by the rule written next to its "
            "experiment in lab/report00N.py or lab/collapse.py (lab/real.py, lab/real_collapse.py on a real model).\n")
    parts = [head]
    for name, r in results.items():
        fig = f"\n\n![{name}]({r['figure']})" if r.get("figure") else ""
        seeds = f"{r['seeds']} seeds" if r.get("seeds") else "no runs of its own"
        when = f"{r.get('date', '?')}, {seeds}" + (f", {r['cpu']}" if r.get("cpu") else "") + \
            (", QUICK: a smoke test, not a result" if r.get("quick") else "")
        source = f"report {r['report']}" if re.match(r"\d{3}\b", r["report"]) else r["report"]   # or the papers
        rule = r.get("rule") or {}
        code = rule.get("code_sha256")
        code = (f"; the deciding code's sha256 {code}, run from {rule.get('commit')}" +
                (f", changed since its registration's {rule['code_registered']}" if rule.get("code_registered")
                 not in (None, code) else "")) if code else ""
        ruled = (f"\n- **Rule** (registered {rule.get('registered') or 'with no runs'}, sha256 {rule['sha256']}{code}): "
                 f"{rule['text']}" if rule.get("sha256") else "")
        changed = rule.get("changed")
        if changed:
            ruled += (f"\n- **Rule changed after runs existed.** Under the rule registered "
                      f"{changed.get('registered')} (\"{changed['rule']}\") the verdict was: {changed['verdict']}")
        tested = stats.after_the_fact(root, name) if root and not r.get("quick") else []    # as said_verdict
        if tested:
            why = "beside the registered test" if stats.NAMED_TEST.search(rule.get("text", "")) else \
                "the rule named no test"
            ruled += (f"\n- **Tested after the runs** ({why}; one-sided, alpha {stats.ALPHA}; "
                      f"a mean is the held-out best at the end unless named): " + "; ".join(phrase for _, _, phrase in tested))
        parts.append(f"## {name} ({source})\n\n- **Claimed:** {r['claim']}{'' if r['claim'][-1:] in '.?!' else '.'}\n"
                     f"- **Measured:** {r['measured']}.\n- **Verdict:** {stats.tested_verdict(r['verdict'], tested, name)}. "
                     f"({when}; {r['seconds']:.0f} s){ruled}{second_block(root, name, r)}{fig}\n")
    return "\n".join(parts)


def second_block(root: Path | None, name: str, entry: dict) -> str:
    """SUMMARY.md's line on the replication: the verdict the same experiment reached on seeds + 1000
    (root/block2, `--block 2`), and whether it is the first block's; a verdict is decided only if both say it."""
    other = read_summary(root / "block2").get(name) if root and (root / "block2" / "summary.json").exists() else None
    if not other or entry.get("quick"):
        return ""
    said = [said_verdict(r, name, e) for r, e in ((root, entry), (root / "block2", other))]
    same = [re.split(r"[:(]", v)[0].strip() for v in said]
    rules = [(e.get("rule") or {}).get("sha256") for e in (entry, other)]
    if None not in rules and rules[0] != rules[1]:
        judged = f"Under another rule than the first block's (sha256 {rules[1]}): not a replication."
    elif same[0] == same[1]:
        judged = "Replicates: the same verdict."
    else:
        judged = f"Does not replicate ({same[0]} against {same[1]}): not decided."
    return f"\n- **Second block** (every seed + {BLOCK}; {other.get('date', '?')}, {other.get('cpu', '?')}): {said[1]}. {judged}"


def main(argv=None):
    p = config.OneLineParser(prog="python -m lab", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="experiments to run (default: all)")
    p.add_argument("--quick", action="store_true", help="2 seeds and a few steps each: a smoke test")
    p.add_argument("--out", type=Path, default=None,
                   help="where NAME/, summary.json and SUMMARY.md go (default: runs/lab, runs/lab/MODEL "
                        "with --model, runs/lab-quick with --quick; --out results refreshes the committed ones)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--block", type=int, default=1, choices=(1, 2), help="2: rerun on a second block of seeds (each + 1000), "
                   "into OUT/block2, whose verdicts SUMMARY.md sets beside the first block's")
    p.add_argument("--model", default="", help="run on a real model (train.py --model, e.g. smollm2-135m), "
                   "each experiment's lr and steps scaled for it (REAL_LR_SCALE, REAL_STEPS_DIVISOR)")
    # --jobs 1 runs every seed in this process, one after another; more jobs run seeds side by
    # side in worker processes started once (compare.pool), each with 1 CPU thread on 2 cores
    p.add_argument("--jobs", type=int, help="runs at a time (default: 2, or 1 on one core; with --model 1: a SmolLM2 run "
                   "fills a laptop), each with OMP_NUM_THREADS threads if set (another lab may share), else cores / jobs")
    args = p.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.block == 2 and args.model:
        p.error("--block 2 is for the tiny model's lab, not --model")
    if args.model:
        problem = pretrained.problem(args.model)
        if problem:
            p.error(f"--model: {problem}")
    if args.list:
        for name, fn in {**EXPERIMENTS, **REAL}.items():
            print(f"{name:18s} {fn.__doc__.strip().splitlines()[0]}")
        return
    unknown = [n for n in args.names if n not in EXPERIMENTS and n not in REAL]
    if unknown:
        p.error(f"unknown experiment {unknown[0]!r}; one of: {', '.join([*EXPERIMENTS, *REAL])}")
    out = (args.out or Path("runs/lab-quick" if args.quick else
                            f"runs/lab/{args.model.replace('/', '_')}" if args.model else "runs/lab")) \
        / ("block2" if args.block == 2 else "")
    if not config.writable(out):
        p.error(f"--out: cannot create or write to the folder {str(out)!r}")
    if args.model and not args.quick and all(n in REAL for n in args.names):
        return real_lab(args, out)
    if any(n in REAL for n in args.names):
        p.error("the real_* experiments need --model (and no --quick)")
    names = args.names or list(EXPERIMENTS)
    names = [n for n in EXPERIMENTS if n in names or any(n in NEEDS.get(m, []) for m in names)]
    blocked = [n for n in names if (out / n).exists() and not (out / n).is_dir()]
    if blocked:
        p.error(f"--out: {str(out / blocked[0])!r} is a file where the experiment's folder goes; move it")
    lab = Lab(out, args.quick, args.model, args.jobs or min(2, os.cpu_count() or 1), args.block)
    transformers.utils.logging.disable_progress_bar()    # loading the tiny model here (batch_size): no bars
    t_all = time.time()
    for name in names:
        t0 = time.time()
        print(f"{name} ...", flush=True)
        lab.most_seeds = 0
        entry = dict(EXPERIMENTS[name](lab), seconds=time.time() - t0,   # seeds: those it ran (None: no runs)
                     date=time.strftime("%Y-%m-%d"), seeds=lab.most_seeds or None, quick=args.quick,
                     rule=rule_of(EXPERIMENTS[name]), cpu=cpu(), block=args.block)
        mark = "QUICK, a smoke test and not a verdict: " if args.quick else ""
        record(out, name, entry)                                        # after every experiment
        print(f"{name}: {mark}{said_verdict(out, name, entry)} ({entry['seconds']:.0f} s)", flush=True)
    print(f"wrote {out / 'SUMMARY.md'} in {time.time() - t_all:.0f} s")


def real_lab(args, out: Path) -> None:
    """lab/real.py's experiments on args.model, each finished run kept: a second call continues the first."""
    lab = real.RealLab(out, args.model, jobs=args.jobs or 1)
    names = args.names or [n for n in REAL if n not in regimes.RECORDS]     # a record runs by its name: hours each
    left, seconds = real.estimate(lab, names)
    print(f"python -m lab --model {args.model}: {left} runs left of {', '.join(names)}, about "
          f"{seconds / 3600:.1f} h one at a time (its setting's finished runs, else COST in lab/real.py)", flush=True)
    t_all = time.time()
    for name in set(names) & set(regimes.RECORDS):       # registered before any of its runs starts
        regimes.register(regimes.RECORDS[name], out / name)
    real.run_pending(lab, names)             # the runs left, arms seed by seed, lab.jobs at a time (8 on a GPU)
    for name in names:
        t0 = time.time()
        print(f"{name} ...", flush=True)
        entry = dict(REAL[name](lab), seconds=time.time() - t0, date=time.strftime("%Y-%m-%d"),
                     seeds=lab.seeds_of(name), quick=False, rule=rule_of(REAL[name], out / name))
        record(out, name, entry)
        print(f"{name}: {said_verdict(out, name, entry)} ({entry['seconds']:.0f} s)", flush=True)
    print(f"wrote {out / 'SUMMARY.md'} in {time.time() - t_all:.0f} s")


def record(out: Path, name: str, entry: dict) -> None:
    """Add one experiment's entry to out/summary.json and rewrite SUMMARY.md, other entries kept; under a
    lock, re-read first (two labs in one folder merge), each file written beside and renamed. An entry that
    measured what the recorded one did keeps its date and seconds; a retired one (real_monitor) stays, last."""
    with open(out / ".summary.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = read_summary(out)
        old = results.get(name, {})
        if all(old.get(k) == entry.get(k) for k in ("measured", "verdict", "seeds", "quick")):
            entry = dict(entry, seconds=old["seconds"], date=old.get("date"))
        results[name] = registered(entry, old)
        results = {n: results[n] for n in [*REAL, *EXPERIMENTS, *results] if n in results}   # retired ones last
        for file, text in (("summary.json", json.dumps(results, indent=1)), ("SUMMARY.md", summary_md(results, out))):
            tmp = out / f".{file}.tmp-{os.getpid()}"
            tmp.write_text(text)
            os.replace(tmp, out / file)


def rule_of(experiment, folder: Path | None = None) -> dict | None:
    """An experiment's rule as its code states it: its comment blocks opening "# rule:" or "# rule (" (each to the
    first line that is not a comment), their sha256, the deciding code's (deciding_code) and the commit it ran from.
    A record's (lab/regimes.py): its registration, the whole record's sha256, dated by folder's registration.json."""
    if getattr(experiment, "record", None):
        return dict(regimes.registration(experiment.record),
                    registered=folder and json.loads((folder / "registration.json").read_text())["registered"])
    lines, text, inside = inspect.getsource(experiment).splitlines(), [], False
    for line in lines:
        inside = bool(re.match(r"# rules?( \(|:)", line.strip())) or (inside and line.strip().startswith("#"))
        text += [line.strip().lstrip("# ")] if inside else []
    if not text:
        return None
    joined = " ".join(text)
    return {"text": joined, "sha256": hashlib.sha256(joined.encode()).hexdigest()[:16],
            "code_sha256": hashlib.sha256(deciding_code(experiment).encode()).hexdigest()[:16], "commit": commit()}


def deciding_code(experiment) -> str:
    """The experiment's source and that of every function of the lab it calls by name, or through a lab
    module (stats.sign_flip): one level deep."""
    g, names = experiment.__globals__, experiment.__code__.co_names
    spaces = [g, *(vars(m) for n in names if inspect.ismodule(m := g.get(n)) and m.__name__.startswith("lab."))]
    called = {f for space in spaces for n in names if inspect.isfunction(f := space.get(n)) and f.__module__.startswith("lab.")}
    return "\n".join(inspect.getsource(f) for f in [experiment, *sorted(called - {experiment}, key=lambda f: f.__qualname__)])


def registered(entry: dict, old: dict) -> dict:
    """The entry with its rule's registration: the date the rule was first recorded with runs (a record's:
    its registration.json's; kept while the rule stays the same), and, when the rule changed after runs existed under
    an older one, that rule, its registration and the verdict recorded under it (`changed`).
    A --quick entry registers nothing: a smoke test is not a result."""
    rule = entry.get("rule")
    if rule is None or entry.get("quick"):
        return entry
    before = old.get("rule") if not old.get("quick") else None
    if before and before.get("sha256") == rule["sha256"]:
        rule = dict(rule, registered=rule.get("registered") or before.get("registered"), changed=before.get("changed"),
                    code_registered=before.get("code_registered", before.get("code_sha256")))
    elif before:                          # a new rule over runs of an old one: the old one's verdict stays beside
        rule = dict(rule, registered=entry["date"], changed=dict(rule=before["text"], registered=before.get(
            "registered"), verdict=old.get("verdict"), measured=old.get("measured")))
    else:
        rule = dict(rule, registered=rule.get("registered") or entry["date"], changed=None)
    return dict(entry, rule=dict(rule, code_registered=rule.get("code_registered") or rule.get("code_sha256")))


ENTRY_KEYS = ("report", "claim", "measured", "verdict", "seconds")     # what SUMMARY.md reads of an entry


def whole_entry(name: str, entry) -> bool:
    """Whether a summary.json entry has what SUMMARY.md needs; one that does not (edited by hand,
    an older lab's) is said in one line and left out, so its experiment's next run replaces it
    (it once ran the experiment and then died on the old entry, recording nothing)."""
    missing = [k for k in ENTRY_KEYS if not isinstance(entry, dict) or k not in entry]
    if missing:
        print(f"python -m lab: summary.json's entry {name!r} lacks {missing[0]!r}; left out (run {name} "
              f"again to record it)", flush=True)
    return not missing


def read_summary(out: Path) -> dict:
    """out/summary.json's entries; a torn one (a write cut short before writes were atomic) is
    kept aside as summary.json.torn, said in one line, and the summary starts again."""
    path = out / "summary.json"
    if not path.exists():
        return {}
    try:
        results = json.loads(path.read_text())
        if isinstance(results, dict):
            return {name: r for name, r in results.items() if whole_entry(name, r)}
    except ValueError:
        pass
    path.replace(out / "summary.json.torn")
    print(f"python -m lab: {path} could not be read; kept as summary.json.torn, and this run's entries start "
          f"a new one", flush=True)
    return {}

