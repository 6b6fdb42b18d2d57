"""Detectors: read one step's statistics (plain floats) and return findings. They never touch the
model, the optimizer or the loss; only ``actions.py`` does.

Every detector is registered (``registry.register_detector``: its name, config section and the
kinds it reports with their default ladders) and has ``kind`` (an event kind), ``after_update``
(True: it judges an update that already landed, and the monitor calls it with the previous step's
complete statistics),
``check(step, stats) -> list[Finding]``, ``observe_eval(step, metrics, chance) -> list[Finding]``
(evaluation-driven detectors), and ``state_dict()`` / ``load_state_dict()`` holding only plain
numbers, lists and dicts.

Windows are ``collections.deque(maxlen=...)``. A non-finite value never enters a window, and
neither does a spike: the value that crossed the threshold is clamped to the threshold before it
is added (as ZClip does), so a run that genuinely moves to a new level is followed, slowly, while
a spike cannot inflate the statistics that judge the next step.

Statistic keys read (listed in stats.py): ``loss/total``, ``loss/<c>``, ``grad_norm/total``,
``grad_norm/<group>``, ``update_ratio/<group>``, ``loss_ratio/<a>/<b>``, ``grad_ratio/<a>/<b>``,
``amp/loss_scale``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from . import stats as S
from .events import (
    ACCURACY_COLLAPSE,
    ACCURACY_DROP,
    ADAM_EPS,
    BN_VAR_SHIFT,
    BN_VAR_SPIKE,
    CLIP,
    DEAD_UNITS,
    GRAD_RATIO_IMBALANCE,
    GRAD_SPIKE,
    LARGE_UPDATE,
    LOSS_COMPONENT_SPIKE,
    LOSS_DIVERGENCE,
    LOSS_LEVEL_RETURN,
    LOSS_LEVEL_SHIFT,
    LOSS_RATIO_IMBALANCE,
    LOSS_SCALE_FLOOR,
    LOSS_SPIKE,
    LR_DROP,
    PLATEAU,
    REWEIGHT,
    ROLLBACK,
    SKIP_STEP,
    STALE_UPDATE,
    UNDO,
    UPDATE_RATIO_SPIKE,
    VANISHING_GRADIENT,
    ConfigError,
    Finding,
)
from .registry import DETECTORS, register_detector
from .schema import Section, SectionTable, option

__all__ = [
    "AccuracyCollapse",
    "AccuracyCollapseConfig",
    "AdamEps",
    "AdamEpsConfig",
    "DeadUnits",
    "DeadUnitsConfig",
    "Detector",
    "DetectorsConfig",
    "GradRatioImbalance",
    "GradSpike",
    "GradSpikeConfig",
    "LossRatioImbalance",
    "LossScaleFloor",
    "LossScaleFloorConfig",
    "LossSpike",
    "LossSpikeConfig",
    "Plateau",
    "PlateauConfig",
    "RatioImbalanceConfig",
    "StaleUpdate",
    "StaleUpdateConfig",
    "UpdateRatioSpike",
    "UpdateRatioSpikeConfig",
    "VanishingGradient",
    "VanishingGradientConfig",
    "build_detectors",
]

# Statistic keys and prefixes read here (defined once, in stats.py).
LOSS_PREFIX = S.LOSS.format("")
GRAD_NORM_PREFIX = S.GRAD_NORM.format("")
UPDATE_RATIO_PREFIX = S.UPDATE_RATIO.format("")
BLOCK_GRAD_NORM_PREFIX = S.BLOCK_GRAD_NORM.format("")
BLOCK_UPDATE_RATIO_PREFIX = S.BLOCK_UPDATE_RATIO.format("")
WEIGHT_PREFIX = S.LOSS_WEIGHT.format("")
UPDATE_STALE_PREFIX = S.UPDATE_STALE.format("")
DEAD_UNITS_PREFIX = S.DEAD_UNITS.format("")
ADAM_EPS_PREFIX = S.ADAM_EPS.format("")
BN_VAR_RATIO_PREFIX = S.BN_VAR_RATIO.format("")
LOSS_RATIO_PREFIX = S.LOSS_RATIO.format("", "")[:-1]
GRAD_RATIO_PREFIX = S.GRAD_RATIO.format("", "")[:-1]
LOSS_TOTAL, GRAD_NORM_TOTAL, LOSS_SCALE, RATIO_EPS = S.LOSS_TOTAL, S.GRAD_NORM_TOTAL, S.AMP_LOSS_SCALE, S.RATIO_EPS

MAD_TO_SIGMA = 1.4826  # sigma of a normal distribution = 1.4826 * median absolute deviation


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


def _at_most(section: Section, name: str, limit: str) -> None:
    """A config check: option ``name`` may not exceed option ``limit`` of the same section."""
    value, bound = getattr(section, name), getattr(section, limit)
    if value > bound:
        p = section._prefix
        raise ConfigError(f"{p}{name}: {value} exceeds {p}{limit} ({bound}); allowed: [2, {limit}]")


@dataclass
class LossSpikeConfig(Section):
    """Loss spike: log(loss) far above its robust rolling level (median and MAD of a window)."""

    enabled: bool = option(True, "watch loss/total")
    components: bool = option(True, "also watch each component loss/<c> given to combine()")
    window: int = option(128, "rolling window in steps (OLMo-core stability monitor: 128 steps)", lo=8)
    z: float = option(6.0, "fire above median + z * sigma of log(loss) (OLMo-core: 6 sigma)", lo=0, lo_open=True)
    warmup: int = option(
        25,
        "values judged against the level (from the prior_after-th on) before the tight test (ZClip: 25 "
        "warm-up steps); the prior judges before",
        lo=2,
    )
    min_sigma: float = option(
        0.01,
        "floor on sigma of log(loss): a jump under z*min_sigma (6%) is never a spike, however flat the curve",
        lo=0,
    )
    recent: int = option(
        16, "the level a loss is compared to: the median of this many latest values (a falling loss is followed)", lo=1
    )
    prior_after: int = option(3, "finite values after which the prior test judges, until the warm-up is over", lo=2)
    early_factor: float = option(
        100.0,
        "before the prior judges: a loss this many times the largest so far is a spike (a healthy early "
        "step does not raise the loss 100x; under Adam one step on a 1e4x loss swamps the second moment "
        "and stalls the updates for thousands of steps)",
        lo=1,
        lo_open=True,
    )
    prior_sigma: float = option(
        0.1,
        "floor on sigma of log(loss) during the warm-up: with z = 6, a loss 1.8x the median of the values "
        "so far (a healthy early loss falls; a jump that size is a fault)",
        lo=0,
        lo_open=True,
    )

    min_setback: float = option(
        0.05,
        "a jump must also give back at least this share of the progress the loss made since its start "
        "(value - expected >= min_setback * (start - expected)): near a loss floor, where a converged "
        "toy's loss jumps 10-20x from 0.01, a jump that small against the start is noise. 0: off; a "
        "loss that has not fallen below its start is judged by z alone",
        lo=0,
        hi=1,
    )

    shift_after: int = option(
        8,
        "a loss that jumps and stays: once this many spikes in a row agree on a level (their spread "
        "in log under their jump), the next value at that level is a level shift (the data or the task "
        "changed: event loss_level_shift, no action), and the detector follows the new level. 0: never "
        "(a level is only followed through the clamped values, ~20-30 steps)",
        lo=0,
    )
    return_within: int = option(
        64,
        "a level shift of loss/total that ends this soon: the loss falls back in one step by more than half "
        "the shift's jump, to nearer its level before than the shift's (event loss_level_return), and the "
        "steps trained at the shifted level were a stretch of bad batches longer than shift_after (a "
        "corrupted shard): the state from before the shift, held on the host meanwhile, is put back. 0: "
        "never (nothing held)",
        lo=0,
    )

    def validate(self) -> None:
        _at_most(self, "warmup", "window")
        _at_most(self, "prior_after", "warmup")


@dataclass
class GradSpikeConfig(Section):
    """Gradient spike: ZClip-style EMA z-score of log(grad_norm/total)."""

    enabled: bool = option(True, "watch grad_norm/total")
    groups: bool = option(False, "also watch each grad_norm/<group>")
    alpha: float = option(0.97, "EMA decay of mean and variance (ZClip: alpha = 0.97)", lo=0, hi=1, lo_open=True)
    z: float = option(
        6.0,
        "fire above z EMA standard deviations. ZClip's z = 2.5 is a clipping "
        "threshold applied every step (actions.clip.zclip_z); as an alarm it would "
        "fire on ~0.6% of healthy steps, so the alarm uses OLMo-core's 6 sigma",
        lo=0,
        lo_open=True,
    )
    warmup: int = option(
        25, "finite values averaged before the EMA test (ZClip: 25 warm-up steps); the prior judges before", lo=2
    )
    min_sigma: float = option(0.01, "floor on the EMA sigma of log(grad norm): a 6% move is never a spike", lo=0)
    prior_after: int = option(3, "finite values after which the prior test judges, until the warm-up is over", lo=2)
    prior_sigma: float = option(
        0.5,
        "floor on sigma of log(grad norm) during the warm-up: with z = 6, a norm 20x the mean (in log) of the "
        "values so far (early gradient norms move by several times in healthy runs)",
        lo=0,
        lo_open=True,
    )

    def validate(self) -> None:
        _at_most(self, "prior_after", "warmup")


@dataclass
class UpdateRatioSpikeConfig(Section):
    """Update spike: update_ratio/<group> = |dtheta|/|theta| far above its rolling median."""

    enabled: bool = option(True, "watch update_ratio/<group> (judged one step later: after_update)")
    window: int = option(128, "rolling window in steps (as the loss window, OLMo-core: 128)", lo=8)
    factor: float = option(10.0, "fire above factor * rolling median (an order of magnitude)", lo=1, lo_open=True)
    ceiling: float = option(
        1.0,
        "fire above this ratio from the first step, whatever the history: one update larger than the group's "
        "own weights. Healthy ratios are ~1e-3 (and ~lr / rms(weight) on Adam's first step: 0.05 for a GPT at its "
        "usual LR); a GPT at 20x its LR starts at 1.0 and spikes a few steps later. Groups whose parameters "
        "start at zero (LoRA B, zero-initialised biases) are exempt. Where the user's schedule has just taken "
        "the LR back up to a level the group's updates were made at before (a warm restart: at least 2x its "
        "lowest LR of the last `warmup` updates, at most its highest so far), an update over it is undone "
        "for what it did to the loss, as the relative test's (harm_rise): a restart's first updates are "
        "large by design (SGD with momentum moved a small output layer by 1.13x its norm). So is a group's first "
        "update still over it when made at an LR the monitor lowered (the warm-up after its first updates were "
        "undone): weights far below their scale (std 1e-3 under SGD) move 17x themselves at a twentieth of the LR",
        lo=0,
        lo_open=True,
    )
    warmup: int = option(25, "values collected before the relative test (ZClip: 25 warm-up steps)", lo=2)
    min_ratio: float = option(
        1e-5,
        "an update under this fraction of the weights is never a relative spike (a model that memorised "
        "its data moves by ~1e-10 and wiggles 10x: nothing to undo)",
        lo=0,
    )
    harm_rise: float = option(
        1.5,
        "a relative spike is undone only when the loss measured after it (the next step's) is non-finite "
        "or over this many times the loss before it; else it is told (large_update): an update that did not "
        "raise the loss did no harm to undo (a model relearning after its data changed makes large updates "
        "that lower the loss). 0: always undo. The ceiling needs no such evidence",
        lo=0,
    )
    harm_noise: float = option(
        6.0,
        "the rise must also pass exp(harm_noise x the median of |log(loss after / loss before)| over the "
        "sound updates landed so far) (once warmup of them are seen; for normal noise 6 medians are ~4 "
        "sigma): on batch-8 classification one batch's loss is often 2-3x the next one's, so a 1.5x rise "
        "is not the update's doing. 0: off",
        lo=0,
    )
    harm_rise_max: float = option(
        4.0,
        "the noise never asks for more than this: a loss over 4x the one before it, right after an update "
        "10x its usual size, is harm however noisy the run (a diverging SGD run's own swings would "
        "otherwise hide it: its loss moves 3-100x from batch to batch)",
        lo=1,
    )
    harm_setback: float = option(
        0.05,
        "the rise must also give back at least this share of the progress the loss made since its start "
        "(after - before >= harm_setback * (start - before), start: the largest of its first 3 values), as "
        "loss_spike.min_setback: near a loss floor one batch's loss is 10x the next's by chance (SGD on "
        "imbalanced classes at loss 1e-3). 0: off",
        lo=0,
        hi=1,
    )

    raise_setback: float = option(
        0.25,
        "a raise's later updates are also judged against the loss's level before the raise (the median "
        "of the last 5 losses at the usual LR), once its first ones were accepted: harm where the loss "
        "after one is over the rise test's factor x that level and gives back at least this share of the "
        "progress since the start (a 300x schedule bug took a batch-16 classifier from 0.3 to 1.6-3.5, past "
        "its start: each step's rise within the noise; a deliberate x30 raise on a converged CNN took its "
        "loss from 0.011 to 0.085, 5% of the progress, and recovered alone: undone at 5%, 12x its bare "
        "run's held-out loss). 0: judged by harm_setback as one step's rise",
        lo=0,
        hi=1,
    )

    relearn_after: int = option(
        8,
        "this many large_update findings of a group in a row (updates past the relative test that did "
        "no harm: the group's usual update size changed) and its window restarts from them, as the "
        "loss's after a level shift; without it the group was told on every step until the clamped values "
        "fed to its window moved the median (78 times in a top-1 mixture-of-experts run). 0: never",
        lo=0,
    )

    lr_excursion: float = option(
        2.0,
        "an update made at an LR at least this many times both the highest LR of the group's last `warmup` "
        "updates and the user's LR of the step after it (a one-step excursion: an LR set by hand for one "
        "step, a scheduler bug) is judged against the update the schedule's LR (the higher of the LRs of the "
        "update before it and of the step after it) would have made, and a spike it made is answered by its "
        "undo alone, never counting towards an LR drop: its cause, that one step's LR, is gone with the step,"
        " and a drop lowers the schedule, which was not the trouble (two excursions 15 steps apart cut an SGD"
        " MLP's LR to 0.2x for 300 steps: held-out loss 2.0-2.2x its twin's; undone alone, 1.01x). Its LR is "
        "no level of the schedule (no warm restart is judged against it). 0: off",
        lo=0,
    )

    def validate(self) -> None:
        _at_most(self, "warmup", "window")
        if 0 < self.lr_excursion <= 1:
            raise ConfigError(
                f"{self._prefix}lr_excursion: {self.lr_excursion:g} must be above 1 (an LR above the "
                "schedule's), or 0 to judge every update at its own LR"
            )


@dataclass
class RatioImbalanceConfig(Section):
    """A ratio a/b of two loss components (or of their gradients on shared parameters) above a
    threshold. Fires when the ratio crosses the threshold, again every ``refire_every`` steps while
    it stays above, and re-arms once the ratio falls under ``rearm_below * threshold``."""

    enabled: bool = option(True, "watch the configured pairs")
    pairs: list[list[str]] = option(
        [],
        "component pairs [a, b] watched as a/b; none by default, "
        "so a healthy run at defaults takes no action (the report's "
        "pair is [[vision, fusion]], set by the reference trainer)",
    )
    threshold: float = option(
        2.0,
        "fire when a/b exceeds this (the report: L_v/L_f > 2, and its second trap: |dL_v/dtheta| > 2 |dL_f/dtheta|)",
        lo=1,
        lo_open=True,
    )
    patience: int = option(1, "consecutive observations above the threshold before firing", lo=1)
    refire_every: int = option(100, "steps between findings while the imbalance persists", lo=1)
    rearm_below: float = option(0.9, "re-arm once a/b < rearm_below * threshold (hysteresis)", lo=0, hi=1, lo_open=True)

    def validate(self) -> None:
        for i, pair in enumerate(self.pairs):
            if len(pair) != 2 or pair[0] == pair[1] or not all(pair):
                raise ConfigError(f"{self._prefix}pairs[{i}]: expected two different component names, got {pair!r}")


@dataclass
class LossScaleFloorConfig(Section):
    """The GradScaler's scale reached the floor: fp16 gradients keep overflowing."""

    enabled: bool = option(True, "watch amp/loss_scale")
    min_loss_scale: float = option(
        512.0, "floor (the report's mixed-precision settings: min_loss_scale 512)", lo=0, lo_open=True
    )


