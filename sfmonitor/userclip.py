"""Gradients as backward made them, when the user clips before ``optimizer.step()``.

A nanoGPT-style loop (``loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0);
optimizer.step()``), the HF Trainer and accelerate clip the gradients before the optimizer's step
pre-hook fires, where the monitor measures them. Measured there, ``grad_norm/*`` would be the
clipped norm (stuck at the threshold), the gradient-spike detector blind, and one NaN gradient,
spread to every gradient by the clip's global norm, would be reported in the model's first
parameter instead of its source.

How: while a monitor is attached, torch's clip functions are wrapped (restored when the last
monitor detaches):

    torch.nn.utils.clip_grad._clip_grads_with_norm_  the function every ``clip_grad_norm_`` calls to
                                                    scale the gradients (a module global, looked
                                                    up at each call: reached however
                                                    ``clip_grad_norm_`` was imported)
    torch.nn.utils.clip_grads_with_norm_            its public name
    torch.nn.utils.clip_grad_value_                 (and ``clip_grad.clip_grad_value_``)

Before the original runs, each monitor whose optimizer holds some of the clipped parameters
measures their gradients: the same per-parameter fused norms of the local shards
(``stats.norms``) as ``Monitor._collect_tensors``, 0-d tensors, no host read. At the step,
``take`` hands them to ``_collect_tensors`` in place of the norms of the clipped gradients, so
``grad_norm/*``, the detectors and the non-finite checks see the gradients as they were before the
clip; ``grad_clip/user`` (1.0) and ``grad_clip/coef`` (the clip's coefficient on the total norm)
say that the user clipped, and the ``clip`` action reads the first so as never to clip twice.

Exact: a gradient measured at a clip is used only if it is the same tensor, unchanged, at the
step: its version counter (``Tensor._version``, bumped by every in-place operation) is recorded
after each clip. A gradient changed since (another backward accumulated into it, a GradScaler
unscaled it) is measured as it is at the step. A second clip of unchanged gradients in the same
step (a value clip then a norm clip; a framework's clip and the user's) keeps the first
measurement: the gradients as backward left them.

Why wrapping the clip functions and not per-parameter post-accumulate-grad hooks:

- cost: the wrapper runs only when the user clips, and measures once per step. Hooks would run
  on every backward whether anyone clips or not (no clip must cost nothing), once per parameter in
  Python, and once per micro-batch under gradient accumulation, where only the gradients as they
  are at the clip matter.
- exactness: under DDP a parameter's hook fires before the reducer all-reduces its bucket, under
  FSDP2 before the reduce-scatter, and under a GradScaler before ``unscale_``: the local, scaled
  gradient, not the one the clip and the optimizer see. The wrapper sees exactly the gradients the
  clip receives.

Limits (docs/guide.md): ``clip_grad_value_`` and ``clip_grads_with_norm_`` imported by name before
attach (``from torch.nn.utils import clip_grad_value_``) are not reached (``clip_grad_norm_`` is,
however imported); clips of other kinds (``Tensor.clamp_`` by hand, FSDP1's
``model.clip_grad_norm_``, DeepSpeed's own) are not seen: ``grad_norm/*`` is then the clipped norm.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.utils as nn_utils
from torch.amp.grad_scaler import OptState
from torch.nn.utils import clip_grad as clip_grad_module

from . import stats as S
from .sharding import local

__all__ = ["CLIP_COEF", "USER_CLIPPED", "UserClip", "grads_scaled", "wrapped_functions"]

USER_CLIPPED = "grad_clip/user"  # 1.0: this step's statistics were taken before the user's clip
CLIP_COEF = "grad_clip/coef"  # ||gradients after the user's clip|| / ||before||, over the monitored ones

# (module, attribute) of each function wrapped while a monitor is attached. ``_clip_grads_with_norm_``
# (torch >= 2.6, this package's floor) is where ``clip_grad_norm_`` scales the gradients, after
# ``_get_total_norm`` only read them.
_TARGETS: tuple[tuple[Any, str], ...] = (
    (clip_grad_module, "_clip_grads_with_norm_"),
    (nn_utils, "clip_grads_with_norm_"),
    (clip_grad_module, "clip_grad_value_"),
    (nn_utils, "clip_grad_value_"),
)


class _Patch:
    """The one set of wrappers, shared by every attached monitor (nested monitors, two optimizers).
    Installed by the first ``UserClip.join``, removed by the last ``leave``, whatever the order."""

    def __init__(self) -> None:
        self.clips: list[UserClip] = []
        self.installed: list[tuple[Any, str, Any, Any]] = []  # (module, name, original, wrapper)

    def join(self, clip: UserClip) -> None:
        if clip in self.clips:
            return
        if not self.clips:
            self.install()
        self.clips.append(clip)

    def leave(self, clip: UserClip) -> None:
        if clip not in self.clips:
            return
        self.clips.remove(clip)
        if not self.clips:
            self.restore()

    def install(self) -> None:
        wrappers: dict[int, Any] = {}  # one wrapper per original (two names, one function)
        for module, name in _TARGETS:
            original = getattr(module, name, None)
            if original is None:
                continue
            wrapper = wrappers.get(id(original))
            if wrapper is None:
                wrapper = wrappers[id(original)] = _wrap(original)
            setattr(module, name, wrapper)
            self.installed.append((module, name, original, wrapper))

    def restore(self) -> None:
        for module, name, original, wrapper in reversed(self.installed):
            # Someone wrapped our wrapper after attach: theirs stays (ours, left inside it, passes
            # straight through to torch once no monitor is attached).
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        self.installed.clear()


_PATCH = _Patch()
_BUSY = threading.local()  # inside a wrapped call: a nested wrapped call measures nothing again


def wrapped_functions() -> list[tuple[Any, str, Any]]:
    """(module, name, original) of each torch function wrapped now (empty when no monitor is attached)."""
    return [(module, name, original) for module, name, original, _ in _PATCH.installed]


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not _PATCH.clips or getattr(_BUSY, "active", False):
            return original(parameters, *args, **kwargs)
        if isinstance(parameters, torch.Tensor):
            params: list[Any] = [parameters]
        else:
            try:
                params = list(parameters)  # a generator is read once: torch gets the same list
            except TypeError:
                return original(parameters, *args, **kwargs)  # torch's own error names the bad input
        _BUSY.active = True
        seen: list[tuple[UserClip, list[tuple[int, torch.Tensor]]]] = []
        try:
            for clip in list(_PATCH.clips):
                seen.append((clip, clip.before_clip(params)))
            return original(params, *args, **kwargs)
        finally:
            for clip, matched in seen:
                clip.after_clip(matched)
            _BUSY.active = False

    return clip_wrapper


@dataclass(eq=False)
class _Measured:
    """One gradient measured at a clip: its norm is ``norms[at]``."""

    norms: torch.Tensor  # the pre-clip norms of the gradients one clip call measured (fp32)
    at: int
    grad: weakref.ref[torch.Tensor]  # the (local) gradient measured: the same tensor at the step?
    version: int = -1  # its version counter after the last clip that saw it


class UserClip:
    """One monitor's view of the user's clips (see the module docstring).

    Args:
        open_step: the step whose pipeline has not run yet, or None (a clip after the monitor's
            ``before_update``, as Lightning's, already comes after the statistics).
        params: the monitor's parameter list (the positions ``_collect_tensors`` uses).
        scaled: whether the gradients are still scaled by a GradScaler (no ``unscale_`` yet).
    """

    def __init__(
        self,
        open_step: Callable[[], int | None],
        params: Callable[[], Sequence[torch.Tensor]],
        scaled: Callable[[], bool],
    ) -> None:
        self._open_step, self._params, self._scaled = open_step, params, scaled
        self._indexed: Sequence[torch.Tensor] | None = None
        self._position: dict[int, int] = {}  # id(parameter) -> its index in params()
        self._step: int | None = None
        self._seen: dict[int, _Measured] = {}
        self._warned = False

    def join(self) -> None:
        _PATCH.join(self)

    def leave(self) -> None:
        _PATCH.leave(self)
        self._seen, self._step, self._indexed, self._position = {}, None, None, {}

    def _positions(self) -> dict[int, int]:
        params = self._params()
        if params is not self._indexed:  # attach, or add_param_group() rebuilt the list
            self._indexed, self._position = params, {id(p): i for i, p in enumerate(params)}
        return self._position

    def before_clip(self, params: Iterable[Any]) -> list[tuple[int, torch.Tensor]]:
        """Measure the monitored gradients among ``params`` before a clip changes them. Returns the
        (position, local gradient) pairs the clip touches, for ``after_clip``. Never raises: a
        failure costs this step's pre-clip statistics (a warning), never the user's clip."""
        try:
            return self._measure(params)
        except Exception as e:  # the user's clip must run whatever happens here
            self._seen = {}
            warnings.warn(
                f"sfmonitor: the gradients could not be measured before the clip "
                f"({type(e).__name__}: {e}); this step's grad_norm/* is of the clipped gradients",
                RuntimeWarning,
                stacklevel=4,
            )
            return []

    def _measure(self, params: Iterable[Any]) -> list[tuple[int, torch.Tensor]]:
        step = self._open_step()
        if step is None:
            return []
        if step != self._step:
            self._step, self._seen = step, {}
        position = self._positions()
        matched: list[tuple[int, torch.Tensor]] = []
        todo: list[tuple[int, torch.Tensor]] = []
        taken: set[int] = set()
        for p in params:
            i = position.get(id(p))
            if i is None or i in taken or p.grad is None:
                continue
            taken.add(i)
            g = local(p.grad)
            matched.append((i, g))
            m = self._seen.get(i)
            if m is None or m.version != g._version or m.grad() is not g:
                todo.append((i, g))  # not measured yet, or changed since an earlier clip
        if not todo:
            return matched
        if self._scaled():
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "sfmonitor: a gradient clip ran on gradients still scaled by the GradScaler, so it "
                    "clips at the loss scale times its threshold; call scaler.unscale_(optimizer) "
                    "before clipping. The monitor measures the gradients unscaled, at the step.",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return []
        norms = S.norms([g for _, g in todo])
        for at, (i, g) in enumerate(todo):
            self._seen[i] = _Measured(norms, at, weakref.ref(g))
        return matched

    def after_clip(self, matched: list[tuple[int, torch.Tensor]]) -> None:
        """Record each measured gradient's version as the clip left it (unchanged at the step:
        the measurement stands)."""
        for i, g in matched:
            m = self._seen.get(i)
            if m is not None and m.grad() is g:
                m.version = g._version

    def take(
        self, step: int, present: Sequence[tuple[int, torch.Tensor]], measured: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """The per-parameter gradient norms of ``step`` as they were before the user's clip.

        ``present``: (position, gradient) of each parameter with a gradient, in the order of
        ``measured`` (their norms now). Returns ``measured`` itself and False when no clip measured
        them this step (no cost, bit-identical statistics); else the norms with each gradient
        measured at a clip, and unchanged since, in its place, and True."""
        seen, self._seen = self._seen, {}
        if not seen or self._step != step:
            return measured, False
        slots: list[int] = []
        picks: list[_Measured] = []
        for slot, (i, grad) in enumerate(present):
            m = seen.get(i)
            if m is None:
                continue
            g = local(grad)
            if m.version != g._version or m.grad() is not g:
                continue  # changed since the clip: as it is now
            slots.append(slot)
            picks.append(m)
        if not slots:
            return measured, False
        first = picks[0].norms
        if len(slots) == len(present) == first.numel() and all(
            m.norms is first and m.at == k for k, m in enumerate(picks)
        ):
            return first, True  # one clip over every gradient: its measurement as it is
        batches = list({id(m.norms): m.norms for m in picks}.values())
        offsets, at = {}, 0
        for b in batches:
            offsets[id(b)] = at
            at += b.numel()
        src = torch.tensor([offsets[id(m.norms)] + m.at for m in picks]).to(measured.device)
        dst = torch.tensor(slots).to(measured.device)
        merged = measured.clone()
        merged[dst] = torch.cat(batches).to(merged.dtype)[src]
        return merged, True

    @staticmethod
    def stats(total_before: torch.Tensor, total_after: torch.Tensor) -> dict[str, Any]:
        """The statistics of a step the user clipped: the flag and the clip's coefficient on the
        total norm (both norms are this rank's shares, completed across ranks before the ratio)."""
        return {USER_CLIPPED: 1.0, CLIP_COEF: S.NormRatio(total_after, total_before)}


def grads_scaled(scaler: Any, optimizer: Any) -> bool:
    """Whether ``optimizer``'s gradients are still scaled by ``scaler`` (no ``unscale_`` this step)."""
    if scaler is None or optimizer is None:
        return False
    # The per-optimizer state is made at the first unscale_/step after each update(): none yet is READY.
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is None or state.get("stage") is OptState.READY
