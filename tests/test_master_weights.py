"""fp32 master weights outside the model (Megatron-LM's Float16 optimizer, apex O2, hand-written
mixed precision): the model holds bf16/fp16 weights, the optimizer updates fp32 copies of them,
and the loop copies the masters into the model after each step. The masters stand in for the
model's weights in every statistic, under the model's names and groups."""

from __future__ import annotations

import math

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)


def _masters(model, split):
    """fp32 copies of the model's weights and an AdamW over them; ``split``: decay and no-decay
    groups, so the optimizer lists the masters in another order than the model its weights."""
    pairs = [(p.detach().float().clone().requires_grad_(True), p) for p in model.parameters()]
    masters = [m for m, _ in pairs]
    if split:
        groups = [
            {"params": [m for m in masters if m.dim() > 1], "weight_decay": 0.1},
            {"params": [m for m in masters if m.dim() == 1], "weight_decay": 0.0},
        ]
    else:
        groups = [{"params": masters}]
    return pairs, torch.optim.AdamW(groups, lr=3e-3)


def _run(tmp_path, monitored, steps=60, split=True, lr_spike_at=None, dtype=torch.bfloat16, seen=None):
    model = _model(dtype)
    pairs, opt = _masters(model, split)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet()) if monitored else None
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), torch.sin(x.sum(1, keepdim=True)))
        (mon.combine(loss) if mon else loss).backward()
        for m, p in pairs:
            m.grad = p.grad.float()
        scale = 1e4 if step == lr_spike_at else 1.0
        for pg in opt.param_groups:
            pg["lr"] *= scale
        opt.step()
        for pg in opt.param_groups:
            pg["lr"] /= scale
        if seen is not None:
            seen.append(
                (
                    dict(mon.stats) if mon else {},
                    [(m.detach().clone(), p.detach().clone()) for m, p in pairs],
                )
            )
        opt.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for m, p in pairs:
                p.copy_(m)
    if mon is not None:
        mon.detach()  # (the events stay; torch's clip functions are unpatched)
    return model, pairs, mon


@pytest.mark.parametrize("split", [False, True])
def test_a_healthy_run_with_fp32_masters_is_untouched_and_tells_nothing(tmp_path, split):
    _, pairs_b, _ = _run(tmp_path / "bare", False, split=split)
    _, pairs_m, mon = _run(tmp_path / "mon", True, split=split)
    for (mb, pb), (mm, pm) in zip(pairs_b, pairs_m):
        assert torch.equal(mb, mm) and torch.equal(pb, pm)
    # The bf16 weights the loop refreshes from the masters are neither weights whose updates
    # round away (stale_update) nor a change the loop made to the model (new_regime).
    assert mon.events == []


def test_the_masters_stand_in_for_the_models_weights_in_the_statistics(tmp_path):
    seen: list = []
    _run(tmp_path, True, steps=12, seen=seen)
    stats, held = seen[-1]
    prev = seen[-2][1]
    groups = {"0": [0, 1], "2": [2, 3], "4": [4, 5]}  # nn.Sequential's children that hold weights
    assert not any(k.endswith("/other") for k in stats), sorted(stats)
    assert not any(k.startswith("update_stale/") for k in stats)
    for g, idx in groups.items():
        # grad_norm/<group>: the masters' gradients, once (not also the bf16 copies' in "other")
        # update_ratio/<group>: what the optimizer moved the masters by, not the bf16 weights'
        # zero (the loop copies them only after the step)
        moved = math.sqrt(sum((held[i][0] - prev[i][0]).double().pow(2).sum().item() for i in idx))
        size = math.sqrt(sum(prev[i][0].double().pow(2).sum().item() for i in idx))
        assert stats[f"update_ratio/{g}"] == pytest.approx(moved / size, rel=1e-3), g
        assert stats[f"param_norm/{g}"] == pytest.approx(size, rel=1e-3), g
    total = stats["grad_norm/total"]
    assert total == pytest.approx(math.sqrt(sum(stats[f"grad_norm/{g}"] ** 2 for g in groups)), rel=1e-5)


def test_a_landed_bad_update_puts_back_the_masters_and_the_models_copies(tmp_path):
    seen: list = []
    _, _, mon = _run(tmp_path, True, steps=20, lr_spike_at=12, seen=seen)
    undos = [e for e in mon.events if "undo" in e.actions]
    assert [e.step for e in undos] == [12], [(e.step, e.kind, e.actions) for e in mon.events]
    _, before = seen[11]  # after step 11's update, before the loop's copy
    _, after = seen[13]  # the step that found it: undone, its own update skipped
    for (m0, _), (m1, p1) in zip(before, after):
        assert torch.equal(m0, m1)  # the masters as after step 11
        # the model's bf16 copies too, at once (before the loop copies the masters again): the
        # model's state_dict, which an emergency checkpoint writes, holds no trace of the update
        assert torch.equal(p1, m0.to(p1.dtype))


