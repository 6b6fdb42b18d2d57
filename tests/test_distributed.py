"""Under torch.distributed (gloo, 2 ranks on 127.0.0.1) every rank takes the same decision."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _integration_helpers import free_port, join_gloo
from _integration_helpers import leave_process_group as _leave
from torch import nn

import sfmonitor

_free_port, _join = free_port, join_gloo


def _worker(rank, world, port, out_dir):
    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config={"console": False})
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x = torch.randn(5, 4, generator=g)
        loss = model(x).pow(2).mean()
        if step == 2 and rank == 1:  # only rank 1 sees a non-finite loss (finite gradients)
            loss = loss + torch.tensor(float("nan"))
        mon.combine(loss).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save(
        {
            "events": [(e.step, e.kind, e.actions) for e in mon.events],
            "params": flat,
            "groups": list(mon.groups),
            "loss": mon.stats["loss/total"],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    mon.detach()
    _leave()


def test_every_rank_takes_the_same_decision_in_the_same_step(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"] == [(2, "nonfinite_loss", ["skip_step"])]
    assert torch.equal(r0["params"], r1["params"])
    assert r0["groups"] == ["0", "2"]  # grouped by the wrapped model's names, not "module"
    assert r0["loss"] == r1["loss"]  # the mean over ranks


def _overflow_worker(rank, world, port, out_dir):
    from test_rescue import make_att_model

    _join(rank, world, port)
    model = nn.parallel.DistributedDataParallel(make_att_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = sfmonitor.attach(
        model,
        opt,
        run_dir=os.path.join(out_dir, str(rank)),
        sinks=[],
        config={"console": False, "watch": {"stride": 1}},
    )
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 4, 8, generator=g)
    for i in range(6):  # only rank 1's inputs grow: only its fusion logits near the fp16 limit
        x = base * (1.1 ** (80 + i) if rank == 1 else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            losses = model(x)
        mon.combine(losses, weights={"fusion": 1.0, "aux": 1.0}).backward()
        opt.step()
        opt.zero_grad()
    torch.save(
        {
            "events": [(e.step, e.kind, e.actions) for e in mon.events],
            "params": [p.detach().clone() for p in model.parameters()],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    mon.detach()
    _leave()


def test_one_rank_overflowing_makes_every_rank_rescue_alike(tmp_path):
    mp.spawn(_overflow_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"]
    # only rank 1's logits overflow; the watch's answer (the activation_overflow ladder) is taken on
    # both ranks, and whatever it changed in the weights, the replicas stay equal
    assert any(a for _, k, a in r0["events"] if k == "activation_overflow")
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


def _unwatched_overflow_worker(rank, world, port, out_dir):
    from test_watch import gram_run

    _join(rank, world, port)
    # only rank 1's inputs are large: only its h @ h^T overflows fp16
    model, mon, losses = gram_run(
        os.path.join(out_dir, str(rank)),
        [50.0 if rank == 1 else 1.0] * 5,
        seed=rank,
        wrap=nn.parallel.DistributedDataParallel,
    )
    torch.save(
        {
            "events": [(e.step, e.kind, e.actions, e.data.get("module")) for e in mon.events],
            "params": [p.detach().clone() for p in model.parameters()],
            "losses": losses,
            "wide": bool(mon._watch._wide),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    mon.detach()
    _leave()


def test_an_overflow_no_watched_module_made_is_found_on_every_rank_alike(tmp_path):
    # The parameter-free module that overflows is watched by no pattern; its inf reaches a watched
    # Linear on rank 1 only. Both ranks widen the watch in the same step (they read the same
    # reduced maxima and first index), name the module, and run it in fp32; the replicas stay equal.
    mp.spawn(_unwatched_overflow_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"]
    fallback = [e for e in r0["events"] if "precision_fallback" in e[2]]
    assert fallback == [(1, "activation_overflow", ["precision_fallback"], "gram")], r0["events"]
    assert all(v == v and abs(v) != float("inf") for v in r1["losses"][2:])
    assert not r0["wide"] and not r1["wide"]
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


def test_tell_ranks_names_where_a_nonfinite_value_started():
    from sfmonitor.events import NONFINITE_GRAD, NONFINITE_LOSS, NONFINITE_PARAM, Finding
    from sfmonitor.integrations.distributed import culprit_ranks, tell_ranks

    # 3 ranks: slots [loss x3, grad x3, param x3, inputs x3], summed across ranks
    by_rank = [0, 1, 1, 4, 4, 4, 0, 0, 2, 0, 0, 0]
    assert culprit_ranks(by_rank) == {"loss": [1, 2], "grad": [0, 1, 2], "param": [2], "inputs": []}
    found = [Finding(NONFINITE_LOSS, "loss is nan"), Finding(NONFINITE_GRAD, "g"), Finding(NONFINITE_PARAM, "p")]
    tell_ranks(found, by_rank)
    assert [f.data["ranks"] for f in found] == [[1, 2], [1, 2], [2]]
    assert found[0].message == "loss is nan (started on ranks 1, 2: their losses were non-finite)"
    assert found[2].message.endswith("(started on rank 2: non-finite parameters)")
    # the loss was fine everywhere: the gradients' ranks are named
    grad_only = [Finding(NONFINITE_GRAD, "g")]
    tell_ranks(grad_only, [0, 0, 3, 3, 0, 0, 0, 0])
    assert grad_only[0].data["ranks"] == [0, 1]
    tell_ranks(grad_only[:0], None)  # no process group: nothing to say


def test_tell_ranks_names_the_rank_of_a_bad_batch():
    """A NaN input on rank 1 of 2 is a bad_batch (its loss and gradient findings merged into it):
    its event named no rank (a probe under torchrun), while a NaN loss on that rank was named."""
    from sfmonitor.events import BAD_BATCH, NONFINITE_GRAD, Finding
    from sfmonitor.integrations.distributed import tell_ranks

    found = [Finding(BAD_BATCH, "the batch holds 1 non-finite input value(s): loss is nan")]
    tell_ranks(found, [0, 1, 3, 3, 0, 0, 0, 1])  # rank 1's loss; the reduced gradients on both
    assert found[0].data["ranks"] == [1]
    assert found[0].message.endswith("(started on rank 1: its loss was non-finite)")
    masked = [Finding(BAD_BATCH, "b")]  # the NaN never reached a loss (masked): the gradients' ranks
    tell_ranks(masked, [0, 0, 0, 3, 0, 0, 0, 0])
    assert masked[0].data["ranks"] == [1]
    # Without combine() no rank's loss is known, and the reduction spread the NaN gradient to every
    # rank: the rank whose inputs held the NaN is where it started (a probe: "ranks 0, 1")
    unseen = [Finding(BAD_BATCH, "b"), Finding(NONFINITE_GRAD, "g")]
    tell_ranks(unseen, [0, 0, 3, 3, 0, 0, 0, 1024])
    assert [f.data["ranks"] for f in unseen] == [[1], [1]]
    assert unseen[0].message.endswith("(started on rank 1: its inputs held non-finite values)")


def test_read_all_reads_vectors_and_norm_ratios_in_one_read():
    from sfmonitor import stats as S

    out = S.read_all(
        {
            "a": torch.tensor(2.0),
            "v": S.Vector(torch.tensor([1.0, 0.0, 3.0])),
            "r": S.NormRatio(torch.tensor(1.0), torch.tensor(4.0)),
            "z": S.NormRatio(torch.tensor(0.0), torch.tensor(0.0)),
            "n": 5,
        }
    )
    assert out == {"a": 2.0, "v": [1.0, 0.0, 3.0], "r": 0.25, "z": 0.0, "n": 5.0}


def test_read_all_in_one_process_keeps_every_value_its_order_and_dtype_and_reads_once(monkeypatch):
    """0-d tensors of three dtypes, one needing grad, interleaved with numbers, a one-element 1-d
    tensor, vectors and ratios: each value back as a float in the order given, one tolist()."""
    from sfmonitor import stats as S

    w = torch.tensor(3.0, requires_grad=True)
    named = {
        "f32": torch.tensor(1.5),
        "n": 7,
        "i64": torch.tensor(4),
        "grad": w * 2,
        "f64": torch.tensor(0.1, dtype=torch.float64),
        "one": torch.tensor([6.0]),
        "b": True,
        "v": S.Vector(torch.tensor([1.0, 2.0])),
        "r": S.NormRatio(torch.tensor(1.0), torch.tensor(8.0)),
        "f32b": torch.tensor(-2.0),
        "half": torch.tensor(65504.0, dtype=torch.float16),
    }
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    out = S.read_all(named)
    assert list(out) == list(named) and len(reads) == 1
    assert out == {
        "f32": 1.5,
        "n": 7.0,
        "i64": 4.0,
        "grad": 6.0,
        "f64": 0.1,
        "one": 6.0,
        "b": 1.0,
        "v": [1.0, 2.0],
        "r": 0.125,
        "f32b": -2.0,
        "half": 65504.0,
    }
    assert all(type(v) is float for k, v in out.items() if k != "v")


@pytest.mark.parametrize(
    ("mask", "first"),
    [([], -1), ([False, False], -1), ([True], 0), ([False, True, True], 1), ([False] * 9 + [True], 9)],
)
def test_first_true_names_the_first_offender_or_minus_one(mask, first):
    from sfmonitor import stats as S

    got = S.first_true(torch.tensor(mask, dtype=torch.bool))
    assert got.dim() == 0 and got.dtype == torch.int64 and got.item() == first


class _Attn(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.num_heads, self.hd = h, d // h
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, L, D = x.shape

        def split(t):
            return t.view(B, L, self.num_heads, self.hd).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / self.hd**0.5, dim=-1)
        return self.o_proj((a @ v).transpose(1, 2).reshape(B, L, D))


class _AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.attn, self.head = nn.Linear(4, 16), _Attn(), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.attn(self.inp(x))).mean(dim=(1, 2))


def _qk_clip_worker(rank, world, port, out_dir):
    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_AttnNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = {"console": False, "watch": {"stride": 1, "attention": {"tau": 2.0}}}
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config=cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):
        x, y = torch.randn(8, 5, 4, generator=g) * 3, torch.randn(8, generator=g)
        x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]  # each rank its half
        mon.combine((model(x) - y).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    clips = [(e.step, e.data["action_results"]["qk_clip"].get("applied")) for e in mon.events if "qk_clip" in e.actions]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save({"clips": clips, "params": flat}, os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_qk_clip_under_ddp_is_the_same_on_every_rank(tmp_path):
    """Each rank holds a full copy of the weights and sees its own half of the batch: a clip
    sized from what one rank re-measures on its own input would scale the copies apart (DDP only
    averages gradients, so they would never come back together)."""
    mp.spawn(_qk_clip_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["clips"] and r0["clips"] == r1["clips"]
    assert torch.equal(r0["params"], r1["params"])


def _alone_worker(rank, world, port, out_dir):
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    if rank == 0:  # an auxiliary model only rank 0 trains, its monitor this process's alone
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        cfg = {"console": False, "distributed": False, "watch": {"stride": 1}}
        mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, "aux"), config=cfg)
        g = torch.Generator().manual_seed(1)
        for step in range(6):
            loss = model(torch.randn(5, 4, generator=g)).pow(2).mean()
            if step == 3:
                loss = loss + torch.tensor(float("nan"))
            mon.combine(loss).backward()
            opt.step()
            opt.zero_grad()
        mon.observe_eval({"loss": 1.0})
        mon.detach()
        torch.save({"events": [(e.step, e.kind, e.actions) for e in mon.events], "steps": mon.step}, f"{out_dir}/r0.pt")
    dist.barrier()  # rank 1 waits here (it attached nothing) while rank 0 trains
    _leave()


def test_a_monitor_alone_on_one_rank_needs_no_other_rank(tmp_path):
    """A model only rank 0 trains, under a process group of 2: its monitor joined collectives that
    rank 1 never entered and rank 0 waited in its first step until the group's timeout (30 min by
    default). With ``distributed: false`` it is this process's alone: no collective, its own files."""
    mp.spawn(_alone_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "r0.pt")
    assert r0["steps"] == 6 and r0["events"] == [(3, "nonfinite_loss", ["skip_step"])]
    assert (tmp_path / "aux" / "events.jsonl").exists() and (tmp_path / "aux" / "summary.json").exists()


