"""Every flag checked before any model loads: bad input ends with one line naming the flag, and
exit code 2 (running/config.py's parse_config calls `validate`). Also what a run folder, a
model folder and a seed must look like, and the default name of a run's folder.
"""
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
from pathlib import Path

import torch

import advantages
import kl
import tasks
from models import policy, pretrained
from running import checkpoint, distributed


class ConfigError(ValueError):
    pass


def validate(cfg):
    """Check every flag before any work starts; raise ConfigError naming the flag."""
    def need(ok, flag, what):
        if not ok:
            raise ConfigError(f"--{flag}: {what}")
    for f in dataclasses.fields(cfg):           # inf and nan pass every comparison below
        value = getattr(cfg, f.name)
        need(not isinstance(value, float) or math.isfinite(value), f.name.replace("_", "-"),
             f"must be a finite number, got {value}")
    need(0 <= cfg.seed <= MAX_SEED, "seed", f"must be in [0, {MAX_SEED}], got {cfg.seed}")
    need(0 <= cfg.sft_seed <= MAX_SEED, "sft-seed", f"must be in [0, {MAX_SEED}], got {cfg.sft_seed}")
    need(cfg.sft_lr >= 0, "sft-lr", f"must be > 0 (or 0 = the default), got {cfg.sft_lr}")
    problem = advantages.group_size_problem(cfg.k, cfg.norm)       # the estimator's own rule
    need(not problem, "k", problem)
    need(cfg.algo != "rce" or cfg.k >= 2, "k", f"--algo rce weighs the K samples of a prompt against each "
         f"other and needs --k >= 2, got {cfg.k}")
    need(cfg.algo != "rce" or (cfg.beta == 0 and cfg.kl_control == "fixed"), "beta",
         "--algo rce has no KL term (rce.py); leave --beta at 0 and --kl-control fixed")
    need(cfg.ratio_level == "token" or cfg.algo == "grpo", "ratio-level",
         f"sequence (GSPO) weighs a sequence advantage by a sequence ratio; --algo {cfg.algo} "
         + ("has per-token advantages (GAE)" if cfg.algo == "ppo" else "has no ratio (rce.py)"))
    for name, algos in USED_BY.items():            # a flag acts in every algorithm that accepts it
        default = default_of(cfg, name)
        need(cfg.algo in algos or getattr(cfg, name) == default, name.replace("_", "-"),
             f"only --algo {' and '.join(algos)} {'uses' if len(algos) == 1 else 'use'} it; --algo {cfg.algo} "
             f"would ignore it (leave it at {default!r})")
    need(not cfg.dynamic_sampling or cfg.algo == "grpo", "dynamic-sampling",
         f"drops the groups a group baseline gives advantage 0; --algo {cfg.algo} "
         + ("gives every token a baseline from its critic" if cfg.algo == "ppo" else "imitates them instead"))
    need(not cfg.dynamic_sampling or cfg.k >= 2, "dynamic-sampling", f"compares the K rewards of a group and "
         f"needs --k >= 2, got {cfg.k}")
    need(not cfg.dynamic_sampling or not distributed.launched(), "dynamic-sampling",
         "not under torchrun: ranks would sample different numbers of rounds (dynamic_sampling.py)")
    need(cfg.max_sampling_rounds >= 1, "max-sampling-rounds", f"must be >= 1, got {cfg.max_sampling_rounds}")
    need(cfg.max_sampling_seconds > 0, "max-sampling-seconds", f"must be > 0, got {cfg.max_sampling_seconds}")
    need(cfg.rce_temp_start > 0, "rce-temp-start", f"must be > 0, got {cfg.rce_temp_start}")
    need(cfg.rce_temp_end > 0, "rce-temp-end", f"must be > 0, got {cfg.rce_temp_end}")
    need(cfg.reward != "composite" or cfg.task == "dsl", "reward",
         f"composite is report 003's reward written for the dsl task, not --task {cfg.task}")
    need(cfg.reward not in ("sparse", "format") or cfg.task == "tools", "reward",
         f"{cfg.reward} is a reward of the tools task; the dsl task takes shaped (the default) or composite")
    need(cfg.early_stop_patience >= 0, "early-stop-patience", f"must be >= 0 (0 = off), got {cfg.early_stop_patience}")
    need(cfg.batch >= 1, "batch", f"must be >= 1, got {cfg.batch}")
    ranks = distributed.size()                      # torchrun's WORLD_SIZE; 1 for python train.py
    need(cfg.batch % ranks == 0, "batch", f"{cfg.batch} prompts per step do not split over {ranks} ranks "
         f"(torchrun's processes); give a multiple of {ranks}")
    need(cfg.steps >= 1, "steps", f"must be >= 1, got {cfg.steps}")
    need(0 <= cfg.threads <= 1024, "threads", f"must be 0 (the default) or a thread count, got {cfg.threads}")
    need(cfg.lr >= 0, "lr", f"must be > 0 (or 0 = the default), got {cfg.lr}")
    cfg.lr = cfg.lr or (2e-5 if cfg.model else 1e-3)
    policy_loss_checks(cfg, need)
    range_checks(cfg, need)
    need(not cfg.tensorboard or has_tensorboard(), "tensorboard",
         "needs the tensorboard package, an optional dependency: pip install tensorboard==2.21.0")
    need(0 <= cfg.clip_eps < 1, "clip-eps", f"must be in [0, 1), got {cfg.clip_eps}")
    need(0 <= cfg.clip_eps_high <= 100, "clip-eps-high", f"must be in [0, 100] (0 = --clip-eps), got {cfg.clip_eps_high}")
    need(cfg.adv_clip >= 0, "adv-clip", f"must be >= 0 (0 = off), got {cfg.adv_clip}")
    need(cfg.beta >= 0, "beta", f"must be >= 0, got {cfg.beta}")
    need(cfg.entropy_coef >= 0, "entropy-coef", f"must be >= 0, got {cfg.entropy_coef}")
    need(cfg.epochs >= 1, "epochs", f"must be >= 1, got {cfg.epochs}")
    need(cfg.mini_batch >= 0 and (cfg.mini_batch == 0 or cfg.n % cfg.mini_batch == 0), "mini-batch",
         f"must divide N = batch*k = {cfg.n} (or be 0), got {cfg.mini_batch}")
    need(cfg.mini_batch % ranks == 0, "mini-batch", f"must split over {ranks} ranks, got {cfg.mini_batch}")
    mini = (cfg.mini_batch or cfg.n) // ranks
    need(cfg.micro_batch >= 0 and (cfg.micro_batch == 0 or mini % cfg.micro_batch == 0), "micro-batch",
         f"must divide the mini-batch ({mini} sequences{' per rank' if ranks > 1 else ''}) (or be 0), "
         f"got {cfg.micro_batch}")
    need(cfg.target_kl >= 0, "target-kl", f"must be >= 0 (0 = off), got {cfg.target_kl}")
    need(0 <= cfg.min_lr <= cfg.lr, "min-lr", f"must be in [0, --lr], got {cfg.min_lr}")
    need(0 <= cfg.warmup_steps < cfg.steps, "warmup-steps", f"must be in [0, --steps), got {cfg.warmup_steps}")
    need(cfg.entropy_coef_end == -1 or cfg.entropy_coef_end >= 0, "entropy-coef-end",
         f"must be >= 0 (or -1 = no decay), got {cfg.entropy_coef_end}")
    need(cfg.kl_control == "fixed" or cfg.beta > 0, "kl-coef",
         f"adaptive --kl-control {cfg.kl_control} needs a starting --kl-coef > 0")
    lo, hi = kl.KLController.CLAMP[cfg.kl_control]
    need(cfg.kl_control == "fixed" or lo <= cfg.beta <= hi, "kl-coef",
         f"--kl-control {cfg.kl_control} keeps beta in [{lo}, {hi}]; a starting --kl-coef {cfg.beta} is outside it")
    need(cfg.kl_target > 0, "kl-target", f"must be > 0, got {cfg.kl_target}")
    need(cfg.kl_horizon > 0, "kl-horizon", f"must be > 0, got {cfg.kl_horizon}")
    # Ziegler's beta *= 1 + e * N / horizon with e down to -0.2 turns beta negative unless horizon > 0.2 N
    need(cfg.kl_control != "proportional" or cfg.kl_horizon > 0.2 * cfg.n, "kl-horizon",
         f"must be above 0.2 * N = {0.2 * cfg.n:g} (N = --batch x --k): the step beta *= 1 + e * N / horizon, "
         f"e down to -0.2, would turn beta negative; got {cfg.kl_horizon:g}")
    need(0 < cfg.kl_target_min < cfg.kl_target_max, "kl-target-min",
         f"need 0 < --kl-target-min < --kl-target-max, got {cfg.kl_target_min} and {cfg.kl_target_max}")
    need(cfg.critic_lr >= 0, "critic-lr", f"must be > 0 (or 0 = --lr), got {cfg.critic_lr}")
    for flag, given in (("critic", cfg.critic != "shared"), ("critic-lr", cfg.critic_lr > 0)):
        need(cfg.algo == "ppo" or not given, flag, f"PPO's critic; --algo {cfg.algo} has none")
    need(cfg.vf_coef >= 0, "vf-coef", f"must be >= 0, got {cfg.vf_coef}")
    need(0 <= cfg.value_clip <= 1e6, "value-clip", f"must be in [0, 1e6] (0 = off), got {cfg.value_clip}")
    need(0 <= cfg.gamma <= 1, "gamma", f"must be in [0, 1], got {cfg.gamma}")
    need(0 <= cfg.lam <= 1, "lam", f"must be in [0, 1], got {cfg.lam}")
    need(cfg.max_grad_norm >= 0, "max-grad-norm", f"must be >= 0 (0 = off), got {cfg.max_grad_norm}")
    need(1e-3 <= cfg.temperature <= 1e3, "temperature", f"must be in [0.001, 1000] (logits / T overflow "
         f"float32 past it), got {cfg.temperature}")
    need(cfg.max_turns >= 1, "max-turns", f"must be >= 1, got {cfg.max_turns}")
    top = tasks.TASKS[cfg.task].MAX_DIFFICULTY
    need(1 <= cfg.difficulty <= top, "difficulty", f"must be in [1, {top}] for --task {cfg.task}, got "
         f"{cfg.difficulty}" if top > 1 else f"--task {cfg.task} has one difficulty (1), got {cfg.difficulty}")
    need(not cfg.curriculum or cfg.difficulty >= 2, "curriculum", f"moves from difficulty 1 up to --difficulty; "
         f"give --difficulty 2 or more (it is {cfg.difficulty})")
    need(not cfg.curriculum or cfg.steps >= cfg.difficulty, "curriculum", f"needs a step per difficulty at "
         f"least: --steps {cfg.steps} < --difficulty {cfg.difficulty}")
    need(0 <= cfg.sft_difficulty <= top, "sft-difficulty", f"must be in [1, {top}] for --task {cfg.task} (or 0 = "
         f"--difficulty), got {cfg.sft_difficulty}")
    cfg.sft_difficulty = cfg.sft_difficulty or cfg.difficulty
    need(cfg.reward_clip >= 0, "reward-clip", f"must be >= 0 (0 = off), got {cfg.reward_clip}")
    need(cfg.max_new_tokens >= 0, "max-new-tokens", f"must be >= 1 (or 0 = the default), got {cfg.max_new_tokens}")
    need(cfg.eval_every >= 1, "eval-every", f"must be >= 1, got {cfg.eval_every}")
    need(cfg.eval_samples >= 1, "eval-samples", f"must be >= 1, got {cfg.eval_samples}")
    need(cfg.eval_prompts >= 0, "eval-prompts", f"must be >= 1 (or 0 = all), got {cfg.eval_prompts}")
    need(cfg.hidden >= 4 and cfg.hidden % 4 == 0, "hidden", f"must be a positive multiple of 4, got {cfg.hidden}")
    need(cfg.layers >= 1, "layers", f"must be >= 1, got {cfg.layers}")
    need(cfg.sft_steps >= -1, "sft-steps", f"must be >= 0 (or -1 = auto), got {cfg.sft_steps}")
    need(cfg.save_every >= 0, "save-every", f"must be >= 0 (0 = off), got {cfg.save_every}")
    need(cfg.keep_checkpoints >= 0, "keep-checkpoints", f"must be >= 0 (0 = all), got {cfg.keep_checkpoints}")
    need(cfg.max_skips >= 0, "max-skips", f"must be >= 0, got {cfg.max_skips}")
    need(cfg.collective_timeout > 0, "collective-timeout", f"must be > 0 seconds, got {cfg.collective_timeout}")
    need(cfg.alert_entropy >= 0, "alert-entropy", f"must be >= 0, got {cfg.alert_entropy}")
    need(cfg.alert_kl > 0, "alert-kl", f"must be > 0, got {cfg.alert_kl}")
    need(cfg.alert_reward_range > 0, "alert-reward-range", f"must be > 0, got {cfg.alert_reward_range}")
    need(cfg.alert_window >= 2, "alert-window", f"must be >= 2, got {cfg.alert_window}")
    need(cfg.device != "cuda" or torch.cuda.is_available(), "device", "cuda asked for but no GPU is visible")
    need(not cfg.compile or (cfg.device != "cpu" and torch.cuda.is_available()), "compile",
         "needs a GPU (--device auto or cuda, with CUDA visible)")
    if cfg.model in pretrained.NAMED:
        cfg.model_cache = cfg.model_cache or str(pretrained.default_cache())
        need(writable(Path(cfg.model_cache)), "model-cache", f"cannot create or write to the folder {cfg.model_cache!r}")
    elif cfg.model:
        problem = validate_model(cfg.model)
        need(not problem, "model", f"{cfg.model!r}: {problem}")
    cfg.cache_dir = cfg.cache_dir or str(policy.CACHE)
    need(writable(Path(cfg.cache_dir)), "cache-dir", f"cannot create or write to the folder {cfg.cache_dir!r}")
    need(not (cfg.overwrite and cfg.resume), "overwrite", "--overwrite replaces a run, --resume continues it: not both")
    if cfg.init_from and not cfg.resume:
        problem = init_from_problem(cfg)
        need(not problem, "init-from", f"{cfg.init_from!r}: {problem}")
    if not distributed.is_main():        # torchrun: rank 0 alone checks, names and writes the folder
        cfg.out = cfg.out or default_out(cfg)
        return cfg
    if not cfg.out:                      # the default name, or NAME-2, -3 ...: the first folder not there yet,
        base = default_out(cfg)          # claimed by creating it (one mkdir succeeds: two runs started
        for name in (base if i == 1 else f"{base}-{i}" for i in itertools.count(1)):   # together get two names)
            try:
                Path(name).mkdir(parents=True)
            except FileExistsError:
                continue
            except OSError:              # not writable: said below, naming the folder
                pass
            cfg.out = name
            break
    out = Path(cfg.out)
    need(cfg.resume or cfg.overwrite or not holds_run(out), "out",
         f"{cfg.out!r} holds a run already ({holds_run(out)}); --resume {cfg.out} continues it, "
         f"--overwrite replaces it, another --out keeps it")
    # the one side effect of validation: the run's folder
    need(writable(out), "out", f"cannot create or write to the folder {str(out)!r}")
    return cfg


