"""stale_update: updates rounded away in bf16/fp16 weights (pure low-precision training), told."""

from __future__ import annotations

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor
from sfmonitor import stats as S
from sfmonitor.detectors import StaleUpdate, StaleUpdateConfig


def _run(tmp_path, dtype, lr, steps=60, opt=torch.optim.Adam, monitored=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)
    optimizer = opt(model.parameters(), lr=lr)
    mon = sfmonitor.attach(model, optimizer, run_dir=str(tmp_path), sinks=[], config=quiet()) if monitored else None
    shares = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 16, generator=g).to(dtype)
        loss = (model(x).float() - x[:, :4].float()).pow(2).mean()
        (mon.combine(loss) if mon is not None else loss).backward()
        optimizer.step()
        optimizer.zero_grad()
        if mon is not None:
            shares.append({k: v for k, v in mon.stats.items() if k.startswith("update_stale/")})
    events = list(mon.events) if mon is not None else []
    if mon is not None:
        mon.detach()
    return model, events, shares


def test_pure_bf16_training_whose_updates_round_away_is_told_and_left_as_it_is(tmp_path):
    """Adam at LR 1e-5 on bf16 weights of ~0.1: every step of ~lr is under half a unit in the last
    place of its weight (bf16: ~0.004 |w|), so the weights never move. Told once, naming the
    groups, nothing changed."""
    model, events, shares = _run(tmp_path / "mon", torch.bfloat16, 1e-5)
    bare, _, _ = _run(tmp_path / "bare", torch.bfloat16, 1e-5, monitored=False)
    assert [e.kind for e in events] == ["stale_update"], events
    assert set(events[0].data["groups"]) == {"0", "2"} and events[0].data["share"] > 0.9
    assert events[0].actions == []
    assert "autocast" in events[0].message
    assert set(shares[-1]) == {"update_stale/0", "update_stale/2", "update_stale/total"}
    assert shares[-1]["update_stale/total"] > 0.9
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bare.state_dict().values()))


@pytest.mark.parametrize(
    "dtype, lr, opt",
    [
        (torch.bfloat16, 1e-2, torch.optim.Adam),
        (torch.float32, 1e-5, torch.optim.Adam),
        (torch.bfloat16, 0.1, torch.optim.SGD),
    ],
)
def test_updates_that_land_are_not_told(dtype, lr, opt, tmp_path):
    """bf16 weights at an LR whose steps land; fp32 weights at any LR (no update_stale key at all:
    the statistic costs nothing there); SGD, whose rounded-away elements are the ones the gradient
    barely touched."""
    _, events, shares = _run(tmp_path, dtype, lr, opt=opt)
    assert not [e for e in events if e.kind == "stale_update"], events
    if dtype == torch.float32:
        assert all(s == {} for s in shares)
    else:
        assert shares[-1] and shares[-1]["update_stale/total"] < 0.7, shares[-1]


def test_stale_shares_weigh_the_unchanged_elements_by_the_gradient():
    before = [torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)]
    after = [torch.tensor([1.0, 2.5, 3.0, 4.5], dtype=torch.bfloat16)]  # elements 0 and 2 unchanged
    grads = [torch.tensor([3.0, 1.0, 0.0, 1.0], dtype=torch.bfloat16)]  # mass 5, of it 3 unchanged
    shares = S.stale_shares(before, after, grads, [1], 2)
    assert shares.tolist() == pytest.approx([0.0, 0.6, 0.6])  # groups 0, 1, then all of them


def test_the_detector_tells_once_until_the_share_falls_under_half_its_threshold():
    det = StaleUpdate(StaleUpdateConfig(window=3, start=0))
    shares = [0.9, 0.9, 0.9, 0.9, 0.2, 0.2, 0.2, 0.9, 0.9]
    told = [len(det.check(i, {"update_stale/a": 1.0, "update_stale/total": v})) for i, v in enumerate(shares)]
    assert told == [0, 0, 1, 0, 0, 0, 0, 0, 1]
    state = det.state_dict()
    again = StaleUpdate(StaleUpdateConfig(window=3, start=0))
    again.load_state_dict(state)
    assert again.told == det.told and list(again.windows["update_stale/total"]) == [0.2, 0.9, 0.9]
    # a small group that loses every update (a LayerNorm's gains, weights near 1) is not told alone
    quiet_det = StaleUpdate(StaleUpdateConfig(window=3, start=0))
    assert not any(quiet_det.check(i, {"update_stale/ln": 1.0, "update_stale/total": 0.3}) for i in range(10))


def test_bf16_weights_the_optimizer_does_not_update_are_not_stale(tmp_path):
    """A linear probe on a bf16 backbone whose weights still take gradients (``requires_grad``
    left on, the optimizer given the head alone): no update rounds away there, none is made. Read
    as stale updates, the backbone's gradient was told as 100% rounded away, with remedies for
    rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)
    optimizer = torch.optim.Adam(model[2].parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, optimizer, run_dir=str(tmp_path), sinks=[], config=quiet())
    for i in range(40):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(i)).bfloat16()
        mon.combine((model(x).float() - x[:, :4].float()).pow(2).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
    mon.detach()
    assert "grad_norm/0" in mon.stats  # the backbone's gradients are still read
    assert not any(e.kind == "stale_update" for e in mon.events), mon.events
    assert set(k for k in mon.stats if k.startswith("update_stale/")) <= {"update_stale/2", "update_stale/total"}
