"""Under torch.distributed the step's values are one reduction by position: every rank must lay
them out alike, whatever order its own dicts hold them in."""

import os

import torch
import torch.multiprocessing as mp
from _integration_helpers import leave_process_group as _leave
from test_distributed import _free_port, _join
from torch import nn

import sfmonitor


def _components_worker(rank, world, port, out_dir):
    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config={"console": False})
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
        seen.append((mine, {k: mon.stats[f"loss/{k}"] for k in mine}))
    torch.save(seen, os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_loss_components_given_in_another_order_on_each_rank_are_read_alike(tmp_path):
    """A probe under torchrun: rank 1 passing ``combine()`` the same components in another order
    read another component's value as its own (rank 0 logged ``loss/a`` with ``b``'s mean, and the
    ranks told spikes of different components in the same step). The values are laid out by key."""
    mp.spawn(_components_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for (mine0, read0), (mine1, read1) in zip(r0, r1):
        assert read0 == read1
        for k in ("big", "small"):
            assert abs(read0[k] - (mine0[k] + mine1[k]) / 2) <= 1e-6 * abs(read0[k])


def _join_worker(rank, world, port, out_dir):
    import warnings

    from torch.distributed.algorithms.join import Join

    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config={"console": False})
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