@dataclass
class AccuracyCollapseConfig(Section):
    """Validation accuracy back at chance after having been clearly above it (the report's sign of
    gradient explosion)."""

    enabled: bool = option(True, "watch the accuracy given to observe_eval()")
    metric: str = option("accuracy", "metric name in observe_eval(metrics)")
    chance: float | None = option(None, "chance level when observe_eval() gives none (None: skip the check)")
    above_margin: float = option(
        0.1,
        "'clearly above chance': accuracy >= chance + this, in the metric's own units",
        lo=0,
        lo_open=True,
    )
    collapse_margin: float = option(0.02, "'at chance': accuracy <= chance + this", lo=0)
    samples: int | None = option(
        None,
        "examples each accuracy is measured on (the validation set's size). With it, 'clearly above "
        "chance' also needs `z` binomial standard errors of chance: on a small validation set a lucky "
        "reading is no climb, and the unlucky one after it no collapse (None: the margins alone)",
        lo=1,
    )
    z: float = option(3.0, "standard errors that 'clearly above chance' needs when `samples` is given", lo=0)
    train_loss_rise: float = option(
        1.5,
        "where the monitor sees the training loss (combine()), a collapse also needs it risen: the median "
        "of its last `loss_window` values (non-finite ones count as infinite) at least this many times "
        "their median when the accuracy was last clearly above chance; else `accuracy_drop`, an event: a "
        "small validation set's wobble (64 examples: 0.63 -> 0.52) was rolled back and the LR cut on a "
        "healthy run. 0: the report's rule alone",
        lo=0,
    )
    loss_window: int = option(20, "training losses whose median `train_loss_rise` reads", lo=1)

    def validate(self) -> None:
        if self.collapse_margin >= self.above_margin:
            raise ConfigError(
                f"{self._prefix}collapse_margin: {self.collapse_margin} must be below "
                f"{self._prefix}above_margin ({self.above_margin})"
            )


@dataclass
class LossDivergenceConfig(Section):
    """A training loss that grows step after step, short of any spike: an LR past the edge of
    stability whose oscillation grows a few percent a step (SGD with momentum at 0.03 on a linear
    regression whose inputs hold 1% outliers went from loss 0.66 to 1e10 over 300 steps). The spike
    tests' windows follow such a growth, so each step looks like the last. The median of the last
    ``window`` losses ``growth`` x the median ``window`` steps before, ``spans`` times in a row,
    ``factor`` x the run's lowest median, and ``min_setback`` of the progress from the start given
    back."""

    enabled: bool = option(True, "watch loss/total for a growth sustained over spans x window steps")
    window: int = option(20, "steps whose median loss is compared (the LR drop's halt_window)", lo=2)
    growth: float = option(
        1.5,
        "each of the last `spans` medians, window steps apart, this many times the one before it",
        lo=1,
        lo_open=True,
    )
    spans: int = option(
        3,
        "consecutive spans of growth (a loss that jumps to a new level and stays grows over one span, or "
        "two where one window holds both levels: a change of data)",
        lo=1,
    )
    factor: float = option(
        10.0,
        "and the median this many times the run's lowest median (an order of magnitude)",
        lo=1,
        lo_open=True,
    )
    z: float = option(
        3.0,
        "each span's growth also this many standard errors of a difference of two medians, from the run's "
        "batch-to-batch noise (the median absolute difference of successive log-losses): a median of 20 "
        "batch losses swings by chance, by several times where single batches swing 3-100x (batch 1, heavy "
        "tails; measured on log-normal noise of sigma 1.5 without it: a finding in 16 of 20 runs of 5000 steps)",
        lo=0,
    )
    min_setback: float = option(
        0.05,
        "and the growth gives back at least this share of the progress since the start (the first median: "
        "median - lowest >= min_setback * (start - lowest)), as loss_spike.min_setback: a model memorising "
        "random targets took its loss from 1 to 3.5e-6 and wobbled back 100x, 0.03% of it (a trial, on a "
        "healthy run). 0: off",
        lo=0,
        hi=1,
    )


@dataclass
class PlateauConfig(Section):
    """Improved early stopping (the report): after ``patience`` validations without improvement,
    a plateau finding (occurrence 1: drop the LR); after ``grace`` more without improvement, a second
    one (occurrence 2: stop). An improvement resets both."""

    enabled: bool = option(True, "watch the metric given to observe_eval()")
    metric: str = option("loss", "metric name in observe_eval(metrics)")
    mode: str = option("min", "'min': lower is better; 'max': higher is better", choices=("min", "max"))
    patience: int = option(3, "validations without improvement before the LR drop (the report: 3)", lo=1)
    grace: int = option(2, "further validations (the report: 2 more epochs) before stopping", lo=1)
    min_delta: float = option(0.0, "an improvement must beat the best by more than this", lo=0)


@dataclass
class VanishingGradientConfig(Section):
    """Gradients that fade through a stack of like layers (Hochreiter 1991; Bengio et al. 1994; a
    post-LN transformer without warm-up, Liu et al. 2020): the first layer's gradient norm a small
    fraction of the last one's, step after step. Told; early in a run at an LR that never rose, once
    the loss stalls, answered by a restart from the run's start with a warm-up (a trial); with a
    loss that trained and collapsed, by a rollback to before the rise and an LR drop (a trial)."""

    enabled: bool = option(True, "watch stacks of like groups (the same parameter shapes, in model order)")
    ratio: float = option(
        0.01,
        "tell when the first group's gradient norm is under this fraction of the last one's (median of "
        "`window` steps); measured: fading or stalled runs 3e-11 to 9e-3, healthy runs >= 0.04 but for deep "
        "tanh MLPs under SGD that train slowly (0.013-0.06) (docs/benchmarks.md)",
        lo=0,
        hi=1,
        lo_open=True,
    )
    window: int = option(20, "steps whose median is judged", lo=1)
    start: int = option(20, "optimizer steps before the first judgement (a default init's first steps fade)", lo=0)
    min_layers: int = option(3, "the fewest like groups in a row that make a stack", lo=2)
    restart_within: int = option(
        150,
        "a fade seen within this many optimizer steps of the run's first, at an LR that never rose (neither the "
        "user's schedule, a warm-up, nor the monitor's scale), once the loss stalls (restart_stall), is answered by a "
        "trial, once per run: back to the snapshot of the run's start (actions.rollback) and an LR warm-up from there "
        "(actions.lr_drop.warmup_scale over warmup_steps). A post-LN transformer at an LR too high for its start "
        "stalls at the unigram loss, its first blocks' gradients faded, and only a warm-up from the start mends it "
        "(Xiong et al. 2020; Liu et al. 2020); an LR drop later does not. The trial is judged once it has made as many "
        "steps as the run had (at least 0.7 x warmup_steps, when the warm-up's LR is back at 0.4x; at most "
        "warmup_steps - 1): its median loss of the last "
        "halt_window steps under the stall's by restart_margin of the progress the run made before it, the restart "
        "stands; else the stalled state and the LR are put back (the steps of the trial are its cost). Without a "
        "snapshot of the run's start the fade is told only. 0: told only",
        lo=0,
    )
    restart_stall: float = option(
        0.02,
        "the loss has stalled when the median (in logs) of its last `window` values is less than this under the "
        "median of the `window` before (a post-LN stall: 0.5-1.5% over 20 steps; the run that escapes it "
        "falls faster)",
        lo=0,
        lo_open=True,
    )
    restart_update: float = option(
        0.02,
        "nor without an update of the run's first `window` to a stack's group at least this share of its weights: a "
        "warm-up makes the first updates smaller, and where they were small already (SGD on faded gradients: "
        "1e-4) it is not what the run lacks (post-LN stalls under Adam: their first updates 0.05-0.15 of the "
        "weights)",
        lo=0,
    )
    collapse_rise: float = option(
        1.1,
        "a fade that comes with a loss whose median (of `window` steps) rose this many times over its lowest, "
        "giving back at least collapse_setback of the progress from its first median, is a collapse of a run "
        "that trained (post-LN transformers at high LRs: 2.6 to 3.1-3.5 with their first blocks' gradients "
        "faded, 225-360 steps in): answered, once per run, by a trial as loss_divergence's: back to the newest "
        "snapshot from before the rise and the LR dropped (actions.lr_drop), judged halt_window steps later "
        "(0: told only)",
        lo=0,
    )
    collapse_setback: float = option(
        0.25, "the share of the progress a collapse gives back (collapse_rise)", lo=0, hi=1
    )
    restart_margin: float = option(
        0.1,
        "the restart's bar, as a share of the progress (in logs) the run made from its first losses to the stall: "
        "its median must end at least this far under the stall's (and 1% under it at least)",
        lo=0,
        lo_open=True,
        hi=1,
    )


@dataclass
class StaleUpdateConfig(Section):
    """Updates rounded away in bf16/fp16 weights (pure low-precision training: the weights and the
    optimizer's steps in bf16, no fp32 master copy): an update under half a unit in the last place
    of its weight leaves it unchanged. Told, no action."""

    enabled: bool = option(True, "watch the bf16/fp16 parameters (update_stale/total)")
    threshold: float = option(
        0.7,
        "tell when this share of the gradient mass fell on bf16/fp16 weights their updates left unchanged (median of "
        "`window` steps); measured (benchmarks/stale_updates.py, a char-level GPT with bf16 weights, the last 100 "
        "of 600 steps, docs/benchmarks.md): AdamW at LR 1e-4 0.70 (held-out loss 1.148x the fp32-weights run's), "
        "3e-4 0.39 (1.051x), 1e-3 0.23, 3e-3 0.17; SGD at LR 0.03 and 0.3 0.27 and 0.20",
        lo=0,
        hi=1,
        lo_open=True,
    )
    window: int = option(20, "steps whose median is judged", lo=1)
    start: int = option(20, "optimizer steps before the first judgement", lo=0)


@dataclass
class DeadUnitsConfig(Section):
    """Units whose gradients stay exactly zero (``dead_units/<group>``, sampled every
    ``stats.dead_units_every`` steps): ReLUs that no input switches on any more, after a too-high LR
    or a large negative bias (Lu et al. 2019, arXiv 1903.06733). Told, no action."""

    enabled: bool = option(True, "watch dead_units/<group>")
    threshold: float = option(
        0.5,
        "tell when a layer has this share of its units dead (gradient rows exactly zero on "
        "stats.dead_units_samples samples in a row after one that was not); again only after it fell under half of it",
        lo=0,
        hi=1,
        lo_open=True,
    )


@dataclass
class AdamEpsConfig(Section):
    """Adam's eps too large for the gradients (``adam_eps/<group>``, sampled every
    ``stats.adam_eps_every`` steps): where the bias-corrected sqrt(v) is under eps, eps sets the step
    (lr * m / eps, an SGD step at lr / eps, far under Adam's ~lr). Told, no action."""

    enabled: bool = option(True, "watch adam_eps/<group>")
    threshold: float = option(
        0.5,
        "tell when this share of a group's momentum (elements weighed by |m|) has sqrt(v) under eps; again only "
        "after it fell under half of it. Measured (an MLP, a char-level transformer, a CNN under AdamW, 300 steps, "
        "docs/benchmarks.md): at eps 1e-8 and 1e-6 0; eps 1e-2 0.54-0.93 (0.15-0.71 for the CNN; losses 2-7x those "
        "at 1e-8); the char-level transformer at eps 1e-3 0.08-0.52 (1.06x)",
        lo=0,
        hi=1,
        lo_open=True,
    )


@dataclass
class BnVarSpikeConfig(Section):
    """A batch far off the data's scale at a BatchNorm layer (``bn_var_ratio/<group>``): its loss
    and gradients look ordinary (BatchNorm normalises by the batch's own statistics in training),
    but the variance it writes into ``running_var`` is what evaluation normalises by."""

    enabled: bool = option(True, "watch bn_var_ratio/<group> (BatchNorm layers whose running statistics are on)")
    ratio: float = option(
        1e4,
        "skip the step when a batch's variance at a BatchNorm layer is this many times the running variance "
        "it is averaged into: inputs 100x their scale (pixels not divided by 255: 6.5e4x; inputs 1e3x: 1e6x, "
        "a BatchNorm ResNet's held-out loss 1.5-3.9x its twin's in a helper's probe). The skip puts the running "
        "statistics back. Healthy batches read ~1; heavy-tailed data reached a few hundred (1% of images 30x: "
        "100-300; raw log-normal features into a BatchNorm1d, before the geometric mean over channels: 1e4), "
        "which a threshold of 100 skipped",
        lo=1,
        lo_open=True,
    )
    warmup: int = option(
        25,
        "steps with the ratio measured before it is judged: running variances start at 1, and the first "
        "batches move them by orders of magnitude (unnormalised pixels: 1e4)",
        lo=0,
    )
    accept_after: int = option(
        8,
        "this many spikes in a row (each skipped, the statistics put back) and the data's scale changed for "
        "good: the next is told (bn_var_shift, no action) and trained on, and the warm-up starts again (as "
        "loss_spike.shift_after)",
        lo=1,
    )


class DetectorsConfig(SectionTable):
    """Every registered detector, one sub-section each (``detectors.<name>``): the built-ins below
    and any registered with ``registry.register_detector``."""

    @classmethod
    def table(cls) -> dict[str, type[Section]]:
        return {name: spec.config for name, spec in DETECTORS.items() if spec.config is not None}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _watched_keys(stats: Mapping[str, float], total: str, prefix: str, each: bool) -> list[str]:
    """The total's key alone, or with ``each`` every key under ``prefix`` (total included)."""
    if not each:
        return [total] if total in stats else []
    return [k for k in stats if k.startswith(prefix)]


def _mix(stats: Mapping[str, float], first: str | None) -> tuple[str, str | None]:
    """The step's set of loss components (combine() given a dict: their names joined by "+"; ""
    for a single loss) and the first set seen (this one where none was before)."""
    mix = "+".join(sorted(k[len(LOSS_PREFIX) :] for k in stats if k.startswith(LOSS_PREFIX) and k != LOSS_TOTAL))
    return mix, (mix if first is None and mix else first)


def _mix_slot(key: str, mix: str, first: str | None) -> str:
    """Where a statistic of the whole step (the total loss, the gradient norm) is judged: ``key``
    itself where the step's loss components are the first set seen (or none were given), else
    ``key|<names>``. A multi-task loop whose batches each carry one task's loss judges each task's
    steps against that task's."""
    return key if not mix or mix == first else f"{key}|{mix}"


