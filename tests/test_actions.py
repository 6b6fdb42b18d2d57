"""Actions: each effect is exact (norms, weights, LRs, restored state) and reported as facts."""

import json
import math

import pytest
import torch
from torch import nn

from sfmonitor import actions as A
from sfmonitor.checkpoint import SnapshotRing, load_checkpoint
from sfmonitor.events import ConfigError, Decision, Finding, StopTraining

torch.set_num_threads(1)


class Tri(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(4, 4)
        self.text = nn.Linear(4, 4)
        self.fusion = nn.Linear(4, 2)

    def forward(self, x):
        return self.fusion(torch.relu(self.vision(x) + self.text(x)))


def ctx_for(model, opt=None, **kw):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = {name: [(f"{name}.{n}", p) for n, p in child.named_parameters()] for name, child in model.named_children()}
    return A.ActionContext(model=model, optimizer=opt, groups=groups, **kw)


def set_grads(model, norms):
    """Give each group a gradient of exactly the given norm (spread over weight and bias)."""
    for name, n in norms.items():
        ps = list(getattr(model, name).parameters())
        total = sum(p.numel() for p in ps)
        for p in ps:
            p.grad = torch.full_like(p, n / math.sqrt(total))


def D(action, kind="grad_spike", before_update=True, params=None, step=None, **data):
    return Decision(
        action=action,
        cause=Finding(kind=kind, message=f"{kind}!", data=data, step=step, before_update=before_update),
        params=params or {},
    )


def gnorm(module):
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])).item()


# ---------------------------------------------------------------------------- skip / dispatch


def test_skip_step_sets_flag_and_unknown_action_is_refused():
    ctx = ctx_for(Tri())
    assert A.apply(ctx, D("skip_step")) == {"skipped_step": 0} and ctx.skip
    with pytest.raises(ConfigError, match="unknown action 'teleport'"):
        A.apply(ctx, D("teleport"))


# ---------------------------------------------------------------------------- clip


def test_clip_global_exact_norm_and_facts():
    m = Tri()
    set_grads(m, {"vision": 3.0, "text": 4.0, "fusion": 12.0})  # total 13
    ctx = ctx_for(m)
    facts = A.apply(ctx, D("clip", params={"mode": "global"}))
    assert facts["norm_before"] == pytest.approx(13.0, rel=1e-6)
    assert facts["norm_after"] == pytest.approx(1.0, rel=1e-5)
    assert facts["group_norm_after"]["fusion"] == pytest.approx(12 / 13, rel=1e-5)
    json.dumps(facts)
    # below the limit: untouched
    set_grads(m, {"vision": 0.3, "text": 0.4, "fusion": 0.0})
    A.apply(ctx, D("clip", params={"mode": "global"}))
    assert gnorm(m.vision) == pytest.approx(0.3, rel=1e-6)


def test_clip_per_modality_report_rules_exact():
    m = Tri()
    set_grads(m, {"vision": 20.0, "text": 400.0, "fusion": 3.0})
    facts = A.apply(ctx_for(m), D("clip", params={"mode": "per_modality"}))
    # vision: min(1, 5/20) -> 5; text: min(1, 10/sqrt(400)) = 0.5 -> 200; fusion ('*'): min(1, 7/3) = 1 -> 3
    assert gnorm(m.vision) == pytest.approx(5.0, rel=1e-5)
    assert gnorm(m.text) == pytest.approx(200.0, rel=1e-5)
    assert gnorm(m.fusion) == pytest.approx(3.0, rel=1e-6)
    assert facts["rules"] == {"vision": "norm:5", "text": "sqrt:10", "fusion": "norm:7"}
    # configurable mapping
    m2 = Tri()
    set_grads(m2, {"vision": 20.0, "text": 400.0, "fusion": 30.0})
    cfg = A.ActionsConfig.from_dict({"clip": {"mode": "per_modality", "per_modality": {"fusion": "sqrt:3"}}})
    A.apply(ctx_for(m2, config=cfg), D("clip"))
    assert gnorm(m2.fusion) == pytest.approx(30 * 3 / math.sqrt(30), rel=1e-5)
    assert gnorm(m2.text) == pytest.approx(400.0, rel=1e-6)  # no rule, no '*': untouched


def test_clip_zclip_uses_detector_statistics():
    m = Tri()
    set_grads(m, {"vision": 30.0, "text": 40.0, "fusion": 0.0})  # total 50
    facts = A.apply(ctx_for(m), D("clip", mean_log=math.log(2.0), sigma_log=0.2))
    target = 2.0 * math.exp(2.5 * 0.2)
    assert facts["mode"] == "zclip" and facts["max_norm"] == pytest.approx(target)
    assert facts["norm_after"] == pytest.approx(target, rel=1e-5)
    # without detector statistics: falls back to max_grad_norm and says so
    set_grads(m, {"vision": 30.0, "text": 40.0, "fusion": 0.0})
    facts = A.apply(ctx_for(m), D("clip"))
    assert facts["mode"] == "global" and "no detector statistics" in facts["note"]
    assert facts["norm_after"] == pytest.approx(1.0, rel=1e-5)


def test_clip_agc_unitwise_exact():
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 1e-5]]))  # row norms 5 and ~0 (eps)
        lin.bias.copy_(torch.tensor([1.0, 0.0]))
    lin.weight.grad = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.001, 0.0]])
    lin.bias.grad = torch.tensor([0.0, 0.001])
    ctx = A.ActionContext(
        model=lin, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1), groups={"all": list(lin.named_parameters())}
    )
    A.apply(ctx, D("clip", params={"mode": "agc"}))
    # row 0: max 0.01 * 5 = 0.05 < 1 -> clipped to norm 0.05; row 1: max 0.01 * 1e-3 = 1e-5 < 1e-3 -> 1e-5
    assert lin.weight.grad[0].norm().item() == pytest.approx(0.05, rel=1e-5)
    assert lin.weight.grad[1].norm().item() == pytest.approx(1e-5, rel=1e-4)
    assert lin.bias.grad.norm().item() == pytest.approx(0.001, rel=1e-6)  # 0.001 < 0.01 * 1: untouched


def test_clip_config_rules_validated():
    with pytest.raises(ConfigError, match=r"clip.per_modality.text: 'root:3'"):
        A.ActionsConfig.from_dict({"clip": {"per_modality": {"text": "root:3"}}})
    with pytest.raises(ConfigError, match="clip.mode"):
        A.ActionsConfig.from_dict({"clip": {"mode": "hard"}})