# Flags that only some algorithms read (the step of another would silently ignore them): set
# to anything but their default with another --algo, they are refused. --ratio-level,
# --dynamic-sampling, --critic, --critic-lr and RCE's --beta have checks of their own above,
# which say why; --kl-estimator and --kl-in act only with --beta > 0, which RCE refuses.
# each 2025-26 objective's own knob, and the objective that reads it (surrogates.py)
KNOB_OF = {"dual_clip_c": ("dual-clip",), "cispo_max": ("cispo",), "sapo_tau_pos": ("sapo",),
           "sapo_tau_neg": ("sapo",), "gmpo_delta": ("gmpo",), "cov_ratio": ("clip-cov", "kl-cov"),
           "kl_cov_coef": ("kl-cov",)}


def new_tokens(cfg) -> int:
    """--max-new-tokens, 0 resolved: a real tokenizer spends more tokens on a tool call."""
    return cfg.max_new_tokens or (64 if cfg.model and cfg.task == "tools" else 24)


def completion_limit(cfg) -> int:
    """The longest completion in policy tokens: one turn's limit, times the turns of a tool
    episode (one more per benchmark beyond the first)."""
    return new_tokens(cfg) * (cfg.max_turns + cfg.difficulty - 1 if cfg.task == "tools" else 1)


