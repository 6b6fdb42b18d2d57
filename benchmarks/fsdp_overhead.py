"""Step-time overhead of the monitor under FSDP2 (``fully_shard``), versus bare FSDP2 training.

Two ranks (gloo on this machine's CPU, started here with torch.multiprocessing) each hold a shard
of identical models, one per variant; the variants' steps are interleaved (bare, monitored, ...,
the order rotating every step) so that machine noise hits them alike. A *run* is ``--steps``
timed steps of every variant after ``--warmup`` untimed ones; the table shows, per variant, the
median over ``--runs`` runs of the run's median step time (rank 0's clock: the collectives keep
the ranks in step), and the ratio to bare FSDP2 in each run (median, min, max).

    python benchmarks/fsdp_overhead.py [--runs 3] [--steps 30] [--threads 1] [--d 256 --layers 3]

Not a test: it prints a table. Latest results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import time

import _checkout  # noqa: F401 - before sfmonitor: this checkout's code, not an editable install's
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import sfmonitor

WORLD = 2


class Model(nn.Module):
    """A small transformer classifier (as benchmarks/overhead.py), one FSDP2 unit per layer."""

    def __init__(self, d=256, layers=3, vocab=1000, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        h = h.mean(1)
        return {"cls": nn.functional.cross_entropy(self.head(h), labels), "reg": 1e-3 * h.pow(2).mean()}


VARIANTS = {  # name -> monitor config (None: bare training)
    "FSDP2 bare": None,
    "FSDP2 + monitor (defaults)": {},
    "FSDP2 + monitor, watch off": {"watch": {"enabled": False}},
}


def make(config, run_dir, args):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model(d=args.d, layers=args.layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mon = None
    if config is not None:
        mon = sfmonitor.attach(model, opt, run_dir=run_dir, sinks=["jsonl"], config={"console": False, **config})
    return model, opt, mon


def step(model, opt, mon, batch):
    t0 = time.perf_counter()
    losses = model(*batch)
    loss = mon.combine(losses) if mon else sum(losses.values())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    g = torch.Generator().manual_seed(rank)  # each rank its own data, as in data parallelism
    batches = [
        (torch.randint(0, 1000, (args.batch, args.seq), generator=g), torch.randint(0, 10, (args.batch,), generator=g))
        for _ in range(8)
    ]
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:  # under FSDP2 every rank uses rank 0's run_dir
        runs = {name: make(cfg, os.path.join(tmp, str(i)), args) for i, (name, cfg) in enumerate(VARIANTS.items())}
        medians: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.runs):
            times: dict[str, list[float]] = {name: [] for name in names}
            for i in range(args.steps + args.warmup):
                b = batches[i % len(batches)]
                for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
                    t = step(*runs[name], b)
                    if i >= args.warmup:
                        times[name].append(t)
            for name in names:
                medians[name].append(statistics.median(times[name]))
        n_params = sum(p.numel() for p in runs[names[0]][0].parameters())
        for _m, _o, mo in runs.values():
            if mo is not None:
                mo.detach()
    if rank == 0:
        torch.save({"medians": medians, "n_params": n_params}, out)
    dist.barrier()  # (destroying a gloo group while its threads free tensors can deadlock)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs (each gives one median per variant)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant at the start of each run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=3, help="transformer layers (one FSDP2 unit each)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.steps < 1:
        ap.error("--runs and --steps must be at least 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(worker, args=(port, args, out), nprocs=WORLD, join=True)
        result = torch.load(out)
    medians, n_params = result["medians"], result["n_params"]
    bare = medians["FSDP2 bare"]
    print(
        f"# monitor overhead under FSDP2 ({WORLD} ranks, gloo, {platform.machine()}, {args.threads} thread(s) per "
        f"rank, torch {torch.__version__}, d={args.d} x {args.layers} layers, {n_params / 1e6:.2f}M params, "
        f"batch {args.batch}x{args.seq} per rank, {args.runs} runs x {args.steps} interleaved steps each)"
    )
    print("| variant | median step (ms) | ratio to bare: median | min | max |")
    print("|---|---|---|---|---|")
    for name, ms in medians.items():
        ratios = [m / b for m, b in zip(ms, bare)]
        print(
            f"| {name} | {statistics.median(ms) * 1e3:.1f} | {statistics.median(ratios):.3f} "
            f"| {min(ratios):.3f} | {max(ratios):.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
