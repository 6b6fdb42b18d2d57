"""Bad input at attach() and combine(): a clear error naming what is wrong, and nothing left behind.

Also the inputs that are not bad but were refused by accident: float64 and complex parameters.
Each test here was written before its fix and failed against the code it was written for (see
docs/guide.md, "Faults and bad input").
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
from _state import assert_identical, quiet, snapshot
from torch import nn

import sfmonitor
from sfmonitor import stats as S
from sfmonitor.monitor import LOCK_FILE

# --------------------------------------------------------------------------------------------
# 1. float64 and complex parameters: measured, never refused, the run untouched
# --------------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """A float32 model with one float64 parameter (a learnable temperature kept in double)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.temp = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * self.temp.float()


def _train(build, make_input, monitored, tmp_path, steps=6, opt_cls=torch.optim.Adam, **cfg):
    torch.manual_seed(0)
    model = build()
    opt = opt_cls(model.parameters(), lr=1e-2)
    mon = None
    if monitored:
        mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet(**cfg))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = model(make_input(g)).abs().pow(2).mean()
        if mon is not None:
            loss = mon.combine(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.detach()
    return snapshot(model, opt), mon


CASES = {
    "float64": (lambda: nn.Linear(4, 1).double(), lambda g: torch.randn(8, 4, generator=g, dtype=torch.float64)),
    "one_float64_param": (Mixed, lambda g: torch.randn(8, 4, generator=g)),
    "complex64": (
        lambda: nn.Linear(4, 1, dtype=torch.cfloat),
        lambda g: torch.randn(8, 4, generator=g, dtype=torch.cfloat),
    ),
    "complex128": (
        lambda: nn.Linear(4, 1, dtype=torch.cdouble),
        lambda g: torch.randn(8, 4, generator=g, dtype=torch.cdouble),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD])
@pytest.mark.parametrize("undo", [True, False])
def test_a_healthy_run_of_any_float_dtype_is_bit_identical_to_bare(case, opt_cls, undo, tmp_path):
    build, make_input = CASES[case]
    bare, _ = _train(build, make_input, False, tmp_path / "bare", opt_cls=opt_cls)
    cfg = {"actions": {"undo": {"enabled": undo}}}
    watched, mon = _train(build, make_input, True, tmp_path / "mon", opt_cls=opt_cls, **cfg)
    assert_identical(bare, watched)
    assert mon.events == []
    assert mon.step == 6
    assert math.isfinite(mon.stats["grad_norm/total"]) and mon.stats["grad_norm/total"] > 0
    assert math.isfinite(mon.stats["loss/total"])


def test_norms_of_mixed_dtypes_are_one_vector_with_the_true_values():
    big = torch.full((4,), 1e100, dtype=torch.float64)  # its norm overflows float32
    z = torch.tensor([3 + 4j, 0 + 0j], dtype=torch.cfloat)
    half = torch.full((4,), 60000.0, dtype=torch.float16)  # its norm overflows float16
    ts = [torch.ones(3), big, z, half, torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([3, 4])]
    out = S.norms(ts)
    assert out.ndim == 1 and out.numel() == len(ts)
    assert out.dtype == torch.float64  # one float64 tensor: the vector is float64
    expected = [math.sqrt(3), 2e100, 5.0, 120000.0, math.sqrt(5), 5.0]
    for got, want in zip(out.tolist(), expected):
        assert got == pytest.approx(want, rel=1e-6)
    narrow = S.norms([torch.ones(3), z, half])
    assert narrow.dtype == torch.float32  # no float64 input: float32 as before
    assert narrow.tolist() == pytest.approx([math.sqrt(3), 5.0, 120000.0], rel=1e-6)


def test_norms_of_a_sparse_complex_gradient():
    i = torch.tensor([[0, 2]])
    v = torch.tensor([3 + 0j, 0 + 4j], dtype=torch.cfloat)
    g = torch.sparse_coo_tensor(i, v, (4,), check_invariants=True)
    assert S.norms([g]).tolist() == pytest.approx([5.0])


def test_a_nonfinite_float64_gradient_is_still_caught_and_skipped(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = quiet()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=cfg)
    model(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    before = snapshot(model, opt)
    mon.combine(model(torch.randn(8, 4, dtype=torch.float64)).pow(2).mean()).backward()
    model.weight.grad[0, 1] = float("nan")
    opt.step()
    assert_identical(before, snapshot(model, opt))
    assert [e.kind for e in mon.events] == ["nonfinite_grad"]
    assert mon.events[0].data.get("param") == "weight"
    mon.detach()


# --------------------------------------------------------------------------------------------
# 2. combine(): weights and names
# --------------------------------------------------------------------------------------------


def _monitor(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet())


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"a": 1.0, "b": float("nan")}, r"weight 'b' is nan"),
        ({"a": float("inf"), "b": 1.0}, r"weight 'a' is inf"),
        ({"a": 1.0, "b": float("-inf")}, r"weight 'b' is -inf"),
        ({"a": 1.0, "b": -1.0}, r"weight 'b' is negative \(-1.0\)"),
        ({"a": 1.0, "b": 1.0, "vison": 0.5}, r"weights has 'vison', which is not a loss component.*'a', 'b'"),
        ({"a": 1.0, "b": "0.5"}, r"weight 'b' is a str"),
        ({"a": 1.0, "b": None}, r"weight 'b' is a NoneType"),
    ],
)
def test_combine_refuses_a_bad_weight_naming_its_key(weights, match, tmp_path):
    model, opt, mon = _monitor(tmp_path)
    out = model(torch.randn(8, 4))
    with pytest.raises(sfmonitor.ConfigError, match=match):
        mon.combine({"a": out.pow(2).mean(), "b": out.abs().mean()}, weights=weights)
    # nothing recorded: the next, correct call is the step's only one
    total = mon.combine({"a": out.pow(2).mean(), "b": out.abs().mean()}, weights={"a": 1.0, "b": 0.5})
    total.backward()
    opt.step()
    assert mon.events == []
    assert mon.stats["loss_weight/b"] == 0.5
    mon.detach()


