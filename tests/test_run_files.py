"""Dry run, log_every, run.json / summary.json, and the SFMONITOR_DISABLED kill switch."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import sfmonitor
from sfmonitor.events import Event
from sfmonitor.sinks.jsonl import read_jsonl


def setup(tmp_path, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config={"console": False, **cfg})
    return model, opt, mon


def train(mon, model, opt, steps=12, nan_at=()):
    for i in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if i in nan_at:
            loss = loss * torch.tensor(float("nan"))
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()


def test_dry_run_says_what_it_would_do_and_changes_nothing(tmp_path):
    model, opt, mon = setup(tmp_path, dry_run=True)
    train(mon, model, opt, nan_at={5})
    mon.detach()
    ev = [e for e in mon.events if e.kind == "nonfinite_loss"]
    assert ev[0].step == 5 and ev[0].actions == []  # (later steps: the NaN weights it let land)
    assert ev[0].data["dry_run_would"] == ["skip_step"]
    assert not all(torch.isfinite(p).all() for p in model.parameters()), "the NaN update landed"
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["dry_run"] is True and summary["actions"] == {}


def test_log_every_thins_metrics_but_not_events(tmp_path):
    model, opt, mon = setup(tmp_path, log_every=4)
    train(mon, model, opt, steps=12, nan_at={6})
    mon.detach()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0, 4, 8]
    assert {e["step"] for e in read_jsonl(str(tmp_path / "events.jsonl"))} == {6}


def test_run_and_summary_files(tmp_path, capsys):
    model, opt, mon = setup(tmp_path, console=True)
    run = json.load(open(tmp_path / "run.json"))
    assert run["torch"] == torch.__version__ and run["sfmonitor"] == sfmonitor.__version__
    assert run["parameters"] == sum(p.numel() for p in model.parameters()) and run["world_size"] == 1
    assert run["parameter_dtypes"] == {"float32": 4}
    train(mon, model, opt, steps=10, nan_at={3})
    mon.detach()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps"] == 10 and summary["steps_skipped"] == 1
    assert summary["events"] == {"nonfinite_loss": 1, "nonfinite_grad": 1} and summary["actions"] == {"skip_step": 1}
    assert summary["rescue_budget_left"] == 10 and summary["monitor_ms_per_step"] > 0
    assert summary["undo_copy_bytes"] > 0
    assert "run summary: 10 steps" in capsys.readouterr().err


def test_the_kill_switch_makes_attach_a_no_op(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SFMONITOR_DISABLED", "1")
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "run"))
    assert "SFMONITOR_DISABLED" in capsys.readouterr().err
    assert not mon.attached and opt._optimizer_step_pre_hooks == {} and not os.path.exists(tmp_path / "run")
    for _ in mon.batches(range(3)):
        loss = mon.combine(model(torch.randn(2, 3)).sum())
        loss.backward()
        opt.step()
    assert mon.step == 0 and mon.events == []
    mon.detach()


def test_the_summary_counts_an_undo_that_fell_back_to_a_rollback_as_a_rollback_with_its_steps(tmp_path):
    """Without the undo copy (the lean profile) an undo falls back to a rollback to the newest
    snapshot: the summary counts it so, with the steps it went back, not as one update undone (a
    helper's probe: a 151-step rollback read ``updates_undone: 1, steps_skipped: 0``)."""
    from sfmonitor.summary import Tally, format_summary, run_summary

    fallback = {"restored": True, "restored_from": 10, "steps_back": 31, "fallback": "rollback", "reason": "no copy"}
    events = [
        Event(
            step=41,
            kind="update_ratio_spike",
            message="",
            actions=["undo"],
            data={"action_results": {"undo": fallback}},
        ),
        Event(
            step=60,
            kind="update_ratio_spike",
            message="",
            actions=["undo"],
            data={"action_results": {"undo": {"restored": True, "undone_step": 59, "steps_back": 1}}},
        ),
        Event(
            step=90,
            kind="loss_spike",
            message="",
            actions=["rollback", "lr_drop"],
            data={
                "action_results": {"rollback": {"restored": True, "restored_from": 80, "steps_back": 10}, "lr_drop": {}}
            },
        ),
    ]
    s = run_summary(Tally().merged(events), 100, 3, 10, 1.0, 100, 0, False)
    assert s["updates_undone"] == 1
    assert s["rollbacks"] == 2 and s["steps_rolled_back"] == 41
    # and under `actions` too (a second probe: `actions: {"undo": 1}` beside `rollbacks: 1`)
    assert s["actions"] == {"undo": 1, "rollback": 2, "lr_drop": 1}
    assert "1 undone, 2 rolled back (41 steps)" in format_summary({**s, "events": {}, "actions": {}})


def test_the_summary_counts_the_lrs_climb_back_apart_from_its_drops(tmp_path):
    """The LR's climb back after a drop (its start, its end, a release) is an event with the
    lr_drop action, as the drop is: one drop and its climb read ``lr_drop: 3`` in the summary (a
    helper's probe). The summary counts the climb apart (``lr_climb``); a halt that takes the LR
    back down for good is a drop."""
    from sfmonitor.summary import Tally

    def ev(step, facts):
        return Event(
            step=step, kind="loss_spike", message="", actions=["lr_drop"], data={"action_results": {"lr_drop": facts}}
        )

    events = [
        ev(10, {"factor": 0.2, "old_scale": 1.0, "new_scale": 0.2}),
        ev(110, {"old_scale": 0.2, "new_scale": 0.21, "recovering": True, "steps": 200}),
        ev(160, {"old_scale": 0.5, "new_scale": 0.3, "halted": True, "permanent": True}),
        ev(400, {"old_scale": 0.9, "new_scale": 1.0, "recovered": True}),
        ev(500, {"old_scale": 0.3, "new_scale": 1.0, "released": True}),
    ]
    assert Tally().merged(events).counts()["actions"] == {"lr_drop": 2, "lr_climb": 3}


def test_a_failed_json_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """run.json and summary.json are written to a temporary file and renamed: a rename that fails
    (a full disk) removes the temporary (a helper's probe found ``run.json.<pid>.tmp`` left)."""

    from sfmonitor import summary as summary_module

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(summary_module.os, "replace", full)
    with pytest.raises(OSError):
        summary_module.write_json(str(tmp_path), "run.json", {"a": 1})
    assert os.listdir(tmp_path) == []


def test_a_resumed_runs_summary_counts_the_run_before_the_resume(tmp_path):
    """A run resumed into its run_dir (the monitor's state_dict saved with the checkpoint and
    loaded into the next session's monitor) ends with a summary of the whole run: before, the
    second session's summary.json replaced the first's with its own events only (a helper's
    probe: a skipped bad batch of the first session gone from it)."""
    model, opt, mon = setup(tmp_path)
    train(mon, model, opt, steps=10, nan_at={3})
    saved = mon.state_dict()
    mon.detach()
    first = json.load(open(tmp_path / "summary.json"))
    assert first["steps_skipped"] == 1 and first["actions"] == {"skip_step": 1}
    mon2 = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config={"console": False})
    mon2.load_state_dict(saved)
    train(mon2, model, opt, steps=10, nan_at={5})
    mon2.detach()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps"] == 20 and summary["steps_skipped"] == 2
    assert summary["actions"] == {"skip_step": 2}
    assert summary["events"] == {"nonfinite_loss": 2, "nonfinite_grad": 2}
    with pytest.raises(sfmonitor.ConfigError, match=r"state\['summary'\]"):
        mon2.load_state_dict({**saved, "summary": {"steps_skipped": "many"}})


