"""The lab's figures other than a comparison's (lab/compare.py): Lesson 1's advantage
distributions and bars over seeds.

    python -m lab.figures         # runs/lab/k2_pm1/advantages.png (or the path given), the K=2 +-1 spikes, and its table
"""
import itertools
import math
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen needed
import matplotlib.pyplot as plt
import torch

import advantages as adv

# The reward mix of report 001's starting point: 42.8% off-format (0), 57.2% valid DSL,
# of which a minority is the best workflow. The split of the valid share into 0.2 and 1.0
# is our assumption (the report does not give it): a third best, two thirds other valid.
REPORT_001_MIX = {0.0: 0.43, 0.2: 0.38, 1.0: 0.19}


def save(fig, path: Path, dpi: int = 90, **layout) -> Path:
    """Lay the figure out (layout: tight_layout's), write it to path, its folder made, and free it."""
    fig.tight_layout(**layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def sample_rewards(n_batches: int, n: int, mix: dict, seed: int = 0) -> torch.Tensor:
    """(n_batches, n) rewards drawn i.i.d. from mix {reward: probability}."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor(list(mix.keys()))
    probs = torch.tensor(list(mix.values()))
    idx = torch.multinomial(probs, n_batches * n, replacement=True, generator=gen)
    return values[idx].view(n_batches, n)


# The estimators whose advantages depend only on how many of each reward a group holds (these)
# or the batch holds (global): their shares can be computed exactly, by enumerating those counts.
BY_GROUP = ("group", "drgrpo", "rloo", "none")


def compositions(n: int, parts: int):
    """Every way to count n draws into `parts` kinds: (c_1, ..., c_parts), summing to n."""
    for cut in itertools.combinations(range(n + parts - 1), parts - 1):
        edges = (-1, *cut, n + parts - 1)
        yield tuple(b - a - 1 for a, b in zip(edges, edges[1:]))


def exact_shares(norm: str, k: int, n: int = 48, mix: dict = REPORT_001_MIX):
    """(share of advantages with |A| = 1, share of zero-variance groups), exactly, for rewards
    drawn i.i.d. from mix: the expectation over every count of each reward in a group of K (or,
    for global, in the batch of N), each weighted by its multinomial probability. None for
    batch and reinforce++-baseline, which depend on how the batch splits into groups."""
    if norm not in (*BY_GROUP, "global"):
        return None
    size, values, probs = (n if norm == "global" else k), list(mix), list(mix.values())
    pm1 = zero = 0.0
    for counts in compositions(size, len(values)):
        p = math.factorial(size) * math.prod(q ** c / math.factorial(c) for q, c in zip(probs, counts))
        r = torch.tensor([v for v, c in zip(values, counts) for _ in range(c)])
        pm1 += p * adv.frac_pm1(adv.compute(r, size if norm != "global" else k, norm))
        zero += p * (max(counts) == size)
    return pm1, (zero if norm != "global" else exact_shares("group", k, n, mix)[1])


def advantage_grid(ks=(2, 4, 8, 16), norms=adv.NORMS, n=48, n_batches=500, seed=0):
    """{(norm, k): (all advantages, share |A| == 1, share of zero-variance groups)}."""
    rewards = sample_rewards(n_batches, n, REPORT_001_MIX, seed)   # (n_batches, N)
    out = {}
    for k in ks:
        for norm in norms:
            a = torch.cat([adv.compute(r, k, norm) for r in rewards])   # (n_batches*N,)
            zero = sum(adv.frac_zero_std(r, k) for r in rewards) / n_batches
            out[(norm, k)] = (a, adv.frac_pm1(a), zero)
    return out


def plot_advantages(path: Path, ks=(2, 4, 8, 16), norms=adv.NORMS, n=48, n_batches=500):
    grid = advantage_grid(ks, norms, n, n_batches)
    fig, axes = plt.subplots(len(norms), len(ks), figsize=(3.2 * len(ks), 1.9 * len(norms)),
                             sharex=True, squeeze=False)
    bins = torch.linspace(-3, 3, 121).tolist()
    for i, norm in enumerate(norms):
        for j, k in enumerate(ks):
            a, pm1, zero = grid[(norm, k)]
            ax = axes[i][j]
            # Weights make each panel a share of all samples, so spike heights compare.
            ax.hist(a.clamp(-3, 3).numpy(), bins=bins, weights=[1 / a.numel()] * a.numel(),
                    color="C3" if (k == 2 and norm == "group") else "C0")
            ax.set_ylim(0, 0.5)
            ax.text(0.02, 0.95, f"|A|=1: {pm1:.0%}\nzero-var groups: {zero:.0%}",
                    transform=ax.transAxes, va="top", fontsize=7)
            if i == 0:
                ax.set_title(f"K = {k}")
            if j == 0:
                ax.set_ylabel(f"{norm}\nshare", fontsize=9)
            if i == len(norms) - 1:
                ax.set_xlabel("advantage (clamped to ±3 for display)")
    fig.suptitle(f"Advantage distributions, N={n} rewards per batch drawn from report 001's mix "
                 f"(P(0)={REPORT_001_MIX[0.0]}, P(0.2)={REPORT_001_MIX[0.2]}, "
                 f"P(1)={REPORT_001_MIX[1.0]}), {n_batches} batches", fontsize=10)
    save(fig, path, dpi=110)
    return grid


def plot_bars(path: Path, values: dict, ylabel: str, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(list(values), list(values.values()), color=["C0", "C1", "C2", "C3"][:len(values)])
    ax.set(ylabel=ylabel, title=title)
    ax.title.set_fontsize(8)
    return save(fig, path)


def plot_grouped_bars(path: Path, values: dict, ylabel: str, title: str) -> Path:
    """values: {bar label: {group: [one value per seed]}}: per group, a bar per label at the
    mean over seeds, the seeds as dots."""
    labels = list(values)
    groups = list(next(iter(values.values())))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.6))
    for i, label in enumerate(labels):
        for j, g in enumerate(groups):
            xs, x = values[label][g], j + (i - (len(labels) - 1) / 2) * width
            ax.bar(x, sum(xs) / len(xs), width, color=f"C{i}", label=label if j == 0 else None)
            ax.plot([x] * len(xs), xs, "k.", ms=3)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(ylabel=ylabel)
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    ax.legend(fontsize=6, ncol=2)
    return save(fig, path)


def plot_probe(results: dict, lrs, conditions, path: Path, model: str = "tiny Qwen2") -> Path:
    """probe_001: the mean change of P(off-format) after one update against lr, a line per
    condition, a panel per warm start and optimizer state (lab/probe001.py)."""
    import statistics
    panels = [(start, state) for start in results for state in ("fresh", "warmed")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharey=True, squeeze=False)
    for ax, (start, state) in zip(axes[0], panels):
        for i, c in enumerate(conditions):
            ax.plot(lrs, [statistics.fmean(results[start][(state, lr, c)]["p_off"]) for lr in lrs], "o-",
                    color=f"C{i}", label=c, ms=3)
        ax.set(xscale="log", xlabel="lr", title=f"{start}\n{state} AdamW")
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.axhline(0, color="k", lw=0.5)
        ax.title.set_fontsize(8)
    axes[0][0].set_ylabel("mean change of P(off-format)\nafter one update (held-out)")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"report 001's mechanism, exactly: {model} warm start, one update, CPU", fontsize=8)
    return save(fig, path)


def main() -> None:
    """Lesson 1's figure and its table: the share of |A| = 1 (and of zero-variance groups),
    exact where the counts decide it (exact_shares), else over the figure's 500 simulated
    batches (marked ~)."""
    out = Path(sys.argv[1] if sys.argv[1:] else "runs/lab/k2_pm1/advantages.png")   # results/k2_pm1/: committed
    grid = plot_advantages(out)
    print(f"wrote {out}")
    print("share of advantages with |A| == 1 (zero-variance groups), by norm and K; ~ simulated:")
    for norm in adv.NORMS:
        cells = []
        for k in (2, 4, 8, 16):
            exact = exact_shares(norm, k)
            pm1, zero = exact if exact else grid[(norm, k)][1:]
            cells.append(f"K={k}: {'' if exact else '~'}{pm1:5.1%} ({zero:5.1%})")
        print(f"  {norm:20s} {'  '.join(cells)}")


if __name__ == "__main__":
    main()
