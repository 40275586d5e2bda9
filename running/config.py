"""The run's configuration: one dataclass, the single source of truth, and the CLI built from it.

Every field is a flag (`k` -> `--k`, `max_grad_norm` -> `--max-grad-norm`) whose help is the
field's own one-line documentation; `python train.py --help` lists them. Every flag is
checked before any model loads (running/checks.py): bad input ends with one line naming the
flag, and exit code 2.

`--resume DIR` continues the run in DIR with the configuration saved there (config.json);
only --steps (to extend the run) and --quiet may be given with it.
"""
import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import advantages
from running import checkpoint
from running import distributed
import grpo
import kl
import mismatch
import ppo
import rce
from running import schedules
import surrogates
from running import checks
from running.checks import ConfigError, default_out, saved_fields, validate  # noqa: F401 (default_out: for importers)
from running.checks import completion_limit, new_tokens  # noqa: F401 (new_tokens: for importers)
import tasks


def opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


# The update's defaults are written once, in the lessons' typed objects; the flags below
# that set them take their defaults from there (GRPO.k, PPO.lam, ...).
GRPO, PPO = grpo.HyperParams, ppo.PPOParams


@dataclass
class Config:
    task: str = opt("dsl", "the task: report 001's workflow DSL, or report 000's tool calling (tasks/tool_task.py)",
                    choices=tuple(tasks.TASKS))
    reward: str = opt("shaped", "tools task: sparse +-1, report 000's shaped reward, or the format reward; "
                      "dsl task: shaped (report 001's 1 / 0.2 / 0) or composite (report 003's: rewards.py)",
                      choices=("sparse", "shaped", "format", "composite"))
    reward_clip: float = opt(0.0, "tools task: clamp the shaped reward to [-c, c]; 0 = off")
    drop_process_reward: bool = opt(False, "tools task: leave the tool's process reward out (report 000's bug)")
    max_turns: int = opt(3, "tools task: policy turns per episode (--max-new-tokens each), one more per "
                         "benchmark beyond the first (--difficulty)")
    difficulty: int = opt(1, "tools task: benchmarks each episode asks about (1 to 3); the answer must report "
                          "every one's setting and value (report 000's long ground truth)")
    curriculum: bool = opt(False, "tools task: train from difficulty 1 up to --difficulty in equal phases "
                           "(report 000's short-to-long curriculum: schedules.difficulty_at); evaluation "
                           "stays at --difficulty")
    algo: str = opt("grpo", "the algorithm: GRPO (no critic), PPO (value head + GAE) or RCE (report 003's "
                    "reward-weighted cross-entropy: rce.py)", choices=("grpo", "ppo", "rce"))
    rce_temp_start: float = opt(1.7, "RCE: softmax temperature tau of the reward weights at the first step")
    rce_temp_end: float = opt(0.5, "RCE: tau at the last step, linear in between (report 003: 1.7 -> 0.5)")
    # the batch
    k: int = opt(GRPO.k, "samples per prompt (K); group norms need K >= 2")
    batch: int = opt(8, "prompts per step (B); N = B*K sequences per step")
    norm: str = opt(GRPO.norm, "advantage estimator", choices=advantages.NORMS)
    unbiased: bool = opt(GRPO.unbiased, "Bessel-corrected std in the advantage (TRL/verl habit; K=2 -> ±0.71)")
    adv_clip: float = opt(0.0, "clamp advantages to [-c, c]; 0 = off")
    # the update
    steps: int = opt(150, "training steps (one batch of rollouts each)")
    lr: float = opt(0.0, "AdamW learning rate; 0 = the default: 1e-3 for the tiny model (it needs a large one), "
                    "2e-5 for a real one (1e-3 wrecks SmolLM2 in one step)")
    clip_eps: float = opt(GRPO.clip_low, "PPO clip range: ratio kept in [1-eps, 1+eps_high]")
    clip_eps_high: float = opt(0.0, "upper clip range (DAPO's clip-higher); 0 = same as --clip-eps")
    ratio_level: str = opt(GRPO.ratio_level, "the importance ratio: per token (PPO, GRPO) or per sequence (GSPO: the "
                           "geometric mean of its token ratios; then, unless given, its paper's --clip-eps "
                           "3e-4 --clip-eps-high 4e-4 --loss-agg seq-mean-token-mean)", choices=grpo.RATIO_LEVELS)
    policy_loss: str = opt(GRPO.policy_loss, "the policy-gradient objective: PPO's clip, or a 2025-26 one in its "
                           "place: dual-clip, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov (surrogates.py)", choices=surrogates.POLICY_LOSSES)
    dual_clip_c: float = opt(GRPO.dual_clip_c, "--policy-loss dual-clip: a negative-advantage token's loss at most -c*A (c > 1)")
    cispo_max: float = opt(GRPO.cispo_max, "--policy-loss cispo: the cap of the stopped importance weight (> 0)")
    sapo_tau_pos: float = opt(GRPO.sapo_tau_pos, "--policy-loss sapo: the gate's temperature for A > 0 (> 0)")
    sapo_tau_neg: float = opt(GRPO.sapo_tau_neg, "--policy-loss sapo: the gate's temperature for A < 0 (> 0)")
    gmpo_delta: float = opt(GRPO.gmpo_delta, "--policy-loss gmpo: each token's log-ratio clipped to [-delta, delta] "
                            "(> 0); unless given, --loss-agg seq-mean-token-mean")
    cov_ratio: float = opt(GRPO.cov_ratio, "--policy-loss clip-cov / kl-cov: the share of tokens, by covariance of "
                           "advantage and log-prob, they detach / penalise (> 0, <= 1)")
    clip_cov_lb: float = opt(GRPO.clip_cov_lb, "--policy-loss clip-cov: a candidate's covariance above this ...")
    clip_cov_ub: float = opt(GRPO.clip_cov_ub, "--policy-loss clip-cov: ... and below this")
    kl_cov_coef: float = opt(GRPO.kl_cov_coef, "--policy-loss kl-cov: the weight of |log ratio| on the chosen tokens (> 0)")
    top_entropy_quantile: float = opt(GRPO.top_entropy_quantile, "the policy-gradient loss only on the tokens whose "
                                      "entropy is in this top share (0, 1] of a micro-batch's (0.2: the 80/20 rule; TRL's name)")
    overlong_buffer: int = opt(GRPO.overlong_buffer, "DAPO's overlong shaping: a completion longer than the token "
                               "limit minus this many tokens loses up to 1 reward, linearly (rewards.overlong_penalty); 0 = off")
    lr_schedule: str = opt("constant", "learning-rate schedule after the warm-up", choices=schedules.LR_SCHEDULES)
    min_lr: float = opt(0.0, "the learning rate that linear/cosine decay to at the last step")
    warmup_steps: int = opt(0, "steps of linear learning-rate warm-up from 0")
    entropy_coef: float = opt(GRPO.entropy_coef, "entropy bonus weight (at the first step)")
    entropy_coef_end: float = opt(-1.0, "entropy bonus at the last step, linear in between; -1 = no decay")
    entropy_target: float = opt(0.0, "adaptive entropy control (Skywork-OR1, TRL's use_adaptive_entropy): the bonus "
                                "applies while the token entropy is at or below this, its weight moving from "
                                "--entropy-coef by --entropy-coef-delta a step (entropy_control.py); 0 = off")
    entropy_coef_delta: float = opt(0.005, "--entropy-target: how far the bonus's weight moves per step (> 0)")
    entropy_coef_max: float = opt(1.0, "--entropy-target: the bonus's weight never rises above this")
    # the rollout/training mismatch (mismatch.py)
    rollout_dtype: str = opt("same", "sample from a copy of the policy in this dtype (bf16: as vLLM does); same = "
                             "the policy itself", choices=("same", *mismatch.DTYPES))
    rollout_stale: int = opt(0, "sample from the policy's weights of this many updates ago (asynchronous rollouts)")
    rollout_temperature: float = opt(0.0, "sample at this temperature while training scores at --temperature; "
                                     "0 = the same")
    rollout_correction: str = opt("none", "correct the mismatch: tis (truncated IS, min(w, C_max)) or mis "
                                  "(masked IS / ICEPOP: w outside [C_min, C_max] drops its token), "
                                  "w = pi_old / pi_sampler", choices=mismatch.CORRECTIONS)
    rollout_correction_level: str = opt("token", "the correction's weight per token, or per sequence (the "
                                        "geometric mean of its tokens')", choices=mismatch.LEVELS)
    rollout_c_min: float = opt(GRPO.rollout_c_min, "--rollout-correction mis: a weight below this drops its token")
    rollout_c_max: float = opt(GRPO.rollout_c_max, "--rollout-correction tis: the cap; mis: a weight above this "
                               "drops its token (> 1)")
    log_mismatch: bool = opt(False, "record the sampler's log-probs and log the mismatch (sampling/*) even "
                             "with no mismatch made (the null: float rounding alone)")
    mask_truncated: bool = opt(False, "DAPO's overlong filtering: completions cut at the token limit (no EOS) are "
                               "left out of the loss (TRL's mask_truncated_completions)")
    loss_agg: str = opt(GRPO.loss_agg, "how per-token losses are averaged", choices=grpo.AGGREGATIONS)
    epochs: int = opt(GRPO.epochs, "passes over each batch")
    mini_batch: int = opt(0, "sequences per optimizer step (over all ranks under torchrun); 0 = all N "
                             "(one step per epoch)")
    micro_batch: int = opt(0, "sequences per forward/backward (gradient accumulation), per rank under "
                              "torchrun; 0 = the whole mini-batch (this rank's share of it)")
    target_kl: float = opt(GRPO.target_kl, "stop an update's epochs once approx_kl passes this (CleanRL); 0 = off")
    max_grad_norm: float = opt(1.0, "clip the global gradient norm; 0 = off")
    fast: bool = opt(GRPO.fast, "the fast path: old log-probs from the update's own forward (GRPO, one update "
                            "per batch), micro-batches sorted by length and cut to their longest sequence")
    compile: bool = opt(False, "CUDA: generate with a static KV cache that torch.compile specialises on")
    no_shared_prefix: bool = opt(False, "encode a group's prompt once per sequence, as a plain forward does, "
                                 "not once per group (shared_prefix.py: the same numbers, for comparison)")
    # KL to the reference (kl.py)
    beta: float = opt(GRPO.beta, "KL coefficient (at the start, if adaptive); 0 with fixed control = no reference model",
                      aliases=("--kl-coef",))
    kl_control: str = opt("fixed", "how beta moves: fixed, ratio (report 002), range (report 003's code: x1.5 / "
                                   "/1.5 on the update's KL between old and new policy) or proportional (Ziegler et al., as "
                                   "TRL/verl/OpenRLHF)", choices=kl.CONTROLS)
    kl_target: float = opt(0.01, "ratio and proportional control: the KL target")
    kl_horizon: float = opt(10000.0, "proportional control: beta *= 1 + clip(KL/target - 1, +-0.2) * N / horizon")
    kl_target_min: float = opt(0.01, "range control: lower beta below this KL")
    kl_target_max: float = opt(0.1, "range control: raise beta above this KL")
    kl_estimator: str = opt("auto", "per-token KL estimator; auto = k1 in the reward, k3 in the loss (kl.py: "
                            "in the reward k3's pull nearly cancels)", choices=("auto", *kl.ESTIMATORS))
    kl_in: str = opt("auto", "where the KL goes: loss (GRPO's habit), reward (PPO's); auto = by --algo",
                     choices=("auto", "loss", "reward"))
    # PPO's critic (ppo.py)
    critic: str = opt("shared", "PPO: a value head on the policy's trunk (shared), or a network of its own "
                      "initialised from the policy (separate, as report 000, verl, OpenRLHF)",
                      choices=("shared", "separate"))
    critic_lr: float = opt(0.0, "PPO: the critic's learning rate (value head, and with --critic separate its "
                                "trunk); 0 = --lr; report 000 used 10x the actor's")
    vf_coef: float = opt(PPO.vf_coef, "PPO: weight of the value loss")
    value_clip: float = opt(PPO.value_clip, "PPO: value-loss clip range around the old values; 0 = unclipped")
    gamma: float = opt(PPO.gamma, "PPO: discount per token")
    lam: float = opt(PPO.lam, "PPO: GAE lambda")
    dynamic_sampling: bool = opt(False, "DAPO's dynamic sampling: drop groups whose K rewards are all equal "
                                 "and sample more prompts until B groups differ (dynamic_sampling.py)")
    max_sampling_rounds: int = opt(8, "--dynamic-sampling: rounds of B prompts at most per step; at the cap "
                                   "the step trains on the groups it kept")
    max_sampling_seconds: float = opt(300.0, "--dynamic-sampling: seconds of sampling at most per step (every group "
                                      "one reward, round after round, under near-greedy sampling)")
    skip_all_fallback: bool = opt(GRPO.skip_all_fallback, "report 001's guard: no update when every sample is fallback text")
    # sampling
    temperature: float = opt(GRPO.temperature, "sampling temperature for rollouts and evaluation")
    max_new_tokens: int = opt(0, "longest completion (tools: each turn); 0 = 24, or 64 for a real model's "
                              "tool turns (a tool call is ~40 of its tokens, 17 of the tiny model's)")
    # evaluation and output
    eval_every: int = opt(10, "evaluate on held-out prompts every this many steps")
    eval_samples: int = opt(4, "samples per held-out prompt at each evaluation")
    eval_prompts: int = opt(0, "held-out prompts per evaluation, spread over the list (and as many training "
                               "prompts for the answer NLL); 0 = all 32: fewer for a quick look at a real model on a CPU")
    early_stop_patience: int = opt(0, "stop once the held-out reward has not improved for this many "
                                      "evaluations, keeping the best one's checkpoint; 0 = off")
    seed: int = opt(GRPO.seed, "seed of the RL phase (prompts and sampling)")
    out: str = opt("", "folder for the run's files; default runs/k{K}_b{B}_{norm}_lr{lr}_s{seed}, with a "
                       "-2, -3 ... suffix when that one holds a run already")
    overwrite: bool = opt(False, "replace the run already in --out (its logs, summary, curves and checkpoints)")
    tensorboard: bool = opt(False, "also write every metric as a TensorBoard scalar into OUT/tensorboard/ "
                            "(needs the optional `pip install tensorboard`); metrics.jsonl stays the record")
    log_samples: int = opt(4, "completions per step written to samples.jsonl")
    quiet: bool = opt(False, "no progress line")
    # surviving failures (checkpoint.py, monitor.py)
    save_every: int = opt(0, "write a checkpoint every this many steps; 0 = only when a run stops early")
    keep_checkpoints: int = opt(0, "keep only this many newest checkpoints; 0 = keep all")
    resume: str = opt("", "continue the run in this folder (or from this checkpoint folder)")
    max_skips: int = opt(10, "stop the run (with a checkpoint) once more optimizer steps than this were non-finite")
    alert_entropy: float = opt(0.5, "monitor: alert when the token-mean entropy falls below this (report 002)")
    alert_kl: float = opt(0.5, "monitor: alert when the KL to the reference rises above this (report 002)")
    alert_reward_range: float = opt(0.3, "monitor: alert when max - min of the mean reward over the window exceeds this")
    alert_window: int = opt(10, "monitor: steps in the reward-range window")
    stop_on_alert: bool = opt(False, "stop the run (with a checkpoint) at the monitor's first alert")
    collective_timeout: float = opt(300.0, "torchrun: seconds a rank waits for the others before the job ends "
                                    "with a line naming it (a rank stopped with kill -STOP hung the others)")
    # the policy
    device: str = opt("auto", "where to run", choices=("auto", "cpu", "cuda"))
    threads: int = opt(0, "CPU threads torch uses; 0 = 1 for the tiny model (a 20-step run on a busy 2-core "
                       "machine: 1.6x faster than with 2; docs/performance.md), torch's default for --model")
    bf16: str = opt("auto", "bf16 autocast: auto = on a GPU, and on a CPU for a real model where "
                    "bf16 is measured faster", choices=("auto", "on", "off"))
    model: str = opt("", "a real model: smollm2-135m (fetched once), a local Hugging Face folder, or a hub id; "
                     "default: the tiny model built in code")
    model_cache: str = opt("", "where --model smollm2-135m is converted and cached; default $RL_LESSONS_CACHE, "
                           "else ~/.cache/rl-lessons")
    hidden: int = opt(64, "tiny model: hidden size")
    layers: int = opt(2, "tiny model: transformer layers")
    sft_steps: int = opt(-1, "supervised warm-up steps; -1 = the default (policy.WARM_START: 300 tiny, 30 real)")
    sft_lr: float = opt(0.0, "warm-up learning rate; 0 = the default (3e-3 tiny, 1e-4 real)")
    sft_seed: int = opt(0, "warm-up seed (one warm start shared by all RL seeds)")
    sft_difficulty: int = opt(0, "tools task: the warm start shows episodes of 1 up to this many benchmarks "
                              "(half of them one); 0 = --difficulty")
    cache_dir: str = opt("", "where warm-started weights are cached; default: .cache/warmstart in the "
                         "repository, wherever the command runs from (models/policy.CACHE)")
    init_from: str = opt("", "start from another run's weights (its best checkpoint if it kept one, else its "
                         "newest), not the warm start; that start is also the KL's reference")

    # derived sizes, computed in one place
    @property
    def n(self) -> int:
        return self.batch * self.k

    @property
    def kl_in_reward(self) -> bool:
        return self.kl_in == "reward" or (self.kl_in == "auto" and self.algo == "ppo")

    @property
    def rollout_logprobs(self) -> bool:
        """The sampler's own log-probs are recorded (a mismatch made, corrected or logged)."""
        return (self.log_mismatch or self.rollout_dtype != "same" or self.rollout_stale > 0
                or self.rollout_temperature > 0 or self.rollout_correction != "none")

    @property
    def reuse_old_logp(self) -> bool:
        """--fast and one GRPO update per batch: the policy that sampled is the policy of the
        update's forward, so old log-probs are that forward's, detached (TRL does the same)."""
        return (self.fast and self.algo == "grpo" and self.epochs == 1
                and self.mini_batch in (0, self.n) and not self.kl_in_reward
                and not self.rollout_logprobs)       # the mismatch's weight needs pi_old before the update


