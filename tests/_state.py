"""A training state to compare bit for bit (the model's and the optimizer's state dicts), and the
small training loop that twin tests run with and without the monitor."""

from __future__ import annotations

import copy

import torch

import sfmonitor


def quiet(**cfg):
    """A monitor config without the console lines (the tests read events, not stderr)."""
    return {"console": False, **cfg}


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_identical(a, b):
    """Two snapshots hold the same tensors, bit for bit, and the same optimizer settings."""
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for pid in oa["state"]:
        for k, v in oa["state"][pid].items():
            w = ob["state"][pid][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w), (pid, k)
            else:
                assert v == w, (pid, k)


def train(
    tmp_path,
    model,
    opt,
    monitored,
    order,
    loss_of,
    *,
    config=None,
    sinks=None,
    lr_spike_at=None,
    after_step=None,
    before_batch=None,
):
    """Train on batches ``order`` (through ``monitor.batches()`` when monitored): ``loss_of(i)`` is
    batch i's loss; the update of ``lr_spike_at`` is made once at 1e4 x the LR; ``after_step()``
    runs after each update (a scheduler); ``before_batch(monitor, i)`` before each batch's forward
    (monitor None when bare). Returns the monitor's events (none when bare)."""
    cfg = {"console": False, **(config or {})}
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=sinks, config=cfg) if monitored else None
    spiked = False
    for i in mon.batches(order) if mon else order:
        if before_batch is not None:
            before_batch(mon, i)
        loss = loss_of(i)
        (mon.combine(loss) if mon else loss).backward()
        spike = i == lr_spike_at and not spiked
        if spike:
            spiked = True
            opt.param_groups[0]["lr"] *= 1e4
        opt.step()
        if spike:
            opt.param_groups[0]["lr"] /= 1e4
        opt.zero_grad()
        if after_step is not None:
            after_step()
    events = list(mon.events) if mon else []
    if mon:
        mon.detach()
    return events


def collector_runs(fn) -> list[int]:
    """The generations of the garbage collector's runs while ``fn`` runs, from a fresh count
    (CPython's default threshold: a run per 700 new objects that are still alive)."""
    import gc

    runs: list[int] = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    gc.callbacks.append(count)
    try:
        gc.collect()
        runs.clear()
        fn()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
    return runs
