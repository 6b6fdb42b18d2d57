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
    on_save                the monitor's state (``Monitor.state_dict()``) is written into the
                           checkpoint folder the Trainer just saved: ``checkpoint-N/sfmonitor_state.pt``
    on_train_end           detach: no hook is left on the model or the optimizer

Resuming. ``trainer.train(resume_from_checkpoint=...)`` restores the Trainer's state before
``on_train_begin``; there the callback reads ``sfmonitor_state.pt`` from the checkpoint folder the
Trainer resumes from (``torch.load(weights_only=True)``) and gives it to the monitor before
attaching it: step, LR scale, rescue budget, detector windows and policy streaks go on as in the run
left uninterrupted, and the steps are numbered on from the checkpoint's. The TrainerCallback API does
not pass that folder to callbacks: the callback takes the ``resume_from_checkpoint`` the running
``Trainer.train()`` call resolved (from its stack frame), else ``args.resume_from_checkpoint``,
else ``<output_dir>/checkpoint-<global_step>``. A checkpoint without the file (saved without the
callback) starts the monitor afresh, numbering its steps from the checkpoint's ``global_step``, with
a warning.

The Trainer has no exception hook: if ``trainer.train()`` raises, the monitor stays attached
until you call ``cb.monitor.detach()`` (safe to call twice), e.g. in a ``finally:``.

The Trainer clips gradients (``max_grad_norm``, default 1.0) *before* ``on_pre_optimizer_step``:
a NaN in one gradient makes the clip coefficient NaN and so every gradient NaN. The step is
skipped all the same; the event then names the first parameter of the model rather than the one
the NaN came from (set ``max_grad_norm=0`` to keep the raw gradients).

Loss statistics (``loss/*``, ``nonfinite_loss``, the loss-spike detector) need the losses: override
``Trainer.compute_loss`` and pass the loss through ``cb.combine(loss, trainer=self,
num_items_in_batch=num_items_in_batch)`` (or a dict of components). Without it the gradient,
parameter and update statistics are still recorded. ``cb.combine`` is ``monitor.combine`` at the
scale of the loss the Trainer reports: under gradient accumulation a model that takes
``num_items_in_batch`` normalises each micro-batch's loss to the whole accumulated batch (the
micro-batch losses add up to the step's loss), whereas the monitor averages the micro-batches; so
it records each such loss times the number of micro-batches, leaving what is backpropagated as it is.

The monitor's ``stop`` action (a spent rescue budget) raises ``StopTraining`` inside the pipeline;
the callback turns it into a graceful stop: the step in flight does not land (its gradients are
dropped), ``control.should_training_stop`` is set and ``stop_reason`` holds the message.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - exercised only without transformers installed
    raise ImportError(
        "sfmonitor.integrations.transformers needs Hugging Face transformers: pip install 'sfmonitor[transformers]'"
    ) from e

from ..events import StopTraining
from ..monitor import Monitor
from ._common import check_eval_metrics, drop_gradients, start_afresh_at, to_float

# The hook that runs after backward, unscaling and clipping and before the update.
PRE_STEP_HOOK = "on_pre_optimizer_step"
# Trainer metric names (``metric_key_prefix="eval"``) -> the names the evaluation detectors read
# (detectors.accuracy_collapse.metric = "accuracy", detectors.plateau.metric = "loss").
DEFAULT_EVAL_METRICS: dict[str, str] = {"eval_loss": "loss", "eval_accuracy": "accuracy"}
# The monitor's state, in each checkpoint folder the Trainer saves (torch.save of plain data).
STATE_FILE = "sfmonitor_state.pt"


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (and any such wrapper):
    hooks go on the optimizer whose ``step`` really updates the parameters."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"SFMonitorTrainerCallback: expected a torch optimizer, got {type(optimizer).__name__}")
    return optimizer


def micro_batches_in_loss(trainer: Any, num_items_in_batch: Any = None) -> int:
    """How many of ``trainer.compute_loss``'s losses add up to the loss of the optimizer step: the
    step's micro-batches when the Trainer takes each loss as normalised to the whole accumulated
    batch (a model that takes ``num_items_in_batch``, a ``compute_loss_func``, or
    ``trainer.loss_is_scaled_for_ga``), else 1 (each loss is its micro-batch's mean, and the
    Trainer divides it by the accumulation steps itself). The Trainer's own test, mirrored."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and num_items_in_batch is not None) or (
            getattr(trainer, "compute_loss_func", None) is not None
        )
    if not scaled:
        return 1
    n = getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps
    return max(int(n), 1)


def resumed_from(args: Any, state: Any) -> str:
    """The checkpoint folder the running ``Trainer.train()`` resumes from. Callbacks are not told:
    the ``resume_from_checkpoint`` of the Trainer frame that called this hook (``train()`` resolves
    ``True`` to the last checkpoint), else ``args.resume_from_checkpoint``, else
    ``<output_dir>/checkpoint-<global_step>``."""
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(32):
            if f is None:
                break
            names = f.f_locals
            path = names.get("resume_from_checkpoint")
            if isinstance(names.get("self"), Trainer) and isinstance(path, (str, os.PathLike)):
                return os.fspath(path)
            f = f.f_back
    finally:
        del frame
    path = getattr(args, "resume_from_checkpoint", None)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        return os.fspath(path)
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


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
        if state.global_step > 0:  # resume_from_checkpoint: the Trainer's state is the checkpoint's
            self._resume(resumed_from(args, state), state.global_step)
        scaler = getattr(optimizer, "scaler", None)  # accelerate's GradScaler (fp16)
        self.monitor.attach(model, inner_optimizer(optimizer), scaler=scaler, groups=self.groups)
        self.monitor.drive_externally()
        self.stop_reason = None

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.detach()

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:  # the process that writes checkpoints (the monitor agrees on every rank)
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        try:
            torch.save(self.monitor.state_dict(), os.path.join(folder, STATE_FILE))
        except (OSError, RuntimeError) as e:
            warnings.warn(
                f"SFMonitorTrainerCallback: the monitor's state could not be saved into {folder} "
                f"({type(e).__name__}: {e}); resuming from that checkpoint will start the monitor afresh",
                RuntimeWarning,
                stacklevel=2,
            )

    def _resume(self, folder: str, step: int) -> None:
        path = os.path.join(folder, STATE_FILE)
        if os.path.isfile(path):
            self.monitor.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return
        if self.monitor.step == step:  # already put back by hand (monitor.load_state_dict)
            return
        start_afresh_at(self.monitor, step, "SFMonitorTrainerCallback", f" ({folder}: no {STATE_FILE})", stacklevel=4)

    # -- losses --------------------------------------------------------------------------------
    def combine(
        self,
        losses: Mapping[str, torch.Tensor] | torch.Tensor,
        weights: Mapping[str, float | torch.Tensor] | None = None,
        *,
        trainer: Any,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """``monitor.combine`` inside ``trainer.compute_loss``: ``loss/*`` at the scale of the loss
        the Trainer reports. When each micro-batch loss is normalised to the whole accumulated batch
        (``micro_batches_in_loss``: n > 1), the monitor records it times n (it averages the n
        micro-batches: their mean is then the step's loss); the returned loss, which the Trainer
        backpropagates and reports, is the one it would get without the monitor, with the same
        gradients."""
        n = micro_batches_in_loss(trainer, num_items_in_batch)
        # Recorded x n, returned as computed: the Trainer backpropagates and reports the loss it
        # would get without the monitor, to the last bit, with the same gradients.
        return self.monitor._combine(losses, weights, record_scale=float(n))

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
