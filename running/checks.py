"""Every flag checked before any model loads: bad input ends with one line naming the flag, and
exit code 2 (running/config.py's parse_config calls `validate`). Also what a run folder, a
model folder and a seed must look like, and the default name of a run's folder.
"""
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
from pathlib import Path

import torch

import tasks
from models import policy, pretrained
from running import checkpoint, distributed


class ConfigError(ValueError):
    pass


def validate(cfg, lessons):
    """Check every flag before any work starts; raise ConfigError naming the flag. First what
    each field says of itself (a finite number, in its range), then each lesson's own checks
    (its `problems`), then whether a flag is read at all (by this --algo, this --policy-loss,
    with the knob it serves), then the run's own."""
    for f in dataclasses.fields(cfg):
        value, flag, meta = getattr(cfg, f.name), f.name.replace("_", "-"), f.metadata
        if isinstance(value, float) and not math.isfinite(value):      # inf and nan pass every comparison
            raise ConfigError(f"--{flag}: must be a finite number, got {value}")
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = (f"in [{lo:g}, {hi:g}]" if lo is not None and hi is not None
                      else f">= {lo:g}" if lo is not None else f"<= {hi:g}")
            raise ConfigError(f"--{flag}: must be {bounds}, got {value:g}" + (
                "" if lo is not None or hi < 100 else ": past it the run cannot mean anything (float32 overflows)"))
    for lesson in lessons:
        for flag, why in getattr(lesson, "problems", lambda cfg: ())(cfg):
            raise ConfigError(f"--{flag.replace('_', '-')}: {why}")
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for f in dataclasses.fields(cfg):
        value, flag, meta = getattr(cfg, f.name), f.name.replace("_", "-"), f.metadata
        algos, changed = meta.get("algos"), value != f.default
        if changed and algos and cfg.algo not in algos:            # a flag acts in every algorithm that accepts it
            raise ConfigError(f"--{flag}: only --algo {listed(algos)} {'uses' if len(algos) == 1 else 'use'} "
                              f"it; --algo {cfg.algo} would ignore it (leave it at {f.default!r})")
        objectives = meta.get("objective")
        if changed and objectives and cfg.policy_loss not in objectives:
            raise ConfigError(f"--{flag}: only --policy-loss {listed(objectives)} "
                              f"{'reads' if len(objectives) == 1 else 'read'} it; --policy-loss {cfg.policy_loss} "
                              f"would ignore it")
        needs = meta.get("needs")
        if changed and needs and getattr(cfg, needs) == defaults[needs]:
            raise ConfigError(f"--{flag}: only --{needs.replace('_', '-')} reads it; give it too")
    return run_problems(cfg)


