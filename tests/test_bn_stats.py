"""A batch that wrecks BatchNorm's running statistics while its loss looks normal: in training
mode BatchNorm normalises by the batch's own statistics, so a batch of inputs 1e3x their scale
(an image pipeline that skipped its normalisation once) gives an ordinary loss, gradients and
update, and writes a variance 1e6x the usual into ``running_var``, which evaluation then uses (a
helper's probe: a BatchNorm ResNet's held-out loss 1.5-3.9x its twin's, no event)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sfmonitor


def make(momentum=0.1):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, momentum=momentum),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, momentum=momentum),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def batches(n, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def loop(net, opt, steps, batch, loss_fn, *, run_dir=None, config=None, drop=(), before=None):
    """``steps`` steps of ``net``, monitored (through ``monitor.batches()``) when ``run_dir`` is
    given: ``batch(i)`` gives step i's (x, y); ``before(i)`` runs before its forward; the batches
    in ``drop`` are never trained on. Returns the net and the monitor."""
    mon = None
    if run_dir is not None:
        mon = sfmonitor.attach(net, opt, run_dir=run_dir, sinks=[], config={"console": False, **(config or {})})
    for i in mon.batches(range(steps)) if mon else range(steps):
        if i in drop:
            continue
        if before is not None:
            before(i)
        x, y = batch(i)
        loss = loss_fn(net(x), y)
        (mon.combine(loss) if mon else loss).backward()
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.detach()
    return net, mon


def train(data, *, monitored, tmp_path=None, scaled=(), drop=(), momentum=0.1, config=None):
    net, opt = make(momentum)

    def batch(i):
        x, y = data[i]
        return (x * 1e3 if i in scaled else x), y

    run_dir = tmp_path if monitored else None
    return loop(net, opt, len(data), batch, nn.functional.cross_entropy, run_dir=run_dir, config=config, drop=drop)


def same(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    return True


def test_a_batch_that_blows_up_batchnorm_statistics_is_skipped_and_leaves_no_trace(tmp_path):
    data = batches(40)
    net, mon = train(data, monitored=True, tmp_path=tmp_path, scaled={30})
    acted = [(e.step, e.kind, e.actions) for e in mon.events if e.actions]
    assert acted == [(30, "bn_var_spike", ["skip_step"])]
    (ev,) = [e for e in mon.events if e.kind == "bn_var_spike"]
    assert ev.data["module"] == "1" and ev.data["ratio"] > 1e5  # the first BatchNorm: its input was scaled
    # bit-identical (parameters and running statistics) to the run that never saw that batch
    twin, _ = train(data, monitored=False, drop={30})
    assert same(net, twin)
    bare, _ = train(data, monitored=False, scaled={30})
    assert bare[1].running_var.mean() > 1e4 * net[1].running_var.mean()  # what it saved


@pytest.mark.parametrize("momentum", [0.1, None])
def test_healthy_batchnorm_runs_are_untouched(tmp_path, momentum):
    """Unnormalised inputs (pixel values, variance ~1e4): the running variance climbs from 1 by
    orders of magnitude in the first steps, a healthy start; and a cumulative average (momentum
    None). No event, bit-identical to bare."""
    data = batches(60, scale=100.0)
    net, mon = train(data, monitored=True, tmp_path=tmp_path, momentum=momentum)
    assert [e for e in mon.events if e.kind == "bn_var_spike"] == []
    assert not [e for e in mon.events if e.actions]
    assert same(net, train(data, monitored=False, momentum=momentum)[0])
    assert "bn_var_ratio/0" not in mon.stats  # the group is the model's top level: named by it
    assert any(k.startswith("bn_var_ratio/") for k in mon.stats)


def test_data_whose_scale_changed_for_good_is_accepted_after_a_few_batches(tmp_path):
    """Every batch from step 30 on is 1e3x: no bad batch, the data changed. Skipped
    ``accept_after`` times, then taken as the new scale (told, no action) and trained on."""
    data = batches(60)
    net, mon = train(data, monitored=True, tmp_path=tmp_path, scaled=set(range(30, 60)))
    skips = [e.step for e in mon.events if e.kind == "bn_var_spike" and e.actions]
    assert len(skips) == 8
    told = [e for e in mon.events if e.kind == "bn_var_shift"]
    assert len(told) == 1 and not told[0].actions
    assert net[1].running_var.mean() > 1e4  # the new scale landed in the statistics


def test_a_change_of_scale_the_loop_announces_is_trained_on_from_its_first_batch(tmp_path):
    """The same change, announced by the loop (``monitor.new_regime()`` before step 30): the
    BatchNorm check starts its warm-up again there, as after a shift; nothing is skipped and the
    run equals bare."""
    data = batches(60)
    net, opt = make()
    holder = {}

    def before(i):
        if i == 30:
            holder["mon"].new_regime("another camera")

    def batch(i):
        x, y = data[i]
        return (x * 1e3 if i >= 30 else x), y

    mon = sfmonitor.attach(net, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    holder["mon"] = mon
    for i in mon.batches(range(60)):
        before(i)
        x, y = batch(i)
        mon.combine(nn.functional.cross_entropy(net(x), y)).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    assert [(e.step, e.kind, e.actions) for e in mon.events] == [(30, "new_regime", [])]
    bare, _ = loop(*make(), 60, batch, nn.functional.cross_entropy)
    assert same(net, bare)


def test_the_check_can_be_switched_off(tmp_path):
    data = batches(40)
    net, mon = train(
        data, monitored=True, tmp_path=tmp_path, scaled={30}, config={"detectors": {"bn_var_spike": {"enabled": False}}}
    )
    assert not [e for e in mon.events if e.kind == "bn_var_spike"]
    assert same(net, train(data, monitored=False, scaled={30})[0])


def test_statistics_a_harmful_update_blew_up_are_the_states_doing_not_the_batchs(tmp_path):
    """An update at 1e4x the LR wrecks the weights; the next forward's BatchNorm variance is huge.
    That is the update's doing: undone (update_ratio_spike), and no bad batch is reported."""
    data = batches(40)
    net, opt = make()
    mon = sfmonitor.attach(net, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    for i in mon.batches(range(len(data))):
        x, y = data[i]
        mon.combine(nn.functional.cross_entropy(net(x), y)).backward()
        opt.param_groups[0]["lr"] = 0.05 * (1e4 if i == 30 else 1.0)
        opt.step()
        opt.param_groups[0]["lr"] = 0.05
        opt.zero_grad()
    mon.detach()
    assert [(e.kind, e.actions) for e in mon.events if e.actions] == [("update_ratio_spike", ["undo"])]
    assert not [e for e in mon.events if e.kind == "bn_var_spike"]


def fit(net, steps, batch, *, run_dir=None, before=None):
    """SGD on a regression: ``batch(i, g)`` gives step i's (x, y) from one generator."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    return loop(net, opt, steps, lambda i: batch(i, g), nn.functional.mse_loss, run_dir=run_dir, before=before)


def test_a_float64_model_and_a_reset_of_the_running_statistics(tmp_path):
    """A float64 BatchNorm model is measured like any other (the first version crashed at its
    second step: a float64 ratio into a float32 buffer). The user's reset_running_stats() mid-run
    is no batch: the variance it leaves (1) is not judged against the one before (here 3e5x; a
    helper's probe: a reset read as a large batch was skipped, and the skip put the old
    statistics back, undoing the reset)."""

    def run(run_dir=None):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)).double()

        def batch(i, g):
            x = 0.01 * torch.randn(32, 6, generator=g, dtype=torch.float64)  # (a reset to 1 reads as ~1e5x)
            return x, x.sum(1, keepdim=True)

        return fit(net, 160, batch, run_dir=run_dir, before=lambda i: i == 150 and net[1].reset_running_stats())

    net, mon = run(tmp_path)
    assert not mon.events
    assert any(k.startswith("bn_var_ratio/") for k in mon.stats)
    assert same(net, run()[0])


def test_an_outlier_in_one_feature_is_no_batch_off_the_datas_scale(tmp_path):
    """A BatchNorm1d normalising raw tabular features, one of them heavy-tailed: one sample's
    value there 1e4x the usual gives that channel a batch variance ~1e6x its running one, while
    every other feature is as always. A batch off the data's scale is off in most channels: each
    layer's ratio is the geometric mean over its channels (a helper's probe: log-normal features
    with sigma 4 had healthy batches skipped at 1.2-2.4e4 with the L2 norm over channels)."""

    def batch(i, g):
        x = torch.randn(32, 8, generator=g)
        y = x[:, 1:].sum(1, keepdim=True)
        if i == 40:
            x[3, 0] = 1e4  # feature 0 is not in the target: an outlier the model can shrug off
        return x, y

    def run(run_dir=None):
        torch.manual_seed(0)
        return fit(
            nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), 60, batch, run_dir=run_dir
        )

    net, mon = run(tmp_path)
    assert not [e for e in mon.events if e.kind == "bn_var_spike"]
    assert same(net, run()[0])


def test_a_layer_without_weights_belongs_to_its_enclosing_modules_group_and_ranks_agree(tmp_path):
    """A BatchNorm without affine parameters has no weight to name its group: it takes the group
    of the module around it. Across ranks the ratio is the largest (one rank's bad batch is the
    step's) and the layer named is one every rank names alike."""
    from sfmonitor import stats as S

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 1)  # the first group: a layer without a group of its own is not put here
            self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, affine=False))

        def forward(self, x):
            return self.head(self.body(x))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    _, mon = loop(
        net, opt, 3, lambda i: (torch.randn(16, 4), torch.randn(16, 1)), nn.functional.mse_loss, run_dir=tmp_path
    )
    assert [k for k in mon.stats if k.startswith("bn_var_ratio/")] == ["bn_var_ratio/body"]
    assert S.reduction_of("bn_var_ratio/body") is S.Reduce.MAX
    assert S.reduction_of(S.BN_VAR_WORST) is S.Reduce.FIRST


