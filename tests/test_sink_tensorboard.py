"""TensorBoard sink: scalars, events as text, and the custom-scalars layout, read back from disk."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from sfmonitor.events import ConfigError, Event
from sfmonitor.sinks import make_sink
from sfmonitor.sinks.tensorboard import CHARTS, LAYOUT_CATEGORY, TensorBoardSink

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2


def _load(log_dir: str) -> EventAccumulator:
    ea = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _write_run(sink, steps=5):
    for s in range(steps):
        sink.log_metrics(
            s,
            {
                "loss/total": 1.0 / (s + 1) if s != 3 else float("nan"),
                "loss/vision": 0.5,
                "loss_weight/vision": 0.4,
                "grad_norm/total": 2.0 + s,
                "grad_norm/fusion": 1.0 + s,
                "update_ratio/fusion": 1e-3,
                "amp/loss_scale": 65536.0 / (2 ** max(0, s - 2)),
                "amp/skipped_steps": float(max(0, s - 2)),
                "act_absmax/fusion": 100.0 * (s + 1),
            },
        )
    sink.log_event(
        Event(
            3,
            "nonfinite_loss",
            "loss/total is nan at step 3",
            {"loss": float("nan"), "component": "fusion"},
            ["skip_step", "rollback"],
        )
    )
    sink.log_event(Event(4, "grad_spike", "grad_norm/total 6.0 > 4.1 (z=3.1)", {"z": 3.1}, []))


def test_scalars_events_and_layout_read_back(tmp_path):
    sink = make_sink("tensorboard")
    assert isinstance(sink, TensorBoardSink)
    sink.open(str(tmp_path), {})
    assert not (tmp_path / "tensorboard").exists()  # nothing opens before the first write
    _write_run(sink)
    sink.flush()
    sink.close()
    sink.close()  # safe twice

    ea = _load(str(tmp_path / "tensorboard"))
    tags = ea.Tags()
    assert "grad_norm/fusion" in tags["scalars"]
    vals = [(e.step, e.value) for e in ea.Scalars("grad_norm/fusion")]
    assert vals == [(s, 1.0 + s) for s in range(5)]
    loss = {e.step: e.value for e in ea.Scalars("loss/total")}
    assert math.isnan(loss[3]) and loss[4] == pytest.approx(0.2)
    assert [e.value for e in ea.Scalars("amp/skipped_steps")] == [0, 0, 0, 1, 2]
    assert [(e.step, e.value) for e in ea.Scalars("event_count/nonfinite_loss")] == [(3, 1.0)]

    # events: one text entry per event at its step, with kind, cause and actions
    text = ea.Tensors("events/nonfinite_loss/text_summary")
    assert [t.step for t in text] == [3]
    md = text[0].tensor_proto.string_val[0].decode()
    assert "nonfinite_loss" in md and "loss/total is nan at step 3" in md
    assert "`skip_step`, `rollback`" in md and "| component | fusion |" in md
    md2 = ea.Tensors("events/grad_spike/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "reported only" in md2

    # custom-scalars layout: category "sfmonitor", one chart per section, regex tags that match
    # the logged keys (TensorBoard matches chart tags as regexes against the scalar tags)
    raw = ea.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout()
    layout.ParseFromString(raw)
    assert [c.title for c in layout.category] == [LAYOUT_CATEGORY]
    charts = {c.title: list(c.multiline.tag) for c in layout.category[0].chart}
    assert list(charts) == [title for title, _ in CHARTS]

    def matched(title):
        return sorted(t for t in tags["scalars"] if any(re.match(r, t) for r in charts[title]))

    assert matched("gradient norm by group") == ["grad_norm/fusion", "grad_norm/total"]
    assert matched("loss components") == ["loss/total", "loss/vision"]  # not loss_weight/
    assert matched("loss weights") == ["loss_weight/vision"]
    assert matched("update ratio by group") == ["update_ratio/fusion"]
    assert matched("loss scale") == ["amp/loss_scale"]
    assert matched("skipped steps (GradScaler)") == ["amp/skipped_steps"]
    assert matched("activation max by module") == ["act_absmax/fusion"]
    assert matched("events by kind (cumulative)") == ["event_count/grad_spike", "event_count/nonfinite_loss"]


def test_prefix_and_log_dir(tmp_path):
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"), prefix="sfmonitor/")
    sink.open(None, {})
    sink.log_metrics(0, {"grad_norm/total": 1.5})
    sink.close()
    ea = _load(str(tmp_path / "tb"))
    assert [e.value for e in ea.Scalars("sfmonitor/grad_norm/total")] == [1.5]
    layout = layout_pb2.Layout()
    layout.ParseFromString(ea.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    tags = [t for c in layout.category[0].chart for t in c.multiline.tag]
    assert r"^sfmonitor/grad_norm/.*" in tags


def test_bad_options_and_missing_run_dir():
    with pytest.raises(ConfigError, match="max_queue"):
        TensorBoardSink(max_queue=0)
    with pytest.raises(TypeError):
        TensorBoardSink(nope=1)
    sink = TensorBoardSink()
    sink.open(None, {})
    with pytest.raises(RuntimeError, match="run_dir"):
        sink.log_metrics(0, {"loss/total": 1.0})


def test_missing_tensorboard_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    sink = TensorBoardSink()
    sink.open(str(tmp_path), {})
    with pytest.raises(ImportError, match=r"sfmonitor\[tensorboard\]"):
        sink.log_metrics(0, {"loss/total": 1.0})


def test_import_does_not_pull_tensorboard():
    code = (
        "import sys, sfmonitor.sinks.tensorboard, sfmonitor.sinks.wandb, sfmonitor.tools.report;"
        "bad = [m for m in ('tensorboard', 'wandb', 'matplotlib') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_monitor_end_to_end_jsonl_tensorboard_and_report(tmp_path):
    """A tiny model under the Monitor with sinks=["jsonl", "tensorboard"]; a NaN loss at step 3."""
    torch = pytest.importorskip("torch")
    import sfmonitor
    from sfmonitor.tools.report import render_report

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.Monitor(config={"console": False}, run_dir=str(tmp_path), sinks=["jsonl", "tensorboard"]).attach(
        model, opt
    )
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for s in range(8):
        opt.zero_grad()
        out = model(x)
        lv = ((out - y) ** 2).mean()
        lt = out.abs().mean() * (float("nan") if s == 3 else 1.0)
        loss = mon.combine({"vision": lv, "text": lt}, weights={"vision": 0.5, "text": 0.5})
        loss.backward()
        opt.step()
    mon.detach()
    kinds = [(e.step, e.kind) for e in mon.events]
    assert (3, "nonfinite_loss") in kinds

    ea = _load(str(tmp_path / "tensorboard"))
    scalars = ea.Tags()["scalars"]
    assert {"loss/total", "loss/vision", "loss_weight/text", "grad_norm/total"} <= set(scalars)
    assert [e.step for e in ea.Scalars("grad_norm/total")] == list(range(8))
    assert math.isnan({e.step: e.value for e in ea.Scalars("loss/total")}[3])
    md = ea.Tensors("events/nonfinite_loss/text_summary")[0]
    assert md.step == 3 and "skip_step" in md.tensor_proto.string_val[0].decode()

    page = open(render_report(str(tmp_path)), encoding="utf-8").read()
    assert "nonfinite_loss" in page and "skip_step" in page


def test_unwritable_log_dir_warns_once_and_training_goes_on(tmp_path):
    """TensorBoard cannot write (a file where its folder should be): one warning, run continues."""
    torch = pytest.importorskip("torch")
    import warnings

    import sfmonitor
    from sfmonitor.sinks.jsonl import read_jsonl

    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sinks = [TensorBoardSink(log_dir=str(blocker / "tb")), "jsonl"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = sfmonitor.Monitor(config={"console": False}, run_dir=str(tmp_path / "run"), sinks=sinks).attach(
            model, opt
        )
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(4, 3)).pow(2).mean().backward()
            opt.step()
        mon.detach()
    msgs = [str(w.message) for w in caught if "'tensorboard'" in str(w.message)]
    assert len(msgs) == 1 and "training goes on" in msgs[0]
    assert mon.step == 5
    assert [r["step"] for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == list(range(5))
