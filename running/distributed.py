"""Past one device: data-parallel training under torchrun (Lesson 6,
docs/lessons/6-torchrun.md, says how a step is shared out and why).

    torchrun --standalone --nproc_per_node 2 train.py --k 8 --norm global     # one machine, 2 processes

torchrun gives each process RANK, LOCAL_RANK and WORLD_SIZE; `python train.py` sets none of
them, and then every helper below is the identity and no process group is ever made. The
lessons call only advantages.all_sum, all_max and world_size; train.py and running/ call
the rest. Only rank 0 writes files.
"""
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import advantages



# ---- who am I ----

def launched() -> bool:
    """Started by torchrun (it sets WORLD_SIZE); `python train.py` is not."""
    return "WORLD_SIZE" in os.environ


def active() -> bool:
    """A process group is up (init ran): the collectives below communicate."""
    return dist.is_available() and dist.is_initialized()


def size() -> int:
    """W, the number of ranks: the process group's, else torchrun's WORLD_SIZE (running/checks.py checks
    the batch against it before the group exists), else 1."""
    return dist.get_world_size() if active() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if active() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one that writes files and prints."""
    return rank() == 0


def init(device: str, timeout: float = 300.0) -> None:
    """Join torchrun's process group: nccl on GPUs (this rank's GPU = LOCAL_RANK), gloo on CPUs,
    and gloo too where ranks share a GPU (nccl refuses two ranks on one device): the model on the
    GPU, the collectives through the CPU. timeout: seconds a collective waits for the other ranks
    (--collective-timeout); past it the collective raises, and train.py ends the job with a line
    naming this rank (RankLost), where a rank stopped with kill -STOP would otherwise hang the
    others forever."""
    backend = "gloo"
    if device == "cuda":
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
        backend = "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def close() -> None:
    if active():
        dist.destroy_process_group()


# ---- the collectives: the identity in one process ----

# the lessons' sum over ranks, the one implementation (nccl sums on the GPU, gloo on the CPU)
all_sum = advantages.all_sum


def sum_float(x: float) -> float:
    """A Python number summed over every rank."""
    return all_sum(torch.tensor([x], dtype=torch.float64)).item() if active() else x


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on at least one."""
    return sum_float(float(flag)) > 0


def gather(obj) -> list:
    """Every rank's obj (any picklable object), in rank order, on every rank."""
    if not active():
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def concat(parts: dict) -> dict:
    """Every rank's parts joined in rank order: tensors concatenated along dim 0, lists
    concatenated, None kept. In one process, parts itself."""
    if not active():
        return parts
    every = gather({key: v.cpu() if torch.is_tensor(v) else v for key, v in parts.items()})
    joined = {}
    for key, v in parts.items():
        pieces = [p[key] for p in every]
        joined[key] = None if v is None else torch.cat(pieces) if torch.is_tensor(v) else sum(pieces, [])
    return joined


def first_reason(reason: str | None) -> str | None:
    """A reason to stop that any rank has (a signal reaches one rank at a time): the same
    answer on every rank, so all stop at the same step."""
    return next((r for r in gather(reason) if r), None)


def barrier() -> None:
    if active():
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (it downloads, converts, warm-starts and fills the caches);
    the others wait, then run it and find the caches full."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


# ---- the split ----

def shard(items: list) -> list:
    """This rank's share of the step's B prompts: items r*B/W ... (r+1)*B/W - 1 (running/checks.py
    refuses a B that does not split)."""
    n = len(items) // size()
    return items[rank() * n:(rank() + 1) * n]


def sampling_seed(seed: int, step: int) -> int:
    """Rank r's sampling seed at a step: distinct for every (seed, rank, step), so no two ranks
    draw the same completions, and a resumed run draws what it would have drawn."""
    return ((seed * 1_000_003 + step) * 4099 + rank()) % 2 ** 63     # up to 4099 ranks


# ---- the update under DistributedDataParallel ----

def replicate(module: torch.nn.Module) -> torch.nn.Module:
    """module in DDP under torchrun (its weights broadcast from rank 0 now; its gradients
    all-reduced, averaged, in every backward while its require_backward_grad_sync is True:
    update.py holds it back on all but a mini-batch's last micro-batch); the module itself in
    one process."""
    if not active():
        return module
    on_gpu = next(module.parameters()).is_cuda
    return DistributedDataParallel(module, device_ids=[torch.cuda.current_device()] if on_gpu else None)


def lost_contact(error: BaseException) -> bool:
    """Whether error is a collective failing because another rank died or hung (gloo and nccl
    raise RuntimeError, or its subclass DistError): the job must end, with a message."""
    return active() and (isinstance(error, getattr(dist, "DistError", ())) or
                         any(word in str(error).lower() for word in ("gloo", "nccl", "connection")))
