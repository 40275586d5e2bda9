"""The run's configuration: one dataclass made of the run's own knobs (Run, below) and each
lesson's (its Knobs, where the lesson defines each with its default, help and range), and the
CLI built from it.

A knob is a flag (`k` -> `--k`, `max_grad_norm` -> `--max-grad-norm`) whose help is its
one-line documentation, unless its metadata says "flag": False (a paper's constant no lesson
turns: a field Python code sets). `python train.py --help` lists the flags by lesson. Every
knob is checked before any model loads (running/checks.py: its range, then its lesson's
problems): bad input ends with one line naming the flag, and exit code 2.

`--resume DIR` continues the run in DIR with the configuration saved there (config.json);
only --steps (to extend the run) and --quiet may be given with it.
"""
import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

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
import schedules
import surrogates
import tasks
import trust_regions
import update
from running import checkpoint, checks, distributed
from running.checks import ConfigError, default_out, saved_fields  # noqa: F401 (default_out: for importers)


def opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Run:
    """The run's own flags: the task, the algorithm, the batch and the schedule, and the machinery
    around the lessons (evaluation, output, checkpoints, the model and the machine)."""
    task: str = opt("dsl", "the task: report 001's workflow DSL, or report 000's tool calling (tasks/tool_task.py)",
                    choices=tuple(tasks.TASKS))
    max_turns: int = opt(3, "tools task: policy turns per episode (--max-new-tokens each), one more per "
                         "benchmark beyond the first (--difficulty)", min=1, flag=False)
    difficulty: int = opt(1, "tools task: benchmarks each episode asks about (1 to 3); the answer must report "
                          "every one's setting and value (report 000's long ground truth)")
    algo: str = opt("grpo", "the algorithm: GRPO (no critic), PPO (value head + GAE) or RCE (report 003's "
                    "reward-weighted cross-entropy: rce.py)", choices=("grpo", "ppo", "rce"))
    batch: int = opt(8, "prompts per step (B); N = B*K sequences per step", min=1, max=4096)
    steps: int = opt(150, "training steps (one batch of rollouts each)", min=1)
    lr: float = opt(0.0, "learning rate; 0 = the default: 1e-3 for the tiny model (it needs a large one), "
                    "2e-5 for a real one (1e-3 wrecks SmolLM2 in one step)", min=0)
    # evaluation and output
    eval_every: int = opt(10, "evaluate on held-out prompts every this many steps", min=1)
    eval_samples: int = opt(4, "samples per held-out prompt at each evaluation", min=1, max=1000)
    eval_prompts: int = opt(0, "held-out prompts per evaluation, spread over the list (and as many training "
                               "prompts for the answer NLL); 0 = all 32: fewer for a quick look at a real model on a CPU",
                            min=0)
    early_stop_patience: int = opt(0, "stop once the held-out reward has not improved for this many "
                                      "evaluations, keeping the best one's checkpoint; 0 = off", min=0)
    seed: int = opt(0, "seed of the RL phase (prompts and sampling)", min=0, max=2 ** 32 - 1)   # seed * 100003 + step
                                                               # stays inside a torch.Generator's 64 bits
    out: str = opt("", "folder for the run's files; default runs/k{K}_b{B}_{norm}_lr{lr}_s{seed}, with a "
                       "-2, -3 ... suffix when that one holds a run already")
    overwrite: bool = opt(False, "replace the run already in --out (its logs, summary, curves and checkpoints)")
    tensorboard: bool = opt(False, "also write every metric as a TensorBoard scalar into OUT/tensorboard/ "
                            "(needs the optional `pip install tensorboard`); metrics.jsonl stays the record")
    quiet: bool = opt(False, "no progress line")
    # surviving failures (checkpoint.py)
    save_every: int = opt(0, "write a checkpoint every this many steps; 0 = only when a run stops early", min=0)
    keep_checkpoints: int = opt(0, "keep only this many newest checkpoints; 0 = keep all", min=0)
    resume: str = opt("", "continue the run in this folder (or from this checkpoint folder)")
    max_skips: int = opt(10, "stop the run (with a checkpoint) once more optimizer steps than this were non-finite",
                         min=0)
    collective_timeout: float = opt(300.0, "torchrun: seconds a rank waits for the others before the job ends "
                                    "with a line naming it (a rank stopped with kill -STOP hung the others)",
                                    min=1.0, max=86400.0)
    # the policy
    device: str = opt("auto", "where to run", choices=("auto", "cpu", "cuda"))
    threads: int = opt(0, "CPU threads torch uses; 0 = 1 for the tiny model (a 20-step run on a busy 2-core "
                       "machine: 1.6x faster than with 2; docs/performance.md), torch's default for --model",
                       min=0, max=1024)
    bf16: str = opt("auto", "bf16 autocast: auto = on a GPU, and on a CPU for a real model where "
                    "bf16 is measured faster", choices=("auto", "on", "off"))
    no_shared_prefix: bool = opt(False, "encode a group's prompt once per sequence, as a plain forward does, "
                                 "not once per group (shared_prefix.py: the same numbers; the tests compare "
                                 "the two)", flag=False)
    model: str = opt("", "a real model: smollm2-135m (fetched once), a local Hugging Face folder, or a hub id; "
                     "default: the tiny model built in code")
    hidden: int = opt(64, "tiny model: hidden size", max=8192)
    layers: int = opt(2, "tiny model: transformer layers", min=1, max=256)
    sft_steps: int = opt(-1, "supervised warm-up steps; -1 = the default (policy.WARM_START: 300 tiny, 30 real)",
                         min=-1)
    sft_difficulty: int = opt(0, "tools task: the warm start shows episodes of 1 up to this many benchmarks "
                              "(half of them one); 0 = --difficulty")
    cache_dir: str = opt("", "where warm-started weights are cached; default: .cache/warmstart in the "
                         "repository, wherever the command runs from (models/policy.CACHE)")
    init_from: str = opt("", "start from another run's weights (its best checkpoint if it kept one, else its "
                         "newest), not the warm start; that start is also the KL's reference")


