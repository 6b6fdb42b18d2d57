"""fp16 overflow watch and precision fallback (the field report's first trap, docs/reference_model.md).

``ActivationWatch`` records, on sampled optimizer steps, the largest |value| each watched module
produces -- its outputs *and* the results of the matmul/softmax/exp-like ops computed inline in its
``forward`` (attention logits ``q @ k.transpose(-1, -2)`` have no module of their own: the report's
fusion layer overflowed exactly there). Values stay 0-d tensors until the monitor's single host read
(``pending()``); ``findings(step, stats)`` then turns them into ``activation_overflow`` findings:

* a warning when a module's |value| reaches ``warn_fraction`` of the limit of the dtype it was
  produced in (fp16: 65504), i.e. *before* it overflows, naming the module;
* the first module, in forward order, whose output or inline intermediate is inf/NaN.

How inline ops are seen: on a sampled step, a ``torch.overrides.TorchFunctionMode`` is pushed by the
forward pre-hook of the outermost watched module and popped by its forward hook (``always_call``, so
an exception in ``forward`` cannot leave it pushed). A stack of watched module names attributes
each op to the innermost watched module running. On unsampled steps the hooks return at once and
no mode is pushed, so the cost is two Python calls per watched module call.

``precision_fallback(model, name)`` runs one module in fp32 from then on (autocast off inside it,
floating inputs upcast, floating outputs cast back to the caller's autocast dtype), with public
forward hooks only -- no monkey-patching -- undone by ``handle.remove()``.

Statistic keys (``pending()``):

=============================  =========================================================
``act_absmax/<module>``         max |value| of the module's outputs and inline ops this step,
                                in its narrowest floating dtype (inf/NaN when non-finite)
``internal/act_first_nonfinite`` index into ``ActivationWatch.module_names`` of the first module
                                (in forward order) that produced inf/NaN this step; -1: none
=============================  =========================================================
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .events import ACTIVATION_OVERFLOW, PRECISION_FALLBACK, ConfigError, Finding
from .registry import register_kind
from .schema import Section, option
from .stats import ACT_FIRST_NONFINITE, finite

# A first warning (|x| >= half the dtype's max) is told; a second within 100 steps means the module
# keeps living near the limit: run it in fp32 before it overflows. A real overflow, or a warning
# that persisted, is urgent: it goes straight to that rung.
register_kind(
    ACTIVATION_OVERFLOW,
    [(1, []), (2, [PRECISION_FALLBACK])],
    window=100,
    doc="a watched module's activations near or past its dtype's limit",
)

__all__ = [
    "ACT_ABSMAX_PREFIX",
    "FIRST_NONFINITE_KEY",
    "ActivationWatch",
    "FallbackHandle",
    "WatchConfig",
    "dtype_limit",
    "precision_fallback",
]

ACT_ABSMAX_PREFIX = "act_absmax/"
# An index, internal and per rank (stats.REDUCTIONS: LOCAL): never in monitor.stats.
FIRST_NONFINITE_KEY = ACT_FIRST_NONFINITE
_NO_NONFINITE = 2**62  # sentinel sequence number: "no non-finite record"

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
        "sample every N optimizer steps (1: every step); at 10 the measured "
        "overhead is ~1-2% of a step (docs/forensics.md)",
        lo=1,
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

    def validate(self) -> None:
        for key in ("modules", "classes"):
            for i, pat in enumerate(getattr(self, key)):
                if pat.startswith("re:"):
                    try:
                        re.compile(pat[3:])
                    except re.error as e:
                        raise ConfigError(f"{self._prefix}{key}[{i}]: bad regex {pat[3:]!r}: {e}") from e


def _matches(patterns: Iterable[str], text: str) -> bool:
    for pat in patterns:
        if pat.startswith("re:"):
            if re.search(pat[3:], text):
                return True
        elif fnmatch.fnmatchcase(text.lower(), pat.lower()):
            return True
    return False


def _iter_tensors(obj: Any, depth: int = 0):
    """Floating tensors inside an output (tensor, tuple/list, dict), a few levels deep."""
    if isinstance(obj, torch.Tensor):
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


class _InlineMode(TorchFunctionMode):
    """Records results of WATCHED_FUNCTIONS for the innermost watched module running."""

    def __init__(self, watch: ActivationWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        w = self.watch
        if func in WATCHED_FUNCTIONS and w._stack and not w._busy:
            w._record(w._stack[-1], out)
        return out


class ActivationWatch:
    """Forward hooks that record max |activation| per watched module on sampled steps.

    Use: ``attach(model)``; ``reset(step)`` at the start of each optimizer step (before its
    forwards); after the backward, put ``pending()`` into the step's single host read and pass the
    resulting floats to ``findings(step, stats)``; ``detach()`` removes every hook.
    """

    def __init__(self, config: WatchConfig | None = None) -> None:
        self.config = config or WatchConfig()
        self.module_names: list[str] = []  # watched modules, in named_modules() order
        self._handles: list[Any] = []
        self._stack: list[str] = []
        self._mode: _InlineMode | None = None
        self._busy = False
        self._records: dict[str, _Record] = {}  # insertion order = first seen in forward order
        self._seq = 0
        self._step = 0
        self._sampled = True
        self._force = False
        self._streak: dict[str, int] = {}  # consecutive sampled steps over warn_fraction
        self._dtypes: dict[str, torch.dtype] = {}  # dtype behind act_absmax/<m> of the last pending()
        self._order: list[str] = []  # module names behind act_first_nonfinite

    # ---- lifecycle -------------------------------------------------------------------------
    def select(self, model: nn.Module) -> list[str]:
        """Names of the modules the config selects (named_modules order)."""
        cfg = self.config
        names = []
        for name, mod in model.named_modules():
            if not name:
                continue
            if _matches(cfg.modules, name) or _matches(cfg.classes, type(mod).__name__):
                names.append(name)
        return names

    def attach(self, model: nn.Module) -> ActivationWatch:
        if self._handles:
            raise RuntimeError("ActivationWatch is already attached; call detach() first")
        if not self.config.enabled:
            return self
        self.module_names = self.select(model)
        for name in self.module_names:
            mod = model.get_submodule(name)
            self._handles.append(mod.register_forward_pre_hook(self._make_pre(name)))
            self._handles.append(mod.register_forward_hook(self._make_post(name), always_call=True))
        self.reset(0)
        return self

    def detach(self) -> None:
        """Remove every hook and pop the inline mode if a forward was interrupted."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._exit_mode()
        self._records.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def reset(self, step: int | None = None) -> None:
        """Start an optimizer step: clear this step's records; decide whether it is sampled."""
        self._exit_mode()
        self._step = self._step + 1 if step is None else int(step)
        self._sampled = self._force or self._step % self.config.stride == 0
        self._force = False
        self._records = {}
        self._seq = 0

    def sample_next(self) -> None:
        """Make the next step sampled whatever the stride (e.g. after a non-finite loss)."""
        self._force = True

    @property
    def sampled(self) -> bool:
        return self._sampled

    # ---- hooks -----------------------------------------------------------------------------
    def _active(self) -> bool:
        return self._sampled and (torch.is_grad_enabled() or not self.config.grad_only)

    def _make_pre(self, name: str) -> Callable:
        def pre(module, args):
            if not self._active():
                return None
            self._stack.append(name)
            if self.config.inline and self._mode is None:
                self._mode = _InlineMode(self)
                self._mode.__enter__()
            return None

        return pre

    def _make_post(self, name: str) -> Callable:
        def post(module, args, output):
            if not self._stack or self._stack[-1] != name:
                return None  # not pushed (unsampled step) or already cleaned up
            self._stack.pop()
            if output is not None:
                self._record(name, output)
            if not self._stack:
                self._exit_mode()
            return None

        return post

    def _exit_mode(self) -> None:
        self._stack.clear()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _record(self, name: str, output: Any) -> None:
        self._busy = True
        try:
            with torch.no_grad():
                rec = self._records.get(name)
                if rec is None:
                    rec = self._records[name] = _Record()
                for t in _iter_tensors(output):
                    m = t.detach().abs().amax().float()  # inf/NaN propagate through amax
                    prev = rec.absmax.get(t.dtype)
                    rec.absmax[t.dtype] = m if prev is None else torch.maximum(prev, m)
                    bad = torch.where(torch.isfinite(m), _NO_NONFINITE, self._seq)
                    rec.first_bad = bad if rec.first_bad is None else torch.minimum(rec.first_bad, bad)
                    self._seq += 1
        finally:
            self._busy = False

    # ---- read-out --------------------------------------------------------------------------
    def pending(self) -> dict[str, torch.Tensor]:
        """This step's 0-d tensors: ``act_absmax/<module>`` and ``act_first_nonfinite``.

        Empty on unsampled steps. For each module the value is taken in the narrowest dtype it
        produced (the one that overflows first); wider dtypes still count for non-finiteness.
        """
        out: dict[str, torch.Tensor] = {}
        self._dtypes = {}
        order, bads = [], []
        for name, rec in self._records.items():
            if not rec.absmax:
                continue
            dtype = min(rec.absmax, key=dtype_limit)
            self._dtypes[name] = dtype
            out[ACT_ABSMAX_PREFIX + name] = rec.absmax[dtype]
            order.append(name)
            bads.append(rec.first_bad if rec.first_bad is not None else torch.tensor(_NO_NONFINITE))
        self._order = order
        if bads:
            seqs = torch.stack(bads)
            first = torch.argmin(seqs)
            out[FIRST_NONFINITE_KEY] = torch.where(seqs[first] < _NO_NONFINITE, first, -1).float()
        return out

    def findings(self, step: int, stats: dict[str, float]) -> list[Finding]:
        """activation_overflow findings from this step's host-read values (see module doc)."""
        cfg = self.config
        out: list[Finding] = []
        seen = set()
        first_idx = int(stats.get(FIRST_NONFINITE_KEY, -1))
        if not 0 <= first_idx < len(self._order):
            # Under torch.distributed the maxima are the max over ranks: another rank's overflow
            # shows here as a non-finite maximum without a local index; name the first such module.
            first_idx = next(
                (i for i, n in enumerate(self._order) if not finite(float(stats.get(ACT_ABSMAX_PREFIX + n, 0.0)))), -1
            )
        if 0 <= first_idx < len(self._order):
            name = self._order[first_idx]
            dtype = self._dtypes.get(name, torch.float32)
            bad = sorted(
                n for n in self._order if ACT_ABSMAX_PREFIX + n in stats and not finite(stats[ACT_ABSMAX_PREFIX + n])
            )
            value = stats.get(ACT_ABSMAX_PREFIX + name, float("nan"))
            out.append(
                Finding(
                    kind=ACTIVATION_OVERFLOW,
                    message=(
                        f"step {step}: module {name!r} is the first (in forward order) to produce "
                        f"inf/NaN ({_dtype_name(dtype)}, limit {dtype_limit(dtype):g})"
                    ),
                    data={
                        "module": name,
                        "absmax": value,
                        "limit": dtype_limit(dtype),
                        "dtype": _dtype_name(dtype),
                        "nonfinite": True,
                        "nonfinite_modules": bad,
                        "recommend": PRECISION_FALLBACK,
                    },
                    where=name,
                    urgent=True,
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
            if not finite(value) or value < cfg.warn_fraction * limit:
                self._streak[name] = 0
                continue
            streak = self._streak[name] = self._streak.get(name, 0) + 1
            recommend = streak >= cfg.persist
            out.append(
                Finding(
                    kind=ACTIVATION_OVERFLOW,
                    message=(
                        f"step {step}: module {name!r} reached |x|={value:.6g}, "
                        f"{value / limit:.0%} of the {_dtype_name(dtype)} limit {limit:g} "
                        f"(warn at {cfg.warn_fraction:g})"
                        + (f"; {streak} sampled steps in a row" if streak > 1 else "")
                        + ("; precision_fallback recommended" if recommend else "")
                    ),
                    data={
                        "module": name,
                        "absmax": value,
                        "limit": limit,
                        "dtype": _dtype_name(dtype),
                        "fraction": value / limit,
                        "warn_fraction": cfg.warn_fraction,
                        "nonfinite": False,
                        "consecutive": streak,
                        "recommend": PRECISION_FALLBACK if recommend else None,
                    },
                    where=name,
                    urgent=recommend,
                )
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "streak": dict(self._streak)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._step = int(sd.get("step", 0))
        self._streak = {str(k): int(v) for k, v in dict(sd.get("streak", {})).items()}


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
    are cast back to the autocast dtype the caller runs under (``cast_back``). Only for modules whose
    parameters are fp32 (autocast mixed precision); a ``.half()`` module raises ValueError.
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
        if cast_back and caller is not None and output is not None:
            return _map_floats(output, lambda t: t.to(caller) if t.dtype == torch.float32 else t)
        return None

    handle._handles = [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True, always_call=True),
    ]
    return handle
