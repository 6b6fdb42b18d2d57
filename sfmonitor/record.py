"""One optimizer step, one record: everything the monitor knows and changed about the step in flight.

A ``StepRecord`` goes through these phases (docs/design.md has the picture):

    OPEN      created when the previous step closed; ``combine()`` adds loss components to it
    DECIDED   the pipeline ran (stats read, findings, decisions, actions): the update may land
    LANDED    the optimizer ran, or was skipped on purpose (``skip``); nothing is left to put back
    ABORTED   an exception ended the step (strict mode, StopTraining, a failing detector...):
              the update never landed, and everything the monitor changed was put back

What the monitor hides or changes for one step lives here and nowhere else: the gradients hidden
to skip the update, the user's LRs while an ``lr_drop`` scale applies, the parameter copy that
measures the update ratio. ``put_back`` restores the first two and is safe to call twice, so
closing a record -- by whatever path -- always leaves the optimizer as the user left it.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import stats as S
from .actions import restore_lr
from .events import Finding
from .forensics import MAX_STEP_BATCHES

__all__ = ["LossAccumulator", "Outcome", "Phase", "StepRecord"]


class Phase(enum.Enum):
    OPEN = "open"
    DECIDED = "decided"
    LANDED = "landed"
    ABORTED = "aborted"


@dataclass(eq=False)
class Outcome:
    """One finding of the step and what came of it: the actions it caused and what each did."""

    finding: Finding
    actions: list[str] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


class _Entry:
    """One ``combine()`` call (or several folded into one): detached copies of its components and
    total, and whether a backward has reached its loss (``used``)."""

    __slots__ = ("calls", "components", "total", "used")

    def __init__(self, components: dict[str, torch.Tensor], total: torch.Tensor, calls: int = 1) -> None:
        self.components, self.total, self.calls, self.used = components, total, calls, False

    def mark(self, grad: torch.Tensor) -> None:  # a tensor hook: a backward reached this loss
        self.used = True


class LossAccumulator:
    """Loss components recorded by ``combine()`` over the micro-batches of one optimizer step.

    A loss counts towards the step when a backward reached it (a hook on the tensors ``combine()``
    returns and was given): a loss computed with gradients on and never backpropagated (a
    validation loss logged without ``torch.no_grad()``) is no micro-batch of the step. When no
    backward reached any of them (a loop that backpropagates its own sum of the components it
    logged elsewhere), every call counts."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.weights: dict[str, float | torch.Tensor] = {}
        # The loop changed combine()'s base weights in this step: (base before, the weights in use
        # before, base now). The total at the weights in use before rides in the step's read.
        self.changed: tuple[dict[str, float], dict[str, float], dict[str, float]] | None = None

    @property
    def count(self) -> int:
        """``combine()`` calls recorded in this step."""
        return sum(e.calls for e in self.entries)

    def add(
        self,
        components: Mapping[str, torch.Tensor],
        total: torch.Tensor,
        weights: Mapping[str, float | torch.Tensor],
        scale: float = 1.0,
    ) -> None:
        """Record one call; ``scale`` multiplies what is recorded (not the tensors given)."""
        entry = _Entry(
            {k: v.detach().float() * scale if scale != 1.0 else v.detach().float() for k, v in components.items()},
            total.detach().float() * scale if scale != 1.0 else total.detach().float(),
        )
        for t in (total, *components.values()):
            if t.requires_grad:
                t.register_hook(entry.mark)
        if len(self.entries) >= MAX_STEP_BATCHES:  # (older calls folded into one that counts)
            folded = _sum_entries(self.entries)
            folded.used = True
            self.entries = [folded]
        self.entries.append(entry)
        self.weights = dict(weights)

    def tensors(self, pairs: list[list[str]]) -> dict[str, torch.Tensor | float]:
        """``loss/*``, ``loss_weight/*`` and ``loss_ratio/*`` as 0-d tensors (nothing is read)."""
        if not self.entries:
            return {}
        used = [e for e in self.entries if e.used] or self.entries
        step = used[0] if len(used) == 1 else _sum_entries(used)
        n = step.calls
        means = {k: v if n == 1 else v / n for k, v in step.components.items()}  # one micro-batch: no division
        out: dict[str, torch.Tensor | float] = {S.LOSS_TOTAL: step.total if n == 1 else step.total / n}
        for k, v in means.items():
            if k != "total":
                out[S.LOSS.format(k)] = v
        if len(means) > 1:
            for k, w in self.weights.items():
                out[S.LOSS_WEIGHT.format(k)] = w if isinstance(w, torch.Tensor) else float(w)
            # (every step with components, so that the read's layout is the same on every step and rank)
            out[S.LOSS_AT_OLD_WEIGHTS] = (
                out[S.LOSS_TOTAL]
                if self.changed is None
                else functools.reduce(operator.add, [self.changed[1].get(k, 0.0) * v for k, v in means.items()])
            )
            for a, b in S.pair_keys(means, pairs):
                out[S.LOSS_RATIO.format(a, b)] = S.ratio(means[a], means[b])
        return out


