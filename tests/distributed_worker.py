"""Run by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU): one batch of
rollouts split over the ranks, prompts whole, and everything that must not depend on the
number of ranks computed on this rank's share: the advantages of every estimator (with the
sums over ranks, and without them), PPO's whitened advantages, one GRPO update's gradient for
every loss aggregation (and with per-rank denominators) and every objective whose tokens are
not chosen per micro-batch (OBJECTIVES), one PPO update's, one LoRA update's
(the adapters' gradient; the weights frozen), and the step's metrics. Rank r saves them to OUT/rank{r}.pt; the test computes the one-process values on
the whole batch (`one_process`) and compares. The K rows of a group share their prompt; the
ranks encode it once per group (shared_prefix.py), the one-process reference once per row, so
the comparison also shows the shared forward under DDP equal to the plain one.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_worker.py OUT [cuda]

With cuda the ranks compute on the GPU (the model, the batch, the update; both on one GPU when
there is one: the collectives then go through gloo, distributed.init) and save on the CPU.
"""
import dataclasses
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))           # conftest (it puts the repo on the path)
from conftest import synthetic_batch, tiny_model  # noqa: E402

import advantages  # noqa: E402
import diagnostics  # noqa: E402
from running import distributed  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import lora  # noqa: E402
import ppo  # noqa: E402
import surrogates  # noqa: E402
import update  # noqa: E402
from tasks import workflow_task  # noqa: E402
from rollout import completion_mask  # noqa: E402

B, K = 4, 4                                              # N = 16 rollouts, 8 per rank
N = B * K
DEVICE = "cpu"                                           # where the ranks compute (argv[2])
# group 0 mixed, group 1 all equal (no signal), groups 2 and 3 of different spreads
REWARDS = torch.tensor([1.0, 0.2, 0.0, 0.2, 0.2, 0.2, 0.2, 0.2, 1.0, 1.0, 0.0, 0.2, 0.0, 0.0, 0.0, 1.0])
CLASSES = ["best" if r == 1.0 else "valid" if r == 0.2 else "junk" for r in REWARDS.tolist()]
# PPO's clip is the aggregations' runs; Clip-Cov and KL-Cov choose tokens per micro-batch (test_guards.py)
OBJECTIVES = [name for name in surrogates.POLICY_LOSSES if name not in ("clip", "clip-cov", "kl-cov")]


def whole_batch():
    """The batch every rank and the one-process reference start from: 16 rollouts of random
    tokens, of unequal lengths (rows 0, 3, 6, ... end early, rows 1 and 2 earlier still: rank 0
    of 2 holds fewer policy tokens than rank 1), rewards above, values for PPO, and random
    per-token advantages for PPO's whitening."""
    model = tiny_model()
    batch = synthetic_batch(model, n=N, seed=3)
    batch.prompt_ids = batch.prompt_ids[::K].repeat_interleave(K, 0)                     # grouped
    batch.prompt_mask = batch.prompt_mask[::K].repeat_interleave(K, 0)                   # (N, P)
    batch.completion_ids[1:3, 1] = 1                                                     # EOS
    batch.completion_mask = completion_mask(batch.completion_ids, 1)
    with torch.no_grad():
        old = logprobs.completion_logprobs(model, batch.tokens())[0]
    batch.old_logp = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    batch.ref_logp = old - 0.1
    batch.rewards = REWARDS.clone()
    gen = torch.Generator().manual_seed(4)
    batch.old_values = 0.1 * torch.randn(batch.completion_mask.shape, generator=gen)     # (N, C)
    batch.advantages = torch.randn(batch.completion_mask.shape, generator=gen)           # (N, C)
    return batch


def take(batch, rows: slice):
    """The rows of a batch as a batch of their own (a rank's share)."""
    cut = {f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)
           if torch.is_tensor(getattr(batch, f.name))}
    return dataclasses.replace(batch, texts=batch.texts[rows], **cut)


def on_cpu(tree):
    """Every tensor in nested dicts moved to the CPU (what a rank computed on the GPU, saved)."""
    if isinstance(tree, dict):
        return {k: on_cpu(v) for k, v in tree.items()}
    return tree.cpu() if torch.is_tensor(tree) else tree


def hyper(algo: str, agg: str, ranks: int) -> grpo.HyperParams:
    """Each rank's settings: its half of the mini-batch, two micro-batches of it (the gradient
    sync held back once)."""
    params = ppo.PPOParams if algo == "ppo" else grpo.HyperParams
    return params(mini_batch=N // ranks, micro_batch=N // ranks // 2, algo=algo, k=K,
                  beta=0.1, entropy_coef=0.01, loss_agg=agg, max_len=6, kl_in_reward=algo == "ppo")


