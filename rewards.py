"""Reward functions: what the policy is paid for a completion.

Workflow DSL (report 001, docs/reports.md). A completion must be a workflow, e.g.

    Custom -> Programmer -> Review ? Revise : done

Grammar (our reading of the report's examples; loops `*` never occurred there, so we leave
them out):

    workflow    := step ( "->" step )*                     at most MAX_STEPS steps
    step        := OPERATOR | OPERATOR "?" OPERATOR ":" ( OPERATOR | "done" )

Every completion falls in exactly one class, and the class decides the reward, as in the
report:

    best      the problem type's best workflow        1.0
    valid     any other well-formed workflow           0.2
    fallback  "### Step 1: Analyze the problem ..."    0.0   (the report's collapse mode)
    junk      anything else, empty text included       0.0

Fallback and junk earn the same reward; we tell them apart only to see *where* a collapse
lands. Nothing here raises on any string: the parser returns None for what it cannot read.

    python -c "import rewards; print(rewards.classify('Custom -> Review ? Revise : done', 'Custom -> Review ? Revise : done'))"
"""
import re
from dataclasses import dataclass, field, replace

import tool_env


@dataclass
class Knobs:
    """The reward: which function pays a completion, and DAPO's length shaping and filtering."""
    reward: str = field(default="shaped", metadata={
        "help": "tools task: sparse +-1, report 000's shaped reward, or the format reward; dsl task: shaped "
                "(report 001's 1 / 0.2 / 0), composite (report 003's), or misjudged (composite, paid as if a "
                "quarter of the training prompts were another type: tasks/workflow_task.py)",
        "choices": ("sparse", "shaped", "format", "composite", "misjudged")})
    reward_clip: float = field(default=0.0, metadata={"help": "tools task: clamp the shaped reward to [-c, c]; "
                                                      "0 = off", "min": 0, "flag": False})
    drop_process_reward: bool = field(default=False, metadata={"help": "tools task: leave the tool's process "
                                                               "reward out (report 000's bug)", "flag": False})
    overlong_buffer: int = field(default=0, metadata={"help": "DAPO's overlong shaping: a completion longer than "
                                 "the token limit minus this many tokens loses up to 1 reward, linearly "
                                 "(overlong_penalty); 0 = off", "algos": ("grpo",)})
    mask_truncated: bool = field(default=False, metadata={"help": "DAPO's overlong filtering: completions cut at "
                                 "the token limit (no EOS) are left out of the loss (TRL's "
                                 "mask_truncated_completions)", "algos": ("grpo", "ppo")})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.reward in ("composite", "misjudged") and cfg.task != "dsl":
        yield "reward", f"{cfg.reward} is report 003's reward written for the dsl task, not --task {cfg.task}"
    if cfg.reward in ("sparse", "format") and cfg.task != "tools":
        yield "reward", (f"{cfg.reward} is a reward of the tools task; the dsl task takes shaped (the default), "
                         f"composite or misjudged")
    if not (cfg.overlong_buffer == 0 or 0 < cfg.overlong_buffer < cfg.completion_limit):
        yield "overlong-buffer", (f"must be in [0, the completion limit {cfg.completion_limit}) (0 = off), got "
                                  f"{cfg.overlong_buffer}")

OPERATORS = ("Custom", "Programmer", "Review", "Revise", "ScEnsemble",
             "AnswerGenerate", "Test", "Format")
MAX_STEPS = 8
DSL_REWARD = {"best": 1.0, "valid": 0.2, "fallback": 0.0, "junk": 0.0}

# One token per operator, arrow, '?', ':', or any other non-space run (which then fails).
_TOKEN = re.compile(r"->|\?|:|[A-Za-z]+|\S")
_FALLBACK = re.compile(r"^\s*#+\s*Step\b", re.IGNORECASE)