# ---------------------------------------------------------------------------- reweight


def test_reweight_report_rule_and_relax_back_to_base():
    base = {"vision": 0.4, "text": 0.3, "fusion": 0.3}
    ctx = ctx_for(Tri(), loss_weights=dict(base), base_weights=dict(base))
    facts = A.apply(
        ctx,
        D(
            "reweight",
            kind="loss_ratio_imbalance",
            a="vision",
            b="fusion",
            ratio=3.0,
            threshold=2.0,
            key="loss_ratio/vision/fusion",
        ),
    )
    assert ctx.loss_weights["vision"] == pytest.approx(0.4 * 2 / 3)
    assert ctx.loss_weights["fusion"] == pytest.approx(0.3 * 3 / 2)
    assert ctx.loss_weights["text"] == 0.3
    assert facts["old_weights"] == {"vision": 0.4, "fusion": 0.3} and facts["applied"]
    # still imbalanced: no relaxation
    assert A.relax_weights(ctx, {"loss_ratio/vision/fusion": 2.5}) == {}
    assert A.relax_weights(ctx, {}) == {}
    # balanced: moves relax_rate (5%) of the way back each step
    out = A.relax_weights(ctx, {"loss_ratio/vision/fusion": 1.5})
    assert out["weights"]["vision"] == pytest.approx(0.4 + (0.4 * 2 / 3 - 0.4) * 0.95)
    for _ in range(300):
        out = A.relax_weights(ctx, {"loss_ratio/vision/fusion": 1.5}) or out
    assert ctx.loss_weights == base and out["restored"] == ["vision/fusion"] and ctx.reweighted == {}
    # without a loss_ratio key, the ratio comes from the component losses (as in the detector)
    A.apply(ctx, D("reweight", a="vision", b="fusion", ratio=3.0, key="loss_ratio/vision/fusion"))
    assert A.relax_weights(ctx, {"loss/vision": 3.0, "loss/fusion": 1.0}) == {}
    assert A.relax_weights(ctx, {"loss/vision": 1.0, "loss/fusion": 1.0})["weights"]["vision"] > 0.4 * 2 / 3
    # unknown components: not applied, says why
    facts = A.apply(ctx, D("reweight", a="image", b="fusion", ratio=3.0))
    assert facts["applied"] is False and "image" in facts["reason"]


# ---------------------------------------------------------------------------- lr_drop


def test_lr_drop_scale_floor_and_apply_restore_helpers():
    m = Tri()
    opt = torch.optim.SGD([{"params": m.vision.parameters(), "lr": 0.1}, {"params": m.fusion.parameters(), "lr": 0.01}])
    ctx = ctx_for(m, opt)
    facts = A.apply(ctx, D("lr_drop", kind="plateau"))
    assert ctx.lr_scale == pytest.approx(0.2) and facts["new_lr"] == pytest.approx([0.02, 0.002])
    assert facts["old_lr"] == pytest.approx([0.1, 0.01])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]  # user's values untouched
    saved = A.apply_lr_scale(opt, ctx.lr_scale)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.02, 0.002])
    A.restore_lr(opt, saved)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    for _ in range(10):
        A.apply(ctx, D("lr_drop"))
    assert ctx.lr_scale == 1e-3  # min_scale floor
    assert A.apply_lr_scale(opt, 1.0) == [] and [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    saved = A.apply_lr_scale(opt, 0.01, min_lr=0.005)  # floor, but never above the user's own LR
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.005, 0.005])
    A.restore_lr(opt, saved)
    t_opt = torch.optim.Adam(m.text.parameters(), lr=torch.tensor(0.01))
    saved = A.apply_lr_scale(t_opt, 0.2)
    assert t_opt.param_groups[0]["lr"].item() == pytest.approx(0.002)
    A.restore_lr(t_opt, saved)
    assert t_opt.param_groups[0]["lr"].item() == pytest.approx(0.01)


def _climb(losses_at, halt_rise=1.5, steps=60):
    """relax_lr over ``steps`` steps after a drop at step 0 (recover_after 20, recover_steps 20,
    halt_window 5), the loss at each step ``losses_at(step, scale)``: the facts of each step."""
    ctx = ctx_for(Tri())
    ctx.config.lr_drop.recover_after, ctx.config.lr_drop.recover_steps = 20, 20
    ctx.config.lr_drop.halt_window, ctx.config.lr_drop.halt_rise = 5, halt_rise
    A.apply(ctx, D("lr_drop"))
    out = []
    for step in range(1, steps):
        ctx.step = step
        out.append((step, A.relax_lr(ctx, losses_at(step, ctx.lr_scale)), ctx.lr_scale))
    return ctx, [(step, facts, scale) for step, facts, scale in out if facts]


def _trial(losses_at, already=1.0, steps=40):
    """A trial drop (a loss_divergence finding, its median 8.0 before the drop, 0.5 where the growth
    began: the bar 2.0) at step 0 with the LR scale at ``already``, then each step judge_trial (its
    verdict's enforced actions applied) and relax_lr (halt_window 5), the loss at each
    ``losses_at(step, scale)``: (ctx, the verdicts with their actions' facts and the scale after
    them, the drop's facts)."""
    ctx = ctx_for(Tri(), torch.optim.SGD(Tri().parameters(), lr=0.3))
    ctx.config.lr_drop.halt_window = 5
    ctx.lr_scale = already
    grows = D("lr_drop", kind="loss_divergence", before_update=False, median=8.0, began_median=0.5, trial=True)
    facts = A.apply(ctx, grows)
    verdicts = []
    for step in range(1, steps):
        ctx.step = step
        loss = losses_at(step, ctx.lr_scale)
        verdict = A.judge_trial(ctx, step, loss)
        if verdict is not None:
            done = {a: A.apply(ctx, Decision(a, verdict, {"enforced": True})) for a in verdict.enforced}
            verdicts.append((step, verdict, done, ctx.lr_scale))
        A.relax_lr(ctx, loss)
    return ctx, verdicts, facts


