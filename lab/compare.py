"""Compare training settings over several seeds: one table, one figure.

    python -m lab.compare --seeds 6 --common "--steps 100" \\
        "--k 8 --batch 8 --norm global" "--k 2 --batch 3 --norm group"

Each quoted setting is a train.py command line (added to --common), run for seeds 0 .. S-1 into
OUT/runs/<setting>/s<seed>/ from one cached warm start: a table of the final held-out rates (mean
± std, [min-max]), the runs ended off-format, the crash rate beside its frozen-policy floor
(monitor.py), and OUT/compare.png (held-out best per step, mean and spread). One seed proves nothing.

    python -m lab.compare --seeds 3 --nproc 2 --out runs/ddp2 "--k 8 --norm global"   # each run under torchrun

Every checkpoint of runs against their warm start: `python -m tools.checkpoints` (evaluate_checkpoints).
"""
import argparse
import contextlib
import dataclasses
import io
import json
import multiprocessing
import os
import re
import shlex
import signal
import subprocess
import statistics
import sys
import textwrap
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from running import loading

loading.quiet_ctrl_c("python -m lab.compare: interrupted while loading; nothing was written")
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import transformers

from lab import figures
from models import policy
from running import checkpoint, config, report
import diagnostics
import rollout
import tasks
import train

loading.loaded()


@dataclass(frozen=True)
class Launch:
    """How each run is started."""
    jobs: int = 1        # runs at a time, each a process of its own when > 1
    nproc: int = 1       # processes per run: > 1 starts each run under torchrun (distributed.py)
    alone: bool = False  # each run a new process, gone when it ends (its memory freed, its peak its own)


def run_one(argv: list, launch: Launch) -> dict:
    """One train.py run (argv includes --seed and --out); its summary. One job of one process:
    in this process. More jobs of one process: in one of launch.jobs worker processes that
    live as long as this one (pool), each with its share of the CPU threads. Several
    processes per run, or launch.alone: train.py in a new process (under torchrun for several)."""
    if launch == Launch():
        summary = train.train(config.parse_config(argv))
    elif launch.nproc == 1 and not launch.alone:
        summary = pool(launch.jobs).submit(run_in_worker, argv).result()
    else:
        summary = run_in_new_process(argv, launch)
    if summary["interrupted"]:                      # Ctrl-C stopped that run cleanly: stop here too
        raise KeyboardInterrupt(summary["interrupted"])
    if lost_to_the_machine(summary):                # not a result: no verdict may count it
        raise RuntimeError(f"{summary['out']} stopped: {summary['stopped']}")
    return summary


def lost_to_the_machine(summary: dict) -> bool:
    """A run stopped by its machine (a checkpoint or log line it could not write), not by its training."""
    return bool(summary.get("stopped") and (summary.get("failed_saves") or summary.get("lost_log_lines")))


def run_in_new_process(argv: list, launch: Launch) -> dict:
    """train.py argv in a process of its own (under torchrun for launch.nproc > 1), which dies
    with this one on Linux: a lab killed with kill -9 leaves no run writing behind it."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // (launch.jobs * launch.nproc)))
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={launch.nproc}"] \
        if launch.nproc > 1 else []
    done = subprocess.run([sys.executable, *runner, str(Path(__file__).parent.parent / "train.py"), *argv],
                          env=dict(os.environ, OMP_NUM_THREADS=threads), capture_output=True, text=True,
                          preexec_fn=die_with_parent if sys.platform == "linux" else None)
    out = Path(argv[argv.index("--out") + 1])
    if not (out / "summary.json").exists():         # it ended before it could write its summary
        tail = (done.stderr.strip().splitlines() or ["(nothing)"])[-1]
        raise RuntimeError(f"train.py {shlex.join(argv)} exited {done.returncode}: {tail}")
    return json.loads((out / "summary.json").read_text())


def die_with_parent() -> None:
    """In the child, before train.py starts: Linux sends it SIGKILL when its parent dies."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# Worker processes, started once and reused by every run: a process's imports (torch,
# transformers) take seconds, longer than a short run of the tiny model.
_POOLS: dict = {}


def pool(jobs: int) -> ProcessPoolExecutor:
    """The pool of `jobs` worker processes (spawned: no thread or CUDA state inherited), each limited to
    the user's OMP_NUM_THREADS threads (another lab may share the cores), else cpu_count // jobs."""
    if jobs not in _POOLS:
        threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // jobs))
        _POOLS[jobs] = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=worker_init, initargs=(threads,))
    return _POOLS[jobs]


