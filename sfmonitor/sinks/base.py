"""Sink interface and the router that fans out to every sink.

A sink receives, per optimizer step, the step's statistics as plain floats (one read per step has
already happened) and each event. Every method does nothing by default, so a sink implements only
what it needs. Backends import their library lazily, inside the sink, never at module import.

A sink that raises is disabled by the router with one warning; training goes on.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable

from ..events import Event


class Sink:
    """Base sink: every method is a no-op. Subclasses override what they need."""

    name = "sink"

    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        """Called once on attach with the run folder (may be None) and the config as a dict."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The statistics of optimizer step ``step`` (0-based), keys as in DESIGN.md."""

    def log_event(self, event: Event) -> None:
        """One event (a finding and the actions it triggered)."""

    def flush(self) -> None:
        """Make everything written so far durable."""

    def close(self) -> None:
        """Release files and runs. Must be safe to call twice."""


class MemorySink(Sink):
    """Keeps everything in memory: for tests and notebooks."""

    name = "memory"

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.events: list[Event] = []
        self.closed = 0

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_event(self, event: Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed += 1


class SinkRouter:
    """Fans every call out to all sinks; a sink that raises is disabled with a single warning."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks: list[Sink] = list(sinks)
        self.disabled: dict[str, str] = {}

    def _call(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:  # noqa: BLE001 - a sink must never stop training
                self.sinks.remove(sink)
                label = getattr(sink, "name", type(sink).__name__)
                self.disabled[label] = f"{type(e).__name__}: {e}"
                warnings.warn(f"sfmonitor: sink {label!r} failed in {method}() and is disabled for "
                              f"the rest of the run ({type(e).__name__}: {e}); training goes on",
                              RuntimeWarning, stacklevel=3)

    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        self._call("open", run_dir, config)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._call("log_metrics", step, metrics)

    def log_event(self, event: Event) -> None:
        self._call("log_event", event)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")


def make_sink(spec: "str | Sink") -> Sink:
    """A sink from its name ("jsonl", "console", "tensorboard", "wandb") or a Sink object."""
    if isinstance(spec, Sink):
        return spec
    if not isinstance(spec, str):
        # Duck-typed sinks are accepted if they have at least one sink method.
        if any(hasattr(spec, m) for m in ("log_metrics", "log_event")):
            return spec  # type: ignore[return-value]
        raise TypeError(f"sinks: expected a sink name or a Sink object, got {type(spec).__name__}")
    from . import SINKS  # name -> "module:Class", imported only when asked for
    if spec not in SINKS:
        from ..events import ConfigError
        raise ConfigError(f"sinks: unknown sink {spec!r}; choose from {', '.join(sorted(SINKS))}")
    module, cls = SINKS[spec].split(":")
    import importlib
    return getattr(importlib.import_module(module, __package__), cls)()