def test_combine_accepts_zero_integer_and_tensor_weights_a_negative_tensor_included(tmp_path):
    model, opt, mon = _monitor(tmp_path)
    out = model(torch.randn(8, 4))
    w = nn.Parameter(torch.tensor(-0.5))  # a learnable weight is the user's own
    total = mon.combine(
        {"a": out.pow(2).mean(), "b": out.abs().mean(), "c": out.mean()}, weights={"a": 0, "b": w, "c": 2}
    )
    total.backward()
    opt.step()
    assert mon.events == []
    assert w.grad is not None
    mon.detach()


def test_combine_refuses_weights_with_a_single_loss_tensor(tmp_path):
    model, opt, mon = _monitor(tmp_path)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    with pytest.raises(sfmonitor.ConfigError, match=r"weights.*single loss tensor"):
        mon.combine(loss, weights={"a": 0.5})
    mon.detach()


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("a/b", sfmonitor.ConfigError, r"loss component 'a/b'.*'/'"),
        (1, TypeError, r"loss component names must be strings.*1 \(an int\)"),
        ("", sfmonitor.ConfigError, r"empty"),
        (" ", sfmonitor.ConfigError, r"blank"),
        ("\n", sfmonitor.ConfigError, r"blank"),
        ("total", sfmonitor.ConfigError, r"'total' is reserved"),
    ],
)
def test_combine_refuses_a_component_name_that_cannot_be_a_metric_key(name, error, match, tmp_path):
    model, opt, mon = _monitor(tmp_path)
    out = model(torch.randn(8, 4))
    with pytest.raises(error, match=match):
        mon.combine({name: out.pow(2).mean(), "c": out.abs().mean()})
    mon.detach()


def test_combine_refuses_a_complex_loss_naming_it(tmp_path):
    model, opt, mon = _monitor(tmp_path)
    out = model(torch.randn(8, 4))
    with pytest.raises(TypeError, match=r"loss component 'a' is complex"):
        mon.combine({"a": out.mean().to(torch.cfloat), "b": out.abs().mean()})
    with pytest.raises(TypeError, match=r"the loss is complex"):
        mon.combine(out.mean().to(torch.cfloat))
    mon.detach()


# --------------------------------------------------------------------------------------------
# 3. groups
# --------------------------------------------------------------------------------------------


def test_a_single_parameter_is_a_one_parameter_group(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, groups={"first_w": model[0].weight}, run_dir=str(tmp_path), config=quiet())
    assert [n for n, _ in mon.groups["first_w"]] == ["0.weight"]
    assert sorted(n for n, _ in mon.groups["other"]) == ["0.bias", "1.bias", "1.weight"]
    mon.detach()