def gradient(batch, hp: grpo.HyperParams, lora_rank: int = 0) -> tuple[torch.Tensor, dict]:
    """One update from the same starting weights (SGD at lr 0: the weights stay, the gradient
    stays in .grad); the gradient over every trained parameter, flat, and the update's statistics.
    With lora_rank, adapters on the frozen model, their B's drawn (not zero, so A's gradient is
    not zero either)."""
    model = tiny_model()
    if lora_rank:
        lora.add_adapters(model, lora_rank, alpha=16.0, seed=1)
        gen = torch.Generator().manual_seed(6)
        for layer in lora.adapters(model):
            layer.lora_B.data = 0.1 * torch.randn(layer.lora_B.shape, generator=gen)
    model.to(DEVICE)
    head = ppo.ValueHead(model.config.hidden_size) if hp.algo == "ppo" else None
    if head is not None:
        torch.nn.init.normal_(head.linear.weight, std=0.1, generator=torch.Generator().manual_seed(5))
        head.to(DEVICE)
    scorer = distributed.replicate(logprobs.Scorer(model, head))
    trained = [p for p in scorer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.0)
    if hp.algo == "ppo":
        ppo.prepare(batch, hp)
    stats = update.update(scorer, opt, batch, hp, ppo.loss if hp.algo == "ppo" else grpo.loss)
    return torch.cat([p.grad.flatten() for p in trained]).cpu(), stats


def compute(batch, classes: list, ranks: int) -> dict:
    """Everything compared, on this process's batch (a rank's share, or the whole batch)."""
    lengths = batch.completion_mask.sum(1)
    out = {"adv": {}, "adv_per_rank": {}, "grad": {}, "stats": {}}
    for norm in advantages.NORMS:
        out["adv"][norm] = advantages.compute(batch.rewards, K, norm, lengths=lengths)
        with mock.patch.object(advantages, "all_sum", lambda x: x):       # the bug: this rank's statistics
            out["adv_per_rank"][norm] = advantages.compute(batch.rewards, K, norm, lengths=lengths)
    out["whitened"] = advantages.whiten(batch.advantages, batch.completion_mask)
    batch.advantages = out["adv"]["global"].clone()
    for agg in grpo.AGGREGATIONS:
        out["grad"][agg], out["stats"][agg] = gradient(batch, hyper("grpo", agg, ranks))
    # the bug: each rank's token mean, DDP's average of them (no sums over ranks, no W scale)
    with mock.patch.object(update, "all_sum", lambda x: x), mock.patch.object(update, "world_size", lambda: 1):
        out["grad_per_rank_counts"], _ = gradient(batch, hyper("grpo", "token-mean", ranks))
    for name in OBJECTIVES:                  # every other objective, with its own aggregation
        hp = dataclasses.replace(hyper("grpo", surrogates.OWN_AGGREGATION.get(name, "token-mean"), ranks),
                                 policy_loss=name, dual_clip_c=1.05, cispo_max=1.02)
        out["grad"][name], out["stats"][name] = gradient(batch, hp)
    out["grad"]["ppo"], out["stats"]["ppo"] = gradient(batch, hyper("ppo", "token-mean", ranks))
    out["grad"]["lora"], out["stats"]["lora"] = gradient(batch, hyper("grpo", "token-mean", ranks), lora_rank=2)
    batch.advantages = out["adv"]["group"].clone()
    out["metrics"] = diagnostics.rollout_metrics(batch, classes, workflow_task, hyper("grpo", "token-mean", ranks),
                                                 join=distributed.concat)
    return out


def one_process() -> dict:
    """The reference: the whole batch in this one process."""
    return compute(whole_batch(), CLASSES, 1)


if __name__ == "__main__":
    DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    distributed.init(DEVICE)
    r, w = distributed.rank(), distributed.size()
    share = slice(r * N // w, (r + 1) * N // w)            # whole groups: K divides N / w
    mine = take(whole_batch(), share)
    mine = dataclasses.replace(mine, share_prefix=True, **{f.name: getattr(mine, f.name).to(DEVICE)
                                                           for f in dataclasses.fields(mine)
                                                           if torch.is_tensor(getattr(mine, f.name))})
    torch.save(on_cpu(compute(mine, CLASSES[share], w)), Path(sys.argv[1]) / f"rank{r}.pt")
    torch.distributed.barrier()                          # neither rank tears down while the other works
    distributed.close()
