"""What the Lightning and transformers callbacks share: metric mapping, value reading, and
dropping a step's gradients when the monitor stops the run mid-step."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..events import ConfigError


def check_eval_metrics(eval_metrics: Mapping[str, str] | None, default: Mapping[str, str]) -> dict[str, str]:
    """``{framework metric name: monitor metric name}``, validated; ``default`` when None."""
    if eval_metrics is None:
        return dict(default)
    if not isinstance(eval_metrics, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in eval_metrics.items()
    ):
        raise ConfigError(
            "eval_metrics: expected a dict {framework metric name: monitor metric name}, "
            f"e.g. {dict(default)}; got {eval_metrics!r}"
        )
    return dict(eval_metrics)


def to_float(v: Any) -> float | None:
    """A logged metric (tensor or number) as a float; None for anything else."""
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean()) if v.numel() else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Set every gradient the optimizer holds to None: its next step leaves parameters and state
    untouched. Used when the monitor stops the run mid-step (``StopTraining``)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def start_afresh_at(monitor: Any, step: int, who: str, where: str, stacklevel: int = 3) -> None:
    """A resume from a checkpoint that holds no monitor state (saved without the callback): say so,
    and let the fresh monitor number its steps from the trainer's ``step``."""
    warnings.warn(
        f"{who}: the checkpoint resumed at step {step}{where} holds no sfmonitor state (saved without "
        "this callback?): the monitor starts afresh (full rescue budget, LR scale 1, empty detector "
        f"windows), numbering its steps from {step}",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
    state = monitor.state_dict()
    state["step"] = step
    monitor.load_state_dict(state)
