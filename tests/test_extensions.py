"""Extension points: a user's own detector and action run through the policy, from the example in
docs/design.md; detector config sections and state are keyed by detector name."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

import sfmonitor
from sfmonitor.detectors import build_detectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def design_example() -> str:
    text = open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = [b for b in blocks if "register_action" in b and "Monitor(detectors=" in b]
    assert len(example) == 1, "docs/design.md holds one worked example of a detector and an action"
    return example[0]


def test_the_documented_example_runs_through_the_policy(clean_registry, tmp_path):
    code = design_example()
    assert len(code.strip().splitlines()) <= 32  # short enough to read at a glance
    namespace: dict = {}
    exec(compile(code, "docs/design.md", "exec"), namespace)
    monitor = namespace["monitor"]
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.run_dir = str(tmp_path)
    monitor.attach(model, opt)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for i in range(3):
        offset = 10.0 if i == 1 else 0.0  # step 1: loss above the ceiling of 5 (same gradient)
        loss = monitor.combine(nn.functional.mse_loss(model(x), y) + offset)
        loss.backward()
        opt.step()
        opt.zero_grad()
    monitor.detach()
    ev = [e for e in monitor.events if e.kind == "loss_above_ceiling"]
    assert [e.step for e in ev] == [1] and ev[0].actions == ["halve_lr"]
    assert ev[0].data["action_results"]["halve_lr"] == {"lr": [0.05]}
    assert opt.param_groups[0]["lr"] == 0.05  # the action's change stays (it is an event)
    lines = open(tmp_path / "events.jsonl").read()
    assert "halve_lr" in lines


class Streak(sfmonitor.Detector):
    """Counts the steps it saw; fires at a configured count."""

    def __init__(self, config=None):
        self.config = config
        self.seen = 0

    def check(self, step, stats):
        self.seen += 1
        at = getattr(self.config, "at", 3)
        return [sfmonitor.Finding(self.kind, f"saw {self.seen} steps")] if self.seen == at else []

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = int(state["seen"])


def test_a_registered_detector_is_configured_under_its_own_name(clean_registry):
    from dataclasses import dataclass

    from sfmonitor.schema import Section, option

    @dataclass
    class StreakConfig(Section):
        enabled: bool = option(True, "run it")
        at: int = option(3, "fire at this many steps", lo=1)

    sfmonitor.register_detector(
        "streak",
        type("StreakDet", (Streak,), {"kind": "streak_seen"}),
        config=StreakConfig,
        kinds={"streak_seen": [(1, ["skip_step"])]},
    )
    cfg = sfmonitor.MonitorConfig.from_any({"detectors": {"streak": {"at": 2}}})
    assert cfg.detectors.streak.at == 2
    with pytest.raises(sfmonitor.ConfigError, match=r"detectors\.streak\.at"):
        sfmonitor.MonitorConfig.from_any({"detectors": {"streak": {"at": 0}}})
    with pytest.raises(sfmonitor.ConfigError, match=r"unknown config key detectors\.streek.*streak"):
        sfmonitor.MonitorConfig.from_any({"detectors": {"streek": {}}})
    assert "streak" in [d.name for d in build_detectors(cfg.detectors)]
    off = sfmonitor.MonitorConfig.from_any({"detectors": {"streak": {"enabled": False}}})
    assert "streak" not in [d.name for d in build_detectors(off.detectors)]
    # Its kind's ladder comes from the registry: a skip at the 2nd step.
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.Monitor(config={"detectors": {"streak": {"at": 2}}, "console": False})
    mon.attach(model, opt)
    before = None
    for i in range(3):
        mon.combine(model(torch.randn(4, 3)).pow(2).mean()).backward()
        if i == 1:
            before = model.weight.detach().clone()
        opt.step()
        opt.zero_grad()
        if i == 1:
            assert torch.equal(model.weight, before)  # skipped
    mon.detach()
    assert [(e.step, e.kind, e.actions) for e in mon.events] == [(1, "streak_seen", ["skip_step"])]


def test_unknown_names_in_ladders_are_config_errors(clean_registry):
    with pytest.raises(sfmonitor.ConfigError, match="unknown action 'halve_lr'"):
        sfmonitor.MonitorConfig.from_any(
            {"policy": {"ladders": {"grad_spike": {"rungs": [{"after": 1, "actions": ["halve_lr"]}]}}}}
        )
    sfmonitor.register_action("halve_lr", lambda ctx, d: {}, order=45)
    cfg = sfmonitor.MonitorConfig.from_any(
        {"policy": {"ladders": {"grad_spike": {"rungs": [{"after": 1, "actions": ["halve_lr"]}]}}}}
    )
    assert cfg.policy.ladders["grad_spike"].rungs[0].actions == ["halve_lr"]
    with pytest.raises(sfmonitor.ConfigError, match="unknown event kind 'made_up'"):
        sfmonitor.MonitorConfig.from_any({"policy": {"ladders": {"made_up": {}}}})


def test_bad_detectors_argument_is_a_clear_error():
    with pytest.raises(sfmonitor.ConfigError, match="expected a detector instance, got the class Streak"):
        sfmonitor.Monitor(detectors=[Streak])
    with pytest.raises(sfmonitor.ConfigError, match="has no name"):
        sfmonitor.Monitor(detectors=[Streak()])
    with pytest.raises(sfmonitor.ConfigError, match="lacks check"):
        sfmonitor.Monitor(detectors=[object()])
    named = type("Named", (Streak,), {"name": "loss_spike", "kind": "x_seen"})
    with pytest.raises(sfmonitor.ConfigError, match="two detectors are named 'loss_spike'"):
        sfmonitor.Monitor(detectors=[named()])


def _trained_monitor(config):
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = sfmonitor.Monitor(config={**config, "console": False})
    mon.attach(model, opt)
    for _ in range(30):
        mon.combine(model(torch.randn(8, 3)).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    return mon


def test_detector_state_loads_by_name_never_into_another_detector():
    # Saved with grad_spike off; loaded into a monitor with loss_spike off.
    saved = _trained_monitor({"detectors": {"grad_spike": {"enabled": False}}}).state_dict()
    assert "grad_spike" not in saved["detectors"] and "loss_spike" in saved["detectors"]
    window = saved["detectors"]["update_ratio_spike"]["windows"]
    other = sfmonitor.Monitor(config={"detectors": {"loss_spike": {"enabled": False}}, "console": False})
    with pytest.warns(RuntimeWarning, match="loss_spike ignored"):
        other.load_state_dict(saved)
    got = other.state_dict()["detectors"]
    assert got["update_ratio_spike"]["windows"] == window  # its own state
    assert got["grad_spike"] == {"ema": {}, "warm": {}, "mix": None, "grads": None}  # nothing saved for it: fresh
    assert "loss_spike" not in got


def test_detector_state_saved_as_a_list_by_an_older_version_is_ignored_with_a_warning():
    mon = sfmonitor.Monitor(config={"console": False})
    sd = mon.state_dict()
    sd["detectors"] = [{"windows": {"loss/total": [1.0] * 30}}]
    with pytest.warns(RuntimeWarning, match="older sfmonitor"):
        mon.load_state_dict(sd)
    assert mon.state_dict()["detectors"]["loss_spike"] == {
        "windows": {},
        "errors": {},
        "start": {},
        "run": {},
        "before_run": {},
        "pending": {},
        "returned": {},
        "signed": [],
        "raw": [],
        "mix": None,
    }


def test_a_registered_actions_budget_and_cooldown_hold_whatever_config_is_given(clean_registry):
    """``register_action(..., budgeted=True, cooldown=N)`` holds in every monitor built after it,
    whatever config it is given (a newcomer's audit: the policy section's defaults were copied
    from one built at import, so without a ``policy`` key in the config the action was neither
    budgeted nor cooled down: it ran every step, spending nothing)."""
    calls = []
    sfmonitor.register_action(
        "tag_step", lambda ctx, d: calls.append(ctx.step) or {}, order=46, budgeted=True, cooldown=5
    )

    class Always(sfmonitor.Detector):
        kind = "always_seen"

        def check(self, step, stats):
            return [sfmonitor.Finding(self.kind, "always")]

    sfmonitor.register_detector("always", Always, kinds={"always_seen": [(1, ["tag_step"])]})
    for config in (None, {}, {"console": False}, {"console": False, "policy": {}}):
        cfg = sfmonitor.MonitorConfig.from_any(config)
        assert "tag_step" in cfg.policy.budget_actions and cfg.policy.cooldowns["tag_step"] == 5, config
    calls.clear()
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.Monitor(config={"console": False}, sinks=[])
    mon.attach(model, opt)
    for _ in range(12):
        mon.combine(model(torch.randn(4, 3)).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    assert calls[0] == 0 and 2 <= len(calls) <= 3 and calls == [0, 5, 10][: len(calls)]
    assert mon._policy.rescues_used == len(calls)
