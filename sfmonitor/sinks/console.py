"""Console sink: one line per event on stderr. Metrics are not printed (too many).

An event that changed nothing (told only: ``large_update``, ``loss_component_spike``, ...) is
printed once per kind every ``QUIET_STEPS`` steps; the ones in between are counted and the next
line of that kind says how many there were. Every event stays in the event log (JSONL,
TensorBoard, W&B) and in ``monitor.events``; an event with actions is always printed.
"""

from __future__ import annotations

import sys

from ..events import Event
from .base import Sink

QUIET_STEPS = 100


def format_event(event: Event) -> str:
    acts = f" -> {', '.join(event.actions)}" if event.actions else ""
    return f"[sfmonitor] step {event.step}: {event.kind}: {event.message}{acts}"


class ConsoleSink(Sink):
    name = "console"

    def __init__(self, stream=None):
        self.stream = stream
        self.told: dict[str, int] = {}  # kind -> step of its last printed told-only event
        self.held: dict[str, int] = {}  # kind -> told-only events not printed since then

    def log_event(self, event: Event) -> None:
        line = format_event(event)
        if not event.actions:
            last = self.told.get(event.kind)
            if last is not None and 0 <= event.step - last < QUIET_STEPS:
                self.held[event.kind] = self.held.get(event.kind, 0) + 1
                return
            self.told[event.kind] = event.step
        held = self.held.pop(event.kind, 0)
        if held:
            line += f" ({held} more {event.kind} events since the last one printed: see the event log)"
        print(line, file=self.stream or sys.stderr, flush=True)