def listed(names) -> str:
    """('a', 'b', 'c') -> 'a, b and c'."""
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def run_problems(cfg):
    """The run's own flags: the task, the batch over the ranks, the model, the folders."""
    def need(ok, flag, what):
        if not ok:
            raise ConfigError(f"--{flag}: {what}")
    need(not cfg.dynamic_sampling or not distributed.launched(), "dynamic-sampling",
         "not under torchrun: ranks would sample different numbers of rounds (dynamic_sampling.py)")
    ranks = distributed.size()                      # torchrun's WORLD_SIZE; 1 for python train.py
    need(cfg.batch % ranks == 0, "batch", f"{cfg.batch} prompts per step do not split over {ranks} ranks "
         f"(torchrun's processes); give a multiple of {ranks}")
    need(not cfg.tensorboard or has_tensorboard(), "tensorboard",
         "needs the tensorboard package, an optional dependency: pip install tensorboard==2.21.0")
    cfg.lr = cfg.lr or (2e-5 if cfg.model else 1e-3)
    need(0 <= cfg.min_lr <= cfg.lr, "min-lr", f"must be in [0, --lr], got {cfg.min_lr}")
    need(0 <= cfg.warmup_steps < cfg.steps, "warmup-steps", f"must be in [0, --steps), got {cfg.warmup_steps}")
    need(cfg.mini_batch == 0 or cfg.n % cfg.mini_batch == 0, "mini-batch",
         f"must divide N = batch*k = {cfg.n} (or be 0), got {cfg.mini_batch}")
    need(cfg.mini_batch % ranks == 0, "mini-batch", f"must split over {ranks} ranks, got {cfg.mini_batch}")
    mini = (cfg.mini_batch or cfg.n) // ranks
    need(cfg.micro_batch == 0 or mini % cfg.micro_batch == 0, "micro-batch",
         f"must divide the mini-batch ({mini} sequences{' per rank' if ranks > 1 else ''}) (or be 0), "
         f"got {cfg.micro_batch}")
    top = tasks.TASKS[cfg.task].MAX_DIFFICULTY
    need(1 <= cfg.difficulty <= top, "difficulty", f"must be in [1, {top}] for --task {cfg.task}, got "
         f"{cfg.difficulty}" if top > 1 else f"--task {cfg.task} has one difficulty (1), got {cfg.difficulty}")
    need(0 <= cfg.sft_difficulty <= top, "sft-difficulty", f"must be in [1, {top}] for --task {cfg.task} (or 0 = "
         f"--difficulty), got {cfg.sft_difficulty}")
    cfg.sft_difficulty = cfg.sft_difficulty or cfg.difficulty
    need(cfg.hidden >= 4 and cfg.hidden % 4 == 0, "hidden", f"must be a positive multiple of 4, got {cfg.hidden}")
    need(cfg.device != "cuda" or torch.cuda.is_available(), "device", "cuda asked for but no GPU is visible")
    if cfg.model in pretrained.NAMED:
        cache = pretrained.default_cache()
        need(writable(cache), "model", f"cannot create or write to the folder {str(cache)!r} where {cfg.model} is "
             f"cached ($RL_LESSONS_CACHE)")
    elif cfg.model:
        problem = pretrained.problem(cfg.model)
        need(not problem, "model", f"{cfg.model!r}: {problem}")
    cfg.cache_dir = cfg.cache_dir or str(policy.CACHE)
    need(writable(Path(cfg.cache_dir)), "cache-dir", f"cannot create or write to the folder {cfg.cache_dir!r}")
    need(not (cfg.overwrite and cfg.resume), "overwrite", "--overwrite replaces a run, --resume continues it: not both")
    if cfg.init_from and not cfg.resume:
        problem = init_from_problem(cfg)
        need(not problem, "init-from", f"{cfg.init_from!r}: {problem}")
    if not distributed.is_main():        # torchrun: rank 0 alone checks, names and writes the folder
        cfg.out = cfg.out or default_out(cfg)
        return cfg
    if not cfg.out:                      # the default name, or NAME-2, -3 ...: the first folder not there yet,
        base = default_out(cfg)          # claimed by creating it (one mkdir succeeds: two runs started
        for name in (base if i == 1 else f"{base}-{i}" for i in itertools.count(1)):   # together get two names)
            try:
                Path(name).mkdir(parents=True)
            except FileExistsError:
                continue
            except OSError:              # not writable: said below, naming the folder
                pass
            cfg.out = name
            break
    out = Path(cfg.out)
    need(cfg.resume or cfg.overwrite or not holds_run(out), "out",
         f"{cfg.out!r} holds a run already ({holds_run(out)}); --resume {cfg.out} continues it, "
         f"--overwrite replaces it, another --out keeps it")
    # the one side effect of validation: the run's folder
    need(writable(out), "out", f"cannot create or write to the folder {str(out)!r}")
    return cfg


RUN_FILES = ("metrics.jsonl", "samples.jsonl", "summary.json", "config.json", "curves.png", "checkpoints",
             "tensorboard")


def has_tensorboard() -> bool:
    """Whether the optional tensorboard package is installed (--tensorboard needs it)."""
    return importlib.util.find_spec("tensorboard") is not None


