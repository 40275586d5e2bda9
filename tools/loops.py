"""Which held-out episodes of a tool run loop on a phrase: report 000's degenerate text, counted from samples.jsonl.

    python -m tools.loops results/smollm2-135m/real_000_regime/runs/*/s*      # run folders

tool_env's "degenerate" failure is a turn with one character 8+ times or one word 6+ times in a row (report
000's `!!!!`). A real model also loops on a phrase, "answer now answer now ...", which that rule passes (such a
turn counts as no_action). For each run and each evaluation in its samples.jsonl this prints the held-out
episodes that hold a loop (tool_env's rule, or a phrase of one to four words 6+ times in a row) and, beside
them, those tool_env's rule alone catches. It reads the runs' files only: what they logged stays as it was.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import tool_env

# a phrase of one to four words, then the same phrase again 5+ more times, a space between each
PHRASE_LOOP = re.compile(r"\b((?:\w+\s+){0,3}\w+)(?:\s+\1\b){5,}")


def kinds(text: str) -> tuple[bool, bool]:
    """(it loops: tool_env's rule or a phrase loop, tool_env's rule catches it)."""
    env = bool(tool_env._DEGENERATE.search(text))
    return env or bool(PHRASE_LOOP.search(text)), env


def loops(text: str) -> bool:
    return kinds(text)[0]


def counts(run: Path) -> list:
    """[(step, episodes that loop, episodes tool_env's rule catches, episodes)] at each held-out evaluation."""
    out = []
    for line in (run / "samples.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("split") == "eval":
            found = [kinds(s["text"]) for s in row["samples"]]
            out.append((row["step"], sum(l for l, _ in found), sum(e for _, e in found), len(found)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.loops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="run folders, each with its samples.jsonl")
    args = p.parse_args(argv)
    print("run: at each held-out evaluation, step: episodes that loop (tool_env's rule catches) / episodes")
    for run in args.runs:
        try:
            found = counts(run)
        except (OSError, ValueError, KeyError) as e:
            print(f"{run}: cannot read its samples ({e})")
            continue
        print(f"{run}: " + ", ".join(f"{step}: {n} ({env}) / {total}" for step, n, env, total in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
