"""Rescues that meet: a bad update undone in a step whose forward the activation watch sampled, a
bad batch at the very first step, several non-finite losses in a row from the data. In each the
run must end as its twin that never saw the bad step, bit for bit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from _state import quiet, train
from torch import nn
from torch.nn import functional as F

import sfmonitor


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class Attn(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.ln(self.inp(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1))


def attn_batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(16, 12, 8, generator=g)
    return x, (x.sum((1, 2)) > 0).long()


def _attn_run(tmp_path, monitored, spike_at=None, omit=None, n=30):
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    order = [i for i in range(n) if i != omit]

    def loss_of(i):
        x, y = attn_batch(i)
        return F.cross_entropy(model(x), y)

    return model, train(tmp_path, model, opt, monitored, order, loss_of, lr_spike_at=spike_at)


def test_an_undo_voids_what_the_watch_saw_in_the_forward_of_the_state_it_leaves(tmp_path):
    """The update of step 9 lands at 1e4 x the LR; step 10's forward, sampled by the watch (stride
    10), shows attention logits ~1e6 from those weights. The undo puts the weights back; a QK-Clip
    of the restored weights (and a module held for 50 steps after it) would answer a state that
    no longer exists."""
    model, events = _attn_run(tmp_path / "m", True, spike_at=9)
    twin, _ = _attn_run(tmp_path / "t", False, omit=9)
    undos = [e for e in events if "undo" in e.actions]
    assert len(undos) == 1 and undos[0].step == 9  # the step whose update it undid
    assert not [e for e in events if "qk_clip" in e.actions], [(e.step, e.kind) for e in events if e.actions]
    assert same(model, twin)
    seen = [e for e in events if e.kind == "attention_logit_growth"]
    # The finding stays in the log, saying what answered it.
    assert seen and all(e.data.get("answered_by") == "undo" for e in seen)


class BNNet(nn.Sequential):
    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)
        )


def bn_batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def _bn_run(tmp_path, monitored, fault=None, at=None, omit=None, n=12):
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    order = [i for i in range(n) if i != omit]

    def loss_of(i):
        x, y = bn_batch(i)
        if fault == "nan" and i == at:
            x = torch.full_like(x, float("nan"))
        return F.cross_entropy(model(x), y)

    train(tmp_path, model, opt, monitored, order, loss_of, lr_spike_at=at if fault == "lr" else None)
    return model


def test_a_bad_batch_at_the_first_step_leaves_no_trace_in_batchnorm_statistics(tmp_path):
    model = _bn_run(tmp_path / "m", True, "nan", 0)
    twin = _bn_run(tmp_path / "t", False, omit=0)
    assert torch.isfinite(model[1].running_mean).all() and torch.isfinite(model[1].running_var).all()
    assert same(model, twin)


def test_an_undone_first_update_leaves_no_trace_in_batchnorm_statistics(tmp_path):
    model = _bn_run(tmp_path / "m", True, "lr", 0)
    twin = _bn_run(tmp_path / "t", False, omit=0)
    assert same(model, twin)


V = 40


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 24)
        self.lstm = nn.LSTM(24, 48, batch_first=True)
        self.head = nn.Linear(48, V)

    def forward(self, x):
        return self.head(self.lstm(self.emb(x))[0])


def lm_batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    s = (torch.randint(0, V, (8, 1), generator=g) + torch.randint(1, 4, (8, 1), generator=g) * torch.arange(17)) % V
    return s[:, :-1], s[:, 1:]


def _lm_run(tmp_path, monitored, bad=(), omit=(), n=45):
    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    order = [i for i in range(n) if i not in omit]

    def loss_of(i):
        x, y = lm_batch(i)
        if i in bad:  # a padding-only batch: every target ignored, the mean loss is 0/0
            y = torch.full_like(y, -100)
        return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), ignore_index=-100)

    return model, train(tmp_path, model, opt, monitored, order, loss_of)


def test_non_finite_losses_in_a_row_from_a_healthy_state_are_skipped_not_rolled_back(tmp_path):
    """Three padding-only batches in a row: each loss is NaN, the weights and the steps before
    are healthy. Skipping them is the whole answer; a rollback to an old snapshot and an LR cut
    would throw away progress that was never damaged."""
    bad = {30, 31, 32}
    model, events = _lm_run(tmp_path / "m", True, bad=bad)
    twin, _ = _lm_run(tmp_path / "t", False, omit=bad)
    acted = sorted({a for e in events for a in e.actions})
    assert acted == ["skip_step"], [(e.step, e.kind, e.actions) for e in events if e.actions]
    assert same(model, twin)


def _closure_run(tmp_path, monitored, bad=(), omit=(), optimizer="sgd", n=20):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = (
        torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=1e-2)
    )
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet()) if monitored else None
    norms, returned = [], []
    for i in [i for i in range(n) if i not in omit]:
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 1, generator=g)
        if i in bad:
            x[0, 0] = float("nan")

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            (mon.combine(loss) if mon else loss).backward()
            return loss

        returned.append(opt.step(closure) if i % 2 else opt.step(closure=closure))
        if mon and i not in bad:
            norms.append(
                (
                    mon.stats["grad_norm/total"],
                    torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item(),
                )
            )
    events = list(mon.events) if mon else []
    if mon:
        mon.detach()
    return model, events, norms, returned


def test_a_step_with_a_closure_is_measured_on_the_gradients_the_closure_made(tmp_path):
    """optimizer.step(closure): the closure computes the gradients inside the step. The monitor
    runs it first, then reads what it made (not the previous step's gradients), and hands the
    optimizer its loss: a healthy run is untouched, and a NaN batch is skipped like any other."""
    for opt_name in ("sgd", "adam"):
        model, events, norms, returned = _closure_run(tmp_path / f"h{opt_name}", True, optimizer=opt_name)
        bare, _, _, bare_returned = _closure_run(tmp_path / f"b{opt_name}", False, optimizer=opt_name)
        assert same(model, bare) and not events
        assert [float(r.detach()) for r in returned] == [float(r.detach()) for r in bare_returned]
        assert all(abs(a - b) <= 1e-5 * b for a, b in norms), norms[:3]
    model, events, _, _ = _closure_run(tmp_path / "m", True, bad={8})
    twin, _, _, _ = _closure_run(tmp_path / "t", False, omit={8})
    assert [(e.step, e.kind, e.actions) for e in events if e.actions] == [(8, "bad_batch", ["skip_step"])]
    assert same(model, twin)


def test_a_skipped_step_is_not_also_clipped(tmp_path):
    """A 1e4 x loss: the step is skipped. Its gradient spike needs no clip as well (the update
    does not land), and the gradients the loop sees after optimizer.step() are backward's own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet())
    for i in range(12):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 1, generator=g)
        loss = F.mse_loss(model(x), y) * (1e4 if i == 10 else 1.0)
        mon.combine(loss).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters())), i
        opt.zero_grad()
    mon.detach()
    at10 = {e.kind: e for e in mon.events if e.step == 10}
    assert at10["loss_spike"].actions == ["skip_step"]
    assert at10["grad_spike"].actions == [] and at10["grad_spike"].data["answered_by"] == "skip_step"


class TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, V)
        self.poison = False

    def forward(self, x):
        h = self.emb(x)
        if self.poison:  # the NaN appears inside the model, upstream of every watched module
            h = h * float("nan")
        return self.head(torch.relu(self.proj(h)))


def _token_run(tmp_path, monitored, bad=None, omit=None, n=14):
    torch.manual_seed(0)
    model = TokenNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    order = [i for i in range(n) if i != omit]

    def loss_of(i):
        x, y = lm_batch(i)
        model.poison = i == bad
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        return F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))

    return model, train(tmp_path, model, opt, monitored, order, loss_of)


def test_a_nan_that_arrives_with_a_modules_input_is_not_that_modules_overflow(tmp_path):
    """bf16 autocast, a NaN from the embedding on a step the watch samples (step 10): the first
    watched module it flows through did not make it, so no precision fallback (which would run
    that module in fp32 for good); the step is skipped and the run equals its twin."""
    model, events = _token_run(tmp_path / "m", True, bad=10)
    twin, _ = _token_run(tmp_path / "t", False, omit=10)
    acted = [(e.step, e.kind, e.actions) for e in events if e.actions]
    assert acted == [(10, "nonfinite_loss", ["skip_step"])], acted
    assert same(model, twin)


def test_an_emergency_checkpoint_decided_with_an_undo_holds_the_state_the_undo_restores(tmp_path):
    """A landed bad update answered by an emergency checkpoint and an undo in one step (as when
    the budget runs out): the checkpoint holds the state just before the bad update, which the
    undo copy holds exactly, not an older snapshot (snapshot_every 50: step 0)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ladder = {"update_ratio_spike": {"rungs": [{"after": 1, "actions": ["checkpoint", "undo"]}]}}
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), config=quiet(policy={"ladders": ladder}))
    before_bad = None
    for i in mon.batches(range(16)):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 1, generator=g)
        mon.combine(F.mse_loss(model(x), y)).backward()
        if i == 12 and before_bad is None:
            before_bad = {k: v.clone() for k, v in model.state_dict().items()}
            opt.param_groups[0]["lr"] *= 1e4
            opt.step()
            opt.param_groups[0]["lr"] /= 1e4
        else:
            opt.step()
        opt.zero_grad()
    mon.detach()
    (event,) = [e for e in mon.events if "checkpoint" in e.actions]
    saved = torch.load(event.data["action_results"]["checkpoint"]["path"], weights_only=True)
    assert saved["model"].keys() == before_bad.keys()
    assert all(torch.equal(saved["model"][k], before_bad[k]) for k in before_bad)


def _batch_loss(model, i):
    """The loss of batch ``i`` (seeded by ``i``): the model maps 6 inputs onto their first 3."""
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i))
    return (model(x) - x[:, :3]).pow(2).mean()


def _step(opt, spike=False):
    """One optimizer step, at 1e4x the LR of 1e-2 when ``spike`` (a landed bad update)."""
    if spike:
        opt.param_groups[0]["lr"] = 1e2
    opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    opt.zero_grad()


def _two_optimizer_run(tmp_path, monitored, spike_at=None, omit=(), n=24):
    """An encoder on Adam and a decoder on SGD, two optimizers over halves of one model; each
    monitor is given the whole model (attach(model, opt)), as a user would write it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    enc, dec = torch.optim.Adam(model[0].parameters(), lr=1e-2), torch.optim.SGD(model[2].parameters(), lr=0.1)
    mons = []
    if monitored:
        mons = [
            sfmonitor.attach(model, o, run_dir=str(tmp_path / name), sinks=[], config=quiet())
            for name, o in (("enc", enc), ("dec", dec))
        ]
    for i in range(n):
        if i in omit:
            continue
        loss = _batch_loss(model, i)
        loss.backward()
        if i == spike_at:  # both optimizers' LR: each monitor undoes its own update
            enc.param_groups[0]["lr"], dec.param_groups[0]["lr"] = 1e2, 1e3
        enc.step()
        dec.step()
        enc.param_groups[0]["lr"], dec.param_groups[0]["lr"] = 1e-2, 0.1
        enc.zero_grad()
        dec.zero_grad()
    for m in mons:
        m.detach()
    return model, [(e.step, e.kind, e.actions) for m in mons for e in m.events if e.actions]


