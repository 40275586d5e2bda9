"""The redesigns of the update changed how it reads, not what it learns.

tests/golden/float64/*.jsonl are the metrics.jsonl of short train.py runs, every field but
`seconds`: GRPO and PPO, the tool task's multi-turn episodes, mini-batches with micro-batches and
two epochs, the KL and entropy terms, --fast's reused old log-probs. The code of today must write
the same lines to 1e-9 (relative).

The runs are made in float64, so that no CPU's kernels move them. In float32 another CPU sums in
another order (AVX-512 against AVX2, Intel against AMD): 1e-7 in a gradient, which Adam turns
into weight differences that grow with each step, so the float32 files missed by up to 4e-5
after three steps when the kernels changed, and had to be kept per CPU vendor, which still failed
on an AMD with AVX-512. In float64 the same runs under AVX-512, AVX2 and the plain kernels
(ATEN_CPU_CAPABILITY=avx512|avx2|default with MKL_ENABLE_INSTRUCTIONS to match) agree to 2e-12;
a sampled token that flips, or any change in what is learned, moves them by far more than 1e-9.
float64 end to end takes the default dtype (the tiny model is built in it) and three places where
transformers computes in float32 whatever the model's dtype: its causal-LM loss (the warm start's),
Qwen2's RMSNorm and its rotary embedding; `float64` below puts the same formulas in the input's dtype.

Where the files come from: the code before the redesigns (2e3d7da, the commit before the machinery
moved into packages and GRPO, PPO and RCE got one update loop) recorded these runs in float32 on an
AMD EPYC and on an Intel Xeon with AVX-512; the code that wrote these float64 files matched those
float32 files on that Intel Xeon to 1e-5, all six, before it recorded them (`python
tests/test_same_learning.py --record`, on any CPU).
"""
import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch


GOLDEN = Path(__file__).parent / "golden" / "float64"
# name -> train.py flags (each run also gets COMMON)
RUNS = {
    "grpo_global": "--k 8 --norm global",
    "ppo": "--algo ppo",
    "tools": "--task tools --steps 2 --k 4 --batch 2",
    "mini_micro_epochs": "--mini-batch 16 --micro-batch 4 --epochs 2",
    "kl_entropy_fast": "--beta 0.05 --entropy-coef 0.01 --fast",
    "ppo_kl_in_loss": "--algo ppo --beta 0.05 --kl-in loss --mini-batch 16 --epochs 2 --loss-agg constant",
}
# no_shared_prefix: the float32 files were recorded before shared_prefix.py, whose forward sums in
# another order (~1e-6 relative per log-prob, then Adam's amplification); tests/test_shared_prefix.py
# shows that path gives these runs' numbers to 1e-4 over 20 steps.
COMMON = "--steps 3 --batch 4 --seed 3 --sft-steps 30 --eval-samples 1 --quiet --device cpu"  # recorded on a CPU
RELATIVE = 1e-9                 # float64 runs under three kernel sets agree to 2e-12


@contextlib.contextmanager
def float64():
    """Everything in float64: the default dtype, and the three float32 casts of transformers that a
    float64 model still goes through, replaced by the same formulas in the input's dtype."""
    from transformers import modeling_utils
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    def rms_norm(self, h):                  # y = w * h / sqrt(mean(h^2) + eps)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    @torch.no_grad()
    def rotary(self, x, position_ids):      # cos and sin of position * inv_freq, each half repeated
        freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(device=x.device, dtype=x.dtype)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def causal_lm_loss(logits, labels, vocab_size, ignore_index=-100, **_):    # mean NLL of labels[t+1]
        shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shifted.reshape(-1),
                                                 ignore_index=ignore_index)
    saved = (torch.get_default_dtype(), qwen2.Qwen2RMSNorm.forward, qwen2.Qwen2RotaryEmbedding.forward,
             modeling_utils.LOSS_MAPPING["ForCausalLM"])
    torch.set_default_dtype(torch.float64)
    qwen2.Qwen2RMSNorm.forward, qwen2.Qwen2RotaryEmbedding.forward = rms_norm, rotary
    modeling_utils.LOSS_MAPPING["ForCausalLM"] = causal_lm_loss
    try:
        yield
    finally:
        torch.set_default_dtype(saved[0])
        qwen2.Qwen2RMSNorm.forward, qwen2.Qwen2RotaryEmbedding.forward = saved[1:3]
        modeling_utils.LOSS_MAPPING["ForCausalLM"] = saved[3]


def run(name: str, tmp: Path) -> list[dict]:
    """The metrics.jsonl lines of one run in float64, without `seconds`. Its warm start is built
    in a cache of its own: a cached one loads as float32 (policy.cached)."""
    from running import config
    import train
    flags = f"{COMMON} {RUNS[name]}".split()
    argv = flags + ["--cache-dir", str(tmp / f"{name}-warm-start"), "--out", str(tmp / name)]
    with float64():
        train.train(dataclasses.replace(config.parse_config(argv), no_shared_prefix=True))
    rows = [json.loads(line) for line in open(tmp / name / "metrics.jsonl")]
    for row in rows:
        row.pop("seconds", None)
    return rows


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=RELATIVE, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", list(RUNS))
def test_the_update_writes_the_metrics_it_wrote_before_on_any_cpu(name, tmp_path):
    golden = [json.loads(line) for line in open(GOLDEN / f"{name}.jsonl")]
    ours = run(name, tmp_path)
    assert len(ours) == len(golden)
    for old, new in zip(golden, ours):
        diff = {k: (old.get(k), new.get(k)) for k in old.keys() | new.keys() if not same(old.get(k), new.get(k))}
        assert not diff, f"step {old['step']}: fields that changed (recorded, now): {diff}"


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile
    sys.path.insert(0, str(Path(__file__).parent.parent))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            rows = run(name, Path(tmp))
            (GOLDEN / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(f"recorded {name}: {len(rows)} lines")
