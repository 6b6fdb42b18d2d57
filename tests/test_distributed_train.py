"""The reference trainer under torchrun: ``--fsdp`` on 2 ranks matches the DDP run's statistics,
and two "nodes" (two torchrun commands, one process each, c10d rendezvous) on localhost train one
sharded model together."""

import json
import os
import socket
import subprocess
import sys

import pytest
from _integration_helpers import needs_fsdp2_on_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["-m", "reference_model.train", "--", "--config", "tiny", "--seed", "0", "--no-progress", "--monitor"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def _result(stdout):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout[-2000:]  # only global rank 0 prints
    return json.loads(lines[0])


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _standalone(run_dir, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [*TRAIN, "--run-dir", str(run_dir), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _result(proc.stdout)


@needs_fsdp2_on_cpu
def test_fsdp_run_matches_the_ddp_run(tmp_path):
    fsdp = _standalone(tmp_path / "fsdp", "--fsdp")
    ddp = _standalone(tmp_path / "ddp")
    assert fsdp["fsdp"] is True and fsdp["world_size"] == 2 and fsdp["optimizer_steps"] == 4
    assert ddp["fsdp"] is False
    assert fsdp["val_loss"] == pytest.approx(ddp["val_loss"], rel=1e-4)
    sharded, replicated = _metrics(tmp_path / "fsdp"), _metrics(tmp_path / "ddp")
    assert [m["step"] for m in sharded] == [0, 1, 2, 3]
    for a, b in zip(sharded, replicated):  # global norms from the shards = DDP's replicated norms
        for key in ("grad_norm/total", "grad_norm/vision", "grad_norm/text", "grad_norm/fusion", "param_norm/fusion"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (a["step"], key)
    assert (tmp_path / "fsdp" / "checkpoint.pt").exists()  # the full state, written by rank 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_fsdp2_on_cpu
def test_two_nodes_on_localhost(tmp_path):
    """The documented multi-node commands, with both "nodes" on this machine."""
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
        cmd += ["--node-rank", str(node), "--rdzv-id", "sfmonitor-test", "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", endpoint, *TRAIN, "--run-dir", str(tmp_path / "run"), "--fsdp"]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    printed = [out for out, _ in outs if any(ln.startswith("{") for ln in out.splitlines())]
    assert len(printed) == 1  # one global rank 0, whichever node it landed on
    result = _result(printed[0])
    assert result["world_size"] == 2 and result["fsdp"] is True and result["optimizer_steps"] == 4
    assert [m["step"] for m in _metrics(tmp_path / "run")] == [0, 1, 2, 3]