def test_an_undo_puts_back_only_what_its_own_optimizer_updated(tmp_path):
    """Each monitor's copy held the whole model: the decoder's monitor, copying after the encoder's
    bad update, put that bad update back with its undo (a probe: a loss of 8.5e5 against 0.056, the
    rescue budget spent). An undo restores the parameters its optimizer updates, nothing else."""
    bare, acts = _two_optimizer_run(tmp_path / "bare", monitored=False)
    healthy, acts = _two_optimizer_run(tmp_path / "healthy", monitored=True)
    assert same(healthy, bare) and acts == []
    faulted, acts = _two_optimizer_run(tmp_path / "fault", monitored=True, spike_at=12)
    twin, _ = _two_optimizer_run(tmp_path / "twin", monitored=False, omit={12, 13})
    assert sorted(acts) == [(12, "update_ratio_spike", ["undo"])] * 2, acts
    assert same(faulted, twin)


def _unfreeze_run(tmp_path, monitored, spike_at=None, omit=(), n=30, unfreeze_at=15, undo=True):
    """A head trained first, the body unfrozen later with add_param_group (fine-tuning)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model[2].parameters(), lr=1e-2)
    mon = None
    if monitored:
        mon = sfmonitor.attach(
            model, opt, run_dir=str(tmp_path), sinks=[], config=quiet(actions={"undo": {"enabled": undo}})
        )
    for i in range(n):
        if i == unfreeze_at:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
        if i in omit:
            continue
        loss = _batch_loss(model, i)
        if mon is not None:
            loss = mon.combine(loss)
        loss.backward()
        _step(opt, i == spike_at)
    events = []
    if mon is not None:
        events = [(e.step, e.kind, e.actions, e.data.get("action_results")) for e in mon.events if e.actions]
        mon.detach()
    return model, opt, events


@pytest.mark.parametrize("undo", [True, False])
def test_a_bad_update_just_before_add_param_group_is_still_put_back(undo, tmp_path):
    """The update of step 14 lands at 1e4x the LR, the loop adds a param group at 15 (unfreezing
    the body), and the finding comes at 15: the undo copy, taken with one group, and every
    snapshot failed to load into two ("loaded state dict has a different number of parameter
    groups"): the weights went back, the optimizer state did not, step 15 landed, and the event
    said nothing changed. Now the rescue restores the groups it holds and leaves the new one, whose
    parameters were frozen then, as it is."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "action ... failed" is a RuntimeWarning
        model, opt, events = _unfreeze_run(tmp_path / "fault", monitored=True, spike_at=14, undo=undo)
    assert events, "the bad update is found"
    step, kind, actions, results = events[0]
    assert step in (14, 15) and actions in (["undo"], ["rollback", "lr_drop"], ["rollback"]), events
    assert all("error" not in str(r) for r in (results or {}).values()), results
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if undo:  # at most one step lost: the twin that never took steps 14 and 15
        twin, twin_opt, _ = _unfreeze_run(tmp_path / "twin", monitored=False, omit={14, 15})
        assert same(model, twin)


def _resume_run(tmp_path, monitored):
    """The update of step 14 lands at 1e4x the LR; the loop then resumes from its own checkpoint of
    step 10 (load_state_dict into the model and optimizer) before step 15's forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet()) if monitored else None
    saved = None
    for i in range(20):
        if i == 10:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        if i == 15:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        loss = _batch_loss(model, i)
        (mon.combine(loss) if mon is not None else loss).backward()
        _step(opt, i == 14)
    events = []
    if mon is not None:
        events = [e for e in mon.events if e.actions]
        mon.detach()
    return model, events


def test_an_undo_leaves_a_state_the_loop_loaded_after_the_bad_update(tmp_path):
    """The undo, found at step 15, put the monitor's copy from before step 14 back over the state
    the loop had just loaded (a probe: its resume silently discarded). The loaded state holds no
    trace of the bad update: nothing is undone, the event says why, and the run equals the bare
    loop's, which resumed the same way."""
    model, events = _resume_run(tmp_path / "mon", monitored=True)
    bare, _ = _resume_run(tmp_path / "bare", monitored=False)
    assert [e.kind for e in events] == ["update_ratio_spike"], events
    undo = events[0].data["action_results"]["undo"]
    assert undo["applied"] is False and "loaded the optimizer's state" in undo["reason"], undo
    assert same(model, bare)


def _ema_run(tmp_path, monitored, track=True, spike_at=None, omit=(), n=30):
    """torchvision's reference recipe in small: an EMA of the weights (AveragedModel) updated after
    every optimizer step the monitor kept."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    mon = None
    if monitored:
        mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet())
        if track:
            mon.track(ema)
    return ema, _derived_loop(model, opt, mon, lambda: ema.update_parameters(model), n, omit, spike_at)


def _derived_loop(model, opt, mon, derive, n, omit, spike_at):
    """Train ``n`` steps (leaving out those in ``omit``; the LR spiked at ``spike_at``), calling
    ``derive`` after every step the monitor kept; returns the acting events."""
    for i in range(n):
        if i in omit:
            continue
        loss = _batch_loss(model, i)
        (mon.combine(loss) if mon is not None else loss).backward()
        _step(opt, i == spike_at)
        if mon is None or not mon.last_step_skipped:
            derive()
    events = []
    if mon is not None:
        events = [(e.step, e.kind, e.actions) for e in mon.events if e.actions]
        mon.detach()
    return events


def test_an_undo_puts_back_a_tracked_ema_that_had_mixed_in_the_bad_update(tmp_path):
    """The bad update of step 14 is found at 15; the loop's EMA, updated after step 14, had mixed
    it in (a probe's torchvision-style EMA ended 5.4x its twin's loss while the model was 1.0x).
    Tracked, the undo puts the EMA back with the weights: bit-identical to the twin's EMA."""
    twin, _ = _ema_run(tmp_path / "twin", monitored=False, omit={14, 15})
    ema, events = _ema_run(tmp_path / "tracked", monitored=True, spike_at=14)
    assert events == [(14, "update_ratio_spike", ["undo"])]
    assert same(ema, twin)
    untracked, _ = _ema_run(tmp_path / "untracked", monitored=True, track=False, spike_at=14)
    gap = max((a - b).abs().max().item() for a, b in zip(untracked.parameters(), twin.parameters()))
    assert gap > 1.0, "without track() the EMA keeps the bad update (what the test guards against)"
    healthy, events = _ema_run(tmp_path / "healthy", monitored=True)
    bare, _ = _ema_run(tmp_path / "bare", monitored=False)
    assert events == [] and same(healthy, bare)


def test_a_rollback_and_the_emergency_checkpoint_hold_a_tracked_module(tmp_path):
    from torch.optim.swa_utils import AveragedModel

    from sfmonitor.checkpoint import load_checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = AveragedModel(model)
    cfg = quiet(actions={"undo": {"enabled": False}, "rollback": {"snapshot_every": 5}})
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=cfg).track(ema)
    assert mon.memory["buffer_bytes"] >= sum(p.numel() * 4 for p in ema.parameters())
    at_snapshot = None
    for i in range(9):
        mon.combine(_batch_loss(model, i)).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
        if mon.step == 5 and at_snapshot is None:  # the snapshot of step 5 is taken in step 5's before_update
            at_snapshot = copy.deepcopy(ema.state_dict())
    ctx = mon._live()
    label, _ = ctx.snapshots.latest_before(8)
    from sfmonitor.actions import checkpoint, rollback
    from sfmonitor.events import UPDATE_RATIO_SPIKE, Decision, Finding

    facts = checkpoint(ctx, Decision("checkpoint", Finding(UPDATE_RATIO_SPIKE, "t", step=mon.step - 1)))
    saved = load_checkpoint(facts["path"])
    assert facts["source"] == "live" and set(saved["extra"]["tracked"]) == {"tracked.0"}
    # a landed bad update: the checkpoint is the snapshot before it, with the snapshot's tracked state
    # (the checkpoint's own facts replaced the snapshot's extra: a helper's probe found it without it)
    landed = Finding(UPDATE_RATIO_SPIKE, "t", step=mon.step - 1, before_update=False)
    facts = checkpoint(ctx, Decision("checkpoint", landed))
    saved = load_checkpoint(facts["path"])
    assert facts["source"] == f"snapshot@{label}" and saved["extra"]["snapshot_step"] == label
    assert all(torch.equal(v, saved["extra"]["tracked"]["tracked.0"][k]) for k, v in at_snapshot.items())
    rollback(ctx, Decision("rollback", Finding(UPDATE_RATIO_SPIKE, "t", step=label)))
    snap_ema = ctx.snapshots.latest_before(label)[1]["extra"]["tracked"]["tracked.0"]
    assert all(torch.equal(v, snap_ema[k]) for k, v in ema.state_dict().items())
    mon.detach()


