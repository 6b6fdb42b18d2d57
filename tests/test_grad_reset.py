"""A loop that forgets ``zero_grad()``: every step's gradients are added onto the earlier ones.
Nothing is non-finite and nothing jumps (grad_norm/total climbs smoothly), so no statistic test
sees it; the monitor tells it from autograd's version counter (sfmonitor/gradreset.py): event
``zero_grad_missing``, once, no action. Every way of resetting says nothing."""

from __future__ import annotations

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _loop(tmp_path, reset, steps=6, micro=1, opt_cls=torch.optim.SGD, scaler=None, model=None, config=None):
    """``steps`` optimizer steps of ``micro`` backward passes each; ``reset(model, opt, step)``
    where a loop would call zero_grad (the first step's gradients start empty either way)."""
    model = model or _model()
    opt = opt_cls(model.parameters(), lr=0.01)
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=str(tmp_path), config=quiet(**(config or {})))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        reset(model, opt, step)
        for _ in range(micro):
            x = torch.randn(8, 4, generator=g)
            loss = mon.combine((model(x) - x.sum(1, keepdim=True)).pow(2).mean())
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    mon.detach()
    return [(e.step, e.actions) for e in mon.events if e.kind == "zero_grad_missing"], mon


def _forget(model, opt, step):
    pass


FIX = ["skip_step", "zero_grad"]
TOLD = {"policy": {"ladders": {"zero_grad_missing": {"rungs": [{"after": 1, "actions": []}]}}}}


def test_a_forgotten_zero_grad_is_found_in_the_step_it_shows_and_reset_from_then_on(tmp_path):
    told, mon = _loop(tmp_path, _forget)
    assert told == [(1, FIX)]  # step 1 adds onto step 0's gradients: skipped, then reset every step
    event = next(e for e in mon.events if e.kind == "zero_grad_missing")
    assert "zero_grad()" in event.message and event.data["parameter"] == "0.weight"
    assert event.data["action_results"]["zero_grad"]["applied"] is True
    # the same with micro-batches, under Adam
    assert _loop(tmp_path / "micro", _forget, micro=3, opt_cls=torch.optim.Adam)[0] == [(1, FIX)]
    # told only: the ladder without actions
    told, _ = _loop(
        tmp_path / "told",
        _forget,
        config=TOLD,
    )
    assert told == [(1, [])]


def _held_out(model, w):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 4, generator=g)
    with torch.no_grad():
        return float((model(x) - x @ w).pow(2).mean())


def test_the_reset_keeps_a_forgotten_zero_grad_run_on_the_course_of_one_that_resets(tmp_path):
    """SGD with momentum: without zero_grad() every update is the sum of all gradients so far and
    the run blows up (NaN within 300 steps; a probe: the monitor's undos and LR cuts only delayed
    it, then the budget stopped it at loss 1e22). With the gradients reset from the step it shows
    on, the run trains as the loop that resets does, less the one skipped step."""

    def run(monitored, reset, steps=200):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        mon = (
            sfmonitor.attach(model, opt, run_dir=str(tmp_path / f"{monitored}{reset}"), config=quiet())
            if monitored
            else None
        )
        g = torch.Generator().manual_seed(1)
        w = torch.randn(4, 1, generator=g)
        for _ in range(steps):
            if reset:
                opt.zero_grad()
            x = torch.randn(16, 4, generator=g)
            loss = (model(x) - x @ w).pow(2).mean()
            (mon.combine(loss) if mon else loss).backward()
            opt.step()
        if mon:
            mon.detach()
        return _held_out(model, w), mon

    good, _ = run(False, True)
    bad, _ = run(False, False)
    fixed, mon = run(True, False)
    assert not bad < 100 * good  # the forgotten zero_grad ruins the bare run
    assert fixed < 1.5 * good, (fixed, good)
    assert [(e.step, e.kind) for e in mon.events if e.actions] == [(1, "zero_grad_missing")]


