"""torch.distributed: every rank takes the same decision in the same step.

The monitor's single host read goes through ``agree``: when a process group is up, the step's
statistics, concatenated into one vector, are reduced across ranks before they are read, so every
rank sees the same numbers and its deterministic detectors and policy decide the same thing. Each
value combines as ``stats.REDUCTIONS`` says:

- losses, LRs: the mean over ranks;
- norms (``grad_norm/*``, ``param_norm/*``): each rank contributes its share of the sum of squares
  (its local shards under FSDP2; 1/world of the replicated tensors under DDP), the result is the
  root of the sum, i.e. the norm of the full parameters;
- counts of events on each rank and per-rank one-hot slots (where a non-finite value started): the sum;
- maxima (activation maxima, counts of parameters every rank holds): the max, NaN counting as +inf;
- indices into lists every rank holds alike (the first offending parameter or module): the
  smallest index over ranks.

That is one sum collective per step, plus one max collective when a maximum or an index is in the
vector: a constant number, whatever the number of statistics. ``agree_metrics`` does the same for
``observe_eval``'s metrics, so evaluation findings agree too. docs/distributed.md has the details.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..stats import Reduce

# Set while a monitor configured ``distributed: false`` runs: it is this process's alone (a model
# only this rank trains), and sees a world of one, itself rank 0, whatever process group exists.
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("sfmonitor_alone", default=False)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within: ``world_size()`` is 1 and ``rank()`` 0 (no collective, this process's own files)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def world_size() -> int:
    d = torch.distributed
    if not _ALONE.get() and d.is_available() and d.is_initialized():
        return d.get_world_size()
    return 1


def rank() -> int:
    d = torch.distributed
    if not _ALONE.get() and d.is_available() and d.is_initialized():
        return d.get_rank()
    return 0


def _comm_device(device: torch.device) -> torch.device:
    """Where a collective's tensor must live: NCCL talks CUDA only; gloo takes any CPU tensor."""
    d = torch.distributed
    if d.get_backend() == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def agree(vector: torch.Tensor, masks: Mapping[Reduce, torch.Tensor]) -> torch.Tensor:
    """Reduce ``vector`` across ranks, each slot as the mask it is in says (``Reduce``; a slot in
    no mask is summed). One ``all_reduce(SUM)``, plus one ``all_reduce(MAX)`` when a MAX or FIRST
    slot is present. No-op without a process group."""
    n = world_size()
    if n == 1:
        return vector
    d = torch.distributed
    comm = _comm_device(vector.device)
    norm, mean = masks.get(Reduce.NORM), masks.get(Reduce.MEAN)
    high, first = masks.get(Reduce.MAX), masks.get(Reduce.FIRST)
    local = masks.get(Reduce.LOCAL)
    # NORM slots hold this rank's share of a norm: its square is what adds up across ranks.
    work = (torch.where(norm, vector.square(), vector) if norm is not None else vector).to(comm, copy=True)
    d.all_reduce(work, op=d.ReduceOp.SUM)
    out = work.to(vector.device)
    if mean is not None:
        out = torch.where(mean, out / n, out)
    if norm is not None:
        out = torch.where(norm, out.sqrt(), out)
    if high is not None or first is not None:
        # One max collective serves both: maxima as they are (NaN as +inf), first indices negated
        # (the max of -i is minus the smallest i; "none here" (-1) becomes -inf, never the max).
        top = torch.full_like(vector, float("-inf"))
        if high is not None:
            top = torch.where(high, torch.nan_to_num(vector, nan=float("inf")), top)
        if first is not None:
            top = torch.where(first, -torch.where(vector < 0, torch.full_like(vector, float("inf")), vector), top)
        top = top.to(comm, copy=True)
        d.all_reduce(top, op=d.ReduceOp.MAX)
        top = top.to(vector.device)
        if high is not None:
            out = torch.where(high, top, out)
        if first is not None:
            out = torch.where(first, torch.where(torch.isinf(top), torch.full_like(top, -1.0), -top), out)
    if local is not None:
        out = torch.where(local, vector, out)
    return out


def same_layout(keys: Sequence[str], size: int, error: str) -> None:
    """Whether every rank lays out the same ``size`` values under the same ``keys`` (their order
    included), checked in one small max collective before a reduction by position: where the ranks
    differ, a ``ConfigError`` on every rank (``layout_error``), where the reduction itself would
    abort inside gloo (vectors of different lengths) or add up unrelated values. No-op without a
    process group."""
    if world_size() == 1:
        return
    d = torch.distributed
    sig = float(zlib.crc32("\0".join(keys).encode()))
    head = torch.tensor([size, sig, -size, -sig], dtype=torch.float64).to(_comm_device(torch.device("cpu")))
    d.all_reduce(head, op=d.ReduceOp.MAX)
    top_n, top_sig, low_n, low_sig = head.tolist()
    if top_n != -low_n or top_sig != -low_sig:
        raise layout_error(keys, size, error)


def layout_error(keys: Sequence[str], size: int, error: str) -> ConfigError:
    """The error of ranks that laid out different values: ``error``, then what this rank has."""
    shown = f"{list(keys)[:12]}" + (f" and {len(keys) - 12} more" if len(keys) > 12 else "")
    return ConfigError(f"{error} (rank {rank()} has {size} values under {shown})")


