"""Instabilities the monitor was not tuned on: bare, monitored and the standard remedy.

Small training instabilities from the literature and from everyday bugs, each run three ways
on the same seed and the same batches: ``bare`` (the trouble as it is), ``monitored`` (sfmonitor at
its defaults, ``config={"console": False}``, the loop drawing its batches through
``monitor.batches()`` and its loss through ``monitor.combine()``) and ``fixed`` (the remedy a
practitioner would apply). CPU, one thread, synthetic data from ``torch.Generator``, no downloads.

* ``adam_second_moment_lag`` (Molybog et al. 2023, arXiv 2304.09871): an MLP 32-128-128-1 (tanh)
  under Adam lr 3e-2, beta2 0.999, 800 steps of regression; the first layer's gradients are
  multiplied by 1e-7 in the backward only (near Adam's eps) until step 400, then by 1: Adam's
  second moment lags the new gradient scale and the first updates at 400 are huge. Fixed: beta2 0.95.
* ``rnn_exploding_gradients`` (Pascanu et al. 2013): a vanilla tanh RNN (64 hidden) on the adding
  problem (T=100, batch 32), SGD lr 0.1 momentum 0.9, no clipping, 300 steps.
  Fixed: ``clip_grad_norm_(1.0)``.
* ``corrupt_batch``: an MLP 16-64-64-1 (tanh) regression under Adam 3e-3, 600 steps; the batch of
  step 300 has its targets x1e3. Fixed: the same run without that batch (its exact twin: a skipped
  step should make the monitored run bit-identical to it).
* ``lr_jump_sgd``: the same regression under SGD 0.05 momentum 0.9 with a schedule bug: the LR is
  x10 from step 300 on (the loop's own counter sets it each iteration). Fixed: no jump.
* ``deep_residual_no_warmup`` (Goyal et al. 2017, arXiv 1706.02677, on warm-up): a 16-block residual
  MLP (width 64, no normalisation) classifying a teacher's labels under SGD lr 0.2 momentum 0.9
  from the first step, 400 steps of batch 64; its gradients grow for ten steps, then it diverges
  (a helper's probe of published instabilities). Fixed: a linear warm-up over 100 steps.
* ``dying_relu`` (Lu et al. 2019, arXiv 1903.06733): a ReLU MLP 32-256-256-256-1 regressing a
  teacher under Adam, 400 steps of batch 64, its LR schedule starting hot (0.05 for 50 steps, then
  1e-3): most hidden units end below zero for every input and never come back. Fixed: 1e-3 from
  the first step.
* ``fp16_unwatched_overflow``: a set classifier under fp16 autocast (GradScaler, Adam 3e-3, 300
  steps of batch 32) whose parameter-free similarity module ``h @ h^T`` overflows fp16 from the
  first step: every loss is NaN. Fixed: that module in fp32 (``precision_fallback``) from the start.
* ``post_ln_no_warmup`` (Xiong et al. 2020, arXiv 2002.04745; Liu et al. 2020, arXiv 2004.08249): a
  6-block post-LN char-level transformer (d 128, nanoGPT's layout: one trunk holding embeddings,
  blocks and head) on six modules of the standard library's own source, Adam 3e-3 from the first
  step, 300 steps of 8 x 32 characters: its first blocks' gradients fade and the loss stalls near
  the unigram loss. Fixed: a linear warm-up over 100 steps to the same LR.
* ``adam_eps_too_large``: a tanh MLP 32-128-128-1 regression under AdamW (LR 1e-3) with eps 1e-2,
  400 steps of batch 64: eps, not the gradients, sizes most steps. Fixed: eps 1e-8. The monitor
  only tells this one (``adam_eps``): it does not change an optimizer's hyperparameters.

Columns, per scenario over the seeds: the step at which each bare run shows the trouble (its first
training loss that is non-finite or over 3x the running minimum, after step 10: a generic rule that
also fires on the noise of small batches; where the scenario has a fault step, the same rule from
that step on is given in brackets), the first monitor event per seed (kind@step), the monitor's
actions (summed over seeds) and the events it only told, the held-out loss (2048 fresh samples, or
512 sequences; cross-entropy on 4096 for the residual MLP) bare / monitored / fixed (mean over
seeds; NaN or inf when a run ended so), the gap closed, (bare - monitored) / (bare - fixed) with a
non-finite loss counted as 1e9 (mean of the seeds' values, 100% = as good as the remedy; left out
for a seed whose bare run ends within 1.1x of the fixed one, where there is nothing to close), how
many monitored runs ended finite and within 2x of the fixed one (the gap closed reads ~100% for a
monitored run that ends far worse than the fixed one when the bare one is NaN), and, for
``corrupt_batch``, how many monitored runs ended bit-identical to the run without the bad batch.
``--json`` writes each seed's row with its events.

    python benchmarks/instabilities.py [--seeds 3] [--scenarios 'rnn_*,corrupt_batch'] [--json out.json]

Not a test: it prints a table (a smoke run is in tests/test_benchmark_instabilities.py). About a
minute on one core for the default 3 seeds.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _tables
import torch
from torch import nn

import sfmonitor
from sfmonitor.watch import precision_fallback


@dataclass
class Spec:
    """One scenario at one seed: ``build(arm) -> (model, optimizer)``, the batches each arm runs,
    the loss of a batch, the LR the loop sets at its iteration k (None: never set), gradient
    clipping per arm, the held-out set."""

    build: Callable[[str], tuple[nn.Module, torch.optim.Optimizer]]
    batches: Callable[[str], list[Any]]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    held_out: tuple[torch.Tensor, torch.Tensor]
    lr_at: Callable[[str, int], float] | None = None
    clip: Callable[[str], float | None] = lambda arm: None
    twin: bool = False  # fixed is the exact twin (the bad batch left out): compare bit for bit
    bad_step: int | None = None  # the batch index of the fault, where there is one
    held_out_loss: Callable[[nn.Module, Any], torch.Tensor] | None = None  # None: the MSE
    amp: bool = False  # fp16 autocast with a GradScaler (every arm)
    remedy: Callable[[nn.Module], Any] | None = None  # applied to the fixed arm's model once built


def _gen(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + salt)


class _GradMul(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``c``."""

    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.c, None