def test_a_trial_drop_stands_where_the_loss_follows_the_lr():
    """A loss that grows over spans (loss_divergence) may be an LR past its edge or a loss weight
    that grows: its drop is a trial. Where the loss falls under its median before the drop within
    halt_window steps, the LR was the cause: a verdict told (no action), and the drop stands as an
    ordinary one (it climbs back after recover_after; for good when the LR was already lowered)."""
    ctx, verdicts, facts = _trial(lambda step, scale: 1.5 if scale < 1 else 20.0)
    assert facts["trial"] and facts["judged_at_step"] == 5 and ctx.lr_scale == pytest.approx(0.2)
    [(step, verdict, done, scale)] = verdicts
    assert step == 5 and verdict.told and not verdict.enforced and done == {}
    assert verdict.kind == "loss_divergence" and verdict.data["followed"] and not verdict.data["state_held"]
    assert verdict.data["loss_median_trial"] == pytest.approx(1.5)
    assert verdict.data["loss_median_before"] == pytest.approx(8.0) and verdict.data[
        "loss_median_bar"
    ] == pytest.approx(2)
    assert scale == pytest.approx(0.2) and not verdict.data["permanent"] and verdict.data["recovers_from_step"] == 100
    assert ctx.lr_trial is None and not ctx.lr_permanent
    ctx, verdicts, _ = _trial(lambda step, scale: 1.5, already=0.5)  # (the LR was lowered already)
    assert verdicts[0][1].data["permanent"] and ctx.lr_permanent
    # under the median before the trial but not back near where the growth began: a TD learner's
    # bimodal loss, 5% under it (its LR cut by a trial it had not borne out: 7x its bare run)
    _, verdicts, _ = _trial(lambda step, scale: 7.6)
    assert verdicts[0][1].data["followed"] is False


def test_a_trial_drop_the_loss_does_not_follow_gives_the_lr_back_and_later_growth_is_told():
    """Where the loss goes on growing at the lowered LR, the growth is not the LR's doing: the
    verdict's enforced lr_drop gives the LR back as it was (scale, permanence, ceiling), and further
    findings of a growing loss are told only (the drop not applied) until its median is back under
    the level of the trial. (No state held: no rollback to put back.)"""
    ctx, verdicts, _ = _trial(lambda step, scale: 10.0 * 1.1**step, already=0.5)
    [(step, verdict, done, scale)] = verdicts
    assert step == 5 and verdict.enforced == ("lr_drop",) and not verdict.told
    assert verdict.data["followed"] is False and done["lr_drop"]["given_back"]
    assert done["lr_drop"]["old_scale"] == pytest.approx(0.1) and done["lr_drop"]["new_scale"] == 0.5 and scale == 0.5
    assert ctx.lr_trial["refuted"] and ctx.lr_dropped_at is None and ctx.lr_ceiling is None and not ctx.lr_permanent
    again = A.apply(ctx, D("lr_drop", kind="loss_divergence", before_update=False, median=50.0, trial=True))
    assert again["applied"] is False and "outside the state and the LR" in again["reason"] and ctx.lr_scale == 0.5
    other = A.apply(ctx, D("lr_drop", kind="loss_spike"))  # (other findings' drops: as ever)
    assert other["new_scale"] == pytest.approx(0.1)
    for step in range(40, 46):  # the loss back under the trial's level: trials again
        assert A.judge_trial(ctx, step, 1.0) is None
    assert ctx.lr_trial is None