def test_a_tensor_that_is_not_in_the_model_is_named(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    stray = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        sfmonitor.ConfigError, match=r"groups\['x'\]: a Parameter of shape \(3, 5\) is not in the model"
    ):
        sfmonitor.attach(model, opt, groups={"x": stray}, run_dir=str(tmp_path), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match=r"groups\['x'\]\[1\]: a Parameter of shape \(3, 5\)"):
        sfmonitor.attach(model, opt, groups={"x": [model[0].weight, stray]}, run_dir=str(tmp_path), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match=r"groups\['x'\]\[0\]: expected a Parameter, got int"):
        sfmonitor.attach(model, opt, groups={"x": [3]}, run_dir=str(tmp_path), config=quiet())
    assert not opt._optimizer_step_pre_hooks
    assert not os.path.exists(tmp_path / LOCK_FILE)


def test_a_group_name_must_be_a_string(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sfmonitor.ConfigError, match=r"groups: the name 1 is an int"):
        sfmonitor.attach(model, opt, groups={1: model[0]}, run_dir=str(tmp_path), config=quiet())


@pytest.mark.parametrize(
    ("name", "match"), [("", r"groups: a group has an empty or blank name"), (" \t", r"empty or blank")]
)
def test_a_group_name_must_name_something(name, match, tmp_path):
    """A blank group name gave the metric keys ``grad_norm/`` and ``param_norm/`` (a helper's
    probe); refused, as a blank loss component name is."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sfmonitor.ConfigError, match=match):
        sfmonitor.attach(model, opt, groups={name: model[0]}, run_dir=str(tmp_path), config=quiet())


def test_a_group_named_other_is_not_merged_with_the_parameters_no_group_names(tmp_path):
    """The parameters no group names go to "other": a user's group of that name was merged with
    them, silently (a helper's probe: the user's 2 parameters and 2 more). Refused, naming them;
    allowed where every parameter is in a group."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sfmonitor.ConfigError, match=r"groups\['other'\].*'1.weight', '1.bias'"):
        sfmonitor.attach(model, opt, groups={"other": model[0]}, run_dir=str(tmp_path), config=quiet())
    mon = sfmonitor.attach(
        model, opt, groups={"other": model[0], "head": model[1]}, run_dir=str(tmp_path), config=quiet()
    )
    assert sorted(mon.groups) == ["head", "other"]
    mon.detach()


# --------------------------------------------------------------------------------------------
# 4. run_dir, wrappers, and a failed attach leaves nothing behind
# --------------------------------------------------------------------------------------------