def worker_init(threads: int) -> None:
    """A worker's start: its share of the CPU threads, and Ctrl-C ignored while it waits (a
    terminal's Ctrl-C reaches every process of the group; an idle worker printed a traceback).
    A run in it still stops cleanly: train.py catches SIGINT for as long as it runs. A worker
    whose parent process dies (kill -9 of the lab, a test runner's timeout) ends too: it once
    waited forever, an orphan. It polls its parent: prctl's death signal (die_with_parent)
    follows the thread that started it, here a waiter thread that ends after every sweep."""
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def stop_pools() -> None:
    """Ctrl-C in this process: no queued run starts; the running ones stop at their step's end
    (each got the same Ctrl-C), and the workers end with them."""
    for executor in _POOLS.values():
        executor.shutdown(wait=False, cancel_futures=True)


def run_in_worker(argv: list) -> dict:
    """train.train in a worker; bad flags (exit 2, one line on stderr) and a crash come back
    as a RuntimeError that names the command and the last line, as a process of its own would."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return train.train(config.parse_config(argv))
    except SystemExit as e:
        tail = (err.getvalue().strip().splitlines() or ["(nothing)"])[-1]
        raise RuntimeError(f"train.py {shlex.join(argv)} exited {e.code}: {tail}") from None
    except Exception as e:
        raise RuntimeError(f"train.py {shlex.join(argv)} failed: {type(e).__name__}: {e}") from None


def run_setting(argv: list, seeds: int | range, out: Path, overwrite: bool = False,
                launch: Launch = Launch()) -> list[dict]:
    """Every seed of one setting (seeds: a count from 0, or a range); "{seed}" in a flag becomes
    the seed (a second stage's --init-from RUN/s{seed} starts each seed from the first stage's
    run of the same seed)."""
    runs = [[a.replace("{seed}", str(seed)) for a in argv] + ["--seed", str(seed), "--out", str(out / f"s{seed}"),
                                                             "--quiet"] + ["--overwrite"] * overwrite
            for seed in (range(seeds) if isinstance(seeds, int) else seeds)]
    if launch.jobs == 1:                            # in this (main) thread: Ctrl-C stops a run cleanly
        return [run_one(r, launch) for r in runs]
    with ThreadPoolExecutor(launch.jobs) as waiters:    # threads that each wait on a worker or process
        return list(waiters.map(lambda r: run_one(r, launch), runs))


def slug(setting: str) -> str:
    """The folder name of a setting's runs: '--k 8 --norm global' -> 'k_8_norm_global'."""
    return " ".join(shlex.split(setting)).replace("--", "").replace(" ", "_").replace("/", "_").replace("{seed}", "S")


def spread(xs: list) -> str:
    """mean ± std [min–max] of the values there are; a run without the value (None) is left
    out and counted: "(5 of 6 runs)". The std is the population std over the runs (pstdev), which
    reads sqrt((n-1)/n) of the sample std: 18% lower at 3 runs, 9% at 6, 5% at 10."""
    there = [x for x in xs if x is not None]
    if not there:
        return f"n/a (0 of {len(xs)} runs)"
    sd = statistics.pstdev(there) if len(there) > 1 else 0.0
    out = f"{statistics.mean(there):.2f} ± {sd:.2f} [{min(there):.2f}–{max(there):.2f}]"
    return out if len(there) == len(xs) else f"{out} ({len(there)} of {len(xs)} runs)"


# The standard columns per task: (header, summary key) with the spread over seeds.
STANDARD = {
    "dsl": [("held-out best (end)", "eval_best_rate_end"), ("held-out valid (end)", "eval_valid_rate_end")],
    "tools": [("held-out accuracy (end)", "eval_accuracy_end"),
              ("held-out tool success (end)", "eval_tool_success_rate_end"),
              ("held-out tool calls / episode (end)", "eval_tool_calls_end"),
              ("held-out reward (end)", "eval_reward_mean_end"),
              ("share A < 0 (run mean)", "frac_adv_negative_mean")],
}


