"""JSONL sink: ``run_dir/metrics.jsonl`` and ``run_dir/events.jsonl``.

One JSON object per line, appended and flushed per write, so a crash loses at most the line being
written. Non-finite floats are written as the strings "nan", "inf", "-inf" (valid JSON).

metrics.jsonl line: {"step": 12, "time": 1733140000.1, "loss/total": 0.71, "grad_norm/total": 2.3, ...}
events.jsonl line:  {"step": 12, "time": ..., "kind": "nonfinite_grad", "message": "...",
                     "data": {...}, "actions": ["skip_step"]}
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from ..events import Event, jsonable
from .base import Sink

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, run_dir: str | None = None):
        self.run_dir = run_dir
        self._files: dict[str, Any] = {}

    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        self.run_dir = self.run_dir or run_dir

    def _file(self, name: str):
        fh = self._files.get(name)
        if fh is None:
            if self.run_dir is None:
                raise RuntimeError("the jsonl sink needs a run_dir (Monitor(run_dir=...))")
            os.makedirs(self.run_dir, exist_ok=True)
            fh = open(os.path.join(self.run_dir, name), "a", encoding="utf-8")
            self._files[name] = fh
        return fh

    def _write(self, name: str, record: dict[str, Any]) -> None:
        fh = self._file(name)
        fh.write(json.dumps(jsonable(record), allow_nan=False) + "\n")
        fh.flush()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write(METRICS_FILE, {"step": step, "time": time.time(), **metrics})

    def log_event(self, event: Event) -> None:
        self._write(EVENTS_FILE, {"step": event.step, "time": time.time(),
                                  **{k: v for k, v in event.to_dict().items() if k != "step"}})

    def flush(self) -> None:
        for fh in self._files.values():
            fh.flush()
            os.fsync(fh.fileno())

    def close(self) -> None:
        for fh in self._files.values():
            try:
                fh.close()
            except OSError:
                pass
        self._files.clear()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a JSONL file written by this sink, tolerating a cut last line (a crashed run)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the line being written when the process died
    return out


def to_float(v: Any) -> float:
    """Undo the JSON encoding of non-finite floats."""
    if isinstance(v, str):
        return float(v)
    return float(v)
