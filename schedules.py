"""How a setting changes over a run: learning rate, entropy bonus, and the task's difficulty.

Pure functions of the step, so a resumed run needs no scheduler state: step s of a resumed
run gets exactly the value step s of an uninterrupted run got.

    lr(s) = base * s / warmup                                   for s <= warmup
            then, with p = (s - warmup) / (total - warmup) in [0, 1]:
    constant   base
    linear     min_lr + (base - min_lr) * (1 - p)
    cosine     min_lr + (base - min_lr) * (1 + cos(pi * p)) / 2

Report 000 recommends a linear or cosine decay; report 002 compares fixed and dynamic lr.
The entropy bonus (report 000: beta_H in [0.001, 0.01], decayed) moves linearly from
--entropy-coef to --entropy-coef-end over the run.

Report 000's curriculum ("start from short examples, then add longer, more complex
prompts"), --curriculum with --difficulty D: the run in D equal phases, phase d training on
tasks of difficulty d (the tool task: d benchmarks to look up and report),

    d(s) = 1 + floor((s - 1) * D / total)          s = 1 .. total

so 100 steps at D = 3 are steps 1-34 at 1, 35-67 at 2, 68-100 at 3. Without --curriculum
every step trains at D. Held-out evaluation is always at D, the task the run is for.
"""
import math
from dataclasses import dataclass, field

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class Knobs:
    """The learning rate over the run, and report 000's curriculum of the task's difficulty."""
    lr_schedule: str = field(default="constant", metadata={"help": "learning-rate schedule after the warm-up",
                                                           "choices": LR_SCHEDULES})
    min_lr: float = field(default=0.0, metadata={"help": "the learning rate that linear/cosine decay to at the "
                                                         "last step", "flag": False})
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear learning-rate warm-up from 0"})
    curriculum: bool = field(default=False, metadata={"help": "tools task: train from difficulty 1 up to "
                             "--difficulty in equal phases (report 000's short-to-long curriculum: difficulty_at); "
                             "evaluation stays at --difficulty"})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.curriculum and cfg.difficulty < 2:
        yield "curriculum", (f"moves from difficulty 1 up to --difficulty; give --difficulty 2 or more "
                             f"(it is {cfg.difficulty})")
    if not 0 <= cfg.min_lr <= cfg.lr:
        yield "min-lr", f"must be in [0, --lr], got {cfg.min_lr}"
    if not 0 <= cfg.warmup_steps < cfg.steps:
        yield "warmup-steps", f"must be in [0, --steps), got {cfg.warmup_steps}"
    if cfg.curriculum and cfg.steps < cfg.difficulty:
        yield "curriculum", f"needs a step per difficulty at least: --steps {cfg.steps} < --difficulty {cfg.difficulty}"


def lr_at(step: int, total: int, base: float, schedule: str = "constant",
          min_lr: float = 0.0, warmup: int = 0) -> float:
    """Learning rate of step `step` (1-based) of a run of `total` steps."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {LR_SCHEDULES}")
    if warmup > 0 and step <= warmup:
        return base * step / warmup
    if schedule == "constant":
        return base
    p = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    if schedule == "linear":
        return min_lr + (base - min_lr) * (1 - p)
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * p)) / 2


def linear(step: int, total: int, start: float, end: float) -> float:
    """start at step 1, end at step `total`, a straight line in between."""
    p = (step - 1) / max(total - 1, 1)
    return start + (end - start) * p


def difficulty_at(step: int, total: int, final: int, curriculum: bool) -> int:
    """The task difficulty of step `step` (1-based) of `total`: `final`, or with a curriculum
    1 + floor((step - 1) * final / total), equal phases from 1 up to `final`."""
    return 1 + (step - 1) * final // total if curriculum else final
