"""Gradients that fade through a deep stack of like layers (a sigmoid MLP; a post-LN transformer
without warm-up): ``vanishing_gradient``, told once, no action (sfmonitor/detectors.py,
VanishingGradient). A deep net whose optimizer rescales the faded gradients into full-sized steps,
and healthy nets, say nothing."""

from __future__ import annotations

import pytest
import torch
from _state import quiet
from torch import nn

import sfmonitor
from sfmonitor.detectors import VanishingGradient, VanishingGradientConfig


def _mlp(act, depth=12, width=32, seed=0):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, width)] + [nn.Linear(width, width) for _ in range(depth - 2)] + [nn.Linear(width, 1)]
    mods: list[nn.Module] = []
    for i, layer in enumerate(layers):
        mods += [layer, act()] if i < len(layers) - 1 else [layer]
    return nn.Sequential(*mods)


def _train(tmp_path, model, opt, steps=40, config=None):
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet(**(config or {})))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = mon.combine((model(x) - torch.tanh(x @ w)).pow(2).mean())
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    return [e for e in mon.events if e.kind == "vanishing_gradient"], mon


def test_gradients_that_fade_through_a_deep_sigmoid_stack_are_told_once_without_action(tmp_path):
    model = _mlp(nn.Sigmoid)
    events, mon = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    assert len(events) == 1
    e = events[0]
    assert e.actions == [] and e.step <= 25
    assert e.data["stack"] == [str(i) for i in range(2, 2 * 11, 2)]  # the hidden 32x32 layers
    assert e.data["first"] == "2" and e.data["last"] == "20"
    assert e.data["ratio"] < 1e-4 and e.data["update_ratio"] < 0.2
    assert "vanishing gradients" in e.message
    assert not [x for x in mon.events if x.actions]  # nothing changed training


def test_faded_gradients_that_adam_turns_into_full_steps_are_not_told(tmp_path):
    """ReLU at PyTorch's default init fades the gradients through 12 layers, but Adam rescales them:
    the first layers move as much as the last, the run trains."""
    model = _mlp(nn.ReLU)
    assert _train(tmp_path, model, torch.optim.Adam(model.parameters(), lr=1e-3))[0] == []
    model = _mlp(nn.ReLU)
    sgd, _ = _train(tmp_path / "sgd", model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    assert len(sgd) == 1  # under SGD the same gradients leave the first layers behind


@pytest.mark.parametrize("case", ["xavier_tanh", "layerwise_lr_decay", "frozen_first_layers"])
def test_healthy_deep_stacks_say_nothing(tmp_path, case):
    model = _mlp(nn.Tanh)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for m in linears:
        nn.init.xavier_uniform_(m.weight, gain=5 / 3)
    params: list = list(model.parameters())
    if case == "layerwise_lr_decay":  # the first layers' LR 0.6^10 of the last's: small updates, healthy gradients
        params = [{"params": m.parameters(), "lr": 0.05 * 0.6 ** (len(linears) - 1 - i)} for i, m in enumerate(linears)]
    if case == "frozen_first_layers":
        for m in linears[:4]:
            m.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
    assert _train(tmp_path, model, torch.optim.SGD(params, lr=0.05, momentum=0.9), steps=50)[0] == []


def test_stacks_are_runs_of_like_groups_in_model_order():
    det = VanishingGradient(VanishingGradientConfig(min_layers=3))
    a, b = [(8, 8)], [(8, 8), (8,)]
    det.layout({"emb": [(10, 8)], "h0": b, "h1": b, "h2": b, "x": a, "y": b, "z": b, "head": a, "p": a, "q": a, "r": a})
    assert det.stacks == [["h0", "h1", "h2"], ["head", "p", "q", "r"]]
    det.layout({"a": b, "b": b})  # two like groups are no stack
    assert det.stacks == []


def test_the_judgement_survives_a_state_dict_round_trip():
    cfg = VanishingGradientConfig(window=3, start=0)
    det = VanishingGradient(cfg)
    det.layout({g: [(4, 4)] for g in ("a", "b", "c")})
    faded = {"grad_norm/a": 1e-6, "grad_norm/b": 1e-3, "grad_norm/c": 1.0}
    assert det.check(0, faded) == [] and det.check(1, faded) == []
    again = VanishingGradient(cfg)
    again.layout({g: [(4, 4)] for g in ("a", "b", "c")})
    again.load_state_dict(det.state_dict())
    assert [f.kind for f in again.check(2, faded)] == ["vanishing_gradient"]
    assert again.check(3, faded) == []  # told once
    healthy = {"grad_norm/a": 0.5, "grad_norm/b": 0.7, "grad_norm/c": 1.0}
    for s in range(4, 7):
        again.check(s, healthy)
    assert [f.kind for f in (again.check(7, faded) + again.check(8, faded) + again.check(9, faded))] == [
        "vanishing_gradient"
    ]


def test_like_siblings_that_do_not_chain_are_no_stack(tmp_path):
    """Three task heads side by side (each 32 -> 5) have the same shapes but are no depth: a head
    whose loss weight is small has small gradients by design. They were taken for a stack and told
    as vanishing gradients under SGD. A stack's groups must hold a weight that maps a width onto
    itself, as blocks and hidden layers do."""
    det = VanishingGradient(VanishingGradientConfig(min_layers=3))
    det.layout({"trunk": [(32, 8), (32,)], "a": [(5, 32), (5,)], "b": [(5, 32), (5,)], "c": [(5, 32), (5,)]})
    assert det.stacks == []
    conv = [(16, 16, 3, 3), (16,), (16,), (16, 16, 3, 3), (16,), (16,)]  # a residual block's convs and norms
    det.layout({"b0": conv, "b1": conv, "b2": conv})
    assert det.stacks == [["b0", "b1", "b2"]]

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(8, 32)
            self.head_a, self.head_b, self.head_c = nn.Linear(32, 5), nn.Linear(32, 5), nn.Linear(32, 5)

    torch.manual_seed(0)
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(32, 8, generator=g)
        h = torch.tanh(model.trunk(x))
        y = x[:, :5].argmax(1)
        ce = nn.functional.cross_entropy
        loss = mon.combine(1e-3 * ce(model.head_a(h), y) + ce(model.head_b(h), y) + ce(model.head_c(h), y))
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    assert [e.kind for e in mon.events if e.kind == "vanishing_gradient"] == []


def test_detectors_get_the_groups_again_when_the_optimizer_gains_parameters(tmp_path):
    """layout() at attach and after add_param_group (a parameter outside the model joins group
    "other"), so a detector's view of the groups follows the monitor's."""

    class Spy(sfmonitor.Detector):
        name, kind = "spy", "spy_told"

        def __init__(self):
            self.seen: list[list[str]] = []

        def layout(self, groups):
            self.seen.append(list(groups))

    model = _mlp(nn.Tanh, depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    spy = Spy()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet(), detectors=[spy])
    assert spy.seen == [["0", "2", "4", "6"]]
    temperature = nn.Parameter(torch.ones(()))
    opt.add_param_group({"params": [temperature]})
    x = torch.randn(4, 8)
    mon.combine((model(x) * temperature).pow(2).mean()).backward()
    opt.step()
    mon.detach()
    assert spy.seen[-1] == ["0", "2", "4", "6", "other"]