# Values past which a run cannot mean anything: each passed the sign checks, made every step
# non-finite (exp or a product overflowing float32) or exhausted memory, and the run said "done".
# flag -> (lowest, highest), either None for no bound; 0 stays allowed where it means "off" or
# "the default" (below). The bounds are far outside any setting the anchors or the reports use.
RANGES = {"beta": (None, 100.0), "entropy_coef": (None, 100.0), "vf_coef": (None, 100.0),
          "kl_cov_coef": (None, 100.0), "entropy_coef_max": (None, 100.0), "entropy_coef_delta": (None, 100.0),
          "sapo_tau_pos": (1e-3, 1e3), "sapo_tau_neg": (1e-3, 1e3), "gmpo_delta": (None, 20.0),
          "cispo_max": (1.0, 1e4), "dual_clip_c": (None, 1e4), "rollout_c_max": (None, 1e4),
          "rce_temp_start": (1e-3, 1e3), "rce_temp_end": (1e-3, 1e3),
          "rollout_temperature": (1e-3, 1e3), "collective_timeout": (1.0, 86400.0),
          "k": (None, 4096), "batch": (None, 4096), "hidden": (None, 8192), "layers": (None, 256),
          "eval_samples": (None, 1000), "log_samples": (0, 100000), "rollout_stale": (None, 64)}
