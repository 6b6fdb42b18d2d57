"""What a run_dir says about its run: ``run.json`` at attach (versions, world size, dtypes, the
monitor's memory) and ``summary.json`` at detach (events and actions by kind, steps skipped or
undone, rescue budget left, the monitor's own time per step), both plain JSON."""

from __future__ import annotations

import collections
import json
import os
import platform
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .events import Event, jsonable

__all__ = ["format_summary", "run_metadata", "run_summary", "write_json"]

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


def run_summary(
    events: Iterable[Event],
    steps: int,
    rescues_used: int,
    budget: int,
    monitor_seconds: float,
    monitored_steps: int,
    undo_bytes: int,
    dry_run: bool,
) -> dict[str, Any]:
    """Events and actions by kind, steps skipped and undone, budget left, the monitor's own
    milliseconds per step. ``events`` may be the bounded in-memory list (the files keep all)."""
    events = list(events)
    kinds = collections.Counter(e.kind for e in events)
    actions = collections.Counter(a for e in events for a in e.actions)
    skipped = {e.step for e in events if "skip_step" in e.actions or e.data.get("step_skipped")}
    undone = sum(1 for e in events if "undo" in e.actions)
    return {
        "steps": steps,
        "events": dict(kinds),
        "actions": dict(actions),
        "steps_skipped": len(skipped),
        "updates_undone": undone,
        "rescues_used": rescues_used,
        "rescue_budget_left": max(0, budget - rescues_used),
        "monitor_ms_per_step": 1e3 * monitor_seconds / max(1, monitored_steps),
        "undo_copy_bytes": undo_bytes,
        "dry_run": dry_run,
    }


def format_summary(summary: Mapping[str, Any]) -> str:
    """One short paragraph for the console."""
    acts = ", ".join(f"{k} x{v}" for k, v in summary["actions"].items()) or "none"
    kinds = ", ".join(f"{k} x{v}" for k, v in summary["events"].items()) or "none"
    return (
        f"[sfmonitor] run summary: {summary['steps']} steps; events: {kinds}; actions: {acts}; "
        f"{summary['steps_skipped']} skipped, {summary['updates_undone']} undone; "
        f"rescue budget left {summary['rescue_budget_left']}; "
        f"monitor {summary['monitor_ms_per_step']:.2f} ms/step"
        + (" (dry run: nothing was changed)" if summary["dry_run"] else "")
    )


def write_json(folder: str, name: str, data: Mapping[str, Any]) -> str:
    """Write ``data`` as ``folder/name`` atomically (temporary file, then rename)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(jsonable(dict(data)), fh, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
