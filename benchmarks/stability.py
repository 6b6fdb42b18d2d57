"""Stability benchmark: N seeds x {bare, monitored} of a reference config, as a markdown table.

    python benchmarks/stability.py --config trap --seeds 20 --jobs 2
    python benchmarks/stability.py --config trap --seeds 8 --modes bare --set model.qk_init_gain=14

Each run is its own process (``python -m reference_model.train ... --no-progress``, one thread);
its final JSON line is parsed. Prints one row per run, then a summary per mode: diverged count,
first-NaN epochs, mean final Top-1, mean val loss, mean seconds. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _checkout  # this checkout's code, in the runs too

ROOT = _checkout.ROOT


def run_one(
    config: str,
    seed: int,
    monitor: bool,
    sets: list[str],
    run_root: str | None,
    epochs: int | None,
    monitor_config: str | None = None,
) -> dict:
    cmd = _checkout.command(
        "reference_model.train",
        "--config",
        config,
        "--seed",
        str(seed),
        "--monitor" if monitor else "--no-monitor",
        "--no-progress",
    )
    for s in sets:
        cmd += ["--set", s]
    if epochs:
        cmd += ["--epochs", str(epochs)]
    if monitor and monitor_config:
        cmd += ["--monitor-config", monitor_config]
    if run_root:
        cmd += ["--run-dir", os.path.join(run_root, f"{'mon' if monitor else 'bare'}-seed{seed}")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        result = {"seed": seed, "monitor": monitor, "error": (proc.stderr or proc.stdout)[-400:]}
    else:
        result = json.loads(lines[-1])
    print(json.dumps(result), file=sys.stderr, flush=True)  # progress, one line per finished run
    return result


def _num(v) -> float:
    return v if isinstance(v, (int, float)) else float("nan")


def table(results: list[dict]) -> str:
    out = [
        "| mode | seed | diverged | first NaN epoch | final Top-1 | val loss | seconds | events | actions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mode = "monitored" if r.get("monitor") else "bare"
        if "error" in r:
            out.append(f"| {mode} | {r['seed']} | error | | | | | {r['error'][-80:]!r} | |")
            continue
        out.append(
            f"| {mode} | {r['seed']} | {'yes' if r['diverged'] else 'no'} | "
            f"{r['first_nan_epoch'] or '-'} | {r['final_top1']:.3f} | {r['val_loss']} | "
            f"{r['seconds']} | {json.dumps(r['events'])} | {json.dumps(r['actions'])} |"
        )
    out += [
        "",
        "| mode | runs | diverged | first NaN epochs | mean Top-1 | mean val loss (finite) | mean seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, flag in (("bare", False), ("monitored", True)):
        rs = [r for r in results if bool(r.get("monitor")) == flag and "error" not in r]
        if not rs:
            continue
        nan_epochs = sorted(r["first_nan_epoch"] for r in rs if r["first_nan_epoch"])
        finite = [_num(r["val_loss"]) for r in rs if math.isfinite(_num(r["val_loss"]))]
        out.append(
            f"| {mode} | {len(rs)} | {sum(r['diverged'] for r in rs)}/{len(rs)} | "
            f"{', '.join(map(str, nan_epochs)) or '-'} | "
            f"{statistics.mean(r['final_top1'] for r in rs):.3f} | "
            f"{statistics.mean(finite) if finite else float('nan'):.3f} | "
            f"{statistics.mean(r['seconds'] for r in rs):.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="trap")
    p.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1 (default 20)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="parallel training processes (default 2)")
    p.add_argument("--modes", default="bare,monitored", help="comma list of bare, monitored")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument(
        "--monitor-config",
        default=None,
        help="sfmonitor YAML for the monitored runs (default: the trainer's, reference_model/configs/monitor.yaml)",
    )
    p.add_argument("--run-root", default=None, help="keep each run's logs under this folder")
    p.add_argument("--json", default=None, help="also write all results to this JSON file")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("bare", "monitored")]
    if bad or args.seeds < 1 or args.jobs < 1:
        p.error(f"--modes takes bare,monitored (got {bad}); --seeds and --jobs must be >= 1")
    jobs = [
        (args.config, s, m == "monitored", args.set, args.run_root, args.epochs, args.monitor_config)
        for m in modes
        for s in range(args.first_seed, args.first_seed + args.seeds)
    ]
    with ThreadPoolExecutor(max_workers=args.jobs) as ex:
        results = list(ex.map(lambda j: run_one(*j), jobs))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    print(f"config {args.config}, overrides {args.set or 'none'}; code: {_checkout.describe()}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
