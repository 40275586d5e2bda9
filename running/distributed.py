"""Data-parallel training under torchrun (docs/lessons/6-torchrun.md says how a step is shared out).

    torchrun --standalone --nproc_per_node 2 train.py --k 8 --norm global     # one machine, 2 processes

Without torchrun's RANK and WORLD_SIZE every helper below is the identity and no process group
is made. The lessons call only advantages.all_sum, all_max and world_size. Rank 0 writes the files.
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
    """W: the process group's size, else torchrun's WORLD_SIZE (before the group exists), else 1."""
    return dist.get_world_size() if active() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if active() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one that writes files and prints."""
    return rank() == 0


def init(device: str, timeout: float = 300.0) -> None:
    """Join torchrun's process group: nccl on GPUs (LOCAL_RANK's), gloo on CPUs and where ranks
    share a GPU. Past timeout seconds a collective raises (RankLost ends the job in one line),
    where a rank stopped with kill -STOP would otherwise hang the others forever."""
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

def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on at least one (the lessons' advantages.all_sum)."""
    return (advantages.all_sum(torch.tensor([float(flag)], dtype=torch.float64)).item() if active() else flag) > 0


def gather(obj) -> list:
    """Every rank's obj (any picklable object), in rank order, on every rank."""
    if not active():
        return [obj]
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def concat(parts: dict) -> dict:
    """Every rank's parts joined in rank order: tensors along dim 0, lists concatenated, None kept."""
    if not active():
        return parts
    every = gather({key: v.cpu() if torch.is_tensor(v) else v for key, v in parts.items()})
    joined = {}
    for key, v in parts.items():
        pieces = [p[key] for p in every]
        joined[key] = None if v is None else torch.cat(pieces) if torch.is_tensor(v) else sum(pieces, [])
    return joined


def first_reason(reason: str | None) -> str | None:
    """A reason to stop any rank has (a signal reaches one rank at a time), on every rank."""
    return next((r for r in gather(reason) if r), None)


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (filling the caches), then releases the others, failed or not."""
    if active() and not is_main():
        dist.barrier()
    try:
        yield
    finally:
        if active() and is_main():
            dist.barrier()


# ---- the split ----

def shard(items: list) -> list:
    """This rank's share of the step's B prompts: items r*B/W ... (r+1)*B/W - 1."""
    n = len(items) // size()
    return items[rank() * n:(rank() + 1) * n]


def sampling_seed(seed: int, step: int) -> int:
    """Rank r's sampling seed at a step, distinct for every (seed, rank, step); a resumed run
    draws what it would have drawn."""
    return ((seed * 1_000_003 + step) * 4099 + rank()) % 2 ** 63     # up to 4099 ranks


# ---- the update under DistributedDataParallel ----

def replicate(module: torch.nn.Module) -> torch.nn.Module:
    """module in DDP under torchrun: rank 0's weights broadcast now, gradients averaged in each
    backward while require_backward_grad_sync (update.py: a mini-batch's last micro-batch)."""
    if not active():
        return module
    on_gpu = next(module.parameters()).is_cuda
    return DistributedDataParallel(module, device_ids=[torch.cuda.current_device()] if on_gpu else None)


def lost_contact(error: BaseException) -> bool:
    """Whether error is a collective failing because another rank died or hung (RuntimeError or DistError)."""
    return active() and (isinstance(error, getattr(dist, "DistError", ())) or
                         any(word in str(error).lower() for word in ("gloo", "nccl", "connection")))