class _Learner(nn.Module):
    """BYOL's layout (lucidrains' byol-pytorch): the EMA target network is a submodule of the
    model, its parameters outside the optimizer, updated by the loop after each step."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            aim = self.target(x)
        return self.online(x) + 0.1 * (self.online(x) - aim)

    @torch.no_grad()
    def update_target(self, decay=0.9):
        for t, o in zip(self.target.parameters(), self.online.parameters()):
            t.lerp_(o, 1 - decay)


def _learner_run(tmp_path, monitored, spike_at=None, omit=()):
    torch.manual_seed(0)
    model = _Learner()
    opt = torch.optim.Adam(model.online.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet()) if monitored else None
    if mon is not None:
        mon.track(model.target)
    return model, _derived_loop(model, opt, mon, model.update_target, 30, omit, spike_at)


def test_an_ema_target_inside_the_model_can_be_tracked_and_an_undo_puts_it_back(tmp_path):
    """The undo copy holds the parameters the optimizer updates and the model's buffers; an EMA
    target network inside the model has parameters outside the optimizer, which an undo left with
    the bad update mixed in (a helper's probe of that layout: held-out 1.34-1.69x the twin), and
    ``track(model.target)`` refused it as "tensors of the model itself, which the monitor holds
    already". What the monitor does not hold can be tracked: the undo puts the target back."""
    twin, _ = _learner_run(tmp_path / "twin", monitored=False, omit={14, 15})
    model, events = _learner_run(tmp_path / "mon", monitored=True, spike_at=14)
    assert events == [(14, "update_ratio_spike", ["undo"])]
    assert same(model, twin)
    healthy, events = _learner_run(tmp_path / "healthy", monitored=True)
    bare, _ = _learner_run(tmp_path / "bare", monitored=False)
    assert events == [] and same(healthy, bare)


def test_track_names_bad_input(tmp_path):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="not attached"):
        sfmonitor.Monitor(config=quiet()).track(copy.deepcopy(model))
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path), sinks=[], config=quiet())
    with pytest.raises(TypeError, match=r"track: argument 0 must be an nn.Module .*got Tensor"):
        mon.track(torch.zeros(3))
    with pytest.raises(sfmonitor.ConfigError, match=r"nothing the monitor does not hold already .*: weight, bias\)"):
        mon.track(model)
    ema = copy.deepcopy(model)
    mon.track(ema)
    with pytest.raises(sfmonitor.ConfigError, match="already tracked"):
        mon.track(ema)
    mon.detach()
