"""Gradients that fade through a deep stack of like layers (a sigmoid MLP; a post-LN transformer
without warm-up): ``vanishing_gradient``, told once, no action (sfmonitor/detectors.py,
VanishingGradient). A deep net whose optimizer rescales the faded gradients into full-sized steps,
and healthy nets, say nothing."""

from __future__ import annotations

import json
import math

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


# -- the restart: a fade early in a run whose LR never rose, its loss stalled ------------------


def _restart_stats(loss: float, lr: float = 1e-3, faded: bool = True, update: float = 0.1) -> dict[str, float]:
    norms = {"a": 1e-6, "b": 1e-3, "c": 1.0} if faded else {"a": 0.5, "b": 0.7, "c": 1.0}
    stats = {f"grad_norm/{g}": v for g, v in norms.items()}
    stats.update({f"update_ratio/{g}": update * share for g, share in zip(norms, (0.05, 0.5, 1.0))})
    stats.update({f"update_lr/{g}": lr for g in norms})
    stats.update({"loss/total": loss, "update_lr_scale": 1.0})
    return stats


def _stalled_run(det: VanishingGradient, steps: int, lr=lambda s: 1e-3, update: float = 0.1) -> list:
    """A loss that falls from 4 to 3 in its first 10 steps, then stays there."""
    out = []
    for s in range(steps):
        loss = 4.0 - 0.1 * min(s, 10) + (0.001 if s % 2 else 0.0)
        out += det.check(s, _restart_stats(loss, lr(s), update=update))
    return out


def _det(**cfg) -> VanishingGradient:
    det = VanishingGradient(VanishingGradientConfig(window=5, start=0, **cfg))
    det.layout({g: [(4, 4)] for g in ("a", "b", "c")})
    return det


def test_a_fade_in_a_stalled_run_whose_lr_never_rose_asks_for_a_restart_from_its_start():
    findings = _stalled_run(_det(), 40)
    assert [f.told for f in findings] == [True, False]  # told at once; the restart once the loss stalls
    told, restart = findings
    assert told.step is None and "restart" not in told.data
    d = restart.data
    assert d["trial"] and d["restart"] and d["first_update"] and d["restart_from"] == 0
    assert d["judge_after"] == d["step"] and d["step"] < 20  # as many steps as the run made
    assert d["median"] == pytest.approx(3.0, rel=1e-2) and d["start_loss"] == pytest.approx(4.0)
    # the bar: a tenth of the progress (in logs) under the stall's median
    assert math.log(d["median"]) - math.log(d["bar_median"]) == pytest.approx(0.1 * math.log(4.0 / d["median"]))
    assert "a trial: back to the run's start" in restart.message.lower()


@pytest.mark.parametrize(
    "why",
    ["warm_up", "lr_lowered_by_the_monitor", "too_late", "small_first_updates", "off", "loss_still_falling"],
)
def test_no_restart_where_a_warm_up_cannot_be_what_the_run_lacks(why):
    det = _det(restart_within=0 if why == "off" else 150)
    lr = (lambda s: 1e-3 * min(1.0, (s + 1) / 10)) if why == "warm_up" else (lambda s: 1e-3)
    if why == "lr_lowered_by_the_monitor":
        det.check(0, {**_restart_stats(4.0), "update_lr_scale": 0.05})
    if why == "too_late":
        for s in range(200):  # a healthy start, then the fade
            det.check(s, _restart_stats(1.0, faded=False))
        findings = [f for s in range(200, 240) for f in det.check(s, _restart_stats(1.0))]
    elif why == "loss_still_falling":
        findings = [f for s in range(40) for f in det.check(s, _restart_stats(4.0 * 0.97**s))]
    else:
        findings = _stalled_run(det, 40, lr, update=0.001 if why == "small_first_updates" else 0.1)
    assert len(findings) == 1 and findings[0].told  # the fade is told, nothing else


def test_the_restart_is_asked_for_once_and_survives_a_state_dict_round_trip():
    det = _det()
    for s in range(8):
        det.check(s, _restart_stats(4.0 - 0.1 * min(s, 10)))
    again = _det()
    again.load_state_dict(det.state_dict())
    assert again.first_step == 0 and again.first_update == 0.1 and not again.lr_rose
    findings = [f for s in range(8, 60) for f in again.check(s, _restart_stats(3.0))]
    assert [f.told for f in findings] == [False]  # (stalled when first seen: one finding, the restart)
    more = _det()
    more.load_state_dict(again.state_dict())
    assert more.restarted
    for s in range(60, 70):
        more.check(s, _restart_stats(3.0, faded=False))  # the gradients come back: told again later
    assert all(f.told for s in range(70, 90) for f in more.check(s, _restart_stats(3.0)))


