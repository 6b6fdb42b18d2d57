"""Policy: ladders escalate as configured, cooldowns and the budget hold, state round-trips."""

import json

import pytest
import yaml

from sfmonitor.events import ConfigError, Finding
from sfmonitor.policy import Policy, PolicyConfig
from sfmonitor.registry import action_order


def F(kind, occurrence=None, **data):
    return Finding(
        kind=kind,
        message=f"{kind} seen",
        data=data,
        occurrence=occurrence,
        where=f"{data['a']}/{data['b']}" if "a" in data and "b" in data else "",
    )


def acts(decisions):
    return [d.action for d in decisions]


def test_healthy_run_decides_nothing():
    p = Policy()
    assert all(p.decide(s, []) == [] for s in range(1000))
    assert p.state_dict() == {"streaks": {}, "last_taken": {}, "rescues_used": 0}


def test_nonfinite_ladder_three_in_a_row():
    p = Policy()
    assert acts(p.decide(0, [F("nonfinite_grad")])) == ["skip_step"]
    assert acts(p.decide(1, [F("nonfinite_grad")])) == ["skip_step"]
    d = p.decide(2, [F("nonfinite_grad")])
    assert acts(d) == ["skip_step", "rollback", "lr_drop"]
    assert d[1].cause.kind == "nonfinite_grad" and d[1].params["streak"] == 3
    # a gap breaks the streak ("in a row" = window 1)
    p2 = Policy()
    for s in (0, 1, 3, 4):
        assert acts(p2.decide(s, [F("nonfinite_loss")])) == ["skip_step"]
    assert acts(p2.decide(5, [F("nonfinite_loss")])) == ["skip_step", "rollback", "lr_drop"]


def test_loss_spike_escalates_within_window_only():
    p = Policy()
    assert acts(p.decide(10, [F("loss_spike")])) == ["skip_step"]  # a jump alone: the batch
    assert acts(p.decide(30, [F("loss_spike")])) == ["skip_step"]  # 20 > 10 apart: a new streak
    assert acts(p.decide(50, [F("loss_spike")])) == ["skip_step"]  # a bad batch every 20 steps never escalates
    assert acts(p.decide(55, [F("loss_spike")])) == ["skip_step"]
    assert acts(p.decide(60, [F("loss_spike")])) == ["rollback", "lr_drop"]  # 3rd within 10 of the last


def test_default_ladders_of_every_kind():
    cases = {
        "grad_spike": ["clip"],
        "update_ratio_spike": ["undo"],
        "loss_ratio_imbalance": ["reweight"],
        "grad_ratio_imbalance": ["reweight"],
        "loss_scale_floor": [],
        "activation_overflow": [],
        "accuracy_collapse": ["rollback", "lr_drop"],
        "plateau": [],  # events only: the report's early stopping is opt-in
        "nonfinite_param": ["undo"],
        "bad_batch": ["skip_step"],
        "loss_spike": ["skip_step"],
    }
    for kind, want in cases.items():
        assert acts(Policy().decide(0, [F(kind)])) == want, kind


def test_activation_overflow_persistent_falls_back_to_fp32():
    p = Policy()
    assert acts(p.decide(0, [F("activation_overflow")])) == []
    assert acts(p.decide(150, [F("activation_overflow")])) == []  # > 100 steps apart: a new streak
    assert acts(p.decide(240, [F("activation_overflow")])) == ["qk_clip"]  # second: treat the cause first
    assert acts(p.decide(250, [F("activation_overflow")])) == ["precision_fallback"]  # third: the last resort


def test_plateau_is_events_only_by_default():
    p = Policy()  # a stalled validation metric is no fault: the report's early stopping is opt-in
    assert acts(p.decide(64, [F("plateau", occurrence=1)])) == []
    assert acts(p.decide(192, [F("plateau", occurrence=2)])) == []


def test_plateau_uses_detector_occurrence():
    rungs = [{"after": 1, "actions": ["lr_drop"]}, {"after": 2, "actions": ["stop"]}]
    p = Policy(PolicyConfig.from_dict({"ladders": {"plateau": {"rungs": rungs}}}))
    assert acts(p.decide(64, [F("plateau", occurrence=1)])) == ["lr_drop"]
    assert acts(p.decide(192, [F("plateau", occurrence=2)])) == ["stop"]
    assert acts(p.decide(900, [F("plateau", occurrence=1)])) == ["lr_drop"]  # after a reset


def test_several_findings_one_step_dedupe_and_order_and_per_finding_reweight():
    p = Policy()
    fs = [
        F("grad_spike"),
        F("update_ratio_spike"),
        F("nonfinite_grad"),
        F("loss_ratio_imbalance", a="vision", b="fusion"),
        F("loss_ratio_imbalance", a="text", b="fusion"),
        F("loss_spike"),
    ]
    d = p.decide(0, fs)
    names = acts(d)
    assert names == sorted(names, key=action_order().index)
    assert names.count("skip_step") == 1 and names.count("undo") == 1 and names.count("reweight") == 2
    assert {x.cause.data.get("a") for x in d if x.action == "reweight"} == {"vision", "text"}
    assert p.rescues_used == 0  # undo, skip, clip and reweight spend no rescue


