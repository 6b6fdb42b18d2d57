"""Healthy runs whose loss legitimately moves: noisy small batches, a switch to a new task, rare
hard batches. The monitor may tell, but it must not cut, undo or cost the run its course."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.utils.prune
from _state import assert_identical, collector_runs, quiet, snapshot, train
from torch import nn

import sfmonitor


def _classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 4))


def _noisy_batches(seed, bs=16, noise=0.1, teacher=None):
    """Batch i of a 4-class teacher task with ``noise`` of its labels random (one generator per
    batch: the same batch whatever the order)."""
    w = teacher if teacher is not None else torch.randn(10, 4, generator=torch.Generator().manual_seed(777 + seed))

    def batch(i):
        g = torch.Generator().manual_seed(seed * 1000003 + i)
        x = torch.randn(bs, 10, generator=g)
        flip = torch.rand(bs, generator=g) < noise
        return x, torch.where(flip, torch.randint(0, 4, (bs,), generator=g), (x @ w).argmax(1))

    return batch


def _noisy_sgd_run(tmp_path, monitored, seed=2, steps=60):
    model = _classifier(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    batch = _noisy_batches(seed)

    def loss_of(i):
        x, y = batch(i)
        return nn.functional.cross_entropy(model(x), y)

    events = train(tmp_path, model, opt, monitored, range(steps), loss_of)
    return snapshot(model, opt), events


def test_a_noisy_batch_as_the_warm_up_ends_is_no_spike(tmp_path):
    """Batch 16, 10% random labels, SGD at 0.2: batch losses swing 0.2-2.6. The warm-up's prior
    knows that swing; the tight test that follows it must know it as well, from its first step
    (here a 2.6 at step 25 read as 6.0 sigma: its noise came from the MAD of 22 errors alone,
    the tail of the errors not yet read)."""
    bare, _ = _noisy_sgd_run(tmp_path / "b", False)
    state, events = _noisy_sgd_run(tmp_path / "m", True)
    assert [(e.step, e.kind, e.actions) for e in events if e.actions] == []
    assert_identical(state, bare)


def _task_switch_run(tmp_path, monitored, optimizer, switch=150, steps=300, seed=1, batch=64, announce=False):
    """A 4-class task learnt until ``switch``, then a new task (another teacher) on the same
    inputs: the loss jumps ~3x (Adam) to ~100x (SGD) and stays there while the model relearns
    (``announce``: the loop calls ``monitor.new_regime()`` before the new task's first batch).
    Returns the held-out loss on the new task and the events."""
    model = _classifier(seed)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    old, new = (torch.randn(10, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2))

    def loss_of(i):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        x = torch.randn(batch, 10, generator=g)
        return nn.functional.cross_entropy(model(x), (x @ (old if i < switch else new)).argmax(1))

    def before_batch(mon, i):
        if announce and mon is not None and i == switch:
            mon.new_regime("a new task")

    events = train(tmp_path, model, opt, monitored, range(steps), loss_of, before_batch=before_batch)
    with torch.no_grad():
        x = torch.randn(2000, 10, generator=torch.Generator().manual_seed(99))
        held_out = float(nn.functional.cross_entropy(model(x), (x @ new).argmax(1)))
    return held_out, events


def test_a_switch_to_a_new_task_is_followed_not_rolled_back(tmp_path):
    """A loss that jumps and stays, on a state a sound update made, is the data changing (a new
    task, a curriculum stage, a new mix): after a few skipped batches whose losses agree on the new
    level, the loss detector follows it and says so. No rollback to an older snapshot of the old
    task, no LR cut, no undo of the large updates that relearning makes (they lower the loss)."""
    shift_after = 8  # detectors.loss_spike.shift_after
    for optimizer in ("adam", "sgd"):
        bare, _ = _task_switch_run(tmp_path / f"b{optimizer}", False, optimizer)
        held_out, events = _task_switch_run(tmp_path / f"m{optimizer}", True, optimizer)
        acted = [(e.step, e.kind, tuple(e.actions)) for e in events if e.actions]
        assert all(a == ("skip_step",) for _, _, a in acted), (optimizer, acted)
        assert [s for s, _, _ in acted] == list(range(150, 150 + shift_after)), (optimizer, acted)
        shifts = [e for e in events if e.kind == "loss_level_shift"]
        assert [e.step for e in shifts] == [150 + shift_after], optimizer
        assert shifts[0].data["skipped"] == shift_after
        assert held_out < 1.1 * bare, (optimizer, held_out, bare)


def test_a_change_of_data_the_loop_announces_costs_nothing(tmp_path):
    """``monitor.new_regime()`` before a new task's first batch (a curriculum stage, a DQN's hard
    target sync): from that step the detectors learn what is usual afresh (the loss's level, the
    gradients' and the updates' sizes), and the update before it is not judged by a loss of other
    data. The switch above, announced: no skip, the run equals bare, one told event naming the
    reason (unannounced: shift_after skipped batches)."""
    for optimizer in ("adam", "sgd"):
        bare, _ = _task_switch_run(tmp_path / f"b{optimizer}", False, optimizer)
        held_out, events = _task_switch_run(tmp_path / f"m{optimizer}", True, optimizer, announce=True)
        assert [(e.step, e.kind, e.actions) for e in events if e.actions] == [], optimizer
        told = [(e.step, e.kind) for e in events if e.kind in ("new_regime", "loss_level_shift", "loss_spike")]
        assert told == [(150, "new_regime")], (optimizer, told)
        assert "a new task" in events[[e.kind for e in events].index("new_regime")].message
        assert held_out == bare, optimizer


def test_the_update_before_an_announced_change_is_not_judged_by_the_new_datas_loss(tmp_path):
    """The loss of the announced step comes from other data: the move from the loss before it says
    nothing of what the last update did, so it is neither evidence of harm nor a sample of the
    run's batch-to-batch noise (the update-ratio detector's ``loss_moves``, learnt afresh)."""
    torch.manual_seed(0)
    model = _classifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    old, new = (torch.randn(10, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=quiet())
    for i in range(21):
        if i == 20:
            mon.new_regime("a new task")
        x = torch.randn(64, 10, generator=torch.Generator().manual_seed(i))
        mon.combine(nn.functional.cross_entropy(model(x), (x @ (old if i < 20 else new)).argmax(1))).backward()
        opt.step()
        opt.zero_grad()
    moves = mon.state_dict()["detectors"]["update_ratio_spike"]["loss_moves"]
    mon.detach()
    assert [e.kind for e in mon.events] == ["new_regime"] and moves == []


def _rescaled_target_run(tmp_path, monitored, seed=0, switch=400, steps=600):
    """A regression whose targets become 10x larger at ``switch`` (a new unit, a new data source):
    the loss jumps ~100x and the model relearns its output scale with updates far larger than
    before, some of them followed by a noisy batch's higher loss."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = torch.randn(10, 1, generator=torch.Generator().manual_seed(555 + seed))

    def batch(i):
        g = torch.Generator().manual_seed(seed * 1000003 + i)
        x = torch.randn(16, 10, generator=g)
        y = torch.tanh(x @ w / 3) * 3 + 0.05 * torch.randn(16, 1, generator=g)
        return x, y * (10.0 if i >= switch else 1.0)

    def loss_of(i):
        x, y = batch(i)
        return nn.functional.mse_loss(model(x), y)

    events = train(tmp_path, model, opt, monitored, range(steps), loss_of)
    with torch.no_grad():
        held = [batch(10_000 + i) for i in range(8)]
        held_out = sum(float(nn.functional.mse_loss(model(x), y)) for x, y in held) / len(held)
    return held_out, events


