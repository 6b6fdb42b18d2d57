"""Tensor parallel (``parallelize_module``: Colwise/Rowwise DTensor parameters), 2-D FSDP2 + TP, and
ranks whose monitors would reduce different statistics (pipeline stages): gloo, CPU.

Every worker builds the same model, parallelizes it, and trains bare and monitored on the same
batches (every rank of a tensor-parallel group sees the whole batch). Results come back through
files in tmp_path and are compared in the test process (no process group there).
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from _integration_helpers import free_port, join_gloo, needs_fsdp2_on_cpu
from _integration_helpers import leave_process_group as _leave
from torch import nn
from torch.nn import functional as F

import sfmonitor

tp = pytest.importorskip("torch.distributed.tensor.parallel")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # pragma: no cover - torch < 2.6
    pytest.skip("FSDP2's public fully_shard needs torch >= 2.6", allow_module_level=True)


def _join(rank, port, world):
    join_gloo(rank, world, port, timeout_s=120)


def _run(worker, tmp_path, world, *args):
    os.makedirs(tmp_path, exist_ok=True)
    mp.spawn(worker, args=(free_port(), str(tmp_path), world, *args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


class Attention(nn.Module):
    """Causal self-attention as torchtitan writes it for tensor parallelism: the heads a rank holds
    follow from its projections' local width (``view(b, t, -1, head_dim)``)."""

    def __init__(self, d=16, head_dim=4):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn, self.mlp, self.head = nn.Linear(6, 16), Attention(), MLP(), nn.Linear(16, 3)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.attn(h)
        return self.head(h + self.mlp(h))


PLAN = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
}


def _net():
    torch.manual_seed(0)
    return Net()


def _parallel(mesh, dp_mesh=None):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _net()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[s]() for name, s in PLAN.items()})
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in (model.attn, model.mlp):
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 3, generator=g)) for _ in range(n)]


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _quiet(**extra):
    return {"console": False, **extra}


def _train(model, opt, batches, mon=None, part=lambda b: b):
    stats = []
    for batch in batches:
        x, y = part(batch)
        loss = F.mse_loss(model(x), y)
        (mon.combine(loss) if mon is not None else loss).backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            stats.append(mon.stats)
    return stats


# --------------------------------------------------------------------------------------------
# tensor parallel, at the defaults (the activation watch and QK-Clip on)
# --------------------------------------------------------------------------------------------


