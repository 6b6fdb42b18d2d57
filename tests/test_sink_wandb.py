"""W&B sink, offline: history, events table, alerts and summary read back from the .wandb file;
W&B that hangs or fails never blocks a training step; WANDB_DIR is honoured."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys
import time
import warnings

import pytest

from sfmonitor.events import ConfigError, Event
from sfmonitor.sinks import SinkRouter, make_sink
from sfmonitor.sinks.wandb import TABLE_COLUMNS, WandbSink

wandb = pytest.importorskip("wandb")
from google.protobuf.message import DecodeError  # noqa: E402 - wandb brings protobuf
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "wandb_dir").mkdir()
    yield
    if wandb.run is not None:  # never leak a run into the next test
        wandb.run.finish()


def read_records(path: str) -> list:
    """Parse a .wandb file: a 7-byte header, then LevelDB-log records in 32 KiB blocks."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk, pos = data[pos : pos + length], pos + length
        if kind in (1, 2):  # FULL, FIRST
            chunks = chunk
        else:  # MIDDLE, LAST
            chunks += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunks)
            out.append(rec)
    return out


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


def parse_run(run_dir: str) -> dict:
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    records: list = []
    for _ in range(100):  # the file is complete once the exit record is in (finish() waited)
        try:
            records = read_records(files[0])
        except DecodeError:  # read while wandb was writing a record (a loaded machine): read again
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
    history, summary, alerts = [], {}, []
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary.update({_key(u): json.loads(u.value_json) for u in rec.summary.update})
        elif kind == "alert":
            alerts.append(rec.alert)
    return {
        "history": history,
        "summary": summary,
        "alerts": alerts,
        "files": os.path.join(os.path.dirname(files[0]), "files"),
    }


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_offline_history_table_alerts_summary(tmp_path):
    clock = FakeClock()
    sink = WandbSink(clock=clock, alert_interval_s=300, table_interval_s=0)
    sink.open(str(tmp_path), {"strict": False})
    assert wandb.run is None  # nothing started before the first write
    for s in range(4):
        sink.log_metrics(
            s,
            {
                "loss/total": 1.0 / (s + 1) if s != 2 else float("nan"),
                "grad_norm/fusion": 1.0 + s,
                "amp/loss_scale": 65536.0,
            },
        )
    assert sink.drain(60)  # the background thread started the run and sent the rows
    assert sink.owns_run and wandb.run is sink.run
    sink.log_event(
        Event(2, "nonfinite_loss", "loss/total is nan", {"loss": float("nan")}, ["skip_step", "rollback"])
    )  # alert (first)
    clock.t += 10
    sink.log_event(Event(3, "grad_spike", "grad_norm/total 9.0 > 4.0", {"z": 4.2}, []))  # no action
    sink.log_event(Event(3, "loss_spike", "loss jumped", {}, ["lr_drop"]))  # held (rate limit)
    clock.t += 400
    sink.log_event(
        Event(4, "activation_overflow", "fusion scores 7e4", {"module": "fusion"}, ["precision_fallback"])
    )  # alert, counts the held one
    sink.close()
    sink.close()  # safe twice
    assert wandb.run is None  # the sink's own run is finished

    got = parse_run(str(tmp_path / "wandb_dir"))  # WANDB_DIR (set by the fixture) wins over run_dir
    assert not os.path.exists(tmp_path / "wandb")
    rows = [h for h in got["history"] if "sfmonitor/grad_norm/fusion" in h]
    assert [r["sfmonitor/step"] for r in rows] == [0, 1, 2, 3]
    assert [r["sfmonitor/grad_norm/fusion"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert math.isnan(float(rows[2]["sfmonitor/loss/total"]))
    counts = [
        (h["sfmonitor/step"], h["sfmonitor/event_count/nonfinite_loss"])
        for h in got["history"]
        if "sfmonitor/event_count/nonfinite_loss" in h
    ]
    assert counts == [(2, 1)]

    # the events table: the last logged version holds every event
    paths = [h["sfmonitor/events.path"] for h in got["history"] if "sfmonitor/events.path" in h]
    assert paths
    with open(os.path.join(got["files"], paths[-1])) as fh:
        table = json.load(fh)
    assert table["columns"] == TABLE_COLUMNS
    assert [r[:2] for r in table["data"]] == [
        [2, "nonfinite_loss"],
        [3, "grad_spike"],
        [3, "loss_spike"],
        [4, "activation_overflow"],
    ]
    assert table["data"][0][3] == "skip_step, rollback"
    assert json.loads(table["data"][0][4]) == {"loss": "nan"}

    # alerts: rescues only, rate-limited, the held one counted in the next
    assert [a.title for a in got["alerts"]] == [
        "sfmonitor: nonfinite_loss at step 2",
        "sfmonitor: activation_overflow at step 4",
    ]
    assert got["alerts"][0].level == "WARN"
    assert "rollback" in got["alerts"][0].text
    assert "+1 more rescue since the last alert" in got["alerts"][1].text
    assert sink.alerts_sent == 2

    summ = got["summary"]
    assert summ["sfmonitor/events_total"] == 4 and summ["sfmonitor/actions_total"] == 4
    assert summ["sfmonitor/event_count/grad_spike"] == 1
    assert summ["sfmonitor/action_count/rollback"] == 1
    assert summ["sfmonitor/action_count/precision_fallback"] == 1


def test_reuses_active_run_and_leaves_it_open(tmp_path):
    run = wandb.init(dir=str(tmp_path), project="user-project")
    sink = make_sink("wandb")
    sink.open(str(tmp_path), {})
    sink.log_metrics(0, {"grad_norm/total": 2.5})
    assert sink.drain(60)
    assert sink.run is run and not sink.owns_run
    sink.close()
    assert wandb.run is run  # the script's run is the script's to finish
    run.log({"user/acc": 0.5})
    run.finish()
    got = parse_run(str(tmp_path))
    assert any(h.get("sfmonitor/grad_norm/total") == 2.5 for h in got["history"]), got["history"]
    assert any(h.get("user/acc") == 0.5 for h in got["history"]), got["history"]
    assert got["summary"]["sfmonitor/events_total"] == 0


def test_unreachable_wandb_warns_once_and_never_raises(tmp_path, monkeypatch):
    calls = []

    def broken_init(**kwargs):
        calls.append(kwargs)
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(wandb, "init", broken_init)
    sink = WandbSink()
    router = SinkRouter([sink])
    router.open(str(tmp_path), {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(5):  # the training loop goes on
            router.log_metrics(s, {"loss/total": 1.0})
            router.log_event(Event(s, "loss_spike", "x", {}, ["skip_step"]))
        router.flush()
        router.close()
    msgs = [str(w.message) for w in caught if "W&B" in str(w.message)]
    assert len(msgs) == 1 and "unreachable" in msgs[0]
    assert len(calls) == 1  # no retry storm
    assert calls[0]["settings"].init_timeout == 30.0
    assert sink.failed and not router.disabled  # the sink turned itself off; nothing raised


def test_config_validation_and_install_hint(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="alert_level"):
        WandbSink(alert_level="LOUD")
    with pytest.raises(ConfigError, match="alert_interval_s"):
        WandbSink(alert_interval_s=-1)
    monkeypatch.setitem(sys.modules, "wandb", None)
    sink = WandbSink()
    sink.open(str(tmp_path), {})
    with pytest.raises(ImportError, match=r"sfmonitor\[wandb\]"):
        sink.log_metrics(0, {"loss/total": 1.0})


def test_run_dir_is_used_when_wandb_dir_is_not_set(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR")
    run_dir = tmp_path / "run"
    sink = WandbSink()
    sink.open(str(run_dir), {})
    sink.log_metrics(0, {"loss/total": 0.25})
    sink.close()
    got = parse_run(str(run_dir))
    assert any(h.get("sfmonitor/loss/total") == 0.25 for h in got["history"])


def _steps(router, n):
    """n training steps' worth of sink calls; returns the slowest call, in seconds."""
    slowest = 0.0
    for s in range(n):
        t = time.perf_counter()
        router.log_metrics(s, {"loss/total": 1.0 / (s + 1), "grad_norm/total": 2.0})
        if s % 5 == 4:
            router.log_event(Event(s, "loss_spike", "loss jumped", {}, ["skip_step"]))
        slowest = max(slowest, time.perf_counter() - t)
    return slowest


def test_slow_wandb_init_never_blocks_a_step_and_close_delivers_the_buffer(tmp_path, monkeypatch):
    real_init = wandb.init
    started = []

    def slow_init(**kwargs):
        started.append(time.monotonic())
        time.sleep(3.0)  # a W&B server that takes its time
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", slow_init)
    sink = WandbSink(table_interval_s=0)
    router = SinkRouter([sink])
    router.open(str(tmp_path), {})
    t0 = time.monotonic()
    slowest = _steps(router, 20)
    assert time.monotonic() - t0 < 1.0 and slowest < 0.5, "a training-side call waited for W&B"
    for _ in range(200):
        if started:
            break
        time.sleep(0.01)
    assert started, "W&B is started in the background at the first write"
    router.flush()
    router.close()  # waits for the run, sends the 20 buffered rows, finishes
    assert not router.disabled and sink.failed is None and sink.dropped == 0, (sink.failed, sink.dropped)
    got = parse_run(str(tmp_path / "wandb_dir"))
    steps = [h["sfmonitor/step"] for h in got["history"] if "sfmonitor/loss/total" in h]
    assert steps == list(range(20))
    assert got["summary"]["sfmonitor/events_total"] == 4
    assert len(got["alerts"]) == 1


@pytest.mark.parametrize("delay", [0.0, 2.0])
def test_failing_wandb_init_returns_fast_and_warns_once(tmp_path, monkeypatch, delay):
    def failing_init(**kwargs):
        time.sleep(delay)
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(wandb, "init", failing_init)
    sink = WandbSink()
    router = SinkRouter([sink])
    router.open(str(tmp_path), {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        slowest = _steps(router, 20)
        assert time.monotonic() - t0 < 1.0 and slowest < 0.5
        router.close()
    msgs = [str(w.message) for w in caught if "W&B" in str(w.message)]
    assert len(msgs) == 1 and "unreachable" in msgs[0], msgs
    assert not router.disabled and sink.failed


def test_hung_wandb_init_close_gives_up_after_close_timeout(tmp_path, monkeypatch):
    import threading

    release = threading.Event()

    def hung_init(**kwargs):
        release.wait(30)
        raise ConnectionError("never answered")

    monkeypatch.setattr(wandb, "init", hung_init)
    sink = WandbSink(close_timeout_s=0.5)
    router = SinkRouter([sink])
    router.open(str(tmp_path), {})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _steps(router, 10) < 0.5
            t0 = time.monotonic()
            router.close()
            assert time.monotonic() - t0 < 3.0
        msgs = [str(w.message) for w in caught if "W&B" in str(w.message)]
        assert len(msgs) == 1 and "close_timeout_s" in msgs[0], msgs
    finally:
        release.set()


def test_a_full_buffer_drops_rows_with_one_warning_and_keeps_events(tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    real_init = wandb.init

    def gated_init(**kwargs):
        release.wait(30)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", gated_init)
    sink = WandbSink(max_buffer=5, table_interval_s=0)
    router = SinkRouter([sink])
    router.open(str(tmp_path), {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(router, 20)  # the first row is taken by the worker (waiting in init), 5 wait
        release.set()
        router.close()
    msgs = [str(w.message) for w in caught if "max_buffer" in str(w.message)]
    assert len(msgs) == 1, [str(w.message) for w in caught]
    assert sink.dropped >= 20 - 6
    got = parse_run(str(tmp_path / "wandb_dir"))
    assert got["summary"]["sfmonitor/events_total"] == 4  # events are never dropped


def test_a_run_wandb_put_elsewhere_is_warned_with_where(tmp_path, monkeypatch):
    """W&B writes to the system temp folder, saying so only in its own log, when the folder it
    was given is not writable (a run folder made read-only): the sink warns with both paths (a
    helper's probe found the run in /tmp/wandb and no word from the monitor)."""
    import tempfile

    from wandb.sdk import wandb_init

    monkeypatch.delenv("WANDB_DIR")
    run_dir = tmp_path / "run"
    real_access = os.access
    monkeypatch.setattr(
        wandb_init.os, "access", lambda p, mode: False if str(p).startswith(str(run_dir)) else real_access(p, mode)
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "elsewhere"))
    os.makedirs(tmp_path / "elsewhere")
    sink = WandbSink()
    with pytest.warns(RuntimeWarning, match=r"W&B wrote this run under .*elsewhere.*not under .*run"):
        sink.open(str(run_dir), {})
        sink.log_metrics(0, {"loss/total": 0.25})
        sink.close()