def test_a_trials_rollback_holds_the_state_it_left_and_a_refutation_puts_it_back(tmp_path):
    """The trial's rollback (to the newest snapshot from before the growth) holds the state it
    left, and the snapshots it took out of the ring. A refutation puts both back (the trial's own
    snapshots go) and skips the step's update; a confirmation drops them."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ring = SnapshotRing(every=10, keep=3)
    ctx = ctx_for(model, opt, snapshots=ring)
    for label in (0, 10, 20):
        with torch.no_grad():
            model.weight.fill_(float(label))
        ring.take(label, model, opt)
    with torch.no_grad():
        model.weight.fill_(25.0)  # the state the growth left
    ctx.step = 25
    cause = Finding("loss_divergence", "grows", data={"trial": True, "median": 8.0}, before_update=False, step=12)
    facts = A.apply(ctx, Decision("rollback", cause))
    assert facts["restored_from"] == 10 and facts["trial"] and facts["held_bytes"] > 0
    assert model.weight.eq(10.0).all() and ring.labels == [0, 10] and ctx.lr_trial_held["at"] == 25
    ctx.skip = False
    ring.take(30, model, opt)  # (a snapshot of the trial's steps)
    ctx.step = 45
    refuted = Finding("loss_divergence", "not the LR", data={"trial_refuted": True})
    back = A.apply(ctx, Decision("rollback", refuted, {"enforced": True}))
    assert back["restored"] and back["restored_from"] == 25 and ctx.skip
    assert model.weight.eq(25.0).all() and ring.labels == [0, 10, 20] and ctx.lr_trial_held is None
    assert A.apply(ctx, Decision("rollback", refuted))["restored"] is False  # (nothing held any more)
    ring.max_bytes, ctx.skip = ring.nbytes + 10, False  # no room beside the snapshots to hold a state
    full = A.apply(ctx, Decision("rollback", cause))
    assert full["restored"] is False and "no room" in full["reason"] and not ctx.skip and ring.labels == [0, 10, 20]
    ring.max_bytes = None
    ring.clear()  # no snapshot from before the growth: the trial is the drop alone, nothing skipped
    bare = A.apply(ctx, Decision("rollback", cause))
    assert bare["restored"] is False and "no snapshot" in bare["reason"] and not ctx.skip
    ctx.lr_trial, ctx.skip = {"at": 25, "before": 2.0, "losses": [], "refuted": True}, False
    told = A.apply(ctx, Decision("rollback", cause))  # (a growing loss after a refutation: told only)
    assert told["restored"] is False and "outside the state and the LR" in told["reason"] and not ctx.skip
    assert model.weight.eq(25.0).all()


def test_the_lr_climbs_back_while_the_loss_holds_and_halts_for_good_where_it_rises():
    ctx, told = _climb(lambda step, scale: 1.0 + 0.01 * (step % 3))  # noise, no rise: back to 1
    assert [(s, sorted(f)) for s, f, _ in told] == [
        (20, ["new_scale", "old_scale", "recovering", "steps"]),
        (40, ["new_scale", "old_scale", "recovered"]),
    ]
    assert ctx.lr_scale == 1.0 and not ctx.lr_permanent
    # the loss rises with the LR once the scale passes 0.5 (the last 5 before the climb: 0.2)
    ctx, told = _climb(lambda step, scale: 3.0 if scale > 0.5 else 1.0)
    step, halt, scale = told[-1]
    assert halt["halted"] and halt["permanent"] and halt["rise"] == pytest.approx(3.0)
    assert halt["new_scale"] == pytest.approx(0.2) and halt["old_scale"] > 0.5 and scale == pytest.approx(0.2)
    assert 20 < step < 40 and ctx.lr_permanent and ctx.lr_scale == pytest.approx(0.2)
    assert [f for _, f, _ in _climb(lambda step, scale: 3.0 if scale > 0.5 else 1.0, steps=80)[1]][-1] == halt
    # a rise of the loss among the last halt_window values is not yet the median's
    ctx, told = _climb(lambda step, scale: 3.0 if step in (25, 26) else 1.0)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    # halt_rise 0: the climb is never halted; without a loss it is not judged
    ctx, told = _climb(lambda step, scale: 3.0 if scale > 0.5 else 1.0, halt_rise=0)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    ctx, told = _climb(lambda step, scale: None)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    with pytest.raises(ConfigError, match="halt_rise"):
        A.ActionsConfig.from_dict({"lr_drop": {"halt_rise": 1.0}})


def _warm_up(losses_at, steps=80, drop_at=None, setup=None):
    """relax_lr after a warm-up's drop at step 0 (warmup_scale 0.05, warmup_steps 10, halt_window
    5): the facts of each step, and an ordinary drop at ``drop_at``."""
    ctx = ctx_for(Tri())
    ctx.config.lr_drop.warmup_scale, ctx.config.lr_drop.warmup_steps, ctx.config.lr_drop.halt_window = 0.05, 10, 5
    if setup is not None:
        setup(ctx)
    A.apply(ctx, D("lr_drop", kind="update_ratio_spike", first_update=True))
    out = []
    for step in range(1, steps):
        ctx.step = step
        if step == drop_at:
            out.append((step, A.apply(ctx, D("lr_drop", kind="update_ratio_spike")), ctx.lr_scale))
        out.append((step, A.relax_lr(ctx, losses_at(step, ctx.lr_scale)), ctx.lr_scale))
    return ctx, [(step, facts, scale) for step, facts, scale in out if facts]


def test_the_lr_a_warm_up_gives_back_is_watched_warmup_steps_more():
    """A warm-up hands back an LR never seen healthy: for ``warmup_steps`` after its climb reaches
    1 the climb's halt still watches the loss (and a drop makes the cut permanent); after that, and
    after an ordinary drop's climb (an LR the run was healthy at), nothing does."""
    ctx, told = _warm_up(lambda step, scale: 1.0 + 0.01 * (step % 3))  # no rise: back to 1, watched, released
    assert [(s, sorted(f)) for s, f, _ in told] == [
        (1, ["new_scale", "old_scale", "recovering", "steps"]),
        (10, ["new_scale", "old_scale", "recovered"]),
    ]
    assert ctx.lr_proving_until is None and ctx.lr_scale == 1.0
    # the loss rises at the full LR, 5 steps after the climb: halted for good, where it was lowest
    ctx, told = _warm_up(lambda step, scale: 3.0 if step >= 15 else 1.0)
    step, halt, scale = told[-1]
    assert halt["halted"] and halt["after_climb"] and halt["permanent"] and 15 < step <= 20
    assert scale == pytest.approx(halt["new_scale"]) and scale < 1 and ctx.lr_permanent
    # ... 15 steps after it (the watch is over): nothing
    ctx, told = _warm_up(lambda step, scale: 3.0 if step >= 25 else 1.0)
    assert told[-1][0] == 10 and told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    # an ordinary drop's climb back to an LR the run was healthy at is not watched after it
    ctx, told = _climb(lambda step, scale: 3.0 if step >= 45 else 1.0, steps=80)
    assert told[-1][0] == 40 and told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    # a drop while the warm-up's LR is watched: permanent; after the watch: a transient's
    ctx, told = _warm_up(lambda step, scale: 1.0, drop_at=15)
    assert told[-1][1]["permanent"] and ctx.lr_permanent and ctx.lr_scale == pytest.approx(0.2)
    ctx, told = _warm_up(lambda step, scale: 1.0, drop_at=25)
    assert not told[-1][1]["permanent"] and told[-1][1]["recovers_from_step"] == 125


def test_a_warm_up_halts_where_the_loss_stalls_as_its_lr_rises():
    """The warm-up climbs to an LR never seen healthy. Where it is too high for the problem the loss
    may stop falling and turn up short of ``halt_rise`` x (a cross-entropy back near chance, 1.2x
    its lowest median): no lower median for ``halt_stall`` steps while the LR rose to 2x the scale
    of the lowest one, the median now ``halt_stall_rise`` x it, halts the climb for good, at that
    scale. A flat plateau and a loss that keeps falling climb to 1; an ordinary drop's climb (back
    to an LR the run was healthy at) is not judged by a stall."""

    def stalling(step, scale):  # falls while the scale is under 0.2, then back up 1.2x, noisy
        return (1.0 - 0.03 * step if scale < 0.2 else 0.7) + 0.01 * (step % 3)

    ctx = None

    def warm(losses_at, stall=8, climb=10):
        nonlocal ctx

        def setup(c):
            c.config.lr_drop.halt_stall, c.config.lr_drop.warmup_steps = stall, climb

        ctx, told = _warm_up(losses_at, setup=setup)
        return told

    told = warm(stalling, climb=30)
    step, halt, scale = told[-1]
    assert halt["halted"] and halt["stalled"] and halt["permanent"]
    assert halt["rise"] < 1.5 and halt["lowest_at"] + 8 <= step and scale == pytest.approx(halt["new_scale"])
    assert scale < 0.2 and ctx.lr_permanent
    # a plateau is no stall: its lowest median is one of its dips, and its median swings about it
    # (an LSTM language model under SGD at 20: flat at 2.93-2.99 for 70 steps, 1.031x its lowest
    # at one step, was halted for good at 0.2x), but never rises halt_stall_rise over its level
    # halt_stall steps before
    dips = [0.95, 0.95, 0.95, 1.0, 1.0, 1.0, 1.0, 1.0]  # a median of 5 swings 0.95-1.0 (1.053x)
    told = warm(lambda step, scale: 2.0 - step / 3 if step < 4 else dips[step % 8], climb=30)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0

    # a loss on a plateau from the warm-up's start: its median creeps 1.06x, but the climb never
    # brought it down (its lowest median is not halt_stall_progress under its first): no stall.
    # The climb is what gets such a run off its plateau (a small-init MLP under SGD at 0.2 was
    # halted for good at 0.05x its LR there: held-out 0.48-0.58, bare 0.09-0.13)
    told = warm(lambda step, scale: (1.0 if scale < 0.2 else 1.06) + 0.01 * (step % 3), climb=30)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0

    # halt_stall 0: off, climbs back to 1 (then a rise of 1.2x is no halt either)
    told = warm(stalling, stall=0, climb=30)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    # a loss that keeps falling as the LR rises: back to 1, watched, nothing more
    told = warm(lambda step, scale: 1.0 / step)
    assert [sorted(f) for _, f, _ in told][-1] == ["new_scale", "old_scale", "recovered"] and ctx.lr_scale == 1.0
    # a median lowest at the full LR (its window's scale 1: the LR cannot have doubled since),
    # 1.1x it after: neither a stall nor a rise of halt_rise
    told = warm(lambda step, scale: 1.0 / step if step <= 25 else 1.1 / 23, climb=20)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0
    with pytest.raises(ConfigError, match="halt_stall_rise"):
        A.ActionsConfig.from_dict({"lr_drop": {"halt_stall_rise": 1.0}})
    # an ordinary drop's climb with the same stall: not halted
    ctx, told = _climb(lambda step, scale: 1.0 if scale < 0.5 else 1.2, steps=80)
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0


