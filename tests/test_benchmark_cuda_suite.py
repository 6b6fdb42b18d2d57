"""benchmarks/cuda_suite.sh, the GPU checks in one command, cannot run here (no GPU). What can
drift without a GPU to notice: a flag it passes that a benchmark renamed or dropped. Each of its
benchmark commands is parsed by that benchmark's own argument parser, up to the first check that
needs a GPU (or, for stability.py, up to a bad --modes added on purpose)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(ROOT, "benchmarks", "cuda_suite.sh")


def _commands() -> dict[str, list[str]]:
    """name -> the benchmark's argv, from the suite's `step NAME SECONDS "$py" script args` lines."""
    text = open(SUITE, encoding="utf-8").read().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        if not line.startswith("step "):
            continue
        words = shlex.split(line.replace('"$py"', "PY").replace('"$out', '"OUT'))
        name, script, argv = words[1], words[4], words[5:]
        out[name] = [script, *argv]
    return out


def _load(script: str):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    name = os.path.splitext(os.path.basename(script))[0]
    spec = importlib.util.spec_from_file_location(f"suite_{name}", os.path.join(ROOT, script))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_suite_is_valid_shell_and_runs_four_benchmarks():
    subprocess.run(["bash", "-n", SUITE], check=True)
    assert set(_commands()) == {"overhead_small", "overhead_large", "faults", "trap"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the commands would run for real")
@pytest.mark.parametrize("name", ["overhead_small", "overhead_large", "faults"])
def test_every_flag_the_suite_passes_is_one_the_benchmark_takes(name, capsys):
    script, *argv = _commands()[name]
    argv = [re.sub(r"^OUT", "/tmp", a) for a in argv]
    with pytest.raises(SystemExit):
        _load(script).main(argv)
    err = capsys.readouterr().err
    assert "sees no CUDA device" in err, err  # parsed every flag, then stopped at the GPU


def test_the_trap_step_flags_parse(capsys):
    script, *argv = _commands()["trap"]
    with pytest.raises(SystemExit):
        _load(script).main([*[re.sub(r"^OUT", "/tmp", a) for a in argv], "--modes", "nope"])
    assert "--modes takes bare,monitored" in capsys.readouterr().err