def _grad_set(stats: Mapping[str, float], first: str | None) -> tuple[str, str | None]:
    """The step's groups with a gradient (a norm other than 0: their names joined by "+") and the
    first such set seen (this one where none was before). The total gradient norm of another set
    is another quantity: a frozen backbone unfrozen (``requires_grad_(True)``,
    ``add_param_group``) adds its gradients to the head's."""
    names = [
        k[len(GRAD_NORM_PREFIX) :]
        for k, v in stats.items()
        if k.startswith(GRAD_NORM_PREFIX) and k != GRAD_NORM_TOTAL and v != 0.0
    ]
    grads = "+".join(sorted(names))
    return grads, (grads if first is None and grads else first)


def _positive_logs(stats: Mapping[str, float], keys: list[str], raw: Collection[str] = ()):
    """(key, value, log value) of the finite, positive values: a NaN, an inf or a value <= 0 never
    enters a window (non-finite losses and gradients are the core's business). A ``raw`` key's
    finite values come as they are, any sign (a loss with no multiplicative scale)."""
    for key in keys:
        value = stats[key]
        if key in raw and S.finite(value):
            yield key, value, value
        elif S.finite(value) and value > 0:
            yield key, value, math.log(value)


def _name_mix(findings: list[Finding], mix: str, first: str | None, only: str | None = None) -> list[Finding]:
    """Say, in each finding judged in a window of its own set of loss components (``_mix_slot``;
    ``only``: the one key that is), which set that was."""
    if mix and mix != first:
        for f in findings:
            if only is None or f.data.get("key") == only:
                f.data["components"] = mix
                f.message += f" (judged among the steps whose loss components are {mix.replace('+', ', ')})"
    return findings


# A batch under this share of the usual one (an epoch's short last batch) is judged, widened, but
# kept out of the windows that say what is usual: its noise is not the run's.
PARTIAL_BATCH = 0.5


def _batch_widening(stats: Mapping[str, float]) -> tuple[float, bool]:
    """How much noisier than usual the step's batch makes its loss and gradient, 1 / sqrt(share)
    (``batch_share``: the monitor gives it where under 1), and whether it is a partial batch."""
    share = stats.get(S.BATCH_SHARE, 1.0)
    if not (0 < share < 1):
        return 1.0, False
    return 1.0 / math.sqrt(share), share < PARTIAL_BATCH


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _median_mad(values: list[float]) -> tuple[float, float]:
    med = _median(values)
    return med, _median([abs(v - med) for v in values])


def _gives_back(value: float, now: float, start: float, share: float) -> bool:
    """A rise from ``now`` to ``value`` gives back at least ``share`` of the progress a loss made
    from ``start`` down to ``now`` (a loss that never fell below its start made none: True).
    Near a loss floor relative noise grows; a jump that gives back little of what was learnt is
    that noise (loss_spike.min_setback, update_ratio_spike.harm_setback)."""
    return start <= now or value - now >= share * (start - now)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# --------------------------------------------------------------------------------------------
# Detectors
# --------------------------------------------------------------------------------------------


class Detector:
    """Base detector: finds nothing. A detector is any object with these members; subclass this one
    and override what you watch, then register the class (``registry.register_detector``) or pass
    an instance to ``Monitor(detectors=[...])``.

    name: its registry name (config section ``detectors.<name>``, key of its state in
    ``Monitor.state_dict()``). kind: the event kind it reports. after_update: True when it judges
    an update that already landed; the monitor then calls ``check`` with the previous step's
    complete statistics (update ratios included), one step later.
    """

    name: str = ""
    kind: str = ""
    after_update: bool = False

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        """Findings for optimizer step ``step`` from its statistics."""
        return []

    def observe_eval(self, step: int, metrics: Mapping[str, float], chance: float | None = None) -> list[Finding]:
        """Findings from a validation result taken at optimizer step ``step``."""
        return []

    def new_regime(self, step: int) -> None:
        """The data changed at optimizer step ``step`` (the loss moved to a new level and stayed:
        ``loss_level_shift``): forget what was usual before it. Optional; the monitor calls it on
        the detectors that have it."""

    def layout(self, groups: Mapping[str, list[tuple[int, ...]]]) -> None:
        """The model's groups in model order, each with its parameters' shapes (plain data): at
        attach, and again when the optimizer gains parameters. Optional; the monitor calls it on the
        detectors that have it."""

    def blocks(self, blocks: Mapping[str, list[tuple[int, ...]]]) -> list[str]:
        """The blocks of the ``ModuleList``/``Sequential`` lists inside one group (a BERT's encoder
        layers beside its embeddings and head), in model order, each with its parameters' shapes,
        called after ``layout``. Return the blocks the monitor is to measure for this detector
        (``block_grad_norm/<block>``, ``block_update_ratio/<block>``: two values a block and
        step); the base asks for none."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class _Windowed(Detector):
    """A detector holding one rolling window (deque of ``config.window`` values) per key."""

    def __init__(self, config: Any):
        self.config = config
        self.windows: dict[str, collections.deque[float]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"windows": {k: list(w) for k, w in self.windows.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.windows = {
            k: collections.deque((float(v) for v in w), maxlen=self.config.window)
            for k, w in state.get("windows", {}).items()
        }


class _Told(_Windowed):
    """A windowed detector that tells a condition once per key (``told``) until it clears."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.told: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "told": sorted(self.told)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.told = set(state.get("told", []))

    def reaches(self, key: str, value: float, threshold: float) -> bool:
        """Whether ``key`` is to be told now: ``value`` at or over ``threshold`` and not told since
        it last fell under half of it (which re-arms it)."""
        if key in self.told:
            if value < threshold / 2:
                self.told.discard(key)
            return False
        if value < threshold:
            return False
        self.told.add(key)
        return True