def test_the_lr_a_warm_ups_halt_left_is_watched_and_lowered_again_where_the_loss_keeps_rising():
    """A warm-up's halt takes the LR back to the scale of the lowest median, itself an LR first
    seen in the climb. Where the loss keeps rising under it (SGD with momentum just past its edge:
    a linear regression at 0.3 rose from 0.2 to 0.66 over 80 steps at the halted 0.55x), the watch
    goes on ``warmup_steps`` more: a median ``halt_rise`` x the one at the halt (a fresh window of
    losses after it) lowers the LR by ``factor`` again, for good, and watches on. A loss that falls
    back after the halt, and an ordinary drop's halted climb, are left as they are."""

    def still_too_high(step, scale):  # rises at the full LR; still rises at the halted scale
        return 1.0 if step < 12 else (2.0 if step < 18 else (5.0 if scale > 0.02 else 1.0))

    ctx, told = _warm_up(still_too_high)
    halts = [(s, f) for s, f, _ in told if f.get("halted")]
    assert len(halts) == 2 and halts[0][1]["after_climb"] and not halts[0][1].get("again")
    (first, halt), (second, again) = halts
    assert again["again"] and again["permanent"] and second <= first + 10
    assert again["old_scale"] == pytest.approx(halt["new_scale"])
    assert again["new_scale"] == pytest.approx(halt["new_scale"] * 0.2) and ctx.lr_scale == again["new_scale"]
    assert again["rise"] == pytest.approx(2.5) and again["lowest_loss_median"] == pytest.approx(2.0)
    assert ctx.lr_permanent and ctx.lr_halt_watch is None  # (watched warmup_steps after it, then done)
    # ... and the LR the second cut left is watched as long again
    ctx, told = _warm_up(
        lambda step, scale: still_too_high(step, scale) if step < 26 else (12.5 if scale > 2e-3 else 1)
    )
    cuts = [f["new_scale"] for _, f, _ in told if f.get("again")]
    assert cuts == [pytest.approx(0.01), pytest.approx(0.002)] and ctx.lr_scale == pytest.approx(0.002)


def test_each_halt_is_told_with_its_cause():
    """A halt's event says what the loss did (a rise, a warm-up's stall, a rise at the LR a
    halt left) and where the LR stays, from the halt's facts."""
    cfg = A.LRDropConfig()
    base = {"rise": 1.6, "signed": False, "new_scale": 0.2, "lowest_loss_median": 0.5, "lowest_at": 40}
    rose = A.halt_message({**base, "stalled": False, "after_climb": False}, cfg)
    assert rose.startswith("the loss rose 1.6x (median of the last 20 steps) while the LR climbed back")
    assert "stays at 0.2x" in rose
    stalled = A.halt_message({**base, "rise": 1.04, "stalled": True, "after_climb": True}, cfg)
    assert "stalled: the median of the last 20 steps has not fallen below 0.5 since step 40" in stalled
    assert "after a warm-up gave the LR back" in stalled
    again = A.halt_message({**base, "again": True, "stalled": False, "after_climb": True}, cfg)
    assert "over its median at the halt at step 40" in again and "goes down to 0.2x" in again
    assert "by -0.3" in A.halt_message(
        {**base, "rise": -0.3, "signed": True, "stalled": False, "after_climb": False}, cfg
    )


def test_the_watch_after_a_warm_ups_halt_survives_a_checkpoint(tmp_path):
    """The watch after a warm-up's halt (its end and the median at the halt) is in the monitor's
    state: a monitor that loads it mid-watch cuts the LR where the uninterrupted one does."""
    import sfmonitor

    def still_too_high(step, scale):
        return 1.0 if step < 12 else (2.0 if step < 18 else (5.0 if scale > 0.02 else 1.0))

    ctx, told = _warm_up(still_too_high, steps=16)  # halted at step 14, watched
    assert ctx.lr_halt_watch is not None and ctx.lr_permanent
    model = nn.Linear(2, 1)
    mon = sfmonitor.attach(model, torch.optim.SGD(model.parameters(), lr=1e-3), run_dir=str(tmp_path / "a"))
    names = ("lr_scale", "lr_permanent", "lr_ceiling", "lr_climb", "lr_halt_watch", "losses_seen", "loss_signed")
    for name in names:
        setattr(mon._live(), name, getattr(ctx, name))
    state = mon.state_dict()
    mon.detach()
    other = sfmonitor.attach(model, torch.optim.SGD(model.parameters(), lr=1e-3), run_dir=str(tmp_path / "b"))
    other.load_state_dict(state)
    again = other._live()  # (the same user's LR, 1e-3: the ceiling is an LR, not a scale)
    assert all(getattr(again, name) == getattr(ctx, name) for name in names)
    again.config.lr_drop.warmup_steps, again.config.lr_drop.halt_window = 10, 5
    both = []
    for step in range(16, 30):
        ctx.step = again.step = step
        both.append(
            (
                A.relax_lr(ctx, still_too_high(step, ctx.lr_scale)),
                A.relax_lr(again, still_too_high(step, again.lr_scale)),
            )
        )
    assert any(a.get("again") for a, _ in both) and all(a == b for a, b in both)
    other.detach()
    # the loss falls back after the halt: the halted LR stays, the watch ends
    ctx, told = _warm_up(lambda step, scale: 2.0 if 12 <= step < 18 else 1.0)
    assert [f.get("again") for _, f, _ in told if f.get("halted")] == [None]
    assert ctx.lr_halt_watch is None and ctx.lr_permanent
    # an ordinary drop's climb, halted, is not watched after
    ctx, told = _climb(lambda step, scale: 3.0 if scale > 0.5 or step > 35 else 1.0, steps=80)
    assert [s for s, f, _ in told if f.get("halted")] == [told[-1][0]] and ctx.lr_halt_watch is None


