"""Console sink: one line per event on stderr. Metrics are not printed (too many)."""

from __future__ import annotations

import sys

from ..events import Event
from .base import Sink


def format_event(event: Event) -> str:
    acts = f" -> {', '.join(event.actions)}" if event.actions else ""
    return f"[sfmonitor] step {event.step}: {event.kind}: {event.message}{acts}"


class ConsoleSink(Sink):
    name = "console"

    def __init__(self, stream=None):
        self.stream = stream

    def log_event(self, event: Event) -> None:
        print(format_event(event), file=self.stream or sys.stderr, flush=True)
