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
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..events import Event, jsonable
from .base import Sink

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"


class JsonlSink(Sink):
    """Appends to ``metrics.jsonl`` and ``events.jsonl``. The two files fail alone: an error
    opening or writing one (disk full, a folder in the way...) warns once, naming the file and the
    error, and turns off that file only, so the events (the rescues) are still written when the
    metrics cannot be, and the other way round. A record that cannot be encoded is skipped (one
    warning per file). ``failed`` maps each turned-off file to its error; ``dropped`` counts the
    records each file lost. No method raises for a file error: training never stops here."""

    name = "jsonl"

    def __init__(self, run_dir: str | None = None):
        self.run_dir = run_dir
        self._files: dict[str, Any] = {}
        self.failed: dict[str, str] = {}  # file name -> the error that turned it off
        self.dropped: dict[str, int] = {}  # file name -> records not written
        self._warned_encode: set[str] = set()

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

    def _fail(self, name: str, where: str, e: BaseException) -> None:
        """Turn off one file with one warning; the other file goes on."""
        self.dropped[name] = self.dropped.get(name, 0) + 1
        if name in self.failed:
            return
        self.failed[name] = f"{type(e).__name__}: {e}"
        fh = self._files.pop(name, None)
        if fh is not None:
            try:
                fh.close()
            except Exception:
                pass
        path = os.path.join(self.run_dir or ".", name)
        warnings.warn(
            f"sfmonitor: the jsonl sink cannot {where} {path} ({self.failed[name]}); "
            f"nothing more is written to {name} for the rest of the run, the other "
            f"file goes on and training goes on",
            RuntimeWarning,
            stacklevel=4,
        )

    def _write(self, name: str, record: Callable[[], dict[str, Any]]) -> None:
        if name in self.failed:
            self.dropped[name] = self.dropped.get(name, 0) + 1
            return
        try:
            line = json.dumps(jsonable(record()), allow_nan=False, default=str) + "\n"
        except Exception as e:
            self.dropped[name] = self.dropped.get(name, 0) + 1
            if name not in self._warned_encode:
                self._warned_encode.add(name)
                warnings.warn(
                    f"sfmonitor: the jsonl sink skipped a record of {name} it cannot "
                    f"encode ({type(e).__name__}: {e}); later records are written",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return
        if self.run_dir is None:
            raise RuntimeError("the jsonl sink needs a run_dir (Monitor(run_dir=...))")
        try:
            fh = self._file(name)
            fh.write(line)
            fh.flush()
        except Exception as e:
            self._fail(name, "write", e)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write(METRICS_FILE, lambda: {"step": step, "time": time.time(), **metrics})

    def log_event(self, event: Event) -> None:
        self._write(
            EVENTS_FILE,
            lambda: {
                "step": event.step,
                "time": time.time(),
                **{k: v for k, v in event.to_dict().items() if k != "step"},
            },
        )

    def flush(self) -> None:
        for name, fh in list(self._files.items()):
            try:
                fh.flush()
                os.fsync(fh.fileno())
            except Exception as e:
                self._fail(name, "flush", e)

    def close(self) -> None:
        for fh in self._files.values():
            try:
                fh.close()
            except Exception:
                pass
        self._files.clear()


@dataclass
class JsonlScan:
    """What ``scan_jsonl`` found: the records, the lines it skipped, and whether the file ends in
    a cut line."""

    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # line number of each record
    bad_lines: list[int] = field(default_factory=list)  # 1-based numbers of skipped lines
    cut: bool = False  # the last line has no newline and does not parse: the writer died mid-line


def scan_jsonl(path: str | os.PathLike) -> JsonlScan:
    """Read a JSONL file line by line, whatever bytes it holds.

    A line that is not UTF-8, not JSON (or too deep / too large a number for Python's parser),
    or not a JSON object is skipped and its number kept in ``bad_lines``; the last line, when it
    has no newline and does not parse, is the one a crash cut (``cut``) and is not counted as
    bad. A missing file reads as empty. Raises OSError only when the file cannot be read at all
    (a folder in its place, no permission).
    """
    out = JsonlScan()
    if not os.path.exists(path):
        return out
    last_bad_unterminated = False
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            last_bad_unterminated = False
            if not raw.strip():
                continue
            try:
                value = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):  # bad UTF-8, bad JSON, a 5000-digit number
                value = None
            if isinstance(value, dict):
                out.records.append(value)
                out.lines.append(lineno)
                continue
            if not raw.endswith(b"\n"):
                last_bad_unterminated = True
            out.bad_lines.append(lineno)
    if last_bad_unterminated:
        out.bad_lines.pop()
        out.cut = True
    return out


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file written by this sink. Tolerates a cut last line (a crashed
    run) and skips lines that are not UTF-8 JSON objects; ``scan_jsonl`` says which."""
    return scan_jsonl(path).records


def to_float(v: Any) -> float:
    """Undo the JSON encoding of non-finite floats."""
    if isinstance(v, str):
        return float(v)
    return float(v)
