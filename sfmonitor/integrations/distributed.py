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


def agree(
    vector: torch.Tensor, mean_mask: torch.Tensor, local_mask: torch.Tensor, max_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """All-reduce ``vector`` across ranks: the mean where ``mean_mask``, the max where ``max_mask``
    (activation maxima: one rank near the fp16 limit must not be diluted by the others; NaN counts
    as +inf), the sum elsewhere, except where ``local_mask`` (this rank's value is kept).
    No-op without a process group."""
    n = world_size()
    if n == 1:
        return vector
    d = torch.distributed
    on_cuda = d.get_backend() == "nccl" and vector.device.type != "cuda"
    work = vector.cuda() if on_cuda else vector.clone()
    d.all_reduce(work, op=d.ReduceOp.SUM)
    out = torch.where(mean_mask, work.to(vector.device) / n, work.to(vector.device))
    if max_mask is not None:
        high = torch.nan_to_num(vector, nan=float("inf"))
        high = high.cuda() if on_cuda else high
        d.all_reduce(high, op=d.ReduceOp.MAX)
        out = torch.where(max_mask, high.to(vector.device), out)
    return torch.where(local_mask, vector, out)


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
