"""fp16 overflow watch, attention-logit growth and precision fallback (docs/forensics.md).

``ActivationWatch`` records, on sampled optimizer steps, the largest |value| each watched module
produces -- its outputs *and* the results of the matmul/softmax/exp-like ops computed inline in its
``forward`` (attention logits ``q @ k.transpose(-1, -2)`` have no module of their own: the report's
fusion layer overflowed exactly there) -- and, for attention modules, the signed max attention logit
per head (``attention.py``). Values stay 0-d tensors until the monitor's single host read
(``pending()``); ``findings(step, stats)`` then turns them into findings:

* ``activation_overflow``: a warning when a module's |value| reaches ``warn_fraction`` of the limit
  of the dtype it was produced in (fp16: 65504), or when its growth rate says the limit is at
  most ``forecast_warn_steps`` steps away, i.e. *before* it overflows, naming the module; and the
  first module, in forward order, whose output or inline intermediate is inf/NaN;
* ``attention_logit_growth``: an attention module whose max logit passed ``attention.tau`` (the
  ``qk_clip`` action answers it), and, for ``HOLD_STEPS`` steps after a clip that was needed, a
  *held* module on every step whatever its logit: the clip is sized after the update.

QK-Clip after the update (``remeasure``): on a sampled step the watch keeps each clippable
attention module's forward input until the update has landed (only for modules with a finding:
the rest are let go in ``findings``); ``qk_clip`` then re-runs the module on it with the updated
weights (eval mode, no grad, the random state put back; the watch records the logits, nothing else
changes) and clips from those exact values. The clip aims at ``clip_target``: tau divided by the
median ratio seen recently between a held module's max logit at a step and what the clip left at
the step before -- what the next batch and the other parameters' update add -- and, after a clip
(held, or the growth regime), at least ``MIN_HEADROOM`` under tau. While a clip was
needed in the last ``HOLD_STEPS`` steps (the growth regime), every clippable attention module is
sampled every step, and each one within ``MAX_HEADROOM`` of tau is held too.

QK-Clip before the forward (``_check_before_forward``): the headroom is a guess about the next
batch, and one batch alone can give a max logit up to 2.4x another's with the same weights
(docs/benchmarks.md, LR sweep). So a module held after a clip qk_clip made, and in the growth
regime every clippable module, is also checked before the step's first training forward: the
module is run on that forward's own input (as ``remeasure`` does) and heads over tau are clipped
(to tau less ``PRECHECK_MARGIN``) before the forward runs; that forward's logits are then under
tau. The finding of the step carries what was clipped (``clipped_before_forward``). One module
forward and one host read per such module and step, in the growth regime only: a healthy run
never gets there (a watch whose findings no qk_clip answers never clips). Not with FSDP2-sharded
projections nor across processes (each rank would clip from its own batch alone): there the clip
after the update is all there is.

Sampling is a forecast, not only a stride: every watched maximum keeps its growth rate (per step,
from its last two samples), and the next sample comes sooner as the extrapolated value nears its
limit (the dtype's max; for attention logits also tau): within ``steps_to_limit / forecast_safety``
steps, at least every ``stride`` steps. Findings carry ``steps_to_limit`` and ``growth_per_step``.

How inline ops are seen: on a sampled step, a ``torch.overrides.TorchFunctionMode`` is pushed by the
forward pre-hook of the outermost watched module and popped by its forward hook (``always_call``, so
an exception in ``forward`` cannot leave it pushed). A stack of watched module names attributes
each op to the innermost watched module running. On unsampled steps the hooks return at once and
no mode is pushed, so the cost is two Python calls per watched module call.

``precision_fallback(model, name)`` runs one module in fp32 from then on (autocast off inside it,
floating inputs upcast, floating outputs cast back to the caller's autocast dtype when that is
bf16; under fp16 they stay fp32), with public
forward hooks only -- no monkey-patching -- undone by ``handle.remove()``.

Statistic keys (``pending()``):

=============================  =========================================================
``act_absmax/<module>``         max |value| of the module's outputs and inline ops this step,
                                in its narrowest floating dtype (inf/NaN when non-finite)
``attn_logit_max/<module>``     signed max attention logit (QK^T * scale, masked entries
                                excluded) of an attention module; ``.../h<i>`` per head
``internal/act_first_nonfinite`` index, in this step's recording order, of the first module
                                (in forward order) that made an inf/NaN this step; -1: none
=============================  =========================================================
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import attention as AT
from .attention import ATTN_LOGIT_MAX_PREFIX, QK_CLIP, AttentionConfig
from .events import ACTIVATION_OVERFLOW, PRECISION_FALLBACK, ConfigError, Finding
from .forensics import in_backward, inside_func_transform
from .integrations.distributed import world_size
from .registry import register_kind
from .schema import Section, option
from .sharding import is_sharded, local
from .stats import ACT_FIRST_NONFINITE, INPUT_NONFINITE, LOSS_TOTAL, REDUCTIONS, Reduce, Vector, finite

# A first warning (|x| >= half the dtype's max, or the limit a few steps away at the current growth
# rate) is told; a second within 100 steps means the module keeps living near the limit: treat the
# cause first -- QK-Clip brings an attention module's logits back to tau -- and if it comes a third
# time (nothing to clip, or clipping did not hold) run the module in fp32, the last resort. A real
# overflow, or a warning that persisted, is urgent: it goes straight to the first acting rung.
# Warnings are counted per module (the finding's occurrence): a real overflow in one module that
# took the kind to its last rung must not make a first warning on another one a precision fallback.
WARN_WINDOW = 100
register_kind(
    ACTIVATION_OVERFLOW,
    [(1, []), (2, [QK_CLIP]), (3, [PRECISION_FALLBACK])],
    window=WARN_WINDOW,
    doc="a watched module's activations near or past its dtype's limit",
)

__all__ = [
    "ACT_ABSMAX_PREFIX",
    "ATTN_LOGIT_MAX_PREFIX",
    "FIRST_NONFINITE_KEY",
    "ActivationWatch",
    "FallbackHandle",
    "WatchConfig",
    "dtype_limit",
    "precision_fallback",
]

ACT_ABSMAX_PREFIX = "act_absmax/"
# An index, internal (never in monitor.stats); across ranks the smallest (stats.REDUCTIONS: FIRST).
FIRST_NONFINITE_KEY = ACT_FIRST_NONFINITE
_NO_NONFINITE = 2**62  # sentinel sequence number: "no non-finite record"
# Under a process group, the value of a watched module that did not run on this rank: below any
# maximum (|activation| >= 0; an attention logit above -1e30), so the max over the ranks is the
# ranks' that ran it; still this after the read, no rank ran it (ActivationWatch.settle).
ABSENT = -1e30
# Under a process group, minus the largest finite value of the dtype a module's maximum was taken
# in (its activations', its attention logits'), reduced by max (the narrowest dtype of the ranks
# that ran it): a rank that did not run the module judges it in that dtype too. Not published.
ACT_DTYPE_PREFIX = "act_dtype_limit/"
ATTN_DTYPE_PREFIX = "attn_dtype_limit/"
_DTYPE_PREFIXES = (ACT_DTYPE_PREFIX, ATTN_DTYPE_PREFIX)
for _prefix in _DTYPE_PREFIXES:
    REDUCTIONS[_prefix] = Reduce.MAX
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_of_limit(limit: float) -> torch.dtype:
    """The floating dtype whose largest finite value is ``limit`` (the nearest one)."""
    return min(_FLOATS, key=lambda d: abs(math.log(dtype_limit(d)) - math.log(max(limit, 1.0))))


# A sampled step whose loss is non-finite and in which a watched module was fed an inf/NaN that no
# watched module made (a module the patterns do not select made it: a parameter-free similarity or
# scaling module, a custom activation) widens the watch: every module of the model is recorded on
# every step from the next on, until one makes an inf/NaN (it is named, and precision_fallback can
# act on it), or a step with a non-finite loss passes and none did (it was made where no module
# runs, or came with the inputs), or after this many steps. Then the extra hooks go, and after a
# search that saw a non-finite loss and no maker the watch does not widen again for WIDEN_COOLDOWN
# steps. A non-finite loss on a step the watch did not sample, with finite inputs, starts a search
# too: an overflow that comes with rare batches is then found when it comes again. Under
# torch.distributed every rank widens alike: the decision is
# taken on values every rank reads the same (the first maker's index over ranks, the largest
# maxima, the mean loss).
WIDEN_STEPS = 20
WIDEN_COOLDOWN = 100
# Fully sampled training steps after which the watch says what it has not seen run (none of its
# modules, or attention modules while others ran: inside compiled code). Two: one step may
# legitimately skip a branch.
BLIND_STEPS = 2
# The watch's hooks return at once while dynamo traces (torch.compile): a hook that reads the
# watch's state would add guards on it (a recompilation every step), and one that draws the RNG
# state or enters a mode would break the graph (an error under fullgraph=True).
_compiling = torch.compiler.is_compiling
# A module clipped because its logits after the update were over the cap is held this many steps:
# sampled every step and clipped after every update that takes it over the cap again. (One AdamW
# step at a high LR can multiply the logits several-fold: the logit before an update says little
# about the logit after it; docs/benchmarks.md, LR sweep.)
HOLD_STEPS = 50
# Headroom ratios (next step's max / what the clip left) kept per held module, and the largest
# headroom used (the cap never goes under tau / MAX_HEADROOM). The smallest, after a clip: the clip
# after the update of a held module aims at least MIN_HEADROOM under tau, learned ratio or not --
# in the LR sweep's GPT one batch's max logit was often 1.2-2.4x the previous one's with the same
# weights, and a cap at tau left the check before the forward (below) to clip on ~10% of held
# steps. The floor was chosen on that benchmark, one seed (docs/benchmarks.md, LR sweep: a floor
# of 1 and a prior of 2 before any ratio is learned were tried).
HEADROOM_SAMPLES = 8
MIN_HEADROOM = 1.5
MAX_HEADROOM = 4.0
# A held module is also checked *before* each step's first training forward, on that forward's own
# input: the clip after the update is sized from the last batch, and the next batch alone can give
# a max logit up to 2.4x higher with the same weights (docs/benchmarks.md, LR sweep). That check
# clips to tau less this fraction, or 4 eps of the logits' dtype when larger (bf16: 3%; rescaling
# W_q and W_k rows is exact only to rounding).
PRECHECK_MARGIN = 1e-3

# Default module selection: attention-like modules by name or class, and every nn.Linear.
DEFAULT_NAME_PATTERNS = ["*attn*", "*attention*", "*fusion*"]
DEFAULT_CLASS_PATTERNS = ["*Attention*", "*Attn*", "*Fusion*", "Linear"]


def _watched_functions() -> frozenset:
    """Ops whose results can overflow: matmul family, exponentials, softmax, linear, conv."""
    F = nn.functional
    T = torch.Tensor
    funcs = [
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.baddbmm,
        torch.addmm,
        torch.addbmm,
        torch.einsum,
        torch.exp,
        torch.softmax,
        torch.log_softmax,
        torch.pow,
        torch.cumsum,
        T.__matmul__,
        T.__rmatmul__,
        T.matmul,
        T.mm,
        T.bmm,
        T.baddbmm,
        T.exp,
        T.softmax,
        T.log_softmax,
        T.pow,
        T.__pow__,
        T.cumsum,
        F.linear,
        F.bilinear,
        F.softmax,
        F.log_softmax,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.scaled_dot_product_attention,
    ]
    return frozenset(funcs)


WATCHED_FUNCTIONS = _watched_functions()
# Softmax calls whose input, inside an attention module, is the attention logits.
SOFTMAX_FUNCTIONS = frozenset({torch.softmax, torch.Tensor.softmax, nn.functional.softmax})
SDPA = nn.functional.scaled_dot_product_attention


def dtype_limit(dtype: torch.dtype) -> float:
    """Largest finite value of a floating dtype (fp16: 65504)."""
    return float(torch.finfo(dtype).max)


@dataclass
class WatchConfig(Section):
    """Activation overflow watch (fp16 trap of the report: the fusion QK^T overflowed 65504)."""

    enabled: bool = option(True, "record act_absmax/<module> and emit activation_overflow findings")
    modules: list[str] = option(
        list(DEFAULT_NAME_PATTERNS), "fnmatch patterns (or 're:<regex>') on module names to watch"
    )
    classes: list[str] = option(
        list(DEFAULT_CLASS_PATTERNS), "fnmatch patterns (or 're:<regex>') on module class names to watch"
    )
    inline: bool = option(
        True,
        "also record matmul/softmax/exp results computed inline inside a "
        "watched module's forward (attention logits); off: module outputs only",
    )
    stride: int = option(
        10,
        "sample at least every N optimizer steps (1: every step); at 10 the measured "
        "overhead is ~1-2% of a step (docs/forensics.md)",
        lo=1,
    )
    forecast: bool = option(
        True,
        "sample sooner as a maximum's extrapolated growth nears its limit (dtype max, attention.tau); "
        "off: a fixed stride",
    )
    forecast_safety: float = option(
        4.0,
        "the next sample comes within steps_to_limit / this many steps (4: about four samples "
        "before the limit at the current growth rate)",
        lo=1.0,
    )
    forecast_warn_steps: float = option(
        3.0,
        "warn when a maximum's growth rate puts its dtype's limit at most this many steps away, even "
        "below warn_fraction (0: off)",
        lo=0.0,
    )
    warn_fraction: float = option(
        0.5,
        "warn when |value| >= this fraction of the dtype's max (fp16 65504 -> 32752); one doubling of headroom",
        lo=0.0,
        hi=1.0,
        lo_open=True,
    )
    persist: int = option(
        3,
        "consecutive sampled steps over warn_fraction in one module before the finding recommends precision_fallback",
        lo=1,
    )
    grad_only: bool = option(
        True, "record only forwards run with autograd enabled (skip eval passes under no_grad / inference_mode)"
    )
    attention: AttentionConfig = option(
        AttentionConfig(), "attention-logit growth: attn_logit_max/<module>, attention_logit_growth, qk_clip"
    )

    def validate(self) -> None:
        for key in ("modules", "classes"):
            for i, pat in enumerate(getattr(self, key)):
                if pat.startswith("re:"):
                    try:
                        re.compile(pat[3:])
                    except re.error as e:
                        raise ConfigError(f"{self._prefix}{key}[{i}]: bad regex {pat[3:]!r}: {e}") from e


def _class_matches(patterns: Iterable[str], cls: type) -> bool:
    """A class pattern matches the module's class or a class it derives from, up to nn.Module:
    FSDP2's fully_shard swaps a Linear's class for FSDPLinear(FSDPModule, Linear)."""
    return any(_matches(patterns, c.__name__) for c in cls.__mro__ if issubclass(c, nn.Module) and c is not nn.Module)


def _matches(patterns: Iterable[str], text: str) -> bool:
    for pat in patterns:
        if pat.startswith("re:"):
            if re.search(pat[3:], text):
                return True
        elif fnmatch.fnmatchcase(text.lower(), pat.lower()):
            return True
    return False


def _iter_tensors(obj: Any, depth: int = 0):
    """Floating tensors inside an output (tensor, tuple/list, dict), a few levels deep; of a
    DTensor (tensor parallelism hands them to a module's forward, and its ops make them), this
    rank's part: the step's max reduction over the ranks makes the whole tensor's maximum."""
    if isinstance(obj, torch.Tensor):
        obj = local(obj)
        if obj.is_floating_point() and obj.numel() > 0:
            yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _iter_tensors(o, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o, depth + 1)


class _Record:
    """Per-module accumulators for one step (all 0-d tensors, no host sync)."""

    __slots__ = ("absmax", "first_bad")

    def __init__(self) -> None:
        self.absmax: dict[torch.dtype, torch.Tensor] = {}  # per producing dtype, fp32 0-d
        self.first_bad: torch.Tensor | None = None  # min sequence number of a non-finite value


class _AttnRecord:
    """Per-attention-module max logit per head for one step (an fp32 vector, no host sync)."""

    __slots__ = ("calls", "dtype", "entropy", "heads")

    def __init__(self, heads: torch.Tensor, dtype: torch.dtype) -> None:
        self.heads = heads
        self.dtype = dtype
        self.entropy: torch.Tensor | None = None  # the sum over this step's calls of their mean entropy
        self.calls = 0


@dataclass
class _AttnInfo:
    """What attach() learned about one attention module."""

    heads: int | None
    spec: AT.QKSpec | None
    reason: str


@dataclass
class _Hold:
    """A clipped module: held until ``until``; ``left`` is its max logit after the last clip (at
    step ``left_step``); ``ratios`` the recent headroom ratios it showed."""

    until: int
    left: float | None = None
    left_step: int = -1
    ratios: list[float] | None = None


class _Trend:
    """The last samples (step, value) of one watched maximum and its growth rate per step."""

    __slots__ = ("samples",)

    def __init__(self, samples: list[tuple[int, float]] | None = None) -> None:
        self.samples: list[tuple[int, float]] = list(samples or [])

    def add(self, step: int, value: float) -> None:
        if not finite(value) or value <= 0:  # no log-growth through 0, a sign change or inf
            self.samples = []
            return
        if self.samples and self.samples[-1][0] >= step:
            self.samples = [s for s in self.samples if s[0] < step]
        self.samples = [*self.samples[-3:], (step, value)]

    def rate(self) -> float | None:
        """log-growth per step from the last two samples (None with fewer than two)."""
        if len(self.samples) < 2:
            return None
        (s0, v0), (s1, v1) = self.samples[-2], self.samples[-1]
        return (math.log(v1) - math.log(v0)) / (s1 - s0)

    def steps_to(self, limit: float) -> float:
        """Steps until the extrapolated value reaches ``limit`` (0: already there; inf: not growing)."""
        if not self.samples:
            return math.inf
        value = self.samples[-1][1]
        if value >= limit:
            return 0.0
        r = self.rate()
        if r is None or r <= 0:
            return math.inf
        return (math.log(limit) - math.log(value)) / r

    def forecast(self, limit: float) -> dict[str, Any]:
        r = self.rate()
        steps = self.steps_to(limit)
        return {
            "steps_to_limit": round(steps, 1) if math.isfinite(steps) else None,
            "growth_per_step": round(math.exp(r), 4) if r is not None else None,
        }


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it lies: another watch (a second
    monitor on the same model) may have entered its own mode above it around the same module, and
    leaves later. A mode no longer there (entered in a forward torch aborted, in the backward's
    recomputation, whose state the autograd engine reset) is forgotten."""
    depth = torch._C._len_torch_function_stack()
    if not any(torch._C._get_function_stack_at(i) is mode for i in range(depth)):
        return
    above = []
    while torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1) is not mode:
        above.append(torch._C._pop_torch_function_stack())
    mode.__exit__(None, None, None)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


class _InlineMode(TorchFunctionMode):
    """Records results of WATCHED_FUNCTIONS for the innermost watched module running, and the
    attention logits (softmax inputs, SDPA logits) of the innermost attention module running."""

    def __init__(self, watch: ActivationWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        w = self.watch
        if func in WATCHED_FUNCTIONS and w._stack and not w._busy:
            w._record(w._stack[-1], out, args)
            if w._attn_cfg.enabled and (func in SOFTMAX_FUNCTIONS or func is SDPA):
                w._record_inline_logits(func, args, kwargs)
        return out


class ActivationWatch:
    """Forward hooks that record max |activation| per watched module, and the max attention logit
    per attention module, on sampled steps.

    Use: ``attach(model)``; ``reset(step)`` at the start of each optimizer step (before its
    forwards); after the backward, put ``pending()`` into the step's single host read and pass the
    resulting floats to ``findings(step, stats)`` (which also plans the next samples);
    ``detach()`` removes every hook.
    """

    def __init__(self, config: WatchConfig | None = None) -> None:
        self.config = config or WatchConfig()
        self._attn_cfg: AttentionConfig = self.config.attention
        self.module_names: list[str] = []  # watched modules, in named_modules() order
        self.attention: dict[str, _AttnInfo] = {}  # attention modules (a subset of module_names)
        self._mha: set[str] = set()  # those that are nn.MultiheadAttention
        self._handles: list[Any] = []
        self._stack: list[str] = []
        self._mode: _InlineMode | None = None
        self._busy = False
        self._records: dict[str, _Record] = {}  # insertion order = first seen in forward order
        self._attn: dict[str, _AttnRecord] = {}
        self._seq = 0
        self._step = 0
        self._sampled = True
        self._force = False
        self._plan: dict[str, int] = {}  # module -> the step the forecast asked to sample it
        self._due: set[str] | None = None  # modules recorded this step (None: all of them)
        self._trends: dict[str, _Trend] = {}  # stat key -> growth of that maximum
        self._streak: dict[str, int] = {}  # consecutive sampled steps over warn_fraction
        self._warned: dict[str, list[int]] = {}  # module -> steps of its warnings in the last WARN_WINDOW
        self._dtypes: dict[str, torch.dtype] = {}  # dtype behind act_absmax/<m> of the last pending()
        self._attn_dtypes: dict[str, torch.dtype] = {}  # dtype of the logits behind attn_logit_max/<m>
        self._attn_heads: dict[str, int] = {}  # heads behind attn_logit_max/<m> of the last pending()
        self._order: list[str] = []  # module names behind act_first_nonfinite
        self._modules: dict[str, nn.Module] = {}  # clippable attention modules
        self._inputs: dict[str, tuple[int, tuple, dict]] = {}  # this step's (step, args, kwargs)
        self._last_inputs: dict[str, tuple[int, tuple, dict]] = {}  # the previous step's, for qk_clip
        self._held: dict[str, _Hold] = {}
        self._device = torch.device("cpu")  # the model's (where ABSENT values are made)
        self._told: dict[str, float] = {}  # modules QK-Clip cannot act on: the max last reported
        self._entropy_start: dict[str, float] = {}  # module -> its first sampled attn_entropy
        self._entropy_told: set[str] = set()  # modules told collapsed, not yet recovered
        self._remeasuring = False
        self._model: nn.Module | None = None
        self._regime_until = -1  # the last step of the growth regime (a clip was needed lately)
        self._ratios: list[float] = []  # the model's recent headroom ratios (any held module)
        self._checked: set[str] = set()  # held modules checked before their forward this step
        self._pre_clips: dict[str, dict[str, Any]] = {}  # what those checks clipped, this step
        self._sharded: set[str] = set()  # clippable modules with FSDP2 (DTensor) projections
        self._measured_dtype: torch.dtype = torch.float32  # of the logits _measure last read
        self._name_of: dict[nn.Module, str] = {}  # watched module -> its name (the hooks look it up)
        self._wide: list[Any] = []  # the hooks of the widened watch (every module), while it lasts
        self._wide_names: set[str] = set()  # the modules only the widened watch records
        self._wide_left = 0  # sampled steps the widened watch still records
        self._widen_from = 0  # the first step the watch may widen again (after a search found nothing)
        self._wide_since = 0  # the step whose findings widened it
        self._blind = 0  # fully sampled training steps seen by check_sight
        self._seen: set[str] = set()  # modules recorded in those steps
        self.blind_warned = False

    # ---- lifecycle -------------------------------------------------------------------------
    def select(self, model: nn.Module) -> list[str]:
        """Names of the modules the config selects (named_modules order): the watch's patterns,
        and the attention modules when attention is enabled."""
        cfg = self.config
        names = []
        for name, mod in model.named_modules():
            if not name:
                continue
            if (
                _matches(cfg.modules, name)
                or _class_matches(cfg.classes, type(mod))
                or (cfg.attention.enabled and AT.is_attention(cfg.attention, name, mod))
            ):
                names.append(name)
        return names

    def attach(self, model: nn.Module) -> ActivationWatch:
        if self._handles:
            raise RuntimeError("ActivationWatch is already attached; call detach() first")
        if not self.config.enabled:
            return self
        self.module_names = self.select(model)
        self.attention, self._mha, self._modules, self._sharded = {}, set(), {}, set()
        self._name_of = {model.get_submodule(name): name for name in self.module_names}
        # A forward that raises inside a watched module skips that module's post-hook: the root's
        # own post-hook, called always, cleans up (the stack, the inline mode). One hook on the
        # root only: an always-called hook on every module makes dynamo guard on each one's hook id,
        # and N identical blocks compiled one by one would each get their own graph.
        self._handles.append(model.register_forward_hook(self._root_hook, always_call=True))
        for name in self.module_names:
            mod = model.get_submodule(name)
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook))
            self._handles.append(mod.register_forward_hook(self._post_hook))
            if self._attn_cfg.enabled and AT.is_attention(self._attn_cfg, name, mod):
                spec, reason = AT.find_projections(mod, name, self._attn_cfg)
                heads = spec.heads if spec is not None and spec.heads else AT.module_heads(mod)
                self.attention[name] = _AttnInfo(heads, spec, reason)
                if isinstance(mod, nn.MultiheadAttention):
                    self._mha.add(name)
                    self._handles.append(mod.register_forward_pre_hook(self._mha_hook, with_kwargs=True))
                if spec is not None:
                    self._modules[name] = mod
                    self._handles.append(mod.register_forward_pre_hook(self._keep_hook, with_kwargs=True))
                    # Before the watch's own pre-hooks: the check runs the module in a clean state.
                    self._handles.append(
                        mod.register_forward_pre_hook(self._check_hook, with_kwargs=True, prepend=True)
                    )
                    if any(is_sharded(p) for p in mod.parameters()):
                        self._sharded.add(name)
        AT.WATCHES[model] = self
        self._model = model
        first = next(iter(model.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self.reset(0)
        return self

    def _widen(self) -> None:
        """Record every module of the model (but the root) from the next step on (``WIDEN_STEPS``):
        an inf/NaN reached a watched module from one it does not watch."""
        model = self._model
        if model is None or self._wide:
            return
        for name, mod in model.named_modules():
            if not name or mod in self._name_of:
                continue
            self._name_of[mod] = name
            self._wide_names.add(name)
            self._wide.append(mod.register_forward_pre_hook(self._pre_hook))
            self._wide.append(mod.register_forward_hook(self._post_hook))
        self._wide_left = WIDEN_STEPS
        self._force = True

    def _narrow(self) -> None:
        """Back to the modules the config selects."""
        for h in self._wide:
            h.remove()
        self._wide = []
        self._name_of = {m: n for m, n in self._name_of.items() if n not in self._wide_names}
        for name in self._wide_names:
            self._trends.pop(ACT_ABSMAX_PREFIX + name, None)
            self._streak.pop(name, None)
            self._plan.pop(name, None)
        self._wide_names, self._wide_left = set(), 0

    def detach(self) -> None:
        """Remove every hook and pop the inline mode if a forward was interrupted."""
        self._narrow()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._exit_mode()
        self._records.clear()
        self._attn.clear()
        self._inputs, self._last_inputs, self._modules, self._name_of = {}, {}, {}, {}
        model = getattr(self, "_model", None)
        if model is not None and AT.WATCHES.get(model) is self:
            del AT.WATCHES[model]
        self._model = None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def reset(self, step: int | None = None) -> None:
        """Start an optimizer step: clear this step's records; decide whether it is sampled (the
        stride, a forced sample, or a sample the forecast asked for)."""
        self._exit_mode()
        self._step = self._step + 1 if step is None else int(step)
        full = self._force or self._step % self.config.stride == 0
        due = {m for m, at in self._plan.items() if at <= self._step}
        if self._step <= self._regime_until:  # the growth regime: every clippable module, every step
            due |= set(self._modules)
        self._sampled = full or bool(due)
        # A step sampled for the forecast alone records only the modules it was asked for (the
        # exact logits of an nn.MultiheadAttention over long sequences are not free).
        self._due = None if full else due
        self._force = False
        self._records = {}
        self._attn = {}
        self._seq = 0
        self._checked, self._pre_clips = set(), {}
        # Kept until the update of the step they come from has landed (qk_clip runs after it).
        self._last_inputs, self._inputs = self._inputs, {}

    def sample_next(self) -> None:
        """Make the next step sampled whatever the stride (e.g. after a non-finite loss)."""
        self._force = True

    @property
    def sampled(self) -> bool:
        return self._sampled

    def check_sight(self, trained: bool) -> None:
        """At a step's read: warn once when ``BLIND_STEPS`` fully sampled training steps ran none
        of the watched modules' hooks, or none of some attention modules' while others ran. Under
        torch.compile the hooks return at once while dynamo traces (so that attaching changes
        nothing it compiles: no graph break, no guard on the watch's state, ``fullgraph=True``
        still compiles), and the watch sees nothing of what runs inside compiled code."""
        if self.blind_warned or not self._sampled or self._due is not None or not self.module_names or not trained:
            return
        self._seen |= set(self._records) | set(self._attn)
        self._blind += 1
        if self._blind < BLIND_STEPS:
            return
        # Attention modules with projections (those QK-Clip acts on): a dropout named *attn* that a
        # fused kernel replaces (Hugging Face GPT-2 with SDPA) never runs, and says nothing.
        unseen = [n for n in self._modules if n not in self._seen]
        if self._seen and not unseen:
            return
        self.blind_warned = True
        what = (
            f"any of its {len(self.module_names)} modules"
            if not self._seen
            else f"{len(unseen)} of its attention modules ({', '.join(unseen[:4])}{', ...' if len(unseen) > 4 else ''})"
        )
        warnings.warn(
            f"sfmonitor: the activation watch did not see {what} run in {BLIND_STEPS} sampled training steps. "
            "Forward hooks do not run inside torch.compile'd code (nor TorchScript), and forwards inside "
            "torch.func transforms (vmap, grad: per-sample gradients) are not recorded: activation maxima "
            "and attention logits there are not measured, and QK-Clip and precision_fallback cannot act "
            "on them; gradients, updates, losses and their rescues are unaffected. To watch them, train "
            "those modules uncompiled (or set watch.enabled: false to silence this)",
            RuntimeWarning,
            stacklevel=2,
        )

    # ---- hooks -----------------------------------------------------------------------------
    def _active(self) -> bool:
        if inside_func_transform():  # per-sample forwards of torch.func: nothing may be kept
            return False
        return self._remeasuring or (self._sampled and (torch.is_grad_enabled() or not self.config.grad_only))

    # The hooks are methods, the same function for every module (the module's name is looked up):
    # under torch.compile, per-module closures would differ and make dynamo compile each of N
    # identical blocks on its own instead of reusing one graph.
    def _keep_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _compiling():
            return None
        name = self._name_of[module]
        if self._remeasuring or not self._active() or not self._wanted(name):
            return None
        # The last call of the step is kept (references, no copy): qk_clip re-runs it.
        self._inputs[name] = (self._step, _detached(args), _detached(kwargs))
        return None

    def _check_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _compiling():
            return None
        name = self._name_of[module]
        if self._remeasuring or self._busy or name in self._checked or not self._holding(name):
            return None
        if self._stack or self._mode is not None or not torch.is_grad_enabled():
            return None  # inside another watched module's forward, or not a training forward
        if in_backward() or inside_func_transform():
            return None  # a recomputation inside the backward (activation checkpointing), or torch.func
        self._checked.add(name)  # the step's first forward only (accumulation, re-entrant calls)
        self._check_before_forward(name, module, args, kwargs)
        return None

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if _compiling():
            return None
        if not self._active():
            return None
        name = self._name_of[module]
        if self._due is not None and name not in self._due and not self._stack:
            return None  # a forecast-only step: nothing asked for runs here
        if name in self._records and in_backward():
            # Activation checkpointing recomputing, inside the backward, a forward the watch saw
            # (non-reentrant; a reentrant one's first forward ran without grad: this is its only
            # sight). Torch may stop that recomputation midway, and the autograd engine drops a mode
            # entered there when it leaves the node: nothing to record, nothing to enter.
            return None
        self._stack.append(name)
        if self.config.inline and self._mode is None:
            self._mode = _InlineMode(self)
            self._mode.__enter__()
        return None

    def _post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _compiling():
            return None
        if not self._stack or self._stack[-1] != self._name_of.get(module):
            return None  # not pushed (unsampled step) or already cleaned up
        name = self._stack.pop()
        if output is not None:
            self._record(name, output, args, op=False)
        if not self._stack:
            self._exit_mode()
        return None

    def _root_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _compiling():
            return None
        if self._stack or self._mode is not None:  # a watched module's forward raised
            self._exit_mode()
        return None

    def _mha_hook(self, module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        if _compiling():
            return None
        name = self._name_of[module]
        if not self._active() or self._busy or not self._wanted(name):
            return None
        self._busy = True
        try:
            with torch.no_grad():
                logits = AT.mha_logits(module, args, kwargs)
                if logits is not None:
                    query = args[0] if args else kwargs["query"]
                    heads = module.num_heads
                    self._add_logits(name, AT.head_maxima(logits, heads), query.dtype, self._entropy(logits, heads))
        finally:
            self._busy = False
        return None

    def _exit_mode(self) -> None:
        self._stack.clear()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _remove_mode(mode)

    def _wanted(self, name: str) -> bool:
        return self._due is None or name in self._due

    def _record(self, name: str, output: Any, inputs: Any = (), op: bool = True) -> None:
        """Record the largest |value| of ``output`` for ``name``, and whether it made an inf/NaN from
        finite inputs: any inf/NaN for an op's result (a matmul, exp or softmax that overflowed);
        for a module's output (``op`` False) a +inf or a NaN only -- a module that writes -inf
        alone into its output (an additive mask, log of an exact zero) made no overflow."""
        if not self._wanted(name):
            return
        self._busy = True
        try:
            with torch.no_grad():
                rec = self._records.get(name)
                if rec is None:
                    rec = self._records[name] = _Record()
                # A module whose input already held inf/NaN did not make it (a NaN from upstream:
                # an unwatched layer, a poisoned embedding): not its overflow, no precision fallback.
                fed = [t.detach().abs().amax() for t in _iter_tensors(inputs) if not isinstance(t, nn.Parameter)]
                fed_bad = ~torch.isfinite(torch.stack(fed).float()).all() if fed else None
                for t in _iter_tensors(output):
                    if op or not t.numel():
                        m = t.detach().abs().amax().float()  # inf/NaN propagate through amax
                        top = m
                    else:
                        low, high = torch.aminmax(t.detach())  # one pass; NaN propagates
                        m, top = torch.maximum(low.abs(), high.abs()).float(), high.float()
                    prev = rec.absmax.get(t.dtype)
                    rec.absmax[t.dtype] = m if prev is None else torch.maximum(prev, m)
                    made = torch.isfinite(top) if fed_bad is None else torch.isfinite(top) | fed_bad
                    bad = torch.where(made, _NO_NONFINITE, self._seq)
                    rec.first_bad = bad if rec.first_bad is None else torch.minimum(rec.first_bad, bad)
                    self._seq += 1
        finally:
            self._busy = False

    def _attention_running(self) -> str | None:
        """The innermost attention module on the stack whose projections are known, else the
        innermost attention module (None: none is running). A part of an attention module that
        the name patterns also match (Swin's ``attn.softmax``, a parameterless core) must not take
        the logits from the module QK-Clip can act on."""
        inner = None
        for name in reversed(self._stack):
            info = self.attention.get(name)
            if info is not None:
                if info.spec is not None:
                    return name
                inner = inner or name
        return inner

    def _record_inline_logits(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = self._attention_running()
        if name is None or name in self._mha or not self._wanted(name):
            return  # no attention module running, or an nn.MultiheadAttention: its pre-hook measures it
        self._busy = True
        try:
            with torch.no_grad():
                if func is SDPA:
                    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
                    a = dict(zip(names, args))
                    a.update(kwargs)
                    # (DTensors, a tensor-parallel model's heads: this rank's heads)
                    q, k, mask = local(a.get("query")), local(a.get("key")), local(a.get("attn_mask"))
                    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
                        return
                    logits = AT.sdpa_logits(
                        q,
                        k,
                        mask,
                        bool(a.get("is_causal", False)),
                        a.get("scale"),
                        bool(a.get("enable_gqa", False)),
                    )
                    heads = q.shape[-3] if q.ndim >= 3 else None
                    self._add_logits(name, AT.head_maxima(logits, heads), q.dtype, self._entropy(logits, heads))
                    return
                x = local(args[0] if args else kwargs.get("input"))
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2 or dim is None:
                    return
                if dim % x.ndim != x.ndim - 1:
                    return  # attention softmaxes over the keys, the last dim
                heads = self.attention[name].heads
                self._add_logits(name, AT.head_maxima(x, heads), x.dtype, self._entropy(x, heads))
        finally:
            self._busy = False

    def _entropy(self, logits: torch.Tensor, heads: int | None) -> torch.Tensor | None:
        return AT.head_entropy(logits, heads).mean() if self._attn_cfg.entropy else None

    def _add_logits(
        self, name: str, heads: torch.Tensor, dtype: torch.dtype, entropy: torch.Tensor | None = None
    ) -> None:
        rec = self._attn.get(name)
        if rec is None:
            rec = self._attn[name] = _AttnRecord(heads, dtype)
        else:
            if rec.heads.shape == heads.shape:
                rec.heads = torch.maximum(rec.heads, heads)
            else:  # calls with different head layouts: keep one value for the module
                rec.heads = torch.maximum(rec.heads.max(), heads.max()).reshape(1)
            if dtype_limit(dtype) < dtype_limit(rec.dtype):
                rec.dtype = dtype
        if entropy is not None:
            rec.entropy = entropy if rec.entropy is None else rec.entropy + entropy
            rec.calls += 1

    # ---- read-out --------------------------------------------------------------------------
    def pending(self) -> dict[str, Any]:
        """This step's 0-d tensors: ``act_absmax/<module>``, ``act_first_nonfinite`` and
        ``attn_logit_max/<module>`` (``/h<i>`` per head).

        Empty on unsampled steps. For each module the value is taken in the narrowest dtype it
        produced (the one that overflows first); wider dtypes still count for non-finiteness.

        Under a process group the step's values are one all-reduce by position, so every rank
        gives the same keys in the same order: every watched module (``ABSENT`` where it did not
        run on this rank: an expert no token was routed to; a branch one rank takes), and the
        attention entropy as [sum, count] summed over the ranks that ran it. ``settle`` turns the
        read values back into this single-process form.
        """
        out: dict[str, Any] = {}
        self._dtypes = {}
        every = self._sampled and world_size() > 1
        if every:
            universe = [n for n in [*self.module_names, *sorted(self._wide_names)] if self._wanted(n)]
            absent = torch.full((), ABSENT, device=self._device)
        order, bads = [], []
        for name in universe if every else list(self._records):
            rec = self._records.get(name)
            if rec is not None and rec.absmax:
                dtype = min(rec.absmax, key=dtype_limit)
                self._dtypes[name] = dtype
                out[ACT_ABSMAX_PREFIX + name] = rec.absmax[dtype]
                if every:
                    out[ACT_DTYPE_PREFIX + name] = torch.full((), -dtype_limit(dtype), device=self._device)
            elif every:
                out[ACT_ABSMAX_PREFIX + name] = out[ACT_DTYPE_PREFIX + name] = absent
            else:
                continue
            order.append(name)
            bad = rec.first_bad if rec is not None else None
            bads.append(bad if bad is not None else torch.full((), _NO_NONFINITE, device=self._device))
        self._order = order
        if bads:
            seqs = torch.stack([b.to(bads[0].device) for b in bads])
            first = torch.argmin(seqs)
            out[FIRST_NONFINITE_KEY] = torch.where(seqs[first] < _NO_NONFINITE, first, -1).float()
        self._attn_dtypes, self._attn_heads = {}, {}
        attn_names = [n for n in self.attention if self._wanted(n)] if every else list(self._attn)
        for name in attn_names:
            arec = self._attn.get(name)
            if every:
                out.update(self._attention_on_every_rank(name, arec))
            elif arec is not None:
                key, n = ATTN_LOGIT_MAX_PREFIX + name, arec.heads.numel()
                out[key] = arec.heads.max()
                if arec.entropy is not None:
                    out[AT.ATTN_ENTROPY_PREFIX + name] = arec.entropy / arec.calls
                self._attn_dtypes[name], self._attn_heads[name] = arec.dtype, n
                if n > 1 and self._attn_cfg.per_head:
                    for h in range(n):
                        out[f"{key}/h{h}"] = arec.heads[h]
        return out

    def _attention_on_every_rank(self, name: str, arec: _AttnRecord | None) -> dict[str, Any]:
        """``pending``'s values of one attention module under a process group: the same keys on
        every rank, ``ABSENT`` where it did not run here; per head as many as the module has (one
        value where that is unknown, or this rank's logits had another count); the dtype's limit;
        the entropy as [mean, 1] (or [0, 0]), summed over the ranks."""
        key, dev = ATTN_LOGIT_MAX_PREFIX + name, self._device
        known = self.attention[name].heads
        heads = known if isinstance(known, int) and known > 1 and self._attn_cfg.per_head else 1
        absent = torch.full((), ABSENT, device=dev)
        if arec is None:
            out: dict[str, Any] = {key: absent, ATTN_DTYPE_PREFIX + name: absent}
            per_head: list[torch.Tensor] = [absent] * heads
            pair = torch.zeros(2, device=dev)
        else:
            limit = torch.full((), -dtype_limit(arec.dtype), device=dev)
            out = {key: arec.heads.max(), ATTN_DTYPE_PREFIX + name: limit}
            fits = arec.heads.numel() == heads
            per_head = [arec.heads[h] if fits else absent for h in range(heads)]
            self._attn_dtypes[name], self._attn_heads[name] = arec.dtype, heads if fits else 1
            mean = arec.entropy / arec.calls if arec.entropy is not None else None
            one = torch.ones((), device=dev)
            pair = torch.stack([mean.float().to(dev), one]) if mean is not None else torch.zeros(2, device=dev)
        if heads > 1:
            out.update({f"{key}/h{h}": v for h, v in enumerate(per_head)})
        if self._attn_cfg.entropy:
            out[AT.ATTN_ENTROPY_PREFIX + name] = Vector(pair)
        return out

    def settle(self, values: dict[str, Any]) -> None:
        """After the step's read (under a process group): drop the values of modules no rank ran
        (still ``ABSENT``), and make each attention entropy [sum, count] its mean."""
        for key in [k for k, v in values.items() if isinstance(v, float) and v <= ABSENT / 2]:
            if key.startswith((ACT_ABSMAX_PREFIX, ATTN_LOGIT_MAX_PREFIX, *_DTYPE_PREFIXES)):
                del values[key]
        for prefix, dtypes in ((ACT_DTYPE_PREFIX, self._dtypes), (ATTN_DTYPE_PREFIX, self._attn_dtypes)):
            for key in [k for k in values if k.startswith(prefix)]:
                dtypes[key[len(prefix) :]] = _dtype_of_limit(-values.pop(key))
        for key in [k for k in values if k.startswith(AT.ATTN_ENTROPY_PREFIX)]:
            v = values[key]
            if isinstance(v, list) and len(v) == 2:
                if v[1] > 0:
                    values[key] = v[0] / v[1]
                else:
                    del values[key]

    def _head_values(self, name: str, stats: dict[str, float]) -> list[float] | None:
        key = ATTN_LOGIT_MAX_PREFIX + name
        if key not in stats:
            return None
        n = self._attn_heads.get(name, 1)
        if n > 1 and all(f"{key}/h{h}" in stats for h in range(n)):
            return [float(stats[f"{key}/h{h}"]) for h in range(n)]
        return [float(stats[key])]

    def _attention_data(self, name: str, stats: dict[str, float]) -> dict[str, Any] | None:
        """What qk_clip needs to clip ``name``, from this step's values (None: no logits)."""
        heads = self._head_values(name, stats)
        info = self.attention.get(name)
        if heads is None or info is None:
            return None
        data: dict[str, Any] = {
            "module": name,
            "max_logit": max(heads),
            "head_max": heads,
            "tau": self._attn_cfg.tau,
            "projection": info.spec.to_dict() if info.spec is not None else None,
        }
        if info.spec is None:
            data["projection_reason"] = info.reason
        return data

    def findings(self, step: int, stats: dict[str, float]) -> list[Finding]:
        """activation_overflow and attention_logit_growth findings from this step's host-read
        values (see module doc); also updates each maximum's growth rate and plans the next sample."""
        cfg = self.config
        self._observe(step, stats)
        out: list[Finding] = []
        seen = set()
        # Under torch.distributed the index is the first over ranks (stats.REDUCTIONS: FIRST) and
        # the maxima the largest: every rank reads the same, and decides (and widens) alike.
        first_idx = int(stats.get(FIRST_NONFINITE_KEY, -1))
        wide = bool(self._wide) and step > self._wide_since  # (its hooks record from the next step)
        widened = set(self._wide_names) if wide else set()
        loss = stats.get(LOSS_TOTAL)
        fed = [n for n in self._order if not finite(float(stats.get(ACT_ABSMAX_PREFIX + n, 0.0)))]
        # A non-finite step: its loss, or (no loss given to combine()) a watched module's maximum.
        broken = not finite(float(loss)) if loss is not None else bool(fed)
        if wide:  # a step of the widened watch
            self._wide_left -= 1
            if 0 <= first_idx < len(self._order):
                self._narrow()  # the maker is named below
            elif broken:
                self._narrow()  # not found: made where no module runs, or with the inputs
                self._widen_from = step + WIDEN_COOLDOWN
            elif self._wide_left <= 0:
                self._narrow()  # it did not come again: the next non-finite step searches anew
            else:
                self._force = True
        elif not 0 <= first_idx < len(self._order) and broken and step >= self._widen_from:
            # An inf/NaN reached a watched module and none of them made it; or the step was not
            # sampled (an overflow on rare batches is seen sooner) and its inputs were finite.
            unseen = not self._order and stats.get(INPUT_NONFINITE, 0.0) == 0.0
            if fed or unseen:
                self._widen()
                self._wide_since = step
        if 0 <= first_idx < len(self._order):
            name = self._order[first_idx]
            dtype = self._dtypes.get(name, torch.float32)
            bad = sorted(
                n for n in self._order if ACT_ABSMAX_PREFIX + n in stats and not finite(stats[ACT_ABSMAX_PREFIX + n])
            )
            value = stats.get(ACT_ABSMAX_PREFIX + name, float("nan"))
            data = {
                "module": name,
                "absmax": value,
                "limit": dtype_limit(dtype),
                "dtype": _dtype_name(dtype),
                "nonfinite": True,
                "nonfinite_modules": bad,
                "steps_to_limit": 0.0,
                "recommend": PRECISION_FALLBACK,
            }
            found = ""
            if name in widened:
                data["found_by_widened_watch"] = True
                found = (
                    " -- a module the watch does not select, named by watching every module after an "
                    "inf/NaN reached a watched one from outside"
                )
            att = self._attention_data(name, stats)
            if att is not None:
                data["attention"] = att
            # QK-Clip needs an exact, finite logit above tau and the module's projections; without
            # them the overflow goes straight to the last resort of the default ladder. An inf/NaN
            # made in fp32 is no overflow that fp32 can cure (huge weights, a log of zero, an
            # explicit inf): told, the first rung, never a precision fallback.
            clippable = (
                att is not None and att["projection"] and any(finite(m) and m > att["tau"] for m in att["head_max"])
            )
            reduced = dtype in (torch.float16, torch.bfloat16)
            if not reduced:
                data["recommend"] = None
            out.append(
                Finding(
                    kind=ACTIVATION_OVERFLOW,
                    message=(
                        f"step {step}: module {name!r} is the first (in forward order) to produce "
                        f"inf/NaN ({_dtype_name(dtype)}, limit {dtype_limit(dtype):g}){found}"
                        + ("" if reduced or clippable else "; made in full precision: no precision fallback cures it")
                    ),
                    data=data,
                    where=name,
                    urgent=reduced or bool(clippable),
                    occurrence=None if clippable else _last_rung(ACTIVATION_OVERFLOW) if reduced else 1,
                )
            )
            seen.add(name)
        for name in self._order:
            key = ACT_ABSMAX_PREFIX + name
            if key not in stats or name in seen:
                continue
            value = float(stats[key])
            dtype = self._dtypes.get(name, torch.float32)
            limit = dtype_limit(dtype)
            trend = self._trends.get(key, _Trend())
            fc = trend.forecast(limit)
            soon = (
                cfg.forecast
                and cfg.forecast_warn_steps > 0
                and fc["steps_to_limit"] is not None
                and fc["steps_to_limit"] <= cfg.forecast_warn_steps
            )
            if not finite(value) or (value < cfg.warn_fraction * limit and not soon):
                self._streak[name] = 0
                continue
            streak = self._streak[name] = self._streak.get(name, 0) + 1
            recommend = streak >= cfg.persist
            warned = [s for s in self._warned.get(name, []) if step - s <= WARN_WINDOW] + [step]
            self._warned[name] = warned
            why = (
                f"{value / limit:.0%} of the {_dtype_name(dtype)} limit {limit:g} (warn at {cfg.warn_fraction:g})"
                if value >= cfg.warn_fraction * limit
                else f"{value / limit:.1%} of the {_dtype_name(dtype)} limit {limit:g}"
            )
            if fc["steps_to_limit"] is not None:
                why += f"; growing x{fc['growth_per_step']:g} a step, the limit is ~{fc['steps_to_limit']:g} steps away"
            data = {
                "module": name,
                "absmax": value,
                "limit": limit,
                "dtype": _dtype_name(dtype),
                "fraction": value / limit,
                "warn_fraction": cfg.warn_fraction,
                "nonfinite": False,
                "consecutive": streak,
                **fc,
                "recommend": PRECISION_FALLBACK if recommend else None,
            }
            att = self._attention_data(name, stats)
            if att is not None:
                data["attention"] = att
            out.append(
                Finding(
                    kind=ACTIVATION_OVERFLOW,
                    message=(
                        f"step {step}: module {name!r} reached |x|={value:.6g}, {why}"
                        + (f"; {streak} sampled steps in a row" if streak > 1 else "")
                        + ("; precision_fallback recommended" if recommend else "")
                    ),
                    data=data,
                    where=name,
                    urgent=recommend,
                    occurrence=len(warned),
                )
            )
        if self._attn_cfg.enabled:
            tau = self._attn_cfg.tau
            regime = step <= self._regime_until
            for name, info in self.attention.items():
                heads = self._head_values(name, stats)
                hold = self._held.get(name)
                if hold is not None and step > hold.until and not regime:
                    del self._held[name]
                    hold = None
                if heads is None:
                    continue
                pre = self._pre_clips.get(name)
                if hold is not None and hold.left is not None and hold.left_step == step - 1 and hold.left > 0:
                    # The same weights as the clip left them: what this batch (and the other
                    # parameters' update) adds to the max logit (before the check's clip, if any).
                    ratio = (pre["max_logit"] if pre is not None else max(heads)) / hold.left
                    hold.ratios = [*(hold.ratios or [])[-(HEADROOM_SAMPLES - 1) :], ratio]
                    self._ratios = [*self._ratios[-(HEADROOM_SAMPLES - 1) :], ratio]
                over = any(finite(m) and m > tau for m in heads)
                # In the growth regime a module within reach of tau is held too: the next update
                # can take it over (its logits are checked after it).
                near = regime and max(heads) >= tau / MAX_HEADROOM
                if info.spec is None:
                    # Nothing QK-Clip can act on: told when the max first passes tau, then again
                    # only when it has doubled since (not on every sampled step), and not held.
                    told = self._told.get(name)
                    top = max(heads)
                    if not over or (told is not None and not (finite(top) and top > 2 * told)):
                        continue
                    self._told[name] = top if finite(top) else math.inf
                    limit = dtype_limit(self._attn_dtypes.get(name, torch.float32))
                    fc = self._trends.get(ATTN_LOGIT_MAX_PREFIX + name, _Trend()).forecast(limit)
                    out.append(AT.finding(step, name, heads, tau, None, info.reason, {"limit": limit, **fc}))
                    continue
                if not over and not near and (hold is None or step > hold.until):
                    continue
                if hold is None:
                    hold = self._held[name] = _Hold(step)
                limit = dtype_limit(self._attn_dtypes.get(name, torch.float32))
                fc = self._trends.get(ATTN_LOGIT_MAX_PREFIX + name, _Trend()).forecast(limit)
                extra: dict[str, Any] = {"limit": limit, **fc, "clip_target": self.clip_target(name)}
                if hold is not None:
                    extra["held"] = True
                    self._plan[name] = step + 1  # a held module is sampled every step
                if pre is not None:
                    extra["clipped_before_forward"] = pre
                out.append(AT.finding(step, name, heads, tau, info.spec, info.reason, extra))
            out += self._entropy_findings(step, stats)
        # Inputs are kept for the modules qk_clip may re-run after the update, only.
        wanted = {f.where for f in out if f.kind != AT.ATTENTION_ENTROPY_COLLAPSE}
        self._inputs = {n: v for n, v in self._inputs.items() if n in wanted}
        return out

    def _entropy_findings(self, step: int, stats: dict[str, float]) -> list[Finding]:
        """attention_entropy_collapse: a module's attn_entropy under ``entropy_collapse`` x its
        first sampled value; told once, again after it came back over twice that fraction."""
        floor = self._attn_cfg.entropy_collapse
        out: list[Finding] = []
        for name in self.attention:
            value = stats.get(AT.ATTN_ENTROPY_PREFIX + name)
            if value is None or not finite(value):
                continue
            start = self._entropy_start.setdefault(name, float(value))
            if not floor or start <= 0:
                continue
            fraction = value / start
            if fraction >= 2 * floor:
                self._entropy_told.discard(name)
            if fraction >= floor or name in self._entropy_told:
                continue
            self._entropy_told.add(name)
            top = stats.get(ATTN_LOGIT_MAX_PREFIX + name)
            tau = self._attn_cfg.tau
            under = f", its max logit {top:.4g} still under tau {tau:g}" if top is not None and top <= tau else ""
            out.append(
                Finding(
                    kind=AT.ATTENTION_ENTROPY_COLLAPSE,
                    message=(
                        f"step {step}: attention module {name!r} has turned nearly one-hot: its mean softmax "
                        f"entropy is {value:.3g} nats, {fraction:.1%} of its first {start:.3g}{under} (entropy "
                        "collapse, Zhai et al. 2023, comes with unstable training: a lower LR, warm-up, "
                        "qk-layernorm or a lower watch.attention.tau for QK-Clip)"
                    ),
                    data={
                        "module": name,
                        "entropy": value,
                        "entropy_start": start,
                        "fraction": fraction,
                        "entropy_collapse": floor,
                        "max_logit": top,
                        "tau": tau,
                    },
                    where=name,
                )
            )
        return out

    # ---- QK-Clip after the update ---------------------------------------------------------
    def clip_target(self, name: str) -> float:
        """The cap qk_clip brings ``name``'s max logit to: tau divided by the median headroom
        ratio its recent steps showed (1 while none is known; at most MAX_HEADROOM), and after a
        clip (held, or the growth regime) at least MIN_HEADROOM. (A first clip is Kimi K2's: the
        heads over tau to tau, the others untouched.)

        The median, not the largest: the check before each forward already clips the batch that
        comes in far over the rest, so the clip after the update covers the usual batch. Sized
        for the worst of the last few, it left 2 of 9 LR-sweep runs (3 LRs x 3 seeds) under half
        the gap to qk-layernorm; the median, none (docs/benchmarks.md, LR sweep)."""
        hold = self._held.get(name)
        # A module without a ratio of its own yet takes the model's recent ones.
        ratios = (hold.ratios if hold is not None else None) or self._ratios or [1.0]
        floor = MIN_HEADROOM if self._after_clip(name) else 1.0
        median = sorted(ratios)[len(ratios) // 2]
        return self._attn_cfg.tau / min(MAX_HEADROOM, max(floor, median))

    def _after_clip(self, name: str) -> bool:
        """Held after a clip qk_clip made (its report set ``left_step``: not only this step's
        finding), or the growth regime (a clip was needed lately, in any module)."""
        hold = self._held.get(name)
        clipped = hold is not None and hold.left_step >= 0 and self._step <= hold.until
        return clipped or self._step <= self._regime_until

    def _holding(self, name: str) -> bool:
        """Whether ``name`` is checked before its forward now: held after a clip qk_clip made, or
        any clippable module in the growth regime (a clip was needed lately: another module can
        cross tau in one update, before a sample has held it); only what qk_clip started (a watch
        whose findings no qk_clip answers never clips); not with sharded projections (FSDP2: each
        rank holds part of the rows) nor across processes (each rank would clip from its own batch
        alone)."""
        if not self._after_clip(name):
            return False
        if name in self._sharded or self._model is None:
            return False
        return world_size() == 1

    def _check_before_forward(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A held module's check before its training forward: its exact max logit per head on this
        forward's own input with the weights as they are; heads over tau less ``PRECHECK_MARGIN``
        are clipped to it now, so this forward's logits stay under tau. One module forward and one
        host read, on held steps only."""
        info = self.attention.get(name)
        if info is None or info.spec is None or self._model is None:
            return
        # Autocast caches its low-precision copy of a weight on first use: the check must not
        # leave one of the weights before the clip for the forward to use.
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            heads = self._measure(name, module, _detached(args), _detached(kwargs))
        finally:
            torch.set_autocast_cache_enabled(cache)
        if not heads:
            return
        tau = self._attn_cfg.tau
        # The forward computes its logits in the same dtype (the check runs inside its autocast).
        dtype = self._measured_dtype
        eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
        margin = max(PRECHECK_MARGIN, 4 * eps)
        facts = AT.clip_now(self._model, info.spec, name, heads, tau, tau * (1.0 - margin))
        if facts is not None:
            self._pre_clips[name] = facts

    def remeasure(self, name: str, keep: bool = False) -> list[float] | None:
        """The max logit per head that ``name`` gives now (after the update) on the input of its
        last sampled forward, or None (no input kept). Exact for that input: the module's own
        forward runs again (eval mode: no dropout, no running statistics; no grad; the random
        state put back), measured as on a sampled step. One host read. ``keep``: the input stays
        for another measure (qk_clip checks its clip on it)."""
        if keep:
            kept = self._last_inputs.get(name) or self._inputs.get(name)
        else:
            kept = self._last_inputs.pop(name, None) or self._inputs.pop(name, None)
        module = self._modules.get(name)
        if kept is None or module is None:
            return None
        _, args, kwargs = kept
        return self._measure(name, module, args, kwargs)

    def _measure(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> list[float] | None:
        """The max logit per head of ``module`` run on (args, kwargs) now (see ``remeasure``)."""
        saved = (self._sampled, self._due, self._stack, self._mode, self._attn, self._records, self._seq)
        modes = [(m, m.training) for m in module.modules()]
        devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
        self._sampled, self._due, self._stack, self._mode = True, {name}, [], None
        self._attn, self._records, self._remeasuring = {}, {}, True
        try:
            module.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                module(*args, **_without_caches(kwargs))
            rec = self._attn.get(name)
            heads = rec.heads.tolist() if rec is not None else None
            self._measured_dtype = rec.dtype if rec is not None else torch.float32
        finally:
            self._exit_mode()
            for m, training in modes:
                m.training = training
            self._remeasuring = False
            self._sampled, self._due, self._stack, self._mode, self._attn, self._records, self._seq = saved
        return heads

    def unclippable(self, name: str, reason: str) -> None:
        """QK-Clip cannot lower ``name``'s logits (qk_clip checked a clip and put it back): its
        projections are dropped (later findings say why, no clip is tried), and it is no longer
        held or checked before its forward."""
        info = self.attention.get(name)
        if info is not None:
            info.spec, info.reason = None, reason
        self._modules.pop(name, None)
        self._held.pop(name, None)
        self._inputs.pop(name, None)
        self._last_inputs.pop(name, None)

    def clipped(self, name: str, left: float, needed: bool, now: bool = False) -> None:
        """qk_clip's report: ``left`` is the max logit the module has now on the measured input;
        ``needed`` whether it was over the cap (that holds the module). Called after the update
        (the monitor has opened the next step), or ``now`` when the update does not land."""
        step = self._step if now else self._step - 1
        hold = self._held.get(name)
        if needed:
            hold = self._held[name] = _Hold(step + HOLD_STEPS, ratios=hold.ratios if hold is not None else None)
            self._regime_until = max(self._regime_until, step + HOLD_STEPS)
        if hold is not None:
            hold.left, hold.left_step = left, step
            # The next step is already open (no forward has run): sample this module, and in the
            # growth regime every clippable one.
            due = set(self._modules) if self._step <= self._regime_until else {name}
            self._plan[name] = step + 1
            if now:
                return
            if not self._sampled:
                self._sampled, self._due = True, due
            elif self._due is not None:
                self._due |= due

    # ---- forecast --------------------------------------------------------------------------
    def _limits(self, stats: dict[str, float]) -> dict[str, list[float]]:
        """Each watched maximum of this step (stat key) and the limits it must not reach."""
        out: dict[str, list[float]] = {}
        for name in self._order:
            out[ACT_ABSMAX_PREFIX + name] = [dtype_limit(self._dtypes.get(name, torch.float32))]
        for name in self._attn:
            limits = [dtype_limit(self._attn_dtypes.get(name, torch.float32))]
            if self._attn_cfg.enabled:
                limits.append(self._attn_cfg.tau)
            out[ATTN_LOGIT_MAX_PREFIX + name] = limits
        return out

    def _observe(self, step: int, stats: dict[str, float]) -> None:
        """Update each maximum's growth rate with this step's value; plan each module's next
        sample: within steps_to_limit / forecast_safety steps of its nearest limit (a maximum seen
        once is sampled again at the next step, to learn its rate); the stride covers the rest."""
        cfg = self.config
        self._plan = {m: at for m, at in self._plan.items() if at > step}
        for key, limits in self._limits(stats).items():
            if key not in stats:
                continue
            trend = self._trends.setdefault(key, _Trend())
            trend.add(step, float(stats[key]))
            if not cfg.forecast:
                continue
            wait = math.inf
            if len(trend.samples) == 1:
                wait = 1
            else:
                for limit in limits:
                    steps = trend.steps_to(limit)
                    if steps < math.inf:  # at or past a limit (a clipped module at tau): the next step
                        wait = min(wait, max(1, math.floor(steps / cfg.forecast_safety)))
            if wait < cfg.stride:
                module = key.split("/", 1)[1]
                self._plan[module] = min(self._plan.get(module, step + int(wait)), step + int(wait))

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self._step,
            "streak": dict(self._streak),
            "warned": {m: list(v) for m, v in self._warned.items()},
            "plan": dict(self._plan),
            "trends": {k: [list(s) for s in t.samples] for k, t in self._trends.items()},
            "regime_until": self._regime_until,
            "ratios": list(self._ratios),
            "entropy_start": dict(self._entropy_start),
            "entropy_told": sorted(self._entropy_told),
            "held": {
                m: {"until": h.until, "left": h.left, "left_step": h.left_step, "ratios": list(h.ratios or [])}
                for m, h in self._held.items()
            },
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._step = int(sd.get("step", 0))
        self._streak = {str(k): int(v) for k, v in dict(sd.get("streak", {})).items()}
        self._warned = {str(k): [int(s) for s in v] for k, v in dict(sd.get("warned", {})).items()}
        self._plan = {str(m): int(at) for m, at in dict(sd.get("plan", {})).items()}
        self._trends = {
            str(k): _Trend([(int(s), float(v)) for s, v in samples])
            for k, samples in dict(sd.get("trends", {})).items()
        }
        self._regime_until = int(sd.get("regime_until", -1))
        self._ratios = [float(r) for r in sd.get("ratios", [])]
        self._entropy_start = {str(k): float(v) for k, v in dict(sd.get("entropy_start", {})).items()}
        self._entropy_told = {str(m) for m in sd.get("entropy_told", [])}
        self._held = {
            str(m): _Hold(int(h["until"]), h.get("left"), int(h.get("left_step", -1)), list(h.get("ratios") or []))
            for m, h in dict(sd.get("held", {})).items()
        }


_CACHE_WORDS = ("cache", "past")  # kwargs names of key/value caches (past_key_values, layer_past...)


def _without_caches(kwargs: dict) -> dict:
    """A module's keyword arguments for a run of the monitor's own (measure, clip): every key/value
    cache left out (None; ``use_cache`` False), so the run neither feeds the forward's keys into it
    a second time nor reads keys that are not this input's. A cache is told by its name
    (``past_key_values``, ``layer_past``, ``*cache*``) or its type (``...Cache``)."""
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k == "use_cache":
            out[k] = False
        elif v is not None and (any(w in k.lower() for w in _CACHE_WORDS) or type(v).__name__.endswith("Cache")):
            out[k] = None
        else:
            out[k] = v
    return out


def _detached(obj: Any, depth: int = 0) -> Any:
    """``obj`` with its tensors detached (tuples, lists, dicts a few levels deep)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if depth < 4 and isinstance(obj, (tuple, list)):
        return type(obj)(_detached(o, depth + 1) for o in obj) if not hasattr(obj, "_fields") else obj
    if depth < 4 and isinstance(obj, dict):
        return {k: _detached(v, depth + 1) for k, v in obj.items()}
    return obj


def _last_rung(kind: str) -> int | None:
    """The ``after`` of the last rung of ``kind``'s registered (default) ladder."""
    from .registry import KINDS

    spec = KINDS.get(kind)
    return max((a for a, _ in spec.rungs), default=None) if spec is not None else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --------------------------------------------------------------------------------------------
# precision fallback
# --------------------------------------------------------------------------------------------


def _map_floats(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], depth: int = 0) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if depth >= 6:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_floats(o, fn, depth + 1) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_floats(o, fn, depth + 1) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_floats(v, fn, depth + 1)) for k, v in obj.items())
    return obj


class FallbackHandle:
    """Undo handle of ``precision_fallback``; ``remove()`` is safe to call twice."""

    def __init__(self, module_name: str, handles: list[Any]) -> None:
        self.module_name = module_name
        self._handles = handles
        self._contexts: list[tuple[torch.autocast, torch.dtype | None]] = []

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        while self._contexts:  # a forward interrupted mid-way: restore autocast state
            ctx, _ = self._contexts.pop()
            ctx.__exit__(None, None, None)


def precision_fallback(model: nn.Module, module_name: str, *, cast_back: bool = True) -> FallbackHandle:
    """Run ``model.<module_name>`` in fp32 from now on; ``handle.remove()`` undoes it.

    Inside the module autocast is disabled and floating inputs are upcast to fp32; floating outputs
    are cast back to the autocast dtype the caller runs under (``cast_back``) when that is bf16,
    whose range is fp32's. Under fp16 they stay fp32: the module overflowed fp16's range, and its
    outputs cast back would be inf again where they are what overflowed (a parameter-free
    similarity module); the ops after it that autocast runs in fp16 (matmul, linear, conv) cast
    their inputs themselves, as before. Only for modules whose parameters are fp32 (autocast mixed
    precision); a ``.half()`` module raises ValueError.
    """
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError as e:
        raise ValueError(f"precision_fallback: model has no module named {module_name!r}") from e
    low = [
        n
        for n, p in module.named_parameters()
        if p.is_floating_point() and p.dtype != torch.float32 and p.dtype != torch.float64
    ]
    if low:
        raise ValueError(
            f"precision_fallback: module {module_name!r} holds low-precision parameters "
            f"({low[0]}: {module.get_parameter(low[0]).dtype}); it handles autocast "
            f"mixed precision only (keep the parameters in fp32)"
        )
    handle = FallbackHandle(module_name, [])

    def device_type_of(args, kwargs) -> str:
        for t in _iter_tensors((args, kwargs)):
            return t.device.type
        for p in module.parameters():
            return p.device.type
        return "cpu"

    def pre(mod, args, kwargs):
        dev = device_type_of(args, kwargs)
        caller = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        ctx = torch.autocast(device_type=dev, enabled=False)
        ctx.__enter__()
        handle._contexts.append((ctx, caller))
        up = lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        return _map_floats(args, up), _map_floats(kwargs, up)

    def post(mod, args, kwargs, output):
        if not handle._contexts:
            return None
        ctx, caller = handle._contexts.pop()
        ctx.__exit__(None, None, None)
        if cast_back and caller is not None and caller != torch.float16 and output is not None:
            return _map_floats(output, lambda t: t.to(caller) if t.dtype == torch.float32 else t)
        return None

    handle._handles = [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True, always_call=True),
    ]
    return handle
