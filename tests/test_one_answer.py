"""Lesson 10: SmolLM2's collapse is onto one answer for every prompt, and that answer scores
exactly a quarter. Read from the committed real-model runs (results/smollm2-135m/*/runs/)."""
import json
from fractions import Fraction
from pathlib import Path

import pytest

from tasks import workflow_task

RUNS = Path(__file__).resolve().parent.parent / "results" / "smollm2-135m"


def evaluations(run: Path) -> list:
    """A run's held-out evaluations as logged in samples.jsonl: [(step, [sampled texts])]."""
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return [(r["step"], [s["text"] for s in r["samples"]]) for r in rows if r["split"] == "eval"]


@pytest.mark.lesson
def test_smollm2_collapses_onto_one_workflow_for_every_prompt_and_it_scores_exactly_a_quarter():
    """Every committed SmolLM2 DSL run whose logged held-out samples at the end are one text
    ends at held-out best exactly 1/4: that text is the best workflow of exactly one of the four
    problem types, whatever the prompt asks, and the held-out prompts hold the four types
    equally (8 each of 32; the lab's 8 prompts, 2 of each). The warm start, a frozen policy,
    never writes one text for every prompt (step 0 of the runs that start from it)."""
    types = [p["type"] for p in workflow_task.prompts("eval")]
    assert all(Fraction(types.count(t), len(types)) == Fraction(1, 4) for t in workflow_task.TYPES)
    owner = {}
    for ptype, text in workflow_task.BEST_WORKFLOW.items():
        owner.setdefault(text, []).append(ptype)
    collapsed = 0
    for summary in sorted(RUNS.glob("*/runs/*/s*/summary.json")):
        run = summary.parent
        config = json.loads((run / "config.json").read_text())
        if config["task"] != "dsl":
            continue
        evals = evaluations(run)
        if not config.get("init_from"):
            assert len(set(evals[0][1])) > 1, f"{run}: the warm start wrote one text for every prompt"
        last = set(evals[-1][1])
        if len(last) == 1:
            collapsed += 1
            assert len(owner.get(last.pop(), [])) == 1, f"{run}: one text, not one type's best workflow"
            assert json.loads(summary.read_text())["eval_best_rate_end"] == 0.25, run
    assert collapsed > 0
