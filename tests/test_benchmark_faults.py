"""A small run of benchmarks/faults.py (the fault-and-health table of docs/benchmarks.md) in the suite:
one tiny model, two scenarios, through the benchmark's own functions."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def faults():
    spec = importlib.util.spec_from_file_location("faults", os.path.join(ROOT, "benchmarks", "faults.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = mod  # dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rows(faults, tmp_path_factory):
    opts = faults.Options(steps=30, isolate=False, root=str(tmp_path_factory.mktemp("runs")))
    cache: dict = {}
    return {s: faults.run_scenario("gpt", s, opts, cache) for s in ("fault_free", "nan_batch")}


def test_rows_have_the_measurements(faults, rows):
    keys = {
        "model",
        "scenario",
        "steps",
        "eval_ratio",
        "train_ratio",
        "identical",
        "lost",
        "thrown_away",
        "actions",
        "kinds",
        "stopped",
        "peak_rss_mib",
        "step_time_ratio",
        "misses",
    }
    for row in rows.values():
        assert keys <= set(row), keys - set(row)
        assert row["model"] == "gpt" and row["steps"] == 30
        assert row["peak_rss_mib"] > 0 and row["step_time_ratio"] > 0
        assert set(row["thrown_away"]) == {"lost", "undone", "skipped", "left_out", "repeated"}
    table = faults.table(list(rows.values())).splitlines()
    assert len(table) == 2 + len(rows) and all(line.count("|") == table[0].count("|") for line in table)
    merged = faults.aggregate([rows["nan_batch"], {**rows["nan_batch"], "seeds": [1]}])
    assert len(merged) == 1 and merged[0]["seeds"] == [0, 1]
    assert merged[0]["actions"]["skip_step"] == 2 * rows["nan_batch"]["actions"]["skip_step"]


def test_seeds_merge_when_one_leaves_a_text_field_empty(faults, rows):
    seen = {**rows["nan_batch"], "detected_kind": "update_ratio_spike", "seeds": [1]}
    merged = faults.aggregate([{**rows["nan_batch"], "detected_kind": None}, seen])
    assert merged[0]["detected_kind"] == "update_ratio_spike" and merged[0]["seeds"] == [0, 1]


def test_a_healthy_run_is_left_alone(rows):
    row = rows["fault_free"]
    assert row["n_actions"] == 0 and row["kinds"] == {}
    assert row["identical"] == 1.0 and row["eval_ratio"] == 1.0 and row["lost"] == 0
    assert row["misses"] == []


def test_a_skipped_nan_batch_ends_bit_identical_to_the_twin_without_it(rows):
    row = rows["nan_batch"]
    assert row["faults"] == [["nan", 12]]
    assert row["actions"].get("skip_step") == 1 and row["stopped"] == 0
    assert {"nonfinite_loss", "bad_batch"} & set(row["kinds"])
    assert row["identical"] == 1.0, "skipping the NaN batch must equal never having seen it"
    assert math.isnan(row["bare_eval_ratio"])  # the bare run with the NaN batch ends with NaN weights
    assert row["thrown_away"]["skipped"] == 1 and row["lost"] == 1


def test_a_device_the_runs_cannot_use_is_refused_by_name(faults, capsys):
    """--device cuda runs the loop and reference runs on a GPU (benchmarks/cuda_suite.sh); the
    Lightning and HF scenarios train on the CPU only, and a machine without CUDA says so."""
    with pytest.raises(SystemExit):
        faults.main(["--device", "cuda", "--models", "gpt", "--scenarios", "fault_free,lightning"])
    assert "lightning train on the CPU only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        faults.main(["--device", "nowhere"])
    assert "--device 'nowhere'" in capsys.readouterr().err
    if not faults.torch.cuda.is_available():
        with pytest.raises(SystemExit):
            faults.main(["--device", "cuda", "--models", "gpt", "--scenarios", "fault_free"])
        assert "sees no CUDA device" in capsys.readouterr().err


def test_runs_move_their_batches_to_the_device(faults):
    batch = {"x": faults.torch.ones(2), "weight": faults.torch.tensor(1.0), "name": "kept"}
    moved = faults.to_device(batch, "meta")
    assert moved["x"].device.type == "meta" and moved["weight"].device.type == "meta" and moved["name"] == "kept"


def test_a_batch_off_the_datas_scale_is_skipped_and_leaves_batchnorm_as_its_twin(faults, tmp_path):
    """The CNN's ``scaled_batch``: its images at 1e3x for one step (after the BatchNorm check's
    warm-up). Bare, the variance lands in the running statistics; monitored, the batch is skipped
    and the run equals the twin that never saw it (parameters and BatchNorm buffers)."""
    opts = faults.Options(steps=100, isolate=False, root=str(tmp_path))
    row = faults.run_scenario("cnn", "scaled_batch", opts, {})
    assert row["faults"] == [["scale", 40]]
    assert row["actions"] == {"skip_step": 1} and "bn_var_spike" in row["kinds"]
    assert row["identical"] == 1.0 and row["misses"] == []
    assert row["bare_eval_ratio"] > 1.2  # what it saves
    assert "scaled_batch" not in faults.APPLIES["gpt"] | faults.APPLIES["bert"] | faults.APPLIES["reference"]
