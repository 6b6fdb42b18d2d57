"""Core monitor promises: bit-identical skips, statistics, groups, accumulation, detach, strict."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from _state import assert_identical, snapshot
from torch import nn

import sfmonitor
from sfmonitor import stats as S
from sfmonitor.sinks import MemorySink
from sfmonitor.sinks.jsonl import read_jsonl


class Tiny(nn.Module):
    """Two 'modalities' and a fusion layer; a root-level parameter goes to 'other'."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.text = nn.Linear(5, 8)
        self.fusion = nn.Linear(16, 3)
        self.temp = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, t, y):
        hv, ht = self.vision(x), self.text(t)
        logits = self.fusion(torch.cat([hv, ht], -1)) * self.temp
        return {"vision": hv.pow(2).mean(), "text": ht.abs().mean(), "fusion": nn.functional.cross_entropy(logits, y)}


WEIGHTS = {"vision": 0.4, "text": 0.3, "fusion": 0.3}


def batch(n=4, nan=False):
    x, t, y = torch.randn(n, 6), torch.randn(n, 5), torch.randint(0, 3, (n,))
    if nan:
        x[0, 0] = float("nan")
    return x, t, y


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
}


def train_step(model, opt, mon, b, scaler=None, nan_loss=False):
    x, t, y = b
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
        losses = model(x, t, y)
    if nan_loss:  # a non-finite loss whose gradients are finite: only the monitor can catch it
        losses["fusion"] = losses["fusion"] + torch.tensor(float("nan"))
    loss = mon.combine(losses, weights=WEIGHTS) if mon else sum(WEIGHTS[k] * v for k, v in losses.items())
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16+scaler"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("how", ["nan_input", "nan_loss_only"])
def test_nonfinite_step_is_skipped_bit_identically(opt_name, amp, how, tmp_path):
    model = Tiny()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = torch.amp.GradScaler("cpu") if amp else None
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=tmp_path, sinks=[MemorySink()], config={"console": False})
    for _ in range(3):
        train_step(model, opt, mon, batch(), scaler)
    before = snapshot(model, opt)
    scale_before = scaler.get_scale() if scaler else None
    train_step(model, opt, mon, batch(nan=how == "nan_input"), scaler, nan_loss=how == "nan_loss_only")
    assert_identical(before, snapshot(model, opt))
    ev = [e for e in mon.events if e.step == 3]
    assert mon.step == 4
    if how == "nan_input":
        # The NaN came with the data: one bad_batch event; the loss and gradients are its symptoms.
        assert [e.kind for e in ev] == ["bad_batch"] and ev[0].actions == ["skip_step"]
        assert ev[0].data["nonfinite_grad"]["count"] == 7  # NaN spread to every gradient
        assert ev[0].data["nonfinite_inputs"] == 1
    else:
        assert ev and ev[0].kind == "nonfinite_loss" and "skip_step" in ev[0].actions
    # training goes on normally afterwards
    train_step(model, opt, mon, batch(), scaler)
    after = snapshot(model, opt)
    assert not torch.equal(after[0]["fusion.weight"], before[0]["fusion.weight"])
    if scaler and how == "nan_loss_only":
        assert scaler.get_scale() >= scale_before  # the scaler saw finite grads and did not halve
    mon.detach()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16+scaler"])
def test_event_names_the_first_offending_parameter_and_its_group(amp, tmp_path):
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # a small scale: the scaled fp16 backward must not overflow on its own here
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if amp else None
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=tmp_path, sinks=[], config={"console": False})
    h = model.fusion.weight.register_hook(lambda g: g * float("nan"))
    before = snapshot(model, opt)
    train_step(model, opt, mon, batch(), scaler)
    h.remove()
    (ev,) = [e for e in mon.events if e.kind != "loss_scale_floor"]  # init_scale 1 is under the floor
    assert ev.kind == "nonfinite_grad" and ev.step == 0
    assert ev.data["param"] == "fusion.weight" and ev.data["group"] == "fusion" and ev.data["count"] == 1
    assert "fusion.weight" in ev.message
    if amp:  # the scaler skips it on its own; the monitor records it without acting
        assert ev.data["skipped_by"] == "grad_scaler" and ev.actions == []
    else:
        assert ev.actions == ["skip_step"]
    assert_identical(before, snapshot(model, opt))
    mon.detach()


