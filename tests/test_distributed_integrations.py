"""The Lightning callback (strategy="ddp") and the HF Trainer callback (accelerate, DDP) on 2 CPU
ranks (gloo) under torchrun: a NaN on rank 1 alone is skipped on both ranks and named as rank 1's,
and different validation accuracies on the ranks still yield one decision (their mean, 0.1, is at
chance). The runs are tests/_dist_lightning.py and tests/_dist_transformers.py."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _check(r0, r1, nan_step):
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["events"] == r1["events"]  # one decision, on both ranks
    kinds = [(step, kind, actions, ranks) for step, kind, actions, ranks, _ in r0["events"]]
    assert (nan_step, "nonfinite_loss", ["skip_step"], [1]) in kinds
    collapse = [e for e in r0["events"] if e[1] == "accuracy_collapse"]
    assert len(collapse) == 1 and collapse[0][4] == pytest.approx(0.1) and "rollback" in collapse[0][2]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert r0["steps"] == r1["steps"]


def test_lightning_callback_under_ddp(tmp_path):
    pytest.importorskip("lightning.pytorch")
    r0, r1 = _torchrun(os.path.join(ROOT, "tests", "_dist_lightning.py"), tmp_path)
    _check(r0, r1, nan_step=2)


def test_transformers_callback_under_ddp(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r0, r1 = _torchrun(os.path.join(ROOT, "tests", "_dist_transformers.py"), tmp_path)
    assert r0["ddp"] == "DistributedDataParallel"  # accelerate wrapped the model in DDP
    _check(r0, r1, nan_step=2)
