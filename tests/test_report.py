"""HTML run report: normal run, NaN/rescue story, cut JSONL, errors, CLI."""
from __future__ import annotations

import base64
import html
import math
import os
import re

import pytest

from sfmonitor.events import Event
from sfmonitor.sinks.jsonl import EVENTS_FILE, METRICS_FILE, JsonlSink
from sfmonitor.tools import report

pytest.importorskip("matplotlib")

GROUPS = ("vision", "text", "fusion")
WEIGHTS = {"vision": 0.4, "text": 0.3, "fusion": 0.3}


def synthetic_stats(s: int, nan_step: int = 140) -> dict[str, float]:
    """One step of a late-fusion run whose fusion attention creeps to the fp16 limit."""
    rescued = s > nan_step
    decay = math.exp(-s / 80)
    comps = {"vision": 1.2 * decay + 0.3, "text": 1.5 * decay + 0.4, "fusion": 2.0 * decay + 0.5}
    stats: dict[str, float] = {}
    for c, v in comps.items():
        stats[f"loss/{c}"] = v
        stats[f"loss_weight/{c}"] = WEIGHTS[c]
    stats["loss/total"] = sum(WEIGHTS[c] * v for c, v in comps.items())
    stats["loss_ratio/vision/text"] = comps["vision"] / comps["text"]
    for i, g in enumerate(GROUPS):
        stats[f"grad_norm/{g}"] = 0.5 + 0.2 * i + (3.0 if s == 60 and g == "text" else 0.0)
        stats[f"param_norm/{g}"] = 10.0 + 0.01 * s
        stats[f"update_ratio/{g}"] = (2e-4 if rescued else 1e-3) * (1 + 0.1 * i)
    stats["grad_norm/total"] = math.sqrt(sum(stats[f"grad_norm/{g}"] ** 2 for g in GROUPS))
    stats["amp/loss_scale"] = 65536.0 / 2 ** max(0, min(s, nan_step) - 120) if s >= 120 else 65536.0
    stats["amp/skipped_steps"] = float(max(0, min(s, nan_step) - 119))
    stats["lr/0"] = 3e-4 * (0.2 if rescued else 1.0)
    stats["act_absmax/fusion"] = 900.0 if rescued else 1200.0 * 1.03 ** s
    stats["act_absmax/text"] = 40.0
    if s == nan_step:
        stats["loss/total"] = math.nan
        stats["loss/fusion"] = math.nan
        stats["grad_norm/total"] = math.inf
        stats["grad_norm/fusion"] = math.nan
    return stats


STORY_EVENTS = [
    Event(60, "grad_spike", "grad_norm/text 3.5 > 1.9 (z=4.1 over the last 50 steps)",
          {"group": "text", "value": 3.5, "z": 4.1}, []),
    Event(121, "activation_overflow", "act_absmax/fusion 4.5e4 is 69% of the fp16 limit in fusion",
          {"module": "fusion", "value": 45000.0, "limit": 65504.0}, []),
    Event(140, "nonfinite_loss", "loss/total is nan at step 140; first non-finite component fusion",
          {"component": "fusion", "loss": math.nan},
          ["skip_step", "rollback", "lr_drop", "precision_fallback"]),
]


def write_run(run_dir, steps: int = 200, events=STORY_EVENTS) -> None:
    sink = JsonlSink()
    sink.open(str(run_dir), {})
    for s in range(steps):
        sink.log_metrics(s, synthetic_stats(s))
        for ev in events:
            if ev.step == s:
                sink.log_event(ev)
    sink.close()


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)]


def test_story_report_is_self_contained_and_holds_events(tmp_path):
    write_run(tmp_path)
    out = report.render_report(tmp_path)
    assert out == os.path.join(str(tmp_path), report.REPORT_FILE)
    page = open(out, encoding="utf-8").read()
    imgs = _images(page)
    assert len(imgs) == len(report.PANELS)  # every panel has data in this run
    assert all(img.startswith(b"\x89PNG") and len(img) > 5000 for img in imgs)
    assert "http://" not in page and "https://" not in page and "<script" not in page
    for ev in STORY_EVENTS:
        assert html.escape(ev.message) in page
    assert "skip_step, rollback, lr_drop, precision_fallback" in page
    assert page.count("<tr class='act'>") == 1          # one event with actions
    assert "non-finite loss or gradient norm at step 140" in page
    assert "cut line" not in page
    assert "<td>rollback</td><td>1</td>" in page        # action counts


def test_events_are_drawn_on_the_charts(tmp_path):
    """The event lines change the pixels: same metrics with and without events differ."""
    a, b = tmp_path / "with", tmp_path / "without"
    write_run(a, steps=80)
    write_run(b, steps=80, events=[])
    run_a, run_b = report.load_run(str(a)), report.load_run(str(b))
    panel = report.PANELS[1]  # gradient norm by group
    assert report._panel_png(panel, run_a) != report._panel_png(panel, run_b)
    page = report.build_html(run_b)
    assert "no events: a quiet run" in page


def test_cut_last_line_is_tolerated_and_flagged(tmp_path):
    write_run(tmp_path, steps=70, events=STORY_EVENTS[:1])
    with open(tmp_path / METRICS_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"step": 70, "time": 1.0, "loss/total": 0.7')   # the crash
    with open(tmp_path / EVENTS_FILE, "a", encoding="utf-8") as fh:
        fh.write('{"step": 70, "kind": "nonfinite_gr')
    run = report.load_run(str(tmp_path))
    assert run["steps"] == list(range(70))
    assert run["cut"] == [METRICS_FILE, EVENTS_FILE]
    out = report.render_report(str(tmp_path), tmp_path / "sub" / "r.html")
    page = open(out, encoding="utf-8").read()
    assert "metrics.jsonl ends in a cut line" in page and "events.jsonl ends in a cut line" in page
    assert html.escape(STORY_EVENTS[0].message) in page


def test_partial_run_draws_only_what_it_has(tmp_path):
    sink = JsonlSink(str(tmp_path))
    for s in range(10):
        sink.log_metrics(s, {"loss/total": 1.0 / (s + 1), "grad_norm/total": 1.0})
    sink.close()
    page = open(report.render_report(str(tmp_path)), encoding="utf-8").read()
    assert len(_images(page)) == 2
    assert "not recorded in this run: Update ratio by group" in page


def test_errors_name_the_problem(tmp_path, capsys):
    with pytest.raises(report.ReportError, match="no metrics.jsonl"):
        report.render_report(tmp_path)
    assert report.main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text('{"step": 0, "loss/tot')
    with pytest.raises(report.ReportError, match="no complete metrics line"):
        report.render_report(tmp_path)
    with pytest.raises(report.ReportError, match="not a folder"):
        report.render_report(tmp_path / "nope")


def test_cli_writes_the_file(tmp_path, capsys):
    write_run(tmp_path, steps=30, events=[])
    out = tmp_path / "x.html"
    assert report.main([str(tmp_path), "-o", str(out)]) == 0
    assert out.exists() and str(out) in capsys.readouterr().out
    from sfmonitor import cli
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / report.REPORT_FILE).exists()
