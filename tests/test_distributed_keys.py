"""Under torch.distributed the step's values are one reduction by position: every rank must lay
them out alike, whatever order its own dicts hold them in."""

import os

import torch
import torch.multiprocessing as mp
from _integration_helpers import leave_process_group as _leave
from test_distributed import _free_port, _join
from torch import nn

import sfmonitor


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _ddp_monitored(rank, world, port, out_dir, net=_mlp, make_opt=_adam):
    """This rank in the group, ``net`` (seeded; a small MLP) under DDP, ``make_opt(parameters)``
    (Adam) and a quiet monitor writing to ``out_dir/<rank>``."""
    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(net())
    opt = make_opt(model.parameters())
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config={"console": False})
    return model, opt, mon


def _components_worker(rank, world, port, out_dir):
    model, opt, mon = _ddp_monitored(rank, world, port, out_dir)
    g = torch.Generator().manual_seed(100 + rank)
    seen = []
    for _ in range(3):
        out = model(torch.randn(8, 4, generator=g))
        parts = {"big": 100.0 + out[:, 0].pow(2).mean(), "small": 1e-3 * out[:, 1].pow(2).mean()}
        if rank == 1:  # the same components, given in the other order
            parts = {"small": parts["small"], "big": parts["big"]}
        mine = {k: v.item() for k, v in parts.items()}
        mon.combine(parts).backward()
        opt.step()
        opt.zero_grad()
        read = mon.stats
        seen.append(
            (mine, {k: read[f"loss/{k}"] for k in mine}, sorted(k for k in read if "/big" in k or "/small" in k))
        )
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_loss_components_given_in_another_order_on_each_rank_are_read_alike(tmp_path):
    """A probe under torchrun: rank 1 passing ``combine()`` the same components in another order
    read another component's value as its own (rank 0 logged ``loss/a`` with ``b``'s mean, and the
    ranks told spikes of different components in the same step). The values are laid out by key."""
    mp.spawn(_components_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for (mine0, read0, keys0), (mine1, read1, keys1) in zip(r0, r1):
        assert read0 == read1
        # the pairs of components are named alike on both ranks: one key of the reduction each
        assert keys0 == keys1 and "loss_ratio/big/small" in keys0 and "loss_ratio/small/big" not in keys0
        for k in ("big", "small"):
            assert abs(read0[k] - (mine0[k] + mine1[k]) / 2) <= 1e-6 * abs(read0[k])


def _join_worker(rank, world, port, out_dir):
    import warnings

    from torch.distributed.algorithms.join import Join

    model, opt, mon = _ddp_monitored(rank, world, port, out_dir)
    g = torch.Generator().manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([model]):
            for _ in range(3):  # as many batches on every rank: this works
                mon.combine(model(torch.randn(8, 4, generator=g)).pow(2).mean()).backward()
                opt.step()
                opt.zero_grad()
    torch.save([str(w.message) for w in caught], os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_ddp_join_is_warned_about_before_a_rank_runs_out_of_batches(tmp_path):
    """DDP's ``Join`` (uneven inputs) shadows the gradient all-reduce on a rank that ran out of
    batches; the monitor's own per-step reduction on the others then meets it, and the job aborts
    inside gloo (a probe: a collective mismatch at the step after the shorter rank's last). The
    monitor cannot take part from a rank that no longer steps: it says so once, when it first
    sees Join enabled, so the log names the cause before any abort; with as many batches on every
    rank the run goes on."""
    mp.spawn(_join_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in (0, 1):
        told = [m for m in torch.load(tmp_path / f"rank{r}.pt") if "Join" in m]
        assert len(told) == 1 and "same number of batches" in told[0]


class _HeldOrFed(nn.Module):
    """Token ids given, or (none given) ids the model holds."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.register_buffer("held", torch.arange(30).view(6, 5), persistent=False)

    def forward(self, ids=None):
        return self.emb(self.held if ids is None else ids).mean((1, 2))


def _inputs_worker(rank, world, port, out_dir):
    model, opt, mon = _ddp_monitored(rank, world, port, out_dir, _HeldOrFed, lambda ps: torch.optim.SGD(ps, lr=1e-2))
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        ids = torch.randint(0, 50, (6, 5), generator=g)
        if rank == 0:
            out = model(ids[:0] if step == 3 else ids)  # (an empty batch at step 3)
        else:
            out = model(ids.float().requires_grad_()[:, :0].long() if step == 4 else None)
        mon.combine(out.pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
    torch.save(mon.step, os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_ranks_whose_forwards_see_different_input_tensors_read_alike(tmp_path):
    """A probe under torchrun: rank 0 fed token ids, rank 1 called the model without a tensor (it
    holds its data), or one rank's batch was empty: the input tally was sent only by a rank whose
    forward saw a tensor, so the vectors differed in length and gloo aborted the job at the step's
    reduction. Every rank sends the input values; one without stands aside (NaN: no tally)."""
    mp.spawn(_inputs_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)] == [5, 5]


def _zero_budget_worker(rank, world, port, out_dir):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 1000), nn.Tanh(), nn.Linear(1000, 2)))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adagrad, lr=1e-2)
    cfg = {
        "console": False,
        # a budget one rank's shard fits and the other's does not
        "actions": {"rollback": {"snapshot_every": 1, "max_host_mb": 0.0545}},
        "policy": {"ladders": {"update_ratio_spike": {"rungs": [{"after": 1, "actions": ["checkpoint"]}]}}},
    }
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, "run"), sinks=[], config=cfg)
    held = []
    for i in range(7):
        g = torch.Generator().manual_seed(1000 * rank + i)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        scale = 1e4 if i == 5 else 1.0  # a bad update lands at step 5: judged at step 6
        opt.param_groups[0]["lr"] *= scale
        opt.step()
        opt.param_groups[0]["lr"] /= scale
        opt.zero_grad()
        held.append(len(mon._live().snapshots.labels))
    torch.save(
        {"held": held, "events": [(e.step, e.actions) for e in mon.events if e.actions]},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    mon.detach()
    _leave()


def test_zero_ranks_holding_different_snapshots_take_the_checkpoint_together(tmp_path):
    """ZeroRedundancyOptimizer's shards differ in size, so one rank's snapshot fits
    ``max_host_mb`` and the other's does not: the emergency checkpoint of a landed bad update then
    consolidated ZeRO's state (a collective) on the rank without a snapshot only, and the job hung
    (a probe). Every rank consolidates, whatever it holds."""
    ctx = mp.spawn(_zero_budget_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False)
    done = False
    for _ in range(12):
        if ctx.join(10):
            done = True
            break
    if not done:
        for p in ctx.processes:
            p.kill()
    assert done, "the ranks hung"
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["held"] != r1["held"]  # (the premise: the ranks' snapshot rings differ)
    assert r0["events"] == r1["events"] and ["checkpoint"] in [a for _, a in r0["events"]]
