"""benchmarks/overhead.py (the step-time table of docs/benchmarks.md): a tiny run prints its table,
and the GPU options refuse what they cannot do by name."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def overhead():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("overhead", os.path.join(ROOT, "benchmarks", "overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_tiny_run_prints_the_table(overhead, capsys):
    argv = ["--steps", "2", "--d", "16", "--layers", "1", "--batch", "2", "--seq", "4", "--variants", "defaults"]
    assert overhead.main([*argv, "--amp", "bf16", "--profile", "1"]) == 0
    out = capsys.readouterr().out
    assert "amp bf16" in out and "| bare |" in out and "| monitor (defaults) |" in out
    # the profile: the ops by time, then the monitor's own functions
    assert "## profile: monitor (defaults)" in out and "Self CPU" in out and "before_update" in out


def test_gpu_options_refuse_what_they_cannot_do(overhead, capsys):
    with pytest.raises(SystemExit):
        overhead.main(["--amp", "fp16"])
    assert "GradScaler" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        overhead.main(["--device", "tpu9"])
    assert "--device 'tpu9'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            overhead.main(["--device", "cuda"])
        assert "sees no CUDA device" in capsys.readouterr().err


def test_the_gpu_columns_count_syncs_per_step_and_memory_beyond_the_start(overhead, monkeypatch):
    """The CUDA-only measurements, with torch.cuda's calls stubbed: syncs are counted per step (the
    median, and the largest: a snapshot step's copies show apart), memory from before the model."""
    import warnings

    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "set_sync_debug_mode"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    per_step = iter([1, 1, 44, 1, 2])

    def fake_step(*args, **kwargs):
        for _ in range(next(per_step)):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=2)

    monkeypatch.setattr(overhead, "train_step", fake_step)
    assert overhead.host_syncs(None, None, None, [None], None, steps=5) == (1, 44)

    allocated = iter([100, 400])  # before the model, after 3 steps
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 700)
    monkeypatch.setattr(overhead, "step", lambda *a, **k: (0.0, 0.0))
    monkeypatch.setattr(overhead, "make", lambda *a: (None, None, None))
    assert overhead.device_memory(None, "", None, [None], None) == (300, 600)