def slow_reference(model, groups):
    out = {}
    total = 0.0
    for g, names in groups.items():
        sq = sum(float(p.grad.double().norm()) ** 2 for n, p in model.named_parameters() if n in names)
        out[f"grad_norm/{g}"] = math.sqrt(sq)
        total += sq
        out[f"param_norm/{g}"] = math.sqrt(
            sum(float(p.detach().double().norm()) ** 2 for n, p in model.named_parameters() if n in names)
        )
    out["grad_norm/total"] = math.sqrt(total)
    return out


def test_every_statistic_key_is_present_and_right(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    x, t, y = batch()
    losses = model(x, t, y)
    # slow reference: per-component gradients on parameters both components reach
    params = [p for p in model.parameters()]
    gv = torch.autograd.grad(losses["vision"], params, retain_graph=True, allow_unused=True)
    gf = torch.autograd.grad(losses["fusion"], params, retain_graph=True, allow_unused=True)
    shared = [(a, b) for a, b in zip(gv, gf) if a is not None and b is not None]
    na = math.sqrt(sum(float(a.norm()) ** 2 for a, _ in shared))
    nb = math.sqrt(sum(float(b.norm()) ** 2 for _, b in shared))
    cos = sum(float((a * b).sum()) for a, b in shared) / (na * nb)
    loss = mon.combine(losses, weights=WEIGHTS)
    loss.backward()
    groups = {g: [n for n, _ in ps] for g, ps in mon.groups.items()}
    ref = slow_reference(model, groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    st = mon.stats
    assert set(groups) == {"vision", "text", "fusion", "other"}
    for k, v in ref.items():
        assert st[k] == pytest.approx(v, rel=1e-5), k
    for g, names in groups.items():
        num = math.sqrt(
            sum(float((dict(model.named_parameters())[n].detach() - before[n]).double().norm()) ** 2 for n in names)
        )
        den = math.sqrt(sum(float(before[n].double().norm()) ** 2 for n in names))
        assert st[f"update_ratio/{g}"] == pytest.approx(num / den, rel=1e-4)
    assert st["loss/total"] == pytest.approx(float(loss.detach()), rel=1e-6)
    for c in WEIGHTS:
        assert st[f"loss/{c}"] == pytest.approx(float(losses[c].detach()), rel=1e-6)
        assert st[f"loss_weight/{c}"] == WEIGHTS[c]
    assert st["loss_ratio/vision/fusion"] == pytest.approx(
        (float(losses["vision"].detach()) + 1e-6) / (float(losses["fusion"].detach()) + 1e-6), rel=1e-5
    )
    assert {"loss_ratio/vision/text", "loss_ratio/text/fusion"} <= set(st)
    assert st["grad_ratio/vision/fusion"] == pytest.approx((na + 1e-6) / (nb + 1e-6), rel=1e-4)
    assert st["grad_cos/vision/fusion"] == pytest.approx(cos, rel=1e-4, abs=1e-6)
    assert st["lr/0"] == 0.1
    mon.detach()


def test_amp_stats_and_scaler_skips_are_counted(tmp_path):
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    sink = MemorySink()
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=tmp_path, sinks=[sink], config={"console": False})
    train_step(model, opt, mon, batch(), scaler)
    assert mon.stats["amp/loss_scale"] == 1.0
    # An overflowing gradient while the loss is finite: dynamic loss scaling's own business.
    h = model.text.weight.register_hook(lambda g: g * float("inf"))
    train_step(model, opt, mon, batch(), scaler)
    h.remove()
    train_step(model, opt, mon, batch(), scaler)
    st = mon.stats
    assert st["amp/skipped_steps"] == 1.0
    (ev,) = [e for e in mon.events if e.kind != "loss_scale_floor"]  # init_scale 1 is under the floor
    assert ev.step == 1 and ev.kind == "nonfinite_grad" and ev.data["skipped_by"] == "grad_scaler"
    assert ev.actions == []  # the monitor did nothing: no action recorded
    assert st["amp/loss_scale"] == 0.5
    assert mon.step == 3
    mon.detach()


def test_gradient_accumulation_records_the_mean(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = MemorySink()
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[sink], config={"console": False})
    vals = []
    for _ in range(4):
        losses = model(*batch())
        loss = mon.combine(losses, weights=WEIGHTS)
        (loss / 4).backward()
        vals.append({k: float(v.detach()) for k, v in losses.items()} | {"total": float(loss.detach())})
    opt.step()
    opt.zero_grad()
    st = mon.stats
    assert mon.step == 1
    assert st["loss/total"] == pytest.approx(sum(v["total"] for v in vals) / 4, rel=1e-6)
    assert st["loss/text"] == pytest.approx(sum(v["text"] for v in vals) / 4, rel=1e-6)
    assert len(sink.metrics) == 1 and sink.metrics[0][0] == 0
    mon.detach()


def test_explicit_groups_module_params_prefix_and_other():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.Monitor(sinks=[], config={"console": False}).attach(
        model, opt, groups={"img": model.vision, "txt": list(model.text.parameters()), "fus": "fusion"}
    )
    assert {g: [n for n, _ in ps] for g, ps in mon.groups.items()} == {
        "img": ["vision.0.weight", "vision.0.bias"],
        "txt": ["text.weight", "text.bias"],
        "fus": ["fusion.weight", "fusion.bias"],
        "other": ["temp"],
    }
    mon.detach()
    with pytest.raises(sfmonitor.ConfigError, match="text.weight.*two groups"):
        sfmonitor.attach(model, opt, groups={"a": model.text, "b": [model.text.weight]}, sinks=[])
    with pytest.raises(sfmonitor.ConfigError, match="prefix 'nope'"):
        sfmonitor.attach(model, opt, groups={"a": "nope"}, sinks=[])
    with pytest.raises(sfmonitor.ConfigError, match="not in the model"):
        sfmonitor.attach(model, opt, groups={"a": [nn.Parameter(torch.zeros(1))]}, sinks=[])


def test_tied_weight_belongs_to_first_listed_module():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Embedding(5, 4)
            self.dec = nn.Linear(4, 5, bias=False)
            self.dec.weight = self.enc.weight

    m = Tied()
    mon = sfmonitor.attach(m, torch.optim.SGD(m.parameters(), lr=1), sinks=[], config={"console": False})
    assert {g: [n for n, _ in ps] for g, ps in mon.groups.items()} == {"enc": ["enc.weight"]}
    mon.detach()


def test_detach_leaves_training_as_if_never_attached(tmp_path):
    torch.manual_seed(1)
    data = [batch() for _ in range(5)]

    def run(attach_first):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        if attach_first:
            mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=tmp_path, sinks=[], config={"console": False})
            train_step(model, opt, mon, data[0], scaler)
            mon.detach()
            assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
            assert "step" not in scaler.__dict__ and "update" not in scaler.__dict__
        else:
            train_step(model, opt, None, data[0], scaler)
        for b in data[1:]:
            train_step(model, opt, None, b, scaler)
        return snapshot(model, opt)

    assert_identical(run(True), run(False))