def _sum_entries(entries: list[_Entry]) -> _Entry:
    components: dict[str, torch.Tensor] = {}
    for e in entries:
        for k, v in e.components.items():
            components[k] = v if k not in components else components[k] + v
    total = functools.reduce(operator.add, [e.total for e in entries])
    return _Entry(components, total, sum(e.calls for e in entries))


@dataclass(eq=False)
class StepRecord:
    """The step in flight (see the module docstring). ``step`` is 0-based."""

    step: int
    phase: Phase = Phase.OPEN
    losses: LossAccumulator = field(default_factory=LossAccumulator)
    grad_ratio: dict[str, torch.Tensor] = field(default_factory=dict)  # from combine(), per step
    grad_groups: frozenset[int] = frozenset()  # the groups (indices) with a gradient this step
    stats: dict[str, float] = field(default_factory=dict)  # the values read (public)
    internal: dict[str, Any] = field(default_factory=dict)  # the values read (stats.INTERNAL)
    # per parameter, written through .data since the last update (loopwrites): at a sampled step
    values_written: torch.Tensor | None = None
    outcomes: list[Outcome] = field(default_factory=list)  # one per finding, in order
    stepped: bool = False  # the optimizer's step ran (its pre-hook fired)
    skip: bool = False  # a decision keeps this step's update from landing
    scaler_skips: bool = False  # the GradScaler found inf/NaN and skips the step itself
    hidden_grads: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    restore_after: bool = False  # a skip by putting this step's exact copy back after the step ran
    closure_in_step: bool = False  # the optimizer calls the closure inside its step (SAM): a forward after the copy
    saved_lr: list[Any] = field(default_factory=list)  # the user's LRs during an lr_drop
    # the param groups' entries as the optimizer's step found them (undo.group_entries): what a
    # skip puts back of those its step wrote (schedule-free's step count, with no gradient)
    groups_before: list[tuple[tuple[Any, ...], tuple[Any, ...]]] | None = None
    group_lr: dict[str, float] = field(default_factory=dict)  # the user's LR of each group's update
    lr_scale: float = 1.0  # the monitor's LR drop the update was made under (1: none)
    batch_share: float = 1.0  # the step's batch over the usual one (Monitor._batch_share)
    before_params: list[torch.Tensor] | None = None  # parameters before the update
    ratio_live: list[torch.Tensor] | None = None  # views of the parameters the update ratio measures (slices)
    before_norms: torch.Tensor | None = None  # their norms per tensor
    after: dict[str, torch.Tensor | S.NormRatio] = field(default_factory=dict)  # update ratios, read next step

    @property
    def findings(self) -> list[Finding]:
        return [o.finding for o in self.outcomes]

    @property
    def closed(self) -> bool:
        return self.phase in (Phase.LANDED, Phase.ABORTED)

    @property
    def update_landed(self) -> bool:
        """The optimizer's update reached the parameters."""
        return self.phase is Phase.LANDED and self.stepped and not self.skip and not self.scaler_skips

    def hide_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """Make this step's update a no-op: torch.optim optimizers leave parameters without a
        gradient untouched (no state update, no step counter), so parameters and optimizer state
        stay bit-identical. ``put_back`` restores the gradients."""
        self.skip = True
        if self.hidden_grads:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.hidden_grads.append((p, p.grad))
                p.grad = None

    def put_back(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Restore what the monitor hid or changed for this step (gradients, the user's LRs).
        Safe to call twice."""
        for p, g in self.hidden_grads:
            p.grad = g
        self.hidden_grads = []
        if optimizer is not None and self.saved_lr:
            restore_lr(optimizer, self.saved_lr)
        self.saved_lr = []
