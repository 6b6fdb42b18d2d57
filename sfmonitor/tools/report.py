"""``sfmonitor report RUN_DIR [-o out.html]``: one self-contained HTML page telling a run's story.

Reads ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/events.jsonl`` (the JSONL sink's files; a cut last
line, as a crash leaves it, is tolerated and reported; a line that is not a UTF-8 JSON object with
a valid step -- a non-negative integer -- is skipped and counted on the page; a metric value that
is not a number is left out of its chart, not drawn as NaN, and counted) and draws, against the
optimizer step:

- loss components (with their weights on a second axis),
- gradient norm by group, update ratio by group (log scale),
- loss scale (log2) with the GradScaler's skipped steps,
- activation max by module, with the fp16 limit 65504,
- loss and gradient ratios between components, learning rate (when the run logged them),

with every event as a vertical line (red: an action was taken; amber: reported only) and every
non-finite value as an ``x`` on the top edge of its chart; then a table of events and actions.
Plots are PNGs embedded as base64: the file needs nothing else to open. matplotlib is imported
only here (``pip install 'sfmonitor[report]'``), without pyplot, so no global backend changes.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..events import SFMonitorError
from ..sinks.jsonl import EVENTS_FILE, METRICS_FILE, scan_jsonl

INSTALL_HINT = "pip install 'sfmonitor[report]'"
REPORT_FILE = "report.html"  # default output: RUN_DIR/report.html
FP16_MAX = 65504.0  # largest finite float16: activations above it overflow to inf
MAX_LEGEND = 12  # series named in a legend; the rest are drawn unnamed
MAX_TABLE_EVENTS = 2000  # rows of the events table (the counts above it cover all)
ACTION_COLOR = "#d62728"  # event that triggered an action
REPORTED_COLOR = "#ff9f1c"  # event reported only
NON_RECORD_KEYS = ("step", "time")
MAX_STEP = 2**53  # steps beyond this are no optimizer steps (and lose precision)
MAX_LISTED = 20  # line numbers / keys named in a warning
TOTAL_SUFFIX = "/total"  # loss/total, grad_norm/total: drawn black and thicker


@dataclass(frozen=True)
class Panel:
    """One chart: the keys it draws (by prefix), its scale, and a second-axis series."""

    title: str
    prefixes: tuple[str, ...]
    log: bool = False
    log2: bool = False
    twin_prefixes: tuple[str, ...] = ()  # drawn dashed on a right-hand axis
    twin_label: str = ""
    hline: tuple[float, str] | None = None  # (value, label) reference line


PANELS = (
    Panel("Loss components", ("loss/",), twin_prefixes=("loss_weight/",), twin_label="loss weight"),
    Panel("Gradient norm by group", ("grad_norm/",), log=True),
    Panel("Update ratio by group (|dθ| / |θ| per step)", ("update_ratio/",), log=True),
    Panel(
        "Loss scale and skipped steps",
        ("amp/loss_scale",),
        log2=True,
        twin_prefixes=("amp/skipped_steps",),
        twin_label="skipped steps (cumulative)",
    ),
    Panel("Activation max by module", ("act_absmax/",), log=True, hline=(FP16_MAX, "fp16 max 65504")),
    Panel("Loss and gradient ratios between components", ("loss_ratio/", "grad_ratio/"), log=True),
    Panel("Learning rate", ("lr/",), log=True),
)


class ReportError(SFMonitorError, ValueError):
    """The run folder cannot be reported on; the message says why."""


def _float(v: Any) -> float | None:
    """A metric value as a float; None when it is not a number (a dict, a list, null, a bool, a
    string other than a number such as "nan"/"inf" as the JSONL sink writes them)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:  # an integer too large for a float
            return None
    if isinstance(v, str):
        try:
            return float(v)  # "nan", "inf", "-inf" as the JSONL sink writes them
        except ValueError:
            return None
    return None