def _tp_worker(rank, port, out, world):
    from torch.distributed.device_mesh import init_device_mesh

    _join(rank, port, world)
    mesh = init_device_mesh("cpu", (world,))
    batches = _batches(12)
    bare = _parallel(mesh)
    opt = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    _train(bare, opt, batches)
    model = _parallel(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=["jsonl"], config=_quiet())
    stats = _train(model, opt, batches, mon)
    events = [(e.step, e.kind, list(e.actions)) for e in mon.events]
    mon.detach()
    result = {
        "stats": stats,
        "events": events,
        "bare": {n: _full(p) for n, p in bare.named_parameters()},
        "monitored": {n: _full(p) for n, p in model.named_parameters()},
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def _reference(run_dir, steps):
    """The same model, whole, in this process: what every statistic should read."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=run_dir, sinks=["jsonl"], config=_quiet())
    stats = _train(model, opt, _batches(steps), mon)
    mon.detach()
    return stats


def test_tensor_parallel_at_the_defaults_trains_as_bare_and_reads_the_whole_models_norms(tmp_path):
    """The watch met DTensor activations (TP's hooks hand them to a module's forward) and the step's
    read raised ``aten.cat.default got mixed torch.Tensor and DTensor`` at the first step."""
    r0, r1 = _run(_tp_worker, tmp_path, 2)
    for r in (r0, r1):
        assert r["events"] == []
        for n, p in r["bare"].items():
            assert torch.equal(r["monitored"][n], p), n
    assert r0["stats"] == r1["stats"]  # one decision: every rank reads the same numbers
    ref = _reference(str(tmp_path / "ref"), 12)
    # the watch measured step 0: every module's largest activation, the attention's largest logit
    # (per head only where the module tells its head count: a rank holds half of them)
    sampled = [k for k in ref[0] if k.startswith("act_absmax/")] + ["attn_logit_max/attn"]
    assert len(sampled) > 5 and all(k in r0["stats"][0] for k in sampled)
    for key in sampled:
        assert r0["stats"][0][key] == pytest.approx(ref[0][key], rel=1e-5), key
    for got, want in zip(r0["stats"], ref):
        for key in [k for k in want if k.startswith(("grad_norm/", "param_norm/"))]:
            assert got[key] == pytest.approx(want[key], rel=1e-4), key
    # (update ratios reach the sinks with the next step's read under a process group)
    for got, want in zip(_metrics(tmp_path / "run")[:11], _metrics(tmp_path / "ref")):
        keys = [k for k in want if k.startswith("update_ratio/")]
        assert keys and all(got[k] == pytest.approx(want[k], rel=1e-4) for k in keys)


# --------------------------------------------------------------------------------------------
# 2-D: FSDP2 over TP
# --------------------------------------------------------------------------------------------


def _two_d_worker(rank, port, out, world):
    from torch.distributed.device_mesh import init_device_mesh

    _join(rank, port, world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _parallel(mesh["tp"], dp_mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    dp = mesh["dp"].get_local_rank()
    stats = _train(model, opt, _batches(3), mon, part=lambda b: (b[0][dp * 2 : dp * 2 + 2], b[1][dp * 2 : dp * 2 + 2]))
    mon.detach()
    torch.save({"stats": stats}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


@needs_fsdp2_on_cpu
def test_fsdp2_over_tensor_parallel_reads_the_whole_models_norms(tmp_path):
    """FSDP2 on top of a Colwise ``Shard(0)`` places ``_StridedShard(0)`` on the data-parallel mesh
    dimension, which is no ``Shard``: its norms read 1/sqrt(2) of the truth (param_norm 2.43 for
    3.44), and the clip scaled by them."""
    runs = _run(_two_d_worker, tmp_path, 4)
    assert all(r["stats"] == runs[0]["stats"] for r in runs)
    ref = _reference(str(tmp_path / "ref"), 3)
    for got, want in zip(runs[0]["stats"], ref):
        keys = [k for k in want if k.startswith(("grad_norm/", "param_norm/"))]
        assert len(keys) == 9 and all(got[k] == pytest.approx(want[k], rel=1e-4) for k in keys)


# --------------------------------------------------------------------------------------------
# gradient noise keeps replicas alike
# --------------------------------------------------------------------------------------------


def _noise_worker(rank, port, out, world):
    from torch.distributed.device_mesh import init_device_mesh

    from sfmonitor import actions as A
    from sfmonitor.events import Decision, Finding

    _join(rank, port, world)
    mesh = init_device_mesh("cpu", (world,))
    model = _parallel(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    x, y = _batches(1)[0]
    F.mse_loss(model(x), y).backward()
    ctx = mon._live()
    ctx.step = 3
    facts = A.grad_noise(ctx, Decision("grad_noise", Finding("loss_spike", "test")))
    grads = {
        n: p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
        for n, p in model.named_parameters()
    }
    placements = {n: str(getattr(p, "placements", "plain")) for n, p in model.named_parameters()}
    mon.detach()
    torch.save({"grads": grads, "placements": placements, "facts": facts}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_gradient_noise_is_the_same_on_ranks_that_hold_the_same_values(tmp_path):
    """A Replicate DTensor (RowwiseParallel's bias) got each rank's own noise: the copies that must
    stay equal drifted apart (0.0085 after one noisy step). Shards still get their own."""
    r0, r1 = _run(_noise_worker, tmp_path, 2)
    assert r0["facts"].get("applied", True) is not False
    for n, g in r0["grads"].items():
        if "Shard" in r0["placements"][n]:
            assert not torch.equal(g, r1["grads"][n]), n  # a shard: its own noise
        else:
            assert torch.equal(g, r1["grads"][n]), n  # replicated (DTensor or plain): alike
    assert any("Replicate" in p for p in r0["placements"].values())


# --------------------------------------------------------------------------------------------
# ranks that would reduce different statistics
# --------------------------------------------------------------------------------------------


def _stages_worker(rank, port, out, world, same_length):
    from collections import OrderedDict

    _join(rank, port, world)
    torch.manual_seed(rank)
    names = ("inp", "a") if rank == 0 else (("mid", "b") if same_length else ("mid", "b", "out"))
    model = nn.Sequential(OrderedDict((n, nn.Linear(4, 4)) for n in names))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = _quiet(watch={"enabled": False}, stats={"dead_units_every": 0})
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=cfg)
    error = None
    try:
        for _ in range(2):
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except sfmonitor.ConfigError as e:
        error = str(e)
    mon.detach()
    torch.save({"error": error, "steps": mon.step}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


@pytest.mark.parametrize("same_length", [False, True])
def test_ranks_with_different_statistics_are_a_config_error_on_every_rank(tmp_path, same_length):
    """Pipeline stages (each rank a different module) reduced their statistics by position: gloo
    aborted the job when the vectors' lengths differed ("Received data size doesn't match"), and
    when they matched, every rank logged a blend of the stages under its own names."""
    runs = _run(_stages_worker, tmp_path, 2, same_length)
    for r in runs:
        assert r["error"] is not None and "different statistics" in r["error"], r["error"]
        assert "pipeline" in r["error"]


def _late_worker(rank, port, out, world):
    _join(rank, port, world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = sfmonitor.attach(model, opt, run_dir=os.path.join(out, "run"), sinks=[], config=_quiet())
    error, at = None, None
    try:
        for step in range(8):
            y = model(torch.randn(8, 4))
            # from step 3 on rank 1 names its second component otherwise: as many values, other keys
            second = "aux" if rank == 1 and step >= 3 else "reg"
            mon.combine({"main": y[:, 0].square().mean(), second: y[:, 1].square().mean()}).backward()
            at = step
            opt.step()
            opt.zero_grad()
    except sfmonitor.ConfigError as e:
        error = str(e)
    mon.detach()
    torch.save({"error": error, "at": at}, os.path.join(out, f"rank{rank}.pt"))
    _leave()


def test_ranks_whose_statistics_part_later_are_a_config_error_on_every_rank(tmp_path):
    """A regression probe of the layout check: it ran where this rank's layout was new, so a rank
    whose components changed after the ranks had agreed checked alone while the other reduced, and
    gloo aborted the job ("72 vs 8"). The check at the first read is the same on every rank; after
    it, each step's reduction carries its keys' signature."""
    runs = _run(_late_worker, tmp_path, 2)
    for r in runs:
        assert r["error"] is not None and "different statistics" in r["error"] and r["at"] == 3, r