def test_after_a_change_of_data_the_update_sizes_are_learnt_afresh(tmp_path):
    """Once the loss detector takes the new level, the update-ratio and gradient tests forget the
    old regime's usual sizes and learn the new ones (their warm-up; the ceiling guards): the
    relearning model's updates, 10x the old task's, are neither undone nor answered by an LR cut,
    and the run ends near the bare run."""
    bare, _ = _rescaled_target_run(tmp_path / "b", False)
    held_out, events = _rescaled_target_run(tmp_path / "m", True)
    acted = [(e.step, e.kind, tuple(e.actions)) for e in events if e.actions]
    assert {a for _, _, a in acted} == {("skip_step",)}, acted
    assert [e.step for e in events if e.kind == "loss_level_shift" and e.data["key"] == "loss/total"] == [408]
    # (bare 14.2; monitored 16.6 for the 8 batches skipped before the shift was taken: the loss
    # still falls fast; with the old regime's update sizes: undone, the LR cut, 180.5)
    assert held_out < 1.3 * bare, (held_out, bare)


def test_a_large_update_is_not_undone_for_a_rise_within_the_runs_batch_to_batch_noise(tmp_path):
    """Batch 8: one batch's loss is often 2-3x the next one's. After a task switch (too noisy for a
    level shift: no jump streak) the relearning SGD makes updates 10x its old ones; the next
    batch's loss 1.5x this one's is that noise, not harm (harm_noise: the rise must also pass 6x
    the median of the run's batch-to-batch moves, in log). No undo, no LR cut: the bare run."""
    for seed in (1, 2):
        bare, _ = _task_switch_run(tmp_path / f"b{seed}", False, "sgd", switch=400, steps=600, seed=seed, batch=8)
        held_out, events = _task_switch_run(
            tmp_path / f"m{seed}", True, "sgd", switch=400, steps=600, seed=seed, batch=8
        )
        assert [(e.step, e.kind, e.actions) for e in events if e.actions] == [], seed
        assert held_out == bare, seed


def test_a_skipped_step_is_no_measure_of_the_runs_batch_to_batch_noise(tmp_path):
    """The update-ratio detector's noise reads what landed updates did to the loss. A batch skipped
    for a 1e3x loss changed nothing: the move from it to the next batch (~1e3x down) must not be
    read as one; the move onto it from the sound update before it is one (the median absorbs it)."""
    import math

    import sfmonitor
    from sfmonitor.detectors import UpdateRatioSpike

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config={"console": False})
    g = torch.Generator().manual_seed(1)
    for i in range(40):
        loss = model(torch.randn(8, 4, generator=g)).pow(2).mean() * (1e3 if i == 35 else 1.0)
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
    assert [(e.step, e.actions) for e in mon.events if e.actions] == [(35, ["skip_step"])]
    det = next(d for d in mon._detectors if isinstance(d, UpdateRatioSpike))
    assert len(det.loss_moves) == 38  # the updates of steps 0-38 but 35, each judged at the next step
    assert sum(m > math.log(100) for m in det.loss_moves) == 1  # 34 -> 35, not 35 -> 36
    mon.detach()