def _step(v: Any) -> int | None:
    """A record's step: a non-negative integer (an integral float is accepted); else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and 0 <= v < MAX_STEP:
        return v
    return None


def _actions(v: Any) -> list[str] | None:
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list):
        return [str(a) for a in v]
    return None


def _scan(path: str):
    try:
        return scan_jsonl(path)
    except OSError as e:
        raise ReportError(f"cannot read {path!r}: {e}") from e


def load_run(run_dir: str) -> dict[str, Any]:
    """The run's metrics as series {key: (steps, values)}, its events, what was cut, and what
    was skipped: ``bad_lines`` {file: count}, ``bad_line_numbers`` {file: [line, ...]} (lines
    that are not a UTF-8 JSON object with a valid step, or an event whose actions are not a
    list), ``non_numeric`` {key: count} (metric values that are not numbers, left out)."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir!r} is not a folder")
    mpath = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(mpath):
        raise ReportError(
            f"{run_dir!r} has no {METRICS_FILE}: not a run folder written by the "
            f"JSONL sink (Monitor(run_dir=..., sinks=['jsonl']))"
        )
    epath = os.path.join(run_dir, EVENTS_FILE)
    mscan, escan = _scan(mpath), _scan(epath)
    bad: dict[str, list[int]] = {METRICS_FILE: list(mscan.bad_lines), EVENTS_FILE: list(escan.bad_lines)}
    series: dict[str, tuple[list[int], list[float]]] = {}
    non_numeric: Counter[str] = Counter()
    steps: list[int] = []
    times: list[float] = []
    for rec, lineno in zip(mscan.records, mscan.lines):
        step = _step(rec.get("step"))
        if step is None:
            bad[METRICS_FILE].append(lineno)
            continue
        steps.append(step)
        t = _float(rec.get("time"))
        if t is not None and math.isfinite(t):
            times.append(t)
        for key, value in rec.items():
            if key in NON_RECORD_KEYS:
                continue
            v = _float(value)
            if v is None:
                non_numeric[key] += 1
                continue
            s_list, v_list = series.setdefault(key, ([], []))
            s_list.append(step)
            v_list.append(v)
    if not steps:
        skipped = len(bad[METRICS_FILE])
        raise ReportError(
            f"{mpath!r} holds no complete metrics line"
            + (f" ({skipped} line{'s' if skipped != 1 else ''} could not be read)" if skipped else "")
        )
    events = []
    for ev, lineno in zip(escan.records, escan.lines):
        step, actions = _step(ev.get("step")), _actions(ev.get("actions"))
        if step is None or actions is None:
            bad[EVENTS_FILE].append(lineno)
            continue
        events.append({**ev, "step": step, "actions": actions})
    return {
        "run_dir": run_dir,
        "series": series,
        "events": events,
        "steps": steps,
        "times": times,
        "cut": [name for name, sc in ((METRICS_FILE, mscan), (EVENTS_FILE, escan)) if sc.cut],
        "bad_lines": {name: len(v) for name, v in bad.items() if v},
        "bad_line_numbers": {name: sorted(v) for name, v in bad.items() if v},
        "non_numeric": dict(non_numeric),
    }


def _keys_for(series: dict, prefixes: tuple[str, ...]) -> list[str]:
    """The series under the prefixes, ``.../total`` first (drawn black), then as logged."""
    keys = [k for k in series if any(k.startswith(p) for p in prefixes)]
    return sorted(keys, key=lambda k: not k.endswith(TOTAL_SUFFIX))


def _mark_events(ax, events: list[dict]) -> None:
    for ev in events:
        ax.axvline(
            ev["step"],
            color=ACTION_COLOR if ev["actions"] else REPORTED_COLOR,
            lw=1.1 if ev["actions"] else 0.8,
            ls="-" if ev["actions"] else "--",
            alpha=0.75,
            zorder=0,
        )


def _draw_series(ax, series: dict, keys: list[str], style: str = "-", named: bool = True) -> list:
    """Plot the keys; non-finite points become x marks on the top edge. Returns the lines."""
    lines = []
    for i, key in enumerate(keys):
        steps, values = series[key]
        finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
        label = key.replace("$", r"\$") if named and i < MAX_LEGEND else None  # no mathtext
        if finite:
            xs, ys = zip(*finite)
            # Break the line where a value is missing or non-finite, so a NaN shows as a gap.
            ys_gapped = [v if math.isfinite(v) else math.nan for v in values]
            total = {"color": "black", "lw": 1.7} if key.endswith(TOTAL_SUFFIX) else {"lw": 1.2}
            (ln,) = ax.plot(steps, ys_gapped, style, label=label, **total)
            if len(xs) == 1:
                ax.plot(xs, ys, "o", ms=3, color=ln.get_color())
        else:
            (ln,) = ax.plot([], [], style, label=label)
        bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
        if bad:
            ax.plot(
                bad,
                [0.98] * len(bad),
                "x",
                color=ln.get_color(),
                ms=7,
                mew=2,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
            )
        lines.append(ln)
    return lines


def _positive(series: dict, keys: list[str]) -> bool:
    return any(math.isfinite(v) and v > 0 for k in keys for v in series[k][1])


