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
    stats["act_absmax/fusion"] = 900.0 if rescued else 1200.0 * 1.03**s
    stats["act_absmax/text"] = 40.0
    if s == nan_step:
        stats["loss/total"] = math.nan
        stats["loss/fusion"] = math.nan
        stats["grad_norm/total"] = math.inf
        stats["grad_norm/fusion"] = math.nan
    return stats


STORY_EVENTS = [
    Event(
        60,
        "grad_spike",
        "grad_norm/text 3.5 > 1.9 (z=4.1 over the last 50 steps)",
        {"group": "text", "value": 3.5, "z": 4.1},
        [],
    ),
    Event(
        121,
        "activation_overflow",
        "act_absmax/fusion 4.5e4 is 69% of the fp16 limit in fusion",
        {"module": "fusion", "value": 45000.0, "limit": 65504.0},
        [],
    ),
    Event(
        140,
        "nonfinite_loss",
        "loss/total is nan at step 140; first non-finite component fusion",
        {"component": "fusion", "loss": math.nan},
        ["skip_step", "rollback", "lr_drop", "precision_fallback"],
    ),
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
    assert page.count("<tr class='act'>") == 1  # one event with actions
    assert "non-finite loss or gradient norm at step 140" in page
    assert "cut line" not in page
    assert "<td>rollback</td><td>1</td>" in page  # action counts


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
        fh.write('{"step": 70, "time": 1.0, "loss/total": 0.7')  # the crash
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


# --------------------------------------------------------------------------------------------
# Bad input: skipped lines are counted on the page; any bytes give a page or a ReportError
# --------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sfmonitor.sinks.jsonl import read_jsonl  # noqa: E402


def _fuzz(n: int):
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
    )


def _page(run_dir) -> str:
    return open(report.render_report(str(run_dir)), encoding="utf-8").read()


def test_invalid_utf8_a_non_object_line_and_a_null_step_are_skipped_and_counted(tmp_path):
    write_run(tmp_path, steps=20, events=STORY_EVENTS[:1])
    with open(tmp_path / METRICS_FILE, "ab") as fh:
        fh.write(b'{"step": 20, "loss/total": 0.5, "name": "\xff\xfe"}\n')  # not UTF-8
        fh.write(b"[1, 2, 3]\n")  # not an object
        fh.write(b'{"step": null, "loss/total": 0.5}\n')  # null step
        fh.write(b"garbage in the middle\n")
        fh.write(b'{"step": 21, "loss/total": 0.25}\n')
    with open(tmp_path / EVENTS_FILE, "ab") as fh:
        fh.write(b'{"step": null, "kind": "loss_spike"}\n"just a string"\n\xff\n')
        fh.write(b'{"step": 21, "kind": "loss_spike", "message": "m", "actions": "skip_step"}\n')
    run = report.load_run(str(tmp_path))
    assert run["steps"] == list(range(20)) + [21]
    assert run["bad_lines"] == {METRICS_FILE: 4, EVENTS_FILE: 3} and run["cut"] == []
    assert run["events"][-1]["actions"] == ["skip_step"]  # one action written as a string
    page = _page(tmp_path)
    assert "4 lines of metrics.jsonl could not be read and were skipped (lines 21, 22, 23, 24)" in page
    assert "3 lines of events.jsonl could not be read and were skipped" in page


def test_a_garbage_line_mid_file_is_not_dropped_silently(tmp_path):
    write_run(tmp_path, steps=5, events=[])
    lines = (tmp_path / METRICS_FILE).read_text().splitlines(keepends=True)
    lines.insert(2, '{"step": 2, "loss/tot\n')
    (tmp_path / METRICS_FILE).write_text("".join(lines))
    assert len(read_jsonl(str(tmp_path / METRICS_FILE))) == 5
    page = _page(tmp_path)
    assert "1 line of metrics.jsonl could not be read and was skipped (line 3)" in page


def test_a_non_numeric_metric_value_is_not_drawn_as_a_non_finite_loss(tmp_path):
    sink = JsonlSink(str(tmp_path))
    for s in range(6):
        sink.log_metrics(
            s, {"loss/total": 1.0 / (s + 1), "grad_norm/total": 1.0, "loss/extra": {"nested": 1} if s == 3 else 0.5}
        )
    sink.close()
    run = report.load_run(str(tmp_path))
    assert run["series"]["loss/extra"][0] == [0, 1, 2, 4, 5]  # step 3 left out, not NaN
    assert all(math.isfinite(v) for _, vals in run["series"].values() for v in vals)
    page = _page(tmp_path)
    assert "non-finite loss" not in page
    assert "1 value that is not a number was left out (loss/extra)" in page


def test_a_folder_in_place_of_a_log_is_a_report_error(tmp_path):
    (tmp_path / METRICS_FILE).mkdir()
    with pytest.raises(report.ReportError, match="metrics.jsonl"):
        report.render_report(tmp_path)
    assert report.main([str(tmp_path)]) == 2


def _page_or_report_error(run_dir):
    try:
        page = _page(run_dir)
    except report.ReportError:
        return None
    assert page.startswith("<!DOCTYPE html>")
    return page


@_fuzz(150)
@given(metrics=st.binary(max_size=600), events=st.binary(max_size=600))
@example(metrics=b'{"step": 0, "loss/total": 1}\n\xff\n', events=b"\xff\xfe")
@example(metrics=b'{"step": 1e400}\n', events=b"")
@example(metrics=b'{"step": ' + b"9" * 5000 + b"}\n", events=b"")
@example(metrics=b"[" * 5000 + b"\n", events=b"{" * 3)
@example(metrics=b'{"step": true, "loss/total": 1}\n{"step": -1, "loss/total": 1}\n', events=b"")
def test_any_bytes_as_the_logs_give_a_page_or_a_report_error(tmp_path, metrics, events):
    (tmp_path / METRICS_FILE).write_bytes(metrics)
    (tmp_path / EVENTS_FILE).write_bytes(events)
    _page_or_report_error(tmp_path)


_values = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["nan", "inf", "-inf"])
    | st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
_keys = st.sampled_from(
    [
        "loss/total",
        "loss/a",
        "loss_weight/a",
        "grad_norm/total",
        "grad_norm/$x$",
        "update_ratio/g",
        "amp/loss_scale",
        "amp/skipped_steps",
        "act_absmax/m",
        "lr/0",
        "loss_ratio/a/b",
        "time",
        "step",
    ]
) | st.text(max_size=5)
_records = st.lists(
    st.builds(
        lambda step, rest: {**rest, "step": step},
        st.integers(0, 1000) | _values,
        st.dictionaries(_keys, _values, max_size=6),
    ),
    min_size=1,
    max_size=8,
)
_events = st.lists(
    st.builds(
        lambda step, rest: {**rest, "step": step},
        st.integers(0, 1000) | _values,
        st.dictionaries(
            st.sampled_from(["kind", "message", "actions", "data"]),
            _values | st.lists(st.text(max_size=4), max_size=2),
            max_size=4,
        ),
    ),
    max_size=4,
)


@_fuzz(25)
@given(records=_records, events=_events)
def test_any_json_records_give_a_page_or_a_report_error(tmp_path, records, events):
    import json

    with open(tmp_path / METRICS_FILE, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    with open(tmp_path / EVENTS_FILE, "w", encoding="utf-8") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")
    _page_or_report_error(tmp_path)