def test_a_climb_halts_on_a_loss_below_zero_by_the_progress_it_gives_back():
    """A loss seen below zero (a Gaussian NLL) has no ratio to rise by: while the LR climbs back,
    its median must rise past ``halt_rise - 1`` times the progress made from its start. A constant
    added to such a loss changes no gradient, so it must not change the halt either."""
    # start 1.0, lowest -1.0: 2.0 of progress; a rise to 0.5 gives back 1.5 (> 0.5 x 2.0): halted
    rising = lambda step, scale: 1.0 if step < 3 else (0.5 if scale > 0.5 else -1.0)
    ctx, told = _climb(rising)
    step, halt, scale = told[-1]
    assert halt.get("halted") and halt["permanent"] and 20 < step < 40 and scale == pytest.approx(0.2)
    assert halt["loss_median"] == pytest.approx(0.5) and halt["lowest_loss_median"] == pytest.approx(-1.0)
    # the same climb shifted by -5 (every loss below zero): the same halt, at the same step
    shifted = [(s, f) for s, f, _ in _climb(lambda step, scale: rising(step, scale) - 5.0)[1]]
    assert [s for s, _ in shifted] == [s for s, _, _ in told] and shifted[-1][1].get("halted")
    # a rise within the progress's noise (to -0.5: gives back a quarter) is not halted
    ctx, told = _climb(lambda step, scale: 1.0 if step < 3 else (-0.5 if scale > 0.5 else -1.0))
    assert told[-1][1].get("recovered") and ctx.lr_scale == 1.0


def test_lr_scale_cooperates_with_a_scheduler():
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = []
    for _step in range(3):
        saved = A.apply_lr_scale(opt, 0.2)
        seen.append(opt.param_groups[0]["lr"])  # what optimizer.step uses
        opt.step()
        A.restore_lr(opt, saved)
        sched.step()
    assert seen == pytest.approx([0.2, 0.1, 0.05])


# ---------------------------------------------------------------------------- checkpoint / stop


