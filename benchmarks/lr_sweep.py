"""LR sweep: attention-logit growth in a small char-level GPT, bare, with qk-layernorm, monitored.

    python benchmarks/lr_sweep.py                                  # 6 LRs x 3 arms, ~30-60 s a run
    python benchmarks/lr_sweep.py --lrs 1e-2,1e-1 --arms bare,monitored --steps 100
    python benchmarks/lr_sweep.py --json sweep.json --plot docs/lr_sweep.png

The setting of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities", arXiv 2309.14322), scaled to a CPU: a pre-LN GPT (4 layers, d=128, 4 heads,
context 64) trained on the Python standard library's own source text (read from
``os.path.dirname(os.__file__)``: it ships with every Python), AdamW (beta2 0.95) with linear
warm-up and cosine decay, fp32, one thread. Three arms per LR:

* ``bare``: the model as it is;
* ``qk_layernorm``: the same with LayerNorm on queries and keys (the paper's fix);
* ``monitored``: the bare model with sfmonitor attached at its defaults (``--monitor-config``
  to change them): attention_logit_growth -> qk_clip.

Each run prints its final validation loss, the peak max attention logit over training (every step,
every layer, measured by the model itself, so alike in every arm) and, monitored, the events and
actions. Then a table per LR, the share of the bare-to-qk-layernorm gap the monitor closes, and
the paper's LR sensitivity per arm: E_lr[min(loss(lr), loss_0) - min_lr loss(lr)] over the grid
(loss_0: the loss at initialisation). Not part of the test suite (a smoke run is).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _checkout  # this checkout's sfmonitor, not an editable install's

ARMS = ("bare", "qk_layernorm", "monitored")
DEFAULT_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1)


@dataclass
class SweepConfig:
    layers: int = 4
    d: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 16
    steps: int = 300
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    chars: int = 2_000_000  # of standard-library source text
    eval_batches: int = 16
    seed: int = 0
    threads: int = 1


# --------------------------------------------------------------------------------------------
# Data: the standard library's sources
# --------------------------------------------------------------------------------------------


def stdlib_text(n_chars: int) -> str:
    """The first ``n_chars`` of the standard library's top-level .py files, in name order."""
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        parts.append(text)
        total += len(text)
        if total >= n_chars:
            break
    return "".join(parts)[:n_chars]


def encode(text: str) -> tuple[torch.Tensor, int]:
    """Printable ASCII, tab and newline as themselves; anything else as one extra symbol."""
    alphabet = "\t\n" + "".join(chr(c) for c in range(32, 127))
    index = {c: i for i, c in enumerate(alphabet)}
    other = len(alphabet)
    ids = torch.tensor([index.get(c, other) for c in text], dtype=torch.long)
    return ids, other + 1


