"""Atomic checkpoints and in-memory snapshots of the last good training state.

- ``save_checkpoint(path, state)``: written to a temporary file in the same folder, flushed and
  fsync'ed, then ``os.replace``'d over ``path`` (atomic on POSIX and Windows), then the folder is
  fsync'ed. A crash at any moment leaves either the previous file or the new one, never a torn one.
  The file's mode follows the umask like ``open()``'s; the temporaries a killed write leaves
  (``.<name>.sfmonitor-<pid>-<hex>.tmp``) are removed by the next save in that folder.
- ``load_checkpoint(path)``: ``torch.load(weights_only=True)``; a file holding a pickled callable or
  any object that is not a tensor / number / string / container is refused with ``CheckpointError``.
- ``capture_state`` / ``restore_state``: CPU copies of model, optimizer, GradScaler and RNG states
  (torch, CUDA, numpy, python), made only of plain tensors, numbers, strings, dicts and lists, so
  they survive ``weights_only=True``.
- ``SnapshotRing``: keeps the last few in-memory snapshots, one every N optimizer steps (default 50,
  the upper bound the issue sets), for ``rollback``.

Snapshot labels: a snapshot labelled ``k`` holds the state after ``k`` optimizer steps, i.e. the
state the (0-based) step ``k`` starts from. Take it in the optimizer step post-hook of step
``k - 1`` with ``label=k``; ``latest_before(s)`` then returns a state that step ``s``'s update has
not touched.
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import re
import secrets
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError
from .sharding import LocalShard, is_sharded, rebuild

__all__ = [
    "DEFAULT_SNAPSHOT_EVERY",
    "DEFAULT_SNAPSHOT_KEEP",
    "CheckpointError",
    "SnapshotRing",
    "capture_state",
    "load_checkpoint",
    "remove_stale_temporaries",
    "restore_state",
    "save_checkpoint",
    "state_dict_needs_every_rank",
    "tree_nbytes",
]

DEFAULT_SNAPSHOT_EVERY = 50  # a rollback loses at most 50 steps
DEFAULT_SNAPSHOT_KEEP = 3  # three CPU copies of model + optimizer: affordable for small models

# Keys of a captured state.
MODEL, OPTIMIZER, SCALER, RNG, EXTRA = "model", "optimizer", "scaler", "rng", "extra"
# The state of the optimizers a wrapper optimizer steps (``inner_optimizers``), per inner optimizer
# {parameter position in its param_groups: state}: SAM's and Lookahead's momentum lives there.
INNER = "inner_optimizer_state"
TRACKED = "tracked"  # key in a state's extra: the state dicts of the modules Monitor.track() holds


# --------------------------------------------------------------------------------------------
# Atomic save / safe load
# --------------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; os.replace is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


TMP_TAG = "sfmonitor"  # temporary files: .<name>.sfmonitor-<pid>-<8 hex>.tmp, next to <name>
_TMP_RE = re.compile(r"\.(?P<name>.+)\.sfmonitor-(?P<pid>\d+)-[0-9a-f]{8}\.tmp")
_LEGACY_TMP_RE = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")  # tempfile.mkstemp's, before TMP_TAG
STALE_TMP_AGE_S = 3600.0  # a temporary file untouched this long belongs to no running write


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (POSIX); True when it cannot be told (other systems)."""
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate it on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files a killed ``save_checkpoint`` left in ``folder``; return them.

    Only plain files named as ``save_checkpoint`` names its temporaries are touched: those of a
    process that no longer runs (POSIX), and any of them (the ``tempfile.mkstemp`` names of
    earlier versions included) not modified for ``STALE_TMP_AGE_S`` seconds. Never anything else.
    """
    folder = Path(folder)
    removed: list[Path] = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        ours = _TMP_RE.fullmatch(entry.name)
        if ours is None and not _LEGACY_TMP_RE.fullmatch(entry.name):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            old = now - entry.stat(follow_symlinks=False).st_mtime >= STALE_TMP_AGE_S
            pid = int(ours["pid"]) if ours else None
            dead = pid is not None and pid != os.getpid() and not _pid_alive(pid)
            if old or dead:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # gone already, or not ours to remove: leave it
            continue
    return removed


def _open_temporary(path: Path) -> tuple[int, str]:
    """A new temporary file next to ``path``, created like ``open()`` creates files: its mode
    is 0o666 less the umask (``tempfile.mkstemp`` would make it 0o600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{TMP_TAG}-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name next to {str(path)!r}")


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (temp file in the same folder, fsync, os.replace).

    Returns the final path. The file's mode follows the umask, as ``open()`` does. The temporary
    file is removed if writing fails; those a killed write left behind in the folder are removed
    by the next save (``remove_stale_temporaries``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    fd, tmp = _open_temporary(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(dict(state), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``torch.load(weights_only=True)``; it must hold a dict.

    Raises ``CheckpointError`` naming the file for whatever is wrong with it: missing, a folder,
    torn, random bytes, a zip that is not a torch checkpoint, something else than a dict, or a
    pickled object that is not plain data (a callable, a class instance...: such a file could run
    code on load). No other exception escapes for a bad file.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} is not a file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"checkpoint {str(path)!r} refused: it holds a pickled object that is not a tensor, "
            f"number, string, list or dict, or is not a valid pickle, and sfmonitor loads "
            f"checkpoints with weights_only=True (loading it could run arbitrary code). "
            f"Details: {first}"
        ) from e
    except Exception as e:
        # UnicodeDecodeError, KeyError, EOFError, RuntimeError, MemoryError...): one typed error
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read (truncated, corrupt or not "
            f"a torch checkpoint): {type(e).__name__}: {first}"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a {type(state).__name__}, not the dict save_checkpoint writes"
        )
    return state


# --------------------------------------------------------------------------------------------
# Capture / restore
# --------------------------------------------------------------------------------------------


def copy_tree(value: Any, device: Any = None) -> Any:
    """A deep copy of a state tree (dicts, lists, tuples) whose tensors are detached clones, on
    ``device`` when given (snapshots: "cpu"), else where they are (restores never alias a snapshot).

    Sharded tensors (FSDP2 DTensors) are copied as this rank's local part (``sharding.LocalShard``:
    host memory per rank is its shards only); copying a ``LocalShard`` without ``device`` gives the
    DTensor back, on its own device (what a restore loads)."""
    if is_sharded(value):
        return LocalShard.of(value, device)
    if isinstance(value, LocalShard):
        return value.copy(device) if device is not None else value.dtensor(clone=True)
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True) if device is not None else value.detach().clone()
    if isinstance(value, Mapping):
        return {k: copy_tree(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_tree(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_tree(v, device) for v in value)
    return value


def capture_rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and python RNG states as tensors and plain values (weights_only safe)."""
    np_state = np.random.get_state()
    # The legacy form is a dict only for a bit generator other than MT19937, which numpy's global
    # RandomState never has (set_state refuses to swap it).
    assert isinstance(np_state, tuple), "numpy's global RandomState is not MT19937"
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(np_state[0]),
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng_state``; parts the state lacks are left alone."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state(
            (
                n["name"],
                n["keys"].numpy().astype(np.uint32),
                int(n["pos"]),
                int(n["has_gauss"]),
                float(n["cached_gaussian"]),
            )
        )
    if "python" in state:
        p = state["python"]
        random.setstate((int(p["version"]), tuple(int(x) for x in p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def inner_optimizers(optimizer: torch.optim.Optimizer, depth: int = 2) -> list[torch.optim.Optimizer]:
    """The optimizers a wrapper optimizer holds as attributes and steps (SAM's ``base_optimizer``,
    Lookahead's ``optimizer``), nested up to ``depth``, each once; not the optimizer itself. Their
    ``state`` is not in the wrapper's ``state_dict()``."""
    found: list[torch.optim.Optimizer] = []

    def add(opt: torch.optim.Optimizer, level: int) -> None:
        if level >= depth:
            return
        for value in vars(opt).values():
            fresh = value is not optimizer and all(value is not o for o in found)
            if isinstance(value, torch.optim.Optimizer) and fresh:
                found.append(value)
                add(value, level + 1)

    add(optimizer, 0)
    return found


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_dict_needs_every_rank(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.state_dict()`` is refused until every rank took part in a collective:
    ZeroRedundancyOptimizer's, until each rank called ``consolidate_state_dict``. One rank cannot
    ask for it alone (a snapshot, a bundle); its state is each rank's shard, held by its inner
    optimizer (``optim``), which a snapshot copies under ``INNER``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer  # (imports RPC parts: not at startup)

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _own_state_inners(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The inner optimizers whose ``state`` is not the wrapper's own (that one is in its state_dict)."""
    return [o for o in inner_optimizers(optimizer) if o.state is not optimizer.state]


def _inner_state(optimizer: torch.optim.Optimizer) -> list[dict[int, Any]]:
    """CPU copies of each inner optimizer's state (``INNER``), keyed by parameter position."""
    return [
        {i: copy_tree(inner.state[p], "cpu") for i, p in enumerate(params_of(inner)) if inner.state.get(p)}
        for inner in _own_state_inners(optimizer)
    ]


def _restore_inner_state(optimizer: torch.optim.Optimizer, saved: list[Mapping[int, Any]]) -> None:
    """Put ``_inner_state``'s copies back: each inner optimizer's state holds exactly them, on its
    parameters' devices (a ``step`` count stays where it was saved, as torch's own load does)."""
    for inner, states in zip(_own_state_inners(optimizer), saved):
        params = params_of(inner)
        inner.state.clear()
        for i, st in states.items():
            p = params[int(i)]
            inner.state[p] = {
                k: v.to(p.device) if isinstance(v, torch.Tensor) and k != "step" and not is_sharded(p) else v
                for k, v in copy_tree(st).items()
            }


def capture_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> dict[str, Any]:
    """CPU copies of everything needed to resume bit-exactly: model (parameters and buffers),
    optimizer (state and param groups; a wrapper optimizer's inner optimizers' state under
    ``INNER``), GradScaler, RNG states, and ``extra`` (plain data only). Of an optimizer whose
    ``state_dict()`` needs every rank (ZeroRedundancyOptimizer), only ``INNER``: this rank's shard.
    """
    state: dict[str, Any] = {MODEL: copy_tree(model.state_dict(), "cpu")}
    if optimizer is not None:
        if not state_dict_needs_every_rank(optimizer):
            state[OPTIMIZER] = copy_tree(optimizer.state_dict(), "cpu")
        inner = _inner_state(optimizer)
        if inner:
            state[INNER] = inner
    if scaler is not None:
        state[SCALER] = copy_tree(scaler.state_dict(), "cpu")
    if rng:
        state[RNG] = capture_rng_state()
    if extra is not None:
        state[EXTRA] = copy_tree(dict(extra), "cpu")
    return state


def _with_groups_added_since(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``saved`` (an optimizer's state dict) with the param groups the live optimizer gained since
    it was taken (``add_param_group``: a frozen part of the model unfrozen), without state: their
    parameters were not the optimizer's then, so it held none for them; torch's load refuses a
    different number of groups. Any other difference is left for torch's load to refuse."""
    groups, live = saved.get("param_groups", []), optimizer.param_groups
    if len(groups) >= len(live) or [len(g["params"]) for g in groups] != [
        len(g["params"]) for g in live[: len(groups)]
    ]:
        return saved
    n = sum(len(g["params"]) for g in groups)
    for group in live[len(groups) :]:
        groups.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(n, n + len(group["params"])))}
        )
        n += len(group["params"])
    return saved


def restore_state(
    state: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    rng: bool = True,
    keep_hyperparams: bool = True,
    step_keys: Collection[tuple[int, str]] = (),
) -> None:
    """Put ``state`` (from ``capture_state`` or ``load_checkpoint``) back into the live objects.

    The snapshot is never aliased: tensors are cloned before the optimizer takes them, so a later
    restore of the same snapshot is still exact. With ``keep_hyperparams`` (default) the optimizer's
    current param-group hyperparameters (lr, weight decay, ...) are kept: the run's step counter and
    the user's LR scheduler do not go back in time, only weights and optimizer state do. A state
    without an ``OPTIMIZER`` entry (ZeroRedundancyOptimizer: ``INNER`` alone) keeps the live
    param groups whatever ``keep_hyperparams`` says. ``step_keys``: param-group entries
    ((position, key)) the optimizer's step writes (its own state kept in its groups: schedule-free
    AdamW's step count ``k``, ``weight_sum``, ``lr_max``), which come from ``state`` even with
    ``keep_hyperparams``.
    """
    model.load_state_dict(rebuild(state[MODEL]))  # local shards back into their DTensors
    if optimizer is not None and OPTIMIZER in state:
        # The live param-group list and dicts stay the ones the run holds: torch's load builds new
        # ones, which would part a wrapper optimizer (SAM, Lookahead) from the optimizer it steps
        # when they share the list (the user's LR schedule would then reach only one of them).
        live = optimizer.param_groups
        sharing = [o for o in inner_optimizers(optimizer) if o.param_groups is live]
        optimizer.load_state_dict(_with_groups_added_since(copy_tree(state[OPTIMIZER]), optimizer))
        loaded = optimizer.param_groups
        if not keep_hyperparams:
            for group, held in zip(live, loaded):
                group.update(held)  # the same parameters, the snapshot's hyperparameters
        else:  # the optimizer's own state in its groups: the snapshot's
            for i, k in step_keys:
                if i < min(len(live), len(loaded)) and k in loaded[i] and k != "params":
                    live[i][k] = loaded[i][k]
        optimizer.param_groups = live
        for inner in sharing:
            inner.param_groups = live
    if optimizer is not None and state.get(INNER):  # (without OPTIMIZER: ZeRO's shard alone)
        _restore_inner_state(optimizer, state[INNER])
    if scaler is not None and state.get(SCALER):
        scaler.load_state_dict(state[SCALER])
    if rng and RNG in state:
        restore_rng_state(state[RNG])


# --------------------------------------------------------------------------------------------
# In-memory snapshots
# --------------------------------------------------------------------------------------------


def tree_nbytes(value: Any) -> int:
    """Bytes of the tensors in a state tree (dicts, lists, tuples, tensors, ``LocalShard``)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, LocalShard):
        return tree_nbytes(value.data)
    if isinstance(value, Mapping):
        return sum(tree_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tree_nbytes(v) for v in value)
    return 0


class SnapshotRing:
    """The last ``keep`` CPU snapshots, one every ``every`` optimizer steps, holding at most
    ``max_bytes`` of tensors in all, with the ``beside`` bytes the run holds next to them (the
    oldest go first; a snapshot larger than the whole budget is not kept, and ``too_big`` says how
    large it was).

    ``maybe_take(label, ...)`` snapshots when ``every`` steps passed since the newest snapshot;
    ``latest_before(step)`` is the newest snapshot with ``label <= step``; ``discard_after(label)``
    drops newer ones (after a rollback they belong to the abandoned trajectory).
    """

    def __init__(
        self, every: int = DEFAULT_SNAPSHOT_EVERY, keep: int = DEFAULT_SNAPSHOT_KEEP, max_bytes: int | None = None
    ):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"SnapshotRing.every must be an integer >= 1, got {every!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"SnapshotRing.keep must be an integer >= 1, got {keep!r}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"SnapshotRing.max_bytes must be >= 0 or None, got {max_bytes!r}")
        self.every = every
        self.keep = keep
        self.max_bytes = max_bytes
        self.too_big: int | None = None  # bytes of the last snapshot the budget could not hold
        # Bytes the run holds on the host beside the snapshots, within the same budget (the state a
        # trial's rollback left, the state before a level shift): set by the monitor before a take
        self.beside = 0
        self._ring: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(maxlen=keep)
        self._sizes: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of tensors the snapshots hold now."""
        return sum(self._sizes.get(id(state), 0) for _, state in self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def labels(self) -> list[int]:
        return [label for label, _ in self._ring]

    def take(
        self,
        label: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Snapshot now under ``label`` (replaces an existing snapshot with the same label)."""
        if self._ring and self._ring[-1][0] >= label:
            self.discard_after(label - 1)
        if self.max_bytes is not None and self.too_big is not None and self.too_big > self.max_bytes:
            return  # one snapshot is larger than the whole budget: none is taken (nor copied)
        state = capture_state(model, optimizer, scaler, extra)
        size = tree_nbytes(state)
        if self.max_bytes is not None:
            if size > self.max_bytes:
                self.too_big = size
                return
            room = self.max_bytes - self.beside
            if size > room:
                return  # (no room beside what is held: none is taken until that is let go)
            while self._ring and self.nbytes + size > room:
                self._sizes.pop(id(self._ring.popleft()[1]), None)  # the oldest go first
        if len(self._ring) == self.keep:
            self._sizes.pop(id(self._ring[0][1]), None)
        self._ring.append((int(label), state))
        self._sizes[id(state)] = size

    def maybe_take(
        self,
        label: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> bool:
        """Snapshot if none is held yet or ``every`` steps have passed since the newest one (so a
        step skipped for being unhealthy delays the snapshot instead of losing it); returns
        whether it did."""
        if self._ring and label - self._ring[-1][0] < self.every:
            return False
        self.take(label, model, optimizer, scaler, extra)
        return True

    def latest_before(self, step: int) -> tuple[int, dict[str, Any]] | None:
        """(label, state) of the newest snapshot with ``label <= step``, or None."""
        for label, state in reversed(self._ring):
            if label <= step:
                return label, state
        return None

    def discard_after(self, label: int) -> None:
        """Drop every snapshot with a label greater than ``label``."""
        self.pop_after(label)

    def pop_after(self, label: int) -> list[tuple[int, dict[str, Any]]]:
        """Take out every snapshot with a label greater than ``label``: (label, state), oldest first."""
        popped: list[tuple[int, dict[str, Any]]] = []
        while self._ring and self._ring[-1][0] > label:
            entry = self._ring.pop()
            self._sizes.pop(id(entry[1]), None)
            popped.append(entry)
        return popped[::-1]

    def put_back(self, entries: list[tuple[int, dict[str, Any]]]) -> None:
        """Put back snapshots ``pop_after`` took out (after dropping those newer than the first of
        them), oldest first; the ring keeps its ``keep`` newest (they were in it before, within its
        byte budget)."""
        if not entries:
            return
        self.discard_after(entries[0][0] - 1)
        for label, state in entries:
            size = tree_nbytes(state)
            if len(self._ring) == self.keep:
                self._sizes.pop(id(self._ring[0][1]), None)
            self._ring.append((label, state))
            self._sizes[id(state)] = size

    def clear(self) -> None:
        self._ring.clear()
        self._sizes.clear()