class _HeldBatch(nn.Module):
    """A model that holds its data and takes none as input (``forward(rows=None)``: the rows of
    it to use, a slice): its inputs show nothing of the batch."""

    def __init__(self, net, x):
        super().__init__()
        self.net, self.x = net, x

    def forward(self, rows=None):
        return self.net(self.x if rows is None else self.x[rows])


def _full_batch_run(tmp_path, steps, monitored, then=0, held=False):
    """Full-batch gradient descent at the edge of stability (Cohen et al. 2021, arXiv
    2103.00065): an MLP on one fixed batch at an LR past 2/sharpness, whose loss rises and falls
    back by itself. ``held``: the batch is held by the model (``_HeldBatch``), so only a replay
    can show the loop feeds the same batch."""
    g = torch.Generator().manual_seed(500)
    blur = functools.partial(nn.functional.interpolate, size=(8, 8), mode="bilinear", align_corners=False)
    templates = blur(torch.randn(10, 3, 3, 3, generator=g))  # tiny blurred "images", 10 classes
    labels = torch.randint(0, 10, (1000,), generator=g)
    x = (
        0.6 * templates[labels]
        + blur(torch.randn(1000, 3, 4, 4, generator=g))
        + 0.3 * torch.randn(1000, 3, 8, 8, generator=g)
    )
    x = ((x - x.mean()) / x.std()).flatten(1)
    y = nn.functional.one_hot(labels, 10).float()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(192, 200), nn.Tanh(), nn.Linear(200, 200), nn.Tanh(), nn.Linear(200, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    root = _HeldBatch(model, x) if held else model
    mon = sfmonitor.attach(root, opt, run_dir=tmp_path, sinks=[], config=quiet()) if monitored else None
    for _ in range(steps):
        loss = 0.5 * ((root() if held else model(x)) - y).pow(2).sum(1).mean()
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
    for i in range(then):  # then mini-batches of 100, at a lower LR, one of them with a 1e4x loss
        opt.param_groups[0]["lr"] = 0.05
        part = slice(100 * (i % 10), 100 * (i % 10 + 1))
        out = root(part) if held else model(x[part])
        loss = 0.5 * (out - y[part]).pow(2).sum(1).mean() * (1e4 if i == then - 5 else 1)
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.detach()
    return model, mon


@pytest.mark.parametrize("held", [False, True])
def test_full_batch_training_is_found_when_a_skip_replays_and_its_loss_rises_are_told(tmp_path, held):
    """In full-batch training a skipped step is followed by the same batch on the same state: the
    same loss, bit for bit, and the same skip (a helper's edge-of-stability probe: 8 skips in a
    row per rise, then a new level, 16-32 steps lost per run, held-out up to 1.035x bare). Once
    the loss on a state a skip put back equals that state's loss before (on inputs equal to the
    steps' before, where the model takes any: ``held`` False), the loop is known to feed one
    batch: its loss spikes, and updates judged harmful by the loss they raised (the run's own
    edge-of-stability rises), are told, not acted on. One step is lost: the run goes on one step
    behind the bare run, bit for bit."""
    model, mon = _full_batch_run(tmp_path / "mon", 120, monitored=True, held=held)
    acted = [(e.step, e.kind, e.actions) for e in mon.events if e.actions]
    assert len(acted) == 1 and acted[0][1:] == ("loss_spike", ["skip_step"])
    told = [e for e in mon.events if e.data.get("fixed_batch") is not None]
    assert told and told[0].step == acted[0][0] + 1 and "same batch every step" in told[0].message
    assert ("on inputs equal" in told[0].message) is not held
    bare, _ = _full_batch_run(tmp_path / "bare", 119, monitored=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))


def _fixed_input_run(tmp_path, fault):
    """A coordinate-based regression (a NeRF-like fit): the model's input is one fixed grid of
    coordinates every step, its targets a new noisy sample each step, which the model never sees.
    ``fault``: "targets" (x4 at step 60) or "lr" (x30 for step 60)."""
    torch.manual_seed(0)
    grid = torch.stack(torch.meshgrid(torch.linspace(-1, 1, 16), torch.linspace(-1, 1, 16), indexing="ij"), -1)
    grid = grid.reshape(-1, 2)
    clean = torch.sin(3 * grid[:, :1]) * torch.cos(2 * grid[:, 1:])
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=quiet())
    g = torch.Generator().manual_seed(1)
    for i in range(90):
        y = clean + 0.1 * torch.randn(clean.shape, generator=g)
        if fault == "targets" and i == 60:
            y = y * 4
        opt.param_groups[0]["lr"] = 3e-3 * (30 if fault == "lr" and i == 60 else 1)
        mon.combine(nn.functional.mse_loss(model(grid), y)).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    return mon


