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
the next one. Offline mode (``WANDB_MODE=offline``) works; W&B being unreachable never stops or
blocks training: ``init`` waits at most ``init_timeout_s``, and any W&B error warns once and turns
the sink off for the rest of the run.
"""
from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from ..schema import Section, option
from ..events import Event, jsonable
from .base import Sink

INSTALL_HINT = "pip install 'sfmonitor[wandb]'"
KEY_PREFIX = "sfmonitor/"
STEP_KEY = KEY_PREFIX + "step"
TABLE_KEY = KEY_PREFIX + "events"
EVENT_COUNT_KEY = KEY_PREFIX + "event_count/"     # + kind
ACTION_COUNT_KEY = KEY_PREFIX + "action_count/"   # + action name
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
    mode: str = option("", "wandb.init mode; empty: from WANDB_MODE / the W&B default",
                       choices=("", "online", "offline", "disabled"))
    init_timeout_s: float = option(30.0, "longest wait for wandb.init before the sink gives up "
                                         "(warns once, training goes on); W&B's own default is 90",
                                   lo=0.0, lo_open=True)
    commit: bool = option(True, "log sfmonitor rows as their own history rows; False: attach them "
                                "to the script's next wandb.log (use when the script passes step=)")
    alerts: bool = option(True, "wandb.alert when an event triggered an action (a rescue)")
    alert_interval_s: float = option(300.0, "at most one alert per this many seconds; alerts held "
                                            "back are counted in the next one", lo=0.0)
    alert_level: str = option("WARN", "wandb.alert level", choices=("INFO", "WARN", "ERROR"))
    table_interval_s: float = option(60.0, "re-log the events table at most this often while "
                                           "events arrive (always on flush and close)", lo=0.0)


class WandbSink(Sink):
    """Statistics, events and alerts to Weights & Biases. See the module docstring for the keys.

    ``WandbSink(project=..., alert_interval_s=..., ...)``: every argument is optional
    (``WandbConfig``). Nothing is imported or started before the first write.
    """

    name = "wandb"

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        self.config = WandbConfig(**kwargs)
        self.run_dir: str | None = None
        self.run_config: dict[str, Any] = {}
        self.run = None             # the wandb Run in use
        self.owns_run = False       # True: the sink started it and finishes it on close
        self.failed: str | None = None  # the W&B error that turned the sink off
        self.clock = clock
        self.rows: list[list[Any]] = []
        self.event_counts: Counter[str] = Counter()
        self.action_counts: Counter[str] = Counter()
        self.alerts_sent = 0
        self.alerts_held = 0        # rescues not alerted since the last alert (rate limit)
        self._last_alert: float | None = None
        self._table_logged_rows = 0
        self._last_table: float | None = None
        self._wandb = None

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.run_config = dict(config or {})

    def _import(self):
        if self._wandb is None:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(f"the wandb sink needs the wandb package: {INSTALL_HINT} ({e})") from e
            self._wandb = wandb
        return self._wandb

    def _fail(self, where: str, e: BaseException) -> None:
        """W&B misbehaved: warn once, stop using it; training goes on."""
        if self.failed is None:
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"sfmonitor: W&B failed in {where} ({self.failed}); the wandb sink is off "
                          f"for the rest of the run, training goes on", RuntimeWarning, stacklevel=3)

    def _ensure_run(self):
        """The run to log to: the active one, else one started now. None once W&B failed."""
        if self.failed is not None:
            return None
        if self.run is not None:
            return self.run
        wandb = self._import()
        try:
            if wandb.run is not None:
                self.run, self.owns_run = wandb.run, False
                if self.run_config:
                    self.run.config.update({"sfmonitor": jsonable(self.run_config)},
                                           allow_val_change=True)
            else:
                c = self.config
                kwargs: dict[str, Any] = {
                    "project": c.project, "dir": self.run_dir,
                    "config": {"sfmonitor": jsonable(self.run_config)},
                    "settings": wandb.Settings(init_timeout=c.init_timeout_s),
                }
                for key in ("entity", "name", "group", "mode"):
                    if getattr(c, key):
                        kwargs[key] = getattr(c, key)
                if c.tags:
                    kwargs["tags"] = list(c.tags)
                self.run, self.owns_run = wandb.init(**kwargs), True
            self.run.define_metric(STEP_KEY)
            self.run.define_metric(KEY_PREFIX + "*", step_metric=STEP_KEY)
        except Exception as e:  # noqa: BLE001 - unreachable server, bad credentials, ...
            self.run = None
            self._fail("wandb.init", e)
        return self.run

    def _log(self, row: dict[str, Any]) -> None:
        run = self._ensure_run()
        if run is None:
            return
        try:
            run.log(row, commit=self.config.commit)
        except Exception as e:  # noqa: BLE001
            self._fail("wandb.log", e)

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
        self._log(row)

    def log_event(self, event: Event) -> None:
        self.event_counts[event.kind] += 1
        self.action_counts.update(event.actions)
        self.rows.append([int(event.step), event.kind, event.message, ", ".join(event.actions),
                          json.dumps(jsonable(event.data or {}), sort_keys=True)])
        self._log({STEP_KEY: int(event.step),
                   EVENT_COUNT_KEY + event.kind: self.event_counts[event.kind]})
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
        run = self._ensure_run()
        if run is None:
            return
        held = self.alerts_held
        text = f"step {event.step}: {event.message}\nactions: {', '.join(event.actions)}"
        if held:
            text += (f"\n(+{held} more rescue{'s' if held > 1 else ''} since the last alert; "
                     f"see the {TABLE_KEY} table)")
        title = f"sfmonitor: {event.kind} at step {event.step}"[:ALERT_TITLE_MAX]
        try:
            run.alert(title=title, text=text, level=self.config.alert_level,
                      wait_duration=max(1.0, self.config.alert_interval_s))
        except Exception as e:  # noqa: BLE001
            self._fail("wandb.alert", e)
            return
        self._last_alert = now
        self.alerts_held = 0
        self.alerts_sent += 1

    def _log_table(self) -> None:
        if len(self.rows) == self._table_logged_rows:
            return
        run = self._ensure_run()
        if run is None:
            return
        try:
            table = self._wandb.Table(columns=TABLE_COLUMNS, data=[list(r) for r in self.rows])
            run.log({TABLE_KEY: table}, commit=self.config.commit)
        except Exception as e:  # noqa: BLE001
            self._fail("logging the events table", e)
            return
        self._table_logged_rows = len(self.rows)
        self._last_table = self.clock()

    def summary(self) -> dict[str, Any]:
        """The counts written to the run summary."""
        out: dict[str, Any] = {EVENTS_TOTAL_KEY: sum(self.event_counts.values()),
                               ACTIONS_TOTAL_KEY: sum(self.action_counts.values())}
        out.update({EVENT_COUNT_KEY + k: n for k, n in sorted(self.event_counts.items())})
        out.update({ACTION_COUNT_KEY + k: n for k, n in sorted(self.action_counts.items())})
        return out

    def _write_summary(self) -> None:
        if self.run is None or self.failed is not None:
            return
        try:
            self.run.summary.update(self.summary())
        except Exception as e:  # noqa: BLE001
            self._fail("writing the run summary", e)

    def flush(self) -> None:
        if self.run is None:
            return
        self._log_table()
        self._write_summary()

    def close(self) -> None:
        run = self.run
        if run is None:
            return
        self._log_table()
        self._write_summary()
        self.run = None
        if self.owns_run and self.failed is None:
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                self._fail("wandb.finish", e)
        self.owns_run = False