def test_emergency_checkpoint_atomic_loadable_pruned(tmp_path):
    m = Tri()
    ctx = ctx_for(m, run_dir=tmp_path, loss_weights={"vision": 0.4}, monitor_state=lambda: {"step": 7, "w": [1.0]})
    ctx.config.checkpoint.keep = 2
    paths = []
    for step in (5, 6, 7):
        ctx.step = step
        facts = A.apply(ctx, D("checkpoint", kind="nonfinite_grad"))
        assert facts["saved"] and facts["source"] == "live"
        paths.append(facts["path"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "emergency-step00000006.pt",
        "emergency-step00000007.pt",
    ]
    state = load_checkpoint(paths[-1])
    assert state["extra"]["step"] == 7 and state["extra"]["monitor"] == {"step": 7, "w": [1.0]}
    assert torch.equal(state["model"]["fusion.weight"], m.fusion.weight.detach())
    assert A.apply(ctx_for(m), D("checkpoint"))["saved"] is False  # no run_dir


def test_checkpoint_after_landed_update_saves_snapshot_from_before(tmp_path):
    m = Tri()
    ctx = ctx_for(m, run_dir=tmp_path, snapshots=SnapshotRing(every=5, keep=3), step=12)
    ctx.snapshots.take(10, m, ctx.optimizer)
    w10 = m.fusion.weight.detach().clone()
    with torch.no_grad():
        m.fusion.weight.mul_(1000)  # the update of step 11 exploded
    facts = A.apply(ctx, D("checkpoint", kind="update_ratio_spike", before_update=False, step=11))
    assert facts["source"] == "snapshot@10"
    assert torch.equal(load_checkpoint(facts["path"])["model"]["fusion.weight"], w10)


def test_stop_saves_then_raises_and_plateau_is_graceful(tmp_path):
    ctx = ctx_for(Tri(), run_dir=tmp_path, step=40)
    with pytest.raises(StopTraining, match="rescue budget of 3 spent") as e:
        A.apply(ctx, D("stop", kind="update_ratio_spike", params={"reason": "rescue budget of 3 spent"}))
    assert ctx.should_stop and e.value.facts["checkpoint"]["saved"]
    assert str(tmp_path) in str(e.value)
    load_checkpoint(e.value.facts["checkpoint"]["path"])
    ctx2 = ctx_for(Tri(), run_dir=tmp_path, step=50)
    A.apply(ctx2, D("checkpoint"))
    facts = A.apply(ctx2, D("stop", kind="plateau"))  # no raise, no second checkpoint this step
    assert facts["graceful"] and ctx2.should_stop
    assert len(list((tmp_path / "checkpoints").glob("*step00000050.pt"))) == 1


# ---------------------------------------------------------------------------- rollback


def adam_run(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def state_of(model, opt):
    return [t.clone() for t in model.state_dict().values()] + [
        v.clone() for s in opt.state.values() for v in s.values()
    ]


def test_rollback_bit_exact_including_adam_state():
    torch.manual_seed(0)
    m = Tri()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ctx = ctx_for(m, opt, snapshots=SnapshotRing(every=10, keep=2))
    adam_run(m, opt, 10, seed=1)
    ctx.snapshots.maybe_take(10, m, opt)  # label 10: the state step 10 starts from
    good = state_of(m, opt)
    adam_run(m, opt, 5, seed=2)
    ctx.snapshots.maybe_take(15, m, opt)  # only 5 steps after the last one: not taken
    ctx.step = 15
    facts = A.apply(ctx, D("rollback", kind="nonfinite_grad"))
    assert facts == {"restored": True, "restored_from": 10, "steps_back": 5, "skipped_step": 15, "batches_to_skip": 4}
    assert ctx.skip and ctx.batches_to_skip == 4
    now = state_of(m, opt)
    assert all(torch.equal(a, b) for a, b in zip(now, good)) and len(now) == len(good)
    assert int(opt.state[m.fusion.weight]["step"]) == 10
    # continuing from the restored state matches continuing from the original state
    adam_run(m, opt, 3, seed=3)
    ref_m = Tri()
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    ref_m.load_state_dict(ctx.snapshots.latest_before(10)[1]["model"])
    ref_opt.load_state_dict(ctx.snapshots.latest_before(10)[1]["optimizer"])
    adam_run(ref_m, ref_opt, 3, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(state_of(m, opt), state_of(ref_m, ref_opt)))


def test_rollback_target_and_missing_snapshot():
    m = Tri()
    ctx = ctx_for(m, snapshots=SnapshotRing(every=1, keep=5))
    for label in (8, 9, 10):
        ctx.snapshots.take(label, m, ctx.optimizer)
    ctx.step = 10
    # a finding in step 10 (before its update): the state step 10 starts from is suspect -> label 9
    assert A.apply(ctx, D("rollback", kind="loss_spike"))["restored_from"] == 9
    assert ctx.snapshots.labels == [8, 9]
    # a landed update of step 8 -> the snapshot labelled 8 predates it
    ctx.step = 10
    assert A.apply(ctx, D("rollback", kind="update_ratio_spike", before_update=False, step=8))["restored_from"] == 8
    ctx2 = ctx_for(Tri(), snapshots=SnapshotRing(), step=3)
    facts = A.apply(ctx2, D("rollback"))
    assert facts["restored"] is False and "no snapshot" in facts["reason"] and ctx2.skip


# ---------------------------------------------------------------------------- precision fallback


def test_precision_fallback_runs_module_in_fp32_and_is_removable():
    m = Tri()
    ctx = ctx_for(m)
    x = torch.randn(2, 4)

    def fusion_dtype():
        seen = {}
        h = m.fusion.register_forward_hook(lambda mod, i, o: seen.update(d=(i[0].dtype, o.dtype)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)
        h.remove()
        return seen["d"]

    assert fusion_dtype() == (torch.bfloat16, torch.bfloat16)
    facts = A.apply(ctx, D("precision_fallback", kind="activation_overflow"))  # where == ""
    assert facts["applied"] is False and "names no module" in facts["reason"]
    facts = A.apply(ctx, D("precision_fallback", params={"module": "attn"}))
    assert facts["applied"] is False and "no module named 'attn'" in facts["reason"]
    facts = A.apply(ctx, D("precision_fallback", params={"module": "fusion"}))
    assert facts == {"applied": True, "module": "fusion"}
    # inside: fp32 inputs; outside: the output is cast back to what the caller's autocast expects
    assert fusion_dtype() == (torch.float32, torch.bfloat16)
    assert A.apply(ctx, D("precision_fallback", params={"module": "fusion"}))["applied"] is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast is back on after the module
        seen = {}
        h = m.vision.register_forward_hook(lambda mod, i, o: seen.update(d=o.dtype))
        m(x)
        h.remove()
    assert seen["d"] == torch.bfloat16
    A.remove_precision_fallback(ctx)
    assert fusion_dtype() == (torch.bfloat16, torch.bfloat16) and ctx.fp32_modules == []


# ---------------------------------------------------------------------------- grad noise


def test_grad_noise_std_formula_and_determinism():
    assert A.grad_noise_std(0) == pytest.approx(0.3)
    assert A.grad_noise_std(2) == pytest.approx(0.3 / 3**0.55)
    lin = nn.Linear(400, 500)
    ctx = A.ActionContext(model=lin, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1), epoch=2)
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    facts = A.apply(ctx, D("grad_noise"))
    assert facts["std"] == pytest.approx(0.3 / 3**0.55) and facts["tensors"] == 2
    assert lin.weight.grad.std().item() == pytest.approx(facts["std"], rel=0.01)
    first = lin.weight.grad.clone()
    ctx2 = A.ActionContext(model=lin, optimizer=ctx.optimizer, epoch=2)
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    rng_before = torch.get_rng_state()
    A.apply(ctx2, D("grad_noise"))
    assert torch.equal(lin.weight.grad, first)  # seeded generator
    assert torch.equal(torch.get_rng_state(), rng_before)  # training RNG untouched


# ---------------------------------------------------------------------------- loss scale floor


def test_keep_loss_scale_floor():
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    assert A.keep_loss_scale_floor(scaler, 512) is False  # not used yet
    m = nn.Linear(2, 1)
    scaler.scale(m(torch.ones(1, 2)).sum())  # initialises the scale tensor
    assert A.keep_loss_scale_floor(scaler, 512) is True
    assert scaler.get_scale() == 512.0
    scaler.update(2048.0)
    A.keep_loss_scale_floor(scaler, 512)
    assert scaler.get_scale() == 2048.0  # above the floor: untouched
    assert A.keep_loss_scale_floor(None, 512) is False


def test_actions_config_defaults_and_yaml_keys():
    cfg = A.ActionsConfig()
    assert cfg.clip.agc_lambda == 0.01 and cfg.lr_drop.factor == 0.2 and cfg.grad_noise.eta == 0.3
    assert cfg.rollback.snapshot_every <= 50 and cfg.loss_scale.min_loss_scale == 512
    with pytest.raises(ConfigError, match="rollback.snapshot_every"):
        A.ActionsConfig.from_dict({"rollback": {"snapshot_every": 0}})
    assert A.ActionsConfig.from_dict(cfg.to_dict()) == cfg


def test_global_clip_of_fp16_gradients_whose_norm_exceeds_fp16():
    w = nn.Parameter(torch.zeros(4, 4, dtype=torch.float16))
    w.grad = torch.full((4, 4), 60000.0, dtype=torch.float16)  # finite values, norm 240000
    before, after, _ = A.clip_gradients({"all": [w]}, A.ClipConfig(mode="global", max_grad_norm=1.0))
    assert float(before["all"]) == pytest.approx(240000.0, rel=1e-3)  # not inf
    assert float(after["all"]) == pytest.approx(1.0, rel=1e-2)  # scaled, not zeroed


def test_a_rank_that_does_not_write_says_so_in_its_checkpoint_facts(monkeypatch):
    """Under torch.distributed only rank 0 writes (DDP): the other ranks' events say that, not
    that the monitor has no run_dir."""
    m = Tri()
    assert "no run_dir" in A.apply(ctx_for(m), D("checkpoint"))["reason"]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    facts = A.apply(ctx_for(m), D("checkpoint"))
    assert facts["saved"] is False and facts["reason"].startswith("rank 1 does not write")


@pytest.mark.parametrize("signed", [False, True])
def test_the_lr_climbs_watch_survives_a_checkpoint(tmp_path, signed):
    """Mid-climb, the monitor's state holds the losses and scales the halt compares, and the
    lowest median (and, for a loss below zero, its start): a monitor that loads it halts where the
    uninterrupted one would."""
    import sfmonitor

    if signed:
        rising = lambda step, scale: 1.0 if step < 3 else (0.5 if scale > 0.5 else -1.0)
    else:
        rising = lambda step, scale: 3.0 if scale > 0.5 else 1.0
    ctx, told = _climb(rising, steps=30)  # stopped mid-climb: not halted yet
    assert not any(f.get("halted") for _, f, _ in told) and ctx.lr_climb and ctx.lr_climb_best
    model = nn.Linear(2, 1)
    cfg = {"console": False}
    mon = sfmonitor.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=str(tmp_path / "a"), config=cfg)
    live = mon._live()
    names = (
        "lr_scale",
        "lr_dropped_at",
        "lr_drop_kind",
        "lr_climb",
        "lr_climb_best",
        "lr_climb_best_at",
        "lr_climb_first",
        "losses_seen",
        "lr_trial",
    )
    names = (*names, "loss_signed")
    saved = A._drop_fields(ctx)  # (a refuted trial: kept until the loss is back under its level)
    ctx.lr_trial = {"at": 2, "before": 9.0, "losses": [0.5, 1.0], "permanent": False, "kind": "x", "saved": saved}
    ctx.lr_trial["refuted"] = True
    for name in names:
        setattr(live, name, getattr(ctx, name))
    state = mon.state_dict()
    mon.detach()
    other = sfmonitor.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=str(tmp_path / "b"), config=cfg
    )
    other.load_state_dict(state)
    again = other._live()
    assert all(getattr(again, name) == getattr(ctx, name) for name in names[3:])
    assert again.loss_signed is signed
    again.config.lr_drop.recover_after, again.config.lr_drop.recover_steps = 20, 20
    again.config.lr_drop.halt_window = ctx.config.lr_drop.halt_window
    halted = []
    for step in range(30, 40):
        ctx.step = again.step = step
        halted.append((A.relax_lr(ctx, rising(step, ctx.lr_scale)), A.relax_lr(again, rising(step, again.lr_scale))))
    assert any(a.get("halted") for a, _ in halted) and all(a == b for a, b in halted)
    other.detach()