def test_a_constant_input_with_targets_that_change_is_no_full_batch(tmp_path):
    """Equal inputs are not the same batch: a loop that feeds one fixed input (a grid of
    coordinates, a prompt, one-hot rows whose sums never change) while its targets change every
    step. Taken for full-batch training from its inputs alone (a probe of this session's first
    version), a batch with targets x4 landed and an update at 30x the LR was only told; a replay on
    a state put back shows it is not: the bad batch is skipped and the update undone."""
    mon = _fixed_input_run(tmp_path / "t", "targets")
    assert [e.actions for e in mon.events if e.step == 60 and e.kind == "loss_spike"] == [["skip_step"]]
    assert not [e for e in mon.events if e.data.get("fixed_batch") is not None]
    mon = _fixed_input_run(tmp_path / "l", "lr")
    assert any("undo" in e.actions for e in mon.events if e.kind == "update_ratio_spike")
    assert not [e for e in mon.events if e.data.get("fixed_batch") is not None]


def _repeated_batch_run(tmp_path, repeats, refill=False):
    """Mini-batches each fed ``repeats`` steps in a row (data echoing), the batch of steps 60-60+repeats
    with a 1e4x loss; ``refill``: every batch is copied into one preallocated tensor (the same
    object every step, changed in place)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=quiet())
    g = torch.Generator().manual_seed(0)
    buf = torch.empty(32, 8)
    for i in range(90):
        if i % repeats == 0:
            x = torch.randn(32, 8, generator=g)
            if refill:
                buf.copy_(x)
                x = buf
            y = x.sum(1, keepdim=True).sin() * (1e2 if 60 <= i < 60 + repeats else 1)
        loss = nn.functional.mse_loss(model(x), y)
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    return mon


def test_a_batch_fed_a_few_steps_or_a_buffer_refilled_in_place_is_no_full_batch(tmp_path):
    """The inputs tell full-batch training only after ``FIXED_BATCH_INPUTS`` steps in a row with
    equal inputs: a loop that feeds each batch a few steps in a row (data echoing) has its bad
    batch skipped each time it comes (a skip, then the same batch on the same state, is no full
    batch where the inputs show they change); so has a loop that copies each batch into one
    preallocated tensor."""
    mon = _repeated_batch_run(tmp_path / "echo", 3)
    spikes = {e.step: e.actions for e in mon.events if e.kind == "loss_spike"}
    assert spikes == {60: ["skip_step"], 61: ["skip_step"], 62: ["skip_step"]}
    assert not [e for e in mon.events if e.data.get("fixed_batch") is not None]
    mon = _repeated_batch_run(tmp_path / "refill", 1, refill=True)
    assert [e.actions for e in mon.events if e.step == 60 and e.kind == "loss_spike"] == [["skip_step"]]
    assert not [e for e in mon.events if e.data.get("fixed_batch") is not None]


def test_full_batch_training_found_once_is_not_assumed_for_good(tmp_path):
    """The loop's batches may change after a stretch of full-batch steps (a sanity check that
    overfits one batch, then the real data): full-batch training found by a replay is assumed for
    ``FIXED_BATCH_STEPS`` steps after it, not for the rest of the run, so a bad batch of the
    mini-batches that come after is skipped again."""
    _, mon = _full_batch_run(tmp_path / "mon", 120, monitored=True, then=260, held=True)
    late = [e for e in mon.events if e.step == 120 + 260 - 5]
    assert [e.actions for e in late if e.kind == "loss_spike"] == [["skip_step"]]


def test_a_clamped_loss_that_repeats_its_cap_is_no_full_batch(tmp_path):
    """A loop that clamps its loss (``loss.clamp(max=5)``) gives every bad batch the same loss, 5.0
    to the last bit, on the same state after a skip: the loss alone read as full-batch training, and
    the second bad batch in a row was told, not skipped. The replay must show in the gradients too
    (their norm, equal and not zero: a clamped loss has none)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=quiet())
    g = torch.Generator().manual_seed(0)
    for i in range(60):
        x = torch.randn(32, 8, generator=g)
        y = x.sum(1, keepdim=True).sin() * (1e3 if i in (50, 51) else 1)
        loss = nn.functional.mse_loss(model(x), y).clamp(max=5.0)
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    acted = {e.step: e.actions for e in mon.events if e.kind == "loss_spike"}
    assert acted == {50: ["skip_step"], 51: ["skip_step"]}


def _finish(mon, model, opt):
    """The run's state and the monitor's events that acted (none when bare), the monitor detached."""
    events = [(e.step, e.kind, e.actions) for e in mon.events if e.actions] if mon else []
    if mon:
        mon.detach()
    return snapshot(model, opt), events


