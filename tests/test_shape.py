"""How the code reads, measured: the top level is the course, the lessons stand alone, and
the loop a reader reads fits on a screen.

    python tests/test_shape.py        # the table: files, and the functions with most parameters and lines

- The top level holds the lessons and train.py, nothing else; each is at most 300 lines.
- A lesson imports only torch, transformers, the standard library and other lessons: never
  the machinery (running/, tasks/, models/, lab/), which may import the lessons. The tools that
  inspect or benchmark the code (tools/) are imported by nothing but the tests.
- No lesson function takes more than 6 parameters; no function of a training step (the
  lessons, train.py, running/, tasks/, models/) more than 8.
- train.py is at most 300 lines; its loop (`train`) at most 80; one step (`rl_step`) at most 50.
- The machinery a run needs (running/) is at most 1,500 non-blank lines.
"""
import ast
import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
LESSONS = ("advantages", "diagnostics", "dynamic_sampling", "entropy_control", "grpo", "kl",
           "logprobs", "mismatch", "monitor", "ppo", "rce", "rewards", "rollout", "shared_prefix", "surrogates",
           "tool_env", "truncation", "trust_regions", "update", "lora", "warm_start", "mistakes")
MACHINERY = ("running", "tasks", "models", "lab")
ALLOWED = {"torch", "transformers", *LESSONS, *sys.stdlib_module_names}


def functions(path: Path) -> dict:
    """'function' (methods as 'Class.method') -> (parameters, lines), for one file."""
    out, tree = {}, ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    child.qualified = f"{node.name}.{child.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs] + [p.arg for p in (a.vararg, a.kwarg) if p]
            params = [p for p in params if p not in ("self", "cls")]
            out[getattr(node, "qualified", node.name)] = (len(params), node.end_lineno - node.lineno + 1)
    return out


def imported(path: Path) -> set:
    """The top-level names of every module a file imports (anywhere in it)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def code_files() -> list:
    return [p for p in ROOT.glob("*.py")] + [p for pkg in MACHINERY for p in (ROOT / pkg).glob("*.py")]


def module_imports() -> dict:
    """Each of the project's modules ('running.session', 'grpo', ...) and the project modules it
    imports, inside functions too: a reader following a module's imports meets a deferred one
    all the same."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in [*ROOT.glob("*.py"), *(q for pkg in (*MACHINERY, "tools") for q in (ROOT / pkg).glob("*.py"))]}
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if node.level == 0 else ".".join([*name.split(".")[:-1], node.module])
                deps |= {m for m in (base, *(f"{base}.{a.name}" for a in node.names)) if m in files}
        graph[name] = deps - {name}
    return graph


def test_no_import_circles():
    graph, done, path = module_imports(), set(), []

    def visit(name):                       # depth first; a module met again on the current path closes a circle
        if name in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(name):] + [name])}")
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        path.pop()
        done.add(name)
    for name in sorted(graph):
        visit(name)
    assert len(graph) > 40 and graph["train"] >= {"grpo", "update", "running.session"}


def test_the_tools_are_outside_the_course_and_the_lab():
    users = [p.relative_to(ROOT) for p in code_files() if "tools" in imported(p)]
    assert users == [], "a lesson, train.py, the machinery or the lab imports tools/"


def test_the_top_level_is_the_lessons_and_train():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert top == sorted([*LESSONS, "train"]), \
        f"top-level files other than the lessons and train.py: {sorted(set(top) - set(LESSONS) - {'train'})}"


@pytest.mark.parametrize("name", [*LESSONS, "train"])
def test_top_level_files_fit_in_300_lines(name):
    lines = len((ROOT / f"{name}.py").read_text().splitlines())
    assert lines <= 300, f"{name}.py is {lines} lines: split it by concept"


@pytest.mark.parametrize("name", LESSONS)
def test_a_lesson_imports_only_torch_transformers_the_standard_library_and_lessons(name):
    outside = imported(ROOT / f"{name}.py") - ALLOWED
    assert not outside, f"{name}.py imports {sorted(outside)}: a lesson never reaches into the machinery"


