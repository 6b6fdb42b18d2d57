"""Exact one-step undo: the state just before the last update, kept in one reused copy.

A bad update that lands (an update-ratio spike, a loss jump on the next step, a non-finite weight)
is best answered by going back exactly one step, not to a snapshot taken tens of steps earlier:
at most one step is lost. That needs the state before the update: the parameters and the
optimizer's state. ``UndoState`` holds one copy of both (for AdamW: 3x the parameter bytes), made
once and overwritten every step (no allocation after the first), and nothing that grows with time.
Its parameter copy also measures the update ratio ``||theta_after - theta_before|| / ||theta_before||``,
so the monitor holds no other copy of the parameters.

A wrapper optimizer's inner optimizers (an attribute that is an optimizer: SAM's
``base_optimizer``, Lookahead's ``optimizer``) keep their state in their own ``state``: the copy
holds it too (``state_owners``).

Under FSDP2 each rank copies its own local shards (``to_local()``): an undo on every rank
restores the whole model. The user's param-group settings (LR, weight decay) are not put back:
an undo never turns the user's schedule back. The entries of a param group that the optimizer's
own step writes (state it keeps there: schedule-free AdamW's step count, ``weight_sum`` and
``lr_max``; ``written_entries``) are, as the capture found them.
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from .checkpoint import inner_optimizers, params_of
from .sharding import all_plain, is_sharded, local, same_objects
from .stats import NORMS_AT_ONCE, norms

__all__ = ["Arena", "Scratch", "UndoState", "group_entries", "put_entries", "state_owners", "written_entries"]


def state_owners(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The ``state`` dicts an optimizer's step changes: its own, and those of the optimizers it
    wraps (``checkpoint.inner_optimizers``: SAM's ``base_optimizer``, Lookahead's ``optimizer``,
    whose momentum lives there), each once."""
    owners: list[Any] = [optimizer.state]
    for inner in inner_optimizers(optimizer):
        if all(inner.state is not o for o in owners):
            owners.append(inner.state)
    return owners


