"""torch.distributed: every rank takes the same decision in the same step.

The monitor's single host read goes through ``agree``: when a process group is up, the step's
stacked statistics are all-reduced before they are read, so every rank sees the same numbers
(the mean over ranks; counts of non-finite values summed, so NaN on one rank is NaN on all) and
its deterministic detectors and policy decide the same thing. It is one collective on the stacked
vector, not one per statistic. Values that only make sense locally (indices of the offending
parameter) are kept as they are.
"""
from __future__ import annotations

import torch
from torch import nn


def world_size() -> int:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_world_size()
    return 1


def agree(vector: torch.Tensor, mean_mask: torch.Tensor, local_mask: torch.Tensor) -> torch.Tensor:
    """All-reduce ``vector`` across ranks: the mean where ``mean_mask``, the sum elsewhere,
    except where ``local_mask`` (kept as this rank's value). No-op without a process group."""
    n = world_size()
    if n == 1:
        return vector
    d = torch.distributed
    backend = d.get_backend()
    work = vector.clone()
    if backend == "nccl" and work.device.type != "cuda":
        work = work.cuda()
    d.all_reduce(work, op=d.ReduceOp.SUM)
    work = work.to(vector.device)
    work = torch.where(mean_mask, work / n, work)
    return torch.where(local_mask, vector, work)


def rank() -> int:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank()
    return 0


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel (their names carry 'module.')."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model
