"""Step-time overhead of the monitor at its defaults, versus bare training.

Two identical models train in one process, their steps interleaved (bare, monitored, bare, ...)
so that machine noise hits both alike; the table shows the median step time of each and their
ratio, and the monitor's own time in a step (``combine()`` and its two optimizer hooks), which
machine noise moves far less than the ratio. The model is a small transformer classifier whose
step takes ~50-150 ms on a 2-core CPU.

    python benchmarks/overhead.py [--steps 80] [--threads 1] [--batch 8 --seq 64 --d 256 --layers 3]
    python benchmarks/overhead.py --variants defaults,undo-off,lean --steps 200   # fewer, longer

Not a test: it prints a table. Latest results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import _checkout  # before sfmonitor: this checkout's code, not an editable install's
import torch
from torch import nn

import sfmonitor


class Model(nn.Module):
    def __init__(self, d=256, layers=3, vocab=1000, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True), layers
        )
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, labels):
        h = self.encoder(self.embed(tokens)).mean(1)
        return {"cls": nn.functional.cross_entropy(self.head(h), labels), "reg": 1e-3 * h.pow(2).mean()}


VARIANTS = {  # name -> monitor config (None: bare training)
    "bare": None,
    "monitor (defaults)": {},
    "monitor, watch off": {"watch": {"enabled": False}},
    "monitor, watch every step": {"watch": {"stride": 1}},
    "monitor, update ratio every 4 steps": {"stats": {"update_ratio_every": 4}},
    "monitor, undo off": {"actions": {"undo": {"enabled": False}}},
    "monitor, lean (undo off, ratio on a 5% slice, watch off)": {
        "actions": {"undo": {"enabled": False}},
        "stats": {"update_ratio_fraction": 0.05},
        "watch": {"enabled": False},
    },
}
SHORT = dict(zip(["bare", "defaults", "watch-off", "watch-every-step", "ratio-every-4", "undo-off", "lean"], VARIANTS))


def make(seed, config, run_dir, args):
    torch.manual_seed(seed)
    model = Model(d=args.d, layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = None
    if config is not None:
        mon = sfmonitor.attach(model, opt, run_dir=run_dir, sinks=["jsonl"], config={"console": False, **config})
        clock(mon)
    return model, opt, mon


def clock(mon) -> None:
    """Time the monitor's own work: ``combine()`` and the two optimizer hooks' ``before_update()``
    / ``after_update()`` (the hooks look them up on the instance), summed into ``mon.own_s``."""
    mon.own_s = 0.0
    for name in ("combine", "before_update", "after_update"):
        fn = getattr(mon, name)

        def timed(*args, _fn=fn, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                mon.own_s += time.perf_counter() - t0

        setattr(mon, name, timed)


def step(model, opt, mon, batch):
    """(the step's time, the monitor's own time in it), in seconds."""
    own0 = mon.own_s if mon else 0.0
    t0 = time.perf_counter()
    losses = model(*batch)
    loss = mon.combine(losses) if mon else sum(losses.values())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, (mon.own_s - own0 if mon else 0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80, help="timed steps per variant (after 5 warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=3, help="transformer layers")
    ap.add_argument("--variants", default=",".join(SHORT), help=f"comma list of {', '.join(SHORT)} (bare always runs)")
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(SHORT)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; expected some of {', '.join(SHORT)}")
    chosen = {SHORT[k]: VARIANTS[SHORT[k]] for k in SHORT if k == "bare" or k in args.variants.split(",")}
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 1000, (args.batch, args.seq), generator=g), torch.randint(0, 10, (args.batch,), generator=g))
        for _ in range(8)
    ]
    with tempfile.TemporaryDirectory() as run_dir:
        runs = {name: make(0, cfg, f"{run_dir}/{i}", args) for i, (name, cfg) in enumerate(chosen.items())}
        times: dict[str, list[float]] = {name: [] for name in chosen}
        own: dict[str, list[float]] = {name: [] for name in chosen}
        names = list(chosen)
        for i in range(args.steps + 5):
            b = batches[i % len(batches)]
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
                m, o, mo = runs[name]
                t, t_own = step(m, o, mo, b)
                if i >= 5:
                    times[name].append(t)
                    own[name].append(t_own)
        n_params = sum(p.numel() for p in runs["bare"][0].parameters())
        for _m, _o, mo in runs.values():
            if mo is not None:
                mo.detach()
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    print(
        f"# monitor overhead ({platform.machine()}, {torch.get_num_threads()} thread(s), "
        f"torch {torch.__version__}, d={args.d} x {args.layers} layers, {n_params / 1e6:.2f}M params, "
        f"batch {args.batch}x{args.seq}, {args.steps} interleaved steps each; sfmonitor at {_checkout.describe()})"
    )
    print("| variant | median step (ms) | median ratio | mean step (ms) | mean ratio | monitor's own ms (median) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        print(
            f"| {name} | {med[name] * 1e3:.1f} | {med[name] / med['bare']:.3f} "
            f"| {mean[name] * 1e3:.1f} | {mean[name] / mean['bare']:.3f} | {statistics.median(own[name]) * 1e3:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
