"""Hugging Face transformers integration: ``SFMonitorTrainerCallback``.

    from sfmonitor.integrations.transformers import SFMonitorTrainerCallback

    cb = SFMonitorTrainerCallback(run_dir="runs/a")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    cb.monitor.events

Where the monitor runs (``Monitor.drive_externally``):

    on_train_begin         attach to (model, the torch optimizer inside accelerate's
                           AcceleratedOptimizer, its GradScaler if any); drive externally
    on_pre_optimizer_step  gradients are complete and unscaled (the Trainer unscales and clips
                           before this hook): ``monitor.before_update()`` runs the pipeline; a skip
                           hides the gradients, so ``optimizer.step()`` leaves parameters and
                           optimizer state untouched. With a GradScaler (fp16) the monitor's
                           ``scaler.step`` wrapper runs it instead, where it also sees the scaler's
                           own skips.
    on_optimizer_step      ``monitor.after_update()`` (a no-op when the optimizer post-hook
                           already finished the step); ``control.should_training_stop`` if the
                           monitor says so (also checked in ``on_step_end``)
    on_evaluate            the mapped metrics go to ``monitor.observe_eval``
    on_train_end           detach: no hook is left on the model or the optimizer

The Trainer has no exception hook: if ``trainer.train()`` raises, the monitor stays attached
until you call ``cb.monitor.detach()`` (safe to call twice), e.g. in a ``finally:``.

The Trainer clips gradients (``max_grad_norm``, default 1.0) *before* ``on_pre_optimizer_step``:
a NaN in one gradient makes the clip coefficient NaN and so every gradient NaN. The step is
skipped all the same; the event then names the first parameter of the model rather than the one
the NaN came from (set ``max_grad_norm=0`` to keep the raw gradients).

Loss statistics (``loss/*``, ``nonfinite_loss``, the loss-spike detector) need the losses: override
``Trainer.compute_loss`` and pass the loss through ``cb.monitor.combine(loss)`` (or a dict of
components). Without it the gradient, parameter and update statistics are still recorded.

The monitor's ``stop`` action (a spent rescue budget) raises ``StopTraining`` inside the pipeline;
the callback turns it into a graceful stop: the step in flight does not land (its gradients are
dropped), ``control.should_training_stop`` is set and ``stop_reason`` holds the message.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only without transformers installed
    raise ImportError(
        "sfmonitor.integrations.transformers needs Hugging Face transformers: pip install 'sfmonitor[transformers]'"
    ) from e

from ..events import StopTraining
from ..monitor import Monitor
from ._common import check_eval_metrics, drop_gradients, to_float

# The hook that runs after backward, unscaling and clipping and before the update.
PRE_STEP_HOOK = "on_pre_optimizer_step"
# Trainer metric names (``metric_key_prefix="eval"``) -> the names the evaluation detectors read
# (detectors.accuracy_collapse.metric = "accuracy", detectors.plateau.metric = "loss").
DEFAULT_EVAL_METRICS: dict[str, str] = {"eval_loss": "loss", "eval_accuracy": "accuracy"}


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and any such wrapper):
    hooks go on the optimizer whose ``step`` really updates the parameters."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"SFMonitorTrainerCallback: expected a torch optimizer, got {type(optimizer).__name__}")
    return optimizer


class SFMonitorTrainerCallback(TrainerCallback):
    """Watch a transformers ``Trainer`` run with a ``sfmonitor.Monitor`` (``.monitor``).

    Args:
        eval_metrics: ``{Trainer metric name: monitor metric name}`` given to ``observe_eval`` after
            each evaluation; names missing from the metrics are left out. Default:
            ``DEFAULT_EVAL_METRICS`` (eval_loss -> loss, eval_accuracy -> accuracy).
        chance: chance-level accuracy for the accuracy-collapse detector (None: its config's).
        groups: parameter groups, as in ``Monitor.attach`` (None: one per top-level child module).
        **monitor_kwargs: ``Monitor(config=..., run_dir=..., sinks=...)``.
    """

    def __init__(
        self,
        *,
        eval_metrics: Mapping[str, str] | None = None,
        chance: float | None = None,
        groups: Mapping[str, Any] | None = None,
        **monitor_kwargs: Any,
    ):
        if not hasattr(TrainerCallback, PRE_STEP_HOOK):
            import transformers

            raise ImportError(
                f"SFMonitorTrainerCallback needs TrainerCallback.{PRE_STEP_HOOK} "
                f"(transformers >= 4.42); installed: {transformers.__version__}. "
                "pip install 'sfmonitor[transformers]'"
            )
        self.eval_metrics = check_eval_metrics(eval_metrics, DEFAULT_EVAL_METRICS)
        self.chance = chance
        self.groups = groups
        self.monitor = Monitor(**monitor_kwargs)  # cheap: sinks open on attach
        self.stop_reason: str | None = None

    # -- attach / detach -----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None or optimizer is None:
            raise RuntimeError("SFMonitorTrainerCallback: the Trainer passed no model or optimizer to on_train_begin")
        scaler = getattr(optimizer, "scaler", None)  # accelerate's GradScaler (fp16)
        self.monitor.attach(model, inner_optimizer(optimizer), scaler=scaler, groups=self.groups)
        self.monitor.drive_externally()
        self.stop_reason = None

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.detach()

    # -- the step ------------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        mon = self.monitor
        if mon.model is None or mon.scaler is not None:
            # With a GradScaler the monitor's scaler.step wrapper runs the pipeline on these same
            # unscaled gradients, and also sees the scaler's own skips.
            return
        try:
            mon.before_update()
        except StopTraining as e:
            drop_gradients(mon.optimizer)  # the step in flight must not land
            self._stop(control, e)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.monitor.after_update()
        if self.monitor.should_stop:
            control.should_training_stop = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor.should_stop:
            control.should_training_stop = True

    def _stop(self, control, err: StopTraining) -> None:
        self.stop_reason = str(err)
        control.should_training_stop = True
        warnings.warn(self.stop_reason, stacklevel=2)

    # -- evaluation ----------------------------------------------------------------------------
    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.monitor.model is None or not metrics:
            return
        values = {}
        for key, name in self.eval_metrics.items():
            value = to_float(metrics.get(key))
            if value is not None:
                values[name] = value
        if not values:
            return
        try:
            self.monitor.observe_eval(values, chance=self.chance)
        except StopTraining as e:
            self._stop(control, e)
        if self.monitor.should_stop:
            control.should_training_stop = True
