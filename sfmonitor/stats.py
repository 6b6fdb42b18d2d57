"""Statistics collectors. Everything here returns 0-d tensors; nothing reads them to the host.

The monitor gathers every tensor of a step into one dict and calls ``read_all`` once: that is the
step's single host synchronisation. Per-parameter norms come from fused ``torch._foreach_norm``.

Metric keys, built by the functions below (how each combines across ranks: ``REDUCTIONS``):

=============================  ==============================================================
key                            meaning
=============================  ==============================================================
``loss/total``                 weighted total of ``combine()``, mean over the step's micro-batches
``loss/<c>``                   loss component ``c``, mean over micro-batches
``loss_weight/<c>``            weight of ``c`` used this step (after any reweighting)
``loss_ratio/<a>/<b>``         ``(L_a + 1e-6) / (L_b + 1e-6)`` (the report's rule)
``grad_norm/total``            L2 norm of all (unscaled) gradients
``grad_norm/<group>``          L2 norm of the group's gradients
``param_norm/<group>``         L2 norm of the group's parameters before the update
``update_ratio/<group>``       ``||theta_after - theta_before|| / ||theta_before||`` over the step
``block_grad_norm/<block>``    L2 norm of the gradients of one block of a stack of like blocks
                               inside a group (a BERT's ``encoder.layer.<i>``), measured where a
                               detector asks for them (``vanishing_gradient``)
``block_update_ratio/<block>`` the update ratio of that block
``grad_ratio/<a>/<b>``         ``||dL_a/dtheta|| / ||dL_b/dtheta||`` on parameters shared by a and b
``grad_cos/<a>/<b>``           cosine between ``dL_a/dtheta`` and ``dL_b/dtheta`` on those parameters
``amp/loss_scale``             the GradScaler's scale when the step was taken
``amp/skipped_steps``          steps the GradScaler skipped so far
``lr/<i>``                     learning rate of param group ``i`` used for the step
``act_absmax/<module>``        max |activation| seen in the module (overflow watch)
``attn_logit_max/<module>``    max attention logit of an attention module (``/h<i>``: per head)
``attn_entropy/<module>``      mean softmax entropy (nats) of its attention rows, over heads
``dead_units/<group>``         the largest share, over the group's layers, of units that died
                               (gradient rows exactly zero on the last samples, not before)
``bn_var_ratio/<group>``       the largest, over the group's BatchNorm layers, of the step's batch
                               variance over the running variance it was averaged into (the
                               geometric mean over the layer's channels)
``update_stale/<group>``       of the group's bf16/fp16 parameters: the share of the gradient's
                               mass on elements the update left unchanged (rounded away);
                               ``update_stale/total`` over all of them
``adam_eps/<group>``           of an Adam-family group, weighed by ``|m|``: the share of elements
                               whose bias-corrected ``sqrt(v)`` is under ``eps`` (sampled)
``grad_clip/user``             1.0 where the step's statistics were taken before the user's own
                               ``clip_grad_norm_`` (``userclip.py``)
``grad_clip/coef``             that clip's coefficient: norm after it over norm before it
=============================  ==============================================================

Sharded parameters (FSDP2 ``fully_shard``: DTensor parameters and gradients) are measured on each
rank's local shard. A norm key then carries this rank's *share* of the global sum of squares
(``group_norms`` weighs each tensor by ``sharding.square_share``) and is reduced as
``Reduce.NORM``: the root of the sum over ranks of the squares. For replicated tensors (DDP) the
share is 1/world, so the result is the norm every rank holds, as before; for shards it is the norm
of the full parameters. docs/distributed.md has the whole story.
"""

from __future__ import annotations

import enum
import functools
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from .errors import ConfigError
from .schema import Section, option

LOSS_TOTAL = "loss/total"
LOSS = "loss/{}"
LOSS_WEIGHT = "loss_weight/{}"
LOSS_RATIO = "loss_ratio/{}/{}"
GRAD_NORM_TOTAL = "grad_norm/total"
GRAD_NORM = "grad_norm/{}"
PARAM_NORM = "param_norm/{}"
UPDATE_RATIO = "update_ratio/{}"
BLOCK_GRAD_NORM = "block_grad_norm/{}"
BLOCK_UPDATE_RATIO = "block_update_ratio/{}"
# Of a group's low-precision (bf16/fp16) parameters: the share of the gradient's mass (sum of |g|)
# on elements the update left exactly unchanged, rounded away (only groups holding such parameters;
# update_stale/total: over all of them).
UPDATE_STALE = "update_stale/{}"
# Of a group's nn.Linear / nn.Conv layers: the largest share of a layer's units (output features,
# output channels) that died: gradient row exactly zero on each of the last
# ``stats.dead_units_samples`` sampled steps, non-zero on one before (``DeadUnitCounter``).
DEAD_UNITS = "dead_units/{}"
# Of a group's elements an Adam-family optimizer has a second moment for, weighed by |m|: the share
# whose bias-corrected sqrt(v) is under the optimizer's eps, where eps, not the gradient's scale,
# sets the step (``eps_dominated``).
ADAM_EPS = "adam_eps/{}"
# Of a group's BatchNorm layers (running statistics on): the largest ratio of the variance the
# step's batch showed a layer to the running variance it was averaged into (the geometric mean over
# its channels), inferred from the running variance before and after the step's forward and the
# layer's momentum (``BatchVarRatio``): ~1 for an ordinary batch, 1e6 for inputs 1e3x their scale.
BN_VAR_RATIO = "bn_var_ratio/{}"
LOW_PRECISION = (torch.bfloat16, torch.float16)
# The user's LR of a group's update (the largest of its parameters' param groups, before the
# monitor's LR drop): given to the after-update detectors with the step's values, not published
# (lr/<i> is: the LR used, per param group).
UPDATE_LR = "update_lr/{}"
# The user's LR of the group's next update (the step that judges it: set by the loop or its
# scheduler before that step's optimizer.step()): given to the after-update detectors beside
# UPDATE_LR, not published. An update made at an LR far above both the LRs before it and this one
# was made at an excursion of the LR, not at the schedule's level.
NEXT_LR = "next_lr/{}"
# The monitor's LR scale (lr_drop) an update was made under, given beside UPDATE_LR (1.0: the
# user's LR as set), not published: an LR the monitor held down is no level the schedule reached.
UPDATE_LR_SCALE = "update_lr_scale"
# Given (1.0) with the run's last update when detach() judges it: no step came after it, so no loss
# was measured on the updated weights; a test that asks the loss for evidence of harm tells instead.
# Also where a step the loop skipped judges the update under torch.distributed (Monitor._forward_starts:
# each rank's loss is its own batch's, and the ranks must decide alike).
LAST_UPDATE = "last_update"
# The loss measured after that update (the next step's loss/total, on the updated weights): given
# to the after-update detectors with the update's step when the update landed, not published (it
# is that step's loss).
LOSS_AFTER_UPDATE = "loss_after_update"
GRAD_RATIO = "grad_ratio/{}/{}"
GRAD_COS = "grad_cos/{}/{}"
AMP_LOSS_SCALE = "amp/loss_scale"
AMP_SKIPPED = "amp/skipped_steps"
LR = "lr/{}"
ACT_ABSMAX = "act_absmax/{}"

