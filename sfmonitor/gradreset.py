"""Was ``zero_grad()`` called between two optimizer steps? One parameter tells.

A loop that forgets ``optimizer.zero_grad()`` (or ``model.zero_grad()``) adds every step's
gradients onto all the earlier ones: each update is the sum of every gradient since the start.
Nothing is non-finite and nothing jumps: ``grad_norm/total`` climbs smoothly (a probe: 1 to 300 in
300 steps), too smoothly for a spike test, and under SGD the run drifts off while under Adam it
trains on a stale direction. The statistics cannot tell it from a run whose gradients grow.

Autograd can. Backward accumulates into a parameter's existing ``.grad`` in place, bumping that
tensor's version counter by one. So, at the end of each optimizer step the probe notes one
parameter's gradient tensor (a weak reference: a strong one would make autograd accumulate out of
place) and its version; at every accumulation into that parameter until the next step (a
``post_accumulate_grad`` hook) it looks again, against what it saw last:

* a different tensor, or none: the gradients were set to ``None`` (``zero_grad()``'s default);
* the same tensor, two or more versions on: changed in place besides the accumulation, e.g.
  zeroed (``zero_grad(set_to_none=False)``, ``p.grad.zero_()``);
* the same tensor, exactly one version on: accumulated onto what was there.

The next step's gradients were not reset when accumulations reached it and none of them saw a
reset. Every accumulation counts, not only the first: in a GAN the generator's backward runs
through the discriminator and adds to its gradients after the discriminator's step, and the
discriminator's ``zero_grad()`` at the top of the next iteration resets them. Micro-batch
accumulation within a step reads as accumulation after the reset, and gradients the user assigns
(``p.grad = ...``: no accumulation, no hook) are not judged. The probe costs one hook call per
backward and one weak reference per call; no tensor is read. DTensor parameters (FSDP2) are not
probed: their gradients are written by the reduce-scatter.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch


class GradResetProbe:
    """``arm(params)`` at the end of every optimizer step; ``take()`` in the next step's pipeline
    says whether that step's gradients were accumulated onto the last one's (True), were reset
    (False) or were not seen (None: the probed parameter got no gradient by autograd)."""

    def __init__(self) -> None:
        self._param: weakref.ref[torch.Tensor] | None = None
        self._hook: Any = None
        self._last: tuple[weakref.ref[torch.Tensor], int] | None = None  # the gradient as last seen
        self._seen: bool | None = None
        self._count = 0  # accumulations seen (a mark holds the count: a reset back to None shows)
        self.index = -1  # the probed parameter's position in the list arm() was given

    def arm(self, params: Sequence[torch.Tensor]) -> None:
        """Note the first parameter's gradient as the step leaves it (call after the update)."""
        self._last, self._seen = None, None
        i, p = next(((i, q) for i, q in enumerate(params) if q.grad is not None), (-1, None))
        if p is None or type(p.grad) is not torch.Tensor:
            return  # nothing to probe, or a DTensor gradient (FSDP2)
        if self._param is None or self._param() is not p:
            self.remove()
            self._param, self.index = weakref.ref(p), i
            self._hook = p.register_post_accumulate_grad_hook(torch.compiler.disable(self._on_accumulate))
        grad = p.grad
        assert grad is not None
        self._last = (weakref.ref(grad), grad._version)

    def _on_accumulate(self, param: torch.Tensor) -> None:
        if self._last is None:  # not armed: before the first step, or nothing to probe
            return
        ref, version = self._last
        grad = param.grad
        if grad is None:
            return
        self._count += 1
        onto_last = ref() is grad and grad._version == version + 1
        self._seen = onto_last and self._seen is not False  # one reset since the step is enough
        self._last = (weakref.ref(grad), grad._version)

    @property
    def armed(self) -> bool:
        """Whether a gradient is probed (from the end of the first step with one on)."""
        return self._last is not None and self._param is not None and self._param() is not None

    def mark(self) -> Mark | None:
        """The probed gradient as it is now, and the accumulations so far (None: nothing probed),
        for ``reset_since``."""
        p = self._param() if self._param is not None else None
        if p is None or self._last is None:
            return None
        grad = p.grad
        return (None, 0, self._count) if grad is None else (weakref.ref(grad), grad._version, self._count)

    def reset_since(self, mark: Mark | None) -> bool:
        """Whether the gradients were reset (``zero_grad()``) since ``mark`` was taken: the probed
        gradient is not as the last accumulation (or the step) left it, and it is not as it was at
        the mark either, or a backward accumulated into it since (``zero_grad(set_to_none=True)``
        after that backward leaves it as it was at a mark taken after the last reset: None).
        Accumulations alone (the backward of the forward that took the mark) are no reset. False
        when nothing is probed (before the first step)."""
        now = self.mark()
        if mark is None or now is None or self._last is None or _same(now[:2], self._last):
            return False
        return not _same(now[:2], mark[:2]) or now[2] != mark[2]

    def take(self) -> bool | None:
        """Whether every accumulation since the last step added onto its gradients (then forgotten)."""
        seen, self._seen = self._seen, None
        return seen

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._param, self._last, self._seen, self.index = None, None, None, None, -1


# A note of the probed gradient: (a weak reference to it, None without one; its version; the
# accumulations the probe had seen)
Mark = tuple[weakref.ref[torch.Tensor] | None, int, int]


def _same(a: tuple[weakref.ref[torch.Tensor] | None, int], b: tuple[weakref.ref[torch.Tensor] | None, int]) -> bool:
    """Whether two notes of a gradient (a weak reference and a version; None: no gradient) are of
    the same tensor at the same version (a tensor since freed matches nothing)."""
    if a[0] is None or b[0] is None:
        return a[0] is None and b[0] is None
    t = a[0]()
    return t is not None and t is b[0]() and a[1] == b[1]
