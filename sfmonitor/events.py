"""The records that flow through the pipeline: findings, decisions, events, errors.

stats -> detectors produce ``Finding`` -> policy turns findings into ``Decision`` ->
actions carry decisions out -> every finding that led somewhere (or that is worth telling)
becomes an ``Event`` that sinks write.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, NonFiniteError, SFMonitorError, StopTraining  # noqa: F401 - re-exported

# Event kinds (DESIGN.md). Detectors name their findings with these constants.
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRAD = "nonfinite_grad"
NONFINITE_PARAM = "nonfinite_param"
GRAD_SPIKE = "grad_spike"
LOSS_SPIKE = "loss_spike"
UPDATE_RATIO_SPIKE = "update_ratio_spike"
GRAD_RATIO_IMBALANCE = "grad_ratio_imbalance"
LOSS_RATIO_IMBALANCE = "loss_ratio_imbalance"
ACTIVATION_OVERFLOW = "activation_overflow"
LOSS_SCALE_FLOOR = "loss_scale_floor"
ACCURACY_COLLAPSE = "accuracy_collapse"
PLATEAU = "plateau"

EVENT_KINDS = (
    NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAM, GRAD_SPIKE, LOSS_SPIKE, UPDATE_RATIO_SPIKE,
    GRAD_RATIO_IMBALANCE, LOSS_RATIO_IMBALANCE, ACTIVATION_OVERFLOW, LOSS_SCALE_FLOOR,
    ACCURACY_COLLAPSE, PLATEAU,
)

# Action names (DESIGN.md).
SKIP_STEP = "skip_step"
CLIP = "clip"
REWEIGHT = "reweight"
LR_DROP = "lr_drop"
CHECKPOINT = "checkpoint"
ROLLBACK = "rollback"
PRECISION_FALLBACK = "precision_fallback"
GRAD_NOISE = "grad_noise"
STOP = "stop"

ACTION_NAMES = (SKIP_STEP, CLIP, REWEIGHT, LR_DROP, CHECKPOINT, ROLLBACK, PRECISION_FALLBACK,
                GRAD_NOISE, STOP)


@dataclass
class Finding:
    """What a detector saw. Detectors return these and never touch the model.

    kind: an event kind above. message: one human sentence with the numbers.
    data: the numbers that crossed the threshold (JSON-serialisable).
    where: the group, module or parameter the finding is about ("" when global).
    before_update: True when the finding is about the step being taken (its update can still be
    stopped); False when the update already landed (e.g. an update-ratio spike seen afterwards).
    """

    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    before_update: bool = True


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
        return {"step": self.step, "kind": self.kind, "message": self.message,
                "data": jsonable(self.data), "actions": list(self.actions)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Event":
        return cls(step=int(d["step"]), kind=str(d["kind"]), message=str(d.get("message", "")),
                   data=dict(d.get("data") or {}), actions=list(d.get("actions") or []))


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
