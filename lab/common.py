"""What every experiment of the lab shares: where it writes, how it shrinks for --quick or scales
for a real model, and a few means."""
import gzip
import platform
import re
import statistics
import subprocess
from pathlib import Path

from lab import compare
from running import report

SEEDS, QUICK_SEEDS = 6, 2
# Most experiments evaluate every 20 steps (the lab's time, docs/lab-notebook.md): an evaluation has
# its own seed (diagnostics.sample_seeded), so how often a run is evaluated does not change it;
# kl_range, rce_grpo (the best evaluation, early stopping) and group_norm_aggressive_lr every 10.

# A real pretrained model (--model) runs each experiment with its learning rates scaled by
# REAL_LR_SCALE and its steps divided by REAL_STEPS_DIVISOR; K and B stay, since they are
# what the experiments compare. Why: the tiny model starts from random weights and learns
# at lr 1e-3 (7e-3 to make it crash); a pretrained 135M model fine-tunes at ~1e-5, and the
# same 100x keeps each experiment's "moderate" and "aggressive" rates apart by the same
# factor (an experiment that sets no --lr gets train.py's real-model default, 2e-5). A real
# model's step is far slower on a CPU (`python -m tools.bench --model smollm2-135m`, figures in
# docs/performance.md), so a third of the steps. Our choices, not tuned to any outcome.
REAL_LR_SCALE, REAL_STEPS_DIVISOR = 0.01, 3
BLOCK = 1000          # a second block of seeds (python -m lab --block 2) runs seed s as s + 1000: no experiment uses >= 1000
COLLAPSED = 0.9       # the real-model lab's collapse: eval_one_answer at or above this, one answer for (nearly) every prompt


class Lab:
    """Where an experiment writes, and how big it runs (--quick shrinks every run; --model
    scales them for a real model; --jobs runs seeds side by side in worker processes)."""

    def __init__(self, root: Path, quick: bool, model: str = "", jobs: int = 1, block: int = 1):
        self.root, self.quick, self.model, self.jobs = root, quick, model, jobs
        self.seeds = QUICK_SEEDS if quick else SEEDS
        self.offset = BLOCK * (block - 1)   # --block 2: every seed + 1000, a draw the first block never made
        self.most_seeds = 0             # the most seeds one setting of the experiment in progress ran
                                        # (its entry's stamp: calibration runs on other seeds add none)

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def shrink(self, flags: str) -> str:
        """--quick: every --steps N becomes N // 15 (at least 4; --warmup-steps and --save-every
        too, at least 1). --model: every --steps N (and those two) becomes
        N // REAL_STEPS_DIVISOR and every --lr x becomes x * REAL_LR_SCALE (before --quick
        shrinks the steps further)."""
        if self.model:
            flags = re.sub(r"--(steps|warmup-steps|save-every) (\d+)",
                           lambda m: f"--{m.group(1)} {max(1, int(m.group(2)) // REAL_STEPS_DIVISOR)}", flags)
            flags = re.sub(r"--lr (\S+)", lambda m: f"--lr {float(m.group(1)) * REAL_LR_SCALE:g}", flags)
        if not self.quick:
            return flags
        return re.sub(r"--(steps|warmup-steps|save-every) (\d+)",
                      lambda m: f"--{m.group(1)} {max(4 if m.group(1) == 'steps' else 1, int(m.group(2)) // 15)}",
                      flags)

    def block(self, seeds: range) -> range:
        """The seeds as this block runs them (the first block's + self.offset)."""
        return range(seeds.start + self.offset, seeds.stop + self.offset)

    def sweep(self, name: str, settings: list, common: str, metrics=("eval_best_rate",), columns=(),
              seeds: range | None = None):
        """Every setting over seeds (default: self.seeds from 0; --quick: the first 2 of the range),
        each shifted into this block (self.block)."""
        seeds = self.block(range(self.seeds) if seeds is None else seeds[:QUICK_SEEDS] if self.quick else seeds)
        self.most_seeds = max(self.most_seeds, len(seeds))
        common = self.shrink(common) + (" --eval-every 5 --eval-samples 1" if self.quick else "") \
            + (f" --model {self.model}" if self.model else "")
        settings = [self.shrink(s) for s in settings]
        # an experiment's rerun replaces its own runs: the lab owns its --out folder
        results = compare.run_settings(settings, common, seeds, self.dir(name), metrics, columns,
                                       title=f"{name}: {len(seeds)} seeds; common: {common}",
                                       log=lambda s: print(f"  {name}: {s}", flush=True), overwrite=True,
                                       launch=compare.Launch(self.jobs))
        for runs in results.values():
            for run in runs:
                keep(Path(run["out"]))
        return {key: runs for key, runs in zip(settings, results.values())}


def keep(run: Path) -> None:
    """run/metrics.jsonl as run/metrics.jsonl.gz, the per-step record committed with the lab's
    results (.gitignore keeps it, config.json and summary.json of each run, and nothing else):
    every number of an entry can be recomputed from it. Byte for byte the same for the same
    file (no timestamp in the gzip header)."""
    (run / "metrics.jsonl.gz").write_bytes(gzip.compress((run / "metrics.jsonl").read_bytes(), mtime=0))


def cpu() -> str:
    """This machine's CPU as the lab records it beside a block's verdicts: another CPU sums in another
    order, so a seed is another draw there."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"model name\s*:\s*(.+)", info)
    return (name.group(1) if name else platform.processor() or platform.machine()) + " with AVX-512" * (" avx512f" in info)


def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")


def end(runs, key):
    return mean(r[key] for r in runs)


def metric_rows(run: dict) -> list:
    return report.read_metrics(run["out"])


def commit() -> str:
    """The commit the lab ran from (+ "with uncommitted changes" outside results/, which the lab writes), or "?"."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results")
    return (git("rev-parse", "--short", "HEAD") + " with uncommitted changes" * bool(changed)) or "?"
