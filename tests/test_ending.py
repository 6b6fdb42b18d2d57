"""Ending well: a run whose rescue budget is spent ends a plain `monitor.batches()` loop without a
traceback, and its emergency checkpoint holds the last healthy state (never non-finite weights,
even when the damage had already landed), loadable with plain `torch.load(weights_only=True)`
into the user's own model and optimizer."""

import math

import torch
from torch import nn

import sfmonitor


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _data(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def test_a_spent_budget_ends_the_plain_loop_and_leaves_a_healthy_loadable_checkpoint(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {"console": False, "policy": {"budget": 2}, "actions": {"rollback": {"snapshot_every": 5}}}
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, config=cfg)
    steps = 0
    for x, y in mon.batches(_data(200)):  # no try/except: the loop must simply end
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        if mon.step >= 20 and not mon.should_stop:  # from step 20 on, every update lands a NaN weight
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
    mon.detach()
    assert mon.should_stop and steps < 200
    saved = [
        e.data["action_results"]["checkpoint"]
        for e in mon.events
        if "checkpoint" in e.actions and e.data["action_results"]["checkpoint"].get("saved", True)
    ]
    assert saved, [(e.step, e.kind, e.actions) for e in mon.events]
    ckpt = torch.load(saved[-1]["path"], weights_only=True)  # plain torch, no sfmonitor needed
    fresh = _net()
    fresh.load_state_dict(ckpt["model"])  # plain keys: the user's own model takes it
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(ckpt["optimizer"])
    assert all(torch.isfinite(p).all() for p in fresh.parameters()), "the checkpoint holds the last healthy state"
    assert all(math.isfinite(float(v.abs().max())) for st in fresh_opt.state.values() for v in st.values())
    # The run ends in that state too: the loop's own code after training (a final save, an
    # evaluation) meets the healthy weights, not the damage (they were left in the model).
    assert all(torch.isfinite(p).all() for p in model.parameters())
    stop = next(e for e in mon.events if "stop" in e.actions)
    assert saved[-1]["source"] == f"snapshot@{stop.data['action_results']['stop']['restored_from']}"
    final = torch.load(saved[-1]["path"], weights_only=True)["model"]
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())