LEAN = {"actions": {"undo": {"enabled": False}}, "stats": {"update_ratio_fraction": 0.05}, "watch": {"enabled": False}}


@pytest.mark.parametrize("fault", ["nan", "scaled"])
def test_the_lean_profile_puts_the_running_statistics_back_on_a_skip(tmp_path, fault):
    """Without the undo copy (the lean profile) a skip still puts back what the skipped batch
    wrote into the normalisation layers' running statistics: a NaN batch left NaN in
    ``running_mean`` (every evaluation NaN after it, while training went on), a batch at 1e3x
    its scale a ``running_var`` 1e6x (a helper's CNN: held-out 5.2x its twin). The run equals
    the one that never saw that batch, running statistics included."""
    data = batches(40)

    def batch(i):
        x, y = data[i]
        if i == 30:
            x = torch.full_like(x, float("nan")) if fault == "nan" else x * 1e3
        return x, y

    net, opt = make()
    net, mon = loop(net, opt, 40, batch, nn.functional.cross_entropy, run_dir=tmp_path, config=LEAN)
    assert [e.actions for e in mon.events if e.actions] == [["skip_step"]]
    twin, _ = train(data, monitored=False, drop={30})
    assert same(net, twin)
    held = mon.memory["running_stats_device_bytes"]  # reported, and small: the running statistics only
    assert 0 < held <= 2 * sum(b.numel() * b.element_size() for b in net.buffers())
    assert "running statistics' copy" in sfmonitor.summary.format_memory(mon.memory)


