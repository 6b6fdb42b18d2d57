"""Step-time overhead of the monitor at its defaults, versus bare training.

Two identical models train in one process, their steps interleaved (bare, monitored, bare, ...)
so that machine noise hits both alike; the table shows the median step time of each and their
ratio, and the monitor's own time in a step (``combine()`` and its two optimizer hooks), which
machine noise moves far less than the ratio. The model is a small transformer classifier whose
step takes ~50-150 ms on a 2-core CPU.

    python benchmarks/overhead.py [--steps 80] [--threads 1] [--batch 8 --seq 64 --d 256 --layers 3]
    python benchmarks/overhead.py --variants defaults,undo-off,lean --steps 200   # fewer, longer
    python benchmarks/overhead.py --device cuda [--amp bf16] [--d 1024 --layers 12 --batch 32 --seq 256]
    python benchmarks/overhead.py --variants defaults --profile 5     # + where the monitor's time goes

On a GPU (``--device cuda``) each step ends with ``torch.cuda.synchronize()`` before its time is
taken, and the table adds, per variant: the host synchronizations a step makes (counted with
``torch.cuda.set_sync_debug_mode``: the monitor's promise is one read a step), and the device
memory it holds beyond the bare run, in MiB and in multiples of the parameters' bytes (each variant
built alone, after the timed steps: its memory after 3 steps, and its peak). The monitor's own
time is left out there: its single read waits for the GPU's queued work, so it would time the
backward pass too.

Not a test: it prints a table. Latest results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import tempfile
import time
import warnings

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
    model = Model(d=args.d, layers=args.layers).to(args.device)
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, mon, batch, amp=None) -> None:
    """One training step, with no synchronization of its own."""
    with torch.autocast(batch[0].device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
        losses = model(*batch)
    loss = mon.combine(losses) if mon else sum(losses.values())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step(model, opt, mon, batch, amp=None):
    """(the step's time, the monitor's own time in it), in seconds. On a GPU the step's time runs
    until its device work is done."""
    device = batch[0].device
    sync(device)
    own0 = mon.own_s if mon else 0.0
    t0 = time.perf_counter()
    train_step(model, opt, mon, batch, amp)
    sync(device)
    return time.perf_counter() - t0, (mon.own_s - own0 if mon else 0.0)


def host_syncs(model, opt, mon, batches, amp, steps=10) -> tuple[float, int]:
    """Synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode("warn")`` warns once for each)
    over ``steps`` steps (10: one of them a step the activation watch samples): (the median of the
    steps' counts, the largest). A step that takes a rollback snapshot (every 50) copies the model
    and optimizer state to host memory, a sync a tensor: the largest, not the median."""
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for i in range(steps):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                train_step(model, opt, mon, batches[i % len(batches)], amp)  # (step() would add two syncs)
            counts.append(sum("synchroniz" in str(w.message) for w in seen))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return statistics.median(counts), max(counts)


def profile(model, opt, mon, batches, amp, steps: int) -> str:
    """``steps`` steps under torch.profiler (with the GPU's kernels on a GPU) and cProfile: the ops
    by self time, then the monitor's functions by cumulative time, as text."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = batches[0][0].device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    calls = cProfile.Profile()
    with torch_profile(activities=activities) as prof:
        calls.enable()
        for i in range(steps):
            step(model, opt, mon, batches[i % len(batches)], amp)
        calls.disable()
    averages = prof.key_averages()
    out = [f"{steps} steps; times are totals over them"]
    out.append(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    if device.type == "cuda":
        try:
            out.append(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=50))
        except (KeyError, AttributeError, ValueError):  # torch < 2.4 names it after CUDA
            out.append(averages.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50))
    text = io.StringIO()
    pstats.Stats(calls, stream=text).sort_stats("cumulative").print_stats("sfmonitor", 20)
    out.append(text.getvalue().strip())
    return "\n".join(out)


def device_memory(config, run_dir, args, batches, amp) -> tuple[float, float]:
    """(bytes held after 3 steps, peak bytes during them), beyond what was allocated before the
    model was built: one variant alone on the GPU."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, opt, mon = make(0, config, run_dir, args)
    for i in range(3):
        step(model, opt, mon, batches[i % len(batches)], amp)
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    if mon is not None:
        mon.detach()
    del model, opt, mon
    return held, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80, help="timed steps per variant (after 5 warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d", type=int, default=256, help="model width")
    ap.add_argument("--layers", type=int, default=3, help="transformer layers")
    ap.add_argument("--variants", default=",".join(SHORT), help=f"comma list of {', '.join(SHORT)} (bare always runs)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ap.add_argument("--amp", default="off", choices=("off", "bf16", "fp16"), help="autocast the forward in this dtype")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the table, N more steps of each monitored variant under torch.profiler and cProfile: "
        "the ops by time (CPU, and the GPU's) and the monitor's functions by cumulative time",
    )
    args = ap.parse_args(argv)
    try:
        args.device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device here")
    if args.device.type not in ("cpu", "cuda"):
        ap.error(f"--device {args.device}: only cpu and cuda are supported")
    amp = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    if amp is torch.float16:
        ap.error("--amp fp16 needs a GradScaler, which this benchmark does not drive; use bf16")
    unknown = set(args.variants.split(",")) - set(SHORT)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; expected some of {', '.join(SHORT)}")
    chosen = {SHORT[k]: VARIANTS[SHORT[k]] for k in SHORT if k == "bare" or k in args.variants.split(",")}
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 1000, (args.batch, args.seq), generator=g).to(args.device),
            torch.randint(0, 10, (args.batch,), generator=g).to(args.device),
        )
        for _ in range(8)
    ]
    cuda = args.device.type == "cuda"
    with tempfile.TemporaryDirectory() as run_dir:
        runs = {name: make(0, cfg, f"{run_dir}/{i}", args) for i, (name, cfg) in enumerate(chosen.items())}
        times: dict[str, list[float]] = {name: [] for name in chosen}
        own: dict[str, list[float]] = {name: [] for name in chosen}
        names = list(chosen)
        for i in range(args.steps + 5):
            b = batches[i % len(batches)]
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
                m, o, mo = runs[name]
                t, t_own = step(m, o, mo, b, amp)
                if i >= 5:
                    times[name].append(t)
                    own[name].append(t_own)
        n_params = sum(p.numel() for p in runs["bare"][0].parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in runs["bare"][0].parameters())
        syncs = {name: host_syncs(*runs[name], batches, amp) for name in names} if cuda else {}
        profiles = {name: profile(*runs[name], batches, amp, args.profile) for name in names[1:] if args.profile}
        for _m, _o, mo in runs.values():
            if mo is not None:
                mo.detach()
        del runs
        memory = {}
        for i, (name, cfg) in enumerate(chosen.items() if cuda else ()):
            memory[name] = device_memory(cfg, f"{run_dir}/mem{i}", args, batches, amp)
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    where = (
        f"{torch.cuda.get_device_name(args.device)}, {platform.machine()} host"
        if cuda
        else f"{platform.machine()}, {torch.get_num_threads()} thread(s)"
    )
    print(
        f"# monitor overhead ({where}, torch {torch.__version__}, d={args.d} x {args.layers} layers, "
        f"{n_params / 1e6:.2f}M params, batch {args.batch}x{args.seq}, amp {args.amp}, {args.steps} interleaved "
        f"steps each; sfmonitor at {_checkout.describe()})"
    )
    if cuda:
        mib = 2**20
        print(
            "| variant | median step (ms) | median ratio | mean step (ms) | mean ratio "
            "| host syncs a step (median; most) "
            "| device memory held beyond bare: MiB (x param bytes) | peak beyond bare: MiB (x param bytes) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        held0, peak0 = memory["bare"]
        for name in names:
            held, peak = memory[name][0] - held0, memory[name][1] - peak0
            print(
                f"| {name} | {med[name] * 1e3:.2f} | {med[name] / med['bare']:.3f} | {mean[name] * 1e3:.2f} "
                f"| {mean[name] / mean['bare']:.3f} | {syncs[name][0]:g}; {syncs[name][1]} "
                f"| {held / mib:.1f} ({held / param_bytes:.2f}) | {peak / mib:.1f} ({peak / param_bytes:.2f}) |"
            )
        print_profiles(profiles)
        return 0
    print("| variant | median step (ms) | median ratio | mean step (ms) | mean ratio | monitor's own ms (median) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        print(
            f"| {name} | {med[name] * 1e3:.1f} | {med[name] / med['bare']:.3f} "
            f"| {mean[name] * 1e3:.1f} | {mean[name] / mean['bare']:.3f} | {statistics.median(own[name]) * 1e3:.2f} |"
        )
    print_profiles(profiles)
    return 0


def print_profiles(profiles: dict[str, str]) -> None:
    for name, text in profiles.items():
        print(f"\n## profile: {name}\n```\n{text}\n```")


if __name__ == "__main__":
    raise SystemExit(main())