def batches(ids: torch.Tensor, cfg: SweepConfig, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, len(ids) - cfg.context - 1, (cfg.batch,), generator=g)
        x = torch.stack([ids[s : s + cfg.context + 1] for s in start.tolist()])
        yield x[:, :-1], x[:, 1:]


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """nanoGPT-style: fused q|k|v Linear, logits computed inline, causal mask, softmax."""

    def __init__(self, d: int, heads: int, qk_layernorm: bool):
        super().__init__()
        self.num_heads, self.d_head = heads, d // heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.q_norm = nn.LayerNorm(self.d_head) if qk_layernorm else None
        self.k_norm = nn.LayerNorm(self.d_head) if qk_layernorm else None
        self.peak = torch.full((), -math.inf)  # largest logit seen (the benchmark's own record)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, self.num_heads, self.d_head).transpose(1, 2) for t in self.c_attn(x).split(D, -1))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(self.d_head)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        logits = logits.masked_fill(~causal, -math.inf)
        if self.training:
            with torch.no_grad():
                self.peak = torch.maximum(self.peak, logits.amax())
        y = logits.softmax(-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, qk_layernorm: bool):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, qk_layernorm)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, cfg: SweepConfig, qk_layernorm: bool):
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.d)
        self.pos = nn.Embedding(cfg.context, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg.d, cfg.heads, qk_layernorm) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2 init (nanoGPT)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("c_proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))

    def peak_logit(self) -> float:
        return float(torch.stack([b.attn.peak for b in self.blocks]).max())


def lr_at(step: int, lr: float, cfg: SweepConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model: GPT, val: torch.Tensor, cfg: SweepConfig) -> float:
    model.eval()
    losses = []
    for x, y in batches(val, cfg, cfg.eval_batches, seed=10_000):
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    model.train()
    return statistics.mean(losses)


def run(
    arm: str, lr: float, cfg: SweepConfig, data: tuple[torch.Tensor, torch.Tensor, int], monitor_config=None
) -> dict:
    """Train one arm at one LR; returns its result row."""
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r}; expected one of {ARMS}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train_ids, val_ids, vocab = data
    torch.manual_seed(cfg.seed)
    model = GPT(vocab, cfg, qk_layernorm=arm == "qk_layernorm")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, 1.0, cfg))
    mon = None
    run_dir = None
    if arm == "monitored":
        import sfmonitor

        run_dir = tempfile.TemporaryDirectory(prefix="lr_sweep-")
        config = {"console": False, **(monitor_config or {})}
        mon = sfmonitor.attach(model, opt, run_dir=run_dir.name, sinks=[], config=config)
    loss0 = evaluate(model, val_ids, cfg)
    t0 = time.perf_counter()
    diverged_at = None
    train_losses = []
    first_clip = None
    peak_to_first_clip = None  # training forwards up to and with the first clip's step
    peak_after_clip = -math.inf
    for step, (x, y) in enumerate(batches(train_ids, cfg, cfg.steps, seed=cfg.seed)):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if mon is not None:
            loss = mon.combine({"lm": loss})
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        value = loss.item()
        train_losses.append(value)
        if not math.isfinite(value) and diverged_at is None:
            diverged_at = step
        if mon is not None:
            if first_clip is None and any(_clipped(e) for e in mon.events):
                first_clip = step
                peak_to_first_clip = model.peak_logit()
                for b in model.blocks:  # from here on: the peak after the first clip
                    b.attn.peak = torch.full((), -math.inf)
            elif first_clip is not None:
                peak_after_clip = max(peak_after_clip, model.peak_logit())
    seconds = time.perf_counter() - t0
    val = evaluate(model, val_ids, cfg)
    row = {
        "arm": arm,
        "lr": lr,
        "val_loss": val if math.isfinite(val) else None,
        "loss0": loss0,
        "train_loss_last20": statistics.mean(train_losses[-20:]),
        "peak_logit": model.peak_logit() if first_clip is None else None,
        "seconds": round(seconds, 1),
        "diverged_at": diverged_at,
    }
    if mon is not None:
        events: dict[str, int] = {}
        actions: dict[str, int] = {}
        for e in mon.events:
            events[e.kind] = events.get(e.kind, 0) + 1
            for a in e.actions:
                actions[a] = actions.get(a, 0) + 1
        clips = [e for e in mon.events if _clipped(e)]
        # What the clips were sized from: after the update, on the step's input (no forward ran
        # on those weights: they were clipped first), or a held module's check before its forward.
        maxima = [
            m
            for e in clips
            for m in (
                e.data.get("action_results", {}).get("qk_clip", {}).get("max_logit"),
                e.data.get("clipped_before_forward", {}).get("max_logit"),
            )
            if m is not None
        ]
        if clips:
            actions["qk_clip_applied"] = len(clips)
            before = sum(_clipped_before_forward(e) for e in clips)
            if before:
                actions["qk_clip_before_forward"] = before
        row.update(
            events=events,
            actions=actions,
            first_clip_step=first_clip,
            peak_logit_clipped=max(maxima) if maxima else None,
            peak_logit_to_first_clip=peak_to_first_clip,
            peak_logit_after_first_clip=peak_after_clip if first_clip is not None else None,
        )
        if first_clip is not None and peak_to_first_clip is not None:
            # Training forwards only, as in the other arms.
            row["peak_logit"] = max(peak_to_first_clip, peak_after_clip)
        mon.detach()
    if run_dir is not None:
        run_dir.cleanup()
    return row


def _clipped(event) -> bool:
    """An event whose qk_clip changed W_q/W_k, after the update or (a held module) before the
    step's forward; a held module's check can find nothing to clip."""
    return "qk_clip" in event.actions and (
        bool(event.data.get("action_results", {}).get("qk_clip", {}).get("applied")) or _clipped_before_forward(event)
    )


def _clipped_before_forward(event) -> bool:
    return bool(event.data.get("clipped_before_forward"))