def test_a_restart_that_does_not_bear_out_puts_the_stalled_state_and_the_lr_back(tmp_path):
    """A deep sigmoid MLP under SGD fades whatever its LR: restarted with a warm-up (forced here:
    its first updates are too small for the default to try), its loss is no better after as many
    steps, and the state the trial left and the LR are put back; the rescue is given back."""
    model = _mlp(nn.Sigmoid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cfg = quiet(detectors={"vanishing_gradient": {"restart_update": 0.0}})
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=cfg)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    before: dict[int, list[torch.Tensor]] = {}
    checked = 0
    for _ in range(140):
        x = torch.randn(32, 8, generator=g)
        loss = mon.combine((model(x) - torch.tanh(x @ w)).pow(2).mean())
        loss.backward()
        before[mon.step] = [p.detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        after = [p.detach().clone() for p in model.parameters()]
        put_back = [e for e in mon.events if e.data.get("trial_refuted") and e.step == mon.step - 1]
        if put_back:
            held_at = put_back[0].data["action_results"]["rollback"]["restored_from"]
            assert all(torch.equal(a, b) for a, b in zip(after, before[held_at]))  # the stalled state, bit for bit
            checked += 1
    mon.detach()
    assert checked == 1
    ev = mon.events
    restart = next(e for e in ev if e.data.get("restart") and "rollback" in e.actions)
    verdict = next(e for e in ev if e.data.get("trial_from_step") == restart.step)
    assert not verdict.data["followed"] and verdict.actions == ["rollback", "lr_drop"]
    assert verdict.data["action_results"]["rollback"]["restored_from"] == restart.step
    assert verdict.data["action_results"]["lr_drop"]["new_scale"] == 1.0 and verdict.data["budget_returned"] == 1
    assert verdict.step - restart.step == min(max(70, restart.data["judge_after"]), 99)  # (the warm-up back at 0.4x)
    assert "did not bear out" in verdict.message
    assert any(e.kind == "new_regime" and e.step == verdict.step + 1 for e in ev)
    assert opt.param_groups[0]["lr"] == 0.01


# -- stacks of like blocks inside one group ----------------------------------------------------


class _Inside(nn.Module):
    """A deep sigmoid MLP whose hidden layers sit in one ModuleList beside an input and an output
    layer: three top-level children, three groups; the stack is inside ``body``."""

    def __init__(self, depth: int = 10, width: int = 32):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.body = nn.ModuleList([nn.Sequential(nn.Sigmoid(), nn.Linear(width, width)) for _ in range(depth)])
        self.out = nn.Sequential(nn.Sigmoid(), nn.Linear(width, 1))

    def forward(self, x):
        h = self.inp(x)
        for block in self.body:
            h = block(h)
        return self.out(h)


def test_like_blocks_inside_one_group_are_a_stack_of_their_own(tmp_path):
    """HF BERT, ViT, minGPT and most hand-written transformers keep their blocks in a ModuleList
    inside one top-level child, beside the embeddings and the head: one group for the whole
    stack. Its blocks are measured (block_grad_norm/<b>, block_update_ratio/<b>) and judged."""
    torch.manual_seed(0)
    model = _Inside()
    events, mon = _train(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    assert len(events) == 1 and events[0].actions == []  # told: SGD's first updates are small
    e = events[0]
    assert e.data["stack"] == [f"body.{i}" for i in range(10)] and "like blocks body.0..body.9" in e.message
    assert e.data["ratio"] < 1e-3 and e.data["update_ratio"] < 0.2
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert {"grad_norm/inp", "grad_norm/body", "grad_norm/out"} <= set(first)  # three groups
    assert {"block_grad_norm/body.0", "block_update_ratio/body.9"} <= set(first)


def test_blocks_are_found_where_a_list_of_like_children_sits_in_one_group():
    from sfmonitor.monitor import like_blocks, resolve_groups

    def found(model):
        groups = resolve_groups(model)
        return like_blocks(model, {n: g for g, ps in groups.items() for n, _ in ps})

    blocks = found(_Inside())
    assert list(blocks) == [f"body.{i}" for i in range(10)] and blocks["body.3"] == ["body.3.1.weight", "body.3.1.bias"]
    # a single trunk's blocks are groups of their own already: no blocks inside them
    trunk = nn.Sequential()
    trunk.add_module(
        "tr", nn.ModuleDict({"h": nn.ModuleList([nn.Linear(4, 4) for _ in range(4)]), "head": nn.Linear(4, 2)})
    )
    assert found(trunk) == {}
    # unlike children (an MLP's Linear, ReLU, Linear, ...), or too few, are no stack
    assert found(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == {}
    two = nn.Module()
    two.a, two.body = nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert found(two) == {}
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32
    )
    bert = transformers.BertForSequenceClassification(cfg)
    assert list(found(bert)) == [f"bert.encoder.layer.{i}" for i in range(3)]


def test_the_detector_takes_the_runs_of_like_blocks_within_each_list():
    """T5's first block holds the relative position bias, the others do not: the stack is the
    others. Two towers of like blocks are two stacks, not one across them."""
    det = VanishingGradient(VanishingGradientConfig())
    det.layout({"enc": [(8, 8)]})
    like, first = [(8, 8), (8,)], [(8, 8), (8,), (32, 4)]
    t5 = {"encoder.block.0": first, **{f"encoder.block.{i}": like for i in range(1, 4)}}
    assert det.blocks(t5) == ["encoder.block.1", "encoder.block.2", "encoder.block.3"]
    towers = {f"{t}.layers.{i}": like for t in ("a", "b") for i in range(3)}
    assert det.blocks(towers) == list(towers) and det.block_stacks == [list(towers)[:3], list(towers)[3:]]
    assert det.blocks({f"body.{i}": [(8, 4)] for i in range(4)}) == []  # no width onto itself: no depth


def test_a_fade_that_comes_with_a_collapse_of_a_trained_loss_rolls_back_to_before_the_rise():
    """A run that trained (4 -> 2.6), then collapsed (2.6 -> 3.2) as its first blocks' gradients
    faded, too late for a restart from its start: a trial as loss_divergence's, back to the newest
    snapshot from before the rise with the LR dropped (post-LN at high LRs, 225-360 steps in)."""
    det = _det()
    findings = []
    for s in range(200):
        loss = 4.0 - 1.4 * min(s, 40) / 40 if s < 170 else 2.6 + 0.6 * min(s - 170, 10) / 10
        findings += det.check(s, _restart_stats(loss + (0.001 if s % 2 else 0.0), faded=s >= 172))
    assert [f.told for f in findings] == [True, False]  # the fade at once; the trial once the loss rose
    f = findings[1]
    d = f.data
    assert d["collapse"] and d["trial"] and "restart" not in d
    assert not f.before_update and f.step == d["rise_from"] and 165 <= f.step <= 170  # before the rise
    assert d["began_median"] == pytest.approx(2.6, rel=1e-2) and d["median"] / d["began_median"] > 1.1
    assert "collapsed" in f.message
    # once per run: a second collapse is told
    again = [g for s in range(200, 300) for g in det.check(s, _restart_stats(2.5 if s < 260 else 3.5, faded=s >= 262))]
    assert all(g.told for g in again)


def test_a_loss_that_did_not_rise_is_no_collapse():
    det = _det()
    findings = []
    for s in range(200):
        loss = 4.0 - 1.4 * min(s, 40) / 40
        findings += det.check(s, _restart_stats(loss + (0.001 if s % 2 else 0.0), faded=s >= 172))
    assert len(findings) == 1 and findings[0].told


def test_a_restart_refuted_after_a_resume_says_that_only_the_lr_is_given_back(tmp_path):
    """The stalled state a restart holds is not in the monitor's state_dict (a full copy of the
    model and optimizer): resumed between the restart and its verdict, a refuted trial gives the
    LR back alone, and its message must say so (it said the stalled state was put back)."""

    def build():
        model = _mlp(nn.Sigmoid)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    xs = [torch.randn(32, 8, generator=g) for _ in range(140)]
    cfg = quiet(detectors={"vanishing_gradient": {"restart_update": 0.0}})

    def train(mon, model, opt, batches):
        for x in mon.batches(batches):
            mon.combine((model(x) - torch.tanh(x @ w)).pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "a"), config=cfg)
    train(mon, model, opt, xs[:60])
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "mon": mon.state_dict()}
    mon.detach()
    assert any(e.data.get("restart") and "rollback" in e.actions for e in mon.events)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "b"), config=cfg)
    mon.load_state_dict(saved["mon"])
    train(mon, model, opt, xs[60:])
    mon.detach()
    verdict = next(e for e in mon.events if e.data.get("trial_refuted"))
    assert verdict.actions == ["lr_drop"] and not verdict.data["state_held"]
    assert "the LR is given back" in verdict.message and "stalled state" not in verdict.message
    assert opt.param_groups[0]["lr"] == 0.01


def test_a_collapse_trial_that_does_not_bear_out_is_not_blamed_on_the_data():
    """loss_divergence's refuted trial says that what grows the loss is outside the state and the
    LR (a loss weight, targets, data); a collapse's trial is vanishing_gradient's, whose loss rose
    as a stack's gradients faded: its verdict says what was put back, without that claim."""
    from sfmonitor.actions import LRDropConfig, trial_message

    facts = {
        "loss_median_before": 3.2,
        "loss_median_trial": 3.1,
        "loss_median_bar": 2.9,
        "trial_from_step": 230,
        "state_held": True,
        "followed": False,
        "collapse": True,
    }
    message = trial_message(facts, LRDropConfig())
    assert "before the collapse" in message and "the state the trial left and the LR are put back" in message
    assert "outside the state" not in message
    growth = trial_message({**facts, "collapse": False}, LRDropConfig())
    assert "outside the state and the LR" in growth