ZERO_MEANS_DEFAULT = ("rollout_temperature",)


def range_checks(cfg, need) -> None:
    """RANGES, and --rollout-stale below --steps (a sampler never staler than the run is long)."""
    for name, (lo, hi) in RANGES.items():
        value = getattr(cfg, name)
        if value == 0 and name in ZERO_MEANS_DEFAULT:
            continue
        need((lo is None or value >= lo) and (hi is None or value <= hi), name.replace("_", "-"),
             f"must be in [{'...' if lo is None else f'{lo:g}'}, {hi:g}], got {value:g}: past it the run "
             f"cannot mean anything (float32 overflows, or memory runs out)"
             if name != "cispo_max" else f"must be in [1, {hi:g}] (the cap is on the ratio, which is 1 "
             f"on-policy; below 1 it scales every token's gradient down), got {value:g}")
    need(cfg.rollout_stale < cfg.steps, "rollout-stale", f"{cfg.rollout_stale} updates old can never be "
         f"reached in a run of --steps {cfg.steps} (and each step would keep a copy of the weights)")


def policy_loss_checks(cfg, need) -> None:
    """--policy-loss and its knobs: positive values; a knob only with its objective; the
    objectives that take a token ratio not with GSPO's sequence ratio; GMPO's one weight per
    sequence not with PPO's per-token advantages."""
    for name, losses in KNOB_OF.items():
        flag, value = name.replace("_", "-"), getattr(cfg, name)
        default = default_of(cfg, name)
        need(value > (1 if name == "dual_clip_c" else 0), flag,
             f"must be > {1 if name == 'dual_clip_c' else 0}, got {value}")
        need(cfg.policy_loss in losses or value == default, flag,
             f"only --policy-loss {' and '.join(losses)} {'reads' if len(losses) == 1 else 'read'} it; "
             f"--policy-loss {cfg.policy_loss} would ignore it")
    need(cfg.cov_ratio <= 1, "cov-ratio", f"is a share of the tokens, at most 1, got {cfg.cov_ratio}")
    for name in ("clip_cov_lb", "clip_cov_ub"):
        default = default_of(cfg, name)
        need(cfg.policy_loss == "clip-cov" or getattr(cfg, name) == default, name.replace("_", "-"),
             f"only --policy-loss clip-cov reads it; --policy-loss {cfg.policy_loss} would ignore it")
    need(cfg.clip_cov_lb < cfg.clip_cov_ub, "clip-cov-lb", f"must be below --clip-cov-ub ({cfg.clip_cov_ub}), "
         f"got {cfg.clip_cov_lb}: no token could be chosen")
    need(cfg.overlong_buffer == 0 or 0 < cfg.overlong_buffer < completion_limit(cfg), "overlong-buffer",
         f"must be in [0, the completion limit {completion_limit(cfg)}) (0 = off), got {cfg.overlong_buffer}")
    entropy_control_checks(cfg, need)
    mismatch_checks(cfg, need)
    need(0 < cfg.top_entropy_quantile <= 1, "top-entropy-quantile",
         f"is a share of the tokens, in (0, 1] (1 = every token), got {cfg.top_entropy_quantile}")
    need(cfg.policy_loss == "clip" or cfg.ratio_level == "token", "policy-loss",
         f"{cfg.policy_loss} weighs each token by its own ratio; --ratio-level sequence is GSPO's clip, "
         f"not a ratio the others take")
    knob = "/--".join(name.replace("_", "-") for name, losses in KNOB_OF.items() if cfg.policy_loss in losses)
    for name in ("clip_eps", "clip_eps_high"):
        default = default_of(cfg, name)
        need(cfg.policy_loss in ("clip", "dual-clip", "clip-cov") or getattr(cfg, name) == default, name.replace("_", "-"),
             f"bounds PPO's clip; --policy-loss {cfg.policy_loss} has its own knob (--{knob})")
    need(cfg.policy_loss != "gmpo" or cfg.algo == "grpo", "policy-loss",
         f"gmpo weighs a sequence by one advantage; --algo {cfg.algo} gives "
         + ("one per token (GAE)" if cfg.algo == "ppo" else "no ratio at all"))


