"""False alarms: healthy runs the monitor was not tuned on, with and without it.

Each setup is a small model trained twice on the same batches (one generator per batch), bare and
monitored at the defaults. A healthy run should end bit-identical to its twin with no action. The
setups are ones whose loss legitimately moves: noisy labels in small batches, a switch to a new task
or a noisier one, targets that change scale, rare classes in batches of 1-8, heavy-tailed inputs,
outlier inputs, warm restarts, a layer unfrozen mid-run, BatchNorm with small batches, under Adam
and SGD. The table says, per setup, in how many runs the monitor acted, how many ended not
bit-identical, how many had an undo, an LR drop or a rollback (the costly actions), what was done
and told, and the held-out loss of the monitored run over the bare one's.

    python benchmarks/false_alarms.py [--seeds 3] [--steps 600] [--setups 'task_*,imbalanced_*'] [--json out.json]

Not a test: it prints a table. Latest results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import _tables
import torch
from torch import nn
from torch.nn import functional as F

import sfmonitor

COSTLY = ("undo", "lr_drop", "rollback")


def _gen(seed: int, i: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + i)


def _teacher(seed: int, k: int = 4, salt: int = 777) -> torch.Tensor:
    return torch.randn(10, k, generator=torch.Generator().manual_seed(salt + seed))


def _classes(seed, bs, noise=0.0, priors=None, tails=None, outliers=0.0, switch=None, noisier=None):
    """Batch i of a 4-class teacher task: Gaussian inputs (``tails``: Student-t with that many
    degrees of freedom; ``outliers``: that share of inputs x20), ``noise`` of the labels random,
    ``priors``: class frequencies (inputs moved toward their class); from step ``switch`` another
    teacher, or (``noisier``) that share of random labels."""
    w, w2 = _teacher(seed), _teacher(seed, salt=999)
    pri = torch.tensor(priors) if priors else None

    def batch(i):
        g = _gen(seed, i)
        x = torch.randn(bs, 10, generator=g)
        if tails:
            x = x / torch.sqrt((torch.randn(bs, tails, generator=g) ** 2).sum(1, keepdim=True) / tails)
        if outliers:
            x = torch.where(torch.rand(bs, 1, generator=g) < outliers, 20 * x, x)
        if pri is not None:
            y = torch.multinomial(pri, bs, replacement=True, generator=g)
            x = x + 1.5 * w.T[y]
        else:
            y = (x @ (w2 if switch is not None and i >= switch and noisier is None else w)).argmax(1)
        share = noisier if switch is not None and noisier is not None and i >= switch else noise
        if share:
            y = torch.where(torch.rand(bs, generator=g) < share, torch.randint(0, 4, (bs,), generator=g), y)
        return x, y

    return batch


def _regression(seed, bs, tails=None, rescale_at=None):
    w = torch.randn(10, 1, generator=torch.Generator().manual_seed(555 + seed))

    def batch(i):
        g = _gen(seed, i)
        x = torch.randn(bs, 10, generator=g)
        if tails:
            x = x / torch.sqrt((torch.randn(bs, tails, generator=g) ** 2).sum(1, keepdim=True) / tails)
        y = torch.tanh(x @ w / 3) * 3 + 0.05 * torch.randn(bs, 1, generator=g)
        return x, y * (10.0 if rescale_at is not None and i >= rescale_at else 1.0)

    return batch


def _mlp(out=4, hidden=64):
    return nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, out))


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(1, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(80, 4)

    def forward(self, x):
        return self.head(self.body(x.unsqueeze(1)))


def _opt(model, name, lr):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


Setup = Callable[[int, int], dict[str, Any]]  # (seed, steps) -> model, opt, batch, loss[, sched]


def _setups() -> dict[str, Setup]:
    s: dict[str, Setup] = {}
    ce, mse = F.cross_entropy, F.mse_loss
    for name, lr in (("adam", 3e-3), ("sgd", 0.2)):
        s[f"noisy_labels_bs16_{name}"] = lambda seed, n, name=name, lr=lr: dict(
            model=(m := _mlp()), opt=_opt(m, name, lr), batch=_classes(seed, 16, noise=0.1), loss=ce
        )

        def onecycle(seed, n, name=name, lr=lr):
            m = _mlp()
            opt = _opt(m, name, lr)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(n, 2) * 3)
            return dict(model=m, opt=opt, batch=_classes(seed, 16, noise=0.1), loss=ce, sched=sched)

        s[f"noisy_labels_onecycle_{name}"] = onecycle

        def sgdr(seed, n, name=name, lr=lr):
            m = _mlp()
            opt = _opt(m, name, lr)
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=max(n // 3, 1))
            return dict(model=m, opt=opt, batch=_classes(seed, 16, noise=0.1), loss=ce, sched=sched)

        s[f"warm_restarts_{name}"] = sgdr
    for name, lr in (("adam", 1e-3), ("sgd", 0.05)):
        for bs in (8, 64):
            s[f"task_switch_bs{bs}_{name}"] = lambda seed, n, name=name, lr=lr, bs=bs: dict(
                model=(m := _mlp()), opt=_opt(m, name, lr), batch=_classes(seed, bs, switch=n * 2 // 3), loss=ce
            )
        s[f"task_noisier_bs64_{name}"] = lambda seed, n, name=name, lr=lr: dict(
            model=(m := _mlp()),
            opt=_opt(m, name, lr),
            batch=_classes(seed, 64, switch=n * 2 // 3, noisier=0.4),
            loss=ce,
        )
        for bs in (1, 8):
            s[f"rare_classes_bs{bs}_{name}"] = lambda seed, n, name=name, lr=lr / 5, bs=bs: dict(
                model=(m := _mlp(hidden=32)),
                opt=_opt(m, name, lr),
                batch=_classes(seed, bs, priors=[0.94, 0.03, 0.02, 0.01]),
                loss=ce,
            )
    s["targets_rescaled_adam"] = lambda seed, n: dict(
        model=(m := _mlp(out=1, hidden=32)),
        opt=_opt(m, "adam", 1e-3),
        batch=_regression(seed, 16, rescale_at=n * 2 // 3),
        loss=mse,
    )
    s["student_t_inputs_bs8_adam"] = lambda seed, n: dict(
        model=(m := _mlp(out=1, hidden=32)), opt=_opt(m, "adam", 1e-3), batch=_regression(seed, 8, tails=3), loss=mse
    )
    s["outlier_inputs_bs8_adam"] = lambda seed, n: dict(
        model=(m := _mlp()), opt=_opt(m, "adam", 1e-3), batch=_classes(seed, 8, outliers=0.01), loss=ce
    )

    def unfreeze(seed, n):
        m = _mlp()
        opt = torch.optim.Adam([{"params": m[0].parameters(), "lr": 1e-5}, {"params": m[2].parameters(), "lr": 1e-3}])

        def at(step):  # the first layer unfrozen to the full LR at the middle
            return 1.0 if step < n // 2 else 100.0

        sched = torch.optim.lr_scheduler.LambdaLR(opt, [at, lambda step: 1.0])
        return dict(model=m, opt=opt, batch=_classes(seed, 16, noise=0.1), loss=ce, sched=sched)

    s["unfreeze_mid_run_adam"] = unfreeze
    s["batchnorm_bs16_sgd"] = lambda seed, n: dict(
        model=(m := _CNN()), opt=_opt(m, "sgd", 0.05), batch=_classes(seed, 16, noise=0.1), loss=ce
    )
    return s


SETUPS = _setups()


def run(setup: Setup, seed: int, steps: int, monitored: bool) -> dict[str, Any]:
    torch.manual_seed(seed)
    spec = setup(seed, steps)
    model, opt, batch, loss_fn, sched = spec["model"], spec["opt"], spec["batch"], spec["loss"], spec.get("sched")
    mon = None
    order: Any = range(steps)
    run_dir = tempfile.TemporaryDirectory(prefix="false-alarms-") if monitored else None
    if run_dir is not None:
        mon = sfmonitor.attach(model, opt, run_dir=run_dir.name, sinks=[], config={"console": False})
        order = mon.batches(order)
    for i in order:
        x, y = batch(i)
        loss = loss_fn(model(x), y)
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    model.eval()
    with torch.no_grad():  # held out: batches of the distribution the run ended on
        held = [batch(steps + 10_000 + k) for k in range(8)]
        held_out = sum(float(loss_fn(model(x), y)) for x, y in held) / len(held)
    events = list(mon.events) if mon else []
    if mon:
        mon.detach()
    if run_dir is not None:
        run_dir.cleanup()
    return {"params": [p.detach().clone() for p in model.parameters()], "held_out": held_out, "events": events}


def compare(name: str, seed: int, steps: int) -> dict[str, Any]:
    bare, mon = run(SETUPS[name], seed, steps, False), run(SETUPS[name], seed, steps, True)
    actions = Counter(a for e in mon["events"] for a in e.changed())
    return {
        "setup": name,
        "seed": seed,
        "identical": all(torch.equal(a, b) for a, b in zip(bare["params"], mon["params"])),
        "actions": dict(actions),
        "told": dict(Counter(e.kind for e in mon["events"] if not e.changed())),
        "costly": any(actions[a] for a in COSTLY),
        "bare_held_out": bare["held_out"],
        "held_out": mon["held_out"],
        "bare_diverged": not math.isfinite(bare["held_out"]) or bare["held_out"] > 1e3,
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| setup | runs | acted | not bit-identical | undo / LR drop / rollback | actions | told "
        "| held-out loss, monitored / bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = _tables.by_case(rows, "setup")
    total: Counter[str] = Counter()
    for name, rs in by.items():
        acts, told = _tables.summed(rs, "actions"), _tables.summed(rs, "told")
        ratios = [r["held_out"] / r["bare_held_out"] for r in rs if not r["bare_diverged"] and r["bare_held_out"] > 0]
        acted = sum(bool(r["actions"]) for r in rs)
        nonid = sum(not r["identical"] for r in rs)
        costly = sum(r["costly"] for r in rs)
        total.update(runs=len(rs), acted=acted, nonid=nonid, costly=costly)
        ratio = f"{sum(ratios) / len(ratios):.3f}x" if ratios else "-"
        acts_told = f"{_tables.counts(acts)} | {_tables.counts(told)}"
        out.append(f"| {name} | {len(rs)} | {acted} | {nonid} | {costly} | {acts_told} | {ratio} |")
    out.append(f"| **all** | {total['runs']} | {total['acted']} | {total['nonid']} | {total['costly']} | | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--setups", default="*", help=f"comma list of names or globs; names: {', '.join(SETUPS)}")
    p.add_argument("--json", default=None, help="also write the runs here")
    args = p.parse_args(argv)
    names = _tables.pick(p, SETUPS, args.setups, "setup")
    return _tables.run_and_print(
        names, args.seeds, lambda name, seed: compare(name, seed, args.steps), table, args.json
    )


if __name__ == "__main__":
    raise SystemExit(main())
