"""Actions: the only code that changes training. One function per action name; ``apply(ctx,
decision)`` dispatches and returns the JSON-able facts of what was done (for the event).

| action | effect |
|---|---|
| skip_step | ``ctx.skip = True``; the monitor makes the step a bit-identical no-op |
| clip | clips this step's (unscaled) gradients: ``zclip`` (default), ``global``, ``per_modality``, ``agc`` |
| reweight | the report's rule on ``ctx.loss_weights`` (read by ``combine()``); ``relax_weights`` drifts back |
| lr_drop | ``ctx.lr_scale *= factor`` (floored); the monitor applies it around every optimizer step |
| checkpoint | emergency checkpoint of the last good state, atomic, loadable with ``weights_only=True`` |
| rollback | restores the newest in-memory snapshot before the trouble, skips this step and K batches |
| precision_fallback | runs the named module in fp32 from now on (autocast off, inputs cast to fp32) |
| grad_noise | adds N(0, std^2) to every gradient, std = eta / (1 + epoch)^0.55 (the report) |
| stop | saves a checkpoint, sets ``ctx.should_stop``, raises ``StopTraining`` (not for plateau) |

LR and user schedulers. ``lr_drop`` never writes ``param_group["lr"]`` permanently. The monitor
calls ``saved = apply_lr_scale(optimizer, ctx.lr_scale)`` in the optimizer-step pre-hook, after the
actions, and ``restore_lr(optimizer, saved)`` in the post-hook. The user's scheduler keeps reading
and writing its own values, so any schedule (warm-up, cosine, OneCycle, ReduceLROnPlateau) keeps
working and the drop multiplies whatever it sets. With ``lr_scale == 1`` nothing is touched.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import sharding
from . import stats as S
from .checkpoint import (
    DEFAULT_SNAPSHOT_EVERY,
    DEFAULT_SNAPSHOT_KEEP,
    EXTRA,
    INNER,
    MODEL,
    OPTIMIZER,
    TRACKED,
    SnapshotRing,
    capture_state,
    inner_optimizers,
    params_of,
    restore_state,
    save_checkpoint,
    state_dict_needs_every_rank,
    tree_nbytes,
)
from .events import (
    ACCURACY_COLLAPSE,
    CHECKPOINT,
    CLIP,
    GRAD_NOISE,
    GRAD_SPIKE,
    LOSS_LEVEL_RETURN,
    LOSS_SPIKE,
    LR_DROP,
    NONFINITE_PARAM,
    PLATEAU,
    PRECISION_FALLBACK,
    REWEIGHT,
    ROLLBACK,
    SKIP_STEP,
    STOP,
    UNDO,
    ZERO_GRAD,
    ConfigError,
    Decision,
    Finding,
    StopTraining,
)
from .integrations.distributed import rank, world_size
from .registry import ACTIONS, register_action
from .schema import Section, SectionTable, option
from .undo import UndoState
from .userclip import USER_CLIPPED

__all__ = [
    "ActionContext",
    "ActionsConfig",
    "CheckpointConfig",
    "ClipConfig",
    "GradNoiseConfig",
    "LRDropConfig",
    "LossScaleConfig",
    "ReweightConfig",
    "RollbackConfig",
    "StopConfig",
    "apply",
    "apply_lr_scale",
    "checkpoint",
    "clip",
    "clip_gradients",
    "grad_noise",
    "grad_noise_std",
    "keep_loss_scale_floor",
    "lr_drop",
    "parse_clip_rule",
    "precision_fallback",
    "relax_weights",
    "remove_precision_fallback",
    "restore_lr",
    "reweight",
    "rollback",
    "skip_step",
    "stop",
]

CLIP_MODES = ("zclip", "global", "per_modality", "agc")
_RULE = re.compile(r"^(sqrt|norm):([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")
ANY_GROUP = "*"
EMERGENCY_PREFIX = "emergency-step"
OUTSIDE_PARAMS = "outside_params"  # key in a state's extra: parameters held by the optimizer only
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def parse_clip_rule(rule: str, key: str = "rule") -> tuple[str, float]:
    """'sqrt:C' -> scale min(1, C / sqrt(|g|)); 'norm:C' -> scale min(1, C / |g|)."""
    m = _RULE.match(rule.strip()) if isinstance(rule, str) else None
    if not m or float(m.group(2)) <= 0:
        raise ConfigError(
            f"{key}: {rule!r} is not a clip rule; expected 'sqrt:C' (scale min(1, C/sqrt(|g|))) "
            f"or 'norm:C' (scale min(1, C/|g|)) with C > 0"
        )
    return m.group(1), float(m.group(2))


@dataclass
class ClipConfig(Section):
    """Gradient clipping taken as an action (a grad_spike answer). Acts on unscaled gradients."""

    mode: str = option(
        "zclip",
        "zclip: clip the total norm to the detector's EMA mean + zclip_z sigma; "
        "global: to max_grad_norm; per_modality: the report's per-group rules; "
        "agc: unit-wise adaptive clipping",
        choices=CLIP_MODES,
    )
    max_grad_norm: float = option(
        1.0, "global mode, and zclip without detector statistics (the report: max_grad_norm 1.0)", lo=0, lo_open=True
    )
    zclip_z: float = option(2.5, "zclip threshold in EMA sigmas (ZClip: z = 2.5)", lo=0, lo_open=True)
    per_modality: dict[str, str] = option(
        {"text": "sqrt:10", "vision": "norm:5", ANY_GROUP: "norm:7"},
        "group -> rule; '*' covers every other group (the report: "
        "text min(1,10/sqrt|g|), vision min(1,5/|g|), other min(1,7/|g|))",
    )
    spare_adaptive: bool = option(
        True,
        "with an Adam-family optimizer (param groups with betas), clip a finite grad spike only when "
        "it would at least double the second-moment estimate, (1 - beta2) * r^2 > 1 with r = norm / "
        "the detector's EMA mean (beta2 0.999: r > 31.6); a smaller spike moves each weight at most "
        "~(1 - beta1) / sqrt(1 - beta2) x lr and fades, so the clip would change a healthy run for "
        "little (the update-ratio check after the step still undoes a bad update). RMSprop's alpha "
        "counts as beta2. False: ZClip, every spike clipped",
    )
    spare_factor: float = option(
        10.0,
        "with an optimizer without a second moment (SGD, with or without momentum, and the rest), clip "
        "a finite grad spike only when it is at least this many times the detector's EMA mean: a "
        "gradient r x its usual size makes an update at most r x the usual (momentum spreads it over "
        "later steps), and the update-ratio test calls an update a spike from 10x (its factor). A "
        "healthy SGD LSTM had natural 1.7x and 4.7x spikes clipped off its course. 0: every spike clipped",
        lo=0,
    )
    agc_lambda: float = option(0.01, "AGC clipping factor (Brock et al. 2021, NFNets: 0.01)", lo=0, lo_open=True)
    agc_eps: float = option(1e-3, "AGC floor on unit parameter norms (Brock et al. 2021: 1e-3)", lo=0, lo_open=True)

    def validate(self) -> None:
        for group, rule in self.per_modality.items():
            parse_clip_rule(rule, f"{self._prefix}per_modality.{group}")


@dataclass
class ReweightConfig(Section):
    """The report's dynamic loss reweighting, generalised to any pair a/b and threshold t:
    w_a = base_a * t / r, w_b = base_b * r / t (t = 2: w_v = 0.4 * 2/r, w_f = 0.3 * r/2)."""

    threshold: float = option(2.0, "t, used when the finding carries none (the report: 2)", lo=1, lo_open=True)
    relax_rate: float = option(
        0.05,
        "per step, once a/b <= t again, the weights move this fraction of "
        "the way back to their base (0.05: ~60 steps to 95%, slow enough not to undo a reweight the ratio still needs)",
        lo=0,
        hi=1,
        lo_open=True,
    )
    min_weight: float = option(1e-3, "no weight goes below this, so no loss component is switched off entirely", lo=0)


@dataclass
class LRDropConfig(Section):
    """Learning-rate drop as a persistent multiplier of every param group's LR."""

    factor: float = option(
        0.2,
        "multiply the LR scale by this (the report: LR to 1/5 on a plateau; the proving ground's rescue: LR x 0.2)",
        lo=0,
        hi=1,
        lo_open=True,
    )
    min_scale: float = option(
        1e-3,
        "the LR scale never goes below this (1e-3: below three orders of magnitude a run no longer learns)",
        lo=0,
        hi=1,
        lo_open=True,
    )
    min_lr: float = option(0.0, "a dropped LR never goes below this (nor above the user's own LR)", lo=0)
    recover_after: int = option(
        100,
        "optimizer steps after a drop before the LR starts back towards the user's schedule (0: a drop "
        "is permanent); a second drop before it is back makes the cut permanent",
        lo=0,
    )
    recover_steps: int = option(200, "optimizer steps the LR scale takes to climb back to 1 (geometrically)", lo=1)
    warmup_scale: float = option(
        0.05,
        "a drop for an update larger than its weights at a group's first update starts the LR again from "
        "this scale and climbs back from the next step over warmup_steps, a warm-up (0: the ordinary drop, a "
        "fifth held recover_after steps). Where the LR is too high only for the initial weights (no warm-up: "
        "a GPT at 20x closes 66% of the gap to its default LR, the ordinary drop 39%) it treats the cause; "
        "where it is too high for the problem the climb's halt (halt_rise, halt_stall) stops it where the "
        "loss was lowest. A drop while it climbs is a warm-up again, from a factor lower, not a cut for good: "
        "the LR it climbs through was never seen healthy, nor was it back (weights from std 1e-3 under SGD with "
        "momentum, the warm-up's second update 1.18x the weights: cut for good, held-out 1.6 against bare 0.014; "
        "warmed up again, 0.0033). The LR it gives back is watched warmup_steps more by that halt, and a drop "
        "in that time is permanent; so is the LR a halt leaves, lowered by factor again where the loss rises "
        "halt_rise x over its median at the halt",
        lo=0,
        hi=1,
    )
    warmup_steps: int = option(100, "optimizer steps the warm-up of warmup_scale takes back to 1 (geometrically)", lo=1)
    halt_rise: float = option(
        1.5,
        "while the LR climbs back (and for warmup_steps after a warm-up's climb), a median loss of the last "
        "halt_window steps this many times its lowest "
        "since the climb began (the last halt_window steps before it included) halts the climb: the LR "
        "goes back to the scale of that lowest median and the cut is permanent (the trouble came back "
        "with the LR; a loss seen below zero: a rise of halt_rise - 1 times the progress made from its "
        "start); 0: never halted",
        lo=0,
    )
    halt_window: int = option(20, "steps whose median loss the climb's halt compares", lo=2)
    halt_stall: int = option(
        20,
        "a warm-up's climb (warmup_scale) and its watch also halt where the loss stalls: no median lower "
        "than the lowest for this many steps while the LR rose to 2x the scale of that lowest, and the "
        "median now halt_stall_rise x its own this many steps before. The LR it climbs to was never seen "
        "healthy; where it is too high for the problem, not only for the initial weights, the loss stops "
        "falling and turns up short of halt_rise (BatchNorm CNNs at LRs too high for them fell back towards "
        "chance, creeping past 1.1x their lowest median over 21-128 steps). 0: off",
        lo=0,
    )
    halt_stall_rise: float = option(
        1.03,
        "the rise a stall (halt_stall) needs, of the median over its own halt_stall steps before: a "
        "trend, not a plateau's swing (read over the lowest median, one of a plateau's dips, an LSTM "
        "language model under SGD at 20, its median flat at 3.09-3.10 for 80 steps, was halted at 1.031x)",
        lo=1,
        lo_open=True,
    )
    halt_stall_progress: float = option(
        0.1,
        "a stall (halt_stall) needs a climb that brought the loss down first: its lowest median at least this "
        "fraction under the climb's first (a loss with no ratio, seen below zero: this fraction of the "
        "progress made from its start). A loss on a plateau from the warm-up's start swings over its medians "
        "by chance, and the climbing LR is what gets it off (a small-init MLP under SGD at 0.2, its median "
        "5% over its own 20 steps before on the plateau, was halted for good at 0.05x: held-out 0.48 against "
        "bare 0.09). 0: any climb",
        lo=0,
        hi=0.9,
    )

    def validate(self) -> None:
        if 0 < self.halt_rise <= 1:
            raise ConfigError(
                f"{self._prefix}halt_rise: {self.halt_rise:g} must be above 1 (a rise), or 0 to never halt the climb"
            )


