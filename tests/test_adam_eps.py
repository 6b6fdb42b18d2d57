"""adam_eps: an Adam-family optimizer whose eps is too large for its gradients, told, nothing changed."""

from __future__ import annotations

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor
from sfmonitor import stats as S
from sfmonitor.detectors import AdamEps, AdamEpsConfig


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))


def _run(tmp_path, eps, steps=60, optimizer=torch.optim.AdamW, monitored=True, config=None, **kw):
    model = _model()
    opt = optimizer(model.parameters(), lr=1e-3, eps=eps, **kw) if eps is not None else optimizer(model.parameters())
    mon = (
        sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=quiet(**(config or {}))) if monitored else None
    )
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 1, generator=g)
    seen = {}
    for step in range(steps):
        x = torch.randn(64, 32, generator=g)
        loss = (model(x) - torch.tanh(x @ w)).pow(2).mean()
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            seen.update({(step, k): v for k, v in mon.stats.items() if k.startswith("adam_eps/")})
    events = list(mon.events) if mon else []
    if mon:
        mon.detach()
    return model, events, seen


def test_shares_under_eps_with_the_bias_correction_weighed_by_the_first_moment():
    p, q = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p, q], lr=1e-3, eps=1e-2, betas=(0.9, 0.99))
    # step 1: bias correction 1 - 0.99 = 0.01, so v < eps^2 * 0.01 = 1e-6 is under eps
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg_sq": torch.tensor([0.0, 5e-7, 2e-6, 1.0])}
    opt.state[q] = {
        "step": torch.tensor(1.0),
        "exp_avg_sq": torch.tensor([1e-9, 1e-9]),
        "max_exp_avg_sq": torch.ones(2),
    }
    out = S.eps_dominated(opt, {id(p): "a", id(q): "b"})
    assert out["adam_eps/a"].values.tolist() == [1.0, 3.0]  # the zero is not counted (no exp_avg: counts)
    assert out["adam_eps/b"].values.tolist() == [0.0, 2.0]  # amsgrad: the max the step divides by
    values = {k: v.values.tolist() for k, v in out.items()}
    S.shares(values, "adam_eps/")
    assert values == {"adam_eps/a": pytest.approx(1 / 3), "adam_eps/b": 0.0}
    # a later step: the correction is ~1, the same v is no longer under eps
    opt.state[p]["step"] = torch.tensor(1000.0)
    assert S.eps_dominated(opt, {id(p): "a"})["adam_eps/a"].values.tolist() == [2.0, 3.0]
    # With a first moment, each element weighs |m|, its step's numerator: a weight the optimizer
    # barely moves (a rarely seen embedding row, its m decayed) counts little.
    opt.state[p]["step"] = torch.tensor(1.0)
    opt.state[p]["exp_avg"] = torch.tensor([5.0, 1e-6, 3.0, 1.0])
    assert S.eps_dominated(opt, {id(p): "a"})["adam_eps/a"].values.tolist() == pytest.approx([1e-6, 4.0 + 1e-6])
    # SGD has no eps and no second moment: nothing
    assert S.eps_dominated(torch.optim.SGD([p], lr=0.1), {id(p): "a"}) == {}


def test_a_large_eps_is_told_once_per_group_and_changes_nothing(tmp_path):
    bare, _, _ = _run(tmp_path / "bare", 0.1, monitored=False)
    model, events, seen = _run(tmp_path / "mon", 0.1)
    # The first layer's gradients are ~1e-2 and under eps everywhere; the output layer's are
    # larger: judged per group, only the first is told.
    (told,) = [e for e in events if e.kind == "adam_eps"]
    assert told.step == 50 and told.actions == [] and told.message.startswith("in group 0,")
    assert told.data["share"] == seen[(50, "adam_eps/0")] == 1.0 and seen[(50, "adam_eps/2")] < 0.5
    assert (10, "adam_eps/0") not in seen  # sampled every 50 steps
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters()))


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam])
def test_the_default_eps_is_silent(tmp_path, optimizer):
    _, events, seen = _run(tmp_path, 1e-8, steps=101, optimizer=optimizer)
    assert not [e for e in events if e.kind == "adam_eps"]
    assert seen and max(seen.values()) < 0.01


def test_off_and_other_optimizers_measure_nothing(tmp_path):
    _, events, seen = _run(tmp_path / "off", 0.1, config={"stats": {"adam_eps_every": 0}})
    assert not seen and not [e for e in events if e.kind == "adam_eps"]
    _, events, seen = _run(tmp_path / "sgd", None, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    assert not seen and not events


def test_told_again_only_after_the_share_fell_under_half():
    det = AdamEps(AdamEpsConfig(threshold=0.5))
    assert [f.where for f in det.check(50, {"adam_eps/a": 0.9})] == ["a"]
    assert det.check(100, {"adam_eps/a": 0.9}) == [] and det.check(150, {"adam_eps/a": 0.3}) == []
    assert det.check(200, {"adam_eps/a": 0.2}) == []  # under half: re-armed
    assert [f.where for f in det.check(250, {"adam_eps/a": 0.6})] == ["a"]
