"""Emergency checkpoints of sharded runs (FSDP2) with ``torch.distributed.checkpoint`` (DCP).

Under FSDP2 no rank holds the whole model, so an emergency checkpoint is a DCP folder that every
rank writes its own shards into (host memory per rank: its shards, as a single process holds its
model). DCP records each shard's place in the full tensors, so the folder loads into any sharding
and any world size, one process included.

Layout of ``<run_dir>/checkpoints/emergency-step00000012.dcp/`` (DCP's own files, one per rank,
plus ``.metadata``); the state saved is

    model       {name: tensor}, plain parameter names (no ``module.`` / ``_orig_mod.``)
    optimizer   {"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}
                (keyed by parameter name, as torch.distributed.checkpoint.state_dict does)
    scaler      the GradScaler's state_dict (when there is one)
    extra       step, epoch, reason, kind, the monitor's state_dict, ...
    rng         each rank's RNG states, under rank<r>

The folder is written under a temporary name and renamed by rank 0 once every rank has written
(DCP's save ends with a collective), so a crash mid-write leaves no half checkpoint under the
final name. Non-tensor entries are read back with ``torch.load(weights_only=True)``.

Reading one back:

- ``load(path, model, optimizer=None, scaler=None)`` into a live model (sharded or not, any world
  size: call it on every rank of the group, or in one process without a process group);
- ``to_single_file(path, out)`` in one process: a single ``torch.save`` file that plain
  ``torch.load(out, weights_only=True)`` reads (the full tensors: needs the host memory of the
  whole model). ``python -m sfmonitor.dcp DCP_FOLDER OUT.pt`` does the same from a shell.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import TRACKED, capture_rng_state, restore_rng_state, save_checkpoint
from .errors import CheckpointError
from .sharding import (
    clean_name,
    is_sharded,
    optimizer_state_by_index,
    optimizer_state_by_name,
    rebuild,
)

__all__ = ["SUFFIX", "holds_shards", "load", "save", "save_emergency", "to_single_file"]

SUFFIX = ".dcp"  # emergency-step00000012.dcp/
PARTIAL = ".partial"  # the folder's name while ranks are still writing
MODEL, OPTIMIZER, SCALER, EXTRA, RNG = "model", "optimizer", "scaler", "extra", "rng"


def holds_shards(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2)."""
    return any(is_sharded(p) for p in model.parameters())


def _rank() -> int:
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else 0


def _blob(value: Any) -> bytes:
    """Plain data as one opaque entry: DCP would flatten a nested dict and drop its empty parts."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unblob(value: Any, what: str) -> Any:
    if not isinstance(value, (bytes, bytearray)):
        raise CheckpointError(f"DCP checkpoint: {what} is a {type(value).__name__}, not the entry sfmonitor writes")
    try:
        return torch.load(io.BytesIO(bytes(value)), map_location="cpu", weights_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(f"DCP checkpoint: its {what} entry cannot be read with weights_only=True: {first}") from e


def _model_state(model: nn.Module, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    sd = model.state_dict() if state is None else state
    return {clean_name(k): v for k, v in sd.items()}


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    extra: Mapping[str, Any] | None = None,
    snapshot: Mapping[str, Any] | None = None,
) -> Path:
    """Write a DCP checkpoint folder at ``path`` (collective: every rank calls it with the same
    path). The state is the live one, or ``snapshot`` (``checkpoint.capture_state``: this rank's
    local shards, written from host memory). Written under ``<path>.partial`` and renamed by rank 0
    once every rank is done. Returns ``path``."""
    import torch.distributed.checkpoint as dcp

    final = Path(path)
    tmp = final.with_name(final.name + PARTIAL)
    if snapshot is not None:
        # Shards stay where the snapshot keeps them (host memory): rebuilt as DTensors over them.
        model_sd = _model_state(model, _on_host(snapshot["model"]))
        optim_sd = snapshot.get("optimizer")
        optim_sd = _on_host(optim_sd) if optim_sd is not None else None
        scaler_sd = snapshot.get("scaler")
    else:
        model_sd = _model_state(model)
        optim_sd = optimizer.state_dict() if optimizer is not None else None
        scaler_sd = scaler.state_dict() if scaler is not None else None
    state: dict[str, Any] = {MODEL: model_sd}
    if optimizer is not None and optim_sd is not None:
        state[OPTIMIZER] = optimizer_state_by_name(optim_sd, model, optimizer)
    if scaler_sd:
        state[SCALER] = _blob(dict(scaler_sd))
    state[EXTRA] = _blob(dict(extra or {}))
    state[RNG] = {f"rank{_rank()}": _blob(capture_rng_state())}
    if _rank() == 0 and final.exists():
        shutil.rmtree(final)  # the same step written twice (a resumed run): the newer one wins
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        os.replace(tmp, final)
    return final


def _on_host(tree: Any) -> Any:
    """A snapshot's local shards as DTensors whose local parts stay in host memory (no copy)."""
    return rebuild(tree, where_kept=True)


