"""Weights & Biases sink: sectioned charts against the optimizer step, an events table, alerts.

``wandb`` is imported on first use (``pip install 'sfmonitor[wandb]'``). The sink reuses the active
run (``wandb.run``) when the training script started one, and otherwise starts its own with
``wandb.init(dir=run_dir, ...)`` on the first write (and finishes it on ``close``; a reused run is
left open for its owner).

What is logged (every key under ``sfmonitor/``):

==================================  ==============================================================
key                                 content
==================================  ==============================================================
``sfmonitor/step``                  the optimizer step (0-based); the x axis of every sfmonitor
                                    chart (``define_metric("sfmonitor/*", step_metric=...)``)
``sfmonitor/<stat key>``            every statistic (``sfmonitor/grad_norm/fusion``, ...), so the
                                    workspace groups charts by section
``sfmonitor/event_count/<kind>``    cumulative events of that kind, logged at the event's step
``sfmonitor/events``                ``wandb.Table`` step, kind, message, actions, data; re-logged
                                    on flush/close and at most every ``table_interval_s``
summary ``sfmonitor/events_total``, ``sfmonitor/actions_total``, ``sfmonitor/event_count/<kind>``,
``sfmonitor/action_count/<action>`` (written on flush and close)
==================================  ==============================================================

Events that triggered an action (a rescue) raise ``wandb.alert`` (Slack / e-mail, as the W&B
project is set up), at most one per ``alert_interval_s`` seconds; alerts held back are counted in
the next one. Offline mode (``WANDB_MODE=offline``) works.

W&B never blocks or stops training: the training thread only appends records to a buffer (at
most ``max_buffer`` metrics rows; beyond that new rows are dropped and counted); a background
thread imports wandb, starts the run (``init`` waits at most ``init_timeout_s``) and sends the
buffer. If W&B cannot start or fails later, the sink warns once (on the training thread, at its
next call) and drops what it holds for the rest of the run. ``close`` sends what is buffered and
finishes the run, waiting at most ``close_timeout_s``. ``drain(timeout)`` waits until the buffer
is sent (tests, notebooks).

Files: a run the sink starts itself is written under ``$WANDB_DIR`` when the user set that
variable, else under ``run_dir`` (``run_dir/wandb/``), else W&B's default.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..events import Event, jsonable
from ..schema import Section, option
from .base import Sink

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

INSTALL_HINT = "pip install 'sfmonitor[wandb]'"
KEY_PREFIX = "sfmonitor/"
STEP_KEY = KEY_PREFIX + "step"
TABLE_KEY = KEY_PREFIX + "events"
EVENT_COUNT_KEY = KEY_PREFIX + "event_count/"  # + kind
ACTION_COUNT_KEY = KEY_PREFIX + "action_count/"  # + action name
EVENTS_TOTAL_KEY = KEY_PREFIX + "events_total"
ACTIONS_TOTAL_KEY = KEY_PREFIX + "actions_total"
TABLE_COLUMNS = ["step", "kind", "message", "actions", "data"]
ALERT_TITLE_MAX = 63  # W&B: "must be less than 64 characters long"


@dataclass
class WandbConfig(Section):
    """Options of the W&B sink (constructor keyword arguments)."""

    project: str = option("sfmonitor", "W&B project of a run the sink starts itself")
    entity: str = option("", "W&B entity (team or user); empty: the account default")
    name: str = option("", "run name of a run the sink starts itself; empty: W&B picks one")
    group: str = option("", "W&B run group; empty: none")
    tags: list[str] = option([], "W&B run tags")
    mode: str = option(
        "", "wandb.init mode; empty: from WANDB_MODE / the W&B default", choices=("", "online", "offline", "disabled")
    )
    init_timeout_s: float = option(
        30.0,
        "longest wait for wandb.init before the sink gives up (warns once, training goes on); W&B's own default is 90",
        lo=0.0,
        lo_open=True,
    )
    commit: bool = option(
        True,
        "log sfmonitor rows as their own history rows; False: attach them "
        "to the script's next wandb.log (use when the script passes step=)",
    )
    alerts: bool = option(True, "wandb.alert when an event triggered an action (a rescue)")
    alert_interval_s: float = option(
        300.0, "at most one alert per this many seconds; alerts held back are counted in the next one", lo=0.0
    )
    alert_level: str = option("WARN", "wandb.alert level", choices=("INFO", "WARN", "ERROR"))
    table_interval_s: float = option(
        60.0, "re-log the events table at most this often while events arrive (always on flush and close)", lo=0.0
    )
    max_buffer: int = option(
        10000,
        "metrics rows held while W&B starts or lags; beyond it new "
        "rows are dropped (counted in sink.dropped, one warning)",
        lo=1,
    )
    close_timeout_s: float = option(
        60.0,
        "longest wait in close() for the buffer to reach W&B and "
        "the run to finish; then the rest is dropped with a "
        "warning",
        lo=0.0,
    )


class WandbSink(Sink):
    """Statistics, events and alerts to Weights & Biases. See the module docstring for the keys.

    ``WandbSink(project=..., alert_interval_s=..., ...)``: every argument is optional
    (``WandbConfig``). Nothing is imported or started before the first write; then a background
    thread does every W&B call, so no training step waits for W&B.
    """

    name = "wandb"

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        self.config = WandbConfig(**kwargs)
        self.run_dir: str | None = None
        self.run_config: dict[str, Any] = {}
        self.run: Run | None = None  # the wandb Run in use (set by the worker thread)
        self.owns_run = False  # True: the sink started it and finishes it on close
        self.failed: str | None = None  # the W&B error that turned the sink off
        self.clock = clock
        self.rows: list[list[Any]] = []
        self.event_counts: Counter[str] = Counter()
        self.action_counts: Counter[str] = Counter()
        self.alerts_sent = 0
        self.alerts_held = 0  # rescues not alerted since the last alert (rate limit)
        self.dropped = 0  # metrics rows dropped (buffer full, or W&B failed)
        self._last_alert: float | None = None
        self._table_logged_rows = 0
        self._last_table: float | None = None
        self._wandb: ModuleType | None = None  # the wandb module, imported on first use
        # Training thread -> worker thread: a queue of (kind, callable) guarded by a condition.
        self._ops: collections.deque[tuple[str, Callable[[], None]]] = collections.deque()
        self._metric_ops = 0  # metrics rows in the queue (max_buffer bounds them)
        self._cv = threading.Condition()
        self._busy = False  # the worker is running an op
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()  # what was warned about: "failed", "moved", "dropped"
        self.moved: tuple[str, str] | None = None  # (the folder given, where W&B put the run instead)

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.run_config = dict(config or {})

    def _check_installed(self) -> None:
        """On the training thread, cheaply: raise ImportError with the install hint if wandb is
        missing (the router then turns the sink off with one warning)."""
        if self._wandb is not None:
            return
        try:
            found = sys.modules.get("wandb", False) is not None and (
                "wandb" in sys.modules or importlib.util.find_spec("wandb") is not None
            )
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ImportError(f"the wandb sink needs the wandb package: {INSTALL_HINT}")

    def _import(self) -> ModuleType:
        if self._wandb is None:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(f"the wandb sink needs the wandb package: {INSTALL_HINT} ({e})") from e
            self._wandb = wandb
        return self._wandb

    def _fail(self, where: str, e: BaseException) -> None:
        """W&B misbehaved (worker thread): stop using it; the training thread warns once."""
        if self.failed is None:
            self.failed = f"{type(e).__name__}: {e} (in {where})"

    def _warn(self) -> None:
        """Training thread: one warning each for a failure, a run W&B put elsewhere, dropped rows."""
        if self.failed is not None and "failed" not in self._warned:
            self._warn_once(
                "failed", f"W&B failed ({self.failed}); the wandb sink is off for the rest of the run, training goes on"
            )
        if self.moved is not None and "moved" not in self._warned:
            self._warn_once(
                "moved",
                f"W&B wrote this run under {self.moved[1]}, not under {self.moved[0]} (not writable for it?); "
                "the wandb sink logs there",
            )
        if self.dropped and "dropped" not in self._warned and self.failed is None:
            self._warn_once(
                "dropped",
                f"W&B is not keeping up; the wandb sink dropped metrics rows (more than "
                f"max_buffer={self.config.max_buffer} were waiting); events and alerts are kept, training goes on",
            )

    def _warn_once(self, what: str, message: str) -> None:
        self._warned.add(what)
        warnings.warn(f"sfmonitor: {message}", RuntimeWarning, stacklevel=4)

    def _submit(self, kind: str, fn: Callable[[], None]) -> None:
        """Training thread: queue one W&B call for the worker; never waits for W&B."""
        self._warn()
        if self.failed is not None or self._closed:
            if kind == "metrics":
                self.dropped += 1
            return
        self._check_installed()
        with self._cv:
            if kind == "metrics":
                if self._metric_ops >= self.config.max_buffer:
                    self.dropped += 1
                    return
                self._metric_ops += 1
            self._ops.append((kind, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="sfmonitor-wandb", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _worker(self) -> None:
        """Worker thread: start the run, then run the queued calls in order."""
        while True:
            with self._cv:
                while not self._ops and not self._closing:
                    self._cv.wait()
                if not self._ops:
                    self._cv.notify_all()
                    return
                kind, fn = self._ops.popleft()
                if kind == "metrics":
                    self._metric_ops -= 1
                self._busy = True
            try:
                if self.failed is None and (kind == "finish" or self._ensure_run() is not None):
                    fn()
                elif kind == "metrics":
                    self.dropped += 1
            except Exception as e:
                self._fail(kind, e)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued record reached W&B (or was dropped); True if it did in time.
        For tests and notebooks: the training loop never needs it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._ops or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _ensure_run(self) -> Run | None:
        """Worker thread: the run to log to, the active one, else one started now. None once
        W&B failed."""
        if self.failed is not None:
            return None
        if self.run is not None:
            return self.run
        try:
            wandb = self._import()
            if wandb.run is not None:
                self.run, self.owns_run = wandb.run, False
                if self.run_config:
                    self.run.config.update({"sfmonitor": jsonable(self.run_config)}, allow_val_change=True)
            else:
                c = self.config
                kwargs: dict[str, Any] = {
                    "project": c.project,
                    "config": {"sfmonitor": jsonable(self.run_config)},
                    "settings": wandb.Settings(init_timeout=c.init_timeout_s),
                }
                # The user's WANDB_DIR wins; else the run folder; else W&B's default. Passed
                # explicitly: wandb reads the variable once per process, at its first setup.
                folder = os.environ.get("WANDB_DIR") or self.run_dir
                if folder:
                    kwargs["dir"] = folder
                for key in ("entity", "name", "group", "mode"):
                    if getattr(c, key):
                        kwargs[key] = getattr(c, key)
                if c.tags:
                    kwargs["tags"] = list(c.tags)
                run = wandb.init(**kwargs)
                if run is None:
                    raise RuntimeError("wandb.init returned no run")
                self.run, self.owns_run = run, True
                where = os.path.realpath(getattr(run, "dir", "") or "")
                if (
                    folder
                    and where
                    and os.path.commonpath([where, os.path.realpath(folder)]) != os.path.realpath(folder)
                ):
                    # W&B falls back to the system temp folder, saying so only in its own log, when
                    # the folder it was given is not writable (a run folder made read-only)
                    self.moved = (str(folder), where)
            self.run.define_metric(STEP_KEY)
            self.run.define_metric(KEY_PREFIX + "*", step_metric=STEP_KEY)
        except Exception as e:
            self.run = None
            self._fail("wandb.init", e)
        return self.run

    def _active_run(self) -> Run:
        """Worker thread, in a queued call: the run ``_ensure_run`` set (the worker runs a call
        other than "finish" only once it returned a run)."""
        if self.run is None:
            raise RuntimeError("the wandb sink has no run")
        return self.run

    def _log(self, row: dict[str, Any], kind: str = "log") -> None:
        commit = self.config.commit
        self._submit(kind, lambda: self._active_run().log(row, commit=commit))

    # -- writes ----------------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row: dict[str, Any] = {STEP_KEY: int(step)}
        for key, value in metrics.items():
            if key in ("step", "time"):
                continue
            try:
                row[KEY_PREFIX + key] = float(value)  # NaN / inf kept: W&B stores them
            except (TypeError, ValueError):
                continue
        self._log(row, "metrics")

    def log_event(self, event: Event) -> None:
        self.event_counts[event.kind] += 1
        self.action_counts.update(event.actions)
        self.rows.append(
            [
                int(event.step),
                event.kind,
                event.message,
                ", ".join(event.actions),
                json.dumps(jsonable(event.data or {}), sort_keys=True, default=str),
            ]
        )
        self._log({STEP_KEY: int(event.step), EVENT_COUNT_KEY + event.kind: self.event_counts[event.kind]})
        if event.actions and self.config.alerts:
            self._maybe_alert(event)
        now = self.clock()
        if self._last_table is None or now - self._last_table >= self.config.table_interval_s:
            self._log_table()

    def _maybe_alert(self, event: Event) -> None:
        now = self.clock()
        if self._last_alert is not None and now - self._last_alert < self.config.alert_interval_s:
            self.alerts_held += 1
            return
        held = self.alerts_held
        text = f"step {event.step}: {event.message}\nactions: {', '.join(event.actions)}"
        if held:
            text += f"\n(+{held} more rescue{'s' if held > 1 else ''} since the last alert; see the {TABLE_KEY} table)"
        title = f"sfmonitor: {event.kind} at step {event.step}"[:ALERT_TITLE_MAX]
        level, wait = self.config.alert_level, max(1.0, self.config.alert_interval_s)

        def send() -> None:
            self._active_run().alert(title=title, text=text, level=level, wait_duration=wait)
            self.alerts_sent += 1

        self._last_alert = now
        self.alerts_held = 0
        self._submit("alert", send)

    def _log_table(self) -> None:
        if len(self.rows) == self._table_logged_rows:
            return
        rows = [list(r) for r in self.rows]  # the table as of now, whatever comes later
        commit = self.config.commit

        def send() -> None:
            table = self._import().Table(columns=TABLE_COLUMNS, data=rows)
            self._active_run().log({TABLE_KEY: table}, commit=commit)

        self._table_logged_rows = len(self.rows)
        self._last_table = self.clock()
        self._submit("table", send)

    def summary(self) -> dict[str, Any]:
        """The counts written to the run summary."""
        out: dict[str, Any] = {
            EVENTS_TOTAL_KEY: sum(self.event_counts.values()),
            ACTIONS_TOTAL_KEY: sum(self.action_counts.values()),
        }
        out.update({EVENT_COUNT_KEY + k: n for k, n in sorted(self.event_counts.items())})
        out.update({ACTION_COUNT_KEY + k: n for k, n in sorted(self.action_counts.items())})
        return out

    def _write_summary(self) -> None:
        summary = self.summary()
        self._submit("summary", lambda: self._active_run().summary.update(summary))

    def flush(self) -> None:
        """Queue the events table and the summary; returns at once."""
        if self._thread is None:
            self._warn()
            return
        self._log_table()
        self._write_summary()

    def close(self) -> None:
        """Send what is buffered, finish the sink's own run; wait at most close_timeout_s."""
        if self._closed:
            return
        if self._thread is not None:
            self._log_table()
            self._write_summary()
            self._submit("finish", self._finish)
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join(self.config.close_timeout_s)
            if self._thread.is_alive():
                with self._cv:
                    lost = sum(1 for k, _ in self._ops if k == "metrics")
                    self._ops.clear()
                    self._metric_ops = 0
                self.dropped += lost
                self._fail(
                    "close",
                    TimeoutError(
                        f"W&B did not take the buffer within close_timeout_s={self.config.close_timeout_s}"
                        f" s; {lost} metrics rows and the records queued after them are dropped"
                    ),
                )
        self._closed = True
        self._warn()

    def _finish(self) -> None:
        """Worker thread: finish the sink's own run (a reused run is left to its owner)."""
        run, self.run = self.run, None
        if run is not None and self.owns_run and self.failed is None:
            run.finish()
        self.owns_run = False