def _panel_png(panel: Panel, run: dict[str, Any]) -> str | None:
    """The panel as a base64 PNG, or None when the run logged none of its keys."""
    series = run["series"]
    keys = _keys_for(series, panel.prefixes)
    twin_keys = _keys_for(series, panel.twin_prefixes)
    if not keys and not twin_keys:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as e:
        raise ImportError(f"sfmonitor report needs matplotlib: {INSTALL_HINT} ({e})") from e
    fig = Figure(figsize=(11, 3.6), dpi=96)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _mark_events(ax, run["events"])
    handles = _draw_series(ax, series, keys)
    if panel.log2 and _positive(series, keys):
        ax.set_yscale("log", base=2)
    elif panel.log and _positive(series, keys):
        ax.set_yscale("log")
    if panel.hline is not None and keys:
        ax.axhline(panel.hline[0], color="black", lw=0.8, ls=":")
        ax.text(
            0.005, panel.hline[0], " " + panel.hline[1], transform=ax.get_yaxis_transform(), va="bottom", fontsize=7
        )
    if twin_keys:
        ax2 = ax.twinx()
        ax2.set_prop_cycle(color=["#7f7f7f", "#8c564b", "#e377c2", "#17becf", "#bcbd22"])
        handles += _draw_series(ax2, series, twin_keys, style="--")
        ax2.set_ylabel(panel.twin_label, fontsize=8)
        ax2.tick_params(which="both", labelsize=7)
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_xlabel("optimizer step", fontsize=8)
    ax.tick_params(which="both", labelsize=7)
    ax.grid(True, alpha=0.25)
    extra = []
    if run["events"]:
        if any(e["actions"] for e in run["events"]):
            extra.append(Line2D([], [], color=ACTION_COLOR, lw=1.1, label="event + action"))
        if any(not e["actions"] for e in run["events"]):
            extra.append(Line2D([], [], color=REPORTED_COLOR, lw=0.8, ls="--", label="event (reported)"))
    if any(not math.isfinite(v) for k in keys + twin_keys for v in series[k][1]):
        extra.append(Line2D([], [], color="black", marker="x", ls="", label="non-finite value"))
    named = [h for h in handles if h.get_label() and not h.get_label().startswith("_")]
    ax.legend(
        handles=named + extra,
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.09 if twin_keys else 1.01, 1.0),
        borderaxespad=0.0,
        frameon=False,
    )
    fig.subplots_adjust(left=0.07, right=0.74, top=0.88, bottom=0.15)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:24px 0 8px}