def test_no_lesson_function_takes_more_than_six_parameters():
    wide = {f"{name}.{fn}": p for name in LESSONS for fn, (p, _) in functions(ROOT / f"{name}.py").items() if p > 6}
    assert not wide, f"lesson functions with more than 6 parameters: {wide}"


def test_no_function_a_training_step_runs_takes_more_than_eight_parameters():
    wiring = [p for p in code_files() if p.parent.name != "lab"]      # the lab's helpers aside
    wide = {f"{path.relative_to(ROOT)}:{fn}": p for path in wiring
            for fn, (p, _) in functions(path).items() if p > 8}
    assert not wide, f"functions with more than 8 parameters: {wide}"


def test_train_reads_as_the_loop():
    lines = len((ROOT / "train.py").read_text().splitlines())
    assert lines <= 300, f"train.py is {lines} lines, more than 300"
    found = functions(ROOT / "train.py")
    assert found["train"][1] <= 80, f"train.train is {found['train'][1]} lines, more than 80"
    assert found["rl_step"][1] <= 50, f"train.rl_step is {found['rl_step'][1]} lines, more than 50"


if __name__ == "__main__":
    print(f"{'file':32s} {'lines':>6s}")
    for path in sorted(code_files()):
        print(f"{str(path.relative_to(ROOT)):32s} {len(path.read_text().splitlines()):6d}")
    rows = sorted(((f"{p.relative_to(ROOT)}:{fn}", v) for p in code_files() for fn, v in functions(p).items()),
                  key=lambda kv: (-kv[1][0], -kv[1][1]))
    top = int(sys.argv[1]) if sys.argv[1:] else 15
    print(f"\n{'function':48s} {'params':>6s} {'lines':>6s}")
    for name, (p, lines) in rows[:top]:
        print(f"{name:48s} {p:6d} {lines:6d}")
    print("longest:")
    for name, (p, lines) in sorted(rows, key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:48s} {p:6d} {lines:6d}")


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    """Images and pages linked from docs/ as if from the repository's root were broken (Lesson 5's
    curves, the lab notebook's nineteen figures)."""
    import re
    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *root.glob("docs/**/*.md"), *root.glob("results/**/SUMMARY.md")]
    broken = [(str(md.relative_to(root)), target) for md in pages
              for target, _ in re.findall(r"\]\(([^)#\s]+)(#[^)]*)?\)", md.read_text())
              if not target.startswith(("http://", "https://", "mailto:")) and not (md.parent / target).exists()]
    assert not broken, broken


@pytest.mark.parametrize("module", ["train.py", "grpo.py"])
def test_the_default_runs_departures_from_grpo_are_what_train_and_grpo_say(module, tmp_path):
    """train.py and grpo.py open with the default run's four departures from DeepSeekMath's GRPO
    and the flag that undoes each: the defaults are those, and each flag gives GRPO's setting."""
    from running import config
    text = (ROOT / module).read_text()
    undo = {"--epochs 2": ("epochs", 2), "--beta 0.04": ("beta", 0.04), "--norm group": ("norm", "group"),
            "--loss-agg seq-mean-token-mean": ("loss_agg", "seq-mean-token-mean")}
    default = config.parse_config(["--out", str(tmp_path / "d")])
    assert (default.epochs, default.mini_batch in (0, default.n), default.beta, default.norm, default.loss_agg) == \
        (1, True, 0.0, "global", "token-mean")
    for flag, (field, value) in undo.items():
        assert flag in text, f"{module} names {flag}"
        assert getattr(config.parse_config([*flag.split(), "--out", str(tmp_path / "u")]), field) == value


