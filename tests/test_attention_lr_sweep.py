"""A small run of benchmarks/lr_sweep.py (the LR sweep of docs/benchmarks.md) in the suite."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("lr_sweep", os.path.join(ROOT, "benchmarks", "lr_sweep.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lr_sweep"] = mod  # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


def test_stdlib_text_is_python_source(sweep):
    text = sweep.stdlib_text(5000)
    assert len(text) == 5000 and ("def " in text or "import " in text)
    ids, vocab = sweep.encode(text)
    assert vocab == 98 and int(ids.max()) < vocab


def test_small_sweep_three_arms(sweep, tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = "--layers 1 --d 32 --heads 2 --context 16 --batch 4 --steps 25 --warmup 3 --chars 30000 --eval-batches 2"
    # (the update-ratio ceiling would answer LR 0.3 first, with undo and an LR drop: off, to reach qk_clip)
    monitor = json.dumps(
        {"watch": {"attention": {"tau": 4.0}}, "detectors": {"update_ratio_spike": {"enabled": False}}}
    )
    rc = sweep.main([*argv.split(), "--lrs", "1e-4,0.3", "--json", str(out), "--monitor-config", monitor])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    by = {(r["arm"], r["lr"]): r for r in rows}
    assert len(rows) == 6
    low_bare, low_mon = by[("bare", 1e-4)], by[("monitored", 1e-4)]
    # a healthy LR: no event, no action, the monitored run is the bare run bit for bit
    assert low_mon["actions"] == {} and low_mon["val_loss"] == low_bare["val_loss"]
    assert low_bare["peak_logit"] < 4.0
    high_bare, high_mon = by[("bare", 0.3)], by[("monitored", 0.3)]
    assert high_bare["peak_logit"] > 4.0 and by[("qk_layernorm", 0.3)]["peak_logit"] < high_bare["peak_logit"]
    assert high_mon["actions"].get("qk_clip", 0) >= 1 and high_mon["first_clip_step"] is not None
    table = capsys.readouterr().out
    assert "LR sensitivity" in table and "| 0.3 |" in table
    assert sweep.sensitivity(rows, "bare") >= 0