class _LagNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 1)

    def forward(self, x, c=1.0):
        h = _GradMul.apply(self.inp(x), c)
        return self.out(torch.tanh(self.mid(torch.tanh(h))))


def adam_second_moment_lag(seed: int, steps: int = 800) -> Spec:
    switch = steps // 2
    g = _gen(seed, 1)
    wt, vt = torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 1, generator=g) / 8

    def mk(n):
        x = torch.randn(n, 32, generator=g)
        return x, torch.tanh(x @ wt) @ vt

    data = [(*mk(64), i) for i in range(steps)]

    def build(arm):
        m = _LagNet()
        beta2 = 0.95 if arm == "fixed" else 0.999
        return m, torch.optim.Adam(m.parameters(), lr=3e-2, betas=(0.9, beta2), eps=1e-8)

    def loss(m, b):  # the multiplier follows the batch, so a batch used again keeps its own
        x, y, i = b
        return ((m(x, 1e-7 if i < switch else 1.0) - y) ** 2).mean()

    return Spec(build, lambda arm: data, loss, mk(2048), bad_step=switch)


class _RNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(2, 64, batch_first=True, nonlinearity="tanh")
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def rnn_exploding_gradients(seed: int, steps: int = 300, length: int = 100) -> Spec:
    g = _gen(seed, 2)

    def mk(n):  # the adding problem (Hochreiter & Schmidhuber): the sum of the two marked values
        x = torch.rand(n, length, 1, generator=g)
        marks = torch.rand(n, length, generator=g).argsort(1)[:, :2]
        mask = torch.zeros(n, length).scatter_(1, marks, 1.0).unsqueeze(-1)
        return torch.cat([x, mask], -1), (x * mask).sum((1, 2)).unsqueeze(1)

    data = [mk(32) for _ in range(steps)]

    def build(arm):
        m = _RNN()
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def loss(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    return Spec(build, lambda arm: data, loss, mk(512), clip=lambda arm: 1.0 if arm == "fixed" else None)


def _regression(seed: int, steps: int):
    g = _gen(seed, 3)
    wt, vt = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 5

    def mk(n):
        x = torch.randn(n, 16, generator=g)
        return x, torch.tanh(x @ wt) @ vt + 0.01 * torch.randn(n, 1, generator=g)

    data = [mk(32) for _ in range(steps)]
    return data, mk(2048)


def _mlp16() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def _mse(m, b):
    return ((m(b[0]) - b[1]) ** 2).mean()


def corrupt_batch(seed: int, steps: int = 600) -> Spec:
    bad = steps // 2
    data, held = _regression(seed, steps)
    corrupt = [*data[:bad], (data[bad][0], data[bad][1] * 1e3), *data[bad + 1 :]]
    clean = data[:bad] + data[bad + 1 :]

    def build(arm):
        m = _mlp16()
        return m, torch.optim.Adam(m.parameters(), lr=3e-3)

    return Spec(build, lambda arm: clean if arm == "fixed" else corrupt, _mse, held, twin=True, bad_step=bad)


def lr_jump_sgd(seed: int, steps: int = 600) -> Spec:
    jump = steps // 2
    data, held = _regression(seed, steps)

    def build(arm):
        m = _mlp16()
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def lr_at(arm, k):
        return 0.05 * (10.0 if k >= jump and arm != "fixed" else 1.0)

    return Spec(build, lambda arm: data, _mse, held, lr_at=lr_at, bad_step=jump)


class _ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def deep_residual_no_warmup(seed: int, steps: int = 400, lr: float = 0.2) -> Spec:
    """A 16-block residual MLP without normalisation under SGD (momentum 0.9) at a high LR from
    the first step: its gradients grow for ten steps, then it diverges. Fixed: a linear warm-up
    over 100 steps (Goyal et al. 2017) to the same LR."""
    g = _gen(seed, 5)
    wt, vt = torch.randn(32, 64, generator=g), torch.randn(64, 10, generator=g)

    def mk(n):
        x = torch.randn(n, 32, generator=g)
        return x, (torch.tanh(x @ wt) @ vt).argmax(1)

    data = [mk(64) for _ in range(steps)]

    def build(arm):
        m = nn.Sequential(nn.Linear(32, 64), *[_ResidualBlock(64) for _ in range(16)], nn.Linear(64, 10))
        return m, torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)

    def lr_at(arm, k):
        return lr * (min(1.0, (k + 1) / 100) if arm == "fixed" else 1.0)

    def ce(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    return Spec(build, lambda arm: data, ce, mk(4096), lr_at=lr_at, held_out_loss=ce)


def dying_relu(seed: int, steps: int = 400, hot: int = 50) -> Spec:
    """A ReLU MLP (32-256-256-256-1) regressing a teacher under Adam, its LR schedule starting hot:
    0.05 for the first ``hot`` steps, then 1e-3. The hot start pushes most hidden units below zero
    for every input; they never come back (Lu et al. 2019, arXiv 1903.06733). Fixed: 1e-3 from
    the first step."""
    g = _gen(seed, 6)
    wt, vt = torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 1, generator=g) / 8

    def mk(n):
        x = torch.randn(n, 32, generator=g)
        return x, torch.tanh(x @ wt) @ vt

    data = [mk(64) for _ in range(steps)]

    def build(arm):
        layers: list[nn.Module] = [nn.Linear(32, 256), nn.ReLU()]
        for _ in range(2):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        m = nn.Sequential(*layers, nn.Linear(256, 1))
        return m, torch.optim.Adam(m.parameters(), lr=1e-3)

    def lr_at(arm, k):
        return 0.05 if k < hot and arm != "fixed" else 1e-3

    return Spec(build, lambda arm: data, _mse, mk(2048), lr_at=lr_at)