def _ddp_mlp(rank, world, port):
    """Joins the group; a small DDP MLP under SGD and its monitor (the same on every rank)."""
    _join(rank, world, port)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    return model, opt, sfmonitor.attach(model, opt, sinks=[], config={"console": False})


def _forgetful_worker(rank, world, port, out_dir):
    model, opt, mon = _ddp_mlp(rank, world, port)
    for step in range(4):
        if rank == 0 or step >= 2:  # rank 1's loop forgets zero_grad() before step 1 only
            opt.zero_grad()
        x = torch.randn(5, 4)
        mon.combine(model(x).pow(2).mean()).backward()
        opt.step()
    torch.save([(e.step, e.kind) for e in mon.events], os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_one_rank_forgetting_zero_grad_is_told_on_every_rank(tmp_path):
    mp.spawn(_forgetful_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0 == r1 == [(1, "zero_grad_missing")]


def _announcing_worker(rank, world, port, out_dir):
    """A task switch at step 20 that rank 0's loop alone announces (its code under ``rank == 0``)."""
    model, opt, mon = _ddp_mlp(rank, world, port)
    g = torch.Generator().manual_seed(rank)
    for step in range(30):
        if step == 20 and rank == 0:
            mon.new_regime("stage 2")
        x = torch.randn(16, 4, generator=g)
        target = (x.sum(1, keepdim=True) * (30.0 if step >= 20 else 1.0)).tanh() * (30.0 if step >= 20 else 1.0)
        mon.combine((model(x) - target).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
    events = [(e.step, e.kind, e.actions, e.data.get("reason")) for e in mon.events]
    torch.save({"events": events, "detectors": mon.state_dict()["detectors"]}, os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_a_change_of_data_one_rank_announces_applies_on_every_rank(tmp_path):
    """The announce rides in the step's reduction (a maximum): every rank's detectors learn afresh
    in the same step, none is skipped, and their state stays alike (a rank whose detectors alone
    forgot would decide otherwise, and the ranks would part)."""
    mp.spawn(_announcing_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == [(20, "new_regime", [], "stage 2")]
    assert r1["events"] == [(20, "new_regime", [], "")]
    assert r0["detectors"] == r1["detectors"]


def _causes_worker(rank, world, port, out_dir):
    """Two named losses whose weights rank 0's loop alone changes at step 20 (0 -> 10 on the
    second), every 8th batch a short one (2 of 16 rows) on every rank, and rank 0's loop alone
    writing a weight in place before step 30 (x1.5: a change larger than the update; rank 1's
    weights stay as they were): what the reduced values say."""
    model, opt, mon = _ddp_mlp(rank, world, port)
    g = torch.Generator().manual_seed(rank)
    for step in range(40):
        if step == 30 and rank == 0:
            with torch.no_grad():
                next(model.parameters()).mul_(1.5)
        x = torch.randn(2 if step % 8 == 7 else 16, 4, generator=g)
        out = model(x)
        parts = {"fit": (out - x.sum(1, keepdim=True).tanh()).pow(2).mean(), "aux": out.pow(2).mean() + 1.0}
        weights = {"fit": 1.0, "aux": 10.0 if (step >= 20 and rank == 0) else 0.0}
        mon.combine(parts, weights).backward()
        opt.step()
        opt.zero_grad()
    events = [(e.step, e.kind, e.actions) for e in mon.events]
    torch.save({"events": events, "detectors": mon.state_dict()["detectors"]}, os.path.join(out_dir, f"rank{rank}.pt"))
    mon.detach()
    _leave()


def test_a_loss_reweighted_and_short_batches_are_judged_alike_on_every_rank(tmp_path):
    """The total at the weights before a change, and each batch's size, ride in the step's
    reduction: a change of weights one rank's loop makes is a new loss on every rank in the same
    step, a short batch widens every rank's tests alike, a parameter one rank's loop writes between
    two steps is a new regime on every rank, and the detectors' states stay equal."""
    mp.spawn(_causes_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"] == [(20, "new_regime", []), (30, "new_regime", [])]
    assert r0["detectors"] == r1["detectors"]


class _Branches(nn.Module):
    """Rank 0 runs branch ``b``, rank 1 branch ``c`` (a mixture-of-experts routing no token to an
    expert on a rank); ``c``'s weights are large, so its activations are."""

    def __init__(self, scale=1000.0):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 3), nn.Linear(6, 3), nn.Linear(6, 3)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        with torch.no_grad():
            self.c.weight.mul_(scale)

    def forward(self, x):
        branch = self.b if dist.get_rank() == 0 else self.c
        out = self.a(x) + 1e-3 * branch(x)
        if dist.get_rank() == 1:  # the attention module runs on rank 1 only
            seq = x.reshape(x.shape[0], 2, 3).repeat(1, 1, 2)
            out = out + 1e-3 * self.attn(seq, seq, seq, need_weights=False)[0].mean(1)[:, :3]
        return out


def _branches_worker(rank, world, port, out_dir, half=False):
    _join(rank, world, port)
    torch.manual_seed(0)
    net = _Branches(30000.0).half() if half else _Branches()
    model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {"console": False, "watch": {"stride": 1}}
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config=cfg)
    true = {}
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step + 10 * rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        x, y = (x.half(), y.half()) if half else (x, y)
        with torch.no_grad():
            true["b" if rank == 0 else "c"] = (model.module.b if rank == 0 else model.module.c)(x).abs().max().item()
            if rank == 1 and not half:  # the attention entropy rank 1 alone measures (heads' mean)
                seq = x.reshape(x.shape[0], 2, 3).repeat(1, 1, 2)
                w = model.module.attn(seq, seq, seq, need_weights=True, average_attn_weights=False)[1]
                true["entropy"] = -(w * w.clamp_min(1e-30).log()).sum(-1).mean().item()
        mon.combine(nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    stats = {k: v for k, v in mon.stats.items() if k.startswith(("act_absmax/", "attn_"))}
    events = [(e.step, e.kind, e.actions, e.data.get("module")) for e in mon.events]
    torch.save({"stats": stats, "true": true, "events": events}, f"{out_dir}/r{rank}.pt")
    mon.detach()
    _leave()


def test_watched_modules_that_run_on_some_ranks_only_are_read_alike_on_every_rank(tmp_path):
    """The watch gave the maxima of the modules that ran on this rank, and the step's values are
    one all-reduce by position: where ranks ran different modules the job aborted inside gloo (a
    count differing), or, with as many on each, one rank's maxima were read as another module's
    (rank 0 logged branch b at 1153, c's maximum on rank 1; under fp16 each rank fell back to
    fp32 a different module). Under a process group the watch gives every watched module a value,
    one that no maximum is below where it did not run, so every rank reads every module's
    maximum over the ranks that ran it, and a module no rank ran has no value."""
    mp.spawn(_branches_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in (0, 1))
    assert r0["stats"] == r1["stats"] and r0["events"] == r1["events"] == []
    assert r0["stats"]["act_absmax/b"] == pytest.approx(r0["true"]["b"], rel=1e-5)
    assert r0["stats"]["act_absmax/c"] == pytest.approx(r1["true"]["c"], rel=1e-5)
    assert "attn_logit_max/attn" in r0["stats"]
    # the mean over the ranks that ran the module (rank 1's own), not over every rank
    assert r0["stats"]["attn_entropy/attn"] == pytest.approx(r1["true"]["entropy"], rel=1e-4)


def test_a_module_near_the_fp16_limit_on_one_rank_is_judged_alike_on_every_rank(tmp_path):
    """The same, in fp16, branch c's activations near the fp16 limit on rank 1: rank 1 judged it
    (activation_overflow, then its rescue) and rank 0, which never ran c, knew no dtype for it and
    judged nothing: the ranks took different actions. The dtype behind each maximum is agreed too."""
    mp.spawn(_branches_worker, args=(2, _free_port(), str(tmp_path), True), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"] and r0["events"]
    assert {module for *_, module in r0["events"]} == {"c"}


# --------------------------------------------------------------------------------------------
# ZeroRedundancyOptimizer (ZeRO-1): each rank holds its shard of the optimizer state in its inner
# optimizer (opt.optim); opt.state_dict() is refused until every rank called consolidate_state_dict
# --------------------------------------------------------------------------------------------

ZERO_BAD = 2  # the step with a NaN loss on rank 1 in the rollback and checkpoint runs


def _zero_run():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)))
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)


def _zero_step(model, opt, mon, i, rank, nan_loss=False, nan_input=False, lr_scale=1.0):
    g = torch.Generator().manual_seed(1000 * rank + i)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    if nan_input:
        x[0, 0] = float("nan")
    loss = nn.functional.mse_loss(model(x), y)
    if nan_loss:
        loss = loss * torch.tensor(float("nan"))
    (mon.combine(loss) if mon is not None else loss).backward()
    opt.param_groups[0]["lr"] *= lr_scale
    opt.step()
    opt.param_groups[0]["lr"] /= lr_scale
    opt.zero_grad()


def _zero_state(model, opt):
    """This rank's parameters (all of them: DDP) and its shard of the optimizer state, by position."""
    from sfmonitor.checkpoint import params_of

    params = [p.detach().clone() for p in model.parameters()]
    inner = opt.optim.state
    return params, [{k: v.clone() for k, v in inner[p].items()} for p in params_of(opt.optim) if p in inner]


def _same_state(a, b):
    (pa, sa), (pb, sb) = a, b
    return (
        len(pa) == len(pb)
        and all(torch.equal(x, y) for x, y in zip(pa, pb))
        and len(sa) == len(sb)
        and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))
    )


