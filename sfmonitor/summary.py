"""What a run_dir says about its run: ``run.json`` at attach (versions, world size, dtypes, the
monitor's memory) and ``summary.json`` at detach (events and actions by kind, steps skipped or
undone, rescue budget left, the monitor's own time per step), both plain JSON."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import platform
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .checkpoint import params_of, state_dict_needs_every_rank
from .events import Event, jsonable
from .sharding import local

__all__ = ["Tally", "format_memory", "format_summary", "memory_plan", "run_metadata", "run_summary", "write_json"]

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"


def _version() -> str:
    from . import __version__

    return __version__


def run_metadata(
    params: Iterable[torch.Tensor], groups: Mapping[str, Any], world_size: int, config: Mapping[str, Any]
) -> dict[str, Any]:
    """The run's facts at attach: versions, world size, parameter count, bytes and dtypes."""
    params = list(params)
    dtypes = collections.Counter(str(p.dtype).replace("torch.", "") for p in params)
    return {
        "sfmonitor": _version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "world_size": world_size,
        "parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "parameter_dtypes": dict(dtypes),
        "groups": list(groups),
        "config": dict(config),
    }


# Optimizer state per parameter element, in parameter-sized tensors, for the optimizers whose state
# is still empty at attach (torch creates it at the first step): Adam's two moments, SGD's momentum.
_STATE_COPIES = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "Adadelta": 2}


def _state_copies(optimizer: torch.optim.Optimizer) -> float | None:
    name = type(optimizer).__name__
    if name == "SGD":
        return float(any(g.get("momentum", 0) for g in optimizer.param_groups))
    if name == "RMSprop":
        g = optimizer.param_groups[0] if optimizer.param_groups else {}
        return 1.0 + bool(g.get("momentum", 0)) + bool(g.get("centered", False))
    copies = _STATE_COPIES.get(name)
    return None if copies is None else float(copies)