RATIO_EPS = 1e-6  # the report's epsilon in r = (L_v + 1e-6) / (L_f + 1e-6)

# Internal values of a step: read in the same single host read as the statistics, used by the
# monitor's own checks, never shown in ``monitor.stats`` or sent to sinks.
GRAD_NONFINITE_COUNT = "internal/grad_nonfinite_count"  # parameters with a non-finite gradient
GRAD_FIRST_NONFINITE = "internal/grad_first_nonfinite"  # index of the first one (-1: none here)
PARAM_NONFINITE_COUNT = "internal/param_nonfinite_count"
PARAM_FIRST_NONFINITE = "internal/param_first_nonfinite"
AMP_FOUND_INF = "internal/amp_found_inf"  # the GradScaler's found-inf, summed
ACT_FIRST_NONFINITE = "internal/act_first_nonfinite"
INPUT_NONFINITE = "internal/input_nonfinite"  # NaN/+inf values in the step's floating inputs
# [sum, sum of squares] of the step's input tensors (forensics._fingerprint): equal step after step
# where the loop feeds one batch (full-batch training); summed over ranks
INPUT_FINGERPRINT = "internal/input_fingerprint"
# Whether this step's gradients were accumulated onto the last step's (1), reset (0), not seen (-1)
GRADS_NOT_RESET = "internal/grads_not_reset"
# 1 where the loop announced a change of data for this step (monitor.new_regime()), else 0: a
# maximum across ranks, so that one rank's announce applies on every rank alike
NEW_REGIME = "internal/new_regime"
# Elements of the step's input tensors (all its micro-batches; summed over ranks): the batch's size
INPUT_SIZE = "internal/input_size"
# 1 where the step's inputs have a shape per example (all but the first dimension) that none of the
# last steps' had (images resized, a longer sequence length), else 0: a maximum across ranks
NEW_INPUT_SHAPE = "internal/new_input_shape"
# Parameters whose values the loop wrote through .data since the last update, by more than it
# moved them (loopwrites): counted at the steps that sample them, a maximum across ranks
VALUES_WRITTEN = "internal/values_written"
# The step's batch as a share of the usual one (its input elements over the median of the last
# steps'), given to the detectors where under 1 (an epoch's short last batch), not published: its
# loss and gradient are noisier by 1 / sqrt(share)
BATCH_SHARE = "batch_share"
# The step's loss at combine()'s weights before the loop changed them in this step (the total where
# they did not change): what the new weights did to the total (Monitor._loss_reweighted)
LOSS_AT_OLD_WEIGHTS = "internal/loss_at_old_weights"
# The BatchNorm layer (index in BatchVarRatio's list) with the largest bn_var_ratio this step
BN_VAR_WORST = "internal/bn_var_worst"
# Under torch.distributed only: a vector of 4 x world slots, one-hot per rank (rank r fills slot r
# of each quarter): [its loss is non-finite, its local non-finite gradient count, its local
# non-finite parameter count, its non-finite input count]. Summed across ranks, it says where a
# non-finite value started.
NONFINITE_BY_RANK = "internal/nonfinite_by_rank"
INTERNAL = frozenset(
    {
        GRAD_NONFINITE_COUNT,
        GRAD_FIRST_NONFINITE,
        PARAM_NONFINITE_COUNT,
        PARAM_FIRST_NONFINITE,
        AMP_FOUND_INF,
        ACT_FIRST_NONFINITE,
        NONFINITE_BY_RANK,
        INPUT_NONFINITE,
        INPUT_FINGERPRINT,
        GRADS_NOT_RESET,
        NEW_REGIME,
        INPUT_SIZE,
        NEW_INPUT_SHAPE,
        VALUES_WRITTEN,
        LOSS_AT_OLD_WEIGHTS,
        BN_VAR_WORST,
    }
)


def is_internal(key: str) -> bool:
    """A value the monitor reads for its own checks (``INTERNAL``), never shown or logged."""
    return key in INTERNAL


class Reduce(enum.Enum):
    """How a value combines across ranks in the step's read (``read_all`` under torch.distributed)."""

    MEAN = "mean"  # identical or comparable on every rank (losses, LRs)
    SUM = "sum"  # counts of events on each rank, one-hot per-rank slots
    MAX = "max"  # maxima: one rank near a limit must not be diluted by the others (NaN counts as inf)
    LOCAL = "local"  # indices into this rank's own lists: kept as they are
    FIRST = "first"  # indices into lists every rank holds alike: the smallest index >= 0, else -1
    NORM = "norm"  # this rank's share of a norm: the root of the sum over ranks of the squares


