"""Weights the loop changed between two optimizer steps: not the optimizer's doing, nor the monitor's.

A loop may change the weights itself after an update: a head re-initialised
(``reset_parameters()``), a checkpoint loaded (``load_state_dict``), shrink and perturb, a
constraint applied after every step (a WGAN critic's clamp, a max-norm projection). The next
step's loss then measures that change, not its batch, and not the update before it.

Every in-place write to a tensor moves its version counter (FSDP2: the DTensor's, or its local
shard's where the write went through ``to_local()``), and a tensor replaced (``p.data = ...``,
``model.to(...)``) changes its storage: ``LoopWrites`` keeps both for each parameter as a step
leaves it (``close``) and names those that moved by the next step's pipeline (``changed``). A
forward and a backward write neither. The monitor's own writes between the steps (QK-Clip after
the update, or before a held module's forward) are marked with ``own_write`` and do not count.
Where the undo copy holds the state before the last update, a write the counters show counts only
where it is material, measured as the values below (schedule-free AdamW's ``eval()`` and
``train()`` move the weights to their average and back: rounding is all they change).

Two changes move no parameter's counter: an in-place write through ``p.data``
(``p.data.mul_(mask)``: that tensor keeps a version counter of its own), and a buffer the loop
adds or replaces (``torch.nn.utils.prune`` registers a mask buffer and leaves the weights as they
were). Both are looked for where they matter, at a step whose loss or gradient norm jumps:

- **Buffers.** ``close`` also keeps which tensor each module's buffer slots hold (a walk of the
  modules' buffer dicts: tens of microseconds), and ``buffers_changed`` names the slots added,
  removed or given a new tensor since. A module whose buffers changed at one of the last
  ``habit`` steps' ends (DINO's ``self.center = ...`` every step) is left out: that is its habit.
- **Values.** The monitor measures each update from its undo copy (``undo.update_norms``); a
  parameter that no counter shows written still holds what the update left when the distance from
  that copy is the same now (``keep_moved``, ``values_due``; the monitor counts a write only where
  it could explain a jump: larger than the update and than 1% of the weights). Without the copy,
  what the update ratio measured (the lean profile: a slice of each parameter) keeps its norms as
  the update left them. Measured where a jump asks, at the
  step after a change was found, and every ``SAMPLE_EVERY`` steps, counted in the step's one read
  (so that a loop that writes large ones through ``.data`` at every step is known for it before a
  jump asks).

Not seen: values written through ``.data`` outside the lean profile's slices (without the undo
copy), or with ``stats.update_ratio_every`` > 1 on the steps it leaves unmeasured; and a new
parameter the loop registers on the model (the optimizer still holds the old one).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

from .sharding import PLAIN_TYPES, all_plain, local, same_objects

__all__ = ["SAMPLE_EVERY", "LoopWrites", "own_write"]

# Values written through .data are also looked for every this many steps (LoopWrites.values_due)
SAMPLE_EVERY = 16

# id(parameter) -> (the parameter, its version counter right after the monitor's last write to it);
# by id with a weak reference (a tensor's == is elementwise: no WeakKeyDictionary), a few entries
# (the tensors QK-Clip scales)
_OWN: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int]]] = {}


def _mark(p: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, version counters) of a parameter. FSDP2: its local shard's address, and
    both counters: an in-place op on the DTensor moves the DTensor's own (the op runs on the shard
    below autograd, whose counter stays), a write through ``to_local()`` moves the shard's."""
    if type(p) in PLAIN_TYPES:  # (every parameter at every step's end: no DTensor lookup)
        return p.data_ptr(), p._version, 0
    t = local(p)
    return t.data_ptr(), t._version, p._version if t is not p else 0


_VERSION = operator.attrgetter("_version")


def own_write(params: Sequence[torch.Tensor]) -> None:
    """The monitor just wrote ``params`` in place (between two steps): not the loop's change."""
    for p in params:
        _OWN[id(p)] = weakref.ref(p), _mark(p)[1:]
    for key in [k for k, (ref, _) in _OWN.items() if ref() is None]:
        del _OWN[key]


def _own_version(p: torch.Tensor) -> tuple[int, int] | None:
    held = _OWN.get(id(p))
    return held[1] if held is not None and held[0]() is p else None


