"""TensorBoard sink: every statistic as a scalar, a custom-scalars dashboard, events as text.

Writes with ``torch.utils.tensorboard.SummaryWriter`` into ``run_dir/tensorboard`` (or ``log_dir``).
The writer opens on first use; ``tensorboard`` is imported only then
(``pip install 'sfmonitor[tensorboard]'``).

What lands where (tags are the statistic keys listed in ``sfmonitor.stats``, optionally under ``prefix``):

=====================================  ==========================================================
tag                                    content
=====================================  ==========================================================
``loss/total``, ``grad_norm/<g>``, ...  every statistic of every optimizer step, at that step
``events/<kind>`` (text)               one text entry per event at its step: kind, message
                                       (the cause, with its numbers), actions taken, data table
``event_count/<kind>``                 cumulative number of events of that kind, at each event's
                                       step (marks the events on the scalar time axis)
custom scalars, category "sfmonitor"   one multi-line chart per section of ``CHARTS``
=====================================  ==========================================================

The groups and loss components of a run are only known from the keys it logs, so the layout uses
tag regexes (``^grad_norm/.*``) and is written once, when the writer opens. One text tag per event
kind keeps each tag's steps increasing (TensorBoard drops entries of a tag whose step goes back).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ..events import Event, jsonable
from ..schema import Section, option
from .base import Sink

INSTALL_HINT = "pip install 'sfmonitor[tensorboard]'"
LOG_SUBDIR = "tensorboard"  # run_dir/tensorboard
LAYOUT_CATEGORY = "sfmonitor"  # custom-scalars category name
EVENT_TEXT_TAG = "events"  # events/<kind>: text entries
EVENT_COUNT_TAG = "event_count"  # event_count/<kind>: cumulative count, scalar

# Chart title -> statistic-key prefixes it collects (the keys of ``sfmonitor.stats``). Shared with the
# W&B sink and the HTML report so the three show the same sections.
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss components", ("loss/",)),
    ("loss weights", ("loss_weight/",)),
    ("loss ratios between components", ("loss_ratio/",)),
    ("gradient ratios between components", ("grad_ratio/",)),
    ("gradient cosine between components", ("grad_cos/",)),
    ("gradient norm by group", ("grad_norm/",)),
    ("parameter norm by group", ("param_norm/",)),
    ("update ratio by group", ("update_ratio/",)),
    ("gradient norm by block (like blocks inside a group)", ("block_grad_norm/",)),
    ("update ratio by block (like blocks inside a group)", ("block_update_ratio/",)),
    ("update share rounded away (bf16/fp16 weights)", ("update_stale/",)),
    ("dead units by group (largest share of a layer)", ("dead_units/",)),
    ("Adam: share of weights whose sqrt(v) is under eps", ("adam_eps/",)),
    ("BatchNorm: batch variance over running variance (largest layer)", ("bn_var_ratio/",)),
    ("loss scale", ("amp/loss_scale",)),
    ("skipped steps (GradScaler)", ("amp/skipped_steps",)),
    ("learning rate", ("lr/",)),
    ("activation max by module", ("act_absmax/",)),
    ("events by kind (cumulative)", (EVENT_COUNT_TAG + "/",)),
)


def custom_scalars_layout(prefix: str = "") -> dict[str, dict[str, list]]:
    """The layout dict for ``SummaryWriter.add_custom_scalars``: one Multiline chart per section.

    Tags are regexes anchored at the start (``^grad_norm/.*``), so charts fill with whatever
    groups, components and modules the run turns out to have.
    """
    p = re.escape(prefix)
    charts = {title: ["Multiline", [f"^{p}{re.escape(k)}.*" for k in keys]] for title, keys in CHARTS}
    return {LAYOUT_CATEGORY: charts}


def event_markdown(event: Event) -> str:
    """One event as Markdown for the TensorBoard text dashboard."""
    acts = ", ".join(f"`{a}`" for a in event.actions) if event.actions else "none (reported only)"
    lines = [f"**step {event.step} - {event.kind}**", "", event.message or "(no message)", "", f"actions: {acts}"]
    data = jsonable(event.data or {})
    if data:
        lines += ["", "| data | value |", "|---|---|"]
        for k, v in data.items():
            cell = v if isinstance(v, str) else json.dumps(v)
            lines.append(f"| {k} | {str(cell).replace('|', '/')} |")
    return "\n".join(lines)


@dataclass
class TensorBoardConfig(Section):
    """Options of the TensorBoard sink (constructor keyword arguments)."""

    log_dir: str = option("", "folder for the event files; empty: run_dir/tensorboard")
    prefix: str = option(
        "", "prepended to every tag, e.g. 'sfmonitor/' when sharing a log dir with the training script's own writer"
    )
    flush_secs: float = option(10.0, "SummaryWriter: seconds between automatic flushes", lo=0.0, lo_open=True)
    max_queue: int = option(100, "SummaryWriter: events queued before a forced flush", lo=1)
    layout: bool = option(True, "write the custom-scalars layout (category 'sfmonitor') on open")


class TensorBoardSink(Sink):
    """Statistics and events to TensorBoard. See the module docstring for the tags.

    ``TensorBoardSink(log_dir=..., prefix=..., flush_secs=..., max_queue=..., layout=...)``;
    every argument is optional (``TensorBoardConfig``). The writer opens on first write.
    """

    name = "tensorboard"

    def __init__(self, **kwargs: Any) -> None:
        self.config = TensorBoardConfig(**kwargs)
        self.run_dir: str | None = None
        self._writer = None
        self._event_counts: dict[str, int] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        self.run_dir = run_dir

    @property
    def log_dir(self) -> str:
        if self.config.log_dir:
            return self.config.log_dir
        if self.run_dir is None:
            raise RuntimeError(
                "the tensorboard sink needs a run_dir (Monitor(run_dir=...)) or TensorBoardSink(log_dir=...)"
            )
        return os.path.join(self.run_dir, LOG_SUBDIR)

    def _get_writer(self):
        if self._writer is None:
            try:
                import tensorboard  # noqa: F401 - SummaryWriter needs it; fail with the hint
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(f"the tensorboard sink needs the tensorboard package: {INSTALL_HINT} ({e})") from e
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = SummaryWriter(
                log_dir=self.log_dir, flush_secs=self.config.flush_secs, max_queue=self.config.max_queue
            )
            if self.config.layout:
                self._writer.add_custom_scalars(custom_scalars_layout(self.config.prefix))
        return self._writer

    # -- writes ----------------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        w = self._get_writer()
        p = self.config.prefix
        for key, value in metrics.items():
            if key in ("step", "time"):
                continue
            try:
                v = float(value)
            except (TypeError, ValueError):
                continue  # not a number (a string note): nothing to plot
            # NaN and inf are written as they are: TensorBoard shows them, and they are the story.
            w.add_scalar(p + key, v, global_step=int(step))

    def log_event(self, event: Event) -> None:
        w = self._get_writer()
        p = self.config.prefix
        w.add_text(f"{p}{EVENT_TEXT_TAG}/{event.kind}", event_markdown(event), global_step=int(event.step))
        n = self._event_counts.get(event.kind, 0) + 1
        self._event_counts[event.kind] = n
        w.add_scalar(f"{p}{EVENT_COUNT_TAG}/{event.kind}", float(n), global_step=int(event.step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            w, self._writer = self._writer, None
            w.flush()
            w.close()