def _zero_twin_worker(rank, world, port, out_dir, n, nan_at, spike_at):
    """The monitored run (a NaN input on rank 1 at ``nan_at``, an update at 1e4 x the LR at
    ``spike_at``), then its bare twin that never saw those two steps."""
    from sfmonitor.checkpoint import INNER, OPTIMIZER, params_of

    _join(rank, world, port)
    model, opt = _zero_run()
    cfg = {"console": False, "actions": {"rollback": {"snapshot_every": 10}}}
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config=cfg)
    shard_bytes = sum(p.numel() * p.element_size() for p in params_of(opt.optim))
    estimate = (mon.memory["optimizer_state_bytes"], 2 * shard_bytes)  # AdamW's two moments of the shard
    spiked = False
    for i in mon.batches(range(n)):  # (the batch of the step an undo skipped comes again)
        spike, spiked = i == spike_at and not spiked, spiked or i == spike_at
        _zero_step(model, opt, mon, i, rank, nan_input=i == nan_at and rank == 1, lr_scale=1e4 if spike else 1)
    snaps = mon._live().snapshots
    _, snap = snaps.latest_before(n)
    held = {"kept": len(snaps), "optimizer": OPTIMIZER in snap, "inner": [len(s) for s in snap.get(INNER, [])]}
    events = [(e.step, e.kind, e.actions) for e in mon.events]
    mon.detach()
    state = _zero_state(model, opt)
    twin, twin_opt = _zero_run()
    for i in range(n):
        if i not in (nan_at, spike_at):
            _zero_step(twin, twin_opt, None, i, rank)
    torch.save(
        {
            "events": events,
            "held": held,
            "estimate": estimate,
            "shard": len(params_of(opt.optim)),
            "same": _same_state(state, _zero_state(twin, twin_opt)),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    _leave()


def _zero_twin(tmp_path, n, nan_at=None, spike_at=None):
    mp.spawn(_zero_twin_worker, args=(2, _free_port(), str(tmp_path), n, nan_at, spike_at), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]


def test_a_healthy_zero_run_is_bit_identical_to_the_bare_run_on_every_rank(tmp_path):
    """Under ZeroRedundancyOptimizer the first snapshot called its state_dict(), which is refused
    until every rank consolidated: the run stopped at its first step. A snapshot holds this rank's
    shard of the optimizer state (its inner optimizer's), not the wrapper's state_dict."""
    r0, r1 = _zero_twin(tmp_path, 60)
    assert r0["events"] == r1["events"] and not [e for e in r0["events"] if e[2]], r0["events"]
    for r in (r0, r1):
        assert r["same"]
        assert r["held"] == {"kept": 3, "optimizer": False, "inner": [r["shard"]]}
        assert r["estimate"][0] == r["estimate"][1] > 0  # the attach-time estimate: this rank's shard (was "?")
    assert r0["shard"] + r1["shard"] == 4  # each rank its own part of the 4 parameters


def test_a_zero_run_skips_a_nan_batch_and_undoes_a_bad_update_like_its_twin(tmp_path):
    r0, r1 = _zero_twin(tmp_path, 30, nan_at=7, spike_at=15)
    assert r0["events"] == r1["events"]
    acted = {s: a for s, _, a in r0["events"] if a}
    assert "skip_step" in acted[7] and "undo" in acted[15], r0["events"]
    assert r0["same"] and r1["same"]  # bit-identical to the twin that never saw steps 7 and 15


def _zero_rollback_worker(rank, world, port, out_dir):
    from sfmonitor.checkpoint import params_of

    _join(rank, world, port)
    model, opt = _zero_run()
    cfg = {
        "console": False,
        "actions": {"rollback": {"snapshot_every": 1, "skip_batches": 0}},
        "policy": {"ladders": {"nonfinite_loss": {"rungs": [{"after": 1, "actions": ["rollback"]}]}}},
    }
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, str(rank)), sinks=[], config=cfg)
    starts = []
    for i in range(4):
        starts.append(_zero_state(model, opt))
        _zero_step(model, opt, mon, i, rank, nan_loss=i == ZERO_BAD and rank == 1)
        if i == ZERO_BAD:
            after = _zero_state(model, opt)
    events = [(e.step, e.kind, e.actions, e.data["action_results"].get("rollback")) for e in mon.events if e.actions]
    mon.detach()
    torch.save(
        {
            "events": events,
            "back": _same_state(after, starts[ZERO_BAD - 1]),
            "moved": not _same_state(starts[ZERO_BAD], starts[ZERO_BAD - 1]),
            "shard": [tuple(p.shape) for p in params_of(opt.optim)],
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    _leave()


def test_a_zero_rollback_restores_every_ranks_shard_of_the_optimizer_state(tmp_path):
    mp.spawn(_zero_rollback_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"]
    [(step, kind, actions, result)] = r0["events"]
    assert (step, kind, actions) == (ZERO_BAD, "nonfinite_loss", ["rollback"])
    assert result["restored"] is True and result["restored_from"] == ZERO_BAD - 1
    for r in (r0, r1):
        assert r["moved"] and r["back"]  # the state step 1 started from, this rank's shard included
    assert r0["shard"] != r1["shard"]  # each rank restored its own shard, not a copy of one


def _zero_checkpoint_worker(rank, world, port, out_dir):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from sfmonitor import actions as A
    from sfmonitor.events import UPDATE_RATIO_SPIKE, Decision, Finding
    from sfmonitor.forensics import load_manifest

    _join(rank, world, port)
    model, opt = _zero_run()
    cfg = {
        "console": False,
        "actions": {"rollback": {"snapshot_every": 1}},
        "policy": {
            "ladders": {"nonfinite_loss": {"rungs": [{"after": 1, "actions": ["checkpoint", "skip_step"]}]}},
            "cooldowns": {"checkpoint": 0},
        },
    }
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out_dir, "run"), sinks=[], config=cfg)  # rank 0 writes
    for i in range(4):
        if i == ZERO_BAD:
            start = _zero_state(model, opt)
        _zero_step(model, opt, mon, i, rank, nan_loss=i == ZERO_BAD and rank == 1)
    [event] = [e for e in mon.events if e.actions]
    # from a snapshot (a landed update): each rank's snapshot holds its own shard, no rank the whole
    ctx = mon._live()
    ctx.step = mon.step
    landed = Finding(UPDATE_RATIO_SPIKE, "a landed update", step=mon.step - 1, before_update=False)
    from_snapshot = A.checkpoint(ctx, Decision("checkpoint", landed))
    # a checkpoint, then stop in the same step: rank 1 (it wrote none) runs stop's checkpoint too,
    # rank 0 not; the consolidation, a collective, must run once on both (it waited forever)
    ctx.step += 1
    seen = Finding("nonfinite_loss", "a loss")
    A.checkpoint(ctx, Decision("checkpoint", seen))
    with pytest.raises(sfmonitor.StopTraining):
        A.stop(ctx, Decision("stop", seen))
    mon.detach()
    live = [event.data["action_results"]["checkpoint"]]
    dist.broadcast_object_list(live)  # where rank 0 wrote
    sd = torch.load(live[0]["path"], weights_only=True)
    fresh, _ = _zero_run()
    fresh.module.load_state_dict(sd["model"])
    fresh_opt = ZeroRedundancyOptimizer(fresh.parameters(), optimizer_class=torch.optim.AdamW, lr=1.0)
    fresh_opt.load_state_dict(sd["optimizer"])
    out = {
        "actions": event.actions,
        "result": event.data["action_results"]["checkpoint"],
        "loaded": _same_state(_zero_state(fresh, fresh_opt), start),
        "lr": fresh_opt.param_groups[0]["lr"],
        "from_snapshot": from_snapshot,
    }
    if rank == 0:
        out["snapshot_file"] = sorted(torch.load(from_snapshot["path"], weights_only=True))
        manifest = load_manifest(event.data["bundle"]) if "bundle" in event.data else {}
        out["bundle"] = (event.data.get("bundle_error"), sorted(manifest.get("files", {})), manifest.get("dropped"))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def test_a_zero_emergency_checkpoint_holds_every_ranks_shard_and_loads_into_a_fresh_zero(tmp_path):
    """Rank 0 saves the consolidated optimizer state (every rank consolidates first, in the same
    step); each rank's fresh ZeroRedundancyOptimizer loads its shard back from the one file. A
    checkpoint from a snapshot has no consolidated state: it holds the model and says so."""
    mp.spawn(_zero_checkpoint_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["actions"] == r1["actions"] == ["skip_step", "checkpoint"]
    assert r0["result"]["saved"] and r0["result"]["source"] == "live" and "optimizer_state" not in r0["result"]
    assert r1["result"]["saved"] is False
    for r in (r0, r1):
        assert r["loaded"] and r["lr"] == 1e-2  # the file's state, this rank's shard of it
    snap = r0["from_snapshot"]
    assert snap["saved"] and snap["source"].startswith("snapshot@")
    assert snap["optimizer_state"].startswith("omitted: ")
    assert r0["snapshot_file"] == ["extra", "model", "rng"]
    error, files, dropped = r0["bundle"]  # the anomaly bundle: the model, without the optimizer state
    assert error is None and "model" in files and "optimizer" not in files and "optimizer" in dropped


def _capped_worker(rank, world, port, out_dir):
    """A DDP loop that skips any step whose (all-reduced) gradient norm is over its cap; an update
    at 1e4x the LR at iteration 10 makes every gradient after it exceed the cap."""
    _join(rank, world, port)
    out = {}
    for monitored, drop in ((True, ()), (False, (10, 11))):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mon = sfmonitor.attach(model, opt, sinks=[], config={"console": False}) if monitored else None
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(24):
            x = torch.randn(8, 4, generator=g)
            if i in drop:
                continue
            loss = (model(x) - x[:, :1]).pow(2).mean()
            (mon.combine(loss) if mon else loss).backward()
            if not torch.stack([p.grad.norm() for p in model.parameters()]).norm() < 100:
                model.zero_grad()  # the loop's own check
                continue
            opt.param_groups[0]["lr"] = 1e-2 * (1e4 if i == 10 else 1)
            opt.step()
            opt.zero_grad()
        out["mon" if monitored else "twin"] = torch.cat([p.detach().flatten() for p in model.parameters()])
        if mon is not None:
            out["events"] = [(e.step, e.kind, e.actions) for e in mon.events]
            mon.detach()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def test_a_bad_update_the_loops_own_check_hides_is_undone_on_every_rank_alike(tmp_path):
    """Under DDP the step the loop skips judges the update before it by its update ratios alone
    (the same on every rank): every rank undoes it at the same step, and the run goes on as the
    one without those two batches."""
    mp.spawn(_capped_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["events"] == r1["events"] and any("undo" in a for _, _, a in r0["events"]), r0["events"]
    assert torch.equal(r0["mon"], r1["mon"]) and torch.equal(r0["mon"], r0["twin"])
