"""Data-parallel runs under ``torchrun``: joining the process group, and rank 0's decisions.

:mod:`headsurgeon.finetune` shards batches by rank and writes checkpoints on rank 0 only;
:mod:`headsurgeon.repair` takes every decision (targets, damage, the best pass) from rank 0, so
that processes whose censuses differ in the last bit still agree. Without ``torchrun`` every
function here is a no-op.

>>> rank_and_world(), from_rank0("L5H9")
((0, 1), 'L5H9')
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []


@dataclasses.dataclass
class DistInfo:
    rank: int
    world_size: int
    device: torch.device


def setup_distributed(device: str | torch.device = "cpu") -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1).

    Uses NCCL and ``cuda:LOCAL_RANK`` for CUDA devices, gloo on CPU. Without torchrun it returns
    rank 0 of 1 and changes nothing.
    """
    device = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    rank, world = rank_and_world()
    return DistInfo(rank=rank, world_size=world, device=device)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (censuses and perplexities on GPUs may differ in the last
    bit, and every rank must take the same decisions)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
