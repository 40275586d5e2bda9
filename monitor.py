"""Report 002's stability monitor: three alarms on the curves a run already logs; report 001's
collapse count beside its null; and --rollback, which undoes a collapse once it is seen.

    entropy_low    token-mean policy entropy below a floor      (premature convergence)
    kl_high        KL to the reference above a ceiling          (the policy ran away from it)
    reward_swing   max - min of the mean reward over the last 10 steps above a ceiling   (oscillation)

Report 002's thresholds (REPORT_002: entropy 0.5, KL 0.5, swing 0.3) fire on every healthy run
the lab has kept: entropy_low on 668 of 668 toy runs and 61 of 61 SmolLM2 runs, reward_swing on
646 of 668 and 59 of 61 (`python -m lab detectors`, results/detectors/table.md). An alarm that
fires on healthy runs warns of nothing, so StabilityMonitor's defaults are the bench's: the round
values at which each fired on at most 10% of the healthy runs of both models. At the fifth
reading: entropy < 0.005 on 5 of 668 and 0 of 61; swing > 2 on 6 of 668 and 1 of 61; KL > 4 on 9
of 99 toy runs with a reference (moved from 2.5, which fired on 19 at the third: rce_grpo's GRPO
stage). They warned 2 of the 108 collapsed runs in time: the bench found no signal that warns
at that false-alarm rate. The entropy one is the field alert_entropy.
An alert is *active* on every step its condition holds (metrics.jsonl lists the active ones
under `alerts`), and is printed once when an episode of it starts, not on every step.
A quantity that was not measured on a step (no update, no reference model) neither starts
nor ends an episode.
"""
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Knobs:
    """Report 002's monitor: alerts on entropy, KL and reward swings, and the collapse count."""
    alert_entropy: float = field(default=0.005, metadata={"help": "alert when the token-mean entropy falls below "
                                                          "this (report 002 said 0.5)", "min": 0, "flag": False})
    # a field, not a flag: no threshold quiet on healthy runs warned of a collapse (the lab's
    # `detectors`); --rollback acts on what the evaluation sees instead
    stop_on_alert: bool = field(default=False, metadata={"help": "stop the run (with a checkpoint) at the "
                                                         "monitor's first alert", "flag": False})
    rollback: int = field(default=0, metadata={"help": "when an evaluation finds one answer or a step is non-finite, "
                                               "go back to the best checkpoint, the lr cut; at most N times (0 = off)",
                                               "min": 0, "max": 100})
    rollback_at: float = field(default=0.9, metadata={"help": "--rollback: the held-out one-answer share that is a "
                                                      "collapse (the lab's)", "min": 0, "max": 1, "flag": False})
    rollback_lr_cut: float = field(default=0.5, metadata={"help": "--rollback: the lr's factor at each rollback",
                                                          "min": 0, "max": 1, "flag": False})



# ---- the crash flag's value under the null ----
#
# train.py flags `collapsed_after_update` when an update was taken and the next step's
# on-format rate is at most half the previous one. That rate is a share of N sampled
# rollouts, so it moves by binomial noise alone: a policy that never changes raises the
# flag too. With X1, X2 ~ Binomial(N, p) independent (two steps of a frozen policy whose
# on-format probability is p), the flag fires when X1 > 0 and X2 <= X1 / 2:
#
#     P(flag) = sum_{x1 >= 1} P(X1 = x1) * P(X2 <= floor(x1 / 2))
#
# p = 0.57 (report 001's warm start): 14.4% at N = 6 (K=2, B=3), 2.6% at N = 16, 2.5e-5 at
# N = 64 (`python monitor.py` prints the table). A crash rate means something only above it.

def binomial_cdf(x: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(0, x + 1))


