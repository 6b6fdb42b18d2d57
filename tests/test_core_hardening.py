"""Faults inside the monitor's own core: each test failed before its fix (issue-style numbers are
in docs/guide.md, "Faults and bad input")."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import sfmonitor


def quiet(**cfg):
    return {"console": False, "watch": {"enabled": False}, **cfg}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def step(mon, model, opt, nan=False, params=None):
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean()
    if nan:  # a NaN from inside the model (a NaN input would be a bad batch)
        loss = loss * torch.tensor(float("nan"))
    if params is not None:
        loss = loss + sum(p.pow(2).sum() for p in params)
    mon.combine(loss).backward()
    opt.step()
    opt.zero_grad()


# -- 1. a checkpoint that cannot be written never escapes optimizer.step() as an OSError ----------
def test_unwritable_checkpoint_folder_is_a_warning_and_the_stop_still_happens(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file where the folder should be")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.attach(model, opt, run_dir=str(run), config=quiet(policy={"budget": 0}))
    # 3 NaN steps in a row: rollback + lr_drop -> budget 0 spent -> checkpoint, stop
    with pytest.warns(RuntimeWarning, match="checkpoint"), pytest.raises(sfmonitor.StopTraining) as stop:
        for _ in range(5):
            step(mon, model, opt, nan=True)
    assert "saved to" not in str(stop.value)
    ev = [e for e in mon.events if "stop" in e.actions][-1]
    facts = ev.data["action_results"]["checkpoint"]
    assert facts["saved"] is False and "error" in facts
    # Not left mid-step: later steps are skipped, and no second stop is raised.
    before = copy.deepcopy(model.state_dict())
    step(mon, model, opt, nan=True)
    step(mon, model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mon.detach()


# -- 3. parameters added with add_param_group after attach are checked ---------------------------
def test_a_param_group_added_after_attach_is_checked_and_skipped(tmp_path):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    step(mon, model, opt)
    scale = nn.Parameter(torch.tensor(2.0))  # held by the optimizer only, added after attach
    opt.add_param_group({"params": [scale]})
    x = torch.randn(8, 4)
    mon.combine(model(x).pow(2).mean() * scale).backward()
    scale.grad.fill_(float("nan"))  # a NaN only in the new group
    before, before_scale = copy.deepcopy(model.state_dict()), scale.detach().clone()
    opt.step()
    assert torch.equal(scale.detach(), before_scale), "the NaN step landed"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ev = mon.events[-1]
    assert ev.kind == "nonfinite_grad" and ev.data["param"] == "optimizer.param_groups[1].params[0]"
    opt.zero_grad()
    mon.combine(model(x).pow(2).mean() * scale).backward()
    opt.step()  # healthy again: lands, and the new parameter is in the statistics
    assert not torch.equal(scale.detach(), before_scale)
    assert "param_norm/other" in mon.stats
    mon.detach()


# -- 4. rollback and checkpoints carry parameters the optimizer holds outside the model ---------
@pytest.mark.parametrize("undo", [True, False], ids=["undo", "rollback"])
def test_going_back_restores_a_parameter_held_only_by_the_optimizer(tmp_path, undo):
    model = Net()
    temp = nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.SGD([*model.parameters(), temp], lr=0.1)
    config = quiet(actions={"rollback": {"snapshot_every": 1}, "undo": {"enabled": undo}})
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=config)
    saved_temp = temp.detach().clone()  # snapshot 0 and the undo copy: the state step 0 started from
    step(mon, model, opt, params=[temp])
    assert not torch.equal(temp.detach(), saved_temp)
    with torch.no_grad():
        temp.fill_(float("nan"))  # damage that landed outside the model
    step(mon, model, opt, params=[temp])
    ev = next(e for e in mon.events if e.kind == "nonfinite_param")
    assert ev.actions == ["undo"]
    facts = ev.data["action_results"]["undo"]
    assert facts["restored"] is True and (facts.get("fallback") == "rollback") == (not undo)
    assert torch.isfinite(temp).all() and torch.equal(temp.detach(), saved_temp)
    mon.detach()


# -- 5. sparse gradients ---------------------------------------------------------------------------
def test_sparse_gradients_are_measured_and_skipped():
    emb = nn.Embedding(20, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    mon = sfmonitor.attach(emb, opt, config=quiet())
    idx = torch.tensor([1, 2, 2, 5])
    mon.combine(emb(idx).pow(2).sum()).backward()
    expected = emb.weight.grad.coalesce().values().norm().item()
    opt.step()
    opt.zero_grad()
    assert mon.stats["grad_norm/total"] == pytest.approx(expected, rel=1e-5)
    before = emb.weight.detach().clone()
    out = emb(idx).pow(2).sum() * float("nan")
    mon.combine(out).backward()
    opt.step()
    assert torch.equal(before, emb.weight) and mon.events[-1].kind in ("nonfinite_grad", "nonfinite_loss")
    mon.detach()


# -- 6. combine() input -------------------------------------------------------------------------
def test_combine_rejects_bad_components_with_clear_errors():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, config=quiet())
    out = model(torch.randn(8, 4))
    with pytest.raises(TypeError, match="'x' is a float"):
        mon.combine({"x": 1.0, "y": out.mean()})
    with pytest.raises(ValueError, match=r"'y' has shape \(8, 1\)"):
        mon.combine({"y": out, "z": out.mean()})
    with pytest.raises(ValueError, match=r"combine: the loss has shape \(8, 1\)"):
        mon.combine(out)
    mon.detach()


def test_learnable_loss_weights_keep_their_gradient():
    model = Net()
    log_w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([*model.parameters(), log_w], lr=0.1)
    mon = sfmonitor.attach(model, opt, config=quiet())
    out = model(torch.randn(8, 4))
    w = log_w.exp()
    total = mon.combine({"a": out.pow(2).mean(), "b": out.abs().mean()}, weights={"a": w[0], "b": w[1]})
    total.backward()
    assert log_w.grad is not None and torch.all(log_w.grad != 0)
    opt.step()
    assert mon.stats["loss_weight/a"] == pytest.approx(1.0)
    mon.detach()


# -- 7. two optimizers sharing one GradScaler; two monitors on one run_dir ------------------------
def test_two_monitors_on_one_scaler_each_keep_their_wrapper():
    m1, m2 = Net(), Net()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    mon1 = sfmonitor.attach(m1, o1, scaler=scaler, config=quiet())
    mon2 = sfmonitor.attach(m2, o2, scaler=scaler, config=quiet())
    mon1.detach()
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    loss = mon2.combine(m2(x).pow(2).mean())
    scaler.scale(loss).backward()
    scaler.step(o2)
    scaler.update()
    assert mon2.step == 1 and mon2.events, "the second monitor still sees its steps"
    mon2.detach()
    assert "step" not in scaler.__dict__ and "update" not in scaler.__dict__


def test_two_live_monitors_on_one_run_dir_are_refused(tmp_path):
    m1, m2 = Net(), Net()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    mon1 = sfmonitor.attach(m1, o1, run_dir=str(tmp_path), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match="already used by another monitor"):
        sfmonitor.attach(m2, o2, run_dir=str(tmp_path), config=quiet())
    mon1.detach()
    sfmonitor.attach(m2, o2, run_dir=str(tmp_path), config=quiet()).detach()  # a resume after it ended


def test_a_lock_left_by_a_killed_process_is_stale(tmp_path):
    (tmp_path / ".sfmonitor.lock").write_text("999999999\n")  # no such process
    model = Net()
    mon = sfmonitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=str(tmp_path), config=quiet())
    mon.detach()


# -- 8. group names -----------------------------------------------------------------------------
def test_a_group_named_total_is_refused():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sfmonitor.ConfigError, match="'total' is reserved"):
        sfmonitor.attach(model, opt, groups={"total": model.a}, config=quiet())


def test_a_compiled_model_is_grouped_like_the_model_itself():
    model = Net()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(compiled, opt, config=quiet())
    assert sorted(mon.groups) == ["a", "b"]
    mon.detach()


# -- 10. strict mode -------------------------------------------------------------------------------
def test_strict_mode_names_the_parameter_and_raises_on_a_nonfinite_parameter():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, config=quiet(strict=True))
    x = torch.randn(8, 4)
    mon.combine(model(x).pow(2).mean() * torch.tensor(float("nan"))).backward()
    with pytest.raises(sfmonitor.NonFiniteError, match="first non-finite gradient: a.weight"):
        opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.b.bias.fill_(float("inf"))
    mon.combine(model(torch.randn(8, 4)).pow(2).mean()).backward()
    with pytest.raises(sfmonitor.NonFiniteError, match="non-finite parameter b.bias"):
        opt.step()
    mon.detach()


# -- 16. after a stop; a bounded event list --------------------------------------------------------
def test_after_a_stop_steps_are_skipped_without_new_checkpoints_or_events(tmp_path):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet(policy={"budget": 0}))
    with pytest.raises(sfmonitor.StopTraining):
        for _ in range(10):
            step(mon, model, opt, nan=True)
    assert mon.should_stop
    n_events = len(mon.events)
    ckpts = sorted(os.listdir(tmp_path / "checkpoints"))
    before = copy.deepcopy(model.state_dict())
    for _ in range(3):  # a loop that carries on anyway
        step(mon, model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ckpts and len(mon.events) == n_events
    assert list(mon.batches(range(5))) == []
    mon.detach()


def test_events_in_memory_are_bounded_the_file_keeps_all(tmp_path):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet(max_events=5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(12):
            step(mon, model, opt, nan=(i % 3 == 0))
    mon.detach()
    lines = open(tmp_path / "events.jsonl").read().splitlines()
    assert len(lines) > 5 and len(mon.events) == 5


def test_a_monitor_whose_optimizer_never_steps_says_so_and_holds_a_bounded_memory(tmp_path):
    """Attached to an optimizer whose step() the loop never calls (SAM's first_step/second_step
    call its base optimizer's): the monitor saw no step, said nothing, and kept every forward's
    inputs for the step that never closed (0.4 MiB a forward, without bound). Past
    ``forensics.MAX_STEP_BATCHES`` forwards it says once which optimizer it waits for, and keeps
    no more of them."""
    from sfmonitor.forensics import MAX_STEP_BATCHES

    model = Net()
    attached = torch.optim.SGD(model.parameters(), lr=0.01)
    stepping = torch.optim.SGD(model.parameters(), lr=0.01)  # the one the loop steps
    mon = sfmonitor.attach(model, attached, run_dir=str(tmp_path), config=quiet())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(MAX_STEP_BATCHES + 20):
            mon.combine(model(torch.randn(4, 4)).pow(2).mean()).backward()
            stepping.step()
            stepping.zero_grad()
    said = [str(w.message) for w in caught if "never stepped" in str(w.message)]
    assert len(said) == 1 and "SGD" in said[0] and "first_step" in said[0]
    assert len(mon._recorder.batches) == MAX_STEP_BATCHES and mon.step == 0
    mon.detach()


def test_a_monitor_whose_optimizer_the_loop_replaced_says_so(tmp_path):
    """A loop that swaps in a new optimizer mid-run (a new head, a precision switch) and keeps
    the monitor attached to the old one: the old one never steps again, and the run went on
    unwatched without a word (a probe: a NaN batch after the swap made the weights NaN, no
    event). The forwards the loop's own resets threw away had restarted the count each time. Past
    ``forensics.MAX_STEP_BATCHES`` training forwards since its last step it says so, once, and how
    to attach to the new optimizer."""
    from sfmonitor.forensics import MAX_STEP_BATCHES

    model = Net()
    first = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.attach(model, first, run_dir=str(tmp_path), config=quiet())
    replaced = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(30 + 2 * MAX_STEP_BATCHES):
            opt = first if i < 30 else replaced
            mon.combine(model(torch.randn(4, 4)).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
            if i == 30 + MAX_STEP_BATCHES - 2:
                assert not [w for w in caught if "sfmonitor" in str(w.message)]
    said = [str(w.message) for w in caught if "last stepped" in str(w.message)]
    assert len(said) == 1 and "SGD" in said[0] and "monitor step 30" in said[0] and "new_optimizer" in said[0]
    assert mon.step == 30
    mon.detach()


def test_attach_before_a_lazy_modules_first_forward_is_a_clear_error_and_changes_nothing(tmp_path):
    """nn.LazyLinear before its first forward: attach raised a raw ValueError from its memory
    report. Now a ConfigError that names the parameters and says what to do; nothing is attached,
    and attach works after one forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.Monitor(run_dir=str(tmp_path), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match=r"4 parameter.*0\.weight.*forward pass"):
        mon.attach(model, opt)
    assert not opt._optimizer_step_pre_hooks and not model._forward_pre_hooks
    model(torch.randn(4, 5))
    mon.attach(model, opt)
    mon.combine(model(torch.randn(4, 5)).pow(2).mean()).backward()
    opt.step()
    assert mon.step == 1 and "grad_norm/total" in mon.stats
    mon.detach()


def test_attach_before_a_lazy_buffers_first_forward_is_a_clear_error_too(tmp_path):
    """nn.LazyBatchNorm2d(affine=False) has no lazy parameters, only lazy buffers (its running
    statistics): attach got past the parameter check and raised a raw ValueError from its memory
    report (a helper's probe). The same ConfigError, naming the buffers."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.LazyBatchNorm2d(affine=False), nn.Flatten(), nn.LazyLinear(2))
    model[3](torch.randn(1, 4 * 6 * 6))  # the head is initialised; the BatchNorm's buffers are not
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.Monitor(run_dir=str(tmp_path), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match=r"buffer.*1\.running_mean.*forward pass"):
        mon.attach(model, opt)
    assert not opt._optimizer_step_pre_hooks and not model._forward_pre_hooks
    model(torch.randn(2, 3, 8, 8))
    mon.attach(model, opt)
    mon.combine(model(torch.randn(2, 3, 8, 8)).pow(2).mean()).backward()
    opt.step()
    assert mon.step == 1
    mon.detach()


def test_attach_to_a_torchscript_model_is_a_clear_error_and_changes_nothing(tmp_path):
    """A whole model compiled with torch.jit.script (or traced) takes no forward hooks: attach
    raised torch's bare RuntimeError ("register_forward_hook is not supported on ScriptModules")
    from the activation watch, and with the watch off from the batch recorder. Now a ConfigError
    that says why and what to do; nothing is attached. A scripted submodule inside an eager model
    is fine."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    for model in (torch.jit.script(eager), torch.jit.trace(eager, torch.randn(2, 4))):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for cfg in (quiet(), quiet(watch={"enabled": False}, bundle={"enabled": False})):
            mon = sfmonitor.Monitor(run_dir=str(tmp_path), config=cfg)
            with pytest.raises(sfmonitor.ConfigError, match=r"TorchScript.*forward hooks.*eager"):
                mon.attach(model, opt)
            assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    mixed = nn.Sequential(torch.jit.script(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(mixed.parameters(), lr=1e-3)
    mon = sfmonitor.attach(mixed, opt, run_dir=str(tmp_path / "mixed"), config=quiet())
    mon.combine(mixed(torch.randn(4, 4)).pow(2).mean()).backward()
    opt.step()
    assert mon.step == 1 and "grad_norm/total" in mon.stats
    mon.detach()


def test_without_bundles_no_input_is_held_past_its_forward_and_a_nan_input_is_still_a_bad_batch(tmp_path):
    """The inputs of a step's forwards were held until the step closed, for the anomaly bundles and
    the bad-batch check, bundles or not: under accumulation that is every micro-batch's input
    (32 of 8 MiB: 256 MiB at the peak). With ``bundle.enabled: false`` the recorder keeps none,
    counting non-finite inputs as they come; a NaN input is still a bad batch, skipped."""
    for bundles, held in ((True, 3), (False, 0)):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        mon = sfmonitor.attach(
            model, opt, run_dir=str(tmp_path / str(bundles)), config=quiet(bundle={"enabled": bundles})
        )
        for _ in range(3):  # three micro-batches of one step
            mon.combine(model(torch.randn(4, 4)).pow(2).mean() / 3).backward()
        # (detached views of each input: they keep its storage alive)
        assert len(mon._recorder.batches) == held
        opt.step()
        opt.zero_grad()
        if bundles:
            mon.detach()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 4)
    x[1, 2] = float("nan")
    mon.combine(model(x).pow(2).mean()).backward()
    opt.step()
    assert [(e.kind, e.actions) for e in mon.events] == [("bad_batch", ["skip_step"])]
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    mon.detach()


def test_a_nan_input_given_to_a_child_module_is_a_bad_batch(tmp_path):
    """A LightningModule's ``training_step`` that calls its network, ``self.net(x)``, never runs
    the attached module's own forward, whose inputs are the ones checked: a NaN input was told as
    ``nonfinite_loss`` + ``nonfinite_grad`` (what an overflow inside the model looks like), not as
    the bad batch it is. The first child module a step calls outside the root's forward is where
    its data comes in: its floating inputs are checked too (under accumulation, each of its calls;
    an intermediate passed to a second child is not, so an overflow in the first stays one)."""

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)

    for bundles in (True, False):
        torch.manual_seed(0)
        wrap = Wrap()
        opt = torch.optim.Adam(wrap.parameters(), lr=1e-3)
        mon = sfmonitor.attach(
            wrap, opt, run_dir=str(tmp_path / str(bundles)), config=quiet(bundle={"enabled": bundles})
        )
        for i in range(6):
            for micro in range(2):
                x = torch.randn(4, 4)
                if i == 4 and micro == 1:
                    x[0, 0] = float("nan")
                mon.combine(wrap.head(wrap.net(x)).pow(2).mean() / 2).backward()
            opt.step()
            opt.zero_grad()
        assert [(e.kind, e.step, e.actions) for e in mon.events] == [("bad_batch", 4, ["skip_step"])]
        assert mon.events[0].data["nonfinite_inputs"] == 1
        assert mon._recorder.batches == []  # (nothing of a child's is held for a bundle)
        mon.detach()
    # An inf made inside the first child and passed on to the second is no bad input.
    torch.manual_seed(0)
    wrap = Wrap()
    opt = torch.optim.SGD(wrap.parameters(), lr=1e-3)
    mon = sfmonitor.attach(wrap, opt, run_dir=str(tmp_path / "inside"), config=quiet())
    for i in range(3):
        h = wrap.net(torch.randn(4, 4))
        if i == 2:
            h = h * float("inf")
        mon.combine(wrap.head(h).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    assert "bad_batch" not in [e.kind for e in mon.events] and mon.events
    mon.detach()
    # Nor one made inside the root's forward and passed to a child the loop calls apart after it
    # (an auxiliary head on the root's output): the step's data came in through the root.

    class Root(Wrap):
        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    root = Root()
    opt = torch.optim.SGD(root.parameters(), lr=1e-3)
    mon = sfmonitor.attach(root, opt, run_dir=str(tmp_path / "root"), config=quiet())
    for i in range(3):
        h = root(torch.randn(4, 4))
        mon.combine(root.head(h * float("inf") if i == 2 else h).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    assert "bad_batch" not in [e.kind for e in mon.events] and mon.events
    mon.detach()


def test_an_additive_minus_inf_mask_in_the_inputs_is_no_bad_input(tmp_path):
    """A float attention mask with -inf where a position is hidden (an additive causal mask passed
    to the model) counted as non-finite input, so an overflow inside the model was told as a bad
    batch, skipped every time it came and never escalated (a helper's probe). A mask holds -inf
    only; NaN and +inf in the inputs are still bad input."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask):
            scores = self.lin(x) + mask
            return torch.softmax(scores, -1)

    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    mask = torch.triu(torch.full((4, 4), float("-inf")), 1)
    for i in range(4):
        out = model(torch.randn(4, 4), mask)
        if i == 2:
            out = out * float("inf")  # an overflow made inside, not in the data
        x = torch.randn(4, 4)
        if i == 3:
            x[0, 0] = float("nan")
        mon.combine(out.sum() if i != 3 else model(x, mask).sum()).backward()
        opt.step()
        opt.zero_grad()
    kinds = [(e.step, e.kind) for e in mon.events]
    assert (2, "bad_batch") not in kinds and (3, "bad_batch") in kinds
    mon.detach()


class _LoggingNAdam(torch.optim.NAdam):
    """A user's optimizer that adds to its parent's step and calls ``super().step()``."""

    def step(self, closure=None):
        return super().step(closure)


def test_an_optimizer_whose_step_calls_its_parents_is_one_step(tmp_path):
    """torch wraps each optimizer class's ``step`` with its hook caller the first time an instance
    of that class is made: once the parent class has an instance somewhere in the process (a
    second optimizer, an lr finder), a subclass whose ``step`` calls ``super().step()`` fires the
    step hooks twice per ``optimizer.step()`` (a newcomer's audit: ``monitor.step`` counted 0, 2,
    4, and one NaN batch gave two events). The nested call is part of the step the outer one began."""
    torch.optim.NAdam([nn.Parameter(torch.zeros(1))])  # the parent class's step is hooked too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = _LoggingNAdam(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x = torch.randn(16, 4, generator=g)
        if i == 3:
            x[0, 0] = float("nan")
            before = [p.detach().clone() for p in model.parameters()]
        mon.combine(nn.functional.mse_loss(model(x), x[:, :1])).backward()
        opt.step()
        opt.zero_grad()
        assert mon.step == i + 1
        if i == 3:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    mon.detach()
    assert [(e.step, e.kind, e.actions) for e in mon.events] == [(3, "bad_batch", ["skip_step"])]


def test_a_step_whose_optimizer_raised_is_closed_by_the_next_before_update(tmp_path):
    """Driven externally (an integration calls ``before_update()`` / ``after_update()``), a step
    whose ``optimizer.step()`` raised left its record decided: the next ``before_update()`` did
    nothing, the next step's pre-hook closed the record and began a new one already marked as
    stepped, and a NaN batch two steps later was told as skipped while its update landed (a
    newcomer's audit). The next ``before_update()`` closes the step the exception ended."""

    class Flaky(torch.optim.Adagrad):
        calls = 0

        def step(self, closure=None):
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise RuntimeError("optimizer failed")
            return super().step(closure)

    torch.manual_seed(0)
    model = Net()
    opt = Flaky(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config=quiet()).drive_externally()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x = torch.randn(16, 4, generator=g)
        if i == 4:
            x[0, 0] = float("nan")
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        mon.before_update()
        try:
            opt.step()
            mon.after_update()
        except RuntimeError:
            assert i == 2
        opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters()), i
        assert mon.step == i + (i != 2), i  # the step that raised is closed by the next one
    mon.detach()
    assert [(e.step, e.kind, e.actions) for e in mon.events] == [(4, "bad_batch", ["skip_step"])]
