"""The run's configuration: one dataclass of the run's own knobs (Run) and each lesson's (its
Knobs, with default, help and range), and the CLI built from it: `max_grad_norm` is
`--max-grad-norm`, unless its metadata says "flag": False (a paper's constant no run turns).
`--help` lists the flags by lesson; `validate` (below) checks them before any model loads.
`--resume DIR` continues the run in DIR with its saved configuration (config.json).
"""
import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import advantages
import dynamic_sampling
import entropy_control
import grpo
import kl
import lora
import mismatch
import monitor
import ppo
import rce
import rewards
import rollout
import surrogates
import tasks
import tool_env
import truncation
import trust_regions
import update
from models import policy, pretrained
from running import checkpoint, distributed


def opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Run:
    """The run's own flags: the task, the algorithm, the batch and the schedule, and the machinery
    around the lessons (evaluation, output, checkpoints, the model and the machine)."""
    task: str = opt("dsl", "report 001's workflow DSL, or report 000's tool calling", choices=tuple(tasks.TASKS))
    max_turns: int = opt(3, "tools task: policy turns per episode, one more per benchmark past the first",
                         min=1, flag=False)
    difficulty: int = opt(1, "tools task: benchmarks an episode asks about (1 to 3), each to be reported")
    algo: str = opt("grpo", "GRPO (no critic), PPO (value head + GAE) or RCE (report 003's rce.py)",
                    choices=("grpo", "ppo", "rce"))
    batch: int = opt(8, "prompts per step (B); N = B*K sequences per step", min=1, max=4096)
    steps: int = opt(150, "training steps (one batch of rollouts each)", min=1)
    lr: float = opt(0.0, "learning rate; 0 = 1e-3 for the tiny model, 2e-5 for a real one (1e-3 wrecks SmolLM2)",
                    min=0)
    eval_every: int = opt(10, "evaluate on held-out prompts every this many steps", min=1)
    eval_samples: int = opt(4, "samples per held-out prompt at each evaluation", min=1, max=1000)
    eval_prompts: int = opt(0, "held-out prompts per evaluation, spread over the list; 0 = all 32", min=0)
    early_stop_patience: int = opt(0, "stop after this many evaluations without a better held-out reward, "
                                      "keeping the best's checkpoint; 0 = off", min=0)
    seed: int = opt(0, "seed of the RL phase (prompts and sampling)", min=0, max=2 ** 32 - 1)   # seed * 100003 + step
                                                               # stays inside a torch.Generator's 64 bits
    out: str = opt("", "the run's folder; default runs/k{K}_b{B}_{norm}_lr{lr}_s{seed} (-2, -3 ... if taken)")
    overwrite: bool = opt(False, "replace the run already in --out (its logs, summary, curves and checkpoints)")
    tensorboard: bool = opt(False, "also write the metrics to OUT/tensorboard/ (optional: pip install tensorboard)")
    quiet: bool = opt(False, "no progress line")
    save_every: int = opt(0, "write a checkpoint every this many steps; 0 = only when a run stops early", min=0)
    keep_checkpoints: int = opt(0, "keep only this many newest checkpoints; 0 = keep all", min=0)
    resume: str = opt("", "continue the run in this folder (or from this checkpoint folder)")
    max_skips: int = opt(10, "stop (with a checkpoint) after more non-finite optimizer steps than this", min=0)
    collective_timeout: float = opt(300.0, "torchrun: seconds a rank waits for the others before the job ends",
                                    min=1.0, max=86400.0)
    device: str = opt("auto", "where to run", choices=("auto", "cpu", "cuda"))
    threads: int = opt(0, "CPU threads; 0 = 1 for the tiny model (docs/performance.md), torch's default for --model",
                       min=0, max=1024)
    bf16: str = opt("auto", "bf16 autocast: auto = on a GPU, and on a CPU where measured faster",
                    choices=("auto", "on", "off"))
    no_shared_prefix: bool = opt(False, "encode a group's prompt once per sequence (shared_prefix.py: same numbers)",
                                 flag=False)
    model: str = opt("", "a real model: smollm2-135m (fetched once), a Hugging Face folder or hub id; "
                     "default: the tiny model")
    hidden: int = opt(64, "tiny model: hidden size", max=8192)
    layers: int = opt(2, "tiny model: transformer layers", min=1, max=256)
    sft_steps: int = opt(-1, "supervised warm-up steps; -1 = warm_start.DEFAULTS's (300 tiny, 30 real)", min=-1)
    sft_difficulty: int = opt(0, "tools task: the warm start shows episodes of 1 up to this many benchmarks; "
                              "0 = --difficulty")
    cache_dir: str = opt("", "where warm starts are cached; default: the repository's .cache/warmstart")
    init_from: str = opt("", "start from another run's best (else newest) checkpoint, also the KL's reference")


