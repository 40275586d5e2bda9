"""What a task is to the trainer: the interface written down once, and the two tasks that have it.

A task is a module: workflow_task.py (report 001's workflow DSL) and tool_task.py (report
000's multi-turn tool calling). train.py, warm_start.py and models/policy.py use a task only
through the names of `Task` below, so a new task is a module with these names, added to TASKS.

`Sampling` is the part of the run's configuration a task reads (Sampling.of builds it
from the flags): how to sample, and, for the tools task, how to score an episode.
"""
from dataclasses import dataclass
from typing import Protocol

from . import tool_task
from . import workflow_task


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0         # sample from softmax(logits / T); log-probs of that
    max_new_tokens: int = 24         # longest completion (tools task: each turn)
    forward_batch: int | None = None  # sequences per scoring forward (--micro-batch); None = all
    static_cache: bool = False       # a static KV cache that torch.compile specialises on (CUDA)
    shared_prefix: bool = False      # forwards encode each distinct prompt once (--no-shared-prefix: off)
    max_turns: int = 3               # tools task: policy turns per episode
    reward: str = "shaped"           # tools task: sparse | shaped | format
    reward_clip: float | None = None  # tools task: clamp the shaped reward to [-c, c]
    process_reward: bool = True      # tools task: the tool's process reward counted
    rollout_temperature: float = 0.0  # the sampler's temperature when not `temperature` (mismatch.py); 0 = same
    rollout_logprobs: bool = False   # record the sampler's own log-probs (mismatch.sampler_logprobs)
    top_p: float = 1.0               # truncated sampling (truncation.py): 1 and 0 keep every token
    top_k: int = 0
    mask_replay: bool = False        # record the kept sets; every log-prob scored over them

    @classmethod
    def of(cls, cfg) -> "Sampling":
        """How a run (cfg: running/config.Config) samples and scores, in training and evaluation."""
        return cls(temperature=cfg.temperature, max_new_tokens=cfg.new_tokens, forward_batch=cfg.micro_batch or None,
                   shared_prefix=not cfg.no_shared_prefix, max_turns=cfg.max_turns, reward=cfg.reward,
                   reward_clip=cfg.reward_clip or None, process_reward=not cfg.drop_process_reward,
                   top_p=cfg.top_p, top_k=cfg.top_k, mask_replay=cfg.mask_replay)


class Task(Protocol):
    """The names a task module defines (module attributes satisfy a Protocol)."""
    NAME: str                        # --task
    SYSTEM_PROMPT: str               # for a chat template (a real model, --model)
    MAX_POSITIONS: int               # the tiny model's context
    MAX_DIFFICULTY: int              # --difficulty's largest value (1: a task with one difficulty)
    HEADLINE: tuple                  # the two rates the progress line and summary show
    FORMAT_KEY: str                  # the on-format rate: a collapse halves it
    GROUP_KEY: str                   # the prompt field results are broken down by (lab.compare.by_group)
    RATES: tuple                     # every key of rates()
    ENDS_WITH_EOS: bool              # a completion ends with the EOS token (warm start adds it)

    def prompts(self, split: str, difficulty: int = 1) -> list[dict]:
        """'train' or 'eval' prompts of a difficulty (--difficulty, --curriculum): dicts with
        at least 'text'."""

    def sample(self, models, prompts: list, k: int, sampling: Sampling, record_old_logp: bool = True):
        """K rollouts per prompt, scored: (rollout.Rollout with rewards (N,), outcomes)."""

    def rates(self, outcomes: list) -> dict:
        """The task's rates over outcomes: every key of RATES."""

    def describe(self, text: str, outcome) -> dict:
        """One rollout for samples.jsonl."""

    def warmstart_batch(self, rng, n: int, difficulty: int = 1) -> list[list[tuple[str, bool]]]:
        """n supervised examples of difficulties 1 .. difficulty as (text, trained) segments,
        the prompt first."""

    def answer(self, prompt: dict) -> list[tuple[str, bool]]:
        """A right answer to a prompt as (text, trained) segments (warm_start.answer_nll)."""

    def vocabulary(self) -> list[str]:
        """Every word the task can produce (the tiny word-level tokenizer)."""

    def fingerprint(self, difficulty: int = 1) -> dict:
        """Everything that shapes a warm start up to that difficulty besides the policy's
        settings (its cache key)."""


TASKS: dict[str, Task] = {t.NAME: t for t in (workflow_task, tool_task)}


def prompts_of(task: Task, cfg) -> dict:
    """A run's prompts (cfg: running/config.Config): "train", those of each difficulty it trains
    at; "eval", --eval-prompts held-out ones spread over the list; "nll", as many training
    prompts (32 by default) for the answer NLL."""
    levels = range(1, cfg.difficulty + 1) if cfg.curriculum else [cfg.difficulty]
    train = {d: task.prompts("train", d) for d in levels}
    held_out, n = task.prompts("eval", cfg.difficulty), cfg.eval_prompts

    def spread(xs: list, k: int) -> list:              # every (len/k)-th: each part of the list
        return xs[::max(1, len(xs) // k)][:k]
    return {"train": train, "eval": spread(held_out, n or len(held_out)), "nll": spread(train[cfg.difficulty], n or 32)}
