"""benchmarks/_checkout.py: a benchmark measures the checkout it lives in, even when an editable
install maps ``import sfmonitor`` elsewhere (a second worktree measuring a fixed commit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_benchmark_and_its_subprocesses_import_the_checkout_they_live_in(tmp_path):
    other = tmp_path / "other-checkout"
    (other / "benchmarks").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "benchmarks", "_checkout.py"), other / "benchmarks" / "_checkout.py")
    (other / "sfmonitor").mkdir()
    (other / "sfmonitor" / "__init__.py").write_text("WHERE = 'the other checkout'\n")
    (other / "probe.py").write_text(
        "import sfmonitor, _checkout\nprint(sfmonitor.WHERE)\nprint(_checkout.describe())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(other / "benchmarks")}
    out = subprocess.run(
        [sys.executable, str(other / "benchmarks" / "_checkout.py"), "-m", "probe"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    # Here sfmonitor is installed editable from this repository; the probe still gets the other one.
    assert out[0] == "the other checkout"
    assert out[1] == f"unknown commit ({other})"  # not a git checkout: said so, with its path


def test_describe_names_this_checkouts_commit():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import _checkout

        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode:  # not a git checkout (an sdist): nothing to compare
            return
        assert _checkout.describe().startswith(f"{head.stdout.strip()} ({ROOT})")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