def _last_batch_run(tmp_path, monitored, seed, task, bad_epoch=None):
    """A DataLoader with drop_last=False: 1027 examples in batches of 64, the epoch's last batch of 3."""
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(1027, 20, generator=g)
    if task == "cls":
        w = torch.randn(20, 5, generator=g)
        y_all = (x_all @ w + 0.8 * torch.randn(1027, 5, generator=g)).argmax(1)
    else:
        w = torch.randn(20, 1, generator=g)
        y_all = x_all @ w + 0.5 * torch.randn(1027, 1, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5 if task == "cls" else 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    mon = (
        sfmonitor.attach(model, opt, run_dir=tmp_path / f"{monitored}{seed}{task}", config=quiet())
        if monitored
        else None
    )
    data = torch.utils.data.TensorDataset(x_all, y_all)
    loader = torch.utils.data.DataLoader(
        data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    for epoch in range(30):
        for x, y in loader:
            if epoch == bad_epoch and len(x) < 64:
                y = y * 1000.0 if task == "reg" else torch.randint(0, 5, y.shape, generator=g)
            out = model(x)
            loss = nn.functional.cross_entropy(out, y) if task == "cls" else nn.functional.mse_loss(out, y)
            (mon.combine(loss) if mon else loss).backward()
            opt.step()
            opt.zero_grad()
    return _finish(mon, model, opt)


@pytest.mark.parametrize("task", ["cls", "reg"])
def test_an_epochs_short_last_batch_is_no_spike(tmp_path, task):
    """drop_last=False (the DataLoader's default): every epoch ends with a batch of 3 where the
    others hold 64, its loss and gradient norm ~4.6x noisier (sqrt(64 / 3)). Judged as a full
    batch, it was skipped as a loss spike or clipped as a gradient spike 2-5 times in 30 epochs
    (7 of 8 healthy runs). The tests read a batch's size from its inputs and widen by it; a garbage
    short batch (targets x1000) is still skipped."""
    for seed in (0, 1):
        bare, _ = _last_batch_run(tmp_path, False, seed, task)
        state, events = _last_batch_run(tmp_path, True, seed, task)
        assert events == [], (seed, events)
        assert_identical(bare, state)
    if task == "reg":
        _, events = _last_batch_run(tmp_path, True, 0, task, bad_epoch=20)
        assert events == [(20 * 17 + 16, "loss_spike", ["skip_step"])]


def _multitask_run(tmp_path, monitored, seed, share=0.05, garbage_at=None):
    """Two tasks on one trunk, each batch one task's (the rare one 5% of batches), its loss given to
    combine() under the task's name: a regression whose loss is ~0.1 and a classification at ~1.5."""
    g = torch.Generator().manual_seed(seed)
    wa, wb = torch.randn(20, 1, generator=g), torch.randn(20, 5, generator=g)
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {"trunk": nn.Sequential(nn.Linear(20, 64), nn.ReLU()), "a": nn.Linear(64, 1), "b": nn.Linear(64, 5)}
    )
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path / f"{monitored}{seed}", config=quiet()) if monitored else None
    for t in range(600):
        x = torch.randn(32, 20, generator=g)
        h = model["trunk"](x)
        if torch.rand(1, generator=g).item() < share:
            y = (x @ wb + 2.0 * torch.randn(32, 5, generator=g)).argmax(1)
            name, loss = "b", nn.functional.cross_entropy(model["b"](h), y)
        else:
            target = x @ wa if t != garbage_at else torch.randn(32, 1, generator=g) * 1e3
            name, loss = "a", 0.1 * nn.functional.mse_loss(model["a"](h), target)
        (mon.combine({name: loss}) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
    return _finish(mon, model, opt)


def test_a_rare_tasks_batches_are_judged_against_that_task(tmp_path):
    """A multi-task loop whose batches each carry one task's loss, named in combine(): the rare
    task's loss is 10-20x the usual one's. Judged against the usual task's, 16-27 of its ~30
    batches in 600 steps were skipped as loss spikes (the task starved) and its gradients told or
    clipped as spikes. Each set of components now has its own windows: no action, bit-identical;
    a garbage batch of the usual task is still skipped."""
    for seed in (0, 1):
        bare, _ = _multitask_run(tmp_path, False, seed)
        state, events = _multitask_run(tmp_path, True, seed)
        assert events == [], (seed, events)
        assert_identical(bare, state)
    _, events = _multitask_run(tmp_path / "bad", True, 0, garbage_at=400)
    assert events == [(400, "loss_spike", ["skip_step"])]


def _surgery_run(tmp_path, monitored, seed, surgery, at=200, steps=320, garbage_at=None, config=None):
    """An MLP classifier under Adam whose loop changes the weights itself at step ``at``, between
    two optimizer steps: ``reset`` re-initialises the head (``reset_parameters()``), ``load`` loads
    the model and the optimizer from copies taken 100 steps before (``load_state_dict``),
    ``shrink`` halves every weight and adds noise (shrink and perturb), ``clamp`` clamps every
    weight into [-0.2, 0.2] after every step from ``at`` on (a constraint the loop keeps),
    ``data_clamp`` the same through ``p.data``, ``data_noise`` adds noise to every weight through
    ``p.data`` before every step from ``at`` on; ``data_prune`` zeroes the 90% smallest weights of
    the first layer through ``p.data`` (``data_remask``: the 50% smallest, then kept at zero after
    every step),
    ``prune`` prunes them with ``torch.nn.utils.prune``;
    ``center`` replaces a buffer of the head with a new tensor before every step. The
    batch of ``garbage_at`` has its inputs x100."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(20, 5, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    if surgery == "center":
        model[2].register_buffer("center", torch.zeros(5))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    config = quiet(**(config or {}))
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path / f"{monitored}{seed}", config=config) if monitored else None
    saved = None
    for t in range(steps):
        if surgery == "center":  # a buffer the loop replaces after every step (DINO's teacher centre)
            model[2].center = 0.9 * model[2].center + 0.1 * model[2].bias.detach()
        if surgery == "load" and t == at - 100:
            saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        with torch.no_grad():
            if t == at and surgery == "reset":
                model[2].reset_parameters()
            elif t == at and surgery == "load" and saved is not None:
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            elif t == at and surgery == "shrink":
                for p in model.parameters():
                    p.mul_(0.5).add_(0.01 * torch.randn(p.shape, generator=g))
            elif t >= at and surgery == "clamp":
                for p in model.parameters():
                    p.clamp_(-0.2, 0.2)
            elif t >= at and surgery == "data_clamp":  # (through .data: no version counter moves)
                for p in model.parameters():
                    p.data.clamp_(-0.2, 0.2)
            elif t >= at and surgery == "data_noise":
                for p in model.parameters():
                    p.data.add_(0.003 * torch.randn(p.shape, generator=g))
            elif t == at and surgery in ("data_prune", "data_remask"):  # magnitude pruning by hand
                first = model[0].weight
                share = 0.9 if surgery == "data_prune" else 0.5
                mask = first.abs() > first.abs().flatten().kthvalue(int(share * first.numel())).values
                first.data.mul_(mask)
            elif t > at and surgery == "data_remask":  # the mask kept on the weights after every step
                model[0].weight.data.mul_(mask)
            elif t == at and surgery == "prune":  # torch.nn.utils.prune: a mask buffer, the weights untouched
                torch.nn.utils.prune.l1_unstructured(model[0], "weight", 0.9)
        x = torch.randn(64, 20, generator=g)
        y = (x @ w + 0.5 * torch.randn(64, 5, generator=g)).argmax(1)
        loss = nn.functional.cross_entropy(model(x * 100 if t == garbage_at else x), y)
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
    told = [(e.step, e.kind, e.data.get("reason", "")) for e in mon.events if not e.actions] if mon else []
    return (*_finish(mon, model, opt), told)


@pytest.mark.parametrize(
    ("surgery", "named"),
    [
        ("reset", "the loop changed the weights of group 2"),
        ("load", "the loop changed the weights of groups"),
        ("shrink", "the loop changed the weights of groups"),
        ("data_prune", "weights of group 0 written through .data"),
        ("prune", "buffer 0.weight_mask (added)"),
    ],
)
def test_weights_the_loop_changes_between_steps_are_a_new_regime_not_bad_batches(tmp_path, surgery, named):
    """A head re-initialised, a checkpoint loaded, shrink and perturb, 90% of a layer pruned: the
    loop itself changed the model after the last update, and the loss jumps (2-4x). Judged as bad
    batches on a sound state, the 8 batches after the change were skipped (level shift, then
    learnt afresh): held-out loss 1.001-1.005x bare, 1.024-1.028x after pruning in a probe. The
    parameters' version counters show the first three. Pruning moves none: through
    ``p.data.mul_(mask)`` the weights' distance from the undo copy is not what the last update
    moved; ``torch.nn.utils.prune`` registers a mask buffer and leaves the weights as they were.
    Both are looked for where the loss jumps. The detectors learn what is usual afresh from that
    step (told `new_regime`, naming what changed), no action, bit-identical; a garbage batch 80
    steps later is still skipped."""
    for seed in (0, 1):
        bare, _, _ = _surgery_run(tmp_path / "b", False, seed, surgery)
        state, events, told = _surgery_run(tmp_path / "m", True, seed, surgery)
        assert events == [], (seed, events)
        assert_identical(bare, state)
        regimes = [(s, r) for s, k, r in told if k == "new_regime"]
        assert len(regimes) == 1 and regimes[0][0] == 200 and named in regimes[0][1], told
    _, events, _ = _surgery_run(tmp_path / "g", True, 0, surgery, garbage_at=280)
    assert events == [(280, "loss_spike", ["skip_step"])]


def test_a_constraint_the_loop_applies_after_every_step_is_no_new_regime_each_time(tmp_path):
    """Weights clamped after every step (a WGAN critic's constraint, a max-norm projection): the
    loop changes them between every two steps, and that is its training, not a change of it. Told
    once, when it starts; a garbage batch is still skipped."""
    bare, _, _ = _surgery_run(tmp_path / "b", False, 0, "clamp")
    state, events, told = _surgery_run(tmp_path / "m", True, 0, "clamp")
    assert events == []
    assert_identical(bare, state)
    assert [s for s, k, _ in told if k == "new_regime"] == [200]
    _, events, _ = _surgery_run(tmp_path / "g", True, 0, "clamp", garbage_at=280)
    assert events == [(280, "loss_spike", ["skip_step"])]


@pytest.mark.parametrize("surgery", ["data_clamp", "data_noise"])
def test_writes_through_data_after_every_step_leave_garbage_batches_skipped(tmp_path, surgery):
    """``p.data.clamp_`` after every step (the original WGAN critic's clip), or noise added to the
    weights through ``p.data`` before every step (weight noise): no counter shows either, and a
    garbage batch's jump finds the weights changed since the last update. A clamp kept after every
    step writes less than the update moved (too little to explain a jump); the noise writes more,
    but sampled every 16 steps it is known for the loop's habit before the jump. The garbage batch
    is skipped, not taken for a change of the model; the healthy run stays bit-identical."""
    bare, _, _ = _surgery_run(tmp_path / "b", False, 0, surgery)
    state, events, _ = _surgery_run(tmp_path / "m", True, 0, surgery)
    assert events == []
    assert_identical(bare, state)
    _, events, told = _surgery_run(tmp_path / "g", True, 0, surgery, garbage_at=280)
    assert events == [(280, "loss_spike", ["skip_step"])]
    assert not [s for s, k, _ in told if k == "new_regime"], told


@pytest.mark.parametrize("fraction", [0.05, 1.0])
def test_pruning_through_data_is_seen_without_the_undo_copy_on_what_the_update_ratio_measures(tmp_path, fraction):
    """Without the undo copy the update ratio measures its own copy: in the lean profile a slice
    of each parameter (5%, moving every step), else the whole parameters. Their norms as the update
    left them against their norms at the next step are the same lower bound on a write there: 90%
    of a layer pruned through ``p.data`` writes into any slice. Before, the next 8 batches were
    skipped (held-out 1.17x bare in a helper's probe); now a `new_regime` naming the weights,
    bit-identical to bare, and a garbage batch later is still skipped."""
    lean = {"actions": {"undo": {"enabled": False}}, "stats": {"update_ratio_fraction": fraction}}
    bare, _, _ = _surgery_run(tmp_path / "b", False, 0, "data_prune")
    state, events, told = _surgery_run(tmp_path / "m", True, 0, "data_prune", config=lean)
    assert events == []
    assert_identical(bare, state)
    regimes = [(s, r) for s, k, r in told if k == "new_regime"]
    assert len(regimes) == 1 and regimes[0][0] == 200 and "written through .data" in regimes[0][1], told
    _, events, _ = _surgery_run(tmp_path / "g", True, 0, "data_prune", garbage_at=280, config=lean)
    assert events == [(280, "loss_spike", ["skip_step"])]


def test_a_garbage_batch_soon_after_a_mask_is_kept_on_the_weights_is_still_skipped(tmp_path):
    """Half of a layer pruned through ``p.data`` at step 200 (the loss does not jump: nothing is
    looked for), the mask then re-applied after every step (lottery tickets): a garbage batch 5
    steps later finds the weights written since the last update, but by less than that update moved
    them (the mask zeroes what the optimizer moved), too little to explain a jump. Before the
    sampling (every 16 steps) had seen the habit, it was taken for a change of the model and landed
    (a helper's probe: 3 of 3). Skipped."""
    bare, _, _ = _surgery_run(tmp_path / "b", False, 0, "data_remask")
    state, events, told = _surgery_run(tmp_path / "m", True, 0, "data_remask")
    assert events == [] and told == []
    assert_identical(bare, state)
    _, events, told = _surgery_run(tmp_path / "g", True, 0, "data_remask", garbage_at=205)
    assert events == [(205, "loss_spike", ["skip_step"])]
    assert not [s for s, k, _ in told if k == "new_regime"], told


def test_a_buffer_the_loop_replaces_every_step_is_its_habit_not_a_change_of_the_model(tmp_path):
    """A buffer given a new tensor before every step (DINO's ``self.center = ...``): its slot
    changes at every step's end, so at a garbage batch's jump the new tensor there is the loop's
    habit, not a change of the model: the batch is skipped."""
    _, events, told = _surgery_run(tmp_path / "g", True, 0, "center", garbage_at=280)
    assert events == [(280, "loss_spike", ["skip_step"])]
    assert not [s for s, k, _ in told if k == "new_regime"], told


def test_buffer_slots_added_replaced_or_removed_are_named_and_a_habit_is_left_out():
    """``LoopWrites`` keeps each module's buffer slots as a step leaves them: a slot added, given a
    new tensor or removed since is named (an in-place write is not: forwards write BatchNorm's
    statistics so); a module whose buffers changed at one of the last ``habit`` steps' ends is
    left out; values are sampled the step after one was found and every ``SAMPLE_EVERY`` steps
    (a jump asks on its own), and a value found within ``habit`` steps of the last is no news."""
    from sfmonitor.loopwrites import SAMPLE_EVERY, LoopWrites

    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    lw = LoopWrites()
    lw.watch(list(model.named_modules()))
    lw.close([], 0)
    model[1].running_mean.add_(1.0)  # in place: no slot changed
    assert lw.buffers_changed(1, 50) == []
    model[0].register_buffer("mask", torch.ones(2, 2))
    model[1].running_var = torch.ones(2)
    del model[1]._buffers["num_batches_tracked"]
    assert sorted(lw.buffers_changed(1, 50)) == [
        "0.mask (added)",
        "1.num_batches_tracked (removed)",
        "1.running_var (replaced)",
    ]
    lw.close([], 1)  # (the step's end sees them changed: a change again within 50 steps is a habit)
    model[0].mask = torch.zeros(2, 2)
    assert lw.buffers_changed(2, 50) == []
    assert lw.buffers_changed(60, 50) == ["0.mask (replaced)"]
    assert not lw.values_due(5) and lw.values_due(2 * SAMPLE_EVERY)
    assert lw.values_found(5, 50)  # the first: news
    assert lw.values_due(6)  # the step after: is it the loop's habit?
    assert not lw.values_found(6, 50) and lw.values_found(57, 50)


def test_the_parameters_the_loop_wrote_are_named_and_an_untouched_step_costs_no_object_per_parameter():
    """``LoopWrites.changed`` names the parameters written in place or given new storage since the
    last ``close`` (not the monitor's own writes); a step where nothing was written is told from
    the parameters' addresses and version counters with nothing made per parameter (before, every
    ``close`` kept a tuple per parameter: on 2,000 parameters the garbage collector ran twice)."""
    from sfmonitor.loopwrites import LoopWrites, own_write

    params = [nn.Parameter(torch.randn(3)) for _ in range(2000)]
    lw = LoopWrites()
    lw.watch([])
    assert lw.changed(params) == []  # (before the first close)
    assert collector_runs(lambda: (lw.close(params, 0), lw.changed(params))) == []
    with torch.no_grad():
        params[3].mul_(2.0)
    params[7].data = torch.zeros(3)
    with torch.no_grad():
        params[9].add_(1.0)
    own_write([params[9]])  # (the monitor's own write: not the loop's)
    assert lw.changed(params) == [3, 7]
    lw.close(params, 1)
    assert lw.changed(params) == []
    assert lw.changed([nn.Parameter(torch.zeros(1)), *params[1:]]) == []  # (a new parameter is not counted)


def _resize_run(tmp_path, monitored, seed, at=150, steps=260, garbage_at=None, spike_at=None):
    """Progressive resizing: a BatchNorm CNN with global pooling classifies noisy class templates
    at 16x16 until ``at``, then at 32x32 (the same images, sharper): the loss jumps ~4x and the
    model relearns. The batch of ``garbage_at`` has random labels and its inputs x30; that of
    ``spike_at`` a loss x1000."""
    g = torch.Generator().manual_seed(seed)
    templates = nn.functional.interpolate(torch.randn(10, 3, 8, 8, generator=g), size=32, mode="bilinear")
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path / f"{monitored}{seed}", config=quiet()) if monitored else None
    for t in range(steps):
        y = torch.randint(0, 10, (32,), generator=g)
        x = 0.6 * templates[y] + torch.randn(32, 3, 32, 32, generator=g)
        x = torch.roll(x, shifts=tuple(torch.randint(-3, 4, (2,), generator=g).tolist()), dims=(2, 3))
        if t < at:
            x = nn.functional.interpolate(x, size=16, mode="bilinear", antialias=True)
        if t == garbage_at:
            x, y = 30 * x, torch.randint(0, 10, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y) * (1000.0 if t == spike_at else 1.0)
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
    told = [(e.step, e.kind, e.data.get("reason", "")) for e in mon.events if not e.actions] if mon else []
    shapes = [(e.data["shapes"], e.message) for e in mon.events if e.data.get("reason") == "input shape"] if mon else []
    return (*_finish(mon, model, opt), told, shapes)


def test_inputs_of_a_new_shape_that_move_the_loss_are_new_data_not_bad_batches(tmp_path):
    """Progressive resizing (images 16 -> 32 pixels mid-run, fast.ai and FFCV recipes) or a longer
    sequence length: the loss jumps with the inputs' shape. Judged as bad batches on a sound
    state, the 8 batches after the change were skipped (held-out loss 1.015-1.051x bare). The
    inputs' shape per example is one the last steps did not have: a spike that comes with it is
    the new data's, and the detectors learn what is usual afresh (told `new_regime`); no action,
    bit-identical. A garbage batch of the usual shape is still skipped."""
    for seed in (0, 1):
        bare, _, _, _ = _resize_run(tmp_path / "b", False, seed)
        state, events, told, shapes = _resize_run(tmp_path / "m", True, seed)
        assert events == [], (seed, events)
        assert_identical(bare, state)
        assert [(s, r) for s, k, r in told if k == "new_regime"] == [(150, "input shape")], told
        # the shape is named (it was "on another rank", in one process, the shapes list empty)
        assert shapes == [([[[3, 32, 32]]], shapes[0][1])] and "(3 x 32 x 32 per example)" in shapes[0][1]
    _, events, _, _ = _resize_run(tmp_path / "g", True, 0, garbage_at=220)
    assert events == [(220, "loss_spike", ["skip_step"])]
    # the new shape, once its jump was taken as new data, is judged as usual: a garbage batch of
    # it two steps later (judged by the fresh windows' prior: a gross one) is skipped
    _, events, _, _ = _resize_run(tmp_path / "g2", True, 0, spike_at=152)
    assert events == [(152, "loss_spike", ["skip_step"])]


def test_a_shape_is_new_for_a_few_steps_after_it_first_comes():
    """An input shape the last 64 steps did not have stays new for 8 steps from its first batch
    (a sequence-length curriculum's jump came at its third batch); shapes seen lately, and a step
    with no history before it, are not new; a shape gone for more than 64 steps is new again."""
    mon = sfmonitor.Monitor(config=quiet())
    seen = []
    for step in range(200):
        shape = ((16,),) if step < 100 or 180 <= step < 190 else ((64,),)  # (64 back at 190: seen lately)
        mon._recorder.shapes = {shape}
        seen.append(mon._input_shapes_new(step))
    assert [s for s, new in enumerate(seen) if new] == list(range(100, 108)) + list(range(180, 188))