def test_cooldowns_hold():
    cfg = PolicyConfig.from_dict({"cooldowns": {"rollback": 10, "lr_drop": 10}})
    p = Policy(cfg)
    assert acts(p.decide(0, [F("accuracy_collapse")])) == ["rollback", "lr_drop"]
    assert acts(p.decide(5, [F("accuracy_collapse")])) == []
    assert {s["action"] for s in p.suppressed} == {"rollback", "lr_drop"}
    assert "cooldown" in p.suppressed[0]["reason"]
    assert acts(p.decide(9, [F("accuracy_collapse")])) == []
    assert acts(p.decide(10, [F("accuracy_collapse")])) == ["rollback", "lr_drop"]
    assert p.rescues_used == 2  # suppressed steps spend nothing


def test_budget_spent_checkpoint_and_stop():
    p = Policy(PolicyConfig(budget=2, cooldowns={"rollback": 0, "lr_drop": 0}))
    assert acts(p.decide(0, [F("accuracy_collapse")])) == ["rollback", "lr_drop"]
    assert acts(p.decide(1, [F("accuracy_collapse")])) == ["rollback", "lr_drop"]
    d = p.decide(2, [F("accuracy_collapse")])
    assert acts(d) == ["checkpoint", "stop"]
    assert "budget of 2 spent" in d[1].params["reason"]
    # non-budgeted actions of the same step survive
    d = p.decide(3, [F("nonfinite_grad"), F("accuracy_collapse")])
    assert acts(d) == ["skip_step", "checkpoint", "stop"]
    assert acts(Policy(PolicyConfig(budget=0)).decide(0, [F("grad_spike")])) == ["clip"]


def test_state_dict_round_trip_mid_sequence_continues_identically():
    seq = [(s, [F("nonfinite_grad")]) for s in range(3)] + [
        (7, [F("loss_spike")]),
        (30, [F("update_ratio_spike")]),
        (31, [F("nonfinite_grad")]),
        (32, [F("nonfinite_grad")]),
        (33, [F("nonfinite_grad")]),
        (60, [F("update_ratio_spike")]),
    ]
    a = Policy(PolicyConfig(budget=2))
    out_a = [(s, acts(a.decide(s, fs))) for s, fs in seq]
    b = Policy(PolicyConfig(budget=2))
    for s, fs in seq[:4]:
        b.decide(s, fs)
    c = Policy(PolicyConfig(budget=2))
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    out_c = [(s, acts(c.decide(s, fs))) for s, fs in seq[4:]]
    assert out_c == out_a[4:]
    assert ["undo", "checkpoint", "stop"] in [x for _, x in out_a]  # the sequence does reach the budget


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match=r"ladders\.grad_spike\.rungs\[0\]\.actions\[1\]: unknown action 'bogus'"):
        PolicyConfig.from_dict({"ladders": {"grad_spike": {"rungs": [{"after": 1, "actions": ["clip", "bogus"]}]}}})
    with pytest.raises(ConfigError, match="ladders.not_a_kind"):
        PolicyConfig.from_dict({"ladders": {"not_a_kind": {"rungs": []}}})
    with pytest.raises(ConfigError, match="cooldowns.jump"):
        PolicyConfig.from_dict({"cooldowns": {"jump": 3}})
    with pytest.raises(ConfigError, match=r"rungs\[1\]\.after"):
        PolicyConfig.from_dict({"ladders": {"grad_spike": {"rungs": [{"after": 2}, {"after": 2}]}}})
    with pytest.raises(ConfigError, match=r"on_budget_spent\[0\]"):
        PolicyConfig.from_dict({"on_budget_spent": ["explode"]})
    with pytest.raises(ConfigError, match="budget"):
        PolicyConfig.from_dict({"budget": -1})


def test_partial_override_keeps_other_defaults_and_yaml_round_trip():
    cfg = PolicyConfig.from_dict(
        {
            "ladders": {"grad_spike": {"rungs": [{"after": 2, "actions": ["clip", "grad_noise"]}]}},
            "cooldowns": {"clip": 5},
        }
    )
    assert cfg.ladders["nonfinite_grad"].rungs[1].actions == ["skip_step", "rollback", "lr_drop"]
    assert cfg.cooldowns["rollback"] == PolicyConfig().cooldowns["rollback"] and cfg.cooldowns["clip"] == 5
    p = Policy(cfg)
    assert acts(p.decide(0, [F("grad_spike")])) == []
    assert acts(p.decide(1, [F("grad_spike")])) == ["clip", "grad_noise"]
    assert acts(p.decide(2, [F("grad_spike")])) == ["grad_noise"]  # clip cooling down
    again = PolicyConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg
    # disabling a kind entirely
    off = Policy(PolicyConfig.from_dict({"ladders": {"grad_spike": {"rungs": []}}}))
    assert off.decide(0, [F("grad_spike")]) == []
