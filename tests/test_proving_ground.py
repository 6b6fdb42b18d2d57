"""The proving ground, small: the reference trap, pushed so far that it always overflows
(qk_init_gain 100, 256 pairs, 2 epochs), diverges bare and finishes with the monitor at its
defaults. The 20-seed calibrated version is benchmarks/stability.py (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import os

import pytest

from reference_model.train import train
from sfmonitor.replay import replay_bundle
from sfmonitor.sinks.jsonl import read_jsonl

FAST_TRAP = {"model.qk_init_gain": 100.0, "data.n_train": 256, "data.n_val": 128, "train.epochs": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pg")
    bare = train("trap", seed=0, monitor=False, overrides=FAST_TRAP)
    mon = train(
        "trap", seed=0, monitor=True, run_dir=str(root / "mon"), overrides=FAST_TRAP, monitor_config={"console": False}
    )
    return bare, mon, root / "mon"


def test_the_trap_diverges_bare_from_a_real_overflow(runs):
    bare, _, _ = runs
    assert bare["first_nan_epoch"] == 1
    assert not math.isfinite(bare["val_loss"]) if isinstance(bare["val_loss"], float) else bare["val_loss"] == "nan"
    assert bare["max_logit"] in ("inf", float("inf")) or bare["max_logit"] > 65504


def test_the_monitor_finishes_the_same_run(runs):
    _, mon, run_dir = runs
    assert isinstance(mon["val_loss"], float) and math.isfinite(mon["val_loss"])
    # the cause is treated first: QK-Clip on the fusion attention's W_q/W_k; fp32 attention
    # (precision_fallback) stays the last resort, on fusion if ever
    assert mon["actions"].get("qk_clip", 0) >= 1
    assert mon["actions"].get("precision_fallback", 0) <= 1
    events = read_jsonl(os.path.join(run_dir, "events.jsonl"))
    clipped = [e for e in events if "qk_clip" in e["actions"]]
    assert clipped and all(e["data"]["action_results"]["qk_clip"]["module"] == "fusion" for e in clipped)
    fallback = [e for e in events if "precision_fallback" in e["actions"]]
    assert all(e["kind"] == "activation_overflow" and e["data"]["module"] == "fusion" for e in fallback)
    # a non-finite step never reached the weights: every one of them was skipped
    assert all(
        e["actions"] == ["skip_step"] or e["data"].get("skipped_by") == "grad_scaler"
        for e in events
        if e["kind"] in ("nonfinite_loss", "nonfinite_grad") and e["actions"] != []
    )
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert metrics and all(k in metrics[-1] for k in ("grad_norm/fusion", "loss/fusion", "amp/loss_scale"))


def test_the_anomaly_bundle_replays_with_the_built_in_factory(runs):
    _, _, run_dir = runs
    bundles = sorted(os.listdir(os.path.join(run_dir, "bundles")))
    nan_bundle = next(b for b in bundles if b.endswith("nonfinite_loss") or b.endswith("activation_overflow"))
    report = replay_bundle(os.path.join(run_dir, "bundles", nan_bundle))
    assert report["reproduced"], json.dumps(report, default=str)[:500]