def parse_workflow(text: str) -> list[tuple] | None:
    """Parse a workflow into a list of steps, or None if it is not one.

    A step is ("op", name) or ("if", test, then, else_) with else_ an operator or "done".
    """
    if not isinstance(text, str):
        return None
    tokens = _TOKEN.findall(text)
    if not tokens or len(tokens) > 6 * MAX_STEPS:
        return None
    steps, i = [], 0
    while True:
        if i >= len(tokens) or tokens[i] not in OPERATORS:
            return None
        # conditional: OP ? OP : (OP | done)
        if i + 1 < len(tokens) and tokens[i + 1] == "?":
            if i + 5 > len(tokens):          # a conditional needs 5 tokens
                return None
            test, _, then, colon, else_ = tokens[i:i + 5]
            if then not in OPERATORS or colon != ":" or else_ not in OPERATORS + ("done",):
                return None
            steps.append(("if", test, then, else_))
            i += 5
        else:
            steps.append(("op", tokens[i]))
            i += 1
        if len(steps) > MAX_STEPS:
            return None
        if i == len(tokens):
            return steps
        if tokens[i] != "->":
            return None
        i += 1


def canonical(steps: list[tuple]) -> str:
    """The one spelling of a parsed workflow: 'A -> B ? C : done'."""
    parts = [s[1] if s[0] == "op" else f"{s[1]} ? {s[2]} : {s[3]}" for s in steps]
    return " -> ".join(parts)


def classify(completion: str, best: str) -> str:
    """'best', 'valid', 'fallback' or 'junk' for a completion, given the best workflow."""
    steps = parse_workflow(completion)
    if steps is not None:
        return "best" if canonical(steps) == canonical(parse_workflow(best)) else "valid"
    if isinstance(completion, str) and _FALLBACK.match(completion):
        return "fallback"
    return "junk"


def dsl_reward(completion: str, best: str) -> float:
    """Report 001's reward: 1.0 best workflow, 0.2 other valid DSL, 0 off-format."""
    return DSL_REWARD[classify(completion, best)]


# ---- report 003's composite reward, on the DSL task (--reward composite) ----
# Report 003 paid a selector of in-context examples 2.0*hard + 1.0*gt_prob + 0.1*(1-hard)*rel:
# hard = the VQA answer was right, gt_prob = the VQA model's probability of the right answer
# (a graded "how close"), rel = the chosen examples' relevance to the question (a small
# shaping term for wrong answers). Our reading of the three on a workflow:

def _lcs(a: list, b: list) -> int:
    """Length of the longest common subsequence of two lists (dynamic programming)."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev, row = row, [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
    return row[-1]


def composite_parts(completion: str, best: str) -> dict:
    """hard, gt_prob, rel of a completion, each in [0, 1]:

        hard     1 if it is the best workflow, else 0
        gt_prob  the share of the best workflow's steps it has, in order: LCS(steps, best) /
                 len(best) (1 for the best, 0 off-format)
        rel      the share of its operators that the best workflow uses (0 off-format)
    """
    steps, target = parse_workflow(completion), parse_workflow(best)
    if steps is None:
        return dict(hard=0.0, gt_prob=0.0, rel=0.0)
    ops = [op for s in steps for op in s[1:] if op != "done"]
    used = {op for s in target for op in s[1:]}
    hard = float(canonical(steps) == canonical(target))
    return dict(hard=hard, gt_prob=_lcs(steps, target) / len(target),
                rel=sum(op in used for op in ops) / len(ops))


def composite_reward(completion: str, best: str) -> float:
    """Report 003's reward: 2.0*hard + 1.0*gt_prob + 0.1*(1-hard)*rel. Range [0, 3]: the best
    workflow earns 3, any other at most 1.1."""
    p = composite_parts(completion, best)
    return 2.0 * p["hard"] + 1.0 * p["gt_prob"] + 0.1 * (1 - p["hard"]) * p["rel"]


# ---- the tool-calling task (report 000, tool_env.py) ----
# Each function takes an episode: the list of `info` dicts that ToolEnv.step returned, one
# per turn. All of them are pure, finite, and within the range their docstring states.

# Per-kind penalties (report 000, section 2.4: "not one flat -1 for every failure").
# -0.5 for the failures of a call (the report's value); garbage and silence cost more,
# an empty result (the tool's fault as much as the policy's) less. The values besides
# -0.5 are our choice.
FAILURE_PENALTY = {"malformed_json": -0.5, "unknown_tool": -0.5, "bad_arguments": -0.5,
                   "empty_result": -0.1, "turn_limit": -0.5, "no_action": -1.0,
                   "too_long": -1.0, "degenerate": -1.0}


def answered_correctly(episode: list) -> bool:
    return any(t.get("answered") and t.get("correct") for t in episode)


def sparse_reward(episode: list) -> float:
    """The reward that failed in report 000: +1 for a correct final answer, -1 otherwise.
    Range [-1, 1]. Most early episodes get -1, so most advantages are negative."""
    return 1.0 if answered_correctly(episode) else -1.0


def shaped_reward(episode: list, process: bool = True, clip: float | None = None) -> float:
    """Report 000's hierarchical reward, section 2.1, with per-kind penalties (2.4):

        R = 0.5 * (tools called correctly, each counted once) + 1.0 * [correct answer]
          + 0.1 * [no turn failed]  + sum of FAILURE_PENALTY over the turns' failures
          + sum of the tool's own process rewards (0.1 per successful call) if `process`

    process=False reproduces report 000's bug: the tool's process reward never reached the
    total. Range [-turns, 2.1 + 0.1 * turns] (two tools) before the optional clamp to
    [-clip, clip].
    """
    # Each tool counts once: repeating a good lookup every turn earns nothing more.
    tools = {t["tool"] for t in episode if t.get("correct_call")}
    r = 0.5 * len(tools) + 1.0 * answered_correctly(episode)
    failures = [t["failure"] for t in episode if t.get("failure")]
    r += 0.1 * (not failures) + sum(FAILURE_PENALTY[f] for f in failures)
    if process:
        r += sum(t.get("process_reward", 0.0) for t in episode)
    return max(-clip, min(clip, r)) if clip else r


def format_reward(episode: list, texts: list) -> float:
    """Partial credit along think -> tool_call -> tool_response -> answer (report 000, 2.1):
    a quarter for each stage reached, in order, over the episode's turns. Range [0, 1].
    texts: the policy's turns, as given to ToolEnv.step."""
    stages = 0
    joined = "\n".join(t if isinstance(t, str) else "" for t in texts)
    if tool_env.tag_body(joined, "think") is not None:           # linear, whatever the text
        stages = 1
        if any(t.get("tool") for t in episode):
            stages = 2
            if any(t.get("tool_success") for t in episode):
                stages = 3
                if any(t.get("answered") for t in episode):
                    stages = 4
    return stages / 4


# ---- DAPO's overlong reward shaping, and overlong filtering ----

def overlong_penalty(length: int, max_len: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft length penalty (verl's overlong_buffer, TRL's get_soft_overlong_punishment):

        penalty = min(0, ((max_len - buffer) - length) / buffer) * factor

    0 up to max_len - buffer tokens, then falling linearly to -factor at max_len: a completion
    that runs into the limit is told so before it is cut, instead of being scored on a text
    that stops mid-answer. length: the completion's policy tokens."""
    return min(0.0, ((max_len - buffer) - length) / buffer) * factor


def mask_truncated(batch):
    """DAPO's overlong filtering (TRL's mask_truncated_completions): a completion cut at the
    token limit never said it was done, so its reward scores a text that stops mid-answer;
    leave it out of the loss instead of punishing or rewarding it:

        mask_it <- mask_it * (1 - truncated_i)

    Its tokens stay in the context the others do not see anyway (each row is its own
    sequence), its reward still enters its group's advantage, but none of its tokens is
    trained on, nor counted in the loss's denominator. batch: a rollout.Rollout with
    `truncated` (N,). Returns the batch the update trains on, a copy with that mask and the
    attention as it was; batch itself is left whole for the step's metrics."""
    keep = (~batch.truncated.bool()).unsqueeze(1).to(batch.completion_mask.dtype)          # (N, 1)
    attn = batch.completion_mask if batch.completion_attn is None else batch.completion_attn   # the mask
    return replace(batch, completion_mask=batch.completion_mask * keep, completion_attn=attn)