# The table: exact keys, then key families (a format string's prefix). Anything else: MEAN.
REDUCTIONS: dict[str, Reduce] = {
    # Parameters with a non-finite gradient: every rank holds the same parameter list, and the
    # gradient all-reduce / reduce-scatter spreads a NaN to every rank, so the count is the largest
    # over ranks (a sum would count one bad parameter once per rank).
    GRAD_NONFINITE_COUNT: Reduce.MAX,
    PARAM_NONFINITE_COUNT: Reduce.MAX,
    AMP_FOUND_INF: Reduce.SUM,
    GRAD_FIRST_NONFINITE: Reduce.FIRST,
    PARAM_FIRST_NONFINITE: Reduce.FIRST,
    ACT_FIRST_NONFINITE: Reduce.FIRST,
    NONFINITE_BY_RANK: Reduce.SUM,
    INPUT_NONFINITE: Reduce.SUM,  # a bad batch on one rank is a bad step for all
    INPUT_FINGERPRINT: Reduce.SUM,  # every rank's batch the same as the step before, or not
    INPUT_SIZE: Reduce.SUM,  # the global batch
    NEW_INPUT_SHAPE: Reduce.MAX,  # new inputs on one rank: new data for the step on every rank
    GRADS_NOT_RESET: Reduce.MAX,  # one rank's loop forgot: told on every rank
    NEW_REGIME: Reduce.MAX,  # one rank's loop announced it: applied on every rank
    VALUES_WRITTEN: Reduce.MAX,  # one rank's shards written: the loop's change on every rank
    BN_VAR_RATIO.format(""): Reduce.MAX,  # one rank's bad batch
    BN_VAR_WORST: Reduce.FIRST,
    ACT_ABSMAX.format(""): Reduce.MAX,
    GRAD_NORM.format(""): Reduce.NORM,
    BLOCK_GRAD_NORM.format(""): Reduce.NORM,
    PARAM_NORM.format(""): Reduce.NORM,
    DEAD_UNITS.format(""): Reduce.SUM,  # per layer: dead units, units (FSDP2: each rank's rows)
    ADAM_EPS.format(""): Reduce.SUM,  # elements under eps, elements (FSDP2: each rank's shard)
}


def reduction_of(key: str) -> Reduce:
    """How ``key`` combines across ranks: its own entry in REDUCTIONS, else its family's, else MEAN."""
    if key in REDUCTIONS:
        return REDUCTIONS[key]
    family = key[: key.find("/") + 1] if "/" in key else None
    return REDUCTIONS.get(family, Reduce.MEAN) if family else Reduce.MEAN


# Measured in float32 as they are; any other dtype goes through ``_measurable`` first.
_NARROW_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})


# Tensors measured (or, on a GPU, differenced: undo.update_norms) by one fused call at most: its
# result is a tensor object per input, all alive until stacked; a few hundred at a time stay under
# the garbage collector's threshold (700 new objects), where a model's thousand parameters ran it
# at every call
NORMS_AT_ONCE = 256


def norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms as one vector (fused; empty input gives an empty vector): float32, or
    float64 when any tensor is float64 or complex128 (its norm can exceed the float32 range).

    Sparse gradients (nn.Embedding(sparse=True)): the norm of their coalesced values. Complex
    tensors: the norm of their real view (|z|^2 = re^2 + im^2, the same L2 norm). Integer or bool
    tensors (a parameter that does not train): measured in float64."""
    if not tensors:
        return torch.zeros(0)
    dense = [t.coalesce().values() if t.is_sparse else t for t in tensors]
    if {t.dtype for t in dense} <= _NARROW_FLOATS:
        # dtype=float32: the norm of finite fp16 values can exceed 65504 and must not read as inf.
        if len(dense) <= NORMS_AT_ONCE:
            return torch.stack(torch._foreach_norm(dense, 2, dtype=torch.float32))
        return torch.cat(
            [
                torch.stack(torch._foreach_norm(dense[i : i + NORMS_AT_ONCE], 2, dtype=torch.float32))
                for i in range(0, len(dense), NORMS_AT_ONCE)
            ]
        )
    dense = [_measurable(t) for t in dense]
    # float64 cannot be narrowed to float32 (torch refuses, and its norm may not fit): measured in
    # float64, the others in float32 as above, then all widened to float64 (exact).
    wide = [i for i, t in enumerate(dense) if t.dtype == torch.float64]
    narrow = [i for i, t in enumerate(dense) if t.dtype != torch.float64]
    out: list[torch.Tensor] = [torch.empty(0)] * len(dense)
    if narrow:
        for i, n in zip(narrow, torch._foreach_norm([dense[i] for i in narrow], 2, dtype=torch.float32)):
            out[i] = n.double() if wide else n
    if wide:
        for i, n in zip(wide, torch._foreach_norm([dense[i] for i in wide], 2)):
            out[i] = n
    return torch.stack(out)


def _measurable(t: torch.Tensor) -> torch.Tensor:
    """A real floating-point tensor with the L2 norm of ``t`` (dense): see ``norms``."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    if not t.is_floating_point():
        return t.double()
    return t


@dataclass(frozen=True)
class TensorIndex:
    """Where each measured tensor of a step goes, built once per set of tensors, on their device
    (no host-to-device copy per step): its ``group``, its ``share`` of the global sum of squares
    (``sharding.square_share``; None: 1 for every tensor) and its ``position`` in the monitor's
    parameter list (so a first-offender index means the same parameter on every rank)."""

    group: torch.Tensor
    share: torch.Tensor | None
    position: torch.Tensor

    def param_of(self, first: torch.Tensor) -> torch.Tensor:
        """The parameter index of ``first`` (a 0-d index into these tensors, -1: none), no sync."""
        if not self.position.numel():
            return first
        # gather, not position[first]: indexing with a 0-d tensor reads it on the host (a sync)
        at = self.position.gather(0, first.clamp(0, self.position.numel() - 1).reshape(1)).reshape(())
        return torch.where(first >= 0, at, torch.full_like(at, -1))


def group_norms(per_tensor: torch.Tensor, index: TensorIndex | torch.Tensor, n_groups: int) -> torch.Tensor:
    """Combine per-tensor norms into per-group norms: sqrt(sum of share * norm^2) for each group.

    ``index``: a ``TensorIndex`` (or a plain tensor of group indices: share 1). Squares add up in
    float64 (float32 on MPS, which has no float64): the square of a finite fp32 norm above 1.8e19
    must not read as inf. With shares, the result is this rank's share of the norm (``Reduce.NORM``
    completes it across ranks)."""
    group, share = (index.group, index.share) if isinstance(index, TensorIndex) else (index, None)
    dtype = torch.float32 if per_tensor.device.type == "mps" else torch.float64
    sq = torch.zeros(n_groups, dtype=dtype, device=per_tensor.device)
    if per_tensor.numel():
        squares = per_tensor.to(dtype).square()
        sq.index_add_(0, group, squares * share.to(dtype) if share is not None else squares)
    return sq.sqrt()


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True in a 1-d bool mask, or -1 when none, as a 0-d tensor (no sync)."""
    if mask.numel() == 0:
        return torch.full((), -1, dtype=torch.long, device=mask.device)
    first = mask.to(torch.uint8).argmax()  # the first maximum: the first True (0 when there is none)
    return torch.where(mask.any(), first, -1)  # not mask[first]: that reads `first` on the host


def update_norms_(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-tensor ||after - before|| (fused). Overwrites ``before`` with the difference."""
    if not before:
        return torch.zeros(0)
    torch._foreach_sub_(list(before), list(after))
    return norms(before)