def default_of(cfg, name: str):
    """The default of a configuration field (what the command line gives when the flag is absent)."""
    return next(f.default for f in dataclasses.fields(cfg) if f.name == name)


def entropy_control_checks(cfg, need) -> None:
    """--entropy-target and its knobs: non-negative values; the knobs only with a target; no
    decay schedule with it (both would set the same weight)."""
    need(cfg.entropy_target >= 0, "entropy-target", f"must be >= 0 (0 = off), got {cfg.entropy_target}")
    need(cfg.entropy_coef_delta > 0, "entropy-coef-delta", f"must be > 0, got {cfg.entropy_coef_delta}")
    need(cfg.entropy_target == 0 or cfg.entropy_coef_max >= cfg.entropy_coef, "entropy-coef-max",
         f"must be >= --entropy-coef {cfg.entropy_coef}, got {cfg.entropy_coef_max}")
    for name in ("entropy_coef_delta", "entropy_coef_max"):
        need(cfg.entropy_target > 0 or getattr(cfg, name) == default_of(cfg, name), name.replace("_", "-"),
             "only adaptive entropy control reads it; give --entropy-target too")
    need(cfg.entropy_target == 0 or cfg.entropy_coef_end == -1, "entropy-coef-end",
         "a decay schedule and --entropy-target would both set the bonus's weight; give one")