def adam_eps_too_large(seed: int, steps: int = 400) -> Spec:
    """A tanh MLP 32-128-128-1 regressing a teacher under AdamW at LR 1e-3 with eps 1e-2, as set
    for another gradient scale: the first layers' gradients (~1e-3) sit under eps, which then sizes
    their steps (an SGD step at lr / eps). Fixed: eps 1e-8, the default."""
    g = _gen(seed, 8)
    w = torch.randn(32, 1, generator=g)

    def mk(n):
        x = torch.randn(n, 32, generator=g)
        return x, torch.tanh(x @ w)

    data = [mk(64) for _ in range(steps)]

    def build(arm):
        m = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 1))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-8 if arm == "fixed" else 1e-2)

    return Spec(build, lambda arm: data, _mse, mk(2048))


class _Pairwise(nn.Module):
    """Parameter-free pairwise similarities of a set's members, unscaled: h @ h^T."""

    def forward(self, h):
        return h @ h.transpose(-1, -2)


class _SetPool(nn.Module):
    """A set classifier: embed each member, pool them by their softmaxed similarities."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.pairwise = _Pairwise()
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = self.embed(x)
        a = torch.softmax(self.pairwise(h) / 8.0, -1)
        return self.head((a @ h).mean(1))


def fp16_unwatched_overflow(seed: int, steps: int = 300) -> Spec:
    """A set classifier (8 members of 16 features at scale 48, 4 classes of a teacher) under fp16
    autocast with a GradScaler, Adam 3e-3: its parameter-free similarity module (``h @ h^T``, no
    pattern of the watch selects it) gives ~1e5, past fp16's 65504, from the first step; the
    softmax of inf is NaN on every step. Fixed: that module run in fp32 from the start (what
    ``precision_fallback`` does)."""
    g = _gen(seed, 7)
    w = torch.randn(16, 4, generator=g)

    def mk(n):
        x = torch.randn(n, 8, 16, generator=g) * 48
        return x, (x.mean(1) @ w).argmax(-1)

    data = [mk(32) for _ in range(steps)]

    def build(arm):
        m = _SetPool()
        return m, torch.optim.Adam(m.parameters(), lr=3e-3)

    def ce(m, b):
        return nn.functional.cross_entropy(m(b[0]).float(), b[1])

    return Spec(
        build,
        lambda arm: data,
        ce,
        mk(1024),
        held_out_loss=ce,
        amp=True,
        remedy=lambda m: precision_fallback(m, "pairwise"),
    )


def _stdlib_text() -> tuple[torch.Tensor, int]:
    """Characters of six modules of the standard library's own source, as indices, and how many."""
    import os

    folder = os.path.dirname(os.__file__)
    names = ["argparse.py", "collections/__init__.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py"]
    text = "".join(open(os.path.join(folder, n), encoding="utf-8").read() for n in sorted(names))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text]), len(chars)