def sensitivity(rows: list[dict], arm: str) -> float | None:
    """Wortsman et al.'s LR sensitivity: mean over the grid of min(loss, loss_0) - best loss."""
    rs = [r for r in rows if r["arm"] == arm]
    if not rs:
        return None
    capped = [min(r["val_loss"] if r["val_loss"] is not None else math.inf, r["loss0"]) for r in rs]
    return statistics.mean(c - min(capped) for c in capped)


def _f(v, fmt=".3f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    lrs = sorted({r["lr"] for r in rows})
    by = {(r["arm"], r["lr"]): r for r in rows}
    out = [
        "| LR | bare: loss / peak logit | qk-layernorm: loss / peak logit | monitored: loss / peak logit | "
        "gap closed | qk_clips applied (first at step) | monitored peak after first clip |",
        "|---|---|---|---|---|---|---|",
    ]
    for lr in lrs:
        b, q, m = by.get(("bare", lr)), by.get(("qk_layernorm", lr)), by.get(("monitored", lr))
        cells = []
        for r in (b, q, m):
            cells.append("-" if r is None else f"{_f(r['val_loss'])} / {_f(r['peak_logit'], '.4g')}")
        gap = "-"
        if b and q and m and None not in (b["val_loss"], q["val_loss"], m["val_loss"]):
            if b["val_loss"] - q["val_loss"] > 1e-9:
                gap = f"{(b['val_loss'] - m['val_loss']) / (b['val_loss'] - q['val_loss']):.0%}"
            else:
                gap = "no gap"
        clips = "-"
        after = "-"
        if m is not None:
            n = m["actions"].get("qk_clip_applied", 0)
            clips = f"{n}" + (f" (step {m['first_clip_step']})" if m.get("first_clip_step") is not None else "")
            after = _f(m.get("peak_logit_after_first_clip"), ".4g")
        out.append(f"| {lr:g} | {' | '.join(cells)} | {gap} | {clips} | {after} |")
    out += ["", "| arm | LR sensitivity (lower is better) | best loss | mean seconds per run |", "|---|---|---|---|"]
    for arm in ARMS:
        rs = [r for r in rows if r["arm"] == arm]
        if not rs:
            continue
        best = min((r["val_loss"] for r in rs if r["val_loss"] is not None), default=None)
        out.append(
            f"| {arm} | {_f(sensitivity(rows, arm))} | {_f(best)} | {statistics.mean(r['seconds'] for r in rs):.1f} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, style in zip(ARMS, ("o-", "s--", "^-.")):
        rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["lr"])
        if not rs:
            continue
        a1.plot(
            [r["lr"] for r in rs],
            [r["val_loss"] if r["val_loss"] is not None else math.nan for r in rs],
            style,
            label=arm,
        )
        a2.plot([r["lr"] for r in rs], [r["peak_logit"] or math.nan for r in rs], style, label=arm)
    for ax, ylabel in ((a1, "final validation loss"), (a2, "peak max attention logit")):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    a2.set_yscale("log")
    fig.suptitle("char-level GPT on the Python standard library: attention-logit growth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS), help="comma list of peak LRs")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--monitor-config", default=None, help="sfmonitor config (YAML path or JSON) for the monitored arm")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--plot", default=None, help="write a plot (PNG) here when matplotlib is installed")
    for f, v in asdict(SweepConfig()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(v), default=v)
    args = p.parse_args(argv)
    cfg = SweepConfig(**{f: getattr(args, f) for f in asdict(SweepConfig())})
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if any(a not in ARMS for a in arms):
        p.error(f"--arms takes {', '.join(ARMS)}")
    lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    mcfg = args.monitor_config
    if mcfg is not None and mcfg.lstrip().startswith("{"):
        mcfg = json.loads(mcfg)
    elif mcfg is not None:
        import yaml

        with open(mcfg, encoding="utf-8") as fh:
            mcfg = yaml.safe_load(fh) or {}
    ids, vocab = encode(stdlib_text(cfg.chars))
    split = int(0.9 * len(ids))
    data = (ids[:split], ids[split:], vocab)
    print(f"{len(ids)} characters of {os.path.dirname(os.__file__)}, vocabulary {vocab}; {cfg}", file=sys.stderr)
    print(f"# sfmonitor at {_checkout.describe()}")
    rows = []
    for lr in lrs:
        for arm in arms:
            row = run(arm, lr, cfg, data, mcfg)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"config": asdict(cfg), "rows": rows}, fh, indent=1)
    print(table(rows))
    if args.plot:
        print(f"\nplot: {args.plot}" if plot(rows, args.plot) else "\nplot: matplotlib is not installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