def mismatch_checks(cfg, need) -> None:
    """The rollout/training mismatch's flags: sane values; a correction's knobs only with it;
    the sampler's log-probs only where they are recorded (the single-turn task)."""
    need(cfg.rollout_stale >= 0, "rollout-stale", f"must be >= 0 updates, got {cfg.rollout_stale}")
    need(cfg.rollout_temperature >= 0, "rollout-temperature", f"must be >= 0 (0 = --temperature), got "
         f"{cfg.rollout_temperature}")
    need(cfg.rollout_c_max > 1, "rollout-c-max", f"must be > 1 (a weight of 1 is on-policy), got {cfg.rollout_c_max}")
    need(0 < cfg.rollout_c_min < 1, "rollout-c-min", f"must be in (0, 1), got {cfg.rollout_c_min}")
    for name in ("rollout_correction_level", "rollout_c_min", "rollout_c_max"):
        default = default_of(cfg, name)
        need(cfg.rollout_correction != "none" or getattr(cfg, name) == default, name.replace("_", "-"),
             "only --rollout-correction tis or mis reads it")
    need(cfg.rollout_correction == "mis" or cfg.rollout_c_min == default_of(cfg, "rollout_c_min"), "rollout-c-min",
         f"only --rollout-correction mis drops tokens below a floor; {cfg.rollout_correction} would ignore it")
    need(cfg.task != "tools" or not cfg.rollout_logprobs, "task",
         "the tool task's multi-turn episodes do not record the sampler's log-probs that --rollout-*/--log-mismatch "
         "need (mismatch.py is built for --task dsl)")


