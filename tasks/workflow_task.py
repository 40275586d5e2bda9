"""The workflow-DSL task of report 001, built in code.

A prompt names a problem and its type; the type decides which workflow is best:

    "Problem ( code ) : debug a parser . Workflow :"  ->  "Custom -> Programmer -> Review ? Revise : done"

rewards.py scores a completion (1.0 best, 0.2 other valid DSL, 0 off-format; or, with
--reward composite, report 003's 2*hard + gt_prob + 0.1*(1-hard)*rel).

--reward misjudged: the composite reward from a judge that is wrong on a fixed quarter of the
training prompts (MISJUDGED), paying there for the next type's best workflow, as report 003's
reward came from a VQA model that is itself wrong on some questions. The held-out prompts and
every rate (best_rate, ...) are judged right, so the reward a run climbs is partly misaligned
with the held-out metric: on three quarters of the prompts of a type it pays for the type's
best workflow, on the rest for another, and a policy that learns those exceptions by heart
can carry them to prompts it never trained on.

Train and held-out prompts share the four types but not the (verb, object) pairs: the
held-out set checks that the policy learned "type -> workflow", not a list of prompts.

The warm-start mix imitates report 001's starting point (570 outputs: 57.2% valid DSL,
42.8% `### Step 1: ...` fallback text; top patterns in its section 3.2). Within the valid
share we give the best workflow probability BEST_SHARE_OF_VALID; the report does not say
how often the 0.2-or-1.0 patterns were right, so that number is our choice.

The task's interface to train.py, warm_start.py and models/policy.py is tasks.Task (tool_task.py has it too).
"""
import random

import torch

import rollout
import rewards
from rewards import OPERATORS

NAME = "dsl"
# The DSL explained once, for a real instruction-tuned model (--model); the tiny model
# learns the format from the warm-up instead.
SYSTEM_PROMPT = ("Answer with a workflow in this DSL and nothing else. Operators: "
                 "Custom, Programmer, Review, Revise, ScEnsemble, AnswerGenerate, Test, Format. "
                 "Chain with '->'; a conditional is 'A ? B : done'. "
                 "Example: Custom -> Programmer -> Review ? Revise : done")
MAX_POSITIONS = 128          # the tiny model's context: prompt + one completion
MAX_DIFFICULTY = 1           # one kind of prompt (tasks.Task; the tools task has 3)
HEADLINE = ("best_rate", "valid_rate")   # the rates the progress line and the summary show
FORMAT_KEY = "valid_rate"                # on-format share: a collapse halves it
GROUP_KEY = "type"                       # results broken down by problem type (lab.compare.by_group)
RATES = ("best_rate", "valid_rate", "fallback_rate", "junk_rate")   # the keys of rates()
ENDS_WITH_EOS = True                     # a completion ends with the EOS token

BEST_WORKFLOW = {
    "code": "Custom -> Programmer -> Review ? Revise : done",
    "math": "Programmer -> ScEnsemble",
    "qa": "Custom -> AnswerGenerate -> ScEnsemble",
    "writing": "Custom -> Review ? Revise : done",
}
TYPES = tuple(BEST_WORKFLOW)

VERBS = {
    "code": ["implement", "debug", "refactor", "test"],
    "math": ["solve", "prove", "compute", "simplify"],
    "qa": ["answer", "explain", "look up", "compare"],
    "writing": ["draft", "edit", "summarise", "translate"],
}
OBJECTS = {
    "code": ["a parser", "a cache", "a sorting function", "an api client", "a scheduler",
             "a tokenizer", "a database query", "a file watcher"],
    "math": ["an integral", "a recurrence", "a geometry problem", "a probability puzzle",
             "a linear system", "an inequality", "a series", "a counting problem"],
    "qa": ["a history question", "a science fact", "a travel question", "a legal term",
           "a medical term", "a sports record", "a city fact", "a product review"],
    "writing": ["an essay", "a cover letter", "a blog post", "a poem", "a press release",
                "a short story", "a product description", "a speech"],
}
HELD_OUT_OBJECTS = 2   # the last 2 objects of each type are only ever seen in evaluation

# Report 001, section 3.2: the ten most frequent valid DSLs and their counts.
REPORT_TOP_PATTERNS = {
    "Custom -> Programmer -> Review ? Revise : done": 115,
    "Custom -> Programmer -> Review -> Revise": 69,
    "Programmer": 47,
    "Custom -> Programmer": 21,
    "Custom -> Programmer -> Review": 18,
    "Programmer -> Review ? Revise : done": 13,
    "Programmer -> Review -> Revise": 10,
    "Custom": 8,
    "Programmer -> Review": 6,
    "Custom -> Review ? Revise : done": 5,
}
FALLBACK_TEXTS = [
    "### Step 1 : Analyze the problem",
    "### Step 1 : Analyze the problem and identify the key requirements .",
    "### Step 1 : Analyze the problem . ### Step 2 : Design a solution .",
]
VALID_SHARE = 0.572          # report 001: 326 / 570
BEST_SHARE_OF_VALID = 0.35   # our choice: P(best | valid DSL) in the warm-start data


def prompts(split: str, difficulty: int = 1) -> list[dict]:
    """The task has one difficulty (MAX_DIFFICULTY): running/config.py refuses --difficulty above it."""
    return make_prompts(split)