def agree_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """``observe_eval``'s metrics, the same on every rank: the mean over ranks of each value.

    Every rank must call it (``observe_eval`` on every rank, as the training step is) with the same
    metric names; different names on different ranks are a ``ConfigError`` on every rank (checked
    first, in a small max collective, so no rank waits on a mismatched reduction). No-op (a copy)
    without a process group."""
    values = {k: float(v) for k, v in metrics.items()}
    n = world_size()
    if n == 1:
        return values
    d = torch.distributed
    keys = sorted(values)
    same_layout(
        keys,
        len(keys),
        "observe_eval: the ranks passed different metric names; call observe_eval on every rank with the "
        "same names, so that every rank takes the same decision",
    )
    vec = torch.tensor([values[k] for k in keys], dtype=torch.float64).to(_comm_device(torch.device("cpu")))
    d.all_reduce(vec, op=d.ReduceOp.SUM)
    mean = dict(zip(keys, (vec / n).tolist()))
    return {k: mean[k] for k in values}


def same_path(path: str) -> str:
    """Rank 0's ``path`` on every rank (one broadcast): a run folder every rank writes into must be
    one folder, whatever name each rank would have made up. No-op without a process group."""
    if world_size() == 1:
        return path
    box: list[Any] = [os.fspath(path)]
    torch.distributed.broadcast_object_list(box, src=0)
    return str(box[0])


_CULPRITS = ("loss", "grad", "param", "inputs")  # the slots of stats.NONFINITE_BY_RANK, in order


def culprit_ranks(by_rank: Sequence[float] | None) -> dict[str, list[int]]:
    """Read the per-rank one-hot slots of ``stats.NONFINITE_BY_RANK`` (4 x world values, summed
    across ranks): the ranks whose own loss, gradients (as they were after the gradient
    reduction), parameters, forward inputs were non-finite. Empty without a process group."""
    if not by_rank:
        return {}
    n = len(by_rank) // len(_CULPRITS)
    parts = [by_rank[i * n : (i + 1) * n] for i in range(len(_CULPRITS))]
    return {what: [r for r, v in enumerate(part) if v != 0] for what, part in zip(_CULPRITS, parts)}


def rank_slots(
    loss: Any, grad_count: torch.Tensor, param_count: torch.Tensor, input_count: torch.Tensor
) -> torch.Tensor:
    """The one-hot per-rank vector of ``stats.NONFINITE_BY_RANK``: whether this rank's ``loss``
    (a 0-d tensor, or None) is non-finite, its local non-finite gradient, parameter and input
    counts, each in this rank's slot of its quarter, zeros elsewhere. No host read."""
    n, r, k = world_size(), rank(), len(_CULPRITS)
    device = grad_count.device
    bad_loss = (~torch.isfinite(loss.detach())).any() if isinstance(loss, torch.Tensor) else torch.zeros(())
    values = torch.stack(
        [v.to(device=device, dtype=torch.float32).reshape(()) for v in (bad_loss, grad_count, param_count, input_count)]
    )
    out = torch.zeros(k * n, dtype=torch.float32, device=device)
    return out.index_copy_(0, torch.arange(k, device=device) * n + r, values)


def tell_ranks(findings: Sequence[Any], by_rank: Sequence[float] | None) -> None:
    """Name the rank(s) where a non-finite value started in the non-finite findings and a bad batch (their
    ``data["ranks"]`` and message): the ranks whose own loss was non-finite, else those whose
    forward inputs held non-finite values (without ``combine()`` no loss is known), else those
    whose gradients (after the gradient reduction, which spreads a NaN to every rank) or
    parameters were.
    ``data["ranks_by_kind"]`` keeps all four lists. Nothing without a process group."""
    from ..events import BAD_BATCH, NONFINITE_GRAD, NONFINITE_LOSS, NONFINITE_PARAM

    seen = culprit_ranks(by_rank)
    if not seen:
        return
    for f in findings:
        if f.kind == NONFINITE_PARAM:
            where, why = seen["param"], "non-finite parameters"
        elif f.kind in (NONFINITE_LOSS, NONFINITE_GRAD, BAD_BATCH) and seen["loss"]:
            where, why = (
                seen["loss"],
                "its loss was non-finite" if len(seen["loss"]) == 1 else "their losses were non-finite",
            )
        elif f.kind in (NONFINITE_LOSS, NONFINITE_GRAD, BAD_BATCH) and seen["inputs"]:
            where = seen["inputs"]
            why = f"{'its' if len(where) == 1 else 'their'} inputs held non-finite values"
        elif f.kind in (NONFINITE_GRAD, BAD_BATCH):  # (a NaN input a mask kept from the loss)
            where, why = seen["grad"], "non-finite gradients"
        else:
            continue
        if not where:
            continue
        f.data["ranks"] = where
        f.data["ranks_by_kind"] = seen
        label = f"rank {where[0]}" if len(where) == 1 else f"ranks {', '.join(map(str, where))}"
        f.message += f" (started on {label}: {why})"


def share_scaler_skip(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """The GradScaler skips a step where *this* rank found inf/NaN. With sharded gradients (FSDP2)
    another rank's shard may hold the overflow while this one is finite: once the agreed read says
    some rank found one, mark it found here too, so every rank skips the step and lowers its scale
    alike. No host read; a no-op when this rank found one already."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    for found in state.get("found_inf_per_device", {}).values():
        found.fill_(1.0)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel / DataParallel (their names carry 'module.') and
    inside ``torch.compile`` (its names carry '_orig_mod.'), so groups, events and checkpoints use
    the model's own parameter names."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while True:
        if isinstance(model, wrappers):
            inner = model.module
        elif type(model).__name__ == "OptimizedModule":
            inner = getattr(model, "_orig_mod", None)
        else:
            return model
        if not isinstance(inner, nn.Module):
            return model
        model = inner
