"""FSDP2 (``fully_shard``, DTensor parameters) under the monitor: 2 ranks, gloo, CPU.

Every worker shards the same 3-layer MLP (each Linear and the root), so each rank holds half of
every weight; rank r trains on half r of each batch. Results come back through files in tmp_path
and are compared in the test process (no process group there).
"""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _integration_helpers import leave_process_group as _leave
from _integration_helpers import needs_fsdp2_on_cpu
from torch import nn

import sfmonitor
from sfmonitor import actions as A
from sfmonitor import dcp as sfdcp
from sfmonitor.events import UPDATE_RATIO_SPIKE, Decision, Finding
from sfmonitor.sharding import optimizer_state_by_index

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("FSDP2's public fully_shard needs torch >= 2.6", allow_module_level=True)
pytestmark = needs_fsdp2_on_cpu

WORLD = 2
GROUPS = ["0", "2", "4"]  # the Linear layers of nn.Sequential: one group each


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _sharded(model=None):
    """``model`` (the MLP by default) with each Linear and the root sharded."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp() if model is None else model
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _half(batch, rank):
    x, y = batch
    return x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _full_params(model):
    return {n: _full(p) for n, p in model.named_parameters()}


def _full_opt(model, opt):
    return {n: {k: _full(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters() if p in opt.state}


def _events(mon):
    return [(e.step, e.kind, list(e.actions), e.data.get("ranks")) for e in mon.events]


def _run(worker, tmp_path, *args):
    os.makedirs(tmp_path, exist_ok=True)
    mp.spawn(worker, args=(_free_port(), str(tmp_path), *args), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _quiet(**extra):
    return {"console": False, **extra}


def _attached(model, opt, out):
    """The monitor on ``model``, no sinks, quiet."""
    return sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


def _norms_worker(rank, port, out, blocks=False):
    _join(rank, port)
    model = _sharded_blocks() if blocks else _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=["jsonl"], config=_quiet())
    stats = []
    for batch in _batches(3):
        x, y = _half(batch, rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        stats.append(mon.stats)
    mon.detach()
    torch.save({"stats": stats, "params": _full_params(model)}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def _reference(run_dir, steps, model=None):
    """The same model (the MLP by default), unsharded, in this process, on the concatenated batches."""
    model = _mlp() if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=run_dir, sinks=["jsonl"], config=_quiet())
    stats = []
    for x, y in _batches(steps):
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        stats.append(mon.stats)
    mon.detach()
    return stats, model


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_sharded_norms_equal_the_unsharded_model_on_the_whole_batch(tmp_path):
    r0, r1 = _run(_norms_worker, tmp_path)
    assert r0["stats"] == r1["stats"]  # every rank read the same numbers
    ref_stats, ref_model = _reference(str(tmp_path / "ref"), 3)
    keys = ["grad_norm/total"] + [f"{k}/{g}" for k in ("grad_norm", "param_norm") for g in GROUPS]
    for got, want in zip(r0["stats"], ref_stats):
        assert set(keys) <= set(got)
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5), k
        assert got["loss/total"] == pytest.approx(want["loss/total"], rel=1e-6)
    # The update ratios (||delta theta|| / ||theta|| over the full parameters) reach the sinks with
    # the next step's read; the last step's go out without them (no collective at detach).
    sharded, ref = _metrics(tmp_path / "run"), _metrics(tmp_path / "ref")
    assert [m["step"] for m in sharded] == [0, 1, 2]
    for got, want in zip(sharded[:2], ref[:2]):
        for g in GROUPS:
            assert got[f"update_ratio/{g}"] == pytest.approx(want[f"update_ratio/{g}"], rel=1e-5)
    assert not any(k.startswith("update_ratio/") for k in sharded[2])
    for n, p in ref_model.named_parameters():  # and training itself matched
        torch.testing.assert_close(r0["params"][n], p.detach(), rtol=1e-5, atol=1e-6)


class _Blocks(nn.Module):
    """Like blocks in a ModuleList beside an input and an output layer: three groups, the blocks
    inside one (block_grad_norm/blocks.<i>)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


def _sharded_blocks():
    """``_Blocks`` with each block and the root sharded."""
    from torch.distributed.fsdp import fully_shard

    model = _Blocks()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def test_block_norms_and_update_ratios_under_fsdp2_equal_the_unsharded_models(tmp_path):
    """The like blocks inside one group, each sharded on its own: their gradient norms and update
    ratios over every rank's shards equal the unsharded model's on the whole batch."""
    r0, r1 = _run(_norms_worker, tmp_path, True)
    assert r0["stats"] == r1["stats"]
    ref, _ = _reference(str(tmp_path / "ref"), 3, _Blocks())
    keys = [f"block_grad_norm/blocks.{i}" for i in range(4)]
    for got, want in zip(r0["stats"], ref):
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5), k
    for got, want in zip(_metrics(tmp_path / "run")[:2], _metrics(tmp_path / "ref")[:2]):
        for i in range(4):
            k = f"block_update_ratio/blocks.{i}"
            assert got[k] == pytest.approx(want[k], rel=1e-5), k