def test_masters_that_match_no_model_weight_stay_in_other(tmp_path):
    """An optimizer parameter the model does not hold and that copies none of its weights (a
    learnable temperature in a loss module) is its own, in group "other", as before."""
    model = _model(torch.float32)
    temp = nn.Parameter(torch.ones(32, 1) * 0.5)  # the last Linear's weight's shape, other values
    opt = torch.optim.AdamW([*model.parameters(), temp], lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    x = torch.randn(16, 8)
    loss = (model(x) * temp.mean()).pow(2).mean()
    mon.combine(loss).backward()
    opt.step()
    mon.detach()
    assert "grad_norm/other" in mon.stats and "grad_norm/0" in mon.stats


def _ddp_masters_worker(rank, world, port, out_dir, after_wrap=False):
    import os

    import torch.distributed as dist
    from _integration_helpers import join_gloo, leave_process_group

    join_gloo(rank, world, port)
    torch.manual_seed(rank)  # each rank its own weights, until DDP broadcasts rank 0's
    inner = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 1))
    inner = inner.to(torch.bfloat16)
    if after_wrap:  # masters of the weights every rank holds: the LayerNorms' tie at attach, on every rank
        model = nn.parallel.DistributedDataParallel(inner)
        masters = [p.detach().float().clone().requires_grad_(True) for p in inner.parameters()]
    else:
        masters = [p.detach().float().clone().requires_grad_(True) for p in inner.parameters()]
        model = nn.parallel.DistributedDataParallel(inner)  # rank 1's masters now copy no weight of its model
    opt = torch.optim.AdamW(masters, lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config=quiet())
    for _ in range(3):
        x = torch.randn(5, 4)
        mon.combine(model(x.bfloat16()).float().pow(2).mean()).backward()
        for m, p in zip(masters, inner.parameters()):
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        model.zero_grad()
    norms = {k: v for k, v in mon.stats.items() if k.startswith("grad_norm/")}
    torch.save(norms, os.path.join(out_dir, f"r{rank}.pt"))
    mon.detach()
    dist.barrier()
    leave_process_group()


def test_every_rank_pairs_the_same_masters(tmp_path):
    """Pairs only some ranks find are made on none: every rank lays out the same statistics (a
    pair rank 0 alone made had rank 1's reduction refuse the layout)."""
    import torch.multiprocessing as mp
    from _integration_helpers import free_port

    mp.spawn(_ddp_masters_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in (0, 1))
    assert r0.keys() == r1.keys() and "grad_norm/other" in r0


def test_masters_that_tie_at_attach_are_paired_again_at_the_first_step_on_every_rank(tmp_path):
    """The LayerNorms' masters tie by value on every rank: every rank pairs them again at the first
    step (one more small collective there, on every rank), and lays out the same statistics."""
    import torch.multiprocessing as mp
    from _integration_helpers import free_port

    mp.spawn(_ddp_masters_worker, args=(2, free_port(), str(tmp_path), True), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in (0, 1))
    assert r0 == r1 and "grad_norm/other" not in r0 and "grad_norm/1" in r0 and "grad_norm/3" in r0


def test_the_emergency_checkpoint_holds_the_masters_and_their_healthy_copies(tmp_path):
    """A spent budget stops the run: the checkpoint holds the last healthy masters (by their place
    in the optimizer) and the model's bf16 copies of them, both finite; a resume rebuilds the
    masters from them."""
    model = _model()
    pairs, opt = _masters(model, split=True)
    cfg = quiet(policy={"budget": 2}, actions={"rollback": {"snapshot_every": 5}})
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=cfg)
    g = torch.Generator().manual_seed(1)
    for x in mon.batches([torch.randn(32, 8, generator=g) for _ in range(60)]):  # ends at the stop
        mon.combine(nn.functional.mse_loss(model(x.bfloat16()).float(), x[:, :1])).backward()
        for m, p in pairs:
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            if mon.step >= 20 and not mon.should_stop:  # from step 20 on, every update lands a NaN master
                pairs[0][0][0, 0] = float("nan")
            for m, p in pairs:
                p.copy_(m)
    mon.detach()
    assert mon.should_stop
    path = next(
        e.data["action_results"]["checkpoint"]["path"]
        for e in reversed(mon.events)
        if "checkpoint" in e.actions and e.data["action_results"]["checkpoint"].get("saved", True)
    )
    ckpt = torch.load(path, weights_only=True)
    masters = ckpt["extra"]["outside_params"]
    assert sorted(masters) == [
        f"optimizer.param_groups[{g}].params[{i}]" for g, n in ((0, 3), (1, 3)) for i in range(n)
    ]
    assert all(torch.isfinite(m).all() and m.dtype == torch.float32 for m in masters.values())
    fresh = _model()
    fresh.load_state_dict(ckpt["model"])
    weights = [m for m in masters.values() if m.dim() > 1]  # the decay group: the three weights, in order
    assert all(
        torch.equal(w.bfloat16(), p) for w, p in zip(weights, [fresh[0].weight, fresh[2].weight, fresh[4].weight])
    )


