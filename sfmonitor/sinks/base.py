"""Sink interface and the router that fans out to every sink.

A sink receives, per optimizer step, the step's statistics as plain floats (one read per step has
already happened) and each event. Every method does nothing by default, so a sink implements only
what it needs. Backends import their library lazily, inside the sink, never at module import.

A sink that raises is disabled by the router with one warning; training goes on.

Duck-typed sinks: ``make_sink`` also takes an object that is not a ``Sink`` subclass if it has
at least one of the sink methods (``SINK_METHODS``). It is wrapped in a ``DuckSink`` whose
missing methods do nothing, as ``Sink``'s do, so such a sink is never disabled later for an
``AttributeError``. Everything is checked when the sink is made (at ``attach``): an object with
none of the methods, a method attribute that is not callable, or one that cannot take the
arguments the router passes is a ``ConfigError`` naming the method and its expected signature.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any

from ..errors import ConfigError
from ..events import Event

# The methods the router calls, with the arguments it passes (for the signature check).
SINK_METHODS: dict[str, tuple[str, ...]] = {
    "open": ("run_dir", "config"),
    "log_metrics": ("step", "metrics"),
    "log_event": ("event",),
    "flush": (),
    "close": (),
}


class Sink:
    """Base sink: every method is a no-op. Subclasses override what they need."""

    name = "sink"

    def open(self, run_dir: str | None, config: dict[str, Any]) -> None:
        """Called once on attach with the run folder (may be None) and the config as a dict."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """The statistics of optimizer step ``step`` (0-based), keys as listed in ``sfmonitor.stats``."""

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


class DuckSink(Sink):
    """A duck-typed sink object made whole: its own methods where it has them, no-ops elsewhere.
    ``sink`` is the wrapped object; ``name`` its ``name`` attribute or its class name."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        label = getattr(sink, "name", None)
        self.name = label if isinstance(label, str) and label else type(sink).__name__
        for method in SINK_METHODS:
            if callable(getattr(sink, method, None)):
                setattr(self, method, getattr(sink, method))  # instance attribute wins

    def __repr__(self) -> str:
        return f"DuckSink({self.sink!r})"


def _check_duck(spec: Any) -> DuckSink:
    """Wrap a duck-typed sink, or raise ConfigError naming what is wrong with it."""
    present = [m for m in SINK_METHODS if getattr(spec, m, None) is not None]
    what = type(spec).__name__
    if not present:
        sigs = ", ".join(f"{m}({', '.join(a)})" for m, a in SINK_METHODS.items())
        raise ConfigError(
            f"sinks: a {what} has none of the sink methods ({sigs}); pass a sink name, "
            f"a sfmonitor.sinks.Sink subclass, or an object with at least one of them"
        )
    for method in present:
        fn = getattr(spec, method)
        expected = f"{method}({', '.join(SINK_METHODS[method])})"
        if not callable(fn):
            raise ConfigError(f"sinks: {what}.{method} is not callable; a sink method is {expected}")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature: trust them
            continue
        try:
            sig.bind(*SINK_METHODS[method])
        except TypeError as e:
            raise ConfigError(f"sinks: {what}.{method}{sig} cannot be called as {expected} ({e})") from None
    return DuckSink(spec)


class SinkRouter:
    """Fans every call out to all sinks; a sink that raises is disabled with a single warning.
    Objects that are not ``Sink`` instances go through ``make_sink`` (checked, wrapped)."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks: list[Sink] = [s if isinstance(s, Sink) else make_sink(s) for s in sinks]
        self.disabled: dict[str, str] = {}

    def _call(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                self.sinks.remove(sink)
                label = getattr(sink, "name", type(sink).__name__)
                self.disabled[label] = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"sfmonitor: sink {label!r} failed in {method}() and is disabled for "
                    f"the rest of the run ({type(e).__name__}: {e}); training goes on",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def failures(self) -> dict[str, str]:
        """What stopped writing during the run, by name: each disabled sink, and each file a sink
        turned off itself (the jsonl sink's, on a full disk), with the records it did not write."""
        out = dict(self.disabled)
        for sink in self.sinks:
            dropped = getattr(sink, "dropped", None) or {}
            for file, error in (getattr(sink, "failed", None) or {}).items():
                out[f"{sink.name}:{file}"] = f"{error} ({dropped.get(file, 0)} records not written)"
        return out

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


def make_sink(spec: str | Sink | Any) -> Sink:
    """A sink from its name ("jsonl", "console", "tensorboard", "wandb"), a Sink object (returned
    as it is), or a duck-typed object with at least one sink method (wrapped in ``DuckSink``; its
    missing methods are no-ops). Anything else is a ConfigError naming what is missing."""
    if isinstance(spec, Sink):
        return spec
    if not isinstance(spec, str):
        return _check_duck(spec)
    from . import SINKS  # name -> "module:Class", imported only when asked for

    if spec not in SINKS:
        raise ConfigError(f"sinks: unknown sink {spec!r}; choose from {', '.join(sorted(SINKS))}")
    module, cls = SINKS[spec].split(":")
    import importlib

    return getattr(importlib.import_module(module, __package__), cls)()
