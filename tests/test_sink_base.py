"""make_sink: a duck-typed sink (not a Sink subclass) is checked when the run is set up, not
disabled later with an AttributeError. Decision (docs/guide.md): an object with at least one
sink method is accepted and its missing methods are no-ops; a method that is not callable or
does not take the sink's arguments, or an object with no sink method at all, is a ConfigError
naming the methods."""

from __future__ import annotations

import warnings

import pytest

from sfmonitor.errors import ConfigError
from sfmonitor.events import Event
from sfmonitor.sinks import MemorySink, Sink, SinkRouter, make_sink
from sfmonitor.sinks.base import SINK_METHODS


class OnlyMetrics:
    """Has log_metrics only: no open, log_event, flush or close."""

    def __init__(self):
        self.rows = []

    def log_metrics(self, step, metrics):
        self.rows.append((step, dict(metrics)))


class OnlyEvents:
    name = "pager"

    def __init__(self):
        self.events = []

    def log_event(self, event):
        self.events.append(event)


def _run(sink_obj):
    sink = make_sink(sink_obj)
    router = SinkRouter([sink])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        router.open(None, {})
        for step in range(3):
            router.log_metrics(step, {"loss/total": 1.0})
            router.log_event(Event(step, "loss_spike", "m", {}, ["skip_step"]))
        router.flush()
        router.close()
        router.close()
    return sink, router, [str(w.message) for w in caught]


@pytest.mark.parametrize("cls", [OnlyMetrics, OnlyEvents])
def test_a_partial_duck_sink_is_never_disabled(cls):
    obj = cls()
    sink, router, warned = _run(obj)
    assert not warned and not router.disabled and router.sinks == [sink]
    assert len(getattr(obj, "rows", getattr(obj, "events", None))) == 3
    assert isinstance(sink, Sink)  # wrapped: every method exists


def test_the_wrapped_sink_keeps_its_name_and_object():
    sink = make_sink(OnlyEvents())
    assert sink.name == "pager" and isinstance(sink.sink, OnlyEvents)
    assert make_sink(OnlyMetrics()).name == "OnlyMetrics"


def test_sink_subclasses_and_names_are_returned_as_they_are():
    mem = MemorySink()
    assert make_sink(mem) is mem
    assert type(make_sink("console")).__name__ == "ConsoleSink"


@pytest.mark.parametrize(
    "obj,match",
    [
        (object(), "none of the sink methods"),
        (3, "none of the sink methods"),
        (type("NotCallable", (), {"log_metrics": 5})(), "log_metrics is not callable"),
        (type("WrongArgs", (), {"log_metrics": lambda self, metrics: None})(), r"log_metrics\(step, metrics\)"),
        (type("WrongEvent", (), {"log_event": lambda self: None})(), r"log_event\(event\)"),
    ],
)
def test_unusable_objects_are_refused_with_config_error(obj, match):
    with pytest.raises(ConfigError, match=match):
        make_sink(obj)


def test_the_error_lists_the_methods():
    with pytest.raises(ConfigError) as e:
        make_sink(object())
    for m in SINK_METHODS:
        assert m in str(e.value)


def test_console_prints_a_told_only_kind_once_per_hundred_steps_and_counts_the_rest():
    import io

    from sfmonitor.events import Event
    from sfmonitor.sinks.console import ConsoleSink

    out = io.StringIO()
    sink = ConsoleSink(out)
    for step in range(10, 60):  # told only: the first is printed, 49 are held
        sink.log_event(Event(step, "large_update", "an update 12x its median"))
    sink.log_event(Event(60, "update_ratio_spike", "undone", actions=["undo"]))  # acted on: printed
    sink.log_event(Event(61, "large_update", "an update 12x its median"))  # held
    sink.log_event(Event(112, "large_update", "an update 11x its median"))  # 102 steps on: printed
    lines = out.getvalue().splitlines()
    assert [ln.split(": ")[1] for ln in lines] == ["large_update", "update_ratio_spike", "large_update"]
    assert lines[0].startswith("[sfmonitor] step 10:") and "more" not in lines[0]
    assert lines[2].startswith("[sfmonitor] step 112:") and "(50 more large_update events" in lines[2]
