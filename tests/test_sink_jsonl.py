"""JSONL sink: metrics.jsonl and events.jsonl fail alone (one warning per file); the rescues are
still written when the metrics file cannot be."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from sfmonitor.events import Event
from sfmonitor.sinks import SinkRouter
from sfmonitor.sinks.jsonl import EVENTS_FILE, METRICS_FILE, JsonlSink

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def _event(step: int) -> Event:
    return Event(step=step, kind="nonfinite_grad", message="grad is nan", data={"x": 1}, actions=["skip_step"])


def _drive(run_dir, steps=3):
    """Three steps through the router, as the monitor calls the sinks; returns the warnings."""
    sink = JsonlSink()
    router = SinkRouter([sink])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        router.open(str(run_dir), {})
        for step in range(steps):
            router.log_metrics(step, {"loss/total": 0.5})
            router.log_event(_event(step))
            router.flush()
        router.close()
    return sink, router, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def _lines(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_both_files_are_written(tmp_path):
    sink, router, warned = _drive(tmp_path)
    assert not warned and router.sinks == [sink]
    assert [r["step"] for r in _lines(tmp_path / METRICS_FILE)] == [0, 1, 2]
    assert [r["actions"] for r in _lines(tmp_path / EVENTS_FILE)] == [["skip_step"]] * 3


def test_metrics_file_that_cannot_be_opened_does_not_lose_the_events(tmp_path):
    (tmp_path / METRICS_FILE).mkdir()  # open(..., "a") raises IsADirectoryError
    sink, router, warned = _drive(tmp_path)
    assert router.sinks == [sink], "the router must not disable the whole sink"
    assert [r["step"] for r in _lines(tmp_path / EVENTS_FILE)] == [0, 1, 2]
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert METRICS_FILE in str(warned[0].message) and "IsADirectoryError" in str(warned[0].message)
    assert set(sink.failed) == {METRICS_FILE}


@needs_dev_full
def test_metrics_write_error_does_not_lose_the_events(tmp_path):
    os.symlink("/dev/full", tmp_path / METRICS_FILE)  # every write: OSError ENOSPC
    sink, router, warned = _drive(tmp_path)
    assert router.sinks == [sink]
    assert [r["step"] for r in _lines(tmp_path / EVENTS_FILE)] == [0, 1, 2]
    assert len(warned) == 1 and METRICS_FILE in str(warned[0].message)
    assert "No space left" in str(warned[0].message)


@needs_dev_full
def test_events_write_error_does_not_lose_the_metrics(tmp_path):
    os.symlink("/dev/full", tmp_path / EVENTS_FILE)
    sink, router, warned = _drive(tmp_path)
    assert router.sinks == [sink]
    assert [r["step"] for r in _lines(tmp_path / METRICS_FILE)] == [0, 1, 2]
    assert len(warned) == 1 and EVENTS_FILE in str(warned[0].message)


@needs_dev_full
def test_both_files_failing_warn_once_each(tmp_path):
    os.symlink("/dev/full", tmp_path / EVENTS_FILE)
    os.symlink("/dev/full", tmp_path / METRICS_FILE)
    sink, router, warned = _drive(tmp_path, steps=5)
    assert len(warned) == 2
    assert {METRICS_FILE, EVENTS_FILE} == {
        f for f in (METRICS_FILE, EVENTS_FILE) for w in warned if f in str(w.message)
    }


def test_a_record_that_cannot_be_encoded_is_skipped_not_the_file(tmp_path):
    loop: dict = {}
    loop["self"] = loop  # json.dumps: ValueError (circular reference)
    sink = JsonlSink(str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sink.log_event(Event(step=0, kind="plateau", message="m", data={"loop": loop}, actions=[]))
        sink.log_event(_event(1))
        sink.log_metrics(2, {"loss/total": 1.0})
        sink.close()
    assert [r["step"] for r in _lines(tmp_path / EVENTS_FILE)] in ([1], [0, 1])
    assert [r["step"] for r in _lines(tmp_path / METRICS_FILE)] == [2]
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) <= 1
