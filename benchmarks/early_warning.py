"""Early warning on the Superfusion trap: how long before the first non-finite value does the
monitor warn, when it only watches?

    python benchmarks/early_warning.py --config trap --seeds 8
    python benchmarks/early_warning.py --config stable --seeds 4      # false warnings?

Each seed runs the reference trainer with the monitor attached but every ladder emptied (events,
no actions: the run follows its bare trajectory; a non-finite step is skipped by the GradScaler
either way), one process at a time. From ``events.jsonl`` it reads, in optimizer steps:

* the first non-finite loss (``nonfinite_loss``), or none;
* the first ``attention_logit_growth`` event (a module's max logit passed ``watch.attention.tau``);
* the first ``activation_overflow`` warning that is not itself a non-finite value (|x| over
  ``warn_fraction`` of the fp16 limit, or the limit at most ``forecast_warn_steps`` steps away);

and prints the lead of each warning over the first non-finite loss. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _checkout  # this checkout's code, in the runs too

ROOT = _checkout.ROOT

from sfmonitor.registry import KINDS  # noqa: E402 - after the path
from sfmonitor.sinks.jsonl import read_jsonl  # noqa: E402

WATCH_ONLY = {"console": False, "policy": {"ladders": {k: {"rungs": []} for k in KINDS}}}


def first(events: list[dict], pred) -> int | None:
    return next((int(e["step"]) for e in events if pred(e)), None)


def run(config: str, seed: int, root: str, sets: list[str]) -> dict:
    run_dir = os.path.join(root, f"{config}-seed{seed}")
    cfg_path = os.path.join(root, "watch_only.json")
    with open(cfg_path, "w", encoding="utf-8") as fh:
        json.dump(WATCH_ONLY, fh)
    cmd = _checkout.command("reference_model.train", "--config", config, "--seed", str(seed), "--monitor")
    cmd += ["--monitor-config", cfg_path, "--run-dir", run_dir, "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"seed": seed, "error": (proc.stderr or proc.stdout)[-400:]}
    result = json.loads(lines[-1])
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    nan = first(events, lambda e: e["kind"] == "nonfinite_loss")
    attn = first(events, lambda e: e["kind"] == "attention_logit_growth")
    warn = first(events, lambda e: e["kind"] == "activation_overflow" and not e["data"].get("nonfinite"))
    out = {
        "seed": seed,
        "first_nonfinite_loss_step": nan,
        "first_attention_event_step": attn,
        "first_overflow_warning_step": warn,
        "lead_attention": nan - attn if nan is not None and attn is not None else None,
        "lead_overflow_warning": nan - warn if nan is not None and warn is not None else None,
        "overflow_warnings": sum(
            1 for e in events if e["kind"] == "activation_overflow" and not e["data"].get("nonfinite")
        ),
        "attention_events": sum(1 for e in events if e["kind"] == "attention_logit_growth"),
        "diverged": result.get("diverged"),
        "final_top1": result.get("final_top1"),
        "seconds": result.get("seconds"),
    }
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="trap")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--run-root", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    root = args.run_root or tempfile.mkdtemp(prefix="early_warning-")
    os.makedirs(root, exist_ok=True)
    rows = [run(args.config, s, root, args.set) for s in range(args.first_seed, args.first_seed + args.seeds)]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    print(
        "| seed | first non-finite loss (step) | first attention_logit_growth (lead) | "
        "first overflow warning (lead) | overflow warnings | final Top-1 |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['seed']} | error: {r['error'][-80:]!r} | | | | |")
            continue

        def lead(step, d):
            return "-" if step is None else f"{step}" + (f" ({d})" if d is not None else "")

        nan = r["first_nonfinite_loss_step"]
        print(
            f"| {r['seed']} | {nan if nan is not None else '-'} | "
            f"{lead(r['first_attention_event_step'], r['lead_attention'])} | "
            f"{lead(r['first_overflow_warning_step'], r['lead_overflow_warning'])} | "
            f"{r['overflow_warnings']} | {r['final_top1']} |"
        )
    ok = [r for r in rows if "error" not in r and r["first_nonfinite_loss_step"] is not None]
    for key, label in (("lead_attention", "attention_logit_growth"), ("lead_overflow_warning", "overflow warning")):
        hits = [r for r in ok if r[key] is not None and r[key] >= 50]
        print(f"\n{label}: warned >= 50 steps before the first non-finite loss on {len(hits)}/{len(ok)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
