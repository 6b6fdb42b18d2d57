"""Benchmarks measure the code of the checkout they live in.

An editable install (``pip install -e .``, what ``make install`` does) maps ``import sfmonitor``
and ``import reference_model`` to the directory it was installed from, ahead of ``sys.path``. A
benchmark started from a second worktree (to measure a fixed commit while work goes on in the
first) would otherwise measure the first checkout's code, and name the second one's commit.

    import _checkout                      # first, before sfmonitor: this checkout's code
    _checkout.describe()                  # "abc1234 (/path/to/checkout)", "+ uncommitted ..."
    _checkout.command("reference_model.train", "--seed", "0")   # the same for a subprocess

    python benchmarks/_checkout.py -m reference_model.train ...  # what command() runs
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("sfmonitor", "reference_model")


def _editable(finder: object) -> bool:
    """A finder an editable install put on ``sys.meta_path`` (setuptools names its module so)."""
    return "__editable__" in (getattr(finder, "__module__", "") or "")


def use_checkout() -> None:
    """Import this checkout's packages from now on: drop the editable install's finders, put the
    root first. A package imported before (a test importing a benchmark) stays what it is:
    ``describe()`` names where it came from."""
    sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
    if ROOT in sys.path:
        sys.path.remove(ROOT)
    sys.path.insert(0, ROOT)


def measured_root() -> str:
    """The checkout ``sfmonitor`` is imported from (importing it if needed)."""
    import sfmonitor

    return os.path.dirname(os.path.dirname(os.path.abspath(sfmonitor.__file__)))


def describe() -> str:
    """The commit measured, where it is, and whether its packages have changes not committed."""
    root = measured_root()
    try:
        git = ["git", "-C", root]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", *PACKAGES], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return f"unknown commit ({root})"
    changed = " + uncommitted changes in sfmonitor/ or reference_model/" if dirty.stdout.strip() else ""
    return f"{head.stdout.strip()} ({root}){changed}"


def command(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this checkout's packages, for a subprocess."""
    return [sys.executable, os.path.abspath(__file__), "-m", module, *args]


use_checkout()

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        sys.exit("usage: python benchmarks/_checkout.py -m module [args...]")
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