class _PostLN(nn.Module):
    """A post-LN char-level transformer in one trunk (embeddings, blocks, head): the monitor's
    default groups are one per block."""

    def __init__(self, vocab: int, d: int = 128, layers: int = 6):
        super().__init__()
        blocks = [nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True) for _ in range(layers)]
        self.tr = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, d),
                "wpe": nn.Embedding(128, d),
                "h": nn.ModuleList(blocks),
                "head": nn.Linear(d, vocab),
            }
        )
        nn.init.normal_(self.tr.wpe.weight, std=0.02)

    def forward(self, x):
        h = self.tr.wte(x) + self.tr.wpe(torch.arange(x.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.tr.h:
            h = block(h, src_mask=mask, is_causal=True)
        return self.tr.head(h)


def post_ln_no_warmup(seed: int, steps: int = 300, lr: float = 3e-3) -> Spec:
    """A post-LN transformer at Adam 3e-3 from the first step: the loss stalls near the unigram
    loss, the first blocks' gradients faded. Fixed: a linear warm-up over 100 steps."""
    data, vocab = _stdlib_text()
    split = int(len(data) * 0.9)
    g = _gen(seed, 9)

    def mk(n: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(lo, hi - 33, (n,), generator=g)
        return torch.stack([data[j : j + 32] for j in i]), torch.stack([data[j + 1 : j + 33] for j in i])

    batches = [mk(8, 0, split) for _ in range(steps)]

    def build(arm):
        m = _PostLN(vocab)
        return m, torch.optim.Adam(m.parameters(), lr=lr)

    def lr_at(arm, k):
        return lr * (min(1.0, (k + 1) / 100) if arm == "fixed" else 1.0)

    def ce(m, b):
        return nn.functional.cross_entropy(m(b[0]).reshape(-1, vocab), b[1].reshape(-1))

    return Spec(build, lambda arm: batches, ce, mk(256, split, len(data)), lr_at=lr_at, held_out_loss=ce)


SCENARIOS: dict[str, Callable[..., Spec]] = {
    "adam_second_moment_lag": adam_second_moment_lag,
    "rnn_exploding_gradients": rnn_exploding_gradients,
    "corrupt_batch": corrupt_batch,
    "lr_jump_sgd": lr_jump_sgd,
    "deep_residual_no_warmup": deep_residual_no_warmup,
    "dying_relu": dying_relu,
    "fp16_unwatched_overflow": fp16_unwatched_overflow,
    "adam_eps_too_large": adam_eps_too_large,
    "post_ln_no_warmup": post_ln_no_warmup,
}
ARMS = ("bare", "monitored", "fixed")


def run(spec: Spec, arm: str, seed: int, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One arm: the training losses of each iteration, the events, the final weights, the
    held-out loss (the monitored arm under ``config``, merged over the benchmark's own)."""
    torch.manual_seed(seed)
    model, opt = spec.build(arm)
    if arm == "fixed" and spec.remedy is not None:
        spec.remedy(model)
    batches = spec.batches(arm)
    clip = spec.clip(arm)
    scaler = torch.amp.GradScaler("cpu", enabled=spec.amp)
    losses: list[float] = []
    events: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="instabilities-") as run_dir:
        mon = None
        if arm == "monitored":
            mon = sfmonitor.attach(
                model,
                opt,
                scaler=scaler if spec.amp else None,
                run_dir=run_dir,
                sinks=[],
                config={"console": False, **(config or {})},
            )
        try:
            for k, b in enumerate(mon.batches(batches) if mon else batches):
                if spec.lr_at is not None:
                    for group in opt.param_groups:
                        group["lr"] = spec.lr_at(arm, k)
                with torch.autocast("cpu", dtype=torch.float16, enabled=spec.amp):
                    loss = spec.loss(model, b)
                losses.append(float(loss.detach()))
                scaler.scale(mon.combine(loss) if mon else loss).backward()
                if clip is not None:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            if mon:
                events = list(mon.events)
        finally:
            if mon:
                mon.detach()
    model.eval()
    with torch.no_grad():
        x, y = spec.held_out
        held_out = float(
            spec.held_out_loss(model, spec.held_out) if spec.held_out_loss else ((model(x) - y) ** 2).mean()
        )
    return {
        "losses": losses,
        "events": events,
        "params": [p.detach().clone() for p in model.parameters()],
        "held_out": held_out,
    }


def onset(losses: list[float], factor: float = 3.0, warm: int = 10, start: int = 0) -> int | None:
    """The first step (from ``start``) whose loss is non-finite, or (from step ``warm``) over
    ``factor`` times the lowest loss before it."""
    best = math.inf
    for i, x in enumerate(losses):
        if i >= start and (not math.isfinite(x) or (i >= warm and x > factor * best)):
            return i
        best = min(best, x)
    return None


def gap_closed(bare: float, mon: float, fixed: float) -> float:
    """(bare - monitored) / (bare - fixed), a non-finite loss counted as 1e9; NaN where the fixed
    run does not end clearly better than the bare one (bare <= 1.1x fixed: nothing to close)."""
    b, m, f = (x if math.isfinite(x) else 1e9 for x in (bare, mon, fixed))
    return (b - m) / (b - f) if b > 1.1 * f and b - f > 1e-12 else math.nan


def compare(name: str, seed: int, **sizes: int) -> dict[str, Any]:
    """The three arms of one scenario at one seed; ``sizes``: the scenario's own (steps, ...)."""
    spec = SCENARIOS[name](seed, **sizes)
    arms = {arm: run(spec, arm, seed) for arm in ARMS}
    bare, mon, fixed = arms["bare"], arms["monitored"], arms["fixed"]
    ev = mon["events"]
    held = {arm: r["held_out"] for arm, r in arms.items()}
    return {
        "scenario": name,
        "seed": seed,
        "bad_step": spec.bad_step,
        "bare_onset": onset(bare["losses"]),
        "bare_onset_from_fault": None if spec.bad_step is None else onset(bare["losses"], start=spec.bad_step),
        "first_event": f"{ev[0].kind}@{ev[0].step}" if ev else None,
        "events": [{"step": e.step, "kind": e.kind, "actions": list(e.actions)} for e in ev],
        "actions": dict(Counter(a for e in ev for a in e.changed())),
        "told": dict(Counter(e.kind for e in ev if not e.changed())),
        "held_out": held,
        "gap_closed": gap_closed(held["bare"], held["monitored"], held["fixed"]),
        "mon_within_2x_fixed": math.isfinite(held["monitored"]) and held["monitored"] <= 2 * held["fixed"],
        "identical_to_fixed": (
            all(torch.equal(a, b) for a, b in zip(mon["params"], fixed["params"])) if spec.twin else None
        ),
        "iterations": {arm: len(r["losses"]) for arm, r in arms.items()},
    }


def _num(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def _step(x: int | None) -> str:
    return "-" if x is None else str(x)


def _first_events(rs: list[dict[str, Any]]) -> str:
    """``kind@s0/s1`` per kind, in seed order; ``-`` for a seed with no event."""
    by: dict[str, list[str]] = {}
    for r in rs:
        kind, _, step = (r["first_event"] or "-@-").partition("@")
        by.setdefault(kind, []).append(step)
    return ", ".join(f"{k}@{'/'.join(v)}" if k != "-" else f"none ({len(v)})" for k, v in by.items())


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| scenario | runs | bare shows it at step | first monitor event | actions | told (no action) "
        "| held-out loss bare / monitored / fixed | gap closed | monitored finite and <= 2x fixed "
        "| bit-identical to fixed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = _tables.by_case(rows, "scenario")
    total: Counter[str] = Counter()
    gaps_all: list[float] = []
    for name, rs in by.items():
        acts, told = _tables.summed(rs, "actions"), _tables.summed(rs, "told")
        onsets = "/".join(_step(r["bare_onset"]) for r in rs)
        if rs[0]["bad_step"] is not None:
            onsets += f" (from {rs[0]['bad_step']}: {'/'.join(_step(r['bare_onset_from_fault']) for r in rs)})"
        mean = {arm: sum(r["held_out"][arm] for r in rs) / len(rs) for arm in ARMS}
        gaps = [r["gap_closed"] for r in rs if not math.isnan(r["gap_closed"])]
        gaps_all += gaps
        gap = f"{100 * sum(gaps) / len(gaps):.0f}%" if gaps else "-"
        if len(gaps) < len(rs):
            gap += f" ({len(rs) - len(gaps)} of {len(rs)}: bare <= 1.1x fixed)"
        within = sum(r["mon_within_2x_fixed"] for r in rs)
        twins = [r["identical_to_fixed"] for r in rs if r["identical_to_fixed"] is not None]
        ident = f"{sum(twins)}/{len(twins)}" if twins else "-"
        total.update(runs=len(rs), within=within, acted=sum(bool(r["actions"]) for r in rs))
        out.append(
            f"| {name} | {len(rs)} | {onsets} | {_first_events(rs)} | {_tables.counts(acts)} | {_tables.counts(told)} "
            f"| {' / '.join(_num(mean[a]) for a in ARMS)} | {gap} | {within}/{len(rs)} | {ident} |"
        )
    gap = f"{100 * sum(gaps_all) / len(gaps_all):.0f}%" if gaps_all else "-"
    out.append(
        f"| **all** | {total['runs']} | | acted in {total['acted']}/{total['runs']} | | | | {gap} "
        f"| {total['within']}/{total['runs']} | |"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of each scenario")
    p.add_argument("--scenarios", default="*", help=f"comma list of names or globs; names: {', '.join(SCENARIOS)}")
    p.add_argument("--json", default=None, help="also write the per-seed rows here")
    args = p.parse_args(argv)
    names = _tables.pick(p, SCENARIOS, args.scenarios, "scenario")
    return _tables.run_and_print(names, args.seeds, compare, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
