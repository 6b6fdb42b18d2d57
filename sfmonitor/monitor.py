"""The Monitor: attach to any model and optimizer, watch every optimizer step, rescue the run.

One optimizer step is one ``StepRecord`` (record.py). Read ``Monitor._run_pipeline`` first: it is
the whole per-step story, in this fixed order,

    1. stats      gather the step's statistics as tensors, read them to the host ONCE
    2. detectors  turn numbers into findings (they never touch the model)
    3. policy     turn findings into decisions (escalation, cooldowns, budgets)
    4. actions    the only code that changes training (skip, clip, reweight, lr drop, rollback...)
    5. sinks      every finding becomes an event with the actions it caused; metrics are logged

Two entry points drive a step, whatever calls them (the optimizer's step hooks, the GradScaler
wrapper, an integration); both are safe to call twice:

    before_update()  where the unscaled gradients are ready and the update has not landed: runs
                     the pipeline (record OPEN -> DECIDED)
    after_update()   once the optimizer ran or was skipped: puts back what the step hid or
                     changed, measures the update, closes the record (DECIDED -> LANDED)

An exception anywhere in a step closes its record as ABORTED with everything put back, so the
next step starts clean and is fully checked.

Skipping a step: the pipeline hides every gradient (``p.grad = None``) before the optimizer runs.
torch.optim optimizers leave parameters without a gradient untouched (no state update, no step
counter), so parameters and optimizer state stay bit-identical; the gradients are put back after.
docs/design.md walks through one step from hook to sink.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import itertools
import math
import numbers
import operator
import os
import statistics
import sys
import time
import warnings
import weakref
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_leaves

from . import actions as A
from . import sharding
from . import stats as S
from .attention import QK_CLIP, routine_check
from .checkpoint import SnapshotRing, state_dict_needs_every_rank
from .config import MonitorConfig
from .detectors import Detector, build_detectors
from .events import (
    ACTIVATION_OVERFLOW,
    BAD_BATCH,
    BN_VAR_SPIKE,
    CLIP,
    GRAD_NOISE,
    GRAD_SPIKE,
    LARGE_UPDATE,
    LOSS_COMPONENT_SPIKE,
    LOSS_LEVEL_RETURN,
    LOSS_LEVEL_SHIFT,
    LOSS_RATIO_IMBALANCE,
    LOSS_SPIKE,
    LR_DROP,
    NEW_REGIME,
    NONFINITE_GRAD,
    NONFINITE_LOSS,
    NONFINITE_PARAM,
    PRECISION_FALLBACK,
    REWEIGHT,
    ROLLBACK,
    SKIP_STEP,
    UNDO,
    UPDATE_RATIO_SPIKE,
    VANISHING_GRADIENT,
    ZERO_GRAD_MISSING,
    ZERO_GRADIENT,
    ConfigError,
    Decision,
    Event,
    Finding,
    NonFiniteError,
    StopTraining,
    changed_something,
)
from .forensics import (
    MAX_STEP_BATCHES,
    BatchRecorder,
    BundleTracker,
    batch_input_stats,
    in_backward,
    load_manifest,
    write_bundle,
)
from .gradreset import GradResetProbe
from .integrations.distributed import (
    agree_metrics,
    alone,
    rank,
    rank_slots,
    same_path,
    share_scaler_skip,
    tell_ranks,
    unwrap,
    world_size,
)
from .loopwrites import LoopWrites, own_write
from .policy import Policy
from .record import Outcome, Phase, StepRecord
from .registry import KINDS, action_order, register_kind
from .sharding import local
from .sinks import SinkRouter, make_sink
from .sinks.console import ConsoleSink
from .summary import (
    RUN_FILE,
    SUMMARY_FILE,
    Tally,
    format_memory,
    format_summary,
    memory_plan,
    run_metadata,
    run_summary,
    write_json,
)
from .undo import (
    Arena,
    Scratch,
    UndoState,
    buffer_slots,
    group_entries,
    put_entries,
    running_statistics_by_layer,
    update_norms,
    written_entries,
)
from .userclip import UserClip, grads_scaled
from .watch import ActivationWatch

# Answers to what a step's forward and backward showed: void once an undo or a rollback leaves
# the state that made them (the step is skipped with it).
_MOOT_AFTER_RESTORE = (SKIP_STEP, CLIP, GRAD_NOISE, QK_CLIP, PRECISION_FALLBACK, REWEIGHT)
_TOTAL = S.LOSS_TOTAL.removeprefix(S.LOSS.format(""))  # the `where` of a finding about loss/total


def _drop_moot(decisions: list[Decision], actions: tuple[str, ...], answered_by: str) -> list[Decision]:
    """``decisions`` without those taking ``actions``; each dropped one's finding says what answered it."""
    kept = []
    for d in decisions:
        if d.action in actions:
            d.cause.data["answered_by"] = answered_by
        else:
            kept.append(d)
    return kept


_RUN_COUNTER = itertools.count()
LOCK_FILE = ".sfmonitor.lock"  # in run_dir while a monitor writes there
DISABLE_ENV = "SFMONITOR_DISABLED"  # set to 1: attach() does nothing (one line on stderr)
OTHER = "other"  # the group of parameters held by the root module or named by no group
TOTAL = "total"  # grad_norm/total: no group may take this name
NONFINITE_KINDS = (NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAM, BAD_BATCH)
# Findings about the batch itself: a skip for one of them is a batch never seen (its overflow is
# not the loss scale's doing).
BATCH_FAULT_KINDS = (BAD_BATCH, NONFINITE_LOSS, LOSS_SPIKE)
ON_DEMAND = "on_demand"  # the kind of a bundle written because the user asked for one
# Layers whose units dead_units/<group> counts: dim 0 of their weight is the output unit (not
# nn.Embedding: a row is a token, unused ones have none; not ConvTranspose: dim 0 is the input).
_UNIT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
MIN_UNITS = 8  # a layer with fewer units is not counted: one unit would be an eighth of it