def test_a_drop_is_sized_to_the_rise_the_users_lr_still_has_and_never_cut_below_its_level():
    """``lr_rise`` (the user's LR now over its level before, in every group) sizes the drop when it
    is more than 1 / factor: the LR goes back to that level. A rise already gone by the time of the
    drop (a schedule bug of 2-3 steps, set back) sizes nothing: a fifth, as any drop (a helper's
    probe: sized by the update's LR, such drops cut a normal LR 300-1000x for the rest of the run).
    As the user's LR falls the scale rises so the LR stays at the level set, and the drop is
    released when the user's LR is there."""
    opt = torch.optim.SGD(Tri().parameters(), lr=0.3)
    ctx = ctx_for(Tri(), opt)
    facts = A.apply(ctx, D("lr_drop", kind="update_ratio_spike", lr_rise=300.0))
    assert facts["lr_rise"] == 300.0 and ctx.lr_scale == pytest.approx(1 / 300)
    assert ctx.lr_ceiling == [pytest.approx(0.001)]
    opt.param_groups[0]["lr"] = 0.1  # the schedule falls: the LR stays at 0.001, not 0.1/300
    assert A.relax_lr(ctx) == {} and ctx.lr_scale == pytest.approx(0.01)
    opt.param_groups[0]["lr"] = 0.001  # back to the level before: released
    released = A.relax_lr(ctx)
    assert released["released"] and ctx.lr_scale == 1.0 and ctx.lr_ceiling is None
    ctx = ctx_for(Tri(), torch.optim.SGD(Tri().parameters(), lr=0.3))
    facts = A.apply(ctx, D("lr_drop", kind="update_ratio_spike", lr_rise=1.0))  # the rise is gone
    assert "lr_rise" not in facts and ctx.lr_scale == pytest.approx(0.2)


def test_a_permanent_cut_is_a_cap_at_its_level_both_ways():
    """A cut the trouble made permanent is not released by a schedule that falls under it: a
    warm restart that takes the user's LR back up is held at the level (the helper's probe: a
    release cleared the permanent cut, and a later restart ran at full LR)."""
    opt = torch.optim.SGD(Tri().parameters(), lr=0.1)
    ctx = ctx_for(Tri(), opt)
    A.apply(ctx, D("lr_drop", kind="update_ratio_spike"))
    A.apply(ctx, D("lr_drop", kind="update_ratio_spike"))  # a second before the first is back
    assert ctx.lr_permanent and ctx.lr_scale == pytest.approx(0.04)
    assert ctx.lr_ceiling == [pytest.approx(0.1 * 0.04)]
    opt.param_groups[0]["lr"] = 0.001  # under the cap: untouched
    A.relax_lr(ctx)
    assert ctx.lr_scale == 1.0 and ctx.lr_permanent
    opt.param_groups[0]["lr"] = 0.1  # a restart: held at the cap
    A.relax_lr(ctx)
    assert ctx.lr_scale == pytest.approx(0.04) and ctx.lr_permanent
