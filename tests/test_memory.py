"""What the monitor holds: the exact-undo copy and the rollback snapshots, bounded and reported."""

import json
import warnings

import pytest
import torch
from torch import nn

import sfmonitor
from sfmonitor.checkpoint import SnapshotRing, capture_state, tree_nbytes
from sfmonitor.summary import format_memory

QUIET = {"console": False}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))


def _train(mon, model, opt, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()


def test_snapshot_ring_keeps_within_its_byte_budget_oldest_first():
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    one = tree_nbytes(capture_state(model))  # parameters, buffers, RNG states
    ring = SnapshotRing(every=1, keep=5, max_bytes=int(2.5 * one))
    for label in range(4):
        ring.take(label, model)
    assert ring.labels == [2, 3] and ring.nbytes <= ring.max_bytes and ring.too_big is None
    ring.discard_after(2)
    assert ring.labels == [2] and ring.nbytes == pytest.approx(one, rel=0.01)
    # a snapshot larger than the whole budget is not taken, and says how large it was
    small = SnapshotRing(every=1, keep=3, max_bytes=one // 2)
    small.take(0, model, opt)
    assert len(small) == 0 and small.too_big is not None and small.too_big >= one
    with pytest.raises(ValueError, match="max_bytes"):
        SnapshotRing(max_bytes=-1)
    # what the run holds beside the snapshots (a trial's left state, the state before a level
    # shift) shares the budget: the oldest go to make room; with no room at all, none is taken and
    # none dropped
    ring = SnapshotRing(every=1, keep=5, max_bytes=int(3.5 * one))
    for label in range(3):
        ring.take(label, model)
    ring.beside = int(1.2 * one)
    ring.take(3, model)
    assert ring.labels == [2, 3] and ring.nbytes + ring.beside <= ring.max_bytes
    ring.beside = int(3 * one)
    ring.take(4, model)
    assert ring.labels == [2, 3] and ring.too_big is None


def test_attach_reports_what_the_monitor_holds(tmp_path, capsys):
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": True})
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    b_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    plan = mon.memory
    assert plan["parameter_bytes"] == p_bytes and plan["buffer_bytes"] == b_bytes
    # AdamW's state does not exist before the first step: estimated as its two moments
    assert plan["optimizer_state_estimated"] and plan["optimizer_state_bytes"] == 2 * p_bytes
    assert plan["undo_device_bytes"] == 3 * p_bytes + b_bytes
    assert plan["snapshots_kept"] == 3 and plan["snapshot_budget_bytes"] == 2048 * 2**20
    assert json.loads((tmp_path / "run.json").read_text())["memory"] == plan
    assert "[sfmonitor] memory: exact undo" in capsys.readouterr().err
    _train(mon, model, opt, 2)
    mon.detach()
    # after a step the state is measured, not estimated: the same bytes here
    mon2 = sfmonitor.attach(model, opt, run_dir=tmp_path / "b", sinks=[], config=QUIET)
    assert not mon2.memory["optimizer_state_estimated"]
    assert mon2.memory["optimizer_state_bytes"] == 2 * p_bytes + 4 * len(list(model.parameters()))  # + steps
    mon2.detach()
    # the lean profile holds no undo copy
    cfg = {**QUIET, "actions": {"undo": {"enabled": False}}}
    mon3 = sfmonitor.attach(_net(), torch.optim.SGD(_net().parameters(), lr=0.1), run_dir=tmp_path / "c", config=cfg)
    assert mon3.memory["undo_device_bytes"] == 0 and mon3.memory["optimizer_state_bytes"] == 0
    mon3.detach()


def test_a_budget_too_small_for_one_snapshot_warns_once_and_keeps_none(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    cfg = {**QUIET, "actions": {"rollback": {"max_host_mb": 0.001, "snapshot_every": 1}}}
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=cfg)
    assert mon.memory["snapshots_kept"] == 0 and mon.memory["snapshot_host_bytes"] <= 0.001 * 2**20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(mon, model, opt, 4)
    budget = [w for w in caught if "max_host_mb" in str(w.message)]
    assert len(budget) == 1 and "no snapshot is kept" in str(budget[0].message)
    assert mon.state_dict() is not None
    mon.detach()


def test_max_host_mb_is_validated():
    with pytest.raises(sfmonitor.ConfigError, match="max_host_mb"):
        sfmonitor.MonitorConfig.from_any({"actions": {"rollback": {"max_host_mb": -1}}})


def test_rotating_slices_cover_every_element_a_fraction_at_a_time():
    from sfmonitor.stats import RotatingSlices

    tensors = [torch.arange(103.0), torch.arange(12.0).view(3, 4).t(), torch.tensor(5.0)]  # flat, strided, 0-d
    slices = RotatingSlices(0.05)
    seen = [set() for _ in tensors]
    for turn in range(40):
        live, into = slices.take(tensors, turn)
        for i, (view, buf) in enumerate(zip(live, into)):
            assert view.numel() <= [6, 3, 1][i]  # ceil(5% of 103); one row of the strided 4x3; the scalar
            assert view.data_ptr() >= tensors[i].data_ptr() and buf.shape == view.shape  # a view of the tensor
            seen[i].update(view.reshape(-1).tolist())
        torch._foreach_copy_(into, live)
        assert all(torch.equal(a, b) for a, b in zip(into, live))
    assert [len(s) for s in seen] == [103, 12, 1]
    assert [b.numel() for b in slices.buffers] == [6, 3, 1]  # one window each, allocated once


def test_rotating_slices_kept_between_steps_are_the_same_views_and_follow_a_new_storage():
    from sfmonitor.stats import RotatingSlices

    p = torch.nn.Parameter(torch.arange(103.0))
    tensors = [p.detach(), torch.arange(12.0).view(3, 4).t(), torch.tensor(5.0)]
    slices = RotatingSlices(0.05)
    again, _ = slices.take(tensors, 7)
    assert again[0] is slices.take(tensors, 7)[0][0]  # built once, then reused
    p.data = torch.arange(400.0)  # the user swapped the storage: windows and buffer built again
    live, into = slices.take([p.detach()] + tensors[1:], 0)
    assert live[0].data_ptr() == p.data_ptr() and live[0].numel() == 20 and into[0].numel() == 20
    assert torch.equal(live[0], torch.arange(20.0))


LEAN = {"actions": {"undo": {"enabled": False}}, "stats": {"update_ratio_fraction": 0.05}, "watch": {"enabled": False}}


def test_the_lean_profile_holds_five_percent_and_still_sees_an_lr_spike_in_its_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "lean"), config={"console": False, **LEAN})
    g = torch.Generator().manual_seed(1)
    ratios = []
    for step in range(40):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 4, generator=g)
        for pg in opt.param_groups:
            pg["lr"] = 1e-3 * (1e3 if step == 30 else 1.0)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        ratios.append(mon.stats.get("update_ratio/0"))
    held = sum(
        t.numel() * t.element_size()
        for t in (mon._update_buf.views if mon._update_buf else []) + (mon._slices.buffers if mon._slices else [])
    )
    mon.detach()
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < held <= 0.05 * p_bytes + 4 * len(list(model.parameters())) * 256
    assert mon.memory["undo_device_bytes"] == 0
    assert mon.memory["update_ratio_device_bytes"] == pytest.approx(0.05 * p_bytes, rel=0.01)
    assert "exact undo off, update ratio's copy" in format_memory(mon.memory)  # the attach line says so
    # A slice's ratio tells the healthy scale (AdamW moves every weight by ~lr): ~lr / rms(w)...
    healthy = [r for r in ratios[5:29] if r is not None]
    assert healthy and all(1e-4 < r < 1e-1 for r in healthy)
    # ...and the LR spike in the step it lands (seen at the next step's read).
    spikes = [e for e in mon.events if e.kind == "update_ratio_spike"]
    assert spikes and spikes[0].step == 30