def resolve_groups(
    model: nn.Module, groups: Mapping[str, Any] | None = None
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the model's parameters into named groups.

    None: one group per top-level child module; parameters held by the root go to "other"; a tied
    weight belongs to the module ``named_parameters()`` lists first. A single-trunk model (one
    top-level child holds every parameter: a GPT's ``transformer``, a tied head holding none) is
    grouped by the structure below that trunk instead: one group per child there, and one per
    block of a ``ModuleList``/``Sequential`` of blocks (``wte``, ``wpe``, ``h.0``, ``h.1``, ...,
    ``ln_f``). A dict maps a group name (a string) to an ``nn.Module``, one Parameter, an iterable
    of Parameters, or a parameter-name prefix; parameters named by no group go to "other"; a
    parameter in two groups, or one the model does not hold, is an error naming it. "total" is
    reserved (``grad_norm/total`` is the norm over all groups).
    """
    model = unwrap(model)  # DDP / DataParallel / torch.compile: group by the model's own names
    named = list(model.named_parameters())  # de-duplicates tied weights: first name wins
    if groups is None:
        return _default_groups(model, named)
    if not isinstance(groups, Mapping):
        raise ConfigError(
            f"groups: expected None or a dict {{name: module | parameters | prefix}}, got {type(groups).__name__}"
        )
    by_id = {id(p): name for name, p in named}
    owner: dict[int, str] = {}
    for gname, spec in groups.items():
        if not isinstance(gname, str):
            raise ConfigError(
                f"groups: the name {gname!r} is a{'n' if type(gname).__name__[0] in 'aeiou' else ''} "
                f"{type(gname).__name__}; group names must be strings (they name grad_norm/<name>)"
            )
        if not gname.strip():
            raise ConfigError(
                f"groups: a group has an empty or blank name ({gname!r}); give it one (it names grad_norm/<name>)"
            )
        if isinstance(spec, nn.Module):
            for pname, p in spec.named_parameters():
                _check_group_member(p, f"groups[{gname!r}] (a {type(spec).__name__}): its parameter {pname!r},", by_id)
            members = [id(p) for p in spec.parameters()]
        elif isinstance(spec, str):
            members = [id(p) for n, p in named if n == spec or n.startswith(spec.rstrip(".") + ".")]
            if not members:
                raise ConfigError(f"groups[{gname!r}]: prefix {spec!r} matches no parameter of the model")
        elif isinstance(spec, torch.Tensor):  # one Parameter: a group of one (iterating it gives its rows)
            _check_group_member(spec, f"groups[{gname!r}]", by_id)
            members = [id(spec)]
        else:
            try:
                items = list(spec)
            except TypeError:
                raise ConfigError(
                    f"groups[{gname!r}]: expected an nn.Module, a Parameter, an iterable of "
                    f"Parameters or a name prefix, got {type(spec).__name__}"
                ) from None
            for i, p in enumerate(items):
                _check_group_member(p, f"groups[{gname!r}][{i}]", by_id)
            members = [id(p) for p in items]
        for pid in members:
            if pid in owner and owner[pid] != gname:
                raise ConfigError(f"parameter {by_id[pid]!r} is in two groups: {owner[pid]!r} and {gname!r}")
            owner[pid] = gname
    if TOTAL in groups:
        raise ConfigError(f"groups: the name {TOTAL!r} is reserved (grad_norm/total is the norm over all groups)")
    left = [name for name, p in named if id(p) not in owner]
    if OTHER in groups and left:
        raise ConfigError(
            f"groups[{OTHER!r}]: the parameters no group names go to {OTHER!r} "
            f"({', '.join(repr(n) for n in left[:5])}{', ...' if len(left) > 5 else ''}), and would be merged "
            f"with yours; name your group differently, or put those parameters in a group"
        )
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for gname in groups:
        out[gname] = []
    for name, p in named:
        out.setdefault(owner.get(id(p), OTHER), []).append((name, p))
    return {g: ps for g, ps in out.items() if ps}


def like_blocks(model: nn.Module, param_group: Mapping[str, str], least: int = 3) -> dict[str, list[str]]:
    """The children that hold parameters of every ``ModuleList``/``Sequential`` with at least
    ``least`` of them, all in one group (a BERT's ``encoder.layer``: its 12 layers sit in the
    group of ``bert``, beside the embeddings): block name -> the names of its parameters (as
    ``param_group`` holds them), in model order. Which of them are alike is the detectors' to
    judge (T5's first block holds the relative position bias, the others do not; a Sequential's
    activations hold nothing and are left out). A list whose blocks are groups of their own (a
    single trunk's) is left out, and so is one inside another list found."""
    model = unwrap(model)
    out: dict[str, list[str]] = {}
    found: list[str] = []
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or any(path.startswith(f"{b}.") for b in found):
            continue
        prefix = f"{path}." if path else ""
        members = {
            f"{prefix}{c}": [n for n in (f"{prefix}{c}.{p}" for p, _ in child.named_parameters()) if n in param_group]
            for c, child in m.named_children()
        }
        members = {b: names for b, names in members.items() if names}  # (tied weights: named once)
        if len(members) < least or len({param_group[n] for names in members.values() for n in names}) != 1:
            continue  # (several groups: the blocks are groups already, or split across them)
        found.append(path)
        out.update(members)
    return out


def _check_group_member(p: Any, where: str, by_id: Mapping[int, str]) -> None:
    """One item of a group given as parameters: a tensor the model holds as a parameter."""
    if not isinstance(p, torch.Tensor):
        raise ConfigError(f"{where}: expected a Parameter, got {type(p).__name__}")
    if id(p) not in by_id:
        raise ConfigError(
            f"{where}: a {type(p).__name__} of shape {tuple(p.shape)} is not in the model (a copy, a slice, "
            f"another model's?); pass one of the model's own parameters, its module or a name prefix"
        )


def _missing_folders(path: str) -> list[str]:
    """The folders of ``path`` that do not exist yet, the deepest first (what makedirs would make)."""
    out: list[str] = []
    path = os.path.abspath(path)
    while path and not os.path.exists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def _default_groups(
    model: nn.Module, named: list[tuple[str, nn.Parameter]]
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """One group per top-level child; below a single trunk, one per child or block (see resolve_groups)."""
    trunk, prefix = model, ""
    while True:  # descend into the only child that holds parameters
        rel = [n[len(prefix) :] for n, _ in named]
        if not rel or any("." not in r for r in rel):
            break  # the trunk holds parameters itself
        holders = sorted({r.split(".", 1)[0] for r in rel})
        child = getattr(trunk, holders[0], None) if len(holders) == 1 else None
        if not isinstance(child, nn.Module) or not any(True for _ in child.named_children()):
            break  # several children, or a leaf (an nn.Linear): one group each
        trunk, prefix = child, prefix + holders[0] + "."
    blocks = {name for name, c in trunk.named_children() if prefix and isinstance(c, (nn.ModuleList, nn.Sequential))}
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in named:
        parts = name[len(prefix) :].split(".")
        if len(parts) == 1:
            group = OTHER
        elif parts[0] in blocks and len(parts) > 2:
            group = f"{parts[0]}.{parts[1]}"
        else:
            group = parts[0]
        if group == TOTAL:
            group = TOTAL + "_"  # grad_norm/total is the norm over all groups
        out.setdefault(group, []).append((name, p))
    return out


def master_copies(
    named: Sequence[tuple[str, nn.Parameter]], outside: Sequence[torch.Tensor], by_grad: bool = False
) -> tuple[list[tuple[int, int]], set[int]]:
    """Which optimizer parameters outside the model are fp32 masters of the model's weights
    (Megatron-LM's Float16 optimizer, apex O2, hand-written mixed precision: the model computes in
    bf16/fp16, the optimizer updates fp32 copies, and the loop copies them back after each step).
    Pairs (position in ``named``, position in ``outside``): a model weight that takes gradients the
    optimizer does not update, of the master's shape and device, equal to the master rounded to
    its dtype (the loop's copy). Where several weights are equal to one master (LayerNorms at
    attach: ones; biases: zeros), ``by_grad`` (the gradients of a step are there) takes the one
    whose gradient is the most parallel to the master's (the loop's copy of it, scaled or not);
    else, or without gradients, the first in the model's order. Also returns the masters paired by
    such a tie (positions in ``outside``). DTensors are left alone (FSDP2 keeps its own masters).
    One read of each candidate pair."""
    free = [
        i
        for i, (_, p) in enumerate(named)
        if p.requires_grad and not sharding.is_sharded(p) and p.layout == torch.strided
    ]
    pairs: list[tuple[int, int]] = []
    tied: set[int] = set()
    with torch.no_grad():
        for j, m in enumerate(outside):
            if sharding.is_sharded(m) or m.layout != torch.strided:
                continue
            same = [
                k
                for k, i in enumerate(free)
                if (p := named[i][1]).shape == m.shape
                and p.device == m.device
                and torch.equal(m.detach().to(p.dtype), p.detach())
            ]
            if not same:
                continue
            k = same[0]
            if len(same) > 1:
                tied.add(j)
                if by_grad:
                    k = same[_most_parallel(m.grad, [named[free[c]][1].grad for c in same])]
            pairs.append((free[k], j))
            del free[k]
    return pairs, tied


def _most_parallel(grad: torch.Tensor | None, grads: Sequence[torch.Tensor | None]) -> int:
    """The position in ``grads`` of the gradient most parallel to ``grad`` (the largest cosine);
    0 where ``grad`` is missing or none can be compared."""
    if grad is None or grad.is_sparse:
        return 0
    a = grad.detach().double().flatten()
    best, best_cos = 0, -math.inf
    for k, g in enumerate(grads):
        if g is None or g.is_sparse or g.shape != grad.shape:
            continue
        b = g.detach().double().flatten()
        cos = float(a @ b) / max(float(a.norm() * b.norm()), 1e-300)
        if cos > best_cos:
            best, best_cos = k, cos
    return best


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def by_finding(outcomes: Sequence[Outcome], finding: Finding) -> Outcome:
    return next(o for o in outcomes if o.finding is finding)


def _check_scalar(value: Any, what: str) -> None:
    """combine()'s inputs: scalar tensors, with an error that names the bad one."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"combine: {what} is a {type(value).__name__} ({value!r}); expected a scalar tensor "
            f"(a loss that autograd can differentiate)"
        )
    if value.numel() != 1:
        raise ValueError(
            f"combine: {what} has shape {tuple(value.shape)}; expected a scalar (reduce it with .mean() or .sum())"
        )
    if value.is_complex():
        raise TypeError(f"combine: {what} is complex ({value.dtype}); a loss must be real (take .abs() or .real)")


def _check_component_names(losses: Mapping[Any, Any]) -> None:
    """combine()'s component names: each becomes the metric keys ``loss/<name>``,
    ``loss_weight/<name>`` and ``loss_ratio/<a>/<b>``, which must read back unambiguously."""
    for name in losses:
        if not isinstance(name, str):
            raise TypeError(
                f"combine: loss component names must be strings (they name the metrics loss/<name>); "
                f"got {name!r} (a{'n' if type(name).__name__[0] in 'aeiou' else ''} {type(name).__name__})"
            )
        if not name:
            raise ConfigError("combine: a loss component has an empty name; give it one (it names loss/<name>)")
        if not name.strip():
            raise ConfigError(
                f"combine: a loss component has a blank name ({name!r}); give it one (it names loss/<name>)"
            )
        if "/" in name:
            raise ConfigError(
                f"combine: loss component {name!r} has a '/' in its name; loss_ratio/<a>/<b> could not be "
                f"read back (rename it, e.g. {name.replace('/', '_')!r})"
            )
        if name == TOTAL:
            raise ConfigError(
                f"combine: the loss component name {name!r} is reserved (loss/total is the weighted total); rename it"
            )


def _check_weights(weights: Mapping[Any, Any], losses: Mapping[str, Any]) -> None:
    """combine()'s weights: one per loss component, no other key; a number weight finite and not
    negative (a tensor weight is the user's own: learnable, it is not read here)."""
    extra = [k for k in weights if k not in losses]
    if extra:
        raise ConfigError(
            f"combine: weights has {', '.join(repr(k) for k in extra)}, which is not a loss component "
            f"(a typo?); the components are {', '.join(repr(k) for k in losses)}"
        )
    missing = [k for k in losses if k not in weights]
    if missing:
        raise ConfigError(f"combine: no weight for loss component(s) {sorted(missing)}; weights has {sorted(weights)}")
    for k in losses:
        w = weights[k]
        if isinstance(w, torch.Tensor):
            continue
        if isinstance(w, (bool, str, bytes)) or not hasattr(w, "__float__"):
            raise ConfigError(f"combine: weight {k!r} is a {type(w).__name__} ({w!r}); expected a number or a tensor")
        v = float(w)
        if not math.isfinite(v):
            raise ConfigError(f"combine: weight {k!r} is {v}; a weight must be a finite number")
        if v < 0:
            raise ConfigError(
                f"combine: weight {k!r} is negative ({v}): it would maximise that loss; "
                f"pass a tensor weight if that is meant"
            )


def _trains(loss: torch.Tensor) -> bool:
    """Whether a loss belongs to a training step: gradients are being computed and it has one."""
    return torch.is_grad_enabled() and loss.requires_grad


class _ScalerPatch:
    """The one patch: GradScaler.step may skip optimizer.step, so no optimizer hook would fire.

    One patch per scaler, shared by every monitor attached with it (two optimizers, one scaler):
    ``step(optimizer)`` finds the monitor of that optimizer, unscales first (as ``scaler.step``
    would), calls its ``before_update()`` on the unscaled gradients, then the original, then its
    ``after_update()`` (a no-op when the optimizer post-hook already closed the step). ``update``
    keeps the scale >= ``actions.loss_scale.min_loss_scale`` for monitors that enforce the floor
    (a standing setting, no event). The last monitor to leave puts both originals back.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.monitors: dict[int, Monitor] = {}
        self.original_step, self.original_update = scaler.step, scaler.update
        scaler.step, scaler.update = self.step, self.update

    def join(self, monitor: Monitor) -> None:
        self.monitors[id(monitor.optimizer)] = monitor

    def leave(self, monitor: Monitor) -> None:
        self.monitors = {k: m for k, m in self.monitors.items() if m is not monitor}
        if not self.monitors:
            for name in ("step", "update"):
                self.scaler.__dict__.pop(name, None)
            _SCALER_PATCHES.pop(self.scaler, None)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        from torch.amp.grad_scaler import OptState

        monitor = self.monitors.get(id(optimizer))
        if monitor is None:
            return self.original_step(optimizer, *args, **kwargs)
        if self.scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.scaler.unscale_(optimizer)
        monitor.before_update()
        try:
            out = self.original_step(optimizer, *args, **kwargs)
        except BaseException:
            monitor.after_update(aborted=True)
            raise
        monitor.after_update()  # the scaler found inf/NaN and skipped optimizer.step
        return out

    def update(self, *args: Any, **kwargs: Any) -> Any:
        # A batch the monitor skipped for itself (NaN in the inputs, a non-finite or spiking loss)
        # says nothing about the loss scale: the scaler's found-inf would halve it, so its scale
        # and growth tracker are kept as they were.
        keep = self.scaler._scale is not None and any(m.last_step_skipped_its_batch() for m in self.monitors.values())
        saved = [t.clone() for t in (self.scaler._scale, self.scaler._growth_tracker)] if keep else None
        out = self.original_update(*args, **kwargs)
        if saved is not None and self.scaler._scale is not None:
            self.scaler._scale.copy_(saved[0])
            self.scaler._growth_tracker.copy_(saved[1])
        for m in self.monitors.values():  # an undo: the scaler as it was before the undone update
            restore = m._ctx.scaler_restore if m._ctx is not None else None
            if restore and self.scaler._scale is not None:
                self.scaler._scale.copy_(restore[0])
                self.scaler._growth_tracker.copy_(restore[1])
            if m._ctx is not None:
                m._ctx.scaler_restore = None
        floors = [m.config.actions.loss_scale for m in self.monitors.values()]
        floors = [f.min_loss_scale for f in floors if f.enforce_floor]
        if floors:
            A.keep_loss_scale_floor(self.scaler, max(floors))
        return out


_SCALER_PATCHES: weakref.WeakKeyDictionary[Any, _ScalerPatch] = weakref.WeakKeyDictionary()
# The monitor attached to each optimizer (weakly both ways: a lost monitor or optimizer goes).
_ATTACHED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[Monitor]] = weakref.WeakKeyDictionary()


# The code of the wrapper torch puts around each optimizer class's step() (it calls the step hooks)
_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def _steps_in_flight(optimizer: torch.optim.Optimizer) -> int:
    """How many of torch's step wrappers for ``optimizer`` are running (on the call stack). torch
    wraps each class's step() the first time an instance of that class is made, so a subclass
    whose step() calls ``super().step()`` runs two once its parent class has an instance too: the
    step hooks fire twice in one ``optimizer.step()``."""
    n = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER and frame.f_locals.get("self") is optimizer:
            n += 1
        frame = frame.f_back
    return n


def _with_closure(args: tuple, kwargs: dict, closure: Any) -> tuple[tuple, dict]:
    """``optimizer.step``'s arguments (as its pre-hook sees them: ``args[0]`` is the optimizer)
    with ``closure`` in place of the one given, by keyword or by position."""
    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure}
    return (args[0], closure, *args[2:]), kwargs


def _in_its_world(method: Any) -> Any:
    """Run ``method`` in the monitor's world: with ``distributed: false``, a world of one (no
    collective, rank 0 for its files) whatever process group exists."""

    @functools.wraps(method)
    def scoped(self: Monitor, *args: Any, **kwargs: Any) -> Any:
        if self.config.distributed:
            return method(self, *args, **kwargs)
        with alone():
            return method(self, *args, **kwargs)

    return scoped


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same values, a NaN equal to a NaN
    (``torch.equal`` calls a tensor holding a NaN different from its own copy)."""
    return (
        bool(torch.equal(a, b) or ((a == b) | (a.isnan() & b.isnan())).all())
        if a.is_floating_point()
        else torch.equal(a, b)
    )


def _tensor_versions(batch: Any) -> list[int]:
    """The version counters of a batch's tensors (nested in dicts, lists, tuples): each in-place
    change of a tensor moves its counter; reading them costs no device work."""
    return [t._version for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


class _Batches(Iterator[Any]):
    """What ``Monitor.batches()`` returns: an iterator over the loader's batches that has the
    loader's length (``len()``: a progress bar's total, torchvision's ``MetricLogger``); batches a
    rollback leaves out are not subtracted."""

    def __init__(self, batches: Generator[Any, None, None], loader: Iterable[Any]):
        self._batches, self._loader = batches, loader

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        return next(self._batches)

    def __len__(self) -> int:
        try:
            return len(self._loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"monitor.batches(): the loader ({type(self._loader).__name__}) has no len()") from None

    def close(self) -> None:
        """End the loop early (as a generator's ``close()``)."""
        self._batches.close()


def _backward_hooked(model: nn.Module, params: Sequence[torch.Tensor]) -> str | None:
    """What holds a backward hook that an extra backward (autograd.grad) would run again, with its
    side effects (a K-FAC-style preconditioner's statistics, a gradient logger): a module's full or
    pre backward hook (its name), a global module backward hook, a hook on a parameter. None: none."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks:
        return "a global module hook (torch.nn.modules.module.register_module_full_backward_hook)"
    for name, mod in model.named_modules():
        if mod._backward_hooks or mod._backward_pre_hooks:
            return f"module {name or type(mod).__name__!r}"
    for p in params:
        if p._backward_hooks:
            return f"a parameter of shape {tuple(p.shape)}"
    return None


def _raw_weight(module: nn.Module) -> torch.Tensor | None:
    """A layer's weight parameter as the optimizer holds it, without running a parametrization:
    ``module.weight`` of a parametrized layer computes it, and ``spectral_norm``'s computation in
    training mode is a power iteration that moves its state (a monitor must not)."""
    if parametrize.is_parametrized(module, "weight"):
        held = getattr(getattr(module, "parametrizations", None), "weight", None)
        original = getattr(held, "original", None)  # (weight_norm's two have no single one)
        return original if isinstance(original, torch.Tensor) else None
    weight = module._parameters.get("weight")
    return weight if isinstance(weight, torch.Tensor) else None


class Monitor:
    """Watches a model and optimizer each optimizer step; see the module docstring.

    Args:
        config: a MonitorConfig, a dict, a path to a YAML file, or None for the defaults.
        run_dir: folder for metrics.jsonl, events.jsonl, checkpoints/, bundles/. None: a new
            folder under ./sfmonitor_runs/ is made on first write.
        sinks: sink names ("jsonl", "console", "tensorboard", "wandb") or Sink objects.
            Default: ["jsonl"] plus one console line per event (``config.console``).
        detectors: extra detector instances (``detectors.Detector`` subclasses, each with its own
            ``name`` and ``kind``) run after the registered ones; see docs/design.md.
    """

    def __init__(
        self,
        config: MonitorConfig | dict | str | os.PathLike | None = None,
        run_dir: str | os.PathLike | None = None,
        sinks: Iterable[Any] | None = None,
        detectors: Sequence[Detector] | None = None,
    ):
        extra = self._check_detectors(detectors)
        self.config = MonitorConfig.from_any(config)
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        if isinstance(sinks, (str, bytes)):
            raise ConfigError(f"sinks: expected a list of sink names or objects, e.g. [{sinks!r}]")
        self._sink_specs = list(sinks) if sinks is not None else ["jsonl"]
        self.events: list[Event] = []
        self._counted = Tally()  # the summary's counts of events no longer in self.events
        self._superseded = 0  # the first events of self.events: of a timeline a load_state_dict left
        self.step = 0
        self._should_stop = False
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = None
        self.groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
        self._model_groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
        self._outside: list[tuple[str, nn.Parameter]] = []
        self._copies: list[torch.Tensor] = []  # the model's weights fp32 masters stand in for
        self._pairing_pending = False  # masters whose weights tied by value at attach (master_copies)
        self._probed: list[torch.Tensor] = []  # the zero_grad probe's candidates (_index_params)
        self._probed_names: list[str] = []
        self._params: list[nn.Parameter] = []  # the monitored parameters (_index_params)
        self._dead = S.DeadUnitCounter([], 1)  # dead_units/<group> (_index_params: its layers)
        self._bn = S.BatchVarRatio([], [])  # bn_var_ratio/<group> (_index_params: its layers)
        self._group_of_id: dict[int, str] = {}  # id(parameter) -> its group (adam_eps/<group>)
        self._lock: str | None = None
        self._router: SinkRouter | None = None
        self._hooks: list[Any] = []
        self._undo: list[Any] = []  # callables that restore whatever attach() replaced
        self._base_weights: dict[str, float] = {}
        self._weights: dict[str, float] = {}  # current (possibly rescued) loss weights
        self._amp_skipped = 0  # steps the GradScaler skipped so far
        self._warned_snapshot_budget = False
        self._warned_inplace = False  # batches(): an undone step's batch changed in place
        # bad batches on an unchanged state (see _bad_batches_on_a_sound_state)
        self._no_update_since_spike = False
        self._last_update_sound = False
        self._state_from_normal_loss = False
        self._same_state_spikes = 0
        # Full-batch training (_fixed_batch): the step it was found at; the last step's input
        # fingerprint and how many steps in a row it repeated; the next step's loss that would
        # show it by a replay; the last steps' losses
        self._fixed_batch_since: int | None = None
        self._last_inputs: list[float] | None = None
        self._same_inputs = 0
        self._expect_loss: tuple[int, tuple[float, float]] | None = None
        self._recent_losses: dict[int, tuple[float, float]] = {}  # step -> (loss, gradient norm)
        self._last_landed: int | None = None  # the step of the last update that landed (nonfinite_param names it)
        self._zero_runs: dict[str, int] = {}  # group -> steps in a row its gradients were exactly zero
        self._grad_reset = GradResetProbe()  # was zero_grad() called between the steps?
        self._told_not_reset = False  # zero_grad_missing told, and no reset seen since
        self._nested_steps = 0  # step() calls running inside the step in flight (_steps_in_flight)
        self._warned_join = False  # DDP's Join seen on (its uneven inputs meet the step's reduction)
        self._no_input_values: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (_no_inputs)
        self.memory: dict[str, Any] = {}  # what the monitor holds (memory_plan, at attach; run.json)
        self._update_buf: Arena | None = None  # reused copy of the parameters (no undo copy)
        self._slices: S.RotatingSlices | None = None  # or of a slice of each (update_ratio_fraction)
        self._scratch = Scratch()  # bounded, reused: the update ratio's differences
        self._sharded = False  # FSDP2 under a process group: parameters are DTensor shards
        self._grad_ratio_off = False  # its extra backward cannot run unseen (a reentrant checkpoint, a backward hook)
        self._driven_externally = False  # an integration calls before_update()/after_update()
        self._closure_grads: list[weakref.ref[torch.Tensor] | None] | None = None  # what step(closure) left
        self._model_factory: tuple[str, dict[str, Any]] | None = None
        # The step in flight, and the last closed one: its update ratios are read with the next
        # step's single read, then its after-update detectors judge it and it goes to the sinks.
        self._record = StepRecord(step=0)
        self._last: StepRecord | None = None
        self._stats: dict[str, float] = {}
        # The stages. Detectors and policy hold windows, streaks and cooldowns (state_dict).
        self._detectors: list[Detector] = build_detectors(self.config.detectors) + extra
        self._policy = Policy(self.config.policy)
        self._watch = ActivationWatch(self.config.watch)
        self._recorder = BatchRecorder(keep=self.config.bundle.enabled)
        self._recorder.on_forward = self._forward_starts
        self._forwards_idle = 0  # training forwards since the optimizer last stepped (_warn_not_stepping)
        # (step, id of its record, the gradients as they were) at the step's last recorded forward
        self._micro_mark: tuple[int, int, Any] | None = None
        # gradient resets between forwards since the last optimizer step, and per step of the last
        # RESET_STEPS that reached one (the loop's habit: _forward_starts)
        self._resets = self._attempt_resets = 0  # (the latter since the record last started over)
        self._reset_counts: collections.deque[int] = collections.deque(maxlen=self.RESET_STEPS)
        self._first_buffers: Any = None  # the forward pre-hook of _arm_first_buffers
        # (step, the gradients as they were) at the forward taken for the step's first (_before_forward)
        self._forward_mark: tuple[int, Any] | None = None
        self._unwritten: list[Event] = []  # events whose actions finish after the update (_emit)
        self._group_pgs: dict[str, list[int]] = {}  # group -> optimizer param groups (_group_lrs)
        self._group_pgs_key: tuple[int, ...] | None = None
        # The user's own clip before optimizer.step(): its gradients measured before it (userclip.py).
        self._user_clip = UserClip(
            lambda: self._record.step if self._record.phase is Phase.OPEN else None,
            lambda: self._params,
            lambda: grads_scaled(self.scaler, self.optimizer),
        )
        self._bundles = BundleTracker(self.config.bundle)
        self._ctx: A.ActionContext | None = None  # built on attach: what actions may change
        self._pending_ctx: dict[str, Any] = {}  # action state loaded before attach()
        self._layout_checked = False  # (the first agreed read checks the ranks' layouts: read_all)
        self._own_seconds, self._own_steps = 0.0, 0  # the monitor's own time (summary.json)
        self._batch_loops = 0  # batches() generators running: a stop then ends them, no raise
        self._steps_closed = 0  # optimizer steps ended (batches() tells a step's micro-batches by it)
        self._bundle_next = False  # request_bundle(): write one for the next step
        self._regime_next: str | None = None  # new_regime(): its reason, for the next step's judgement
        self._reweighted_at = -2  # the last step whose change of combine()'s weights was a new loss
        self._loop_writes = LoopWrites()  # parameters the loop changed between two steps
        self._loop_changed_at: int | None = None  # the last step before which the loop changed some
        self._sizes: collections.deque[float] = collections.deque(maxlen=self.BATCH_SIZES)  # input elements a step
        # input shapes per example -> the last step that had each, and those new lately -> the step
        # they first came (_input_shapes_new)
        self._shapes_last: dict[Any, int] = {}
        self._shapes_since: dict[Any, int] = {}
        self.bundles: list[str] = []  # bundles written on request (anomaly bundles: in their events)
        names = [d.name for d in self._detectors]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(
                f"detectors: two detectors are named {dup[0]!r}; each needs its own name "
                f"(it keys the detector's state in state_dict)"
            )

    @staticmethod
    def _check_detectors(detectors: Sequence[Detector] | None) -> list[Detector]:
        """A user's own detector instances; their kinds are registered (with no ladder unless
        registered before) so that events and ``policy.ladders`` know them."""
        if detectors is None:
            return []
        if isinstance(detectors, (str, bytes)) or not isinstance(detectors, Iterable):
            raise ConfigError(f"detectors: expected a list of detector instances, got {detectors!r}")
        out = list(detectors)
        for i, d in enumerate(out):
            if isinstance(d, type):
                raise ConfigError(
                    f"detectors[{i}]: expected a detector instance, got the class {d.__name__}; pass {d.__name__}(...)"
                )
            missing = [
                m
                for m in ("check", "observe_eval", "state_dict", "load_state_dict")
                if not callable(getattr(d, m, None))
            ]
            if missing:
                raise ConfigError(
                    f"detectors[{i}]: {type(d).__name__} lacks {', '.join(missing)} (subclass sfmonitor.Detector)"
                )
            name, kind = getattr(d, "name", ""), getattr(d, "kind", "")
            if not name or not isinstance(name, str):
                raise ConfigError(
                    f"detectors[{i}]: {type(d).__name__} has no name (set the class "
                    f"attribute `name`; it keys the detector's state)"
                )
            if not kind or not isinstance(kind, str):
                raise ConfigError(
                    f"detectors[{i}]: {type(d).__name__} has no kind (set the class "
                    f"attribute `kind`: the event kind of its findings)"
                )
            if kind not in KINDS:
                register_kind(kind)
        return out

    # ------------------------------------------------------------------------------------------
    # attach / detach
    # ------------------------------------------------------------------------------------------
    def _index_params(self, by_grad: bool = False) -> None:
        """The parameter tables the statistics use: the model's parameters in named_parameters()
        order (so "the first offending parameter" is the first one a user, or `sfmonitor replay`,
        finds walking the model), then those the optimizer updates but the model does not hold (a
        learnable temperature in a loss module, say), in group "other". Rebuilt when the optimizer
        gains parameters (``add_param_group`` after attach)."""
        assert self.model is not None and self.optimizer is not None
        model, optimizer = unwrap(self.model), self.optimizer
        named = list(model.named_parameters())
        in_model = {id(p) for _, p in named}
        outside = [
            (f"optimizer.param_groups[{gi}].params[{pi}]", p)
            for gi, pg in enumerate(optimizer.param_groups)
            for pi, p in enumerate(pg["params"])
            if id(p) not in in_model
        ]
        self._outside[:] = outside  # shared with the action context (snapshots carry them)
        # fp32 masters of weights the optimizer does not update take those weights' names and
        # groups: the statistics read what the optimizer updates, once; the model's copies go in
        # the undo copy beside them (the loop refreshes them from the masters after each step)
        in_optimizer = {id(p) for pg in optimizer.param_groups for p in pg["params"]}
        fed = [(n, p) for n, p in named if id(p) not in in_optimizer]
        found, tied = master_copies(fed, [p for _, p in outside], by_grad=by_grad)
        pairs = sharding.agree_pairs(found, len(outside))
        # masters told apart from another weight by value alone at attach: again at the first step
        self._pairing_pending = not by_grad and any(j in tied for _, j in pairs)
        stand_in = {id(fed[i][1]): outside[j][1] for i, j in pairs}
        mastered = {j for _, j in pairs}
        outside = [o for j, o in enumerate(outside) if j not in mastered]
        self._copies[:] = [fed[i][1] for i, _ in pairs]
        copy_names = [fed[i][0] for i, _ in pairs]
        self.groups.clear()  # the action context shares this dict
        self.groups.update({g: [(n, stand_in.get(id(p), p)) for n, p in ps] for g, ps in self._model_groups.items()})
        if outside:
            self.groups.setdefault(OTHER, []).extend(outside)
        self._group_names = list(self.groups)
        self._name_to_group = {n: g for g, ps in self.groups.items() for n, _ in ps}
        group_index = {g: i for i, g in enumerate(self._group_names)}
        ordered = [(n, stand_in.get(id(p), p)) for n, p in named if n in self._name_to_group] + outside
        held = self._params
        self._params = [p for _, p in ordered]
        # Walked once, not every step: the undo copy holds them. A forward may replace one (DINO's
        # `self.center = ...`): where each lives is kept, and looked up each step (_fresh_buffers).
        self._buffer_slots = buffer_slots(model)
        self._buffers = [b for m, n in self._buffer_slots if (b := m._buffers[n]) is not None]  # (all are)
        self._buffer_owners = [id(m) for m, _ in self._buffer_slots]  # which module each is of
        self._loop_writes.watch(list(model.named_modules()))  # (a buffer the loop adds or replaces)
        by_layer = running_statistics_by_layer(model)
        self._running_stats = [b for _, b in by_layer]  # without the undo copy, a copy holds these
        self._stats_owners = [id(m) for m, _ in by_layer]
        if self._ctx is not None:  # add_param_group()
            self._ctx.undo_params, self._ctx.undo_buffers = self._params, self._buffers
            if self._ctx.stats_copy is not None and list(map(id, self._ctx.stats_buffers)) != list(
                map(id, self._running_stats)
            ):
                self._ctx.stats_copy.clear()  # (other tensors: its copies are of nothing held now)
            self._ctx.stats_buffers = self._running_stats
            same = len(held) == len(self._params) and all(a is b for a, b in zip(held, self._params))
            if self._ctx.undo is not None and not same:
                # New tensors: the undo copy starts over with the new list. The same tensors (a
                # frozen part of the model unfrozen into a new group) keep it: it holds them, and
                # the new group's parameters had no optimizer state, which an undo leaves so.
                self._ctx.undo.clear()
        self._param_names = [n for n, _ in ordered]
        self._param_group = [group_index[self._name_to_group[n]] for n in self._param_names]
        # bf16/fp16 parameters the optimizer updates: the share of each update rounded away
        # (update_stale/<group>; a weight that takes gradients and is updated by no one, a linear
        # probe's backbone with requires_grad left on, rounds nothing away and needs no zero_grad)
        updated = [i for i, p in enumerate(self._params) if id(p) in in_optimizer]
        self._lowp = [i for i in updated if self._params[i].dtype in S.LOW_PRECISION]
        # The gradients the zero_grad probe watches: where backward accumulates those an update
        # reads (the masters' are the loop's copies of their weights' gradients), by their names
        self._probed = [*self._copies, *(self._params[i] for i in updated)]
        self._probed_names = [*copy_names, *(self._param_names[i] for i in updated)]
        # The weights of nn.Linear / nn.Conv layers whose units dead_units/<group> watches (a tied
        # weight once); their counts start over with the new list.
        position = {id(p): i for i, p in enumerate(self._params)}
        position.update({id(c): position[id(stand_in[id(c)])] for c in self._copies})  # (a master's units)
        weights = [w for m in model.modules() if isinstance(m, _UNIT_LAYERS) and (w := _raw_weight(m)) is not None]
        units = dict.fromkeys(
            position[id(w)] for w in weights if id(w) in position and w.dim() >= 2 and w.shape[0] >= MIN_UNITS
        )
        self._dead = S.DeadUnitCounter(
            [(i, self._group_names[self._param_group[i]]) for i in units], self.config.stats.dead_units_samples
        )
        self._group_of_id = {id(p): self._group_names[self._param_group[i]] for i, p in enumerate(self._params)}
        self._bn = S.BatchVarRatio(self._batchnorm_layers(model), self._group_names, sharding.local)
        shapes = {g: [tuple(p.shape) for _, p in ps] for g, ps in self.groups.items()}
        for d in self._detectors:  # plain data: detectors never touch the model
            layout = getattr(d, "layout", None)
            if layout is not None:
                layout(shapes)
        # Like blocks inside a group (a BERT's encoder layers): measured only for a detector that asks
        blocks = like_blocks(model, self._name_to_group)
        at = {n: i for i, n in enumerate(self._param_names)}
        block_shapes = {b: [tuple(self._params[at[n]].shape) for n in names] for b, names in blocks.items()}
        asked = {b for d in self._detectors if blocks and hasattr(d, "blocks") for b in d.blocks(block_shapes)}
        self._block_names = [b for b in blocks if b in asked]
        block_of = {n: bi for bi, b in enumerate(self._block_names) for n in blocks[b]}
        self._param_block = [block_of.get(n, len(self._block_names)) for n in self._param_names]  # (last: none)
        device = self._params[0].device if self._params else torch.device("cpu")
        # FSDP2: statistics measure each rank's local shards, weighted by their share of the norms.
        self._layout = sharding.Layout(self._params)
        self._param_group_t = self._layout.index(range(len(self._params)), self._param_group, device)
        self._param_block_t = self._layout.index(range(len(self._params)), self._param_block, device)
        # which parameters have gradients -> their group (and block) index tensors, and the groups they fall in
        self._index_cache: dict[tuple[int, ...], tuple[S.TensorIndex, frozenset[int], S.TensorIndex]] = {}
        self._update_buf, self._slices = None, None
        self._n_opt_params = sum(len(pg["params"]) for pg in optimizer.param_groups)

    def _batchnorm_layers(self, model: nn.Module) -> list[tuple[str, Any, int]]:
        """(name, module, group index) of the BatchNorm layers whose running statistics are on
        (bn_var_ratio/<group>): the group of the layer's weight, else of the nearest enclosing
        module's parameters, else the first group."""
        index = {n: self._param_group[i] for i, n in enumerate(self._param_names)}
        found: list[tuple[str, Any, int]] = []
        for name, m in model.named_modules():
            var = getattr(m, "running_var", None)
            if not isinstance(m, nn.modules.batchnorm._NormBase) or not isinstance(var, torch.Tensor):
                continue
            if var.is_meta or not var.is_floating_point() or m.momentum == 0:  # (a lazy module not yet run;
                continue  # statistics that never move)
            group = index.get(f"{name}.weight" if name else "weight")
            prefix = name
            while group is None and prefix:  # (no affine weight: the enclosing module's group)
                prefix = prefix.rpartition(".")[0]
                group = next((g for n, g in index.items() if n.startswith(f"{prefix}.")), None) if prefix else None
            found.append((name, m, group if group is not None else 0))
        return found if self._group_names else []

    @property
    def attached(self) -> bool:
        return self.model is not None

    def track(self, *modules: nn.Module) -> Monitor:
        """Hold ``modules`` (an EMA of the weights: ``torch.optim.swa_utils.AveragedModel``, timm's
        ``ModelEmaV2``; or a part of the model outside the optimizer, such as BYOL's target network
        inside the learner) beside the model: what the loop derives from the weights after each step.
        Of a module the monitor holds already in part, the rest is held (not the parameters its
        optimizer updates, nor the model's buffers).
        The undo copy holds their parameters and buffers (an undo puts them back with the
        weights: an EMA updated after a bad update, before the step that finds it, mixed it in),
        and so do the rollback snapshots and the single-file emergency checkpoint
        (``extra["tracked"]``, one state dict per module, by the names ``tracked.0``, ``tracked.1``,
        ...; not the FSDP2 (DCP) checkpoint: a sharded module's parts would not all land). Call it after
        ``attach`` (once per module; again after a new attach). Returns the monitor."""
        ctx = self._live()
        held = ctx.held_ids()
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"track: argument {i} must be an nn.Module (an EMA of the model), got {type(m).__name__}"
                )
            if any(m is already for _, already in ctx.tracked):
                raise ConfigError(f"track: argument {i} ({type(m).__name__}) is already tracked")
            named = [*m.named_parameters(), *m.named_buffers()]
            if named and all(id(t) in held for _, t in named):
                names = ", ".join(n for n, _ in named[:3]) + (", ..." if len(named) > 3 else "")
                raise ConfigError(
                    f"track: argument {i} ({type(m).__name__}) holds nothing the monitor does not hold already "
                    f"(the parameters its optimizer updates and the model's buffers: {names}); track a separate "
                    "copy (an EMA is a deep copy of the model), or a part of the model outside the optimizer"
                )
        for m in modules:
            ctx.tracked.append((f"tracked.{len(ctx.tracked)}", m))
        if ctx.undo is not None:
            ctx.undo.tracked = []  # the next capture holds them; an undo before it leaves them
        self._plan_memory()
        return self

    @staticmethod
    def attached_to(optimizer: Any) -> Monitor | None:
        """The monitor attached to ``optimizer`` (or to the torch optimizer inside a wrapper
        such as accelerate's), or None: finds a monitor whose handle was lost (a notebook cell
        run again) so that it can be detached."""
        for _ in range(9):
            ref = _ATTACHED.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
            found = ref() if ref is not None else None
            if found is not None and found.attached:
                return found
            optimizer = getattr(optimizer, "optimizer", None)
            if optimizer is None:
                return None
        return None

    def _live(self) -> A.ActionContext:
        """The action context of the attached model and optimizer (what the pipeline works on)."""
        if self._ctx is None:
            raise RuntimeError("the monitor is not attached (call attach() first)")
        return self._ctx

    @_in_its_world
    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        groups: Mapping[str, Any] | None = None,
    ) -> Monitor:
        if self.model is not None:
            raise RuntimeError("this Monitor is already attached; call detach() first")
        if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
            print(f"[sfmonitor] {DISABLE_ENV} is set: attach does nothing, training runs unmonitored", file=sys.stderr)
            return self
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"attach: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        hooked = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
        if not all(hasattr(optimizer, h) for h in hooked):
            # A wrapper that subclasses Optimizer without its __init__ (accelerate's
            # AcceleratedOptimizer): the hooks go on the torch optimizer inside, whose step it calls.
            inner: Any = optimizer
            for _ in range(8):
                inner = getattr(inner, "optimizer", None)
                if not isinstance(inner, torch.optim.Optimizer) or all(hasattr(inner, h) for h in hooked):
                    break
            if not isinstance(inner, torch.optim.Optimizer) or not all(hasattr(inner, h) for h in hooked):
                raise TypeError(
                    f"attach: {type(optimizer).__name__} has no step hooks (its __init__ does not call "
                    f"torch.optim.Optimizer.__init__), so the monitor cannot watch its steps; pass the torch "
                    f"optimizer that updates the parameters (accelerate: the prepared optimizer's .optimizer)"
                )
            own_scaler = getattr(optimizer, "scaler", None)  # accelerate's GradScaler (fp16)
            adopted = scaler is None and own_scaler is not None
            if adopted:
                scaler = own_scaler  # it unscales the gradients before the inner step
            if self.config.console:
                print(
                    f"[sfmonitor] attach: {type(optimizer).__name__} is a wrapper; watching the "
                    f"{type(inner).__name__} inside it (its .optimizer)" + (" and its .scaler" if adopted else ""),
                    file=sys.stderr,
                )
            optimizer = inner
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "attach: LBFGS treats a missing gradient as zero, so a skipped step "
                "could not be kept bit-identical; use a first-order optimizer"
            )
        # Everything that can fail on bad input fails here, before any hook is registered.
        other = Monitor.attached_to(optimizer)
        if other is not None:
            raise ConfigError(
                f"attach: this {type(optimizer).__name__} already has a monitor attached (run_dir "
                f"{other.run_dir!r}, at step {other.step}); two monitors would both act on every step (two "
                f"LR drops for one finding, two clips). Call detach() on that one first (if you no longer "
                f"hold it: sfmonitor.Monitor.attached_to(optimizer).detach())"
            )
        if isinstance(unwrap(model), torch.jit.ScriptModule):
            raise ConfigError(
                "attach: the model is a TorchScript module (torch.jit.script or torch.jit.trace), which takes "
                "no forward hooks; the monitor needs them (each batch's input, the buffers a skipped batch "
                "must give back, the activation watch). Attach to the eager model (a scripted submodule "
                "inside it is fine), or compile it with torch.compile"
            )
        lazy = [n for n, p in unwrap(model).named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
        what = "parameter"
        if not lazy:  # (LazyBatchNorm with affine=False: lazy running statistics, no lazy parameter)
            lazy = [n for n, b in unwrap(model).named_buffers() if isinstance(b, nn.parameter.UninitializedBuffer)]
            what = "buffer"
        if lazy:
            raise ConfigError(
                f"attach: {len(lazy)} {what}(s) of the model are not initialised yet ({', '.join(lazy[:4])}"
                f"{', ...' if len(lazy) > 4 else ''}: lazy modules, whose shapes come from their first input); "
                "run one forward pass (a batch of your data) before attaching, so that the monitor can "
                "measure them and hold their copies"
            )
        self._model_groups = resolve_groups(model, groups)
        sharding.check_optimizer(unwrap(model), optimizer)  # FSDP2: built after fully_shard?
        sinks = [make_sink(s) for s in self._sink_specs]
        if self.run_dir is not None and os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise ConfigError(
                f"run_dir {self.run_dir!r} is a file; give a folder (the monitor writes metrics.jsonl, "
                f"events.jsonl, checkpoints/ and bundles/ in it)"
            )
        # From here on, a failure undoes everything done so far (hooks, patches, the lock, the
        # folders it made) and leaves the monitor as it was: attach() can be called again.
        run_dir, made = self.run_dir, _missing_folders(self._ensure_run_dir())
        try:
            self._attach(model, optimizer, scaler, sinks)
        except BaseException:
            self._abandon_attach(run_dir, made)
            raise
        return self

    def _attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, sinks: list[Any]) -> None:
        """attach() past its checks: everything it does, ``_abandon_attach`` undoes."""
        try:
            self._lock = self._lock_run_dir()
        except OSError as e:
            raise ConfigError(
                f"run_dir {self.run_dir!r} cannot be used: {e.strerror or e}"
                + (f" ({e.filename!r})" if e.filename else "")
            ) from e
        self.model, self.optimizer = model, optimizer
        self._index_params()
        # Run eagerly under torch.compile(optimizer.step): dynamo would trace the whole pipeline
        # (host reads, clocks, RNG captures), break the graph on each and recompile on snapshots.
        self._hooks.append(optimizer.register_step_pre_hook(torch.compiler.disable(self._on_optimizer_pre_step)))
        self._hooks.append(optimizer.register_step_post_hook(torch.compiler.disable(self._on_optimizer_post_step)))
        _ATTACHED[optimizer] = weakref.ref(self)
        self._undo.append(lambda: _ATTACHED.pop(optimizer, None))
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            self.scaler = scaler
            self._wrap_scaler(scaler)
        rb = self.config.actions.rollback
        # Under torch.distributed every rank decides and acts alike, but only rank 0 writes
        # (logs, bundles, emergency checkpoints) into the shared run_dir.
        self._writer = rank() == 0
        # Under FSDP2 (sharded parameters) every rank writes its own shards of an emergency
        # checkpoint (torch.distributed.checkpoint) into one folder: rank 0's run_dir.
        self._sharded = self._layout.sharded and world_size() > 1
        if self._sharded:
            self.run_dir = same_path(self._ensure_run_dir())
        self._ctx = A.ActionContext(
            model=unwrap(model),
            optimizer=optimizer,
            scaler=self.scaler,
            groups=self.groups,
            loss_weights=self._weights,
            base_weights=self._base_weights,
            snapshots=SnapshotRing(every=rb.snapshot_every, keep=rb.keep, max_bytes=int(rb.max_host_mb * 2**20)),
            run_dir=self._ensure_run_dir() if self._writer or self._sharded else None,
            config=self.config.actions,
            monitor_state=self.state_dict,
            outside_params=self._outside,
            copies=self._copies,
            undo=UndoState() if self.config.actions.undo.enabled else None,
            undo_params=self._params,
            undo_buffers=self._buffers,
            stats_copy=None if self.config.actions.undo.enabled or not self._running_stats else UndoState(),
            stats_buffers=self._running_stats,
        )
        self._watch.attach(unwrap(model))
        self._watch.reset(self.step)
        self._record = StepRecord(step=self.step)
        self._recorder.attach(model)
        self._arm_first_buffers()
        self._undo.append(self._disarm_first_buffers)
        self._undo.append(self._watch.detach)
        self._undo.append(self._recorder.detach)
        self._user_clip.join()
        self._undo.append(self._user_clip.leave)
        self._undo.append(lambda: A.remove_precision_fallback(self._ctx))
        if self._pending_ctx:  # load_state_dict() was called before attach()
            self.load_state_dict({**self.state_dict(), **self._pending_ctx})
        if self.config.console and not any(isinstance(s, ConsoleSink) for s in sinks):
            sinks.append(ConsoleSink())
        if not self._writer:
            sinks = []  # events stay in monitor.events on every rank
        self._router = SinkRouter(sinks)
        self._router.open(self._ensure_run_dir(), self.config.to_dict())
        self._plan_memory()
        if self._writer:
            meta = run_metadata(self._params, self.groups, world_size(), self.config.to_dict())
            self._write_json(RUN_FILE, {**meta, "memory": self.memory})
            if self.config.console:
                print(format_memory(self.memory), file=sys.stderr)

    def _plan_memory(self) -> None:
        """``self.memory``: what the undo copy and the snapshots will hold (at attach; again when
        ``track`` adds modules to them)."""
        ctx = self._live()
        rb = self.config.actions.rollback
        self.memory = memory_plan(
            self._layout.local(self._params),
            [*self._buffers, *ctx.tracked_tensors()],
            ctx.optimizer,
            self.config.actions.undo.enabled,
            rb.keep,
            int(rb.max_host_mb * 2**20),
            self.config.stats.update_ratio_fraction if self.config.stats.update_ratio_every else 0.0,
            self._running_stats,
        )

    def _abandon_attach(self, run_dir: str | None, made: list[str]) -> None:
        """Undo what a failed attach did, in reverse: its hooks, the patches it made (scaler,
        watch, recorder, user clip, precision fallback), its sinks, its lock and the folders it
        created (if empty); the monitor is left detached, with its run_dir as given."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._grad_reset.remove()
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):
                undo()
        self._undo.clear()
        if self._router is not None:
            with contextlib.suppress(Exception):
                self._router.close()
            self._router = None
        self._unlock_run_dir()
        for folder in made:  # the deepest first
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        self._ctx = None
        self._update_buf, self._slices = None, None
        self._record = StepRecord(step=self.step)
        self._params, self._index_cache, self.groups, self._model_groups = [], {}, {}, {}
        self._outside[:] = []
        self._copies[:] = []
        self._sharded, self.memory = False, {}
        self.run_dir = run_dir
        self.model = self.optimizer = self.scaler = None

    def _write_json(self, name: str, data: Mapping[str, Any]) -> None:
        try:
            write_json(self._ensure_run_dir(), name, data)
        except OSError as e:
            warnings.warn(
                f"sfmonitor: {name} could not be written ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=3
            )

    def summary(self) -> dict[str, Any]:
        """Events and actions by kind, steps skipped or undone, rescue budget left, the monitor's
        own milliseconds per step (``summary.json`` in run_dir at detach)."""
        undo = self._ctx.undo if self._ctx is not None else None
        return run_summary(
            self._tally(),
            self.step,
            self._policy.rescues_used,
            self.config.policy.budget,
            self._own_seconds,
            self._own_steps,
            undo.nbytes if undo is not None else 0,
            self.config.dry_run,
            self._router.failures() if self._router is not None else {},
        )

    @_in_its_world
    def detach(self) -> None:
        """Remove every hook and restore what attach() replaced. Safe to call twice."""
        if self.model is None:
            return
        try:
            if self._record.phase is Phase.DECIDED:  # a step was interrupted: put everything back
                self._close(aborted=True)
            self._finish_pending(final=True)
            self._judge_last_update()
            if self._writer:
                summary = self.summary()
                self._write_json(SUMMARY_FILE, summary)
                if self.config.console:
                    print(format_summary(summary), file=sys.stderr)
        except Exception as e:
            warnings.warn(
                f"sfmonitor: detach could not finish the last step ({type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=2,
            )
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._grad_reset.remove()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._write_unwritten()
        if self._router is not None:
            self._router.flush()
            self._router.close()
            self._router = None
        # Drop every reference to the model, its state and copies of it (snapshots, the update
        # buffer); what the run learned (events, stats, state_dict()) stays.
        if self._ctx is not None:
            self._pending_ctx = {
                k: v
                for k, v in self.state_dict().items()
                if k in ("lr_scale", "batches_to_skip", "reweighted", "epoch", "lr_recovery")
            }
            self._should_stop = self.should_stop
        self._ctx = None
        self._update_buf, self._slices = None, None
        self._record = StepRecord(step=self.step)
        self._last = None
        self._params, self._index_cache, self.groups = [], {}, {}
        self._unlock_run_dir()
        self.model = self.optimizer = self.scaler = None

    close = detach

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _ensure_run_dir(self) -> str:
        if self.run_dir is None:
            # time, process and a counter: two monitors made in the same second get two folders
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_RUN_COUNTER)}"
            self.run_dir = os.path.join("sfmonitor_runs", name)
        return self.run_dir

    def _wrap_scaler(self, scaler: Any) -> None:
        """Join the scaler's one patch (``_ScalerPatch``); ``detach()`` leaves it, and the last
        monitor to leave puts the originals back."""
        patch = _SCALER_PATCHES.get(scaler)
        if patch is None:
            patch = _SCALER_PATCHES[scaler] = _ScalerPatch(scaler)
        patch.join(self)
        self._undo.append(lambda: patch.leave(self))

    def _lock_run_dir(self) -> str | None:
        """Refuse a run_dir another live monitor writes to (two monitors would interleave one
        metrics.jsonl). The lock holds the owner's pid; a lock whose process is gone is stale and
        taken over. Under torch.distributed only rank 0 writes, so only rank 0 locks."""
        if rank() != 0:
            return None
        folder = self._ensure_run_dir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK_FILE)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = int(open(path, encoding="utf-8").read().split()[0])
                except (OSError, ValueError, IndexError):
                    owner = -1
                if owner == os.getpid() or (owner > 0 and _alive(owner)):
                    raise ConfigError(
                        f"run_dir {folder!r} is already used by another monitor (process {owner}); "
                        f"give each monitor its own run_dir, or detach the other one first"
                    ) from None
                with contextlib.suppress(OSError):
                    os.remove(path)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{os.getpid()}\n")
            return path
        raise ConfigError(f"run_dir {folder!r}: could not take the lock file {path!r}")

    def _unlock_run_dir(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                os.remove(self._lock)
            self._lock = None

    # ------------------------------------------------------------------------------------------
    # user API
    # ------------------------------------------------------------------------------------------
    def combine(
        self,
        losses: Mapping[str, torch.Tensor] | torch.Tensor,
        weights: Mapping[str, float | torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The weighted total of the loss components with the *current* weights; records them.

        ``weights`` are the base weights (default 1 each), numbers or tensors; a tensor weight
        (learnable, e.g. uncertainty weighting) keeps its gradient. A reweight rescue changes the
        current weights, and ``loss_weight/<c>`` shows them. Call once per micro-batch. A call
        that computes no gradient (under ``torch.no_grad()`` / ``inference_mode``, or a loss that
        does not require grad: an evaluation loop) returns the total and records nothing.
        """
        return self._combine(losses, weights)

    @_in_its_world
    def _combine(
        self,
        losses: Mapping[str, torch.Tensor] | torch.Tensor,
        weights: Mapping[str, float | torch.Tensor] | None = None,
        record_scale: float = 1.0,
    ) -> torch.Tensor:
        """``combine``; ``record_scale`` multiplies what is recorded, never what is returned (an
        integration whose framework normalises each micro-batch's loss to the whole batch)."""
        if isinstance(losses, torch.Tensor):
            _check_scalar(losses, "the loss")
            if weights is not None:
                raise ConfigError(
                    "combine: weights are given with a single loss tensor, which has no components to "
                    "weigh; pass a dict {name: loss} or multiply the loss yourself"
                )
            if _trains(losses):
                self._open_record().losses.add({}, losses, {}, record_scale)
            return losses
        if not isinstance(losses, Mapping) or not losses:
            raise TypeError("combine: expected a non-empty dict {name: loss tensor} or a tensor")
        _check_component_names(losses)
        for name, value in losses.items():
            _check_scalar(value, f"loss component {name!r}")
        if weights is not None and not isinstance(weights, Mapping):
            raise ConfigError(f"combine: weights must be a dict {{name: weight}}, got {type(weights).__name__}")
        weights = dict(weights) if weights is not None else {k: 1.0 for k in losses}
        _check_weights(weights, losses)
        learnable = {k for k in losses if isinstance(weights[k], torch.Tensor)}
        for k in learnable:
            _check_scalar(weights[k], f"weight {k!r}")
        # A tensor weight is the user's own (it changes every step): its base is a multiplier of 1.
        base = {k: 1.0 if k in learnable else float(weights[k]) for k in losses}
        if base != self._base_weights:
            # New or changed base weights: rescues start over. Mutated in place: the action
            # context shares these dicts. The loop changed its loss: the step's record keeps the
            # weights before, to measure what the change did to the total (a new loss, not a spike).
            if self._base_weights and self._record.losses.changed is None:
                self._record.losses.changed = (dict(self._base_weights), dict(self._weights), dict(base))
            self._base_weights.clear()
            self._base_weights.update(base)
            self._weights.clear()
            self._weights.update(base)
        effective: dict[str, float | torch.Tensor] = {
            k: weights[k] * self._weights[k] if k in learnable else self._weights[k] for k in losses
        }
        total = functools.reduce(operator.add, [effective[k] * v for k, v in losses.items()])
        if not _trains(total):
            return total
        rec = self._open_record()
        if rec.losses.count == 0 and self._grad_ratio_due():
            rec.grad_ratio = self._component_grad_stats(losses)
        rec.losses.add(
            losses,
            total,
            {k: w.detach() if isinstance(w, torch.Tensor) else w for k, w in effective.items()},
            record_scale,
        )
        return total

    @property
    def last_step_skipped(self) -> bool:
        """Whether the monitor kept the update of the step that just closed from landing (a skip,
        an undo, a rollback, a stop): what the loop derives from the weights after the step (an
        EMA's ``update_parameters``) should be left out too, as the run without that step would."""
        return self._last is not None and self._last.skip

    def last_step_skipped_its_batch(self) -> bool:
        """Whether the step that just closed was skipped for its batch: a NaN input, a non-finite
        loss or a loss spike (the GradScaler patch keeps the loss scale then: the scale did not
        make that overflow, the batch did)."""
        last = self._last
        return last is not None and any(
            o.finding.kind in BATCH_FAULT_KINDS and SKIP_STEP in o.actions for o in last.outcomes
        )

    def _open_record(self) -> StepRecord:
        """The record of the step in flight, ready for this step's inputs. A record left DECIDED
        means its step never finished (the optimizer raised before its post-hook): it is closed
        as ABORTED first, with everything put back."""
        if self._record.phase is Phase.DECIDED:
            self._close(aborted=True)
        return self._record

    def _grad_ratio_due(self) -> bool:
        every = self.config.stats.grad_ratio_every
        # FSDP2: autograd.grad cannot reach the sharded parameters (the forward used gathered
        # copies), so grad_ratio/grad_cos are not measured there (docs/distributed.md).
        return (
            bool(every)
            and self.model is not None
            and not self._sharded
            and not self._grad_ratio_off
            and self.step % every == 0
            and torch.is_grad_enabled()
        )

    def _component_grad_stats(self, losses: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """grad_ratio/<a>/<b> and grad_cos/<a>/<b> on the parameters both components reach.

        One extra backward per component (autograd.grad, graph retained), on the first
        micro-batch of every ``grad_ratio_every``-th step; ``.grad`` is not touched. Buffers it
        changed are put back after it: through ``torch.utils.checkpoint`` the extra backward runs
        the checkpointed forward again (BatchNorm's running statistics would count it). A reentrant
        checkpoint refuses ``autograd.grad``: the measurement is then off for the run, with a
        warning.
        """
        pairs = S.pair_keys([k for k, v in losses.items() if v.requires_grad], self.config.stats.loss_ratio_pairs)
        if not pairs:
            return {}
        if self.config.stats.grad_ratio_groups:
            params = [p for g in self.config.stats.grad_ratio_groups for _, p in self.groups.get(g, [])]
        else:
            params = [p for p in self._params if p.requires_grad]
        comps = sorted({c for pair in pairs for c in pair})
        assert self.model is not None  # _grad_ratio_due
        hooked = _backward_hooked(self.model, params)
        if hooked is not None:
            return self._grad_ratio_refused(f"{hooked} has a backward hook, which the extra backward would run again")
        buffers = [b for b in self.model.buffers() if b.numel()]
        kept = [b.detach().clone() for b in buffers]
        try:
            grads = {c: torch.autograd.grad(losses[c], params, retain_graph=True, allow_unused=True) for c in comps}
        except RuntimeError as e:
            if "checkpoint" not in str(e):
                raise
            return self._grad_ratio_refused(
                f"the model uses torch.utils.checkpoint with use_reentrant=True, which refuses autograd.grad ({e}); "
                "use_reentrant=False keeps them"
            )
        finally:
            with torch.no_grad():  # only those it changed: a buffer saved for backward must keep its version
                for buf, before in zip(buffers, kept):
                    if not _same_bits(buf, before):  # (NaN running statistics equal themselves)
                        buf.copy_(before)
        out = {}
        for a, b in pairs:
            r = S.shared_grad_stats(grads[a], grads[b])
            if r is not None:
                out[S.GRAD_RATIO.format(a, b)], out[S.GRAD_COS.format(a, b)] = r
        return out

    def _grad_ratio_refused(self, why: str) -> dict[str, torch.Tensor]:
        """grad_ratio's extra backward cannot run without changing the run: off for the run, one warning."""
        self._grad_ratio_off = True
        warnings.warn(
            f"sfmonitor: grad_ratio/* and grad_cos/* are off for this run: {why}.", RuntimeWarning, stacklevel=4
        )
        return {}

    @property
    def stats(self) -> dict[str, float]:
        """The last optimizer step's statistics. Reading it right after a step forces the read of
        that step's update ratio (a host sync the monitor would otherwise do on the next step)."""
        self._finish_pending()
        return dict(self._stats)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the loader's batches, leaving out those a rollback asked to skip, and end once
        the monitor says stop (``should_stop``). While a loop draws its batches here, a spent
        rescue budget ends the loop cleanly instead of raising ``StopTraining``::

            for batch in monitor.batches(loader):
                ...  # forward, combine, backward, optimizer.step()
            # ends at the stop; the emergency checkpoint holds the last healthy state
        """
        return _Batches(self._batches(loader), loader)

    def _batches(self, loader: Iterable[Any]) -> Generator[Any, None, None]:
        self._batch_loops += 1
        closed = self._steps_closed
        fed: list[tuple[Any, list[int]]] = []  # the batches yielded since the last step ended
        try:
            for batch in loader:
                if self.should_stop:
                    return
                if self._ctx is not None and self._ctx.batches_to_skip > 0:
                    self._ctx.batches_to_skip -= 1
                    continue
                queue = [batch]
                while queue and not self.should_stop:
                    b = queue.pop(0)
                    versions = _tensor_versions(b)  # (a tensor's version moves when changed in place)
                    yield b
                    fed.append((b, versions))
                    if self._steps_closed == closed:
                        continue  # gradient accumulation: the step has more micro-batches
                    closed = self._steps_closed
                    step_batches, fed = fed, []
                    # An undo skipped the step these batches fed (their gradients came from the
                    # undone state): all of them (every micro-batch of an accumulated step) are
                    # used again, from the restored state, unless the loop changed them in place.
                    if self._ctx is not None and self._ctx.repeat_batch:
                        self._ctx.repeat_batch = False
                        intact = [b for b, v in step_batches if _tensor_versions(b) == v]
                        if len(intact) < len(step_batches) and not self._warned_inplace:
                            self._warned_inplace = True
                            warnings.warn(
                                "monitor.batches(): the loop changed the batch of an undone step in place "
                                "(an in-place transform such as Mixup or a normalisation); it is not used "
                                "again, which would transform it twice. Transform a copy (x = x.mul(...), "
                                "not x.mul_(...)) for the undone step's batch to be used again",
                                RuntimeWarning,
                                stacklevel=3,  # the loop that draws from batches()
                            )
                        queue = intact + queue
        finally:
            self._batch_loops -= 1

    @property
    def should_stop(self) -> bool:
        """True once the policy decided to stop (early stopping, or a spent rescue budget)."""
        return self._should_stop or (self._ctx is not None and self._ctx.should_stop)

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._should_stop = bool(value)
        if self._ctx is not None:
            self._ctx.should_stop = bool(value)

    def set_model_factory(self, factory: str, **kwargs: Any) -> None:
        """How ``sfmonitor replay`` rebuilds the model from a bundle: "module:function" and its
        JSON-able keyword arguments (the reference trainer sets this)."""
        if not isinstance(factory, str) or ":" not in factory:
            raise ConfigError(f"model factory must be 'module:function', got {factory!r}")
        self._model_factory = (factory, dict(kwargs))

    @_in_its_world
    def observe_eval(self, metrics: Mapping[str, float], chance: float | None = None) -> list[Event]:
        """Feed validation results to the evaluation detectors (accuracy collapse, plateau);
        their findings go through the same policy and actions. Returns the new events."""
        if self.model is None:
            raise RuntimeError(
                "observe_eval: the monitor is not attached (call attach() first); "
                "its actions would have no model to act on"
            )
        if not isinstance(metrics, Mapping):
            raise TypeError(f"observe_eval: metrics must be a mapping {{name: number}}, got {type(metrics).__name__}")
        for name, value in metrics.items():
            if (
                isinstance(value, bool)
                or not isinstance(value, (numbers.Real, torch.Tensor))
                or (isinstance(value, torch.Tensor) and value.numel() != 1)
            ):
                raise TypeError(
                    f"observe_eval: metrics[{name!r}] is {value!r:.40} (a {type(value).__name__}); expected a number"
                )
        values = agree_metrics(metrics)  # torch.distributed: the mean over ranks, so every rank decides alike
        self._live().epoch += 1  # validations mark epochs (the gradient-noise decay counts them)
        findings = [f for d in self._detectors for f in d.observe_eval(self.step, values, chance)]
        return self._decide_and_act(self.step, findings, None)

    # ------------------------------------------------------------------------------------------
    # hooks
    # ------------------------------------------------------------------------------------------
    # ------------------------------------------------------------------------------------------
    # the drivers: optimizer hooks, the GradScaler wrapper (above), integrations. Each calls the
    # same two entry points, before_update() and after_update().
    # ------------------------------------------------------------------------------------------
    def _on_optimizer_pre_step(self, optimizer, args, kwargs) -> tuple[tuple, dict] | None:
        if self._record.stepped:
            if _steps_in_flight(optimizer) > 1:  # a step() calling its parent's: the step begun
                self._nested_steps += 1
                return None
            self._close(aborted=True)  # the last optimizer.step raised before its post-hook
        self._nested_steps = 0
        # With a scaler the pipeline already ran inside scaler.step; driven externally, the
        # framework calls before_update() where its gradients are ready.
        changed: tuple[tuple, dict] | None = None
        if self.scaler is None and not self._driven_externally:
            # args[0] is the optimizer itself (the hook sees step's own arguments)
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if closure is not None and self._made_this_step():
                # step(closure) after the loop's own backward: the step's gradients are here, and
                # the closure is the optimizer's to call where it wants (SAM: a second
                # forward-backward at perturbed weights, in the middle of its step). A skip hides
                # them; a closure run then would make new ones, so the optimizer gets none to run.
                rec = self._record
                rec.closure_in_step = True
                self.before_update()
                if rec.skip:
                    changed = _with_closure(args, kwargs, lambda: None)
                rec.stepped = True
                return changed
            if closure is not None:
                # step(closure) with no gradient yet: the closure makes this step's gradients
                # inside the step. It runs here, as the optimizer would have run it first (SGD,
                # Adam and the like call it once; LBFGS is refused at attach), the pipeline reads
                # what it made, and the optimizer gets its loss back instead of running it again
                # (which would also undo a skip's hidden gradients).
                with torch.enable_grad():
                    loss = closure()
                changed = _with_closure(args, kwargs, lambda: loss)
            self.before_update()
        self._record.stepped = True
        return changed

    def _on_optimizer_post_step(self, optimizer, args, kwargs) -> None:
        if self._nested_steps:  # the end of a nested step() (see _steps_in_flight): not yet the step's
            self._nested_steps -= 1
            return
        self.after_update()
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        # The gradients a step(closure) leaves (a skip's put back): the next step's are its own
        # only if they differ (a loop whose closure zeroes and makes them leaves these till then).
        self._closure_grads = (
            [weakref.ref(p.grad) if p.grad is not None else None for p in self._params] if closure else None
        )

    def _warn_not_stepping(self) -> None:
        """``MAX_STEP_BATCHES`` training forwards and no step of the optimizer the monitor is
        attached to: said once for each such stretch. Never stepped: the loop steps another one
        (SAM's ``first_step()``). Stepped before: the loop replaced it (a new optimizer after a
        change of the model), and the run goes on unwatched; the monitor said nothing (a probe: a
        NaN batch and a 1e4x LR after a head swap, no event)."""
        optimizer = self._live().optimizer if self._ctx is not None else self.optimizer
        name = type(optimizer).__name__
        if self.step == 0:
            said = (
                f"{MAX_STEP_BATCHES} training forwards since monitor step {self.step} began, and the {name} the "
                "monitor is attached to never stepped: the monitor measures nothing until it does and keeps no "
                "more of these forwards' inputs. Attach it to the optimizer whose step() the loop calls (SAM's "
                "first_step()/second_step() call its base optimizer's step(), not its own)"
            )
        else:
            said = (
                f"{MAX_STEP_BATCHES} training forwards since the {name} the monitor is attached to last stepped "
                f"(monitor step {self.step}): the monitor measures nothing and rescues nothing until it steps "
                "again. If the loop now steps another optimizer (a new one after a change of the model: a new "
                "head, a precision switch), attach a monitor to that one: monitor.detach(); "
                "monitor = sfmonitor.attach(model, new_optimizer)"
            )
        warnings.warn(f"sfmonitor: {said}", RuntimeWarning, stacklevel=2)

    def _made_this_step(self) -> bool:
        """Whether the gradients present were made for the step about to run: a training loss went
        through ``combine()`` in it, or gradients are there that the last step(closure) did not
        leave (the loop's own backward before calling step(closure))."""
        if self._record.losses.count:
            return True
        last = self._closure_grads
        grads = [p.grad for p in self._params]
        if last is None:
            return any(g is not None for g in grads)
        return any(g is not None and (ref is None or ref() is not g) for g, ref in zip(grads, last))

    def drive_externally(self) -> Monitor:
        """Let a framework tell the monitor where the unscaled gradients are ready.

        Lightning calls ``optimizer.step(closure)``: the optimizer pre-hook fires before the closure
        has computed any gradient. An integration calls this once after attach, then
        ``before_update()`` from the framework's hook that runs after backward (and after
        unscaling) and before the update, and ``after_update()`` once the step is over (it is a
        no-op when the optimizer post-hook already finished the step).
        """
        self._driven_externally = True
        return self

    @_in_its_world
    def before_update(self) -> None:
        """Entry point 1: run the pipeline for the step in flight, where the unscaled gradients are
        ready and the update has not landed. A no-op when it already ran for this step. An
        exception inside closes the step as ABORTED (everything put back) and propagates. A step
        whose ``optimizer.step()`` began and raised (no step of it running now) is closed as
        ABORTED first."""
        if self.model is None:
            return
        self._forwards_idle = 0
        rec = self._record
        if rec.phase is Phase.DECIDED and rec.stepped and not _steps_in_flight(self._live().optimizer):
            rec = self._open_record()
        if rec.phase is not Phase.OPEN:
            return
        self._write_unwritten()  # the last step's actions that finished after its update
        ctx = self._live()
        if ctx.stopped:  # the run was stopped: further steps are skipped, without new events
            rec.phase = Phase.DECIDED
            rec.hide_grads(ctx.optimizer)
            rec.groups_before = group_entries(ctx.optimizer)
            return
        ctx.graceful_stop = self._batch_loops > 0
        ctx.repeat_batch = False  # a request to repeat the last step's batch was taken or not
        started = time.perf_counter()
        try:
            self._run_pipeline(rec)
        except BaseException:
            self._close(aborted=True)
            raise
        finally:
            self._own_seconds += time.perf_counter() - started
            self._own_steps += 1

    @_in_its_world
    def after_update(self, *, aborted: bool = False) -> None:
        """Entry point 2: close the step in flight once the optimizer ran or was skipped
        (``aborted``: an exception ended it before the update could land). A no-op when no step
        is in flight (e.g. the optimizer post-hook already closed it)."""
        if self.model is not None and self._record.phase is Phase.DECIDED:
            self._close(aborted=aborted)

    # ------------------------------------------------------------------------------------------
    # the per-step pipeline
    # ------------------------------------------------------------------------------------------
    def _run_pipeline(self, rec: StepRecord) -> None:
        """Everything the monitor does before an update lands, in this fixed order."""
        step = rec.step
        optimizer = self._live().optimizer
        if self._pairing_pending or sum(len(pg["params"]) for pg in optimizer.param_groups) != self._n_opt_params:
            self._index_params(by_grad=True)  # add_param_group() since the last step; masters that tied
        self._fresh_buffers()
        if not self._warned_join and getattr(getattr(self.model, "_join_config", None), "enable", False):
            self._warned_join = True
            warnings.warn(
                "sfmonitor: DDP's Join (uneven inputs) is on. A rank that runs out of batches shadows "
                "DDP's all-reduce but no longer steps, so the monitor's per-step reduction on the "
                "other ranks meets Join's and the job aborts (gloo: a collective mismatch). Give every "
                "rank the same number of batches (DistributedSampler(drop_last=True)) while the "
                "monitor is attached",
                RuntimeWarning,
                stacklevel=2,
            )

        if self._grad_reset.armed:  # (resets are seen from the first step's end on)
            self._reset_counts.append(self._resets)  # the loop's habit (_forward_starts)
        self._resets = self._attempt_resets = 0

        # 1. stats: every number of this step as a tensor, then ONE host read. The previous
        #    step's update ratios (measured after its update landed) ride along in the same read.
        tensors, grad_index = self._collect_tensors(rec, [p.grad for p in self._params])
        tensors.update(self._watch.pending())
        reset = self._grad_reset.take()
        tensors[S.GRADS_NOT_RESET] = -1.0 if reset is None else float(reset)
        reason, self._regime_next = self._regime_next, None  # (new_regime(): any rank's, for all)
        changed_by_loop, material = self._weights_changed_by_loop(step)
        if reason is None:
            reason = changed_by_loop
        # (a change the loop made counts only as large as the update before it, or larger: read here)
        tensors[S.NEW_REGIME] = (
            material if reason is changed_by_loop and material is not None else float(reason is not None)
        )
        if self._loop_writes.values_due(step):  # (sampled: counted in this one read)
            rec.values_written = self._values_written(step)
            if rec.values_written is not None:
                tensors[S.VALUES_WRITTEN] = rec.values_written.sum()
        self._watch.check_sight(trained=bool(grad_index))
        last = self._last if self._last is not None and self._last.after else None
        prev = {f"prev:{k}": v for k, v in last.after.items()} if last else {}
        # (the first read checks that every rank lays out the same statistics: the same step on each)
        values = S.read_all({**tensors, **prev}, check_layout=not self._layout_checked)
        self._layout_checked = True
        if world_size() > 1:
            self._watch.settle(values)  # (modules no rank ran; attention entropies' means)
        self._dead.resolve(values)  # dead_units/<group>: counts summed across ranks -> shares
        S.shares(values, S.ADAM_EPS.format(""))  # adam_eps/<group>: [|m| under eps, all |m|] -> share
        if last is not None:
            self._publish(last, {k[len("prev:") :]: values.pop(k) for k in prev})
        rec.internal = {k: values.pop(k) for k in list(values) if k in S.INTERNAL}
        rec.stats = values
        rec.batch_share = self._batch_share(rec.internal.get(S.INPUT_SIZE, 0.0))
        # The scaler will skip this very step (itself, or inside a fused optimizer): count it in
        # this step's record and in the running total.
        rec.scaler_skips = rec.internal.get(S.AMP_FOUND_INF, 0.0) > 0
        if rec.scaler_skips and self.scaler is not None and world_size() > 1:
            share_scaler_skip(self.scaler, optimizer)  # FSDP2: another rank's shard overflowed
        if rec.scaler_skips:
            rec.stats[S.AMP_SKIPPED] += 1
        self._stats = rec.stats

        # 2. detectors: the core's non-finite checks; the configured detectors (after-update ones
        #    judge the update the previous step landed); the activation watch.
        findings = self._nonfinite_findings(rec, grad_index) + self._zero_gradient_findings(rec)
        findings += self._zero_grad_missing_findings(rec)
        announced = rec.internal.get(S.NEW_REGIME, 0.0) > 0
        if announced and changed_by_loop is not None:
            self._loop_changed_at = step  # (a change of the weights the loop made: its habit from here)
        if announced:  # (before the detectors see the new data)
            self._new_regime(step)
            why = f" ({reason})" if reason else ("" if reason is not None else " (on another rank)")
            told = (
                reason
                if reason is not None and reason is changed_by_loop
                else f"the loop announced a change of data{why}"
            )
            findings.append(
                Finding(
                    NEW_REGIME,
                    f"{told}: the detectors learn what is usual afresh from this step, and the update before it "
                    "is not judged by its loss",
                    data={"reason": reason or "", "step": step},
                )
            )
        reweighted = None if announced else self._loss_reweighted(rec)
        if reweighted is not None:  # the loop changed its loss's weights: a new loss, no spike
            announced = True
            self._new_regime(step)
            if self._reweighted_at != step - 1:  # (told once for a run of changes: a steep ramp's steps)
                findings.append(reweighted)
            self._reweighted_at = step
        seen = rec.stats if rec.batch_share >= 1 else {**rec.stats, S.BATCH_SHARE: rec.batch_share}
        detected = [f for d in self._detectors if not d.after_update for f in d.check(step, seen)]
        if not announced:  # a jump that new inputs, or a change of the model no counter shows, explain
            jumped = [f for f in detected if f.kind in self._NEW_DATA_JUMPS]
            cause = self._jump_explained(step, jumped, rec)
            if cause is not None:
                announced = True
                self._new_regime(step)
                detected = [f for f in detected if all(f is not j for j in jumped)]
                findings.append(cause)
        harmful: list[Finding] = []  # the update that made this state, judged harmful (it is undone)
        if self._last is not None and self._last.phase is not Phase.ABORTED:
            prev_rec, self._last = self._last, None
            extra = {S.NEXT_LR.format(g): lr for g, lr in self._group_lrs(optimizer).items()}  # (the user's)
            # what that update did to the loss (not told by a loss of other data)
            if prev_rec.update_landed and S.LOSS_TOTAL in rec.stats and not announced:
                extra[S.LOSS_AFTER_UPDATE] = rec.stats[S.LOSS_TOTAL]
            if any(f.kind in self._TROUBLE_AFTER_UPDATE for f in findings + detected):
                self._measure_from_undo(prev_rec)  # (an update stats.update_ratio_every left unmeasured)
            judged = self._judge_update(prev_rec, extra)
            findings += judged
            harmful = self._harmful(judged)
            if prev_rec.update_landed:  # was the update the state comes from judged, and sound?
                self._last_update_sound = self._measured(prev_rec) and not harmful
        findings += detected
        if harmful:  # BatchNorm statistics a harmful update blew up: the state's doing, not the batch's
            findings = [f for f in findings if f.kind != BN_VAR_SPIKE]
        worst = int(rec.internal.get(S.BN_VAR_WORST, -1))
        if 0 <= worst < len(self._bn.layers):  # name the BatchNorm layer (the group's finding that holds it)
            name, _, gi = self._bn.layers[worst]
            for f in findings:
                if f.kind == BN_VAR_SPIKE and f.where == self._group_names[gi]:
                    f.data["module"] = name
        if any(f.kind in (LOSS_LEVEL_SHIFT, LOSS_LEVEL_RETURN) and f.where == _TOTAL for f in findings):
            self._new_regime(step)  # the data changed: what was usual before no longer is
        self._level_shift_held(step, findings, announced)
        self._bad_batches_on_a_sound_state(findings)
        self._fixed_batch(step, rec, findings)
        if self._watch.attached:
            watched = self._watch.findings(step, {**rec.stats, **rec.internal})
            if any(f.kind == BAD_BATCH for f in findings):  # a NaN input is no overflow
                watched = [f for f in watched if not f.data.get("nonfinite")]
            findings += watched

        # A trial (a drop and a rollback for a loss that grows, loss_divergence) judged by the
        # losses since: its verdict is a finding, told, or putting back what the trial changed.
        verdict = A.judge_trial(self._live(), step, rec.stats.get(S.LOSS_TOTAL))
        if verdict is not None:
            findings.append(verdict)

        # A healthy step starts from a good state to come back to: snapshot it, at the first
        # healthy step once `snapshot_every` steps have passed since the last snapshot.
        if all(f.handled_by_scaler for f in findings):
            ctx = self._live()
            if ctx.snapshots is not None:
                ctx.snapshots.beside = ctx.held_bytes()  # (what a trial or a level shift holds shares the budget)
                ctx.snapshots.maybe_take(
                    step, ctx.model, ctx.optimizer, ctx.scaler, ctx.with_outside_params({"step": step})
                )
                if ctx.snapshots.too_big is not None and not self._warned_snapshot_budget:
                    self._warned_snapshot_budget = True
                    warnings.warn(
                        f"sfmonitor: a snapshot of this run holds {ctx.snapshots.too_big / 2**20:.1f} MiB, over "
                        f"actions.rollback.max_host_mb ({self.config.actions.rollback.max_host_mb:g} MiB): no "
                        "snapshot is kept, so a rollback has nothing to go back to (raise the budget to allow it)",
                        RuntimeWarning,
                        stacklevel=2,
                    )

        if self._bundle_next and self._writer:  # request_bundle(): this step, as it is now
            self._bundle_next = False
            try:
                self.bundles.append(
                    self._write_bundle(
                        step, ON_DEMAND, {"step": step, "kind": ON_DEMAND, "message": "requested by the user"}
                    )
                )
            except Exception as e:
                warnings.warn(
                    f"sfmonitor: the bundle requested for step {step} could not be written "
                    f"({type(e).__name__}: {e}); training goes on",
                    RuntimeWarning,
                    stacklevel=2,
                )

        # 3. policy, 4. actions, 5. sinks (events): shared with observe_eval(). The step counts
        # as in flight from here: whatever ends it (hook, scaler, integration, exception) closes it.
        rec.phase = Phase.DECIDED
        self._decide_and_act(step, findings, rec)
        held = self._live().shift_held
        if held is not None and held["at"] == step and self._live().restored_at == step:
            self._live().shift_held = None  # (this step went back to an older state: the hold is of no state)
        self._expect_replay(step, rec)
        self._bn.rebase()  # the running statistics the next forward starts from (a skip put them back)

    def _decide_and_act(self, step: int, findings: list[Finding], rec: StepRecord | None) -> list[Event]:
        """Stages 3-5 for a list of findings: policy -> actions -> one event per finding.
        ``rec``: the step in flight (None for findings of an evaluation, between steps)."""
        ctx = self._live()
        outcomes = [Outcome(f) for f in findings]
        if rec is not None:
            rec.outcomes = outcomes
        # The scaler's own skips (finite loss, overflowing scaled gradients) are ordinary dynamic
        # loss scaling: recorded as events, never acted on.
        actionable = [f for f in findings if not f.handled_by_scaler and not f.told and not f.enforced]
        nonfinite = [f for f in actionable if f.kind in (NONFINITE_LOSS, NONFINITE_GRAD, BAD_BATCH)]
        landed_bad = [f for f in actionable if f.kind == NONFINITE_PARAM]
        if (nonfinite or landed_bad) and self.config.strict:
            events = [self._emit(self._event(step, o, rec)) for o in outcomes]
            first = (landed_bad or nonfinite)[0]  # a non-finite weight is the cause of the rest
            grad = next((f for f in nonfinite if f.kind == NONFINITE_GRAD), None)
            if first.kind == NONFINITE_LOSS:  # name where it shows first in the weights' gradients
                where = (
                    f"first non-finite gradient: {grad.where} (group {grad.data.get('group')})"
                    if grad is not None
                    else "no gradient is non-finite"
                )
                message = f"{first.message}; {where}"
            else:
                message = first.message
            raise NonFiniteError(f"step {step}: {message}", events[outcomes.index(by_finding(outcomes, first))])
        # 3. policy: findings -> decisions (ladders, cooldowns, budget).
        decisions = self._policy.decide(step, actionable)
        enforced = [Decision(a, f, {"enforced": True}) for f in findings if f.enforced for a in f.enforced]
        if enforced:  # (not the ladder's: what a refuted trial puts back; no rescue spent, one given back)
            order = action_order()
            decisions = sorted(decisions + enforced, key=lambda d: order.index(d.action))
            if any(d.cause.data.get("trial_refuted") for d in enforced) and self._policy.credit():
                enforced[-1].cause.data["budget_returned"] = 1
        if {d.action for d in decisions} & {UNDO, ROLLBACK}:
            # The state goes back: this step is skipped, and what the other findings saw of it (a
            # loss jump, a gradient spike, attention logits or activations its forward made, loss
            # ratios) are symptoms of the state being left. No separate answer: a QK-Clip, a
            # precision fallback or a reweighting would change the restored state for them.
            restore = next(d.action for d in decisions if d.action in (UNDO, ROLLBACK))
            decisions = _drop_moot(decisions, _MOOT_AFTER_RESTORE, restore)
        if rec is not None and nonfinite and not any(d.action in (SKIP_STEP, UNDO, ROLLBACK) for d in decisions):
            # The promise holds whatever the ladder says: a non-finite step never lands.
            decisions.insert(0, Decision(SKIP_STEP, nonfinite[0], {"enforced": True}))
        if any(d.action == SKIP_STEP for d in decisions):
            # The update does not land: a clip or gradient noise would only change the gradients
            # the loop gets back after optimizer.step().
            decisions = _drop_moot(decisions, (CLIP, GRAD_NOISE), SKIP_STEP)
        if self.config.dry_run:
            # Say what would have been done; change nothing. The policy still counts, so the
            # ladders, cooldowns and budget show what a live run would have reached.
            for d in decisions:
                d.cause.data.setdefault("dry_run_would", []).append(d.action)
            decisions = []
        # Evidence for the anomalies (non-finite values, findings that trigger actions), taken
        # before any action changes the state; warnings that trigger nothing cost nothing here.
        causes = {id(d.cause) for d in decisions}
        anomalies = [f for f in actionable if id(f) in causes or f.kind in NONFINITE_KINDS]
        if rec is not None and anomalies:
            self._gather_evidence(step, anomalies)

        # 4. actions: the only code that changes training. A failing action is told in its event
        #    and as a warning; the others still run (a skip still keeps the update out).
        ctx.step, ctx.stats = step, self._stats
        ctx.scaler_skips = rec is not None and rec.scaler_skips  # read in this step's one read
        by_cause = {id(o.finding): o for o in outcomes}
        stop: tuple[StopTraining, Outcome] | None = None
        try:
            for d in decisions:
                outcome = by_cause[id(d.cause)]
                try:
                    facts = A.apply(ctx, d)
                except StopTraining as e:
                    facts, stop = dict(e.facts or {"reason": str(e)}), (e, outcome)
                except Exception as e:
                    facts = {"failed": f"{type(e).__name__}: {e}"}
                    warnings.warn(
                        f"sfmonitor: action {d.action} failed at step {step} ({type(e).__name__}: {e})",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                outcome.actions.append(d.action)
                outcome.results[d.action] = facts
                if "streak" in d.params:  # why this rung: how many times the kind came, how close
                    d.cause.data.setdefault(
                        "policy", {"streak": d.params["streak"], "rung": d.params.get("rung_after")}
                    )
                if stop is not None:
                    break
            budgeted = [o.results[a] for o in outcomes for a in o.actions if a in self.config.policy.budget_actions]
            if budgeted and not any(changed_something(facts) for facts in budgeted):
                self._policy.refund(step)  # the budget counts only rescues that did something
            if ctx.announce is not None:  # (a restart from the run's start: the detectors learn afresh)
                self._regime_next, ctx.announce = ctx.announce, None
            if rec is not None:
                if ctx.skip:
                    # An optimizer that reads the gradients before calling its closure (SAM's
                    # ascent) fails on none: with this step's exact copy (captured below) it runs
                    # on them, and the copy is put back when the step closes (a skip all the same).
                    rec.restore_after = rec.closure_in_step and ctx.undo is not None and not ctx.stopped
                    if not rec.restore_after:
                        rec.hide_grads(ctx.optimizer)
                    restored = ctx.restored_at == step  # (an undo or a rollback put the state back)
                    held = ctx.buffer_copy()
                    if held is not None and held[0].label == step - 1 and not restored:
                        # What this step's forward wrote into the buffers (BatchNorm statistics of
                        # a NaN batch) goes too: a skipped batch is a batch never seen. (An undo
                        # already put them back as they were before the undone step's forward; a
                        # rollback, or a refuted trial's put-back, as its state held them.)
                        held[0].restore_buffers(held[1])
                relaxed = A.relax_weights(ctx)
                if relaxed.get("restored"):
                    outcomes.append(
                        Outcome(
                            Finding(
                                LOSS_RATIO_IMBALANCE,
                                f"loss ratio back under its threshold: weights restored "
                                f"to their base {self._base_weights}",
                                {"restored": relaxed["restored"]},
                            ),
                            [REWEIGHT],
                            {REWEIGHT: relaxed},
                        )
                    )
                # After a transient the LR climbs back (an event each way), and halts for good
                # where the loss rises with it (an event too).
                recovered = A.relax_lr(ctx, self._stats.get(S.LOSS_TOTAL))
                if recovered.get("halted"):
                    message = A.halt_message(recovered, self.config.actions.lr_drop)
                elif recovered.get("released"):
                    message = (
                        "the user's LR fell to the level the LR drop set (or below it): the drop is released, "
                        "the LR is the user's schedule again"
                    )
                elif recovered and ctx.lr_warmup is not None and recovered.get("recovering"):
                    why = (
                        "a warm-up from the run's start (a restart)"
                        if ctx.lr_drop_kind == VANISHING_GRADIENT
                        else "a warm-up after the first updates were larger than the weights"
                    )
                    message = f"{why}: the LR climbs back to the user's schedule over {recovered['steps']} steps"
                elif recovered:
                    what = "is back to" if recovered.get("recovered") else "climbs back towards"
                    message = f"no trouble since the LR drop: the LR {what} the user's schedule"
                if (recovered.get("recovered") or recovered.get("released")) and self._policy.credit():
                    recovered["budget_returned"] = 1  # (the incident is over: its rescue is given back)
                if recovered:
                    outcomes.append(Outcome(Finding(ctx.lr_drop_kind, message), [LR_DROP], {LR_DROP: recovered}))
                # The LR scale (lr_drop) applies around this update only; the user's own LR and
                # scheduler are put back when the step closes (see actions.py).
                # The user's LR per group (before the drop): the update-ratio test reads updates per
                # unit of it, so the user's schedule is no spike and the monitor's own drop a remedy.
                rec.group_lr, rec.lr_scale = self._group_lrs(ctx.optimizer), ctx.lr_scale
                rec.saved_lr = A.apply_lr_scale(ctx.optimizer, ctx.lr_scale, self.config.actions.lr_drop.min_lr)
                rec.groups_before = group_entries(ctx.optimizer)  # (as the optimizer's step finds them)
                if ctx.undo is not None and not ctx.stopped:
                    # The state this update starts from: an exact undo of it, and the update ratio's
                    # "before" (no other copy of the parameters is held).
                    ctx.undo.capture(
                        step,
                        self._params,
                        ctx.optimizer,
                        ctx.undo_buffers,
                        ctx.scaler,
                        ctx.tracked_tensors(),
                        groups=rec.groups_before,
                    )
                    rec.before_params = ctx.undo.params
                elif ctx.stats_copy is not None and not ctx.stopped:
                    # (the lean profile) the running statistics alone, as the next forward finds them
                    ctx.stats_copy.capture(step, [], ctx.optimizer, ctx.stats_buffers)
                for i, pg in enumerate(ctx.optimizer.param_groups):
                    if pg["lr"] is not None:  # (None: the optimizer sizes its steps itself)
                        self._stats[S.LR.format(i)] = float(pg["lr"])
        finally:
            ctx.skip = False

        # 5. sinks: one event per finding, with the actions it caused and what they did.
        events = [self._emit(self._event(step, o, rec)) for o in outcomes]
        if stop is not None:
            error, outcome = stop
            error.event = events[outcomes.index(outcome)]
            raise error  # before_update() closes the step as ABORTED: the update never lands
        return events

    def _event(self, step: int, outcome: Outcome, rec: StepRecord | None) -> Event:
        f = outcome.finding
        data = dict(f.data)
        if outcome.results:
            data["action_results"] = outcome.results
        held = [s for s in self._policy.suppressed if s["kind"] == f.kind]
        if held:
            data["suppressed"] = held
        if f.handled_by_scaler:
            data["skipped_by"] = "grad_scaler"
        if rec is not None and rec.skip and f.kind in NONFINITE_KINDS and not outcome.actions:
            data["step_skipped"] = True  # by another finding's skip_step in this same step
        # A finding judged after an update landed names the step of that update (a non-finite
        # weight, seen before the step in flight, keeps this step: it stops this update too).
        at = f.step if f.step is not None and not f.before_update else step
        return Event(at, f.kind, f.message, data, list(outcome.actions))

    def _gather_evidence(self, step: int, findings: list[Finding]) -> None:
        """The playbook: per-input statistics of the step's batch on every anomaly, and one anomaly
        bundle (pre-step state, batch, stats, RNG, config) for the step where a kind first shows."""
        inputs = batch_input_stats(self._recorder.batches)
        for f in findings:
            f.data.setdefault("inputs", inputs)
        new = [f for f in findings if f.before_update and self._bundles.should_write(f.kind)]
        if not new or not self._writer or self._sharded:  # FSDP2: no rank holds the whole model
            return
        first = new[0]
        try:
            path = self._write_bundle(
                step,
                first.kind,
                {"step": step, "kind": first.kind, "message": first.message, "data": first.data, "where": first.where},
            )
            dropped = load_manifest(path).get("batch_dropped_reason")
        except Exception as e:
            first.data["bundle_error"] = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"sfmonitor: the anomaly bundle of step {step} could not be written ({type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        for f in new:  # one bundle serves every finding of the step
            self._bundles.mark(f.kind, step)
            f.data["bundle"] = path
            if dropped:
                f.data["bundle_batch_dropped"] = dropped

    def _write_bundle(self, step: int, kind: str, event: dict[str, Any]) -> str:
        factory, kwargs = self._model_factory or (None, None)
        cfg = self.config.bundle
        optimizer = self._live().optimizer
        # ZeroRedundancyOptimizer: only a collective of every rank gathers its state, and rank 0
        # writes the bundle alone
        whole = not state_dict_needs_every_rank(optimizer)
        return write_bundle(
            self._ensure_run_dir(),
            step,
            kind,
            model_state=self._live().model.state_dict(),
            optimizer_state=optimizer.state_dict() if whole else None,
            omitted=None if whole else {"optimizer": "ZeroRedundancyOptimizer's state is sharded over the ranks"},
            batch=self._recorder.batches,
            stats=self._stats,
            event=event,
            rng_state=self._recorder.rng_state,
            config=self.config.to_dict(),
            model_factory=factory,
            model_kwargs=kwargs,
            loss_weights=dict(self._weights),
            max_bytes=int(cfg.max_mb * 2**20),
            dir_name=cfg.dir,
        )

    def new_regime(self, reason: str = "") -> None:
        """Say that the data changes from the step being taken (or, between steps, the next one): a
        new task, a curriculum stage, a new data mix, a DQN's hard target-network sync. From that
        step the detectors learn what is usual afresh (the loss's level, the gradients' and the
        updates' sizes; their priors judge meanwhile), and the update before it is not judged by
        that step's loss, which comes from other data. Unannounced, such a jump is skipped as bad
        data until ``detectors.loss_spike.shift_after`` batches agree on the new level. Told as an
        event (``new_regime``, no action) with ``reason``."""
        if not isinstance(reason, str):
            raise TypeError(f"new_regime: reason must be a str, got {type(reason).__name__}")
        self._regime_next = reason

    def _loss_reweighted(self, rec: StepRecord) -> Finding | None:
        """A ``new_regime`` finding where the base weights given to ``combine()`` changed in this step
        and moved the total beyond ``WEIGHTS_JUMP`` x what the weights before give on the step's own
        components (an auxiliary loss switched on, a KL weight set from 0 to 1): the loop changed its
        loss, and the detectors learn the new one afresh. A ramp's small steps are followed by the
        detectors' windows as they are. None otherwise."""
        # Decided on the values read (reduced across ranks: every rank decides alike); where the
        # weights did not change, the total at the old weights is the total itself.
        old, total = rec.internal.get(S.LOSS_AT_OLD_WEIGHTS), rec.stats.get(S.LOSS_TOTAL)
        if old is None or total is None or not (S.finite(old) and S.finite(total)) or old == total:
            return None
        if old > 0 and total > 0:
            ratio = total / old
            if max(ratio, 1 / ratio) <= self.WEIGHTS_JUMP:
                return None
        else:
            ratio = math.nan  # (a signed loss: no ratio)
        changed = rec.losses.changed
        before, after = (changed[0], changed[2]) if changed is not None else ({}, dict(self._base_weights))
        moved = (
            ", ".join(f"{k} {before.get(k, 0.0):.4g} -> {after[k]:.4g}" for k in after if before.get(k) != after[k])
            if changed is not None
            else "on another rank"
        )
        return Finding(
            NEW_REGIME,
            f"the loss weights given to combine() changed ({moved}): the loss is {total:.4g}, "
            + (f"{ratio:.3g}x" if math.isfinite(ratio) else "against")
            + f" {old:.4g} at the weights before on this step's components. A new loss: the detectors "
            "learn what is usual afresh from this step, and the update before it is not judged by its loss",
            data={
                "reason": "loss weights",
                "weights_before": before,
                "weights": after,
                "ratio": ratio if math.isfinite(ratio) else None,
                "step": rec.step,
            },
        )

    def _level_shift_held(self, step: int, findings: list[Finding], announced: bool) -> None:
        """The state held across a level shift of the loss (``actions.hold_before_shift``): taken
        at a shift that may end (its finding's data ``returnable``; the facts go into its data),
        put back at its end (``loss_level_return``: the put-back is the finding's own, enforced;
        told where nothing is held), and let go ``return_within`` steps after the shift or at a
        change of data the loop made or announced (the detectors forget the shift then too)."""
        ctx = self._live()
        held = ctx.shift_held
        if held is not None and (announced or step - held["at"] > self.config.detectors.loss_spike.return_within):
            ctx.shift_held = held = None
        for f in findings:
            if f.where != _TOTAL:
                continue
            if f.kind == LOSS_LEVEL_SHIFT and f.data.get("returnable"):
                facts = A.hold_before_shift(ctx, step)
                f.data.update(facts)
                within = self.config.detectors.loss_spike.return_within
                f.message += (
                    f"; should the loss fall back to its level before within {within} steps, the state from "
                    "before this step is put back"
                    if facts["held"]
                    else f" ({facts['reason']})"
                )
            elif f.kind == LOSS_LEVEL_RETURN:
                if held is not None and held["at"] == f.data["shift_step"]:
                    f.enforced = (ROLLBACK,)
                    f.message += ": the state from before the shift is put back"
                else:
                    ctx.shift_held = None
                    f.told = True
                    f.message += " (no state from before the shift is held: nothing to put back)"

    def _weights_changed_by_loop(self, step: int) -> tuple[str | None, torch.Tensor | None]:
        """The reason of a new regime where the loop changed the weights since the last step ended
        (``loopwrites``: a head re-initialised, a checkpoint loaded, shrink and perturb): the step's
        loss measures that change, neither its batch nor the update before it (judged as bad
        batches on a sound state, the batches after a re-initialised head were skipped until
        their level had been seen 8 times). A change within ``LOOP_HABIT`` steps of the loop's
        last one is its habit, its training and not a change of it (a WGAN critic's clamp after
        every step): told once, when it starts. (None, None) otherwise.

        With the reason, whether the change is material (a 0-d tensor, 1.0 where it is, read in
        the step's one read; None where it cannot be measured: no undo copy of the last update,
        which the change is measured from): a write that moved the weights less than the update
        before it and ``WRITE_SHARE`` of their norm explains no jump, and is no new regime
        (schedule-free AdamW's ``eval()`` / ``train()`` around an evaluation move the weights to
        their average and back: rounding is all they change, and every evaluation more than
        ``LOOP_HABIT`` steps after the last told one and reset the detectors). Local: one
        rank's change applies on every rank through the read (``S.NEW_REGIME``)."""
        changed = self._loop_writes.changed(self._params)
        if not changed:
            return None, None
        last = self._loop_changed_at
        if last is not None and step - last <= self.LOOP_HABIT:
            self._loop_changed_at = step
            return None, None
        groups = list(dict.fromkeys(self._group_names[self._param_group[i]] for i in changed))
        reason = (
            f"the loop changed the weights of {'group' if len(groups) == 1 else 'groups'} {', '.join(groups)} "
            "since the last step "
            f"({len(changed)} of {len(self._params)} parameter tensors)"
        )
        differs = self._moved_beyond_update(step, whole=True)
        return reason, differs[changed].any().float() if differs is not None else None

    def _jump_explained(self, step: int, jumped: list[Finding], rec: StepRecord) -> Finding | None:
        """``new_regime`` where the step's jumps (``jumped``) are new data's or the loop's change of
        the model, not a bad batch's: inputs of a new shape (``_new_shape_finding``), else a change
        no version counter shows (``_unseen_change``, which also learns the loop's habits at steps
        without a jump). None otherwise."""
        if jumped and rec.internal.get(S.NEW_INPUT_SHAPE, 0.0) > 0:
            finding = self._new_shape_finding(step, jumped)  # (names the new shapes: before they are let go)
            for shape in self._recorder.shapes:  # (taken as new data: later jumps are judged as usual)
                self._shapes_since.pop(shape, None)
            return finding
        return self._unseen_change(step, jumped, rec)

    def _unseen_change(self, step: int, jumped: list[Finding], rec: StepRecord) -> Finding | None:
        """``new_regime`` for a step whose loss or gradient norm jumped (``jumped``: the findings
        that said so) where the loop changed the model in a way no parameter's version counter
        shows (``loopwrites``): a buffer added or replaced (``torch.nn.utils.prune``'s mask; the
        weights stay as they were), or weights written through ``p.data`` (magnitude pruning by
        hand, ``p.data.mul_(mask)``). Judged as bad batches on a sound state, the 8 batches after 90%
        of a layer was pruned either way were skipped. A write too small to explain a jump is none
        (``_values_written``); values are also counted at sampled steps without a jump, in the
        step's one read, to learn a loop that writes large ones through ``.data`` at every step
        (weight noise): its habit, as for the writes the counters show. None where nothing is
        found, or it is the loop's habit. Every rank decides alike: a sample is agreed in the read,
        a jump's look in one max collective (and a host read of its own: a step in trouble)."""
        lw = self._loop_writes
        sampled = rec.internal.get(S.VALUES_WRITTEN)  # (this step's sample, read with its statistics)
        if not jumped:
            if sampled is not None and sampled > 0:
                lw.values_found(step, self.LOOP_HABIT)
            return None
        buffers = lw.buffers_changed(step, self.LOOP_HABIT)
        differs = rec.values_written if sampled is not None else self._values_written(step)
        written = differs.nonzero().flatten().tolist() if differs is not None else []
        found = [float(bool(written)), float(bool(buffers))]
        if world_size() > 1:
            found = sharding.max_over_ranks(torch.tensor(found, dtype=torch.float64)).tolist()
        news = found[0] > 0 and lw.values_found(step, self.LOOP_HABIT)
        if not (news or found[1] > 0):
            return None
        parts = []
        if news:
            groups = list(dict.fromkeys(self._group_names[self._param_group[i]] for i in written))
            parts.append(
                f"weights of {'group' if len(groups) == 1 else 'groups'} {', '.join(groups)} written through "
                f".data ({len(written)} of {len(self._params)} parameter tensors)"
                if written
                else "weights written through .data on another rank"
            )
        if found[1] > 0:
            shown = ", ".join(buffers[:4]) + (f" and {len(buffers) - 4} more" if len(buffers) > 4 else "")
            parts.append(
                f"{'buffer' if len(buffers) == 1 else 'buffers'} {shown}" if buffers else "buffers on another rank"
            )
        reason = f"the loop changed the model since the last step: {'; '.join(parts)}"
        kinds = ", ".join(dict.fromkeys(f.kind for f in jumped))
        return Finding(
            NEW_REGIME,
            f"{reason}, and {kinds} with it: the change's doing (pruning, a mask, weights set by hand), not a "
            "bad batch. The detectors learn what is usual afresh from this step, and the update before it is "
            "not judged by its loss",
            data={
                "reason": reason,
                "written": [self._param_names[i] for i in written] if news else [],
                "buffers": buffers,
                "jumps": [f.kind for f in jumped],
                "step": step,
            },
        )

    @torch.no_grad()
    def _values_written(self, step: int) -> torch.Tensor | None:
        """Per parameter (a bool vector, no host read), whether its values changed since the last
        step's update landed with no version counter to show it (a write through ``.data``), by
        more than that update's size and ``WRITE_SHARE`` of the weights (``_moved_beyond_update``).
        The writes the counters show (``_weights_changed_by_loop``'s) and the monitor's own are
        left out. None where the last update was not measured."""
        differs = self._moved_beyond_update(step)
        if differs is None:
            return None
        shown = self._loop_writes.changed(self._params) + self._loop_writes.own(self._params)
        if shown:
            differs[shown] = False
        return differs

    def _moved_beyond_update(self, step: int, whole: bool = False) -> torch.Tensor | None:
        """Per parameter (a bool vector, no host read), whether something other than the last
        update moved its values since that update landed: the distance from the undo copy, which
        holds the state before that update, is not what the update moved (``keep_moved``), by more
        than that update's size and ``WRITE_SHARE`` of the weights (the difference of the two
        distances is a lower bound on the write's norm). A smaller write cannot explain a jump the
        updates did not make: a mask or a clamp the loop keeps after every step takes back part of
        what the optimizer moved, and was taken for the jump's cause before the sampling had seen
        the habit (a garbage batch 10 steps after a lottery ticket's first re-masking landed).
        Without the undo copy (the lean profile) what the update ratio measured is compared, its
        norms as the update left them against its norms now (their difference the same lower bound
        on a write): in the lean profile a slice of each parameter, moving every step, so a write
        that misses the slice is not seen (``whole``: None there). None where the last update was
        not measured."""
        kept = self._loop_writes.moved(step - 1)
        if kept is None or kept.numel() != len(self._params):
            return None
        slices = self._loop_writes.slices(step - 1)
        if slices is not None:  # the lean profile: the slices' norms as the update left them, and now
            if whole:
                return None
            now = S.norms(slices[0])
            gap = (now - slices[1]).abs()
        else:
            undo = self._ctx.undo if self._ctx is not None else None
            if undo is None or undo.label != step - 1 or len(undo.params) != len(self._params):
                return None
            live = self._layout.detached(self._params)
            gap = (update_norms(undo.params, live, self._scratch) - kept).abs()
            now = S.norms(live)
        # the gap is at most the write's norm: a write under the update's own size, or 1% of the
        # weights, explains no jump (a mask or a clamp kept after every step takes back part of
        # what the optimizer moved; an EMA target's step)
        return gap > torch.maximum(kept, self.WRITE_SHARE * now)

    # Findings of a step whose inputs came in a new shape that say the new data's doing, not a bad batch's
    _NEW_DATA_JUMPS = frozenset({LOSS_SPIKE, LOSS_COMPONENT_SPIKE, GRAD_SPIKE})

    def _input_shapes_new(self, step: int) -> bool:
        """Whether the step's inputs came in a shape per example (all but the first dimension of
        each input tensor) that none of the last ``BATCH_SIZES`` steps had before it first came, at
        most ``NEW_SHAPE_STEPS`` steps ago: images resized, a longer sequence length (the jump may
        come a step or two after the first batch of the new data). False without inputs or history."""
        last, since = self._shapes_last, self._shapes_since
        for old in [s for s, at in since.items() if step - at >= self.NEW_SHAPE_STEPS]:
            del since[old]
        shapes = self._recorder.shapes
        for shape in shapes:
            if last and step - last.get(shape, -math.inf) > self.BATCH_SIZES:
                since[shape] = step
            last[shape] = step
        if len(last) > 4 * self.BATCH_SIZES:  # (a bucketed loop's many lengths: forget the long gone)
            for old in [s for s, at in last.items() if step - at > self.BATCH_SIZES]:
                del last[old]
        return any(shape in since for shape in shapes)

    def _shapes_new(self) -> list[Any]:
        """The step's input shapes that ``_input_shapes_new`` found new (this rank's)."""
        return [shape for shape in self._recorder.shapes if shape in self._shapes_since]

    def _new_shape_finding(self, step: int, jumped: list[Finding]) -> Finding:
        """``new_regime`` for a step whose inputs came in a new shape and whose loss or gradient
        norm jumped with them (``jumped``: the findings that said so, dropped): progressive
        resizing, a sequence-length curriculum. Judged as bad batches on a sound state, the 8
        batches after images went from 16 to 32 pixels were skipped (held-out loss 1.015-1.051x
        bare); a garbage batch of the usual shape is skipped as before."""
        new = self._shapes_new()
        shapes = [" x ".join(map(str, s[0])) if len(s) == 1 else str([list(t) for t in s]) for s in new]
        where = f" ({'; '.join(shapes)} per example)" if shapes else " (on another rank)" if world_size() > 1 else ""
        kinds = ", ".join(dict.fromkeys(f.kind for f in jumped))
        return Finding(
            NEW_REGIME,
            f"the inputs came in a shape the steps before did not have{where}, and "
            f"{kinds} with them: new data (images resized, a longer sequence), not a bad batch. The detectors "
            "learn what is usual afresh from this step, and the update before it is not judged by its loss",
            data={
                "reason": "input shape",
                "shapes": [[list(t) for t in s] for s in new],
                "jumps": [f.kind for f in jumped],
                "step": step,
            },
        )

    def _new_regime(self, step: int) -> None:
        """The data changed at ``step``: every detector that keeps what was usual forgets it."""
        for d in self._detectors:
            new_regime = getattr(d, "new_regime", None)
            if new_regime is not None:
                new_regime(step)

    @_in_its_world
    def request_bundle(self) -> None:
        """Write an anomaly bundle of the next optimizer step (its pre-step state and batch), as
        if something had gone wrong there: for reproducing a step by hand with `sfmonitor replay`.
        Its path lands in ``monitor.bundles``. Needs ``bundle.on_demand`` (default true)."""
        if not self._bundles.should_write(ON_DEMAND, on_demand=True):
            raise ConfigError("request_bundle: bundle.on_demand is false (or bundle.enabled is false)")
        if self._sharded:
            raise ConfigError(
                "request_bundle: the model is sharded (FSDP2) and a bundle holds the whole model; "
                "an emergency checkpoint (torch.distributed.checkpoint) keeps the shards instead"
            )
        self._bundle_next = True

    @torch.no_grad()
    def _collect_tensors(
        self, rec: StepRecord, grads: list[torch.Tensor | None]
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """All values of the step as 0-d tensors (or Python numbers); nothing is read here.
        Returns them and the indices of the parameters that have a gradient."""
        out: dict[str, Any] = {}
        out.update(rec.losses.tensors(self.config.stats.loss_ratio_pairs))
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        measured = S.norms(self._layout.local(g for _, g in present))  # FSDP2: local shards
        # The user clipped before optimizer.step(): the norms as backward left them (userclip.py).
        grad_norms, user_clipped = self._user_clip.take(rec.step, present, measured)
        key = tuple(i for i, _ in present)  # which parameters have gradients: stable across steps
        cached = self._index_cache.get(key)
        if cached is None:  # group index tensors are built once, not copied per step
            index = self._layout.index(key, self._param_group, grad_norms.device)
            by_block = self._layout.index(key, self._param_block, grad_norms.device)
            cached = self._index_cache[key] = (index, frozenset(self._param_group[i] for i in key), by_block)
        index, rec.grad_groups, by_block = cached
        per_group = S.group_norms(grad_norms, index, len(self._group_names))
        out[S.GRAD_NORM_TOTAL] = per_group.square().sum().sqrt()
        for gi, g in enumerate(self._group_names):
            out[S.GRAD_NORM.format(g)] = per_group[gi]
        if self._block_names:
            per_block = S.group_norms(grad_norms, by_block, len(self._block_names) + 1)
            for bi, b in enumerate(self._block_names):
                out[S.BLOCK_GRAD_NORM.format(b)] = per_block[bi]
        if user_clipped:
            after = S.group_norms(measured, index, len(self._group_names))
            out.update(self._user_clip.stats(out[S.GRAD_NORM_TOTAL], after.square().sum().sqrt()))
        params = self._layout.detached(self._params)  # FSDP2: the local shards
        param_norms = S.norms(params)
        per_group_p = S.group_norms(param_norms, self._param_group_t, len(self._group_names))
        for gi, g in enumerate(self._group_names):
            out[S.PARAM_NORM.format(g)] = per_group_p[gi]
        if self._bn.layers:  # what the step's batch did to BatchNorm's running variances
            out.update(self._bn.measure())
        every = self.config.stats.dead_units_every
        if every and rec.step % every == 0 and self._dead.layers:
            out.update(self._dead.measure({i: local(gr) for i, _ in self._dead.layers if (gr := grads[i]) is not None}))
        optimizer = self._live().optimizer
        every = self.config.stats.adam_eps_every
        if every and rec.step and rec.step % every == 0:  # (step 0: no second moment yet)
            out.update(S.eps_dominated(optimizer, self._group_of_id, local))
        for i, pg in enumerate(optimizer.param_groups):
            lr = pg["lr"]
            if lr is not None:  # (None: the optimizer sizes its steps itself, Adafactor's relative step)
                out[S.LR.format(i)] = lr if isinstance(lr, torch.Tensor) else float(lr)
        out.update(rec.grad_ratio)
        if self.scaler is not None:
            scale = self.scaler._scale
            out[S.AMP_LOSS_SCALE] = scale if scale is not None else float(self.scaler.get_scale())
            out[S.AMP_SKIPPED] = float(self._amp_skipped)
            found = self.scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
            if found:
                out[S.AMP_FOUND_INF] = sum(v.to(next(iter(found.values())).device) for v in found.values())
        # Which gradients / parameters are non-finite: first index, count (resolved at the read).
        bad_grad = ~torch.isfinite(grad_norms)
        if user_clipped:  # name the gradient the clip spread a NaN from; catch one that came after it
            bad_grad = torch.where(bad_grad.any(), bad_grad, ~torch.isfinite(measured))
        out[S.GRAD_FIRST_NONFINITE] = index.param_of(S.first_true(bad_grad))  # a parameter index
        out[S.GRAD_NONFINITE_COUNT] = bad_grad.sum()
        bad_param = ~torch.isfinite(param_norms)
        out[S.PARAM_FIRST_NONFINITE] = S.first_true(bad_param)
        out[S.PARAM_NONFINITE_COUNT] = bad_param.sum()
        # The inputs' values, sent whatever this step's forwards saw (under a process group every
        # rank sends the same keys: a rank whose forward took no tensor, or an empty batch, sends
        # none found and no tally, NaN, which makes the sum over the ranks none too)
        bad_inputs, tally = self._recorder.nonfinite_inputs(), self._recorder.fingerprint
        if bad_inputs is None or tally is None:
            none_found, no_tally = self._no_inputs(bad_grad.device)
            bad_inputs = none_found if bad_inputs is None else bad_inputs
            tally = no_tally if tally is None else tally
        out[S.INPUT_NONFINITE] = bad_inputs
        out[S.INPUT_FINGERPRINT] = S.Vector(tally)
        out[S.INPUT_SIZE] = float(self._recorder.numel)
        out[S.NEW_INPUT_SHAPE] = float(self._input_shapes_new(rec.step))
        if world_size() > 1:  # where a non-finite value started: one-hot per rank, summed at the read
            out[S.NONFINITE_BY_RANK] = S.Vector(
                rank_slots(out.get(S.LOSS_TOTAL), bad_grad.sum(), bad_param.sum(), bad_inputs)
            )
        every = self.config.stats.update_ratio_every
        if every and rec.step % every == 0:
            rec.before_norms = param_norms
            if self._live().undo is not None:
                return out, key  # the undo copy, taken after the actions, is the "before"
            # Without it: a copy of what is measured, the whole parameters or a slice of each that
            # moves every step (stats.update_ratio_fraction), in buffers allocated once and reused
            # (copying into warm memory is several times cheaper than a fresh clone each step).
            fraction = self.config.stats.update_ratio_fraction
            if fraction >= 1.0:
                if self._update_buf is None:
                    self._update_buf = Arena()  # one flat buffer per dtype, one fused copy
                rec.before_params = self._update_buf.copy_from(params)
                return out, key
            if self._slices is None or self._slices.fraction != fraction:
                self._slices = S.RotatingSlices(fraction)  # flat buffers as large as a window
            live, before = self._slices.take(params, rec.step // every)
            torch._foreach_copy_(before, live)
            rec.before_params, rec.ratio_live = before, live
            # the ratio of the slices: ||delta slice|| / ||slice||
            rec.before_norms = S.norms(before)
        return out, key

    # A loss spike on a state that a sound step made is the batch's fault: the update that made the
    # state was measured and normal-sized (no update-ratio finding), and the loss of the step that
    # made it was normal (no loss spike there). Then it is skipped, however many come (a stretch of
    # corrupted labels, a bad batch every few steps), instead of escalating to a rollback of healthy
    # weights and an LR cut. The same holds for a non-finite loss or gradient while every weight is
    # finite (padding-only batches whose mean loss is 0/0, a token batch that no NaN input check can
    # see). Bad batches in a row on one state (each skipped: nothing landed between) are capped:
    # past this many, different batches all failing on it say the state is the trouble.
    SAME_STATE_SPIKES = 32
    SAME_STATE_NONFINITE = 8  # a non-finite loss on every batch sooner says the state makes it

    # Steps in a row the inputs must have been equal, to the last bit, for a replay to show
    # full-batch training (a loop may feed each batch a few steps: data echoing)
    FIXED_BATCH_INPUTS = 8
    # Steps full-batch training found by a replay is assumed for where the monitor sees no input
    # tensor (a loop may overfit one batch, then train on its data): after them, a skip or an
    # undo acts again, and finds it again or not.
    FIXED_BATCH_STEPS = 200
    # A change of combine()'s base weights that moves the step's total beyond this factor (either
    # way) against the weights before is a new loss (_loss_reweighted); a ramp's smaller steps are not
    WEIGHTS_JUMP = 1.05
    # Steps whose input sizes make the usual batch (their median) that a step's batch is a share of
    BATCH_SIZES = 64
    # A step whose inputs come in a shape none of the last BATCH_SIZES steps had before it first came,
    # at most this many steps ago, is new data where its loss jumps (_input_shapes_new)
    NEW_SHAPE_STEPS = 8
    # A write through .data smaller than this share of the weights (or than the last update) explains
    # no jump of the loss (_values_written)
    WRITE_SHARE = 0.01
    # A change the loop makes to the weights within this many steps of its last one is its habit
    # (a constraint applied after every step, Lookahead's sync every k), not a change of its training
    LOOP_HABIT = 50

    def _fixed_batch(self, step: int, rec: StepRecord, findings: list[Finding]) -> None:
        """Full-batch training (the loop feeds the same batch every step: edge-of-stability
        studies, catapults, grokking). There a skip replays the same batch on the same state, and
        an undo puts back the state that makes the same update again: a loss spike is the state's,
        not the batch's, and an update judged harmful by the loss it raised is the run's own
        dynamics (an edge-of-stability rise, a slingshot), which such runs come back from by
        themselves (helpers' probes: 8 skips in a row per rise, 16-32 steps lost; a grokking
        transformer's slingshots undone, its LR cut for good, and it never grokked). While it holds
        both are told, not acted on; the ceiling, the non-finite checks and the other detectors act
        as before.

        Found where a skip or an undo put a state back and the step after it measured, on that
        state, the very loss and gradient norm it had before (a gradient norm of zero says
        nothing: a clamped loss repeats its cap without one), and the step's inputs
        (``forensics._fingerprint``) equalled, to the last bit, those of the ``FIXED_BATCH_INPUTS``
        steps before: a batch fed a few steps in a row (data echoing) is no full batch. Equal
        inputs alone are not enough: a loop may feed a constant input (a grid of coordinates, a
        prompt, one-hot rows whose sums never change) while its targets, which the model never
        sees, change every step (a probe: such a loop's bad batch landed). It holds until the
        inputs change; where the monitor sees no input tensor (a model that holds its data), for
        ``FIXED_BATCH_STEPS`` steps (found again, longer)."""
        expected, self._expect_loss = self._expect_loss, None
        fingerprint = rec.internal.get(S.INPUT_FINGERPRINT)
        inputs = isinstance(fingerprint, list) and all(S.finite(v) for v in fingerprint)  # (NaN: none seen)
        if inputs:
            same = fingerprint == self._last_inputs
            self._last_inputs = fingerprint
            self._same_inputs = self._same_inputs + 1 if same else 0
            if not same:
                self._fixed_batch_since = None  # the batch changed: whatever was found is over
        else:
            self._last_inputs, self._same_inputs = None, 0
        seen = self._loss_and_grad(rec)
        replayed = expected is not None and expected[0] == step and seen is not None and seen == expected[1]
        if replayed and (not inputs or self._same_inputs >= self.FIXED_BATCH_INPUTS):
            self._fixed_batch_since = step  # (found again: it holds longer)
        since = self._fixed_batch_since
        if since is not None and not inputs and step - since > self.FIXED_BATCH_STEPS:
            self._fixed_batch_since = since = None  # (a loop may feed one batch for a while, then its data)
        if since is None:
            return
        why = (
            f"the loop feeds the same batch every step (found at step {since}: the loss and gradient norm "
            "measured on a state a skip or an undo put back equalled, to the last bit, those that state had "
            "before" + (", on inputs equal to those of the steps before)" if inputs else ")")
        )
        for f in findings:
            if f.kind == LOSS_SPIKE:
                moot = "a skip would replay it"
            elif f.kind == UPDATE_RATIO_SPIKE and f.data.get("harm") is True:
                moot = "an undo would put back the state that makes it again"
            else:
                continue
            f.told = True
            f.data["fixed_batch"] = since
            f.message += f"; told only: {why}, so {moot}"

    def _expect_replay(self, step: int, rec: StepRecord) -> None:
        """After this step's actions: the loss the next step measures where it runs on a state put
        back with a batch fed again (see ``_fixed_batch``): a skip for a loss spike (this step's
        state and loss), an undo (the undone update's state, and the loss measured on it)."""
        seen = self._loss_and_grad(rec)
        if seen is not None:
            self._recent_losses[step] = seen
        self._recent_losses.pop(step - 4, None)
        for o in rec.outcomes:
            undone = (o.results.get(UNDO) or {}) if UNDO in o.actions else {}
            if undone.get("restored") and "fallback" not in undone:
                before = self._recent_losses.get(int(undone.get("undone_step", -1)))
                self._expect_loss = (step + 1, before) if before is not None else None
                return
        if rec.skip and any(o.finding.kind == LOSS_SPIKE and SKIP_STEP in o.actions for o in rec.outcomes):
            self._expect_loss = (step + 1, seen) if seen is not None else None

    @staticmethod
    def _loss_and_grad(rec: StepRecord) -> tuple[float, float] | None:
        """The step's loss and total gradient norm, where both are finite and the norm is not zero:
        what a replay of the same batch on the same state gives again to the last bit."""
        loss, grad = rec.stats.get(S.LOSS_TOTAL), rec.stats.get(S.GRAD_NORM_TOTAL)
        if loss is None or grad is None or not S.finite(loss) or not S.finite(grad) or grad <= 0:
            return None
        return (float(loss), float(grad))

    def _bad_batches_on_a_sound_state(self, findings: list[Finding]) -> None:
        spikes = [f for f in findings if f.kind == LOSS_SPIKE]
        nonfinite = [f for f in findings if f.kind in (NONFINITE_LOSS, NONFINITE_GRAD) and not f.handled_by_scaler]
        if not spikes and not nonfinite:
            return
        self._same_state_spikes = self._same_state_spikes + 1 if self._no_update_since_spike else 1
        self._no_update_since_spike = True
        if not (self._last_update_sound and self._state_from_normal_loss):
            return
        if any(f.kind == NONFINITE_PARAM for f in findings):
            return  # the weights themselves are broken: not the batch
        cap = self.SAME_STATE_NONFINITE if nonfinite else self.SAME_STATE_SPIKES
        if self._same_state_spikes > cap:
            return
        for f in spikes + nonfinite:
            f.occurrence = 1
            f.data["sound_state"] = {
                "bad_batches_on_this_state": self._same_state_spikes,
                "why": "the update that made this state was measured and normal, from a step whose "
                "loss was normal, and every weight is finite: the batch, not the weights",
            }

    # Steps in a row a group's gradients must be exactly zero (while the others' are not) to be told.
    ZERO_GRADIENT_STEPS = 20

    def _zero_gradient_findings(self, rec: StepRecord) -> list[Finding]:
        """A group whose parameters have gradients, all exactly zero, for ``ZERO_GRADIENT_STEPS``
        steps in a row while the model's total is finite and above zero: told once (no action) until
        its gradients come back. A group with no gradient at all (frozen) is never told."""
        present = rec.grad_groups
        total = rec.stats.get(S.GRAD_NORM_TOTAL)
        training = total is not None and S.finite(total) and total > 0
        out = []
        for gi, g in enumerate(self._group_names):
            if not (training and gi in present and rec.stats.get(S.GRAD_NORM.format(g)) == 0.0):
                self._zero_runs.pop(g, None)
                continue
            run = self._zero_runs[g] = self._zero_runs.get(g, 0) + 1
            if run == self.ZERO_GRADIENT_STEPS:
                amp = " (fp16 gradients underflow without a GradScaler)" if self.scaler is None else ""
                out.append(
                    Finding(
                        ZERO_GRADIENT,
                        f"the gradients of group {g} are exactly zero for {run} steps in a row while the "
                        f"others train: it does not learn{amp}; or its units are dead, or its path to the "
                        "loss is cut",
                        {"group": g, "steps": run, "grad_norm_total": total},
                        where=g,
                    )
                )
        return out

    def _zero_grad_missing_findings(self, rec: StepRecord) -> list[Finding]:
        """This step's gradients were accumulated onto the last step's (``gradreset``): told
        once, no action, and again only after the loop has reset them in between."""
        seen = rec.internal.get(S.GRADS_NOT_RESET, -1.0)
        if seen == 0.0:
            self._told_not_reset = False
        if seen != 1.0 or self._told_not_reset:
            return []
        self._told_not_reset = True
        i = self._grad_reset.index
        name = self._probed_names[i] if 0 <= i < len(self._probed_names) else "(another rank's)"
        return [
            Finding(
                ZERO_GRAD_MISSING,
                f"the gradients of step {rec.step} were added onto those of step {rec.step - 1} (parameter "
                f"{name}): the loop does not call optimizer.zero_grad() (or model.zero_grad()) between "
                "optimizer steps, so every update is the sum of all gradients so far. Call it once per "
                "optimizer step, before the first backward of the step",
                {"parameter": name, "grad_norm_total": rec.stats.get(S.GRAD_NORM_TOTAL)},
                where=name,
            )
        ]

    def _nonfinite_findings(self, rec: StepRecord, grad_index: Sequence[int]) -> list[Finding]:
        v, i = rec.stats, rec.internal
        findings: list[Finding] = []
        loss = v.get(S.LOSS_TOTAL)
        if loss is not None and not S.finite(loss):
            comps = {k[5:]: x for k, x in v.items() if k.startswith("loss/") and k != S.LOSS_TOTAL}
            bad = [c for c, x in comps.items() if not S.finite(x)]
            findings.append(
                Finding(
                    NONFINITE_LOSS,
                    f"loss is {loss}" + (f" (non-finite components: {', '.join(bad)})" if bad else ""),
                    {"loss": loss, "components": comps, "nonfinite_components": bad},
                )
            )
        # Finite loss, overflowing scaled gradients: ordinary dynamic loss scaling.
        by_scaler = rec.scaler_skips and not findings
        if i[S.GRAD_NONFINITE_COUNT] > 0:
            first = int(i[S.GRAD_FIRST_NONFINITE])  # a parameter index, the same on every rank
            name = self._param_names[first] if first >= 0 else "(another rank)"
            n_bad = int(i[S.GRAD_NONFINITE_COUNT])
            data = {
                "param": name,
                "group": self._name_to_group.get(name, "?"),
                "count": n_bad,
                "grad_norm": v[S.GRAD_NORM_TOTAL],
            }
            msg = (
                f"non-finite gradient in {name} (group {data['group']}); {n_bad} parameter(s) with non-finite gradients"
            )
            if by_scaler:
                msg += f"; the GradScaler skips this step and lowers its scale from {v.get(S.AMP_LOSS_SCALE):g}"
            findings.append(Finding(NONFINITE_GRAD, msg, data, where=name, handled_by_scaler=by_scaler))
        elif by_scaler:
            findings.append(
                Finding(
                    NONFINITE_GRAD,
                    "the GradScaler found inf/NaN gradients and skips this step",
                    {},
                    handled_by_scaler=True,
                )
            )
        if i[S.PARAM_NONFINITE_COUNT] > 0:
            first = int(i[S.PARAM_FIRST_NONFINITE])
            name = self._param_names[first] if first >= 0 else "(another rank)"
            group = self._name_to_group.get(name, "?")
            findings.append(
                Finding(
                    NONFINITE_PARAM,
                    f"non-finite parameter {name} (group {group})",
                    {"param": name, "group": group, "count": int(i[S.PARAM_NONFINITE_COUNT])},
                    where=name,
                    # the update that put it there: one made after a rollback is new evidence for
                    # the policy (no cooldown); the step in flight is stopped all the same
                    step=self._last_landed,
                )
            )
        n_inputs = i.get(S.INPUT_NONFINITE, 0.0)
        if n_inputs > 0 and any(f.kind in (NONFINITE_LOSS, NONFINITE_GRAD) for f in findings):
            # The non-finite values came with the data: one bad_batch finding tells the whole story
            # (skip it, however often it comes); the loss and gradient findings are its symptoms.
            symptoms = [f for f in findings if f.kind in (NONFINITE_LOSS, NONFINITE_GRAD)]
            findings = [f for f in findings if f not in symptoms]
            findings.insert(
                0,
                Finding(
                    BAD_BATCH,
                    f"the batch holds {int(n_inputs)} non-finite input value(s): "
                    + "; ".join(f.message for f in symptoms),
                    {"nonfinite_inputs": int(n_inputs), **{f.kind: f.data for f in symptoms}},
                    where=next((f.where for f in symptoms if f.where), ""),
                ),
            )
        tell_ranks(findings, i.get(S.NONFINITE_BY_RANK))  # torch.distributed: where it started
        return findings

    @torch.no_grad()
    def _close(self, aborted: bool) -> None:
        """End the step in flight, whatever path got here: put back what it hid or changed,
        measure the update, and open the next step's record."""
        rec = self._record
        started = time.perf_counter()
        moved: torch.Tensor | None = None  # the update, measured from the undo copy (loopwrites)
        slices: tuple[list[torch.Tensor], torch.Tensor] | None = None  # or on the lean profile's slices
        try:
            ctx = self._ctx
            if ctx is not None and rec.groups_before is not None:
                # What the optimizer's step wrote into its param groups (its own state there, with
                # or without gradients: schedule-free's step count): learned for an undo and a
                # rollback to put back, and put back now where the step was skipped.
                written = written_entries(rec.groups_before, ctx.optimizer)
                ctx.group_step_keys |= written
                if rec.skip and not rec.restore_after:
                    put_entries(ctx.optimizer, rec.groups_before, written)
                rec.groups_before = None
            if ctx is not None and ctx.undo is not None and rec.restore_after:
                # a skip by restoring: the parameters, optimizer state and buffers as captured
                ctx.undo.restore(
                    ctx.undo_params,
                    ctx.optimizer,
                    ctx.undo_buffers,
                    tracked=ctx.tracked_tensors(),
                    group_keys=ctx.group_step_keys,
                )
                rec.restore_after = False
            elif ctx is not None and (held := ctx.buffer_copy()) and held[0].label == rec.step and rec.closure_in_step:
                # the closure's forward ran after this step's copy: the buffers a skip of the next
                # step puts back are the ones this step leaves (BatchNorm statistics)
                if not aborted:
                    held[0].refresh_buffers(held[1])
            rec.put_back(self.optimizer)  # gradients hidden for a skip; the user's LR
            rec.phase = Phase.ABORTED if aborted else Phase.LANDED
            if rec.update_landed:
                self._last_landed = rec.step
                self._no_update_since_spike = False
                self._state_from_normal_loss = not any(f.kind == LOSS_SPIKE for f in rec.findings)
            if rec.scaler_skips and not aborted:
                self._amp_skipped += 1
            if rec.before_params is not None and rec.before_norms is not None:
                if rec.update_landed:
                    # FSDP2: the local shards; a slice of each (stats.update_ratio_fraction): the same slice
                    now = rec.ratio_live or self._layout.detached(self._params)
                    before = rec.before_params
                    if self._ctx is not None and before is getattr(self._ctx.undo, "params", None):
                        upd = update_norms(before, now, self._scratch)  # the undo copy stays intact
                        if rec.ratio_live is None:  # (the whole parameters: a write through .data shows)
                            moved = upd
                        if self._lowp:  # (the whole parameters: the undo copy, not a slice)
                            self._stale_shares(rec, before, now)
                    else:
                        upd = S.update_norms_(rec.before_params, now)  # (the copy now holds the difference)
                        # without the undo copy: what was measured (the lean profile's slices, or
                        # the whole parameters), and its norms as the update left them
                        moved, slices = upd, (list(now), S.norms(now))
                    rec.after.update(self._update_ratios(upd, rec.before_norms))
                else:
                    for g in self._group_names:
                        rec.after[S.UPDATE_RATIO.format(g)] = torch.zeros(())
                    for b in self._block_names:
                        rec.after[S.BLOCK_UPDATE_RATIO.format(b)] = torch.zeros(())
                rec.before_params, rec.ratio_live = None, None
            if ctx is not None and ctx.zero_grads:  # (zero_grad_missing's fix: the loop never resets)
                grads = [p.grad for p in self._params if p.grad is not None]
                if grads:
                    torch._foreach_zero_(grads)
            elif not aborted:  # the gradients as the step leaves them: the next one must reset them
                self._grad_reset.arm(self._probed)
            if rec.stats or rec.internal:  # the pipeline read this step: it goes to the sinks
                self._last = rec
                if not rec.after:
                    self._publish(rec, {})
            # After a non-finite loss the watch samples the next step whatever its stride.
            if not S.finite(rec.stats.get(S.LOSS_TOTAL, 0.0)):
                self._watch.sample_next()
        finally:
            # The step counter counts skipped and aborted steps too.
            self.step = rec.step + 1
            self._steps_closed += 1
            self._record = StepRecord(step=self.step)
            self._watch.reset(self.step)
            self._recorder.clear()
            self._loop_writes.close(self._params, rec.step)  # (what the loop changes from here is its own)
            self._loop_writes.keep_moved(rec.step, moved if not aborted else None, slices)
            self._own_seconds += time.perf_counter() - started

    def _stale_shares(self, rec: StepRecord, before: Sequence[torch.Tensor], now: Sequence[torch.Tensor]) -> None:
        """``update_stale/<group>`` of the groups holding bf16/fp16 parameters and
        ``update_stale/total`` over all of them, read with the update ratios (``stats.stale_shares``)."""
        low = self._lowp
        shares = S.stale_shares(
            [before[i] for i in low],
            [now[i] for i in low],
            [local(g) if (g := self._params[i].grad) is not None else None for i in low],
            [self._param_group[i] for i in low],
            len(self._group_names),
        )
        for gi in sorted({self._param_group[i] for i in low}):
            rec.after[S.UPDATE_STALE.format(self._group_names[gi])] = shares[gi]
        rec.after[S.UPDATE_STALE.format("total")] = shares[-1]

    @_in_its_world
    def _finish_pending(self, final: bool = False) -> None:
        """Read the last step's update ratios now (used by ``stats`` and, ``final``, ``detach``)."""
        last = self._last
        if last is not None and last.after and self._sharded:
            # FSDP2: each rank holds only its shards' part of the update ratios, and only the next
            # step's agreed read completes them (a local read would feed ranks different numbers).
            # Leaving (detach), the step goes to the sinks without them.
            if final:
                self._publish(last, {})
            return
        if last is not None and last.after:
            # Local: one rank may read monitor.stats alone (e.g. to log on rank 0), so no
            # collective here; the update ratios are the same on every rank anyway.
            self._publish(last, S.read_all(last.after, agree=False))

    def _judge_last_update(self, extra: dict[str, float] | None = None) -> None:
        """The last update, judged where no optimizer step comes after it to judge it: at
        ``detach()`` (``extra`` None: without a loss after it, ``S.LAST_UPDATE``: what needs that
        evidence is told), or where the loop skipped a training step itself (``_forward_starts``:
        with the loss that step measured after the update, where it told one, and the LRs of the
        next). A loop whose
        own check rejects every step after a bad update (its cap on the gradient norm, its loss
        scaler halving at each overflow) would make none: the update stayed, unjudged, until
        detach (a probe: a 1e4x LR step, then 349 steps the loop skipped, held-out loss 7e9).
        Its update ratios were just read (``_finish_pending``): the after-update detectors judge it
        now, and what they find is acted on as in any step, so an update larger than the weights is
        undone (one step lost). Not under FSDP2 (each rank holds a part of the ratios: no agreed
        read here)."""
        last = self._last
        if last is None or last.phase is Phase.ABORTED or not last.update_landed or self._sharded:
            return
        if self._ctx is None or not (self._measured(last) or self._measure_from_undo(last)):
            return
        judged = self._judge_update(last, extra if extra is not None else {S.LAST_UPDATE: 1.0})
        self._last = None
        self._last_update_sound = not self._harmful(judged)
        if judged:
            try:
                self._decide_and_act(self.step, judged, None)
            except StopTraining:
                pass  # the run is over already: the stop is in its event (and its checkpoint written)

    # What the step after an update may find that the update made: then an update the update ratio
    # did not measure (stats.update_ratio_every > 1) is measured, from the undo copy, and judged.
    _TROUBLE_AFTER_UPDATE = frozenset(
        {LOSS_SPIKE, LOSS_COMPONENT_SPIKE, NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAM, GRAD_SPIKE}
    )

    @staticmethod
    def _measured(rec: StepRecord) -> bool:
        """Whether ``rec``'s update ratios were measured."""
        return any(k.startswith(S.UPDATE_RATIO.format("")) for k in rec.stats)

    @torch.no_grad()
    def _measure_from_undo(self, rec: StepRecord) -> bool:
        """An update the update ratio did not measure (``stats.update_ratio_every`` > 1), measured
        now from the undo copy, which holds the state from before it until the next capture: its
        ratios join ``rec.stats``, in a host read of their own. Only where the step after it is in
        trouble (a loss or loss component spike, a gradient spike, a non-finite value), and at
        detach for the run's last update: one bad update in ``every`` would otherwise go unjudged,
        its loss spike counted against a state not known sound (skips, then a rollback and an LR
        cut) while the copy that undoes it exactly is in memory. False where it cannot be measured
        (measured already, no update landed, no copy) or is off (``update_ratio_every: 0``)."""
        undo = self._ctx.undo if self._ctx is not None else None
        if undo is None or undo.label != rec.step or not undo.params or not rec.update_landed or self._measured(rec):
            return False
        if not self.config.stats.update_ratio_every:  # (0: the update ratio is off)
            return False
        before = undo.params
        upd = update_norms(before, self._layout.detached(self._params), self._scratch)
        rec.stats.update(S.read_all(self._update_ratios(upd, S.norms(before))))
        return True

    def _update_ratios(self, moved_norms: torch.Tensor, before_norms: torch.Tensor) -> dict[str, Any]:
        """``update_ratio/<group>`` (and ``block_update_ratio/<block>``) from the per-tensor norms
        of an update and of the weights before it: ||delta theta|| / ||theta||, both completed
        across ranks at the read."""
        n = len(self._group_names)
        moved = S.group_norms(moved_norms, self._param_group_t, n)
        held = S.group_norms(before_norms, self._param_group_t, n)
        out: dict[str, Any] = {
            S.UPDATE_RATIO.format(g): S.NormRatio(moved[gi], held[gi]) for gi, g in enumerate(self._group_names)
        }
        if self._block_names:
            nb = len(self._block_names) + 1
            moved_b = S.group_norms(moved_norms, self._param_block_t, nb)
            held_b = S.group_norms(before_norms, self._param_block_t, nb)
            for bi, b in enumerate(self._block_names):
                out[S.BLOCK_UPDATE_RATIO.format(b)] = S.NormRatio(moved_b[bi], held_b[bi])
        return out

    def _judge_update(self, rec: StepRecord, extra: dict[str, float]) -> list[Finding]:
        """The after-update detectors' findings on ``rec``'s update: its statistics (update ratios
        included), the user's LR of each group's update, and ``extra``."""
        seen = {**rec.stats, **{S.UPDATE_LR.format(g): lr for g, lr in rec.group_lr.items()}, **extra}
        seen[S.UPDATE_LR_SCALE] = rec.lr_scale
        if rec.batch_share < 1:
            seen[S.BATCH_SHARE] = rec.batch_share
        return [f for d in self._detectors if d.after_update for f in d.check(rec.step, seen)]

    @staticmethod
    def _harmful(judged: list[Finding]) -> list[Finding]:
        """The findings of ``_judge_update`` that call the update harmful (it is undone): all but a
        large update that did not raise the loss, which is told, and sound."""
        return [f for f in judged if f.kind != LARGE_UPDATE]

    def _batch_share(self, size: float) -> float:
        """The step's batch as a share of the usual one: its input elements over the median of the
        last ``BATCH_SIZES`` steps' (capped at 1; 1 without inputs or history). An epoch's short last
        batch (``drop_last=False``) is noisier by 1 / sqrt(share): the detectors widen by that."""
        usual = statistics.median(self._sizes) if len(self._sizes) >= 3 else None
        if size > 0:
            self._sizes.append(size)
        return min(1.0, size / usual) if usual and size > 0 else 1.0

    def _publish(self, rec: StepRecord, after: dict[str, float]) -> None:
        """The record's statistics are complete (its update ratios added): send them to the sinks."""
        rec.stats.update(after)
        rec.after = {}
        if self._router is not None and rec.step % self.config.log_every == 0:
            self._router.log_metrics(rec.step, dict(rec.stats))

    def _tally(self) -> Tally:
        """The counts of the run's events: those let go of (the list's bound, the sessions before a
        resume) and those in memory (their facts final: an action finishing after its update has)."""
        return self._counted.merged(self.events[self._superseded :])

    def _emit(self, event: Event) -> Event:
        results = (event.data or {}).get("action_results") or {}
        pending = any(isinstance(f, dict) and f.get("measured") == "pending" for f in results.values())
        if not pending and routine_check(event):
            return event  # (a held module's check that found nothing to clip: no event)
        self.events.append(event)
        if len(self.events) > self.config.max_events:  # bounded in memory; the files keep all
            gone = len(self.events) - self.config.max_events
            for e in self.events[self._superseded : gone]:
                self._counted.add(e)
            self._superseded = max(0, self._superseded - gone)
            del self.events[:gone]
        # An action that finishes after the update (qk_clip sizes its clip from the updated
        # weights) is written once it has: the files say what was done, not what was planned.
        # Later events wait behind it, in order, until the next step (or detach) writes them.
        if self._unwritten or pending:
            self._unwritten.append(event)
        elif self._router is not None:
            self._router.log_event(event)
        return event

    def _write_unwritten(self) -> None:
        """Write the events whose actions have finished since (``_emit``). A held module's check
        after the update that clipped nothing is no event: it leaves the list and the files."""
        while self._unwritten:
            event = self._unwritten.pop(0)
            if routine_check(event):
                for i in range(len(self.events) - 1, self._superseded - 1, -1):
                    if self.events[i] is event:
                        del self.events[i]
                        break
                continue
            if self._router is not None:
                self._router.log_event(event)

    # ------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------
    @_in_its_world
    def state_dict(self) -> dict[str, Any]:
        """Plain data: step, loss weights, LR scale, detector windows (by detector name), policy
        streaks and cooldowns, watch streaks, bundles written. Snapshots and hooks are not included."""
        ctx = self._ctx
        return {
            "step": self.step,
            "amp_skipped": self._amp_skipped,
            "should_stop": self.should_stop,
            "new_regime": self._regime_next,  # (announced, not yet applied)
            "base_weights": dict(self._base_weights),
            "weights": dict(self._weights),
            "lr_scale": ctx.lr_scale if ctx else self._pending_ctx.get("lr_scale", 1.0),
            "batches_to_skip": ctx.batches_to_skip if ctx else self._pending_ctx.get("batches_to_skip", 0),
            "reweighted": copy.deepcopy(ctx.reweighted) if ctx else self._pending_ctx.get("reweighted", {}),
            "fp32_modules": list(ctx.fp32_modules) if ctx else self._pending_ctx.get("fp32_modules", []),
            "detectors": {d.name: d.state_dict() for d in self._detectors},
            "policy": self._policy.state_dict(),
            "watch": self._watch.state_dict(),
            "bundles": self._bundles.state_dict(),
            "summary": self._tally().state_dict(),  # (a resume's summary counts the run before it)
            "epoch": ctx.epoch if ctx else self._pending_ctx.get("epoch", 0),
            "lr_recovery": (
                {
                    "dropped_at": ctx.lr_dropped_at,
                    "kind": ctx.lr_drop_kind,
                    "permanent": ctx.lr_permanent,
                    "climb": [list(v) for v in ctx.lr_climb],
                    "climb_best": list(ctx.lr_climb_best) if ctx.lr_climb_best is not None else None,
                    "climb_best_at": ctx.lr_climb_best_at,
                    "climb_first": ctx.lr_climb_first,
                    "halt_watch": list(ctx.lr_halt_watch) if ctx.lr_halt_watch is not None else None,
                    "warmup": ctx.lr_warmup,
                    "proving_until": ctx.lr_proving_until,
                    "losses_seen": list(ctx.losses_seen),
                    "signed": ctx.loss_signed,
                    "ceiling": list(ctx.lr_ceiling) if ctx.lr_ceiling is not None else None,
                    "trial": copy.deepcopy(ctx.lr_trial),
                }
                if ctx
                else self._pending_ctx.get("lr_recovery", {})
            ),
        }

    def _group_lrs(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """The user's LR for each group: the largest LR of the param groups holding its parameters
        (before the monitor's LR drop). The param groups' membership is looked up again only when
        their sizes change (add_param_group)."""
        groups = optimizer.param_groups
        key = tuple(len(pg["params"]) for pg in groups)
        if key != self._group_pgs_key:
            pg_of = {id(p): j for j, pg in enumerate(groups) for p in pg["params"]}
            self._group_pgs = {
                g: sorted({pg_of[id(p)] for _, p in ps if id(p) in pg_of}) for g, ps in self.groups.items()
            }
            self._group_pgs_key = key
        # A group whose param groups hold no LR that sizes their updates (the optimizer sizes its
        # steps itself) has none: the update-ratio test reads its raw ratios.
        return {
            g: max(float(groups[j]["lr"]) for j in js)
            for g, js in self._group_pgs.items()
            if js and all(A.lr_not_a_step_size(optimizer, groups[j]) is None for j in js)
        }

    def _no_inputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's input checks where its forwards saw no input tensor: no non-finite value,
        and no tally (NaN); made once per device (only read), not every step."""
        held = self._no_input_values.get(device)
        if held is None:
            held = self._no_input_values[device] = (
                torch.zeros((), device=device),
                torch.full((2,), math.nan, device=device),
            )
        return held

    def _fresh_buffers(self) -> None:
        """The model's buffers as they are registered now: a forward that assigns a new tensor to a
        buffer (not in place) leaves the held list pointing at the old one, and a skip or an undo
        would put the saved values there. Updated in place (the action context shares the list)."""
        live = [m._buffers.get(n) for m, n in self._buffer_slots]
        if any(a is not b for a, b in zip(live, self._buffers)):
            fresh = [b for b in live if b is not None]
            if len(fresh) == len(live):  # (one set to None: the copy's layout stays as it was)
                self._buffers[:] = fresh

    RESET_STEPS = 20

    def _reset_habit(self) -> float:
        """The gradient resets between forwards a step of this loop makes as a rule: the median
        over the last ``RESET_STEPS`` optimizer steps (0 before any)."""
        return statistics.median(self._reset_counts) if self._reset_counts else 0

    def _forward_starts(self) -> bool:
        """A forward that computes gradients begins (the recorder's hook, before it records it):
        whether the loop threw away what this step's forwards before it made, and so the step's
        record starts over. That is where the loop reset the gradients (``zero_grad()``) since the
        last of them and made no optimizer step, more often than its steps do as a rule (PCGrad
        and MAML reset them between tasks in every step: ``_reset_habit``): a skip of its own (a
        hand-written loss scaler's overflow, a check of the gradients for NaN:
        ``model.zero_grad(); continue``). Their losses and inputs are no part of the step's update:
        a NaN or a spike among them made the next step a bad batch, its healthy update skipped.
        True: the losses recorded are dropped here, the recorder drops the inputs."""
        if not in_backward():  # (not a recomputation inside a backward)
            self._forwards_idle += 1
            if self._forwards_idle == MAX_STEP_BATCHES:
                self._warn_not_stepping()
        rec = self._record
        mark, self._micro_mark = self._micro_mark, (self.step, id(rec), self._grad_reset.mark())
        if mark is None or mark[:2] != (self.step, id(rec)) or rec.phase is not Phase.OPEN:
            return False
        if not self._grad_reset.reset_since(mark[2]):
            return False  # a micro-batch of the step (or one whose backward never came)
        self._resets += 1
        self._attempt_resets += 1
        if self._attempt_resets <= self._reset_habit():
            # The loop takes its gradients apart in every step (PCGrad's per task, MAML's per
            # task: a backward, the gradients kept by hand, zero_grad, the next task): its step.
            # Taken for a skip, a task's loss judged the update by another's (undone), and an
            # undo between two tasks left the first task's gradient of the undone state in it.
            return False
        self._attempt_resets = 0  # (what follows is another try at the step)
        trained = [e for e in rec.losses.entries if e.used]  # (combine()'s, backpropagated)
        rec.losses.entries.clear()
        # A training step the loop skipped: the update before it is judged now, for no optimizer
        # step may come to judge it (a loop whose check rejects every step after a bad update), by
        # what the next step would have judged it by: the loss that step measured after it (one
        # read), or without combine() (no loss told) its update ratios alone. Under
        # torch.distributed by its update ratios alone (the same on every rank; each rank's loss
        # is its own batch's, and the ranks must decide alike).
        extra = {S.NEXT_LR.format(g): lr for g, lr in self._group_lrs(self._live().optimizer).items()}
        if trained and world_size() > 1:
            extra[S.LAST_UPDATE] = 1.0
        elif trained and self._regime_next is None:  # (new_regime(): the loss is of other data)
            extra[S.LOSS_AFTER_UPDATE] = float(sum(e.total for e in trained) / sum(e.calls for e in trained))
        self._finish_pending()
        self._judge_last_update(extra)
        if self._ctx is not None and self._ctx.restored_at == self.step:
            own_write(self._params)  # (put back by the monitor: no change the loop made)
        return True

    def _arm_first_buffers(self) -> None:
        """The copy a skip puts the buffers back from (``ActionContext.buffer_copy``) holds them as
        they were before the step's forward: from the second step on, the capture of the step
        before, and what a forward between the two steps wrote since (``UndoState.mark_forward``,
        at the step's first forward); for the first step of a run, or of a resume, they are copied
        at its first forward that computes gradients: a NaN batch at that step leaves no NaN
        BatchNorm statistics behind either. One forward pre-hook on the model does both."""
        self._disarm_first_buffers()
        ctx = self._ctx
        held = ctx.buffer_copy() if ctx is not None else None
        if held is None or not held[1] or self.model is None:
            return
        self._forward_mark = None
        self._first_buffers = self.model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """A forward of the model before the step's pipeline: is it the step's first? The first
        that computes gradients is taken for it, and a later one in its place when the gradients
        were reset (``zero_grad()``) since: the forward before the reset was one between the
        steps (a GAN's generator loss through the discriminator, whose gradients the reset
        throws away). A forward under ``no_grad`` is never the step's. Then the buffers written
        since the copy (by the forwards between the steps) are copied, and only those."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or self._record.phase is not Phase.OPEN:
            return
        if in_backward():  # a recomputation in the backward (checkpointing)
            return
        mark = self._forward_mark
        if mark is not None and mark[0] == self.step and not self._grad_reset.reset_since(mark[1]):
            return  # a later forward of the step (a micro-batch)
        ctx = self._ctx
        held = ctx.buffer_copy() if ctx is not None else None
        if ctx is None or held is None or not held[1]:
            return
        copy, buffers = held
        if copy.label is None:  # no capture yet: the first step
            copy.start(self.step - 1, buffers)
        elif copy.label != self.step - 1:
            return  # (no copy of the step before: none a skip would put back)
        elif copy is ctx.undo:
            self._fresh_buffers()  # (a buffer replaced by `self.center = ...` since)
            copy.mark_forward(buffers, self._buffer_owners)
        else:
            copy.mark_forward(buffers, self._stats_owners)
        self._forward_mark = (self.step, self._grad_reset.mark())

    def _disarm_first_buffers(self) -> None:
        if self._first_buffers is not None:
            self._first_buffers.remove()
            self._first_buffers = None

    @_in_its_world
    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; works before or after ``attach``. Detector state
        is matched by detector name: state of a detector this monitor does not run is ignored
        with a warning, and a detector without saved state starts fresh."""
        if not isinstance(sd, Mapping):
            raise TypeError(
                f"load_state_dict: expected the mapping Monitor.state_dict() returned, got {type(sd).__name__}"
            )
        if "step" not in sd:
            raise ConfigError(
                f"load_state_dict: expected what Monitor.state_dict() returned (a mapping with 'step', "
                f"'detectors', 'policy', ...), got keys {sorted(map(str, sd))[:8]}: pass the monitor's own "
                f"entry of your checkpoint, not the checkpoint or a model's state"
            )
        step = sd["step"]
        whole = isinstance(step, (numbers.Integral, torch.Tensor)) and not isinstance(step, bool)
        if not whole or int(step) != step or step < 0:
            raise ConfigError(f"load_state_dict: state['step'] must be a whole number, got {step!r}")
        regime = sd.get("new_regime")
        if regime is not None and not isinstance(regime, str):
            raise ConfigError(f"load_state_dict: state['new_regime'] must be a str or None, got {regime!r}")
        counted = Tally()
        try:
            counted.load_state_dict(sd.get("summary") or {})
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"load_state_dict: state['summary'] is not what state_dict() wrote ({e})") from None
        self.step = int(step)
        self._record = StepRecord(step=self.step)
        held = self._ctx.buffer_copy() if self._ctx is not None else None
        if held is not None:
            held[0].clear()  # a copy from another step of another timeline
            self._arm_first_buffers()
        # The run's counts so far are the loaded ones: this session's events before the load
        # belong to the timeline it left.
        self._counted = counted
        self._superseded = len(self.events)
        self._amp_skipped = int(sd.get("amp_skipped", 0))
        self._base_weights.clear()
        self._base_weights.update(sd.get("base_weights", {}))
        self._weights.clear()
        self._weights.update(sd.get("weights", {}))
        self._load_detector_states(sd.get("detectors", {}))
        self._policy.load_state_dict(sd.get("policy", {}))
        self._watch.load_state_dict(sd.get("watch", {}))
        self._bundles.load_state_dict(sd.get("bundles", {}))
        self._pending_ctx = {
            k: sd[k]
            for k in ("lr_scale", "batches_to_skip", "reweighted", "fp32_modules", "epoch", "lr_recovery")
            if k in sd
        }
        self.should_stop = bool(sd.get("should_stop", False))
        self._regime_next = regime
        if self._ctx is not None:
            ctx = self._ctx
            ctx.lr_scale = float(sd.get("lr_scale", 1.0))
            ctx.batches_to_skip = int(sd.get("batches_to_skip", 0))
            ctx.reweighted = copy.deepcopy(dict(sd.get("reweighted", {})))
            ctx.epoch = int(sd.get("epoch", 0))
            recovery = dict(sd.get("lr_recovery") or {})
            dropped = recovery.get("dropped_at")
            ctx.lr_dropped_at = int(dropped) if dropped is not None else None
            ctx.lr_drop_kind = str(recovery.get("kind", ""))
            ctx.lr_permanent = bool(recovery.get("permanent", False))
            ctx.lr_climb = [(float(x), float(scale)) for x, scale in recovery.get("climb", [])]
            best = recovery.get("climb_best")
            ctx.lr_climb_best = (float(best[0]), float(best[1])) if best is not None else None
            best_at = recovery.get("climb_best_at")
            ctx.lr_climb_best_at = int(best_at) if best_at is not None else None
            first = recovery.get("climb_first")
            ctx.lr_climb_first = float(first) if first is not None else None
            watch = recovery.get("halt_watch")
            ctx.lr_halt_watch = (int(watch[0]), float(watch[1])) if watch is not None else None
            warmup = recovery.get("warmup")
            ctx.lr_warmup = float(warmup) if warmup is not None else None
            proving = recovery.get("proving_until")
            ctx.lr_proving_until = int(proving) if proving is not None else None
            ctx.losses_seen = [float(x) for x in recovery.get("losses_seen", [])]
            ctx.loss_signed = bool(recovery.get("signed", False))
            ceiling = recovery.get("ceiling")
            ctx.lr_ceiling = None if ceiling is None else [None if c is None else float(c) for c in ceiling]
            trial = recovery.get("trial")
            ctx.lr_trial = copy.deepcopy(dict(trial)) if trial is not None else None
            for name in sd.get("fp32_modules", []):
                if name not in ctx.fp32_modules:
                    A.precision_fallback(
                        ctx, Decision(PRECISION_FALLBACK, Finding(ACTIVATION_OVERFLOW, "restored"), {"module": name})
                    )
            self._pending_ctx = {}

    def _load_detector_states(self, states: Any) -> None:
        if isinstance(states, (list, tuple)):
            if states:
                warnings.warn(
                    "sfmonitor: the detector state was saved by an older sfmonitor, as a "
                    "list without detector names; it is ignored and detector windows start "
                    "empty",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        if not isinstance(states, Mapping):
            raise ConfigError(
                f"state_dict['detectors']: expected a mapping of detector name -> state, got {type(states).__name__}"
            )
        mine = {d.name: d for d in self._detectors}
        gone = sorted(set(states) - set(mine))
        if gone:
            warnings.warn(
                f"sfmonitor: state of detector(s) {', '.join(gone)} ignored: this monitor does "
                f"not run them (running: {', '.join(mine) or 'none'})",
                RuntimeWarning,
                stacklevel=3,
            )
        for name, state in states.items():
            if name in mine:
                mine[name].load_state_dict(state)


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any = None,
    groups: Mapping[str, Any] | None = None,
    **monitor_kwargs: Any,
) -> Monitor:
    """Shortcut: ``Monitor(**monitor_kwargs).attach(model, optimizer, scaler=scaler, groups=groups)``."""
    return Monitor(**monitor_kwargs).attach(model, optimizer, scaler=scaler, groups=groups)