USED_BY = {
    "norm": ("grpo",), "unbiased": ("grpo",), "adv_clip": ("grpo",),     # GRPO's advantages; PPO: GAE
    "clip_eps": ("grpo", "ppo"), "clip_eps_high": ("grpo", "ppo"),        # RCE has no ratio
    "policy_loss": ("grpo", "ppo"), "top_entropy_quantile": ("grpo", "ppo"), "overlong_buffer": ("grpo",),
    "entropy_target": ("grpo", "ppo"), "mask_truncated": ("grpo", "ppo"),
    "rollout_correction": ("grpo", "ppo"),                                # RCE has no ratio to correct
    "loss_agg": ("grpo", "ppo"), "target_kl": ("grpo", "ppo"),            # RCE: its own mean, no approx_kl
    "entropy_coef": ("grpo", "ppo"), "entropy_coef_end": ("grpo", "ppo"), # RCE's loss has no entropy term
    "gamma": ("ppo",), "lam": ("ppo",), "vf_coef": ("ppo",), "value_clip": ("ppo",),   # the critic's
    "rce_temp_start": ("rce",), "rce_temp_end": ("rce",),
}


RUN_FILES = ("metrics.jsonl", "samples.jsonl", "summary.json", "config.json", "curves.png", "checkpoints",
             "tensorboard")


def has_tensorboard() -> bool:
    """Whether the optional tensorboard package is installed (--tensorboard needs it)."""
    return importlib.util.find_spec("tensorboard") is not None


def holds_run(folder: Path) -> str | None:
    """The files of a run in folder ('metrics.jsonl, checkpoints'), or None when it holds none."""
    found = [name for name in RUN_FILES if (Path(folder) / name).exists()]
    return ", ".join(found) or None


