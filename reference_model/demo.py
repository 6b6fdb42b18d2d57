"""``make demo``: the trap config on one seed, bare and with the monitor, side by side.

    python -m reference_model.demo [--seed N] [--config trap] [--out runs/demo]

DEMO_SEED is a seed that diverges without the monitor (see docs/reference_model.md for the
calibration table). Logs: runs/demo/bare-seed<N>/ (checkpoint) and runs/demo/monitored-seed<N>/
(events.jsonl, metrics.jsonl, checkpoints/, bundles/ written by the monitor).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sfmonitor.sinks.jsonl import read_jsonl
from sfmonitor.tools.report import render_report

from .train import train

DEMO_SEED = 0  # diverges bare under configs/trap.yaml (calibration table in docs/reference_model.md)
ROWS = (
    "diverged",
    "first_nan_epoch",
    "final_top1",
    "val_loss",
    "nonfinite_microbatches",
    "skipped_steps",
    "loss_scale",
    "max_logit",
    "events",
    "actions",
    "seconds",
    "run_dir",
)


def side_by_side(bare: dict, monitored: dict) -> str:
    """A two-column markdown table of the result fields that tell the story."""
    out = ["| | without monitor | with monitor |", "|---|---|---|"]
    for k in ROWS:
        a, b = bare.get(k), monitored.get(k)
        fmt = lambda v: json.dumps(v) if isinstance(v, (dict, list)) else str(v)
        out.append(f"| {k} | {fmt(a)} | {fmt(b)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reference_model.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="trap")
    p.add_argument("--seed", type=int, default=DEMO_SEED)
    p.add_argument("--out", default=os.path.join("runs", "demo"))
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    args = p.parse_args(argv)
    dirs = {m: os.path.join(args.out, f"{m}-seed{args.seed}") for m in ("bare", "monitored")}
    print(f"[demo] {args.config}, seed {args.seed}: training without the monitor ...", flush=True)
    bare = train(args.config, seed=args.seed, monitor=False, run_dir=dirs["bare"], progress=args.progress)
    print("[demo] ... and with the monitor (sfmonitor.attach) ...", flush=True)
    mon = train(args.config, seed=args.seed, monitor=True, run_dir=dirs["monitored"], progress=args.progress)
    print()
    print(side_by_side(bare, mon))
    print()
    print("what the monitor did (events with actions; all events: events.jsonl):")
    for e in read_jsonl(os.path.join(dirs["monitored"], "events.jsonl")):
        if e["actions"]:
            print(f"  step {e['step']}: {e['kind']}: {e['message']} -> {', '.join(e['actions'])}")
    print()
    print(
        f"logs: {dirs['bare']}/ (checkpoint) and {dirs['monitored']}/ (events.jsonl, metrics.jsonl, "
        f"checkpoints/, bundles/)"
    )
    try:
        report = render_report(dirs["monitored"])
        print(f"report: {report} (the monitored run's charts, every event on the time axis)")
    except ImportError as e:  # matplotlib missing
        print(f"report: not rendered ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
