"""Do two runs write the same metrics? Their metrics.jsonl compared line by line, field by field.

    python -m tools.same_metrics RUN_A RUN_B          # run folders (or metrics.jsonl files)

Every field but `seconds` is compared: numbers by their relative difference, everything else
for equality. It prints the number of lines and numbers compared, the largest relative
difference and where, and any field that differs otherwise; exit 0 when the largest relative
difference is at most --tol (default 1e-5) and nothing else differs, else 1. How a redesign
is shown to change nothing learned: the same command, seed and flags on the code before and
after it.
"""
import argparse
import json
import sys
from pathlib import Path


def rows(path: Path) -> list:
    path = path / "metrics.jsonl" if path.is_dir() else path
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in out:
        row.pop("seconds", None)
    return out


def compare(a, b, where: str, found: dict) -> None:
    """Walk a and b together; record the largest relative difference and other mismatches."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        found["numbers"] += 1
        rel = abs(a - b) / max(abs(a), abs(b), 1e-30) if a != b else 0.0
        if rel > found["worst"]:
            found["worst"], found["where"] = rel, where
    elif isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            found["other"].append(f"{where}: fields {sorted(a.keys() ^ b.keys())}")
        for key in sorted(a.keys() & b.keys()):
            compare(a[key], b[key], f"{where}.{key}", found)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            compare(x, y, f"{where}[{i}]", found)
    elif a != b:
        found["other"].append(f"{where}: {a!r} != {b!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.same_metrics", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--tol", type=float, default=1e-5)
    args = p.parse_args(argv)
    try:
        a, b = rows(args.a), rows(args.b)
    except (OSError, ValueError) as e:
        p.error(f"cannot read the metrics: {e}")
    found = {"numbers": 0, "worst": 0.0, "where": None, "other": []}
    if len(a) != len(b):
        found["other"].append(f"{len(a)} lines against {len(b)}")
    for ra, rb in zip(a, b):
        compare(ra, rb, f"step {ra.get('step')}", found)
    at = f" ({found['where']})" if found["where"] else ""
    print(f"{len(a)} and {len(b)} lines, {found['numbers']} numbers compared; largest relative difference "
          f"{found['worst']:.2e}{at}")
    for line in found["other"][:20]:
        print(f"  differs: {line}")
    return 0 if found["worst"] <= args.tol and not found["other"] else 1


if __name__ == "__main__":
    sys.exit(main())