def table(results: dict, columns=()) -> str:
    """Markdown: the task's standard columns, then one per extra summary key in `columns`."""
    task = "dsl" if "eval_best_rate_end" in next(iter(results.values()))[0] else "tools"
    cols = STANDARD[task] + [(k, k) for k in columns]
    tail = ["off-format runs", "crash rate", "crash floor", "fallback / junk (end)"] if task == "dsl" else []
    head = ["setting", *[h for h, _ in cols], *tail, "s per run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, runs in results.items():
        cells = [f"`{name}`", *[spread([r.get(k) for r in runs]) for _, k in cols]]
        if task == "dsl":
            cells += [f"{sum(r['ended_off_format'] for r in runs)}/{len(runs)}",
                      f"{statistics.mean(r['crash_rate'] for r in runs):.2f}",
                      f"{statistics.mean(r.get('crash_floor', float('nan')) for r in runs):.2f}",
                      f"{statistics.mean(r['eval_fallback_rate_end'] for r in runs):.2f} / "
                      f"{statistics.mean(r['eval_junk_rate_end'] for r in runs):.2f}"]
        cells.append(f"{statistics.mean(r['seconds'] for r in runs):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Metrics whose early values run off the scale the lesson reads: explained variance is 1 - Var(G - V)
# / Var(G), at most 1 and -900 when every return is nearly equal (docs/metrics.md); below -1 the critic is
# useless all the same.
AXIS_RANGE = {"explained_variance": (-1.05, 1.05)}
MEDIAN = ("explained_variance",)     # one seed's -900 would drag a mean off the axis: these draw the median
LOG_SCALE = ("kl", "kl_coef")


def band(runs: list, key: str, center=statistics.mean) -> tuple:
    """A setting's curve of `key` over its seeds: (steps, center, min, max), each step over the
    seeds that logged it there (a stopped run is shorter; a metric a step could not compute,
    such as the entropy of no completion, is missing; evaluations exist only at their steps)."""
    by_step = [{x["step"]: x[key] for x in report.read_metrics(r["out"]) if x.get(key) is not None}
               for r in runs]
    steps = sorted(set().union(*by_step))
    cols = [[s[t] for s in by_step if t in s] for t in steps]
    return steps, [center(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def figure(results: dict, path: Path, title: str, metrics=("eval_best_rate",)) -> None:
    """A panel per metric, the settings overlaid: each its mean over seeds (a line) and its
    spread, min to max (a band), so the comparison is read in one place on one scale."""
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    lines = textwrap.wrap(title, 60 * cols)
    rows_of_legend = -(-sum(len(textwrap.wrap(f"{name} (9)", 60)) for name in results) // 2)
    top, bottom = 0.25 * len(lines) + 0.2, 0.5 + 0.17 * rows_of_legend            # inches: title, legend
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows + top + bottom), squeeze=False)
    for j in range(len(metrics), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    for i, key in enumerate(metrics):
        ax, drawn = axes[i // cols][i % cols], 0
        for j, (name, runs) in enumerate(results.items()):
            steps, mean, low, high = band(runs, key, statistics.median if key in MEDIAN else statistics.mean)
            ax.fill_between(steps, low, high, color=f"C{j}", alpha=0.18, lw=0)
            ax.plot(steps, mean, color=f"C{j}", lw=2, label=textwrap.fill(f"{name} ({len(runs)})", 60))
            drawn += len(steps)
        ax.set(xlabel="step", ylabel=f"{key} (median over seeds)" if key in MEDIAN else key)
        if not drawn:
            ax.text(0.5, 0.5, "no run logged it", ha="center", transform=ax.transAxes)
        elif key in LOG_SCALE:
            ax.set_yscale("log")
        elif key in AXIS_RANGE:             # the scale of the claim, not of one wild early step
            ax.set_ylim(*AXIS_RANGE[key])
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(2, len(labels)), fontsize=8,
               title="setting (seeds): mean, band from min to max over seeds", title_fontsize=8)
    fig.suptitle("\n".join(lines), fontsize=10)
    figures.save(fig, path, rect=(0, bottom / fig.get_figheight(), 1, 1 - top / fig.get_figheight()))


METRICS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def is_metric(key: str) -> bool:
    """Whether key is a metrics.jsonl key docs/metrics.md documents (eval_<rate>, failure/<kind>
    and sampling/* as families): what `lab.compare --metrics` accepts."""
    names = set()
    for line in METRICS_PAGE.read_text().split("summary.json (`finish`)")[0].splitlines():
        named = re.match(r"^    (\S.*?)(\s{2,}|$)", line)          # the left column of the list above
        names.update(n for n in re.split(r",\s*", named.group(1)) if n) if named else None
    if key in names:
        return True
    if key.startswith("eval_"):                                     # eval_<rate>: a rate above, held out
        return is_metric(key[len("eval_"):])
    families = [n.split("<")[0].rstrip("*") for n in names if "<" in n or n.endswith("*")]
    return any(key.startswith(f) and key != f for f in families if f != "eval_")


SUMMARY_KEYS = ("steps", "updates", "collapses", "crash_rate", "crash_floor", "skipped_nonfinite",
                "alert_episodes", "stopped", "interrupted", "failed_saves", "lost_log_lines",
                "ended_off_format", "frac_adv_negative_mean", "early_stopped", "best_step", "best_checkpoint",
                "eval_value_rmse_end", "explained_variance_end", "eval_reward_mean_end", "seconds",
                "peak_memory_mb", "out")


def summary_keys(task) -> set:
    """Every key summary.json can hold for a task (lab/compare.py checks --columns against it)."""
    evals = [*task.RATES, "reward_mean", "answer_nll"]
    return set(SUMMARY_KEYS) | {f"eval_{key}_{when}" for key in evals for when in ("end", "best")} | \
        {f"eval_{key}_start" for key in task.HEADLINE} | {"train_answer_nll_end", "train_answer_nll_best"}


def main(argv=None):
    p = config.OneLineParser(prog="python -m lab.compare", description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", help="train.py flags for one setting, quoted")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--common", default="", help="flags shared by every setting")
    p.add_argument("--out", type=Path, default=Path("runs/compare"))
    p.add_argument("--metrics", default="eval_best_rate",
                   help="comma-separated metrics.jsonl keys to draw, a row each")
    p.add_argument("--columns", default="",
                   help="comma-separated extra summary.json keys for the table, e.g. eval_value_rmse_end")
    p.add_argument("--overwrite", action="store_true", help="replace the runs already under --out")
    p.add_argument("--model", default="", help="train.py --model for every run (e.g. smollm2-135m)")
    p.add_argument("--jobs", type=int, default=1, help="seeds run as this many parallel processes")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes per run: > 1 runs each under torchrun --nproc_per_node NPROC")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")

    unknown = [m for m in args.metrics.split(",") if not is_metric(m)]
    if unknown:
        p.error(f"--metrics: {unknown[0]!r} is not a metrics.jsonl key (docs/metrics.md lists them)")
    if args.model:
        args.common = f"--model {shlex.quote(args.model)} {args.common}"
    try:                                          # an unbalanced quote: one line, not a traceback
        common, settings = shlex.split(args.common), [shlex.split(s) for s in args.settings]
    except ValueError as e:
        p.error(f"--common or a setting: {e} (shell quoting)")
    columns = [x for x in args.columns.split(",") if x]
    owned = [f for f in ("--seed", "--out") if f in common]
    if owned:
        p.error(f"--common sets {owned[0]}, which compare sets for every run itself; leave it out")
    for s, split in zip(args.settings, settings):  # fail on a bad setting or column before any run
        flags = [a for a in split if a.startswith("--")]
        owned = [f for f in ("--seed", "--out") if f in flags]
        twice = [f for f in flags if flags.count(f) > 1]
        if owned or twice:
            p.error(f"setting {s!r}: " + (f"sets {owned[0]}, which compare sets for every run itself" if owned else
                                          f"gives {twice[0]} twice; the last one would silently win"))
        held = [run for run in (args.out / "runs" / slug(s)).glob("s*") if config.holds_run(run)]
        busy = [run for run in held if checkpoint.is_busy(run)]
        if busy:
            p.error(f"--out: a run is writing in {str(busy[0])!r} now; wait for it, or choose another --out")
        if held and not args.overwrite:
            p.error(f"--out: {str(held[0])!r} holds a run already; --overwrite replaces the runs "
                    f"under {str(args.out)!r}, another --out keeps them")
        c = config.parse_config([a.replace("{seed}", "0") for a in common + split] + ["--overwrite"] * args.overwrite +
                                ["--out", str(args.out / "runs" / slug(s) / "s0")])
        if c.batch % args.nproc:
            p.error(f"--nproc: setting {s!r} has --batch {c.batch}, which does not split over {args.nproc} ranks")
        unknown = [col for col in columns if col not in summary_keys(tasks.TASKS[c.task])]
        if unknown:
            p.error(f"--columns: {unknown[0]!r} is not a summary.json key of --task {c.task}; one of: "
                    f"{', '.join(sorted(summary_keys(tasks.TASKS[c.task])))}")
    results = run_settings(args.settings, args.common, args.seeds, args.out, args.metrics.split(","),
                           columns, overwrite=args.overwrite, launch=Launch(args.jobs, args.nproc))
    print(f"\n{args.seeds} seeds each; common flags: {args.common or '(defaults)'}\n\n{table(results, columns)}")
    print(f"\nwrote {args.out}/table.md and {args.out}/compare.png")


def progress(done: int, total: int, seconds: float) -> str:      # the time left at the pace so far
    return f"{done}/{total} settings, {seconds / 60:.1f} min so far, about {seconds / done * (total - done) / 60:.1f} min left"


def run_settings(settings: list, common: str, seeds: int | range, out: Path, metrics=("eval_best_rate",),
                 columns=(), title: str = "", log=print, overwrite: bool = False, launch: Launch = Launch()) -> dict:
    """Run every setting over seeds into out/runs/<setting>/s<seed>/ (overwrite: replacing the
    runs there); write out/table.md, out/summaries.json and out/compare.png; return
    {setting: [summary per seed]}."""
    results, started = {}, time.time()
    for i, s in enumerate(settings, 1):
        name = " ".join(shlex.split(s))
        results[name] = run_setting(shlex.split(common) + shlex.split(s), seeds, out / "runs" / slug(s),
                                    overwrite, launch)
        log(f"finished {name} ({progress(i, len(settings), time.time() - started)})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table(results, columns) + "\n")
    (out / "summaries.json").write_text(json.dumps(results, indent=1))
    first = json.loads((Path(next(iter(results.values()))[0]["out"]) / "config.json").read_text())
    title = title or f"{len(results[next(iter(results))])} seeds; common: {common or 'defaults'}"
    figure(results, out / "compare.png", f"{title}; {report.made_by(first)}", metrics)
    return results


# ---- every checkpoint against the baseline ----

CHECKPOINT_SEED = 4321          # not diagnostics.EVAL_SEED: the runs picked their best under that one


def run_config(run: Path) -> config.Config:
    """The configuration a run was made with (its config.json)."""
    return config.Config(**config.saved_fields(run, config.Config))


def by_group(models, task, prompts: list, sampling, samples: int, seed: int) -> dict:
    """{group: {rate: value, "reward_mean": ...}} for each value of the prompts' task.GROUP_KEY
    (DSL: problem type), and "all": `samples` rollouts per prompt under `seed`."""
    batch, outcomes = diagnostics.sample_seeded(models, task, prompts, sampling, samples, seed)
    rewards = batch.rewards.tolist()
    groups = {}                                          # group -> rollout indices
    for i, p in enumerate(prompts):
        groups.setdefault(p[task.GROUP_KEY], []).extend(range(i * samples, (i + 1) * samples))
    groups["all"] = list(range(len(outcomes)))
    return {g: dict(task.rates([outcomes[i] for i in idx]), reward_mean=statistics.mean(rewards[i] for i in idx))
            for g, idx in groups.items()}


def evaluate_checkpoints(runs: list, samples: int, kept_only: bool = False, log=print) -> dict:
    """{"baseline": by_group of the warm start, "runs": {run: [(step, by_group), ...]}}
    for every checkpoint of each run, oldest first (kept_only: only the one a later stage
    would start from, checkpoint.starting_point), all on the same held-out prompts and seed."""
    transformers.utils.logging.disable_progress_bar()                       # one bar per checkpoint load
    cfg = dataclasses.replace(run_config(runs[0]), init_from="", device="cpu")
    task = tasks.TASKS[cfg.task]
    model, tok = policy.load(cfg, task, "cpu", log=lambda s: None)        # the warm start
    models, sampling, prompts = rollout.Models(model, tok), tasks.Sampling.of(cfg), \
        task.prompts("eval", cfg.difficulty)
    out = {"baseline": by_group(models, task, prompts, sampling, samples, CHECKPOINT_SEED), "runs": {}}
    for run in runs:
        ckpts = [checkpoint.starting_point(run)] if kept_only else sorted(checkpoint.candidates(run))
        out["runs"][str(run)] = []
        for ckpt in ckpts:
            model.load_state_dict(policy.read_weights(ckpt, model))
            step = int(ckpt.name.split("-")[-1])
            out["runs"][str(run)].append((step, by_group(models, task, prompts, sampling, samples,
                                                                  CHECKPOINT_SEED)))
        log(f"evaluated {len(ckpts)} checkpoint(s) of {run}")
    return out


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        stop_pools()
        print("python -m lab.compare: interrupted; the finished runs' folders are kept", file=sys.stderr)
        sys.exit(130)                 # after the running runs' current step: each stops cleanly