def test_every_way_of_resetting_says_nothing(tmp_path):
    def manual_none(model, opt, step):
        for p in model.parameters():
            p.grad = None

    def manual_zero(model, opt, step):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    resets = {
        "optimizer": lambda model, opt, step: opt.zero_grad(),
        "optimizer_in_place": lambda model, opt, step: opt.zero_grad(set_to_none=False),
        "model": lambda model, opt, step: model.zero_grad(),
        "model_in_place": lambda model, opt, step: model.zero_grad(set_to_none=False),
        "manual_none": manual_none,
        "manual_zero": manual_zero,
    }
    for name, reset in resets.items():
        for micro in (1, 3):
            assert _loop(tmp_path / f"{name}{micro}", reset, micro=micro)[0] == [], (name, micro)


def test_a_grad_scaler_loop_and_a_skipped_step_say_nothing(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    told, _ = _loop(tmp_path / "scaled", lambda m, o, s: o.zero_grad(), scaler=scaler)
    assert told == []

    # a NaN batch the monitor skips (its gradients hidden from the optimizer and put back) and
    # the loop resetting as usual afterwards: nothing to tell
    model = _model()
    real = model.forward

    def poisoned(x, _calls=[0]):  # noqa: B006 - a counter across calls
        _calls[0] += 1
        out = real(x)
        return out * float("nan") if _calls[0] == 3 else out

    model.forward = poisoned
    told, mon = _loop(tmp_path / "nan", lambda m, o, s: o.zero_grad(), model=model)
    assert told == [] and any(e.kind == "nonfinite_loss" for e in mon.events)


def test_told_again_only_after_the_loop_reset_in_between(tmp_path):
    # resets at steps 1-3 and 6-7, forgets at 4-5 and 8-9: told at 4 (not at 5) and at 8
    told, _ = _loop(tmp_path, lambda m, o, s: o.zero_grad() if s in (1, 2, 3, 6, 7) else None, steps=10, config=TOLD)
    assert told == [(4, []), (8, [])]
    # with the fix, the monitor resets from step 4 on: nothing more to find
    told, _ = _loop(tmp_path / "fixed", lambda m, o, s: o.zero_grad() if s in (1, 2, 3, 6, 7) else None, steps=10)
    assert told == [(4, FIX)]


def test_detach_removes_the_probe_hook(tmp_path):
    told, mon = _loop(tmp_path, _forget, steps=2)
    model = mon.model
    assert model is None  # detached
    # no hook left on the first parameter: its accumulate hooks dictionary is empty again
    lin = _model()
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    mon = sfmonitor.attach(lin, opt, run_dir=str(tmp_path / "again"), config=quiet())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    first = next(lin.parameters())
    assert first._post_accumulate_grad_hooks  # armed after the step
    mon.detach()
    assert not first._post_accumulate_grad_hooks


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_gan_whose_generator_backward_runs_through_the_monitored_discriminator_says_nothing(tmp_path, set_to_none):
    """The DCGAN tutorial's order: D.zero_grad, D's backward, D's step; then the generator's loss
    backward runs through D and adds to D's gradients after D's step, and D's zero_grad at the top
    of the next iteration resets them. The probe judged the first accumulation after D's step (the
    generator's) and told a forgotten zero_grad(), skipping a healthy step. Judged now over every
    accumulation before the next step: one of them saw the reset."""

    def run(monitored):
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        disc = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        opt_g = torch.optim.Adam(gen.parameters(), 2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), 2e-4, betas=(0.5, 0.999))
        mon = (
            sfmonitor.attach(disc, opt_d, run_dir=str(tmp_path / str(monitored)), config=quiet()) if monitored else None
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            real = torch.randn(16, 2, generator=g) * 0.3 + 2.0
            fake = gen(torch.randn(16, 8, generator=g))
            opt_d.zero_grad(set_to_none=set_to_none)
            loss_d = nn.functional.softplus(-disc(real)).mean() + nn.functional.softplus(disc(fake.detach())).mean()
            loss_d.backward()
            opt_d.step()
            opt_g.zero_grad()
            nn.functional.softplus(-disc(fake)).mean().backward()  # adds to D's gradients too
            opt_g.step()
        if mon is not None:
            mon.detach()
        return disc.state_dict(), [] if mon is None else [(e.kind, e.step) for e in mon.events]

    bare, _ = run(False)
    watched, events = run(True)
    assert events == []
    assert all(torch.equal(bare[k], watched[k]) for k in bare)
