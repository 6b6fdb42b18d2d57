"""Sharded parameters (FSDP2's ``fully_shard``: parameters, gradients and optimizer state are DTensors).

The monitor works on each rank's local shard and never gathers a full parameter:

- ``Layout`` (built at attach) knows which parameters are sharded and each one's *share* of the
  global sum of squares; statistics measure the local shards (``Layout.local``) and the step's one
  reduction completes them (``stats.Reduce.NORM``). A parameter split over the ranks of a mesh
  dimension counts fully on each of them; a tensor every rank holds alike (DDP, a replicated mesh
  dimension) counts 1/copies on each, so summing over ranks counts it once.
- ``global_group_norms``: per-group gradient norms over every shard for the clip action, in one
  collective (none when nothing is sharded).
- ``LocalShard`` / ``rebuild``: in-memory snapshots keep a copy of this rank's local shard (on the
  host) and what rebuilds the DTensor; restoring loads it back into the same sharding. Host memory
  per rank is the rank's shards only, as a single process would hold its whole model.
- ``optimizer_state_by_name`` / ``optimizer_state_by_index``: ``optimizer.state_dict()`` keyed by
  parameter name (FQN) instead of position, the format ``torch.distributed.checkpoint`` reshards
  (``sfmonitor.dcp``).

Without torch.distributed, or without DTensor parameters, every function here is the identity or
close to it. FSDP2's public ``torch.distributed.fsdp.fully_shard`` needs torch >= 2.6.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .integrations.distributed import world_size
from .stats import TensorIndex, norms

__all__ = [
    "Layout",
    "LocalShard",
    "clean_name",
    "global_group_norms",
    "is_sharded",
    "local",
    "locals_",
    "optimizer_state_by_index",
    "optimizer_state_by_name",
    "rebuild",
    "scale_slice_",
    "split_coordinates",
    "split_sizes",
    "square_share",
]

# Wrapper modules whose attribute name shows up in parameter names: torch.compile's
# OptimizedModule, activation checkpointing, FSDP1. DDP's "module." is handled by unwrap().
WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor (< 2.4)
        return None
    return DTensor


_DTENSOR: Any = _dtensor_type()


def is_sharded(t: Any) -> bool:
    """A DTensor (FSDP2 parameter, gradient or optimizer state)."""
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def local(t: Any) -> Any:
    """This rank's part of a DTensor (a view: writing into it writes into the DTensor); anything
    else as it is. (The DTensor's own local tensor, read directly: ``to_local()`` costs ~10 us of
    Python per call, which adds up over every parameter and gradient of every step.)"""
    if not is_sharded(t):
        return t
    part = getattr(t, "_local_tensor", None)
    return part if isinstance(part, torch.Tensor) else t.to_local()


# Tensors of these exact types are neither DTensors nor other subclasses: what a per-step walk
# over every parameter can take as it is, without a DTensor lookup per tensor
PLAIN_TYPES = frozenset({torch.Tensor, nn.Parameter})


def all_plain(tensors: Iterable[Any]) -> bool:
    """Whether every tensor is a plain tensor or parameter (``PLAIN_TYPES``)."""
    return all(map(PLAIN_TYPES.__contains__, map(type, tensors)))


def same_objects(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether ``a`` and ``b`` hold the same objects in the same order (by identity: no ``==`` on
    tensors, no Python call per item)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def locals_(tensors: Iterable[Any]) -> list[Any]:
    """``local`` of each tensor, as a list."""
    return [local(t) for t in tensors]


def square_share(t: Any, world: int | None = None) -> float:
    """The weight of this rank's ``||local part||^2`` in the global ``||t||^2`` when every rank's
    weighted squares are summed: 1 / (how many ranks hold each element). A DTensor sharded over
    mesh dimensions of total size S is held by world / S ranks (the replicas of its mesh, or of
    data parallelism around it); a plain tensor under a process group by every rank (DDP)."""
    world = world_size() if world is None else world
    if world <= 1:
        return 1.0
    if not is_sharded(t):
        return 1.0 / world
    return math.prod(split_sizes(t)) / world


def _split_dims(t: Any) -> list[int]:
    """The mesh dimensions that split DTensor ``t`` (each rank holds a part): every placement but
    ``Replicate`` and ``Partial``. FSDP2 over a tensor-parallel ``Shard(0)`` places
    ``_StridedShard(0)`` on the data-parallel dimension, which splits too but is no ``Shard``."""
    return [i for i, p in enumerate(t.placements) if not (p.is_replicate() or p.is_partial())]


def split_sizes(t: Any) -> list[int]:
    """The sizes of the mesh dimensions that split DTensor ``t``."""
    return [t.device_mesh.size(i) for i in _split_dims(t)]


def split_coordinates(t: Any) -> list[int]:
    """This rank's coordinates on the mesh dimensions that split DTensor ``t``: ranks with the same
    coordinates hold the same part of it."""
    coords = t.device_mesh.get_coordinate() or []
    return [coords[i] for i in _split_dims(t)]


def clean_name(name: str) -> str:
    """A parameter name without wrapper components (``_orig_mod.`` of torch.compile,
    ``_checkpoint_wrapped_module.``, FSDP1's ``_fsdp_wrapped_module.``): the name the plain model
    has, which is what a checkpoint is keyed by."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


class Layout:
    """How the monitor's parameters are laid out across ranks (built once, at attach)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.world = world_size()
        self.sharded = any(is_sharded(p) for p in params)
        self.shares = [square_share(p, self.world) for p in params]
        # Without a process group every share is 1: the plain, single-process arithmetic.
        self.weighted = self.world > 1

    def local(self, tensors: Iterable[Any]) -> list[Any]:
        """Each tensor's local part (a list, same order; None stays None)."""
        tensors = list(tensors)
        if not self.sharded:
            return tensors
        return [local(t) for t in tensors]

    def detached(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's local part, detached (parameters, for their norms and copies). Under
        ``torch.no_grad()`` plain tensors are given as they are: nothing recorded reads them, and a
        new tensor object per parameter, several times a step, kept Python's garbage collector busy
        (a model of 1,160 parameters: 4 ms a call)."""
        if not self.sharded:
            return list(tensors) if not torch.is_grad_enabled() else list(map(torch.Tensor.detach, tensors))
        return [local(t).detach() for t in tensors]

    def index(self, positions: Sequence[int], groups: Sequence[int], device: torch.device) -> TensorIndex:
        """The ``TensorIndex`` of the parameters at ``positions`` (their groups: ``groups[i]``)."""
        dtype = torch.float32 if device.type == "mps" else torch.float64
        share = torch.tensor([self.shares[i] for i in positions], dtype=dtype).to(device) if self.weighted else None
        return TensorIndex(
            group=torch.tensor([groups[i] for i in positions], dtype=torch.long).to(device),
            share=share,
            position=torch.tensor(list(positions), dtype=torch.long).to(device),
        )


def global_group_norms(grads: Mapping[str, Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """0-d float norm per group over every shard of its tensors: local norms, each rank's share of
    the squares, one ``all_reduce`` for all groups together. When no tensor is sharded the local
    norms are the global ones (replicated gradients) and no collective runs. No host read."""
    groups = [g for g, ts in grads.items() if ts]
    if not groups:
        return {}
    if not any(is_sharded(t) for g in groups for t in grads[g]):
        return {g: torch.linalg.vector_norm(norms(grads[g])) for g in groups}
    world = world_size()
    sq = []
    for g in groups:
        per = norms([local(t) for t in grads[g]]).double()
        share = torch.tensor([square_share(t, world) for t in grads[g]], dtype=per.dtype, device=per.device)
        sq.append((per.square() * share).sum())
    total = torch.stack(sq)
    d = torch.distributed
    comm = total.to(torch.device("cuda", torch.cuda.current_device())) if d.get_backend() == "nccl" else total
    d.all_reduce(comm, op=d.ReduceOp.SUM)
    out = comm.to(total.device).sqrt().float()
    return {g: out[i] for i, g in enumerate(groups)}


# --------------------------------------------------------------------------------------------
# Local copies of sharded state (snapshots)
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class LocalShard:
    """A copy of this rank's part of a DTensor, with what it takes to rebuild the DTensor (mesh,
    placements, global shape and stride, the device the local part lived on). Lives in memory
    only (snapshots); checkpoints on disk go through ``sfmonitor.dcp``."""

    data: torch.Tensor
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, t: Any, device: Any = None) -> LocalShard:
        part = t.to_local().detach()
        data = part.to(device, copy=True) if device is not None else part.clone()
        return cls(data, t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()), part.device)

    def copy(self, device: Any = None) -> LocalShard:
        data = self.data.to(device, copy=True) if device is not None else self.data.clone()
        return LocalShard(data, self.mesh, self.placements, self.shape, self.stride, self.device)

    def dtensor(self, clone: bool = True, where_kept: bool = False) -> Any:
        """The DTensor again, its local part on the device it came from (a fresh copy unless
        ``clone`` is False and it is there already); ``where_kept``: on the copy's own device
        (host memory), to be read, never computed with."""
        assert _DTENSOR is not None
        data = self.data.to(self.data.device if where_kept else self.device, copy=clone)
        return _DTENSOR.from_local(
            data, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def rebuild(tree: Any, clone: bool = False, where_kept: bool = False) -> Any:
    """``tree`` with every ``LocalShard`` turned back into its DTensor (``LocalShard.dtensor``);
    other leaves as they are."""
    if isinstance(tree, LocalShard):
        return tree.dtensor(clone=clone, where_kept=where_kept)
    if isinstance(tree, Mapping):
        return {k: rebuild(v, clone, where_kept) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rebuild(v, clone, where_kept) for v in tree]
    if isinstance(tree, tuple):
        return tuple(rebuild(v, clone, where_kept) for v in tree)
    return tree


# --------------------------------------------------------------------------------------------
# Optimizer state keyed by parameter name
# --------------------------------------------------------------------------------------------


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in ``state_dict()`` order (position i is id i)."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            out.append(names.get(id(p), f"optimizer.param_groups[{gi}].params[{pi}]"))
    return out


def optimizer_state_by_name(
    state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer.state_dict()`` (or a copy of it) keyed by parameter name: ``{"state": {name:
    {...}}, "param_groups": [{..., "params": [name, ...]}]}``, the layout
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` uses; it does not depend
    on the order of the parameters, so it loads into another sharding or world size."""
    names = _param_names(model, optimizer)
    return {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def optimizer_state_by_index(
    state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The inverse of ``optimizer_state_by_name`` for this optimizer: ready for
    ``optimizer.load_state_dict``. A name the optimizer does not hold is a ``KeyError`` naming it."""
    index = {n: i for i, n in enumerate(_param_names(model, optimizer))}

    def at(name: str) -> int:
        if name not in index:
            raise KeyError(f"the checkpoint's optimizer state names parameter {name!r}, which this optimizer lacks")
        return index[name]

    return {
        "state": {at(n): v for n, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [at(n) for n in g["params"]]} for g in state["param_groups"]],
    }


def max_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` maxed element by element over the ranks (one max collective where the monitor
    sees more than one rank; ``value`` itself otherwise), on the device the backend needs; no host
    read: a choice every rank must make alike."""
    if world_size() <= 1:
        return value
    d = torch.distributed
    comm = value.to(torch.device("cuda", torch.cuda.current_device())) if d.get_backend() == "nccl" else value
    d.all_reduce(comm, op=d.ReduceOp.MAX)
    return comm


def agree_pairs(pairs: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The (model weight, master) pairs every rank made of its ``n`` optimizer parameters outside
    the model (``monitor.master_copies``: equal values, which masters built before DDP's broadcast
    of rank 0's weights are not on the other ranks), in one ``max_over_ranks`` of each master's
    weight and its negative, at attach and at the first step where masters tied by value (every
    rank alike: the pairs it checks are agreed), so that every rank lays out the same statistics."""
    if world_size() <= 1 or n == 0:
        return list(pairs)
    mine = torch.zeros(n, dtype=torch.float64)
    for i, j in pairs:
        mine[j] = i + 1
    both = max_over_ranks(torch.cat([mine, -mine])).tolist()
    return [(i, j) for i, j in pairs if both[j] == -both[n + j] == i + 1]


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite, on every rank when any of them is sharded
    (one max collective then; one host read either way), so every rank answers the same."""
    if not tensors:
        return True
    bad = (~torch.isfinite(norms([local(t) for t in tensors]))).any().double()
    if any(is_sharded(t) for t in tensors):
        bad = max_over_ranks(bad)
    return not bool(bad)


def gaussian_noise(tensors: Sequence[torch.Tensor], generator: torch.Generator) -> tuple[list[Any], list[Any]]:
    """(local parts of ``tensors``, standard normal noise shaped like each), drawn on the host from
    ``generator`` (the same on every rank). A tensor every rank holds alike (a plain tensor, a
    ``Replicate`` DTensor) gets the same noise on every rank. A DTensor's part gets the noise of
    that part, from a generator seeded by one shared draw, the tensor and the rank's coordinates
    on the mesh dimensions that split it: ranks that hold the same part (the replicas of HSDP, the
    ranks of a tensor-parallel group for what data parallelism splits) draw alike, and different
    parts differ (else every shard would repeat one pattern). Nothing sharded: exactly the draws of
    ``torch.randn(shape, generator=generator)`` in order, as in a single process."""
    parts = [local(t) for t in tensors]
    base = int(torch.randint(2**62, (1,), generator=generator)) if any(is_sharded(t) for t in tensors) else 0
    noise = []
    for i, (t, part) in enumerate(zip(tensors, parts)):
        coords = split_coordinates(t) if is_sharded(t) else []
        draw = generator
        if coords:
            draw = torch.Generator().manual_seed((base + hash((i, *coords))) % 2**63)
        noise.append(torch.randn(part.shape, generator=draw).to(device=part.device, dtype=part.dtype))
    return parts, noise


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A sharded model (FSDP2) watched with an optimizer that holds none of its parameters: the
    optimizer was built before ``fully_shard`` replaced them, and it would update tensors the model
    no longer uses. A ``ConfigError`` says so at attach."""
    from .errors import ConfigError

    params = list(model.parameters())
    if not any(is_sharded(p) for p in params):
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in held for p in params):
        raise ConfigError(
            "attach: the model is sharded (FSDP2) but the optimizer holds none of its parameters; "
            "build the optimizer after fully_shard(), from model.parameters()"
        )


@torch.no_grad()
def scale_slice_(t: Any, dim: int, start: int, length: int, scale: float) -> None:
    """``t.narrow(dim, start, length).mul_(scale)`` that reaches a DTensor's shards: each rank
    scales the part of the slice it holds. (On an FSDP2 parameter, sharded on dim 0, an in-place
    op on ``narrow`` of the DTensor itself changes nothing: it runs on a redistributed copy.)"""
    if not is_sharded(t):
        t.narrow(dim, start, length).mul_(scale)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    lo, hi = max(start, offset[dim]), min(start + length, offset[dim] + shape[dim])
    if hi > lo:
        local(t).narrow(dim, lo - offset[dim], hi - lo).mul_(scale)