def memory_plan(
    params: Iterable[torch.Tensor],
    buffers: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    undo: bool,
    snapshot_keep: int,
    snapshot_budget_bytes: int,
    update_ratio_fraction: float = 0.0,
    running_stats: Iterable[torch.Tensor] = (),
) -> dict[str, Any]:
    """What the monitor will hold, in bytes: the exact-undo copy (device memory: parameters,
    optimizer state, buffers), the update ratio's own copy when there is no undo copy to read
    (``update_ratio_fraction`` of the parameters; 0: the ratio is off), the copy of the
    normalisation layers' ``running_stats`` when there is no undo copy (two sets: as before the
    step's forward, and the one before) and the rollback snapshots (host memory, bounded by the
    budget).
    The optimizer's state is measured when it exists, else estimated from its class (``None``
    when unknown). Under ZeroRedundancyOptimizer, that of this rank's shard: its inner optimizer's,
    the state this rank's undo copy and snapshots hold."""
    params, buffers = list(params), list(buffers)
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    b_bytes = sum(b.numel() * b.element_size() for b in buffers)
    holder = optimizer.optim if state_dict_needs_every_rank(optimizer) else optimizer  # type: ignore[attr-defined]
    live = [local(v) for st in holder.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    if live:
        s_bytes: int | None = sum(t.numel() * t.element_size() for t in live)
        estimated = False
    else:
        copies = _state_copies(holder)
        held = p_bytes if holder is optimizer else sum(p.numel() * p.element_size() for p in params_of(holder))
        s_bytes = None if copies is None else int(copies * held)
        estimated = True
    one = p_bytes + b_bytes + (s_bytes or 0)
    return {
        "parameter_bytes": p_bytes,
        "buffer_bytes": b_bytes,
        "optimizer_state_bytes": s_bytes,
        "optimizer_state_estimated": estimated,
        "undo_device_bytes": one if undo else 0,
        "update_ratio_device_bytes": 0 if undo else math.ceil(update_ratio_fraction * p_bytes),
        "running_stats_device_bytes": 0 if undo else 2 * sum(b.numel() * b.element_size() for b in running_stats),
        "snapshot_bytes": one,
        "snapshots_kept": min(snapshot_keep, snapshot_budget_bytes // one) if one else snapshot_keep,
        "snapshot_host_bytes": min(snapshot_keep * one, snapshot_budget_bytes),
        "snapshot_budget_bytes": snapshot_budget_bytes,
    }


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def format_memory(plan: Mapping[str, Any]) -> str:
    """One console line: what the monitor holds besides the run itself."""
    state = _mib(plan["optimizer_state_bytes"]) + (" est." if plan["optimizer_state_estimated"] else "")
    undo = (
        f"exact undo {_mib(plan['undo_device_bytes'])} beside the parameters (one copy of parameters "
        f"{_mib(plan['parameter_bytes'])} + optimizer state {state})"
        if plan["undo_device_bytes"]
        else "exact undo off"
    )
    if not plan["undo_device_bytes"] and plan.get("update_ratio_device_bytes"):
        undo += f", update ratio's copy {_mib(plan['update_ratio_device_bytes'])}"
    if not plan["undo_device_bytes"] and plan.get("running_stats_device_bytes"):
        undo += f", running statistics' copy {_mib(plan['running_stats_device_bytes'])}"
    return (
        f"[sfmonitor] memory: {undo}; rollback snapshots in host memory: {plan['snapshots_kept']} x "
        f"{_mib(plan['snapshot_bytes'])} = {_mib(plan['snapshot_host_bytes'])} at most "
        f"(budget actions.rollback.max_host_mb = {_mib(plan['snapshot_budget_bytes'])})"
    )


class Tally:
    """What the run's summary counts of its events: events and actions by kind, actions that
    changed nothing, steps skipped, updates undone, rollbacks and the steps they went back. Plain
    counts, so that they outlive the events they came from: those the bounded in-memory list let go
    and, through the monitor's ``state_dict``, those of the sessions before a resume."""

    def __init__(self) -> None:
        self.events: collections.Counter[str] = collections.Counter()
        self.actions: collections.Counter[str] = collections.Counter()
        self.idle: collections.Counter[str] = collections.Counter()
        self.steps_skipped = 0
        self.last_skipped: int | None = None
        self.updates_undone = 0
        self.rollbacks = 0
        self.steps_rolled_back = 0

    def add(self, event: Event) -> None:
        """Count one event (events come in step order)."""
        self.events[event.kind] += 1
        # An action counts where it changed training; one decided that changed nothing (a clip the
        # optimizer takes in its stride, an LR drop on an optimizer without an LR) is counted apart.
        done = event.changed()
        results = event.data.get("action_results") or {}
        # an undo without its copy (the lean profile) fell back to a rollback: counted as one
        fell_back = (results.get("undo") or {}).get("fallback") == "rollback"
        # the LR's climb back after a drop (its start, its end, a release) changes the LR too, but
        # is no drop: counted apart, so one drop and its climb do not read as three drops
        lr = results.get("lr_drop") or {}
        climb = any(lr.get(k) for k in ("recovering", "recovered", "released"))
        self.actions.update(
            "rollback" if a == "undo" and fell_back else "lr_climb" if a == "lr_drop" and climb else a for a in done
        )
        self.idle.update(a for a in event.actions if a not in done)
        if ("skip_step" in done or event.data.get("step_skipped")) and event.step != self.last_skipped:
            self.steps_skipped += 1
            self.last_skipped = event.step
        for a in done:
            if a not in ("undo", "rollback"):
                continue
            facts = results.get(a) or {}
            if a == "rollback" or facts.get("fallback") == "rollback":
                self.rollbacks += 1
                self.steps_rolled_back += int(facts.get("steps_back", 0))
            else:
                self.updates_undone += 1

    def merged(self, events: Iterable[Event]) -> Tally:
        """A copy of these counts with ``events`` added."""
        out = Tally()
        out.load_state_dict(self.state_dict())
        for e in events:
            out.add(e)
        return out

    def counts(self) -> dict[str, Any]:
        """What the summary reports."""
        return {
            "events": dict(self.events),
            "actions": dict(self.actions),
            "actions_that_changed_nothing": dict(self.idle),
            "steps_skipped": self.steps_skipped,
            "updates_undone": self.updates_undone,
            "rollbacks": self.rollbacks,
            "steps_rolled_back": self.steps_rolled_back,
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self.counts(), "last_skipped": self.last_skipped}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.events = collections.Counter({str(k): int(v) for k, v in dict(sd.get("events") or {}).items()})
        self.actions = collections.Counter({str(k): int(v) for k, v in dict(sd.get("actions") or {}).items()})
        idle = dict(sd.get("actions_that_changed_nothing") or {})
        self.idle = collections.Counter({str(k): int(v) for k, v in idle.items()})
        self.steps_skipped = int(sd.get("steps_skipped", 0))
        last = sd.get("last_skipped")
        self.last_skipped = None if last is None else int(last)
        self.updates_undone = int(sd.get("updates_undone", 0))
        self.rollbacks = int(sd.get("rollbacks", 0))
        self.steps_rolled_back = int(sd.get("steps_rolled_back", 0))


def run_summary(
    tally: Tally,
    steps: int,
    rescues_used: int,
    budget: int,
    monitor_seconds: float,
    monitored_steps: int,
    undo_bytes: int,
    dry_run: bool,
    sink_failures: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The run's events and actions by kind, steps skipped, updates undone, rollbacks and the
    steps they went back (``tally``), budget left, the monitor's own milliseconds per step, and
    the sinks (or their files) that stopped writing, with why."""
    return {
        "steps": steps,
        **tally.counts(),
        "rescues_used": rescues_used,
        "rescue_budget_left": max(0, budget - rescues_used),
        "monitor_ms_per_step": 1e3 * monitor_seconds / max(1, monitored_steps),
        "undo_copy_bytes": undo_bytes,
        "dry_run": dry_run,
        "sink_failures": dict(sink_failures or {}),
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """One short paragraph for the console."""
    acts = ", ".join(f"{k} x{v}" for k, v in summary["actions"].items()) or "none"
    kinds = ", ".join(f"{k} x{v}" for k, v in summary["events"].items()) or "none"
    return (
        f"[sfmonitor] run summary: {summary['steps']} steps; events: {kinds}; actions: {acts}; "
        f"{summary['steps_skipped']} skipped, {summary['updates_undone']} undone, "
        f"{summary['rollbacks']} rolled back ({summary['steps_rolled_back']} steps); "
        f"rescue budget left {summary['rescue_budget_left']}; "
        f"monitor {summary['monitor_ms_per_step']:.2f} ms/step"
        + (" (dry run: nothing was changed)" if summary["dry_run"] else "")
        + (f"; stopped writing: {', '.join(summary['sink_failures'])}" if summary.get("sink_failures") else "")
    )


def write_json(folder: str, name: str, data: Mapping[str, Any]) -> str:
    """Write ``data`` as ``folder/name`` atomically (temporary file, then rename)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(jsonable(dict(data)), fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # (a full disk: no temporary left behind)
            os.remove(tmp)
        raise
    return path