# the lessons whose knobs (Knobs) are flags, each with its checks (problems), in the course's order
LESSONS = (advantages, grpo, surrogates, trust_regions, update, kl, entropy_control, rewards, tool_env, rollout,
           truncation, mismatch, ppo, rce, dynamic_sampling, monitor, lora)


@dataclass
class Config(Run, tool_env.Knobs, rce.Knobs, ppo.Knobs, dynamic_sampling.Knobs, monitor.Knobs, lora.Knobs,
             truncation.Knobs, *grpo.KNOBS):
    """Every flag: the run's own (Run) and each lesson's (its Knobs)."""

    @property                        # derived sizes, computed in one place
    def n(self) -> int:
        return self.batch * self.k

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_in == "reward" or (self.kl_in == "auto" and self.algo == "ppo")

    @property
    def rollout_logprobs(self) -> bool:          # the sampler's own log-probs recorded (mismatch.py)
        return (self.log_mismatch or self.rollout_dtype != "same" or self.rollout_stale > 0
                or self.rollout_temperature > 0 or self.rollout_correction != "none")

    @property
    def reuse_old_logp(self) -> bool:
        """--fast, one GRPO update per batch: old log-probs are the update's forward, detached (as TRL)."""
        return (self.fast and self.algo == "grpo" and self.epochs == 1
                and self.mini_batch in (0, self.n) and not self.kl_in_reward
                and not self.rollout_logprobs)       # the mismatch's weight needs pi_old before the update

    @property
    def new_tokens(self) -> int:                 # 0: a real tokenizer spends more tokens on a tool call
        return self.max_new_tokens or (64 if self.model and self.task == "tools" else 24)

    @property
    def completion_limit(self) -> int:           # in policy tokens: a turn's limit times a tool episode's turns
        return self.new_tokens * (self.max_turns + self.difficulty - 1 if self.task == "tools" else 1)


# ---- what the lesson code reads ----

def hyper_params(cfg: Config) -> grpo.HyperParams:
    """grpo.HyperParams (or PPO's and RCE's), each knob copied from its flag; train.py replaces
    beta, entropy_coef, seed (and RCE's tau) each step. Under torchrun the batch sizes are one rank's."""
    cls = {"ppo": ppo.PPOParams, "rce": rce.RCEParams}.get(cfg.algo, grpo.HyperParams)
    knobs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)}
    mini_batch = (cfg.mini_batch or cfg.n) // distributed.size()
    tau = {"rce_temp": cfg.rce_temp_start} if cfg.algo == "rce" else {}
    return cls(**{**knobs, **tau, "mini_batch": mini_batch, "micro_batch": cfg.micro_batch or mini_batch,
                  "max_len": cfg.completion_limit, "kl_estimator": kl.estimator(cfg)})