def prune(folder: Path, keep: int, prefix: str) -> list[str]:
    """Remove all but the newest ``keep`` checkpoint folders ``<prefix>*.dcp`` (rank 0 only)."""
    if _rank() != 0:
        return []
    found = sorted(p for p in folder.glob(f"{prefix}*{SUFFIX}") if p.is_dir())
    removed = []
    for p in found[:-keep]:
        try:
            shutil.rmtree(p)
            removed.append(p.name)
        except OSError:
            pass
    return removed


def save_emergency(ctx: Any, folder: Path, prefix: str, snap: Any, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The ``checkpoint`` action under FSDP2: every rank writes its shards of the last good state
    (the live state, or the snapshot ``snap = (label, state)``) into one DCP folder. Returns the
    facts of the event. A failure (full disk...) reaches every rank through DCP's collectives, so
    every rank reports the same outcome; it warns and never stops the step."""
    source, state = "live", None
    if snap is not None:
        label, state = snap
        # The snapshot's own extra carries what the model state lacks (optimizer-only parameters).
        # Not its tracked modules (Monitor.track): sharded, each rank's part would go into one
        # per-rank entry of plain data that only one rank's copy survives in (and that
        # weights_only cannot read); this checkpoint holds the model's, optimizer's and scaler's state.
        extra = {k: v for k, v in {**(state.get(EXTRA) or {}), **extra}.items() if k != TRACKED}
        extra["snapshot_step"] = label
        source = f"snapshot@{label}"
    else:
        extra = ctx.with_outside_params(extra, tracked=False)
    path = folder / f"{prefix}{ctx.step:08d}{SUFFIX}"
    try:
        save(path, ctx.model, ctx.optimizer, ctx.scaler, extra, snapshot=state)
    except Exception as e:
        warnings.warn(
            f"sfmonitor: the emergency checkpoint {path} could not be written ({type(e).__name__}: {e})",
            RuntimeWarning,
            stacklevel=2,
        )
        return {"saved": False, "path": str(path), "format": "dcp", "error": f"{type(e).__name__}: {e}"}
    ctx.last_checkpoint, ctx.last_checkpoint_step = str(path), ctx.step
    facts: dict[str, Any] = {"saved": True, "path": str(path), "format": "dcp", "source": source}
    if _rank() == 0:  # the folder has its final name (rank 0 renamed it); rank 0 prunes the old ones
        facts["removed"] = prune(folder, ctx.config.checkpoint.keep, prefix)
        facts["bytes"] = sum(f.stat().st_size for f in path.iterdir())
    return _from_rank0(facts)  # every rank's event tells the same


def _from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (one broadcast; no-op without a process group)."""
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() == 1:
        return obj
    box = [obj]
    d.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _metadata(path: str | os.PathLike) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    p = Path(path)
    if not p.is_dir() or not (p / ".metadata").is_file():
        raise CheckpointError(f"{str(p)!r} is not a DCP checkpoint folder (no .metadata file in it)")
    try:
        md = FileSystemReader(str(p)).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"DCP checkpoint {str(p)!r}: its .metadata cannot be read ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(md.planner_data, Mapping):
        raise CheckpointError(f"DCP checkpoint {str(p)!r} was not written with a flattened state dict")
    return md


_SKIP = object()  # a leaf() answer: leave this entry out (not loaded)


def _template(md: Any, leaf: Any) -> dict[str, Any]:
    """The nested state the checkpoint holds, each entry ``leaf(path, storage metadata)`` (a
    tensor to load into, None for a non-tensor entry, ``_SKIP`` to leave it out): DCP loads into
    it. Integer path components are list positions (``param_groups``)."""
    out: dict[Any, Any] = {}
    for flat, obj_path in md.planner_data.items():
        value = leaf(tuple(obj_path), md.state_dict_metadata[flat])
        if value is _SKIP:
            continue
        node: Any = out
        for key, nxt in itertools.pairwise(obj_path):
            node = _slot(node, key, lambda nxt=nxt: [] if isinstance(nxt, int) else {})
        _slot(node, obj_path[-1], lambda value=value: value, replace=True)
    return out


def _slot(node: Any, key: Any, make: Any, replace: bool = False) -> Any:
    """``node[key]`` (a dict or a list, grown as needed), made with ``make()`` when absent."""
    if isinstance(node, list):
        while len(node) <= key:
            node.append(None)
        if node[key] is None or replace:
            node[key] = make()
        return node[key]
    if key not in node or replace:
        node[key] = make()
    return node[key]


def _is_bytes(meta: Any) -> bool:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return isinstance(meta, BytesStorageMetadata)


def _load(state: dict[str, Any], path: str | os.PathLike, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, but its non-tensor entries are read with weights_only=True."""

        def load_bytes(self, read_item, value):
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    try:
        with warnings.catch_warnings():  # one process on purpose: DCP's note that it assumes so is noise
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    except Exception as e:
        raise CheckpointError(f"DCP checkpoint {str(path)!r} cannot be loaded: {type(e).__name__}: {e}") from e


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    rng: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint ``save`` wrote into ``model`` (and ``optimizer``, ``scaler``), whatever
    their sharding and world size now: FSDP2 on any number of ranks (call it on every rank), or a
    plain model in one process without a process group. ``rng``: also restore this rank's RNG
    states (rank 0's when this rank did not write any). Returns the checkpoint's ``extra``
    (step, reason, the monitor's state_dict under "monitor"). A checkpoint that does not fit the
    model (a missing or unknown parameter, another shape) raises ``CheckpointError`` naming it."""
    md = _metadata(path)
    live = {clean_name(k): v for k, v in model.state_dict().items()}
    names = {clean_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    saved_model = {p[1] for p in md.planner_data.values() if p[0] == MODEL}
    missing, unknown = sorted(set(live) - saved_model), sorted(saved_model - set(live))
    if missing or unknown:
        raise CheckpointError(
            f"DCP checkpoint {str(path)!r} does not fit this model: "
            + "; ".join(
                s
                for s in (
                    f"missing {', '.join(missing[:5])}" if missing else "",
                    f"unknown {', '.join(unknown[:5])}" if unknown else "",
                )
                if s
            )
        )
    me = f"rank{_rank()}"
    have_rng = {p[1] for p in md.planner_data.values() if p[0] == RNG}
    rng_key = me if me in have_rng else "rank0"

    def leaf(obj_path: tuple[Any, ...], meta: Any) -> Any:
        top = obj_path[0]
        if top == MODEL:
            target = live[obj_path[1]]
            if tuple(target.shape) != tuple(meta.size):
                raise CheckpointError(
                    f"DCP checkpoint {str(path)!r}: {obj_path[1]} has shape {tuple(meta.size)} there, "
                    f"{tuple(target.shape)} in this model"
                )
            return target
        if top == OPTIMIZER:
            if optimizer is None:
                return _SKIP
            if obj_path[1] == "state" and not _is_bytes(meta):
                p = names.get(obj_path[2])
                if p is not None and tuple(p.shape) == tuple(meta.size):
                    return torch.empty_like(p, dtype=meta.properties.dtype)
                return torch.empty(meta.size, dtype=meta.properties.dtype)
            return None
        if top == SCALER:
            return None if scaler is not None else _SKIP
        if top == RNG:
            return None if rng and obj_path[1] == rng_key else _SKIP
        if top == EXTRA:
            return None
        return _SKIP

    state = _template(md, leaf)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    _load(state, path, no_dist=not distributed)
    with torch.no_grad():  # DCP loaded into the model's own tensors; this checks and copies the rest
        model.load_state_dict({k: state[MODEL][clean_name(k)] for k in model.state_dict()})
    if optimizer is not None and OPTIMIZER in state:
        try:
            optimizer.load_state_dict(optimizer_state_by_index(state[OPTIMIZER], model, optimizer))
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"DCP checkpoint {str(path)!r}: optimizer state does not fit: {e}") from e
    if scaler is not None and SCALER in state:
        scaler.load_state_dict(_unblob(state[SCALER], "scaler"))
    if rng and RNG in state and rng_key in state[RNG]:
        restore_rng_state(_unblob(state[RNG][rng_key], "rng"))
    return _unblob(state[EXTRA], "extra") if EXTRA in state else {}


def to_single_file(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Gather a DCP checkpoint into one ``torch.save`` file that ``torch.load(out,
    weights_only=True)`` reads: ``{"model": {name: tensor}, "optimizer": {"state": {name: ...},
    "param_groups": [...]}, "scaler": ..., "extra": ..., "rng": {"rank<r>": ...}}``, full tensors,
    plain parameter names. One process, no process group; needs the host memory of the whole
    state. Written atomically (``checkpoint.save_checkpoint``). Returns ``out``.

    Load the model part with ``model.load_state_dict(sd["model"])``; the optimizer part with
    ``optimizer.load_state_dict(sharding.optimizer_state_by_index(sd["optimizer"], model,
    optimizer))``."""
    md = _metadata(path)

    def leaf(obj_path: tuple[Any, ...], meta: Any) -> Any:
        if _is_bytes(meta):
            return None
        return torch.empty(meta.size, dtype=meta.properties.dtype)

    state = _template(md, leaf)
    _load(state, path, no_dist=True)
    for key in (SCALER, EXTRA):
        if key in state:
            state[key] = _unblob(state[key], key)
    if RNG in state:
        state[RNG] = {r: _unblob(v, f"rng.{r}") for r, v in state[RNG].items()}
    return save_checkpoint(out, state)


def main(argv: list[str] | None = None) -> int:
    """python -m sfmonitor.dcp DCP_FOLDER OUT.pt: one torch.load(weights_only=True) file."""
    ap = argparse.ArgumentParser(prog="python -m sfmonitor.dcp", description=main.__doc__)
    ap.add_argument("folder", help="a DCP checkpoint folder (e.g. run_dir/checkpoints/emergency-step00000012.dcp)")
    ap.add_argument("out", help="the single file to write")
    args = ap.parse_args(argv)
    try:
        written = to_single_file(args.folder, args.out)
    except CheckpointError as e:
        print(f"python -m sfmonitor.dcp: {e}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