def false_collapse_rate(p: float, n: int) -> float:
    """P(flag) for a frozen policy with on-format probability p and N = n rollouts per step."""
    return sum(math.comb(n, x) * p ** x * (1 - p) ** (n - x) * binomial_cdf(x // 2, n, p)
               for x in range(1, n + 1))


def false_collapse_given(rate: float, n: int) -> float:
    """P(flag on the next step | this step's on-format rate), for a policy frozen at that
    rate: P(Binomial(n, rate) <= n * rate / 2); 0 when the rate is 0 (the flag needs > 0).
    The rate stands for the policy's own p here, which the observed rate after a flag's first
    step overstates (CollapseCount below takes p from a window instead)."""
    if rate <= 0:
        return 0.0
    return binomial_cdf(int(round(n * rate)) // 2, n, rate)


# A frozen policy's rate p is not the rate the flag compares against: after x of n on-format
# samples, the flag's chance under the null is P(Binomial(n, p) <= x / 2) at the policy's p, and
# x / n is a biased guess of p on exactly the steps that can flag (x > 0 is itself selected: at
# p = 0.03 and n = 6 the flag follows x = 1 with chance 0.97^6 = 0.83, and x / n = 1/6 says 0.33).
# CollapseCount takes p from the WINDOW steps before the updated one instead (all of them, updated
# or not: under the null they are independent of the two steps the flag reads).
WINDOW = 10


class CollapseCount:
    """Report 001's statistic, counted as a run goes (train.py's steer), beside its null: a step
    is collapsed_after_update when the step before it took an update from x > 0 on-format
    samples of n and this step has at most x / 2; `floor` sums, over the same steps, the flag's
    chance for a policy frozen at the rate of the last WINDOW steps: the count sampling noise
    alone would reach along the run's own rates."""

    def __init__(self, n: int):
        self.n, self.collapses, self.floor = n, 0, 0.0
        self.before = None               # the on-format rate the last step updated from, or None
        self.last = None                 # the last step's on-format rate, updated or not
        self.recent = deque(maxlen=WINDOW)    # the WINDOW steps' rates before the last one

    def update(self, updated: bool, on_format: float | None) -> bool:
        """Count one step (on_format: its rate, None when nothing was sampled); True when it is
        collapsed_after_update."""
        collapsed = bool(self.before and on_format is not None and on_format <= self.before / 2)
        if self.before is not None and on_format is not None:
            x = int(round(self.n * self.before))
            self.floor += self.chance_at_most(x // 2) if x > 0 else 0.0
        self.collapses += collapsed
        if self.last is not None:                  # the window: every step before the one that updates next
            self.recent.append(self.last)
        self.before, self.last = (on_format if updated else None), on_format
        return collapsed

    def chance_at_most(self, k: int) -> float:
        """P(Binomial(n, p) <= k) at the frozen policy's p, estimated without bias from the
        window's samples (M = n a step, S on-format): the chance that n of them drawn without
        replacement hold at most k on-format, sum_i<=k C(S, i) C(M - S, n - i) / C(M, n)
        (a plug-in p would be biased: the flag's chance is not linear in p). With no step before
        the updated one (the run's first), its own rate stands for p."""
        if not self.recent:
            return binomial_cdf(k, self.n, self.before)
        counts = [int(round(self.n * r)) for r in self.recent]
        m, s = self.n * len(counts), sum(counts)
        return sum(math.comb(s, i) * math.comb(m - s, self.n - i) for i in range(k + 1)) / math.comb(m, self.n)

    def state_dict(self) -> dict:
        return {"collapses": self.collapses, "floor": self.floor, "before": self.before, "last": self.last,
                "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.collapses, self.floor, self.before, self.last = (state[k] for k in ("collapses", "floor", "before", "last"))
        self.recent.extend(state["recent"])


REPORT_002 = {"min_entropy": 0.5, "max_kl": 0.5, "max_reward_range": 0.3}    # the report's thresholds


class StabilityMonitor:
    def __init__(self, min_entropy=0.005, max_kl=4.0, max_reward_range=2.0, window=10):
        self.min_entropy, self.max_kl = min_entropy, max_kl
        self.max_reward_range, self.window = max_reward_range, window
        self.rewards = deque(maxlen=window)
        self.active = set()
        self.episodes = {"entropy_low": 0, "kl_high": 0, "reward_swing": 0}

    def update(self, reward_mean: float | None, entropy: float | None, kl: float | None):
        """Feed one step. Returns (active alerts, alerts whose episode starts now, messages)."""
        if reward_mean is not None:
            self.rewards.append(reward_mean)
        swing = max(self.rewards) - min(self.rewards) if self.rewards else 0.0
        # A quantity not measured this step (None) leaves its alert as it was.
        held = lambda name: name in self.active
        checks = {
            "entropy_low": (entropy < self.min_entropy if entropy is not None else held("entropy_low"),
                            f"entropy {entropy or 0:.3f} < {self.min_entropy}"),
            "kl_high": (kl > self.max_kl if kl is not None else held("kl_high"),
                        f"KL {kl or 0:.3f} > {self.max_kl}"),
            "reward_swing": (len(self.rewards) == self.window and swing > self.max_reward_range,
                             f"reward range {swing:.2f} over {self.window} steps > {self.max_reward_range}"),
        }
        active = {name for name, (on, _) in checks.items() if on}
        started = sorted(active - self.active)
        for name in started:
            self.episodes[name] += 1
        self.active = active
        return sorted(active), started, [checks[name][1] for name in started]

    def state_dict(self) -> dict:
        return {"rewards": list(self.rewards), "active": sorted(self.active),
                "episodes": dict(self.episodes)}

    def load_state_dict(self, state: dict) -> None:
        self.rewards = deque(state["rewards"], maxlen=self.window)
        self.active = set(state["active"])
        self.episodes = dict(state["episodes"])


def replay(rows: list, thresholds: dict = REPORT_002) -> list:
    """The alerts active on each of a run's metrics.jsonl rows after step 0 under these thresholds
    (default: report 002's), as the run would have logged them: the lab reads report 002's alarms
    on runs logged under other defaults."""
    monitor = StabilityMonitor(**thresholds)
    return [monitor.update(r.get("reward_mean"), r.get("entropy"), r.get("kl"))[0] for r in rows]


# ---- --rollback: undo a collapse once it is seen ----
#
# The detector bench (`python -m lab detectors`) found no signal the runs log that warns of a
# collapse before the held-out evaluation sees it, at a usable false-alarm rate. What can be done
# is to undo it: when an evaluation finds one answer for nearly every prompt (the lab's collapse)
# or an on-format rate half the best evaluation's (junk), or a step is non-finite, go back to the
# checkpoint of the best evaluation so far (model, optimizer, the controllers that shape training,
# the prompts' sampler) and go on with the lr cut.
# The step count goes on (the steps spent are spent), and so do the run's own statistics (report
# 001's count, the monitor's episodes): a rollback undoes the policy, not the record.

class Rollbacks:
    """--rollback N: the rollbacks taken (each: the step, why, the step gone back to, the lr's scale
    after it), and what a rollback restores and rescales. fmt: the task's on-format rate (FORMAT_KEY)."""
    RESTORED = ("kl_control", "entropy_control", "value_head", "rollout_policy")   # the controllers that shape training

    def __init__(self, most: int, at: float, cut: float, fmt: str):
        self.most, self.at, self.cut, self.fmt, self.taken = most, at, cut, f"eval_{fmt}", []

    def why(self, row: dict, stats: dict, best: dict | None) -> str | None:
        """Why this step rolls back, or None: a non-finite step; an evaluation on one answer (the lab's
        collapse); or one whose on-format rate is half the best evaluation's or less (report 001's
        crash, read on the held-out prompts: the run has left the format for junk)."""
        if stats.get("nonfinite"):
            return f"non-finite {' and '.join(stats['nonfinite'])}"
        one, fmt, top = row.get("eval_one_answer"), row.get(self.fmt), (best or {}).get(self.fmt)
        if one is not None and one >= self.at:
            return f"the held-out one-answer share is {one:.2f} (>= {self.at})"
        if fmt is not None and top and fmt <= top / 2:
            return f"the held-out {self.fmt[5:]} is {fmt:.2f}, at most half the best evaluation's {top:.2f}"
        return None

    def cannot(self, why: str | None, best: str | None) -> str | None:
        """Why a step that should roll back cannot (said once), or None."""
        if why and len(self.taken) >= self.most:
            return f"{why}; no rollback left (--rollback {self.most})"
        return f"{why}; no checkpoint to go back to yet" if why and not best else None

    def take(self, step: int, why: str, to: int, optimizer) -> dict:
        """Record one rollback and cut every param group's lr: its lr_scale (update.lr_at's lr times it,
        in train.step_hyper_params) carries the cut, whatever scale the restored optimizer held."""
        self.taken.append({"step": step, "why": why, "to": to, "lr_scale": self.cut ** (len(self.taken) + 1)})
        for group in optimizer.param_groups:
            group["lr_scale"] = group.get("lr_scale", 1.0) / group.get("rollback_scale", 1.0) * self.taken[-1]["lr_scale"]
            group["rollback_scale"] = self.taken[-1]["lr_scale"]
        return self.taken[-1]

    def state_dict(self) -> dict:
        return {"taken": list(self.taken)}

    def load_state_dict(self, state: dict) -> None:
        self.taken = list(state["taken"])


if __name__ == "__main__":
    print("false crash-after-update rate of a frozen policy, by on-format probability p and N rollouts:")
    ns = (6, 16, 24, 64, 128)
    print("   p  " + "".join(f"  N={n:<5d}" for n in ns))
    for p in (0.2, 0.4, 0.57, 0.6, 0.8, 0.95):
        print(f"{p:5.2f} " + "".join(f"  {false_collapse_rate(p, n):7.2%}" for n in ns))
    import random
    print("\na frozen policy, 20,000 steps at N = 6 (seed 1): flags raised, and the floor of the updated")
    print("step's own rate (the old estimator) and of CollapseCount's window, beside the exact expectation")
    for p in (0.03, 0.3, 0.57, 0.8):
        rng, count, own = random.Random(1), CollapseCount(6), 0.0
        for _ in range(20000):
            if count.before is not None:
                own += false_collapse_given(count.before, 6)
            count.update(True, sum(rng.random() < p for _ in range(6)) / 6)
        print(f"  p = {p:4.2f}: {count.collapses} flags; own rate {own:.0f}, window {count.floor:.0f}, "
              f"exact {19999 * false_collapse_rate(p, 6):.0f}")