def fail(message: str):
    """Bad input: one line on stderr, exit code 2, before any work (under torchrun, on every rank:
    torchrun stops the others as soon as one exits)."""
    print(f"train.py: error: {message}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (train.py and the lab's commands)."""
    def error(self, message):        # one line instead of usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def is_flag(f) -> bool:
    """A knob is a flag unless its metadata says "flag": False."""
    return f.metadata.get("flag", True)


# --help's sections of the run's own flags, by their first flag; each lesson's follow (LESSONS)
SECTIONS = {"task": "the run: the task, the algorithm, the batch and the schedule",
            "eval_every": "the run: evaluation and output", "save_every": "the run: surviving failures",
            "device": "the run: the policy and the machine"}


def sections():
    """--help's sections: (title, the flags under it), the run's first, then one per lesson."""
    out = []
    for f in dataclasses.fields(Run):
        if f.name in SECTIONS:
            out.append((SECTIONS[f.name], []))
        out[-1][1].extend([f] if is_flag(f) else [])
    for lesson in LESSONS:
        out.append((f"{lesson.__name__}.py: {lesson.Knobs.__doc__}",
                     [f for f in dataclasses.fields(lesson.Knobs) if is_flag(f)]))
    return out


EXAMPLES = """examples:
  python train.py --k 8 --norm global                  the main job (GRPO, the tiny model, CPU)
  python train.py --k 2 --batch 3 --norm group         report 001's setting (Lesson 2)
  python train.py --algo ppo                           PPO with a critic (Lesson 3)
  python train.py --task tools --reward sparse         report 000's tool agent (Lesson 4)
  python train.py --policy-loss cispo --epochs 2       a 2025-26 objective; it needs a second epoch to act (Lesson 8)
  python train.py --resume runs/NAME                   continue a stopped run

Progress and messages go to stderr (python train.py 2> log.txt keeps them); the numbers go to
the run's folder: metrics.jsonl, samples.jsonl, summary.json, curves.png."""


def parser() -> argparse.ArgumentParser:
    """The CLI, built from Config's fields (--field-name, its help and default); a flag not given is
    left out of the result (Config's default fills it), so the result says what the user gave."""
    out = OneLineParser(prog="train.py", description="Train a policy with GRPO, PPO or RCE on report 001's "
                        "workflow-DSL task\nor report 000's tool-calling task; each flag is a field of config.Config.",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    for title, fields in sections():
        group = out.add_argument_group(title)
        for f in fields:
            flags, help = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())], f.metadata["help"]
            kind = dict(action="store_true") if f.type in (bool, "bool") else \
                dict(type=type(f.default), choices=f.metadata.get("choices"))
            group.add_argument(*flags, **kind, default=argparse.SUPPRESS, help=f"{help} (default: {f.default})")
    return out


