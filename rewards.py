"""Reward functions: what the policy is paid for a completion.

Workflow DSL (report 001, ../shared/seeds/001_*.txt). A completion must be a workflow, e.g.

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