def _param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param-group dicts of ``optimizer`` and of the optimizers it wraps, each list once."""
    lists = [optimizer.param_groups]
    for inner in inner_optimizers(optimizer):
        if all(inner.param_groups is not held for held in lists):
            lists.append(inner.param_groups)
    return [group for groups in lists for group in groups]


_ABSENT = object()

# Each param group's keys and values (the values themselves, not copies), in its dict's order
GroupEntry = tuple[tuple[Any, ...], tuple[Any, ...]]
GroupEntries = list[GroupEntry]


def group_entries(optimizer: torch.optim.Optimizer) -> GroupEntries:
    """Each param group's keys and values as they are now: of ``optimizer`` and of the optimizers
    it wraps. The values are held, not copied (with ``written_entries``, ~20 microseconds a step
    for an optimizer with two groups, ~100 for fifty)."""
    return [(tuple(g), tuple(g.values())) for g in _param_groups(optimizer)]


def written_entries(before: GroupEntries, optimizer: torch.optim.Optimizer) -> set[tuple[int, str]]:
    """(position, key) of the param-group entries that hold another value than in ``before``
    (``group_entries``; the position in its list), added and removed ones too: taken around
    ``optimizer.step()``, the state an optimizer keeps in its groups and advances in its step
    (schedule-free AdamW's ``k``, ``weight_sum`` and ``lr_max``, Prodigy's ``d``), with or without
    gradients; and what a wrapper's step copies into the groups of the optimizer it wraps
    (ZeroRedundancyOptimizer: the user's LR, into its shard's optimizer), which is the wrapper's
    own and never the user's. By identity: an entry given a new object counts (an equal value
    too: putting it back changes nothing), a container changed in place does not. Nothing where
    groups were added or removed."""
    now = _param_groups(optimizer)
    if len(now) != len(before):
        return set()
    out: set[tuple[int, str]] = set()
    for i, (g, (keys, values)) in enumerate(zip(now, before)):
        current = tuple(g.values())
        if same_objects(current, values):
            continue  # (the usual step: nothing written)
        held = dict(zip(keys, values))
        out.update(
            (i, k) for k in g.keys() | held.keys() if k != "params" and g.get(k, _ABSENT) is not held.get(k, _ABSENT)
        )
    return out


def put_entries(optimizer: torch.optim.Optimizer, before: GroupEntries, keys: Collection[tuple[int, str]]) -> None:
    """Put the param-group entries ``keys`` ((position, key): ``written_entries``) back as
    ``before`` (``group_entries``) holds them (one it does not hold is removed); the others stay
    as they are (the user's LR schedule)."""
    now = _param_groups(optimizer)
    if not keys or len(now) != len(before):
        return
    held = [dict(zip(*entries)) for entries in before]
    for i, k in keys:
        if i < len(now):
            if k in held[i]:
                now[i][k] = held[i][k]
            else:
                now[i].pop(k, None)


class Arena:
    """Copies of many tensors kept back to back, one flat buffer per (dtype, device): a copy into
    it is one ``torch.cat`` per buffer, not one copy per tensor. On a GPU a per-tensor copy is a
    kernel launch each (AdamW on a 150M-parameter transformer: ~580 a step), made while the GPU
    waits for the step's decision; the CPU does the same memory traffic either way.

    ``copy_from(live)`` copies ``live`` in and returns the copies: views of the buffers, in the
    order and with the shapes and strides of ``live``; the same buffers and the same list while
    ``live`` keeps its layout, new ones when it does not. The flat views of the live tensors that
    ``torch.cat`` reads are built once and kept while the tensors' storages stay where they were
    (building one per tensor every step costs more CPU time than the launches it saves)."""

    def __init__(self) -> None:
        self.layout: tuple[Any, ...] | None = None
        self.views: list[torch.Tensor] = []
        self._flat: list[tuple[torch.Tensor, list[int]]] = []  # (buffer, indices of the tensors in it)
        self._key: tuple[Any, ...] | None = None  # layout and addresses when _sources was built
        self._sources: list[list[torch.Tensor]] = []  # per buffer, the flat views it copies

    def copy_from(self, live: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self._same_key(live):
            # per tensor: where it is, what it is, how it is laid out
            key = (list(map(_DATA_PTR, live)), list(map(_KIND_SHAPE, live)), list(map(_STRIDE, live)))
            layout = key[1:]
            if layout != self.layout:
                self._allocate(live)
                self.layout = layout
            self._sources = [[_flatten(live[i]) for i in idx] for _, idx in self._flat]
            # a kept view keeps its storage alive, so a new storage never reuses its address; a
            # tensor that is not dense is read through a copy, which must be made every time
            self._key = key if all(_dense(t) for t in live) else None
        for (flat, _), sources in zip(self._flat, self._sources):
            torch.cat(sources, out=flat)
        return self.views

    def _same_key(self, live: Sequence[torch.Tensor]) -> bool:
        """Whether ``live`` has the key the sources were built for, compared tensor by tensor as it
        is read: no list of a tuple per tensor is built (thousands of tuples alive at once, every
        step, made Python's garbage collector run several times a step, and the survivors its
        full collections: on a model of 1,160 parameters, 19 ms a step)."""
        key = self._key
        return (
            key is not None
            and len(live) == len(key[0])
            and all(map(operator.eq, map(_DATA_PTR, live), key[0]))
            and all(map(operator.eq, map(_KIND_SHAPE, live), key[1]))
            and all(map(operator.eq, map(_STRIDE, live), key[2]))
        )

    def _allocate(self, live: Sequence[torch.Tensor]) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(live):
            groups.setdefault((t.dtype, t.device), []).append(i)
        views: list[torch.Tensor] = [torch.empty(0)] * len(live)
        self._flat = []
        for (dtype, device), idx in groups.items():
            flat = torch.empty(sum(live[i].numel() for i in idx), dtype=dtype, device=device)
            offset = 0
            for i in idx:
                t, n = live[i], live[i].numel()
                # a dense tensor's copy has its strides (channels_last stays channels_last): an
                # undo's copy back and the update ratio's subtraction read both alike
                views[i] = (
                    flat.as_strided(t.shape, t.stride(), flat.storage_offset() + offset)
                    if _dense(t)
                    else flat[offset : offset + n].view(t.shape)
                )
                offset += n
            self._flat.append((flat, idx))
        self.views = views


_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_KIND_SHAPE = operator.attrgetter("dtype", "device", "shape")


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of its storage with no gaps (contiguous in some
    dimension order: contiguous, channels_last, a transpose), so it reads as one flat run."""
    if t.layout != torch.strided:
        return False
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    expected = 1
    for d in reversed(order):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _flatten(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in storage order, as a 1-d view when it is dense (else a copy, in its
    logical order, which is how ``fit`` lays such a tensor's copy out)."""
    if _dense(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset())
    return t.reshape(-1)


def running_statistics(model: torch.nn.Module) -> list[torch.Tensor]:
    """The running statistics of the model's normalisation layers (BatchNorm, SyncBatchNorm,
    InstanceNorm with ``track_running_stats``): the buffers a training forward writes from its
    batch. What the lean profile's copy holds, so that a skip puts them back without an undo copy;
    a few floats per channel."""
    return [b for _, b in running_statistics_by_layer(model)]


def running_statistics_by_layer(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """``running_statistics``, each with the layer it belongs to."""
    found: list[tuple[torch.nn.Module, torch.Tensor]] = []
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for b in (m.running_mean, m.running_var, m.num_batches_tracked):
                if isinstance(b, torch.Tensor) and not isinstance(b, torch.nn.parameter.UninitializedBuffer):
                    found.append((m, b))
    return found


def buffer_slots(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Where each of the model's buffers lives, (module, name), in ``model.buffers()``'s order
    (a buffer shared by two modules once): looked up again each step, a forward that assigns a new
    tensor to a buffer (DINO's ``self.center = ...``) is followed."""
    seen: set[int] = set()
    slots = []
    for m in model.modules():
        for name, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                slots.append((m, name))
    return slots


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (a DTensor's: its local shard's), which each in-place write moves."""
    return (t if type(t) is torch.Tensor else local(t))._version


def _fitted(held: list[torch.Tensor], live: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``held`` when it can take a copy of ``live`` (the same count, shapes and dtypes: reused, no
    allocation), else new empty buffers for it."""
    if len(held) == len(live) and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(held, live)):
        return held
    return [torch.empty_like(t) for t in live]


@dataclass
class _Walk:
    """What ``UndoState.capture``'s walk of the optimizer state found: each parameter's state dict
    (None: no state), their values and keys, as they were; the tensors to copy, where each copy is kept
    (the dict of ``UndoState._state`` and its key) and the copies last kept there."""

    states: list[Any]
    values: list[Any]
    keys: list[Any]
    live: list[torch.Tensor]
    slots: list[tuple[dict[str, Any], str]]
    copies: list[torch.Tensor] | None


class UndoState:
    """The parameters and optimizer state as they were before the update of step ``label``."""

    def __init__(self) -> None:
        self.label: int | None = None
        self.params: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []  # the model's buffers (BatchNorm statistics...)
        # The buffers of the capture before (label - 1): as they were before step `label`'s forward.
        # An undo of that step's update puts these back, so its batch leaves no trace in them.
        self.prev_buffers: list[torch.Tensor] = []
        self.prev_label: int | None = None
        # A forward between the steps (outside them: a GAN's generator loss through the
        # discriminator, an evaluation in training mode) writes the buffers after the capture and
        # before the next step's forward; a skip of that step must keep what it wrote. The buffers
        # as the capture saw them (the tensors, and their version counters, which every in-place
        # write moves), and, from the next step's first forward (mark_forward), a copy of those
        # written since then, by position: what a skip of that step puts back over the capture's.
        # `prev_changed`: the same for the capture before (an undo's "before the forward").
        self.seen: list[torch.Tensor] = []
        self.seen_versions: list[int] = []
        self.changed: dict[int, torch.Tensor] = {}
        self.prev_changed: dict[int, torch.Tensor] = {}
        self._spare: dict[int, torch.Tensor] = {}  # copies to reuse (no allocation every step)
        # A GradScaler's scale and growth tracker at the capture: after an undo the scaler is put
        # back too (its next update would otherwise count the undone step's overflow).
        self.scaler_state: list[torch.Tensor] = []
        # The tracked tensors (Monitor.track) at the capture: an undo puts them back from the same
        # capture as the parameters (the loop updates an EMA after the step, not in its forward).
        self.tracked: list[torch.Tensor] = []
        # per state owner (state_owners: the optimizer's, then those it wraps), per parameter:
        # key -> buffer or value; None: no state
        self._state: list[list[dict[str, Any] | None]] = []
        # the parameters' copies and the optimizer state's, each kept back to back (one fused
        # copy each); two arenas, so that the parameters' is not made again when the state appears
        self._param_arena = Arena()
        self._state_arena = Arena()
        self._walk: _Walk | None = None  # the last capture's walk of the optimizer state
        # Which state dicts the capture copied (ids, not references: they may be dropped): the
        # loop's own optimizer.load_state_dict() gives the optimizer a new one (a resume).
        self.owner_ids: list[int] = []
        # The param groups' entries at the capture (group_entries): an undo puts back those the
        # optimizer's step writes (its own counters), never the user's settings.
        self.groups: GroupEntries = []

    @property
    def nbytes(self) -> int:
        tensors = (
            self.params
            + self.buffers
            + self.prev_buffers
            + [*self.changed.values(), *self.prev_changed.values()]
            + self.tracked
            + [v for owner in self._state for st in owner if st for v in st.values() if isinstance(v, torch.Tensor)]
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def capture(
        self,
        label: int,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        buffers: Sequence[torch.Tensor] = (),
        scaler: Any = None,
        tracked: Sequence[torch.Tensor] = (),
        groups: Sequence[GroupEntry] = (),
    ) -> None:
        """Copy the parameters, their optimizer state, the model's buffers, a GradScaler's
        scale and growth tracker and the ``tracked`` tensors (``Monitor.track``: an EMA of the
        weights, which the loop updates after each step) in one fused copy; hold ``groups`` (the
        param groups' entries, ``group_entries``), which ``restore`` puts back in part.
        Taken after the step's forward: the buffers hold the running statistics up to this step's
        batch, which a later skip of the next step puts back."""
        live_buffers = [local(b) for b in buffers]
        # two sets of buffers, alternating: this capture's, and the one before (reused, no allocation)
        self.buffers, self.prev_buffers, self.prev_label = self.prev_buffers, self.buffers, self.label
        self._spare, self.prev_changed, self.changed = self.prev_changed, self.changed, {}
        self.buffers = _fitted(self.buffers, live_buffers)
        if len(self.prev_buffers) != len(self.buffers):
            self.prev_label = None
        # (under no_grad: plain parameters as they are, no new tensor object per parameter a step)
        live = list(params) if all_plain(params) else [local(p.detach()) for p in params]
        owners = state_owners(optimizer)
        held = self._param_arena.copy_from(live)
        if held is not self.params:  # new copies: the parameters' layout changed
            self._state, self._walk = [], None
        self.params = held
        if len(self._state) != len(owners):
            self._state, self._walk = [[None] * len(live) for _ in owners], None
        # Each parameter's state dict, and the values in them, in order: while they are the same
        # objects as at the last capture (the usual step: an optimizer updates its state tensors
        # in place), the walk below would find the same tensors to copy and the same places to
        # keep the copies in, so the last one is reused (built again when anything differs: state
        # created or dropped, a tensor replaced, load_state_dict()).
        states = [st for owner in owners for st in map(owner.get, params)]
        present = list(filter(None, states))
        values = list(chain.from_iterable(map(dict.values, present)))
        keys = list(chain.from_iterable(present))
        walk = self._walk
        if (
            walk is not None
            and same_objects(states, walk.states)
            and same_objects(values, walk.values)
            and keys == walk.keys
        ):
            live_state, slots = walk.live, walk.slots
        else:
            live_state, slots, plain = [], [], False
            for owner, kept in zip(owners, self._state):
                for i, p in enumerate(params):
                    state = owner.get(p)
                    if not state:
                        kept[i] = None  # no state yet: an undo removes what the update created
                        continue
                    saved: dict[str, Any] = kept[i] or {}
                    for key in [k for k in saved if k not in state]:  # (an entry the state no longer has)
                        del saved[key]
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            live_state.append(local(value))
                            slots.append((saved, key))
                        else:
                            saved[key] = copy.deepcopy(value)
                            plain = True
                    kept[i] = saved
            # (a value that is no tensor is copied at every capture: no walk is kept; nor for
            # DTensors, whose local shard is looked up at every capture)
            sharded = any(v is not t for v, t in zip(values, live_state))
            self._walk = None if plain or sharded else _Walk(states, values, keys, live_state, slots, None)
        copies = self._state_arena.copy_from(live_state)
        if self._walk is None or copies is not self._walk.copies:  # (new copies: kept where they belong)
            for (saved, key), copied in zip(slots, copies):
                saved[key] = copied
            if self._walk is not None:
                self._walk.copies = copies
        dst, src = list(self.buffers), list(live_buffers)
        live_scaler = (
            []
            if scaler is None or getattr(scaler, "_scale", None) is None
            else [
                scaler._scale,
                scaler._growth_tracker,
            ]
        )
        self.scaler_state = _fitted(self.scaler_state, live_scaler)
        dst += self.scaler_state
        src += live_scaler
        live_tracked = [local(t.detach()) for t in tracked]
        self.tracked = _fitted(self.tracked, live_tracked)
        dst += self.tracked
        src += live_tracked
        if dst:
            torch._foreach_copy_(dst, src)
        self._note(buffers)
        self.label = label
        self.owner_ids = [id(o) for o in owners]
        self.groups = list(groups)

    def _note(self, buffers: Sequence[torch.Tensor]) -> None:
        """The buffers as the copy holds them now: which tensors, at which versions."""
        self.seen = list(buffers)
        self.seen_versions = [_version(b) for b in buffers]

    @torch.no_grad()
    def mark_forward(self, buffers: Sequence[torch.Tensor], owners: Sequence[int]) -> int:
        """At the first forward of the step after the capture: copy the buffers written since the
        capture (a forward between the steps), so that a skip of this step puts them back as they
        are now, not as the capture saw them. A buffer counts as written when its version counter
        moved or another tensor took its place (``self.center = ...``); and with it every buffer
        of the same module (``owners``: one key per module): BatchNorm writes its running mean and
        variance in a kernel that moves no version counter, and its ``num_batches_tracked`` with
        an in-place add that does. Nothing is copied when nothing was written (a loop without
        forwards between its steps). Called again (a later forward turned out to be the step's
        first), it starts over. Returns how many buffers it copied."""
        self._spare.update(self.changed)
        self.changed = {}
        if not self.buffers or len(buffers) != len(self.seen) or len(buffers) != len(self.buffers):
            return 0
        moved = {
            o for b, s, v, o in zip(buffers, self.seen, self.seen_versions, owners) if b is not s or _version(b) != v
        }
        if not moved:
            return 0
        idx = [i for i, o in enumerate(owners) if o in moved]
        live = [local(buffers[i]) for i in idx]
        for i, t in zip(idx, live):
            kept = self._spare.pop(i, None)
            fits = kept is not None and (kept.shape, kept.dtype, kept.device) == (t.shape, t.dtype, t.device)
            self.changed[i] = kept if fits and kept is not None else torch.empty_like(t)
        torch._foreach_copy_([self.changed[i] for i in idx], live)
        return len(idx)

    def loaded_since(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer's state was replaced since the capture (``load_state_dict``: the
        loop resumed from a checkpoint), so the copy belongs to a timeline the loop left."""
        return bool(self.owner_ids) and [id(o) for o in state_owners(optimizer)] != self.owner_ids

    @torch.no_grad()
    def start(self, label: int, buffers: Sequence[torch.Tensor]) -> None:
        """Before the first capture (of a run, or after a resume): the model's buffers as they are
        now, before the next step's forward, labelled as a capture of the step before it. A skip
        of that next step puts them back (a NaN batch at the first step leaves no NaN running
        statistics), and an undo of its update restores them as the buffers before its forward.
        No parameters are held: no undo can target this label."""
        self.clear()
        self.buffers = [local(b).clone() for b in buffers]
        self._note(buffers)
        self.label = label

    @torch.no_grad()
    def refresh_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """The buffers as they are now, in place of the capture's (a forward ran after it: an
        optimizer's closure inside its step)."""
        if self.buffers and len(self.buffers) == len(buffers):
            torch._foreach_copy_(self.buffers, [local(b) for b in buffers])
            self._spare.update(self.changed)
            self.changed = {}
            self._note(buffers)

    def buffers_before_forward(self) -> list[torch.Tensor]:
        """The copies of the model's buffers as they were just before the step after the capture
        ran its first forward (``restore_buffers``), by position."""
        return [self.changed.get(i, b) for i, b in enumerate(self.buffers)]

    @torch.no_grad()
    def restore_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Put the model's buffers back as they were just before the step after the capture ran
        its first forward: as the capture saw them, but for those a forward between the steps
        wrote (``mark_forward``), which keep what it wrote (a skipped step's forward moved
        BatchNorm's running statistics; a NaN batch made them NaN)."""
        if self.buffers and len(self.buffers) == len(buffers):
            torch._foreach_copy_([local(b) for b in buffers], self.buffers_before_forward())
            if not self.changed:  # as the capture holds them: no write since (none to copy at a forward)
                self._note(buffers)

    @torch.no_grad()
    def restore(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        buffers: Sequence[torch.Tensor] = (),
        before_forward: bool = False,
        tracked: Sequence[torch.Tensor] = (),
        group_keys: Collection[tuple[int, str]] = (),
    ) -> None:
        """Put the copy back: parameters, optimizer state, buffers and tracked tensors
        bit-identical to the capture, and the param groups' ``group_keys`` (those the optimizer's
        step writes: ``written_entries``) as the capture found them.
        ``before_forward``: the buffers as they were just before the captured step's first forward
        (when the capture before it is held: with what a forward between the two steps wrote), so
        the undone step's batch is as if never seen."""
        # Only what this optimizer updates goes back: a parameter another optimizer steps (a
        # second optimizer over part of the same model, with its own monitor) keeps its value.
        mine = {id(p) for opt in [optimizer, *inner_optimizers(optimizer)] for p in params_of(opt)}
        owners = state_owners(optimizer)
        for owner, kept in zip(owners, self._state):  # (before anything is written: nothing half put back)
            for p, saved in zip(params, kept):
                state = (owner.get(p) or {}) if saved and id(p) in mine else {}
                gone = [k for k, v in (saved or {}).items() if isinstance(v, torch.Tensor) and k not in state]
                if gone and is_sharded(p):
                    raise RuntimeError(
                        f"the optimizer step being undone removed the state entries {gone} of a sharded "
                        "parameter: their DTensors cannot be made again from this rank's copies"
                    )
        if before_forward and self.label is not None and self.prev_label == self.label - 1 and buffers:
            src = [self.prev_changed.get(i, b) for i, b in enumerate(self.prev_buffers)]
            torch._foreach_copy_([local(b) for b in buffers], src)
        else:
            self.restore_buffers(buffers)
        held = [i for i, p in enumerate(params) if id(p) in mine]
        dst = [local(params[i].detach()) for i in held]
        src = [self.params[i] for i in held]
        for owner, kept in zip(owners, self._state):
            for p, saved in zip(params, kept):
                if id(p) not in mine:
                    continue
                if saved is None:
                    owner.pop(p, None)
                    continue
                state = owner[p]
                for key in [k for k in state if k not in saved]:  # an entry the undone step created
                    del state[key]
                for key, value in saved.items():
                    if not isinstance(value, torch.Tensor):
                        state[key] = copy.deepcopy(value)
                    elif key not in state:  # an entry the undone step removed (or moved to another key)
                        state[key] = value.clone()
                    else:
                        dst.append(local(state[key]))
                        src.append(value)
        if self.tracked and len(self.tracked) == len(tracked):
            dst += [local(t.detach()) for t in tracked]
            src += self.tracked
        torch._foreach_copy_(dst, src)
        put_entries(optimizer, self.groups, group_keys)

    def clear(self) -> None:
        self.label, self.params, self.buffers, self._state = None, [], [], []
        self._param_arena, self._state_arena, self._walk = Arena(), Arena(), None
        self.prev_label, self.prev_buffers, self.scaler_state = None, [], []
        self.owner_ids, self.tracked, self.groups = [], [], []
        self.seen, self.seen_versions, self.changed, self.prev_changed, self._spare = [], [], {}, {}, {}


# The most the update-ratio measurement holds at once on the CPU: 256K elements (1 MiB in float32),
# about a core's L2 cache, so each chunk's norm reads back the differences just written from the
# cache rather than from memory. At 4M elements (before the thirtieth session) the scratch held up
# to one more copy of a small model's parameters, and on the 2.63M-parameter overhead model
# (docs/benchmarks.md) the measurement took 2.15 ms a step against 1.74 ms now.
SCRATCH_ELEMENTS = 1 << 18


@dataclass
class _Chunk:
    """Tensors measured together: their positions; on the CPU the views of the scratch buffer
    their differences are written into (None: fused, from the allocator); ``piece``: one tensor
    larger than the buffer, measured piece by piece through ``buf``."""

    positions: list[int]
    views: list[torch.Tensor] | None
    piece: bool = False
    buf: torch.Tensor | None = None


class Scratch:
    """What ``update_norms`` reuses from one step to the next: a buffer per (dtype, device) for the
    differences on the CPU, and the plan of the last call (which tensors go in which chunk, the
    views of the buffer each difference is written into), kept while the tensors measured are the
    same objects (the undo copy's: the same tensors every step while the parameters keep their
    layout). Building the views and the chunks every step cost ~7 us a tensor, more than the
    subtraction of a small tensor (a 12-layer model's 147 parameters: ~1 ms a step)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._held: list[weakref.ref[torch.Tensor]] = []  # the tensors the plan is for
        self._key: tuple[int, bool | None] | None = None  # and its limit and fused
        self._plan: list[_Chunk] = []

    def plan(self, before: Sequence[torch.Tensor], limit: int, fused: bool | None) -> list[_Chunk]:
        """The chunks ``before`` is measured in: the last plan while ``before`` holds the same
        tensors (then their shapes and kinds are the same too), else a new one."""
        if self._key == (limit, fused) and same_objects(list(map(_CALL, self._held)), before):
            return self._plan
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, t in enumerate(before):
            by_kind.setdefault((t.dtype, t.device), []).append(i)
        plan: list[_Chunk] = []
        for kind, idx in by_kind.items():
            buf: torch.Tensor | None = None  # the scratch (CPU); None: fused, from the allocator (GPU)
            if not (fused if fused is not None else kind[1].type != "cpu"):
                size = max(1, min(limit, sum(before[i].numel() for i in idx)))
                buf = self.buffers.get(kind)
                if buf is None or buf.numel() < size:
                    buf = self.buffers[kind] = torch.empty(size, dtype=kind[0], device=kind[1])
            room = buf.numel() if buf is not None else limit
            for chunk in _chunks([before[i].numel() for i in idx], room):
                js = [idx[c] for c in chunk]
                if len(js) == 1 and before[js[0]].numel() > room:  # larger than a chunk: piece by piece
                    plan.append(_Chunk(js, None, piece=True, buf=buf))
                    continue
                if buf is None:  # (fused: its differences are new tensors, a few hundred at a time)
                    plan += [_Chunk(js[k : k + NORMS_AT_ONCE], None) for k in range(0, len(js), NORMS_AT_ONCE)]
                    continue
                views, offset = [], 0
                for j in js:
                    n = before[j].numel()
                    views.append(buf[offset : offset + n].view(before[j].shape))
                    offset += n
                plan.append(_Chunk(js, views))
        self._held, self._key, self._plan = [weakref.ref(t) for t in before], (limit, fused), plan
        return plan


_CALL = operator.methodcaller("__call__")


def update_norms(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    scratch: Scratch | None = None,
    limit: int = SCRATCH_ELEMENTS,
    fused: bool | None = None,
) -> torch.Tensor:
    """Per-tensor ``||after - before||`` as one fp32 vector, leaving ``before`` intact (it is the
    undo copy), in chunks of at most ``limit`` elements per dtype.

    On the CPU (``fused`` False, the default there) the differences go through a reused scratch
    buffer (``scratch`` keeps it, and its views, between calls: no allocation, no page faults after
    the first step): each difference written there in one pass (``torch.sub(..., out=)``: a third
    less memory traffic than a copy then a subtraction), then one fused norm per chunk. On a GPU
    (``fused`` True, the default there) memory traffic is cheap and kernel launches are not:
    per chunk one ``torch._foreach_sub`` (its differences come from the caching allocator and go
    back to it, at most ``limit`` elements at a time) and one fused norm, instead of a launch per
    tensor."""
    plan = (Scratch() if scratch is None else scratch).plan(before, limit, fused)
    if not plan:
        return torch.zeros(0)
    parts: list[torch.Tensor] = []  # per chunk, the norms of its tensors
    for chunk in plan:
        js = chunk.positions
        if chunk.piece:
            i, room, buf = js[0], chunk.buf.numel() if chunk.buf is not None else limit, chunk.buf
            a, b, sq = after[i].reshape(-1), before[i].reshape(-1), None
            for k in range(0, a.numel(), room):  # (at least one piece: the tensor is larger than the room)
                end = min(a.numel(), k + room)
                piece = torch.sub(a[k:end], b[k:end], out=buf[: end - k] if buf is not None else None)
                part = norms([piece])[0].square()
                sq = part if sq is None else sq + part
            parts.append(sq.sqrt().reshape(1) if sq is not None else torch.zeros(1))
        elif chunk.views is None:
            parts.append(norms(torch._foreach_sub([after[j] for j in js], [before[j] for j in js])))
        else:  # one pass: read both, write the difference
            parts.append(norms([torch.sub(after[j], before[j], out=v) for j, v in zip(js, chunk.views)]))
    if len(parts) == 1:  # (the usual case: one chunk of every tensor, in order)
        return parts[0]
    flat = torch.cat(parts)  # float64 when any chunk is (cat promotes)
    order = [j for chunk in plan for j in chunk.positions]
    if order == list(range(len(before))):
        return flat
    return torch.empty_like(flat).index_copy_(0, torch.tensor(order, device=flat.device), flat)


def _chunks(sizes: Sequence[int], room: int) -> list[list[int]]:
    """Consecutive runs of positions whose sizes add up to at most ``room``; a size larger than
    ``room`` is a run of its own."""
    runs: list[list[int]] = []
    used = room + 1  # start a new run at the first position
    for k, n in enumerate(sizes):
        if used + n > room or n > room:
            runs.append([])
            used = 0
        runs[-1].append(k)
        used += n
    return runs