def test_strict_mode_raises_with_the_facts(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"strict": True, "console": False})
    train_step(model, opt, mon, batch())
    with pytest.raises(sfmonitor.NonFiniteError, match="step 1") as ei:
        train_step(model, opt, mon, batch(nan=True))
    assert ei.value.event.kind == "bad_batch"  # the NaN came with the input
    mon.detach()


def test_single_loss_tensor_and_event_step_is_zero_based(tmp_path):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    x = torch.tensor([[float("nan"), 1.0, 2.0]])
    loss = mon.combine(model(x).sum())
    loss.backward()
    opt.step()
    assert mon.events[0].step == 0 and mon.step == 1
    assert mon.stats["loss/total"] != mon.stats["loss/total"]  # NaN recorded as it was
    mon.detach()


def test_one_host_read_per_step(tmp_path, monkeypatch):
    import sfmonitor.monitor as M

    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    calls = []
    real = M.S.read_all
    monkeypatch.setattr(M.S, "read_all", lambda named, **kw: calls.append(len(named)) or real(named, **kw))

    real_item, real_tolist = torch.Tensor.item, torch.Tensor.tolist
    from_monitor = []

    def spy(real):
        def wrapper(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if os.sep + "sfmonitor" + os.sep in caller:
                from_monitor.append(caller)
            return real(self, *a, **k)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "item", spy(real_item))
    monkeypatch.setattr(torch.Tensor, "tolist", spy(real_tolist))
    for _ in range(5):
        loss = mon.combine(model(*batch()), weights=WEIGHTS)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == 5  # one read per step; update ratios ride along with the next read
    assert from_monitor == [S.__file__] * 5  # ...and it is the only place values leave the device
    mon.detach()


