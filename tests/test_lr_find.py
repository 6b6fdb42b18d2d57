"""Tests for sfmonitor.tools.lr_find (the LR range test) and ``sfmonitor lr-find`` (its preset on
the reference model, reference_model.lr_find)."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sfmonitor
from reference_model.lr_find import main as lr_find_main
from sfmonitor.checkpoint import copy_tree
from sfmonitor.tools import lr_find as L

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def regression(seed=0, n=256, d=10, bs=32):
    """y = X w + noise, batches as a list; MSE's Hessian is ~2I, so SGD diverges near lr 1."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g)
    y = X @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return [(X[i : i + bs], y[i : i + bs]) for i in range(0, n, bs)]


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


class Scripted:
    """A loss that is a function of the optimizer's current LR (plus 0 x a parameter)."""

    def __init__(self, opt, fn):
        self.opt, self.fn, self.calls = opt, fn, 0

    def __call__(self, model, batch):
        self.calls += 1
        lr = self.opt.param_groups[0]["lr"]
        return model.weight.sum() * 0 + self.fn(lr)


def tiny_linear():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def state_equal(a, b):
    """Deep equality of state dicts, tensors compared bit-exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


def clone_tree(x):
    return copy_tree(x)


# --------------------------------------------------------------------------------------------
# the sweep and its suggestions
# --------------------------------------------------------------------------------------------


def test_regression_suggestion_is_sane_and_divergence_stops_early():
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = sfmonitor.lr_find(model, opt, regression(), mse, start_lr=1e-5, end_lr=100, num_iter=100)
    # SGD on this problem: optimum lr ~0.5, divergence above ~1 (2 / largest Hessian eigenvalue)
    assert res.stop_reason == L.STOP_DIVERGED and res.diverged
    assert res.iterations < 100 and len(res.losses) == len(res.smoothed) == res.iterations
    assert 0.5 < res.lr_diverged < 10
    assert res.lr_steepest is not None and res.suggested_lr == res.lr_steepest
    assert 1e-2 <= res.suggested_lr <= 0.5
    assert res.suggested_lr < res.lr_min_loss < res.lr_diverged
    assert res.min_loss < 0.5 * res.initial_loss and not res.flat  # the sweep did train
    assert res.cyclic_max_lr == pytest.approx(res.lr_min_loss / 10)
    assert res.cyclic_base_lr == pytest.approx(res.cyclic_max_lr / 4)
    assert res.cyclic_max_lr < res.lr_diverged
    assert res.current_lr == 0.1 and res.current_lr_too_large is False
    # the exponential schedule: start_lr * (end/start)^(i/99)
    assert res.lrs[0] == pytest.approx(1e-5)
    assert res.lrs[50] == pytest.approx(1e-5 * 1e7 ** (50 / 99))


def test_adam_suggestion_is_sane():
    torch.manual_seed(1)
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    res = sfmonitor.lr_find(model, opt, regression(1), mse, start_lr=1e-5, end_lr=100, num_iter=100)
    assert res.diverged and res.iterations < 100
    assert 1e-3 <= res.suggested_lr <= 1.0


def test_stops_at_the_first_step_past_diverge_factor():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = Scripted(opt, lambda lr: 1.0 if lr < 1e-2 else 10.5)
    res = L.lr_find(model, opt, [0], fn, start_lr=1e-4, end_lr=1, num_iter=5, smoothing=0.0)
    # lrs 1e-4, 1e-3, 1e-2: the third step's loss is 10.5 > 10 x 1.0
    assert res.stop_reason == L.STOP_DIVERGED
    assert res.iterations == 3 and res.lr_diverged == pytest.approx(1e-2)
    assert fn.calls == 3
    # 10.5 is not more than 20x: the sweep runs to its end
    fn = Scripted(opt, lambda lr: 1.0 if lr < 1e-2 else 10.5)
    res = L.lr_find(model, opt, [0], fn, start_lr=1e-4, end_lr=1, num_iter=5, smoothing=0.0, diverge_factor=20)
    assert res.stop_reason == L.STOP_COMPLETED and res.iterations == 5 and res.lr_diverged is None
    assert res.lrs[-1] == pytest.approx(1.0)


def test_diverge_reference_best_or_initial():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    curve = lambda lr: 1.0 if lr < 1e-3 else (0.5 if lr < 1e-1 else 6.0)
    res = L.lr_find(model, opt, [0], Scripted(opt, curve), start_lr=1e-4, end_lr=1, num_iter=5, smoothing=0.0)
    assert res.stop_reason == L.STOP_DIVERGED and res.lr_diverged == pytest.approx(1e-1)  # 6 > 10 x 0.5
    res = L.lr_find(
        model,
        opt,
        [0],
        Scripted(opt, curve),
        start_lr=1e-4,
        end_lr=1,
        num_iter=5,
        smoothing=0.0,
        diverge_reference="initial",
    )
    assert res.stop_reason == L.STOP_COMPLETED  # 6 < 10 x 1.0 (the first loss)


def test_smoothing_is_a_bias_corrected_ema():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vals = iter([2.0, 4.0, 1.0])
    res = L.lr_find(
        model,
        opt,
        [0],
        Scripted(opt, lambda lr: next(vals)),
        start_lr=1e-3,
        end_lr=1e-2,
        num_iter=3,
        smoothing=0.5,
        diverge_factor=100,
    )
    avg, want = 0.0, []
    for i, v in enumerate([2.0, 4.0, 1.0]):
        avg = 0.5 * avg + 0.5 * v
        want.append(avg / (1 - 0.5 ** (i + 1)))
    assert res.losses == [2.0, 4.0, 1.0]
    assert res.smoothed == pytest.approx(want)
    assert res.smoothed[0] == 2.0  # bias correction: the first value is the first loss


def test_nonfinite_loss_stops_and_never_enters_the_average():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fn = Scripted(opt, lambda lr: 1.0 if lr < 1e-2 else float("nan"))
    res = L.lr_find(model, opt, [0], fn, start_lr=1e-4, end_lr=1, num_iter=5, smoothing=0.9)
    assert res.stop_reason == L.STOP_NONFINITE and res.diverged
    assert res.lr_diverged == pytest.approx(1e-2)
    assert math.isnan(res.losses[-1]) and math.isnan(res.smoothed[-1])
    assert res.smoothed[:-1] == pytest.approx([1.0, 1.0])
    assert res.min_loss == pytest.approx(1.0) and res.current_lr_too_large is True
    d = res.to_dict()
    assert d["losses"][-1] == "nan" and json.dumps(d)  # JSON-safe


def test_nan_at_the_first_step_gives_no_suggestion():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = L.lr_find(model, opt, [0], Scripted(opt, lambda lr: float("inf")), num_iter=5)
    assert res.stop_reason == L.STOP_NONFINITE and res.iterations == 1
    assert res.suggested_lr is None and res.cyclic_max_lr is None
    assert "no suggestion" in res.summary()
    with pytest.raises(ValueError, match="no cyclic range"):
        res.cyclic_lr(opt)


def test_flat_curve_gives_no_suggestion():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wiggle = iter([1.0, 0.995, 1.002, 0.99, 1.0, 0.999] * 5)  # noise, never 2% under the start
    res = L.lr_find(
        model, opt, [0], Scripted(opt, lambda lr: next(wiggle)), num_iter=30, start_lr=1e-6, end_lr=1e-2, smoothing=0.0
    )
    assert res.flat and res.suggested_lr is None and res.lr_steepest is None
    assert res.cyclic_max_lr is None and res.min_loss == pytest.approx(0.99)
    assert "flat" in res.summary() and res.to_dict()["flat"] is True
    # the same curve with a real descent (3%) gets a suggestion
    drop = iter([1.0] * 10 + [1.0 - 0.003 * i for i in range(1, 11)] + [0.97] * 10)
    res = L.lr_find(
        model, opt, [0], Scripted(opt, lambda lr: next(drop)), num_iter=30, start_lr=1e-6, end_lr=1e-2, smoothing=0.0
    )
    assert not res.flat and res.suggested_lr is not None
    assert res.lrs[10] <= res.lr_steepest <= res.lrs[20]


def test_linear_mode_and_group_ratios():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.01}], lr=0.1
    )
    seen = []

    def fn(m, batch):
        seen.append([g["lr"] for g in opt.param_groups])
        return m(torch.ones(1, 2)).sum() * 0 + 1.0

    res = L.lr_find(model, opt, [0], fn, start_lr=0.1, end_lr=0.5, num_iter=5, mode="linear")
    assert res.lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert [s[0] for s in seen] == pytest.approx(res.lrs)
    assert [s[1] for s in seen] == pytest.approx([lr / 10 for lr in res.lrs])  # ratio kept
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]  # restored


def test_dict_loss_weights_components_and_accumulation():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.tensor(1.0), torch.tensor(3.0)]  # accumulation 2 -> each step sees both
    calls = []

    def fn(m, b):
        calls.append(float(b))
        z = m.weight.sum() * 0
        return {"a": z + b, "b": z + 2 * b}

    res = L.lr_find(
        model,
        opt,
        batches,
        fn,
        num_iter=3,
        accumulation=2,
        weights={"a": 0.5, "b": 2.0},
        start_lr=1e-3,
        end_lr=1e-2,
        diverge_factor=100,
    )
    assert calls == [1.0, 3.0] * 3
    # mean over the 2 micro-batches of 0.5*b + 2*(2b) = 4.5 b -> 4.5 * 2
    assert res.losses == pytest.approx([9.0] * 3)
    assert res.components == {"a": pytest.approx([2.0] * 3), "b": pytest.approx([4.0] * 3)}
    # no weights: a plain sum
    res = L.lr_find(model, opt, batches, fn, num_iter=2, start_lr=1e-3, end_lr=1e-2)
    assert res.losses[0] == pytest.approx(3.0)


def test_one_shot_iterator_ends_the_sweep():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = L.lr_find(
        model,
        opt,
        iter(regression(n=64, d=2, bs=16)),
        lambda m, b: F.mse_loss(m(b[0]), b[1]),
        num_iter=10,
        start_lr=1e-4,
        end_lr=1e-2,
    )
    assert res.stop_reason == L.STOP_LOADER_EXHAUSTED and res.iterations == 4


def test_reiterable_loader_is_cycled():
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = L.lr_find(model, opt, regression(n=64, bs=32), mse, num_iter=7, start_lr=1e-5, end_lr=1e-3)
    assert res.stop_reason == L.STOP_COMPLETED and res.iterations == 7


# --------------------------------------------------------------------------------------------
# the sweep leaves no trace
# --------------------------------------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.3)
        self.fc2 = torch.nn.Linear(16, 1)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum", "fresh_adam"])
def test_model_optimizer_rng_and_modes_restored_bit_exactly(opt_name):
    torch.manual_seed(0)
    model = Net()
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    elif opt_name == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = regression()
    if opt_name != "fresh_adam":  # a run in progress: optimizer state, leftover grads
        mse(model, batches[0]).backward()
        opt.step()
        opt.zero_grad()
        mse(model, batches[1]).backward()
    model.fc2.eval()  # a user-chosen mode on one submodule
    model_before = clone_tree(model.state_dict())
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    opt_before = clone_tree(opt.state_dict())
    rng_before = torch.get_rng_state()
    modes_before = [m.training for m in model.modules()]

    moved = []

    def fn(m, b):
        moved.append(not torch.equal(m.fc1.weight, model_before["fc1.weight"]))
        return mse(m, b)

    res = L.lr_find(model, opt, batches, fn, start_lr=1e-4, end_lr=10, num_iter=30)
    assert res.iterations >= 3 and any(moved)  # the sweep did change the weights while it ran
    assert state_equal(model.state_dict(), model_before)
    assert all(torch.equal(b, buffers_before[n]) for n, b in model.named_buffers())  # non-persistent too
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads_before[n] is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, grads_before[n]), n
    assert state_equal(opt.state_dict(), opt_before)
    if opt_name == "fresh_adam":
        assert len(opt.state) == 0
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert [m.training for m in model.modules()] == modes_before


def test_state_restored_when_loss_fn_raises():
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = clone_tree(model.state_dict())
    n = []

    def fn(m, b):
        n.append(1)
        if len(n) == 4:
            raise RuntimeError("boom")
        return mse(m, b)

    with pytest.raises(RuntimeError, match="boom"):
        L.lr_find(model, opt, regression(), fn, start_lr=1e-2, end_lr=1, num_iter=10)
    assert state_equal(model.state_dict(), before)
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 1e-3


def test_grad_scaler_and_autocast_restored():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    dtypes = []

    def fn(m, b):
        out = m(b[0])
        dtypes.append(out.dtype)
        return F.mse_loss(out.float(), b[1])

    before_model = clone_tree(model.state_dict())
    before_scaler = clone_tree(scaler.state_dict())
    res = L.lr_find(
        model,
        opt,
        regression(),
        fn,
        start_lr=1e-5,
        end_lr=10,
        num_iter=40,
        scaler=scaler,
        autocast_dtype=torch.bfloat16,
    )
    assert set(dtypes) == {torch.bfloat16}
    assert res.iterations >= 10 and res.suggested_lr is not None
    assert state_equal(model.state_dict(), before_model)
    assert state_equal(scaler.state_dict(), before_scaler)
    assert len(opt.state) == 0


def test_grad_scaler_skipped_steps_are_counted_not_divergence():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def fn(m, b):  # loss 1.0 (finite), but the first 2 steps' scaled gradients overflow fp32
        big = 1e36 if len(calls) < 2 else 1.0
        calls.append(1)
        g = (m.weight * big).sum()
        return g - g.detach() + 1.0

    calls = []
    res = L.lr_find(model, opt, [0], fn, num_iter=5, scaler=scaler, start_lr=1e-3, end_lr=1e-2)
    assert res.stop_reason == L.STOP_COMPLETED and res.iterations == 5
    assert res.skipped_steps == 2
    assert scaler.get_scale() == 2.0**16  # restored


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"start_lr": 0.0}, "start_lr"),
        ({"start_lr": -1e-3}, "start_lr"),
        ({"start_lr": 1.0, "end_lr": 0.5}, "end_lr"),
        ({"end_lr": 1e-7}, "end_lr"),
        ({"num_iter": 1}, "num_iter"),
        ({"num_iter": 10.5}, "num_iter"),
        ({"mode": "cubic"}, "mode"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"smoothing": -0.1}, "smoothing"),
        ({"diverge_factor": 1.0}, "diverge_factor"),
        ({"diverge_factor": float("nan")}, "diverge_factor"),
        ({"diverge_reference": "last"}, "diverge_reference"),
        ({"accumulation": 0}, "accumulation"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"skip_start": 1.0}, "skip_start"),
        ({"min_drop": 1.0}, "min_drop"),
        ({"slope_window": 0.5}, "slope_window"),
        ({"weights": [0.5]}, "weights"),
        ({"weights": {"a": float("inf")}}, "weights"),
        ({"scaler": object()}, "scaler"),
        ({"autocast_dtype": torch.float32}, "autocast_dtype"),
    ],
)
def test_bad_keyword_arguments_name_the_argument(kwargs, name):
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=name):
        L.lr_find(model, opt, [0], mse, **kwargs)


def test_bad_positional_arguments_name_the_argument():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="model"):
        L.lr_find("net", opt, [0], mse)
    with pytest.raises(ValueError, match="optimizer"):
        L.lr_find(model, model.parameters(), [0], mse)
    with pytest.raises(ValueError, match="loader"):
        L.lr_find(model, opt, 5, mse)
    with pytest.raises(ValueError, match="loss_fn"):
        L.lr_find(model, opt, [0], "mse")
    with pytest.raises(ValueError, match="loader: yielded no batches"):
        L.lr_find(model, opt, [], mse)


def test_bad_loss_fn_outputs_are_reported():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = clone_tree(model.state_dict())
    with pytest.raises(ValueError, match="loss_fn: must return a scalar"):
        L.lr_find(model, opt, [0], lambda m, b: m.weight)
    with pytest.raises(ValueError, match="loss_fn: must return a loss tensor or a dict"):
        L.lr_find(model, opt, [0], lambda m, b: 1.0)
    with pytest.raises(ValueError, match="loss_fn: returned an empty dict"):
        L.lr_find(model, opt, [0], lambda m, b: {})
    z = lambda m: m.weight.sum()
    with pytest.raises(ValueError, match=r"weights: keys must match.*missing \['b'\]"):
        L.lr_find(model, opt, [0], lambda m, b: {"a": z(m), "b": z(m)}, weights={"a": 1.0})
    with pytest.raises(ValueError, match="weights: given, but loss_fn returned a single tensor"):
        L.lr_find(model, opt, [0], lambda m, b: z(m), weights={"a": 1.0})
    assert state_equal(model.state_dict(), before)


def test_warns_when_optimizer_has_step_hooks():
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    handle = opt.register_step_post_hook(lambda *a: steps.append(1))
    with pytest.warns(UserWarning, match="step hooks"):
        L.lr_find(model, opt, [0], Scripted(opt, lambda lr: 1.0), num_iter=3, start_lr=1e-3, end_lr=1e-2)
    handle.remove()
    assert len(steps) == 2  # the last step's update is not taken


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------


def test_out_dir_writes_json_and_png_and_cyclic_lr(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = L.lr_find(model, opt, regression(), mse, start_lr=1e-5, end_lr=100, num_iter=60, out_dir=str(tmp_path / "lr"))
    data = json.loads((tmp_path / "lr" / L.JSON_FILE).read_text())
    assert data["lrs"] == pytest.approx(res.lrs)
    assert data["suggested_lr"] == pytest.approx(res.suggested_lr)
    assert data["stop_reason"] == res.stop_reason and data["diverged"] is True
    assert data["config"]["num_iter"] == 60 and data["config"]["diverge_factor"] == 10.0
    png = (tmp_path / "lr" / L.PNG_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    sched = res.cyclic_lr(opt, step_size_up=4)
    assert isinstance(sched, torch.optim.lr_scheduler.CyclicLR)
    lrs = []
    for _ in range(9):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(res.cyclic_base_lr) and lrs[4] == pytest.approx(res.cyclic_max_lr)
    assert lrs[8] == pytest.approx(res.cyclic_base_lr)  # triangular: back down
    table = res.table(rows=10)
    assert "steepest" in table and "diverged" in table and "min loss" in table
    assert "CyclicLR(base_lr=" in res.summary()


def test_no_plot_writes_only_json(tmp_path):
    model = tiny_linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    L.lr_find(
        model,
        opt,
        [0],
        Scripted(opt, lambda lr: 1.0),
        num_iter=3,
        start_lr=1e-3,
        end_lr=1e-2,
        out_dir=str(tmp_path),
        plot=False,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [L.JSON_FILE]


def test_importing_lr_find_imports_no_matplotlib():
    code = (
        "import sys, sfmonitor, sfmonitor.tools.lr_find; "
        "print(any(m.split('.')[0] in ('matplotlib', 'wandb', 'tensorboard') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --------------------------------------------------------------------------------------------
# sfmonitor lr-find
# --------------------------------------------------------------------------------------------


def test_cli_on_the_tiny_reference_config(tmp_path, capsys):
    from sfmonitor import cli

    rc = cli.main(
        [
            "lr-find",
            "--config",
            "tiny",
            "--num-iter",
            "8",
            "--out",
            str(tmp_path),
            "--no-plot",
            "--set",
            "train.amp=false",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "config tiny" in out and "fp32" in out
    assert "suggested lr" in out and "cyclic range" in out
    data = json.loads((tmp_path / L.JSON_FILE).read_text())
    assert 1 <= data["iterations"] <= 8
    assert set(data["components"]) == {"vision", "text", "fusion"}
    assert data["current_lr"] == pytest.approx(3e-3)  # tiny.yaml's train.lr
    assert data["config"]["accumulation"] == 2  # tiny.yaml's train.accumulation
    # weighted total of the three components (0.4/0.3/0.3) is the recorded loss
    c = data["components"]
    assert data["losses"][0] == pytest.approx(
        0.4 * c["vision"][0] + 0.3 * c["text"][0] + 0.3 * c["fusion"][0], rel=1e-5
    )


def test_cli_with_fp16_grad_scaler(tmp_path, capsys):
    rc = lr_find_main(["--config", "tiny", "--num-iter", "4", "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0 and "fp16 + GradScaler" in out
    assert json.loads((tmp_path / L.JSON_FILE).read_text())["iterations"] >= 1


def test_cli_bad_config_and_arguments(capsys):
    assert lr_find_main(["--config", "no_such_config", "--num-iter", "4"]) == 2
    assert "not found" in capsys.readouterr().err
    assert lr_find_main(["--config", "tiny", "--num-iter", "1"]) == 2
    assert "num_iter" in capsys.readouterr().err
    assert lr_find_main(["--config", "tiny", "--set", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err