# A loss jump alone is most often the batch (a bad update shows as an update-ratio spike, undone
# there): skip the step. Three jumps each within 10 steps of the last are trouble that builds up:
# go back to the newest snapshot and lower the LR. A bad batch every N > 10 steps never escalates.
# A jump of one component while the total holds is told, not acted on: components trade off
# against each other (and the loss-ratio detector reweights them), so skipping steps or cutting
# the LR for one of them costs more than it saves; policy.ladders.loss_component_spike opts in.
@register_detector(
    "loss_spike",
    config=LossSpikeConfig,
    window=10,
    kinds={
        LOSS_SPIKE: [(1, [SKIP_STEP]), (3, [ROLLBACK, LR_DROP])],
        LOSS_COMPONENT_SPIKE: [(1, [])],
        LOSS_LEVEL_SHIFT: [(1, [])],
        # (the put-back of the state from before the shift is the finding's own, enforced: no ladder)
        LOSS_LEVEL_RETURN: [(1, [])],
    },
)
class LossSpike(_Windowed):
    """log(loss) above its expected value + z * max(noise, min_sigma).

    The expected value is the level, the median of the last ``recent`` finite values, corrected
    by the median of the detector's own past errors (value minus the level it had then); the noise
    is 1.4826 * MAD of those errors over the last ``window`` steps, or, where larger, their 95th
    percentile / 1.96 (heavy tails). Both follow a trend: the loss
    of a run that learns fast falls through the window, and the window's own median and MAD would
    lag behind it and take the fall for noise; a component that wanders is judged by how far it
    usually wanders from its recent level.

    A jump that passes the z test must also matter: give back at least ``min_setback`` of the
    progress since the loss's start (the largest of its first ``prior_after`` values). Relative
    noise grows as a loss nears its floor (a converged regression at 0.01 jumps to 0.2 and back):
    such a jump is a z-outlier in log space but a few percent of what was learnt, and acting on it
    would change a healthy run.

    A loss that jumps and stays is the data changing, not a batch: a new task, a curriculum's next
    stage, a new data mix. Once ``shift_after`` spikes in a row agree on a level (the spread of
    their logs under their jump above the expected value), the next value that agrees too is a
    level shift (kind ``loss_level_shift``, told, no action): the window starts afresh from the
    run's values and the loss's start is the new level. Spikes that disagree (a loss that climbs
    or swings) never form a level; the policy's ladder goes on judging them.

    A level shift of ``loss/total`` that ends within ``return_within`` steps, the loss falling back
    in one step by more than half the shift's jump to nearer its level before than the shift's,
    was a stretch of bad batches longer than ``shift_after`` (a corrupted shard, a run of random
    labels), not new data: kind ``loss_level_return``, the window before the first jump back. The
    monitor holds the state from before the shift's step meanwhile and puts it back. Only a shift
    above the loss's start is held (batches whose loss is worse than the untrained model's undo
    the progress made; a level below it is the run's own excursion, grokking's slingshots). A
    learnt new task comes down gradually, and a level that came back once is new data the next
    time it comes (alternating tasks): no state is held for it again.

    Watches ``loss/total`` (kind ``loss_spike``) and, with ``components``, every ``loss/<c>``
    (kind ``loss_component_spike``). A total loss seen below zero (a Gaussian or flow negative
    log-likelihood, a loss with a negative constant; a cross-entropy of exactly 0 is no such loss)
    has no multiplicative scale: from then on it
    is judged on its own scale (``raw``: the values themselves, the sigma floors times the progress
    the loss made), its window carried over; before, only its positive values entered a log window,
    and a batch with targets x20 (a loss of thousands against -0.7) was not judged. A component
    seen at or below zero is no longer judged. One finding per key that spikes or shifts.
    """

    kind = LOSS_SPIKE

    def __init__(self, config: LossSpikeConfig | None = None):
        super().__init__(config or LossSpikeConfig())
        self.errors: dict[str, collections.deque[float]] = {}  # key -> value minus the level it had
        self.start: dict[str, float] = {}  # key -> log of the loss at its start (the largest first value)
        self.run: dict[str, list[float]] = {}  # key -> logs of its spikes in a row, and the expected value
        self.signed: set[str] = set()  # components seen at or below zero: no log scale, not judged
        self.raw: set[str] = set()  # the total loss seen below zero: judged on its own scale
        self.shifted: dict[str, int] = {}  # key -> the step of its last level shift
        # loss/total's window and errors as they were when its spikes in a row began (what a level
        # shift that ends put back), the shift awaiting its end (return_within), and the levels
        # (logs) of the shifts that ended: a level that comes again is data, not a bad stretch
        self.before_run: dict[str, tuple[list[float], list[float]]] = {}
        self.pending: dict[str, dict[str, Any]] = {}
        self.returned: dict[str, list[float]] = {}
        # The components combine() was first given (names joined by "+"): a step given others (a
        # multi-task loop, each batch one task's loss) has a total of another kind, judged in a
        # window of its own ("loss/total|<names>"), not against the usual task's.
        self.mix: str | None = None

    def _keys(self, stats: Mapping[str, float]) -> list[str]:
        keys = _watched_keys(stats, LOSS_TOTAL, LOSS_PREFIX, self.config.components)
        for key in keys:
            value = stats[key]
            if key == LOSS_TOTAL and key not in self.raw and S.finite(value) and value < 0:
                self.raw.add(key)  # from logs to the values themselves, every set's window carried over
                for slot in {
                    k for k in [*self.windows, *self.start, *self.errors, *self.run] if k.split("|")[0] == key
                }:
                    if slot in self.windows:
                        self.windows[slot] = collections.deque(
                            map(math.exp, self.windows[slot]), maxlen=self.config.window
                        )
                    if slot in self.start:
                        self.start[slot] = math.exp(self.start[slot])
                    self.errors.pop(slot, None)
                    self.run.pop(slot, None)
            if key != LOSS_TOTAL and key not in self.signed and S.finite(value) and value <= 0:
                # A component that takes values at or below zero (a policy-gradient loss, a
                # negative log-likelihood under a learnt variance) has no multiplicative scale: its
                # log, judged on the positive values alone, calls each small positive one a jump.
                self.signed.add(key)
                for table in (self.windows, self.errors, self.start, self.run):
                    table.pop(key, None)
        return [k for k in keys if k not in self.signed]

    def _unscaled(self, key: str, x: float) -> float:
        return x if key in self.raw else math.exp(x)

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        out = []
        widen, partial = _batch_widening(stats)
        mix, self.mix = _mix(stats, self.mix)
        for key, value, x in _positive_logs(stats, self._keys(stats), self.raw):
            # the total of a step whose components are not the first set seen: a window per set
            slot = _mix_slot(key, mix, self.mix) if key == LOSS_TOTAL else key
            w = self.windows.setdefault(slot, collections.deque(maxlen=cfg.window))
            back = self._level_return(key, slot, x, step) if slot in self.pending else None
            if back is not None:
                out.append(back)
                continue
            if len(w) < cfg.prior_after:
                top = max(w, default=math.inf)
                early = (cfg.early_factor - 1) * abs(top) if key in self.raw else math.log(cfg.early_factor)
                if x - top > early:  # kept out of the window: not a start
                    out.append(self._finding(key, value, step, top, top, top + early))
                else:
                    w.append(x)
                continue
            if slot not in self.start:
                self.start[slot] = max(w)
            errors = self.errors.setdefault(slot, collections.deque(maxlen=cfg.window))
            level = _median(list(w)[-cfg.recent :])
            bias, mad = _median_mad(list(errors)) if len(errors) >= 2 else (0.0, 0.0)
            expected = level + bias
            # The sigma floors are shares of a log (relative moves); on a raw key, shares of the
            # loss's scale: the progress it made from its start, or its size.
            unit = max(self.start[slot] - level, abs(level)) if key in self.raw else 1.0
            sigma = max(MAD_TO_SIGMA * mad, cfg.min_sigma * unit)
            if len(errors) < cfg.warmup:
                # The prior, until the errors' tail can judge (below; the errors start prior_after
                # values after the window, so a prior ending with the window's warm-up left steps
                # judged by the MAD of a few errors alone: a noisy batch-16 run's 2.6 at step 25 was
                # 6.0 sigma). While few values say little about the noise: a wider floor, and the
                # widest swing from the level seen so far, widened for few values (the largest of n
                # deviations is ~1 sigma at n = 4 and still under it by chance: x (1 + 2 / (n - 1)),
                # 2x at 3 values, 1.1x at 24). A MAD of a handful of errors can be near zero; half
                # the swing, unwidened, skipped ~3% of healthy batch-16 regressions in warm-up.
                swing = max(abs(v - level) for v in w) * (1 + 2 / (len(w) - 1))
                sigma = max(sigma, cfg.prior_sigma * unit, swing)
            if len(errors) >= cfg.warmup:
                # Batch losses have heavy tails (a model's hard batches): sigma is also read from
                # the tail, the 95th percentile of |error| / 1.96 (the same sigma for a normal
                # distribution; larger where hard batches are common: a healthy CNN's reach 9.7
                # MAD-sigmas).
                dev = sorted(abs(e - bias) for e in errors)
                sigma = max(sigma, dev[int(0.95 * (len(dev) - 1))] / 1.96)
            sigma *= widen  # (a short batch: its mean over fewer examples)
            z = (x - expected) / sigma
            if key in self.raw and expected - x > cfg.z * sigma:
                # A loss below zero multiplied (a policy-gradient or likelihood loss x1e4) falls: a
                # fall past z sigma and early_factor x its usual magnitude is no progress one step
                # makes, and its gradient is as large. Kept out of the window and the errors.
                usual = _median([abs(v) for v in w])
                if expected - x > cfg.early_factor * usual:
                    out.append(self._fall(key, value, step, expected, usual))
                    continue
            if z <= cfg.z or self._small_setback(key, slot, value, expected):
                self.run.pop(slot, None)
                self.before_run.pop(slot, None)
                if not partial:
                    w.append(x)
                    errors.append(x - level)
                continue
            limit = expected + cfg.z * sigma
            if partial:  # a spike even for its size: no new level, nothing usual learnt from it
                out.append(self._finding(key, value, step, level, expected, limit, sigma, widen))
                continue
            if slot == LOSS_TOTAL and cfg.return_within and slot not in self.run:
                self.before_run[slot] = (list(w), list(errors))
            run = self.run.setdefault(slot, [expected])  # [expected before the jump, spikes...]
            run.append(x)
            del run[1 : -(cfg.shift_after + 1)]  # only the last shift_after + 1 spikes can form a level
            shift = self._level_shift(key, slot, run, step)
            if shift is not None:
                out.append(shift)
                continue
            # Clamped into the level's window (a run that moves to a new level is followed, slowly);
            # kept out of the errors, whose tail would otherwise grow with every spike.
            w.append(limit)
            out.append(self._finding(key, value, step, level, expected, limit, sigma, widen))
        return _name_mix(out, mix, self.mix, LOSS_TOTAL)

    def _finding(
        self,
        key: str,
        value: float,
        step: int,
        level: float,
        expected: float,
        limit: float,
        sigma: float = 0.0,
        widen: float = 1.0,
    ) -> Finding:
        """A spike of ``key`` (logs of the level, the expected value and the limit; ``sigma`` 0:
        the early test, before the prior judges, by ``early_factor``; ``widen``: how much a short
        batch widened sigma)."""
        cfg = self.config
        raw, out = key in self.raw, functools.partial(self._unscaled, key)
        z = ((value if raw else math.log(value)) - expected) / sigma if sigma else None
        if z is not None:
            why = f"is {z:.1f} sigma above its expected {_fmt(out(expected))} (threshold {cfg.z:g} sigma"
            if widen > 1:
                why = f"{why}, sigma widened {widen:.3g}x for a batch {1 / widen**2:.2g} of the usual size"
        else:
            why = f"is over {cfg.early_factor:g}x the largest loss so far {_fmt(out(level))} (threshold"
        return Finding(
            kind=self.kind if key == LOSS_TOTAL else LOSS_COMPONENT_SPIKE,
            where=key[len(LOSS_PREFIX) :],
            message=f"{key} = {_fmt(value)} {why} = {_fmt(out(limit))})",
            data={
                "key": key,
                "value": value,
                "median": out(level),
                "expected": out(expected),
                "threshold_value": out(limit),
                "z": z,
                "z_threshold": cfg.z if sigma else None,
                "sigma" if raw else "sigma_log": sigma,
                "batch_share": 1 / widen**2,
                "step": step,
            },
        )

    def _fall(self, key: str, value: float, step: int, expected: float, usual: float) -> Finding:
        """A spike downwards of a loss judged on its own scale (``raw``): a fall of more than
        ``early_factor`` x ``usual``, the median magnitude of its window."""
        limit = expected - self.config.early_factor * usual
        return Finding(
            kind=self.kind if key == LOSS_TOTAL else LOSS_COMPONENT_SPIKE,
            where=key[len(LOSS_PREFIX) :],
            message=(
                f"{key} = {_fmt(value)} fell more than {self.config.early_factor:g}x its usual magnitude "
                f"{_fmt(usual)} below its expected {_fmt(expected)} (threshold {_fmt(limit)}): a loss below "
                "zero multiplied, not learnt (its gradient is as large)"
            ),
            data={
                "key": key,
                "value": value,
                "expected": expected,
                "usual_magnitude": usual,
                "threshold_value": limit,
                "direction": "down",
                "step": step,
            },
        )

    def _level_shift(self, key: str, slot: str, run: list[float], step: int) -> Finding | None:
        """The finding of a level shift when the run (expected before the jump, then the spikes in
        a row, this value last) holds more than ``shift_after`` values that agree on a level: their
        logs lie in a band narrower than the gap between its bottom and the expected value before
        the jump, without a trend (the medians of the band's two halves differ by at most half its
        width: a climb of any slope differs by more). The window then starts afresh from them, and
        the loss's start is their largest. Else None (the value is a spike)."""
        cfg = self.config
        before, values = run[0], run[1:]
        if not cfg.shift_after or len(values) <= cfg.shift_after:
            return None
        values = values[-(cfg.shift_after + 1) :]
        level = _median(values)
        spread = max(values) - min(values)
        half = len(values) // 2
        trend = _median(values[-half:]) - _median(values[:half])
        if spread >= min(values) - before or abs(trend) > spread / 2:
            return None  # no one level: a band wider than the jump, or a loss that climbs
        del self.run[slot]
        held = self.before_run.pop(slot, None)
        # Held for a return only where the batches undo the progress made from the loss's start
        # (above it: what they teach is worse than the untrained model): a level below it is the
        # run's own excursion (grokking's slingshots), nor is a level that came back before (within
        # half this jump: alternating tasks, new data again).
        seen = any(abs(level - r) < (min(values) - before) / 2 for r in self.returned.get(slot, []))
        if held is not None and not seen and level > self.start.get(slot, math.inf):
            self.pending[slot] = {
                "at": step,
                "before": before,
                "level": level,
                "last": values[-1],
                "window": held[0],
                "errors": held[1],
                "start": self.start.get(slot),
            }
        self.windows[slot] = collections.deque(values, maxlen=cfg.window)
        # The loss's start: the new level where it is above the old start (a new task to learn), the
        # old start where it is not (a level below it has not undone the progress made from there:
        # grokking's slingshots, each judged against its own level, were skipped, undone and rolled
        # back until the run no longer grokked)
        self.start[slot] = max(self.start.get(slot, -math.inf), max(values))
        self.shifted[slot] = step
        skipped = len(values) - 1
        out = functools.partial(self._unscaled, key)
        within = f"{_fmt(spread)}" if key in self.raw else f"{math.exp(spread):.3g}x"
        return Finding(
            kind=LOSS_LEVEL_SHIFT,
            where=key[len(LOSS_PREFIX) :],
            message=(
                f"{key} has stayed near {_fmt(out(level))} (expected {_fmt(out(before))} before it "
                f"jumped) for {len(values)} steps, within {within} of each other: a new level "
                f"(the data or the task changed), not a spike. The detector follows it from here "
                f"({skipped} jumps before it were judged as spikes)"
            ),
            data={
                "key": key,
                "value": out(values[-1]),
                "level": out(level),
                "expected_before": out(before),
                "spread" if key in self.raw else "spread_factor": spread if key in self.raw else math.exp(spread),
                "steps": len(values),
                "skipped": skipped,
                "returnable": slot in self.pending,
                "step": step,
            },
        )

    def _level_return(self, key: str, slot: str, x: float, step: int) -> Finding | None:
        """The finding of a level shift that ended (``x``, this step's log loss, fell back in one
        step from the last by more than half the shift's jump, to nearer the level before it than
        the shift's), with the window, errors and start from before its first jump put back; else
        None (and the shift no longer awaited past ``return_within`` steps)."""
        held = self.pending[slot]
        if step - held["at"] > self.config.return_within:
            del self.pending[slot]
            return None
        before, level, last = held["before"], held["level"], held["last"]
        half = (level - before) / 2
        if not (x < before + half and last - x > half):
            held["last"] = x
            return None
        del self.pending[slot]
        self.windows[slot] = collections.deque(held["window"], maxlen=self.config.window)
        self.errors[slot] = collections.deque(held["errors"], maxlen=self.config.window)
        if held["start"] is None:
            self.start.pop(slot, None)
        else:
            self.start[slot] = held["start"]
        self.run.pop(slot, None)
        self.before_run.pop(slot, None)
        self.shifted[slot] = step  # (kept through the new regime this step starts)
        self.returned.setdefault(slot, []).append(level)
        out = functools.partial(self._unscaled, key)
        return Finding(
            kind=LOSS_LEVEL_RETURN,
            where=key[len(LOSS_PREFIX) :],
            message=(
                f"{key} = {_fmt(out(x))} fell back from {_fmt(out(last))} to near its level before the shift "
                f"at step {held['at']} ({_fmt(out(before))}; the shift's level {_fmt(out(level))}) after "
                f"{step - held['at']} steps: those steps were a stretch of bad batches, not new data"
            ),
            data={
                "key": key,
                "value": out(x),
                "last": out(last),
                "level_before": out(before),
                "level": out(level),
                "shift_step": held["at"],
                "steps_at_level": step - held["at"],
                "step": step,
            },
        )

    def new_regime(self, step: int) -> None:
        """The data changed at ``step``: every loss learns its level afresh (its first values, the
        prior), but a key whose level shift at this very step told of it (it follows that level
        already)."""
        for key in [k for k in self.windows if self.shifted.get(k) != step]:
            for table in (self.windows, self.errors, self.start, self.run, self.before_run, self.pending):
                table.pop(key, None)

    def _small_setback(self, key: str, slot: str, value: float, expected: float) -> bool:
        """The jump gives back less than ``min_setback`` of the progress since the start (a loss
        that never fell below its start makes no progress to give back: False)."""
        out = functools.partial(self._unscaled, key)
        return not _gives_back(value, out(expected), out(self.start[slot]), self.config.min_setback)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "errors": {k: list(e) for k, e in self.errors.items()},
            "start": dict(self.start),
            "run": {k: list(r) for k, r in self.run.items()},
            "before_run": {k: [list(w), list(e)] for k, (w, e) in self.before_run.items()},
            "pending": {k: dict(p) for k, p in self.pending.items()},
            "returned": {k: list(r) for k, r in self.returned.items()},
            "signed": sorted(self.signed),
            "raw": sorted(self.raw),
            "mix": self.mix,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.signed = {str(k) for k in state.get("signed", [])}
        self.raw = {str(k) for k in state.get("raw", [])}
        mix = state.get("mix")
        self.mix = None if mix is None else str(mix)
        self.errors = {
            k: collections.deque((float(v) for v in e), maxlen=self.config.window)
            for k, e in state.get("errors", {}).items()
        }
        self.run = {k: [float(v) for v in r] for k, r in state.get("run", {}).items()}
        self.before_run = {
            k: ([float(v) for v in w], [float(v) for v in e]) for k, (w, e) in state.get("before_run", {}).items()
        }
        self.pending = {k: dict(p) for k, p in state.get("pending", {}).items()}
        self.returned = {k: [float(v) for v in r] for k, r in state.get("returned", {}).items()}
        if "start" in state:
            self.start = {k: float(v) for k, v in state["start"].items()}
        else:  # saved by a version that kept no start: the window's largest value stands in
            self.start = {k: max(w) for k, w in self.windows.items() if len(w) >= self.config.prior_after}


# A loss that grows over spans of steps: an LR the run cannot take, or a healthy schedule (a loss
# weight ramped up, KL annealing, a curriculum that raises the noise, targets that grow, TD
# learning: a helper's probe, 11 healthy setups, 38 of 76 runs). The loss alone cannot tell them
# apart, so the answer is a trial (the finding's "trial"): back to the newest snapshot from before
# the growth and the LR dropped, the state left held. Where the loss from there, at the lowered LR,
# comes back near where the growth began within halt_window steps, the growth was the run's own and
# the drop stands; else the held state and the LR are put back (actions.judge_trial) and the growth
# is told only.
@register_detector(
    "loss_divergence", config=LossDivergenceConfig, window=300, kinds={LOSS_DIVERGENCE: [(1, [ROLLBACK, LR_DROP])]}
)
class LossDivergence(Detector):
    """The median of the last ``window`` training losses (their logs) ``growth`` x its value
    ``window`` steps before, ``spans`` times in a row, and ``factor`` x the lowest median of the run.
    The finding names the step where the growth began (the lowest median of the last
    ``(spans + 1) * window`` steps) as the damaged update's (``before_update=False``), so a rollback
    goes back to the newest snapshot from before it. Its history starts afresh after a finding, a
    change of data, and for good once a loss at or below zero is seen (a loss with no ratio)."""

    kind = LOSS_DIVERGENCE

    def __init__(self, config: LossDivergenceConfig | None = None):
        self.config = config or LossDivergenceConfig()
        # the log-losses of the last spans * window + 1 steps: the last window's median, and the noise
        self.losses: collections.deque[float] = collections.deque(maxlen=self._horizon())
        # (step, median of the window ending there), the last spans * window + 1 of them
        self.medians: collections.deque[tuple[int, float]] = collections.deque(maxlen=self._horizon())
        self.lowest: float | None = None  # the run's lowest median (log)
        self.start: float | None = None  # the run's first median (log): the progress is from there
        self.signed = False
        # each step's loss components and their weights (combine() with two or more), as far back as
        # the oldest median reaches: a growth the weights explain is the user's (_weights_explain)
        self.parts: collections.deque[tuple[dict[str, float], dict[str, float]]] = collections.deque(
            maxlen=self._reach()
        )

    def _horizon(self) -> int:
        return self.config.spans * self.config.window + 1

    def _reach(self) -> int:
        return (self.config.spans + 1) * self.config.window

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        loss = stats.get(LOSS_TOTAL)
        if self.signed or loss is None or not S.finite(loss):
            return []
        if loss <= 0:
            self.signed = True  # (no ratio to grow by)
            return []
        cfg = self.config
        self.losses.append(math.log(loss))
        # (a weight comes with its component: "total" is no component's name)
        weights = {k[len(WEIGHT_PREFIX) :]: v for k, v in stats.items() if k.startswith(WEIGHT_PREFIX)}
        self.parts.append(({c: float(stats[S.LOSS.format(c)]) for c in weights}, weights))
        if len(self.losses) < cfg.window:
            return []
        median = _median(list(self.losses)[-cfg.window :])
        self.medians.append((step, median))
        self.lowest = median if self.lowest is None else min(self.lowest, median)
        if self.start is None:
            self.start = median
        if len(self.medians) < self._horizon():
            return []
        if median - self.lowest < math.log(cfg.factor):
            return []
        if not _gives_back(math.exp(median), math.exp(self.lowest), math.exp(self.start), cfg.min_setback):
            return []  # (a wobble at a loss floor)
        spaced = [self.medians[-1 - k * cfg.window][1] for k in range(cfg.spans + 1)]
        rises = [a - b for a, b in itertools.pairwise(spaced)]  # (newest first)
        if min(rises) < math.log(cfg.growth):
            return []
        need = max(math.log(cfg.growth), cfg.z * self._median_se(list(self.losses)))  # (the noise: read only now)
        if min(rises) < need or self._weights_explain():
            return []
        began, low = min(self.medians, key=lambda m: m[1])
        per_span = [math.exp(r) for r in rises]
        finding = Finding(
            kind=self.kind,
            before_update=False,
            step=began,
            message=(
                f"loss/total grows: its median of the last {cfg.window} steps, {_fmt(math.exp(median))} at step "
                f"{step}, rose {', '.join(f'{g:.3g}x' for g in reversed(per_span))} over the last {cfg.spans} spans "
                f"of {cfg.window} steps (threshold {math.exp(need):.3g}x each: {cfg.growth:g}x, or {cfg.z:g} "
                f"standard errors of the batch noise) and is {math.exp(median - self.lowest):.3g}x "
                f"the run's lowest median {_fmt(math.exp(self.lowest))} (threshold {cfg.factor:g}x); it was lowest at "
                f"step {began} ({_fmt(math.exp(low))}), where the growth began"
            ),
            data={
                "median": math.exp(median),
                "growth": list(reversed(per_span)),
                "growth_needed": math.exp(need),
                "lowest_median": math.exp(self.lowest),
                "began": began,
                "began_median": math.exp(low),
                "at": step,
                "step": began,
                # the loss cannot tell an LR past its edge from a loss weight that grows: the LR drop
                # that answers it is a trial, judged by whether the loss follows the LR
                "trial": True,
            },
        )
        self.losses.clear()
        self.medians.clear()
        self.parts.clear()
        return [finding]

    def _weights_explain(self) -> bool:
        """Whether the user's loss weights changed over the steps the test read and, at the newest
        weights, the loss of those steps did not grow (the same test on sum(w_now * component)): a
        component whose weight is ramped in (KL annealing, an auxiliary loss) grows the total while
        the model's losses fall. False where the weights stayed (the total is then that sum) or any
        step lacks a component."""
        cfg = self.config
        parts = list(self.parts)
        if len(parts) < self._reach() or not parts[-1][1]:
            return False
        weights = parts[-1][1]
        if all(w == weights for _, w in parts):
            return False
        logs = []
        for components, _ in parts:
            if components.keys() != weights.keys():
                return False
            value = sum(weights[c] * components[c] for c in weights)
            if not (math.isfinite(value) and value > 0):
                return False
            logs.append(math.log(value))
        n = len(logs)
        spaced = [_median(logs[n - (k + 1) * cfg.window : n - k * cfg.window]) for k in range(cfg.spans + 1)]
        rises = [a - b for a, b in itertools.pairwise(spaced)]
        return min(rises) < max(math.log(cfg.growth), cfg.z * self._median_se(logs[-self._horizon() :]))

    def _median_se(self, logs: list[float]) -> float:
        """The standard error of a difference of two medians of ``window`` log-losses (``logs``, the
        last ones), from the noise of one, sigma: 1.4826 x the median absolute difference of
        successive log-losses / sqrt(2) (a steady growth moves every difference alike and barely
        widens it); a median's is 1.2533 sigma / sqrt(window)."""
        steps = [abs(b - a) for a, b in itertools.pairwise(logs)]
        if not steps:
            return 0.0
        sigma = 1.4826 * _median(steps) / math.sqrt(2.0)
        return 1.2533 * sigma * math.sqrt(2.0 / self.config.window)

    def new_regime(self, step: int) -> None:
        """A new level of the loss is no growth: the history starts afresh, the lowest with it."""
        self.losses.clear()
        self.medians.clear()
        self.parts.clear()
        self.lowest = self.start = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "medians": [list(m) for m in self.medians],
            "lowest": self.lowest,
            "start": self.start,
            "signed": self.signed,
            "parts": [[dict(c), dict(w)] for c, w in self.parts],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.losses = collections.deque((float(v) for v in state.get("losses", [])), maxlen=self._horizon())
        self.medians = collections.deque(
            ((int(s), float(m)) for s, m in state.get("medians", [])), maxlen=self._horizon()
        )
        lowest, start = state.get("lowest"), state.get("start")
        self.lowest = None if lowest is None else float(lowest)
        self.start = None if start is None else float(start)
        self.signed = bool(state.get("signed", False))
        self.parts = collections.deque(
            (
                ({str(k): float(v) for k, v in c.items()}, {str(k): float(v) for k, v in w.items()})
                for c, w in state.get("parts", [])
            ),
            maxlen=self._reach(),
        )