def test_failing_sink_warns_once_and_training_goes_on(tmp_path):
    class Broken(MemorySink):
        def log_metrics(self, step, metrics):
            raise OSError("disk full")

    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = MemorySink()
    with pytest.warns(RuntimeWarning, match="disk full") as rec:
        with sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[Broken(), good], config={"console": False}) as mon:
            for _ in range(4):
                train_step(model, opt, mon, batch())
    assert len([w for w in rec if "sfmonitor" in str(w.message)]) == 1
    assert len(good.metrics) == 4 and mon.step == 4


def test_state_dict_round_trip(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    for _ in range(3):
        train_step(model, opt, mon, batch())
    sd = mon.state_dict()
    json.dumps(sd)  # plain data
    other = sfmonitor.Monitor(sinks=[], config={"console": False})
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    mon.detach()


def test_import_does_not_pull_optional_backends():
    code = (
        "import sys, sfmonitor; print([m for m in ('wandb', 'tensorboard', 'matplotlib', 'lightning', "
        "'transformers', 'accelerate') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_jsonl_is_readable_after_the_process_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import torch, sfmonitor, sys
        torch.set_num_threads(1)
        m = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        mon = sfmonitor.attach(m, opt, run_dir={str(tmp_path)!r}, config={{"console": False}})
        i = 0
        while True:
            x = torch.randn(3, 4)
            if i % 7 == 3: x[0, 0] = float("nan")
            loss = mon.combine({{"a": m(x).pow(2).mean(), "b": m(x).abs().mean()}})
            loss.backward(); opt.step(); opt.zero_grad(); i += 1
            if i == 20: print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    metrics = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    events = read_jsonl(os.path.join(tmp_path, "events.jsonl"))
    assert len(metrics) >= 20 and [r["step"] for r in metrics] == list(range(len(metrics)))
    nonfinite = [e for e in events if e["kind"] == "bad_batch"]  # NaN inputs
    assert [e["step"] for e in nonfinite[:3]] == [3, 10, 17]
    assert nonfinite[0]["actions"] == ["skip_step"] and nonfinite[0]["data"]["nonfinite_loss"]["loss"] == "nan"
    # every complete line is valid JSON; at most the last one is cut
    lines = open(os.path.join(tmp_path, "metrics.jsonl")).read().split("\n")
    bad = [ln for ln in lines[:-1] if ln and not json.loads(ln)]
    assert not bad


def test_closure_optimizers_are_driven_externally(tmp_path):
    """optimizer.step(closure) (Lightning): gradients exist only inside the closure, so the
    integration calls before_update() where they are ready; a NaN step is still skipped."""
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False}).drive_externally()

    def run(b):
        def closure():
            opt.zero_grad()
            loss = mon.combine(model(*b), weights=WEIGHTS)
            loss.backward()
            mon.before_update()  # what the integration's on_before_optimizer_step does
            return loss

        opt.step(closure)
        mon.after_update()  # no-op: the post-hook finished the step

    run(batch())
    before = snapshot(model, opt)
    run(batch(nan=True))
    assert_identical(before, snapshot(model, opt))
    assert mon.step == 2 and [e.step for e in mon.events if e.kind == "bad_batch"] == [1]
    assert mon.stats["grad_norm/total"] != mon.stats["grad_norm/total"]
    mon.detach()


