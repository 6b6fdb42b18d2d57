"""What the table benchmarks share: pick the cases a ``--setups``/``--scenarios`` option names
(names or globs), run each at each seed, print the code and the table, write the rows as JSON."""

from __future__ import annotations

import argparse
import fnmatch
import json
import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import _checkout
import torch


def pick(parser: argparse.ArgumentParser, names: Iterable[str], patterns: str, what: str) -> list[str]:
    """The names that match any of the comma-separated ``patterns``; a parser error when none does."""
    pats = [x.strip() for x in patterns.split(",") if x.strip()]
    names = list(names)
    picked = [n for n in names if any(fnmatch.fnmatch(n, q) for q in pats)]
    if not picked:
        parser.error(f"no {what} matches {patterns!r}; names: {', '.join(names)}")
    return picked


def run_and_print(
    names: list[str],
    seeds: int,
    row: Callable[[str, int], dict[str, Any]],
    table: Callable[[list[dict[str, Any]]], str],
    json_path: str | None,
) -> int:
    """``row(name, seed)`` for every name and seed (one thread), then the code line, the table and
    (``json_path``) the rows."""
    torch.set_num_threads(1)
    t0 = time.time()
    rows = []
    for name in names:
        for seed in range(seeds):
            rows.append(row(name, seed))
        print(f"  {name}: done", flush=True)
    print(
        f"\ncode: {_checkout.describe()}; torch {torch.__version__}; {platform.machine()}; {time.time() - t0:.0f} s\n"
    )
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def by_case(rows: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """The rows grouped by ``row[key]`` (a setup or scenario name), in the order they came."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r[key], []).append(r)
    return by


def summed(rows: list[dict[str, Any]], field: str) -> Counter[str]:
    """The counts under ``row[field]`` (actions, told events), added over the rows."""
    return sum((Counter(r[field]) for r in rows), Counter())


def counts(c: Counter[str]) -> str:
    """``"kind n, kind n"`` in name order, or "0"."""
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "0"