def parse_config(argv=None) -> Config:
    """The CLI: parse, resolve --resume, validate; bad input ends in one line and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    given = vars(parser().parse_args(argv))
    try:
        cfg = grpo.own_defaults(Config(**given), given)
        for name, what in (("resume", "the folder of the run to continue"), ("init_from", "a run or checkpoint "
                           "folder to start from"), ("model", "a named model, a folder or a hub id")):
            if name in given and not str(given[name]).strip():      # an empty string is a mistake, not "off"
                raise ConfigError(f"--{name.replace('_', '-')}: needs {what}, got an empty string")
        if "resume" in given:
            cfg = resumed_config(cfg, given)
        return validate(cfg, LESSONS)
    except ConfigError as e:
        fail(str(e))


# flags that change how a run is carried out, not what it computes (alert_entropy: which alerts it logs)
NOT_IN_RESULTS = ("quiet", "overwrite", "threads", "cache_dir", "alert_entropy")
RESUME_MAY_CHANGE = ("steps", "resume", *NOT_IN_RESULTS)


def resumed_config(cfg: Config, given: dict) -> Config:
    """The saved configuration of the run being resumed. A flag given must equal the saved value
    (the original command with --resume added works); --steps may extend the run."""
    if given.get("overwrite"):
        raise ConfigError("--overwrite: replaces a run, --resume continues it: not both")
    ckpt = checkpoint.find(Path(cfg.resume))
    if ckpt is None and holds_run(Path(cfg.resume)):    # it stopped before its first checkpoint
        raise ConfigError(f"--resume: the run in {cfg.resume!r} stopped before its first checkpoint, so "
                          f"there is nothing to continue; run its command again with --overwrite")
    if ckpt is None:
        raise ConfigError(f"--resume: no checkpoint in {cfg.resume!r} (expected a run folder "
                          f"with checkpoints/step-*/ or a checkpoint folder)")
    run_dir = checkpoint.run_dir_of(ckpt)
    try:
        saved, before = saved_fields(run_dir, Config), json.loads((run_dir / "config.json").read_text())["processes"]
    except KeyError:                             # config.json says not how many processes trained it
        raise ConfigError(f"--resume: {str(run_dir)!r} was written by an older version of train.py; start it again")
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: cannot read {str(run_dir / 'config.json')!r} ({e})")
    if before != distributed.size():             # each one's prompts, seeds and micro-batches would change
        raise ConfigError(f"--resume: the run was trained by {before} process(es), this is {distributed.size()}; "
                          f"resume it with " + (f"torchrun --nproc_per_node {before}" if before > 1 else "python train.py"))
    saved["out"] = str(run_dir)
    for name, value in given.items():
        if name in RESUME_MAY_CHANGE:
            continue
        same = Path(value).resolve() == run_dir.resolve() if name == "out" else value == saved.get(name)
        if not same:
            raise ConfigError(f"--resume: --{name.replace('_', '-')} was {saved.get(name)!r} in the saved "
                              f"run and is {value!r} now; a resumed run keeps its configuration "
                              f"(only --steps and --quiet can change)")
    merged = {**saved, "resume": str(run_dir if (Path(cfg.resume) / "checkpoints").is_dir() else ckpt),
              "quiet": cfg.quiet, "steps": cfg.steps if "steps" in given else saved.get("steps", cfg.steps),
              "overwrite": False}                 # the run was made with it, perhaps; it goes on now
    at = int(ckpt.name.split("-")[-1]) if ckpt.name.startswith("step-") else 0
    if merged["steps"] <= at:
        raise ConfigError(f"--steps: the run's newest checkpoint is at step {at}; give --steps above "
                          f"{at} to continue it (it is {merged['steps']})")
    return Config(**merged)


# ---- the checks: every flag before any model loads ----

class ConfigError(ValueError):
    pass


def validate(cfg, lessons):
    """Raise ConfigError naming the flag: each field's range, each lesson's `problems`, whether a flag
    is read at all (by this --algo, --policy-loss, with the knob it serves), then the run's own."""
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
    cfg.lr = cfg.lr or (2e-5 if cfg.model else 1e-3)          # 0: the model's default
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
    ranks = distributed.size()                      # torchrun's WORLD_SIZE; 1 for python train.py
    need(cfg.batch % ranks == 0, "batch", f"{cfg.batch} prompts per step do not split over {ranks} ranks "
         f"(torchrun's processes); give a multiple of {ranks}")
    need(not cfg.tensorboard or has_tensorboard(), "tensorboard",
         "needs the tensorboard package, an optional dependency: pip install tensorboard==2.21.0")
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
    if cfg.init_from and not cfg.resume:
        problem = init_from_problem(cfg)
        need(not problem, "init-from", f"{cfg.init_from!r}: {problem}")
    if not distributed.is_main():        # torchrun: rank 0 alone checks, names and writes the folder
        cfg.out = cfg.out or default_out(cfg)
        return cfg
    if not cfg.out:                      # the default name, or NAME-2, -3 ...: the first one free, claimed by
        base = default_out(cfg)          # creating it (two runs started together get two names)
        for name in (base if i == 1 else f"{base}-{i}" for i in itertools.count(1)):
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
    """Whether the optional tensorboard package is installed."""
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
    """The fields of config_class a run was made with (config.json); OSError or ValueError if unreadable."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    if not isinstance(saved, dict):
        raise ValueError("config.json is not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    out = {k: v for k, v in saved.items() if k in fields}
    for name, value in out.items():                 # a hand-edited file: a number where a word goes
        want = type(fields[name].default)
        wrong = not isinstance(value, want) and not (want is float and type(value) is int)   # 1 is a float here
        if wrong or (type(value) is bool) != (want is bool):                # ... and True is not an int
            raise ValueError(f"config.json's {name!r} is {value!r}, not a {want.__name__}")
    return out


SAME_MODEL = ("task", "model", "hidden", "layers")     # what a run started --init-from another must share


def init_from_problem(cfg) -> str | None:
    """Why --init-from cannot start this run, or None: it needs a whole checkpoint of a run of the
    same task and model that has ended."""
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
    """runs/NAME, NAME made of what sets the run apart (the main job: runs/k8_b8_global_lr0.001_s0)."""
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