@dataclass
class UndoConfig(Section):
    """Exact one-step undo (sfmonitor/undo.py)."""

    enabled: bool = option(
        True,
        "hold one copy of the parameters and the optimizer state from before each update (AdamW: "
        "3x the parameter bytes), so a bad update that landed is undone exactly; false (the lean "
        "profile): undo falls back to the newest snapshot",
    )


@dataclass
class RollbackConfig(Section):
    """In-memory snapshots and rollback."""

    snapshot_every: int = option(
        DEFAULT_SNAPSHOT_EVERY, "optimizer steps between CPU snapshots (50: a rollback loses at most 50 steps)", lo=1
    )
    keep: int = option(DEFAULT_SNAPSHOT_KEEP, "snapshots kept in memory", lo=1)
    max_host_mb: float = option(
        2048.0,
        "host memory (MiB) all snapshots together may hold (model, optimizer state, scaler); the oldest "
        "go first, and a snapshot larger than this is not taken (rollback then has none). Reported at attach",
        lo=0,
    )
    skip_batches: int = option(
        4,
        "batches monitor.batches() drops after a rollback (PaLM skipped "
        "200-500 batches on a 540B run; ours is scaled to short runs); none after vanishing_gradient's restart "
        "from the run's start, whose trouble was the LR, not the data",
        lo=0,
    )
    restore_rng: bool = option(True, "also restore the RNG states of the snapshot")


@dataclass
class CheckpointConfig(Section):
    """Emergency checkpoints under <run_dir>/checkpoints/."""

    subdir: str = option("checkpoints", "folder under run_dir")
    keep: int = option(3, "emergency checkpoints kept (older ones are deleted)", lo=1)

    def validate(self) -> None:
        parts = self.subdir.replace("\\", "/").split("/")
        if not self.subdir or os.path.isabs(self.subdir) or self.subdir[0] in "/\\" or ".." in parts:
            raise ConfigError(
                f"{self._prefix}subdir: expected a relative folder inside run_dir "
                f"(no absolute path, no '..'), got {self.subdir!r}"
            )


@dataclass
class GradNoiseConfig(Section):
    """Gaussian gradient noise (the report's trick; Neelakantan et al. 2015)."""

    eta: float = option(0.3, "eta in std = eta / (1 + epoch)^gamma (the report: 0.3)", lo=0, lo_open=True)
    gamma: float = option(0.55, "decay exponent (the report and Neelakantan et al.: 0.55)", lo=0)
    seed: int = option(0, "seed of the noise generator (kept apart from the training RNG)", lo=0)


@dataclass
class LossScaleConfig(Section):
    """A GradScaler floor, a standing setting (no event) when enforced."""

    enforce_floor: bool = option(False, "keep the GradScaler scale >= min_loss_scale every step")
    min_loss_scale: float = option(512.0, "the floor (the report: min_loss_scale 512)", lo=0, lo_open=True)


@dataclass
class StopConfig(Section):
    """The stop action."""

    save_checkpoint: bool = option(True, "save a checkpoint before stopping (unless one was saved this step)")
    graceful_kinds: list[str] = option(
        [PLATEAU], "causes that only set monitor.should_stop instead of raising StopTraining (early stopping)"
    )

    def validate(self) -> None:
        from . import events  # EVENT_KINDS: the kinds registered now (a user's own kinds included)

        known = tuple(events.EVENT_KINDS)
        for i, kind in enumerate(self.graceful_kinds):
            if kind not in known:
                raise ConfigError(
                    f"{self._prefix}graceful_kinds[{i}]: {kind!r} is not an event kind; "
                    f"known kinds: {', '.join(sorted(known))}"
                )


class ActionsConfig(SectionTable):
    """Every registered action's settings (``actions.<name>``), plus the GradScaler floor
    (``actions.loss_scale``, a standing setting rather than an action)."""

    @classmethod
    def table(cls) -> dict[str, type[Section]]:
        out = {name: spec.config for name, spec in ACTIONS.items() if spec.config is not None}
        out["loss_scale"] = LossScaleConfig
        return out


