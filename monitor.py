"""Report 002's stability monitor: three alarms on the curves a run already logs.

    entropy_low    token-mean policy entropy < 0.5       (premature convergence)
    kl_high        KL to the reference > 0.5             (the policy ran away from it)
    reward_swing   max - min of the mean reward over the last 10 steps > 0.3   (oscillation)

The thresholds are report 002's, written for LLMs with vocabularies of ~150k tokens; each
is a flag of train.py (--alert-entropy, --alert-kl, --alert-reward-range, --alert-window).
An alert is *active* on every step its condition holds (metrics.jsonl lists the active ones
under `alerts`), and is printed once when an episode of it starts, not on every step.
A quantity that was not measured on a step (no update, no reference model) neither starts
nor ends an episode.
"""
from collections import deque


class StabilityMonitor:
    def __init__(self, min_entropy=0.5, max_kl=0.5, max_reward_range=0.3, window=10):
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