@pytest.mark.parametrize("fraction", [1.0, 0.2])
def test_the_update_ratio_without_undo_measures_non_contiguous_parameters(tmp_path, fraction):
    # A channels_last conv weight is not contiguous: its slices go along dim 0 into flat buffers.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 2)).to(
        memory_format=torch.channels_last
    )
    assert not model[0].weight.is_contiguous()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = {"console": False, "actions": {"undo": {"enabled": False}}, "stats": {"update_ratio_fraction": fraction}}
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=config)
    ratios = []
    for _ in range(4):
        x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
        mon.combine(model(x).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
        ratios.append(mon.stats.get("update_ratio/0"))
    mon.detach()
    assert all(r is not None and 0 < r < 1 for r in ratios[1:])


def test_the_update_ratios_scratch_on_the_cpu_stays_within_a_cache_sized_bound(tmp_path):
    """At defaults on the CPU the update ratio's differences go through a scratch buffer of at most
    SCRATCH_ELEMENTS per dtype (1 MiB in float32), whatever the model's size: not one more copy of
    the parameters beside the undo copy. The ratios read as the whole update's, tensors larger than
    the buffer measured piece by piece."""
    from sfmonitor.undo import SCRATCH_ELEMENTS

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 300))  # 1.36M params, one > the bound
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=QUIET)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x, y = torch.randn(4, 1024, generator=g), torch.randn(4, 300, generator=g)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    want = {}
    for group in ("0", "2"):
        names = [n for n in before if n.startswith(group + ".")]
        moved = torch.stack([(model.get_parameter(n).detach() - before[n]).norm() for n in names]).norm()
        want[group] = (moved / torch.stack([before[n].norm() for n in names]).norm()).item()
    got = {group: mon.stats[f"update_ratio/{group}"] for group in want}  # (reads the last step's ratios)
    held = sum(b.numel() * b.element_size() for b in mon._scratch.buffers.values())
    mon.detach()
    assert model[0].weight.numel() > SCRATCH_ELEMENTS and SCRATCH_ELEMENTS * 4 <= 2**20
    assert 0 < held <= SCRATCH_ELEMENTS * 4
    assert got == pytest.approx(want, rel=1e-5)