def test_each_lesson_page_opens_with_its_one_test_and_that_test_exists():
    """A lesson page leads with the test that shows the lesson, then the code to read, then
    the commands, in at most 150 lines; the test it names is a function of that test file."""
    for page in sorted((ROOT / "docs" / "lessons").glob("*.md")):
        lines = page.read_text().splitlines()
        assert len(lines) <= 150, f"{page.name} is {len(lines)} lines: its long results go to docs/lessons/results/"
        assert lines[2].startswith("**The lesson, as a test**"), page.name
        node = lines[4].split('"')[1]
        path, name = node.split("::")
        assert name in functions(ROOT / path), f"{page.name} names {node}, which does not exist"
        first = {key: next(i for i, line in enumerate(lines) if line.startswith(key)) for key in ("**Read**", "**Run**")}
        assert 4 < first["**Read**"] < first["**Run**"], page.name


def test_the_readmes_lesson_paragraphs_are_at_most_8_lines():
    """The README carries the few numbers that make each lesson; the tables live on its page."""
    text = (ROOT / "README.md").read_text()
    lessons = text[text.index("## The lessons"):text.index("\n## ", text.index("## The lessons") + 1)]
    long = [p.splitlines()[0] for p in lessons.split("\n\n") if len(p.splitlines()) > 8]
    assert long == [], long


def test_each_knob_is_defined_once_by_the_lesson_that_uses_it_and_the_flags_are_at_most_80():
    """Config is made of the run's own flags (Run) and each lesson's Knobs: no field twice, none
    elsewhere, each with its help; the flags (Knobs whose metadata does not say "flag": False)
    are at most 80, and --help lists each under its lesson."""
    from running import config
    owners = [config.Run, *(lesson.Knobs for lesson in config.LESSONS)]
    names = [f.name for cls in owners for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), "a knob defined twice"
    assert set(names) == {f.name for f in dataclasses.fields(config.Config)}
    assert all(f.metadata.get("help") for f in dataclasses.fields(config.Config))
    sections = config.sections()
    flags = [f.name for _, fields in sections for f in fields]
    assert len(flags) == len(set(flags)) <= 80, len(flags)
    for lesson in config.LESSONS:
        assert any(title.startswith(f"{lesson.__name__}.py: ") for title, _ in sections), lesson.__name__


def test_the_machinery_a_run_needs_is_at_most_1500_lines():
    """running/ (the configuration and its checks, one run, checkpoints, torchrun, the report) stays
    small enough to see past: at most 1,500 non-blank lines."""
    lines = sum(1 for path in (ROOT / "running").glob("*.py") for line in path.read_text().splitlines() if line.strip())
    assert lines <= 1500, f"running/ is {lines} non-blank lines"


def test_a_new_objective_is_one_registered_function(monkeypatch):
    """--policy-loss's choices, the update's dispatch and the checks of each objective's knobs all
    come from surrogates.OBJECTIVES and the knobs' metadata: registering a function is the edit."""
    import surrogates
    from running import config
    # PPO's clip, and LUSPO (that clip on GSPO's ratio, with its own aggregation) are grpo.policy_loss's
    assert surrogates.POLICY_LOSSES == ("clip", "luspo", *surrogates.OBJECTIVES)
    policy_loss = next(f for f in dataclasses.fields(config.Config) if f.name == "policy_loss")
    assert policy_loss.metadata["choices"] == surrogates.POLICY_LOSSES
    for f in dataclasses.fields(surrogates.Knobs):
        assert set(f.metadata.get("objective", ())) <= set(surrogates.POLICY_LOSSES), f.name
    called = []
    monkeypatch.setitem(surrogates.OBJECTIVES, "cispo", lambda *args: called.append(args) or "the registered one")
    hp = config.hyper_params(config.Config(policy_loss="cispo"))
    assert surrogates.policy_gradient_loss(None, None, None, None, hp) == "the registered one" and len(called) == 1

def test_the_lessons_are_at_least_40_percent_of_the_code_outside_tools_and_tests():
    """The course in proportion: the lessons and train.py hold at least 40% of the non-blank lines
    of Python outside tests/ and tools/ (the machinery and the lab the rest)."""
    def lines(paths):
        return sum(1 for p in paths for line in p.read_text().splitlines() if line.strip())
    course = lines(ROOT.glob("*.py"))
    share = course / lines(code_files())
    assert share >= 0.40, f"the lessons are {share:.1%} of the code"