def test_a_resume_into_a_monitor_that_has_events_counts_only_the_resumed_timeline(tmp_path):
    """load_state_dict into a monitor that already has events: those belong to the timeline the
    load left and are not counted, also once the bounded list lets them go; later ones are."""
    model, opt, mon = setup(tmp_path, max_events=3)
    train(mon, model, opt, steps=4, nan_at={1})  # 2 events of the left timeline
    saved = {**mon.state_dict(), "summary": {}}  # a state whose run had no event
    mon.load_state_dict(saved)
    train(mon, model, opt, steps=8, nan_at={2, 5})  # 4 more: the list keeps the last 3
    mon.detach()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps_skipped"] == 2 and summary["events"] == {"nonfinite_loss": 2, "nonfinite_grad": 2}


def test_the_summary_counts_events_the_bounded_list_let_go(tmp_path):
    """``max_events`` bounds the events kept in memory; the summary still counts every one."""
    model, opt, mon = setup(tmp_path, max_events=2)
    train(mon, model, opt, steps=12, nan_at={2, 5, 8})
    mon.detach()
    assert len(mon.events) == 2
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["steps_skipped"] == 3 and summary["events"] == {"nonfinite_loss": 3, "nonfinite_grad": 3}


def test_the_summary_names_a_sink_that_stopped_writing(tmp_path):
    """A sink that fails is disabled with one warning and training goes on; the run's summary
    says so too, so that what is missing from a dashboard is explained after the run (a helper's
    probe: the console warning was the only trace)."""

    class Broken:
        name = "broken"

        def log_metrics(self, step, metrics):
            raise RuntimeError("dashboard down")

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=["jsonl", Broken()], config={"console": False})
    with pytest.warns(RuntimeWarning, match="dashboard down"):
        train(mon, model, opt, steps=3)
    mon.detach()
    summary = json.load(open(tmp_path / "summary.json"))
    assert list(summary["sink_failures"]) == ["broken"]
    assert "dashboard down" in summary["sink_failures"]["broken"]
    assert "stopped writing: broken" in sfmonitor.summary.format_summary(summary)  # (the console line too)