MAX_SEED = 2 ** 32 - 1          # seed * 100003 + step must stay inside a torch.Generator's 64 bits
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
           "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def writable(folder: Path) -> bool:
    """Create folder (and its parents) if needed; True when we can write into it."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def saved_fields(run_dir: Path, config_class) -> dict:
    """The fields of config_class (Config) a run was made with (its config.json, less ran_on
    and any field this version no longer has); OSError or ValueError when it cannot be read."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    if not isinstance(saved, dict):
        raise ValueError("config.json is not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    out = {k: v for k, v in saved.items() if k in fields}
    for name, value in out.items():                 # a hand-edited file: a number where a word goes
        want = type(fields[name].default)
        if not (isinstance(value, want) or (want is float and isinstance(value, int) and not isinstance(value, bool))) \
                or (want is int and isinstance(value, bool)):
            raise ValueError(f"config.json's {name!r} is {value!r}, not a {want.__name__}")
    return out


SAME_MODEL = ("task", "model", "hidden", "layers")     # what a run started --init-from another must share


def init_from_problem(cfg) -> str | None:
    """Why --init-from cannot start this run, or None: it needs a checkpoint, and the run
    that wrote it must have had the same task and model (its config.json)."""
    ckpt = checkpoint.starting_point(Path(cfg.init_from))
    if ckpt is None:
        return "no checkpoint in it (the first stage needs --save-every N, or --early-stop-patience P)"
    if pretrained.cut_short(ckpt):
        return f"its checkpoint {ckpt.name} is damaged: {pretrained.cut_short(ckpt)}"
    try:
        json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"its checkpoint {ckpt.name} is damaged: its config.json does not read ({type(e).__name__})"
    if checkpoint.is_busy(checkpoint.run_dir_of(ckpt)):
        return "that run is still running (its folder is locked): start from it once it has ended"
    try:
        saved = saved_fields(checkpoint.run_dir_of(ckpt), type(cfg))
    except (OSError, ValueError):
        return f"cannot read {str(checkpoint.run_dir_of(ckpt) / 'config.json')!r}"
    for name in SAME_MODEL:
        if saved.get(name) != getattr(cfg, name):
            return (f"that run's --{name} was {saved.get(name)!r}, this run's is {getattr(cfg, name)!r}; "
                    f"a run starts only from weights of the same task and model")
    return None


def validate_model(name: str) -> str | None:
    """Why --model name cannot be used, or None: a named model, a loadable folder, or
    something of the form of a hub id (whether the hub has it is known only when asked)."""
    if name in pretrained.NAMED:
        return None
    if Path(name).exists():
        return model_folder_problem(Path(name))
    return pretrained.not_a_hub_id(name)


def model_folder_problem(path: Path) -> str | None:
    """Why a --model folder cannot be loaded, or None: it needs a config.json that parses,
    weights, and a tokenizer."""
    if not path.is_dir():
        return "not a folder"
    try:
        cfg = json.loads((path / "config.json").read_text())
    except OSError:
        return "no readable config.json"
    except ValueError as e:
        return f"config.json is not valid JSON ({e})"
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return "config.json names no model_type"
    if not any((path / name).is_file() for name in WEIGHTS):
        return f"no weights (none of {', '.join(WEIGHTS)})"
    if pretrained.cut_short(path):
        return pretrained.cut_short(path)
    if not any((path / name).is_file() for name in TOKENIZER):
        return f"no tokenizer (none of {', '.join(TOKENIZER)})"
    return None


def default_out(cfg) -> str:
    """runs/NAME, NAME made of what sets the run apart: the task, the model and where it started,
    the objective, the sampler, then the algorithm, K, B, the estimator, lr and seed (the main
    job: runs/k8_b8_global_lr0.001_s0)."""
    task = f"tools_{cfg.reward}_" if cfg.task == "tools" else ""
    if cfg.difficulty > 1:
        task += f"d{cfg.difficulty}_" + ("curriculum_" if cfg.curriculum else "")
    marks = [re.sub(r"[^A-Za-z0-9.-]+", "-", Path(cfg.model).name) if cfg.model else "",
             "from-" + re.sub(r"[^A-Za-z0-9.-]+", "-", Path(cfg.init_from).name) if cfg.init_from else "",
             cfg.policy_loss if cfg.policy_loss != "clip" else "", "gspo" if cfg.ratio_level == "sequence" else "",
             f"e{cfg.epochs}" if cfg.epochs > 1 else "",
             f"rollout-{cfg.rollout_dtype}" if cfg.rollout_dtype != "same" else "",
             f"stale{cfg.rollout_stale}" if cfg.rollout_stale else ""]
    task += "".join(m + "_" for m in marks if m)
    if cfg.algo in ("ppo", "rce"):
        return f"runs/{task}{cfg.algo}_k{cfg.k}_b{cfg.batch}_lr{cfg.lr:g}_s{cfg.seed}"
    return f"runs/{task}k{cfg.k}_b{cfg.batch}_{cfg.norm}_lr{cfg.lr:g}_s{cfg.seed}"