def _lean_worker(rank, port, out, fraction):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lean = {"actions": {"undo": {"enabled": False}}, "stats": {"update_ratio_fraction": fraction}}
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=["jsonl"], config=_quiet(**lean))
    for batch in _batches(4):
        x, y = _half(batch, rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    held = sum(
        t.numel()
        for t in (mon._update_buf.views if mon._update_buf else []) + (mon._slices.buffers if mon._slices else [])
    )
    local = sum(p.to_local().numel() for p in model.parameters())
    stats = mon.stats
    mon.detach()
    torch.save({"held": held, "local": local, "stats": stats}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_the_lean_update_ratio_under_fsdp2_equals_the_unsharded_one_or_holds_a_slice(tmp_path):
    # Without the undo copy: on whole shards (fraction 1) the ratio over every rank's shard equals
    # the unsharded model's; on a 20% slice each rank holds a fifth of its shard's elements and
    # still gives a finite, positive ratio per group, the same on every rank (one read).
    _run(_lean_worker, tmp_path / "whole", 1.0)
    _reference(str(tmp_path / "ref"), 4)
    sharded, ref = _metrics(tmp_path / "whole" / "run"), _metrics(tmp_path / "ref")
    for got, want in zip(sharded[:3], ref[:3]):
        for g in GROUPS:
            assert got[f"update_ratio/{g}"] == pytest.approx(want[f"update_ratio/{g}"], rel=1e-5)
    r0, r1 = _run(_lean_worker, tmp_path / "slice", 0.2)
    for r in (r0, r1):
        assert 0 < r["held"] <= 0.2 * r["local"] + 10
    assert r0["stats"] == r1["stats"]
    for got in _metrics(tmp_path / "slice" / "run")[:3]:
        for g in GROUPS:
            assert 0 < got[f"update_ratio/{g}"] < 1


# --------------------------------------------------------------------------------------------
# a NaN on one rank: skip, name the rank, nothing lands
# --------------------------------------------------------------------------------------------

BAD_STEP = 2


def _nan_worker(rank, port, out):
    _join(rank, port)
    watched, bare = _sharded(), _sharded()
    opt = torch.optim.AdamW(watched.parameters(), lr=1e-2)
    opt_bare = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    mon = sfmonitor.attach(watched, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    for i, batch in enumerate(_batches(5)):
        x, y = _half(batch, rank)
        loss = nn.functional.mse_loss(watched(x), y)
        if i == BAD_STEP and rank == 1:  # only rank 1: its loss and so every gradient is NaN
            loss = loss * torch.tensor(float("nan"))
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
        if i != BAD_STEP:  # the reference run never sees that batch
            nn.functional.mse_loss(bare(x), y).backward()
            opt_bare.step()
            opt_bare.zero_grad()
    events = _events(mon)
    mon.detach()
    torch.save(
        {
            "events": events,
            "params": _full_params(watched),
            "bare": _full_params(bare),
            "opt": _full_opt(watched, opt),
            "opt_bare": _full_opt(bare, opt_bare),
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    _leave()


def test_a_nan_on_one_rank_skips_the_step_on_both_and_names_the_rank(tmp_path):
    r0, r1 = _run(_nan_worker, tmp_path)
    assert r0["events"] == r1["events"]
    loss_events = [e for e in r0["events"] if e[1] == "nonfinite_loss"]
    assert loss_events == [(BAD_STEP, "nonfinite_loss", ["skip_step"], [1])]
    grad_events = [e for e in r0["events"] if e[1] == "nonfinite_grad"]
    assert [(s, r) for s, _, _, r in grad_events] == [(BAD_STEP, [1])]  # started where the loss was
    for r in (r0, r1):
        assert r["params"].keys() == r["bare"].keys()
        for n in r["params"]:
            assert torch.equal(r["params"][n], r["bare"][n]), n  # bit-identical to never seeing it
            for k in r["opt"][n]:
                assert torch.equal(r["opt"][n][k], r["opt_bare"][n][k]), (n, k)


# --------------------------------------------------------------------------------------------
# rollback restores every rank's shards
# --------------------------------------------------------------------------------------------


def _rollback_worker(rank, port, out):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = _quiet(
        actions={"rollback": {"snapshot_every": 1, "skip_batches": 0}},
        policy={"ladders": {"nonfinite_loss": {"rungs": [{"after": 1, "actions": ["rollback"]}]}}},
    )
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=config)
    starts = []
    for i, batch in enumerate(_batches(4)):
        starts.append((_full_params(model), _full_opt(model, opt)))
        x, y = _half(batch, rank)
        loss = nn.functional.mse_loss(model(x), y)
        if i == BAD_STEP and rank == 1:
            loss = loss * torch.tensor(float("nan"))
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
        if i == BAD_STEP:
            after_rollback = (_full_params(model), _full_opt(model, opt))
    events = [(e.step, e.kind, e.actions, e.data.get("action_results", {})) for e in mon.events]
    # host memory: a snapshot holds this rank's shards only
    _, snap = mon._live().snapshots.latest_before(BAD_STEP)
    held = sum(v.data.numel() for v in snap["model"].values())
    mine = sum(p.to_local().numel() for p in model.parameters())
    mon.detach()
    torch.save(
        {
            "events": events,
            "starts": starts,
            "after": after_rollback,
            "local": [p.to_local() for p in model.parameters()],
            "held": (held, mine, sum(p.numel() for p in model.parameters())),
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    _leave()


def test_rollback_restores_every_ranks_shards(tmp_path):
    r0, r1 = _run(_rollback_worker, tmp_path)
    assert r0["events"] == r1["events"]
    (step, kind, actions, results) = next(e for e in r0["events"] if e[1] == "nonfinite_loss")
    assert (step, actions) == (BAD_STEP, ["rollback"])
    assert results["rollback"]["restored"] is True and results["rollback"]["restored_from"] == BAD_STEP - 1
    for r in (r0, r1):
        params, opt = r["after"]
        want_params, want_opt = r["starts"][BAD_STEP - 1]  # the state step 1 started from
        for n in want_params:
            assert torch.equal(params[n], want_params[n]), n
            for k in want_opt[n]:
                assert torch.equal(opt[n][k], want_opt[n][k]), (n, k)
    for r in (r0, r1):
        held, mine, full = r["held"]
        assert held == mine < full  # the snapshot is this rank's shards, not the whole model
    # each rank holds its own half again, and the halves differ (a sharded model, not a replica)
    assert not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(r0["local"], r1["local"]))


def _trial_worker(rank, port, out):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = _quiet(actions={"rollback": {"snapshot_every": 1, "skip_batches": 0}})
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=config)
    for batch in _batches(4):  # healthy steps: snapshots at 1, 2, 3
        x, y = _half(batch, rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    ctx = mon._live()
    left = (_full_params(model), _full_opt(model, opt))
    ctx.step = 4  # a loss that grew from step 1: the trial's rollback holds the state it leaves
    grows = Finding("loss_divergence", "grows", data={"trial": True, "median": 8.0}, before_update=False, step=1)
    trial = A.apply(ctx, Decision("rollback", grows))
    rolled = _full_params(model)
    ctx.step = 24  # the loss did not bear it out: the held state goes back
    refuted = Finding("loss_divergence", "not the run's own", data={"trial_refuted": True})
    back = A.apply(ctx, Decision("rollback", refuted, {"enforced": True}))
    after = (_full_params(model), _full_opt(model, opt))
    if rank == 1:  # no room to hold a state on rank 1 alone: no rank rolls back
        ctx.snapshots.max_bytes = ctx.snapshots.nbytes
    ctx.skip = False
    full = A.apply(ctx, Decision("rollback", grows))
    mon.detach()
    torch.save(
        {"trial": trial, "back": back, "full": full, "left": left, "rolled": rolled, "after": after},
        os.path.join(out, f"rank{rank}.pt"),
    )
    _leave()


def test_a_trials_rollback_and_its_put_back_move_every_ranks_shards_alike(tmp_path):
    """loss_divergence's trial under FSDP2: its rollback holds each rank's shards of the state it
    leaves, and a refutation puts them back on every rank (parameters and AdamW's moments equal to
    before the trial). Where one rank has no room to hold them, no rank rolls back (the ranks' rings
    may differ: one collective decides)."""
    r0, r1 = _run(_trial_worker, tmp_path)
    for r in (r0, r1):
        assert r["trial"]["restored"] and r["trial"]["restored_from"] == 1 and r["trial"]["trial"]
        assert r["back"]["restored"] and r["back"]["restored_from"] == 4
        assert any(not torch.equal(r["rolled"][n], r["left"][0][n]) for n in r["left"][0])
        params, opt = r["after"]
        assert all(torch.equal(params[n], r["left"][0][n]) for n in params)
        assert all(torch.equal(opt[n][k], r["left"][1][n][k]) for n in opt for k in opt[n])
        assert r["full"]["restored"] is False and "no room" in r["full"]["reason"]


def _stretch_worker(rank, port, out):
    _join(rank, port)
    batches, bad = _batches(100), set(range(60, 72))

    def train(monitored, twin):
        model = _sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = _attached(model, opt, out) if monitored else None
        stream = [i for i in range(100) if not (twin and i in bad)]
        for i in mon.batches(stream) if mon else stream:
            x, y = _half(batches[i], rank)
            loss = nn.functional.mse_loss(model(x), y * 30 + 10 if i in bad else y)  # (targets off their scale)
            (mon.combine(loss) if mon else loss).backward()
            opt.step()
            opt.zero_grad()
        events = []
        if mon is not None:
            events = [(s, k, a) for s, k, a, _ in _events(mon)]
            held = [e.data.get("held") for e in mon.events if e.kind == "loss_level_shift"]
            events.append(("held", held, None))
            mon.detach()
        return _full_params(model), _full_opt(model, opt), events

    mon, twin = train(True, False), train(False, True)
    torch.save({"mon": mon, "twin": twin}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_a_stretch_of_bad_batches_put_back_after_its_level_shift_moves_every_ranks_shards(tmp_path):
    """Twelve batches with targets off their scale on both ranks of a sharded MLP: eight skipped,
    the ninth taken as a level shift and its state held on each rank (its shards), the stretch's
    end a loss_level_return on both that puts those shards back: parameters and AdamW's moments
    equal to the twin that never saw the stretch, on every rank."""
    r0, r1 = _run(_stretch_worker, tmp_path)
    assert r0["mon"][2] == r1["mon"][2]
    told = [e for e in r0["mon"][2] if e[1] not in ("loss_spike", "grad_spike")]  # (its gradients jump too)
    assert told == [(68, "loss_level_shift", []), (72, "loss_level_return", ["rollback"]), ("held", [True], None)]
    for r in (r0, r1):
        (params, opt, _), (twin_params, twin_opt, _) = r["mon"], r["twin"]
        assert all(torch.equal(params[n], twin_params[n]) for n in params)
        assert all(torch.equal(opt[n][k], twin_opt[n][k]) for n in opt for k in opt[n])


# --------------------------------------------------------------------------------------------
# emergency checkpoints: written by 2 ranks, read by 1
# --------------------------------------------------------------------------------------------


def _checkpoint_worker(rank, port, out):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = _quiet(
        actions={"rollback": {"snapshot_every": 1}},
        policy={
            "ladders": {"nonfinite_loss": {"rungs": [{"after": 1, "actions": ["checkpoint", "skip_step"]}]}},
            "cooldowns": {"checkpoint": 0},
        },
    )
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=["jsonl"], config=config)
    ema = _sharded()  # a sharded EMA the monitor tracks: not part of the DCP checkpoint (docs/guide.md)
    mon.track(ema)
    starts = []
    for i, batch in enumerate(_batches(5)):
        starts.append((_full_params(model), _full_opt(model, opt)))
        x, y = _half(batch, rank)
        if i == 4 and rank == 1:  # a NaN in rank 1's half of a weight: the live state is damaged
            with torch.no_grad():
                model[2].weight.to_local()[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        if i == BAD_STEP and rank == 1:
            loss = loss * torch.tensor(float("nan"))
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
        if not mon.last_step_skipped:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
    # written from a snapshot (a landed update): the snapshot held the tracked EMA's shards
    ctx = mon._live()
    ctx.step = mon.step  # the step about to run (its own checkpoint name), finding the last update bad
    landed = Finding(UPDATE_RATIO_SPIKE, "a landed update", step=mon.step - 1, before_update=False)
    from_snapshot = A.checkpoint(ctx, Decision("checkpoint", landed))
    events = [(e.step, e.kind, e.actions, e.data) for e in mon.events]
    mon.detach()
    torch.save(
        {"events": events, "starts": starts, "from_snapshot": from_snapshot}, os.path.join(out, f"rank{rank}.pt")
    )
    _leave()


def _checkpoints(events):
    return {
        step: data["action_results"]["checkpoint"]
        for step, kind, actions, data in events
        if kind == "nonfinite_loss" and "checkpoint" in actions
    }


def test_an_emergency_checkpoint_written_by_two_ranks_loads_into_one_process(tmp_path):
    r0, r1 = _run(_checkpoint_worker, tmp_path)
    saved = _checkpoints(r0["events"])
    assert saved == _checkpoints(r1["events"]) and sorted(saved) == [BAD_STEP, 4]
    live, snap = saved[BAD_STEP], saved[4]
    assert live["saved"] and live["format"] == "dcp" and live["source"] == "live" and live["bytes"] > 0
    # the weights were already damaged: the step's undo (order 25) put back the state step 3 started
    # from, and the checkpoint (order 35) saves that live state
    assert snap["saved"] and snap["source"] == "live"
    # the damaged parameter is named, and only rank 1 held a non-finite shard
    param_events = [d for _, k, _, d in r0["events"] if k == "nonfinite_param"]
    assert param_events and param_events[0]["param"] == "2.weight" and param_events[0]["ranks"] == [1]
    for path, start in ((live["path"], r0["starts"][BAD_STEP]), (snap["path"], r0["starts"][3])):
        assert os.path.isdir(path) and path.endswith(".dcp")
        assert not os.path.exists(path + ".partial")
        want_params, want_opt = start
        model = _mlp()  # one process, no process group, the plain model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = sfdcp.load(path, model, opt)  # (a tracked sharded EMA in it made it unreadable)
        assert extra["kind"] == "nonfinite_loss" and "monitor" in extra and "tracked" not in extra
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), want_params[n]), n
            for k, v in want_opt[n].items():
                assert torch.equal(opt.state[p][k], v), (n, k)
        # the single-file conversion: plain torch.load(weights_only=True), plain names
        out = tmp_path / "single.pt"
        assert sfdcp.main([path, str(out)]) == 0  # python -m sfmonitor.dcp FOLDER OUT
        sd = torch.load(out, weights_only=True)
        assert list(sd["model"]) == list(_mlp().state_dict())
        for n in want_params:
            assert torch.equal(sd["model"][n], want_params[n])
        fresh = _mlp()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh.load_state_dict(sd["model"])
        fresh_opt.load_state_dict(optimizer_state_by_index(sd["optimizer"], fresh, fresh_opt))
        assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], want_opt["0.weight"]["exp_avg"])
    from_snapshot = r0["from_snapshot"]
    assert from_snapshot["source"].startswith("snapshot@") and from_snapshot == r1["from_snapshot"]
    extra = sfdcp.load(from_snapshot["path"], _mlp())  # readable, without the EMA's per-rank parts
    assert extra["snapshot_step"] == int(from_snapshot["source"].split("@")[1]) and "tracked" not in extra


def test_a_folder_that_is_not_a_dcp_checkpoint_is_a_checkpoint_error(tmp_path, capsys):
    (tmp_path / "nothing.dcp").mkdir()
    with pytest.raises(sfmonitor.checkpoint.CheckpointError, match="not a DCP checkpoint folder"):
        sfdcp.load(tmp_path / "nothing.dcp", _mlp())
    with pytest.raises(sfmonitor.checkpoint.CheckpointError, match="not a DCP checkpoint folder"):
        sfdcp.to_single_file(tmp_path / "missing", tmp_path / "out.pt")
    assert sfdcp.main([str(tmp_path / "missing"), str(tmp_path / "out.pt")]) == 2  # python -m sfmonitor.dcp
    assert "not a DCP checkpoint folder" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


def test_python_m_sfmonitor_dcp_runs_without_a_runpy_warning(tmp_path):
    """The documented shell command: importing the package must not import the module first
    (runpy then warns that it was found in sys.modules before its execution)."""
    import subprocess
    import sys

    args = [sys.executable, "-W", "error::RuntimeWarning", "-m", "sfmonitor.dcp"]
    done = subprocess.run([*args, str(tmp_path / "missing"), str(tmp_path / "out.pt")], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "RuntimeWarning" not in done.stderr and "not a DCP checkpoint folder" in done.stderr


# --------------------------------------------------------------------------------------------
# evaluation metrics agree across ranks (DDP and FSDP2)
# --------------------------------------------------------------------------------------------

# rank 0 / rank 1 accuracies per validation (chance 0.1): the second would collapse rank 1 alone,
# the third collapses neither rank alone but their mean (0.1) is at chance.
EVALS = [(0.9, 0.9), (0.5, 0.0), (0.2, 0.0)]


def _eval_worker(rank, port, out, mode):
    _join(rank, port)
    if mode == "fsdp2":
        model = _sharded()
    else:
        model = nn.parallel.DistributedDataParallel(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    x, y = _half(_batches(1)[0], rank)
    decisions = []
    for accs in EVALS:
        # (no training loss through combine(): the accuracy alone decides, the report's rule; with
        # one, a collapse also needs that loss risen: tests/test_detectors.py)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        new = mon.observe_eval({"accuracy": accs[rank]}, chance=0.1)
        decisions.append([(e.kind, e.actions, e.data.get("value")) for e in new])
    mon.detach()
    torch.save({"decisions": decisions, "params": _full_params(model)}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_different_eval_values_on_each_rank_yield_one_decision(tmp_path, mode):
    r0, r1 = _run(_eval_worker, tmp_path, mode)
    assert r0["decisions"] == r1["decisions"]
    assert r0["decisions"][:2] == [[], []]
    (kind, actions, value), *_ = r0["decisions"][2]
    assert kind == "accuracy_collapse" and value == pytest.approx(0.1) and "rollback" in actions
    for n in r0["params"]:  # the rollback it took left both ranks' models the same
        assert torch.equal(r0["params"][n], r1["params"][n])


def _mismatch_worker(rank, port, out):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    try:
        mon.observe_eval({"accuracy": 0.5} if rank == 0 else {"acc": 0.5}, chance=0.1)
        err = None
    except sfmonitor.ConfigError as e:
        err = str(e)
    mon.detach()
    torch.save({"error": err}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_different_metric_names_on_the_ranks_are_an_error_on_every_rank(tmp_path):
    r0, r1 = _run(_mismatch_worker, tmp_path)
    assert "different metric names" in r0["error"] and "['accuracy']" in r0["error"]
    assert "different metric names" in r1["error"] and "['acc']" in r1["error"]


# --------------------------------------------------------------------------------------------
# a GradScaler overflow in one rank's shard; clip and gradient noise on shards
# --------------------------------------------------------------------------------------------


def _scaler_worker(rank, port, out, monitored):
    # (torch's DTensor unscale already all-reduces found-inf over the mesh; the monitor's agreed read
    # marks it found on every rank too, for scalers whose found-inf stays local)
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0)
    mon = None
    if monitored:
        mon = sfmonitor.attach(model, opt, scaler=scaler, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    moved = []
    for i, batch in enumerate(_batches(3)):
        x, y = _half(batch, rank)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(mon.combine(loss) if mon else loss).backward()
        if i == 1 and rank == 1:  # an overflow in rank 1's shard of one gradient only
            model[2].weight.grad.to_local()[0, 0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved.append(any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())))
    events = _events(mon) if mon else []
    if mon:
        mon.detach()
    torch.save({"moved": moved, "scale": scaler.get_scale(), "events": events}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_a_scaler_overflow_in_one_shard_skips_the_step_on_every_rank(tmp_path):
    r0, r1 = _run(_scaler_worker, tmp_path, True)
    assert r0["moved"] == r1["moved"] == [True, False, True]
    assert r0["scale"] == r1["scale"] == 32768.0  # both lowered their scale once
    # one event on both ranks: the scaler's own skip (recorded, not acted on), seen on rank 1
    assert r0["events"] == r1["events"] == [(1, "nonfinite_grad", [], [1])]


def test_share_scaler_skip_marks_found_inf_where_this_rank_found_none():
    from sfmonitor.integrations.distributed import share_scaler_skip

    opt = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    found = torch.zeros(())
    scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {torch.device("cpu"): found}
    share_scaler_skip(scaler, opt)
    assert found.item() == 1.0  # so scaler.step skips and scaler.update lowers the scale


def _clip_worker(rank, port, out):
    from sfmonitor import actions as A

    _join(rank, port)
    model = _sharded()
    x, y = _half(_batches(1)[0], rank)
    nn.functional.mse_loss(model(x), y).backward()
    groups = {g: [p for n, p in model.named_parameters() if n.startswith(g + ".")] for g in GROUPS}
    cfg = A.ClipConfig(max_grad_norm=0.05, per_modality={"*": "norm:0.01"})
    clipped = {}
    for mode in ("global", "per_modality", "agc"):
        saved = [p.grad.to_local().clone() for p in model.parameters()]
        before, after, _ = A.clip_gradients(groups, cfg, mode=mode)
        clipped[mode] = (
            {g: float(v) for g, v in before.items()},
            {g: float(v) for g, v in after.items()},
            {n: _full(p.grad) for n, p in model.named_parameters()},
        )
        for p, g in zip(model.parameters(), saved):
            p.grad.to_local().copy_(g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = A.ActionContext(
        model=model, optimizer=opt, groups={g: [(n, p) for n, p in model.named_parameters()] for g in ["all"]}
    )
    local_before = [p.grad.to_local().clone() for p in model.parameters()]
    A.grad_noise(ctx, sfmonitor.Decision("grad_noise", sfmonitor.Finding("plateau", "test"), {}))
    noise = [p.grad.to_local() - b for p, b in zip(model.parameters(), local_before)]
    torch.save({"clipped": clipped, "noise": noise}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_clip_measures_and_scales_every_shard_and_noise_differs_per_shard(tmp_path):
    from sfmonitor import actions as A

    r0, r1 = _run(_clip_worker, tmp_path)
    model = _mlp()  # the unsharded reference on the whole batch
    x, y = _batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    groups = {g: [p for n, p in model.named_parameters() if n.startswith(g + ".")] for g in GROUPS}
    cfg = A.ClipConfig(max_grad_norm=0.05, per_modality={"*": "norm:0.01"})
    for mode in ("global", "per_modality", "agc"):
        saved = [p.grad.clone() for p in model.parameters()]
        before, after, _ = A.clip_gradients(groups, cfg, mode=mode)
        got_before, got_after, got_grads = r0["clipped"][mode]
        assert r1["clipped"][mode][0] == got_before  # the same global norms on both ranks
        for g in GROUPS:
            assert got_before[g] == pytest.approx(float(before[g]), rel=1e-5)
            assert got_after[g] == pytest.approx(float(after[g]), rel=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(got_grads[n], p.grad, rtol=1e-5, atol=1e-8)
        for p, g in zip(model.parameters(), saved):
            p.grad.copy_(g)
    # each rank's shard got its own noise (one pattern repeated on every shard would be correlated)
    assert any(a.numel() and not torch.equal(a, b) for a, b in zip(r0["noise"], r1["noise"]) if a.shape == b.shape)
    assert all(torch.isfinite(n).all() and n.abs().sum() > 0 for n in r0["noise"] if n.numel())


def _undo_worker(rank, port, out):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    starts = []
    for i, batch in enumerate(_batches(4)):
        starts.append((_full_params(model), _full_opt(model, opt)))
        x, y = _half(batch, rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        if i == 1 and rank == 1:  # step 1's update "landed" a NaN in rank 1's half of a weight
            with torch.no_grad():
                model[2].weight.to_local()[0, 0] = float("nan")
        if i == 2:
            after = (_full_params(model), _full_opt(model, opt))
    events = [(e.step, e.kind, e.actions, e.data.get("ranks"), e.data.get("action_results", {})) for e in mon.events]
    mon.detach()
    torch.save({"events": events, "starts": starts, "after": after}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_undo_puts_every_ranks_shards_back_one_step(tmp_path):
    r0, r1 = _run(_undo_worker, tmp_path)
    assert [e[:4] for e in r0["events"]] == [e[:4] for e in r1["events"]]
    param = next(e for e in r0["events"] if e[1] == "nonfinite_param")
    assert param[0] == 2 and "undo" in param[2] and param[3] == [1]  # only rank 1's shard held it
    assert param[4]["undo"]["restored"] is True
    for r in (r0, r1):
        params, opt = r["after"]
        want_params, want_opt = r["starts"][1]  # the state step 1's update started from
        for n in want_params:
            assert torch.equal(params[n], want_params[n]), n
            for k in want_opt[n]:
                assert torch.equal(opt[n][k], want_opt[n][k]), (n, k)


def test_checkpoint_names_are_the_plain_models():
    from sfmonitor.sharding import clean_name

    assert clean_name("_orig_mod.layers.0._checkpoint_wrapped_module.attn.weight") == "layers.0.attn.weight"
    assert clean_name("encoder._fsdp_wrapped_module.0.weight") == "encoder.0.weight"
    assert clean_name("head.weight") == "head.weight"


def _stale_optimizer_worker(rank, port, out):
    from torch.distributed.fsdp import fully_shard

    _join(rank, port)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before fully_shard: stale
    fully_shard(model)
    try:
        sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
        err = None
    except sfmonitor.ConfigError as e:
        err = str(e)
    torch.save({"error": err}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_an_optimizer_built_before_fully_shard_is_a_config_error(tmp_path):
    for r in _run(_stale_optimizer_worker, tmp_path):
        assert "build the optimizer after fully_shard()" in r["error"]


def _slice_worker(rank, port, out):
    from torch.distributed.fsdp import fully_shard

    from sfmonitor.sharding import scale_slice_

    _join(rank, port)
    torch.manual_seed(0)
    layer = nn.Linear(4, 7)  # 7 rows: uneven shards (4 on rank 0, 3 on rank 1)
    fully_shard(layer)
    before = _full(layer.weight)
    with torch.no_grad():
        layer.weight.narrow(0, 2, 4).mul_(0.5)  # the plain way: a redistributed copy, nothing lands
    plain = _full(layer.weight)
    scale_slice_(layer.weight, 0, 2, 4, 0.5)  # rows 2..5: across both shards
    scale_slice_(layer.weight, 1, 1, 2, 3.0)  # columns 1..2 of every row
    torch.save({"before": before, "plain": plain, "after": _full(layer.weight)}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_scale_slice_reaches_every_shard(tmp_path):
    r0, r1 = _run(_slice_worker, tmp_path)
    assert torch.equal(r0["plain"], r0["before"])  # why the helper exists
    want = r0["before"].clone()
    want[2:6] *= 0.5
    want[:, 1:3] *= 3.0
    for r in (r0, r1):
        assert torch.equal(r["after"], want)


# --------------------------------------------------------------------------------------------
# torch.compile, block by block (torchtitan's way)
# --------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _compiled_blocks_worker(rank, port, out):
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard

    _join(rank, port)
    got = {}
    for monitored in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), _Block(), _Block(), _Block(), nn.Linear(16, 3))
        blocks = [m for m in model if isinstance(m, _Block)]
        for m in blocks:
            fully_shard(m)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = _quiet(watch={"stride": 1})
        run = os.path.join(out, f"run{int(monitored)}")
        mon = sfmonitor.attach(model, opt, run_dir=run, sinks=[], config=config) if monitored else None
        for m in blocks:
            m.compile(backend="eager")  # dynamo traces what a backend would compile
        for batch in _batches(4):
            x, y = _half(batch, rank)
            loss = nn.functional.mse_loss(model(x), y)
            (mon.combine(loss) if mon else loss).backward()
            opt.step()
            opt.zero_grad()
        got[monitored] = {
            "params": [p.to_local().detach().clone() for p in model.parameters()],
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "events": [e.kind for e in mon.events] if mon else [],
            "watched": sorted(k for k in mon.stats if k.startswith("act_absmax/")) if mon else [],
        }
        if mon:
            mon.detach()
    torch.save(got, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_blocks_compiled_one_by_one_under_fsdp2_compile_and_train_as_without_the_monitor(tmp_path):
    for rank in _run(_compiled_blocks_worker, tmp_path):
        bare, mon = rank[False], rank[True]
        assert bare["graphs"] >= 1 and bare["breaks"] == 0
        assert (mon["graphs"], mon["breaks"]) == (bare["graphs"], bare["breaks"])  # identical blocks: one graph
        assert all(torch.equal(a, b) for a, b in zip(bare["params"], mon["params"]))
        assert mon["events"] == []
        assert mon["watched"] == ["act_absmax/0", "act_absmax/4"]  # outside the compiled blocks: watched


# --------------------------------------------------------------------------------------------
# dead units
# --------------------------------------------------------------------------------------------


def _relu_mlp(sharded):
    """16 units in each hidden layer; after the first step the first layer's units 0-11 never
    switch on again (``_kill``). Sharded, rank 0 holds rows 0-7 (all dead), rank 1 rows 8-15 (4
    dead): 12 of 16 in all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    return _sharded(model) if sharded else model


def _kill(model):
    bias = model[0].bias
    with torch.no_grad():
        if hasattr(bias, "to_local"):  # this rank's rows: 8 of the 16
            rows = range(dist.get_rank() * 8, dist.get_rank() * 8 + 8)
            bias.to_local()[[r - rows.start for r in rows if r < 12]] = -100.0
        else:
            bias[:12] = -100.0


def _train_dead(model, mon, opt, batches):
    seen = []
    for i, (x, y) in enumerate(batches):
        if i == 1:
            _kill(model)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        seen.append({k: v for k, v in mon.stats.items() if k.startswith("dead_units/")})
    return seen


def _dead_worker(rank, port, out):
    _join(rank, port)
    model = _relu_mlp(sharded=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = _quiet(stats={"dead_units_every": 1, "dead_units_samples": 3})
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=cfg)
    seen = _train_dead(model, mon, opt, [_half(b, rank) for b in _batches(5)])
    events = _events(mon)
    mon.detach()
    torch.save({"seen": seen, "events": events}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_dead_units_under_fsdp2_are_the_unsharded_models_shares_on_every_rank(tmp_path):
    """Each rank counts the dead units of its own rows; the counts are summed at the read, so every
    rank reads 12 of 16 (not its own 8 of 8 or 4 of 8) and tells the same event."""
    r0, r1 = _run(_dead_worker, tmp_path)
    model = _relu_mlp(sharded=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = _quiet(stats={"dead_units_every": 1, "dead_units_samples": 3})
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "ref"), sinks=[], config=cfg)
    ref = _train_dead(model, mon, opt, _batches(5))
    ref_events = _events(mon)
    mon.detach()
    assert r0["seen"] == r1["seen"] == ref
    assert [s["dead_units/0"] for s in ref] == [0.0, 0.0, 0.0, 0.75, 0.75]
    # (the biases set at step 1 are the loop's change of the weights, seen on every rank alike)
    assert r0["events"] == r1["events"] == ref_events == [(1, "new_regime", [], None), (3, "dead_units", [], None)]


# --------------------------------------------------------------------------------------------
# Adam's eps
# --------------------------------------------------------------------------------------------


def _train_eps(model, mon, opt, batches):
    seen = []
    for x, y in batches:
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        seen.append({k: v for k, v in mon.stats.items() if k.startswith("adam_eps/")})
    return seen


_EPS_CFG = {"stats": {"adam_eps_every": 1}}


def _eps_worker(rank, port, out):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=3e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet(**_EPS_CFG))
    seen = _train_eps(model, mon, opt, [_half(b, rank) for b in _batches(4)])
    mon.detach()
    torch.save({"seen": seen}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_adam_eps_under_fsdp2_is_the_unsharded_models_share_on_every_rank(tmp_path):
    """Each rank counts the elements of its own shard of the second moment; the counts are summed
    at the read: both ranks read the unsharded model's shares, not their shard's."""
    r0, r1 = _run(_eps_worker, tmp_path)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=3e-2)
    mon = sfmonitor.attach(model, opt, run_dir=str(tmp_path / "ref"), sinks=[], config=_quiet(**_EPS_CFG))
    ref = _train_eps(model, mon, opt, _batches(4))
    mon.detach()
    assert r0["seen"] == r1["seen"]
    assert (
        [sorted(s) for s in ref[1:]]
        == [sorted(s) for s in r0["seen"][1:]]
        == [["adam_eps/0", "adam_eps/2", "adam_eps/4"]] * 3
    )
    for got, want in zip(r0["seen"][1:], ref[1:]):
        assert got == pytest.approx(want, abs=0.02)
    assert 0.05 < max(ref[-1].values()) and min(ref[-1].values()) < 0.95  # shares, not all or nothing


# --------------------------------------------------------------------------------------------
# an fp16 overflow in a module no pattern selects, sharded
# --------------------------------------------------------------------------------------------


def _gram_fsdp_worker(rank, port, out):
    from test_watch import gram_run

    def shard(model):
        from torch.distributed.fsdp import fully_shard

        for m in (model.embed, model.head):
            fully_shard(m)
        return fully_shard(model)

    _join(rank, port)
    # only rank 1's inputs overflow the parameter-free h @ h^T
    model, mon, losses = gram_run(os.path.join(out, "run"), [50.0 if rank == 1 else 1.0] * 5, seed=rank, wrap=shard)
    events = [(e.step, e.kind, e.actions, e.data.get("module")) for e in mon.events]
    wide = bool(mon._watch._wide)
    mon.detach()
    torch.save({"events": events, "losses": losses, "wide": wide}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_an_unwatched_fp16_overflow_under_fsdp2_is_found_on_every_rank_alike(tmp_path):
    """Both ranks widen the watch in the same step (no collective mismatch, no hang), name the
    parameter-free module and run it in fp32; rank 1's losses are finite from then on."""
    r0, r1 = _run(_gram_fsdp_worker, tmp_path)
    assert r0["events"] == r1["events"]
    fallback = [e for e in r0["events"] if "precision_fallback" in e[2]]
    assert fallback == [(1, "activation_overflow", ["precision_fallback"], "gram")], r0["events"]
    assert all(v == v and abs(v) != float("inf") for v in r1["losses"][2:])
    assert not r0["wide"] and not r1["wide"]


def _stride_worker(rank, port, out, bad):
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = _quiet(stats={"update_ratio_every": 4})
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=["jsonl"], config=config)
    for i in mon.batches(range(12)):
        x, y = _half(_batches(12)[i], rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        for g in opt.param_groups:
            g["lr"] = 1e-2 * (1e4 if i == bad else 1.0)
        opt.step()
        opt.zero_grad()
    events = _events(mon)
    mon.detach()
    torch.save({"events": events, "params": _full_params(model)}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_an_update_the_stride_left_unmeasured_is_measured_on_every_rank_alike(tmp_path):
    """``stats.update_ratio_every: 4`` and an LR at 1e4x on step 5, which the stride leaves
    unmeasured: the next step's trouble has every rank measure it from its undo copy's shards (a
    read of its own: one more collective, on every rank) and undo it alike; no rank waits."""
    r0, r1 = _run(_stride_worker, tmp_path, 5)
    assert r0["events"] == r1["events"]
    assert [(s, k, a) for s, k, a, _ in r0["events"] if a] == [(5, "update_ratio_spike", ["undo"])]
    for n in r0["params"]:
        assert torch.equal(r0["params"][n], r1["params"][n])


# --------------------------------------------------------------------------------------------
# weights the loop changes between two steps
# --------------------------------------------------------------------------------------------


def _reinit_worker(rank, port, out):
    """The loop re-initialises the head through its DTensor (``normal_`` on the parameter, not on
    ``to_local()``) between steps 3 and 4, on both ranks."""
    _join(rank, port)
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    for i, batch in enumerate(_batches(6)):
        if i == 4:
            with torch.no_grad():
                model[4].weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(7))
        x, y = _half(batch, rank)
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    events = _events(mon)
    mon.detach()
    torch.save({"events": events}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_a_write_through_a_dtensor_parameter_is_the_loops_change_on_every_rank(tmp_path):
    """An in-place op on an FSDP2 parameter moves the DTensor's version counter, not its local
    shard's (DTensor runs it on the shard below autograd): read from the shard alone, a head the
    loop re-initialised went unseen, and the jump it made was skipped 8 times (a helper's probe:
    held-out 1.11x bare). Both counters are read: one `new_regime` on both ranks, at that step."""
    r0, r1 = _run(_reinit_worker, tmp_path)
    assert r0["events"] == r1["events"]
    assert [(s, k) for s, k, _, _ in r0["events"]] == [(4, "new_regime")], r0["events"]


def _data_write_worker(rank, port, out):
    """Rank 1 fills its shard of the head's weight with 5 through ``.data`` between steps 39 and 40
    (no version counter moves), monitored and bare."""
    _join(rank, port)
    batches = _batches(60)

    def train(monitored):
        model = _sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = _attached(model, opt, out) if monitored else None
        for i, batch in enumerate(batches):
            if i == 40 and rank == 1:
                model[4].weight.to_local().data.fill_(5.0)
            x, y = _half(batch, rank)
            loss = nn.functional.mse_loss(model(x), y)
            (mon.combine(loss) if mon else loss).backward()
            opt.step()
            opt.zero_grad()
        events = []
        if mon is not None:
            events = [(e.step, e.kind, list(e.actions), e.data.get("written")) for e in mon.events]
            mon.detach()
        return _full_params(model), events

    (params, events), (bare, _) = train(True), train(False)
    torch.save(
        {"events": events, "equal": all(torch.equal(params[n], bare[n]) for n in params)},
        os.path.join(out, f"rank{rank}.pt"),
    )
    _leave()


def test_a_write_through_data_on_one_rank_is_the_loops_change_on_every_rank(tmp_path):
    """One rank fills its shard of the head through ``.data`` (no counter moves): the next step's
    jump measures that rank's shards off what the last update left; the ranks agree (one max
    collective), and both take the step for a change of the model, not a bad batch: no skip, and
    the run equals bare on both ranks."""
    r0, r1 = _run(_data_write_worker, tmp_path)
    assert [e[:3] for e in r0["events"]] == [e[:3] for e in r1["events"]]
    regimes = [(e[0], e[3]) for e in r0["events"] if e[1] == "new_regime"]
    assert regimes == [(40, [])], r0["events"]  # (rank 0 wrote nothing: "on another rank")
    assert [(e[0], e[3]) for e in r1["events"] if e[1] == "new_regime"] == [(40, ["4.weight"])]
    assert not [e for e in r0["events"] if e[2]], r0["events"]
    assert r0["equal"] and r1["equal"]
