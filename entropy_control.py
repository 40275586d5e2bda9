"""Adaptive entropy control: the entropy bonus's weight moved toward a target entropy.

A fixed entropy bonus (-c * H in grpo.policy_loss) is a guess made before the run: too small
and the policy still collapses onto one answer, too large and it babbles. Skywork-OR1 (2025;
TRL's `use_adaptive_entropy`) sets a target entropy H* instead and lets the weight follow the
measured one. After every update, with H the update's token-mean entropy,

    c <- min(c + delta, c_max)      if H <= H*        (entropy low: push harder)
    c <- max(c - delta, 0)          otherwise         (entropy fine: back off)

and a step applies the bonus only while the entropy is at or below the target:

    applied = c   if the last measured H <= H*,   else 0

so a run whose entropy stays above H* never feels the bonus, and one that collapses gets a
bonus that grows by delta a step until the entropy comes back. The first step applies none
(no entropy measured yet). `--entropy-target H*` turns it on, starting from `--entropy-coef`;
The fields entropy_coef_delta and AdaptiveEntropy.coef_max are delta and c_max (TRL's 0.005 and 1).
A step that takes no update (every advantage 0 and no bonus applied: train.why_no_update)
measures no entropy, and c waits for the next one. The controller's state is saved in every
checkpoint, so a resumed run continues it.
"""
import math
from dataclasses import dataclass, field


@dataclass
class Knobs:
    """The entropy bonus: its weight, a linear decay, or adaptive control toward a target entropy."""
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus weight (at the first step)", "min": 0,
                                                       "max": 100.0, "algos": ("grpo", "ppo")})
    entropy_coef_end: float = field(default=-1.0, metadata={"help": "entropy bonus at the last step, linear in "
                                    "between; -1 = no decay", "algos": ("grpo", "ppo")})
    entropy_target: float = field(default=0.0, metadata={
        "help": "adaptive entropy control (Skywork-OR1, TRL's use_adaptive_entropy): the bonus applies while the "
                "token entropy is at or below this, its weight moving from --entropy-coef by entropy_coef_delta "
                "a step; 0 = off", "min": 0, "algos": ("grpo", "ppo")})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "--entropy-target: how far the bonus's weight "
                                      "moves per step (> 0)", "max": 100.0, "needs": "entropy_target", "flag": False})


def problems(cfg):
    """(flag, why) for each setting of these knobs train.py refuses (cfg: the whole configuration)."""
    if cfg.entropy_coef_end != -1 and cfg.entropy_coef_end < 0:
        yield "entropy-coef-end", f"must be >= 0 (or -1 = no decay), got {cfg.entropy_coef_end}"
    if cfg.entropy_coef_delta <= 0:
        yield "entropy-coef-delta", f"must be > 0, got {cfg.entropy_coef_delta}"
    if cfg.entropy_target and cfg.entropy_coef > AdaptiveEntropy.coef_max:
        yield "entropy-coef", f"adaptive control keeps the weight at most {AdaptiveEntropy.coef_max}, got {cfg.entropy_coef}"
    if cfg.entropy_target and cfg.entropy_coef_end != -1:
        yield "entropy-coef-end", "a decay schedule and --entropy-target would both set the bonus's weight; give one"


@dataclass
class AdaptiveEntropy:
    """The entropy bonus's weight c, moved once per update toward the target entropy."""
    coef: float                      # c: the weight the bonus has when it applies
    target: float                    # H*: the token-mean entropy to keep (nats)
    delta: float = 0.005             # how far c moves per update
    coef_max: float = 1.0            # c never rises above this (nor falls below 0)
    last_entropy: float = math.inf   # the newest measured H (inf: none yet, no bonus)

    def applied(self) -> float:
        """The bonus weight this step's loss uses: c while the entropy is at or below H*, else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> float:
        """After an update that measured token-mean entropy H: move c; return the new c."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, 0.0)
        self.last_entropy = entropy
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.coef, self.last_entropy = state["coef"], state["last_entropy"]
