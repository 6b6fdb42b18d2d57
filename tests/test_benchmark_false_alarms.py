"""A small run of benchmarks/false_alarms.py (the false-alarm table of docs/benchmarks.md) in the
suite: two setups, one seed, through the benchmark's own functions."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fa():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # its `import _checkout`
    spec = importlib.util.spec_from_file_location("false_alarms", os.path.join(ROOT, "benchmarks", "false_alarms.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["false_alarms"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_healthy_setup_is_bit_identical_and_a_task_switch_costs_only_its_skips(fa):
    healthy = fa.compare("noisy_labels_bs16_adam", 0, 40)
    assert healthy["identical"] and healthy["actions"] == {} and healthy["told"] == {}
    assert healthy["held_out"] == healthy["bare_held_out"]
    switch = fa.compare("task_switch_bs64_sgd", 0, 60)  # the new task from step 40
    assert switch["actions"] == {"skip_step": 8} and not switch["costly"]
    assert switch["told"].get("loss_level_shift") == 1
    text = fa.table([healthy, switch])
    assert "| noisy_labels_bs16_adam | 1 | 0 | 0 | 0 | 0 | 0 | 1.000x |" in text
    assert "| **all** | 2 | 1 | 1 | 0 |" in text


def test_an_unknown_setup_is_named_in_the_error(fa, capsys):
    with pytest.raises(SystemExit):
        fa.main(["--setups", "no_such_setup"])
    assert "no setup matches 'no_such_setup'" in capsys.readouterr().err