def holds_run(folder: Path) -> str | None:
    """The files of a run in folder ('metrics.jsonl, checkpoints'), or None when it holds none."""
    found = [name for name in RUN_FILES if (Path(folder) / name).exists()]
    return ", ".join(found) or None


def writable(folder: Path) -> bool:
    """Create folder (and its parents) if needed; True when we can write into it."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def saved_fields(run_dir: Path, config_class) -> dict:
    """The fields of config_class (Config) a run was made with (its config.json, less ran_on
    and any field this version no longer has); OSError or ValueError when it cannot be read."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    if not isinstance(saved, dict):
        raise ValueError("config.json is not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    out = {k: v for k, v in saved.items() if k in fields}
    for name, value in out.items():                 # a hand-edited file: a number where a word goes
        want = type(fields[name].default)
        if not (isinstance(value, want) or (want is float and isinstance(value, int) and not isinstance(value, bool))) \
                or (want is int and isinstance(value, bool)):
            raise ValueError(f"config.json's {name!r} is {value!r}, not a {want.__name__}")
    return out


SAME_MODEL = ("task", "model", "hidden", "layers")     # what a run started --init-from another must share


def init_from_problem(cfg) -> str | None:
    """Why --init-from cannot start this run, or None: it needs a checkpoint, and the run
    that wrote it must have had the same task and model (its config.json)."""
    ckpt = checkpoint.starting_point(Path(cfg.init_from))
    if ckpt is None:
        return "no checkpoint in it (the first stage needs --save-every N, or --early-stop-patience P)"
    if pretrained.cut_short(ckpt):
        return f"its checkpoint {ckpt.name} is damaged: {pretrained.cut_short(ckpt)}"
    try:
        json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"its checkpoint {ckpt.name} is damaged: its config.json does not read ({type(e).__name__})"
    if checkpoint.is_busy(checkpoint.run_dir_of(ckpt)):
        return "that run is still running (its folder is locked): start from it once it has ended"
    try:
        saved = saved_fields(checkpoint.run_dir_of(ckpt), type(cfg))
    except (OSError, ValueError):
        return f"cannot read {str(checkpoint.run_dir_of(ckpt) / 'config.json')!r}"
    for name in SAME_MODEL:
        if saved.get(name) != getattr(cfg, name):
            return (f"that run's --{name} was {saved.get(name)!r}, this run's is {getattr(cfg, name)!r}; "
                    f"a run starts only from weights of the same task and model")
    return None


def default_out(cfg) -> str:
    """runs/NAME, NAME made of what sets the run apart: the task, the model and where it started,
    the objective, the sampler, then the algorithm, K, B, the estimator, lr and seed (the main
    job: runs/k8_b8_global_lr0.001_s0)."""
    task = f"tools_{cfg.reward}_" if cfg.task == "tools" else ""
    if cfg.difficulty > 1:
        task += f"d{cfg.difficulty}_" + ("curriculum_" if cfg.curriculum else "")
    marks = [re.sub(r"[^A-Za-z0-9.-]+", "-", Path(cfg.model).name) if cfg.model else "",
             "from-" + re.sub(r"[^A-Za-z0-9.-]+", "-", Path(cfg.init_from).name) if cfg.init_from else "",
             cfg.policy_loss if cfg.policy_loss != "clip" else "", "gspo" if cfg.ratio_level == "sequence" else "",
             f"e{cfg.epochs}" if cfg.epochs > 1 else "",
             f"rollout-{cfg.rollout_dtype}" if cfg.rollout_dtype != "same" else "",
             f"stale{cfg.rollout_stale}" if cfg.rollout_stale else ""]
    task += "".join(m + "_" for m in marks if m)
    if cfg.algo in ("ppo", "rce"):
        return f"runs/{task}{cfg.algo}_k{cfg.k}_b{cfg.batch}_lr{cfg.lr:g}_s{cfg.seed}"
    return f"runs/{task}k{cfg.k}_b{cfg.batch}_{cfg.norm}_lr{cfg.lr:g}_s{cfg.seed}"