def prompt_text(ptype: str, verb: str, obj: str) -> str:
    return f"Problem ( {ptype} ) : {verb} {obj} . Workflow :"


MISJUDGED = 4        # --reward misjudged: every 4th training prompt of a type (6 of its 24)


def make_prompts(split: str) -> list[dict]:
    """All prompts of a split ('train' or 'eval'): dicts with text, type, best; a misjudged
    training prompt (--reward misjudged) also has `judged`, the next type's best workflow."""
    prompts = []
    for ptype in TYPES:
        objs = OBJECTS[ptype][:-HELD_OUT_OBJECTS] if split == "train" \
            else OBJECTS[ptype][-HELD_OUT_OBJECTS:]
        for i, (verb, obj) in enumerate((v, o) for v in VERBS[ptype] for o in objs):
            prompt = {"text": prompt_text(ptype, verb, obj), "type": ptype, "best": BEST_WORKFLOW[ptype]}
            if split == "train" and i % MISJUDGED == 0:      # (verb, object) pairs spread over both
                prompt["judged"] = BEST_WORKFLOW[TYPES[(TYPES.index(ptype) + 1) % len(TYPES)]]
            prompts.append(prompt)
    return prompts


def warmstart_completion(ptype: str, rng: random.Random) -> str:
    """One supervised target drawn from the report-shaped mix for a prompt of this type."""
    return rng.choice(FALLBACK_TEXTS) if rng.random() >= VALID_SHARE else valid_completion(ptype, rng)


def valid_completion(ptype: str, rng: random.Random) -> str:
    """A valid workflow: the type's best with probability BEST_SHARE_OF_VALID, else other_valid's."""
    return BEST_WORKFLOW[ptype] if rng.random() < BEST_SHARE_OF_VALID else other_valid(ptype, rng)


def other_valid(ptype: str, rng: random.Random) -> str:
    """A valid workflow that is not the type's best, drawn by the report's counts."""
    others = {p: c for p, c in REPORT_TOP_PATTERNS.items() if p != BEST_WORKFLOW[ptype]}
    return rng.choices(list(others), weights=list(others.values()))[0]


def warmstart_batch(rng: random.Random, n: int, difficulty: int = 1) -> list[list[tuple[str, bool]]]:
    """n supervised examples, each a list of (text, trained) segments: the prompt (not
    trained on) and a completion from the mix (trained on, its EOS added by warm_start.sft_rows)."""
    chosen = rng.choices(make_prompts("train"), k=n)
    return [[(p["text"], False), (warmstart_completion(p["type"], rng), True)] for p in chosen]


def answer(prompt: dict) -> list[tuple[str, bool]]:
    """The right completion for a prompt, as (text, trained) segments: the best workflow
    (the held-out answer NLL's text: warm_start.answer_nll)."""
    return [(prompt["text"], False), (prompt["best"], True)]


def fingerprint(difficulty: int = 1) -> dict:
    """Everything that shapes the warm start besides the policy's own settings."""
    return {"vocab": vocabulary(), "mix": [VALID_SHARE, BEST_SHARE_OF_VALID, REPORT_TOP_PATTERNS,
                                           FALLBACK_TEXTS, BEST_WORKFLOW]}


# ---- rollouts and their scores (train.py) ----

def sample(models, prompts: list, k: int, sampling, record_old_logp: bool = True):
    """K completions per prompt, scored: (Rollout with rewards (N,), classes).
    models: rollout.Models; sampling: tasks.Sampling."""
    texts = [rollout.format_prompt(models.tok, p["text"], SYSTEM_PROMPT) for p in prompts]
    batch = rollout.sample(models, texts, k, sampling, record_old_logp)
    bests = [p["best"] for p in prompts for _ in range(k)]
    classes = [rewards.classify(t, b) for t, b in zip(batch.texts, bests)]
    if sampling.reward in ("composite", "misjudged"):   # report 003's (rewards.composite_reward)
        wrong = sampling.reward == "misjudged"          # from a judge wrong on MISJUDGED's prompts
        judged = [p.get("judged", p["best"]) if wrong else p["best"] for p in prompts for _ in range(k)]
        batch.rewards = torch.tensor([rewards.composite_reward(t, b) for t, b in zip(batch.texts, judged)])
    else:                                        # report 001's: 1 best, 0.2 valid, 0 off-format
        batch.rewards = torch.tensor([rewards.DSL_REWARD[cl] for cl in classes])  # (N,)
    return batch, classes


def rates(classes: list) -> dict:
    n = len(classes)
    share = {c: sum(x == c for x in classes) / n for c in ("best", "valid", "fallback", "junk")}
    return dict(best_rate=share["best"], valid_rate=share["best"] + share["valid"],
                fallback_rate=share["fallback"], junk_rate=share["junk"])


def describe(text: str, cls: str) -> dict:
    """One sample for samples.jsonl."""
    return dict(text=text, cls=cls)


def vocabulary() -> list[str]:
    """Every word the task can produce, for the word-level tokenizer."""
    words = {"Problem", "(", ")", ":", ".", "Workflow", "->", "?", "done"}
    words.update(TYPES)
    words.update(OPERATORS)
    for texts in (*VERBS.values(), *OBJECTS.values(), FALLBACK_TEXTS):
        for text in texts:
            words.update(text.split())
    return sorted(words)