.meta{color:#555;font-size:13px} .warn{background:#fff3cd;border:1px solid #e0c36a;padding:8px;
margin:10px 0;font-size:13px} table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4} tr.act td{background:#fdecec} img{max-width:100%;display:block;margin:6px 0}
.counts td{min-width:60px} .missing{color:#777;font-size:12px} code{font-size:11px}
"""


def _counts_table(title: str, counts: Counter) -> str:
    if not counts:
        return f"<p class='meta'>{html.escape(title)}: none</p>"
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{n}</td></tr>" for k, n in counts.most_common())
    return f"<table class='counts'><tr><th>{html.escape(title)}</th><th>count</th></tr>{rows}</table>"


def _event_rows(events: list[dict]) -> str:
    rows = []
    for ev in events[:MAX_TABLE_EVENTS]:
        data = json.dumps(ev.get("data") or {}, sort_keys=True)
        if len(data) > 400:
            data = data[:400] + " ..."
        cls = " class='act'" if ev["actions"] else ""
        rows.append(
            f"<tr{cls}><td>{ev['step']}</td><td>{html.escape(str(ev.get('kind', '')))}</td>"
            f"<td>{html.escape(str(ev.get('message', '')))}</td>"
            f"<td>{html.escape(', '.join(map(str, ev['actions']))) or '-'}</td>"
            f"<td><code>{html.escape(data)}</code></td></tr>"
        )
    more = ""
    if len(events) > MAX_TABLE_EVENTS:
        more = f"<p class='meta'>... and {len(events) - MAX_TABLE_EVENTS} more events (see events.jsonl)</p>"
    return (
        "<table><tr><th>step</th><th>kind</th><th>message (cause)</th><th>actions</th>"
        f"<th>data</th></tr>{''.join(rows)}</table>{more}"
    )


def _last_finite(series: dict, key: str) -> str:
    if key not in series:
        return "-"
    vals = [v for v in series[key][1] if math.isfinite(v)]
    return f"{vals[-1]:.4g}" if vals else "non-finite"


def build_html(run: dict[str, Any]) -> str:
    """The report page for a run loaded with ``load_run``."""
    events = run["events"]
    steps = run["steps"]
    name = os.path.basename(os.path.abspath(run["run_dir"]))
    kinds = Counter(str(e.get("kind", "")) for e in events)
    actions = Counter(a for e in events for a in e["actions"])
    parts = [f"<h1>sfmonitor run report: {html.escape(name)}</h1>"]
    span = ""
    if len(run["times"]) >= 2 and run["times"][-1] - run["times"][0] >= 0.05:
        span = f", {run['times'][-1] - run['times'][0]:.1f} s of training"
    parts.append(
        f"<p class='meta'>{html.escape(os.path.abspath(run['run_dir']))}<br>"
        f"{len(steps)} logged steps (optimizer steps {min(steps)}..{max(steps)}){span}; "
        f"{len(events)} events, {sum(actions.values())} actions; "
        f"final loss/total {_last_finite(run['series'], 'loss/total')}, "
        f"grad_norm/total {_last_finite(run['series'], 'grad_norm/total')}<br>"
        f"generated {time.strftime('%Y-%m-%d %H:%M:%S')}</p>"
    )
    for fname in run["cut"]:
        parts.append(
            f"<div class='warn'>{html.escape(fname)} ends in a cut line: the run stopped "
            f"while writing it (crash or kill). The report shows everything up to the last "
            f"complete line.</div>"
        )
    for fname, numbers in run.get("bad_line_numbers", {}).items():
        n = len(numbers)
        listed = ", ".join(map(str, numbers[:MAX_LISTED])) + (" ..." if n > MAX_LISTED else "")
        parts.append(
            f"<div class='warn'>{n} line{'s' if n != 1 else ''} of {html.escape(fname)} "
            f"could not be read and {'were' if n != 1 else 'was'} skipped "
            f"(line{'s' if n != 1 else ''} {listed}): not a UTF-8 JSON object with a "
            f"valid step. Everything else is shown.</div>"
        )
    non_numeric = run.get("non_numeric") or {}
    if non_numeric:
        n = sum(non_numeric.values())
        keys = sorted(non_numeric)
        listed = ", ".join(keys[:MAX_LISTED]) + (" ..." if len(keys) > MAX_LISTED else "")
        parts.append(
            f"<div class='warn'>{n} value{'s' if n != 1 else ''} that "
            f"{'are' if n != 1 else 'is'} not {'numbers' if n != 1 else 'a number'} "
            f"{'were' if n != 1 else 'was'} left out ({html.escape(listed)}).</div>"
        )
    nonfinite = sorted(
        {
            s
            for k in ("loss/total", "grad_norm/total")
            if k in run["series"]
            for s, v in zip(*run["series"][k])
            if not math.isfinite(v)
        }
    )
    if nonfinite:
        shown = ", ".join(map(str, nonfinite[:20])) + (" ..." if len(nonfinite) > 20 else "")
        parts.append(
            f"<div class='warn'>non-finite loss or gradient norm at "
            f"step{'s' if len(nonfinite) > 1 else ''} {shown}</div>"
        )
    parts.append(
        "<div style='display:flex;gap:24px;flex-wrap:wrap'>"
        f"{_counts_table('event kind', kinds)}{_counts_table('action', actions)}</div>"
    )
    parts.append(
        "<h2>Charts</h2><p class='meta'>x axis: optimizer step. Vertical lines: events "
        "(solid red: an action was taken; dashed amber: reported only). x on the top edge: "
        "a non-finite value (NaN/inf) of that series.</p>"
    )
    missing = []
    for panel in PANELS:
        png = _panel_png(panel, run)
        if png is None:
            missing.append(panel.title)
            continue
        parts.append(f"<img alt='{html.escape(panel.title)}' src='data:image/png;base64,{png}'>")
    if missing:
        parts.append(f"<p class='missing'>not recorded in this run: {html.escape('; '.join(missing))}</p>")
    parts.append(f"<h2>Events and actions ({len(events)})</h2>")
    parts.append(_event_rows(events) if events else "<p class='meta'>no events: a quiet run</p>")
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>sfmonitor report: {html.escape(name)}</title><style>{CSS}</style></head>"
        f"<body>{''.join(parts)}</body></html>"
    )


def render_report(run_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> str:
    """Write the HTML report of ``run_dir`` (default ``run_dir/report.html``); return its path.

    Raises ReportError when the folder has no (complete) ``metrics.jsonl``.
    """
    run_dir = os.fspath(run_dir)
    run = load_run(run_dir)
    page = build_html(run)
    out = os.fspath(out_path) if out_path is not None else os.path.join(run_dir, REPORT_FILE)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sfmonitor report", description="Render RUN_DIR's JSONL logs as one HTML file."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="folder holding metrics.jsonl and events.jsonl")
    parser.add_argument("-o", "--output", default=None, help=f"output HTML file (default: RUN_DIR/{REPORT_FILE})")
    args = parser.parse_args(argv)
    try:
        path = render_report(args.run_dir, args.output)
    except (ReportError, ImportError, OSError) as e:
        print(f"sfmonitor report: error: {e}", file=sys.stderr)
        return 2
    print(f"sfmonitor report: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
