"""PyTorch Lightning integration: ``SFMonitorCallback``.

    from sfmonitor.integrations.lightning import SFMonitorCallback

    cb = SFMonitorCallback(run_dir="runs/a", eval_metrics={"val_loss": "loss", "val_acc": "accuracy"})
    trainer = lightning.Trainer(callbacks=[cb])
    trainer.fit(module, datamodule)
    cb.monitor.events

Where the monitor runs. Lightning calls ``optimizer.step(closure)``: the optimizer's step pre-hook
fires *before* the closure has run ``training_step`` and ``backward``, so the monitor cannot look at
gradients there. It is driven externally instead (``Monitor.drive_externally``):

    on_fit_start              attach to (pl_module, trainer.optimizers[0], the precision plugin's
                              GradScaler if any); drive externally
    on_before_optimizer_step  gradients are complete and unscaled (Lightning unscales before this
                              hook and clips after it): ``monitor.before_update()`` runs the
                              pipeline; a skip hides the gradients, so the update that follows
                              leaves parameters and optimizer state untouched. With a GradScaler
                              the monitor's ``scaler.step`` wrapper runs it instead, where it also
                              sees the scaler's own skips.
    on_train_batch_end        ``monitor.after_update()`` (a no-op when the optimizer post-hook
                              already finished the step); ``trainer.should_stop`` if the monitor
                              says so
    on_validation_epoch_end   the mapped ``trainer.callback_metrics`` go to ``monitor.observe_eval``
    on_fit_end / on_exception detach: no hook is left on the model or the optimizer

Resuming. The monitor's state (``Monitor.state_dict()``: its step, LR scale, rescue budget,
detector windows, policy streaks) travels in Lightning's checkpoints, under
``checkpoint["callbacks"]["SFMonitorCallback"]["monitor"]`` (the callback's ``state_dict``), and
``Trainer.fit(ckpt_path=...)`` puts it back (``load_state_dict``): a resumed run goes on as the run
left uninterrupted would, its steps numbered on from the checkpoint's. A checkpoint saved without
the callback holds no monitor state: the monitor then starts afresh, numbering its steps from the
checkpoint's ``global_step``, and a warning says so.

Loss statistics (``loss/*``, ``nonfinite_loss``, the loss-spike detector) need the losses: keep a
reference to the callback and return ``cb.monitor.combine({...}, weights=...)`` (or
``cb.monitor.combine(loss)``) from ``training_step``. Without it the gradient, parameter and update
statistics are still recorded, and a non-finite loss still shows as ``nonfinite_grad``.

The monitor's ``stop`` action (a spent rescue budget) raises ``StopTraining`` inside the pipeline;
the callback turns it into a graceful stop: the step in flight does not land (its gradients are
dropped), ``trainer.should_stop`` is set and ``stop_reason`` holds the message.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:  # pragma: no cover - exercised only without lightning installed
    raise ImportError(
        "sfmonitor.integrations.lightning needs PyTorch Lightning: pip install 'sfmonitor[lightning]'"
    ) from e

from ..events import StopTraining
from ..monitor import Monitor
from ._common import check_eval_metrics, drop_gradients, start_afresh_at, to_float

# Validation metric names Lightning users commonly log -> the names the evaluation detectors read
# (detectors.accuracy_collapse.metric = "accuracy", detectors.plateau.metric = "loss").
DEFAULT_EVAL_METRICS: dict[str, str] = {"val_loss": "loss", "val_acc": "accuracy", "val_accuracy": "accuracy"}


class SFMonitorCallback(Callback):
    """Watch a Lightning run with a ``sfmonitor.Monitor`` (``.monitor``).

    Args:
        eval_metrics: ``{callback_metrics key: monitor metric name}`` given to ``observe_eval`` after
            each validation epoch; keys missing from ``trainer.callback_metrics`` are left out.
            Default: ``DEFAULT_EVAL_METRICS`` (val_loss -> loss, val_acc / val_accuracy -> accuracy).
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
        super().__init__()
        self.eval_metrics = check_eval_metrics(eval_metrics, DEFAULT_EVAL_METRICS)
        self.chance = chance
        self.groups = groups
        self.monitor = Monitor(**monitor_kwargs)  # cheap: sinks open on attach
        self.stop_reason: str | None = None

    # -- attach / detach -----------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.optimizers:
            raise RuntimeError(
                "SFMonitorCallback: the trainer has no optimizer to watch (configure_optimizers returned none)"
            )
        if len(trainer.optimizers) > 1:
            warnings.warn(
                f"SFMonitorCallback watches the first of {len(trainer.optimizers)} optimizers only", stacklevel=2
            )
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # MixedPrecision("16-mixed")
        self.monitor.attach(pl_module, trainer.optimizers[0], scaler=scaler, groups=self.groups)
        self.monitor.drive_externally()
        self.stop_reason = None

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, saved in Lightning's checkpoint (plain data: ``torch.load`` with
        ``weights_only=True`` reads it)."""
        return {"monitor": self.monitor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put back what ``state_dict`` saved (Lightning calls it on ``fit(ckpt_path=...)``, before
        or after ``on_fit_start`` depending on the strategy; the monitor takes it either way)."""
        if "monitor" in state_dict:
            self.monitor.load_state_dict(state_dict["monitor"])

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls this before load_state_dict, whether or not the checkpoint holds this
        # callback's state. Without it (a checkpoint saved without the callback), resuming a fit
        # starts the monitor afresh: say so, and number its steps as the trainer does.
        if trainer.state.fn != TrainerFn.FITTING or self.state_key in checkpoint.get("callbacks", {}):
            return
        step = int(checkpoint.get("global_step", 0))
        if step and self.monitor.step != step:
            start_afresh_at(self.monitor, step, "SFMonitorCallback", "")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.monitor.detach()

    # -- the step ------------------------------------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        mon = self.monitor
        if optimizer is not mon.optimizer or mon.scaler is not None:
            # Another optimizer; or a GradScaler, whose step the monitor wraps: the pipeline runs
            # there, on these same unscaled gradients, and also sees the scaler's own skips.
            return
        try:
            mon.before_update()
        except StopTraining as e:
            self._stop(trainer, optimizer, e)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.monitor.after_update()
        if self.monitor.should_stop:
            trainer.should_stop = True

    def _stop(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, err: StopTraining) -> None:
        drop_gradients(optimizer)  # the step in flight must not land
        self.stop_reason = str(err)
        trainer.should_stop = True
        warnings.warn(self.stop_reason, stacklevel=2)

    # -- evaluation ----------------------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor.model is None:
            return
        metrics = {}
        for key, name in self.eval_metrics.items():
            value = to_float(trainer.callback_metrics.get(key))
            if value is not None:
                metrics[name] = value
        if not metrics:
            return
        try:
            self.monitor.observe_eval(metrics, chance=self.chance)
        except StopTraining as e:
            self.stop_reason = str(e)
            warnings.warn(self.stop_reason, stacklevel=2)
        if self.monitor.should_stop:
            trainer.should_stop = True