# The lessons whose knobs are flags, in the course's order: each defines its own (Knobs: the
# field, its default, its help) and its checks (problems); --help shows them in this order.
LESSONS = (advantages, grpo, surrogates, trust_regions, update, schedules, kl, entropy_control, rewards, rollout, mismatch, ppo,
           rce, dynamic_sampling, monitor, lora)


@dataclass
class Config(Run, schedules.Knobs, rce.Knobs, ppo.Knobs, dynamic_sampling.Knobs, monitor.Knobs, lora.Knobs,
             *grpo.KNOBS):
    """Every flag: the run's own (Run) and each lesson's (its Knobs)."""

    # derived sizes, computed in one place
    @property
    def n(self) -> int:
        return self.batch * self.k

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_in == "reward" or (self.kl_in == "auto" and self.algo == "ppo")

    @property
    def rollout_logprobs(self) -> bool:
        """The sampler's own log-probs are recorded (a mismatch made, corrected or logged)."""
        return (self.log_mismatch or self.rollout_dtype != "same" or self.rollout_stale > 0
                or self.rollout_temperature > 0 or self.rollout_correction != "none")

    @property
    def reuse_old_logp(self) -> bool:
        """--fast and one GRPO update per batch: the policy that sampled is the policy of the
        update's forward, so old log-probs are that forward's, detached (TRL does the same)."""
        return (self.fast and self.algo == "grpo" and self.epochs == 1
                and self.mini_batch in (0, self.n) and not self.kl_in_reward
                and not self.rollout_logprobs)       # the mismatch's weight needs pi_old before the update

    @property
    def new_tokens(self) -> int:
        """--max-new-tokens, 0 resolved: a real tokenizer spends more tokens on a tool call."""
        return self.max_new_tokens or (64 if self.model and self.task == "tools" else 24)

    @property
    def completion_limit(self) -> int:
        """The longest completion in policy tokens: one turn's limit, times the turns of a tool
        episode (one more per benchmark beyond the first)."""
        return self.new_tokens * (self.max_turns + self.difficulty - 1 if self.task == "tools" else 1)


# ---- what the lesson code reads ----

def hyper_params(cfg: Config) -> grpo.HyperParams:
    """The update's and the advantages' settings: grpo.HyperParams, or PPO's and RCE's
    extensions of it, each knob copied from its flag of the same name; train.py replaces beta,
    entropy_coef, seed (and RCE's tau) each step. Under torchrun the batch sizes are one rank's:
    its share of each mini-batch."""
    cls = {"ppo": ppo.PPOParams, "rce": rce.RCEParams}.get(cfg.algo, grpo.HyperParams)
    knobs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)}
    mini_batch = (cfg.mini_batch or cfg.n) // distributed.size()
    tau = {"rce_temp": cfg.rce_temp_start} if cfg.algo == "rce" else {}
    return cls(**{**knobs, **tau, "mini_batch": mini_batch, "micro_batch": cfg.micro_batch or mini_batch,
                  "max_len": cfg.completion_limit, "kl_estimator": kl.estimator(cfg)})


def sampling(cfg: Config) -> tasks.Sampling:
    """How the task samples and scores rollouts (training and evaluation alike)."""
    return tasks.Sampling(temperature=cfg.temperature, max_new_tokens=cfg.new_tokens,
                          forward_batch=cfg.micro_batch or None,
                          shared_prefix=not cfg.no_shared_prefix,
                          max_turns=cfg.max_turns, reward=cfg.reward, reward_clip=cfg.reward_clip or None,
                          process_reward=not cfg.drop_process_reward)


