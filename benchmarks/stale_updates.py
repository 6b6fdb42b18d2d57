"""Pure bf16 training: how much of each update rounds away, and what the `stale_update` detector tells.

A char-level GPT (the LR sweep's model, smaller) trained on the standard library's sources in two
arms per optimizer and LR: **pure bf16** (weights and optimizer state in bf16, `model.to(bfloat16)`)
with the monitor at its defaults, and **fp32 weights** under the same bf16 autocast, bare (the
remedy). Reported: the held-out loss of each and their ratio, the median `update_stale/total` of
the last 100 steps (the share of the step's gradient mass on weights the update left unchanged),
and the steps of the `stale_update` events.

    python benchmarks/stale_updates.py                      # AdamW 3e-3..1e-4, SGD 0.3 and 0.03
    python benchmarks/stale_updates.py --runs adamw:1e-4 --steps 600
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _checkout
from lr_sweep import GPT, SweepConfig, batches, encode, evaluate, stdlib_text

import sfmonitor

DEFAULT_RUNS = "adamw:3e-3,adamw:1e-3,adamw:3e-4,adamw:1e-4,sgd:0.3,sgd:0.03"


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise SystemExit(f"--runs: unknown optimizer {kind!r}; choose adamw or sgd")


def run(kind: str, lr: float, pure: bool, cfg: SweepConfig, data: tuple[torch.Tensor, torch.Tensor, int]) -> dict:
    train_ids, val_ids, vocab = data
    torch.manual_seed(cfg.seed)
    model = GPT(vocab, cfg, qk_layernorm=False)
    if pure:
        model = model.to(torch.bfloat16)
    opt = make_optimizer(kind, model.parameters(), lr)
    mon = None
    run_dir = tempfile.TemporaryDirectory(prefix="stale-") if pure else None
    if run_dir is not None:
        mon = sfmonitor.attach(model, opt, run_dir=run_dir.name, sinks=[], config={"console": False})
    shares: list[float] = []
    for x, y in batches(train_ids, cfg, cfg.steps, seed=cfg.seed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if mon is not None:
            loss = mon.combine(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mon is not None:
            if "update_stale/total" in mon.stats:
                shares.append(mon.stats["update_stale/total"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        held_out = evaluate(model, val_ids, cfg)
    events = [e.step for e in mon.events if e.kind == "stale_update"] if mon else []
    if mon is not None:
        mon.detach()
    if run_dir is not None:
        run_dir.cleanup()
    tail = shares[-100:]
    return {"eval": held_out, "share": statistics.median(tail) if tail else None, "events": events}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=DEFAULT_RUNS, help="comma list of optimizer:lr (adamw or sgd)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        SweepConfig(), layers=args.layers, d=args.d, heads=4, steps=args.steps, seed=args.seed, chars=1_000_000
    )
    ids, vocab = encode(stdlib_text(cfg.chars))
    cut = int(0.9 * len(ids))
    data = (ids[:cut], ids[cut:], vocab)
    print(f"# stale updates: sfmonitor at {_checkout.describe()}, torch {torch.__version__}; {cfg}", flush=True)
    rows = []
    started = time.time()
    for spec in args.runs.split(","):
        kind, _, lr_text = spec.partition(":")
        try:
            lr = float(lr_text)
        except ValueError:
            raise SystemExit(f"--runs: {spec!r} is not optimizer:lr (e.g. adamw:1e-4)") from None
        pure = run(kind, lr, True, cfg, data)
        master = run(kind, lr, False, cfg, data)
        rows.append((kind, lr, pure, master))
        print(f"  {kind} {lr:g}: done", file=sys.stderr, flush=True)
    print(f"\n{time.time() - started:.0f} s\n")
    print(
        "| optimizer | LR | held-out loss, pure bf16 (monitored) | fp32 weights (bare) | ratio "
        "| update_stale/total, median of the last 100 steps | stale_update events (step) |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, lr, pure, master in rows:
        share = "-" if pure["share"] is None else f"{pure['share']:.2f}"
        told = ", ".join(map(str, pure["events"])) or "none"
        print(
            f"| {kind} | {lr:g} | {pure['eval']:.3f} | {master['eval']:.3f} | {pure['eval'] / master['eval']:.3f}x "
            f"| {share} | {told} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