def stale_shares(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    groups: Sequence[int],
    n_groups: int,
) -> torch.Tensor:
    """Per group (``groups[i]``: tensor i's group index), then over all of them (the last of the
    ``n_groups + 1`` values), the share of the gradient's mass (sum of |g|) on elements that
    ``after`` holds exactly as ``before``: an update under half a unit in the last place of its
    weight rounds away (bf16 keeps 8 significant bits: an Adam step of lr is lost on every weight
    over ~256 lr). Weighted by |g| so that elements the gradient barely touched count little (SGD
    loses those harmlessly). No host read; 0 where a group had no gradient."""
    lost = torch.zeros(n_groups, dtype=torch.float32, device=before[0].device if before else None)
    mass = torch.zeros_like(lost)
    for b, a, g, gi in zip(before, after, grads, groups):
        if g is None or g.is_sparse:
            continue
        weight = g.abs()
        mass[gi] += weight.sum(dtype=torch.float32)
        lost[gi] += (weight * (a == b)).sum(dtype=torch.float32)
    lost, mass = torch.cat([lost, lost.sum().reshape(1)]), torch.cat([mass, mass.sum().reshape(1)])
    return lost / mass.clamp_min(torch.finfo(torch.float32).tiny)


def zero_rows(grad: torch.Tensor) -> torch.Tensor:
    """Which rows (dim 0: nn.Linear's output features, a convolution's output channels) of a
    gradient are exactly zero: a ReLU unit that no input of the batch switched on. No host read.
    (Its largest and smallest element both zero: two reductions, 10x faster on CPU than a max-abs
    norm; a NaN row is no zero row.)"""
    rows = (torch.view_as_real(grad) if grad.is_complex() else grad).reshape(grad.shape[0], -1)
    return (rows.amax(1) == 0) & (rows.amin(1) == 0)


class DeadUnitCounter:
    """``dead_units/<group>``: per layer, the share of its units that died: their gradient row was
    exactly zero on each of the last ``samples`` samples, and non-zero on some sample before; per
    group, its layers' largest share. Units never seen alive are not counted: a deep narrow ReLU
    MLP at PyTorch's default init has most units of some layers off from the start, for every input,
    and trains as well as with an init that has few (a helper's sweep: 0.66-0.75 of a layer at
    batch 1-64 for units off from the start; units that died, 0.09-0.25).

    Each unit's count of zero rows in a row and whether it was seen alive live on the device (5 bytes
    a unit). ``measure`` (before
    the step's read) gives per group, per layer, the units whose count reaches ``samples`` with this
    sample, those already there, the units alive in it and the units: summed across ranks at the
    read (FSDP2: each rank counts its own rows; a DDP replica doubles every count alike), so the
    shares are the unsharded model's. ``resolve`` (after it) turns them into shares and moves the
    counts on. A layer whose gradient is zero everywhere (on every rank: an expert no token reached,
    a loss that did not use it with ``zero_grad(set_to_none=False)``) says nothing about its units:
    their counts stay."""

    def __init__(self, layers: Sequence[tuple[int, str]], samples: int):
        self.layers = list(layers)  # (parameter index, group name) of each weight watched
        self.samples = samples
        self.streaks: dict[int, torch.Tensor] = {}
        self.alive: dict[int, torch.Tensor] = {}  # per unit: a non-zero gradient row seen on some sample
        self._units: dict[int, torch.Tensor] = {}  # a layer's local units, an int64 tensor (built once)
        self._pending: dict[str, list[tuple[int, torch.Tensor | None]]] = {}

    def measure(self, grads: Mapping[int, torch.Tensor]) -> dict[str, Vector]:
        """``grads``: the local gradient of each watched weight that has one, by parameter index."""
        k = self.samples
        self._pending = {}
        parts: dict[str, list[torch.Tensor]] = {}
        for i, group in self.layers:
            g = grads.get(i)
            if g is None or g.is_sparse:
                continue
            units = self._units.get(i)
            if units is None:
                units = self._units[i] = torch.tensor(g.shape[0], device=g.device)
            zero: torch.Tensor | None = None
            slots = torch.zeros(4, dtype=torch.int64, device=g.device)  # FSDP2: none of the layer's rows here
            if g.shape[0]:
                zero = zero_rows(g)
                streak = self.streaks.get(i)
                if streak is None:
                    streak = self.streaks[i] = torch.zeros(g.shape[0], dtype=torch.int32, device=g.device)
                    self.alive[i] = torch.zeros(g.shape[0], dtype=torch.bool, device=g.device)
                was = self.alive[i]  # (a unit dead on the last k samples was alive before them)
                reached, kept = ((streak >= k - 1) & zero & was).sum(), ((streak >= k) & was).sum()
                slots = torch.stack([reached, kept, (~zero).sum(), units])
            self._pending.setdefault(group, []).append((i, zero))
            parts.setdefault(group, []).append(slots)
        return {DEAD_UNITS.format(group): Vector(torch.cat(p).float()) for group, p in parts.items()}

    def resolve(self, values: dict[str, Any]) -> None:
        """After the read: each group's slots in ``values`` become its largest share, and each
        layer's counts move on."""
        for group, layers in self._pending.items():
            key = DEAD_UNITS.format(group)
            slots = values.get(key)
            if not isinstance(slots, list):
                continue
            shares = []
            for j, (i, zero) in enumerate(layers):
                reached, kept, alive, units = slots[4 * j : 4 * j + 4]
                cut = alive == 0  # zero everywhere, on every rank
                if zero is not None and not cut:
                    streak = self.streaks[i]
                    self.streaks[i] = torch.where(zero, streak + 1, 0)
                    self.alive[i] = self.alive[i] | ~zero
                if units > 0:
                    shares.append((kept if cut else reached) / units)
            values[key] = max(shares, default=0.0)
        self._pending = {}