class Centered(nn.Module):
    """Subtracts a running center that each training forward replaces (DINO's ``self.center = ...``)."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("center", torch.zeros(n))

    def forward(self, x):
        if self.training:
            self.center = 0.9 * self.center + 0.1 * x.detach().mean(0)
        return x - self.center


def between_forwards(
    run_dir=None, *, config=None, mode="no_grad", fault=None, drop=(), lr=None, peek=None, split=None, center=False
):
    """A BatchNorm MLP under Adam, 40 steps, whose forward runs once more in training mode after
    each step, outside it (a GAN's generator loss through the discriminator): under ``no_grad``,
    with gradients on and no backward, or with a backward (``backward``: gradients the next
    step's ``zero_grad()`` throws away). ``fault``: the step whose batch holds a NaN; ``drop``:
    steps never run (the twin); ``lr``: (step, factor) for one step's LR; ``peek(i, phase, net)``
    sees the net before ("forward") and after ("stepped") each step. ``split``: each step's batch
    in two halves, a backward each (``accumulate``) or one backward of both (``views``);
    ``center``: a buffer each forward replaces, after the first layer."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)]
    net = nn.Sequential(*(layers[:1] + [Centered(8)] + layers[1:] if center else layers))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    mon = None
    if run_dir is not None:
        mon = sfmonitor.attach(net, opt, run_dir=run_dir, sinks=[], config={"console": False, **(config or {})})
    for i in range(40):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if i == fault:
            x[-1, 0] = float("nan")
        if i not in drop:
            opt.zero_grad()
            if peek is not None:
                peek(i, "forward", net)
            if split == "accumulate":
                for h in (slice(0, 8), slice(8, 16)):
                    nn.functional.mse_loss(net(x[h]), y[h]).backward()
            elif split == "views":
                (nn.functional.mse_loss(net(x[:8]), y[:8]) + nn.functional.mse_loss(net(x[8:]), y[8:])).backward()
            else:
                nn.functional.mse_loss(net(x), y).backward()
            if lr is not None and i == lr[0]:
                opt.param_groups[0]["lr"] *= lr[1]
            opt.step()
            opt.param_groups[0]["lr"] = 1e-3
            if peek is not None:
                peek(i, "stepped", net)
        z = torch.randn(16, 4, generator=g) + 2.0
        if mode == "no_grad":
            with torch.no_grad():
                net(z)
        elif mode == "grad":
            net(z).sum()
        else:
            net(z).square().mean().backward()
    if mon is not None:
        mon.detach()
    return net, opt, mon


def identical(a, b):
    """Every parameter, buffer and optimizer state tensor of two (net, opt) runs equal, bit for bit."""
    (net_a, opt_a), (net_b, opt_b) = a, b
    assert same(net_a, net_b)
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k
    return True


@pytest.mark.parametrize("profile", ["defaults", "lean"])
@pytest.mark.parametrize("mode", ["no_grad", "grad", "backward"])
def test_a_skip_keeps_what_a_forward_between_the_steps_wrote_into_the_running_statistics(tmp_path, profile, mode):
    """A skipped batch's step puts the buffers back as they were just before that step's first
    forward, not as the step before left them: a forward the loop runs between the steps (a GAN's
    generator loss through the discriminator, under ``no_grad`` or not) wrote into BatchNorm's
    running statistics legitimately, and the twin that never saw the batch kept that (a probe:
    ``running_mean`` 1.4e-3 off its twin's, ``num_batches_tracked`` 78 against 79)."""
    config = LEAN if profile == "lean" else None
    net, opt, mon = between_forwards(tmp_path, config=config, mode=mode, fault=20)
    assert [(e.step, e.kind, e.actions) for e in mon.events if e.actions] == [(20, "bad_batch", ["skip_step"])]
    twin, twin_opt, _ = between_forwards(mode=mode, drop={20})
    assert int(net[1].num_batches_tracked) == int(twin[1].num_batches_tracked) == 79
    assert identical((net, opt), (twin, twin_opt))


@pytest.mark.parametrize("profile", ["defaults", "lean"])
@pytest.mark.parametrize("split", ["accumulate", "views"])
@pytest.mark.parametrize("mode", ["no_grad", "backward"])
def test_the_skipped_steps_first_forward_is_its_first_micro_batchs(tmp_path, profile, split, mode):
    """A step of two forwards (micro-batches with a backward each, or two halves with one
    backward): a skip puts the buffers back as they were before the first, with what the forward
    between the steps wrote (the NaN is in the second half)."""
    config = LEAN if profile == "lean" else None
    net, opt, mon = between_forwards(tmp_path, config=config, mode=mode, fault=20, split=split)
    assert [(e.step, e.kind, e.actions) for e in mon.events if e.actions] == [(20, "bad_batch", ["skip_step"])]
    twin, twin_opt, _ = between_forwards(mode=mode, drop={20}, split=split)
    assert identical((net, opt), (twin, twin_opt))


@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_a_buffer_a_forward_between_the_steps_replaced_is_kept_by_a_skip(tmp_path, mode):
    """A buffer the forward replaces (``self.center = ...``), not written in place: a new tensor
    is a write too."""
    net, opt, mon = between_forwards(tmp_path, mode=mode, fault=20, center=True)
    assert [(e.step, e.kind, e.actions) for e in mon.events if e.actions] == [(20, "bad_batch", ["skip_step"])]
    twin, twin_opt, _ = between_forwards(mode=mode, drop={20}, center=True)
    assert identical((net, opt), (twin, twin_opt))


@pytest.mark.parametrize("profile", ["defaults", "lean"])
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_forwards_between_the_steps_of_a_healthy_run_change_nothing(tmp_path, profile, mode):
    net, opt, mon = between_forwards(tmp_path, config=LEAN if profile == "lean" else None, mode=mode)
    assert not [e for e in mon.events if e.actions]
    bare, bare_opt, _ = between_forwards(mode=mode)
    assert identical((net, opt), (bare, bare_opt))


@pytest.mark.parametrize("profile", ["defaults", "lean"])
def test_without_forwards_between_the_steps_no_buffer_is_copied_at_a_forward(tmp_path, profile):
    """What this costs a loop without forwards between its steps: nothing. Each buffer's version
    counter is read when the copy is taken and again at the next step's first forward; only a
    buffer written in between is copied then."""
    data = batches(12)
    net, opt = make()
    mon = sfmonitor.attach(net, opt, run_dir=tmp_path, sinks=[], config={"console": False, **LEAN})
    if profile == "defaults":
        mon.detach()
        net, opt = make()
        mon = sfmonitor.attach(net, opt, run_dir=tmp_path / "d", sinks=[], config={"console": False})
    held = mon._ctx.buffer_copy()[0]
    seen = []
    net.register_forward_hook(lambda m, a, o: seen.append(len(held.changed)))
    for i in range(len(data)):
        x, y = data[i]
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    assert seen == [0] * len(data)


def test_an_undo_puts_the_buffers_back_as_they_were_just_before_the_undone_steps_forward(tmp_path):
    """An undo of step k's update (found at step k+1) puts the buffers back as they were just
    before step k's first forward: what the forward between steps k-1 and k wrote stays."""
    before, after = {}, {}

    def peek(i, phase, net):
        (before if phase == "forward" else after)[i] = [b.clone() for b in net.buffers()]

    net, opt, mon = between_forwards(tmp_path, lr=(30, 1e4), peek=peek)
    (undo,) = [e.data["action_results"]["undo"] for e in mon.events if e.actions]
    assert (undo["undone_step"], undo["skipped_step"]) == (30, 31)
    assert not all(torch.equal(a, b) for a, b in zip(after[29], before[30]))  # the forward between wrote
    for a, b in zip(after[31], before[30]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("nan_at", [0, 5])
def test_a_nan_batch_at_a_component_gradient_step_is_skipped_not_a_crash(tmp_path, nan_at):
    """A probe (knowledge distillation, ``combine({"kd", "ce"})``, a BatchNorm model): a NaN batch on
    a step whose component gradients are measured (the extra backward of grad_ratio) crashed the
    user's ``loss.backward()`` ("modified by an inplace operation"): NaN running statistics never
    equal themselves, so the buffers read as changed by the extra backward and were copied back,
    which moved the version of tensors BatchNorm saved for the backward."""
    from torch.nn import functional as F

    def run(monitored, drop=()):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        opt = torch.optim.Adam(net.parameters(), 1e-3)
        cfg = {"console": False, "stats": {"grad_ratio_every": 5}}
        mon = sfmonitor.attach(net, opt, run_dir=str(tmp_path / "m"), sinks=[], config=cfg) if monitored else None
        for i in range(nan_at + 3):
            if i in drop:
                continue
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
            if i == nan_at:
                x[0, 0] = float("nan")
            out = net(x)
            a, b = F.cross_entropy(out, y), out.pow(2).mean()
            (mon.combine({"ce": a, "reg": b}, weights={"ce": 1.0, "reg": 0.1}) if mon else a + 0.1 * b).backward()
            opt.step()
            opt.zero_grad()
        events = [(e.step, e.kind, list(e.actions)) for e in mon.events] if mon else []
        if mon:
            mon.detach()
        return net, events

    net, events = run(True)
    twin, _ = run(False, drop=(nan_at,))
    assert (nan_at, "bad_batch", ["skip_step"]) in events
    for (n, a), b in zip(net.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), n


def test_a_rollback_puts_back_the_running_statistics_of_its_snapshot(tmp_path):
    """A rollback restores its snapshot whole, the BatchNorm buffers with the weights. The skip
    that comes with it then put the buffers back from the undo copy (as they were just before the
    step's forward, on the trajectory being left): weights from the snapshot, running statistics
    from steps later. So did a refuted trial's put-back, over the state it held."""
    data = batches(8)
    net, opt = make()
    seen = {}  # the running statistics just before each step's forward

    def before(i):
        seen[i] = [b.clone() for b in net.buffers()]

    def loss_fn(out, y):  # step 5's loss NaN (a NaN input would be a bad batch, skipped)
        return nn.functional.cross_entropy(out, y) * (float("nan") if len(seen) == 6 else 1.0)

    config = {
        "actions": {"rollback": {"snapshot_every": 3, "skip_batches": 0}},
        "policy": {"ladders": {"nonfinite_loss": {"rungs": [{"after": 1, "actions": ["rollback"]}]}}},
    }
    _, mon = loop(net, opt, 6, lambda i: data[i], loss_fn, run_dir=tmp_path, config=config, before=before)
    (rollback,) = [e.data["action_results"]["rollback"] for e in mon.events if e.actions]
    assert rollback["restored"] and rollback["restored_from"] == 3
    # the snapshot of step 3 holds the statistics after step 3's forward: those step 4 started from
    assert not all(torch.equal(a, b) for a, b in zip(seen[4], seen[5]))
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), seen[4]))