class LoopWrites:
    """Which parameters the loop changed since the last step ended; which buffers, and which
    values through ``.data``, where a jump asks (see the module's docstring)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int, int]] = {}  # id(parameter) -> its mark as the step left it
        # Plain parameters (no DTensor): the list as the step left it, with their addresses and
        # version counters, from which `_seen` is built only where something changed (the usual
        # step compares two lists of ints: no Python call per parameter)
        self._plain: tuple[list[torch.Tensor], list[int], list[int]] | None = None
        # per module: its name and its buffers dict (walked at each close), the buffers it held
        # then (names and tensors), and the last step whose close found them changed
        self._modules: list[tuple[str, dict[str, Any]]] = []
        self._held: list[tuple[tuple[str, Any], ...]] = []
        self._moved_at: list[int | None] = []
        # the last step's update as measured: (its step, per-tensor norms, and without the undo
        # copy the tensors it measured with their norms as it left them), or None
        self._moved: tuple[int, torch.Tensor, tuple[list[torch.Tensor], torch.Tensor] | None] | None = None
        self._values_at: int | None = None  # the last step a value written through .data was found

    def watch(self, modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
        """The model's modules (name, module) whose buffers ``close`` keeps."""
        self._modules = [(name, m._buffers) for name, m in modules]
        self._held = [tuple(d.items()) for _, d in self._modules]
        self._moved_at = [None] * len(self._modules)

    def close(self, params: Sequence[torch.Tensor], step: int = -1) -> None:
        """The step ``step`` ended: remember every parameter, and every buffer slot, as it is now."""
        if all_plain(params):
            self._plain = (list(params), list(map(torch.Tensor.data_ptr, params)), list(map(_VERSION, params)))
            self._seen = {}
        else:
            self._plain, self._seen = None, {id(p): _mark(p) for p in params}
        held, moved_at = self._held, self._moved_at
        for k, (_, d) in enumerate(self._modules):
            if d or held[k]:
                now = tuple(d.items())
                if not _same(now, held[k]):
                    held[k], moved_at[k] = now, step

    def changed(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Indices into ``params`` of those written or replaced since ``close`` by anything but the
        monitor (none before the first ``close``; a parameter new since then is not counted)."""
        if self._plain is not None:
            held, ptrs, versions = self._plain
            if (
                same_objects(params, held)
                and all(map(operator.eq, map(_VERSION, params), versions))
                and all(map(operator.eq, map(torch.Tensor.data_ptr, params), ptrs))
            ):
                return []  # (the usual step: nothing written)
            if not self._seen:  # (the marks of plain parameters, as _mark makes them)
                self._seen = dict(zip(map(id, held), zip(ptrs, versions, repeat(0))))
        seen, out = self._seen, list[int]()
        if not seen:
            return out
        for i, p in enumerate(params):
            before = seen.get(id(p))
            if before is None:
                continue
            now = _mark(p)
            if now != before and not (now[0] == before[0] and _own_version(p) == now[1:]):
                out.append(i)
        return out

    def buffers_changed(self, step: int, habit: int) -> list[str]:
        """The buffer slots added, removed or given another tensor since the last ``close``
        ("layer.weight_mask (added)"), but those of a module whose buffers changed at the end of one
        of the ``habit`` steps before ``step``."""
        out: list[str] = []
        for k, (name, d) in enumerate(self._modules):
            held = self._held[k]
            if not (d or held):
                continue
            now = tuple(d.items())
            if _same(now, held):
                continue
            last = self._moved_at[k]
            if last is not None and step - last <= habit:
                continue
            before = dict(held)
            for n, b in now:
                if n not in before:
                    out.append(f"{name + '.' if name else ''}{n} (added)")
                elif before[n] is not b:
                    out.append(f"{name + '.' if name else ''}{n} (replaced)")
            out += [f"{name + '.' if name else ''}{n} (removed)" for n in before if n not in d]
        return out

    def keep_moved(
        self, step: int, norms: torch.Tensor | None, slices: tuple[list[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """Step ``step``'s update as measured from the undo copy (per-tensor ``||after - before||``,
        in the order of the parameters), or None where it was not. ``slices``: where it was
        measured on slices of the parameters (the lean profile), those views and their norms as the
        update left them."""
        self._moved = (step, norms, slices) if norms is not None else None

    def moved(self, step: int) -> torch.Tensor | None:
        """The norms ``keep_moved`` kept for ``step``, or None."""
        kept = self._moved
        return kept[1] if kept is not None and kept[0] == step else None

    def slices(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """The tensors ``keep_moved`` kept for ``step`` and their norms then, or None."""
        kept = self._moved
        return kept[2] if kept is not None and kept[0] == step else None

    def values_due(self, step: int) -> bool:
        """Whether step ``step`` samples the values written through ``.data`` without a jump
        asking: at the step after one was found (is it the loop's habit?), and every
        ``SAMPLE_EVERY`` steps."""
        return step % SAMPLE_EVERY == 0 or (self._values_at is not None and step - self._values_at == 1)

    def values_found(self, step: int, habit: int) -> bool:
        """A value written through ``.data`` was found at ``step``: whether it is news (no other
        found within ``habit`` steps before it)."""
        last, self._values_at = self._values_at, step
        return last is None or step - last > habit

    def own(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Indices into ``params`` of those the monitor wrote last (QK-Clip between the steps)."""
        return [i for i, p in enumerate(params) if id(p) in _OWN and _own_version(p) == _mark(p)[1:]]


def _same(a: tuple[tuple[str, Any], ...], b: tuple[tuple[str, Any], ...]) -> bool:
    """Whether two buffer dicts' items hold the same names and the same tensors (by identity)."""
    return len(a) == len(b) and all(x[0] == y[0] and x[1] is y[1] for x, y in zip(a, b))
