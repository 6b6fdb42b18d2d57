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

Not seen: in-place writes through ``p.data`` (``p.data.clamp_(...)``), whose tensor keeps a version
counter of its own; and a new parameter the loop registers on the model (the optimizer still
holds the old one).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .sharding import local

__all__ = ["LoopWrites", "own_write"]

# id(parameter) -> (the parameter, its version counter right after the monitor's last write to it);
# by id with a weak reference (a tensor's == is elementwise: no WeakKeyDictionary), a few entries
# (the tensors QK-Clip scales)
_OWN: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, int]]] = {}


def _mark(p: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, version counters) of a parameter. FSDP2: its local shard's address, and
    both counters: an in-place op on the DTensor moves the DTensor's own (the op runs on the shard
    below autograd, whose counter stays), a write through ``to_local()`` moves the shard's."""
    t = local(p)
    return t.data_ptr(), t._version, p._version if t is not p else 0


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
    """Which parameters the loop changed since the last step ended."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, int, int]] = {}  # id(parameter) -> its mark as the step left it

    def close(self, params: Sequence[torch.Tensor]) -> None:
        """The step ended: remember every parameter as it is now."""
        self._seen = {id(p): _mark(p) for p in params}

    def changed(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Indices into ``params`` of those written or replaced since ``close`` by anything but the
        monitor (none before the first ``close``; a parameter new since then is not counted)."""
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