def _assert_nothing_left(mon, model, opt, run_dir):
    assert not mon.attached
    assert mon.optimizer is None and mon.scaler is None
    assert not getattr(opt, "_optimizer_step_pre_hooks", None) and not getattr(opt, "_optimizer_step_post_hooks", None)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not os.path.exists(os.path.join(run_dir, LOCK_FILE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.detach()  # nothing to finish, no warning


def test_a_run_dir_that_is_a_file_is_a_config_error(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.Monitor(run_dir=str(path), sinks=["jsonl"], config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match=r"run_dir '.*not_a_dir' is a file"):
        mon.attach(model, opt)
    _assert_nothing_left(mon, model, opt, str(tmp_path))
    under = tmp_path / "not_a_dir" / "sub"  # a file in the way above it
    with pytest.raises(sfmonitor.ConfigError, match=r"run_dir '.*sub'"):
        sfmonitor.attach(model, opt, run_dir=str(under), config=quiet())
    assert path.read_text() == "x"


class FakeWrapper(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass whose __init__ does not call
    Optimizer.__init__ (no step hooks) and that holds the real optimizer as ``.optimizer``."""

    def __init__(self, optimizer, scaler=None):
        self.optimizer = optimizer
        self.scaler = scaler

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


class Hookless(torch.optim.Optimizer):
    def __init__(self, params):
        self.param_groups = [{"params": list(params), "lr": 0.1}]
        self.state = {}


def test_a_wrapper_optimizer_is_unwrapped_and_watched(tmp_path, capsys):
    data = [torch.randn(8, 4) for _ in range(4)]

    def run(monitored):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = FakeWrapper(torch.optim.Adam(model.parameters(), lr=1e-2))
        mon = None
        if monitored:
            mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config={"console": True})
            assert mon.optimizer is opt.optimizer
        for i, x in enumerate(data):
            if i == 2:
                x = x.clone()
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            if i != 2 or mon is not None:
                loss = mon.combine(loss) if mon else loss
                loss.backward()
                opt.step()
            opt.zero_grad()
        if mon is not None:
            mon.detach()
        return snapshot(model, opt.optimizer), mon

    bare, _ = run(False)
    watched, mon = run(True)
    assert_identical(bare, watched)  # the NaN step was skipped: what a bare run without it did
    assert [(e.step, e.kind) for e in mon.events] == [(2, "bad_batch")]
    assert "FakeWrapper is a wrapper; watching the Adam inside it (its .optimizer)\n" in capsys.readouterr().err


def test_an_optimizer_without_step_hooks_is_refused_naming_it(tmp_path):
    model = nn.Linear(4, 1)
    opt = Hookless(model.parameters())
    mon = sfmonitor.Monitor(run_dir=str(tmp_path), config=quiet())
    with pytest.raises(TypeError, match=r"Hookless.*step hooks"):
        mon.attach(model, opt)
    _assert_nothing_left(mon, model, opt, str(tmp_path))


def test_accelerates_optimizer_is_unwrapped(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet())
    assert mon.optimizer is opt.optimizer
    assert sfmonitor.Monitor.attached_to(opt) is mon  # found through the wrapper too
    acc.backward(mon.combine(model(torch.randn(8, 4)).pow(2).mean()))
    opt.step()
    assert mon.step == 1 and mon.events == []
    mon.detach()
    assert not opt.optimizer._optimizer_step_pre_hooks


@pytest.mark.parametrize("where", ["memory_plan", "run_metadata", "ActionContext", "make_sink"])
def test_a_failure_anywhere_in_attach_leaves_nothing_behind(where, tmp_path, monkeypatch):
    import sfmonitor.monitor as M

    def boom(*a, **k):
        raise RuntimeError("boom")

    if where == "ActionContext":
        monkeypatch.setattr(M.A, "ActionContext", boom)
    else:
        monkeypatch.setattr(M, where, boom)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    mon = sfmonitor.Monitor(run_dir=str(tmp_path), config=quiet())
    with pytest.raises(RuntimeError, match="boom"):
        mon.attach(model, opt, scaler=scaler)
    _assert_nothing_left(mon, model, opt, str(tmp_path))
    assert "step" not in scaler.__dict__ and "update" not in scaler.__dict__
    monkeypatch.undo()
    # the same monitor attaches again, and so would another one on the same run_dir
    mon.attach(model, opt, scaler=scaler)
    assert mon.attached
    mon.detach()
    other = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    other.detach()


def test_a_failed_attach_without_run_dir_leaves_no_folder(tmp_path, monkeypatch):
    import sfmonitor.monitor as M

    monkeypatch.setattr(M, "memory_plan", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.Monitor(sinks=[], config=quiet())
    with pytest.raises(RuntimeError, match="boom"):
        mon.attach(model, opt)
    assert mon.run_dir is None
    assert not os.path.exists("sfmonitor_runs") or not os.listdir("sfmonitor_runs")


def test_a_module_that_is_not_in_the_model_is_named(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        sfmonitor.ConfigError, match=r"groups\['x'\] \(a Linear\): its parameter 'weight'.*not in the model"
    ):
        sfmonitor.attach(model, opt, groups={"x": nn.Linear(2, 2)}, run_dir=str(tmp_path), config=quiet())


def test_a_run_dir_locked_by_another_monitor_keeps_its_lock(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    second = sfmonitor.Monitor(run_dir=str(tmp_path), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match="already used by another monitor"):
        second.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert os.path.exists(tmp_path / LOCK_FILE)  # the first monitor's, left alone
    assert not second.attached and second.run_dir == str(tmp_path)
    first.combine(model(torch.randn(8, 4)).pow(2).mean()).backward()
    opt.step()
    assert first.step == 1
    first.detach()
    assert not os.path.exists(tmp_path / LOCK_FILE)


def test_gradient_ratio_and_cosine_of_complex_gradients_use_both_parts():
    a, b = [torch.tensor([1 + 2j, 3 - 1j])], [torch.tensor([2 - 1j, 1 + 1j])]
    ratio, cos = S.shared_grad_stats(a, b)
    ra, rb = torch.view_as_real(a[0]).flatten(), torch.view_as_real(b[0]).flatten()
    assert float(ratio) == pytest.approx(float(ra.norm() / rb.norm()), rel=1e-5)
    assert float(cos) == pytest.approx(float(ra @ rb / (ra.norm() * rb.norm())), rel=1e-5)


# --------------------------------------------------------------------------------------------
# 5. a second monitor on one optimizer; state and metrics that are not what they should be
# --------------------------------------------------------------------------------------------


def test_a_second_monitor_on_the_same_optimizer_is_refused_and_the_first_can_be_found(tmp_path):
    """A notebook cell run twice attaches a second monitor beside the first: both would act on
    every step (two LR drops for one finding, two clips). Refused, naming the first; and the first
    can be found from the optimizer when its handle is lost."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "a"), config=quiet())
    assert sfmonitor.Monitor.attached_to(opt) is first
    second = sfmonitor.Monitor(run_dir=str(tmp_path / "b"), config=quiet())
    with pytest.raises(sfmonitor.ConfigError, match=r"already has a monitor attached \(run_dir .*a'.*detach\(\)"):
        second.attach(model, opt)
    assert not second.attached and not os.path.exists(tmp_path / "b")
    hooks = len(opt._optimizer_step_pre_hooks)
    sfmonitor.Monitor.attached_to(opt).detach()
    assert sfmonitor.Monitor.attached_to(opt) is None and len(opt._optimizer_step_pre_hooks) == hooks - 1
    second.attach(model, opt)  # now it may
    assert sfmonitor.Monitor.attached_to(opt) is second
    second.detach()
    # A GAN: one monitor per optimizer, each on its own parameters, is fine.
    d, g = nn.Linear(4, 1), nn.Linear(2, 4)
    od, og = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    md = sfmonitor.attach(d, od, run_dir=str(tmp_path / "d"), config=quiet())
    mg = sfmonitor.attach(g, og, run_dir=str(tmp_path / "g"), config=quiet())
    assert sfmonitor.Monitor.attached_to(od) is md and sfmonitor.Monitor.attached_to(og) is mg
    md.detach()
    mg.detach()


@pytest.mark.parametrize(
    "state, error, match",
    [
        (
            {"model": {}, "optimizer": {}},
            sfmonitor.ConfigError,
            r"load_state_dict: .*'step'.*got keys \['model', 'optimizer'\]",
        ),
        ([1, 2], TypeError, r"load_state_dict: expected the mapping Monitor.state_dict\(\) returned, got list"),
        ({"step": "x"}, sfmonitor.ConfigError, r"load_state_dict: state\['step'\] must be a whole number, got 'x'"),
        (
            {"step": 3, "new_regime": 1},
            sfmonitor.ConfigError,
            r"load_state_dict: state\['new_regime'\] must be a str or None, got 1",
        ),
    ],
)
def test_load_state_dict_names_what_is_wrong_and_changes_nothing(state, error, match, tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    mon.combine(model(torch.randn(8, 4)).pow(2).mean()).backward()
    opt.step()
    before = mon.state_dict()
    with pytest.raises(error, match=match):
        mon.load_state_dict(state)
    assert mon.state_dict() == before
    mon.detach()


def test_new_regime_names_a_reason_that_is_not_text(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    with pytest.raises(TypeError, match="new_regime: reason must be a str, got int"):
        mon.new_regime(3)
    assert mon.state_dict()["new_regime"] is None
    mon.new_regime("stage 2")  # (announced, kept across a checkpoint until the next step)
    assert mon.state_dict()["new_regime"] == "stage 2"
    mon.detach()


def test_observe_eval_names_a_metric_that_is_not_a_number(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    with pytest.raises(TypeError, match=r"observe_eval: metrics\['loss'\] is 'low' \(a str\); expected a number"):
        mon.observe_eval({"loss": "low"})
    with pytest.raises(TypeError, match=r"observe_eval: metrics must be a mapping"):
        mon.observe_eval(0.5)  # type: ignore[arg-type]
    assert mon.observe_eval({"loss": torch.tensor(0.5), "accuracy": 0.9}) == []  # tensors and floats both fine
    mon.detach()


def test_observe_eval_takes_numpy_numbers(tmp_path):
    np = pytest.importorskip("numpy")
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    assert mon.observe_eval({"loss": np.float32(0.5), "accuracy": np.float64(0.9), "n": np.int64(3)}) == []
    mon.detach()
