"""What a reader follows through one training step: the project's files and functions it enters.

    python -m tools.trace_step                     # step 2 of `python train.py --k 8 --norm global`
    python -m tools.trace_step --algo ppo          # any train.py flags

It runs a 2-step run of the tiny model (a short warm start, into a temporary folder) and records,
with Python's profiler hook, every call into this repository's code during step 2 (from the
step's start to the next one's, bookkeeping and logs included; the held-out evaluation is not
due at step 2). It prints the files entered, the distinct functions per file and how many calls
each file received; and, first, the files entered from the step's start to its first optimizer
step (update.optimizer_step: the sample -> reward -> advantage -> update path, before the logs). Comprehensions, generator expressions and lambdas are not counted as
functions; a function's calls to torch or transformers are not followed.
"""
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SKIP = ("<listcomp>", "<genexpr>", "<lambda>", "<dictcomp>", "<setcomp>", "<module>")


class Tracer:
    """Records (file, function) of every call into the repository while `on`."""

    def __init__(self):
        self.on, self.calls, self.before_step, self.stepped = False, Counter(), Counter(), False

    def __call__(self, frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and self.on and not name.startswith("<") and name != __file__:
            path = Path(name).resolve()
            if path.is_relative_to(ROOT) and "tests" not in path.parts and frame.f_code.co_name not in SKIP:
                where = (str(path.relative_to(ROOT)), frame.f_code.co_qualname)
                self.calls[where] += 1
                self.stepped = self.stepped or where == ("update.py", "optimizer_step")
                self.before_step[where] += not self.stepped


def trace(argv: list) -> Counter:
    """The calls of step 2 of a train.py run with argv (plus a short run's flags)."""
    import train
    try:
        from running import config
    except ImportError:                         # older code: flat modules
        import config
    tracer, starts = Tracer(), []

    def window(step_start):                     # wraps the function that starts a step
        def wrapped(*args, **kwargs):
            starts.append(1)
            tracer.on = len(starts) == 2        # on during step 2 only
            return step_start(*args, **kwargs)
        return wrapped
    if hasattr(train, "one_step"):              # older code: one function per step
        one_step = train.one_step

        def traced(*args, **kwargs):
            starts.append(1)
            tracer.on = len(starts) == 2
            try:
                return one_step(*args, **kwargs)
            finally:
                tracer.on = False
        train.one_step = traced
    elif hasattr(train, "begin_step"):          # older code: the loop's body, from begin_step on
        train.begin_step = window(train.begin_step)
    else:                                       # today: the loop's body, from its first call on
        train.step_hyper_params = window(train.step_hyper_params)
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--steps", "3", "--sft-steps", "30", "--eval-every", "10", "--quiet",
                 "--cache-dir", f"{tmp}/cache", "--out", f"{tmp}/run", *argv]
        sys.setprofile(tracer)
        try:
            train.train(config.parse_config(flags))
        finally:
            sys.setprofile(None)
    return tracer


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    tracer = trace(argv)
    before = +tracer.before_step                    # drop the zero counts
    files = sorted({path for path, _ in before})
    print(f"to the first optimizer step: {len(files)} files, {len(before)} distinct functions, "
          f"{sum(before.values())} calls ({', '.join(files)})")
    calls = tracer.calls
    by_file, functions = Counter(), defaultdict(set)
    for (path, name), n in calls.items():
        by_file[path] += n
        functions[path].add(name)
    print(f"step 2 of `python train.py {' '.join(argv)}`: {len(by_file)} files, "
          f"{len(calls)} distinct functions, {sum(calls.values())} calls")
    for path, n in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"  {path:28s} {len(functions[path]):3d} functions {n:5d} calls   {', '.join(sorted(functions[path]))}")


if __name__ == "__main__":
    main()