@register_detector("grad_spike", config=GradSpikeConfig, kinds={GRAD_SPIKE: [(1, [CLIP])]})
class GradSpike(Detector):
    """ZClip-style z-score of log(grad norm) against an EMA of its mean and variance.

    Warm-up: the first ``warmup`` finite values set the mean and variance (ZClip). A spike updates
    the EMA with the clamped value ``mean + z * sigma`` (ZClip). The finding's data carries the EMA
    mean and sigma (log space) so that ``clip`` in ``zclip`` mode can clip to ZClip's own threshold.
    """

    kind = GRAD_SPIKE

    def __init__(self, config: GradSpikeConfig | None = None):
        self.config = config or GradSpikeConfig()
        self.ema: dict[str, list[float]] = {}  # key (or key|components: _mix_slot) -> [mean, var]
        self.warm: dict[str, list[float]] = {}  # key -> values seen during warm-up
        self.mix: str | None = None  # the first set of loss components (a task's steps: _mix_slot)
        self.grads: str | None = None  # the first set of groups with gradients (_grad_set)

    def _keys(self, stats: Mapping[str, float]) -> list[str]:
        return _watched_keys(stats, GRAD_NORM_TOTAL, GRAD_NORM_PREFIX, self.config.groups)

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        out = []
        # A short batch's gradient is noisier: its norm up to 1 / sqrt(share) x a full batch's where
        # the noise dominates. Judged against a mean raised by that much; kept out of what is usual.
        widen, partial = _batch_widening(stats)
        shift = math.log(widen)
        mix, self.mix = _mix(stats, self.mix)
        grads, self.grads = _grad_set(stats, self.grads)
        other_grads = bool(grads) and grads != self.grads
        for key, value, x in _positive_logs(stats, self._keys(stats)):
            slot = _mix_slot(key, mix, self.mix)
            if key == GRAD_NORM_TOTAL and other_grads:  # (judged among the steps of the same groups)
                slot += f"|grads:{grads}"
            if slot not in self.ema:
                warm = self.warm.setdefault(slot, [])
                if len(warm) >= cfg.prior_after:  # the prior: the mean so far, a wide sigma floor
                    mean = sum(warm) / len(warm)
                    sigma = max(math.sqrt(sum((v - mean) ** 2 for v in warm) / len(warm)), cfg.prior_sigma)
                    finding = self._finding(step, key, value, x, mean + shift, sigma, "the mean of its first values")
                    if finding is not None:
                        out.append(finding)
                        x = mean + cfg.z * sigma  # clamped, as after the warm-up
                if partial:
                    continue
                warm.append(x)
                if len(warm) >= cfg.warmup:
                    mean = sum(warm) / len(warm)
                    var = sum((v - mean) ** 2 for v in warm) / len(warm)
                    self.ema[slot] = [mean, var]
                    del self.warm[slot]
                continue
            mean, var = self.ema[slot]
            sigma = max(math.sqrt(var), cfg.min_sigma)
            finding = self._finding(step, key, value, x, mean + shift, sigma, "its EMA")
            if finding is not None:
                out.append(finding)
                x = mean + cfg.z * sigma
            if partial:
                continue
            mean = cfg.alpha * mean + (1 - cfg.alpha) * x
            var = cfg.alpha * var + (1 - cfg.alpha) * (x - mean) ** 2
            self.ema[slot] = [mean, var]
        if other_grads:
            for f in out:
                if f.data.get("key") == GRAD_NORM_TOTAL:
                    f.data["grad_groups"] = grads
                    f.message += f" (judged among the steps whose gradients come from {grads.replace('+', ', ')})"
        return _name_mix(out, mix, self.mix)

    def _finding(
        self, step: int, key: str, value: float, x: float, mean: float, sigma: float, against: str
    ) -> Finding | None:
        cfg = self.config
        z = (x - mean) / sigma
        if z <= cfg.z:
            return None
        limit = mean + cfg.z * sigma
        return Finding(
            kind=self.kind,
            where=key[len(GRAD_NORM_PREFIX) :],
            message=(
                f"{key} = {_fmt(value)} is {z:.1f} sigma above {against} {_fmt(math.exp(mean))} "
                f"(threshold {cfg.z:g} sigma = {_fmt(math.exp(limit))})"
            ),
            data={
                "key": key,
                "value": value,
                "ema_mean": math.exp(mean),
                "threshold_value": math.exp(limit),
                "z": z,
                "z_threshold": cfg.z,
                "mean_log": mean,
                "sigma_log": sigma,
                "step": step,
            },
        )

    def new_regime(self, step: int) -> None:
        """After a change of data the gradients have a new usual size: the warm-up starts afresh
        (its prior judges meanwhile)."""
        self.ema, self.warm = {}, {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "ema": {k: list(v) for k, v in self.ema.items()},
            "warm": {k: list(v) for k, v in self.warm.items()},
            "mix": self.mix,
            "grads": self.grads,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ema = {k: [float(a) for a in v] for k, v in state.get("ema", {}).items()}
        self.warm = {k: [float(a) for a in v] for k, v in state.get("warm", {}).items()}
        mix, grads = state.get("mix"), state.get("grads")
        self.mix = None if mix is None else str(mix)
        self.grads = None if grads is None else str(grads)


# A spike seen after the update landed: undo exactly that update (one step lost). A second within
# 50 steps also lowers the LR, which climbs back once the trouble is gone (actions.lr_drop).
@register_detector(
    "update_ratio_spike",
    config=UpdateRatioSpikeConfig,
    window=50,
    # A third within the window: the undos keep landing on a state the damage already reached
    # (gradients that grew for steps before the first spike): back to the newest snapshot.
    kinds={UPDATE_RATIO_SPIKE: [(1, [UNDO]), (2, [UNDO, LR_DROP]), (3, [ROLLBACK, LR_DROP])], LARGE_UPDATE: [(1, [])]},
)
class UpdateRatioSpike(_Windowed):
    """update_ratio/<group> above ``factor`` x its rolling median, or above ``ceiling``.

    ``after_update``: the monitor calls ``check(prev_step, prev_stats)``; the update already landed,
    so findings have ``before_update=False`` and ``data["step"]`` names the step whose update spiked.

    Past the relative test alone, an update is undone for what it did: the loss measured after it
    (``loss_after_update``, the next step's loss) is non-finite or over ``harm_rise`` x the loss
    before it, a rise beyond the run's own batch-to-batch noise (``harm_noise``) that gives back
    part of the progress (``harm_setback``). An update that did not do that is told, as kind
    ``large_update``, and left alone: large updates that lower the loss are a model relearning
    (after a change of data or task, measured: undone, then the LR cut for good). Without a loss
    (no ``combine()``) the relative test alone decides, as the ceiling always does.
    """

    kind = UPDATE_RATIO_SPIKE
    after_update = True

    def __init__(self, config: UpdateRatioSpikeConfig | None = None):
        super().__init__(config or UpdateRatioSpikeConfig())
        self.large_runs: dict[str, list[float]] = {}  # key -> its large_update values in a row (per LR)
        self.zero_init: set[str] = set()  # groups first seen with all parameters at zero: no ceiling
        # key -> the LRs of its last `warmup` updates, and (the highest LR of its updates, the
        # lowest since that one): whether the user's schedule has just taken the LR back up to a
        # level it had left (a warm restart)
        self.lrs: dict[str, collections.deque[float]] = {}
        self.lr_peak: dict[str, tuple[float, float]] = {}
        self.losses_seen: list[float] = []  # the first (up to 3) losses: the largest is the start
        # |log(loss after an update / loss before it)| of the updates that landed and were judged
        # sound: how much one batch's loss differs from the next one's in this run (the noise a
        # harm must rise above)
        self.loss_moves: collections.deque[float] = collections.deque(maxlen=self.config.window)
        # The losses before the last few updates made at the schedule's usual LR, and, per group
        # whose LR a raise took up (updates accepted as the user's), the loss's level before the
        # raise: a raise's updates are judged by where they took the loss from there, not by one
        # step (the loss climbs over several, each rise within the batch-to-batch noise).
        self.recent_losses: collections.deque[float] = collections.deque(maxlen=5)
        self.raise_base: dict[str, float] = {}
        self.signed = False  # the loss was seen below zero: its rises are judged by S.rose

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        out = self._check(step, stats)
        before, after = stats.get(LOSS_TOTAL), stats.get(S.LOSS_AFTER_UPDATE)  # (given once it landed)
        if not out and before is not None and after is not None and S.finite(before) and S.finite(after):
            if before > 0 and after > 0:
                self.loss_moves.append(abs(math.log(after / before)))
        return out

    def _check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        out = []
        # a short batch's update (SGD: its noisier gradient) is judged widened, not learnt from
        widen, partial = _batch_widening(stats)
        loss = stats.get(LOSS_TOTAL)
        if loss is not None and S.finite(loss) and len(self.losses_seen) < 3:
            self.losses_seen.append(float(loss))
        if loss is not None and S.finite(loss) and loss < 0:
            self.signed = True  # a loss with no multiplicative scale (see S.rose)
        # The median LR of each group's last updates (before this one), and how far every group's
        # next LR is above it: once a step, for the raise's test and an LR drop's size.
        befores = {k: _median(list(lrs)) for k, lrs in self.lrs.items() if lrs}
        rise = self._lr_rise(stats, befores)
        # An update made under the monitor's LR drop: the user's LR it read is no level the
        # schedule reached (the monitor held it down).
        held_down = stats.get(S.UPDATE_LR_SCALE, 1.0) < 1.0
        now = float(loss) if loss is not None and S.finite(loss) else None  # the loss before this update
        raising_any, judged = False, False
        for key, value in stats.items():
            if not key.startswith(UPDATE_RATIO_PREFIX):
                continue
            group = key[len(UPDATE_RATIO_PREFIX) :]
            if key not in self.windows and stats.get(S.PARAM_NORM.format(group)) == 0.0:
                # A group that starts at zero (LoRA B, biases) grows from nothing: its ratio is ~1/k
                # at step k, healthy. Only the relative test, once its history exists, judges it.
                self.zero_init.add(key)
            if not S.finite(value) or value <= 0:
                continue
            judged = True
            # The relative test reads the update per unit of the LR it was made with: a schedule
            # that raises the LR (a warm restart, an unfrozen layer, a warm-up's step) raises the
            # ratio with it; an update far larger at the same LR is the spike. The ceiling reads
            # the ratio itself (an update larger than the weights, whatever the LR).
            given = stats.get(S.UPDATE_LR.format(group))
            per_lr = given is not None and S.finite(given) and given > 0
            lr = float(given) if per_lr and given is not None else 1.0
            x = value / lr
            # An update made at a one-step excursion of the LR is judged against what the
            # schedule's LR would have moved (an update normal per unit of a 100x LR is 100x too
            # large), and its LR is not recorded as one the schedule reached.
            level = self._excursion(key, lr, stats.get(S.NEXT_LR.format(group))) if per_lr else None
            peak_before = self.lr_peak.get(key)
            restart = per_lr and level is None and self._lr_back(key, lr, held_down)
            # An update made at an LR the schedule raised (at least lr_excursion x the median LR of
            # the group's updates before; not a warm restart to a level it had) is judged against
            # what that LR would have moved, by what it did to the loss: a raise that does no harm
            # is the user's (accepted, silently), one whose updates wreck the loss is undone.
            before = befores.get(key) if per_lr and level is None and not restart else None
            w = self.windows.setdefault(key, collections.deque(maxlen=cfg.window))
            med = _median(list(w)) if len(w) >= cfg.warmup else None
            judged_lr = lr if level is None else level
            rel_limit = max(cfg.factor * med * judged_lr * widen, cfg.min_ratio) if med is not None else math.inf
            limit = min(rel_limit, math.inf if key in self.zero_init else cfg.ceiling)
            raise_limit = math.inf  # the raise's test: the update the LR before the raise would make
            if before is not None and med is not None and cfg.lr_excursion and lr >= cfg.lr_excursion * before:
                raise_limit = max(cfg.factor * med * before, cfg.min_ratio)
                raising_any = True
            else:
                self.raise_base.pop(key, None)
            by_raise = raise_limit < value <= limit  # past the raise's test alone (ordinary per unit of LR)
            # A group's first update still over the ceiling once the monitor has lowered the LR (the
            # warm-up after first updates larger than the weights): the LR no longer makes it large,
            # the weights' size does (initialised far below their scale: a linear model at std 1e-3
            # under SGD moves 17x its weights at a twentieth of its LR, and lowers the loss). It is
            # judged by what it did to the loss, as a warm restart's. (Its later updates are not:
            # judged by the loss, the over-ceiling updates of SGD runs diverging at batch 1-8 landed.)
            growing = not w and held_down and level is None and value > cfg.ceiling
            if value > limit or by_raise:
                since = self.raise_base.get(key) if by_raise else None
                relative = value <= cfg.ceiling or key in self.zero_init or restart or growing
                kind, harm = self.kind, self._harm(stats, relative, since, growing)
                if by_raise and (harm is None or not harm["harm"]):
                    self.large_runs.pop(key, None)
                    w.append(x)  # the raise is the user's
                    if now is not None and key not in self.raise_base:  # (the loss's level before the raise)
                        self.raise_base[key] = _median([*self.recent_losses, now])
                    continue
                if by_raise and before is not None:  # (what the message says)
                    judged_lr, rel_limit, limit = before, raise_limit, raise_limit
                if harm is not None and not harm["harm"]:
                    kind = LARGE_UPDATE
                why = (
                    f"{cfg.factor:g} x its rolling median {_fmt((med or 0.0) * judged_lr)}"
                    + (f" at its LR {_fmt(lr)}" if per_lr and level is None else "")
                    + (f" at the schedule's LR {_fmt(level)}" if level is not None else "")
                    if rel_limit <= cfg.ceiling
                    else f"the ceiling {cfg.ceiling:g}"
                    + (" (the schedule took the LR back up: judged by the loss)" if restart else "")
                    + (
                        " (the group's first update, made at the monitor's lowered LR: judged by the loss)"
                        if growing
                        else ""
                    )
                )
                told = ""
                if by_raise and before is not None:
                    told = (
                        f"; made at LR {_fmt(lr)}, {lr / before:.3g}x the LR of the group's updates before it (a raise)"
                    )
                if level is not None:
                    told = (
                        f"; made at LR {_fmt(lr)}, {lr / level:.3g}x the schedule's {_fmt(level)} before and "
                        "after it: an excursion of that one step" + ("" if kind == LARGE_UPDATE else " (no LR drop)")
                    )
                if harm is not None and harm.get("last_update"):
                    told += (
                        "; no loss after it to judge it by (the run's last update, or one a step the loop "
                        "skipped under torch.distributed found), no harm shown to undo"
                    )
                elif harm is not None:
                    told += f"; the loss went from {_fmt(harm['loss_before'])}" + (
                        " (its level before the raise)" if harm.get("since_raise") else ""
                    )
                    told += f" to {_fmt(harm['loss_after'])} " + (
                        "after it" if harm["harm"] else "after it: no harm to undo"
                    )
                finding = Finding(
                    kind=kind,
                    where=group,
                    before_update=False,
                    step=step,
                    message=f"{key} = {_fmt(value)} at step {step} is above {why} (limit {_fmt(limit)}){told}",
                    data={
                        **(harm or {}),
                        "key": key,
                        "value": value,
                        "median": med * judged_lr if med is not None else None,
                        "lr": lr if per_lr else None,
                        "factor": cfg.factor,
                        "ceiling": cfg.ceiling,
                        "threshold_value": limit,
                        "step": step,
                    },
                )
                if not w and value > cfg.ceiling and level is None and not restart and kind == self.kind:
                    # no update of the group has landed yet: the run starts at an LR too high for
                    # its initial weights (an LR drop answers with a warm-up, actions.lr_drop)
                    finding.data["first_update"] = True
                if per_lr and level is None and rise is not None:
                    # how far the user's LR is now above its level before (every group's): an LR
                    # drop takes a risen LR back to that level (actions.lr_drop)
                    finding.data["lr_rise"] = rise
                if level is not None:
                    finding.data["lr_excursion"] = {
                        "lr": lr,
                        "schedule_lr": level,
                        "next_lr": float(stats[S.NEXT_LR.format(group)]),
                        "times": lr / level,
                    }
                    finding.occurrence = 1  # its undo alone: the ladder's streak starts afresh
                out.append(finding)
                if kind == self.kind and peak_before is not None:
                    # undone: its LR is no level the schedule reached (a schedule bug that comes
                    # back to it is no warm restart)
                    self.lr_peak[key] = peak_before
                if kind == LARGE_UPDATE:
                    run = self.large_runs.setdefault(key, [])
                    run.append(x)
                    if cfg.relearn_after and len(run) >= cfg.relearn_after:
                        # Harmless, and larger every time: this is the group's update size now. The
                        # window restarts from these (the relative test waits for its warm-up again).
                        self.windows[key] = collections.deque(self.large_runs.pop(key), maxlen=cfg.window)
                        continue
                else:
                    self.large_runs.pop(key, None)
                if med is not None:
                    w.append(cfg.factor * med)  # clamped (per unit of LR, as the window)
                continue
            self.large_runs.pop(key, None)
            if not partial:
                w.append(x)
        if judged and not out and not raising_any and now is not None:
            self.recent_losses.append(now)  # (the loss before an update made at the usual LR)
        return out

    @staticmethod
    def _lr_rise(stats: Mapping[str, float], befores: Mapping[str, float]) -> float | None:
        """How many times its level before the user's LR is now, the same for every group: the
        smallest over the groups of the user's LR of the next step over the median LR of the group's
        last ``warmup`` updates (``befores``; a schedule bug that multiplies every LR for some steps;
        a layer unfrozen at a raised LR alone is no rise of the others'). None where a group has no
        such history or no next LR."""
        rises = []
        for key in stats:
            if not key.startswith(UPDATE_RATIO_PREFIX):
                continue
            now, before = stats.get(S.NEXT_LR.format(key[len(UPDATE_RATIO_PREFIX) :])), befores.get(key)
            if now is None or not S.finite(now) or now <= 0 or not before:
                return None
            rises.append(float(now) / before)
        return min(rises) if rises else None

    def _excursion(self, key: str, lr: float, next_lr: float | None) -> float | None:
        """The schedule's LR when ``lr`` (this update's) is a one-step excursion above it: at least
        ``lr_excursion`` x both the highest LR of the group's last ``warmup`` updates and the user's
        LR of the step after it (``next_lr``); else None. The schedule's LR of that step is its
        neighbours', the higher of the update before it and the next step's (under a decaying
        schedule the highest of the last updates is the LR of steps ago: a cosine's twice it). A
        first update, or one without the next LR, is none."""
        factor, recent = self.config.lr_excursion, self.lrs.get(key)
        if not factor or not recent or next_lr is None or not S.finite(next_lr) or next_lr <= 0:
            return None
        if lr < factor * max(max(recent), float(next_lr)):
            return None
        return max(recent[-1], float(next_lr))

    def _lr_back(self, key: str, lr: float, held_down: bool = False) -> bool:
        """Records the LR of this update of ``key``; True when the user's schedule has just taken it
        back up to a level the group's updates were made at before it fell: at least 2x the lowest
        of the last ``warmup`` updates, at most the highest LR so far, the LR having fallen to half
        that highest since (a warm restart). A first step, a constant LR, an LR above any before it
        (a fault, a schedule bug, an unfrozen layer, a warm-up): False. An update the monitor's LR
        drop made (``held_down``) sets no new highest: the user's LR was not what it was made at."""
        recent = self.lrs.setdefault(key, collections.deque(maxlen=self.config.warmup))
        peak, low = self.lr_peak.get(key, (lr, lr))
        back = bool(recent) and 2 * low <= peak and 2 * min(recent) <= lr <= peak * (1 + 1e-6)
        recent.append(lr)
        self.lr_peak[key] = (lr, lr) if lr > peak and not held_down else (peak, min(low, lr))
        return back

    def _harm(
        self, stats: Mapping[str, float], relative: bool, since: float | None = None, growing: bool = False
    ) -> dict[str, Any] | None:
        """What the update did to the loss, for a spike of the relative test alone (``relative``):
        {"loss_before", "loss_after", "loss_start", "harm_rise", "harm"}; None when the test needs no
        evidence (the ceiling, ``harm_rise`` 0) or no loss was given to judge by. Harm: the loss after
        is non-finite, or over ``harm_rise`` x the loss before and the rise gives back at least
        ``harm_setback`` of the progress since the start (a loss that never fell below its start:
        the ratio alone). ``since``: the loss's level before a raise whose earlier updates were
        accepted; a rise that far over it is harm too (``since_raise``). ``growing``: a group's first
        update at the warm-up's LR, in the run's first steps, before the batch noise is known: the
        rise must pass ``harm_rise_max`` (a batch-8 regression's loss moved 1.57x from one batch to
        the next there, and the undo's rollback cut the LR for good)."""
        cfg = self.config
        before, after = stats.get(LOSS_TOTAL), stats.get(S.LOSS_AFTER_UPDATE)
        if relative and cfg.harm_rise and before is not None and S.finite(before) and stats.get(S.LAST_UPDATE):
            # no loss to judge it by (the run's last update; under torch.distributed, one a step the
            # loop skipped found): no harm is shown (told)
            return {"loss_before": before, "loss_after": None, "harm": False, "last_update": True}
        if not relative or not cfg.harm_rise or before is None or after is None or not S.finite(before):
            return None
        start = max(self.losses_seen, default=before)
        material = _gives_back(after, before, start, cfg.harm_setback)
        rise = cfg.harm_rise
        if cfg.harm_noise and len(self.loss_moves) >= cfg.warmup:
            # and above how much one batch's loss differs from the next one's in this run (the
            # median: a bad batch next to a sound update makes a move too, and must not widen it)
            noise = math.exp(cfg.harm_noise * _median(list(self.loss_moves)))
            rise = max(rise, min(noise, cfg.harm_rise_max))
        elif growing:
            rise = max(rise, cfg.harm_rise_max)
        signed = self.signed
        harm = not S.finite(after) or (S.rose(after, before, rise, start, signed) and material)
        if not harm and since is not None and S.finite(since):
            share = cfg.raise_setback or cfg.harm_setback
            if S.rose(after, since, rise, start, signed) and _gives_back(after, since, start, share):
                return {
                    "loss_before": since,
                    "loss_after": after,
                    "loss_start": start,
                    "harm_rise": rise,
                    "harm": True,
                    "since_raise": True,
                }
        return {
            "loss_before": before,
            "loss_after": after,
            "loss_start": start,
            "harm_rise": rise,
            "harm": harm,
        }

    def new_regime(self, step: int) -> None:
        """After a change of data a model relearns with larger updates: the relative test learns
        their usual size afresh (its warm-up; the ceiling judges meanwhile), and the loss's start
        is the new level's where that is higher (a level below the old start has not undone the
        progress made from it, see LossSpike._level_shift)."""
        start = max(self.losses_seen, default=None)
        self.windows, self.large_runs, self.raise_base = {}, {}, {}
        self.losses_seen = [start] if start is not None else []
        self.loss_moves.clear()
        self.recent_losses.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "zero_init": sorted(self.zero_init),
            "per_lr": True,
            "losses_seen": list(self.losses_seen),
            "lrs": {k: list(v) for k, v in self.lrs.items()},
            "lr_peak": {k: list(v) for k, v in self.lr_peak.items()},
            "loss_moves": list(self.loss_moves),
            "recent_losses": list(self.recent_losses),
            "raise_base": dict(self.raise_base),
            "large_runs": {k: list(v) for k, v in self.large_runs.items()},
            "signed": self.signed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if not state.get("per_lr"):
            # Saved by a version whose windows held the ratios themselves, not per unit of LR:
            # judged against them, every update would read as a spike. The windows start afresh.
            self.windows = {}
        self.zero_init = {str(k) for k in state.get("zero_init", [])}
        self.losses_seen = [float(v) for v in state.get("losses_seen", [])]
        self.lrs = {
            str(k): collections.deque((float(x) for x in v), maxlen=self.config.warmup)
            for k, v in state.get("lrs", {}).items()
        }
        self.lr_peak = {str(k): (float(v[0]), float(v[1])) for k, v in state.get("lr_peak", {}).items()}
        self.loss_moves = collections.deque((float(v) for v in state.get("loss_moves", [])), maxlen=self.config.window)
        self.recent_losses = collections.deque((float(v) for v in state.get("recent_losses", [])), maxlen=5)
        self.raise_base = {str(k): float(v) for k, v in state.get("raise_base", {}).items()}
        self.large_runs = {str(k): [float(x) for x in v] for k, v in state.get("large_runs", {}).items()}
        self.signed = bool(state.get("signed", False))


class _RatioImbalance(Detector):
    """Shared logic of the loss- and gradient-ratio detectors (edge-triggered with hysteresis)."""

    prefix = ""
    what = ""

    def __init__(self, config: RatioImbalanceConfig | None = None):
        self.config = config or RatioImbalanceConfig()
        self.over: dict[str, int] = {}  # pair key -> consecutive observations above threshold
        self.last_fire: dict[str, int] = {}  # pair key -> step of the last finding while armed-off

    def _ratio(self, a: str, b: str, stats: Mapping[str, float]) -> float | None:
        return stats.get(f"{self.prefix}{a}/{b}")

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        out = []
        for a, b in cfg.pairs:
            key = f"{self.prefix}{a}/{b}"
            r = self._ratio(a, b, stats)
            if r is None or not S.finite(r):
                continue
            if r <= cfg.threshold:
                self.over[key] = 0
                if r < cfg.rearm_below * cfg.threshold:
                    self.last_fire.pop(key, None)
                continue
            self.over[key] = self.over.get(key, 0) + 1
            if self.over[key] < cfg.patience:
                continue
            last = self.last_fire.get(key)
            if last is not None and step - last < cfg.refire_every:
                continue
            self.last_fire[key] = step
            out.append(
                Finding(
                    kind=self.kind,
                    where=f"{a}/{b}",
                    message=f"{self.what} {a}/{b} = {r:.3g} exceeds {cfg.threshold:g}",
                    data={"key": key, "a": a, "b": b, "ratio": r, "threshold": cfg.threshold, "step": step},
                )
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"over": dict(self.over), "last_fire": dict(self.last_fire)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.over = {k: int(v) for k, v in state.get("over", {}).items()}
        self.last_fire = {k: int(v) for k, v in state.get("last_fire", {}).items()}


@register_detector("loss_ratio_imbalance", config=RatioImbalanceConfig, kinds={LOSS_RATIO_IMBALANCE: [(1, [REWEIGHT])]})
class LossRatioImbalance(_RatioImbalance):
    """loss_ratio/<a>/<b> above 2 (the report's reweighting trigger). Falls back to
    (loss/<a> + 1e-6) / (loss/<b> + 1e-6) when the ratio key is absent."""

    kind = LOSS_RATIO_IMBALANCE
    prefix = LOSS_RATIO_PREFIX
    what = "loss ratio"

    def _ratio(self, a: str, b: str, stats: Mapping[str, float]) -> float | None:
        return S.loss_ratio_of(stats, a, b)


@register_detector("grad_ratio_imbalance", config=RatioImbalanceConfig, kinds={GRAD_RATIO_IMBALANCE: [(1, [REWEIGHT])]})
class GradRatioImbalance(_RatioImbalance):
    """grad_ratio/<a>/<b> above 2 on shared parameters (the field report's second trap: conflicting gradients,
    NaN followed with 87% probability). The key exists only on the steps the stats stage measures it."""

    kind = GRAD_RATIO_IMBALANCE
    prefix = GRAD_RATIO_PREFIX
    what = "gradient-norm ratio"


@register_detector("loss_scale_floor", config=LossScaleFloorConfig, kinds={LOSS_SCALE_FLOOR: []})
class LossScaleFloor(Detector):
    """amp/loss_scale <= min_loss_scale; fires once, re-arms when the scale is back above."""

    kind = LOSS_SCALE_FLOOR

    def __init__(self, config: LossScaleFloorConfig | None = None):
        self.config = config or LossScaleFloorConfig()
        self.armed = True

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        scale = stats.get(LOSS_SCALE)
        if not S.finite(scale):
            return []
        floor = self.config.min_loss_scale
        if scale > floor:
            self.armed = True
            return []
        if not self.armed:
            return []
        self.armed = False
        return [
            Finding(
                kind=self.kind,
                where="scaler",
                message=f"GradScaler scale {scale:g} reached the floor min_loss_scale = {floor:g}: "
                f"fp16 gradients keep overflowing",
                data={"key": LOSS_SCALE, "value": scale, "min_loss_scale": floor, "step": step},
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"armed": self.armed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.armed = bool(state.get("armed", True))


@register_detector(
    "accuracy_collapse",
    config=AccuracyCollapseConfig,
    kinds={ACCURACY_COLLAPSE: [(1, [ROLLBACK, LR_DROP])], ACCURACY_DROP: [(1, [])]},
)
class AccuracyCollapse(Detector):
    """Validation accuracy at chance (<= chance + collapse_margin) after it had been clearly above
    (>= chance + above_margin). Fires once per collapse; re-arms when clearly above again.

    Where the training loss is seen (``check``), a collapse also needs it to have risen with the
    accuracy's fall (``train_loss_rise``): a divergence shows in both. An accuracy at chance with
    the training loss where it was is told once as ``accuracy_drop`` (no action), and the detector
    stays armed."""

    kind = ACCURACY_COLLAPSE

    def __init__(self, config: AccuracyCollapseConfig | None = None):
        self.config = config or AccuracyCollapseConfig()
        self.best: float | None = None
        self.armed = False  # becomes True once accuracy was clearly above chance
        self.losses: collections.deque[float] = collections.deque(maxlen=self.config.loss_window)
        self.loss_then: float | None = None  # the losses' median when the accuracy was last clearly above
        self.told = False  # an accuracy_drop was told since it was last clearly above

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        loss = stats.get(LOSS_TOTAL)
        if loss is not None:
            self.losses.append(float(loss) if S.finite(loss) else math.inf)
        return []

    def observe_eval(self, step: int, metrics: Mapping[str, float], chance: float | None = None) -> list[Finding]:
        cfg = self.config
        chance = cfg.chance if chance is None else chance
        acc = metrics.get(cfg.metric)
        if chance is None or acc is None:
            return []
        if not S.finite(acc):
            acc_for_test = -math.inf  # NaN accuracy: the model outputs garbage, i.e. collapsed
        else:
            acc_for_test = acc
            self.best = acc if self.best is None else max(self.best, acc)
        above = cfg.above_margin
        if cfg.samples is not None and 0.0 < chance < 1.0:
            above = max(above, cfg.z * math.sqrt(chance * (1.0 - chance) / cfg.samples))
        if acc_for_test >= chance + above:
            self.armed, self.told = True, False
            self.loss_then = _median(list(self.losses)) if self.losses else None
            return []
        if not self.armed or acc_for_test > chance + cfg.collapse_margin:
            return []
        now = _median(list(self.losses)) if self.losses else None
        data = {
            "metric": cfg.metric,
            "value": acc,
            "chance": chance,
            "best": self.best,
            "collapse_margin": cfg.collapse_margin,
            "train_loss_now": now,
            "train_loss_then": self.loss_then,
            "step": step,
        }
        message = f"validation {cfg.metric} {acc} is back at chance {chance:g} (best so far {self.best})"
        then = self.loss_then
        if (
            cfg.train_loss_rise
            and S.finite(acc)
            and now is not None
            and then is not None
            and not S.rose(now, then, cfg.train_loss_rise, signed=min(self.losses) < 0)
        ):
            if self.told:
                return []
            self.told = True
            return [
                Finding(
                    kind=ACCURACY_DROP,
                    where=cfg.metric,
                    message=(
                        f"{message}, but the training loss did not rise with it (median {_fmt(now)}, was "
                        f"{_fmt(then)}): no divergence to roll back (a small validation set, "
                        "or overfitting)"
                    ),
                    data={**data, "train_loss_rise": cfg.train_loss_rise},
                )
            ]
        self.armed = False
        return [Finding(kind=self.kind, where=cfg.metric, message=message, data=data)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "armed": self.armed,
            "losses": list(self.losses),
            "loss_then": self.loss_then,
            "told": self.told,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.armed = bool(state.get("armed", False))
        self.losses = collections.deque((float(v) for v in state.get("losses", [])), maxlen=self.config.loss_window)
        then = state.get("loss_then")
        self.loss_then = None if then is None else float(then)
        self.told = bool(state.get("told", False))


# The report's improved early stopping: the detector places its findings on the ladder itself.
# Events only by default: a validation metric that stops improving is no fault (a small validation
# set, overfitting a short run), and lowering the LR or stopping is the user's training recipe, not
# a rescue. The report's recipe is one setting away (policy.ladders.plateau; docs/policy.md).
@register_detector("plateau", config=PlateauConfig, kinds={PLATEAU: [(1, []), (2, [])]})
class Plateau(Detector):
    """No improvement of the eval metric for ``patience`` validations (finding with
    ``data["occurrence"] = 1``), then for ``grace`` more (``occurrence = 2``). The policy uses the
    occurrence as the ladder position (default: events only; the report's early stopping:
    1 -> lr_drop, 2 -> stop, set in ``policy.ladders.plateau``)."""

    kind = PLATEAU

    def __init__(self, config: PlateauConfig | None = None):
        self.config = config or PlateauConfig()
        self.best: float | None = None
        self.stale = 0
        self.stage = 0  # 0: watching; 1: LR dropped, in the grace period; 2: told to stop

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        d = self.config.min_delta
        return value < self.best - d if self.config.mode == "min" else value > self.best + d

    def observe_eval(self, step: int, metrics: Mapping[str, float], chance: float | None = None) -> list[Finding]:
        cfg = self.config
        value = metrics.get(cfg.metric)
        if value is None:
            return []
        if S.finite(value) and self._improved(value):
            self.best, self.stale, self.stage = float(value), 0, 0
            return []
        self.stale += 1  # a non-finite metric counts as no improvement and never becomes the best
        if self.stage == 0 and self.stale >= cfg.patience:
            self.stage, self.stale = 1, 0
            n, occurrence, what = cfg.patience, 1, "drop the learning rate"
        elif self.stage == 1 and self.stale >= cfg.grace:
            self.stage = 2
            n, occurrence, what = cfg.grace, 2, "stop"
        else:
            return []
        return [
            Finding(
                kind=self.kind,
                where=cfg.metric,
                # What the report's early stopping would do now; what is done is the plateau
                # ladder's (at the defaults: nothing, the event alone), and the event's actions say it.
                message=(
                    f"validation {cfg.metric} {value} has not improved on {self.best} for {n} validations "
                    f"(the report's early stopping would now {what})"
                ),
                data={
                    "metric": cfg.metric,
                    "value": value,
                    "best": self.best,
                    "validations": n,
                    "occurrence": occurrence,
                    "step": step,
                },
                occurrence=occurrence,
            )
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stale": self.stale, "stage": self.stage}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")
        self.stale = int(state.get("stale", 0))
        self.stage = int(state.get("stage", 0))


def _maps_onto_itself(shapes: list[tuple[int, ...]]) -> bool:
    """Whether a group holds a weight (2-D or more) that maps a width onto itself, as the layers of a
    depth stack do (a block's output projection, a hidden layer, a residual block's conv); side-by-side
    heads from one width to another hold none. Either orientation (nn.Linear's and GPT-2's Conv1D's)."""
    return any(len(s) >= 2 and s[0] == s[1] for s in shapes)


# Gradients that fade with depth leave the first layers untrained. The stack is judged by its own
# ends (like layers, so their norms compare): the first one's gradients must be a small fraction of
# the last one's, and so must its updates (an Adam-family optimizer rescales faded gradients into
# full-sized steps; a layer-wise LR decay makes the first updates small from healthy gradients).
# Told once until the gradients come back (10x the ratio).
UPDATE_RATIO_FADED = 0.2  # measured: stalled or faded runs <= 0.09, healthy >= 0.43 (docs/benchmarks.md)


@register_detector(
    "vanishing_gradient", config=VanishingGradientConfig, kinds={VANISHING_GRADIENT: [(1, [ROLLBACK, LR_DROP])]}
)
class VanishingGradient(_Told):
    """``grad_norm/<first>`` / ``grad_norm/<last>`` over each stack of like groups: runs of at least
    ``min_layers`` consecutive groups (in model order) whose parameters have the same shapes (a
    transformer's blocks, an MLP's hidden layers). The ends are the stack's first and last groups
    with a positive gradient norm in the step (a frozen first block does not count). Told when the
    median of ``window`` steps is under ``ratio`` and, where update ratios are measured, the first
    group's update ratio is also under ``UPDATE_RATIO_FADED`` of the last one's (median). Judged one
    step late (``after_update``: the update ratios of a step are read with the next). The monitor
    gives the groups' shapes through ``layout()``; without it nothing is judged.

    A told finding is no action. One cause it can mend: an LR too high for the run's start (a
    post-LN transformer without warm-up). Where the fade comes within ``restart_within`` steps of
    the run's first, its LR never rose (the user's ``update_lr/<group>`` never over 2x its first,
    the monitor's scale never under 1), a stack's group moved by ``restart_update`` of its weights
    in one of the first ``window`` updates, and the loss stalled (``restart_stall``), the finding
    is not told: its data (``trial``, ``restart``, ``restart_from``, ``judge_after``,
    ``bar_median``, ``first_update``) make its ladder's rollback go to the run's start and its LR
    drop a warm-up judged as a trial (actions.rollback, actions.lr_drop, actions.judge_trial).
    Once per run. A fade that comes with a collapse of a loss that had trained (``collapse_rise``)
    is answered once per run as loss_divergence's growth: its ``step`` is before the rise, its
    data (``trial``, ``median``, ``began_median``) make the rollback and the LR drop a trial."""

    kind = VANISHING_GRADIENT
    after_update = True

    def __init__(self, config: VanishingGradientConfig | None = None):
        super().__init__(config or VanishingGradientConfig())  # windows: "<first>..<last>", and ":update"
        self.stacks: list[list[str]] = []  # of groups: grad_norm/<g>, update_ratio/<g>
        self.block_stacks: list[list[str]] = []  # of blocks inside a group: block_grad_norm/<b>, ...
        # What the restart (restart_within) asks of the run so far: its first judged step, its first
        # losses (logs), its last 2 x window losses (logs), the user's LR of each group's first update,
        # whether any LR rose since (or the monitor scaled it), whether a restart was decided.
        self.first_step: int | None = None
        self.first_losses: list[float] = []
        self.losses: collections.deque[float] = collections.deque(maxlen=2 * self.config.window)
        self.first_lr: dict[str, float] = {}
        self.lr_rose = False
        self.first_update = 0.0  # the largest update ratio of a stack's group in the run's first `window` updates
        self.restarted = False
        # For a collapse (collapse_rise): the first median of `window` losses (log), the lowest one
        # and its step, the last step whose median was within 5% of the lowest, a collapse answered.
        self.start_median: float | None = None
        self.low: tuple[float, int] | None = None
        self.near_low_at: int | None = None
        self.collapsed = False
        self.signed = False  # (a loss seen at or below zero: no logs to compare)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "first_step": self.first_step,
            "first_losses": list(self.first_losses),
            "losses": list(self.losses),
            "first_lr": dict(self.first_lr),
            "lr_rose": self.lr_rose,
            "first_update": self.first_update,
            "restarted": self.restarted,
            "start_median": self.start_median,
            "low": None if self.low is None else list(self.low),
            "near_low_at": self.near_low_at,
            "collapsed": self.collapsed,
            "signed": self.signed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        first = state.get("first_step")
        self.first_step = None if first is None else int(first)
        self.first_losses = [float(v) for v in state.get("first_losses", [])]
        self.losses = collections.deque((float(v) for v in state.get("losses", [])), maxlen=2 * self.config.window)
        self.first_lr = {str(k): float(v) for k, v in state.get("first_lr", {}).items()}
        self.lr_rose = bool(state.get("lr_rose", False))
        self.first_update = float(state.get("first_update", 0.0))
        self.restarted = bool(state.get("restarted", False))
        start, low, near = state.get("start_median"), state.get("low"), state.get("near_low_at")
        self.start_median = None if start is None else float(start)
        self.low = None if low is None else (float(low[0]), int(low[1]))
        self.near_low_at = None if near is None else int(near)
        self.collapsed = bool(state.get("collapsed", False))
        self.signed = bool(state.get("signed", False))

    def _answered(self) -> bool:
        """Nothing left to follow the run for: the restart and the collapse each taken, or off."""
        cfg = self.config
        return (self.restarted or not cfg.restart_within) and (self.collapsed or not cfg.collapse_rise)

    def _follow_run(self, step: int, stats: Mapping[str, float]) -> None:
        """The run's start, its losses and its LRs, for the restart and the collapse."""
        if self._answered():
            return
        if self.first_step is None:
            self.first_step = step
        loss = stats.get(LOSS_TOTAL)
        if loss is not None and S.finite(loss):
            if loss <= 0:  # (a signed loss has no logs to compare: no restart, no collapse)
                self.signed = True
            else:
                self.losses.append(math.log(loss))
                if len(self.first_losses) < 3:
                    self.first_losses.append(math.log(loss))
                if len(self.losses) >= self.config.window:
                    median = _median(list(self.losses)[-self.config.window :])
                    if self.start_median is None:
                        self.start_median = median
                    if self.low is None or median < self.low[0]:
                        self.low = (median, step)
                    if median <= self.low[0] + math.log(1.05):
                        self.near_low_at = step
        if step - self.first_step < self.config.window:  # (the stacks' groups or blocks: what faded)
            for stack, _, prefix in self._stacks():
                for part in stack:
                    ratio = stats.get(prefix + part)
                    if ratio is not None and S.finite(ratio):
                        self.first_update = max(self.first_update, ratio)
        scale = stats.get(S.UPDATE_LR_SCALE)
        if scale is not None and scale < 1.0:  # (the monitor lowered the LR: a warm-up of its own)
            self.lr_rose = True
        prefix = S.UPDATE_LR.format("")
        for key, lr in stats.items():
            if key.startswith(prefix) and S.finite(lr) and lr > 0:
                if lr > 2.0 * self.first_lr.setdefault(key, lr):  # (a warm-up: the LR rose from its start)
                    self.lr_rose = True

    def _collapse(self) -> dict[str, Any] | None:
        """A collapse's facts where one is due (a fade with a loss risen over its lowest, giving
        back a share of its progress), else None."""
        cfg = self.config
        if self.collapsed or not cfg.collapse_rise or self.low is None or self.near_low_at is None:
            return None
        if self.signed or self.start_median is None or len(self.losses) < cfg.window:
            return None
        now = _median(list(self.losses)[-cfg.window :])
        low = self.low[0]
        if now - low < math.log(cfg.collapse_rise) or now - low < cfg.collapse_setback * (self.start_median - low):
            return None
        return {
            "trial": True,
            "collapse": True,
            "median": math.exp(now),
            "began_median": math.exp(low),
            "lowest_at": self.low[1],
            # (the median lags its window: the window's start, the rise began no sooner)
            "rise_from": max(self.near_low_at - cfg.window, self.first_step or 0),
        }

    def _restart(self, step: int) -> dict[str, Any] | None:
        """The restart's facts where it is due (a fade early in a run whose LR never rose, its loss
        stalled), else None."""
        cfg, w = self.config, self.config.window
        if self.restarted or not cfg.restart_within or self.lr_rose or self.signed or self.first_step is None:
            return None
        if self.first_update < cfg.restart_update:
            return None
        if step - self.first_step > cfg.restart_within or len(self.losses) < 2 * w or not self.first_losses:
            return None
        values = list(self.losses)
        before, now = _median(values[:w]), _median(values[w:])
        if before - now >= cfg.restart_stall:
            return None
        progress = max(self.first_losses) - now
        bar = now - max(cfg.restart_margin * progress, math.log(1.01))
        return {
            "trial": True,
            "restart": True,
            "first_update": True,  # (the LR drop is a warm-up: actions.lr_drop)
            "restart_from": self.first_step,
            "judge_after": step - self.first_step,
            "median": math.exp(now),
            "median_before": math.exp(before),
            "start_loss": math.exp(max(self.first_losses)),
            "first_update_ratio": self.first_update,
            "bar_median": math.exp(bar),
        }

    def _runs(self, parts: Mapping[str, list[tuple[int, ...]]], lists: bool = False) -> list[list[str]]:
        """Runs of at least ``min_layers`` consecutive like parts (the same shapes, a weight that
        maps a width onto itself), in order; with ``lists``, within one list (the parts' names
        less their last component: two towers of like blocks are two stacks)."""
        stacks: list[list[str]] = []
        run: list[str] = []
        last: tuple | None = None
        for name, shapes in parts.items():
            sig: tuple | None = tuple(sorted(shapes)) if _maps_onto_itself(shapes) else None
            if sig is not None and lists:
                sig = (name.rpartition(".")[0], sig)
            if run and sig == last and sig:
                run.append(name)
            else:
                if len(run) >= self.config.min_layers:
                    stacks.append(run)
                run, last = [name], sig
        if len(run) >= self.config.min_layers:
            stacks.append(run)
        return stacks

    def layout(self, groups: Mapping[str, list[tuple[int, ...]]]) -> None:
        """The groups in model order, each with its parameters' shapes (plain data)."""
        self.stacks = self._runs(groups)

    def blocks(self, blocks: Mapping[str, list[tuple[int, ...]]]) -> list[str]:
        """The runs of like blocks inside groups (a BERT's encoder layers in its one ``bert``
        group): stacks of their own, judged on ``block_grad_norm/<b>`` and ``block_update_ratio/<b>``."""
        self.block_stacks = self._runs(blocks, lists=True)
        return [b for stack in self.block_stacks for b in stack]

    def _stacks(self) -> list[tuple[list[str], str, str]]:
        """Every stack with the prefixes of its gradient norms and update ratios."""
        return [(s, GRAD_NORM_PREFIX, UPDATE_RATIO_PREFIX) for s in self.stacks] + [
            (s, BLOCK_GRAD_NORM_PREFIX, BLOCK_UPDATE_RATIO_PREFIX) for s in self.block_stacks
        ]

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        out = []
        stacks = self._stacks()
        if stacks:
            self._follow_run(step, stats)
        for stack, grad_prefix, update_prefix in stacks:
            key = f"{stack[0]}..{stack[-1]}"
            norms = [(g, stats.get(grad_prefix + g)) for g in stack]
            live = [(g, v) for g, v in norms if v is not None and S.finite(v) and v > 0]
            if len(live) < cfg.min_layers:
                continue
            (first, a), (last, b) = live[0], live[-1]
            window = self.windows.setdefault(key, collections.deque(maxlen=cfg.window))
            window.append(a / b)
            ua, ub = stats.get(update_prefix + first), stats.get(update_prefix + last)
            moved = self.windows.setdefault(key + ":update", collections.deque(maxlen=cfg.window))
            if ua is not None and ub is not None and S.finite(ua) and S.finite(ub) and ub > 0:
                moved.append(ua / ub)
            if step < cfg.start or len(window) < cfg.window:
                continue
            median = _median(list(window))
            update = _median(list(moved)) if moved else None
            if key in self.told:
                if median > 10 * cfg.ratio:
                    self.told.discard(key)
                    continue
                if median >= cfg.ratio:  # (still told, no longer faded: no restart for it)
                    continue
            elif median >= cfg.ratio or (update is not None and update >= UPDATE_RATIO_FADED):
                continue
            restart = self._restart(step)
            collapse = self._collapse() if restart is None else None
            if key in self.told and restart is None and collapse is None:
                continue
            self.told.add(key)
            like = "groups" if grad_prefix == GRAD_NORM_PREFIX else "blocks"
            faded = (
                f"gradients fade through the {len(stack)} like {like} {key}: the gradient norm of "
                f"{first} is {_fmt(median)} of {last}'s (median of {cfg.window} steps, under "
                f"{_fmt(cfg.ratio)})" + (f" and its updates {_fmt(update)} of {last}'s" if update is not None else "")
            )
            if collapse is not None:
                self.collapsed = True
                message = (
                    faded + f", and the loss collapsed: its median of the last {cfg.window} steps, "
                    f"{_fmt(collapse['median'])}, is {collapse['median'] / collapse['began_median']:.3g}x its lowest, "
                    f"{_fmt(collapse['began_median'])} at step {collapse['lowest_at']} (an LR past what the faded "
                    "stack can take). A trial: back to the newest snapshot from before the rise (step "
                    f"{collapse['rise_from']} or earlier) with the LR dropped"
                )
            elif restart is None:
                message = (
                    faded + ": the first layers barely train (vanishing gradients; a post-LN "
                    "transformer without warm-up stalls so). Residual connections, normalisation, another "
                    "activation or init, or an LR warm-up"
                )
            else:
                self.restarted = True
                message = (
                    faded + f", {restart['judge_after']} steps into a run whose LR never rose, and its loss "
                    f"stalled at {_fmt(restart['median'])} (median of the last {cfg.window} steps; "
                    f"{_fmt(restart['median_before'])} the {cfg.window} before): an LR too high for the start "
                    "(a post-LN transformer without warm-up stalls so). A trial: back to the run's start with an "
                    f"LR warm-up, judged by its loss after {restart['judge_after']} steps against "
                    f"{_fmt(restart['bar_median'])}"
                )
            out.append(
                Finding(
                    kind=self.kind,
                    where=first,
                    message=message,
                    data={
                        "stack": stack,
                        "first": first,
                        "last": last,
                        "ratio": median,
                        "update_ratio": update,
                        "threshold": cfg.ratio,
                        "window": cfg.window,
                        "step": step,
                        **(restart or collapse or {}),
                    },
                    told=restart is None and collapse is None,
                    before_update=collapse is None,  # (a collapse's rollback goes to before the rise)
                    step=None if collapse is None else collapse["rise_from"],
                )
            )
        return out


@register_detector("stale_update", config=StaleUpdateConfig, kinds={STALE_UPDATE: [(1, [])]})
class StaleUpdate(_Told):
    """``update_stale/total``: over every bf16/fp16 parameter, the share of the step's gradient
    mass on weights the update left exactly unchanged. Told once when the median of ``window``
    steps passes ``threshold`` (naming the groups with the largest shares), again only after it
    fell under half of it. The whole model, not each group: a small group of weights near 1 (a
    LayerNorm's gains: bf16 rounds away any step under ~0.004) loses its updates at any usual LR and
    costs little (a probe: 0.98x the held-out loss of fp32 weights). Judged one step late
    (``after_update``: the value is read with the next step's statistics)."""

    kind = STALE_UPDATE
    after_update = True
    KEY = S.UPDATE_STALE.format("total")

    def __init__(self, config: StaleUpdateConfig | None = None):
        super().__init__(config or StaleUpdateConfig())

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        value = stats.get(self.KEY)
        if value is None or not S.finite(value):
            return []
        window = self.windows.setdefault(self.KEY, collections.deque(maxlen=cfg.window))
        window.append(value)
        if step < cfg.start or len(window) < cfg.window:
            return []
        median = _median(list(window))
        if not self.reaches(self.KEY, median, cfg.threshold):
            return []
        groups = sorted(
            (
                (k[len(UPDATE_STALE_PREFIX) :], v)
                for k, v in stats.items()
                if k.startswith(UPDATE_STALE_PREFIX) and k != self.KEY
            ),
            key=lambda kv: -kv[1],
        )
        worst = ", ".join(f"{g} {_fmt(100 * v)}%" for g, v in groups[:3])
        return [
            Finding(
                kind=self.kind,
                where=groups[0][0] if groups else "",
                message=(
                    f"{_fmt(100 * median)}% of the gradient fell on bf16/fp16 weights its updates left unchanged "
                    f"(median of {cfg.window} steps; by group, this step: {worst}): an update under half a unit in "
                    "the last place of its weight rounds away (bf16: an Adam step of lr on any weight over ~256 lr). "
                    "Keep fp32 weights and train under torch.autocast, or use an update with Kahan summation or "
                    "stochastic rounding, or a higher LR"
                ),
                data={"share": median, "groups": dict(groups), "threshold": cfg.threshold, "window": cfg.window},
            )
        ]


class _ToldShare(_Told):
    """A told detector of one share per group, ``<prefix><group>``: a finding once the share
    reaches ``config.threshold``, again only after it fell under half of it (``_Told.reaches``).
    Subclasses give the prefix, their config section and the message."""

    prefix = ""
    config_class: type[Section] = Section

    def __init__(self, config: Any = None):
        super().__init__(config or self.config_class())

    def message(self, group: str, value: float) -> str:
        raise NotImplementedError

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        out = []
        for key, value in stats.items():
            if not key.startswith(self.prefix) or not S.finite(value) or not self.reaches(key, value, cfg.threshold):
                continue
            group = key[len(self.prefix) :]
            data = {"share": value, "threshold": cfg.threshold}
            out.append(Finding(kind=self.kind, where=group, message=self.message(group, value), data=data))
        return out


@register_detector("dead_units", config=DeadUnitsConfig, kinds={DEAD_UNITS: [(1, [])]})
class DeadUnits(_ToldShare):
    """``dead_units/<group>``: the largest share, over the group's nn.Linear / nn.Conv layers, of
    units that died: their gradient row was exactly zero on each of the last
    ``stats.dead_units_samples`` samples and non-zero on one before (``stats.DeadUnitCounter``).
    A unit dead for good stays so under every action the monitor has (a lower LR does not switch
    it on): the event names the cause and the cures."""

    kind = DEAD_UNITS
    prefix = DEAD_UNITS_PREFIX
    config_class = DeadUnitsConfig

    def message(self, group: str, value: float) -> str:
        return (
            f"{_fmt(100 * value)}% of the units of a layer in group {group} are dead: their gradients "
            "were exactly zero on every sample of the last ones (no input switches them on; "
            f"told from {_fmt(100 * self.config.threshold)}%). They no longer learn and the layer works with "
            "what is left. Causes: a too-high LR (early, without warm-up), a large negative bias. "
            "Cures: a lower LR or a warm-up, LeakyReLU/GELU, re-initialising the dead units"
        )


@register_detector("adam_eps", config=AdamEpsConfig, kinds={ADAM_EPS: [(1, [])]})
class AdamEps(_ToldShare):
    """``adam_eps/<group>``: the share of the group's momentum (its elements weighed by |m|) whose
    bias-corrected second moment is under eps squared (``stats.eps_dominated``). The monitor does
    not change an optimizer's hyperparameters: the event names the cause and the cures."""

    kind = ADAM_EPS
    prefix = ADAM_EPS_PREFIX
    config_class = AdamEpsConfig

    def message(self, group: str, value: float) -> str:
        return (
            f"in group {group}, {_fmt(100 * value)}% of the momentum is on weights whose second moment is under "
            f"the optimizer's eps (sqrt(v) < eps; told from {_fmt(100 * self.config.threshold)}%): eps, not the "
            "gradients, sizes their steps, lr * m / eps, so the optimizer moves them far less than "
            "Adam's ~lr and no longer adapts to each weight's scale (Adam becomes SGD at lr / eps). "
            "Causes: an eps set for another gradient scale (1e-3 to 1e-1), gradients scaled down (a "
            "loss multiplied by a small factor, fp16 gradients not unscaled), or gradients that vanish as "
            "the loss reaches its floor (a run that memorised its data or converged, where smaller steps "
            "do no harm). Cures for the first two: a smaller eps (1e-8 to 1e-6), gradients at their "
            "natural scale"
        )


@register_detector(
    "bn_var_spike", config=BnVarSpikeConfig, kinds={BN_VAR_SPIKE: [(1, [SKIP_STEP])], BN_VAR_SHIFT: [(1, [])]}
)
class BnVarSpike(Detector):
    """``bn_var_ratio/<group>`` at or over ``ratio`` after the warm-up: the step's batch showed a
    BatchNorm layer a variance that many times what it has averaged (``stats.BatchVarRatio``). The
    batch, not the model: skipped, however often (no escalation), which puts the running statistics
    back (with the undo copy: ``actions.undo``). More than ``accept_after`` in a row are the data's
    new scale: told as ``bn_var_shift`` and trained on."""

    kind = BN_VAR_SPIKE

    def __init__(self, config: BnVarSpikeConfig | None = None):
        self.config = config or BnVarSpikeConfig()
        self.seen = 0  # steps measured since the start (or the last shift)
        self.in_a_row = 0  # spikes in a row

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seen, self.in_a_row = int(state.get("seen", 0)), int(state.get("in_a_row", 0))

    def new_regime(self, step: int) -> None:
        """The data changed: its scale may have too. The warm-up starts again (as after a shift)."""
        self.seen = self.in_a_row = 0

    def check(self, step: int, stats: Mapping[str, float]) -> list[Finding]:
        cfg = self.config
        values = {k[len(BN_VAR_RATIO_PREFIX) :]: v for k, v in stats.items() if k.startswith(BN_VAR_RATIO_PREFIX)}
        if not values:
            return []
        self.seen += 1
        # (a non-finite ratio: non-finite inputs, which the core reports as a bad batch)
        over = {g: v for g, v in values.items() if S.finite(v) and v >= cfg.ratio}
        if self.seen <= cfg.warmup or not over:
            self.in_a_row = 0
            return []
        self.in_a_row += 1
        if self.in_a_row > cfg.accept_after:
            self.seen = self.in_a_row = 0
            group, value = max(over.items(), key=lambda kv: kv[1])
            return [
                Finding(
                    BN_VAR_SHIFT,
                    f"bn_var_ratio/{group} = {_fmt(value)}: the batches' variance at a BatchNorm layer has been "
                    f"over {_fmt(cfg.ratio)}x its running variance for {cfg.accept_after + 1} steps in a row: the "
                    "data's scale changed, taken as the new one (told, trained on)",
                    {"ratio": value, "threshold": cfg.ratio, "steps": cfg.accept_after + 1},
                    where=group,
                )
            ]
        return [
            Finding(
                self.kind,
                f"bn_var_ratio/{g} = {_fmt(v)}: this batch's variance at a BatchNorm layer is {_fmt(v)}x the running "
                f"variance it is averaged into (threshold {_fmt(cfg.ratio)}x): a batch far off the data's scale "
                "(inputs not normalised, another source's data), whose loss BatchNorm hides in training while it "
                "writes its variance into the statistics evaluation uses; skipped, the statistics put back",
                {"ratio": v, "threshold": cfg.ratio, "in_a_row": self.in_a_row},
                where=g,
            )
            for g, v in over.items()
        ]


def build_detectors(config: DetectorsConfig | None = None) -> list[Detector]:
    """The enabled registered detectors, in registration order (built-ins first)."""
    cfg = config or DetectorsConfig()
    built: list[Detector] = []
    for name, spec in DETECTORS.items():
        section = getattr(cfg, name) if spec.config is not None else None
        if section is not None and not getattr(section, "enabled", True):
            continue
        det = spec.cls(section) if section is not None else spec.cls()
        det.name = name
        built.append(det)
    return built
