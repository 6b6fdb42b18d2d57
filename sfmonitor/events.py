"""The records that flow through the pipeline: findings, decisions, events, errors.

stats -> detectors produce ``Finding`` -> policy turns findings into ``Decision`` ->
actions carry decisions out -> every finding that led somewhere (or that is worth telling)
becomes an ``Event`` that sinks write.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, NonFiniteError, SFMonitorError, StopTraining  # noqa: F401 - re-exported
from .registry import action_names, event_kinds, register_kind

# Event kinds. Each is registered (registry.KINDS) by the component that reports it, with its
# default ladder; the names are here so that any module can refer to them without importing that
# component.
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
NONFINITE_PARAM = "nonfinite_param"
GRAD_SPIKE = "grad_spike"
LOSS_SPIKE = "loss_spike"
LOSS_COMPONENT_SPIKE = "loss_component_spike"
LOSS_LEVEL_SHIFT = "loss_level_shift"
LOSS_LEVEL_RETURN = "loss_level_return"
LOSS_DIVERGENCE = "loss_divergence"
UPDATE_RATIO_SPIKE = "update_ratio_spike"
LARGE_UPDATE = "large_update"
GRAD_RATIO_IMBALANCE = "grad_ratio_imbalance"
LOSS_RATIO_IMBALANCE = "loss_ratio_imbalance"
ACTIVATION_OVERFLOW = "activation_overflow"
LOSS_SCALE_FLOOR = "loss_scale_floor"
ACCURACY_COLLAPSE = "accuracy_collapse"
ACCURACY_DROP = "accuracy_drop"
PLATEAU = "plateau"
BAD_BATCH = "bad_batch"
VANISHING_GRADIENT = "vanishing_gradient"
STALE_UPDATE = "stale_update"
DEAD_UNITS = "dead_units"
ADAM_EPS = "adam_eps"
BN_VAR_SPIKE = "bn_var_spike"
BN_VAR_SHIFT = "bn_var_shift"

# Action names; each is registered (registry.ACTIONS) in actions.py with its function.
SKIP_STEP = "skip_step"
CLIP = "clip"
REWEIGHT = "reweight"
LR_DROP = "lr_drop"
CHECKPOINT = "checkpoint"
ROLLBACK = "rollback"
PRECISION_FALLBACK = "precision_fallback"
GRAD_NOISE = "grad_noise"
STOP = "stop"
UNDO = "undo"
ZERO_GRAD = "zero_grad"

# The core's own kinds: the monitor checks every step for non-finite values itself (no detector
# to switch off). A non-finite loss or gradient is skipped; three in a row also go back to the
# last snapshot and drop the LR. A non-finite parameter means the update already landed: only
# going back helps.
_NONFINITE_RUNGS = [(1, [SKIP_STEP]), (3, [SKIP_STEP, ROLLBACK, LR_DROP])]
register_kind(NONFINITE_LOSS, _NONFINITE_RUNGS, window=1, doc="the step's loss is NaN or inf")
register_kind(NONFINITE_GRAD, _NONFINITE_RUNGS, window=1, doc="a gradient holds NaN or inf")
# A non-finite weight: the last update put it there. Undo that update (exact, one step lost); again
# within 50 steps: the trouble builds up, go back to the newest snapshot and lower the LR.
register_kind(NONFINITE_PARAM, [(1, [UNDO]), (2, [ROLLBACK, LR_DROP])], window=50, doc="a parameter holds NaN or inf")
# Non-finite values that arrive with the inputs: the batch is bad, not the model or its state.
# Skipping it is the whole answer, however often it comes (no escalation: window 0, one rung).
register_kind(BAD_BATCH, [(1, [SKIP_STEP])], doc="the step's inputs hold NaN or inf")
# The loop said the data changes from this step (monitor.new_regime(): a new task, a curriculum
# stage, a DQN's hard target sync): the detectors learn what is usual afresh. Told, no action.
NEW_REGIME = "new_regime"
register_kind(NEW_REGIME, [(1, [])], doc="the loop announced a change of data (monitor.new_regime())")
# A group whose gradients exist but are exactly zero step after step while the others train: fp16
# gradients that underflow without a GradScaler, dead units, a path cut off from the loss. Told,
# no action: nothing the monitor changes would bring them back.
ZERO_GRADIENT = "zero_gradient"
register_kind(ZERO_GRADIENT, [(1, [])], doc="a group's gradients are exactly zero step after step")
# Gradients added onto the last step's: the loop does not call zero_grad() between optimizer steps
# (sfmonitor/gradreset.py). The cause is certain and so is the cure: skip this step (its gradients
# hold the last step's too) and reset the gradients as every later step closes.
ZERO_GRAD_MISSING = "zero_grad_missing"
register_kind(
    ZERO_GRAD_MISSING,
    [(1, [SKIP_STEP, ZERO_GRAD])],
    doc="the gradients were accumulated onto the last step's: zero_grad() was not called",
)


def __getattr__(name: str) -> Any:
    """EVENT_KINDS and ACTION_NAMES, derived from the registry at the time they are asked for."""
    if name == "EVENT_KINDS":
        return event_kinds()
    if name == "ACTION_NAMES":
        return action_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Finding:
    """What a detector saw. Detectors return these and never touch the model.

    kind: a registered event kind. message: one human sentence with the numbers.
    data: the numbers that crossed the threshold, for people (JSON-serialisable); nothing in the
    monitor or the policy decides on it. The fields below are what decisions are made on.
    where: the group, module or parameter the finding is about ("" when global).
    before_update: True when the finding is about the step being taken (its update can still be
    stopped); False when the update already landed (e.g. an update-ratio spike seen afterwards).
    step: the optimizer step of the landed update the finding is about (None: the step being
    taken). An after-update finding's event carries it; a non-finite weight names the update that
    put it there, so that the policy sees one made after its last rollback as new evidence.
    occurrence: the finding's place on its kind's ladder, set by detectors whose findings are
    validations apart (plateau); None: the policy counts the streak itself.
    handled_by_scaler: the GradScaler skips this step itself (finite loss, overflowing scaled
    gradients: ordinary dynamic loss scaling); recorded, never acted on.
    urgent: the trouble is already here (e.g. a module produced inf): the finding enters its
    ladder at the first rung that acts, whatever the streak.
    told: recorded, never acted on: what its ladder would do is known to change nothing (a skip
    that would replay the same batch on the same state).
    enforced: actions taken for it whatever its ladder says, and it does not enter its ladder (a
    trial the loss did not bear out puts back what the trial changed: rollback, lr_drop).
    """

    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    before_update: bool = True
    step: int | None = None
    occurrence: int | None = None
    handled_by_scaler: bool = False
    urgent: bool = False
    told: bool = False
    enforced: tuple[str, ...] = ()


@dataclass
class Decision:
    """What the policy asks an action to do, and why."""

    action: str
    cause: Finding
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class Event:
    """One line of the run's story: a finding with the actions it triggered.

    step is 0-based: the value ``monitor.step`` had when the optimizer step began.
    """

    step: int
    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "message": self.message,
            "data": jsonable(self.data),
            "actions": list(self.actions),
        }

    def changed(self) -> list[str]:
        """The actions that changed training (their facts do not say ``applied: false``, nor that
        they failed): ``actions`` holds every action decided, also a clip the optimizer took in its
        stride or an LR drop on an optimizer without an LR."""
        results = self.data.get("action_results") or {}
        return [a for a in self.actions if changed_something(results.get(a) or {})]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(
            step=int(d["step"]),
            kind=str(d["kind"]),
            message=str(d.get("message", "")),
            data=dict(d.get("data") or {}),
            actions=list(d.get("actions") or []),
        )


def jsonable(value: Any) -> Any:
    """A JSON-safe copy: non-finite floats become strings ("nan", "inf", "-inf")."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy / torch scalars and small arrays
        return jsonable(value.tolist())
    return str(value)


def changed_something(facts: Mapping[str, Any]) -> bool:
    """Whether an action's facts say it changed training (the budget and the run's summary count
    only those): not when it failed, or reports ``applied``/``restored``/``saved`` as False."""
    if "failed" in facts:
        return False
    return all(facts.get(key, True) is not False for key in ("applied", "restored", "saved"))