def _scaled_run(tmp_path, monitored, bad_at=30, steps=60):
    """fp16 weights, fp32 masters and a loss scaler of the loop's own (fairseq's, Megatron's): an
    overflow halves the scale and skips the step (no optimizer step), the scale doubles after 20
    good steps."""
    model = _model(torch.float16)
    pairs, opt = _masters(model, split=False)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet()) if monitored else None
    g = torch.Generator().manual_seed(1)
    scale, good, skipped = 2.0**12, 0, 0
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = torch.sin(x.sum(1, keepdim=True)) * (1e4 if step == bad_at else 1.0)
        loss = nn.functional.mse_loss(model(x.half()).float(), y)
        ((mon.combine(loss) if mon else loss) * scale).backward()
        if not all(torch.isfinite(p.grad).all() for _, p in pairs):
            scale, good, skipped = scale / 2, 0, skipped + 1
            model.zero_grad()
            continue
        for m, p in pairs:
            m.grad = p.grad.float() / scale
        opt.step()
        opt.zero_grad()
        model.zero_grad()
        good += 1
        if good % 20 == 0:
            scale *= 2
        with torch.no_grad():
            for m, p in pairs:
                p.copy_(m)
    if mon is not None:
        mon.detach()
    return pairs, mon, skipped


def test_a_step_the_loops_own_loss_scaler_skips_leaves_the_next_one_alone(tmp_path):
    """The overflow the batch of step 30 makes is the loop's to skip, and it does: the monitor
    holds none of that batch for the next step (its loss, 1e8 times the usual, was a loss spike
    there, and a healthy batch was skipped)."""
    bare, _, skipped = _scaled_run(tmp_path / "bare", False)
    pairs, mon, _ = _scaled_run(tmp_path / "mon", True)
    assert skipped >= 1
    assert mon.events == [], [(e.step, e.kind, e.actions) for e in mon.events]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(bare, pairs))


def test_a_loop_that_never_resets_the_models_gradients_is_told(tmp_path):
    """The masters' gradients are copies the loop makes; the model's, which backward adds onto, are
    what a missing ``model.zero_grad()`` leaves summed over every step (the probe watched a master,
    onto which nothing accumulates, and told nothing)."""
    model = _model()
    pairs, opt = _masters(model, split=True)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(32, 8, generator=g)
        mon.combine(nn.functional.mse_loss(model(x.bfloat16()).float(), x[:, :1])).backward()
        for m, p in pairs:
            m.grad = p.grad.float()
        opt.step()
        opt.zero_grad()  # the masters' only: the model's gradients keep adding up
        with torch.no_grad():
            for m, p in pairs:
                p.copy_(m)
    mon.detach()
    told = [e for e in mon.events if e.kind == "zero_grad_missing"]
    assert [e.step for e in told] == [1] and told[0].data["parameter"] == "0.weight", mon.events


def test_masters_listed_in_another_order_are_paired_by_their_gradients_where_values_tie(tmp_path):
    """Two LayerNorms hold equal values at attach (ones, zeros), so values alone cannot tell whose
    master is whose; with the final norm's and the head's masters in a first parameter group (their
    own LR), the first master of ones took the body's LayerNorm: grad_norm/ln_f read 0.26 where the
    masters' is 0.52 (a helper's probe). At the first step the gradients tell them apart."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh())
            self.ln_f = nn.LayerNorm(16)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.ln_f(self.body(x)))

    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    pairs = {n: (p.detach().clone().float().requires_grad_(True), p) for n, p in model.named_parameters()}
    first = ["ln_f.weight", "ln_f.bias", "head.weight", "head.bias"]
    opt = torch.optim.AdamW(
        [{"params": [pairs[n][0] for n in first]}, {"params": [m for n, (m, _) in pairs.items() if n not in first]}],
        lr=1e-3,
    )
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(32, 8, generator=g)
        mon.combine(nn.functional.mse_loss(model(x.bfloat16()).float(), x[:, :1])).backward()
        for m, p in pairs.values():
            m.grad = p.grad.float()
        true = {
            k: math.sqrt(sum(m.grad.double().pow(2).sum().item() for n, (m, _) in pairs.items() if n.startswith(k)))
            for k in ("body", "ln_f", "head")
        }
        opt.step()
        for k, v in true.items():
            assert mon.stats[f"grad_norm/{k}"] == pytest.approx(v, rel=1e-5), k
        opt.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for m, p in pairs.values():
                p.copy_(m)
    mon.detach()
    assert mon.events == []
