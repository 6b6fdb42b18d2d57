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
