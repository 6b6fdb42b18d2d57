"""One step, one record: whatever ends a step (hook, scaler, integration, exception) closes its
record, and what the step hid or changed is put back."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import sfmonitor
from sfmonitor.record import Phase
from sfmonitor.sinks.base import Sink


def setup(config=None, sinks=(), lr=0.1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    mon = sfmonitor.Monitor(
        config={"console": False, "watch": {"enabled": False}, **(config or {})}, sinks=["jsonl", *sinks]
    )
    mon.attach(model, opt)
    return model, opt, mon


def backward(mon, model, nan=False):
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean()
    if nan:  # a NaN from inside the model (a NaN input would be a bad batch)
        loss = loss * torch.tensor(float("nan"))
    mon.combine(loss).backward()


def state(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])


def same(a, b):
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1].keys() == b[1].keys()


def test_entry_points_are_safe_to_call_twice_and_phases_follow_the_step():
    model, opt, mon = setup()
    rec = mon._record
    assert rec.phase is Phase.OPEN and rec.step == 0
    backward(mon, model)
    mon.before_update()
    assert rec.phase is Phase.DECIDED
    mon.before_update()  # no second pipeline
    assert len(mon.events) == 0 and rec.phase is Phase.DECIDED
    opt.step()  # the hooks: pre-hook is a no-op (already decided), post-hook closes
    assert rec.phase is Phase.LANDED and rec.update_landed and mon.step == 1
    mon.after_update()  # nothing in flight: no-op
    assert mon.step == 1 and mon._record.phase is Phase.OPEN
    mon.detach()


def test_a_failing_action_is_told_and_the_next_step_is_fully_checked(clean_registry):
    def boom(ctx, decision):
        raise RuntimeError("the action broke")

    sfmonitor.register_action("boom", boom, order=25)
    ladder = {"rungs": [{"after": 1, "actions": ["skip_step", "boom"]}], "window": 1}
    model, opt, mon = setup({"policy": {"ladders": {"nonfinite_grad": ladder, "nonfinite_loss": ladder}}})
    backward(mon, model, nan=True)
    grads = [p.grad for p in model.parameters()]
    before = state(model, opt)
    with pytest.warns(RuntimeWarning, match="action boom failed at step 0"):
        opt.step()
    assert same(state(model, opt), before)  # the skip held
    assert [p.grad for p in model.parameters()] == grads  # the same tensors, put back
    ev = [e for e in mon.events if e.kind == "nonfinite_loss"][-1]
    assert ev.actions == ["skip_step", "boom"]
    assert ev.data["action_results"]["boom"] == {"failed": "RuntimeError: the action broke"}
    opt.zero_grad()
    # The next step is checked: a NaN there is still skipped...
    backward(mon, model, nan=True)
    before = state(model, opt)
    with pytest.warns(RuntimeWarning):
        opt.step()
    assert same(state(model, opt), before) and mon.events[-1].step == 1
    opt.zero_grad()
    # ... and a healthy step lands.
    backward(mon, model)
    opt.step()
    assert not same(state(model, opt), before) and mon.events[-1].step == 1
    mon.detach()


class Interrupting(Sink):
    """A sink that raises KeyboardInterrupt on the first event: the pipeline stops mid-step,
    after the skip hid the gradients and the LR scale changed the LR."""

    def __init__(self):
        self.fired = False

    def log_event(self, event):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def test_an_exception_mid_step_aborts_it_with_gradients_and_lr_put_back():
    sink = Interrupting()
    model, opt, mon = setup(sinks=[sink])
    sd = mon.state_dict()
    sd["lr_scale"] = 0.5
    mon.load_state_dict(sd)
    backward(mon, model, nan=True)
    grads = [p.grad for p in model.parameters()]
    before = state(model, opt)
    rec = mon._record
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    assert rec.phase is Phase.ABORTED and mon.step == 1
    assert same(state(model, opt), before)
    assert [p.grad for p in model.parameters()] == grads  # not left hidden
    assert opt.param_groups[0]["lr"] == 0.1  # not left scaled
    opt.zero_grad()
    backward(mon, model, nan=True)  # the next step is fully checked
    opt.step()
    assert same(state(model, opt), before)
    assert [(e.step, e.kind, e.actions) for e in mon.events[-2:]] == [
        (1, "nonfinite_loss", ["skip_step"]),
        (1, "nonfinite_grad", []),
    ]
    opt.zero_grad()
    backward(mon, model)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    opt.step()
    assert seen == [0.05] and opt.param_groups[0]["lr"] == 0.1  # scaled for the update only
    mon.detach()


def test_a_skip_then_a_failing_rollback_does_not_skip_a_later_healthy_step(monkeypatch):
    from sfmonitor import actions as A

    def broken(*args, **kwargs):
        raise OSError("snapshot unreadable")

    monkeypatch.setattr(A, "restore_state", broken)
    ladder = {"rungs": [{"after": 1, "actions": ["skip_step", "rollback"]}], "window": 1}
    model, opt, mon = setup(
        {"policy": {"ladders": {"nonfinite_loss": ladder}}, "actions": {"rollback": {"snapshot_every": 1}}}
    )
    backward(mon, model)
    opt.step()  # a healthy step: snapshot 0
    opt.zero_grad()
    backward(mon, model, nan=True)
    with pytest.warns(RuntimeWarning, match="rollback failed"):
        opt.step()
    ev = [e for e in mon.events if e.kind == "nonfinite_loss"][-1]
    assert ev.data["action_results"]["rollback"]["failed"].startswith("OSError")
    opt.zero_grad()
    n_events = len(mon.events)
    before = state(model, opt)
    backward(mon, model)
    opt.step()
    assert not same(state(model, opt), before), "a healthy step after the failure must land"
    assert len(mon.events) == n_events
    mon.detach()


def test_an_optimizer_that_raises_leaves_no_step_in_flight():
    model, opt, mon = setup()
    backward(mon, model)
    mon.before_update()
    rec = mon._record
    assert rec.phase is Phase.DECIDED
    # The optimizer raised between the hooks: the next combine() closes that step as ABORTED.
    opt.zero_grad()
    backward(mon, model)
    assert rec.phase is Phase.ABORTED and mon.step == 1 and mon._record.step == 1
    opt.step()
    assert mon.step == 2
    mon.detach()


def test_a_steps_loss_record_is_bounded_and_its_mean_exact_past_the_bound():
    """More combine() calls in one step than the record keeps apart (MAX_STEP_BATCHES): the older
    ones are folded into one that counts; the step's loss is still the mean of every call, and a
    later call no backward reaches is still left out."""
    from sfmonitor.forensics import MAX_STEP_BATCHES
    from sfmonitor.record import LossAccumulator

    acc = LossAccumulator()
    x = torch.nn.Parameter(torch.tensor(1.0))
    n = MAX_STEP_BATCHES + 44
    for i in range(n):
        loss = x * float(i)
        acc.add({"a": loss, "b": loss * 2}, loss * 3, {"a": 1.0, "b": 1.0})
        loss.backward()
    acc.add({"a": x * 1e6, "b": x * 1e6}, x * 1e6, {"a": 1.0, "b": 1.0})  # never backpropagated
    assert len(acc.entries) <= MAX_STEP_BATCHES and acc.count == n + 1
    out = acc.tensors([["a", "b"]])
    mean = sum(range(n)) / n
    assert out["loss/total"].item() == pytest.approx(3 * mean) and out["loss/a"].item() == pytest.approx(mean)
    assert out["loss_ratio/a/b"].item() == pytest.approx(0.5)