def fail(message: str):
    """Bad input: one line on stderr, exit code 2, before any work. Under torchrun every rank
    prints its line: torchrun stops the others as soon as one exits, so a rank left to speak
    for all might be stopped before it could."""
    print(f"train.py: error: {message}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (train.py and the lab's commands)."""
    def error(self, message):        # one line instead of usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def is_flag(f) -> bool:
    """A knob is a flag unless its lesson says otherwise (metadata "flag": False): a value from a
    paper or a report that no lesson's run turns, kept as a field that Python code can set."""
    return f.metadata.get("flag", True)


# the flags only some algorithms read (their metadata's "algos"): set to anything but their
# default with another --algo, they are refused (checks.validate)
USED_BY = {f.name: f.metadata["algos"] for f in dataclasses.fields(Config) if "algos" in f.metadata and is_flag(f)}


# --help's sections of the run's own flags (Run's banner comments); each lesson's flags follow
# under the lesson's name, in the course's order (LESSONS)
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


def _parser(explicit_only: bool = False) -> argparse.ArgumentParser:
    """The CLI, built from Config's fields: --field-name with the field's help. explicit_only:
    a flag not on the command line is left out of the result (to tell what the user gave)."""
    parser = OneLineParser(prog="train.py",
                           description="Train a policy with GRPO or PPO on report 001's workflow-DSL "
                                       "task or report 000's tool-calling task; each flag is a "
                                       "field of config.Config.",
                           formatter_class=HelpFormatter, epilog=EXAMPLES,
                           argument_default=argparse.SUPPRESS if explicit_only else None)
    for title, fields in sections():
        group = parser.add_argument_group(title)
        for f in fields:
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            default = argparse.SUPPRESS if explicit_only else f.default
            if f.type is bool or f.type == "bool":
                group.add_argument(*flags, action="store_true", default=default, help=f.metadata["help"])
            else:
                group.add_argument(*flags, type=type(f.default), default=default,
                                   choices=f.metadata.get("choices"), help=f.metadata["help"])
    return parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; the examples kept as written."""


def parse_config(argv=None) -> Config:
    """The CLI: parse, resolve --resume, validate; bad input ends in one line and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    given = vars(_parser(explicit_only=True).parse_args(argv))
    try:
        cfg = grpo.own_defaults(Config(**vars(args)), given)
        for name, what in (("resume", "the folder of the run to continue"), ("init_from", "a run or checkpoint "
                           "folder to start from"), ("model", "a named model, a folder or a hub id")):
            if name in given and not str(given[name]).strip():      # an empty string is a mistake, not "off"
                raise ConfigError(f"--{name.replace('_', '-')}: needs {what}, got an empty string")
        if "resume" in given:
            cfg = resumed_config(cfg, given)
        return checks.validate(cfg, LESSONS)
    except ConfigError as e:
        fail(str(e))


def processes_of(run_dir: Path) -> int:
    """How many processes trained a run (its config.json's `processes`)."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    if "processes" not in saved:
        raise ConfigError(f"--resume: {str(run_dir)!r} was written by an older version of train.py "
                          f"(its config.json does not say how many processes trained it); start it again")
    return int(saved["processes"])


# Flags that change how a run is carried out, not what it computes: where the warm start is
# cached, torch's threads (identical results), the printing, and replacing a folder.
NOT_IN_RESULTS = ("quiet", "overwrite", "threads", "cache_dir")
RESUME_MAY_CHANGE = ("steps", "resume", *NOT_IN_RESULTS)


def resumed_config(cfg: Config, given: dict) -> Config:
    """The saved configuration of the run being resumed. A flag given on the command line must
    equal the saved value (re-running the original command with --resume added works);
    --steps may extend the run, --quiet may change."""
    if given.get("overwrite"):
        raise ConfigError("--overwrite: replaces a run, --resume continues it: not both")
    ckpt = checkpoint.find(Path(cfg.resume))
    if ckpt is None and checks.holds_run(Path(cfg.resume)):    # it stopped before its first checkpoint
        raise ConfigError(f"--resume: the run in {cfg.resume!r} stopped before its first checkpoint, so "
                          f"there is nothing to continue; run its command again with --overwrite")
    if ckpt is None:
        raise ConfigError(f"--resume: no checkpoint in {cfg.resume!r} (expected a run folder "
                          f"with checkpoints/step-*/ or a checkpoint folder)")
    run_dir = checkpoint.run_dir_of(ckpt)
    try:
        saved = saved_fields(run_dir, Config)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: cannot read {str(run_dir / 'config.json')!r} ({e})")
    before, now = processes_of(run_dir), distributed.size()
    if before != now:
        raise ConfigError(f"--resume: the run was trained by {before} process(es) and this is {now}: each "
                          f"process's share of the prompts, its sampling seeds and --micro-batch (per process) "
                          f"would change mid-run; resume with torchrun --nproc_per_node {before}"
                          if before > 1 else f"--resume: the run was trained by 1 process; resume it with "
                          f"python train.py, not {now} processes")
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
