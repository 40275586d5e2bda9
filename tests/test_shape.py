"""How the code reads, measured: no function of the lesson and wiring modules takes more than
8 parameters, and the training step and loop each fit on one screen (issue 14).

    python tests/test_shape.py        # the table: parameters and lines of the longest functions
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
# The lesson and wiring modules: everything a reader follows through one training step.
MODULES = ("advantages", "config", "distributed", "evaluate", "grpo", "kl", "logprobs", "policy", "ppo", "pretrained", "report",
           "rewards", "rollout", "schedules", "tasks", "tool_env", "tool_task", "train", "workflow_task")
MAX_PARAMETERS = 8
ONE_SCREEN = 50                                        # lines, docstring included
ON_ONE_SCREEN = ("train.train", "train.rl_step")


def functions() -> dict:
    """'module.function' (methods as 'module.Class.method') -> (parameters, lines)."""
    out = {}
    for name in MODULES:
        path = ROOT / f"{name}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for child in node.body:
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        child.qualified = f"{node.name}.{child.name}"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs] + \
                    [p.arg for p in (a.vararg, a.kwarg) if p]
                params = [p for p in params if p not in ("self", "cls")]
                qualified = getattr(node, "qualified", node.name)
                out[f"{name}.{qualified}"] = (len(params), node.end_lineno - node.lineno + 1)
    return out


def test_no_function_takes_more_than_eight_parameters():
    wide = {name: p for name, (p, _) in functions().items() if p > MAX_PARAMETERS}
    assert not wide, f"functions with more than {MAX_PARAMETERS} parameters: {wide}"


def test_the_training_step_and_loop_fit_on_one_screen():
    found = functions()
    for name in ON_ONE_SCREEN:
        assert name in found, f"{name} is gone; update ON_ONE_SCREEN"
        assert found[name][1] <= ONE_SCREEN, f"{name} is {found[name][1]} lines, more than {ONE_SCREEN}"


if __name__ == "__main__":
    rows = sorted(functions().items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
    top = int(sys.argv[1]) if sys.argv[1:] else 15
    print(f"{'function':40s} {'params':>6s} {'lines':>6s}")
    for name, (p, lines) in rows[:top]:
        print(f"{name:40s} {p:6d} {lines:6d}")
    print("longest:")
    for name, (p, lines) in sorted(rows, key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:40s} {p:6d} {lines:6d}")