# --------------------------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ActionContext:
    """Everything an action may read or change. The monitor owns one and updates ``step``,
    ``epoch`` and ``stats`` before each round of actions, and reads ``skip``, ``lr_scale``,
    ``loss_weights``, ``batches_to_skip`` and ``should_stop`` afterwards."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any = None
    groups: dict[str, list[tuple[str, nn.Parameter]]] = field(default_factory=dict)
    loss_weights: dict[str, float] = field(default_factory=dict)  # current weights, read by combine()
    base_weights: dict[str, float] = field(default_factory=dict)  # the user's weights
    lr_scale: float = 1.0
    snapshots: SnapshotRing | None = None
    run_dir: str | os.PathLike | None = None
    step: int = 0
    epoch: int = 0
    stats: Mapping[str, float] = field(default_factory=dict)
    skip: bool = False  # set by skip_step / rollback: this step's update must not land
    batches_to_skip: int = 0  # set by rollback; consumed by monitor.batches()
    repeat_batch: bool = False  # set by undo: monitor.batches() yields this step's batch again
    # set by undo: the GradScaler's scale and growth tracker from before the undone update, put
    # back after this step's scaler.update() (which would count the undone update's overflow)
    scaler_restore: list[torch.Tensor] | None = None
    undo: UndoState | None = None  # the state before the last update (the monitor keeps it current)
    # the param-group keys the optimizer's step writes (its own counters in its groups:
    # undo.written_entries), learned step by step: an undo and a rollback put them back too
    group_step_keys: set[tuple[int, str]] = field(default_factory=set)  # (position, key)
    undo_params: list[nn.Parameter] = field(default_factory=list)  # the parameters it holds, in order
    undo_buffers: list[torch.Tensor] = field(default_factory=list)  # the model's buffers it holds
    # Without the undo copy (the lean profile): a copy of the normalisation layers' running
    # statistics alone, kept as the undo copy keeps the buffers, so that a skip still puts back what
    # the skipped batch wrote into them (a NaN batch: NaN running means, every evaluation NaN)
    stats_copy: UndoState | None = None
    stats_buffers: list[torch.Tensor] = field(default_factory=list)  # the running statistics it holds
    lr_dropped_at: int | None = None  # step of the last lr_drop (recovery counts from it)
    # A warm-up (lr_drop.warmup_scale): the climb's rate per step, from the step after the drop,
    # in place of recover_after and the factor's climb (None: an ordinary drop)
    lr_warmup: float | None = None
    # After a warm-up's climb reaches 1: the last step at which the full LR, never seen healthy
    # before, is still watched by the climb's halt (None: nothing watched)
    lr_proving_until: int | None = None
    restored_at: int | None = None  # step in which an undo or a rollback put the state back
    # A change of regime an action made (a restart from the run's start, and its put-back): the
    # monitor announces it for the next step (Monitor.new_regime), so the detectors learn afresh.
    announce: str | None = None
    lr_drop_kind: str = ""  # the kind that caused it
    lr_permanent: bool = False  # the trouble came back while the LR was still lowered
    # The losses (logs; the values themselves once the loss was seen below zero) and LR scales of
    # the last halt_window steps, from halt_window steps before the LR starts to climb back; and
    # the lowest median of those losses so far with the lowest scale of its window: what the climb
    # is judged against (relax_lr). The run's first losses (the largest is its start) and whether
    # one was below zero: a signed loss's rise is measured against the progress made from there.
    lr_climb: list[tuple[float, float]] = field(default_factory=list)
    lr_climb_best: tuple[float, float] | None = None
    lr_climb_best_at: int | None = None  # the step that median was reached (a warm-up's stall)
    lr_climb_first: float | None = None  # the climb's first median (a stall needs progress from it)
    # After a warm-up's climb halted: the last step at which the LR it left is still watched, and
    # the median (log) loss at the halt, which a rise of halt_rise x lowers the LR from again
    lr_halt_watch: tuple[int, float] | None = None
    # A trial drop (a finding whose cause the loss alone cannot tell: loss_divergence's, data
    # "trial"): the step it was taken, the median (log) loss of the window before it and the bar
    # the trial's median must come back under (judge_trial), the log losses since, whether the cut
    # stands for good once borne out, and the drop's fields as they were before it (put back on a
    # refutation). Kept after a refutation ("refuted") until the median of the last halt_window
    # losses is under the one before the trial: a growing loss is told only until then. None: no
    # trial.
    lr_trial: dict[str, Any] | None = None
    # The live state a trial's rollback left (CPU copies, as a snapshot), with the snapshots that
    # rollback took out of the ring: put back on a refutation (never saved: a run resumed
    # mid-trial gives back the LR alone). None: nothing held.
    lr_trial_held: dict[str, Any] | None = None
    # The state a level shift of the loss started from (loss_level_shift, hold_before_shift: CPU
    # copies, as a snapshot), put back should the shift end soon (loss_level_return: the steps since
    # were a stretch of bad batches). Never saved. None: nothing held.
    shift_held: dict[str, Any] | None = None
    losses_seen: list[float] = field(default_factory=list)
    loss_signed: bool = False
    # The LR per param group that the drop (or a halt of the climb) set, the level it holds the LR
    # at or below (None: no such level; an entry None: a group without a step-size LR)
    lr_ceiling: list[float | None] | None = None
    should_stop: bool = False
    zero_grads: bool = False  # set by zero_grad: the monitor zeroes the gradients as each step closes
    stopped: bool = False  # set by stop (not early stopping): every later step is skipped
    graceful_stop: bool = False  # set by the monitor: a loop draws from batches(), so stop ends it
    scaler_skips: bool = False  # set by the monitor: the GradScaler found inf/NaN and skips this step
    config: ActionsConfig = field(default_factory=ActionsConfig)
    monitor_state: Callable[[], dict[str, Any]] | None = None  # saved inside emergency checkpoints
    reweighted: dict[str, dict[str, Any]] = field(default_factory=dict)  # "a/b" -> {a, b, key, threshold}
    fp32_modules: list[str] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    outside_params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # optimizer-only
    # Monitor.track(): modules the loop derives from the weights after each step (an EMA), which an
    # undo, a rollback and the emergency checkpoint hold beside the model
    tracked: list[tuple[str, nn.Module]] = field(default_factory=list)
    # The model's weights that fp32 masters the optimizer updates stand in for (Megatron-LM's
    # Float16 optimizer, apex O2: the loop copies the masters into them after each step): an undo
    # puts them back with the masters, so the model's state holds no trace of the undone update
    copies: list[torch.Tensor] = field(default_factory=list)
    last_checkpoint: str | None = None
    last_checkpoint_step: int | None = None
    # The step in which every rank consolidated ZeroRedundancyOptimizer's state on rank 0: once a
    # step, as stop's checkpoint after the checkpoint action's runs again on the ranks that do not
    # write (their last_checkpoint_step stays behind) and a collective must not
    consolidated_at: int | None = None
    _noise_gen: torch.Generator | None = None

    def with_outside_params(self, extra: Mapping[str, Any], tracked: bool = True) -> dict[str, Any]:
        """``extra`` plus the values of the parameters the optimizer holds outside the model (a
        learnable temperature in a loss module): a model state_dict does not carry them; and, with
        ``tracked``, the state dicts of the tracked modules (``Monitor.track``: an EMA)."""
        out = dict(extra)
        if self.outside_params:
            out[OUTSIDE_PARAMS] = {name: p.detach() for name, p in self.outside_params}
        if self.tracked and tracked:
            out[TRACKED] = {name: m.state_dict() for name, m in self.tracked}
        return out

    def restore_outside_params(self, state: Mapping[str, Any]) -> None:
        """Put back what ``with_outside_params`` saved (in a snapshot's or checkpoint's extra)."""
        extra = state.get(EXTRA) or {}
        saved = extra.get(OUTSIDE_PARAMS, {})
        with torch.no_grad():
            for name, p in self.outside_params:
                if name in saved:
                    p.copy_(saved[name])
        tracked = extra.get(TRACKED, {})
        for name, m in self.tracked:
            if name in tracked:
                m.load_state_dict(sharding.rebuild(tracked[name]))  # (copies in: the snapshot stays intact)

    def held_bytes(self) -> int:
        """Bytes of the states held on the host beside the snapshots (``lr_trial_held``,
        ``shift_held``), which share ``actions.rollback.max_host_mb`` with them."""
        return sum(held["bytes"] for held in (self.lr_trial_held, self.shift_held) if held is not None)

    def no_room_to_hold(self, size: int) -> bool:
        """Whether ``size`` more bytes held on the host would pass ``actions.rollback.max_host_mb``
        beside the snapshots and what is held already (this rank's answer)."""
        ring = self.snapshots
        return (
            ring is not None and ring.max_bytes is not None and ring.nbytes + self.held_bytes() + size > ring.max_bytes
        )

    def buffer_copy(self) -> tuple[UndoState, list[torch.Tensor]] | None:
        """The copy that holds the model's buffers as they were before the step's forward, with the
        buffers it holds: the undo copy's (every buffer), else the running statistics' copy (the lean
        profile), else None."""
        if self.undo is not None:
            return self.undo, self.undo_buffers
        if self.stats_copy is not None:
            return self.stats_copy, self.stats_buffers
        return None

    def held_ids(self) -> set[int]:
        """The ids of the tensors the undo copy puts back of its own: the parameters the optimizer
        updates (and those of the optimizers it wraps) and the model's buffers."""
        params = [p for opt in [self.optimizer, *inner_optimizers(self.optimizer)] for p in params_of(opt)]
        return {id(t) for t in (*params, *self.undo_buffers)}

    def tracked_tensors(self) -> list[torch.Tensor]:
        """The model's weights fp32 masters stand in for (``copies``), then the tracked modules'
        parameters and buffers, walked now (a module may replace one), but those the undo copy
        holds of its own (``held_ids``: a tracked part of the model)."""
        if not self.tracked:
            return list(self.copies)
        held = self.held_ids()
        return [
            *self.copies,
            *(t for _, m in self.tracked for t in (*m.parameters(), *m.buffers()) if id(t) not in held),
        ]

    def params_with_grad(self) -> dict[str, list[nn.Parameter]]:
        groups = self.groups or {"all": list(self.model.named_parameters())}
        return {g: [p for _, p in named if p.grad is not None] for g, named in groups.items()}


# --------------------------------------------------------------------------------------------
# skip_step
# --------------------------------------------------------------------------------------------


@register_action(SKIP_STEP, order=20)
def skip_step(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Mark this step's update as not to be applied; the monitor makes it a bit-identical no-op."""
    ctx.skip = True
    return {"skipped_step": ctx.step}


@register_action(ZERO_GRAD, order=22)
def zero_grad(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """The loop calls no ``zero_grad()`` between optimizer steps (``zero_grad_missing``): from now
    on the monitor zeroes every gradient in place as each step closes, as
    ``optimizer.zero_grad(set_to_none=False)`` would before the next backward (in place, not None:
    a loop that reads its gradients after ``optimizer.step()`` still finds them)."""
    applied = not ctx.zero_grads
    ctx.zero_grads = True
    return {"applied": applied, "from_step": ctx.step, "how": "gradients zeroed in place as each step closes"}


# --------------------------------------------------------------------------------------------
# clip
# --------------------------------------------------------------------------------------------


def _group_norms(grads: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """0-d float32 norm per group, fused (no host sync; ``stats.norms``, fp32 even for fp16); over
    every shard of a sharded (FSDP2) gradient, in one collective for all groups."""
    return sharding.global_group_norms(grads)


def _total(norms: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(list(norms.values())))


def _unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """Norm per output unit (dim 0) for matrices and conv kernels; whole-tensor norm for vectors."""
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x.float())
    return torch.linalg.vector_norm(x.float(), dim=tuple(range(1, x.ndim)), keepdim=True)


def _total_norm_target(
    config: ClipConfig, mode: str, cause_data: Mapping[str, Any] | None
) -> tuple[float, dict[str, Any]] | None:
    """The total-norm threshold of ``global`` and ``zclip`` (ZClip's EMA mean + z sigma, or
    ``max_grad_norm`` without detector statistics) and the settings used; None for the other modes."""
    if mode == "zclip":
        data = cause_data or {}
        if "mean_log" in data and "sigma_log" in data:
            target = math.exp(float(data["mean_log"]) + config.zclip_z * float(data["sigma_log"]))
            return target, {"mode": mode, "max_norm": target, "zclip_z": config.zclip_z}
        target = config.max_grad_norm
        return target, {"mode": "global", "max_norm": target, "note": "no detector statistics: global clip"}
    if mode == "global":
        return config.max_grad_norm, {"mode": mode, "max_norm": config.max_grad_norm}
    return None


def clip_gradients(
    groups: dict[str, list[nn.Parameter]],
    config: ClipConfig,
    mode: str | None = None,
    cause_data: Mapping[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """Clip the gradients of ``groups`` (group -> parameters with .grad) in place.

    Returns (norms before, norms after, settings used); norms are 0-d tensors per group (no host
    sync here), so a monitor can also call this as a standing setting every step.
    """
    mode = mode or config.mode
    grads = {g: [p.grad for p in ps if p.grad is not None] for g, ps in groups.items()}
    grads = {g: ts for g, ts in grads.items() if ts}
    before = _group_norms(grads)
    if not before:
        return {}, {}, {"mode": mode}
    used: dict[str, Any] = {"mode": mode}
    bound = _total_norm_target(config, mode, cause_data)
    if bound is not None:
        target, used = bound
        total = _total(before)
        coef = torch.clamp(target / (total + CLIP_EPS), max=1.0)
        for ts in grads.values():
            torch._foreach_mul_(sharding.locals_(ts), coef.to(ts[0].dtype) if ts[0].dtype != coef.dtype else coef)
    elif mode == "per_modality":
        rules = {}
        for g, ts in grads.items():
            rule = config.per_modality.get(g, config.per_modality.get(ANY_GROUP))
            if rule is None:
                continue
            kind, c = parse_clip_rule(rule)
            n = before[g]
            coef = torch.clamp(c / (torch.sqrt(n) if kind == "sqrt" else n).clamp_min(CLIP_EPS), max=1.0)
            torch._foreach_mul_(sharding.locals_(ts), coef)
            rules[g] = rule
        used["rules"] = rules
    elif mode == "agc":
        used.update(agc_lambda=config.agc_lambda, agc_eps=config.agc_eps)
        for ps in groups.values():
            for p in ps:
                if p.grad is None:
                    continue
                # torch.clamp(min=), not clamp_min: FSDP2's DTensors have no clamp_min before torch 2.9
                max_norm = torch.clamp(_unitwise_norm(p.detach()), min=config.agc_eps) * config.agc_lambda
                g_norm = _unitwise_norm(p.grad)
                coef = torch.where(
                    g_norm > max_norm, max_norm / torch.clamp(g_norm, min=CLIP_EPS), torch.ones_like(g_norm)
                )
                p.grad.mul_(coef.to(p.grad.dtype))
    else:
        raise ConfigError(f"clip mode {mode!r} is not allowed; choose one of {', '.join(CLIP_MODES)}")
    after = _group_norms(grads)
    return before, after, used


# torch's clip leaves the norm at max_norm * total / (total + 1e-6), and the fp32 norms of the
# clipped gradients round by a few ulps (~1e-7 relative): a norm within 1e-5 of the threshold is
# the user's clip at the same threshold, not a gradient left above it.
USER_CLIP_RTOL = 1e-5


def _user_clip_holds(
    ctx: ActionContext, decision: Decision, groups: dict[str, list[nn.Parameter]]
) -> dict[str, Any] | None:
    """The clip never clips twice: when the user's own clip before ``optimizer.step()`` (this
    step's ``grad_clip/user``, userclip.py) already bounded the total norm at or below this clip's
    threshold, the facts of a clip that changed nothing; else None (clip)."""
    if not ctx.stats.get(USER_CLIPPED):
        return None
    bound = _total_norm_target(
        ctx.config.clip, decision.params.get("mode") or ctx.config.clip.mode, decision.cause.data
    )
    if bound is None:  # per_modality / agc: per-group and unit-wise rules, not the user's total norm
        return None
    target, used = bound
    norms = _group_norms({g: [p.grad for p in ps if p.grad is not None] for g, ps in groups.items() if ps})
    if not norms:
        return None
    total = float(_total(norms))  # one host read (an action's, not every step's)
    if not total <= target * (1 + USER_CLIP_RTOL):
        return None
    return {
        **used,
        "clipped": False,
        "applied": False,  # the budget counts only actions that changed something
        "reason": (
            f"the user's clip before optimizer.step() already bounded the total gradient norm "
            f"({total:.6g}) at or below the threshold ({target:.6g})"
        ),
        "norm_before": total,
        "user_clipped": True,
    }


def _second_moment_decay(optimizer: torch.optim.Optimizer) -> float | None:
    """The decay of the optimizer's second-moment estimate (the smallest over its param groups:
    Adam-family ``betas[1]``, RMSprop's ``alpha``), or None when it keeps none (SGD)."""
    try:
        if all("betas" in pg for pg in optimizer.param_groups):
            return min(float(pg["betas"][1]) for pg in optimizer.param_groups)
        if all("alpha" in pg for pg in optimizer.param_groups):
            return min(float(pg["alpha"]) for pg in optimizer.param_groups)
    except (TypeError, IndexError, ValueError):
        pass
    return None


def _absorbed_by_optimizer(ctx: ActionContext, decision: Decision) -> dict[str, Any] | None:
    """A finite grad spike the optimizer takes in its stride: the facts of a clip that changed
    nothing, with the reason; else None (clip).

    With a second moment (``clip.spare_adaptive``; Adam's betas, RMSprop's alpha) the step per
    element is m_hat / sqrt(v_hat): a gradient r times its usual norm adds (1 - beta1) r to the
    first moment and (1 - beta2) r^2 to the second, so the step it makes is bounded (~(1 - beta1) /
    sqrt(1 - beta2), ~3x a usual step at the defaults) and it shrinks later steps only while
    (1 - beta2) r^2 is comparable to 1. Below that the spike's harm is small and a clip would move a
    healthy run off its course; above it (a 10^4 x loss) the clip protects the second moment for the
    ~1 / (1 - beta2) steps it remembers. Without one (``clip.spare_factor``; SGD) the update it makes
    is at most r x the usual: under the factor the update-ratio test calls a spike, it is left."""
    data = decision.cause.data
    cfg = ctx.config.clip
    if decision.cause.kind != GRAD_SPIKE:
        return None
    try:
        r = float(data["value"]) / float(data["ema_mean"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None  # not a ZClip finding
    if not math.isfinite(r):
        return None
    beta2 = _second_moment_decay(ctx.optimizer)
    if beta2 is None:
        if not r < cfg.spare_factor:
            return None
        return {
            "clipped": False,
            "applied": False,
            "ratio_to_mean": r,
            "reason": (
                f"the gradient is {r:.3g}x its mean: with no second moment to swamp, the update it makes "
                f"is at most {r:.3g}x the usual, under the {cfg.spare_factor:g}x that calls for a clip "
                "(actions.clip.spare_factor)"
            ),
        }
    added = (1.0 - beta2) * r * r  # what the spike adds to the second moment, in units of its level
    growth = beta2 + added
    if not cfg.spare_adaptive or not math.isfinite(growth) or not 0.0 <= beta2 < 1.0 or added > 1.0:
        return None
    return {
        "clipped": False,
        "applied": False,
        "ratio_to_mean": r,
        "beta2": beta2,
        "second_moment_growth": growth,
        "reason": (
            f"the gradient is {r:.3g}x its mean: the optimizer's second moment (beta2 {beta2:g}) "
            f"grows {growth:.3g}x, under the 2x that would call for a clip (actions.clip.spare_adaptive)"
        ),
    }


@register_action(CLIP, order=70, config=ClipConfig)
def clip(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Clip this step's gradients (mode from ``decision.params['mode']`` or the config). It never
    clips twice: after the user's own clip bounded the total norm at or below its threshold it
    changes nothing and says so (``clipped: False`` and the reason). Under an Adam-family optimizer
    a spike too small to matter to it is left alone (``clip.spare_adaptive``), under one without a
    second moment a spike under ``clip.spare_factor`` x its mean, and it says so."""
    groups = ctx.params_with_grad()
    held = _user_clip_holds(ctx, decision, groups)
    if held is None:
        held = _absorbed_by_optimizer(ctx, decision)
    if held is not None:
        return held
    before, after, used = clip_gradients(groups, ctx.config.clip, decision.params.get("mode"), decision.cause.data)
    if ctx.stats.get(USER_CLIPPED):
        used["user_clipped"] = True  # the user's clip left the total norm above this threshold
    if not before:
        return {**used, "clipped": False, "applied": False, "reason": "no gradients"}
    names = list(before)
    values = torch.stack(
        [before[g] for g in names] + [_total(before)] + [after[g] for g in names] + [_total(after)]
    ).tolist()  # one host read
    n = len(names) + 1
    return {
        **used,
        "norm_before": values[n - 1],
        "norm_after": values[2 * n - 1],
        "group_norm_before": dict(zip(names, values[: n - 1])),
        "group_norm_after": dict(zip(names, values[n : 2 * n - 1])),
    }


# --------------------------------------------------------------------------------------------
# reweight
# --------------------------------------------------------------------------------------------


@register_action(REWEIGHT, order=60, per_finding=True, config=ReweightConfig)
def reweight(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """The report's rule for the pair (a, b) of the finding, ratio r > t:
    w_a = base_a * t / r, w_b = base_b * r / t (the report: w_v = 0.4 * 2/r, w_f = 0.3 * r/2)."""
    cfg = ctx.config.reweight
    data = decision.cause.data
    a, b, r = data.get("a"), data.get("b"), data.get("ratio")
    t = float(data.get("threshold", cfg.threshold))
    if a not in ctx.base_weights or b not in ctx.base_weights:
        return {
            "applied": False,
            "reason": f"components {a!r} and {b!r} are not both in combine() weights {sorted(ctx.base_weights)}",
        }
    if r is None or not math.isfinite(r) or r <= t:
        return {"applied": False, "reason": f"ratio {r} is not above {t:g}"}
    old = dict(ctx.loss_weights)
    ctx.loss_weights[a] = max(ctx.base_weights[a] * t / r, cfg.min_weight)
    ctx.loss_weights[b] = max(ctx.base_weights[b] * r / t, cfg.min_weight)
    key = str(data.get("key", S.LOSS_RATIO.format(a, b)))
    ctx.reweighted[f"{a}/{b}"] = {"a": a, "b": b, "key": key, "threshold": t}
    return {
        "applied": True,
        "pair": [a, b],
        "ratio": r,
        "threshold": t,
        "old_weights": {a: old.get(a), b: old.get(b)},
        "new_weights": {a: ctx.loss_weights[a], b: ctx.loss_weights[b]},
    }


def relax_weights(ctx: ActionContext, stats: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Call once per step: each reweighted pair whose ratio is back at or under its threshold moves
    ``relax_rate`` of the way back to its base weights (snapping to base within 0.1%). Returns
    {"weights": {...}, "restored": [pairs back at base]} when something changed, else {}."""
    stats = ctx.stats if stats is None else stats
    rate = ctx.config.reweight.relax_rate
    changed: dict[str, float] = {}
    restored = []
    for pair, info in list(ctx.reweighted.items()):
        r = stats.get(info["key"])
        if r is None and info["key"].startswith(S.LOSS_RATIO.format("", "")[:-1]):
            r = S.loss_ratio_of(stats, info["a"], info["b"])  # as the detector's own fallback
        if r is None or not math.isfinite(r) or r > info["threshold"]:
            continue
        done = True
        for c in (info["a"], info["b"]):
            base, w = ctx.base_weights[c], ctx.loss_weights[c]
            w = base + (w - base) * (1.0 - rate)
            if abs(w - base) <= 1e-3 * abs(base):
                w = base
            else:
                done = False
            ctx.loss_weights[c] = w
            changed[c] = w
        if done:
            del ctx.reweighted[pair]
            restored.append(pair)
    if not changed:
        return {}
    return {"weights": changed, "restored": restored}


# --------------------------------------------------------------------------------------------
# lr_drop
# --------------------------------------------------------------------------------------------


def _scaled_lr(lr: float, scale: float, min_lr: float) -> float:
    return max(lr * scale, min(lr, min_lr))


def lr_not_a_step_size(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> str | None:
    """Why a param group's ``lr`` does not size its updates, or None when it does: the optimizer
    sizes its steps itself (Adafactor's relative step keeps lr None; Rprop reads lr once, as every
    weight's first step size, then grows and shrinks each step by itself). Such a group has no LR
    for the update-ratio test to read its updates by, and no LR for lr_drop to lower."""
    if group["lr"] is None:
        return "its lr is None (the optimizer sizes its steps itself, e.g. Adafactor's relative step)"
    if isinstance(optimizer, torch.optim.Rprop):
        return "Rprop's lr is only every weight's first step size (each step then grows or shrinks by itself)"
    return None


def apply_lr_scale(optimizer: torch.optim.Optimizer, scale: float, min_lr: float = 0.0) -> list[Any]:
    """Multiply every param group's LR by ``scale`` (not below ``min_lr``, nor above the group's own
    LR); returns what ``restore_lr`` needs. ``scale == 1``, or no group whose LR sizes its updates
    (``lr_not_a_step_size``): touches nothing, returns []."""
    if scale == 1.0:
        return []
    groups = optimizer.param_groups
    alone = [lr_not_a_step_size(optimizer, g) is not None for g in groups]
    if all(alone):
        return []
    saved: list[Any] = []
    for group, left in zip(groups, alone):
        lr = group["lr"]
        if left:
            saved.append(None)  # left alone
        elif isinstance(lr, torch.Tensor):
            saved.append(lr.clone())
            lr.copy_(torch.maximum(lr * scale, torch.clamp_max(lr, min_lr)))
        else:
            saved.append(lr)
            group["lr"] = _scaled_lr(lr, scale, min_lr)
    return saved


def restore_lr(optimizer: torch.optim.Optimizer, saved: list[Any]) -> None:
    """Put back the LRs ``apply_lr_scale`` changed."""
    for group, lr in zip(optimizer.param_groups, saved):
        if lr is None:  # left alone
            continue
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].copy_(lr)
        else:
            group["lr"] = lr


# Cooldown 20: one drop per incident, not one per finding of a burst.
@register_action(LR_DROP, order=40, budgeted=True, cooldown=20, config=LRDropConfig)
def lr_drop(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """``ctx.lr_scale *= factor`` (not below ``min_scale``); effective LRs reported per group. For a
    finding whose data says ``trial`` (loss_divergence) the drop is a trial, judged by
    ``judge_trial``: it is made permanent, if so, only once the loss bears it out.
    Where the user's LR is now more than 1 / ``factor`` x its level before, in every group (the
    finding's ``lr_rise``: a schedule bug that multiplies the LR for some steps), the scale takes
    the LR back to that level instead: a fifth of a 300x LR is still 60x the LR the run was healthy
    at."""
    cfg = ctx.config.lr_drop
    if decision.cause.data.get("trial_refuted"):
        return _give_back_lr(ctx)
    factor = float(decision.params.get("factor", cfg.factor))
    rise = decision.cause.data.get("lr_rise")
    if not isinstance(rise, float) or rise * factor <= 1.0:
        rise = None  # (no rise beyond what the factor takes back: the drop is the factor's)
    if rise is not None:
        factor = 1.0 / rise
    old = ctx.lr_scale
    trial = bool(decision.cause.data.get("trial")) and rise is None
    refuted = _refuted(ctx) if trial else None
    if refuted is not None:
        return {"applied": False, "reason": refuted}
    restart = trial and bool(decision.cause.data.get("restart"))
    if restart and ctx.restored_at != ctx.step:  # (a warm-up mid-stall does not mend it: only from the start)
        return {"applied": False, "reason": "no restart from the run's start (see the rollback): no warm-up either"}
    saved = _drop_fields(ctx) if trial else None
    # An update larger than its weights before any of the group's updates landed: the run may
    # start at an LR too high for its initial weights (no warm-up). A hold at a fifth for 100 steps
    # left the damage of the first updates (a GPT at 20x its LR: 39% of the gap to its default LR
    # closed); the undone updates leave the initial state, from which a warm-up closes 66%. Where
    # the LR is too high for the problem, not only for the start, the climb's halt takes it back
    # to where the loss was lowest: on a rise, or a stall (relax_lr).
    warmup = bool(decision.cause.data.get("first_update")) and cfg.warmup_scale > 0 and old >= 1.0 and rise is None
    if warmup:
        factor = cfg.warmup_scale
    # A drop while a warm-up climbs (the LR it is at was never seen healthy, nor was it back) is a
    # warm-up again, from the lower scale: not trouble that came back with the LR.
    rewarm = not warmup and ctx.lr_warmup is not None and not ctx.lr_permanent and rise is None
    new = max(old * factor, cfg.min_scale)
    ctx.lr_scale = new
    ctx.lr_warmup = (1.0 / new) ** (1.0 / cfg.warmup_steps) if warmup or rewarm else None
    # The trouble came back before the LR did: it stays cut (a drop sized to the user's raise
    # answers that raise, not this; a warm-up climbs back whatever recover_after says).
    # So did trouble at the LR a warm-up gave back, which was never seen healthy.
    permanent = not (warmup or rewarm) and ((old < 1.0 and rise is None) or not cfg.recover_after or _proving(ctx))
    if permanent and saved is None:  # (a trial's cut is made permanent, if so, once it is confirmed)
        ctx.lr_permanent = True
    ctx.lr_proving_until = None
    ctx.lr_dropped_at, ctx.lr_drop_kind = ctx.step, decision.cause.kind
    groups = ctx.optimizer.param_groups
    why_not = [lr_not_a_step_size(ctx.optimizer, g) for g in groups]
    lrs = [None if why else float(g["lr"]) for g, why in zip(groups, why_not)]
    facts: dict[str, Any] = {
        "factor": factor,
        "old_scale": old,
        "new_scale": new,
        "permanent": ctx.lr_permanent,
        "recovers_from_step": None if ctx.lr_permanent else ctx.step + _recover_after(ctx),
        "at_floor": new == cfg.min_scale,
        "old_lr": _scaled_lrs(lrs, old, cfg.min_lr),
        "new_lr": _scaled_lrs(lrs, new, cfg.min_lr),
    }
    if rise is not None:
        facts["lr_rise"] = rise
    if warmup or rewarm:
        facts["warmup_steps"] = cfg.warmup_steps
    if saved is not None:
        median = decision.cause.data.get("median")
        before = math.log(median) if isinstance(median, float) and median > 0 else None
        if before is None:  # (no median to judge the trial against: an ordinary drop)
            ctx.lr_permanent = ctx.lr_permanent or permanent
        else:
            # The trial's bar: midway (in logs) between that median and the one where the growth
            # began: from a state before a growth of its own the loss comes back near where it
            # began; a TD learner's bimodal loss, 5% under its median before, is no such return.
            began = decision.cause.data.get("began_median")
            low = math.log(began) if isinstance(began, float) and 0 < began < math.exp(before) else before
            bar = (before + low) / 2
            after = cfg.halt_window
            if restart:  # (judged once it has made the run's steps again, before the warm-up's climb ends)
                bar = math.log(float(decision.cause.data["bar_median"]))
                after = min(max(int(decision.cause.data["judge_after"]), _restart_judged(cfg)), cfg.warmup_steps - 1)
            ctx.lr_trial = {
                "at": ctx.step,
                "before": before,
                "bar": bar,
                "losses": [],
                "permanent": permanent,
                "kind": decision.cause.kind,
                "saved": saved,
                "judge_after": after,
                "restart": restart,
                "collapse": bool(decision.cause.data.get("collapse")),
            }
            facts.update(trial=True, judged_at_step=ctx.step + after, recovers_from_step=None)
    if all(why_not):
        facts["applied"] = False
        facts["reason"] = f"no param group has an LR to lower: {why_not[0]}"
    else:
        ctx.lr_ceiling = list(facts["new_lr"])
    return facts


# A restart's trial is judged no sooner than this share of the warm-up's steps: its LR has climbed
# to warmup_scale ** 0.3 of the full (0.41 at the default 0.05). Judged after the run's own 45-50
# steps, 12-block post-LN stalls were refuted at 0.2x the LR (medians 3.23 and 3.13 against bars 3.02
# and 2.95) where the same warm-up from the start passes the bar by step ~70 and ends at 2.65 and
# 2.52 against bare 3.22 and 3.17 (a helper's probe).
RESTART_JUDGED_SHARE = 0.7


def _restart_judged(cfg: LRDropConfig) -> int:
    """The earliest step after a restart its trial is judged at (``RESTART_JUDGED_SHARE``)."""
    return max(cfg.halt_window, math.ceil(RESTART_JUDGED_SHARE * cfg.warmup_steps))


def _refuted(ctx: ActionContext) -> str | None:
    """Why a trial's actions are not taken (a trial before was not borne out, and the loss has
    not come back under that trial's level since), else None."""
    trial = ctx.lr_trial
    if trial is None or not trial.get("refuted"):
        return None
    return (
        f"a trial at step {trial['at']} showed that what grows the loss is outside the state and the LR: a growing "
        f"loss is told, not answered, until its median is back under {math.exp(trial['before']):.4g}"
    )


def _drop_fields(ctx: ActionContext) -> dict[str, Any]:
    """The LR drop's fields as they are (put back where a trial is not borne out)."""
    return {
        "scale": ctx.lr_scale,
        "permanent": ctx.lr_permanent,
        "warmup": ctx.lr_warmup,
        "proving_until": ctx.lr_proving_until,
        "dropped_at": ctx.lr_dropped_at,
        "kind": ctx.lr_drop_kind,
        "ceiling": None if ctx.lr_ceiling is None else list(ctx.lr_ceiling),
        "halt_watch": None if ctx.lr_halt_watch is None else list(ctx.lr_halt_watch),
    }


def judge_trial(ctx: ActionContext, step: int, loss: float | None) -> Finding | None:
    """Call once per step with the step's loss, before its decisions. A trial (``ctx.lr_trial``:
    for a finding whose cause the loss cannot tell, loss_divergence's, a rollback to the newest
    snapshot from before the growth and an LR drop, the state left held) is judged ``halt_window``
    steps after it by the median of the losses made since. Back under the bar, midway (in logs)
    from the median of the window before the trial to the one where the growth began, the growth
    was the run's own (an LR past its edge: from the state before the growth, at the lowered LR,
    the loss is back near where it began at once and stays there): a finding told, no action,
    and the drop stands as an ordinary one. Else what grows the loss is outside the state and the
    LR (a loss weight or a target that grows, noisier data): a finding whose enforced actions put
    back what the trial changed (``rollback``: the held state; ``lr_drop``: the LR as it was), so
    the run goes on as if the trial had not been, but for its steps. Returns that finding, else
    None. After a refutation, clears the trial once the median of the last ``halt_window`` losses
    is back under the one before it (until then a growing loss is told only)."""
    trial = ctx.lr_trial
    if trial is None:
        return None
    window = ctx.config.lr_drop.halt_window
    if loss is not None and math.isfinite(loss) and step > trial["at"]:
        trial["losses"] = [*trial["losses"][-(window - 1) :], math.log(loss) if loss > 0 else -math.inf]
    if trial.get("refuted"):
        if len(trial["losses"]) >= window and statistics.median(trial["losses"]) < trial["before"]:
            ctx.lr_trial = None
        return None
    if ctx.lr_dropped_at != trial["at"]:  # (another drop, or a release, took over: no trial to judge)
        ctx.lr_trial = ctx.lr_trial_held = None
        return None
    if step - trial["at"] < trial.get("judge_after", window):
        return None
    median = statistics.median(trial["losses"]) if trial["losses"] else None
    held = ctx.lr_trial_held
    facts: dict[str, Any] = {
        "trial": True,
        "restart": bool(trial.get("restart")),
        "collapse": bool(trial.get("collapse")),
        "trial_steps": step - trial["at"],
        "trial_from_step": trial["at"],
        "loss_median_before": math.exp(trial["before"]),
        "loss_median_bar": math.exp(trial["bar"]),
        "loss_median_trial": None if median is None else math.exp(median),
        "state_held": held is not None,
    }
    if median is not None and median < trial["bar"]:
        ctx.lr_trial = ctx.lr_trial_held = None  # (the snapshots its rollback took out stay out)
        ctx.lr_permanent = ctx.lr_permanent or bool(trial["permanent"])
        facts.update(
            followed=True,
            scale=ctx.lr_scale,
            permanent=ctx.lr_permanent,
            recovers_from_step=None if ctx.lr_permanent else trial["at"] + _recover_after(ctx),
        )
        return Finding(trial["kind"], trial_message(facts, ctx.config.lr_drop), data=facts, told=True)
    facts.update(followed=False, trial_refuted=True)
    enforced = (ROLLBACK, LR_DROP) if held is not None else (LR_DROP,)
    return Finding(trial["kind"], trial_message(facts, ctx.config.lr_drop), data=facts, enforced=enforced)


def _give_back_lr(ctx: ActionContext) -> dict[str, Any]:
    """A refuted trial (``judge_trial``): the LR drop's fields as they were before it; further trials
    wait until the loss is back under the level of this one."""
    trial = ctx.lr_trial
    if trial is None or trial.get("refuted"):
        return {"applied": False, "reason": "no trial drop to give back"}
    old, saved = ctx.lr_scale, trial["saved"]
    ctx.lr_scale, ctx.lr_permanent, ctx.lr_warmup = float(saved["scale"]), bool(saved["permanent"]), saved["warmup"]
    ctx.lr_proving_until, ctx.lr_dropped_at, ctx.lr_drop_kind = (
        saved["proving_until"],
        saved["dropped_at"],
        saved["kind"],
    )
    ctx.lr_ceiling = None if saved["ceiling"] is None else list(saved["ceiling"])
    watch = saved["halt_watch"]
    ctx.lr_halt_watch = None if watch is None else (int(watch[0]), float(watch[1]))
    trial["refuted"] = True
    return {"old_scale": old, "new_scale": ctx.lr_scale, "given_back": True}


def _proving(ctx: ActionContext) -> bool:
    """Whether the full LR a warm-up gave back is still watched (``ctx.lr_proving_until``)."""
    return ctx.lr_proving_until is not None and ctx.step <= ctx.lr_proving_until


def _recover_after(ctx: ActionContext) -> int:
    """Steps after the last drop before the LR climbs back: the warm-up's, or recover_after."""
    return 1 if ctx.lr_warmup is not None else ctx.config.lr_drop.recover_after


def _scaled_lrs(lrs: list[float | None], scale: float, min_lr: float) -> list[float | None]:
    """Each param group's LR under ``scale`` (None: a group without a step-size LR)."""
    return [None if lr is None else _scaled_lr(lr, scale, min_lr) for lr in lrs]


def _user_lrs(ctx: ActionContext) -> list[float | None]:
    """The user's LR of each param group as it is now (before the monitor's scale is applied);
    None for a group whose LR sizes no step."""
    opt = ctx.optimizer
    return [None if lr_not_a_step_size(opt, g) else float(g["lr"]) for g in opt.param_groups]


def _hold_ceiling(ctx: ActionContext) -> dict[str, Any]:
    """A drop never takes the LR below the level it set (``ctx.lr_ceiling``) as the user's
    schedule falls: the scale rises so that the LR stays at that level, and once the user's own LR
    is at or below it the drop is released (its cause, an LR too high, is gone: an LR raised for
    some steps by a schedule bug and set back). A permanent cut (the trouble came back with the LR)
    is a cap at its level instead, both ways: a schedule that falls under it runs untouched, one
    that rises again (a warm restart) is held there. Returns the release's facts, else {}."""
    ceiling = ctx.lr_ceiling
    if ceiling is None or (ctx.lr_scale >= 1.0 and not ctx.lr_permanent):
        return {}
    lrs = _user_lrs(ctx)
    if len(lrs) != len(ceiling):  # (param groups added since: no level to compare with)
        ctx.lr_ceiling = None
        return {}
    room = [c / lr for c, lr in zip(ceiling, lrs) if c is not None and lr is not None and lr > 0]
    if not room:
        return {}
    needed = min(room)  # the scale at which every group's LR is at its level
    if ctx.lr_permanent:  # (the trouble came back with the LR: a cap at that level, both ways)
        ctx.lr_scale = max(min(1.0, needed), ctx.config.lr_drop.min_scale)
        return {}
    if needed < 1.0:
        ctx.lr_scale = max(ctx.lr_scale, needed)
        return {}
    old = ctx.lr_scale
    ctx.lr_scale, ctx.lr_permanent, ctx.lr_dropped_at, ctx.lr_ceiling = 1.0, False, None, None
    ctx.lr_warmup, ctx.lr_proving_until, ctx.lr_halt_watch = None, None, None
    _forget_climb(ctx)
    return {"old_scale": old, "new_scale": 1.0, "released": True, "user_lr": lrs, "dropped_lr": ceiling}


def relax_lr(ctx: ActionContext, loss: float | None = None) -> dict[str, Any]:
    """Call once per step, with the step's loss when there is one: after a transient, the LR scale
    climbs back to 1 over ``recover_steps`` steps, starting ``recover_after`` steps after the drop
    (never once the cut is permanent). While it climbs the loss is watched: when the median of the
    last ``halt_window`` losses rises ``halt_rise`` x above the lowest such median since the climb
    began (the LR's return brings the trouble back: weights that grew at the low LR, an LR the run
    never could take), the climb halts at the scale of that lowest median, for good. A warm-up's
    climb gives back an LR never seen healthy: the halt watches it ``warmup_steps`` more after the
    climb ends (``ctx.lr_proving_until``; a linear regression under SGD at 0.3 with momentum, whose
    loss rose again 5 steps after: 41 without that watch, 0.053 with it). Returns facts when the
    climb starts, ends or halts (each is an event), else {}. Before any of it, the drop
    holds the LR at the level it set, and is released when the user's LR falls there
    (``_hold_ceiling``)."""
    cfg = ctx.config.lr_drop
    if loss is not None and math.isfinite(loss):
        if len(ctx.losses_seen) < 3:
            ctx.losses_seen.append(float(loss))
        if loss < 0 and not ctx.loss_signed:
            # (a loss with no ratio to rise by, see S.rose: the window's logs no longer compare)
            ctx.loss_signed, ctx.lr_halt_watch = True, None
            _forget_climb(ctx)
    released = _hold_ceiling(ctx)
    if released:
        return released
    again = _watch_halted(ctx, loss)
    if again is not None:
        return again
    after = _recover_after(ctx)
    proving = _proving(ctx) and not ctx.lr_permanent
    if not proving:
        ctx.lr_proving_until = None
    idle = ctx.lr_scale >= 1.0 or ctx.lr_permanent or ctx.lr_dropped_at is None or not after
    since = 0 if idle or ctx.lr_dropped_at is None else ctx.step - ctx.lr_dropped_at
    if proving:  # (the climb is over: its halt still watches the full LR)
        idle, since = False, after + 1
    if idle or since < after - cfg.halt_window:  # (a new drop restarts the count)
        _forget_climb(ctx)
        return {}
    median = _window_median(ctx, loss) if cfg.halt_rise else None
    if median is not None:
        best = ctx.lr_climb_best
        warming = ctx.lr_warmup is not None or proving  # (an LR never seen healthy: a warm-up's)
        rose = best is not None and _median_rose(ctx, median, best[0], cfg.halt_rise)
        stalled = not rose and warming and best is not None and _stalled(ctx, median, best)
        if since > after and best is not None and (rose or stalled):
            old, at = ctx.lr_scale, ctx.lr_climb_best_at
            _cap_lr(ctx, min(best[1], old))
            if warming:  # (the LR left was first seen in the climb)
                ctx.lr_halt_watch, ctx.lr_climb = (ctx.step + cfg.warmup_steps, median), []
            return _halt_facts(ctx, old, median, best[0], after_climb=proving, stalled=not rose, lowest_at=at)
        if best is None or median < best[0]:
            ctx.lr_climb_best = (median, min(scale for _, scale in ctx.lr_climb[-cfg.halt_window :]))
            ctx.lr_climb_best_at = ctx.step
        if best is None:
            ctx.lr_climb_first = median
    if since < after or proving:
        return {}
    old = ctx.lr_scale
    warmup = ctx.lr_warmup
    rate = warmup if warmup is not None else (1.0 / cfg.factor) ** (1.0 / cfg.recover_steps)
    ctx.lr_scale = min(1.0, old * rate)
    if ctx.lr_scale >= 1.0:
        # A warm-up gave back an LR never seen healthy: the halt watches it warmup_steps more
        if warmup is not None and cfg.halt_rise:
            ctx.lr_proving_until = ctx.step + cfg.warmup_steps
        ctx.lr_dropped_at, ctx.lr_ceiling, ctx.lr_warmup = None, None, None
        return {"old_scale": old, "new_scale": 1.0, "recovered": True}
    if since == after:
        steps = cfg.warmup_steps if warmup is not None else cfg.recover_steps
        return {"old_scale": old, "new_scale": ctx.lr_scale, "recovering": True, "steps": steps}
    return {}


def _watch_halted(ctx: ActionContext, loss: float | None) -> dict[str, Any] | None:
    """After a warm-up's halt (``ctx.lr_halt_watch``): the LR it left was itself first seen in
    the climb, and may still be too high (SGD with momentum just past its edge: a linear regression
    at 0.3 whose loss rose from 0.2 to 0.66 over 80 steps at the halted 0.55x). For
    ``warmup_steps`` after the halt, a median of the last ``halt_window`` losses ``halt_rise`` x the
    one at the halt lowers the LR by ``factor`` again, for good, and is watched as long again.
    Returns None where nothing is watched (relax_lr goes on), else the facts of a new cut or {}."""
    watch = ctx.lr_halt_watch
    if watch is None:
        return None
    cfg = ctx.config.lr_drop
    until, at_halt = watch
    if ctx.step > until or not ctx.lr_permanent:
        ctx.lr_halt_watch = None
        return None
    median = _window_median(ctx, loss)
    if median is None or not _median_rose(ctx, median, at_halt, cfg.halt_rise):
        return {}
    old = ctx.lr_scale
    _cap_lr(ctx, max(old * cfg.factor, cfg.min_scale))
    ctx.lr_halt_watch, ctx.lr_climb = (ctx.step + cfg.warmup_steps, median), []
    # (its "lowest": the median at the halt before, and that halt's step)
    return _halt_facts(
        ctx, old, median, at_halt, again=True, after_climb=True, stalled=False, lowest_at=until - cfg.warmup_steps
    )


def halt_message(facts: Mapping[str, Any], cfg: LRDropConfig) -> str:
    """The event message of a halt (``_halt_facts``): a rise during the climb or the watch after a
    warm-up's, a warm-up's stall, or a rise at the LR a warm-up's halt left."""
    rise = f"by {facts['rise']:.3g}" if facts["signed"] else f"{facts['rise']:.3g}x"
    median = f"(median of the last {cfg.halt_window} steps)"
    if facts.get("again"):
        return (
            f"the loss rose {rise} over its median at the halt at step {facts['lowest_at']} {median} at the LR "
            f"a warm-up's halt left (first seen in its climb: watched {cfg.warmup_steps} steps after the halt): "
            f"still too high; the LR goes down to {facts['new_scale']:.3g}x the user's schedule, for good"
        )
    what = f"rose {rise} {median}"
    if facts["stalled"]:
        what = (
            f"stalled: the median of the last {cfg.halt_window} steps has not fallen below "
            f"{facts['lowest_loss_median']:.4g} since step {facts['lowest_at']} while the LR rose to 2x its "
            "scale there or more"
        )
    when = "while the LR climbed back"
    if facts["after_climb"]:
        when = f"after a warm-up gave the LR back (an LR never seen healthy is watched {cfg.warmup_steps} steps more)"
    return (
        f"the loss {what} {when}: the trouble came back with it; the LR stays at {facts['new_scale']:.3g}x the "
        "user's schedule, where the loss was lowest"
    )


def trial_message(facts: Mapping[str, Any], cfg: LRDropConfig) -> str:
    """The message of a trial's judgement (``judge_trial``)."""
    before, during, bar = facts["loss_median_before"], facts["loss_median_trial"], facts["loss_median_bar"]
    if facts.get("restart"):
        seen = (
            f"its median over the last {cfg.halt_window} of its {facts['trial_steps']} steps, {during:.4g}, "
            if during is not None
            else f"no loss was seen in the {facts['trial_steps']} steps of the trial, "
        )
        if facts["followed"]:
            return (
                f"the restart from the run's start with an LR warm-up bore out: {seen}is under {bar:.4g}, the bar "
                f"under the stall's median before it at step {facts['trial_from_step']}, {before:.4g}: the warm-up "
                "stands"
            )
        back = (
            "the stalled state and the LR are put back"
            if facts["state_held"]
            else "the LR is given back (nothing is held to put back: the run was resumed since the restart, and the "
            "monitor's state_dict does not carry the state it held)"
        )
        return (
            f"the restart from the run's start with an LR warm-up did not bear out: {seen}is not under {bar:.4g}, the "
            f"bar under the stall's median before it at step {facts['trial_from_step']}, {before:.4g}: {back}"
        )
    seen = (
        f"its median over the {cfg.halt_window} steps of the trial, {during:.4g}, "
        if during is not None
        else f"no loss was seen in the {cfg.halt_window} steps of the trial, "
    )
    start = "from the state before the growth, at the lowered LR, " if facts["state_held"] else "at the lowered LR, "
    if facts["followed"]:
        then = (
            "for good (the trouble came back before the LR did)"
            if facts["permanent"]
            else f"and the LR climbs back from step {facts['recovers_from_step']}"
        )
        return (
            f"the trial bore the growth out as the run's own: {start}{seen}is back under {bar:.4g}, midway from its "
            f"median before the trial at step {facts['trial_from_step']}, {before:.4g}, to where the growth began (an "
            f"LR past its edge): the drop stands, {then}"
        )
    back = "the state the trial left and the LR are put back" if facts["state_held"] else "the LR is given back"
    if facts.get("collapse"):  # (vanishing_gradient's: a faded stack's loss that rose from its lowest)
        return (
            f"the rollback to before the collapse with the LR dropped did not bear out: {start}{seen}is not back "
            f"under {bar:.4g}, midway from its median before the trial at step {facts['trial_from_step']}, "
            f"{before:.4g}, to its lowest: {back}"
        )
    return (
        f"the trial did not bear the growth out as the run's own: {start}{seen}is not back under {bar:.4g}, midway "
        f"from its median before the trial at step {facts['trial_from_step']}, {before:.4g}, to where the growth "
        "began. What grows the loss is outside the state and the LR "
        f"(a loss weight, targets or data that change): {back}, and a growing loss is told, not answered, until its "
        "median is back under that level"
    )


def _stalled(ctx: ActionContext, median: float, lowest: tuple[float, float]) -> bool:
    """A warm-up's LR that stopped the loss falling and turned it back up: no lower median than
    ``lowest`` (the climb's lowest median and its LR scale) for ``halt_stall`` steps while the LR
    rose to 2x that scale, and the median now ``halt_stall_rise`` x its own ``halt_stall`` steps
    before. (Not x the
    lowest: on a plateau the lowest median is one of its dips, which the median rises over and
    back.) Only after progress: the lowest median ``halt_stall_progress`` under the climb's first
    (a plateau from the start swings over its medians by chance)."""
    cfg = ctx.config.lr_drop
    at = ctx.lr_climb_best_at  # (None: a state saved before it was kept)
    if not cfg.halt_stall or at is None or ctx.step - at < cfg.halt_stall or ctx.lr_scale < 2.0 * lowest[1]:
        return False
    first = ctx.lr_climb_first  # (None: a state saved before it was kept)
    if cfg.halt_stall_progress and first is not None:
        if not _median_rose(ctx, first, lowest[0], 1.0 / (1.0 - cfg.halt_stall_progress)):
            return False  # (the climb never brought the loss down: a plateau's swings)
    earlier = _median_before(ctx, cfg.halt_stall)
    return earlier is not None and _median_rose(ctx, median, earlier, cfg.halt_stall_rise)


def _cap_lr(ctx: ActionContext, scale: float) -> None:
    """The climb's halt: the LR scale to ``scale`` for good, a cap at the LR it sets (the trouble
    came back with the LR)."""
    ctx.lr_scale, ctx.lr_permanent, ctx.lr_proving_until = scale, True, None
    ctx.lr_ceiling = _scaled_lrs(_user_lrs(ctx), scale, ctx.config.lr_drop.min_lr)


def _forget_climb(ctx: ActionContext) -> None:
    """No climb judged: its values, its first and lowest medians and that median's step."""
    ctx.lr_climb, ctx.lr_climb_best, ctx.lr_climb_best_at, ctx.lr_climb_first = [], None, None, None


def _window_median(ctx: ActionContext, loss: float | None) -> float | None:
    """Add the step's loss (its log; the loss itself once one was seen below zero) and the LR
    scale to the climb's values (``ctx.lr_climb``, the last ``halt_window + halt_stall``): the
    median of the last ``halt_window`` once there are that many, else None (and None, nothing
    added, without a loss it can read)."""
    signed = ctx.loss_signed
    if loss is None or not math.isfinite(loss) or not (loss > 0 or signed):
        return None
    cfg = ctx.config.lr_drop
    keep = cfg.halt_window + cfg.halt_stall  # (a stall's rise is over the median halt_stall steps before)
    ctx.lr_climb = [*ctx.lr_climb[-(keep - 1) :], (loss if signed else math.log(loss), ctx.lr_scale)]
    return _median_before(ctx, 0)


def _median_before(ctx: ActionContext, steps: int) -> float | None:
    """The median of the ``halt_window`` climb values that ended ``steps`` steps ago (None where
    the climb has fewer)."""
    window = ctx.config.lr_drop.halt_window
    if len(ctx.lr_climb) < window + steps:
        return None
    values = ctx.lr_climb[len(ctx.lr_climb) - steps - window : len(ctx.lr_climb) - steps]
    return statistics.median(x for x, _ in values)


def _median_rose(ctx: ActionContext, median: float, reference: float, factor: float) -> bool:
    """Whether the climb window's median (a log loss; the loss itself once one was seen below
    zero) is ``factor`` x ``reference``: for a signed loss, a rise of ``factor - 1`` times the
    progress made from the run's start (S.rose)."""
    if ctx.loss_signed:
        return S.rose(median, reference, factor, max(ctx.losses_seen, default=None), signed=True)
    return median - reference > math.log(factor)


def _halt_facts(ctx: ActionContext, old: float, median: float, reference: float, **more: Any) -> dict[str, Any]:
    """The facts of a halt that took the LR scale from ``old`` to ``ctx.lr_scale`` for good."""
    signed = ctx.loss_signed
    unlog = (lambda x: x) if signed else math.exp
    return {
        "halted": True,
        "old_scale": old,
        "new_scale": ctx.lr_scale,
        "permanent": True,
        "loss_median": unlog(median),
        "lowest_loss_median": unlog(reference),
        # a ratio; a loss below zero has none: the rise itself (S.rose)
        "rise": median - reference if signed else math.exp(median - reference),
        "signed": signed,
        **more,
    }


# --------------------------------------------------------------------------------------------
# undo
# --------------------------------------------------------------------------------------------


@register_action(UNDO, order=25, config=UndoConfig)
def undo(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Put back the parameters and optimizer state from just before the last update (the step the
    finding names, or the one before a finding about the step in flight), skip this step (its
    gradients belong to the undone state), and let ``monitor.batches()`` yield this step's batch
    again: at most one step is lost. Without the copy of that step (undo disabled, or it is older),
    it goes back to the newest snapshot instead (``rollback``)."""
    cause = decision.cause
    target = (ctx.step - 1) if cause.before_update else (cause.step if cause.step is not None else ctx.step - 1)
    state = ctx.undo
    if state is not None and state.label == target and state.loaded_since(ctx.optimizer):
        return {
            "applied": False,
            "undone_step": target,
            "reason": f"the loop loaded the optimizer's state after step {target}'s update (a resume): the "
            "update is no longer there to undo, and the copy from before it would overwrite what was loaded",
        }
    if state is None or state.label != target or not state.params:
        facts = rollback(ctx, decision)
        have = None if state is None else state.label
        return {**facts, "fallback": "rollback", "reason": f"no copy from before step {target}'s update ({have})"}
    # the undone step's batch leaves no trace in the buffers either (BatchNorm statistics)
    state.restore(
        ctx.undo_params,
        ctx.optimizer,
        ctx.undo_buffers,
        before_forward=True,
        tracked=ctx.tracked_tensors(),
        group_keys=ctx.group_step_keys,
    )
    if state.scaler_state:  # (clones: the capture of this step overwrites the undo copy)
        ctx.scaler_restore = [t.clone() for t in state.scaler_state]
    ctx.skip = True
    ctx.repeat_batch = True
    ctx.restored_at = ctx.step
    return {"restored": True, "undone_step": target, "steps_back": ctx.step - target, "skipped_step": ctx.step}


# --------------------------------------------------------------------------------------------
# checkpoint
# --------------------------------------------------------------------------------------------


def _checkpoint_dir(ctx: ActionContext) -> Path | None:
    if ctx.run_dir is None:
        return None
    return Path(ctx.run_dir) / ctx.config.checkpoint.subdir


def _prune(folder: Path, keep: int) -> list[str]:
    files = sorted(folder.glob(f"{EMERGENCY_PREFIX}*.pt"))
    removed = []
    for f in files[:-keep]:
        try:
            f.unlink()
            removed.append(f.name)
        except OSError:
            pass
    return removed


# Kinds whose finding says the state the step started from is already damaged.
DAMAGED_STATE_KINDS = (NONFINITE_PARAM, LOSS_SPIKE, ACCURACY_COLLAPSE)


def _live_state_healthy(ctx: ActionContext, cause: Any) -> bool:
    """Whether the live weights are a state worth saving: the finding is about this step's
    update (not one that landed), or an undo or a rollback of this step put the state back, and
    every parameter is finite (one host read: emergencies only)."""
    restored = ctx.restored_at == ctx.step
    if not restored and (not cause.before_update or cause.kind in DAMAGED_STATE_KINDS):
        return False
    params = [p.detach() for p in ctx.model.parameters()] + [p.detach() for _, p in ctx.outside_params]
    return sharding.all_finite(params)  # FSDP2: over every rank's shards, one answer everywhere


def _restore_snapshot(ctx: ActionContext, state: Mapping[str, Any], rng: bool) -> None:
    """Put a snapshot back: model, optimizer, scaler (and RNG, with ``rng``), the optimizer-only
    parameters and the tracked modules; the state now is the one restored in this step."""
    restore_state(state, ctx.model, ctx.optimizer, ctx.scaler, rng=rng, step_keys=ctx.group_step_keys)
    ctx.restore_outside_params(state)
    ctx.restored_at = ctx.step


def _last_good_snapshot(ctx: ActionContext, cause: Any) -> tuple[int, dict[str, Any]] | None:
    """None when the live state is the last healthy one (``_live_state_healthy``); else the
    newest snapshot from before the damage (a landed update, non-finite weights), if one is held."""
    if ctx.snapshots is None or _live_state_healthy(ctx, cause):
        return None
    if cause.before_update:
        target = ctx.step - 1
    else:
        target = cause.step if cause.step is not None else ctx.step
    return ctx.snapshots.latest_before(target)


# Cooldown 100: emergency checkpoints are big; one per incident. After undo and rollback (order
# 35): when they put the state back in this step, the live state is the last healthy one (an undo
# holds it exactly; an older snapshot would throw away the steps since).
@register_action(CHECKPOINT, order=35, cooldown=100, config=CheckpointConfig)
def checkpoint(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Emergency checkpoint of the last good state: the live state when the finding is about an
    update not yet applied, or an undo or a rollback of this step put it back; otherwise the
    newest snapshot from before the offending update.

    ZeroRedundancyOptimizer: its whole state exists only gathered on rank 0 by a collective
    (``consolidate_state_dict``), which every rank runs here, before rank 0 alone goes on to
    write: every rank runs this action in the same step (the ranks' decisions agree). A snapshot
    holds each rank's own shard only, so a checkpoint from one holds no optimizer state."""
    cause = decision.cause
    snap = _last_good_snapshot(ctx, cause)
    omitted = None  # why the file holds no optimizer state
    zero = state_dict_needs_every_rank(ctx.optimizer)
    alone = zero and world_size() != ctx.optimizer.world_size  # type: ignore[attr-defined]
    if zero and not alone and ctx.consolidated_at != ctx.step:
        # Every rank, whatever snapshot it holds: the ranks' snapshot rings may differ (ZeRO's
        # shards differ in size, so one rank's fits actions.rollback.max_host_mb and another's
        # not), and a collective that only some ranks run hangs the job (a probe).
        ctx.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        ctx.consolidated_at = ctx.step
    if zero and snap is not None:
        omitted = "a snapshot holds each rank's own shard of ZeroRedundancyOptimizer's state, not the whole"
    elif alone:
        omitted = "the monitor is alone on its rank (distributed: false): ZeRO's state needs every rank"
    folder = _checkpoint_dir(ctx)
    if folder is None:
        r = rank()
        if r:  # DDP: rank 0 writes the run's files, this checkpoint too
            return {"saved": False, "reason": f"rank {r} does not write: rank 0 saves the emergency checkpoint"}
        return {"saved": False, "reason": "no run_dir: the monitor has nowhere to write"}
    extra = {
        "step": ctx.step,
        "epoch": ctx.epoch,
        "lr_scale": ctx.lr_scale,
        "loss_weights": dict(ctx.loss_weights),
        "reason": cause.message,
        "kind": cause.kind,
    }
    if ctx.monitor_state is not None:
        extra["monitor"] = ctx.monitor_state()
    source = "live"
    # Imported here: importing the package must not import sfmonitor.dcp, which also runs as
    # `python -m sfmonitor.dcp` (runpy warns when the module is already in sys.modules).
    from . import dcp as sharded_checkpoint

    if sharded_checkpoint.holds_shards(ctx.model):  # FSDP2: every rank writes its own shards
        return sharded_checkpoint.save_emergency(ctx, folder, EMERGENCY_PREFIX, snap, extra)
    if snap is not None:
        label, state = snap
        state = dict(state)
        # the snapshot's own extra carries what the model state lacks (optimizer-only parameters,
        # tracked modules); the checkpoint's facts go beside it
        state[EXTRA] = {**(state.get(EXTRA) or {}), **extra, "snapshot_step": label}
        source = f"snapshot@{label}"
    else:
        state = capture_state(ctx.model, ctx.optimizer, ctx.scaler, ctx.with_outside_params(extra))
        if zero and omitted is None:
            state[OPTIMIZER] = ctx.optimizer.state_dict()  # the whole state, consolidated above
    if zero:
        state.pop(INNER, None)  # rank 0's shard alone: in the whole state, or of no use without the rest
    path = folder / f"{EMERGENCY_PREFIX}{ctx.step:08d}.pt"
    try:
        save_checkpoint(path, state)
    except OSError as e:  # a full disk or an unwritable run_dir must not stop the step
        warnings.warn(
            f"sfmonitor: the emergency checkpoint {path} could not be written ({type(e).__name__}: {e})",
            RuntimeWarning,
            stacklevel=2,
        )
        return {"saved": False, "path": str(path), "error": f"{type(e).__name__}: {e}"}
    ctx.last_checkpoint, ctx.last_checkpoint_step = str(path), ctx.step
    removed = _prune(folder, ctx.config.checkpoint.keep)
    out = {"saved": True, "path": str(path), "bytes": path.stat().st_size, "source": source, "removed": removed}
    if omitted is not None:
        out["optimizer_state"] = f"omitted: {omitted}"
    return out


# --------------------------------------------------------------------------------------------
# rollback
# --------------------------------------------------------------------------------------------


# Cooldown 20: a restored run takes a few steps before going back again.
@register_action(ROLLBACK, order=30, budgeted=True, cooldown=20, config=RollbackConfig)
def rollback(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Restore the newest snapshot taken before the trouble (model, optimizer, scaler, RNG), skip
    this step's update (its gradients belong to the abandoned state) and the next ``skip_batches``
    batches. The LR drop is a separate decision.

    Target: a finding about a landed update (``before_update=False``, e.g. update_ratio_spike) names
    the offending step t in ``data["step"]``: the snapshot labelled <= t predates it. Otherwise the
    trouble is seen in step s, caused by the state step s starts from: a snapshot labelled < s.
    """
    cfg = ctx.config.rollback
    cause = decision.cause
    if cause.data.get("trial_refuted"):
        held, ctx.lr_trial_held = ctx.lr_trial_held, None
        if cause.data.get("restart") and held is not None:
            ctx.announce = "the stalled state put back (the restart from the run's start did not bear out)"
        return _put_back_held(ctx, held, "trial")
    if cause.kind == LOSS_LEVEL_RETURN:
        held, ctx.shift_held = ctx.shift_held, None
        return _put_back_held(ctx, held, "level shift")
    start = cause.data.get("restart_from")  # (a restart from the run's start: vanishing_gradient's trial)
    restart = isinstance(start, int)
    if isinstance(start, int):
        target = start
    elif cause.before_update:
        target = ctx.step - 1
    else:
        target = cause.step if cause.step is not None else ctx.step
    snap = ctx.snapshots.latest_before(target) if ctx.snapshots is not None else None
    trial = bool(cause.data.get("trial"))
    why_not = (_refuted(ctx) or _cannot_hold(ctx, snap, restart=restart)) if trial else None
    if why_not is not None:
        return {"restored": False, "reason": why_not}
    ctx.skip = True
    if snap is None:
        have = ctx.snapshots.labels if ctx.snapshots is not None else []
        return {
            "restored": False,
            "skipped_step": ctx.step,
            "reason": f"no snapshot at or before step {target} (snapshots held: {have})",
        }
    label, state = snap
    assert ctx.snapshots is not None  # snap came from it
    # (a trial: the state left is held, with the snapshots taken out, until the loss says)
    live = (
        capture_state(ctx.model, ctx.optimizer, ctx.scaler, ctx.with_outside_params({}), rng=False) if trial else None
    )
    _restore_snapshot(ctx, state, rng=cfg.restore_rng)
    if ctx.shift_held is not None and label < ctx.shift_held["at"]:
        ctx.shift_held = None  # (a state from before the shift: a later put-back would jump forward)
    popped = ctx.snapshots.pop_after(label)
    if live is not None:
        ctx.lr_trial_held = {"at": ctx.step, "state": live, "popped": popped, "bytes": tree_nbytes(live)}
    if restart:  # (from the run's start the loss and the gradients are another regime; the LR, not
        # the data, was the trouble: no batch is left out)
        ctx.announce = f"a restart from the run's start (step {label}) with an LR warm-up, a trial"
    else:
        ctx.batches_to_skip += cfg.skip_batches
    return {
        "restored": True,
        "restored_from": label,
        "steps_back": ctx.step - label,
        "skipped_step": ctx.step,
        "batches_to_skip": ctx.batches_to_skip,
        **({"trial": True, "held_bytes": tree_nbytes(live)} if live is not None else {}),
        **({"restart": True} if restart else {}),
    }


def _cannot_hold(ctx: ActionContext, snap: tuple[int, dict[str, Any]] | None, restart: bool = False) -> str | None:
    """Why a trial rolls back on no rank (its drop goes on alone; a ``restart``'s does not go on),
    else None: a rank holds no snapshot from before the growth (of the run's start), or has no room
    beside its snapshots to hold the state it would leave (one as large as the snapshot) within
    ``actions.rollback.max_host_mb``. Every rank answers the same (one max collective: the ranks'
    rings may differ, ZeRO's shards in size)."""
    ring = ctx.snapshots
    full = snap is not None and ctx.no_room_to_hold(tree_nbytes(snap[1]))
    mine = torch.tensor(2.0 if snap is None else 1.0 if full else 0.0, dtype=torch.float64)
    why = float(sharding.max_over_ranks(mine))
    then = "no restart, the fade is told" if restart else "the trial drops the LR alone"
    if why >= 2.0:
        return f"no snapshot from before the {'run' if restart else 'growth'} (on some rank): {then}"
    if why >= 1.0:
        held = f"{ring.nbytes / 2**20:.1f} MiB here" if ring is not None else "none"
        return (
            f"no room under actions.rollback.max_host_mb (the snapshots hold {held}) to hold the state a trial "
            f"would put back, on some rank: {then}"
        )
    return None


def _put_back_held(ctx: ActionContext, held: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """Put back a state held on the host (``held``: ``at``, the step it was taken in, ``state``
    and, for a trial, ``popped``). A refuted trial (``judge_trial``): the state its rollback left,
    and the snapshots that rollback took out of the ring. A level shift that ended
    (``loss_level_return``): the state the shift's step started from, and ``monitor.batches()``
    yields this step's batch again (its gradients came from the state left; the batch is good).
    The snapshots taken since, of the abandoned steps, go; this step's update is skipped."""
    ctx.skip = True
    if held is None:
        return {"restored": False, "skipped_step": ctx.step, "reason": f"no state held for the {what}"}
    _restore_snapshot(ctx, held["state"], rng=False)
    scaler = ctx.scaler
    if scaler is not None and getattr(scaler, "_scale", None) is not None:
        # (the scaler as held, after this skipped step's update() too: it would count a step)
        ctx.scaler_restore = [scaler._scale.clone(), scaler._growth_tracker.clone()]
    if ctx.snapshots is not None:
        ctx.snapshots.discard_after(held["at"])
        ctx.snapshots.put_back(held.get("popped", []))
    if held.get("repeat_batch"):
        ctx.repeat_batch = True
    return {
        "restored": True,
        "restored_from": held["at"],
        "steps_back": ctx.step - held["at"],
        "skipped_step": ctx.step,
    }


def hold_before_shift(ctx: ActionContext, step: int) -> dict[str, Any]:
    """A level shift of the loss at ``step`` (``loss_level_shift`` that may end: its data
    ``returnable``): hold the state this step starts from (``ctx.shift_held``, CPU copies as a
    snapshot; the buffers as they were before this step's forward, whose batch is the shift's),
    to be put back should the shift end (``loss_level_return``). Held beside the snapshots within
    ``actions.rollback.max_host_mb``, and only with rollback snapshots on; every rank answers the
    same (one max collective). Returns the facts: ``held`` and its bytes, or why not."""
    ring = ctx.snapshots
    if ring is None:
        return {"held": False, "reason": "no rollback snapshots: nothing is held to put back"}
    state = capture_state(ctx.model, ctx.optimizer, ctx.scaler, ctx.with_outside_params({}), rng=False)
    copy = ctx.buffer_copy()
    if copy is not None and copy[0].label == step - 1:
        names = {id(b): name for name, b in ctx.model.named_buffers()}
        for live, before in zip(copy[1], copy[0].buffers_before_forward()):
            kept = state[MODEL].get(names.get(id(live)))
            if isinstance(kept, torch.Tensor) and kept.shape == before.shape:
                kept.copy_(before)
    size = tree_nbytes(state)
    full = ctx.no_room_to_hold(size)
    if float(sharding.max_over_ranks(torch.tensor(float(full), dtype=torch.float64))) > 0:
        return {
            "held": False,
            "reason": f"no room under actions.rollback.max_host_mb beside the snapshots ({ring.nbytes / 2**20:.1f} "
            "MiB here), on some rank: nothing is held to put back",
        }
    ctx.shift_held = {"at": step, "state": state, "repeat_batch": True, "bytes": size}
    return {"held": True, "held_bytes": size}


# --------------------------------------------------------------------------------------------
# precision_fallback
# --------------------------------------------------------------------------------------------


@register_action(PRECISION_FALLBACK, order=50, budgeted=True)
def precision_fallback(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Run the module named by ``decision.params['module']`` or the finding's ``where`` in fp32 from
    now on (``watch.precision_fallback``: autocast off inside it, inputs upcast, outputs cast back to
    the caller's autocast dtype; the proving ground: fp32 fusion attention is what holds). Undone by
    ``remove_precision_fallback``."""
    from .watch import precision_fallback as fp32_module

    name = decision.params.get("module") or decision.cause.where
    if not name:
        return {"applied": False, "reason": "the finding names no module to run in fp32"}
    if name in ctx.fp32_modules:
        return {"applied": False, "module": name, "reason": "already running in fp32"}
    try:
        handle = fp32_module(ctx.model, name)
    except ValueError as e:  # no such module, or its parameters are not fp32
        return {"applied": False, "module": name, "reason": str(e)}
    ctx.hooks.append(handle)
    ctx.fp32_modules.append(name)
    return {"applied": True, "module": name}


def remove_precision_fallback(ctx: ActionContext) -> None:
    """Undo every fallback (the monitor calls this on detach)."""
    for h in ctx.hooks:
        h.remove()
    ctx.hooks.clear()
    ctx.fp32_modules.clear()


# --------------------------------------------------------------------------------------------
# grad_noise
# --------------------------------------------------------------------------------------------


def grad_noise_std(epoch: int, eta: float = 0.3, gamma: float = 0.55) -> float:
    """std = eta / (1 + epoch)^gamma (the report's formula)."""
    return eta / (1.0 + epoch) ** gamma


@register_action(GRAD_NOISE, order=80, config=GradNoiseConfig)
def grad_noise(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Add Gaussian noise to every gradient, from a generator kept apart from the training RNG."""
    cfg = ctx.config.grad_noise
    epoch = int(decision.params.get("epoch", ctx.epoch))
    std = grad_noise_std(epoch, cfg.eta, cfg.gamma)
    if ctx._noise_gen is None:
        ctx._noise_gen = torch.Generator().manual_seed(cfg.seed)
    grads = [p.grad for ps in ctx.params_with_grad().values() for p in ps if p.grad is not None]
    grads, noise = sharding.gaussian_noise(grads, ctx._noise_gen)  # FSDP2: each rank's own shards
    if grads:
        torch._foreach_add_(grads, noise, alpha=std)
    return {"std": std, "epoch": epoch, "tensors": len(grads)}


# --------------------------------------------------------------------------------------------
# stop
# --------------------------------------------------------------------------------------------


@register_action(STOP, order=90, config=StopConfig)
def stop(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Save a checkpoint (unless one was saved this step), set ``ctx.should_stop``, and raise
    ``StopTraining`` with the reason; causes in ``graceful_kinds`` (plateau) only set the flag.
    The raised error has ``.facts`` for the event."""
    cfg = ctx.config.stop
    cause = decision.cause
    facts: dict[str, Any] = {"reason": decision.params.get("reason") or cause.message, "kind": cause.kind}
    if cfg.save_checkpoint and ctx.last_checkpoint_step != ctx.step:
        facts["checkpoint"] = checkpoint(ctx, decision)
    elif ctx.last_checkpoint_step == ctx.step:
        facts["checkpoint"] = {"saved": True, "path": ctx.last_checkpoint}
    ctx.should_stop = True
    if cause.kind in cfg.graceful_kinds:
        facts["graceful"] = True
        return facts
    ctx.stopped = True  # later steps are skipped without new checkpoints or events
    ctx.skip = True
    # The run ends in its last healthy state, as the checkpoint holds it: the loop's own code after
    # training (a final save, an evaluation) must not meet the damage (a probe: a held-out loss of
    # 1.2e4 left in the model while the checkpoint held the healthy weights).
    snap = _last_good_snapshot(ctx, cause)
    if snap is not None:
        _restore_snapshot(ctx, snap[1], rng=False)
        facts["restored_from"] = snap[0]
    if ctx.graceful_stop:  # the loop draws from monitor.batches(): it ends there, cleanly
        facts["graceful"] = True
        return facts
    saved = facts.get("checkpoint", {})
    where = saved.get("path") if saved.get("saved") else None
    raise StopTraining(
        f"sfmonitor stopped training at step {ctx.step}: {facts['reason']} "
        f"(cause: {cause.kind}: {cause.message})" + (f"; last good state saved to {where}" if where else ""),
        facts=facts,
    )


# --------------------------------------------------------------------------------------------
# GradScaler floor (a standing setting, not an action)
# --------------------------------------------------------------------------------------------


def keep_loss_scale_floor(scaler: Any, min_scale: float) -> bool:
    """Keep a GradScaler's scale >= ``min_scale`` (an in-place clamp on the device: no host read).
    Returns False when there is nothing to clamp yet (no scaler, disabled, or never used)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return False
    scale = getattr(scaler, "_scale", None)
    if scale is None:  # not used yet: the first scale() call sets init_scale
        return False
    scale.clamp_(min=min_scale)
    return True


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def apply(ctx: ActionContext, decision: Decision) -> dict[str, Any]:
    """Carry out one decision; returns JSON-able facts for its event. ``stop`` raises StopTraining."""
    spec = ACTIONS.get(decision.action)
    if spec is None:
        raise ConfigError(f"unknown action {decision.action!r}; allowed: {', '.join(ACTIONS)}")
    return spec.fn(ctx, decision)