def test_loss_scale_floor_is_a_standing_setting(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2048.0)
    mon = sfmonitor.attach(
        model,
        opt,
        scaler=scaler,
        run_dir=tmp_path,
        sinks=[],
        config={"console": False, "actions": {"loss_scale": {"enforce_floor": True, "min_loss_scale": 512.0}}},
    )
    h = model.text.weight.register_hook(lambda g: g * float("inf"))  # every step overflows
    for _ in range(6):
        train_step(model, opt, mon, batch(), scaler)
        assert scaler.get_scale() >= 512.0  # 2048 -> 1024 -> 512, then held
    h.remove()
    assert mon.stats["amp/skipped_steps"] == 6
    assert all(e.actions == [] for e in mon.events)  # configured by the user: not an action
    mon.detach()


def test_bad_sink_name_fails_before_any_hook_is_registered():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sfmonitor.ConfigError, match="unknown sink 'tensorbord'"):
        sfmonitor.attach(model, opt, sinks=["tensorbord"])
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    with pytest.raises(sfmonitor.ConfigError, match=r"\['jsonl'\]"):
        sfmonitor.Monitor(sinks="jsonl")


def test_optimizer_parameters_outside_the_model_are_checked_and_skipped(tmp_path):
    model = Tiny()
    temp = nn.Parameter(torch.tensor(1.0))  # e.g. a learnable temperature held by a loss module
    opt = torch.optim.Adam(list(model.parameters()) + [temp], lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    before = (temp.detach().clone(), snapshot(model, opt))
    loss = mon.combine(model(*batch()), weights=WEIGHTS) + 0 * temp
    loss.backward()
    temp.grad = torch.tensor(float("nan"))
    opt.step()
    assert torch.equal(temp.detach(), before[0])
    assert_identical(before[1], snapshot(model, opt))
    (ev,) = mon.events
    assert ev.data["param"] == "optimizer.param_groups[0].params[7]" and ev.data["group"] == "other"
    mon.detach()


def test_strict_error_caught_the_next_step_is_still_watched(tmp_path):
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"strict": True, "console": False})
    for i in range(2):
        before = snapshot(model, opt)
        with pytest.raises(sfmonitor.NonFiniteError, match=f"step {i}"):
            train_step(model, opt, mon, batch(nan=True))
        assert_identical(before, snapshot(model, opt))
        opt.zero_grad()
    assert mon.step == 2
    mon.detach()


def test_fp16_parameters_with_large_finite_gradients_are_not_called_non_finite(tmp_path):
    model = nn.Linear(4, 4).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    mon = sfmonitor.attach(model, opt, run_dir=tmp_path, sinks=[], config={"console": False})
    for p in model.parameters():
        p.grad = torch.full_like(p, 60000.0)  # every value finite; the norm is > 65504
    opt.step()
    assert mon.events == []
    assert mon.stats["grad_norm/total"] == pytest.approx(60000.0 * math.sqrt(20), rel=1e-3)
    mon.detach()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_scaler_skips_are_counted_also_inside_fused_optimizers(fused, tmp_path):
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=tmp_path, sinks=[], config={"console": False})
    train_step(model, opt, mon, batch(), scaler)
    before = snapshot(model, opt)
    h = model.text.weight.register_hook(lambda g: g * float("inf"))
    train_step(model, opt, mon, batch(), scaler)
    h.remove()
    assert_identical(before, snapshot(model, opt))
    assert mon.stats["amp/skipped_steps"] == 1.0 and mon.stats["update_ratio/text"] == 0.0
    train_step(model, opt, mon, batch(), scaler)
    assert mon.stats["amp/skipped_steps"] == 1.0  # the running total agrees with the records
    mon.detach()