@torch.no_grad()
def eps_dominated(
    optimizer: torch.optim.Optimizer,
    group_of: Mapping[int, str],
    local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> dict[str, Vector]:
    """``adam_eps/<group>`` before the read: per group, [the elements whose bias-corrected second
    moment is under eps squared, the elements with a second moment], each weighed by |m| (the
    first moment, where the state has one; else counted), as a ``Vector`` (summed across ranks;
    ``shares`` turns it into the share after the read). Adam's step is lr * m / (sqrt(v) + eps):
    where sqrt(v) is under eps, eps sets it, and the update is an SGD step at lr / eps rather than
    Adam's ~lr. Weighed by |m|, a weight the optimizer barely moves counts little (a rarely seen
    embedding row, whose v and m both decayed: counted, a bag-of-words model's embedding read
    0.64-0.70 at eps 1e-5 with no harm, 0.14-0.23 weighed). Elements whose v is exactly zero (never
    a gradient) are not counted. Every param group with ``eps`` and ``betas`` whose state holds
    ``exp_avg_sq`` (``max_exp_avg_sq`` with amsgrad: the one the step divides by) counts: Adam,
    AdamW, NAdam, RAdam. ``group_of``: the
    monitor's group of each parameter, by ``id``; ``local``: a state's part on this rank (FSDP2).
    The step count stays a tensor (no host read)."""
    counts: dict[str, list[torch.Tensor]] = {}
    for pg in optimizer.param_groups:
        eps, betas = pg.get("eps"), pg.get("betas")
        if not isinstance(eps, (int, float)) or not isinstance(betas, (tuple, list)) or eps <= 0:
            continue
        for p in pg["params"]:
            st = optimizer.state.get(p)
            group = group_of.get(id(p))
            if group is None or not st:
                continue
            v = st.get("max_exp_avg_sq", st.get("exp_avg_sq"))
            if not isinstance(v, torch.Tensor) or v.is_sparse:
                continue
            v = local(v)
            step = st.get("step", 1)
            corr = 1 - float(betas[1]) ** (step.to(torch.float64) if isinstance(step, torch.Tensor) else float(step))
            have = v > 0
            under = have & (v < (eps * eps) * corr)
            m = st.get("exp_avg")
            if isinstance(m, torch.Tensor) and not m.is_sparse:  # weighed by |m|, the step's numerator
                w = local(m).abs().float()
                counts.setdefault(group, []).append(torch.stack([(w * under).sum(), (w * have).sum()]))
            else:
                counts.setdefault(group, []).append(torch.stack([under.sum(), have.sum()]).float())
    return {ADAM_EPS.format(g): Vector(torch.stack(ps).sum(0).float()) for g, ps in counts.items()}


def shares(values: dict[str, Any], prefix: str) -> None:
    """After the read: each ``[part, whole]`` value under ``prefix`` becomes part / whole (0 for an
    empty whole)."""
    for key, v in values.items():
        if key.startswith(prefix) and isinstance(v, list) and len(v) == 2:
            values[key] = v[0] / v[1] if v[1] > 0 else 0.0


def _windows(t: torch.Tensor, fraction: float) -> tuple[torch.Tensor, int, int]:
    """(the tensor cut along its first dimension or flat, window length, number of windows)."""
    flat = t.view(-1) if t.is_contiguous() else (t if t.ndim else t.reshape(1))
    n = flat.shape[0]
    k = max(1, math.ceil(fraction * n))
    return flat, k, max(1, math.ceil(n / k))


class BatchVarRatio:
    """``bn_var_ratio/<group>``: per BatchNorm layer whose running statistics are on, how many
    times the running variance the step's batch's variance was, per channel, inferred from the
    running variance before the step's forward (``rebase``, after the last step's actions: a skip
    put back what its batch wrote) and after it (``measure``, before the step's read): a forward
    in training mode sets ``running_var = (1 - m) * running_var + m * batch_var``, so the batch's
    ratio is ``(after / before - (1 - m)) / m`` (m: the layer's momentum; a cumulative average,
    momentum None: 1 / the batches it has counted). A layer's ratio is the geometric mean over its
    channels (each at least 0.01, so a channel with no variance does not hide the others): a batch
    off the data's scale is off in most channels, while one feature's outlier (heavy-tailed raw
    features into a BatchNorm1d) is off in one. A layer whose batch count went down was reset by
    the loop (``reset_running_stats()``): its ratio is 1. Per group, its layers' largest;
    ``BN_VAR_WORST``, the layer with the largest of all.

    In training mode BatchNorm normalises by the batch's own statistics, so a batch far off the
    data's scale (inputs 1e3x: a pipeline that skipped its normalisation once) trains with an
    ordinary loss and gradients, while the variance it writes into ``running_var`` (1e6x) is what
    evaluation normalises by. Several forwards in a step (accumulation) compound into one ratio.
    Costs a copy of the running variances (channels only) and a dozen small ops a step, whatever
    the number of layers; no host read."""

    MIN_CHANNEL_RATIO = 0.01

    def __init__(
        self,
        layers: Sequence[tuple[str, Any, int]],
        groups: Sequence[str],
        local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ):
        self.layers = list(layers)  # (module name, BatchNorm module, group index)
        self.groups = list(groups)
        self._local = local  # a DTensor buffer's local part (sharding.local)
        self._present: list[int] = []  # the groups that hold a layer
        self._before: torch.Tensor | None = None  # every layer's running variance, back to back
        self._counts_before: torch.Tensor | None = None
        self._index: torch.Tensor | None = None  # per layer: its group
        self._layer_of: torch.Tensor | None = None  # per channel: its layer
        self._sizes = torch.zeros(0)
        self._momenta: tuple[float | None, ...] = ()
        self._fixed = torch.zeros(0)
        self._cumulative: torch.Tensor | None = None

    def _flat(self) -> torch.Tensor:
        """The running variances of every layer, back to back (a copy), in float32 (float64 when
        one is float64)."""
        parts = [self._local(m.running_var).reshape(-1) for _, m, _ in self.layers]
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
        return torch.cat([p.to(dtype) for p in parts])

    def _counts(self) -> torch.Tensor:
        return torch.stack([self._local(m.num_batches_tracked) for _, m, _ in self.layers])

    @torch.no_grad()
    def rebase(self) -> None:
        """The running variances (and batch counts) as the next forward finds them."""
        self._before = self._flat() if self.layers else None
        self._counts_before = self._counts() if self.layers else None

    @torch.no_grad()
    def measure(self) -> dict[str, Any]:
        """This step's ratios per group (and the worst layer's index), as tensors; {} before the
        first ``rebase`` or when a layer's running variance changed shape (a new one: rebased)."""
        before = self._before
        if before is None:
            return {}
        after = self._flat()
        if after.shape != before.shape:
            return {}
        device, dtype = after.device, after.dtype
        momenta = tuple(m.momentum for _, m, _ in self.layers)
        if self._index is None or self._index.device != device or momenta != self._momenta:
            # built once (again if a momentum is changed): no host-to-device copy a step
            sizes = [self._local(m.running_var).numel() for _, m, _ in self.layers]
            self._present = sorted({g for _, _, g in self.layers})
            self._index = torch.tensor([g for _, _, g in self.layers], device=device)
            self._sizes = torch.tensor(sizes, dtype=dtype, device=device)
            self._layer_of = torch.repeat_interleave(  # (output_size: no read of the sizes on the host)
                torch.arange(len(sizes), device=device), self._sizes.long(), output_size=sum(sizes)
            )
            self._fixed = torch.tensor([1.0 if x is None else float(x) for x in momenta], dtype=dtype, device=device)
            cumulative = [i for i, x in enumerate(momenta) if x is None]
            self._cumulative = torch.tensor(cumulative, device=device) if cumulative else None
            self._momenta = momenta
        assert self._layer_of is not None
        counts = self._counts().to(device)
        m = self._fixed
        if self._cumulative is not None:  # a cumulative average: 1 / the batches counted, on the device
            m = m.index_put((self._cumulative,), 1.0 / counts[self._cumulative].clamp_min(1).to(m))
        m = m.clamp_min(1e-12)[self._layer_of]  # per channel
        grown = after / before.clamp_min(torch.finfo(torch.float32).tiny)
        per_channel = ((grown - (1 - m)) / m).clamp_min(self.MIN_CHANNEL_RATIO)
        logs = torch.zeros(len(self.layers), dtype=dtype, device=device).index_add_(
            0, self._layer_of, per_channel.log()
        )
        ratio = (logs / self._sizes).exp()
        if self._counts_before is not None:
            # a count that went down: the loop reset the statistics (reset_running_stats()), no batch
            ratio = torch.where(counts < self._counts_before, 1.0, ratio)
        per_group = torch.zeros(len(self.groups), dtype=dtype, device=device).scatter_reduce(
            0, self._index, ratio, "amax", include_self=False
        )
        out: dict[str, Any] = {BN_VAR_WORST: ratio.argmax()}
        for gi in self._present:
            out[BN_VAR_RATIO.format(self.groups[gi])] = per_group[gi]
        return out


class RotatingSlices:
    """``fraction`` of each tensor, a different window each turn (turn after turn they cover every
    element: a contiguous tensor is cut flat into windows of ceil(fraction * numel) elements, any
    other along its first dimension), paired with reused flat buffers to copy them into. Each
    window's two views are built once and kept (per tensor, at most 1 / fraction windows): building
    two views per tensor every step costs more than the copy of a 5% slice itself. When a tensor's
    storage changed (``p.data = ...``) every window and buffer is built again."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.buffers: list[torch.Tensor] = []
        self._ptrs: list[int] = []  # the storages the windows were built on
        # per tensor: (number of windows, {window: (live view, buffer view)})
        self._windows: list[tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = []

    def take(self, tensors: Sequence[torch.Tensor], turn: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ``turn``-th slices of ``tensors`` and, for each, a view of its buffer shaped alike."""
        ptrs = [t.data_ptr() for t in tensors]
        if ptrs != self._ptrs:
            self._build(tensors, ptrs)
        live, into = [], []
        for i, (count, views) in enumerate(self._windows):
            w = turn % count
            pair = views.get(w)
            if pair is None:
                flat, k, _ = _windows(tensors[i], self.fraction)
                view = flat[w * k : min(flat.shape[0], (w + 1) * k)]
                pair = views[w] = (view, self.buffers[i][: view.numel()].view(view.shape))
            live.append(pair[0])
            into.append(pair[1])
        return live, into

    def _build(self, tensors: Sequence[torch.Tensor], ptrs: list[int]) -> None:
        buffers: list[torch.Tensor] = []
        windows: list[tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = []
        for i, t in enumerate(tensors):
            flat, k, count = _windows(t, self.fraction)
            size = flat[:k].numel()  # the first window is the largest
            buf = self.buffers[i] if i < len(self.buffers) else None
            if buf is None or buf.numel() < size or buf.dtype != t.dtype or buf.device != t.device:
                buf = t.new_empty(size)
            buffers.append(buf)
            windows.append((count, {}))
        self.buffers, self._windows, self._ptrs = buffers, windows, ptrs


def ratio(a: torch.Tensor, b: torch.Tensor, eps: float = RATIO_EPS) -> torch.Tensor:
    return (a + eps) / (b + eps)


def loss_ratio_of(stats: Mapping[str, float], a: str, b: str) -> float | None:
    """``loss_ratio/<a>/<b>`` from read statistics, or (L_a + 1e-6) / (L_b + 1e-6) from
    ``loss/<a>`` and ``loss/<b>`` when the ratio key is absent; None when neither is there."""
    r = stats.get(LOSS_RATIO.format(a, b))
    if r is None:
        la, lb = stats.get(LOSS.format(a)), stats.get(LOSS.format(b))
        if finite(la) and finite(lb):
            r = (la + RATIO_EPS) / (lb + RATIO_EPS)
    return r


def shared_grad_stats(
    grads_a: Sequence[torch.Tensor | None], grads_b: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(||g_a|| / ||g_b||, cos(g_a, g_b)) over the parameters that both components reach."""
    pairs = [(a, b) for a, b in zip(grads_a, grads_b) if a is not None and b is not None]
    if not pairs:
        return None
    # complex: the real view (Re<a, b> = the dot product of the real views; the same norms)
    ga = [(torch.view_as_real(a) if a.is_complex() else a).float() for a, _ in pairs]
    gb = [(torch.view_as_real(b) if b.is_complex() else b).float() for _, b in pairs]
    na = norms(ga).square().sum().sqrt()
    nb = norms(gb).square().sum().sqrt()
    dot = torch.stack([(x * y).sum() for x, y in zip(ga, gb)]).sum()
    return ratio(na, nb), dot / (na * nb).clamp_min(1e-30)


@dataclass(frozen=True)
class NormRatio:
    """``num / den`` of two norms, each completed across ranks as ``Reduce.NORM`` before the
    division (``update_ratio/<group>``: ||delta theta|| / ||theta|| over every shard, not the mean
    of each rank's own ratio). ``read_all`` returns the float; both parts stay tensors until then."""

    num: torch.Tensor
    den: torch.Tensor
    eps: float = 1e-12


@dataclass(frozen=True)
class Vector:
    """A 1-d tensor read as a list of floats (per-rank slots), each slot reduced as its key says."""

    values: torch.Tensor


Value = torch.Tensor | NormRatio | Vector | float | int

# read_all's layouts of one step's values across ranks (their signature and reduction masks),
# cached by keys and sizes: the same keys come every step, so each is built and copied to the
# device once.
_LAYOUTS: dict[tuple[torch.device, tuple[tuple[str, int, bool], ...]], _Layout] = {}


def _slots(v: Value) -> int:
    if isinstance(v, NormRatio):
        return 2
    if isinstance(v, Vector):
        return v.values.numel()
    return 1


@dataclass(frozen=True)
class _Layout:
    """How ``read_all``'s vector of one device is laid out under a process group: the keys'
    signature (a crc of their names) and its two slots ahead of the values (``head``: crc, -crc,
    reduced by max), and which slots reduce how (``masks``: the signature's two, then each key's
    slots as ``reduction_of`` says, a ratio's two norms)."""

    sig: float
    head: torch.Tensor
    masks: dict[Reduce, torch.Tensor]


def _layout(ks: Sequence[str], named: Mapping[str, Value], device: torch.device, dtype: torch.dtype) -> _Layout:
    """``ks``' layout, made once per layout (a step's keys recur: cached)."""
    shape = tuple((k, _slots(named[k]), isinstance(named[k], NormRatio)) for k in ks)
    hit = _LAYOUTS.get((device, shape))
    if hit is None:
        how: list[Reduce] = [Reduce.MAX, Reduce.MAX]
        for k, n, is_ratio in shape:
            how += [Reduce.NORM] * 2 if is_ratio else [reduction_of(k)] * n
        masks = {r: torch.tensor([h is r for h in how]).to(device, non_blocking=True) for r in Reduce if r in set(how)}
        sig = float(zlib.crc32("\0".join(ks).encode()))
        head = torch.tensor([sig, -sig], dtype=dtype).to(device, non_blocking=True)
        if len(_LAYOUTS) > 64:  # keys that change every step (they should not): stay bounded
            _LAYOUTS.clear()
        hit = _LAYOUTS[(device, shape)] = _Layout(sig, head, masks)
    return hit


def _parts(v: Value, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    if isinstance(v, NormRatio):
        return [v.num.detach().reshape(1).to(dtype), v.den.detach().reshape(1).to(dtype)]
    if isinstance(v, Vector):
        return [v.values.detach().reshape(-1).to(dtype)]
    if isinstance(v, torch.Tensor):
        return [v.detach().reshape(1).to(dtype)]
    return [torch.tensor([float(v)], dtype=dtype).to(device, non_blocking=True)]


def _device_of(v: Value) -> torch.device:
    if isinstance(v, NormRatio):
        return v.num.device
    if isinstance(v, Vector):
        return v.values.device
    return v.device if isinstance(v, torch.Tensor) else torch.device("cpu")


_LAYOUT_ERROR = (
    "the ranks' monitors measured different statistics (different parameter groups, watched modules "
    "or loss components), and the step's statistics are reduced across ranks by position: attach the "
    "monitor to the same model on every rank and pass combine() the same component names. A model "
    "split into a different module on each rank (pipeline-parallel stages) is not supported "
    "(docs/distributed.md)"
)


def read_all(named: Mapping[str, Value], agree: bool = True, check_layout: bool = False) -> dict[str, Any]:
    """The one host read of a step: every value to a Python float in a single transfer per
    device (tensors are concatenated where they live, then read with one ``tolist()``).

    Values are single-element tensors or numbers (a float comes back), ``Vector`` (a list of floats
    comes back: per-rank slots) or ``NormRatio`` (its float ratio comes back).

    With ``agree`` and a process group up, the concatenated vector is first reduced across ranks
    (``integrations.distributed.agree``: one sum collective, plus one max collective when a key
    needs a maximum or a first index), each value as the REDUCTIONS table says, so every rank
    reads the same numbers and takes the same decision. Reads that only one rank may make
    (``monitor.stats``) pass ``agree=False``.

    Every rank must lay out the same keys. Each reduction carries their signature (a crc, in two
    max slots ahead of the values): ranks whose keys differ but whose vectors have one length (a
    loss component named otherwise on one rank) stop with a ``ConfigError`` on every rank, not a
    blend of unrelated values. ``check_layout`` (a monitor's first read: the same step on every
    rank) checks the length first, in one small collective of its own: vectors of different
    lengths (pipeline stages, a component one rank lacks) would abort inside gloo.
    """
    from .integrations.distributed import agree as all_ranks_agree
    from .integrations.distributed import layout_error, same_layout, world_size

    distributed = agree and world_size() > 1
    if not distributed:
        got, vectors = _local_vectors(named)
        for vec, decode in vectors:
            got.update(decode(vec.tolist()))  # the host synchronisation, once per device
        return {k: got[k] for k in named}
    # Laid out by key, not by the order this rank's dicts hold them in (rank 1 may pass combine()
    # its components in another order): the reduction is by position.
    by_device: dict[torch.device, list[str]] = {}
    for k in sorted(named):
        by_device.setdefault(_device_of(named[k]), []).append(k)
    out: dict[str, Any] = {}
    for device, ks in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64
        layout = _layout(ks, named, device, dtype)
        vec = torch.cat([layout.head, *(part for k in ks for part in _parts(named[k], dtype, device))])
        if check_layout:
            same_layout(ks, vec.numel() - 2, _LAYOUT_ERROR)
        vec = all_ranks_agree(vec, layout.masks)
        top, low, *flat = vec.tolist()  # the host synchronisation
        if top != layout.sig or low != -layout.sig:  # (the same reduced values on every rank: all raise)
            raise layout_error(ks, vec.numel() - 2, _LAYOUT_ERROR)
        out.update(_decode(named, [], ks, flat))
    return {k: out[k] for k in named}


@torch.no_grad()
def _local_vectors(
    named: Mapping[str, Value],
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, Callable[[list[float]], dict[str, Any]]]]]:
    """``read_all`` in one process, before the read: the numbers as they are, and per device one
    vector with a function that turns its list of floats into values. 0-d tensors are stacked per
    device and dtype (one op for each, not two per value); the rest goes as ``_parts`` says."""
    out: dict[str, Any] = {}
    scalars: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    rest: dict[torch.device, list[str]] = {}
    for k, v in named.items():
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            scalars.setdefault((v.device, v.dtype), []).append((k, v))
        elif isinstance(v, (int, float)):
            out[k] = float(v)
        else:
            rest.setdefault(_device_of(v), []).append(k)
    vectors: list[tuple[torch.Tensor, Callable[[list[float]], dict[str, Any]]]] = []
    for device in {d for d, _ in scalars} | set(rest):
        dtype = torch.float32 if device.type == "mps" else torch.float64
        keys: list[str] = []
        parts: list[torch.Tensor] = []
        for (d, _), kv in scalars.items():
            if d == device:
                keys += [k for k, _ in kv]
                parts.append(torch.stack([v for _, v in kv]).to(dtype))
        others = rest.get(device, [])
        for k in others:
            parts += _parts(named[k], dtype, device)
        vectors.append((torch.cat(parts), functools.partial(_decode, named, keys, others)))
    return out, vectors


def _decode(named: Mapping[str, Value], keys: list[str], others: list[str], flat: list[float]) -> dict[str, Any]:
    """The values of one device's vector as read: ``keys`` (0-d tensors stacked by
    ``_local_vectors``) first, one float each, then ``others`` in order, laid out as ``_parts``
    puts them."""
    got: dict[str, Any] = dict(zip(keys, flat))
    at = len(keys)
    for k in others:
        v = named[k]
        if isinstance(v, NormRatio):
            got[k], at = flat[at] / max(flat[at + 1], v.eps), at + 2
        elif isinstance(v, Vector):
            n = v.values.numel()
            got[k], at = flat[at : at + n], at + n
        else:
            got[k], at = flat[at], at + 1
    return got


def finite(x: Any) -> TypeGuard[float]:
    """A real number (not a bool, not None) that is neither NaN nor infinite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def rose(after: float, before: float, factor: float, start: float | None = None, signed: bool = False) -> bool:
    """Whether a loss went from ``before`` to over ``factor`` times it. A positive loss: by the
    ratio. A ``signed`` one, seen below zero (a Gaussian or flow negative log-likelihood, a
    loss with a negative constant), has no multiplicative scale: ``factor * before`` lies *below* a
    negative ``before``, and a small positive one near zero makes any move a large ratio (a Gaussian
    NLL from 0.07 to 0.30 read as 4.4x; with +10 added to the loss, 1.02x). Its rise must pass
    ``factor - 1`` times the progress it made down from ``start``, or, without a start, its size."""
    if before > 0 and not signed:
        return after > factor * before
    scale = start - before if start is not None and start > before else abs(before)
    return after - before > (factor - 1) * scale


def pair_keys(components: Iterable[str], pairs: Sequence[Sequence[str]]) -> list[tuple[str, str]]:
    """The configured pairs, or every pair (a, b), a before b in the order components came; under a
    process group in sorted order, the one order every rank knows without asking (ranks may give
    combine() its components in different orders, and each pair is one key of the step's
    reduction: ``grad_ratio/a/b`` on one rank must not meet ``grad_ratio/b/a`` on another)."""
    from .integrations.distributed import world_size

    comps = list(components)
    if pairs:
        return [(a, b) for a, b in pairs if a in comps and b in comps]
    if world_size() > 1:
        comps = sorted(comps)
    return [(a, b) for i, a in enumerate(comps) for b in comps[i + 1 :]]


@dataclass
class StatsConfig(Section):
    """What the statistics stage measures each optimizer step."""

    update_ratio_every: int = option(
        1,
        "compute update_ratio/<group> every N optimizer steps (0: never); with the exact undo on it "
        "reads the undo copy (no memory of its own), else it holds a copy of what it measures",
        lo=0,
    )
    update_ratio_fraction: float = option(
        1.0,
        "without the undo copy (actions.undo.enabled false), measure the update ratio on this fraction "
        "of each parameter: a slice that moves every step, so the copy it holds is this fraction of "
        "the parameter bytes (the lean profile: 0.05); 1: the whole parameters",
        lo=0,
        hi=1,
        lo_open=True,
    )
    dead_units_every: int = option(
        10,
        "sample dead_units/<group> every N optimizer steps (0: never): the largest and smallest element of "
        "each gradient row of each nn.Linear / nn.Conv layer (a read of their gradients)",
        lo=0,
    )
    dead_units_samples: int = option(
        20,
        "a unit is dead when its gradient row was exactly zero on this many samples in a row (every "
        "dead_units_every steps): a healthy ReLU unit is off for a whole batch now and then, a dead one always. "
        "Measured on healthy ReLU MLPs, counting units off from the start too (docs/benchmarks.md): at batch 1 "
        "the largest share read 0.38-0.44 over 5 samples, 0.09-0.22 over 20",
        lo=1,
    )
    adam_eps_every: int = option(
        50,
        "sample adam_eps/<group> every N optimizer steps (0: never): the share of an Adam-family "
        "optimizer's momentum (|m|) on elements whose bias-corrected second moment is under eps (a read of "
        "its exp_avg and exp_avg_sq)",
        lo=0,
    )
    grad_ratio_every: int = option(
        100,
        "compute grad_ratio/<a>/<b> and grad_cos/<a>/<b> on shared "
        "parameters every N optimizer steps (0: never); costs one extra "
        "backward per loss component on the first micro-batch of those steps",
        lo=0,
    )
    loss_ratio_pairs: list[list[str]] = option(
        [], "pairs [a, b] for loss_ratio/<a>/<b> and grad_ratio; empty: every pair of components in combine() order"
    )
    grad_ratio_groups: list[str] = option(
        [],
        "groups whose parameters count as shared for grad_ratio; "
        "empty: every parameter that receives gradient from both components",
    )

    def validate(self) -> None:
        for i, pair in enumerate(self.loss_ratio_pairs):
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ConfigError(
                    f"{self._prefix}loss_ratio_pairs[{i}]: expected two different component names, got {pair!r}"
                )