# ---- what the lesson code reads: two small objects, every "0 means the default" resolved here ----

def hyper_params(cfg: Config) -> grpo.HyperParams:
    """The update's and the advantages' settings: grpo.HyperParams, or PPO's and RCE's
    extensions of it; train.py replaces beta, entropy_coef, seed (and RCE's tau) each step.
    Under torchrun the sizes are one rank's: its N/W sequences, its share of each mini-batch."""
    mini_batch = (cfg.mini_batch or cfg.n) // distributed.size()
    common = dict(
        mini_batch=mini_batch, micro_batch=cfg.micro_batch or mini_batch, algo=cfg.algo,
        k=cfg.k, norm=cfg.norm, unbiased=cfg.unbiased, adv_clip=cfg.adv_clip or None,
        kl_in_reward=cfg.kl_in_reward,
        clip_low=cfg.clip_eps, clip_high=cfg.clip_eps_high or cfg.clip_eps, ratio_level=cfg.ratio_level,
        beta=cfg.beta, kl_estimator=kl_estimator(cfg), entropy_coef=cfg.entropy_coef, loss_agg=cfg.loss_agg,
        max_len=completion_limit(cfg),
        temperature=cfg.temperature,
        epochs=cfg.epochs, max_grad_norm=cfg.max_grad_norm or math.inf, target_kl=cfg.target_kl,
        fast=cfg.fast, reuse_old_logp=cfg.reuse_old_logp, skip_all_fallback=cfg.skip_all_fallback,
        policy_loss=cfg.policy_loss, dual_clip_c=cfg.dual_clip_c, cispo_max=cfg.cispo_max,
        sapo_tau_pos=cfg.sapo_tau_pos, sapo_tau_neg=cfg.sapo_tau_neg, gmpo_delta=cfg.gmpo_delta,
        cov_ratio=cfg.cov_ratio, clip_cov_lb=cfg.clip_cov_lb, clip_cov_ub=cfg.clip_cov_ub, kl_cov_coef=cfg.kl_cov_coef,
        top_entropy_quantile=cfg.top_entropy_quantile, overlong_buffer=cfg.overlong_buffer,
        mask_truncated=cfg.mask_truncated, rollout_correction=cfg.rollout_correction,
        rollout_correction_level=cfg.rollout_correction_level, rollout_c_min=cfg.rollout_c_min,
        rollout_c_max=cfg.rollout_c_max, seed=cfg.seed)
    if cfg.algo == "ppo":
        return ppo.PPOParams(**common, gamma=cfg.gamma, lam=cfg.lam, vf_coef=cfg.vf_coef, value_clip=cfg.value_clip)
    if cfg.algo == "rce":
        return rce.RCEParams(**common, rce_temp=cfg.rce_temp_start)
    return grpo.HyperParams(**common)


def kl_estimator(cfg: Config) -> str:
    """--kl-estimator, auto resolved by where the KL goes: k1 in the reward, k3 in the loss."""
    if cfg.kl_estimator != "auto":
        return cfg.kl_estimator
    return kl.REWARD_ESTIMATOR if cfg.kl_in_reward else kl.LOSS_ESTIMATOR


def sampling(cfg: Config) -> tasks.Sampling:
    """How the task samples and scores rollouts (training and evaluation alike)."""
    return tasks.Sampling(temperature=cfg.temperature, max_new_tokens=new_tokens(cfg),
                          forward_batch=cfg.micro_batch or None, static_cache=cfg.compile,
                          shared_prefix=not cfg.no_shared_prefix,
                          max_turns=cfg.max_turns, reward=cfg.reward, reward_clip=cfg.reward_clip or None,
                          process_reward=not cfg.drop_process_reward)


def fail(message: str):
    """Bad input: one line on stderr, exit code 2, before any work. Under torchrun every rank
    prints its line: torchrun stops the others as soon as one exits, so a rank left to speak
    for all might be stopped before it could."""
    print(f"train.py: error: {message}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (train.py and the lab's commands)."""
    def error(self, message):        # one line instead of usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


# --help's sections: the first flag of each, in Config's order (its banner comments)
SECTIONS = {"task": "the task and the algorithm", "k": "the batch", "steps": "the update",
            "rollout_dtype": "the rollout/training mismatch (mismatch.py)", "beta": "KL to the reference (kl.py)",
            "critic": "PPO's critic (ppo.py)", "temperature": "sampling", "eval_every": "evaluation and output",
            "save_every": "surviving failures", "device": "the policy and the machine"}
EXAMPLES = """examples:
  python train.py --k 8 --norm global                  the main job (GRPO, the tiny model, CPU)
  python train.py --k 2 --batch 3 --norm group         report 001's setting (Lesson 2)
  python train.py --algo ppo                           PPO with a critic (Lesson 3)
  python train.py --task tools --reward sparse         report 000's tool agent (Lesson 4)
  python train.py --policy-loss cispo --epochs 2       a 2025-26 objective; it needs a second epoch to act (Lesson 8)
  python train.py --resume runs/NAME                   continue a stopped run

Progress and messages go to stderr (python train.py 2> log.txt keeps them); the numbers go to
the run's folder: metrics.jsonl, samples.jsonl, summary.json, curves.png."""


def _parser(explicit_only: bool = False) -> argparse.ArgumentParser:
    """The CLI, built from Config's fields: --field-name with the field's help. explicit_only:
    a flag not on the command line is left out of the result (to tell what the user gave)."""
    parser = OneLineParser(prog="train.py",
                           description="Train a policy with GRPO or PPO on report 001's workflow-DSL "
                                       "task or report 000's tool-calling task; each flag is a "
                                       "field of config.Config.",
                           formatter_class=HelpFormatter, epilog=EXAMPLES,
                           argument_default=argparse.SUPPRESS if explicit_only else None)
    group = parser
    for f in dataclasses.fields(Config):
        group = parser.add_argument_group(SECTIONS[f.name]) if f.name in SECTIONS else group
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        default = argparse.SUPPRESS if explicit_only else f.default
        if f.type is bool or f.type == "bool":
            group.add_argument(*flags, action="store_true", default=default, help=f.metadata["help"])
        else:
            group.add_argument(*flags, type=type(f.default), default=default,
                               choices=f.metadata.get("choices"), help=f.metadata["help"])
    return parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; the examples kept as written."""


def parse_config(argv=None) -> Config:
    """The CLI: parse, resolve --resume, validate; bad input ends in one line and exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    given = vars(_parser(explicit_only=True).parse_args(argv))
    try:
        cfg = gspo_defaults(Config(**vars(args)), given)
        for name, what in (("resume", "the folder of the run to continue"), ("init_from", "a run or checkpoint "
                           "folder to start from"), ("model", "a named model, a folder or a hub id")):
            if name in given and not str(given[name]).strip():      # an empty string is a mistake, not "off"
                raise ConfigError(f"--{name.replace('_', '-')}: needs {what}, got an empty string")
        if "resume" in given:
            cfg = resumed_config(cfg, given)
        return validate(cfg)
    except ConfigError as e:
        fail(str(e))


# GSPO's paper (and verl's gspo) clip the sequence ratio at 3e-4 / 4e-4 and average over
# sequences; token-level PPO's 0.2 would leave a length-normalised ratio unclipped.
GSPO_DEFAULTS = dict(clip_eps=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean")


def gspo_defaults(cfg: Config, given: dict) -> Config:
    """--ratio-level sequence: GSPO's clip range and aggregation for the flags not given;
    --policy-loss sapo or gmpo: the aggregation it was written with (surrogates.OWN_AGGREGATION),
    unless --loss-agg is given."""
    if cfg.policy_loss in surrogates.OWN_AGGREGATION and "loss_agg" not in given:
        cfg = dataclasses.replace(cfg, loss_agg=surrogates.OWN_AGGREGATION[cfg.policy_loss])
    if cfg.ratio_level != "sequence":
        return cfg
    return dataclasses.replace(cfg, **{k: v for k, v in GSPO_DEFAULTS.items() if k not in given})


def processes_of(run_dir: Path) -> int:
    """How many processes trained a run (its config.json's `processes`)."""
    saved = json.loads((Path(run_dir) / "config.json").read_text())
    if "processes" not in saved:
        raise ConfigError(f"--resume: {str(run_dir)!r} was written by an older version of train.py "
                          f"(its config.json does not say how many processes trained it); start it again")
    return int(saved["processes"])


# Flags that change how a run is carried out, not what it computes: where the warm start is
# cached, torch's threads (identical results), the printing, and replacing a folder.
NOT_IN_RESULTS = ("quiet", "overwrite", "threads", "cache_dir")
RESUME_MAY_CHANGE = ("steps", "resume", *NOT_IN_RESULTS)


def resumed_config(cfg: Config, given: dict) -> Config:
    """The saved configuration of the run being resumed. A flag given on the command line must
    equal the saved value (re-running the original command with --resume added works);
    --steps may extend the run, --quiet may change."""
    if given.get("overwrite"):
        raise ConfigError("--overwrite: replaces a run, --resume continues it: not both")
    ckpt = checkpoint.find(Path(cfg.resume))
    if ckpt is None and checks.holds_run(Path(cfg.resume)):    # it stopped before its first checkpoint
        raise ConfigError(f"--resume: the run in {cfg.resume!r} stopped before its first checkpoint, so "
                          f"there is nothing to continue; run its command again with --overwrite")
    if ckpt is None:
        raise ConfigError(f"--resume: no checkpoint in {cfg.resume!r} (expected a run folder "
                          f"with checkpoints/step-*/ or a checkpoint folder)")
    run_dir = checkpoint.run_dir_of(ckpt)
    try:
        saved = saved_fields(run_dir, Config)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: cannot read {str(run_dir / 'config.json')!r} ({e})")
    before, now = processes_of(run_dir), distributed.size()
    if before != now:
        raise ConfigError(f"--resume: the run was trained by {before} process(es) and this is {now}: each "
                          f"process's share of the prompts, its sampling seeds and --micro-batch (per process) "
                          f"would change mid-run; resume with torchrun --nproc_per_node {before}"
                          if before > 1 else f"--resume: the run was trained by 1 process; resume it with "
                          f"python train.py, not {now} processes")
    saved["out"] = str(run_dir)
    for name, value in given.items():
        if name in RESUME_MAY_CHANGE:
            continue
        same = Path(value).resolve() == run_dir.resolve() if name == "out" else value == saved.get(name)
        if not same:
            raise ConfigError(f"--resume: --{name.replace('_', '-')} was {saved.get(name)!r} in the saved "
                              f"run and is {value!r} now; a resumed run keeps its configuration "
                              f"(only --steps and --quiet can change)")
    merged = {**saved, "resume": str(run_dir if (Path(cfg.resume) / "checkpoints").is_dir() else ckpt),
              "quiet": cfg.quiet, "steps": cfg.steps if "steps" in given else saved.get("steps", cfg.steps),
              "overwrite": False}                 # the run was made with it, perhaps; it goes on now
    at = int(ckpt.name.split("-")[-1]) if ckpt.name.startswith("step-") else 0
    if merged["steps"] <= at:
        raise ConfigError(f"--steps: the run's newest checkpoint is at step {at}; give --steps above "
                          f"{at} to continue it (it is {merged['steps']})")
    return Config(**merged)
